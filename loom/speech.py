"""POST /v1/audio/speech on a speech deployment: text in, PCM16 at 24 kHz streamed out.

The input is split into sentences and phonemized on the CPU executor
(loom.phonemes, as Piper does), then each request's sentences go through the
package's three stages in order, sharing every step with the other requests
that are ready for it: `encode` (phoneme ids -> the encoder's stats and each
phoneme's duration in frames), `latents` (frames -> the flow's output) and
`vocode` (latent frames -> samples at the voice's rate). A sentence's samples
go through the request's resampler (audio.py: history kept from sentence to
sentence) to 24 kHz and out as soon as they exist, so audio starts after the
first sentence, not the whole input.

The decoder runs over windows of a sentence's latent frames, each widened by
the package's CONTEXT frames on both sides and cut back to its own samples,
which then equal a decode of the whole sentence: a request's first window is
short (FIRST_WINDOW frames, about a third of a second), so its audio starts
before its first sentence is vocoded; later ones are as long as a vocode step
allows (VOCODE_FRAMES with their context), so the context adds little work,
and they bound the decoder's memory per step.

The stage contract (kind speech): specs STATS (encoder stats per phoneme),
INTER (latent channels), HOP (samples per frame), CONTEXT (latent frames of
context a vocode window needs on each side); the checkpoint's metadata
"config" is the voice's Piper document (.onnx.json: sample rate, phoneme map,
espeak voice, inference noise and length scales). Commands:

    encode(ids, lengths, seeds, noise_w, length_scale, stats, durations, T, S)
    latents(stats, index, lengths, seeds, noise_scale, z, T, S)
    vocode(z, off0, off1, off2, off3, audio, T, S)

Every noise draw comes from the package's counter-based generator keyed by
the request's seed and the sentence's index, so a seed reproduces its
waveform whatever shares the steps. A request whose client reads slowly sits
out until its stream has credit; one that disconnects is dropped at the next
step boundary while the step it was part of retires.
"""

import collections

import numpy as np

from . import audio, kinds, phonemes
from .errors import Error, Problem
from .http import Stream
from .jsonin import Int, Num, Obj, OneOf, Str
from .runtime import run_stage
from .scheduler import CohortEngine

OUTPUT_RATE = 24000
PCM_TYPE = f"audio/pcm;rate={OUTPUT_RATE};channels=1"
INPUT_CHARS = 4096
SENTENCE_IDS = 1024        # phoneme ids per sentence (a longer one is refused, never cut)
SENTENCE_FRAMES = 65536    # latent frames per sentence (12 min at 22050 Hz): the flow's int32 indexing stays exact
BATCH = 8                  # sentences per step
FIRST_WINDOW = 32          # latent frames of a request's first vocode window (0.37 s at 22050 Hz, hop 256)
VOCODE_FRAMES = 320        # latent frames (context included) per vocode step: its activations stay in cache
ENCODED_FORMATS = ("mp3", "opus", "aac", "flac", "wav")

SPEC = Obj({
    "model": Str(min_len=1),
    "input": Str(min_len=1, max_len=INPUT_CHARS),
    "voice": OneOf(Str(min_len=1, max_len=256), Obj({"id": Str(min_len=1, max_len=256)})),
    "response_format": Str(),
    "instructions": Str(optional=True),
    "speed": Num(lo=0.25, hi=4.0, optional=True),
    "seed": OneOf(Int(lo=0, hi=2**64 - 1), Str(min_len=1, max_len=20), optional=True),
    "stream_format": Str(optional=True),
})


def create(server, request):
    body = request.json(SPEC)
    fmt = body["response_format"]
    if fmt != "pcm":
        why = "encoded formats are not produced" if fmt in ENCODED_FORMATS else "unknown format"
        raise Error(400, f"response_format {fmt!r}: {why}; this endpoint streams raw PCM (\"pcm\")",
                    "unsupported_value", "response_format")
    if body.get("stream_format", "audio") != "audio":
        raise Error(400, f"stream_format {body['stream_format']!r} is not available: only \"audio\" (raw PCM)",
                    "unsupported_value", "stream_format")
    reg = server.registry.admit(body["model"], KIND)
    request.model = reg.name
    voice = Voice.of(reg.prepared)
    name = body["voice"]["id"] if isinstance(body["voice"], dict) else body["voice"]
    if name not in voice.voices:
        raise Error(400, f"voice {name!r} is not a voice of {reg.name!r}: {', '.join(sorted(voice.voices))}",
                    "unsupported_value", "voice")
    if body.get("instructions"):
        raise Error(400, "this voice cannot follow instructions", "unsupported_value", "instructions")
    job = Job(server, reg, request, body["input"], kinds.seed(body.get("seed")), body.get("speed", 1.0))
    server.registry.enter(reg, job)
    return job.deferred


class Voice(kinds.Derived):
    """The voice's Piper document, resolved once per prepared deployment."""

    def __init__(self, prepared):
        config = prepared.binding.metadata.get("config")
        if not isinstance(config, dict) or "phoneme_id_map" not in config:
            raise Problem("a speech package needs the voice's Piper document (<voice>.onnx.json beside it)",
                          "no_voice_config", quotes=False)
        self.config = config
        self.rate = int(config.get("audio", {}).get("sample_rate", 22050))
        inference = config.get("inference", {})
        self.noise_scale = float(inference.get("noise_scale", 0.667))
        self.length_scale = float(inference.get("length_scale", 1.0))
        self.noise_w = float(inference.get("noise_w", 0.8))
        declared = prepared.binding.options.get("voices")
        self.voices = dict(declared) if isinstance(declared, dict) else (
            dict(config.get("speaker_id_map") or {}) or {"default": 0})
        self.hop, self.stats, self.inter = prepared.spec("HOP"), prepared.spec("STATS"), prepared.spec("INTER")
        self.context = prepared.spec("CONTEXT")
        if not 0 <= self.context < VOCODE_FRAMES // 4:
            raise Problem(f"CONTEXT {self.context}: a vocode window's context must be 0 to {VOCODE_FRAMES // 4 - 1} "
                          "latent frames a side", "contract")


class Job(kinds.Job):
    what = "speech"

    def __init__(self, server, reg, request, text, seed, speed):
        super().__init__(server, reg, request)
        self.text, self.seed, self.speed = text, seed, speed
        self.voice = Voice.of(reg.prepared)
        self.sentences = []
        self.next = 0               # the sentence the engine works on
        self.stream = None
        self.audible = False        # some of its audio has gone out
        self.resampler = audio.Resampler(self.voice.rate, OUTPUT_RATE, 1)

    def run(self):
        self.server.loop.run_in_executor(self._phonemize, self.phonemized)

    def _phonemize(self):
        sentences = phonemes.text_to_ids(self.text, self.voice.config, max_chars=INPUT_CHARS)
        for i, ids in enumerate(sentences):
            if len(ids) > SENTENCE_IDS:
                raise Error(400, f"sentence {i + 1} of the input is {len(ids)} phonemes long; at most "
                                 f"{SENTENCE_IDS} per sentence", "invalid_value", "input")
        return sentences

    def phonemized(self, sentences, error):
        if error is not None or self.gone:
            self.finish(error=error)
            return
        self.sentences = sentences
        self.stream = Stream(content_type=PCM_TYPE)
        self.stream.on_close = lambda reason: self.cancelled()
        self.stream.on_ready = self.engine.kick
        self.deferred.resolve(self.stream)
        self.engine.submit(self)

    def seeds(self, i):
        """The noise seed of sentence i: the request's seed moved along by the sentence index."""
        s = (self.seed + i * 0x9E3779B97F4A7C15) % 2**64
        return [s & 0xFFFFFFFF, s >> 32]

    def finish(self, response=None, error=None):
        if error is not None and self.stream is not None and not self.gone:
            # The PCM stream has begun: it cannot carry an error envelope, so it ends early.
            self.stream.finish()
            self.gone = True
        super().finish(response, error)

    def emit(self, samples, last):
        out = self.resampler.feed(samples[:, None])
        if last:
            out = np.concatenate([out, self.resampler.flush()])
        pcm = np.clip(np.round(out[:, 0] * 32767.0), -32768, 32767).astype("<i2").tobytes()
        self.stream.send(pcm)
        self.audible = True
        if last:
            self.stream.finish()
            self.finish()


def windows(frames, first, context):
    """The vocode windows [a, b) of a sentence of `frames` latent frames; `first`: it opens its request.

    After the short first window, the rest goes in the fewest even windows whose frames
    with their context fit a vocode step: each frame of context is decoded twice, and a
    short last window runs below a long one's rate."""
    start = FIRST_WINDOW if first and frames > FIRST_WINDOW else 0
    rest, n = frames - start, 1
    while True:
        cuts = [0] * (start > 0) + [start + rest * i // n for i in range(n + 1)]
        spans = list(zip(cuts, cuts[1:]))
        if all(min(frames, b + context) - max(0, a - context) <= VOCODE_FRAMES for a, b in spans[start > 0:]):
            return spans
        n += 1


class Sentence:
    """One sentence of a request on its way through the stages."""

    def __init__(self, job, index):
        self.job, self.index = job, index
        self.ids = job.sentences[index]
        self.state = "encode"
        self.stats = self.durations = self.z = None
        self.windows, self.window = [], 0        # vocode windows [a, b) and the next one

    def span(self):
        """The next window [a, b) and the frames [lo, hi) it is decoded from (its context)."""
        a, b = self.windows[self.window]
        context = self.job.voice.context
        return a, b, max(0, a - context), min(len(self.z), b + context)


class Engine(CohortEngine):
    """Sentences of every request through encode, latents and vocode steps, taking turns."""

    def __init__(self, prepared, loop):
        super().__init__(prepared, loop)
        self.jobs = collections.deque()
        self.turn = 0

    def submit(self, job):
        if self.failed:
            job.finish(error=Error(503, self.failed, "step_timeout"))
            return
        if not job.sentences:
            job.emit(np.zeros(0, np.float32), True)
            return
        job.current = Sentence(job, 0)
        self.jobs.append(job)
        self.kick()

    def backlog(self):
        """Requests that have not had a step yet: what pending_capacity bounds."""
        return sum(1 for job in self.jobs if job.current.index == 0 and job.current.state == "encode")

    def stats(self):
        return dict(super().stats(), active=len(self.jobs))

    def _settle(self):
        for job in list(self.jobs):
            if job.gone or job.finished:
                self.jobs.remove(job)
                job.finish()

    def form(self):
        self._settle()
        phases = ("encode", "latents", "vocode")
        for i in range(len(phases)):
            phase = phases[(self.turn + i) % len(phases)]
            work = [job.current for job in self.jobs if job.current.state == phase and job.stream.ready]
            if phase == "vocode":
                # requests still waiting for their first audio go first: their short first
                # windows share a step instead of queueing behind other requests' long ones
                work = self._within_budget(sorted(work, key=lambda s: s.job.audible))
            work = work[:BATCH]
            if work:
                self.turn = (self.turn + i + 1) % len(phases)
                self.requests += len(work)
                for s in work:
                    s.state = phase + "-running"
                return phase, work
        return None

    @staticmethod
    def _within_budget(work):
        """The first windows whose frames fit one vocode step (always at least one)."""
        total = 0
        for i, s in enumerate(work):
            _, _, lo, hi = s.span()
            total += hi - lo
            if i and total > VOCODE_FRAMES:
                return work[:i]
        return work

    def launch(self, cohort, done):
        phase, work = cohort
        voice = work[0].job.voice
        S = len(work)
        seeds = np.array([s.job.seeds(s.index) for s in work], np.uint32).ravel()
        if phase == "encode":
            T = max(len(s.ids) for s in work)
            ids = np.zeros((S, T), np.int32)
            for i, s in enumerate(work):
                ids[i, :len(s.ids)] = s.ids
            inputs = {"ids": ids.ravel(), "lengths": np.array([len(s.ids) for s in work], np.int32), "seeds": seeds,
                      "noise_w": np.full(S, voice.noise_w, np.float32),
                      "length_scale": np.array([voice.length_scale / s.job.speed for s in work], np.float32)}
            outputs = {"stats": (np.float32, S * T * voice.stats), "durations": (np.float32, S * T)}
            geometry = {"T": T, "S": S}
        elif phase == "latents":
            T = max(len(s.ids) for s in work)
            F = max(int(s.durations.sum()) for s in work)
            stats = np.zeros((S, T, voice.stats), np.float32)
            index = np.full((S, F), -1, np.int32)
            frames = np.zeros(S, np.int32)
            for i, s in enumerate(work):
                stats[i, :len(s.ids)] = s.stats
                rows = np.repeat(np.arange(len(s.ids)) + i * T, s.durations.astype(np.int64))
                index[i, :len(rows)], frames[i] = rows, len(rows)
            inputs = {"stats": stats.ravel(), "index": index.ravel(), "lengths": frames, "seeds": seeds,
                      "noise_scale": np.full(S, voice.noise_scale, np.float32)}
            outputs = {"z": (np.float32, S * F * voice.inter)}
            geometry = {"T": F, "S": S}
        else:
            spans = [s.span() for s in work]
            off = np.concatenate([[0], np.cumsum([hi - lo for _, _, lo, hi in spans])]).astype(np.int32)
            z = np.concatenate([s.z[lo:hi] for s, (_, _, lo, hi) in zip(work, spans)])
            inputs = {"z": z.ravel(), "off0": off, "off1": off * 8,
                      "off2": off * 64, "off3": off * 256}
            outputs = {"audio": (np.float32, int(off[-1]) * voice.hop)}
            geometry = {"T": int(off[-1]), "S": S}
        run_stage(self.prepared, self.loop, phase, geometry, inputs, outputs, done, on_submit=self.submitted)

    def abandon(self, cohort, error):
        super().abandon(cohort, error)
        for job in list(self.jobs):
            job.finish(error=error)
        self.jobs.clear()

    def apply(self, cohort, values, error):
        phase, work = cohort
        if error is not None:
            for s in work:
                s.job.finish(error=error)
            return
        voice = work[0].job.voice
        if phase == "encode":
            T = max(len(s.ids) for s in work)
            stats = values["stats"].reshape(len(work), T, voice.stats)
            durations = values["durations"].reshape(len(work), T)
            for i, s in enumerate(work):
                s.stats, s.durations = stats[i, :len(s.ids)], durations[i, :len(s.ids)]
                frames = int(s.durations.sum())
                if frames > SENTENCE_FRAMES:     # the voice's durations at this speed: refused, never cut
                    s.job.finish(error=Error(400, f"sentence {s.index + 1} of the input would last {frames} frames; "
                                                  f"at most {SENTENCE_FRAMES} per sentence (a lower speed or a "
                                                  "shorter sentence)", "invalid_value", "input"))
                    continue
                s.state = "latents"
        elif phase == "latents":
            F = max(int(s.durations.sum()) for s in work)
            z = values["z"].reshape(len(work), F, voice.inter)
            for i, s in enumerate(work):
                s.z = z[i, :int(s.durations.sum())]
                s.windows = windows(len(s.z), s.index == 0, voice.context)
                s.state = "vocode"
        else:
            samples = values["audio"]
            at = 0
            for s in work:
                a, b, lo, hi = s.span()
                job = s.job
                s.window += 1
                last_window = s.window == len(s.windows)
                last = last_window and s.index + 1 == len(job.sentences)
                if not job.gone:
                    job.emit(samples[at + (a - lo) * voice.hop:at + (b - lo) * voice.hop], last)
                    if last_window and not last:
                        job.current = Sentence(job, s.index + 1)
                    elif not last_window:
                        s.state = "vocode"
                at += (hi - lo) * voice.hop


class Speech(kinds.Kind):
    name = "speech"
    endpoint = "/v1/audio/speech"
    routes = [("POST", "/v1/audio/speech", create)]
    inputs, outputs = ["text"], ["audio"]
    probes = [("encode", {"T": 1, "S": 1}), ("latents", {"T": 1, "S": 1}), ("vocode", {"T": 1, "S": 1})]

    def trial(self, binding, command, geometry):
        s, T, S = binding.specs, geometry["T"], geometry["S"]
        seeds = np.zeros(2 * S, np.uint32)
        if command == "encode":
            return ({"ids": np.zeros(S * T, np.int32), "lengths": np.full(S, T, np.int32), "seeds": seeds,
                     "noise_w": np.zeros(S, np.float32), "length_scale": np.ones(S, np.float32)},
                    {"stats": (np.float32, S * T * s["STATS"]), "durations": (np.float32, S * T)})
        if command == "latents":
            return ({"stats": np.zeros(S * T * s["STATS"], np.float32), "index": np.arange(S * T, dtype=np.int32),
                     "lengths": np.full(S, T, np.int32), "seeds": seeds, "noise_scale": np.zeros(S, np.float32)},
                    {"z": (np.float32, S * T * s["INTER"])})
        off = (np.arange(S + 1) * T).astype(np.int32)
        return ({"z": np.zeros(S * T * s["INTER"], np.float32), "off0": off, "off1": off * 8, "off2": off * 64,
                 "off3": off * 256}, {"audio": (np.float32, S * T * s["HOP"])})

    def check(self, prepared):
        Voice.of(prepared)

    def capability(self, reg):
        p = reg.prepared
        if p is None:
            return {}
        voice = Voice.of(p)
        return {"voices": sorted(voice.voices), "sample_rate": OUTPUT_RATE, "channels": 1, "format": "pcm",
                "voice_sample_rate": voice.rate}

    def start(self, reg, loop):
        return Engine(reg.prepared, loop)


KIND = Speech()
