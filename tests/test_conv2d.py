"""opencl/conv2d.cl and opencl/group_norm.cl against float64 numpy references.

Built and run as tests/test_kernels.py does (its Env: common.cl prepended, -D macros),
on every usable driver (conftest.drivers). The references are written out
here, channels last, with the taps as explicit loops; one test checks them against
tests/sd_numpy.py (channels first, what the SD package is measured against), and one
runs a whole ResnetBlock2D and an Upsample2D from the library kernels.
"""

import numpy as np
import pytest

from conftest import drivers
from test_kernels import shared_env, assert_close, conv_in_view, conv_in_view_ref, make_weights, rng, i32, f32

cl = pytest.importorskip("pyopencl")


@pytest.fixture(scope="module", params=drivers())
def env(request):
    return shared_env(request.param)


def silu(x):
    return x / (1.0 + np.exp(-x))


# ---------------------------------------------------------------- references (float64, channels last)

def conv2d_ref(x, w, b=None, stride=1, pad=0, up=False, in_silu=False):
    """x [N, H, W, C], w [O, C, KH, KW] (PyTorch) -> [N, OH, OW, O]; zero padding of the
    (SiLU'd, nearest-2x-upsampled) input on both axes; b [O] or per image [N, O]."""
    x = np.asarray(x, np.float64)
    if in_silu:
        x = silu(x)
    if up:
        x = x.repeat(2, axis=1).repeat(2, axis=2)
    n, h, wd, _ = x.shape
    o, _, kh, kw = w.shape
    oh, ow = (h + 2 * pad - kh) // stride + 1, (wd + 2 * pad - kw) // stride + 1
    xp = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    y = np.zeros((n, oh, ow, o))
    for i in range(kh):
        for j in range(kw):
            tap = xp[:, i:i + stride * (oh - 1) + 1:stride, j:j + stride * (ow - 1) + 1:stride]
            y += tap @ np.asarray(w[:, :, i, j], np.float64).T
    if b is not None:
        b = np.asarray(b, np.float64)
        y += b if b.ndim == 1 else b[:, None, None, :]
    return y


def group_norm_ref(x, gamma, beta, groups, eps, out_silu=False):
    """torch.nn.GroupNorm over x [N, HW, C] (channels last), biased variance."""
    x = np.asarray(x, np.float64)
    n, hw, c = x.shape
    g = x.reshape(n, hw, groups, c // groups)
    mu = g.mean(axis=(1, 3), keepdims=True)
    var = ((g - mu) ** 2).mean(axis=(1, 3), keepdims=True)
    y = ((g - mu) / np.sqrt(var + eps)).reshape(n, hw, c) * gamma + beta
    return silu(y) if out_silu else y


def test_references_match_sd_numpy():
    """The references above against sd_numpy's conv2d, Downsample2D, Upsample2D and
    group_norm (channels first, [O, C, k, k] weights as diffusers stores them)."""
    import sd_numpy as sd
    r = rng(900)
    x = r.standard_normal((6, 7, 5)).astype(np.float32)            # [C, H, W]
    w = r.standard_normal((4, 6, 3, 3)).astype(np.float32)
    b = r.standard_normal(4).astype(np.float32)
    t = {"c.weight": w, "c.bias": b, "c.conv.weight": w, "c.conv.bias": b}
    xl = x.transpose(1, 2, 0)[None]                                  # [1, H, W, C]
    assert_close(conv2d_ref(xl, w, b, pad=1)[0], sd.conv2d(x, t, "c").transpose(1, 2, 0), 1e-5)
    assert_close(conv2d_ref(xl, w, b, stride=2, pad=1)[0], sd.downsample(x, t, "c").transpose(1, 2, 0), 1e-5)
    assert_close(conv2d_ref(xl, w, b, pad=1, up=True)[0], sd.upsample(x, t, "c").transpose(1, 2, 0), 1e-5)
    w1 = r.standard_normal((4, 6, 1, 1)).astype(np.float32)
    assert_close(conv2d_ref(xl, w1, b)[0], sd.conv2d(x, {"c.weight": w1, "c.bias": b}, "c").transpose(1, 2, 0), 1e-5)
    gamma, beta = r.standard_normal(6).astype(np.float32), r.standard_normal(6).astype(np.float32)
    want = sd.group_norm(x, {"n.weight": gamma, "n.bias": beta}, "n", 3, 1e-6)
    assert_close(group_norm_ref(x.reshape(6, -1).T[None], gamma, beta, 3, 1e-6)[0], want.reshape(6, -1).T, 1e-5)


# ---------------------------------------------------------------- conv2d

def run_conv2d(env, prg, x, wdev, b, r, y0, o, ot, g1, views, n, ih, iw, oh, ow):
    """One launch; x [N*IH*IW, C], r / y0 [N*OH*OW, O] placed in their views; -> Y's view [P, ldy]."""
    ldx, x_off, ldy, y_off, ldr, r_off = views
    xb = conv_in_view(env, x, ldx, x_off)
    yb = conv_in_view(env, y0, ldy, y_off)
    rb = conv_in_view(env, r, ldr, r_off) if r is not None else None
    env.run(prg.conv2d, (-(-o // ot), g1), (1, 1), xb, i32(x_off), i32(ldx), env.buf(wdev),
            env.buf(b) if b is not None else None, rb, i32(r_off), i32(ldr),
            yb, i32(y_off), i32(ldy), i32(n), i32(ih), i32(iw))
    p = n * oh * ow
    return env.read(yb, y_off + max(p, 1) * ldy)[y_off:y_off + p * ldy].reshape(p, ldy)


# (C, O, KH, KW, STRIDE, PAD, N, IH, IW, macros, views (ldx, x_off, ldy, y_off, ldr, r_off) or None)
CONV2D = {
    # the illustrator's shapes (3x3 pad 1, 32/64 channels), odd sizes, two images
    "k3_c32_odd": (32, 32, 3, 3, 1, 1, 2, 9, 11, dict(HAS_BIAS=True), None),
    "k3_c64_tile8x4": (64, 64, 3, 3, 1, 1, 2, 6, 7, dict(HAS_BIAS=True, OUTS_PER_ITEM=8, POS_PER_ITEM=4), None),
    "downsample_s2": (32, 32, 3, 3, 2, 1, 2, 9, 10, dict(HAS_BIAS=True, POS_PER_ITEM=3), None),
    "downsample_s2_even": (16, 16, 3, 3, 2, 1, 3, 8, 8, dict(HAS_BIAS=True, OUTS_PER_ITEM=8), None),
    "k1_shortcut": (64, 32, 1, 1, 1, 0, 2, 5, 7, dict(HAS_BIAS=True, OUTS_PER_ITEM=8, POS_PER_ITEM=4), None),
    "k1_proj_f16_nobias": (32, 48, 1, 1, 1, 0, 1, 3, 9, dict(WEIGHT_F16=True), None),
    # VW fallbacks and tail outputs
    "c24_vw8_o13": (24, 13, 3, 3, 1, 1, 2, 5, 7, dict(HAS_BIAS=True, POS_PER_ITEM=3), None),
    "c12_vw4_o6_f16": (12, 6, 3, 3, 1, 1, 1, 4, 5, dict(HAS_BIAS=True, WEIGHT_F16=True, OUTS_PER_ITEM=4), None),
    "c5_vw1": (5, 7, 3, 3, 1, 1, 2, 3, 4, dict(HAS_BIAS=True, OUTS_PER_ITEM=3, POS_PER_ITEM=2), None),
    "conv_in_c4": (4, 32, 3, 3, 1, 1, 2, 8, 8, dict(HAS_BIAS=True, OUTS_PER_ITEM=8), None),
    "conv_out_o3": (16, 3, 3, 3, 1, 1, 1, 6, 5, dict(HAS_BIAS=True, OUTS_PER_ITEM=4, POS_PER_ITEM=4), None),
    # fused input SiLU (every VW), nearest 2x upsampling
    "silu_vw16": (32, 16, 3, 3, 1, 1, 2, 5, 6, dict(HAS_BIAS=True, IN_SILU=True), None),
    "silu_vw8_s2": (24, 8, 3, 3, 2, 1, 1, 7, 7, dict(IN_SILU=True), None),
    "silu_vw4": (12, 5, 3, 3, 1, 1, 1, 4, 4, dict(HAS_BIAS=True, IN_SILU=True, OUTS_PER_ITEM=2), None),
    "silu_vw1": (3, 4, 3, 3, 1, 1, 1, 4, 3, dict(IN_SILU=True, VW=1), None),
    "upsample2": (32, 16, 3, 3, 1, 1, 2, 4, 5, dict(HAS_BIAS=True, UPSAMPLE2=True, POS_PER_ITEM=3), None),
    "upsample2_f16_silu": (16, 16, 3, 3, 1, 1, 1, 3, 3, dict(HAS_BIAS=True, UPSAMPLE2=True, WEIGHT_F16=True,
                                                              IN_SILU=True, OUTS_PER_ITEM=8), None),
    # epilogues: accumulate, residual (views), per-image bias, channel blocks
    "accumulate": (32, 20, 3, 3, 1, 1, 2, 5, 5, dict(HAS_BIAS=True, ACCUMULATE=True), None),
    "residual_views": (16, 24, 3, 3, 1, 1, 2, 5, 6, dict(HAS_BIAS=True, RESIDUAL=True),
                       (20, 3, 40, 8, 30, 5)),
    "residual_accumulate_bias_per_image": (32, 32, 3, 3, 1, 1, 3, 4, 5, dict(BIAS_PER_IMAGE=True, RESIDUAL=True,
                                                                              ACCUMULATE=True), None),
    "c_block_residual": (64, 12, 3, 3, 1, 1, 2, 5, 4, dict(HAS_BIAS=True, RESIDUAL=True, C_BLOCK=16,
                                                            OUTS_PER_ITEM=8), None),
    "c_block_vw8_accumulate_up": (48, 8, 3, 3, 1, 1, 1, 3, 4, dict(ACCUMULATE=True, C_BLOCK=24, UPSAMPLE2=True,
                                                                    IN_SILU=True), None),
    # other geometry: non-square kernel, wide pad, images smaller than the kernel
    "k5x3_pad2": (16, 8, 5, 3, 1, 2, 2, 6, 5, dict(HAS_BIAS=True), None),
    "one_pixel": (16, 8, 3, 3, 1, 1, 3, 1, 1, dict(HAS_BIAS=True, POS_PER_ITEM=4), None),
    "one_pixel_s2": (16, 8, 3, 3, 2, 1, 2, 2, 1, dict(HAS_BIAS=True), None),
}


def every_driver(cases, chosen):
    """Case names as params, `chosen` (one a weight type) marked to run on every driver."""
    return [pytest.param(case, marks=pytest.mark.every_driver if case in chosen else ()) for case in cases]


@pytest.mark.parametrize("case", every_driver(CONV2D, ("k3_c32_odd", "k1_proj_f16_nobias")))
def test_conv2d(env, case):
    """conv2d against the float64 loop: 3x3 pad 1 / stride 2 / 1x1, odd sizes and tails (pixels
    of a row, outputs), several images, VW 16/8/4/1, F16 weights, bias (none, [O], [N, O]),
    accumulate, residual, fused SiLU and 2x upsampling, channel blocks, views; G1 1, 3 and 64
    give identical bits."""
    c, o, kh, kw, stride, pad, n, ih, iw, macros, views = CONV2D[case]
    r = rng(800 + len(case) * 7 + c)
    up = bool(macros.get("UPSAMPLE2"))
    sh, sw = (2 * ih, 2 * iw) if up else (ih, iw)
    oh, ow = (sh + 2 * pad - kh) // stride + 1, (sw + 2 * pad - kw) // stride + 1
    x = (r.standard_normal((n, ih, iw, c)) * 2).astype(np.float32)
    w = (r.standard_normal((o, c, kh, kw)) / np.sqrt(c * kh * kw)).astype(np.float32)
    per_image = macros.get("BIAS_PER_IMAGE")
    b = r.standard_normal((n, o) if per_image else o).astype(np.float32)
    has_bias = macros.get("HAS_BIAS") or per_image
    res = r.standard_normal((n * oh * ow, o)).astype(np.float32) if macros.get("RESIDUAL") else None
    y0 = r.standard_normal((n * oh * ow, o)).astype(np.float32)
    wdev, w64 = make_weights("F16" if macros.get("WEIGHT_F16") else "F32", w.reshape(o, -1))
    want = conv2d_ref(x, w64.reshape(w.shape), b if has_bias else None, stride, pad, up,
                      macros.get("IN_SILU")).reshape(-1, o)
    if res is not None:
        want = want + res
    if macros.get("ACCUMULATE"):
        want = want + y0
    views = views or (c, 0, o, 0, o, 0)
    ldy = views[2]
    prg = env.build("conv2d", C=c, O=o, KH=kh, KW=kw, STRIDE=stride, PAD=pad, **macros)
    ot = macros.get("OUTS_PER_ITEM", 8)
    results = []
    for g1 in (1, 3, 64):
        got = run_conv2d(env, prg, x.reshape(-1, c), wdev, b if has_bias else None, res, y0, o, ot, g1, views,
                         n, ih, iw, oh, ow)
        assert_close(got[:, :o], want, 1e-5)
        if ldy > o:     # untouched outside the view
            np.testing.assert_array_equal(got[:, o:], conv_in_view_ref(y0, ldy, views[3])[:, o:])
        results.append(got[:, :o])
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


def test_conv2d_tiles_and_channel_blocks_agree(env):
    """Different OUTS_PER_ITEM x POS_PER_ITEM tiles give identical bits (each output sums its
    taps in the same order); C_BLOCK only changes rounding."""
    c, o, n, ih, iw = 32, 16, 2, 5, 7
    r = rng(870)
    x = r.standard_normal((n * ih * iw, c)).astype(np.float32)
    w = (r.standard_normal((o, c, 3, 3)) / 17).astype(np.float32)
    b = r.standard_normal(o).astype(np.float32)
    y0 = np.zeros((n * ih * iw, o), np.float32)
    views = (c, 0, o, 0, o, 0)
    outs = {}
    for ot, pt, cb in [(4, 2, 32), (8, 4, 32), (1, 1, 32), (3, 5, 32), (4, 2, 16)]:
        prg = env.build("conv2d", C=c, O=o, KH=3, KW=3, PAD=1, HAS_BIAS=True, OUTS_PER_ITEM=ot, POS_PER_ITEM=pt,
                        C_BLOCK=cb)
        outs[(ot, pt, cb)] = run_conv2d(env, prg, x, w, b, None, y0, o, ot, 2, views, n, ih, iw, ih, iw)
    for key in [(8, 4, 32), (1, 1, 32), (3, 5, 32)]:
        np.testing.assert_array_equal(outs[key], outs[(4, 2, 32)])
    assert_close(outs[(4, 2, 16)], conv2d_ref(x.reshape(n, ih, iw, c), w, b, pad=1).reshape(-1, o), 1e-5)


def test_conv2d_residual_in_place(env):
    """Y may be R: y = conv(x) + b + y, the skip added where it lies."""
    c, o, n, ih, iw = 16, 16, 2, 4, 6
    r = rng(880)
    x = r.standard_normal((n * ih * iw, c)).astype(np.float32)
    w = (r.standard_normal((o, c, 3, 3)) / 12).astype(np.float32)
    b = r.standard_normal(o).astype(np.float32)
    skip = r.standard_normal((n * ih * iw, o)).astype(np.float32)
    prg = env.build("conv2d", C=c, O=o, KH=3, KW=3, PAD=1, HAS_BIAS=True, RESIDUAL=True)
    yb = env.buf(skip)
    env.run(prg.conv2d, (o // 8, 3), (1, 1), env.buf(x), i32(0), i32(c), env.buf(w), env.buf(b),
            yb, i32(0), i32(o), yb, i32(0), i32(o), i32(n), i32(ih), i32(iw))
    want = conv2d_ref(x.reshape(n, ih, iw, c), w, b, pad=1).reshape(-1, o) + skip
    assert_close(env.read(yb, (n * ih * iw, o)), want, 1e-5)


def test_conv2d_build_errors(env):
    """Each required macro missing is a build error naming it; so are impossible choices."""
    full = dict(C=8, O=4, KH=3, KW=3)
    for name in full:
        with pytest.raises(cl.RuntimeError) as e:
            env.build("conv2d", **{k: v for k, v in full.items() if k != name})
        assert f"define {name}" in str(e.value)
    for bad in (dict(VW=16), dict(C_BLOCK=3), dict(STRIDE=0), dict(HAS_BIAS=True, BIAS_PER_IMAGE=True),
                dict(WEIGHT_F16=True, WEIGHT_F32=True)):
        with pytest.raises(cl.RuntimeError):
            env.build("conv2d", **full, **bad)


# ---------------------------------------------------------------- group_norm

# (C, G, N, HW, eps, macros, in place, mean offset)
GROUP_NORM = {
    "g1": (32, 1, 2, 37, 1e-5, dict(), False, 0.0),
    "g8_illustrator_silu_in_place": (32, 8, 2, 100, 1e-5, dict(OUT_SILU=True), True, 0.0),
    "g8_cg8_wg3": (64, 8, 1, 300, 1e-6, dict(WG=3), True, 0.0),
    "g32_sd_cg10_silu": (320, 32, 2, 45, 1e-5, dict(OUT_SILU=True), False, 0.0),
    "g32_cg16_wg4_silu_in_place": (512, 32, 1, 130, 1e-6, dict(OUT_SILU=True, WG=4), True, 0.0),
    "g32_cg2_large_mean": (64, 32, 3, 200, 1e-6, dict(), False, 20.0),
    "g8_cg4_one_pixel": (32, 8, 2, 1, 1e-6, dict(OUT_SILU=True), True, 0.0),
    # several groups a work-group (slabs of 8-20 channels)
    "g8_vae_cg2_slab16_silu_in_place": (16, 8, 1, 150, 1e-6, dict(OUT_SILU=True, GROUPS_PER_ITEM=8), True, 0.0),
    "g8_cg4_slab16_wg2": (32, 8, 2, 140, 1e-5, dict(GROUPS_PER_ITEM=4, WG=2), False, 3.0),
    "g32_cg10_slab20_silu": (320, 32, 1, 70, 1e-5, dict(OUT_SILU=True, GROUPS_PER_ITEM=2), True, 0.0),
    "g1_slab5": (5, 1, 2, 33, 1e-5, dict(GROUPS_PER_ITEM=1), False, 0.0),
}


@pytest.mark.parametrize("case", every_driver(GROUP_NORM, ("g8_illustrator_silu_in_place", "g32_sd_cg10_silu")))
def test_group_norm(env, case):
    """group_norm against GroupNorm in float64: 1, 8 and 32 groups (4-16 channels a group, and
    SD's 10), OUT_SILU, in place, several lanes, several groups a work-group, a large mean
    (two-pass variance), one pixel."""
    c, groups, n, hw, eps, macros, in_place, offset = GROUP_NORM[case]
    r = rng(950 + c + groups + hw)
    x = (r.standard_normal((n, hw, c)) * 3 + offset + r.standard_normal(c) * 2).astype(np.float32)
    gamma = (1 + r.standard_normal(c) * 0.3).astype(np.float32)
    beta = r.standard_normal(c).astype(np.float32)
    want = group_norm_ref(x, gamma, beta, groups, eps, macros.get("OUT_SILU"))
    prg = env.build("group_norm", C=c, G=groups, **macros)
    wg, gpi = macros.get("WG", 1), macros.get("GROUPS_PER_ITEM", 1)
    xb = env.buf(x)
    yb = xb if in_place else env.empty(x.nbytes)
    env.run(prg.group_norm, (wg, groups // gpi, n), (wg, 1, 1), xb, env.buf(gamma), env.buf(beta), yb,
            i32(n), i32(hw), f32(eps))
    assert_close(env.read(yb, x.shape), want, 2e-6 if hw > 1 else 1e-5)


def test_group_norm_build_errors(env):
    for macros, name in [(dict(G=8), "C"), (dict(C=32), "G")]:
        with pytest.raises(cl.RuntimeError) as e:
            env.build("group_norm", **macros)
        assert f"define {name}" in str(e.value)
    for bad in (dict(C=30, G=8), dict(C=32, G=8, GROUPS_PER_ITEM=3)):
        with pytest.raises(cl.RuntimeError):
            env.build("group_norm", **bad)


# ---------------------------------------------------------------- SD blocks from the kernels

def test_resnet_block_and_upsampler_from_library_kernels(env):
    """A ResnetBlock2D with a conv_shortcut (32 -> 64 channels, time embedding) and an
    Upsample2D as the SD package would launch them, against tests/sd_numpy.py:
    group_norm OUT_SILU, conv1 with BIAS_PER_IMAGE (conv1 bias + time_emb_proj of each
    image's timestep), group_norm OUT_SILU, the 1x1 shortcut, conv2 with RESIDUAL onto it,
    then conv2d UPSAMPLE2. Two images with different time embeddings in one launch each."""
    import sd_numpy as sd
    c, o, n, h, wd, groups, eps, temb_dim = 32, 64, 2, 6, 5, 8, 1e-5, 16
    r = rng(990)
    t = {}
    for name, shape in [("norm1.weight", (c,)), ("norm1.bias", (c,)), ("conv1.weight", (o, c, 3, 3)),
                        ("conv1.bias", (o,)), ("time_emb_proj.weight", (o, temb_dim)), ("time_emb_proj.bias", (o,)),
                        ("norm2.weight", (o,)), ("norm2.bias", (o,)), ("conv2.weight", (o, o, 3, 3)),
                        ("conv2.bias", (o,)), ("conv_shortcut.weight", (o, c, 1, 1)), ("conv_shortcut.bias", (o,)),
                        ("up.conv.weight", (o, o, 3, 3)), ("up.conv.bias", (o,))]:
        scale = 1 / np.sqrt(np.prod(shape[1:])) if len(shape) > 1 else 0.5
        t["rb." + name] = (r.standard_normal(shape) * scale + (1 if name.startswith("norm") and "weight" in name
                                                                else 0)).astype(np.float32)
    x = r.standard_normal((n, c, h, wd)).astype(np.float32)
    temb = r.standard_normal((n, temb_dim)).astype(np.float32)
    want = [sd.upsample(sd.resnet_block(x[i], t, "rb", groups, eps, temb[i]), t, "rb.up") for i in range(n)]
    want = np.stack(want).transpose(0, 2, 3, 1).reshape(-1, o)

    p = n * h * wd
    conv = {}

    def run(name, src, cin, k, dst, bias, res=None, up=False, **macros):
        key = (cin, k, up, tuple(sorted(macros)))
        if key not in conv:
            conv[key] = env.build("conv2d", C=cin, O=o, KH=k, KW=k, PAD=k // 2, UPSAMPLE2=up, **macros)
        w = t[f"rb.{name}.weight"]
        env.run(conv[key].conv2d, (o // 8, 2), (1, 1), src, i32(0), i32(cin), env.buf(w), env.buf(bias),
                res, i32(0), i32(o), dst, i32(0), i32(o), i32(n), i32(h), i32(wd))

    def norm(name, ch, src, dst):
        prg = env.build("group_norm", C=ch, G=groups, OUT_SILU=True)
        env.run(prg.group_norm, (1, groups, n), (1, 1, 1), src, env.buf(t[f"rb.{name}.weight"]),
                env.buf(t[f"rb.{name}.bias"]), dst, i32(n), i32(h * wd), f32(eps))

    xb = env.buf(x.transpose(0, 2, 3, 1).reshape(p, c))
    hn, h1, sc = env.empty(p * c * 4), env.empty(p * o * 4), env.empty(p * o * 4)
    norm("norm1", c, xb, hn)
    temb_proj = silu(temb.astype(np.float64)) @ t["rb.time_emb_proj.weight"].T.astype(np.float64) \
        + t["rb.time_emb_proj.bias"]
    run("conv1", hn, c, 3, h1, (t["rb.conv1.bias"] + temb_proj).astype(np.float32), BIAS_PER_IMAGE=True)
    norm("norm2", o, h1, h1)
    run("conv_shortcut", xb, c, 1, sc, t["rb.conv_shortcut.bias"], HAS_BIAS=True)
    run("conv2", h1, o, 3, sc, t["rb.conv2.bias"], res=sc, HAS_BIAS=True, RESIDUAL=True)
    out = env.empty(4 * p * o * 4)
    run("up.conv", sc, o, 3, out, t["rb.up.conv.bias"], up=True, HAS_BIAS=True)
    assert_close(env.read(out, (4 * p, o)), want, 1e-5)
