"""A text deployment's image component (loom/vision.py): registered with the document's
"components", prepared on its own checkpoint, checked against the text model, proven, listed
in /v1/models' input modalities and /v1/status, a residency component of its own, and gone
with the registration, accounting included."""
import importlib.util
import json
import os
import time

import pytest

from conftest import ROOT, _start_live, read_response, tiny_scout_dir

_gen = importlib.util.spec_from_file_location("smolvlm_generate", os.path.join(ROOT, "models", "smolvlm", "generate.py"))
generate = importlib.util.module_from_spec(_gen)
_gen.loader.exec_module(generate)
VISION = os.path.join(ROOT, "models", "smolvlm", "vision.loom")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The server's folder (its catalog's, so a model root) and the towers'."""
    return tmp_path_factory.mktemp("vision")


@pytest.fixture(scope="module")
def server(folder):
    srv = _start_live(folder, ())
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def towers(folder):
    """Generated vision towers projecting to the tiny text model's 128 channels, and to SmolLM2's 576."""
    root = folder / "towers"
    return {width: generate.generate(str(root / str(width)), text_hidden=width) for width in (128, 576)}


def call(server, path, body, timeout=180, headers=()):
    """POST JSON; a generous timeout: a model's first requests compile their geometry's kernels."""
    conn = server.connection(timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode() if body is not None else b"",
                     headers={"Content-Type": "application/json", **dict(headers)})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def status(server):
    return json.loads(server.request("GET", "/v1/status")[2])


def registration(server, name):
    return next((r for r in status(server)["registrations"] if r["model"] == name), None)


def wait_phase(server, name, phases, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reg = registration(server, name)
        if reg is not None and reg["phase"] in phases:
            return reg
        time.sleep(0.1)
    raise AssertionError(f"{name} never reached {phases}: {registration(server, name)}")


def assert_gone_with_its_memory(server, name, used_before):
    """The unregistered `name` leaves /v1/status, and the pool holds nothing of it or its image."""
    deadline = time.monotonic() + 30
    while registration(server, name) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert registration(server, name) is None
    memory = status(server)["resources"]["memory"]
    assert name not in memory["by_owner"] and f"{name}/image" not in memory["by_owner"]
    assert memory["used"] == used_before


def scout(name, tower, **fields):
    return dict({"model": name, "kind": "text", "sources": [os.path.join(ROOT, "models", "llama", "llama.loom")],
                 "checkpoint": os.path.join(tiny_scout_dir(), "model.safetensors"), "rows": 2,
                 "context_length": 256, "options": {"chat": "chatml"},
                 "components": {"image": {"sources": [VISION], "checkpoint": os.path.join(tower, "model.safetensors")}}},
                **fields)


def test_an_image_component_registers_serves_its_modality_and_leaves_with_its_memory(server, towers):
    before = status(server)["resources"]["memory"]["used"]
    assert call(server, "/v1/models/register", scout("seer", towers[128]))[0] == 202
    reg = wait_phase(server, "seer", ("ready", "failed"))
    assert reg["phase"] == "ready", reg["error"]
    image = reg["resources"]["components"]["image"]
    weights = sum(a.nbytes for a in generate.tensors(0, 128).values())    # the generated tower, float32
    assert image["resident"] and weights <= image["param_bytes"] <= weights * 1.05
    owners = status(server)["resources"]["memory"]["by_owner"]
    assert owners["seer/image"]["params"] == image["param_bytes"]
    model = next(m for m in json.loads(server.request("GET", "/v1/models")[2])["data"] if m["id"] == "seer")
    assert model["input_modalities"] == ["text", "image"] and model["output_modalities"] == ["text"]
    # Residency selectors: "image" is a component now, an undeclared one is 404.
    assert call(server, "/v1/models/pin", {"model": "seer", "component": "image"})[0] == 200
    assert registration(server, "seer")["resources"]["components"]["image"]["pinned"]
    assert not registration(server, "seer")["resources"]["pinned"]
    assert call(server, "/v1/models/unpin", {"model": "seer", "component": "image"})[0] == 200
    status_code, body = call(server, "/v1/models/pin", {"model": "seer", "component": "audio"})
    assert status_code == 404 and body["error"]["code"] == "component_not_found"
    # The image component's weights leave and return alone; the primary's keep their place.
    assert call(server, "/v1/models/drain", {"model": "seer"})[0] in (200, 202)
    primary = reg["resources"]["param_bytes"]

    def resources():
        res = registration(server, "seer")["resources"]
        return res, status(server)["resources"]["memory"]["by_owner"].get("seer/image", {}).get("params", 0)

    assert call(server, "/v1/models/deactivate", {"model": "seer", "component": "image"})[0] == 202
    res, owned = resources()
    assert not res["components"]["image"]["resident"] and res["components"]["image"]["param_bytes"] == owned == 0
    assert res["resident"] and res["param_bytes"] == primary
    assert call(server, "/v1/models/activate", {"model": "seer", "component": "image"})[0] == 202
    deadline = time.monotonic() + 30
    while not resources()[0]["components"]["image"]["resident"] and time.monotonic() < deadline:
        time.sleep(0.05)
    res, owned = resources()
    assert res["components"]["image"]["resident"] and res["components"]["image"]["param_bytes"] == owned == image["param_bytes"]
    assert call(server, "/v1/models/deactivate", {"model": "seer"})[0] == 202      # primary alone
    res, owned = resources()
    assert not res["resident"] and res["param_bytes"] == 0 and owned == image["param_bytes"]
    assert call(server, "/v1/models/activate", {"model": "seer"})[0] == 202
    assert call(server, "/v1/models/undrain", {"model": "seer"})[0] in (200, 202)
    assert call(server, "/v1/models/unregister", {"model": "seer"})[0] in (200, 202)
    assert_gone_with_its_memory(server, "seer", before)


def test_an_unregistration_while_weights_stream_back_waits_for_them_and_leaves_nothing_charged(server, towers):
    """activate answers 202 and uploads on a worker; an unregister that arrives before the upload
    ends must not release first and let the upload charge a pool owner nobody will free."""
    before = status(server)["resources"]["memory"]["used"]
    assert call(server, "/v1/models/register", scout("racer", towers[128]))[0] == 202
    assert wait_phase(server, "racer", ("ready", "failed"))["phase"] == "ready"
    assert call(server, "/v1/models/drain", {"model": "racer"})[0] in (200, 202)
    for component in ("image", None):
        assert call(server, "/v1/models/deactivate", dict({"model": "racer"}, **(
            {"component": component} if component else {})))[0] == 202
    sock = server.raw()
    requests = [{"model": "racer", "component": "image"}, {"model": "racer"}, {"model": "racer"}]
    paths = ["/v1/models/activate", "/v1/models/activate", "/v1/models/unregister"]
    sock.sendall(b"".join(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(json.dumps(body)), json.dumps(body).encode())
                          for path, body in zip(paths, requests)))   # one write: no upload ends in between
    answers = [read_response(sock) for _ in paths]
    sock.close()
    assert [a[0] for a in answers][:2] == [202, 202] and answers[2][0] in (200, 202), answers
    assert_gone_with_its_memory(server, "racer", before)


def test_a_tower_for_another_width_fails_the_registration_by_its_contract(server, towers):
    assert call(server, "/v1/models/register", scout("mismatch", towers[576]))[0] == 202
    reg = wait_phase(server, "mismatch", ("ready", "failed"))
    assert reg["phase"] == "failed" and reg["error"]["code"] == "contract"
    assert "TEXT_D" in reg["error"]["message"] and "576" not in reg["error"]["message"]
    # the widths, read from the checkpoints, are for the operator's eyes: the server's stderr
    assert any("576" in line and "128" in line for line in server.stderr_lines)
    assert "mismatch/image" not in status(server)["resources"]["memory"]["by_owner"]
    call(server, "/v1/models/unregister", {"model": "mismatch"})


@pytest.mark.parametrize("change,param", [
    ({"kind": "embedding"}, "components.image"),                       # only text deployments take one
    ({"components": {"audio": {"sources": [VISION], "checkpoint": "x"}}}, "components.audio"),
    ({"components": {"image": {"sources": [VISION]}}}, "components.image.checkpoint"),
    ({"components": {"image": {"sources": [], "checkpoint": "x"}}}, "components.image.sources"),
    ({"components": {"image": {"sources": [VISION], "checkpoint": "x", "weights": 1}}}, "components.image.weights"),
])
def test_component_documents_that_reject(server, towers, change, param):
    status_code, body = call(server, "/v1/models/register", dict(scout("bad", towers[128]), **change))
    assert status_code == 400, body
    assert body["error"]["param"] == param, body
    assert registration(server, "bad") is None


# -- images in chat (the tiny text model behind the generated tower) -----------------------

def png_url(seed, size=(48, 64)):
    import base64
    import io
    import numpy as np
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ask(server, model, content, **fields):
    return call(server, "/v1/chat/completions", dict({"model": model, "max_tokens": 6, "temperature": 0,
                                                      "messages": [{"role": "user", "content": content}]}, **fields))


def projected(server, model):
    return registration(server, model)["scheduler"]["images"]["images_projected"]


def decoded(server, model):
    return registration(server, model)["scheduler"]["images"]["images_decoded"]


@pytest.fixture(scope="module")
def seer(server, towers):
    assert call(server, "/v1/models/register", scout("eyes", towers[128], context_length=4096,
                                                      prefix_cache_capacity=2, session_cache_capacity=2,
                                                      checkpoint_capacity=2))[0] == 202
    reg = wait_phase(server, "eyes", ("ready", "failed"))
    assert reg["phase"] == "ready", reg["error"]
    yield "eyes"
    call(server, "/v1/models/unregister", {"model": "eyes"})


def test_a_chat_with_an_image_counts_its_positions_and_reuses_them_exactly(server, seer):
    image = {"type": "image_url", "image_url": {"url": png_url(1)}}
    content = [{"type": "text", "text": "What is in this picture?"}, image]
    before = projected(server, seer)
    status_code, first = ask(server, seer, content)
    assert status_code == 200, first
    assert projected(server, seer) == before + 1
    status_code, counted = call(server, "/v1/chat/completions/input_tokens",
                                {"model": seer, "messages": [{"role": "user", "content": content}]})
    assert status_code == 200 and counted["input_tokens"] == first["usage"]["prompt_tokens"]
    # 16 image positions (one 128-pixel tile of 16 after the shuffle) and the markers' text.
    status_code, text_only = call(server, "/v1/chat/completions/input_tokens",
                                  {"model": seer, "messages": [{"role": "user", "content": content[:1]}]})
    assert counted["input_tokens"] - text_only["input_tokens"] > 16
    # The same conversation again: its image positions come from the retained row, nothing projects,
    # and the answer is the same.
    unpacked = decoded(server, seer)
    status_code, again = ask(server, seer, content)
    assert status_code == 200
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= counted["input_tokens"] - 1
    assert projected(server, seer) == before + 1 and decoded(server, seer) == unpacked   # neither projected nor decoded
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    # Another image (other bytes) in the same place replays: projected again.
    other = [content[0], {"type": "image_url", "image_url": {"url": png_url(2)}}]
    status_code, changed = ask(server, seer, other)
    assert status_code == 200
    assert projected(server, seer) == before + 2
    assert changed["usage"]["prompt_tokens_details"]["cached_tokens"] < counted["input_tokens"] - 16


def test_image_parts_that_reject(server, seer):
    bad = {"network": ("https://example.com/cat.png", 400, "unsupported_image_url"),
           "not base64": ("data:image/png,rawbytes", 400, "invalid_image_url"),
           "mismatch": (png_url(3).replace("image/png", "image/jpeg"), 400, "image_mime_mismatch")}
    for name, (url, status_code, code) in bad.items():
        got_status, body = ask(server, seer, [{"type": "image_url", "image_url": {"url": url}}])
        assert (got_status, body["error"]["code"]) == (status_code, code), (name, body)
        assert body["error"]["param"] == "messages[0].content[0].image_url.url"
    # A header that passes over a broken raster (a sample above MAXVAL): still a 400 before any response.
    import base64
    broken = base64.b64decode(pam_url("GRAYSCALE", 100, 1).split(",", 1)[1])[:-1] + bytes([200])
    got_status, body = ask(server, seer, [{"type": "image_url", "image_url": {
        "url": "data:image/x-portable-arbitrarymap;base64," + base64.b64encode(broken).decode()}}], stream=True)
    assert (got_status, body["error"]["code"]) == (400, "invalid_image"), body
    got_status, body = ask(server, seer, [{"type": "image_url", "image_url": {"url": png_url(3), "detail": "max"}}])
    assert got_status == 400 and body["error"]["param"] == "messages[0].content[0].image_url.detail"


def test_a_text_model_without_the_component_refuses_image_parts(server):
    doc = scout("blind", ".")
    del doc["components"]
    assert call(server, "/v1/models/register", doc)[0] == 202
    try:
        assert wait_phase(server, "blind", ("ready", "failed"))["phase"] == "ready"
        model = next(m for m in json.loads(server.request("GET", "/v1/models")[2])["data"] if m["id"] == "blind")
        assert model["input_modalities"] == ["text"]
        status_code, body = ask(server, "blind", [{"type": "text", "text": "hi"},
                                                  {"type": "image_url", "image_url": {"url": png_url(4)}}])
        assert status_code == 400 and body["error"]["code"] == "unsupported_value"
        assert body["error"]["param"] == "messages[0].content[1]"
        assert ask(server, "blind", [{"type": "text", "text": "hi"}])[0] == 200
    finally:
        call(server, "/v1/models/unregister", {"model": "blind"})


def pam_url(tupltype, maxval, seed, size=(5, 7)):
    """A PAM data URL of random samples (8-bit, or 16-bit big-endian above 255)."""
    import base64
    import numpy as np
    depth = {"BLACKANDWHITE": 1, "GRAYSCALE": 1, "RGB": 3}[tupltype.replace("_ALPHA", "")] + tupltype.endswith("_ALPHA")
    rng = np.random.default_rng(seed)
    samples = rng.integers(0, maxval + 1, (*size, depth))
    header = (f"P7\nWIDTH {size[1]}\nHEIGHT {size[0]}\nDEPTH {depth}\nMAXVAL {maxval}\nTUPLTYPE {tupltype}\n"
              "ENDHDR\n").encode()
    data = samples.astype(">u2" if maxval > 255 else "u1").tobytes()
    return "data:image/x-portable-arbitrarymap;base64," + base64.b64encode(header + data).decode()


def pillow_url(fmt, seed, mode="RGB", size=(40, 56)):
    import base64
    import io
    import numpy as np
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, len(mode)), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels if len(mode) > 1 else pixels[..., 0], mode).save(buf, fmt.upper(), **(
        {"lossless": True} if fmt == "webp" else {}))
    return f"data:image/{fmt};base64," + base64.b64encode(buf.getvalue()).decode()


def test_the_openai_sdk_sends_every_format_in_one_conversation(server, seer):
    """PNG, JPEG, GIF, WebP and each PAM tuple type (8- and 16-bit, with and without alpha) in
    one user message through the openai SDK: one answer, every image counted and projected."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://{server.host}:{server.port}/v1", api_key="unused")
    urls = [pillow_url("png", 1, "RGBA"), pillow_url("jpeg", 2), pillow_url("gif", 3, "L"), pillow_url("webp", 4)]
    urls += [pam_url(t, m, 10 + i) for i, (t, m) in enumerate(
        [("BLACKANDWHITE", 1), ("BLACKANDWHITE_ALPHA", 1), ("GRAYSCALE", 255), ("GRAYSCALE", 65535),
         ("GRAYSCALE_ALPHA", 255), ("GRAYSCALE_ALPHA", 4095), ("RGB", 255), ("RGB", 65535),
         ("RGB_ALPHA", 255), ("RGB_ALPHA", 65535)])]
    content = [{"type": "text", "text": "Compare these pictures."}] + [
        {"type": "image_url", "image_url": {"url": url, "detail": "low"}} for url in urls]
    before = projected(server, seer)
    reply = client.chat.completions.create(model=seer, max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": content}])
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert projected(server, seer) == before + len(urls)
    status_code, counted = call(server, "/v1/chat/completions/input_tokens",
                                {"model": seer, "messages": [{"role": "user", "content": content}]})
    assert status_code == 200 and counted["input_tokens"] == reply.usage.prompt_tokens
    assert reply.usage.prompt_tokens > len(urls) * 16


def test_three_turns_reuse_the_image_and_equal_a_cold_run(server, seer):
    """An image in turn 1: turns 2 and 3 report cached tokens covering its positions and project
    nothing; a one-byte change of the image replays and projects again; turn 3's answer equals
    the same conversation run cold (retained state trimmed first)."""
    picture = pam_url("RGB", 255, 77, size=(9, 9))
    history = [{"role": "user", "content": [{"type": "text", "text": "Look at this."},
                                            {"type": "image_url", "image_url": {"url": picture}}]}]
    before = projected(server, seer)
    answers, first_prompt = [], None
    for turn, question in enumerate(["What is it?", "And the colours?", "Anything else?"]):
        if turn:
            history.append({"role": "user", "content": question})
        status_code, out = call(server, "/v1/chat/completions", {"model": seer, "max_tokens": 5, "temperature": 0,
                                                                 "messages": history})
        assert status_code == 200, out
        if turn:
            # Everything before this turn's new text is reused, the image's positions included.
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= first_prompt
        else:
            first_prompt = out["usage"]["prompt_tokens"]
        answers.append(out)
        history.append(out["choices"][0]["message"])
    assert projected(server, seer) == before + 1
    # One byte of the image changed: turn 3 again replays from the image on, and projects it.
    import base64
    raw = bytearray(base64.b64decode(picture.split(",", 1)[1]))
    raw[-1] ^= 1
    changed = [dict(history[0], content=[history[0]["content"][0], {"type": "image_url", "image_url": {
        "url": "data:image/x-portable-arbitrarymap;base64," + base64.b64encode(bytes(raw)).decode()}}])] + history[1:-1]
    status_code, out = call(server, "/v1/chat/completions", {"model": seer, "max_tokens": 5, "temperature": 0,
                                                             "messages": changed})
    assert status_code == 200 and projected(server, seer) == before + 2
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] < first_prompt - 16
    # Cold: with retained state trimmed away, turn 3 projects again and answers as before.
    assert call(server, "/v1/devices/trim", {"device": 0, "target_bytes": 0})[0] == 200
    status_code, cold = call(server, "/v1/chat/completions", {"model": seer, "max_tokens": 5, "temperature": 0,
                                                              "messages": history[:-1]})
    assert status_code == 200 and cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert projected(server, seer) == before + 3
    assert cold["choices"][0]["message"] == answers[2]["choices"][0]["message"]


def animated_gif_url():
    import base64
    import io
    from PIL import Image
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100)
    return "data:image/gif;base64," + base64.b64encode(buf.getvalue()).decode()


def test_the_components_image_options_bound_what_it_accepts(server, towers):
    """The component's options: image_codecs switches codecs off one by one (PAM stays), and
    max_image_* bound an image before it is decoded; bad options fail the registration."""
    doc = scout("strict", towers[128], context_length=2048)
    doc["components"]["image"]["options"] = {"image_codecs": ["png", "gif"], "max_image_dimension": 64}
    assert call(server, "/v1/models/register", doc)[0] == 202
    try:
        assert wait_phase(server, "strict", ("ready", "failed"))["phase"] == "ready"
        cases = [(pillow_url("jpeg", 5), 415, "image_codec_disabled"), (pillow_url("webp", 6), 415, "image_codec_disabled"),
                 (png_url(7, size=(65, 10)), 413, "image_dimensions_too_large"), (animated_gif_url(), 415, "animated_image")]
        for url, status_code, code in cases:
            got, body = ask(server, "strict", [{"type": "image_url", "image_url": {"url": url}}])
            assert (got, body["error"]["code"]) == (status_code, code), body
            assert body["error"]["param"] == "messages[0].content[0].image_url.url"
        for url in (png_url(8), pillow_url("gif", 9, "L"), pam_url("RGB", 255, 10)):
            assert ask(server, "strict", [{"type": "image_url", "image_url": {"url": url}}])[0] == 200
    finally:
        call(server, "/v1/models/unregister", {"model": "strict"})
    for options in ({"image_codecs": ["bmp"]}, {"max_image_pixels": 0}, {"image_codecs": "png"}):
        doc = scout("unbound", towers[128])
        doc["components"]["image"]["options"] = options
        assert call(server, "/v1/models/register", doc)[0] == 202
        reg = wait_phase(server, "unbound", ("ready", "failed"))
        assert reg["phase"] == "failed" and reg["error"]["code"] == "invalid_option", reg
        call(server, "/v1/models/unregister", {"model": "unbound"})
        deadline = time.monotonic() + 30
        while registration(server, "unbound") is not None and time.monotonic() < deadline:
            time.sleep(0.1)


def test_sessions_and_checkpoints_hold_images_by_identity(server, seer):
    """A named session continues over its image without projecting it again; a checkpoint
    pinned there forks with the same image, and a history whose image differs by one byte
    does not extend it (400 history_mismatch)."""
    import base64
    picture = pam_url("RGB_ALPHA", 255, 91, size=(8, 6))
    first = [{"role": "user", "content": [{"type": "text", "text": "Keep this."},
                                          {"type": "image_url", "image_url": {"url": picture}}]}]
    session = {"X-Loom-Session": "pics"}
    status_code, one = call(server, "/v1/chat/completions", {"model": seer, "max_tokens": 4, "temperature": 0,
                                                             "messages": first}, headers=session)
    assert status_code == 200, one
    before = projected(server, seer)
    history = first + [one["choices"][0]["message"], {"role": "user", "content": "Still there?"}]
    status_code, two = call(server, "/v1/chat/completions", {"model": seer, "max_tokens": 4, "temperature": 0,
                                                             "messages": history}, headers=session)
    assert status_code == 200, two
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= one["usage"]["prompt_tokens"]
    assert projected(server, seer) == before
    status_code, pinned = call(server, "/v1/checkpoints/shot", None, headers={**session, "X-Loom-Model": seer})
    assert status_code == 201, pinned
    fork = history + [two["choices"][0]["message"], {"role": "user", "content": "And now?"}]
    status_code, three = call(server, "/v1/chat/completions", {"model": seer, "max_tokens": 4, "temperature": 0,
                                                               "messages": fork},
                              headers={"X-Loom-Session": "fork", "X-Loom-Checkpoint": "shot"})
    assert status_code == 200, three
    assert three["usage"]["prompt_tokens_details"]["cached_tokens"] >= two["usage"]["prompt_tokens"]
    assert projected(server, seer) == before
    raw = bytearray(base64.b64decode(picture.split(",", 1)[1]))
    raw[-2] ^= 1
    other = "data:image/x-portable-arbitrarymap;base64," + base64.b64encode(bytes(raw)).decode()
    edited = [dict(fork[0], content=[fork[0]["content"][0], {"type": "image_url", "image_url": {"url": other}}])] + fork[1:]
    status_code, body = call(server, "/v1/chat/completions", {"model": seer, "max_tokens": 4, "temperature": 0,
                                                              "messages": edited},
                             headers={"X-Loom-Session": "fork2", "X-Loom-Checkpoint": "shot"})
    assert status_code == 400 and body["error"]["code"] == "history_mismatch", body
    conn = server.connection(timeout=60)
    conn.request("DELETE", "/v1/checkpoints/shot", headers={"X-Loom-Model": seer})
    assert conn.getresponse().status == 200
    conn.close()
