"""LoRA adapters packed for the kernels: read, mapped onto the base model's weights, checked.

A deployment registers adapters by id; a request picks some, each with its own strength,
and the kernels add their low-rank terms per row (opencl/lora.cl), so the shared weights
are never merged and one batch can mix selections. ``pack`` turns the registered files
into the tensors the package binds (models/sd/sd.loom's ``lora.*`` params):

    arrays, metadata = pack([("watercolor", "loras/watercolor.safetensors"), ...],
                            {name: shape for every base weight})
    arrays["lora." + weight]   float32 [R, K + N + 1], for each weight [N, K] (or a 1x1
                               convolution [N, K, 1, 1]) some adapter touches: row r is one
                               rank component, down[r, :K], then up[:, r] * alpha / rank,
                               then the index of its adapter; R = the sum of the touching
                               adapters' ranks, rows grouped by adapter in registration order
    metadata                   {"loras": [ids in order], "lora_rank": the largest R}

File layouts read (with Loom's own safetensors reader):

- kohya-ss: ``lora_unet_<module>`` / ``lora_te_<module>`` (the module path with "_" for
  "."), each with ``.lora_down.weight``, ``.lora_up.weight`` and optionally ``.alpha``;
  the module is found by spelling every base weight's name that way (as diffusers'
  converter does), not by guessing where the dots were.
- diffusers / PEFT: ``<module>.lora_A.weight`` / ``.lora_B.weight`` (or ``.lora.down`` /
  ``.lora.up``, ``.lora_down`` / ``.lora_up``, ``.lora_linear_layer.down`` / ``.up``, the
  attention processors' ``processor.to_q_lora.down``...), module names with an optional
  ``base_model.model.`` prefix, ``unet.`` / ``text_encoder.`` / ``text_model.`` (the text
  encoder) or none (the UNet).

A weight's alpha: its ``.alpha`` tensor (kohya's, or ``<module>.alpha``), else the
``lora_adapter_metadata`` JSON diffusers writes (``unet.lora_alpha``, overridden by an
``unet.alpha_pattern`` of literal module names; ``unet.use_rslora`` divides by sqrt(rank)
instead of the rank), else the rank (scale 1).

Only what the package applies is accepted (``TARGETS``: the CLIP text encoder's attention
and MLP projections, the spatial transformers' proj_in/out, attention and feed-forward
projections); anything else fails the registration with a LoraError naming the adapter and
the key: a weight the package applies no LoRA to (its term would silently be dropped), a 3x3
convolution LoRA, LyCORIS/LoHa/LoKr/DoRA tensors, a key naming no weight of the model,
missing down or up, shapes that do not fit, non-float or non-finite values, a rank of 0,
duplicate ids. Standard library and numpy only; no device code.
"""
from __future__ import annotations

import json
import math
import os
import re

import numpy as np

from . import weights
from .errors import Problem

__all__ = ["LoraError", "TARGETS", "pack"]

# The projections models/sd/sd.loom gives a low-rank term (kohya's default LoRA targets:
# Transformer2DModel, CLIPAttention and CLIPMLP modules).
TARGETS = re.compile(
    r"unet\.(?:(?:down|up)_blocks\.\d+\.|mid_block\.)attentions\.\d+\.(?:proj_in|proj_out|transformer_blocks\.0\."
    r"(?:attn[12]\.(?:to_q|to_k|to_v|to_out\.0)|ff\.net\.0\.proj|ff\.net\.2))\.weight"
    r"|text_encoder\.text_model\.encoder\.layers\.\d+\.(?:self_attn\.(?:q|k|v|out)_proj|mlp\.fc[12])\.weight")

KOHYA_PREFIXES = {"lora_unet_": "unet.", "lora_te_": "text_encoder."}
KOHYA_LEAVES = {"lora_down.weight": "down", "lora_up.weight": "up", "alpha": "alpha"}
PEFT_SUFFIXES = ((".lora_A.weight", "down"), (".lora_B.weight", "up"), (".lora.down.weight", "down"),
                 (".lora.up.weight", "up"), (".lora_linear_layer.down.weight", "down"),
                 (".lora_linear_layer.up.weight", "up"), (".lora_down.weight", "down"), (".lora_up.weight", "up"),
                 (".alpha", "alpha"))
# diffusers' old attention-processor files: attn1.processor.to_q_lora.down.weight
PROCESSORS = {"processor.to_q_lora": "to_q", "processor.to_k_lora": "to_k", "processor.to_v_lora": "to_v",
              "processor.to_out_lora": "to_out.0"}
FLOATS = ("F32", "F16", "BF16", "F64")
INTEGERS = ("I64", "I32", "I16", "I8", "U8")      # a kohya alpha saved from an int network_alpha


class LoraError(Problem):
    """An adapter that cannot be registered; ``adapter`` and ``key`` name what was at fault."""

    code = "invalid_adapter"

    def __init__(self, message, adapter=None, key=None, code=None, param=None):
        super().__init__(message, code, param)
        self.adapter = adapter
        self.key = key


def pack(entries, shapes, targets=TARGETS):
    """(adapter id, .safetensors path) in registration order, the base weights' shapes
    -> (arrays, metadata) as the module docstring describes."""
    ids = []
    for entry in entries:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str) and entry[0]):
            raise LoraError(f"an adapter entry must be (id, path) with a non-empty string id, got {entry!r}")
        if entry[0] in ids:
            raise LoraError(f"adapter {entry[0]!r} is registered twice", entry[0])
        ids.append(entry[0])
    shapes = {name: tuple(shape) for name, shape in shapes.items()}
    kohya = _kohya_names(shapes)
    adapters = [_read(adapter, path, shapes, kohya, targets) for adapter, path in entries]
    arrays, rank = {}, 0
    for name in shapes:
        rows = []
        for index, adapter in enumerate(adapters):
            if name in adapter:
                down, up = adapter[name]
                rows.append(np.concatenate([down, up.T, np.full((len(down), 1), index, np.float32)], axis=1))
        if rows:
            arrays["lora." + name] = np.concatenate(rows).astype(np.float32)
            rank = max(rank, len(arrays["lora." + name]))
    return arrays, {"loras": ids, "lora_rank": rank}


def _kohya_names(shapes):
    """kohya module key ("lora_unet_down_blocks_0_..._to_q") -> base weight name, spelled from
    the base names; a spelling two weights share maps to None (ambiguous)."""
    out = {}
    for name in shapes:
        if not name.endswith(".weight"):
            continue
        for theirs, ours in KOHYA_PREFIXES.items():
            if name.startswith(ours):
                key = theirs + name[len(ours):-len(".weight")].replace(".", "_")
                out[key] = None if key in out else name
    return out


def _peft_module(key):
    """A diffusers/PEFT key -> (base weight name, "down" | "up" | "alpha"), or None."""
    for old, new in PROCESSORS.items():
        key = key.replace(f".{old}.", f".{new}.lora.")
    for suffix, side in PEFT_SUFFIXES:
        if key.endswith(suffix) and len(key) > len(suffix):
            module = key[:-len(suffix)].removeprefix("base_model.model.")
            if module.startswith("text_model."):
                module = "text_encoder." + module
            elif not module.startswith(("unet.", "text_encoder.")):
                module = "unet." + module           # raw PEFT and processor files name UNet modules bare
            return module + ".weight", side
    return None


def _read(adapter, path, shapes, kohya, targets):
    """One adapter file -> {base weight name: (down [r, K], up [N, r] * alpha / rank)}."""
    def fail(message, key=None):
        where = f"adapter {adapter!r}" + (f": tensor {key!r}" if key is not None else "")
        return LoraError(f"{where}: {message}", adapter, key)

    if not str(path).lower().endswith(".safetensors"):
        raise fail(f"{path} is not a .safetensors file")
    try:
        checkpoint = weights.open_checkpoint(os.fspath(path))
    except weights.WeightsError as e:
        raise fail(e.message) from None
    except OSError as e:
        raise fail(f"cannot read {path}: {e.strerror or e}") from None
    with checkpoint:
        config = _adapter_config(checkpoint.metadata.get("__metadata__", {}), fail)
        parts, keys = {}, {}
        for key, info in checkpoint.tensors.items():
            name, side = _locate(key, kohya, fail)
            if name not in shapes:
                raise fail(f"names no weight of this model ({name!r})", key)
            if side in parts.setdefault(name, {}):
                raise fail(f"gives the {side} of {name!r} again (also {keys[(name, side)]!r})", key)
            allowed = FLOATS + INTEGERS if side == "alpha" else FLOATS
            if info.dtype not in allowed:
                raise fail(f"is {info.dtype}; LoRA factors must be floating point", key)
            with np.errstate(over="ignore", invalid="ignore"):    # F64 beyond float32: refused below
                value = checkpoint.dequantize(key).astype(np.float32)
            if not np.isfinite(value).all():
                raise fail("holds NaN or infinity", key)
            parts[name][side], keys[(name, side)] = value, key
    if not parts:
        raise fail(f"{path} holds no LoRA tensors")
    factors = {}
    for name, part in parts.items():
        factors[name] = _factors(name, part, shapes[name], config, keys, fail)
        # after the shape checks, so a 3x3 convolution LoRA is reported as one
        if targets is not None and not targets.fullmatch(name):
            raise fail(f"targets {name!r}, which this model applies no LoRA to (its term would be dropped)",
                       keys[(name, "down")])
    return factors


def _locate(key, kohya, fail):
    """A tensor key -> (base weight name, "down" | "up" | "alpha"), by its layout."""
    module, _, leaf = key.partition(".")
    if module.startswith(tuple(KOHYA_PREFIXES)):
        if module not in kohya:
            raise fail("names no weight of this model", key)
        if kohya[module] is None:
            raise fail("is ambiguous: two weights of this model share its kohya name", key)
        if leaf not in KOHYA_LEAVES:
            raise fail("is not plain LoRA (lora_down, lora_up, alpha); LyCORIS/LoHa/LoKr/DoRA tensors "
                       "are not supported", key)
        return kohya[module], KOHYA_LEAVES[leaf]
    found = _peft_module(key)
    if found is None:
        raise fail("is not a LoRA factor Loom reads (kohya lora_down/lora_up/alpha, diffusers/PEFT "
                   "lora_A/lora_B or lora.down/lora.up)", key)
    return found


def _adapter_config(metadata, fail):
    """The lora_adapter_metadata JSON (diffusers' PEFT config per component), checked."""
    text = metadata.get("lora_adapter_metadata")
    if text is None:
        return {}
    try:
        config = json.loads(text)
    except ValueError as e:
        raise fail(f"lora_adapter_metadata is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise fail("lora_adapter_metadata must be a JSON object")
    return config


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _alpha(name, part, rank, config, keys, fail):
    """(alpha, rank divisor) for one weight: its alpha tensor, the component's metadata, or the rank."""
    if "alpha" in part:
        if part["alpha"].size != 1:
            raise fail(f"an alpha must be one number, got shape {list(part['alpha'].shape)}", keys[(name, "alpha")])
        return float(part["alpha"].reshape(())), rank
    comp, module = name.split(".", 1)
    module = module[:-len(".weight")]
    alpha = config.get(f"{comp}.lora_alpha", rank)
    pattern = config.get(f"{comp}.alpha_pattern") or {}
    if not isinstance(pattern, dict):
        raise fail(f"lora_adapter_metadata {comp}.alpha_pattern must be an object")
    for literal, value in pattern.items():
        if not re.fullmatch(r"[A-Za-z0-9_.]+", literal):
            raise fail(f"lora_adapter_metadata {comp}.alpha_pattern key {literal!r}: only literal module names "
                       f"are supported")
        if module == literal or module.endswith("." + literal):
            alpha = value
            break
    if not _number(alpha):
        raise fail(f"lora_adapter_metadata {comp}.lora_alpha for {name!r} must be a finite number, got {alpha!r}")
    rslora = config.get(f"{comp}.use_rslora", False)
    if not isinstance(rslora, bool):
        raise fail(f"lora_adapter_metadata {comp}.use_rslora must be true or false")
    return float(alpha), math.sqrt(rank) if rslora else rank


def _factors(name, part, shape, config, keys, fail):
    """down [r, K] and up [N, r] scaled by alpha / rank, checked against the weight [N, K(, 1, 1)]."""
    key = keys.get((name, "down"), keys.get((name, "up"), keys.get((name, "alpha"))))
    if "down" not in part or "up" not in part:
        missing = "down" if "down" not in part else "up"
        raise fail(f"the LoRA of {name!r} has no {missing} factor", key)
    if len(shape) == 4 and shape[2:] != (1, 1):
        raise fail(f"{name!r} is a {shape[2]}x{shape[3]} convolution; LoRA is supported on linear layers and "
                   f"1x1 convolutions only", key)
    if len(shape) not in (2, 4):
        raise fail(f"{name!r} has shape {list(shape)}; LoRA is supported on linear layers and 1x1 "
                   f"convolutions only", key)
    n, k = shape[:2]
    down, up = part["down"], part["up"]
    for side, a in (("down", down), ("up", up)):
        if a.ndim == 4 and a.shape[2:] != (1, 1):
            raise fail(f"is a {a.shape[2]}x{a.shape[3]} convolution LoRA factor; only linear and 1x1 "
                       f"factors are supported", keys[(name, side)])
        if a.ndim not in (2, 4):
            raise fail(f"has shape {list(a.shape)}; a LoRA factor is [rank, in] (down) or [out, rank] (up)",
                       keys[(name, side)])
    down, up = down.reshape(down.shape[:2]), up.reshape(up.shape[:2])
    rank = down.shape[0]
    if rank == 0:
        raise fail("has rank 0", keys[(name, "down")])
    if down.shape != (rank, k) or up.shape != (n, rank):
        raise fail(f"down {list(down.shape)} and up {list(up.shape)} do not fit {name!r} {list(shape)} "
                   f"(down [rank, {k}], up [{n}, rank])", keys[(name, "down")])
    alpha, divisor = _alpha(name, part, rank, config, keys, fail)
    with np.errstate(over="ignore"):         # overflow is refused just below, not warned about
        up = (up * np.float32(alpha / divisor)).astype(np.float32)
    if not np.isfinite(up).all():
        raise fail(f"up * alpha / rank overflows float32 (alpha {alpha:g})", keys[(name, "up")])
    return np.ascontiguousarray(down, np.float32), up
