"""The paged KV pool's bookkeeping: page ids with reference counts, and rows' page tables.

The device memory for a deployment's paged state (the package's `state ...
paged(PAGE)` declarations) is allocated once at preparation; this module
decides which page holds what. A row holds a list of pages covering its
positions; retained conversations, prefix-cache entries and checkpoints hold
references to the same pages, so sharing an exact prefix costs no copy, and
a page returns to the free list when its last reference goes.
"""

import numpy as np


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

    def __init__(self, pool, max_pages):
        self.pool = pool
        self.max_pages = max_pages
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
        is shared (a prefix-cache entry or a named history holds it too) is never
        written again: the boundary moves down to its start, and pages past the
        boundary are let go, so new positions always land in private pages."""
        size = self.pool.page_size
        keep = length // size
        if length % size and keep < len(self.pages) and self.pool.refs[self.pages[keep]] == 1:
            keep += 1
        else:
            length = keep * size
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
