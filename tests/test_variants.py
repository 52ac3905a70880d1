"""Native executable variants over HTTP: inventory, staging, selection, removal."""

import json
import os
import threading
import time

import numpy as np
import pytest

from test_registry import SOURCE, call, wait_phase
from test_runtime import reference, write_gguf

DOUBLED = open(SOURCE).read().replace(
    "float scale = 1.0f / fmax(sqrt(sum), EPS);", "float scale = 2.0f / fmax(sqrt(sum), EPS);")
BROKEN = open(SOURCE).read().replace("float sum = 0.0f;\n    for (int i = 0; i < N", "float sum = 0.0f\n    for (int i = 0; i < N")
CHANGED_CONTRACT = open(SOURCE).read().replace("spec EPS = 1e-12", "spec EPS = 1e-6")


def inventory(server, model="m", **headers):
    status, _, data = server.request("GET", "/v1/models/variants",
                                     headers={"X-Loom-Model": model, **headers})
    return status, json.loads(data)


def embed(server):
    status, body = call(server, "/v1/embeddings", {"model": "m", "input": [[1, 2, 3]]})
    assert status == 200, body
    return np.array(body["data"][0]["embedding"])


@pytest.fixture
def server(live_server, tmp_path):
    srv = live_server("--device", "cpu")
    srv.expected = write_gguf(tmp_path / "m.gguf", "F16", seed=4)
    for name, text in (("doubled.loom", DOUBLED), ("broken.loom", BROKEN), ("contract.loom", CHANGED_CONTRACT)):
        (tmp_path / name).write_text(text)
    srv.dir = str(tmp_path)
    doc = {"model": "m", "kind": "embedding", "sources": [SOURCE], "checkpoint": "m.gguf",
           "base_directory": str(tmp_path), "variant_capacity": 3}
    assert call(srv, "/v1/models/register", doc)[0] == 202
    wait_phase(srv, "m", "ready")
    return srv


def test_stage_select_remove(server):
    want = reference(*server.expected, [[1, 2, 3]])[0]
    status, inv = inventory(server)
    assert status == 200 and inv["object"] == "list" and inv["count"] == 1 and inv["offset"] == 0
    base = inv["selected"]
    assert inv["data"] == [{"object": "variant", "id": base, "base": None, "phase": "ready", "users": 1,
                            "created": inv["data"][0]["created"]}]
    model = json.loads(server.request("GET", "/v1/models")[2])["data"][0]
    assert model["loom"]["variants"] == {"selected": base, "count": 1}

    status, body = call(server, "/v1/models/variants", {"model": "m", "base": base, "base_directory": server.dir,
                                                        "sources": ["doubled.loom"], "wait": True})
    assert status == 200, body
    new = body["variant"]["id"]
    assert body["selected"] == base and body["variant"]["phase"] == "ready" and body["variant"]["base"] == base
    assert new > base and body["variant"]["diagnostics"]
    np.testing.assert_allclose(embed(server), want, atol=2e-5)          # staging does not switch

    status, body = call(server, "/v1/models/variants/select", {"model": "m", "variant": new, "expected": new})
    assert status == 409 and body["error"]["code"] == "stale_expected"
    np.testing.assert_allclose(embed(server), want, atol=2e-5)          # nothing switched
    assert call(server, "/v1/models/variants/select", {"model": "m", "variant": new, "expected": base}) == \
        (200, {"selected": new})
    np.testing.assert_allclose(embed(server), 2 * want, atol=4e-5)      # the new kernel runs

    status, body = call(server, "/v1/models/variants/remove", {"model": "m", "variant": new})
    assert status == 409 and body["error"]["code"] == "variant_busy"
    assert call(server, "/v1/models/variants/remove", {"model": "m", "variant": base}) == (200, {"removed": base})
    assert call(server, "/v1/models/variants/remove", {"model": "m", "variant": base})[0] == 404
    status, inv = inventory(server)
    assert [v["id"] for v in inv["data"]] == [new] and inv["selected"] == new
    status, detail = inventory(server, **{"X-Loom-Variant": str(new)})
    assert status == 200 and detail["id"] == new and "diagnostics" in detail


def test_failed_compilation_and_contract(server):
    base = inventory(server)[1]["selected"]
    status, body = call(server, "/v1/models/variants", {"model": "m", "base": base, "base_directory": server.dir,
                                                        "sources": ["broken.loom"]})
    assert status == 422 and body["variant"]["phase"] == "failed" and body["selected"] == base
    assert body["variant"]["error"]["code"] == "compile"
    assert any("error" in d["log"] for d in body["variant"]["diagnostics"])
    status, body = call(server, "/v1/models/variants", {"model": "m", "base": base, "base_directory": server.dir,
                                                        "sources": ["contract.loom"], "wait": True})
    assert status == 422 and body["variant"]["error"]["code"] == "contract"
    assert "specs" in body["variant"]["error"]["message"]
    status, body = call(server, "/v1/models/variants", {"model": "m", "base": base, "base_directory": server.dir,
                                                        "sources": ["doubled.loom"]})
    assert status == 429 and body["error"]["code"] == "variant_capacity"   # capacity 3: base + two failed
    failed = [v["id"] for v in inventory(server)[1]["data"] if v["phase"] == "failed"]
    status, body = call(server, "/v1/models/variants/select", {"model": "m", "variant": failed[0], "expected": base})
    assert status == 409 and inventory(server)[1]["selected"] == base


def test_asynchronous_staging(server):
    base = inventory(server)[1]["selected"]
    status, body = call(server, "/v1/models/variants", {"model": "m", "base": base, "base_directory": server.dir,
                                                        "sources": ["doubled.loom"], "wait": False})
    assert status == 202 and body["variant"]["phase"] == "compiling" and body["selected"] == base
    vid = body["variant"]["id"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        record = inventory(server, **{"X-Loom-Variant": str(vid)})[1]
        if record["phase"] != "compiling":
            break
        time.sleep(0.05)
    assert record["phase"] == "ready"


@pytest.mark.parametrize("headers,status", [
    ({"X-Loom-Offset": "0", "X-Loom-Variant": "1"}, 400),
    ({"X-Loom-Offset": "-1"}, 400),
    ({"X-Loom-Variant": "999999"}, 404),
])
def test_inventory_rejections(server, headers, status):
    assert inventory(server, **headers)[0] == status


def test_inventory_selector_and_body_rules(server):
    assert server.request("GET", "/v1/models/variants")[0] == 400                       # no X-Loom-Model
    assert server.request("GET", "/v1/models/variants", headers={"X-Loom-Model": "nope"})[0] == 404
    assert server.request("GET", "/v1/models/variants", body=b"{}", headers={"X-Loom-Model": "m"})[0] == 400
    assert inventory(server, **{"X-Loom-Offset": "5"})[1]["data"] == []


def test_stage_rejections(server):
    base = inventory(server)[1]["selected"]
    ok = {"model": "m", "base": base, "base_directory": server.dir, "sources": ["doubled.loom"]}
    cases = [
        (dict(ok, prepare="x.loom"), 400, "unknown_field"),
        (dict(ok, base_directory="relative"), 400, "invalid_value"),
        ({k: v for k, v in ok.items() if k != "base_directory"}, 400, "invalid_value"),
        (dict(ok, base=987654), 404, "variant_not_found"),
        (dict(ok, model="nope"), 404, "model_not_found"),
        (dict(ok, sources=[]), 400, "invalid_value"),
    ]
    for body, status, code in cases:
        got, resp = call(server, "/v1/models/variants", body)
        assert (got, resp["error"]["code"]) == (status, code), (body, resp)


def test_variants_disabled_is_501_and_ids_never_recycle(server, tmp_path):
    first = inventory(server)[1]["selected"]
    doc = {"model": "plain", "kind": "embedding", "sources": [SOURCE], "checkpoint": os.path.join(server.dir, "m.gguf")}
    assert call(server, "/v1/models/register", dict(doc, base_directory=server.dir))[0] == 202
    wait_phase(server, "plain", "ready")
    assert inventory(server, "plain")[0] == 501
    assert call(server, "/v1/models/variants/select", {"model": "plain", "variant": 1, "expected": 1})[0] == 501
    call(server, "/v1/models/unregister", {"model": "m"})
    assert call(server, "/v1/models/register", {"model": "m", "kind": "embedding", "sources": [SOURCE],
                                                "checkpoint": "m.gguf", "base_directory": server.dir,
                                                "variant_capacity": 2})[0] == 202
    wait_phase(server, "m", "ready")
    assert inventory(server)[1]["selected"] > first


def test_unregister_withdraws_waiting_compilation_readers(thread_server, tmp_path):
    write_gguf(tmp_path / "m.gguf", "F32", seed=1)
    (tmp_path / "doubled.loom").write_text(DOUBLED)
    ts = thread_server(device="cpu")
    doc = {"model": "m", "kind": "embedding", "sources": [SOURCE], "checkpoint": "m.gguf",
           "base_directory": str(tmp_path), "variant_capacity": 2}
    assert call(ts, "/v1/models/register", doc)[0] == 202
    wait_phase(ts, "m", "ready")
    prepared = ts.server.registry.registrations["m"].prepared
    original = prepared.compile_layout
    # Hold the candidate's compilation so the reader is still waiting when the model is removed.
    prepared.compile_layout = lambda *a: ts.server.loop.call_later(1.5, original, *a)
    base = inventory(ts)[1]["selected"]
    result = {}
    reader = threading.Thread(target=lambda: result.update(r=call(ts, "/v1/models/variants", {
        "model": "m", "base": base, "base_directory": str(tmp_path), "sources": ["doubled.loom"]})))
    reader.start()
    time.sleep(0.5)
    assert call(ts, "/v1/models/unregister", {"model": "m", "mode": "abort"})[0] == 202
    reader.join(10)
    status, body = result["r"]
    assert status == 410 and body["error"]["code"] == "model_unregistered"
    # The held compilation still completes (1.5 s on, plus the build) and is then dropped with the model.
    deadline = time.monotonic() + 30
    while ts.call(lambda: "m" in ts.server.registry.registrations) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ts.call(lambda: "m" in ts.server.registry.registrations) is False
    assert ts.call(lambda: ts.server.registry.device.pool.usage()["by_owner"].get("m")) is None


def test_management_observation_credit_bounds_open_observations(thread_server, tmp_path):
    """Staged compilations hold the credit until they settle: the ninth observation at
    once (staging, inventory, detail, selection, removal) answers 429, and everything
    comes back once they have."""
    from loom.admin import MANAGEMENT_CREDIT
    write_gguf(tmp_path / "m.gguf", "F32", seed=1)
    (tmp_path / "doubled.loom").write_text(DOUBLED)
    ts = thread_server(device="cpu")
    assert call(ts, "/v1/models/register", {"model": "m", "kind": "embedding", "sources": [SOURCE],
                                            "checkpoint": "m.gguf", "base_directory": str(tmp_path),
                                            "variant_capacity": MANAGEMENT_CREDIT + 4})[0] == 202
    wait_phase(ts, "m", "ready")
    stage = {"model": "m", "base": inventory(ts)[1]["selected"], "base_directory": str(tmp_path),
             "sources": ["doubled.loom"]}
    status, spare = call(ts, "/v1/models/variants", stage)          # ready, unselected: removable
    assert status == 200
    spare = spare["variant"]["id"]
    prepared = ts.server.registry.registrations["m"].prepared
    original = prepared.compile_layout
    prepared.compile_layout = lambda *a: ts.server.loop.call_later(2.0, original, *a)
    for _ in range(MANAGEMENT_CREDIT):
        assert call(ts, "/v1/models/variants", dict(stage, wait=False))[0] == 202
    for status, body in (call(ts, "/v1/models/variants", dict(stage, wait=False)), inventory(ts),
                         inventory(ts, **{"X-Loom-Variant": str(spare)}),
                         call(ts, "/v1/models/variants/select", {"model": "m", "variant": spare,
                                                                 "expected": stage["base"]}),
                         call(ts, "/v1/models/variants/remove", {"model": "m", "variant": spare})):
        assert status == 429 and body["error"]["code"] == "management_credit", body
    assert ts.call(lambda: len(prepared.variants)) == MANAGEMENT_CREDIT + 2      # the refusals added nothing
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status, inv = inventory(ts)
        if status == 200 and all(v["phase"] == "ready" for v in inv["data"]):
            break
        time.sleep(0.2)
    assert status == 200 and all(v["phase"] == "ready" for v in inv["data"]) and inv["selected"] == stage["base"]
    assert call(ts, "/v1/models/variants/remove", {"model": "m", "variant": spare}) == (200, {"removed": spare})
    assert ts.call(lambda: ts.server.registry.registrations["m"].observations) == 0
