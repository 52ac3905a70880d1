"""The paged KV pool's bookkeeping: page ids with reference counts, and rows' page tables.

The device memory for a deployment's paged state (the package's `state ...
paged(PAGE)` declarations) is allocated once at preparation; this module
decides which page holds what. A row holds a list of pages covering its
positions; retained conversations, prefix-cache entries and checkpoints hold
references to the same pages, so sharing an exact prefix costs no copy, and
a page returns to the free list when its last reference goes. A shared page
is never written: a row that must extend a shared, partly filled page first
copies it (copy-on-write, `PagedState.copy`).

`PagedState` is the device side: page copies, and host snapshots of a
checkpoint's pages (suspension) and their return into fresh pages.
"""

import logging
import threading

import numpy as np

log = logging.getLogger("loom.kvcache")


class OutOfPages(Exception):
    """The pool cannot hold what was asked; the scheduler answers 503 or waits."""


class PagePool:
    def __init__(self, pages, page_size):
        self.pages = pages
        self.page_size = page_size
        self.refs = np.zeros(pages, np.int32)
        self.free = list(range(pages - 1, -1, -1))   # a stack: recently freed pages are reused first (warm)

    @property
    def available(self):
        return len(self.free)

    @property
    def used(self):
        return self.pages - len(self.free)

    def alloc(self, n):
        """n fresh pages, each with one reference; all or nothing."""
        if n > len(self.free):
            raise OutOfPages(f"{n} pages wanted, {len(self.free)} of {self.pages} free")
        ids = [self.free.pop() for _ in range(n)]
        self.refs[ids] = 1
        return ids

    def share(self, ids):
        """Another holder of these pages (a retained prefix, a checkpoint)."""
        for page in ids:
            if self.refs[page] <= 0:
                raise ValueError(f"page {page} is not allocated")
        for page in ids:
            self.refs[page] += 1

    def release(self, ids):
        for page in ids:
            if self.refs[page] <= 0:
                raise ValueError(f"page {page} released more often than held")
        for page in ids:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.append(page)

    def pages_for(self, positions):
        return -(-positions // self.page_size)


class RowPages:
    """One sequence's page table: grows a page at a time as positions are added."""

    def __init__(self, pool, max_pages, copy=None):
        self.pool = pool
        self.max_pages = max_pages
        self.copy = copy         # copy(src, dst): duplicate a page's contents (copy-on-write)
        self.pages = []
        self.length = 0          # positions stored

    def reserve(self, positions):
        """Make room for `positions` in total; OutOfPages if the pool or the row is full."""
        needed = self.pool.pages_for(positions)
        if needed > self.max_pages:
            raise OutOfPages(f"{positions} positions need {needed} pages; a row holds {self.max_pages}")
        if needed > len(self.pages):
            self.pages += self.pool.alloc(needed - len(self.pages))

    def truncate(self, length):
        """Keep positions [0, length) for reuse and return the length kept. A page that
        is shared (a prefix-cache entry, a named history or a checkpoint holds it
        too) is never written again: a partly kept shared page is copied into a
        private one, or, without a copier or a free page, the boundary moves down
        to its start. Pages past the boundary are let go."""
        size = self.pool.page_size
        keep = length // size
        if length % size and keep < len(self.pages):
            page = self.pages[keep]
            if self.pool.refs[page] > 1 and self.copy is not None and self.pool.available:
                private = self.pool.alloc(1)[0]
                self.copy(page, private)
                self.pool.release([page])
                self.pages[keep] = private
            if self.pool.refs[self.pages[keep]] == 1:
                keep += 1
            else:
                length = keep * size
        else:
            length = min(length, keep * size)
        self.pool.release(self.pages[keep:])
        self.pages = self.pages[:keep]
        self.length = length
        return length

    def table(self):
        """The row's page table as the kernels read it: page ids, then -1."""
        out = np.full(self.max_pages, -1, np.int32)
        out[:len(self.pages)] = self.pages
        return out

    def clear(self):
        self.pool.release(self.pages)
        self.pages = []
        self.length = 0


class History:
    """Retained state outside a row: the tokens whose keys and values `pages` hold
    and, for text, the sampled token not yet fed back (None for sequences)."""

    __slots__ = ("tokens", "pages", "pending")

    def __init__(self, tokens, pages, pending=None):
        self.tokens, self.pages, self.pending = list(tokens), list(pages), pending


class Checkpoint(History):
    """A pinned, immutable endpoint. Resident (pages) or suspended (host: one
    array per paged state, [pages, groups, page_bytes]); borrowers are queued
    requests that will start from it, which block deletion."""

    __slots__ = ("name", "host", "borrowers", "suspending")

    def __init__(self, name, history):
        super().__init__(history.tokens, history.pages, history.pending)
        self.name = name
        self.host = None
        self.borrowers = 0
        self.suspending = None    # callbacks waiting for a snapshot in progress

    @property
    def host_bytes(self):
        return sum(a.nbytes for a in self.host) if self.host is not None else 0


class PagedState:
    """Page-level device operations on a deployment's paged state buffers.

    Layout (docs/language.md, `state ... paged(PAGE) [D0, D1, ...]`): each buffer
    is [D0][pages][PAGE][D1...], so one page is D0 blocks of `page_bytes`, one per
    outer index (a layer), `pages * page_bytes` apart: rectangular copies move a
    page in one command per buffer. Every command goes through the device's
    submission thread (device.submit), in order with the steps around it, so the
    loop never waits in a driver."""

    def __init__(self, device, buffers):
        """buffers: (device buffer, groups, page_bytes, pages) per paged state."""
        self.device = device
        self.buffers = buffers
        self.uploads = []     # (event, arrays) kept alive until their copy completes
        self.lock = threading.Lock()

    def copy(self, src, dst):
        def enqueue():
            for buf, groups, page_bytes, pages in self.buffers:
                self.device.copy_blocks(buf, src * page_bytes, dst * page_bytes, page_bytes, groups,
                                        pages * page_bytes)
        self.device.submit(enqueue, _reported("page copy"))

    def snapshot(self, page_ids):
        """Enqueue reads of the pages into new host arrays; -> (arrays, wait), where wait()
        blocks (on a worker) until they hold the pages."""
        arrays = [np.empty((len(page_ids), groups, page_bytes), np.uint8)
                  for _, groups, page_bytes, _ in self.buffers]
        enqueued, box = threading.Event(), {}

        def enqueue():
            return self._transfer(self.device.read_blocks_async, arrays, page_ids)

        def done(event, error):
            box.update(event=event, error=error)
            enqueued.set()

        def wait():
            enqueued.wait()
            if box["error"] is not None:
                raise box["error"]
            if box["event"] is not None:
                box["event"].wait()

        self.device.submit(enqueue, done)
        return arrays, wait

    def restore(self, arrays, page_ids):
        """Enqueue writes of a snapshot into (fresh) pages; the arrays stay alive until done."""
        def enqueue():
            event = self._transfer(self.device.write_blocks_async, arrays, page_ids)
            with self.lock:
                self.uploads = [(e, a) for e, a in self.uploads if not self.device.finished(e)] + [(event, arrays)]

        self.device.submit(enqueue, _reported("checkpoint restore"))

    def _transfer(self, copy, arrays, page_ids):
        """On the submission thread: `copy` (read or write of one page's blocks) for every
        page of every paged buffer, then flush; -> the last event."""
        event = None
        for (buf, groups, page_bytes, pages), host in zip(self.buffers, arrays):
            for i, page in enumerate(page_ids):
                event = copy(buf, host[i], page * page_bytes, page_bytes, groups, pages * page_bytes)
        self.device.flush()
        return event


def _reported(what):
    def done(_, error):
        if error is not None:
            log.error("%s failed on the device: %s", what, error, extra={"event": "device_command_failed"})
    return done