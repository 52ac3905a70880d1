"""The opencl/ kernel library against independent numpy references.

Every kernel is built the way the compiler builds it (opencl/common.cl
prepended, specialization values as -D macros) on every usable driver
present (conftest.drivers: Intel's runtime, PoCL, ...), run on
deterministic random data, and compared with a float64 numpy computation
written here. Quantized weights are produced with
the ggml reference formulas and dequantized by numpy from the same bytes.
Each program is built once per module (builds cost ~0.5 s on PoCL).
"""

import itertools
import os
import re

import numpy as np
import pytest

from conftest import drivers
from loom import device as loom_device
from loom.runtime import tile, tile_blocks

cl = pytest.importorskip("pyopencl")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPENCL = os.path.join(ROOT, "opencl")
QK = 32


# ---------------------------------------------------------------- device

class Program:
    """A built program whose kernels are retrieved once (prg.NAME)."""

    def __init__(self, program):
        self._program = program
        self._kernels = {}

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._kernels:
            self._kernels[name] = cl.Kernel(self._program, name)
        return self._kernels[name]


class Env:
    def __init__(self, selector):
        self.device, self.info = loom_device._enumerate()[int(selector)]
        self.ctx = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.ctx)
        self.programs = {}

    def build(self, name, **macros):
        """opencl/common.cl + opencl/NAME.cl with -DKEY=VALUE (-DKEY for True)."""
        opts = []
        macros = dict(macros, **loom_device.kernel_defines(self.info))   # as loom.compiler adds them
        for k, v in sorted(macros.items()):
            if v is True:
                opts.append(f"-D{k}")
            elif v is not False and v is not None:
                opts.append(f"-D{k}={v}")
        key = (name, tuple(opts))
        if key not in self.programs:
            with open(os.path.join(OPENCL, "common.cl")) as f:
                src = f.read()
            with open(os.path.join(OPENCL, name + ".cl")) as f:
                src += "\n" + f.read()
            self.programs[key] = Program(cl.Program(self.ctx, src).build(options=opts))
        return self.programs[key]

    def buf(self, arr):
        arr = np.ascontiguousarray(arr)
        return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=arr)

    def empty(self, nbytes):
        return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, max(4, nbytes))

    def read(self, b, shape, dtype=np.float32):
        out = np.empty(shape, dtype)
        cl.enqueue_copy(self.queue, out, b)
        return out

    def run(self, kernel, gsize, lsize, *args):
        kernel(self.queue, gsize, lsize, *args)


_ENVS = {}


def shared_env(selector):
    """One Env a driver for the whole run: every module's kernels built once (test_conv2d and
    test_lora build through it too)."""
    if selector not in _ENVS:
        _ENVS[selector] = Env(selector)
    return _ENVS[selector]


@pytest.fixture(scope="module", params=drivers())
def env(request):
    return shared_env(request.param)


def diagonal(*axes):
    """The product of the axes as pytest params, all but a diagonal marked `full`: `make test`
    runs the r-th value of every axis together (r up to the longest axis), so every type,
    shape and geometry still runs on every driver; `make test-full` runs the whole product."""
    axes = [list(axis) for axis in axes]
    kept = {tuple(r % len(axis) for axis in axes) for r in range(max(map(len, axes)))}
    return [pytest.param(*(axis[i] for axis, i in zip(axes, index)), marks=() if index in kept else pytest.mark.full)
            for index in itertools.product(*(range(len(axis)) for axis in axes))]


def i32(v):
    return np.int32(v)


def f32(v):
    return np.float32(v)


def assert_close(got, ref, rel):
    """max |got - ref| <= rel * (output scale = max |ref|)."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    scale = max(float(np.abs(ref).max(initial=0.0)), 1e-30)
    err = float(np.abs(got - ref).max(initial=0.0))
    assert np.all(np.isfinite(got)), "non-finite output"
    assert err <= rel * scale, f"max error {err:.3g} > {rel:g} * {scale:.3g}"


def rng(seed):
    return np.random.default_rng(seed)


# ---------------------------------------------------------------- ggml quantization (reference formulas)

def quantize_q8_0(w):
    """[N, K] float32 -> (raw [N, K/32*34] uint8, dequantized float64)."""
    n, k = w.shape
    b = w.reshape(-1, QK).astype(np.float32)
    amax = np.abs(b).max(axis=1)
    d = amax / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    v = b * inv[:, None]
    q = np.trunc(v + np.copysign(np.float32(0.5), v)).astype(np.int8)  # roundf
    d16 = d.astype(np.float16)
    raw = np.concatenate([d16.view(np.uint8).reshape(-1, 2), q.view(np.uint8)], axis=1)
    deq = d16.astype(np.float64)[:, None] * q.astype(np.float64)
    return raw.reshape(n, -1), deq.reshape(n, k)


def quantize_q4_0(w):
    """[N, K] float32 -> (raw [N, K/32*18] uint8, dequantized float64)."""
    n, k = w.shape
    b = w.reshape(-1, QK).astype(np.float32)
    m = b[np.arange(len(b)), np.abs(b).argmax(axis=1)]  # signed value of max |x|
    d = m / np.float32(-8)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.minimum(15, np.trunc(b * inv[:, None] + np.float32(8.5))), 0, 15).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    d16 = d.astype(np.float16)
    raw = np.concatenate([d16.view(np.uint8).reshape(-1, 2), packed], axis=1)
    deq = d16.astype(np.float64)[:, None] * (q.astype(np.float64) - 8)
    return raw.reshape(n, -1), deq.reshape(n, k)


def quantize_activations_q8(x):
    """matmul.cl's ACT_Q8 activation quantization, [T, K] float32 (K % 32 == 0) ->
    (q int8 [T, K/32, 32], d float32 [T, K/32]): per 32-element block
    d = max|x| / 127, q = round-half-even(x * (1 / d)) (0 where d = 0), in float32."""
    b = np.asarray(x, np.float32).reshape(len(x), -1, QK)
    d = np.abs(b).max(axis=-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.rint(b * inv[..., None]).astype(np.int8)
    return q, d


def act_q8_matmul(x, wraw, kind, n, k):
    """The ACT_Q8 matmul from raw Q8_0/Q4_0 bytes, float64: per block an exact
    integer dot of int8 activations and weights, scaled by d_w * d_x."""
    qx, dx = quantize_activations_q8(x)
    raw = np.asarray(wraw, np.uint8).reshape(n, k // QK, -1)
    dw = raw[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float64)
    if kind == "Q8_0":
        qw = raw[:, :, 2:].copy().view(np.int8).astype(np.int64)
    else:
        nib = raw[:, :, 2:].astype(np.int64)
        qw = np.concatenate([nib & 15, nib >> 4], axis=-1) - 8
    isum = np.einsum("tbk,nbk->tnb", qx.astype(np.int64), qw)      # exact int32-range sums
    return (isum * (dw[None] * dx[:, None].astype(np.float64))).sum(axis=-1)


def make_weights(kind, w):
    """(device bytes, float64 matrix the kernel must multiply by)."""
    if kind == "F32":
        return w.astype(np.float32), w.astype(np.float64)
    if kind == "F16":
        h = w.astype(np.float16)
        return h, h.astype(np.float64)
    if kind == "Q8_0":
        return quantize_q8_0(w)
    if kind in ("Q4_1", "Q5_0", "Q5_1"):    # gguf's quantizer and dequantizer: independent of ours
        import gguf
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        raw = gguf.quants.quantize(w, qtype)
        return raw, gguf.quants.dequantize(raw, qtype).astype(np.float64)
    return quantize_q4_0(w)


# ---------------------------------------------------------------- K-quants

KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# ggml's superblocks (QK_K = 256): bytes, and the byte offsets of their f16 fields (d, dmin)
KQ_BLOCKS = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
             "Q6_K": (210, (208,))}


def kquant_weights(kind, n, k, seed, magnitude=0.01):
    """Random K-quant superblocks, [N, K] (K % 256 == 0): random bytes, so every quant and
    sub-block scale bit pattern occurs, with the f16 fields set to finite values of either
    sign up to `magnitude` (one superblock's zero, as a quantizer writes for zeros).
    -> (raw [N, K/256*bytes] uint8, gguf's dequantization as float64: an independent decoder)."""
    import gguf
    size, fields = KQ_BLOCKS[kind]
    r = rng(seed)
    raw = r.integers(0, 256, (n, k // 256 * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for at in fields:
        halves = (r.uniform(-1, 1, len(blocks)) * magnitude).astype(np.float16)
        halves[0] = 0
        blocks[:, at:at + 2] = halves.view(np.uint8).reshape(-1, 2)
    ref = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).astype(np.float64)
    return raw, ref.reshape(n, k)


KQ_MATMUL_CASES = [
    # (N, K, geometry (ROWS_PER_ITEM, TOKENS_PER_ITEM, WG, VW), bias, accumulate)
    (5, 256, (1, 1, 8, 16), False, False),       # one superblock, decode defaults, N < WG
    (37, 4864, (4, 2, 8, 8), True, False),       # 19 superblocks, N % 4 != 0
    (19, 768, (1, 4, 8, 16), True, True),        # odd N, cohort tile, residual add
    (1, 256, (3, 3, 2, 8), False, True),         # N = 1, odd tile sizes (4-lane K-quant tiles: no package
                                                 # uses them, and Intel's compiler takes 15-40 s a kind)
    (43, 1536, (4, 4, 8, 16), True, True),       # the wide prefill tile
    (9, 512, (2, 1, 16, 8), False, False),       # N % WG != 0, 8 lanes
]


@pytest.mark.every_driver
@pytest.mark.parametrize("kind,case", diagonal(KQUANTS, range(len(KQ_MATMUL_CASES))))
def test_matmul_kquants(env, kind, case):
    """Every K-quant against gguf's dequantization of the same random superblocks."""
    n, k, geometry, has_bias, accumulate = KQ_MATMUL_CASES[case]
    wraw, wref = kquant_weights(kind, n, k, 200 + case)
    r = rng(300 + case)
    bias = r.standard_normal(n).astype(np.float32) if has_bias else None
    for t in (1, 3, 67):
        x = r.standard_normal((t, k)).astype(np.float32)
        y0 = r.standard_normal((t, n)).astype(np.float32) if accumulate else None
        ref = x.astype(np.float64) @ wref.T + (bias if has_bias else 0.0) + (y0 if accumulate else 0.0)
        got = run_matmul(env, kind, n, k, x, wraw, bias, y0, geometry)
        assert_close(got, ref, 1e-4)


def some(values, quick):
    """values as pytest params, those not in `quick` marked `full`: a sweep that `make test`
    runs for the types real checkpoints use most (the others are checked by a single case)."""
    return [pytest.param(v, marks=() if v in quick else pytest.mark.full) for v in values]


@pytest.mark.parametrize("kind", some(KQUANTS, ("Q4_K",)))
def test_matmul_kquant_cohort_tails(env, kind):
    """llama.loom's cohort geometries and the wide tile at every T up to 9 (every tail
    width). Not TOKENS_PER_ITEM = 16: fifteen inlined tail tiles of a fully unrolled
    superblock take Intel's compiler a minute to build, and no package uses it."""
    for n, k, geometries in ((19, 512, ((1, 4, 8, 16), (1, 2, 8, 16))), (11, 2560, ((2, 4, 8, 8), (4, 4, 8, 16)))):
        wraw, wref = kquant_weights(kind, n, k, 41)
        x = rng(42).standard_normal((9, k)).astype(np.float32)
        y0 = rng(43).standard_normal((9, n)).astype(np.float32)
        for geometry in geometries:
            for t in range(1, 10):
                got = run_matmul(env, kind, n, k, x[:t], wraw, y0=y0[:t], geometry=geometry)
                assert_close(got, y0[:t] + x[:t].astype(np.float64) @ wref.T, 1e-4)


@pytest.mark.parametrize("kind", KQUANTS)
def test_matmul_kquant_subnormal_scales(env, kind):
    """Superblock scales d (and dmin) that are f16 subnormals."""
    n, k = 6, 512
    wraw, wref = kquant_weights(kind, n, k, 33, magnitude=6e-5)
    size, fields = KQ_BLOCKS[kind]
    halves = np.abs(wraw.reshape(-1, size)[:, fields[0]:fields[0] + 2].copy().view(np.float16))
    assert ((halves > 0) & (halves < np.float16(6.104e-5))).mean() > 0.5
    x = rng(34).standard_normal((3, k)).astype(np.float32)
    got = run_matmul(env, kind, n, k, x, wraw, geometry=(1, 1, 8, 16))
    assert_close(got, x.astype(np.float64) @ wref.T, 1e-4)


def random_weights(seed, n, k):
    w = rng(seed).standard_normal((n, k)).astype(np.float32)
    if k % QK == 0:
        w[0, :QK] = 0.0                      # an all-zero block (d = 0)
        if n > 1:
            w[n - 1, :QK] *= 0.001            # one dominant negative element:
            w[n - 1, 3] = -5.0                # Q4_0's signed max, most q near 8
    return w


def test_quantizers_match_known_blocks():
    """The test's own ggml formulas on hand-checked blocks."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, -63.5, 1.0
    raw, deq = quantize_q8_0(x)
    assert raw.shape == (1, 34)
    assert np.frombuffer(raw[0, :2].tobytes(), np.float16)[0] == np.float16(1.0)
    assert list(raw[0, 2:5].view(np.int8)) == [127, -64, 1]  # roundf: half away from zero
    assert np.allclose(deq[0, :3], [127, -64, 1])
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 17] = -8.0, 4.0
    raw, deq = quantize_q4_0(x)
    assert raw.shape == (1, 18)
    assert np.frombuffer(raw[0, :2].tobytes(), np.float16)[0] == np.float16(1.0)
    assert raw[0, 2] == 0x80          # element 0 -> q 0, element 16 -> q 8
    assert raw[0, 3] == 0xC8          # element 1 -> q 8 (zero), element 17 -> q 12
    assert deq[0, 0] == -8 and deq[0, 17] == 4 and deq[0, 1] == 0


# ---------------------------------------------------------------- matmul

def run_matmul(env, kind, n, k, x, wraw, bias=None, y0=None, geometry=(1, 1, 8, 16),
               extra=None):
    rpi, tpi, wg, vw = geometry
    t = x.shape[0]
    macros = dict(K=k, N=n, ROWS_PER_ITEM=rpi, TOKENS_PER_ITEM=tpi, WG=wg, VW=vw,
                  HAS_BIAS=bias is not None, ACCUMULATE=y0 is not None)
    macros["WEIGHT_" + kind] = True
    macros.update(extra or {})
    prg = env.build("matmul", **macros)
    yb = env.buf(y0 if y0 is not None else np.full((t, n), np.nan, np.float32))
    groups = -(-n // rpi)
    env.run(prg.matmul, (-(-groups // wg) * wg, 1), (wg, 1),
            env.buf(x), i32(0), i32(k), env.buf(wraw),
            env.buf(bias) if bias is not None else None,
            yb, i32(0), i32(n), i32(t))
    return env.read(yb, (t, n))


KINDS = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
REL = {"F32": 1e-5, "F16": 1e-4, "Q8_0": 1e-4, "Q4_0": 1e-4, "Q4_1": 1e-4, "Q5_0": 1e-4, "Q5_1": 1e-4}

MATMUL_CASES = [
    # (N, K, geometry (ROWS_PER_ITEM, TOKENS_PER_ITEM, WG, VW), bias, accumulate)
    (5, 96, (1, 1, 8, 16), False, False),        # decode defaults, N < WG
    (37, 4864, (4, 2, 8, 8), True, False),       # long K, N % 4 != 0
    (250, 896, (1, 4, 8, 16), True, True),       # cohort/prefill tile, residual add
    (1, 32, (3, 3, 2, 4), False, True),          # N = 1, odd tile sizes
    (43, 4864, (4, 4, 8, 16), True, True),       # the wide tile Intel's runtime and PoCL 3.1 run fastest
]


@pytest.mark.every_driver
@pytest.mark.parametrize("kind,case", diagonal(KINDS, range(len(MATMUL_CASES))))
def test_matmul(env, kind, case):
    n, k, geometry, has_bias, accumulate = MATMUL_CASES[case]
    wraw, wref = make_weights(kind, random_weights(case, n, k))
    r = rng(100 + case)
    bias = r.standard_normal(n).astype(np.float32) if has_bias else None
    for t in (1, 3, 67):
        x = r.standard_normal((t, k)).astype(np.float32)
        y0 = r.standard_normal((t, n)).astype(np.float32) if accumulate else None
        ref = x.astype(np.float64) @ wref.T
        if has_bias:
            ref = ref + bias
        if accumulate:
            ref = ref + y0
        got = run_matmul(env, kind, n, k, x, wraw, bias, y0, geometry)
        assert_close(got, ref, REL[kind])


@pytest.mark.every_driver
@pytest.mark.parametrize("kind", KINDS + KQUANTS)
def test_dequantize_is_exact_and_feeds_the_same_sums(env, kind):
    """matmul.cl's dequantize writes exactly the reference values (every quantized value is exact
    in float32: gguf's or the test's own decoder), and the float tile on them gives the quantized
    tile's outputs bit for bit at the same VW (llama.loom's prefill path relies on it)."""
    n, k = (19, 512) if kind in KQUANTS else (37, 96 if kind not in ("F32", "F16") else 100)
    wraw, wref = (kquant_weights(kind, n, k, 11) if kind in KQUANTS else make_weights(kind, random_weights(7, n, k)))
    prg = env.build("matmul", K=k, N=n, VW=8, **{"WEIGHT_" + kind: True})
    yb = env.buf(np.full((n, k), np.nan, np.float32))
    env.run(prg.dequantize, (-(-k // 32), n), None, env.buf(wraw), yb)
    wf = env.read(yb, (n, k))
    assert np.array_equal(wf.astype(np.float64), wref)
    x = rng(8).standard_normal((40, k)).astype(np.float32)
    quantized = run_matmul(env, kind, n, k, x, wraw, geometry=(2, 4, 8, 8))
    widened = run_matmul(env, "F32", n, k, x, wf, geometry=(4, 2, 8, 8))
    assert np.array_equal(quantized, widened)


@pytest.mark.parametrize("kind", ["F32", "F16"])
def test_matmul_k_not_multiple_of_32(env, kind):
    """F32/F16 rows of any length: the vector loop plus a scalar tail."""
    for k, geometry in ((100, (2, 2, 4, 16)), (7, (1, 1, 8, 4))):
        n = 9
        wraw, wref = make_weights(kind, random_weights(7, n, k))
        x = rng(8).standard_normal((5, k)).astype(np.float32)
        got = run_matmul(env, kind, n, k, x, wraw, geometry=geometry)
        assert_close(got, x.astype(np.float64) @ wref.T, REL[kind])


def test_matmul_geometry_does_not_change_the_answer(env):
    """Work-group geometry is a specialization: every choice computes the same Y."""
    n, k, t = 37, 96, 5
    wraw, wref = make_weights("Q8_0", random_weights(11, n, k))
    x = rng(12).standard_normal((t, k)).astype(np.float32)
    ref = x.astype(np.float64) @ wref.T
    results = []
    for geometry in ((1, 1, 8, 16), (2, 4, 8, 8), (4, 1, 1, 4), (3, 2, 16, 16)):
        got = run_matmul(env, "Q8_0", n, k, x, wraw, geometry=geometry)
        assert_close(got, ref, 1e-4)
        results.append(got)
    for got in results[1:]:
        assert_close(got, results[0], 1e-6)


@pytest.mark.parametrize("kind", some(KINDS, ("Q8_0", "Q4_0")))
def test_matmul_cohort_tails(env, kind):
    """Cohort geometries (llama.loom: 1,4,8,16 and, for K >= 4096, 2,4,8,8) and a
    wide tile: every T, so every tail width (T % TOKENS_PER_ITEM, run as one
    narrower tile) meets numpy, for a short and a long K."""
    for n, k, geometries in ((19, 96, ((1, 4, 8, 16), (2, 4, 8, 8), (1, 16, 8, 4))),
                             (11, 4864, ((2, 4, 8, 8),))):
        wraw, wref = make_weights(kind, random_weights(41, n, k))
        x = rng(42).standard_normal((18, k)).astype(np.float32)
        y0 = rng(43).standard_normal((18, n)).astype(np.float32)
        for geometry in geometries:
            for t in range(1, 19 if geometry[1] == 16 else 10):
                got = run_matmul(env, kind, n, k, x[:t], wraw, y0=y0[:t], geometry=geometry)
                assert_close(got, y0[:t] + x[:t].astype(np.float64) @ wref.T, REL[kind])


ACT_Q8_CASES = [
    # (N, K, geometry, bias, accumulate): llama.loom's T <= 2 choice, cohort and
    # prefill tiles, odd tiles, a long K
    (37, 96, (1, 1, 64, 16), False, False),
    (70, 4864, (1, 2, 64, 16), True, True),
    (19, 896, (2, 4, 8, 8), True, False),
    (5, 64, (3, 3, 2, 4), False, True),
]


@pytest.mark.every_driver
@pytest.mark.parametrize("case,kind,portable", diagonal(range(len(ACT_Q8_CASES)), ["Q8_0", "Q4_0"],
                                                       ["native", "portable"]))
def test_matmul_act_q8_matches_integer_reference(env, kind, case, portable):
    """ACT_Q8: activations quantized to int8 per block inside the kernel, integer
    block dots. Checked tightly against the numpy integer reference (only the
    float32 scaling and summation differ), every T up to 18 (all tails) for the
    first two cases; and within the rounding bound of the float product. Both
    integer dots: the AVX2 one (x86 CPUs) and the portable one (MM_PORTABLE)."""
    n, k, geometry, has_bias, accumulate = ACT_Q8_CASES[case]
    w = random_weights(60 + case, n, k)
    wraw, wref = make_weights(kind, w)
    r = rng(70 + case)
    x = r.standard_normal((18, k)).astype(np.float32)
    x[0, :QK] = 0.0                       # an all-zero activation block (d = 0)
    x[1, 5] = 40.0                        # one dominant element: most q near 0
    bias = r.standard_normal(n).astype(np.float32) if has_bias else None
    y0 = r.standard_normal((18, n)).astype(np.float32) if accumulate else None
    for t in list(range(1, 19)) if case < 2 else (1, 2, 5, 18):
        ref = act_q8_matmul(x[:t], wraw, kind, n, k)
        exact = x[:t].astype(np.float64) @ wref.T
        extra = (bias if has_bias else 0.0) + (y0[:t] if accumulate else 0.0)
        got = run_matmul(env, kind, n, k, x[:t], wraw, bias, None if y0 is None else y0[:t], geometry,
                         extra={"ACT_Q8": True, "MM_PORTABLE": portable == "portable"})
        assert_close(got - extra, ref, 2e-6)
        # against the float product: each activation is off by at most d_x / 2
        dx = quantize_activations_q8(x[:t])[1].astype(np.float64)
        bound = 0.5 * np.einsum("tb,nb->tn", dx, np.abs(wref).reshape(n, k // QK, QK).sum(-1))
        assert np.all(np.abs(got - extra - exact) <= bound + 1e-5 * np.abs(exact).max())


def test_act_q8_reference_quantizer():
    """The numpy activation quantizer on a hand-checked block: round half to even."""
    x = np.zeros((1, 32), np.float32)
    x[0, :5] = [127.0, -63.5, 0.5, 1.5, -2.5]
    q, d = quantize_activations_q8(x)
    assert d[0, 0] == np.float32(1.0)
    assert list(q[0, 0, :5]) == [127, -64, 0, 2, -2]
    assert not quantize_activations_q8(np.zeros((1, 32), np.float32))[0].any()


@pytest.mark.parametrize("kind", KINDS)
def test_matmul_subnormal_scales(env, kind):
    """Tiny weights: f16 values and block scales that are f16 subnormals."""
    n, k = 6, 64
    w = rng(31).standard_normal((n, k)).astype(np.float32) * np.float32(1e-4)
    wraw, wref = make_weights(kind, w)
    if kind == "F16":
        halves = np.abs(wraw)
    elif kind in ("Q8_0", "Q4_0"):
        block = 34 if kind == "Q8_0" else 18
        halves = np.abs(wraw.reshape(-1, block)[:, :2].copy().view(np.float16))
    elif kind in ("Q4_1", "Q5_0", "Q5_1"):
        block = {"Q4_1": 20, "Q5_0": 22, "Q5_1": 24}[kind]
        halves = np.abs(wraw.reshape(-1, block)[:, :2].copy().view(np.float16))
    if kind != "F32":  # f16 subnormals: nonzero and below the smallest normal
        assert ((halves > 0) & (halves < np.float16(6.104e-5))).mean() > 0.3
    x = rng(32).standard_normal((3, k)).astype(np.float32)
    got = run_matmul(env, kind, n, k, x, wraw, geometry=(1, 1, 8, 16))
    assert_close(got, x.astype(np.float64) @ wref.T, REL[kind])


@pytest.mark.parametrize("kind", some(["Q4_0", "Q5_0"], ("Q4_0",)))
def test_matmul_lut_unpacking_gives_the_same_bits(env, kind):
    """LUT (table lookup of a block's values, what llama.loom builds on CPUs) against the
    unpacking path at llama.loom's 16-lane geometries and every tail width: the same
    outputs bit for bit (a reply must not depend on the driver's unpacking), and numpy's.
    Blocks with zero, subnormal and large scales, and every nibble and fifth bit."""
    n, k = 29, 896
    w = random_weights(51, n, k)
    w[2] *= np.float32(1e-4)                                  # f16-subnormal block scales
    w[3] *= np.float32(1e3)
    wraw, wref = make_weights(kind, w)
    x = rng(52).standard_normal((19, k)).astype(np.float32)
    y0 = rng(53).standard_normal((19, n)).astype(np.float32)
    for geometry, ts in (((1, 1, 8, 16), (1, 2, 5)), ((1, 4, 8, 16), (3, 4, 7)),
                         ((1, 8, 8, 16), (8, 11, 15)), ((4, 4, 8, 16), (16, 19))):
        for t in ts:
            plain = run_matmul(env, kind, n, k, x[:t], wraw, y0=y0[:t], geometry=geometry)
            lut = run_matmul(env, kind, n, k, x[:t], wraw, y0=y0[:t], geometry=geometry, extra=dict(LUT=1))
            assert np.array_equal(lut.view(np.uint32), plain.view(np.uint32)), (geometry, t)
            assert_close(lut, y0[:t] + x[:t].astype(np.float64) @ wref.T, REL[kind])


def test_matmul_views_and_token_split(env):
    """x_off/ldx and y_off/ldy address column slices of wider buffers, and a
    second global dimension G1 > 1 splits tokens across work-items."""
    n, k, t = 12, 64, 7
    wraw, wref = make_weights("F32", random_weights(21, n, k))
    xfull = rng(22).standard_normal((t, k + 10)).astype(np.float32)
    yfull = rng(23).standard_normal((t, n + 6)).astype(np.float32)
    prg = env.build("matmul", K=k, N=n, WEIGHT_F32=True, ROWS_PER_ITEM=1,
                    TOKENS_PER_ITEM=2, WG=4, VW=8, ACCUMULATE=True)
    yb = env.buf(yfull)
    env.run(prg.matmul, (12, 3), (4, 1), env.buf(xfull), i32(10), i32(k + 10),
            env.buf(wraw), None, yb, i32(6), i32(n + 6), i32(t))
    got = env.read(yb, yfull.shape)
    ref = yfull.astype(np.float64).copy()
    ref[:, 6:] += xfull[:, 10:].astype(np.float64) @ wref.T
    assert_close(got, ref, 1e-5)


CAT_CASES = [
    # (row counts of the matrices, geometry, bias, accumulate): llama.loom's q|k|v at decode,
    # a cohort tile, the wide prefill tile; gate|up (two matrices); one row per matrix
    ((24, 8, 8), (1, 1, 8, 16), False, False),
    ((24, 8, 8), (1, 4, 8, 16), True, False),
    ((12, 4, 8), (4, 4, 8, 16), True, True),
    ((20, 20), (1, 8, 8, 16), False, False),
    ((1, 1, 1), (1, 2, 2, 8), True, False),
]


@pytest.mark.parametrize("kind,case", [p if p.values[0] in ("F16", "Q8_0", "Q5_1", "Q4_K", "Q6_K") else
                                       pytest.param(*p.values, marks=pytest.mark.full)
                                       for p in diagonal(KINDS + ["Q4_K", "Q6_K"], range(len(CAT_CASES)))])
def test_matmul_cat_gives_each_matrix_its_own_bits(env, kind, case):
    """matmul_cat over [W0; W1; W2] read where each lies (llama.loom's one q|k|v and gate|up
    launch): every output column is the bits matmul gives for that matrix alone at the same
    geometry, written side by side into a view of a wider buffer (y_off, ldy), and meets numpy."""
    rows, geometry, has_bias, accumulate = CAT_CASES[case]
    k = 512 if kind in KQUANTS else 96
    mats = [kquant_weights(kind, n, k, 80 + i) if kind in KQUANTS else make_weights(kind, random_weights(80 + i, n, k))
            for i, n in enumerate(rows)]
    r = rng(90 + case)
    biases = [r.standard_normal(n).astype(np.float32) for n in rows]
    n_all = sum(rows)
    rpi, tpi, wg, vw = geometry
    macros = dict(K=k, N=n_all, N0=rows[0], ROWS_PER_ITEM=rpi, TOKENS_PER_ITEM=tpi, WG=wg, VW=vw,
                  HAS_BIAS=has_bias, ACCUMULATE=accumulate, LUT=1, **{"WEIGHT_" + kind: True})
    if len(rows) == 3:
        macros["N1"] = rows[1]
    prg = env.build("matmul", **macros)
    for t in (1, 3, 19):
        x = r.standard_normal((t, k)).astype(np.float32)
        wide = r.standard_normal((t, n_all + 7)).astype(np.float32)      # y_off 5, two spare columns
        yb = env.buf(wide)
        ws = [env.buf(raw) for raw, _ in mats] + [None] * (3 - len(rows))
        bs = [env.buf(b) for b in biases] + [None] * (3 - len(rows))
        groups = -(-n_all // rpi)
        env.run(prg.matmul_cat, (-(-groups // wg) * wg, 1), (wg, 1), env.buf(x), i32(0), i32(k),
                *ws, *(bs if has_bias else [None] * 3), yb, i32(5), i32(n_all + 7), i32(t))
        got = env.read(yb, wide.shape)
        assert np.array_equal(got[:, :5], wide[:, :5]) and np.array_equal(got[:, 5 + n_all:], wide[:, 5 + n_all:])
        col = 5
        for (raw, ref), n, b in zip(mats, rows, biases):
            y0 = wide[:, col:col + n].copy() if accumulate else None
            alone = run_matmul(env, kind, n, k, x, raw, b if has_bias else None, y0, geometry, extra=dict(LUT=1))
            assert np.array_equal(got[:, col:col + n].view(np.uint32), alone.view(np.uint32)), (n, t)
            want = x.astype(np.float64) @ ref.T + (b if has_bias else 0.0) + (y0 if accumulate else 0.0)
            assert_close(got[:, col:col + n], want, REL.get(kind, 1e-4))
            col += n


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_matmul_cat_with_int8_activations(env, kind):
    """ACT_Q8 (the package's int8_activations option) through matmul_cat: each matrix's
    columns equal matmul's for it alone (work-groups straddling two matrices quantize the
    same activations)."""
    rows, k = (40, 24, 24), 96
    mats = [make_weights(kind, random_weights(95 + i, n, k))[0] for i, n in enumerate(rows)]
    x = rng(96).standard_normal((2, k)).astype(np.float32)
    prg = env.build("matmul", K=k, N=sum(rows), N0=rows[0], N1=rows[1], ROWS_PER_ITEM=1, TOKENS_PER_ITEM=2,
                    WG=64, ACT_Q8=True, **{"WEIGHT_" + kind: True})
    yb = env.buf(np.full((2, sum(rows)), np.nan, np.float32))
    env.run(prg.matmul_cat, (128, 1), (64, 1), env.buf(x), i32(0), i32(k), *[env.buf(m) for m in mats],
            None, None, None, yb, i32(0), i32(sum(rows)), i32(2))
    got = env.read(yb, (2, sum(rows)))
    col = 0
    for raw, n in zip(mats, rows):
        alone = run_matmul(env, kind, n, k, x, raw, geometry=(1, 2, 64, 16), extra={"ACT_Q8": True})
        assert np.array_equal(got[:, col:col + n], alone)
        col += n


def test_matmul_cat_rows_must_fit_the_tile(env):
    with pytest.raises(cl.RuntimeError) as e:
        env.build("matmul", K=64, N=12, N0=6, ROWS_PER_ITEM=4, WEIGHT_F32=True)
    assert "multiples of ROWS_PER_ITEM" in str(e.value)


@pytest.mark.parametrize("kind", some(KINDS + ["Q4_K"], ("F16", "Q5_0", "Q4_K")))
def test_matmul_more_accumulators_than_a_block_has_vectors(env, kind):
    """ACCS 4 at VW 16 (llama.loom's decode): two blocks a loop step where K allows
    (K % 64 == 0), the plain loop where it does not; numpy either way."""
    for n, k in ((13, 896), (13, 96)) if kind not in KQUANTS else ((13, 512),):
        if kind == "Q4_K":
            wraw, wref = kquant_weights(kind, n, k, 97)
        else:
            wraw, wref = make_weights(kind, random_weights(97, n, k))
        x = rng(98).standard_normal((2, k)).astype(np.float32)
        for geometry in ((1, 1, 8, 16), (1, 1, 8, 8)):
            got = run_matmul(env, kind, n, k, x[:1], wraw, geometry=geometry, extra=dict(ACCS=4, LUT=1))
            assert_close(got, x[:1].astype(np.float64) @ wref.T, REL.get(kind, 1e-4))


# ---------------------------------------------------------------- Q4_0 in tiles of 16 rows (ROW_TILE)

def tiled16(raw, n, kind):
    """A matrix as llama.loom's tiled(0, 16) params hold it: runtime.tile_blocks for block
    formats, runtime.tile for F16 ([N/16][K][16] halves)."""
    return tile(raw, 0, 16) if kind == "F16" else tile_blocks(raw, n, kind, 16)


def run_row_tiles(env, kind, n, k, x, raw, tpi, bias=None, y0=None, ldy=None, extra=None, split=1):
    """matmul with ROW_TILE 16 on raw rows laid out as llama.loom's tiled(0, 16) params
    are (tiled16): one work-item a tile (and token tiles shared among `split` items along
    dim 1), Y as a view (y_off 3, ldy) of a wider buffer whose other columns must come back
    untouched."""
    t = x.shape[0]
    ldy = ldy or n + 5
    wide = rng(7).standard_normal((t, ldy)).astype(np.float32)
    if y0 is not None:
        wide[:, 3:3 + n] = y0
    prg = env.build("matmul", K=k, N=n, ROW_TILE=16, TOKENS_PER_ITEM=tpi, WG=8, **{"WEIGHT_" + kind: True},
                    HAS_BIAS=bias is not None, ACCUMULATE=y0 is not None, **(extra or {}))
    yb = env.buf(wide)
    tiles = -(-n // 16)
    env.run(prg.matmul, (-(-tiles // 8) * 8, split), (8, 1), env.buf(x), i32(0), i32(k),
            env.buf(tiled16(raw, n, kind)), env.buf(bias) if bias is not None else None,
            yb, i32(3), i32(ldy), i32(t))
    got = env.read(yb, wide.shape)
    assert np.array_equal(got[:, :3], wide[:, :3]) and np.array_equal(got[:, 3 + n:], wide[:, 3 + n:])
    return got[:, 3:3 + n]


@pytest.mark.parametrize("kind,shape", diagonal(["Q4_0", "Q5_0", "Q4_1"], [(37, 896), (5, 4864)]))
def test_matmul_row_tiles_meet_numpy(env, kind, shape):
    """Q4_0, Q5_0 and Q4_1 held in tiles of 16 rows: decode (one token, u * x summed per
    block and scaled once), cohort and prefill tiles of 4 and 8 tokens with every tail width, bias
    and residual add, and a last tile of padding rows that is computed but never stored."""
    n, k = shape
    raw, ref = make_weights(kind, random_weights(60, n, k))
    r = rng(61)
    x = r.standard_normal((19, k)).astype(np.float32)
    bias = r.standard_normal(n).astype(np.float32)
    y0 = r.standard_normal((19, n)).astype(np.float32)
    want = x.astype(np.float64) @ ref.T
    for tpi, ts in ((1, (1, 2)), (4, range(1, 10)), (8, (1, 7, 8, 9, 16, 19))):
        for t in ts:
            got = run_row_tiles(env, kind, n, k, x[:t], raw, tpi, bias=bias, y0=y0[:t])
            assert_close(got, want[:t] + bias + y0[:t], REL[kind])
            if tpi == 8:        # the plain store (no bias, no residual) once per width
                assert_close(run_row_tiles(env, kind, n, k, x[:t], raw, tpi), want[:t], REL[kind])


@pytest.mark.parametrize("shape", some([(37, 896), (5, 4864), (21, 37)], ((37, 896), (21, 37))))
def test_matmul_f16_tiles_meet_numpy(env, shape):
    """F16 held in tiles of 16 rows (outer products, RT_F16): one token (two chains, K odd
    too), tiles of 6 tokens with every tail width, bias and residual add, token tiles split
    between two work-items (dim 1), and a last tile of padding rows never stored."""
    n, k = shape
    raw, ref = make_weights("F16", random_weights(64, n, k))
    r = rng(65)
    x = r.standard_normal((19, k)).astype(np.float32)
    bias = r.standard_normal(n).astype(np.float32)
    y0 = r.standard_normal((19, n)).astype(np.float32)
    want = x.astype(np.float64) @ ref.T
    for tpi, ts in ((1, (1, 2)), (6, range(1, 14))):
        for t in ts:
            got = run_row_tiles(env, "F16", n, k, x[:t], raw, tpi, bias=bias, y0=y0[:t])
            assert_close(got, want[:t] + bias + y0[:t], REL["F16"])
    for t in (1, 7, 12, 19):
        assert_close(run_row_tiles(env, "F16", n, k, x[:t], raw, 6, split=2), want[:t], REL["F16"])


@pytest.mark.parametrize("kind", some(["Q4_0", "Q5_0", "Q4_1", "F16"], ("Q4_1", "F16")))
def test_matmul_cat_row_tiles_give_each_matrix_its_own_bits(env, kind):
    """matmul_cat over three tiled matrices (q|k|v): each output column is the bits matmul
    gives for its matrix alone."""
    rows, k = (32, 16, 16), 96
    mats = [make_weights(kind, random_weights(70 + i, n, k)) for i, n in enumerate(rows)]
    x = rng(73).standard_normal((9, k)).astype(np.float32)
    for tpi, t in ((1, 1), (8, 9)):
        prg = env.build("matmul", K=k, N=sum(rows), N0=rows[0], N1=rows[1], ROW_TILE=16, TOKENS_PER_ITEM=tpi,
                        WG=8, **{"WEIGHT_" + kind: True})
        yb = env.buf(np.full((t, sum(rows)), np.nan, np.float32))
        env.run(prg.matmul_cat, (8, 1), (8, 1), env.buf(x[:t]), i32(0), i32(k),
                *[env.buf(tiled16(raw, n, kind)) for (raw, _), n in zip(mats, rows)],
                None, None, None, yb, i32(0), i32(sum(rows)), i32(t))
        got = env.read(yb, (t, sum(rows)))
        col = 0
        for (raw, ref), n in zip(mats, rows):
            alone = run_row_tiles(env, kind, n, k, x[:t], raw, tpi)
            assert np.array_equal(got[:, col:col + n].view(np.uint32), alone.view(np.uint32))
            assert_close(got[:, col:col + n], x[:t].astype(np.float64) @ ref.T, REL[kind])
            col += n


def rms_normed(x, g, eps):
    """rms_norm.cl's output in float64: x / sqrt(mean(x^2) + eps) * g per row."""
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * g


@pytest.mark.parametrize("kind", ["Q4_0", "F16"])
def test_matmul_norm_in_groups_of_4_give_the_bits_of_groups_of_8(env, kind):
    """Decode's small projections run work-groups of 4 tiles (both cores busy): NORM_IN's
    sum of squares is the same 8 partial sums in the same order, so the same bits."""
    n, k = 100, 896
    raw, _ = make_weights(kind, random_weights(83, n, k))
    x = (rng(84).standard_normal((1, k)) * 3 + 0.5).astype(np.float32)
    g = rng(85).uniform(0.5, 1.5, k).astype(np.float32)
    got = {}
    for wg in (4, 8):
        prg = env.build("matmul", K=k, N=n, ROW_TILE=16, TOKENS_PER_ITEM=1, WG=wg, NORM_IN=True,
                        **{"WEIGHT_" + kind: True})
        yb = env.buf(np.zeros((1, n), np.float32))
        env.run(prg.matmul, (-(-n // (16 * wg)) * wg, 1), (wg, 1), env.buf(x), i32(0), i32(k),
                env.buf(tiled16(raw, n, kind)), None, yb, i32(0), i32(n), i32(1), env.buf(g), f32(1e-6))
        got[wg] = env.read(yb, (1, n))
    assert np.array_equal(got[4].view(np.uint32), got[8].view(np.uint32))
    with pytest.raises(Exception) as e:
        env.build("matmul", K=k, N=n, ROW_TILE=16, TOKENS_PER_ITEM=1, WG=16, NORM_IN=True, WEIGHT_F16=True)
    assert "NORM_IN needs WG <= 8" in str(e.value)


@pytest.mark.parametrize("kind,shape", diagonal(["Q4_0", "Q5_0", "Q4_1", "F16"], [(37, 896), (16, 96)]))
def test_matmul_norm_in_tiles_meet_rms_norm_then_numpy(env, kind, shape):
    """NORM_IN (decode's q|k|v and the head): each token's input row RMS-normed inside the
    tile, as rms_norm.cl then matmul would (numpy in float64), with bias and residual,
    tokens one at a time, padding rows never stored, the other columns of Y untouched; and
    matmul_cat passes the norm to every matrix (each column the bits of its matrix alone)."""
    n, k = shape
    raw, ref = make_weights(kind, random_weights(80, n, k))
    r = rng(81)
    x = (r.standard_normal((3, k)) * 3 + 0.5).astype(np.float32)
    g = r.uniform(0.5, 1.5, k).astype(np.float32)
    bias = r.standard_normal(n).astype(np.float32)
    y0 = r.standard_normal((3, n)).astype(np.float32)
    eps = 1e-6
    want = rms_normed(x, g, eps) @ ref.T
    ldy = n + 5
    for t in (1, 3):
        for b, y in ((None, None), (bias, y0[:t])):
            wide = rng(7).standard_normal((t, ldy)).astype(np.float32)
            if y is not None:
                wide[:, 3:3 + n] = y
            prg = env.build("matmul", K=k, N=n, ROW_TILE=16, TOKENS_PER_ITEM=1, WG=8, NORM_IN=True,
                            HAS_BIAS=b is not None, ACCUMULATE=y is not None, **{"WEIGHT_" + kind: True})
            yb = env.buf(wide)
            env.run(prg.matmul, (-(-n // 128) * 8, 1), (8, 1), env.buf(x[:t]), i32(0), i32(k),
                    env.buf(tiled16(raw, n, kind)), env.buf(b) if b is not None else None,
                    yb, i32(3), i32(ldy), i32(t), env.buf(g), f32(eps))
            got = env.read(yb, wide.shape)
            assert np.array_equal(got[:, :3], wide[:, :3]) and np.array_equal(got[:, 3 + n:], wide[:, 3 + n:])
            extra = (0 if b is None else b) + (0 if y is None else y)
            assert_close(got[:, 3:3 + n], want[:t] + extra, REL[kind])
    # as the unfused path computes it: rms_norm.cl, then the tile on its output
    normed = rms_normed(x, g, eps).astype(np.float32)
    assert_close(got[:, 3:3 + n], run_row_tiles(env, kind, n, k, normed, raw, 1) + bias + y0, 1e-5)
    rows = (32, 16, 16)
    mats = [make_weights(kind, random_weights(82 + i, m, k)) for i, m in enumerate(rows)]
    prg = env.build("matmul", K=k, N=sum(rows), N0=rows[0], N1=rows[1], ROW_TILE=16, TOKENS_PER_ITEM=1,
                    WG=8, NORM_IN=True, **{"WEIGHT_" + kind: True})
    yb = env.buf(np.full((3, sum(rows)), np.nan, np.float32))
    env.run(prg.matmul_cat, (8, 1), (8, 1), env.buf(x), i32(0), i32(k),
            *[env.buf(tiled16(m_raw, m, kind)) for (m_raw, _), m in zip(mats, rows)],
            None, None, None, yb, i32(0), i32(sum(rows)), i32(3), env.buf(g), f32(eps))
    got = env.read(yb, (3, sum(rows)))
    col = 0
    alone_prg = {}
    for (m_raw, m_ref), m in zip(mats, rows):
        alone_prg = env.build("matmul", K=k, N=m, ROW_TILE=16, TOKENS_PER_ITEM=1, WG=8, NORM_IN=True,
                              **{"WEIGHT_" + kind: True})
        ab = env.buf(np.zeros((3, m), np.float32))
        env.run(alone_prg.matmul, (8, 1), (8, 1), env.buf(x), i32(0), i32(k), env.buf(tiled16(m_raw, m, kind)),
                None, ab, i32(0), i32(m), i32(3), env.buf(g), f32(eps))
        assert np.array_equal(got[:, col:col + m].view(np.uint32), env.read(ab, (3, m)).view(np.uint32))
        assert_close(got[:, col:col + m], rms_normed(x, g, eps) @ m_ref.T, REL[kind])
        col += m


@pytest.mark.parametrize("kind", some(["Q4_0", "Q5_0", "Q4_1", "F16"], ("Q4_0", "Q4_1")))
def test_matmul_glu_is_silu_gate_times_up(env, kind):
    """matmul_glu (decode's feed-forward): silu(x W0^T) * (x W1^T) from tiles of both
    matrices in one launch, with and without NORM_IN, against numpy; padding rows and
    the columns past N never written."""
    n, k = 37, 896
    (raw0, ref0), (raw1, ref1) = (make_weights(kind, random_weights(90 + i, n, k)) for i in range(2))
    r = rng(92)
    x = (r.standard_normal((2, k)) * 2).astype(np.float32)
    g = r.uniform(0.5, 1.5, k).astype(np.float32)
    eps = 1e-5
    for norm in (False, True):
        inputs = rms_normed(x, g, eps) if norm else x.astype(np.float64)
        gate, up = inputs @ ref0.T, inputs @ ref1.T
        want = gate / (1 + np.exp(-gate)) * up
        prg = env.build("matmul", K=k, N=n, ROW_TILE=16, TOKENS_PER_ITEM=1, WG=8, GLU=True, NORM_IN=norm,
                        **{"WEIGHT_" + kind: True})
        for t in (1, 2):
            yb = env.buf(np.full((t, n + 3), np.nan, np.float32))
            env.run(prg.matmul_glu, (8, 1), (8, 1), env.buf(x[:t]), i32(0), i32(k),
                    env.buf(tiled16(raw0, n, kind)), env.buf(tiled16(raw1, n, kind)),
                    yb, i32(0), i32(n + 3), i32(t), *((env.buf(g), f32(eps)) if norm else ()))
            got = env.read(yb, (t, n + 3))
            assert np.isnan(got[:, n:]).all()
            assert_close(got[:, :n], want[:t], 3 * REL[kind])


@pytest.mark.parametrize("macros", [dict(NORM_IN=True, TOKENS_PER_ITEM=8), dict(GLU=True),
                                    dict(NORM_IN=True, ROW_TILE=16, TOKENS_PER_ITEM=8)])
def test_matmul_norm_in_and_glu_need_one_token_row_tiles(env, macros):
    with pytest.raises(cl.RuntimeError) as e:
        env.build("matmul", K=64, N=16, WEIGHT_Q4_0=True, **macros)
    assert "NORM_IN and GLU need ROW_TILE, TOKENS_PER_ITEM 1 and float inputs" in str(e.value)


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0", "Q4_1"])
def test_dequantize_row_tiles_is_exact(env, kind):
    """dequantize reads the tiled layout back to rows: exactly the reference values, the
    padding rows of the last tile never written."""
    n, k = 37, 96
    raw, ref = make_weights(kind, random_weights(75, n, k))
    prg = env.build("matmul", K=k, N=n, VW=8, ROW_TILE=16, **{"WEIGHT_" + kind: True})
    yb = env.buf(np.full((n + 1, k), np.nan, np.float32))
    env.run(prg.dequantize, (k // 32, n), None, env.buf(tile_blocks(raw, n, kind, 16)), yb)
    got = env.read(yb, (n + 1, k))
    assert np.array_equal(got[:n].astype(np.float64), ref) and np.isnan(got[n]).all()


# ------------------------------------------ tiles by int8 dot products (INT8_DOT, quantize_x)

def quantize_rows(env, kind, x):
    """quantize_x's output for x [T, K] (INT8_DOT programs: Intel's runtime on VNNI CPUs)."""
    t, k = x.shape
    prg = env.build("matmul", K=k, N=16, ROW_TILE=16, TOKENS_PER_ITEM=8, INT8_DOT=1, **{"WEIGHT_" + kind: True})
    xb = env.buf(np.pad(x, ((0, 0), (0, 3)), constant_values=np.nan))      # ldx K + 3: the pad is never read
    qb = env.buf(np.full((t, k // 32, 20), -1, np.int32))
    env.run(prg.quantize_x, (k // 32, t), None, xb, i32(k + 3), qb, i32(t))
    return env.read(qb, (t, k // 32, 20), np.int32)


def dequantized_inputs(q):
    """x^ = s (h + l / 256) from quantize_x's blocks, in float64."""
    digits = q[..., :16].copy().view(np.int8).astype(np.float64)      # [T, blocks, 64]: h then l
    scale = q[..., 16].copy().view(np.float32).astype(np.float64)[..., None]
    xhat = scale * (digits[..., :32] + digits[..., 32:] / 256.0)
    return xhat.reshape(q.shape[0], -1)


def assert_digit_sums(q):
    """quantize_x's sums beside the digits: q[17] sum(h), q[18] sum(l) over the block, q[19]
    those of its first 16 values as int16 halves (low: h)."""
    digits = q[..., :16].copy().view(np.int8).astype(np.int64)       # h then l
    assert np.array_equal(q[..., 17], digits[..., :32].sum(axis=-1))
    assert np.array_equal(q[..., 18], digits[..., 32:].sum(axis=-1))
    first = q[..., 19].astype(np.int64)
    assert np.array_equal(((first & 0xFFFF) ^ 0x8000) - 0x8000, digits[..., :16].sum(axis=-1))
    assert np.array_equal(first >> 16, digits[..., 32:48].sum(axis=-1))


def needs_int8_dot(env):
    if not env.info.get("int8_dot"):
        pytest.skip("int8 dot products need Intel's runtime on an AVX2 or AVX512-VNNI CPU (device.int8_dot)")


def test_quantize_x_folds_in_the_norm_or_the_gate(env):
    """QX_NORM: the rows RMS-normed first (rms_norm.cl's (x / rms) g, one work-group a token);
    QX_GLU: gate | up rows in, silu(gate) up quantized (silu_mul's). Either way the digits
    are the plain quantize_x's of those values computed apart (numpy, float32), but for a
    value whose rounding lands the other side of a digit (one l step: s / 256), and the
    digits' sums stand beside them."""
    needs_int8_dot(env)
    r = rng(95)
    t, k = 5, 896
    x = (r.standard_normal((t, k)) * 4 + 1).astype(np.float32)
    g = r.uniform(0.5, 1.5, k).astype(np.float32)
    eps = 1e-6
    gu = (r.standard_normal((t, 2 * k)) * 3).astype(np.float32)
    gate, up = gu[:, :k].astype(np.float64), gu[:, k:].astype(np.float64)
    common = dict(K=k, N=16, ROW_TILE=16, TOKENS_PER_ITEM=8, INT8_DOT=1, WEIGHT_Q4_0=True)
    for macro, inputs, args, local, want in (
            ("QX_NORM", x, (i32(k),), (k // 32, 1), rms_normed(x, g, eps)),
            ("QX_GLU", gu, (i32(2 * k),), None, gate / (1 + np.exp(-gate)) * up)):
        prg = env.build("matmul", **{macro: True}, **common)
        qb = env.buf(np.full((t, k // 32, 20), -1, np.int32))
        extra = (env.buf(g), f32(eps)) if macro == "QX_NORM" else ()
        env.run(prg.quantize_x, (k // 32, t), local, env.buf(inputs), *args, qb, i32(t), *extra)
        q = env.read(qb, (t, k // 32, 20), np.int32)
        apart = quantize_rows(env, "Q4_0", want.astype(np.float32))
        scale = apart[..., 16].copy().view(np.float32).astype(np.float64)[..., None]
        assert np.allclose(q[..., 16].copy().view(np.float32), apart[..., 16].copy().view(np.float32), rtol=1e-5)
        diff = np.abs(dequantized_inputs(q) - dequantized_inputs(apart)).reshape(t, k // 32, 32)
        assert (diff <= scale / 256 * (1 + 1e-3)).all(), macro
        assert_digit_sums(q)


@pytest.mark.parametrize("x16", [0, 1])
@pytest.mark.parametrize("t", [1, 3])
def test_matmul_qx_tail_writes_the_next_inputs_as_quantize_x_would(env, t, x16):
    """QX_TAIL: the launch's last work-group quantizes its output rows for the next
    projection. 1: a residual projection's rows RMS-normed (quantize_x's QX_NORM on that
    output), 2: gate | up rows as silu(gate) up (QX_GLU): the digits to the bit, the
    projection's own outputs the plain kernel's bits, and the count of finished groups
    back at 0 after each launch (a second launch finds it so). Several work-groups, the
    last one partly past N (items there store nothing but reach the tail's barriers)."""
    needs_int8_dot(env)
    r = rng(98)
    k, eps = 896, 1e-6
    q = quantize_rows(env, "Q4_0", r.standard_normal((t, k)).astype(np.float32))
    quant = dict(K=k, ROW_TILE=16, TOKENS_PER_ITEM=1, WG=8, INT8_DOT=1, WEIGHT_Q4_0=True, DOT16=x16)
    for tail, n in ((1, 416), (2, 2 * 416)):
        raw, _ = make_weights("Q4_0", random_weights(99 + tail, n, k))
        wb = env.buf(tiled16(raw, n, "Q4_0"))
        y0 = r.standard_normal((t, n)).astype(np.float32) * 3
        g = r.uniform(0.5, 1.5, n).astype(np.float32)
        qk = n if tail == 1 else n // 2
        grid = (-(-(n // 16) // 8) * 8, 1)

        def launch(prg, yb, tail_args):
            if tail == 1:
                env.run(prg.matmul, grid, (8, 1), env.buf(q), i32(0), i32(k), wb, None, yb, i32(0), i32(n), i32(t),
                        *tail_args)
            else:       # gate | up: one matrix's halves as W0 and W1
                half = tiled16(raw, n, "Q4_0")
                w0, w1 = env.buf(half[:len(half) // 2]), env.buf(half[len(half) // 2:])
                env.run(prg.matmul_cat, grid, (8, 1), env.buf(q), i32(0), i32(k), w0, w1, w1, None, None, None,
                        yb, i32(0), i32(n), i32(t), *tail_args)

        extra = dict(ACCUMULATE=tail == 1, **({} if tail == 1 else dict(N0=n // 2)))
        plain = env.buf(y0)
        launch(env.build("matmul", N=n, **quant, **extra), plain, ())
        fused = env.build("matmul", N=n, **quant, **extra, QX_TAIL=tail, QX_K=qk, QX_X16=x16)
        done = env.buf(np.zeros(1, np.int32))
        for _ in range(2):
            yb = env.buf(y0)
            xqb = env.buf(np.full((t, qk // 32, 20), -1, np.int32))
            launch(fused, yb, (xqb, env.buf(g), f32(eps), done) if tail == 1 else (xqb, done))
            y = env.read(yb, (t, n))
            assert np.array_equal(y.view(np.uint32), env.read(plain, (t, n)).view(np.uint32)), tail
            assert env.read(done, (1,), np.int32)[0] == 0
            apart = env.build("matmul", **dict(quant, K=qk), N=16, **{"QX_NORM" if tail == 1 else "QX_GLU": True})
            want = env.buf(np.full((t, qk // 32, 20), -1, np.int32))
            if tail == 1:
                env.run(apart.quantize_x, (qk // 32, t), (qk // 32, 1), env.buf(y), i32(n), want, i32(t),
                        env.buf(g), f32(eps))
            else:
                env.run(apart.quantize_x, (qk // 32, t), None, env.buf(y), i32(n), want, i32(t))
            got = env.read(xqb, (t, qk // 32, 20), np.int32)
            assert np.array_equal(got, env.read(want, (t, qk // 32, 20), np.int32)), tail


@pytest.mark.parametrize("macros, message", [
    (dict(QX_TAIL=1, QX_K=32), "QX_TAIL needs INT8_DOT"),
    (dict(QX_TAIL=1, QX_K=16, INT8_DOT=1), "QX_TAIL quantizes Y's N columns"),
    (dict(QX_TAIL=2, QX_K=32, INT8_DOT=1), "QX_TAIL quantizes Y's N columns")])
def test_matmul_qx_tail_needs_int8_dot_and_whole_blocks(env, macros, message):
    with pytest.raises(cl.RuntimeError) as e:
        env.build("matmul", K=64, N=32, WEIGHT_Q4_0=True, ROW_TILE=16, QX_X16=0, **macros)
    assert message in str(e.value)


def test_quantize_x_holds_each_value_in_two_int8_digits(env):
    """Per block of 32: s = max|x| / 127, h = round(x / s), l = round((x - h s) 256 / s) in
    [-127, 127], so |x - s (h + l / 256)| <= s / 512; the digits' sums beside them, and the
    first 16 values' sums as two int16 halves of q[19]; a zero block all zeros."""
    needs_int8_dot(env)
    r = rng(90)
    x = (r.standard_normal((3, 128)) * np.array([1.0, 1e-3, 50.0])[:, None]).astype(np.float32)
    x[1, 32:64] = 0.0
    x[2, 64] = 6e4                          # one large value beside small ones
    q = quantize_rows(env, "Q4_0", x)
    digits = q[..., :16].copy().view(np.int8).astype(np.int64)
    scale = q[..., 16].copy().view(np.float32).astype(np.float64)
    blocks = x.reshape(3, 4, 32).astype(np.float64)
    assert np.allclose(scale, np.abs(blocks).max(axis=2) / 127, rtol=1e-6, atol=0)
    assert np.abs(digits).max() <= 127
    assert_digit_sums(q)
    assert (q[1, 1] == 0).all()
    err = np.abs(dequantized_inputs(q).reshape(3, 4, 32) - blocks)
    assert (err <= scale[..., None] / 512 * (1 + 1e-5) + 1e-30).all()


@pytest.mark.parametrize("kind", some(["Q4_0", "Q5_0", "Q4_1"], ("Q4_0", "Q5_0")))
def test_matmul_int8_dot_tiles_meet_numpy(env, kind):
    """INT8_DOT tiles of 2, 4 and 8 tokens at every tail width, bias and residual: the
    quantized inputs' products exactly as float64 numpy forms them from the same digits
    (to float32 rounding), and within 1e-4 of the float products."""
    needs_int8_dot(env)
    n, k = 37, 896
    raw, ref = make_weights(kind, random_weights(91, n, k))
    r = rng(92)
    x = r.standard_normal((19, k)).astype(np.float32)
    bias = r.standard_normal(n).astype(np.float32)
    y0 = r.standard_normal((19, n)).astype(np.float32)
    q = quantize_rows(env, kind, x)
    exact = dequantized_inputs(q) @ ref.T
    want = x.astype(np.float64) @ ref.T
    qb = env.buf(q)
    for tpi, ts in ((2, (1, 2, 3)), (4, (1, 3, 4, 9)), (8, (1, 7, 8, 9, 16, 19))):
        for t in ts:
            got = run_row_tiles(env, kind, n, k, q[:t], raw, tpi, bias=bias, y0=y0[:t], extra=dict(INT8_DOT=1))
            assert_close(got, exact[:t] + bias + y0[:t], 2e-6)
            assert_close(got, want[:t] + bias + y0[:t], REL[kind])
    plain = run_row_tiles(env, kind, n, k, q, raw, 8, extra=dict(INT8_DOT=1))
    assert_close(plain, exact, 2e-6)
    del qb


@pytest.mark.parametrize("kind", some(["Q4_0", "Q5_0", "Q4_1"], ("Q4_0",)))
def test_matmul_int8_dot_tiles_hold_the_largest_sums(env, kind):
    """Weights at their largest digits (15, Q5_0 31) against inputs whose two int8 digits
    are both near 127, of either sign: sums at the bounds the integer lanes hold (AVX2 adds
    vpmaddubsw pairs in int16 first), still exactly the products of the digits."""
    needs_int8_dot(env)
    n, k = 16, 896
    top = {"Q4_0": 7 / 8, "Q5_0": 15 / 16, "Q4_1": 1.0}[kind]
    w = np.full((n, k), top, np.float32)
    w[:, ::32] = -1.0 if kind != "Q4_1" else 0.0   # the block's signed max: the others at the top digit
    raw, ref = make_weights(kind, w)
    x = np.ones((4, k), np.float32)
    x[:, 31::32] = 1.004                           # x / s = 126.49: h = 126, l = 126
    x[1::2] *= -1
    q = quantize_rows(env, kind, x)
    digits = np.abs(q[..., :16].copy().view(np.int8).astype(np.int64))    # h then l; the block's max is 127, 0
    assert (digits[..., :31] >= 125).all() and (digits[..., 32:63] >= 125).all()
    got = run_row_tiles(env, kind, n, k, q, raw, 4, extra=dict(INT8_DOT=1))
    assert_close(got, dequantized_inputs(q) @ ref.T, 2e-6)


@pytest.mark.parametrize("kind", some(["Q4_0", "Q5_0"], ("Q4_0",)))
def test_matmul_cat_int8_dot_tiles_give_each_matrix_its_own_bits(env, kind):
    needs_int8_dot(env)
    rows, k = (32, 16, 16), 96
    mats = [make_weights(kind, random_weights(80 + i, n, k)) for i, n in enumerate(rows)]
    q = quantize_rows(env, kind, rng(83).standard_normal((9, k)).astype(np.float32))
    prg = env.build("matmul", K=k, N=sum(rows), N0=rows[0], N1=rows[1], ROW_TILE=16, TOKENS_PER_ITEM=8,
                    WG=8, INT8_DOT=1, **{"WEIGHT_" + kind: True})
    yb = env.buf(np.full((9, sum(rows)), np.nan, np.float32))
    env.run(prg.matmul_cat, (8, 1), (8, 1), env.buf(q), i32(0), i32(k),
            *[env.buf(tile_blocks(raw, n, kind, 16)) for (raw, _), n in zip(mats, rows)],
            None, None, None, yb, i32(0), i32(sum(rows)), i32(9))
    got = env.read(yb, (9, sum(rows)))
    col = 0
    for (raw, ref), n in zip(mats, rows):
        alone = run_row_tiles(env, kind, n, k, q, raw, 8, extra=dict(INT8_DOT=1))
        assert np.array_equal(got[:, col:col + n].view(np.uint32), alone.view(np.uint32))
        col += n


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("isa", ["device", "avx2"])
def test_matmul_int8_dot_kquant_tiles_meet_numpy(env, kind, isa):
    """Q4_K and Q6_K superblocks in tiles of 16 rows (INT8_DOT only), random bytes so every
    scale, minimum and quant pattern occurs, against gguf's dequantization times the same
    input digits in float64, at tiles of 1, 2 and 8 tokens and every tail width, bias and
    residual. Also the AVX2 instructions where the device takes VNNI's (an AVX-512 CPU runs
    both; the two must agree to the bit)."""
    needs_int8_dot(env)
    if isa == "avx2" and env.info.get("int8_isa") == "avx2":
        pytest.skip("the device's own instructions are AVX2's: the other case")
    n, k = 37, 768
    raw, ref = kquant_weights(kind, n, k, 96, magnitude=0.05)
    r = rng(97)
    x = (r.standard_normal((19, k)) * np.repeat(r.uniform(0.1, 3, k // 16), 16)).astype(np.float32)
    bias = r.standard_normal(n).astype(np.float32)
    y0 = r.standard_normal((19, n)).astype(np.float32)
    q = quantize_rows(env, "Q4_0", x)
    exact = dequantized_inputs(q) @ ref.T
    want = x.astype(np.float64) @ ref.T
    extra = dict(INT8_DOT=1, LOOM_DOT8_AVX2=1 if isa == "avx2" else None)
    for tpi, ts in ((1, (1, 3)), (2, (1, 2, 5)), (8, (1, 7, 8, 19))):
        for t in ts:
            got = run_row_tiles(env, kind, n, k, q[:t], raw, tpi, bias=bias, y0=y0[:t], extra=extra)
            assert_close(got, exact[:t] + bias + y0[:t], 2e-6)
            assert_close(got, want[:t] + bias + y0[:t], 1e-4)
    if isa == "avx2":
        native = run_row_tiles(env, kind, n, k, q, raw, 2, extra=dict(INT8_DOT=1))
        assert np.array_equal(run_row_tiles(env, kind, n, k, q, raw, 2, extra=extra).view(np.uint32),
                              native.view(np.uint32))


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_matmul_int8_dot_kquant_tiles_hold_the_largest_sums(env, kind):
    """Every quant at its largest (Q4_K 15, Q6_K 63) against inputs whose two digits are near
    127, of either sign: AVX2's int16 pair sums at their bound, still exact."""
    needs_int8_dot(env)
    n, k = 16, 512
    raw, _ = kquant_weights(kind, n, k, 98)
    size, _ = KQ_BLOCKS[kind]
    blocks = raw.reshape(-1, size)
    if kind == "Q4_K":
        blocks[:, 16:144] = 0xFF                     # every nibble 15
    else:
        blocks[:, 0:192] = 0xFF                      # every quant 63 (+31 after the zero point)
    import gguf
    ref = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).astype(np.float64).reshape(n, k)
    x = np.ones((4, k), np.float32)
    x[:, 31::32] = 1.004                           # x / s = 126.49: h = 126, l = 126
    x[1::2] *= -1
    q = quantize_rows(env, "Q4_0", x)
    got = run_row_tiles(env, kind, n, k, q, raw, 2, extra=dict(INT8_DOT=1))
    assert_close(got, dequantized_inputs(q) @ ref.T, 2e-6)


def x16_from_digits(q):
    """quantize_x's blocks with x16 (Q8_0 tiles' inputs), from the digit layout's q:
    256 h + l per value as int16, each group of four values ordered 0, 2, 1, 3."""
    digits = q[..., :16].copy().view(np.int8).astype(np.int32)
    v = (256 * digits[..., :32] + digits[..., 32:]).astype(np.int16)
    v = v.reshape(v.shape[:-1] + (8, 4))[..., [0, 2, 1, 3]].reshape(v.shape)
    return np.concatenate([v.view(np.int32), q[..., 16:]], axis=-1)


def test_quantize_x_for_q8_0_tiles_joins_the_digits(env):
    """A Q8_0 program's quantize_x writes the digits the others write, joined: 256 h + l
    as one int16 in vpmaddwd's pair order, with the same scale and sums."""
    needs_int8_dot(env)
    x = (rng(99).standard_normal((5, 896)) * 3).astype(np.float32)
    x[0, :32] = 0.0                                   # a zero block: scale 0, digits 0
    x[1, 32:64] = np.linspace(-1, 1, 32)              # the block's max at both ends
    q = quantize_rows(env, "Q4_0", x)
    assert np.array_equal(quantize_rows(env, "Q8_0", x), x16_from_digits(q))


def dot_tile_case(kind, seed, n=37, k=896):
    """A matrix of `kind` (raw bytes, float64 values), 19 tokens of inputs whose blocks span
    a range of scales, a bias and a residual: the int8 dot tile tests' operands."""
    raw, ref = make_weights(kind, random_weights(seed, n, k))
    r = rng(seed + 1)
    x = (r.standard_normal((19, k)) * np.repeat(r.uniform(0.1, 3, k // 16), 16)).astype(np.float32)
    return raw, ref, x, r.standard_normal(n).astype(np.float32), r.standard_normal((19, n)).astype(np.float32)


@pytest.mark.parametrize("isa", ["device", "avx2"])
def test_matmul_int8_dot_q8_0_tiles_meet_numpy(env, isa):
    """Q8_0 rows in tiles of 16 (INT8_DOT only: vpmaddwd on the weights and the joined
    digits) against the same quantized weights times the same input digits in float64,
    at tiles of 1, 2, 4 and 8 tokens, every tail width, bias and residual."""
    needs_int8_dot(env)
    if isa == "avx2" and env.info.get("int8_isa") == "avx2":
        pytest.skip("the device's own instructions are AVX2's: the other case")
    n, k = 37, 896
    raw, ref, x, bias, y0 = dot_tile_case("Q8_0", 100, n, k)
    q = quantize_rows(env, "Q8_0", x)
    exact = dequantized_inputs(quantize_rows(env, "Q4_0", x)) @ ref.T
    want = x.astype(np.float64) @ ref.T
    extra = dict(INT8_DOT=1, LOOM_DOT8_AVX2=1 if isa == "avx2" else None)
    for tpi, ts in ((1, (1, 3)), (2, (1, 2, 5)), (4, (3, 4, 9)), (8, (1, 7, 8, 19))):
        for t in ts:
            got = run_row_tiles(env, "Q8_0", n, k, q[:t], raw, tpi, bias=bias, y0=y0[:t], extra=extra)
            assert_close(got, exact[:t] + bias + y0[:t], 2e-6)
            assert_close(got, want[:t] + bias + y0[:t], 1e-4)


def test_matmul_dot16_q4_0_tiles_give_the_byte_tiles_bits(env):
    """Q4_0 tiles on vpmaddwd (DOT16: inputs in the x16 layout, a nibble times a whole input
    per lane) form the integers the byte tiles form, so the same floats to the bit, at
    tiles of 1, 2, 4 and 8 tokens, every tail width, bias and residual; and nibbles at 15
    against inputs near the digits' bound stay exact."""
    needs_int8_dot(env)
    n, k = 37, 896
    raw, ref, x, bias, y0 = dot_tile_case("Q4_0", 103, n, k)
    q = quantize_rows(env, "Q4_0", x)
    for tpi, ts in ((1, (1, 3)), (2, (1, 2, 5)), (4, (3, 4, 9)), (8, (1, 7, 8, 19))):
        for t in ts:
            args = ("Q4_0", n, k)
            got = run_row_tiles(env, *args, x16_from_digits(q[:t]), raw, tpi, bias=bias, y0=y0[:t],
                                extra=dict(INT8_DOT=1, DOT16=1))
            want = run_row_tiles(env, *args, q[:t], raw, tpi, bias=bias, y0=y0[:t], extra=dict(INT8_DOT=1))
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert_close(got, dequantized_inputs(q) @ ref.T + bias + y0, 2e-6)
    blocks = raw.reshape(-1, 18)
    blocks[:, 2:] = 0xFF                              # every nibble 15: +7 after the zero point
    x = np.ones((4, k), np.float32)
    x[:, 31::32] = 1.004                              # x / s = 126.49: h = 126, l = 126
    x[1::2] *= -1
    q = quantize_rows(env, "Q4_0", x)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float64).reshape(n, -1)
    for tpi in (1, 2):                                # 1: the nibbles in place, sums of 16 e and 256 e apart
        got = run_row_tiles(env, "Q4_0", n, k, x16_from_digits(q), raw, tpi, extra=dict(INT8_DOT=1, DOT16=1))
        assert_close(got, dequantized_inputs(q) @ np.repeat(7 * d, 32, axis=1).T, 2e-6)


def test_matmul_int8_dot_q8_0_tiles_hold_the_largest_sums(env):
    """Every weight byte at -128 or 127 against inputs whose two digits are near 127, of
    either sign: a block's int32 row sums at their bound, still exact."""
    needs_int8_dot(env)
    n, k = 16, 512
    raw, _ = make_weights("Q8_0", random_weights(102, n, k))
    blocks = raw.reshape(-1, 34)
    blocks[:, 2:] = np.where(np.arange(32) % 3 == 0, 0x80, 0x7F).astype(np.uint8)
    blocks[:n * k // 64, 2:] = 0x80                  # the first rows: every byte -128
    d = blocks[:, :2].copy().view(np.float16).astype(np.float64)
    ref = (d * blocks[:, 2:].view(np.int8)).reshape(n, k)
    x = np.ones((4, k), np.float32)
    x[:, 31::32] = 1.004                           # x / s = 126.49: h = 126, l = 126
    x[1::2] *= -1
    q = quantize_rows(env, "Q8_0", x)
    got = run_row_tiles(env, "Q8_0", n, k, q, raw, 2, extra=dict(INT8_DOT=1))
    assert_close(got, dequantized_inputs(quantize_rows(env, "Q4_0", x)) @ ref.T, 2e-6)


def test_matmul_int8_dot_needs_row_tiles(env):
    with pytest.raises(cl.RuntimeError) as e:
        env.build("matmul", K=64, N=16, WEIGHT_Q4_0=True, INT8_DOT=1)
    assert "INT8_DOT needs ROW_TILE" in str(e.value)


@pytest.mark.parametrize("macros", [dict(WEIGHT_Q8_0=True), dict(WEIGHT_Q4_0=True, ACT_Q8=True),
                                    dict(WEIGHT_Q4_0=True, ROW_TILE=8), dict(WEIGHT_Q4_K=True),
                                    dict(WEIGHT_F32=True), dict(WEIGHT_F16=True, INT8_DOT=1)])
def test_matmul_row_tiles_only_for_4_and_5_bit_blocks_and_f16_by_16(env, macros):
    with pytest.raises(cl.RuntimeError) as e:
        env.build("matmul", K=64, N=16, **dict(dict(ROW_TILE=16), **macros))
    assert "ROW_TILE needs 16, WEIGHT_Q4_0, WEIGHT_Q5_0, WEIGHT_Q4_1 or WEIGHT_F16 (Q4_K, Q6_K, Q8_0 with INT8_DOT), " \
        "and float activations" in str(e.value)


def test_matmul_missing_macro_is_a_build_error(env):
    with pytest.raises(cl.RuntimeError) as e:
        env.build("matmul", K=64, WEIGHT_F32=True)
    assert "define N" in str(e.value)


# ---------------------------------------------------------------- norms

@pytest.mark.every_driver
@pytest.mark.parametrize("d,wg,weighted", [(896, 1, True), (100, 4, True), (37, 1, False)])
def test_rms_norm(env, d, wg, weighted):
    prg = env.build("rms_norm", D=d, WG=wg, HAS_WEIGHT=weighted)
    r = rng(d)
    t, eps = 3, 1e-6
    x = (r.standard_normal((t, d)) * 3).astype(np.float32)
    w = r.standard_normal(d).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + eps)
    if weighted:
        ref = ref * w
    xb = env.buf(x)
    yb = env.empty(x.nbytes)
    env.run(prg.rms_norm, (wg, t), (wg, 1), xb, env.buf(w) if weighted else None, yb, i32(t), f32(eps))
    assert_close(env.read(yb, (t, d)), ref, 1e-5)
    # in place
    env.run(prg.rms_norm, (wg, t), (wg, 1), xb, env.buf(w) if weighted else None, xb, i32(t), f32(eps))
    assert_close(env.read(xb, (t, d)), ref, 1e-5)


@pytest.mark.parametrize("wg", [1, 4])
def test_rms_norm_over_heads_of_wider_rows(env, wg):
    """HEADS, LDX, ROW_OFF (llama.loom's Qwen3 q/k norms on q|k|v rows): head h of token t at
    ROW_OFF + t*LDX + h*D is normed in place; every other element keeps its bits."""
    d, heads, ldx, off, t, eps = 64, 3, 64 * 7 + 5, 64 * 2, 4, 1e-6
    prg = env.build("rms_norm", D=d, WG=wg, HAS_WEIGHT=True, HEADS=heads, LDX=ldx, ROW_OFF=off)
    r = rng(5)
    x = (r.standard_normal((t, ldx)) * 3).astype(np.float32)
    w = r.standard_normal(d).astype(np.float32)
    ref = x.astype(np.float64).copy()
    part = ref[:, off:off + heads * d].reshape(t, heads, d)
    ref[:, off:off + heads * d] = (part / np.sqrt((part ** 2).mean(-1, keepdims=True) + eps) * w).reshape(t, -1)
    xb = env.buf(x)
    env.run(prg.rms_norm, (wg, t * heads), (wg, 1), xb, env.buf(w), xb, i32(t * heads), f32(eps))
    got = env.read(xb, x.shape)
    outside = np.ones(ldx, bool)
    outside[off:off + heads * d] = False
    assert np.array_equal(got[:, outside], x[:, outside])
    assert_close(got, ref, 1e-5)


@pytest.mark.every_driver
@pytest.mark.parametrize("d,wg", [(384, 1), (37, 8)])
def test_layer_norm(env, d, wg):
    prg = env.build("layer_norm", D=d, WG=wg, HAS_WEIGHT=True, HAS_BIAS=True)
    r = rng(d + 1)
    t, eps = 67, 1e-12
    x = (r.standard_normal((t, d)) * 2 + 5).astype(np.float32)  # a large mean
    w = r.standard_normal(d).astype(np.float32)
    b = r.standard_normal(d).astype(np.float32)
    x64 = x.astype(np.float64)
    mu = x64.mean(axis=1, keepdims=True)
    ref = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(axis=1, keepdims=True) + eps) * w + b
    xb = env.buf(x)
    env.run(prg.layer_norm, (wg, t), (wg, 1), xb, env.buf(w), env.buf(b), xb, i32(t), f32(eps))
    assert_close(env.read(xb, (t, d)), ref, 1e-5)


@pytest.mark.every_driver
@pytest.mark.parametrize("d,wg,accumulate", [(192, 1, True), (37, 8, True), (40, 1, False)])
def test_layer_norm_gelu_out(env, d, wg, accumulate):
    """OUT_GELU (erf form) on the affine result, and ACCUMULATE adding it to Y (VITS's
    DDSConv residual: x += gelu(LN(u)))."""
    from math import erf
    prg = env.build("layer_norm", D=d, WG=wg, HAS_WEIGHT=True, HAS_BIAS=True, OUT_GELU=True,
                    **({"ACCUMULATE": True} if accumulate else {}))
    r = rng(d + 7)
    t, eps = 29, 1e-5
    x = (r.standard_normal((t, d)) * 3 + 1).astype(np.float32)
    w = r.standard_normal(d).astype(np.float32)
    b = r.standard_normal(d).astype(np.float32)
    y0 = r.standard_normal((t, d)).astype(np.float32)
    x64 = x.astype(np.float64)
    mu = x64.mean(axis=1, keepdims=True)
    v = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(axis=1, keepdims=True) + eps) * w + b
    ref = 0.5 * v * (1 + np.vectorize(erf)(v / np.sqrt(2))) + (y0 if accumulate else 0)
    yb = env.buf(y0)
    env.run(prg.layer_norm, (wg, t), (wg, 1), env.buf(x), env.buf(w), env.buf(b), yb, i32(t), f32(eps))
    assert_close(env.read(yb, (t, d)), ref, 1e-5)


def test_layer_norm_without_affine(env):
    d, t = 64, 2
    prg = env.build("layer_norm", D=d)
    x = rng(5).standard_normal((t, d)).astype(np.float32)
    x64 = x.astype(np.float64)
    mu = x64.mean(axis=1, keepdims=True)
    ref = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(axis=1, keepdims=True) + 1e-5)
    yb = env.empty(x.nbytes)
    env.run(prg.layer_norm, (1, t), (1, 1), env.buf(x), None, None, yb, i32(t), f32(1e-5))
    assert_close(env.read(yb, (t, d)), ref, 1e-5)


# ---------------------------------------------------------------- rope

def rope_ref(x, pos, theta, freq_scale, rope_dims, neox):
    """x [T, H, Dh] float64 rotated at pos[T]."""
    out = x.copy()
    i = np.arange(rope_dims // 2)
    inv = theta ** (-2.0 * i / rope_dims)
    ang = pos[:, None].astype(np.float64) * freq_scale * inv[None, :]  # [T, R/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if neox:
        ia, ib = i, i + rope_dims // 2
    else:
        ia, ib = 2 * i, 2 * i + 1
    a, b = x[:, :, ia], x[:, :, ib]
    out[:, :, ia] = a * c - b * s
    out[:, :, ib] = a * s + b * c
    return out


@pytest.mark.every_driver
@pytest.mark.parametrize("head_dim,neox,rope_dims", [(64, False, None), (64, True, None),
                                                     (128, True, 32), (128, False, 64)])
def test_rope(env, head_dim, neox, rope_dims):
    """Q (14 heads) and K (2 heads) of one fused QKV row, rotated in place."""
    nq, nkv, t = 14, 2, 5
    rd = rope_dims or head_dim
    theta, fs = 10000.0, 0.5 if rope_dims else 1.0
    width = (nq + 2 * nkv) * head_dim
    qkv = rng(head_dim + rd).standard_normal((t, width)).astype(np.float32)
    pos = np.array([0, 1, 17, 99, 42], np.int32)
    qkv_b, pos_b = env.buf(qkv), env.buf(pos)
    for heads, off in ((nq, 0), (nkv, nq * head_dim)):
        prg = env.build("rope", N_HEADS=heads, HEAD_DIM=head_dim, ROPE_DIMS=rope_dims,
                        ROPE_NEOX=neox, ROPE_NORMAL=not neox and rope_dims is None)
        env.run(prg.rope, (rd // 2, t), None, qkv_b, i32(off), i32(width), pos_b, i32(t),
                f32(theta), f32(fs))
    got = env.read(qkv_b, qkv.shape)
    ref = qkv.astype(np.float64).copy()
    q = ref[:, :nq * head_dim].reshape(t, nq, head_dim)
    k = ref[:, nq * head_dim:(nq + nkv) * head_dim].reshape(t, nkv, head_dim)
    ref[:, :nq * head_dim] = rope_ref(q, pos, theta, fs, rd, neox).reshape(t, -1)
    ref[:, nq * head_dim:(nq + nkv) * head_dim] = rope_ref(k, pos, theta, fs, rd, neox).reshape(t, -1)
    # the angle is float32 (pos * inv_freq up to ~100 rad): 2e-5 of the output scale
    assert_close(got, ref, 2e-5)
    assert np.array_equal(got[:, (nq + nkv) * head_dim:], qkv[:, (nq + nkv) * head_dim:])  # V untouched


@pytest.mark.parametrize("neox,kv_f16", [(False, False), (True, False), (True, True)])
def test_rope_store_is_rope_then_kv_store(env, neox, kv_f16):
    """rope_store (one launch) leaves q|k|v rows and the paged cache with the bits that
    rope over the q and k heads followed by kv_store leave: the rotated keys and the
    values where kv_store puts them, nothing stored for a position past the page
    table, a negative one or an unmapped page, and other cache entries untouched."""
    nq, nkv, dh, page, max_pages, n_pages = 14, 2, 64, 16, 4, 8
    kv_row, width = nkv * dh, (nq + 2 * nkv) * dh + 3
    r = rng(77 + neox + 2 * kv_f16)
    t = 7
    qkv = r.standard_normal((t, width)).astype(np.float32)
    pos = np.array([0, 5, 17, 63, -1, 64, 40], np.int32)        # -1 and 64: outside the table
    row_of = np.array([0, 1, 0, 1, 0, 1, 1], np.int32)
    table = np.array([[3, 5, -1, 0], [1, 7, 2, 6]], np.int32)   # row 0's third page unmapped
    pos[2] = 33                                                  # row 0, page 2: unmapped
    store_t = np.float16 if kv_f16 else np.float32
    pool = np.full(2 * n_pages * page * kv_row, 7.0, store_t)
    layer_off = n_pages * page * kv_row                          # the second layer
    theta, fs = 1e6, 1.0
    flags = dict(ROPE_NEOX=neox, ROPE_NORMAL=not neox)
    cache = dict(PAGE_SIZE=page, N_KV_HEADS=nkv, HEAD_DIM=dh, MAX_PAGES=max_pages, KV_F16=kv_f16)

    x1, k1, v1 = env.buf(qkv), env.buf(pool), env.buf(pool)
    rope = env.build("rope", N_HEADS=nq + nkv, HEAD_DIM=dh, **flags).rope
    env.run(rope, (dh // 2, t), None, x1, i32(0), i32(width), env.buf(pos), i32(t), f32(theta), f32(fs))
    store = env.build("kv_store", **cache).kv_store
    env.run(store, (kv_row, t), None, x1, i32(nq * dh), i32(width), x1, i32((nq + nkv) * dh), i32(width),
            k1, v1, i32(layer_off), env.buf(pos), env.buf(row_of), env.buf(table), i32(t))

    x2, k2, v2 = env.buf(qkv), env.buf(pool), env.buf(pool)
    fused = env.build("rope", N_HEADS=nq + nkv, **cache, **flags).rope_store
    env.run(fused, (dh // 2, t), None, x2, i32(0), i32(width), env.buf(pos), i32(t), f32(theta), f32(fs),
            i32((nq + nkv) * dh), k2, v2, i32(layer_off), env.buf(row_of), env.buf(table))

    assert np.array_equal(env.read(x2, qkv.shape), env.read(x1, qkv.shape))
    got_k, want_k = env.read(k2, pool.shape, store_t), env.read(k1, pool.shape, store_t)
    got_v, want_v = env.read(v2, pool.shape, store_t), env.read(v1, pool.shape, store_t)
    assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v)
    # exactly the 4 tokens with a mapped page stored, each a full k and v row
    assert (got_k != 7.0).sum() <= 4 * kv_row and (got_v != 7.0).sum() == 4 * kv_row
    rotated = rope_ref(qkv[:, None, nq * dh:(nq + 1) * dh].astype(np.float64), pos, theta, fs, dh, neox)
    dst = layer_off + (table[1, 0] * page + 5) * kv_row                 # token 1: row 1, position 5
    assert_close(got_k[dst:dst + dh].astype(np.float64), rotated[1, 0], 1e-3 if kv_f16 else 2e-5)


# ---------------------------------------------------------------- softmax

@pytest.mark.every_driver
@pytest.mark.parametrize("d,wg,scale", [(37, 1, 1.0), (1000, 4, 0.125), (8, 1, -2.0)])
def test_softmax(env, d, wg, scale):
    prg = env.build("softmax", D=d, WG=wg)
    t = 3
    x = (rng(d).standard_normal((t, d)) * 10).astype(np.float32)
    x[1, :] += 1000.0                    # huge logits: stability
    if scale > 0:
        x[2, d // 2] = -np.inf           # a masked logit is exactly 0
    z = x.astype(np.float64) * scale
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    ref = e / e.sum(axis=1, keepdims=True)
    xb = env.buf(x)
    env.run(prg.softmax, (wg, t), (wg, 1), xb, xb, i32(t), f32(scale))
    got = env.read(xb, (t, d))
    assert_close(got, ref, 1e-5)
    if scale > 0:
        assert got[2, d // 2] == 0.0
    assert np.allclose(got.sum(axis=1), 1.0, atol=1e-5)


# ---------------------------------------------------------------- paged KV cache and attention

def attention_ref(q, hist_k, hist_v, rows, positions, scale, group, window=None):
    """q [T, H, Dh]; hist_k[r] [P, KVH, Dh] dense history of row r."""
    t_count, heads, dh = q.shape
    out = np.zeros((t_count, heads, dh))
    for t in range(t_count):
        r, p = rows[t], positions[t]
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(heads):
            g = h // group
            k = hist_k[r][lo:p + 1, g, :]
            v = hist_v[r][lo:p + 1, g, :]
            s = k @ q[t, h] * scale
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v
    return out


ATTN_CASES = [
    # (heads, kv heads, head dim, KV_F16, WINDOW)
    (14, 2, 64, False, None),   # Qwen2.5-0.5B-like GQA 7
    (4, 4, 128, True, None),    # MHA, half cache
    (14, 2, 64, False, 20),     # sliding window
]


@pytest.mark.every_driver
@pytest.mark.parametrize("case", range(len(ATTN_CASES)))
def test_kv_store_and_attention(env, case):
    heads, kvh, dh, kv_f16, window = ATTN_CASES[case]
    page, max_pages, n_pages, layers = 16, 8, 24, 2
    kv_row = kvh * dh
    lens = [1, 17, 100]                        # context per row after this step
    r = rng(200 + case)

    # scattered, shuffled pages; page id -1 marks unused table entries
    perm = r.permutation(n_pages)
    table = -np.ones((len(lens), max_pages), np.int32)
    used = 0
    for row, n in enumerate(lens):
        need = -(-n // page)
        table[row, :need] = perm[used:used + need]
        used += need
    layer = 1
    layer_off = layer * n_pages * page * kv_row
    store_t = np.float16 if kv_f16 else np.float32
    sentinel = 7.0
    pool_k = np.full(layers * n_pages * page * kv_row, sentinel, store_t)
    pool_v = np.full_like(pool_k, sentinel)
    kb, vb = env.buf(pool_k), env.buf(pool_v)

    common = dict(PAGE_SIZE=page, N_KV_HEADS=kvh, HEAD_DIM=dh, MAX_PAGES=max_pages, KV_F16=kv_f16)
    store = env.build("kv_store", **common).kv_store
    attn = env.build("attention", N_HEADS=heads, WINDOW=window, **common).attention
    table_b = env.buf(table)

    # Every position of every row, written in one kv_store call through a fused
    # QKV-like buffer (K at column 0, V at column kv_row, row length 2*kv_row + 3).
    rows = np.concatenate([np.full(n, i) for i, n in enumerate(lens)]).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    order = r.permutation(len(rows))           # arrival order does not matter
    rows, positions = rows[order], positions[order]
    ld = 2 * kv_row + 3
    fused = r.standard_normal((len(rows), ld)).astype(np.float32)
    env.run(store, (kv_row, len(rows)), None, env.buf(fused), i32(0), i32(ld),
            env.buf(fused), i32(kv_row), i32(ld), kb, vb, i32(layer_off),
            env.buf(positions), env.buf(rows), table_b, i32(len(rows)))

    # The pool, element by element, as numpy places it.
    ref_k, ref_v = pool_k.copy(), pool_v.copy()
    hist_k = [np.zeros((n, kvh, dh)) for n in lens]
    hist_v = [np.zeros((n, kvh, dh)) for n in lens]
    for i, (row, p) in enumerate(zip(rows, positions)):
        dst = layer_off + (table[row, p // page] * page + p % page) * kv_row
        ref_k[dst:dst + kv_row] = fused[i, :kv_row]
        ref_v[dst:dst + kv_row] = fused[i, kv_row:2 * kv_row]
        hist_k[row][p] = ref_k[dst:dst + kv_row].astype(np.float64).reshape(kvh, dh)
        hist_v[row][p] = ref_v[dst:dst + kv_row].astype(np.float64).reshape(kvh, dh)
    got_k = env.read(kb, pool_k.shape, store_t)
    got_v = env.read(vb, pool_v.shape, store_t)
    assert np.array_equal(got_k, ref_k) and np.array_equal(got_v, ref_v)

    # One attention call mixing: the last 10 positions of row 2 (a prefill
    # chunk), row 0 at pos 0, row 1 at pos 16 (crossing a page), row 2 at pos 50.
    q_rows = np.array([2] * 10 + [0, 1, 2], np.int32)
    q_pos = np.array(list(range(90, 100)) + [0, 16, 50], np.int32)
    t = len(q_rows)
    width = heads * dh + 5
    q = r.standard_normal((t, width)).astype(np.float32)
    scale = 1.0 / np.sqrt(dh)
    ob = env.buf(np.full((t, width + 1), np.nan, np.float32))
    env.run(attn, (heads, t), (heads // kvh, 1), env.buf(q), i32(5), i32(width), kb, vb,
            i32(layer_off), env.buf(q_pos), env.buf(q_rows), table_b,
            ob, i32(1), i32(width + 1), i32(t), f32(scale))
    got = env.read(ob, (t, width + 1))
    ref = attention_ref(q[:, 5:].astype(np.float64).reshape(t, heads, dh), hist_k, hist_v,
                        q_rows, q_pos, scale, heads // kvh, window)
    assert_close(got[:, 1:1 + heads * dh], ref.reshape(t, -1), 1e-5)
    assert np.isnan(got[:, 0]).all() and np.isnan(got[:, 1 + heads * dh:]).all()
    if dh % 32:
        return
    # QUANT_OUT: the same outputs as the o projection's int8 inputs (quantize_x's blocks)
    attn_q = env.build("attention", N_HEADS=heads, WINDOW=window, QUANT_OUT=True, **common).attention
    qb = env.buf(np.full((t, heads * dh // 32, 20), -1, np.int32))
    env.run(attn_q, (heads, t), (heads // kvh, 1), env.buf(q), i32(5), i32(width), kb, vb,
            i32(layer_off), env.buf(q_pos), env.buf(q_rows), table_b, qb, i32(0), i32(0), i32(t), f32(scale))
    blocks = env.read(qb, (t, heads * dh // 32, 20), np.int32)
    floats = got[:, 1:1 + heads * dh].astype(np.float64).reshape(t, -1, 32)
    assert np.allclose(blocks[..., 16].copy().view(np.float32), np.abs(floats).max(axis=2) / 127, rtol=1e-6)
    scale_q = blocks[..., 16].copy().view(np.float32).astype(np.float64)[..., None]
    err = np.abs(dequantized_inputs(blocks).reshape(t, -1, 32) - floats)
    assert (err <= 3 * scale_q / 512).all()          # (l clamped at 127: up to s / 256 more)
    assert_digit_sums(blocks)
    # QUANT_X16: the same digits joined, as a Q8_0 output projection's tiles read them
    attn_x16 = env.build("attention", N_HEADS=heads, WINDOW=window, QUANT_OUT=True, QUANT_X16=1, **common).attention
    env.run(attn_x16, (heads, t), (heads // kvh, 1), env.buf(q), i32(5), i32(width), kb, vb,
            i32(layer_off), env.buf(q_pos), env.buf(q_rows), table_b, qb, i32(0), i32(0), i32(t), f32(scale))
    assert np.array_equal(env.read(qb, (t, heads * dh // 32, 20), np.int32), x16_from_digits(blocks))


@pytest.mark.parametrize("neox,kv_f16", [(False, False), (True, False), (True, True)])
def test_attention_rope_in_is_rope_store_then_attention(env, neox, kv_f16):
    """ROPE_IN (decode: each token a row of its own): one launch leaves the paged cache and
    the outputs (floats, and QUANT_OUT's blocks) with the bits rope_store then attention
    leave, q | k | v rows as projected in; a token at a position outside the page table
    or on an unmapped page stores nothing, as rope_store, and other entries stay."""
    nq, nkv, dh, page, max_pages, n_pages = 14, 2, 64, 16, 4, 24
    kv_row, width = nkv * dh, (nq + 2 * nkv) * dh + 3
    r = rng(230 + neox + 2 * kv_f16)
    store_t = np.float16 if kv_f16 else np.float32
    pool = r.standard_normal(2 * n_pages * page * kv_row).astype(store_t)    # every row's history
    layer_off = n_pages * page * kv_row
    pos = np.array([37, 5, 0, -1, 40], np.int32)                  # -1: outside; 40: row 4's page 2 unmapped
    row_of = np.arange(5, dtype=np.int32)
    table = r.permutation(n_pages)[:5 * max_pages].reshape(5, max_pages).astype(np.int32)    # no page shared
    table[4, 2] = -1
    t = len(pos)
    qkv = r.standard_normal((t, width)).astype(np.float32)
    theta, fs, scale = 1e6, 1.0, 1.0 / np.sqrt(dh)
    flags = dict(ROPE_NEOX=neox, ROPE_NORMAL=not neox)
    cache = dict(PAGE_SIZE=page, N_KV_HEADS=nkv, HEAD_DIM=dh, MAX_PAGES=max_pages, KV_F16=kv_f16)
    tb, pb, rb = env.buf(table), env.buf(pos), env.buf(row_of)
    for quant in (False, True):
        out = (np.full((t, nq * dh // 32, 20), -1, np.int32) if quant else np.full((t, nq * dh), np.nan, np.float32))
        x1, k1, v1, o1 = env.buf(qkv), env.buf(pool), env.buf(pool), env.buf(out)
        rope_store = env.build("rope", N_HEADS=nq + nkv, **cache, **flags).rope_store
        env.run(rope_store, (dh // 2, t), None, x1, i32(0), i32(width), pb, i32(t), f32(theta), f32(fs),
                i32((nq + nkv) * dh), k1, v1, i32(layer_off), rb, tb)
        attn = env.build("attention", N_HEADS=nq, QUANT_OUT=quant, **cache).attention
        env.run(attn, (nq, t), (nq // nkv, 1), x1, i32(0), i32(width), k1, v1, i32(layer_off), pb, rb, tb,
                o1, i32(0), i32(nq * dh), i32(t), f32(scale))
        x2, k2, v2, o2 = env.buf(qkv), env.buf(pool), env.buf(pool), env.buf(out)
        fused = env.build("attention", N_HEADS=nq, QUANT_OUT=quant, ROPE_IN=True, **cache, **flags).attention
        env.run(fused, (nq, t), (nq // nkv, 1), x2, i32(0), i32(width), k2, v2, i32(layer_off), pb, rb, tb,
                o2, i32(0), i32(nq * dh), i32(t), f32(scale), f32(theta), f32(fs), i32(nq * dh),
                i32((nq + nkv) * dh))
        dtype = np.int32 if quant else np.float32
        assert np.array_equal(env.read(o2, out.shape, dtype).view(np.uint32), env.read(o1, out.shape, dtype).view(np.uint32))
        got_k, want_k = env.read(k2, pool.shape, store_t), env.read(k1, pool.shape, store_t)
        got_v, want_v = env.read(v2, pool.shape, store_t), env.read(v1, pool.shape, store_t)
        assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v)
        assert (got_v != pool).sum() <= 3 * kv_row and (got_v != pool).sum() > 2 * kv_row   # three tokens stored
        assert np.array_equal(env.read(x2, qkv.shape), qkv)                                # its input as projected
        if not quant:
            assert (env.read(o2, out.shape)[3] == 0).all()                              # position -1: zeros


def test_attention_is_stable_for_large_scores(env):
    """Scores in the thousands (no overflow) and a one-position context."""
    heads, kvh, dh, page, max_pages = 2, 1, 8, 16, 4
    common = dict(PAGE_SIZE=page, N_KV_HEADS=kvh, HEAD_DIM=dh, MAX_PAGES=max_pages)
    store = env.build("kv_store", **common).kv_store
    attn = env.build("attention", N_HEADS=heads, **common).attention
    n = 40
    r = rng(300)
    kv = (r.standard_normal((n, 2 * dh)) * 30).astype(np.float32)
    table = np.array([[3, 0, 2, -1]], np.int32)
    kb = env.buf(np.zeros(4 * page * dh, np.float32))
    vb = env.buf(np.zeros(4 * page * dh, np.float32))
    pos = np.arange(n, dtype=np.int32)
    zeros = np.zeros(n, np.int32)
    env.run(store, (dh, n), None, env.buf(kv), i32(0), i32(2 * dh), env.buf(kv), i32(dh), i32(2 * dh),
            kb, vb, i32(0), env.buf(pos), env.buf(zeros), env.buf(table), i32(n))
    q = (r.standard_normal((2, heads * dh)) * 30).astype(np.float32)
    q_pos = np.array([0, n - 1], np.int32)
    ob = env.empty(q.nbytes)
    env.run(attn, (heads, 2), None, env.buf(q), i32(0), i32(heads * dh), kb, vb, i32(0),
            env.buf(q_pos), env.buf(np.zeros(2, np.int32)), env.buf(table), ob, i32(0),
            i32(heads * dh), i32(2), f32(1.0))
    hist = kv.astype(np.float64)
    ref = attention_ref(q.astype(np.float64).reshape(2, heads, dh),
                        [hist[:, :dh].reshape(n, 1, dh)], [hist[:, dh:].reshape(n, 1, dh)],
                        [0, 0], q_pos, 1.0, heads)
    assert_close(env.read(ob, (2, heads * dh)), ref.reshape(2, -1), 1e-5)


@pytest.mark.every_driver
@pytest.mark.parametrize("causal, split_v", [(False, False), (True, False), (False, True)])
def test_attention_seq(env, causal, split_v):
    """split_v: values from their own buffer, at another offset and leading dimension than the keys."""
    heads, kvh, dh = 6, 2, 32
    prg = env.build("attention_seq", N_HEADS=heads, N_KV_HEADS=kvh, HEAD_DIM=dh, CAUSAL=causal)
    lens = [1, 17, 5, 40]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(offsets[-1])
    qw, kw = heads * dh, kvh * dh
    ld = qw + 2 * kw
    qkv = rng(400).standard_normal((t, ld)).astype(np.float32) * 3
    ob = env.empty(t * qw * 4)
    scale = 1.0 / np.sqrt(dh)
    b = env.buf(qkv)
    v_args = (b, i32(qw + kw), i32(ld))
    if split_v:
        values = np.zeros((t, kw + 8), np.float32)
        values[:, 8:] = qkv[:, qw + kw:]
        v_args = (env.buf(values), i32(8), i32(kw + 8))
    env.run(prg.attention_seq, (heads, t), None, b, i32(0), i32(ld), b, i32(qw), i32(ld),
            *v_args, env.buf(offsets), i32(len(lens)), ob, i32(0), i32(qw),
            i32(t), f32(scale))
    x = qkv.astype(np.float64)
    ref = np.zeros((t, heads, dh))
    for s in range(len(lens)):
        a, e = offsets[s], offsets[s + 1]
        for i in range(a, e):
            end = i + 1 if causal else e
            for h in range(heads):
                g = h // (heads // kvh)
                q = x[i, h * dh:(h + 1) * dh]
                k = x[a:end, qw + g * dh:qw + (g + 1) * dh]
                v = x[a:end, qw + kw + g * dh:qw + kw + (g + 1) * dh]
                sc = k @ q * scale
                w = np.exp(sc - sc.max())
                ref[i, h] = (w / w.sum()) @ v
    assert_close(env.read(ob, (t, qw)), ref.reshape(t, -1), 1e-5)


def test_attention_seq_cross(env):
    """KV_OFFSETS: sequence s's queries attend to its own stretch of another buffer (SD's cross-attention)."""
    heads, dh = 4, 16
    prg = env.build("attention_seq", N_HEADS=heads, HEAD_DIM=dh, KV_OFFSETS=True)
    q_lens, kv_lens = [64, 3, 20], [77, 5, 1]
    q_off = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_off = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    t, u, w = int(q_off[-1]), int(kv_off[-1]), heads * dh
    r = rng(401)
    q = (r.standard_normal((t, w)) * 3).astype(np.float32)
    kv = (r.standard_normal((u, 2 * w)) * 3).astype(np.float32)      # K then V in one buffer
    ob = env.empty(t * w * 4)
    kvb = env.buf(kv)
    scale = 1.0 / np.sqrt(dh)
    env.run(prg.attention_seq, (heads, t), None, env.buf(q), i32(0), i32(w), kvb, i32(0), i32(2 * w),
            kvb, i32(w), i32(2 * w), env.buf(q_off), i32(len(q_lens)), env.buf(kv_off), ob, i32(0), i32(w),
            i32(t), f32(scale))
    ref = np.zeros((t, w))
    x, y = q.astype(np.float64), kv.astype(np.float64)
    for s in range(len(q_lens)):
        k, v = y[kv_off[s]:kv_off[s + 1], :w], y[kv_off[s]:kv_off[s + 1], w:]
        for h in range(heads):
            cols = slice(h * dh, (h + 1) * dh)
            sc = x[q_off[s]:q_off[s + 1], cols] @ k[:, cols].T * scale
            e = np.exp(sc - sc.max(1, keepdims=True))
            ref[q_off[s]:q_off[s + 1], cols] = (e / e.sum(1, keepdims=True)) @ v[:, cols]
    assert_close(env.read(ob, (t, w)), ref, 1e-5)


# ---------------------------------------------------------------- elementwise

def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu_erf(x):
    from math import erf
    return 0.5 * x * (1.0 + np.vectorize(erf)(x / np.sqrt(2.0)))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


# Row-strided elementwise kernels address in int where that is exact (on Intel's runtime,
# which vectorizes only 32-bit addressing) and in size_t otherwise: EW_SIZE_T forces the latter.
ADDRESSING = [pytest.param(False, id="as-built"), pytest.param(True, id="size_t")]


@pytest.mark.every_driver
@pytest.mark.parametrize("size_t", ADDRESSING)
@pytest.mark.parametrize("tanh", [False, True])
def test_gated_activations(env, tanh, size_t):
    f, t = 37, 3
    prg = env.build("elementwise", F=f, GELU_TANH=tanh, EW_SIZE_T=size_t)
    r = rng(500)
    gu = (r.standard_normal((t, 2 * f)) * 4).astype(np.float32)
    gu[0, :4] = [-100.0, 100.0, 0.0, -30.0]        # saturated sigmoids
    g64, u64 = gu[:, :f].astype(np.float64), gu[:, f:].astype(np.float64)
    act = gelu_tanh if tanh else gelu_erf
    # fused halves of one [T, 2F] buffer -> separate output
    ob = env.empty(t * f * 4)
    b = env.buf(gu)
    env.run(prg.silu_mul, (f, t), None, b, i32(0), i32(2 * f), b, i32(f), i32(2 * f),
            ob, i32(0), i32(f), i32(t))
    assert_close(env.read(ob, (t, f)), silu(g64) * u64, 1e-5)
    env.run(prg.gelu_mul, (f, t), None, b, i32(0), i32(2 * f), b, i32(f), i32(2 * f),
            ob, i32(0), i32(f), i32(t))
    assert_close(env.read(ob, (t, f)), act(g64) * u64, 1e-5)
    # separate buffers, output in place over the gate
    gb, ub = env.buf(gu[:, :f]), env.buf(gu[:, f:])
    env.run(prg.silu_mul, (f, t), None, gb, i32(0), i32(f), ub, i32(0), i32(f),
            gb, i32(0), i32(f), i32(t))
    assert_close(env.read(gb, (t, f)), silu(g64) * u64, 1e-5)


@pytest.mark.every_driver
@pytest.mark.parametrize("tanh", [False, True])
def test_gelu(env, tanh):
    prg = env.build("elementwise", GELU_TANH=tanh)   # flat kernels need no F
    n = 1000
    x = (rng(501).standard_normal(n) * 4).astype(np.float32)
    x[:3] = [-50.0, 50.0, 0.0]
    xb = env.buf(x)
    env.run(prg.gelu, (1024,), (64,), xb, xb, i32(n))
    ref = (gelu_tanh if tanh else gelu_erf)(x.astype(np.float64))
    assert_close(env.read(xb, n), ref, 1e-5)


@pytest.mark.every_driver
def test_quick_gelu_and_silu(env):
    prg = env.build("elementwise")
    n = 1000
    x = (rng(503).standard_normal(n) * 6).astype(np.float32)
    x[:3] = [-90.0, 90.0, 0.0]
    x64 = x.astype(np.float64)
    for name, ref in [("quick_gelu", x64 / (1.0 + np.exp(-1.702 * x64))), ("silu", silu(x64))]:
        yb = env.empty(n * 4)
        env.run(getattr(prg, name), (1024,), (64,), env.buf(x), yb, i32(n))
        assert_close(env.read(yb, n), ref, 1e-5)


@pytest.mark.every_driver
@pytest.mark.parametrize("size_t", ADDRESSING)
def test_add_mul_scale_add_bias(env, size_t):
    f, t = 37, 5
    prg = env.build("elementwise", F=f, EW_SIZE_T=size_t)
    r = rng(502)
    n = f * t
    y = r.standard_normal(n).astype(np.float32)
    x = r.standard_normal(n).astype(np.float32)
    b = r.standard_normal(f).astype(np.float32)
    yb, xb = env.buf(y), env.buf(x)
    g = (-(-n // 16) * 16,)
    env.run(prg.add, g, (16,), yb, xb, i32(n))
    ref = y.astype(np.float64) + x
    assert_close(env.read(yb, n), ref, 1e-6)
    env.run(prg.mul, g, (16,), yb, xb, i32(n))
    ref = ref * x
    assert_close(env.read(yb, n), ref, 1e-6)
    env.run(prg.scale, g, (16,), yb, i32(n), f32(-0.25))
    ref = ref * -0.25
    assert_close(env.read(yb, n), ref, 1e-6)
    env.run(prg.add_bias, (f, t), None, yb, env.buf(b), i32(t))
    ref = (ref.reshape(t, f) + b).reshape(-1)
    assert_close(env.read(yb, n), ref, 1e-6)


@pytest.mark.every_driver
def test_to_f16(env):
    """float32 -> IEEE half bits exactly as numpy rounds them (nearest even, overflow to inf)."""
    prg = env.build("elementwise")
    n = 1003
    x = (rng(503).standard_normal(n) * 100).astype(np.float32)
    x[:8] = [0.0, -0.0, 65504.0, 70000.0, -1e6, 6e-8, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11]  # max, inf, subnormal, ties
    yb = env.empty(2 * n)
    env.run(prg.to_f16, (1008,), (16,), env.buf(x), yb, i32(n))
    got = env.read(yb, n, np.uint16)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- gather

@pytest.mark.every_driver
@pytest.mark.parametrize("kind", KINDS)
def test_gather(env, kind):
    vocab, d = 50, 64
    raw, ref_table = make_weights(kind, random_weights(600, vocab, d))
    prg = env.build("gather", D=d, VOCAB=vocab, **{"TABLE_" + kind: True})
    ids = np.array([3, 0, 49, 3, -1, 50, 17], np.int32)
    t = len(ids)
    ob = env.empty(t * d * 4)
    env.run(prg.gather, (d, t), None, env.buf(raw), env.buf(ids), ob, i32(t), f32(2.5))
    got = env.read(ob, (t, d))
    ref = np.zeros((t, d))
    ok = (ids >= 0) & (ids < vocab)
    ref[ok] = ref_table[ids[ok]] * 2.5
    assert_close(got, ref, REL[kind])
    assert not got[~ok].any()                       # out-of-range ids give zeros


@pytest.mark.parametrize("kind", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_gather_from_row_tiles_reads_every_value_where_the_tile_put_it(env, kind):
    """TABLE_TILE 16 (a tied lm head's table held in tiles): the rows of every lane, in
    the last tile with padding rows too, the same bits as the row-major table gives;
    ids outside the table give zeros."""
    vocab, d = 50, 96
    raw, ref = make_weights(kind, random_weights(601, vocab, d))
    ids = np.array([0, 15, 16, 31, 33, 47, 48, 49, -1, 50, 7], np.int32)
    t = len(ids)
    out = {}
    for tiled in (0, 16):
        prg = env.build("gather", D=d, VOCAB=vocab, TABLE_TILE=tiled, **{"TABLE_" + kind: True})
        ob = env.empty(t * d * 4)
        env.run(prg.gather, (d, t), None, env.buf(tiled16(raw, vocab, kind) if tiled else raw), env.buf(ids), ob,
                i32(t), f32(1.5))
        out[tiled] = env.read(ob, (t, d))
    assert np.array_equal(out[16].view(np.uint32), out[0].view(np.uint32))
    ok = (ids >= 0) & (ids < vocab)
    assert_close(out[16][ok], ref[ids[ok]] * 1.5, REL[kind])
    assert not out[16][~ok].any()


@pytest.mark.parametrize("kind", ["F32", "Q4_K"])
def test_gather_row_tiles_only_for_the_tiled_types(env, kind):
    with pytest.raises(cl.RuntimeError) as e:
        env.build("gather", D=256, VOCAB=4, TABLE_TILE=16, **{"TABLE_" + kind: True})
    assert "TABLE_TILE needs 16 and TABLE_F16, TABLE_Q8_0, TABLE_Q4_0, TABLE_Q4_1 or TABLE_Q5_0" in str(e.value)


@pytest.mark.every_driver
@pytest.mark.parametrize("kind,d", diagonal(KQUANTS, [256, 768]))
def test_gather_kquants(env, kind, d):
    """Embedding rows of one and of three superblocks, an odd vocabulary, ids out of range."""
    vocab = 37
    raw, ref_table = kquant_weights(kind, vocab, d, 610 + d)
    prg = env.build("gather", D=d, VOCAB=vocab, **{"TABLE_" + kind: True})
    ids = np.array([3, 0, 36, 3, -1, 37, 17, 0], np.int32)
    t = len(ids)
    ob = env.empty(t * d * 4)
    env.run(prg.gather, (d, t), None, env.buf(raw), env.buf(ids), ob, i32(t), f32(2.5))
    got = env.read(ob, (t, d))
    ok = (ids >= 0) & (ids < vocab)
    ref = np.zeros((t, d))
    ref[ok] = ref_table[ids[ok]] * 2.5
    assert_close(got, ref, 1e-6)
    assert not got[~ok].any()


def test_kquant_sizes_are_build_errors(env):
    """K-quant rows must be whole superblocks: K or D not a multiple of 256 does not build."""
    with pytest.raises(cl.RuntimeError) as e:
        env.build("matmul", K=96, N=4, WEIGHT_Q4_K=True)
    assert "K % 256" in str(e.value)
    with pytest.raises(cl.RuntimeError) as e:
        env.build("gather", D=896, VOCAB=4, TABLE_Q6_K=True)
    assert "D % 256" in str(e.value)


# ---------------------------------------------------------------- pooling

@pytest.mark.every_driver
def test_mean_cls_pool_and_l2_normalize(env):
    d = 37
    prg = env.build("pool", D=d)
    lens = [3, 1, 0, 7]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t, s = int(offsets[-1]), len(lens)
    x = rng(700).standard_normal((t, d)).astype(np.float32)
    xb, offb = env.buf(x), env.buf(offsets)
    mb, cb = env.empty(s * d * 4), env.empty(s * d * 4)
    env.run(prg.mean_pool, (d, s), None, xb, offb, mb, i32(s))
    env.run(prg.cls_pool, (d, s), None, xb, offb, cb, i32(s))
    mean_ref = np.zeros((s, d))
    cls_ref = np.zeros((s, d))
    for i in range(s):
        a, e = offsets[i], offsets[i + 1]
        if e > a:
            mean_ref[i] = x[a:e].astype(np.float64).mean(axis=0)
            cls_ref[i] = x[a]
    assert_close(env.read(mb, (s, d)), mean_ref, 1e-6)
    assert np.array_equal(env.read(cb, (s, d)), cls_ref.astype(np.float32))
    # normalize the pooled rows in place; the empty sequence's zero row stays 0
    env.run(prg.l2_normalize, (1, s), (1, 1), mb, mb, i32(s), f32(1e-12))
    norms = np.linalg.norm(mean_ref, axis=1, keepdims=True)
    ref = mean_ref / np.maximum(norms, 1e-12)
    assert_close(env.read(mb, (s, d)), ref, 1e-6)


def test_l2_normalize_work_group_lanes(env):
    d, t, wg = 384, 4, 8
    prg = env.build("pool", D=d, WG=wg)
    x = rng(701).standard_normal((t, d)).astype(np.float32) * 100
    yb = env.empty(x.nbytes)
    env.run(prg.l2_normalize, (wg, t), (wg, 1), env.buf(x), yb, i32(t), f32(1e-12))
    x64 = x.astype(np.float64)
    assert_close(env.read(yb, (t, d)), x64 / np.linalg.norm(x64, axis=1, keepdims=True), 1e-6)


# ---------------------------------------------------------------- argmax

@pytest.mark.every_driver
@pytest.mark.parametrize("d,wg", [(1000, 1), (1000, 4), (37, 1)])
def test_argmax(env, d, wg):
    prg = env.build("argmax", D=d, WG=wg)
    t = 5
    x = rng(d + wg).standard_normal((t, d + 2)).astype(np.float32)
    x[1, :] = 0.0                                    # all tied: lowest index
    # (column c holds row element c - 1: the row starts at x_off = 1)
    x[2, 1 + np.array([9, 16, d - 1])] = 100.0       # tie: lower index in a later vector slot
    x[3, 1 + (d - 1)] = 100.0                        # max in the last element
    x[4, :] = -np.inf
    x[4, 1 + d // 2] = -1e30
    ob = env.empty(t * 4)
    env.run(prg.argmax, (wg, t), (wg, 1), env.buf(x), i32(1), i32(d + 2), ob, i32(t))
    got = env.read(ob, t, np.int32)
    ref = np.argmax(x[:, 1:1 + d], axis=1)
    assert list(got) == list(ref)


# ---------------------------------------------------------------- catalogue

def test_catalogue_lists_every_kernel():
    """opencl/README.md has one row per kernel, naming its file."""
    with open(os.path.join(OPENCL, "README.md")) as f:
        readme = f.read()
    found = set()
    for name in sorted(os.listdir(OPENCL)):
        if not name.endswith(".cl") or name == "common.cl":
            continue
        with open(os.path.join(OPENCL, name)) as f:
            src = f.read()
        for kernel in re.findall(r"__kernel\s+(?:__attribute__\(\(.*?\)\)\s*)?void\s+(\w+)", src, re.S):
            found.add(kernel)
            assert re.search(rf"\|\s*`{re.escape(name)}`\s*\|\s*`{kernel}`\s*\|", readme), \
                f"README.md has no row for {name} {kernel}"
    with open(os.path.join(OPENCL, "common.cl")) as f:
        assert "__kernel" not in f.read(), "common.cl is prepended everywhere: helpers only"
    assert {"matmul", "rms_norm", "layer_norm", "rope", "softmax", "kv_store", "attention",
            "silu_mul", "gelu", "add", "mul", "scale", "to_f16", "add_bias", "gather", "mean_pool",
            "cls_pool", "l2_normalize", "argmax"} <= found


# ---------------------------------------------------------------- spectrum, conv1d

@pytest.mark.every_driver
def test_spectrum_kernels_match_numpy(env):
    """dft_basis as an STFT against numpy's rfft, power_spectrum, and mel_filterbank against
    librosa's Slaney formula written out in float64 (hz <-> mel linear below 1 kHz, log above)."""
    import whisper_numpy
    n_fft, n_mels, rate = 400, 80, 16000
    bins = n_fft // 2 + 1
    prg = env.build("spectrum", N_FFT=n_fft, N_MELS=n_mels, RATE=rate)
    basis = env.empty(4 * 2 * bins * n_fft)
    env.run(prg.dft_basis, (n_fft, 2 * bins), None, basis)
    w = env.read(basis, (2 * bins, n_fft))
    frames = rng(3).standard_normal((7, n_fft)).astype(np.float32)
    spec = np.fft.rfft(frames.astype(np.float64) * whisper_numpy.hann(n_fft), axis=1)
    proj = frames @ w.T
    assert_close(proj[:, :bins], spec.real, 1e-5)
    assert_close(np.abs(proj[:, bins:]), np.abs(spec.imag), 1e-5)    # sin rows: sign is immaterial to power
    pb = env.empty(4 * 7 * bins)
    env.run(prg.power_spectrum, (bins, 7), None, env.buf(proj.astype(np.float32)), pb, i32(7))
    assert_close(env.read(pb, (7, bins)), np.abs(spec) ** 2, 1e-4)
    fb = env.empty(4 * n_mels * bins)
    env.run(prg.mel_filterbank, (bins, n_mels), None, fb)
    assert_close(env.read(fb, (n_mels, bins)), whisper_numpy.mel_filters(rate, n_fft, n_mels), 1e-5)
    x = np.array([0.0, 1e-12, 3.5, 1e4], np.float32)
    xb = env.buf(x)
    env.run(prg.log10_floor, (4,), None, xb, i32(4), f32(1e-10))
    assert_close(env.read(xb, (4,)), np.log10(np.maximum(x.astype(np.float64), 1e-10)), 1e-6)


@pytest.mark.every_driver
@pytest.mark.parametrize("c,kw,stride,pad,dilation", [(80, 3, 1, 1, 1), (5, 3, 2, 1, 1), (4, 5, 1, 4, 2), (3, 7, 3, 0, 3)])
def test_im2col1d_is_a_conv1d_with_matmul(env, c, kw, stride, pad, dilation):
    """im2col1d, then the unfolded input times W[O, C, KW] viewed as [O, C*KW], equals a direct conv1d."""
    s_, t_in, o = 2, 37, 6
    t_out = (t_in + 2 * pad - dilation * (kw - 1) - 1) // stride + 1
    r = rng(c + kw)
    x = r.standard_normal((s_, t_in, c)).astype(np.float32)
    w = r.standard_normal((o, c, kw)).astype(np.float32)
    prg = env.build("conv1d", C=c, KW=kw, STRIDE=stride, PAD=pad, DILATION=dilation)
    yb = env.empty(4 * s_ * t_out * c * kw)
    env.run(prg.im2col1d, (c * kw, t_out, s_), None, env.buf(x), yb, i32(t_in), i32(t_out), i32(s_))
    cols = env.read(yb, (s_, t_out, c * kw))
    xp = np.pad(x.astype(np.float64), ((0, 0), (pad, pad), (0, 0)))
    want = np.zeros((s_, t_out, o))
    for t in range(t_out):
        for k in range(kw):
            want[:, t] += xp[:, t * stride + k * dilation] @ w[:, :, k].T
    assert_close(cols @ w.reshape(o, -1).T, want, 1e-5)


# ---------------------------------------------------------------- direct convolutions (VITS: HiFi-GAN, WaveNet, DDS)

def packed_offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def leaky(x, slope):
    return np.where(x < 0, x * slope, x) if slope is not None else x


def conv1d_ref(x, w, b, xo, yo, stride=1, pad=0, dil=1, slope=None):
    """Packed channels-last conv1d in float64: x [T_in, C], w [O, C, KW] -> [yo[-1], O];
    each sequence convolved alone, zero outside it."""
    x = leaky(np.asarray(x, np.float64), slope)
    o_, _, kw = w.shape
    y = np.zeros((yo[-1], o_))
    for s in range(len(xo) - 1):
        xs, n = x[xo[s]:xo[s + 1]], yo[s + 1] - yo[s]
        for k in range(kw):
            u = np.arange(n) * stride + k * dil - pad
            ok = (u >= 0) & (u < len(xs))
            y[yo[s]:yo[s + 1]][ok] += xs[u[ok]] @ w[:, :, k].T.astype(np.float64)
    return y + (0 if b is None else b)


def conv_transpose1d_ref(x, w, b, offs, stride, pad, slope=None):
    """Packed ConvTranspose1d, float64: x [T, C], w [C, O, KW] -> [stride*T, O]: each
    sequence's PyTorch output, frames 0 .. stride*n - 1 (zero past its end), plus bias."""
    x = leaky(np.asarray(x, np.float64), slope)
    _, o_, kw = w.shape
    y = np.zeros((stride * offs[-1], o_))
    for s in range(len(offs) - 1):
        xs = x[offs[s]:offs[s + 1]]
        n = len(xs)
        full = np.zeros(((n - 1) * stride + kw + 2 * pad + stride, o_))
        for m in range(n):
            full[m * stride:m * stride + kw] += (xs[m] @ w.reshape(len(w), -1)).reshape(o_, kw).T
        y[stride * offs[s]:stride * offs[s + 1]] = full[pad:pad + stride * n]
    return y + (0 if b is None else b)


def test_conv_references_match_vits_numpy():
    """The float64 references above, channels last, against tests/vits_numpy.py's conv1d
    (same padding, dilated, depthwise) and conv_transpose1d on one sequence each."""
    import vits_numpy as vn
    r = rng(700)
    x = r.standard_normal((23, 6)).astype(np.float32)
    w = r.standard_normal((5, 6, 5)).astype(np.float32)
    b = r.standard_normal(5).astype(np.float32)
    o = packed_offsets([23])
    assert_close(conv1d_ref(x, w, b, o, o, pad=6, dil=3), vn.conv1d(x.T, w, b, dilation=3).T, 1e-5)
    wd = r.standard_normal((6, 1, 3)).astype(np.float32)
    bd = r.standard_normal(6).astype(np.float32)
    assert_close(depthwise_ref(x, wd, bd, o, pad=9, dil=9), vn.conv1d(x.T, wd, bd, dilation=9, groups=6).T, 1e-5)
    wt = r.standard_normal((6, 4, 16)).astype(np.float32)
    assert_close(conv_transpose1d_ref(x, wt, b[:4], o, 8, 4), vn.conv_transpose1d(x.T, wt, b[:4], 8, 4).T, 1e-5)


def depthwise_ref(x, w, b, offs, pad, dil):
    x = np.asarray(x, np.float64)
    c, _, kw = w.shape
    y = np.zeros_like(x)
    for s in range(len(offs) - 1):
        xs = x[offs[s]:offs[s + 1]]
        for k in range(kw):
            u = np.arange(len(xs)) + k * dil - pad
            ok = (u >= 0) & (u < len(xs))
            y[offs[s]:offs[s + 1]][ok] += xs[u[ok]] * w[:, 0, k]
    return y + (0 if b is None else b)


def conv_in_view(env, x, ldx, x_off):
    """x [T, C] inside a wider buffer: row t at x_off + t*ldx (other elements are noise)."""
    t, c = x.shape
    buf = rng(1).standard_normal(x_off + max(t, 1) * ldx).astype(np.float32) * 1e3
    buf[x_off:x_off + t * ldx].reshape(t, ldx)[:, :c] = x
    return env.buf(buf)


# (C, O, KW, STRIDE, PAD, DILATION, lengths, macros, views): the voice's layers first
CONV_DIRECT = {
    "conv_pre": (192, 256, 7, 1, 3, 1, [13, 30, 7], dict(HAS_BIAS=True, OUTS_PER_ITEM=4, FRAMES_PER_ITEM=2), None),
    "rb_k7_d12_residual": (32, 32, 7, 1, 36, 12, [50, 3, 20], dict(HAS_BIAS=True, LEAKY=0.1, RESIDUAL=True), None),
    "rb_k5_d6_accumulate": (64, 64, 5, 1, 12, 6, [31, 40], dict(HAS_BIAS=True, LEAKY=0.1, RESIDUAL=True, ACCUMULATE=True), None),
    "rb_k3_d2": (128, 128, 3, 1, 2, 2, [9, 1, 12], dict(HAS_BIAS=True, LEAKY=0.1, OUTS_PER_ITEM=4, FRAMES_PER_ITEM=3), None),
    "conv_post_tanh": (32, 1, 7, 1, 3, 1, [40, 25], dict(LEAKY=0.01, OUT_TANH=True, OUTS_PER_ITEM=1, FRAMES_PER_ITEM=8), None),
    "wn_in_layer": (192, 384, 5, 1, 2, 1, [9, 17], dict(HAS_BIAS=True, OUTS_PER_ITEM=8, FRAMES_PER_ITEM=1), None),
    "stride2_f16_empty_seq": (12, 5, 4, 2, 1, 1, [10, 0, 7], dict(HAS_BIAS=True, WEIGHT_F16=True), None),
    "valid_vw1_views": (5, 3, 3, 1, 0, 2, [8, 6], dict(HAS_BIAS=True, LEAKY=0.2, ACCUMULATE=True, OUTS_PER_ITEM=2,
                                                      FRAMES_PER_ITEM=3), (9, 3, 7, 2)),
    "vw16_len1": (32, 16, 3, 1, 3, 3, [1, 40], dict(HAS_BIAS=True, VW=16, OUTS_PER_ITEM=2, FRAMES_PER_ITEM=2), None),
    "causal_pad": (8, 8, 3, 1, 2, 1, [6, 11], dict(RESIDUAL=True, OUTS_PER_ITEM=3, FRAMES_PER_ITEM=4), None),
    # the package's tiles (8 x 2-4, VW 16) and conv_post taking the mean of three ResBlock2 sums
    "wn_in_vw16_tile8x4": (192, 384, 5, 1, 2, 1, [9, 17], dict(HAS_BIAS=True, VW=16, OUTS_PER_ITEM=8, FRAMES_PER_ITEM=4), None),
    "rb_vw16_tile8x2_scaled": (32, 32, 5, 1, 12, 6, [31, 2], dict(HAS_BIAS=True, LEAKY=0.1, RESIDUAL=True, X_SCALE=0.5,
                                                                  VW=16, FRAMES_PER_ITEM=2), None),
    "conv_post_mean": (32, 1, 7, 1, 3, 1, [40, 25], dict(X_SCALE=1 / 3, LEAKY=0.01, OUT_TANH=True, OUTS_PER_ITEM=1,
                                                         FRAMES_PER_ITEM=8), None),
}


OUTER_MODES = ("copied", "tiled")     # weights as the checkpoint lays them out, or tiled at load (WEIGHT_TILES)


def conv_entries(cases, entries):
    """(case, entry, weights) params: every case through each entry that takes it (`make test-full`);
    `make test` takes each case through one of them, in turn."""
    params = []
    for i, case in enumerate(cases):
        usable = [(entry, mode) for entry, mode in entries if entry.endswith("direct") or "transpose" in entry
                  or not cases[case][7].get("OUT_TANH")]
        params += [pytest.param(case, entry, mode, marks=() if j == i % len(usable) else pytest.mark.full)
                   for j, (entry, mode) in enumerate(usable)]
    return params


@pytest.mark.parametrize("case,entry,weights", conv_entries(CONV_DIRECT, [("conv1d_direct", "copied")] +
                                                            [("conv1d_outer", mode) for mode in OUTER_MODES]))
def test_conv1d_direct(env, case, entry, weights):
    """conv1d_direct, and conv1d_outer (the same contract as outer products over output
    vectors, OUT_VECS x OUT_VW outputs by 8 frames a tile: a partial last vector when
    OUT_VW does not divide O), on packed sequences against the float64 loop: bias, fused
    leaky input (scaled first with X_SCALE), residual, tanh (direct only), accumulate,
    stride, dilation beyond a sequence's length, empty and one-frame sequences, tail
    outputs and frames, F16 weights, views; any G1, same bits; a T past y_offsets[S]
    writes nothing more. conv1d_outer reads its weights either as the checkpoint lays them
    out or tiled at load (runtime.tile, WEIGHT_TILES = OUT_VW): the same bits either way."""
    c, o, kw, stride, pad, dil, lengths, macros, views = CONV_DIRECT[case]
    if entry == "conv1d_outer":         # no OUT_TANH: conv_post's one output runs conv1d_direct
        macros = {k: v for k, v in macros.items() if k not in ("OUTS_PER_ITEM", "FRAMES_PER_ITEM")}
        macros.update(OUT_VW=16 if o >= 16 else 4, OUT_VECS=2, FRAMES_PER_ITEM=8)
    r = rng(710 + len(case))
    xo = packed_offsets(lengths)
    yo = packed_offsets([(n + 2 * pad - dil * (kw - 1) - 1) // stride + 1 if n else 0 for n in lengths])
    if macros.get("RESIDUAL"):      # frame t's own input row: as many output frames as input ones
        yo = xo                     # (for causal_pad, PAD = KW - 1: left padding only)
        assert c == o
    t_in, t_out = int(xo[-1]), int(yo[-1])
    x = r.standard_normal((t_in, c)).astype(np.float32)
    w = (r.standard_normal((o, c, kw)) / np.sqrt(c * kw)).astype(np.float32)
    b = r.standard_normal(o).astype(np.float32)
    kind = "F16" if macros.get("WEIGHT_F16") else "F32"
    wdev, w64 = make_weights(kind, w)
    if weights == "tiled":
        wdev = tile(wdev, 0, macros["OUT_VW"])
        macros["WEIGHT_TILES"] = macros["OUT_VW"]
    ldx, x_off, ldy, y_off = views or (c, 0, o, 0)
    y0 = r.standard_normal((t_out, o)).astype(np.float32)
    slope = macros.get("LEAKY")
    xs = np.float32(macros.get("X_SCALE", 1.0))      # scales the conv's input, not the residual
    want = conv1d_ref(x * xs, w64, b if macros.get("HAS_BIAS") else None, xo, yo, stride, pad, dil, slope)
    if macros.get("RESIDUAL"):
        want = want + x
    if macros.get("OUT_TANH"):
        want = np.tanh(want)
    if macros.get("ACCUMULATE"):
        want = want + y0
    prg = env.build("conv1d", C=c, O=o, KW=kw, STRIDE=stride, PAD=pad, DILATION=dil, **macros)
    ot = macros["OUT_VW"] * macros["OUT_VECS"] if entry == "conv1d_outer" else macros.get("OUTS_PER_ITEM", 8)
    xb, ob_x, ob_y = conv_in_view(env, x, ldx, x_off), env.buf(xo), env.buf(yo)
    results = []
    for g1 in (1, 3, 64):
        yb = conv_in_view(env, y0, ldy, y_off)
        env.run(getattr(prg, entry), (-(-o // ot), g1), (1, 1), xb, i32(x_off), i32(ldx), env.buf(wdev),
                env.buf(b), yb, i32(y_off), i32(ldy), ob_x, ob_y, i32(len(lengths)), i32(t_out + 50 * (g1 == 3)))   # a T too large is clamped
        full = env.read(yb, y_off + max(t_out, 1) * ldy)
        got = full[y_off:y_off + t_out * ldy].reshape(t_out, ldy)
        assert_close(got[:, :o], want, 1e-5)
        if ldy > o:      # untouched outside the view
            np.testing.assert_array_equal(got[:, o:], conv_in_view_ref(y0, ldy, y_off)[:, o:])
        results.append(got[:, :o])
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


@pytest.mark.parametrize("weights", OUTER_MODES)
@pytest.mark.parametrize("c,h,kw,dil,lengths,kind", [(192, 192, 5, 1, [9, 17], "F32"),
                                                      (8, 32, 3, 2, [5, 0, 12], "F16")])
def test_conv1d_outer_gate(env, c, h, kw, dil, lengths, kind, weights):
    """conv1d_outer with GATE=H stores WaveNet's gate of its 2H outputs, tanh of the first
    half times sigmoid of the second (VITS's flows), into a view of Y: packed sequences,
    F16 weights, weights as stored or tiled, any G1 the same bits; the build refuses a GATE
    it cannot honour, and tiles of another width than OUT_VW."""
    r = rng(c + h + kw)
    pad = dil * (kw - 1) // 2
    xo = packed_offsets(lengths)
    t = int(xo[-1])
    x = r.standard_normal((t, c)).astype(np.float32)
    w = (r.standard_normal((2 * h, c, kw)) / np.sqrt(c * kw)).astype(np.float32)
    b = r.standard_normal(2 * h).astype(np.float32)
    wdev, w64 = make_weights(kind, w)
    tiles = 16 if weights == "tiled" else 0
    if tiles:
        wdev = tile(wdev, 0, tiles)
    v = conv1d_ref(x, w64, b, xo, xo, 1, pad, dil, None)
    want = np.tanh(v[:, :h]) / (1 + np.exp(-v[:, h:]))
    prg = env.build("conv1d", C=c, O=2 * h, KW=kw, PAD=pad, DILATION=dil, HAS_BIAS=True, OUT_VW=16, OUT_VECS=2,
                    FRAMES_PER_ITEM=8, GATE=h, WEIGHT_TILES=tiles, **{f"WEIGHT_{kind}": True})
    ldy = h + 5
    ob = env.buf(xo)
    results = []
    for g1 in (1, 3):
        y0 = np.full((max(t, 1), ldy), 7.0, np.float32)
        yb = env.buf(y0)
        env.run(prg.conv1d_outer, (h // 16, g1), (1, 1), env.buf(x), i32(0), i32(c), env.buf(wdev), env.buf(b), yb,
                i32(0), i32(ldy), ob, ob, i32(len(lengths)), i32(t))
        got = env.read(yb, (max(t, 1), ldy))[:t]
        assert_close(got[:, :h], want, 1e-5)
        assert np.all(got[:, h:] == 7.0)          # the view's other columns untouched
        results.append(got)
    np.testing.assert_array_equal(results[0], results[1])
    with pytest.raises(Exception, match="GATE"):
        env.build("conv1d", C=c, O=2 * h + 16, KW=kw, OUT_VW=16, GATE=h)
    with pytest.raises(Exception, match="WEIGHT_TILES"):
        env.build("conv1d", C=c, O=2 * h, KW=kw, OUT_VW=16, GATE=h, WEIGHT_TILES=8)


def conv_in_view_ref(x, ldx, x_off):
    t, c = x.shape
    buf = rng(1).standard_normal(x_off + max(t, 1) * ldx).astype(np.float32) * 1e3
    buf[x_off:x_off + t * ldx].reshape(t, ldx)[:, :c] = x
    return buf[x_off:x_off + t * ldx].reshape(t, ldx)


# (C, KW, DILATION, lengths, macros, views): the duration predictor's DDS convs first
CONV_DEPTHWISE = {
    "dds_d1": (192, 3, 1, [5, 20, 2], dict(HAS_BIAS=True), None),
    "dds_d3": (192, 3, 3, [5, 20, 2], dict(HAS_BIAS=True, FRAMES_PER_ITEM=4), None),
    "dds_d9_f16": (192, 3, 9, [5, 20, 2], dict(HAS_BIAS=True, WEIGHT_F16=True), None),
    "vw1_accumulate_views": (5, 5, 2, [7, 0, 9], dict(ACCUMULATE=True, FRAMES_PER_ITEM=3), (8, 3, 6, 1)),
    "vw16": (32, 7, 1, [1, 15], dict(HAS_BIAS=True, VW=16, FRAMES_PER_ITEM=1), None),
}


@pytest.mark.every_driver
@pytest.mark.parametrize("case", list(CONV_DEPTHWISE))
def test_conv1d_depthwise(env, case):
    c, kw, dil, lengths, macros, views = CONV_DEPTHWISE[case]
    pad = dil * (kw - 1) // 2
    r = rng(720 + len(case))
    offs = packed_offsets(lengths)
    t = int(offs[-1])
    x = r.standard_normal((t, c)).astype(np.float32)
    w = r.standard_normal((c, 1, kw)).astype(np.float32)
    b = r.standard_normal(c).astype(np.float32)
    wdev, w64 = make_weights("F16" if macros.get("WEIGHT_F16") else "F32", w)
    ldx, x_off, ldy, y_off = views or (c, 0, c, 0)
    y0 = r.standard_normal((t, c)).astype(np.float32)
    want = depthwise_ref(x, w64, b if macros.get("HAS_BIAS") else None, offs, pad, dil)
    if macros.get("ACCUMULATE"):
        want = want + y0
    prg = env.build("conv1d", C=c, KW=kw, PAD=pad, DILATION=dil, **macros)
    vw = macros.get("VW", 8 if c % 8 == 0 else 4 if c % 4 == 0 else 1)
    xb, ob = conv_in_view(env, x, ldx, x_off), env.buf(offs)
    results = []
    for g1 in (1, 4, 64):
        yb = conv_in_view(env, y0, ldy, y_off)
        env.run(prg.conv1d_depthwise, (c // vw, g1), (1, 1), xb, i32(x_off), i32(ldx), env.buf(wdev), env.buf(b),
                yb, i32(y_off), i32(ldy), ob, i32(len(lengths)), i32(t + 50 * (g1 == 4)))
        got = env.read(yb, y_off + max(t, 1) * ldy)[y_off:y_off + t * ldy].reshape(t, ldy)
        assert_close(got[:, :c], want, 1e-5)
        if ldy > c:
            np.testing.assert_array_equal(got[:, c:], conv_in_view_ref(y0, ldy, y_off)[:, c:])
        results.append(got[:, :c])
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


# (C, O, KW, STRIDE, PAD, lengths, macros, views): the voice's upsamplers first
CONV_TRANSPOSE = {
    "ups0": (256, 128, 16, 8, 4, [3, 5], dict(HAS_BIAS=True, LEAKY=0.1, OUTS_PER_ITEM=4, FRAMES_PER_ITEM=2), None),
    "ups1_f16": (128, 64, 16, 8, 4, [4, 1, 6], dict(HAS_BIAS=True, LEAKY=0.1, WEIGHT_F16=True), None),
    "ups2": (64, 32, 8, 4, 2, [20, 1, 9], dict(HAS_BIAS=True, LEAKY=0.1, OUTS_PER_ITEM=8, FRAMES_PER_ITEM=1), None),
    "odd_tails_accumulate_views": (12, 5, 5, 3, 1, [7, 0, 4], dict(HAS_BIAS=True, ACCUMULATE=True, FRAMES_PER_ITEM=3),
                                   (13, 2, 9, 3)),
    "kw_longer_vw1": (5, 3, 3, 2, 0, [6, 2], dict(HAS_BIAS=True, OUTS_PER_ITEM=2), None),
    "kw_shorter_stride": (4, 3, 2, 3, 0, [5, 3], dict(HAS_BIAS=True), None),
    "pad_beyond_stride": (8, 4, 11, 3, 4, [6, 1, 4], dict(LEAKY=0.3, VW=4), None),
    "ups1_mean_vw16": (128, 64, 16, 8, 4, [4, 1, 6], dict(HAS_BIAS=True, LEAKY=0.1, X_SCALE=1 / 3, VW=16,
                                                          FRAMES_PER_ITEM=2), None),
}


@pytest.mark.every_driver
@pytest.mark.parametrize("case,entry,weights", conv_entries(CONV_TRANSPOSE, [("conv_transpose1d", "copied")] +
                                                            [("conv_transpose1d_outer", mode) for mode in OUTER_MODES]))
def test_conv_transpose1d(env, case, entry, weights):
    """conv_transpose1d and conv_transpose1d_outer (outer products, as conv1d_outer): STRIDE * n
    output frames per sequence equal to PyTorch's when KW - 2*PAD == STRIDE (HiFi-GAN), truncated
    or bias-extended otherwise; packed sequences (one frame, empty), fused leaky input (scaled
    first with X_SCALE), F16 weights, tails, views; any G1, same bits. The outer kernel reads
    W [C, O, KW] as stored or tiled along O at load (tile(w, 1, OUT_VW))."""
    c, o, kw, stride, pad, lengths, macros, views = CONV_TRANSPOSE[case]
    if entry == "conv_transpose1d_outer":
        macros = {k: v for k, v in macros.items() if k not in ("OUTS_PER_ITEM", "FRAMES_PER_ITEM")}
        macros.update(OUT_VW=16 if o >= 16 else 4, OUT_VECS=2, FRAMES_PER_ITEM=8)
    r = rng(730 + len(case))
    offs = packed_offsets(lengths)
    t = int(offs[-1])
    x = r.standard_normal((t, c)).astype(np.float32)
    w = (r.standard_normal((c, o, kw)) / np.sqrt(c)).astype(np.float32)
    b = r.standard_normal(o).astype(np.float32)
    wdev, w64 = make_weights("F16" if macros.get("WEIGHT_F16") else "F32", w)
    if weights == "tiled":
        wdev = tile(wdev, 1, macros["OUT_VW"])
        macros["WEIGHT_TILES"] = macros["OUT_VW"]
    ldx, x_off, ldy, y_off = views or (c, 0, o, 0)
    t_out = stride * t
    y0 = r.standard_normal((t_out, o)).astype(np.float32)
    xs = np.float32(macros.get("X_SCALE", 1.0))
    want = conv_transpose1d_ref(x * xs, w64, b if macros.get("HAS_BIAS") else None, offs, stride, pad, macros.get("LEAKY"))
    if macros.get("ACCUMULATE"):
        want = want + y0
    prg = env.build("conv1d", C=c, O=o, KW=kw, STRIDE=stride, PAD=pad, **macros)
    ot = macros["OUT_VW"] * macros["OUT_VECS"] if entry == "conv_transpose1d_outer" else macros.get("OUTS_PER_ITEM", 8)
    xb, ob = conv_in_view(env, x, ldx, x_off), env.buf(offs)
    results = []
    for g1 in (1, 2, 64):
        yb = conv_in_view(env, y0, ldy, y_off)
        env.run(getattr(prg, entry), (-(-o // ot), stride, g1), (1, 1, 1), xb, i32(x_off), i32(ldx), env.buf(wdev),
                env.buf(b), yb, i32(y_off), i32(ldy), ob, i32(len(lengths)), i32(t + 50 * (g1 == 2)))
        got = env.read(yb, y_off + max(t_out, 1) * ldy)[y_off:y_off + t_out * ldy].reshape(t_out, ldy)
        assert_close(got[:, :o], want, 1e-5)
        if ldy > o:
            np.testing.assert_array_equal(got[:, o:], conv_in_view_ref(y0, ldy, y_off)[:, o:])
        results.append(got[:, :o])
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


@pytest.mark.every_driver
def test_conv_build_errors_and_absent_kernels(env):
    """VW must divide C; conv_transpose1d exists only with DILATION 1; without O only
    im2col1d and conv1d_depthwise exist; OUT_VW builds the outer kernels instead of the
    direct ones, and never with OUT_TANH; only they read tiled weights (WEIGHT_TILES)."""
    with pytest.raises(cl.RuntimeError):
        env.build("conv1d", C=12, O=4, KW=3, VW=8)
    with pytest.raises(cl.LogicError):
        env.build("conv1d", C=8, O=4, KW=3, DILATION=2).conv_transpose1d
    prg = env.build("conv1d", C=8, KW=3)
    prg.conv1d_depthwise
    with pytest.raises(cl.LogicError):
        prg.conv1d_direct
    outer = env.build("conv1d", C=8, O=4, KW=3, OUT_VW=4)       # OUT_VW: the outer family instead
    outer.conv1d_outer, outer.conv_transpose1d_outer
    with pytest.raises(cl.LogicError):
        outer.conv1d_direct
    with pytest.raises(cl.RuntimeError):
        env.build("conv1d", C=8, O=4, KW=3, OUT_VW=4, OUT_TANH=True)
    with pytest.raises(cl.RuntimeError):       # tiled weights: the outer kernels only
        env.build("conv1d", C=8, O=4, KW=3, WEIGHT_TILES=4)


def test_hifigan_stage_from_library_kernels(env):
    """One HiFi-GAN upsampling stage of the voice's last shape (64 -> 32 channels, x4, MRF of
    ResBlock2 k3/5/7, dilations [1,2], [2,6], [3,12]) on two packed sequences, composed as a
    package would (conv_transpose1d with fused leaky, conv1d_direct with LEAKY + RESIDUAL and
    ACCUMULATE for the sum, scale by 1/3), against vits_numpy's resblock and conv_transpose1d
    run on each sequence alone."""
    import vits_numpy as vn
    c_in, c, up, kw_up, pad_up = 64, 32, 4, 8, 2
    kernels, dils = [3, 5, 7], [[1, 2], [2, 6], [3, 12]]
    r = rng(740)
    W = {"hp": {"resblock_kernel_sizes": kernels, "resblock_dilation_sizes": dils, "resblock": "2"},
         "ups.w": (r.standard_normal((c_in, c, kw_up)) / 8).astype(np.float32),
         "ups.b": (r.standard_normal(c) * 0.1).astype(np.float32)}
    for j, k in enumerate(kernels):
        for i in range(2):
            W[f"dec.resblocks.{j}.convs.{i}.weight"] = (r.standard_normal((c, c, k)) / np.sqrt(c * k)).astype(np.float32)
            W[f"dec.resblocks.{j}.convs.{i}.bias"] = (r.standard_normal(c) * 0.1).astype(np.float32)
    lengths = [9, 14]
    xo = packed_offsets(lengths)
    x = r.standard_normal((int(xo[-1]), c_in)).astype(np.float32)
    want = []
    for s in range(2):
        h = vn.conv_transpose1d(vn.leaky_relu(x[xo[s]:xo[s + 1]].T, 0.1), W["ups.w"], W["ups.b"], up, pad_up)
        xs = sum(vn.resblock(W, f"dec.resblocks.{j}", h) for j in range(3))
        want.append((xs / np.float32(3)).T)
    want = np.concatenate(want)

    t = int(xo[-1]) * up
    yo = env.buf(xo * up)
    hb, ab, bb, sb = (env.empty(4 * t * c) for _ in range(4))
    ups = env.build("conv1d", C=c_in, O=c, KW=kw_up, STRIDE=up, PAD=pad_up, HAS_BIAS=True, LEAKY=0.1)
    env.run(ups.conv_transpose1d, (c // 8, up, 8), (1, 1, 1), env.buf(x), i32(0), i32(c_in), env.buf(W["ups.w"]),
            env.buf(W["ups.b"]), hb, i32(0), i32(c), env.buf(xo), i32(2), i32(xo[-1]))
    for j, k in enumerate(kernels):
        src = hb
        for i, d in enumerate(dils[j]):
            last = i == len(dils[j]) - 1
            prg = env.build("conv1d", C=c, O=c, KW=k, DILATION=d, PAD=d * (k - 1) // 2, HAS_BIAS=True, LEAKY=0.1,
                            RESIDUAL=True, ACCUMULATE=last and j > 0, OUTS_PER_ITEM=8, FRAMES_PER_ITEM=1)
            dst = sb if last else (ab if src is not ab else bb)
            env.run(prg.conv1d_direct, (c // 8, 16), (1, 1), src, i32(0), i32(c),
                    env.buf(W[f"dec.resblocks.{j}.convs.{i}.weight"]), env.buf(W[f"dec.resblocks.{j}.convs.{i}.bias"]),
                    dst, i32(0), i32(c), yo, yo, i32(2), i32(t))
            src = dst
    ew = env.build("elementwise")
    env.run(ew.scale, (-(-t * c // 64) * 64,), (64,), sb, i32(t * c), f32(1.0 / 3.0))
    assert_close(env.read(sb, (t, c)), want, 1e-5)


@pytest.mark.every_driver
@pytest.mark.parametrize("size_t", ADDRESSING)
def test_vits_elementwise(env, size_t):
    """leaky_relu, tanh_act, tanh_sigmoid_mul (WaveNet gate on the halves of one [T, 2H]
    buffer) and mask_rows."""
    f, t = 37, 6
    prg = env.build("elementwise", F=f, EW_SIZE_T=size_t)
    r = rng(750)
    n = 1000
    x = (r.standard_normal(n) * 4).astype(np.float32)
    x[:8] = [-50.0, 50.0, 0.0, -0.0, 1e-3, -1e-6, 0.625, -0.6251]
    x64 = x.astype(np.float64)
    xb, yb = env.buf(x), env.empty(4 * n)
    env.run(prg.leaky_relu, (1024,), (64,), xb, yb, i32(n), f32(0.1))
    np.testing.assert_array_equal(env.read(yb, n), np.where(x < 0, x * np.float32(0.1), x))
    env.run(prg.tanh_act, (1024,), (64,), xb, yb, i32(n))
    got = env.read(yb, n)
    assert_close(got, np.tanh(x64), 1e-6)
    np.testing.assert_allclose(got[4:6], np.tanh(x64[4:6]), rtol=1e-6)     # relative accuracy near 0
    assert got[0] == -1.0 and got[1] == 1.0
    env.run(prg.tanh_act, (1024,), (64,), xb, xb, i32(n))                    # in place
    np.testing.assert_array_equal(env.read(xb, n), got)

    gu = (r.standard_normal((t, 2 * f)) * 3).astype(np.float32)
    gu[0, :3], gu[0, f:f + 3] = [-30.0, 30.0, 0.0], [-100.0, 100.0, 0.0]
    g64, u64 = gu[:, :f].astype(np.float64), gu[:, f:].astype(np.float64)
    b, ob = env.buf(gu), env.empty(4 * t * f)
    env.run(prg.tanh_sigmoid_mul, (f, t), None, b, i32(0), i32(2 * f), b, i32(f), i32(2 * f), ob, i32(0), i32(f), i32(t))
    assert_close(env.read(ob, (t, f)), np.tanh(g64) / (1 + np.exp(-u64)), 1e-6)

    y = r.standard_normal((t, 2 * f)).astype(np.float32)
    keep = np.array([1, 0, 1, 0, 0, 1], np.int32)
    yb2 = env.buf(y)
    env.run(prg.mask_rows, (f, t), None, yb2, i32(f), i32(2 * f), env.buf(keep), i32(t))
    want = y.copy()
    want[keep == 0, f:] = 0
    np.testing.assert_array_equal(env.read(yb2, (t, 2 * f)), want)
