"""loom.compiler on the real PoCL CPU device, driven by the server's real event loop."""

import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import loom
from loom.compiler import LIBRARY, LOG_CHARS, BuildFailure, Compiler, Executable
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
