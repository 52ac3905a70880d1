"""POST /v1/chat/completions on the tiny catalog's `scout` (random weights, see conftest.tiny_scout_dir)."""

import json
import socket
import threading

import openai
import pytest

from conftest import _start_live, read_response, tiny_scout_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = _start_live(tmp_path_factory.mktemp("chat"), ("--device", "cpu"), catalog="tiny")
    yield srv
    srv.stop()


def chat(server, body):
    status, _, data = server.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return status, json.loads(data)


def sse(server, body):
    """The raw SSE events of a streamed completion, parsed, ending at [DONE]."""
    sock = server.raw(timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(data), data))
    status, headers, raw = read_response(sock)
    sock.close()
    assert status == 200 and headers["content-type"] == "text/event-stream"
    events = [block[len("data: "):] for block in raw.decode().split("\n\n") if block.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


BASE = {"model": "scout", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "What is 2+2?"}], "temperature": 0}


def test_json_completion_shape_and_usage(server):
    status, body = chat(server, dict(BASE, max_tokens=12))
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["model"] == "scout" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 12 and usage["total_tokens"] == usage["prompt_tokens"] + 12


def test_stream_matches_json_and_reports_usage(server):
    status, whole = chat(server, dict(BASE, max_completion_tokens=10))
    events = sse(server, dict(BASE, max_completion_tokens=10, stream=True, stream_options={"include_usage": True}))
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == whole["choices"][0]["message"]["content"]        # temperature 0: the same tokens
    finals = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finals == ["length"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert events[-1]["choices"] == [] and {k: events[-1]["usage"][k] for k in counts} == \
        {k: whole["usage"][k] for k in counts}


def test_openai_sdk_plain_and_streaming(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="scout", messages=BASE["messages"], max_tokens=6, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model="scout", messages=BASE["messages"], max_tokens=6,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content


def test_seeded_sampling_is_reproducible_and_concurrent_clients_match_alone(server):
    body = dict(BASE, max_tokens=8, temperature=0.9, top_p=0.8, top_k=20, seed=42)
    first, second = chat(server, body)[1], chat(server, body)[1]
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    alone = chat(server, dict(BASE, max_tokens=8))[1]["choices"][0]["message"]["content"]
    results = [None] * 4

    def client(i):
        results[i] = chat(server, dict(BASE, max_tokens=8))[1]["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [alone] * 4


@pytest.mark.parametrize("change,status,code", [
    ({"max_tokens": 4, "max_completion_tokens": 4}, 400, "invalid_value"),
    ({"stream_options": {"include_usage": True}}, 400, "invalid_value"),
    ({"tool_choice": "required"}, 400, "unsupported_value"),
    ({"temperature": 3.5}, 400, "out_of_range"),
    ({"max_tokens": 0}, 400, "out_of_range"),
    ({"max_tokens": 513}, 400, "out_of_range"),              # over limits.max_output_tokens (512)
    ({"max_completion_tokens": 16384}, 400, "out_of_range"),
    ({"messages": []}, 400, "invalid_value"),
    ({"logprobs": True}, 400, "unknown_field"),
    ({"store": True}, 400, "unsupported_value"),
    ({"model": "vectors"}, 404, "model_not_found"),
])
def test_rejections(server, change, status, code):
    got_status, body = chat(server, dict(BASE, **change))
    assert (got_status, body["error"]["code"]) == (status, code), body


def test_disconnect_mid_stream_frees_the_row(server):
    sock = server.raw(timeout=30)
    data = json.dumps(dict(BASE, max_tokens=200, stream=True)).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(data), data))
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    assert chat(server, dict(BASE, max_tokens=4))[0] == 200
    regs = json.loads(server.request("GET", "/v1/status")[2])["registrations"]
    scout = next(r for r in regs if r["model"] == "scout")
    assert scout["requests"]["in_flight"] == 0


def test_input_tokens_counts_exactly_what_generation_uses(server):
    status, count = (lambda r: (r[0], json.loads(r[2])))(server.request(
        "POST", "/v1/chat/completions/input_tokens", body=json.dumps(dict(BASE, stream=True)).encode(),
        headers={"Content-Type": "application/json"}))
    assert status == 200 and set(count) == {"input_tokens"}
    generated = chat(server, dict(BASE, max_tokens=1))[1]
    assert count["input_tokens"] == generated["usage"]["prompt_tokens"]
    for header in ("X-Loom-Session", "X-Loom-Checkpoint"):
        status, _, body = server.request("POST", "/v1/chat/completions/input_tokens", body=json.dumps(BASE).encode(),
                                         headers={"Content-Type": "application/json", header: "s1"})
        assert status == 400 and json.loads(body)["error"]["code"] == "unsupported_header"
    status, _, body = server.request("POST", "/v1/chat/completions/input_tokens", body=json.dumps(
        dict(BASE, max_tokens=2, max_completion_tokens=2)).encode(), headers={"Content-Type": "application/json"})
    assert status == 400
    models = {m["id"]: m for m in json.loads(server.request("GET", "/v1/models")[2])["data"]}
    loom = models["scout"]["loom"]
    assert loom["input_tokens"] is True and loom["tokenize"] is True
    assert loom["context_length"] == 4096 and loom["limits"] == {"max_output_tokens": 512}


def test_tools_are_rendered_and_tool_choice_none_is_accepted(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = json.loads(server.request("POST", "/v1/chat/completions/input_tokens", body=json.dumps(
        dict(BASE, tools=tools)).encode(), headers={"Content-Type": "application/json"})[2])["input_tokens"]
    without = json.loads(server.request("POST", "/v1/chat/completions/input_tokens", body=json.dumps(
        BASE).encode(), headers={"Content-Type": "application/json"})[2])["input_tokens"]
    assert with_tools > without                                     # the catalog is in the prompt
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="scout", messages=BASE["messages"], tools=tools, tool_choice="none",
                                           max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    bad = [{"type": "function", "function": {"name": ""}}]
    assert chat(server, dict(BASE, tools=bad))[0] == 400
    assert chat(server, dict(BASE, model_options={"unknown": 1}))[1]["error"]["code"] == "unknown_field"


def test_concurrent_streams_of_different_lengths_equal_their_solo_outputs(server):
    prompts = [f"Question number {i}: " + "tell me more. " * i for i in range(8)]
    bodies = [dict(BASE, messages=[{"role": "user", "content": p}], max_tokens=4 + 2 * i, stream=True)
              for i, p in enumerate(prompts)]
    solo = ["".join(e["choices"][0]["delta"].get("content", "") for e in sse(server, b) if e["choices"])
            for b in bodies]
    together = [None] * 8

    def client(i):
        together[i] = "".join(e["choices"][0]["delta"].get("content", "") for e in sse(server, bodies[i])
                              if e["choices"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert together == solo


def test_a_slow_reader_does_not_slow_the_others(server):
    import socket as socketlib
    slow = socketlib.socket()
    slow.setsockopt(socketlib.SOL_SOCKET, socketlib.SO_RCVBUF, 4096)
    slow.settimeout(30)
    slow.connect((server.host, server.port))
    data = json.dumps(dict(BASE, max_tokens=250, stream=True)).encode()
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(data), data))
    # The slow client reads nothing; others are served meanwhile.
    for _ in range(3):
        assert chat(server, dict(BASE, max_tokens=8))[0] == 200
    status, _, body = read_response(slow)     # and it still gets its whole stream when it reads
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
    slow.close()


def test_a_follow_up_turn_reuses_the_idle_row(server):
    messages = [{"role": "user", "content": "Name a color and a shape, please."}]
    first = chat(server, dict(BASE, messages=messages, max_tokens=8))[1]
    assert "cached_tokens" in first["usage"]["prompt_tokens_details"]
    follow = messages + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And another?"}]
    second = chat(server, dict(BASE, messages=follow, max_tokens=4))[1]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens"] <= cached < second["usage"]["prompt_tokens"]
    events = sse(server, dict(BASE, messages=follow, max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0   # streamed usage reports it too


def test_unregister_abort_ends_a_running_stream_with_an_error_event(server, tmp_path):
    from loom import demo
    doc = {"model": "scout2", "kind": "text", "sources": ["llama.loom"], "checkpoint": tiny_scout_dir(),
           "base_directory": demo.MODELS + "/llama", "rows": 2, "context_length": 4096, "max_output_tokens": 4000}
    assert server.request("POST", "/v1/models/register", body=json.dumps(doc).encode(),
                          headers={"Content-Type": "application/json"})[0] == 202
    import time
    for _ in range(200):
        regs = json.loads(server.request("GET", "/v1/status")[2])["registrations"]
        if next(r for r in regs if r["model"] == "scout2")["phase"] == "ready":
            break
        time.sleep(0.05)
    sock = server.raw(timeout=30)
    data = json.dumps({"model": "scout2", "messages": [{"role": "user", "content": "go"}], "max_tokens": 3900,
                       "stream": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(data), data))
    # Generating once its first chunk arrives (peeked, so read_response still sees the whole body);
    # 3900 tokens take seconds even on the fastest driver, so the abort lands mid-stream.
    deadline = time.monotonic() + 30
    while b'"delta"' not in sock.recv(1 << 16, socket.MSG_PEEK) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.request("POST", "/v1/models/unregister", body=json.dumps({"model": "scout2", "mode": "abort"}).encode(),
                          headers={"Content-Type": "application/json"})[0] == 202
    status, _, body = read_response(sock)          # the stream ends, with the withdrawal as its last event
    assert status == 200 and b'"code":"model_unregistered"' in body.rstrip().split(b"\n\n")[-1]
    sock.close()
    for _ in range(100):
        if not any(r["model"] == "scout2" for r in json.loads(server.request("GET", "/v1/status")[2])["registrations"]):
            break
        time.sleep(0.05)
    assert not any(r["model"] == "scout2" for r in json.loads(server.request("GET", "/v1/status")[2])["registrations"])


def test_named_session_turns_reuse_their_history(server):
    def turn(messages, session, tokens=6):
        status, _, body = server.request("POST", "/v1/chat/completions", body=json.dumps(
            dict(BASE, messages=messages, max_tokens=tokens)).encode(),
            headers={"Content-Type": "application/json", "X-Loom-Session": session})
        return status, json.loads(body)

    messages = [{"role": "user", "content": "A session about colors."}]
    status, first = turn(messages, "colors-1")
    assert status == 200
    for i in range(4):                                   # other traffic takes every row meanwhile
        chat(server, dict(BASE, messages=[{"role": "user", "content": f"noise {i}"}], max_tokens=3))
    follow = messages + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "More?"}]
    status, second = turn(follow, "colors-1")
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    status, body = turn(messages, "bad name!")
    assert status == 400 and body["error"]["param"] == "X-Loom-Session"
    status, other = turn(follow, "colors-2")               # sessions are separate histories
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_sessions_inspection(server, live_server):
    server.request("POST", "/v1/chat/completions", body=json.dumps(dict(BASE, max_tokens=2)).encode(),
                   headers={"Content-Type": "application/json", "X-Loom-Session": "inspect-me"})
    listing = json.loads(server.request("GET", "/v1/sessions?limit=100")[2])
    mine = [s for s in listing["data"] if s["session"] == "inspect-me"]
    assert mine and mine[0]["model"] == "scout" and mine[0]["state"] == "idle" and mine[0]["pages"] >= 1
    assert server.request("GET", "/v1/sessions?limit=101")[0] == 400
    bare = live_server()                                   # no text deployment at all
    assert bare.request("GET", "/v1/sessions")[0] == 501


def test_status_shows_the_scheduler(server):
    chat(server, dict(BASE, max_tokens=2))
    regs = json.loads(server.request("GET", "/v1/status")[2])["registrations"]
    sched = next(r for r in regs if r["model"] == "scout")["scheduler"]
    assert sched["rows"] == 4 and sched["active"] == 0 and sched["steps"] > 0
    assert 0 < sched["pages"]["free"] <= sched["pages"]["total"] and sched["pages"]["page_size"] == 16


def test_input_tokens_waits_behind_a_drained_model(server):
    """The drain policy applies to counting too: the count queues until admission reopens."""
    import time
    answered = {}

    def count():
        answered["r"] = server.request("POST", "/v1/chat/completions/input_tokens", body=json.dumps(BASE).encode(),
                                       headers={"Content-Type": "application/json"})
    drain = json.dumps({"model": "scout"}).encode()
    assert server.request("POST", "/v1/models/drain", body=drain, headers={"Content-Type": "application/json"})[0] == 200
    waiter = threading.Thread(target=count)
    waiter.start()
    time.sleep(0.3)
    assert not answered
    assert server.request("POST", "/v1/models/undrain", body=drain,
                          headers={"Content-Type": "application/json"})[0] == 200
    waiter.join(10)
    assert answered["r"][0] == 200 and json.loads(answered["r"][2])["input_tokens"] > 0


def test_max_output_tokens_is_the_limit_and_the_default(server):
    for field in ("max_tokens", "max_completion_tokens"):
        status, body = chat(server, dict(BASE, **{field: 513}))
        assert status == 400 and body["error"]["param"] == field and "512" in body["error"]["message"], body
    status, body = chat(server, dict(BASE, max_tokens=512))
    assert status == 200 and body["usage"]["completion_tokens"] <= 512
    status, body = chat(server, BASE)                        # omitted: the deployment default, 512
    assert status == 200 and body["usage"]["completion_tokens"] <= 512


def test_reasoning_content_is_present_when_thinking_is_on(server):
    """A reasoning-aware deployment with thinking enabled always carries reasoning_content
    (null when nothing was reasoned); with thinking off the key is absent."""
    status, body = chat(server, dict(BASE, max_tokens=6, enable_thinking=True))
    message = body["choices"][0]["message"]
    assert status == 200 and "reasoning_content" in message
    assert message["reasoning_content"] is None or isinstance(message["reasoning_content"], str)
    status, body = chat(server, dict(BASE, max_tokens=6, enable_thinking=False))
    assert status == 200 and "reasoning_content" not in body["choices"][0]["message"]
    status, _, data = server.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                     body=json.dumps(dict(BASE, max_tokens=6, enable_thinking=True,
                                                          stream=True)).encode())
    chunks = [json.loads(line[6:]) for line in data.decode().splitlines()
              if line.startswith("data: {")]
    reasoned = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"])
    final = chunks[-1]["choices"][0]
    assert final["finish_reason"] is not None
    assert reasoned or ("reasoning_content" in final["delta"] and final["delta"]["reasoning_content"] is None)


def test_stop_strings_end_the_text_before_them_in_json_and_sse(server):
    """OpenAI's `stop`: the answer ends right before the first stop string, which is never
    published (not even split across tokens or SSE deltas); finish_reason is stop."""
    body = dict(BASE, max_tokens=32, temperature=0)
    status, whole = chat(server, body)
    assert status == 200
    text = whole["choices"][0]["message"]["content"]
    assert len(text) > 12, text
    for start, width in ((4, 3), (len(text) // 2, 5), (1, 1)):
        stop = text[start:start + width]
        want = text[:text.find(stop)]
        for stops in (stop, ["never-in-this-text-\u2603", stop]):
            status, got = chat(server, dict(body, stop=stops))
            assert status == 200, got
            assert got["choices"][0]["message"]["content"] == want
            assert got["choices"][0]["finish_reason"] == "stop"
            assert got["usage"]["completion_tokens"] <= whole["usage"]["completion_tokens"]
            events = sse(server, dict(body, stop=stops, stream=True))
            deltas = [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]
            assert "".join(deltas) == want and events[-1]["choices"][0]["finish_reason"] == "stop"
    # A stop string that never occurs changes nothing.
    status, same = chat(server, dict(body, stop=["never-in-this-text-\u2603"]))
    assert same["choices"][0]["message"]["content"] == text
    assert same["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


@pytest.mark.parametrize("stop", ["", [], ["a"] * 5, 7, [""], ["x" * 1025]])
def test_stop_rejections(server, stop):
    status, body = chat(server, dict(BASE, stop=stop))
    assert status == 400 and body["error"]["param"].startswith("stop"), body


def test_stop_with_tools_and_a_named_session(server):
    """A stop string with tools offered and on a named session: the stopped turn keeps the
    session usable, and its next turn answers."""
    tool = {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                             "parameters": {"type": "object", "properties": {}}}}
    body = dict(BASE, max_tokens=24, tools=[tool])
    status, whole = chat(server, body)
    text = whole["choices"][0]["message"]["content"] or ""
    assert status == 200 and len(text) > 6, whole
    stop = text[3:6]
    status, _, raw = server.request("POST", "/v1/chat/completions", body=json.dumps(dict(body, stop=stop)).encode(),
                                    headers={"Content-Type": "application/json", "X-Loom-Session": "stopper"})
    got = json.loads(raw)
    assert status == 200 and got["choices"][0]["message"]["content"] == text[:text.find(stop)]
    assert got["choices"][0]["finish_reason"] == "stop"
    # The message as it came back (reasoning_content included) is valid history for the next turn.
    follow = dict(body, messages=body["messages"] + [got["choices"][0]["message"], {"role": "user", "content": "And?"}])
    conn = server.connection(timeout=120)      # a new prompt length may compile new kernels first
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(follow).encode(),
                     headers={"Content-Type": "application/json", "X-Loom-Session": "stopper"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
    finally:
        conn.close()


def test_the_openai_sdk_sends_back_the_message_it_got(server):
    """A multi-turn SDK client appends the returned message (reasoning_content, refusal and
    tool_calls as None included): the next turn is accepted."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)
    messages = [{"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model="scout", messages=messages, max_tokens=4, temperature=0)
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "Again?"}]
    second = client.chat.completions.create(model="scout", messages=messages, max_tokens=4, temperature=0)
    assert second.choices[0].finish_reason in ("length", "stop")
