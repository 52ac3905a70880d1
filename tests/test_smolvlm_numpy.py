"""The numpy SmolVLM vision reference (tests/smolvlm_numpy.py) and the default catalog's
generated vision tower (models/smolvlm/generate.py), checked on their own, independent of Loom's
kernels.

- Generator: same seed -> byte-identical files (the CLI too), another seed -> other weights;
  the files agree with each other and with the shapes the reference expects; Loom's strict
  safetensors reader and the safetensors package read the same tensors.
- Layout facts of the real SmolVLM-256M-Instruct (config values found in transformers and
  published configs) give the shapes its model.safetensors holds.
- Reader: BF16/F16/F32 and a nested name prefix (SmolVLA keeps the tower under
  model.vlm_with_expert.vlm.model.*).
- Preprocessing: `resize` equals Pillow byte for byte (Lanczos, bicubic, bilinear, up and
  down; Pillow's classic pass order, see smolvlm_numpy.resize); tile geometry per detail for
  several sizes, hand-derived from the processor's rules; one whole split rebuilt with Pillow
  crops and resizes.
- Model: pixel shuffle against a loop that replays transformers' view/permute/reshape chain
  element by element; the patch embedding against a direct convolution loop; attention against
  a per-head loop; the whole pipeline on the generated weights finite and not degenerate.
- Prompt expansion: counts and the processor's exact string.
"""
import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import smolvlm_numpy as sv  # noqa: E402


def _load_generator():
    """models/smolvlm/generate.py as a module, leaving no __pycache__ in the package folder
    (setup.py ships models/*/* as data)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("smolvlm_generate",
                                                  os.path.join(ROOT, "models", "smolvlm", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = saved
    return module


gen = _load_generator()

FILES = ("model.safetensors", "config.json", "preprocessor_config.json", "processor_config.json",
         "added_tokens.json")

# SmolVLM-256M-Instruct's config.json / preprocessor_config.json values that fix the vision side.
REAL_256M = {"scale_factor": 4, "image_token_id": 49190,
             "vision_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                               "num_attention_heads": 12, "patch_size": 16, "image_size": 512},
             "text_config": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                             "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49280}}
REAL_256M_PRE = {"size": {"longest_edge": 2048}, "max_image_size": {"longest_edge": 512},
                 "do_image_splitting": True, "resample": 1, "rescale_factor": 1 / 255,
                 "image_mean": [0.5] * 3, "image_std": [0.5] * 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return gen.generate(str(tmp_path_factory.mktemp("smolvlm") / "seed0"))


@pytest.fixture(scope="module")
def W(model_dir):
    return sv.load(model_dir)


def _bytes(folder):
    return {name: open(os.path.join(folder, name), "rb").read() for name in FILES}


# --- Generator ------------------------------------------------------------------

def test_generator_is_deterministic(model_dir, tmp_path):
    again = _bytes(gen.generate(str(tmp_path / "again")))
    assert again == _bytes(model_dir)
    subprocess.run([sys.executable, os.path.join(ROOT, "models", "smolvlm", "generate.py"), str(tmp_path / "cli")],
                   check=True, timeout=60)
    assert _bytes(str(tmp_path / "cli")) == again
    other = _bytes(gen.generate(str(tmp_path / "seed1"), seed=1))
    assert other["model.safetensors"] != again["model.safetensors"]
    assert len(other["model.safetensors"]) == len(again["model.safetensors"])
    assert other["preprocessor_config.json"] == again["preprocessor_config.json"]
    a, b = sv.load(model_dir), sv.load(str(tmp_path / "seed1"))
    assert all(not np.array_equal(a[k], b[k]) for k in a)


def test_generated_files_agree(W, model_dir):
    cfg, pre, proc = W.config, W.preprocessor, W.processor
    v = sv.vision_config(cfg)
    assert {k: tuple(a.shape) for k, a in W.items()} == sv.expected_shapes(cfg)
    assert all(a.dtype == np.float32 and np.isfinite(a).all() for a in W.values())
    assert pre["max_image_size"]["longest_edge"] == v["image_size"] == 128
    assert pre["size"]["longest_edge"] % v["image_size"] == 0
    assert cfg["text_config"]["hidden_size"] == 576 and v["hidden_size"] % v["num_attention_heads"] == 0
    assert (v["image_size"] // v["patch_size"]) % cfg["scale_factor"] == 0
    assert sv.image_seq_len(cfg, proc) == proc["image_seq_len"] == 16
    added = json.load(open(os.path.join(model_dir, "added_tokens.json")))
    assert added == sv.ADDED_TOKENS and cfg["image_token_id"] == added[sv.IMAGE]
    assert W[sv.PROJ].shape == (576, 128 * 4)


def test_generated_file_reads_the_same_everywhere(W, model_dir):
    path = os.path.join(model_dir, "model.safetensors")
    from safetensors.numpy import load_file
    theirs = load_file(path)
    assert set(theirs) == set(W) and all(np.array_equal(theirs[k], W[k]) for k in W)
    from loom.weights import open_checkpoint                    # the server's strict reader
    ck = open_checkpoint(path)
    assert set(ck.tensors) == set(W)
    assert all(np.array_equal(np.asarray(ck.array(k)).reshape(W[k].shape), W[k]) for k in W)


def test_real_smolvlm_256m_layout():
    shapes = sv.expected_shapes(REAL_256M)
    assert len(shapes) == 6 + 16 * 12
    assert shapes["model.vision_model.embeddings.patch_embedding.weight"] == (768, 3, 16, 16)
    assert shapes["model.vision_model.embeddings.position_embedding.weight"] == (1024, 768)
    assert shapes["model.vision_model.encoder.layers.11.mlp.fc1.weight"] == (3072, 768)
    assert shapes["model.connector.modality_projection.proj.weight"] == (576, 12288)
    assert sv.image_seq_len(REAL_256M, {"image_seq_len": 64}) == 64
    assert sv.vision_config(REAL_256M)["layer_norm_eps"] == 1e-6      # transformers' default
    # Its grid: longest edge to 2048, tiles of 512, so at most 4 x 4 (+ global) per image.
    assert sv.resize_output_size(480, 640, 2048) == (1536, 2048)
    assert sv.size_for_tiles(1536, 2048, 512) == (1536, 2048)
    assert sv.resize_output_size(1000, 10, 2048) == (2048, 20)
    assert sv.size_for_tiles(2048, 20, 512) == (2048, 512)
    assert sv.resize_output_size(9000, 3000, 2048) == (2048, 682)
    assert sv.resize_output_size(10, 5000, 8192) == (8, 4096)        # 8192 x 16, then the 4096 cap


def _write_safetensors(path, entries):
    header, blob = {"__metadata__": {"format": "pt"}}, b""
    for name, (dtype, shape, data) in entries.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + blob)


def test_reader_widens_bf16_and_f16_and_strips_prefixes(tmp_path):
    rng = np.random.default_rng(3)
    a, b, c = rng.standard_normal(6).astype(np.float32), rng.standard_normal((2, 3)), rng.standard_normal(4)
    bf16 = (a.view(np.uint32) >> 16).astype("<u2")                  # truncated to bfloat16
    nest = "model.vlm_with_expert.vlm.model."
    _write_safetensors(str(tmp_path / "model.safetensors"), {
        nest + "vision_model.post_layernorm.weight": ("BF16", (6,), bf16.tobytes()),
        nest + "vision_model.post_layernorm.bias": ("F16", (2, 3), b.astype("<f2").tobytes()),
        nest + "connector.modality_projection.proj.weight": ("F32", (4,), c.astype("<f4").tobytes()),
        nest + "text_model.norm.weight": ("F32", (4,), c.astype("<f4").tobytes())})
    for name in ("config.json", "preprocessor_config.json"):
        (tmp_path / name).write_text("{}")
    W = sv.load(str(tmp_path))
    assert sorted(W) == ["model.connector.modality_projection.proj.weight",
                         "model.vision_model.post_layernorm.bias", "model.vision_model.post_layernorm.weight"]
    assert np.array_equal(W["model.vision_model.post_layernorm.weight"],
                          (bf16.astype(np.uint32) << 16).view(np.float32))
    assert np.abs(W["model.vision_model.post_layernorm.weight"] - a).max() <= np.abs(a).max() * 2 ** -7
    assert np.array_equal(W["model.vision_model.post_layernorm.bias"], b.astype(np.float16).astype(np.float32))
    assert np.array_equal(W["model.connector.modality_projection.proj.weight"], c.astype(np.float32))
    assert W.processor == {}


# --- Preprocessing ----------------------------------------------------------------

@pytest.mark.parametrize("h,w,oh,ow,resample", [
    (300, 200, 512, 342, 1), (512, 342, 512, 384, 1), (512, 384, 128, 128, 1), (37, 91, 128, 128, 1),
    (1, 1, 64, 64, 1), (5, 300, 2, 17, 1), (2048, 682, 512, 512, 1), (64, 48, 23, 101, 3),
    (19, 7, 40, 3, 2), (40, 30, 10, 20, 1)])
def test_resize_equals_pillow(h, w, oh, ow, resample):
    """Against Pillow's single-axis resizes chained horizontal then vertical (each one pass),
    and against one Pillow call wherever every Pillow version runs that order (the height does
    not shrink, or 2 * ow - oh <= 2 * w - h)."""
    img = np.random.default_rng(h * 1000 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    ours = sv.resize(img, oh, ow, resample)
    assert ours.dtype == np.uint8 and ours.shape == (oh, ow, 3)
    chained = Image.fromarray(img).resize((ow, h), resample=resample).resize((ow, oh), resample=resample)
    assert np.array_equal(ours, np.asarray(chained))
    if oh >= h or 2 * ow - oh <= 2 * w - h:
        assert np.array_equal(ours, np.asarray(Image.fromarray(img).resize((ow, oh), resample=resample)))


# (H, W) -> (rows, cols) when split, for the generated preprocessor (tile 128, longest edge 512),
# derived by hand: longest edge to 512, the other edge int(512 * ratio) made even, then both
# rounded up to multiples of 128.
GEOMETRY = {(100, 100): (4, 4),            # 512 x 512
            (300, 200): (4, 3),            # 512 x 342 -> 512 x 384
            (200, 300): (3, 4),
            (37, 91): (2, 4),              # 208 x 512 -> 256 x 512
            (128, 128): (4, 4),
            (129, 64): (4, 2),             # 512 x 254 -> 512 x 256
            (1, 1): (4, 4),
            (10, 1000): (1, 4),            # 6 x 512 -> 128 x 512
            (640, 480): (4, 3)}


@pytest.mark.parametrize("hw", list(GEOMETRY))
def test_preprocess_geometry(W, hw):
    h, w = hw
    img = np.random.default_rng(h + 7 * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    rows, cols = GEOMETRY[hw]
    for detail in sv.DETAILS:
        tiles, r, c = sv.preprocess(img, detail, W.preprocessor)
        split = detail == "high" or (detail == "auto" and max(h, w) > 128)
        assert (r, c) == ((rows, cols) if split else (0, 0))
        assert tiles.shape == ((rows * cols + 1) if split else 1, 3, 128, 128) and tiles.dtype == np.float32
        assert tiles.min() >= -1.0 and tiles.max() <= 1.0


def test_preprocess_equals_the_processor_steps_done_with_pillow(W):
    """300 x 200 (H x W): the processor's steps redone with Pillow. high: longest edge to 512
    (512 x 342), rounded to tiles (512 x 384), 4 x 3 crops, then the global 128 x 128; low: the
    first resize squared to 128 x 128."""
    img = np.random.default_rng(5).integers(0, 256, (300, 200, 3), dtype=np.uint8)
    def lanczos(im, width, height):                     # Pillow, one axis at a time: horizontal first
        return im.resize((width, im.height), Image.LANCZOS).resize((width, height), Image.LANCZOS)
    step1 = lanczos(Image.fromarray(img), 342, 512)
    step2 = lanczos(step1, 384, 512)
    crops = [step2.crop((c * 128, r * 128, (c + 1) * 128, (r + 1) * 128)) for r in range(4) for c in range(3)]
    frames = crops + [lanczos(step2, 128, 128)]
    want = np.stack([np.asarray(f, np.float32).transpose(2, 0, 1) / 127.5 - 1.0 for f in frames])
    tiles, rows, cols = sv.preprocess(img, "high", W.preprocessor)
    assert (rows, cols) == (4, 3)
    np.testing.assert_allclose(tiles, want, atol=1e-6, rtol=0)
    low, _, _ = sv.preprocess(img, "low", W.preprocessor)
    want_low = np.asarray(lanczos(step1, 128, 128), np.float32).transpose(2, 0, 1) / 127.5 - 1
    np.testing.assert_allclose(low[0], want_low, atol=1e-6, rtol=0)


def test_detail_policy():
    pre = gen.preprocessor_config()
    assert not sv.splits("auto", 128, 128, pre) and sv.splits("auto", 129, 1, pre)
    assert sv.splits("high", 1, 1, pre) and not sv.splits("low", 4000, 4000, pre)
    off = dict(pre, do_image_splitting=False)
    assert not any(sv.splits(d, 4000, 3000, off) for d in sv.DETAILS)
    with pytest.raises(ValueError):
        sv.splits("medium", 10, 10, pre)
    # 256M: photos are tiled under auto, icons are not.
    assert sv.splits("auto", 480, 640, REAL_256M_PRE) and not sv.splits("auto", 512, 300, REAL_256M_PRE)


def test_flatten_alpha_onto_white():
    px = np.array([[[10, 20, 30, 255], [10, 20, 30, 0], [200, 100, 0, 128]]], np.uint8)
    out = sv.flatten_alpha(px)
    assert out.tolist() == [[[10, 20, 30], [255, 255, 255],
                             [round((200 * 128 + 255 * 127) / 255), round((100 * 128 + 255 * 127) / 255),
                              round(255 * 127 / 255)]]]


# --- Model ----------------------------------------------------------------------------

def _permute_0213(flat, shape):
    """torch .permute(0, 2, 1, 3) followed by a contiguous copy, element by element."""
    a, b, c, e = shape
    out = [None] * len(flat)
    for i0 in range(a):
        for i1 in range(b):
            for i2 in range(c):
                for i3 in range(e):
                    out[((i0 * c + i2) * b + i1) * e + i3] = flat[((i0 * b + i1) * c + i2) * e + i3]
    return out, (a, c, b, e)


def _pixel_shuffle_loop(x, s):
    """transformers' Idefics3Connector.pixel_shuffle replayed on the flat buffer: view
    (n, g, g/s, d*s) -> permute -> reshape (n, g/s, g/s, d*s*s) -> permute -> reshape."""
    n, seq, d = x.shape
    g = math.isqrt(seq)
    flat = x.reshape(-1).tolist()                       # views share this row-major buffer
    flat, shape = _permute_0213(flat, (n, g, g // s, d * s))
    flat, shape = _permute_0213(flat, (shape[0], shape[1], g // s, d * s * s))
    return np.array(flat, x.dtype).reshape(n, seq // (s * s), d * s * s)


@pytest.mark.parametrize("n,g,d,s", [(2, 4, 3, 2), (1, 8, 2, 4), (1, 8, 5, 2), (1, 6, 2, 3)])
def test_pixel_shuffle_matches_transformers_loop(n, g, d, s):
    x = np.random.default_rng(g * d + s).standard_normal((n, g * g, d)).astype(np.float32)
    ours = sv.pixel_shuffle(x, s)
    assert np.array_equal(ours, _pixel_shuffle_loop(x, s))
    for b in range(n):                                  # and the documented closed form
        for big_i in range(g // s):
            for big_j in range(g // s):
                for a in range(s):
                    for bb in range(s):
                        got = ours[b, big_i * (g // s) + big_j, (a * s + bb) * d:(a * s + bb + 1) * d]
                        assert np.array_equal(got, x[b, (big_i * s + a) * g + big_j * s + bb])


def test_patch_embedding_matches_a_convolution_loop(W):
    tiles = np.random.default_rng(11).uniform(-1, 1, (2, 3, 128, 128)).astype(np.float32)
    w = W["model.vision_model.embeddings.patch_embedding.weight"].astype(np.float64)
    bias = W["model.vision_model.embeddings.patch_embedding.bias"]
    pos = W["model.vision_model.embeddings.position_embedding.weight"]
    ours = sv.patch_embed(W, tiles)
    p, g = 16, 8
    for t in range(2):
        for i in range(g):
            for j in range(g):
                window = tiles[t, :, i * p:(i + 1) * p, j * p:(j + 1) * p].astype(np.float64)
                want = np.tensordot(w, window, axes=([1, 2, 3], [0, 1, 2])) + bias + pos[i * g + j]
                np.testing.assert_allclose(ours[t, i * g + j], want, atol=2e-5, rtol=0)


def test_attention_matches_a_per_head_loop(W):
    h = np.random.default_rng(12).standard_normal((2, 64, 128)).astype(np.float32)
    prefix = "model.vision_model.encoder.layers.1.self_attn"
    ours = sv.attention(W, h, prefix, heads=4)
    hd = 32
    for t in range(2):
        x = h[t].astype(np.float64)
        heads = []
        for head in range(4):
            rows = slice(head * hd, (head + 1) * hd)

            def proj(m):
                return x @ W[f"{prefix}.{m}_proj.weight"][rows].T.astype(np.float64) + W[f"{prefix}.{m}_proj.bias"][rows]
            q, k, v = proj("q"), proj("k"), proj("v")
            scores = q @ k.T / math.sqrt(hd)
            p = np.exp(scores - scores.max(1, keepdims=True))
            heads.append((p / p.sum(1, keepdims=True)) @ v)
        want = np.concatenate(heads, 1) @ W[f"{prefix}.out_proj.weight"].T.astype(np.float64) + W[f"{prefix}.out_proj.bias"]
        np.testing.assert_allclose(ours[t], want, atol=2e-5 * np.abs(want).max(), rtol=0)


def test_gelu_and_layer_norm_definitions():
    x = np.array([-3.0, -0.5, 0.0, 0.7, 2.5], np.float32)
    want = [0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))) for v in x.tolist()]
    np.testing.assert_allclose(sv.gelu_tanh(x), want, rtol=1e-6, atol=1e-7)
    y = np.random.default_rng(2).standard_normal((3, 16)).astype(np.float32) * 4 + 3
    P = {"n.weight": np.full(16, 2.0, np.float32), "n.bias": np.full(16, 0.5, np.float32)}
    out = sv.layer_norm(y, P, "n", 1e-6)
    np.testing.assert_allclose(out.mean(-1), 0.5, atol=1e-5)
    np.testing.assert_allclose(out.std(-1), 2.0, rtol=1e-4)


def test_whole_pipeline_on_the_generated_weights(W):
    yy, xx = np.mgrid[0:300, 0:200]
    smooth = np.stack([xx * 255 // 199, yy * 255 // 299, (xx + yy) % 256], -1).astype(np.uint8)
    noisy = np.random.default_rng(9).integers(0, 256, (300, 200, 3), dtype=np.uint8)
    for img in (smooth, noisy):
        feats, pieces = sv.encode_image(W, img, "high")
        assert feats.shape == (13 * 16, 576) and feats.dtype == np.float32 and np.isfinite(feats).all()
        assert pieces.count(sv.IMAGE) == len(feats)
        rms = float(np.sqrt((feats ** 2).mean()))
        assert 0.05 < rms < 0.4                                   # near SmolLM2's embedding scale
        assert feats.std(0).mean() > 0.2 * rms                    # positions differ from each other
        per_tile = feats.reshape(13, 16, 576)
        assert np.abs(per_tile[0] - per_tile[5]).max() > 0.1 * rms
    enc = sv.vision_encoder(W, sv.preprocess(smooth, "low", W.preprocessor)[0])
    assert enc.shape == (1, 64, 128)
    np.testing.assert_allclose(enc.std(-1), 1.0, rtol=0.3)       # post-LN, gains near 1


# --- Prompt ------------------------------------------------------------------------------

def _processor_string(rows, cols, seq):
    """Idefics3Processor's expansion of one image, written out independently."""
    if rows == 0 and cols == 0:
        return "<fake_token_around_image><global-img>" + "<image>" * seq + "<fake_token_around_image>"
    text = ""
    for r in range(rows):
        for c in range(cols):
            text += f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>" + "<image>" * seq
        text += "\n"
    return text + "\n<fake_token_around_image><global-img>" + "<image>" * seq + "<fake_token_around_image>"


@pytest.mark.parametrize("rows,cols,seq", [(0, 0, 16), (4, 3, 16), (1, 1, 64), (2, 4, 64), (6, 6, 3)])
def test_prompt_tokens(rows, cols, seq):
    pieces = sv.prompt_tokens(rows, cols, seq)
    assert "".join(pieces) == _processor_string(rows, cols, seq)
    tiles = rows * cols + 1 if rows else 1
    assert pieces.count(sv.IMAGE) == tiles * seq
    assert pieces.count(sv.FAKE) == tiles + 1 and pieces.count(sv.GLOBAL) == 1
    specials = [p for p in pieces if p.startswith("<")]
    assert all(p in sv.ADDED_TOKENS for p in specials)
    text = [p for p in pieces if not p.startswith("<")]
    assert text == (["\n"] * (rows - 1) + ["\n\n"] if rows else [])
    assert len(pieces) == rows * cols * (seq + 2) + rows + seq + 3
