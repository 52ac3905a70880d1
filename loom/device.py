"""OpenCL device: drivers and probing, selection, the context and its one queue, and the memory pool.

    device = Device("cpu")                       # or None: the first usable GPU, else the best CPU
    buf = device.pool.alloc(a.nbytes, owner="scout", kind="params", host=a)
    device.upload(buf, a); out = device.download(buf, np.float32, a.size)
    pending = device.download_async(buf, np.int32, 4)   # poll pending.done() from the loop
    kernel = device.kernel(executable.program, "matmul"); kernel.set_args(...)
    event = device.launch(kernel, (4864,), (8,)); device.flush(); device.finished(event)
    device.copy_blocks(...), device.read_blocks_async(...), device.write_blocks_async(...)  # KV pages
    buf.release()

The rest of the server reaches OpenCL only through this module and
compiler.py (tests/test_layers.py checks it): kernels, launches, the queue,
asynchronous and rectangular copies, and ``DriverError`` for what drivers raise.

Drivers: the ICD loader (the one bundled in pyopencl's wheel) finds drivers by
the ``.icd`` files in /etc/OpenCL/vendors (or the folder OCL_ICD_VENDORS names),
plus the PoCL that PyPI's pocl-binary-distribution puts beside pyopencl. Intel's CPU runtime from PyPI
(``intel-opencl-rt``, which make install adds on x86-64) ships an ``.icd`` file
with a placeholder path, so :func:`arrange_loader` writes a private vendors
folder naming it and every system driver, and points OCL_ICD_VENDORS at it,
before pyopencl first enumerates platforms (the loader reads its configuration
once per process). A user's own OCL_ICD_VENDORS is left alone: that is how an
operator, or a benchmark, hides drivers from the loader.

Probing: every device found is probed by building and running a small kernel
(local memory, a barrier, f16 storage loads) whose result is checked; a device
whose driver fails is skipped, with the reason (the build log's first lines or
the wrong values) in its row. Probes run in a child process (``python -m
loom.device --probe``), so a driver that crashes (SIGILL on a CPU it
mistakes) or hangs on a build is skipped too, instead of taking the server
down; a second child carries on after the device that killed the first.
PoCL 3.0 from PyPI fails here on CPUs its LLVM does not know (``unknown
target CPU 'generic'`` on Zen 5).

Selection (``--device``): None picks the first usable GPU of any platform, else
the best usable CPU, where best is ``DRIVER_PREFERENCE`` (measured, see
docs/operations.md) then the newer driver version then enumeration order. A
selector is "cpu", "gpu" or "accelerator" (the best usable of that type), a flat
index "N" into :func:`list_devices`, "P:D" (platform index, device index within
it), a driver family ("intel", "pocl", ...: the best usable device of that
driver) or a case-insensitive substring of the device name (the best usable match).
A selector that matches nothing, or only unusable devices, raises
:class:`NoUsableDevice` naming what was tried and how to get a driver.

Memory: every device buffer of the server comes from ``device.pool`` and is
accounted by owner (a deployment name, "server", ...) and kind:

* ``params``    model weights
* ``state``     retained state: KV pages, sessions, checkpoints
* ``workspace`` per-step scratch
* ``staging``   host transfer buffers

The pool is bounded by ``memory_bytes`` (``--memory_bytes``). Its default is
``DEFAULT_MEMORY_FRACTION`` (80%) of the device's global memory: the rest is
headroom for what the driver allocates outside our buffers (programs, queues,
private and local memory) and, on CPU drivers, for the host process sharing that RAM.
An allocation that does not fit first drops idle cached workspace, then asks
the evictor (the residency manager) to free memory, then raises
:class:`OutOfDeviceMemory`, which the server answers with 503.

Workspace reuse: a released workspace buffer is not freed but kept in a free
list keyed by (owner, capacity), and the owner's next workspace alloc of the
same size bucket takes it back, so per-step scratch is not recreated every
step. Workspace capacities are rounded up to a multiple of a quarter of their
power of two, and of 256 bytes (so at most 25% over any request above 1 KiB,
and four size buckets per octave). Cached buffers stay counted as
their owner's "workspace" until reused or trimmed: by memory pressure, by
``trim()`` (``POST /v1/devices/trim``), or by ``trim(0, owner=name)`` when an
owner retires. Reusing a buffer right after its release is safe because the
device has a single in-order queue: later commands run after earlier ones.

The pool is thread-safe: preparation threads allocate params while the loop
allocates workspace. Driver calls (buffer creation, host copies) run outside
the lock against a reservation, so accounting is exact at every instant.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import platform
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import queue as queue_module
import threading
import time
from pathlib import Path

import numpy as np
import pyopencl as cl
from pyopencl._cl import _Program

from .errors import Problem

__all__ = ["KINDS", "DEFAULT_MEMORY_FRACTION", "DRIVER_PREFERENCE", "DriverError", "OutOfDeviceMemory",
           "NoUsableDevice", "DeviceBuffer", "MemoryPool", "Transfer", "Device", "arrange_loader",
           "list_devices", "select_device", "format_devices"]

# What a driver call raises: callers catch it without importing pyopencl.
DriverError = cl.Error

log = logging.getLogger("loom.device")

KINDS = ("params", "state", "workspace", "staging")
DEFAULT_MEMORY_FRACTION = 0.8
WORKSPACE_CACHE_BUFFERS = 256   # bound on idle workspace buffers kept for reuse

# CPU drivers, best first. Measured side by side on one host (docs/operations.md,
# "OpenCL drivers and devices"): Intel's runtime ran bench/llama.py's prefill
# and decode as fast as PoCL 3.1 or faster for F16, Q8_0 and Q4_0.
DRIVER_PREFERENCE = ("intel", "pocl")
TYPE_ORDER = ("gpu", "cpu", "accelerator", "other")
HOW_TO_GET_A_DRIVER = ("run `make install` in the Loom checkout (on x86-64 it installs Intel's OpenCL CPU "
                       "runtime into .venv; as root on Debian/Ubuntu it also installs PoCL: "
                       "`apt-get install pocl-opencl-icd`)")


class NoUsableDevice(ValueError):
    """No device matches the selector, or every match failed its probe: start fails (exit 2)."""


# -- drivers and the ICD loader ----------------------------------------------

_loader_lock = threading.Lock()
_loader_arranged = False
SYSTEM_VENDORS = "/etc/OpenCL/vendors"


def _intel_runtime():
    """libintelocl.so as pip installs it (intel-opencl-rt puts it in <prefix>/lib), or None."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        path = Path(prefix, "lib", "libintelocl.so")
        if path.is_file():
            return path
    return None


def arrange_loader() -> str | None:
    """Make every installed driver visible to the ICD loader; once per process,
    before the first enumeration. Returns the vendors folder it set, or None."""
    global _loader_arranged
    with _loader_lock:
        if _loader_arranged:
            return os.environ.get("OCL_ICD_VENDORS")
        _loader_arranged = True
        if os.environ.get("OCL_ICD_VENDORS"):
            return None     # the operator chose what the loader sees
        intel = _intel_runtime()
        if intel is None:
            return None     # the loader's own search finds every system driver
        folder = tempfile.mkdtemp(prefix="loom-opencl-vendors-")
        atexit.register(shutil.rmtree, folder, True)
        system = Path(os.environ.get("OPENCL_VENDOR_PATH") or SYSTEM_VENDORS)
        for icd in sorted(system.glob("*.icd")) if system.is_dir() else ():
            if icd.is_file():
                Path(folder, icd.name).write_text(icd.read_text())
        # Its libimf/libsvml/libtbb neighbours resolve through the library's RUNPATH ($ORIGIN).
        Path(folder, "loom-intel-cpu.icd").write_text(f"{intel}\n")
        os.environ["OCL_ICD_VENDORS"] = folder
        return folder


# -- probing -------------------------------------------------------------------

PROBE_LANES = 8
PROBE_ITEMS = 64
PROBE_SOURCE = f"""
#define LANES {PROBE_LANES}
__kernel void loom_probe(__global const float* x, __global const half* h, __global float* y) {{
    __local float s[LANES];
    int i = get_global_id(0), l = get_local_id(0);
    s[l] = x[i] * 2.0f + vload_half(i, h);
    barrier(CLK_LOCAL_MEM_FENCE);
    y[i] = s[l] + s[(l + 1) % LANES];
}}
"""


def _first_lines(text, lines=3, chars=300) -> str:
    kept = [line.strip() for line in text.splitlines() if line.strip()][:lines]
    return " | ".join(kept)[:chars]


def _probe(dev) -> str | None:
    """None when ``dev`` builds and runs the probe kernel correctly, else why not."""
    x = np.arange(PROBE_ITEMS, dtype=np.float32) * 0.25 - 3.0
    h = (np.arange(PROBE_ITEMS, dtype=np.float32) * 0.5).astype(np.float16)
    s = (x * 2 + h.astype(np.float32)).reshape(-1, PROBE_LANES)
    want = (s + np.roll(s, -1, axis=1)).reshape(-1)
    try:
        ctx = cl.Context([dev])
    except cl.Error as e:
        return f"no context: {_first_lines(str(e))}"
    program = _Program(ctx, PROBE_SOURCE)   # the raw program: no pyopencl disk cache or warnings
    try:
        program._build(options=b"", devices=[dev])
    except cl.Error as e:
        try:
            build_log = program.get_build_info(dev, cl.program_build_info.LOG)
        except cl.Error:
            build_log = ""
        return f"kernel build failed: {_first_lines(build_log or str(e))}"
    try:
        queue = cl.CommandQueue(ctx)
        mf = cl.mem_flags
        xb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
        hb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=h)
        yb = cl.Buffer(ctx, mf.WRITE_ONLY, x.nbytes)
        kernel = cl.Kernel(program, "loom_probe")
        kernel.set_args(xb, hb, yb)
        cl.enqueue_nd_range_kernel(queue, kernel, (PROBE_ITEMS,), (PROBE_LANES,))
        got = np.empty_like(x)
        cl.enqueue_copy(queue, got, yb)
        queue.finish()
    except cl.Error as e:
        return f"probe kernel did not run: {_first_lines(str(e))}"
    if not np.array_equal(got, want):
        bad = int(np.flatnonzero(got != want)[0])
        return f"probe kernel computed wrong values (item {bad}: {got[bad]!r}, expected {want[bad]!r})"
    return None


PROBE_TIMEOUT_S = 120      # per device: a build that takes longer is a hung driver
PROBE_COMMAND = (sys.executable, "-m", "loom.device", "--probe")
PROBE_MARK = b"loom-probe "


def _probe_children(command=PROBE_COMMAND, timeout=PROBE_TIMEOUT_S) -> dict:
    """{(platform, device): reason or None} for every device the child processes
    report. ``command`` + [JSON list of [p, d] to skip] prints a line PROBE_MARK +
    {"start": [p, d]} before each probe and PROBE_MARK + {"done": [p, d], "reason": ...} after."""
    reasons = {}
    while True:
        errors = tempfile.TemporaryFile()
        proc = subprocess.Popen([*command, json.dumps(sorted(k for k in reasons if k is not None))],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors, close_fds=True)
        started, buffered, fault = None, b"", None
        deadline = time.monotonic() + timeout
        with proc:
            while True:
                ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    proc.kill()
                    fault = f"the probe did not finish within {timeout:g} s (a hung driver)"
                    break
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                buffered += chunk
                *lines, buffered = buffered.split(b"\n")
                for line in lines:
                    if not line.startswith(PROBE_MARK):
                        continue    # a driver's own chatter on stdout
                    message = json.loads(line[len(PROBE_MARK):])
                    if "start" in message:
                        started, deadline = tuple(message["start"]), time.monotonic() + timeout
                    else:
                        reasons[tuple(message["done"])] = message["reason"]
                        started = None
            code = proc.wait()
        errors.seek(max(0, errors.seek(0, os.SEEK_END) - 2000))
        said = [line.strip() for line in errors.read().decode("utf-8", "replace").splitlines() if line.strip()]
        errors.close()
        said = f": {said[-1][:200]}" if said else ""
        if started is None:     # every device reported, or the child failed outside any probe
            if fault is not None or code != 0:
                reasons[None] = fault or f"the probe process failed (exit status {code}){said}"
            return reasons
        if fault is None:
            name = signal.Signals(-code).name if code < 0 and -code in signal.valid_signals() else None
            fault = f"the driver crashed the probe ({name or f'exit status {code}'}){said}"
        reasons[started] = fault


def _probe_main(skip_json: str) -> int:
    """The child of _probe_children: probe every device not in ``skip``."""
    skip = {tuple(x) for x in json.loads(skip_json)}
    arrange_loader()
    try:
        platforms = cl.get_platforms()
    except cl.Error:
        return 0
    for p, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except cl.Error:
            continue
        for d, dev in enumerate(devices):
            if (p, d) in skip:
                continue
            print(PROBE_MARK.decode() + json.dumps({"start": [p, d]}), flush=True)
            try:
                reason = _probe(dev)
            except Exception as e:  # a driver fault of any kind disqualifies that device only
                reason = f"probe raised {type(e).__name__}: {_first_lines(str(e))}"
            print(PROBE_MARK.decode() + json.dumps({"done": [p, d], "reason": reason}), flush=True)
    return 0


# -- discovery and selection -----------------------------------------------

def _device_type(dev) -> str:
    for flag, name in ((cl.device_type.GPU, "gpu"), (cl.device_type.CPU, "cpu"),
                       (cl.device_type.ACCELERATOR, "accelerator")):
        if dev.type & flag:
            return name
    return "other"


def int8_isa(driver: str, driver_version: str, cpuinfo="/proc/cpuinfo") -> str:
    """Which x86 int8 dot product kernels may name (matmul.cl's INT8_DOT), or "": "vnni"
    (AVX512-VNNI's vpdpbusd, where the flags list avx512_vnni and avx512bw) or "avx2"
    (vpmaddubsw then vpmaddwd: two instructions where VNNI has one, on any AVX2 CPU).
    Intel's CPU runtime compiles for the host's instruction set and passes LLVM's x86
    intrinsics through; only runtimes from 2026 on (the intrinsics' byte-vector operands
    of their LLVM; the one make install pins is 2026.2), and not when
    CL_CONFIG_CPU_TARGET_ARCH picks another target: an intrinsic the compiler cannot lower
    aborts it, and with it the process."""
    if driver != "intel" or os.environ.get("CL_CONFIG_CPU_TARGET_ARCH"):
        return ""
    if (_version(driver_version) or (0,))[0] < 2026:
        return ""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return ""
    if "avx512_vnni" in flags and "avx512bw" in flags:
        return "vnni"
    return "avx2" if "avx2" in flags else ""


def int8_dot(driver: str, driver_version: str, cpuinfo="/proc/cpuinfo") -> bool:
    """Whether kernels may take int8 dot products here (int8_isa names which)."""
    return bool(int8_isa(driver, driver_version, cpuinfo))


def kernel_defines(info: dict) -> dict:
    """Macros every program built for this device gets: which instructions INT8_DOT
    tiles name (the kernel's front end cannot tell; SPIR targets no CPU)."""
    return {"LOOM_DOT8_AVX2": 1} if info.get("int8_isa") == "avx2" else {}


def driver_family(platform_name: str) -> str:
    """A short driver name for preference and package specialization: "pocl",
    "intel", "nvidia", "amd", ... (the platform name's first word otherwise)."""
    name = platform_name.lower()
    for needle, family in (("portable computing language", "pocl"), ("pocl", "pocl"), ("intel", "intel"),
                           ("nvidia", "nvidia"), ("amd", "amd"), ("rusticl", "rusticl"), ("clover", "clover")):
        if needle in name:
            return family
    return re.sub(r"[^a-z0-9_]", "", name.split()[0]) if name.split() else "unknown"


_probed = None
_probed_lock = threading.Lock()


def _enumerate() -> list:
    """[(cl.Device, info dict)] for every device of every platform, in flat order,
    each probed once per process (rows carry ``usable`` and ``reason``)."""
    global _probed
    with _probed_lock:
        if _probed is None:
            _probed = _discover()
        return _probed


def _discover(probe=True) -> list:
    arrange_loader()
    reasons = _probe_children() if probe else {None: None}
    try:
        platforms = cl.get_platforms()
    except cl.Error:  # no ICD installed at all
        return []
    found = []
    for p, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except cl.Error:  # a platform with no usable device
            continue
        for d, dev in enumerate(devices):
            extensions = sorted(dev.extensions.split())
            platform_name = platform.name.strip()
            info = {
                "index": len(found),
                "platform": p,
                "platform_name": platform_name,
                "platform_version": platform.version.strip(),
                "driver": driver_family(platform_name),
                "device": d,
                "name": dev.name.strip(),
                "type": _device_type(dev),
                "vendor": dev.vendor.strip(),
                "driver_version": dev.driver_version.strip(),
                "opencl_version": dev.version.strip(),
                "global_memory_bytes": int(dev.global_mem_size),
                "max_allocation_bytes": int(dev.max_mem_alloc_size),
                "compute_units": int(dev.max_compute_units),
                "vector_width": int(dev.native_vector_width_float),
                "int8_isa": int8_isa(driver_family(platform_name), dev.driver_version.strip())
                            if _device_type(dev) == "cpu" else "",
                "fp16": "cl_khr_fp16" in extensions,
                "fp64": "cl_khr_fp64" in extensions,
                "extensions": extensions,
            }
            info["int8_dot"] = bool(info["int8_isa"])
            reason = reasons.get((p, d), reasons.get(None, "the probe process did not report this device"))
            info["usable"], info["reason"] = reason is None, reason
            found.append((dev, info))
    return found


def assume_usable() -> None:
    """For a child process of a server that has already probed its devices (the
    proving ground): enumerate without probing, every device taken as usable."""
    global _probed
    with _probed_lock:
        if _probed is None:
            _probed = _discover(probe=False)


def list_devices() -> list:
    """Every OpenCL device as a JSON-ready dict (see ``_discover`` for the fields)."""
    return [info for _, info in _enumerate()]


def _version(text: str) -> tuple:
    return tuple(int(n) for n in re.findall(r"\d+", text)[:4])


def _preference(info) -> tuple:
    """Sort key among usable devices: GPUs first, in enumeration order; then CPUs by
    DRIVER_PREFERENCE, the newer driver version, enumeration order; then the rest."""
    kind = info["type"] if info["type"] in TYPE_ORDER else "other"
    if kind != "cpu":
        return (TYPE_ORDER.index(kind), 0, (), info["index"])
    driver = info.get("driver", "")
    rank = DRIVER_PREFERENCE.index(driver) if driver in DRIVER_PREFERENCE else len(DRIVER_PREFERENCE)
    return (TYPE_ORDER.index(kind), rank, tuple(-n for n in _version(info.get("driver_version", ""))),
            info["index"])


def format_devices(devices: list, chosen: int | None = None) -> str:
    """The probe table, one line per device (``--list-devices`` and error messages)."""
    if not devices:
        return "  (none: the OpenCL loader found no platform)"
    lines = []
    for d in devices:
        mark = "*" if d["index"] == chosen else " "
        state = "usable" if d.get("usable", True) else f"unusable: {d.get('reason')}"
        lines.append(f"{mark} {d['index']} ({d['platform']}:{d['device']}) {d['name']} [{d['type']}] "
                     f"{d.get('platform_name', '')} {d.get('driver_version', '')}: {state}")
    return "\n".join(lines)


def select_device(devices: list, selector: str | None) -> int:
    """The flat index in ``devices`` (list_devices() rows) that ``selector`` names;
    rows without a ``usable`` field count as usable."""
    def usable(rows):
        return sorted((d for d in rows if d.get("usable", True)), key=_preference)

    if selector is None:
        matches = [d for d in devices if d["type"] in ("gpu", "cpu")]   # _preference puts GPUs first
    elif not isinstance(selector, str) or not selector:
        raise ValueError(f"device selector must be a non-empty string, got {selector!r}")
    elif selector.lower() in ("cpu", "gpu", "accelerator"):
        matches = [d for d in devices if d["type"] == selector.lower()]
    elif selector.isdecimal():
        matches = [d for d in devices if d["index"] == int(selector)]
    elif selector.count(":") == 1 and all(part.isdecimal() for part in selector.split(":")):
        p, d = map(int, selector.split(":"))
        matches = [x for x in devices if x["platform"] == p and x["device"] == d]
    elif any(d.get("driver") == selector.lower() for d in devices):
        matches = [d for d in devices if d.get("driver") == selector.lower()]
    else:
        matches = [d for d in devices if selector.lower() in d["name"].lower()]
    best = usable(matches)
    if best:
        return best[0]["index"]
    wanted = "a GPU or CPU" if selector is None else repr(selector)
    listing = "; ".join(f'{d["index"]} ({d["platform"]}:{d["device"]}) {d["name"]} [{d["type"]}]'
                        + ("" if d.get("usable", True) else f" unusable: {d.get('reason')}")
                        for d in devices) or "none"
    if matches:
        raise NoUsableDevice(f"no usable OpenCL device matches {wanted}: every match failed its probe; "
                             f"devices: {listing}. To get a working driver, {HOW_TO_GET_A_DRIVER}")
    raise NoUsableDevice(f"no OpenCL device matches {wanted}; devices: {listing}. "
                         f"To get a working driver, {HOW_TO_GET_A_DRIVER}")


# -- memory accounting -----------------------------------------------------

class OutOfDeviceMemory(Problem):
    """An allocation the pool (or the driver) cannot satisfy (code device_memory: 503)."""

    code = "device_memory"
    quotes = False      # byte counts and owners: nothing a file holds

    def __init__(self, requested: int, available: int, limit: int, owner: str, kind: str, reason: str = ""):
        self.requested, self.available, self.limit = requested, available, limit
        self.owner, self.kind = owner, kind
        message = (f"device memory exhausted: {owner} asked for {requested} bytes of {kind}, "
                   f"{available} of {limit} available")
        super().__init__(f"{message} ({reason})" if reason else message)


def _bucket(n: int) -> int:
    """Workspace capacity for a request of n > 0 bytes (see the module docstring)."""
    step = 1 << max(8, n.bit_length() - 3)
    return -(-n // step) * step


class DeviceBuffer:
    """One accounted allocation. ``buffer`` is the cl.Buffer (None for a zero-byte
    allocation, which OpenCL cannot create: pass it as a NULL kernel argument).
    After release ``buffer`` is None, so a stale handle cannot reach memory that
    now belongs to someone else."""

    __slots__ = ("buffer", "nbytes", "capacity", "owner", "kind", "_pool", "released")

    def __init__(self, pool, buffer, nbytes, capacity, owner, kind):
        self.buffer = buffer
        self.nbytes = nbytes        # what was asked for
        self.capacity = capacity    # what the device holds and the pool counts
        self.owner = owner
        self.kind = kind
        self._pool = pool
        self.released = False

    def release(self) -> None:
        self._pool.release(self)

    def __repr__(self):
        state = " released" if self.released else ""
        return f"<DeviceBuffer {self.owner}/{self.kind} {self.nbytes} bytes{state}>"


class MemoryPool:
    """The bounded allocator and its accounting; see the module docstring."""

    def __init__(self, context: cl.Context, limit: int, max_allocation: int):
        self.context = context
        self.limit = limit
        self.max_allocation = max_allocation    # the device's largest single buffer
        self._lock = threading.Lock()
        self._used = 0                           # bytes, cached workspace included
        self._peak = 0
        self._buffers = 0                        # live handles, zero-byte ones included
        self._by_kind = dict.fromkeys(KINDS, 0)
        self._owned: dict = {}                   # (owner, kind) -> [bytes, live handles]
        self._cache: dict = {}                   # (owner, capacity) -> [idle workspace cl.Buffer]
        self._cached_bytes = 0
        self._cached_buffers = 0
        self._evictor = None

    def set_evictor(self, fn) -> None:
        """``fn(needed_bytes, requester_owner) -> bytes_freed``, called on the
        allocating thread, without the pool lock, when an alloc does not fit."""
        self._evictor = fn

    def available(self) -> int:
        return self.limit - self._used

    def alloc(self, nbytes: int, owner: str, kind: str, host=None) -> DeviceBuffer:
        """A buffer of ``nbytes`` for ``owner``; ``host`` (an array of exactly
        nbytes) is copied in at creation."""
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"owner must be a non-empty string, got {owner!r}")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if host is not None:
            host = np.ascontiguousarray(host)
            if host.nbytes != nbytes:
                raise ValueError(f"host array has {host.nbytes} bytes, allocation has {nbytes}")
        reusable = kind == "workspace" and host is None and nbytes > 0
        capacity = _bucket(nbytes) if reusable else nbytes
        if capacity > self.max_allocation:
            raise OutOfDeviceMemory(nbytes, self.available(), self.limit, owner, kind,
                                    f"over the device's largest single allocation, {self.max_allocation} bytes")
        if reusable:
            with self._lock:
                idle = self._cache.get((owner, capacity))
                if idle:
                    buffer = idle.pop()
                    if not idle:
                        del self._cache[owner, capacity]
                    self._cached_bytes -= capacity
                    self._cached_buffers -= 1
                    self._account(owner, kind, 0, 1)
                    return DeviceBuffer(self, buffer, nbytes, capacity, owner, kind)
        self._reserve(nbytes, capacity, owner, kind)
        if not capacity:
            return DeviceBuffer(self, None, 0, 0, owner, kind)
        try:
            if host is None:
                buffer = cl.Buffer(self.context, cl.mem_flags.READ_WRITE, capacity)
            else:
                buffer = cl.Buffer(self.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                                   hostbuf=host)
        except (cl.Error, MemoryError) as e:
            with self._lock:
                self._account(owner, kind, -capacity, -1)
            raise OutOfDeviceMemory(nbytes, self.available(), self.limit, owner, kind,
                                    f"the driver refused: {e}") from e
        with self._lock:  # the peak counts allocations that happened, not attempts
            self._peak = max(self._peak, self._used)
        return DeviceBuffer(self, buffer, nbytes, capacity, owner, kind)

    def _reserve(self, nbytes, capacity, owner, kind) -> None:
        """Count ``capacity`` for owner/kind, making room first if needed, or raise."""
        with self._lock:
            if self._used + capacity <= self.limit:
                self._account(owner, kind, capacity, 1)
                return
            idle = self._drop_cached(self.limit - capacity, None)   # idle scratch goes first
            fits = self._used + capacity <= self.limit
            if fits:
                self._account(owner, kind, capacity, 1)
            short = self._used + capacity - self.limit
        _free(idle)
        if fits:
            return
        if self._evictor is not None:
            self._evictor(short, owner)
            with self._lock:
                if self._used + capacity <= self.limit:
                    self._account(owner, kind, capacity, 1)
                    return
        raise OutOfDeviceMemory(nbytes, self.available(), self.limit, owner, kind)

    def _account(self, owner, kind, nbytes, handles) -> None:
        # Under the lock. An (owner, kind) row lives while it has bytes or handles.
        self._used += nbytes
        self._by_kind[kind] += nbytes
        self._buffers += handles
        row = self._owned.setdefault((owner, kind), [0, 0])
        row[0] += nbytes
        row[1] += handles
        if row == [0, 0]:
            del self._owned[owner, kind]

    def release(self, buf: DeviceBuffer) -> None:
        """Give ``buf`` back; releasing twice is a no-op."""
        if buf._pool is not self:
            raise ValueError(f"{buf!r} belongs to another pool")
        with self._lock:
            if buf.released:
                return
            buf.released = True
            buffer, buf.buffer = buf.buffer, None
            key = (buf.owner, buf.capacity)
            if (buf.kind == "workspace" and buffer is not None and _bucket(buf.capacity) == buf.capacity
                    and self._cached_buffers < WORKSPACE_CACHE_BUFFERS):
                self._cache.setdefault(key, []).append(buffer)
                self._cached_bytes += buf.capacity
                self._cached_buffers += 1
                self._account(buf.owner, buf.kind, 0, -1)
                return
            self._account(buf.owner, buf.kind, -buf.capacity, -1)
        if buffer is not None:
            buffer.release()

    def trim(self, target_bytes: int = 0, owner: str | None = None) -> int:
        """Free cached idle workspace (of ``owner``, or anyone's) until at most
        ``target_bytes`` are used or the cache is empty; returns bytes freed."""
        with self._lock:
            before = self._used
            idle = self._drop_cached(target_bytes, owner)
            freed = before - self._used
        _free(idle)
        return freed

    def _drop_cached(self, target, owner) -> list:
        # Under the lock: unaccount idle workspace, returning the cl.Buffers to free.
        idle = []
        for key in list(self._cache):
            if owner is not None and key[0] != owner:
                continue
            buffers = self._cache[key]
            while buffers and self._used > target:
                idle.append(buffers.pop())
                self._cached_bytes -= key[1]
                self._cached_buffers -= 1
                self._account(key[0], "workspace", -key[1], 0)
            if not buffers:
                del self._cache[key]
            if self._used <= target:
                break
        return idle

    def usage(self) -> dict:
        """Consistent snapshot for /v1/status, /metrics and tests."""
        with self._lock:
            by_owner: dict = {}
            for (owner, kind), (nbytes, _) in self._owned.items():
                by_owner.setdefault(owner, {})[kind] = nbytes
            return {"limit": self.limit, "used": self._used, "available": self.limit - self._used,
                    "peak": self._peak, "buffers": self._buffers,
                    "cached_bytes": self._cached_bytes, "cached_buffers": self._cached_buffers,
                    "by_kind": dict(self._by_kind), "by_owner": by_owner}


def _free(buffers) -> None:
    for buffer in buffers:
        buffer.release()


# -- the device ------------------------------------------------------------

class Transfer:
    """A device-to-host copy in flight: ``array`` is valid once ``done()``."""

    __slots__ = ("event", "array")

    def __init__(self, event, array):
        self.event = event
        self.array = array

    def done(self) -> bool:
        """Non-blocking poll for the loop; raises if the device reports failure."""
        if self.event is None:
            return True
        status = self.event.command_execution_status
        if status < 0:
            raise RuntimeError(f"device transfer failed with status {status}")
        return status == cl.command_execution_status.COMPLETE

    def wait(self) -> np.ndarray:
        """Block until complete (start-up and tests only, never on the loop)."""
        if self.event is not None:
            self.event.wait()
        return self.array


class Guarded:
    """A buffer with guard bytes on both sides, for trial runs in the proving ground:
    a kernel writing outside its ``buffer`` (a sub-buffer of ``whole``) changes a
    guard, which ``intact()`` reports. Not from the pool: the child owns its device."""

    PATTERN = 0xA5

    def __init__(self, device, nbytes, fill=None):
        align = max(int(device.cl_device.mem_base_addr_align) // 8, 128)
        self.nbytes = nbytes
        self.guard = -(-max(4096, align) // align) * align
        self.total = self.guard + -(-max(nbytes, 1) // align) * align + self.guard
        host = np.full(self.total, self.PATTERN, np.uint8)
        host[self.guard:self.guard + nbytes] = 0 if fill is None else np.frombuffer(
            np.ascontiguousarray(fill).tobytes(), np.uint8)
        self.device = device
        flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
        self.whole = cl.Buffer(device.context, flags, hostbuf=host)
        self.buffer = self.whole.get_sub_region(self.guard, max(nbytes, 1))

    def intact(self) -> bool:
        host = np.empty(self.total, np.uint8)
        cl.enqueue_copy(self.device.queue, host, self.whole, is_blocking=True)
        outside = np.concatenate([host[:self.guard], host[self.guard + self.nbytes:]])
        return bool((outside == self.PATTERN).all())

    def read(self, dtype, count) -> np.ndarray:
        host = np.empty(count, dtype)
        cl.enqueue_copy(self.device.queue, host, self.buffer, is_blocking=True)
        return host


def host_cpu() -> str:
    """The host CPU's model and instruction-set flags (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n\n")[0].splitlines()
    except OSError:
        lines = []
    wanted = ("vendor_id", "cpu family", "model", "model name", "flags", "Features", "CPU part")
    fields = [line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() in wanted]
    return ";".join(fields) or f"{platform.machine()};{platform.processor()}"


class Device:
    """One OpenCL device: ``context``, one in-order ``queue``, ``pool``, ``info``."""

    def __init__(self, selector: str | None = None, memory_bytes: int | None = None):
        found = _enumerate()
        index = select_device([info for _, info in found], selector)
        self.cl_device, info = found[index]
        self.info = dict(info, selector=selector)
        self.devices = [dict(row) for _, row in found]   # the probe table, for /v1/status
        for row in self.devices:
            if not row["usable"]:
                log.warning("OpenCL device %d (%s, %s %s) skipped: %s", row["index"], row["name"],
                            row["platform_name"], row["driver_version"], row["reason"],
                            extra={"event": "device_skipped", "device": row["name"], "reason": row["reason"]})
        total = info["global_memory_bytes"]
        if memory_bytes is None:
            memory_bytes = int(total * DEFAULT_MEMORY_FRACTION)
        elif type(memory_bytes) is not int or not 0 < memory_bytes <= total:
            raise ValueError(f"memory_bytes must be an int in 1..{total} (the device's global memory), "
                             f"got {memory_bytes!r}")
        self.info["memory_limit_bytes"] = memory_bytes
        # What a compiled program depends on: the compiler keys its caches with it. A CPU
        # driver emits native code for the host's instruction set, and CPUs of one name differ
        # (an "AMD EPYC" may have AVX-512 or not): its binaries are keyed by the host's flags too.
        self.identity = "|".join([info[k] for k in ("platform_name", "name", "vendor", "driver_version",
                                                    "opencl_version")] + ([host_cpu()] if info["type"] == "cpu" else []))
        self.context = cl.Context([self.cl_device])
        self.queue = cl.CommandQueue(self.context)
        self.pool = MemoryPool(self.context, memory_bytes, info["max_allocation_bytes"])
        # Steps are enqueued by one submission thread, in the order they were handed over:
        # a driver that blocks in an enqueue (a full queue behind a stuck kernel) blocks it,
        # never the server's loop.
        self._submissions = queue_module.SimpleQueue()
        self._submitter = None
        self._limits = None

    def describe(self) -> str:
        i = self.info
        return (f"{i['name']} ({i['type']}, {i['platform_name']}, {i['opencl_version']}, "
                f"{i['compute_units']} compute units, {i['global_memory_bytes'] >> 20} MiB global, "
                f"pool limit {self.pool.limit >> 20} MiB, fp16 {'yes' if i['fp16'] else 'no'})")

    @staticmethod
    def _check_span(buf, offset, nbytes):
        if buf.released:
            raise ValueError(f"{buf!r} was released")
        if type(offset) is not int or offset < 0 or offset + nbytes > buf.nbytes:
            raise ValueError(f"{nbytes} bytes at offset {offset} do not fit in {buf!r}")

    def upload(self, buf: DeviceBuffer, array, offset: int = 0) -> None:
        """Copy ``array`` into ``buf`` at byte ``offset``; returns when the copy is done."""
        array = np.ascontiguousarray(array)
        self._check_span(buf, offset, array.nbytes)
        if array.nbytes:
            cl.enqueue_copy(self.queue, buf.buffer, array, dst_offset=offset, is_blocking=True)

    def zero(self, buf: DeviceBuffer) -> None:
        """Fill ``buf`` with zero bytes; returns when the fill is done."""
        if buf.nbytes:
            cl.enqueue_fill_buffer(self.queue, buf.buffer, np.zeros(1, np.uint8), 0, buf.nbytes).wait()

    def download(self, buf: DeviceBuffer, dtype, count: int, offset: int = 0) -> np.ndarray:
        """``count`` items of ``dtype`` from ``buf`` at byte ``offset`` (blocking)."""
        return self.download_async(buf, dtype, count, offset).wait()

    def download_async(self, buf: DeviceBuffer, dtype, count: int, offset: int = 0) -> Transfer:
        """Enqueue the copy after everything already queued and return at once."""
        array = np.empty(count, dtype)
        self._check_span(buf, offset, array.nbytes)
        if not array.nbytes:
            return Transfer(None, array)
        event = cl.enqueue_copy(self.queue, array, buf.buffer, src_offset=offset, is_blocking=False)
        self.queue.flush()  # submitted now, so polling the event sees progress
        return Transfer(event, array)

    # -- kernels, launches and asynchronous copies ---------------------------
    # Everything the server enqueues goes through these, on the one in-order
    # queue; nothing outside device.py and compiler.py touches pyopencl.

    def kernel(self, program, entry: str):
        """A kernel object of a built program (compiler.Executable.program). Set its
        arguments with ``set_arg(i, value)`` / ``set_args(...)`` on the loop thread only."""
        return cl.Kernel(program, entry)

    def launch(self, kernel, grid, local=None):
        """Enqueue ``kernel`` over ``grid`` (work-group ``local``, or the driver's choice); returns its event."""
        return cl.enqueue_nd_range_kernel(self.queue, kernel, tuple(grid), None if local is None else tuple(local))

    def flush(self) -> None:
        """Submit what is queued, so events make progress while the loop polls."""
        self.queue.flush()

    @staticmethod
    def finished(event) -> bool:
        """Whether an enqueued command has completed (non-blocking)."""
        return event.command_execution_status == cl.command_execution_status.COMPLETE

    def upload_async(self, buf: DeviceBuffer, array: np.ndarray, offset: int = 0):
        """Enqueue a copy of ``array`` into ``buf`` at byte ``offset``; returns its event.
        The caller keeps ``array`` alive until the event has completed."""
        self._check_span(buf, offset, array.nbytes)
        if not array.nbytes:
            return None
        return cl.enqueue_copy(self.queue, buf.buffer, array, dst_offset=offset, is_blocking=False)

    def copy_blocks(self, buffer, src: int, dst: int, block_bytes: int, blocks: int, pitch: int) -> None:
        """Within one buffer, copy ``blocks`` blocks of ``block_bytes``, ``pitch`` bytes
        apart, from byte ``src`` to byte ``dst`` (one rectangular copy: a KV page of every layer)."""
        pitches = (pitch, blocks * pitch)
        cl.enqueue_copy(self.queue, buffer, buffer, src_origin=(src, 0, 0), dst_origin=(dst, 0, 0),
                        region=(block_bytes, blocks, 1), src_pitches=pitches, dst_pitches=pitches)

    def read_blocks_async(self, buffer, host: np.ndarray, src: int, block_bytes: int, blocks: int, pitch: int):
        """Enqueue a read of the same rectangle into ``host`` ([blocks, block_bytes]); returns its event."""
        return cl.enqueue_copy(self.queue, host, buffer, buffer_origin=(src, 0, 0), host_origin=(0, 0, 0),
                               region=(block_bytes, blocks, 1), buffer_pitches=(pitch, blocks * pitch),
                               host_pitches=(block_bytes, blocks * block_bytes), is_blocking=False)

    def write_blocks_async(self, buffer, host: np.ndarray, dst: int, block_bytes: int, blocks: int, pitch: int):
        """Enqueue a write of ``host`` ([blocks, block_bytes]) into that rectangle; returns its event.
        The caller keeps ``host`` alive until the event has completed."""
        return cl.enqueue_copy(self.queue, buffer, host, buffer_origin=(dst, 0, 0), host_origin=(0, 0, 0),
                               region=(block_bytes, blocks, 1), buffer_pitches=(pitch, blocks * pitch),
                               host_pitches=(block_bytes, blocks * block_bytes), is_blocking=False)

    def submit(self, fn, done) -> None:
        """fn() on the device's submission thread, in submission order; done(result, error)
        is called there too (hand it back to the loop with call_soon_threadsafe)."""
        if self._submitter is None:
            self._submitter = threading.Thread(target=self._submit_forever, name="loom-device", daemon=True)
            self._submitter.start()
        self._submissions.put((fn, done))

    def _submit_forever(self):
        while True:
            fn, done = self._submissions.get()
            try:
                result, error = fn(), None
            except Exception as e:      # reported to the step that submitted it
                result, error = None, e
            done(result, error)

    def finish(self) -> None:
        """Wait for everything queued (the proving ground's child, never the server's loop)."""
        self.queue.finish()

    def guarded(self, nbytes: int, fill=None) -> "Guarded":
        """A trial buffer of ``nbytes`` between guard bytes (outside the pool)."""
        return Guarded(self, nbytes, fill)

    def limits(self) -> dict:
        """What one launch may ask of this device."""
        if self._limits is None:
            self._limits = {"local_memory_bytes": int(self.cl_device.local_mem_size),
                            "work_group_size": int(self.cl_device.max_work_group_size)}
        return self._limits

    def local_memory_bytes(self, kernel) -> int:
        """The __local memory one work-group of ``kernel`` needs."""
        return int(kernel.get_work_group_info(cl.kernel_work_group_info.LOCAL_MEM_SIZE, self.cl_device))

    def metrics(self, registry) -> None:
        """Ownership gauges, computed from the pool at scrape time."""
        pool = self.pool
        registry.gauge_fn("loom_device_memory_bytes", "Device memory held, by owner and kind.",
                          lambda: [((owner, kind), n) for owner, kinds in pool.usage()["by_owner"].items()
                                   for kind, n in kinds.items()],
                          labels=("owner", "kind"))
        registry.gauge_fn("loom_device_memory_limit_bytes", "Device memory pool limit (--memory_bytes).",
                          lambda: pool.limit)
        registry.gauge_fn("loom_device_memory_used_bytes", "Device memory counted against the limit.",
                          lambda: pool.usage()["used"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"] and len(sys.argv) == 3:
        sys.exit(_probe_main(sys.argv[2]))
    sys.exit("usage: python -m loom.device --probe SKIP_JSON (the device probe's child process)")
