"""Text serving benchmark: prints figures, asserts nothing.

Serves the llama bench model (bench/llama.py's random-weight GGUF shaped like
Qwen2.5-0.5B, with a byte-level tokenizer.json of the same vocabulary beside
it) from a real `python -m loom` and measures over HTTP with streaming: time to
first token for 128- and 1024-token prompts, decode tokens/s for one client,
and aggregate tokens/s for 1, 4, 8 and 16 concurrent clients (the whole wall,
prefill of every prompt included), and beside it the steady decode rate:
tokens streamed while every client was past its first token and none had
finished (no prefill in the cohort). The package's own decode speed
(bench/llama.py's direct loop) is measured in the same run, in rounds that
alternate with one HTTP client's: the serving overhead is how much slower that
client decodes than the direct round just before it (the median over rounds).

With --gguf PATH, a GGUF that carries its own tokenizer and chat template
instead (`--gguf smollm2`: the default catalog's SmolLM2-135M-Instruct).

    python bench/text.py [--dtype Q8_0 | --gguf PATH] [--tokens 64]
"""

import os
import sys

# bench/ holds an http.py: keep it off the path so `http` is the stdlib's.
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import argparse  # noqa: E402
import collections  # noqa: E402
import http.client  # noqa: E402
import importlib.util  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

_spec = importlib.util.spec_from_file_location("package_bench", os.path.join(HERE, "llama.py"))
package_bench = importlib.util.module_from_spec(_spec)  # bench/llama.py: the model and its direct loop
_spec.loader.exec_module(package_bench)


def tokenizer_beside(gguf_path, vocab):
    """A byte-level tokenizer.json covering the model's whole vocabulary."""
    from loom.tokenizer import _bytes_to_unicode
    path = os.path.join(os.path.dirname(gguf_path), "tokenizer.json")
    if os.path.exists(path):
        return path
    chars = _bytes_to_unicode()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    specials += [f"<|extra_{i}|>" for i in range(vocab - 256 - len(specials))]
    added = [{"id": 256 + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(specials)]
    with open(path, "w") as f:
        json.dump({"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                   "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                     "use_regex": True},
                   "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True,
                                                        "trim_offsets": True, "use_regex": True},
                   "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                             "vocab": {c: i for i, c in enumerate(chars)}, "merges": []}}, f)
    return path


NONCE = itertools.count(1000)
ROUNDS = 7      # alternating direct and HTTP decode runs


def stream(port, prompt, max_tokens, times=None):
    """(seconds to the first token, seconds for the rest, tokens generated); the
    arrival time of every content chunk appended to `times` when given."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    # A fresh number first: no request reuses another's prompt from the prefix cache.
    prompt = f"{next(NONCE)}. {prompt}"
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = None
    tokens = 0
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"the server's stream ended in an error: {event['error']}")
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        elif event["choices"] and event["choices"][0]["delta"].get("content"):
            now = time.perf_counter()
            first = first or now
            if times is not None:
                times.append(now)
    end = time.perf_counter()
    conn.close()
    first = first or end
    return first - start, end - first, tokens


def steady(chunks, results):
    """Tokens/s while all clients decode: chunks inside [last first chunk, first last
    chunk], each client's chunk count scaled to its token count."""
    lo, hi = max(c[0] for c in chunks), min(c[-1] for c in chunks)
    if hi - lo <= 0:
        return float("nan")
    tokens = sum(sum(lo < t <= hi for t in c) * tok / len(c) for c, tok in zip(chunks, (r[2] for r in results)))
    return tokens / (hi - lo)


def serve(catalog):
    """A `python -m loom` on a free port, ready: (process, port)."""
    proc = subprocess.Popen([sys.executable, "-m", "loom", "--listen", "tcp:127.0.0.1:0", "--models", catalog],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    port = None
    for line in proc.stderr:
        if "listening on tcp:" in line:
            port = int(line.rsplit(":", 1)[1])
            break
    if port is None:
        raise RuntimeError(f"the server exited ({proc.wait()}) before listening")
    proc.log = collections.deque(maxlen=40)   # the server's last lines, shown if it dies
    threading.Thread(target=lambda: proc.log.extend(proc.stderr), daemon=True).start()
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready")
        time.sleep(0.2)


def count(port, prompt):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}]}
    conn.request("POST", "/v1/chat/completions/input_tokens", json.dumps(body), {"Content-Type": "application/json"})
    n = json.loads(conn.getresponse().read())["input_tokens"]
    conn.close()
    return n


def prompt_of(port, tokens):
    """A user message whose rendered prompt is about `tokens` tokens: a request for a long
    answer (a real model would otherwise stop early), padded with filler text."""
    ask = "Count from 1 to 500, one number per line. Context: "
    filler = "The quick brown fox jumps over the lazy dog. "
    base, per = count(port, ask), count(port, ask + filler * 10) - count(port, ask)
    return ask + filler * max(0, round((tokens - base) * 10 / per))


def clients_run(port, prompt, tokens, clients):
    """`clients` concurrent streams: (aggregate tok/s over the wall, steady decode tok/s)."""
    results, chunks = [None] * clients, [[] for _ in range(clients)]

    def client(i):
        results[i] = stream(port, prompt, tokens, chunks[i])
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return sum(r[2] for r in results) / wall, steady(chunks, results)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="Q8_0")
    ap.add_argument("--gguf", default=None, help="a GGUF with its own tokenizer ('smollm2': the default catalog's)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--clients", default="1,4,8,16")
    args = ap.parse_args()
    if args.gguf:
        from loom import demo
        gguf = demo.smollm2_file() if args.gguf == "smollm2" else os.path.abspath(args.gguf)
        label = os.path.basename(gguf).removesuffix(".gguf")
    else:
        gguf, label = package_bench.checkpoint(args.dtype), f"{args.dtype} 0.5B shape"
        tokenizer_beside(gguf, package_bench.SHAPE["V"])
    clients = [int(c) for c in args.clients.split(",")]
    # The package alone first, the same weights, no HTTP or scheduler: bench/llama.py's loop.
    from loom import runtime
    from loom.compiler import Compiler, run_now
    from loom.device import Device
    device = Device()
    prepared = runtime.prepare("direct", [package_bench.SOURCE], gguf, {"pages": 64, "page_size": 16,
                                                                       "context_length": 1024},
                               device, Compiler(device, run_now))

    folder = os.path.dirname(gguf)
    os.makedirs(package_bench.CACHE, exist_ok=True)
    catalog = os.path.join(package_bench.CACHE, "text-catalog.json")
    with open(catalog, "w") as f:
        json.dump([{"model": "bench", "kind": "text", "sources": [os.path.join(ROOT, "models", "llama", "llama.loom")],
                    "checkpoint": gguf, "base_directory": folder, "rows": max(clients), "context_length": 2048,
                    "max_output_tokens": 512, "options": {"chat": "chatml"}}], f)
    proc, port = serve(catalog)
    try:
        short, long = prompt_of(port, 128), prompt_of(port, 1024)
        for p in (short, long):
            stream(port, p, 4)                                         # warm: compile every shape
        stream(port, "x", 4)
        # Warm: each count's cohort shapes at the measured length. A cohort size's first step compiles
        # its kernels while every row waits, and short requests never form the 8-row decode cohort
        # (with 4 tokens each, the first rows finish before the last prefill ends): on a cold kernel
        # cache the 8-client figure came out at 0.2x.
        for n in clients:
            clients_run(port, short, args.tokens, n)
        print(f"device: {device.describe()}")
        print(f"model: {label}; {args.tokens} tokens per request, temperature 0\n")
        for p in (short, long):
            ttft = min(stream(port, p, 1)[0] for _ in range(3))
            print(f"time to first token, {count(port, p):4d}-token prompt  {ttft * 1000:8.1f} ms")
        # The machines swing by 10% within a minute: direct and HTTP rounds alternate (the
        # server idles while the direct loop runs) and the medians are compared.
        runs, direct = [], []
        for _ in range(ROUNDS):
            direct.append(package_bench.loom_figures(prepared, list(range(1, 129)), args.tokens)[1])
            runs.append(stream(port, short, args.tokens))
        prepared.release()
        rates = [(tokens - 1) / rest for _, rest, tokens in runs]
        # Each HTTP round against the direct round just before it: the host's drift over
        # the minute cancels in the pair, where it skews two medians taken apart.
        overhead = statistics.median(1 - h / d for h, d in zip(rates, direct))
        tokens = min(r[2] for r in runs)
        print(f"decode, one client over HTTP       {statistics.median(rates):8.1f} tok/s "
              f"(median of {ROUNDS}, {tokens}+ tokens)")
        print(f"decode, the package direct         {statistics.median(direct):8.1f} tok/s "
              f"(median of {ROUNDS}, alternating with HTTP)")
        print(f"serving overhead                   {overhead * 100:8.1f} % (median of the {ROUNDS} rounds' "
              f"1 - HTTP / direct; of the medians: {(1 - statistics.median(rates) / statistics.median(direct)) * 100:.1f} %)")
        base = None
        for n in clients:
            aggregate, steady_rate = clients_run(port, short, args.tokens, n)
            base = base or aggregate
            print(f"aggregate, {n:2d} client{'s' if n > 1 else ' '}               {aggregate:8.1f} tok/s "
                  f"({aggregate / base:4.1f}x)   steady decode {steady_rate:6.1f} tok/s")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
