"""A text deployment's image component (loom/vision.py): registered with the document's
"components", prepared on its own checkpoint, checked against the text model, proven, listed
in /v1/models' input modalities and /v1/status, a residency component of its own, and gone
with the registration, accounting included."""
import importlib.util
import json
import os
import time

import pytest

from conftest import ROOT, _start_live, tiny_scout_dir

_gen = importlib.util.spec_from_file_location("smolvlm_generate", os.path.join(ROOT, "models", "smolvlm", "generate.py"))
generate = importlib.util.module_from_spec(_gen)
_gen.loader.exec_module(generate)
VISION = os.path.join(ROOT, "models", "smolvlm", "vision.loom")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = _start_live(tmp_path_factory.mktemp("vision"), ())
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    """Generated vision towers projecting to the tiny text model's 128 channels, and to SmolLM2's 576."""
    root = tmp_path_factory.mktemp("towers")
    return {width: generate.generate(str(root / str(width)), text_hidden=width) for width in (128, 576)}


def call(server, path, body):
    status, _, data = server.request("POST", path, body=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return status, json.loads(data)


def status(server):
    return json.loads(server.request("GET", "/v1/status")[2])


def registration(server, name):
    return next((r for r in status(server)["registrations"] if r["model"] == name), None)


def wait_phase(server, name, phases, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reg = registration(server, name)
        if reg is not None and reg["phase"] in phases:
            return reg
        time.sleep(0.1)
    raise AssertionError(f"{name} never reached {phases}: {registration(server, name)}")


def scout(name, tower, **fields):
    return dict({"model": name, "kind": "text", "sources": [os.path.join(ROOT, "models", "llama", "llama.loom")],
                 "checkpoint": os.path.join(tiny_scout_dir(), "model.safetensors"), "rows": 2,
                 "context_length": 256, "options": {"chat": "chatml"},
                 "components": {"image": {"sources": [VISION], "checkpoint": os.path.join(tower, "model.safetensors")}}},
                **fields)


def test_an_image_component_registers_serves_its_modality_and_leaves_with_its_memory(server, towers):
    before = status(server)["resources"]["memory"]["used"]
    assert call(server, "/v1/models/register", scout("seer", towers[128]))[0] == 202
    reg = wait_phase(server, "seer", ("ready", "failed"))
    assert reg["phase"] == "ready", reg["error"]
    image = reg["resources"]["components"]["image"]
    weights = sum(a.nbytes for a in generate.tensors(0, 128).values())    # the generated tower, float32
    assert image["resident"] and weights <= image["param_bytes"] <= weights * 1.05
    owners = status(server)["resources"]["memory"]["by_owner"]
    assert owners["seer/image"]["params"] == image["param_bytes"]
    model = next(m for m in json.loads(server.request("GET", "/v1/models")[2])["data"] if m["id"] == "seer")
    assert model["input_modalities"] == ["text", "image"] and model["output_modalities"] == ["text"]
    # Residency selectors: "image" is a component now, an undeclared one is 404.
    assert call(server, "/v1/models/pin", {"model": "seer", "component": "image"})[0] == 200
    assert registration(server, "seer")["resources"]["components"]["image"]["pinned"]
    assert not registration(server, "seer")["resources"]["pinned"]
    assert call(server, "/v1/models/unpin", {"model": "seer", "component": "image"})[0] == 200
    status_code, body = call(server, "/v1/models/pin", {"model": "seer", "component": "audio"})
    assert status_code == 404 and body["error"]["code"] == "component_not_found"
    # The image component's weights leave and return alone; the primary's keep their place.
    assert call(server, "/v1/models/drain", {"model": "seer"})[0] in (200, 202)
    primary = reg["resources"]["param_bytes"]

    def resources():
        res = registration(server, "seer")["resources"]
        return res, status(server)["resources"]["memory"]["by_owner"].get("seer/image", {}).get("params", 0)

    assert call(server, "/v1/models/deactivate", {"model": "seer", "component": "image"})[0] == 202
    res, owned = resources()
    assert not res["components"]["image"]["resident"] and res["components"]["image"]["param_bytes"] == owned == 0
    assert res["resident"] and res["param_bytes"] == primary
    assert call(server, "/v1/models/activate", {"model": "seer", "component": "image"})[0] == 202
    deadline = time.monotonic() + 30
    while not resources()[0]["components"]["image"]["resident"] and time.monotonic() < deadline:
        time.sleep(0.05)
    res, owned = resources()
    assert res["components"]["image"]["resident"] and res["components"]["image"]["param_bytes"] == owned == image["param_bytes"]
    assert call(server, "/v1/models/deactivate", {"model": "seer"})[0] == 202      # primary alone
    res, owned = resources()
    assert not res["resident"] and res["param_bytes"] == 0 and owned == image["param_bytes"]
    assert call(server, "/v1/models/activate", {"model": "seer"})[0] == 202
    assert call(server, "/v1/models/undrain", {"model": "seer"})[0] in (200, 202)
    assert call(server, "/v1/models/unregister", {"model": "seer"})[0] in (200, 202)
    deadline = time.monotonic() + 30
    while registration(server, "seer") is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert registration(server, "seer") is None
    memory = status(server)["resources"]["memory"]
    assert "seer/image" not in memory["by_owner"] and "seer" not in memory["by_owner"]
    assert memory["used"] == before


def test_a_tower_for_another_width_fails_the_registration_by_its_contract(server, towers):
    assert call(server, "/v1/models/register", scout("mismatch", towers[576]))[0] == 202
    reg = wait_phase(server, "mismatch", ("ready", "failed"))
    assert reg["phase"] == "failed" and reg["error"]["code"] == "contract"
    assert "576" in reg["error"]["message"] and "128" in reg["error"]["message"]
    assert "mismatch/image" not in status(server)["resources"]["memory"]["by_owner"]
    call(server, "/v1/models/unregister", {"model": "mismatch"})


@pytest.mark.parametrize("change,param", [
    ({"kind": "embedding"}, "components.image"),                       # only text deployments take one
    ({"components": {"audio": {"sources": [VISION], "checkpoint": "x"}}}, "components.audio"),
    ({"components": {"image": {"sources": [VISION]}}}, "components.image.checkpoint"),
    ({"components": {"image": {"sources": [], "checkpoint": "x"}}}, "components.image.sources"),
    ({"components": {"image": {"sources": [VISION], "checkpoint": "x", "weights": 1}}}, "components.image.weights"),
])
def test_component_documents_that_reject(server, towers, change, param):
    status_code, body = call(server, "/v1/models/register", dict(scout("bad", towers[128]), **change))
    assert status_code == 400, body
    assert body["error"]["param"] == param, body
    assert registration(server, "bad") is None
