"""Retained conversation benchmark: prints figures, asserts nothing.

Time to first token for each turn of a 10-turn chat (each user turn ~200
tokens, the whole history sent every turn, the OpenAI way) with the server's
retained history (every turn under one X-Loom-Session) against cold replay of
the same messages (each turn under a fresh session name, so the whole prompt is
prefilled again), both measured in the same run against a real
`python -m loom`. Each turn runs reuse first, then cold, so load drift hits
both alike; the whole conversation runs once unmeasured first, so no turn pays
for compiling a new chunk shape. The deployment has no prefix cache, and named
sessions take no part in automatic idle-row reuse: the cold turns must report
cached_tokens 0 (a warning line says so if not, or if greedy replies differ).
Then the finished conversation is pinned as a checkpoint (elastic backing): a
branch from it is timed while resident, after suspension into host memory
(the suspension itself is timed too), and as a cold replay.

The model is bench/llama.py's random-weight Q8_0 GGUF shaped like Qwen2.5-0.5B
with a byte-level tokenizer (bench/text.py); by default with 8 of its 24
layers so the 20 turns finish in a few minutes on a small CPU (--layers 24:
the full shape).

    python bench/retained.py [--layers 8] [--dtype Q8_0] [--turns 10] [--words 200] [--tokens 16]
"""

import os
import sys

# bench/ holds an http.py: keep it off the path so `http` is the stdlib's.
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import argparse  # noqa: E402
import http.client  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

_spec = importlib.util.spec_from_file_location("text_bench", os.path.join(HERE, "text.py"))
text_bench = importlib.util.module_from_spec(_spec)  # bench/text.py: tokenizer; its bench/llama.py: the model
_spec.loader.exec_module(text_bench)
package_bench = text_bench.package_bench

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river stone light garden window paper music story letter "
         "market city road table winter summer morning evening bridge forest mountain island harbor lantern").split()


def checkpoint(dtype, layers):
    """bench/llama.py's checkpoint, with `layers` of its layers (its own cache folder unless all)."""
    if layers == package_bench.SHAPE["L"]:
        return package_bench.checkpoint(dtype)
    shape, cache = package_bench.SHAPE, package_bench.CACHE
    package_bench.SHAPE = dict(shape, L=layers)
    package_bench.CACHE = os.path.join(cache, f"layers-{layers}")
    try:
        return package_bench.checkpoint(dtype)
    finally:
        package_bench.SHAPE, package_bench.CACHE = shape, cache


def post(port, path, body, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    if body is None:
        conn.request("POST", path, b"", headers or {})
    else:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    if resp.status not in (200, 201):
        raise RuntimeError(f"{path}: {resp.status} {data}")
    return data


def user_turn(port, turn, target):
    """Deterministic words for turn `turn`, `target` tokens long (counted by POST /tokenize)."""
    rng = random.Random(turn)
    words = [f"Turn {turn}."]
    text = ""
    while True:
        words.append(rng.choice(WORDS))
        candidate = " ".join(words)
        if len(post(port, "/tokenize", {"model": "bench", "content": candidate})["tokens"]) > target:
            return text
        text = candidate


def stream(port, messages, max_tokens, session, checkpoint=None):
    """(seconds to the first content token, the reply's text, usage) for one streamed turn."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json", "X-Loom-Session": session}
    if checkpoint is not None:
        headers["X-Loom-Checkpoint"] = checkpoint
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"chat completion: {resp.status} {resp.read()[:500]!r}")
    first = None
    after_role = None     # the first chunk after the role chunk, if no content ever comes
    seen_role = False
    parts, usage = [], None
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            usage = event["usage"]
            continue
        if not event["choices"]:
            continue
        delta = event["choices"][0]["delta"]
        if "role" in delta and not seen_role:
            seen_role = True
            continue
        if after_role is None:
            after_role = time.perf_counter()
        if delta.get("content"):
            parts.append(delta["content"])
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    conn.close()
    first = first or after_role or end
    return first - start, "".join(parts), usage


def conversation(port, turns, max_tokens, name, show=False):
    """Each turn under session `name`-reuse, then the same messages under a fresh
    `name`-cold-<turn>; the reuse reply joins the history. ([(ttft reuse, ttft cold)],
    turns whose replies differ, turns whose usage is not as expected, the history)."""
    messages, rows, differs, unexpected = [], [], [], []
    for turn, content in enumerate(turns, 1):
        messages.append({"role": "user", "content": content})
        ttft_r, reply_r, usage_r = stream(port, messages, max_tokens, f"{name}-reuse")
        ttft_c, reply_c, usage_c = stream(port, messages, max_tokens, f"{name}-cold-{turn}")
        cached_r = usage_r["prompt_tokens_details"]["cached_tokens"]
        cached_c = usage_c["prompt_tokens_details"]["cached_tokens"]
        if reply_r != reply_c:
            differs.append(turn)
        if cached_c != 0 or (turn > 1 and cached_r == 0) or usage_r["prompt_tokens"] != usage_c["prompt_tokens"]:
            unexpected.append(turn)
        rows.append((ttft_r, ttft_c))
        if show:
            print(f"{turn:4} {usage_r['prompt_tokens']:10} {cached_r:12} {cached_c:11} {ttft_r * 1000:13.1f} "
                  f"{ttft_c * 1000:12.1f} {ttft_c / ttft_r:7.2f}x", flush=True)
        messages.append({"role": "assistant", "content": reply_r})
    return rows, differs, unexpected, messages


def checkpoints(port, messages, question, max_tokens):
    """Pin the finished conversation's session, then time a branch from it while resident,
    the suspension into host memory, a branch from the suspended endpoint (warmed back into
    new pages) and a cold replay of the same branch."""
    control = {"X-Loom-Model": "bench"}
    pinned = post(port, "/v1/checkpoints/bench-end", None, dict(control, **{"X-Loom-Session": "bench-reuse"}))
    branch = messages + [{"role": "user", "content": question}]
    resident, reply_a, usage_a = stream(port, branch, max_tokens, "branch-resident", "bench-end")
    start = time.perf_counter()
    parked = post(port, "/v1/checkpoints/bench-end/suspend", None, control)
    suspend = time.perf_counter() - start
    warmed, reply_b, usage_b = stream(port, branch, max_tokens, "branch-suspended", "bench-end")
    cold, reply_c, _ = stream(port, branch, max_tokens, "branch-cold")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("DELETE", "/v1/checkpoints/bench-end", headers=control)
    conn.getresponse().read()
    conn.close()
    mb = parked["host_snapshot_bytes"] / 1e6
    print(f"\ncheckpoint of the finished conversation: {pinned['position']} positions")
    print(f"  suspend to host memory   {suspend * 1000:8.1f} ms  ({mb:.1f} MB, {mb / suspend:.0f} MB/s)")
    print(f"  branch TTFT, resident    {resident * 1000:8.1f} ms  (cached {usage_a['prompt_tokens_details']['cached_tokens']})")
    print(f"  branch TTFT, suspended   {warmed * 1000:8.1f} ms  (cached {usage_b['prompt_tokens_details']['cached_tokens']}, "
          f"warmed back into new pages)")
    print(f"  branch TTFT, cold replay {cold * 1000:8.1f} ms")
    if not reply_a == reply_b == reply_c:
        print("WARNING: greedy branch replies differ between resident, suspended and cold")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8, help="of the 0.5B shape's 24 (default 8)")
    ap.add_argument("--dtype", default="Q8_0")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--words", type=int, default=200, help="tokens per user turn")
    ap.add_argument("--tokens", type=int, default=16, help="max_tokens per reply")
    args = ap.parse_args()
    gguf = checkpoint(args.dtype, args.layers)
    text_bench.tokenizer_beside(gguf, package_bench.SHAPE["V"])
    folder = os.path.dirname(gguf)
    catalog = os.path.join(folder, "retained-catalog.json")
    with open(catalog, "w") as f:
        json.dump([{"model": "bench", "kind": "text", "sources": [os.path.join(ROOT, "models", "llama", "llama.loom")],
                    "checkpoint": gguf, "base_directory": folder, "rows": 2, "context_length": 4096,
                    "max_output_tokens": 512, "session_cache_capacity": 2, "prefix_cache_capacity": 0,
                    "checkpoint_capacity": 1, "checkpoint_backing": "elastic", "options": {"chat": "chatml"}}], f)
    proc, port = text_bench.serve(catalog)
    try:
        turns = [user_turn(port, turn, args.words) for turn in range(1, args.turns + 1)]
        # Warm: the whole conversation once, unmeasured, so every prefill chunk length and
        # decode shape the measured turns use is compiled already.
        conversation(port, turns, args.tokens, "warm")
        print(f"model: {args.dtype} 0.5B shape with {args.layers} of 24 layers (random weights, byte-level "
              f"tokenizer); {args.turns} turns of ~{args.words} user tokens, {args.tokens}-token greedy replies; "
              f"rows 2, no prefix cache\n")
        print(f"{'turn':>4} {'prompt tok':>10} {'cached reuse':>12} {'cached cold':>11} {'TTFT reuse ms':>13} "
              f"{'TTFT cold ms':>12} {'speed-up':>8}")
        rows, differs, unexpected, history = conversation(port, turns, args.tokens, "bench", show=True)
        later = rows[1:]
        mean = sum(c / r for r, c in later) / len(later) if later else float("nan")
        print(f"\nturn {args.turns}: {rows[-1][1] / rows[-1][0]:.2f}x faster to first token with reuse; "
              f"mean over turns 2-{args.turns}: {mean:.2f}x")
        if differs:
            print(f"WARNING: greedy replies differ between reuse and cold replay at turns {differs}")
        if unexpected:
            print(f"WARNING: unexpected usage (cold cached_tokens != 0, reuse cached_tokens == 0 after turn 1, "
                  f"or prompt_tokens differing) at turns {unexpected}")
        checkpoints(port, history, user_turn(port, args.turns + 1, args.words), args.tokens)
    except Exception:
        if proc.poll() is not None:
            print(f"the server exited ({proc.returncode}); its last lines:\n{''.join(proc.log)}", file=sys.stderr)
        raise
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
