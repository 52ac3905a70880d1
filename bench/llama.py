"""Llama package benchmark: prints figures, asserts nothing.

A random-weight GGUF shaped like Qwen2.5-0.5B (24 layers, 896 dims, 14 heads /
2 KV heads, FFN 4864, vocab 32000, untied head) in F16 and Q8_0, generated once
into ~/.cache/loom/bench. For each: prefill tokens/s for a 128-token prompt and
decode tokens/s at batch 1, beside the bandwidth bound (weight bytes read per
token / DRAM bandwidth measured with numpy in the same run). --dtypes also
takes Q4_0.

Then batched decode (continuous batching without the server): one `advance`
step of R rows feeding one token each (T = R), every row with its own pages and
128 positions already stored, for each R of --rows: step ms and aggregate
tok/s beside R = 1, plus the library sampler (opencl/sample.cl at the package's
default temperature 0.7 / top_p 0.8 / top_k 20) for the same R rows. With
--breakdown, a diagnostic replay of the R = 1 and largest-R plans that waits
for each launch (queue.finish) and sums the time per kernel (matmuls by
their N x K): the serial sum, not the pipelined step.

With --gguf PATH (repeatable), any llama-architecture GGUF instead, such as
the default catalog's SmolLM2-135M-Instruct Q4_1 (`--gguf smollm2` names it).

With --peer, llama.cpp beside Loom on the same files (llama-cpp-python from
`make bench-peers`, in .peers/): each engine measures in its own fresh process,
the two alternating, --rounds times, and the best of each is printed with the
ratio Loom / llama.cpp: pp128 (one 128-token prompt) and 64 greedy decode
steps at batch 1, llama.cpp on 2 threads. The generated files then carry a
vocabulary (llama.cpp needs one) and are quantized by llama.cpp's own
quantizer from F32: F16, Q8_0, Q4_0 (pure) and Q4_K_M (llama.cpp's mix);
--peer-files picks among those and smollm2.

    python bench/llama.py [--dtypes F16,Q8_0] [--gguf PATH] [--decode 32] [--rows 1,2,4,8] [--breakdown]
    python bench/llama.py --peer [--peer-files F16,Q8_0,Q4_0,Q4_K_M,smollm2] [--rounds 2]
"""

import argparse
import json
import os
import subprocess
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
BATCH_CONTEXT = 128      # positions each batched row already holds


def checkpoint(dtype):
    """The generated 0.5B-shape file in `dtype` (Loom's quantizer); "F32-vocab": float32 with a
    vocabulary, the source llama.cpp's quantizer starts from."""
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
    if dtype == "F32-vocab":
        w.add_uint32("llama.rope.dimension_count", dh)
        w.add_uint32("llama.context_length", 4096)
        vocabulary(w, s["V"])

    def matrix(name, rows, cols):
        values = (rng.standard_normal((rows, cols), np.float32) * cols ** -0.5)
        if dtype == "F32-vocab":
            w.add_tensor(name, values)
        elif dtype == "F16":
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
    """One sequence driven step by step through `advance`, as the scheduler drives a row:
    one plan and one set of input buffers per step size, refilled each step."""

    def __init__(self, prepared):
        self.prepared = prepared
        self.device = prepared.device
        max_pages = prepared.spec("MAX_PAGES")
        self.vocab = prepared.spec("V")
        self.length = 0
        self.pages = self.device.pool.alloc(4 * max_pages, "bench", "workspace",
                                            host=np.arange(max_pages, dtype=np.int32))
        self.logits = self.device.pool.alloc(4 * self.vocab, "bench", "workspace")
        self.shapes = {}     # T -> (plan, buffers)

    def _shape(self, n):
        if n not in self.shapes:
            box = {}
            self.prepared.plan_async("advance", {"T": n, "R": 1}, lambda plan, error: box.update(plan=plan,
                                                                                                error=error))
            if box["error"] is not None:
                raise box["error"]
            fixed = {"row_of": np.zeros(n, np.int32), "last": np.array([n - 1], np.int32)}
            bufs = {k: self.device.pool.alloc(a.nbytes, "bench", "workspace", host=a) for k, a in fixed.items()}
            bufs.update(tokens=self.device.pool.alloc(4 * n, "bench", "workspace"),
                        pos=self.device.pool.alloc(4 * n, "bench", "workspace"), pages=self.pages, logits=self.logits)
            self.shapes[n] = box["plan"], bufs
        return self.shapes[n]

    def step(self, ids):
        n = len(ids)
        plan, bufs = self._shape(n)
        self.device.upload(bufs["tokens"], np.array(ids, np.int32))
        self.device.upload(bufs["pos"], np.arange(self.length, self.length + n, dtype=np.int32))
        plan.run(bufs).wait()
        self.length += n
        return self.device.download(self.logits, np.float32, self.vocab)

    def release(self):
        for _, bufs in self.shapes.values():
            for name in ("row_of", "last", "tokens", "pos"):
                bufs[name].release()
        self.pages.release()
        self.logits.release()
        self.shapes.clear()


def loom_figures(prepared, prompt, steps):
    """(prefill tok/s for `prompt` on a fresh row, greedy decode tok/s over `steps` steps)."""
    warm = Row(prepared)                  # compile and first-launch every shape used below
    for ids in (prompt, [1]):
        warm.step(ids)
    warm.release()
    row = Row(prepared)
    prefill = _timed(lambda: row.step(prompt))
    token = int(row.step([7]).argmax())
    start = time.perf_counter()
    for _ in range(steps):
        token = int(row.step([token]).argmax())
    decode = (time.perf_counter() - start) / steps
    row.release()
    return len(prompt) / prefill, 1 / decode


class Cohort:
    """R rows with their own pages, each prefilled with BATCH_CONTEXT tokens, then
    stepped together one token per row (the scheduler's decode cohort)."""

    def __init__(self, prepared, R, prompt):
        self.prepared, self.device, self.R = prepared, prepared.device, R
        max_pages = prepared.spec("MAX_PAGES")
        self.tables = np.arange(R * max_pages, dtype=np.int32).reshape(R, max_pages)
        self.logits = self.device.pool.alloc(4 * prepared.spec("V") * R, "bench", "workspace")
        for r in range(R):        # prefill each row alone, into its own pages
            self._run({"tokens": np.array(prompt, np.int32), "pos": np.arange(len(prompt), dtype=np.int32),
                       "row_of": np.zeros(len(prompt), np.int32), "pages": self.tables[r],
                       "last": np.array([len(prompt) - 1], np.int32)}, len(prompt), 1)
        self.length = len(prompt)

    def plan(self, T, R):
        box = {}
        self.prepared.plan_async("advance", {"T": T, "R": R}, lambda plan, error: box.update(plan=plan, error=error))
        if box["error"] is not None:
            raise box["error"]
        return box["plan"]

    def _buffers(self, host):
        bufs = {k: self.device.pool.alloc(a.nbytes, "bench", "workspace", host=a) for k, a in host.items()}
        bufs["logits"] = self.logits
        return bufs

    def _run(self, host, T, R, diagnose=None):
        bufs = self._buffers(host)
        plan = self.plan(T, R)
        if diagnose is None:
            plan.run(bufs).wait()
        else:
            diagnose(plan, bufs)
        for k in host:
            bufs[k].release()

    def host(self, tokens):
        R = self.R
        return {"tokens": np.array(tokens, np.int32), "pos": np.full(R, self.length, np.int32),
                "row_of": np.arange(R, dtype=np.int32), "pages": self.tables.ravel(),
                "last": np.arange(R, dtype=np.int32)}

    def step(self, tokens, diagnose=None):
        self._run(self.host(tokens), self.R, self.R, diagnose)
        self.length += 1


def per_kernel(plan, bufs, totals):
    """Replay `plan` launch by launch, waiting for each: seconds per kernel into totals."""
    import pyopencl as cl
    queue = plan.prepared.device.queue
    queue.finish()
    for (kernel, grid, local, slots), launch in zip(plan.launches, plan.layout.launches):
        for i, name in slots:
            kernel.set_arg(i, bufs[name].buffer)
        d = launch.defines
        key = f"{launch.kernel} {d['N']}x{d['K']}" if "N" in d and "K" in d else launch.kernel
        start = time.perf_counter()
        cl.enqueue_nd_range_kernel(queue, kernel, grid, local)
        queue.finish()
        totals[key] = totals.get(key, 0.0) + time.perf_counter() - start


class Sampler:
    """The library sampler over R rows of logits, as the scheduler launches it."""

    def __init__(self, prepared, compiler, R, logits):
        import pyopencl as cl
        self.device = device = prepared.device
        self.R, self.logits = R, logits
        V = prepared.spec("V")
        exe = compiler.compile(compiler.library_source("sample"), {"V": V}, name="sample")
        params = np.tile(np.array([0.7, 0.8, 20, 0], np.float32), (R, 1))
        seeds = np.array([[r, 0] for r in range(R)], np.uint32)
        self.bufs = [device.pool.alloc(params.nbytes, "bench", "workspace", host=params),
                     device.pool.alloc(seeds.nbytes, "bench", "workspace", host=seeds),
                     device.pool.alloc(4 * R * V, "bench", "workspace"),
                     device.pool.alloc(4 * R, "bench", "workspace")]
        self.kernel = cl.Kernel(exe.program, "sample")
        self.kernel.set_args(logits.buffer, np.int32(0), np.int32(V), *(b.buffer for b in self.bufs[:4]),
                             np.int32(R))

    def run(self):
        import pyopencl as cl
        cl.enqueue_nd_range_kernel(self.device.queue, self.kernel, (self.R,), (1,))   # as the scheduler
        return self.device.download(self.bufs[3], np.int32, self.R)

    def release(self):
        for b in self.bufs:
            b.release()


def batched(prepared, compiler, rows, steps, breakdown):
    """Batched decode: R rows x 1 token per `advance` step."""
    prompt = list(np.random.default_rng(2).integers(0, prepared.spec("V"), BATCH_CONTEXT))
    print(f"\n  batched decode, {BATCH_CONTEXT} positions per row: one advance step of R rows x 1 token")
    print(f"  {'R':>3} {'step ms':>9} {'tok/s':>8} {'x R=1':>6} {'sample ms':>10} {'with sample tok/s':>18}")
    base, diag = None, {}
    for R in rows:
        cohort = Cohort(prepared, R, prompt)
        sampler = Sampler(prepared, compiler, R, cohort.logits)
        try:
            tokens = [7] * R
            cohort.step(tokens)                                  # warm this shape
            sampler.run()
            start = time.perf_counter()
            for _ in range(steps):
                cohort.step(tokens)
            step = (time.perf_counter() - start) / steps
            sample = min(_timed(sampler.run) for _ in range(5))
            base = base or R / step
            print(f"  {R:3d} {step * 1e3:9.1f} {R / step:8.1f} {R / step / base:5.1f}x {sample * 1e3:10.2f} "
                  f"{R / (step + sample):18.1f}")
            if breakdown and R in (rows[0], rows[-1]):
                totals = {}
                for _ in range(3):
                    cohort.step(tokens, lambda plan, bufs: per_kernel(plan, bufs, totals))
                diag[R] = {k: v / 3 for k, v in totals.items()}
        finally:
            sampler.release()
            cohort.logits.release()
    if diag:
        lo, hi = rows[0], rows[-1]
        print("\n  per kernel, ms per step (each launch waited for; serial sum):")
        print(f"  {'kernel':24} {'R=' + str(lo):>9} {'R=' + str(hi):>9} {'ratio':>6}")
        keys = sorted(set(diag[lo]) | set(diag[hi]), key=lambda k: (-diag[hi].get(k, 0.0), -diag[lo].get(k, 0.0)))
        for k in keys + ["total"]:
            a = sum(diag[lo].values()) if k == "total" else diag[lo].get(k, 0.0)
            b = sum(diag[hi].values()) if k == "total" else diag[hi].get(k, 0.0)
            print(f"  {k:24} {a * 1e3:9.2f} {b * 1e3:9.2f} {b / a if a else 0:5.1f}x")


def bandwidth():
    a = np.ones(64 << 20, np.float32)
    best = min(_timed(a.sum) for _ in range(5))
    return a.nbytes / best / 1e9


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- llama.cpp beside Loom ------------------------------------------------------------

PEERS = os.path.join(ROOT, ".peers")
PEER_TYPES = {"F16": 1, "Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15}   # llama_ftype values
DECODE_STEPS = 64


def peer_module():
    """llama-cpp-python from make bench-peers' folder, or None."""
    if os.path.isdir(PEERS) and PEERS not in sys.path:
        sys.path.append(PEERS)
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def vocabulary(writer, size):
    """A byte-level BPE vocabulary of `size` tokens (no merges): llama.cpp loads no model without one."""
    from loom.tokenizer import _bytes_to_unicode
    chars = list(_bytes_to_unicode())
    merged = chars[0] + chars[1]             # the one merge's result must be a token too
    tokens = chars + [merged] + [f"<t{i}>" for i in range(size - len(chars) - 1)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * size)
    writer.add_token_merges([f"{chars[0]} {chars[1]}"])   # llama.cpp needs the key; gguf writes no empty list
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)


def peer_file(kind):
    """A bench file llama.cpp and Loom both load: the 0.5B shape in F32 with a vocabulary,
    quantized by llama.cpp's own quantizer (pure for F16/Q8_0/Q4_0, its mix for Q4_K_M)."""
    if kind == "smollm2":
        from loom import demo
        return demo.smollm2_file()
    out = os.path.join(CACHE, f"qwen-0.5b-shape-vocab-{kind}.gguf")
    if os.path.exists(out):
        return out
    source = checkpoint("F32-vocab")
    llama_cpp = peer_module()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = PEER_TYPES[kind]
    params.nthread = 2
    params.pure = kind != "Q4_K_M"
    if llama_cpp.llama_model_quantize(source.encode(), (out + ".tmp").encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {kind}")
    os.replace(out + ".tmp", out)
    return out


def measure(engine, path):
    """One engine on one file, in this (fresh) process: {"prefill", "decode"} tok/s."""
    import gguf
    vocab = len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, vocab, 128)]
    if engine == "llama.cpp":
        llm = peer_module().Llama(model_path=path, n_threads=2, n_threads_batch=2, n_ctx=CTX, n_batch=128,
                                  n_ubatch=128, verbose=False)
        llm.eval(prompt)                       # warm: first-use allocations and repacking
        llm.reset()
        prefill = _timed(lambda: llm.eval(prompt))

        def last():      # the last position's logits (llama.cpp computes only those)
            return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))

        def step(token):
            llm.eval([token])
            return last()
        token = last()
    else:
        device = Device()
        prepared = runtime.prepare("bench", [SOURCE], path, {"pages": CTX // PAGE, "page_size": PAGE,
                                                             "context_length": CTX}, device, Compiler(device, run_now))
        prefill, decode = loom_figures(prepared, prompt, DECODE_STEPS)
        return {"prefill": prefill, "decode": decode}
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        token = step(token)
    return {"prefill": 128 / prefill, "decode": DECODE_STEPS / (time.perf_counter() - start)}


def side_by_side(kinds, rounds):
    if peer_module() is None:
        sys.exit("llama-cpp-python is not installed: run `make bench-peers` first")
    paths = {kind: peer_file(kind) for kind in kinds}
    best = {}
    for _ in range(rounds):
        for kind in kinds:
            for engine in ("loom", "llama.cpp"):     # alternating fresh processes
                out = subprocess.run([sys.executable, __file__, "--measure", engine, paths[kind]], check=True,
                                     capture_output=True, text=True).stdout
                got = json.loads(out.strip().splitlines()[-1])
                mine = best.setdefault((kind, engine), got)
                best[(kind, engine)] = {k: max(mine[k], got[k]) for k in got}
    print(f"device: {Device().describe()}")
    print(f"llama.cpp: llama-cpp-python {peer_module().__version__}, 2 threads; best of {rounds} alternating "
          f"fresh processes each\n")
    print(f"{'file':10} {'llama.cpp pp128':>16} {'Loom pp128':>11} {'ratio':>6} {'llama.cpp decode':>17} "
          f"{'Loom decode':>12} {'ratio':>6}")
    for kind in kinds:
        peer, loom = best[(kind, "llama.cpp")], best[(kind, "loom")]
        print(f"{kind:10} {peer['prefill']:16.1f} {loom['prefill']:11.1f} {loom['prefill'] / peer['prefill']:6.2f} "
              f"{peer['decode']:17.1f} {loom['decode']:12.1f} {loom['decode'] / peer['decode']:6.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="F16,Q8_0", help="generated 0.5B-shape files ('' for none)")
    ap.add_argument("--gguf", action="append", default=[],
                    help="a GGUF file to measure as well (repeatable; 'smollm2' = the default catalog's)")
    ap.add_argument("--decode", type=int, default=32, help="decode steps to time")
    ap.add_argument("--rows", default="1,2,4,8", help="batched decode: rows per step")
    ap.add_argument("--breakdown", action="store_true", help="per-kernel times for the smallest and largest R")
    ap.add_argument("--device", default=None)
    ap.add_argument("--int8", action="store_true",
                    help="the package's int8_activations option (Q8_0/Q4_0: int8 activations at every T)")
    ap.add_argument("--peer", action="store_true", help="llama.cpp beside Loom on the same files (make bench-peers)")
    ap.add_argument("--peer-files", default="F16,Q8_0,Q4_0,Q4_K_M,smollm2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--measure", nargs=2, metavar=("ENGINE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    if args.peer:
        side_by_side(args.peer_files.split(","), args.rounds)
        return
    device = Device(args.device)
    compiler = Compiler(device, run_now)
    bw = bandwidth()
    rows = [int(r) for r in args.rows.split(",") if r]
    print(f"device: {device.describe()}")
    print(f"numpy DRAM read bandwidth, same run: {bw:.1f} GB/s\n")
    files = [(dtype, checkpoint(dtype)) for dtype in args.dtypes.split(",") if dtype]
    for path in args.gguf:
        if path == "smollm2":
            from loom import demo
            path = demo.smollm2_file()
        files.append((os.path.basename(path).removesuffix(".gguf"), path))
        print(f"{files[-1][0][:8]}: {path}")
    print()
    print(f"{'weights':8} {'GB':>6} {'prefill 128 tok/s':>18} {'decode tok/s':>13} {'decode bound':>13} {'of bound':>9}")
    for label, path in files:
        prepared = runtime.prepare(f"bench-{label}", [SOURCE], path,
                                   {"pages": max(rows, default=1) * CTX // PAGE, "page_size": PAGE,
                                    "context_length": CTX, "int8_activations": args.int8}, device, compiler)
        try:
            # Bytes read per decoded token: every param, less the embedding table (rows gathered)
            # unless the head is tied to it and reads it whole.
            tied = prepared.params[("output", None)] is prepared.params[("embd", None)]
            weight_bytes = prepared.param_bytes() - (0 if tied else prepared.params[("embd", None)].capacity)
            prompt = list(np.random.default_rng(1).integers(0, prepared.spec("V"), 128))
            prefill, decode = loom_figures(prepared, prompt, args.decode)
            bound = bw * 1e9 / weight_bytes
            print(f"{label[:8]:8} {weight_bytes / 1e9:6.2f} {prefill:18.1f} {decode:13.1f} {bound:13.1f} "
                  f"{decode / bound:8.0%}")
            if rows:
                batched(prepared, compiler, rows, max(4, args.decode // 2), args.breakdown)
        finally:
            prepared.release()


if __name__ == "__main__":
    main()
