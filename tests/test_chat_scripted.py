"""Tool calls and reasoning end to end, with a scripted model.

Random weights cannot be made to reason or call tools, so this package's
`advance` emits a script: at position p it puts all the probability on
script[p]. The test measures the prompt's exact length with input_tokens and
writes the script to start right after it: the server then streams a
`<think>` block, an answer and a tool call through the real scheduler,
detokenizer and chat policy.
"""

import json
import os
import shutil

import numpy as np
import openai
import pytest

from conftest import ROOT, _start_live, tiny_scout_dir
from loom.weights import write_safetensors

CTX = 1024
SCRIPTED = f'''
module scripted kind text
spec V = shape("embed", 0)
spec MAX_PAGES = ceil(option("context_length", {CTX}), option("page_size", 16))
param embed : f32 [V, 4] = "embed"
param script : i32 [{CTX}] = "script"
kernel emit(pos: buf, last: buf, script: buf, logits: buf, R: int)
    source """
__kernel void emit(__global const int* pos, __global const int* last, __global const int* script,
                   __global float* logits, int R) {{
    int v = get_global_id(0), r = get_global_id(1);
    if (r >= R) return;
    int next = pos[last[r]] + 1;
    logits[r * V + v] = (next < {CTX} && v == script[next]) ? 10.0f : 0.0f;
}}
"""
    defines {{ V = V }}
    grid [V, R]
command advance(tokens: buf, pos: buf, row_of: buf, pages: buf, last: buf, logits: buf, T: int, R: int) {{
    emit(pos, last, script, logits, R)
}}
'''

REPLY = ('<think>The user wants the weather.</think>Checking.<tool_call>\n'
         '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>')
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scripted")
    srv = _start_live(tmp, ("--device", "cpu"), catalog="tiny")   # scout's tokenizer is the one we use
    package = tmp / "package"
    package.mkdir()
    llama_policy = open(os.path.join(ROOT, "models", "llama", "llama.loom")).read()
    policy = llama_policy[llama_policy.index("policy {"):]
    (package / "scripted.loom").write_text(SCRIPTED + "\n" + policy)
    shutil.copy(os.path.join(tiny_scout_dir(), "tokenizer.json"), tmp / "tokenizer.json")
    srv.tmp = tmp
    yield srv
    srv.stop()


def register(server, messages, tools):
    """Write a checkpoint whose script starts right after this request's prompt, and register it."""
    from loom.tokenizer import load
    tok = load(str(server.tmp / "tokenizer.json"))
    count = json.loads(server.request("POST", "/v1/chat/completions/input_tokens", body=json.dumps(
        {"model": "scout", "messages": messages, "tools": tools}).encode(),
        headers={"Content-Type": "application/json"})[2])["input_tokens"]
    reply = tok.encode(REPLY, parse_special=True)
    script = np.zeros(CTX, np.float32)
    script[count:count + len(reply)] = reply
    name = f"scripted-{len(list(server.tmp.glob('*.safetensors')))}"
    write_safetensors(server.tmp / f"{name}.safetensors", {"embed": np.zeros((tok.vocab_size, 4), np.float32),
                                                           "script": script})
    status, _, body = server.request("POST", "/v1/models/register", body=json.dumps({
        "model": name, "kind": "text", "sources": [str(server.tmp / "package" / "scripted.loom")],
        "checkpoint": str(server.tmp / f"{name}.safetensors"), "context_length": CTX,
        "options": {"chat": "chatml"}}).encode(), headers={"Content-Type": "application/json"})
    assert status == 202, body
    for _ in range(200):
        regs = json.loads(server.request("GET", "/v1/status")[2])["registrations"]
        if next(r for r in regs if r["model"] == name)["phase"] == "ready":
            return name, len(reply)
        import time
        time.sleep(0.05)
    raise AssertionError("the scripted model did not prepare")


def test_reasoning_and_tool_calls_in_a_complete_message(server):
    name, length = register(server, MESSAGES, TOOLS)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=name, messages=MESSAGES, tools=TOOLS, max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id and call.type == "function"
    assert reply.usage.completion_tokens == length            # the terminal <|im_end|> counts


def test_reasoning_and_tool_calls_streamed(server):
    name, _ = register(server, MESSAGES, TOOLS)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(model=name, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert reasoning == "The user wants the weather." and content == "Checking."
    assert len(calls) == 1 and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_none_rejects_the_generated_call(server):
    name, _ = register(server, MESSAGES, TOOLS)
    status, _, body = server.request("POST", "/v1/chat/completions", body=json.dumps(
        {"model": name, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 200}).encode(),
        headers={"Content-Type": "application/json"})
    err = json.loads(body)["error"]
    assert status == 500 and err["code"] == "invalid_tool_call" and "tool_choice is none" in err["message"]
