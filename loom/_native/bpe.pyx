# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""BPE merge loop for loom.tokenizer.

The same algorithm as the pure-Python `_BPE.merge` (HF tokenizers' `Word::merge_all`): a
min-heap of (rank, position) merge candidates over a linked list of symbols, stale entries
skipped when popped.  Here the merge table is an open-addressing hash of int64 pair keys and the
loop runs on C arrays without the GIL, so long pre-tokens cost microseconds per merge.
"""
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc, realloc


cdef struct Entry:
    int32_t rank
    int32_t pos
    int32_t new


cdef inline bint _before(Entry a, Entry b) noexcept nogil:
    return a.rank < b.rank or (a.rank == b.rank and a.pos < b.pos)


cdef struct Heap:
    Entry* items
    Py_ssize_t size
    Py_ssize_t cap


cdef int _push(Heap* h, Entry e) noexcept nogil:
    cdef Py_ssize_t i, parent
    cdef Entry* grown
    if h.size == h.cap:
        grown = <Entry*>realloc(h.items, (h.cap * 2 + 16) * sizeof(Entry))
        if grown == NULL:
            return -1
        h.items = grown
        h.cap = h.cap * 2 + 16
    i = h.size
    h.size += 1
    while i > 0:
        parent = (i - 1) >> 1
        if not _before(e, h.items[parent]):
            break
        h.items[i] = h.items[parent]
        i = parent
    h.items[i] = e
    return 0


cdef Entry _pop(Heap* h) noexcept nogil:
    cdef Entry top = h.items[0]
    cdef Entry last
    cdef Py_ssize_t i = 0, child
    h.size -= 1
    if h.size:
        last = h.items[h.size]
        while True:
            child = 2 * i + 1
            if child >= h.size:
                break
            if child + 1 < h.size and _before(h.items[child + 1], h.items[child]):
                child += 1
            if not _before(h.items[child], last):
                break
            h.items[i] = h.items[child]
            i = child
        h.items[i] = last
    return top


cdef class MergeTable:
    """(left id, right id) -> (rank, merged id), built from `_BPE.pairs` ({left*width+right:
    (rank, new)})."""
    cdef int64_t* keys
    cdef int32_t* ranks
    cdef int32_t* news
    cdef uint64_t mask
    cdef int shift
    cdef int64_t width

    def __cinit__(self, dict pairs, int64_t width):
        cdef uint64_t size = 16
        cdef int bits = 4
        cdef uint64_t i, slot
        cdef int64_t key
        while size < 2 * <uint64_t>len(pairs) + 16:
            size <<= 1
            bits += 1
        self.keys = <int64_t*>malloc(size * sizeof(int64_t))
        self.ranks = <int32_t*>malloc(size * sizeof(int32_t))
        self.news = <int32_t*>malloc(size * sizeof(int32_t))
        if self.keys == NULL or self.ranks == NULL or self.news == NULL:
            raise MemoryError()
        self.mask = size - 1
        self.shift = 64 - bits
        self.width = width
        for i in range(size):
            self.keys[i] = -1
        for k, v in pairs.items():
            key = k
            slot = self._slot(key)
            while self.keys[slot] != -1 and self.keys[slot] != key:
                slot = (slot + 1) & self.mask
            self.keys[slot] = key
            self.ranks[slot] = v[0]
            self.news[slot] = v[1]

    def __dealloc__(self):
        free(self.keys)
        free(self.ranks)
        free(self.news)

    cdef inline uint64_t _slot(self, int64_t key) noexcept nogil:
        return (<uint64_t>key * <uint64_t>11400714819323198485ULL) >> self.shift

    cdef inline bint _find(self, int32_t a, int32_t b, Entry* out) noexcept nogil:
        cdef int64_t key = <int64_t>a * self.width + b
        cdef uint64_t slot = self._slot(key)
        while self.keys[slot] != -1:
            if self.keys[slot] == key:
                out.rank = self.ranks[slot]
                out.new = self.news[slot]
                return True
            slot = (slot + 1) & self.mask
        return False

    def merge(self, list ids):
        """Apply the merges to a list of symbol ids; returns the merged ids."""
        cdef Py_ssize_t n = len(ids), i, j, k, p
        if n < 2:
            return list(ids)
        cdef int32_t* c = <int32_t*>malloc(n * sizeof(int32_t))
        cdef int32_t* nxt = <int32_t*>malloc(n * sizeof(int32_t))
        cdef int32_t* prv = <int32_t*>malloc(n * sizeof(int32_t))
        cdef Heap heap
        heap.items = <Entry*>malloc((n + 16) * sizeof(Entry))
        heap.size = 0
        heap.cap = n + 16
        cdef Entry e, top
        cdef int failed = 0
        try:
            if c == NULL or nxt == NULL or prv == NULL or heap.items == NULL:
                raise MemoryError()
            for i in range(n):
                c[i] = ids[i]
                nxt[i] = i + 1
                prv[i] = i - 1
            nxt[n - 1] = -1
            with nogil:
                for i in range(n - 1):
                    if self._find(c[i], c[i + 1], &e):
                        e.pos = <int32_t>i
                        failed |= _push(&heap, e)
                while heap.size and not failed:
                    top = _pop(&heap)
                    if c[top.pos] < 0:  # merged into its left neighbour
                        continue
                    j = nxt[top.pos]
                    if j < 0:
                        continue
                    if not self._find(c[top.pos], c[j], &e) or e.new != top.new:
                        continue  # stale: the pair at this position changed
                    c[top.pos] = top.new
                    c[j] = -1
                    k = nxt[j]
                    nxt[top.pos] = <int32_t>k
                    if k >= 0:
                        prv[k] = top.pos
                        if self._find(top.new, c[k], &e):
                            e.pos = top.pos
                            failed |= _push(&heap, e)
                    p = prv[top.pos]
                    if p >= 0 and self._find(c[p], top.new, &e):
                        e.pos = <int32_t>p
                        failed |= _push(&heap, e)
            if failed:
                raise MemoryError()
            return [c[i] for i in range(n) if c[i] >= 0]
        finally:
            free(c)
            free(nxt)
            free(prv)
            free(heap.items)
