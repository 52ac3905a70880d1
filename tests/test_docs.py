"""The curl examples in the docs run against a real server, as a user would paste them."""

import os
import re
import subprocess

import pytest

from conftest import ROOT


def blocks(path, start, end):
    text = open(os.path.join(ROOT, path)).read()
    section = text[text.index(start):text.index(end)]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


@pytest.mark.parametrize("path,start,end", [
    ("docs/operations.md", "## Registration lifecycle", "## Device and memory"),
    ("docs/operations.md", "## Observability", "### Logs"),
    ("README.md", "With the server running", "Any OpenAI client"),
])
def test_doc_examples_run(live_server, path, start, end, tmp_path):
    server = live_server()
    script = "\n".join(b for b in blocks(path, start, end) if "curl -N" not in b)  # streams never end
    script = script.replace("127.0.0.1:8080", f"127.0.0.1:{server.port}").replace("/tmp/", f"{tmp_path}/")
    out = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PATH=os.path.join(ROOT, ".venv", "bin") + ":" + os.environ["PATH"]))
    assert out.returncode == 0, out.stderr
    assert '"error":{' not in out.stdout, out.stdout
