"""POST /v1/images/generations on an image deployment: a prompt in, one PNG out.

The host runs what is sequential and cheap: CLIP tokenization, the noise of the
request's seed, the Euler scheduler and classifier-free guidance. The device
runs the package's three stages (kind image), shared between requests by the
cohort engine:

    encode_text(ids, scales, context, S)        S prompts of SEQ ids -> context rows
    denoise(latents, t_emb, context, kv_offs, scales, eps, N, H, W)
                                                N latent images (two a request: the negative
                                                prompt's and the prompt's), each at its own
                                                timestep -> predicted noise
    decode(latents, image, N, H, W)             N final latents -> pixels in about [-1, 1]

(specs LATENT, C0 (the sinusoidal timestep width), SEQ, TEXT_D, NB (2^(NB-1)
divides the latent size), VNB (the VAE's upsampling: pixels = latents *
2^(VNB-1)), LORAS; the checkpoint's metadata holds the scheduler config and
the tokenizer folder). Requests of one size share denoising and decoding steps
whatever step each is at; each keeps its own seed, adapters and progress. A
size compiles on its first request, off the step loop, while other sizes go on;
at most `size_cache` sizes keep their plans (least recently used go). A client
that leaves is dropped at the next step boundary while the step it was in
retires. The PNG is encoded on the CPU executor; a native variant switch waits
until every image in progress has been encoded.

LoRA adapters are registered in the document (options.loras: id -> a
.safetensors file beside the checkpoint); lora.pack lays them out for the
kernels, which add each image's selected adapters as low-rank terms scaled
per image, so one batch holds any mix of selections.
"""

import base64
import collections
import math
import os
import re
import time

import numpy as np

from . import images, kinds, tokenizer
from .errors import Error, Problem
from .http import Response
from .jsonin import Arr, Int, Num, Obj, OneOf, Str
from .runtime import run_stage
from .scheduler import CohortEngine

PROMPT_CHARS = 4096
IMAGES_PER_STEP = 8         # latent images per denoising step (four requests with guidance)
REQUESTS_PER_TEXT = 8       # requests whose prompts one text-encoder step takes
DECODES_PER_STEP = 2        # images per VAE step: its activations are the widest of all
SIZE = re.compile(r"([1-9][0-9]{0,4})x([1-9][0-9]{0,4})")

SPEC = Obj({
    "model": Str(min_len=1),
    "prompt": Str(min_len=1, max_len=PROMPT_CHARS),
    "size": Str(min_len=1, max_len=16, optional=True),
    "seed": OneOf(Int(lo=0, hi=2**64 - 1), Str(min_len=1, max_len=20), optional=True),
    "n": Int(lo=1, hi=1 << 20, optional=True),
    "response_format": Str(optional=True),
    "loras": Arr(Obj({"id": Str(min_len=1, max_len=256), "scale": Num(optional=True)}), max_len=64, optional=True),
})

OPTIONS = {     # document options -> (type, check, default); width/height default to the model's own size
    "width": (int, lambda v: v >= 1, None), "height": (int, lambda v: v >= 1, None),
    "steps": (int, lambda v: 1 <= v <= 1000, 20), "guidance_scale": (float, lambda v: 0 <= v <= 100, 7.5),
    "negative_prompt": (str, lambda v: len(v) <= PROMPT_CHARS, ""),
    "max_pixels": (int, lambda v: v >= 1, 512 * 512), "size_cache": (int, lambda v: 1 <= v <= 64, 4),
}


def create(server, request):
    body = request.json(SPEC)
    if body.get("n", 1) != 1:
        raise Error(400, f"n must be 1 (one image a request), got {body['n']}", "unsupported_value", "n")
    fmt = body.get("response_format", "b64_json")
    if fmt != "b64_json":
        raise Error(400, f"response_format {fmt!r} is not available: only \"b64_json\" (images are never "
                         "stored for a URL)", "unsupported_value", "response_format")
    reg = server.registry.admit(body["model"], KIND)
    request.model = reg.name
    model = Model.of(reg.prepared)
    width, height = model.size(body.get("size"))
    scales = model.scales(body.get("loras") or [])
    job = Job(server, reg, request, body["prompt"], width, height, kinds.seed(body.get("seed")), scales)
    server.registry.enter(reg, job)
    return job.deferred


# -- the model ------------------------------------------------------------------

class Model(kinds.Derived):
    """What a prepared image deployment needs on the host, resolved once."""

    def __init__(self, prepared):
        meta, options = prepared.binding.metadata, prepared.binding.options
        folder = meta.get("tokenizer")
        if not isinstance(folder, str):
            raise Problem("an image package needs its tokenizer folder (tokenizer/ in the diffusers folder)",
                          "no_tokenizer", quotes=False)
        try:
            self.tokenizer = tokenizer.from_clip_files(folder)
        except (tokenizer.TokenizerError, OSError) as e:
            raise Problem(f"the tokenizer: {e}", "tokenizer") from None
        self.seq, self.latent = prepared.spec("SEQ"), prepared.spec("LATENT")
        self.c0, self.text_d = prepared.spec("C0"), prepared.spec("TEXT_D")
        self.up = 2 ** (prepared.spec("VNB") - 1)                    # pixels per latent
        self.multiple = self.up * 2 ** (prepared.spec("NB") - 1)     # every level's size stays whole
        self.loras = list(meta.get("loras") or [])
        self.scheduler = Scheduler((meta.get("config") or {}).get("scheduler") or {})
        sample = meta.get("config.unet.sample_size", 64)         # the latent size it was trained at
        self.width = options.get("width") or sample * self.up
        self.height = options.get("height") or sample * self.up
        self.steps, self.guidance = options["steps"], options["guidance_scale"]
        self.negative, self.max_pixels = options["negative_prompt"], options["max_pixels"]
        self.size_cache = options["size_cache"]
        if self.width % self.multiple or self.height % self.multiple:
            raise Problem(f"the default size {self.width}x{self.height} is not a multiple of {self.multiple}",
                          "invalid_option")

    def size(self, text):
        if text is None:
            return self.width, self.height
        m = SIZE.fullmatch(text)
        if m is None:
            raise Error(400, f"size must be WIDTHxHEIGHT (e.g. \"{self.width}x{self.height}\"), got {text!r}",
                        "invalid_value", "size")
        width, height = int(m.group(1)), int(m.group(2))
        if width % self.multiple or height % self.multiple:
            raise Error(400, f"size {text}: this model generates sizes that are multiples of {self.multiple} "
                             "on both sides (sizes are exact, never rounded)", "unsupported_value", "size")
        if width * height > self.max_pixels:
            raise Error(400, f"size {text} is {width * height} pixels; this deployment generates at most "
                             f"{self.max_pixels} (its max_pixels option)", "unsupported_value", "size")
        return width, height

    def scales(self, loras):
        """The request's adapter strengths, one per registered adapter (zero: not selected)."""
        scales = np.zeros(max(1, len(self.loras)), np.float32)
        seen = set()
        for i, entry in enumerate(loras):
            name, scale = entry["id"], entry.get("scale", 1.0)
            where = f"loras[{i}]"
            if name in seen:
                raise Error(400, f"adapter {name!r} is selected twice", "duplicate_value", f"{where}.id")
            seen.add(name)
            if name not in self.loras:
                known = ", ".join(self.loras) or "none are registered"
                raise Error(400, f"adapter {name!r} is not registered with this deployment ({known})",
                            "unsupported_value", f"{where}.id")
            if not math.isfinite(scale) or not math.isfinite(float(np.float32(scale))):
                raise Error(400, f"{where}.scale must be a finite 32-bit float", "invalid_value", f"{where}.scale")
            scales[self.loras.index(name)] = scale
        return scales

    def ids(self, text):
        """CLIP's framing: start, at most SEQ - 2 tokens, end, then padding to SEQ."""
        ids = self.tokenizer.encode(text, add_special=False)[:self.seq - 2]
        ids = [self.tokenizer.bos_id, *ids, self.tokenizer.eos_id]
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else self.tokenizer.eos_id
        return ids + [pad] * (self.seq - len(ids))

    def noise(self, seed, h, w):
        return noise(seed, h, w, self.latent)


def noise(seed, h, w, channels):
    """The seed's unit Gaussian latents [h, w, channels]: Box-Muller over PCG64's raw stream,
    so a seed gives the same noise on any machine and whatever shares the steps."""
    n = h * w * channels
    bits = np.random.PCG64(seed).random_raw(2 * ((n + 1) // 2))
    u = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53        # in (0, 1)
    r = np.sqrt(-2.0 * np.log(u[0::2]))
    z = np.concatenate([r * np.cos(2 * np.pi * u[1::2]), r * np.sin(2 * np.pi * u[1::2])])[:n]
    return z.astype(np.float32).reshape(channels, h, w).transpose(1, 2, 0).copy()


class Scheduler:
    """diffusers' EulerDiscreteScheduler (epsilon prediction, no noise churn), in float32."""

    def __init__(self, cfg):
        self.train = int(cfg.get("num_train_timesteps", 1000))
        self.spacing = cfg.get("timestep_spacing", "leading")
        self.offset = int(cfg.get("steps_offset", 0))
        b0, b1 = float(cfg.get("beta_start", 0.00085)), float(cfg.get("beta_end", 0.012))
        schedule = cfg.get("beta_schedule", "scaled_linear")
        if schedule == "scaled_linear":
            betas = np.linspace(b0 ** 0.5, b1 ** 0.5, self.train, dtype=np.float32) ** 2
        elif schedule == "linear":
            betas = np.linspace(b0, b1, self.train, dtype=np.float32)
        else:
            raise Problem(f"scheduler beta_schedule {schedule!r} is not supported", "unsupported_scheduler")
        if cfg.get("prediction_type", "epsilon") != "epsilon":
            raise Problem(f"prediction_type {cfg['prediction_type']!r} is not supported (epsilon only)",
                          "unsupported_scheduler")
        if self.spacing not in ("trailing", "leading", "linspace"):
            raise Problem(f"timestep_spacing {self.spacing!r} is not supported", "unsupported_scheduler")
        self.alphas = np.cumprod(np.float32(1.0) - betas, dtype=np.float32)

    def plan(self, steps):
        """(timesteps [steps], sigmas [steps + 1] ending at 0, the initial noise's sigma)."""
        n = self.train
        if self.spacing == "trailing":
            ts = np.round(np.arange(n, 0, -n / steps)).astype(np.float32) - 1
        elif self.spacing == "leading":
            ts = (np.arange(steps) * (n // steps)).round()[::-1].astype(np.float32) + self.offset
        else:
            ts = np.linspace(0, n - 1, steps, dtype=np.float32)[::-1]
        sigmas = np.interp(ts, np.arange(n), ((1 - self.alphas) / self.alphas) ** 0.5)
        sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
        top = float(sigmas.max())
        init = np.float32(top if self.spacing in ("linspace", "trailing") else (top ** 2 + 1) ** 0.5)
        return ts.copy(), sigmas, init


def timestep_embedding(t, dim):
    """diffusers' Timesteps(flip_sin_to_cos=True, freq_shift=0), as SD's UNet uses it."""
    half = dim // 2
    freqs = np.exp(-math.log(10000) * np.arange(half, dtype=np.float32) / np.float32(half)).astype(np.float32)
    args = np.float32(t) * freqs
    return np.pad(np.concatenate([np.cos(args), np.sin(args)]), (0, dim % 2)).astype(np.float32)


# -- a request ---------------------------------------------------------------------

class Job(kinds.Job):
    what = "image generation"

    def __init__(self, server, reg, request, prompt, width, height, seed, scales):
        super().__init__(server, reg, request)
        self.model = Model.of(reg.prepared)
        self.prompt, self.width, self.height, self.seed, self.scales = prompt, width, height, seed, scales
        self.h, self.w = height // self.model.up, width // self.model.up
        self.state = "tokenize"      # -> text -> denoise (step by step) -> decode -> encode -> done
        self.step = 0
        self.ids = self.context = self.latents = None

    @property
    def size(self):
        return self.h, self.w

    def run(self):
        self.server.loop.run_in_executor(self._tokenize, self.tokenized)

    def _tokenize(self):
        return [self.model.ids(self.model.negative), self.model.ids(self.prompt)]

    def tokenized(self, ids, error):
        if error is not None or self.gone:
            self.finish(error=error)
            return
        self.ids = ids
        m = self.model
        self.timesteps, self.sigmas, init = m.scheduler.plan(m.steps)
        self.latents = m.noise(self.seed, self.h, self.w) * init
        self.state = "text"
        self.engine.submit(self)

    def guided(self, eps_negative, eps_prompt):
        """Classifier-free guidance, then one Euler step."""
        m, i = self.model, self.step
        eps = eps_negative + np.float32(m.guidance) * (eps_prompt - eps_negative) if m.guidance > 1 else eps_prompt
        sigma, after = self.sigmas[i], self.sigmas[i + 1]
        x0 = self.latents - sigma * eps
        self.latents = (self.latents + (self.latents - x0) / sigma * (after - sigma)).astype(np.float32)
        self.step += 1

    def model_input(self):
        sigma = self.sigmas[self.step]
        return (self.latents / np.sqrt(sigma ** 2 + 1)).astype(np.float32)

    def decoded(self, pixels):
        self.state = "encode"
        rgb = np.round(np.clip(pixels * np.float32(0.5) + np.float32(0.5), 0.0, 1.0) * np.float32(255.0))
        self.server.loop.run_in_executor(images.encode_png, self.encoded, rgb.astype(np.uint8))

    def encoded(self, png, error):
        self.state = "done"
        if error is None and not self.gone:
            self.finish(Response.json({"created": int(time.time()),
                                       "data": [{"b64_json": base64.b64encode(png).decode("ascii")}]}))
        else:
            self.finish(error=error)
        self.engine.done(self)


# -- the engine ---------------------------------------------------------------------

class Engine(CohortEngine):
    """Images of every request through text, denoise and decode steps, taking turns.
    Denoising and decoding steps hold one size; a size is usable once its plans exist."""

    def __init__(self, prepared, loop):
        super().__init__(prepared, loop)
        self.model = Model.of(prepared)
        self.jobs = []
        self.turn = 0
        self.sizes = collections.OrderedDict()   # (h, w) -> "compiling" | "ready"
        self.compiles = 0
        self.switching = []       # variant switches waiting for the images in progress

    def submit(self, job):
        if self.failed:
            job.finish(error=Error(503, self.failed, "step_timeout"))
            return
        self.jobs.append(job)
        self._want(job.size)
        self.kick()

    def _want(self, size):
        """Plans for a size, built off the step loop the first time it is asked for."""
        if size in self.sizes:
            self.sizes.move_to_end(size)
            return
        self.sizes[size] = "compiling"
        self.compiles += 1
        h, w = size
        pending = [2]

        def built(plan, error):
            pending[0] -= 1
            if error is not None:
                self.sizes.pop(size, None)
                for job in [j for j in self.jobs if j.size == size]:
                    self.jobs.remove(job)
                    job.finish(error=error)
            elif pending[0] == 0 and size in self.sizes:
                self.sizes[size] = "ready"
                self._evict()
                self.kick()

        self.prepared.plan_async("denoise", {"N": 2, "H": h, "W": w}, built)
        self.prepared.plan_async("decode", {"N": 1, "H": h, "W": w}, built)

    def _evict(self):
        """Keep at most size_cache sizes' plans: the least recently used one no job needs goes."""
        while len(self.sizes) > self.model.size_cache:
            used = {job.size for job in self.jobs}
            victim = next((s for s in self.sizes if s not in used and self.sizes[s] == "ready"), None)
            if victim is None:
                return
            del self.sizes[victim]
            self.prepared.release_plans_where(lambda command, geometry: command in ("denoise", "decode")
                                              and (geometry.get("H"), geometry.get("W")) == victim)

    def backlog(self):
        return sum(1 for job in self.jobs if job.state == "text")

    def stats(self):
        states = collections.Counter(job.state for job in self.jobs)
        return dict(super().stats(), active=len(self.jobs), states=dict(states), compiles=self.compiles,
                    sizes=[f"{w * self.model.up}x{h * self.model.up}" for (h, w), s in self.sizes.items()
                           if s == "ready"],
                    size_cache=self.model.size_cache)

    def at_boundary(self, fn):
        """A variant switch waits for every image in progress to be encoded (PROFILES); images
        not yet started wait for it, then run on the new variant."""
        if not any(job.state not in ("text", "done") for job in self.jobs) and self.running is None:
            fn()
        else:
            self.switching.append(fn)

    def done(self, job):
        if job in self.jobs:
            self.jobs.remove(job)
        if self.switching and not any(j.state not in ("text", "done") for j in self.jobs):
            waiting, self.switching = self.switching, []
            for fn in waiting:
                super().at_boundary(fn)
        self.kick()

    def _settle(self):
        for job in list(self.jobs):
            if job.gone and job.state in ("text", "denoise", "decode"):
                self.done(job)
                job.finish()

    def form(self):
        self._settle()
        phases = ("text", "denoise", "decode")
        for i in range(len(phases)):
            phase = phases[(self.turn + i) % len(phases)]
            ready = [job for job in self.jobs if job.state == phase]
            if phase == "text":
                if self.switching:
                    continue        # a waiting switch: nothing new starts until it has happened
                work = ready[:REQUESTS_PER_TEXT]
            else:
                ready = [job for job in ready if self.sizes.get(job.size) == "ready"]
                size = ready[0].size if ready else None
                limit = IMAGES_PER_STEP // 2 if phase == "denoise" else DECODES_PER_STEP
                work = [job for job in ready if job.size == size][:limit]
            if work:
                self.turn = (self.turn + i + 1) % len(phases)
                self.requests += len(work)
                for job in work:
                    job.state += "-running"
                return phase, work
        return None

    def launch(self, cohort, done):
        phase, work = cohort
        m = self.model
        scales = np.stack([job.scales for job in work])
        if phase == "text":
            S = 2 * len(work)
            ids = np.array([ids for job in work for ids in job.ids], np.int32)
            inputs = {"ids": ids.ravel(), "scales": np.repeat(scales, 2, axis=0).ravel()}
            outputs = {"context": (np.float32, S * m.seq * m.text_d)}
            geometry = {"S": S}
            command = "encode_text"
        elif phase == "denoise":
            h, w = work[0].size
            N = 2 * len(work)
            latents = np.stack([x for job in work for x in (job.model_input(),) * 2])
            t_emb = np.stack([timestep_embedding(job.timesteps[job.step], m.c0) for job in work for _ in range(2)])
            context = np.concatenate([job.context for job in work])
            inputs = {"latents": latents.ravel(), "t_emb": t_emb.ravel(), "context": context.ravel(),
                      "kv_offs": (np.arange(N + 1) * m.seq).astype(np.int32),
                      "scales": np.repeat(scales, 2, axis=0).ravel()}
            outputs = {"eps": (np.float32, N * h * w * m.latent)}
            geometry = {"N": N, "H": h, "W": w}
            command = "denoise"
        else:
            h, w = work[0].size
            N = len(work)
            inputs = {"latents": np.stack([job.latents for job in work]).ravel()}
            outputs = {"image": (np.float32, N * h * w * m.up * m.up * 3)}
            geometry = {"N": N, "H": h, "W": w}
            command = "decode"
        run_stage(self.prepared, self.loop, command, geometry, inputs, outputs, done, on_submit=self.submitted)

    def abandon(self, cohort, error):
        super().abandon(cohort, error)
        for job in list(self.jobs):
            job.finish(error=error)
        self.jobs.clear()

    def apply(self, cohort, values, error):
        phase, work = cohort
        if error is not None:
            for job in work:
                self.done(job)
                job.finish(error=error)
            return
        m = self.model
        if phase == "text":
            context = values["context"].reshape(len(work), 2 * m.seq, m.text_d)
            for i, job in enumerate(work):
                job.context = context[i]
                job.state = "denoise"
                self._want(job.size)
        elif phase == "denoise":
            h, w = work[0].size
            eps = values["eps"].reshape(len(work), 2, h, w, m.latent)
            for i, job in enumerate(work):
                job.guided(eps[i, 0], eps[i, 1])
                job.state = "decode" if job.step == len(job.timesteps) else "denoise"
        else:
            h, w = work[0].size
            pixels = values["image"].reshape(len(work), h * m.up, w * m.up, 3)
            for i, job in enumerate(work):
                if job.gone:
                    self.done(job)
                    job.finish()
                else:
                    job.decoded(pixels[i])


# -- the kind --------------------------------------------------------------------------

class Image(kinds.Kind):
    name = "image"
    endpoint = "/v1/images/generations"
    routes = [("POST", "/v1/images/generations", create)]
    inputs, outputs = ["text"], ["image"]
    # The smallest latent size any SD-family package takes (2^(NB-1) for NB <= 4 levels).
    probes = [("encode_text", {"S": 2}), ("denoise", {"N": 2, "H": 8, "W": 8}), ("decode", {"N": 1, "H": 8, "W": 8})]

    def options(self, doc, options):
        out = dict(options)
        for name, (kind, check, default) in OPTIONS.items():
            value = options.get(name, default)
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if value is None:
                continue
            if type(value) is not kind or not check(value):
                raise Problem(f"option {name}={value!r} is not valid for an image deployment", "invalid_option",
                              quotes=False)
            out[name] = value
        loras = options.get("loras", {})
        if not isinstance(loras, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                                  for k, v in loras.items()):
            raise Problem("option loras must map adapter ids to .safetensors paths", "invalid_option", quotes=False)
        return out

    def _adapters(self, options, checkpoint_path):
        """(id, server path) of the document's LoRA adapters: absolute, or beside the checkpoint."""
        loras = options.get("loras") or {}
        folder = checkpoint_path if os.path.isdir(checkpoint_path) else os.path.dirname(checkpoint_path)
        entries = []
        for name, path in loras.items():
            if not os.path.isabs(path) and ".." in path.replace("\\", "/").split("/"):
                raise Problem(f"adapter {name!r}: {path!r} leaves the model's folder", "invalid_option", quotes=False)
            entries.append((name, path if os.path.isabs(path) else os.path.join(folder, path)))
        return entries

    def server_files(self, doc, checkpoint_path):
        loras = (doc.get("options") or {}).get("loras")
        if not isinstance(loras, dict) or not all(isinstance(v, str) for v in loras.values()):
            return []       # options() refuses it at preparation
        try:
            return [(f"options.loras.{name}", path) for name, path in self._adapters({"loras": loras}, checkpoint_path)]
        except Problem:
            return []       # an adapter leaving the model's folder: preparation refuses it by name

    def extend(self, doc, options, checkpoint_path):
        if not options.get("loras"):
            return None
        entries = self._adapters(options, checkpoint_path)
        from . import lora

        return lambda checkpoint: lora.pack(entries, {n: t.shape for n, t in checkpoint.tensors.items()})

    def trial(self, binding, command, geometry):
        s = binding.specs
        a = max(1, len(binding.metadata.get("loras") or []))
        if command == "encode_text":
            S = geometry["S"]
            return ({"ids": np.zeros(S * s["SEQ"], np.int32), "scales": np.zeros(S * a, np.float32)},
                    {"context": (np.float32, S * s["SEQ"] * s["TEXT_D"])})
        N, H, W = geometry["N"], geometry["H"], geometry["W"]
        if command == "denoise":
            return ({"latents": np.zeros(N * H * W * s["LATENT"], np.float32), "t_emb": np.zeros(N * s["C0"], np.float32),
                     "context": np.zeros(N * s["SEQ"] * s["TEXT_D"], np.float32),
                     "kv_offs": (np.arange(N + 1) * s["SEQ"]).astype(np.int32), "scales": np.zeros(N * a, np.float32)},
                    {"eps": (np.float32, N * H * W * s["LATENT"])})
        up = 2 ** (s["VNB"] - 1)
        return ({"latents": np.zeros(N * H * W * s["LATENT"], np.float32)}, {"image": (np.float32, N * H * W * up * up * 3)})

    def check(self, prepared):
        Model.of(prepared)

    def capability(self, reg):
        p = reg.prepared
        if p is None:
            return {}
        m = Model.of(p)
        return {"size": f"{m.width}x{m.height}", "size_multiple": m.multiple, "max_pixels": m.max_pixels,
                "steps": m.steps, "guidance_scale": m.guidance, "loras": list(m.loras), "format": "png"}

    def start(self, reg, loop):
        return Engine(reg.prepared, loop)


KIND = Image()
