"""Write a deterministic random checkpoint for the affine package.

    python models/affine/make_checkpoint.py OUT.safetensors [--vocab 1000] [--dim 64] [--out_dim 32] [--seed 0]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from loom.weights import write_safetensors  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=64, help="embedding width (a multiple of 32)")
    ap.add_argument("--out_dim", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    write_safetensors(args.out, {
        "token_embd.weight": rng.standard_normal((args.vocab, args.dim)).astype(np.float16),
        "proj.weight": (rng.standard_normal((args.out_dim, args.dim)) / np.sqrt(args.dim)).astype(np.float32),
        "proj.bias": np.zeros(args.out_dim, np.float32),
    })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
