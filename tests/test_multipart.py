"""multipart/form-data parsing: loom._native.multipart (Cython) and its pure-Python reference.

Every behavioural test runs against both implementations; the property tests also
check that the two agree exactly (same parts, or the same error message) on valid,
mutated and random bodies.
"""

import shutil
import socket
import subprocess
import threading

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from loom._native import multipart, pymultipart

IMPLS = [pytest.param(multipart, id="cython"), pytest.param(pymultipart, id="reference")]
API = ["MultipartError", "Part", "boundary_of", "parse"]
SETTINGS = settings(max_examples=250, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

BOUNDARY = "------------------------d74496d66958873e"
CT = f"multipart/form-data; boundary={BOUNDARY}"


def quote(value):
    """A quoted-string the way curl escapes it: backslash before '"' and '\\'."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def part_bytes(boundary, name, data, filename=None, headers=()):
    disposition = f"form-data; name={quote(name)}"
    if filename is not None:
        disposition += f"; filename={quote(filename)}"
    lines = [f"Content-Disposition: {disposition}", *headers]
    return (f"--{boundary}\r\n" + "".join(line + "\r\n" for line in lines) + "\r\n").encode() + data + b"\r\n"


def encode(parts, boundary=BOUNDARY, preamble=b"", epilogue=b"\r\n"):
    """Body of (name, data, filename, extra header lines) parts."""
    body = b"".join(part_bytes(boundary, *p) for p in parts)
    return preamble + body + f"--{boundary}--".encode() + epilogue


def fields(parts):
    return [(p.name, p.filename, p.headers, p.content_type, p.params, p.data) for p in parts]


def outcome(impl, body, content_type, **limits):
    """What parse() does, comparable across implementations: the fields, or the rejection message."""
    try:
        return fields(impl.parse(body, content_type, **limits))
    except impl.MultipartError as e:
        assert isinstance(e, ValueError) and e.message == str(e) and e.message
        return ("rejected", e.message)


def rejects(impl, body, content_type=CT, match="", **limits):
    with pytest.raises(impl.MultipartError) as info:
        impl.parse(body, content_type, **limits)
    assert match in info.value.message, info.value.message
    return info.value.message


# Binary contents that look like framing: CR, LF, dashes and a prefix of the delimiter.
TRICKY = b"\x00\r\n--\r\n\r\n-" + f"\r\n--{BOUNDARY[:-1]}".encode() + b"\r--" + BOUNDARY.encode() + b"\xff\r"
PCM = bytes(range(256)) * 4 + b"\r\n"

REALISTIC = [
    ("request", b'{"model":"scout","base":12,"sources":["config.loom","advance.loombc"]}',
     "model/candidate.json", ["Content-Type: application/json"]),
    ("file", TRICKY, "model/advance.loombc", ["Content-Type: application/octet-stream"]),
    ("model", b"recognizer", None, []),
    ("file", PCM, "rec.pcm", ["Content-Type: audio/pcm;rate=24000;channels=1"]),
    ("file", b"", "modèle/ü.loom", ["Content-Type: application/octet-stream"]),
    ("file", b"x", "model/%41.loom", []),
    ("file", b"\r\n", 'we"ird\\name.bin', ["X-Extra:   padded value\t", "content-TYPE: Text/Plain; Charset=\"utf-8\""]),
]


def check_realistic(parts):
    assert [p.name for p in parts] == ["request", "file", "model", "file", "file", "file", "file"]
    assert [p.filename for p in parts] == [
        "model/candidate.json", "model/advance.loombc", None, "rec.pcm", "modèle/ü.loom", "model/%41.loom",
        'we"ird\\name.bin']
    assert [p.data for p in parts] == [r[1] for r in REALISTIC]
    assert [p.content_type for p in parts] == [
        "application/json", "application/octet-stream", None, "audio/pcm", "application/octet-stream", None,
        "text/plain"]
    assert parts[3].params == {"rate": "24000", "channels": "1"}
    assert parts[3].headers == [("content-disposition", 'form-data; name="file"; filename="rec.pcm"'),
                                ("content-type", "audio/pcm;rate=24000;channels=1")]
    assert parts[2].headers == [("content-disposition", 'form-data; name="model"')] and parts[2].params == {}
    assert parts[6].headers[1:] == [("x-extra", "padded value"), ("content-type", 'Text/Plain; Charset="utf-8"')]
    assert parts[6].params == {"charset": "utf-8"}
    assert all(type(p.data) is bytes for p in parts)


def test_both_modules_export_the_api():
    for impl in (multipart, pymultipart):
        assert all(hasattr(impl, name) for name in API)
        assert sorted(impl.__all__) == sorted(API)
        assert issubclass(impl.MultipartError, ValueError)


# -- realistic bodies ---------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_curl_style_body(impl):
    check_realistic(impl.parse(encode(REALISTIC), CT))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("preamble,epilogue", [
    (b"", b""), (b"preamble\r\n", b"\r\nepilogue --" + BOUNDARY.encode() + b"--\r\n"), (b"\r\n", b"\r\n\r\n")])
def test_preamble_and_epilogue_are_ignored(impl, preamble, epilogue):
    check_realistic(impl.parse(encode(REALISTIC, preamble=preamble, epilogue=epilogue), CT))


@pytest.mark.parametrize("impl", IMPLS)
def test_transport_padding_quoted_boundary_and_header_case(impl):
    boundary = "a'()+_,-./:=? b"  # every bchar class, including ones that need quoting
    body = (f"--{boundary} \t\r\ncontent-disposition: Form-Data; NAME=token; FileName=\"f.txt\"\r\n"
            f"CONTENT-TYPE: Text/Plain ;Charset=UTF-8 ; format=\"flowed\"\r\n\r\n"
            f"one\r\n--{boundary}\t\r\nContent-Disposition: form-data; name=\"two\"\r\n\r\n"
            f"\r\n--{boundary}--  \r\n").encode()
    content_type = f'Multipart/Form-Data ; Boundary="{boundary}"; charset=utf-8'
    assert impl.boundary_of(content_type) == boundary.encode()
    one, two = impl.parse(body, content_type)
    assert (one.name, one.filename, one.content_type, one.data) == ("token", "f.txt", "text/plain", b"one")
    assert one.params == {"charset": "UTF-8", "format": "flowed"}
    assert one.headers[0] == ("content-disposition", 'Form-Data; NAME=token; FileName="f.txt"')
    assert (two.name, two.filename, two.content_type, two.data, two.params) == ("two", None, None, b"", {})


@pytest.mark.parametrize("impl", IMPLS)
def test_identity_transfer_encodings_are_accepted(impl):
    for encoding in ("7bit", "8bit", "Binary"):
        (part,) = impl.parse(_headers(CD, f"Content-Transfer-Encoding: {encoding}", data=b"\xff\r\n"), CT)
        assert part.data == b"\xff\r\n" and part.headers[1] == ("content-transfer-encoding", encoding)


@pytest.mark.parametrize("impl", IMPLS)
def test_part_values_and_equality(impl):
    (part,) = impl.parse(encode([("a", b"1", "", [])]), CT)
    assert part.filename == ""  # an empty filename is kept, not turned into None
    assert part == impl.Part("a", "", [("content-disposition", 'form-data; name="a"; filename=""')], None, {}, b"1")
    assert part != impl.Part("a", None, part.headers, None, {}, b"1")
    assert "name='a'" in repr(part)


def _capture_one_request(listener, box):
    """Accept one HTTP request on listener and keep its raw bytes; answer 200."""
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(10)
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += conn.recv(65536)
        box["head"], box["body"] = head.decode("latin-1"), body
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


@pytest.fixture(scope="module")
def curl_request(tmp_path_factory):
    """(Content-Type, body) of a real curl upload, as PROFILES.md's examples send it."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    d = tmp_path_factory.mktemp("curl")
    (d / "candidate.json").write_bytes(REALISTIC[0][1])
    (d / "advance.loombc").write_bytes(TRICKY + b"\r\n--------------------------")  # curl's boundary prefix
    (d / "rec.pcm").write_bytes(PCM)
    (d / "u.bin").write_bytes(b"")
    box = {}
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        thread = threading.Thread(target=_capture_one_request, args=(listener, box), daemon=True)
        thread.start()
        subprocess.run(
            ["curl", "-s", "-H", "Expect:", "--max-time", "10",
             "-F", "request=@candidate.json;type=application/json;filename=model/candidate.json",
             "-F", "file=@advance.loombc;filename=model/advance.loombc",
             "-F", "model=recognizer",
             "-F", 'file=@rec.pcm;headers="Content-Type: audio/pcm;rate=24000;channels=1"',
             "-F", "file=@u.bin;filename=modèle/ü%41.loom",
             f"http://127.0.0.1:{listener.getsockname()[1]}/"],
            cwd=d, check=True, timeout=20, stdin=subprocess.DEVNULL)
        thread.join(10)
    head = box["head"].split("\r\n")
    content_type = next(line.split(":", 1)[1].strip() for line in head if line.lower().startswith("content-type:"))
    assert not any(line.lower().startswith("expect:") for line in head)
    return content_type, box["body"]


@pytest.mark.parametrize("impl", IMPLS)
def test_real_curl_upload(impl, curl_request):
    content_type, body = curl_request
    parts = impl.parse(body, content_type)
    assert [(p.name, p.filename, p.content_type) for p in parts] == [
        ("request", "model/candidate.json", "application/json"),
        ("file", "model/advance.loombc", "application/octet-stream"),
        ("model", None, None),
        ("file", "rec.pcm", "audio/pcm"),
        ("file", "modèle/ü%41.loom", "application/octet-stream"),
    ]
    assert [p.data for p in parts] == [
        REALISTIC[0][1], TRICKY + b"\r\n--------------------------", b"recognizer", PCM, b""]
    assert parts[3].params == {"rate": "24000", "channels": "1"}
    assert parts[3].headers == [("content-disposition", 'form-data; name="file"; filename="rec.pcm"'),
                                ("content-type", "audio/pcm;rate=24000;channels=1")]
    assert parts[0].headers[1] == ("content-type", "application/json")


# -- truncation ---------------------------------------------------------------------------------

def complete_lengths(body):
    """Prefix lengths that are still a complete body: the whole, or ending right at the closing `--`."""
    close = body.rindex(b"--\r\n") + 2 if body.endswith(b"--\r\n") else len(body)
    return {close, len(body)}


@pytest.mark.parametrize("impl", IMPLS)
def test_every_truncation_rejects(impl):
    body = encode(REALISTIC[:4])
    expected = fields(impl.parse(body, CT))
    for n in range(len(body) + 1):
        if n in complete_lengths(body):
            assert fields(impl.parse(body[:n], CT)) == expected
        else:
            rejects(impl, body[:n])


@pytest.mark.parametrize("impl", IMPLS)
def test_every_truncation_of_the_curl_upload_rejects(impl, curl_request):
    content_type, body = curl_request
    expected = fields(impl.parse(body, content_type))
    for n in range(len(body) + 1):
        if n in complete_lengths(body):
            assert fields(impl.parse(body[:n], content_type)) == expected
        else:
            rejects(impl, body[:n], content_type)


# -- rejections ---------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("content_type,match", [
    ("multipart/form-data", "no boundary parameter"),
    ("multipart/form-data; charset=utf-8", "no boundary parameter"),
    ("multipart/form-data; boundary=a; boundary=a", "duplicate request Content-Type parameter 'boundary'"),
    ("multipart/form-data; BOUNDARY=a; boundary=b", "duplicate"),
    ("multipart/mixed; boundary=a", "must be multipart/form-data, not 'multipart/mixed'"),
    ("application/x-www-form-urlencoded", "must be multipart/form-data"),
    ("", "expected a media type"),
    ("multipart", "expected '/'"),
    ("multipart/form-data; boundary=", "expected a parameter value"),
    ('multipart/form-data; boundary=""', "1 to 70 characters"),
    ("multipart/form-data; boundary=" + "a" * 71, "1 to 70 characters long, not 71"),
    ('multipart/form-data; boundary="a@b"', "contains '@'"),
    ('multipart/form-data; boundary="ab "', "must not end with a space"),
    ('multipart/form-data; boundary="ab', "expected a closing '\"'"),
    ("multipart/form-data; boundary = ab", "expected '='"),
    ("multipart/form-data boundary=ab", "expected ';'"),
    ("multipart/form-data; boundary=ab;", "expected a parameter name"),
    ("multipart/form-data; boundary=ab\r\n", "contains the character '\\r'"),
    ("multipart/form-data; boundary=é", "contains the character 'é'"),
])
def test_bad_request_content_type(impl, content_type, match):
    with pytest.raises(impl.MultipartError) as info:
        impl.boundary_of(content_type)
    assert match in info.value.message
    rejects(impl, encode(REALISTIC), content_type, match)


@pytest.mark.parametrize("impl", IMPLS)
def test_boundary_lengths(impl):
    assert impl.boundary_of("multipart/form-data; boundary=" + "a" * 70) == b"a" * 70
    assert impl.boundary_of("multipart/form-data; boundary=x") == b"x"


def _headers(*lines, data=b"d"):
    """A one-part body with exactly these header lines."""
    return (f"--{BOUNDARY}\r\n" + "".join(line + "\r\n" for line in lines) + "\r\n").encode() + data + \
        f"\r\n--{BOUNDARY}--\r\n".encode()


CD = 'Content-Disposition: form-data; name="f"'
MALFORMED = [
    (b"", "no opening boundary"),
    (b"just some text", "no opening boundary"),
    (f"--{BOUNDARY}--\r\n".encode(), "has no parts"),
    (encode([("a", b"1", None, [])])[:-len(f"--{BOUNDARY}--\r\n")], "no closing boundary"),
    (encode([("a", b"1", None, [])]).replace(b"--\r\n", b"-x\r\n"), "unexpected bytes after a multipart boundary"),
    (encode([("a", b"1", None, [])]).replace(f"--{BOUNDARY}\r\n".encode(), f"--{BOUNDARY}x\r\n".encode()),
     "unexpected bytes after a multipart boundary at offset"),
    (encode([("a", b"1", None, [])]).replace(b"--\r\n", b"--\n"), "unexpected bytes"),
    (encode([("a", b"1", None, [])]).replace(b"\r\n", b"\n"), "unexpected bytes after a multipart boundary"),
    (f"--{BOUNDARY}\r\n\r\nno headers\r\n--{BOUNDARY}--".encode(), "part 1: part has no Content-Disposition"),
    (_headers("Content-Type: text/plain"), "part 1: part has no Content-Disposition"),
    (_headers(CD, "Bad Header: x"), "part 1: malformed part header line b'Bad Header: x'"),
    (_headers(CD, "NoColon"), "malformed part header line"),
    (_headers(CD, ": empty name"), "malformed part header line"),
    (_headers(CD, "X-A: 1", " folded"), "obsolete line folding"),
    (_headers(CD + "\nX-A: 1"), "bare CR or LF"),
    (_headers(CD + "\rX-A: 1"), "bare CR or LF"),
    (_headers(CD, "X-A: a\x00b"), "control character in part header 'x-a'"),
    (_headers(CD, "X-A: a\x7fb"), "control character"),
    (_headers(CD, "X-\x00: 1"), "malformed part header line"),
    (_headers(CD, "Content-Disposition: form-data; name=g"), "duplicate Content-Disposition header"),
    (_headers(CD, "Content-Type: a/b", "content-type: a/b"), "part 1: duplicate Content-Type header"),
    (_headers("Content-Disposition: form-data"), "Content-Disposition has no name parameter"),
    (_headers('Content-Disposition: form-data; filename="x"'), "no name parameter"),
    (_headers('Content-Disposition: form-data; name=""'), "name is empty"),
    (_headers('Content-Disposition: attachment; name="f"'), "must be form-data, not 'attachment'"),
    (_headers("Content-Disposition: ; name=f"), "expected a disposition type"),
    (_headers(CD + "; filename*=UTF-8''x.bin"), "'filename*' (RFC 5987"),
    (_headers("Content-Disposition: form-data; name*=UTF-8''x"), "'name*' (RFC 5987"),
    (_headers(CD + "; size=3"), "unsupported Content-Disposition parameter 'size'"),
    (_headers(CD + '; filename="a"; filename="b"'), "duplicate part 1 Content-Disposition parameter 'filename'"),
    (_headers(CD + '; filename="a'), "expected a closing '\"'"),
    (_headers(CD + '; filename="a\\'), "expected a closing '\"'"),
    (_headers(CD + "; filename=a b"), "expected ';' at offset"),
    (_headers(CD + "; filename=é"), "expected a parameter value"),
    (_headers(CD + ";"), "expected a parameter name"),
    (_headers(CD, "Content-Type: audio/pcm;rate=24000;rate=16000"), "duplicate part 1 Content-Type parameter 'rate'"),
    (_headers(CD, "Content-Type: audio/pcm;rate=24000;channels"), "expected '='"),
    (_headers(CD, "Content-Type: audio"), "part 1 Content-Type: expected '/'"),
    (_headers(CD, "Content-Type: audio/"), "expected a media subtype"),
    (_headers(CD, "Content-Type: audio/pcm rate=1"), "expected ';'"),
    (_headers(CD, "Content-Type: "), "expected a media type"),
    (_headers(CD, "Content-Transfer-Encoding: base64"), "Content-Transfer-Encoding 'base64' is not supported"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("body,match", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_bodies_reject(impl, body, match):
    rejects(impl, body, CT, match)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_utf8_filename_rejects(impl):
    body = _headers(CD, "X: y").replace(b'name="f"', b'name="f"; filename="caf\xe9"')
    rejects(impl, body, CT, "part 1: part header 'content-disposition' is not valid UTF-8")


@pytest.mark.parametrize("impl", IMPLS)
def test_max_parts(impl):
    parts = [(f"p{i}", b"x", None, []) for i in range(5)]
    assert len(impl.parse(encode(parts), CT, max_parts=5)) == 5
    rejects(impl, encode(parts), CT, "more than 4 parts", max_parts=4)
    rejects(impl, encode(parts * 300), CT, "more than 1024 parts")


@pytest.mark.parametrize("impl", IMPLS)
def test_max_part_header_bytes(impl):
    block = f"{CD}\r\nX-Pad: {'p' * 100}"
    body = _headers(*block.split("\r\n"))
    size = len(block.encode())
    assert impl.parse(body, CT, max_part_header_bytes=size)[0].headers[1] == ("x-pad", "p" * 100)
    rejects(impl, body, CT, f"part 1: part headers exceed {size - 1} bytes", max_part_header_bytes=size - 1)
    huge = _headers(CD, "X-Pad: " + "p" * 9000)
    rejects(impl, huge, CT, "part headers exceed 8192 bytes")
    # A body cut inside oversize headers still reports the size bound once it passes it.
    rejects(impl, huge[:8300], CT, "part headers exceed 8192 bytes")
    rejects(impl, huge[:1000], CT, "body ends inside the part headers")


@pytest.mark.parametrize("impl", IMPLS)
def test_argument_errors_are_not_multipart_errors(impl):
    with pytest.raises(TypeError):
        impl.parse(bytearray(encode(REALISTIC)), CT)
    with pytest.raises(ValueError):
        impl.parse(b"", CT, max_parts=-1)


# -- properties ---------------------------------------------------------------------------------

BCHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'()+_,-./:=? "
TOKEN = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~",
                min_size=1, max_size=12)
# Header text: any Unicode except C0 controls and DEL (which headers cannot carry) and lone surrogates.
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=[chr(c) for c in range(32)] + ["\x7f"]),
               max_size=24)


@st.composite
def boundaries(draw):
    boundary = draw(st.text(BCHARS, min_size=1, max_size=70).filter(lambda b: not b.endswith(" ")))
    quoted = not is_token(boundary) or draw(st.booleans())
    return boundary, f"multipart/form-data; boundary={quote(boundary) if quoted else boundary}"


@st.composite
def contents(draw, boundary):
    """Binary data built from random bytes and framing look-alikes, never containing the delimiter."""
    pieces = [b"\r\n", b"\r", b"\n", b"--", b"-", b"\r\n--", f"--{boundary}".encode(),
              f"\r\n--{boundary[:-1]}".encode(), f"\r\n-{boundary}".encode()]
    data = b"".join(draw(st.lists(st.one_of(st.binary(max_size=16), st.sampled_from(pieces)), max_size=8)))
    assume(f"\r\n--{boundary}".encode() not in data)
    return data


@st.composite
def media_types(draw):
    media = draw(TOKEN) + "/" + draw(TOKEN)
    params = draw(st.dictionaries(TOKEN.map(str.lower), st.one_of(TOKEN, TEXT), max_size=3))
    text = media
    for k, v in params.items():
        separator = draw(st.sampled_from(["; ", ";", " ; "]))
        key = k.upper() if draw(st.booleans()) else k
        value = v if is_token(v) and draw(st.booleans()) else quote(v)
        text += f"{separator}{key}={value}"
    return text, media.lower(), params


def is_token(v):
    return bool(v) and all(c.isascii() and c.isalnum() or c in "!#$%&'*+-.^_`|~" for c in v)


@st.composite
def bodies(draw):
    """(content_type, body, expected fields) for a random valid body."""
    boundary, content_type = draw(boundaries())
    expected, chunks = [], []
    for _ in range(draw(st.integers(1, 4))):
        name = draw(TEXT.filter(bool))
        filename = draw(st.none() | TEXT)
        disposition = f"form-data; {draw(st.sampled_from(['name', 'Name']))}={quote(name)}"
        if filename is not None:
            disposition += f"; filename={quote(filename)}"
        headers = [(draw(st.sampled_from(["Content-Disposition", "content-disposition"])), disposition)]
        media = None
        params = {}
        if draw(st.booleans()):
            text, media, params = draw(media_types())
            headers.append(("Content-Type", text))
        if draw(st.booleans()):
            headers.insert(draw(st.integers(0, len(headers))), ("X-" + draw(TOKEN), draw(TEXT).strip(" \t")))
        data = draw(contents(boundary))
        padding = draw(st.sampled_from(["", " ", "\t "]))
        chunks.append(f"--{boundary}{padding}\r\n".encode()
                      + "".join(f"{k}:{draw(st.sampled_from(['', ' ', '  ']))}{v}\r\n" for k, v in headers).encode()
                      + b"\r\n" + data + b"\r\n")
        expected.append((name, filename, [(k.lower(), v) for k, v in headers], media, params, data))
    preamble = draw(st.sampled_from([b"", b"preamble\r\n", b"\r\n", b"x\r\n-\r\n"]))
    epilogue = draw(st.sampled_from([b"", b"\r\n", b"\r\nany epilogue\r\n", b" \r\n--"]))
    assume(f"--{boundary}".encode() not in preamble)
    return content_type, preamble + b"".join(chunks) + f"--{boundary}--".encode() + epilogue, expected


@SETTINGS
@given(bodies())
def test_random_bodies_round_trip(case):
    content_type, body, expected = case
    for impl in (multipart, pymultipart):
        assert outcome(impl, body, content_type) == expected


def both(body, content_type, **limits):
    """Run both implementations; they must agree exactly, and fail only with MultipartError."""
    result = outcome(multipart, body, content_type, **limits)
    assert result == outcome(pymultipart, body, content_type, **limits)
    return result


MUTATION = st.tuples(st.sampled_from(["set", "flip", "insert", "delete", "truncate"]), st.floats(0, 1),
                     st.sampled_from(list(b"\r\n-\" ;:=\\\t\x00\xff") + [ord("a")]) | st.integers(0, 255))


@SETTINGS
@given(bodies(), st.lists(MUTATION, min_size=1, max_size=4), st.integers(1, 4), st.integers(0, 300))
def test_mutated_bodies_reject_cleanly_and_agree(case, mutations, max_parts, max_header):
    content_type, body, _ = case
    body = bytearray(body)
    for kind, where, byte in mutations:
        i = min(int(where * len(body)), len(body))
        if kind == "set" and i < len(body):
            body[i] = byte
        elif kind == "flip" and i < len(body):
            body[i] ^= byte or 1
        elif kind == "insert":
            body[i:i] = bytes([byte])
        elif kind == "delete":
            del body[i:i + 1]
        elif kind == "truncate":
            del body[i:]
    both(bytes(body), content_type)
    both(bytes(body), content_type, max_parts=max_parts, max_part_header_bytes=max_header)


@SETTINGS
@given(st.binary(max_size=300), st.sampled_from([BOUNDARY, "a", "-"]))
def test_garbage_rejects_cleanly_and_agrees(body, boundary):
    content_type = f'multipart/form-data; boundary="{boundary}"'
    both(body, content_type)
    both(f"--{boundary}".encode() + body, content_type)  # past the opening delimiter


@SETTINGS
@given(st.text(max_size=80) | st.text("multipart/form-dat; =\"boundary\\ \t'(),", max_size=60).map(
    lambda s: "multipart/form-data" + s))
def test_random_content_types_agree(content_type):
    answers = []
    for impl in (multipart, pymultipart):
        try:
            answers.append(impl.boundary_of(content_type))
        except impl.MultipartError as e:
            answers.append(("rejected", e.message))
    assert answers[0] == answers[1]
