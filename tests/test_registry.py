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
    assert status == 200, body
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


def test_every_kind_of_the_language_is_served():
    from loom import language, routes
    assert sorted(k.name for k in routes.KINDS) == sorted(language.KINDS)


def test_a_kind_without_an_implementation_rejects_instead_of_registering(thread_server, server):
    """A build that serves fewer kinds (an appliance without image generation) names what it serves."""
    from loom import embeddings
    small = thread_server(kinds=[embeddings.KIND])
    status, body = call(small, "/v1/models/register", dict(server.doc, kind="image"))
    assert (status, body["error"]["code"], body["error"]["param"]) == (400, "unsupported_kind", "kind")
    assert "'image'" in body["error"]["message"] and "served kinds: embedding" in body["error"]["message"]
    assert status_of(small, "m") is None
    assert json.loads(small.request("GET", "/v1/models")[2])["data"] == []


def test_failed_preparation_is_reported(server):
    call(server, "/v1/models/register", dict(server.doc, checkpoint="absent.gguf"))
    reg = wait_phase(server, "m", "failed")
    assert reg["error"]["code"] == "checkpoint" and "absent.gguf" in reg["error"]["message"]
    # Not retryable, so not 503: the reason's first line and where the rest is.
    status, body = call(server, "/v1/embeddings", {"model": "m", "input": [1]})
    assert (status, body["error"]["code"], body["error"]["type"]) == (422, "model_failed", "unprocessable_entity_error")
    assert "(checkpoint)" in body["error"]["message"] and "/v1/status" in body["error"]["message"]
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


def test_drained_registration_defers_preparation(server):
    assert call(server, "/v1/models/register", dict(server.doc, admission="drained"))[0] == 202
    time.sleep(0.3)
    reg = status_of(server, "m")
    assert reg["phase"] == "registered" and "m" not in memory(server)["by_owner"]
    assert call(server, "/v1/embeddings", {"model": "m", "input": [1]})[0] == 503
    assert call(server, "/v1/models/activate", {"model": "m"})[0] == 409   # not a prepared registration
    assert call(server, "/v1/models/undrain", {"model": "m"})[0] == 200
    wait_phase(server, "m", "ready")
    assert call(server, "/v1/embeddings", {"model": "m", "input": [1]})[0] == 200


def split_package(tmp_path):
    """affine.loom as two parts: config.loom (specs, params, policy) and advance.loombc (kernels, commands)."""
    import subprocess
    import sys
    text = open(SOURCE).read()
    head = "module affine kind embedding\n"
    body = text[text.index("spec VOCAB"):]
    config = head + body[:body.index("# out[t, :]")] + body[body.index("policy"):]
    advance = head + body[body.index("# out[t, :]"):body.index("policy")]
    (tmp_path / "config.loom").write_text(config)
    (tmp_path / "advance.loom").write_text(advance)
    out = subprocess.run([sys.executable, "-m", "loom.language", "compile", "--partial", str(tmp_path / "advance.loom"),
                          "-o", str(tmp_path / "advance.loombc")], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    checked = subprocess.run([sys.executable, "-m", "loom.language", "check", str(tmp_path / "config.loom"),
                              str(tmp_path / "advance.loombc")], cwd=ROOT, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def curl_form(server, path, *fields):
    import subprocess
    out = subprocess.run(["curl", "-sS", "-H", "Expect:", f"{server.url}{path}", *sum((["-F", f] for f in fields), [])],
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)


def test_register_and_stage_uploaded_packages_with_curl(server, tmp_path):
    split_package(tmp_path)
    (tmp_path / "register.json").write_text(json.dumps({
        "model": "m", "kind": "embedding", "sources": ["config.loom", "advance.loombc"],
        "checkpoint": "m.gguf", "base_directory": str(tmp_path), "variant_capacity": 4}))
    body = curl_form(server, "/v1/models/register",
                     f"request=@{tmp_path}/register.json;type=application/json;filename=model/register.json",
                     f"file=@{tmp_path}/config.loom;filename=model/config.loom",
                     f"file=@{tmp_path}/advance.loombc;filename=model/advance.loombc")
    assert body["object"] == "registration", body
    wait_phase(server, "m", "ready")
    status, emb = call(server, "/v1/embeddings", {"model": "m", "input": [[4, 5]]})
    np.testing.assert_allclose(emb["data"][0]["embedding"], reference(*server.expected, [[4, 5]])[0],
                               atol=2e-5, rtol=1e-4)
    # Stage a variant exactly as PROFILES.md shows: the request part names the package's files.
    base = json.loads(server.request("GET", "/v1/models/variants", headers={"X-Loom-Model": "m"})[2])["selected"]
    doubled = (tmp_path / "advance.loom").read_text().replace("1.0f / fmax", "2.0f / fmax")
    (tmp_path / "advance2.loom").write_text(doubled)
    import subprocess
    import sys
    subprocess.run([sys.executable, "-m", "loom.language", "compile", "--partial", str(tmp_path / "advance2.loom"),
                    "-o", str(tmp_path / "advance2.loombc")], cwd=ROOT, check=True)
    (tmp_path / "candidate.json").write_text(json.dumps({"model": "m", "base": base,
                                                         "sources": ["config.loom", "advance.loombc"]}))
    staged = curl_form(server, "/v1/models/variants",
                       f"request=@{tmp_path}/candidate.json;type=application/json;filename=model/candidate.json",
                       f"file=@{tmp_path}/config.loom;filename=model/config.loom",
                       f"file=@{tmp_path}/advance2.loombc;filename=model/advance.loombc")
    assert staged["variant"]["phase"] == "ready", staged
    call(server, "/v1/models/variants/select", {"model": "m", "variant": staged["variant"]["id"], "expected": base})
    status, emb = call(server, "/v1/embeddings", {"model": "m", "input": [[4, 5]]})
    np.testing.assert_allclose(emb["data"][0]["embedding"], 2 * reference(*server.expected, [[4, 5]])[0],
                               atol=4e-5, rtol=1e-4)


@pytest.mark.parametrize("fields,status,code", [
    (["file=@{d}/config.loom;filename=model/config.loom"], 400, "missing_field"),
    (["request=@{d}/r.json;filename=model/r.json", "file=@{d}/config.loom;filename=../config.loom"],
     400, "invalid_filename"),
    (["request=@{d}/r.json;filename=model/r.json", "file=@{d}/config.loom;filename=model/config.loom",
      "file=@{d}/config.loom;filename=model/config.loom"], 400, "duplicate_file"),
    (["request=@{d}/r.json;filename=model/r.json", "file=@{d}/config.loom;filename=model/config.loom"],
     422, "missing_member"),
    (["request=@{d}/r.json;filename=model/r.json", "other=@{d}/config.loom"], 400, "unknown_field"),
])
def test_package_rejections(server, tmp_path, fields, status, code):
    split_package(tmp_path)
    (tmp_path / "r.json").write_text(json.dumps({
        "model": "m", "kind": "embedding", "sources": ["config.loom", "advance.loombc"],
        "checkpoint": "m.gguf", "base_directory": str(tmp_path)}))
    (tmp_path / "advance.loombc").rename(tmp_path / "elsewhere.loombc")  # never fall back to a server file
    import subprocess
    args = ["curl", "-sS", "-o", "/dev/stderr", "-w", "%{http_code}", "-H", "Expect:", f"{server.url}/v1/models/register"]
    for f in fields:
        args += ["-F", f.format(d=tmp_path)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert int(out.stdout) == status and json.loads(out.stderr)["error"]["code"] == code
    assert status_of(server, "m") is None


def test_a_package_whose_kernels_do_not_build_fails_at_registration(server, tmp_path):
    broken = open(SOURCE).read().replace("float sum = 0.0f;\n    for (int t = begin", "float sum = 0.0f\n    for (int t = begin")
    (tmp_path / "broken.loom").write_text(broken)
    call(server, "/v1/models/register", dict(server.doc, sources=[str(tmp_path / "broken.loom")]))
    reg = wait_phase(server, "m", "failed")
    # The build log quotes a server file: /v1/status says what failed, the operator's stderr says where.
    assert reg["error"]["code"] == "compile" and "does not build" in reg["error"]["message"]
    assert "mean_pool" not in reg["error"]["message"]
    deadline = time.monotonic() + 10
    while not any("mean_pool" in line for line in server.stderr_lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("mean_pool" in line for line in server.stderr_lines)
    assert "m" not in memory(server)["by_owner"]                  # its weights were released
    assert call(server, "/v1/embeddings", {"model": "m", "input": [1]})[0] == 422


def _log_after_ready(server, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = list(server.stderr_lines)
        if any(" ready: " in line for line in lines):
            return lines
        time.sleep(0.05)
    raise AssertionError("no ready line:\n" + "".join(server.stderr_lines))


def test_start_up_says_ready_after_the_catalog_with_one_line_per_model(live_server, tmp_path):
    write_gguf(tmp_path / "m.gguf", "Q8_0", seed=3)
    good = {"model": "good", "kind": "embedding", "sources": [SOURCE], "checkpoint": "m.gguf"}
    bad = dict(good, model="bad", checkpoint="absent.gguf")
    (tmp_path / "catalog.json").write_text(json.dumps([good, bad]))
    lines = _log_after_ready(live_server("--models", str(tmp_path / "catalog.json")))
    ready = next(i for i, line in enumerate(lines) if " ready: " in line)
    assert "ready: 1 of 2 catalog models ready, 1 failed" in lines[ready]
    summary = [line for line in lines[:ready] if " model good: " in line or " model bad: " in line]
    assert len(summary) == 2
    assert any("INFO" in line and "model good: ready" in line for line in summary)
    assert any("ERROR" in line and "model bad: failed (checkpoint): " in line and "absent.gguf" in line
               for line in summary)
    assert next(i for i, line in enumerate(lines) if "prepared good" in line) < ready
    assert not any("every model of the start-up catalog failed" in line for line in lines)


def test_a_catalog_whose_every_model_failed_says_so(live_server, tmp_path):
    doc = {"model": "bad", "kind": "embedding", "sources": [SOURCE], "checkpoint": "absent.gguf"}
    (tmp_path / "catalog.json").write_text(json.dumps([doc]))
    server = live_server("--models", str(tmp_path / "catalog.json"))
    lines = _log_after_ready(server)
    assert any("ERROR" in line and "every model of the start-up catalog failed to prepare (1 of 1)" in line
               and "/v1/status" in line for line in lines)
    reg = status_of(server, "bad")
    assert reg["phase"] == "failed" and reg["error"]["code"] == "checkpoint" and "absent.gguf" in reg["error"]["message"]


# -- prepare and control modules, asset directories, native-only models -------------------

def split_roles(folder):
    """affine.loom as a document's three parts: prepare (specs, params), control (policy)
    and the native providers (kernels, commands), written as .loom text."""
    from loom import language
    whole = language.load(SOURCE)
    parts = {"prepare.loom": language.Module("affine", "embedding", specs=whole.specs, params=whole.params),
             "control.loom": language.Module("affine", None, policy=whole.policy),
             "program.loom": language.Module("affine", None, kernels=whole.kernels, commands=whole.commands)}
    for name, module in parts.items():
        (folder / name).write_text(language.format_module(module))
    return list(parts)


def embeddings(server, model, inputs):
    status, body = call(server, "/v1/embeddings", {"model": model, "input": inputs})
    assert status == 200, body
    return np.array([d["embedding"] for d in body["data"]])


def test_prepare_and_control_modules_are_kept_by_every_variant(server, tmp_path):
    split_roles(tmp_path)
    doc = dict(server.doc, prepare="prepare.loom", control="control.loom", sources=["program.loom"],
               variant_capacity=4)
    assert call(server, "/v1/models/register", doc)[0] == 202
    wait_phase(server, "m", "ready")
    want = reference(*server.expected, [[4, 5]])
    np.testing.assert_allclose(embeddings(server, "m", [[4, 5]]), want, atol=2e-5, rtol=1e-4)
    base = json.loads(server.request("GET", "/v1/models/variants", headers={"X-Loom-Model": "m"})[2])["selected"]
    # A variant supplies only the native providers: the prepare and control modules stay the registration's.
    (tmp_path / "doubled.loom").write_text((tmp_path / "program.loom").read_text().replace(
        "1.0f / fmax", "2.0f / fmax"))
    status, staged = call(server, "/v1/models/variants", {"model": "m", "base": base, "base_directory": str(tmp_path),
                                                          "sources": ["doubled.loom"]})
    assert status == 200 and staged["variant"]["phase"] == "ready", staged
    assert call(server, "/v1/models/variants/select", {"model": "m", "variant": staged["variant"]["id"],
                                                        "expected": base}) == (200, {"selected": staged["variant"]["id"]})
    np.testing.assert_allclose(embeddings(server, "m", [[4, 5]]), 2 * want, atol=4e-5, rtol=1e-4)
    # Sources that declare what the prepare module owns reject, and so does a prepare field in staging.
    status, failed = call(server, "/v1/models/variants", {"model": "m", "base": base, "base_directory": str(tmp_path),
                                                          "sources": [SOURCE]})
    assert status == 422 and failed["variant"]["error"]["code"] == "source"
    assert "which the prepare module" in failed["variant"]["error"]["message"]
    status, body = call(server, "/v1/models/variants", {"model": "m", "base": base, "base_directory": str(tmp_path),
                                                        "sources": ["doubled.loom"], "prepare": "prepare.loom"})
    assert status == 400 and body["error"]["code"] == "unknown_field" and body["error"]["param"] == "prepare"


@pytest.mark.parametrize("prepare,control,sources,needle", [
    ("program.loom", None, ["prepare.loom"], "a prepare module declares only"),   # roles swapped
    (None, "prepare.loom", ["program.loom"], "a control module declares only"),
    ("prepare.loom", None, [SOURCE], "which the prepare module"),                  # sources duplicate its params
    (None, "control.loom", [SOURCE], "which the control module"),
])
def test_a_module_outside_its_role_fails_the_registration(server, tmp_path, prepare, control, sources, needle):
    split_roles(tmp_path)
    doc = dict(server.doc, sources=sources, **{k: v for k, v in (("prepare", prepare), ("control", control)) if v})
    assert call(server, "/v1/models/register", doc)[0] == 202
    reg = wait_phase(server, "m", "failed")
    assert reg["error"]["code"] == "source" and needle in reg["error"]["message"], reg["error"]
    assert "m" not in memory(server)["by_owner"]


TOKENS = ["[UNK]", "[CLS]", "[SEP]", "hello", "world", "loom", "package", "server"]


def wordpiece(vocab):
    return json.dumps({"version": "1.0", "added_tokens": [], "normalizer": None,
                       "pre_tokenizer": {"type": "Whitespace"},
                       "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                                 "max_input_chars_per_word": 100, "vocab": {t: i for i, t in enumerate(vocab)}}})


def tokenize(server, model, text):
    status, body = call(server, "/tokenize", {"model": model, "content": text})
    assert status == 200, body
    return body["tokens"]


def test_an_upload_reads_its_own_metadata_while_checkpoint_bytes_stay_on_the_server(server, tmp_path):
    """PROFILES' checkpoint:"." example: tokenizer metadata from the package, weights
    from base_directory; a server tokenizer.json beside them is not consulted."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (tmp_path / "m.gguf").rename(checkpoints / "m.gguf")
    (checkpoints / "tokenizer.json").write_text(wordpiece(list(reversed(TOKENS))))    # the server's: other ids
    split_roles(tmp_path)
    (tmp_path / "tokenizer.json").write_text(wordpiece(TOKENS))
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(wordpiece(TOKENS[:3] + ["world", "hello"]))

    def register(name, **fields):
        (tmp_path / "r.json").write_text(json.dumps(dict(
            {"model": name, "kind": "embedding", "prepare": "prepare.loom", "control": "control.loom",
             "sources": ["program.loom"], "checkpoint": ".", "base_directory": str(checkpoints)}, **fields)))
        return curl_form(server, "/v1/models/register", f"request=@{tmp_path}/r.json;filename=pkg/r.json",
                         *(f"file=@{tmp_path}/{f};filename=pkg/{f}" for f in
                           ("prepare.loom", "control.loom", "program.loom", "tokenizer.json", "tok/tokenizer.json")))

    assert register("up")["object"] == "registration"
    assert register("assets", assets="tok")["object"] == "registration"
    wait_phase(server, "up", "ready")
    wait_phase(server, "assets", "ready")
    assert tokenize(server, "up", "hello world") == [3, 4]
    assert tokenize(server, "assets", "hello world") == [4, 3]
    np.testing.assert_allclose(embeddings(server, "up", ["hello world"]),
                               reference(*server.expected, [[3, 4]]), atol=2e-5, rtol=1e-4)
    # The same document as server files reads the server's tokenizer beside the checkpoint.
    assert call(server, "/v1/models/register", {"model": "local", "kind": "embedding", "sources": [SOURCE],
                                                "checkpoint": ".", "base_directory": str(checkpoints)})[0] == 202
    wait_phase(server, "local", "ready")
    assert tokenize(server, "local", "hello world") == [4, 3]
    # An asset directory or module the package lacks fails the request; nothing registers.
    body = register("missing", assets="nowhere")
    assert body["error"]["code"] == "missing_member" and body["error"]["param"] == "assets"
    body = register("missing", control="absent.loom")
    assert body["error"]["code"] == "missing_member" and body["error"]["param"] == "control"
    assert status_of(server, "missing") is None


def test_a_native_only_model_has_no_http_inference_but_keeps_its_utilities(server, tmp_path):
    (tmp_path / "tokenizer.json").write_text(wordpiece(TOKENS))
    assert call(server, "/v1/models/register", dict(server.doc, endpoint=False, variant_capacity=2))[0] == 202
    wait_phase(server, "m", "ready")
    model = next(m for m in json.loads(server.request("GET", "/v1/models")[2])["data"] if m["id"] == "m")
    assert "endpoint" not in model["loom"] and model["loom"]["kind"] == "embedding" and model["loom"]["tokenize"]
    status, body = call(server, "/v1/embeddings", {"model": "m", "input": [[1, 2]]})
    assert status == 404 and body["error"]["code"] == "model_not_found" and "native-only" in body["error"]["message"]
    assert tokenize(server, "m", "loom server") == [5, 7]
    assert call(server, "/detokenize", {"model": "m", "tokens": [3, 4]}) == (200, {"content": "hello world"})
    status, _, inv = server.request("GET", "/v1/models/variants", headers={"X-Loom-Model": "m"})
    assert status == 200 and json.loads(inv)["count"] == 1
    assert call(server, "/v1/models/drain", {"model": "m"}) == (200, {"model": "m", "admission": "drained"})
    assert call(server, "/v1/models/unregister", {"model": "m"})[0] == 202


# -- bounds: registrations, retained packages, preparation time (issue 15.5, 15.6) -----------

def test_a_source_that_is_a_fifo_fails_at_once_and_blocks_nothing(server, tmp_path):
    os.mkfifo(tmp_path / "pipe.loom")
    assert call(server, "/v1/models/register", dict(server.doc, sources=[str(tmp_path / "pipe.loom")]))[0] == 202
    reg = wait_phase(server, "m", "failed", timeout=10)
    assert reg["error"]["code"] == "source" and "not a regular file" in reg["error"]["message"]
    assert call(server, "/v1/models/register", dict(server.doc, model="after"))[0] == 202
    wait_phase(server, "after", "ready")
    assert call(server, "/v1/models/unregister", {"model": "m"})[0] == 202
    deadline = time.monotonic() + 10
    while status_of(server, "m") is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status_of(server, "m") is None


def test_registration_count_and_retained_package_bytes_are_bounded(thread_server, tmp_path):
    write_gguf(tmp_path / "m.gguf", "F32", seed=3)
    ts = thread_server(device="cpu", registrations=2, package_bytes=len(open(SOURCE, "rb").read()) * 3 // 2)
    doc = {"kind": "embedding", "sources": [SOURCE], "checkpoint": "m.gguf", "base_directory": str(tmp_path)}
    assert call(ts, "/v1/models/register", dict(doc, model="a"))[0] == 202
    (tmp_path / "r.json").write_text(json.dumps(dict(doc, model="b", sources=["affine.loom"])))
    upload = [f"request=@{tmp_path}/r.json;filename=r.json", f"file=@{SOURCE};filename=affine.loom"]
    assert curl_form(ts, "/v1/models/register", *upload)["object"] == "registration"
    status, body = call(ts, "/v1/models/register", dict(doc, model="c"))
    assert status == 429 and body["error"]["code"] == "registration_limit", body
    assert call(ts, "/v1/models/unregister", {"model": "a"})[0] == 202
    deadline = time.monotonic() + 10
    while status_of(ts, "a") is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    # Room for a registration again, but not for a second retained package.
    (tmp_path / "r.json").write_text(json.dumps(dict(doc, model="c", sources=["affine.loom"])))
    body = curl_form(ts, "/v1/models/register", *upload)
    assert body["error"]["code"] == "package_limit", body
    assert status_of(ts, "c") is None
    assert call(ts, "/v1/models/register", dict(doc, model="c"))[0] == 202


def test_a_preparation_past_its_timeout_fails_and_the_next_one_runs(thread_server, tmp_path, monkeypatch):
    from loom import runtime
    write_gguf(tmp_path / "m.gguf", "F32", seed=3)
    real, released = runtime.prepare, threading.Event()

    def slow(name, *args, **kwargs):
        prepared = real(name, *args, **kwargs)
        if name == "slow":
            time.sleep(6)               # a worker stuck in reading a file, say
            original = prepared.release
            prepared.release = lambda: (original(), released.set())
        return prepared

    monkeypatch.setattr(runtime, "prepare", slow)
    ts = thread_server(device="cpu", prepare_timeout=3)   # room for the next one's trial run on a busy host
    doc = {"kind": "embedding", "sources": [SOURCE], "checkpoint": "m.gguf", "base_directory": str(tmp_path)}
    assert call(ts, "/v1/models/register", dict(doc, model="slow"))[0] == 202
    assert call(ts, "/v1/models/register", dict(doc, model="next"))[0] == 202
    reg = wait_phase(ts, "slow", "failed", timeout=10)
    assert reg["error"]["code"] == "prepare_timeout"
    wait_phase(ts, "next", "ready", timeout=20)       # its preparation did not wait for the stuck one
    status, body = call(ts, "/v1/embeddings", {"model": "slow", "input": [[1]]})
    assert status == 422 and body["error"]["code"] == "model_failed"
    assert released.wait(15)                            # the late result was let go
    assert ts.call(lambda: ts.server.registry.device.pool.usage()["by_owner"].get("slow")) is None


def test_kernel_includes_resolve_inside_the_package(server, tmp_path):
    """Issue 15.7: an inline kernel's #include "name" reads the package's own file (an
    upload's member, or a file under base_directory), never any other server file."""
    scaled = open(SOURCE).read().replace(
        "__kernel void l2_normalize", '#include "scale.h"\n__kernel void l2_normalize').replace(
        "float scale = 1.0f / fmax", "float scale = SCALE / fmax")
    (tmp_path / "scaled.loom").write_text(scaled)
    (tmp_path / "scale.h").write_text("#define SCALE 2.0f\n")
    want = reference(*server.expected, [[4, 5]])
    # Server files: the include resolves under base_directory.
    assert call(server, "/v1/models/register", dict(server.doc, model="local", sources=["scaled.loom"]))[0] == 202
    wait_phase(server, "local", "ready")
    np.testing.assert_allclose(embeddings(server, "local", [[4, 5]]), 2 * want, atol=4e-5, rtol=1e-4)
    # An upload: the include is the package's member, not the server file of the same name.
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "scale.h").write_text("#define SCALE 3.0f\n")
    (tmp_path / "r.json").write_text(json.dumps(dict(server.doc, model="up", sources=["scaled.loom"])))
    body = curl_form(server, "/v1/models/register", f"request=@{tmp_path}/r.json;filename=pkg/r.json",
                     f"file=@{tmp_path}/scaled.loom;filename=pkg/scaled.loom",
                     f"file=@{tmp_path}/up/scale.h;filename=pkg/scale.h")
    assert body["object"] == "registration", body
    wait_phase(server, "up", "ready")
    np.testing.assert_allclose(embeddings(server, "up", [[4, 5]]), 3 * want, atol=6e-5, rtol=1e-4)
    # A name in neither the package nor the library fails the registration.
    (tmp_path / "r.json").write_text(json.dumps(dict(server.doc, model="missing", sources=["scaled.loom"])))
    body = curl_form(server, "/v1/models/register", f"request=@{tmp_path}/r.json;filename=pkg/r.json",
                     f"file=@{tmp_path}/scaled.loom;filename=pkg/scaled.loom")
    reg = wait_phase(server, "missing", "failed")
    assert reg["error"]["code"] == "source" and "neither in the package nor the kernel library" in \
        reg["error"]["message"]
