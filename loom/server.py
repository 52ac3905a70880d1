"""The selectors event loop: listeners, connections, keep-alive, timeouts, output credit.

Single-threaded and never blocking. Each connection owns a RequestParser
(loom._native.framing) and serves one request at a time: pipelined requests
wait in the parser's buffer until the previous response completes, and reading
pauses while that buffer is full, so a pipelining client cannot grow memory.
Output is buffered per connection up to `output_buffer_bytes`; a Stream's
producer sees that credit through `stream.ready`, so a slow reader stalls
only its own producer. Worker threads hand results back via call_soon_threadsafe.
"""

import errno
import itertools
import logging
import os
import selectors
import signal
import socket
import stat
import threading
import time
from dataclasses import dataclass, field

from . import __version__, routes
from ._native.framing import FramingError, RequestParser
from .errors import Error, Problem
from .http import Deferred, Request, Response, Stream
from .logs import LogRing, OperatorFormatter, RingHandler
from .loop import Loop
from .metrics import Registry
from .registry import Registry as Models, first_line

log = logging.getLogger("loom")

READ_CHUNK = 65536
SWEEP_SECONDS = 0.25
LINGER_SECONDS = 2.0        # after an error response, drain the client's unread upload briefly
LINGER_BYTES = 1 << 20      # so it sees our status line instead of a reset


@dataclass
class Config:
    listen: list = field(default_factory=lambda: ["tcp:127.0.0.1:8080"])
    models: str | None = None
    request_body_bytes: int = 64 << 20
    header_bytes: int = 16384
    connections: int = 1024
    header_timeout: float = 10.0
    idle_timeout: float = 60.0
    request_timeout: float = 300.0
    output_buffer_bytes: int = 256 << 10
    shutdown_timeout: float = 10.0
    log_capacity: int = 4096
    workers: int = 2
    log_level: str = "info"
    device: str | None = None
    memory_bytes: int | None = None
    registrations: int = 64                 # registered models at once; more answer 429
    package_bytes: int = 256 << 20          # uploaded package bytes retained by all registrations
    prepare_timeout: float = 600.0          # seconds a preparation may take before it fails
    trial_timeout: float = 60.0             # seconds a package's trial run may take (proving.py)
    kernel_cache: str | None = None         # folder of built kernels kept across starts; "" for none
    # Folders whose files a client may name for a model (registration, staging, includes); None:
    # Loom's cache folder. The start-up catalog's own folders and Loom's shipped packages are always roots.
    model_root: list | None = None


class Listener:
    def __init__(self, server, spec):
        self.server = server
        self.spec = spec
        self.path = None
        kind, _, rest = spec.partition(":")
        if kind == "tcp":
            host, sep, port = rest.rpartition(":")
            if not sep or not port.isdigit():
                raise ValueError(f"listener {spec!r}: expected tcp:HOST:PORT")
            host = host.strip("[]") or "127.0.0.1"
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.sock = socket.socket(family, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, int(port)))
            bound = self.sock.getsockname()
            self.address = f"tcp:{'[' + bound[0] + ']' if family == socket.AF_INET6 else bound[0]}:{bound[1]}"
        elif kind == "unix":
            if not rest:
                raise ValueError(f"listener {spec!r}: expected unix:PATH")
            self.path = rest
            _clear_stale_socket(rest)
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(rest)
            self.address = f"unix:{rest}"
        else:
            raise ValueError(f"listener {spec!r}: expected tcp:HOST:PORT or unix:PATH")
        self.sock.listen(512)
        self.sock.setblocking(False)
        self.transport = kind
        self.accepted = 0

    def on_accept(self, _mask):
        for _ in range(64):  # bounded per wakeup so one busy listener cannot starve the loop
            try:
                sock, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("accept failed: %s", e)
                    return
                raise
            self.accepted += 1
            self.server.accept(sock, self)

    def close(self):
        self.sock.close()
        if self.path:
            try:
                if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                    os.unlink(self.path)
            except FileNotFoundError:
                pass


def _clear_stale_socket(path):
    """Replace a socket file only when nothing listens on it; never delete other files."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # stale: left by a process that did not exit cleanly
        return
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise ValueError(f"{path}: another server is listening on this socket")


class Connection:
    def __init__(self, server, sock, listener):
        self.server = server
        self.sock = sock
        self.listener = listener
        self.transport = listener.address
        cfg = server.config
        self.parser = RequestParser(cfg.header_bytes, cfg.request_body_bytes)
        self.out = bytearray()
        self.sent = []              # Response.on_sent callbacks waiting for `out` to drain
        self.high_water = cfg.output_buffer_bytes
        self.request = None         # the request whose response is in progress
        self.stream = None
        self.deferred = None
        self.events = selectors.EVENT_READ
        self.closing = False        # close once output is flushed
        self.lingering = None       # deadline while draining after an error response
        self.linger_bytes = 0
        self.closed = False
        now = time.monotonic()
        self.last_read = now
        self.last_write = now
        self.request_since = None   # when the first byte of the next request arrived
        self.bytes_out_mark = 0
        sock.setblocking(False)
        server.loop.selector.register(sock, self.events, self.on_event)

    # -- readiness ---------------------------------------------------------
    def on_event(self, mask):
        try:
            self._on_event(mask)
        except Exception:
            log.exception("connection %s failed", self.transport, extra={"event": "connection_failed"})
            self.abort("internal error")

    def _on_event(self, mask):
        if mask & selectors.EVENT_WRITE and not self.closed:
            self.flush()
            # Credit is returned only from the writable event, never from inside a
            # producer's own send(), so producers are not re-entered.
            if self.stream is not None and not self.closed and len(self.out) < self.high_water // 2:
                self.stream.notify_ready()
        if mask & selectors.EVENT_READ and not self.closed:
            self.on_readable()

    def on_readable(self):
        try:
            data = self.sock.recv(READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.abort("disconnect")
            return
        if self.lingering is not None:
            self.linger_bytes += len(data)
            if not data or self.linger_bytes > LINGER_BYTES:
                self.close()
            return
        if not data:
            self.on_eof()
            return
        self.last_read = time.monotonic()
        self.server.bytes_in.inc(len(data))
        try:
            self.parser.feed(data)
        except FramingError as e:
            self.reject(e)
            return
        self.pump()

    def on_eof(self):
        if self.stream is not None or self.deferred is not None:
            self.abort("disconnect")  # a streaming or waiting client left: tell the producer now
        elif self.request is None and self.parser.state != "idle":
            # Half-closed mid-request (a body shorter than Content-Length, a chunked body
            # cut mid-chunk, a head without its blank line): it still gets its 400.
            where = self.parser.state
            self.server.framing_errors.inc(code="incomplete_request")
            request = Request(self.server.next_request_id(), "-", "-", 11, [], b"", False, self.transport)
            self.server.finished(request, 400, "rejected", route="(framing)")
            response = Response.error(Error(400, f"the connection was closed mid-request (in its {where}): "
                                                 "the request is incomplete", "incomplete_request"))
            self.closing = True
            self.write(response.head_bytes(False, length=len(response.body)) + response.body)
        elif self.out:
            self.closing = True       # a half-closed client still gets what it asked for
            self.set_events(selectors.EVENT_WRITE)
        else:
            self.close()

    def set_events(self, events):
        if events != self.events and not self.closed:
            self.events = events
            self.server.loop.selector.modify(self.sock, events or selectors.EVENT_READ, self.on_event)

    def update_interest(self):
        events = 0
        # Stop reading while a response is in progress and the pipeline buffer
        # is full: backpressure instead of unbounded buffering.
        if self.lingering is not None or (not self.closing and (
                self.request is None or self.parser.buffered < self.server.config.header_bytes)):
            events |= selectors.EVENT_READ
        if self.out:
            events |= selectors.EVENT_WRITE
        self.set_events(events or selectors.EVENT_READ)

    # -- requests ----------------------------------------------------------
    def pump(self):
        """Parse and dispatch buffered requests, one at a time."""
        while self.request is None and not self.closing and not self.closed:
            try:
                raw = self.parser.next_request()
            except FramingError as e:
                self.reject(e)
                return
            if raw is None:
                if self.parser.state != "idle" and self.request_since is None:
                    self.request_since = time.monotonic()
                break
            self.request_since = None
            self.dispatch(raw)
        self.update_interest()

    def dispatch(self, raw):
        method, target, version, headers, body, keep_alive = raw
        server = self.server
        request = Request(server.next_request_id(), method, target, version, headers, body,
                          keep_alive and not server.stopping, self.transport)
        self.request = request
        server.requests[request.id] = request
        response = server.handle(request)
        if self.closed:
            # Gone while its handler ran: whatever the answer holds is let go.
            if isinstance(response, Stream):
                response.abort("disconnect")
            elif isinstance(response, Deferred):
                response.cancel()
            return
        if isinstance(response, Deferred):
            request.state = "waiting"
            self.deferred = response
            response.attach(self.on_resolved)
        else:
            self.start_response(response)

    def on_resolved(self, response):
        if self.closed or self.deferred is None:
            return
        self.deferred = None
        self.start_response(response)

    def start_response(self, response):
        request = self.request
        head_only = request.method == "HEAD"
        if isinstance(response, Stream):
            request.state = "streaming"
            # Held before the first send: a send that fails aborts the stream, which
            # frees its row (a reset client used to wedge it).
            self.stream = response
            self.response_status = response.status
            self.write(response.head_bytes(request.keep_alive, chunked=True))
            if self.closed:
                return
            if head_only:
                response.abort("head")
                self.complete()
            else:
                response.attach(self)
            return
        self.response_status = response.status
        if not request.keep_alive:
            self.closing = True
        head = response.head_bytes(request.keep_alive, length=len(response.body))
        self.write(head if head_only else head + response.body)  # one send: no Nagle stall between them
        if response.on_sent is not None:
            self.sent.append(response.on_sent)
            self._sent()
        if not self.closed:     # else the failed send has already ended the request (499)
            self.complete()

    # Stream sink protocol (see http.Stream).
    def has_credit(self):
        return len(self.out) < self.high_water and not self.closed

    def write_chunk(self, data):
        self.write(b"%x\r\n%b\r\n" % (len(data), data))

    def finish_stream(self):
        if self.stream is None:
            return
        self.write(b"0\r\n\r\n")
        self.complete()

    def complete(self):
        request, self.request = self.request, None
        self.stream = None
        self.deferred = None
        self.server.finished(request, self.response_status, "completed")
        if not request.keep_alive or self.server.stopping:
            self.closing = True
        if self.closing and not self.out:
            self.close()
            return
        if not self.closing:
            self.server.loop.call_soon(self.pump)  # the next pipelined request, if any
        self.update_interest()

    # -- output ------------------------------------------------------------
    def write(self, data):
        if self.closed:
            return
        self.out += data
        self.flush()

    def flush(self):
        if self.closed:
            return
        if self.out:
            try:
                sent = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.abort("disconnect")
                return
            if sent:
                del self.out[:sent]
                self.last_write = time.monotonic()
                self.server.bytes_out.inc(sent)
                self._sent()
        if not self.out and self.closing and self.request is None:
            if self.lingering is None:
                self.close()
                return
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                self.close()
                return
        self.update_interest()

    def _sent(self):
        """Run the on_sent callbacks once nothing is left to send (or nothing will be)."""
        if self.sent and (not self.out or self.closed):
            callbacks, self.sent = self.sent, []
            for fn in callbacks:
                fn()

    # -- endings -----------------------------------------------------------
    def reject(self, error):
        """Answer a framing error, then close: the byte stream cannot be resynchronised."""
        self.server.framing_errors.inc(code=error.code)
        if error.status == 413:
            self.server.body_limit_rejections.inc()
        response = Response.error(Error(error.status, error.message, error.code))
        request = Request(self.server.next_request_id(), "-", "-", 11, [], b"", False, self.transport)
        self.server.finished(request, error.status, "rejected", route="(framing)")
        self.send_error_and_linger(response)

    def send_error_and_linger(self, response):
        # Lingering close: stop sending after the error, but keep reading (and
        # discarding) briefly, so a client still uploading sees our status line
        # rather than a connection reset.
        self.closing = True
        self.lingering = time.monotonic() + LINGER_SECONDS
        self.write(response.head_bytes(False, length=len(response.body)) + response.body)

    def abort(self, reason):
        """The client went away (or is being cut off): release everything it held."""
        if self.closed:
            return
        request = self.request
        stream, deferred = self.stream, self.deferred
        self.close()
        if stream is not None:
            stream.abort(reason)
        if deferred is not None:
            deferred.cancel()
        if request is not None:
            self.server.finished(request, 499, reason)

    def close(self):
        if self.closed:
            return
        self.closed = True
        self.server.loop.selector.unregister(self.sock)
        self.sock.close()
        self.out = bytearray()
        self._sent()
        self.server.connections.discard(self)

    def sweep(self, now, cfg):
        """Enforce timeouts; called periodically by the server."""
        if self.lingering is not None:
            if now > self.lingering:
                self.close()
            return
        if self.out and now - self.last_write > cfg.idle_timeout:
            self.abort("stalled")  # the client stopped reading
            return
        if self.request is not None:
            return
        state = self.parser.state
        if state == "idle":
            if now - max(self.last_read, self.last_write) > cfg.idle_timeout and not self.out:
                self.close()
        elif self.request_since is not None and (
                (state == "head" and now - self.request_since > cfg.header_timeout)
                or now - self.request_since > cfg.request_timeout
                or now - self.last_read > cfg.idle_timeout):
            self.server.framing_errors.inc(code="request_timeout")
            self.send_error_and_linger(Response.error(Error(408, "request not received in time", "request_timeout")))


class Server:
    def __init__(self, config, kinds=None, extra_routes=()):
        """`kinds` defaults to routes.KINDS, the kinds this build serves; `extra_routes`
        are (method, path, handler) rows added to the table (tests)."""
        self.config = config
        kinds = routes.KINDS if kinds is None else tuple(kinds)
        self.routes = routes.table_of(kinds, extra_routes)
        self.loop = Loop(config.workers)
        self.listeners = []
        self.connections = set()
        self.requests = {}              # in-flight requests by id, in arrival order
        self._ids = itertools.count(1)
        self.started = time.time()
        self.ready = False
        self.stopping = False
        self.stop_deadline = None
        self.exit_code = 0
        self.logs = LogRing(config.log_capacity, notifier=lambda: self.loop.call_soon_threadsafe(self.logs.notify))
        self.metrics = Registry()
        self._define_metrics()
        self.registry = Models(self, kinds)

    def _define_metrics(self):
        m = self.metrics
        self.http_requests = m.counter("loom_http_requests", "HTTP requests answered, by route and status.",
                                       ("method", "route", "status"))
        self.bytes_in = m.counter("loom_http_received_bytes", "Bytes read from client connections.")
        self.bytes_out = m.counter("loom_http_sent_bytes", "Bytes written to client connections.")
        self.body_limit_rejections = m.counter("loom_http_body_limit_rejections",
                                               "Requests rejected for exceeding --request_body_bytes.")
        self.framing_errors = m.counter("loom_http_framing_errors", "Connections closed for bad framing or timeouts.",
                                        ("code",))
        self.connections_rejected = m.counter("loom_http_connections_rejected",
                                              "Connections refused with 503 past --connections.")
        self.connections_accepted = m.counter("loom_http_connections_accepted", "Connections accepted.",
                                              ("transport",))
        m.gauge_fn("loom_http_connections_open", "Open client connections.", lambda: len(self.connections))
        m.gauge_fn("loom_http_requests_in_flight", "Requests being served.", lambda: len(self.requests))
        m.gauge_fn("loom_executor_pending", "Jobs queued or running on the CPU executor.",
                   lambda: self.loop.executor_pending)
        m.gauge_fn("loom_log_entries", "Entries held in the /logz ring.", lambda: len(self.logs))

    def next_request_id(self):
        return next(self._ids)

    # -- lifecycle ---------------------------------------------------------
    def start(self):
        try:
            for spec in self.config.listen:
                self.listeners.append(Listener(self, spec))
        except Exception:
            for listener in self.listeners:
                listener.close()
            raise
        try:
            self.registry.open_device()    # NoUsableDevice (a ValueError) fails start: exit 2
            if self.config.models:
                self.registry.load_catalog(self.config.models)
            else:
                from . import demo
                self.registry.load_documents(demo.catalog())
        except (OSError, ValueError):
            for listener in self.listeners:
                listener.close()
            raise
        for listener in self.listeners:
            self.loop.selector.register(listener.sock, selectors.EVENT_READ, listener.on_accept)
            log.info("listening on %s", listener.address, extra={"event": "listening", "address": listener.address})
        self.loop.call_later(SWEEP_SECONDS, self._sweep)
        self.ready = True
        self.registry.watch_catalog(self._catalog_settled)

    def _catalog_settled(self, registrations):
        """The start-up summary: one line per catalog model, then `ready`."""
        failed = [r for r in registrations if r.phase == "failed"]
        for reg in registrations:
            if reg.phase == "failed":
                log.error("model %s: failed (%s): %s", reg.name, reg.error["code"], first_line(reg.error["message"]),
                          extra={"event": "model_summary", "model": reg.name, "phase": reg.phase,
                                 "code": reg.error["code"]})
            else:
                log.info("model %s: %s", reg.name, reg.phase,
                         extra={"event": "model_summary", "model": reg.name, "phase": reg.phase})
        if registrations and len(failed) == len(registrations):
            log.error("every model of the start-up catalog failed to prepare (%d of %d): nothing can be served; "
                      "GET /v1/status shows why", len(failed), len(registrations),
                      extra={"event": "catalog_failed", "failed": len(failed)})
        log.info("ready: %d of %d catalog models ready, %d failed",
                 sum(r.phase == "ready" for r in registrations), len(registrations), len(failed),
                 extra={"event": "ready", "version": __version__, "pid": os.getpid(), "failed": len(failed)})

    def serve_forever(self, signals=True):
        previous = self._install_signals() if signals else {}
        try:
            while not (self.stopping and self._drained()):
                self.loop.run_once()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if signals:
                signal.set_wakeup_fd(-1)
            self.close()
        return self.exit_code

    def _install_signals(self):
        previous = {}
        signal.set_wakeup_fd(self.loop.wakeup_fd(), warn_on_full_buffer=False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: self.loop.call_soon(self.shutdown))
        return previous

    def shutdown(self):
        """Stop accepting, let in-flight work finish (bounded), cancel endless streams."""
        if self.stopping:
            return
        self.stopping = True
        self.ready = False
        self.stop_deadline = time.monotonic() + self.config.shutdown_timeout
        log.info("shutting down: %d connections, %d requests in flight", len(self.connections), len(self.requests),
                 extra={"event": "shutdown"})
        for listener in self.listeners:
            self.loop.selector.unregister(listener.sock)
            listener.close()
        self.listeners = []
        for conn in list(self.connections):
            if conn.request is None:
                conn.close()
            elif conn.stream is not None and conn.stream.cancel_on_shutdown:
                conn.abort("shutdown")

    def _drained(self):
        if not self.connections:
            return True
        if time.monotonic() > self.stop_deadline:
            for conn in list(self.connections):
                conn.abort("shutdown")
            return True
        return False

    def close(self):
        for conn in list(self.connections):
            conn.abort("shutdown")
        for listener in self.listeners:
            listener.close()
        # Releasing device memory waits in the driver for the kernels using it: a device
        # step that never ends (a kernel stuck at some geometry) must not keep the process.
        teardown = threading.Thread(target=self.registry.close, name="loom-teardown", daemon=True)
        teardown.start()
        teardown.join(max(1.0, self.config.shutdown_timeout / 2))
        if teardown.is_alive():
            log.warning("device memory was not released within %.1f s (a device step is still running); "
                        "exiting without it", max(1.0, self.config.shutdown_timeout / 2),
                        extra={"event": "teardown_abandoned"})
        self.loop.close()

    # -- connections -------------------------------------------------------
    def accept(self, sock, listener):
        if self.stopping or len(self.connections) >= self.config.connections:
            self.connections_rejected.inc()
            body = Response.error(Error(503, "too many connections", "connection_limit"))
            try:
                sock.setblocking(False)
                sock.send(body.head_bytes(False, length=len(body.body)) + body.body)
            except OSError:
                pass  # best effort: the refusal must never block the loop
            sock.close()
            return
        if listener.transport == "tcp":
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # SSE events and small replies go out at once
        self.connections_accepted.inc(transport=listener.transport)
        self.connections.add(Connection(self, sock, listener))

    def _sweep(self):
        now = time.monotonic()
        for conn in list(self.connections):
            if not conn.closed:
                conn.sweep(now, self.config)
        self.loop.call_later(SWEEP_SECONDS, self._sweep)

    # -- requests ----------------------------------------------------------
    def handle(self, request):
        """Route a complete request; every failure becomes an error response."""
        if request.wants_parse_off_loop():
            return self._parse_then_handle(request)
        return self._route(request)

    def _parse_then_handle(self, request):
        """A large JSON body is parsed on the executor; its handler runs on the loop after."""
        outer = Deferred()
        inner = []

        def parsed(_, error):
            if outer.cancelled:
                return            # the client left while its body was parsed: nothing runs
            if error is not None:
                log.error("request %d: parsing its body failed: %r", request.id, error,
                          extra={"event": "handler_failed", "request": request.id, "path": request.path})
                outer.resolve(Response.error(Error(500, "internal error", "internal_error")))
                return
            response = self._route(request)
            if isinstance(response, Deferred):
                inner.append(response)
                response.attach(outer.resolve)
            else:
                outer.resolve(response)

        outer.on_cancel = lambda: inner and inner[0].cancel()
        self.loop.run_in_executor(request.parse_json, parsed)
        return outer

    def _route(self, request):
        try:
            return routes.dispatch(self, request)
        except Problem as e:      # an Error, or a lower layer's Problem mapped by its code
            return Response.error(Error.of(e))
        except Exception:
            log.exception("request %d %s %s failed", request.id, request.method, request.path,
                          extra={"event": "handler_failed", "request": request.id, "path": request.path})
            return Response.error(Error(500, "internal error", "internal_error"))

    def finished(self, request, status, outcome, route=None):
        self.requests.pop(request.id, None)
        route = route or request.route or "(unmatched)"
        self.http_requests.inc(method=request.method if request.method in _METHODS else "other",
                               route=route, status=str(status))
        ms = round((time.monotonic() - request.started) * 1000, 3)
        self.logs.append("info", "request", request=request.id, method=request.method, path=request.path,
                         status=status, outcome=outcome, ms=ms, model=request.model)


_METHODS = {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "-"}


def configure_logging(level, ring):
    root = logging.getLogger("loom")
    root.setLevel(level.upper())
    if not root.handlers:
        stderr = logging.StreamHandler()
        stderr.setFormatter(OperatorFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(stderr)
    root.addHandler(RingHandler(ring))
