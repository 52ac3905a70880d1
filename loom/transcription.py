"""POST /v1/audio/transcriptions on a recognition deployment.

A finished recording arrives as multipart/form-data; audio.py turns its bytes
(WAV, FLAC, MP3, or raw PCM16LE with a declared geometry) into float samples
at the model's rate on the CPU executor, and the deployment's engine
transcribes it in windows, as openai/whisper's transcribe() does: a window of
audio is encoded once, the decoder writes timestamped text tokens, and the
next window starts at the last complete timestamp (or at the window's end).
The decoding rules (which tokens are suppressed, how timestamps pair) run on
the device in the package; this file owns the loop around them: windows,
prompts, temperature fallback, silence, segments.

The stage contract (kind recognition). Specs: RATE (samples per second),
MAX_FRAMES (the input-frame limit, in samples at RATE), FRAMES (mel frames
per window), CHUNK_IN (audio samples a chunk of FRAMES frames reads), N_MELS,
N_CTX (encoder positions per window), N_TEXT (decoder positions), V
(vocabulary), ROWS (decoding rows; the document's rows). Commands:

    spectrum(audio: buf, out: buf, S: int)
        S chunks of CHUNK_IN samples -> float32 [S, FRAMES, N_MELS] log10 mel energies
    encode(mel: buf, bounds: buf, offsets: buf, pos: buf, row_of: buf, pages: buf, S: int)
        S windows -> the cross-attention state of each window's row
    decode(ids: buf, pos: buf, cpos: buf, row_of: buf, pages: buf, picks: buf, ctl: buf,
           temps: buf, mask: buf, out: buf, T: int, P: int)
        T tokens of several rows -> float32 [P, 4] per picked position: the chosen
        token, its log-probability and the no-speech probability

The policy gives the geometry (sample_rate, channels, hop, window_frames,
frames_per_position, seconds_per_timestamp), the special tokens by name, and
Whisper's decoding settings (sample_len, max_prompt_tokens,
max_initial_timestamp, temperature_increment, and the compression-ratio,
log-probability and no-speech thresholds).

Each upload holds one decoding row from its first window to its last, so
uploads share encoder batches and decoding steps while keeping their own
sample clocks, token histories and transcripts. A client that leaves is
dropped at the next step boundary: until the step using its row retires, its
samples and row stay owned by that step.
"""

import collections
import math
import re
import zlib

import numpy as np

from . import audio, kinds
from .errors import Error, Problem
from .http import Response
from .runtime import run_stage
from .scheduler import CohortEngine

FIELDS = ("model", "file", "language", "prompt", "temperature", "response_format", "stream")
TEXT_FIELD_BYTES = 1 << 16
SPECTRUM_BATCH = 4      # chunks per spectrum step
ENCODE_BATCH = 2        # windows per encoder step
DECODE_TOKENS = 1024    # tokens per decoding step (a prompt is at most max_prompt_tokens + 4)
CTL = 16                # ints per picked position (select.cl)
# A decimal number as a form field writes one: no whitespace, underscores, inf or nan (which float() takes).
NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


# ---- the request ---------------------------------------------------------------

def _text(part):
    if part.filename is not None:
        raise Error(400, f"{part.name} must be a plain form field, not a file", "invalid_type", part.name)
    if len(part.data) > TEXT_FIELD_BYTES:
        raise Error(400, f"{part.name} is longer than {TEXT_FIELD_BYTES} bytes", "invalid_value", part.name)
    try:
        return part.data.decode("utf-8")
    except UnicodeDecodeError:
        raise Error(400, f"{part.name} is not valid UTF-8", "invalid_value", part.name) from None


def _content_type(part):
    for name, value in part.headers:
        if name.lower() == "content-type":
            return value
    return None


def read_fields(parts):
    """The form's fields by name: unknown and repeated fields reject, types are checked."""
    fields = {}
    for part in parts:
        if part.name not in FIELDS:
            raise Error(400, f"unknown field {part.name!r}; this endpoint takes {', '.join(FIELDS)}",
                        "unknown_field", part.name)
        if part.name in fields:
            raise Error(400, f"field {part.name!r} appears twice", "duplicate_field", part.name)
        fields[part.name] = part if part.name == "file" else _text(part)
    for name in ("model", "file"):
        if name not in fields:
            raise Error(400, f"missing required field {name!r}", "missing_field", name)
    if not fields["file"].data:
        raise Error(400, "file is empty", "invalid_value", "file")
    value = fields.get("temperature", "0")
    if not NUMBER.fullmatch(value):
        raise Error(400, f"temperature must be a decimal number, got {value[:40]!r}", "invalid_type", "temperature")
    temperature = float(value)
    if not math.isfinite(temperature) or not 0 <= temperature <= 1:
        raise Error(400, f"temperature must be from 0 through 1, got {value[:40]!r}", "out_of_range", "temperature")
    fields["temperature"] = temperature
    fmt = fields.setdefault("response_format", "json")
    if fmt not in ("json", "text"):
        raise Error(400, f"response_format must be 'json' or 'text', got {fmt!r}", "unsupported_value",
                    "response_format")
    if fields.get("stream", "false") != "false":
        raise Error(400, "stream must be omitted or false: this endpoint transcribes a finished upload",
                    "unsupported_value", "stream")
    for name in ("language", "prompt"):
        if name in fields and not fields[name]:
            raise Error(400, f"{name} must not be empty", "invalid_value", name)
    return fields


def create(server, request):
    fields = read_fields(request.form())
    reg = server.registry.admit(fields["model"], KIND)
    request.model = reg.name
    decoder = Decoder.of(reg.prepared)
    language = decoder.language(fields.get("language"))
    upload = fields["file"]
    ctype = _content_type(upload)
    try:
        geometry = audio.pcm_geometry(ctype)
        if geometry is not None:     # raw PCM is measured before it is admitted
            rate, channels = geometry
            if channels != decoder.channels:
                raise audio.AudioError(f"raw PCM declares {channels} channels; model {reg.name!r} takes "
                                       f"{decoder.channels} (channels={decoder.channels})", "channel_mismatch")
            frames = audio.pcm_frames(len(upload.data), rate, channels, decoder.rate)
            if frames > decoder.max_frames:
                raise audio.AudioError(f"the recording is {frames} frames ({frames / decoder.rate:.1f} s) at "
                                       f"{decoder.rate} Hz; model {reg.name!r} takes at most {decoder.max_frames} "
                                       f"({decoder.max_frames / decoder.rate:g} s)", "audio_too_long")
    except audio.AudioError as e:
        raise Error.of(e) from None
    job = Job(server, reg, request, upload.data, ctype, language, fields)
    server.registry.enter(reg, job)
    return job.deferred


class Job(kinds.Job):
    what = "transcription"

    def __init__(self, server, reg, request, data, ctype, language, fields):
        super().__init__(server, reg, request)
        self.data, self.ctype, self.language = data, ctype, language
        self.prompt = fields.get("prompt")
        self.temperature = fields["temperature"]
        self.format = fields["response_format"]

    def run(self):
        self.server.loop.run_in_executor(self._prepare, self.prepared_input)

    def _prepare(self):
        """On a worker: the upload's samples at the model's geometry, and the prompt's tokens."""
        decoder = Decoder.of(self.reg.prepared)
        samples = audio.decode(self.data, self.ctype, decoder.rate, decoder.channels, decoder.max_frames,
                               codecs=decoder.codecs)
        return samples[:, 0].copy(), decoder.prompt_tokens(self.prompt)

    def prepared_input(self, result, error):
        if error is None and not self.gone:
            samples, prompt = result
            self.data = None        # decoded: the upload's bytes are no longer needed
            self.engine.submit(Recording(self, Decoder.of(self.reg.prepared), samples, prompt))
        else:
            self.finish(error=error)

    def deliver(self, segments):
        texts = [text for text in segments if text.strip()]
        if self.format == "text":
            self.finish(Response(200, "\n".join(t.strip() for t in texts).encode(), "text/plain; charset=utf-8"))
        else:
            self.finish(Response.json({"text": "".join(texts).strip()}))


# ---- the package's decoding protocol ----------------------------------------------

class Decoder(kinds.Derived):
    """What the package's policy and tokenizer say about decoding, resolved once per prepared model."""

    def __init__(self, prepared):
        policy, tok = prepared.policy, prepared.tokenizer
        if tok is None:
            raise Problem("a recognition package needs the model's tokenizer (tokenizer.json beside the "
                          "checkpoint)", "no_tokenizer", quotes=False)
        self.tokenizer, self.policy = tok, policy
        self.rate, self.channels = policy["sample_rate"], policy["channels"]
        self.hop, self.window = policy["hop"], prepared.spec("FRAMES")
        self.chunk_in, self.n_mels = prepared.spec("CHUNK_IN"), prepared.spec("N_MELS")
        self.n_ctx, self.n_text, self.vocab = prepared.spec("N_CTX"), prepared.spec("N_TEXT"), prepared.spec("V")
        self.max_frames = prepared.spec("MAX_FRAMES")
        self.codecs = prepared.binding.options.get("audio_codecs", list(audio.CODECS))
        if not isinstance(self.codecs, list) or not set(self.codecs) <= set(audio.CODECS):
            raise Problem(f"option audio_codecs must be a list of {', '.join(audio.CODECS)}, got {self.codecs!r}",
                          "invalid_option", quotes=False)
        self.codecs = tuple(self.codecs)
        names = policy["tokens"]

        def token(name):
            for candidate in [name] if isinstance(name, str) else name:
                i = tok.token_to_id(candidate)
                if i is not None:
                    return i
            return None

        missing = [names[n] for n in ("eot", "sot", "prev", "no_timestamps", "transcribe", "translate")
                   if token(names[n]) is None]
        if missing:
            raise Problem(f"the tokenizer lacks the package's special tokens {', '.join(missing)}", "no_tokenizer")
        self.eot, self.sot, self.prev = token(names["eot"]), token(names["sot"]), token(names["prev"])
        self.no_speech = token(names["no_speech"])
        self.timestamp_begin = token(names["no_timestamps"]) + 1
        self.multilingual = self.vocab >= policy["english_only_below_vocab"]
        self.transcribe, self.translate = token(names["transcribe"]), token(names["translate"])
        self.language_format = names["language"]
        mask = np.zeros(self.vocab, np.uint8)
        meta = prepared.binding.metadata
        always = [token(n) for n in names["suppress"]] + [token(names["no_timestamps"])]
        always += list(meta.get(policy["suppress_ids"], ()))
        mask[[i for i in always if i is not None and 0 <= i < self.vocab]] |= 1
        first = [i for i in meta.get(policy["suppress_ids_begin"], ()) if 0 <= i < self.vocab]
        mask[first] |= 2
        self.mask = mask
        self.sample_len = policy["sample_len"]
        self.max_prompt = policy["max_prompt_tokens"]
        self.max_initial = round(policy["max_initial_timestamp"] / policy["seconds_per_timestamp"])
        self.input_stride = policy["frames_per_position"]
        self.time_per_frame = self.hop / self.rate

    def language(self, code):
        """The language token for a request's `language` (None: English on English-only
        models; detected from the first window on multilingual ones)."""
        if code is None:
            return None if self.multilingual else self.tokenizer.token_to_id(self.language_format.format("en"))
        token = self.tokenizer.token_to_id(self.language_format.format(code.lower()))
        if token is None or not self.sot < token < self.translate:
            raise Error(400, f"language {code!r} is not a language code this model knows (e.g. 'en', 'de')",
                        "unsupported_value", "language")
        if not self.multilingual and code.lower() != "en":
            raise Error(400, f"this model transcribes English only; language {code!r} is not available",
                        "unsupported_value", "language")
        return token

    def prompt_tokens(self, prompt):
        if prompt is None:
            return []
        ids = self.tokenizer.encode(" " + prompt.strip(), add_special=False, parse_special=False)
        if len(ids) > self.max_prompt:
            raise Error(400, f"prompt is {len(ids)} tokens; this model takes at most {self.max_prompt}",
                        "invalid_value", "prompt")
        return ids

    def sot_sequence(self, language):
        if not self.multilingual:
            return [self.sot]
        return [self.sot, language, self.transcribe]

    def text(self, tokens):
        return self.tokenizer.decode([t for t in tokens if t < self.eot])

    def temperatures(self, start):
        step = self.policy["temperature_increment"]
        return [start + step * i for i in range(int(round((1.0 - start) / step)) + 1)] if step else [start]


class Recording:
    """One upload's transcription: its samples, mel frames, windows and text, as whisper's
    transcribe() advances them. The engine asks what it needs next (needs) and hands it
    the results of each step."""

    def __init__(self, job, decoder, samples, prompt):
        self.job, self.d = job, decoder
        self.samples = samples
        self.content = len(samples) // decoder.hop          # mel frames of content
        frames = self.content + 2                           # the last frames that still see content
        self.chunks = -(-frames // decoder.window)
        self.next_chunk = 0
        self.mel = np.zeros((self.chunks * decoder.window + decoder.window, decoder.n_mels), np.float32)
        self.done_chunks = 0
        self.peak = None
        self.language = job.language
        self.seek = 0
        self.all_tokens = list(prompt)
        self.prompt_reset = 0
        self.segments = []
        self.row = None
        self.state = "spectrum" if self.content > 0 else "done"
        self.attempt = None

    # -- spectrum -------------------------------------------------------------------
    def chunk(self, c):
        """Audio of chunk c: the recording reflect-padded by N_FFT / 2 in front, zeros behind."""
        d, n = self.d, len(self.samples)
        half = (d.chunk_in - (d.window - 1) * d.hop) // 2
        out = np.zeros(d.chunk_in, np.float32)
        start = c * d.window * d.hop - half      # in the recording's own sample clock
        lo, hi = max(start, 0), min(start + d.chunk_in, n)
        if hi > lo:
            out[lo - start:hi - start] = self.samples[lo:hi]
        if start < 0:       # the reflection of samples 1..half, as torch.stft(center=True) pads
            k = min(-start, n - 1)
            out[-start - k:-start] = self.samples[1:k + 1][::-1]
        return out

    def spectrum_done(self, c, mel):
        d = self.d
        self.mel[c * d.window:(c + 1) * d.window] = mel
        self.done_chunks += 1
        if self.done_chunks == self.chunks:
            self.peak = float(self.mel[:self.chunks * d.window].max())
            self.start_window()

    # -- windows ----------------------------------------------------------------------
    def start_window(self):
        if self.seek >= self.content:
            self.state = "done"
            return
        self.segment_size = min(self.d.window, self.content - self.seek)
        self.state = "encode"
        self.temps = self.d.temperatures(self.job.temperature)

    def window_input(self):
        d = self.d
        mel = self.mel[self.seek:self.seek + d.window]
        return mel, (self.peak - 8.0, float(self.segment_size))

    def encoded(self):
        self.start_attempt(self.temps[0])

    def start_attempt(self, temperature):
        d = self.d
        if self.language is None:       # multilingual without a language: detect it first
            self.state = "decode"
            self.attempt = Attempt(self, [d.sot], temperature, detect=True)
            return
        context = self.all_tokens[self.prompt_reset:]
        prefix = [d.prev] + context[-d.max_prompt:] if context else []
        self.state = "decode"
        self.attempt = Attempt(self, prefix + d.sot_sequence(self.language), temperature, sot_index=len(prefix))

    def attempt_done(self, attempt):
        d = self.d
        if attempt.detect:
            self.language = attempt.sampled[0]
            self.start_attempt(attempt.temperature)
            return
        tokens = attempt.sampled[:-1] if attempt.sampled and attempt.sampled[-1] == d.eot else attempt.sampled
        text = d.text(tokens).encode()
        ratio = len(text) / len(zlib.compress(text)) if text else 0.0
        avg_logprob = attempt.logprob / (len(tokens) + 1)
        p = d.policy
        fallback = ratio > p["compression_ratio_threshold"] or avg_logprob < p["logprob_threshold"]
        if attempt.no_speech > p["no_speech_threshold"]:
            fallback = False
        later = [t for t in self.temps if t > attempt.temperature + 1e-9]
        if fallback and later:
            self.start_attempt(later[0])
            return
        silent = attempt.no_speech > p["no_speech_threshold"] and avg_logprob <= p["logprob_threshold"]
        if silent:
            self.seek += self.segment_size
        else:
            self.seek += self.split(tokens)
            if attempt.temperature > 0.5:
                self.prompt_reset = len(self.all_tokens)
        self.start_window()

    def split(self, tokens):
        """The window's tokens as segments (between consecutive timestamps); returns how
        many mel frames the window consumed."""
        d = self.d
        is_ts = [t >= d.timestamp_begin for t in tokens]
        single_ending = len(is_ts) >= 2 and is_ts[-2:] == [False, True]
        cuts = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
        if cuts:
            if single_ending:
                cuts.append(len(tokens))
            last = 0
            for cut in cuts:
                self.add_segment(tokens[last:cut])
                last = cut
            if single_ending:
                return self.segment_size
            return (tokens[last - 1] - d.timestamp_begin) * d.input_stride
        self.add_segment(tokens)
        return self.segment_size

    def add_segment(self, tokens):
        text = [t for t in tokens if t < self.d.eot]
        self.all_tokens += tokens
        if text:
            self.segments.append(self.d.text(text))


class Attempt:
    """Decoding one window at one temperature: the row's tokens fed so far and sampled."""

    def __init__(self, recording, prompt, temperature, sot_index=0, detect=False):
        self.recording, self.temperature, self.detect = recording, temperature, detect
        self.pending = list(prompt)     # tokens to feed next
        self.position = 0               # the row's next decoder position
        self.sot_index = sot_index
        self.sampled = []
        self.logprob = 0.0
        self.no_speech = 0.0
        self.first = True

    def feed(self):
        """The tokens to feed, their positions, and select.cl's controls for the last one."""
        d = self.recording.d
        tokens, start = self.pending, self.position
        ctl = np.zeros(CTL, np.int32)
        n = len(self.sampled)
        ts_sampled = [t for t in self.sampled if t >= d.timestamp_begin]
        ctl[:11] = (1 if self.detect else 0, n, self.sampled[-1] if n else -1, self.sampled[-2] if n > 1 else -1,
                    ts_sampled[-1] if ts_sampled else -1, d.timestamp_begin, d.eot,
                    d.no_speech if d.no_speech is not None else -1, d.max_initial, d.sot + 1, d.translate)
        ctl[11] = hash((self.recording.seek, round(self.temperature * 10))) & 0x7FFFFFFF
        ctl[12] = n
        return tokens, list(range(start, start + len(tokens))), ctl

    def picked(self, token, logprob, no_speech):
        """A step's result for this row; True when the attempt is over."""
        d = self.recording.d
        if self.first:
            self.no_speech = no_speech      # read at <|startoftranscript|> from the raw logits, as Whisper does
        self.first = False
        self.position += len(self.pending)
        if self.detect:
            self.sampled = [token]
            return True
        self.sampled.append(token)
        self.logprob += logprob
        if token == d.eot or len(self.sampled) >= d.sample_len or self.position >= d.n_text:
            return True
        self.pending = [token]
        return False


# ---- the engine -------------------------------------------------------------------

class Engine(CohortEngine):
    """Rows of uploads through three kinds of step: spectrum chunks, encoder windows and
    decoding tokens. A step of each kind that has work runs in turn, so a long upload's
    encoding never starves other rows' decoding for more than one step."""

    def __init__(self, prepared, loop):
        super().__init__(prepared, loop)
        self.rows = prepared.spec("ROWS")
        self.free_rows = list(range(self.rows))
        self.waiting = collections.deque()   # recordings without a row
        self.active = []                     # recordings holding a row
        self.turn = 0
        self.pages = np.arange(self.rows, dtype=np.int32)

    def submit(self, recording):
        if self.failed:
            recording.job.finish(error=Error(503, self.failed, "step_timeout"))
            return
        if recording.state == "done":
            recording.job.deliver([])
            return
        self.waiting.append(recording)
        self.kick()

    def backlog(self):
        return len(self.waiting)

    def stats(self):
        return dict(super().stats(), rows=self.rows, active=len(self.active), waiting=len(self.waiting))

    def _settle(self):
        """Finished and abandoned recordings give back their rows; waiting ones take them."""
        for rec in list(self.active):
            if rec.job.gone or rec.state == "done":
                self.active.remove(rec)
                self.free_rows.append(rec.row)
                if rec.job.gone:
                    rec.job.finish()
                else:
                    rec.job.deliver(rec.segments)
        while self.waiting and (self.waiting[0].job.gone or self.free_rows):
            rec = self.waiting.popleft()
            if rec.job.gone:
                rec.job.finish()
                continue
            rec.row = self.free_rows.pop(0)
            self.active.append(rec)

    def form(self):
        self._settle()
        kinds_ = (self._spectrum, self._encode, self._decode)
        for i in range(len(kinds_)):
            which = (self.turn + i) % len(kinds_)
            cohort = kinds_[which]()
            if cohort is not None:
                self.turn = which + 1
                self.requests += len({id(r) for r in cohort[1]})
                return cohort
        return None

    def _spectrum(self):
        work = []
        for rec in self.active:
            while rec.state == "spectrum" and rec.next_chunk < rec.chunks and len(work) < SPECTRUM_BATCH:
                work.append((rec, rec.next_chunk))
                rec.next_chunk += 1
        if not work:
            return None
        audio_in = np.concatenate([rec.chunk(c) for rec, c in work])
        return ("spectrum", [rec for rec, _ in work], work, {"S": len(work)}, {"audio": audio_in})

    def _encode(self):
        recs = [rec for rec in self.active if rec.state == "encode"][:ENCODE_BATCH]
        if not recs:
            return None
        d, S = recs[0].d, len(recs)
        mels, bounds = zip(*(rec.window_input() for rec in recs))
        inputs = {"mel": np.concatenate(mels), "bounds": np.array(bounds, np.float32).ravel(),
                  "offsets": (np.arange(S + 1) * d.n_ctx).astype(np.int32),
                  "pos": np.tile(np.arange(d.n_ctx, dtype=np.int32), S),
                  "row_of": np.repeat(np.array([rec.row for rec in recs], np.int32), d.n_ctx),
                  "pages": self.pages}
        for rec in recs:
            rec.state = "encoding"
        return ("encode", recs, None, {"S": S}, inputs)

    def _decode(self):
        recs, ids, pos, row_of, picks, ctls, temps = [], [], [], [], [], [], []
        for rec in self.active:
            if rec.state != "decode":
                continue
            tokens, positions, ctl = rec.attempt.feed()
            if recs and len(ids) + len(tokens) > DECODE_TOKENS:
                break
            recs.append(rec)
            rec.sot_pick = None
            if rec.attempt.first and rec.attempt.sot_index != len(tokens) - 1:
                rec.sot_pick = len(picks)      # the no-speech probability is read at sot
                picks.append(len(ids) + rec.attempt.sot_index)
                ctls.append(ctl)
                temps.append(0.0)
            ids += tokens
            pos += positions
            row_of += [rec.row] * len(tokens)
            rec.last_pick = len(picks)
            picks.append(len(ids) - 1)
            ctls.append(ctl)
            temps.append(rec.attempt.temperature)
            rec.state = "decoding"
        if not recs:
            return None
        d = recs[0].d
        inputs = {"ids": np.array(ids, np.int32), "pos": np.array(pos, np.int32),
                  "cpos": np.full(len(ids), d.n_ctx - 1, np.int32), "row_of": np.array(row_of, np.int32),
                  "pages": self.pages, "picks": np.array(picks, np.int32), "ctl": np.stack(ctls).ravel(),
                  "temps": np.array(temps, np.float32), "mask": d.mask}
        return ("decode", recs, None, {"T": len(ids), "P": len(picks)}, inputs)

    def launch(self, cohort, done):
        command, recs, _, geometry, inputs = cohort
        outputs = {}
        if command == "spectrum":
            d = recs[0].d
            outputs = {"out": (np.float32, geometry["S"] * d.window * d.n_mels)}
        elif command == "decode":
            outputs = {"out": (np.float32, geometry["P"] * 4)}
        run_stage(self.prepared, self.loop, command, geometry, inputs, outputs, done, on_submit=self.submitted)

    def abandon(self, cohort, error):
        super().abandon(cohort, error)
        for rec in list(self.active) + list(self.waiting):
            rec.job.finish(error=error)
        self.active.clear()
        self.waiting.clear()
        self.free_rows = list(range(self.rows))

    def apply(self, cohort, values, error):
        command, recs, work, _, _ = cohort
        if error is not None:
            for rec in {id(r): r for r in recs}.values():
                rec.job.finish(error=error)
                rec.state = "done"
            return
        if command == "spectrum":
            d = recs[0].d
            mel = values["out"].reshape(len(work), d.window, d.n_mels)
            for (rec, c), m in zip(work, mel):
                rec.spectrum_done(c, m)
        elif command == "encode":
            for rec in recs:
                rec.encoded()
        else:
            out = values["out"].reshape(-1, 4)
            for rec in recs:
                token, logprob = int(out[rec.last_pick, 0]), float(out[rec.last_pick, 1])
                no_speech = float(out[rec.last_pick if rec.sot_pick is None else rec.sot_pick, 2])
                rec.state = "decode"
                if rec.attempt.picked(token, logprob, no_speech):
                    rec.attempt_done(rec.attempt)


# ---- the kind -----------------------------------------------------------------------

class Recognition(kinds.Kind):
    name = "recognition"
    endpoint = "/v1/audio/transcriptions"
    routes = [("POST", "/v1/audio/transcriptions", create)]
    inputs, outputs = ["audio"], ["text"]
    probes = [("spectrum", {"S": 1}), ("encode", {"S": 1}), ("decode", {"T": 1, "P": 1})]

    def options(self, doc, options):
        options.setdefault("rows", doc["rows"])
        return options

    def check(self, prepared):
        Decoder.of(prepared)     # the policy's tokens resolve in the tokenizer

    def trial(self, binding, command, geometry):
        s = binding.specs
        rows = np.arange(s["ROWS"], dtype=np.int32)
        if command == "spectrum":
            return ({"audio": np.zeros(geometry["S"] * s["CHUNK_IN"], np.float32)},
                    {"out": (np.float32, geometry["S"] * s["FRAMES"] * s["N_MELS"])})
        if command == "encode":
            S, n = geometry["S"], s["N_CTX"]
            return ({"mel": np.zeros(S * s["FRAMES"] * s["N_MELS"], np.float32),
                     "bounds": np.tile(np.array([-1.0, 1.0], np.float32), S),
                     "offsets": (np.arange(S + 1) * n).astype(np.int32),
                     "pos": np.tile(np.arange(n, dtype=np.int32), S), "row_of": np.zeros(S * n, np.int32),
                     "pages": rows}, {})
        T, P = geometry["T"], geometry["P"]
        ctl = np.zeros((P, CTL), np.int32)
        ctl[:, 5] = s["V"]      # no timestamp rules
        return ({"ids": np.zeros(T, np.int32), "pos": np.arange(T, dtype=np.int32),
                 "cpos": np.full(T, s["N_CTX"] - 1, np.int32), "row_of": np.zeros(T, np.int32), "pages": rows,
                 "picks": np.arange(P, dtype=np.int32) % T, "ctl": ctl.ravel(), "temps": np.zeros(P, np.float32),
                 "mask": np.zeros(s["V"], np.uint8)}, {"out": (np.float32, P * 4)})

    def capability(self, reg):
        p = reg.prepared
        if p is None:
            return {}
        decoder = Decoder.of(p)
        return {"sample_rate": decoder.rate, "channels": decoder.channels,
                "max_input_seconds": decoder.max_frames / decoder.rate, "formats": list(decoder.codecs) + ["pcm"],
                "multilingual": decoder.multilingual}

    def start(self, reg, loop):
        return Engine(reg.prepared, loop)


KIND = Recognition()
