"""Retained state at the scheduler: multi-turn reuse, LRU bounds, checkpoints (pin, fork,
rewind, delete), copy-on-write of shared pages, and host suspension.

Greedy tokens are compared with the independent numpy reference of test_llama
(cold runs), never with the engine itself; every test ends with the page pool
back at its baseline.
"""

import numpy as np
import pytest

from loom.kvcache import History
from loom.errors import Error
from loom.scheduler import Refused, Sequence, TextEngine
from loom.loop import Loop
from test_llama import device, greedy_reference, prepared_model  # noqa: F401  (device: a fixture)
from test_scheduler import run_all, tick

PAGE, PAGES, CTX = 16, 48, 512


@pytest.fixture(scope="module")
def model(device, tmp_path_factory):  # noqa: F811  (the imported fixture)
    prepared, weights = prepared_model(device, tmp_path_factory.mktemp("r"), "qwen2", "F32", 23, PAGES, CTX)
    yield prepared, weights
    prepared.release()


@pytest.fixture
def loop():
    loop = Loop(2)
    yield loop
    loop.close()


def run(engine, loop, prompt, n=5, **kw):
    seq = Sequence(prompt, max_tokens=n, **kw)
    engine.submit(seq)
    run_all(engine, loop, [seq])
    return seq


def assert_greedy(weights, seq):
    """The engine's tokens equal a cold numpy run of the same prompt (ties aside)."""
    want, gaps = greedy_reference(weights, "qwen2", seq.prompt, len(seq.generated))
    bad = next((i for i, (a, b) in enumerate(zip(seq.generated, want)) if a != b), None)
    assert bad is None or gaps[bad] < 1e-4, (seq.generated, want)


def test_three_turns_reuse_exactly_the_previous_turn(model, loop):
    prepared, weights = model
    engine = TextEngine(prepared, loop, rows=2, pages=PAGES, page_size=PAGE, chunk=16)
    prompt = [5, 17, 33, 2, 9, 60, 61, 70, 71, 3, 12, 14, 19]
    first = run(engine, loop, prompt, session="talk")
    assert first.cached == 0
    second = run(engine, loop, prompt + first.generated + [40, 41, 42], session="talk")
    third = run(engine, loop, second.prompt + second.generated + [43, 44], session="talk")
    # Everything but each turn's last sampled token (never fed back) is reused.
    assert second.cached == len(first.prompt) + len(first.generated) - 1
    assert third.cached == len(second.prompt) + len(second.generated) - 1
    for seq in (first, second, third):
        assert_greedy(weights, seq)
    engine.release_idle()
    assert engine.pool.available == PAGES


def test_session_and_prefix_caches_evict_least_recently_used_at_capacity_one(model, loop):
    prepared, _ = model
    engine = TextEngine(prepared, loop, rows=1, pages=PAGES, page_size=PAGE, chunk=16, session_capacity=1,
                        prefix_capacity=1)
    for name in ("a", "b"):
        run(engine, loop, [3, 4, 5, 6], n=2, session=name)
    assert list(engine.sessions) == ["a", "b"]           # rows + 1 named histories
    run(engine, loop, [3, 4, 5, 6, 7], n=1, session="a")  # touching a makes b the oldest
    run(engine, loop, [8, 8, 8], n=1, session="c")
    assert list(engine.sessions) == ["a", "c"]
    evicted = run(engine, loop, [3, 4, 5, 6, 9], n=1, session="b")
    assert evicted.cached == 0                           # b was evicted: its history replays
    # Prefix cache of one slot: a new branch's natural boundary reclaims the old entry.
    run(engine, loop, list(range(1, 40)), n=1)
    assert list(engine.prefixes) == [tuple(range(1, 17))]
    run(engine, loop, list(range(100, 140)), n=1)
    assert list(engine.prefixes) == [tuple(range(100, 116))]
    engine.release_idle()
    assert engine.pool.available == PAGES and not engine.sessions and not engine.prefixes


def test_checkpoint_pin_fork_rewind_delete(model, loop):
    prepared, weights = model
    engine = TextEngine(prepared, loop, rows=2, pages=PAGES, page_size=PAGE, chunk=16, checkpoint_capacity=2,
                        session_capacity=4)
    base = run(engine, loop, [5, 17, 33, 2, 9, 60, 61, 70, 71, 3, 12, 14, 19, 22, 23, 24, 25, 26], n=6,
               session="main")
    cp = engine.pin("tool-summary", "main")
    assert cp.tokens == base.prompt + base.generated[:-1] and cp.pending == base.generated[-1]
    assert len(cp.tokens) % PAGE, "the endpoint should end inside a page, to exercise copy-on-write"
    endpoint = cp.tokens + [cp.pending]
    # Fork into two other sessions: each starts exactly at the endpoint (the shared, partly
    # filled last page is copied, not recomputed) and gives the cold run's tokens.
    forks = []
    for name, suffix in (("fork-1", [40, 41]), ("fork-2", [50, 51, 52])):
        seq = run(engine, loop, endpoint + suffix, n=5, session=name, checkpoint=engine.borrow("tool-summary"))
        assert seq.cached == len(cp.tokens)
        assert_greedy(weights, seq)
        forks.append(seq)
    assert engine.checkpoints["tool-summary"].tokens == cp.tokens    # immutable: forks never wrote into it
    # The pinned session moves on, then rewinds to the endpoint, dropping what came after.
    run(engine, loop, endpoint + [7, 7, 7], n=3, session="main")
    rewound = run(engine, loop, endpoint + [40, 41], n=5, session="main", checkpoint=engine.borrow("tool-summary"))
    assert rewound.cached == len(cp.tokens) and rewound.generated == forks[0].generated
    # Rules: duplicate name 409, busy session 409, absent 404, capacity 503, borrowed deletion 409.
    with pytest.raises(Refused) as e:
        engine.pin("tool-summary", "fork-1")
    assert e.value.code == "checkpoint_exists" and Error.of(e.value).status == 409
    with pytest.raises(Refused) as e:
        engine.pin("other", "nobody")
    assert e.value.code == "session_not_found" and Error.of(e.value).status == 404
    engine.pin("second", "fork-1")
    with pytest.raises(Refused) as e:
        engine.pin("third", "fork-2")
    assert e.value.code == "checkpoint_capacity" and Error.of(e.value).status == 503
    busy = Sequence(endpoint + [9], max_tokens=50, session="fork-2")
    engine.submit(busy)
    with pytest.raises(Refused) as e:
        engine.pin("third", "fork-2")                    # queued or running: busy before full
    assert e.value.code == "session_busy" and Error.of(e.value).status == 409
    engine.cancel(busy)
    while busy.finish_reason is None:
        tick(loop)
    borrowed = engine.borrow("tool-summary")
    with pytest.raises(Refused) as e:
        engine.delete("tool-summary")
    assert e.value.code == "checkpoint_borrowed" and Error.of(e.value).status == 409
    engine.unborrow(borrowed)
    with pytest.raises(Refused) as e:
        engine.borrow("missing")
    assert e.value.code == "checkpoint_not_found" and Error.of(e.value).status == 404
    engine.delete("tool-summary")
    engine.delete("second")
    assert not engine.checkpoints
    engine.release_idle()
    assert engine.pool.available == PAGES


def test_pinned_checkpoints_survive_trim_and_a_busy_session_cannot_be_pinned(model, loop):
    prepared, _ = model
    engine = TextEngine(prepared, loop, rows=1, pages=PAGES, page_size=PAGE, checkpoint_capacity=1)
    run(engine, loop, [1, 2, 3, 4], n=3, session="s")
    cp = engine.pin("keep", "s")
    engine.release_idle()                                # trim: idle caches go, pins stay
    assert not engine.sessions and engine.pool.available == PAGES - len(cp.pages)
    long = Sequence([6, 6, 6], max_tokens=200, session="t")
    engine.submit(long)
    with pytest.raises(Refused) as e:
        engine.pin("keep2", "t")
    assert e.value.code == "session_busy" and Error.of(e.value).status == 409
    engine.cancel(long)
    while long.finish_reason is None:
        tick(loop)
    engine.delete("keep")
    assert engine.pool.available == PAGES


def test_suspend_then_resume_gives_the_same_tokens(model, loop):
    prepared, weights = model
    engine = TextEngine(prepared, loop, rows=1, pages=PAGES, page_size=PAGE, chunk=16, checkpoint_capacity=1,
                        elastic=True)
    base = run(engine, loop, list(range(30, 51)), n=4, session="s")
    cp = engine.pin("park", "s")
    endpoint = cp.tokens + [cp.pending]
    before = run(engine, loop, endpoint + [1, 2], n=5, session="x", checkpoint=engine.borrow("park"))
    engine.release_idle()                                 # only the checkpoint holds pages now
    held = len(cp.pages)
    assert engine.pool.available == PAGES - held
    result = {}
    engine.suspend("park", lambda c, error: result.update(cp=c, error=error))
    while not result:
        tick(loop)
    assert result["error"] is None and cp.pages is None
    page_bytes = 2 * prepared.spec("L") * PAGE * prepared.spec("KVD") * 4      # k and v, f32
    assert cp.host_bytes == held * page_bytes
    assert engine.pool.available == PAGES                 # the device pages went back
    # Scribble over every free page, so a resume that did not restore would show.
    scratch = run(engine, loop, list(range(200, 260)), n=2)
    engine.release_idle()
    after = run(engine, loop, endpoint + [1, 2], n=5, session="y", checkpoint=engine.borrow("park"))
    assert after.generated == before.generated and after.cached == len(cp.tokens)
    assert cp.host is None and len(cp.pages) == held      # warmed back into (new) pool pages
    assert_greedy(weights, after)
    del scratch, base
    engine.delete("park")
    engine.release_idle()
    assert engine.pool.available == PAGES


def test_fixed_backing_refuses_suspension(model, loop):
    prepared, _ = model
    engine = TextEngine(prepared, loop, rows=1, pages=PAGES, page_size=PAGE, checkpoint_capacity=1)
    run(engine, loop, [1, 2, 3], n=2, session="s")
    engine.pin("p", "s")
    with pytest.raises(Refused) as e:
        engine.suspend("p", lambda *a: None)
    assert e.value.code == "fixed_backing" and Error.of(e.value).status == 400
    engine.delete("p")
    engine.release_idle()
    assert engine.pool.available == PAGES


def test_an_impossible_restore_is_refused_and_keeps_the_destination(model, loop):
    prepared, _ = model
    engine = TextEngine(prepared, loop, rows=2, pages=8, page_size=PAGE, chunk=16, checkpoint_capacity=1,
                        elastic=True)
    run(engine, loop, list(range(1, 60)), n=2, session="s")       # 4 pages
    engine.pin("p", "s")
    engine.release_idle()                                          # the checkpoint alone holds them
    done = {}
    engine.suspend("p", lambda c, error: done.update(error=error))
    while not done:
        tick(loop)
    dest = run(engine, loop, [9, 9, 9], n=2, session="dest")
    hog = Sequence(list(range(1, 100)), max_tokens=12)             # holds the other 7 pages meanwhile
    engine.submit(hog)
    while hog.fed < len(hog.prompt):
        tick(loop)
    refused = run(engine, loop, list(range(1, 60)) + [3], n=2, session="dest", checkpoint=engine.borrow("p"))
    assert refused.finish_reason == "refused" and refused.generated == []
    assert engine.sessions["dest"].tokens == (dest.prompt + dest.generated)[:4]   # untouched
    assert engine.checkpoints["p"].borrowers == 0
    engine.cancel(hog)
    while hog.finish_reason is None:                               # its row goes once the step retires
        tick(loop)
    engine.delete("p")
    engine.release_idle()
    assert engine.pool.available == 8


def test_sequence_engine_appends_exactly_and_a_slow_reader_sits_out(model, loop):
    """Stage encode: per-step chunks of known ids, exact continuation from a handle, and a
    row whose consumer is not ready leaves the cohorts while another continues."""
    prepared, _ = model
    engine = TextEngine(prepared, loop, rows=2, pages=PAGES, page_size=PAGE, chunk=16, stage="encode",
                        session_capacity=2, checkpoint_capacity=1)
    size = prepared.spec("SEQUENCE_BYTES")
    chunks = []
    first = Sequence(list(range(1, 41)), session="h1", on_chunk=lambda p, ids, data: chunks.append((p, ids, data)))
    engine.submit(first)
    run_all(engine, loop, [first])
    assert [(p, len(ids)) for p, ids, _ in chunks] == [(0, 16), (16, 16), (32, 8)]   # the execution steps
    assert all(len(data) == len(ids) * size for _, ids, data in chunks)
    assert engine.sessions["h1"].tokens == list(range(1, 41)) and engine.sessions["h1"].pending is None
    whole = b"".join(d for _, _, d in chunks)
    # Append 5 ids to the handle: the KV of the first 40 is reused exactly (not recomputed).
    saved = engine.claim("h1", 40)
    more = []
    tail = Sequence(list(range(1, 46)), session="h1", resume=saved, on_chunk=lambda p, ids, d: more.append((p, d)))
    engine.submit(tail)
    run_all(engine, loop, [tail])
    assert tail.cached == 40 and [p for p, _ in more] == [40]
    with pytest.raises(Refused) as e:
        engine.claim("h1", 40)                            # stale: it has completed 45 now
    assert e.value.code == "sequence_conflict" and Error.of(e.value).status == 409
    with pytest.raises(Refused) as e:
        engine.claim("nobody", 0)
    assert e.value.code == "session_not_found" and Error.of(e.value).status == 404
    # One-shot of all 45 gives the same per-token bytes (within f16 rounding of other layouts).
    once = []
    alone = Sequence(list(range(1, 46)), session="h2", on_chunk=lambda p, ids, d: once.append(d))
    engine.submit(alone)
    run_all(engine, loop, [alone])
    got = np.frombuffer(whole + more[0][1], np.float16).astype(np.float32)
    want = np.frombuffer(b"".join(once), np.float16).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    # A slow reader: its row sits out while the other sequence runs to the end.
    ready = {"slow": False}
    slow = Sequence(list(range(1, 60)), session="slow", ready=lambda: ready["slow"])
    fast = Sequence(list(range(60, 120)), session="fast")
    engine.submit(slow)
    engine.submit(fast)
    run_all(engine, loop, [fast])
    assert fast.finish_reason == "stop" and slow.fed == 0 and slow.finish_reason is None
    ready["slow"] = True
    engine.wake()
    run_all(engine, loop, [slow])
    assert slow.fed == 59
    engine.release_idle()
    assert engine.pool.available == PAGES


def test_a_sequence_that_must_replay_history_emits_only_its_new_ids(model, loop):
    """If a shared partial page cannot be copied, the history inside it is computed again,
    but the caller still gets chunks for exactly the ids it sent, at their positions."""
    prepared, _ = model
    engine = TextEngine(prepared, loop, rows=1, pages=PAGES, page_size=PAGE, chunk=16, stage="encode",
                        session_capacity=2, checkpoint_capacity=1)
    first = Sequence(list(range(1, 21)), session="h")
    engine.submit(first)
    run_all(engine, loop, [first])
    engine.pin("cp", "h")                                # shares h's partly filled second page

    def append(copy):
        engine.tables[0].copy = copy
        got = []
        seq = Sequence(list(range(1, 24)), session="h", resume=engine.claim("h", 20), first_output=20,
                       on_chunk=lambda p, ids, data: got.append((p, list(ids), data)))
        engine.submit(seq)
        run_all(engine, loop, [seq])
        return seq, got

    replayed, chunks = append(None)                      # no copier: the boundary moves to the page start
    assert replayed.cached == 16 and [(p, ids) for p, ids, _ in chunks] == [(20, [21, 22, 23])]
    engine.release_idle()
    cp = engine.checkpoints["cp"]
    engine.pool.share(cp.pages)
    engine.retain("h", History(cp.tokens, cp.pages))     # back to the pinned endpoint, sharing its pages
    copied, again = append(engine.paged.copy)
    assert copied.cached == 20 and [(p, ids) for p, ids, _ in again] == [(20, [21, 22, 23])]
    a = np.frombuffer(chunks[0][2], np.float16).astype(np.float32)
    b = np.frombuffer(again[0][2], np.float16).astype(np.float32)
    np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2 * np.abs(b).max())
    engine.delete("cp")
    engine.release_idle()
    assert engine.pool.available == PAGES


def test_checkpoint_controls_take_one_slot_in_turn(model, loop):
    """Pin, suspend and delete share one control slot per deployment: a control waits for
    the one before it to release, and the waiting queue is bounded."""
    from loom.scheduler import CONTROL_QUEUE
    prepared, _ = model
    engine = TextEngine(prepared, loop, rows=1, pages=PAGES, page_size=PAGE, checkpoint_capacity=1)
    ran, releases = [], []
    engine.take_control(lambda release: (ran.append(0), releases.append(release)))
    for i in range(1, CONTROL_QUEUE + 1):
        engine.take_control(lambda release, i=i: (ran.append(i), releases.append(release)))
    with pytest.raises(Refused) as e:
        engine.take_control(lambda release: None)
    assert e.value.code == "control_queue_full" and Error.of(e.value).status == 503
    assert ran == [0]                                     # the others wait for the slot
    releases[0]()
    releases[0]()                                         # a second release is a no-op
    tick(loop)
    assert ran == [0, 1]
    for n in range(1, CONTROL_QUEUE + 1):
        releases[n]()
        tick(loop)
    assert ran == list(range(CONTROL_QUEUE + 1)) and not engine.control_busy
