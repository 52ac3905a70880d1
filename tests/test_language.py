"""The Loom language: parsing, printing, .loombc round trips, the untrusted reader, the VM."""

import glob
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT
from loom import bytecode, language, vm, weights
from loom.language import LoomError

SAMPLE = '''
# a sample exercising every declaration
module sample kind embedding

spec D = shape("embed.weight", 1)
spec V = shape("embed.weight", 0)
spec E = meta("sample.out_dim", D)
spec L = meta("sample.layers", 2)
spec EPS = 1e-12
spec NEOX = format == "safetensors" or meta("general.architecture", "") == "qwen2"

param embed : weight [V, D] = "embed.weight"
param proj[L] : weight [E, D] = "layers.{i}.proj.weight" | "blk.{i}.proj"
param bias : f32 [E] = "proj.bias"
param head : weight [V, D] = "head.weight" | embed
param extra[L] : f32 [D] = "blk.{i}.extra" when has("blk.0.extra")

state kv : f32 paged(16) [L, 2, D]

kernel gather(ids: buf, table: tensor[R, C], out: buf, T: int)
    from "gather.cl"
    defines { D = C, ROWS = R, flag "TABLE_" + dtype(table) }
    grid [T * 8] local [8]

kernel matmul(x: buf, w: tensor[N, K], y: buf, T: int)
    from "matmul.cl"
    defines { N = N, K = K, flag "WEIGHT_" + dtype(w) }
    args [x, 0, K, w, y, y, 0, N, T, 1.5]
    grid [ceil(N, 4) * 8, T] local [8, 1]

kernel scale(x: buf, n: int, s: float)
    source """
__kernel void scale(__global float* x, int n, float s) {
    int i = get_global_id(0);
    if (i < n) x[i] *= s;   // a "quoted" word and a \\ backslash stay as written
}
"""
    grid [ceil(n, 64) * 64]

command embed(ids: buf, out: buf, T: int) {
    scratch x : f32 [T, D]
    gather(ids, embed, x, T)
    for l in 0..L {
        scratch y : f32 [T, E]
        matmul(x, proj[l], y, T)
        if l == 0 and T > 1 {
            scale(y, T * E, 0.5)
        } else {
            scale(y, T * E, -2.0)
        }
    }
    let n = -T * D + 2 ** 3 ** 2 - (1 - 2) - -3
    finish(x, n > 0 ? n : 1)
}

command finish(x: buf, n: int) {
    scale(x, n, 2)
}

policy {"pooling": "mean", "nested": {"a": [1, 2.5, "brace } inside"]}}
'''


def sample():
    return language.parse(SAMPLE, "sample.loom")


def reference_sources():
    return sorted(glob.glob(os.path.join(ROOT, "models", "*", "*.loom")))


@pytest.mark.parametrize("text", [SAMPLE] + [open(p).read() for p in reference_sources()],
                         ids=["sample"] + [os.path.relpath(p, ROOT) for p in reference_sources()])
def test_text_module_binary_round_trips(text):
    # Reference packages may be parts of a multi-file module (judge uses bert's encoder):
    # round-trip them as parts; whole packages are checked below.
    module = language.parse(text, checked=False)
    printed = language.format_module(module)
    assert language.parse(printed, checked=False) == module                      # module -> text -> module
    assert language.format_module(language.parse(printed, checked=False)) == printed  # a fixed point
    data = bytecode.write(module)
    assert data.startswith(bytecode.MAGIC)
    assert bytecode.read(data, checked=False) == module                          # module -> binary -> module
    assert bytecode.write(bytecode.read(data, checked=False)) == data            # and the bytes are stable


@pytest.mark.parametrize("parts", [["affine/affine.loom"], ["llama/llama.loom"], ["bert/bert.loom"],
                                   ["bert/bert.loom", "judge/judge.loom"]])
def test_reference_packages_check(parts):
    paths = [os.path.join(ROOT, "models", p) for p in parts]
    merged = language.merge([language.load(p, checked=False) for p in paths], paths)
    assert bytecode.read(bytecode.write(merged)) == merged


def test_inline_source_survives_verbatim():
    kernel = sample().find("kernels", "scale")
    assert 'a "quoted" word and a \\ backslash' in kernel.source  # one backslash, kept raw


BAD_SOURCES = [
    ("modul x", 1, 1, "expected 'module'"),
    ("module x\nspec a = 1 +", 2, 13, "expected an expression"),
    ("module x\nspec a = b", None, None, "unknown name 'b'"),
    ("module x\nspec a = 1\nspec a = 2", 3, 1, "declared twice"),
    ("module x kind chat", 1, 15, "unknown kind"),
    ("module x\nspec a = nope(1)", 2, 10, "unknown function"),
    ("module x\nspec a = ceil(1)", 2, 10, "takes 2 arguments"),
    ("module x\nparam p : f64 [1] = \"t\"", 2, 11, "expected a dtype"),
    ("module x\ncommand c(a: buf) { missing(a) }", None, None, "neither a kernel nor a command"),
    ("module x\ncommand c(a: buf) { let }", 2, 25, "expected a name"),
    ("module x\nkernel k(a: buf) from \"../evil.cl\" grid [1]", None, None, "plain NAME.cl"),
    ("module x\nkernel k(a: buf) from \"k.cl\" grid [1] local [1, 1]", None, None, "local the same count"),
    ("module x\npolicy {\"a\": 1, \"a\": 2}", 2, 8, "not strict JSON"),
    ("module x\nspec a = 1 $", 2, 12, "unexpected character"),
]
# Issue 15.7: an inline kernel reads no server file, in any preprocessor spelling; only a
# quoted relative #include passes, which the server resolves in the package or the library.
for directive in ('#include "/etc/passwd"', ' #  include <x.h>', '%:include "a"', '??=include "a"',
                  '#import "a"', '#embed "a"', '#if __has_include("/etc/passwd")\n#endif', '#include "../up.h"',
                  '#include "a/./b.h"', '#include MACRO', '#inc\\\nlude "/etc/passwd"'):
    BAD_SOURCES.append((f'module x\nkernel k(a: buf) source """{directive}\n__kernel void k() {{}}""" grid [1]',
                        None, None, "reads no server file"))


def test_includes_resolve_in_the_package_then_the_library_and_nowhere_else():
    found = {"norm.h": "#define NORM 1\n#include \"inner/deep.h\"", "inner/deep.h": "#define DEEP 2"}
    text = language.include_files("k", 'a\n#include "norm.h"\nb', found.get)
    assert "#define NORM 1" in text and "#define DEEP 2" in text and text.endswith('#line 3 "k"\nb')
    with pytest.raises(LoomError, match="neither in the package nor the kernel library"):
        language.include_files("k", '#include "missing.h"', found.get)
    loop = {"a.h": '#include "a.h"'}
    with pytest.raises(LoomError, match="nest deeper"):
        language.include_files("k", '#include "a.h"', loop.get)
    with pytest.raises(LoomError, match="reads no server file|only #include"):
        language.include_files("k", '#include "x.h"', {"x.h": '#include "/etc/passwd"'}.get)


@pytest.mark.parametrize("text,line,col,message", BAD_SOURCES, ids=[b[3] for b in BAD_SOURCES])
def test_diagnostics_point_at_the_problem(text, line, col, message):
    with pytest.raises(LoomError) as info:
        language.parse(text, "bad.loom")
    assert message in str(info.value)
    if line is not None:
        assert (info.value.line, info.value.col) == (line, col)


# -- the untrusted reader ----------------------------------------------------------

def test_reader_rejects_structural_damage():
    data = bytecode.write(sample())
    cases = {
        "bad magic": b"XXXXXXXX" + data[8:],
        "version": data[:8] + struct.pack("<H", 99) + data[10:],
        "huge section count": data[:10] + struct.pack("<H", 60000) + data[12:],
        "truncated": data[:len(data) // 2],
        "empty": b"",
    }
    for name, bad in cases.items():
        with pytest.raises(LoomError):
            bytecode.read(bad)
    # A section pointing past the end of the file.
    table = bytearray(data)
    struct.pack_into("<I", table, 12 + 4, len(data) + 10)
    with pytest.raises(LoomError, match="outside the file"):
        bytecode.read(bytes(table))


def test_reader_rejects_lying_counts_without_allocating():
    data = bytearray(bytecode.write(sample()))
    n = struct.unpack_from("<H", data, 10)[0]
    for i in range(n):
        sid, offset, _ = struct.unpack_from("<III", data, 12 + 12 * i)
        bad = bytearray(data)
        struct.pack_into("<I", bad, offset, 0xFFFFFFF0)  # every section starts with a count or index
        with pytest.raises(LoomError):
            bytecode.read(bytes(bad))


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VALID = bytecode.write(language.parse(SAMPLE))


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["set", "insert", "delete", "truncate"]),
                          st.integers(0, len(VALID)), st.binary(min_size=1, max_size=4)), min_size=1, max_size=5))
def test_mutated_modules_never_crash_the_reader(edits):
    data = bytearray(VALID)
    for op, at, payload in edits:
        at = min(at, len(data))
        if op == "set" and at < len(data):
            data[at] = payload[0]
        elif op == "insert":
            data[at:at] = payload
        elif op == "delete":
            del data[at:at + len(payload)]
        elif op == "truncate":
            del data[at:]
    try:
        module = bytecode.read(bytes(data))
    except LoomError:
        return
    # Whatever the reader accepts is a well-formed module: it prints and re-reads identically.
    assert bytecode.read(bytecode.write(module)) == module


@FUZZ
@given(st.binary(max_size=400))
def test_garbage_is_rejected(data):
    with pytest.raises(LoomError):
        bytecode.read(bytecode.MAGIC + data)


# -- the VM ------------------------------------------------------------------------

def bound(layers=2, fmt="gguf", **options):
    tensors = {"embed.weight": vm.Tensor((100, 32), "Q8_0"), "proj.bias": vm.Tensor((16,), "F32")}
    for i in range(layers):
        tensors[f"blk.{i}.proj"] = vm.Tensor((16, 32), "Q4_0")
    metadata = {"sample.out_dim": 16, "sample.layers": layers, "general.architecture": "qwen2"}
    return vm.bind(sample(), metadata, tensors, dict(options, pages=8), fmt)


def test_bind_evaluates_specs_and_resolves_params():
    b = bound()
    assert (b.specs["D"], b.specs["V"], b.specs["E"], b.specs["L"], b.specs["NEOX"]) == (32, 100, 16, 2, True)
    assert b.params[("proj", 1)].tensor == "blk.1.proj" and b.params[("proj", 1)].storage == "Q4_0"
    head = b.params[("head", None)]
    assert head.tensor is None and head.alias == ("embed", None) and head.storage == "Q8_0"  # tied head
    assert b.states["kv"].page == 16 and b.states["kv"].dims == (2, 2, 32)
    assert ("extra", 0) not in b.params  # its `when` does not hold for this checkpoint


def test_bind_errors_name_the_param():
    with pytest.raises(LoomError, match=r"param proj\[2\]: none of \['layers.2.proj.weight', 'blk.2.proj'\]"):
        vm.bind(sample(), {"sample.out_dim": 16, "sample.layers": 3},
                {"embed.weight": vm.Tensor((100, 32), "F32"), "proj.bias": vm.Tensor((16,), "F32"),
                 **{f"blk.{i}.proj": vm.Tensor((16, 32), "F32") for i in range(2)}})
    with pytest.raises(LoomError, match=r"has shape \(16, 33\), the module expects \(16, 32\)"):
        vm.bind(sample(), {"sample.out_dim": 16},
                {"embed.weight": vm.Tensor((100, 32), "F32"), "proj.bias": vm.Tensor((16,), "F32"),
                 "blk.0.proj": vm.Tensor((16, 33), "F32"), "blk.1.proj": vm.Tensor((16, 32), "F32")})


def test_plan_unrolls_loops_branches_and_calls():
    plan = bound().plan("embed", T=3)
    names = [launch.kernel for launch in plan.launches]
    assert names == ["gather", "matmul", "scale", "matmul", "scale", "scale"]
    gather, mm0, s0, mm1, s1, fin = plan.launches
    assert gather.defines == {"D": 32, "ROWS": 100, "TABLE_Q8_0": None}
    assert gather.grid == (24,) and gather.local == (8,)
    assert mm0.defines == {"N": 16, "K": 32, "WEIGHT_Q4_0": None} and mm0.grid == (32, 3)
    assert mm0.args == [vm.Ref("scratch", "x"), 0, 32, vm.Ref("param", "proj", 0), vm.Ref("scratch", "y"),
                        vm.Ref("scratch", "y"), 0, 16, 3, 1.5]  # the OpenCL argument list from args [...]
    assert mm0.arg_types == ["buf", "int", "int", "buf", "buf", "buf", "int", "int", "int", "float"]
    assert mm1.args[3] == vm.Ref("param", "proj", 1)
    assert s0.args[1:] == [48, 0.5] and s1.args[1:] == [48, -2.0]   # l == 0 and T > 1, then the else branch
    n = -3 * 32 + 2 ** 9 + 1 + 3
    assert fin.args[1:] == [n, 2] and fin.grid == (((n + 63) // 64) * 64,)
    assert plan.scratch == {"x": ("f32", (3, 32)), "y": ("f32", (3, 16))}
    assert bound().plan("embed", T=1).launches[2].args[2] == -2.0  # T == 1 takes the else branch


def test_plan_errors():
    b = bound()
    with pytest.raises(LoomError, match="argument 'T' was not given"):
        b.plan("embed")
    with pytest.raises(LoomError, match="unknown arguments"):
        b.plan("embed", T=1, U=2)
    with pytest.raises(LoomError, match="a size must be from 1"):
        b.plan("embed", T=0)
    with pytest.raises(LoomError, match="no command"):
        b.plan("nothing")


WIDENING = '''module widen
spec VW = vector_width == 8 ? 8 : 16
kernel widen(w: tensor[N, K], y: buf)
    source """__kernel void widen(__global const uchar *w, __global float *y) {}"""
    defines { N = N, K = K, VW = VW, flag "WEIGHT_" + dtype(w) }
    grid [N]
command go(y: buf, T: int) {
    if T >= 32 and dtype(w) != "F32" {
        scratch wf : f32 [dim(w, 0), dim(w, 1)]
        widen(w, wf)
        widen(wf, y)
    } else {
        widen(w, y)
    }
}
param w : weight [16, 64] = "w"
'''


def test_int8_dot_is_predefined():
    """`int8_dot` (whether the device's kernels may use AVX512-VNNI dot products) is a predefined
    spec name, false unless the device says so, kept on the binding for rebinding and proving."""
    module = language.parse("module m\nspec DOT = int8_dot ? 1 : 0\n", "m.loom")
    assert vm.bind(module, {}, {}).specs["DOT"] == 0
    binding = vm.bind(module, {}, {}, int8_dot=True)
    assert binding.specs["DOT"] == 1 and binding.int8_dot is True


def test_vector_width_is_predefined_and_dtype_reads_scratch_buffers():
    """`vector_width` (the device's float vector width) is a predefined spec name; dtype() of a
    scratch buffer is its own type, so one kernel declaration takes a param or a widened copy."""
    module = language.parse(WIDENING, "widen.loom")
    tensors = {"w": vm.Tensor((16, 64), "Q4_0")}
    assert vm.bind(module, {}, tensors, vector_width=8).specs["VW"] == 8
    binding = vm.bind(module, {}, tensors, vector_width=16)
    assert binding.specs["VW"] == 16 and binding.vector_width == 16
    widened = binding.plan("go", T=32)
    assert [sorted(launch.defines) for launch in widened.launches] == [["K", "N", "VW", "WEIGHT_Q4_0"],
                                                                       ["K", "N", "VW", "WEIGHT_F32"]]
    assert list(widened.scratch.values()) == [("f32", (16, 64))]
    (direct,) = binding.plan("go", T=31).launches
    assert "WEIGHT_Q4_0" in direct.defines
    with pytest.raises(LoomError, match="dtype\\(\\) needs a param or a scratch buffer"):
        vm.bind(language.parse(WIDENING.replace("dtype(w) != ", "dtype(y) != ")), {}, tensors).plan("go", T=32)


def test_a_loop_takes_one_scratch_buffer_per_name_and_shape():
    """A layer loop widening matrices of two shapes, one declaration: two buffers, whatever the
    number of layers (every layer took new ones and a 24-layer prefill plan held 1.3 GB)."""
    module = language.parse('''module layers
spec L = 5
kernel widen(w: tensor[N, K], y: buf)
    source """__kernel void widen(__global const uchar *w, __global float *y) {}"""
    defines { N = N, K = K }
    grid [N]
command widen_all(y: buf) {
    for l in 0..L {
        go(a[l], y)
        go(b[l], y)
    }
}
command go(w: buf, y: buf) {
    scratch wf : f32 [dim(w, 0), dim(w, 1)]
    widen(w, wf)
}
param a[L] : weight [16, 64] = "a.{i}"
param b[L] : weight [64, 16] = "b.{i}"
''', "layers.loom")
    tensors = {f"{m}.{i}": vm.Tensor((16, 64) if m == "a" else (64, 16), "Q4_0") for m in "ab" for i in range(5)}
    plan = vm.bind(module, {}, tensors).plan("widen_all")
    assert sorted(plan.scratch.values()) == [("f32", (16, 64)), ("f32", (64, 16))]
    assert len(plan.launches) == 10 and len({launch.args[1].name for launch in plan.launches}) == 2


def test_runaway_loops_are_bounded():
    module = language.parse('module x\nkernel k(n: int) source """__kernel void k(int n) {}""" grid [1]\n'
                            "command c(n: int) { for i in 0..n { for j in 0..n { let z = i } } }")
    with pytest.raises(LoomError, match="runaway"):
        vm.bind(module, {}, {}).plan("c", n=100_000)


# -- the command line --------------------------------------------------------------

def test_command_line(tmp_path):
    src = tmp_path / "sample.loom"
    src.write_text(SAMPLE)
    out = tmp_path / "sample.loombc"
    run = lambda *a: subprocess.run([sys.executable, "-m", "loom.language", *a], cwd=ROOT,  # noqa: E731
                                    capture_output=True, text=True, timeout=60)
    assert run("compile", str(src), "-o", str(out)).returncode == 0
    assert bytecode.read(out.read_bytes()) == sample()
    checked = run("check", str(out))
    assert checked.returncode == 0 and "5 params" in checked.stdout and "3 kernels" in checked.stdout
    listing = run("disassemble", str(out)).stdout
    assert 'launch "matmul" 4' in listing and "grid [ceil(N, 4) * 8, T] local [8, 1]" in listing
    assert language.parse(run("format", str(out)).stdout) == sample()
    (tmp_path / "bad.loom").write_text("module x\nspec a = 1 +\n")
    bad = run("check", str(tmp_path / "bad.loom"))
    assert bad.returncode == 1 and "bad.loom:2:" in bad.stderr


# -- kernel let bindings ---------------------------------------------------------------

LETS = '''
module lets kind text
spec WIDE_ROWS = 4
param w : weight [8, 64] = "w"
kernel linear(x: buf, w: tensor[N, K], y: buf, T: int)
    from "matmul.cl" entry "matmul"
    let ACT8 = dtype(w) == "Q8_0" and T < 2
    let ROWS = T >= 16 and not ACT8 ? WIDE_ROWS : 1
    let LANES = ACT8 ? 64 : 8
    defines { N = N, K = K, ROWS_PER_ITEM = ROWS, WG = LANES, flag ACT8 ? "ACT_Q8" : "ACT_F32" }
    grid [ceil(ceil(N, ROWS), LANES) * LANES, T] local [LANES, 1]
command go(x: buf, y: buf, T: int) {
    linear(x, w, y, T)
}
'''


def test_kernel_lets_bind_in_order_and_round_trip():
    module = language.parse(LETS, "lets.loom")
    assert [name for name, _ in module.find("kernels", "linear").lets] == ["ACT8", "ROWS", "LANES"]
    assert language.parse(language.format_module(module)) == module
    assert bytecode.read(bytecode.write(module)) == module
    assert "let ROWS = " in language.format_module(module)
    tensors = {"w": vm.Tensor((8, 64), "Q8_0")}
    binding = vm.bind(module, {}, tensors)
    for t, rows, lanes, act in ((1, 1, 64, "ACT_Q8"), (4, 1, 8, "ACT_F32"), (32, 4, 8, "ACT_F32")):
        (launch,) = binding.plan("go", T=t).launches
        assert (launch.defines["ROWS_PER_ITEM"], launch.defines["WG"], act in launch.defines) == (rows, lanes, True)
        assert launch.grid == (-(-(-(-8 // rows)) // lanes) * lanes, t) and launch.local == (lanes, 1)


@pytest.mark.parametrize("change, message", [
    ("    let ROWS = T >= 16 and not ACT8 ? WIDE_ROWS : 1", "unknown name|ACT8"),   # a let before its binding
    ("    let T = 1", "not a new name"),                                        # shadows an argument
    ("    let WIDE_ROWS = 2", "not a new name"),                                # shadows a spec
])
def test_kernel_let_errors(change, message):
    source = LETS.replace('    let ACT8 = dtype(w) == "Q8_0" and T < 2\n', change + '\n    let ACT8 = 1\n', 1)
    with pytest.raises(LoomError, match=message):
        language.parse(source, "lets.loom")


def test_format_version_1_files_still_read():
    """A .loombc written before kernels had lets (format version 1) reads as the same module."""
    data = open(os.path.join(ROOT, "tests", "data", "sample-v1.loombc"), "rb").read()
    assert struct.unpack("<H", data[8:10]) == (1,)
    assert bytecode.read(data) == sample()
    assert struct.unpack("<H", bytecode.write(sample())[8:10]) == (bytecode.FORMAT_VERSION,) == (3,)
    with pytest.raises(LoomError, match="format version 4 is not supported"):
        bytecode.read(data[:8] + struct.pack("<H", 4) + data[10:])


# -- layers that differ: placeholders, "?" dimensions, per-layer `when` ------------------------

NESTED = '''
module nested kind image
spec NB = count("down.{i}.res.0.w")                  # blocks
spec LPB = count("down.0.res.{i}.w")                 # layers per block
param w[NB * LPB] : f32 [?, ?] = "down.{i // LPB}.res.{i % LPB}.w"
param attn[NB * LPB] : f32 [dim_of_i(i)] = "down.{i // LPB}.attn.{i % LPB}.g" when has("down.{i // LPB}.attn.0.g")
param skip[NB * LPB] : f32 [?, ?] = "down.{i // LPB}.res.{i % LPB}.skip" when has("down.{i // LPB}.res.{i % LPB}.skip")
param head : f32 [shape("down.{NB - 1}.res.{LPB - 1}.w", 0)] = "head.{NB * 10 + 1}"
kernel k(x: tensor[O, C], n: int)
    source """__kernel void k(__global float *x, int n) {}"""
    defines { O = O, C = C }
    grid [O]
command c(n: int) {
    for l in 0..NB * LPB {
        k(w[l], dim(w[l], 1))
        if present(skip[l]) { k(skip[l], 0) }
        if present(attn[l]) { k(w[l], -1) }
    }
}
'''


def nested_tensors(blocks=3, layers=2, channels=(4, 8, 16)):
    t = {}
    for b in range(blocks):
        for j in range(layers):
            cin = channels[b - 1] if b and j == 0 else channels[b]
            t[f"down.{b}.res.{j}.w"] = vm.Tensor((channels[b], cin), "F32")
            if cin != channels[b]:
                t[f"down.{b}.res.{j}.skip"] = vm.Tensor((channels[b], cin), "F32")
            if b < 2:
                t[f"down.{b}.attn.{j}.g"] = vm.Tensor((channels[b],), "F32")
    t["head.31"] = vm.Tensor((channels[-1],), "F32")
    return t


def test_layers_differ_by_placeholders_any_dims_and_per_layer_when():
    module = language.parse(NESTED.replace("dim_of_i(i)", "?"))
    b = vm.bind(module, {}, nested_tensors())
    assert (b.specs["NB"], b.specs["LPB"]) == (3, 2)
    assert [b.params[("w", l)].tensor for l in range(6)] == [f"down.{l // 2}.res.{l % 2}.w" for l in range(6)]
    assert [b.params[("w", l)].shape for l in range(6)] == [(4, 4), (4, 4), (8, 4), (8, 8), (16, 8), (16, 16)]
    assert sorted(l for (name, l) in b.params if name == "skip") == [2, 4]
    assert sorted(l for (name, l) in b.params if name == "attn") == [0, 1, 2, 3]
    assert b.params[("head", None)].tensor == "head.31" and b.params[("head", None)].shape == (16,)
    plan = b.plan("c", n=1)
    got = [(launch.defines["O"], launch.defines["C"], launch.args[1]) for launch in plan.launches]
    assert got == [(4, 4, 4), (4, 4, -1), (4, 4, 4), (4, 4, -1),
                   (8, 4, 4), (8, 4, 0), (8, 4, -1), (8, 8, 8), (8, 8, -1),
                   (16, 8, 8), (16, 8, 0), (16, 16, 16)]
    again = bytecode.read(bytecode.write(module))              # "?" and placeholders survive the binary form
    assert language.format_module(again) == language.format_module(module)
    assert "[?, ?]" in language.format_module(module)


@pytest.mark.parametrize("change, message", [
    (('"down.{i // LPB}.res.{i % LPB}.w"', '"down.{i // LPB.res.w"'), "unmatched brace"),
    (('"down.{i // LPB}.res.{i % LPB}.w"', '"down.{}.w"'), "empty placeholder"),
    (('"down.{i // LPB}.res.{i % LPB}.w"', '"down.{i i}.w"'), "not one expression"),
    (('"down.{i // LPB}.res.{i % LPB}.w"', '"down.{j}.w"'), "unknown name 'j'"),
    (('"head.{NB * 10 + 1}"', '"head.{i}"'), "unknown name 'i'"),          # not a layered param
    (("dim_of_i(i)", "i + ?"), "expected an expression"),
])
def test_placeholder_and_any_dim_errors(change, message):
    with pytest.raises(LoomError, match=message):
        language.parse(NESTED.replace(*change).replace("dim_of_i(i)", "?"))


def test_layer_dims_may_use_i_and_a_misfit_names_the_layer():
    module = language.parse(NESTED.replace("dim_of_i(i)", "4 * 2 ** (i // LPB)"))
    b = vm.bind(module, {}, nested_tensors())
    assert [b.params[("attn", l)].shape for l in range(4)] == [(4,), (4,), (8,), (8,)]
    bad = nested_tensors()
    bad["down.1.res.1.w"] = vm.Tensor((8, 8, 1), "F32")
    with pytest.raises(LoomError, match=r"param w\[3\]: tensor 'down.1.res.1.w' has shape \(8, 8, 1\), "
                                        r"the module expects \(\?, \?\)"):
        vm.bind(module, {}, bad)
    with pytest.raises(LoomError, match=r"dim\(\) needs a param that is present"):
        vm.bind(language.parse(NESTED.replace("dim_of_i(i)", "?").replace("k(skip[l], 0)", "k(w[l], dim(skip[0], 0))")),
                {}, nested_tensors()).plan("c", n=1)


# -- tiled params: laid out at load for the kernels that read them -----------------------------

TILED = '''
module t kind embedding
spec O = shape("w.0", 0)
spec W = 4
param w[2] : f32 [O, ?, 3] = "w.{i}" tiled(0, W)
param up : f16 [4, O, 2] = "up" tiled(1, W // 2 + 2)
param plain : f32 [O, 3, 3] = "w.0"
param shared : f32 [4, O, 2] = "missing" | up
kernel k(w: tensor[A, B, K], n: int)
    source "__kernel void k(int n) {}"
    defines { A = A, TILES = tiles(w) }
    args [n]
    grid [n]
command c(n: int) {
    k(w[1], n)
    k(up, n)
    k(plain, n)
    k(shared, n)
}
'''


def tiled_tensors(o=6):
    return {"w.0": vm.Tensor((o, 3, 3), "F32"), "w.1": vm.Tensor((o, 5, 3), "F32"), "up": vm.Tensor((4, o, 2), "F16")}


def test_tiled_params_round_trip_bind_and_tell_their_kernels():
    module = language.parse(TILED)
    assert module.find("params", "w").tiled is not None and module.find("params", "plain").tiled is None
    printed = language.format_module(module)
    assert "tiled(0, W)" in printed and "tiled(1, W // 2 + 2)" in printed
    assert language.parse(printed) == module
    assert bytecode.read(bytecode.write(module)) == module
    b = vm.bind(module, {}, tiled_tensors())
    assert [b.params[("w", i)].tiled for i in (0, 1)] == [(0, 4), (0, 4)]
    assert b.params[("up", None)].tiled == (1, 4)
    assert b.params[("plain", None)].tiled is None
    assert b.params[("shared", None)].alias == ("up", None) and b.params[("shared", None)].tiled == (1, 4)
    assert [launch.defines["TILES"] for launch in b.plan("c", n=1).launches] == [4, 4, 0, 4]
    assert b.contract()["params"][("w", 0)][-1] == (0, 4)      # a variant keeps the layout


@pytest.mark.parametrize("change, message", [
    (('param plain : f32', 'param plain : i32'), "tiled\\(\\) needs dtype f32, f16 or weight, not i32"),
    (('"w.0"\nparam shared', '"w.0" tiled(0, Q)\nparam shared'), "unknown name 'Q'"),
    (('tiled(0, W)', 'tiled(0 W)'), "expected ','"),
])
def test_tiled_declaration_errors(change, message):
    source = TILED.replace(*change)
    if change[0].startswith("param plain"):
        source = source.replace('"w.0"\nparam shared', '"w.0" tiled(0, 4)\nparam shared')
    with pytest.raises(LoomError, match=message):
        language.parse(source)


@pytest.mark.parametrize("tiled, values", [("tiled(3, W)", "3, 4"), ("tiled(0, -1)", "0, -1"), ("tiled(0, 65)", "0, 65"),
                                           ("tiled(-1, W)", "-1, 4")])
def test_tiled_values_out_of_range_fail_binding(tiled, values):
    module = language.parse(TILED.replace("tiled(0, W)", tiled))
    with pytest.raises(LoomError, match=re.escape(f"param w[0]: tiled({values}) needs an axis of its 3 dimensions "
                                                  "(rows, axis 0, for quantized blocks) and a width of 0 to 64")):
        vm.bind(module, {}, tiled_tensors())


def test_tiled_width_0_keeps_the_checkpoint_layout():
    b = vm.bind(language.parse(TILED.replace("tiled(0, W)", "tiled(0, W - 4)")), {}, tiled_tensors())
    assert [b.params[("w", i)].tiled for i in (0, 1)] == [None, None]
    assert [launch.defines["TILES"] for launch in b.plan("c", n=1).launches] == [0, 4, 0, 4]


WEIGHT_TILES = '''
module t kind embedding
param a : weight [16, 64] = "a" tiled(AXIS, storage == "Q4_0" ? 16 : 0)
param c[2] : weight [16, 64] = "c.{i}" tiled(0, storage == "Q4_0" ? 16 : 0)
param b : weight [16, 64] = "missing" | a
kernel k(w: tensor[N, K], n: int)
    source "__kernel void k(int n) {}"
    defines { TILES = tiles(w), TYPE = dtype(w) }
    args [n]
    grid [n]
command c(n: int) {
    k(a, n)
    k(c[0], n)
    k(c[1], n)
    k(b, n)
    scratch s : f32 [16, 64]
    k(s, n)
}
'''


def test_weight_params_tile_by_their_storage():
    """tiled() on a weight param sees `storage`, the bound tensor's device type: a layout
    for the types whose kernels read it (llama.loom tiles Q4_0 matrices by 16 rows), the
    checkpoint's for the rest; an alias keeps its target's."""
    tensors = {"a": vm.Tensor((16, 64), "Q4_0"), "c.0": vm.Tensor((16, 64), "Q8_0"), "c.1": vm.Tensor((16, 64), "F16")}
    b = vm.bind(language.parse(WEIGHT_TILES.replace("AXIS", "0")), {}, tensors)
    assert [b.params[key].tiled for key in (("a", None), ("c", 0), ("c", 1))] == [(0, 16), None, None]
    assert b.params[("b", None)].alias == ("a", None) and b.params[("b", None)].tiled == (0, 16)
    assert [(launch.defines["TILES"], launch.defines["TYPE"]) for launch in b.plan("c", n=1).launches] == \
        [(16, "Q4_0"), (0, "Q8_0"), (0, "F16"), (16, "Q4_0"), (0, "F32")]
    with pytest.raises(LoomError, match=re.escape("param a: tiled(1, 16) needs an axis of its 2 dimensions "
                                                  "(rows, axis 0, for quantized blocks)")):
        vm.bind(language.parse(WEIGHT_TILES.replace("AXIS", "1")), {}, tensors)
    with pytest.raises(LoomError, match="unknown name 'storage'"):
        language.parse(WEIGHT_TILES.replace('"a" tiled(AXIS, storage == "Q4_0" ? 16 : 0)', '"a" when storage == "F16"'))


@pytest.mark.parametrize("shape, axis, width", [((5, 3, 2), 0, 4), ((3, 5, 2), 1, 4), ((5, 7), 0, 4),
                                                ((8, 2, 3), 0, 8), ((2, 9, 4), 1, 16), ((6,), 0, 4)])
def test_tile_layout_against_loops(shape, axis, width):
    """runtime.tile: the axis in tiles of `width` (padded with zeros), each tile's values with
    the other axes in reverse order and the tile's own index innermost; storage_bytes agrees."""
    from loom.runtime import storage_bytes, tile
    a = np.arange(1, np.prod(shape) + 1, dtype=np.float32).reshape(shape)
    got = tile(a, axis, width)
    rest = [d for i, d in enumerate(shape) if i != axis]
    tiles = -(-shape[axis] // width)
    assert got.shape == (tiles, *rest[::-1], width)
    for t in range(tiles):
        for lane in range(width):
            n = t * width + lane
            for idx in np.ndindex(*rest):
                full = list(idx)
                full.insert(axis, n)
                want = a[tuple(full)] if n < shape[axis] else 0.0
                assert got[(t, *idx[::-1], lane)] == want
    assert storage_bytes(shape, "F32", (axis, width)) == got.nbytes
    assert storage_bytes(shape, "F16", (axis, width)) == got.nbytes // 2


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(weights.SCALE_FIELDS)), st.integers(1, 40), st.integers(1, 3),
       st.sampled_from([1, 4, 16]), st.integers(0, 2**32 - 1))
def test_tile_blocks_puts_every_byte_where_the_kernels_read_it(storage, rows, blocks, width, seed):
    """runtime.tile_blocks: per tile of `width` rows and block column, each scale field's 2
    bytes row after row, then the block's other bytes four at a time, each word as `width`
    4-byte groups one per row (rows past the end are zeros); storage_bytes agrees with the
    size."""
    from loom.runtime import storage_bytes, tile_blocks
    values, size = weights.BLOCK_LAYOUT[storage]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    got = tile_blocks(raw.reshape(-1), rows, storage, width)
    tiles = -(-rows // width)
    assert got.nbytes == storage_bytes((rows, blocks * values), storage, (0, width)) == tiles * blocks * width * size
    got = got.reshape(tiles, blocks, width * size)
    fields = weights.SCALE_FIELDS[storage]
    rest = [i for i in range(size) if all(i not in (at, at + 1) for at in fields)]
    for n in range(tiles * width):
        t, lane = divmod(n, width)
        row = raw[n].copy() if n < rows else np.zeros((blocks, size), np.uint8)
        if storage == "Q5_0":
            # element e's fifth bit (qh bit e) where matmul.cl's ROW_TILE reads it: element
            # 4j + b at 8b + 4 + j, element 16 + 4j + b at 8b + j
            qh = row[:, 2:6].copy().view("<u4")[:, 0]
            moved = np.zeros_like(qh)
            for j in range(4):
                for b in range(4):
                    moved |= ((qh >> (4 * j + b)) & 1) << (8 * b + 4 + j)
                    moved |= ((qh >> (16 + 4 * j + b)) & 1) << (8 * b + j)
            row[:, 2:6] = moved.view(np.uint8).reshape(-1, 4)
        for f, at in enumerate(fields):
            start = f * 2 * width + 2 * lane
            assert np.array_equal(got[t, :, start:start + 2], row[:, at:at + 2])
        base = len(fields) * 2 * width
        assert len(rest) % 4 == 0
        for i, byte in enumerate(rest):
            word, at = divmod(i, 4)
            assert np.array_equal(got[t, :, base + (word * width + lane) * 4 + at], row[:, byte])
