"""The selectors event loop: callbacks, timers, readiness callbacks, and a bounded
thread executor whose results come back on the loop thread.

Single-threaded and never blocking: socket readiness, timers and executor
hand-backs (call_soon_threadsafe) interleave in run_once. A failing callback is
logged and contained.
"""

import collections
import concurrent.futures
import heapq
import itertools
import logging
import selectors
import socket
import time

log = logging.getLogger("loom")


class Loop:
    """Callbacks, timers, readiness and a bounded thread executor around one selector."""

    def __init__(self, workers):
        self.selector = selectors.DefaultSelector()
        self._ready = collections.deque()
        self._timers = []
        self._seq = itertools.count()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, self._drain_wakeups)
        self.executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="loom-worker")
        self.executor_pending = 0

    def call_soon(self, fn, *args):
        self._ready.append((fn, args))

    def call_soon_threadsafe(self, fn, *args):
        self._ready.append((fn, args))  # deque.append is atomic
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a full wake pipe already guarantees a wakeup

    def call_later(self, delay, fn, *args):
        timer = [time.monotonic() + delay, next(self._seq), fn, args, False]
        heapq.heappush(self._timers, timer)
        return timer

    @staticmethod
    def cancel_timer(timer):
        timer[4] = True

    def run_in_executor(self, fn, done, *args):
        """Run fn(*args) on a worker; done(result, error) runs on the loop thread."""
        self.executor_pending += 1

        def finished(future):
            if future.cancelled():
                return      # the loop is closing (shutdown cancels queued work): nobody waits for it
            error = future.exception()
            self.call_soon_threadsafe(self._complete, done, None if error else future.result(), error)

        self.executor.submit(fn, *args).add_done_callback(finished)

    def _complete(self, done, result, error):
        self.executor_pending -= 1
        done(result, error)

    def _drain_wakeups(self, _mask):
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def wakeup_fd(self):
        return self._wake_w.fileno()

    def run_once(self):
        timeout = 0 if self._ready else None
        if self._timers and timeout is None:
            timeout = max(0.0, self._timers[0][0] - time.monotonic())
        for key, mask in self.selector.select(timeout):
            self._guarded(key.data, (mask,))
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, fn, args, cancelled = heapq.heappop(self._timers)
            if not cancelled:
                self._ready.append((fn, args))
        for _ in range(len(self._ready)):
            fn, args = self._ready.popleft()
            self._guarded(fn, args)

    @staticmethod
    def _guarded(fn, args):
        # A bug in one callback is logged and contained: it must never take the
        # server (and every other client's work) down with it.
        try:
            fn(*args)
        except Exception:
            log.exception("callback %r failed", getattr(fn, "__qualname__", fn),
                          extra={"event": "callback_failed"})

    def close(self):
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.selector.close()
        self._wake_r.close()
        self._wake_w.close()
