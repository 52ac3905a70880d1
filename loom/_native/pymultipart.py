"""Pure-Python multipart/form-data parser: the reference for loom._native.multipart.

Same API, same results and the same error messages as the Cython module; tests
use it as a differential oracle and bench/ as the baseline.  Framing follows
RFC 2046 (CRLF-based delimiters, transport padding, preamble and epilogue),
fields follow RFC 7578, tokens and quoted strings follow RFC 7230.  Anything
outside that grammar raises MultipartError; nothing is repaired or guessed.
"""

__all__ = ["MultipartError", "Part", "boundary_of", "parse"]

_TCHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_TCHAR_BYTES = frozenset(ord(c) for c in _TCHARS)
# RFC 2046 bchars; a boundary additionally must not end with a space.
_BCHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'()+_,-./:=? ")
_CRLF = b"\r\n"
_PADDING = b" \t"


class MultipartError(ValueError):
    """Rejection of a malformed body. .message: str (human-readable, precise). The server turns it into HTTP 400."""

    def __init__(self, message):
        super().__init__(message)
        self.message = message


class Part:
    """One form field: its Content-Disposition name/filename, headers, media type and exact bytes."""

    __slots__ = ("name", "filename", "headers", "content_type", "params", "data")

    def __init__(self, name, filename, headers, content_type, params, data):
        self.name = name
        self.filename = filename
        self.headers = headers
        self.content_type = content_type
        self.params = params
        self.data = data

    def __eq__(self, other):
        if not isinstance(other, Part):
            return NotImplemented
        return all(getattr(self, a) == getattr(other, a) for a in Part.__slots__)

    def __repr__(self):
        return (f"Part(name={self.name!r}, filename={self.filename!r}, "
                f"content_type={self.content_type!r}, params={self.params!r}, {len(self.data)} bytes)")


def _clip(line):
    """repr() of a header line for an error message, bounded in length."""
    return repr(line[:64]) + ("..." if len(line) > 64 else "")


def _malformed(what, s, i, expected):
    found = repr(s[i]) if i < len(s) else "the end"
    return MultipartError(f"malformed {what}: expected {expected} at offset {i}, found {found}")


def _token_end(s, i):
    n = len(s)
    while i < n and s[i] in _TCHARS:
        i += 1
    return i


def _skip_ows(s, i):
    n = len(s)
    while i < n and s[i] in " \t":
        i += 1
    return i


def _quoted(s, i, what):
    """s[i] is an opening quote: return (contents with quoted-pairs unescaped, index past the closing quote)."""
    out = []
    n = len(s)
    i += 1
    while i < n:
        c = s[i]
        if c == '"':
            return "".join(out), i + 1
        if c == "\\":
            i += 1
            if i == n:
                break
        out.append(s[i])
        i += 1
    raise _malformed(what, s, n, "a closing '\"'")


def _params(s, i, what):
    """Parse `*(OWS ";" OWS token "=" (token / quoted-string)) OWS` from s[i:].

    Returns {lower-cased name: value} in order of appearance; a repeated name rejects.
    """
    params = {}
    n = len(s)
    while True:
        i = _skip_ows(s, i)
        if i == n:
            return params
        if s[i] != ";":
            raise _malformed(what, s, i, "';'")
        i = _skip_ows(s, i + 1)
        j = _token_end(s, i)
        if j == i:
            raise _malformed(what, s, i, "a parameter name")
        key = s[i:j].lower()
        if j == n or s[j] != "=":
            raise _malformed(what, s, j, "'='")
        i = j + 1
        if i < n and s[i] == '"':
            value, i = _quoted(s, i, what)
        else:
            j = _token_end(s, i)
            if j == i:
                raise _malformed(what, s, i, "a parameter value")
            value = s[i:j]
            i = j
        if key in params:
            raise MultipartError(f"duplicate {what} parameter {key!r}")
        params[key] = value


def _media_type(s, what):
    """Parse `type/subtype *(; param)` into (lower-cased "type/subtype", params)."""
    i = _token_end(s, 0)
    if i == 0:
        raise _malformed(what, s, 0, "a media type")
    if i == len(s) or s[i] != "/":
        raise _malformed(what, s, i, "'/'")
    j = _token_end(s, i + 1)
    if j == i + 1:
        raise _malformed(what, s, j, "a media subtype")
    return s[:j].lower(), _params(s, j, what)


def boundary_of(content_type):
    """Validate a request Content-Type header value `multipart/form-data; boundary=...` and return the boundary.

    Rejects (MultipartError) another media type, a missing or repeated boundary parameter, an empty or
    >70-character boundary, characters outside RFC 2046 bchars and malformed parameter syntax.
    """
    s = content_type.strip(" \t")
    for c in s:
        if c > "~" or (c < " " and c != "\t"):
            raise MultipartError(f"request Content-Type contains the character {c!r}")
    media, params = _media_type(s, "request Content-Type")
    if media != "multipart/form-data":
        raise MultipartError(f"request Content-Type must be multipart/form-data, not {media!r}")
    boundary = params.get("boundary")
    if boundary is None:
        raise MultipartError("request Content-Type has no boundary parameter")
    if not 1 <= len(boundary) <= 70:
        raise MultipartError(f"multipart boundary must be 1 to 70 characters long, not {len(boundary)}")
    for c in boundary:
        if c not in _BCHARS:
            raise MultipartError(f"multipart boundary contains {c!r}, which RFC 2046 does not allow")
    if boundary[-1] == " ":
        raise MultipartError("multipart boundary must not end with a space")
    return boundary.encode("ascii")


def _header_lines(block, where):
    """Split a part's header block (without its closing blank line) into [(lower-cased name, value)]."""
    headers = []
    for line in block.split(_CRLF):
        if b"\r" in line or b"\n" in line:
            raise MultipartError(f"{where}: bare CR or LF in part headers")
        if line[:1] in (b" ", b"\t"):
            raise MultipartError(f"{where}: part header line starts with whitespace (obsolete line folding)")
        colon = line.find(b":")
        if colon <= 0 or any(c not in _TCHAR_BYTES for c in line[:colon]):
            raise MultipartError(f"{where}: malformed part header line {_clip(line)}")
        name = line[:colon].decode("ascii").lower()
        value = line[colon + 1:].strip(_PADDING)
        if any(c < 0x20 and c != 0x09 or c == 0x7F for c in value):
            raise MultipartError(f"{where}: control character in part header {name!r}")
        try:
            headers.append((name, value.decode("utf-8")))
        except UnicodeDecodeError:
            raise MultipartError(f"{where}: part header {name!r} is not valid UTF-8") from None
    return headers


def _disposition(value, where):
    """Return (name, filename or None) from a `form-data; name=...; filename=...` value."""
    what = f"{where} Content-Disposition"
    i = _token_end(value, 0)
    if i == 0:
        raise _malformed(what, value, 0, "a disposition type")
    kind = value[:i].lower()
    if kind != "form-data":
        raise MultipartError(f"{where}: Content-Disposition must be form-data, not {kind!r}")
    params = _params(value, i, what)
    for key in params:
        if key.endswith("*"):
            raise MultipartError(f"{where}: Content-Disposition parameter {key!r} (RFC 5987 encoding) is not "
                                 "supported; send the literal UTF-8 value in its plain form")
        if key not in ("name", "filename"):
            raise MultipartError(f"{where}: unsupported Content-Disposition parameter {key!r}")
    name = params.get("name")
    if name is None:
        raise MultipartError(f"{where}: Content-Disposition has no name parameter")
    if not name:
        raise MultipartError(f"{where}: Content-Disposition name is empty")
    return name, params.get("filename")


def _part(block, data, where):
    headers = _header_lines(block, where) if block else []
    disposition = content_type = None
    params = {}
    for key, value in headers:
        if key == "content-disposition":
            if disposition is not None:
                raise MultipartError(f"{where}: duplicate Content-Disposition header")
            disposition = _disposition(value, where)
        elif key == "content-transfer-encoding" and value.lower() not in ("7bit", "8bit", "binary"):
            # Data is returned as sent: a base64 or quoted-printable part would reach consumers undecoded.
            raise MultipartError(f"{where}: Content-Transfer-Encoding {value!r} is not supported")
        elif key == "content-type":
            if content_type is not None:
                raise MultipartError(f"{where}: duplicate Content-Type header")
            content_type, params = _media_type(value, f"{where} Content-Type")
    if disposition is None:
        raise MultipartError(f"{where}: part has no Content-Disposition header")
    return Part(disposition[0], disposition[1], headers, content_type, params, data)


def parse(body, content_type, max_parts=1024, max_part_header_bytes=8192):
    """Parse a complete multipart/form-data body and return its parts in body order.

    max_parts bounds the number of parts; max_part_header_bytes bounds each part's header block
    (its header lines and their separating CRLFs, excluding the blank line that ends it).
    """
    if not isinstance(body, bytes):
        raise TypeError(f"body must be bytes, not {type(body).__name__}")
    if max_parts < 0 or max_part_header_bytes < 0:
        raise ValueError("max_parts and max_part_header_bytes must not be negative")
    dash = b"--" + boundary_of(content_type)
    delimiter = _CRLF + dash
    n = len(body)
    if body.startswith(dash):
        pos = 0
    else:
        pos = body.find(delimiter)
        if pos < 0:
            raise MultipartError("multipart body has no opening boundary")
        pos += 2
    parts = []
    while True:
        # pos is at a `--boundary`; what follows decides between another part and the end.
        after = pos + len(dash)
        closing = body.startswith(b"--", after)
        if closing:
            if not parts:
                raise MultipartError("multipart body has no parts")
            after += 2
        p = after
        # RFC 2046 transport padding may follow a delimiter.
        while p < n and body[p] in _PADDING:
            p += 1
        if body.startswith(_CRLF, p):
            p += 2
        elif not (closing and p == n):
            # A body that stops where a valid one could go on is truncated rather than wrong.
            rest = body[p:p + 2]
            if p == n or rest == b"\r" or (rest == b"-" and p == after and not closing):
                raise MultipartError("multipart body is truncated after a boundary")
            raise MultipartError(f"unexpected bytes after a multipart boundary at offset {p}")
        if closing:
            return parts  # whatever follows the CRLF is the epilogue
        if len(parts) == max_parts:
            raise MultipartError(f"multipart body has more than {max_parts} parts")
        where = f"part {len(parts) + 1}"
        if body.startswith(_CRLF, p):
            end = p
            start = p + 2
        else:
            limit = p + max_part_header_bytes + 4
            end = body.find(b"\r\n\r\n", p, limit)
            if end < 0:
                if limit <= n:
                    raise MultipartError(f"{where}: part headers exceed {max_part_header_bytes} bytes")
                raise MultipartError(f"{where}: multipart body ends inside the part headers")
            start = end + 4
        pos = body.find(delimiter, start)
        if pos < 0:
            raise MultipartError(f"{where}: multipart body ends inside the part data (no closing boundary)")
        parts.append(_part(body[p:end], body[start:pos], where))
        pos += 2
