"""Requests, responses, the error envelope and SSE encoding.

Handlers receive a complete, validated Request and return one of:
- Response: a complete body (JSON, text, bytes);
- Stream: a body produced over time (chunked transfer; SSE is a Stream whose
  chunks are events). Producers respect output credit: they send while
  `stream.ready` and resume when `on_ready` fires, so a slow reader stalls only
  its own producer. Disconnect calls `on_close(reason)` once;
- Deferred: a response that will exist later (a background job finishes).
  `resolve(response)` completes it; disconnect calls `on_cancel()`.
"""

import json
import time
from urllib.parse import parse_qs

from . import jsonin
from .errors import Error
from ._native import multipart


REASONS = {
    200: "OK", 201: "Created", 202: "Accepted", 204: "No Content",
    400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
    409: "Conflict", 410: "Gone", 411: "Length Required", 413: "Content Too Large",
    415: "Unsupported Media Type", 417: "Expectation Failed", 422: "Unprocessable Content",
    429: "Too Many Requests", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
    501: "Not Implemented", 503: "Service Unavailable", 505: "HTTP Version Not Supported",
}

JSON_TYPE = "application/json"
SSE_TYPE = "text/event-stream"
TEXT_TYPE = "text/plain; charset=utf-8"


class Request:
    __slots__ = ("id", "method", "target", "path", "query", "version", "headers", "body",
                 "keep_alive", "started", "route", "model", "state", "transport", "parsed")

    def __init__(self, rid, method, target, version, headers, body, keep_alive, transport):
        self.id = rid
        self.method = method
        self.target = target
        # Paths are matched as sent: no route needs percent-decoding, and
        # not decoding means no ambiguity between "/a%2Fb" and "/a/b".
        self.path, _, self.query = target.partition("?")
        self.version = version
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.started = time.monotonic()
        self.route = None       # the matched route pattern, a bounded label for metrics
        self.model = None       # set by inference and admin handlers for inspection
        self.state = "running"
        self.transport = transport
        self.parsed = None      # (value, JSONInputError or None) once parse_json ran off the loop

    # A body this large is parsed on the CPU executor before its handler runs: parsing
    # is ~3 ms per MiB of C code holding the loop (and the GIL), so a 64 MiB message
    # parsed on the loop thread stalled every other connection for a quarter second
    # or, on a loaded host, for seconds.
    OFF_LOOP_JSON_BYTES = 1 << 20

    def wants_parse_off_loop(self):
        if len(self.body) < self.OFF_LOOP_JSON_BYTES:
            return False
        ctype = [v for n, v in self.headers if n == "content-type"]
        return len(ctype) <= 1 and (not ctype or ctype[0].split(";")[0].strip().lower() == JSON_TYPE)

    def parse_json(self):
        """Run on a worker: the body parsed once, for json() to validate on the loop."""
        try:
            self.parsed = (jsonin.loads(self.body), None)
        except jsonin.JSONInputError as e:
            self.parsed = (None, e)

    def header(self, name):
        """The single value of a header, None when absent; a repeated header rejects."""
        values = [v for n, v in self.headers if n == name]
        if len(values) > 1:
            raise Error(400, f"header {name!r} must appear at most once", "duplicate_header", name)
        return values[0] if values else None

    def params(self, allowed):
        """Query parameters, each at most once and only from `allowed`."""
        try:
            parsed = parse_qs(self.query, keep_blank_values=True, strict_parsing=bool(self.query),
                              errors="strict", max_num_fields=32)
        except (ValueError, UnicodeDecodeError) as e:
            raise Error(400, f"malformed query string: {e}", "invalid_query") from None
        for name, values in parsed.items():
            if name not in allowed:
                raise Error(400, f"unknown query parameter {name!r}", "unknown_parameter", name)
            if len(values) > 1:
                raise Error(400, f"query parameter {name!r} repeated", "duplicate_parameter", name)
        return {name: values[0] for name, values in parsed.items()}

    def int_param(self, params, name, default, lo, hi):
        raw = params.get(name)
        if raw is None:
            return default
        if not raw.isdigit() or len(raw) > 18 or not lo <= int(raw) <= hi:
            raise Error(400, f"{name} must be an integer from {lo} to {hi}", "invalid_parameter", name)
        return int(raw)

    def json(self, spec=None):
        """The body as strict JSON (see jsonin), validated against `spec` when given."""
        ctype = (self.header("content-type") or "").split(";")[0].strip().lower()
        if ctype and ctype != JSON_TYPE:
            raise Error(415, f"expected Content-Type application/json, got {ctype!r} "
                                 "(curl: -H 'Content-Type: application/json')", "unsupported_media_type")
        try:
            if self.parsed is None:
                value = jsonin.loads(self.body)
            else:
                value, error = self.parsed
                if error is not None:
                    raise error
            return spec.validate(value) if spec is not None else value
        except jsonin.JSONInputError as e:
            raise Error(400, e.message, e.code, e.param) from None

    def form(self, max_parts=1024):
        """The body as multipart/form-data parts, in order (see _native.multipart)."""
        ctype = self.header("content-type") or ""
        try:
            return multipart.parse(self.body, ctype, max_parts=max_parts)
        except multipart.MultipartError as e:
            status = 415 if not ctype.lower().startswith("multipart/form-data") else 400
            raise Error(status, e.message, "invalid_multipart") from None

    def require_empty_body(self):
        if self.body:
            raise Error(400, f"{self.method} {self.route or self.path} takes no request body", "unexpected_body")


class Response:
    __slots__ = ("status", "headers", "body", "on_sent")

    def __init__(self, status=200, body=b"", content_type=None, headers=()):
        self.on_sent = None     # called once its bytes have left for the client, or the client has gone
        self.status = status
        self.headers = list(headers)
        if content_type:
            self.headers.append(("Content-Type", content_type))
        self.body = body

    @classmethod
    def json(cls, value, status=200, headers=()):
        body = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
        return cls(status, body, JSON_TYPE, headers)

    @classmethod
    def error(cls, error):
        """The error envelope of an Error (errors.py), with its status and headers."""
        return cls.json(error.envelope(), error.status, error.headers)

    @classmethod
    def text(cls, text, status=200, content_type=TEXT_TYPE, headers=()):
        return cls(status, text.encode() if isinstance(text, str) else text, content_type, headers)

    def head_bytes(self, keep_alive, length=None, chunked=False):
        lines = [f"HTTP/1.1 {self.status} {REASONS.get(self.status, 'Status')}", "Server: loom"]
        lines += [f"{k}: {v}" for k, v in self.headers]
        if chunked:
            lines.append("Transfer-Encoding: chunked")
        elif length is not None:
            lines.append(f"Content-Length: {length}")
        if not keep_alive:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Stream(Response):
    """A chunked body produced incrementally. The server attaches it to the connection."""

    __slots__ = ("on_ready", "on_close", "finished", "closed", "cancel_on_shutdown", "_sink", "_pending")

    def __init__(self, status=200, content_type=SSE_TYPE, headers=()):
        extra = [("Cache-Control", "no-cache")] if content_type == SSE_TYPE else []
        super().__init__(status, b"", content_type, list(headers) + extra)
        self.on_ready = None    # producer callback: credit is available again
        self.on_close = None    # producer callback(reason): the client went away or the server stops
        self.finished = False
        self.closed = None      # the close reason once the stream can take no more data
        self.cancel_on_shutdown = False  # endless streams (log tails) end at once on shutdown
        self._sink = None       # the connection, once attached
        self._pending = []      # chunks sent before attachment

    @property
    def ready(self):
        """True while the connection has output credit for more data."""
        return self.closed is None and not self.finished and (self._sink is None or self._sink.has_credit())

    def send(self, data):
        """Queue one chunk (flushed at once). Returns False if the stream is closed."""
        if self.closed is not None or self.finished:
            return False
        if data:
            if self._sink is None:
                self._pending.append(data)
            else:
                self._sink.write_chunk(data)
        return True

    def finish(self):
        if self.closed is None and not self.finished:
            self.finished = True
            if self._sink is not None:
                self._sink.finish_stream()

    # The server side of the protocol.
    def attach(self, sink):
        self._sink = sink
        pending, self._pending = self._pending, []
        for data in pending:
            sink.write_chunk(data)
        if self.finished:
            sink.finish_stream()

    def notify_ready(self):
        if self.on_ready is not None and self.ready:
            self.on_ready()

    def abort(self, reason):
        if self.closed is None:
            self.closed = reason
            if self.on_close is not None and not self.finished:
                self.on_close(reason)


class Deferred:
    """A response that a background job completes later."""

    __slots__ = ("on_cancel", "_sink", "response", "cancelled")

    def __init__(self):
        self.on_cancel = None
        self._sink = None
        self.response = None
        self.cancelled = False

    def resolve(self, response):
        if self.response is not None or self.cancelled:
            return False
        self.response = response
        if self._sink is not None:
            self._sink(response)
        return True

    def attach(self, sink):
        self._sink = sink
        if self.response is not None:
            sink(self.response)

    def cancel(self):
        if not self.cancelled and self.response is None:
            self.cancelled = True
            if self.on_cancel is not None:
                self.on_cancel()


def sse_event(data, event=None, id=None):
    """One SSE event. `data` is a str (split on newlines into data: lines) or JSON-able value."""
    if not isinstance(data, str):
        data = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    out = []
    if id is not None:
        out.append(f"id: {id}")
    if event is not None:
        out.append(f"event: {event}")
    out.extend(f"data: {line}" for line in data.split("\n"))
    return ("\n".join(out) + "\n\n").encode()


def page(items, offset, limit):
    """One bounded page of a listing: (items[offset:offset + limit], the next offset or None)."""
    data = items[offset:offset + limit]
    return data, offset + len(data) if offset + len(data) < len(items) else None
