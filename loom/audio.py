"""Audio in and out: container sniffing, decoding, PCM, bandlimited resampling.

A transcription upload arrives as bytes plus the file part's Content-Type.
``decode`` turns it into float32 frames at the model's geometry (rate and
channel count), or raises ``AudioError``:

- raw PCM16LE, when the part declares ``audio/pcm;rate=R;channels=C``
  (``pcm_geometry``). It needs no codec; its length is known from the byte
  count, so ``pcm_frames`` checks it against the model's frame limit before
  anything is converted.
- otherwise the container found in the bytes (``sniff``; never the filename
  or the MIME label) picks the decoder: WAV, FLAC or MP3 through libsndfile
  (soundfile). WebM, MP4/AAC, Ogg and anything else are refused by name.
  Encoded lengths are not trusted: decoded frames are counted as they arrive
  and the recording is refused the moment it would pass the limit.

``Resampler`` converts the sample rate with a Kaiser-windowed sinc filter,
keeping its history across blocks, so a recording decoded block by block
comes out exactly as if converted in one piece.

This module knows no HTTP and no device: an ``AudioError`` carries a stable
code (statuses in errors.STATUS) and param "file".
"""
from __future__ import annotations

import io
import math
import re
from functools import lru_cache

import numpy as np
import soundfile

from .errors import Problem

__all__ = ["AudioError", "sniff", "pcm_geometry", "out_frames", "Resampler", "pcm_frames", "decode",
           "CODECS", "MAX_RATE", "MAX_CHANNELS"]

CODECS = ("wav", "flac", "mp3")
NAMES = {"wav": "WAV", "flac": "FLAC", "mp3": "MP3"}
PCM_HINT = "raw PCM16LE declared as audio/pcm;rate=R;channels=C"

# Far beyond any real recording; they keep every later size computation small.
MAX_RATE = 1_000_000
MAX_CHANNELS = 64


class AudioError(Problem):
    """An upload that cannot become the model's input; param is always "file"."""

    code = "invalid_audio"

    def __init__(self, message, code=None):
        super().__init__(message, code, "file")


def _accepted(codecs):
    """What a client may send instead, e.g. "WAV, FLAC or MP3, or raw PCM16LE declared as ..."."""
    names = [NAMES[c] for c in CODECS if c in codecs]
    listed = (", ".join(names[:-1]) + " or " + names[-1]) if len(names) > 1 else "".join(names)
    return f"{listed}, or {PCM_HINT}" if listed else PCM_HINT


# --- Containers --------------------------------------------------------------------

# Containers we recognise only to refuse them by name.
_REFUSED = [
    (b"\x1aE\xdf\xa3", "WebM/Matroska (e.g. WebM/Opus)"),
    (b"FORM", "AIFF"),
    (b"caff", "Core Audio (CAF)"),
    (b".snd", "Sun/NeXT AU"),
    (b"#!AMR", "AMR"),
    (b"wvpk", "WavPack"),
    (b"MAC ", "Monkey's Audio"),
    (b"\x30\x26\xb2\x75\x8e\x66\xcf\x11", "ASF/WMA"),
    (b"MThd", "MIDI"),
]
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide")
_OGG_STREAMS = [(b"OpusHead", "Ogg/Opus"), (b"\x01vorbis", "Ogg/Vorbis"), (b"\x7fFLAC", "Ogg/FLAC"),
                (b"Speex", "Ogg/Speex")]


def _refused(found, codecs):
    return AudioError(f"{found} uploads are not accepted: convert to {_accepted(codecs)}",
                      "unsupported_audio")


def _mpeg_frame(head: bytes) -> bool:
    """An MPEG-1/2/2.5 audio frame header (Layer I, II or III) with no reserved field.

    ADTS AAC shares the sync word but has layer bits 00, which MPEG audio reserves."""
    if len(head) < 4 or head[0] != 0xFF or head[1] & 0xE0 != 0xE0:
        return False
    version, layer = (head[1] >> 3) & 3, (head[1] >> 1) & 3
    bitrate, rate, emphasis = head[2] >> 4, (head[2] >> 2) & 3, head[3] & 3
    return version != 1 and layer != 0 and bitrate != 15 and rate != 3 and emphasis != 2


def _id3_end(head: bytes) -> int:
    """Where the audio after an ID3v2 tag starts, or 0 if the file does not start with one."""
    if len(head) < 10 or head[:3] != b"ID3" or head[3] == 0xFF or head[4] == 0xFF:
        return 0
    if any(b & 0x80 for b in head[6:10]):  # the size is "syncsafe": 7 bits a byte
        return 0
    size = (head[6] << 21) | (head[7] << 14) | (head[8] << 7) | head[9]
    return 10 + size + (10 if head[5] & 0x10 else 0)  # the footer flag adds a copy of the header


def _sniff(data, codecs) -> str:
    head = bytes(data[:64])
    if not head:
        raise AudioError(f"the file is empty: send a recording in {_accepted(codecs)}", "unsupported_audio")
    if head[:4] in (b"RIFF", b"RIFX", b"RF64") and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    start = _id3_end(head)
    if start:
        # MP3 files usually carry an ID3v2 tag; FLAC files occasionally do.
        return "flac" if bytes(data[start:start + 4]) == b"fLaC" else "mp3"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xF6 == 0xF0:
        raise _refused("AAC (ADTS)", codecs)
    if _mpeg_frame(head[:4]):
        return "mp3"
    if head[:4] == b"OggS":
        stream = next((name for magic, name in _OGG_STREAMS if head[28:28 + len(magic)] == magic), "Ogg")
        raise _refused(stream, codecs)
    if head[4:8] in _MP4_BOXES:
        brand = head[8:12].decode("latin-1") if head[4:8] == b"ftyp" else ""
        raise _refused(f"MP4/M4A/AAC (brand {brand!r})" if brand.strip() else "MP4/QuickTime", codecs)
    if head[:4] == b"RIFF":
        raise _refused(f"RIFF {head[8:12].decode('latin-1')!r} (not WAVE)", codecs)
    for magic, name in _REFUSED:
        if head.startswith(magic):
            raise _refused(name, codecs)
    raise AudioError(f"the file is not a recording in a known format (it starts with bytes {head[:8].hex(' ')}): "
                     f"send {_accepted(codecs)}", "unsupported_audio")


def sniff(data: bytes) -> str:
    """The container by its bytes: "wav" (RIFF/RIFX/RF64 WAVE), "flac" or "mp3" (an ID3v2
    tag, or an MPEG audio frame header). Anything else raises AudioError naming what was found."""
    return _sniff(data, CODECS)


# --- Raw PCM ------------------------------------------------------------------------

_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_TYPE = re.compile(r"[ \t]*([^; \t]+)[ \t]*")
# RFC 9110 parameters: OWS ";" OWS [ name "=" (token | quoted-string) ]; we also allow
# whitespace around "=", which is not ambiguous.
_PARAM = re.compile(rf"[ \t]*;[ \t]*(?:({_TOKEN})[ \t]*=[ \t]*({_TOKEN}|\"(?:[^\"\\]|\\[\s\S])*\"))?[ \t]*")
_DECIMAL = re.compile(r"[0-9]+")
_PCM_LIMITS = {"rate": MAX_RATE, "channels": MAX_CHANNELS}


def pcm_geometry(content_type: str | None) -> tuple[int, int] | None:
    """(rate, channels) for a part labelled audio/pcm;rate=R;channels=C, None for any other type.

    Type and parameter names are case-insensitive and values may be quoted; both
    parameters are required, once each, as positive decimal integers, and nothing else
    is accepted beside them."""
    if content_type is None:
        return None
    head = _TYPE.match(content_type)
    if head is None or head.group(1).lower() != "audio/pcm":
        return None
    params, pos = {}, head.end()
    while pos < len(content_type):
        m = _PARAM.match(content_type, pos)
        if m is None:
            raise AudioError(f"malformed audio/pcm parameters {content_type[pos:][:60]!r}: "
                             f"expected audio/pcm;rate=R;channels=C", "invalid_pcm_geometry")
        pos = m.end()
        if m.group(1) is None:
            continue  # an empty parameter (";;"), which RFC 9110 allows
        name, value = m.group(1).lower(), m.group(2)
        if value.startswith('"'):
            value = re.sub(r"\\([\s\S])", r"\1", value[1:-1])
        if name not in _PCM_LIMITS:
            raise AudioError(f"audio/pcm takes only rate and channels, not {m.group(1)!r}",
                             "invalid_pcm_geometry")
        if name in params:
            raise AudioError(f"audio/pcm declares {name} twice", "invalid_pcm_geometry")
        if not _DECIMAL.fullmatch(value) or not 0 < int(value) <= _PCM_LIMITS[name]:
            raise AudioError(f"audio/pcm {name}={value[:20]!r} is not a whole number from 1 to "
                             f"{_PCM_LIMITS[name]}", "invalid_pcm_geometry")
        params[name] = int(value)
    missing = [name for name in _PCM_LIMITS if name not in params]
    if missing:
        raise AudioError(f"audio/pcm must declare {' and '.join(missing)}: audio/pcm;rate=R;channels=C",
                         "invalid_pcm_geometry")
    return params["rate"], params["channels"]


def out_frames(n: int, in_rate: int, out_rate: int) -> int:
    """Frames that n input frames become: ceil(n * out_rate / in_rate), exactly."""
    return -(-n * out_rate // in_rate)


def pcm_frames(nbytes: int, rate: int, channels: int, model_rate: int) -> int:
    """Frames a raw PCM16LE body of nbytes yields at model_rate; it must hold whole frames."""
    if nbytes == 0:
        raise AudioError("the file is empty: raw PCM needs at least one frame", "invalid_audio")
    frame = 2 * channels
    if nbytes % frame:
        raise AudioError(f"raw PCM16LE with {channels} channel{'s' if channels > 1 else ''} comes in "
                         f"{frame}-byte frames; {nbytes} bytes is not a whole number of them", "invalid_audio")
    return out_frames(nbytes // frame, rate, model_rate)


# --- Resampling ----------------------------------------------------------------------

# One filter quality for every ratio: stopband from the lower Nyquist frequency
# (min(in, out) / 2) at least STOPBAND_DB down, passband flat to within the same
# ripple up to (1 - TRANSITION) of it. Only the length changes with the ratio.
STOPBAND_DB = 80.0
TRANSITION = 0.1
KAISER_BETA = 0.1102 * (STOPBAND_DB - 8.7)
DEFAULT_BUDGET = 1 << 20      # stored coefficients and history samples, each: 4 MiB of float32
GROUP_SAMPLES = 1 << 16       # at most this many input samples (frames x channels) a group
# OpenBLAS runs a product of at most 4 * 65536 multiply-adds on the calling thread. Keeping
# every product under that keeps a conversion on its executor thread: BLAS threads
# spinning on cores the server's other work needs made conversion a hundred times slower.
SINGLE_THREAD_PRODUCT = 4 * 65536
_ALIGN = 16                   # float32s in 64 bytes: every group's operands start on a cache line


def filter_half(up: int, down: int) -> int:
    """Taps each side of an output instant, in input samples, for the reduced ratio up/down."""
    r = min(1.0, up / down)  # the cutoff relative to the input's Nyquist frequency
    # Kaiser's length estimate for the attenuation over a transition TRANSITION * r / 2 wide.
    length = (STOPBAND_DB - 7.95) / (2.285 * 2 * math.pi * TRANSITION * r / 2)
    return math.ceil(length / 2)


class _Plan:
    """A reduced ratio's filter, laid out for matrix products (shared by every resampler of it).

    Output u (input time u * down / up) is the dot product of `taps` consecutive input
    samples, starting at s_u = u * down // up in a history padded with half - 1 zeros,
    with the row of its phase (u * down mod up). Outputs repeat their pattern every `up`;
    a row of `block` periods (`span` inputs, `width` outputs) is split into bands of
    outputs whose windows lie within `taps` inputs of each other, so each band is one
    matrix product of (rows, window) input views with its (window, outputs) coefficients.
    """

    def __init__(self, up, down):
        self.up, self.down = up, down
        self.half = filter_half(up, down)
        self.taps = 2 * self.half
        self.block = max(1, -(-2 * self.taps // down))  # span >= 2 taps: band windows fit in a row
        self.span, self.width = self.block * down, self.block * up
        starts = np.arange(self.width, dtype=np.int64) * down // up
        cuts = np.flatnonzero(np.diff(starts // self.taps)) + 1
        self.bands = list(zip(np.r_[0, cuts], np.r_[cuts, self.width]))
        self.windows = [int(starts[u1 - 1] - starts[u0]) + self.taps for u0, u1 in self.bands]
        self.starts = [int(starts[u0]) for u0, _ in self.bands]
        self.reach = max(s + w for s, w in zip(self.starts, self.windows))
        self.coefficients = int(sum(w * (u1 - u0) for w, (u0, u1) in zip(self.windows, self.bands)))
        self._matrices = None

    def matrices(self):
        """Each band's (window, outputs) coefficient matrix, built on first use."""
        if self._matrices is None:
            table = _phase_table(self.up, self.down, self.half)
            u = np.arange(self.width, dtype=np.int64)
            starts, phases = u * self.down // self.up, u * self.down % self.up
            matrices = []
            for (u0, u1), s0, w in zip(self.bands, self.starts, self.windows):
                m = np.zeros((u1 - u0, w), np.float32)
                rows = np.arange(u1 - u0)[:, None]
                m[rows, (starts[u0:u1] - s0)[:, None] + np.arange(self.taps)] = table[phases[u0:u1]]
                matrices.append(np.ascontiguousarray(m.T))
            self._matrices = matrices  # published whole: plans are shared by worker threads
        return self._matrices


def _phase_table(up, down, half):
    """The up x taps windowed-sinc table. Row p weighs the 2 * half input samples around an
    output that falls p/up of a sample after an input sample, oldest first; each row sums
    to 1, so every phase passes DC unchanged."""
    r = min(1.0, up / down)
    cutoff = (1 - TRANSITION / 2) * r  # the -6 dB point, relative to the input's Nyquist frequency
    t = np.arange(2 * half, dtype=np.float64)
    tau = (np.arange(up, dtype=np.float64) / up)[:, None] + (half - 1) - t  # output minus input time
    x = tau / half  # within [-1, 1): the windows cover exactly the kernel's support
    window = np.i0(KAISER_BETA * np.sqrt(1.0 - x * x)) / np.i0(KAISER_BETA)
    table = cutoff * np.sinc(cutoff * tau) * window
    return table / table.sum(axis=1, keepdims=True)


@lru_cache(maxsize=8)  # a server meets a handful of ratios; each plan is at most `budget` floats
def _plan(up, down):
    return _Plan(up, down)


class Resampler:
    """Bandlimited sample-rate conversion of [frames, channels] float32, block by block.

    The ratio reduces to up/down (by their gcd). Every ratio gets the same filter
    quality: a Kaiser-windowed sinc (STOPBAND_DB down from min(in, out) / 2, passband
    flat to (1 - TRANSITION) of it), 2 * filter_half(up, down) taps long, so the filter
    grows with the downsampling factor. Budget rule: the coefficients the ratio stores
    (`coefficients`: every output position of a row of periods with its window, at most
    about 2 * block * up * taps; 510284 for 22050 -> 192000, the largest among the common
    rates to and from 16000, 22050 and 24000 Hz) and the history (`history`: channels x
    samples kept between products) must each fit in `budget`, or construction raises
    AudioError "resample_budget". Quality is never traded for size: 16001 -> 16000 has
    16000 phases, 1.6 M coefficients, and is refused.

    Outputs are computed in fixed groups of inputs, on an aligned buffer, with the same
    matrix shapes every time, so each output's arithmetic is the same however the input
    is split into feed() calls: chunking changes no bit of the result. feed() returns
    the outputs of every group its input completes; flush() pads the end with silence
    for the filter's lookahead and returns the rest, so over a whole recording exactly
    out_frames(total_in, in_rate, out_rate) frames come out. Equal rates pass samples
    through unchanged. Channels are filtered independently, never mixed.
    """

    def __init__(self, in_rate: int, out_rate: int, channels: int, budget: int = DEFAULT_BUDGET):
        if in_rate <= 0 or out_rate <= 0 or channels <= 0:
            raise ValueError(f"Resampler({in_rate}, {out_rate}, {channels}): rates and channels must be positive")
        self.in_rate, self.out_rate, self.channels = in_rate, out_rate, channels
        g = math.gcd(in_rate, out_rate)
        self.up, self.down = out_rate // g, in_rate // g
        self.total_in = self.total_out = 0
        self._flushed = False
        if self.up == self.down:
            self.taps = self.coefficients = self.history = 0
            return
        half = filter_half(self.up, self.down)
        # The up x taps table is a lower bound of what the plan stores: refuse before building it.
        if self.up * 2 * half > budget:
            raise self._too_big(self.up * 2 * half, "coefficients", budget)
        plan = self._plan = _plan(self.up, self.down)
        if plan.coefficients > budget:
            raise self._too_big(plan.coefficients, "coefficients", budget)
        self.taps, self.coefficients = plan.taps, plan.coefficients
        largest = max(w * (u1 - u0) for w, (u0, u1) in zip(plan.windows, plan.bands))
        self._rows = max(1, min(GROUP_SAMPLES // (plan.span * channels), SINGLE_THREAD_PRODUCT // largest))
        self._consumed = self._rows * plan.span  # inputs each group moves on by
        length = max(self._consumed, (self._rows - 1) * plan.span + plan.reach)
        self._keep = length - self._consumed
        stride = -(-length // _ALIGN) * _ALIGN
        self.history = channels * stride
        if self.history > budget:
            raise self._too_big(self.history, "history samples", budget)
        raw = np.zeros(channels * stride + _ALIGN, np.float32)
        skip = (-raw.ctypes.data // 4) % _ALIGN
        self._buf = raw[skip:skip + channels * stride].reshape(channels, stride)
        self._length = length
        self._fill = plan.half - 1  # the silence before the first sample
        # Each band's input windows, as fixed read-only views of the buffer: (channels, rows, window).
        step = self._buf.strides
        self._products = [
            (u0, u1, np.lib.stride_tricks.as_strided(self._buf[:, s0:], (channels, self._rows, w),
                                                     (step[0], plan.span * step[1], step[1]), writeable=False),
             m)
            for (u0, u1), s0, w, m in zip(plan.bands, plan.starts, plan.windows, plan.matrices())]

    def _too_big(self, size, what, budget):
        return AudioError(f"converting {self.in_rate} Hz to {self.out_rate} Hz needs {size} {what} "
                          f"(a {self.up}/{self.down} ratio), over this server's budget of {budget}: "
                          f"resample the recording to a common rate such as {self.out_rate} Hz first",
                          "resample_budget")

    def feed(self, frames: np.ndarray) -> np.ndarray:
        """Convert more input; returns the outputs it completes (possibly none)."""
        if self._flushed:
            raise RuntimeError("Resampler.feed after flush")
        frames = np.asarray(frames, dtype=np.float32)
        if frames.ndim != 2 or frames.shape[1] != self.channels:
            raise ValueError(f"Resampler.feed takes [frames, {self.channels}], not {frames.shape}")
        self.total_in += len(frames)
        if self.up == self.down:
            self.total_out += len(frames)
            return frames.copy()
        out, pos = [], 0
        while pos < len(frames):
            take = min(len(frames) - pos, self._length - self._fill)
            self._buf[:, self._fill:self._fill + take] = frames[pos:pos + take].T
            self._fill += take
            pos += take
            if self._fill == self._length:
                out.append(self._group())
        out = self._joined(out)
        self.total_out += len(out)
        return out

    def flush(self) -> np.ndarray:
        """The outputs still owed at the end of the recording (the filter's lookahead)."""
        if self._flushed:
            raise RuntimeError("Resampler.flush twice")
        self._flushed = True
        if self.up == self.down:
            return np.zeros((0, self.channels), np.float32)
        owed = out_frames(self.total_in, self.in_rate, self.out_rate) - self.total_out
        out, made = [], 0
        while made < owed:
            self._buf[:, self._fill:self._length] = 0.0
            self._fill = self._length
            out.append(self._group())
            made += len(out[-1])
        tail = self._joined(out)[:owed]
        self.total_out += len(tail)
        return tail

    def _group(self):
        """The outputs of one full buffer; then keep its overlap with the next group."""
        plan, rows = self._plan, self._rows
        result = np.empty((self.channels, rows, plan.width), np.float32)
        for u0, u1, windows, m in self._products:
            np.matmul(windows, m, out=result[:, :, u0:u1])
        self._buf[:, :self._keep] = self._buf[:, self._consumed:self._length]
        self._fill = self._keep
        return result.reshape(self.channels, rows * plan.width).T

    def _joined(self, parts):
        if not parts:
            return np.zeros((0, self.channels), np.float32)
        return np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts))


# --- Decoding ------------------------------------------------------------------------

class _Frames:
    """The converted recording, growing block by block, never past `limit` frames."""

    def __init__(self, expected, limit, channels):
        self.limit = limit
        self.data = np.empty((max(1, min(expected, limit)), channels), np.float32)
        self.count = 0

    def append(self, block):
        end = self.count + len(block)
        if end > len(self.data):  # only when a header understated the length
            grown = np.empty((min(self.limit, max(end, 2 * len(self.data))), self.data.shape[1]), np.float32)
            grown[:self.count] = self.data[:self.count]
            self.data = grown
        self.data[self.count:end] = block
        self.count = end

    def result(self):
        return self.data if self.count == len(self.data) else self.data[:self.count].copy()


def _too_long(max_frames, rate):
    return AudioError(f"the recording is longer than this model accepts: at most {max_frames / rate:g} s "
                      f"({max_frames} frames at {rate} Hz)", "audio_too_long")


def _layout(found, channels):
    """How decoded channels become the model's: kept, or averaged to mono."""
    if found == channels:
        return None
    if channels == 1:
        return "mono"
    raise AudioError(f"the recording has {found} channels; this model takes {channels}: only recordings "
                     f"with {channels} channels, or any recording for a mono model, are converted",
                     "channel_mismatch")


def _decode_pcm(data, geometry, rate, channels, max_frames, block):
    pcm_rate, pcm_channels = geometry
    if pcm_channels != channels:
        raise AudioError(f"the raw PCM declares {pcm_channels} channel{'s' if pcm_channels > 1 else ''}; "
                         f"this model takes {channels}: send audio/pcm;rate=R;channels={channels}",
                         "channel_mismatch")
    frames = pcm_frames(len(data), pcm_rate, channels, rate)
    if frames > max_frames:
        raise _too_long(max_frames, rate)
    resampler = Resampler(pcm_rate, rate, channels)
    samples = np.frombuffer(data, "<i2").reshape(-1, channels)
    out = _Frames(frames, max_frames, channels)
    for start in range(0, len(samples), block):
        # int16 / 32768 is exact in float32, so equal rates keep every sample.
        out.append(resampler.feed(samples[start:start + block].astype(np.float32) * np.float32(1 / 32768)))
    out.append(resampler.flush())
    return out.result()


def _decode_file(data, kind, rate, channels, max_frames, block):
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            in_rate, in_channels, stated = f.samplerate, f.channels, f.frames
            if not 0 < in_rate <= MAX_RATE:
                raise AudioError(f"the {NAMES[kind]} header states a sample rate of {in_rate} Hz; "
                                 f"accepted are 1 to {MAX_RATE} Hz", "invalid_audio")
            if not 0 < in_channels <= MAX_CHANNELS:
                raise AudioError(f"the {NAMES[kind]} header states {in_channels} channels; "
                                 f"accepted are 1 to {MAX_CHANNELS}", "invalid_audio")
            layout = _layout(in_channels, channels)
            resampler = Resampler(in_rate, rate, channels)
            out = _Frames(out_frames(max(stated, 0), in_rate, rate), max_frames, channels)
            while True:
                frames = f.read(block, dtype="float32", always_2d=True)
                if not len(frames):
                    break
                # Counted before conversion: the recording is refused the moment it is too long.
                if out_frames(resampler.total_in + len(frames), in_rate, rate) > max_frames:
                    raise _too_long(max_frames, rate)
                if not np.isfinite(frames).all():
                    raise AudioError(f"the {NAMES[kind]} file holds samples that are not finite numbers",
                                     "invalid_audio")
                if layout == "mono":
                    frames = frames.mean(axis=1, dtype=np.float32, keepdims=True)
                out.append(resampler.feed(frames))
    except (soundfile.LibsndfileError, RuntimeError, ValueError) as e:
        # libsndfile's own words, without soundfile's "Error opening <BytesIO object at ...>".
        detail = getattr(e, "error_string", None) or str(e)
        raise AudioError(f"the file looks like {NAMES[kind]} but cannot be decoded: {detail}",
                         "invalid_audio") from e
    if resampler.total_in == 0:
        raise AudioError(f"the {NAMES[kind]} file holds no audio frames", "invalid_audio")
    out.append(resampler.flush())
    return out.result()


def decode(data: bytes, content_type: str | None, rate: int, channels: int, max_frames: int,
           codecs=CODECS, block: int = 65536) -> np.ndarray:
    """An uploaded recording as float32 [frames, channels] at the model's rate and channel count.

    Raw PCM16LE when content_type is audio/pcm (its channel count must be the model's);
    otherwise the container in the bytes picks the decoder, which must be in `codecs`.
    Decoding reads `block` frames at a time through one decoder and one resampler, so
    both keep their history across blocks; more than max_frames output frames reject,
    checked before decoding for raw PCM and as frames arrive for encoded audio, so
    storage never exceeds max_frames (plus one block) whatever a header claims.
    Runs on a worker thread: libsndfile and numpy release the GIL.
    """
    geometry = pcm_geometry(content_type)
    if geometry is not None:
        return _decode_pcm(data, geometry, rate, channels, max_frames, block)
    kind = _sniff(data, codecs)
    if kind not in codecs:
        raise AudioError(f"{NAMES[kind]} decoding is disabled on this server: send {_accepted(codecs)}",
                         "audio_codec_disabled")
    return _decode_file(data, kind, rate, channels, max_frames, block)
