"""Whisper inference in plain numpy (float32 math): the reference Loom's kernels are checked against.

Written from the published architecture, not from Loom: openai/whisper's audio.py
(log_mel_spectrogram, with the Slaney mel filterbank its mel_filters.npz holds,
i.e. librosa.filters.mel(sr=16000, n_fft=400, n_mels=80)), model.py (AudioEncoder,
TextDecoder, ResidualAttentionBlock) and decoding.py (greedy decoding with
SuppressBlank, SuppressTokens and ApplyTimestampRules). Weights come from a
CTranslate2 WhisperSpec model.bin read through loom.weights (a file reader, no
Loom kernels), whose layout differs from PyTorch's only in naming and fusion:

    encoder/conv{1,2}/{weight [D, C, 3], bias}       encoder/position_encodings/encodings [1500, D]
    {enc,dec}oder/layer_i/self_attention/linear_0    fused Q, K, V rows (K bias stored as zeros)
    {enc,dec}oder/layer_i/self_attention/linear_1    attention output
    decoder/layer_i/attention/linear_0, linear_1     cross-attention Q; fused K, V (over the audio)
    decoder/layer_i/attention/linear_2               cross-attention output
    */layer_i/ffn/linear_{0,1}                        MLP D -> 4D -> D, GELU between
    */layer_norm/{gamma,beta}                         pre-LN of each sub-block / final LN
    decoder/embeddings/weight [V, D]                  tokens; also the output projection (tied)
    decoder/position_encodings/encodings [448, D]     learned positions

    W = load(model_dir); mel = log_mel(audio_16k)[:, :3000]
    enc = encode(W, mel); logits = decode(W, enc, [sot])
    text = transcribe(W, tokenizer, audio_16k)
"""
from __future__ import annotations

import json
import os
import re

import numpy as np

SAMPLE_RATE, N_FFT, HOP, CHUNK = 16000, 400, 160, 30
N_SAMPLES = CHUNK * SAMPLE_RATE          # 480000 samples in a window
N_FRAMES = N_SAMPLES // HOP              # 3000 mel frames in a window
f32 = np.float32


# --- Weights ------------------------------------------------------------------

def load(model_dir):
    """{"t": name -> float32 array, "config": config.json, "dims": {...}, "dir": model_dir}."""
    from loom.weights import open_checkpoint
    ck = open_checkpoint(os.path.join(model_dir, "model.bin"))
    t = {name: np.asarray(ck.array(name)).astype(f32) for name, info in ck.tensors.items()
         if info.dtype in ("F32", "F16", "BF16")}
    config = ck.metadata.get("config") or json.load(open(os.path.join(model_dir, "config.json")))
    def layers(side):
        return len({n.split("/")[1] for n in t if re.match(rf"{side}/layer_\d+/", n)})
    dims = {"n_mels": t["encoder/conv1/weight"].shape[1], "d": t["encoder/conv1/weight"].shape[0],
            "n_audio_ctx": t["encoder/position_encodings/encodings"].shape[0],
            "n_text_ctx": t["decoder/position_encodings/encodings"].shape[0],
            "n_vocab": t["decoder/embeddings/weight"].shape[0],
            "n_audio_head": int(ck.array("encoder/num_heads")), "n_text_head": int(ck.array("decoder/num_heads")),
            "n_audio_layer": layers("encoder"), "n_text_layer": layers("decoder")}
    return {"t": t, "config": config, "dims": dims, "dir": model_dir}


# --- Audio features -----------------------------------------------------------

def hz_to_mel(f):
    """Slaney's mel scale (librosa htk=False): linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, np.float64)
    mel = f / (200.0 / 3)
    logstep = np.log(6.4) / 27.0
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / logstep, mel)


def mel_to_hz(m):
    m = np.asarray(m, np.float64)
    logstep = np.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(logstep * (m - 15.0)), m * (200.0 / 3))


def mel_filters(sr=SAMPLE_RATE, n_fft=N_FFT, n_mels=80):
    """[n_mels, n_fft // 2 + 1] triangles between mel-spaced edges, area-normalized (norm="slaney")."""
    fft_freqs = np.fft.rfftfreq(n_fft, 1.0 / sr)
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sr / 2.0), n_mels + 2))
    width = np.diff(edges)
    ramps = edges[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / width[:-1, None]
    upper = ramps[2:] / width[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    enorm = 2.0 / (edges[2:n_mels + 2] - edges[:n_mels])
    return (weights * enorm[:, None]).astype(f32)


def hann(n):
    """The periodic Hann window (torch.hann_window's default)."""
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)).astype(f32)


def log_mel(audio, n_mels=80, padding=N_SAMPLES):
    """Whisper's log_mel_spectrogram: [n_mels, frames] for float32 16 kHz mono samples."""
    x = np.concatenate([np.asarray(audio, f32), np.zeros(padding, f32)])
    x = np.pad(x, N_FFT // 2, mode="reflect")                     # torch.stft(center=True)
    n_frames = 1 + (len(x) - N_FFT) // HOP
    idx = np.arange(N_FFT)[None, :] + HOP * np.arange(n_frames)[:, None]
    spec = np.fft.rfft(x[idx] * hann(N_FFT), axis=-1)              # [frames, 201]
    power = (np.abs(spec[:-1]) ** 2).astype(f32)                   # the last frame dropped
    mel = mel_filters(SAMPLE_RATE, N_FFT, n_mels) @ power.T
    logs = np.log10(np.maximum(mel, 1e-10))
    logs = np.maximum(logs, logs.max() - 8.0)
    return ((logs + 4.0) / 4.0).astype(f32)


def pad_or_trim(mel, frames=N_FRAMES):
    mel = mel[:, :frames]
    return np.pad(mel, ((0, 0), (0, frames - mel.shape[1])))


# --- Layers -------------------------------------------------------------------

def erf(x):
    """Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), evaluated in float64."""
    x = np.asarray(x, np.float64)
    s, a = np.sign(x), np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return s * (1.0 - poly * np.exp(-a * a))


def gelu(x):
    """GELU with erf, as torch.nn.GELU()."""
    return (0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))).astype(f32)


def layer_norm(x, p, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * p["gamma"] + p["beta"]


def linear(x, t, name):
    return x @ t[f"{name}/weight"].T + t[f"{name}/bias"]


def conv1d(x, w, b, stride=1):
    """x [C, T], w [D, C, 3], padding 1 -> [D, T // stride]."""
    xp = np.pad(x, ((0, 0), (1, 1)))
    n = (xp.shape[1] - 3) // stride + 1
    cols = np.stack([xp[:, k:k + stride * (n - 1) + 1:stride] for k in range(3)])   # [3, C, n]
    return np.einsum("dck,kcn->dn", w, cols, optimize=True) + b[:, None]


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def attention(q, k, v, heads, causal=False):
    """q [n, D], k/v [m, D] -> [n, D]: softmax(q k^T / sqrt(d_head)) v per head."""
    n, d = q.shape
    hd = d // heads
    q, k, v = (a.reshape(len(a), heads, hd).transpose(1, 0, 2) for a in (q, k, v))
    scale = f32(hd ** -0.25)                        # applied to both q and k, as model.py does
    w = (q * scale) @ (k * scale).transpose(0, 2, 1)                      # [heads, n, m]
    if causal:
        w = w + np.triu(np.full((n, len(k[0])), -np.inf, f32), 1)
    return (softmax(w) @ v).transpose(1, 0, 2).reshape(n, d)


def params(t, prefix):
    return {"gamma": t[f"{prefix}/gamma"], "beta": t[f"{prefix}/beta"]}


def self_attention(x, t, name, heads, causal=False):
    h = layer_norm(x, params(t, f"{name}/layer_norm"))
    q, k, v = np.split(linear(h, t, f"{name}/linear_0"), 3, axis=-1)
    return x + linear(attention(q, k, v, heads, causal), t, f"{name}/linear_1")


def mlp(x, t, name):
    h = layer_norm(x, params(t, f"{name}/layer_norm"))
    return x + linear(gelu(linear(h, t, f"{name}/linear_0")), t, f"{name}/linear_1")


# --- Model --------------------------------------------------------------------

def encode(W, mel):
    """[n_mels, 3000] log-mel -> [1500, D] audio features."""
    t, dims = W["t"], W["dims"]
    x = gelu(conv1d(np.asarray(mel, f32), t["encoder/conv1/weight"], t["encoder/conv1/bias"]))
    x = gelu(conv1d(x, t["encoder/conv2/weight"], t["encoder/conv2/bias"], stride=2)).T
    x = x + t["encoder/position_encodings/encodings"][:len(x)]
    for i in range(dims["n_audio_layer"]):
        x = self_attention(x, t, f"encoder/layer_{i}/self_attention", dims["n_audio_head"])
        x = mlp(x, t, f"encoder/layer_{i}/ffn")
    return layer_norm(x, params(t, "encoder/layer_norm")).astype(f32)


def cross_kv(W, enc):
    """Each decoder layer's cross-attention keys and values over the audio (fixed per window)."""
    t = W["t"]
    return [np.split(linear(enc, t, f"decoder/layer_{i}/attention/linear_1"), 2, axis=-1)
            for i in range(W["dims"]["n_text_layer"])]


def decode(W, enc, tokens, cross=None, last=False):
    """Logits [len(tokens), vocab] (only the last row's [1, vocab] when last=True)."""
    t, dims = W["t"], W["dims"]
    cross = cross if cross is not None else cross_kv(W, enc)
    emb = t["decoder/embeddings/weight"]
    x = emb[np.asarray(tokens)] + t["decoder/position_encodings/encodings"][:len(tokens)]
    for i in range(dims["n_text_layer"]):
        name = f"decoder/layer_{i}"
        x = self_attention(x, t, f"{name}/self_attention", dims["n_text_head"], causal=True)
        h = layer_norm(x, params(t, f"{name}/attention/layer_norm"))
        q = linear(h, t, f"{name}/attention/linear_0")
        x = x + linear(attention(q, *cross[i], dims["n_text_head"]), t, f"{name}/attention/linear_2")
        x = mlp(x, t, f"{name}/ffn")
    x = layer_norm(x[-1:] if last else x, params(t, "decoder/layer_norm"))
    return (x @ emb.T).astype(f32)


# --- Decoding -----------------------------------------------------------------

def special_tokens(W, tokenizer):
    """Special token ids from the tokenizer; timestamps (absent from tokenizer.json) follow
    <|notimestamps|>, as vocabulary.txt's "<|0.00|>" confirms when present."""
    ids = {name: tokenizer.token_to_id(tok) for name, tok in [
        ("eot", "<|endoftext|>"), ("sot", "<|startoftranscript|>"), ("sot_prev", "<|startofprev|>"),
        ("no_timestamps", "<|notimestamps|>"), ("transcribe", "<|transcribe|>")]}
    ids["no_speech"] = tokenizer.token_to_id("<|nospeech|>") or tokenizer.token_to_id("<|nocaptions|>")
    ids["timestamp_begin"] = ids["no_timestamps"] + 1
    vocab = os.path.join(W["dir"], "vocabulary.txt")
    if os.path.exists(vocab):
        lines = open(vocab, encoding="utf-8").read().split("\n")
        assert lines.index("<|0.00|>") == ids["timestamp_begin"], "vocabulary.txt disagrees on <|0.00|>"
    return ids


def apply_rules(logits, seq, ids, config, max_initial_timestamp_index=50):
    """Whisper's logit filters for the next token after `seq` (the sampled tokens so far):
    SuppressBlank, SuppressTokens, then ApplyTimestampRules (when timestamps are on)."""
    logits = logits.astype(np.float64).copy()
    if not seq:
        logits[config["suppress_ids_begin"]] = -np.inf      # " " and <|endoftext|>
    logits[config["suppress_ids"]] = -np.inf
    tb, eot = ids["timestamp_begin"], ids["eot"]
    if ids.get("timestamps", True):
        logits[ids["no_timestamps"]] = -np.inf
        last_ts = len(seq) >= 1 and seq[-1] >= tb
        penult_ts = len(seq) < 2 or seq[-2] >= tb
        if last_ts:
            if penult_ts:
                logits[tb:] = -np.inf          # a pair just closed: text (or eot) next
            else:
                logits[:eot] = -np.inf         # an open timestamp: another, or eot
        stamps = [s for s in seq if s >= tb]
        if stamps:                             # never decreasing, segments of nonzero length
            floor = stamps[-1] if last_ts and not penult_ts else stamps[-1] + 1
            logits[tb:floor] = -np.inf
        if not seq:
            logits[:tb] = -np.inf
            logits[tb + max_initial_timestamp_index + 1:] = -np.inf
        logprobs = logits - np.logaddexp.reduce(logits)
        if np.logaddexp.reduce(logprobs[tb:]) > logprobs[:tb].max():
            logits[:tb] = -np.inf
    return logits


def greedy(W, enc, ids, timestamps=True, prompt=(), max_tokens=None):
    """Greedy decoding of one window: (sampled tokens without eot, no-speech probability)."""
    config = W["config"]
    start = ([ids["sot_prev"], *prompt] if prompt else []) + [ids["sot"]]
    if not timestamps:
        start.append(ids["no_timestamps"])
    rules = dict(ids, timestamps=timestamps)
    cross = cross_kv(W, enc)
    max_tokens = max_tokens or W["dims"]["n_text_ctx"] // 2
    seq, no_speech = [], None
    while len(seq) < max_tokens:
        logits = decode(W, enc, start + seq, cross, last=no_speech is not None)
        if no_speech is None:
            p = softmax(logits[start.index(ids["sot"])].astype(np.float64))
            no_speech = float(p[ids["no_speech"]])
        token = int(np.argmax(apply_rules(logits[-1], seq, rules, config)))
        if token == ids["eot"]:
            break
        seq.append(token)
    return seq, no_speech


def transcribe(W, tokenizer, audio, timestamps=True):
    """The text of one 30 s window of float32 16 kHz mono audio, greedy, temperature 0."""
    ids = special_tokens(W, tokenizer)
    mel = pad_or_trim(log_mel(audio, W["dims"]["n_mels"]))
    seq, _ = greedy(W, encode(W, mel), ids, timestamps)
    return tokenizer.decode([s for s in seq if s < ids["eot"]]).strip()
