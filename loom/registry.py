"""Registrations: model documents, background preparation, admission, residency.

A registration starts from a model document (DESIGN.md "Model documents and
packages"), validated strictly. Preparation (reading sources, binding the
checkpoint, uploading weights) runs on the CPU executor and reports progress;
the loop never blocks on it. Its phases and their transitions are one table
(PHASES), applied by Registration.transition. Everything a kind knows about
itself comes from its Kind object (kinds.py); this file never asks which kind
a registration is. The HTTP handlers over it are in admin.py.
"""

import logging
import os
import re
import threading
import time

from . import cache_folder, confine, jsonin, language, model_roots, open_regular, outside_roots, proving, runtime, \
    tokenizer
from .errors import Error, Problem, withhold
from .logs import PRIVATE
from .jsonin import Arr, Bool, Enum, Int, Map, Num, Obj, Str

log = logging.getLogger("loom.registry")

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
NAME_RULE = "1-64 ASCII letters, digits, '_', '.' or '-'"   # deployments, sessions, checkpoints


def _name_rule(value):
    return None if NAME.fullmatch(value) else f"must be {NAME_RULE}"


def _capacity(hi):
    return Int(lo=0, hi=hi, optional=True)


def document_schema(kind_names):
    return Obj({
        "model": Str(check=_name_rule),
        "kind": Enum(kind_names),
        "sources": Arr(Str(min_len=1, max_len=4096), min_len=1, max_len=64),
        "checkpoint": Str(min_len=1, max_len=4096),
        "base_directory": Str(min_len=1, max_len=4096, optional=True),
        "prepare": Str(min_len=1, max_len=4096, optional=True),
        "control": Str(min_len=1, max_len=4096, optional=True),
        "assets": Str(min_len=1, max_len=4096, optional=True),
        "endpoint": Bool(optional=True),
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
        "step_timeout": Num(lo=0.001, hi=86400, optional=True),
        "options": Obj(None, optional=True),
        # Extra components (the text kind's "image"), each a package of its own; which
        # names a kind takes is checked at register (Kind.contracts).
        "components": Map(Obj({"sources": Arr(Str(min_len=1, max_len=4096), min_len=1, max_len=64),
                               "checkpoint": Str(min_len=1, max_len=4096),
                               "options": Obj(None, optional=True)}), max_len=8, optional=True),
    })


DEFAULTS = {"admission": "open", "rows": 4, "context_length": 4096, "max_output_tokens": 512,
            "pending_capacity": 32, "session_cache_capacity": 0, "prefix_cache_capacity": 0,
            "checkpoint_capacity": 0, "checkpoint_backing": "fixed", "variant_capacity": 0, "endpoint": True,
            "step_timeout": 120.0}

# (phase, event) -> the next phase. Any other pair is a bug, and raises.
PHASES = {
    ("new", "open"): "preparing",            # registered with admission open
    ("new", "drained"): "registered",        # registered drained: preparation waits for undrain
    ("registered", "undrain"): "preparing",
    ("preparing", "prepared"): "ready",      # weights resident, probe kernels built
    ("preparing", "failed"): "failed",
    ("registered", "unregister"): "removing",
    ("preparing", "unregister"): "removing",
    ("ready", "unregister"): "removing",
    ("failed", "unregister"): "failed",      # a failed registration keeps saying why until it goes
    ("removing", "failed"): "failed",        # preparation failed after unregister: removed next
    ("ready", "failed"): "failed",           # a device step passed its step_timeout
}


class Files:
    """Where a registration's inputs come from (PROFILES.md "Uploaded source packages").
    Code (prepare, control, sources) and metadata (the asset directory: tokenizer
    files) come from an uploaded package when their locators are relative, else from
    server files; checkpoint bytes always from the server, relative to base_directory.
    Package members are looked up here, so a missing one fails the request (422)
    instead of falling back to a server file of the same name."""

    def __init__(self, doc, base, package):
        self.checkpoint = runtime.resolve(base, doc["checkpoint"])
        self.preserved = []
        for role in ("prepare", "control"):
            if role in doc:
                self.preserved.append((role, *self._code(doc[role], base, package, role)))
        self.sources, self.loaded = self._modules(doc["sources"], base, package, "sources")
        # name -> (sources, loaded, checkpoint) of each extra component's package
        self.components = {name: (*self._modules(c["sources"], base, package, f"components.{name}.sources"),
                                  runtime.resolve(base, c["checkpoint"]))
                           for name, c in doc.get("components", {}).items()}
        self.assets = self._assets(doc, base, package)
        self.includes = self.include_reader(base, package)
        # Whether diagnostics may quote the code (every source, prepare/control module and include
        # an uploaded member: the client's own bytes) and the metadata; else what a reader says
        # about a server file is withheld (errors.withhold).
        self.quotable = package is not None and not self.sources and all(
            data is not None for _, _, data in self.preserved) and not any(
            paths for paths, _, _ in self.components.values())
        self.quotable_assets = package is not None and not os.path.isabs(doc.get("assets") or doc["checkpoint"])
        self.base, self.package, self.doc = base, package, doc

    def server_paths(self):
        """(document field, server path) of every server file or folder the registration reads."""
        # base_directory first: a relative path's escape is told of the folder it escapes
        out = [("base_directory", self.base)] if self.package is None and self.base is not None else []
        out += [("checkpoint", self.checkpoint)]
        out += [(role, path) for role, path, data in self.preserved if data is None]
        out += [("sources", path) for path in self.sources]
        for name, (paths, _, checkpoint) in self.components.items():
            out += [(f"components.{name}.sources", p) for p in paths] + [(f"components.{name}.checkpoint", checkpoint)]
        assets = self.doc.get("assets")
        if assets is not None and not self.quotable_assets:
            out.append(("assets", runtime.resolve(self.base, assets)))
        return out

    @classmethod
    def _modules(cls, refs, base, package, param):
        """(server paths, [(path, bytes)] of uploaded members) of a list of source references."""
        paths, loaded = [], []
        for i, ref in enumerate(refs):
            path, data = cls._code(ref, base, package, f"{param}[{i}]")
            if data is None:
                paths.append(path)
            else:
                loaded.append((path, data))
        return paths, loaded

    @staticmethod
    def include_reader(base, package):
        """includes(name) -> bytes | None for a kernel's #include "name": a member of the
        uploaded package (from the request's folder), else a file under base_directory;
        names never hold '..' or a leading '/' (language.INCLUDE), so nothing escapes."""
        if package is not None:
            return package.reader(package.base)
        if base is None:
            return None

        def read(name):
            path = os.path.join(base, name)
            if not os.path.lexists(path):
                return None
            if outside_roots(path):     # (a symlink out of the roots, say): refused, not read
                raise OSError(f"{path} resolves outside the model roots (--model_root)")
            if not os.path.isfile(path):
                return None
            with open_regular(path) as f:
                return f.read()
        return read

    @staticmethod
    def _code(ref, base, package, param):
        """(path, bytes) of an uploaded member, or (server path, None) to read at preparation."""
        if package is None:
            return runtime.resolve(base, ref), None
        where, path = package.resolve(ref, param=param)
        return path, (package.files[path] if where == "package" else None)

    @staticmethod
    def _assets(doc, base, package):
        """read(name) -> bytes | None over the metadata directory; None: the checkpoint's
        own folder on the server (runtime's default)."""
        ref = doc.get("assets")
        if package is not None and not os.path.isabs(ref or doc["checkpoint"]):
            if ref is not None:
                return package.reader(package.resolve_dir(ref, param="assets")[1])
            # checkpoint:"." reads uploaded metadata beside the request; its bytes stay on the server.
            folder = package.folder_of(doc["checkpoint"], param="checkpoint")
            return package.reader(folder) if folder is not None else (lambda name: None)
        if ref is None:
            return None
        folder = runtime.resolve(base, ref)
        read = tokenizer.folder_reader(folder)

        def server_read(name):
            if not os.path.isdir(folder):
                raise OSError(f"the asset directory {folder} is not a directory")
            return read(name)
        return server_read


class Registration:
    def __init__(self, doc, kind, base_directory):
        self.doc = dict(DEFAULTS, **doc)
        self.name = doc["model"]
        self.kind = kind            # its Kind object (kinds.py)
        self.base_directory = base_directory
        self.created = int(time.time())
        self.phase = "new"
        self.progress = {"bytes_done": 0, "bytes_total": 0}
        self.error = None
        self.admission = self.doc["admission"]
        self.prepared = None
        self.engine = None          # the kind's cohort engine, started when the model is ready
        self.in_flight = 0          # jobs holding resident parameters (see acquire)
        self.from_catalog = False
        # Residency: parameters can leave the device (deactivate, memory pressure)
        # and stream back on demand. The lock orders in_flight against eviction,
        # which may run on a preparation thread.
        self.lock = threading.Lock()
        self.pinned = False
        self.pinned_components = set()   # extra components (a text model's "image") pinned on their own
        self.last_used = time.monotonic()
        self.restoring = {}         # component -> callbacks waiting for its parameters to return
        # Admission: jobs waiting at the gate (drained, FIFO) and jobs admitted.
        self.waiting = []
        self.jobs = set()
        self.removing = None        # "drain" | "abort" once unregistered
        self.deactivate_when_idle = set()   # components asked to leave once unused and not streaming back
        self.users = {}             # extra component -> jobs using it (the primary's count is in_flight)
        self.readers = set()        # fn(error) of requests waiting for a staged variant's compilation
        self.staging = 0            # staged variants still compiling: they hold the compiler's model ownership
        self.restores = 0           # parameter uploads on a worker: the registration goes only after them
        self.observations = 0       # management observations open (admin.py's credit)
        self.deadline = None        # the --prepare_timeout timer while preparing
        self.timed_out = False      # preparation passed it: whatever the worker returns is released
        self.loop = None            # the server's loop and --trial_timeout, for the proving ground
        self.trial_timeout = None
        self.package = None         # an uploaded source package, retained until the model retires
        self.files = None           # where its code, metadata and checkpoint come from (Files)

    def transition(self, event):
        try:
            self.phase = PHASES[self.phase, event]
        except KeyError:
            raise RuntimeError(f"registration {self.name}: no transition from {self.phase} on {event}") from None

    def components(self):
        return self.kind.components(self.prepared)

    def capability(self):
        p = self.prepared
        loom = {"kind": self.kind.name}
        if self.kind.endpoint is not None and self.doc["endpoint"]:
            loom["endpoint"] = self.kind.endpoint       # native-only activity models have none
        loom.update(tokenize=bool(p is not None and p.tokenizer is not None), admission=self.admission)
        loom.update(self.kind.capability(self))
        if p is not None and p.variants:
            loom["variants"] = {"selected": p.selected, "count": len(p.variants)}
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "local",
                "input_modalities": self.kind.input_modalities(p), "output_modalities": list(self.kind.outputs),
                "loom": loom}

    def status(self):
        p = self.prepared
        engine = self.engine.stats() if self.engine is not None else None
        return {
            "model": self.name, "kind": self.kind.name, "phase": self.phase, "created": self.created,
            "progress": dict(self.progress), "error": self.error, "admission": self.admission,
            "requests": {"in_flight": len(self.jobs), "waiting": len(self.waiting),
                         "pending_capacity": self.doc["pending_capacity"]},
            "resources": {"param_bytes": p.param_bytes() if p else 0, "plans": len(p.plans) if p else 0,
                          "resident": bool(p and p.resident), "pinned": self.pinned,
                          "components": {name: {"param_bytes": part.param_bytes(), "resident": part.resident,
                                                "pinned": name in self.pinned_components}
                                         for name, part in (p.components.items() if p else ())}},
            "variants": {"selected": p.selected, "count": len(p.variants)} if p is not None and p.variants else None,
            "batching": {k: engine[k] for k in ("cohorts", "requests")} if engine else None,
            "scheduler": engine,
        }


def checked(fn, public):
    """fn(), a Problem it raises withheld (errors.withhold) unless it quotes nothing."""
    try:
        fn()
    except Problem as e:
        raise withhold(e, public) from None


def probe_problem(failure, quotable):
    """A ProbeFailed as a client may see it: whole for uploaded code, else withheld (a build log,
    a plan's or a trial's message name what the server's source files say)."""
    failed = failure.result
    text = failure.message if failed is None else f"{failed.name}: {failed.message}\n{failed.log}"
    if quotable:
        return Problem(text, failure.code, quotes=False)
    public = {"compile": "a kernel does not build", "plan": "a probe geometry does not plan"}.get(
        failure.code, "a kernel's trial run failed")
    return withhold(Problem(text, failure.code), f"{public} ({failure.code})")


class ProbeFailed(Problem):
    """A kind's probe geometry did not plan (code plan), build (code compile) or pass
    its trial run (proving.py's codes)."""

    def __init__(self, code, message, result=None):
        super().__init__(message, code)
        self.result = result     # the failed BuildResult, for compile


def compile_probes(reg, prepared, binding, sources, done, probes=None, trial=None):
    """Plan and build the kind's probe geometries (or a component's `probes`, with its
    `trial`) for `binding`, then trial-run them in the proving ground (proving.py):
    done(failure, results) once, with failure None or a ProbeFailed, results every
    BuildResult seen."""
    probes, trial = (reg.kind.probes, reg.kind.trial) if probes is None else (probes, trial)
    try:
        layouts = [binding.plan(command, **geometry) for command, geometry in probes]
        trials = [(command, geometry, *io) for command, geometry in probes
                  if (io := trial(binding, command, geometry)) is not None]
    except runtime.LoomError as e:
        done(ProbeFailed("plan", str(e)), [])
        return
    remaining, results, built = [len(layouts)], [], {}
    if not layouts:
        done(None, results)
        return

    def compiled(new):
        if remaining[0] <= 0:
            return      # an earlier layout already failed: that answer stands
        results.extend(new.values())
        built.update(new)
        failed = next((b for b in new.values() if not b.ok), None)
        remaining[0] = 0 if failed is not None else remaining[0] - 1
        if failed is not None:
            done(ProbeFailed("compile", failed.message, failed), results)
        elif remaining[0] == 0:
            prove(reg, prepared, binding, built, trials, lambda failure: done(failure, results))

    for layout in layouts:
        prepared.compile_layout(layout, binding, sources, compiled)


def prove(reg, prepared, binding, built, trials, done):
    """The trial runs, on a worker (the child takes seconds): done(None or ProbeFailed) on the loop."""
    if not trials:
        done(None)
        return
    timeout = reg.trial_timeout

    def work():
        started = time.monotonic()
        failure = proving.prove(proving.job(prepared.device.info, binding, built, trials), timeout)
        log.info("trial run of %s: %s in %.2f s", reg.name, "clean" if failure is None else failure[0],
                 time.monotonic() - started, extra={"event": "trial", "model": reg.name,
                                                    "code": None if failure is None else failure[0]})
        return failure

    def proven(failure, error):
        if error is not None:
            done(ProbeFailed("trial", f"the proving ground could not run: {type(error).__name__}: {error}"))
        else:
            done(None if failure is None else ProbeFailed(*failure))

    reg.loop.run_in_executor(work, proven)


class Registry:
    """All registrations of one server, and the device they share."""

    def __init__(self, server, kinds):
        self.server = server
        self.kinds = {kind.name: kind for kind in kinds}
        # The contract's kind names, plus any this build adds; a known name without a
        # Kind here rejects with unsupported_kind rather than as an unknown value.
        self.document = document_schema(list(language.KINDS) + [k for k in self.kinds if k not in language.KINDS])
        self.registrations = {}
        self.device = None      # opened by open_device() at start
        self.compiler = None
        self.catalog_pending = None     # start-up catalog registrations not yet ready or failed
        # One preparation at a time: uploads are bound by memory bandwidth anyway,
        # and a finished model is evictable while the next one loads.
        self.to_prepare = []
        self.preparing = None
        self.previous_roots = None      # the confinement before this server's (restored by close)

    # -- device --------------------------------------------------------------
    def open_device(self):
        """Probe every OpenCL device and open the chosen one, before any registration
        prepares. Raises device.NoUsableDevice (a ValueError: start fails, exit 2)."""
        from .compiler import BinaryStore, Compiler
        from .device import Device
        cfg = self.server.config
        self.device = Device(cfg.device, cfg.memory_bytes)
        loop = self.server.loop
        binaries = None
        folder = cfg.kernel_cache if cfg.kernel_cache is not None else cache_folder("kernels")
        if folder:
            try:
                binaries = BinaryStore(folder)
            except OSError as e:
                log.warning("kernel cache %s unusable (%s): every start compiles", folder, e)
        self.compiler = Compiler(self.device, lambda fn, done: loop.run_in_executor(fn, done), binaries=binaries)
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
            return [(reg.name, stats) for reg in list(self.registrations.values())
                    if reg.engine is not None and (stats := reg.engine.retained()) is not None]

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
                "opencl_version", "int8_dot", "usable", "reason")
        return [dict({k: row.get(k) for k in keys}, in_use=row["index"] == self.device.info["index"])
                for row in self.device.devices]

    # -- lifecycle -----------------------------------------------------------
    def register(self, doc, base_directory=None, package=None, trusted=False):
        """Validate and start preparing. `doc` is parsed JSON; `package` an uploaded
        source package whose members relative sources name; `trusted`: the start-up
        catalog's (its folders are model roots), else every server path it names must
        resolve inside the model roots (403). Raises Error."""
        try:
            doc = self.document.validate(doc)
        except jsonin.JSONInputError as e:
            raise Error(400, e.message, e.code, e.param) from None
        kind = self.kinds.get(doc["kind"])
        if kind is None:
            raise Error(400, f"kind {doc['kind']!r} has no implementation in this build "
                             f"(served kinds: {', '.join(self.kinds)})", "unsupported_kind", "kind")
        for component in doc.get("components", {}):
            if component not in kind.contracts:
                offered = ", ".join(kind.contracts) or "none"
                raise Error(400, f"a {kind.name} deployment takes no {component!r} component (it takes: {offered})",
                            "unsupported_value", f"components.{component}")
        if doc["model"] in self.registrations:
            raise Error(409, f"model {doc['model']!r} is already registered", "duplicate_model", "model")
        cfg = self.server.config
        if len(self.registrations) >= cfg.registrations:
            raise Error(429, f"{len(self.registrations)} models are registered, the server's limit "
                             "(--registrations); unregister one first", "registration_limit", "model")
        if package is not None:
            retained = sum(r.package.nbytes for r in self.registrations.values() if r.package is not None)
            if retained + package.nbytes > cfg.package_bytes:
                raise Error(429, f"registrations retain {retained} package bytes; this package's {package.nbytes} "
                                 f"would pass the server's limit of {cfg.package_bytes} (--package_bytes)",
                            "package_limit", "model")
        base = doc.get("base_directory") or base_directory
        if base is not None and not os.path.isabs(base):
            raise Error(400, "base_directory must be an absolute path", "invalid_value", "base_directory")
        components = doc.get("components", {}).values()
        located = [doc["checkpoint"]] + [c["checkpoint"] for c in components] + (
            [] if package else [doc[f] for f in ("prepare", "control", "assets") if f in doc] + doc["sources"]
            + [ref for c in components for ref in c["sources"]])
        if base is None and any(not os.path.isabs(p) for p in located):
            raise Error(400, "relative paths need an absolute base_directory", "invalid_value", "base_directory")
        files = Files(doc, base, package)
        if not trusted:
            for param, path in files.server_paths() + kind.server_files(doc, files.checkpoint):
                self.confined(param, path)
        reg = Registration(doc, kind, base)
        reg.package, reg.files = package, files
        reg.loop, reg.trial_timeout = self.server.loop, cfg.trial_timeout
        self.registrations[reg.name] = reg
        log.info("registered %s (%s)", reg.name, kind.name, extra={"event": "registered", "model": reg.name})
        reg.transition(reg.admission)
        if reg.phase == "preparing":
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
        files = reg.files
        options = reg.kind.options(reg.doc, dict(reg.doc.get("options") or {}))
        loop = self.server.loop

        def progress(done, total):
            loop.call_soon_threadsafe(reg.progress.update, {"bytes_done": done, "bytes_total": total})

        def work():
            prepared = runtime.prepare(reg.name, files.sources, files.checkpoint, options, device, self.compiler,
                                       progress, loaded=files.loaded, preserved=files.preserved,
                                       assets=files.assets, includes=files.includes,
                                       extend=reg.kind.extend(reg.doc, options, files.checkpoint),
                                       quotable=files.quotable, quotable_assets=files.quotable_assets)
            try:
                # What a kind finds wrong reads the checkpoint's metadata and config (server files).
                checked(lambda: reg.kind.check(prepared), f"the prepared package cannot serve a {reg.kind.name} "
                                                          "deployment")
                for name, (sources, loaded, checkpoint) in files.components.items():
                    component_options = dict(reg.doc["components"][name].get("options") or {})
                    part = runtime.prepare(f"{reg.name}/{name}", sources, checkpoint, component_options, device,
                                           self.compiler, loaded=loaded, includes=files.includes,
                                           quotable=files.quotable)
                    prepared.components[name] = part
                    checked(lambda: reg.kind.contracts[name].check(prepared, part),
                            f"the {name} component cannot serve with this {reg.kind.name} model")
            except BaseException:
                prepared.release()
                raise
            return prepared

        def finished(prepared, error):
            if reg.timed_out:       # this answer is too late: the registration has already failed
                if prepared is not None:
                    prepared.release()
                return
            if error is not None:
                self.server.loop.call_soon(self._prepared, reg)
                code = error.code if isinstance(error, Problem) else "internal"
                if not isinstance(error, Problem):      # unexpected: it may hold anything it read
                    error = Problem(f"{type(error).__name__}: {error}", code)
                if error.quotes:
                    error = withhold(error, "preparation failed", code=code)
                self._failed(reg, code, error.message, error.private)
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
        reg.deadline = loop.call_later(self.server.config.prepare_timeout, self._timed_out, reg)

    def _timed_out(self, reg):
        """A preparation past --prepare_timeout fails, and the next one may start; a worker
        still stuck in it is left to finish, and what it then returns is released."""
        if self.preparing is not reg or reg.phase not in ("preparing", "removing"):
            return
        reg.timed_out = True
        self._prepared(reg)
        self._failed(reg, "prepare_timeout", f"preparation took longer than {self.server.config.prepare_timeout:g} "
                                            "seconds (--prepare_timeout)")
        if reg.removing:
            self._remove(reg)

    def _probe(self, reg, prepared):
        """Compile the kind's stage commands at a small geometry before declaring the
        model ready: a package whose kernels do not build fails its registration
        (phase failed, code compile) instead of failing its first requests."""
        def probed(failure, _results):
            if reg.timed_out:
                prepared.release()
                return
            if failure is None:
                self._ready(reg, prepared)
                return
            prepared.release()
            problem = probe_problem(failure, reg.files.quotable)
            self._failed(reg, problem.code, problem.message, problem.private)
            self.server.loop.call_soon(self._prepared, reg)
            if reg.removing:
                self._remove(reg)

        steps = [(prepared, reg.kind.probes, reg.kind.trial)] + [
            (part, reg.kind.contracts[name].probes, reg.kind.contracts[name].trial)
            for name, part in prepared.components.items()]

        def next_step(failure, results):
            if failure is not None or not steps:
                probed(failure, results)
                return
            part, probes, trial = steps.pop(0)
            compile_probes(reg, part, part.binding, part.sources, next_step, probes, trial)

        next_step(None, [])

    def _ready(self, reg, prepared):
        if reg.deadline is not None:
            self.server.loop.cancel_timer(reg.deadline)
        self.server.loop.call_soon(self._prepared, reg)   # the next preparation may start
        if reg.removing:
            prepared.release()
            self._remove(reg)
            return
        reg.prepared = prepared
        reg.transition("prepared")
        if reg.doc["variant_capacity"] > 0:
            # The prepared execution is the first choice; staged variants are checked against it.
            first = runtime.Variant(runtime.next_variant_id(), None, prepared.binding, prepared.sources)
            first.phase, first.users = "ready", 1
            prepared.variants[first.id] = first
            prepared.selected = first.id
        reg.engine = reg.kind.start(reg, self.server.loop)
        reg.engine.step_timeout = reg.doc["step_timeout"]
        reg.engine.on_failed = lambda message: self._step_failed(reg, message)
        log.info("prepared %s: %d parameter bytes", reg.name, prepared.param_bytes(),
                 extra={"event": "prepared", "model": reg.name, "param_bytes": prepared.param_bytes()})
        self._settle(reg)

    def _step_failed(self, reg, message):
        """A device step passed its deadline: the deployment fails (503 step_timeout from
        now on, the reason in /v1/status); its queue is answered; the server serves on."""
        if reg.phase != "ready":
            return
        reg.transition("failed")
        reg.error = {"code": "step_timeout", "message": message}
        error = Error(503, message, "step_timeout", "model")
        waiting, reg.waiting = reg.waiting, []
        for job in waiting:
            job.fail(error)

    def _failed(self, reg, code, message, private=None):
        """The registration fails with `message` (public: /v1/status, answers, /logz); `private`,
        the whole diagnostic about server files, goes to the server's standard error alone."""
        if reg.deadline is not None:
            self.server.loop.cancel_timer(reg.deadline)
        reg.transition("failed")
        reg.error = {"code": code, "message": message}
        log.error("preparing %s failed (%s): %s", reg.name, code, message,
                  extra={"event": "prepare_failed", "model": reg.name, "code": code, PRIVATE: private})
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
        docs = [dict(doc, base_directory=os.path.join(folder, doc["base_directory"]))
                if isinstance(doc, dict) and isinstance(doc.get("base_directory"), str) else doc for doc in catalog]
        self.load_documents(docs, folder, path)

    def load_documents(self, docs, folder=None, path="the default catalog"):
        """Register the start-up catalog's documents. They are the operator's own: their
        folders become model roots (set before anything is read) and they are not checked."""
        self.set_roots(catalog_folders(docs, folder) + ([folder] if folder else []))
        for i, doc in enumerate(docs):
            try:
                self.register(doc, folder, trusted=True).from_catalog = True
            except Error as e:
                raise ValueError(f"{path}: model document {i}: {e.message}") from None

    def set_roots(self, catalog):
        """Confine the server's file reads to the model roots: --model_root (default: Loom's
        cache folder), Loom's shipped packages and kernels, and the catalog's own folders."""
        from . import resource
        cfg = self.server.config
        chosen = list(cfg.model_root) if cfg.model_root is not None else [cache_folder("")]
        for root in cfg.model_root or ():
            if not os.path.isdir(root):
                raise ValueError(f"--model_root {root}: not a directory")
        roots = chosen + [resource("models"), resource("opencl")] + catalog
        self.previous_roots = confine(roots)
        log.info("model roots: %s", ", ".join(model_roots()), extra={"event": "model_roots",
                                                                    "roots": list(model_roots())})

    def confined(self, param, path):
        """403 before anything is read when a server path resolves outside the model roots."""
        if outside_roots(path):
            raise Error(403, f"{param} {path!r} resolves outside the server's model roots (--model_root); the "
                             "server reads no file there", "outside_model_root", param)

    # -- residency -----------------------------------------------------------
    # A registration's residency components: "primary" (reg.prepared) and its extra ones
    # (reg.prepared.components, a text model's "image"). Each leaves the device (deactivate,
    # memory pressure) only while nothing uses it, and streams back on demand, exactly as
    # preparation uploaded it (runtime.Prepared.restore).
    @staticmethod
    def _part(reg, name):
        p = reg.prepared
        return None if p is None else p if name == "primary" else p.components.get(name)

    @staticmethod
    def _used(reg, name):
        return reg.in_flight if name == "primary" else reg.users.get(name, 0)

    def acquire(self, reg, ready, components=()):
        """Count a use of reg's parameters and of the extra `components` a job needs (a chat's
        images: "image"); ready(error) once all are resident (at once if they are, after
        streaming the evicted ones back if not)."""
        with reg.lock:
            missing = next((name for name in ("primary", *components)
                            if (part := self._part(reg, name)) is None or not part.resident), None)
            if missing is None:
                reg.in_flight += 1
                for name in components:
                    reg.users[name] = reg.users.get(name, 0) + 1
                reg.last_used = time.monotonic()
        if missing is None:
            ready(None)
        else:
            self.activate(reg, lambda error: ready(error) if error else self.acquire(reg, ready, components), missing)

    def release_use(self, reg, components=()):
        with reg.lock:
            reg.in_flight -= 1
            for name in components:
                reg.users[name] -= 1
            reg.last_used = time.monotonic()
        for name in ("primary", *components):
            self._deactivate_if_wanted(reg, name)

    def deactivate_when_unused(self, reg, name="primary"):
        """Deactivation as an administrator asks for it: now, or once the drained work
        still using the component and any upload of it under way are done."""
        reg.deactivate_when_idle.add(name)
        self._deactivate_if_wanted(reg, name)

    def _deactivate_if_wanted(self, reg, name):
        """A deactivation asked for while `name` was in use or streaming back happens once it is neither."""
        if name in reg.deactivate_when_idle and not self._used(reg, name) and name not in reg.restoring:
            reg.deactivate_when_idle.discard(name)
            self.deactivate(reg, name)

    def activate(self, reg, done=None, name="primary"):
        """Stream a component's evicted parameters back from its own checkpoint (on a
        worker; only that component's weights move); done(error) on the loop."""
        waiters = [done] if done else []
        if name in reg.restoring:
            reg.restoring[name] += waiters
            return
        part = self._part(reg, name)
        if part is None or part.resident:
            for fn in waiters:
                fn(None if part is not None else RuntimeError(f"{reg.name} is not prepared"))
            return
        reg.restoring[name] = waiters
        checkpoint = reg.files.checkpoint if name == "primary" else reg.files.components[name][2]
        label = reg.name if name == "primary" else f"{reg.name}/{name}"
        component = {} if name == "primary" else {"component": name}
        log.info("activating %s", label, extra={"event": "activating", "model": reg.name, **component})

        def restored(_result, error):
            callbacks = reg.restoring.pop(name)
            if error is not None:
                log.error("activating %s failed: %s", label, error, extra={"event": "activate_failed",
                                                                         "model": reg.name, **component,
                                                                         PRIVATE: getattr(error, "private", None)})
            for fn in callbacks:
                fn(error)
            self._deactivate_if_wanted(reg, name)
            self._restored(reg)

        reg.restores += 1
        self.server.loop.run_in_executor(lambda: part.restore(checkpoint), restored)

    def _restored(self, reg):
        # An unregistration that came while the upload ran releases what it charged now.
        reg.restores -= 1
        self._retire_if_idle(reg)

    def deactivate(self, reg, name="primary"):
        """Evict a component's parameters now if nothing is using them or streaming them
        back (the other components' stay); returns the bytes freed."""
        with reg.lock:
            part = self._part(reg, name)
            if part is None or self._used(reg, name) or name in reg.restoring:
                return 0
            freed = part.evict()
        label = reg.name if name == "primary" else f"{reg.name}/{name}"
        log.info("deactivated %s: %d bytes", label, freed,
                 extra={"event": "deactivated", "model": reg.name, "bytes": freed,
                        **({} if name == "primary" else {"component": name})})
        return freed

    def _evict_for(self, needed, requester):
        """The pool's evictor: least recently used, unpinned, idle parameters of
        other deployments (their extra components first) leave the device until
        `needed` bytes are free."""
        freed = 0
        candidates = sorted((r for r in list(self.registrations.values())
                             if r.name != requester and r.prepared is not None), key=lambda r: r.last_used)
        for reg in candidates:
            for name in reg.prepared.components:
                if freed < needed and name not in reg.pinned_components:
                    freed += self.deactivate(reg, name)
            if freed < needed and not reg.pinned:
                freed += self.deactivate(reg)
        return freed

    # -- admission -----------------------------------------------------------
    def admit(self, name, kind):
        """The registration serving `name` for an endpoint of `kind` (a Kind), or Error."""
        if not isinstance(name, str):
            raise Error(400, "model must be a string", "invalid_type", "model")
        reg = self.registrations.get(name)
        if reg is None or reg.removing:
            raise Error(404, f"model {name!r} does not exist", "model_not_found", "model")
        if reg.kind is not kind:
            raise Error(404, f"model {name!r} is a {reg.kind.name} deployment, not {kind.name}", "model_not_found",
                        "model")
        if not reg.doc["endpoint"]:
            raise Error(404, f"model {name!r} is a native-only activity model: it serves no HTTP inference "
                             "(its management and tokenizer utilities stay available)", "model_not_found", "model")
        if reg.phase == "failed" and reg.error["code"] == "step_timeout":
            raise Error(503, f"model {name!r} failed: {reg.error['message']}", "step_timeout", "model")
        if reg.phase == "failed":
            # Not retryable: the package, checkpoint or driver must change (422, as a failed variant).
            raise Error(422, f"model {name!r} failed to prepare ({reg.error['code']}): "
                                 f"{first_line(reg.error['message'])}; GET /v1/status has the whole reason",
                            "model_failed", "model")
        if reg.phase != "ready":
            raise Error(503, f"model {name!r} is {reg.phase}, not prepared yet", "model_not_ready", "model")
        return reg

    def enter(self, reg, job):
        """Pass the admission gate: job.start(error) runs once it may use the
        device. A drained gate queues (bounded by pending_capacity, then 503)."""
        capacity = reg.doc["pending_capacity"]
        if reg.admission != "open" or reg.waiting:
            if len(reg.waiting) >= capacity:
                raise Error(503, f"model {reg.name!r} has a full queue", "queue_full", "model",
                            headers=[("Retry-After", "1")])
            reg.waiting.append(job)
            return
        backlog = reg.engine.backlog() if reg.engine is not None and job.resident else 0
        if backlog >= capacity:
            # Open admission is bounded too: requests accepted but not yet running.
            raise Error(503, f"model {reg.name!r} has {backlog} requests waiting to run (pending_capacity "
                             f"{capacity})", "queue_full", "model", headers=[("Retry-After", "1")])
        self._start(reg, job)

    def enter_ungated(self, reg, job):
        """Start now, past a drained gate (control work that never waits for inference);
        the registration still counts the job until it finishes."""
        self._start(reg, job)

    def _start(self, reg, job):
        reg.jobs.add(job)
        if job.resident:
            self.acquire(reg, job.start, job.components)
        else:
            job.start(None)     # control work on retained state: the weights need not be resident

    def leave(self, reg, job, acquired):
        """A job is done with the device (its accepted work has retired)."""
        reg.jobs.discard(job)
        if acquired:
            self.release_use(reg, job.components)
        self._retire_if_idle(reg)

    def staged(self, reg, delta):
        """A variant's compilation started (+1) or settled (-1). An unregistered model
        goes only once its staged compilations have actually finished."""
        reg.staging += delta
        self._retire_if_idle(reg)

    def _retire_if_idle(self, reg):
        if (reg.removing and not reg.jobs and not reg.staging and not reg.restores and self.preparing is not reg
                and self.registrations.get(reg.name) is reg):
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
            reg.transition("undrain")
            self.to_prepare.append(reg)
            self._next_preparation()
        self._open_gate(reg)

    def unregister(self, reg, mode):
        """Stop admitting; waiting jobs get 410; `abort` withdraws in-flight ones too.
        The registration goes once its accepted work has retired."""
        if reg.removing:
            return
        reg.removing = mode
        reg.transition("unregister")
        gone = Error(410, f"model {reg.name!r} was unregistered", "model_unregistered", "model")
        waiting, reg.waiting = reg.waiting, []
        for job in waiting:
            job.fail(gone)
        readers, reg.readers = reg.readers, set()
        for reader in readers:
            reader(gone)  # the compilation itself still joins the compiler
        if mode == "abort":
            for job in list(reg.jobs):
                job.fail(gone)
        if reg in self.to_prepare:
            self.to_prepare.remove(reg)
        log.info("unregistering %s (%s)", reg.name, mode, extra={"event": "unregistering", "model": reg.name})
        self._retire_if_idle(reg)

    def _remove(self, reg):
        if self.registrations.get(reg.name) is reg:
            del self.registrations[reg.name]
        self._settle(reg)
        if reg.prepared is not None:
            if reg.error is not None and reg.error["code"] == "step_timeout":
                # Its stuck kernel still uses these buffers: releasing them waits in the driver,
                # which the loop must never do.
                threading.Thread(target=reg.prepared.release, name=f"loom-release-{reg.name}", daemon=True).start()
            else:
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
        confine(self.previous_roots)




def catalog_folders(docs, folder):
    """The folders a catalog's documents name (base_directory, and the folder of every server
    path they hold: checkpoints, sources, assets, components, a kind's extra files)."""
    out = []
    for doc in docs:
        if not isinstance(doc, dict):
            continue
        base = doc.get("base_directory") if isinstance(doc.get("base_directory"), str) else folder
        refs = [doc.get(f) for f in ("checkpoint", "prepare", "control", "assets")] + list(doc.get("sources") or [])
        for component in (doc.get("components") or {}).values():
            if isinstance(component, dict):
                refs += [component.get("checkpoint")] + list(component.get("sources") or [])
        loras = ((doc.get("options") or {}).get("loras") or {}) if isinstance(doc.get("options"), dict) else {}
        if isinstance(loras, dict):
            refs += [v for v in loras.values() if isinstance(v, str) and os.path.isabs(v)]
        if base:
            out.append(base)
        for ref in refs:
            if isinstance(ref, str) and ref and (base or os.path.isabs(ref)):
                path = runtime.resolve(base, ref) if base else ref
                out.append(path if os.path.isdir(path) else os.path.dirname(path))
    return out


def first_line(text, chars=300):
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")[:chars]


