"""A kind added without touching registry.py: one module-sized Kind, one line in a kinds table.

`Tally` is a toy kind defined here: POST /v1/tally runs the affine package's
`embed` stage on the shared cohort engine (scheduler.BatchEngine) and answers
each input's largest output component and its index. It goes through the same
registration, probing, admission, /v1/models listing and unregistering as the
built-in kinds, and is checked against the numpy reference of test_runtime.
"""

import json
import threading
import time

import numpy as np

from loom import kinds, routes
from loom.errors import Error
from loom.http import Response
from loom.jsonin import Arr, Int, Obj, Str
from loom.scheduler import BatchEngine, pack
from test_runtime import DIM, PACKAGE, reference, write_gguf

TALLY_BODY = Obj({"model": Str(min_len=1), "input": Arr(Arr(Int(lo=0, hi=2**31 - 1), min_len=1), min_len=1,
                                                         max_len=16)})


def handler(kind):
    def tally(server, request):
        body = request.json(TALLY_BODY)
        reg = server.registry.admit(body["model"], kind())
        vocab = reg.prepared.spec("VOCAB")
        if any(t >= vocab for ids in body["input"] for t in ids):
            raise Error(400, f"token ids must be below {vocab}", "invalid_value", "input")
        job = TallyJob(server, reg, request, body["input"])
        server.registry.enter(reg, job)
        return job.deferred
    return tally


class TallyJob(kinds.Job):
    what = "tally"
    key = None

    def __init__(self, server, reg, request, sequences):
        super().__init__(server, reg, request)
        self.sequences = sequences
        self.tokens, self.inputs = sum(map(len, sequences)), len(sequences)

    def run(self):
        self.engine.submit(self)


class TallyBatch:
    def __init__(self, width):
        self.width = width

    def stage(self, jobs):
        ids, pos, offsets = pack([s for job in jobs for s in job.sequences])
        count = len(offsets) - 1
        return ("embed", {"T": int(ids.size), "S": count}, {"ids": ids, "pos": pos, "offsets": offsets},
                {"out": (np.float32, count * self.width)})

    def deliver(self, jobs, values, error):
        rows = None if error else values["out"].reshape(-1, self.width)
        at = 0
        for job in jobs:
            if error is not None:
                job.finish(error=error)
                continue
            mine, at = rows[at:at + job.inputs], at + job.inputs
            job.finish(Response.json({"object": "tally", "max": [float(r.max()) for r in mine],
                                      "argmax": [int(r.argmax()) for r in mine]}))


class Tally(kinds.Kind):
    name = "tally"
    endpoint = "/v1/tally"
    routes = [("POST", "/v1/tally", handler(lambda: TALLY))]
    inputs, outputs = ["tokens"], ["tally"]
    probes = [("embed", {"T": 1, "S": 1})]

    def capability(self, reg):
        return {"width": reg.prepared.spec("DIM")} if reg.prepared is not None else {}

    def start(self, reg, loop):
        return BatchEngine(reg.prepared, loop, TallyBatch(reg.prepared.spec("DIM")), max_tokens=64, max_inputs=16)


TALLY = Tally()

GATE = threading.Event()     # a gated step retires only once the test sets it


class GatedEngine(BatchEngine):
    def launch(self, jobs, done):
        def held(values, error):
            threading.Thread(target=lambda: (GATE.wait(30), self.loop.call_soon_threadsafe(done, values, error)),
                             daemon=True).start()
        super().launch(jobs, held)


class Gated(Tally):
    """Tally whose device steps stay in flight until GATE opens: the safe execution
    boundary becomes observable."""
    name = "gated"
    endpoint = "/v1/gated"
    routes = [("POST", "/v1/gated", handler(lambda: GATED))]

    def start(self, reg, loop):
        return GatedEngine(reg.prepared, loop, TallyBatch(reg.prepared.spec("DIM")), max_tokens=64, max_inputs=16)


GATED = Gated()


def call(server, path, body):
    status, _, data = server.request("POST", path, body=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return status, json.loads(data)


def wait_ready(server, name, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        regs = json.loads(server.request("GET", "/v1/status")[2])["registrations"]
        reg = next((r for r in regs if r["model"] == name), None)
        if reg is not None and reg["phase"] in ("ready", "failed"):
            return reg
        time.sleep(0.05)
    raise AssertionError(f"{name} never settled")


def test_a_toy_kind_registers_and_serves_end_to_end(thread_server, tmp_path):
    expected = write_gguf(tmp_path / "m.gguf", "F32", seed=5)
    server = thread_server(kinds=routes.KINDS + (TALLY,), device="cpu")
    memory = lambda: json.loads(server.request("GET", "/v1/status")[2])["resources"]["memory"]  # noqa: E731
    baseline = memory()
    doc = {"model": "t", "kind": "tally", "sources": [f"{PACKAGE}/affine.loom"], "checkpoint": "m.gguf",
           "base_directory": str(tmp_path)}
    status, body = call(server, "/v1/models/register", doc)
    assert status == 202, body
    reg = wait_ready(server, "t")
    assert reg["phase"] == "ready", reg
    listed = json.loads(server.request("GET", "/v1/models")[2])["data"]
    assert listed[0]["loom"]["kind"] == "tally" and listed[0]["loom"]["endpoint"] == "/v1/tally"
    assert listed[0]["output_modalities"] == ["tally"] and listed[0]["loom"]["width"] == DIM

    # Concurrent requests share cohorts on the one engine; each gets its own answer.
    inputs = [[[1, 2, 3]], [[7], [9, 9, 4, 2]], [[0, 5]]]
    answers = [None] * len(inputs)

    def ask(i):
        answers[i] = call(server, "/v1/tally", {"model": "t", "input": inputs[i]})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for sequences, (status, body) in zip(inputs, answers):
        assert status == 200, body
        ref = reference(*expected, sequences)
        np.testing.assert_allclose(body["max"], ref.max(axis=1), rtol=1e-4, atol=1e-5)
        assert body["argmax"] == [int(i) for i in ref.argmax(axis=1)]
    status = json.loads(server.request("GET", "/v1/status")[2])
    batching = next(r for r in status["registrations"] if r["model"] == "t")["batching"]
    assert batching["requests"] == len(inputs) and 1 <= batching["cohorts"] <= len(inputs)

    # Its error paths are the common ones: a bad body, an id out of range, another kind's endpoint.
    assert call(server, "/v1/tally", {"model": "t", "input": [[]]})[0] == 400
    status, body = call(server, "/v1/tally", {"model": "t", "input": [[10 ** 6]]})
    assert status == 400 and body["error"]["param"] == "input"
    status, body = call(server, "/v1/embeddings", {"model": "t", "input": [[1]]})
    assert status == 404 and body["error"]["code"] == "model_not_found"

    status, _ = call(server, "/v1/models/unregister", {"model": "t"})
    assert status == 202
    deadline = time.monotonic() + 10
    while memory()["used"] != baseline["used"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert memory()["used"] == baseline["used"] and memory()["by_owner"] == baseline["by_owner"]
    assert call(server, "/v1/tally", {"model": "t", "input": [[1]]})[0] == 404


def test_a_server_without_the_kind_does_not_know_it(thread_server, tmp_path):
    write_gguf(tmp_path / "m.gguf", "F32", seed=5)
    server = thread_server(device="cpu")
    doc = {"model": "t", "kind": "tally", "sources": [f"{PACKAGE}/affine.loom"], "checkpoint": "m.gguf",
           "base_directory": str(tmp_path)}
    status, body = call(server, "/v1/models/register", doc)
    assert status == 400 and body["error"]["param"] == "kind", body
    assert server.request("POST", "/v1/tally", body=b"{}", headers={"Content-Type": "application/json"})[0] == 404


def test_selection_waits_for_the_cohort_in_flight(thread_server, tmp_path):
    """A selection completes at the safe boundary: the step in flight finishes on the old
    variant (a consumer of it), a second selection meanwhile is 409, neither variant can be
    removed, and staged executables stay pinned in the compiler cache until they go."""
    from test_variants import DOUBLED
    expected = write_gguf(tmp_path / "m.gguf", "F32", seed=6)
    (tmp_path / "doubled.loom").write_text(DOUBLED)
    server = thread_server(kinds=routes.KINDS + (GATED,), device="cpu")
    status_of = lambda: json.loads(server.request("GET", "/v1/status")[2])  # noqa: E731
    baseline = status_of()["resources"]
    GATE.set()
    doc = {"model": "g", "kind": "gated", "sources": [f"{PACKAGE}/affine.loom"], "checkpoint": "m.gguf",
           "base_directory": str(tmp_path), "variant_capacity": 3}
    assert call(server, "/v1/models/register", doc)[0] == 202
    assert wait_ready(server, "g")["phase"] == "ready"
    pinned = status_of()["resources"]["jit"]["pinned"]
    inv = json.loads(server.request("GET", "/v1/models/variants", headers={"X-Loom-Model": "g"})[2])
    base = inv["selected"]
    status, body = call(server, "/v1/models/variants", {"model": "g", "base": base, "sources": ["doubled.loom"],
                                                        "base_directory": str(tmp_path)})
    assert status == 200 and body["variant"]["phase"] == "ready", body
    new = body["variant"]["id"]
    assert status_of()["resources"]["jit"]["pinned"] > pinned          # the candidate's builds are pinned

    GATE.clear()
    results = {}
    ask = threading.Thread(target=lambda: results.update(step=call(server, "/v1/gated",
                                                                   {"model": "g", "input": [[1, 2]]})))
    ask.start()
    deadline = time.monotonic() + 10
    while next(r for r in status_of()["registrations"] if r["model"] == "g")["batching"]["cohorts"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    select = threading.Thread(target=lambda: results.update(select=call(
        server, "/v1/models/variants/select", {"model": "g", "variant": new, "expected": base})))
    select.start()
    while not any(r["route"] == "/v1/models/variants/select"
                  for r in json.loads(server.request("GET", "/v1/requests")[2])["data"]):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    status, body = call(server, "/v1/models/variants/select", {"model": "g", "variant": new, "expected": base})
    assert status == 409 and body["error"]["code"] == "selection_pending", body
    for vid in (base, new):
        status, body = call(server, "/v1/models/variants/remove", {"model": "g", "variant": vid})
        assert status == 409 and body["error"]["code"] == "variant_busy", body
    inv = json.loads(server.request("GET", "/v1/models/variants", headers={"X-Loom-Model": "g"})[2])
    assert inv["selected"] == base and {v["id"]: v["users"] for v in inv["data"]} == {base: 2, new: 0}
    GATE.set()
    ask.join(30)
    select.join(30)
    assert results["select"] == (200, {"selected": new})
    ref = reference(*expected, [[1, 2]])
    np.testing.assert_allclose(results["step"][1]["max"], ref.max(axis=1), rtol=1e-4)    # ran on the old variant
    status, body = call(server, "/v1/gated", {"model": "g", "input": [[1, 2]]})
    np.testing.assert_allclose(body["max"], 2 * ref.max(axis=1), rtol=1e-4)              # the new one runs now
    assert call(server, "/v1/models/variants/remove", {"model": "g", "variant": base}) == (200, {"removed": base})

    assert call(server, "/v1/models/unregister", {"model": "g"})[0] == 202
    deadline = time.monotonic() + 10
    while any(r["model"] == "g" for r in status_of()["registrations"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = status_of()["resources"]
    assert after["jit"]["pinned"] == baseline["jit"]["pinned"]                           # pins went with the model
    assert after["memory"]["used"] == baseline["memory"]["used"]
