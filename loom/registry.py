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

from . import jsonin, runtime
from .http import HTTPError
from .jsonin import Enum, Int, Obj, Str, Arr

log = logging.getLogger("loom.registry")

KINDS = ("text", "sequence", "embedding", "decision", "image", "speech", "recognition")
ENDPOINTS = {"text": "/v1/chat/completions", "sequence": "/v1/sequences", "embedding": "/v1/embeddings",
             "decision": "/v1/systemone", "image": "/v1/images/generations", "speech": "/v1/audio/speech",
             "recognition": "/v1/audio/transcriptions"}
MODALITIES = {"text": (["text"], ["text"]), "sequence": (["tokens"], ["tensor"]),
              "embedding": (["text", "tokens"], ["embedding"]), "decision": (["text"], ["probabilities"]),
              "image": (["text"], ["image"]), "speech": (["text"], ["audio"]), "recognition": (["audio"], ["text"])}
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
    "variant_capacity": _capacity(1 << 10),
    "options": Obj(None, optional=True),
})

DEFAULTS = {"admission": "open", "rows": 4, "context_length": 4096, "max_output_tokens": 512,
            "pending_capacity": 32, "session_cache_capacity": 0, "prefix_cache_capacity": 0,
            "checkpoint_capacity": 0, "variant_capacity": 0}


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
        self.in_flight = 0
        self.queued = 0
        self.from_catalog = False
        # Residency: parameters can leave the device (deactivate, memory pressure)
        # and stream back on demand. The lock orders in_flight against eviction,
        # which may run on a preparation thread.
        self.lock = threading.Lock()
        self.pinned = False
        self.last_used = time.monotonic()
        self.restoring = None       # callbacks waiting for parameters to return

    def paths(self):
        base = self.base_directory
        sources = [runtime.resolve(base, s) for s in self.doc["sources"]]
        return sources, runtime.resolve(base, self.doc["checkpoint"])

    def capability(self):
        p = self.prepared
        loom = {"kind": self.kind, "endpoint": ENDPOINTS[self.kind], "tokenize": False,
                "admission": self.admission}
        if self.kind in ("text", "sequence"):
            loom["context_length"] = self.doc["context_length"]
            loom["limits"] = {"max_output_tokens": self.doc["max_output_tokens"]}
        if self.kind == "embedding" and p is not None:
            loom["dimensions"] = p.spec("DIM")
            loom["max_input_tokens"] = p.spec("MAX_TOKENS")
        inputs, outputs = MODALITIES[self.kind]
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "local",
                "input_modalities": inputs, "output_modalities": outputs, "loom": loom}

    def status(self):
        p = self.prepared
        return {
            "model": self.name, "kind": self.kind, "phase": self.phase, "created": self.created,
            "progress": dict(self.progress), "error": self.error, "admission": self.admission,
            "requests": {"in_flight": self.in_flight, "queued": self.queued,
                         "pending_capacity": self.doc["pending_capacity"]},
            "resources": {"param_bytes": p.param_bytes() if p else 0, "plans": len(p.plans) if p else 0,
                          "resident": bool(p and p.resident), "pinned": self.pinned},
        }


class Registry:
    """All registrations of one server, and the device they share."""

    def __init__(self, server):
        self.server = server
        self.registrations = {}
        self.device = None
        self.compiler = None
        self.device_error = None
        # One preparation at a time: uploads are bound by memory bandwidth anyway,
        # and a finished model is evictable while the next one loads.
        self.to_prepare = []
        self.preparing = None

    # -- device --------------------------------------------------------------
    def ensure_device(self):
        """Open the OpenCL device on first use, so a server without models never needs one."""
        if self.device is None and self.device_error is None:
            from .compiler import Compiler
            from .device import Device
            cfg = self.server.config
            try:
                self.device = Device(cfg.device, cfg.memory_bytes)
            except Exception as e:  # no platform, bad selector, driver failure: reported, never fatal
                self.device_error = f"{type(e).__name__}: {e}"
                log.error("no OpenCL device: %s", self.device_error, extra={"event": "device_failed"})
                return None
            loop = self.server.loop
            self.compiler = Compiler(self.device, lambda fn, done: loop.run_in_executor(fn, done))
            self.device.pool.set_evictor(self._evict_for)
            self.device.metrics(self.server.metrics)
            self.compiler.metrics(self.server.metrics)
            log.info("device: %s", self.device.describe(),
                     extra={"event": "device", "device": self.device.info["name"], "type": self.device.info["type"]})
        return self.device

    def device_info(self):
        if self.device is None:
            return {"error": self.device_error} if self.device_error else {}
        info = {k: v for k, v in self.device.info.items() if k != "extensions"}
        return info

    # -- lifecycle -----------------------------------------------------------
    def register(self, doc, base_directory):
        """Validate and start preparing. `doc` is parsed JSON; raises HTTPError."""
        try:
            doc = DOCUMENT.validate(doc)
        except jsonin.JSONInputError as e:
            raise HTTPError(400, e.message, e.code, e.param) from None
        if doc["model"] in self.registrations:
            raise HTTPError(409, f"model {doc['model']!r} is already registered", "duplicate_model", "model")
        base = doc.get("base_directory") or base_directory
        if base is None or not os.path.isabs(base):
            raise HTTPError(400, "relative paths need an absolute base_directory", "invalid_value", "base_directory")
        reg = Registration(doc, base)
        self.registrations[reg.name] = reg
        log.info("registered %s (%s)", reg.name, reg.kind, extra={"event": "registered", "model": reg.name})
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
        device = self.ensure_device()
        if device is None:
            self._failed(reg, "device", f"no OpenCL device: {self.device_error}")
            self._prepared(reg)
            return
        sources, checkpoint = reg.paths()
        options = dict(reg.doc.get("options") or {})
        loop = self.server.loop

        def progress(done, total):
            loop.call_soon_threadsafe(reg.progress.update, {"bytes_done": done, "bytes_total": total})

        def work():
            return runtime.prepare(reg.name, sources, checkpoint, options, device, self.compiler, progress)

        def finished(prepared, error):
            self.server.loop.call_soon(self._prepared, reg)
            if error is not None:
                code = getattr(error, "code", "internal")
                self._failed(reg, code, getattr(error, "message", None) or f"{type(error).__name__}: {error}")
                return
            if self.registrations.get(reg.name) is not reg:  # removed while preparing
                prepared.release()
                return
            reg.prepared = prepared
            reg.phase = "ready"
            log.info("prepared %s: %d parameter bytes", reg.name, prepared.param_bytes(),
                     extra={"event": "prepared", "model": reg.name, "param_bytes": prepared.param_bytes()})

        loop.run_in_executor(work, finished)

    def _failed(self, reg, code, message):
        reg.phase = "failed"
        reg.error = {"code": code, "message": message}
        log.error("preparing %s failed (%s): %s", reg.name, code, message,
                  extra={"event": "prepare_failed", "model": reg.name, "code": code})

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
        """The ready registration serving `name` for an endpoint of `kind`."""
        if not isinstance(name, str):
            raise HTTPError(400, "model must be a string", "invalid_type", "model")
        reg = self.registrations.get(name)
        if reg is None or reg.kind != kind:
            raise HTTPError(404, f"model {name!r} does not exist" if reg is None
                            else f"model {name!r} is a {reg.kind} deployment, not {kind}", "model_not_found", "model")
        if reg.phase == "failed":
            raise HTTPError(503, f"model {name!r} failed to prepare: {reg.error['message']}", "model_failed", "model")
        if reg.phase != "ready":
            raise HTTPError(503, f"model {name!r} is still preparing", "model_not_ready", "model")
        if reg.admission != "open":
            raise HTTPError(503, f"model {name!r} is drained", "model_drained", "model")
        if reg.in_flight + reg.queued >= reg.doc["pending_capacity"] + reg.doc["rows"]:
            raise HTTPError(503, f"model {name!r} has a full queue", "queue_full", "model")
        return reg

    # -- views ---------------------------------------------------------------
    def model_list(self):
        return [reg.capability() for reg in self.registrations.values() if reg.phase == "ready"]

    def status(self):
        return [reg.status() for reg in self.registrations.values()]

    def resources(self):
        if self.device is None:
            return {"device": self.device_info()}
        return {"device": self.device_info(), "memory": self.device.pool.usage(), "jit": self.compiler.stats()}

    def close(self):
        for reg in self.registrations.values():
            if reg.prepared is not None:
                reg.prepared.release()
                reg.prepared = None


