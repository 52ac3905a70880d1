"""The one table of (method, path) -> handler, the kinds table, and the server-level handlers.

A server's routes are its own (health, status, metrics, logs, requests), the
administration routes (admin.py) and every route its kinds declare (kinds.py).

Handlers take (server, request, **path_params) and return a Response, Stream
or Deferred (see http.py), or raise Error. HEAD is served wherever GET is,
with the same headers and no body. A known path with another method is 405
with Allow; anything else is 404.
"""

import os
import time

from . import __version__, admin, decisions, embeddings, imagegen, logs, speech, text, transcription
from .errors import Error
from .http import Response, Stream, page
from .metrics import CONTENT_TYPE as METRICS_TYPE

REQUESTS_PAGE = 100     # /v1/requests page bound
LOGZ_PAGE = 1000        # /logz page bound (logs.MAX_READ_LIMIT)
SSE_BATCH = 64          # log entries written per credit check on /logz/stream


def healthz(server, request):
    request.require_empty_body()
    return Response.json({"status": "ready"})


def readyz(server, request):
    request.require_empty_body()
    if not server.ready:
        raise Error(503, "the server is starting or stopping", "not_ready")
    preparing = [r.name for r in server.registry.registrations.values() if r.phase == "preparing" and r.from_catalog]
    if preparing:
        raise Error(503, f"start-up catalog still preparing: {', '.join(preparing)}", "not_ready")
    return Response.json({"status": "ready"})


def models(server, request):
    request.require_empty_body()
    return Response.json({"object": "list", "data": server.registry.model_list()})


def status(server, request):
    request.require_empty_body()
    cfg = server.config
    return Response.json({
        "object": "status",
        "server": {
            "version": __version__,
            "pid": os.getpid(),
            "started": int(server.started),
            "uptime_s": round(time.time() - server.started, 3),
            "ready": server.ready,
            "stopping": server.stopping,
            "listeners": [listener.address for listener in server.listeners],
        },
        "limits": {
            "request_body_bytes": cfg.request_body_bytes,
            "header_bytes": cfg.header_bytes,
            "connections": cfg.connections,
            "output_buffer_bytes": cfg.output_buffer_bytes,
            "header_timeout_s": cfg.header_timeout,
            "idle_timeout_s": cfg.idle_timeout,
            "request_timeout_s": cfg.request_timeout,
        },
        "connections": {
            "open": len(server.connections),
            "limit": cfg.connections,
            "rejected": server.connections_rejected.get(),
        },
        "requests": {"in_flight": len(server.requests)},
        "admission": {"accepting": server.ready and not server.stopping},
        "scheduler": {
            "executor": {"workers": cfg.workers, "pending": server.loop.executor_pending},
        },
        "devices": server.registry.devices(),
        "resources": server.registry.resources(),
        "registrations": server.registry.status(),
    })


def metrics(server, request):
    request.require_empty_body()
    return Response.text(server.metrics.expose(), content_type=METRICS_TYPE)


def logz(server, request):
    request.require_empty_body()
    params = request.params({"cursor", "limit"})
    cursor = request.int_param(params, "cursor", 0, 0, 2**63 - 1)
    limit = request.int_param(params, "limit", 100, 1, LOGZ_PAGE)
    entries, next_cursor, dropped = server.logs.read(cursor, limit)
    return Response(200, logs.to_jsonl(entries), "application/x-ndjson",
                    [("X-Loom-Next-Cursor", str(next_cursor)), ("X-Loom-Dropped", str(dropped))])


def logz_stream(server, request):
    """SSE of log entries. Each client holds its own cursor into the ring and
    reads only while it has output credit, so a slow client skips ahead over
    evicted entries (announced as a `dropped` event) without affecting anyone."""
    request.require_empty_body()
    params = request.params({"cursor"})
    try:
        cursor = logs.sse_cursor_from(request.header("last-event-id"), params.get("cursor"))
    except ValueError as e:
        raise Error(400, str(e), "invalid_cursor", "cursor") from None
    stream = Stream()
    ring = server.logs
    state = {"cursor": cursor, "token": None}

    def pump(_last_id=None):
        while stream.ready and state["cursor"] <= ring.last_id:
            entries, state["cursor"], dropped = ring.read(state["cursor"], SSE_BATCH)
            stream.send(logs.to_sse(entries, dropped))

    def closed(_reason):
        ring.unsubscribe(state["token"])

    stream.on_ready = pump
    stream.on_close = closed
    stream.cancel_on_shutdown = True
    state["token"] = ring.subscribe(pump)
    stream.send(b": loom log stream\n\n")  # opens the stream for clients waiting on headers
    server.loop.call_soon(pump)
    return stream


def requests(server, request):
    request.require_empty_body()
    params = request.params({"offset", "limit"})
    offset = request.int_param(params, "offset", 0, 0, 2**63 - 1)
    limit = request.int_param(params, "limit", 50, 1, REQUESTS_PAGE)
    now = time.monotonic()
    live = list(server.requests.values())
    data, next_offset = page(live, offset, limit)
    return Response.json({
        "object": "list",
        "data": [{"id": r.id, "method": r.method, "path": r.path, "route": r.route, "model": r.model,
                  "state": r.state, "transport": r.transport, "age_ms": round((now - r.started) * 1000, 3)}
                 for r in data],
        "offset": offset,
        "total": len(live),
        "next_offset": next_offset,
    })


SERVER_ROUTES = [
    ("GET", "/healthz", healthz),
    ("GET", "/readyz", readyz),
    ("GET", "/v1/models", models),
    ("GET", "/v1/status", status),
    ("GET", "/metrics", metrics),
    ("GET", "/logz", logz),
    ("GET", "/logz/stream", logz_stream),
    ("GET", "/v1/requests", requests),
]

# The kinds this build serves: adding a kind is its module plus one line here.
KINDS = (text.TEXT, text.SEQUENCE, embeddings.KIND, decisions.KIND, speech.KIND, transcription.KIND, imagegen.KIND)


def table_of(kinds, extra=()):
    """Every route: the server's own, administration's, each kind's, then `extra`."""
    return Table(SERVER_ROUTES + admin.ROUTES + [route for kind in kinds for route in kind.routes] + list(extra))


class Table:
    """Exact paths by dict lookup; `{name}` segments match one nonempty path segment."""

    def __init__(self, routes):
        self.exact = {}
        self.patterns = []
        for method, path, handler in routes:
            if "{" in path:
                entry = next((p for p in self.patterns if p[0] == path), None)
                if entry is None:
                    entry = (path, path.strip("/").split("/"), {})
                    self.patterns.append(entry)
            else:
                entry = (path, None, self.exact.setdefault(path, {}))
            if entry[2].setdefault(method, handler) is not handler:
                raise ValueError(f"two handlers for {method} {path}")

    def match(self, path):
        """(pattern, {method: handler}, params) or None."""
        methods = self.exact.get(path)
        if methods is not None:
            return path, methods, {}
        segments = path.strip("/").split("/")
        for pattern, parts, methods in self.patterns:
            if len(parts) != len(segments):
                continue
            params = {}
            for part, seg in zip(parts, segments):
                if part.startswith("{"):
                    if not seg:
                        break
                    params[part[1:-1]] = seg
                elif part != seg:
                    break
            else:
                return pattern, methods, params
        return None


def dispatch(server, request):
    found = server.routes.match(request.path)
    if found is None:
        raise Error(404, f"no route for {request.path}", "route_not_found")
    pattern, methods, params = found
    request.route = pattern
    method = "GET" if request.method == "HEAD" and "HEAD" not in methods else request.method
    handler = methods.get(method)
    if handler is None:
        allow = sorted(set(methods) | ({"HEAD"} if "GET" in methods else set()))
        raise Error(405, f"{request.method} is not allowed on {pattern}", "method_not_allowed",
                        headers=[("Allow", ", ".join(allow))])
    return handler(server, request, **params)
