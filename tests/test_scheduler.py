"""Continuous batching on the llama package: cohorts, chunked prefill, device sampling, stops."""

import time

import numpy as np
import pytest

from loom.scheduler import Sequence, TextEngine
from loom.loop import Loop
from test_llama import V, device, greedy_reference, prepared_model  # noqa: F401  (device: a fixture)

PAGE, PAGES, CTX = 16, 48, 512


@pytest.fixture(scope="module")
def model(device, tmp_path_factory):  # noqa: F811  (the imported fixture)
    prepared, weights = prepared_model(device, tmp_path_factory.mktemp("s"), "qwen2", "F32", 21, PAGES, CTX)
    yield prepared, weights
    prepared.release()


def tick(loop):
    """The server's loop always has its sweep timer; a bare loop needs one to never block forever."""
    loop.call_later(0.01, lambda: None)
    loop.run_once()


def run_all(engine, loop, seqs, timeout=120):
    deadline = time.monotonic() + timeout
    while any(s.finish_reason is None and not s.cancelled for s in seqs) and time.monotonic() < deadline:
        tick(loop)
    assert time.monotonic() < deadline, "generation did not finish"


def test_greedy_cohorts_match_numpy_token_for_token(model):
    prepared, weights = model
    loop = Loop(2)
    engine = TextEngine(prepared, loop, rows=3, pages=PAGES, page_size=PAGE, chunk=16, token_budget=64)
    prompts = [[5, 17, 33, 2, 9, 60, 61], [90, 1, 1, 44], list(np.random.default_rng(4).integers(0, V, 70))]
    seqs = [Sequence(p, max_tokens=20) for p in prompts]
    for s in seqs:
        engine.submit(s)
    run_all(engine, loop, seqs)
    for s, p in zip(seqs, prompts):
        want, gaps = greedy_reference(weights, "qwen2", p, 20)
        mismatch = next((i for i, (a, b) in enumerate(zip(s.generated, want)) if a != b), None)
        assert mismatch is None or gaps[mismatch] < 1e-4, (s.generated, want)
        assert s.finish_reason == "length"
    held = sum(len(t.pages) for r, t in enumerate(engine.tables) if engine.history[r])
    assert engine.pool.available + held == PAGES   # only idle conversations keep pages...
    engine.release_idle()
    assert engine.pool.available == PAGES          # ...and they give them back
    loop.close()


def test_long_prompt_never_stalls_decoding_rows(model):
    prepared, _ = model
    loop = Loop(2)
    engine = TextEngine(prepared, loop, rows=2, pages=PAGES, page_size=PAGE, chunk=16, token_budget=64)
    short = Sequence([1, 2, 3], max_tokens=12)
    cohorts = []
    original = engine.launch

    def spy(work, done):
        cohorts.append([(row, len(ids)) for row, ids in work])
        original(work, done)

    engine.launch = spy
    engine.submit(short)
    tick(loop)
    long = Sequence(list(range(1, 90)), max_tokens=2)
    engine.submit(long)
    run_all(engine, loop, [short, long])
    # The long prompt prefills a chunk at a time, and every one of those steps also
    # advances the short row by its one decode token: decoding never stalls.
    prefills = [dict(c) for c in cohorts if dict(c).get(1, 0) > 1]
    assert len(prefills) == -(-89 // 16) and all(c[1] <= 16 for c in prefills)
    assert all(c.get(0) == 1 for c in prefills[:5])
    assert len(short.generated) == 12 and len(long.generated) == 2
    loop.close()


def test_seeded_sampling_is_the_same_batched_or_alone(model):
    prepared, _ = model
    results = []
    for batch in (False, True):
        loop = Loop(2)
        engine = TextEngine(prepared, loop, rows=3, pages=PAGES, page_size=PAGE)
        seq = Sequence([7, 8, 9], max_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=12345)
        others = [Sequence([3, 3, i], max_tokens=10, temperature=1.0, seed=i) for i in range(2)] if batch else []
        for s in [seq] + others:
            engine.submit(s)
        run_all(engine, loop, [seq] + others)
        results.append(seq.generated)
        loop.close()
    assert results[0] == results[1]


def test_stop_tokens_cancellation_and_backpressure(model):
    prepared, weights = model
    loop = Loop(2)
    engine = TextEngine(prepared, loop, rows=2, pages=PAGES, page_size=PAGE)
    want, _ = greedy_reference(weights, "qwen2", [5, 6, 7], 6)
    stopper = Sequence([5, 6, 7], max_tokens=20, stop_ids={want[3]})
    gate = {"open": False}
    slow = Sequence([5, 6, 7], max_tokens=6, ready=lambda: gate["open"])
    gone = Sequence([9, 9, 9], max_tokens=50)
    for s in (stopper, slow):
        engine.submit(s)
    run_all(engine, loop, [stopper])
    assert stopper.finish_reason == "stop" and stopper.generated == want[:want.index(want[3]) + 1]
    assert len(slow.generated) == 1          # its reader is backed up: it sits out
    engine.submit(gone)
    for _ in range(500):
        tick(loop)
        if len(gone.generated) >= 2:
            break
    engine.cancel(gone)
    gate["open"] = True
    engine.wake()
    run_all(engine, loop, [slow])
    assert slow.generated == want[:6] and slow.finish_reason == "length"
    for _ in range(20):
        tick(loop)
    engine.release_idle()
    assert engine.rows == [None, None] and engine.pool.available == PAGES
    loop.close()


@pytest.fixture(scope="module")
def llama_model(device, tmp_path_factory):  # noqa: F811
    """An untied head: greedy and sampled tokens that vary (qwen2's tied head mostly repeats)."""
    prepared, weights = prepared_model(device, tmp_path_factory.mktemp("l"), "llama", "F32", 5, PAGES, CTX)
    yield prepared, weights
    prepared.release()


def test_decode_runs_ahead_on_the_device_with_the_tokens_of_single_steps(llama_model, monkeypatch):
    """A cohort of decode rows runs up to DECODE_RUNS tokens ahead, each run fed the ids the
    one before sampled: the same tokens (greedy, seeded sampling) as one token a step, rows
    that stop or reach max_tokens in the middle of a cohort keep no token past that, an
    owner's stop (a stop string) ends its row at once, and every page comes back."""
    import loom.scheduler as scheduler
    prepared, weights = llama_model
    want, _ = greedy_reference(weights, "llama", [5, 6, 7], 12)
    outcomes, cohorts = {}, {}
    for runs in (1, 4, 16):
        monkeypatch.setattr(scheduler, "DECODE_RUNS", runs)
        loop = Loop(2)
        engine = TextEngine(prepared, loop, rows=4, pages=PAGES, page_size=PAGE)
        launched = []
        original = engine.launch

        def spy(work, done, original=original, launched=launched, engine=engine):
            original(work, done)
            launched.append(engine.runs)

        engine.launch = spy
        greedy = Sequence([5, 6, 7], max_tokens=11)
        sampled = Sequence([9, 8, 7, 6], max_tokens=9, temperature=2.0, seed=77)
        stopper = Sequence([5, 6, 7], max_tokens=20, stop_ids={want[5]})
        owner = Sequence([1, 2, 3], max_tokens=20, session="owner")
        owner.on_token = lambda token: len(owner.generated) == 6 and engine.stop(owner)
        seqs = [greedy, sampled, stopper, owner]
        for seq in seqs:
            engine.submit(seq)
        run_all(engine, loop, seqs)
        outcomes[runs] = [(s.generated, s.finish_reason) for s in seqs]
        cohorts[runs] = launched
        assert greedy.generated == want[:11] and greedy.finish_reason == "length"
        assert stopper.generated == want[:want.index(want[5]) + 1] and stopper.finish_reason == "stop"
        assert len(owner.generated) == 6 and owner.finish_reason == "stop"
        assert len(sampled.generated) == 9
        for _ in range(20):
            tick(loop)
        # an idle row's kept length is its kept conversation (a named one took its pages along)
        assert [t.length for t in engine.tables] == [len(h or ()) for h in engine.history]
        assert engine.sessions["owner"].tokens == owner.prompt + owner.generated[:-1 if runs == 1 else None]
        engine.release_idle()
        assert engine.rows == [None] * 4 and engine.pool.available == PAGES
        loop.close()
    assert outcomes[4] == outcomes[1] and outcomes[16] == outcomes[1]
    assert set(cohorts[1]) == {1} and max(cohorts[4]) == 4 and max(cohorts[16]) > 4   # it did run ahead...
    assert len(cohorts[16]) <= len(cohorts[4]) < len(cohorts[1])                    # ...in fewer host round trips


def test_a_run_chain_ends_early_for_arrivals_and_cancellations(llama_model, monkeypatch):
    """A long chain of decode runs streams each run's token as it completes, and ends soon
    after a request arrives (which then starts long before the chain's 99 runs would have
    ended: a run or two on a 2-core host serving a real model, more where the loop lags
    behind runs this tiny model makes in a fraction of a millisecond) or after a row is
    cancelled; tokens are those of single steps, pages come back."""
    import loom.scheduler as scheduler
    prepared, weights = llama_model
    monkeypatch.setattr(scheduler, "DECODE_RUNS", 128)
    want, _ = greedy_reference(weights, "llama", [5, 6, 7], 100)
    loop = Loop(2)
    engine = TextEngine(prepared, loop, rows=4, pages=PAGES, page_size=PAGE)
    first = Sequence([5, 6, 7], max_tokens=100)
    late = Sequence([9, 8, 7, 6], max_tokens=3)
    seen = {}

    def on_token(token):
        if len(first.generated) == 3:
            engine.submit(late)                     # arrives while the chain runs
        if late.generated and "late" not in seen:
            seen["late"] = len(first.generated)     # how far the first row went meanwhile
    first.on_token = on_token
    engine.submit(first)
    run_all(engine, loop, [first, late])
    assert first.generated == want and first.finish_reason == "length"
    assert late.finish_reason == "length" and len(late.generated) == 3
    assert seen.get("late", 100) < 70, seen        # not after 100 tokens: the chain was cut

    runs = []                                     # run indices the chain delivered before its last
    ran = engine._ran
    engine._ran = lambda work, ids, run, seqs: (runs.append(run), ran(work, ids, run, seqs))
    cancelled = Sequence([5, 6, 7], max_tokens=100)
    cancelled.on_token = lambda token: len(cancelled.generated) == 4 and engine.cancel(cancelled)
    engine.submit(cancelled)
    run_all(engine, loop, [cancelled])
    deadline = time.monotonic() + 60
    while engine.cohort is not None and time.monotonic() < deadline:
        tick(loop)                                # the chain's step retires
    assert cancelled.generated == want[:4]
    assert max(runs) < 70, runs                   # cut, not run to its 99th token
    for _ in range(20):
        tick(loop)                                # the cancelled row leaves at the boundary
    engine.release_idle()
    assert engine.rows == [None] * 4 and engine.pool.available == PAGES
    loop.close()


def test_a_run_that_fails_to_enqueue_ends_the_stage_once(llama_model):
    """run_stage with runs: a run that fails to enqueue (its sampler, say) ends the stage
    with the error, exactly once (the rows retire with it; runs RUNS_AHEAD before it were
    reported as they completed), and every buffer of the stage is released, whichever run
    failed."""
    from loom import runtime
    prepared, _ = llama_model
    device = prepared.device
    table = np.arange(prepared.spec("MAX_PAGES"), dtype=np.int32)
    inputs = {"tokens": np.array([5], np.int32), "pos": np.array([0], np.int32),
              "row_of": np.array([0], np.int32), "pages": table, "last": np.array([0], np.int32)}
    for fail_at in (None, 2, 0):
        loop = Loop(2)
        before = device.pool.usage()     # (after the first pass: the plan holds its scratch)
        reported, ended = [], []

        def after(buffers, run, fail_at=fail_at):
            if run == fail_at:
                raise RuntimeError(f"run {run} could not be enqueued")
            ids = device.pool.alloc(4, prepared.name, "workspace", host=np.array([7], np.int32))
            transfer = device.download_async(ids, np.int32, 1)
            return {"ids": transfer}, ids.release, ({"pos": inputs["pos"] + run + 1}, {"tokens": ids})

        runtime.run_stage(prepared, loop, "advance", {"T": 1, "R": 1}, inputs,
                          {"logits": (np.float32, prepared.spec("V"))},
                          lambda values, error: ended.append((values, error)), after=after, runs=4,
                          on_run=lambda run, values: reported.append((run, int(values["ids"][0]))))
        deadline = time.monotonic() + 60
        while not ended and time.monotonic() < deadline:
            tick(loop)
        for _ in range(5):
            tick(loop)
        loop.close()
        if fail_at is None:      # all four ran: the last through done
            assert reported == [(0, 7), (1, 7), (2, 7)] and len(ended) == 1 and ended[0][1] is None
            assert ended[0][0]["ids"][0] == 7
            continue
        assert reported == [(run, 7) for run in range(fail_at - runtime.RUNS_AHEAD + 1)]
        assert len(ended) == 1 and ended[0][0] is None
        assert str(ended[0][1]) == f"run {fail_at} could not be enqueued"
        now = device.pool.usage()
        assert now["buffers"] - now["cached_buffers"] == before["buffers"] - before["cached_buffers"]


def test_a_row_whose_client_is_gone_as_it_starts_retires_at_once(model):
    """Issue 15.1 (the soak's find): a stream that fails as it opens cancels its sequence
    from inside the cohort's forming; the row must still retire, with nothing else arriving."""
    prepared, _ = model
    loop = Loop(2)
    engine = TextEngine(prepared, loop, rows=2, pages=PAGES, page_size=PAGE)
    done = []
    gone = Sequence([5, 6, 7], max_tokens=8, ready=lambda: False, on_done=done.append)
    gone.on_start = lambda: engine.cancel(gone)     # the first send found the client reset
    engine.submit(gone)
    for _ in range(50):
        tick(loop)
        if done:
            break
    assert done == ["cancelled"] and engine.rows == [None, None]
    assert engine.pool.available == PAGES and not engine.busy
    loop.close()


def test_an_idle_row_continues_a_conversation_without_recomputing_it(model):
    """Automatic row reuse: the next turn's prompt extends the finished one exactly."""
    prepared, weights = model
    loop = Loop(2)
    engine = TextEngine(prepared, loop, rows=2, pages=PAGES, page_size=PAGE, chunk=16)
    first = Sequence([5, 17, 33, 2, 9, 60, 61, 70, 71, 3], max_tokens=6)
    engine.submit(first)
    run_all(engine, loop, [first])
    follow = first.prompt + first.generated + [40, 41, 42]
    second = Sequence(follow, max_tokens=6)
    engine.submit(second)
    run_all(engine, loop, [second])
    assert second.cached == len(first.prompt) + len(first.generated) - 1   # all but the last, never fed
    fresh = TextEngine(prepared, loop, rows=2, pages=PAGES, page_size=PAGE, chunk=16)
    again = Sequence(follow, max_tokens=6)
    fresh.submit(again)
    run_all(fresh, loop, [again])
    assert again.cached == 0 and second.generated == again.generated          # same tokens either way
    edited = Sequence([5, 17, 99] + follow[3:], max_tokens=2)                 # an edited history replays
    engine.submit(edited)
    run_all(engine, loop, [edited])
    assert edited.cached == 2
    loop.close()


def test_named_sessions_survive_other_traffic_and_are_bounded(model):
    prepared, _ = model
    loop = Loop(2)
    engine = TextEngine(prepared, loop, rows=1, pages=PAGES, page_size=PAGE, session_capacity=1)
    alice = Sequence([5, 6, 7, 8, 9], max_tokens=4, session="alice")
    engine.submit(alice)
    run_all(engine, loop, [alice])
    other = Sequence([1, 2, 3], max_tokens=3)          # takes the only row meanwhile
    engine.submit(other)
    run_all(engine, loop, [other])
    again = Sequence(alice.prompt + alice.generated + [11], max_tokens=2, session="alice")
    engine.submit(again)
    run_all(engine, loop, [again])
    assert again.cached == len(alice.prompt) + len(alice.generated) - 1
    # A session is no candidate for automatic reuse, and an edited history replays.
    plain = Sequence(again.prompt + again.generated, max_tokens=1)
    engine.submit(plain)
    run_all(engine, loop, [plain])
    assert plain.cached == 0
    edited = Sequence([5, 6, 99], max_tokens=1, session="alice")
    engine.submit(edited)
    run_all(engine, loop, [edited])
    assert edited.cached == 2                            # the common prefix only
    # rows + session_capacity = 2 named histories at most: the oldest goes.
    for name in ("bob", "carol"):
        s = Sequence([7, 7, 7], max_tokens=1, session=name)
        engine.submit(s)
        run_all(engine, loop, [s])
    assert list(engine.sessions) == ["bob", "carol"]
    engine.release_idle()
    assert engine.pool.available == PAGES and not engine.sessions
    loop.close()


def test_prefix_cache_shares_prompt_prefixes_without_corrupting_them(model):
    prepared, _ = model
    loop = Loop(2)
    rng = np.random.default_rng(9)
    system = list(rng.integers(0, V, 70))                  # a shared 64-token boundary, and then some
    engine = TextEngine(prepared, loop, rows=2, pages=PAGES, page_size=PAGE, chunk=64, prefix_capacity=2)
    first = Sequence(system + [1, 2, 3], max_tokens=4)
    engine.submit(first)
    run_all(engine, loop, [first])
    assert tuple(system[:64]) in engine.prefixes           # the natural boundary was kept
    # Rows are busy with other prompts, so only the prefix cache can help the next one.
    fillers = [Sequence([90 + i] * 5, max_tokens=2) for i in range(2)]
    for s in fillers:
        engine.submit(s)
    run_all(engine, loop, fillers)
    second = Sequence(system + [4, 5, 6, 7], max_tokens=4)
    engine.submit(second)
    run_all(engine, loop, [second])
    assert second.cached == 64
    fresh = TextEngine(prepared, loop, rows=2, pages=PAGES, page_size=PAGE, chunk=64)
    alone = Sequence(system + [4, 5, 6, 7], max_tokens=4)
    fresh.submit(alone)
    run_all(fresh, loop, [alone])
    assert second.generated == alone.generated              # the shared pages held exact state
    # A row continuing its own history inside a shared page must not write into it.
    third = Sequence(system[:40] + [8, 8], max_tokens=3)
    engine.submit(third)
    run_all(engine, loop, [third])
    fourth = Sequence(system + [4, 5, 6, 7], max_tokens=4)
    engine.submit(fourth)
    run_all(engine, loop, [fourth])
    assert fourth.generated == alone.generated
    engine.release_idle()
    assert engine.pool.available == PAGES and not engine.prefixes
    loop.close()


def test_a_full_cache_keeps_its_first_ancestor_and_the_end_boundary_never_evicts(model):
    prepared, _ = model
    loop = Loop(2)
    engine = TextEngine(prepared, loop, rows=1, pages=PAGES, page_size=PAGE, chunk=32, prefix_capacity=1)
    long = Sequence(list(range(1, 100)), max_tokens=1)      # boundaries at 32, 64 and 96
    engine.submit(long)
    run_all(engine, loop, [long])
    assert list(engine.prefixes) == [tuple(range(1, 33))]   # later boundaries did not replace the ancestor
    other = Sequence(list(range(50, 90)), max_tokens=1)     # a new branch: its natural boundary may reclaim
    engine.submit(other)
    run_all(engine, loop, [other])
    assert list(engine.prefixes) == [tuple(range(50, 82))]
    loop.close()


def test_closing_the_loop_cancels_queued_work_quietly(caplog):
    """Shutdown cancels executor work not yet started: no callback errors, no tracebacks."""
    import threading
    loop = Loop(1)
    started = threading.Event()
    loop.run_in_executor(lambda: (started.set(), time.sleep(0.2)), lambda result, error: None)
    for _ in range(8):
        loop.run_in_executor(lambda: None, lambda result, error: None)
    started.wait(5)
    with caplog.at_level("ERROR"):
        loop.close()
        time.sleep(0.3)
    assert [r for r in caplog.records if r.levelname == "ERROR"] == []


def test_one_source_policy_borrower_per_model_in_arrival_order():
    """Template rendering and counting share one borrower per model: each waits for the
    one before it to retire, on the CPU executor (two workers, yet never two at once)."""
    import collections
    import threading
    from loom.text import ChatEngine

    class Policy:
        borrow_policy, _next_borrower = ChatEngine.borrow_policy, ChatEngine._next_borrower

        def __init__(self, loop):
            self.loop, self.policy_waiting, self.policy_busy = loop, collections.deque(), False

    loop = Loop(2)
    engine = Policy(loop)
    active, peak, order, done = [0], [0], [], []
    lock = threading.Lock()

    def work(i):
        def run():
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            assert threading.current_thread() is not threading.main_thread()
            time.sleep(0.02)
            with lock:
                active[0] -= 1
            order.append(i)
            return i
        return run

    for i in range(5):
        engine.borrow_policy(work(i), lambda result, error: done.append((result, error)))
    deadline = time.monotonic() + 10
    while len(done) < 5 and time.monotonic() < deadline:
        loop.run_once()
    loop.close()
    assert done == [(i, None) for i in range(5)] and order == list(range(5)) and peak[0] == 1
