"""Stable Diffusion 1.5 inference in plain numpy (float32 math): the reference Loom's kernels are checked against.

Written from the published architecture, not from Loom: diffusers' UNet2DConditionModel
(unets/unet_2d_condition.py, unet_2d_blocks.py: CrossAttnDownBlock2D, DownBlock2D,
UNetMidBlock2DCrossAttn, UpBlock2D, CrossAttnUpBlock2D), resnet.py (ResnetBlock2D),
transformers/transformer_2d.py and attention.py (Transformer2DModel, BasicTransformerBlock,
FeedForward with GEGLU), embeddings.py (get_timestep_embedding, TimestepEmbedding),
autoencoders/vae.py (Decoder, UNetMidBlock2D with one attention head, UpDecoderBlock2D),
schedulers/scheduling_euler_discrete.py, pipelines/stable_diffusion (classifier-free
guidance, latents / scaling_factor, image / 2 + 0.5), transformers' CLIPTextModel
(pre-LN layers, causal mask, quick_gelu, final_layer_norm) and CLIPTokenizer, and the LoRA
layouts diffusers' loaders read (loaders/lora_conversion_utils.py for kohya-ss names).

A diffusers folder (tensors get their component as a prefix: "unet.conv_in.weight"):

    unet/diffusion_pytorch_model.safetensors    conv_in, time_embedding.linear_{1,2},
        {down,up}_blocks.i.resnets.j.{norm1, conv1, time_emb_proj, norm2, conv2, conv_shortcut},
        {down,up}_blocks.i.attentions.j.{norm, proj_in, proj_out, transformer_blocks.0.{norm1..3,
        attn1/attn2.{to_q, to_k, to_v, to_out.0}, ff.net.0.proj (GEGLU), ff.net.2}},
        down_blocks.i.downsamplers.0.conv, up_blocks.i.upsamplers.0.conv,
        mid_block.{resnets.0, attentions.0, resnets.1}, conv_norm_out, conv_out
    text_encoder/model.safetensors              text_model.embeddings.{token,position}_embedding,
        text_model.encoder.layers.i.{layer_norm1, self_attn.{q,k,v,out}_proj, layer_norm2,
        mlp.fc1, mlp.fc2}, text_model.final_layer_norm
    vae/diffusion_pytorch_model.safetensors     post_quant_conv, decoder.{conv_in, mid_block
        (attentions.0.{group_norm, to_q, to_k, to_v, to_out.0}; the older query/key/value/
        proj_attn names are renamed as diffusers does), up_blocks.i.{resnets.j, upsamplers.0.conv},
        conv_norm_out, conv_out}; the encoder (image -> latents) is not needed and ignored
    */config.json, scheduler/scheduler_config.json, tokenizer/{vocab.json, merges.txt}

Note SD 1.5's naming quirk: unet config `attention_head_dim` is the number of heads
(diffusers: num_attention_heads = num_attention_heads or attention_head_dim); each
head has channels // heads channels.

    W = load(model_dir)
    ids = tokenize(W, "a red fox in the snow"); neg = tokenize(W, "")
    noise = np.random.default_rng(0).standard_normal((4, 32, 32)).astype(np.float32)
    adapter = read_lora(W, "watercolor.safetensors")
    image = generate(W, ids, neg, noise, steps=4, guidance=7.5, loras=[(adapter, 0.5)])
    pixels = to_pixels(image)          # [H, W, 3] uint8
"""
from __future__ import annotations

import html
import json
import os
import re

import numpy as np

f32 = np.float32
COMPONENTS = (("text_encoder", "model.safetensors"), ("unet", "diffusion_pytorch_model.safetensors"),
              ("vae", "diffusion_pytorch_model.safetensors"))
VAE_LEGACY = {".query.": ".to_q.", ".key.": ".to_k.", ".value.": ".to_v.", ".proj_attn.": ".to_out.0."}


# --- Weights ------------------------------------------------------------------

def read_safetensors(path):
    """(tensors, metadata) through the safetensors package's own numpy reader."""
    from safetensors import safe_open
    from safetensors.numpy import load_file
    with safe_open(path, framework="numpy") as f:
        metadata = f.metadata() or {}
    return load_file(path), metadata


def legacy_name(name):
    """Older VAE files name the mid-block attention query/key/value/proj_attn; diffusers renames them."""
    if ".attentions." in name:
        for old, new in VAE_LEGACY.items():
            name = name.replace(old, new)
    return name


def load(model_dir):
    """{"t": "component.name" -> float32 array, "unet"/"vae"/"text_encoder"/"scheduler": configs, "tokenizer"}."""
    W = {"t": {}, "dir": model_dir}
    for comp, filename in COMPONENTS:
        tensors, _ = read_safetensors(os.path.join(model_dir, comp, filename))
        for name, a in tensors.items():
            if a.dtype.kind != "f" or (comp == "vae" and name.startswith(("encoder.", "quant_conv."))):
                continue                                   # position_ids buffers; the image encoder
            W["t"][f"{comp}.{legacy_name(name) if comp == 'vae' else name}"] = a.astype(f32)
        W[comp] = json.load(open(os.path.join(model_dir, comp, "config.json")))
    W["scheduler"] = json.load(open(os.path.join(model_dir, "scheduler", "scheduler_config.json")))
    W["tokenizer"] = read_tokenizer(os.path.join(model_dir, "tokenizer"))
    return W


# --- Tokenizer (CLIPTokenizer) ------------------------------------------------

def bytes_to_unicode():
    """CLIP's byte -> character map: printable Latin-1 bytes are themselves, the other 68 move to U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def read_tokenizer(folder):
    vocab = json.load(open(os.path.join(folder, "vocab.json"), encoding="utf-8"))
    lines = open(os.path.join(folder, "merges.txt"), encoding="utf-8").read().split("\n")[1:]
    ranks = {tuple(line.split()): i for i, line in enumerate(line for line in lines if line.strip())}
    return {"vocab": vocab, "ranks": ranks, "bos": vocab["<|startoftext|>"], "eos": vocab["<|endoftext|>"]}


# CLIP's pattern with \p{L} as [^\W\d_] and \p{N} as \d (Python's re has no \p classes).
PATTERN = re.compile(r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[^\W\d_]+|\d|(?:[^\s\w]|_)+",
                     re.IGNORECASE)


def bpe(word, ranks):
    """One pre-token (already byte-mapped) -> its BPE symbols; the last symbol carries </w>."""
    parts = list(word[:-1]) + [word[-1] + "</w>"]
    while len(parts) > 1:
        pairs = [(ranks.get(p, len(ranks)), i) for i, p in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        first, second = parts[i], parts[i + 1]
        merged, j = [], 0
        while j < len(parts):                       # merge every occurrence of the best pair, left to right
            if j + 1 < len(parts) and parts[j] == first and parts[j + 1] == second:
                merged.append(first + second)
                j += 2
            else:
                merged.append(parts[j])
                j += 1
        parts = merged
    return parts


def tokenize(W, text, max_length=77):
    """SD's prompt ids: bos, BPE tokens (truncated), eos, padded with eos to max_length."""
    tok = W["tokenizer"]
    text = re.sub(r"\s+", " ", html.unescape(html.unescape(text))).strip().lower()
    byte_map = bytes_to_unicode()
    ids = []
    for piece in PATTERN.findall(text):
        word = "".join(byte_map[b] for b in piece.encode("utf-8"))
        ids += [tok["vocab"][s] for s in bpe(word, tok["ranks"])]
    ids = [tok["bos"]] + ids[:max_length - 2] + [tok["eos"]]
    return ids + [tok["eos"]] * (max_length - len(ids))


# --- Elementary ops -------------------------------------------------------------

def erf(x):
    """Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), evaluated in float64."""
    x = np.asarray(x, np.float64)
    s, a = np.sign(x), np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return s * (1.0 - poly * np.exp(-a * a))


def gelu(x):
    return (0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))).astype(f32)


def quick_gelu(x):
    return (x / (1.0 + np.exp(-1.702 * x))).astype(f32)


def silu(x):
    return (x / (1.0 + np.exp(-x))).astype(f32)


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def linear(x, t, name):
    """x [..., in] @ weight.T + bias; a 1x1 conv weight [out, in, 1, 1] serves as well."""
    w = t[f"{name}.weight"]
    y = x @ w.reshape(len(w), -1).T
    return y + t[f"{name}.bias"] if f"{name}.bias" in t else y


def conv2d(x, t, name, stride=1, padding=None):
    """x [C, H, W] -> [O, H', W'], weight [O, C, k, k], zero padding k // 2 by default."""
    w = t[f"{name}.weight"]
    k = w.shape[-1]
    p = k // 2 if padding is None else padding
    xp = np.pad(x, ((0, 0), (p, p), (p, p)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (k, k), axis=(1, 2))[:, ::stride, ::stride]
    y = np.tensordot(w, win, axes=([1, 2, 3], [0, 3, 4]))                   # [O, H', W']
    return (y + t[f"{name}.bias"][:, None, None]).astype(f32)


def group_norm(x, t, name, groups, eps):
    """torch.nn.GroupNorm over x [C, ...]: statistics per group of C // groups channels."""
    g = x.reshape(groups, -1)
    mu = g.mean(-1, keepdims=True)
    var = ((g - mu) ** 2).mean(-1, keepdims=True)
    y = ((g - mu) / np.sqrt(var + eps)).reshape(x.shape)
    shape = (-1,) + (1,) * (x.ndim - 1)
    return (y * t[f"{name}.weight"].reshape(shape) + t[f"{name}.bias"].reshape(shape)).astype(f32)


def layer_norm(x, t, name, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return ((x - mu) / np.sqrt(var + eps) * t[f"{name}.weight"] + t[f"{name}.bias"]).astype(f32)


def attention(q, k, v, heads, mask=None):
    """q [n, D], k/v [m, D] -> [n, D]: softmax(q k^T / sqrt(D / heads) + mask) v per head."""
    n, d = q.shape
    q, k, v = (a.reshape(len(a), heads, d // heads).transpose(1, 0, 2) for a in (q, k, v))
    w = q @ k.transpose(0, 2, 1) * f32((d // heads) ** -0.5)
    if mask is not None:
        w = w + mask
    return (softmax(w) @ v).transpose(1, 0, 2).reshape(n, d).astype(f32)


# --- CLIP text encoder --------------------------------------------------------

def clip_attention(x, t, name, heads):
    q, k, v = (linear(x, t, f"{name}.{p}_proj") for p in "qkv")
    causal = np.triu(np.full((len(x), len(x)), -np.inf, f32), 1)
    return linear(attention(q, k, v, heads, causal), t, f"{name}.out_proj")


def clip_mlp(x, t, name):
    return linear(quick_gelu(linear(x, t, f"{name}.fc1")), t, f"{name}.fc2")


def clip_encoder_layer(x, t, name, heads, eps):
    x = x + clip_attention(layer_norm(x, t, f"{name}.layer_norm1", eps), t, f"{name}.self_attn", heads)
    return x + clip_mlp(layer_norm(x, t, f"{name}.layer_norm2", eps), t, f"{name}.mlp")


def text_encoder(W, ids):
    """CLIPTextModel's last_hidden_state [len(ids), hidden] (what SD cross-attends to)."""
    t, cfg = W["t"], W["text_encoder"]
    p = "text_encoder.text_model."
    ids = np.asarray(ids)
    x = t[p + "embeddings.token_embedding.weight"][ids] + t[p + "embeddings.position_embedding.weight"][:len(ids)]
    for i in range(cfg["num_hidden_layers"]):
        x = clip_encoder_layer(x, t, f"{p}encoder.layers.{i}", cfg["num_attention_heads"], cfg["layer_norm_eps"])
    return layer_norm(x, t, p + "final_layer_norm", cfg["layer_norm_eps"])


# --- UNet blocks --------------------------------------------------------------

def timestep_embedding(timestep, dim, flip_sin_to_cos=True, freq_shift=0, max_period=10000):
    """diffusers' get_timestep_embedding (Timesteps) for one timestep -> [dim]."""
    half = dim // 2
    freqs = np.exp(-np.log(max_period) * np.arange(half, dtype=f32) / f32(half - freq_shift)).astype(f32)
    args = f32(timestep) * freqs
    emb = np.concatenate([np.cos(args), np.sin(args)] if flip_sin_to_cos else [np.sin(args), np.cos(args)])
    return np.pad(emb, (0, dim % 2)).astype(f32)


def time_embedding(t, name, t_emb):
    """TimestepEmbedding: linear_1, SiLU, linear_2."""
    return linear(silu(linear(t_emb, t, f"{name}.linear_1")), t, f"{name}.linear_2")


def resnet_block(x, t, name, groups, eps, temb=None):
    """ResnetBlock2D (time_embedding_norm "default", output_scale_factor 1)."""
    h = conv2d(silu(group_norm(x, t, f"{name}.norm1", groups, eps)), t, f"{name}.conv1")
    if temb is not None:
        h = h + linear(silu(temb), t, f"{name}.time_emb_proj")[:, None, None]
    h = conv2d(silu(group_norm(h, t, f"{name}.norm2", groups, eps)), t, f"{name}.conv2")
    shortcut = conv2d(x, t, f"{name}.conv_shortcut") if f"{name}.conv_shortcut.weight" in t else x
    return (shortcut + h).astype(f32)


def attention_block(x, t, name, heads, context=None):
    """diffusers Attention: to_q over x, to_k/to_v over context (x itself for self-attention), to_out.0."""
    kv = x if context is None else context
    q, k, v = linear(x, t, f"{name}.to_q"), linear(kv, t, f"{name}.to_k"), linear(kv, t, f"{name}.to_v")
    return linear(attention(q, k, v, heads), t, f"{name}.to_out.0")


def feed_forward(x, t, name):
    """FeedForward with GEGLU: net.0.proj -> (hidden, gate) halves, hidden * gelu(gate), net.2."""
    hidden, gate = np.split(linear(x, t, f"{name}.net.0.proj"), 2, axis=-1)
    return linear(hidden * gelu(gate), t, f"{name}.net.2")


def transformer_block(x, t, name, heads, context, eps=1e-5):
    """BasicTransformerBlock: self-attention, cross-attention, feed-forward, each pre-LN and residual."""
    x = x + attention_block(layer_norm(x, t, f"{name}.norm1", eps), t, f"{name}.attn1", heads)
    x = x + attention_block(layer_norm(x, t, f"{name}.norm2", eps), t, f"{name}.attn2", heads, context)
    return x + feed_forward(layer_norm(x, t, f"{name}.norm3", eps), t, f"{name}.ff")


def spatial_transformer(x, t, name, heads, context, groups):
    """Transformer2DModel (continuous input): GroupNorm (eps 1e-6), proj_in, blocks over H*W tokens, proj_out, + x."""
    c, hgt, wid = x.shape
    h = group_norm(x, t, f"{name}.norm", groups, 1e-6).reshape(c, -1).T          # [H*W, C]
    h = linear(h, t, f"{name}.proj_in")                                           # 1x1 conv or linear alike
    i = 0
    while f"{name}.transformer_blocks.{i}.norm1.weight" in t:
        h = transformer_block(h, t, f"{name}.transformer_blocks.{i}", heads, context)
        i += 1
    return (linear(h, t, f"{name}.proj_out").T.reshape(c, hgt, wid) + x).astype(f32)


def downsample(x, t, name):
    """Downsample2D: 3x3 conv, stride 2, padding 1."""
    return conv2d(x, t, f"{name}.conv", stride=2, padding=1)


def upsample(x, t, name):
    """Upsample2D: nearest-neighbour 2x, then a 3x3 conv."""
    return conv2d(x.repeat(2, axis=1).repeat(2, axis=2), t, f"{name}.conv")


def unet(W, latents, timestep, context):
    """UNet2DConditionModel: [in_channels, h, w] latents, a timestep, context [n, cross_dim] -> noise [out, h, w]."""
    t, cfg = W["t"], W["unet"]
    groups, eps, ch = cfg["norm_num_groups"], cfg["norm_eps"], cfg["block_out_channels"]
    heads = cfg.get("num_attention_heads") or cfg["attention_head_dim"]
    heads = heads if isinstance(heads, list) else [heads] * len(ch)
    lpb = cfg["layers_per_block"]
    lpb = lpb if isinstance(lpb, list) else [lpb] * len(ch)
    t_emb = timestep_embedding(timestep, ch[0], cfg["flip_sin_to_cos"], cfg["freq_shift"])
    temb = time_embedding(t, "unet.time_embedding", t_emb)

    x = conv2d(latents, t, "unet.conv_in")
    skips = [x]
    for i, kind in enumerate(cfg["down_block_types"]):
        for j in range(lpb[i]):
            x = resnet_block(x, t, f"unet.down_blocks.{i}.resnets.{j}", groups, eps, temb)
            if kind == "CrossAttnDownBlock2D":
                x = spatial_transformer(x, t, f"unet.down_blocks.{i}.attentions.{j}", heads[i], context, groups)
            skips.append(x)
        if f"unet.down_blocks.{i}.downsamplers.0.conv.weight" in t:
            x = downsample(x, t, f"unet.down_blocks.{i}.downsamplers.0")
            skips.append(x)

    if cfg.get("mid_block_type", "UNetMidBlock2DCrossAttn") is not None:     # distilled UNets may drop it
        x = resnet_block(x, t, "unet.mid_block.resnets.0", groups, eps, temb)
        x = spatial_transformer(x, t, "unet.mid_block.attentions.0", heads[-1], context, groups)
        x = resnet_block(x, t, "unet.mid_block.resnets.1", groups, eps, temb)

    for i, kind in enumerate(cfg["up_block_types"]):
        for j in range(lpb[::-1][i] + 1):
            x = np.concatenate([x, skips.pop()])                  # the skip is concatenated after x
            x = resnet_block(x, t, f"unet.up_blocks.{i}.resnets.{j}", groups, eps, temb)
            if kind == "CrossAttnUpBlock2D":
                x = spatial_transformer(x, t, f"unet.up_blocks.{i}.attentions.{j}", heads[::-1][i], context, groups)
        if f"unet.up_blocks.{i}.upsamplers.0.conv.weight" in t:
            x = upsample(x, t, f"unet.up_blocks.{i}.upsamplers.0")
    assert not skips
    x = silu(group_norm(x, t, "unet.conv_norm_out", groups, eps))
    return conv2d(x, t, "unet.conv_out")


# --- VAE decoder --------------------------------------------------------------

def vae_attention(x, t, name, groups, eps=1e-6):
    """The VAE mid block's Attention: GroupNorm, one head over H*W pixels, to_out.0, + x."""
    c, hgt, wid = x.shape
    h = group_norm(x, t, f"{name}.group_norm", groups, eps).reshape(c, -1).T
    q, k, v = (linear(h, t, f"{name}.{p}") for p in ("to_q", "to_k", "to_v"))
    out = linear(attention(q, k, v, 1), t, f"{name}.to_out.0")
    return (out.T.reshape(c, hgt, wid) + x).astype(f32)


def vae_mid_block(x, t, name, groups):
    """UNetMidBlock2D without a time embedding: resnet, attention, resnet (eps 1e-6)."""
    x = resnet_block(x, t, f"{name}.resnets.0", groups, 1e-6)
    x = vae_attention(x, t, f"{name}.attentions.0", groups)
    return resnet_block(x, t, f"{name}.resnets.1", groups, 1e-6)


def vae_decoder_block(x, t, name, num_layers, groups):
    """UpDecoderBlock2D: num_layers resnets (eps 1e-6, no time embedding), then an upsampler if it has one."""
    for j in range(num_layers):
        x = resnet_block(x, t, f"{name}.resnets.{j}", groups, 1e-6)
    return upsample(x, t, f"{name}.upsamplers.0") if f"{name}.upsamplers.0.conv.weight" in t else x


def vae_decode(W, latents):
    """AutoencoderKL.decode(latents / scaling_factor): [latent_channels, h, w] -> image [3, 8h, 8w] in about [-1, 1]."""
    t, cfg = W["t"], W["vae"]
    groups = cfg["norm_num_groups"]
    z = conv2d(latents / f32(cfg["scaling_factor"]), t, "vae.post_quant_conv")
    x = conv2d(z, t, "vae.decoder.conv_in")
    x = vae_mid_block(x, t, "vae.decoder.mid_block", groups)
    for i in range(len(cfg["up_block_types"])):
        x = vae_decoder_block(x, t, f"vae.decoder.up_blocks.{i}", cfg["layers_per_block"] + 1, groups)
    x = silu(group_norm(x, t, "vae.decoder.conv_norm_out", groups, 1e-6))
    return conv2d(x, t, "vae.decoder.conv_out")


def to_pixels(image):
    """diffusers' postprocess: (image / 2 + 0.5) clamped to [0, 1], * 255 rounded -> [H, W, 3] uint8."""
    x = np.clip(image * f32(0.5) + f32(0.5), 0.0, 1.0)
    return np.round(x.transpose(1, 2, 0) * f32(255.0)).astype(np.uint8)


# --- Scheduler (EulerDiscreteScheduler) -----------------------------------------

def alphas_cumprod(cfg):
    """scaled_linear betas (linspace of sqrt(beta), squared; or linear), in float32 as diffusers' torch code."""
    n, b0, b1 = cfg["num_train_timesteps"], cfg["beta_start"], cfg["beta_end"]
    if cfg.get("beta_schedule", "scaled_linear") == "scaled_linear":
        betas = np.linspace(b0 ** 0.5, b1 ** 0.5, n, dtype=f32) ** 2
    elif cfg["beta_schedule"] == "linear":
        betas = np.linspace(b0, b1, n, dtype=f32)
    else:
        raise ValueError(f"beta_schedule {cfg['beta_schedule']!r} is not supported")
    return np.cumprod(f32(1.0) - betas, dtype=f32)


def scheduler_timesteps(steps, cfg=None, spacing=None):
    """(timesteps [steps] float32, sigmas [steps + 1] float32 ending in 0) as EulerDiscreteScheduler.set_timesteps."""
    cfg = cfg or {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012}
    n = cfg["num_train_timesteps"]
    spacing = spacing or cfg.get("timestep_spacing", "trailing")
    if spacing == "trailing":
        ts = np.round(np.arange(n, 0, -n / steps)).astype(f32) - 1
    elif spacing == "leading":
        ts = (np.arange(steps) * (n // steps)).round()[::-1].astype(f32) + cfg.get("steps_offset", 0)
    elif spacing == "linspace":
        ts = np.linspace(0, n - 1, steps, dtype=f32)[::-1]
    else:
        raise ValueError(f"timestep_spacing {spacing!r} is not supported")
    ac = alphas_cumprod(cfg)
    sigmas = np.interp(ts, np.arange(n), ((1 - ac) / ac) ** 0.5)
    return ts.copy(), np.concatenate([sigmas, [0.0]]).astype(f32)


def init_noise_sigma(sigmas, spacing="trailing"):
    top = float(sigmas.max())
    return f32(top if spacing in ("linspace", "trailing") else (top ** 2 + 1) ** 0.5)


def scale_model_input(sample, sigma):
    return (sample / np.sqrt(f32(sigma) ** 2 + 1)).astype(f32)


def euler_step(sample, noise_pred, sigma, sigma_next):
    """One Euler step of dx/dsigma = eps (epsilon prediction, no churn): x + eps * (sigma_next - sigma)."""
    x0 = sample - f32(sigma) * noise_pred
    derivative = (sample - x0) / f32(sigma)
    return (sample + derivative * (f32(sigma_next) - f32(sigma))).astype(f32)


# --- LoRA ---------------------------------------------------------------------

PEFT_SUFFIXES = ((".lora_A.weight", ".lora_B.weight"), (".lora.down.weight", ".lora.up.weight"),
                 (".lora_linear_layer.down.weight", ".lora_linear_layer.up.weight"),
                 (".lora_down.weight", ".lora_up.weight"))
PROCESSOR = {"processor.to_q_lora": "to_q", "processor.to_k_lora": "to_k", "processor.to_v_lora": "to_v",
             "processor.to_out_lora": "to_out.0"}


def _kohya_names(W):
    """kohya-ss module key ("lora_unet_down_blocks_0_..._to_q") -> our weight name, from the base model's names."""
    prefixes = {"unet.": "lora_unet_", "text_encoder.": "lora_te_"}
    out = {}
    for name in W["t"]:
        for ours, theirs in prefixes.items():
            if name.startswith(ours) and name.endswith(".weight"):
                out[theirs + name[len(ours):-len(".weight")].replace(".", "_")] = name
    return out


def _peft_module(key):
    """A diffusers/PEFT key -> (our weight name, "down"/"up"), or None."""
    for old, new in PROCESSOR.items():                       # "attn1.processor.to_q_lora.down.weight"
        key = key.replace(f".{old}.", f".{new}.lora.")
    for down, up in PEFT_SUFFIXES:
        for suffix, side in ((down, "down"), (up, "up")):
            if key.endswith(suffix):
                mod = key[:-len(suffix)].removeprefix("base_model.model.")    # raw PEFT saves
                if mod.startswith("text_model."):
                    mod = "text_encoder." + mod
                elif not mod.startswith(("unet.", "text_encoder.")):
                    mod = "unet." + mod                       # attention-processor files name UNet modules bare
                return mod + ".weight", side
    return None


def read_lora(W, source):
    """A LoRA file (path) or {key: array} -> {weight name: {"down", "up", "alpha", "shape"}}, checked against W."""
    tensors, metadata = read_safetensors(source) if isinstance(source, str) else (source, {})
    config = json.loads(metadata.get("lora_adapter_metadata", "{}"))
    kohya = _kohya_names(W)
    parts = {}
    for key, a in tensors.items():
        module, _, leaf = key.partition(".")
        if module in kohya and leaf in ("lora_down.weight", "lora_up.weight", "alpha"):
            parts.setdefault(kohya[module], {})[leaf.split(".")[0].replace("lora_", "")] = a
        elif key.endswith(".alpha") and f"{key[:-6]}.weight" in W["t"]:
            parts.setdefault(f"{key[:-6]}.weight", {})["alpha"] = a
        elif _peft_module(key):
            name, side = _peft_module(key)
            parts.setdefault(name, {})[side] = a
        else:
            raise ValueError(f"LoRA tensor {key!r} names no projection of this model")
    adapter = {}
    for name, p in parts.items():
        if name not in W["t"] or "down" not in p or "up" not in p:
            raise ValueError(f"LoRA for {name!r}: unknown weight or missing down/up")
        shape = W["t"][name].shape
        down, up = p["down"].astype(f32).reshape(len(p["down"]), -1), p["up"].astype(f32).reshape(len(p["up"]), -1)
        rank = len(down)
        if up.shape != (shape[0], rank) or down.shape[1] != int(np.prod(shape[1:])):
            raise ValueError(f"LoRA for {name!r}: down {down.shape} / up {up.shape} do not fit {shape}")
        comp = name.split(".")[0]
        alpha = float(p["alpha"]) if "alpha" in p else float(config.get(f"{comp}.lora_alpha", rank))
        adapter[name] = {"down": down, "up": up, "alpha": alpha, "shape": shape}
    return adapter


def apply_lora(weight_name, scale, adapter):
    """The low-rank term scale * (alpha / rank) * up @ down for one weight (None if the adapter leaves it alone)."""
    p = adapter.get(weight_name)
    if p is None:
        return None
    factor = f32(scale) * f32(p["alpha"] / len(p["down"]))
    return (factor * (p["up"] @ p["down"])).reshape(p["shape"]).astype(f32)


def with_loras(W, loras):
    """A per-request view of W: each touched weight is a new array, base + the sum of its deltas; W is unchanged."""
    t = dict(W["t"])
    for adapter, scale in loras:
        for name in adapter:
            t[name] = t[name] + apply_lora(name, scale, adapter)
    return dict(W, t=t)


# --- Pipeline -------------------------------------------------------------------

def generate(W, prompt_ids, negative_ids, seed_noise, steps, guidance, loras=()):
    """StableDiffusionPipeline with Euler: seed_noise [4, h, w] (unit Gaussian) -> image [3, 8h, 8w].

    `loras` is a list of (adapter from read_lora, scale), applied to this call only.
    Classifier-free guidance runs the UNet on the negative and the prompt context when guidance > 1.
    """
    Wr = with_loras(W, loras)
    cond = text_encoder(Wr, prompt_ids)
    uncond = text_encoder(Wr, negative_ids) if guidance > 1 else None
    spacing = W["scheduler"].get("timestep_spacing", "trailing")
    timesteps, sigmas = scheduler_timesteps(steps, W["scheduler"], spacing)
    x = (np.asarray(seed_noise, f32) * init_noise_sigma(sigmas, spacing)).astype(f32)
    for i, ts in enumerate(timesteps):
        inp = scale_model_input(x, sigmas[i])
        eps = unet(Wr, inp, ts, cond)
        if uncond is not None:
            eps_u = unet(Wr, inp, ts, uncond)
            eps = eps_u + f32(guidance) * (eps - eps_u)
        x = euler_step(x, eps, sigmas[i], sigmas[i + 1])
    return vae_decode(Wr, x)
