"""Matmul bandwidth and throughput of the opencl/ kernel library.

Prints, for a Qwen2.5-0.5B-like FFN matrix (N=4864, K=896) and an attention
projection (896x896), in F32, F16, Q8_0 and Q4_0:
  - T=1 (decode matvec): GB/s of weight bytes, per launch (wall, launches back
    to back, one finish per batch) and per kernel (profiling events);
  - T=4 (a decode cohort) and T=64 (a prefill chunk): effective tokens/s;
next to the DRAM read bandwidth numpy measures in the same run (best of
several sums of a 256 MiB array, on one thread and on two), and the ratios.
Weights rotate through copies spanning >= 256 MiB so every call reads DRAM,
not the last-level cache. Also prints the cost of a kernel launch.

Never asserts: figures only. Machines are noisy; compare ratios within one run.

With --sweep, instead: for each weight type, T in --sweep-t and matrix in
--sweep-shapes (FFN up 4864x896 and down 896x4864), every geometry of a small grid (ROWS_PER_ITEM, TOKENS_PER_ITEM,
WG, VW), fastest first, beside the geometry the llama package picks today
(float activations), so
each driver's best geometry is measured on that driver (opencl/README.md).

    python bench/kernels.py [--quick] [--rounds N] [--device SELECTOR] [--sweep]
"""

import argparse
import os
import sys
import threading
import time

import numpy as np
import pyopencl as cl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPENCL = os.path.join(ROOT, "opencl")
QK = 32
POOL_BYTES = 256 << 20

# (ROWS_PER_ITEM, TOKENS_PER_ITEM, WG, VW) per T and weight kind: the choices
# opencl/README.md recommends for Intel's runtime and PoCL 3.1 (--sweep picked them).
DECODE = (1, 1, 8, 16)
COHORT = (1, 4, 8, 16)
PREFILL = {"F32": (4, 4, 8, 16), "F16": (4, 4, 8, 16), "Q8_0": (4, 4, 8, 16), "Q4_0": (4, 4, 8, 16)}


def geometries(kind, t):
    if t == 1:
        return [DECODE]
    if t <= 8:
        return [COHORT]
    return [PREFILL[kind], COHORT]


def pick_device(selector=None):
    """The device loom would use (probing, driver preference, --device selectors)."""
    sys.path.insert(0, os.path.dirname(OPENCL))
    from loom import device as loom_device
    found = loom_device._enumerate()
    return found[loom_device.select_device([info for _, info in found], selector)][0]


def numpy_bandwidth(reps):
    a = np.ones(POOL_BYTES // 4, np.float32)
    a.sum()
    best1 = best2 = float("inf")
    halves = [a[: len(a) // 2], a[len(a) // 2:]]
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        best1 = min(best1, time.perf_counter() - t)
        threads = [threading.Thread(target=h.sum) for h in halves]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        best2 = min(best2, time.perf_counter() - t)
    return a.nbytes / best1 / 1e9, a.nbytes / best2 / 1e9


def quantize(kind, w):
    """ggml reference quantization (as in tests/test_kernels.py), raw bytes."""
    if kind == "F32":
        return w.astype(np.float32)
    if kind == "F16":
        return w.astype(np.float16)
    b = w.reshape(-1, QK)
    if kind == "Q8_0":
        d = np.abs(b).max(axis=1) / np.float32(127)
        inv = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
        v = b * inv[:, None]
        q = np.trunc(v + np.copysign(0.5, v)).astype(np.int8).view(np.uint8)
    else:
        m = b[np.arange(len(b)), np.abs(b).argmax(axis=1)]
        d = m / np.float32(-8)
        inv = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
        q = np.clip(np.minimum(15, np.trunc(b * inv[:, None] + 8.5)), 0, 15).astype(np.uint8)
        q = q[:, :16] | (q[:, 16:] << 4)
    d16 = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return np.concatenate([d16, q], axis=1).reshape(w.shape[0], -1)


class Bench:
    def __init__(self, selector=None):
        self.device = pick_device(selector)
        self.ctx = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
        with open(os.path.join(OPENCL, "common.cl")) as f:
            self.common = f.read()
        with open(os.path.join(OPENCL, "matmul.cl")) as f:
            self.matmul_src = f.read()
        self.pool = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, POOL_BYTES + (64 << 20))
        self.align = max(4096, self.device.mem_base_addr_align // 8)
        self.io = {}
        self.weight_cache = {}

    def activations(self, t, k, n):
        """X and Y allocated once per shape: on PoCL a freshly allocated buffer
        pair changed prefill speed by up to 2x from one allocation to the next."""
        if (t, k, n) not in self.io:
            x = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                          hostbuf=np.random.default_rng(1).standard_normal((t, k)).astype(np.float32))
            self.io[(t, k, n)] = (x, cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, t * n * 4))
        return self.io[(t, k, n)]

    def kernel(self, kind, n, k, geometry):
        rpi, tpi, wg, vw, accs = (tuple(geometry) + (0,))[:5]     # accs 0: the kernel's default
        opts = [f"-DK={k}", f"-DN={n}", f"-DWEIGHT_{kind}", f"-DROWS_PER_ITEM={rpi}",
                f"-DTOKENS_PER_ITEM={tpi}", f"-DWG={wg}", f"-DVW={vw}", f"-DACCS={accs}"]
        prg = cl.Program(self.ctx, self.common + "\n" + self.matmul_src).build(options=opts)
        return cl.Kernel(prg, "matmul")

    def weights(self, kind, n, k):
        """Sub-buffers of the pool, each a copy of one real matrix of this kind."""
        raw = quantize(kind, np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05)
        src = cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=raw)
        stride = -(-raw.nbytes // self.align) * self.align
        count = max(2, POOL_BYTES // stride)
        subs = []
        for i in range(count):
            cl.enqueue_copy(self.queue, self.pool, src, byte_count=raw.nbytes, dst_offset=i * stride)
            subs.append(self.pool.get_sub_region(i * stride, raw.nbytes))
        self.queue.finish()
        return subs, raw.nbytes

    def measure(self, kind, n, k, t, geometry, passes):
        """(seconds per call wall, seconds per call in-kernel)."""
        kern = self.kernel(kind, n, k, geometry)
        if (kind, n, k) not in self.weight_cache:   # one copy set at a time: the pool is shared
            self.weight_cache = {(kind, n, k): self.weights(kind, n, k)[0]}
        subs = self.weight_cache[(kind, n, k)]
        x, y = self.activations(t, k, n)
        rpi, wg = geometry[0], geometry[2]
        gsize = (-(-(-(-n // rpi)) // wg) * wg, 1)
        calls = subs
        if t >= 64:  # compute-bound: fewer calls are enough
            calls = subs[: max(4, min(len(subs), 16))]
        best_wall = best_kernel = float("inf")
        for p in range(passes + 1):
            events = []
            start = time.perf_counter()
            for w in calls:
                kern.set_args(x, np.int32(0), np.int32(k), w, None, y, np.int32(0), np.int32(n), np.int32(t))
                events.append(cl.enqueue_nd_range_kernel(self.queue, kern, gsize, (wg, 1)))
            self.queue.finish()
            wall = (time.perf_counter() - start) / len(calls)
            kernel = sum(e.profile.end - e.profile.start for e in events) / 1e9 / len(calls)
            if p:  # the first pass warms up (and compiles for this launch shape)
                best_wall, best_kernel = min(best_wall, wall), min(best_kernel, kernel)
        return best_wall, best_kernel

    def launch_cost(self):
        prg = cl.Program(self.ctx, self.common + "\n" + open(os.path.join(OPENCL, "elementwise.cl")).read()).build()
        kern = cl.Kernel(prg, "scale")
        y = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, 64)
        kern.set_args(y, np.int32(8), np.float32(1.0))
        for _ in range(50):
            cl.enqueue_nd_range_kernel(self.queue, kern, (8,), (8,))
        self.queue.finish()
        best_batch = best_sync = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(1000):
                cl.enqueue_nd_range_kernel(self.queue, kern, (8,), (8,))
            self.queue.finish()
            best_batch = min(best_batch, (time.perf_counter() - t) / 1000)
            t = time.perf_counter()
            for _ in range(200):
                cl.enqueue_nd_range_kernel(self.queue, kern, (8,), (8,))
                self.queue.finish()
            best_sync = min(best_sync, (time.perf_counter() - t) / 200)
        return best_batch, best_sync


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round, fewer passes")
    ap.add_argument("--rounds", type=int, default=3,
                    help="measure everything this many times, spread over the run, keep the best")
    ap.add_argument("--device", default=None, help="as loom's --device")
    ap.add_argument("--sweep", action="store_true", help="time a grid of geometries per weight type and T")
    ap.add_argument("--sweep-shapes", default="4864x896,896x4864", help="NxK matrices to sweep")
    ap.add_argument("--sweep-t", default="1,4,64", help="token counts to sweep")
    args = ap.parse_args()
    passes, rounds = (2, 1) if args.quick else (3, max(1, args.rounds))

    b = Bench(args.device)
    print(f"device: {b.device.name.strip()} ({b.device.platform.name.strip()} "
          f"{b.device.platform.version.strip()}), {b.device.max_compute_units} compute units")
    if args.sweep:
        shapes = [tuple(map(int, shape.split("x"))) for shape in args.sweep_shapes.split(",")]
        return sweep(b, passes, shapes, [int(t) for t in args.sweep_t.split(",")])
    shapes = [("4864x896", 4864, 896), ("896x896", 896, 896)]
    kinds = ["F32", "F16", "Q8_0", "Q4_0"]
    cases = [(n, k, kind, 1, DECODE) for _, n, k in shapes for kind in kinds]
    cases += [(n, k, kind, t, g) for _, n, k in shapes for kind in kinds
              for t in (4, 64) for g in geometries(kind, t)]
    best = {}
    bw1 = bw2 = 0.0
    batch = sync = float("inf")
    for _ in range(rounds):
        one, two = numpy_bandwidth(3 if args.quick else 5)
        bw1, bw2 = max(bw1, one), max(bw2, two)
        lb, ls = b.launch_cost()
        batch, sync = min(batch, lb), min(sync, ls)
        for case in cases:
            wall, kern = b.measure(case[2], case[0], case[1], case[3], case[4], passes)
            old = best.get(case, (float("inf"), float("inf")))
            best[case] = (min(old[0], wall), min(old[1], kern))
    dram = max(bw1, bw2)

    print(f"numpy DRAM read bandwidth (sum of 256 MiB, best of several): "
          f"{bw1:.1f} GB/s on 1 thread, {bw2:.1f} GB/s on 2 threads -> reference {dram:.1f} GB/s")
    print(f"kernel launch: {batch * 1e6:.1f} us each back to back, {sync * 1e6:.1f} us with finish() per launch")
    print(f"(best of {rounds} round(s) x {passes} passes per figure)")
    print()
    print("matvec T=1 (decode), geometry ROWS_PER_ITEM,TOKENS_PER_ITEM,WG,VW = "
          + ",".join(map(str, DECODE)))
    print(f"{'matrix':<12}{'weights':<8}{'MiB':>7}{'GB/s wall':>11}{'GB/s kernel':>13}"
          f"{'ratio wall':>12}{'ratio kernel':>14}{'calls/s':>9}")
    for label, n, k in shapes:
        for kind in kinds:
            wall, kern = best[(n, k, kind, 1, DECODE)]
            nbytes = quantize_bytes(kind, n, k)
            print(f"{label:<12}{kind:<8}{nbytes / 2**20:>7.2f}{nbytes / wall / 1e9:>11.1f}"
                  f"{nbytes / kern / 1e9:>13.1f}{nbytes / wall / 1e9 / dram:>12.0%}"
                  f"{nbytes / kern / 1e9 / dram:>14.0%}{1 / wall:>9.0f}")
    print()
    print("batched: effective tokens/s = T / seconds per call (wall); weight GB/s; speed-up over T=1")
    print(f"{'matrix':<12}{'weights':<8}{'T':>4}{'geometry':>12}{'tok/s':>10}{'GB/s':>8}{'vs T=1':>9}")
    for label, n, k in shapes:
        for kind in kinds:
            nbytes = quantize_bytes(kind, n, k)
            decode = best[(n, k, kind, 1, DECODE)][0]
            for t in (4, 64):
                for g in geometries(kind, t):
                    wall = best[(n, k, kind, t, g)][0]
                    print(f"{label:<12}{kind:<8}{t:>4}{','.join(map(str, g)):>12}"
                          f"{t / wall:>10.0f}{nbytes / wall / 1e9:>8.1f}{t * decode / wall:>8.1f}x")
    return 0


def package_geometry(kind, t, k, driver, vector_width):
    """What models/llama/llama.loom picks (float activations) on `driver`, for comparison."""
    if driver in ("intel", "pocl") and vector_width == 8:     # its AVX2 table
        floatw = kind in ("F16", "F32")
        rows = 4 if t >= 16 and floatw else 2 if t >= 2 and not floatw else 1
        return (rows, 2 if t >= 16 and floatw else 4 if t >= 3 else t, 8, 8, 4 if t == 1 else 0)
    wide = t >= 16 or (t >= 2 and k >= 4096)
    rows, vw = (4, 16) if driver in ("intel", "pocl") else (2, 8)   # its WIDE_ROWS, WIDE_VW
    return (rows if wide else 1, 4 if t >= 3 else t, 8, vw if wide else 16)


def sweep(b, passes, shapes, ts):
    from loom.device import driver_family
    driver = driver_family(b.device.platform.name)
    cases = [(n, k, kind, t) for n, k in shapes for kind in ("F16", "Q8_0", "Q4_0") for t in ts]
    for n, k, kind, t in cases:
        ours_g = package_geometry(kind, t, k, driver, int(b.device.native_vector_width_float))
        grid = {ours_g} | {(rpi, tpi, wg, vw) for rpi in (1, 2, 4) for tpi in ((1,) if t == 1 else (2, 4))
                           for wg in (1, 8, 16, 64) for vw in (8, 16)}
        timed = []
        for g in sorted(grid):
            try:
                timed.append((b.measure(kind, n, k, t, g, passes)[0], g))
            except cl.Error as e:   # a geometry this driver cannot build or launch
                print(f"  {kind} T={t} {g}: {str(e).splitlines()[0][:80]}")
        timed.sort()
        ours = next(w for w, g in timed if g == ours_g)
        print(f"{n}x{k} {kind:<6} T={t:<3} package {ours_g}: {ours * 1e6:8.1f} us;  fastest: "
              + ", ".join(f"{g} {w * 1e6:.1f} us ({ours / w:.2f}x)" for w, g in timed[:4]), flush=True)
    return 0


def quantize_bytes(kind, n, k):
    return {"F32": n * k * 4, "F16": n * k * 2, "Q8_0": n * k // QK * 34, "Q4_0": n * k // QK * 18}[kind]


if __name__ == "__main__":
    sys.exit(main())
