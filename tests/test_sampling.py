"""opencl/sample.cl against a numpy reference of the same sampling semantics."""

import numpy as np
import pyopencl as cl
import pytest

from conftest import compiler_for
from loom.device import Device

V = 1000
TAIL_V = 1003     # not a multiple of 8: the eight-wide passes leave a tail of 3


def key(x):
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return np.where(bits & 0x80000000, (~bits) & 0xFFFFFFFF, bits | 0x80000000)


def lowbias32(x):
    x = np.uint32(x)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x = np.uint32(x * np.uint32(0x7FEB352D))
        x ^= x >> np.uint32(15)
        x = np.uint32(x * np.uint32(0x846CA68B))
        x ^= x >> np.uint32(16)
    return x


def uniform(seed, counter):
    with np.errstate(over="ignore"):
        inner = lowbias32(np.uint32(counter) + np.uint32(0x9E3779B9))
    return float(lowbias32(np.uint32(seed) ^ inner) >> np.uint32(8)) / 16777216.0


def reference(logits, temperature, top_p, top_k, seed, counter):
    """(kept mask, cumulative kept mass in index order, target) per sample.cl's contract, in float64."""
    if not temperature > 0 or top_k == 1:
        return int(np.argmax(logits)), None, None
    x = (logits.astype(np.float32) / np.float32(temperature)).astype(np.float32)
    keys = key(logits)   # for a positive temperature the logits order the tokens as x does
    keep = np.ones(len(logits), bool)
    if 0 < top_k < len(logits):
        kth = np.sort(keys)[::-1][top_k - 1]
        keep = keys >= kth
    p = np.where(keep, np.exp(x.astype(np.float64) - x.max()), 0.0)
    if 0 < top_p < 1:
        order = np.argsort(-logits.astype(np.float64), kind="stable")
        mass = np.cumsum(p[order])
        need = top_p * p.sum()
        last = order[np.searchsorted(mass, need * (1 - 1e-6))]   # the smallest top set reaching the mass
        keep &= keys >= keys[last]
        p = np.where(keep, p, 0.0)
    cdf = np.cumsum(p)
    return None, cdf, uniform(seed, counter) * cdf[-1]


def sampler(vocab):
    device = Device("cpu")
    compiler = compiler_for(device)
    exe = compiler.compile(compiler.library_source("sample"), {"V": vocab})
    return device, exe.program


@pytest.fixture(scope="module")
def kernel():
    return sampler(V)


def run(kernel, logits, params, seeds):
    device, program = kernel
    R, V = logits.shape
    ctx, queue = device.context, device.queue
    mf = cl.mem_flags
    X = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(logits, np.float32))
    P = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.asarray(params, np.float32))
    S = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.asarray(seeds, np.uint32))
    W = cl.Buffer(ctx, mf.READ_WRITE, R * V * 4)
    ids = np.zeros(R, np.int32)
    I = cl.Buffer(ctx, mf.WRITE_ONLY, ids.nbytes)
    k = cl.Kernel(program, "sample")
    k.set_args(X, np.int32(0), np.int32(V), P, S, W, I, np.int32(R))
    cl.enqueue_nd_range_kernel(queue, k, (R,), None)
    cl.enqueue_copy(queue, ids, I)
    return ids


def check(choice, logits, params, seed, counter):
    greedy, cdf, target = reference(logits, *params[:3], seed, counter)
    if greedy is not None:
        assert choice == greedy
        return
    # The device sums in float32 and in another order: its pick must be where the
    # reference's cumulative mass crosses the target, within that rounding.
    eps = 1e-4 * cdf[-1]
    assert cdf[choice] > target - eps and (choice == 0 or cdf[choice - 1] <= target + eps)
    assert cdf[choice] > (cdf[choice - 1] if choice else 0)   # a kept token


CASES = [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 40), (0.8, 0.5, 20), (1.0, 0.95, 1),
         (2.0, 0.3, 0), (0.5, 1.0, 999), (1.0, 0.0, 0)]


@pytest.mark.parametrize("temperature,top_p,top_k", CASES)
def test_sampling_matches_the_reference(kernel, temperature, top_p, top_k):
    rng = np.random.default_rng(int(temperature * 100 + top_p * 10 + top_k))
    logits = (rng.standard_normal((24, V)) * 3).astype(np.float32)
    params = [[temperature, top_p, top_k, 0]] * 24
    seeds = [[1234 + r, r * 7] for r in range(24)]
    ids = run(kernel, logits, params, seeds)
    for r in range(24):
        check(int(ids[r]), logits[r], params[r], *seeds[r])


def test_a_seed_gives_the_same_draw_batched_or_alone(kernel):
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((8, V)).astype(np.float32)
    params = [[1.0, 0.9, 50, 0]] * 8
    seeds = [[99, 3]] + [[r, r] for r in range(1, 8)]
    together = run(kernel, logits, params, seeds)
    alone = run(kernel, logits[:1], params[:1], seeds[:1])
    assert together[0] == alone[0]


def test_empirical_distribution_follows_the_probabilities(kernel):
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05] + [1e-12] * (V - 4), np.float32))
    draws = 4000
    ids = run(kernel, np.tile(logits, (draws, 1)), [[1.0, 1.0, 4, 0]] * draws, [[7, c] for c in range(draws)])
    freq = np.bincount(ids, minlength=4)[:4] / draws
    assert np.abs(freq - [0.5, 0.3, 0.15, 0.05]).max() < 0.03
    assert set(np.unique(ids)) <= {0, 1, 2, 3}   # top_k = 4 drops the rest


@pytest.mark.parametrize("temperature,top_p,top_k", CASES)
def test_a_vocabulary_with_a_tail_matches_the_reference(temperature, top_p, top_k):
    kernel = sampler(TAIL_V)
    rng = np.random.default_rng(int(temperature * 100 + top_p * 10 + top_k) + 1)
    logits = (rng.standard_normal((24, TAIL_V)) * 3).astype(np.float32)
    logits[:8, -3:] += 20      # rows whose likeliest tokens are all in the tail
    params = [[temperature, top_p, top_k, 0]] * 24
    seeds = [[4321 + r, r * 5] for r in range(24)]
    ids = run(kernel, logits, params, seeds)
    for r in range(24):
        check(int(ids[r]), logits[r], params[r], *seeds[r])
    if temperature == 0:
        assert all(ids[:8] >= TAIL_V - 3)
