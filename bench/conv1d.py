"""conv1d.cl's outer-product kernels on the voice's shapes: weights as the checkpoint
stores them (each work-item gathers its 2 x OUT_VW outputs' weights into private memory
at every launch) beside weights tiled at load (`tiled(axis, 16)` in vits.loom,
WEIGHT_TILES: read in place), alternating in the same run; ms a call (median of 11)
and whether both give the same bits. Figures only, never asserts.

The shapes are the speech engine's: a request's first vocode window (43 latent frames)
and a long one (299), the flow's gated WaveNet conv over 320 frames, and the text
encoder's convs over 149 phonemes.

    python bench/conv1d.py [--device intel|pocl|SELECTOR]
"""

import argparse
import os
import sys
import time

import numpy as np
import pyopencl as cl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import OPENCL, pick_device  # noqa: E402

sys.path.insert(0, os.path.dirname(OPENCL))
from loom.runtime import tile  # noqa: E402

BASE = dict(HAS_BIAS=1, OUT_VW=16, OUT_VECS=2, FRAMES_PER_ITEM=8, VW=16)


class Bench:
    def __init__(self, device):
        self.ctx = cl.Context([device])
        self.queue = cl.CommandQueue(self.ctx)
        with open(os.path.join(OPENCL, "common.cl")) as f, open(os.path.join(OPENCL, "conv1d.cl")) as g:
            self.source = f.read() + "\n" + g.read()
        self.rng = np.random.default_rng(0)

    def buf(self, a):
        return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))

    def kernel(self, entry, defines):
        options = [f"-D{k}={v}" for k, v in defines.items()]
        return getattr(cl.Program(self.ctx, self.source).build(options=options), entry)

    def case(self, name, entry, defines, wshape, axis, c, t, t_out, ldy, grid):
        x = self.buf(self.rng.standard_normal((t, c)).astype(np.float32))
        w = (self.rng.standard_normal(wshape) * 0.05).astype(np.float32)
        b = self.buf(self.rng.standard_normal(max(wshape[axis], 1)).astype(np.float32))
        offsets = self.buf(np.array([0, t], np.int32))
        runs = []
        for tiles, weights in ((0, w), (16, tile(w, axis, 16))):
            k = self.kernel(entry, dict(defines, WEIGHT_TILES=tiles))
            y = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, t_out * ldy * 4)
            wb = self.buf(weights)
            extra = (offsets, offsets) if entry == "conv1d_outer" else (offsets,)
            k.set_args(x, np.int32(0), np.int32(c), wb, b, y, np.int32(0), np.int32(ldy), *extra, np.int32(1),
                       np.int32(t))
            runs.append((k, y, [], wb))       # the buffers live as long as the kernel's arguments
        for r in range(12):
            for k, _, times, _ in runs:         # alternating, so both see the same machine
                self.queue.finish()
                start = time.perf_counter()
                cl.enqueue_nd_range_kernel(self.queue, k, grid, (1,) * len(grid))
                self.queue.finish()
                if r:
                    times.append(time.perf_counter() - start)
        out = []
        for _, y, _, _ in runs:
            host = np.empty(t_out * ldy, np.float32)
            cl.enqueue_copy(self.queue, host, y)
            out.append(host)
        copied, tiled = (np.median(times) * 1e3 for _, _, times, _ in runs)
        print(f"  {name:34} {t:6d} {copied:9.3f} {tiled:9.3f} {copied / tiled:6.2f}x  "
              f"{'yes' if np.array_equal(*out) else 'NO'}")

    def res_conv(self, c, kw, dil, t):
        d = dict(BASE, C=c, O=c, KW=kw, DILATION=dil, PAD=dil * (kw - 1) // 2, LEAKY=0.1, RESIDUAL=1)
        self.case(f"ResBlock2 {c}->{c} k{kw} d{dil}", "conv1d_outer", d, (c, c, kw), 0, c, t, t, c,
                  (-(-c // 32), min(max(t // 64, 4), 8)))

    def upsample(self, c, o, kw, stride, t):
        d = dict(BASE, C=c, O=o, KW=kw, STRIDE=stride, PAD=(kw - stride) // 2, LEAKY=0.1)
        self.case(f"upsample {c}->{o} k{kw} x{stride}", "conv_transpose1d_outer", d, (c, o, kw), 1, c, t, t * stride, o,
                  (-(-o // 32), stride, min(max(t // 256, 1), 4)))

    def conv(self, c, o, kw, t, gate=False):
        d = dict(BASE, C=c, O=o, KW=kw, PAD=kw // 2, **({"GATE": o // 2} if gate else {}))
        n = -(-o // (16 if gate else 32))
        self.case(f"{'gated ' if gate else ''}conv {c}->{o} k{kw}", "conv1d_outer", d, (o, c, kw), 0, c, t, t,
                  o // 2 if gate else o, (n, 1 if n >= 6 else 2))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    device = pick_device(args.device)
    print(f"{device.name.strip()} ({device.platform.name.strip()}); ms a call, median of 11")
    print(f"  {'layer':34} {'frames':>6} {'copied':>9} {'tiled':>9} {'gain':>7}  same bits")
    b = Bench(device)
    for frames in (43, 299):
        print(f" vocode window of {frames} latent frames:")
        b.upsample(256, 128, 16, 8, frames)
        b.res_conv(128, 7, 1, 8 * frames)
        b.res_conv(128, 3, 1, 8 * frames)
        b.upsample(128, 64, 16, 8, 8 * frames)
        b.res_conv(64, 7, 1, 64 * frames)
        b.upsample(64, 32, 8, 4, 64 * frames)
        b.res_conv(32, 7, 1, 256 * frames)
    print(" flow, 320 frames; text encoder, 149 phonemes:")
    b.conv(192, 384, 5, 320, gate=True)
    b.conv(192, 384, 1, 320)
    b.conv(192, 768, 3, 149)
    b.conv(768, 192, 3, 149)
    b.conv(192, 192, 1, 149)


if __name__ == "__main__":
    main()
