"""Audio input (loom/audio.py): sniffing, audio/pcm geometry, resampling, decoding.

Recordings are real files written by soundfile (libsndfile: WAV, RF64, FLAC, MP3,
Ogg, AIFF); broken and lying ones are built byte by byte below. The resampler is
checked against an independent reference, the direct sum of its documented
windowed-sinc kernel, and by what a listener cares about: a sine keeps its
frequency and level (SNR printed), tones above the new Nyquist frequency are
removed, channels stay apart, and chunking changes no bit of the result.
"""
import io
import math
import struct
import tracemalloc
from fractions import Fraction

import numpy as np
import pytest
import soundfile as sf
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from loom import audio
from loom.audio import AudioError, Resampler, decode, out_frames, pcm_frames, pcm_geometry, sniff
from loom.errors import Error, STATUS

RNG = np.random.default_rng(20240601)
COMMON = [8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000, 88200, 96000, 192000]
MODEL_RATES = [16000, 22050, 24000]
FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


def rejects(code, status, fn, *args, **kwargs):
    """fn(*args) raises AudioError `code`, which the service boundary answers with `status`."""
    with pytest.raises(AudioError) as info:
        fn(*args, **kwargs)
    e = info.value
    assert e.code == code, e.message
    assert e.param == "file"
    assert Error.of(e).status == status == STATUS[code]
    return e.message


def convert(in_rate, out_rate, x, cuts=()):
    """x through one Resampler, fed in pieces split at `cuts`, then flushed."""
    r = Resampler(in_rate, out_rate, x.shape[1])
    edges = [0, *sorted(cuts), len(x)]
    parts = [r.feed(x[a:b]) for a, b in zip(edges, edges[1:])]
    return np.concatenate(parts + [r.flush()])


def encoded(x, rate, fmt, subtype=None):
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def wav16(samples, rate, channels, data_size=None):
    """A PCM16 WAV built by hand, so its data chunk may state any length."""
    pcm = np.asarray(samples, "<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * 2 * channels, 2 * channels, 16)
    body = (b"WAVEfmt " + struct.pack("<I", 16) + fmt + b"data"
            + struct.pack("<I", len(pcm) if data_size is None else data_size) + pcm)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def tone(freq, rate, seconds, amplitude=0.5, phase=0.0):
    return amplitude * np.sin(2 * np.pi * freq * np.arange(round(rate * seconds)) / rate + phase)


def spectrum_peak(y, rate):
    """The strongest frequency in y (Hann-windowed FFT, 1 Hz bins for 1 s of signal)."""
    power = np.abs(np.fft.rfft(y * np.hanning(len(y)))) ** 2
    return np.argmax(power) * rate / len(y)


# --- The reference: the documented kernel, summed directly ----------------------------

def reference(x, in_rate, out_rate):
    """Each output as the direct sum over input samples of the Kaiser-windowed sinc the
    Resampler documents (silence outside the recording), in float64, one at a time."""
    g = math.gcd(in_rate, out_rate)
    up, down = out_rate // g, in_rate // g
    half = audio.filter_half(up, down)
    cutoff = (1 - audio.TRANSITION / 2) * min(1.0, up / down)
    y = np.zeros((out_frames(len(x), in_rate, out_rate), x.shape[1]))
    for k in range(len(y)):
        t = Fraction(k * down, up)
        first = math.floor(t) - half + 1
        idx = np.arange(first, first + 2 * half)
        tau = float(t - first) - np.arange(2 * half)
        w = np.i0(audio.KAISER_BETA * np.sqrt(np.maximum(0.0, 1 - (tau / half) ** 2))) / np.i0(audio.KAISER_BETA)
        h = cutoff * np.sinc(cutoff * tau) * w
        inside = (idx >= 0) & (idx < len(x))
        y[k] = (h[inside] / h.sum()) @ x[idx[inside]]
    return y


@pytest.mark.parametrize("in_rate,out_rate", [(44100, 16000), (16000, 24000), (24000, 16000), (7, 3), (3, 11)])
def test_resampler_matches_direct_kernel_sum(in_rate, out_rate):
    x = RNG.standard_normal((1500, 2))
    got = convert(in_rate, out_rate, x.astype(np.float32))
    want = reference(x.astype(np.float32).astype(np.float64), in_rate, out_rate)
    # float32 coefficients and accumulation over a few hundred taps: ~1e-6 of a unit-variance signal.
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5)


# --- Resampler properties ---------------------------------------------------------------

rates = st.one_of(st.sampled_from(COMMON), st.integers(1, 400))


@given(in_rate=rates, out_rate=rates, n=st.integers(0, 3000), data=st.data())
@settings(max_examples=60, deadline=None)
def test_output_length_is_ceil_of_duration(in_rate, out_rate, n, data):
    try:
        r = Resampler(in_rate, out_rate, 1)
    except AudioError as e:
        assert e.code == "resample_budget"
        assume(False)
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=4)))
    x = np.zeros((n, 1), np.float32)
    total = sum(len(r.feed(x[a:b])) for a, b in zip([0, *cuts], [*cuts, n])) + len(r.flush())
    assert total == out_frames(n, in_rate, out_rate) == math.ceil(Fraction(n * out_rate, in_rate))


@given(n=st.integers(0, 10**30), in_rate=st.integers(1, 10**7), out_rate=st.integers(1, 10**7))
def test_out_frames_is_exact_for_huge_counts(n, in_rate, out_rate):
    assert out_frames(n, in_rate, out_rate) == math.ceil(Fraction(n * out_rate, in_rate))


@given(rate=st.integers(1, 10**6), channels=st.integers(1, 3), data=st.data())
@settings(max_examples=50, deadline=None)
def test_equal_rates_pass_every_sample_through(rate, channels, data):
    n = data.draw(st.integers(0, 500))
    x = RNG.standard_normal((n, channels)).astype(np.float32) * np.float32(1e3)
    cuts = data.draw(st.lists(st.integers(0, n), max_size=3))
    y = convert(rate, rate, x, cuts)
    assert y.dtype == np.float32 and np.array_equal(y, x)


PAIRS = [(44100, 16000), (16000, 24000), (24000, 16000), (22050, 192000), (192000, 16000), (11025, 16000),
         (7, 3), (3, 7), (48000, 22050)]


@given(pair=st.sampled_from(PAIRS), channels=st.integers(1, 2), data=st.data())
@settings(max_examples=40, deadline=None)
def test_chunk_boundaries_change_no_bit(pair, channels, data):
    n = data.draw(st.one_of(st.integers(0, 100), st.integers(5000, 40000)))  # past several groups
    x = RNG.standard_normal((n, channels)).astype(np.float32)
    whole = convert(*pair, x)
    cuts = data.draw(st.lists(st.integers(0, n), max_size=8))
    assert np.array_equal(convert(*pair, x, cuts), whole)


def snr_db(y, ideal):
    return 10 * np.log10(np.sum(ideal ** 2) / np.sum((y - ideal) ** 2))


@pytest.mark.parametrize("in_rate,out_rate", [(44100, 16000), (22050, 16000), (24000, 16000), (16000, 24000),
                                              (11025, 16000), (32000, 22050), (22050, 192000)])
@pytest.mark.parametrize("freq", [440, 1000, 3000, 4900])
def test_sine_keeps_frequency_and_level(in_rate, out_rate, freq):
    x = tone(freq, in_rate, 1.25, phase=0.3)[:, None].astype(np.float32)
    y = convert(in_rate, out_rate, x)[:, 0]
    # Output k is the signal at time k / out_rate: compare with the sine sampled there, away
    # from the ends where the recording starts and stops (the filter sees silence beyond them).
    edge = out_rate // 8
    ideal = tone(freq, out_rate, 1.25, phase=0.3)[edge:edge + out_rate]
    inner = y[edge:edge + out_rate]
    snr = snr_db(inner, ideal)
    print(f"{in_rate} -> {out_rate} Hz, {freq} Hz sine: SNR {snr:.1f} dB")
    assert snr > 70
    assert spectrum_peak(inner, out_rate) == freq
    assert abs(np.sqrt(np.mean(inner ** 2)) / np.sqrt(np.mean(ideal ** 2)) - 1) < 1e-3


@pytest.mark.parametrize("in_rate,out_rate,freq", [(44100, 16000, 8300), (44100, 16000, 12000),
                                                   (48000, 16000, 20000), (24000, 16000, 9000),
                                                   (192000, 22050, 30000)])
def test_tones_above_the_new_nyquist_are_removed(in_rate, out_rate, freq):
    x = tone(freq, in_rate, 1.0)[:, None].astype(np.float32)
    y = convert(in_rate, out_rate, x)[:, 0]
    inner = y[out_rate // 8:-out_rate // 8]
    attenuation = 20 * np.log10(np.sqrt(np.mean(x ** 2)) / np.sqrt(np.mean(inner ** 2)))
    print(f"{in_rate} -> {out_rate} Hz, {freq} Hz tone: {attenuation:.1f} dB down")
    assert attenuation > 75


def test_upsampling_adds_no_images():
    x = tone(7000, 16000, 1.25)[:, None].astype(np.float32)
    y = convert(16000, 48000, x)[6000:54000, 0]
    power = np.abs(np.fft.rfft(y * np.hanning(len(y)))) ** 2
    freqs = np.fft.rfftfreq(len(y), 1 / 48000)
    image = power[(freqs > 8500)].max()   # 16000 - 7000 = 9000 Hz, and beyond
    assert 10 * np.log10(power.max() / image) > 75


def test_channels_are_filtered_apart():
    left, right = tone(500, 44100, 1.25), tone(2500, 44100, 1.25, amplitude=0.25)
    y = convert(44100, 16000, np.stack([left, right], 1).astype(np.float32))
    inner = y[2000:18000]
    assert spectrum_peak(inner[:, 0], 16000) == 500
    assert spectrum_peak(inner[:, 1], 16000) == 2500
    for channel, other in ((0, 2500), (1, 500)):
        power = np.abs(np.fft.rfft(inner[:, channel] * np.hanning(len(inner)))) ** 2
        assert 10 * np.log10(power.max() / power[other]) > 90   # none of the other channel's tone
    for channel, x in enumerate((left, right)):
        alone = convert(44100, 16000, x[:, None].astype(np.float32))[:, 0]
        np.testing.assert_allclose(y[:, channel], alone, atol=1e-6)


# --- Budget -------------------------------------------------------------------------------

def test_common_rates_fit_the_default_budget():
    for rate in COMMON:
        for model in MODEL_RATES:
            Resampler(rate, model, 2)
            Resampler(model, rate, 2)


def test_ratio_beyond_the_budget_rejects():
    message = rejects("resample_budget", 400, Resampler, 16001, 16000, 1)
    assert "16001 Hz" in message and "16000 Hz" in message


def test_budget_rejects_instead_of_lowering_quality():
    x = RNG.standard_normal((30000, 1)).astype(np.float32)
    default = Resampler(44100, 16000, 1)
    need = max(default.coefficients, default.history)
    tight = Resampler(44100, 16000, 1, budget=need)
    assert tight.taps == default.taps
    assert np.array_equal(np.concatenate([tight.feed(x), tight.flush()]), convert(44100, 16000, x))
    rejects("resample_budget", 400, Resampler, 44100, 16000, 1, budget=need - 1)


def test_filter_length_follows_the_downsampling_factor_only():
    """One quality for every accepted ratio: taps * min(1, out/in) is the same length."""
    lengths = []
    for in_rate, out_rate in [(16000, 24000), (44100, 16000), (48000, 16000), (192000, 16000), (11025, 16000)]:
        r = Resampler(in_rate, out_rate, 1)
        lengths.append(r.taps * min(1, out_rate / in_rate))
    assert max(lengths) - min(lengths) < 2.5, lengths


# --- Sniffing -----------------------------------------------------------------------------

STEREO = np.stack([tone(440, 44100, 0.5), tone(660, 44100, 0.5)], 1).astype(np.float32)


@pytest.mark.parametrize("fmt,subtype,kind", [("WAV", "PCM_16", "wav"), ("WAV", "FLOAT", "wav"),
                                              ("RF64", "PCM_16", "wav"), ("FLAC", "PCM_16", "flac"),
                                              ("MP3", None, "mp3")])
def test_sniff_finds_real_files(fmt, subtype, kind):
    assert sniff(encoded(STEREO, 44100, fmt, subtype)) == kind


def id3(payload=b"\0" * 20):
    size = len(payload)
    syncsafe = bytes([(size >> 21) & 127, (size >> 14) & 127, (size >> 7) & 127, size & 127])
    return b"ID3\x04\x00\x00" + syncsafe + payload


def test_sniff_looks_past_an_id3_tag():
    assert sniff(id3() + encoded(STEREO, 44100, "MP3")) == "mp3"
    assert sniff(id3() + encoded(STEREO, 44100, "FLAC")) == "flac"
    assert decode(id3() + encoded(STEREO, 44100, "MP3"), None, 16000, 1, 10**6).shape[1] == 1


@pytest.mark.parametrize("data,named", [
    (b"\x1aE\xdf\xa3\x9fB\x86\x81\x01", "WebM"),
    (b"\x00\x00\x00\x20ftypM4A \x00\x00\x02\x00", "MP4"),
    (b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00", "isom"),
    (b"\xff\xf1\x50\x80\x02\x1f\xfc", "AAC"),
    (b"\xff\xf9\x50\x80\x02\x1f\xfc", "AAC"),
    (b"OggS\x00\x02" + b"\x00" * 22 + b"OpusHead\x01\x02", "Ogg/Opus"),
    (encoded(STEREO, 44100, "OGG", "VORBIS"), "Ogg/Vorbis"),
    (encoded(STEREO, 44100, "AIFF", "PCM_16"), "AIFF"),
    (b"RIFF\x10\x00\x00\x00AVI LIST", "not WAVE"),
    (b"", "empty"),
    (bytes(RNG.integers(0, 256, 64, dtype=np.uint8)) + b"x", "not a recording in a known format"),
])
def test_sniff_refuses_other_containers_by_name(data, named):
    message = rejects("unsupported_audio", 415, sniff, data)
    assert named in message
    assert "WAV, FLAC or MP3" in message


def test_mpeg_sync_needs_a_valid_header():
    assert sniff(b"\xff\xfb\x90\x64" + b"\0" * 8) == "mp3"        # MPEG-1 Layer III, 128 kbit/s
    for head in (b"\xff\xfb\xf0\x64", b"\xff\xfb\x9c\x64", b"\xff\xeb\x90\x64", b"\xff\xf9\x90\x64"):
        rejects("unsupported_audio", 415, sniff, head + b"\0" * 8)  # bad bitrate, rate, version, ADTS


@given(st.binary(max_size=200))
@FUZZ
def test_sniff_on_arbitrary_bytes(data):
    try:
        assert sniff(data) in audio.CODECS
    except AudioError as e:
        assert e.code == "unsupported_audio"


# --- audio/pcm geometry --------------------------------------------------------------------

@pytest.mark.parametrize("content_type,geometry", [
    (None, None), ("audio/wav", None), ("application/octet-stream", None), ("audio/pcmx;rate=1", None),
    ("", None), ("audio/L16;rate=16000;channels=1", None),
    ("audio/pcm;rate=24000;channels=1", (24000, 1)),
    ("Audio/PCM; RATE=16000 ; Channels=\"2\"", (16000, 2)),
    ("audio/pcm;channels=1;rate=\"8000\"", (8000, 1)),
    ("audio/pcm ; rate = 44100 ;; channels=2 ;", (44100, 2)),
    ("audio/pcm;rate=\"4\\8000\";channels=1", (48000, 1)),
])
def test_pcm_geometry_reads_the_declared_geometry(content_type, geometry):
    assert pcm_geometry(content_type) == geometry


@pytest.mark.parametrize("content_type", [
    "audio/pcm", "audio/pcm;rate=16000", "audio/pcm;channels=1", "audio/pcm;rate=0;channels=1",
    "audio/pcm;rate=-1;channels=1", "audio/pcm;rate=+5;channels=1", "audio/pcm;rate=1e3;channels=1",
    "audio/pcm;rate=0x10;channels=1", "audio/pcm;rate=16000.0;channels=1", "audio/pcm;rate=\"\";channels=1",
    "audio/pcm;rate=16000;channels=65", "audio/pcm;rate=1000001;channels=1",
    "audio/pcm;rate=\u0661\u0666\u0660\u0660\u0660;channels=1", "audio/pcm;rate=16000;rate=16000;channels=1",
    "audio/pcm;rate=16000;RATE=16000;channels=1", "audio/pcm;rate=16000;channels=1;encoding=s16le",
    "audio/pcm;rate=16000;channels=1 x", "audio/pcm;rate=\"16000;channels=1", "audio/pcm;rate;channels=1",
    "audio/pcm;=1;rate=1;channels=1",
])
def test_pcm_geometry_rejects_bad_declarations(content_type):
    rejects("invalid_pcm_geometry", 400, pcm_geometry, content_type)


params = st.sampled_from(["rate", "channels", "RATE", "Channels", "bits", ""])
values = st.one_of(st.integers(-5, 10**7).map(str), st.text(max_size=6), st.integers(0, 99).map(lambda v: f'"{v}"'))
declarations = st.builds(lambda parts, gap: "audio/pcm" + "".join(f"{gap};{gap}{n}={v}" for n, v in parts),
                         st.lists(st.tuples(params, values), max_size=4), st.sampled_from(["", " ", "\t"]))


@given(st.one_of(st.text(max_size=60), declarations))
@FUZZ
def test_pcm_geometry_on_arbitrary_strings(content_type):
    try:
        geometry = pcm_geometry(content_type)
    except AudioError as e:
        assert e.code == "invalid_pcm_geometry"
        return
    if geometry is not None:
        rate, channels = geometry
        assert type(rate) is int and type(channels) is int
        assert 0 < rate <= audio.MAX_RATE and 0 < channels <= audio.MAX_CHANNELS


def test_pcm_frames_counts_whole_frames_at_the_model_rate():
    assert pcm_frames(2 * 24000, 24000, 1, 16000) == 16000
    assert pcm_frames(4 * 3, 22050, 2, 16000) == math.ceil(3 * 16000 / 22050)
    rejects("invalid_audio", 400, pcm_frames, 0, 16000, 1, 16000)
    assert "4-byte frames" in rejects("invalid_audio", 400, pcm_frames, 6, 16000, 2, 16000)
    rejects("invalid_audio", 400, pcm_frames, 7, 16000, 1, 16000)


# --- Decoding ---------------------------------------------------------------------------

def test_wav_stereo_44100_becomes_16000_mono():
    left, right = tone(440, 44100, 1.0, 0.4), tone(3000, 44100, 1.0, 0.3, phase=1.0)
    data = encoded(np.stack([left, right], 1), 44100, "WAV", "PCM_16")
    y = decode(data, "audio/wav", 16000, 1, 16000)
    assert y.shape == (16000, 1) and y.dtype == np.float32 and y.flags.c_contiguous
    want = (tone(440, 16000, 1.0, 0.4) + tone(3000, 16000, 1.0, 0.3, phase=1.0)) / 2
    # Error budget: PCM16 rounding (2^-16 per sample, halved by the mix) and the filter's
    # passband ripple (80 dB: 1e-4 of the 0.35 amplitude): both under 1e-4 apart from the
    # ends, where the recording's edges ring through the filter.
    inner = slice(1000, 15000)
    assert np.abs(y[inner, 0] - want[inner]).max() < 1e-4


def test_flac_at_the_model_rate_is_lossless():
    x = (RNG.integers(-32768, 32768, (8000, 2))).astype(np.int16)
    y = decode(encoded(x, 16000, "FLAC", "PCM_16"), None, 16000, 2, 8000)
    assert np.array_equal(y, x / np.float32(32768))


def test_flac_48000_becomes_16000():
    x = tone(1000, 48000, 1.0)[:, None]
    y = decode(encoded(x, 48000, "FLAC", "PCM_24"), "audio/flac", 16000, 1, 16000)[:, 0]
    assert np.abs(y[1000:15000] - tone(1000, 16000, 1.0)[1000:15000]).max() < 1e-4


def test_mp3_round_trip_keeps_pitch_and_energy():
    x = tone(1000, 44100, 2.0)[:, None]
    y = decode(encoded(x, 44100, "MP3"), "audio/mpeg", 16000, 1, 10**6)[:, 0]
    # MP3 is lossy and its decoder adds priming samples: compare what a listener hears.
    assert abs(len(y) - 32000) < 2000
    inner = y[4000:20000]
    assert spectrum_peak(inner, 16000) == 1000
    assert abs(np.sqrt(np.mean(inner ** 2)) / (0.5 / np.sqrt(2)) - 1) < 0.05


def test_raw_pcm_22050_becomes_16000():
    x = np.round(tone(700, 22050, 1.0, 0.6) * 32767).astype("<i2")
    y = decode(x.tobytes(), "audio/pcm;rate=22050;channels=1", 16000, 1, 16000)
    assert y.shape == (pcm_frames(x.nbytes, 22050, 1, 16000), 1) == (16000, 1)
    assert np.array_equal(y, convert(22050, 16000, (x / np.float32(32768))[:, None].astype(np.float32)))
    assert np.abs(y[1000:15000, 0] - tone(700, 16000, 1.0, 0.6)[1000:15000]).max() < 1e-4


def test_raw_pcm_at_the_model_rate_keeps_every_sample():
    x = RNG.integers(-32768, 32768, (5000, 2)).astype("<i2")
    y = decode(x.tobytes(), "audio/pcm;rate=16000;channels=2", 16000, 2, 5000, block=777)
    assert np.array_equal(y * 32768, x.astype(np.float32))


def test_raw_pcm_channels_must_be_the_models():
    stereo = np.zeros((100, 2), "<i2").tobytes()
    message = rejects("channel_mismatch", 400, decode, stereo, "audio/pcm;rate=16000;channels=2", 16000, 1, 10**6)
    assert "channels=1" in message


def test_raw_pcm_partial_frames_reject():
    rejects("invalid_audio", 400, decode, b"\x00" * 7, "audio/pcm;rate=16000;channels=1", 16000, 1, 100)
    rejects("invalid_audio", 400, decode, b"\x00" * 6, "audio/pcm;rate=16000;channels=2", 16000, 2, 100)
    rejects("invalid_audio", 400, decode, b"", "audio/pcm;rate=16000;channels=1", 16000, 1, 100)
    rejects("invalid_pcm_geometry", 400, decode, b"\0\0", "audio/pcm;rate=16000", 16000, 1, 100)


def test_raw_pcm_longer_than_the_limit_rejects_before_decoding():
    pcm = np.zeros(22050, "<i2").tobytes()
    limit = pcm_frames(len(pcm), 22050, 1, 16000)
    assert len(decode(pcm, "audio/pcm;rate=22050;channels=1", 16000, 1, limit)) == limit
    message = rejects("audio_too_long", 400, decode, pcm, "audio/pcm;rate=22050;channels=1", 16000, 1, limit - 1)
    assert f"{(limit - 1) / 16000:g} s" in message


@pytest.mark.parametrize("data_size", [None, 0xFFFFFFFF])
def test_encoded_audio_longer_than_the_limit_rejects(data_size):
    """At the limit passes, one frame over rejects, whatever the header says the length is."""
    data = wav16(np.zeros(4410), 44100, 1, data_size)
    limit = out_frames(4410, 44100, 16000)
    assert len(decode(data, None, 16000, 1, limit, block=1000)) == limit
    rejects("audio_too_long", 400, decode, data, None, 16000, 1, limit - 1, block=1000)


def test_decoding_storage_stays_bounded_by_the_limit():
    data = wav16(np.zeros(16000 * 20), 16000, 1, 0xFFFFFFFF)   # 20 s claiming "to the end of the file"
    tracemalloc.start()
    try:
        rejects("audio_too_long", 400, decode, data, None, 16000, 1, 16000, block=4096)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The limit is 1 s (64 KB of float32): nothing near the 1.3 MB of the whole recording.
    assert peak < 16000 * 4 * 4 + 4096 * 4 * 4


def test_disabled_codec_rejects_with_its_own_code():
    data = encoded(STEREO, 44100, "FLAC", "PCM_16")
    message = rejects("audio_codec_disabled", 415, decode, data, None, 16000, 1, 10**6, codecs=("wav", "mp3"))
    assert "FLAC" in message and "WAV or MP3" in message
    assert "not accepted" in rejects("unsupported_audio", 415, decode, b"OggS" + b"\0" * 40, None, 16000, 1, 10**6,
                                     codecs=("wav",))
    raw = np.zeros(10, "<i2").tobytes()
    assert len(decode(raw, "audio/pcm;rate=16000;channels=1", 16000, 1, 10, codecs=())) == 10


def test_channel_layouts():
    stereo = np.stack([tone(300, 16000, 0.5), tone(900, 16000, 0.5, 0.25)], 1).astype(np.float32)
    y = decode(encoded(stereo, 16000, "WAV", "FLOAT"), None, 16000, 1, 10**6)
    assert np.array_equal(y[:, 0], stereo.mean(axis=1, dtype=np.float32))
    assert np.array_equal(decode(encoded(stereo, 16000, "WAV", "FLOAT"), None, 16000, 2, 10**6), stereo)
    three = np.zeros((100, 3), np.float32)
    assert "3 channels" in rejects("channel_mismatch", 400, decode, encoded(three, 16000, "WAV"), None, 16000, 2, 10**6)
    rejects("channel_mismatch", 400, decode, encoded(stereo[:, :1], 16000, "WAV"), None, 16000, 2, 10**6)


def test_broken_recordings_reject():
    rejects("invalid_audio", 400, decode, encoded(np.zeros((0, 1)), 16000, "WAV"), None, 16000, 1, 100)
    rejects("invalid_audio", 400, decode, b"RIFF\0\0\0\0WAVEjunkjunk", None, 16000, 1, 100)
    rejects("invalid_audio", 400, decode, wav16(np.zeros(100), 0, 1), None, 16000, 1, 100)
    rejects("invalid_audio", 400, decode, wav16(np.zeros(100), 2_000_000, 1), None, 16000, 1, 100)
    rejects("resample_budget", 400, decode, wav16(np.zeros(100), 16001, 1), None, 16000, 1, 100)
    nan = np.full((100, 1), np.nan, np.float32)
    rejects("invalid_audio", 400, decode, encoded(nan, 16000, "WAV", "FLOAT"), None, 16000, 1, 100)
    rejects("invalid_audio", 400, decode, b"fLaC" + b"\0" * 100, None, 16000, 1, 100)


# --- Fuzz -------------------------------------------------------------------------------

def decoded_or_refused(data, content_type=None):
    """decode() either returns the model's geometry or raises AudioError, nothing else."""
    try:
        y = decode(data, content_type, 16000, 1, 20000, block=512)
    except AudioError as e:
        assert e.code in STATUS and e.param == "file"
        return
    assert y.dtype == np.float32 and y.ndim == 2 and y.shape[1] == 1 and 0 < len(y) <= 20000


@given(st.binary(max_size=600))
@FUZZ
def test_decode_on_arbitrary_bytes(data):
    decoded_or_refused(data)


SMALL = tone(440, 8000, 0.1)[:, None].astype(np.float32)
VALID = [encoded(SMALL, 8000, "WAV", "PCM_16"), encoded(SMALL, 8000, "WAV", "FLOAT"),
         encoded(SMALL, 8000, "FLAC", "PCM_16"), encoded(tone(440, 8000, 0.3)[:, None], 8000, "MP3")]


@given(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=8),
       st.integers(0, 10**6))
@FUZZ
def test_decode_on_corrupted_and_truncated_files(data, changes, cut):
    data = bytearray(data)
    for position, value in changes:
        data[position % len(data)] = value
    decoded_or_refused(bytes(data[:max(0, len(data) - cut % (len(data) + 1))]))


@given(st.binary(max_size=400), st.integers(1, 50000), st.integers(1, 3))
@FUZZ
def test_decode_raw_pcm_on_arbitrary_bytes(data, rate, channels):
    decoded_or_refused(data, f"audio/pcm;rate={rate};channels={channels}")
