"""loom.jsonin: the strict JSON reader and the declarative field specs."""
import json
import math
import sys

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from loom.jsonin import (
    MAX_INT_DIGITS, Any_, Arr, Bool, Enum, Int, JSONInputError, Map, Null, Num, Obj,
    OneOf, Str, Tagged, loads, parse,
)

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def rejects(data, code="invalid_json", param=None, match=None, **kw):
    with pytest.raises(JSONInputError) as info:
        loads(data, **kw)
    err = info.value
    assert (err.code, err.param) == (code, param), repr(err)
    if match is not None:
        assert match in err.message, err.message
    return err


def same(a, b):
    """Equal, with JSON types equal too (1 vs 1.0 vs True differ)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# --------------------------------------------------------------------------
# loads: accepted input
# --------------------------------------------------------------------------

VALID = [
    b'{}', b'[]', b'0', b'-0', b'-0.0', b'1.5e3', b'1E-2', b'123456789012345678901234567890',
    b'true', b'false', b'null', b'"text"', b'  \t\r\n {"a" : [1, 2.0, "x", null, true]}\n',
    b'{"model":"scout","messages":[{"role":"user","content":"What is 2+2?"}],"stream":true}',
    '{"emoji":"😀","cjk":"日本語","nbsp":"\u00a0"}'.encode(),
    b'"\\ud83d\\ude00 \\uD83D\\uDE00"',  # escaped surrogate pairs, any hex case
    b'"\\\\ud800"',  # an escaped backslash then literal text: no surrogate at all
    b'"\\u0000\\u001f\\n\\t\\"\\\\\\/\\b\\f\\r"',  # escaped control characters are fine
    b'{"":1, "a b":2, "\\u0061\\u0062":3}',
    b'[' * 64 + b']' * 64,
    b'"' + b'[' * 1000 + b'"',  # brackets inside strings are not nesting
    b'1' * MAX_INT_DIGITS,
    b'{"a":{"b":1},"c":{"b":2}}',  # equal keys in different objects
]


@pytest.mark.parametrize("data", VALID)
def test_valid_documents_match_the_stdlib(data):
    assert same(loads(data), json.loads(data))


def test_numbers_keep_their_kind():
    value = loads(b'[1, -2, 1.0, 2e0, 10000000000000000000000, 0.1]')
    assert [type(v) for v in value] == [int, int, float, float, int, float]


def test_bytes_likes_are_accepted_and_str_is_a_type_error():
    assert loads(bytearray(b'{"a":1}')) == {"a": 1}
    assert loads(memoryview(b'xx[1]')[2:]) == [1]
    with pytest.raises(TypeError):
        loads('{"a":1}')


def test_custom_depth():
    assert loads(b'[[1]]', max_depth=2) == [[1]]
    rejects(b'[[[1]]]', max_depth=2, match="deeper than 2")
    rejects(b'{"a":{"b":{}}}', max_depth=2)
    assert loads(b'1', max_depth=0) == 1


# --------------------------------------------------------------------------
# loads: rejections
# --------------------------------------------------------------------------

@pytest.mark.parametrize("data", [
    b'"\xff"', b'"\xc0\xaf"',            # invalid byte, overlong encoding
    b'"\xed\xa0\x80"',                    # a surrogate encoded directly in UTF-8
    b'"\xe2\x82"', b'"\xf4\x90\x80\x80"',  # truncated sequence, beyond U+10FFFF
    b'\x00\x7b\x00\x7d',                  # UTF-16 is not UTF-8 JSON
])
def test_malformed_utf8(data):
    rejects(data)


def test_malformed_utf8_says_where():
    err = rejects(b'{\n  "a": "ok",\n  "b": "\xff"}')
    assert "line 3 column 9" in err.message and "UTF-8" in err.message


def test_bom():
    rejects(b'\xef\xbb\xbf{}', match="byte order mark")


@pytest.mark.parametrize("data", [b'', b' ', b'\n\t\r '])
def test_empty_body(data):
    rejects(data, match="empty")


@pytest.mark.parametrize("data", [
    b'{"a":1,}', b'[1,]', b'[1,,2]', b'{,}',                       # trailing / stray commas
    b'// c\n{}', b'{} // c', b'/* c */ {}', b'{"a":1 /* c */}', b'# c\n{}',  # comments
    b'{} {}', b'[1] x', b'1 2', b'{"a":1}}', b'"a" "b"',               # trailing garbage
    b"{'a':1}", b'{a:1}', b'[True]', b'[None]', b'[undefined]',          # not JSON
    b'01', b'+1', b'.5', b'1.', b'0x10', b'1e', b'-', b'--1', b'1_000',  # bad numbers
    '[1\u0662]'.encode(), '\u0661'.encode(),                           # non-ASCII digits
    b'\x0c{}', '\u00a0{}'.encode(), b'{}\x0b',                         # non-JSON whitespace
    b'"abc', b'{"a":', b'[', b'{"a" 1}', b'"\\x41"', b'"\\u12"', b'"\\u12g4"',
])
def test_syntax_errors(data):
    rejects(data)


def test_syntax_errors_say_where():
    err = rejects(b'{\n  "a": tru\n}')
    assert "line 2 column 8" in err.message
    assert "line 1 column 8" in rejects(b'{"a":1,}').message


@pytest.mark.parametrize("data", [
    b'"a\x00b"', b'"\x1f"', b'"line\nbreak"', b'"tab\there"', b'{"k\x01":1}', b'["ok", "\x7f\x08"]',
])
def test_raw_control_characters_in_strings(data):
    rejects(data, match="control character")


@pytest.mark.parametrize("data", [
    b'NaN', b'[NaN]', b'Infinity', b'{"t": -Infinity}', b'[1, Infinity]',
])
def test_nonfinite_constants(data):
    rejects(data, match="not a JSON number")


@pytest.mark.parametrize("data", [
    b'1e400', b'[-1e400]', b'1' * 400 + b'.0', b'{"x": 1.8e308}', b'1' * 250 + b'e99',
])
def test_numbers_that_overflow_to_infinity(data):
    rejects(data, match="out of range")


def test_absurd_integer_digit_counts():
    rejects(b'1' * (MAX_INT_DIGITS + 1), match="digits")
    rejects(b'[-' + b'9' * 100000 + b']', match="digits")
    rejects(b'{"a": [' + b'1' * 5000 + b']}', match="digits")


@pytest.mark.skipif(not hasattr(sys, "set_int_max_str_digits"), reason="no interpreter digit limit")
@pytest.mark.parametrize("limit", [0, 1000, 100000])
def test_digit_bound_holds_whatever_the_interpreter_limit(limit):
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(limit)
    try:
        bound = limit if 0 < limit <= MAX_INT_DIGITS else MAX_INT_DIGITS
        assert loads(b'[-' + b'7' * bound + b']') == [-int('7' * bound)]
        rejects(b'[' + b'7' * (bound + 1) + b']', match=f"more than {bound} digits")
    finally:
        sys.set_int_max_str_digits(old)


def test_huge_float_digit_counts_are_not_ints():
    # Many fraction digits are a float, parsed in linear time.
    assert loads(b'0.' + b'1' * 10000) == pytest.approx(0.1111111111111111)


@pytest.mark.parametrize("data, param", [
    (b'"\\ud800"', None),
    (b'"\\udc00"', None),
    (b'"\\uDBFF tail"', None),
    (b'"x\\ud800\\ud800"', None),            # high followed by high
    (b'"\\udc00\\ud800"', None),             # pair in the wrong order
    (b'"\\ud83d\\ude00\\udc00"', None),      # valid pair then a stray low one
    (b'"\\\\\\ud800"', None),                # escaped backslash, then a real escape
    (b'"\\\\ud800\\udc00"', None),           # literal "\ud800" text, then a real lone low
    (b'"\\ud800\\\\udc00"', None),           # real high, then literal text
    (b'{"\\ud800": 1}', '["\\ud800"]'),      # keys too
    (b'{"messages": [{"content": "ok"}, {"content": ["a", "\\udfff"]}]}', "messages[1].content[1]"),
])
def test_lone_surrogates(data, param):
    rejects(data, param=param, match="surrogate")


def test_surrogate_error_param_is_encodable():
    err = rejects(b'{"a\\udc00b": {"\\ud800": 1}}', param='["a\\udc00b"]')
    err.param.encode("utf-8")
    err.message.encode("utf-8")


@pytest.mark.parametrize("data, param", [
    (b'{"a":1,"a":2}', "a"),
    (b'{"a":1,"\\u0061":2}', "a"),  # equal after decoding escapes
    (b'{"messages":[{"role":"user","content":"x","role":"assistant"}]}', "messages[0].role"),
    (b'{"messages":[{"role":"user"},{"role":"a","x":{"k":1,"k":2}}]}', "messages[1].x.k"),
    (b'[[{}], [{"d": [1, {"z": 0, "z": 0}]}]]', "[1][0].d[1].z"),
    (b'{"a b":{"x":1,"x":2}}', '["a b"].x'),
    (b'{"a":{"x":1},"a":{"x":2}}', "a"),
    # Document order: "a" repeats before the inner object (which closes first) does.
    (b'{"a":1,"a":2,"c":{"d":1,"d":2}}', "a"),
    (b'{"a":{"b":1,"b":2},"a":3}', "a.b"),
])
def test_duplicate_keys(data, param):
    rejects(data, code="duplicate_key", param=param, match="duplicate key")


def test_syntax_error_beats_an_earlier_duplicate():
    rejects(b'{"a":1,"a":2} trailing')
    rejects(b'[{"a":1,"a":2}, NaN]', match="NaN")


@pytest.mark.parametrize("data", [
    b'[' * 65 + b']' * 65,
    b'{"a":' * 65 + b'1' + b'}' * 65,
    b'[{"a":' * 33 + b'1' + b'}]' * 33,
    b'[' * 100000,
    b'[' * 100000 + b']' * 100000,
    b'{"a":' * 100000,
    b'{"a":[' * 50000 + b']}' * 50000,
    b'[' * 10 ** 6 + b'1' + b']' * 10 ** 6,
])
def test_deep_nesting_rejects_cleanly(data):
    err = rejects(data)
    assert "nest" in err.message or "line" in err.message


def test_nesting_past_the_interpreter_recursion_limit_with_a_huge_max_depth():
    rejects(b'[' * 100000 + b']' * 100000, max_depth=10 ** 9, match="too deep")


def test_depth_counts_containers_not_brackets_in_strings():
    doc = b'[' * 60 + b'"' + b'[' * 5000 + b']' * 9000 + b'"' + b']' * 60
    assert loads(doc) is not None
    wide = json.dumps([[[1] * 10] * 100] * 100).encode()  # many containers, shallow
    assert loads(wide) == json.loads(wide)


# --------------------------------------------------------------------------
# loads: properties
# --------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.text() | st.floats(
    allow_nan=False, allow_infinity=False)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(), children, max_size=5),
    max_leaves=25)


@FUZZ
@given(json_values, st.booleans(), st.sampled_from([None, 1, 2]))
def test_roundtrip(value, ascii_only, indent):
    data = json.dumps(value, ensure_ascii=ascii_only, indent=indent).encode()
    assert same(loads(data, max_depth=1000), value)


# Strings built from surrogates (paired or not once escaped) and from escape-like
# text such as a literal backslash + "ud800", so escaped backslashes land next
# to real escapes.
FRAGMENTS = ["\\", "\\ud800", "\\uDBFF", "udc00", "\ud800", "\udbff", "\udc00", "\udfff",
             "\ud7ff", "\u00e9"]
surrogate_text = st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=6).map("".join)
with_surrogates = st.recursive(
    st.integers() | surrogate_text,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(surrogate_text, children, max_size=3),
    max_leaves=8)


def has_surrogate(value):
    if isinstance(value, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, list):
        return any(map(has_surrogate, value))
    if isinstance(value, dict):
        return any(has_surrogate(k) or has_surrogate(v) for k, v in value.items())
    return False


@settings(FUZZ, max_examples=600)
@example("\\ud800\udc00")  # literal escape text fooling a pairing pre-scan
@given(with_surrogates)
def test_lone_surrogates_agree_with_the_stdlib(value):
    data = json.dumps(value).encode()  # escapes every surrogate as \\uXXXX
    expected = json.loads(data)        # the stdlib pairs adjacent high+low escapes
    if has_surrogate(expected):
        with pytest.raises(JSONInputError, match="surrogate"):
            loads(data)
    else:
        assert same(loads(data), expected)


def check_accepted(data, value):
    """Anything loads accepts is strict JSON the stdlib reads the same way."""
    assert same(value, json.loads(data.decode("utf-8")))
    json.dumps(value, allow_nan=False).encode("utf-8")  # finite, no lone surrogates


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_jsoninputerror(data):
    try:
        value = loads(data)
    except JSONInputError:
        return
    check_accepted(data, value)


TOKENS = [b'{', b'}', b'[', b']', b'"', b'\\', b',', b':', b'\\u', b'\\ud800', b'\\udc00',
          b'NaN', b'-Infinity', b'1e999', b'0', b'-', b'.', b'e', b'\xff', b'\xed\xa0\x80',
          b'\xef\xbb\xbf', b'//', b'/*', b'\x00', b'\n', b' ', b'true', b'nul', b'"a":1,',
          b'9' * 4400]


@FUZZ
@given(json_values, st.lists(st.tuples(st.sampled_from(["insert", "delete", "replace", "token"]),
                                       st.integers(0, 10 ** 6), st.integers(0, 255),
                                       st.sampled_from(TOKENS)), min_size=1, max_size=4))
def test_mutated_documents_raise_only_jsoninputerror(value, edits):
    data = bytearray(json.dumps(value).encode())
    for op, where, byte, token in edits:
        i = where % (len(data) + 1)
        if op == "insert":
            data[i:i] = bytes([byte])
        elif op == "token":
            data[i:i] = token
        elif data:
            i = min(i, len(data) - 1)
            if op == "delete":
                del data[i]
            else:
                data[i] = byte
    data = bytes(data)
    try:
        result = loads(data)
    except JSONInputError:
        return
    check_accepted(data, result)


# --------------------------------------------------------------------------
# Field specs
# --------------------------------------------------------------------------

def fails(spec, value, code, param, match=None):
    with pytest.raises(JSONInputError) as info:
        spec.validate(value)
    err = info.value
    assert (err.code, err.param) == (code, param), repr(err)
    if param is not None:
        assert err.message.startswith(param + ": "), err.message
    if match is not None:
        assert match in err.message, err.message
    return err


PART = Tagged("type", {
    "text": Obj({"text": Str()}),
    "image_url": Obj({"image_url": Obj({
        "url": Str(check=lambda u: None if u.startswith("data:") else "must be a base64 data URL"),
        "detail": Enum(["auto", "low", "high"], optional=True),
    })}),
})
MESSAGE = Obj({
    "role": Enum(["system", "user", "assistant", "tool"]),
    "content": OneOf(Str(), Arr(PART), nullable=True),
    "name": Str(optional=True),
})


def one_limit(body):
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise JSONInputError("supply max_tokens or max_completion_tokens, not both",
                             param="max_completion_tokens")


CHAT = Obj({
    "model": Str(min_len=1),
    "messages": Arr(MESSAGE, min_len=1),
    "stream": Bool(optional=True, nullable=True),
    "max_tokens": Int(lo=1, hi=16384, optional=True),
    "max_completion_tokens": Int(lo=1, hi=16384, optional=True),
    "temperature": Num(lo=0, hi=2, optional=True),
    "top_p": Num(gt=0, hi=1, optional=True),
    "stop": OneOf(Str(), Arr(Str(), max_len=4), optional=True),
    "stream_options": Obj({"include_usage": Bool(optional=True)}, optional=True),
    "options": Obj(None, optional=True),
}, check=one_limit)


def chat(**fields):
    body = {"model": "scout", "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return body


def test_valid_body_keeps_only_present_keys():
    body = chat(stream=None, max_tokens=16, temperature=0, stop=["a"], options={"x": [None]},
                stream_options={"include_usage": True})
    assert same(CHAT.validate(body), body)
    minimal = CHAT.validate(chat())
    assert set(minimal) == {"model", "messages"}  # no defaults invented


def test_validate_returns_fresh_containers():
    body = chat(stop=["a"], options={"k": 1})
    out = CHAT.validate(body)
    assert out is not body and out["messages"] is not body["messages"]
    assert out["stop"] is not body["stop"] and out["options"] is not body["options"]


def test_parse_is_loads_then_validate():
    assert parse(json.dumps(chat(max_tokens=5)).encode(), CHAT)["max_tokens"] == 5
    with pytest.raises(JSONInputError) as info:
        parse(b'{"model":"a","model":"b","messages":[]}', CHAT)
    assert (info.value.code, info.value.param) == ("duplicate_key", "model")
    with pytest.raises(JSONInputError) as info:
        parse(b'{"model":"a"}', CHAT)
    assert (info.value.code, info.value.param) == ("missing_field", "messages")


@pytest.mark.parametrize("body, param", [
    (chat(foo=1), "foo"),
    (chat(stream_options={"include_usage": True, "extra": 1}), "stream_options.extra"),
    (chat(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b", "x": 1}]),
     "messages[1].x"),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a", "lang": "en"}]}]),
     "messages[0].content[0].lang"),
    (chat(**{"a b": 1}), '["a b"]'),
])
def test_unknown_fields(body, param):
    fails(CHAT, body, "unknown_field", param, "unknown field")


def test_unknown_field_param_is_bounded():
    err = fails(Obj({}), {"k" * 100000: 1}, "unknown_field", '["' + "k" * 64 + '…"]')
    assert len(err.message) < 200


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m"}, "messages"),
    (chat(messages=[{"content": "x"}]), "messages[0].role"),
    (chat(messages=[{"role": "user"}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages[0].content[0].image_url"),
    (chat(messages=[{"role": "user", "content": [{"text": "no type"}]}]),
     "messages[0].content[0].type"),
])
def test_missing_fields(body, param):
    fails(CHAT, body, "missing_field", param, "missing")


@pytest.mark.parametrize("body, param, match", [
    (chat(model=1), "model", "expected string, got integer"),
    (chat(model=None), "model", "got null"),
    (chat(messages={}), "messages", "expected array, got object"),
    (chat(messages=["hi"]), "messages[0]", "expected object, got string"),
    (chat(max_tokens=True), "max_tokens", "expected integer, got boolean"),
    (chat(max_tokens=3.0), "max_tokens", "expected integer, got number"),
    (chat(max_tokens="3"), "max_tokens", "expected integer, got string"),
    (chat(temperature=True), "temperature", "expected number, got boolean"),
    (chat(temperature="0"), "temperature", "expected number, got string"),
    (chat(stream=1), "stream", "expected boolean, got integer"),
    (chat(stream=0), "stream", "expected boolean, got integer"),
    (chat(stream_options=[]), "stream_options", "expected object, got array"),
    (chat(options="x"), "options", "expected object, got string"),
    (chat(max_tokens=None), "max_tokens", "got null"),       # optional is not nullable
    (chat(stream_options=None), "stream_options", "got null"),
    (chat(messages=[{"role": 1, "content": "x"}]), "messages[0].role", "expected string"),
    (chat(messages=[{"role": "user", "content": [{"type": 3}]}]),
     "messages[0].content[0].type", "expected string, got integer"),
])
def test_wrong_types(body, param, match):
    fails(CHAT, body, "invalid_type", param, match)


def test_root_type_error_has_no_param():
    err = fails(CHAT, [], "invalid_type", None)
    assert err.message == "expected object, got array"
    fails(CHAT, None, "invalid_type", None)


def test_bools_are_not_numbers_but_ints_are():
    assert Num().validate(1) == 1 and type(Num().validate(1)) is int
    assert Num().validate(-0.5) == -0.5
    for spec in (Int(), Num(), Int(lo=0, hi=1), Num(lo=0, hi=1)):
        fails(spec, True, "invalid_type", None)
        fails(spec, False, "invalid_type", None)
    fails(Int(), 3.0, "invalid_type", None)
    fails(Bool(), 1, "invalid_type", None)
    assert Int().validate(10 ** 30) == 10 ** 30


def test_num_rejects_nonfinite_given_directly():
    for bad in (math.inf, -math.inf, math.nan):
        fails(Num(), bad, "invalid_value", None, "finite")
    fails(Arr(Num()), [1.0, math.nan], "invalid_value", "[1]")


@pytest.mark.parametrize("body, param, match", [
    (chat(max_tokens=0), "max_tokens", "at least 1 (got 0)"),
    (chat(max_tokens=16385), "max_tokens", "at most 16384"),
    (chat(max_tokens=10 ** 40), "max_tokens", "at most 16384"),
    (chat(temperature=-0.1), "temperature", "at least 0"),
    (chat(temperature=2.5), "temperature", "at most 2"),
    (chat(top_p=0), "top_p", "greater than 0"),
    (chat(top_p=1.01), "top_p", "at most 1"),
])
def test_out_of_range(body, param, match):
    fails(CHAT, body, "out_of_range", param, match)


def test_range_edges_pass():
    out = CHAT.validate(chat(max_tokens=16384, temperature=2, top_p=1))
    assert (out["max_tokens"], out["temperature"], out["top_p"]) == (16384, 2, 1)
    fails(Num(lt=1), 1, "out_of_range", None, "less than 1")
    assert Num(lt=1).validate(0.999) == 0.999


@pytest.mark.parametrize("body, param, match", [
    (chat(model=""), "model", "must not be empty"),
    (chat(messages=[]), "messages", "must not be empty"),
    (chat(stop=["a"] * 5), "stop", "at most 4 items (got 5)"),
    (chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role", 'one of "system"'),
    (chat(messages=[{"role": "user", "content": [{"type": "video"}]}]),
     "messages[0].content[0].type", 'got "video"'),
    (chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:x", "detail": "max"}}]}]),
     "messages[0].content[0].image_url.detail", "one of"),
])
def test_invalid_values(body, param, match):
    fails(CHAT, body, "invalid_value", param, match)


def test_lengths():
    spec = Str(min_len=2, max_len=3)
    assert spec.validate("abc") == "abc"
    fails(spec, "a", "invalid_value", None, "at least 2 characters (got 1)")
    fails(spec, "abcd", "invalid_value", None, "at most 3 characters (got 4)")
    assert Str(max_len=1).validate("😀") == "😀"  # code points, not bytes
    fails(Arr(Int(), min_len=2), [1], "invalid_value", None, "at least 2 items")
    fails(Map(min_len=1), {}, "invalid_value", None, "must not be empty")
    fails(Map(max_len=1), {"a": 1, "b": 2}, "invalid_value", None, "at most 1 entry")


def test_null_handling():
    assert CHAT.validate(chat(stream=None))["stream"] is None      # nullable keeps the null
    assert CHAT.validate(chat(messages=[{"role": "assistant", "content": None}]))
    assert Null().validate(None) is None
    fails(Null(), 0, "invalid_type", None, "expected null, got integer")
    fails(Obj({"a": Null()}), {"a": False}, "invalid_type", "a")
    spec = OneOf(Str(), Null())
    assert spec.validate(None) is None and spec.validate("x") == "x"
    fails(spec, 1, "invalid_type", None, "expected string or null, got integer")
    fails(Any_(), None, "invalid_type", None)
    assert Any_(nullable=True).validate(None) is None
    assert Any_().validate({"x": [None]}) == {"x": [None]}
    fails(Arr(Str()), ["a", None], "invalid_type", "[1]")
    assert Arr(Str(nullable=True)).validate(["a", None]) == ["a", None]
    assert Obj(None).validate({"x": None}) == {"x": None}    # free-form contents


def test_oneof_reports_the_most_specific_failure():
    fails(CHAT, chat(stop=5), "invalid_type", "stop", "expected string or array, got integer")
    fails(CHAT, chat(stop=["a", 1]), "invalid_type", "stop[1]", "expected string, got integer")
    fails(CHAT, chat(stop=["a"] * 5), "invalid_value", "stop")
    inputs = OneOf(Str(), Arr(Str()), Arr(Int(lo=0)), Arr(Arr(Int(lo=0))))
    for value in ("x", ["a"], [1, 2], [[1], [2]], []):
        assert inputs.validate(value) == value
    fails(inputs, [1, "a"], "invalid_type", "[1]", "expected integer, got string")
    fails(inputs, ["a", 1], "invalid_type", "[1]", "expected string, got integer")
    fails(inputs, [[1], [2, "x"]], "invalid_type", "[1][1]", "expected integer")
    fails(inputs, [[1], [-2]], "out_of_range", "[1][0]")
    fails(inputs, {"a": 1}, "invalid_type", None, "expected string or array, got object")
    err = fails(CHAT, chat(messages=[{"role": "user", "content": 7}]), "invalid_type",
                "messages[0].content")
    assert "expected string or array, got integer" in err.message
    assert OneOf(Int(), Num()).validate(1.5) == 1.5  # first that accepts wins
    assert OneOf(Str(), nullable=True).validate(None) is None


def test_enum_compares_json_types():
    fails(Enum([False]), True, "invalid_value", None, "one of false (got true)")
    fails(Enum([1]), True, "invalid_type", None, "expected integer, got boolean")
    fails(Enum([1]), 1.0, "invalid_type", None)
    fails(Enum(["a", "b"]), 1, "invalid_type", None, "expected string, got integer")
    mixed = Enum(["a", 1])
    assert mixed.validate("a") == "a" and mixed.validate(1) == 1
    fails(mixed, None, "invalid_type", None, "expected string or integer, got null")
    fails(Enum(["x" * 100]), "y" * 100, "invalid_value", None)  # echoes stay bounded


def test_nested_arrays_of_objects():
    spec = Obj({"rows": Arr(Obj({"cells": Arr(Obj({"v": Int()}), max_len=3)}))})
    good = {"rows": [{"cells": [{"v": 1}]}, {"cells": []}]}
    assert spec.validate(good) == good
    fails(spec, {"rows": [{"cells": []}, {"cells": [{"v": 1}, {"v": "2"}]}]}, "invalid_type",
          "rows[1].cells[1].v")
    fails(spec, {"rows": [{"cells": [{"v": 1}, {"w": 2}]}]}, "unknown_field", "rows[0].cells[1].w")
    fails(spec, {"rows": [{"cells": [{}] * 4}]}, "invalid_value", "rows[0].cells")


def test_first_problem_in_document_order_wins():
    fails(Obj({"a": Int(), "b": Int()}), {"b": "x", "a": "y"}, "invalid_type", "b")
    fails(Obj({"a": Int(), "b": Int()}), {"zz": 1, "a": "y"}, "unknown_field", "zz")
    fails(Obj({"a": Int(), "b": Int()}), {"a": "y"}, "invalid_type", "a")  # before "b" missing


def test_tagged_variants():
    fails(PART, {"type": "text"}, "missing_field", "text")
    fails(PART, {"type": "text", "text": "x", "image_url": {}}, "unknown_field", "image_url")
    fails(PART, "text", "invalid_type", None, "expected object")
    fails(PART, {"type": "image_url", "image_url": {"url": "http://x"}}, "invalid_value",
          "image_url.url", "base64 data URL")
    spec = Tagged("kind", {"a": Obj({"kind": Str(), "n": Int()})})  # declares its own tag
    assert spec.validate({"kind": "a", "n": 1}) == {"kind": "a", "n": 1}


QUESTION = Tagged("type", {
    "choice": Obj({"instructions": OneOf(Str(), Obj(None), Arr(Any_())),
                   "criteria": Map(Str(), min_len=1, max_len=255)}),
    "score": Obj({"instructions": Str(), "criteria": Arr(Str(), min_len=2, max_len=10)}),
    "noul": Obj({"instructions": Str()}),
})
DECISION = Obj({
    "model": Str(min_len=1),
    "state": OneOf(Str(), Obj(None), Arr(Any_(nullable=True))),
    "questions": Map(QUESTION, keys=Str(min_len=1, max_len=64), min_len=1, max_len=1024),
})


def test_maps():
    body = {"model": "judge", "state": ["x", None], "questions": {
        "route": {"type": "choice", "instructions": "Choose.", "criteria": {"support": "a"}},
        "needs reply": {"type": "noul", "instructions": "?"}}}
    assert DECISION.validate(body) == body
    body["questions"]["needs reply"]["extra"] = 1
    fails(DECISION, body, "unknown_field", 'questions["needs reply"].extra')
    fails(DECISION, {**body, "questions": {}}, "invalid_value", "questions")
    fails(DECISION, {**body, "questions": {"": {"type": "noul", "instructions": "?"}}},
          "invalid_value", 'questions[""]', "invalid key: must not be empty")
    fails(DECISION, {**body, "questions": {"q": {"type": "score", "instructions": "?",
                                                 "criteria": ["Low"]}}},
          "invalid_value", "questions.q.criteria", "at least 2 items")
    fails(DECISION, {**body, "questions": {"q": {"type": "choice", "instructions": "?",
                                                 "criteria": {"a": 1}}}},
          "invalid_type", "questions.q.criteria.a")
    fails(DECISION, {**body, "state": 5}, "invalid_type", "state",
          "expected string or object or array, got integer")


def test_check_hooks():
    fails(CHAT, chat(max_tokens=1, max_completion_tokens=2), "invalid_value",
          "max_completion_tokens", "not both")
    spec = Obj({"seed": Str(check=lambda s: None if s.isdigit() else "must be decimal digits")})
    fails(spec, {"seed": "12a"}, "invalid_value", "seed", "seed: must be decimal digits")

    def custom(value):
        raise JSONInputError("bad part", param="[2].x", code="custom_code")
    fails(Obj({"a": Arr(check=custom)}), {"a": []}, "custom_code", "a[2].x", "a[2].x: bad part")
    fails(Obj({"a": Obj(None, check=lambda v: "no")}), {"a": {}}, "invalid_value", "a", "a: no")

    calls = []
    nullable = Str(nullable=True, check=calls.append)
    assert nullable.validate(None) is None and calls == []   # checks see values, not null
    assert nullable.validate("x") == "x" and calls == ["x"]
    with pytest.raises(TypeError):
        Str(check=lambda v: False).validate("x")


def test_validate_at_prefixes_params():
    err = fails(Obj({"a": Int()}), {"a": "x"}, "invalid_type", "a")
    with pytest.raises(JSONInputError) as info:
        Obj({"a": Int()}).validate({"a": "x"}, at="model_options")
    assert info.value.param == "model_options.a"
    with pytest.raises(JSONInputError) as info:
        Int().validate("x", at="messages[0]")
    assert info.value.param == "messages[0]"
    assert err.message == "a: expected integer, got string"


def test_big_arrays_use_the_fast_path_and_still_locate_errors():
    ids = list(range(200000))
    spec = Arr(Int(lo=0, hi=2 ** 31 - 1), min_len=1)
    assert spec.validate(ids) == ids
    fails(spec, ids[:123] + [-1] + ids[124:], "out_of_range", "[123]")
    fails(spec, ids[:7] + [True] + ids[8:], "invalid_type", "[7]")
    fails(spec, ids[:9] + [2 ** 31] + ids[10:], "out_of_range", "[9]")
    fails(Arr(Str(max_len=2)), ["ab"] * 1000 + ["abc"], "invalid_value", "[1000]")
    fails(Arr(Num(gt=0)), [0.5] * 1000 + [0], "out_of_range", "[1000]")
    assert Arr(Num(lo=0, hi=1)).validate([0, 0.5, 1]) == [0, 0.5, 1]
    fails(Arr(Num(hi=1)), [0.5, 10 ** 400], "out_of_range", "[1]", "a 1329-bit integer")
    assert Arr(Num()).validate([0.5, 10 ** 400]) == [0.5, 10 ** 400]
    assert Arr(Str(min_len=1)).validate([]) == []


def test_spec_construction_mistakes_fail_early():
    with pytest.raises(TypeError):
        Obj({"a": Str})
    with pytest.raises(TypeError):
        Arr(Int)
    with pytest.raises(ValueError):
        Enum([])
    with pytest.raises(TypeError):
        Enum([None])
    with pytest.raises(TypeError):
        OneOf()
    with pytest.raises(TypeError):
        Tagged("type", {"a": Obj(None)})


def test_error_type():
    err = JSONInputError("m")
    assert isinstance(err, ValueError) and (err.message, err.param, err.code) == ("m", None, "invalid_json")
    assert str(err) == "m"
    err = JSONInputError("m", "c", "p")     # errors.Problem's one order: message, code, param
    assert (err.param, err.code) == ("p", "c")


@FUZZ
@given(json_values)
def test_specs_raise_only_jsoninputerror_on_arbitrary_values(value):
    for spec in (CHAT, DECISION, MESSAGE, PART, CHAT.fields["stop"]):
        for candidate in (value, {"model": "m", "messages": value}, {"model": "m", "questions": value},
                          chat(messages=[{"role": "user", "content": value}])):
            try:
                spec.validate(candidate)
            except JSONInputError as err:
                assert err.code in {"unknown_field", "missing_field", "invalid_type",
                                    "out_of_range", "invalid_value"}
                assert err.param is None or isinstance(err.param, str)
