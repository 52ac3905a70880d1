# cython: language_level=3, boundscheck=False, wraparound=False
"""Incremental HTTP/1.1 request framing: head, Content-Length and chunked bodies.

One RequestParser per connection. The server feeds it whatever recv() returned
and asks for the next complete request; a request is only handed out once its
whole body has arrived and been decoded, so routing always sees a complete,
validated request. Every dimension is bounded: the head (431), the decoded body
(413, raised as soon as a length or chunk size says it will be exceeded, before
the bytes arrive), chunk-size lines and trailers (400). Any framing error is
final for the connection: after it the byte stream cannot be trusted to resync.
"""

cdef enum:
    IDLE = 0
    HEAD = 1
    BODY = 2          # Content-Length body
    CHUNK_SIZE = 3
    CHUNK_DATA = 4
    CHUNK_END = 5     # the CRLF after chunk data
    TRAILERS = 6

MAX_HEADERS = 128
MAX_LEADING_CRLF = 8  # RFC 9112 2.2: ignore a few empty lines before a request line


import re


class FramingError(Exception):
    """A request the connection cannot carry. The server answers `status` and closes."""

    def __init__(self, status, code, message):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


# Host = uri-host [":" port]: an IP literal or a reg-name; no spaces, no comma (a list of hosts).
HOST = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[-A-Za-z0-9._~!$&'()*+;=%]*)(?::[0-9]*)?\Z")

# RFC 9110 tchar: the characters allowed in methods, header names and codings.
cdef unsigned char TCHAR[256]
cdef unsigned char HEXVAL[256]


cdef void _init_tables():
    cdef int c
    for c in range(256):
        TCHAR[c] = 0
        HEXVAL[c] = 255
    for c in b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ":
        TCHAR[c] = 1
    for c in range(10):
        HEXVAL[48 + c] = c
    for c in range(6):
        HEXVAL[97 + c] = 10 + c
        HEXVAL[65 + c] = 10 + c


_init_tables()


cdef bint _is_token(bytes s):
    cdef const unsigned char* p = s
    cdef Py_ssize_t i, n = len(s)
    if n == 0:
        return False
    for i in range(n):
        if not TCHAR[p[i]]:
            return False
    return True


cdef bint _is_field_value(bytes s):
    # VCHAR, obs-text, SP and HTAB; no other controls (NUL, bare CR/LF, DEL).
    cdef const unsigned char* p = s
    cdef Py_ssize_t i, n = len(s)
    cdef unsigned char c
    for i in range(n):
        c = p[i]
        if (c < 0x20 and c != 0x09) or c == 0x7F:
            return False
    return True


cdef bint _is_target(bytes s):
    cdef const unsigned char* p = s
    cdef Py_ssize_t i, n = len(s)
    if n == 0:
        return False
    for i in range(n):
        if p[i] <= 0x20 or p[i] >= 0x7F:
            return False
    return True


cdef list _split_lines(bytes block):
    """Split a head or trailer block on CRLF; a bare CR or LF anywhere rejects."""
    cdef list lines = block.split(b"\r\n")
    cdef bytes line
    for line in lines:
        if b"\n" in line or b"\r" in line:
            raise FramingError(400, "bare_line_ending", "bare CR or LF in the message head")
    return lines


cdef list _parse_fields(list lines, int max_fields):
    cdef list fields = []
    cdef bytes line, name, value
    cdef Py_ssize_t colon
    for line in lines:
        if not line:
            continue
        if line[0] == 0x20 or line[0] == 0x09:
            raise FramingError(400, "obsolete_line_folding", "obsolete header line folding is not accepted")
        colon = line.find(b":")
        if colon <= 0:
            raise FramingError(400, "malformed_header", "header line without a field name and colon")
        name = line[:colon]
        if not _is_token(name):
            raise FramingError(400, "malformed_header", "invalid header field name")
        value = line[colon + 1:].strip(b" \t")
        if not _is_field_value(value):
            raise FramingError(400, "malformed_header", "control character in a header field value")
        fields.append((name.decode("ascii").lower(), value.decode("latin-1")))
        if len(fields) > max_fields:
            raise FramingError(431, "too_many_headers", f"more than {max_fields} header fields")
    return fields


cdef class RequestParser:
    """Feed bytes in with feed(); take complete requests out with next_request().

    next_request() returns None until a whole request (head and decoded body)
    is available, then a tuple (method, target, version, headers, body,
    keep_alive): version is 10 or 11, headers a list of (lower-case name,
    latin-1 value) in arrival order, body bytes. It raises FramingError.
    """

    cdef bytes buf                  # unconsumed input starts at pos; replaced, not grown, by feed
    cdef Py_ssize_t pos
    cdef Py_ssize_t scan            # where the next CRLFCRLF search resumes
    cdef int state
    cdef Py_ssize_t header_bytes, body_bytes, chunk_line_bytes, trailer_bytes
    cdef Py_ssize_t remaining       # bytes left of the current CL body or chunk
    cdef Py_ssize_t trailer_used
    cdef int leading                # empty lines skipped before this request line
    cdef list body                  # body pieces, joined once at the end
    cdef Py_ssize_t body_len
    cdef object head                # (method, target, version, headers, keep_alive)
    cdef readonly bint failed

    def __init__(self, Py_ssize_t header_bytes=16384, Py_ssize_t body_bytes=1 << 20,
                 Py_ssize_t chunk_line_bytes=1024, Py_ssize_t trailer_bytes=8192):
        self.buf = b""
        self.pos = 0
        self.scan = 0
        self.state = IDLE
        self.header_bytes = header_bytes
        self.body_bytes = body_bytes
        self.chunk_line_bytes = chunk_line_bytes
        self.trailer_bytes = trailer_bytes
        self.body = []
        self.body_len = 0
        self.head = None
        self.leading = 0
        self.failed = False

    @property
    def state(self):
        """'idle' (nothing of a next request buffered), 'head', 'body' or 'failed'."""
        if self.failed:
            return "failed"
        if self.state == IDLE:
            return "head" if self.pos < len(self.buf) else "idle"
        return "head" if self.state == HEAD else "body"

    @property
    def buffered(self):
        """Bytes received but not yet consumed by a returned request."""
        return len(self.buf) - self.pos

    def feed(self, data):
        if self.failed:
            raise FramingError(400, "connection_failed", "the connection already failed framing")
        # Keep only what is pending: when everything was consumed (the common
        # case for bodies) the new read becomes the buffer without a copy.
        if self.pos >= len(self.buf):
            self.buf = bytes(data)
            self.scan = 0
        else:
            self.buf = self.buf[self.pos:] + data
            self.scan = max(0, self.scan - self.pos)
        self.pos = 0

    def next_request(self):
        if self.failed:
            raise FramingError(400, "connection_failed", "the connection already failed framing")
        try:
            return self._advance()
        except FramingError:
            self.failed = True
            raise

    cdef object _advance(self):
        cdef Py_ssize_t end
        while True:
            if self.state == IDLE or self.state == HEAD:
                if not self._take_head():
                    return None
            elif self.state == BODY:
                if not self._take_bytes():
                    return None
                return self._finish()
            elif self.state == CHUNK_SIZE:
                if not self._take_chunk_size():
                    return None
            elif self.state == CHUNK_DATA:
                if not self._take_bytes():
                    return None
                self.state = CHUNK_END
            elif self.state == CHUNK_END:
                if len(self.buf) - self.pos < 2:
                    return None
                if self.buf[self.pos] != 13 or self.buf[self.pos + 1] != 10:
                    raise FramingError(400, "malformed_chunk", "chunk data is not followed by CRLF")
                self.pos += 2
                self.state = CHUNK_SIZE
            elif self.state == TRAILERS:
                if not self._take_trailers():
                    return None
                return self._finish()

    cdef bint _take_head(self) except -1:
        cdef Py_ssize_t n = len(self.buf)
        cdef Py_ssize_t end
        # Empty lines before the request line are tolerated (RFC 9112 2.2).
        while n - self.pos >= 2 and self.buf[self.pos] == 13 and self.buf[self.pos + 1] == 10:
            self.pos += 2
            self.leading += 1
            if self.leading > MAX_LEADING_CRLF:
                raise FramingError(400, "malformed_request_line", "too many empty lines before the request line")
        if self.pos >= n:
            self.state = IDLE
            return False
        self.state = HEAD
        if self.scan < self.pos:
            self.scan = self.pos
        end = self.buf.find(b"\r\n\r\n", self.scan)
        if end < 0:
            if n - self.pos > self.header_bytes:
                raise FramingError(431, "header_too_large", f"request head exceeds {self.header_bytes} bytes")
            self.scan = max(self.pos, n - 3)
            return False
        if end + 4 - self.pos > self.header_bytes:
            raise FramingError(431, "header_too_large", f"request head exceeds {self.header_bytes} bytes")
        block = self.buf[self.pos:end]
        self.pos = end + 4
        self._parse_head(block)
        return True

    cdef int _parse_head(self, bytes block) except -1:
        cdef list lines = _split_lines(block)
        cdef bytes request_line = lines[0]
        cdef list parts = request_line.split(b" ")
        if len(parts) != 3:
            raise FramingError(400, "malformed_request_line", "request line is not 'METHOD target HTTP/1.x'")
        method, target, version_bytes = parts
        if not _is_token(method):
            raise FramingError(400, "malformed_request_line", "invalid method")
        if not _is_target(target):
            raise FramingError(400, "malformed_request_line", "invalid request target")
        if version_bytes == b"HTTP/1.1":
            version = 11
        elif version_bytes == b"HTTP/1.0":
            version = 10
        elif len(version_bytes) == 8 and version_bytes[:5] == b"HTTP/" and version_bytes[6] == 0x2E:
            raise FramingError(505, "http_version_not_supported", "only HTTP/1.0 and HTTP/1.1 are served")
        else:
            raise FramingError(400, "malformed_request_line", "invalid HTTP version")
        target = _origin_form(target)
        headers = _parse_fields(lines[1:], MAX_HEADERS)

        hosts = 0
        content_length = None
        codings = None
        keep_alive = version == 11
        for name, value in headers:
            if name == "host":
                hosts += 1
            elif name == "content-length":
                if content_length is not None:
                    raise FramingError(400, "ambiguous_framing", "more than one Content-Length")
                if not value.isdigit() or not value.isascii() or len(value) > 18:
                    raise FramingError(400, "invalid_content_length", "Content-Length is not a decimal byte count")
                content_length = int(value)
            elif name == "transfer-encoding":
                codings = (codings or []) + [c.strip().lower() for c in value.split(",")]
            elif name == "connection":
                tokens = {c.strip().lower() for c in value.split(",")}
                if "close" in tokens:
                    keep_alive = False
                elif version == 10 and "keep-alive" in tokens:
                    keep_alive = True
            elif name == "expect":
                if value:
                    raise FramingError(417, "expectation_failed",
                                       "Expect is not supported; send the body directly (curl: -H 'Expect:')")
        if version == 11 and hosts != 1:
            raise FramingError(400, "invalid_host", "an HTTP/1.1 request needs exactly one Host header")
        for name, value in headers:
            if name == "host" and not HOST.match(value):
                raise FramingError(400, "invalid_host", "the Host header is not a host[:port]")

        self.head = (method.decode("ascii"), target.decode("ascii"), version, headers, keep_alive)
        self.body = []
        self.body_len = 0
        if codings is not None:
            if content_length is not None:
                raise FramingError(400, "ambiguous_framing", "both Content-Length and Transfer-Encoding")
            if version == 10:
                raise FramingError(400, "ambiguous_framing", "Transfer-Encoding in an HTTP/1.0 request")
            for coding in codings:
                if coding != "chunked":
                    raise FramingError(501, "unsupported_transfer_encoding",
                                       f"transfer coding {coding!r} is not supported; use chunked or Content-Length")
            if len(codings) != 1:
                raise FramingError(400, "malformed_transfer_encoding", "chunked may be applied only once")
            self.state = CHUNK_SIZE
        elif content_length is not None:
            if content_length > self.body_bytes:
                raise FramingError(413, "body_too_large",
                                   f"request body of {content_length} bytes exceeds the {self.body_bytes}-byte limit")
            self.remaining = content_length
            self.state = BODY
        else:
            self.remaining = 0
            self.state = BODY
        return 0

    cdef bint _take_bytes(self) except -1:
        """Move up to `remaining` bytes into the body; True once they have all arrived."""
        cdef Py_ssize_t avail = len(self.buf) - self.pos
        cdef Py_ssize_t take = self.remaining if self.remaining < avail else avail
        if take > 0:
            self.body.append(self.buf[self.pos:self.pos + take])  # no copy when it is the whole read
            self.body_len += take
            self.pos += take
            self.remaining -= take
        return self.remaining == 0

    cdef bint _take_chunk_size(self) except -1:
        cdef Py_ssize_t n = len(self.buf)
        cdef Py_ssize_t end = self.buf.find(b"\r\n", self.pos, min(n, self.pos + self.chunk_line_bytes + 2))
        cdef Py_ssize_t i, sized, digits = 0
        cdef unsigned long long size = 0
        cdef unsigned char c, v
        if end < 0:
            if n - self.pos > self.chunk_line_bytes:
                raise FramingError(400, "chunk_line_too_long", f"chunk-size line exceeds {self.chunk_line_bytes} bytes")
            return False
        i = self.pos
        while i < end:
            c = self.buf[i]
            v = HEXVAL[c]
            if v == 255:
                break
            digits += 1
            if digits > 15:
                raise FramingError(400, "malformed_chunk", "chunk size has too many digits")
            size = size * 16 + v
            i += 1
        if digits == 0:
            raise FramingError(400, "malformed_chunk", "chunk size is not hexadecimal")
        # Whatever follows the size must be chunk extensions (";name=value"), which we ignore;
        # whitespace may come before one (BWS), never alone.
        sized = i
        while i < end and (self.buf[i] == 0x20 or self.buf[i] == 0x09):
            i += 1
        if i == end and i > sized:
            raise FramingError(400, "malformed_chunk", "whitespace after chunk size")
        if i < end:
            if self.buf[i] != 0x3B:
                raise FramingError(400, "malformed_chunk", "invalid character after chunk size")
            if not _is_field_value(self.buf[i:end]):
                raise FramingError(400, "malformed_chunk", "control character in a chunk extension")
        self.pos = end + 2
        if size == 0:
            self.trailer_used = 0
            self.state = TRAILERS
            return True
        if <Py_ssize_t>size > self.body_bytes - self.body_len:
            raise FramingError(413, "body_too_large",
                               f"chunked request body exceeds the {self.body_bytes}-byte limit")
        self.remaining = <Py_ssize_t>size
        self.state = CHUNK_DATA
        return True

    cdef bint _take_trailers(self) except -1:
        # Trailer fields are validated like headers, bounded, and then discarded:
        # nothing in Loom's contract is carried in trailers.
        cdef Py_ssize_t end
        while True:
            end = self.buf.find(b"\r\n", self.pos)
            if end < 0:
                if self.trailer_used + len(self.buf) - self.pos > self.trailer_bytes:
                    raise FramingError(431, "trailers_too_large", f"trailers exceed {self.trailer_bytes} bytes")
                return False
            self.trailer_used += end + 2 - self.pos
            if self.trailer_used > self.trailer_bytes:
                raise FramingError(431, "trailers_too_large", f"trailers exceed {self.trailer_bytes} bytes")
            line = self.buf[self.pos:end]
            self.pos = end + 2
            if not line:
                return True
            _parse_fields(_split_lines(line), MAX_HEADERS)

    cdef object _finish(self):
        method, target, version, headers, keep_alive = self.head
        body = b"".join(self.body)
        self.body = []
        self.body_len = 0
        self.head = None
        self.state = IDLE
        self.scan = self.pos
        self.leading = 0
        return (method, target, version, headers, body, keep_alive)


cdef bytes _origin_form(bytes target):
    """Reduce absolute-form targets (which servers must accept) to their path and query."""
    cdef Py_ssize_t slash
    if target[0] == 0x2F or target == b"*":
        return target
    lower = target[:8].lower()
    if lower.startswith(b"http://") or lower.startswith(b"https://"):
        slash = target.find(b"/", target.find(b"//") + 2)
        return target[slash:] if slash >= 0 else b"/"
    raise FramingError(400, "malformed_request_line", "request target must be a path")
