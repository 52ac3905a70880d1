"""Llama package benchmark: prints figures, asserts nothing.

A random-weight GGUF shaped like Qwen2.5-0.5B (24 layers, 896 dims, 14 heads /
2 KV heads, FFN 4864, vocab 32000, untied head) in F16 and Q8_0, generated once
into ~/.cache/loom/bench. For each: prefill tokens/s for a 128-token prompt and
decode tokens/s at batch 1, beside the bandwidth bound (weight bytes read per
token / DRAM bandwidth measured with numpy in the same run). PERFORMANCE.md
has llama.cpp's figures on this machine for the same shape.

    python bench/llama.py [--dtypes F16,Q8_0] [--decode 32]
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from loom import runtime  # noqa: E402
from loom.compiler import Compiler, run_now  # noqa: E402
from loom.device import Device  # noqa: E402
from loom.weights import quantize  # noqa: E402

SHAPE = {"L": 24, "D": 896, "H": 14, "HKV": 2, "F": 4864, "V": 32000}
CACHE = os.path.expanduser("~/.cache/loom/bench")
SOURCE = os.path.join(ROOT, "models", "llama", "llama.loom")
PAGE, CTX = 16, 512


def checkpoint(dtype):
    import gguf
    path = os.path.join(CACHE, f"qwen-0.5b-shape-{dtype}.gguf")
    if os.path.exists(path):
        return path
    os.makedirs(CACHE, exist_ok=True)
    rng = np.random.default_rng(0)
    s = SHAPE
    dh = s["D"] // s["H"]
    w = gguf.GGUFWriter(path + ".tmp", "llama")
    for key, value in (("block_count", s["L"]), ("embedding_length", s["D"]), ("feed_forward_length", s["F"]),
                       ("attention.head_count", s["H"]), ("attention.head_count_kv", s["HKV"])):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)

    def matrix(name, rows, cols):
        values = (rng.standard_normal((rows, cols), np.float32) * cols ** -0.5)
        if dtype == "F16":
            w.add_tensor(name, values.astype(np.float16))
        else:
            w.add_tensor(name, quantize(values, dtype), raw_dtype=getattr(gguf.GGMLQuantizationType, dtype))

    matrix("token_embd.weight", s["V"], s["D"])
    for i in range(s["L"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(s["D"], np.float32))
        matrix(f"blk.{i}.attn_q.weight", s["H"] * dh, s["D"])
        matrix(f"blk.{i}.attn_k.weight", s["HKV"] * dh, s["D"])
        matrix(f"blk.{i}.attn_v.weight", s["HKV"] * dh, s["D"])
        matrix(f"blk.{i}.attn_output.weight", s["D"], s["H"] * dh)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(s["D"], np.float32))
        matrix(f"blk.{i}.ffn_gate.weight", s["F"], s["D"])
        matrix(f"blk.{i}.ffn_up.weight", s["F"], s["D"])
        matrix(f"blk.{i}.ffn_down.weight", s["D"], s["F"])
    w.add_tensor("output_norm.weight", np.ones(s["D"], np.float32))
    matrix("output.weight", s["V"], s["D"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(path + ".tmp", path)
    return path




class Row:
    """One sequence driven step by step through `advance`."""

    def __init__(self, prepared):
        self.prepared = prepared
        self.device = prepared.device
        max_pages = prepared.spec("MAX_PAGES")
        self.pages = np.arange(max_pages, dtype=np.int32)
        self.length = 0
        self.buffers = {}
        self.logits = self.device.pool.alloc(4 * SHAPE["V"], "bench", "workspace")

    def step(self, ids):
        n = len(ids)
        host = {"tokens": np.array(ids, np.int32), "pos": np.arange(self.length, self.length + n, dtype=np.int32),
                "row_of": np.zeros(n, np.int32), "pages": self.pages, "last": np.array([n - 1], np.int32)}
        bufs = {k: self.device.pool.alloc(a.nbytes, "bench", "workspace", host=a) for k, a in host.items()}
        bufs["logits"] = self.logits
        box = {}
        self.prepared.plan_async("advance", {"T": n, "R": 1}, lambda plan, error: box.update(plan=plan, error=error))
        if box["error"] is not None:
            raise box["error"]
        box["plan"].run(bufs).wait()
        for k in host:
            bufs[k].release()
        self.length += n
        return self.device.download(self.logits, np.float32, SHAPE["V"])


def bandwidth():
    a = np.ones(64 << 20, np.float32)
    best = min(_timed(a.sum) for _ in range(5))
    return a.nbytes / best / 1e9


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="F16,Q8_0")
    ap.add_argument("--decode", type=int, default=32, help="decode steps to time")
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    device = Device(args.device)
    compiler = Compiler(device, run_now)
    bw = bandwidth()
    print(f"device: {device.describe()}")
    print(f"numpy DRAM read bandwidth, same run: {bw:.1f} GB/s\n")
    print(f"{'weights':8} {'GB':>6} {'prefill 128 tok/s':>18} {'decode tok/s':>13} {'decode bound':>13} {'of bound':>9}")
    for dtype in args.dtypes.split(","):
        path = checkpoint(dtype)
        prepared = runtime.prepare(f"bench-{dtype}", [SOURCE], path,
                                   {"pages": CTX // PAGE, "page_size": PAGE, "context_length": CTX}, device, compiler)
        try:
            weight_bytes = prepared.param_bytes() - prepared.params[("embd", None)].capacity  # rows gathered, not read
            prompt = list(np.random.default_rng(1).integers(0, SHAPE["V"], 128))
            Row(prepared).step(prompt)                     # warm: compile and first-launch every shape
            warm = Row(prepared)
            warm.step(prompt[:4])
            warm.step([1])
            row = Row(prepared)
            prefill = _timed(lambda: row.step(prompt))
            token = int(row.step([7]).argmax())
            start = time.perf_counter()
            for _ in range(args.decode):
                token = int(row.step([token]).argmax())
            decode = (time.perf_counter() - start) / args.decode
            bound = bw * 1e9 / weight_bytes
            print(f"{dtype:8} {weight_bytes / 1e9:6.2f} {128 / prefill:18.1f} {1 / decode:13.1f} {bound:13.1f} "
                  f"{(1 / decode) / bound:8.0%}")
        finally:
            prepared.release()


if __name__ == "__main__":
    main()
