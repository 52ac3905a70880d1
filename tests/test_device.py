"""loom.device on the real CPU drivers: probing, selection, the memory pool, transfers, metrics."""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import loom.device as loom_device
from conftest import ROOT
from loom import __main__ as cli
from loom.device import (DEFAULT_MEMORY_FRACTION, Device, MemoryPool, NoUsableDevice, OutOfDeviceMemory,
                         driver_family, list_devices, select_device)
from loom.metrics import Registry

MiB = 1 << 20


@pytest.fixture(scope="module")
def device():
    return Device("cpu")


def pool_of(device, limit=16 * MiB, max_allocation=None):
    """A fresh pool on the shared context, so each test starts from zero."""
    return MemoryPool(device.context, limit, max_allocation or device.info["max_allocation_bytes"])


def baseline(usage):
    return {k: v for k, v in usage.items() if k != "peak"}


# -- selection -------------------------------------------------------------

def fake(*rows):
    """list_devices()-shaped rows from (platform, device, name, type)."""
    return [{"index": i, "platform": p, "device": d, "name": name, "type": kind}
            for i, (p, d, name, kind) in enumerate(rows)]


MIXED = fake((0, 0, "pthread-AMD EPYC", "cpu"), (1, 0, "Intel(R) UHD Graphics 770", "gpu"),
             (1, 1, "NVIDIA H200", "gpu"))


def test_default_prefers_the_first_gpu_of_any_platform_then_the_cpu():
    assert select_device(MIXED, None) == 1
    assert select_device(fake((0, 0, "pthread-AMD EPYC", "cpu"), (0, 1, "FPGA", "accelerator")), None) == 0
    with pytest.raises(ValueError, match="no OpenCL device matches a GPU or CPU; devices: 0 .* FPGA"):
        select_device(fake((0, 0, "FPGA", "accelerator")), None)
    with pytest.raises(ValueError, match="devices: none"):
        select_device([], None)


@pytest.mark.parametrize("selector, index", [
    ("cpu", 0), ("GPU", 1), ("0", 0), ("2", 2), ("1:1", 2), ("0:0", 0), ("h200", 2), ("uhd", 1),
    ("Graphics", 1), ("EPYC", 0),
])
def test_selectors(selector, index):
    assert select_device(MIXED, selector) == index


@pytest.mark.parametrize("selector", ["3", "0:1", "2:0", "accelerator", "radeon", "1:", ":1", "1:0:0"])
def test_unknown_selector_lists_what_exists(selector):
    with pytest.raises(ValueError) as e:
        select_device(MIXED, selector)
    message = str(e.value)
    assert repr(selector) in message
    for name in ("0 (0:0) pthread-AMD EPYC [cpu]", "1 (1:0) Intel(R) UHD Graphics 770 [gpu]", "NVIDIA H200"):
        assert name in message


@pytest.mark.parametrize("selector", ["", 0, b"cpu"])
def test_selector_must_be_a_non_empty_string(selector):
    with pytest.raises(ValueError, match="non-empty string"):
        select_device(MIXED, selector)


def test_list_devices_describes_the_real_device():
    devices = list_devices()
    assert devices and [d["index"] for d in devices] == list(range(len(devices)))
    cpu = next(d for d in devices if d["type"] == "cpu")
    assert cpu["global_memory_bytes"] >= cpu["max_allocation_bytes"] > 0
    assert cpu["compute_units"] >= 1
    assert cpu["opencl_version"].startswith("OpenCL ")
    assert cpu["fp16"] == ("cl_khr_fp16" in cpu["extensions"])
    assert isinstance(cpu["platform_name"], str) and isinstance(cpu["name"], str)


def test_device_selectors_on_the_real_machine(device):
    devices = list_devices()
    me = device.info
    assert Device().info["name"] == devices[select_device(devices, None)]["name"]
    for selector in (str(me["index"]), f'{me["platform"]}:{me["device"]}', me["name"][-6:].lower()):
        other = Device(selector)
        assert (other.info["index"], other.info["selector"]) == (me["index"], selector)
    with pytest.raises(ValueError) as e:
        Device("no such device anywhere")
    assert me["name"] in str(e.value)
    assert me["name"] in device.describe()


def test_memory_limit_default_and_bounds(device):
    total = device.info["global_memory_bytes"]
    assert device.pool.limit == device.info["memory_limit_bytes"] == int(total * DEFAULT_MEMORY_FRACTION)
    assert Device("cpu", memory_bytes=total).pool.limit == total
    assert Device("cpu", memory_bytes=4096).pool.usage()["limit"] == 4096
    for bad in (total + 1, 0, -1, 1.5, True):
        with pytest.raises(ValueError, match="memory_bytes"):
            Device("cpu", memory_bytes=bad)


# -- probing ---------------------------------------------------------------

def probed(*rows):
    """Rows as _discover makes them, from (platform name, driver version, type, usable reason or None)."""
    return [{"index": i, "platform": i, "device": 0, "name": f"dev{i}", "type": kind,
             "platform_name": platform, "driver": driver_family(platform), "driver_version": version,
             "usable": reason is None, "reason": reason}
            for i, (platform, version, kind, reason) in enumerate(rows)]


def test_int8_isa_needs_intels_runtime_and_avx2_or_vnni_flags(tmp_path, monkeypatch):
    """device.int8_isa: on Intel's runtime from 2026, "vnni" where the CPU lists avx512_vnni and
    avx512bw, else "avx2" where it lists avx2, else ""; "" with CL_CONFIG_CPU_TARGET_ARCH (another
    target without the instruction would abort the compiler). int8_dot is whether it is set, and
    only "avx2" adds a macro to every program (kernel_defines)."""
    monkeypatch.delenv("CL_CONFIG_CPU_TARGET_ARCH", raising=False)
    vnni, plain, old = tmp_path / "vnni", tmp_path / "plain", tmp_path / "old"
    vnni.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n\n")
    plain.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx_vnni\n\n")
    old.write_text("processor\t: 0\nflags\t\t: fpu sse2 sse4_2 avx\n\n")
    intel = "2026.22.10.0.01_160000"
    assert loom_device.int8_isa("intel", intel, vnni) == "vnni"
    assert loom_device.int8_isa("intel", intel, plain) == "avx2"    # AVX-VNNI (256-bit) is not AVX512-VNNI
    assert loom_device.int8_isa("intel", intel, old) == ""
    assert loom_device.int8_dot("intel", intel, plain) and not loom_device.int8_dot("intel", intel, old)
    assert loom_device.int8_isa("intel", "2025.20.6.0.04_224945", vnni) == ""     # an older LLVM's intrinsic form
    assert loom_device.int8_isa("pocl", "3.1", vnni) == ""
    assert loom_device.int8_isa("intel", intel, tmp_path / "missing") == ""
    assert loom_device.kernel_defines({"int8_isa": "avx2"}) == {"LOOM_DOT8_AVX2": 1}
    assert loom_device.kernel_defines({"int8_isa": "vnni"}) == loom_device.kernel_defines({}) == {}
    monkeypatch.setenv("CL_CONFIG_CPU_TARGET_ARCH", "icelake-server")
    assert loom_device.int8_isa("intel", intel, vnni) == ""


def test_driver_families():
    assert driver_family("Portable Computing Language") == "pocl"
    assert driver_family("Intel(R) OpenCL") == "intel"
    assert driver_family("Intel(R) OpenCL Graphics") == "intel"
    assert driver_family("NVIDIA CUDA") == "nvidia"
    assert driver_family("AMD Accelerated Parallel Processing") == "amd"
    assert driver_family("rusticl") == "rusticl"
    assert driver_family("Some Vendor's Platform") == "some"


def test_selection_skips_unusable_devices_and_prefers_measured_drivers():
    broken = "kernel build failed: error: unknown target CPU 'generic'"
    rows = probed(("Portable Computing Language", "3.0-rc2", "cpu", broken),
                  ("Portable Computing Language", "3.1+debian", "cpu", None),
                  ("Intel(R) OpenCL", "2026.22.10.0.01_160000", "cpu", None))
    assert select_device(rows, None) == 2 == select_device(rows, "cpu") == select_device(rows, "intel")
    assert select_device(rows, "pocl") == 1                 # the newer usable PoCL, never the broken one
    assert select_device(rows, "dev") == 2                  # the best usable name match
    assert select_device(rows[:2], None) == 1
    # A usable GPU beats every CPU; an unusable one does not.
    gpu = probed(("NVIDIA CUDA", "550.1", "gpu", None), ("Intel(R) OpenCL", "1", "cpu", None))
    assert select_device(gpu, None) == 0
    gpu[0].update(usable=False, reason="probe kernel computed wrong values")
    assert select_device(gpu, None) == 1
    gpus = probed(("Intel(R) OpenCL Graphics", "24.1", "gpu", None), ("NVIDIA CUDA", "550.1", "gpu", None))
    assert select_device(gpus, None) == 0 == select_device(gpus, "gpu")   # GPUs: the first usable one
    for selector in ("0", "0:0", "dev0"):
        with pytest.raises(NoUsableDevice) as e:
            select_device(rows, selector)
        message = str(e.value)
        assert "every match failed its probe" in message and "unknown target CPU 'generic'" in message
        assert "make install" in message and "pocl-opencl-icd" in message
    with pytest.raises(NoUsableDevice, match="no usable OpenCL device matches a GPU or CPU"):
        select_device(rows[:1], None)
    assert issubclass(NoUsableDevice, ValueError)           # __main__ turns it into exit status 2


def test_every_device_found_is_probed():
    devices = list_devices()
    assert any(d["usable"] for d in devices), devices
    for d in devices:
        assert isinstance(d["usable"], bool) and (d["reason"] is None) == d["usable"]
        assert d["driver"] == driver_family(d["platform_name"])


def test_a_probe_that_builds_wrong_code_is_caught(monkeypatch):
    dev = next(cl_dev for cl_dev, info in loom_device._enumerate() if info["usable"])
    monkeypatch.setattr(loom_device, "PROBE_SOURCE", loom_device.PROBE_SOURCE.replace("* 2.0f", "* 3.0f"))
    assert "wrong values" in loom_device._probe(dev)
    monkeypatch.setattr(loom_device, "PROBE_SOURCE", "__kernel void loom_probe( { syntax error")
    assert loom_device._probe(dev).startswith("kernel build failed: ")


def _best_fails(monkeypatch):
    """Re-probe with the device that would be chosen failing its probe: (its row, the next choice's row)."""
    real = [info for _, info in loom_device._enumerate()]
    usable = sorted((d for d in real if d["usable"] and d["type"] in ("cpu", "gpu")), key=loom_device._preference)
    if len(usable) < 2:
        pytest.skip("needs two usable OpenCL devices (make install provides Intel's runtime and PoCL)")
    best, following = usable[0], usable[1]
    original = loom_device._probe_children

    def probe_children(*args, **kwargs):
        reasons = original(*args, **kwargs)
        reasons[best["platform"], best["device"]] = "probe raised RuntimeError: error: simulated driver fault"
        return reasons

    monkeypatch.setattr(loom_device, "_probe_children", probe_children)
    monkeypatch.setattr(loom_device, "_probed", None)      # restored afterwards: the real table again
    return best, following


FAKE_CHILD = """
import json, os, signal, sys, time
skip = {tuple(x) for x in json.loads(sys.argv[1])}
for p, d in [(0, 0), (0, 1), (1, 0)]:
    if (p, d) in skip:
        continue
    print("loom-probe " + json.dumps({"start": [p, d]}), flush=True)
    print("driver chatter on stdout", flush=True)
    if (p, d) == (0, 1):
        sys.stderr.write("pocl: fatal: illegal instruction in the JIT\\n"); sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGILL)
    if (p, d) == (1, 0) and os.environ.get("FAKE_HANG"):
        time.sleep(60)
    print("loom-probe " + json.dumps({"done": [p, d], "reason": None}), flush=True)
"""


def test_a_driver_that_crashes_or_hangs_in_its_probe_is_skipped_not_fatal(monkeypatch):
    command = (sys.executable, "-c", FAKE_CHILD)
    reasons = loom_device._probe_children(command)
    assert reasons[0, 0] is None and reasons[1, 0] is None            # a second child carried on
    assert reasons[0, 1] == ("the driver crashed the probe (SIGILL): "
                             "pocl: fatal: illegal instruction in the JIT")
    monkeypatch.setenv("FAKE_HANG", "1")
    reasons = loom_device._probe_children(command, timeout=1)
    assert reasons[1, 0] == "the probe did not finish within 1 s (a hung driver)"
    assert reasons[0, 0] is None and reasons[0, 1].startswith("the driver crashed the probe (SIGILL)")
    broken = loom_device._probe_children((sys.executable, "-c", "import sys; sys.exit('no numpy here')"))
    assert broken == {None: "the probe process failed (exit status 1): no numpy here"}


def test_a_failing_device_is_skipped_reported_and_the_next_chosen(monkeypatch, thread_server):
    best, following = _best_fails(monkeypatch)
    ts = thread_server()
    status = json.loads(ts.request("GET", "/v1/status")[2])
    rows = {d["index"]: d for d in status["devices"]}
    assert len(rows) == len(list_devices())
    failed = rows[best["index"]]
    assert failed["usable"] is False and failed["in_use"] is False
    assert failed["reason"] == "probe raised RuntimeError: error: simulated driver fault"
    assert failed["platform_name"] == best["platform_name"] and failed["driver_version"] == best["driver_version"]
    assert {i: d["int8_dot"] for i, d in rows.items()} == {d["index"]: d["int8_dot"] for d in list_devices()}
    chosen = [d for d in status["devices"] if d["in_use"]]
    assert [d["index"] for d in chosen] == [following["index"]] and chosen[0]["usable"]
    assert status["resources"]["device"]["index"] == following["index"]


def test_naming_an_unusable_device_fails_start_with_exit_2(monkeypatch, capsys, tmp_path):
    best, _ = _best_fails(monkeypatch)
    (tmp_path / "empty.json").write_text("[]")
    code = cli.main(["--device", str(best["index"]), "--models", str(tmp_path / "empty.json"),
                     "--listen", "tcp:127.0.0.1:0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"loom: cannot start: no usable OpenCL device matches '{best['index']}'")
    assert "simulated driver fault" in err and "make install" in err
    assert cli.main(["--list-devices", "--device", str(best["index"])]) == 2
    out = capsys.readouterr()
    assert "unusable: probe raised RuntimeError" in out.out and "loom: no usable" in out.err


def test_list_devices_and_an_unknown_device_from_the_command_line(tmp_path):
    listing = subprocess.run([sys.executable, "-m", "loom", "--list-devices"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert len(lines) == len(list_devices()) and sum(line.startswith("*") for line in lines) == 1
    chosen = list_devices()[select_device(list_devices(), None)]
    assert f"* {chosen['index']} ({chosen['platform']}:{chosen['device']}) {chosen['name']}" in listing.stdout
    (tmp_path / "empty.json").write_text("[]")
    run = subprocess.run([sys.executable, "-m", "loom", "--device", "no such device anywhere", "--models",
                          str(tmp_path / "empty.json"), "--listen", "tcp:127.0.0.1:0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "loom: cannot start: no OpenCL device matches 'no such device anywhere'" in run.stderr
    assert chosen["name"] in run.stderr and "make install" in run.stderr


def test_the_loader_sees_intel_runtime_through_a_private_vendors_folder():
    intel = loom_device._intel_runtime()
    folder = os.environ.get("OCL_ICD_VENDORS")
    if intel is None or folder is None or not os.path.basename(folder).startswith("loom-opencl-vendors-"):
        pytest.skip("Intel's runtime is not installed here, or the operator set OCL_ICD_VENDORS")
    assert open(os.path.join(folder, "loom-intel-cpu.icd")).read() == f"{intel}\n"
    assert any(d["driver"] == "intel" for d in list_devices())


# -- accounting ------------------------------------------------------------

def test_accounting_by_owner_and_kind(device):
    pool = pool_of(device)
    a = pool.alloc(1000, owner="scout", kind="params")
    b = pool.alloc(24, owner="scout", kind="state")
    c = pool.alloc(4096, owner="vectors", kind="params")
    d = pool.alloc(10, owner="server", kind="staging")
    u = pool.usage()
    assert u["used"] == 1000 + 24 + 4096 + 10 and u["buffers"] == 4
    assert u["available"] == u["limit"] - u["used"]
    assert u["by_kind"] == {"params": 5096, "state": 24, "workspace": 0, "staging": 10}
    assert u["by_owner"] == {"scout": {"params": 1000, "state": 24}, "vectors": {"params": 4096},
                             "server": {"staging": 10}}
    assert (a.nbytes, a.capacity, a.owner, a.kind) == (1000, 1000, "scout", "params")
    a.release()
    a.release()                     # idempotent
    pool.release(a)
    assert a.released and a.buffer is None
    u = pool.usage()
    assert u["used"] == 24 + 4096 + 10 and u["by_owner"]["scout"] == {"state": 24}
    for buf in (b, c, d):
        buf.release()
    u = pool.usage()
    assert (u["used"], u["buffers"], u["by_owner"]) == (0, 0, {})
    assert u["by_kind"] == dict.fromkeys(("params", "state", "workspace", "staging"), 0)
    assert u["peak"] == 1000 + 24 + 4096 + 10


def test_zero_byte_allocations(device):
    pool = pool_of(device, limit=4096)
    full = pool.alloc(4096, owner="a", kind="params")
    z = pool.alloc(0, owner="b", kind="workspace")   # fits even in a full pool
    assert z.buffer is None and z.nbytes == z.capacity == 0
    u = pool.usage()
    assert u["buffers"] == 2 and u["by_owner"]["b"] == {"workspace": 0} and u["used"] == 4096
    z.release()
    full.release()
    assert baseline(pool.usage()) == baseline(pool_of(device, limit=4096).usage())


def test_argument_validation(device):
    pool = pool_of(device)
    for nbytes in (-1, 1.0, True, "8"):
        with pytest.raises(ValueError, match="nbytes"):
            pool.alloc(nbytes, owner="a", kind="params")
    with pytest.raises(ValueError, match="owner"):
        pool.alloc(8, owner="", kind="params")
    with pytest.raises(ValueError, match="kind"):
        pool.alloc(8, owner="a", kind="weights")
    with pytest.raises(ValueError, match="host array has 16 bytes"):
        pool.alloc(8, owner="a", kind="params", host=np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="another pool"):
        pool_of(device).release(pool.alloc(8, owner="a", kind="params"))


def test_over_the_limit_fails_cleanly(device):
    pool = pool_of(device, limit=10_000)
    held = pool.alloc(6000, owner="scout", kind="params")
    before = pool.usage()
    with pytest.raises(OutOfDeviceMemory) as e:
        pool.alloc(4001, owner="vectors", kind="state")
    assert (e.value.requested, e.value.available, e.value.limit) == (4001, 4000, 10_000)
    assert (e.value.owner, e.value.kind) == ("vectors", "state")
    assert not isinstance(e.value, MemoryError)
    assert pool.usage() == before
    exact = pool.alloc(4000, owner="vectors", kind="state")    # exactly to the limit fits
    assert pool.usage()["available"] == 0
    exact.release()
    held.release()
    assert pool.usage()["used"] == 0


def test_device_and_driver_refusals_leave_accounting_unchanged(device):
    biggest = device.info["max_allocation_bytes"]
    pool = pool_of(device, limit=4 * biggest)
    with pytest.raises(OutOfDeviceMemory, match="largest single allocation"):
        pool.alloc(biggest + 1, owner="a", kind="params")
    # Lift our own check so the request reaches the driver, which refuses it.
    lifted = pool_of(device, limit=4 * biggest, max_allocation=4 * biggest)
    before = lifted.usage()
    with pytest.raises(OutOfDeviceMemory, match="driver refused") as e:
        lifted.alloc(biggest + 4096, owner="a", kind="params")
    assert e.value.requested == biggest + 4096
    assert lifted.usage() == before


def test_evictor_frees_other_owners_before_failing(device):
    pool = pool_of(device, limit=10_000)
    old = pool.alloc(6000, owner="old", kind="params")
    calls = []

    def evict(needed, requester):
        calls.append((needed, requester))
        if old.released:
            return 0
        old.release()
        return 6000

    pool.set_evictor(evict)
    new = pool.alloc(5000, owner="new", kind="params")
    assert calls == [(1000, "new")]
    assert pool.usage()["by_owner"] == {"new": {"params": 5000}}
    before = pool.usage()
    with pytest.raises(OutOfDeviceMemory):
        pool.alloc(6000, owner="third", kind="params")   # evictor has nothing left to give
    assert calls[-1] == (1000, "third") and pool.usage() == before
    new.release()


def test_workspace_is_bucketed_cached_and_reused(device):
    pool = pool_of(device)
    w = pool.alloc(1000, owner="scout", kind="workspace")
    assert (w.nbytes, w.capacity) == (1000, 1024)
    cl_buffer = w.buffer
    w.release()
    u = pool.usage()
    assert (u["used"], u["buffers"], u["cached_bytes"], u["cached_buffers"]) == (1024, 0, 1024, 1)
    assert u["by_owner"] == {"scout": {"workspace": 1024}}     # idle scratch still counts
    again = pool.alloc(900, owner="scout", kind="workspace")   # same bucket: the same buffer back
    assert again.buffer is cl_buffer and pool.usage()["cached_bytes"] == 0
    other = pool.alloc(1000, owner="vectors", kind="workspace")  # owners never share scratch
    assert other.buffer is not cl_buffer
    for n, capacity in ((1, 256), (256, 256), (257, 512), (1025, 1280), (5 * MiB + 1, 6 * MiB)):
        buf = pool.alloc(n, owner="sizes", kind="workspace")
        assert buf.capacity == capacity and capacity - n < max(256, n // 4 + 1)
        buf.release()
    again.release()
    other.release()
    assert pool.trim(0, owner="sizes") == 256 + 512 + 1280 + 6 * MiB
    assert set(pool.usage()["by_owner"]) == {"scout", "vectors"}
    assert pool.trim(0) == 2048
    u = pool.usage()
    assert (u["used"], u["cached_buffers"], u["by_owner"]) == (0, 0, {})


def test_trim_stops_at_the_target(device):
    pool = pool_of(device)
    for buf in [pool.alloc(4096, owner="a", kind="workspace") for _ in range(4)]:
        buf.release()
    assert pool.usage()["used"] == 4 * 4096
    assert pool.trim(2 * 4096) == 2 * 4096
    assert pool.usage()["cached_buffers"] == 2
    assert pool.trim(10 * 4096) == 0


def test_memory_pressure_drops_idle_workspace_before_evicting(device):
    pool = pool_of(device, limit=10_000)
    pool.set_evictor(lambda needed, requester: pytest.fail("evictor called while idle scratch existed"))
    pool.alloc(8192, owner="a", kind="workspace").release()
    held = pool.alloc(9000, owner="b", kind="params")
    assert pool.usage()["by_owner"] == {"b": {"params": 9000}}
    held.release()


def test_host_upload_at_creation_and_round_trips(device):
    pool = device.pool
    data = np.arange(1000, dtype=np.float32)
    buf = pool.alloc(data.nbytes, owner="test", kind="params", host=data)
    np.testing.assert_array_equal(device.download(buf, np.float32, 1000), data)
    device.upload(buf, np.full(10, 7, np.int32), offset=40)
    got = device.download(buf, np.int32, 20, offset=0).view(np.float32)
    np.testing.assert_array_equal(got[:10], data[:10])
    np.testing.assert_array_equal(got[10:].view(np.int32), 7)
    pending = device.download_async(buf, np.float32, 4, offset=3996 - 12)
    while not pending.done():
        pass
    np.testing.assert_array_equal(pending.array, data[-4:])
    with pytest.raises(ValueError, match="do not fit"):
        device.upload(buf, np.zeros(1001, np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        device.download(buf, np.float32, 2, offset=3996)
    empty = pool.alloc(0, owner="test", kind="staging")
    assert device.download(empty, np.float32, 0).shape == (0,)
    assert device.download_async(empty, np.int32, 0).done()
    device.upload(empty, np.zeros(0, np.int8))
    for b in (buf, empty):
        b.release()
    with pytest.raises(ValueError, match="released"):
        device.download(buf, np.float32, 1)
    assert "test" not in pool.usage()["by_owner"]


def test_concurrent_allocations_account_exactly(device):
    pool = pool_of(device, limit=64 * MiB)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        held = []
        try:
            for i in range(300):
                if held and rng.random() < 0.5:
                    held.pop(int(rng.integers(len(held)))).release()
                else:
                    kind = ("params", "state", "workspace", "staging")[i % 4]
                    held.append(pool.alloc(int(rng.integers(0, 64 * 1024)), owner=f"t{seed % 3}", kind=kind))
            for buf in held:
                buf.release()
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    u = pool.usage()
    assert u["buffers"] == 0 and u["used"] == u["cached_bytes"] == u["by_kind"]["workspace"]
    pool.trim(0)
    u = pool.usage()
    assert (u["used"], u["cached_buffers"], u["by_owner"]) == (0, 0, {})
    assert 0 < u["peak"] <= u["limit"]


def test_metrics_gauges_parse(device):
    dev = Device("cpu", memory_bytes=1 * MiB)
    registry = Registry()
    dev.metrics(registry)
    bufs = [dev.pool.alloc(1000, owner='odd "name"', kind="params"), dev.pool.alloc(24, owner="b", kind="state")]
    families = {f.name: f for f in text_string_to_metric_families(registry.expose())}
    owned = {(s.labels["owner"], s.labels["kind"]): s.value for s in families["loom_device_memory_bytes"].samples}
    assert owned == {('odd "name"', "params"): 1000, ("b", "state"): 24}
    assert families["loom_device_memory_limit_bytes"].samples[0].value == MiB
    assert families["loom_device_memory_used_bytes"].samples[0].value == 1024
    for buf in bufs:
        buf.release()
    families = {f.name: f for f in text_string_to_metric_families(registry.expose())}
    assert families["loom_device_memory_bytes"].samples == []
    assert families["loom_device_memory_used_bytes"].samples[0].value == 0
    assert registry.scrape_errors == 0


def test_block_copies_reads_and_writes_move_one_page_of_every_layer(device):
    """The rectangular copies kvcache.PagedState uses, against a numpy model of
    the [groups][pages][page_bytes] layout."""
    groups, pages, page = 3, 5, 64
    model = np.random.default_rng(0).integers(0, 256, (groups, pages, page), dtype=np.uint8)
    buf = device.pool.alloc(model.nbytes, owner="test", kind="state", host=model)
    pitch = pages * page
    device.copy_blocks(buf.buffer, 1 * page, 3 * page, page, groups, pitch)
    model[:, 3] = model[:, 1]
    host = np.empty((groups, page), np.uint8)
    device.read_blocks_async(buf.buffer, host, 2 * page, page, groups, pitch).wait()
    np.testing.assert_array_equal(host, model[:, 2])
    fresh = np.arange(groups * page, dtype=np.uint8).reshape(groups, page)
    event = device.write_blocks_async(buf.buffer, fresh, 0, page, groups, pitch)
    device.flush()
    event.wait()
    assert device.finished(event)
    model[:, 0] = fresh
    np.testing.assert_array_equal(device.download(buf, np.uint8, model.size).reshape(model.shape), model)
    staged = np.full(16, 7, np.uint8)
    device.upload_async(buf, staged, offset=32).wait()
    assert (device.download(buf, np.uint8, 48)[32:] == 7).all()
    with pytest.raises(ValueError, match="do not fit"):
        device.upload_async(buf, staged, offset=model.nbytes - 8)
    buf.release()
    assert "test" not in device.pool.usage()["by_owner"]
