"""POST /v1/audio/speech end to end on the default `speaker` (Piper's en_US-joe-medium through
models/vits), heard by the default `recognizer`: PROFILES' example, intelligibility (WER),
seeds, speed, every rejection, the openai SDK's streaming response, and concurrent requests
with one client that never reads."""

import http.client
import json
import socket
import threading
import time

import numpy as np
import pytest

from conftest import _start_live
from loom import demo

pytestmark = pytest.mark.skipif(demo.joe_voice_file() is None or demo.whisper_tiny_file() is None,
                                reason="the speaker and recognizer weights are not installed (make install)")
import speech  # noqa: E402

SENTENCES = ["The quick brown fox jumps over the lazy dog near the river bank.",
             "She sells fresh bread and warm coffee at the little shop on the corner.",
             "If you listen carefully, you can hear the birds singing in the garden before sunrise."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = _start_live(tmp_path_factory.mktemp("speech"), (), catalog="audio")
    deadline = time.monotonic() + 600
    while True:
        ids = {m["id"] for m in json.loads(srv.request("GET", "/v1/models")[2])["data"]}
        if {"speaker", "recognizer"} <= ids:
            break
        assert time.monotonic() < deadline, "".join(srv.stderr_lines)
        time.sleep(0.5)
    yield srv
    srv.stop()


def speak(server, body, timeout=120):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/audio/speech", json.dumps(body).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def pcm(server, text, **fields):
    status, headers, body = speak(server, dict({"model": "speaker", "input": text, "voice": "alba",
                                                "response_format": "pcm"}, **fields))
    assert status == 200, body
    assert headers["content-type"] == "audio/pcm;rate=24000;channels=1"
    assert headers.get("transfer-encoding") == "chunked"
    assert len(body) % 2 == 0
    return body


def heard(server, data):
    boundary = "b0undary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nrecognizer\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"s.pcm\"\r\n"
            "Content-Type: audio/pcm;rate=24000;channels=1\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    status, _, out = server.request("POST", "/v1/audio/transcriptions", body,
                                    {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 200, out
    return json.loads(out)["text"]


def test_profiles_example_speaks_good_day(server):
    data = pcm(server, "Good day.")
    assert 0.4 < len(data) / 2 / 24000 < 3
    text = heard(server, data)
    print(repr(text))
    assert speech.wer("Good day.", text) == 0


def test_speech_is_intelligible_to_the_recognizer(server):
    for text in SENTENCES + [" ".join(SENTENCES)]:
        got = heard(server, pcm(server, text))
        print(f"{speech.wer(text, got):.3f} {got!r}")
        assert speech.wer(text, got) < 0.1


def test_a_seed_reproduces_its_bytes_and_other_seeds_differ(server):
    a = pcm(server, SENTENCES[0], seed=7)
    assert pcm(server, SENTENCES[0], seed="7") == a
    assert pcm(server, SENTENCES[0]) == pcm(server, SENTENCES[0], seed=0)
    assert pcm(server, SENTENCES[0], seed=8) != a
    assert pcm(server, SENTENCES[0], seed=2**64 - 1) != a


def test_speed_two_gives_about_half_the_samples(server):
    normal, fast = len(pcm(server, SENTENCES[2], seed=3)), len(pcm(server, SENTENCES[2], seed=3, speed=2))
    print(normal, fast, fast / normal)
    assert 0.4 < fast / normal < 0.65        # durations are ceil()ed per phoneme: a little over half
    assert len(pcm(server, SENTENCES[2], seed=3, speed=0.5)) > 1.6 * normal


@pytest.mark.parametrize("change,code,param", [
    ({"response_format": "mp3"}, "unsupported_value", "response_format"),
    ({"response_format": "wav"}, "unsupported_value", "response_format"),
    ({"response_format": None}, "missing_field", "response_format"),
    ({"stream_format": "sse"}, "unsupported_value", "stream_format"),
    ({"voice": "nobody"}, "unsupported_value", "voice"),
    ({"voice": {"id": "nobody"}}, "unsupported_value", "voice"),
    ({"voice": {"name": "alba"}}, None, None),
    ({"voice": None}, "missing_field", "voice"),
    ({"instructions": "Speak cheerfully."}, "unsupported_value", "instructions"),
    ({"speed": 0.2}, "out_of_range", "speed"),
    ({"speed": 4.5}, "out_of_range", "speed"),
    ({"seed": -1}, None, "seed"),
    ({"seed": "12x"}, "invalid_value", "seed"),
    ({"seed": str(2**64)}, "invalid_value", "seed"),
    ({"seed": 1.5}, None, "seed"),
    ({"input": ""}, None, "input"),
    ({"input": None}, "missing_field", "input"),
    ({"model": "nobody"}, "model_not_found", "model"),
    ({"surprise": 1}, "unknown_field", "surprise"),
])
def test_rejections(server, change, code, param):
    body = {"model": "speaker", "input": "Good day.", "voice": "alba", "response_format": "pcm"}
    for k, v in change.items():
        if v is None:
            body.pop(k)
        else:
            body[k] = v
    status, headers, out = speak(server, body)
    assert status == (404 if code == "model_not_found" else 400), out
    err = json.loads(out)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err


def test_instructions_may_be_empty_and_voice_an_object(server):
    assert pcm(server, "Good day.", instructions="", voice={"id": "joe"}, stream_format="audio") == \
        pcm(server, "Good day.", voice="alba")


def test_openai_sdk_streaming_response(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://{server.host}:{server.port}/v1", api_key="unused")
    chunks = []
    with client.audio.speech.with_streaming_response.create(model="speaker", voice="alba", input="Good day.",
                                                            response_format="pcm") as response:
        for chunk in response.iter_bytes():
            chunks.append(chunk)
    assert b"".join(chunks) == pcm(server, "Good day.")


def test_concurrent_requests_and_a_client_that_never_reads(server):
    """8 requests at once, one of them never reading its response: the other seven finish,
    each equal to its solo output; the stalled one is dropped when it disconnects."""
    texts = [SENTENCES[i % 3] + (" Again." * (i // 3)) for i in range(7)]
    solo = [pcm(server, t, seed=i) for i, t in enumerate(texts)]
    stalled = socket.create_connection((server.host, server.port))
    body = json.dumps({"model": "speaker", "input": " ".join(SENTENCES * 4), "voice": "alba",
                       "response_format": "pcm"}).encode()
    stalled.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    results = [None] * 7

    def one(i):
        results[i] = pcm(server, texts[i], seed=i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    stalled.close()
    assert all(results[i] == solo[i] for i in range(7))
    deadline = time.monotonic() + 60
    while True:
        regs = json.loads(server.request("GET", "/v1/status")[2])["registrations"]
        active = next(r for r in regs if r["model"] == "speaker")["scheduler"]["active"]
        if active == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert active == 0


def test_backlog_counts_only_requests_that_have_not_had_a_step():
    """pending_capacity bounds speech requests accepted but not yet started: a request counts
    until its first sentence has been encoded, never after (unit level: the engine's count)."""
    from collections import deque
    from types import SimpleNamespace as NS
    from loom import speech as engine_module
    engine = engine_module.Engine.__new__(engine_module.Engine)
    states = [(0, "encode"), (0, "encode-running"), (0, "latents"), (1, "encode"), (0, "encode"), (2, "vocode")]
    engine.jobs = deque(NS(current=NS(index=i, state=s)) for i, s in states)
    assert engine.backlog() == 2
    engine.jobs.clear()
    assert engine.backlog() == 0


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("context", [0, 11, 40])
def test_vocode_windows_cover_the_sentence_in_the_fewest_steps(first, context):
    """windows(): contiguous cuts over [0, frames); a request's first sentence opens with the
    short FIRST_WINDOW; every later window fits one vocode step with its context, and one
    window fewer (split evenly) would not."""
    from loom import speech as engine_module
    fit = engine_module.VOCODE_FRAMES

    def spans(frames, cuts):
        return [min(frames, b + context) - max(0, a - context) for a, b in cuts]

    for frames in list(range(1, 700)) + [1023, 4096]:
        cuts = engine_module.windows(frames, first, context)
        assert cuts[0][0] == 0 and cuts[-1][1] == frames
        assert all(a < b for a, b in cuts) and all(p[1] == q[0] for p, q in zip(cuts, cuts[1:]))
        lead = first and frames > engine_module.FIRST_WINDOW
        if lead:
            assert cuts[0] == (0, engine_module.FIRST_WINDOW)
        rest = cuts[lead:]
        assert max(spans(frames, rest)) <= fit
        sizes = [b - a for a, b in rest]
        assert max(sizes) - min(sizes) <= 1
        if len(rest) > 1:
            start, n = rest[0][0], len(rest) - 1
            fewer = [start + (frames - start) * i // n for i in range(n + 1)]
            assert max(spans(frames, list(zip(fewer, fewer[1:])))) > fit


def test_requests_waiting_for_first_audio_take_the_vocode_step_first():
    """A vocode step takes the short first windows of requests that have no audio yet
    before another request's long window, which would fill the step alone (unit level)."""
    from collections import deque
    from types import SimpleNamespace as NS
    from loom import speech as engine_module

    def sentence(audible, frames):
        s = NS(state="vocode", span=lambda: (0, frames, 0, frames))
        s.job = NS(current=s, audible=audible, gone=False, finished=False, stream=NS(ready=True))
        return s
    engine = engine_module.Engine.__new__(engine_module.Engine)
    engine.turn, engine.requests = 2, 0
    talking = sentence(True, 299)
    waiting = [sentence(False, 43) for _ in range(3)]
    engine.jobs = deque(s.job for s in [talking] + waiting)
    phase, work = engine.form()
    assert phase == "vocode" and work == waiting
    assert talking.state == "vocode" and all(s.state == "vocode-running" for s in waiting)
    for s in waiting:
        s.job.audible, s.state = True, "vocode"
    _, work = engine.form()
    assert work[0] is talking and sum(s.span()[3] for s in work) <= engine_module.VOCODE_FRAMES


def test_a_sentence_longer_than_the_frame_bound_ends_its_request_alone():
    """A sentence whose durations add up to more than SENTENCE_FRAMES (the flow indexes its
    frames with int32) ends its request with 400 invalid_value on `input`; a sentence of another
    request in the same encode step goes on to latents (unit level)."""
    from types import SimpleNamespace as NS
    from loom import speech as engine_module
    ended = {}

    def sentence(name, durations):
        job = NS(voice=NS(stats=2), finish=lambda error=None: ended.update({name: error}))
        return NS(job=job, ids=[1] * len(durations), index=0, state="encode-running"), np.array(durations, np.float32)

    limit = engine_module.SENTENCE_FRAMES
    long, long_d = sentence("long", [limit // 2, limit // 2, 1])
    short, short_d = sentence("short", [3, 4, 0])
    engine = engine_module.Engine.__new__(engine_module.Engine)
    engine.apply(("encode", [long, short]), {"stats": np.zeros(2 * 3 * 2, np.float32),
                                             "durations": np.concatenate([long_d, short_d])}, None)
    assert ended["long"].status == 400 and ended["long"].param == "input" and str(limit) in str(ended["long"])
    assert long.state == "encode-running" and "short" not in ended and short.state == "latents"
