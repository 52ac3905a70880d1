"""Registration lifecycle over HTTP on a real server with the affine test package."""

import json
import os
import threading
import time

import numpy as np
import pytest

from conftest import ROOT
from test_runtime import PACKAGE, reference, write_gguf

SOURCE = os.path.join(PACKAGE, "affine.loom")


def call(server, path, body, method="POST"):
    status, _, data = server.request(method, path, body=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return status, json.loads(data)


def status_of(server, name):
    regs = json.loads(server.request("GET", "/v1/status")[2])["registrations"]
    return next((r for r in regs if r["model"] == name), None)


def wait_phase(server, name, phase, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reg = status_of(server, name)
        if reg is not None and reg["phase"] == phase:
            return reg
        time.sleep(0.05)
    raise AssertionError(f"{name} never reached {phase}: {status_of(server, name)}")


def memory(server):
    return json.loads(server.request("GET", "/v1/status")[2])["resources"]["memory"]


class Background:
    """An embeddings request on another thread, to observe waiting."""

    def __init__(self, server, model):
        self.result = None
        self.thread = threading.Thread(target=lambda: setattr(self, "result", call(
            server, "/v1/embeddings", {"model": model, "input": [[1, 2]]})), daemon=True)
        self.thread.start()

    def wait(self, timeout=10):
        self.thread.join(timeout)
        return self.result


@pytest.fixture
def server(live_server, tmp_path):
    srv = live_server("--device", "cpu")
    srv.expected = write_gguf(tmp_path / "m.gguf", "Q8_0", seed=3)
    srv.doc = {"model": "m", "kind": "embedding", "sources": [SOURCE], "checkpoint": "m.gguf",
               "base_directory": str(tmp_path), "pending_capacity": 1}
    return srv


def test_register_serve_and_unregister_back_to_baseline(server):
    baseline = memory(server)
    status, body = call(server, "/v1/models/register", server.doc)
    assert status == 202 and body["object"] == "registration" and body["model"] == "m"
    wait_phase(server, "m", "ready")
    assert [m["id"] for m in json.loads(server.request("GET", "/v1/models")[2])["data"]] == ["m"]
    status, body = call(server, "/v1/embeddings", {"model": "m", "input": [[4, 5, 6]]})
    assert status == 200
    np.testing.assert_allclose(body["data"][0]["embedding"], reference(*server.expected, [[4, 5, 6]])[0],
                               atol=2e-5, rtol=1e-4)
    assert call(server, "/v1/models/register", server.doc)[0] == 409
    status, body = call(server, "/v1/models/unregister", {"model": "m", "mode": "drain"})
    assert status == 202 and body["mode"] == "drain"
    assert json.loads(server.request("GET", "/v1/models")[2])["data"] == []
    assert status_of(server, "m") is None
    after = memory(server)
    assert after["by_owner"] == baseline["by_owner"] and after["used"] == baseline["used"]
    assert call(server, "/v1/embeddings", {"model": "m", "input": [1]})[0] == 404
    assert call(server, "/v1/models/unregister", {"model": "m"})[0] == 404


@pytest.mark.parametrize("change,status,code", [
    ({"base_directory": "relative/dir"}, 400, "invalid_value"),
    ({"model": "bad name!"}, 400, "invalid_value"),
    ({"kind": "chat"}, 400, "invalid_value"),
    ({"surprise": 1}, 400, "unknown_field"),
    ({"rows": 0}, 400, "out_of_range"),
    ({"sources": []}, 400, "invalid_value"),
])
def test_register_rejections(server, change, status, code):
    got_status, body = call(server, "/v1/models/register", dict(server.doc, **change))
    assert got_status == status and body["error"]["code"] == code, body


def test_failed_preparation_is_reported(server):
    call(server, "/v1/models/register", dict(server.doc, checkpoint="absent.gguf"))
    reg = wait_phase(server, "m", "failed")
    assert reg["error"]["code"] == "checkpoint" and "absent.gguf" in reg["error"]["message"]
    assert call(server, "/v1/embeddings", {"model": "m", "input": [1]})[0] == 503
    assert call(server, "/v1/models/unregister", {"model": "m"})[0] == 202
    assert status_of(server, "m") is None


def test_drain_queues_new_requests_until_undrain(server):
    call(server, "/v1/models/register", server.doc)
    wait_phase(server, "m", "ready")
    assert call(server, "/v1/models/drain", {"model": "m"}) == (200, {"model": "m", "admission": "drained"})
    waiter = Background(server, "m")
    time.sleep(0.5)
    assert waiter.result is None and status_of(server, "m")["requests"]["waiting"] == 1
    status, body = call(server, "/v1/embeddings", {"model": "m", "input": [1]})  # pending_capacity is 1
    assert status == 503 and body["error"]["code"] == "queue_full"
    assert call(server, "/v1/models/undrain", {"model": "m"}) == (200, {"model": "m", "admission": "open"})
    status, body = waiter.wait()
    assert status == 200 and len(body["data"]) == 1


def test_unregister_abort_withdraws_waiting_requests_with_410(server):
    call(server, "/v1/models/register", server.doc)
    wait_phase(server, "m", "ready")
    call(server, "/v1/models/drain", {"model": "m"})
    waiter = Background(server, "m")
    time.sleep(0.3)
    assert call(server, "/v1/models/unregister", {"model": "m", "mode": "abort"})[0] == 202
    status, body = waiter.wait()
    assert status == 410 and body["error"]["code"] == "model_unregistered"
    assert status_of(server, "m") is None and "m" not in memory(server)["by_owner"]


def test_residency_operations(server):
    call(server, "/v1/models/register", server.doc)
    wait_phase(server, "m", "ready")
    params = memory(server)["by_owner"]["m"]["params"]
    status, body = call(server, "/v1/models/deactivate", {"model": "m"})
    assert status == 409 and body["error"]["code"] == "not_drained"
    call(server, "/v1/models/drain", {"model": "m"})
    for component, code in (("image", 404), ("Bad!", 400)):
        assert call(server, "/v1/models/deactivate", {"model": "m", "component": component})[0] == code
    assert call(server, "/v1/models/deactivate", {"model": "m", "component": 5})[0] == 400
    assert call(server, "/v1/models/deactivate", {"model": "m", "component": "primary"})[0] == 202
    assert memory(server)["by_owner"].get("m", {}).get("params", 0) == 0    # weights really left
    assert status_of(server, "m")["resources"]["resident"] is False
    assert call(server, "/v1/models/activate", {"model": "m"})[0] == 202
    deadline = time.monotonic() + 10
    while not status_of(server, "m")["resources"]["resident"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert memory(server)["by_owner"]["m"]["params"] == params              # and came back
    assert call(server, "/v1/models/pin", {"model": "m"}) == (200, {"model": "m", "component": "primary",
                                                                     "pinned": True})
    assert status_of(server, "m")["resources"]["pinned"] is True
    assert call(server, "/v1/models/unpin", {"model": "m"})[1]["pinned"] is False
    assert call(server, "/v1/models/pin", {"model": "nope"})[0] == 404
    assert call(server, "/v1/models/drain", {"model": "m", "component": "primary"})[0] == 400  # whole registration
    call(server, "/v1/models/undrain", {"model": "m"})
    assert call(server, "/v1/embeddings", {"model": "m", "input": [[1, 2]]})[0] == 200


def test_device_trim(server):
    status, body = call(server, "/v1/devices/trim", {"device": 0, "target_bytes": 0})
    assert status == 200 and "memory" in body and body["device"]["type"] == "cpu"
    assert call(server, "/v1/devices/trim", {"device": 3, "target_bytes": 0})[0] == 404
    assert call(server, "/v1/devices/trim", {"device": 0})[0] == 400
