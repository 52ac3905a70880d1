"""The curl examples in the docs run against a real server, as a user would paste them."""

import json
import os
import re
import subprocess

import pytest

from conftest import ROOT, _start_live


def catalog_view(server):
    """What a walkthrough must leave as it found it: the deployments and their selected variants."""
    models = json.loads(server.request("GET", "/v1/models")[2])["data"]
    return sorted((m["id"], m["loom"]["kind"], json.dumps(m["loom"].get("variants"))) for m in models)


WALKTHROUGHS = [
    ("README.md", "With the server running", "Any OpenAI client"),   # the quick start against `make run`
    ("docs/operations.md", "## Registration lifecycle", None),       # everything from here on, in order
]


# The walkthroughs share one fresh default catalog, started once (it loads every real model and
# its kernels: a minute or more on two busy cores, more than the suite's 120 s a test): each must
# leave the catalog as it found it, so the next one meets what a fresh `make run` serves.
@pytest.mark.timeout(900)
def test_doc_examples_run_in_order_and_leave_the_catalog_as_found(tmp_path):
    """Every runnable curl block of each walkthrough, in document order, against a fresh
    default-catalog server (a fresh `make run`): none answers an error, and the catalog is
    as it was afterwards."""
    # the walkthroughs write their files under /tmp (here tmp_path), which they make a model root
    server = _start_live(tmp_path, ("--model_root", str(tmp_path)), catalog="default")
    try:
        before = catalog_view(server)
        for path, start, end in WALKTHROUGHS:
            text = open(os.path.join(ROOT, path)).read()
            section = text[text.index(start):text.index(end) if end else None]
            runnable = [b for b in re.findall(r"```sh\n(.*?)```", section, re.S)
                        if "curl -N" not in b and "make run" not in b]                  # streams never end
            script = "\n".join(runnable).replace("127.0.0.1:8080", f"127.0.0.1:{server.port}")
            script = script.replace("/tmp/", f"{tmp_path}/")
            out = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=ROOT, capture_output=True,
                                 text=True, timeout=300,
                                 env=dict(os.environ, PATH=os.path.join(ROOT, ".venv", "bin") + ":" + os.environ["PATH"]))
            assert out.returncode == 0, f"{path}: {out.stderr}"
            assert '"error":{' not in out.stdout, f"{path}: {out.stdout}"
            assert catalog_view(server) == before, path
    finally:
        server.stop()


def test_language_doc_first_module_runs(tmp_path):
    """The first example of docs/language.md is a working package."""
    import numpy as np

    from loom import runtime
    from loom.compiler import Compiler
    from loom.device import Device
    from loom.weights import write_safetensors
    text = open(os.path.join(ROOT, "docs", "language.md")).read()
    source = re.search(r"```loom\n(# embed\.loom.*?)```", text, re.S).group(1)
    (tmp_path / "embed.loom").write_text(source)
    rng = np.random.default_rng(0)
    table, proj, bias = (rng.standard_normal((40, 32)).astype(np.float32),
                         rng.standard_normal((8, 32)).astype(np.float32), rng.standard_normal(8).astype(np.float32))
    write_safetensors(tmp_path / "w.safetensors", {"embed.weight": table, "proj.weight": proj, "proj.bias": bias})
    device = Device("cpu")

    def submit(fn, done):
        done(fn(), None)

    prepared = runtime.prepare("doc", [str(tmp_path / "embed.loom")], str(tmp_path / "w.safetensors"), {},
                               device, Compiler(device, submit))
    inputs = [[1, 2, 3], [39]]
    host = {"ids": np.array([1, 2, 3, 39], np.int32), "pos": np.array([0, 1, 2, 0], np.int32),
            "offsets": np.array([0, 3, 4], np.int32)}
    bufs = {k: device.pool.alloc(a.nbytes, "t", "workspace", host=a) for k, a in host.items()}
    bufs["out"] = device.pool.alloc(2 * 8 * 4, "t", "workspace")
    box = {}
    prepared.plan_async("embed", {"T": 4, "S": 2}, lambda plan, error: box.update(plan=plan, error=error))
    box["plan"].run(bufs).wait()
    got = device.download(bufs["out"], np.float32, 16).reshape(2, 8)
    want = np.array([table[i].mean(0) @ proj.T + bias for i in inputs])
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, atol=1e-5)
    prepared.release()
