"""conv2d.cl speed on Stable Diffusion's convolution shapes, beside numpy.

For each shape (the default illustrator's UNet at 256x256, i.e. 32x32 latents with 32
and 64 channels, its VAE's last 256x256 stage, and SD-1.5's first stage, 64x64x320),
prints ms per conv2d call and GFLOP/s for a few register tiles (OUTS_PER_ITEM x
POS_PER_ITEM, VW 16, G1 chosen so the work-items are a few per core) and the 4x4 tile
with IN_SILU, next to numpy
in the same run: im2col (a strided view copied to [pixels, C*KH*KW]) then one matmul
against W[O, C*KH*KW] (OpenBLAS SGEMM), im2col's share shown separately. Also
group_norm (OUT_SILU) on each shape, one group a work-group and a slab of >= 16 channels. Figures only, never asserts; the machine is noisy, so
compare within one run.

    python bench/conv2d.py [--device intel|pocl|SELECTOR] [--rounds N] [--sweep] [--shapes a,b]
"""

import argparse
import os
import sys
import time

import numpy as np
import pyopencl as cl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import OPENCL, pick_device  # noqa: E402

# name: (N, H, W, C, O, K, groups) -- 3x3, stride 1, pad 1
SHAPES = {
    "unet32": (2, 32, 32, 32, 32, 3, 8),       # illustrator down/up block 0 (CFG pair)
    "unet16": (2, 16, 16, 64, 64, 3, 8),       # illustrator down block 1, mid block
    "unet32up": (2, 32, 32, 96, 32, 3, 8),     # illustrator up block 1 conv1 (64 + 32 skip)
    "vae256": (1, 256, 256, 16, 16, 3, 8),     # illustrator VAE's last stage
    "sd64": (1, 64, 64, 320, 320, 3, 32),      # SD-1.5 down block 0 (one image)
}
TILES = [(4, 4), (8, 4), (8, 1)]
SWEEP = [(2, 4), (2, 8), (4, 1), (4, 2), (4, 3), (4, 4), (4, 6), (4, 8), (8, 1), (8, 2), (8, 3), (8, 4), (16, 1), (16, 2)]


def numpy_conv(x, w2, k, pad):
    """im2col + matmul: x [N, H, W, C], w2 [O, C*K*K] -> ([N*H*W, O], seconds of im2col)."""
    t0 = time.perf_counter()
    xp = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (k, k), axis=(1, 2))   # [N, H, W, C, K, K]
    cols = np.ascontiguousarray(win).reshape(-1, w2.shape[1])
    t1 = time.perf_counter()
    return cols @ w2.T, t1 - t0


def best_of(fn, rounds, calls):
    fn()    # warm (JIT for the launch shape)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="as loom's --device")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="a larger grid of tiles")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--g1", type=int, default=0, help="row-tile stretches per output group (0: at least 4 work-items a core)")
    args = ap.parse_args()

    dev = pick_device(args.device)
    ctx = cl.Context([dev])
    queue = cl.CommandQueue(ctx)
    src = {name: open(os.path.join(OPENCL, "common.cl")).read() + "\n" + open(os.path.join(OPENCL, name + ".cl")).read()
           for name in ("conv2d", "group_norm")}
    mf = cl.mem_flags
    print(f"device: {dev.name} / {dev.platform.name} {dev.driver_version}, {dev.max_compute_units} units")
    print(f"{'shape':10} {'N,H,W,C->O':22} {'GFLOP':>6} {'tile':>8} {'G1':>3} {'ms':>8} {'GFLOP/s':>8}")
    for name in args.shapes.split(","):
        n, h, wd, c, o, k, groups = SHAPES[name]
        pad = k // 2
        flop = 2.0 * n * h * wd * o * c * k * k
        r = np.random.default_rng(0)
        x = r.standard_normal((n, h, wd, c)).astype(np.float32)
        w = (r.standard_normal((o, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)
        b = r.standard_normal(o).astype(np.float32)
        xb = cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=x)
        wb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=w)
        bb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=b)
        yb = cl.Buffer(ctx, mf.READ_WRITE, n * h * wd * o * 4)
        label = f"{n},{h},{wd},{c}->{o}"
        ref = None
        calls = max(1, int(0.05 / max(flop / 150e9, 1e-5)))
        for ot, pt, extra in [(ot, pt, "") for ot, pt in (SWEEP if args.sweep else TILES)] + [(4, 4, "IN_SILU")]:
            opts = [f"-DC={c}", f"-DO={o}", f"-DKH={k}", f"-DKW={k}", f"-DPAD={pad}", "-DHAS_BIAS",
                    f"-DOUTS_PER_ITEM={ot}", f"-DPOS_PER_ITEM={pt}"] + ([f"-D{extra}"] if extra else [])
            kern = cl.Kernel(cl.Program(ctx, src["conv2d"]).build(options=opts), "conv2d")
            items = -(-o // ot)
            g1 = args.g1 or max(1, -(-4 * dev.max_compute_units // items))
            kern.set_args(xb, np.int32(0), np.int32(c), wb, bb, None, np.int32(0), np.int32(o),
                          yb, np.int32(0), np.int32(o), np.int32(n), np.int32(h), np.int32(wd))

            def launch():
                cl.enqueue_nd_range_kernel(queue, kern, (items, g1), (1, 1))
                queue.finish()
            sec = best_of(launch, args.rounds, calls)
            got = np.empty((n * h * wd, o), np.float32)
            cl.enqueue_copy(queue, got, yb)
            if ref is None:
                ref = numpy_conv(x, w.reshape(o, -1), k, pad)[0] + b
                ref_silu = numpy_conv(x / (1 + np.exp(-x)), w.reshape(o, -1), k, pad)[0] + b
            want = ref_silu if extra else ref
            err = float(np.abs(got - want).max() / np.abs(want).max())
            print(f"{name:10} {label:22} {flop / 1e9:6.3f} {f'{ot}x{pt}' + ('+silu' if extra else ''):>8} {g1:3d} {sec * 1e3:8.3f} "
                  f"{flop / sec / 1e9:8.1f}" + (f"  (rel err {err:.1e}!)" if err > 1e-4 else ""))
        w2 = w.reshape(o, -1)
        im2col = [float("inf")]

        def numpy_call():
            im2col[0] = min(im2col[0], numpy_conv(x, w2, k, pad)[1])
        sec = best_of(numpy_call, args.rounds, calls)
        print(f"{name:10} {label:22} {flop / 1e9:6.3f} {'numpy':>8} {'':3} {sec * 1e3:8.3f} {flop / sec / 1e9:8.1f}"
              f"  (im2col {im2col[0] * 1e3:.3f} ms)")
        cg = c // groups
        gb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.ones(c, np.float32))
        gy = cl.Buffer(ctx, mf.READ_WRITE, x.nbytes)
        for gpi in sorted({1, min(d for d in range(1, groups + 1) if groups % d == 0 and (d * cg >= 16 or d == groups))}):
            gk = cl.Kernel(cl.Program(ctx, src["group_norm"]).build(
                options=[f"-DC={c}", f"-DG={groups}", f"-DGROUPS_PER_ITEM={gpi}", "-DOUT_SILU"]), "group_norm")
            gk.set_args(xb, gb, gb, gy, np.int32(n), np.int32(h * wd), np.float32(1e-5))

            def norm():
                cl.enqueue_nd_range_kernel(queue, gk, (1, groups // gpi, n), (1, 1, 1))
                queue.finish()
            sec = best_of(norm, args.rounds, max(calls, 20))
            print(f"{name:10} {label:22} {'':6} {f'gn/{gpi}':>8} {'':3} {sec * 1e3:8.3f}  "
                  f"(group_norm OUT_SILU, {groups} groups, {gpi} a work-group: "
                  f"{n * h * wd * c * 4 * 3 / sec / 1e9:.1f} GB/s over 3 passes)")


if __name__ == "__main__":
    main()
