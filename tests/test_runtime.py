"""The runtime end to end: the affine test package registered from a catalog,
prepared from GGUF and safetensors checkpoints, served over HTTP, and checked
against an independent numpy forward pass."""

import json
import os
import threading
import time

import numpy as np
import pytest

from conftest import ROOT

gguf = pytest.importorskip("gguf")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

PACKAGE = os.path.join(ROOT, "models", "affine")
VOCAB, D, DIM = 50, 64, 24


# -- an independent reference ----------------------------------------------------

def q8_0(x):
    """ggml Q8_0 blocks for rows of x, and the values they decode to (numpy, written here)."""
    blocks = x.reshape(-1, 32)
    d = np.abs(blocks).max(axis=1) / 127
    q = np.round(blocks / np.where(d == 0, 1, d)[:, None]).astype(np.int8)
    d16 = d.astype(np.float16)
    raw = np.concatenate([d16.view(np.uint8).reshape(-1, 2), q.view(np.uint8)], axis=1)
    return raw.reshape(x.shape[0], -1), (d16.astype(np.float32)[:, None] * q).reshape(x.shape)


def q4_0(x):
    blocks = x.reshape(-1, 32)
    idx = np.abs(blocks).argmax(axis=1)
    m = blocks[np.arange(len(blocks)), idx]
    d = m / -8
    inv = np.where(d == 0, 0, 1 / np.where(d == 0, 1, d))
    q = np.clip(np.trunc(blocks * inv[:, None] + 8.5), 0, 15).astype(np.uint8)
    d16 = d.astype(np.float16)
    packed = (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)
    raw = np.concatenate([d16.view(np.uint8).reshape(-1, 2), packed], axis=1)
    return raw.reshape(x.shape[0], -1), (d16.astype(np.float32)[:, None] * (q.astype(np.float32) - 8)).reshape(x.shape)


def reference(embd, proj, bias, inputs):
    out = []
    for ids in inputs:
        y = embd[ids].mean(axis=0) @ proj.T + bias
        out.append(y / max(np.linalg.norm(y), 1e-12))
    return np.array(out)


def make_weights(seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((VOCAB, D)).astype(np.float32), rng.standard_normal((DIM, D)).astype(np.float32),
            rng.standard_normal(DIM).astype(np.float32))


def write_gguf(path, dtype, seed):
    embd, proj, bias = make_weights(seed)
    w = gguf.GGUFWriter(str(path), "affine")
    w.add_uint32("affine.context_length", 16)
    used = {}
    for name, array in (("token_embd.weight", embd), ("proj.weight", proj)):
        if dtype == "F32":
            w.add_tensor(name, array)
            used[name] = array
        elif dtype == "F16":
            w.add_tensor(name, array.astype(np.float16))
            used[name] = array.astype(np.float16).astype(np.float32)
        else:
            raw, values = (q8_0 if dtype == "Q8_0" else q4_0)(array)
            w.add_tensor(name, raw, raw_dtype=getattr(gguf.GGMLQuantizationType, dtype))
            used[name] = values
    w.add_tensor("proj.bias", bias)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return used["token_embd.weight"], used["proj.weight"], bias


def write_safetensors(path, seed):
    embd, proj, bias = make_weights(seed)
    embd16 = embd.astype(np.float16)
    safetensors_numpy.save_file({"token_embd.weight": embd16, "proj.weight": proj, "proj.bias": bias}, str(path))
    return embd16.astype(np.float32), proj, bias


@pytest.fixture(scope="module")
def catalog_server(tmp_path_factory):
    from conftest import _start_live
    tmp = tmp_path_factory.mktemp("affine")
    expected, docs = {}, []
    for i, dtype in enumerate(["F32", "F16", "Q8_0", "Q4_0"]):
        name = f"affine-{dtype.lower().replace('_', '')}"
        expected[name] = write_gguf(tmp / f"{name}.gguf", dtype, seed=i)
        docs.append({"model": name, "kind": "embedding", "sources": [os.path.join(PACKAGE, "affine.loom")],
                     "checkpoint": f"{name}.gguf", "base_directory": "."})
    expected["affine-st"] = write_safetensors(tmp / "st.safetensors", seed=9)
    docs.append({"model": "affine-st", "kind": "embedding", "sources": [os.path.join(PACKAGE, "affine.loom")],
                 "checkpoint": "st.safetensors", "base_directory": "."})
    docs.append({"model": "broken", "kind": "embedding", "sources": [os.path.join(PACKAGE, "affine.loom")],
                 "checkpoint": "missing.gguf", "base_directory": "."})
    (tmp / "catalog.json").write_text(json.dumps({"models": docs}))
    server = _start_live(tmp, ("--models", str(tmp / "catalog.json"), "--device", "cpu"))
    yield server, expected
    server.stop()


def post(server, body):
    status, _, data = server.request("POST", "/v1/embeddings", body=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return status, json.loads(data)


@pytest.mark.parametrize("model", ["affine-f32", "affine-f16", "affine-q80", "affine-q40", "affine-st"])
def test_embeddings_match_numpy(catalog_server, model):
    server, expected = catalog_server
    inputs = [[1, 2, 3], [7], [49, 0, 0, 5, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
    status, body = post(server, {"model": model, "input": inputs})
    assert status == 200, body
    got = np.array([d["embedding"] for d in body["data"]], np.float32)
    want = reference(*expected[model], inputs)
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    assert body["usage"] == {"prompt_tokens": 20, "total_tokens": 20}
    status, single = post(server, {"model": model, "input": [7], "encoding_format": "base64"})
    assert status == 200
    import base64
    decoded = np.frombuffer(base64.b64decode(single["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(decoded, want[1], atol=2e-5, rtol=1e-4)


def test_catalog_models_are_discoverable_and_failures_reported(catalog_server):
    server, _ = catalog_server
    models = {m["id"]: m for m in json.loads(server.request("GET", "/v1/models")[2])["data"]}
    assert set(models) == {"affine-f32", "affine-f16", "affine-q80", "affine-q40", "affine-st"}
    m = models["affine-q80"]
    assert m["owned_by"] == "local" and m["loom"]["kind"] == "embedding"
    assert m["loom"]["endpoint"] == "/v1/embeddings" and m["loom"]["dimensions"] == DIM
    status = json.loads(server.request("GET", "/v1/status")[2])
    regs = {r["model"]: r for r in status["registrations"]}
    assert regs["broken"]["phase"] == "failed" and regs["broken"]["error"]["code"] == "checkpoint"
    ready = regs["affine-q40"]
    assert ready["phase"] == "ready" and ready["progress"]["bytes_done"] == ready["progress"]["bytes_total"] > 0
    memory = status["resources"]["memory"]
    assert memory["by_owner"]["affine-q40"]["params"] == ready["resources"]["param_bytes"]
    assert status["resources"]["device"]["type"] == "cpu"
    metrics = server.request("GET", "/metrics")[2].decode()
    assert 'loom_device_memory_bytes{owner="affine-q40",kind="params"}' in metrics


def test_embedding_rejections(catalog_server):
    server, _ = catalog_server
    cases = [
        ({"model": "nope", "input": [1]}, 404, "model_not_found"),
        ({"model": "affine-f32", "input": [50]}, 400, "invalid_value"),
        ({"model": "affine-f32", "input": list(range(17))}, 400, "context_length_exceeded"),
        ({"model": "affine-f32", "input": "text"}, 400, "no_tokenizer"),
        ({"model": "affine-f32", "input": [1], "dimensions": 3}, 400, "unsupported_value"),
        ({"model": "affine-f32", "input": [1], "extra": 1}, 400, "unknown_field"),
        ({"model": "affine-f32", "input": []}, 400, None),
        ({"model": "broken", "input": [1]}, 422, "model_failed"),
    ]
    for body, status, code in cases:
        got_status, got = post(server, body)
        assert got_status == status, (body, got)
        if code:
            assert got["error"]["code"] == code, (body, got)
    # Nothing leaked: workspace for requests is returned to the pool's reuse cache, params unchanged.
    before = json.loads(server.request("GET", "/v1/status")[2])["resources"]["memory"]["by_owner"]["affine-f32"]
    for _ in range(5):
        assert post(server, {"model": "affine-f32", "input": [[1, 2], [3]]})[0] == 200
    after = json.loads(server.request("GET", "/v1/status")[2])["resources"]["memory"]["by_owner"]["affine-f32"]
    assert after["params"] == before["params"] and after.get("workspace", 0) <= max(before.get("workspace", 0), 1 << 16)


def test_memory_pressure_evicts_idle_models_and_streams_them_back(tmp_path):
    """Two models whose parameters cannot both fit: each request streams its
    model back, evicting the other, and every answer stays exact."""
    from conftest import _start_live
    docs, expected = [], {}
    for i, name in enumerate(["left", "right"]):
        expected[name] = write_gguf(tmp_path / f"{name}.gguf", "F32", seed=20 + i)
        docs.append({"model": name, "kind": "embedding", "sources": [os.path.join(PACKAGE, "affine.loom")],
                     "checkpoint": f"{name}.gguf", "base_directory": "."})
    (tmp_path / "catalog.json").write_text(json.dumps(docs))
    param_bytes = (VOCAB * D + DIM * D + DIM) * 4
    server = _start_live(tmp_path, ("--models", str(tmp_path / "catalog.json"), "--device", "cpu",
                                    "--memory_bytes", str(param_bytes + param_bytes // 2)))
    try:
        def resident():
            regs = json.loads(server.request("GET", "/v1/status")[2])["registrations"]
            return {r["model"]: r["resources"]["resident"] for r in regs}

        assert resident() == {"left": False, "right": True}  # preparing right evicted idle left
        for name in ["left", "right", "left", "left", "right"]:
            status, body = post(server, {"model": name, "input": [[3, 4], [5]]})
            assert status == 200, body
            got = np.array([d["embedding"] for d in body["data"]], np.float32)
            np.testing.assert_allclose(got, reference(*expected[name], [[3, 4], [5]]), atol=2e-5, rtol=1e-4)
            assert resident()[name] is True
        memory = json.loads(server.request("GET", "/v1/status")[2])["resources"]["memory"]
        assert memory["used"] <= memory["limit"]
        assert sum(owner.get("params", 0) for owner in memory["by_owner"].values()) == param_bytes
    finally:
        assert server.stop() == 0


def test_a_plan_that_does_not_fit_answers_503_and_the_next_request_works(tmp_path):
    """Issue 15.2: running out of device memory while building a plan used to leave
    the request unanswered and the deployment wedged."""
    from conftest import _start_live
    expected = write_gguf(tmp_path / "m.gguf", "F32", seed=7)
    (tmp_path / "catalog.json").write_text(json.dumps([{
        "model": "m", "kind": "embedding", "sources": [os.path.join(PACKAGE, "affine.loom")],
        "checkpoint": "m.gguf", "base_directory": "."}]))
    param_bytes = (VOCAB * D + DIM * D + DIM) * 4
    server = _start_live(tmp_path, ("--models", str(tmp_path / "catalog.json"), "--device", "cpu",
                                    "--memory_bytes", str(param_bytes + 40000)))
    try:
        def workspace():
            memory = json.loads(server.request("GET", "/v1/status")[2])["resources"]["memory"]
            return memory["by_owner"].get("m", {}).get("workspace", 0)

        for _ in range(2):      # the same oversized shape twice: no half-built plan is cached
            status, body = post(server, {"model": "m", "input": [list(range(16))] * 16})
            assert status == 503 and body["error"]["code"] == "device_memory", body
        status, body = post(server, {"model": "m", "input": [[3, 4], [5]]})
        assert status == 200, body
        got = np.array([d["embedding"] for d in body["data"]], np.float32)
        np.testing.assert_allclose(got, reference(*expected, [[3, 4], [5]]), atol=2e-5, rtol=1e-4)
        assert workspace() > 0          # the plan's scratch and the reuse cache
        # Trim releases cached plans as well as idle workspace: nothing stays behind (issue 15.7).
        assert server.request("POST", "/v1/devices/trim", body=b'{"device": 0, "target_bytes": 0}',
                              headers={"Content-Type": "application/json"})[0] == 200
        assert workspace() == 0
        assert post(server, {"model": "m", "input": [[3, 4], [5]]})[0] == 200     # plans again on demand
    finally:
        assert server.stop() == 0


def affine_server(thread_server, tmp_path):
    """An in-process server with m.gguf registered as `m` (affine), prepared."""
    ts = thread_server(device="cpu")
    reg = ts.call(ts.server.registry.register, {
        "model": "m", "kind": "embedding", "sources": [os.path.join(PACKAGE, "affine.loom")],
        "checkpoint": str(tmp_path / "m.gguf")}, str(tmp_path))
    deadline = time.monotonic() + 30
    while ts.call(lambda: reg.phase) == "preparing" and time.monotonic() < deadline:
        time.sleep(0.05)
    return ts, reg


def test_deactivate_activate_and_pinning(thread_server, tmp_path):
    expected = write_gguf(tmp_path / "m.gguf", "Q8_0", seed=5)
    ts, reg = affine_server(thread_server, tmp_path)
    assert reg.phase == "ready"
    pool = ts.server.registry.device.pool
    params = ts.call(lambda: pool.usage()["by_owner"]["m"]["params"])
    assert params > 0
    ts.call(setattr, reg, "pinned", True)
    assert ts.call(ts.server.registry._evict_for, 1 << 30, "other") == 0   # pinned: never evicted
    ts.call(setattr, reg, "pinned", False)
    assert ts.call(ts.server.registry.deactivate, reg) == params
    assert ts.call(lambda: pool.usage()["by_owner"].get("m", {}).get("params", 0)) == 0
    status, body = post(ts, {"model": "m", "input": [9, 8, 7]})          # streams the weights back
    assert status == 200
    np.testing.assert_allclose(np.array(body["data"][0]["embedding"], np.float32),
                               reference(*expected, [[9, 8, 7]])[0], atol=2e-5, rtol=1e-4)
    assert ts.call(lambda: pool.usage()["by_owner"]["m"]["params"]) == params
    ts.call(ts.server.registry.close)
    assert ts.call(lambda: pool.usage()["used"]) == 0  # everything the model held is back


def test_non_finite_block_scales_fail_preparation(thread_server, tmp_path):
    raw, _ = q8_0(np.ones((DIM, D), np.float32))
    raw[0, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)   # the first block's scale
    embd, _, bias = make_weights(0)
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "affine")
    w.add_tensor("token_embd.weight", embd)
    w.add_tensor("proj.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("proj.bias", bias)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ts = thread_server(device="cpu")
    reg = ts.call(ts.server.registry.register, {"model": "bad", "kind": "embedding", "sources": [
        os.path.join(PACKAGE, "affine.loom")], "checkpoint": str(tmp_path / "bad.gguf")})
    deadline = time.monotonic() + 30
    while ts.call(lambda: reg.phase) == "preparing" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reg.phase == "failed" and reg.error["code"] == "weights" and "non-finite" in reg.error["message"]
    assert ts.call(lambda: ts.server.registry.device.pool.usage()["by_owner"].get("bad")) is None


def test_a_driver_that_blocks_in_an_enqueue_never_blocks_the_loop(thread_server, tmp_path, monkeypatch):
    """Steps are enqueued by the device's submission thread: an enqueue that blocks (a
    driver whose queue is full behind a slow kernel) leaves /healthz answering at once,
    and the step still completes, exactly."""
    from loom import device as device_module
    expected = write_gguf(tmp_path / "m.gguf", "F32", seed=9)
    ts, reg = affine_server(thread_server, tmp_path)
    real = device_module.Device.upload_async

    def blocking(self, buf, array, offset=0):
        time.sleep(2.0)
        return real(self, buf, array, offset)

    monkeypatch.setattr(device_module.Device, "upload_async", blocking)
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=post(ts, {"model": "m", "input": [[3, 4]]})))
    worker.start()
    time.sleep(0.3)
    for _ in range(5):
        started = time.monotonic()
        assert ts.request("GET", "/healthz")[0] == 200
        assert time.monotonic() - started < 0.5
    worker.join(30)
    status, body = result["r"]
    assert status == 200, body
    np.testing.assert_allclose(body["data"][0]["embedding"], reference(*expected, [[3, 4]])[0], atol=2e-5, rtol=1e-4)
