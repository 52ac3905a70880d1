"""Numerical fingerprints of the llama package on the bench files: run before and
after a kernel or geometry change and diff the two outputs.

For each file bench/llama.py generates (the 0.5B-shaped Llama in Q4_0, Q4_K_M,
Q8_0 and F16, as `--peer` writes them) and the default catalog's SmolLM2 Q4_1:
a 100-token prompt prefilled in chunks of 40 and 60 (both past the widening
threshold), a hash of its last logits, 12 greedy tokens, and a hash of the
logits after them. A change meant to keep the arithmetic (a new unpacking, a
tile that sums in the same order) must leave every line unchanged; a line that
changes names the file whose numbers moved. Files not yet generated are skipped
(`python bench/llama.py --peer` writes them).

    python bench/fingerprint.py [--device SELECTOR] > before.txt
"""

import argparse
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import llama as bench  # noqa: E402  (bench/llama.py: its Row, SOURCE and cache paths)
from loom import demo, runtime  # noqa: E402
from loom.compiler import Compiler, run_now  # noqa: E402
from loom.device import Device  # noqa: E402

FILES = ["qwen-0.5b-shape-vocab-Q4_0.gguf", "qwen-0.5b-shape-vocab-Q4_K_M.gguf",
         "qwen-0.5b-shape-vocab-Q8_0.gguf", "qwen-0.5b-shape-vocab-F16.gguf"]


def digest(logits):
    return hashlib.sha1(np.ascontiguousarray(logits, np.float32).tobytes()).hexdigest()[:12]


def fingerprint(prepared):
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, prepared.spec("V"), 100)]
    row = bench.Row(prepared)
    try:
        row.step(prompt[:40])
        logits = row.step(prompt[40:])
        prefill = digest(logits)
        tokens = [int(logits.argmax())]
        for _ in range(11):
            tokens.append(int(row.step([tokens[-1]]).argmax()))
        return prefill, tokens, digest(row.step([tokens[-1]]))
    finally:
        row.release()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    device = Device(args.device)
    compiler = Compiler(device, run_now)
    print(f"device: {device.describe()}")
    paths = [os.path.join(bench.CACHE, name) for name in FILES] + [demo.smollm2_file()]
    for path in paths:
        if not os.path.exists(path):
            print(f"{os.path.basename(path)}: not generated (python bench/llama.py --peer)")
            continue
        prepared = runtime.prepare("fingerprint", [bench.SOURCE], path,
                                   {"pages": bench.CTX // bench.PAGE, "page_size": bench.PAGE,
                                    "context_length": bench.CTX}, device, compiler)
        try:
            prefill, tokens, after = fingerprint(prepared)
        finally:
            prepared.release()
        print(f"{os.path.basename(path)}: prefill logits {prefill}, greedy {tokens}, then logits {after}", flush=True)


if __name__ == "__main__":
    main()
