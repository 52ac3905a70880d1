"""LoRA adapters applied per request (loom/lora.py, opencl/lora.cl, models/sd/sd.loom's lora
terms) against the numpy reference (tests/sd_numpy.py: read_lora, apply_lora, with_loras).

pack() is checked on the generated adapters (watercolor: kohya, UNet and text encoder; ink:
diffusers/PEFT, UNet only), on every layout it reads, on each file it must refuse and on
mutated bytes. The package, prepared with the adapters on every CPU driver, must equal the
reference with each prompt's or image's own adapters and strengths, leave the base model's
bits alone where the strengths are zero, and give an image in a batch the bits it gets alone.
"""
import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.numpy import save_file

from conftest import drivers, compiler_for
from loom import lora, runtime, weights
from loom.device import Device
from loom.errors import Problem

import sd_numpy as ref
from test_kernels import shared_env, i32
from test_sd import SOURCE, _temb_inputs, channels_last, close, generate, run

f32 = np.float32
TE = "text_encoder.text_model.encoder.layers"
TF = "unet.down_blocks.0.attentions.0"
TB = TF + ".transformer_blocks.0"


def kohya(name):
    """kohya-ss's module key for a base weight name."""
    comp, module = name.split(".", 1)
    return {"unet": "lora_unet_", "text_encoder": "lora_te_"}[comp] + module[:-len(".weight")].replace(".", "_")


def factors(shapes, names, rank, seed, strength=0.5, conv_factors=False):
    """{weight: (down [rank, K], up [N, rank])} of random factors; conv_factors: 1x1 convolutions'
    as 4-d [rank, K, 1, 1] / [N, rank, 1, 1], the way kohya saves them."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in names:
        n, k = shapes[name][:2]
        down = (rng.standard_normal((rank, k)) / np.sqrt(k)).astype(f32)
        up = (rng.standard_normal((n, rank)) * strength / np.sqrt(rank)).astype(f32)
        if conv_factors and len(shapes[name]) == 4:
            down, up = down[:, :, None, None], up[:, :, None, None]
        out[name] = (down, up)
    return out


def full_targets(shapes):
    """Everything the generated adapters leave alone: the text encoder's MLPs and the spatial
    transformers' proj_in/out and feed-forwards, plus the cross-attention's k/v (ink's too)."""
    return [n for n in shapes if lora.TARGETS.fullmatch(n) and (
        ".mlp." in n or ".proj_in." in n or ".proj_out." in n or ".ff." in n or ".attn2.to_k." in n
        or ".attn2.to_v." in n or n == f"{TE}.1.self_attn.q_proj.weight")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sd"))
    generate.generate_default(out)
    with weights.open_checkpoint(out) as cp:
        shapes = {n: t.shape for n, t in cp.tensors.items()}
    # "full": rank 3, kohya, 1x1 convolution factors 4-d; an alpha on half the modules
    tensors = {}
    for i, (name, (down, up)) in enumerate(factors(shapes, full_targets(shapes), 3, 7, conv_factors=True).items()):
        tensors.update({f"{kohya(name)}.lora_down.weight": down, f"{kohya(name)}.lora_up.weight": up})
        if i % 2:
            tensors[f"{kohya(name)}.alpha"] = np.array(1.5, f32)
    save_file(tensors, os.path.join(out, "loras", "full.safetensors"))
    return out


@pytest.fixture(scope="module")
def W(folder):
    return ref.load(folder)


@pytest.fixture(scope="module")
def shapes(folder):
    with weights.open_checkpoint(folder) as cp:
        return {n: t.shape for n, t in cp.tensors.items()}


def entries(folder, *names):
    return [(name, os.path.join(folder, "loras", f"{name}.safetensors")) for name in names]


def deltas(arrays, shapes, name, index):
    """alpha / rank * up @ down of adapter `index` on weight `name`, from the packed rows."""
    shape = shapes[name]
    n, k = shape[0], int(np.prod(shape[1:]))
    packed = arrays["lora." + name]
    rows = packed[:, k + n] == index
    return (packed[rows, k:k + n].T.astype(np.float64) @ packed[rows, :k]).reshape(shape)


# ---- pack ------------------------------------------------------------------------------

def test_pack_reproduces_the_reference_deltas(folder, W, shapes):
    arrays, meta = lora.pack(entries(folder, "watercolor", "ink"), shapes)
    adapters = [ref.read_lora(W, path) for _, path in entries(folder, "watercolor", "ink")]
    touched = set(adapters[0]) | set(adapters[1])
    assert any(n.startswith("text_encoder.") for n in adapters[0]) and not any(
        n.startswith("text_encoder.") for n in adapters[1])
    assert set(arrays) == {"lora." + n for n in touched}
    ranks = {}
    for name in touched:
        packed = arrays["lora." + name]
        n, k = shapes[name][0], int(np.prod(shapes[name][1:]))
        owners = packed[:, k + n]
        assert packed.dtype == f32 and packed.shape[1] == k + n + 1
        assert list(owners) == sorted(owners)                      # grouped by adapter, in entry order
        assert len(packed) == sum(len(a[name]["down"]) for a in adapters if name in a)
        ranks[name] = len(packed)
        for index, adapter in enumerate(adapters):
            if name in adapter:
                want = ref.apply_lora(name, 1.0, adapter)
                np.testing.assert_allclose(deltas(arrays, shapes, name, index), want,
                                           atol=1e-6 * np.abs(want).max(), rtol=1e-5)
            else:
                assert not (owners == index).any()
    assert meta == {"loras": ["watercolor", "ink"], "lora_rank": max(ranks.values())} and meta["lora_rank"] == 8
    assert lora.pack([], shapes) == ({}, {"loras": [], "lora_rank": 0})


def _layouts(shapes):
    """The same adapter in each layout pack reads: (file name, tensors, metadata)."""
    names = [f"{TE}.0.self_attn.q_proj.weight", f"{TE}.1.mlp.fc1.weight", f"{TF}.proj_in.weight",
             f"{TB}.ff.net.2.weight", f"{TB}.attn2.to_k.weight", "unet.mid_block.attentions.0.proj_out.weight"]
    fs = factors(shapes, names, 2, 3)
    conv = factors(shapes, names, 2, 3, conv_factors=True)
    out = []
    t = {}
    for name, (down, up) in conv.items():
        t.update({f"{kohya(name)}.lora_down.weight": down, f"{kohya(name)}.lora_up.weight": up,
                  f"{kohya(name)}.alpha": np.array(3.0, f32)})
    out.append(("kohya", t, None))
    t = {}
    for name, (down, up) in fs.items():
        t.update({f"{name[:-7]}.lora_A.weight": down, f"{name[:-7]}.lora_B.weight": up})
    out.append(("diffusers", t, {"unet.lora_alpha": 4.0, "text_encoder.lora_alpha": 1.0, "unet.r": 2}))
    t = {}
    for name, (down, up) in fs.items():
        module = name[:-7].removeprefix("text_encoder.").removeprefix("unet.")   # text_model. / bare UNet names
        t.update({f"{module}.lora.down.weight": down, f"{module}.lora.up.weight": up})
    out.append(("bare", t, {"unet.lora_alpha": 0.5, "text_encoder.lora_alpha": 8}))
    t = {}
    for name, (down, up) in fs.items():
        if name.startswith("unet."):       # a raw PEFT save of the UNet: no alpha, so alpha = rank
            t.update({f"base_model.model.{name[5:-7]}.lora_A.weight": down,
                      f"base_model.model.{name[5:-7]}.lora_B.weight": up})
    out.append(("peft", t, None))
    return out


@pytest.mark.parametrize("layout", ["kohya", "diffusers", "bare", "peft"])
def test_pack_reads_every_layout(tmp_path, W, shapes, layout):
    _, tensors, config = next(x for x in _layouts(shapes) if x[0] == layout)
    path = str(tmp_path / f"{layout}.safetensors")
    save_file(tensors, path, {"lora_adapter_metadata": json.dumps(config)} if config else None)
    arrays, meta = lora.pack([("solo", path)], shapes)
    adapter = ref.read_lora(W, path)
    assert set(arrays) == {"lora." + n for n in adapter} and meta == {"loras": ["solo"], "lora_rank": 2}
    for name in adapter:
        want = ref.apply_lora(name, 1.0, adapter)
        np.testing.assert_allclose(deltas(arrays, shapes, name, 0), want, atol=1e-6 * np.abs(want).max(), rtol=1e-5)


def test_pack_reads_alpha_patterns_and_rslora(tmp_path, shapes):
    """PEFT's per-module alpha (literal module names) and rank-stabilized scaling (alpha / sqrt(rank))."""
    names = [f"{TB}.attn1.to_q.weight", f"{TB}.attn1.to_k.weight"]
    fs = factors(shapes, names, 4, 5)
    t = {}
    for name, (down, up) in fs.items():
        t.update({f"{name[:-7]}.lora_A.weight": down, f"{name[:-7]}.lora_B.weight": up})
    path = str(tmp_path / "p.safetensors")
    config = {"unet.lora_alpha": 8, "unet.alpha_pattern": {"attn1.to_k": 2.0}, "unet.use_rslora": True}
    save_file(t, path, {"lora_adapter_metadata": json.dumps(config)})
    arrays, _ = lora.pack([("p", path)], shapes)
    for name, alpha in zip(names, (8, 2.0)):
        down, up = fs[name]
        np.testing.assert_allclose(deltas(arrays, shapes, name, 0), alpha / 2.0 * (up @ down), rtol=1e-5, atol=1e-7)


Q = f"{TB}.attn1.to_q.weight"
REFUSALS = ("3x3 convolution", "loha", "misfit", "no such kohya module", "no such PEFT module", "not a LoRA key",
            "missing up", "missing down", "non-float", "rank 0", "NaN", "overflow", "untargeted",
            "alpha not a number", "twice", "metadata not JSON", "metadata alpha", "alpha pattern regex", "empty")


def _refusals(shapes):
    """case -> (tensors, metadata, what the message says, the key it names or None)."""
    conv = "unet.down_blocks.0.resnets.0.conv1.weight"
    temb = "unet.down_blocks.0.resnets.0.time_emb_proj.weight"
    cout, cin = shapes[conv][:2]
    fs = factors(shapes, [Q, temb], 2, 1)
    d, u, a = f"{kohya(Q)}.lora_down.weight", f"{kohya(Q)}.lora_up.weight", f"{kohya(Q)}.alpha"
    good = {d: fs[Q][0], u: fs[Q][1]}
    peft = {f"{Q[:-7]}.lora_A.weight": fs[Q][0], f"{Q[:-7]}.lora_B.weight": fs[Q][1]}
    unknown = "lora_unet_down_blocks_7_attentions_0_proj_in.lora_down.weight"

    def meta(config):
        return {"lora_adapter_metadata": config if isinstance(config, str) else json.dumps(config)}
    return {
        "3x3 convolution": ({f"{kohya(conv)}.lora_down.weight": np.zeros((4, cin, 3, 3), f32),
                             f"{kohya(conv)}.lora_up.weight": np.zeros((cout, 4, 1, 1), f32)},
                            None, "3x3 convolution", f"{kohya(conv)}.lora_down.weight"),
        "loha": (dict(good, **{f"{kohya(Q)}.hada_w1_a": np.zeros((32, 2), f32)}), None, "LyCORIS/LoHa",
                 f"{kohya(Q)}.hada_w1_a"),
        "misfit": ({d: np.zeros((2, 33), f32), u: good[u]}, None, "do not fit", d),
        "no such kohya module": ({unknown: good[d]}, None, "names no weight", unknown),
        "no such PEFT module": ({"unet.down_blocks.7.attentions.0.proj_in.lora_A.weight": good[d]}, None,
                                "names no weight", "unet.down_blocks.7.attentions.0.proj_in.lora_A.weight"),
        "not a LoRA key": (dict(good, emb_params=np.zeros(3, f32)), None, "is not a LoRA factor", "emb_params"),
        "missing up": ({d: good[d]}, None, "no up factor", d),
        "missing down": ({u: good[u], a: np.array(2.0, f32)}, None, "no down factor", u),
        "non-float": ({d: good[d].astype(np.int32), u: good[u]}, None, "I32; LoRA factors must be floating", d),
        "rank 0": ({d: np.zeros((0, 32), f32), u: np.zeros((32, 0), f32)}, None, "rank 0", d),
        "NaN": ({d: good[d], u: np.full_like(good[u], np.nan)}, None, "NaN or infinity", u),
        "overflow": ({d: good[d], u: np.full_like(good[u], 10.0), a: np.array(3e38, f32)}, None,
                     "overflows float32", u),
        "untargeted": ({f"{kohya(temb)}.lora_down.weight": fs[temb][0], f"{kohya(temb)}.lora_up.weight": fs[temb][1]},
                       None, "applies no LoRA to", f"{kohya(temb)}.lora_down.weight"),
        "alpha not a number": (dict(good, **{a: np.ones(2, f32)}), None, "one number", a),
        "twice": (dict(good, **{f"{Q[:-7]}.lora_A.weight": good[d]}), None, "gives the down of .* again", None),
        "metadata not JSON": (peft, meta("{"), "lora_adapter_metadata is not JSON", None),
        "metadata alpha": (peft, meta({"unet.lora_alpha": "big"}), "must be a finite number", None),
        "alpha pattern regex": (peft, meta({"unet.alpha_pattern": {"attn.*": 1}}), "only literal module names", None),
        "empty": ({}, None, "holds no LoRA tensors", None),
    }


def test_every_refusal_is_tried(shapes):
    assert set(_refusals(shapes)) == set(REFUSALS)


@pytest.mark.parametrize("case", REFUSALS)
def test_pack_refuses(tmp_path, shapes, case):
    tensors, metadata, says, key = _refusals(shapes)[case]
    path = str(tmp_path / "bad.safetensors")
    save_file(tensors, path, metadata)
    with pytest.raises(lora.LoraError, match=says) as e:
        lora.pack([("bad", path)], shapes)
    assert isinstance(e.value, Problem) and e.value.code == "invalid_adapter" and e.value.adapter == "bad"
    assert e.value.message.startswith("adapter 'bad'")
    if key is not None:
        assert e.value.key == key and f"tensor {key!r}" in e.value.message


def test_pack_refuses_files_and_entries(tmp_path, folder, shapes):
    good = entries(folder, "watercolor")[0][1]
    with pytest.raises(lora.LoraError, match="adapter 'watercolor' is registered twice"):
        lora.pack([("watercolor", good), ("watercolor", good)], shapes)
    with pytest.raises(lora.LoraError, match="non-empty string id"):
        lora.pack([("", good)], shapes)
    with pytest.raises(lora.LoraError, match="adapter 'x': .* is not a .safetensors file"):
        lora.pack([("x", os.path.join(folder, "unet", "config.json"))], shapes)
    with pytest.raises(lora.LoraError, match="adapter 'gone': "):
        lora.pack([("gone", str(tmp_path / "gone.safetensors"))], shapes)
    (tmp_path / "short.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(lora.LoraError, match="adapter 'short': .*short.safetensors") as e:
        lora.pack([("short", str(tmp_path / "short.safetensors"))], shapes)
    assert e.value.code == "invalid_adapter" and e.value.adapter == "short"


# ---- fuzz: mutated adapter bytes ----------------------------------------------------------

SMALL_SHAPES = {Q: (32, 32), f"{TB}.attn1.to_k.weight": (32, 32), f"{TF}.proj_in.weight": (32, 32, 1, 1)}


def _small_adapter():
    """kohya factors (one 1x1 convolution) with alphas, and a PEFT pair with metadata alpha."""
    fs = factors(SMALL_SHAPES, list(SMALL_SHAPES), 2, 9, conv_factors=True)
    t = {}
    for name in (Q, f"{TF}.proj_in.weight"):
        t.update({f"{kohya(name)}.lora_down.weight": fs[name][0], f"{kohya(name)}.lora_up.weight": fs[name][1],
                  f"{kohya(name)}.alpha": np.array(1.0, f32)})
    k = f"{TB}.attn1.to_k"
    t.update({f"{k}.lora_A.weight": fs[k + ".weight"][0], f"{k}.lora_B.weight": fs[k + ".weight"][1]})
    from safetensors.numpy import save
    data = save(t, {"lora_adapter_metadata": json.dumps({"unet.lora_alpha": 2})})
    return data, 8 + int.from_bytes(data[:8], "little")


SMALL, SMALL_HEADER = _small_adapter()


@st.composite
def mutated(draw):
    """A few bytes, integers or floats overwritten (half of them in the header), maybe truncated."""
    data = bytearray(SMALL)
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.one_of(st.integers(0, SMALL_HEADER - 1), st.integers(0, len(data) - 1)))
        kind = draw(st.sampled_from(["byte", "u64", "u32", "f32"]))
        if kind == "byte":
            data[pos] = draw(st.integers(0, 255))
        elif kind == "f32":
            data[pos:pos + 4] = f32(draw(st.sampled_from([np.nan, np.inf, 3e38, -0.0, 0.0, 7.0]))).tobytes()
        else:
            width = 8 if kind == "u64" else 4
            value = draw(st.one_of(st.integers(0, 64), st.integers(0, 2**(8 * width) - 1)))
            data[pos:pos + width] = value.to_bytes(width, "little")
    return bytes(data[:draw(st.integers(0, len(data)))] if draw(st.booleans()) else data)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def test_fuzz_original_packs(fuzz_dir):
    (fuzz_dir / "small.safetensors").write_bytes(SMALL)
    arrays, meta = lora.pack([("s", str(fuzz_dir / "small.safetensors"))], SMALL_SHAPES)
    assert len(arrays) == 3 and meta["lora_rank"] == 2


@settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=mutated())
def test_fuzz_mutated_adapters_pack_or_raise_lora_error(fuzz_dir, data):
    path = fuzz_dir / "m.safetensors"
    path.write_bytes(data)
    try:
        arrays, meta = lora.pack([("m", str(path))], SMALL_SHAPES)
    except lora.LoraError as e:
        assert e.code == "invalid_adapter" and e.message.startswith("adapter 'm'")
        return
    for name, a in arrays.items():       # what packs is what the kernels can take
        n, k = SMALL_SHAPES[name[5:]][:2]
        assert a.dtype == f32 and a.shape[1] == k + n + 1 and np.isfinite(a).all() and set(a[:, -1]) == {0.0}
    assert meta["loras"] == ["m"] and meta["lora_rank"] == max(len(a) for a in arrays.values())


# ---- the kernels ------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=drivers())
def env(request):
    return shared_env(request.param)


@pytest.mark.every_driver
@pytest.mark.parametrize("k, vw, nv", [(37, 4, 4), (40, 8, 8), (48, 16, 16)])
def test_kernels_against_numpy(env, k, vw, nv):
    """lora_down then lora_up on views (offsets, wider leading dimensions), K and N not multiples
    of the vector widths, a tail of tokens, rows of three images, one of which selects nothing."""
    rng = np.random.default_rng(k)
    n, ranks, t, rows, ldx, x_off, ldy, y_off = 13, (2, 1, 3), 7, 3, k + 5, 3, 17, 2
    owner = np.repeat(np.arange(len(ranks)), ranks)
    down = rng.standard_normal((len(owner), k)).astype(f32)
    up = rng.standard_normal((len(owner), n)).astype(f32)
    packed = np.concatenate([down, up, owner[:, None].astype(f32)], axis=1)
    scales = np.array([[0.5, 0, -2], [0, 0, 0], [1, 3, 0]], f32)        # image 1 selects nothing
    x = rng.standard_normal(x_off + t * ldx).astype(f32)
    y0 = rng.standard_normal(y_off + t * ldy + 3).astype(f32)
    y0[y_off + 4 * ldy] = -0.0                                          # image 1's bits stay, even a -0
    X = x[x_off:].reshape(t, ldx)[:, :k]
    prg = env.build("lora", K=k, N=n, LORAS=len(ranks), VW=vw, NV=nv)
    bx, ba, bs, by, bu = env.buf(x), env.buf(packed), env.buf(scales), env.buf(y0), env.empty(4 * t * len(owner))
    env.run(prg.lora_down, (len(owner), -(-t // 4)), None, bx, i32(x_off), i32(ldx), ba, bs, i32(rows), bu,
            i32(len(owner)), i32(t))
    env.run(prg.lora_up, (-(-n // nv), -(-t // 4)), None, bu, ba, by, i32(y_off), i32(ldy), i32(len(owner)), i32(t))
    u = env.read(bu, (t, len(owner)))
    s = scales[np.arange(t)[:, None] // rows, owner[None, :]]
    want_u = s * (X.astype(np.float64) @ down.T)
    np.testing.assert_allclose(u, want_u, rtol=1e-5, atol=1e-5)
    assert (u[s == 0] == 0).all()
    y = env.read(by, y0.shape)
    want = y0.astype(np.float64).copy()
    view = want[y_off:y_off + t * ldy].reshape(t, ldy)
    view[:, :n] += want_u @ up
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    image1 = slice(y_off + 3 * ldy, y_off + 6 * ldy)
    assert y[image1].tobytes() == y0[image1].tobytes()
    outside = np.ones(len(y0), bool)
    outside[y_off:y_off + t * ldy] = np.tile(np.arange(ldy) >= n, t)
    assert y[outside].tobytes() == y0[outside].tobytes()


# ---- the package on the device --------------------------------------------------------------

@pytest.fixture(scope="module", params=drivers())
def deployments(request, folder):
    """Per driver: the base model, with watercolor and ink ("both"), with full and ink ("full");
    one compiler, so the three share their builds."""
    dev = Device(request.param)
    compiler = compiler_for(dev)

    def prepared(*names):
        def extend(cp):
            return lora.pack(entries(folder, *names), {n: t.shape for n, t in cp.tensors.items()})
        return runtime.prepare("illustrator", [SOURCE], folder, {}, dev, compiler, extend=extend if names else None)
    out = {"base": prepared(), "both": prepared("watercolor", "ink"), "full": prepared("full", "ink")}
    yield out
    for p in out.values():
        p.release()


@pytest.fixture(scope="module")
def adapters(folder, W):
    return {name: ref.read_lora(W, path) for name, path in entries(folder, "watercolor", "ink", "full")}


PROMPTS = ["a red fox in the snow", "watercolor painting of a castle at night", "ink sketch of a boat"]
TEXT_SCALES = [[0, 0], [0.3, 0.7], [-1, 0]]                 # none; watercolor 0.3 + ink 0.7; watercolor -1
IMAGE_SCALES = [[0, 0], [0.3, 0.7], [0, -1.5]]              # none; watercolor 0.3 + ink 0.7; ink -1.5
SIZE = 8          # 8x8 latents: 64 pixel rows an image, fewer than its 77 context rows


def encode(p, W, prompts, scales):
    ids = np.array([ref.tokenize(W, q) for q in prompts], np.int32)
    return run(p, "encode_text", {"S": len(prompts)}, {"ids": ids.ravel(), "scales": np.asarray(scales, f32)},
               {"context": ids.size * p.spec("TEXT_D")})["context"].reshape(len(prompts), 77, -1)


@pytest.fixture(scope="module")
def images(W):
    """Three latent images, each with its own timestep and prompt context."""
    rng = np.random.default_rng(11)
    latents = rng.standard_normal((3, 4, SIZE, SIZE)).astype(f32)
    timesteps = [999, 500, 1]
    context = np.stack([ref.text_encoder(W, ref.tokenize(W, q)) for q in PROMPTS])
    return latents, timesteps, context, _temb_inputs(W, timesteps)[0]


def denoise(p, images, which, scales):
    latents, _, context, t_emb = images
    n = len(which)
    return run(p, "denoise", {"N": n, "H": SIZE, "W": SIZE},
               {"latents": np.stack([channels_last(latents[i]) for i in which]).ravel(), "t_emb": t_emb[which].ravel(),
                "context": context[which].ravel(), "kv_offs": (np.arange(n + 1) * 77).astype(np.int32),
                "scales": np.asarray(scales, f32)},
               {"eps": n * SIZE * SIZE * 4})["eps"].reshape(n, SIZE, SIZE, 4)


def selected(W, adapters, names, scales):
    return ref.with_loras(W, [(adapters[name], s) for name, s in zip(names, scales)])


def test_text_encoder_with_each_prompts_adapters(deployments, W, adapters):
    got = encode(deployments["both"], W, PROMPTS, TEXT_SCALES)
    for i, prompt in enumerate(PROMPTS):
        ids = ref.tokenize(W, prompt)
        want = ref.text_encoder(selected(W, adapters, ("watercolor", "ink"), TEXT_SCALES[i]), ids)
        _, scale = close(got[i], want)
        if i:          # the adapters do change these prompts, far beyond the tolerance
            assert np.abs(want - ref.text_encoder(W, ids)).max() > 0.01 * scale


def test_unet_with_each_images_adapters(deployments, W, adapters, images):
    latents, timesteps, context, _ = images
    got = denoise(deployments["both"], images, [0, 1, 2], IMAGE_SCALES)
    for n in range(3):
        want = ref.unet(selected(W, adapters, ("watercolor", "ink"), IMAGE_SCALES[n]), latents[n], timesteps[n],
                        context[n])
        _, scale = close(got[n], channels_last(want), rel=1e-4)
        if n:
            assert np.abs(want - ref.unet(W, latents[n], timesteps[n], context[n])).max() > 0.01 * scale


def test_every_projection_kind_with_two_adapters_of_different_ranks(deployments, W, adapters, images):
    """full (rank 3, kohya, 1x1 convolution factors) touches the text encoder's MLPs, proj_in/out,
    the feed-forwards and the cross-attention's k/v, where ink (rank 4) joins it."""
    p = deployments["full"]
    assert p.spec("LORAS") == 2 and p.spec("LORA_RANK") == 7
    text_scales = [[0.8, 0], [-0.5, 0.4]]
    got = encode(p, W, PROMPTS[:2], text_scales)
    for i in range(2):
        close(got[i], ref.text_encoder(selected(W, adapters, ("full", "ink"), text_scales[i]),
                                       ref.tokenize(W, PROMPTS[i])))
    latents, timesteps, context, _ = images
    image_scales = [[1.0, 0.5], [-0.7, 0], [0, 0]]
    got = denoise(p, images, [0, 1, 2], image_scales)
    for n in range(3):
        want = ref.unet(selected(W, adapters, ("full", "ink"), image_scales[n]), latents[n], timesteps[n], context[n])
        close(got[n], channels_last(want), rel=1e-4)


def _same_bits(a, b):
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def test_zero_strengths_keep_the_base_models_bits(deployments, W, images):
    base = deployments["base"]
    text = encode(base, W, PROMPTS, np.zeros((3, 1)))
    eps = denoise(base, images, [0, 1, 2], np.zeros((3, 1)))
    for name in ("both", "full"):
        assert _same_bits(encode(deployments[name], W, PROMPTS, np.zeros((3, 2))), text)
        assert _same_bits(denoise(deployments[name], images, [0, 1, 2], np.zeros((3, 2))), eps)


def test_a_batched_image_equals_the_image_alone(deployments, W, images):
    """Rows never mix: each prompt or image of a batch of different selections gets the bits it
    gets alone (and one without adapters, the base model's)."""
    p = deployments["both"]
    text = encode(p, W, PROMPTS, TEXT_SCALES)
    eps = denoise(p, images, [0, 1, 2], IMAGE_SCALES)
    for i in range(3):
        assert _same_bits(encode(p, W, PROMPTS[i:i + 1], TEXT_SCALES[i:i + 1]), text[i:i + 1])
        assert _same_bits(denoise(p, images, [i], IMAGE_SCALES[i:i + 1]), eps[i:i + 1])
    assert _same_bits(denoise(deployments["base"], images, [0], np.zeros((1, 1))), eps[:1])


def test_lora_launches_only_where_an_adapter_is_bound(deployments):
    for name, p in deployments.items():
        packed = [n for n in p.binding.tensors if n.startswith("lora.")]
        for command, geometry, prefix in (("encode_text", {"S": 2}, "lora.text_encoder."),
                                          ("denoise", {"N": 2, "H": SIZE, "W": SIZE}, "lora.unet.")):
            plan = p.binding.plan(command, **geometry)
            kernels = [launch.kernel for launch in plan.launches]
            # each packed weight is applied once per stage (every transformer runs once a denoise)
            assert kernels.count("lora_down") == kernels.count("lora_up") == sum(n.startswith(prefix) for n in packed)
            if name == "base":
                assert not packed and plan.scratch["lu"] == ("f32", (1, 1))
