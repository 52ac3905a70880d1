"""The gated activations of elementwise.cl (silu_mul: SwiGLU's silu(gate) * up) on the
llama bench shape (F = 4864) at decode, cohort and prefill row counts: the kernel as built
(int addresses wherever they are exact) beside its size_t path (EW_SIZE_T) and numpy, in
the same run; microseconds a call, launches back to back (median of 7 batches of 20).
Figures only, never asserts.

    python bench/elementwise.py [--device intel|pocl|SELECTOR]
"""

import argparse
import os
import sys
import time

import numpy as np
import pyopencl as cl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import OPENCL, pick_device  # noqa: E402

F = 4864


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    device = pick_device(args.device)
    ctx = cl.Context([device])
    queue = cl.CommandQueue(ctx)
    with open(os.path.join(OPENCL, "common.cl")) as f, open(os.path.join(OPENCL, "elementwise.cl")) as g:
        source = f.read() + "\n" + g.read()
    builds = {name: cl.Kernel(cl.Program(ctx, source).build(options=[f"-DF={F}"] + extra), "silu_mul")
              for name, extra in (("int", []), ("size_t", ["-DEW_SIZE_T"]))}
    print(f"{device.name.strip()} ({device.platform.name.strip()}); silu_mul over [T, {F}] of a [T, 2 x {F}] gate|up")
    print(f"  {'T':>4} {'as built':>10} {'size_t':>10} {'numpy':>10}  (us a call)")
    rng = np.random.default_rng(0)
    for t in (1, 8, 32, 128):
        gu = rng.standard_normal((t, 2 * F)).astype(np.float32)
        src = cl.Buffer(ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=gu)
        outs = {name: cl.Buffer(ctx, cl.mem_flags.READ_WRITE, t * F * 4) for name in builds}
        times = {name: [] for name in builds}
        for name, k in builds.items():
            k.set_args(src, np.int32(0), np.int32(2 * F), src, np.int32(F), np.int32(2 * F), outs[name], np.int32(0),
                       np.int32(F), np.int32(t))
            cl.enqueue_nd_range_kernel(queue, k, (F, t), None)
        for _ in range(7):
            for name, k in builds.items():          # alternating, so both see the same machine
                queue.finish()
                start = time.perf_counter()
                for _ in range(20):
                    cl.enqueue_nd_range_kernel(queue, k, (F, t), None)
                queue.finish()
                times[name].append((time.perf_counter() - start) / 20)
        got = {}
        for name, buf in outs.items():
            got[name] = np.empty((t, F), np.float32)
            cl.enqueue_copy(queue, got[name], buf)
        g, u = gu[:, :F], gu[:, F:]
        start = time.perf_counter()
        for _ in range(20):
            ref = g / (1.0 + np.exp(-g)) * u
        ref_us = (time.perf_counter() - start) / 20 * 1e6
        same = np.array_equal(got["int"], got["size_t"]) and np.allclose(got["int"], ref, rtol=1e-5, atol=1e-6)
        print(f"  {t:4d} {np.median(times['int']) * 1e6:10.1f} {np.median(times['size_t']) * 1e6:10.1f} "
              f"{ref_us:10.1f}  {'same values' if same else 'VALUES DIFFER'}")


if __name__ == "__main__":
    main()
