"""POST /v1/images/generations end to end on the default `illustrator` (a generated model of
Stable Diffusion 1.5's architecture, models/sd): the openai SDK, PROFILES' two examples, the
pixels against the numpy pipeline (tests/sd_numpy.py) for the same noise, seeds, adapters per
request inside shared batches, sizes compiled once without moving the default, disconnects,
and every rejection with its error envelope."""

import base64
import http.client
import io
import json
import socket
import threading
import time

import numpy as np
import pytest
from PIL import Image

from conftest import _start_live
from loom import demo
from loom.imagegen import noise

import sd_numpy as ref

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = _start_live(tmp_path_factory.mktemp("imagegen"), (), catalog="illustrator")
    deadline = time.monotonic() + 600
    while "illustrator" not in {m["id"] for m in json.loads(srv.request("GET", "/v1/models")[2])["data"]}:
        assert time.monotonic() < deadline, "".join(srv.stderr_lines)
        time.sleep(0.5)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def W():
    return ref.load(demo.illustrator_folder())


def post(server, body, timeout=300):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/images/generations", json.dumps(body).encode(), JSON)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def png(server, **fields):
    status, body = post(server, dict({"model": "illustrator", "prompt": "a red fox in the snow"}, **fields))
    assert status == 200, body
    assert set(body) == {"created", "data"} and len(body["data"]) == 1 and set(body["data"][0]) == {"b64_json"}
    return base64.b64decode(body["data"][0]["b64_json"])


def pixels(data):
    im = Image.open(io.BytesIO(data))
    assert im.format == "PNG" and im.mode == "RGB"
    return np.asarray(im)


def status(server):
    regs = json.loads(server.request("GET", "/v1/status")[2])["registrations"]
    return next(r for r in regs if r["model"] == "illustrator")["scheduler"]


def capability(server):
    models = json.loads(server.request("GET", "/v1/models")[2])["data"]
    return next(m for m in models if m["id"] == "illustrator")


def reference(W, server, prompt, seed, size=(256, 256), loras=()):
    """The numpy pipeline on the same prompt, noise, scheduler, steps and guidance."""
    cap = capability(server)["loom"]
    h, w = size[1] // 8, size[0] // 8
    latents = noise(seed, h, w, 4).transpose(2, 0, 1)
    adapters = [(ref.read_lora(W, f"{W['dir']}/loras/{name}.safetensors"), scale) for name, scale in loras]
    image = ref.generate(W, ref.tokenize(W, prompt), ref.tokenize(W, ""), latents, cap["steps"],
                         cap["guidance_scale"], loras=adapters)
    return ref.to_pixels(image)


def assert_pixels_match(got, want):
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
    # float32 on the device vs numpy: a value near a rounding boundary may land one level off.
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())


def test_discovery(server):
    m = capability(server)
    assert m["input_modalities"] == ["text"] and m["output_modalities"] == ["image"]
    loom = m["loom"]
    assert loom["endpoint"] == "/v1/images/generations" and loom["size"] == "256x256"
    assert loom["loras"] == ["watercolor", "ink"] and loom["format"] == "png"


def test_the_openai_sdk_generates_a_png(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://{server.host}:{server.port}/v1", api_key="unused")
    result = client.images.generate(model="illustrator", prompt="a red fox in the snow", size="256x256",
                                    response_format="b64_json")
    assert pixels(base64.b64decode(result.data[0].b64_json)).shape == (256, 256, 3)
    plain = client.images.generate(model="illustrator", prompt="a red fox in the snow")   # no response_format
    assert base64.b64decode(plain.data[0].b64_json) == base64.b64decode(result.data[0].b64_json)


def test_pixels_equal_the_numpy_pipeline_and_seeds_reproduce(server, W):
    first = png(server, seed=7)
    assert png(server, seed="7") == first                 # the same seed: the same bytes, as a string too
    assert png(server, seed=8) != first
    assert png(server) == png(server, seed=0)             # seed defaults to zero
    assert_pixels_match(pixels(first), reference(W, server, "a red fox in the snow", 7))


def test_profiles_examples_run_verbatim(server, W):
    status_, body = post(server, {"model": "illustrator", "prompt": "a red fox in the snow", "size": "1536x1024",
                                  "seed": "0", "response_format": "b64_json"})
    # The generated illustrator bounds its work at 512x512 pixels (max_pixels): a clear refusal.
    assert status_ == 400 and body["error"]["code"] == "unsupported_value" and body["error"]["param"] == "size"
    assert "1572864 pixels" in body["error"]["message"] and "max_pixels" in body["error"]["message"]
    mixed = png(server, loras=[{"id": "watercolor", "scale": 0.3}, {"id": "ink", "scale": 0.7}])
    assert mixed != png(server)
    assert_pixels_match(pixels(mixed), reference(W, server, "a red fox in the snow", 0,
                                                 loras=[("watercolor", 0.3), ("ink", 0.7)]))


def test_adapters_act_per_request_inside_a_shared_batch(server):
    base = png(server, seed=3)
    assert png(server, seed=3, loras=[]) == base
    assert png(server, seed=3, loras=[{"id": "watercolor", "scale": 0.0}, {"id": "ink", "scale": 0}]) == base
    alone = {name: png(server, seed=3, loras=[{"id": name, "scale": -0.8 if name == "ink" else 1.0}])
             for name in ("watercolor", "ink")}
    assert alone["watercolor"] != base and alone["ink"] != base and alone["watercolor"] != alone["ink"]
    before = status(server)["cohorts"]
    results = {}

    def run(name):
        results[name] = png(server, seed=3, loras=[{"id": name, "scale": -0.8 if name == "ink" else 1.0}])

    threads = [threading.Thread(target=run, args=(name,)) for name in ("watercolor", "ink")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results == alone                       # bit for bit, whoever shared the steps
    steps = capability(server)["loom"]["steps"]
    assert status(server)["cohorts"] - before < 2 * (steps + 2)   # they did share steps


def test_a_second_size_compiles_once_and_leaves_the_default(server):
    compiles = status(server)["compiles"]
    small = pixels(png(server, size="128x128"))
    assert small.shape == (128, 128, 3)
    assert status(server)["compiles"] == compiles + 1
    assert pixels(png(server, size="128x128", seed=1)).shape == (128, 128, 3)
    assert pixels(png(server, size="96x160")).shape == (160, 96, 3)
    assert status(server)["compiles"] == compiles + 2           # 128x128 reused its code
    assert pixels(png(server)).shape == (256, 256, 3)           # the default did not move
    assert "128x128" in status(server)["sizes"] and status(server)["size_cache"] == 4


@pytest.mark.parametrize("body, code, param", [
    ({"n": 2}, "unsupported_value", "n"),
    ({"response_format": "url"}, "unsupported_value", "response_format"),
    ({"quality": "hd"}, "unknown_field", "quality"),
    ({"image": "data:image/png;base64,AAAA"}, "unknown_field", "image"),
    ({"size": "256"}, "invalid_value", "size"),
    ({"size": "256x256 "}, "invalid_value", "size"),
    ({"size": "0x256"}, "invalid_value", "size"),
    ({"size": "250x256"}, "unsupported_value", "size"),
    ({"size": "1024x1024"}, "unsupported_value", "size"),
    ({"seed": -1}, "out_of_range", "seed"),
    ({"seed": 2 ** 64}, "out_of_range", "seed"),
    ({"seed": "18446744073709551616"}, "invalid_value", "seed"),
    ({"seed": "0x10"}, "invalid_value", "seed"),
    ({"prompt": ""}, "invalid_value", "prompt"),
    ({"loras": [{"id": "oil"}]}, "unsupported_value", "loras[0].id"),
    ({"loras": [{"id": "ink"}, {"id": "ink", "scale": 0.5}]}, "duplicate_value", "loras[1].id"),
    ({"loras": [{"id": ""}]}, "invalid_value", "loras[0].id"),
    ({"loras": [{"id": "ink", "scale": 1e39}]}, "invalid_value", "loras[0].scale"),
    ({"loras": [{"id": "ink", "weight": 1}]}, "unknown_field", "loras[0].weight"),
    ({"loras": [{"id": "/srv/other.safetensors"}]}, "unsupported_value", "loras[0].id"),
    ({"loras": {"id": "ink"}}, "invalid_type", "loras"),
])
def test_rejections(server, body, code, param):
    status_, err = post(server, dict({"model": "illustrator", "prompt": "a fox"}, **body))
    assert status_ == 400, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["code"] == code and err["error"]["param"] == param, err


def test_a_missing_prompt_and_an_unknown_model(server):
    status_, err = post(server, {"model": "illustrator"})
    assert status_ == 400 and err["error"]["code"] == "missing_field"
    status_, err = post(server, {"model": "painter", "prompt": "a fox"})
    assert status_ == 404 and err["error"]["code"] == "model_not_found"


def test_a_client_that_leaves_stops_its_steps_while_others_finish(server):
    before = status(server)
    body = json.dumps({"model": "illustrator", "prompt": "a boat", "size": "256x256", "seed": 11}).encode()
    sock = socket.create_connection((server.host, server.port))
    sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 60
    while status(server)["active"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    sock.close()
    survivor = png(server, seed=12)
    assert pixels(survivor).shape == (256, 256, 3)
    deadline = time.monotonic() + 30
    while status(server)["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = status(server)
    assert after["active"] == 0
    steps = capability(server)["loom"]["steps"]
    # The survivor ran all its steps; the one that left did not (its steps stopped at the boundary).
    assert after["requests"] - before["requests"] < 2 * (steps + 2)


def test_residency_has_only_the_primary_component(server):
    status_, _, raw = server.request("POST", "/v1/models/deactivate",
                                     body=json.dumps({"model": "illustrator", "component": "image"}).encode(),
                                     headers=JSON)
    assert status_ == 404 and json.loads(raw)["error"]["code"] == "component_not_found"


def test_a_variant_switch_waits_for_the_image_in_progress(server):
    from conftest import ROOT
    call = lambda path, body: server.request("POST", path, body=json.dumps(body).encode(), headers=JSON)  # noqa: E731
    models = json.loads(server.request("GET", "/v1/models")[2])["data"]
    base = next(m for m in models if m["id"] == "illustrator")["loom"]["variants"]["selected"]
    status_, _, raw = call("/v1/models/variants", {"model": "illustrator", "base": base, "wait": True,
                                                   "base_directory": f"{ROOT}/models/sd", "sources": ["sd.loom"]})
    assert status_ == 200, raw
    staged = json.loads(raw)["variant"]["id"]
    done = {}

    def image():
        done["image"] = png(server, seed=21)

    thread = threading.Thread(target=image)
    thread.start()
    deadline = time.monotonic() + 60
    while status(server).get("states", {}).get("denoise", 0) + status(server).get("states", {}).get(
            "denoise-running", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert status(server)["active"] == 1
    status_, _, raw = call("/v1/models/variants/select", {"model": "illustrator", "variant": staged,
                                                          "expected": base})
    # Answered only once the image had left the engine, PNG encoded (it was a second of steps away).
    assert status(server)["active"] == 0
    thread.join(300)
    assert status_ == 200 and json.loads(raw) == {"selected": staged}
    assert png(server, seed=21) == done["image"]        # the same source: the same picture on the new variant
    assert call("/v1/models/variants/select", {"model": "illustrator", "variant": base, "expected": staged})[0] == 200
    assert call("/v1/models/variants/remove", {"model": "illustrator", "variant": staged})[0] == 200
