"""Continuous batching for text deployments: rows, paged KV, cohorts, device sampling.

One TextEngine per prepared text deployment. A sequence (a prompt plus its
sampling parameters) takes an execution row and pages from the deployment's
KV pool. Each step forms one cohort: decode tokens of running rows plus
prefill chunks of new prompts (at most `chunk` tokens of one prompt per step,
so a long prompt never stalls decoding rows for more than one chunk), within
a token budget. The package's `advance` command runs the cohort, the library
sampler (opencl/sample.cl) picks each row's next token on the device, and
only the token ids come back. One step is in flight at a time: each step's
keys and values are the next step's context.

A row whose consumer is not ready (a slow reader) sits out until it is; a
cancelled sequence leaves at the next step boundary and its pages go back to
the pool once the step that used them has retired.
"""

import collections
import logging

import numpy as np

from . import runtime
from .kvcache import OutOfPages, PagePool, RowPages

log = logging.getLogger("loom.scheduler")


class Sequence:
    """One generation: prompt in, tokens out through callbacks on the loop thread."""

    def __init__(self, prompt, max_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=0, stop_ids=(),
                 on_token=None, on_done=None, ready=None, session=None):
        self.prompt = list(prompt)
        self.session = session    # a named history to continue (X-Loom-Session), best effort
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


class TextEngine:
    def __init__(self, prepared, loop, rows, pages, page_size, chunk=64, token_budget=256, session_capacity=0,
                 prefix_capacity=0):
        self.prepared = prepared
        self.loop = loop
        self.vocab = prepared.spec("V")
        self.max_pages = prepared.spec("MAX_PAGES")
        self.pool = PagePool(pages, page_size)
        self.rows = [None] * rows            # the Sequence in each row
        self.tables = [RowPages(self.pool, self.max_pages) for _ in range(rows)]
        self.history = [None] * rows         # idle rows: the tokens whose KV they still hold
        self.idle_since = [0] * rows
        # Named histories: name -> (tokens, pages). They hold page references outside any
        # row, so they survive row reuse; rows + session_capacity of them are kept (LRU).
        self.sessions = collections.OrderedDict()
        self.session_limit = rows + session_capacity
        self.session_users = set()           # names of sessions a running sequence continues
        # Prefix cache: exact prompt prefixes at page-aligned prefill boundaries -> their pages
        # (shared references: rows extend them into private pages, never write them).
        self.prefixes = collections.OrderedDict()
        self.prefix_capacity = prefix_capacity
        self.waiting = collections.deque()
        self.chunk = chunk
        self.token_budget = token_budget
        self.busy = False
        self.steps = 0
        self.sampler = prepared.compiler.compile(prepared.compiler.library_source("sample"), {"V": self.vocab},
                                                 name="sample")

    # -- requests ---------------------------------------------------------------
    def submit(self, seq):
        if not seq.prompt:
            raise ValueError("an empty prompt")
        self.waiting.append(seq)
        self._kick()

    def cancel(self, seq):
        """Stop a sequence: at once if it waits for a row, else at the next step
        boundary, once the step using its pages has retired."""
        if seq.cancelled or seq.finish_reason is not None:
            return
        seq.cancelled = True
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.finish_reason = "cancelled"
            seq.on_done("cancelled")
        self._kick()

    def stats(self):
        """For /v1/status: what the rows and the KV pool hold right now."""
        return {"rows": len(self.rows), "active": sum(r is not None for r in self.rows),
                "waiting": len(self.waiting),
                "idle_conversations": sum(1 for r, h in enumerate(self.history) if self.rows[r] is None and h),
                "sessions": len(self.sessions), "prefixes": len(self.prefixes),
                "pages": {"total": self.pool.pages, "free": self.pool.available, "page_size": self.pool.page_size},
                "steps": self.steps}

    def wake(self):
        """A consumer that was not ready is ready again (its output drained)."""
        self._kick()

    def _kick(self):
        if not self.busy:
            self.busy = True
            self.loop.call_soon(self._step)

    # -- steps ------------------------------------------------------------------
    def _retire(self, row, reason):
        seq = self.rows[row]
        self.rows[row] = None
        if seq.session is not None:
            self.session_users.discard(seq.session)
        if reason in ("stop", "length") and seq.session is not None and seq.session not in self.session_users:
            # A named history leaves the row with its pages: it is no candidate for
            # automatic reuse, and it outlives the row's next occupant.
            table = self.tables[row]
            self._drop_session(seq.session)
            self.sessions[seq.session] = ((seq.prompt + seq.generated)[:table.length], table.pages)
            table.pages, table.length = [], 0
            while len(self.sessions) > self.session_limit:
                self._drop_session(next(iter(self.sessions)))
        elif reason in ("stop", "length"):
            # The row stays idle with its conversation's keys and values: an untagged
            # request that continues it exactly reuses them (automatic row reuse).
            self.history[row] = (seq.prompt + seq.generated)[:self.tables[row].length]
            self.idle_since[row] = self.steps
        else:
            self.tables[row].clear()
        seq.finish_reason = reason
        seq.row = None
        seq.on_done(reason)   # "cancelled" too: its owner releases what it holds

    def _admit(self):
        """Give waiting sequences rows: the idle row holding the longest exact prefix of
        the prompt (its positions are not computed again), else an empty row, else the
        least recently used idle row."""
        while self.waiting and None in self.rows:
            seq = self.waiting.popleft()
            best, best_len = None, 0
            if seq.session is not None:
                best_len = self._continue_session(seq)
                if best_len:
                    continue
            else:
                for row, history in enumerate(self.history):
                    if self.rows[row] is None and history:
                        n = _common_prefix(history, seq.prompt)
                        if n > best_len:
                            best, best_len = row, n
            if best is None:
                free = [r for r in range(len(self.rows)) if self.rows[r] is None]
                best = min(free, key=lambda r: (bool(self.history[r]), self.idle_since[r]))
                best_len = 0
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
            self.history[best] = None
            seq.fed = seq.cached = reuse
            seq.row = best
            self.rows[best] = seq
            if seq.session is not None:
                self.session_users.add(seq.session)

    def _continue_session(self, seq):
        """Put a named history back in a row if the prompt extends it; 0 if it cannot
        (absent, evicted, in use, or edited): then the caller replays the full history."""
        saved = self.sessions.get(seq.session)
        if saved is None or seq.session in self.session_users:
            return 0
        tokens, pages = saved
        reuse = min(_common_prefix(tokens, seq.prompt), len(seq.prompt) - 1)
        if reuse == 0:
            return 0
        free = [r for r in range(len(self.rows)) if self.rows[r] is None]
        row = min(free, key=lambda r: (bool(self.history[r]), self.idle_since[r]))
        table = self.tables[row]
        table.clear()
        self.history[row] = None
        del self.sessions[seq.session]
        table.pages = pages                        # the row takes over the session's page references
        reuse = table.truncate(reuse)
        seq.fed = seq.cached = reuse
        seq.row = row
        self.rows[row] = seq
        self.session_users.add(seq.session)
        return reuse

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
            self.pool.release(saved[1])
    def release_idle(self):
        """Drop every idle row's retained conversation and every named history (trim)."""
        while self._reclaim():
            pass

    def _reclaim(self):
        """Free the least recently used idle row's pages, else the least recently used
        named history's; False when nothing is left to reclaim."""
        idle = [r for r in range(len(self.rows)) if self.rows[r] is None and self.history[r]]
        if not idle:
            if self.sessions:
                self._drop_session(next(iter(self.sessions)))
                return True
            if self.prefixes:
                self.pool.release(self.prefixes.popitem(last=False)[1])
                return True
            return False
        row = min(idle, key=lambda r: self.idle_since[r])
        self.tables[row].clear()
        self.history[row] = None
        return True

    def _step(self):
        for row, seq in enumerate(self.rows):
            if seq is not None and seq.cancelled:
                self._retire(row, "cancelled")
        self._admit()
        work, budget = [], self.token_budget
        for row, seq in enumerate(self.rows):
            if seq is None or budget <= 0:
                continue
            if seq.fed < len(seq.prompt):
                ids = seq.prompt[seq.fed:seq.fed + min(self.chunk, budget)]
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
        if not work:
            self.busy = False
            return
        self._run(work)

    def _run(self, work):
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
        self.steps += 1
        runtime.run_stage(self.prepared, self.loop, "advance", {"T": len(tokens), "R": R}, inputs,
                          {"logits": (np.float32, R * self.vocab)},
                          lambda values, error: self._stepped(work, values, error),
                          after=lambda buffers, finish: self._sample(buffers, R, params, seeds, finish))

    def _sample(self, buffers, R, params, seeds, done):
        """Runs after `advance` on the same in-order queue: logits -> token ids on the device."""
        import pyopencl as cl
        device = self.prepared.device
        pool = device.pool
        owner = self.prepared.name
        extra = {"params": pool.alloc(params.nbytes, owner, "workspace", host=params),
                 "seeds": pool.alloc(seeds.nbytes, owner, "workspace", host=seeds),
                 "work": pool.alloc(4 * R * self.vocab, owner, "workspace"),
                 "ids": pool.alloc(4 * R, owner, "workspace")}
        kernel = cl.Kernel(self.sampler.program, "sample")
        kernel.set_args(buffers["logits"].buffer, np.int32(0), np.int32(self.vocab), extra["params"].buffer,
                        extra["seeds"].buffer, extra["work"].buffer, extra["ids"].buffer, np.int32(R))
        cl.enqueue_nd_range_kernel(device.queue, kernel, (R,), None)
        transfer = device.download_async(extra["ids"], np.int32, R)

        def release(values, error):
            for buf in extra.values():
                buf.release()
            done(values, error)

        self.loop.run_in_executor(lambda: {"ids": transfer.wait()}, release)

    def _stepped(self, work, values, error):
        if error is not None:
            log.error("step failed: %s", error, extra={"event": "step_failed", "model": self.prepared.name})
            for row, _ in work:
                if self.rows[row] is not None:
                    self.rows[row].error = error
                    self._retire(row, "error")
            self.busy = False
            self._kick()
            return
        ids = values["ids"]
        for i, (row, fed) in enumerate(work):
            seq = self.rows[row]
            self.tables[row].length += len(fed)
            if seq is None:
                continue
            if seq.fed < len(seq.prompt):
                seq.fed += len(fed)
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
        self.busy = False
        self._kick()


def _common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
