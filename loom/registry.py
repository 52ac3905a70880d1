"""Registrations: model documents, background preparation, admission, and the status view.

A registration starts from a model document (DESIGN.md "Model documents and
packages"), validated strictly. Preparation (reading sources, binding the
checkpoint, uploading weights) runs on the CPU executor and reports progress;
the loop never blocks on it. Phases: preparing -> ready | failed. Prepared
deployments are what /v1/models lists and what inference endpoints admit to.
"""

import logging
import os
import re
import threading
import time

from . import jsonin, packages, runtime
from .device import OutOfDeviceMemory
from .http import Deferred, HTTPError, Response
from .jsonin import Arr, Bool, Enum, Int, Obj, Str

log = logging.getLogger("loom.registry")

KINDS = ("text", "sequence", "embedding", "decision", "image", "speech", "recognition")
ENDPOINTS = {"text": "/v1/chat/completions", "sequence": "/v1/sequences", "embedding": "/v1/embeddings",
             "decision": "/v1/systemone", "image": "/v1/images/generations", "speech": "/v1/audio/speech",
             "recognition": "/v1/audio/transcriptions"}
MODALITIES = {"text": (["text"], ["text"]), "sequence": (["tokens"], ["tensor"]),
              "embedding": (["text", "tokens"], ["embedding"]), "decision": (["text"], ["probabilities"]),
              "image": (["text"], ["image"]), "speech": (["text"], ["audio"]), "recognition": (["audio"], ["text"])}
# The kinds this build serves; the others are known names whose services are not built yet,
# and a document naming one rejects rather than becoming "ready" behind routes that 404.
SERVED_KINDS = ("text", "sequence", "embedding", "decision")
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _name_rule(value):
    if not NAME.fullmatch(value):
        return "must be 1-64 ASCII letters, digits, '_', '.' or '-'"
    return None


def _capacity(hi):
    return Int(lo=0, hi=hi, optional=True)


DOCUMENT = Obj({
    "model": Str(check=_name_rule),
    "kind": Enum(KINDS),
    "sources": Arr(Str(min_len=1, max_len=4096), min_len=1, max_len=64),
    "checkpoint": Str(min_len=1, max_len=4096),
    "base_directory": Str(min_len=1, max_len=4096, optional=True),
    "prepare": Str(min_len=1, max_len=4096, optional=True),
    "control": Str(min_len=1, max_len=4096, optional=True),
    "admission": Enum(["open", "drained"], optional=True),
    "rows": Int(lo=1, hi=1024, optional=True),
    "context_length": Int(lo=1, hi=1 << 20, optional=True),
    "max_output_tokens": Int(lo=1, hi=16384, optional=True),
    "pending_capacity": _capacity(1 << 16),
    "session_cache_capacity": _capacity(1 << 16),
    "prefix_cache_capacity": _capacity(1 << 16),
    "checkpoint_capacity": _capacity(1 << 16),
    "checkpoint_backing": Enum(["fixed", "elastic"], optional=True),
    "variant_capacity": _capacity(1 << 10),
    "options": Obj(None, optional=True),
})

DEFAULTS = {"admission": "open", "rows": 4, "context_length": 4096, "max_output_tokens": 512,
            "pending_capacity": 32, "session_cache_capacity": 0, "prefix_cache_capacity": 0,
            "checkpoint_capacity": 0, "checkpoint_backing": "fixed", "variant_capacity": 0}


class Registration:
    def __init__(self, doc, base_directory):
        self.doc = dict(DEFAULTS, **doc)
        self.name = doc["model"]
        self.kind = doc["kind"]
        self.base_directory = base_directory
        self.created = int(time.time())
        self.phase = "preparing"
        self.progress = {"bytes_done": 0, "bytes_total": 0}
        self.error = None
        self.admission = self.doc["admission"]
        self.prepared = None
        self.in_flight = 0          # jobs holding resident parameters (see acquire)
        self.from_catalog = False
        # Residency: parameters can leave the device (deactivate, memory pressure)
        # and stream back on demand. The lock orders in_flight against eviction,
        # which may run on a preparation thread.
        self.lock = threading.Lock()
        self.pinned = False
        self.last_used = time.monotonic()
        self.restoring = None       # callbacks waiting for parameters to return
        # Admission: jobs waiting at the gate (drained, FIFO) and jobs admitted.
        self.waiting = []
        self.jobs = set()
        self.removing = None        # "drain" | "abort" once unregistered
        self.deactivate_when_idle = False
        self.readers = set()        # Deferreds waiting for a staged variant's compilation
        self.batcher = None         # the kind's cohort former, created on first use
        self.engine = None          # text: the continuous-batching engine, created on first use
        self.package = None         # an uploaded source package, retained until the model retires
        self.loaded = []            # its members this registration's sources name: (path, bytes)

    def paths(self):
        """(server source paths, checkpoint path); uploaded members are in self.loaded."""
        base = self.base_directory
        if self.package is not None:
            sources = [s for s in self.doc["sources"] if os.path.isabs(s)]
        else:
            sources = [runtime.resolve(base, s) for s in self.doc["sources"]]
        return sources, runtime.resolve(base, self.doc["checkpoint"])

    def components(self):
        """Residency components: the primary computation, plus an image-input
        component for text deployments whose package declares one."""
        policy = self.prepared.policy if self.prepared else {}
        return ("primary", "image") if self.kind == "text" and policy.get("image_input") else ("primary",)

    def capability(self):
        p = self.prepared
        loom = {"kind": self.kind, "endpoint": ENDPOINTS[self.kind],
                "tokenize": bool(p is not None and p.tokenizer is not None), "admission": self.admission}
        if self.kind in ("text", "sequence"):
            loom["context_length"] = self.doc["context_length"]
            loom["limits"] = {"max_output_tokens": self.doc["max_output_tokens"]}
            loom["retained"] = {k: self.doc[k] for k in ("session_cache_capacity", "prefix_cache_capacity",
                                                         "checkpoint_capacity", "checkpoint_backing")}
        if self.kind == "sequence" and p is not None:
            loom["sequence_bytes_per_token"] = p.spec("SEQUENCE_BYTES")
        if self.kind == "text":
            loom["input_tokens"] = bool(p is not None and p.tokenizer is not None and p.policy.get("chats"))
        if p is not None and p.variants:
            loom["variants"] = {"selected": p.selected, "count": len(p.variants)}
        if self.kind == "embedding" and p is not None:
            from .embeddings import supported_widths
            loom["dimensions"] = p.spec("DIM")
            loom["supported_dimensions"] = supported_widths(p)
            loom["max_input_tokens"] = p.spec("MAX_TOKENS")
        inputs, outputs = MODALITIES[self.kind]
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "local",
                "input_modalities": inputs, "output_modalities": outputs, "loom": loom}

    def status(self):
        p = self.prepared
        return {
            "model": self.name, "kind": self.kind, "phase": self.phase, "created": self.created,
            "progress": dict(self.progress), "error": self.error, "admission": self.admission,
            "requests": {"in_flight": len(self.jobs), "waiting": len(self.waiting),
                         "pending_capacity": self.doc["pending_capacity"]},
            "resources": {"param_bytes": p.param_bytes() if p else 0, "plans": len(p.plans) if p else 0,
                          "resident": bool(p and p.resident), "pinned": self.pinned},
            "variants": {"selected": p.selected, "count": len(p.variants)} if p is not None and p.variants else None,
            "batching": ({"cohorts": self.batcher.cohorts, "requests": self.batcher.requests}
                         if getattr(self, "batcher", None) is not None else None),
            "scheduler": self.engine.stats() if getattr(self, "engine", None) is not None else None,
        }


class Registry:
    """All registrations of one server, and the device they share."""

    def __init__(self, server):
        self.server = server
        self.registrations = {}
        self.device = None      # opened by open_device() at start
        self.compiler = None
        self.catalog_pending = None     # start-up catalog registrations not yet ready or failed
        # One preparation at a time: uploads are bound by memory bandwidth anyway,
        # and a finished model is evictable while the next one loads.
        self.to_prepare = []
        self.preparing = None

    # -- device --------------------------------------------------------------
    def open_device(self):
        """Probe every OpenCL device and open the chosen one, before any registration
        prepares. Raises device.NoUsableDevice (a ValueError: start fails, exit 2)."""
        from .compiler import Compiler
        from .device import Device
        cfg = self.server.config
        self.device = Device(cfg.device, cfg.memory_bytes)
        loop = self.server.loop
        self.compiler = Compiler(self.device, lambda fn, done: loop.run_in_executor(fn, done))
        self.device.pool.set_evictor(self._evict_for)
        self.device.metrics(self.server.metrics)
        self.compiler.metrics(self.server.metrics)
        self._retained_metrics(self.server.metrics)
        log.info("device: %s", self.device.describe(),
                 extra={"event": "device", "device": self.device.info["name"], "type": self.device.info["type"],
                        "driver": self.device.info["platform_name"]})
        return self.device

    def _retained_metrics(self, metrics):
        """KV pages and retained state of each text or sequence deployment, read from its
        engine at scrape time."""
        def engines():
            return [(reg.name, reg.engine.stats()) for reg in list(self.registrations.values())
                    if getattr(reg, "engine", None) is not None]

        metrics.gauge_fn("loom_kv_pages", "KV cache pages of a deployment's pool, free or used.",
                         lambda: [((name, state), s["pages"]["free"] if state == "free"
                                   else s["pages"]["total"] - s["pages"]["free"])
                                  for name, s in engines() for state in ("free", "used")],
                         labels=("model", "state"))
        metrics.gauge_fn("loom_retained", "Retained state held: named sessions or sequence handles, prefixes, "
                                          "checkpoints (resident or suspended).",
                         lambda: [((name, kind), value) for name, s in engines() for kind, value in (
                             ("sessions", s["sessions"]), ("prefixes", s["prefixes"]),
                             ("checkpoints_resident", s["checkpoints"] - s["suspended_checkpoints"]),
                             ("checkpoints_suspended", s["suspended_checkpoints"]))],
                         labels=("model", "kind"))
        metrics.gauge_fn("loom_checkpoint_host_bytes", "Host memory held by suspended checkpoints.",
                         lambda: [((name,), s["host_snapshot_bytes"]) for name, s in engines()], labels=("model",))

    def device_info(self):
        return {k: v for k, v in self.device.info.items() if k not in ("extensions", "usable", "reason")}

    def devices(self):
        """The probe table for /v1/status: every device found, usable or not, and the one in use."""
        keys = ("index", "platform", "device", "platform_name", "driver", "name", "type", "driver_version",
                "opencl_version", "usable", "reason")
        return [dict({k: row.get(k) for k in keys}, in_use=row["index"] == self.device.info["index"])
                for row in self.device.devices]

    # -- lifecycle -----------------------------------------------------------
    def register(self, doc, base_directory=None, package=None):
        """Validate and start preparing. `doc` is parsed JSON; `package` an uploaded
        source package whose members relative sources name. Raises HTTPError."""
        try:
            doc = DOCUMENT.validate(doc)
        except jsonin.JSONInputError as e:
            raise HTTPError(400, e.message, e.code, e.param) from None
        if doc["kind"] not in SERVED_KINDS:
            raise HTTPError(400, f"kind {doc['kind']!r} has no implementation in this build "
                                 f"(served kinds: {', '.join(SERVED_KINDS)})", "unsupported_kind", "kind")
        if doc["model"] in self.registrations:
            raise HTTPError(409, f"model {doc['model']!r} is already registered", "duplicate_model", "model")
        base = doc.get("base_directory") or base_directory
        if base is not None and not os.path.isabs(base):
            raise HTTPError(400, "base_directory must be an absolute path", "invalid_value", "base_directory")
        relative = [doc["checkpoint"]] + ([] if package else doc["sources"])
        if base is None and any(not os.path.isabs(p) for p in relative):
            raise HTTPError(400, "relative paths need an absolute base_directory", "invalid_value", "base_directory")
        loaded = []
        if package is not None:
            # Members are looked up now, so a missing one fails the request (422)
            # instead of falling back to a server file of the same name.
            for i, ref in enumerate(doc["sources"]):
                where, data = package.read(ref, param=f"sources[{i}]")
                if where == "package":
                    loaded.append((package.resolve(ref)[1], data))
        reg = Registration(doc, base)
        reg.package, reg.loaded = package, loaded
        self.registrations[reg.name] = reg
        log.info("registered %s (%s)", reg.name, reg.kind, extra={"event": "registered", "model": reg.name})
        if reg.admission == "drained":
            reg.phase = "registered"   # preparation waits for admission to open
        else:
            self.to_prepare.append(reg)
            self._next_preparation()
        return reg

    def _next_preparation(self):
        while self.preparing is None and self.to_prepare:
            reg = self.to_prepare.pop(0)
            if self.registrations.get(reg.name) is reg:
                self.preparing = reg
                self._prepare(reg)

    def _prepared(self, reg):
        if self.preparing is reg:
            self.preparing = None
        self._next_preparation()

    def _prepare(self, reg):
        device = self.device
        sources, checkpoint = reg.paths()
        options = dict(reg.doc.get("options") or {})
        if reg.kind in ("text", "sequence"):
            # The KV pool: every row can hold a full context.
            options.setdefault("context_length", reg.doc["context_length"])
            page = options.setdefault("page_size", 16)
            options.setdefault("pages", reg.doc["rows"] * -(-options["context_length"] // page))
        loop = self.server.loop

        def progress(done, total):
            loop.call_soon_threadsafe(reg.progress.update, {"bytes_done": done, "bytes_total": total})

        def work():
            return runtime.prepare(reg.name, sources, checkpoint, options, device, self.compiler, progress,
                                   loaded=reg.loaded)

        def finished(prepared, error):
            if error is not None:
                self.server.loop.call_soon(self._prepared, reg)
                code = getattr(error, "code", "internal")
                self._failed(reg, code, getattr(error, "message", None) or f"{type(error).__name__}: {error}")
                if reg.removing:
                    self._remove(reg)
                return
            if reg.removing:  # unregistered while preparing
                self.server.loop.call_soon(self._prepared, reg)
                prepared.release()
                self._remove(reg)
                return
            self._probe(reg, prepared)

        loop.run_in_executor(work, finished)

    def _probe(self, reg, prepared):
        """Compile the kind's stage commands at a small geometry before declaring the
        model ready: a package whose kernels do not build fails its registration
        (phase failed, code compile) instead of failing its first requests."""
        layouts = []
        try:
            for command, geometry in PROBES.get(reg.kind, []):
                layouts.append(prepared.binding.plan(command, **geometry))
        except runtime.LoomError as e:
            prepared.release()
            self._failed(reg, "plan", str(e))
            self.server.loop.call_soon(self._prepared, reg)
            return
        remaining = [len(layouts)]

        def compiled(built):
            failed = next((b for b in built.values() if not b.ok), None)
            if remaining[0] <= 0:
                return
            if failed is not None:
                remaining[0] = 0
                prepared.release()
                self._failed(reg, "compile", f"{failed.name}: {failed.message}\n{failed.log}")
                self.server.loop.call_soon(self._prepared, reg)
                if reg.removing:
                    self._remove(reg)
                return
            remaining[0] -= 1
            if remaining[0] == 0:
                self._ready(reg, prepared)

        if not layouts:
            self._ready(reg, prepared)
        for layout in layouts:
            prepared.compile_layout(layout, prepared.binding, prepared.sources, compiled)

    def _ready(self, reg, prepared):
        self.server.loop.call_soon(self._prepared, reg)   # the next preparation may start
        if reg.removing:
            prepared.release()
            self._remove(reg)
            return
        reg.prepared = prepared
        reg.phase = "ready"
        if reg.doc["variant_capacity"] > 0:
            # The prepared execution is the first choice; staged variants are checked against it.
            first = runtime.Variant(runtime.next_variant_id(), None, prepared.binding, prepared.sources)
            first.phase, first.users = "ready", 1
            prepared.variants[first.id] = first
            prepared.selected = first.id
        log.info("prepared %s: %d parameter bytes", reg.name, prepared.param_bytes(),
                 extra={"event": "prepared", "model": reg.name, "param_bytes": prepared.param_bytes()})
        self._settle(reg)

    def _failed(self, reg, code, message):
        reg.phase = "failed"
        reg.error = {"code": code, "message": message}
        log.error("preparing %s failed (%s): %s", reg.name, code, message,
                  extra={"event": "prepare_failed", "model": reg.name, "code": code})
        self._settle(reg)

    def watch_catalog(self, done):
        """done(registrations) once every start-up catalog registration is ready or
        failed (drained ones wait for admission, so they count as settled)."""
        self._catalog_done = done
        self.catalog_pending = {r.name for r in self.registrations.values()
                                if r.from_catalog and r.phase == "preparing"}
        self._settle(None)

    def _settle(self, reg):
        if self.catalog_pending is None:
            return
        if reg is not None:
            self.catalog_pending.discard(reg.name)
        if not self.catalog_pending:
            self.catalog_pending = None
            self._catalog_done([r for r in self.registrations.values() if r.from_catalog])

    def load_catalog(self, path):
        """Register every document of a catalog file: a JSON list, or {"models": [...]}.
        Relative base_directory values resolve against the catalog's folder."""
        with open(path, "rb") as f:
            try:
                catalog = jsonin.loads(f.read())
            except jsonin.JSONInputError as e:
                raise ValueError(f"{path}: {e.message}") from None
        if isinstance(catalog, dict) and set(catalog) == {"models"}:
            catalog = catalog["models"]
        if not isinstance(catalog, list):
            raise ValueError(f"{path}: a catalog is a JSON list of model documents or {{\"models\": [...]}}")
        folder = os.path.dirname(os.path.abspath(path))
        for i, doc in enumerate(catalog):
            if isinstance(doc, dict) and isinstance(doc.get("base_directory"), str):
                doc = dict(doc, base_directory=os.path.join(folder, doc["base_directory"]))
            try:
                self.register(doc, folder).from_catalog = True
            except HTTPError as e:
                raise ValueError(f"{path}: model document {i}: {e.message}") from None

    # -- residency -----------------------------------------------------------
    def acquire(self, reg, ready):
        """Count a use of reg's parameters; ready(error) once they are resident
        (at once if they are, after streaming them back if they were evicted)."""
        with reg.lock:
            if reg.prepared is not None and reg.prepared.resident:
                reg.in_flight += 1
                reg.last_used = time.monotonic()
                acquired = True
            else:
                acquired = False
        if acquired:
            ready(None)
        else:
            self.activate(reg, lambda error: ready(error) if error else self.acquire(reg, ready))

    def release_use(self, reg):
        with reg.lock:
            reg.in_flight -= 1
            reg.last_used = time.monotonic()
        if reg.in_flight == 0 and reg.deactivate_when_idle:
            reg.deactivate_when_idle = False
            self.deactivate(reg)

    def activate(self, reg, done=None):
        """Stream evicted parameters back (on a worker); done(error) on the loop."""
        waiters = [done] if done else []
        if reg.restoring is not None:
            reg.restoring += waiters
            return
        if reg.prepared is None or reg.prepared.resident:
            for fn in waiters:
                fn(None if reg.prepared is not None else RuntimeError(f"{reg.name} is not prepared"))
            return
        reg.restoring = waiters
        _, checkpoint = reg.paths()
        log.info("activating %s", reg.name, extra={"event": "activating", "model": reg.name})

        def restored(_result, error):
            callbacks, reg.restoring = reg.restoring, None
            if error is not None:
                log.error("activating %s failed: %s", reg.name, error, extra={"event": "activate_failed",
                                                                               "model": reg.name})
            for fn in callbacks:
                fn(error)

        self.server.loop.run_in_executor(reg.prepared.restore, restored, checkpoint)

    def deactivate(self, reg):
        """Evict reg's parameters now if nothing is using them; returns the bytes freed."""
        with reg.lock:
            if reg.prepared is None or reg.in_flight or reg.restoring is not None:
                return 0
            freed = reg.prepared.evict()
        log.info("deactivated %s: %d bytes", reg.name, freed,
                 extra={"event": "deactivated", "model": reg.name, "bytes": freed})
        return freed

    def _evict_for(self, needed, requester):
        """The pool's evictor: least recently used, unpinned, idle parameters of
        other deployments leave the device until `needed` bytes are free."""
        freed = 0
        candidates = sorted((r for r in list(self.registrations.values())
                             if r.name != requester and not r.pinned and r.prepared is not None),
                            key=lambda r: r.last_used)
        for reg in candidates:
            if freed >= needed:
                break
            freed += self.deactivate(reg)
        return freed

    # -- admission -----------------------------------------------------------
    def admit(self, name, kind):
        """The registration serving `name` for an endpoint of `kind`, or HTTPError."""
        if not isinstance(name, str):
            raise HTTPError(400, "model must be a string", "invalid_type", "model")
        reg = self.registrations.get(name)
        if reg is None or reg.removing:
            raise HTTPError(404, f"model {name!r} does not exist", "model_not_found", "model")
        if reg.kind != kind:
            raise HTTPError(404, f"model {name!r} is a {reg.kind} deployment, not {kind}", "model_not_found", "model")
        if reg.phase == "failed":
            # Not retryable: the package, checkpoint or driver must change (422, as a failed variant).
            raise HTTPError(422, f"model {name!r} failed to prepare ({reg.error['code']}): "
                                 f"{_first_line(reg.error['message'])}; GET /v1/status has the whole reason",
                            "model_failed", "model")
        if reg.phase != "ready":
            raise HTTPError(503, f"model {name!r} is {reg.phase}, not prepared yet", "model_not_ready", "model")
        return reg

    def enter(self, reg, job):
        """Pass the admission gate: job.start(error) runs once it may use the
        device. A drained gate queues (bounded by pending_capacity, then 503)."""
        if reg.admission != "open" or reg.waiting:
            if len(reg.waiting) >= reg.doc["pending_capacity"]:
                raise HTTPError(503, f"model {reg.name!r} has a full queue", "queue_full", "model")
            reg.waiting.append(job)
            return
        self._start(reg, job)

    def _start(self, reg, job):
        reg.jobs.add(job)
        if job.resident:
            self.acquire(reg, job.start)
        else:
            job.start(None)     # control work on retained state: the weights need not be resident

    def leave(self, reg, job, acquired):
        """A job is done with the device (its accepted work has retired)."""
        reg.jobs.discard(job)
        if acquired:
            self.release_use(reg)
        if reg.removing and not reg.jobs:
            self._remove(reg)

    def withdraw(self, reg, job):
        """A waiting job's client went away: it leaves the queue at once."""
        if job in reg.waiting:
            reg.waiting.remove(job)

    def _open_gate(self, reg):
        while reg.admission == "open" and reg.waiting and not reg.removing:
            self._start(reg, reg.waiting.pop(0))

    # -- lifecycle operations ----------------------------------------------------
    def drain(self, reg):
        reg.admission = "drained"

    def undrain(self, reg):
        reg.admission = "open"
        if reg.phase == "registered":
            reg.phase = "preparing"
            self.to_prepare.append(reg)
            self._next_preparation()
        self._open_gate(reg)

    def unregister(self, reg, mode):
        """Stop admitting; waiting jobs get 410; `abort` withdraws in-flight ones too.
        The registration goes once its accepted work has retired."""
        if reg.removing:
            return
        reg.removing = mode
        reg.phase = "removing" if reg.phase != "failed" else reg.phase
        gone = HTTPError(410, f"model {reg.name!r} was unregistered", "model_unregistered", "model")
        waiting, reg.waiting = reg.waiting, []
        for job in waiting:
            job.fail(gone)
        readers, reg.readers = reg.readers, set()
        for reader in readers:
            reader.resolve(gone.response())  # the compilation itself still joins the compiler
        if mode == "abort":
            for job in list(reg.jobs):
                job.fail(gone)
        if reg in self.to_prepare:
            self.to_prepare.remove(reg)
        log.info("unregistering %s (%s)", reg.name, mode, extra={"event": "unregistering", "model": reg.name})
        if not reg.jobs and self.preparing is not reg:
            self._remove(reg)

    def _remove(self, reg):
        if self.registrations.get(reg.name) is reg:
            del self.registrations[reg.name]
        self._settle(reg)
        if reg.prepared is not None:
            reg.prepared.release()
            reg.prepared = None
        log.info("unregistered %s", reg.name, extra={"event": "unregistered", "model": reg.name})

    # -- views ---------------------------------------------------------------
    def model_list(self):
        return [reg.capability() for reg in self.registrations.values() if reg.phase == "ready" and not reg.removing]

    def status(self):
        return [reg.status() for reg in self.registrations.values()]

    def resources(self):
        return {"device": self.device_info(), "memory": self.device.pool.usage(), "jit": self.compiler.stats()}

    def close(self):
        for reg in self.registrations.values():
            if reg.prepared is not None:
                reg.prepared.release()
                reg.prepared = None




def _first_line(text, chars=300):
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")[:chars]


class Job:
    """One inference request's life at a registration: the admission gate
    (start), the client leaving (cancelled), unregister (fail), and the end of
    its device work (finish). Endpoints subclass it with their own work."""

    what = "request"
    resident = True     # start() needs the parameters on the device

    def __init__(self, server, reg, request):
        self.server, self.reg, self.request = server, reg, request
        self.deferred = Deferred()
        self.deferred.on_cancel = self.cancelled
        self.gone = False        # the client left, or the response was already settled
        self.acquired = False
        self.finished = False
        request.state = "queued"

    def start(self, error):
        """The gate let the job through and the parameters are resident (or error)."""
        self.acquired = error is None and self.resident
        if error is not None or self.gone:
            self.finish(error=error)
            return
        self.request.state = "running"
        self.run()

    def run(self):
        raise NotImplementedError

    def cancelled(self):
        """The client disconnected: leave the queue; accepted device work retires for its peers."""
        self.gone = True
        self.server.registry.withdraw(self.reg, self)

    def fail(self, error):
        """Withdrawn (unregister): answer now; accepted device work still retires."""
        if not self.gone:
            self.gone = True
            self.deferred.resolve(error.response())

    def finish(self, response=None, error=None):
        if self.finished:
            return    # several endings can race (a failure, then the retiring step): one counts
        self.finished = True
        self.server.registry.leave(self.reg, self, self.acquired)
        self.acquired = False
        if isinstance(error, HTTPError):
            response = error.response()
        elif error is not None:
            status = 503 if isinstance(error, OutOfDeviceMemory) else 500
            response = HTTPError(status, f"{self.what} failed: {getattr(error, 'message', error)}",
                                 "device_memory" if status == 503 else "execution_failed").response()
        if not self.gone and response is not None:
            self.deferred.resolve(response)


# -- HTTP: discovery and administration (PROFILES.md) ------------------------------

MODEL = Obj({"model": Str(min_len=1)})
UNREGISTER = Obj({"model": Str(min_len=1), "mode": Enum(["drain", "abort"], optional=True)})
COMPONENT = Obj({"model": Str(min_len=1), "component": Str(optional=True)})
TRIM = Obj({"device": Int(lo=0, hi=2**31 - 1), "target_bytes": Int(lo=0, hi=2**62)})
COMPONENT_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def _registration(server, name):
    reg = server.registry.registrations.get(name)
    if reg is None or reg.removing:
        raise HTTPError(404, f"model {name!r} does not exist", "model_not_found", "model")
    return reg


def _component(reg, body):
    """The residency selector: "primary" by default; undeclared 404, malformed 400."""
    component = body.get("component", "primary")
    if not COMPONENT_NAME.fullmatch(component):
        raise HTTPError(400, f"invalid component selector {component!r}", "invalid_value", "component")
    if component not in reg.components():
        raise HTTPError(404, f"model {reg.name!r} declares no {component!r} component", "component_not_found",
                        "component")
    return component


def _document(request):
    """The request JSON and, for multipart/form-data, the uploaded source package."""
    ctype = (request.header("content-type") or "").split(";")[0].strip().lower()
    if ctype != "multipart/form-data":
        return request.json(), None
    package, raw = packages.from_form(request.form())
    try:
        return jsonin.loads(raw), package
    except jsonin.JSONInputError as e:
        raise HTTPError(400, f"request part: {e.message}", e.code, e.param) from None


def register_model(server, request):
    doc, package = _document(request)
    reg = server.registry.register(doc, None, package)
    return Response.json(dict(reg.status(), object="registration"), 202)


def drain_model(server, request):
    reg = _registration(server, request.json(MODEL)["model"])
    server.registry.drain(reg)
    return Response.json({"model": reg.name, "admission": reg.admission})


def undrain_model(server, request):
    reg = _registration(server, request.json(MODEL)["model"])
    server.registry.undrain(reg)
    return Response.json({"model": reg.name, "admission": reg.admission})


def unregister_model(server, request):
    body = request.json(UNREGISTER)
    reg = _registration(server, body["model"])
    mode = body.get("mode", "drain")
    server.registry.unregister(reg, mode)
    return Response.json({"model": reg.name, "mode": mode, "phase": reg.phase,
                          "in_flight": len(reg.jobs)}, 202)


def _residency_target(server, request):
    body = request.json(COMPONENT)
    reg = _registration(server, body["model"])
    component = _component(reg, body)
    if reg.phase != "ready" or reg.prepared is None:
        raise HTTPError(409, f"model {reg.name!r} is {reg.phase}, not a healthy prepared registration",
                        "not_ready", "model")
    if reg.admission != "drained":
        raise HTTPError(409, f"model {reg.name!r} must be drained first (POST /v1/models/drain)",
                        "not_drained", "model")
    return reg, component


def activate_model(server, request):
    reg, component = _residency_target(server, request)
    reg.deactivate_when_idle = False
    server.registry.activate(reg)
    return Response.json({"model": reg.name, "component": component, "operation": "activate"}, 202)


def deactivate_model(server, request):
    reg, component = _residency_target(server, request)
    if reg.in_flight or reg.restoring is not None:
        reg.deactivate_when_idle = True   # after the drained work finishes
    else:
        server.registry.deactivate(reg)
    return Response.json({"model": reg.name, "component": component, "operation": "deactivate"}, 202)


def _pinning(server, request, pinned):
    body = request.json(COMPONENT)
    reg = _registration(server, body["model"])
    component = _component(reg, body)
    reg.pinned = pinned
    return Response.json({"model": reg.name, "component": component, "pinned": pinned})


def pin_model(server, request):
    return _pinning(server, request, True)


def unpin_model(server, request):
    return _pinning(server, request, False)


def trim_device(server, request):
    body = request.json(TRIM)
    registry = server.registry
    if registry.device is None or body["device"] != 0:
        raise HTTPError(404, f"no device {body['device']}", "device_not_found", "device")
    for reg in registry.registrations.values():
        if getattr(reg, "engine", None) is not None:
            reg.engine.release_idle()   # retained idle conversations are reclaimable caches too
    freed = registry.device.pool.trim(body["target_bytes"])
    return Response.json(dict(registry.resources(), device_index=0, freed_bytes=freed))


# -- native executable variants ------------------------------------------------------

PAGE = 64
PROBES = {"embedding": [("embed", {"T": 1, "S": 1})], "text": [("advance", {"T": 1, "R": 1})],
          "sequence": [("encode", {"T": 1})], "decision": [("decide", {"T": 2, "S": 2, "G": 1})]}   # geometries compiled when a variant is staged
STAGE = Obj({"model": Str(min_len=1), "base": Int(lo=0, hi=2**62),
             "base_directory": Str(min_len=1, max_len=4096, optional=True),
             "sources": Arr(Str(min_len=1, max_len=4096), min_len=1, max_len=64), "wait": Bool(optional=True)})
SELECT = Obj({"model": Str(min_len=1), "variant": Int(lo=0, hi=2**62), "expected": Int(lo=0, hi=2**62)})
REMOVE = Obj({"model": Str(min_len=1), "variant": Int(lo=0, hi=2**62)})


def _variant_service(server, name):
    """A healthy prepared registration with native variants enabled."""
    reg = _registration(server, name)
    if reg.phase != "ready" or reg.prepared is None:
        raise HTTPError(409, f"model {reg.name!r} is {reg.phase}, not a healthy prepared service", "not_ready", "model")
    if not reg.prepared.variants:
        raise HTTPError(501, f"model {reg.name!r} does not support native variants (variant_capacity is 0)",
                        "variants_disabled", "model")
    return reg


def _variant(server, reg, vid, param="variant"):
    variant = reg.prepared.variants.get(vid)
    if variant is not None:
        return variant
    if any(r.prepared is not None and vid in r.prepared.variants for r in server.registry.registrations.values()):
        raise HTTPError(409, f"variant {vid} belongs to another registration", "variant_conflict", param)
    raise HTTPError(404, f"model {reg.name!r} has no variant {vid}", "variant_not_found", param)


def list_variants(server, request):
    request.require_empty_body()
    name = request.header("x-loom-model")
    if name is None:
        raise HTTPError(400, "X-Loom-Model names the deployment whose variants to list", "missing_header",
                        "X-Loom-Model")
    reg = _variant_service(server, name)
    offset_text, variant_text = request.header("x-loom-offset"), request.header("x-loom-variant")
    if offset_text is not None and variant_text is not None:
        raise HTTPError(400, "X-Loom-Offset and X-Loom-Variant are mutually exclusive", "conflicting_headers")
    prepared = reg.prepared
    if variant_text is not None:
        vid = _header_int(variant_text, "X-Loom-Variant")
        return Response.json(_variant(server, reg, vid).record(detail=True))
    offset = _header_int(offset_text, "X-Loom-Offset") if offset_text is not None else 0
    variants = list(prepared.variants.values())
    page = variants[offset:offset + PAGE]
    return Response.json({"object": "list", "model": reg.name, "selected": prepared.selected,
                          "count": len(variants), "offset": offset, "data": [v.record() for v in page],
                          "next_offset": offset + len(page) if offset + len(page) < len(variants) else None})


def _header_int(text, header):
    if not text.isdigit() or not text.isascii() or len(text) > 18:
        raise HTTPError(400, f"{header} must be a nonnegative integer", "invalid_header", header)
    return int(text)


def stage_variant(server, request):
    doc, package = _document(request)
    try:
        body = STAGE.validate(doc)
    except jsonin.JSONInputError as e:
        raise HTTPError(400, e.message, e.code, e.param) from None
    reg = _variant_service(server, body["model"])
    base = _variant(server, reg, body["base"], "base")
    if base.phase != "ready":
        raise HTTPError(409, f"base variant {base.id} is {base.phase}, not ready", "variant_not_ready", "base")
    directory = body.get("base_directory")
    if directory is not None and not os.path.isabs(directory):
        raise HTTPError(400, "base_directory must be absolute", "invalid_value", "base_directory")
    paths, loaded = [], []
    for i, source in enumerate(body["sources"]):
        if package is not None and not os.path.isabs(source):
            where, data = package.read(source, param=f"sources[{i}]")
            loaded.append((package.resolve(source)[1], data))
        elif not os.path.isabs(source) and directory is None:
            raise HTTPError(400, f"relative source {source!r} needs an absolute base_directory", "invalid_value",
                            "sources")
        else:
            paths.append(runtime.resolve(directory, source) if directory else source)
    # Staging keeps the uploaded bytes only until its executables are built.
    return _stage(server, reg, base, paths, loaded, body.get("wait", True))


def _stage(server, reg, base, paths, loaded, wait):
    prepared = reg.prepared
    if len(prepared.variants) >= reg.doc["variant_capacity"]:
        raise HTTPError(429, f"model {reg.name!r} holds {len(prepared.variants)} variants, its variant_capacity",
                        "variant_capacity", "model")
    variant = runtime.Variant(runtime.next_variant_id(), base.id, None, None)
    prepared.variants[variant.id] = variant
    reader = Deferred() if wait else None
    if reader is not None:
        reg.readers.add(reader)
        reader.on_cancel = lambda: reg.readers.discard(reader)   # the compilation goes on

    def settle(phase, error=None):
        variant.phase = phase
        variant.error = error
        log.info("variant %d of %s: %s", variant.id, reg.name, phase,
                 extra={"event": "variant", "model": reg.name, "variant": variant.id, "phase": phase})
        if reader is not None and reader in reg.readers:
            reg.readers.discard(reader)
            reader.resolve(Response.json({"selected": prepared.selected, "variant": variant.record(detail=True)},
                                         200 if phase == "ready" else 422))

    def bound(result, error):
        if error is not None:
            settle("failed", {"code": getattr(error, "code", "internal"), "message": str(error)})
            return
        variant.binding, variant.sources = result
        layouts = []
        try:
            for command, geometry in PROBES.get(reg.kind, []):
                layouts.append(variant.binding.plan(command, **geometry))
        except runtime.LoomError as e:
            settle("failed", {"code": "plan", "message": str(e)})
            return
        pending = [len(layouts)]
        if not layouts:
            settle("ready")

        def compiled(built):
            for result in built.values():
                variant.diagnostics.append({"kernel": result.name, "ok": result.ok, "log": result.log,
                                            **({"message": result.message} if not result.ok else {})})
            failed = [r for r in built.values() if not r.ok]
            if failed:
                pending[0] = -1
                settle("failed", {"code": "compile", "message": failed[0].message})
                return
            pending[0] -= 1
            if pending[0] == 0:
                settle("ready")

        for layout in layouts:
            prepared.compile_layout(layout, variant.binding, variant.sources,
                                    lambda built: compiled(built) if pending[0] > 0 else None)

    server.loop.run_in_executor(runtime.stage_binding, bound, prepared, paths, loaded)
    if reader is not None:
        return reader
    return Response.json({"selected": prepared.selected, "variant": variant.record()}, 202)


def select_variant(server, request):
    body = request.json(SELECT)
    reg = _variant_service(server, body["model"])
    prepared = reg.prepared
    variant = _variant(server, reg, body["variant"])
    if body["expected"] != prepared.selected:
        raise HTTPError(409, f"the selected variant is {prepared.selected}, not {body['expected']}",
                        "stale_expected", "expected")
    if variant.phase != "ready":
        raise HTTPError(409, f"variant {variant.id} is {variant.phase}", "variant_not_ready", "variant")
    # Embedding and decision cohorts capture their plan when they start, so the
    # switch takes effect between cohorts: this is the safe execution boundary.
    previous = prepared.variants[prepared.selected]
    previous.users -= 1
    variant.users += 1
    prepared.selected = variant.id
    log.info("selected variant %d of %s", variant.id, reg.name,
             extra={"event": "variant_selected", "model": reg.name, "variant": variant.id})
    return Response.json({"selected": variant.id})


def remove_variant(server, request):
    body = request.json(REMOVE)
    reg = _variant_service(server, body["model"])
    prepared = reg.prepared
    variant = _variant(server, reg, body["variant"])
    if variant.phase == "compiling":
        raise HTTPError(409, f"variant {variant.id} is still compiling", "variant_busy", "variant")
    if variant.users or variant.id == prepared.selected:
        raise HTTPError(409, f"variant {variant.id} is in use ({variant.users} users)", "variant_busy", "variant")
    del prepared.variants[variant.id]
    for key in [k for k in prepared.plans if k[0] == variant.id]:
        prepared.plans.pop(key).release()
    return Response.json({"removed": variant.id})


ROUTES = [
    ("GET", "/v1/models/variants", list_variants),
    ("POST", "/v1/models/variants", stage_variant),
    ("POST", "/v1/models/variants/select", select_variant),
    ("POST", "/v1/models/variants/remove", remove_variant),
    ("POST", "/v1/models/register", register_model),
    ("POST", "/v1/models/drain", drain_model),
    ("POST", "/v1/models/undrain", undrain_model),
    ("POST", "/v1/models/unregister", unregister_model),
    ("POST", "/v1/models/activate", activate_model),
    ("POST", "/v1/models/deactivate", deactivate_model),
    ("POST", "/v1/models/pin", pin_model),
    ("POST", "/v1/models/unpin", unpin_model),
    ("POST", "/v1/devices/trim", trim_device),
]
