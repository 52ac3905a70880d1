"""Page bookkeeping: allocation, sharing, release, row tables; accounting always returns to baseline."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.kvcache import OutOfPages, PagePool, RowPages


def test_alloc_share_release_and_exhaustion():
    pool = PagePool(8, 16)
    a = pool.alloc(3)
    b = pool.alloc(5)
    assert pool.available == 0 and sorted(a + b) == list(range(8))
    with pytest.raises(OutOfPages):
        pool.alloc(1)
    pool.share(a)                 # a retained prefix keeps a's pages alive
    pool.release(a)
    assert pool.available == 0
    pool.release(a)
    assert pool.available == 3
    with pytest.raises(ValueError):
        pool.release(a)           # a double release is a bug, never silent
    pool.release(b)
    assert pool.available == 8 and not pool.refs.any()


def test_row_pages_grow_by_page_and_respect_the_row_bound():
    pool = PagePool(10, 16)
    row = RowPages(pool, max_pages=4)
    row.reserve(1)
    assert len(row.pages) == 1
    row.reserve(16)
    assert len(row.pages) == 1
    row.reserve(17)
    assert len(row.pages) == 2
    table = row.table()
    assert list(table[:2]) == row.pages and (table[2:] == -1).all()
    with pytest.raises(OutOfPages):
        row.reserve(65)           # more than max_pages pages
    row.clear()
    assert pool.available == 10


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "share", "release"]), st.integers(0, 5), st.integers(0, 20)),
                max_size=60))
def test_random_operations_match_a_reference_count_model(ops):
    pool = PagePool(12, 4)
    held = []                     # one entry per reference we hold: a list of page ids
    for op, n, pick in ops:
        if op == "alloc":
            try:
                held.append(pool.alloc(n))
            except OutOfPages:
                assert n > pool.available
        elif op == "share" and held:
            ids = held[pick % len(held)]
            pool.share(ids)
            held.append(list(ids))
        elif op == "release" and held:
            pool.release(held.pop(pick % len(held)))
        counts = np.zeros(12, np.int32)
        for ids in held:
            np.add.at(counts, ids, 1)
        assert (pool.refs == counts).all()
        assert pool.available == int((counts == 0).sum())
    for ids in held:
        pool.release(ids)
    assert pool.available == 12
