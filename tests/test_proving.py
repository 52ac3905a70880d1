"""The proving ground (issue 15.5): hostile packages fail their registration or
their staged variant with a clear code and evidence, and the server serving
other models never runs them, stays up and keeps answering."""

import json
import threading
import time

import numpy as np
import pytest

from test_registry import SOURCE, call, memory, status_of, wait_phase
from test_runtime import reference, write_gguf

NORMALIZE = "    float scale = 1.0f / fmax(sqrt(sum), EPS);"
HOSTILE = {
    # A kernel that never returns (volatile: the compiler may not assume it ends).
    "hang": ("    volatile int spin = 1;\n    while (spin) { }\n" + NORMALIZE, "trial_timeout"),
    # Writes just past its output: caught by the guard bytes, not by luck.
    "overrun": (NORMALIZE + "\n    y[S * N + 16] = 1.0f;", "out_of_bounds"),
    # Writes far outside any allocation: the child dies of it, not the server.
    "wild": (NORMALIZE + "\n    y[(size_t)1 << 42] = 1.0f;", "trial_crash"),
    # Kills its process outright, as a driver assertion would.
    "abort": (NORMALIZE + "\n    if (s == 0) { __global volatile int* p = 0; *p = 1; }", "trial_crash"),
}


def hostile(tmp_path, name):
    body, _ = HOSTILE[name]
    text = open(SOURCE).read()
    assert NORMALIZE in text
    path = tmp_path / f"{name}.loom"
    path.write_text(text.replace(NORMALIZE, body))
    return str(path)


@pytest.fixture
def server(live_server, tmp_path):
    srv = live_server("--device", "cpu", "--trial_timeout", "8")
    srv.expected = write_gguf(tmp_path / "m.gguf", "F32", seed=3)
    srv.doc = {"model": "good", "kind": "embedding", "sources": [SOURCE], "checkpoint": "m.gguf",
               "base_directory": str(tmp_path), "variant_capacity": 4}
    assert call(srv, "/v1/models/register", srv.doc)[0] == 202
    wait_phase(srv, "good", "ready")
    return srv


def embeds_right(server):
    status, body = call(server, "/v1/embeddings", {"model": "good", "input": [[1, 2, 3]]})
    assert status == 200, body
    np.testing.assert_allclose(body["data"][0]["embedding"], reference(*server.expected, [[1, 2, 3]])[0],
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_package_fails_its_registration_and_the_server_serves_on(server, tmp_path, name):
    code = HOSTILE[name][1]
    stop, health = threading.Event(), []

    def watch():            # /healthz and another model answer throughout
        while not stop.is_set():
            started = time.monotonic()
            health.append((server.request("GET", "/healthz")[0], time.monotonic() - started))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        doc = dict(server.doc, model=name, sources=[hostile(tmp_path, name)])
        assert call(server, "/v1/models/register", doc)[0] == 202
        reg = wait_phase(server, name, "failed", timeout=30)
        embeds_right(server)
    finally:
        stop.set()
        watcher.join()
    assert reg["error"]["code"] == code, reg["error"]
    # The kernel's name is the server file's: /v1/status withholds it, the operator's stderr has it.
    assert "l2_normalize" not in reg["error"]["message"] and f"({code})" in reg["error"]["message"], reg["error"]
    assert code == "trial_crash" or any("l2_normalize" in line for line in server.stderr_lines)
    assert all(status == 200 for status, _ in health) and max(s for _, s in health) < 2.0
    assert name not in memory(server)["by_owner"]
    status, body = call(server, "/v1/embeddings", {"model": name, "input": [[1]]})
    assert status == 422 and body["error"]["code"] == "model_failed"


@pytest.mark.parametrize("name,old,new,codes", [
    # A runaway grid: 2^62 work-items would run for ever.
    ("grid", "    defines { N = DIM, EPS = EPS }\n    grid [S]",
     "    defines { N = DIM, EPS = EPS }\n    grid [S * 2147483647, 2147483647]", {"device_limit"}),
    # More local memory than any device has: the build or the trial refuses it.
    ("local", NORMALIZE, "    __local float big[1 << 28];\n    big[s] = sum;\n    sum = big[0];\n" + NORMALIZE,
     {"compile", "device_limit"}),
    # A state no device can hold (issue 15.7: it used to fail with code internal).
    ("state", "policy {", "state big : f32 [2147483647, 2147483647]\n\npolicy {", {"device_memory"}),
    ("state_dims", "policy {", "state big : f32 [2147483648, 2147483648]\n\npolicy {", {"bind"}),
    # A scratch no device can hold.
    ("scratch", "    scratch pooled : f32 [S, D]", "    scratch pooled : f32 [S, D]\n    scratch huge : f32 [T * 65536, 2147483647]",
     {"device_limit"}),
])
def test_packages_over_the_device_limits_fail_cleanly(server, tmp_path, name, old, new, codes):
    text = open(SOURCE).read()
    assert old in text
    (tmp_path / f"{name}.loom").write_text(text.replace(old, new))
    doc = dict(server.doc, model=name, sources=[str(tmp_path / f"{name}.loom")])
    assert call(server, "/v1/models/register", doc)[0] == 202
    reg = wait_phase(server, name, "failed", timeout=30)
    assert reg["error"]["code"] in codes, reg["error"]
    embeds_right(server)
    assert name not in memory(server)["by_owner"]


def test_a_hostile_variant_fails_its_staging_and_the_selection_stays(server, tmp_path):
    base = json.loads(server.request("GET", "/v1/models/variants", headers={"X-Loom-Model": "good"})[2])["selected"]
    status, body = call(server, "/v1/models/variants", {"model": "good", "base": base,
                                                        "sources": [hostile(tmp_path, "overrun")]})
    assert status == 422 and body["variant"]["phase"] == "failed", body
    assert body["variant"]["error"]["code"] == "out_of_bounds" and body["selected"] == base
    embeds_right(server)


def test_a_clean_package_passes_its_trial(server):
    """The trial is not a formality that passes anything: the good package ran it too
    (its log line), and the probe's outputs were computed."""
    assert status_of(server, "good")["phase"] == "ready"
    lines = "".join(server.stderr_lines)
    assert "trial run of good: clean" in lines


LATE = NORMALIZE.replace("    float scale", "    if (S > 1) { volatile int spin = 1; while (spin) { } }\n    float scale")


def test_a_step_past_its_deadline_fails_the_deployment_and_sigterm_still_exits(live_server, tmp_path):
    """A kernel that hangs only beyond the probe geometry passes its trial; its first such
    step then passes step_timeout: the request answers 503 step_timeout, the deployment
    fails with the reason, /healthz never stalls, and SIGTERM exits within
    --shutdown_timeout although a device step never ends."""
    server = live_server("--device", "cpu", "--shutdown_timeout", "2")
    write_gguf(tmp_path / "m.gguf", "F32", seed=3)
    (tmp_path / "late.loom").write_text(open(SOURCE).read().replace(NORMALIZE, LATE))
    doc = {"model": "late", "kind": "embedding", "sources": [str(tmp_path / "late.loom")], "checkpoint": "m.gguf",
           "base_directory": str(tmp_path), "step_timeout": 2}
    assert call(server, "/v1/models/register", doc)[0] == 202
    wait_phase(server, "late", "ready")
    assert call(server, "/v1/embeddings", {"model": "late", "input": [[1]]})[0] == 200     # S = 1: fine
    result = {}
    hung = threading.Thread(target=lambda: result.update(r=call(server, "/v1/embeddings",
                                                                 {"model": "late", "input": [[1], [2]]})))
    started = time.monotonic()
    hung.start()
    health = []
    while hung.is_alive() and time.monotonic() - started < 60:
        t = time.monotonic()
        assert server.request("GET", "/healthz")[0] == 200
        health.append(time.monotonic() - t)
        time.sleep(0.1)
    status, body = result["r"]
    assert status == 503 and body["error"]["code"] == "step_timeout", body
    assert max(health) < 1.0
    reg = status_of(server, "late")
    assert reg["phase"] == "failed" and reg["error"]["code"] == "step_timeout"
    status, body = call(server, "/v1/embeddings", {"model": "late", "input": [[1]]})
    assert status == 503 and body["error"]["code"] == "step_timeout"
    stopping = time.monotonic()
    assert server.stop(timeout=15) == 0
    assert time.monotonic() - stopping < 2 + 3       # the grace, plus the bounded device teardown


def test_a_geometry_over_the_device_limits_fails_its_request_not_the_server(server, tmp_path):
    """Plan time checks every launch against the device (issue 15: launch geometry, local
    memory): a grid that runs away only beyond the probe answers 500 device_limit for that
    request, and the same deployment still serves the shapes it can."""
    text = open(SOURCE).read()
    old = "    defines { N = DIM, EPS = EPS }\n    grid [S]"
    assert old in text
    (tmp_path / "runaway.loom").write_text(text.replace(
        old, "    defines { N = DIM, EPS = EPS }\n    grid [(S - 1) * 1073741824 + S, (S - 1) * 1073741824 + 1]"))
    doc = dict(server.doc, model="runaway", sources=[str(tmp_path / "runaway.loom")])
    assert call(server, "/v1/models/register", doc)[0] == 202
    wait_phase(server, "runaway", "ready")
    status, body = call(server, "/v1/embeddings", {"model": "runaway", "input": [[1], [2]]})
    assert status == 500 and body["error"]["code"] == "device_limit", body
    status, body = call(server, "/v1/embeddings", {"model": "runaway", "input": [[1]]})
    assert status == 200, body
    embeds_right(server)
