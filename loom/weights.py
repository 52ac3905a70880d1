"""Checkpoint readers: GGUF, safetensors, CTranslate2, ONNX and diffusers pipeline folders,
memory-mapped and validated.

``open_checkpoint(path)`` takes a ``.gguf`` file, a ``.safetensors`` file, a
sharded ``model.safetensors.index.json``, a CTranslate2 ``model.bin``, an
``.onnx`` model (its initializers and graph, read by a hand-written protobuf
decoder), or a directory holding exactly one of those, and returns a ``Checkpoint``:
metadata, a table of ``TensorInfo`` in file order, and zero-copy access to
every tensor's bytes. A directory holding ``model_index.json`` is a diffusers
pipeline (Stable Diffusion): its text_encoder, unet and vae safetensors are read
through the same safetensors reader, their tensors named ``<component>.<name>``.

Checkpoint files are untrusted input. Every header is parsed through a cursor
that checks each read against the file size first, and every count or length
a file states is checked against the bytes that remain before anything is
allocated or looped over, so a lying file is rejected in time proportional to
what it actually contains. Every problem is a ``WeightsError`` whose message
names the file and says what was expected where.

Tensor dtypes: F32, F16, BF16 (every format), I8/I16/I32 (safetensors and
CTranslate2 buffers, never weights by default) and ggml's block formats
(GGUF): Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 (32 values a block), and the K-quants
Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (256-value superblocks of 16- or 32-value
sub-blocks with their own quantized scales), the types llama.cpp writes for
its Q2_K ... Q6_K files (rows not a multiple of 256 fall back to Q4_0, Q5_0,
Q5_1 or Q8_0 there). ``dequantize_blocks`` decodes all of them, vectorized in
numpy. ``quantize`` writes Q8_0 and Q4_0 as ggml's reference quantizers do
(byte for byte), and the five K-quants with a simple direct quantizer (valid
blocks, rounded to nearest, not llama.cpp's search for the best scales).

ONNX: initializers in raw_data (what exporters write) and in one packed
float_data/double_data run are zero-copy views of the file; ones stored as
varints (int32_data, int64_data: small tensors from onnx.helper.make_tensor)
or as scattered elements are decoded once into an anonymous mapping. Types
FLOAT, FLOAT16, BFLOAT16, DOUBLE, INT64, INT32, INT16, INT8 and UINT8; others,
external data, segments and sparse initializers are rejected by name.

Runtime dependencies: the standard library and numpy only.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from . import open_regular

__all__ = [
    "WeightsError", "TensorInfo", "Checkpoint", "open_checkpoint",
    "dequantize_blocks", "quantize", "BLOCK_LAYOUT", "SCALE_FIELDS", "write_safetensors",
]


class WeightsError(ValueError):
    """A checkpoint that cannot be read; ``message`` names the file and the problem.
    ``public``, when set, says it without any byte or value the file holds (the path, a
    position, what was expected): what a server repeats about its own files
    (errors.withhold)."""

    def __init__(self, message: str, public: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.message = message
        self.public = public
        self.detail = detail        # public without its path, to tell it of another (_shown_as)


def _fail(path: str, detail: str, public: str | None = None) -> WeightsError:
    return WeightsError(f"{path}: {detail}", f"{path}: {public}" if public else None, public)


def _shown_as(error: WeightsError, shown: str) -> WeightsError:
    """`error` told of `shown`, the path its caller named, rather than of a file found through
    the checkpoint's own bytes (a shard an index names, a directory's entry), whose name is
    itself something the server read."""
    error.public = f"{shown}: {error.detail}" if error.detail else None
    return error


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str          # "F32" | "F16" | "BF16" | a block format of BLOCK_LAYOUT ("Q8_0", "Q4_K", ...)
    shape: tuple        # row-major (numpy order)
    offset: int         # absolute byte offset in its file
    nbytes: int
    file: str           # which file holds the bytes (matters for shards)


# --- Tensor encodings ---------------------------------------------------------

# dtype -> (values per block, bytes per block); plain dtypes are 1-value blocks.
BLOCK_LAYOUT = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18),
                "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
                "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
# Byte offsets of each block's f16 fields (scales d, minimums); every other byte is quant bits or
# integer sub-block scales, any value of which decodes to a finite number.
SCALE_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
                "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# Plain numeric safetensors dtypes that are readable but never weights by default:
# real checkpoints carry buffers like BERT's int64 position_ids beside the weights.
_NUMERIC = {"F64": "<f8", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1"}
_QUANTIZED = ("Q8_0", "Q4_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_INT64_MAX = 2**63 - 1


def _nbytes(dtype: str, count: int) -> int:
    values, size = BLOCK_LAYOUT[dtype]
    return count // values * size


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    # bfloat16 is the top half of a float32.
    return (bits.astype(np.uint32) << 16).view(np.float32)


# K-quants: a 256-value superblock is eight 32-value chunks; chunk j holds values 32j .. 32j + 31.
# Quant bits lie in bit planes: `groups` equal runs of bytes, and in each run byte i holds value i
# of 8 / width consecutive chunks, the first chunk in the lowest bits. Q2_K's 2-bit quants (and
# Q3_K's low bits, Q6_K's high bits) are 2 runs of 32 bytes at width 2; Q3_K's and Q5_K's one high
# bit a value, 1 run of 32 at width 1; Q4_K's and Q5_K's nibbles, 4 runs of 32 at width 4;
# Q6_K's low nibbles, 2 runs of 64 at width 4.

def _unpack_bits(plane: np.ndarray, groups: int, width: int) -> np.ndarray:
    """A bit plane (blocks, bytes) -> its fields in value order, (blocks, 256) uint8."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)[:, None]
    return ((plane.reshape(len(plane), groups, 1, -1) >> shifts) & ((1 << width) - 1)).reshape(len(plane), 256)


def _pack_bits(fields: np.ndarray, groups: int, width: int) -> np.ndarray:
    """The inverse of _unpack_bits: (blocks, 256) values below 2**width -> (blocks, bytes) uint8."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)[:, None]
    runs = fields.astype(np.uint8).reshape(len(fields), groups, 8 // width, -1) << shifts
    return np.bitwise_or.reduce(runs, axis=2).reshape(len(fields), -1)


def _unpack_scale_min(packed: np.ndarray):
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit minimums, (blocks, 8) each.
    Bytes 0-3 and 4-7 hold scales 0-3 and minimums 0-3 in their low 6 bits and the top 2 bits
    of scales/minimums 4-7 in their top 2; bytes 8-11 the low nibbles of scale and minimum 4-7."""
    sc_lo, m_lo, mix = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([sc_lo & 63, (mix & 15) | (sc_lo >> 6) << 4], axis=1)
    m = np.concatenate([m_lo & 63, (mix >> 4) | (m_lo >> 6) << 4], axis=1)
    return sc, m


def _pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The inverse of _unpack_scale_min: (blocks, 8) values in 0..63 each -> (blocks, 12) bytes."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    return np.concatenate([(sc[:, :4] & 63) | (sc[:, 4:] >> 4) << 6, (m[:, :4] & 63) | (m[:, 4:] >> 4) << 6,
                           (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=1)


def _unpack_q3_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes -> sixteen signed 6-bit scales (stored + 32): scale i has its low nibble in
    byte i % 8 (low nibble for i < 8, high for i >= 8) and its top 2 bits at bit 2(i//4) of byte 8 + i % 4."""
    low = np.concatenate([packed[:, :8] & 15, packed[:, :8] >> 4], axis=1)
    high = ((packed[:, None, 8:12] >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]) & 3).reshape(-1, 16)
    return (low | high << 4).astype(np.int8) - np.int8(32)


def _pack_q3_scales(scales: np.ndarray) -> np.ndarray:
    """The inverse of _unpack_q3_scales: (blocks, 16) values in -32..31 -> (blocks, 12) bytes."""
    u = (scales.astype(np.int16) + 32).astype(np.uint8)
    low = (u[:, :8] & 15) | (u[:, 8:] & 15) << 4
    top = (u >> 4).reshape(-1, 4, 4) << np.arange(0, 8, 2, dtype=np.uint8)[:, None]
    return np.concatenate([low, np.bitwise_or.reduce(top, axis=1)], axis=1)


def _f16_field(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 field at byte `at` of every block, as float32 (blocks, 1)."""
    return blocks[:, at:at + 2].copy().view("<f2").astype(np.float32)


def _dequantize_k(blocks: np.ndarray, dtype: str) -> np.ndarray:
    """K-quant superblocks (blocks, block bytes) -> float32 values, with ggml's arithmetic order."""
    with np.errstate(invalid="ignore"):   # an infinite scale times a zero quant is NaN, as in ggml
        if dtype == "Q2_K":     # scales[16] (scale | min << 4 per 16 values), qs[64], d, dmin
            sc = blocks[:, :16].astype(np.float32)
            dl = np.repeat(_f16_field(blocks, 80) * (sc % 16), 16, axis=1)
            ml = np.repeat(_f16_field(blocks, 82) * (sc // 16), 16, axis=1)
            return (dl * _unpack_bits(blocks[:, 16:80], 2, 2) - ml).reshape(-1)
        if dtype == "Q3_K":     # hmask[32], qs[64], scales[12], d: (low 2 bits - (hmask bit ? 0 : 4)) * scale
            dl = np.repeat(_f16_field(blocks, 108) * _unpack_q3_scales(blocks[:, 96:108]), 16, axis=1)
            high = _unpack_bits(blocks[:, :32], 1, 1)
            q = _unpack_bits(blocks[:, 32:96], 2, 2).astype(np.int8) - ((1 - high) << 2).astype(np.int8)
            return (dl * q).reshape(-1)
        if dtype in ("Q4_K", "Q5_K"):   # d, dmin, scales[12], (Q5_K: qh[32]), qs[128]: q * d*sc - dmin*m
            sc, m = _unpack_scale_min(blocks[:, 4:16])
            dl = np.repeat(_f16_field(blocks, 0) * sc, 32, axis=1)
            ml = np.repeat(_f16_field(blocks, 2) * m, 32, axis=1)
            q = _unpack_bits(blocks[:, 16:144], 4, 4) if dtype == "Q4_K" else \
                _unpack_bits(blocks[:, 48:176], 4, 4) | _unpack_bits(blocks[:, 16:48], 1, 1) << 4
            return (dl * q - ml).reshape(-1)
        # Q6_K: ql[128], qh[64], scales[16] (int8), d: (low nibble | 2 high bits << 4) - 32
        dl = np.repeat(_f16_field(blocks, 208) * blocks[:, 192:208].view(np.int8), 16, axis=1)
        q = (_unpack_bits(blocks[:, :128], 2, 4) | _unpack_bits(blocks[:, 128:192], 2, 2) << 4).astype(np.int8) - 32
        return (dl * q).reshape(-1)


def dequantize_blocks(raw, dtype: str, count: int) -> np.ndarray:
    """Decode ``count`` values stored as ``dtype`` in ``raw`` to a float32 vector."""
    if dtype not in BLOCK_LAYOUT:
        raise WeightsError(f"dequantize_blocks: unknown dtype {dtype!r}; known: {', '.join(BLOCK_LAYOUT)}")
    values, block_bytes = BLOCK_LAYOUT[dtype]
    if not isinstance(count, int) or count < 0 or count % values:
        raise WeightsError(f"dequantize_blocks: {dtype} count must be a non-negative multiple of {values}, "
                           f"got {count!r}")
    if isinstance(raw, np.ndarray):
        data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    else:
        data = np.frombuffer(raw, np.uint8)
    if data.size != _nbytes(dtype, count):
        raise WeightsError(f"dequantize_blocks: {count} {dtype} values take {_nbytes(dtype, count)} bytes, "
                           f"got {data.size}")
    if dtype == "F32":
        return data.view("<f4").astype(np.float32)
    if dtype == "F16":
        return data.view("<f2").astype(np.float32)
    if dtype == "BF16":
        return _bf16_to_f32(data.view("<u2"))
    blocks = data.reshape(-1, block_bytes)
    if values == 256:
        return _dequantize_k(blocks, dtype)
    scale = blocks[:, :2].view("<f2").astype(np.float32)          # (blocks, 1)
    if dtype in ("Q5_0", "Q5_1"):   # d (Q5_1: then m), 32 high bits, Q4_0's nibbles; element e takes bit e
        at = 2 if dtype == "Q5_0" else 4
        high = blocks[:, at:at + 4].copy().view("<u4")                    # (blocks, 1)
        packed = blocks[:, at + 4:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.uint32)
        q |= ((high >> np.arange(32, dtype=np.uint32)) & 1) << 4
        with np.errstate(invalid="ignore"):
            if dtype == "Q5_0":
                return ((q.astype(np.float32) - 16) * scale).reshape(-1)
            return (q.astype(np.float32) * scale + blocks[:, 2:4].view("<f2").astype(np.float32)).reshape(-1)
    if dtype == "Q4_1":   # d, then the block minimum m, then Q4_0's nibble order: q * d + m
        low = blocks[:, 2:4].view("<f2").astype(np.float32)
        packed = blocks[:, 4:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
        with np.errstate(invalid="ignore"):
            return (q * scale + low).reshape(-1)
    if dtype == "Q8_0":
        q = blocks[:, 2:].view(np.int8)
    else:  # Q4_0: byte j holds element j (low nibble) and element j + 16 (high nibble)
        packed = blocks[:, 2:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.int8) - np.int8(8)
    with np.errstate(invalid="ignore"):  # an infinite scale times a zero quant is NaN, as in ggml
        return (q.astype(np.float32) * scale).reshape(-1)


def _inverse(d: np.ndarray) -> np.ndarray:
    # ggml's `id = d ? 1/d : 0`. Where 1/d overflows (d is subnormal, so its f16
    # copy is zero anyway) ggml's cast is undefined; 0 keeps the quants defined.
    with np.errstate(over="ignore"):
        inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    inv[~np.isfinite(inv)] = 0
    return inv


def _f16_scale(x: np.ndarray, dtype: str) -> np.ndarray:
    """A block scale as stored (f16), back in float32; one that f16 cannot hold is an error."""
    with np.errstate(over="ignore"):
        half = x.astype(np.float16)
    if not np.isfinite(half).all():
        raise WeightsError(f"quantize: values too large for {dtype}: a block scale exceeds float16")
    return half.astype(np.float32)


def _quantize_affine(x: np.ndarray, nmax: int, smax: int, dtype: str):
    """Sub-blocks x (blocks, n, size) as q * d*sc - dmin*m (Q2_K, Q4_K, Q5_K): each sub-block's
    range [min(lo, 0), hi] split into nmax steps; its step and -min quantized to sc, m in 0..smax
    against the superblock's d, dmin. -> (d, dmin (blocks, 1) float32 of f16, sc, m (blocks, n), q)."""
    lo = np.minimum(x.min(axis=2), 0)
    step = (x.max(axis=2) - lo) / np.float32(nmax)
    d = _f16_scale(step.max(axis=1, keepdims=True) / np.float32(smax), dtype)
    dmin = _f16_scale(-lo.min(axis=1, keepdims=True) / np.float32(smax), dtype)
    sc = np.clip(np.rint(step * _inverse(d)), 0, smax)
    m = np.clip(np.rint(-lo * _inverse(dmin)), 0, smax)
    # quants against the scales as stored, so rounding the scales costs no more than a step
    q = np.clip(np.rint((x + (dmin * m)[..., None]) * _inverse(d * sc)[..., None]), 0, nmax)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.reshape(len(x), -1).astype(np.uint8)


def _quantize_symmetric(x: np.ndarray, qmin: int, smin: int, dtype: str):
    """Sub-blocks x (blocks, n, size) as q * d*sc (Q3_K, Q6_K): each sub-block's value of largest
    magnitude maps to qmin (the wider, negative end of [qmin, -qmin - 1], as in ggml), and the
    sub-block scale of largest magnitude to smin. -> (d (blocks, 1), sc (blocks, n) int, q + |qmin|)."""
    def signed_peak(a):
        return np.take_along_axis(a, np.abs(a).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    scale = signed_peak(x) / np.float32(qmin)
    d = _f16_scale(signed_peak(scale)[:, None] / np.float32(smin), dtype)
    sc = np.clip(np.rint(scale * _inverse(d)), smin, -smin - 1)
    q = np.clip(np.rint(x * _inverse(d * sc)[..., None]), qmin, -qmin - 1)
    return d, sc.astype(np.int16), (q - qmin).reshape(len(x), -1).astype(np.uint8)


def _quantize_k(blocks: np.ndarray, dtype: str) -> np.ndarray:
    """Superblocks (blocks, 256) float32 -> (blocks, block bytes) of dtype, in ggml's layouts."""
    def half(v):
        return v.astype("<f2").view(np.uint8)
    if dtype == "Q2_K":     # scales[16], qs[64], d, dmin
        d, dmin, sc, m, q = _quantize_affine(blocks.reshape(-1, 16, 16), 3, 15, dtype)
        parts = [sc | m << 4, _pack_bits(q, 2, 2), half(d), half(dmin)]
    elif dtype == "Q3_K":   # hmask[32], qs[64], scales[12], d
        d, sc, q = _quantize_symmetric(blocks.reshape(-1, 16, 16), -4, -32, dtype)
        parts = [_pack_bits(q >> 2, 1, 1), _pack_bits(q & 3, 2, 2), _pack_q3_scales(sc), half(d)]
    elif dtype in ("Q4_K", "Q5_K"):     # d, dmin, scales[12], (Q5_K: qh[32]), qs[128]
        d, dmin, sc, m, q = _quantize_affine(blocks.reshape(-1, 8, 32), 15 if dtype == "Q4_K" else 31, 63, dtype)
        high = [_pack_bits(q >> 4, 1, 1)] if dtype == "Q5_K" else []
        parts = [half(d), half(dmin), _pack_scale_min(sc, m), *high, _pack_bits(q & 15, 4, 4)]
    else:                   # Q6_K: ql[128], qh[64], scales[16] int8, d
        d, sc, q = _quantize_symmetric(blocks.reshape(-1, 16, 16), -32, -128, dtype)
        parts = [_pack_bits(q & 15, 2, 4), _pack_bits(q >> 4, 2, 2), sc.astype(np.int8).view(np.uint8), half(d)]
    return np.concatenate(parts, axis=1)


def quantize(values: np.ndarray, dtype: str) -> np.ndarray:
    """Float values -> uint8 blocks: Q8_0 and Q4_0 as ggml's reference quantizer writes them;
    Q2_K ... Q6_K by a direct quantizer (each sub-block's scale from its range, every scale
    and quant rounded to nearest; valid blocks, coarser than llama.cpp's search).

    The innermost axis (a multiple of the block size: 32, or 256 for the K-quants) becomes
    ``blocks * block_bytes`` bytes, so an (N, K) matrix gives (N, K // block * block_bytes),
    the layout ``Checkpoint.array`` returns for quantized tensors.
    """
    if dtype not in _QUANTIZED:
        raise WeightsError(f"quantize: dtype must be one of {', '.join(_QUANTIZED)}, got {dtype!r}")
    x = np.asarray(values, dtype=np.float32)
    size = BLOCK_LAYOUT[dtype][0]
    if x.ndim == 0 or x.shape[-1] % size:
        raise WeightsError(f"quantize: the innermost dimension must be a multiple of {size} for {dtype}, "
                           f"got shape {x.shape}")
    if not np.isfinite(x).all():
        raise WeightsError("quantize: values contain NaN or infinity")
    if size == 256:
        out = _quantize_k(x.reshape(-1, 256), dtype)
        return out.reshape(*x.shape[:-1], x.shape[-1] // 256 * BLOCK_LAYOUT[dtype][1])
    blocks = x.reshape(-1, 32)
    if dtype == "Q8_0":
        d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
        v = blocks * _inverse(d)
        a = np.abs(v)
        whole = np.floor(a)
        q = np.copysign(whole + (a - whole >= 0.5), v).astype(np.int8).view(np.uint8)  # C roundf: halves away from zero
    else:
        # The value of largest magnitude, sign kept (the first one on ties), maps to -8.
        peak = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
        d = peak / np.float32(-8)
        nibbles = np.minimum(np.float32(15), np.trunc(blocks * _inverse(d) + np.float32(8.5))).astype(np.uint8)
        q = nibbles[:, :16] | (nibbles[:, 16:] << np.uint8(4))
    out = np.concatenate([d.astype("<f2").view(np.uint8), q], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * BLOCK_LAYOUT[dtype][1])


# --- Files --------------------------------------------------------------------

def _map_file(path: str, minimum: int, what: str) -> mmap.mmap:
    """Memory-map a whole file read-only, refusing files too short to hold a header."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size < minimum:
                raise _fail(path, f"the file has {size} bytes; {what} needs at least {minimum}")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise _fail(path, f"cannot read: {e.strerror or e}", f"cannot read: {e.strerror or e}") from None


def _release(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:
        pass  # arrays or views still use it (or a traceback holds one); it unmaps when they go


def _unique_object(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def _strict_json(path: str, data: bytes, what: str):
    """Standard JSON, minus what lenient parsers accept: duplicate keys, NaN/Infinity."""
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_unique_object, parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise _fail(path, f"{what} is not valid UTF-8 (byte {e.start})") from None
    except (ValueError, RecursionError) as e:
        raise _fail(path, f"{what} is not valid JSON: {e}") from None


_MAX_JSON_FILE = 64 << 20   # index and config files: real ones are kilobytes


def _read_json_file(path: str, what: str):
    try:
        with open_regular(path) as f:
            data = f.read(_MAX_JSON_FILE + 1)
    except OSError as e:
        raise _fail(path, f"cannot read: {e.strerror or e}") from None
    if len(data) > _MAX_JSON_FILE:
        raise _fail(path, f"{what} is larger than {_MAX_JSON_FILE} bytes")
    return _strict_json(path, data, what)


class _Cursor:
    """Sequential little-endian reads from a mapped file; each checked before it happens."""

    def __init__(self, path: str, buf: mmap.mmap):
        self.path, self.buf, self.pos, self.size = path, buf, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise _fail(self.path, f"{what} needs bytes {self.pos}..{self.pos + n} but the file has {self.size} bytes")

    def unpack(self, fmt: str, what: str) -> tuple:
        size = struct.calcsize(fmt)
        self.need(size, what)
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values

    def string(self, what: str) -> str:
        (n,) = self.unpack("<Q", f"length of {what}")
        self.need(n, what)
        start, self.pos = self.pos, self.pos + n
        try:
            return self.buf[start:self.pos].decode("utf-8")
        except UnicodeDecodeError as e:
            raise _fail(self.path, f"{what} at bytes {start}..{self.pos} is not valid UTF-8 "
                                   f"(byte {start + e.start})") from None


def _check_layout(path: str, tensors: list[TensorInfo], size: int) -> None:
    """Every tensor inside the file, no two sharing a byte."""
    for t in tensors:
        if t.offset + t.nbytes > size:
            raise _fail(path, f"tensor {t.name!r} needs bytes {t.offset}..{t.offset + t.nbytes} "
                              f"but the file has {size} bytes")
    ordered = sorted(tensors, key=lambda t: (t.offset, t.nbytes))
    for a, b in zip(ordered, ordered[1:]):
        if b.offset < a.offset + a.nbytes:
            raise _fail(path, f"tensors {a.name!r} (bytes {a.offset}..{a.offset + a.nbytes}) and "
                              f"{b.name!r} (bytes {b.offset}..{b.offset + b.nbytes}) overlap")


# --- GGUF ---------------------------------------------------------------------

# ggml type ids, for naming the ones Loom rejects.
_GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
_GGML_SUPPORTED = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1",
                   10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}

# GGUF metadata value types: scalars by struct code; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
_GGUF_BOOL, _GGUF_STRING, _GGUF_ARRAY = 7, 8, 9
_GGUF_MIN_SIZE = {**{t: struct.calcsize(c) for t, c in _GGUF_SCALARS.items()}, _GGUF_STRING: 8, _GGUF_ARRAY: 12}
_GGUF_MAX_NESTING = 8           # arrays of arrays: real files use at most one level
_GGUF_HEADER = 24               # magic, version, tensor count, kv count
_GGUF_MIN_KV = 8 + 4 + 1        # key length, value type, smallest value
_GGUF_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8   # name length, n_dims, one dim, type, offset


def _gguf_value(cur: _Cursor, vtype: int, what: str, depth: int = 0):
    if vtype == _GGUF_STRING:
        return cur.string(what)
    if vtype in _GGUF_SCALARS:
        (value,) = cur.unpack("<" + _GGUF_SCALARS[vtype], what)
        if vtype == _GGUF_BOOL:
            if value > 1:
                raise _fail(cur.path, f"{what} is a bool stored as {value}; expected 0 or 1")
            return bool(value)
        return value
    if vtype != _GGUF_ARRAY:
        raise _fail(cur.path, f"{what} has unknown value type {vtype}")
    if depth == _GGUF_MAX_NESTING:
        raise _fail(cur.path, f"{what} nests arrays deeper than {_GGUF_MAX_NESTING} levels")
    etype, count = cur.unpack("<IQ", f"array header of {what}")
    if etype not in _GGUF_MIN_SIZE:
        raise _fail(cur.path, f"{what} is an array of unknown value type {etype}")
    # Bound the count by what the rest of the file could hold before touching it.
    cur.need(count * _GGUF_MIN_SIZE[etype], f"{what} ({count} array elements)")
    if etype in _GGUF_SCALARS:
        code = _GGUF_SCALARS[etype]
        items = np.frombuffer(cur.buf, np.dtype("<" + code), count, cur.pos)
        cur.pos += items.nbytes
        if etype == _GGUF_BOOL:
            if count and items.max() > 1:
                raise _fail(cur.path, f"{what} holds a bool stored as {items.max()}; expected 0 or 1")
            return items.astype(bool).tolist()
        return items.tolist()
    return [_gguf_value(cur, etype, f"{what}[{i}]", depth + 1) for i in range(count)]


def _read_gguf(path: str) -> Checkpoint:
    buf = _map_file(path, _GGUF_HEADER, "a GGUF header")
    try:
        cur = _Cursor(path, buf)
        magic = buf[:4]
        if magic != b"GGUF":
            raise _fail(path, f"not a GGUF file: magic is {magic!r}, expected b'GGUF'",
                        "bytes 0..4: expected the GGUF magic b'GGUF'")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in (1, 2, 3):
                raise _fail(path, f"big-endian GGUF (version {swapped}) is not supported; "
                                  f"Loom reads little-endian files")
            raise _fail(path, f"GGUF version {version} is not supported; Loom reads versions 2 and 3",
                        "bytes 4..8: expected GGUF version 2 or 3")
        cur.pos = _GGUF_HEADER
        cur.need(n_kv * _GGUF_MIN_KV, f"{n_kv} metadata entries")

        metadata = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key {i}")
            if key in metadata:
                raise _fail(path, f"duplicate metadata key {key!r}")
            (vtype,) = cur.unpack("<I", f"value type of metadata {key!r}")
            metadata[key] = _gguf_value(cur, vtype, f"metadata {key!r}")
            if key == "general.alignment" and vtype != 4:
                raise _fail(path, f"general.alignment must be a uint32, got value type {vtype}")
        alignment = metadata.get("general.alignment", 32)
        if alignment <= 0 or alignment & (alignment - 1):
            raise _fail(path, f"general.alignment {alignment} is not a power of two")

        cur.need(n_tensors * _GGUF_MIN_TENSOR_INFO, f"{n_tensors} tensor infos")
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"name of tensor {i}")
            (n_dims,) = cur.unpack("<I", f"dimension count of tensor {name!r}")
            if not 1 <= n_dims <= 4:
                raise _fail(path, f"tensor {name!r} has {n_dims} dimensions; GGUF allows 1 to 4")
            ne = cur.unpack(f"<{n_dims}Q", f"dimensions of tensor {name!r}")
            type_id, rel = cur.unpack("<IQ", f"type and offset of tensor {name!r}")
            infos.append((name, ne, type_id, rel))
        data_start = -(-cur.pos // alignment) * alignment

        tensors = {}
        for name, ne, type_id, rel in infos:
            if name in tensors:
                raise _fail(path, f"duplicate tensor name {name!r}")
            dtype = _GGML_SUPPORTED.get(type_id)
            if dtype is None:
                known = f"{_GGML_TYPE_NAMES.get(type_id, 'unknown')} ({type_id})"
                raise _fail(path, f"tensor {name!r} has type {known}, which Loom does not support; "
                                  f"supported: {', '.join(_GGML_SUPPORTED.values())}")
            count = 1
            for d in ne:
                count *= d
                if d == 0 or count > _INT64_MAX:
                    raise _fail(path, f"tensor {name!r} has dimensions {list(ne)}; each must be positive "
                                      f"and their product at most 2**63-1")
            if BLOCK_LAYOUT[dtype][0] > 1 and ne[0] % BLOCK_LAYOUT[dtype][0]:
                raise _fail(path, f"tensor {name!r} is {dtype} with a row of {ne[0]} values; "
                                  f"quantized rows must be a multiple of {BLOCK_LAYOUT[dtype][0]}")
            if rel % alignment:
                raise _fail(path, f"tensor {name!r} data offset {rel} is not a multiple of the alignment {alignment}")
            tensors[name] = TensorInfo(name, dtype, tuple(reversed(ne)), data_start + rel, _nbytes(dtype, count), path)
        _check_layout(path, list(tensors.values()), len(buf))
    except BaseException:
        _release(buf)
        raise
    return Checkpoint("gguf", metadata, tensors, {path: buf})


# --- safetensors --------------------------------------------------------------

_ST_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, **{k: np.dtype(v).itemsize for k, v in _NUMERIC.items()}}
_ST_MAX_HEADER = 100_000_000    # the format's own limit
_ST_MAX_RANK = 8
_ST_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


def _is_uint(v) -> bool:
    return type(v) is int and 0 <= v <= _INT64_MAX      # bool is an int subclass: excluded


def _read_safetensors_file(path: str):
    """One safetensors file -> (mmap, its __metadata__ map, tensors in data order)."""
    buf = _map_file(path, 8, "the safetensors header length")
    try:
        size = len(buf)
        (n,) = struct.unpack_from("<Q", buf, 0)
        if n > _ST_MAX_HEADER:
            raise _fail(path, f"header length {n} exceeds the format's limit of {_ST_MAX_HEADER} bytes",
                        f"bytes 0..8: expected a safetensors header length of at most {_ST_MAX_HEADER}")
        if 8 + n > size:
            raise _fail(path, f"header needs bytes 8..{8 + n} but the file has {size} bytes",
                        "bytes 0..8: expected a safetensors header length within the file")
        try:
            header = _strict_json(path, buf[8:8 + n], "header")
        except WeightsError as e:
            raise WeightsError(e.message, f"{path}: byte 8: expected the safetensors header, a strict JSON "
                                          "object") from None
        if not isinstance(header, dict):
            raise _fail(path, f"header must be a JSON object, got {type(header).__name__}")
        meta = header.pop("__metadata__", {})
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise _fail(path, "__metadata__ must be an object of string values")
        data_start, data_size = 8 + n, size - 8 - n
        tensors = []
        for name, entry in header.items():
            where = f"tensor {name!r}"
            if not isinstance(entry, dict) or entry.keys() != _ST_ENTRY_KEYS:
                raise _fail(path, f"{where} must be an object with exactly dtype, shape and data_offsets")
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
                raise _fail(path, f"{where} has dtype {dtype!r}, which Loom does not support; "
                                  f"supported: {', '.join(_ST_DTYPES)}")
            if not isinstance(shape, list) or len(shape) > _ST_MAX_RANK or not all(map(_is_uint, shape)):
                raise _fail(path, f"{where} shape must be a list of at most {_ST_MAX_RANK} non-negative integers")
            if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_uint, offsets)):
                raise _fail(path, f"{where} data_offsets must be two non-negative integers")
            begin, end = offsets
            if not begin <= end <= data_size:
                raise _fail(path, f"{where} data_offsets [{begin}, {end}] fall outside the data section "
                                  f"(bytes {data_start}..{size}, {data_size} bytes)")
            count = 0 if 0 in shape else 1
            for d in shape:
                count *= d
                if count * _ST_DTYPES[dtype] > data_size:   # stops a product of huge dims early
                    break
            if count * _ST_DTYPES[dtype] != end - begin:
                raise _fail(path, f"{where} is {dtype} {shape} but data_offsets [{begin}, {end}] "
                                  f"span {end - begin} bytes")
            tensors.append(TensorInfo(name, dtype, tuple(shape), data_start + begin, end - begin, path))
        tensors.sort(key=lambda t: t.offset)       # stable: ties keep header order
        _check_layout(path, tensors, size)
    except BaseException:
        _release(buf)
        raise
    return buf, meta, tensors


def _plain_shard_name(name) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..")
            and not any(c in name for c in "/\\\0") and os.path.basename(name) == name)


def _read_safetensors(path: str, index: bool, beside: bool = True) -> Checkpoint:
    """A safetensors file or index; `beside`: also read config.json and preprocessor_config.json
    next to it (a diffusers component reads its own config instead)."""
    folder = os.path.dirname(path)
    maps: dict[str, mmap.mmap] = {}
    try:
        if not index:
            buf, meta, tensors = _read_safetensors_file(path)
            maps[path] = buf
            metadata = {"__metadata__": meta}
            table = {t.name: t for t in tensors}
        else:
            try:
                doc = _read_json_file(path, "the index")
            except WeightsError as e:
                raise WeightsError(e.message, e.public or f"{path}: byte 0: expected a safetensors index, a strict "
                                                          "JSON object") from None
            if not isinstance(doc, dict) or "weight_map" not in doc or not doc.keys() <= {"weight_map", "metadata"}:
                detail = "the index must be an object with weight_map and optionally metadata"
                raise _fail(path, detail, detail)
            weight_map, index_meta = doc["weight_map"], doc.get("metadata", {})
            if not isinstance(weight_map, dict) or not isinstance(index_meta, dict):
                raise _fail(path, "weight_map and metadata must be objects")
            shards: dict[str, list[str]] = {}
            for name, shard in weight_map.items():
                if not _plain_shard_name(shard):
                    raise _fail(path, f"tensor {name!r} maps to {shard!r}; shards must be plain file names "
                                      f"in the index's directory")
                shards.setdefault(shard, []).append(name)
            # Shards in the order the index first names them; tensors in each shard's order.
            merged: dict[str, str] = {}
            table = {}
            for shard, mapped in shards.items():
                shard_path = os.path.join(folder, shard)
                try:
                    buf, meta, tensors = _read_safetensors_file(shard_path)
                except WeightsError as e:
                    raise _shown_as(e, f"{path} (a shard it maps)") from None
                maps[shard_path] = buf
                for key, value in meta.items():
                    if merged.setdefault(key, value) != value:
                        raise _fail(shard_path, f"__metadata__ {key!r} is {value!r} "
                                                f"but an earlier shard says {merged[key]!r}")
                for t in tensors:
                    if t.name in table:
                        raise _fail(shard_path, f"tensor {t.name!r} is also in {table[t.name].file}")
                    if weight_map.get(t.name) != shard:
                        raise _fail(shard_path, f"holds tensor {t.name!r}, "
                                                f"which the index maps to {weight_map.get(t.name)!r}")
                    table[t.name] = t
                missing = [n for n in mapped if n not in table]
                if missing:
                    raise _fail(shard_path, f"lacks tensor {missing[0]!r}, which the index {path} maps to it")
            metadata = {"__metadata__": merged, "index": index_meta}
        config_path = os.path.join(folder, "config.json")
        if beside and os.path.isfile(config_path):
            metadata["config"] = _read_json_file(config_path, "config.json")
        # A vision model's image processing settings (SmolVLM's Idefics3ImageProcessor).
        processor_path = os.path.join(folder, "preprocessor_config.json")
        if beside and os.path.isfile(processor_path):
            metadata["preprocessor"] = _read_json_file(processor_path, "preprocessor_config.json")
    except BaseException:
        for buf in maps.values():
            _release(buf)
        raise
    return Checkpoint("safetensors", metadata, table, maps)


# --- diffusers pipeline folders -----------------------------------------------
# A folder with model_index.json: {"_class_name": ..., "<component>": [library, class] or
# [null, null], pipeline options...}; each component lives in the subfolder of its name.
# Loom reads the components Stable Diffusion's image pipeline runs; the rest (safety_checker,
# feature_extractor, ...) may be absent or hold formats Loom does not read (pytorch .bin).

_DIFFUSERS_WEIGHTS = ("text_encoder", "unet", "vae")
_DIFFUSERS_READ = (*_DIFFUSERS_WEIGHTS, "scheduler", "tokenizer")    # components Loom looks at
# diffusers' models save the first name, transformers' (the CLIP text encoder) the second.
_DIFFUSERS_FILES = ("diffusion_pytorch_model.safetensors", "model.safetensors",
                    "diffusion_pytorch_model.safetensors.index.json", "model.safetensors.index.json")
# Older VAE files name the mid-block attention as diffusers' AttentionBlock did; current diffusers
# renames them on load (_convert_deprecated_attention_blocks) to its Attention's names.
_VAE_LEGACY = {".query.": ".to_q.", ".key.": ".to_k.", ".value.": ".to_v.", ".proj_attn.": ".to_out.0."}


def _vae_current_name(name: str) -> str:
    if ".attentions." in name:
        for old, new in _VAE_LEGACY.items():
            name = name.replace(old, new)
    return name


def _diffusers_components(index_path: str, index) -> dict:
    """model_index.json -> {component: present}, every name checked as a plain folder name."""
    if not isinstance(index, dict):
        raise _fail(index_path, f"model_index.json must be a JSON object, got {type(index).__name__}")
    components = {}
    for name, entry in index.items():
        if name.startswith("_") or (not isinstance(entry, list) and name not in _DIFFUSERS_READ):
            continue        # _class_name, _diffusers_version; options such as requires_safety_checker
        if not _plain_shard_name(name):
            raise _fail(index_path, f"component name {name!r} is not a plain folder name")
        if (not isinstance(entry, list) or len(entry) != 2
                or not (all(isinstance(e, str) for e in entry) or entry == [None, None])):
            raise _fail(index_path, f"component {name!r} must be [library, class] (two strings) or "
                                    f"[null, null], got {entry!r}")
        components[name] = entry != [None, None]
    return components


def _diffusers_config(path: str, what: str) -> dict:
    config = _read_json_file(path, what)
    if not isinstance(config, dict):
        raise _fail(path, f"{what} must be a JSON object, got {type(config).__name__}")
    return config


def _read_diffusers(folder: str) -> Checkpoint:
    index_path = os.path.join(folder, "model_index.json")
    index = _read_json_file(index_path, "model_index.json")
    components = _diffusers_components(index_path, index)
    configs: dict = {"model_index": index}
    tensors: dict[str, TensorInfo] = {}
    aliases: dict[str, str] = {}
    maps: dict[str, mmap.mmap] = {}
    try:
        for name, present in components.items():
            if name not in _DIFFUSERS_WEIGHTS or not present:
                continue
            sub = os.path.join(folder, name)
            found = [f for f in _DIFFUSERS_FILES if os.path.isfile(os.path.join(sub, f))]
            if len(found) != 1:
                raise _fail(sub, f"component {name!r} must hold exactly one of {', '.join(_DIFFUSERS_FILES)}; "
                                 f"found {found or 'none'}")
            configs[name] = _diffusers_config(os.path.join(sub, "config.json"), "config.json")
            part = _read_safetensors(os.path.join(sub, found[0]), index=found[0].endswith(".json"), beside=False)
            maps.update(part._maps)      # distinct folders, so distinct paths
            added = []
            for t in part.tensors.values():
                full = f"{name}.{t.name}"
                if full in tensors:     # distinct prefixes rule this out; checked so nothing is shadowed
                    raise _fail(t.file, f"tensor {full!r} is also in {tensors[full].file}")
                tensors[full] = TensorInfo(full, t.dtype, t.shape, t.offset, t.nbytes, t.file)
                added.append(full)
            if name == "vae":
                for full in added:
                    alias = _vae_current_name(full)
                    if alias == full:
                        continue
                    if alias in tensors or alias in aliases:
                        other = aliases.get(alias, alias)
                        raise _fail(tensors[full].file, f"holds both {full!r} and {other!r}, "
                                                        f"which diffusers both names {alias!r}")
                    aliases[alias] = full
        for alias, target in aliases.items():   # the same bytes under diffusers' current name
            t = tensors[target]
            tensors[alias] = TensorInfo(alias, t.dtype, t.shape, t.offset, t.nbytes, t.file)
        if components.get("scheduler"):
            configs["scheduler"] = _diffusers_config(os.path.join(folder, "scheduler", "scheduler_config.json"),
                                                     "scheduler_config.json")
        metadata = {"config": configs, "aliases": aliases}
        if components.get("tokenizer"):
            tokenizer = os.path.abspath(os.path.join(folder, "tokenizer"))
            if not os.path.isdir(tokenizer):
                raise _fail(tokenizer, "model_index.json names a tokenizer but this folder does not exist")
            metadata["tokenizer"] = tokenizer
    except BaseException:
        for buf in maps.values():
            _release(buf)
        raise
    return Checkpoint("diffusers", metadata, tensors, maps)


# --- The uniform interface ----------------------------------------------------

# --- CTranslate2 --------------------------------------------------------------
# model.bin, binary versions 4 to 6: the version, the spec's name and revision, then
# each variable back to back (name, rank, dims, dtype id, byte count, bytes), then
# aliases (a name for another variable's bytes, e.g. Whisper's tied output projection).
# Strings are a uint16 length, then that many bytes ending in NUL. No magic, no padding.

_CT2_DTYPES = {0: "F32", 1: "I8", 2: "I16", 3: "I32", 4: "F16", 5: "BF16"}
_CT2_ITEM = {"F32": 4, "I8": 1, "I16": 2, "I32": 4, "F16": 2, "BF16": 2}
_CT2_SCALARS = {"I8": "<i1", "I16": "<i2", "I32": "<i4"}
_CT2_MAX_RANK = 8
_CT2_MIN_VARIABLE = 2 + 1 + 1 + 4       # name length, rank, dtype, byte count


def _ct2_string(cur: _Cursor, what: str) -> str:
    (n,) = cur.unpack("<H", f"length of {what}")
    cur.need(n, what)
    raw, cur.pos = cur.buf[cur.pos:cur.pos + n], cur.pos + n
    if not raw.endswith(b"\0"):
        raise _fail(cur.path, f"{what} does not end in NUL")
    try:
        return raw[:-1].decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(cur.path, f"{what} is not valid UTF-8") from None


def _read_ctranslate2(path: str) -> Checkpoint:
    buf = _map_file(path, 4, "a CTranslate2 header")
    try:
        cur = _Cursor(path, buf)
        (version,) = cur.unpack("<I", "binary version")
        if not 4 <= version <= 6:
            raise _fail(path, f"CTranslate2 binary version {version} is not supported; Loom reads versions 4 to 6",
                        "bytes 0..4: expected CTranslate2 binary version 4, 5 or 6")
        spec = _ct2_string(cur, "spec name")
        (revision, count) = cur.unpack("<II", "spec revision and variable count")
        cur.need(count * _CT2_MIN_VARIABLE, f"{count} variables")
        tensors = {}
        for i in range(count):
            name = _ct2_string(cur, f"name of variable {i}")
            (rank,) = cur.unpack("<B", f"rank of {name!r}")
            if rank > _CT2_MAX_RANK:
                raise _fail(path, f"variable {name!r} has rank {rank}; at most {_CT2_MAX_RANK} is supported")
            dims = cur.unpack(f"<{rank}I", f"dimensions of {name!r}")
            type_id, nbytes = cur.unpack("<BI", f"dtype and size of {name!r}")
            dtype = _CT2_DTYPES.get(type_id)
            if dtype is None:
                raise _fail(path, f"variable {name!r} has dtype id {type_id}, which Loom does not read "
                                  f"(int8-quantized weights carry a scale; supported: "
                                  f"{', '.join(_CT2_DTYPES.values())})")
            want = _CT2_ITEM[dtype]
            for d in dims:
                want *= d
            if nbytes != want:
                raise _fail(path, f"variable {name!r} ({dtype} {list(dims)}) states {nbytes} bytes; "
                                  f"its shape needs {want}")
            if name in tensors:
                raise _fail(path, f"duplicate variable name {name!r}")
            cur.need(nbytes, f"data of {name!r}")
            tensors[name] = TensorInfo(name, dtype, tuple(dims), cur.pos, nbytes, path)
            cur.pos += nbytes
        aliases = {}
        (n_aliases,) = cur.unpack("<I", "alias count")
        cur.need(n_aliases * 4, f"{n_aliases} aliases")
        for i in range(n_aliases):
            alias, target = _ct2_string(cur, f"alias {i}"), _ct2_string(cur, f"target of alias {i}")
            if alias in tensors or alias in aliases:
                raise _fail(path, f"alias {alias!r} names an existing variable")
            if target not in tensors:
                raise _fail(path, f"alias {alias!r} refers to {target!r}, which is not a variable")
            aliases[alias] = target
        if cur.pos != len(buf):
            raise _fail(path, f"{len(buf) - cur.pos} bytes follow the last alias (at byte {cur.pos})")
        _check_layout(path, list(tensors.values()), len(buf))
        for alias, target in aliases.items():    # the same bytes under a second name
            t = tensors[target]
            tensors[alias] = TensorInfo(alias, t.dtype, t.shape, t.offset, t.nbytes, path)
        metadata = {"binary_version": version, "spec": spec, "spec_revision": revision, "aliases": aliases}
        # Scalar variables are the spec's settings (num_heads, pre_norm...): metadata, like GGUF's keys.
        for t in tensors.values():
            if t.shape == () and t.dtype in _CT2_SCALARS:
                metadata[t.name] = int(np.frombuffer(buf, _CT2_SCALARS[t.dtype], 1, t.offset)[0])
        config = os.path.join(os.path.dirname(path), "config.json")
        if os.path.isfile(config):
            metadata["config"] = _read_json_file(config, "config.json")
    except BaseException:
        _release(buf)
        raise
    return Checkpoint("ctranslate2", metadata, tensors, {path: buf})


# --- ONNX ---------------------------------------------------------------------
# A ModelProto in protobuf's wire format, decoded by hand: each field a varint key
# (number << 3 | wire type), then a varint (0), 8 bytes (1), a varint length and that many
# bytes (2: strings, bytes, sub-messages, packed repeated scalars), or 4 bytes (5); groups
# (3 ... 4) are deprecated but still skipped, as protobuf does. Fields Loom does not use
# are skipped by their wire type. Every length is checked against the end of the message
# that holds it before anything is read, so each field costs its own bytes and no more.
# Repeated scalars are accepted packed or one element a field, in any mix, as protobuf does.
# A singular scalar or string stated twice takes the last value (protobuf's rule); a
# singular sub-message (the graph) stated twice is rejected rather than merged.

_PB_VARINT, _PB_I64, _PB_LEN, _PB_SGROUP, _PB_EGROUP, _PB_I32 = range(6)
_PB_MAX_FIELD = 2**29 - 1
_PB_MAX_GROUP_DEPTH = 100            # protobuf's default recursion limit
_PB_WIRE_NAMES = {0: "varint", 1: "fixed64", 2: "length-delimited", 3: "start-group", 4: "end-group", 5: "fixed32"}


def _pb_varint(path: str, buf, pos: int, end: int, what: str):
    """One varint at pos (which must end before `end`) -> (unsigned 64-bit value, next position)."""
    start, result, shift = pos, 0, 0
    while True:
        if pos >= end:
            raise _fail(path, f"{what}: the varint at byte {start} runs past the end of its message (byte {end})")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result & 0xFFFF_FFFF_FFFF_FFFF, pos
        shift += 7
        if shift == 70:
            raise _fail(path, f"{what}: the varint at byte {start} is longer than 10 bytes")


def _pb_signed(v: int, bits: int = 64) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


def _pb_fields(path: str, buf, start: int, end: int, what: str):
    """The fields of the message in bytes start..end: (number, wire type, value); value is the
    varint for 0, the payload's offset for 1 and 5, (begin, end) for 2, None for a skipped group."""
    pos = start
    while pos < end:
        at = pos
        key, pos = _pb_varint(path, buf, pos, end, f"{what}: field key")
        number, wire = key >> 3, key & 7
        if not 1 <= number <= _PB_MAX_FIELD:
            raise _fail(path, f"{what}: field number {number} at byte {at} is outside 1..{_PB_MAX_FIELD}")
        if wire == _PB_VARINT:
            value, pos = _pb_varint(path, buf, pos, end, f"{what}: field {number}")
        elif wire in (_PB_I64, _PB_I32):
            size = 8 if wire == _PB_I64 else 4
            if size > end - pos:
                raise _fail(path, f"{what}: field {number} needs bytes {pos}..{pos + size} "
                                  f"but its message ends at byte {end}")
            value, pos = pos, pos + size
        elif wire == _PB_LEN:
            n, pos = _pb_varint(path, buf, pos, end, f"{what}: length of field {number}")
            if n > end - pos:
                raise _fail(path, f"{what}: field {number} states {n} bytes at byte {pos} "
                                  f"but its message ends at byte {end}")
            value, pos = (pos, pos + n), pos + n
        elif wire == _PB_SGROUP:
            pos, value = _pb_skip_group(path, buf, pos, end, number, what), None
        elif wire == _PB_EGROUP:
            raise _fail(path, f"{what}: end-group tag for field {number} at byte {at} without a start")
        else:
            raise _fail(path, f"{what}: invalid wire type {wire} for field {number} at byte {at}")
        yield number, wire, value


def _pb_skip_group(path: str, buf, pos: int, end: int, number: int, what: str) -> int:
    """Skip a group's fields up to its matching end-group tag; returns the position after it."""
    stack = [number]
    while pos < end:
        at = pos
        key, pos = _pb_varint(path, buf, pos, end, f"{what}: field key in group {number}")
        inner, wire = key >> 3, key & 7
        if not 1 <= inner <= _PB_MAX_FIELD:
            raise _fail(path, f"{what}: field number {inner} at byte {at} is outside 1..{_PB_MAX_FIELD}")
        if wire == _PB_VARINT:
            _, pos = _pb_varint(path, buf, pos, end, f"{what}: field {inner} in a group")
        elif wire in (_PB_I64, _PB_I32):
            pos += 8 if wire == _PB_I64 else 4
        elif wire == _PB_LEN:
            n, pos = _pb_varint(path, buf, pos, end, f"{what}: length of field {inner} in a group")
            pos += n
        elif wire == _PB_SGROUP:
            if len(stack) == _PB_MAX_GROUP_DEPTH:
                raise _fail(path, f"{what}: groups nest deeper than {_PB_MAX_GROUP_DEPTH} levels at byte {at}")
            stack.append(inner)
        elif wire == _PB_EGROUP:
            if inner != stack.pop():
                raise _fail(path, f"{what}: end-group tag for field {inner} at byte {at} does not match its start")
            if not stack:
                return pos
        else:
            raise _fail(path, f"{what}: invalid wire type {wire} for field {inner} at byte {at}")
        if pos > end:
            raise _fail(path, f"{what}: a field in group {number} runs past the end of its message (byte {end})")
    raise _fail(path, f"{what}: group {number} has no end-group tag before byte {end}")


# Message schemas: field number -> (name, kind). Kinds: "i" varint, "f" fixed32 float, "s" UTF-8
# string, "b" bytes, "m" sub-message (ranges, decoded later), "rs"/"rb"/"rm" repeated of those,
# "rv"/"r4"/"r8" repeated varint / fixed32 / fixed64 (chunks: an int for one element, a range
# for a packed run). Fields not listed are skipped.
_ONNX_MODEL = {1: ("ir_version", "i"), 2: ("producer_name", "s"), 3: ("producer_version", "s"),
               4: ("domain", "s"), 5: ("model_version", "i"), 7: ("graph", "m"),
               8: ("opset_import", "rm"), 14: ("metadata_props", "rm")}
_ONNX_OPSET = {1: ("domain", "s"), 2: ("version", "i")}
_ONNX_ENTRY = {1: ("key", "s"), 2: ("value", "s")}
_ONNX_GRAPH = {1: ("node", "rm"), 2: ("name", "s"), 5: ("initializer", "rm"), 11: ("input", "rm"),
               12: ("output", "rm"), 15: ("sparse_initializer", "rm")}
_ONNX_VALUE_INFO = {1: ("name", "s")}
_ONNX_NODE = {1: ("input", "rs"), 2: ("output", "rs"), 3: ("name", "s"), 4: ("op_type", "s"),
              5: ("attribute", "rm"), 7: ("domain", "s")}
_ONNX_ATTRIBUTE = {1: ("name", "s"), 20: ("type", "i"), 2: ("f", "f"), 3: ("i", "i"), 4: ("s", "b"),
                   5: ("t", "m"), 6: ("g", "m"), 7: ("floats", "r4"), 8: ("ints", "rv"), 9: ("strings", "rb"),
                   10: ("tensors", "rm"), 11: ("graphs", "rm"), 21: ("ref_attr_name", "s")}
_ONNX_TENSOR = {1: ("dims", "rv"), 2: ("data_type", "i"), 3: ("segment", "m"), 4: ("float_data", "r4"),
                5: ("int32_data", "rv"), 6: ("string_data", "rb"), 7: ("int64_data", "rv"), 8: ("name", "s"),
                9: ("raw_data", "b"), 10: ("double_data", "r8"), 11: ("uint64_data", "rv"),
                13: ("external_data", "rm"), 14: ("data_location", "i")}
_PB_SCALAR_WIRE = {"i": _PB_VARINT, "f": _PB_I32, "s": _PB_LEN, "b": _PB_LEN, "m": _PB_LEN,
                   "rs": _PB_LEN, "rb": _PB_LEN, "rm": _PB_LEN, "rv": _PB_VARINT, "r4": _PB_I32, "r8": _PB_I64}


def _pb_message(path: str, buf, span, schema: dict, what: str) -> dict:
    out = {}
    for number, wire, value in _pb_fields(path, buf, span[0], span[1], what):
        spec = schema.get(number)
        if spec is None:
            continue                    # unknown to Loom: already skipped by its wire type
        name, kind = spec
        want = _PB_SCALAR_WIRE[kind]
        if kind in ("rv", "r4", "r8"):
            if wire not in (want, _PB_LEN):
                raise _fail(path, f"{what}: field {name} ({number}) has wire type {_PB_WIRE_NAMES[wire]}; "
                                  f"expected {_PB_WIRE_NAMES[want]} or packed")
            if wire == _PB_LEN and kind != "rv" and (value[1] - value[0]) % (4 if kind == "r4" else 8):
                raise _fail(path, f"{what}: packed field {name} ({number}) at byte {value[0]} holds "
                                  f"{value[1] - value[0]} bytes, not a whole number of elements")
            out.setdefault(name, []).append(value)
        elif wire != want:
            raise _fail(path, f"{what}: field {name} ({number}) has wire type {_PB_WIRE_NAMES[wire]}; "
                              f"expected {_PB_WIRE_NAMES[want]}")
        elif kind.startswith("r"):
            out.setdefault(name, []).append(value)
        elif kind == "m" and name in out:
            raise _fail(path, f"{what}: field {name} ({number}) appears twice")
        else:
            out[name] = value
    return out


def _pb_str(path: str, buf, span, what: str) -> str:
    try:
        return buf[span[0]:span[1]].decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, f"{what} at bytes {span[0]}..{span[1]} is not valid UTF-8 (byte {span[0] + e.start})") from None


def _pb_packed_varints(path: str, buf, span, what: str) -> np.ndarray:
    """A packed run of varints -> uint64 values, vectorized (a value's 7-bit groups OR-ed into place)."""
    begin, end = span
    data = np.frombuffer(buf, np.uint8, end - begin, begin)
    if not data.size:
        return np.zeros(0, np.uint64)
    ends = np.flatnonzero(data < 0x80)
    if not ends.size or ends[-1] != data.size - 1:
        raise _fail(path, f"{what}: the packed varints at bytes {begin}..{end} end inside a value")
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if lengths.max() > 10:
        raise _fail(path, f"{what}: a packed varint at bytes {begin}..{end} is longer than 10 bytes")
    shifts = (7 * (np.arange(data.size) - np.repeat(starts, lengths))).astype(np.uint64)
    return np.bitwise_or.reduceat((data & 0x7F).astype(np.uint64) << shifts, starts)


def _pb_varint_values(path: str, buf, chunks, what: str) -> np.ndarray:
    """A repeated varint field's chunks (single values and packed runs, in order) -> uint64."""
    parts = [_pb_packed_varints(path, buf, c, what) if isinstance(c, tuple) else np.array([c], np.uint64)
             for c in chunks]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


def _pb_ints(path: str, buf, chunks, what: str) -> list:
    return _pb_varint_values(path, buf, chunks, what).view(np.int64).tolist()


def _pb_fixed_bytes(buf, chunks, size: int) -> bytes:
    return b"".join(buf[c[0]:c[1]] if isinstance(c, tuple) else buf[c:c + size] for c in chunks)


# ONNX TensorProto.DataType -> Loom dtype, and the typed field that holds it when raw_data does not.
_ONNX_DTYPES = {1: ("F32", "float_data"), 2: ("U8", "int32_data"), 3: ("I8", "int32_data"),
                5: ("I16", "int32_data"), 6: ("I32", "int32_data"), 7: ("I64", "int64_data"),
                10: ("F16", "int32_data"), 11: ("F64", "double_data"), 16: ("BF16", "int32_data")}
_ONNX_TYPE_NAMES = {0: "UNDEFINED", 1: "FLOAT", 2: "UINT8", 3: "INT8", 4: "UINT16", 5: "INT16", 6: "INT32",
                    7: "INT64", 8: "STRING", 9: "BOOL", 10: "FLOAT16", 11: "DOUBLE", 12: "UINT32", 13: "UINT64",
                    14: "COMPLEX64", 15: "COMPLEX128", 16: "BFLOAT16", 17: "FLOAT8E4M3FN", 18: "FLOAT8E4M3FNUZ",
                    19: "FLOAT8E5M2", 20: "FLOAT8E5M2FNUZ", 21: "UINT4", 22: "INT4", 23: "FLOAT4E2M1"}
# int32_data carries these as int32 values (float16/bfloat16 as their bit patterns): their ranges.
_ONNX_INT32_RANGE = {"U8": (0, 255), "I8": (-128, 127), "I16": (-32768, 32767), "I32": (-2**31, 2**31 - 1),
                     "F16": (0, 65535), "BF16": (0, 65535)}
_ONNX_ITEM = {"F32": "<f4", "F64": "<f8", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1",
              "F16": "<u2", "BF16": "<u2"}
_ONNX_DATA_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")
_ONNX_MAX_RANK = 8
_ONNX_ATTR_TENSOR_VALUES = 1024     # tensor attributes up to this many values are listed in metadata


def _onnx_tensor(path: str, buf, span, what: str):
    """A TensorProto -> (name, dtype, shape, data): data is (offset, nbytes) in the file when its
    bytes lie there contiguously (raw_data, a single packed float_data/double_data run), else
    the little-endian bytes decoded from varints (int32_data, int64_data) or scattered elements."""
    f = _pb_message(path, buf, span, _ONNX_TENSOR, what)
    name = _pb_str(path, buf, f["name"], f"{what} name") if "name" in f else ""
    where = f"{what} ({name!r})" if name else what
    if f.get("data_location", 0) == 1 or "external_data" in f:
        location = ""
        for entry in f.get("external_data", []):
            e = _pb_message(path, buf, entry, _ONNX_ENTRY, f"{where} external_data")
            if "key" in e and _pb_str(path, buf, e["key"], "external_data key") == "location" and "value" in e:
                location = f" in {_pb_str(path, buf, e['value'], 'external_data location')!r}"
        raise _fail(path, f"{where} keeps its data outside the model file (external data{location}); "
                          f"Loom reads ONNX files that hold their initializers themselves")
    if "segment" in f:
        raise _fail(path, f"{where} is a segment of a larger tensor; segmented tensors are not supported")
    type_id = _pb_signed(f.get("data_type", 0), 32)
    if type_id not in _ONNX_DTYPES:
        known = _ONNX_TYPE_NAMES.get(type_id, "unknown")
        raise _fail(path, f"{where} has data type {known} ({type_id}), which Loom does not read; supported: "
                          + ", ".join(_ONNX_TYPE_NAMES[t] for t in _ONNX_DTYPES))
    dtype, field = _ONNX_DTYPES[type_id]
    chunks = f.get("dims", [])
    if sum(1 if not isinstance(c, tuple) else c[1] - c[0] for c in chunks) > 10 * _ONNX_MAX_RANK:
        raise _fail(path, f"{where} has more than {_ONNX_MAX_RANK} dimensions")
    shape = _pb_ints(path, buf, chunks, f"{where} dims")
    if len(shape) > _ONNX_MAX_RANK or any(d < 0 for d in shape):
        raise _fail(path, f"{where} has dims {shape}; at most {_ONNX_MAX_RANK} non-negative dimensions are supported")
    item = np.dtype(_ONNX_ITEM[dtype]).itemsize
    count = 0 if 0 in shape else 1
    for d in shape:
        count *= d
        if count > len(buf):    # each value takes a byte at least, however stored: stops huge products early
            raise _fail(path, f"{where} is {dtype} {shape}, more values than the file has bytes ({len(buf)})")
    present = [k for k in ("raw_data", *_ONNX_DATA_FIELDS) if k in f]
    if len(present) > 1:
        raise _fail(path, f"{where} holds its data in both {present[0]} and {present[1]}; expected one")
    if present and present[0] not in ("raw_data", field):
        raise _fail(path, f"{where} is {_ONNX_TYPE_NAMES[type_id]} but holds {present[0]}; "
                          f"expected raw_data or {field}")
    if "raw_data" in f:
        begin, end = f["raw_data"]
        if end - begin != count * item:
            raise _fail(path, f"{where} is {dtype} {shape} ({count * item} bytes) but raw_data at bytes "
                              f"{begin}..{end} holds {end - begin}")
        return name, dtype, tuple(shape), (begin, end - begin)
    if not present:
        if count:
            raise _fail(path, f"{where} is {dtype} {shape} but holds no data")
        return name, dtype, tuple(shape), (0, 0)
    chunks = f[field]
    if field in ("float_data", "double_data"):
        size = 4 if field == "float_data" else 8
        got = sum((c[1] - c[0]) // size if isinstance(c, tuple) else 1 for c in chunks)
        if got != count:
            raise _fail(path, f"{where} is {dtype} {shape} ({count} values) but {field} holds {got}")
        if len(chunks) == 1 and isinstance(chunks[0], tuple):
            return name, dtype, tuple(shape), (chunks[0][0], count * size)     # one packed run: zero-copy
        return name, dtype, tuple(shape), _pb_fixed_bytes(buf, chunks, size)
    values = _pb_varint_values(path, buf, chunks, f"{where} {field}")
    if values.size != count:
        raise _fail(path, f"{where} is {dtype} {shape} ({count} values) but {field} holds {values.size}")
    if field == "int64_data":
        return name, dtype, tuple(shape), values.view("<i8").tobytes()
    ints = (values & np.uint64(0xFFFF_FFFF)).astype(np.uint32).view(np.int32)   # int32: the low 32 bits
    low, high = _ONNX_INT32_RANGE[dtype]
    if ints.size and (ints.min() < low or ints.max() > high):
        bad = ints[(ints < low) | (ints > high)][0]
        raise _fail(path, f"{where} is {dtype} but int32_data holds {bad}, outside {low}..{high}")
    return name, dtype, tuple(shape), ints.astype(_ONNX_ITEM[dtype]).tobytes()


def _onnx_values(buf, dtype: str, data) -> np.ndarray:
    raw = np.frombuffer(buf, np.uint8, data[1], data[0]) if isinstance(data, tuple) else np.frombuffer(data, np.uint8)
    if dtype == "F16":
        return raw.view("<f2").astype(np.float32)
    if dtype == "BF16":
        return _bf16_to_f32(raw.view("<u2"))
    return raw.view(_ONNX_ITEM[dtype])


def _onnx_attribute(path: str, buf, span, what: str):
    """An AttributeProto -> (name, JSON-able value). Numbers, strings, their lists and small tensors
    come as values; graphs, sparse tensors and type protos only as {"unsupported": <type>}."""
    a = _pb_message(path, buf, span, _ONNX_ATTRIBUTE, what)
    if "name" not in a:
        raise _fail(path, f"{what} has no name")
    name = _pb_str(path, buf, a["name"], f"{what} name")
    where = f"{what} ({name!r})"
    kind = _pb_signed(a.get("type", 0), 32)
    if kind == 0:       # files from before the type field: the one value field that is set
        kinds = [k for field, k in (("f", 1), ("i", 2), ("s", 3), ("t", 4), ("g", 5), ("floats", 6),
                                    ("ints", 7), ("strings", 8), ("tensors", 9), ("graphs", 10)) if field in a]
        if len(kinds) != 1:
            raise _fail(path, f"{where} has no type and {len(kinds)} value fields; expected one")
        kind = kinds[0]

    def tensor(t_span, label):
        _, dtype, shape, data = _onnx_tensor(path, buf, t_span, label)
        out = {"dtype": dtype, "shape": list(shape)}
        count = int(np.prod(shape, dtype=np.int64))
        if count <= _ONNX_ATTR_TENSOR_VALUES:
            out["values"] = _onnx_values(buf, dtype, data).tolist()
        return out

    if kind == 1:
        return name, struct.unpack_from("<f", buf, a["f"])[0] if "f" in a else 0.0
    if kind == 2:
        return name, _pb_signed(a.get("i", 0))
    if kind == 3:
        return name, _pb_str(path, buf, a["s"], f"{where} value") if "s" in a else ""
    if kind == 4:
        if "t" not in a:
            raise _fail(path, f"{where} is a TENSOR attribute without a tensor")
        return name, {"tensor": tensor(a["t"], f"{where} tensor")}
    if kind == 6:
        return name, np.frombuffer(_pb_fixed_bytes(buf, a.get("floats", []), 4), "<f4").tolist()
    if kind == 7:
        return name, _pb_ints(path, buf, a.get("ints", []), f"{where} ints")
    if kind == 8:
        return name, [_pb_str(path, buf, s, f"{where} string {i}") for i, s in enumerate(a.get("strings", []))]
    if kind == 9:
        return name, {"tensors": [tensor(t, f"{where} tensor {i}") for i, t in enumerate(a.get("tensors", []))]}
    names = {5: "GRAPH", 10: "GRAPHS", 11: "SPARSE_TENSOR", 12: "SPARSE_TENSORS", 13: "TYPE_PROTO", 14: "TYPE_PROTOS"}
    if kind not in names:
        raise _fail(path, f"{where} has unknown attribute type {kind}")
    return name, {"unsupported": names[kind]}


def _onnx_node(path: str, buf, span, what: str) -> dict:
    n = _pb_message(path, buf, span, _ONNX_NODE, what)
    name = _pb_str(path, buf, n["name"], f"{what} name") if "name" in n else ""
    where = f"{what} ({name!r})" if name else what
    if "op_type" not in n:
        raise _fail(path, f"{where} has no op_type")
    node = {"op": _pb_str(path, buf, n["op_type"], f"{where} op_type"), "name": name,
            "inputs": [_pb_str(path, buf, s, f"{where} input {i}") for i, s in enumerate(n.get("input", []))],
            "outputs": [_pb_str(path, buf, s, f"{where} output {i}") for i, s in enumerate(n.get("output", []))],
            "attrs": {}}
    for i, a in enumerate(n.get("attribute", [])):
        key, value = _onnx_attribute(path, buf, a, f"{where} attribute {i}")
        if key in node["attrs"]:
            raise _fail(path, f"{where} has attribute {key!r} twice")
        node["attrs"][key] = value
    if "domain" in n:
        domain = _pb_str(path, buf, n["domain"], f"{where} domain")
        if domain:
            node["domain"] = domain
    return node


# Aliases for anonymous initializers: torch.onnx names a parameter it cannot trace to a module
# attribute (weight norm folded into the weight, say) "onnx::<Op>_<n>", or just a number. Where
# such a tensor is the weight or bias input of a layer node, the node's scope names the module:
# node "/flow/flows.0/enc/in_layers.0/Conv" input 1 -> "flow.flows.0.enc.in_layers.0.weight",
# the name PyTorch gives that parameter and the one the exporter gives the named ones beside it.
_ONNX_PARAM_INPUTS = {"Conv": {1: "weight", 2: "bias"}, "ConvTranspose": {1: "weight", 2: "bias"}}


def _onnx_anonymous(name: str) -> bool:
    return name.startswith("onnx::") or name.isdigit()


def _onnx_aliases(nodes: list, names) -> dict:
    """anonymous initializer -> alias, where every layer node consuming it agrees on one alias
    that no tensor already has and no other anonymous initializer would get."""
    proposed: dict[str, set] = {}
    for node in nodes:
        slots = _ONNX_PARAM_INPUTS.get(node["op"])
        if slots is None and node["op"] == "Gemm" and node["attrs"].get("transB") == 1:
            slots = {1: "weight", 2: "bias"}         # nn.Linear: B is the weight as PyTorch stores it
        for i, source in enumerate(node["inputs"]):
            if source in names and _onnx_anonymous(source):
                scope = node["name"].split("/")
                ok = slots and i in slots and len(scope) >= 3 and scope[0] == "" and all(scope[1:-1])
                proposed.setdefault(source, set()).add(".".join(scope[1:-1]) + "." + slots[i] if ok else None)
    aliases = {}
    for source, candidates in proposed.items():
        if len(candidates) == 1 and None not in candidates:
            aliases[source] = next(iter(candidates))
    taken: dict[str, int] = {}
    for alias in aliases.values():
        taken[alias] = taken.get(alias, 0) + 1
    return {s: a for s, a in aliases.items() if taken[a] == 1 and a not in names}


def _read_onnx(path: str) -> Checkpoint:
    buf = _map_file(path, 2, "an ONNX model")
    maps = {path: buf}
    try:
        try:
            model = _pb_message(path, buf, (0, len(buf)), _ONNX_MODEL, "ModelProto")
        except WeightsError as e:
            raise WeightsError(e.message, f"{path}: byte 0: expected an ONNX ModelProto (protobuf)") from None
        if "graph" not in model:
            raise _fail(path, "not an ONNX model: ModelProto has no graph (is this an ONNX file?)")
        opset = {}
        for i, span in enumerate(model.get("opset_import", [])):
            o = _pb_message(path, buf, span, _ONNX_OPSET, f"opset_import {i}")
            domain = _pb_str(path, buf, o["domain"], f"opset_import {i} domain") if "domain" in o else ""
            if domain in opset:
                raise _fail(path, f"opset_import names domain {domain!r} twice")
            opset[domain] = _pb_signed(o.get("version", 0))
        props = {}
        for i, span in enumerate(model.get("metadata_props", [])):
            e = _pb_message(path, buf, span, _ONNX_ENTRY, f"metadata_props {i}")
            key = _pb_str(path, buf, e["key"], f"metadata_props {i} key") if "key" in e else ""
            props[key] = _pb_str(path, buf, e["value"], f"metadata_props {i} value") if "value" in e else ""
        text = {k: _pb_str(path, buf, model[k], f"ModelProto {k}") if k in model else ""
                for k in ("producer_name", "producer_version", "domain")}

        graph = _pb_message(path, buf, model["graph"], _ONNX_GRAPH, "GraphProto")
        if "sparse_initializer" in graph:
            raise _fail(path, "the graph has sparse initializers, which Loom does not read")
        value_names = {}
        for key in ("input", "output"):
            value_names[key] = []
            for i, span in enumerate(graph.get(key, [])):
                v = _pb_message(path, buf, span, _ONNX_VALUE_INFO, f"graph {key} {i}")
                value_names[key].append(_pb_str(path, buf, v["name"], f"graph {key} {i} name") if "name" in v else "")
        nodes = [_onnx_node(path, buf, span, f"node {i}") for i, span in enumerate(graph.get("node", []))]

        tensors, decoded, decoded_size = {}, [], 0
        for i, span in enumerate(graph.get("initializer", [])):
            name, dtype, shape, data = _onnx_tensor(path, buf, span, f"initializer {i}")
            if not name:
                raise _fail(path, f"initializer {i} (bytes {span[0]}..{span[1]}) has no name")
            if name in tensors:
                raise _fail(path, f"duplicate initializer name {name!r}")
            if isinstance(data, tuple):
                tensors[name] = TensorInfo(name, dtype, shape, data[0], data[1], path)
            else:
                tensors[name] = (name, dtype, shape, decoded_size, len(data))
                decoded.append(data)
                decoded_size += len(data)
        _check_layout(path, [t for t in tensors.values() if isinstance(t, TensorInfo)], len(buf))
        if decoded_size:    # initializers stored as varints or scattered elements, decoded into memory
            store = f"{path}#decoded"
            maps[store] = mmap.mmap(-1, decoded_size)
            maps[store][:] = b"".join(decoded)
            for name, t in tensors.items():
                if not isinstance(t, TensorInfo):
                    tensors[name] = TensorInfo(*t, store)
        else:
            for name, t in tensors.items():
                if not isinstance(t, TensorInfo):
                    tensors[name] = TensorInfo(*t[:3], 0, 0, path)

        initializers, aliased = list(tensors), _onnx_aliases(nodes, tensors)
        aliases = {alias: source for source, alias in aliased.items()}
        for alias, source in aliases.items():   # the same bytes under a second name
            t = tensors[source]
            tensors[alias] = TensorInfo(alias, t.dtype, t.shape, t.offset, t.nbytes, t.file)
        metadata = {"ir_version": _pb_signed(model.get("ir_version", 0)), "opset": opset,
                    "producer": text["producer_name"], "producer_version": text["producer_version"],
                    "domain": text["domain"], "model_version": _pb_signed(model.get("model_version", 0)),
                    "metadata_props": props,
                    "graph_name": _pb_str(path, buf, graph["name"], "graph name") if "name" in graph else "",
                    "inputs": value_names["input"], "outputs": value_names["output"],
                    "graph": nodes, "aliases": aliases,
                    "unaliased": [n for n in initializers if _onnx_anonymous(n) and n not in aliased]}
        config = f"{path}.json"         # Piper keeps a voice's settings in <voice>.onnx.json
        if os.path.isfile(config):
            metadata["config"] = _read_json_file(config, os.path.basename(config))
    except BaseException:
        for b in maps.values():
            _release(b)
        raise
    return Checkpoint("onnx", metadata, tensors, maps)


class Checkpoint:
    """An open checkpoint.

    ``format``: "gguf", "safetensors", "ctranslate2", "onnx" or "diffusers". ``metadata``: GGUF
    key/values as Python values (arrays as lists); for safetensors ``{"__metadata__": {...}}`` (shards'
    maps merged, which must agree), ``"index"``: the index's own ``metadata`` when
    sharded, and ``"config"``: a ``config.json`` beside the files when there is one
    (``"preprocessor"``: likewise a ``preprocessor_config.json``);
    for CTranslate2 the binary version, spec name and revision, ``"aliases"``
    (alias -> variable; each alias is also a tensor sharing its target's bytes) and
    ``"config"``; for ONNX ``ir_version``, ``opset`` (domain -> version), ``producer``,
    ``producer_version``, ``domain``, ``model_version``, ``metadata_props``, ``graph_name``,
    ``inputs`` and ``outputs`` (names), ``graph``: the nodes in file order as
    ``{"op", "name", "inputs", "outputs", "attrs"}`` (plus ``"domain"`` when not the default;
    attribute values as numbers, strings, lists, ``{"tensor": {"dtype", "shape", "values"}}``
    (values when at most 1024) or ``{"unsupported": "GRAPH"}`` and the like), ``"aliases"``
    (alias -> anonymous initializer, named after the layer that consumes it; each alias is also
    a tensor sharing its bytes), ``"unaliased"`` (anonymous initializers left without one) and
    ``"config"``: ``<model>.onnx.json`` beside the file (a Piper voice's settings);
    for "diffusers" (a pipeline folder) ``"config"``: ``{"model_index": model_index.json,
    "text_encoder"/"unet"/"vae": each component's config.json, "scheduler":
    scheduler/scheduler_config.json}`` (a component model_index.json lists as ``[null, null]``,
    or does not list, is absent), ``"tokenizer"``: the absolute path of the tokenizer folder
    (absent when model_index.json names none) and ``"aliases"`` (diffusers' current VAE attention
    name -> the older ``query``/``key``/``value``/``proj_attn`` tensor a file holds; each alias
    is also a tensor sharing its bytes).
    ``tensors``: name -> TensorInfo in file order (GGUF: tensor-info order;
    safetensors: data order, shards in the order the index first names them; ONNX:
    initializer order, then aliases; diffusers: ``<component>.<name>``, components in
    model_index.json's order, each in its safetensors order, then aliases). ``TensorInfo.file``
    is the model's path (for diffusers, the component's file), or ``<path>#decoded`` for ONNX
    initializers decoded into memory.

    ``close()`` (or leaving a ``with`` block) releases the mappings; arrays already
    handed out keep their mapping alive until they go.
    """

    def __init__(self, format: str, metadata: dict, tensors: dict[str, TensorInfo], maps: dict[str, mmap.mmap]):
        self.format = format
        self.metadata = metadata
        self.tensors = tensors
        self.nbytes = sum(t.nbytes for t in tensors.values())
        self._maps = maps

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for buf in self._maps.values():
            _release(buf)
        self._maps = {}

    def add_arrays(self, arrays: dict, store: str) -> None:
        """Tensors computed at load time (LoRA adapters packed for the kernels), float32, held
        in one anonymous map named `store`, closed with the checkpoint like the files."""
        if not arrays:
            return
        blobs = {name: np.ascontiguousarray(a, dtype="<f4").tobytes() for name, a in arrays.items()}
        buf = mmap.mmap(-1, sum(len(b) for b in blobs.values()) or 1)
        offset = 0
        for name, blob in blobs.items():
            if name in self.tensors:
                buf.close()
                raise WeightsError(f"{store}: tensor {name!r} is already in the checkpoint")
            buf[offset:offset + len(blob)] = blob
            self.tensors[name] = TensorInfo(name, "F32", tuple(np.shape(arrays[name])), offset, len(blob), store)
            offset += len(blob)
        self._maps[store] = buf
        self.nbytes += offset

    def _info(self, name: str) -> tuple[TensorInfo, mmap.mmap]:
        if name not in self.tensors:
            raise WeightsError(f"checkpoint has no tensor {name!r}")
        t = self.tensors[name]
        if t.file not in self._maps:
            raise WeightsError(f"{t.file}: checkpoint is closed")
        return t, self._maps[t.file]

    def raw(self, name: str) -> memoryview:
        """The tensor's exact bytes, zero-copy and read-only."""
        t, buf = self._info(name)
        return memoryview(buf)[t.offset:t.offset + t.nbytes]

    def array(self, name: str) -> np.ndarray:
        """F32/F16: a read-only zero-copy view; BF16: float32; block formats: uint8 blocks (rows, row bytes)."""
        t, buf = self._info(name)
        if t.dtype in ("F32", "F16"):
            item = "<f4" if t.dtype == "F32" else "<f2"
            return np.frombuffer(buf, item, t.nbytes // BLOCK_LAYOUT[t.dtype][1], t.offset).reshape(t.shape)
        if t.dtype == "BF16":
            return _bf16_to_f32(np.frombuffer(buf, "<u2", t.nbytes // 2, t.offset)).reshape(t.shape)
        if t.dtype in _NUMERIC:
            item = np.dtype(_NUMERIC[t.dtype])
            return np.frombuffer(buf, item, t.nbytes // item.itemsize, t.offset).reshape(t.shape)
        rows = int(np.prod(t.shape[:-1], dtype=np.int64))
        return np.frombuffer(buf, np.uint8, t.nbytes, t.offset).reshape(rows, t.nbytes // rows)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as a new float32 array of its shape, whatever its dtype."""
        t, _ = self._info(name)
        if t.dtype in _NUMERIC:
            return self.array(name).astype(np.float32)
        count = int(np.prod(t.shape, dtype=np.int64))
        return dequantize_blocks(self.raw(name), t.dtype, count).reshape(t.shape)


def open_checkpoint(path) -> Checkpoint:
    """Open a .gguf, a .safetensors, a safetensors index .json, a CTranslate2 model.bin,
    an .onnx model, or a directory with exactly one of them; a directory holding
    model_index.json (or that file itself) is a diffusers pipeline folder, read whole."""
    path = os.fspath(path)
    if os.path.basename(path) == "model_index.json" and os.path.isfile(path):
        return _read_diffusers(os.path.dirname(path))
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "model_index.json")):
        return _read_diffusers(path)
    if os.path.isdir(path):
        entries = sorted(os.listdir(path))
        found = [e for e in entries if e in ("model.safetensors", "model.safetensors.index.json", "model.bin")]
        found += [e for e in entries if e.lower().endswith((".gguf", ".onnx"))]
        expected = ("a checkpoint directory must hold exactly one of model.safetensors, model.safetensors.index.json, "
                    "model.bin, a single .gguf or a single .onnx file")
        if len(found) != 1:
            raise _fail(path, f"{expected}; found {found or 'none'}", f"{expected} (it holds {len(found)})")
        try:
            return _open_file(os.path.join(path, found[0]))
        except WeightsError as e:
            raise _shown_as(e, f"{path} (its checkpoint file)") from None
    return _open_file(path)


def _open_file(path: str) -> Checkpoint:
    lower = path.lower()
    if lower.endswith(".gguf"):
        return _read_gguf(path)
    if lower.endswith(".bin"):
        return _read_ctranslate2(path)
    if lower.endswith(".safetensors"):
        return _read_safetensors(path, index=False)
    if lower.endswith(".onnx"):
        return _read_onnx(path)
    if lower.endswith(".onnx.json"):
        raise _fail(path, "this is an ONNX model's settings (a Piper voice config); open the .onnx file beside it")
    if lower.endswith(".json"):
        return _read_safetensors(path, index=True)
    detail = ("not a checkpoint: expected a .gguf, .safetensors, .json index, CTranslate2 .bin or .onnx file, "
              "or a directory")
    raise _fail(path, detail, detail)


def write_safetensors(path, tensors, metadata=None) -> None:
    """Write float32/float16 arrays as a safetensors file (for generated checkpoints:
    the embedded catalog's stand-in weights and examples)."""
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        dtype = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}.get(array.dtype)
        if dtype is None:
            raise ValueError(f"{name}: only float32 and float16 arrays are written, not {array.dtype}")
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data 8-byte aligned, as the reference writer does
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for data in blobs:
            f.write(data)
    os.replace(tmp, path)  # never leave a half-written checkpoint under the real name
