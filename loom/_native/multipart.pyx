# cython: language_level=3, boundscheck=False, wraparound=False
"""multipart/form-data parser used by the server (Cython).

pymultipart.py beside this file is the pure-Python reference with the same API,
results and error messages; keep the two in step.  Framing follows RFC 2046
(CRLF-based delimiters, transport padding, preamble and epilogue), fields follow
RFC 7578, tokens and quoted strings follow RFC 7230.  Anything outside that
grammar raises MultipartError; nothing is repaired or guessed.

Speed comes from working on the body as a C buffer: part headers are found
with memchr/memcmp and validated byte by byte in C, so Python objects are only
created for the values returned and for error messages.  Delimiters are found
with bytes.find, whose CPython search is linear-time even on adversarial data
and at least as fast as a memchr scan on ordinary binary uploads.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeASCII, PyUnicode_DecodeUTF8
from libc.string cimport memchr, memcmp

__all__ = ["MultipartError", "Part", "boundary_of", "parse"]

cdef bint _TCHAR[128]
cdef bint _BCHAR[128]
cdef Py_ssize_t _k
for _k in range(128):
    _TCHAR[_k] = chr(_k) in "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    # RFC 2046 bchars; a boundary additionally must not end with a space.
    _BCHAR[_k] = chr(_k) in "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'()+_,-./:=? "


class MultipartError(ValueError):
    """Rejection of a malformed body. .message: str (human-readable, precise). The server turns it into HTTP 400."""

    def __init__(self, message):
        super().__init__(message)
        self.message = message


cdef class Part:
    """One form field: its Content-Disposition name/filename, headers, media type and exact bytes."""

    cdef public str name
    cdef public object filename
    cdef public list headers
    cdef public object content_type
    cdef public dict params
    cdef public bytes data

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
        cdef Part o = other
        return (self.name == o.name and self.filename == o.filename and self.headers == o.headers
                and self.content_type == o.content_type and self.params == o.params and self.data == o.data)

    def __repr__(self):
        return (f"Part(name={self.name!r}, filename={self.filename!r}, "
                f"content_type={self.content_type!r}, params={self.params!r}, {len(self.data)} bytes)")


# ---- header values (str): tokens, quoted strings, parameters ----------------------------------------

cdef inline bint _is_tchar(Py_UCS4 c):
    return c < 128 and _TCHAR[c]


# Error messages name what was being parsed as (index, label): index 0 is the request's own
# Content-Type, index k >= 1 prefixes "part k".  The text is built only when an error is raised.
cdef str _subject(Py_ssize_t index, str label):
    return label if index == 0 else f"part {index} {label}"


cdef object _malformed(Py_ssize_t index, str label, str s, Py_ssize_t i, str expected):
    found = repr(s[i]) if i < len(s) else "the end"
    return MultipartError(f"malformed {_subject(index, label)}: expected {expected} at offset {i}, found {found}")


cdef Py_ssize_t _token_end(str s, Py_ssize_t i):
    cdef Py_ssize_t n = len(s)
    while i < n and _is_tchar(s[i]):
        i += 1
    return i


cdef Py_ssize_t _skip_ows(str s, Py_ssize_t i):
    cdef Py_ssize_t n = len(s)
    cdef Py_UCS4 c
    while i < n:
        c = s[i]
        if c != u' ' and c != u'\t':
            break
        i += 1
    return i


cdef tuple _quoted(str s, Py_ssize_t i, Py_ssize_t index, str label):
    """s[i] is an opening quote: return (contents with quoted-pairs unescaped, index past the closing quote)."""
    cdef Py_ssize_t n = len(s)
    cdef Py_ssize_t run
    cdef Py_UCS4 c
    cdef list pieces = None
    i += 1
    run = i
    while i < n:
        c = s[i]
        if c == u'"':
            if pieces is None:
                return s[run:i], i + 1
            pieces.append(s[run:i])
            return "".join(pieces), i + 1
        if c == u'\\':
            if i + 1 == n:
                break
            if pieces is None:
                pieces = []
            pieces.append(s[run:i])
            run = i + 1  # the escaped character starts the next run
            i += 2
        else:
            i += 1
    raise _malformed(index, label, s, n, "a closing '\"'")


cdef dict _params(str s, Py_ssize_t i, Py_ssize_t index, str label):
    """Parse `*(OWS ";" OWS token "=" (token / quoted-string)) OWS` from s[i:].

    Returns {lower-cased name: value} in order of appearance; a repeated name rejects.
    """
    cdef dict params = {}
    cdef Py_ssize_t n = len(s)
    cdef Py_ssize_t j
    while True:
        i = _skip_ows(s, i)
        if i == n:
            return params
        if s[i] != u';':
            raise _malformed(index, label, s, i, "';'")
        i = _skip_ows(s, i + 1)
        j = _token_end(s, i)
        if j == i:
            raise _malformed(index, label, s, i, "a parameter name")
        key = s[i:j].lower()
        if j == n or s[j] != u'=':
            raise _malformed(index, label, s, j, "'='")
        i = j + 1
        if i < n and s[i] == u'"':
            value, i = _quoted(s, i, index, label)
        else:
            j = _token_end(s, i)
            if j == i:
                raise _malformed(index, label, s, i, "a parameter value")
            value = s[i:j]
            i = j
        if key in params:
            raise MultipartError(f"duplicate {_subject(index, label)} parameter {key!r}")
        params[key] = value


cdef tuple _media_type(str s, Py_ssize_t index, str label):
    """Parse `type/subtype *(; param)` into (lower-cased "type/subtype", params)."""
    cdef Py_ssize_t i = _token_end(s, 0)
    cdef Py_ssize_t j
    if i == 0:
        raise _malformed(index, label, s, 0, "a media type")
    if i == len(s) or s[i] != u'/':
        raise _malformed(index, label, s, i, "'/'")
    j = _token_end(s, i + 1)
    if j == i + 1:
        raise _malformed(index, label, s, j, "a media subtype")
    return s[:j].lower(), _params(s, j, index, label)


def boundary_of(str content_type not None):
    """Validate a request Content-Type header value `multipart/form-data; boundary=...` and return the boundary.

    Rejects (MultipartError) another media type, a missing or repeated boundary parameter, an empty or
    >70-character boundary, characters outside RFC 2046 bchars and malformed parameter syntax.
    """
    cdef str s = content_type.strip(" \t")
    cdef Py_UCS4 c
    for c in s:
        if c > u'~' or (c < u' ' and c != u'\t'):
            raise MultipartError(f"request Content-Type contains the character {c!r}")
    media, params = _media_type(s, 0, "request Content-Type")
    if media != "multipart/form-data":
        raise MultipartError(f"request Content-Type must be multipart/form-data, not {media!r}")
    cdef str boundary = params.get("boundary")
    if boundary is None:
        raise MultipartError("request Content-Type has no boundary parameter")
    if not 1 <= len(boundary) <= 70:
        raise MultipartError(f"multipart boundary must be 1 to 70 characters long, not {len(boundary)}")
    for c in boundary:
        if not _BCHAR[c]:  # every character is ASCII by the check above
            raise MultipartError(f"multipart boundary contains {c!r}, which RFC 2046 does not allow")
    if boundary[len(boundary) - 1] == u' ':
        raise MultipartError("multipart boundary must not end with a space")
    return boundary.encode("ascii")


# ---- the body (bytes): delimiters, header lines, parts ---------------------------------------------

cdef Py_ssize_t _find(const char* buf, Py_ssize_t start, Py_ssize_t end, const char* pat, Py_ssize_t m) noexcept:
    """Index of the first pat[:m] (which starts with CR) in buf[start:end], or -1.

    For the short CRLF patterns inside part headers, whose length max_part_header_bytes bounds.
    """
    cdef Py_ssize_t i = start
    cdef Py_ssize_t last = end - m  # the last index where a match fits
    cdef const char* p
    while i <= last:
        p = <const char*>memchr(buf + i, b'\r', last - i + 1)
        if p == NULL:
            return -1
        i = p - buf
        if memcmp(p, pat, m) == 0:
            return i
        i += 1
    return -1


cdef str _where(Py_ssize_t index):
    return f"part {index}"


cdef str _clip(bytes line):
    """repr() of a header line for an error message, bounded in length."""
    return repr(line[:64]) + ("..." if len(line) > 64 else "")


cdef list _header_lines(bytes body, Py_ssize_t start, Py_ssize_t end, Py_ssize_t index):
    """Split the header block body[start:end] (without its closing blank line) into [(lower-cased name, value)]."""
    cdef const unsigned char* buf = <const unsigned char*>PyBytes_AS_STRING(body)
    cdef list headers = []
    cdef Py_ssize_t line = start
    cdef Py_ssize_t eol, colon, i, a, b
    cdef unsigned char c
    while True:
        eol = _find(<const char*>buf, line, end, b"\r\n", 2)
        if eol < 0:
            eol = end
        colon = -1
        for i in range(line, eol):
            c = buf[i]
            if c == b'\r' or c == b'\n':
                raise MultipartError(f"{_where(index)}: bare CR or LF in part headers")
            if c == b':' and colon < 0:
                colon = i
        if buf[line] == b' ' or buf[line] == b'\t':
            raise MultipartError(f"{_where(index)}: part header line starts with whitespace (obsolete line folding)")
        if colon <= line:
            raise MultipartError(f"{_where(index)}: malformed part header line {_clip(body[line:eol])}")
        for i in range(line, colon):
            if buf[i] >= 128 or not _TCHAR[buf[i]]:
                raise MultipartError(f"{_where(index)}: malformed part header line {_clip(body[line:eol])}")
        name = PyUnicode_DecodeASCII(<const char*>buf + line, colon - line, NULL).lower()
        a = colon + 1
        b = eol
        while a < b and (buf[a] == b' ' or buf[a] == b'\t'):
            a += 1
        while b > a and (buf[b - 1] == b' ' or buf[b - 1] == b'\t'):
            b -= 1
        for i in range(a, b):
            c = buf[i]
            if (c < 0x20 and c != 0x09) or c == 0x7F:
                raise MultipartError(f"{_where(index)}: control character in part header {name!r}")
        try:
            value = PyUnicode_DecodeUTF8(<const char*>buf + a, b - a, NULL)
        except UnicodeDecodeError:
            raise MultipartError(f"{_where(index)}: part header {name!r} is not valid UTF-8") from None
        headers.append((name, value))
        if eol == end:
            return headers
        line = eol + 2


cdef tuple _disposition(str value, Py_ssize_t index):
    """Return (name, filename or None) from a `form-data; name=...; filename=...` value."""
    cdef Py_ssize_t i = _token_end(value, 0)
    if i == 0:
        raise _malformed(index, "Content-Disposition", value, 0, "a disposition type")
    kind = value[:i].lower()
    if kind != "form-data":
        raise MultipartError(f"{_where(index)}: Content-Disposition must be form-data, not {kind!r}")
    cdef dict params = _params(value, i, index, "Content-Disposition")
    for key in params:
        if key.endswith("*"):
            raise MultipartError(f"{_where(index)}: Content-Disposition parameter {key!r} (RFC 5987 encoding) is not "
                                 "supported; send the literal UTF-8 value in its plain form")
        if key != "name" and key != "filename":
            raise MultipartError(f"{_where(index)}: unsupported Content-Disposition parameter {key!r}")
    name = params.get("name")
    if name is None:
        raise MultipartError(f"{_where(index)}: Content-Disposition has no name parameter")
    if not name:
        raise MultipartError(f"{_where(index)}: Content-Disposition name is empty")
    return name, params.get("filename")


cdef Part _part(bytes body, Py_ssize_t hstart, Py_ssize_t hend, Py_ssize_t dstart, Py_ssize_t dend,
                Py_ssize_t index):
    cdef list headers = _header_lines(body, hstart, hend, index) if hend > hstart else []
    cdef Part part = Part.__new__(Part)
    disposition = None
    content_type = None
    params = {}
    for key, value in headers:
        if key == "content-disposition":
            if disposition is not None:
                raise MultipartError(f"{_where(index)}: duplicate Content-Disposition header")
            disposition = _disposition(value, index)
        elif key == "content-transfer-encoding" and value.lower() not in ("7bit", "8bit", "binary"):
            # Data is returned as sent: a base64 or quoted-printable part would reach consumers undecoded.
            raise MultipartError(f"{_where(index)}: Content-Transfer-Encoding {value!r} is not supported")
        elif key == "content-type":
            if content_type is not None:
                raise MultipartError(f"{_where(index)}: duplicate Content-Type header")
            content_type, params = _media_type(value, index, "Content-Type")
    if disposition is None:
        raise MultipartError(f"{_where(index)}: part has no Content-Disposition header")
    part.name, part.filename = disposition
    part.headers = headers
    part.content_type = content_type
    part.params = params
    part.data = PyBytes_FromStringAndSize(PyBytes_AS_STRING(body) + dstart, dend - dstart)
    return part


def parse(bytes body not None, str content_type not None, Py_ssize_t max_parts=1024,
          Py_ssize_t max_part_header_bytes=8192):
    """Parse a complete multipart/form-data body and return its parts in body order.

    max_parts bounds the number of parts; max_part_header_bytes bounds each part's header block
    (its header lines and their separating CRLFs, excluding the blank line that ends it).
    """
    cdef bytes delimiter = b"\r\n--" + boundary_of(content_type)
    cdef const char* buf = PyBytes_AS_STRING(body)
    cdef const char* delim = PyBytes_AS_STRING(delimiter)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(body)
    cdef Py_ssize_t m = PyBytes_GET_SIZE(delimiter)
    cdef Py_ssize_t pos, after, p, end, start, limit
    cdef bint closing
    cdef list parts = []
    if max_parts < 0 or max_part_header_bytes < 0:
        raise ValueError("max_parts and max_part_header_bytes must not be negative")
    # A delimiter is CRLF "--" boundary; the body may also start with it minus the CRLF.
    if n >= m - 2 and memcmp(buf, delim + 2, m - 2) == 0:
        pos = 0
    else:
        pos = body.find(delimiter)
        if pos < 0:
            raise MultipartError("multipart body has no opening boundary")
        pos += 2
    while True:
        # pos is at a `--boundary`; what follows decides between another part and the end.
        after = pos + m - 2
        closing = after + 2 <= n and buf[after] == b'-' and buf[after + 1] == b'-'
        if closing:
            if not parts:
                raise MultipartError("multipart body has no parts")
            after += 2
        p = after
        # RFC 2046 transport padding may follow a delimiter.
        while p < n and (buf[p] == b' ' or buf[p] == b'\t'):
            p += 1
        if p + 2 <= n and buf[p] == b'\r' and buf[p + 1] == b'\n':
            p += 2
        elif not (closing and p == n):
            # A body that stops where a valid one could go on is truncated rather than wrong.
            if p == n or (p == n - 1 and (buf[p] == b'\r' or (buf[p] == b'-' and p == after and not closing))):
                raise MultipartError("multipart body is truncated after a boundary")
            raise MultipartError(f"unexpected bytes after a multipart boundary at offset {p}")
        if closing:
            return parts  # whatever follows the CRLF is the epilogue
        if len(parts) == max_parts:
            raise MultipartError(f"multipart body has more than {max_parts} parts")
        if p + 2 <= n and buf[p] == b'\r' and buf[p + 1] == b'\n':
            end = p
            start = p + 2
        else:
            limit = p + min(max_part_header_bytes, n) + 4  # min() keeps the sum from overflowing
            end = _find(buf, p, limit if limit < n else n, b"\r\n\r\n", 4)
            if end < 0:
                if limit <= n:
                    raise MultipartError(
                        f"{_where(len(parts) + 1)}: part headers exceed {max_part_header_bytes} bytes")
                raise MultipartError(f"{_where(len(parts) + 1)}: multipart body ends inside the part headers")
            start = end + 4
        pos = body.find(delimiter, start)
        if pos < 0:
            raise MultipartError(
                f"{_where(len(parts) + 1)}: multipart body ends inside the part data (no closing boundary)")
        parts.append(_part(body, p, end, start, pos, len(parts) + 1))
        pos += 2
