"""Pure-Python reference for loom._native.framing, with the same API and results.

Written independently of the Cython parser (regular expressions instead of
byte tables) so tests can use it as a differential oracle, and bench/http.py as
the baseline the Cython parser is measured against. The server never uses it.
"""

import re

MAX_HEADERS = 128
MAX_LEADING_CRLF = 8

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*\Z")
_TARGET = re.compile(rb"[\x21-\x7e]+\Z")
_HEX = re.compile(rb"([0-9A-Fa-f]*)(?:[ \t]*(;.*))?\Z", re.S)   # whitespace only before an extension
# Host = uri-host [":" port]: an IP literal or a reg-name; no spaces, and no comma (a list of hosts).
HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~!$&'()*+;=%-]*)(:[0-9]*)?\Z")


class FramingError(Exception):
    def __init__(self, status, code, message):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def _fields(block):
    fields = []
    for line in block.split(b"\r\n"):
        if b"\r" in line or b"\n" in line:
            raise FramingError(400, "bare_line_ending", "bare CR or LF in the message head")
        if not line:
            continue
        if line[:1] in (b" ", b"\t"):
            raise FramingError(400, "obsolete_line_folding", "obsolete header line folding is not accepted")
        name, colon, value = line.partition(b":")
        if not colon or not name:
            raise FramingError(400, "malformed_header", "header line without a field name and colon")
        if not _TOKEN.match(name):
            raise FramingError(400, "malformed_header", "invalid header field name")
        value = value.strip(b" \t")
        if not _VALUE.match(value):
            raise FramingError(400, "malformed_header", "control character in a header field value")
        fields.append((name.decode("ascii").lower(), value.decode("latin-1")))
        if len(fields) > MAX_HEADERS:
            raise FramingError(431, "too_many_headers", f"more than {MAX_HEADERS} header fields")
    return fields


class RequestParser:
    def __init__(self, header_bytes=16384, body_bytes=1 << 20, chunk_line_bytes=1024, trailer_bytes=8192):
        self.limits = (header_bytes, body_bytes, chunk_line_bytes, trailer_bytes)
        self.data = b""
        self.step = "head"
        self.head = None
        self.body = []
        self.body_len = 0
        self.left = 0
        self.trailer_used = 0
        self.leading = 0
        self.failed = False

    @property
    def state(self):
        if self.failed:
            return "failed"
        if self.step == "head":
            return "head" if self.data else "idle"
        return "body"

    @property
    def buffered(self):
        return len(self.data)

    def feed(self, data):
        if self.failed:
            raise FramingError(400, "connection_failed", "the connection already failed framing")
        self.data += bytes(data)

    def next_request(self):
        if self.failed:
            raise FramingError(400, "connection_failed", "the connection already failed framing")
        try:
            return self._run()
        except FramingError:
            self.failed = True
            raise

    def _run(self):
        header_bytes, body_bytes, chunk_line_bytes, trailer_bytes = self.limits
        while True:
            if self.step == "head":
                while self.data.startswith(b"\r\n"):
                    self.data = self.data[2:]
                    self.leading += 1
                    if self.leading > MAX_LEADING_CRLF:
                        raise FramingError(400, "malformed_request_line", "too many empty lines before the request line")
                stripped = self.data
                if not stripped:
                    return None
                end = stripped.find(b"\r\n\r\n")
                if end < 0 or end + 4 > header_bytes:
                    if len(stripped) > header_bytes or end >= 0:
                        raise FramingError(431, "header_too_large", f"request head exceeds {header_bytes} bytes")
                    return None
                self.data = stripped[end + 4:]
                self._head(stripped[:end], body_bytes)
            elif self.step == "length":
                if len(self.data) < self.left:
                    return None
                self.body.append(self.data[: self.left])
                self.data = self.data[self.left:]
                return self._done()
            elif self.step == "size":
                end = self.data.find(b"\r\n", 0, chunk_line_bytes + 2)
                if end < 0:
                    if len(self.data) > chunk_line_bytes:
                        raise FramingError(400, "chunk_line_too_long", f"chunk-size line exceeds {chunk_line_bytes} bytes")
                    return None
                m = _HEX.match(self.data[:end])
                digits = m.group(1) if m else None
                if digits is not None and len(digits) > 15:
                    raise FramingError(400, "malformed_chunk", "chunk size has too many digits")
                if not digits:
                    raise FramingError(400, "malformed_chunk", "chunk size is not hexadecimal")
                if m is None:
                    raise FramingError(400, "malformed_chunk", "invalid character after chunk size")
                if m.group(2) and not _VALUE.match(m.group(2)):
                    raise FramingError(400, "malformed_chunk", "control character in a chunk extension")
                self.data = self.data[end + 2:]
                size = int(digits, 16)
                if size == 0:
                    self.step = "trailers"
                    self.trailer_used = 0
                elif size > body_bytes - self.body_len:
                    raise FramingError(413, "body_too_large", f"chunked request body exceeds the {body_bytes}-byte limit")
                else:
                    self.left = size
                    self.step = "chunk"
            elif self.step == "chunk":
                if len(self.data) < self.left + 2:
                    return None
                if self.data[self.left:self.left + 2] != b"\r\n":
                    raise FramingError(400, "malformed_chunk", "chunk data is not followed by CRLF")
                self.body.append(self.data[: self.left])
                self.body_len += self.left
                self.data = self.data[self.left + 2:]
                self.step = "size"
            elif self.step == "trailers":
                end = self.data.find(b"\r\n")
                if end < 0:
                    if self.trailer_used + len(self.data) > trailer_bytes:
                        raise FramingError(431, "trailers_too_large", f"trailers exceed {trailer_bytes} bytes")
                    return None
                self.trailer_used += end + 2
                if self.trailer_used > trailer_bytes:
                    raise FramingError(431, "trailers_too_large", f"trailers exceed {trailer_bytes} bytes")
                line, self.data = self.data[:end], self.data[end + 2:]
                if not line:
                    return self._done()
                _fields(line)

    def _head(self, block, body_bytes):
        lines = block.split(b"\r\n", 1)
        request_line = lines[0]
        if b"\r" in request_line or b"\n" in request_line:
            raise FramingError(400, "bare_line_ending", "bare CR or LF in the message head")
        rest = lines[1] if len(lines) > 1 else b""
        if b"\n" in rest.replace(b"\r\n", b"") or b"\r" in rest.replace(b"\r\n", b""):
            raise FramingError(400, "bare_line_ending", "bare CR or LF in the message head")
        parts = request_line.split(b" ")
        if len(parts) != 3:
            raise FramingError(400, "malformed_request_line", "request line is not 'METHOD target HTTP/1.x'")
        method, target, version = parts
        if not _TOKEN.match(method):
            raise FramingError(400, "malformed_request_line", "invalid method")
        if not _TARGET.match(target):
            raise FramingError(400, "malformed_request_line", "invalid request target")
        versions = {b"HTTP/1.1": 11, b"HTTP/1.0": 10}
        if version not in versions:
            if re.match(rb"HTTP/.\..\Z", version, re.S):
                raise FramingError(505, "http_version_not_supported", "only HTTP/1.0 and HTTP/1.1 are served")
            raise FramingError(400, "malformed_request_line", "invalid HTTP version")
        version = versions[version]
        m = re.match(rb"https?://[^/]*(/.*)?\Z", target, re.I | re.S)
        if m:
            target = m.group(1) or b"/"
        elif not (target.startswith(b"/") or target == b"*"):
            raise FramingError(400, "malformed_request_line", "request target must be a path")
        headers = _fields(rest)

        def values(name):
            return [v for n, v in headers if n == name]

        lengths = values("content-length")
        if len(lengths) > 1:
            raise FramingError(400, "ambiguous_framing", "more than one Content-Length")
        if lengths and not re.fullmatch(r"[0-9]{1,18}", lengths[0]):
            raise FramingError(400, "invalid_content_length", "Content-Length is not a decimal byte count")
        tokens = {t.strip().lower() for v in values("connection") for t in v.split(",")}
        keep_alive = "close" not in tokens and (version == 11 or "keep-alive" in tokens)
        if any(values("expect")):
            raise FramingError(417, "expectation_failed",
                               "Expect is not supported; send the body directly (curl: -H 'Expect:')")
        if version == 11 and len(values("host")) != 1:
            raise FramingError(400, "invalid_host", "an HTTP/1.1 request needs exactly one Host header")
        if any(not HOST.match(h) for h in values("host")):
            raise FramingError(400, "invalid_host", "the Host header is not a host[:port]")
        codings = [c.strip().lower() for v in values("transfer-encoding") for c in v.split(",")]
        self.head = (method.decode(), target.decode(), version, headers, keep_alive)
        self.body, self.body_len = [], 0
        if values("transfer-encoding"):
            if lengths:
                raise FramingError(400, "ambiguous_framing", "both Content-Length and Transfer-Encoding")
            if version == 10:
                raise FramingError(400, "ambiguous_framing", "Transfer-Encoding in an HTTP/1.0 request")
            for coding in codings:
                if coding != "chunked":
                    raise FramingError(501, "unsupported_transfer_encoding",
                                       f"transfer coding {coding!r} is not supported; use chunked or Content-Length")
            if len(codings) != 1:
                raise FramingError(400, "malformed_transfer_encoding", "chunked may be applied only once")
            self.step = "size"
        else:
            self.left = int(lengths[0]) if lengths else 0
            if self.left > body_bytes:
                raise FramingError(413, "body_too_large",
                                   f"request body of {self.left} bytes exceeds the {body_bytes}-byte limit")
            self.step = "length"

    def _done(self):
        method, target, version, headers, keep_alive = self.head
        body = b"".join(self.body)
        self.body, self.body_len, self.head, self.step, self.leading = [], 0, None, "head", 0
        return (method, target, version, headers, body, keep_alive)
