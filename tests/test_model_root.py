"""Model roots (--model_root, issue 51): a server-side path a client names for a model
(registration, staging, a kernel's #include) that resolves, symlinks followed, outside every
root is refused with 403 outside_model_root before any byte is read; files a reader finds on
its own (a tokenizer beside the checkpoint, an include) are refused at the open. By default
the roots are Loom's cache folder, its shipped packages and the start-up catalog's own
folders: a file elsewhere (here: a temporary folder of its own) is out of reach."""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, _start_live
from test_runtime import PACKAGE, write_gguf

AFFINE = os.path.join(PACKAGE, "affine.loom")
SECRET = b"TOPSECRET-ROOT the password is hunter2\n"


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """inside/: a model root holding an affine checkpoint, the package and symlinks that lead out;
    outside/: a folder no root covers, with a checkpoint, a package and a secret."""
    inside, outside = tmp_path_factory.mktemp("inside"), tmp_path_factory.mktemp("outside")
    for folder in (inside, outside):
        write_gguf(folder / "m.gguf", "F32", seed=2)
        (folder / "affine.loom").write_text(open(AFFINE).read())
    (outside / "secret.h").write_bytes(SECRET)
    (inside / "escape.gguf").symlink_to(outside / "m.gguf")
    (inside / "escape.loom").symlink_to(outside / "affine.loom")
    (inside / "elsewhere").symlink_to(outside, target_is_directory=True)
    # a package whose kernel includes a file that is a symlink out of the root
    source = open(AFFINE).read().replace("__kernel void mean_pool(", '#include "leak.h"\n__kernel void mean_pool(', 1)
    (inside / "includes.loom").write_text(source)
    (inside / "leak.h").symlink_to(outside / "secret.h")
    # a checkpoint folder whose tokenizer metadata leads out of the root
    (inside / "folder").mkdir()
    write_gguf(inside / "folder" / "m.gguf", "F32", seed=2)
    (inside / "folder" / "tokenizer.json").symlink_to(outside / "secret.h")
    return inside, outside


@pytest.fixture(scope="module")
def server(tmp_path_factory, tree):
    inside, _ = tree
    srv = _start_live(tmp_path_factory.mktemp("root-server"), ("--model_root", str(inside)))
    yield srv
    srv.stop()


def post(server, path, body):
    status, _, raw = server.request("POST", path, body=json.dumps(body).encode(),
                                    headers={"Content-Type": "application/json"})
    return status, json.loads(raw)


def registration(server, name):
    regs = json.loads(server.request("GET", "/v1/status")[2])["registrations"]
    return next((r for r in regs if r["model"] == name), None)


def settled(server, name, timeout=60):
    deadline = time.monotonic() + timeout
    while (reg := registration(server, name))["phase"] not in ("ready", "failed"):
        assert time.monotonic() < deadline, reg
        time.sleep(0.05)
    return reg


def affine(name, inside, **fields):
    return dict({"model": name, "kind": "embedding", "sources": [str(inside / "affine.loom")],
                 "checkpoint": str(inside / "m.gguf")}, **fields)


def refused(status, body, param):
    assert status == 403, body
    error = body["error"]
    assert error["code"] == "outside_model_root" and error["param"] == param and error["type"] == "permission_error"
    assert "--model_root" in error["message"]


CASES = {   # field -> the document change that names a server path outside the root
    "checkpoint": lambda i, o: {"checkpoint": str(o / "m.gguf")},
    "checkpoint-symlink": lambda i, o: {"checkpoint": str(i / "escape.gguf")},
    "checkpoint-dotdot": lambda i, o: {"checkpoint": f"../{o.name}/m.gguf", "base_directory": str(i)},
    "sources": lambda i, o: {"sources": [str(o / "affine.loom")]},
    "sources-symlink": lambda i, o: {"sources": [str(i / "escape.loom")]},
    "sources-through-a-folder-link": lambda i, o: {"sources": [str(i / "elsewhere" / "affine.loom")]},
    "prepare": lambda i, o: {"prepare": str(o / "affine.loom")},
    "control": lambda i, o: {"control": str(o / "affine.loom")},
    "assets": lambda i, o: {"assets": str(o)},
    "base_directory": lambda i, o: {"base_directory": str(o), "sources": ["affine.loom"], "checkpoint": str(i / "m.gguf")},
}
PARAMS = {"checkpoint-symlink": "checkpoint", "checkpoint-dotdot": "checkpoint", "sources-symlink": "sources",
          "sources-through-a-folder-link": "sources"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_registration_outside_the_roots_is_refused_before_anything_is_read(server, tree, case):
    inside, outside = tree
    status, body = post(server, "/v1/models/register", affine("out", inside, **CASES[case](inside, outside)))
    refused(status, body, PARAMS.get(case, case))
    assert registration(server, "out") is None           # nothing registered, nothing prepared


def test_components_and_adapters_are_confined_too(server, tree):
    inside, outside = tree
    doc = {"model": "out", "kind": "text", "sources": [str(inside / "affine.loom")], "checkpoint": str(inside / "m.gguf"),
           "components": {"image": {"sources": [str(outside / "affine.loom")], "checkpoint": str(inside / "m.gguf")}}}
    refused(*post(server, "/v1/models/register", doc), "components.image.sources")
    doc["components"]["image"] = {"sources": [str(inside / "affine.loom")], "checkpoint": str(outside / "m.gguf")}
    refused(*post(server, "/v1/models/register", doc), "components.image.checkpoint")
    image = {"model": "out", "kind": "image", "sources": [str(inside / "affine.loom")], "checkpoint": str(inside / "m.gguf"),
             "options": {"loras": {"watercolor": str(outside / "m.gguf")}}}
    refused(*post(server, "/v1/models/register", image), "options.loras.watercolor")
    assert registration(server, "out") is None


def test_inside_the_root_registers_and_serves(server, tree):
    inside, _ = tree
    assert post(server, "/v1/models/register", affine("in", inside, variant_capacity=2))[0] == 202
    assert settled(server, "in")["phase"] == "ready"
    status, body = post(server, "/v1/embeddings", {"model": "in", "input": [[1, 2]]})
    assert status == 200 and len(body["data"]) == 1


def test_staging_outside_the_roots_is_refused(server, tree):
    inside, outside = tree
    if registration(server, "in") is None:
        test_inside_the_root_registers_and_serves(server, tree)
    models = json.loads(server.request("GET", "/v1/models")[2])["data"]
    base = next(m for m in models if m["id"] == "in")["loom"]["variants"]["selected"]
    refused(*post(server, "/v1/models/variants", {"model": "in", "base": base, "sources": [str(outside / "affine.loom")]}),
            "sources")
    refused(*post(server, "/v1/models/variants", {"model": "in", "base": base, "base_directory": str(outside),
                                                  "sources": ["affine.loom"]}), "base_directory")
    refused(*post(server, "/v1/models/variants", {"model": "in", "base": base, "base_directory": str(inside),
                                                  "sources": ["escape.loom"]}), "sources")
    status, body = post(server, "/v1/models/variants", {"model": "in", "base": base, "base_directory": str(inside),
                                                        "sources": ["affine.loom"]})
    assert status == 200 and body["variant"]["phase"] == "ready", body


def test_an_include_or_a_neighbour_leading_out_is_refused_at_the_open(server, tree):
    inside, _ = tree
    assert post(server, "/v1/models/register", affine("inc", inside, sources=["includes.loom"],
                                                      base_directory=str(inside)))[0] == 202
    reg = settled(server, "inc")
    assert reg["phase"] == "failed" and reg["error"]["code"] == "source", reg
    assert "outside the model roots" in reg["error"]["message"] and "TOPSECRET" not in json.dumps(reg)
    assert post(server, "/v1/models/register", affine("tok", inside, checkpoint=str(inside / "folder" / "m.gguf")))[0] == 202
    reg = settled(server, "tok")
    assert reg["phase"] == "failed" and reg["error"]["code"] == "tokenizer", reg
    assert "outside the model roots" in reg["error"]["message"]
    logz = server.request("GET", "/logz?cursor=0&limit=1000")[2].decode()
    assert "TOPSECRET" not in logz


def test_an_upload_naming_a_server_file_outside_the_roots_is_refused(server, tree, tmp_path):
    inside, outside = tree
    (tmp_path / "r.json").write_text(json.dumps(affine("up", inside, sources=["own.loom", str(outside / "affine.loom")])))
    (tmp_path / "own.loom").write_text(open(AFFINE).read())
    out = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", "-H", "Expect:", f"{server.url}/v1/models/register",
                          "-F", f"request=@{tmp_path}/r.json;filename=pkg/r.json",
                          "-F", f"file=@{tmp_path}/own.loom;filename=pkg/own.loom"], capture_output=True, text=True,
                         timeout=60)
    body, status = out.stdout.rsplit("\n", 1)
    refused(int(status), json.loads(body), "sources")


def test_the_default_roots_are_the_catalog_folders_the_cache_and_loom_itself(tmp_path, tmp_path_factory):
    """No --model_root: the catalog's folder (and what its documents name), Loom's shipped packages
    and its cache are roots; another folder of this machine is not."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    write_gguf(elsewhere / "m.gguf", "F32", seed=2)
    write_gguf(tmp_path / "m.gguf", "F32", seed=2)
    srv = _start_live(tmp_path, ())         # its catalog.json is in tmp_path
    try:
        refused(*post(srv, "/v1/models/register", affine("far", tmp_path, checkpoint=str(elsewhere / "m.gguf"))),
                "checkpoint")
        doc = {"model": "near", "kind": "embedding", "sources": [AFFINE], "checkpoint": str(tmp_path / "m.gguf")}
        assert post(srv, "/v1/models/register", doc)[0] == 202         # shipped package, catalog folder
        assert settled(srv, "near")["phase"] == "ready"
        roots = [json.loads(line) for line in srv.request("GET", "/logz?cursor=0&limit=1000")[2].decode().splitlines()]
        shown = next(e for e in roots if e["event"] == "model_roots")["roots"]
        assert os.path.realpath(str(tmp_path)) in shown and os.path.realpath(os.path.join(ROOT, "models")) in shown
    finally:
        srv.stop()


def test_a_model_root_that_is_not_a_folder_stops_the_start(tmp_path):
    (tmp_path / "empty.json").write_text("[]")
    run = subprocess.run([sys.executable, "-m", "loom", "--models", str(tmp_path / "empty.json"), "--listen",
                          "tcp:127.0.0.1:0", "--model_root", str(tmp_path / "absent")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--model_root" in run.stderr and "not a directory" in run.stderr
