"""Start real Loom servers for end-to-end tests.

- `live_server(*flags)`: `python -m loom` in a subprocess on an ephemeral TCP
  port and a Unix socket, exactly as a user runs it.
- `thread_server(routes)`: the same Server class in a thread of this process,
  with extra routes, for transport behaviour that needs a handler we control
  (echoing bodies, producing streams) or a look at server internals.

Servers get an empty catalog unless a test asks: `catalog="default"` is the
real default catalog (SmolLM2, MiniLM: what `make run` serves), `catalog="tiny"`
the same deployments with scout and encoder on a tiny generated checkpoint
(`tiny_scout_dir()`: a two-layer Qwen2 shape, random weights), which keeps
serving tests fast and their outputs unlike any real model's, and
`catalog="recognizer"` the default recognizer alone (whisper tiny.en).
"""

import http.client
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import shutil
import threading
import time
import weakref

import pytest

import loom
from loom import demo, device as loom_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Before anything in this process enumerates OpenCL platforms: the ICD loader
# reads its configuration once, and Intel's runtime is visible only through the
# vendors folder that loom.device writes (servers started by tests inherit it).
loom_device.arrange_loader()

# Every test and every server a run starts share one kernel cache of their own (the
# user's stays untouched): the first to build a kernel stores its binary, the later ones
# load it. The folder outlives the run (a machine's next run loads what this one built):
# its files are keyed by content (source, options, device, driver version, instruction
# set), never by the clone's path, so a stale file cannot match; LOOM_TEST_KERNELS=DIR
# picks another folder (an empty one for a cold run).
KERNELS = os.environ.get("LOOM_TEST_KERNELS") or loom.cache_folder("test-kernels")
os.makedirs(KERNELS, exist_ok=True)

# `make test` warns past this many seconds (pytest's own time), naming the slowest files:
# CI allows 90 minutes, and make test took 57 on an Intel Xeon before its sweeps moved to
# make test-full (2026-12-07); the budget leaves room for features to come.
BUDGET_S = float(os.environ.get("LOOM_TEST_BUDGET_S", 25 * 60))


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="also run the exhaustive cases marked `full` (make test-full)")


def _quick(item, others) -> bool:
    """Whether `make test` runs this item: not a sweep marked `full`, and on a driver other than
    the preferred one only where marked `every_driver` (each kernel family and weight type on
    every driver; the preferred one, which serves by default, runs everything)."""
    if item.get_closest_marker("full"):
        return False
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any(driver in callspec.id for driver in others):
        return item.get_closest_marker("every_driver") is not None
    return True


# The files that take minutes (measured), longest first: xdist hands out whole files in this
# order, so the workers finish together instead of one starting test_kernels last.
HEAVY_FILES = ["test_kernels", "test_llama", "test_imagegen_http", "test_docs", "test_speech_http",
               "test_residency", "test_transcription_http", "test_soak", "test_vits", "test_whisper",
               "test_whisper_reference", "test_bert", "test_registry", "test_vits_reference", "test_smollm2",
               "test_sd", "test_conv2d", "test_compiler", "test_proving"]


def pytest_collection_modifyitems(config, items):
    def weight(item):
        name = item.path.stem
        return HEAVY_FILES.index(name) if name in HEAVY_FILES else len(HEAVY_FILES)

    items.sort(key=weight)       # stable: each file's own order is kept
    if config.getoption("--full"):
        return
    others = [param.id for param in drivers()[1:]]
    kept = [item for item in items if _quick(item, others)]
    if len(kept) < len(items):
        dropped = set(items) - set(kept)
        config.hook.pytest_deselected(items=[item for item in items if item in dropped])
        items[:] = kept


# -- what a run costs: kernel builds and the slowest files ---------------------------

class _Costs:
    """Kernel builds from source (this process's, by counting the driver calls; servers',
    by the binaries they add to KERNELS) and each test file's seconds."""

    def __init__(self):
        self.started = time.time()
        self.builds, self.build_seconds = 0, 0.0
        self.stored = set()             # cache keys this process's compilers stored
        self.files = {}                 # test file -> seconds (setup, call and teardown)

    def watch(self):
        import pyopencl._cl as cl_raw
        from loom.compiler import BinaryStore
        build, put, costs = cl_raw._Program._build, BinaryStore.put, self

        def counted_build(program, *args, **kwargs):
            if program.kind() != cl_raw.program_kind.SOURCE:    # a stored binary loading
                return build(program, *args, **kwargs)
            start = time.perf_counter()
            try:
                return build(program, *args, **kwargs)
            finally:
                costs.builds += 1
                costs.build_seconds += time.perf_counter() - start

        def recorded_put(store, key, *args, **kwargs):
            costs.stored.add(key)
            return put(store, key, *args, **kwargs)

        cl_raw._Program._build = counted_build
        BinaryStore.put = recorded_put

    def server_builds(self):
        added = set()
        for entry in os.scandir(KERNELS):
            if entry.name.endswith(".bin") and entry.stat().st_mtime >= self.started:
                added.add(entry.name[:-4])
        return len(added - self.stored)


COSTS = _Costs()


def pytest_configure(config):
    COSTS.watch()


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    COSTS.files[path] = COSTS.files.get(path, 0.0) + report.duration


def pytest_sessionfinish(session):
    # An xdist worker hands its builds to the controller, which prints the summary.
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["loom_builds"] = (COSTS.builds, COSTS.build_seconds, sorted(COSTS.stored))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    builds, seconds, stored = getattr(node, "workeroutput", {}).get("loom_builds", (0, 0.0, ()))
    COSTS.builds += builds
    COSTS.build_seconds += seconds
    COSTS.stored.update(stored)


def pytest_terminal_summary(terminalreporter):
    total = time.time() - COSTS.started
    write = terminalreporter.write_line
    write(f"kernel builds from source: {COSTS.builds} in the test processes ({COSTS.build_seconds:.0f} s), "
          f"{COSTS.server_builds()} by the servers they started (cache {KERNELS})")
    if total > BUDGET_S and not terminalreporter.config.getoption("--full"):
        slowest = sorted(COSTS.files.items(), key=lambda item: -item[1])[:8]
        write(f"WARNING: the tests took {total / 60:.1f} min, past the {BUDGET_S / 60:.0f} min budget "
              f"(LOOM_TEST_BUDGET_S); the slowest files:", yellow=True, bold=True)
        for path, seconds in slowest:
            write(f"  {seconds:7.1f} s  {path}", yellow=True)


def compiler_for(device):
    """A compiler that builds on the calling thread and shares the run's kernel cache with every
    other in-process test and every server the run starts (a package's kernels, built once by its
    numerics tests, load in its serving tests instead of compiling again)."""
    from loom.compiler import BinaryStore, Compiler, run_now
    return Compiler(device, run_now, binaries=BinaryStore(KERNELS))


def drivers():
    """pytest params: one device selector (a flat index) per usable driver present (each CPU
    driver's best device, every GPU), so numerics are checked on every driver installed."""
    best = {}
    for d in sorted(loom_device.list_devices(), key=loom_device._preference):
        if d["usable"] and d["type"] in ("cpu", "gpu"):
            key = (d["driver"], d["driver_version"]) if d["type"] == "cpu" else d["index"]
            best.setdefault(key, d)
    return [pytest.param(str(d["index"]), id=f'{d["driver"]}-{d["type"]}-{d["driver_version"].split()[0]}')
            for d in best.values()]


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout=10):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


class Endpoint:
    """Where a server listens, with small helpers to talk to it."""

    def __init__(self, host, port, unix_path):
        self.host, self.port, self.unix_path = host, port, unix_path
        self.url = f"http://{host}:{port}"

    def connection(self, transport="tcp", timeout=10):
        if transport == "unix":
            return UnixHTTPConnection(self.unix_path, timeout)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(self, method, path, body=None, headers=None, transport="tcp", timeout=60):
        # 60 s: a deployment's first request may build its geometry's kernels on two busy cores.
        conn = self.connection(transport, timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def raw(self, transport="tcp", timeout=10):
        if transport == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(self.unix_path)
        else:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        return sock


class _Reader(io.BufferedReader):
    """A socket's one buffered reader: responses read in sequence share its buffer."""

    def close(self):
        pass  # http.client closes its fp after each response; the socket lives on


_readers = weakref.WeakKeyDictionary()


def reader(sock):
    if sock not in _readers:
        _readers[sock] = _Reader(socket.SocketIO(sock, "rb"))
    return _readers[sock]


class _ViaReader:
    def __init__(self, sock):
        self.sock = sock

    def makefile(self, *args, **kwargs):
        return reader(self.sock)


def read_response(sock, head_only=False):
    """Read one HTTP/1.1 response from a raw socket: (status, headers, body)."""
    resp = http.client.HTTPResponse(_ViaReader(sock), method="HEAD" if head_only else "GET")
    resp.begin()
    body = resp.read()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


def recv_all(sock, timeout=10):
    """Everything until the server closes the connection."""
    sock.settimeout(timeout)
    chunks = []
    while True:
        try:
            data = reader(sock).read1(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


class LiveServer(Endpoint):
    def __init__(self, proc, host, port, unix_path, stderr_lines):
        super().__init__(host, port, unix_path)
        self.proc = proc
        self.stderr_lines = stderr_lines

    def stop(self, sig=signal.SIGTERM, timeout=20):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


TINY = os.path.join(os.path.expanduser("~"), ".cache", "loom", "tests", "scout-v2")


def tiny_scout_dir():
    """The tests' tiny random text checkpoint (models/llama/make_checkpoint.py), generated once."""
    if os.path.isfile(os.path.join(TINY, "model.safetensors")):
        return TINY
    import importlib.util
    import shutil
    spec = importlib.util.spec_from_file_location("make_llama", os.path.join(ROOT, "models", "llama",
                                                                               "make_checkpoint.py"))
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    tmp = TINY + f".tmp{os.getpid()}"
    maker.make(tmp)
    try:
        os.rename(tmp, TINY)    # atomic: a concurrent first use finds a whole folder or none
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return TINY


def _start_live(tmp_path, flags, catalog=None):
    unix_path = str(tmp_path / "loom.sock")
    if catalog != "default" and "--models" not in flags:
        # Most tests need no models: an empty catalog keeps start-up light.
        if catalog == "tiny":
            docs = demo.catalog(text=tiny_scout_dir(), recognizer=False, speaker=False, illustrator=False)
        elif catalog in ("recognizer", "speaker", "illustrator"):   # one default deployment alone
            docs = [doc for doc in demo.catalog() if doc["model"] == catalog]
        elif catalog == "audio":                     # the speaker and the recognizer
            docs = [doc for doc in demo.catalog() if doc["model"] in ("speaker", "recognizer")]
        else:
            docs = []
        (tmp_path / "catalog.json").write_text(json.dumps(docs))
        flags = ("--models", str(tmp_path / "catalog.json"), *flags)
    if "--kernel_cache" not in flags:
        flags = ("--kernel_cache", KERNELS, *flags)
    cmd = [sys.executable, "-m", "loom", "--listen", "tcp:127.0.0.1:0", "--listen", f"unix:{unix_path}", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    port_found = threading.Event()
    found = {}

    def pump():
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"listening on tcp:([\d.]+):(\d+)", line)
            if m:
                found["host"], found["port"] = m.group(1), int(m.group(2))
            if "listening on unix:" in line and "port" in found:
                port_found.set()

    threading.Thread(target=pump, daemon=True).start()
    if not port_found.wait(30):
        proc.kill()
        raise RuntimeError("server did not start:\n" + "".join(lines))
    server = LiveServer(proc, found["host"], found["port"], unix_path, lines)
    # Readiness waits for the catalog: real models compile their kernels first (minutes when cold).
    deadline = time.monotonic() + (30 if catalog is None else 900)
    while time.monotonic() < deadline:
        try:
            if server.request("GET", "/readyz")[0] == 200:
                return server
        except OSError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("server never became ready:\n" + "".join(lines))


@pytest.fixture
def live_server(tmp_path):
    """Factory: live_server(*flags) starts `python -m loom` and stops it after the test."""
    started = []

    def start(*flags):
        server = _start_live(tmp_path, flags)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """One `python -m loom` with default flags, shared by a module's read-only tests."""
    server = _start_live(tmp_path_factory.mktemp("loom"), ())
    yield server
    server.stop()


class ThreadServer(Endpoint):
    def __init__(self, server, unix_path):
        tcp = next(l for l in server.listeners if l.transport == "tcp")
        host, port = tcp.sock.getsockname()[:2]
        super().__init__(host, port, unix_path)
        self.server = server
        self.thread = threading.Thread(target=server.serve_forever, kwargs={"signals": False}, daemon=True)
        self.thread.start()

    def call(self, fn, *args, timeout=10):
        """Run fn on the loop thread and return its result."""
        done = threading.Event()
        box = {}

        def run():
            try:
                box["value"] = fn(*args)
            except BaseException as e:  # surfaced to the test below
                box["error"] = e
            done.set()

        self.server.loop.call_soon_threadsafe(run)
        assert done.wait(timeout), "loop did not run the call"
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def stop(self):
        self.server.loop.call_soon_threadsafe(self.server.shutdown)
        self.thread.join(20)
        assert not self.thread.is_alive(), "server thread did not stop"


@pytest.fixture
def thread_server(tmp_path):
    """Factory: thread_server(extra_routes, kinds=None, **config) runs a Server in a thread."""
    from loom.server import Config, Server

    started = []

    def start(extra_routes=(), kinds=None, **config):
        unix_path = str(tmp_path / f"t{len(started)}.sock")
        if "models" not in config:
            (tmp_path / "empty-catalog.json").write_text("[]")
            config["models"] = str(tmp_path / "empty-catalog.json")
        cfg = Config(listen=["tcp:127.0.0.1:0", f"unix:{unix_path}"], **config)
        server = Server(cfg, kinds=kinds, extra_routes=extra_routes)
        server.start()
        ts = ThreadServer(server, unix_path)
        started.append(ts)
        return ts

    yield start
    for ts in started:
        if ts.thread.is_alive():
            ts.stop()
