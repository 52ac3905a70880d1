"""Write the tests' tiny text checkpoint: a Qwen2-shaped model with deterministic
random weights and a byte-level BPE tokenizer (tokenizer.json).

It serves the text API's shapes (framing, streaming, tools, limits), not
meaningful answers: the serving tests run `scout` on it (tests/conftest.py,
tiny_scout_dir), where the default catalog runs SmolLM2. By hand:

    python models/llama/make_checkpoint.py OUT_DIR
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from loom.tokenizer import _bytes_to_unicode  # noqa: E402
from loom.weights import write_safetensors  # noqa: E402

CONFIG = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
SEED = 2026


def tokenizer():
    """Byte-level BPE without merges: every byte is a token, then the chat specials."""
    vocab = {c: i for i, c in enumerate(_bytes_to_unicode())}
    added = [{"id": 256 + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(SPECIALS)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": byte_level, "post_processor": None, "decoder": dict(byte_level, add_prefix_space=True),
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "vocab": vocab, "merges": []}}


def tensors():
    s, v = CONFIG, 256 + len(SPECIALS)
    d, dh = s["hidden_size"], s["hidden_size"] // s["num_attention_heads"]
    heads, kv_heads, ffn = s["num_attention_heads"], s["num_key_value_heads"], s["intermediate_size"]
    rng = np.random.default_rng(SEED)

    def m(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    # An untied head whose printable-ASCII rows dominate: random weights then babble
    # readable characters instead of stray bytes that decode to U+FFFD.
    head = m(v, d) * 0.05
    head[32:127] *= 60.0
    out = {"model.embed_tokens.weight": m(v, d), "model.norm.weight": np.ones(d, np.float32), "lm_head.weight": head}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": np.ones(d, np.float32),
            p + "self_attn.q_proj.weight": m(heads * dh, d),
            p + "self_attn.k_proj.weight": m(kv_heads * dh, d),
            p + "self_attn.v_proj.weight": m(kv_heads * dh, d),
            p + "self_attn.o_proj.weight": m(d, heads * dh),
            p + "post_attention_layernorm.weight": np.ones(d, np.float32),
            p + "mlp.gate_proj.weight": m(ffn, d),
            p + "mlp.up_proj.weight": m(ffn, d),
            p + "mlp.down_proj.weight": m(d, ffn)})
    return out


def make(folder):
    """Write model.safetensors, config.json and tokenizer.json into `folder` (created)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(tokenizer(), f)
    write_safetensors(os.path.join(folder, "model.safetensors"), tensors())
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(CONFIG, model_type="qwen2", vocab_size=256 + len(SPECIALS), tie_word_embeddings=False), f)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    make(sys.argv[1])
    print(f"wrote {sys.argv[1]}")
