"""Checkpoint readers (loom/weights.py) on real GGUF and safetensors files.

Valid files come from the formats' own writers (`gguf.GGUFWriter`,
`safetensors.numpy.save_file`), which serve only as oracles here; broken and
lying files are built byte by byte with the small writers below. Dequantized
values are checked against `gguf.quants` and against a per-block reference
written in this file from the ggml block layouts.
"""
import json
import os
import struct
import tempfile
import tracemalloc

import gguf
import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.numpy import save_file

from loom.weights import (
    SCALE_FIELDS, Checkpoint, TensorInfo, WeightsError, dequantize_blocks, open_checkpoint, quantize,
)

RNG = np.random.default_rng(1234)


# --- Independent references -----------------------------------------------------

def ref_dequantize(raw: bytes, dtype: str, count: int) -> np.ndarray:
    """ggml's block layouts, one block and one value at a time."""
    out = []
    if dtype == "Q8_0":
        for b in range(count // 32):
            block = raw[b * 34:(b + 1) * 34]
            d = np.float32(np.frombuffer(block[:2], "<f2")[0])
            out += [d * np.float32(q) for q in struct.unpack("32b", block[2:])]
    elif dtype == "Q4_0":
        for b in range(count // 32):
            block = raw[b * 18:(b + 1) * 18]
            d = np.float32(np.frombuffer(block[:2], "<f2")[0])
            lo = [d * np.float32((byte & 15) - 8) for byte in block[2:]]
            hi = [d * np.float32((byte >> 4) - 8) for byte in block[2:]]
            out += lo + hi
    elif dtype == "Q4_1":
        for b in range(count // 32):
            block = raw[b * 20:(b + 1) * 20]
            d, m = (np.float32(v) for v in np.frombuffer(block[:4], "<f2"))
            lo = [np.float32(byte & 15) * d + m for byte in block[4:]]
            hi = [np.float32(byte >> 4) * d + m for byte in block[4:]]
            out += lo + hi
    elif dtype in ("Q5_0", "Q5_1"):
        size, at = (22, 2) if dtype == "Q5_0" else (24, 4)
        for b in range(count // 32):
            block = raw[b * size:(b + 1) * size]
            d = np.float32(np.frombuffer(block[:2], "<f2")[0])
            m = np.float32(np.frombuffer(block[2:4], "<f2")[0]) if dtype == "Q5_1" else None
            high = struct.unpack("<I", block[at:at + 4])[0]
            qs = block[at + 4:]
            for e in range(32):
                q = (qs[e] & 15 if e < 16 else qs[e - 16] >> 4) | ((high >> e) & 1) << 4
                out.append(np.float32(q - 16) * d if m is None else np.float32(q) * d + m)
    elif dtype in KQ_SIZES:
        size = KQ_SIZES[dtype]
        for b in range(count // 256):
            out += ref_dequantize_k(raw[b * size:(b + 1) * size], dtype)
    elif dtype == "BF16":
        out = [struct.unpack("<f", b"\0\0" + raw[i:i + 2])[0] for i in range(0, 2 * count, 2)]
    else:
        out = np.frombuffer(raw, "<f4" if dtype == "F32" else "<f2")
    return np.asarray(out, dtype=np.float32)


KQ_SIZES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def half_at(block: bytes, at: int) -> np.float32:
    return np.float32(np.frombuffer(block[at:at + 2], "<f2")[0])


def scale_min_k4(j: int, q: bytes):
    """ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from Q4_K/Q5_K's 12 bytes."""
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ref_dequantize_k(block: bytes, dtype: str) -> list:
    """One K-quant superblock, the loops of ggml's dequantize_row_q*_K, in float32."""
    f = np.float32
    out = []
    if dtype == "Q2_K":         # scales[16], qs[64], d, dmin
        d, dmin, qs = half_at(block, 80), half_at(block, 82), block[16:80]
        scales = iter(block[:16])
        for n in (0, 32):
            for shift in (0, 2, 4, 6):
                for part in (0, 16):
                    sc = next(scales)
                    dl, ml = d * f(sc & 0xF), dmin * f(sc >> 4)
                    out += [dl * f((qs[n + part + l] >> shift) & 3) - ml for l in range(16)]
    elif dtype == "Q3_K":       # hmask[32], qs[64], scales[12], d
        hm, qs, d = block[:32], block[32:96], half_at(block, 108)
        # the 16 6-bit scales, unpacked as ggml does, in 32-bit words
        aux = list(struct.unpack("<3I", block[96:108])) + [0]
        tmp, k1, k2 = aux[2], 0x03030303, 0x0F0F0F0F
        aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4)
        aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4)
        aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4)
        aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4)
        scales = iter(struct.unpack("<16b", struct.pack("<4I", *aux)))
        m = 1
        for n in (0, 32):
            for shift in (0, 2, 4, 6):
                for part in (0, 16):
                    dl = d * f(next(scales) - 32)
                    out += [dl * f(((qs[n + part + l] >> shift) & 3) - (0 if hm[part + l] & m else 4))
                            for l in range(16)]
                m <<= 1
    elif dtype in ("Q4_K", "Q5_K"):     # d, dmin, scales[12], (Q5_K: qh[32]), qs[128]
        d, dmin, scales = half_at(block, 0), half_at(block, 2), block[4:16]
        qh, ql = (block[16:48], block[48:]) if dtype == "Q5_K" else (bytes(32), block[16:])
        for j in range(4):
            (sc1, m1), (sc2, m2) = scale_min_k4(2 * j, scales), scale_min_k4(2 * j + 1, scales)
            d1, d2, mm1, mm2 = d * f(sc1), d * f(sc2), dmin * f(m1), dmin * f(m2)
            q = ql[32 * j:32 * j + 32]
            out += [d1 * f((q[l] & 0xF) + (16 if qh[l] & (1 << 2 * j) else 0)) - mm1 for l in range(32)]
            out += [d2 * f((q[l] >> 4) + (16 if qh[l] & (2 << 2 * j) else 0)) - mm2 for l in range(32)]
    else:                       # Q6_K: ql[128], qh[64], scales[16] int8, d
        ql, qh, d = block[:128], block[128:192], half_at(block, 208)
        sc = struct.unpack("<16b", block[192:208])
        for n in (0, 1):
            y = [f(0)] * 128
            for l in range(32):
                a, b, h = ql[64 * n + l], ql[64 * n + l + 32], qh[32 * n + l]
                s = 8 * n + l // 16
                q1, q2 = (a & 0xF) | ((h >> 0) & 3) << 4, (b & 0xF) | ((h >> 2) & 3) << 4
                q3, q4 = (a >> 4) | ((h >> 4) & 3) << 4, (b >> 4) | ((h >> 6) & 3) << 4
                y[l], y[l + 32] = d * f(sc[s]) * f(q1 - 32), d * f(sc[s + 2]) * f(q2 - 32)
                y[l + 64], y[l + 96] = d * f(sc[s + 4]) * f(q3 - 32), d * f(sc[s + 6]) * f(q4 - 32)
            out += y
    return out


def f32_exact(x) -> np.ndarray:
    """float32 values that bfloat16 holds exactly (low mantissa half zero)."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


# --- GGUF: valid files from gguf.GGUFWriter ---------------------------------------

METADATA = [
    ("t.u8", VT.UINT8, 200), ("t.i8", VT.INT8, -100), ("t.u16", VT.UINT16, 60000),
    ("t.i16", VT.INT16, -30000), ("t.u32", VT.UINT32, 4_000_000_000), ("t.i32", VT.INT32, -2_000_000_000),
    ("t.u64", VT.UINT64, 2**64 - 1), ("t.i64", VT.INT64, -(2**63)), ("t.f32", VT.FLOAT32, 1.5),
    ("t.f64", VT.FLOAT64, 0.1), ("t.true", VT.BOOL, True), ("t.false", VT.BOOL, False),
    ("t.str", VT.STRING, "héllo ✓ 𝄞"), ("t.empty", VT.STRING, ""),
]
ARRAYS = [
    ("t.tokens", ["<s>", "", "ünï", "a b"], VT.STRING), ("t.ints", [1, -2, 3], VT.INT32),
    ("t.u64s", [0, 2**64 - 1], VT.UINT64), ("t.floats", [0.5, -2.25], VT.FLOAT32),
    ("t.f64s", [0.1, 1e300], VT.FLOAT64), ("t.bools", [True, False, True], VT.BOOL),
    ("t.bytes", [0, 255], VT.UINT8), ("t.nested", [["a", "b"], ["ccc"]], VT.ARRAY),
]


def tensor_values(shape):
    return RNG.standard_normal(shape).astype(np.float32)


def write_gguf(path, tensors, *, alignment=None, endianess=gguf.GGUFEndian.LITTLE, metadata=True):
    """tensors: [(name, dtype, float32 values)] -> a GGUF v3 file; returns the bytes stored per tensor."""
    w = gguf.GGUFWriter(str(path), arch="test", endianess=endianess)
    if alignment:
        w.add_custom_alignment(alignment)
    if metadata:
        for key, vtype, value in METADATA:
            w.add_key_value(key, value, vtype)
        for key, value, sub in ARRAYS:
            w.add_key_value(key, value, VT.ARRAY, sub_type=sub)
    stored = {}
    for name, dtype, values in tensors:
        if dtype == "F32":
            data = values.astype(np.float32)
            w.add_tensor(name, data)
        elif dtype == "F16":
            data = values.astype(np.float16)
            w.add_tensor(name, data)
        else:   # gguf-py cannot quantize K-quants: Loom's quantizer writes those
            data = quantize(values, dtype) if dtype in KQ_SIZES else gguf.quants.quantize(values, QT[dtype])
            w.add_tensor(name, data, raw_dtype=QT[dtype])
        stored[name] = data.tobytes()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


GGUF_TENSORS = [
    ("w.f32", "F32", (3, 64)), ("w.f16", "F16", (4, 32)), ("w.bf16", "BF16", (2, 32)),
    ("w.q8", "Q8_0", (5, 64)), ("w.q4", "Q4_0", (3, 96)), ("w.q41", "Q4_1", (4, 64)), ("w.q50", "Q5_0", (3, 64)), ("w.q51", "Q5_1", (2, 96)),
    ("w.q2k", "Q2_K", (2, 256)), ("w.q3k", "Q3_K", (3, 512)), ("w.q4k", "Q4_K", (2, 512)), ("w.q5k", "Q5_K", (3, 256)),
    ("w.q6k", "Q6_K", (2, 768)), ("vec", "F32", (7,)),
    ("cube", "F16", (2, 3, 4)), ("four", "F32", (2, 1, 3, 2)), ("q8.vec", "Q8_0", (64,)),
    ("last", "F32", (8,)),    # 32 bytes: ends the file without padding
]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    values = {name: tensor_values(shape) for name, _, shape in GGUF_TENSORS}
    stored = write_gguf(path, [(n, d, values[n]) for n, d, _ in GGUF_TENSORS])
    return path, values, stored


def test_gguf_metadata_of_every_type(gguf_file):
    with open_checkpoint(gguf_file[0]) as ck:
        assert ck.format == "gguf"
        expected = {"general.architecture": "test"}
        expected.update({k: v for k, _, v in METADATA})
        expected.update({k: v for k, v, _ in ARRAYS})
        assert ck.metadata == expected
        assert list(ck.metadata) == list(expected)   # file order
        assert type(ck.metadata["t.true"]) is bool and ck.metadata["t.bools"] == [True, False, True]
        assert all(type(b) is bool for b in ck.metadata["t.bools"])
        assert type(ck.metadata["t.u64"]) is int and type(ck.metadata["t.f32"]) is float


def test_gguf_tensors_of_every_dtype(gguf_file):
    path, values, stored = gguf_file
    with open_checkpoint(path) as ck:
        assert list(ck.tensors) == [n for n, _, _ in GGUF_TENSORS]
        assert ck.nbytes == sum(len(b) for b in stored.values())
        for name, dtype, shape in GGUF_TENSORS:
            t = ck.tensors[name]
            assert isinstance(t, TensorInfo)
            assert (t.name, t.dtype, t.shape, t.file) == (name, dtype, shape, str(path))
            assert t.offset % 32 == 0 and t.nbytes == len(stored[name])
            raw = ck.raw(name)
            assert isinstance(raw, memoryview) and raw.readonly and raw.tobytes() == stored[name]
            count = int(np.prod(shape))
            deq = ck.dequantize(name)
            assert deq.dtype == np.float32 and deq.shape == shape
            np.testing.assert_array_equal(deq.reshape(-1), ref_dequantize(stored[name], dtype, count))
            if dtype not in ("F32", "F16"):
                oracle = gguf.quants.dequantize(np.frombuffer(stored[name], np.uint8).reshape(
                    int(np.prod(shape[:-1])), -1), QT[dtype])
                np.testing.assert_array_equal(deq.reshape(-1), oracle.reshape(-1))
            if dtype in ("Q8_0", "Q4_0"):
                assert quantize(values[name], dtype).tobytes() == stored[name]     # ours == gguf's
            if dtype == "F32":
                np.testing.assert_array_equal(deq, values[name])


def test_gguf_array_forms(gguf_file):
    path, values, stored = gguf_file
    with open_checkpoint(path) as ck:
        f32 = ck.array("w.f32")
        assert f32.dtype == np.dtype("<f4") and f32.shape == (3, 64) and not f32.flags.writeable
        np.testing.assert_array_equal(f32, values["w.f32"])
        f16 = ck.array("cube")
        assert f16.dtype == np.dtype("<f2") and f16.shape == (2, 3, 4) and not f16.flags.writeable
        np.testing.assert_array_equal(f16, values["cube"].astype(np.float16))
        bf16 = ck.array("w.bf16")
        assert bf16.dtype == np.float32 and bf16.shape == (2, 32)
        np.testing.assert_array_equal(bf16, ck.dequantize("w.bf16"))
        q8 = ck.array("w.q8")
        assert q8.dtype == np.uint8 and q8.shape == (5, 2 * 34)
        assert q8.tobytes() == stored["w.q8"]
        assert ck.array("w.q4").shape == (3, 3 * 18)
        assert ck.array("w.q6k").shape == (2, 3 * 210)
        assert ck.array("q8.vec").shape == (1, 2 * 34)


def test_gguf_agrees_with_gguf_reader(gguf_file):
    path = gguf_file[0]
    reader = gguf.GGUFReader(path)
    with open_checkpoint(path) as ck:
        assert [t.name for t in reader.tensors] == list(ck.tensors)
        for rt in reader.tensors:
            t = ck.tensors[rt.name]
            assert t.offset == rt.data_offset
            assert t.shape == tuple(int(d) for d in reversed(rt.shape))   # GGUFReader keeps ne order
            assert t.dtype == rt.tensor_type.name and t.nbytes == rt.n_bytes
        assert reader.fields["t.tokens"].contents() == ck.metadata["t.tokens"]
        assert reader.fields["t.u64"].contents() == ck.metadata["t.u64"]


def test_gguf_version_2_reads_the_same(gguf_file, tmp_path):
    path = gguf_file[0]
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 2)
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(bytes(data))
    with open_checkpoint(path) as a, open_checkpoint(v2) as b:
        assert a.metadata == b.metadata
        assert [(t.name, t.dtype, t.shape, t.offset, t.nbytes) for t in a.tensors.values()] == \
               [(t.name, t.dtype, t.shape, t.offset, t.nbytes) for t in b.tensors.values()]


def test_gguf_custom_alignment(tmp_path):
    path = tmp_path / "a.gguf"
    stored = write_gguf(path, [("a", "F32", tensor_values((3,))), ("b", "Q8_0", tensor_values((2, 32)))],
                        alignment=64, metadata=False)
    with open_checkpoint(path) as ck:
        assert ck.metadata["general.alignment"] == 64
        assert all(t.offset % 64 == 0 for t in ck.tensors.values())
        assert ck.raw("b").tobytes() == stored["b"]
        assert [t.data_offset for t in gguf.GGUFReader(path).tensors] == [t.offset for t in ck.tensors.values()]


def test_directory_with_one_gguf(gguf_file):
    with open_checkpoint(gguf_file[0].parent) as ck:
        assert ck.format == "gguf" and "w.q4" in ck.tensors


def test_close_and_context_manager(gguf_file):
    ck = open_checkpoint(gguf_file[0])
    view = ck.array("w.f32")          # outlives close(): the mapping stays until it goes
    raw = ck.raw("w.q8")
    ck.close()
    assert view.sum() == pytest.approx(float(gguf_file[1]["w.f32"].sum()), rel=1e-5)
    assert len(raw) == ck.tensors["w.q8"].nbytes
    with pytest.raises(WeightsError, match="closed"):
        ck.raw("w.f32")
    ck.close()                         # idempotent
    with open_checkpoint(gguf_file[0]) as ck2:
        with pytest.raises(WeightsError, match="no tensor 'nope'"):
            ck2.array("nope")
    with pytest.raises(WeightsError, match="closed"):
        ck2.dequantize("w.f32")
    assert isinstance(ck2, Checkpoint)


# --- Quantizers -------------------------------------------------------------------

def edge_blocks():
    blocks = [
        np.zeros(32), np.full(32, -3.0), np.arange(32) - 16.0, np.arange(32) * 0.25,
        np.where(np.arange(32) % 2, 1.0, -1.0), np.linspace(-1, 1, 32) * 1e-3,
        np.r_[5.0, np.full(31, -5.0)], np.r_[np.full(31, 0.5), -8.0], np.r_[-2.0, 2.0, np.zeros(30)],
        np.full(32, 1e-30), np.r_[1e-30, np.zeros(31)],     # scales too small for f16: stored as 0
        np.full(32, 60000.0) * np.where(np.arange(32) < 16, 1, -1),
    ]
    return np.stack(blocks).astype(np.float32)


@pytest.mark.parametrize("dtype", ["Q8_0", "Q4_0"])
def test_quantize_matches_ggml_reference(dtype):
    values = np.concatenate([edge_blocks(), RNG.standard_normal((64, 32)).astype(np.float32) * 3])
    mine = quantize(values.reshape(-1, 64), dtype)
    oracle = gguf.quants.quantize(values.reshape(-1, 64), QT[dtype])
    assert mine.dtype == np.uint8
    assert mine.shape == oracle.shape == (values.size // 64, 2 * (34 if dtype == "Q8_0" else 18))
    assert mine.tobytes() == oracle.tobytes()
    count = values.size
    np.testing.assert_array_equal(dequantize_blocks(mine, dtype, count), ref_dequantize(mine.tobytes(), dtype, count))


@pytest.mark.parametrize("dtype", ["Q8_0", "Q4_0"])
def test_quantize_subnormal_scale(dtype):
    # 1/d overflows here, where ggml's float-to-int cast is undefined; Loom keeps the block zero.
    x = np.r_[1e-40, -1e-41, np.zeros(30)].astype(np.float32)
    q = quantize(x, dtype)
    assert np.frombuffer(q[:2].tobytes(), "<f2")[0] == 0
    np.testing.assert_array_equal(dequantize_blocks(q, dtype, 32), np.zeros(32))


def test_quantize_worked_examples():
    # Q8_0: amax 127 -> d = 1 and the values come back exactly.
    x = np.arange(-15, 17, dtype=np.float32) * 127 / 16
    x[0] = -127.0
    q = quantize(x, "Q8_0")
    assert np.frombuffer(q[:2].tobytes(), "<f2")[0] == 1.0
    assert list(q[2:].view(np.int8)) == [int(np.sign(v) * np.floor(abs(v) + 0.5)) for v in x]
    # Q4_0: the peak -8 -> d = 1; 2.5 rounds by trunc(2.5 + 8.5) = 11; element j+16 in the high nibble.
    y = np.zeros(32, np.float32)
    y[0], y[1], y[16], y[17] = -8.0, 2.5, 7.0, -3.4
    q = quantize(y, "Q4_0")
    assert np.frombuffer(q[:2].tobytes(), "<f2")[0] == 1.0
    assert q[2] == (0 | (15 << 4)) and q[3] == (11 | (5 << 4)) and q[4] == (8 | (8 << 4))
    np.testing.assert_array_equal(dequantize_blocks(q, "Q4_0", 32)[[0, 1, 16, 17]], [-8, 3, 7, -3])


# Error bound in steps d: rounding (Q4_0 spends its top step on the negative side,
# so +amax may land a whole step off), plus the f16 scale's error times the largest quant.
@pytest.mark.parametrize("dtype,steps,levels", [("Q8_0", 0.5 + 127 * 2**-11, 127), ("Q4_0", 1 + 8 * 2**-11, 8)])
def test_quantize_error_bound(dtype, steps, levels):
    x = RNG.standard_normal((8, 128)).astype(np.float32)
    back = dequantize_blocks(quantize(x, dtype), dtype, x.size).reshape(x.shape)
    d = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / levels
    assert (np.abs(back - x).reshape(-1, 32) <= d * steps * 1.0001).all()


def random_superblocks(dtype, count, seed):
    """Random bytes (every quant and integer sub-block scale pattern) with finite f16 fields."""
    r = np.random.default_rng(seed)
    blocks = r.integers(0, 256, (count, KQ_SIZES[dtype]), dtype=np.uint8)
    for at in SCALE_FIELDS[dtype]:
        blocks[:, at:at + 2] = (r.standard_normal(count) * 0.1).astype("<f2").view(np.uint8).reshape(-1, 2)
    return blocks


@pytest.mark.parametrize("dtype", list(KQ_SIZES))
def test_kquant_dequantize_random_superblocks(dtype):
    """Random superblocks decode as ggml's loops do (this file) and as gguf.quants does, exactly."""
    blocks = random_superblocks(dtype, 9, sum(map(ord, dtype)))
    mine = dequantize_blocks(blocks, dtype, 9 * 256)
    assert mine.dtype == np.float32 and mine.shape == (9 * 256,)
    np.testing.assert_array_equal(mine, ref_dequantize(blocks.tobytes(), dtype, 9 * 256))
    np.testing.assert_array_equal(mine, gguf.quants.dequantize(blocks, QT[dtype]).reshape(-1))


def kquant_edge_rows():
    """Superblocks of awkward values, one a row: zeros, a constant negative, all positive,
    one dominant value of either sign, values too small for f16 scales, big values, and
    sub-blocks of very different scales side by side."""
    ramp = np.linspace(-1, 1, 256)
    rows = [np.zeros(256), np.full(256, -3.0), np.abs(ramp) + 0.5, np.r_[-40.0, ramp[1:] * 1e-3],
            np.r_[ramp[:-1] * 1e-3, 40.0], np.full(256, 1e-30), np.r_[1e-30, np.zeros(255)],
            ramp * 3e4, ramp * np.repeat(10.0 ** np.arange(-4, 4), 32)]
    return np.stack(rows).astype(np.float32)


# Error bounds of quantize's K-quants (see its helpers), per element of sub-block j:
# affine types (Q2_K, Q4_K, Q5_K, range [lo, hi] with lo = min(x, 0), nmax steps):
#   (hi - lo) / nmax / 2 + (nmax + 1) * d / 2 + dmin / 2 (the scale and min rounding);
# symmetric types (Q3_K, Q6_K, peak |x| mapped to qmin): |x|max / |qmin| + (|qmin| + 1) * |d|.
KQ_QUANT = {"Q2_K": ("affine", 16, 3), "Q3_K": ("symmetric", 16, 4), "Q4_K": ("affine", 32, 15),
            "Q5_K": ("affine", 32, 31), "Q6_K": ("symmetric", 16, 32)}


@pytest.mark.parametrize("dtype", list(KQ_SIZES))
def test_kquant_quantize_is_valid_and_bounded(dtype):
    edges, sigma = len(kquant_edge_rows()), 2.0
    x = np.concatenate([kquant_edge_rows(), RNG.standard_normal((7, 256)).astype(np.float32) * sigma])
    x = x.reshape(-1, 512)                            # rows of two superblocks
    q = quantize(x, dtype)
    assert q.dtype == np.uint8 and q.shape == (len(x), 2 * KQ_SIZES[dtype])
    back = gguf.quants.dequantize(q, QT[dtype])       # an independent decoder of the bytes
    assert np.isfinite(back).all()
    np.testing.assert_array_equal(dequantize_blocks(q, dtype, x.size), back.reshape(-1))
    blocks = q.reshape(-1, KQ_SIZES[dtype])
    fields = [np.abs(blocks[:, at:at + 2].copy().view("<f2").astype(np.float64)) for at in SCALE_FIELDS[dtype]]
    kind, size, levels = KQ_QUANT[dtype]
    sub = x.reshape(len(blocks), -1, size).astype(np.float64)
    if kind == "affine":
        d, dmin = fields
        lo = np.minimum(sub.min(axis=2), 0)
        bound = (sub.max(axis=2) - lo) / levels / 2 + (levels + 1) * d / 2 + dmin / 2
    else:
        bound = np.abs(sub).max(axis=2) / levels + (levels + 1) * fields[0]
    err = np.abs(back.reshape(sub.shape) - sub)
    # (+ 1e-30: values far below f16's smallest scale, as in two edge rows, decode to zero)
    assert (err <= bound[..., None] * (1 + 1e-3) + 1e-30).all()
    assert not back[0, :256].any()                    # zeros stay exactly zero
    # useful, not only valid: on normal values the rms error stays near a rounding step's
    # (a sub-block's range, about 5 sigma, / levels / sqrt(12), so under 2 sigma / levels)
    noise = (back.reshape(-1, 256) - x.reshape(-1, 256))[edges:]
    assert np.sqrt((noise ** 2).mean()) < 2 * sigma / levels


def test_quantizer_rejections():
    with pytest.raises(WeightsError, match="multiple of 32"):
        quantize(np.zeros((2, 48), np.float32), "Q8_0")
    with pytest.raises(WeightsError, match="NaN"):
        quantize(np.r_[np.nan, np.zeros(31)], "Q4_0")
    with pytest.raises(WeightsError, match="dtype"):
        quantize(np.zeros(32), "Q4_1")
    with pytest.raises(WeightsError, match="multiple of 256 for Q4_K"):
        quantize(np.zeros((2, 896), np.float32), "Q4_K")
    with pytest.raises(WeightsError, match="too large for Q6_K"):
        quantize(np.full(256, 3e38, np.float32), "Q6_K")
    with pytest.raises(WeightsError, match="68 bytes, got 67"):
        dequantize_blocks(bytes(67), "Q8_0", 64)
    with pytest.raises(WeightsError, match="multiple of 32"):
        dequantize_blocks(bytes(34), "Q8_0", 33)
    with pytest.raises(WeightsError, match="unknown dtype"):
        dequantize_blocks(bytes(4), "F64", 1)
    np.testing.assert_array_equal(dequantize_blocks(np.float16([1, 2]).tobytes(), "F16", 2), [1, 2])
    np.testing.assert_array_equal(dequantize_blocks(bytearray(b"\x80\x3f"), "BF16", 1), [1.0])
    np.testing.assert_array_equal(dequantize_blocks(np.float32([[3]]), "F32", 1), [3])


# --- GGUF: broken and lying files, byte by byte ------------------------------------

def gstr(s) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, value) -> bytes:
    """One metadata entry; `value` is packed bytes for the raw cases (vtype given as int)."""
    codes = {VT.UINT8: "B", VT.INT8: "b", VT.UINT16: "H", VT.INT16: "h", VT.UINT32: "I", VT.INT32: "i",
             VT.FLOAT32: "f", VT.BOOL: "?", VT.UINT64: "Q", VT.INT64: "q", VT.FLOAT64: "d"}
    if isinstance(value, bytes):
        body = value
    elif vtype == VT.STRING:
        body = gstr(value)
    else:
        body = struct.pack("<" + codes[vtype], value)
    return gstr(key) + struct.pack("<I", vtype) + body


def tinfo(name, ne, type_id, offset) -> bytes:
    return gstr(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, type_id, offset)


def gguf_bytes(kvs=(), infos=(), data=b"", *, version=3, n_kv=None, n_tensors=None, alignment=32, magic=b"GGUF"):
    head = magic + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    return body + bytes(-len(body) % alignment) + data if data else body


def f32_info(name="x", n=8, offset=0):
    return tinfo(name, [n], 0, offset)


def open_bytes(tmp_path, data, name="m.gguf"):
    path = tmp_path / name
    path.write_bytes(data)
    return open_checkpoint(path)


def case_id(value):
    """Name a parametrized rejection after its expected message, not its bytes."""
    return value[:60] if isinstance(value, str) else "-"


def rejects(tmp_path, data, match, name="m.gguf"):
    with pytest.raises(WeightsError, match=match) as e:
        open_bytes(tmp_path, data, name).close()
    assert e.value.message == str(e.value) and e.value.message.startswith(str(tmp_path / name) + ": ")
    return e.value.message


def test_handmade_gguf_is_valid(tmp_path):
    data = np.arange(8, dtype=np.float32).tobytes()
    kvs = [kv("a", VT.STRING, "b"), kv("empty", VT.ARRAY, struct.pack("<IQ", VT.INT32, 0))]
    with open_bytes(tmp_path, gguf_bytes(kvs, [f32_info()], data)) as ck:
        assert ck.metadata == {"a": "b", "empty": []}
        np.testing.assert_array_equal(ck.array("x"), np.arange(8))
    with open_bytes(tmp_path, gguf_bytes([kv("k", VT.UINT8, 1)])) as ck:   # no tensors at all
        assert ck.tensors == {} and ck.nbytes == 0


@pytest.mark.parametrize("data,match", [
    (gguf_bytes(magic=b"GGML"), r"not a GGUF file: magic is b'GGML'"),
    (gguf_bytes(version=1), "GGUF version 1 is not supported; Loom reads versions 2 and 3"),
    (gguf_bytes(version=4), "GGUF version 4 is not supported"),
    (gguf_bytes(version=3 << 24), r"big-endian GGUF \(version 3\) is not supported"),
    (b"GGUF\x03\0\0\0", "the file has 8 bytes; a GGUF header needs at least 24"),
    (b"", "the file has 0 bytes"),
], ids=case_id)
def test_gguf_header_rejections(tmp_path, data, match):
    rejects(tmp_path, data, match)


def test_gguf_big_endian_file_from_writer(tmp_path):
    path = tmp_path / "be.gguf"
    write_gguf(path, [("a", "F32", tensor_values((4,)))], endianess=gguf.GGUFEndian.BIG, metadata=False)
    with pytest.raises(WeightsError, match="big-endian GGUF"):
        open_checkpoint(path)


def test_gguf_every_truncation_rejects(gguf_file, tmp_path):
    data = gguf_file[0].read_bytes()
    last = gguf.GGUFReader(gguf_file[0]).tensors[-1]
    assert last.data_offset + last.n_bytes == len(data)     # so every shorter file lacks something
    path = tmp_path / "cut.gguf"
    for cut in list(range(0, 2000)) + list(range(2000, len(data), 7)) + [len(data) - 1]:
        path.write_bytes(data[:cut])
        with pytest.raises(WeightsError):
            open_checkpoint(path)


HUGE = 2**63 - 5


@pytest.mark.parametrize("data,match", [
    (gguf_bytes(n_kv=HUGE), f"{HUGE} metadata entries needs bytes 24..\\d+ but the file has 24 bytes"),
    (gguf_bytes(n_tensors=HUGE), f"{HUGE} tensor infos"),
    (gguf_bytes([struct.pack("<Q", HUGE) + b"key" + bytes(8)]),
     r"metadata key 0 needs bytes 32\.\.\d+ but the file has 43 bytes"),
    (gguf_bytes([kv("s", VT.STRING, struct.pack("<Q", HUGE) + b"abc")]), r"metadata 's' needs bytes"),
    (gguf_bytes([kv("a", VT.ARRAY, struct.pack("<IQ", VT.UINT8, HUGE) + b"abc")]),
     f"metadata 'a' \\({HUGE} array elements\\)"),
    (gguf_bytes([kv("a", VT.ARRAY, struct.pack("<IQ", VT.STRING, HUGE // 8) + bytes(64))]), "array elements"),
    (gguf_bytes([kv("a", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, HUGE // 12) + bytes(64))]), "array elements"),
    (gguf_bytes([kv("a", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 1) + struct.pack("<IQ", VT.UINT64, HUGE))]),
     r"metadata 'a'\[0\] \(\d+ array elements\)"),
    (gguf_bytes(infos=[gstr("x") + struct.pack("<I", 4) + bytes(20)]),
     "dimensions of tensor 'x' needs bytes 37..69 but the file has 57 bytes"),
    (gguf_bytes(infos=[struct.pack("<Q", HUGE) + bytes(32)]),
     r"name of tensor 0 needs bytes 32\.\.\d+ but the file has 64 bytes"),
], ids=case_id)
def test_gguf_lying_counts_reject_without_allocating(tmp_path, data, match):
    tracemalloc.start()
    try:
        rejects(tmp_path, data, match)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("kvs,infos,data,match", [
    ([kv("k", VT.UINT8, 1), kv("k", VT.UINT8, 2)], [], b"", "duplicate metadata key 'k'"),
    ([], [f32_info("x", 8, 0), f32_info("x", 8, 32)], bytes(64), "duplicate tensor name 'x'"),
    ([], [tinfo("blk.0.attn_q.weight", [256, 2], 23, 0)], bytes(288),
     r"tensor 'blk.0.attn_q.weight' has type IQ4_XS \(23\), which Loom does not support; "
     r"supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K$"),
    ([], [tinfo("w", [256], 35, 0)], bytes(64), r"tensor 'w' has type TQ2_0 \(35\), which Loom does not support"),
    ([], [tinfo("w", [256], 20, 0)], bytes(64), r"tensor 'w' has type IQ4_NL \(20\), which Loom does not support"),
    ([], [tinfo("t", [4], 28, 0)], bytes(32), r"tensor 't' has type F64 \(28\), which Loom does not support"),
    ([], [tinfo("t", [4], 99, 0)], bytes(32), r"tensor 't' has type unknown \(99\)"),
    ([], [tinfo("q", [48, 2], 8, 0)], bytes(128),
     "tensor 'q' is Q8_0 with a row of 48 values; quantized rows must be a multiple of 32"),
    ([], [tinfo("q", [16], 2, 0)], bytes(32), "Q4_0 with a row of 16 values"),
    ([], [tinfo("blk.0.attn_q.weight", [896, 2], 12, 0)], bytes(7 * 144),
     "tensor 'blk.0.attn_q.weight' is Q4_K with a row of 896 values; quantized rows must be a multiple of 256"),
    ([], [tinfo("t", [], 0, 0)], bytes(32), "tensor 't' has 0 dimensions; GGUF allows 1 to 4"),
    ([], [tinfo("t", [1] * 5, 0, 0)], bytes(32), "tensor 't' has 5 dimensions"),
    ([], [tinfo("t", [4, 0], 0, 0)], bytes(32), r"tensor 't' has dimensions \[4, 0\]; each must be positive"),
    ([], [tinfo("t", [2**32, 2**32, 2**32], 0, 0)], bytes(32), "product at most 2\\*\\*63-1"),
    ([], [f32_info("x", 8, 16)], bytes(64), "tensor 'x' data offset 16 is not a multiple of the alignment 32"),
    ([], [f32_info("x", 8, 0), f32_info("y", 16, 0)], bytes(64),
     r"tensors 'x' \(bytes 96\.\.128\) and 'y' \(bytes 96\.\.160\) overlap"),
    ([], [f32_info("x", 16, 0), f32_info("y", 8, 32)], bytes(96), r"tensors 'x' .* and 'y' .* overlap"),
    ([], [f32_info("x", 1024, 0)], bytes(100), r"tensor 'x' needs bytes 64\.\.4160 but the file has 164 bytes"),
    ([], [f32_info("x", 8, 2**64 - 32)], bytes(32),
     r"tensor 'x' needs bytes 18446744073709551648\.\.18446744073709551680 but the file has 96 bytes"),
    ([kv("general.alignment", VT.UINT32, 0)], [], b"", "general.alignment 0 is not a power of two"),
    ([kv("general.alignment", VT.UINT32, 48)], [], b"", "general.alignment 48 is not a power of two"),
    ([kv("general.alignment", VT.INT32, 32)], [], b"", "general.alignment must be a uint32, got value type 5"),
    ([kv("general.alignment", VT.STRING, "32")], [], b"", "general.alignment must be a uint32"),
    ([kv(b"\xff\xfe", VT.UINT8, 1)], [], b"", r"metadata key 0 at bytes 32\.\.34 is not valid UTF-8 \(byte 32\)"),
    ([kv("s", VT.STRING, b"\x02\0\0\0\0\0\0\0\xc3\x28")], [], b"",
     r"metadata 's' at bytes 45\.\.47 is not valid UTF-8 \(byte 45\)"),
    ([], [tinfo(b"\x80", [8], 0, 0)], bytes(32), r"name of tensor 0 at bytes 32\.\.33 is not valid UTF-8"),
    ([kv("a", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2) + gstr("ok") + gstr(b"\xed\xa0\x80"))], [], b"",
     r"metadata 'a'\[1\] at bytes \d+\.\.\d+ is not valid UTF-8"),
    ([kv("b", VT.BOOL, b"\x02")], [], b"", "metadata 'b' is a bool stored as 2; expected 0 or 1"),
    ([kv("b", VT.ARRAY, struct.pack("<IQ", VT.BOOL, 3) + b"\x01\x00\x07")], [], b"", "holds a bool stored as 7"),
    ([kv("v", 13, b"\0" * 8)], [], b"", "metadata 'v' has unknown value type 13"),
    ([kv("v", VT.ARRAY, struct.pack("<IQ", 77, 1) + bytes(8))], [], b"", "is an array of unknown value type 77"),
    ([kv("deep", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 1) * 9 + struct.pack("<IQ", VT.UINT8, 0))], [], b"",
     "nests arrays deeper than 8 levels"),
], ids=case_id)
def test_gguf_structural_rejections(tmp_path, kvs, infos, data, match):
    rejects(tmp_path, gguf_bytes(kvs, infos, data), match)


def test_gguf_nesting_up_to_the_limit_reads(tmp_path):
    nested = struct.pack("<IQ", VT.ARRAY, 1) * 7 + struct.pack("<IQ", VT.UINT8, 1) + b"\x05"
    with open_bytes(tmp_path, gguf_bytes([kv("deep", VT.ARRAY, nested)])) as ck:
        assert ck.metadata["deep"] == [[[[[[[[5]]]]]]]]


def test_gguf_tensors_may_leave_gaps_and_come_in_any_order(tmp_path):
    data = np.arange(8, dtype=np.float32).tobytes() + bytes(32) + np.arange(8, 16, dtype=np.float32).tobytes()
    with open_bytes(tmp_path, gguf_bytes([], [f32_info("late", 8, 64), f32_info("early", 8, 0)], data)) as ck:
        assert list(ck.tensors) == ["late", "early"]
        np.testing.assert_array_equal(ck.array("late"), np.arange(8, 16))
        np.testing.assert_array_equal(ck.array("early"), np.arange(8))


# --- safetensors -------------------------------------------------------------------

def st_bytes(header, data=b"", *, header_len=None) -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(head) if header_len is None else header_len) + head + data


def bf16_file(path, tensors, metadata=None):
    """Hand-written safetensors with BF16 tensors (numpy has no bfloat16)."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, values in tensors.items():
        raw = (f32_exact(values).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(values.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    path.write_bytes(st_bytes(header, data))


def test_safetensors_file_with_config(tmp_path):
    tensors = {"emb": tensor_values((5, 4)), "norm": tensor_values((4,)).astype(np.float16),
               "scalar": np.array(2.5, np.float32), "empty": np.zeros((0, 3), np.float32)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt", "note": "ü"})
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4, "architectures": ["X"]}))
    for target in (tmp_path / "model.safetensors", tmp_path):
        with open_checkpoint(target) as ck:
            assert ck.format == "safetensors"
            assert ck.metadata == {"__metadata__": {"format": "pt", "note": "ü"},
                                   "config": {"hidden_size": 4, "architectures": ["X"]}}
            assert set(ck.tensors) == set(tensors)
            offsets = [t.offset for t in ck.tensors.values()]
            assert offsets == sorted(offsets)          # file order
            for name, values in tensors.items():
                t = ck.tensors[name]
                assert t.shape == values.shape and t.dtype == {"float32": "F32", "float16": "F16"}[values.dtype.name]
                assert t.file == str(tmp_path / "model.safetensors") and t.nbytes == values.nbytes
                a = ck.array(name)
                assert a.dtype == values.dtype and not a.flags.writeable
                np.testing.assert_array_equal(a, values)
                assert ck.raw(name).tobytes() == values.tobytes()
                np.testing.assert_array_equal(ck.dequantize(name), values.astype(np.float32))
            assert ck.nbytes == sum(v.nbytes for v in tensors.values())


def test_safetensors_bf16(tmp_path):
    values = {"w": np.array([[1.0, -2.5, 3.140625], [1e30, -1e-30, 0.0]], np.float32)}
    path = tmp_path / "model.safetensors"
    bf16_file(path, values, metadata={"format": "pt"})
    with open_checkpoint(path) as ck:
        assert ck.tensors["w"].dtype == "BF16" and ck.tensors["w"].nbytes == 12 and "config" not in ck.metadata
        a = ck.array("w")
        assert a.dtype == np.float32 and a.shape == (2, 3)
        np.testing.assert_array_equal(a, f32_exact(values["w"]))
        np.testing.assert_array_equal(ck.dequantize("w"), f32_exact(values["w"]))
        np.testing.assert_array_equal(ck.dequantize("w").reshape(-1), ref_dequantize(ck.raw("w").tobytes(), "BF16", 6))


def write_shards(folder, *, index=None):
    a = {"a.w": tensor_values((2, 3)), "a.b": tensor_values((3,))}
    b = {"b.w": tensor_values((4, 2)).astype(np.float16)}
    save_file(a, str(folder / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(b, str(folder / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    if index is None:
        index = {"metadata": {"total_size": 52},
                 "weight_map": {"b.w": "model-00002-of-00002.safetensors", "a.w": "model-00001-of-00002.safetensors",
                                "a.b": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return {**a, **b}


def test_safetensors_sharded(tmp_path):
    values = write_shards(tmp_path)
    (tmp_path / "config.json").write_text('{"n": 1}')
    for target in (tmp_path / "model.safetensors.index.json", tmp_path):
        with open_checkpoint(target) as ck:
            assert ck.metadata == {"__metadata__": {"format": "pt"}, "index": {"total_size": 52}, "config": {"n": 1}}
            assert list(ck.tensors)[0] == "b.w"        # shards in the index's order
            assert set(ck.tensors) == set(values)
            for name, v in values.items():
                shard = "model-00002-of-00002.safetensors" if name == "b.w" else "model-00001-of-00002.safetensors"
                assert ck.tensors[name].file == str(tmp_path / shard)
                np.testing.assert_array_equal(ck.array(name), v)
                assert ck.raw(name).tobytes() == v.tobytes()
            assert ck.nbytes == 52


def test_safetensors_every_truncation_rejects(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": tensor_values((3, 5)), "b": tensor_values((7,)).astype(np.float16)}, str(path), metadata={"k": "v"})
    data = path.read_bytes()
    cut_path = tmp_path / "cut.safetensors"
    for cut in range(len(data)):
        cut_path.write_bytes(data[:cut])
        with pytest.raises(WeightsError):
            open_checkpoint(cut_path)


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize("data,match", [
    (b"\x05\0\0", "the file has 3 bytes; the safetensors header length needs at least 8"),
    (st_bytes(b"{}", header_len=1000), "header needs bytes 8..1008 but the file has 10 bytes"),
    (st_bytes(b"{}", header_len=2**63), "header length 9223372036854775808 exceeds the format's limit"),
    (st_bytes(b"{not json"), "header is not valid JSON"),
    (st_bytes(b"\xff{}"), "header is not valid UTF-8"),
    (st_bytes(b"[1, 2]"), "header must be a JSON object, got list"),
    (st_bytes(b'{"x": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "x": {}}'), "duplicate key 'x'"),
    (st_bytes(b'{"x": NaN}'), "NaN is not JSON"),
    (st_bytes(b"[" * 100000 + b"]" * 100000), "header is not valid JSON"),
    (st_bytes({"__metadata__": {"a": 1}}), "__metadata__ must be an object of string values"),
    (st_bytes({"__metadata__": ["a"]}), "__metadata__ must be an object"),
    (st_bytes({"x": entry("BOOL", (8,))}, bytes(8)),
     "tensor 'x' has dtype 'BOOL', which Loom does not support; supported: F32, F16, BF16"),
    (st_bytes({"x": entry("C64", (1,))}, bytes(8)), "tensor 'x' has dtype 'C64'"),
    (st_bytes({"x": entry(["F32"])}, bytes(8)), r"tensor 'x' has dtype \['F32'\]"),
    (st_bytes({"x": {**entry(), "extra": 1}}, bytes(8)),
     "must be an object with exactly dtype, shape and data_offsets"),
    (st_bytes({"x": [1]}), "must be an object with exactly"),
    (st_bytes({"x": entry(shape=(-2,))}, bytes(8)), "shape must be a list of at most 8 non-negative integers"),
    (st_bytes({"x": entry(shape=(True, 2))}, bytes(8)), "shape must be a list"),
    (st_bytes({"x": entry(shape=[1] * 9, offsets=(0, 4))}, bytes(8)), "at most 8"),
    (st_bytes({"x": entry(offsets=(0, 8, 9))}, bytes(8)), "data_offsets must be two non-negative integers"),
    (st_bytes({"x": entry(offsets=(0, 8.0))}, bytes(8)), "data_offsets must be two"),
    (st_bytes({"x": entry(offsets=(8, 16))}, bytes(8)),
     r"tensor 'x' data_offsets \[8, 16\] fall outside the data section"),
    (st_bytes({"x": entry(offsets=(8, 0))}, bytes(8)), r"data_offsets \[8, 0\] fall outside"),
    (st_bytes({"x": entry(offsets=(0, 2**64))}, bytes(8)), "data_offsets must be two"),
    (st_bytes({"x": entry(shape=(3,))}, bytes(8)), r"tensor 'x' is F32 \[3\] but data_offsets \[0, 8\] span 8 bytes"),
    (st_bytes({"x": entry(shape=(2**62, 2**62, 0))}, bytes(8)), "span 8 bytes"),
    (st_bytes({"x": entry(), "y": entry("F16", (4,), (4, 12))}, bytes(12)), "tensors 'x' .* and 'y' .* overlap"),
], ids=case_id)
def test_safetensors_rejections(tmp_path, data, match):
    rejects(tmp_path, data, match, name="model.safetensors")


def test_safetensors_gaps_are_fine(tmp_path):
    data = bytes(4) + np.float32([1, 2]).tobytes()
    with open_bytes(tmp_path, st_bytes({"x": entry(offsets=(4, 12))}, data), "m.safetensors") as ck:
        np.testing.assert_array_equal(ck.array("x"), [1, 2])


SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


@pytest.mark.parametrize("index,match", [
    ({"weight_map": {"a.w": "../" + SHARD1}},
     r"tensor 'a.w' maps to '\.\./model-00001-of-00002.safetensors'; shards must be plain file names"),
    ({"weight_map": {"a.w": "sub/" + SHARD1}}, "shards must be plain file names"),
    ({"weight_map": {"a.w": "/etc/passwd"}}, "shards must be plain file names"),
    ({"weight_map": {"a.w": "sub\\x"}}, "shards must be plain file names"),
    ({"weight_map": {"a.w": ".."}}, "shards must be plain file names"),
    ({"weight_map": {"a.w": 3}}, "shards must be plain file names"),
    ({"weight_map": {"a.w": "missing.safetensors"}}, "missing.safetensors: cannot read"),
    ({"weight_map": {"a.w": SHARD1, "a.b": SHARD1, "b.w": SHARD2, "ghost": SHARD2}},
     f"{SHARD2}: lacks tensor 'ghost', which the index .* maps to it"),
    ({"weight_map": {"a.w": SHARD1, "b.w": SHARD2}}, f"{SHARD1}: holds tensor 'a.b', which the index maps to None"),
    ({"weight_map": {"a.w": SHARD1, "a.b": SHARD2, "b.w": SHARD2}},
     "holds tensor 'a.b', which the index maps to 'model-00002"),
    ({"weight_map": []}, "weight_map and metadata must be objects"),
    ({"metadata": {}}, "the index must be an object with weight_map"),
    ({"weight_map": {}, "extra": 1}, "the index must be an object with weight_map"),
], ids=case_id)
def test_sharded_rejections(tmp_path, index, match):
    write_shards(tmp_path, index=index)
    with pytest.raises(WeightsError, match=match):
        open_checkpoint(tmp_path / "model.safetensors.index.json")


def test_sharded_duplicate_across_shards(tmp_path):
    save_file({"t": np.zeros(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    save_file({"t": np.ones(2, np.float32)}, str(tmp_path / "s2.safetensors"))
    save_file({"u": np.ones(2, np.float32)}, str(tmp_path / "s3.safetensors"))
    (tmp_path / "i.json").write_text(json.dumps({"weight_map": {"t": "s1.safetensors", "u": "s2.safetensors"}}))
    with pytest.raises(WeightsError, match="s2.safetensors: tensor 't' is also in .*s1.safetensors"):
        open_checkpoint(tmp_path / "i.json")
    (tmp_path / "i.json").write_text('{"weight_map": {"t": "s1.safetensors", "t": "s2.safetensors"}}')
    with pytest.raises(WeightsError, match="duplicate key 't'"):
        open_checkpoint(tmp_path / "i.json")


def test_sharded_metadata_must_agree(tmp_path):
    save_file({"t": np.zeros(2, np.float32)}, str(tmp_path / "s1.safetensors"), metadata={"format": "pt"})
    save_file({"u": np.zeros(2, np.float32)}, str(tmp_path / "s2.safetensors"), metadata={"format": "mlx"})
    (tmp_path / "i.json").write_text(json.dumps({"weight_map": {"t": "s1.safetensors", "u": "s2.safetensors"}}))
    with pytest.raises(WeightsError, match="__metadata__ 'format' is 'mlx' but an earlier shard says 'pt'"):
        open_checkpoint(tmp_path / "i.json")


def test_bad_config_json_rejects(tmp_path):
    save_file({"t": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"a": 1, "a": 2}')
    with pytest.raises(WeightsError, match=r"config.json: config.json is not valid JSON: duplicate key 'a'"):
        open_checkpoint(tmp_path / "model.safetensors")


def test_checkpoint_directory_rules(tmp_path):
    with pytest.raises(WeightsError, match="found none"):
        open_checkpoint(tmp_path)
    (tmp_path / "a.gguf").write_bytes(gguf_bytes())
    (tmp_path / "b.gguf").write_bytes(gguf_bytes())
    with pytest.raises(WeightsError, match=r"exactly one of .* found \['a.gguf', 'b.gguf'\]"):
        open_checkpoint(tmp_path)
    (tmp_path / "b.gguf").unlink()
    save_file({"t": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"found \['model.safetensors', 'a.gguf'\]"):
        open_checkpoint(tmp_path)
    (tmp_path / "a.gguf").unlink()
    with open_checkpoint(tmp_path) as ck:
        assert ck.format == "safetensors"
    with pytest.raises(WeightsError, match="not a checkpoint"):
        open_checkpoint(tmp_path / "weights.pt")
    (tmp_path / "model.bin").write_bytes(SMALL_CT2)      # a CTranslate2 model beside it: ambiguous
    with pytest.raises(WeightsError, match=r"found \['model.bin', 'model.safetensors'\]"):
        open_checkpoint(tmp_path)
    (tmp_path / "model.bin").unlink()
    with pytest.raises(WeightsError, match="cannot read"):
        open_checkpoint(tmp_path / "absent.gguf")
    os.mkdir(tmp_path / "dir.gguf")
    with pytest.raises(WeightsError):
        open_checkpoint(tmp_path / "dir.gguf")


# --- Fuzzing: mutated files open or reject, nothing else ----------------------------

def small_gguf() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s.gguf")
        w = gguf.GGUFWriter(path, arch="fz")
        w.add_uint32("n", 7)
        w.add_array("tok", ["a", "bc"])
        w.add_key_value("nest", [[1, 2], [3]], VT.ARRAY)
        w.add_tensor("f", np.arange(4, dtype=np.float32))
        w.add_tensor("h", np.arange(2, dtype=np.float16))
        w.add_tensor("q8", gguf.quants.quantize(np.linspace(-1, 1, 32, dtype=np.float32), QT.Q8_0), raw_dtype=QT.Q8_0)
        w.add_tensor("q4", gguf.quants.quantize(np.linspace(-1, 1, 32, dtype=np.float32), QT.Q4_0), raw_dtype=QT.Q4_0)
        w.add_tensor("b", gguf.quants.quantize(np.ones(2, np.float32), QT.BF16), raw_dtype=QT.BF16)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(path, "rb") as f:
            return f.read()


SMALL_GGUF = small_gguf()
SMALL_ST = st_bytes({"__metadata__": {"k": "v"}, "a": entry("F32", (2,), (0, 8)),
                     "b": entry("F16", (2, 1), (8, 12)), "c": entry("BF16", (1,), (12, 14))}, bytes(14))


@st.composite
def mutated(draw, original):
    data = bytearray(original)
    for _ in range(draw(st.integers(0, 4))):
        pos = draw(st.integers(0, len(data) - 1))
        kind = draw(st.sampled_from(["byte", "u64", "u32"]))
        if kind == "byte":
            data[pos] = draw(st.integers(0, 255))
        else:
            width = 8 if kind == "u64" else 4
            value = draw(st.one_of(st.integers(0, 64), st.integers(0, 2**(8 * width) - 1)))
            data[pos:pos + width] = value.to_bytes(width, "little")
    return bytes(data[:draw(st.integers(0, len(data)))])


def open_or_reject(folder, name, data):
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        f.write(data)
    try:
        ck = open_checkpoint(path)
    except WeightsError:
        return
    with ck:                    # what opened must read in full
        for tname in ck.tensors:
            ck.raw(tname)
            ck.array(tname)
            assert ck.dequantize(tname).shape == ck.tensors[tname].shape


# No deadline: pytest-timeout is the hang guard, and tests never assert timings.
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@FUZZ
@given(data=mutated(SMALL_GGUF))
def test_fuzz_gguf(fuzz_dir, data):
    open_or_reject(fuzz_dir, "fuzz.gguf", data)


@FUZZ
@given(data=mutated(SMALL_ST))
def test_fuzz_safetensors(fuzz_dir, data):
    open_or_reject(fuzz_dir, "fuzz.safetensors", data)


def test_fuzz_originals_open():
    with tempfile.TemporaryDirectory() as d:
        for name, data in (("o.gguf", SMALL_GGUF), ("o.safetensors", SMALL_ST)):
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
            with open_checkpoint(os.path.join(d, name)) as ck:
                assert len(ck.tensors) == (5 if name.endswith("gguf") else 3)


def test_write_safetensors_round_trips_through_both_readers(tmp_path):
    from safetensors.numpy import load_file

    from loom.weights import write_safetensors
    rng = np.random.default_rng(3)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float16)}
    path = tmp_path / "w.safetensors"
    write_safetensors(path, tensors, {"note": "x"})
    oracle = load_file(str(path))
    with open_checkpoint(path) as ckpt:
        for name, array in tensors.items():
            np.testing.assert_array_equal(ckpt.array(name), array)
            np.testing.assert_array_equal(oracle[name], array)
        assert ckpt.metadata["__metadata__"] == {"note": "x"}
    with pytest.raises(ValueError):
        write_safetensors(tmp_path / "bad.safetensors", {"i": np.zeros(2, np.int64)})
    assert not (tmp_path / "bad.safetensors").exists()


def test_safetensors_integer_buffers_are_readable(tmp_path):
    """Real checkpoints carry integer buffers (BERT's int64 position_ids) beside the weights."""
    from safetensors.numpy import save_file
    path = tmp_path / "w.safetensors"
    ids = np.arange(6, dtype=np.int64).reshape(1, 6)
    save_file({"position_ids": ids, "w": np.ones((2, 2), np.float32), "b": np.arange(3, dtype=np.uint8)}, str(path))
    with open_checkpoint(path) as ckpt:
        assert ckpt.tensors["position_ids"].dtype == "I64"
        np.testing.assert_array_equal(ckpt.array("position_ids"), ids)
        np.testing.assert_array_equal(ckpt.dequantize("b"), np.arange(3, dtype=np.float32))


# --- CTranslate2 model.bin ----------------------------------------------------------

CT2_TYPES = {np.float32: 0, np.int8: 1, np.int16: 2, np.int32: 3, np.float16: 4}


def ct2_string(text, nul=True):
    raw = text.encode() + (b"\0" if nul else b"")
    return struct.pack("<H", len(raw)) + raw


def ct2_variable(name, array, type_id=None, nbytes=None, rank=None):
    dims = array.shape
    return (ct2_string(name) + struct.pack("<B", len(dims) if rank is None else rank)
            + struct.pack(f"<{len(dims)}I", *dims)
            + struct.pack("<BI", CT2_TYPES[array.dtype.type] if type_id is None else type_id,
                          array.nbytes if nbytes is None else nbytes) + array.tobytes())


def ct2_bytes(variables, aliases=(), version=6, count=None, tail=b""):
    """A model.bin as CTranslate2's converter writes it (spec WhisperSpec, revision 3);
    `variables` are already-encoded entries (ct2_variable) so tests can make them lie."""
    out = struct.pack("<I", version) + ct2_string("WhisperSpec") + struct.pack("<II", 3, len(variables)
                                                                              if count is None else count)
    out += b"".join(variables) + struct.pack("<I", len(aliases))
    return out + b"".join(ct2_string(a) + ct2_string(t) for a, t in aliases) + tail


CT2_ARRAYS = {"decoder/embeddings/weight": np.arange(12, dtype=np.float16).reshape(4, 3) / 8,
              "encoder/conv1/weight": np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 4),
              "decoder/alignment_heads": np.array(1, np.int16),
              "decoder/activation": np.array(3, np.int8),
              "suppress": np.array([7, -2, 50000], np.int32)}
SMALL_CT2 = ct2_bytes([ct2_variable(n, a) for n, a in CT2_ARRAYS.items()],
                      aliases=[("decoder/projection/weight", "decoder/embeddings/weight")])


def test_ctranslate2_round_trip_with_alias_and_config(tmp_path):
    (tmp_path / "model.bin").write_bytes(SMALL_CT2)
    (tmp_path / "config.json").write_text('{"suppress_ids": [1, 2]}')
    with open_checkpoint(tmp_path) as ck:     # the directory form
        assert ck.format == "ctranslate2"
        assert ck.metadata["spec"] == "WhisperSpec" and ck.metadata["binary_version"] == 6
        assert ck.metadata["config"] == {"suppress_ids": [1, 2]}
        assert list(ck.tensors)[:len(CT2_ARRAYS)] == list(CT2_ARRAYS)
        for name, array in CT2_ARRAYS.items():
            got = ck.array(name)
            assert got.dtype == array.dtype and got.shape == array.shape
            np.testing.assert_array_equal(got, array)
        tied, table = ck.tensors["decoder/projection/weight"], ck.tensors["decoder/embeddings/weight"]
        assert (tied.offset, tied.nbytes, tied.shape) == (table.offset, table.nbytes, table.shape)
        np.testing.assert_array_equal(ck.dequantize("decoder/projection/weight"),
                                      CT2_ARRAYS["decoder/embeddings/weight"].astype(np.float32))


def test_ctranslate2_every_truncation_rejects(tmp_path):
    path = tmp_path / "model.bin"
    for cut in range(len(SMALL_CT2)):
        path.write_bytes(SMALL_CT2[:cut])
        with pytest.raises(WeightsError):
            open_checkpoint(path)


ONE = ct2_variable("w", np.zeros(2, np.float32))


@pytest.mark.parametrize("data,match", [
    (ct2_bytes([ONE], version=3), "binary version 3 is not supported"),
    (ct2_bytes([ONE], version=7), "binary version 7 is not supported"),
    (ct2_bytes([ct2_variable("w", np.zeros(2, np.float32), nbytes=4)]), r"states 4 bytes; its shape needs 8"),
    (ct2_bytes([ct2_variable("w", np.zeros(2, np.float32), nbytes=2**32 - 1)]), "states 4294967295 bytes"),
    (ct2_bytes([ct2_variable("w", np.zeros(2, np.int8), type_id=9)]), "dtype id 9, which Loom does not read"),
    (ct2_bytes([ct2_variable("w", np.zeros((1,) * 9, np.int8))]), "rank 9"),
    (ct2_bytes([ONE, ONE]), "duplicate variable name 'w'"),
    (ct2_bytes([ONE], aliases=[("out", "missing")]), "refers to 'missing', which is not a variable"),
    (ct2_bytes([ONE], aliases=[("w", "w")]), "names an existing variable"),
    (ct2_bytes([ONE], tail=b"\0\0"), "2 bytes follow the last alias"),
    (ct2_bytes([ONE], count=2**32 - 1), "4294967295 variables needs bytes"),
    (struct.pack("<I", 6) + ct2_string("WhisperSpec", nul=False) + struct.pack("<II", 3, 0) + bytes(4),
     "spec name does not end in NUL"),
    (struct.pack("<I", 6) + struct.pack("<H", 2) + b"\xff\0" + struct.pack("<II", 3, 0) + bytes(4),
     "spec name is not valid UTF-8"),
])
def test_ctranslate2_lying_files_reject_with_a_diagnostic(tmp_path, data, match):
    rejects(tmp_path, data, match, name="model.bin")


@FUZZ
@given(data=mutated(SMALL_CT2))
def test_fuzz_ctranslate2(fuzz_dir, data):
    open_or_reject(fuzz_dir, "model.bin", data)
