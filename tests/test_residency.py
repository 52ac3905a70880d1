"""Residency is invisible to results (issue 51): after any sequence of drain/undrain,
deactivate/activate (every declared component, scout's `image` too), pin/unpin,
/v1/devices/trim and native variant selection, a deployment that ends undrained and
active answers exactly what it answered before the first operation: the same bytes
(images, speech, embeddings, sequence outputs), the same tokens (chat, transcripts) or the
same probabilities (decisions).

One `python -m loom` with an empty catalog; each kind's deployments are registered when its
test first asks (a single test prepares only its own). Each kind gets a hypothesis stateful
test over the administration operations, ending with requests compared with the answers
taken before the first operation; requests also run between the operations whenever the
deployment is undrained. The default settings keep each kind to seconds; the `full` marker
runs longer programs (make test-full)."""

import base64
import http.client
import io
import json
import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from conftest import ROOT, _start_live, tiny_scout_dir
from loom import demo

JSON = {"Content-Type": "application/json"}
UNDECLARED = "audio"        # a component no deployment here declares: 404 on every residency control


# -- the server and its deployments -------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The deployments' files are model roots: the catalog's folders (installed weight packages)
    # and Loom's cache (the generated checkpoints), as for the default catalog.
    from loom import cache_folder
    from loom.registry import catalog_folders
    roots = sorted(set(catalog_folders(list(documents().values()), None)) | {cache_folder("")})
    srv = _start_live(tmp_path_factory.mktemp("residency"), tuple(a for r in roots for a in ("--model_root", r)))
    srv.deployed = {}
    yield srv
    srv.stop()


def call(server, path, body, timeout=300):
    """POST JSON -> (status, headers, raw body); a generous timeout: first requests compile."""
    conn = server.connection(timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body).encode(), JSON)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def ok(server, path, body, status=200, binary=False):
    """The answer of a request that must succeed: its JSON, or with `binary` its bytes."""
    code, _, raw = call(server, path, body)
    assert code == status, (path, body, code, raw[:500])
    return raw if binary else json.loads(raw)


def registration(server, name):
    regs = json.loads(server.request("GET", "/v1/status")[2])["registrations"]
    return next(r for r in regs if r["model"] == name)


def selected_variant(server, name):
    models = json.loads(server.request("GET", "/v1/models")[2])["data"]
    return next(m for m in models if m["id"] == name)["loom"]["variants"]["selected"]


def tower():
    """The tests' vision tower for the tiny text model's 128 channels (models/smolvlm/generate.py)."""
    import importlib.util
    folder = os.path.join(os.path.expanduser("~"), ".cache", "loom", "tests", "smolvlm-128-v1")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        spec = importlib.util.spec_from_file_location("smolvlm_generate",
                                                      os.path.join(ROOT, "models", "smolvlm", "generate.py"))
        generate = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(generate)
        tmp = f"{folder}.tmp{os.getpid()}"
        generate.generate(tmp, text_hidden=128)
        try:
            os.rename(tmp, folder)
        except OSError:         # a concurrent first use won
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    return os.path.join(folder, "model.safetensors")


def documents():
    """The default catalog's documents, scout and encoder on the tiny text checkpoint (scout with
    an image component on the tiny tower), keyed by deployment name."""
    docs = {d["model"]: d for d in demo.catalog(text=tiny_scout_dir(), image=False)}
    if "illustrator" in docs:     # four denoising steps: the adapters and weights matter here, not quality
        docs["illustrator"] = dict(docs["illustrator"], options=dict(docs["illustrator"]["options"], steps=4))
    if "scout" in docs:
        docs["scout"] = dict(docs["scout"], rows=2, context_length=512,
                             components={"image": {"sources": ["../smolvlm/vision.loom"], "checkpoint": tower()}})
    return docs


def deploy(server, name):
    """Register `name` (once per server), wait until it is ready, and stage a second native
    variant of the same sources so that selection has somewhere to go."""
    if name in server.deployed:
        return server.deployed[name]
    doc = documents().get(name)
    if doc is None:
        pytest.skip(f"the default {name!r} deployment's weights are not installed")
    ok(server, "/v1/models/register", doc, 202)
    deadline = time.monotonic() + 900
    while (reg := registration(server, name))["phase"] not in ("ready", "failed"):
        assert time.monotonic() < deadline, "".join(server.stderr_lines[-20:])
        time.sleep(0.2)
    assert reg["phase"] == "ready", reg["error"]
    base = selected_variant(server, name)
    staged = ok(server, "/v1/models/variants", {"model": name, "base": base, "base_directory": doc["base_directory"],
                                                "sources": doc["sources"], "wait": True})
    assert staged["variant"]["phase"] == "ready", staged
    server.deployed[name] = [base, staged["variant"]["id"]]
    return server.deployed[name]


# -- each kind's requests, reduced to what must not change --------------------------------

def png_url(seed, size=(40, 56)):
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(server, i):
    """Tokens of a greedy answer about an image (the image component projects it)."""
    content = [{"type": "text", "text": ["What is this?", "Describe it.", "Colours?"][i]},
               {"type": "image_url", "image_url": {"url": png_url(i)}}]
    body = ok(server, "/v1/chat/completions", {"model": "scout", "max_tokens": 6, "temperature": 0,
                                               "messages": [{"role": "user", "content": content}]})
    return body["choices"][0]["message"], body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]


def sequence(server, i):
    """The encoder's output bytes for known tokens (SSE chunks, in order)."""
    raw = ok(server, "/v1/sequences", {"model": "encoder", "position": 0, "token_ids": [[11, 27, 42], [5, 6], [99]][i]},
             binary=True)
    events = [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: ")]
    return [(e.get("token_ids"), e.get("data")) for e in events if "data" in e]


def embeddings(server, i):
    body = ok(server, "/v1/embeddings", {"model": "vectors", "input": [["a fox", "snow"], ["loom"], ["x" * 40]][i],
                                         "encoding_format": "base64"})
    return [d["embedding"] for d in body["data"]]


def decision(server, i):
    body = ok(server, "/v1/systemone", {"model": "judge", "state": ["I cannot log in.", "Refund me.", "Hi"][i],
                                        "questions": {"route": {"type": "choice", "instructions": "Pick a team.",
                                                                "criteria": {"support": "Access", "billing": "Money"}},
                                                      "urgency": {"type": "score", "instructions": "How urgent?",
                                                                  "criteria": ["Low", "High"]}}})
    body.pop("created", None)
    body.pop("id", None)
    return body


def speech(server, i):
    return ok(server, "/v1/audio/speech", {"model": "speaker", "input": ["Good day.", "A fox.", "Snow falls."][i],
                                           "voice": "alba", "response_format": "pcm", "seed": i}, binary=True)


def recording(server):
    """Speech for the recognizer: the speaker's own PCM (24 kHz) when its voice is installed,
    else a chirp (16 kHz)."""
    if documents().get("speaker") is not None:
        deploy(server, "speaker")
        return "24000", speech(server, 0)
    t = np.arange(16000) / 16000
    return "16000", (np.sin(2 * np.pi * (200 + 600 * t) * t) * 8000).astype("<i2").tobytes()


def transcript(server, i):
    rate, pcm = server.recording
    boundary = "residency-boundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nrecognizer\r\n'.encode(),
             f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.pcm"\r\n'
             f'Content-Type: audio/pcm;rate={rate};channels=1\r\n\r\n'.encode() + pcm[:len(pcm) // 6 * (i + 1) * 2]
             + b"\r\n", f"--{boundary}--\r\n".encode()]
    conn = server.connection(timeout=300)
    try:
        conn.request("POST", "/v1/audio/transcriptions", b"".join(parts),
                     {"Content-Type": f"multipart/form-data; boundary={boundary}"})
        resp = conn.getresponse()
        raw = resp.read()
        assert resp.status == 200, raw
        return json.loads(raw)["text"]
    finally:
        conn.close()


def image(server, i):
    loras = [[], [{"id": "watercolor", "scale": 0.5}], [{"id": "ink", "scale": -0.7}, {"id": "watercolor"}]][i]
    body = ok(server, "/v1/images/generations", {"model": "illustrator", "prompt": "a red fox in the snow",
                                                 "size": "64x64", "seed": 3 + i, "loras": loras})
    return base64.b64decode(body["data"][0]["b64_json"])


KINDS = {   # kind -> (deployment, its residency components, the request whose answer is compared)
    "text": ("scout", ("primary", "image"), chat),
    "sequence": ("encoder", ("primary",), sequence),
    "embedding": ("vectors", ("primary",), embeddings),
    "decision": ("judge", ("primary",), decision),
    "speech": ("speaker", ("primary",), speech),
    "recognition": ("recognizer", ("primary",), transcript),
    "image": ("illustrator", ("primary",), image),
}


# -- the state machine -----------------------------------------------------------------------

def machine(server, model, components, ask, variants, baseline):
    """A RuleBasedStateMachine over one deployment's administration, checking every answer
    against `baseline` (ask(server, i) for each i, taken before any operation)."""
    selectors = st.sampled_from(components + (UNDECLARED,))
    accounting = {name: resources(server, model, name) for name in components}

    class Residency(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.drained = False
            self.selected = selected_variant(server, model)

        @rule()
        def drain(self):
            assert ok(server, "/v1/models/drain", {"model": model}) == {"model": model, "admission": "drained"}
            self.drained = True

        @rule()
        def undrain(self):
            assert ok(server, "/v1/models/undrain", {"model": model}) == {"model": model, "admission": "open"}
            self.drained = False

        def residency(self, operation, component):
            code, _, raw = call(server, f"/v1/models/{operation}", {"model": model, "component": component})
            body = json.loads(raw)
            if component not in components:
                assert code == 404 and body["error"]["code"] == "component_not_found", body
            elif not self.drained:
                assert code == 409 and body["error"]["code"] == "not_drained", body
            else:
                assert code == 202 and body == {"model": model, "component": component, "operation": operation}

        @rule(component=selectors)
        def deactivate(self, component):
            self.residency("deactivate", component)

        @rule(component=selectors)
        def activate(self, component):
            self.residency("activate", component)

        @rule(component=selectors, pinned=st.booleans())
        def pin(self, component, pinned):
            code, _, raw = call(server, "/v1/models/pin" if pinned else "/v1/models/unpin",
                                {"model": model, "component": component})
            if component in components:
                assert (code, json.loads(raw)) == (200, {"model": model, "component": component, "pinned": pinned})
            else:
                assert code == 404 and json.loads(raw)["error"]["code"] == "component_not_found"

        @rule()
        def trim(self):
            body = ok(server, "/v1/devices/trim", {"device": 0, "target_bytes": 0})
            assert isinstance(body["freed_bytes"], int) and body["freed_bytes"] >= 0

        @rule()
        def select(self):
            other = variants[1] if self.selected == variants[0] else variants[0]
            assert ok(server, "/v1/models/variants/select",
                      {"model": model, "variant": other, "expected": self.selected}) == {"selected": other}
            self.selected = other

        @precondition(lambda self: not self.drained)
        @rule(i=st.integers(0, len(baseline) - 1))
        def request(self, i):
            assert ask(server, i) == baseline[i]

        def teardown(self):
            # Ends undrained and active: every component streamed back, then the same answers.
            if self.drained:
                for component in components:
                    self.residency("activate", component)
                self.undrain()
            for i, want in enumerate(baseline):
                assert ask(server, i) == want, i
            for name in components:
                assert resources(server, model, name) == accounting[name], name
            reg = registration(server, model)
            assert reg["requests"]["in_flight"] == 0 and reg["requests"]["waiting"] == 0

    return Residency


def resources(server, model, component):
    """A component's residency as /v1/status reports it: resident, parameter bytes (the
    accounting that must return to its baseline)."""
    res = registration(server, model)["resources"]
    part = res if component == "primary" else res["components"][component]
    return part["resident"], part["param_bytes"]


def check(server, kind, examples, steps):
    model, components, ask = KINDS[kind]
    variants = deploy(server, model)
    if kind == "recognition" and not hasattr(server, "recording"):
        server.recording = recording(server)
    baseline = [ask(server, i) for i in range(3)]
    run_state_machine_as_test(
        machine(server, model, components, ask, variants, baseline),
        settings=settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck)))


@pytest.mark.parametrize("kind", list(KINDS))
def test_residency_is_invisible_to_results(server, kind):
    check(server, kind, examples=4, steps=6)


@pytest.mark.full
@pytest.mark.parametrize("kind", list(KINDS))
def test_residency_is_invisible_to_results_over_long_programs(server, kind):
    check(server, kind, examples=20, steps=15)


# -- issue 51's report, verbatim ---------------------------------------------------------------

def test_the_reported_cycle_keeps_the_illustrators_pngs(server):
    """drain, deactivate, activate, undrain: the same PNG, with and without adapters, as often
    as the cycle runs (it used to answer 500 'changed since the module was bound' for good)."""
    deploy(server, "illustrator")

    def generate(**fields):
        body = ok(server, "/v1/images/generations", dict({"model": "illustrator", "prompt": "a fox",
                                                          "size": "128x128"}, **fields))
        data = base64.b64decode(body["data"][0]["b64_json"])
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        return data

    before = generate(), generate(loras=[{"id": "ink", "scale": 0.8}])
    for _ in range(2):
        assert ok(server, "/v1/models/drain", {"model": "illustrator"})["admission"] == "drained"
        ok(server, "/v1/models/deactivate", {"model": "illustrator", "component": "primary"}, 202)
        assert resources(server, "illustrator", "primary") == (False, 0)
        ok(server, "/v1/models/activate", {"model": "illustrator", "component": "primary"}, 202)
        assert ok(server, "/v1/models/undrain", {"model": "illustrator"})["admission"] == "open"
        assert (generate(), generate(loras=[{"id": "ink", "scale": 0.8}])) == before
