"""Unit tests for loom.logs (bounded log ring, cursors, JSONL/SSE, logging bridge)."""

import json
import logging
import math
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from loom.logs import (MAX_READ_LIMIT, LogRing, RingHandler, sse_cursor_from, to_jsonl,
                       to_sse)


def ids(entries):
    return [e["id"] for e in entries]


# -- ids, eviction, cursors ------------------------------------------------------

def test_entry_shape_and_ids_start_at_one():
    ring = LogRing(4)
    t0 = time.time()
    assert ring.last_id == 0 and len(ring) == 0 and ring.oldest_id == 1
    assert ring.append("info", "started", model="demo", n=3) == 1
    assert ring.append("warning", "slow") == 2
    entries, nxt, dropped = ring.read(0, 10)
    assert nxt == 3 and dropped == 0
    e = entries[0]
    assert list(e)[:4] == ["id", "time", "level", "event"]
    assert e["id"] == 1 and e["level"] == "info" and e["event"] == "started"
    assert e["model"] == "demo" and e["n"] == 3
    assert t0 - 1 <= e["time"] <= time.time() + 1
    assert ids(entries) == [1, 2]


def test_reserved_field_names_never_override():
    ring = LogRing(2)
    ring.append("info", "e", id=99, time="x", level="y", event="z", ok=1)
    (e,), _, _ = ring.read(0, 1)
    assert (e["id"], e["level"], e["event"]) == (1, "info", "e")
    assert isinstance(e["time"], float)
    assert (e["field_id"], e["field_time"], e["field_level"], e["field_event"], e["ok"]) == (99, "x", "y", "z", 1)


def test_eviction_and_dropped():
    ring = LogRing(3)
    for i in range(1, 8):
        assert ring.append("info", f"e{i}") == i
    assert ring.last_id == 7 and ring.oldest_id == 5 and len(ring) == 3
    assert ring.read(0, 10) == (ring.read(1, 10)[0], 8, 4)
    assert ids(ring.read(1, 10)[0]) == [5, 6, 7]
    entries, nxt, dropped = ring.read(3, 2)
    assert ids(entries) == [5, 6] and nxt == 7 and dropped == 2
    entries, nxt, dropped = ring.read(nxt, 2)
    assert ids(entries) == [7] and nxt == 8 and dropped == 0
    # Caught up: nothing new, cursor stays.
    assert ring.read(8, 5) == ([], 8, 0)
    ring.append("info", "e8")
    assert ids(ring.read(8, 5)[0]) == [8]


def test_future_cursor_clamps_to_live_edge():
    ring = LogRing(3)
    ring.append("info", "a")
    assert ring.read(10 ** 12, 5) == ([], 2, 0)
    empty = LogRing(3)
    assert empty.read(0, 1) == ([], 1, 0)
    assert empty.read(5, 1) == ([], 1, 0)


def test_read_returns_copies():
    ring = LogRing(3)
    ring.append("info", "a", x=1)
    entries, _, _ = ring.read(0, 1)
    entries[0]["x"] = 2
    entries[0]["id"] = 50
    assert ring.read(0, 1)[0][0]["x"] == 1 and ring.read(0, 1)[0][0]["id"] == 1


@pytest.mark.parametrize("limit", [0, -1, MAX_READ_LIMIT + 1, 1.5, "10", None, True])
def test_limit_validation(limit):
    ring = LogRing(3)
    with pytest.raises(ValueError):
        ring.read(0, limit)


@pytest.mark.parametrize("cursor", [-1, 1.0, "0", None, False])
def test_cursor_validation(cursor):
    ring = LogRing(3)
    with pytest.raises(ValueError):
        ring.read(cursor, 10)


def test_limit_bounds_accepted():
    ring = LogRing(2000)
    for _ in range(1500):
        ring.append("debug", "x")
    assert len(ring.read(0, 1)[0]) == 1
    entries, nxt, _ = ring.read(0, MAX_READ_LIMIT)
    assert len(entries) == MAX_READ_LIMIT and nxt == MAX_READ_LIMIT + 1


@pytest.mark.parametrize("cap", [0, -3, 1.5, None, True])
def test_capacity_validation(cap):
    with pytest.raises(ValueError):
        LogRing(cap)


def test_capacity_one():
    ring = LogRing(1)
    for i in range(5):
        ring.append("info", str(i))
    assert ring.read(0, 10) == (ring.read(5, 10)[0], 6, 4)
    assert ids(ring.read(0, 10)[0]) == [5]


# -- property test against a simple model ---------------------------------------

class Model:
    """Keeps every entry ever appended; eviction is just 'the last cap'."""

    def __init__(self, cap):
        self.cap = cap
        self.all = []

    def append(self):
        self.all.append(len(self.all) + 1)
        return self.all[-1]

    def read(self, cursor, limit):
        held = self.all[-self.cap:]
        evicted = self.all[:len(self.all) - len(held)]
        out = [i for i in held if i >= cursor][:limit]
        dropped = sum(1 for i in evicted if i >= cursor)
        nxt = out[-1] + 1 if out else len(self.all) + 1
        return out, nxt, dropped


ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 12)),
        st.tuples(st.just("read"), st.integers(0, 80), st.integers(1, 15)),
        st.tuples(st.just("follow"), st.integers(1, 15)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(cap=st.integers(1, 10), ops=ops)
def test_ring_matches_model(cap, ops):
    ring, model = LogRing(cap), Model(cap)
    follower, seen, gaps = 0, [], 0  # one reader that always resumes at next_cursor
    for op in ops:
        if op[0] == "append":
            for _ in range(op[1]):
                assert ring.append("info", "e") == model.append()
        elif op[0] == "read":
            _, cursor, limit = op
            entries, nxt, dropped = ring.read(cursor, limit)
            assert (ids(entries), nxt, dropped) == model.read(cursor, limit)
        else:
            entries, follower, dropped = ring.read(follower, op[1])
            seen += ids(entries)
            gaps += dropped
    entries, follower, dropped = ring.read(follower, MAX_READ_LIMIT)
    seen += ids(entries)
    gaps += dropped
    # A reader that follows next_cursor sees every id exactly once, in order,
    # or is told it missed it: nothing silently lost, nothing twice.
    assert seen == sorted(set(seen))
    assert len(seen) + gaps == len(model.all)
    assert follower == len(model.all) + 1


# -- JSONL and SSE ---------------------------------------------------------------

class Weird:
    def __repr__(self):
        return "<Weird>"


class BadRepr:
    def __repr__(self):
        raise RuntimeError("no")


def test_to_jsonl_shape_and_unicode():
    ring = LogRing(10)
    ring.append("info", "héllo ✓", text="猫\n\"q\"", n=1.5, ok=True, none=None, nested={"a": [1, 2]})
    ring.append("error", "second")
    data = to_jsonl(ring.read(0, 10)[0])
    assert isinstance(data, bytes) and data.endswith(b"\n")
    lines = data.split(b"\n")
    assert lines[-1] == b"" and len(lines) == 3
    assert "héllo ✓".encode() in lines[0]  # ensure_ascii=False: raw UTF-8
    assert b", " not in lines[1] and b": " not in lines[1]  # compact
    first = json.loads(lines[0])
    assert first["text"] == "猫\n\"q\"" and first["nested"] == {"a": [1, 2]} and first["event"] == "héllo ✓"
    assert json.loads(lines[1])["id"] == 2
    assert to_jsonl([]) == b""


def test_to_jsonl_non_json_values_use_repr():
    ring = LogRing(10)
    cyc = []
    cyc.append(cyc)
    ring.append("info", "a", obj=Weird(), s={3}, b=b"\x00", exc=ValueError("x"))
    ring.append("info", "b", nan=math.nan, inf=-math.inf, tuple_keys={(1, 2): "v", 3: "w"})
    ring.append("info", "c", cyc=cyc, bad=BadRepr())
    ring.append("info", "d", surrogate="bad\udcff byte")
    lines = to_jsonl(ring.read(0, 10)[0]).split(b"\n")[:-1]
    a, b, c, d = (json.loads(l) for l in lines)
    assert a["obj"] == "<Weird>" and a["s"] == "{3}" and a["b"] == "b'\\x00'" and a["exc"] == "ValueError('x')"
    assert b["nan"] == "nan" and b["inf"] == "-inf" and b["tuple_keys"] == {"(1, 2)": "v", "3": "w"}
    assert c["bad"] == "<unrepresentable BadRepr>" and isinstance(c["cyc"], list)
    assert d["surrogate"] == "bad\udcff byte"


def test_to_sse_frames():
    ring = LogRing(10)
    ring.append("info", "multi\nline", x="y")
    ring.append("info", "two")
    entries, _, _ = ring.read(0, 10)
    data = to_sse(entries, dropped=3).decode()
    frames = data.split("\n\n")
    assert frames[-1] == "" and len(frames) == 4
    assert frames[0] == 'event: dropped\ndata: {"dropped":3}'
    head, ev, payload = frames[1].split("\n")
    assert head == "id: 1" and ev == "event: log"
    assert json.loads(payload[len("data: "):])["event"] == "multi\nline"
    assert frames[2].startswith("id: 2\n")
    assert to_sse([]) == b""


# -- sse_cursor_from --------------------------------------------------------------

@pytest.mark.parametrize("header,param,want", [
    (None, None, 0),
    ("41", None, 42),
    ("41", "7", 42),          # a reconnect's Last-Event-ID wins over the original URL
    (None, "7", 7),
    (None, "0", 0),
    ("0", None, 1),
    (" 5\t", None, 6),         # optional whitespace around a header value
    ("", "7", 7),              # empty Last-Event-ID means "none"
    ("  ", None, 0),
    (None, "007", 7),
    ("9" * 19, None, 10 ** 19),
])
def test_sse_cursor_from_valid(header, param, want):
    assert sse_cursor_from(header, param) == want


@pytest.mark.parametrize("header,param", [
    ("-1", None), ("+1", None), ("1.0", None), ("abc", None), ("1e3", None), ("٣", None),
    ("1 2", None), ("9" * 20, None), (None, ""), (None, "-3"), (None, " 3"), (None, "0x10"),
    (None, "9" * 20), (None, "²"), ("x", "5"), ("", "x"),
])
def test_sse_cursor_from_invalid(header, param):
    with pytest.raises(ValueError):
        sse_cursor_from(header, param)


# -- subscriptions and notifications ----------------------------------------------

def test_subscribers_notified_without_notifier():
    ring = LogRing(5)
    got_a, got_b = [], []
    ta = ring.subscribe(got_a.append)
    ring.subscribe(got_b.append)
    ring.append("info", "x")
    ring.append("info", "y")
    assert got_a == [1, 2] and got_b == [1, 2]
    assert ring.unsubscribe(ta) is True
    assert ring.unsubscribe(ta) is False
    ring.append("info", "z")
    assert got_a == [1, 2] and got_b == [1, 2, 3]


def test_failing_subscriber_does_not_starve_others():
    ring = LogRing(5)
    got = []

    def bad(_):
        raise RuntimeError("client gone")

    ring.subscribe(bad)
    ring.subscribe(got.append)
    ring.append("info", "x")
    assert got == [1] and ring.callback_errors == 1


def test_reentrant_append_from_subscriber():
    ring = LogRing(10)
    got = []

    def cb(last):
        got.append(last)
        if last == 1:
            ring.append("info", "from-callback")  # must not recurse

    ring.subscribe(cb)
    ring.append("info", "x")
    assert got == [1, 2]


def test_subscriber_may_unsubscribe_itself():
    ring = LogRing(5)
    got = []
    token = None

    def once(last):
        got.append(last)
        ring.unsubscribe(token)

    token = ring.subscribe(once)
    ring.append("info", "a")
    ring.append("info", "b")
    assert got == [1]


def test_notifier_coalesces_until_loop_notifies():
    wakeups = []
    ring = LogRing(10, notifier=lambda: wakeups.append(1))
    got = []
    ring.subscribe(got.append)
    ring.append("info", "a")
    ring.append("info", "b")
    ring.append("info", "c")
    assert wakeups == [1] and got == []  # nothing runs on the appending thread
    ring.notify()  # what the loop runs
    assert got == [3]
    ring.notify()  # nothing pending: no spurious callback
    assert got == [3]
    ring.append("info", "d")
    assert wakeups == [1, 1]
    ring.notify()
    assert got == [3, 4]


def test_notifier_failure_is_swallowed_and_retried():
    calls = []

    def notifier():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("loop closed")

    ring = LogRing(4, notifier=notifier)
    assert ring.append("info", "a") == 1  # no exception into the caller
    ring.append("info", "b")  # the failed wakeup did not leave 'pending' stuck
    assert len(calls) == 2 and ring.callback_errors == 1


def test_notifier_delivers_on_loop_thread():
    # A worker appends; the notifier hops to the 'loop' thread like
    # call_soon_threadsafe would, and subscribers run there.
    import queue

    q = queue.Queue()
    ring = LogRing(100, notifier=lambda: q.put(ring.notify))
    seen_threads, got = set(), []
    ring.subscribe(lambda last: (seen_threads.add(threading.get_ident()), got.append(last)))
    worker = threading.Thread(target=lambda: [ring.append("info", "w", i=i) for i in range(50)])
    worker.start()
    worker.join()
    while not q.empty():
        q.get()()
    assert seen_threads == {threading.get_ident()}
    assert got and got[-1] == 50


# -- thread safety ------------------------------------------------------------------

def test_concurrent_appends_unique_contiguous_ids():
    n_threads, per = 8, 2000
    ring = LogRing(n_threads * per)
    returned = [[] for _ in range(n_threads)]
    barrier = threading.Barrier(n_threads)

    def work(t):
        barrier.wait()
        for i in range(per):
            returned[t].append(ring.append("info", "w", t=t, i=i))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    all_ids = sorted(i for r in returned for i in r)
    assert all_ids == list(range(1, n_threads * per + 1))
    entries, cursor = [], 0
    while True:
        batch, cursor, dropped = ring.read(cursor, MAX_READ_LIMIT)
        assert dropped == 0
        if not batch:
            break
        entries += batch
    assert ids(entries) == all_ids
    for t in range(n_threads):
        mine = [e for e in entries if e["t"] == t]
        assert [e["i"] for e in mine] == list(range(per))  # each thread's order kept
        assert [e["id"] for e in mine] == returned[t]


def test_concurrent_appends_while_reading_small_ring():
    ring = LogRing(64)
    stop = threading.Event()

    def work():
        while not stop.is_set():
            ring.append("debug", "spin")

    threads = [threading.Thread(target=work) for _ in range(3)]
    for th in threads:
        th.start()
    try:
        cursor, seen, gaps = 0, 0, 0
        for _ in range(2000):
            batch, nxt, dropped = ring.read(cursor, 50)
            assert ids(batch) == list(range(nxt - len(batch), nxt))
            assert not batch or batch[0]["id"] == max(cursor, 1) + dropped
            seen, gaps, cursor = seen + len(batch), gaps + dropped, nxt
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert seen + gaps == cursor - 1


# -- logging bridge -------------------------------------------------------------------

@pytest.fixture
def bridged():
    ring = LogRing(50)
    logger = logging.getLogger("loom.test.logs")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    handler = RingHandler(ring)
    logger.addHandler(handler)
    logger.ring_handler = handler
    yield ring, logger
    logger.removeHandler(handler)


def test_handler_message_as_event(bridged):
    ring, logger = bridged
    logger.warning("loaded %s in %d ms", "demo", 12)
    (e,), _, _ = ring.read(0, 10)
    assert e["level"] == "warning" and e["event"] == "loaded demo in 12 ms"
    assert e["logger"] == "loom.test.logs"
    assert "msg" not in e and "args" not in e and "lineno" not in e  # no LogRecord noise


def test_handler_event_and_extra_fields(bridged):
    ring, logger = bridged
    logger.info("model %s ready", "demo", extra={"event": "model_ready", "model": "demo", "ms": 3.5})
    logger.debug("", extra={"event": "tick"})
    a, b = ring.read(0, 10)[0]
    assert a["level"] == "info" and a["event"] == "model_ready"
    assert a["model"] == "demo" and a["ms"] == 3.5 and a["message"] == "model demo ready"
    assert b["event"] == "tick" and b["level"] == "debug" and "message" not in b
    json.loads(to_jsonl([a, b]).split(b"\n")[0])


def test_handler_exception_and_reserved_extra(bridged):
    ring, logger = bridged
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed", extra={"id": 7, "level": "x"})
    (e,), _, _ = ring.read(0, 10)
    assert e["id"] == 1 and e["level"] == "error" and e["event"] == "failed"
    assert e["field_id"] == 7 and e["field_level"] == "x"
    assert "ValueError: boom" in e["exc"] and "Traceback" in e["exc"]


def test_handler_never_raises(bridged, monkeypatch):
    ring, logger = bridged
    monkeypatch.setattr(logging, "raiseExceptions", False)  # keep stderr quiet
    logger.error("bad %d format", "not-a-number")  # getMessage() raises inside emit
    handler = logger.ring_handler

    class Broken:
        def append(self, *a, **k):
            raise RuntimeError("ring broken")

    handler.ring = Broken()
    logger.error("still fine")
    handler.ring = ring
    logger.error("ok")
    entries = ring.read(0, 10)[0]
    assert [e["event"] for e in entries] == ["ok"]


def test_handler_respects_level():
    ring = LogRing(10)
    logger = logging.getLogger("loom.test.logs.level")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    handler = RingHandler(ring, level=logging.WARNING)
    logger.addHandler(handler)
    try:
        logger.info("quiet")
        logger.warning("loud")
    finally:
        logger.removeHandler(handler)
    assert [e["event"] for e in ring.read(0, 10)[0]] == ["loud"]
