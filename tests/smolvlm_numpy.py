"""SmolVLM's vision side in plain numpy: the reference Loom's image component is checked against.

Written from the published architecture, not from Loom: HF transformers' Idefics3 / SmolVLM
(`Idefics3VisionTransformer`, `Idefics3Connector`, `Idefics3ImageProcessor`,
`Idefics3Processor`), i.e. a SigLIP-style ViT, the pixel-shuffle connector and a bias-free linear
projection into the decoder's embedding space. Pillow's resampler (libImaging/Resample.c) is
reproduced in integer arithmetic, so `resize` equals Pillow's byte for byte (see `resize` on
the pass order). Float32 math, with float64 for LayerNorm statistics and softmax.

Checkpoint layout (HF names; SmolVLM-256M-Instruct's shapes: D 768, 12 layers, 12 heads,
F 3072, patch 16, image_size 512, scale_factor 4, text hidden 576):

    model.vision_model.embeddings.patch_embedding.{weight [D, 3, p, p], bias [D]}   Conv2d, stride p
    model.vision_model.embeddings.position_embedding.weight [(S/p)^2, D]           learned
    model.vision_model.encoder.layers.i.layer_norm{1,2}.{weight, bias} [D]          pre-LN
    model.vision_model.encoder.layers.i.self_attn.{q,k,v,out}_proj.{weight [D, D], bias [D]}
    model.vision_model.encoder.layers.i.mlp.fc1.{weight [F, D], bias}, fc2.{weight [D, F], bias}
    model.vision_model.post_layernorm.{weight, bias} [D]
    model.connector.modality_projection.proj.weight [text_hidden, D * scale^2]      no bias

One image, as the package turns it into language-model input:

    W = load(model_dir)                                   # model.safetensors + the three JSONs
    tiles, rows, cols = preprocess(rgb, "auto", W.preprocessor)     # [N, 3, S, S]
    feats = connector(W, vision_encoder(W, tiles), W.config["scale_factor"])  # [N, seq, 576]
    pieces = prompt_tokens(rows, cols, image_seq_len(W.config))
    # pieces hold one "<image>" per row of feats.reshape(-1, 576), in order: tiles row-major
    # (the grid's rows top to bottom), the global image last.

Detail policy (the package's; PROFILES leaves its meaning to the source). S is the tile edge
(preprocessor max_image_size.longest_edge = vision image_size), L the resize target
(size.longest_edge, a multiple of S: 4 x 512 = 2048 for SmolVLM-256M):

    low    the global image only: SmolVLM's do_image_splitting=False path. The longest edge is
           resized to L (aspect kept), then the image is squared to S x S. One tile; the prompt
           is <fake><global-img><image> x seq <fake>.
    high   tiles plus the global image: SmolVLM's do_image_splitting=True path, exactly. The
           longest edge is resized to L (aspect kept, the other edge rounded up to even, both
           capped at 4096), both edges are rounded up to multiples of S, the result is cut into
           rows x cols tiles of S x S, and that image squared to S x S is the last tile. The
           prompt names each tile <row_r_col_c>. (rows = cols = 0 and low's prompt if the
           rounded image is a single S x S tile, possible only when L == S.)
    auto   high when the decoded image is larger than one tile (max(H, W) > S), else low.

A preprocessor with do_image_splitting false makes every detail low. Images arrive as RGB8;
straight alpha is composited onto white first (`flatten_alpha`), as the processor's
convert_to_rgb does, though the processor resizes RGBA before compositing.

Prompt expansion (Idefics3Processor, image_seq_len = (S/p)^2 / scale^2, 64 for SmolVLM-256M):
for each grid row r and column c `<fake_token_around_image><row_r_col_c>` + `<image>` x seq, a
newline after each grid row, then `\\n<fake_token_around_image><global-img>` + `<image>` x seq +
`<fake_token_around_image>`. SmolVLM's tokenizer holds these as added tokens (ADDED_TOKENS:
<global-img> 49152, <row_r_col_c> 49153.. up to a 6 x 6 grid, <fake_token_around_image> 49189,
<image> 49190), which SmolLM2-135M's own 49,152-token vocabulary lacks.
"""
from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

f32 = np.float32

FAKE, IMAGE, GLOBAL = "<fake_token_around_image>", "<image>", "<global-img>"
MAX_GRID = 6                       # SmolVLM's tokenizer has <row_r_col_c> for r, c in 1..6
ADDED_TOKENS = {GLOBAL: 49152,
                **{f"<row_{r}_col_{c}>": 49153 + (r - 1) * MAX_GRID + (c - 1)
                   for r in range(1, MAX_GRID + 1) for c in range(1, MAX_GRID + 1)},
                FAKE: 49189, IMAGE: 49190, "<end_of_utterance>": 49279}
MAX_IMAGE_SIZE = 4096              # the processor's absolute cap on the resized longest edge
DETAILS = ("low", "high", "auto")
VISION = "model.vision_model."
PROJ = "model.connector.modality_projection.proj.weight"


# --- Weights ------------------------------------------------------------------

class Weights(dict):
    """HF tensor name -> float32 array, with the model folder's JSON files as attributes:
    config (config.json), preprocessor (preprocessor_config.json), processor
    (processor_config.json, {} when absent)."""
    config: dict
    preprocessor: dict
    processor: dict


_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"), "BF16": np.dtype("<u2")}


def read_safetensors(path, keep=lambda name: True):
    """A safetensors file -> {name: float32 array} for the names `keep` accepts (BF16 widened
    by putting its 16 bits on top of a float32; F16 and F64 converted)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, entry in header.items():
        if name == "__metadata__" or not keep(name):
            continue
        begin, end = entry["data_offsets"]
        raw = np.frombuffer(data[begin:end], dtype=_DTYPES[entry["dtype"]])
        if entry["dtype"] == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[name] = raw.astype(f32).reshape(entry["shape"])
    return out


def _json(folder, name, default=None):
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        if default is None:
            raise FileNotFoundError(path)
        return default
    with open(path) as f:
        return json.load(f)


def load(path):
    """The vision tower and connector of a SmolVLM-layout checkpoint: `path` is its folder
    (model.safetensors, config.json, preprocessor_config.json, optional processor_config.json)
    or the .safetensors file inside it. Names are normalized to `model.vision_model.*` and
    `model.connector.*` whatever prefix the file nests them under; the text model is not read."""
    folder, file = (path, os.path.join(path, "model.safetensors")) if os.path.isdir(path) \
        else (os.path.dirname(path), path)

    def vision_or_connector(name):
        return "vision_model." in name or "connector.modality_projection." in name

    raw = read_safetensors(file, vision_or_connector)
    W = Weights()
    for name, array in raw.items():
        at = name.find("vision_model.") if "vision_model." in name else name.find("connector.")
        W["model." + name[at:]] = array
    W.config = _json(folder, "config.json")
    W.preprocessor = _json(folder, "preprocessor_config.json")
    W.processor = _json(folder, "processor_config.json", {})
    return W


def vision_config(config):
    """config.json's vision_config with transformers' Idefics3VisionConfig defaults filled in."""
    v = dict(num_channels=3, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
    v.update(config["vision_config"])
    return v


def image_seq_len(config, processor=None):
    """Positions one tile takes in the language input: (S/p)^2 / scale^2 (processor_config's
    image_seq_len when given, which must agree)."""
    v = vision_config(config)
    n = (v["image_size"] // v["patch_size"]) ** 2 // config["scale_factor"] ** 2
    if processor and "image_seq_len" in processor:
        assert processor["image_seq_len"] == n, (processor["image_seq_len"], n)
    return n


def expected_shapes(config):
    """{HF name: shape} every SmolVLM-layout vision tower + connector has for this config."""
    v = vision_config(config)
    d, ff, p, c = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["num_channels"]
    out = {VISION + "embeddings.patch_embedding.weight": (d, c, p, p),
           VISION + "embeddings.patch_embedding.bias": (d,),
           VISION + "embeddings.position_embedding.weight": ((v["image_size"] // p) ** 2, d),
           VISION + "post_layernorm.weight": (d,), VISION + "post_layernorm.bias": (d,),
           PROJ: (config["text_config"]["hidden_size"], d * config["scale_factor"] ** 2)}
    for i in range(v["num_hidden_layers"]):
        L = f"{VISION}encoder.layers.{i}."
        for ln in ("layer_norm1", "layer_norm2"):
            out[L + ln + ".weight"] = out[L + ln + ".bias"] = (d,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[L + f"self_attn.{proj}.weight"], out[L + f"self_attn.{proj}.bias"] = (d, d), (d,)
        out[L + "mlp.fc1.weight"], out[L + "mlp.fc1.bias"] = (ff, d), (ff,)
        out[L + "mlp.fc2.weight"], out[L + "mlp.fc2.bias"] = (d, ff), (d,)
    return out


# --- Resampling: Pillow's ImagingResample, exactly ------------------------------

def _lanczos(x):
    def sinc(t):
        return 1.0 if t == 0.0 else math.sin(t * math.pi) / (t * math.pi)
    return sinc(x) * sinc(x / 3.0) if -3.0 <= x < 3.0 else 0.0


def _bicubic(x, a=-0.5):
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    return (((x - 5) * x + 8) * x - 4) * a if x < 2.0 else 0.0


def _bilinear(x):
    x = abs(x)
    return 1.0 - x if x < 1.0 else 0.0


# PIL resample codes (preprocessor_config "resample"): 1 LANCZOS, 2 BILINEAR, 3 BICUBIC.
FILTERS = {1: (_lanczos, 3.0), 2: (_bilinear, 1.0), 3: (_bicubic, 2.0)}
PRECISION_BITS = 32 - 8 - 2        # Resample.c's fixed point for 8-bit images


def _coefficients(in_size, out_size, resample):
    """Resample.c's precompute_coeffs + normalize_coeffs_8bpc: per output pixel, the first input
    index and integer weights (scaled by 2^22) over a window of ksize inputs (zeros past its end)."""
    filt, support = FILTERS[resample]
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support *= filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    first = np.zeros(out_size, np.int64)
    weights = np.zeros((out_size, ksize))
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        w = [filt((x + xmin - center + 0.5) / filterscale) for x in range(xmax)]
        total = sum(w)
        first[xx] = xmin
        weights[xx, :xmax] = [v / total for v in w] if total != 0.0 else w
    fixed = np.trunc(weights * (1 << PRECISION_BITS) + np.where(weights < 0, -0.5, 0.5)).astype(np.int64)
    return first, fixed


def _resample_axis(img, out_size, axis, resample):
    """One pass along `axis` (0 rows, 1 columns) of a uint8 [H, W, C] image, rounded to uint8."""
    first, k = _coefficients(img.shape[axis], out_size, resample)
    src = np.moveaxis(img, axis, 0).astype(np.int64)            # [in, other, C]
    acc = np.full((out_size,) + src.shape[1:], 1 << (PRECISION_BITS - 1), np.int64)
    for j in range(k.shape[1]):
        idx = np.minimum(first + j, src.shape[0] - 1)           # taps past a window's end weigh 0
        acc += src[idx] * k[:, j, None, None]
    out = np.clip(acc >> PRECISION_BITS, 0, 255).astype(np.uint8)
    return np.moveaxis(out, 0, axis)


def resize(img, height, width, resample=1):
    """PIL.Image.resize((width, height), resample) of a uint8 [H, W, C] image in Pillow's
    classic pass order: the horizontal pass first, each pass rounded to 8 bits, a pass skipped
    when its size does not change. That is Pillow up to 12, under which SmolVLM's processor
    ran. Pillow 13 runs the vertical pass first when the height shrinks and
    2 * width_out - height_out > 2 * width_in - height_in (measured on 13.0.0), which moves
    some pixels of such resizes by one level; the package keeps the classic order."""
    img = np.asarray(img, np.uint8)
    if img.shape[1] != width:
        img = _resample_axis(img, width, 1, resample)
    if img.shape[0] != height:
        img = _resample_axis(img, height, 0, resample)
    return img


# --- Preprocessing --------------------------------------------------------------

def resize_output_size(height, width, longest_edge, cap=MAX_IMAGE_SIZE):
    """The processor's first resize: the longest edge to `longest_edge` (up or down), the other
    by the aspect ratio (truncated, then made even), then both scaled under `cap`."""
    aspect = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > cap:
        width, height = cap, int(cap / aspect)
    elif height > width and height > cap:
        height, width = cap, int(cap * aspect)
    return max(height, 1), max(width, 1)


def size_for_tiles(height, width, tile):
    """resize_for_vision_encoder: the longer edge rounded up to a multiple of the tile, the other
    derived from it by the aspect ratio, then rounded up too."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def splits(detail, height, width, preprocessor):
    """Whether an image of this decoded size is tiled, under the detail policy above."""
    if detail not in DETAILS:
        raise ValueError(f"detail must be one of {DETAILS}, got {detail!r}")
    if not preprocessor.get("do_image_splitting", True) or detail == "low":
        return False
    return detail == "high" or max(height, width) > preprocessor["max_image_size"]["longest_edge"]


def flatten_alpha(rgba):
    """Straight-alpha RGBA8 composited onto white -> RGB8 (round half up)."""
    rgba = np.asarray(rgba, np.uint8)
    if rgba.shape[-1] == 3:
        return rgba
    c, a = rgba[..., :3].astype(np.int64), rgba[..., 3:].astype(np.int64)
    return ((c * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)


def normalize(img, preprocessor):
    """uint8 [H, W, 3] -> float32 [3, H, W]: x * rescale_factor, minus mean, over std."""
    x = img.astype(np.float64) * preprocessor.get("rescale_factor", 1 / 255)
    mean = np.asarray(preprocessor.get("image_mean", [0.5] * 3), np.float64)
    std = np.asarray(preprocessor.get("image_std", [0.5] * 3), np.float64)
    return ((x - mean) / std).transpose(2, 0, 1).astype(f32)


def preprocess(rgb, detail, config):
    """RGB8 [H, W, 3] -> (tiles float32 [N, 3, S, S], rows, cols), `config` being the
    preprocessor_config.json dict. N = rows * cols + 1 (tiles row-major, the global image
    last) when split, else N = 1 and rows = cols = 0."""
    rgb = np.asarray(rgb, np.uint8)
    tile = config["max_image_size"]["longest_edge"]
    resample = config.get("resample", 1)
    split = splits(detail, rgb.shape[0], rgb.shape[1], config)
    img = rgb
    if config.get("do_resize", True):
        img = resize(img, *resize_output_size(*img.shape[:2], config["size"]["longest_edge"]), resample)
    rows = cols = 0
    if split:
        img = resize(img, *size_for_tiles(*img.shape[:2], tile), resample)
        if img.shape[0] > tile or img.shape[1] > tile:
            rows, cols = img.shape[0] // tile, img.shape[1] // tile
            frames = [img[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile]
                      for r in range(rows) for c in range(cols)]
            frames.append(resize(img, tile, tile, resample))
        else:
            frames = [img]
    else:
        frames = [resize(img, tile, tile, resample)]
    return np.stack([normalize(f, config) for f in frames]), rows, cols


# --- Vision encoder ---------------------------------------------------------------

def layer_norm(x, W, name, eps):
    x64 = x.astype(np.float64)
    mu = x64.mean(-1, keepdims=True)
    var = ((x64 - mu) ** 2).mean(-1, keepdims=True)
    y = (x64 - mu) / np.sqrt(var + eps)
    return (y * W[name + ".weight"] + W[name + ".bias"]).astype(f32)


def gelu_tanh(x):
    """GELU, tanh approximation (transformers' gelu_pytorch_tanh)."""
    x64 = x.astype(np.float64)
    return (0.5 * x64 * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64 ** 3)))).astype(f32)


def linear(x, W, name):
    return x @ W[name + ".weight"].T + W[name + ".bias"]


def softmax(x):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def patch_embed(W, tiles):
    """Conv2d(3, D, kernel p, stride p) as a GEMM over the flattened (channel, y, x) patches,
    plus the learned positions: [N, 3, S, S] -> [N, (S/p)^2, D], patches row-major."""
    w = W[VISION + "embeddings.patch_embedding.weight"]
    d, c, p, _ = w.shape
    n, _, s, _ = tiles.shape
    g = s // p
    patches = tiles.reshape(n, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(n, g * g, c * p * p)
    x = patches @ w.reshape(d, -1).T + W[VISION + "embeddings.patch_embedding.bias"]
    # Full S x S tiles: the model's bucketed position ids are simply 0 .. (S/p)^2 - 1.
    pos = W[VISION + "embeddings.position_embedding.weight"]
    assert pos.shape[0] == g * g, f"tiles of {s} px give {g * g} patches, the table has {pos.shape[0]}"
    return (x + pos).astype(f32)


def attention(W, h, prefix, heads):
    """Bidirectional multi-head self-attention with biases: [N, P, D] -> [N, P, D]."""
    n, p, d = h.shape
    hd = d // heads

    def split(t):                                      # [N, P, D] -> [N, heads, P, hd]
        return t.reshape(n, p, heads, hd).transpose(0, 2, 1, 3)

    q, k, v = (split(linear(h, W, f"{prefix}.{m}_proj")) for m in "qkv")
    weights = softmax((q @ k.transpose(0, 1, 3, 2)) * f32(hd ** -0.5))
    out = (weights.astype(f32) @ v).transpose(0, 2, 1, 3).reshape(n, p, d)
    return linear(out, W, f"{prefix}.out_proj")


def encoder_layer(W, x, i, heads, eps):
    L = f"{VISION}encoder.layers.{i}"
    x = x + attention(W, layer_norm(x, W, f"{L}.layer_norm1", eps), f"{L}.self_attn", heads)
    h = layer_norm(x, W, f"{L}.layer_norm2", eps)
    return (x + linear(gelu_tanh(linear(h, W, f"{L}.mlp.fc1")), W, f"{L}.mlp.fc2")).astype(f32)


def vision_encoder(W, tiles, config=None):
    """[N, 3, S, S] normalized tiles -> [N, (S/p)^2, D] post-LayerNorm patch features."""
    v = vision_config(config or W.config)
    if v["hidden_act"] not in ("gelu_pytorch_tanh", "gelu_new"):
        raise ValueError(f"hidden_act {v['hidden_act']!r}: only the tanh GELU is implemented")
    x = patch_embed(W, np.asarray(tiles, f32))
    for i in range(v["num_hidden_layers"]):
        x = encoder_layer(W, x, i, v["num_attention_heads"], v["layer_norm_eps"])
    return layer_norm(x, W, VISION + "post_layernorm", v["layer_norm_eps"])


# --- Connector ----------------------------------------------------------------------

def pixel_shuffle(x, scale):
    """Idefics3Connector.pixel_shuffle: [N, P, D] -> [N, P / scale^2, D * scale^2]. Output
    token (I, J) of the (g/scale)^2 grid, row-major, holds x at patch (I*scale + a, J*scale + b)
    in feature slots (a * scale + b) * D .. + D."""
    n, seq, d = x.shape
    g = int(round(seq ** 0.5))
    x = x.reshape(n, g, g, d)
    x = x.reshape(n, g, g // scale, d * scale)                     # fold `scale` columns
    x = x.transpose(0, 2, 1, 3)
    x = x.reshape(n, g // scale, g // scale, d * scale * scale)    # fold `scale` rows
    x = x.transpose(0, 2, 1, 3)
    return x.reshape(n, seq // (scale * scale), d * scale * scale)


def connector(W, features, scale_factor):
    """[N, P, D] -> [N, P / scale^2, text_hidden]: pixel shuffle, then the bias-free projection."""
    return (pixel_shuffle(features, scale_factor) @ W[PROJ].T).astype(f32)


# --- Prompt ---------------------------------------------------------------------------

def prompt_tokens(rows, cols, image_seq_len):
    """The text the processor puts in place of one image, as a list: each added token
    (<fake_token_around_image>, <row_r_col_c>, <global-img>, <image>) one entry, and the plain
    text between two of them ("\\n" after a grid row, "\\n\\n" after the last) one entry, as a
    tokenizer that splits on added tokens sees it. "".join(...) is the processor's string."""
    out = []
    for r in range(1, rows + 1):
        for c in range(1, cols + 1):
            out += [FAKE, f"<row_{r}_col_{c}>"] + [IMAGE] * image_seq_len
        out.append("\n\n" if r == rows else "\n")
    return out + [FAKE, GLOBAL] + [IMAGE] * image_seq_len + [FAKE]


def encode_image(W, rgb, detail="auto"):
    """RGB8 -> (features float32 [(rows * cols + 1) * seq, text_hidden], prompt_tokens)."""
    tiles, rows, cols = preprocess(flatten_alpha(rgb), detail, W.preprocessor)
    feats = connector(W, vision_encoder(W, tiles), W.config["scale_factor"])
    return feats.reshape(-1, feats.shape[-1]), prompt_tokens(rows, cols, image_seq_len(W.config, W.processor))
