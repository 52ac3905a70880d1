"""Generate the default catalog's stand-in SmolVLM vision tower and connector.

No vision-language weights install offline, so `scout`'s image component runs a small
SmolVLM-layout (HF Idefics3) vision tower and connector drawn from a seeded numpy Generator, in
front of the real SmolLM2-135M-Instruct decoder (text hidden size 576). The weights are random:
the architecture, shapes, preprocessing and prompt expansion are SmolVLM's, the answers about
images are not meaningful. Real SmolVLM-256M/500M folders have the same file layout and names.

Written into OUT_DIR (same seed -> byte-identical files):

    model.safetensors         vision + connector tensors only, HF names, float32
    config.json               SmolVLM's format (vision_config, scale_factor, text_config, image_token_id)
    preprocessor_config.json  Idefics3ImageProcessor settings (tile 128, resize target 512, mean/std 0.5)
    processor_config.json     image_seq_len
    added_tokens.json         the placeholder tokens' ids in SmolVLM's tokenizer

Sizes: 128 x 128 tiles of 16 x 16 patches (64 per tile), hidden 128, 4 heads, MLP 512, 2 layers,
pixel shuffle 2 -> 16 positions per tile, each a 512 -> 576 projection. Float32 because the
file is small (798k values, 3.2 MB) and the numpy reference and the device then read identical
values, with no rounding step between what was drawn and what runs; real SmolVLM checkpoints
are bfloat16.

Standard library and numpy only: this runs at server start.

    python models/smolvlm/generate.py OUT_DIR [SEED]
"""
import json
import os
import struct
import sys

import numpy as np

TILE, PATCH, HIDDEN, HEADS, FFN, LAYERS, SCALE = 128, 16, 128, 4, 512, 2, 2
TEXT_HIDDEN = 576                   # SmolLM2-135M-Instruct's embedding width
LONGEST_EDGE = 4 * TILE             # as SmolVLM-256M's 4 x 512: at most 4 x 4 tiles
LAYER_NORM_EPS = 1e-6
# RMS of SmolLM2-135M-Instruct's token embeddings (Q8_0 token_embd, dequantized: 0.1356): the
# projection is scaled so image positions enter the decoder at the size its tokens have.
TEXT_EMBED_RMS = 0.136
SEQ = (TILE // PATCH) ** 2 // SCALE ** 2
ADDED_TOKENS = {"<global-img>": 49152,
                **{f"<row_{r}_col_{c}>": 49153 + (r - 1) * 6 + (c - 1) for r in range(1, 7) for c in range(1, 7)},
                "<fake_token_around_image>": 49189, "<image>": 49190, "<end_of_utterance>": 49279}


def config(seed=0, text_hidden=TEXT_HIDDEN):
    return {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": ADDED_TOKENS["<image>"],
        "scale_factor": SCALE,
        "tie_word_embeddings": True,
        "vision_config": {"model_type": "idefics3_vision", "hidden_size": HIDDEN, "intermediate_size": FFN,
                          "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_channels": 3,
                          "patch_size": PATCH, "image_size": TILE, "hidden_act": "gelu_pytorch_tanh",
                          "layer_norm_eps": LAYER_NORM_EPS},
        "text_config": {"model_type": "llama", "hidden_size": text_hidden, "intermediate_size": 1536,
                        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                        "rope_theta": 100000.0, "tie_word_embeddings": True},
        "loom_generated": {"by": "models/smolvlm/generate.py", "seed": seed,
                           "note": "random vision weights in front of SmolLM2-135M-Instruct: "
                                   "answers about images are not meaningful"},
    }


def preprocessor_config():
    return {"image_processor_type": "Idefics3ImageProcessor", "processor_class": "Idefics3Processor",
            "do_convert_rgb": True, "do_resize": True, "size": {"longest_edge": LONGEST_EDGE},
            "resample": 1, "do_image_splitting": True, "max_image_size": {"longest_edge": TILE},
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pad": True}


def tensors(seed=0, text_hidden=TEXT_HIDDEN):
    """{HF name: float32 array}, drawn in a fixed order from default_rng(seed). Matrices have
    1/sqrt(fan_in) deviations (activations keep unit scale), LayerNorm gains 1 +- 0.1, small
    biases, positions 0.3, the projection TEXT_EMBED_RMS / sqrt(fan_in)."""
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(name):
        out[name + ".weight"] = 1.0 + normal((HIDDEN,), 0.1)
        out[name + ".bias"] = normal((HIDDEN,), 0.05)

    def dense(name, rows, cols):
        out[name + ".weight"] = normal((rows, cols), cols ** -0.5)
        out[name + ".bias"] = normal((rows,), 0.02)

    v, out = "model.vision_model.", {}
    fan_in = 3 * PATCH * PATCH
    out[v + "embeddings.patch_embedding.weight"] = normal((HIDDEN, 3, PATCH, PATCH), fan_in ** -0.5)
    out[v + "embeddings.patch_embedding.bias"] = normal((HIDDEN,), 0.02)
    out[v + "embeddings.position_embedding.weight"] = normal(((TILE // PATCH) ** 2, HIDDEN), 0.3)
    for i in range(LAYERS):
        layer = f"{v}encoder.layers.{i}."
        norm(layer + "layer_norm1")
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            dense(layer + "self_attn." + proj, HIDDEN, HIDDEN)
        norm(layer + "layer_norm2")
        dense(layer + "mlp.fc1", FFN, HIDDEN)
        dense(layer + "mlp.fc2", HIDDEN, FFN)
    norm(v + "post_layernorm")
    shuffled = HIDDEN * SCALE * SCALE
    out["model.connector.modality_projection.proj.weight"] = normal((text_hidden, shuffled),
                                                                    TEXT_EMBED_RMS * shuffled ** -0.5)
    return out


def safetensors_bytes(arrays, metadata):
    """A safetensors file: names sorted, data in that order, little-endian float32, the JSON
    header compact and space-padded to 8 bytes (fixed bytes for fixed input)."""
    header, blobs, offset = {"__metadata__": dict(metadata)}, [], 0
    for name in sorted(arrays):
        data = np.ascontiguousarray(arrays[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arrays[name].shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def _write(path, data):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)           # never a half-written file under the real name


def _json_bytes(obj):
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def generate(out_dir, seed=0, text_hidden=TEXT_HIDDEN):
    """Write the five files into `out_dir` (created); returns out_dir. `text_hidden`: the
    decoder's embedding width the projection targets (the tests' tiny text model: 128)."""
    os.makedirs(out_dir, exist_ok=True)
    meta = {"format": "pt", "generator": "loom models/smolvlm/generate.py", "seed": str(seed)}
    _write(os.path.join(out_dir, "model.safetensors"), safetensors_bytes(tensors(seed, text_hidden), meta))
    _write(os.path.join(out_dir, "config.json"), _json_bytes(config(seed, text_hidden)))
    _write(os.path.join(out_dir, "preprocessor_config.json"), _json_bytes(preprocessor_config()))
    _write(os.path.join(out_dir, "processor_config.json"),
           _json_bytes({"image_seq_len": SEQ, "processor_class": "Idefics3Processor"}))
    _write(os.path.join(out_dir, "added_tokens.json"), _json_bytes(ADDED_TOKENS))
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    generate(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else 0)
