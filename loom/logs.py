"""Bounded structured log ring behind ``GET /logz`` (JSONL) and ``GET /logz/stream`` (SSE).

Entries are dicts ``{"id", "time", "level", "event", **fields}``. Ids start at
1, increase by exactly 1 per append and are never reused, so an integer cursor
is all a reader needs; when the ring is full the oldest entry is evicted.

Reading::

    ring = LogRing(4096)
    ring.append("info", "model_loaded", model="demo", ms=12.5)
    entries, cursor, dropped = ring.read(cursor, limit)   # loop thread
    body = to_jsonl(entries)

``dropped`` counts entries at or after ``cursor`` that were evicted before the
caller got to them: the gap *this* reader missed. Every reader (each poller,
each SSE client) holds its own cursor, so a slow reader only ever loses its
own entries and never holds memory or delays anyone else.

Threads and notifications (SSE wakeups):

* ``append`` may be called from any thread (one short lock). ``read``,
  ``subscribe``/``unsubscribe`` and ``notify`` belong to the loop thread.
* ``LogRing(capacity, notifier=fn)``: after an append, ``fn()`` is called on the
  appending thread, at most once until the loop runs ``ring.notify()`` (bursts
  coalesce into one wakeup). ``fn`` must only schedule, e.g.
  ``notifier=lambda: loop.call_soon_threadsafe(ring.notify)``. ``notify()`` then
  calls each ``subscriber(last_id)`` on the loop thread.
* Without a notifier, ``append`` calls ``notify()`` itself, so subscribers run
  on the appending thread: fine for a single-threaded program or tests.
* An SSE client subscribes a callback that just marks itself ready; when it has
  output credit it calls ``read(cursor, limit)`` and writes ``to_sse(...)``.
  Resume position comes from ``sse_cursor_from(Last-Event-ID, ?cursor=)``.

A cursor beyond the newest id (e.g. a ``Last-Event-ID`` from a previous server
process) is clamped to ``last_id + 1`` so the reader follows new entries
instead of silently waiting for an id that may be far away.

``RingHandler`` bridges the standard ``logging`` module into a ring.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from typing import Callable

__all__ = ["LogRing", "RingHandler", "OperatorFormatter", "PRIVATE", "to_jsonl", "to_sse", "sse_cursor_from",
           "MAX_READ_LIMIT", "RESERVED_KEYS"]

MAX_READ_LIMIT = 1000
RESERVED_KEYS = ("id", "time", "level", "event")
_RESERVED = frozenset(RESERVED_KEYS)
_MAX_CURSOR_DIGITS = 19  # fits an int64; longer is garbage, not a cursor
_CURSOR = re.compile(r"[0-9]{1,%d}" % _MAX_CURSOR_DIGITS)


class LogRing:
    def __init__(self, capacity: int, notifier: Callable[[], object] | None = None):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        # Fixed slots indexed by (id - 1) % capacity: O(1) append and O(1)
        # random access by id, unlike deque indexing which is O(n).
        self._buf: list = [None] * capacity
        self._next_id = 1
        self._lock = threading.Lock()
        self._notifier = notifier
        self._pending = False  # a wakeup is scheduled but notify() has not run yet
        self._subs: dict = {}
        self._next_token = 1
        self._tls = threading.local()
        self.callback_errors = 0  # subscriber/notifier exceptions swallowed

    # -- writing (any thread) -------------------------------------------------

    def append(self, level: str, event: str, /, **fields) -> int:
        """Store an entry and return its id. Fields named like a reserved key
        (id, time, level, event) are kept as ``field_<name>``; they never
        override the ring's own values."""
        entry_time = time.time()
        with self._lock:
            n = self._next_id
            self._next_id = n + 1
            entry = {"id": n, "time": entry_time, "level": level, "event": event}
            for k, v in fields.items():
                entry["field_" + k if k in _RESERVED else k] = v
            self._buf[(n - 1) % self.capacity] = entry
            wake = not self._pending
            self._pending = True
        if self._notifier is None:
            self.notify()
        elif wake:
            try:
                self._notifier()
            except Exception:
                # e.g. the loop is closed: never raise into a logging call, and
                # let the next append try again.
                with self._lock:
                    self._pending = False
                self.callback_errors += 1
        return n

    # -- reading (loop thread) ------------------------------------------------

    @property
    def last_id(self) -> int:
        """Id of the newest entry, 0 if none yet."""
        return self._next_id - 1

    @property
    def oldest_id(self) -> int:
        """Id of the oldest entry still held (== last_id + 1 when empty)."""
        return max(1, self._next_id - self.capacity)

    def __len__(self) -> int:
        return min(self.capacity, self._next_id - 1)

    def read(self, cursor: int, limit: int) -> tuple[list, int, int]:
        """Return ``(entries, next_cursor, dropped)`` for ids >= cursor.

        ``cursor`` 0 or 1 means "from the oldest available". ``limit`` is
        1..MAX_READ_LIMIT. Returned dicts are copies; mutate them freely."""
        if isinstance(cursor, bool) or not isinstance(cursor, int) or cursor < 0:
            raise ValueError(f"cursor must be a nonnegative integer, got {cursor!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_READ_LIMIT:
            raise ValueError(f"limit must be an integer in 1..{MAX_READ_LIMIT}, got {limit!r}")
        with self._lock:
            next_id = self._next_id
            start = min(max(cursor, 1), next_id)  # clamp a future cursor to the live edge
            oldest = max(1, next_id - self.capacity)
            dropped = max(0, oldest - start)
            start = max(start, oldest)
            stop = min(next_id, start + limit)
            cap, buf = self.capacity, self._buf
            held = [buf[(i - 1) % cap] for i in range(start, stop)]
        # Stored dicts are never mutated (a slot is replaced, not edited), so
        # copying outside the lock is safe and keeps appenders unblocked.
        return [dict(e) for e in held], stop, dropped

    # -- subscriptions (loop thread) ------------------------------------------

    def subscribe(self, callback: Callable[[int], object]) -> int:
        """Register ``callback(last_id)``; returns a token for unsubscribe."""
        with self._lock:
            token = self._next_token
            self._next_token += 1
            self._subs[token] = callback
        return token

    def unsubscribe(self, token: int) -> bool:
        """Remove a subscription; False if the token was unknown (idempotent)."""
        with self._lock:
            return self._subs.pop(token, None) is not None

    def notify(self) -> None:
        """Deliver a pending append notification to every subscriber."""
        if getattr(self._tls, "active", False):
            return  # a callback appended (or logged): the loop below redelivers
        self._tls.active = True
        try:
            while True:
                with self._lock:
                    if not self._pending:
                        return
                    self._pending = False
                    last = self._next_id - 1
                    subs = list(self._subs.values())  # callbacks may (un)subscribe
                for cb in subs:
                    try:
                        cb(last)
                    except Exception:
                        # One broken client must not starve the others.
                        self.callback_errors += 1
        finally:
            self._tls.active = False


# -- serialization ------------------------------------------------------------

def _safe_repr(obj) -> str:
    try:
        return repr(obj)
    except Exception:
        return f"<unrepresentable {type(obj).__name__}>"


def _sanitize(obj, depth: int = 0):
    """Make a value JSON-able: unknown objects, non-finite floats and
    odd dict keys become repr() strings; deep or cyclic nesting is cut off."""
    if obj is None or isinstance(obj, (str, bool, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else _safe_repr(obj)
    if depth >= 32:
        return _safe_repr(obj)
    if isinstance(obj, dict):
        return {(k if isinstance(k, str) else _safe_repr(k)): _sanitize(v, depth + 1)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_sanitize(v, depth + 1) for v in obj]
    return _safe_repr(obj)


def _dumps(entry) -> str:
    try:
        # Fast path: plain data, which is almost every entry.
        return json.dumps(entry, ensure_ascii=False, separators=(",", ":"),
                          allow_nan=False, default=_safe_repr)
    except Exception:
        return json.dumps(_sanitize(entry), ensure_ascii=False, separators=(",", ":"))


def _encode(text: str) -> bytes:
    # Lone surrogates (from surrogateescape'd bytes) become \\udcXX, which is
    # itself a valid JSON escape, instead of an encode error.
    return text.encode("utf-8", "backslashreplace")


def to_jsonl(entries) -> bytes:
    """One compact JSON object per line, UTF-8, each followed by ``\\n``."""
    return _encode("".join(_dumps(e) + "\n" for e in entries))


def to_sse(entries, dropped: int = 0) -> bytes:
    """SSE frames: ``id: N`` / ``event: log`` / ``data: <json>`` per entry, so a
    reconnecting EventSource sends ``Last-Event-ID``. A nonzero ``dropped``
    is announced first as ``event: dropped`` with ``data: {"dropped": n}``
    (no id, so it does not move the client's resume point)."""
    parts = []
    if dropped:
        parts.append('event: dropped\ndata: {"dropped":%d}\n\n' % dropped)
    for e in entries:
        # Compact JSON never contains a raw newline, so one data line suffices.
        parts.append(f"id: {e['id']}\nevent: log\ndata: {_dumps(e)}\n\n")
    return _encode("".join(parts))


def sse_cursor_from(last_event_id_header: str | None, cursor_param: str | None) -> int:
    """Starting cursor for a log stream.

    ``Last-Event-ID: N`` (a reconnect) wins and resumes at N+1; otherwise the
    ``cursor`` query parameter is used as is; with neither, 0 (the oldest
    entry held). Values must be plain decimal digits (at most 19); anything
    else raises ValueError. An empty Last-Event-ID counts as absent, since
    SSE uses an empty id to reset it."""
    if last_event_id_header is not None:
        h = last_event_id_header.strip(" \t")
        if h:
            if not _CURSOR.fullmatch(h):
                raise ValueError(f"invalid Last-Event-ID: {last_event_id_header[:40]!r}")
            return int(h) + 1
    if cursor_param is not None:
        if not _CURSOR.fullmatch(cursor_param):
            raise ValueError(f"invalid cursor: {cursor_param[:40]!r}")
        return int(cursor_param)
    return 0


# -- logging bridge -------------------------------------------------------------

# Attributes every LogRecord has; anything else on a record came from extra=.
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message", "asctime", "taskName"}


class RingHandler(logging.Handler):
    """``logging.Handler`` that appends records to a ``LogRing``.

    level = ``record.levelname.lower()``; event = ``extra={"event": ...}`` if
    given (the formatted message is then kept as field ``message``), else the
    formatted message. Other ``extra`` keys become fields; ``logger`` is the
    logger name and ``exc`` the formatted traceback when there is one.
    emit() never raises."""

    def __init__(self, ring: LogRing, level=logging.NOTSET):
        super().__init__(level)
        self.ring = ring

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            fields = {k: v for k, v in record.__dict__.items()
                      if k not in _RECORD_ATTRS and k not in ("event", PRIVATE)}
            event = getattr(record, "event", None)
            if event is None:
                event = message
            elif message:
                fields["message"] = message
            fields.setdefault("logger", record.name)
            if record.exc_info:
                fields["exc"] = (self.formatter or _DEFAULT_FORMATTER).formatException(record.exc_info)
            self.ring.append(str(record.levelname).lower(), str(event), **fields)
        except Exception:
            try:
                self.handleError(record)
            except Exception:
                pass


_DEFAULT_FORMATTER = logging.Formatter()

# A record attribute (extra={PRIVATE: text}) for the operator alone: the whole diagnostic
# about a server file, which the ring (public: /logz) never holds; OperatorFormatter prints it.
PRIVATE = "private"


class OperatorFormatter(logging.Formatter):
    """The standard-error format, with a record's PRIVATE detail on indented lines below it."""

    def format(self, record):
        text = super().format(record)
        private = getattr(record, PRIVATE, None)
        if not private:
            return text
        return text + "".join(f"\n    {line}" for line in str(private).splitlines())
