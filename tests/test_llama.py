"""The llama package on tiny random checkpoints, against an independent numpy forward pass.

Runs the package's `advance` command directly through the runtime (prepared
weights, paged KV with scattered pages), for Llama, Qwen2-style (q/k/v biases,
NeoX rotation, tied head) and Qwen3-style (per-head q/k RMSNorm) checkpoints,
and its sequence stage `encode` (every token's final normed hidden state, f16).
"""

import math
import os

import numpy as np
import pytest

from conftest import ROOT, drivers, compiler_for
from test_kernels import quantize_activations_q8
from test_runtime import q4_0, q8_0

gguf = pytest.importorskip("gguf")

from loom import runtime  # noqa: E402
from loom.device import Device  # noqa: E402
from loom.weights import open_checkpoint, quantize  # noqa: E402

SOURCE = os.path.join(ROOT, "models", "llama", "llama.loom")
V, D, L, H, HKV, F = 96, 64, 2, 4, 2, 128
DH = D // H
PAGE, PAGES, CTX = 16, 24, 512
KQUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
KQ_DIMS = (256, 256)     # (D, F) of K-quant checkpoints: every row one 256-value superblock (few shapes to build)


HF_NAMES = [
    (r"token_embd.weight", "model.embed_tokens.weight"), (r"output_norm.weight", "model.norm.weight"),
    (r"output.weight", "lm_head.weight"), ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"), ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"), ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.bias", "self_attn.k_proj.bias"), ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"), ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"), ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
]


def hf_name(name):
    for gguf_part, hf_part in HF_NAMES:
        if name == gguf_part:
            return hf_part
        if name.startswith("blk.") and name.split(".", 2)[2] == gguf_part:
            return f"model.layers.{name.split('.')[1]}.{hf_part}"
    raise KeyError(name)


def bf16_bits(values):
    """float32 -> bfloat16 bits, round to nearest even (as torch does)."""
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def write_hf(folder, arch, tensors, dtype):
    """A Hugging Face-style checkpoint: model.safetensors (F32, F16 or BF16) and config.json."""
    import json
    import struct
    header, blobs, offset, used = {}, [], 0, {}
    for name, values in tensors.items():
        if dtype == "BF16" and values.ndim == 2:
            bits = bf16_bits(values)
            data, used[name] = bits.tobytes(), (bits.astype(np.uint32) << 16).view(np.float32)
        elif dtype == "F16" and values.ndim == 2:
            data, used[name] = values.astype(np.float16).tobytes(), values.astype(np.float16).astype(np.float32)
        else:
            data, used[name] = values.astype(np.float32).tobytes(), values
        kind = "F32" if values.ndim != 2 or dtype == "F32" else dtype
        header[hf_name(name)] = {"dtype": kind, "shape": list(values.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    (folder / "config.json").write_text(json.dumps({
        "model_type": arch, "hidden_size": D, "num_hidden_layers": L, "num_attention_heads": H,
        "num_key_value_heads": HKV, "intermediate_size": F, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "head_dim": DH, "vocab_size": V, "tie_word_embeddings": arch == "qwen2"}))
    return used


def q4_k_m_type(name, cols, tied):
    """The type llama.cpp's quantizer gives a matrix of a Q4_K_M file (src/llama-quant.cpp,
    llama_tensor_get_type for a non-Falcon model without imatrix): the output head (and a
    tied token embedding, which doubles as the head) Q6_K, attn_v and ffn_down Q6_K in the
    layers use_more_bits picks (of L = 2: layer 1), the rest Q4_K; then rows (cols) not a
    multiple of 256 fall back: the head to Q8_0, Q6_K to Q8_0, Q4_K to Q5_0."""
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q8_0" if cols % 256 else "Q6_K"
    kind = "Q4_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(name.split(".")[1])
        if layer < L // 8 or layer >= 7 * L // 8 or (layer - L // 8) % 3 == 2:   # use_more_bits
            kind = "Q6_K"
    return {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[kind] if cols % 256 else kind


def make_checkpoint(path, arch, dtype, seed, fmt="gguf", dims=None):
    """Random weights in `fmt` ("gguf" at path, or "safetensors" in the folder path);
    returns the values the model really holds (after rounding or quantization).
    dtype "Q4_K_M": each matrix in the type q4_k_m_type gives it. dims: (D, F), by
    default (D, F) of this module, or KQ_DIMS for a K-quant dtype."""
    d_model, ffn = dims or (KQ_DIMS if dtype in KQUANTS else (D, F))
    rng = np.random.default_rng(seed)
    if fmt == "safetensors":
        raw = make_checkpoint(None, arch, "F32", seed, fmt="values")
        return write_hf(path, arch, raw, dtype)

    class Collect:
        def __init__(self):
            self.tensors = {}

        def add_tensor(self, name, values, raw_dtype=None):
            self.tensors[name] = values

    w = Collect() if fmt == "values" else gguf.GGUFWriter(str(path), arch)
    if fmt == "values":
        w.add_uint32 = w.add_float32 = lambda *a: None
    w.add_uint32(f"{arch}.block_count", L)
    w.add_uint32(f"{arch}.embedding_length", d_model)
    w.add_uint32(f"{arch}.feed_forward_length", ffn)
    w.add_uint32(f"{arch}.attention.head_count", H)
    w.add_uint32(f"{arch}.attention.head_count_kv", HKV)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    weights = {}

    def matrix(name, rows, cols, scale):
        values = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        kind = q4_k_m_type(name, cols, arch == "qwen2") if dtype == "Q4_K_M" else dtype
        if kind == "F32":
            w.add_tensor(name, values)
        elif kind == "F16":
            w.add_tensor(name, values.astype(np.float16))
            values = values.astype(np.float16).astype(np.float32)
        elif kind in ("Q4_1", "Q5_0", "Q5_1") + KQUANTS:
            # gguf's dequantization of the very bytes written: the reference (gguf's own
            # quantizer where it has one; gguf-py cannot write K-quants, Loom's can)
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            raw = quantize(values, kind) if kind in KQUANTS else gguf.quants.quantize(values, qtype)
            values = gguf.quants.dequantize(raw, qtype).astype(np.float32)
            w.add_tensor(name, raw, raw_dtype=qtype)
        else:
            raw, values = (q8_0 if kind == "Q8_0" else q4_0)(values)
            w.add_tensor(name, raw, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
        weights[name] = values

    def vector(name, n, base=1.0, scale=0.1):
        values = (base + rng.standard_normal(n) * scale).astype(np.float32)
        w.add_tensor(name, values)
        weights[name] = values

    d, f, dh = d_model, ffn, d_model // H
    matrix("token_embd.weight", V, d, 1.0)
    for i in range(L):
        vector(f"blk.{i}.attn_norm.weight", d)
        matrix(f"blk.{i}.attn_q.weight", H * dh, d, d ** -0.5)
        matrix(f"blk.{i}.attn_k.weight", HKV * dh, d, d ** -0.5)
        matrix(f"blk.{i}.attn_v.weight", HKV * dh, d, d ** -0.5)
        if arch == "qwen2":
            for part, n in (("q", H * dh), ("k", HKV * dh), ("v", HKV * dh)):
                vector(f"blk.{i}.attn_{part}.bias", n, base=0.0, scale=0.2)
        if arch == "qwen3":
            vector(f"blk.{i}.attn_q_norm.weight", dh)
            vector(f"blk.{i}.attn_k_norm.weight", dh)
        matrix(f"blk.{i}.attn_output.weight", d, H * dh, (H * dh) ** -0.5)
        vector(f"blk.{i}.ffn_norm.weight", d)
        matrix(f"blk.{i}.ffn_gate.weight", f, d, d ** -0.5)
        matrix(f"blk.{i}.ffn_up.weight", f, d, d ** -0.5)
        matrix(f"blk.{i}.ffn_down.weight", d, f, f ** -0.5)
    vector("output_norm.weight", d)
    if arch != "qwen2":  # qwen2-style: tied output head
        matrix("output.weight", V, d, d ** -0.5)
    if fmt == "values":
        return w.tensors
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


# -- the independent reference -------------------------------------------------------

def rms(x, weight, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def rope(x, positions, neox, base=10000.0):
    """x: [T, heads, DH] -> rotated (pairs (2i, 2i+1), or (i, i + DH/2) for NeoX)."""
    dh = x.shape[-1]
    half = dh // 2
    freqs = base ** (-np.arange(half) * 2 / dh)
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


def split(dtype):
    """A case's dtype: the checkpoint storage, and "+int8" for the package's
    int8_activations option -> (storage, option on)."""
    storage, _, mode = dtype.partition("+")
    return storage, mode == "int8"


def options(dtype, pages=None, context=None):
    """runtime.prepare options for a case (the int8_activations option when it asks)."""
    out = {"pages": pages or PAGES, "page_size": PAGE, "context_length": context or CTX}
    if split(dtype)[1]:
        out["int8_activations"] = True
    return out


def rel_tol(dtype):
    """Relative logit tolerance against forward(). Float activations: 1e-4 (float32 vs
    float64 arithmetic). Int8 activations: an input that lands within float32 rounding of
    a half step rounds the other way in the kernel than in the float64 reference, moving
    that activation by one int8 step (d/2 either side); over a prompt's thousands of
    quantized inputs a few do, which measured up to 3.5e-3 of the largest logit."""
    return 1e-2 if split(dtype)[1] else 1e-4


def act_q8(dtype, steps, rows=1):
    """Which matmul inputs llama.loom quantizes to int8 (ACT_Q8: Q8_0/Q4_0 weights with
    the int8_activations option, at every step size) for a row fed in steps of `steps`
    tokens: forward()'s act_q8 argument (token mask, head)."""
    storage, int8 = split(dtype)
    on = int8 and storage in ("Q8_0", "Q4_0")
    return np.full(sum(steps), on), on


def q8_activations(x):
    """x as the ACT_Q8 matmul sees it: float32, quantized per 32-block, dequantized
    (an integer block dot scaled by d_w * d_x equals this times the weights)."""
    q, d = quantize_activations_q8(np.asarray(x, np.float32))
    return (q.astype(np.float64) * d[..., None].astype(np.float64)).reshape(np.shape(x))


TINY = {"layers": L, "heads": H, "kv_heads": HKV, "rope_base": 10000.0, "eps": 1e-6}


def forward(weights, arch, tokens, fmt="gguf", hidden=False, act_q8=None, shape=TINY):
    """Logits of the last token, float64, the straightforward way; with hidden=True,
    every token's final hidden state after the output norm instead, [T, D].
    act_q8: (token mask, head) from act_q8(): those tokens' matmul inputs (and the
    head's) are int8-quantized first, as the kernels do. shape: the model's
    hyperparameters (TINY: the random checkpoints here; test_smollm2 passes SmolLM2's)."""
    W = {k: v.astype(np.float64) for k, v in weights.items()}
    heads, kv_heads, eps = shape["heads"], shape["kv_heads"], shape["eps"]
    dh = W["blk.0.attn_q.weight"].shape[0] // heads
    mask, head_q8 = act_q8 if act_q8 is not None else (np.zeros(len(tokens), bool), False)

    def lin(h, name):
        if mask.any():
            h = h.copy()
            h[mask] = q8_activations(h[mask])
        return h @ W[name].T
    x = W["token_embd.weight"][tokens]
    positions = np.arange(len(tokens), dtype=np.float64)
    neox = arch != "llama" or fmt != "gguf"   # HF checkpoints rotate halves; GGUF llama weights are permuted
    for i in range(shape["layers"]):
        h = rms(x, W[f"blk.{i}.attn_norm.weight"], eps)
        q, k, v = (lin(h, f"blk.{i}.attn_{p}.weight") for p in "qkv")
        if arch == "qwen2":
            q, k, v = (m + W[f"blk.{i}.attn_{p}.bias"] for m, p in zip((q, k, v), "qkv"))
        q, k, v = q.reshape(-1, heads, dh), k.reshape(-1, kv_heads, dh), v.reshape(-1, kv_heads, dh)
        if arch == "qwen3":
            q, k = rms(q, W[f"blk.{i}.attn_q_norm.weight"], eps), rms(k, W[f"blk.{i}.attn_k_norm.weight"], eps)
        q, k = rope(q, positions, neox, shape["rope_base"]), rope(k, positions, neox, shape["rope_base"])
        out = np.zeros_like(q)
        for head in range(heads):
            g = head // (heads // kv_heads)
            scores = q[:, head] @ k[:, g].T / math.sqrt(dh)
            scores += np.triu(np.full(scores.shape, -np.inf), 1)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, g]
        x = x + lin(out.reshape(len(tokens), -1), f"blk.{i}.attn_output.weight")
        h = rms(x, W[f"blk.{i}.ffn_norm.weight"], eps)
        gate, up = lin(h, f"blk.{i}.ffn_gate.weight"), lin(h, f"blk.{i}.ffn_up.weight")
        x = x + lin(gate / (1 + np.exp(-gate)) * up, f"blk.{i}.ffn_down.weight")
    if hidden:
        return rms(x, W["output_norm.weight"], eps)
    head = W.get("output.weight", W["token_embd.weight"])
    last = rms(x[-1], W["output_norm.weight"], eps)
    return (q8_activations(last[None])[0] if head_q8 else last) @ head.T


# -- running the package --------------------------------------------------------------



@pytest.fixture(scope="module", params=drivers())
def device(request):
    """Every usable driver present (CPU and GPU): the package's numerics must hold on each."""
    dev = Device(request.param)
    return dev, compiler_for(dev)


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


CASES = [(arch, dtype, "gguf") for arch in ("llama", "qwen2", "qwen3") for dtype in ("F32", "F16", "Q8_0", "Q4_0")] \
    + [(arch, dtype, "safetensors") for arch in ("llama", "qwen2", "qwen3") for dtype in ("F32", "F16", "BF16")] \
    + [("qwen2", "Q8_0+int8", "gguf"), ("llama", "Q4_0+int8", "gguf"), ("llama", "Q4_1", "gguf"), ("qwen2", "Q5_0", "gguf"),
         ("llama", "Q5_1", "gguf")] \
    + [(arch, dtype, "gguf") for arch, dtype in zip(("llama", "qwen2", "qwen3", "llama", "qwen2"), KQUANTS)]


def kquant_models_on_one_driver(request):
    """Whole K-quant models build slowly on Intel's compiler (about 4 s per unrolled tile):
    they run on the first driver only; test_kernels checks every K-quant kernel on every driver."""
    if request.node.callspec.params["device"] != drivers()[0]:
        pytest.skip("K-quant whole models run on the first driver (test_kernels covers every driver)")


# `make test` runs a whole model per architecture on the preferred driver (each its own weight
# type and format: test_kernels checks every type's kernels on every driver), one of them on
# every other driver, and one Q4_K_M mix; `make test-full` runs every case on every driver.
QUICK_CASES = {("llama", "Q4_0", "gguf"): pytest.mark.every_driver, ("qwen2", "Q8_0+int8", "gguf"): (),
               ("qwen3", "BF16", "safetensors"): ()}


@pytest.mark.parametrize("arch,dtype,fmt", [pytest.param(*c, id="-".join(c), marks=QUICK_CASES.get(c, pytest.mark.full))
                                            for c in CASES])
def test_last_token_logits_match_numpy(device, tmp_path, arch, dtype, fmt, request):
    """Prompts of 1, 7, 33 and 257 tokens (257 in prefill chunks of 64, over more than one KV page)."""
    if dtype in KQUANTS:
        kquant_models_on_one_driver(request)
    check_logits(device, tmp_path, arch, dtype, fmt)


@pytest.mark.parametrize("dtype,width", [pytest.param("F16", 16, id="F16-16"),
                                         *[pytest.param(d, w, id=f"{d}-{w}", marks=pytest.mark.full) for d, w in
                                           (("F16", 8), ("Q8_0", 8), ("Q8_0", 16), ("Q4_1", 8), ("Q4_1", 16))]])
def test_logits_match_numpy_at_each_vector_width(device, tmp_path, dtype, width):
    """The package's matmul tiles follow the device's vector width (8 floats: AVX2 tiles of 8
    accumulators; 16: AVX-512's 4 x 4 of float16): whichever the host has, both give numpy's logits."""
    dev, _ = device
    before = dev.info.get("vector_width", 0)
    dev.info["vector_width"] = width
    try:
        check_logits(device, tmp_path, "llama", dtype, "gguf")
    finally:
        dev.info["vector_width"] = before


# Q4_K_M-style mixes (q4_k_m_type), with dims (D, F) where fallback occurs: F = 320 rows
# make ffn_down fall back to Q5_0 / Q8_0 beside Q4_K and Q6_K; D = 64 makes every matrix
# but ffn_down fall back, as Qwen2.5-0.5B's D = 896 does in its Q4_K_M files.
MIX_CASES = [("llama", (256, 320), {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}),
             ("qwen2", (256, 320), {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}),
             ("qwen2", (64, 256), {"Q4_K", "Q6_K", "Q5_0", "Q8_0"})]


@pytest.mark.parametrize("arch,dims,types", [pytest.param(*c, id=f"{c[0]}-{c[1][0]}x{c[1][1]}",
                                                           marks=() if c[0] == "qwen2" and c[1] == (64, 256) else
                                                           pytest.mark.full) for c in MIX_CASES])
def test_q4_k_m_mix_logits_match_numpy(device, tmp_path, arch, dims, types, request):
    """A checkpoint of mixed types as llama.cpp's Q4_K_M writes them, each matrix's kernels
    specialized to its own type, against the numpy forward pass of gguf's dequantization."""
    kquant_models_on_one_driver(request)
    path = check_logits(device, tmp_path, arch, "Q4_K_M", "gguf", dims)
    with open_checkpoint(path) as ck:      # the dims really made matrices fall back
        matrices = {t.dtype for t in ck.tensors.values() if len(t.shape) == 2}
    assert matrices == types


@pytest.mark.parametrize("kind,field,value", [("Q2_K", 82, np.nan), ("Q3_K", 108, np.inf), ("Q4_K", 2, -np.inf),
                                              ("Q5_K", 0, np.nan), ("Q6_K", 208, np.inf)])
def test_non_finite_kquant_scales_fail_preparation(device, tmp_path, kind, field, value):
    """A NaN or infinite d or dmin in one superblock of one tensor stops preparation (the
    kernels decode without checks), naming the tensor in the server's log."""
    dev, compiler = device
    path = tmp_path / "m.gguf"
    make_checkpoint(path, "llama", kind, seed=3)
    name = "blk.1.ffn_up.weight"
    with open_checkpoint(path) as ck:
        at = ck.tensors[name].offset + 5 * ck.tensors[name].nbytes // ck.tensors[name].shape[0] + field
    data = bytearray(path.read_bytes())
    data[at:at + 2] = np.float16(value).tobytes()       # row 5, its first superblock
    path.write_bytes(bytes(data))
    with pytest.raises(runtime.PrepareError, match="a tensor of the checkpoint has non-finite block scales") as e:
        runtime.prepare("bad", [SOURCE], str(path), options(kind), dev, compiler).release()
    # The tensor's name is the server file's text: only the server's own log (private) holds it.
    assert e.value.code == "weights" and name not in e.value.message
    assert e.value.private == f"tensor '{name}' has non-finite block scales"


def check_logits(device, tmp_path, arch, dtype, fmt, dims=None):
    """Last-token logits of prompts of 1, 7, 33 and 257 tokens (257 in prefill chunks of 64)
    against forward(); returns the checkpoint's path."""
    dev, compiler = device
    path = tmp_path / ("m.gguf" if fmt == "gguf" else "hf")
    weights = make_checkpoint(path, arch, split(dtype)[0], seed=sum(map(ord, arch + dtype + fmt)), fmt=fmt, dims=dims)
    prepared = runtime.prepare(f"{arch}-{dtype}", [SOURCE], str(path), options(dtype), dev, compiler)
    try:
        rng = np.random.default_rng(1)
        for n in (1, 7, 33, 257):
            tokens = rng.integers(0, V, n).tolist()
            rows = Rows(prepared, 1)
            for start in range(0, n, 64):
                logits = rows.step([(0, tokens[start:start + 64])])[0]
            want = forward(weights, arch, tokens, fmt, act_q8=act_q8(dtype, [min(64, n - s) for s in range(0, n, 64)]))
            scale = np.abs(want).max()
            assert np.abs(logits - want).max() <= rel_tol(dtype) * scale, (n, np.abs(logits - want).max(), scale)
    finally:
        prepared.release()
    return path


class Rows:
    """A minimal host-side driver of `advance`: rows with page tables, steps mixing rows."""

    def __init__(self, prepared, rows, pages=PAGES, vocab=V):
        self.prepared, self.vocab = prepared, vocab
        self.max_pages = prepared.spec("MAX_PAGES")
        free = list(np.random.default_rng(7).permutation(pages))
        per_row = min(pages // rows, self.max_pages)
        self.tables = np.full((rows, self.max_pages), -1, np.int32)
        for r in range(rows):
            self.tables[r, :per_row] = [free.pop() for _ in range(per_row)]
        self.length = [0] * rows

    def _pack(self, work):
        """The cohort's per-token inputs, advancing each listed row's length."""
        tokens, pos, row_of, last = [], [], [], []
        for row, ids in work:
            tokens += ids
            pos += list(range(self.length[row], self.length[row] + len(ids)))
            row_of += [row] * len(ids)
            last.append(len(tokens) - 1)
            self.length[row] += len(ids)
        return {"tokens": np.array(tokens, np.int32), "pos": np.array(pos, np.int32),
                "row_of": np.array(row_of, np.int32), "pages": self.tables.ravel().copy(),
                "last": np.array(last, np.int32)}

    def _run(self, command, geometry, host, out_name, out_bytes):
        device = self.prepared.device
        bufs = {n: device.pool.alloc(a.nbytes, "test", "workspace", host=a) for n, a in host.items()}
        bufs[out_name] = device.pool.alloc(out_bytes, "test", "workspace")
        box = {}
        self.prepared.plan_async(command, geometry, lambda plan, error: box.update(plan=plan, error=error))
        assert box["error"] is None, box["error"]
        box["plan"].run(bufs).wait()
        out = device.download(bufs[out_name], np.uint8, out_bytes)
        for buf in bufs.values():
            buf.release()
        return out

    def step(self, work):
        """work: [(row, [token ids])] -> logits of each listed row's last token, in order."""
        host = self._pack(work)
        out = self._run("advance", {"T": len(host["tokens"]), "R": len(work)}, host, "logits",
                        4 * self.vocab * len(work))
        return out.view(np.float32).reshape(len(work), self.vocab)

    def encode(self, work):
        """work: [(row, [token ids])] -> the sequence stage's output bytes, [T, SEQUENCE_BYTES]
        uint8, tokens in the order listed."""
        host = self._pack(work)
        del host["last"]
        T, size = len(host["tokens"]), self.prepared.spec("SEQUENCE_BYTES")
        return self._run("encode", {"T": T}, host, "out", T * size).reshape(T, size)


def greedy_reference(weights, arch, prompt, n, dtype="F32"):
    tokens, out, gaps = list(prompt), [], []
    for _ in range(n):
        logits = forward(weights, arch, tokens, act_q8=act_q8(dtype, [len(tokens)]))
        top = np.sort(logits)[-2:]
        gaps.append(top[1] - top[0])
        tokens.append(int(logits.argmax()))
        out.append(tokens[-1])
    return out, gaps


def prepared_model(device, folder, arch, dtype, seed, pages=PAGES, context=CTX):
    """A random checkpoint of `arch`/`dtype` written to folder and prepared: (prepared, weights)."""
    dev, compiler = device
    weights = make_checkpoint(folder / "m.gguf", arch, split(dtype)[0], seed=seed)
    prepared = runtime.prepare(f"{arch}-{dtype}-{seed}", [SOURCE], str(folder / "m.gguf"),
                               options(dtype, pages, context), dev, compiler)
    return prepared, weights


@pytest.fixture(scope="module", params=["Q8_0", "Q8_0+int8"])
def qwen2_q8(device, tmp_path_factory, request):
    """Q8_0 weights with float activations, and with the int8_activations option."""
    prepared, weights = prepared_model(device, tmp_path_factory.mktemp("q"), "qwen2", request.param, 11)
    yield prepared, weights, request.param
    prepared.release()


def test_a_replayed_plan_binds_only_buffers_that_changed(device, tmp_path):
    """ExecPlan.run skips set_arg where the previous run bound the same buffer there (the
    server's steps reuse their input buffers): a replay with the same buffer objects and new
    contents binds nothing yet computes from the new contents, and other buffers are bound."""
    dev, _ = device
    prepared, weights = prepared_model(device, tmp_path, "llama", "F32", 5)
    try:
        rows = Rows(prepared, 3)
        box = {}
        prepared.plan_async("advance", {"T": 1, "R": 1}, lambda plan, error: box.update(plan=plan, error=error))
        plan = box["plan"]
        sizes = {"tokens": 4, "pos": 4, "row_of": 4, "last": 4, "pages": rows.tables.nbytes, "logits": 4 * V}

        def buffers():
            return {name: dev.pool.alloc(n, "test", "workspace") for name, n in sizes.items()}

        def step(bufs, row, token):
            for name, array in rows._pack([(row, [token])]).items():
                dev.upload(bufs[name], array)
            plan.run(bufs).wait()
            return dev.download(bufs["logits"], np.float32, V)

        first, second = buffers(), buffers()
        want = forward(weights, "llama", [9])
        got = step(first, 0, 9)
        bindings = plan.rebinds
        assert bindings > 0
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
        assert np.array_equal(step(second, 1, 9), got)            # new buffers: bound again
        assert plan.rebinds == 2 * bindings
        again = step(second, 2, 9)                                # same buffers, new row: nothing bound
        assert plan.rebinds == 2 * bindings and np.array_equal(again, got)
        want = forward(weights, "llama", [9, 4])
        got = step(second, 2, 4)                                  # and new contents are read
        assert plan.rebinds == 2 * bindings
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
        for buf in (*first.values(), *second.values()):
            buf.release()
    finally:
        prepared.release()


def test_long_prompt_in_chunks_crosses_pages(qwen2_q8):
    """257 tokens prefilled in chunks of 64 (more than one page and one chunk): same logits as numpy."""
    prepared, weights, case = qwen2_q8
    rows = Rows(prepared, 1)
    prompt = np.random.default_rng(3).integers(0, V, 257).tolist()
    for start in range(0, 257, 64):
        logits = rows.step([(0, prompt[start:start + 64])])
    want = forward(weights, "qwen2", prompt, act_q8=act_q8(case, [64, 64, 64, 64, 1]))
    assert np.abs(logits[0] - want).max() <= rel_tol(case) * np.abs(want).max()


def compare_greedy(got, want, gaps):
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            # A flip is only acceptable at an exact tie of the reference's top two logits.
            assert gaps[i] < 1e-4, f"token {i}: {a} != {b} with a logit gap of {gaps[i]}"
            return
    assert got == want


def test_greedy_generation_alone_and_batched(qwen2_q8):
    prepared, weights, case = qwen2_q8
    prompts = [[5, 17, 33, 2, 9, 60, 61], [90, 1, 1, 44], [3]]
    # With int8 activations the arithmetic is the same at every cohort size, so batching
    # changes no token either (against a reference that quantizes the same inputs).
    expected = [greedy_reference(weights, "qwen2", p, 32, case) for p in prompts]
    # Alone: one row at a time.
    rows = Rows(prepared, 3)
    for r, prompt in enumerate(prompts):
        got, nxt = [], int(rows.step([(r, prompt)])[0].argmax())
        for _ in range(32):
            got.append(nxt)
            nxt = int(rows.step([(r, [nxt])])[0].argmax())
        compare_greedy(got, *expected[r])
    # Batched: all rows in every step, prefill of one row beside decode of the others.
    rows = Rows(prepared, 3)
    first = rows.step([(0, prompts[0])])
    nxt = {0: int(first[0].argmax())}
    logits = rows.step([(0, [nxt[0]]), (1, prompts[1]), (2, prompts[2])])
    got = {0: [nxt[0]], 1: [], 2: []}
    nxt = {r: int(logits[i].argmax()) for i, r in enumerate((0, 1, 2))}
    for _ in range(32):
        for r in (0, 1, 2):
            got[r].append(nxt[r])
        logits = rows.step([(r, [nxt[r]]) for r in (0, 1, 2)])
        nxt = {r: int(logits[r].argmax()) for r in (0, 1, 2)}
    for r in (0, 1, 2):
        compare_greedy(got[r][:32], *expected[r])


# -- the sequence stage ----------------------------------------------------------------

SEQUENCE_CASES = [("llama", "Q4_0", "gguf"), ("qwen2", "Q8_0+int8", "gguf"), ("qwen3", "F16", "gguf"),
                  ("llama", "BF16", "safetensors")]


@pytest.fixture(scope="module")
def sequence_models(device, tmp_path_factory):
    """(arch, dtype, fmt) -> (prepared, weights), prepared once per case for the tests below."""
    dev, compiler = device
    models = {}

    def get(arch, dtype, fmt):
        if (arch, dtype, fmt) not in models:
            folder = tmp_path_factory.mktemp(f"seq-{arch}-{split(dtype)[0]}")
            path = folder / ("m.gguf" if fmt == "gguf" else "hf")
            weights = make_checkpoint(path, arch, split(dtype)[0], seed=sum(map(ord, "seq" + arch + dtype + fmt)),
                                      fmt=fmt)
            prepared = runtime.prepare(f"seq-{arch}-{dtype}-{fmt}", [SOURCE], str(path), options(dtype), dev,
                                       compiler)
            models[(arch, dtype, fmt)] = (prepared, weights)
        return models[(arch, dtype, fmt)]

    yield get
    for prepared, _ in models.values():
        prepared.release()


def halves(out):
    """encode's output bytes -> float32 [T, D] (llama: IEEE f16, row-major)."""
    assert out.shape[1] == 2 * D
    return out.view(np.float16).astype(np.float32)


@pytest.mark.parametrize("arch,dtype,fmt", SEQUENCE_CASES, ids=["-".join(c) for c in SEQUENCE_CASES])
def test_encode_matches_numpy(sequence_models, arch, dtype, fmt):
    """Every token's final normed hidden state, for prompts of 1 and 37 tokens (over two pages)."""
    prepared, weights = sequence_models(arch, dtype, fmt)
    assert prepared.spec("SEQUENCE_BYTES") == 2 * D
    rng = np.random.default_rng(2)
    for n in (1, 37):
        tokens = rng.integers(0, V, n).tolist()
        got = halves(Rows(prepared, 1).encode([(0, tokens)]))
        want = forward(weights, arch, tokens, fmt, hidden=True, act_q8=act_q8(dtype, [n]))
        assert got.shape == want.shape == (n, D)
        # f16 keeps 11 significant bits (relative rounding error <= 2^-11); the f32
        # forward pass itself agrees with float64 to ~1e-5 of the largest value.
        np.testing.assert_allclose(got, want, rtol=2 ** -10, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("arch,dtype,fmt", SEQUENCE_CASES[:3], ids=["-".join(c) for c in SEQUENCE_CASES[:3]])
def test_encode_in_chunks_and_mixed_rows_matches_one_shot(sequence_models, arch, dtype, fmt):
    """Chunks crossing page boundaries, and two rows in one launch, give the one-shot outputs."""
    prepared, _ = sequence_models(arch, dtype, fmt)
    rng = np.random.default_rng(4)
    a, b = rng.integers(0, V, 45).tolist(), rng.integers(0, V, 23).tolist()
    one_a = halves(Rows(prepared, 1).encode([(0, a)]))
    one_b = halves(Rows(prepared, 1).encode([(0, b)]))
    # Cohorts of different sizes take different matmul geometries (summation orders):
    # a few halves may land one f16 step apart; equal geometries give equal bytes.
    tolerance = dict(rtol=2 ** -10, atol=1e-5 * np.abs(one_a).max())
    # One row in chunks of 7, 13 and 25 tokens: the second and third cross pages 0|1 and 1|2.
    rows = Rows(prepared, 1)
    chunks = [halves(rows.encode([(0, a[i:j])])) for i, j in ((0, 7), (7, 20), (20, 45))]
    np.testing.assert_allclose(np.concatenate(chunks), one_a, **tolerance)
    # Two rows mixed: both prefill a first chunk, then both finish in one launch.
    rows = Rows(prepared, 2)
    first = halves(rows.encode([(0, a[:10]), (1, b[:18])]))
    second = halves(rows.encode([(1, b[18:]), (0, a[10:])]))
    np.testing.assert_allclose(np.concatenate([first[:10], second[5:]]), one_a, **tolerance)
    np.testing.assert_allclose(np.concatenate([first[10:], second[:5]]), one_b, **tolerance)


@pytest.mark.parametrize("arch,dtype,fmt", SEQUENCE_CASES, ids=["-".join(c) for c in SEQUENCE_CASES])
def test_encode_writes_the_kv_cache_advance_continues(sequence_models, arch, dtype, fmt):
    """encode tokens[:n], then advance tokens[n:] on the same pages: the last token's
    logits equal advancing the whole prompt at once (and numpy)."""
    prepared, weights = sequence_models(arch, dtype, fmt)
    tokens = np.random.default_rng(5).integers(0, V, 41).tolist()
    whole = Rows(prepared, 1).step([(0, tokens)])[0]
    want = forward(weights, arch, tokens, fmt, act_q8=act_q8(dtype, [41]))
    assert np.abs(whole - want).max() <= rel_tol(dtype) * np.abs(want).max()
    for n in (1, 16, 29, 40):        # page-aligned and not; the continuation is a prefill chunk or one token
        rows = Rows(prepared, 1)
        rows.encode([(0, tokens[:n])])
        logits = rows.step([(0, tokens[n:])])[0]
        steps = act_q8(dtype, [n, 41 - n])
        # The whole prompt's arithmetic unless a step quantizes where the prompt did not (ACT_Q8
        # at every step; int8 dot tiles, DOT8, take every step, one token too).
        if not steps[0].any():
            assert np.abs(logits - whole).max() <= 1e-5 * np.abs(whole).max(), (n, np.abs(logits - whole).max())
        want_n = forward(weights, arch, tokens, fmt, act_q8=steps)
        assert np.abs(logits - want_n).max() <= rel_tol(dtype) * np.abs(want_n).max(), n


def test_features_at_positions_equal_the_tokens_they_replace(device, tmp_path):
    """advance_media, the image component's way in: rows of features placed at some positions
    (their token ids out of the vocabulary, as image positions are) give the same logits and
    KV cache as advance on the tokens whose embeddings those rows are, bit for bit."""
    prepared, weights = prepared_model(device, tmp_path, "llama", "F32", 5)
    try:
        tokens = [3, 17, 9, 41, 5, 28, 11]
        media = [1, 2, 3, 5]                                # positions fed as features
        want = Rows(prepared, 1).step([(0, tokens)])[0]
        rows = Rows(prepared, 1)
        host = rows._pack([(0, [V + 7 if i in media else t for i, t in enumerate(tokens)])])
        host["features"] = np.ascontiguousarray(weights["token_embd.weight"][[tokens[i] for i in media]], np.float32)
        host["feature_at"] = np.array([media.index(i) if i in media else -1 for i in range(len(tokens))], np.int32)
        got = rows._run("advance_media", {"T": len(tokens), "R": 1}, host, "logits", 4 * V).view(np.float32)
        np.testing.assert_array_equal(got, want)
        assert np.abs(got).max() > 0
        # Without the features those positions would be zeros: the logits differ.
        host["feature_at"][:] = -1
        rows = Rows(prepared, 1)
        blank = rows._run("advance_media", {"T": len(tokens), "R": 1}, host, "logits", 4 * V).view(np.float32)
        assert not np.array_equal(blank, want)
    finally:
        prepared.release()
