"""Runtime benchmark: prints figures, asserts nothing.

1. Plan replay: the per-launch host cost of replaying a Loom launch plan
   (ExecPlan.run) against a raw pyopencl loop enqueueing the same kernel
   objects, for a command of many tiny launches; and a step with one wait.
2. Matrix-vector products through the runtime (the library matmul declared in
   a Loom module, T = 1), as GB/s of weight bytes per dtype, against the
   machine's DRAM read bandwidth measured with numpy in the same run. The
   weights are LAYERS copies of the matrix, read one after another like a
   decode step, so that together they exceed the last-level cache.

    python bench/runtime.py [--seconds 2]
"""

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import pyopencl as cl  # noqa: E402

from loom import runtime  # noqa: E402
from loom.compiler import Compiler, run_now  # noqa: E402
from loom.device import Device  # noqa: E402

REPLAY = '''
module replay kind embedding
spec D = shape("w", 0)
param w : f32 [D] = "w"
kernel touch(x: buf, n: int)
    source """__kernel void touch(__global float* x, int n) { if (get_global_id(0) < n) x[get_global_id(0)] += 1.0f; }"""
    grid [64] local [64]
command step(x: buf, L: int) {
    for l in 0..L {
        touch(x, 64)
    }
}
'''

MATVEC = '''
module matvec kind embedding
spec ROWS = shape("w.0", 0)
spec COLS = shape("w.0", 1)
spec L = meta("bench.layers")
param w[L] : weight [ROWS, COLS] = "w.{i}"
kernel linear(x: buf, w: tensor[N, K], y: buf, T: int)
    from "matmul.cl"
    entry "matmul"
    defines { N = N, K = K, ROWS_PER_ITEM = 1, WG = 8, flag "WEIGHT_" + dtype(w) }
    args [x, 0, K, w, y, y, 0, N, T]
    grid [ceil(N, 8) * 8, 1] local [8, 1]
command mv(x: buf, y: buf, T: int) {
    for l in 0..L {
        linear(x, w[l], y, T)
    }
}
'''




def prepared_module(source, tensors, device, compiler, name, layers=1):
    """Write `tensors` to a GGUF file and prepare `source` against it."""
    import gguf
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "w.gguf")
    writer = gguf.GGUFWriter(path, "bench")
    writer.add_uint32("bench.layers", layers)
    for tname, (array, raw_dtype) in tensors.items():
        writer.add_tensor(tname, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    src = os.path.join(folder, "m.loom")
    with open(src, "w") as f:
        f.write(source)
    return runtime.prepare(name, [src], path, {}, device, compiler)


def get_plan(prepared, command, geometry):
    box = {}
    prepared.plan_async(command, geometry, lambda plan, error: box.update(plan=plan, error=error))
    if box.get("error"):
        raise box["error"]
    return box["plan"]


def timed(fn, seconds):
    runs, start = 0, time.perf_counter()
    while True:
        fn()
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and runs >= 3:
            return elapsed / runs


def bench_replay(device, compiler, seconds):
    prepared = prepared_module(REPLAY, {"w": (np.zeros(64, np.float32), None)}, device, compiler, "replay")
    x = device.pool.alloc(64 * 4, "bench", "workspace")
    launches = 200
    plan = get_plan(prepared, "step", {"L": launches})
    queue = device.queue
    kernels = [(k, g, l) for k, g, l, _ in plan.launches]
    for kernel, _, _ in kernels:
        kernel.set_arg(0, x.buffer)

    def raw():
        for kernel, grid, local in kernels:
            cl.enqueue_nd_range_kernel(queue, kernel, grid, local)
        queue.flush()

    def replay():
        plan.run({"x": x})

    def replay_and_wait():
        plan.run({"x": x}).wait()

    queue.finish()
    t_raw = timed(lambda: (raw(), queue.finish()), seconds)
    t_replay = timed(lambda: (replay(), queue.finish()), seconds)
    # Host-side enqueue cost alone: enqueue, then drain outside the timing.
    enq_raw = _enqueue_only(raw, queue, seconds)
    enq_replay = _enqueue_only(replay, queue, seconds)
    t_step = timed(replay_and_wait, seconds)
    plan_build = timed(lambda: prepared.binding.plan("step", L=launches), seconds / 2)
    print("## Plan replay (200 tiny launches per step)\n")
    print(f"{'':44} {'per launch':>12}")
    print(f"{'raw pyopencl enqueue loop (host only)':44} {enq_raw / launches * 1e6:10.2f} us")
    print(f"{'ExecPlan.run (host only)':44} {enq_replay / launches * 1e6:10.2f} us")
    print(f"{'raw loop + finish':44} {t_raw / launches * 1e6:10.2f} us")
    print(f"{'ExecPlan.run + finish':44} {t_replay / launches * 1e6:10.2f} us")
    print(f"{'ExecPlan.run + wait on the last event':44} {t_step / launches * 1e6:10.2f} us")
    print(f"{'VM planning (first step of a new geometry)':44} {plan_build / launches * 1e6:10.2f} us")
    print(f"replay overhead over raw enqueues: {enq_replay / enq_raw:.2f}x\n")
    x.release()
    prepared.release()


def _enqueue_only(fn, queue, seconds):
    total, runs = 0.0, 0
    while total < seconds or runs < 3:
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
        runs += 1
        queue.finish()
    return total / runs


def dram_bandwidth():
    a = np.ones(64 << 20 // 8 * 8, np.float32)  # 256 MiB
    best = min(_once(a) for _ in range(5))
    return a.nbytes / best / 1e9


def _once(a):
    start = time.perf_counter()
    a.sum()
    return time.perf_counter() - start


def bench_matvec(device, compiler, seconds):
    import gguf
    from loom.weights import quantize
    n, k = 4864, 896
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32)
    bandwidth = dram_bandwidth()
    layers = 16
    print(f"## Matrix-vector products through the runtime ({layers} layers of N={n}, K={k}, T=1)\n")
    print(f"numpy DRAM read bandwidth, same run: {bandwidth:.1f} GB/s\n")
    print(f"{'weights':8} {'MB':>8} {'us/step':>10} {'GB/s':>8} {'of DRAM':>8}")
    for dtype in ("F32", "F16", "Q8_0", "Q4_0"):
        if dtype == "F32":
            tensor = (w, None)
        elif dtype == "F16":
            tensor = (w.astype(np.float16), None)
        else:
            tensor = (quantize(w, dtype), getattr(gguf.GGMLQuantizationType, dtype))
        prepared = prepared_module(MATVEC, {f"w.{i}": tensor for i in range(layers)}, device, compiler,
                                   f"mv-{dtype}", layers)
        x = device.pool.alloc(k * 4, "bench", "workspace", host=rng.standard_normal(k).astype(np.float32))
        y = device.pool.alloc(n * 4, "bench", "workspace")
        plan = get_plan(prepared, "mv", {"T": 1})
        per_call = timed(lambda: plan.run({"x": x, "y": y}).wait(), seconds)
        nbytes = prepared.param_bytes()
        gbs = nbytes / per_call / 1e9
        print(f"{dtype:8} {nbytes / 1e6:8.2f} {per_call * 1e6:10.1f} {gbs:8.1f} {gbs / bandwidth:7.0%}")
        x.release()
        y.release()
        prepared.release()
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    ap.add_argument("--device", default=None, help="OpenCL device selector (default: first GPU, else CPU)")
    args = ap.parse_args()
    device = Device(args.device)
    compiler = Compiler(device, run_now)
    print(f"device: {device.describe()}\n")
    bench_replay(device, compiler, args.seconds)
    bench_matvec(device, compiler, args.seconds)


if __name__ == "__main__":
    main()
