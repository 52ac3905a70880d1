"""Strict JSON input: the one reader and field validator every endpoint uses.

Two halves, both pure standard library:

* ``loads(data)`` turns request bytes into Python values. It accepts exactly
  RFC 8259 JSON in UTF-8 and rejects the things a lenient parser would guess
  about: duplicate keys, NaN/Infinity, lone surrogates, a BOM, absurd nesting
  or digit counts. Parsing itself is the stdlib C scanner; the extra rules are
  parse hooks plus checks that run inside C (bytes searches, a regex, itertools),
  so multi-megabyte bodies never meet a per-character Python loop.

* A small declarative spec (``Obj``, ``Str``, ``Int`` ...) that an endpoint
  writes once as a module constant and applies with ``SPEC.validate(value)``
  or ``parse(data, SPEC)``. Unknown, missing and wrongly typed fields reject
  with the offending parameter named (DESIGN.md, "Reject, never guess").

Every rejection is a ``JSONInputError``; the HTTP layer renders it as a 400
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``.
``param`` is a JSON path such as ``messages[2].content`` or
``questions["needs reply"].type``; validation messages read ``"<param>: <detail>"``.

    CHAT = Obj({
        "model": Str(min_len=1),                      # fields are required by default
        "messages": Arr(MESSAGE, min_len=1),
        "stream": Bool(optional=True, nullable=True),
        "max_tokens": Int(lo=1, hi=16384, optional=True),
        "stop": OneOf(Str(), Arr(Str(), max_len=4), optional=True),
        "options": Obj(None, optional=True),          # any object, free-form
    })
    body = parse(request.body, CHAT)                  # dict of the keys sent, validated
"""
from __future__ import annotations

import json
import math
import re
import sys
from itertools import chain, compress, repeat
from typing import Any, Callable, Iterable, Iterator, Mapping

from .errors import Problem

__all__ = [
    "JSONInputError", "loads", "parse", "MAX_DEPTH", "MAX_INT_DIGITS",
    "Spec", "Obj", "Map", "Tagged", "Arr", "Str", "Int", "Num", "Bool",
    "Enum", "Null", "Any_", "OneOf",
    "INVALID_JSON", "DUPLICATE_KEY", "UNKNOWN_FIELD", "MISSING_FIELD",
    "INVALID_TYPE", "OUT_OF_RANGE", "INVALID_VALUE",
]

# Error codes, as they appear in the response's "code".
INVALID_JSON = "invalid_json"      # not strict JSON at all
DUPLICATE_KEY = "duplicate_key"    # same key twice in one object
UNKNOWN_FIELD = "unknown_field"    # a key the spec does not declare
MISSING_FIELD = "missing_field"    # a required key is absent
INVALID_TYPE = "invalid_type"      # wrong JSON type (incl. null where not allowed)
OUT_OF_RANGE = "out_of_range"      # number outside lo/hi/gt/lt
INVALID_VALUE = "invalid_value"    # length bounds, enum miss, non-finite, check hooks

MAX_DEPTH = 64        # default nesting limit: no request needs more
MAX_INT_DIGITS = 4300  # Python's default int-parsing guard (its cost is quadratic in digits)


class JSONInputError(Problem, ValueError):
    """A client input error; ``param`` is the JSON path of the culprit, if known."""

    code = INVALID_JSON

    def __repr__(self) -> str:
        return f"JSONInputError({self.message!r}, param={self.param!r}, code={self.code!r})"


# --------------------------------------------------------------------------
# JSON paths ("messages[0].content", 'options["a b"]') for params and messages
# --------------------------------------------------------------------------

class _Raw(str):
    """An already formatted relative path (from a check hook's param)."""


_BARE_KEY = re.compile(r"[A-Za-z0-9_\-]+\Z")
_KEY_SHOWN = 64  # echo at most this much of a key: error bodies stay bounded


def _format_path(parts: Iterable[object]) -> str | None:
    out: list[str] = []
    for part in parts:
        if isinstance(part, _Raw):
            out.append(part if part.startswith("[") or not out else "." + part)
        elif isinstance(part, int):
            out.append(f"[{part}]")
        elif len(part) <= _KEY_SHOWN and _BARE_KEY.match(part):
            out.append("." + part if out else part)
        else:
            out.append("[" + _quote(part[:_KEY_SHOWN] + ("…" if len(part) > _KEY_SHOWN else "")) + "]")
    return "".join(out) or None


def _quote(text: str) -> str:
    shown = json.dumps(text, ensure_ascii=False)
    try:
        shown.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate must not reach the response encoder
        shown = json.dumps(text)
    return shown


def _show(value: object) -> str:
    """A bounded rendering of a scalar for messages (inputs may be megabytes)."""
    if isinstance(value, str):
        text = _quote(value[:40])
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"a {value.bit_length()}-bit integer"  # skip a quadratic int-to-text conversion
    else:
        text = json.dumps(value) if value is None or isinstance(value, (bool, float)) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------
# loads
# --------------------------------------------------------------------------

class _Reject(Exception):
    """Raised from parse hooks; deliberately not a ValueError so nothing swallows it."""


class _Duplicate(Exception):
    """A hook saw a duplicate key; the path is found afterwards (hooks are bottom-up)."""


class _Pairs(list):
    """Object as its raw (key, value) pairs: used only to locate a duplicate key."""


def _no_duplicates(pairs: list) -> dict:
    obj = dict(pairs)  # C-speed; a shorter dict means a key repeated
    if len(obj) != len(pairs):
        raise _Duplicate
    return obj


def _no_constants(name: str) -> object:
    raise _Reject(f"invalid JSON: {name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # e.g. 1e400: no literal infinity, but one all the same
        raise _Reject(f"invalid JSON: number {text[:40]} is out of range")
    return value


def _bounded_int(text: str) -> int:
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:
        raise _Reject(f"invalid JSON: integer with more than {MAX_INT_DIGITS} digits")
    return int(text)


def _int_digit_limit() -> int:
    """The interpreter's own int() digit limit (0: none; absent before 3.10.7)."""
    getter = getattr(sys, "get_int_max_str_digits", None)
    return getter() if getter is not None else 0


def _decoder(object_pairs_hook: Callable, parse_int: Callable) -> json.JSONDecoder:
    return json.JSONDecoder(object_pairs_hook=object_pairs_hook, parse_int=parse_int,
                            parse_float=_finite_float, parse_constant=_no_constants)


# The C scanner's memo is only a key-interning cache, so sharing decoders is safe.
# Plain int keeps integer parsing in C, bounded by the interpreter's digit limit
# (turned into a JSONInputError below); _bounded_int is the fallback for an
# interpreter whose limit is off or looser than ours.
_DECODERS = {
    (False, True): _decoder(_no_duplicates, int),
    (False, False): _decoder(_no_duplicates, _bounded_int),
    (True, True): _decoder(_Pairs, int),
    (True, False): _decoder(_Pairs, _bounded_int),
}

_BOM = b"\xef\xbb\xbf"
_JSON_SPACE = " \t\r\n"
# Escapes that may decode to a lone surrogate: a high one not followed by a low
# one, a low one not preceded by a high one, or one right after an escaped
# backslash (where the pairing read here may be misaligned). Valid pairs, which
# ensure_ascii clients emit for every emoji, do not match. The leading literal
# backslash lets the regex engine skip ahead quickly.
_MAYBE_LONE_SURROGATE = re.compile(
    rb"\\(?:\\u[dD]|u[dD](?:[89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD])[c-fC-F]))")
_SURROGATE = re.compile("[\ud800-\udfff]")


def loads(data: bytes | bytearray | memoryview, max_depth: int = MAX_DEPTH) -> object:
    """Parse one strict JSON document from UTF-8 bytes, or raise JSONInputError."""
    if not isinstance(data, bytes):
        if not isinstance(data, (bytearray, memoryview)):
            raise TypeError(f"loads() takes bytes, not {type(data).__name__}")
        data = bytes(data)
    if data.startswith(_BOM):
        raise JSONInputError("invalid JSON: a UTF-8 byte order mark is not allowed")
    try:
        text = data.decode("utf-8")  # strict: rejects overlongs, encoded surrogates, truncation
    except UnicodeDecodeError as e:
        line, column = _line_column(data, e.start)
        raise JSONInputError(f"invalid JSON: malformed UTF-8 at line {line} column {column} "
                             f"(byte {e.start})") from None
    if not text.strip(_JSON_SPACE):
        raise JSONInputError("invalid JSON: empty body")

    c_ints = 0 < _int_digit_limit() <= MAX_INT_DIGITS
    try:
        value = _decode(text, _DECODERS[False, c_ints])
    except _Duplicate:
        # Parse again keeping raw pairs; a syntax error later in the text wins.
        raise _duplicate_error(_decode(text, _DECODERS[True, c_ints])) from None
    # Each container opens with a bracket byte, so few brackets means shallow.
    openers = data.count(b"[") + data.count(b"{")
    if openers > max_depth and _too_deep(value, max_depth, openers):
        raise JSONInputError(f"invalid JSON: nesting deeper than {max_depth} levels")
    # UTF-8 never puts ASCII bytes inside a multibyte character: matches are real.
    if _MAYBE_LONE_SURROGATE.search(data):
        _check_surrogates(value)
    return value


def _line_column(data: bytes, offset: int) -> tuple[int, int]:
    line_start = data.rfind(b"\n", 0, offset) + 1
    return data.count(b"\n", 0, offset) + 1, offset - line_start + 1


def _decode(text: str, decoder: json.JSONDecoder) -> object:
    try:
        return decoder.decode(text)
    except json.JSONDecodeError as e:
        at = " " if e.msg.endswith(" at") else " at "  # some stdlib messages end in "at"
        raise JSONInputError(f"invalid JSON: {e.msg}{at}line {e.lineno} column {e.colno}") from None
    except _Reject as e:
        raise JSONInputError(str(e)) from None
    except RecursionError:  # the C scanner's own guard, far beyond any sane max_depth
        raise JSONInputError("invalid JSON: nesting too deep") from None
    except ValueError:  # int() past the interpreter's digit limit: the only ValueError left
        raise JSONInputError(f"invalid JSON: integer with more than {_int_digit_limit()} digits") from None


def _too_deep(value: object, max_depth: int, openers: int) -> bool:
    """Level-by-level breadth-first walk; the per-item work happens in C iterators.

    openers (bracket bytes in the body) bounds the number of containers, so the
    walk stops as soon as the containers not yet seen could not reach max_depth:
    a batch of token-id arrays never has its numbers visited.
    """
    lists = [value] if isinstance(value, list) else []
    dicts = [value] if isinstance(value, dict) else []
    depth = seen = 0
    while lists or dicts:
        depth += 1
        seen += len(lists) + len(dicts)
        if depth > max_depth:
            return True
        if depth + (openers - seen) <= max_depth:
            return False
        below = list(chain(chain.from_iterable(lists), chain.from_iterable(map(dict.values, dicts))))
        kinds = set(map(type, below))
        lists, dicts = _only(list, below, kinds), _only(dict, below, kinds)
    return False


def _only(cls: type, items: list, kinds: set) -> list:
    if cls not in kinds:
        return []
    if len(kinds) == 1:
        return items
    return list(compress(items, map(isinstance, items, repeat(cls))))


def _walk(root: object) -> Iterator[tuple[tuple, object]]:
    """Every value with its path, in document order, without recursion."""
    stack: list[Iterator] = [iter((((), root),))]
    while stack:
        item = next(stack[-1], None)
        if item is None:
            stack.pop()
            continue
        yield item
        path, value = item
        if isinstance(value, _Pairs):
            stack.append(_children(path, value))
        elif isinstance(value, dict):
            stack.append(_children(path, value.items()))
        elif isinstance(value, list):
            stack.append(_children(path, enumerate(value)))


def _children(path: tuple, pairs: Iterable[tuple]) -> Iterator[tuple[tuple, object]]:
    return ((path + (k,), v) for k, v in pairs)


def _duplicate_error(tree: object) -> JSONInputError:
    # A path seen twice is a repeated key (array indices never repeat).
    seen: set[tuple] = set()
    for path, _ in _walk(tree):
        if path in seen:
            param = _format_path(path)
            return JSONInputError(f"invalid JSON: duplicate key at {param}", DUPLICATE_KEY, param)
        seen.add(path)
    raise AssertionError("duplicate key vanished on the second parse")


def _check_surrogates(value: object) -> None:
    for path, item in _walk(value):
        if path and isinstance(path[-1], str) and _SURROGATE.search(path[-1]):
            what = "an object key"
        elif isinstance(item, str) and _SURROGATE.search(item):
            what = "a string"
        else:
            continue
        param = _format_path(path)
        where = f" at {param}" if param else ""
        raise JSONInputError(f"invalid JSON: lone UTF-16 surrogate escape in {what}{where}", param=param)


# --------------------------------------------------------------------------
# Field specs
# --------------------------------------------------------------------------
#
# A spec validates a parsed value and returns it: containers it describes come
# back as new dicts/lists holding only what was sent (no defaults invented);
# scalars come back as given. Failures travel up as _Fail, each container
# adding its path part on the way, so the success path builds no path strings.

class _Fail(Exception):
    def __init__(self, code: str, detail: str, where: list | None = None):
        self.code = code
        self.detail = detail
        self.where = where or []  # innermost part first

    def error(self, at: str | None = None) -> JSONInputError:
        parts = ([_Raw(at)] if at else []) + self.where[::-1]
        param = _format_path(parts)
        message = f"{param}: {self.detail}" if param else self.detail
        return JSONInputError(message, self.code, param)


def _kind(value: object) -> str:
    """The JSON type name of a Python value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _count_rule(n: int, lo: int, hi: int | None, one: str, many: str) -> None:
    if n < lo:
        if n == 0 and lo == 1:
            raise _Fail(INVALID_VALUE, "must not be empty")
        raise _Fail(INVALID_VALUE, f"must have at least {lo} {one if lo == 1 else many} (got {n})")
    if hi is not None and n > hi:
        raise _Fail(INVALID_VALUE, f"must have at most {hi} {one if hi == 1 else many} (got {n})")


def _apply_check(check: Callable[[Any], str | None], value: object) -> None:
    try:
        problem = check(value)
    except JSONInputError as e:
        # The JSON itself was fine, so the constructor's default code would mislead.
        code = INVALID_VALUE if e.code == INVALID_JSON else e.code
        raise _Fail(code, e.message, [_Raw(e.param)] if e.param else []) from None
    if problem is not None:
        if not isinstance(problem, str):
            raise TypeError(f"check {check!r} returned {problem!r}; return None or a message")
        raise _Fail(INVALID_VALUE, problem)


class Spec:
    """Base of all specs.

    optional: the field may be absent from its object (nothing is filled in).
    nullable: an explicit null is accepted (and returned as None); otherwise
              null is a wrong type, even on an optional field.
    check:    fn(value) -> None | message, run after the built-in rules for
              endpoint-specific rules. A message rejects as invalid_value at this
              value's path; fn may instead raise JSONInputError: its param, if
              any, is taken relative to this value, and its code is kept
              (the default "invalid_json" becomes "invalid_value").
    """

    type_name = "value"

    def __init__(self, *, optional: bool = False, nullable: bool = False,
                 check: Callable[[Any], str | None] | None = None):
        self.optional = optional
        self.nullable = nullable
        self.check = check

    def validate(self, value: object, at: str | None = None) -> Any:
        """Return the validated value or raise JSONInputError; ``at`` prefixes params."""
        try:
            return self._run(value)
        except _Fail as f:
            raise f.error(at) from None

    def _run(self, value: object) -> Any:
        if value is None and self.nullable:
            return None
        value = self._accept(value)
        if self.check is not None:
            _apply_check(self.check, value)
        return value

    def _accept(self, value: object) -> Any:
        raise NotImplementedError

    def _bulk(self, items: list) -> bool:
        """True if every item certainly passes (a C-speed fast path for big arrays)."""
        return False

    def _wrong_type(self, value: object) -> _Fail:
        return _Fail(INVALID_TYPE, f"expected {self.type_name}, got {_kind(value)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(...)"


class Any_(Spec):
    """Any JSON value, passed through unvalidated (null only if nullable)."""

    type_name = "non-null value"

    def _accept(self, value):
        if value is None:
            raise self._wrong_type(value)
        return value


class Null(Spec):
    """Exactly null, e.g. as an alternative in OneOf."""

    type_name = "null"

    def _accept(self, value):
        if value is not None:
            raise self._wrong_type(value)
        return None


class Bool(Spec):
    type_name = "boolean"

    def _accept(self, value):
        if not isinstance(value, bool):
            raise self._wrong_type(value)
        return value


class Str(Spec):
    """A string; lengths count code points."""

    type_name = "string"

    def __init__(self, *, min_len: int = 0, max_len: int | None = None, **kw):
        super().__init__(**kw)
        self.min_len, self.max_len = min_len, max_len

    def _accept(self, value):
        if not isinstance(value, str):
            raise self._wrong_type(value)
        _count_rule(len(value), self.min_len, self.max_len, "character", "characters")
        return value

    def _bulk(self, items):
        if self.check is not None or not set(map(type, items)) <= {str}:
            return False
        if not items or (self.min_len == 0 and self.max_len is None):
            return True
        lengths = list(map(len, items))
        return min(lengths) >= self.min_len and (self.max_len is None or max(lengths) <= self.max_len)


def _range_rule(value, lo, hi, gt=None, lt=None) -> None:
    if lo is not None and value < lo:
        raise _Fail(OUT_OF_RANGE, f"must be at least {lo} (got {_show(value)})")
    if hi is not None and value > hi:
        raise _Fail(OUT_OF_RANGE, f"must be at most {hi} (got {_show(value)})")
    if gt is not None and not value > gt:
        raise _Fail(OUT_OF_RANGE, f"must be greater than {gt} (got {_show(value)})")
    if lt is not None and not value < lt:
        raise _Fail(OUT_OF_RANGE, f"must be less than {lt} (got {_show(value)})")


class Int(Spec):
    """An integer. Booleans and floats (even 3.0) are wrong types."""

    type_name = "integer"

    def __init__(self, *, lo: int | None = None, hi: int | None = None, **kw):
        super().__init__(**kw)
        self.lo, self.hi = lo, hi

    def _accept(self, value):
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._wrong_type(value)
        _range_rule(value, self.lo, self.hi)
        return value

    def _bulk(self, items):  # token-id arrays: type and range checks in C
        if self.check is not None or not set(map(type, items)) <= {int}:
            return False
        return not items or ((self.lo is None or min(items) >= self.lo)
                             and (self.hi is None or max(items) <= self.hi))


class Num(Spec):
    """A finite number: integers pass (returned as int), booleans do not.

    lo/hi are inclusive bounds, gt/lt exclusive ones.
    """

    type_name = "number"

    def __init__(self, *, lo: float | None = None, hi: float | None = None,
                 gt: float | None = None, lt: float | None = None, **kw):
        super().__init__(**kw)
        self.lo, self.hi, self.gt, self.lt = lo, hi, gt, lt

    def _accept(self, value):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self._wrong_type(value)
        if isinstance(value, float) and not math.isfinite(value):
            raise _Fail(INVALID_VALUE, "must be a finite number")
        _range_rule(value, self.lo, self.hi, self.gt, self.lt)
        return value

    def _bulk(self, items):
        if self.check is not None or not set(map(type, items)) <= {int, float}:
            return False
        if not items:
            return True
        try:
            if not all(map(math.isfinite, items)):
                return False
        except OverflowError:  # an int beyond float range: let the item loop judge it
            return False
        low, high = min(items), max(items)
        return ((self.lo is None or low >= self.lo) and (self.hi is None or high <= self.hi)
                and (self.gt is None or low > self.gt) and (self.lt is None or high < self.lt))


class Enum(Spec):
    """One of fixed scalar values, compared with their JSON type (True is not 1)."""

    def __init__(self, values: Iterable[str | int | float | bool], **kw):
        super().__init__(**kw)
        self.values = tuple(values)
        if not self.values:
            raise ValueError("Enum needs at least one value")
        kinds = [_kind(v) for v in self.values]
        if not set(kinds) <= {"string", "integer", "number", "boolean"}:
            raise TypeError("Enum values must be JSON scalars")
        self._kinds = set(kinds)
        self._choices = set(zip(kinds, self.values))
        self.type_name = " or ".join(dict.fromkeys(kinds))

    def _accept(self, value):
        kind = _kind(value)
        if kind not in self._kinds:
            raise self._wrong_type(value)
        if (kind, value) not in self._choices:
            allowed = ", ".join(_show(v) for v in self.values)
            raise _Fail(INVALID_VALUE, f"must be one of {allowed} (got {_show(value)})")
        return value


class Arr(Spec):
    """An array whose items all match ``items`` (None: items unvalidated)."""

    type_name = "array"

    def __init__(self, items: Spec | None = None, *, min_len: int = 0,
                 max_len: int | None = None, **kw):
        super().__init__(**kw)
        if items is not None and not isinstance(items, Spec):
            raise TypeError(f"Arr items must be a Spec instance, not {items!r}")
        self.items, self.min_len, self.max_len = items, min_len, max_len

    def _accept(self, value):
        if not isinstance(value, list):
            raise self._wrong_type(value)
        # Length first: never validate a million items only to reject the count.
        _count_rule(len(value), self.min_len, self.max_len, "item", "items")
        spec = self.items
        if spec is None or spec._bulk(value):
            return list(value)
        out = []
        for i, item in enumerate(value):
            try:
                out.append(spec._run(item))
            except _Fail as f:
                f.where.append(i)
                raise
        return out


class Obj(Spec):
    """An object with declared fields; ``Obj(None)`` is any object, contents free-form.

    Fields are required unless their spec says optional=True. Unknown keys reject.
    """

    type_name = "object"

    def __init__(self, fields: Mapping[str, Spec] | None, **kw):
        super().__init__(**kw)
        if fields is not None:
            for name, spec in fields.items():
                if not isinstance(spec, Spec):
                    raise TypeError(f"field {name!r} needs a Spec instance, not {spec!r}")
            fields = dict(fields)
        self.fields = fields
        self._required = () if fields is None else tuple(k for k, s in fields.items() if not s.optional)

    def _accept(self, value):
        if not isinstance(value, dict):
            raise self._wrong_type(value)
        fields = self.fields
        if fields is None:
            return dict(value)
        out = {}
        for key, item in value.items():  # document order: the first culprit is reported
            spec = fields.get(key)
            if spec is None:
                raise _Fail(UNKNOWN_FIELD, "unknown field", [key])
            try:
                out[key] = spec._run(item)
            except _Fail as f:
                f.where.append(key)
                raise
        for key in self._required:
            if key not in out:
                raise _Fail(MISSING_FIELD, "missing required field", [key])
        return out


class Map(Spec):
    """An object used as a map: any keys (optionally checked by ``keys``), each
    value matching ``values`` (None: unvalidated), with an entry-count range."""

    type_name = "object"

    def __init__(self, values: Spec | None = None, *, keys: Spec | None = None,
                 min_len: int = 0, max_len: int | None = None, **kw):
        super().__init__(**kw)
        self.values, self.keys, self.min_len, self.max_len = values, keys, min_len, max_len

    def _accept(self, value):
        if not isinstance(value, dict):
            raise self._wrong_type(value)
        _count_rule(len(value), self.min_len, self.max_len, "entry", "entries")
        out = {}
        for key, item in value.items():
            if self.keys is not None:
                try:
                    self.keys._run(key)
                except _Fail as f:
                    raise _Fail(f.code, f"invalid key: {f.detail}", [key]) from None
            try:
                out[key] = item if self.values is None else self.values._run(item)
            except _Fail as f:
                f.where.append(key)
                raise
        return out


class Tagged(Spec):
    """An object whose string field ``key`` selects which Obj validates it, e.g.
    ``Tagged("type", {"text": Obj({"text": Str()}), "image_url": Obj({...})})``.
    A variant that does not declare ``key`` gets it added as that exact tag."""

    type_name = "object"

    def __init__(self, key: str, variants: Mapping[str, Obj], **kw):
        super().__init__(**kw)
        self.key = key
        self.variants: dict[str, Obj] = {}
        for tag, spec in variants.items():
            if not isinstance(spec, Obj) or spec.fields is None:
                raise TypeError(f"variant {tag!r} must be an Obj with declared fields")
            if key not in spec.fields:
                spec = Obj({key: Enum([tag]), **spec.fields}, check=spec.check)
            self.variants[tag] = spec

    def _accept(self, value):
        if not isinstance(value, dict):
            raise self._wrong_type(value)
        if self.key not in value:
            raise _Fail(MISSING_FIELD, "missing required field", [self.key])
        tag = value[self.key]
        if not isinstance(tag, str):
            raise _Fail(INVALID_TYPE, f"expected string, got {_kind(tag)}", [self.key])
        spec = self.variants.get(tag)
        if spec is None:
            allowed = ", ".join(_show(t) for t in self.variants)
            raise _Fail(INVALID_VALUE, f"must be one of {allowed} (got {_show(tag)})", [self.key])
        return spec._run(value)


def _progress(f: _Fail) -> tuple:
    # How far an alternative got: a wrong type at the top means it never applied;
    # otherwise deeper failures, then later array items, went further. Validation
    # runs in document order, so this picks the alternative the client most
    # plausibly meant.
    if f.code == INVALID_TYPE and not f.where:
        return (0,)
    return (1, len(f.where), tuple(p if isinstance(p, int) else 0 for p in reversed(f.where)))


class OneOf(Spec):
    """The first alternative that accepts the value wins. If none does, the
    failure of the alternative that got furthest is reported; if none even had
    the right type: "expected string or array, got integer"."""

    def __init__(self, *alternatives: Spec, **kw):
        super().__init__(**kw)
        if not alternatives or not all(isinstance(a, Spec) for a in alternatives):
            raise TypeError("OneOf needs Spec instances")
        self.alternatives = alternatives
        self.type_name = " or ".join(dict.fromkeys(a.type_name for a in alternatives))

    def _accept(self, value):
        failures = []
        for alternative in self.alternatives:
            try:
                return alternative._run(value)
            except _Fail as f:
                failures.append(f)
        best = max(failures, key=_progress)  # max keeps the first of equals
        if _progress(best) == (0,):
            raise self._wrong_type(value)
        raise best


def parse(data: bytes | bytearray | memoryview, spec: Spec, max_depth: int = MAX_DEPTH) -> Any:
    """loads() then spec.validate(): request bytes to validated values."""
    return spec.validate(loads(data, max_depth))
