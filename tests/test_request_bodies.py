"""Request bodies through the real transport: multipart uploads and strict JSON.

Handlers here stand in for the endpoints that will consume them (registration
packages, transcription uploads, every JSON API): they use the same
Request.form() and Request.json() an endpoint uses and echo what they saw.
"""

import base64
import json
import subprocess

import pytest

from loom.http import Response
from loom.jsonin import Arr, Bool, Int, Obj, Str

SPEC = Obj({
    "model": Str(min_len=1),
    "max_tokens": Int(lo=1, hi=16384, optional=True),
    "stream": Bool(optional=True, nullable=True),
    "messages": Arr(Obj({"role": Str(), "content": Str()}), min_len=1, optional=True),
})


def show_form(server, request):
    return Response.json([{"name": p.name, "filename": p.filename, "content_type": p.content_type,
                           "params": p.params, "data": base64.b64encode(p.data).decode()}
                          for p in request.form()])


def show_json(server, request):
    return Response.json(request.json(SPEC))


@pytest.fixture
def body_server(thread_server):
    return thread_server([("POST", "/form", show_form), ("POST", "/json", show_json)], request_body_bytes=1 << 20)


def curl(*args):
    out = subprocess.run(["curl", "-sS", "-H", "Expect:", *args], capture_output=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("chunked", [False, True])
def test_curl_multipart_upload_keeps_names_order_filenames_and_bytes(body_server, tmp_path, chunked):
    (tmp_path / "candidate.json").write_text('{"model":"scout","base":12,"sources":["config.loom"]}')
    binary = bytes(range(256)) * 40 + b"\r\n--boundary-ish\r\n"
    (tmp_path / "advance.loombc").write_bytes(binary)
    (tmp_path / "rec.pcm").write_bytes(b"\x01\x00\xff\x7f" * 100)
    extra = ["-H", "Transfer-Encoding: chunked"] if chunked else []
    parts = curl(*extra, f"{body_server.url}/form",
                 "-F", f"request=@{tmp_path / 'candidate.json'};type=application/json;filename=model/candidate.json",
                 "-F", f"file=@{tmp_path / 'advance.loombc'};filename=model/mod\u00e8le%41.loombc",
                 "-F", "model=recognizer",
                 "-F", f"file=@{tmp_path / 'rec.pcm'};headers=\"Content-Type: audio/pcm;rate=24000;channels=1\"")
    assert [(p["name"], p["filename"]) for p in parts] == [
        ("request", "model/candidate.json"), ("file", "model/mod\u00e8le%41.loombc"),
        ("model", None), ("file", "rec.pcm")]
    assert base64.b64decode(parts[1]["data"]) == binary
    assert parts[0]["content_type"] == "application/json"
    assert (parts[3]["content_type"], parts[3]["params"]) == ("audio/pcm", {"rate": "24000", "channels": "1"})
    assert base64.b64decode(parts[2]["data"]) == b"recognizer"


def test_malformed_multipart_rejects_and_connection_survives(body_server):
    conn = body_server.connection()
    cases = [
        ("multipart/form-data", b"--x\r\n"),                                  # no boundary parameter
        ("multipart/form-data; boundary=x; boundary=y", b"--x--\r\n"),        # duplicate boundary
        ("multipart/form-data; boundary=x",
         b"--x\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nvalue\r\n"),  # no final boundary
        ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition form-data\r\n\r\nv\r\n--x--\r\n"),
    ]
    for ctype, body in cases:
        conn.request("POST", "/form", body=body, headers={"Content-Type": ctype})
        resp = conn.getresponse()
        err = json.loads(resp.read())["error"]
        assert resp.status == 400 and err["code"] == "invalid_multipart" and err["message"]
    conn.request("POST", "/form", body=b"{}", headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 415 and json.loads(resp.read())["error"]["code"] == "invalid_multipart"
    conn.close()


def test_multipart_body_counts_against_the_body_limit(thread_server, tmp_path):
    ts = thread_server([("POST", "/form", show_form)], request_body_bytes=10_000)
    (tmp_path / "big.bin").write_bytes(b"b" * 20_000)
    out = subprocess.run(["curl", "-sS", "-H", "Expect:", "-F", f"file=@{tmp_path / 'big.bin'}", f"{ts.url}/form"],
                         capture_output=True, timeout=30)
    assert json.loads(out.stdout)["error"]["code"] == "body_too_large"


JSON_CASES = [
    (b'{"model":"a","model":"b"}', "duplicate_key", "model"),
    (b'{"model":"a","messages":[{"role":"u","role":"v","content":""}]}', "duplicate_key", "messages[0].role"),
    (b'{"model":"a","max_tokens":NaN}', "invalid_json", None),
    (b'{"model":"a"} trailing', "invalid_json", None),
    (b'{"model":"a",}', "invalid_json", None),
    (b'{"model":"a" /* c */}', "invalid_json", None),
    (b'{"model":"\\ud800"}', "invalid_json", "model"),
    (b'{"model":"\xff"}', "invalid_json", None),
    (b'{"model":"a","extra":1}', "unknown_field", "extra"),
    (b'{"model":"a","max_tokens":true}', "invalid_type", "max_tokens"),
    (b'{"model":"a","max_tokens":0}', "out_of_range", "max_tokens"),
    (b'{"max_tokens":3}', "missing_field", "model"),
    (b'{"model":"a","messages":[{"role":"u","content":1}]}', "invalid_type", "messages[0].content"),
    (b"", "invalid_json", None),
]


@pytest.mark.parametrize("body,code,param", JSON_CASES)
def test_strict_json_rejections_name_the_param(body_server, body, code, param):
    status, _, resp = body_server.request("POST", "/json", body=body, headers={"Content-Type": "application/json"})
    err = json.loads(resp)["error"]
    assert status == 400 and err["type"] == "invalid_request_error"
    assert (err["code"], err["param"]) == (code, param)


def test_valid_json_passes_and_wrong_media_type_is_415(body_server):
    doc = {"model": "scout", "stream": None, "messages": [{"role": "user", "content": "h\u00e9 \U0001f600"}]}
    status, _, resp = body_server.request("POST", "/json", body=json.dumps(doc).encode())
    assert status == 200 and json.loads(resp) == doc
    status, _, resp = body_server.request("POST", "/json", body=b'{"model":"x"}',
                                          headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 415 and json.loads(resp)["error"]["code"] == "unsupported_media_type"
