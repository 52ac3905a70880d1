"""The llama package on tiny random checkpoints, against an independent numpy forward pass.

Runs the package's `advance` command directly through the runtime (prepared
weights, paged KV with scattered pages), for Llama, Qwen2-style (q/k/v biases,
NeoX rotation, tied head) and Qwen3-style (per-head q/k RMSNorm) checkpoints.
"""

import math
import os

import numpy as np
import pyopencl as cl
import pytest

from conftest import ROOT
from test_runtime import q4_0, q8_0

gguf = pytest.importorskip("gguf")

from loom import runtime  # noqa: E402
from loom.compiler import Compiler  # noqa: E402
from loom.device import Device  # noqa: E402

SOURCE = os.path.join(ROOT, "models", "llama", "llama.loom")
V, D, L, H, HKV, F = 96, 64, 2, 4, 2, 128
DH = D // H
PAGE, PAGES, CTX = 16, 24, 256


def make_checkpoint(path, arch, dtype, seed):
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", L)
    w.add_uint32(f"{arch}.embedding_length", D)
    w.add_uint32(f"{arch}.feed_forward_length", F)
    w.add_uint32(f"{arch}.attention.head_count", H)
    w.add_uint32(f"{arch}.attention.head_count_kv", HKV)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    weights = {}

    def matrix(name, rows, cols, scale):
        values = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if dtype == "F32":
            w.add_tensor(name, values)
        elif dtype == "F16":
            w.add_tensor(name, values.astype(np.float16))
            values = values.astype(np.float16).astype(np.float32)
        else:
            raw, values = (q8_0 if dtype == "Q8_0" else q4_0)(values)
            w.add_tensor(name, raw, raw_dtype=getattr(gguf.GGMLQuantizationType, dtype))
        weights[name] = values

    def vector(name, n, base=1.0, scale=0.1):
        values = (base + rng.standard_normal(n) * scale).astype(np.float32)
        w.add_tensor(name, values)
        weights[name] = values

    matrix("token_embd.weight", V, D, 1.0)
    for i in range(L):
        vector(f"blk.{i}.attn_norm.weight", D)
        matrix(f"blk.{i}.attn_q.weight", H * DH, D, D ** -0.5)
        matrix(f"blk.{i}.attn_k.weight", HKV * DH, D, D ** -0.5)
        matrix(f"blk.{i}.attn_v.weight", HKV * DH, D, D ** -0.5)
        if arch == "qwen2":
            for part, n in (("q", H * DH), ("k", HKV * DH), ("v", HKV * DH)):
                vector(f"blk.{i}.attn_{part}.bias", n, base=0.0, scale=0.2)
        if arch == "qwen3":
            vector(f"blk.{i}.attn_q_norm.weight", DH)
            vector(f"blk.{i}.attn_k_norm.weight", DH)
        matrix(f"blk.{i}.attn_output.weight", D, H * DH, (H * DH) ** -0.5)
        vector(f"blk.{i}.ffn_norm.weight", D)
        matrix(f"blk.{i}.ffn_gate.weight", F, D, D ** -0.5)
        matrix(f"blk.{i}.ffn_up.weight", F, D, D ** -0.5)
        matrix(f"blk.{i}.ffn_down.weight", D, F, F ** -0.5)
    vector("output_norm.weight", D)
    if arch != "qwen2":  # qwen2-style: tied output head
        matrix("output.weight", V, D, D ** -0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


# -- the independent reference -------------------------------------------------------

def rms(x, weight, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def rope(x, positions, neox):
    """x: [T, heads, DH] -> rotated (pairs (2i, 2i+1), or (i, i + DH/2) for NeoX)."""
    half = DH // 2
    freqs = 10000.0 ** (-np.arange(half) * 2 / DH)
    angles = positions[:, None, None] * freqs[None, None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:]
        out[..., :half], out[..., half:] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def forward(weights, arch, tokens):
    """Logits of the last token, float64, the straightforward way."""
    W = {k: v.astype(np.float64) for k, v in weights.items()}
    x = W["token_embd.weight"][tokens]
    positions = np.arange(len(tokens), dtype=np.float64)
    neox = arch != "llama"
    for i in range(L):
        h = rms(x, W[f"blk.{i}.attn_norm.weight"])
        q, k, v = (h @ W[f"blk.{i}.attn_{p}.weight"].T for p in "qkv")
        if arch == "qwen2":
            q, k, v = (m + W[f"blk.{i}.attn_{p}.bias"] for m, p in zip((q, k, v), "qkv"))
        q, k, v = q.reshape(-1, H, DH), k.reshape(-1, HKV, DH), v.reshape(-1, HKV, DH)
        if arch == "qwen3":
            q, k = rms(q, W[f"blk.{i}.attn_q_norm.weight"]), rms(k, W[f"blk.{i}.attn_k_norm.weight"])
        q, k = rope(q, positions, neox), rope(k, positions, neox)
        out = np.zeros_like(q)
        for head in range(H):
            g = head // (H // HKV)
            scores = q[:, head] @ k[:, g].T / math.sqrt(DH)
            scores += np.triu(np.full(scores.shape, -np.inf), 1)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, g]
        x = x + out.reshape(len(tokens), -1) @ W[f"blk.{i}.attn_output.weight"].T
        h = rms(x, W[f"blk.{i}.ffn_norm.weight"])
        gate, up = h @ W[f"blk.{i}.ffn_gate.weight"].T, h @ W[f"blk.{i}.ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ W[f"blk.{i}.ffn_down.weight"].T
    head = W.get("output.weight", W["token_embd.weight"])
    return rms(x[-1], W["output_norm.weight"]) @ head.T


# -- running the package --------------------------------------------------------------

def sync_submit(fn, done):
    try:
        result, error = fn(), None
    except Exception as e:  # handed to the caller, as the server's executor does
        result, error = None, e
    done(result, error)


@pytest.fixture(scope="module")
def device():
    dev = Device("cpu")
    return dev, Compiler(dev, sync_submit)


def run_advance(prepared, tokens, page_ids):
    """One prefill step of a single row whose pages are `page_ids` (scattered)."""
    device = prepared.device
    n = len(tokens)
    table = np.full(prepared.spec("MAX_PAGES"), -1, np.int32)
    table[:len(page_ids)] = page_ids
    host = {"tokens": np.array(tokens, np.int32), "pos": np.arange(n, dtype=np.int32),
            "row_of": np.zeros(n, np.int32), "pages": table, "last": np.array([n - 1], np.int32)}
    bufs = {name: device.pool.alloc(a.nbytes, "test", "workspace", host=a) for name, a in host.items()}
    bufs["logits"] = device.pool.alloc(4 * V, "test", "workspace")
    box = {}
    prepared.plan_async("advance", {"T": n, "R": 1}, lambda plan, error: box.update(plan=plan, error=error))
    assert box["error"] is None, box["error"]
    box["plan"].run(bufs).wait()
    logits = device.download(bufs["logits"], np.float32, V)
    for buf in bufs.values():
        buf.release()
    return logits


@pytest.mark.parametrize("arch,dtype", [("llama", "F32"), ("qwen2", "F32"), ("qwen3", "F32"),
                                         ("llama", "F16"), ("llama", "Q8_0"), ("qwen2", "Q4_0")])
def test_last_token_logits_match_numpy(device, tmp_path, arch, dtype):
    dev, compiler = device
    weights = make_checkpoint(tmp_path / "m.gguf", arch, dtype, seed=hash((arch, dtype)) % 1000)
    prepared = runtime.prepare(f"{arch}-{dtype}", [SOURCE], str(tmp_path / "m.gguf"),
                               {"pages": PAGES, "page_size": PAGE, "context_length": CTX}, dev, compiler)
    try:
        rng = np.random.default_rng(1)
        for n in (1, 7, 33):
            tokens = rng.integers(0, V, n).tolist()
            pages = rng.permutation(PAGES)[:math.ceil(n / PAGE)]  # scattered, not in order
            got = run_advance(prepared, tokens, pages)
            want = forward(weights, arch, tokens)
            scale = np.abs(want).max()
            assert np.abs(got - want).max() <= 1e-4 * scale, (n, np.abs(got - want).max(), scale)
    finally:
        prepared.release()
