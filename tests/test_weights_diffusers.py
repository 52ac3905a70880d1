"""diffusers pipeline folders through loom.weights.open_checkpoint.

The folders are the tiny Stable Diffusion 1.5 model models/sd/generate.py writes, read back
against safetensors' own numpy loader (the oracle) and the numpy SD reference's loader
(tests/sd_numpy.py); broken folders are that model with one file changed. A hypothesis fuzz
mutates model_index.json: every folder either opens and reads in full or is a WeightsError.
"""
import importlib.util
import json
import os
import re
import shutil
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st
from safetensors.numpy import load_file

from loom import weights as W
from loom.weights import WeightsError, open_checkpoint, write_safetensors

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd_numpy as sd  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("sd_generate", os.path.join(ROOT, "models", "sd", "generate.py"))
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

FILES = {"text_encoder": "model.safetensors", "unet": "diffusion_pytorch_model.safetensors",
         "vae": "diffusion_pytorch_model.safetensors"}
LEGACY = {".to_q.": ".query.", ".to_k.": ".key.", ".to_v.": ".value.", ".to_out.0.": ".proj_attn."}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("sd") / "illustrator")
    gen.generate_default(d)
    return d


@pytest.fixture
def folder(model_dir, tmp_path):
    """A private copy of the generated model, for tests that change a file."""
    d = str(tmp_path / "m")
    shutil.copytree(model_dir, d)
    return d


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)


def oracle_of(folder, components):
    """component-prefixed name -> array, through safetensors' own reader."""
    out = {}
    for comp in components:
        for k, v in load_file(os.path.join(folder, comp, FILES[comp])).items():
            out[f"{comp}.{k}"] = v
    return out


def oracle(folder):
    return oracle_of(folder, FILES)


def oracle_without(folder, skip):
    return oracle_of(folder, [c for c in FILES if c != skip])


def to_legacy(name):
    if ".attentions." in name:
        for new, old in LEGACY.items():
            name = name.replace(new, old)
    return name


def write_legacy_vae(folder):
    """Rename the VAE file's attention tensors to the older query/key/value/proj_attn names."""
    path = os.path.join(folder, "vae", FILES["vae"])
    tensors = load_file(path)
    renamed = {to_legacy(k): v for k, v in tensors.items()}
    assert len(renamed) == len(tensors) and renamed.keys() != tensors.keys()
    write_safetensors(path, renamed, {"format": "pt"})
    return tensors


# --- Valid folders ----------------------------------------------------------------

def test_generated_folder_matches_safetensors_and_configs(model_dir):
    want = oracle(model_dir)
    for target in (model_dir, os.path.join(model_dir, "model_index.json")):
        with open_checkpoint(target) as ck:
            assert ck.format == "diffusers"
            assert set(ck.tensors) == set(want)
            assert list(ck.tensors)[0].startswith("text_encoder.")      # model_index.json's order
            for name, values in want.items():
                t = ck.tensors[name]
                comp = name.split(".", 1)[0]
                assert t.name == name and t.file == os.path.join(model_dir, comp, FILES[comp])
                assert t.dtype == "F32" and t.shape == values.shape and t.nbytes == values.nbytes
                a = ck.array(name)
                assert not a.flags.writeable
                np.testing.assert_array_equal(a, values)
                assert ck.raw(name).tobytes() == values.tobytes()
            assert ck.nbytes == sum(v.nbytes for v in want.values())
            config = ck.metadata["config"]
            assert config == {
                "model_index": read_json(os.path.join(model_dir, "model_index.json")),
                "text_encoder": read_json(os.path.join(model_dir, "text_encoder", "config.json")),
                "unet": read_json(os.path.join(model_dir, "unet", "config.json")),
                "vae": read_json(os.path.join(model_dir, "vae", "config.json")),
                "scheduler": read_json(os.path.join(model_dir, "scheduler", "scheduler_config.json"))}
            assert ck.metadata["tokenizer"] == os.path.abspath(os.path.join(model_dir, "tokenizer"))
            assert ck.metadata["aliases"] == {}
            assert set(ck.metadata) == {"config", "tokenizer", "aliases"}


def test_names_the_numpy_reference_uses(model_dir):
    ref = sd.load(model_dir)["t"]        # the decoder side, current names, prefixed
    with open_checkpoint(model_dir) as ck:
        for name, values in ref.items():
            np.testing.assert_array_equal(ck.array(name), values)


def test_legacy_vae_names_are_aliased(folder):
    original = write_legacy_vae(folder)
    with open_checkpoint(folder) as ck:
        aliases = ck.metadata["aliases"]
        expected = {f"vae.{k}": f"vae.{to_legacy(k)}" for k in original if to_legacy(k) != k}
        assert aliases == expected and len(aliases) == 8          # q, k, v, out: weight and bias
        assert "vae.decoder.mid_block.attentions.0.to_q.weight" in aliases
        assert aliases["vae.decoder.mid_block.attentions.0.to_out.0.bias"] == \
            "vae.decoder.mid_block.attentions.0.proj_attn.bias"
        for alias, target in aliases.items():
            a, t = ck.tensors[alias], ck.tensors[target]
            assert (a.file, a.offset, a.nbytes, a.dtype, a.shape) == (t.file, t.offset, t.nbytes, t.dtype, t.shape)
            assert np.shares_memory(ck.array(alias), ck.array(target))     # the same mapped bytes
            np.testing.assert_array_equal(ck.array(alias), original[alias[len("vae."):]])
        # every current name is there, so readers need not know the older ones
        assert {f"vae.{k}" for k in original} <= set(ck.tensors)
        assert list(ck.tensors)[-len(aliases):] == list(aliases)          # aliases come last
        for name, values in sd.load(folder)["t"].items():                 # the reference renames likewise
            np.testing.assert_array_equal(ck.array(name), values)


def test_sharded_component(folder):
    unet = os.path.join(folder, "unet")
    tensors = load_file(os.path.join(unet, FILES["unet"]))
    names = sorted(tensors)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[:len(names) // 2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, part in shards.items():
        write_safetensors(os.path.join(unet, shard), {n: tensors[n] for n in part})
        weight_map.update({n: shard for n in part})
    os.remove(os.path.join(unet, FILES["unet"]))
    write_json(os.path.join(unet, "diffusion_pytorch_model.safetensors.index.json"),
               {"metadata": {"total_size": 1}, "weight_map": weight_map})
    with open_checkpoint(folder) as ck:
        for n, values in tensors.items():
            assert os.path.basename(ck.tensors[f"unet.{n}"].file) == weight_map[n]
            np.testing.assert_array_equal(ck.array(f"unet.{n}"), values)
        assert set(ck.tensors) == set(oracle_without(folder, "unet")) | {f"unet.{n}" for n in tensors}


def test_null_and_unlisted_components_are_skipped(folder):
    index_path = os.path.join(folder, "model_index.json")
    index = read_json(index_path)
    index["text_encoder"] = [None, None]
    index["tokenizer"] = [None, None]
    del index["scheduler"]
    write_json(index_path, index)
    shutil.rmtree(os.path.join(folder, "text_encoder"))
    shutil.rmtree(os.path.join(folder, "tokenizer"))
    with open_checkpoint(folder) as ck:
        assert set(ck.metadata["config"]) == {"model_index", "unet", "vae"}
        assert "tokenizer" not in ck.metadata
        assert not any(n.startswith("text_encoder.") for n in ck.tensors)
        assert set(ck.tensors) == set(oracle_without(folder, "text_encoder"))


def test_weightless_components_are_not_read(folder):
    # SD 1.5's own folder: a safety checker as a pytorch .bin, a feature extractor with only a config
    index_path = os.path.join(folder, "model_index.json")
    index = read_json(index_path)
    index["safety_checker"] = ["stable_diffusion", "StableDiffusionSafetyChecker"]
    index["feature_extractor"] = ["transformers", "CLIPImageProcessor"]
    write_json(index_path, index)
    os.makedirs(os.path.join(folder, "safety_checker"))
    with open(os.path.join(folder, "safety_checker", "pytorch_model.bin"), "wb") as f:
        f.write(b"PK\x03\x04 not read")
    os.makedirs(os.path.join(folder, "feature_extractor"))
    write_json(os.path.join(folder, "feature_extractor", "preprocessor_config.json"), {"crop_size": 224})
    with open_checkpoint(folder) as ck:
        assert set(ck.tensors) == set(oracle(folder))
        assert set(ck.metadata["config"]) == {"model_index", "text_encoder", "unet", "vae", "scheduler"}


def test_other_formats_are_unchanged(tmp_path):
    # a folder with model.safetensors (and a config) but no model_index.json stays a safetensors checkpoint
    write_safetensors(tmp_path / "model.safetensors", {"w": np.ones(2, np.float32)})
    write_json(tmp_path / "config.json", {"n": 1})
    with open_checkpoint(tmp_path) as ck:
        assert ck.format == "safetensors" and ck.metadata["config"] == {"n": 1}


def test_close_releases_every_map(model_dir):
    ck = open_checkpoint(model_dir)
    maps = list(ck._maps.values())
    assert len(maps) == 3
    ck.raw("unet.conv_in.weight")
    ck.close()
    assert all(m.closed for m in maps)
    with pytest.raises(WeightsError, match="checkpoint is closed"):
        ck.raw("unet.conv_in.weight")


def test_a_failure_releases_what_was_mapped(folder, monkeypatch):
    mapped = []
    real = W._map_file

    def recording(*args):
        buf = real(*args)
        mapped.append(buf)
        return buf
    monkeypatch.setattr(W, "_map_file", recording)
    path = os.path.join(folder, "vae", FILES["vae"])      # the last component: two are mapped by then
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(WeightsError, match=re.escape(path)):
        open_checkpoint(folder)
    assert len(mapped) == 3 and all(m.closed for m in mapped)


# --- Broken folders -----------------------------------------------------------------

def edit_index(change):
    def apply(folder):
        path = os.path.join(folder, "model_index.json")
        index = read_json(path)
        change(index)
        write_json(path, index)
        return path
    return apply


def write_file(rel, data):
    def apply(folder):
        path = os.path.join(folder, rel)
        with open(path, "wb") as f:
            f.write(data)
        return path
    return apply


def remove(rel):
    def apply(folder):
        path = os.path.join(folder, rel)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
        return os.path.dirname(path) if rel.endswith(".safetensors") else path
    return apply


def truncate(rel):
    def apply(folder):
        path = os.path.join(folder, rel)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 7)
        return path
    return apply


def second_weights_file(folder):
    shutil.copy(os.path.join(folder, "unet", FILES["unet"]), os.path.join(folder, "unet", "model.safetensors"))
    return os.path.join(folder, "unet")


def both_vae_names(folder):
    path = os.path.join(folder, "vae", FILES["vae"])
    tensors = load_file(path)
    tensors["decoder.mid_block.attentions.0.query.weight"] = tensors["decoder.mid_block.attentions.0.to_q.weight"]
    write_safetensors(path, tensors)
    return path


def bad_shard_index(folder):
    unet = os.path.join(folder, "unet")
    os.remove(os.path.join(unet, FILES["unet"]))
    path = os.path.join(unet, "diffusion_pytorch_model.safetensors.index.json")
    write_json(path, {"weight_map": {"conv_in.weight": "../vae/diffusion_pytorch_model.safetensors"}})
    return path


def set_key(key, value):
    return edit_index(lambda index: index.__setitem__(key, value))


BROKEN = {
    "missing weights file": (remove("unet/diffusion_pytorch_model.safetensors"),
                             "component 'unet' must hold exactly one of .*; found none"),
    "missing component folder": (remove("vae"), "component 'vae' must hold exactly one of"),
    "two weights files": (second_weights_file,
                          r"found \['diffusion_pytorch_model.safetensors', 'model.safetensors'\]"),
    "truncated text encoder": (truncate("text_encoder/model.safetensors"), "fall outside the data section"),
    "truncated vae header": (write_file("vae/diffusion_pytorch_model.safetensors", b"\x10\0\0\0\0\0\0\0{"),
                             "header needs bytes"),
    "model_index a list": (write_file("model_index.json", b"[1, 2]"),
                           "model_index.json must be a JSON object, got list"),
    "model_index a string": (write_file("model_index.json", b'"unet"'), "must be a JSON object, got str"),
    "model_index not JSON": (write_file("model_index.json", b'{"unet": '), "model_index.json is not valid JSON"),
    "model_index not UTF-8": (write_file("model_index.json", b'{"\xff": 1}'), "is not valid UTF-8"),
    "model_index duplicate key": (write_file("model_index.json", b'{"unet": [null, null], "unet": [null, null]}'),
                                  "duplicate key 'unet'"),
    "parent component": (set_key("../unet", ["diffusers", "UNet2DConditionModel"]),
                         r"component name '\.\./unet' is not a plain folder name"),
    "nested component": (set_key("unet/x", ["diffusers", "X"]), "component name 'unet/x' is not a plain"),
    "dot-dot component": (set_key("..", ["diffusers", "X"]), r"component name '\.\.' is not a plain"),
    "backslash component": (set_key("a\\b", ["diffusers", "X"]), "is not a plain folder name"),
    "empty component": (set_key("", ["diffusers", "X"]), "component name '' is not a plain"),
    "nul component": (set_key("a\0", ["diffusers", "X"]), "is not a plain folder name"),
    "entry a string": (set_key("unet", "diffusers"), r"component 'unet' must be \[library, class\]"),
    "entry too short": (set_key("vae", ["diffusers"]), r"component 'vae' must be \[library, class\]"),
    "entry half null": (set_key("unet", [None, "UNet2DConditionModel"]), r"or \[null, null\]"),
    "entry numbers": (set_key("feature_extractor", [1, 2]), "component 'feature_extractor' must be"),
    "config missing": (remove("unet/config.json"), "cannot read"),
    "config a list": (write_file("unet/config.json", b"[]"), "config.json must be a JSON object, got list"),
    "config not JSON": (write_file("vae/config.json", b"{,}"), "config.json is not valid JSON"),
    "scheduler config missing": (remove("scheduler/scheduler_config.json"), "cannot read"),
    "scheduler config a number": (write_file("scheduler/scheduler_config.json", b"7"),
                                  "scheduler_config.json must be a JSON object, got int"),
    "tokenizer folder missing": (remove("tokenizer"), "names a tokenizer but this folder does not exist"),
    "both vae names": (both_vae_names, "holds both .*query.weight' and .*to_q.weight'"),
    "shard outside the component": (bad_shard_index, "shards must be plain file names"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_folders_raise_weights_error_naming_the_file(folder, case):
    change, match = BROKEN[case]
    path = change(folder)
    with pytest.raises(WeightsError, match=match) as info:
        open_checkpoint(folder)
    assert info.value.message.startswith(path + ": "), (path, info.value.message)


# --- Fuzzing: mutated model_index.json opens or rejects, nothing else ---------------

INDEX = json.dumps(gen.MODEL_INDEX, indent=2).encode()
KEYS = ["unet", "vae", "text_encoder", "scheduler", "tokenizer", "safety_checker", "_class_name",
        "../unet", "a/b", "..", ".", "", "x\\y", "unet\u0000", "vae "]
VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8)
                      | st.sampled_from(["diffusers", "transformers", "UNet2DConditionModel"]),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                  max_size=2),
                      max_leaves=6)


@st.composite
def mutated_bytes(draw):
    data = bytearray(INDEX)
    for _ in range(draw(st.integers(0, 4))):
        pos = draw(st.integers(0, len(data) - 1))
        kind = draw(st.sampled_from(["byte", "json", "delete"]))
        if kind == "byte":
            data[pos] = draw(st.integers(0, 255))
        elif kind == "json":    # characters that change the structure rather than a letter
            data[pos:pos] = draw(st.sampled_from([b"[", b"]", b"{", b"}", b",", b'"', b"null", b":", b"\\", b"/"]))
        else:
            del data[pos:pos + draw(st.integers(1, 8))]
    if draw(st.integers(0, 4)) == 0:      # any cut is invalid JSON: only sometimes
        del data[draw(st.integers(0, len(data))):]
    return bytes(data)


@st.composite
def mutated_index(draw):
    index = dict(gen.MODEL_INDEX)
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(KEYS))
        if draw(st.booleans()):
            index[key] = draw(VALUES)
        else:
            index.pop(key, None)
    return json.dumps(index).encode()


FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def fuzz_folder(model_dir, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fuzz") / "m")
    shutil.copytree(model_dir, d)
    return d


def open_or_reject(folder, data):
    with open(os.path.join(folder, "model_index.json"), "wb") as f:
        f.write(data)
    try:
        ck = open_checkpoint(folder)
    except WeightsError as e:
        assert e.message.startswith(folder)
        event("rejected")
        return
    event(f"opened with {len(ck.metadata['config']) - 1} components")
    with ck:                    # what opened must read in full
        assert ck.format == "diffusers"
        for name in ck.tensors:
            ck.raw(name)
            assert ck.array(name).shape == ck.tensors[name].shape


@FUZZ
@given(data=mutated_bytes())
def test_fuzz_model_index_bytes(fuzz_folder, data):
    open_or_reject(fuzz_folder, data)


@FUZZ
@given(data=mutated_index())
def test_fuzz_model_index_structure(fuzz_folder, data):
    open_or_reject(fuzz_folder, data)


def test_fuzz_original_opens(fuzz_folder):
    with open(os.path.join(fuzz_folder, "model_index.json"), "wb") as f:
        f.write(INDEX)
    with open_checkpoint(fuzz_folder) as ck:
        assert len(ck.tensors) == len(oracle(fuzz_folder))
