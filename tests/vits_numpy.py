"""Piper VITS inference in plain numpy (float32 math): the reference Loom's speech kernels are checked against.

Written from the published architecture (VITS, Kim et al. 2021: jaywalnut310/vits models.py,
attentions.py, modules.py, transforms.py, commons.py; Piper's vits/models.py SynthesizerTrn.infer
is the same code), with every detail confirmed against what the exported ONNX graph of a Piper
voice computes (the graph is the ground truth). Weights and hyperparameters come from that
.onnx file, read with the `onnx` package (a file reader; no onnxruntime here).

Shapes are unbatched, channels first: a signal is [C, T] float32, a mask is [1, T] float32 of
0/1. Module names follow the PyTorch ones (the ONNX initializer names):

    enc_p   TextEncoder        emb (stored as the initializer "sid"), 6 x (relative-position MHA,
                               LayerNorm, conv FFN, LayerNorm), proj -> m_p, logs_p
    dp      StochasticDurationPredictor, run in reverse: pre, DDSConv, proj -> conditioning h;
                               noise [2, T_x] * noise_w -> Flip, ConvFlow(7), Flip, ConvFlow(5),
                               Flip, ConvFlow(3), Flip, ElementwiseAffine(0) -> logw = z[0]
                               (flows.1, a ConvFlow, is the "useless vflow" infer() drops)
    flow    ResidualCouplingBlock in reverse: Flip, coupling(6), Flip, coupling(4), ... coupling(0);
                               each coupling: pre, WaveNet WN (gated tanh*sigmoid), post (mean only)
    dec     HiFi-GAN Generator: conv_pre, 3 x (leaky_relu 0.1, ConvTranspose1d, mean of 3
                               ResBlocks), leaky_relu 0.01, conv_post (no bias), tanh

What the export changed, and how load() undoes it:
  * weight norm is folded: every conv has a plain weight;
  * the 32 WN convs of `flow` lost their names (anonymous "onnx::Conv_NNNN" initializers): each
    is named after the Conv node that consumes it, e.g. "/flow/flows.6/enc/in_layers.0/Conv"
    -> "flow.flows.6.enc.in_layers.0.weight";
  * enc_p.emb.weight is stored under the name "sid" (an exporter naming collision; it is the
    [n_vocab, hidden] table the first Gather reads with the phoneme ids);
  * dp.flows.0.logs is folded into the constant exp(-logs) ("/dp/flows.0/Exp_output_0");
    load() stores logs = -log(that).
  * The graph draws its own noise (RandomNormalLike); here the noise arrays are arguments, so a
    caller (Loom, with its counter-based generator, or a test replaying onnxruntime's draws)
    supplies them.

    W = load(onnx_path)                          # name -> float32 array, W["hp"] hyperparameters
    x, m_p, logs_p, x_mask = text_encoder(W, ids, length)
    logw = duration_predictor(W, x, x_mask, noise_dp, noise_w)
    w_ceil = np.ceil(np.exp(logw) * x_mask * length_scale)
    m, logs, y_mask = expand(m_p, logs_p, w_ceil)
    z = flow_reverse(W, m + noise_z * np.exp(logs) * noise_scale, y_mask)
    audio = decoder(W, z * y_mask)               # [T_y * hop] float32 in [-1, 1]
    audio = synthesize(W, ids, 0.667, 1.0, 0.8)  # all of the above
"""
from __future__ import annotations

import json
import math
import os
import re

import numpy as np

f32 = np.float32
LRELU_SLOPE = 0.1                  # HiFi-GAN's leaky ReLU (the last one, before conv_post, is 0.01)
LN_EPS = 1e-5                      # LayerNorm over channels (attentions.LayerNorm, modules.LayerNorm)
MASK_FILL = -1e4                   # masked attention scores (masked_fill(mask == 0, -1e4))
MIN_BIN_WIDTH = MIN_BIN_HEIGHT = MIN_DERIVATIVE = 1e-3   # transforms.py DEFAULT_MIN_*
SEARCH_EPS = 1e-6                  # transforms.searchsorted


# --- Weights and hyperparameters ------------------------------------------------

def _module(node_name):
    """"/flow/flows.6/enc/in_layers.0/Conv" -> "flow.flows.6.enc.in_layers.0"."""
    return node_name.strip("/").rsplit("/", 1)[0].replace("/", ".")


def load(onnx_path, config_path=None):
    """Read a Piper voice: {name: float32 array} for every weight, plus W["hp"] (hyperparameters).

    Hyperparameters are inferred from weight shapes and the graph's Conv attributes (dilations,
    strides); W["hp"]["renamed"] maps each anonymous initializer to the name given it here.
    """
    import onnx
    from onnx import numpy_helper

    model = onnx.load(onnx_path)
    g = model.graph
    raw = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    consts = dict(raw)
    for n in g.node:
        if n.op_type == "Constant":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)

    W, renamed, conv = {}, {}, {}
    for n in g.node:
        if n.op_type in ("Conv", "ConvTranspose"):
            mod = _module(n.name)
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            conv[mod] = {"dilation": attrs.get("dilations", [1])[0], "stride": attrs.get("strides", [1])[0],
                         "pad": attrs.get("pads", [0, 0])[0], "group": attrs.get("group", 1)}
            wname = n.input[1]
            if not wname.startswith(mod + "."):          # anonymous (weight norm folded by the exporter)
                renamed[wname] = mod + ".weight"
    for name, a in raw.items():
        if a.dtype != np.float32 or a.ndim == 0:
            continue
        if name == "sid" and a.ndim == 2:
            name = renamed["sid"] = "enc_p.emb.weight"
        W[renamed.get(name, name)] = a.astype(f32)
    if "/dp/flows.0/Exp_output_0" in consts:             # folded exp(-logs) of the ElementwiseAffine
        W["dp.flows.0.logs"] = (-np.log(consts["/dp/flows.0/Exp_output_0"].astype(np.float64))).astype(f32)
        renamed["/dp/flows.0/Exp_output_0"] = "dp.flows.0.logs (stored as exp(-logs))"

    def indices(pattern):
        return sorted({int(m.group(1)) for k in W for m in [re.match(pattern, k)] if m})

    hidden = W["enc_p.emb.weight"].shape[1]
    rel = W["enc_p.encoder.attn_layers.0.emb_rel_k"]                    # [heads_rel, 2w+1, k_channels]
    dec_ups = indices(r"dec\.ups\.(\d+)\.weight")
    resblocks = indices(r"dec\.resblocks\.(\d+)\.")
    n_kernels = len(resblocks) // len(dec_ups)
    rb_type = "1" if any(k.startswith("dec.resblocks.0.convs1.") for k in W) else "2"
    if rb_type == "2":
        rb_dil = [[conv[f"dec.resblocks.{j}.convs.{c}"]["dilation"] for c in indices(rf"dec\.resblocks\.{j}\.convs\.(\d+)\.")]
                  for j in range(n_kernels)]
    else:
        rb_dil = [[conv[f"dec.resblocks.{j}.convs1.{c}"]["dilation"] for c in indices(rf"dec\.resblocks\.{j}\.convs1\.(\d+)\.")]
                  for j in range(n_kernels)]
    dp_flows = indices(r"dp\.flows\.(\d+)\.pre\.weight")
    tail = [consts[n.input[1]] for n in g.node if n.op_type == "LessOrEqual" and n.name.startswith("/dp/flows.")
            and n.input[1] in consts]
    hp = {
        "n_vocab": W["enc_p.emb.weight"].shape[0],
        "hidden_channels": hidden,
        "inter_channels": W["enc_p.proj.weight"].shape[0] // 2,
        "filter_channels": W["enc_p.encoder.ffn_layers.0.conv_1.weight"].shape[0],
        "n_layers": len(indices(r"enc_p\.encoder\.attn_layers\.(\d+)\.")),
        "n_heads": hidden // rel.shape[2],
        "window_size": (rel.shape[1] - 1) // 2,
        "ffn_kernel_size": W["enc_p.encoder.ffn_layers.0.conv_1.weight"].shape[2],
        "dp_filter_channels": W["dp.pre.weight"].shape[0],
        "dp_kernel_size": W["dp.convs.convs_sep.0.weight"].shape[2],
        "dds_layers": len(indices(r"dp\.convs\.convs_sep\.(\d+)\.weight")),
        "dds_dilations": [conv[f"dp.convs.convs_sep.{i}"]["dilation"]
                          for i in indices(r"dp\.convs\.convs_sep\.(\d+)\.weight")],
        "dp_conv_flows": dp_flows,                       # ConvFlows infer() runs (flows.1 is dropped)
        "num_bins": (W[f"dp.flows.{dp_flows[0]}.proj.weight"].shape[0] + 1) // 3,
        "tail_bound": float(tail[0]) if tail else 5.0,
        "flow_couplings": indices(r"flow\.flows\.(\d+)\.pre\.weight"),
        "wn_layers": len(indices(r"flow\.flows\.0\.enc\.in_layers\.(\d+)\.")),
        "wn_kernel_size": W["flow.flows.0.enc.in_layers.0.weight"].shape[2],
        "wn_dilations": [conv[f"flow.flows.0.enc.in_layers.{i}"]["dilation"]
                         for i in indices(r"flow\.flows\.0\.enc\.in_layers\.(\d+)\.")],
        "mean_only": W["flow.flows.0.post.weight"].shape[0] == W["flow.flows.0.pre.weight"].shape[1],
        "upsample_initial_channel": W["dec.conv_pre.weight"].shape[0],
        "upsample_rates": [conv[f"dec.ups.{i}"]["stride"] for i in dec_ups],
        "upsample_kernel_sizes": [W[f"dec.ups.{i}.weight"].shape[2] for i in dec_ups],
        "resblock": rb_type,
        "resblock_kernel_sizes": [W[f"dec.resblocks.{j}.{'convs' if rb_type == '2' else 'convs1'}.0.weight"].shape[2]
                                  for j in range(n_kernels)],
        "resblock_dilation_sizes": rb_dil,
        "conv_pre_kernel": W["dec.conv_pre.weight"].shape[2],
        "conv_post_kernel": W["dec.conv_post.weight"].shape[2],
        "n_speakers": 1 if not any(i.name == "sid" for i in g.input) else W["emb_g.weight"].shape[0],
        "opset": max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
        "n_params": int(sum(a.size for a in raw.values() if a.dtype == np.float32 and a.ndim >= 1)),
        "renamed": renamed,
        "conv": conv,
    }
    hp["hop_length"] = int(np.prod(hp["upsample_rates"]))
    config_path = config_path or onnx_path + ".json"
    if os.path.exists(config_path):
        cfg = json.load(open(config_path))
        hp["sample_rate"] = cfg["audio"]["sample_rate"]
        hp["inference"] = cfg.get("inference", {})
    W["hp"] = hp
    return W


# --- Primitives ---------------------------------------------------------------

def conv1d(x, w, b=None, dilation=1, padding=None, groups=1):
    """x [Cin, T], w [Cout, Cin/groups, K] -> [Cout, T + 2*padding - dilation*(K-1)].

    Zero padding, "same" ((K-1)*dilation/2 each side) unless told; groups is 1 or depthwise.
    """
    cout, cin_g, K = w.shape
    if padding is None:
        padding = (K - 1) * dilation // 2
    xp = np.pad(x, ((0, 0), (padding, padding))) if padding else x
    T = xp.shape[1] - dilation * (K - 1)
    taps = [xp[:, k * dilation:k * dilation + T] for k in range(K)]
    if groups == 1:
        cols = np.concatenate(taps, axis=0) if K > 1 else taps[0]        # [K*Cin, T]
        y = w.transpose(0, 2, 1).reshape(cout, K * cin_g) @ cols
    else:
        assert groups == cout == x.shape[0] and cin_g == 1, "only depthwise grouping is used"
        y = sum(w[:, 0, k, None] * taps[k] for k in range(K))
    if b is not None:
        y = y + b[:, None]
    return y.astype(f32, copy=False)


def conv_transpose1d(x, w, b, stride, padding):
    """x [Cin, T], w [Cin, Cout, K] -> [Cout, (T-1)*stride - 2*padding + K] (PyTorch ConvTranspose1d)."""
    cin, cout, K = w.shape
    T = x.shape[1]
    cols = (w.reshape(cin, cout * K).T @ x).reshape(cout, K, T)         # every tap of every input step
    full = np.zeros((cout, (T - 1) * stride + K), f32)
    for k in range(K):
        full[:, k:k + (T - 1) * stride + 1:stride] += cols[:, k]
    y = full[:, padding:full.shape[1] - padding]
    return (y + b[:, None]).astype(f32, copy=False)


def layer_norm(x, gamma, beta, eps=LN_EPS):
    """LayerNorm over channels of x [C, T] (VITS normalizes each frame's channel vector)."""
    mean = x.mean(axis=0, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=0, keepdims=True)
    return ((x - mean) / np.sqrt(var + f32(eps)) * gamma[:, None] + beta[:, None]).astype(f32)


_erf = np.frompyfunc(math.erf, 1, 1)


def gelu(x):
    """Exact GELU, 0.5 x (1 + erf(x / sqrt 2)) (torch F.gelu default); erf in float64."""
    return (0.5 * x * (1.0 + _erf(x.astype(np.float64) / math.sqrt(2.0)).astype(np.float64))).astype(f32)


def leaky_relu(x, slope):
    return np.where(x >= 0, x, x * f32(slope)).astype(f32)


def sigmoid(x):
    return (1.0 / (1.0 + np.exp(-x))).astype(f32)


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(f32)


def softplus(x):
    return np.logaddexp(0.0, x)


def sequence_mask(length, max_length):
    """[1, max_length] float32: 1 for t < length."""
    return (np.arange(max_length) < length).astype(f32)[None]


# --- Text encoder (enc_p) -----------------------------------------------------

def relative_embeddings(emb, length, window):
    """emb [2w+1, D] (relative positions -w..w) -> [2*length-1, D] for positions -(length-1)..length-1,
    zero beyond the window (attentions._get_relative_embeddings)."""
    pad = max(length - (window + 1), 0)
    start = max((window + 1) - length, 0)
    padded = np.pad(emb, ((pad, pad), (0, 0))) if pad else emb
    return padded[start:start + 2 * length - 1]


def rel_to_abs(x):
    """[H, L, 2L-1] logits by relative position -> [H, L, L] by absolute key position
    (out[h, i, j] = x[h, i, j - i + L - 1]), by the pad-and-reshape trick of attentions.py."""
    H, L, _ = x.shape
    x = np.pad(x, ((0, 0), (0, 0), (0, 1)))                         # [H, L, 2L]
    flat = np.pad(x.reshape(H, L * 2 * L), ((0, 0), (0, L - 1)))
    return flat.reshape(H, L + 1, 2 * L - 1)[:, :L, L - 1:]


def abs_to_rel(x):
    """[H, L, L] weights by absolute key position -> [H, L, 2L-1] by relative position
    (out[h, i, r] = x[h, i, i + r - (L-1)], zero off the grid); the inverse trick."""
    H, L, _ = x.shape
    x = np.pad(x, ((0, 0), (0, 0), (0, L - 1)))                     # [H, L, 2L-1]
    flat = np.pad(x.reshape(H, L * (2 * L - 1)), ((0, 0), (L, 0)))
    return flat.reshape(H, L, 2 * L)[:, :, 1:]


def attention(W, i, x, x_mask):
    """Multi-head self-attention with windowed relative position embeddings (keys and values),
    heads sharing one table; x [C, T] -> [C, T]."""
    p, hp = f"enc_p.encoder.attn_layers.{i}.", W["hp"]
    C, T = x.shape
    H = hp["n_heads"]
    D = C // H
    q, k, v = (conv1d(x, W[p + f"conv_{n}.weight"], W[p + f"conv_{n}.bias"]) for n in "qkv")
    q = q.reshape(H, D, T).transpose(0, 2, 1) / f32(math.sqrt(D))   # [H, T, D], pre-scaled
    k = k.reshape(H, D, T).transpose(0, 2, 1)
    v = v.reshape(H, D, T).transpose(0, 2, 1)
    scores = q @ k.transpose(0, 2, 1)                                 # [H, T, T]
    rel_k = relative_embeddings(W[p + "emb_rel_k"][0], T, hp["window_size"])   # [2T-1, D]
    scores = scores + rel_to_abs(q @ rel_k.T)
    mask = x_mask.T * x_mask                                          # [T, T]
    scores = np.where(mask == 0, f32(MASK_FILL), scores)
    p_attn = softmax(scores, axis=-1)
    out = p_attn @ v                                                  # [H, T, D]
    rel_v = relative_embeddings(W[p + "emb_rel_v"][0], T, hp["window_size"])
    out = out + abs_to_rel(p_attn) @ rel_v
    out = out.transpose(0, 2, 1).reshape(C, T)
    return conv1d(out, W[p + "conv_o.weight"], W[p + "conv_o.bias"])


def ffn(W, i, x, x_mask):
    """conv1d(k=3, same) -> ReLU -> conv1d(k=3, same), masked before each conv and after."""
    p = f"enc_p.encoder.ffn_layers.{i}."
    y = conv1d(x * x_mask, W[p + "conv_1.weight"], W[p + "conv_1.bias"])
    y = np.maximum(y, 0)
    y = conv1d(y * x_mask, W[p + "conv_2.weight"], W[p + "conv_2.bias"])
    return y * x_mask


def encoder_layer(W, i, x, x_mask):
    """One post-LN transformer layer: x = LN(x + MHA(x)); x = LN(x + FFN(x)). x [C, T]."""
    p = "enc_p.encoder."
    x = layer_norm(x + attention(W, i, x, x_mask), W[p + f"norm_layers_1.{i}.gamma"], W[p + f"norm_layers_1.{i}.beta"])
    x = layer_norm(x + ffn(W, i, x, x_mask), W[p + f"norm_layers_2.{i}.gamma"], W[p + f"norm_layers_2.{i}.beta"])
    return x


def text_encoder(W, ids, length=None):
    """ids [T_x] ints (the first `length` real, the rest padding) ->
    (x [hidden, T_x], m_p [inter, T_x], logs_p [inter, T_x], x_mask [1, T_x])."""
    hp = W["hp"]
    ids = np.asarray(ids, np.int64)
    T = len(ids)
    x_mask = sequence_mask(T if length is None else length, T)
    x = W["enc_p.emb.weight"][ids].T * f32(math.sqrt(hp["hidden_channels"]))   # [C, T]
    x = x * x_mask
    for i in range(hp["n_layers"]):
        x = encoder_layer(W, i, x, x_mask)
    x = x * x_mask
    stats = conv1d(x, W["enc_p.proj.weight"], W["enc_p.proj.bias"]) * x_mask
    c = hp["inter_channels"]
    return x, stats[:c], stats[c:], x_mask


# --- Stochastic duration predictor (dp), reverse ---------------------------------

def dds_conv(W, prefix, x, x_mask, g=None):
    """Dilated depth-separable conv stack (modules.DDSConv): per layer, depthwise conv
    (dilation kernel**i) -> LN -> GELU -> 1x1 -> LN -> GELU, residual. x [C, T]."""
    hp = W["hp"]
    if g is not None:
        x = x + g
    for i, d in enumerate(hp["dds_dilations"]):
        y = conv1d(x * x_mask, W[f"{prefix}.convs_sep.{i}.weight"], W[f"{prefix}.convs_sep.{i}.bias"],
                   dilation=d, groups=x.shape[0])
        y = gelu(layer_norm(y, W[f"{prefix}.norms_1.{i}.gamma"], W[f"{prefix}.norms_1.{i}.beta"]))
        y = conv1d(y, W[f"{prefix}.convs_1x1.{i}.weight"], W[f"{prefix}.convs_1x1.{i}.bias"])
        y = gelu(layer_norm(y, W[f"{prefix}.norms_2.{i}.gamma"], W[f"{prefix}.norms_2.{i}.beta"]))
        x = x + y
    return x * x_mask


def _spline_params(uw, uh, ud, tail_bound):
    """Bin edges, widths, heights and knot derivatives of the rational-quadratic spline on
    [-B, B]^2 (float64): uw, uh [..., nb], ud [..., nb-1] -> padded to nb+1 knots with the
    constant that makes the boundary derivative 1 (linear tails)."""
    nb = uw.shape[-1]
    B = tail_bound
    const = np.log(np.exp(1 - MIN_DERIVATIVE) - 1)
    ud = np.concatenate([np.full(ud.shape[:-1] + (1,), const), ud, np.full(ud.shape[:-1] + (1,), const)], -1)

    def edges(u, min_size):
        s = np.exp(u - u.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        s = min_size + (1 - min_size * nb) * s
        cum = np.concatenate([np.zeros(s.shape[:-1] + (1,)), np.cumsum(s, -1)], -1)
        cum = 2 * B * cum - B
        cum[..., 0], cum[..., -1] = -B, B
        return cum, np.diff(cum, axis=-1)

    cumw, widths = edges(uw.astype(np.float64), MIN_BIN_WIDTH)
    cumh, heights = edges(uh.astype(np.float64), MIN_BIN_HEIGHT)
    derivs = MIN_DERIVATIVE + softplus(ud.astype(np.float64))
    return cumw, widths, cumh, heights, derivs


def rational_quadratic_spline(x, uw, uh, ud, inverse=False, tail_bound=5.0):
    """Unconstrained rational-quadratic spline with linear (identity) tails outside [-B, B]
    (transforms.piecewise_rational_quadratic_transform, tails="linear"); float64 inside.
    x [...]; uw, uh [..., nb]; ud [..., nb-1]. Returns float32 of x's shape (no log-det)."""
    x64 = x.astype(np.float64)
    B = tail_bound
    inside = (x64 >= -B) & (x64 <= B)
    cumw, widths, cumh, heights, derivs = _spline_params(uw, uh, ud, B)
    nb = widths.shape[-1]
    loc = (cumh if inverse else cumw).copy()
    loc[..., -1] += SEARCH_EPS
    idx = np.clip(np.sum(x64[..., None] >= loc, axis=-1) - 1, 0, nb - 1)[..., None]

    def at(a, j=idx):
        return np.take_along_axis(a, j, -1)[..., 0]

    cw, bw, ch, bh = at(cumw), at(widths), at(cumh), at(heights)
    delta = at(heights / widths)
    d0, d1 = at(derivs), at(derivs[..., 1:])
    if inverse:
        dy = x64 - ch
        a = dy * (d0 + d1 - 2 * delta) + bh * (delta - d0)
        b = bh * d0 - dy * (d0 + d1 - 2 * delta)
        c = -delta * dy
        disc = np.maximum(b * b - 4 * a * c, 0.0)
        theta = (2 * c) / (-b - np.sqrt(disc))
        y = theta * bw + cw
    else:
        theta = (x64 - cw) / bw
        t1 = theta * (1 - theta)
        y = ch + bh * (delta * theta ** 2 + d0 * t1) / (delta + (d0 + d1 - 2 * delta) * t1)
    return np.where(inside, y, x64).astype(f32)


def conv_flow_reverse(W, j, z, x_mask, g):
    """ConvFlow dp.flows.{j} in reverse: z [2, T]; x0 conditions a spline applied (inverted) to x1.
    g [filter, T] is the predictor's conditioning (added inside the DDSConv)."""
    hp, p = W["hp"], f"dp.flows.{j}."
    nb, T = hp["num_bins"], z.shape[1]
    x0, x1 = z[:1], z[1:]
    h = conv1d(x0, W[p + "pre.weight"], W[p + "pre.bias"])
    h = dds_conv(W, p + "convs", h, x_mask, g=g)
    h = conv1d(h, W[p + "proj.weight"], W[p + "proj.bias"]) * x_mask          # [3nb-1, T]
    h = h.reshape(1, 3 * nb - 1, T).transpose(0, 2, 1)                          # [1, T, 3nb-1]
    scale = f32(math.sqrt(hp["dp_filter_channels"]))
    x1 = rational_quadratic_spline(x1, h[..., :nb] / scale, h[..., nb:2 * nb] / scale, h[..., 2 * nb:],
                                   inverse=True, tail_bound=hp["tail_bound"])
    return np.concatenate([x0, x1], 0) * x_mask


def duration_predictor(W, x, x_mask, noise=None, noise_w=0.8):
    """Stochastic duration predictor in reverse: x [hidden, T_x] (the text encoder's output),
    noise [2, T_x] standard normal (zeros if None) -> logw [1, T_x]."""
    h = conv1d(x, W["dp.pre.weight"], W["dp.pre.bias"])
    h = dds_conv(W, "dp.convs", h, x_mask)
    h = conv1d(h, W["dp.proj.weight"], W["dp.proj.bias"]) * x_mask
    z = (np.zeros((2, x.shape[1]), f32) if noise is None else np.asarray(noise, f32)) * f32(noise_w)
    for j in reversed(W["hp"]["dp_conv_flows"]):                              # 7, 5, 3
        z = z[::-1]                                                           # Flip (flows.j+1)
        z = conv_flow_reverse(W, j, z, x_mask, h)
    z = z[::-1]                                                               # Flip (flows.2)
    z = (z - W["dp.flows.0.m"]) * np.exp(-W["dp.flows.0.logs"]) * x_mask      # ElementwiseAffine
    return z[:1].astype(f32)


# --- Alignment ------------------------------------------------------------------

def generate_path(w_ceil, T_y):
    """Durations w_ceil [1, T_x] (whole frames) -> monotonic path [T_x, T_y]:
    path[i, t] = 1 where frame t belongs to phoneme i (commons.generate_path)."""
    d = w_ceil[0].astype(np.int64)
    cum = np.cumsum(d)
    t = np.arange(T_y)
    return ((t[None] < cum[:, None]) & (t[None] >= (cum - d)[:, None])).astype(f32)


def expand(m_p, logs_p, w_ceil):
    """Repeat each phoneme's prior by its duration: m_p, logs_p [C, T_x], w_ceil [1, T_x] ->
    (m [C, T_y], logs [C, T_y], y_mask [1, T_y]), T_y = max(sum(w_ceil), 1)."""
    T_y = max(int(w_ceil.sum()), 1)
    path = generate_path(w_ceil, T_y)
    return m_p @ path, logs_p @ path, sequence_mask(int(w_ceil.sum()), T_y)


# --- Normalizing flow (flow), reverse ------------------------------------------

def wn(W, prefix, x, mask):
    """WaveNet-style stack (modules.WN, no conditioning): dilated conv -> tanh*sigmoid gate ->
    1x1 to residual + skip (the last layer: skip only). x [H, T] -> skip sum [H, T]."""
    hp = W["hp"]
    H = x.shape[0]
    out = np.zeros_like(x)
    n = hp["wn_layers"]
    for i, d in enumerate(hp["wn_dilations"]):
        x_in = conv1d(x, W[f"{prefix}.in_layers.{i}.weight"], W[f"{prefix}.in_layers.{i}.bias"], dilation=d)
        acts = (np.tanh(x_in[:H]) * sigmoid(x_in[H:])).astype(f32)
        rs = conv1d(acts, W[f"{prefix}.res_skip_layers.{i}.weight"], W[f"{prefix}.res_skip_layers.{i}.bias"])
        if i < n - 1:
            x = (x + rs[:H]) * mask
            out = out + rs[H:]
        else:
            out = out + rs
    return out * mask


def coupling_layer_reverse(W, i, z, mask):
    """ResidualCouplingLayer flow.flows.{i} (i = 0, 2, 4, 6) in reverse, mean only:
    z [C, T] -> [x0, (x1 - m(x0)) * mask]."""
    p = f"flow.flows.{i}."
    half = z.shape[0] // 2
    x0, x1 = z[:half], z[half:]
    h = conv1d(x0, W[p + "pre.weight"], W[p + "pre.bias"]) * mask
    h = wn(W, p + "enc", h, mask)
    m = conv1d(h, W[p + "post.weight"], W[p + "post.bias"]) * mask
    return np.concatenate([x0, (x1 - m) * mask], 0).astype(f32)


def flow_reverse(W, z, mask):
    """ResidualCouplingBlock in reverse: for each coupling, last first: Flip, then coupling. z [C, T_y]."""
    for i in reversed(W["hp"]["flow_couplings"]):
        z = coupling_layer_reverse(W, i, z[::-1], mask)
    return z


# --- HiFi-GAN decoder (dec) ---------------------------------------------------

def resblock(W, name, x):
    """One multi-receptive-field block, e.g. name "dec.resblocks.4"; x [C, T] -> [C, T].
    ResBlock2: x += conv_d(lrelu(x)) per dilation d. ResBlock1 (unused by joe medium):
    x += conv_1(lrelu(conv_d(lrelu(x))))."""
    hp = W["hp"]
    j = int(name.rsplit(".", 1)[1]) % len(hp["resblock_kernel_sizes"])
    for c, d in enumerate(hp["resblock_dilation_sizes"][j]):
        if hp["resblock"] == "2":
            xt = conv1d(leaky_relu(x, LRELU_SLOPE), W[f"{name}.convs.{c}.weight"], W[f"{name}.convs.{c}.bias"], dilation=d)
        else:
            xt = conv1d(leaky_relu(x, LRELU_SLOPE), W[f"{name}.convs1.{c}.weight"], W[f"{name}.convs1.{c}.bias"], dilation=d)
            xt = conv1d(leaky_relu(xt, LRELU_SLOPE), W[f"{name}.convs2.{c}.weight"], W[f"{name}.convs2.{c}.bias"])
        x = xt + x
    return x


def decoder(W, z):
    """HiFi-GAN generator: z [inter, T_y] -> audio [T_y * hop] float32 in [-1, 1]."""
    hp = W["hp"]
    nk = len(hp["resblock_kernel_sizes"])
    x = conv1d(z, W["dec.conv_pre.weight"], W["dec.conv_pre.bias"])
    for i, (u, k) in enumerate(zip(hp["upsample_rates"], hp["upsample_kernel_sizes"])):
        x = leaky_relu(x, LRELU_SLOPE)
        x = conv_transpose1d(x, W[f"dec.ups.{i}.weight"], W[f"dec.ups.{i}.bias"], stride=u, padding=(k - u) // 2)
        xs = resblock(W, f"dec.resblocks.{i * nk}", x)
        for j in range(1, nk):
            xs = xs + resblock(W, f"dec.resblocks.{i * nk + j}", x)
        x = (xs / f32(nk)).astype(f32)
    x = leaky_relu(x, 0.01)                                   # F.leaky_relu default slope
    x = conv1d(x, W["dec.conv_post.weight"], W.get("dec.conv_post.bias"))
    return np.tanh(x[0]).astype(f32)


# --- Whole synthesis -------------------------------------------------------------

def synthesize(W, ids, noise_scale=0.667, length_scale=1.0, noise_w=0.8, noises=None, trace=None, length=None):
    """Phoneme ids -> float32 audio at W["hp"]["sample_rate"] (SynthesizerTrn.infer, one speaker).

    noises: the standard-normal draws, as a callable noises(name, shape) -> array, or a mapping
    {"dp": [2, T_x], "z": [inter, >= T_y]}; None draws them from numpy's default_rng(0).
    "dp" is the duration predictor's input noise (scaled by noise_w), "z" the prior's (by
    noise_scale). trace: a dict to receive every intermediate (x, m_p, ..., z, audio).
    length: how many of ids are real (the rest is padding, masked out), all by default.
    """
    if noises is None:
        rng = np.random.default_rng(0)
        noises = lambda name, shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    draw = noises if callable(noises) else (lambda name, shape: np.asarray(noises[name], f32)[:, :shape[1]])
    x, m_p, logs_p, x_mask = text_encoder(W, ids, length)
    logw = duration_predictor(W, x, x_mask, draw("dp", (2, x.shape[1])), noise_w)
    w = np.exp(logw) * x_mask * f32(length_scale)
    w_ceil = np.ceil(w)
    m, logs, y_mask = expand(m_p, logs_p, w_ceil)
    z_p = (m + draw("z", m.shape) * np.exp(logs) * f32(noise_scale)).astype(f32)
    z = flow_reverse(W, z_p, y_mask)
    audio = decoder(W, z * y_mask)
    if trace is not None:
        trace.update(x=x, m_p=m_p, logs_p=logs_p, x_mask=x_mask, logw=logw, w_ceil=w_ceil, m=m, logs=logs,
                     y_mask=y_mask, z_p=z_p, z=z, audio=audio)
    return audio
