"""models/sd/sd.loom, Stable Diffusion 1.5's networks as Loom commands, against the numpy
reference (tests/sd_numpy.py) on the default illustrator's generated weights: each block
(a UNet resnet, a spatial transformer, a VAE resnet), the text encoder, the whole UNet
over a batch of images at different timesteps and prompts, and the VAE decoder."""
import importlib.util
import os

import numpy as np
import pytest

from conftest import ROOT, drivers, compiler_for
from loom import runtime
from loom.device import Device

import sd_numpy as ref

SOURCE = os.path.join(ROOT, "models", "sd", "sd.loom")
_gen = importlib.util.spec_from_file_location("sd_generate", os.path.join(ROOT, "models", "sd", "generate.py"))
generate = importlib.util.module_from_spec(_gen)
_gen.loader.exec_module(generate)
f32 = np.float32


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("sd")
    generate.generate(str(out))
    return str(out)


@pytest.fixture(scope="module")
def W(folder):
    return ref.load(folder)


@pytest.fixture(scope="module", params=drivers())
def prepared(request, folder):
    dev = Device(request.param)
    p = runtime.prepare("illustrator", [SOURCE], folder, {}, dev, compiler_for(dev))
    yield p
    p.release()


def run(p, command, geometry, inputs, outputs, read=None):
    """Run one command: inputs name -> array (uploaded), outputs name -> floats (allocated);
    -> the arrays of `read` (default: every output), which may name an input changed in place."""
    dev = p.device
    bufs = {name: dev.pool.alloc(a.nbytes, "test", "workspace", host=np.ascontiguousarray(a))
            for name, a in inputs.items()}
    bufs.update({name: dev.pool.alloc(4 * n, "test", "workspace") for name, n in outputs.items()})
    box = {}
    p.plan_async(command, geometry, lambda plan, error: box.update(plan=plan, error=error))
    assert box["error"] is None, box["error"]
    box["plan"].run(bufs).wait()
    read = read or outputs
    got = {name: dev.download(bufs[name], np.float32, n) for name, n in read.items()}
    for buf in bufs.values():
        buf.release()
    return got


def no_adapters(p, n):
    """The scales argument of a deployment without adapters: [n, 1] zeros."""
    return np.zeros((n, max(1, p.spec("LORAS"))), f32)


def close(got, want, rel=2e-5):
    err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
    assert err <= rel * max(scale, 1.0), f"max error {err:.3g} of scale {scale:.3g}"
    return err, scale


def channels_last(x):
    """[C, H, W] (the reference's layout) -> [H, W, C] (the package's)."""
    return np.ascontiguousarray(np.moveaxis(x, 0, -1))


def test_specs_follow_the_checkpoint(prepared, W):
    u, v = W["unet"], W["vae"]
    assert prepared.spec("NB") == len(u["block_out_channels"]) and prepared.spec("LPB") == u["layers_per_block"]
    assert prepared.spec("HEADS") == u["attention_head_dim"] and prepared.spec("GROUPS") == u["norm_num_groups"]
    assert prepared.spec("VNB") == len(v["up_block_types"]) and prepared.spec("VLP") == v["layers_per_block"] + 1
    assert prepared.spec("SEQ") == 77 and prepared.spec("TEXT_D") == W["text_encoder"]["hidden_size"]
    assert prepared.spec("VSCALE") == pytest.approx(v["scaling_factor"])


def test_text_encoder(prepared, W):
    prompts = ["a red fox in the snow", "", "watercolor painting of a castle at night, detailed"]
    ids = np.array([ref.tokenize(W, p) for p in prompts], np.int32)
    got = run(prepared, "encode_text", {"S": len(prompts)},
              {"ids": ids.ravel(), "scales": no_adapters(prepared, len(prompts))},
              {"context": ids.size * prepared.spec("TEXT_D")})["context"].reshape(len(prompts), 77, -1)
    for i in range(len(prompts)):
        close(got[i], ref.text_encoder(W, ids[i]))


def _temb_inputs(W, timesteps):
    u = W["unet"]
    t_emb = np.stack([ref.timestep_embedding(t, u["block_out_channels"][0], u["flip_sin_to_cos"], u["freq_shift"])
                      for t in timesteps]).astype(f32)
    temb = np.stack([ref.time_embedding(W["t"], "unet.time_embedding", e) for e in t_emb])
    return t_emb, temb


def test_resnet_blocks(prepared, W):
    """Every UNet resnet of the flat stack, at its own width, on two images at different timesteps."""
    t, u = W["t"], W["unet"]
    rng = np.random.default_rng(0)
    _, temb = _temb_inputs(W, [999, 41])
    silu_temb = ref.silu(temb)
    names = ([f"unet.down_blocks.{b}.resnets.{j}" for b in range(len(u["block_out_channels"]))
              for j in range(u["layers_per_block"])] + [f"unet.mid_block.resnets.{j}" for j in range(2)]
             + [f"unet.up_blocks.{b}.resnets.{j}" for b in range(len(u["block_out_channels"]))
                for j in range(u["layers_per_block"] + 1)])
    assert len(names) == prepared.spec("NR")
    for r, name in enumerate(names):
        cin, cout = t[f"{name}.conv1.weight"].shape[1], t[f"{name}.conv1.weight"].shape[0]
        h = w = 8
        x = rng.standard_normal((2, cin, h, w)).astype(f32)
        got = run(prepared, "resnet", {"r": r, "N": 2, "H": h, "W": w},
                  {"x": np.stack([channels_last(a) for a in x]).ravel(), "temb": silu_temb.ravel()},
                  {"y": 2 * h * w * cout, "t": 2 * h * w * max(cin, cout), "tb": 2 * cout})["y"].reshape(2, h, w, cout)
        for n in range(2):
            want = ref.resnet_block(x[n], t, name, u["norm_num_groups"], u["norm_eps"], temb[n])
            close(got[n], channels_last(want))


def transformer_name(p, a):
    """The diffusers name of flat transformer a: DR down, then the mid block's, then UR up."""
    dr, lpb, lpu = p.spec("DR"), p.spec("LPB"), p.spec("LPU")
    if a < dr:
        return f"unet.down_blocks.{a // lpb}.attentions.{a % lpb}"
    if a == dr:
        return "unet.mid_block.attentions.0"
    return f"unet.up_blocks.{(a - dr - 1) // lpu}.attentions.{(a - dr - 1) % lpu}"


def test_spatial_transformers(prepared, W):
    """Every Transformer2DModel, in place on two images, each attending to its own prompt."""
    t, u = W["t"], W["unet"]
    rng = np.random.default_rng(1)
    ids = np.array([ref.tokenize(W, "a red fox in the snow"), ref.tokenize(W, "ink sketch of a boat")])
    context = np.stack([ref.text_encoder(W, i) for i in ids])
    names = [transformer_name(prepared, a) for a in range(prepared.spec("NT"))]
    present = [a for a, name in enumerate(names) if f"{name}.norm.weight" in t]
    assert len(present) == sum(1 for k in t if k.startswith("unet.") and k.endswith(".proj_in.weight")) > 0
    for a in present:
        c = t[f"{names[a]}.proj_in.weight"].shape[0]
        h, w = 6, 5
        x = rng.standard_normal((2, c, h, w)).astype(f32)
        rows = 2 * h * w
        got = run(prepared, "transformer", {"a": a, "N": 2, "HW": h * w},
                  {"x": np.stack([channels_last(v) for v in x]).ravel(), "context": context.ravel(),
                   "kv_offs": np.array([0, 77, 154], np.int32), "scales": no_adapters(prepared, 2)},
                  {"u": rows * c, "n": rows * c, "qkv": rows * 3 * c, "kv": 154 * 2 * c, "o": rows * c,
                   "f": rows * 8 * c, "g": rows * 4 * c, "lu": 1, "offs": 3},
                  read={"x": rows * c})["x"].reshape(2, h, w, c)
        for n in range(2):
            want = ref.spatial_transformer(x[n], t, names[a], u["attention_head_dim"], context[n],
                                           u["norm_num_groups"])
            close(got[n], channels_last(want))


def test_vae_resnet_blocks(prepared, W):
    t, v = W["t"], W["vae"]
    rng = np.random.default_rng(2)
    names = ["vae.decoder.mid_block.resnets.0", "vae.decoder.mid_block.resnets.1"] + [
        f"vae.decoder.up_blocks.{b}.resnets.{j}" for b in range(len(v["up_block_types"]))
        for j in range(v["layers_per_block"] + 1)]
    assert len(names) == prepared.spec("NV")
    for r, name in enumerate(names):
        cin, cout = t[f"{name}.conv1.weight"].shape[1], t[f"{name}.conv1.weight"].shape[0]
        h, w = 5, 7
        x = rng.standard_normal((1, cin, h, w)).astype(f32)
        got = run(prepared, "vae_resnet", {"r": r, "N": 1, "H": h, "W": w}, {"x": channels_last(x[0]).ravel()},
                  {"y": h * w * cout, "t": h * w * max(cin, cout)})["y"].reshape(h, w, cout)
        close(got, channels_last(ref.resnet_block(x[0], t, name, v["norm_num_groups"], 1e-6)))


def test_unet_on_a_batch_at_different_timesteps_and_prompts(prepared, W):
    """Three latent images in one call, each with its own timestep and prompt, equal three reference calls."""
    rng = np.random.default_rng(3)
    h = w = 16
    latents = rng.standard_normal((3, 4, h, w)).astype(f32)
    timesteps = [999, 500, 1]
    prompts = ["a red fox in the snow", "", "a cat on a boat"]
    context = np.stack([ref.text_encoder(W, ref.tokenize(W, p)) for p in prompts])
    t_emb, _ = _temb_inputs(W, timesteps)
    got = run(prepared, "denoise", {"N": 3, "H": h, "W": w},
              {"latents": np.stack([channels_last(x) for x in latents]).ravel(), "t_emb": t_emb.ravel(),
               "context": context.ravel(), "kv_offs": (np.arange(4) * 77).astype(np.int32),
               "scales": no_adapters(prepared, 3)},
              {"eps": 3 * h * w * 4})["eps"].reshape(3, h, w, 4)
    for n in range(3):
        close(got[n], channels_last(ref.unet(W, latents[n], timesteps[n], context[n])), rel=1e-4)


def test_vae_decoder(prepared, W):
    rng = np.random.default_rng(4)
    h, w = 8, 6
    latents = rng.standard_normal((2, 4, h, w)).astype(f32)
    up = 2 ** (prepared.spec("VNB") - 1)
    got = run(prepared, "decode", {"N": 2, "H": h, "W": w},
              {"latents": np.stack([channels_last(x) for x in latents]).ravel()},
              {"image": 2 * h * w * up * up * 3})["image"].reshape(2, h * up, w * up, 3)
    for n in range(2):
        close(got[n], channels_last(ref.vae_decode(W, latents[n])), rel=1e-4)


# SD 1.5's own topology (four levels, two resnets a down block, three with cross-attention,
# the mid block, three resnets an up block), at small widths: the same package binds it.
SD15_TOPOLOGY = {"block_out_channels": [32, 32, 64, 64], "layers_per_block": 2, "sample_size": 16,
                 "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
                 "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3}


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sd15"))
    generate.generate(out, seed=5, unet=SD15_TOPOLOGY)
    dev = Device(drivers()[0].values[0])
    p = runtime.prepare("sd15", [SOURCE], out, {}, dev, compiler_for(dev))
    yield p, ref.load(out)
    p.release()


def test_sd15_topology_binds_and_denoises_as_the_reference(sd15):
    p, W = sd15
    assert (p.spec("NB"), p.spec("LPB"), p.spec("NR"), p.spec("NT")) == (4, 2, 22, 21)
    present = [a for a in range(p.spec("NT")) if p.binding.params.get(("tf_norm_w", a))]
    assert len(present) == 3 * 2 + 1 + 3 * 3
    rng = np.random.default_rng(6)
    h = w = 16
    latents = rng.standard_normal((2, 4, h, w)).astype(f32)
    timesteps = [981, 20]
    context = np.stack([ref.text_encoder(W, ref.tokenize(W, p_)) for p_ in ("a castle", "")])
    t_emb, _ = _temb_inputs(W, timesteps)
    got = run(p, "denoise", {"N": 2, "H": h, "W": w},
              {"latents": np.stack([channels_last(x) for x in latents]).ravel(), "t_emb": t_emb.ravel(),
               "context": context.ravel(), "kv_offs": np.array([0, 77, 154], np.int32),
               "scales": np.zeros(2, f32)},
              {"eps": 2 * h * w * 4})["eps"].reshape(2, h, w, 4)
    for n in range(2):
        close(got[n], channels_last(ref.unet(W, latents[n], timesteps[n], context[n])), rel=1e-4)
