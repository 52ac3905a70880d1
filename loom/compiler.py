"""JIT builds of OpenCL programs, the specialization cache, and build diagnostics.

    compiler = Compiler(device, lambda fn, done: loop.run_in_executor(fn, done))
    source = compiler.library_source("matvec")             # opencl/common.cl + opencl/matvec.cl
    compiler.compile_async(source, {"ROWS": 4, "EPS": 1e-5}, name="matvec", on_done=ready)
    def ready(result):                                      # on the loop thread
        if result.ok:                                       # Executable
            compiler.pin(result)                            # while a live plan uses it
            result.kernels["matvec"]
        else:                                               # BuildFailure
            log.warning("%s: %s", result.message, result.log)

A program is built from source text, specialization ``defines`` (passed as
``-D NAME=VALUE``) and extra ``options`` (OpenCL ``-cl-*`` flags only). The cache
key is the sha256 of the full source, the sorted defines, the options and the
device identity, so the same text specialized the same way is built once per
device. Defines are checked before anything is built: names are C identifiers,
values are ints, finite floats (emitted as single-precision literals, ``1e-05f``)
or simple tokens without spaces or quotes, so nothing can smuggle in options.

Builds run on a worker through ``submit(fn, done)`` (done runs on the loop
thread); concurrent requests for a key being built join that one build. Kernel
objects are created on the thread that receives the result, never on the
worker: pyopencl kernels are not thread-safe, and each is used only from the
loop (set arguments, enqueue, in one go).

The cache holds at most ``capacity`` executables, least recently used first out,
except that pinned executables (``pin``/``unpin``, reference-counted by the
plans and variants that hold them) are never evicted: ``capacity`` bounds the
unpinned ones. Failures are not cached, so a fixed source (or a retry) builds
again. Build logs are kept on both outcomes, bounded to ``LOG_CHARS``.

With ``binaries`` (a ``BinaryStore``: the server's ``--kernel_cache`` folder) a
successful build also leaves the device binary on disk under the same key, and
a later build of that key (the next start) loads it instead of compiling: tens
of milliseconds instead of seconds a kernel. The key names the device, its
driver version and, for CPU drivers, the host's instruction set; a file that
does not read back whole, or that the driver refuses, is deleted and the
source is built again.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import numbers
import os
import re
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyopencl as cl
# The low-level program object and its raw _build() compile exactly the options
# we pass and nothing else. The high-level cl.Program adds include paths,
# consults its own disk cache and writes failing sources to temporary files,
# and its build() re-reports a non-empty log as a warning; we keep the log.
from pyopencl._cl import _Program

import loom
from .device import kernel_defines
from .logs import PRIVATE

__all__ = ["Compiler", "Executable", "BuildFailure", "BinaryStore", "LIBRARY", "LOG_CHARS", "run_now"]

log = logging.getLogger("loom.compiler")

LIBRARY = Path(loom.resource("opencl"))
LOG_CHARS = 64 << 10      # build log kept per outcome (its head)
MESSAGE_CHARS = 300       # the one-line failure message

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOKEN = re.compile(r"-?[A-Za-z0-9_.]+")
_OPTION = re.compile(r"-cl-[a-z0-9-]+(=[A-Za-z0-9.]+)?|-w|-Werror")
_LIBRARY_NAME = re.compile(r"[A-Za-z0-9_]+")


def _define(name, value) -> str:
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise ValueError(f"define name must be a C identifier, got {name!r}")
    # numbers.* admits numpy scalars, as checkpoint metadata often yields them.
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        value = int(value)
        if not -(1 << 63) <= value < (1 << 64):
            raise ValueError(f"define {name}={value} does not fit 64 bits")
        text = str(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"define {name} must be finite, got {value!r}")
        text = repr(value) + "f"
    elif isinstance(value, str) and _TOKEN.fullmatch(value):
        text = value
    else:
        raise ValueError(f"define {name} must be an int, a finite float or a simple token "
                         f"(letters, digits, _ and .), got {value!r}")
    return f"-D{name}={text}"


def _bounded(text: str) -> str:
    if len(text) <= LOG_CHARS:
        return text
    return text[:LOG_CHARS] + f"\n[... {len(text) - LOG_CHARS} more characters truncated]"


def _deliver(callbacks, outcome):
    for on_done in callbacks:
        try:
            on_done(outcome)
        except Exception:  # one broken consumer must not starve the others or the loop
            log.exception("compile callback for %s failed", outcome.name)


def run_now(fn, done):
    """A `submit` that runs fn on the calling thread: for tools, benchmarks and tests."""
    try:
        result, error = fn(), None
    except Exception as e:  # handed to done, as the server's executor does
        result, error = None, e
    done(result, error)


class BuildError(Exception):
    """A failed build on the worker, carried to the loop as ``error``."""

    def __init__(self, log_text, seconds):
        # The first line the compiler flagged as an error says the most.
        first = next((line.strip() for line in log_text.splitlines() if "error" in line.lower()), "")
        first = first if len(first) <= MESSAGE_CHARS else first[:MESSAGE_CHARS] + "..."
        super().__init__(f"OpenCL build failed: {first}" if first else "OpenCL build failed")
        self.message = str(self)
        self.log = log_text
        self.seconds = seconds


class Executable:
    """A built program: ``kernels`` by function name, with its build evidence."""

    ok = True

    def __init__(self, key, name, program, build_seconds, log_text):
        self.key = key
        self.name = name
        self.program = program
        self.kernels = {k.function_name: k for k in program.all_kernels()}
        self.build_seconds = build_seconds
        self.log = log_text
        self.pins = 0

    def __repr__(self):
        return f"<Executable {self.name} {self.key[:12]} kernels={sorted(self.kernels)}>"

    def binary(self) -> bytes:
        """The device binary, for the proving ground's child to load instead of rebuilding."""
        return bytes(self.program.get_info(cl.program_info.BINARIES)[0])


class BuildFailure:
    """A build that failed: ``message`` for the error envelope, ``log`` from the compiler."""

    ok = False

    def __init__(self, key, name, message, log_text):
        self.key = key
        self.name = name
        self.message = message
        self.log = log_text

    def __repr__(self):
        return f"<BuildFailure {self.name} {self.key[:12]}: {self.message}>"


class BinaryStore:
    """Device binaries on disk, one file per cache key: MAGIC, the sha256 of the rest,
    the build log's length (4 bytes) and text, then the binary. Bounded to
    ``capacity_bytes``: the oldest files go first."""

    MAGIC = b"LOOMBIN1"

    def __init__(self, folder, capacity_bytes: int = 1 << 30):
        self.folder = Path(folder)
        self.capacity_bytes = capacity_bytes
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, key):
        return self.folder / f"{key}.bin"

    def get(self, key):
        """(binary, log) or None."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        head = len(self.MAGIC) + 32
        body = data[head:]
        if data[:len(self.MAGIC)] != self.MAGIC or hashlib.sha256(body).digest() != data[len(self.MAGIC):head] \
                or len(body) < 4 or 4 + int.from_bytes(body[:4], "little") > len(body):
            self.discard(key)
            return None
        size = int.from_bytes(body[:4], "little")
        return body[4 + size:], body[4:4 + size].decode("utf-8", "replace")

    def put(self, key, binary: bytes, log_text: str):
        text = log_text.encode("utf-8")
        body = len(text).to_bytes(4, "little") + text + bytes(binary)
        fd, temp = tempfile.mkstemp(dir=self.folder, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self.MAGIC + hashlib.sha256(body).digest() + body)
            os.replace(temp, self._path(key))   # readers see the whole file or none
        except BaseException:
            os.unlink(temp)
            raise
        self._trim()

    def discard(self, key):
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:        # a read-only cache: the file stays, the source is built anyway
            log.warning("kernel cache %s: cannot remove %s: %s", self.folder, key[:12], e)

    def _trim(self):
        files = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".bin"):
                try:
                    stat = entry.stat()
                except FileNotFoundError:
                    continue                    # another process trimmed it
                files.append((stat.st_mtime, stat.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.capacity_bytes:
                break
            Path(path).unlink(missing_ok=True)
            total -= size


class Compiler:
    """The build service and cache of one Device; see the module docstring."""

    def __init__(self, device, submit, capacity: int = 256, library: Path | str | None = None,
                 binaries: BinaryStore | None = None):
        if type(capacity) is not int or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.device = device
        self.capacity = capacity
        self.library = Path(library) if library is not None else LIBRARY
        self._submit = submit
        self.binaries = binaries
        self._lock = threading.Lock()      # start-up or preparation threads may compile too
        self._cache: collections.OrderedDict = collections.OrderedDict()   # key -> Executable, LRU first
        self._building: dict = {}          # key -> [on_done waiters]
        self._stats = {"builds": 0, "failures": 0, "hits": 0, "misses": 0, "build_seconds": 0.0,
                       "binaries_loaded": 0}
        self._counters = None              # (builds, lookups, seconds) once metrics() registered them

    # -- sources -----------------------------------------------------------

    def library_file(self, name: str):
        """The text of ``opencl/NAME`` (a plain file name: .cl or .h) for an #include, or None."""
        if "/" in name or not re.fullmatch(r"[A-Za-z0-9_]+\.(cl|h)", name):
            return None
        path = self.library / name
        return path.read_text(encoding="utf-8") if path.is_file() else None

    def library_source(self, name: str) -> str:
        """``opencl/NAME.cl`` with ``common.cl`` (when present) in front. Reads
        files: call it while preparing, not on the loop."""
        if not isinstance(name, str) or not _LIBRARY_NAME.fullmatch(name) or name == "common":
            raise ValueError(f"not a library kernel name: {name!r}")
        path = self.library / f"{name}.cl"
        if not path.is_file():
            raise ValueError(f"no library kernel {name!r} in {self.library}")
        parts = []
        common = self.library / "common.cl"
        if common.is_file():
            # #line keeps compiler diagnostics pointing at the right file and line.
            parts.append(f'#line 1 "common.cl"\n{common.read_text(encoding="utf-8")}\n')
        parts.append(f'#line 1 "{name}.cl"\n{path.read_text(encoding="utf-8")}')
        return "".join(parts)

    def _prepare(self, source: str, defines=None, options=()) -> tuple:
        """(cache key, build options) after validating defines and options."""
        if not isinstance(source, str):
            raise ValueError("source must be text")
        defines = dict(defines or {}, **kernel_defines(getattr(self.device, "info", {})))
        if isinstance(options, str):
            raise ValueError("options must be a sequence of separate flags")
        options = tuple(options)
        for option in options:
            if not isinstance(option, str) or not _OPTION.fullmatch(option):
                raise ValueError(f"unsupported build option {option!r} (allowed: -cl-*, -w, -Werror)")
        flags = [_define(name, defines[name]) for name in sorted(defines)] + list(options)
        key = hashlib.sha256(json.dumps([hashlib.sha256(source.encode()).hexdigest(), flags,
                                         self.device.identity]).encode()).hexdigest()
        return key, " ".join(flags)

    # -- building ----------------------------------------------------------

    def compile_async(self, source: str, defines=None, options=(), *, name: str = "program", on_done) -> None:
        """Deliver an Executable or BuildFailure to ``on_done(result)`` through
        ``submit``'s done callback (the loop thread), never before returning.
        Bad defines or options raise ValueError here, at once."""
        key, flags = self._prepare(source, defines, options)
        with self._lock:
            cached = self._lookup(key)
            if cached is None:
                waiters = self._building.get(key)
                if waiters is not None:     # join the build already running
                    waiters.append(on_done)
                    return
                self._building[key] = [on_done]
        if cached is not None:
            self._submit(lambda: cached, lambda result, error: _deliver([on_done], cached))
            return
        self._submit(lambda: self._build(source, flags, key),
                     lambda result, error: self._built(key, name, result, error))

    def compile(self, source: str, defines=None, options=(), *, name: str = "program"):
        """Build (or fetch) on the calling thread: for start-up and tests."""
        key, flags = self._prepare(source, defines, options)
        with self._lock:
            cached = self._lookup(key)
        if cached is not None:
            return cached
        try:
            built, error = self._build(source, flags, key), None
        except BuildError as e:
            built, error = None, e
        return self._finish(key, name, built, error)

    def _lookup(self, key):
        # Under the lock.
        found = self._cache.get(key)
        self._stats["hits" if found is not None else "misses"] += 1
        if self._counters:
            self._counters[1].inc(result="hit" if found is not None else "miss")
        if found is not None:
            self._cache.move_to_end(key)
        return found

    def load_binary(self, binary: bytes, name: str = "program"):
        """An Executable from a device binary built earlier by this device's driver
        (uncached): the proving ground's child runs exactly what the server built."""
        return Executable("binary", name, self._from_binary(binary), 0.0, "")

    def _from_binary(self, binary):
        program = _Program(self.device.context, [self.device.cl_device], [binary])
        program._build(options=b"", devices=[self.device.cl_device])
        return program

    def _build(self, source, flags, key):
        """On a worker: (program, seconds, log) or raise BuildError."""
        start = time.perf_counter()
        stored = self.binaries.get(key) if self.binaries is not None else None
        if stored is not None:
            try:
                program = self._from_binary(stored[0])
            except cl.Error as e:           # a driver update the identity missed: build again
                log.warning("stored binary %s refused (%s); building from source", key[:12], e)
                self.binaries.discard(key)
            else:
                with self._lock:
                    self._stats["binaries_loaded"] += 1
                return program, time.perf_counter() - start, stored[1]
        program = _Program(self.device.context, source)
        try:
            program._build(options=flags.encode(), devices=[self.device.cl_device])
        except cl.Error as e:
            try:
                text = program.get_build_info(self.device.cl_device, cl.program_build_info.LOG)
            except cl.Error:
                text = ""
            raise BuildError(text or str(e), time.perf_counter() - start) from None
        seconds = time.perf_counter() - start
        text = program.get_build_info(self.device.cl_device, cl.program_build_info.LOG)
        if self.binaries is not None:
            try:
                self.binaries.put(key, program.get_info(cl.program_info.BINARIES)[0], text)
            except (OSError, cl.Error) as e:     # a full or read-only disk costs the next start only
                log.warning("kernel cache %s: cannot store a binary: %s", self.binaries.folder, e)
                self.binaries = None
        return program, seconds, text

    def _built(self, key, name, result, error):
        outcome = self._finish(key, name, result, error)
        with self._lock:
            waiters = self._building.pop(key, [])
        _deliver(waiters, outcome)

    def _finish(self, key, name, built, error):
        """Turn a build result into an outcome, count it and cache a success."""
        if error is None:
            program, seconds, text = built
            try:
                outcome = Executable(key, name, cl.Program(program), seconds, _bounded(text))
            except cl.Error as e:  # creating the kernels can still fail after a clean build
                error = BuildError(f"{text}\nerror: creating kernels: {e}", seconds)
        if error is not None:
            if not isinstance(error, BuildError):  # a bug or a driver crash is still a failure
                error = BuildError(f"error: {error!r}", 0.0)
            outcome = BuildFailure(key, name, error.message, _bounded(error.log))
            seconds = error.seconds
        with self._lock:
            self._stats["builds" if outcome.ok else "failures"] += 1
            self._stats["build_seconds"] += seconds
            if self._counters:
                self._counters[0].inc(outcome="ok" if outcome.ok else "failed")
                self._counters[2].inc(seconds)
            if outcome.ok:
                # A synchronous build may have cached this key meanwhile: keep one object.
                outcome = self._cache.setdefault(key, outcome)
                self._cache.move_to_end(key)
                self._evict()
        if not outcome.ok:
            # The kernel's name and the compiler's words quote its source, which may be a server
            # file: the public log (/logz) names the deployment, the operator's stderr the rest.
            log.warning("a kernel build of %s failed", name.rsplit("/", 1)[0],
                        extra={PRIVATE: f"build of {name} failed: {outcome.message}"})
        return outcome

    # -- residency ---------------------------------------------------------

    def pin(self, executable: Executable) -> None:
        """Keep ``executable`` cached while a holder uses it (counted)."""
        with self._lock:
            executable.pins += 1
            self._cache.setdefault(executable.key, executable)

    def unpin(self, executable: Executable) -> None:
        with self._lock:
            if executable.pins <= 0:
                raise ValueError(f"{executable!r} is not pinned")
            executable.pins -= 1
            self._evict()

    def _evict(self):
        # Under the lock: drop least recently used unpinned entries past capacity.
        unpinned = sum(1 for e in self._cache.values() if not e.pins)
        for key in [k for k, e in self._cache.items() if not e.pins][:max(0, unpinned - self.capacity)]:
            del self._cache[key]

    # -- observability -----------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats, entries=len(self._cache),
                        pinned=sum(1 for e in self._cache.values() if e.pins),
                        compiling=len(self._building), capacity=self.capacity)

    def metrics(self, registry) -> None:
        with self._lock:
            builds = registry.counter("loom_jit_builds", "OpenCL program builds, by outcome.", ("outcome",))
            builds.inc(self._stats["builds"], outcome="ok")
            builds.inc(self._stats["failures"], outcome="failed")
            lookups = registry.counter("loom_jit_cache_lookups", "Program cache lookups, by result.", ("result",))
            lookups.inc(self._stats["hits"], result="hit")
            lookups.inc(self._stats["misses"], result="miss")
            seconds = registry.counter("loom_jit_build_seconds", "Seconds spent building programs.")
            seconds.inc(self._stats["build_seconds"])
            self._counters = (builds, lookups, seconds)
        registry.gauge_fn("loom_jit_cache_entries", "Built programs held in the cache.", lambda: len(self._cache))
        registry.gauge_fn("loom_jit_compiling", "Program builds in progress.", lambda: len(self._building))
