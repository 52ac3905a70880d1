"""The numpy Stable Diffusion reference (tests/sd_numpy.py) and the tiny model generator
(models/sd/generate.py) checked on their own, independent of Loom.

Generator: byte-identical output for a seed, other seeds differ, every config value agrees
with the tensors' shapes, the reference reads every tensor. Blocks: GroupNorm, conv2d,
attention, the timestep embedding, a ResnetBlock2D, a BasicTransformerBlock, a
Transformer2DModel, the CLIP text encoder and a VAE decoder block against slower explicit
formulations written here (loops per group, per head, per pixel). Scheduler: Euler
timesteps and sigmas against their closed forms. LoRA: kohya and PEFT layouts parse to the
same deltas, scale 0 is the base model. Pipeline: 256x256 images are finite,
deterministic for a seed, different for another seed, and not constant.
"""
import importlib.util
import json
import math
import os
import struct
import sys
from fractions import Fraction

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd_numpy as sd  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("sd_generate", os.path.join(ROOT, "models", "sd", "generate.py"))
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)
f32 = np.float32


def files(folder):
    out = {}
    for base, _, names in os.walk(folder):
        for n in names:
            path = os.path.join(base, n)
            out[os.path.relpath(path, folder)] = open(path, "rb").read()
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("sd") / "illustrator")
    gen.generate_default(d)
    return d


@pytest.fixture(scope="module")
def W(model_dir):
    return sd.load(model_dir)


@pytest.fixture(scope="module")
def adapters(W, model_dir):
    return {n: sd.read_lora(W, os.path.join(model_dir, "loras", f"{n}.safetensors")) for n in ("watercolor", "ink")}


def noise(seed, shape=(4, 32, 32)):
    return np.random.default_rng(seed).standard_normal(shape).astype(f32)


@pytest.fixture(scope="module")
def base_image(W):
    return sd.generate(W, sd.tokenize(W, "a red fox in the snow"), sd.tokenize(W, ""), noise(0), 2, 7.5)


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(f32)


# --- Generator ------------------------------------------------------------------

def test_generator_is_deterministic(tmp_path, model_dir):
    gen.generate_default(str(tmp_path / "again"))
    first, again = files(model_dir), files(str(tmp_path / "again"))
    assert sorted(first) == sorted(again) and len(first) == 14
    assert all(first[k] == again[k] for k in first), "the same seed must write the same bytes"
    gen.generate_default(str(tmp_path / "other"), seed=1)
    other = files(str(tmp_path / "other"))
    for name in first:
        if name.endswith(".safetensors"):
            assert other[name] != first[name], name
        else:
            assert other[name] == first[name], name            # configs and tokenizer do not depend on the seed


def test_safetensors_as_written(model_dir):
    for rel in ("unet/diffusion_pytorch_model.safetensors", "loras/watercolor.safetensors"):
        data = open(os.path.join(model_dir, rel), "rb").read()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        meta = header.pop("__metadata__")
        assert n % 8 == 0 and list(header) == sorted(header)
        ends = [0] + [header[k]["data_offsets"][1] for k in sorted(header)]
        assert all(header[k]["data_offsets"][0] == ends[i] for i, k in enumerate(sorted(header)))
        assert ends[-1] == len(data) - 8 - n and all(v["dtype"] == "F32" for v in header.values())
        assert meta.get("format") == "pt" or meta.get("ss_network_module") == "networks.lora"
    with pytest.raises(ValueError):
        gen.generate_lora(os.path.join(model_dir, "x.safetensors"), "x", 0, "lycoris")


def test_configs_agree_with_shapes(W, model_dir):
    t, u, v, c = W["t"], W["unet"], W["vae"], W["text_encoder"]
    ch, lpb = u["block_out_channels"], u["layers_per_block"]
    assert t["unet.conv_in.weight"].shape == (ch[0], u["in_channels"], 3, 3)
    assert t["unet.time_embedding.linear_1.weight"].shape == (4 * ch[0], ch[0])
    assert t["unet.conv_out.weight"].shape == (u["out_channels"], ch[0], 3, 3)
    assert len(u["down_block_types"]) == len(u["up_block_types"]) == len(ch)
    for i, kind in enumerate(u["down_block_types"]):
        assert t[f"unet.down_blocks.{i}.resnets.0.conv1.weight"].shape[0] == ch[i]
        assert f"unet.down_blocks.{i}.resnets.{lpb}.norm1.weight" not in t
        assert (f"unet.down_blocks.{i}.attentions.0.norm.weight" in t) == (kind == "CrossAttnDownBlock2D")
        assert (f"unet.down_blocks.{i}.downsamplers.0.conv.weight" in t) == (i < len(ch) - 1)
    for i, kind in enumerate(u["up_block_types"]):
        assert f"unet.up_blocks.{i}.resnets.{lpb}.norm1.weight" in t
        assert f"unet.up_blocks.{i}.resnets.{lpb + 1}.norm1.weight" not in t
        assert (f"unet.up_blocks.{i}.attentions.0.norm.weight" in t) == (kind == "CrossAttnUpBlock2D")
        assert (f"unet.up_blocks.{i}.upsamplers.0.conv.weight" in t) == (i < len(ch) - 1)
    heads = u["attention_head_dim"]
    for name, a in t.items():
        if name.endswith("attn2.to_k.weight"):
            assert a.shape[1] == u["cross_attention_dim"] == c["hidden_size"]
        if name.endswith(".to_q.weight") and name.startswith("unet."):
            assert a.shape[0] % heads == 0
        if name.endswith((".norm1.weight", ".norm2.weight", ".norm.weight", "conv_norm_out.weight",
                          "group_norm.weight")) and "transformer_blocks" not in name:
            groups = (u if name.startswith("unet.") else v)["norm_num_groups"]
            assert a.shape[0] % groups == 0, name
    assert u["sample_size"] * 2 ** (len(v["block_out_channels"]) - 1) == v["sample_size"] == 256
    assert u["in_channels"] == u["out_channels"] == v["latent_channels"]
    assert t["vae.post_quant_conv.weight"].shape == (v["latent_channels"],) * 2 + (1, 1)
    assert t["vae.decoder.conv_in.weight"].shape == (v["block_out_channels"][-1], v["latent_channels"], 3, 3)
    assert t["vae.decoder.conv_out.weight"].shape == (v["out_channels"], v["block_out_channels"][0], 3, 3)
    for i in range(len(v["up_block_types"])):
        assert f"vae.decoder.up_blocks.{i}.resnets.{v['layers_per_block']}.conv1.weight" in t
        assert (f"vae.decoder.up_blocks.{i}.upsamplers.0.conv.weight" in t) == (i < 3)
    p = "text_encoder.text_model."
    assert t[p + "embeddings.token_embedding.weight"].shape == (c["vocab_size"], c["hidden_size"])
    assert t[p + "embeddings.position_embedding.weight"].shape == (c["max_position_embeddings"], c["hidden_size"])
    assert t[p + f"encoder.layers.{c['num_hidden_layers'] - 1}.mlp.fc1.weight"].shape == (c["intermediate_size"],
                                                                                          c["hidden_size"])
    assert p + f"encoder.layers.{c['num_hidden_layers']}.mlp.fc1.weight" not in t
    assert c["hidden_size"] % c["num_attention_heads"] == 0
    vocab = W["tokenizer"]["vocab"]
    assert len(vocab) == c["vocab_size"] and vocab["<|endoftext|>"] == c["eos_token_id"] == c["pad_token_id"]
    assert vocab["<|startoftext|>"] == c["bos_token_id"]
    s = W["scheduler"]
    assert (s["beta_start"], s["beta_end"], s["beta_schedule"], s["num_train_timesteps"]) == \
        (0.00085, 0.012, "scaled_linear", 1000)
    index = json.load(open(os.path.join(model_dir, "model_index.json")))
    assert all(os.path.isdir(os.path.join(model_dir, k)) for k, v in index.items() if isinstance(v, list) and v[0])


class Recording(dict):
    def __init__(self, *a):
        super().__init__(*a)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


def test_reference_reads_every_tensor(W):
    t = Recording(W["t"])
    Wr = dict(W, t=t)
    ctx = sd.text_encoder(Wr, sd.tokenize(W, "a fox"))
    assert sd.unet(Wr, noise(1, (4, 8, 12)), 500.0, ctx).shape == (4, 8, 12)     # non-square latents
    assert sd.vae_decode(Wr, noise(2, (4, 4, 6))).shape == (3, 32, 48)
    assert t.read == set(W["t"]), sorted(set(W["t"]) - t.read)[:5]


def test_parameter_count(W):
    counts = {c: sum(a.size for k, a in W["t"].items() if k.startswith(c + ".")) for c in ("text_encoder", "unet", "vae")}
    assert 500_000 < sum(counts.values()) < 2_000_000, counts


# --- Tokenizer ------------------------------------------------------------------

def test_tokenizer_is_clip_format(W, model_dir):
    tok = W["tokenizer"]
    vocab, inv = tok["vocab"], {i: s for s, i in tok["vocab"].items()}
    assert open(os.path.join(model_dir, "tokenizer", "merges.txt")).readline() == "#version: 0.2\n"
    assert inv[0] == "!" and inv[256] == "!</w>" and inv[len(vocab) - 1] == "<|endoftext|>"
    assert all(inv[i].endswith("</w>") for i in range(256, 512)) and len(tok["ranks"]) == gen.N_MERGES
    bos, eos = tok["bos"], tok["eos"]
    assert sd.tokenize(W, "") == [bos, eos] + [eos] * 75
    ids = sd.tokenize(W, "A  Red fox")
    assert ids == sd.tokenize(W, "a red FOX")                  # lowercased, whitespace collapsed
    words = [inv[i] for i in ids[1:ids.index(eos)]]
    assert "".join(words).replace("</w>", " ").split() == ["a", "red", "fox"]
    for text in ("Ünïcode ✓ 東京 tab\tnew\nline 12,5%", "x" * 300):
        ids = sd.tokenize(W, text)
        assert len(ids) == 77 and ids[0] == bos and eos in ids and all(0 <= i < len(vocab) for i in ids)
    assert sd.tokenize(W, "x" * 300)[-1] == eos and sd.tokenize(W, "x" * 300)[-2] != eos


def test_bpe_matches_tokenizers(W):
    models = pytest.importorskip("tokenizers.models")
    tok = W["tokenizer"]
    merges = sorted(tok["ranks"], key=tok["ranks"].get)
    ref = models.BPE(tok["vocab"], merges, end_of_word_suffix="</w>")
    byte_map = sd.bytes_to_unicode()
    for word in ("painting", "watercolor", "snow", "astronauts", "a", "zzz", "castle", "sunset", "é", "ink"):
        mapped = "".join(byte_map[b] for b in word.encode())
        assert sd.bpe(mapped, tok["ranks"]) == [t.value for t in ref.tokenize(mapped)], word


# --- Slow explicit formulations ---------------------------------------------------

def slow_group_norm(x, gamma, beta, groups, eps):
    c = x.shape[0]
    per = c // groups
    out = np.zeros(x.shape, np.float64)
    for g in range(groups):
        vals = [float(v) for v in x[g * per:(g + 1) * per].ravel()]
        mu = sum(vals) / len(vals)
        var = sum((v - mu) ** 2 for v in vals) / len(vals)
        for ch in range(g * per, (g + 1) * per):
            out[ch] = (x[ch] - mu) / math.sqrt(var + eps) * gamma[ch] + beta[ch]
    return out


def slow_conv(x, w, b, stride=1, pad=1):
    c, h, wd = x.shape
    o, _, k, _ = w.shape
    ho, wo = (h + 2 * pad - k) // stride + 1, (wd + 2 * pad - k) // stride + 1
    out = np.zeros((o, ho, wo))
    for oc in range(o):
        for i in range(ho):
            for j in range(wo):
                acc = float(b[oc])
                for ic in range(c):
                    for ky in range(k):
                        for kx in range(k):
                            y, xx = i * stride + ky - pad, j * stride + kx - pad
                            if 0 <= y < h and 0 <= xx < wd:
                                acc += float(w[oc, ic, ky, kx]) * float(x[ic, y, xx])
                out[oc, i, j] = acc
    return out


def slow_attention(q, k, v, heads, causal=False):
    n, d = q.shape
    hd = d // heads
    out = np.zeros((n, d))
    for h in range(heads):
        cols = slice(h * hd, (h + 1) * hd)
        for i in range(n):
            keys = range(i + 1) if causal else range(len(k))
            scores = [float(np.dot(q[i, cols].astype(np.float64), k[j, cols])) / math.sqrt(hd) for j in keys]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            out[i, cols] = sum(wt / total * v[j, cols].astype(np.float64) for wt, j in zip(weights, keys))
    return out


def slow_layer_norm(x, gamma, beta, eps=1e-5):
    out = np.zeros(x.shape)
    for i, row in enumerate(x.astype(np.float64)):
        mu = row.mean()
        out[i] = (row - mu) / math.sqrt(((row - mu) ** 2).mean() + eps) * gamma + beta
    return out


def slow_linear(x, w, b=None):
    w = w.reshape(len(w), -1)
    out = np.array([[float(np.dot(row.astype(np.float64), w[o])) for o in range(len(w))] for row in x])
    return out if b is None else out + b


def slow_gelu(x):
    return np.vectorize(lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2))))(x.astype(np.float64))


def slow_silu(x):
    return np.vectorize(lambda v: v / (1 + math.exp(-v)))(x.astype(np.float64))


def norm_params(rng, t, name, c):
    t[f"{name}.weight"] = (1 + rand(rng, c, scale=0.2)).astype(f32)
    t[f"{name}.bias"] = rand(rng, c, scale=0.1)


def dense_params(rng, t, name, out, inp, kernel=None, bias=True):
    shape = (out, inp) if kernel is None else (out, inp, kernel, kernel)
    t[f"{name}.weight"] = rand(rng, *shape, scale=1 / math.sqrt(np.prod(shape[1:])))
    if bias:
        t[f"{name}.bias"] = rand(rng, out, scale=0.1)


def resnet_params(rng, t, p, cin, cout, temb=None):
    norm_params(rng, t, p + ".norm1", cin)
    dense_params(rng, t, p + ".conv1", cout, cin, 3)
    if temb:
        dense_params(rng, t, p + ".time_emb_proj", cout, temb)
    norm_params(rng, t, p + ".norm2", cout)
    dense_params(rng, t, p + ".conv2", cout, cout, 3)
    if cin != cout:
        dense_params(rng, t, p + ".conv_shortcut", cout, cin, 1)


def slow_resnet(x, t, p, groups, eps, temb=None):
    h = slow_conv(slow_silu(slow_group_norm(x, t[p + ".norm1.weight"], t[p + ".norm1.bias"], groups, eps)),
                  t[p + ".conv1.weight"], t[p + ".conv1.bias"])
    if temb is not None:
        h = h + slow_linear(slow_silu(temb)[None], t[p + ".time_emb_proj.weight"], t[p + ".time_emb_proj.bias"])[0][:, None, None]
    h = slow_conv(slow_silu(slow_group_norm(h, t[p + ".norm2.weight"], t[p + ".norm2.bias"], groups, eps)),
                  t[p + ".conv2.weight"], t[p + ".conv2.bias"])
    if p + ".conv_shortcut.weight" in t:
        x = slow_conv(x, t[p + ".conv_shortcut.weight"], t[p + ".conv_shortcut.bias"], pad=0)
    return x + h


def close(a, b, tol=2e-5):
    b = np.asarray(b, np.float64)
    err = np.abs(np.asarray(a, np.float64) - b).max()
    assert err <= tol * max(1.0, np.abs(b).max()), err


# --- Blocks -----------------------------------------------------------------------

@pytest.mark.parametrize("groups", [1, 4, 8])
def test_group_norm_per_group(groups):
    rng = np.random.default_rng(groups)
    x, t = rand(rng, 8, 5, 6, scale=3.0) + 1.5, {}
    norm_params(rng, t, "n", 8)
    close(sd.group_norm(x, t, "n", groups, 1e-5), slow_group_norm(x, t["n.weight"], t["n.bias"], groups, 1e-5))


@pytest.mark.parametrize("kernel,stride,pad", [(3, 1, 1), (3, 2, 1), (1, 1, 0)])
def test_conv2d_explicit_loops(kernel, stride, pad):
    rng = np.random.default_rng(kernel + stride)
    x, t = rand(rng, 3, 5, 6), {}
    dense_params(rng, t, "c", 4, 3, kernel)
    close(sd.conv2d(x, t, "c", stride, pad), slow_conv(x, t["c.weight"], t["c.bias"], stride, pad))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_per_head(causal):
    rng = np.random.default_rng(3)
    q = rand(rng, 6, 8)
    k, v = (q, rand(rng, 6, 8)) if causal else (rand(rng, 7, 8), rand(rng, 7, 8))
    mask = np.triu(np.full((6, 6), -np.inf, f32), 1) if causal else None
    close(sd.attention(q, k, v, 2, mask), slow_attention(q, k, v, 2, causal))


@pytest.mark.parametrize("dim,flip,shift", [(32, True, 0), (320, True, 0), (33, True, 0), (16, False, 1)])
def test_timestep_embedding_formula(dim, flip, shift):
    half = dim // 2
    for ts in (0.0, 1.0, 249.0, 499.5, 999.0):
        freq = [math.exp(-math.log(10000) * j / (half - shift)) for j in range(half)]
        sin, cos = [math.sin(ts * f) for f in freq], [math.cos(ts * f) for f in freq]
        want = (cos + sin if flip else sin + cos) + [0.0] * (dim % 2)
        got = sd.timestep_embedding(ts, dim, flip, shift)
        assert got.shape == (dim,) and got.dtype == f32
        close(got, want, 2e-4)                 # float32 arguments up to 999 radians, as diffusers computes them


def test_activations():
    x = np.linspace(-6, 6, 241).astype(f32)
    close(sd.gelu(x), slow_gelu(x), 1e-6)
    close(sd.silu(x), slow_silu(x), 1e-6)
    close(sd.quick_gelu(x), [v / (1 + math.exp(-1.702 * v)) for v in x.astype(np.float64)], 1e-6)


@pytest.mark.parametrize("cin,cout,temb", [(4, 6, 5), (4, 4, None)])
def test_resnet_block(cin, cout, temb):
    rng = np.random.default_rng(cin + cout)
    t = {}
    resnet_params(rng, t, "r", cin, cout, temb)
    x, e = rand(rng, cin, 4, 5), (rand(rng, temb) if temb else None)
    close(sd.resnet_block(x, t, "r", 2, 1e-5, e), slow_resnet(x, t, "r", 2, 1e-5, e), 5e-5)


def transformer_params(rng, t, p, c, ctx, kernel=1):
    norm_params(rng, t, p + ".norm", c)
    dense_params(rng, t, p + ".proj_in", c, c, kernel)
    b = p + ".transformer_blocks.0"
    for i, (attn, kv) in enumerate((("attn1", c), ("attn2", ctx))):
        norm_params(rng, t, f"{b}.norm{i + 1}", c)
        for proj, fan in (("to_q", c), ("to_k", kv), ("to_v", kv)):
            dense_params(rng, t, f"{b}.{attn}.{proj}", c, fan, bias=False)
        dense_params(rng, t, f"{b}.{attn}.to_out.0", c, c)
    norm_params(rng, t, b + ".norm3", c)
    dense_params(rng, t, b + ".ff.net.0.proj", 8 * c, c)
    dense_params(rng, t, b + ".ff.net.2", c, 4 * c)
    dense_params(rng, t, p + ".proj_out", c, c, kernel)


def slow_attention_block(x, t, p, heads, context=None):
    kv = x if context is None else context
    q, k, v = (slow_linear(a, t[f"{p}.{n}.weight"]) for a, n in ((x, "to_q"), (kv, "to_k"), (kv, "to_v")))
    return slow_linear(slow_attention(q, k, v, heads), t[f"{p}.to_out.0.weight"], t[f"{p}.to_out.0.bias"])


def slow_transformer_block(x, t, p, heads, context):
    ln = [slow_layer_norm] * 3
    x = x + slow_attention_block(ln[0](x, t[p + ".norm1.weight"], t[p + ".norm1.bias"]), t, p + ".attn1", heads)
    x = x + slow_attention_block(ln[1](x, t[p + ".norm2.weight"], t[p + ".norm2.bias"]), t, p + ".attn2", heads,
                                 context)
    h = slow_linear(ln[2](x, t[p + ".norm3.weight"], t[p + ".norm3.bias"]), t[p + ".ff.net.0.proj.weight"],
                    t[p + ".ff.net.0.proj.bias"])
    inner = h.shape[1] // 2
    geglu = h[:, :inner] * slow_gelu(h[:, inner:])           # the first half is the value, the second the gate
    return x + slow_linear(geglu, t[p + ".ff.net.2.weight"], t[p + ".ff.net.2.bias"])


def test_transformer_block():
    rng = np.random.default_rng(7)
    t = {}
    transformer_params(rng, t, "s", 8, 6)
    x, ctx = rand(rng, 5, 8), rand(rng, 3, 6)
    b = "s.transformer_blocks.0"
    close(sd.transformer_block(x, t, b, 2, ctx), slow_transformer_block(x, t, b, 2, ctx), 5e-5)


def test_spatial_transformer_conv_and_linear_projections():
    rng = np.random.default_rng(8)
    t = {}
    transformer_params(rng, t, "s", 8, 6)
    x, ctx = rand(rng, 8, 3, 2), rand(rng, 4, 6)
    h = slow_group_norm(x, t["s.norm.weight"], t["s.norm.bias"], 4, 1e-6).reshape(8, -1).T     # pixels row-major
    h = slow_linear(h, t["s.proj_in.weight"], t["s.proj_in.bias"])
    h = slow_transformer_block(h, t, "s.transformer_blocks.0", 2, ctx)
    want = slow_linear(h, t["s.proj_out.weight"], t["s.proj_out.bias"]).T.reshape(8, 3, 2) + x
    close(sd.spatial_transformer(x, t, "s", 2, ctx, 4), want, 5e-5)
    flat = {k: (v.reshape(v.shape[:2]) if v.ndim == 4 else v) for k, v in t.items()}   # SD 2's Linear proj_in/out
    close(sd.spatial_transformer(x, flat, "s", 2, ctx, 4), want, 5e-5)


def test_text_encoder_per_position(W):
    t, cfg = W["t"], W["text_encoder"]
    p = "text_encoder.text_model."
    ids = sd.tokenize(W, "an ink painting of a castle")
    x = (t[p + "embeddings.token_embedding.weight"][ids] + t[p + "embeddings.position_embedding.weight"]).astype(np.float64)
    heads = cfg["num_attention_heads"]
    for i in range(cfg["num_hidden_layers"]):
        q = f"{p}encoder.layers.{i}."
        h = slow_layer_norm(x, t[q + "layer_norm1.weight"], t[q + "layer_norm1.bias"])
        qkv = [slow_linear(h, t[f"{q}self_attn.{n}_proj.weight"], t[f"{q}self_attn.{n}_proj.bias"]) for n in "qkv"]
        att = slow_attention(*qkv, heads, causal=True)          # position i sees positions 0..i only
        x = x + slow_linear(att, t[q + "self_attn.out_proj.weight"], t[q + "self_attn.out_proj.bias"])
        h = slow_layer_norm(x, t[q + "layer_norm2.weight"], t[q + "layer_norm2.bias"])
        h = slow_linear(h, t[q + "mlp.fc1.weight"], t[q + "mlp.fc1.bias"])
        h = h / (1 + np.exp(-1.702 * h))
        x = x + slow_linear(h, t[q + "mlp.fc2.weight"], t[q + "mlp.fc2.bias"])
    want = slow_layer_norm(x, t[p + "final_layer_norm.weight"], t[p + "final_layer_norm.bias"])
    got = sd.text_encoder(W, ids)
    close(got, want, 5e-5)
    prefix = sd.text_encoder(W, ids[:9])                         # causal: a prefix is unaffected by what follows
    close(prefix, got[:9], 1e-5)


def test_vae_decoder_block_and_attention():
    rng = np.random.default_rng(9)
    t = {}
    for j, cin in enumerate((6, 4)):
        resnet_params(rng, t, f"u.resnets.{j}", cin, 4)
    dense_params(rng, t, "u.upsamplers.0.conv", 4, 4, 3)
    x = rand(rng, 6, 3, 2)
    h = slow_resnet(slow_resnet(x, t, "u.resnets.0", 2, 1e-6), t, "u.resnets.1", 2, 1e-6)
    up = np.zeros((4, 6, 4))
    for c in range(4):
        for i in range(6):
            for j in range(4):
                up[c, i, j] = h[c, i // 2, j // 2]                   # nearest neighbour
    want = slow_conv(up, t["u.upsamplers.0.conv.weight"], t["u.upsamplers.0.conv.bias"])
    close(sd.vae_decoder_block(x, t, "u", 2, 2), want, 5e-5)

    norm_params(rng, t, "a.group_norm", 4)
    for proj in ("to_q", "to_k", "to_v", "to_out.0"):
        dense_params(rng, t, f"a.{proj}", 4, 4)
    x = rand(rng, 4, 3, 3)
    g = slow_group_norm(x, t["a.group_norm.weight"], t["a.group_norm.bias"], 2, 1e-6)
    pixels = [g[:, i, j] for i in range(3) for j in range(3)]    # one token per pixel, one head
    q, k, v = (slow_linear(pixels, t[f"a.{n}.weight"], t[f"a.{n}.bias"]) for n in ("to_q", "to_k", "to_v"))
    out = slow_linear(slow_attention(q, k, v, 1), t["a.to_out.0.weight"], t["a.to_out.0.bias"])
    close(sd.vae_attention(x, t, "a", 2), out.T.reshape(4, 3, 3) + x, 5e-5)


def test_downsample_upsample():
    rng = np.random.default_rng(10)
    t = {}
    dense_params(rng, t, "d.conv", 3, 3, 3)
    x = rand(rng, 3, 6, 5)
    assert sd.downsample(x, t, "d").shape == (3, 3, 3)
    close(sd.downsample(x, t, "d"), slow_conv(x, t["d.conv.weight"], t["d.conv.bias"], 2, 1))
    up = sd.upsample(x, t, "d")
    assert up.shape == (3, 12, 10)
    near = np.array([[[x[c, i // 2, j // 2] for j in range(10)] for i in range(12)] for c in range(3)])
    close(up, slow_conv(near, t["d.conv.weight"], t["d.conv.bias"]))


def test_vae_legacy_attention_names():
    assert sd.legacy_name("decoder.mid_block.attentions.0.query.weight") == "decoder.mid_block.attentions.0.to_q.weight"
    assert sd.legacy_name("decoder.mid_block.attentions.0.proj_attn.bias") == \
        "decoder.mid_block.attentions.0.to_out.0.bias"
    assert sd.legacy_name("decoder.up_blocks.0.resnets.0.conv1.weight") == "decoder.up_blocks.0.resnets.0.conv1.weight"


# --- Scheduler --------------------------------------------------------------------

def closed_form_sigma(ts):
    b0, b1 = math.sqrt(0.00085), math.sqrt(0.012)
    ac, out = 1.0, []
    for s in range(1000):
        ac *= 1 - (b0 + (b1 - b0) * s / 999) ** 2
        out.append(math.sqrt((1 - ac) / ac))
    lo = [int(math.floor(t)) for t in ts]
    return [out[i] + (t - i) * (out[min(i + 1, 999)] - out[i]) for t, i in zip(ts, lo)]


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 7, 10, 16, 25, 50])
def test_trailing_timesteps_and_sigmas(steps):
    ts, sigmas = sd.scheduler_timesteps(steps)
    want = [round(Fraction(1000 * (steps - i), steps)) - 1 for i in range(steps)]    # round half to even
    assert ts.tolist() == want and ts.dtype == sigmas.dtype == f32
    assert sigmas.shape == (steps + 1,) and sigmas[-1] == 0.0
    close(sigmas[:-1], closed_form_sigma(want), 1e-4)
    assert abs(sigmas[0] - 14.6146) < 1e-3                       # SD's sigma at t = 999
    assert sd.init_noise_sigma(sigmas) == sigmas[0]
    assert {2: [999, 499], 4: [999, 749, 499, 249], 3: [999, 666, 332]}.get(steps, want) == want


def test_leading_and_linspace_spacing():
    cfg = dict(gen.SCHEDULER_CONFIG)
    ts, sigmas = sd.scheduler_timesteps(4, cfg, "leading")
    assert ts.tolist() == [751, 501, 251, 1]                     # steps_offset 1, as SD 1.5's own config
    close(sigmas[:-1], closed_form_sigma(ts.tolist()), 1e-4)
    assert abs(sd.init_noise_sigma(sigmas, "leading") - math.sqrt(float(sigmas[0]) ** 2 + 1)) < 1e-5
    ts, sigmas = sd.scheduler_timesteps(4, cfg, "linspace")
    close(ts, [999, 666, 333, 0], 1e-6)
    close(sigmas[:-1], closed_form_sigma([999, 666, 333, 0]), 1e-4)
    ts, sigmas = sd.scheduler_timesteps(3, cfg, "linspace")      # fractional timesteps interpolate sigma linearly
    close(ts, [999, 499.5, 0], 1e-6)
    close(sigmas[:-1], closed_form_sigma([999, 499.5, 0]), 1e-4)


def test_euler_steps_follow_the_true_noise():
    rng = np.random.default_rng(11)
    x0, eps = rand(rng, 4, 3, 3), rand(rng, 4, 3, 3)
    ts, sigmas = sd.scheduler_timesteps(4)
    x = x0 + sigmas[0] * eps
    for i in range(4):
        x = sd.euler_step(x, eps, sigmas[i], sigmas[i + 1])
        close(x, x0 + float(sigmas[i + 1]) * eps, 1e-5)          # exact for the probability-flow ODE of a point
    close(sd.scale_model_input(x0, 3.0), x0 / math.sqrt(10.0), 1e-6)


# --- LoRA -------------------------------------------------------------------------

def test_generated_adapters(W, adapters):
    wc, ink = adapters["watercolor"], adapters["ink"]
    assert len(wc) == 40 and len(ink) == 32
    assert {n.split(".")[0] for n in wc} == {"unet", "text_encoder"} and {n.split(".")[0] for n in ink} == {"unet"}
    assert all(".attn1." in n or ".attn2." in n or ".self_attn." in n for n in [*wc, *ink])
    assert {p["alpha"] for p in wc.values()} == {2.0} and {p["alpha"] for p in ink.values()} == {8.0}
    for adapter in (wc, ink):
        for name, p in adapter.items():
            assert len(p["down"]) == 4 and sd.apply_lora(name, 1.0, adapter).shape == W["t"][name].shape
    assert sd.apply_lora("unet.conv_in.weight", 1.0, wc) is None


def test_kohya_and_peft_layouts_parse_alike(W, tmp_path):
    factors = gen.lora_factors(5, text_encoder=True)
    kohya, _ = gen.kohya_tensors(factors, alpha=3.0)
    peft, meta = gen.peft_tensors(factors, alpha=3.0)
    gen.write_safetensors(str(tmp_path / "peft.safetensors"), peft, meta)     # alpha lives in the metadata
    a, b = sd.read_lora(W, kohya), sd.read_lora(W, str(tmp_path / "peft.safetensors"))
    assert sorted(a) == sorted(b) and len(a) == len(factors)
    for name in a:
        assert a[name]["alpha"] == b[name]["alpha"] == 3.0
        np.testing.assert_array_equal(sd.apply_lora(name, 0.7, a), sd.apply_lora(name, 0.7, b))
    # diffusers' older attention-processor and lora.down/up spellings, without an alpha: alpha = rank
    unet_only = {k: v for k, v in factors.items() if k[0] == "unet"}
    old = {}
    for (_, mod), (down, up) in unet_only.items():
        parent, leaf = mod.rsplit(".", 1) if not mod.endswith("to_out.0") else (mod[:-9], "to_out")
        old[f"{parent}.processor.{leaf}_lora.down.weight"], old[f"{parent}.processor.{leaf}_lora.up.weight"] = down, up
    spelled = {f"unet.{mod}.lora.{side}.weight": f for (_, mod), pair in unet_only.items()
               for side, f in zip(("down", "up"), pair)}
    raw = {k.replace("unet.", "base_model.model.", 1): v for k, v in gen.peft_tensors(unet_only, 4.0)[0].items()}
    k4 = sd.read_lora(W, gen.kohya_tensors(unet_only, alpha=4.0)[0])
    for other in (sd.read_lora(W, old), sd.read_lora(W, spelled), sd.read_lora(W, raw)):
        assert sorted(other) == sorted(k4)
        for name in k4:
            np.testing.assert_array_equal(sd.apply_lora(name, 1.0, other), sd.apply_lora(name, 1.0, k4))


def test_apply_lora_is_a_separate_low_rank_term(W, adapters):
    ink = adapters["ink"]
    name = next(iter(ink))
    p = ink[name]
    want = -0.6 * (p["alpha"] / 4) * np.einsum("or,ri->oi", p["up"].astype(np.float64), p["down"])
    close(sd.apply_lora(name, -0.6, ink), want, 1e-6)
    assert not sd.apply_lora(name, 0.0, ink).any()
    before = {k: v.copy() for k, v in W["t"].items()}
    view = sd.with_loras(W, [(ink, 0.5), (adapters["watercolor"], 1.5)])
    assert all(np.array_equal(W["t"][k], before[k]) for k in before), "the stored weights are never changed"
    x = rand(np.random.default_rng(12), 5, W["t"][name].shape[1])
    low_rank = x @ W["t"][name].T
    for adapter, scale in ((ink, 0.5), (adapters["watercolor"], 1.5)):    # both touch this projection
        q = adapter[name]
        low_rank = low_rank + f32(scale * q["alpha"] / 4) * ((x @ q["down"].T) @ q["up"].T)
    close(x @ view["t"][name].T, low_rank, 1e-5)                 # what a kernel computes per request


def test_conv_lora_of_proj_in(W):
    """kohya files also adapt the 1x1-conv proj_in/proj_out: [rank, in, 1, 1] down, [out, rank, 1, 1] up."""
    name = "unet.down_blocks.0.attentions.0.proj_in.weight"
    out, inp = W["t"][name].shape[:2]
    rng = np.random.default_rng(13)
    down, up = rand(rng, 4, inp, 1, 1), rand(rng, out, 4, 1, 1)
    key = "lora_unet_down_blocks_0_attentions_0_proj_in"
    adapter = sd.read_lora(W, {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up,
                               f"{key}.alpha": np.array(2.0, np.float16)})
    delta = sd.apply_lora(name, 1.0, adapter)
    assert delta.shape == (out, inp, 1, 1)
    close(delta[:, :, 0, 0], 0.5 * up[:, :, 0, 0].astype(np.float64) @ down[:, :, 0, 0], 1e-6)


def test_unet_without_mid_block(W):
    """BK-SDM-style distilled UNets drop the mid block (mid_block_type null); the rest is unchanged."""
    t = {k: v for k, v in W["t"].items() if not k.startswith("unet.mid_block.")}
    Wd = dict(W, t=t, unet=dict(W["unet"], mid_block_type=None))
    ctx = sd.text_encoder(W, sd.tokenize(W, "a fox"))
    out = sd.unet(Wd, noise(4, (4, 8, 8)), 300.0, ctx)
    assert out.shape == (4, 8, 8) and np.isfinite(out).all()
    assert np.abs(out - sd.unet(W, noise(4, (4, 8, 8)), 300.0, ctx)).max() > 1e-3


def test_read_lora_rejects(W):
    factors = gen.lora_factors(6, text_encoder=False)
    good, _ = gen.kohya_tensors(factors, alpha=4.0)
    key = next(k for k in good if k.endswith("lora_up.weight"))
    for bad in ({**good, "lora_unet_nowhere.lora_down.weight": good[key]},
                {k: v for k, v in good.items() if k != key},
                {**good, key: good[key][:, :3]}):
        with pytest.raises(ValueError):
            sd.read_lora(W, bad)


# --- Pipeline ---------------------------------------------------------------------

def test_generate_256(W, base_image):
    ids, neg = sd.tokenize(W, "a red fox in the snow"), sd.tokenize(W, "")
    assert base_image.shape == (3, 256, 256) and base_image.dtype == f32 and np.isfinite(base_image).all()
    pixels = sd.to_pixels(base_image)
    assert pixels.shape == (256, 256, 3) and pixels.dtype == np.uint8
    assert pixels.std() > 10 and len(np.unique(pixels)) > 100, "the decoded image must not be constant"
    again = sd.generate(W, ids, neg, noise(0), 2, 7.5)
    np.testing.assert_array_equal(again, base_image)
    other = sd.generate(W, ids, neg, noise(1), 2, 7.5)
    assert np.isfinite(other).all() and np.abs(other - base_image).mean() > 1e-2


def test_lora_scale_zero_is_the_base_model(W, adapters, base_image):
    ids, neg = sd.tokenize(W, "a red fox in the snow"), sd.tokenize(W, "")
    zero = [(adapters["watercolor"], 0.0), (adapters["ink"], 0.0)]
    np.testing.assert_array_equal(sd.generate(W, ids, neg, noise(0), 2, 7.5, zero), base_image)
    mixed = sd.generate(W, ids, neg, noise(0), 2, 7.5, [(adapters["watercolor"], 0.3), (adapters["ink"], 0.7)])
    assert np.isfinite(mixed).all() and np.abs(mixed - base_image).mean() > 1e-3


def test_prompt_and_size_matter(W):
    ids, neg = sd.tokenize(W, "a castle at night"), sd.tokenize(W, "blurry")
    small = sd.generate(W, ids, neg, noise(3, (4, 8, 16)), 3, 5.0)
    assert small.shape == (3, 64, 128) and np.isfinite(small).all()
    fox = sd.generate(W, sd.tokenize(W, "a red fox"), neg, noise(3, (4, 8, 16)), 3, 5.0)
    assert np.abs(fox - small).mean() > 1e-3
    plain = sd.generate(W, ids, neg, noise(3, (4, 8, 16)), 3, 1.0)     # guidance 1: the prompt branch only
    assert np.abs(plain - small).mean() > 1e-3
