"""Cohort engines: every kind's device steps, one in flight per deployment.

CohortEngine is the shape they share: work arrives on the loop thread, a cohort
forms from what waits when no step runs, its results are applied on the loop,
and late arrivals join the next cohort. BatchEngine batches whole requests
(embeddings, decisions); TextEngine batches rows continuously (text, sequences).
CPU work (tokenizing) happens on the executor before a request joins.

One TextEngine per prepared text deployment. A sequence (a prompt plus its
sampling parameters) takes an execution row and pages from the deployment's
KV pool. Each step forms one cohort: decode tokens of running rows plus
prefill chunks of new prompts (at most `chunk` tokens of one prompt per step,
so a long prompt never stalls decoding rows for more than one chunk), within
a token budget. The package's `advance` command runs the cohort, the library
sampler (opencl/sample.cl) picks each row's next token on the device, and
only the token ids come back. One step is in flight at a time: each step's
keys and values are the next step's context. A cohort of decode rows only,
with nothing waiting, runs several tokens ahead on the device (DECODE_RUNS
runs of the step, each fed the ids the one before sampled, never leaving the
device): the host's part of a step -- results back on the loop, tokens
streamed, the next launch -- is paid once per cohort instead of once per token,
with the same tokens.

A row whose consumer is not ready (a slow reader) sits out until it is; a
cancelled sequence leaves at the next step boundary and its pages go back to
the pool once the step that used them has retired.

Retained state (PROFILES.md "Retained conversations", "Named checkpoints"):
idle rows keep their conversation for automatic reuse; named histories
(X-Loom-Session, and sequence handles) live outside rows with their page
references; the prefix cache shares page-aligned prompt prefixes; checkpoints
pin an immutable endpoint, which can be suspended into host memory and warmed
back into fresh pages. Every holder counts references in the page pool, and a
shared page is never written (kvcache.py).

A sequence engine (stage "encode", kind "sequence") runs known token ids
without sampling: each step's per-token output bytes go to the sequence's
on_chunk, and a finished sequence is retained under its handle.
"""

import collections
import logging

import numpy as np

from . import runtime, vm
from .errors import Problem
from .kvcache import Checkpoint, History, OutOfPages, PagedState, PagePool, RowPages

log = logging.getLogger("loom.scheduler")


CONTROL_QUEUE = 32      # checkpoint controls waiting for a deployment's control slot
# Decode tokens a cohort of decode rows may run on the device in one step: the host's
# ~0.6 ms between steps (results to the loop, the next launch: bench/text.py's serving
# overhead) is paid once per DECODE_RUNS tokens. Tokens stream as each run completes,
# and the chain ends early, a run or two on, once a request waits, a row stops or is
# cancelled, or a control wants the step boundary (_more).
DECODE_RUNS = 16


class Refused(Problem):
    """A retained-state control the engine cannot do; its code says why (errors.STATUS)."""


class Sequence:
    """One generation: prompt in, tokens out through callbacks on the loop thread."""

    def __init__(self, prompt, max_tokens=0, temperature=0.0, top_p=1.0, top_k=0, seed=0, stop_ids=(),
                 on_token=None, on_done=None, ready=None, session=None, checkpoint=None, resume=None,
                 on_chunk=None, on_start=None, first_output=0, media=None):
        self.prompt = list(prompt)
        self.media = media        # vision.Media: the prompt's image positions and their features
        self.session = session    # a named history to continue (X-Loom-Session), best effort
        self.checkpoint = checkpoint   # a Checkpoint to start from exactly (X-Loom-Checkpoint)
        self.resume = resume      # a sequence handle's History, claimed at submit: continued exactly
        self.on_chunk = on_chunk or (lambda position, ids, data: None)   # sequences: output bytes per step
        self.first_output = first_output   # sequences: positions before it (replayed history) emit nothing
        self.on_start = on_start or (lambda: None)   # it has a row: its response can begin
        self.max_tokens = max_tokens
        self.params = (float(temperature), float(top_p), float(top_k), 0.0)
        self.seed = int(seed) & 0xFFFFFFFF ^ (int(seed) >> 32) & 0xFFFFFFFF
        self.stop_ids = set(stop_ids)
        self.on_token = on_token or (lambda token: None)
        self.on_done = on_done or (lambda reason: None)
        self.ready = ready or (lambda: True)     # False: the consumer is backed up; sit out
        self.row = None
        self.fed = 0              # prompt tokens already in the KV cache
        self.cached = 0           # of those, reused from an idle row's retained conversation
        self.generated = []
        self.pending = None       # the sampled token not yet fed back
        self.finish_reason = None
        self.error = None
        self.cancelled = False
        self.cancel_reason = "cancelled"    # "stop": ended by its owner as a stop token would end it


class CohortEngine:
    """One device step in flight per deployment: work that arrives while a step runs
    joins the next cohort. A subclass says how a cohort forms from what waits
    (form -> cohort or None), how it runs (launch(cohort, done(values, error))) and
    what its results do (apply). Results are applied on the loop thread, and
    whatever a consumer's callback does, the engine goes on to the next step."""

    def __init__(self, prepared, loop):
        self.prepared, self.loop = prepared, loop
        self.busy = False
        self.again = False       # kicked while busy: form once more before idling
        self.step_timeout = None     # seconds a queued device step may take (the document's step_timeout)
        self.on_failed = None        # fn(message), once a step has passed it: the registry fails the deployment
        self.failed = None           # that message: nothing forms any more
        self.cohort = None           # the cohort in flight
        self.deadline = None
        self.running = None      # the native variant the step in flight runs (a consumer of it)
        self.runs = 1            # device runs of the step in flight (its deadline scales with them)
        self.boundary = []       # callbacks waiting for no step to be in flight
        self.steps = 0           # cohorts run
        self.requests = 0        # requests that took part in them (a text row counts once per step)

    def kick(self):
        if not self.busy:
            self.busy = True
            self.loop.call_soon(self._tick)    # same-tick arrivals join this cohort
        else:
            self.again = True   # a kick while a cohort forms (a callback inside form) looks again

    def at_boundary(self, fn):
        """fn() once no step is in flight: now, or as soon as the running step has
        retired and before the next one forms (a variant switch happens here)."""
        if self.running is None:
            fn()
        else:
            self.boundary.append(fn)

    def _tick(self):
        self.again = False
        if self.failed:
            self.busy = False
            return
        cohort = self.form()
        if cohort is None:
            self.busy = False
            if self.again:
                # Forming ran callbacks that changed what can run (a row's client found gone
                # as its stream opened: that row must retire now, not at some later arrival).
                self.kick()
            return
        self.steps += 1
        # A step's plan is made from the variant selected now; it counts as that
        # variant's consumer until it retires, so the variant cannot be removed under it.
        self.running = self.prepared.variants.get(self.prepared.selected) or True
        if self.running is not True:
            self.running.users += 1
        self.cohort = cohort
        self.launch(cohort, lambda values, error: self._retired(cohort, values, error))

    def submitted(self):
        """The step in flight is on the device (run_stage's on_submit): its deadline starts."""
        if self.step_timeout and self.cohort is not None:
            self.deadline = self.loop.call_later(self.step_timeout * self.runs, self._expired, self.cohort)

    def _expired(self, cohort):
        """A device step that never retires (a kernel stuck at this geometry): every request
        the engine holds ends with 503 step_timeout, and the deployment fails; the loop,
        other deployments' admission and the server go on."""
        if cohort is not self.cohort or self.failed:
            return
        self.failed = (f"a device step of {self.prepared.name} did not finish within {self.step_timeout:g} s "
                       "(step_timeout): a kernel is stuck at this geometry; the device may need a restart")
        log.error("%s", self.failed, extra={"event": "step_timeout", "model": self.prepared.name})
        self.abandon(cohort, Problem(self.failed, "step_timeout"))
        if self.on_failed is not None:
            self.on_failed(self.failed)

    def abandon(self, cohort, error):
        """End every request this engine holds with `error` (its step will never retire)."""
        self.apply(cohort, None, error)

    def _retired(self, cohort, values, error):
        if self.deadline is not None:
            self.loop.cancel_timer(self.deadline)
            self.deadline = None
        self.cohort = None
        if self.failed:
            return      # answered when its deadline passed; what it held is released by run_stage
        try:
            self.apply(cohort, values, error)
        finally:
            if self.running is not True:
                self.running.users -= 1
            self.running = None
            waiting, self.boundary = self.boundary, []
            for fn in waiting:
                self.loop.call_soon(fn)     # queued ahead of the next step's forming
            self.busy = False
            self.kick()

    def form(self):
        raise NotImplementedError

    def launch(self, cohort, done):
        raise NotImplementedError

    def apply(self, cohort, values, error):
        raise NotImplementedError

    def stats(self):
        return {"cohorts": self.steps, "requests": self.requests}

    def backlog(self):
        """Requests accepted but not yet running: what pending_capacity bounds."""
        return 0

    def release_idle(self):
        """Drop reclaimable retained state (trim); an engine without any holds none."""

    def retained(self):
        """Retained-state counters for /metrics, or None for an engine that retains nothing."""
        return None


class BatchEngine(CohortEngine):
    """Whole requests batched into cohorts (embeddings, decisions). A request is a job
    with `tokens`, `inputs`, a `key` that every job of one cohort shares, `gone`, and
    finish(); the kind's `batch` object turns jobs into a stage call
    (stage(jobs) -> command, geometry, inputs, outputs) and hands each job its part
    of the results (deliver(jobs, values, error)). A cohort closes at `max_tokens`
    tokens or `max_inputs` inputs; a larger request runs as a cohort of its own."""

    def __init__(self, prepared, loop, batch, max_tokens, max_inputs):
        super().__init__(prepared, loop)
        self.batch = batch
        self.max_tokens, self.max_inputs = max_tokens, max_inputs
        self.queue = collections.deque()

    def submit(self, job):
        self.queue.append(job)
        if self.failed:
            self.abandon([], Problem(self.failed, "step_timeout"))   # it arrived after the failure
            return
        self.kick()

    def stats(self):
        return dict(super().stats(), waiting=len(self.queue))

    def backlog(self):
        return len(self.queue)

    def form(self):
        jobs, tokens, inputs = [], 0, 0
        while self.queue:
            job = self.queue[0]
            if job.gone:
                self.queue.popleft().finish()   # left before its cohort: nothing was computed
                continue
            if jobs and (tokens + job.tokens > self.max_tokens or inputs + job.inputs > self.max_inputs
                         or job.key != jobs[0].key):
                break
            jobs.append(self.queue.popleft())
            tokens += job.tokens
            inputs += job.inputs
        if not jobs:
            return None
        self.requests += len(jobs)
        for job in jobs:
            job.request.state = "running"
        return jobs

    def launch(self, jobs, done):
        command, geometry, inputs, outputs = self.batch.stage(jobs)
        runtime.run_stage(self.prepared, self.loop, command, geometry, inputs, outputs, done,
                          on_submit=self.submitted)

    def abandon(self, jobs, error):
        super().abandon(jobs, error)
        while self.queue:
            self.queue.popleft().finish(error=error)

    def apply(self, jobs, values, error):
        self.batch.deliver(jobs, values, error)


class TextEngine(CohortEngine):
    def __init__(self, prepared, loop, rows, pages, page_size, chunk=64, token_budget=256, session_capacity=0,
                 prefix_capacity=0, checkpoint_capacity=0, elastic=False, stage="advance"):
        super().__init__(prepared, loop)
        self.stage = stage                   # "advance" (text) or "encode" (known-token sequences)
        self.max_pages = prepared.spec("MAX_PAGES")
        self.pool = PagePool(pages, page_size)
        self.paged = PagedState(prepared.device, _paged_buffers(prepared, pages))
        self.rows = [None] * rows            # the Sequence in each row
        self.tables = [RowPages(self.pool, self.max_pages, self.paged.copy) for _ in range(rows)]
        self.history = [None] * rows         # idle rows: the tokens whose KV they still hold
        self.idle_since = [0] * rows
        # Named histories: name -> (tokens, pages). They hold page references outside any
        # row, so they survive row reuse; rows + session_capacity of them are kept (LRU).
        self.sessions = collections.OrderedDict()
        self.session_limit = rows + session_capacity
        # Prefix cache: exact prompt prefixes at page-aligned prefill boundaries -> their pages
        # (shared references: rows extend them into private pages, never write them).
        self.prefixes = collections.OrderedDict()
        self.prefix_capacity = prefix_capacity
        # Checkpoints: name -> Checkpoint, pinned until deleted (never reclaimed).
        self.checkpoints = {}
        self.checkpoint_capacity = checkpoint_capacity
        self.claimed = set()                 # sequence handles taken by an append not yet finished
        self.control_waiting = collections.deque()   # checkpoint controls waiting for the slot
        self.control_busy = False
        self.elastic = elastic               # checkpoints may be suspended into host memory
        self.waiting = collections.deque()
        self.chunk = chunk
        self.token_budget = token_budget
        self.projection = None               # a ProjectionEngine when the deployment takes images (text.py)
        if stage == "advance":
            self.vocab = prepared.spec("V")
            self.sampler = prepared.compiler.compile(prepared.compiler.library_source("sample"), {"V": self.vocab},
                                                     name="sample")
            # One kernel object for every step: making one per step also made pyopencl look its
            # argument invoker up in an on-disk cache each time. Only the submission thread uses it.
            self.sample_kernel = prepared.device.kernel(self.sampler.program, "sample")
        else:
            self.out_bytes = prepared.spec("SEQUENCE_BYTES")

    # -- requests ---------------------------------------------------------------
    def submit(self, seq):
        if not seq.prompt:
            raise ValueError("an empty prompt")
        self.waiting.append(seq)
        if self.failed:
            self.abandon([], Problem(self.failed, "step_timeout"))   # it arrived after the failure
            return
        self.kick()

    def cancel(self, seq):
        """Stop a sequence: at once if it waits for a row, else at the next step
        boundary, once the step using its pages has retired."""
        if seq.cancelled or seq.finish_reason is not None:
            return
        seq.cancelled = True
        if seq in self.waiting:
            self.waiting.remove(seq)
            self._unborrow(seq)
            if seq.resume is not None:
                self.pool.release(seq.resume.pages)   # a cancelled append invalidates its handle
                seq.resume = None
            self.claimed.discard(seq.session)
            seq.finish_reason = "cancelled"
            seq.on_done("cancelled")
        self.kick()

    def stop(self, seq):
        """End a running sequence at the next step boundary as though it had generated a
        stop token (its owner found a stop string): a session keeps its history."""
        if seq.cancelled or seq.finish_reason is not None or seq.row is None:
            return
        seq.cancelled, seq.cancel_reason = True, "stop"
        self.kick()

    def _unborrow(self, seq):
        if seq.checkpoint is not None:
            self.unborrow(seq.checkpoint)
            seq.checkpoint = None

    def stats(self):
        """For /v1/status: what the rows and the KV pool hold right now."""
        return {**super().stats(), "rows": len(self.rows), "active": sum(r is not None for r in self.rows),
                "waiting": len(self.waiting),
                "idle_conversations": sum(1 for r, h in enumerate(self.history) if self.rows[r] is None and h),
                "sessions": len(self.sessions), "prefixes": len(self.prefixes),
                "checkpoints": len(self.checkpoints),
                "suspended_checkpoints": sum(c.host is not None for c in self.checkpoints.values()),
                "host_snapshot_bytes": sum(c.host_bytes for c in self.checkpoints.values()),
                "pages": {"total": self.pool.pages, "free": self.pool.available, "page_size": self.pool.page_size},
                "steps": self.steps}

    def retained(self):
        return self.stats()

    def backlog(self):
        return len(self.waiting)

    def abandon(self, work, error):
        for row, seq in enumerate(self.rows):
            if seq is not None:
                seq.error = error
                self._retire(row, "error")
        while self.waiting:
            seq = self.waiting.popleft()
            self._unborrow(seq)
            seq.error, seq.finish_reason = error, "error"
            seq.on_done("error")

    def take_control(self, fn):
        """The deployment's one retained-state control slot: pin, suspend and delete run
        one at a time, in arrival order. fn(release) runs when the slot is free and calls
        release() when its control is done. Refused (control_queue_full) past
        CONTROL_QUEUE waiting controls."""
        if len(self.control_waiting) >= CONTROL_QUEUE:
            raise Refused(f"{CONTROL_QUEUE} checkpoint controls are already waiting", "control_queue_full")
        self.control_waiting.append(fn)
        self._next_control()

    def _next_control(self):
        if self.control_busy or not self.control_waiting:
            return
        fn = self.control_waiting.popleft()
        self.control_busy = True
        released = []

        def release():
            if not released:
                released.append(True)
                self.control_busy = False
                self.loop.call_soon(self._next_control)

        try:
            fn(release)
        except BaseException:
            release()
            raise

    def wake(self):
        """A consumer that was not ready is ready again (its output drained)."""
        self.kick()

    # -- steps ------------------------------------------------------------------
    def _retire(self, row, reason):
        seq = self.rows[row]
        self.rows[row] = None
        if seq.media is not None:
            seq.media.release()
        self.claimed.discard(seq.session)
        table = self.tables[row]
        if reason in ("stop", "length") and seq.session is not None:
            # A named history (or sequence handle) leaves the row with its pages: it is no
            # candidate for automatic reuse, and it outlives the row's next occupant.
            full = seq.prompt + seq.generated
            pending = full[table.length] if len(full) > table.length else None
            self.retain(seq.session, History(full[:table.length], table.pages, pending))
            table.pages, table.length = [], 0
        elif reason in ("stop", "length"):
            # The row stays idle with its conversation's keys and values: an untagged
            # request that continues it exactly reuses them (automatic row reuse).
            self.history[row] = (seq.prompt + seq.generated)[:table.length]
            self.idle_since[row] = self.steps
        else:
            table.clear()
        seq.finish_reason = reason
        seq.row = None
        seq.on_done(reason)   # "cancelled" too: its owner releases what it holds

    def _free_row(self):
        free = [r for r in range(len(self.rows)) if self.rows[r] is None]
        return min(free, key=lambda r: (bool(self.history[r]), self.idle_since[r]))

    def _admit(self):
        """Give waiting sequences rows. A checkpoint or a sequence handle starts the row
        from exactly its pages; a named session continues its history if the prompt
        extends it; otherwise the idle row holding the longest exact prefix of the
        prompt (its positions are not computed again), else an empty row, else the
        least recently used idle row."""
        while self.waiting and None in self.rows:
            seq = self.waiting.popleft()
            if seq.checkpoint is not None or seq.resume is not None:
                self._start_exact(seq)
                continue
            best, best_len = None, 0
            if seq.session is not None:
                if self._continue_session(seq):
                    continue
            else:
                for row, history in enumerate(self.history):
                    if self.rows[row] is None and history:
                        n = _common_prefix(history, seq.prompt)
                        if n > best_len:
                            best, best_len = row, n
            if best is None:
                best, best_len = self._free_row(), 0
            # At least the prompt's last token is computed again: its logits start generation.
            reuse = min(best_len, len(seq.prompt) - 1)
            table = self.tables[best]
            prefix, pages = self._longest_prefix(seq.prompt)
            if len(prefix) > reuse:
                # A cached prefix beats the row's own history: start from its pages.
                table.clear()
                self.pool.share(pages)
                table.pages, table.length = list(pages), len(prefix)
                self.prefixes.move_to_end(prefix)
                reuse = len(prefix)
            elif reuse == 0:
                table.clear()
            else:
                reuse = table.truncate(reuse)
            self._place(seq, best, reuse)

    def reusable(self, prompt, session=None, checkpoint=None):
        """How many leading tokens of prompt retained state could supply now, changing
        nothing: a checkpoint's, a named session's, else the best idle row's or cached
        prefix's (admission decides later and may find less)."""
        if checkpoint is not None:
            return _common_prefix(checkpoint.tokens, prompt)
        if session is not None:
            saved = self.sessions.get(session)
            return min(_common_prefix(saved.tokens, prompt), len(prompt) - 1) if saved is not None else 0
        best = max((_common_prefix(history, prompt) for row, history in enumerate(self.history)
                    if self.rows[row] is None and history), default=0)
        return min(max(best, len(self._longest_prefix(prompt)[0])), len(prompt) - 1)

    def _place(self, seq, row, reuse):
        self.history[row] = None
        seq.fed = seq.cached = reuse
        seq.row = row
        self.rows[row] = seq
        seq.on_start()

    def _start_exact(self, seq):
        """Start from a checkpoint (fork or rewind) or a sequence handle's retained pages.
        A suspended checkpoint is warmed back into fresh pages first; if the pool cannot
        hold it the request is refused and the destination session keeps its state."""
        cp = seq.checkpoint
        source = seq.resume
        if cp is not None:
            if cp.pages is None and not self._warm(cp, keep=seq.session):
                self._unborrow(seq)
                seq.finish_reason = "refused"
                seq.on_done("refused")
                return
            source = cp
            self.pool.share(cp.pages)
            self._unborrow(seq)
            if seq.session is not None and seq.session in self.sessions:
                self._drop_session(seq.session)   # the same session rewinds; another one forks
        seq.resume = None
        row = self._free_row()
        table = self.tables[row]
        table.clear()
        table.pages, table.length = list(source.pages), len(source.tokens)
        # Text computes the prompt's last token again for its logits; sequences feed only new ids.
        keep = len(source.tokens) if self.stage == "encode" else min(len(source.tokens), len(seq.prompt) - 1)
        self._place(seq, row, table.truncate(keep))

    def _warm(self, cp, keep=None):
        """Bring a suspended checkpoint back into new pages (reclaiming idle caches, but
        not the destination session `keep`); False if the pool cannot hold it."""
        n = len(cp.host[0]) if cp.host else 0
        while self.pool.available < n and self._reclaim(keep):
            pass
        if self.pool.available < n:
            return False
        pages = self.pool.alloc(n)
        self.paged.restore(cp.host, pages)
        cp.pages, cp.host = pages, None
        return True

    def _continue_session(self, seq):
        """Put a named history back in a row if the prompt extends it; 0 if it cannot
        (absent, evicted, in use, or edited): then the caller replays the full history."""
        saved = self.sessions.get(seq.session)
        if saved is None:
            return 0
        reuse = min(_common_prefix(saved.tokens, seq.prompt), len(seq.prompt) - 1)
        if reuse == 0:
            return 0
        row = self._free_row()
        table = self.tables[row]
        table.clear()
        del self.sessions[seq.session]
        table.pages, table.length = saved.pages, len(saved.tokens)   # the row takes over the references
        self._place(seq, row, table.truncate(reuse))
        seq.cached = seq.fed
        return max(seq.fed, 1)

    # -- retained state: sessions, handles and checkpoints -------------------------
    def busy_session(self, name):
        """A running or queued request continues this named history or handle."""
        return name in self.claimed or any(s is not None and s.session == name for s in self.rows) or \
            any(s.session == name for s in self.waiting)

    def claim(self, handle, position):
        """A sequence append: take handle's retained history out of the cache so nothing
        evicts it while the append waits. -> History; Refused if absent (evicted,
        invalidated: session_not_found), or if busy or `position` is not its completed
        position (sequence_conflict)."""
        if self.busy_session(handle):
            raise Refused(f"sequence {handle} is in use by another request", "sequence_conflict", "position")
        saved = self.sessions.get(handle)
        if saved is None:
            raise Refused(f"sequence {handle} does not exist (evicted, unregistered or invalidated)",
                          "session_not_found", "session")
        if position != len(saved.tokens):
            raise Refused(f"position {position} is stale: sequence {handle} has completed "
                          f"{len(saved.tokens)} tokens", "sequence_conflict", "position")
        self.claimed.add(handle)
        return self.sessions.pop(handle)

    def unclaim(self, handle, history):
        """An append that never reached a row gives its handle back, unchanged."""
        self.claimed.discard(handle)
        self.retain(handle, history)

    def retain(self, name, history):
        self._drop_session(name)
        self.sessions[name] = history
        while len(self.sessions) > self.session_limit:
            self._drop_session(next(iter(self.sessions)))

    def borrow(self, name):
        """A request will start from checkpoint `name`: it cannot be deleted meanwhile."""
        cp = self.checkpoints.get(name)
        if cp is None:
            raise Refused(f"no checkpoint {name!r}", "checkpoint_not_found")
        cp.borrowers += 1
        return cp

    def unborrow(self, cp):
        cp.borrowers -= 1

    def pin(self, name, session):
        """Pin an idle completed session (or sequence handle) as checkpoint `name`.
        Raises Refused(404 | 409 | 503)."""
        if name in self.checkpoints:
            raise Refused(f"checkpoint {name!r} already exists", "checkpoint_exists")
        if self.busy_session(session):
            raise Refused(f"session {session!r} is busy", "session_busy")
        saved = self.sessions.get(session)
        if saved is None:
            raise Refused(f"no retained session {session!r}", "session_not_found")
        if len(self.checkpoints) >= self.checkpoint_capacity:
            raise Refused(f"all {self.checkpoint_capacity} checkpoints are pinned", "checkpoint_capacity")
        self.pool.share(saved.pages)
        cp = self.checkpoints[name] = Checkpoint(name, saved)
        return cp

    def suspend(self, name, done):
        """Park a checkpoint in host memory: its pages are read back (on a worker) and
        released; done(checkpoint, error) on the loop. Live branches keep their pages."""
        cp = self.checkpoints.get(name)
        if cp is None:
            raise Refused(f"no checkpoint {name!r}", "checkpoint_not_found")
        if not self.elastic:
            raise Refused("this deployment's checkpoints have fixed backing; they cannot be suspended",
                          "fixed_backing")
        if cp.host is not None:
            done(cp, None)
            return
        if cp.suspending is not None:
            cp.suspending.append(done)
            return
        cp.suspending = [done]
        arrays, wait = self.paged.snapshot(cp.pages)

        def read(_, error):
            waiters, cp.suspending = cp.suspending, None
            if error is None and self.checkpoints.get(name) is cp:
                self.pool.release(cp.pages)
                cp.pages, cp.host = None, arrays
            elif error is None:
                error = Refused(f"checkpoint {name!r} was deleted while suspending", "checkpoint_not_found")
            for fn in waiters:
                fn(cp, error)

        self.loop.run_in_executor(wait, read)

    def delete(self, name):
        cp = self.checkpoints.get(name)
        if cp is None:
            raise Refused(f"no checkpoint {name!r}", "checkpoint_not_found")
        if cp.borrowers:
            raise Refused(f"checkpoint {name!r} has {cp.borrowers} queued requests starting from it",
                          "checkpoint_borrowed")
        del self.checkpoints[name]
        if cp.pages is not None:
            self.pool.release(cp.pages)   # a snapshot in progress reads before any later write
            cp.pages = None
        cp.host = None

    def _longest_prefix(self, prompt):
        """The longest cached prefix of prompt (leaving its last token to compute)."""
        best, pages = (), []
        for prefix, entry in self.prefixes.items():
            if len(best) < len(prefix) < len(prompt) and tuple(prompt[:len(prefix)]) == prefix:
                best, pages = prefix, entry
        return best, pages

    def _capture(self, seq, row):
        """After a prefill step: remember page-aligned prefixes of the prompt.

        A chunk boundary is a natural boundary and may displace the least recently
        used entry, unless the cache already holds an ancestor of this prompt (a full
        cache keeps its first matching ancestor). The last page boundary before the
        prompt's end is kept only in a free slot: it never evicts another prefix."""
        if not self.prefix_capacity or seq.session is not None:
            return
        size = self.pool.page_size
        table = self.tables[row]
        natural = seq.fed % self.chunk == 0 and seq.fed < len(seq.prompt)
        boundary = seq.fed if natural else (min(seq.fed, len(seq.prompt) - 1) // size) * size
        if boundary < size or boundary % size:
            return
        prefix = tuple(seq.prompt[:boundary])
        if prefix in self.prefixes:
            self.prefixes.move_to_end(prefix)
            return
        if len(self.prefixes) >= self.prefix_capacity:
            ancestor = any(prefix[:len(p)] == p for p in self.prefixes)
            if not natural or ancestor:
                return
            self.pool.release(self.prefixes.popitem(last=False)[1])
        pages = table.pages[:boundary // size]
        self.pool.share(pages)
        self.prefixes[prefix] = pages

    def _drop_session(self, name):
        saved = self.sessions.pop(name, None)
        if saved is not None:
            self.pool.release(saved.pages)

    def release_idle(self):
        """Drop every idle row's retained conversation and every named history (trim)."""
        while self._reclaim():
            pass

    def _reclaim(self, keep=None):
        """Free the least recently used idle row's pages, else the least recently used
        named history's (other than `keep`), else a prefix; False when nothing is left."""
        idle = [r for r in range(len(self.rows)) if self.rows[r] is None and self.history[r]]
        if not idle:
            victim = next((name for name in self.sessions if name != keep), None)
            if victim is not None:
                self._drop_session(victim)
                return True
            if self.prefixes:
                self.pool.release(self.prefixes.popitem(last=False)[1])
                return True
            return False
        row = min(idle, key=lambda r: self.idle_since[r])
        self.tables[row].clear()
        self.history[row] = None
        return True

    def form(self):
        """This step's work: (row, ids) pairs -- decode tokens of running rows plus
        prefill chunks, within the token budget -- or None when nothing can run."""
        for row, seq in enumerate(self.rows):
            if seq is not None and seq.cancelled:
                self._retire(row, seq.cancel_reason)
        self._admit()
        work, budget, media = [], self.token_budget, None
        for row, seq in enumerate(self.rows):
            if seq is None or budget <= 0 or seq.cancelled:
                continue                              # (a row cancelled while forming retires next)
            if seq.fed < len(seq.prompt) and (self.stage == "advance" or seq.ready()):
                ids = seq.prompt[seq.fed:seq.fed + min(self.chunk, budget)]
                if seq.media is not None and seq.media.positions and seq.media.positions[-1] >= seq.fed:
                    if seq.media.error is not None:
                        seq.error = seq.media.error
                        self._retire(row, "error")
                        continue
                    if seq.media.features is None:    # its images are projected first (once, its own cohort)
                        seq.media.project(self.projection, self.kick)
                        continue
                    if seq.media.within(seq.fed, len(ids)):
                        if media is not None:
                            continue                  # one request's image rows per step
                        media = seq
            elif self.stage == "encode":
                continue                              # sequences: a slow reader's row sits out
            elif seq.pending is not None and seq.ready():
                ids = [seq.pending]
            else:
                continue
            table = self.tables[row]
            while True:
                try:
                    table.reserve(table.length + len(ids))
                    break
                except OutOfPages:
                    if table.length + len(ids) > self.max_pages * self.pool.page_size:
                        self._retire(row, "length")   # the context is full
                        break
                    if not self._reclaim():           # idle conversations yield their pages first
                        break
            if self.rows[row] is None or table.length + len(ids) > len(table.pages) * self.pool.page_size:
                continue                              # the pool is full: wait for pages to free
            work.append((row, ids))
            budget -= len(ids)
        self.requests += len(work)
        return work or None

    def launch(self, work, done):
        if self.stage == "encode":
            self._launch_encode(work, done)
            return
        runs = self._decode_runs(work)      # (first: it may reserve pages the tables below hold)
        tokens, pos, row_of, last = [], [], [], []
        for row, ids in work:
            start = self.tables[row].length
            tokens += ids
            pos += range(start, start + len(ids))
            row_of += [row] * len(ids)
            last.append(len(tokens) - 1)
        # The step's rows, in order, are the cohort rows 0..R-1 of this launch.
        cohort_rows = [row for row, _ in work]
        remap = {row: i for i, row in enumerate(cohort_rows)}
        tables = np.stack([self.tables[row].table() for row in cohort_rows])
        params = np.array([self.rows[row].params for row in cohort_rows], np.float32)
        seeds = np.array([[self.rows[row].seed, len(self.rows[row].generated)] for row in cohort_rows], np.uint32)
        inputs = {"tokens": np.array(tokens, np.int32), "pos": np.array(pos, np.int32),
                  "row_of": np.array([remap[r] for r in row_of], np.int32), "pages": tables.ravel(),
                  "last": np.array(last, np.int32)}
        R = len(work)
        command, bound = "advance", None
        imaged = [(row, ids) for row, ids in work if self._imaged(self.rows[row], len(ids))]
        if imaged:
            # The step's image positions (one request's) take their rows of its features.
            seq = self.rows[imaged[0][0]]
            at = []
            for row, ids in work:
                start = self.rows[row].fed
                at += [seq.media.row(start + j) if row == imaged[0][0] else -1 for j in range(len(ids))]
            command, bound = "advance_media", {"features": seq.media.features.buffer}
            inputs["feature_at"] = np.array(at, np.int32)
        seqs = [self.rows[row] for row in cohort_rows]
        sample = self._sampler(R, params, seeds, inputs["pos"], runs)
        self.runs = runs
        ran = [0]           # runs retired before the last

        def ran_one(run, values):
            ran[0] = run + 1
            self._ran(work, values["ids"], run, seqs)
        runtime.run_stage(self.prepared, self.loop, command, {"T": len(tokens), "R": R}, inputs,
                          {"logits": (np.float32, R * self.vocab)},
                          lambda values, error: done(values and dict(values, run=ran[0], seqs=seqs), error),
                          after=sample, on_submit=self.submitted, bound=bound, runs=runs, on_run=ran_one,
                          more=(lambda: self._more(seqs)) if runs > 1 else None)

    def _ran(self, work, ids, run, seqs):
        """A run before a cohort's last retired: its tokens go out now (not after a step
        that expired: that cohort's rows have ended)."""
        if self.cohort is work and not self.failed:
            self._apply_ids(work, ids, run, seqs)

    def _more(self, seqs):
        """On the submission thread, before another run of a decode chain: whether nothing
        wants the step boundary (reads of loop state; one that is stale costs a run)."""
        return not (self.waiting or self.boundary or self.control_waiting or self.failed) and all(
            not seq.cancelled and seq.finish_reason is None and seq.ready() for seq in seqs)

    def _decode_runs(self, work):
        """How many runs of this step go to the device at once (DECODE_RUNS for a cohort
        of decode rows with nothing waiting and pages for the tokens ahead, else 1):
        every row has that many tokens left, so no run samples past max_tokens."""
        if self.stage != "advance" or self.waiting or DECODE_RUNS < 2:
            return 1
        runs = DECODE_RUNS
        for row, ids in work:
            seq = self.rows[row]
            if len(ids) != 1 or seq.fed < len(seq.prompt) or seq.media is not None or seq.cancelled:
                return 1
            runs = min(runs, seq.max_tokens - len(seq.generated))
        if runs < 2:
            return 1
        try:
            for row, _ in work:
                self.tables[row].reserve(self.tables[row].length + runs)
        except OutOfPages:
            return 1        # (pages reserved so far stay with their rows: their next tokens use them)
        # the page tables uploaded for the first run serve them all
        return runs

    @staticmethod
    def _imaged(seq, n):
        """Whether this step's n tokens of seq's prompt hold image positions."""
        media = seq.media
        return (media is not None and media.features is not None and seq.fed < len(seq.prompt)
                and media.within(seq.fed, n))

    def _launch_encode(self, work, done):
        """A cohort of known ids: keys and values into the rows' pages, and each token's
        output bytes (captured in a step buffer before scratch is reused) back to the host."""
        tokens, pos, row_of = [], [], []
        for i, (row, ids) in enumerate(work):
            start = self.tables[row].length
            tokens += ids
            pos += range(start, start + len(ids))
            row_of += [i] * len(ids)
        tables = np.stack([self.tables[row].table() for row, _ in work])
        inputs = {"tokens": np.array(tokens, np.int32), "pos": np.array(pos, np.int32),
                  "row_of": np.array(row_of, np.int32), "pages": tables.ravel()}
        runtime.run_stage(self.prepared, self.loop, "encode", {"T": len(tokens)}, inputs,
                          {"out": (np.uint8, len(tokens) * self.out_bytes)}, done, on_submit=self.submitted)

    def _sampler(self, R, params, seeds, pos, runs):
        """run_stage's `after`: on the submission thread, behind each run of `advance` on
        the same in-order queue, logits -> token ids on the device (seeds count the row's
        tokens, so run r samples as a step of its own would). -> (transfers, cleanup, feed):
        the next run's positions, and these ids as its tokens (cohort rows are its tokens)."""
        device = self.prepared.device
        pool = device.pool
        owner = self.prepared.name

        def sample(buffers, run):
            extra = {}

            def release():
                for buf in extra.values():
                    buf.release()

            try:
                counted = seeds + np.array([0, run], np.uint32)
                extra["params"] = pool.alloc(params.nbytes, owner, "workspace", host=params)
                extra["seeds"] = pool.alloc(counted.nbytes, owner, "workspace", host=counted)
                extra["work"] = pool.alloc(4 * R * self.vocab, owner, "workspace")
                extra["ids"] = pool.alloc(4 * R, owner, "workspace")
            except BaseException:
                release()
                raise
            kernel = self.sample_kernel
            kernel.set_args(buffers["logits"].buffer, np.int32(0), np.int32(self.vocab), extra["params"].buffer,
                            extra["seeds"].buffer, extra["work"].buffer, extra["ids"].buffer, np.int32(R))
            device.launch(kernel, (R,), (1,))   # a row per work-group: rows spread over cores
            transfer = device.download_async(extra["ids"], np.int32, R)
            feed = ({"pos": pos + (run + 1)}, {"tokens": extra["ids"]}) if run + 1 < runs else None
            return {"ids": transfer}, release, feed
        return sample

    def apply(self, work, values, error):
        if error is not None:
            log.error("step failed: %s", error, extra={"event": "step_failed", "model": self.prepared.name})
            for row, _ in work:
                if self.rows[row] is not None:
                    self.rows[row].error = error
                    self._retire(row, "error")
            return
        if self.stage == "encode":
            self._encoded(work, values["out"])
            return
        self._apply_ids(work, values["ids"], values.get("run", 0), values.get("seqs"))

    def _apply_ids(self, work, ids, run, seqs):
        """Run `run` of a cohort's step retired: its tokens, row by row. From the second
        run on, a row whose sequence left at an earlier run (stop, length) is skipped:
        what that run computed for it is past its kept length, never read."""
        for i, (row, fed) in enumerate(work):
            seq = self.rows[row]
            if run and seq is not seqs[i]:
                continue
            self.tables[row].length += len(fed)
            if seq is None:
                continue
            if seq.fed < len(seq.prompt):
                seq.fed += len(fed)
                if seq.media is not None and seq.media.features is not None and seq.fed > seq.media.positions[-1]:
                    seq.media.release()           # past its images: their rows go back
                self._capture(seq, row)
                if seq.fed < len(seq.prompt):
                    continue                      # more prompt to prefill: this logit is not a prediction
            if seq.cancelled:
                continue
            token = int(ids[i])
            seq.generated.append(token)
            seq.on_token(token)
            if token in seq.stop_ids:
                self._retire(row, "stop")
            elif len(seq.generated) >= seq.max_tokens:
                self._retire(row, "length")
            else:
                seq.pending = token

    def _encoded(self, work, out):
        offset = 0
        for row, fed in work:
            seq = self.rows[row]
            start = self.tables[row].length
            self.tables[row].length += len(fed)
            data = out[offset * self.out_bytes:(offset + len(fed)) * self.out_bytes]
            offset += len(fed)
            if seq is None:
                continue
            seq.fed += len(fed)
            skip = max(0, seq.first_output - start)   # history replayed (a shared page could not be copied)
            if not seq.cancelled and skip < len(fed):
                seq.on_chunk(start + skip, fed[skip:], data[skip * self.out_bytes:].tobytes())
            if seq.fed == len(seq.prompt) and not seq.cancelled:
                self._retire(row, "stop")


def _paged_buffers(prepared, pages):
    """(buffer, groups, page_bytes, pages) for each paged state (kvcache.PagedState)."""
    out = []
    for state in prepared.binding.states.values():
        if state.page:
            itemsize = vm.itemsize(state.dtype)
            inner = int(np.prod(state.dims[1:], dtype=np.int64)) if len(state.dims) > 1 else 1
            groups = state.dims[0] if state.dims else 1
            out.append((prepared.states[state.name].buffer, groups, state.page * inner * itemsize, pages))
    return out


def _common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def split_tokens(T, S):
    """T zero token ids as S sequences, as even as they go (a probe's batch)."""
    return [[0] * (T * (s + 1) // S - T * s // S) for s in range(S)]


def trial_pages(binding, T, R):
    """Probe inputs for a paged text stage: T positions over R rows, each row's
    tokens on its own pages of the pool, and the page tables as the kernels read them."""
    page = binding.options["page_size"]
    width = binding.specs["MAX_PAGES"]
    rows = [len(s) for s in split_tokens(T, R)]
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in rows])
    row_of = np.repeat(np.arange(R, dtype=np.int32), rows)
    tables = np.full((R, width), -1, np.int32)
    next_page = 0
    for r, n in enumerate(rows):
        used = max(1, -(-n // page))
        tables[r, :used] = np.arange(next_page, next_page + used) % max(1, binding.options["pages"])
        next_page += used
    last = np.cumsum(rows).astype(np.int32) - 1
    return {"tokens": np.zeros(T, np.int32), "pos": pos, "row_of": row_of, "pages": tables.ravel(), "last": last}


def pack(sequences):
    """Token lists -> (ids, positions within each, offsets), as batch stage commands take them."""
    ids = np.fromiter((t for seq in sequences for t in seq), np.int32)
    offsets = np.zeros(len(sequences) + 1, np.int32)
    np.cumsum([len(s) for s in sequences], out=offsets[1:])
    pos = np.concatenate([np.arange(len(s), dtype=np.int32) for s in sequences])
    return ids, pos, offsets
