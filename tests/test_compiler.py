"""loom.compiler on the real PoCL CPU device, driven by the server's real event loop."""

import hashlib
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

import loom
from loom.compiler import LIBRARY, LOG_CHARS, BinaryStore, BuildFailure, Compiler, Executable
from loom.device import Device
from loom.metrics import Registry
from loom.loop import Loop

WRITE = "__kernel void k(__global int *out) { out[0] = VALUE; }\n"


@pytest.fixture(scope="module")
def device():
    return Device("cpu")


@pytest.fixture
def loop():
    loop = Loop(workers=2)
    yield loop
    loop.close()


def run_until(loop, predicate, timeout=60):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the loop"
        loop.call_later(0.05, lambda: None)  # bound each select()
        loop.run_once()


def make(device, loop, **kw):
    return Compiler(device, lambda fn, done: loop.run_in_executor(fn, done), **kw)


def run_kernel(device, kernel, count=1, dtype=np.int32):
    buf = device.pool.alloc(count * np.dtype(dtype).itemsize, owner="test", kind="workspace")
    try:
        kernel(device.queue, (1,), None, buf.buffer)
        return device.download(buf, dtype, count)
    finally:
        buf.release()


def test_defines_reach_the_kernel_through_the_library(device, loop, tmp_path):
    (tmp_path / "common.cl").write_text("#define TWICE(x) (2 * (x))\n")
    (tmp_path / "fill.cl").write_text(
        "__kernel void fill(__global float *out) {\n"
        "    TYPE n = TWICE(COUNT);\n"
        "    out[0] = n; out[1] = SCALE; out[2] = OFFSET;\n"
        "}\n")
    compiler = make(device, loop, library=tmp_path)
    source = compiler.library_source("fill")
    assert source.index("TWICE(x)") < source.index("__kernel")
    exe = compiler.compile(source, {"COUNT": 21, "SCALE": 0.25, "TYPE": "int", "OFFSET": -3}, name="fill")
    assert isinstance(exe, Executable) and exe.ok and set(exe.kernels) == {"fill"}
    assert exe.name == "fill" and exe.build_seconds > 0 and len(exe.key) == 64
    np.testing.assert_array_equal(run_kernel(device, exe.kernels["fill"], 3, np.float32), [42, 0.25, -3])


def test_library_names_and_default_directory(device, loop, tmp_path):
    assert LIBRARY == Path(loom.__file__).resolve().parent.parent / "opencl"
    (tmp_path / "solo.cl").write_text("__kernel void k() {}\n")
    compiler = make(device, loop, library=tmp_path)
    assert compiler.library_source("solo") == '#line 1 "solo.cl"\n__kernel void k() {}\n'  # no common.cl
    for bad in ("../solo", "solo.cl", "common", "missing", "", None):
        with pytest.raises(ValueError):
            compiler.library_source(bad)


def test_cache_hits_same_key_and_misses_on_a_different_define(device, loop):
    compiler = make(device, loop)
    first = compiler.compile(WRITE, {"VALUE": 1})
    assert compiler.compile(WRITE, {"VALUE": 1}) is first
    results = []
    compiler.compile_async(WRITE, {"VALUE": 1}, on_done=results.append)
    assert results == []                                  # even a hit arrives later, on the loop
    run_until(loop, lambda: results)
    assert results == [first]
    second = compiler.compile(WRITE, {"VALUE": 2})
    assert second is not first and second.key != first.key
    assert run_kernel(device, second.kernels["k"])[0] == 2 and run_kernel(device, first.kernels["k"])[0] == 1
    stats = compiler.stats()
    assert (stats["builds"], stats["hits"], stats["misses"], stats["entries"]) == (2, 2, 2, 2)
    assert stats["failures"] == stats["compiling"] == 0 and stats["build_seconds"] > 0


def test_concurrent_requests_share_one_build_and_never_block_the_caller(device, loop):
    compiler = make(device, loop)
    results = []
    started = time.perf_counter()
    for _ in range(3):
        compiler.compile_async(WRITE, {"VALUE": 5}, name="five", on_done=results.append)
    assert time.perf_counter() - started < 0.1 and results == []   # the build runs on a worker
    assert compiler.stats()["compiling"] == 1
    run_until(loop, lambda: len(results) == 3)
    assert results[0].ok and results[0] is results[1] is results[2]
    stats = compiler.stats()
    assert (stats["builds"], stats["compiling"], stats["entries"]) == (1, 0, 1)
    assert run_kernel(device, results[0].kernels["k"])[0] == 5


def test_build_failure_is_reported_and_does_not_poison_the_cache(device, loop, tmp_path):
    (tmp_path / "broken.cl").write_text("__kernel void k(__global int *out) {\n"
                                        "    out[0] = 1;\n"
                                        "    out[1] = ;\n"
                                        "}\n")
    compiler = make(device, loop, library=tmp_path)
    registry = Registry()
    compiler.metrics(registry)
    source = compiler.library_source("broken")
    results = []
    compiler.compile_async(source, name="broken", on_done=results.append)
    run_until(loop, lambda: results)
    failure = results[0]
    assert isinstance(failure, BuildFailure) and not failure.ok and failure.name == "broken"
    assert "broken.cl:3:" in failure.log and "broken.cl:3:" in failure.message
    assert compiler.stats()["entries"] == 0
    again = compiler.compile(source, name="broken")        # not cached: it really builds again
    assert not again.ok and compiler.stats()["failures"] == 2
    fixed = compiler.compile(source.replace("= ;", "= 2;"), name="broken")
    assert fixed.ok and compiler.stats()["entries"] == 1
    families = {f.name: f for f in text_string_to_metric_families(registry.expose())}
    builds = {s.labels["outcome"]: s.value for s in families["loom_jit_builds"].samples
              if s.name == "loom_jit_builds_total"}
    assert builds == {"ok": 1, "failed": 2}
    lookups = {s.labels["result"]: s.value for s in families["loom_jit_cache_lookups"].samples
               if s.name.endswith("_total")}
    assert lookups == {"hit": 0, "miss": 3}
    assert families["loom_jit_cache_entries"].samples[0].value == 1
    assert families["loom_jit_compiling"].samples[0].value == 0
    assert families["loom_jit_build_seconds"].samples[0].value > 0


def test_long_build_logs_and_messages_are_bounded(device, loop):
    compiler = make(device, loop)
    failure = compiler.compile("#error " + "x" * (LOG_CHARS + 1000) + "\n__kernel void k() {}\n")
    assert not failure.ok
    assert len(failure.log) < LOG_CHARS + 100 and failure.log.endswith("characters truncated]")
    assert len(failure.message) < 400


def test_warnings_are_kept_on_success(device, loop):
    exe = make(device, loop).compile("#warning check this\n__kernel void warned() {}\n")
    assert exe.ok and "check this" in exe.log


@pytest.mark.parametrize("defines, options", [
    ({"VALUE": "1 -cl-foo"}, ()),
    ({"VALUE": '"x"'}, ()),
    ({"VALUE": "a\nb"}, ()),
    ({"VALUE": float("nan")}, ()),
    ({"VALUE": float("inf")}, ()),
    ({"VALUE": True}, ()),
    ({"VALUE": np.bool_(True)}, ()),
    ({"VALUE": np.float32("nan")}, ()),
    ({"VALUE": None}, ()),
    ({"VALUE": 1 << 64}, ()),
    ({"1VALUE": 1}, ()),
    ({"VALUE=2 -DX": 1}, ()),
    ({"": 1}, ()),
    ({}, ("-I/etc",)),
    ({}, ("-cl-mad-enable -DX=1",)),
    ({}, "-cl-mad-enable"),
    ({}, ("-D", "X=1")),
])
def test_defines_and_options_reject_injection(device, loop, defines, options):
    compiler = make(device, loop)
    with pytest.raises(ValueError):
        compiler.compile(WRITE, defines, options)
    with pytest.raises(ValueError):
        compiler.compile_async(WRITE, defines, options, on_done=lambda r: None)
    assert compiler.stats()["misses"] == 0


def test_key_ignores_define_order_and_numpy_scalars_match_python_numbers(device, loop):
    compiler = make(device, loop)
    first = compiler.compile(WRITE, {"VALUE": 3, "OTHER": 1}, ("-cl-mad-enable",))
    assert compiler.compile(WRITE, {"OTHER": np.int64(1), "VALUE": np.uint32(3)}, ["-cl-mad-enable"]) is first
    assert compiler.stats()["builds"] == 1
    assert run_kernel(device, first.kernels["k"])[0] == 3


def test_a_failing_callback_does_not_starve_the_others(device, loop):
    compiler = make(device, loop)
    results = []

    def broken(result):
        raise RuntimeError("consumer bug")

    compiler.compile_async(WRITE, {"VALUE": 6}, on_done=broken)
    compiler.compile_async(WRITE, {"VALUE": 6}, on_done=results.append)
    run_until(loop, lambda: results)
    compiler.compile_async(WRITE, {"VALUE": 6}, on_done=broken)   # a cache hit, delivered the same way
    compiler.compile_async(WRITE, {"VALUE": 6}, on_done=results.append)
    run_until(loop, lambda: len(results) == 2)
    assert results[0] is results[1] and results[0].ok


def test_lru_eviction_respects_pins(device, loop):
    compiler = make(device, loop, capacity=1)
    a = compiler.compile(WRITE, {"VALUE": 10})
    compiler.pin(a)
    compiler.pin(a)                                # two holders
    b = compiler.compile(WRITE, {"VALUE": 11})
    assert compiler.stats()["entries"] == 2         # capacity bounds the unpinned: only b
    c = compiler.compile(WRITE, {"VALUE": 12})      # b, least recently used and unpinned, goes
    stats = compiler.stats()
    assert (stats["entries"], stats["pinned"]) == (2, 1)
    assert compiler.compile(WRITE, {"VALUE": 10}) is a and compiler.compile(WRITE, {"VALUE": 12}) is c
    compiler.unpin(a)
    assert compiler.stats()["entries"] == 2         # one holder left
    compiler.unpin(a)                               # now a is the least recently used unpinned
    assert compiler.stats()["entries"] == 1
    assert compiler.compile(WRITE, {"VALUE": 12}) is c
    with pytest.raises(ValueError, match="not pinned"):
        compiler.unpin(a)
    builds = compiler.stats()["builds"]
    assert compiler.compile(WRITE, {"VALUE": 11}) is not b and compiler.stats()["builds"] == builds + 1
    assert run_kernel(device, b.kernels["k"])[0] == 11   # an evicted executable still works for its holder


def test_capacity_must_be_positive(device, loop):
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="capacity"):
            make(device, loop, capacity=bad)


# -- binaries kept on disk (--kernel_cache) ------------------------------------

def test_a_second_compiler_loads_the_stored_binary_and_keeps_its_log(device, loop, tmp_path):
    """The next start's compiler finds the binary the first one built: it runs the same,
    its warning log comes back with it, and nothing compiles."""
    source = "#warning kept with the binary\n__kernel void k(__global int *out) { out[0] = VALUE; }\n"
    first = make(device, loop, binaries=BinaryStore(tmp_path))
    built = first.compile(source, {"VALUE": 7})
    assert built.ok and first.stats()["binaries_loaded"] == 0 and len(list(tmp_path.glob("*.bin"))) == 1
    second = make(device, loop, binaries=BinaryStore(tmp_path))
    loaded = second.compile(source, {"VALUE": 7})
    assert loaded.ok and second.stats()["binaries_loaded"] == 1
    assert "kept with the binary" in loaded.log and loaded.log == built.log
    assert run_kernel(device, loaded.kernels["k"])[0] == 7
    other = second.compile(source, {"VALUE": 8})      # another key: built, then stored
    assert run_kernel(device, other.kernels["k"])[0] == 8 and second.stats()["binaries_loaded"] == 1
    assert len(list(tmp_path.glob("*.bin"))) == 2


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_a_damaged_or_refused_file_is_a_miss_and_is_replaced(device, loop, tmp_path_factory, data):
    """Truncated, flipped, grown or foreign-binary files: never an error, the source is
    built again (the right result), and a whole file stands in its place."""
    folder = tmp_path_factory.mktemp("bins")
    make(device, loop, binaries=BinaryStore(folder)).compile(WRITE, {"VALUE": 5})
    (path,) = folder.glob("*.bin")
    raw = bytearray(path.read_bytes())
    damage = data.draw(st.sampled_from(["truncate", "flip", "append", "foreign"]))
    if damage == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif damage == "flip":
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    elif damage == "append":
        raw += data.draw(st.binary(min_size=1, max_size=64))
    else:   # a whole, checksummed envelope around bytes no driver takes
        body = (0).to_bytes(4, "little") + data.draw(st.binary(min_size=0, max_size=256))
        raw = BinaryStore.MAGIC + hashlib.sha256(body).digest() + body
    path.write_bytes(bytes(raw))
    again = make(device, loop, binaries=BinaryStore(folder))
    exe = again.compile(WRITE, {"VALUE": 5})
    assert exe.ok and run_kernel(device, exe.kernels["k"])[0] == 5 and again.stats()["binaries_loaded"] == 0
    assert BinaryStore(folder).get(exe.key) is not None        # replaced by a whole one


def test_the_store_stays_under_its_capacity_oldest_first(device, loop, tmp_path):
    compiler = make(device, loop, binaries=BinaryStore(tmp_path, capacity_bytes=1))
    for value in range(3):
        compiler.compile(WRITE, {"VALUE": value})
        time.sleep(0.01)
    assert len(list(tmp_path.glob("*.bin"))) <= 1 and not list(tmp_path.glob("*.part"))
    roomy = make(device, loop, binaries=BinaryStore(tmp_path / "roomy"))
    sizes = []
    for value in range(3):
        roomy.compile(WRITE, {"VALUE": value})
        sizes.append(sum(p.stat().st_size for p in (tmp_path / "roomy").glob("*.bin")))
        time.sleep(0.01)
    capped = make(device, loop, binaries=BinaryStore(tmp_path / "capped", capacity_bytes=sizes[1]))
    keys = [capped.compile(WRITE, {"VALUE": value}).key for value in range(3)]
    time.sleep(0.01)
    stored = {p.stem for p in (tmp_path / "capped").glob("*.bin")}
    assert keys[0] not in stored and keys[2] in stored


def test_an_unwritable_folder_still_builds(device, loop, tmp_path):
    store = BinaryStore(tmp_path / "ro")
    (tmp_path / "ro").chmod(0o500)
    try:
        compiler = make(device, loop, binaries=store)
        exe = compiler.compile(WRITE, {"VALUE": 3})
        assert exe.ok and run_kernel(device, exe.kernels["k"])[0] == 3
        if not list((tmp_path / "ro").glob("*.bin")):     # root writes anyway
            assert compiler.binaries is None              # one warning, then no more tries
    finally:
        (tmp_path / "ro").chmod(0o700)


def test_cpu_identity_names_the_host_instruction_set(device):
    from loom.device import host_cpu
    assert device.info["type"] != "cpu" or device.identity.endswith("|" + host_cpu())
    assert host_cpu()


def test_a_restarted_server_loads_its_kernels_and_none_keeps_nothing(tmp_path):
    """`python -m loom --kernel_cache DIR`: the second start of the same catalog builds from
    the stored binaries (the jit status says how many) and answers the same; with `none`
    every start compiles."""
    import json

    from conftest import _start_live

    from conftest import tiny_scout_dir
    from loom import demo

    # scout alone (on the tiny checkpoint): every start but the warm one compiles all its kernels.
    catalog = tmp_path / "scout.json"
    catalog.write_text(json.dumps([doc for doc in demo.catalog(text=tiny_scout_dir(), recognizer=False,
                                                                 speaker=False, illustrator=False)
                                   if doc["model"] == "scout"]))

    def start_and_answer(run, cache):
        (tmp_path / run).mkdir()
        server = _start_live(tmp_path / run, ("--models", str(catalog), "--kernel_cache", cache), catalog="scout")
        try:
            body = {"model": "scout", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "temperature": 0}
            status, _, data = server.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            assert status == 200
            jit = json.loads(server.request("GET", "/v1/status")[2])["resources"]["jit"]
            return jit, json.loads(data)["choices"][0]["message"]["content"]
        finally:
            server.stop()

    kernels = tmp_path / "kernels"
    cold, first = start_and_answer("cold", str(kernels))
    assert cold["builds"] > 0 and cold["binaries_loaded"] == 0 and len(list(kernels.glob("*.bin"))) == cold["builds"]
    warm, second = start_and_answer("warm", str(kernels))
    assert warm["binaries_loaded"] == warm["builds"] == cold["builds"] and second == first
    none, third = start_and_answer("none", "none")
    assert none["builds"] == cold["builds"] and none["binaries_loaded"] == 0 and third == first
