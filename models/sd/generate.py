"""Generate a tiny Stable-Diffusion-1.5-architecture model and two LoRA adapters.

No diffusion weights can be installed offline, so the default `illustrator`
deployment runs this at first start: a model with SD 1.5's exact architecture
and diffusers' folder layout (so the same package code reads a real SD-1.5
checkpoint), only very small, with deterministic random weights. Its pictures
are not meaningful.

    OUT_DIR/model_index.json
    OUT_DIR/scheduler/scheduler_config.json     EulerDiscreteScheduler, scaled_linear betas, "trailing"
    OUT_DIR/text_encoder/{config.json, model.safetensors}             CLIPTextModel
    OUT_DIR/tokenizer/{vocab.json, merges.txt, ...}                     CLIPTokenizer (byte-level BPE, </w>)
    OUT_DIR/unet/{config.json, diffusion_pytorch_model.safetensors}   UNet2DConditionModel
    OUT_DIR/vae/{config.json, diffusion_pytorch_model.safetensors}    AutoencoderKL (decoder only)
    OUT_DIR/loras/watercolor.safetensors        kohya layout (lora_unet_* / lora_te_*, .alpha)
    OUT_DIR/loras/ink.safetensors               diffusers/PEFT layout (unet.*.lora_A/lora_B)

Weights are uniform with the variance of the intended scale, drawn from the raw
PCG64 stream of the seed (no transcendental functions, no Generator
distribution code), so the same seed writes byte-identical files on any machine
and numpy version. Standard library and numpy only:

    python models/sd/generate.py OUT_DIR
"""
import json
import os
import struct
import sys

import numpy as np

TEXT_CONFIG = {"architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "hidden_act": "quick_gelu",
               "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
               "max_position_embeddings": 77, "layer_norm_eps": 1e-5, "projection_dim": 32,
               "torch_dtype": "float32"}
# attention_head_dim is SD 1.5's name for the head count (see tests/sd_numpy.py): 4 heads
# keep each head at 8 or more channels, the attention kernel's vector width, as in SD 1.5.
UNET_CONFIG = {"_class_name": "UNet2DConditionModel", "_diffusers_version": "0.30.0", "act_fn": "silu",
               "attention_head_dim": 4, "block_out_channels": [32, 64], "center_input_sample": False,
               "class_embed_type": None, "conv_in_kernel": 3, "conv_out_kernel": 3, "cross_attention_dim": 32,
               "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"], "downsample_padding": 1,
               "dual_cross_attention": False, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4,
               "layers_per_block": 1, "mid_block_scale_factor": 1, "mid_block_type": "UNetMidBlock2DCrossAttn",
               "norm_eps": 1e-5, "norm_num_groups": 8, "only_cross_attention": False, "out_channels": 4,
               "resnet_time_scale_shift": "default", "sample_size": 32, "time_embedding_type": "positional",
               "transformer_layers_per_block": 1, "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
               "upcast_attention": False, "use_linear_projection": False}
VAE_CONFIG = {"_class_name": "AutoencoderKL", "_diffusers_version": "0.30.0", "act_fn": "silu",
              "block_out_channels": [16, 16, 32, 32], "down_block_types": ["DownEncoderBlock2D"] * 4,
              "in_channels": 3, "latent_channels": 4, "layers_per_block": 1, "norm_num_groups": 8,
              "out_channels": 3, "sample_size": 256, "scaling_factor": 0.18215,
              "up_block_types": ["UpDecoderBlock2D"] * 4}
SCHEDULER_CONFIG = {"_class_name": "EulerDiscreteScheduler", "_diffusers_version": "0.30.0",
                    "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
                    "final_sigmas_type": "zero", "interpolation_type": "linear", "num_train_timesteps": 1000,
                    "prediction_type": "epsilon", "steps_offset": 1, "timestep_spacing": "trailing",
                    "trained_betas": None, "use_karras_sigmas": False}
MODEL_INDEX = {"_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.30.0",
               "feature_extractor": [None, None], "requires_safety_checker": False, "safety_checker": [None, None],
               "scheduler": ["diffusers", "EulerDiscreteScheduler"], "text_encoder": ["transformers", "CLIPTextModel"],
               "tokenizer": ["transformers", "CLIPTokenizer"], "unet": ["diffusers", "UNet2DConditionModel"],
               "vae": ["diffusers", "AutoencoderKL"]}
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
# The merges are learned from these words, so common prompt words become few tokens;
# any other text still tokenizes through the 512 byte symbols (with and without </w>).
CORPUS = ("a red fox in the snow watercolor ink painting of an astronaut riding horse on mars photo portrait "
          "landscape city at night sky with stars sunset over mountain river forest cat dog bird flower tree "
          "house castle ocean beach boat rain cloud light dark blue green yellow orange purple black white gold "
          "detailed high quality illustration drawing sketch style art the and")
N_MERGES = 120
LORA_RANK = 4
ADAPTERS = {"watercolor": (1, "kohya"), "ink": (2, "peft")}   # name -> (seed, layout)


# --- Writing ------------------------------------------------------------------

def write_safetensors(path, tensors, metadata=None):
    """float32 arrays (names sorted, data 8-byte aligned) -> a safetensors file, written atomically."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(np.shape(tensors[name])),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * (-len(text) % 8)
    _write_bytes(path, struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _write_bytes(path, data):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(f"{path}.tmp", "wb") as f:
        f.write(data)
    os.replace(f"{path}.tmp", path)   # never leave a half-written file under the real name


def _write_json(path, obj):
    _write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode())


class Uniform:
    """Zero-mean uniform draws with a given standard deviation from PCG64's raw 64-bit stream."""

    def __init__(self, seed):
        self.bits = np.random.PCG64(seed)

    def __call__(self, shape, std):
        n = int(np.prod(shape, dtype=np.int64))
        u = (self.bits.random_raw(n) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53   # exact, in [0, 1)
        return ((u * 2.0 - 1.0) * (std * 3.0 ** 0.5)).astype(np.float32).reshape(shape)


# --- Tokenizer ----------------------------------------------------------------

def bytes_to_unicode():
    """GPT-2/CLIP's reversible byte -> printable character map (printable bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


def learn_merges(corpus=CORPUS, n=N_MERGES):
    """Greedy BPE over the corpus words (last symbol carries </w>); ties broken by the pair itself."""
    words = [tuple(w[:-1]) + (w[-1] + "</w>",) for w in corpus.split()]
    merges = []
    while len(merges) < n:
        counts = {}
        for w in words:
            for pair in zip(w, w[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        joined = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            joined.append(tuple(out))
        words = joined
    return merges


def tokenizer_vocab(merges):
    """CLIP's vocabulary order: 256 byte symbols, the same with </w>, one token per merge, bos, eos."""
    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + [BOS, EOS]
    return {t: i for i, t in enumerate(tokens)}


def write_tokenizer(folder):
    merges = learn_merges()
    vocab = tokenizer_vocab(merges)
    _write_json(os.path.join(folder, "vocab.json"), vocab)
    _write_bytes(os.path.join(folder, "merges.txt"),
                 ("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)).encode())
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "unk_token": EOS}
    _write_json(os.path.join(folder, "special_tokens_map.json"), special)
    _write_json(os.path.join(folder, "tokenizer_config.json"),
                dict(special, tokenizer_class="CLIPTokenizer", model_max_length=77, do_lower_case=True,
                     add_prefix_space=False, errors="replace"))
    return vocab


# --- Tensor specifications ----------------------------------------------------
# (name, shape, kind): "w" a linear/conv weight (std gain / sqrt(fan_in)), "b" a bias,
# "gamma"/"beta" a norm's scale/shift, "tok"/"pos" embeddings.

def _norm(name, c):
    return [(f"{name}.weight", (c,), "gamma"), (f"{name}.bias", (c,), "beta")]


def _dense(name, out, inp, bias=True, kernel=None):
    shape = (out, inp) if kernel is None else (out, inp, kernel, kernel)
    return [(f"{name}.weight", shape, "w")] + ([(f"{name}.bias", (out,), "b")] if bias else [])


def resnet_specs(p, cin, cout, temb=None):
    """ResnetBlock2D: norm1, conv1, [time_emb_proj], norm2, conv2, [conv_shortcut 1x1 when cin != cout]."""
    s = _norm(p + "norm1", cin) + _dense(p + "conv1", cout, cin, kernel=3)
    if temb:
        s += _dense(p + "time_emb_proj", cout, temb)
    s += _norm(p + "norm2", cout) + _dense(p + "conv2", cout, cout, kernel=3)
    if cin != cout:
        s += _dense(p + "conv_shortcut", cout, cin, kernel=1)
    return s


def transformer_specs(p, c, context, linear_proj=False):
    """Transformer2DModel with one BasicTransformerBlock (self-attn, cross-attn, GEGLU feed-forward)."""
    k = None if linear_proj else 1
    b = p + "transformer_blocks.0."
    s = _norm(p + "norm", c) + _dense(p + "proj_in", c, c, kernel=k)
    for attn, kv in (("attn1", c), ("attn2", context)):
        s += _norm(b + ("norm1" if attn == "attn1" else "norm2"), c)
        s += _dense(f"{b}{attn}.to_q", c, c, bias=False) + _dense(f"{b}{attn}.to_k", c, kv, bias=False)
        s += _dense(f"{b}{attn}.to_v", c, kv, bias=False) + _dense(f"{b}{attn}.to_out.0", c, c)
    s += _norm(b + "norm3", c) + _dense(b + "ff.net.0.proj", 8 * c, c) + _dense(b + "ff.net.2", c, 4 * c)
    return s + _dense(p + "proj_out", c, c, kernel=k)


def unet_specs(cfg=UNET_CONFIG):
    """UNet2DConditionModel's tensors, walking the channels exactly as diffusers builds its blocks."""
    ch, lpb, ctx = cfg["block_out_channels"], cfg["layers_per_block"], cfg["cross_attention_dim"]
    lin, temb = cfg["use_linear_projection"], 4 * ch[0]
    s = _dense("conv_in", ch[0], cfg["in_channels"], kernel=3)
    s += _dense("time_embedding.linear_1", temb, ch[0]) + _dense("time_embedding.linear_2", temb, temb)
    out = ch[0]
    for i, kind in enumerate(cfg["down_block_types"]):
        inp, out = out, ch[i]
        for j in range(lpb):
            s += resnet_specs(f"down_blocks.{i}.resnets.{j}.", inp if j == 0 else out, out, temb)
            if kind == "CrossAttnDownBlock2D":
                s += transformer_specs(f"down_blocks.{i}.attentions.{j}.", out, ctx, lin)
        if i < len(ch) - 1:
            s += _dense(f"down_blocks.{i}.downsamplers.0.conv", out, out, kernel=3)
    s += resnet_specs("mid_block.resnets.0.", ch[-1], ch[-1], temb)
    s += transformer_specs("mid_block.attentions.0.", ch[-1], ctx, lin)
    s += resnet_specs("mid_block.resnets.1.", ch[-1], ch[-1], temb)
    rev = ch[::-1]
    out = rev[0]
    for i, kind in enumerate(cfg["up_block_types"]):
        prev, out, inp = out, rev[i], rev[min(i + 1, len(ch) - 1)]
        for j in range(lpb + 1):
            skip = inp if j == lpb else out
            s += resnet_specs(f"up_blocks.{i}.resnets.{j}.", (prev if j == 0 else out) + skip, out, temb)
            if kind == "CrossAttnUpBlock2D":
                s += transformer_specs(f"up_blocks.{i}.attentions.{j}.", out, ctx, lin)
        if i < len(ch) - 1:
            s += _dense(f"up_blocks.{i}.upsamplers.0.conv", out, out, kernel=3)
    return s + _norm("conv_norm_out", ch[0]) + _dense("conv_out", cfg["out_channels"], ch[0], kernel=3)


def text_specs(cfg, vocab_size):
    """CLIPTextModel: token/position embeddings, pre-LN encoder layers, final_layer_norm."""
    d, ff = cfg["hidden_size"], cfg["intermediate_size"]
    s = [("text_model.embeddings.token_embedding.weight", (vocab_size, d), "tok"),
         ("text_model.embeddings.position_embedding.weight", (cfg["max_position_embeddings"], d), "pos")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"text_model.encoder.layers.{i}."
        s += _norm(p + "layer_norm1", d)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            s += _dense(f"{p}self_attn.{proj}", d, d)
        s += _norm(p + "layer_norm2", d) + _dense(p + "mlp.fc1", ff, d) + _dense(p + "mlp.fc2", d, ff)
    return s + _norm("text_model.final_layer_norm", d)


def vae_specs(cfg=VAE_CONFIG):
    """AutoencoderKL's decoder side: post_quant_conv, decoder conv_in, mid block (with attention), up blocks."""
    ch, lpb, z = cfg["block_out_channels"], cfg["layers_per_block"], cfg["latent_channels"]
    s = _dense("post_quant_conv", z, z, kernel=1) + _dense("decoder.conv_in", ch[-1], z, kernel=3)
    s += resnet_specs("decoder.mid_block.resnets.0.", ch[-1], ch[-1])
    a = "decoder.mid_block.attentions.0."
    s += _norm(a + "group_norm", ch[-1])
    for proj in ("to_q", "to_k", "to_v", "to_out.0"):
        s += _dense(a + proj, ch[-1], ch[-1])
    s += resnet_specs("decoder.mid_block.resnets.1.", ch[-1], ch[-1])
    rev = ch[::-1]
    out = rev[0]
    for i in range(len(cfg["up_block_types"])):
        prev, out = out, rev[i]
        for j in range(lpb + 1):
            s += resnet_specs(f"decoder.up_blocks.{i}.resnets.{j}.", prev if j == 0 else out, out)
        if i < len(ch) - 1:
            s += _dense(f"decoder.up_blocks.{i}.upsamplers.0.conv", out, out, kernel=3)
    return s + _norm("decoder.conv_norm_out", ch[0]) + _dense("decoder.conv_out", cfg["out_channels"], ch[0], kernel=3)


def draw(specs, rand, gain=1.0):
    std = {"b": 0.05, "gamma": 0.1, "beta": 0.05, "tok": 1.0, "pos": 0.3}
    out = {}
    for name, shape, kind in specs:
        if kind == "w":
            out[name] = rand(shape, gain / float(np.prod(shape[1:])) ** 0.5)
        elif kind == "gamma":
            out[name] = (1.0 + rand(shape, std[kind])).astype(np.float32)
        else:
            out[name] = rand(shape, std[kind])
    return out


# --- The model ----------------------------------------------------------------

def generate(out_dir, seed=0, unet=None):
    """Write the tiny SD-1.5-layout model into out_dir (created); the same seed writes the same bytes.
    `unet`: config overrides (the tests' SD-1.5 topology: four levels, two resnets each)."""
    unet = dict(UNET_CONFIG, **(unet or {}))
    rand = Uniform(seed)
    vocab = write_tokenizer(os.path.join(out_dir, "tokenizer"))
    text_cfg = dict(TEXT_CONFIG, vocab_size=len(vocab), bos_token_id=vocab[BOS], eos_token_id=vocab[EOS],
                    pad_token_id=vocab[EOS])
    parts = (("text_encoder", "model.safetensors", text_cfg, text_specs(text_cfg, len(vocab))),
             ("unet", "diffusion_pytorch_model.safetensors", unet, unet_specs(unet)),
             ("vae", "diffusion_pytorch_model.safetensors", VAE_CONFIG, vae_specs()))
    for folder, filename, cfg, specs in parts:
        _write_json(os.path.join(out_dir, folder, "config.json"), cfg)
        write_safetensors(os.path.join(out_dir, folder, filename), draw(specs, rand), {"format": "pt"})
    _write_json(os.path.join(out_dir, "scheduler", "scheduler_config.json"), SCHEDULER_CONFIG)
    _write_json(os.path.join(out_dir, "model_index.json"), MODEL_INDEX)


# --- LoRA adapters ------------------------------------------------------------

def lora_targets(text_encoder):
    """(component, module, out, in) for every UNet attention projection (and the text encoder's)."""
    targets = [("unet", name[:-len(".weight")], shape[0], shape[1]) for name, shape, _ in unet_specs()
               if ".attn" in name and name.endswith(".weight")]
    if text_encoder:
        targets += [("text_encoder", name[:-len(".weight")], shape[0], shape[1])
                    for name, shape, _ in text_specs(TEXT_CONFIG, 1) if "self_attn." in name and name.endswith(".weight")]
    return targets


def lora_factors(seed, text_encoder, rank=LORA_RANK, strength=1.0):
    """{(component, module): (down [rank, in], up [out, rank])}; `strength` sizes up@down against the base."""
    rand = Uniform(seed)
    return {(comp, mod): (rand((rank, fan_in), fan_in ** -0.5), rand((out, rank), strength * rank ** -0.5))
            for comp, mod, out, fan_in in lora_targets(text_encoder)}


def kohya_tensors(factors, alpha):
    """kohya-ss layout: lora_unet_<module with _>.lora_down/.lora_up/.alpha, lora_te_ for the text encoder."""
    prefix = {"unet": "lora_unet_", "text_encoder": "lora_te_"}
    out = {}
    for (comp, mod), (down, up) in factors.items():
        key = prefix[comp] + mod.replace(".", "_")
        out.update({f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up,
                    f"{key}.alpha": np.array(alpha, np.float32)})
    rank = len(next(iter(factors.values()))[0])
    return out, {"ss_network_module": "networks.lora", "ss_network_dim": rank, "ss_network_alpha": alpha}


def peft_tensors(factors, alpha):
    """diffusers/PEFT layout: <component>.<module>.lora_A/lora_B.weight, alpha in lora_adapter_metadata."""
    out, meta = {}, {}
    for (comp, mod), (down, up) in factors.items():
        out.update({f"{comp}.{mod}.lora_A.weight": down, f"{comp}.{mod}.lora_B.weight": up})
        meta[f"{comp}.r"], meta[f"{comp}.lora_alpha"] = len(down), alpha
        meta.setdefault(f"{comp}.target_modules", set()).add(mod.rsplit(".", 1)[-1] if ".to_out." not in mod
                                                             else "to_out.0")
    meta = {k: sorted(v) if isinstance(v, set) else v for k, v in meta.items()}
    return out, {"format": "pt", "lora_adapter_metadata": json.dumps(meta, indent=2, sort_keys=True)}


def generate_lora(out_path, name, seed, layout):
    """Write adapter `name`: "kohya" (UNet and text encoder, alpha 2 = rank / 2) or "peft" (UNet, alpha 8)."""
    if layout == "kohya":
        tensors, meta = kohya_tensors(lora_factors(seed, text_encoder=True, strength=2.0), alpha=2.0)
    elif layout == "peft":
        tensors, meta = peft_tensors(lora_factors(seed, text_encoder=False, strength=0.5), alpha=8.0)
    else:
        raise ValueError(f"unknown LoRA layout {layout!r}: expected 'kohya' or 'peft'")
    write_safetensors(out_path, tensors, dict(meta, ss_output_name=name) if layout == "kohya" else meta)


def generate_default(out_dir, seed=0):
    """The `illustrator` folder: the model and loras/watercolor.safetensors, loras/ink.safetensors."""
    generate(out_dir, seed)
    for name, (lora_seed, layout) in ADAPTERS.items():
        generate_lora(os.path.join(out_dir, "loras", f"{name}.safetensors"), name, seed * 1000 + lora_seed, layout)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    generate_default(sys.argv[1])
