"""No server file is ever quoted back (issue 51). The server has no authentication
(PROFILES.md), so every diagnostic is public: one about a server-side file (sources,
prepare/control modules, checkpoint, assets, base_directory members and includes, a
component's files, LoRA adapters) names the path, the position and what was expected,
never bytes it read. A secret file goes through every registration and staging path; the
answers, /v1/status, /logz and /logz/stream must not hold its text, nor the numbers a
binary reader would decode from its first bytes. The operator's standard error alone gets
the whole diagnostic. An uploaded package's members are the client's own bytes: their
diagnostics may quote them, as before."""

import json
import os
import shutil
import socket
import subprocess
import time
import uuid

import pytest

from conftest import ROOT, _start_live, tiny_scout_dir
from loom import demo
from test_runtime import PACKAGE, write_gguf

AFFINE = os.path.join(PACKAGE, "affine.loom")
TOKEN = "TOPSECRET" + uuid.uuid4().hex[:12].upper()
SECRET = f"{TOKEN} the password is hunter2 {TOKEN}\n".encode()
JSON_SECRET = json.dumps({"weight_map": {TOKEN: f"{TOKEN}.safetensors"}, "metadata": {"k": TOKEN}}).encode()
MODULE_SECRET = f"module {TOKEN}\nspec {TOKEN}x = {TOKEN}y + 1\n".encode()   # parses; its names are the secret
CLIENT = "CLIENTBYTES" + uuid.uuid4().hex[:12].upper()     # an uploaded member's text: the client's own


def leaks(text):
    """What of the secret a text holds: the token, or a number a binary reader decodes from the
    file's first bytes (a header length, a magic, a version)."""
    found = [TOKEN] if TOKEN in text else []
    for data in (SECRET, JSON_SECRET, MODULE_SECRET):
        numbers = {int.from_bytes(data[:8], "little"), int.from_bytes(data[4:8], "little"),
                   int.from_bytes(data[:4], "little")}
        found += [str(n) for n in numbers if str(n) in text] + [repr(data[:4])] * (repr(data[:4]) in text)
    return found


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A valid affine package and checkpoint, and the secret under every name a reader takes."""
    root = tmp_path_factory.mktemp("files")
    write_gguf(root / "m.gguf", "F32", seed=1)
    secret = root / "private"
    secret.mkdir()
    for name in ("file", "secret.gguf", "secret.safetensors", "secret.bin", "secret.onnx", "secret.loom",
                 "secret.loombc", "secret.h"):
        (secret / name).write_bytes(SECRET)
    (secret / "secret.json").write_bytes(JSON_SECRET)
    (secret / "module.loom").write_bytes(MODULE_SECRET)
    for sub, name, data in (("diffusers", "model_index.json", JSON_SECRET), ("gguf_dir", "only.gguf", SECRET),
                            ("assets_json", "tokenizer.json", SECRET), ("assets_vocab", "tokenizer.json", JSON_SECRET)):
        (secret / sub).mkdir()
        (secret / sub / name).write_bytes(data)
    # An affine package whose kernel includes a server file beside it (base_directory).
    source = open(AFFINE).read()
    include = source.replace("__kernel void mean_pool(", '#include "secret.h"\n__kernel void mean_pool(', 1)
    assert include != source
    (secret / "includes.loom").write_text(include)
    shutil.copy(AFFINE, secret / "affine.loom")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, files):
    # the secret's folder is a model root: what is at stake here is what a diagnostic says of a file
    # the server may read (tests/test_model_root.py keeps the rest out)
    srv = _start_live(tmp_path_factory.mktemp("server-files"),
                      ("--model_root", str(files), "--model_root", os.path.dirname(os.path.dirname(tiny_scout_dir()))))
    yield srv
    srv.stop()


def post(server, path, body, headers=None):
    status, _, raw = server.request("POST", path, body=json.dumps(body).encode() if not isinstance(body, bytes)
                                    else body, headers=headers or {"Content-Type": "application/json"}, timeout=120)
    return status, raw.decode("utf-8", "replace")


def registration(server, name):
    regs = json.loads(server.request("GET", "/v1/status")[2])["registrations"]
    return next((r for r in regs if r["model"] == name), None)


def settled(server, name, timeout=120):
    deadline = time.monotonic() + timeout
    while (reg := registration(server, name)) is not None and reg["phase"] not in ("ready", "failed"):
        assert time.monotonic() < deadline, reg
        time.sleep(0.05)
    return reg


def logz(server):
    return server.request("GET", "/logz?cursor=0&limit=1000")[2].decode()


def stream(server):
    """/logz/stream from the first entry up to the newest /logz holds now."""
    last = json.loads(logz(server).strip().splitlines()[-1])["id"]
    sock = socket.create_connection((server.host, server.port), timeout=10)
    try:
        sock.sendall(b"GET /logz/stream?cursor=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        deadline = time.monotonic() + 10
        while f"id: {last}\n".encode() not in data and time.monotonic() < deadline:
            data += sock.recv(65536)
        assert f"id: {last}\n".encode() in data, data[-300:]
        return data.decode("utf-8", "replace")
    finally:
        sock.close()


def everything_public(server):
    return {"/v1/status": server.request("GET", "/v1/status")[2].decode(), "/logz": logz(server),
            "/logz/stream": stream(server), "/v1/models": server.request("GET", "/v1/models")[2].decode()}


def assert_not_quoted(server, *answers):
    for where, text in [("answer", a) for a in answers] + list(everything_public(server).items()):
        assert not leaks(text), (where, leaks(text), text[-2000:])


def affine(name, files, **fields):
    return dict({"model": name, "kind": "embedding", "sources": [AFFINE], "checkpoint": str(files / "m.gguf")},
                **fields)


def private(files, name):
    return str(files / "private" / name)


# Each case: a registration that reads the secret on the server, and the path its error must name.
REGISTRATIONS = {
    "sources": lambda f: (affine("r-sources", f, sources=[private(f, "file")]), "file"),
    "sources-loom": lambda f: (affine("r-loom", f, sources=[AFFINE, private(f, "secret.loom")]), "secret.loom"),
    "sources-module-names": lambda f: (affine("r-names", f, sources=[AFFINE, private(f, "module.loom")]),
                                       "module.loom"),
    "sources-relative": lambda f: (affine("r-relative", f, sources=["file"], base_directory=str(f / "private"),
                                          checkpoint=str(f / "m.gguf")), "file"),
    "prepare": lambda f: (affine("r-prepare", f, prepare=private(f, "file")), "file"),
    "control": lambda f: (affine("r-control", f, control=private(f, "secret.loom")), "secret.loom"),
    "checkpoint-gguf": lambda f: (affine("r-gguf", f, checkpoint=private(f, "secret.gguf")), "secret.gguf"),
    "checkpoint-safetensors": lambda f: (affine("r-st", f, checkpoint=private(f, "secret.safetensors")),
                                         "secret.safetensors"),
    "checkpoint-ctranslate2": lambda f: (affine("r-ct2", f, checkpoint=private(f, "secret.bin")), "secret.bin"),
    "checkpoint-onnx": lambda f: (affine("r-onnx", f, checkpoint=private(f, "secret.onnx")), "secret.onnx"),
    "checkpoint-index": lambda f: (affine("r-index", f, checkpoint=private(f, "secret.json")), "secret.json"),
    "checkpoint-diffusers": lambda f: (affine("r-diffusers", f, checkpoint=private(f, "diffusers")), "diffusers"),
    "checkpoint-directory": lambda f: (affine("r-dir", f, checkpoint=private(f, "gguf_dir")), "gguf_dir"),
    "checkpoint-other": lambda f: (affine("r-other", f, checkpoint=private(f, "file")), "file"),
    "assets-tokenizer": lambda f: (affine("r-assets", f, assets=private(f, "assets_json")), None),
    "assets-tokenizer-json": lambda f: (affine("r-assets2", f, assets=private(f, "assets_vocab")), None),
    "includes": lambda f: (affine("r-include", f, sources=["includes.loom"], base_directory=str(f / "private"),
                                  checkpoint=str(f / "m.gguf")), None),
    "component-sources": lambda f: (scout("r-component", f, sources=[private(f, "file")]), "file"),
    "component-checkpoint": lambda f: (scout("r-component2", f, checkpoint=private(f, "secret.safetensors")),
                                       "secret.safetensors"),
    "lora-adapter": lambda f: (illustrator("r-lora", private(f, "secret.safetensors")), None),
}


def scout(name, files, **component):
    docs = {d["model"]: d for d in demo.catalog(text=tiny_scout_dir(), image=False, recognizer=False, speaker=False,
                                                   illustrator=False)}
    image = dict({"sources": [os.path.join(ROOT, "models", "smolvlm", "vision.loom")],
                  "checkpoint": private(files, "secret.safetensors")}, **component)
    return dict(docs["scout"], model=name, rows=1, context_length=256, components={"image": image})


def illustrator(name, adapter):
    sd = demo.illustrator_folder()
    if sd is None:
        pytest.skip("the generated illustrator cannot be written")
    doc = next(d for d in demo.catalog(text=tiny_scout_dir(), recognizer=False, speaker=False)
               if d["model"] == "illustrator")
    return dict(doc, model=name, options={"loras": {"secret": adapter}})


INFERENCE = {"embedding": ("/v1/embeddings", {"input": "x"}),
             "text": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
             "image": ("/v1/images/generations", {"prompt": "x"})}


@pytest.mark.parametrize("case", list(REGISTRATIONS))
def test_a_registration_never_quotes_a_server_file(server, files, case):
    doc, named = REGISTRATIONS[case](files)
    status, answer = post(server, "/v1/models/register", doc)
    assert status == 202, answer
    reg = settled(server, doc["model"])
    assert reg["phase"] == "failed", reg
    message = reg["error"]["message"]
    if named is not None:
        assert named in message, message          # it names the file, and
    # ... says what was expected, at a position when the parser has one
    if case in ("sources", "sources-relative", "prepare"):
        assert ":1:1: expected 'module'" in message, message
    path, body = INFERENCE[doc["kind"]]
    status, refused = post(server, path, dict(body, model=doc["model"]))
    assert status == 422 and json.loads(refused)["error"]["code"] == "model_failed", refused
    assert_not_quoted(server, answer, refused)
    assert post(server, "/v1/models/unregister", {"model": doc["model"]})[0] == 202


def test_the_operator_still_reads_the_whole_diagnostic_on_stderr(server, files):
    """What /v1/status withholds (a module's declared names, here the secret) is on the server's
    own standard error, for the operator's eyes; the parser never repeats a file's text at all."""
    doc = affine("r-operator", files, sources=[AFFINE, private(files, "module.loom")])
    assert post(server, "/v1/models/register", doc)[0] == 202
    assert settled(server, "r-operator")["phase"] == "failed"
    deadline = time.monotonic() + 10
    while not any(TOKEN in line for line in server.stderr_lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(TOKEN in line for line in server.stderr_lines)
    assert_not_quoted(server)
    post(server, "/v1/models/unregister", {"model": "r-operator"})


@pytest.fixture(scope="module")
def staged_base(server, files):
    doc = affine("stager", files, variant_capacity=4)
    assert post(server, "/v1/models/register", doc)[0] == 202
    assert settled(server, "stager")["phase"] == "ready"
    models = json.loads(server.request("GET", "/v1/models")[2])["data"]
    return next(m for m in models if m["id"] == "stager")["loom"]["variants"]["selected"]


@pytest.mark.parametrize("sources,directory", [
    (["file"], "private"), ([AFFINE, "module.loom"], "private"), (["includes.loom"], "private"),
    ([f"/{{root}}/private/secret.loom"], None),
])
def test_staging_never_quotes_a_server_file(server, files, staged_base, sources, directory):
    body = {"model": "stager", "base": staged_base, "wait": True,
            "sources": [s.replace("/{root}", str(files)) for s in sources]}
    if directory:
        body["base_directory"] = str(files / directory)
    status, answer = post(server, "/v1/models/variants", body)
    assert status == 422, answer
    variant = json.loads(answer)["variant"]
    assert variant["phase"] == "failed" and variant["error"]["code"] in ("source", "compile", "contract"), variant
    detail = server.request("GET", "/v1/models/variants", headers={"X-Loom-Model": "stager",
                                                                   "X-Loom-Variant": str(variant["id"])})[2].decode()
    assert_not_quoted(server, answer, detail)
    assert post(server, "/v1/models/variants/remove", {"model": "stager", "variant": variant["id"]})[0] == 200


def curl_form(server, path, *fields):
    out = subprocess.run(["curl", "-sS", "-H", "Expect:", f"{server.url}{path}", *sum((["-F", f] for f in fields), [])],
                         capture_output=True, text=True, timeout=120)
    return out.stdout


def test_an_upload_naming_a_server_file_never_quotes_it_but_its_own_members_may_be(server, files, staged_base,
                                                                                     tmp_path):
    # An uploaded package that names the secret by its absolute server path: withheld.
    (tmp_path / "r.json").write_text(json.dumps(affine("up-server", files, sources=["own.loom", private(files, "file")])))
    (tmp_path / "own.loom").write_text(open(AFFINE).read())
    answer = curl_form(server, "/v1/models/register", f"request=@{tmp_path}/r.json;filename=pkg/r.json",
                       f"file=@{tmp_path}/own.loom;filename=pkg/own.loom")
    assert settled(server, "up-server")["phase"] == "failed"
    assert "file" in registration(server, "up-server")["error"]["message"]
    assert_not_quoted(server, answer)
    post(server, "/v1/models/unregister", {"model": "up-server"})
    # The client's own member with the same bytes: its diagnostic may quote what the client sent.
    (tmp_path / "r.json").write_text(json.dumps(affine("up-own", files, sources=["mine.loom"])))
    (tmp_path / "mine.loom").write_text(f"{CLIENT} is not a module\n")
    curl_form(server, "/v1/models/register", f"request=@{tmp_path}/r.json;filename=pkg/r.json",
              f"file=@{tmp_path}/mine.loom;filename=pkg/mine.loom")
    reg = settled(server, "up-own")
    assert reg["phase"] == "failed" and CLIENT in reg["error"]["message"], reg["error"]
    post(server, "/v1/models/unregister", {"model": "up-own"})
    # Staging an uploaded member: quoted too.
    (tmp_path / "s.json").write_text(json.dumps({"model": "stager", "sources": ["mine.loom"], "base": staged_base}))
    staged = json.loads(curl_form(server, "/v1/models/variants", f"request=@{tmp_path}/s.json;filename=pkg/s.json",
                                  f"file=@{tmp_path}/mine.loom;filename=pkg/mine.loom"))
    assert staged["variant"]["phase"] == "failed" and CLIENT in staged["variant"]["error"]["message"]
    post(server, "/v1/models/variants/remove", {"model": "stager", "variant": staged["variant"]["id"]})
