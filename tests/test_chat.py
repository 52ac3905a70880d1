"""The chat policy runtime on the llama package's policy: framing and output parsing."""

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import ROOT
from loom import language
from loom.chat import ChatError, ChatPolicy, ToolCallError
from loom.errors import Error

POLICY = language.load(os.path.join(ROOT, "models", "llama", "llama.loom")).policy

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_chatml_framing_with_tools_and_a_tool_round_trip():
    policy = ChatPolicy(POLICY, choice="chatml")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, clear"},
    ]
    text = policy.render(messages, tools=[WEATHER], enable_thinking=False)
    tools_block = ('{"type": "function", "function": {"name": "get_weather", "description": "Current weather", '
                   '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}')
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + tools_block + "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
        "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C, clear\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert policy.stop == ["<|im_end|>", "<|endoftext|>"]


def test_llama3_framing_and_detection():
    detected = ChatPolicy(POLICY, chat_template="{{ '<|start_header_id|>' + role }}")
    assert detected.name == "llama3"
    text = detected.render([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    with pytest.raises(ChatError) as info:
        detected.render([{"role": "user", "content": "x"}], tools=[WEATHER])
    assert Error.of(info.value).status == 400 and info.value.param == "tools"
    with pytest.raises(ChatError):
        detected.render([{"role": "user", "content": "x"}], enable_thinking=True)
    assert ChatPolicy(POLICY).name == "chatml"  # no template to detect from: the first format


def feed_all(parser, pieces):
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    deltas += parser.close()
    merged = {}
    for kind, text in deltas:
        merged[kind] = merged.get(kind, "") + text
    return merged


@pytest.mark.parametrize("split", [1, 2, 3, 7, 1000])
def test_reasoning_content_and_tool_calls_parse_across_any_split(split):
    text = ('<think>The user wants weather.</think>Let me check.<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    parser = ChatPolicy(POLICY, choice="chatml").parser(enable_thinking=True)
    merged = feed_all(parser, [text[i:i + split] for i in range(0, len(text), split)])
    assert merged == {"reasoning": "The user wants weather.", "content": "Let me check."}
    assert parser.calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]


def test_partial_markers_are_held_back_not_published():
    parser = ChatPolicy(POLICY, choice="chatml").parser(enable_thinking=False)
    assert parser.feed("Hello <tool") == [("content", "Hello ")]
    assert parser.feed("s are fun") == [("content", "<tools are fun")]


@pytest.mark.parametrize("text,message", [
    ("<tool_call>\n{not json}\n</tool_call>", "not valid JSON"),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', "needs a name"),
    ('<tool_call>\n{"name": "x", "arguments": {"a"', "ended inside a tool call"),
])
def test_invalid_tool_syntax_fails_instead_of_publishing(text, message):
    parser = ChatPolicy(POLICY, choice="chatml").parser(enable_thinking=False)
    with pytest.raises(ToolCallError, match=message):
        parser.feed(text)
        parser.close()
    assert parser.calls == []


def test_tool_choice_none_rejects_a_generated_call():
    parser = ChatPolicy(POLICY, choice="chatml").parser(enable_thinking=False, tools_allowed=False)
    with pytest.raises(ToolCallError, match="tool_choice is none"):
        parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')


def test_model_options_are_validated_and_rendered_where_the_format_declares():
    import copy
    policy_doc = copy.deepcopy(POLICY)
    policy_doc["chats"]["chatml"]["model_options"] = {
        "effort": {"type": "string", "enum": ["low", "high"], "system": "Reasoning: {value}"},
        "budget": {"type": "integer", "generation": "<budget {value}>"}}
    policy = ChatPolicy(policy_doc, choice="chatml")
    text = policy.render([{"role": "user", "content": "Hi"}], enable_thinking=True,
                         model_options={"effort": "high", "budget": 64})
    assert text == ("<|im_start|>system\nReasoning: high<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n<budget 64>")
    assert policy.render([{"role": "user", "content": "Hi"}], enable_thinking=True) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"                  # omitted: nothing rendered
    for options, code, param in (({"effort": "medium"}, "invalid_value", "model_options.effort"),
                                 ({"budget": "64"}, "invalid_value", "model_options.budget"),
                                 ({"budget": True}, "invalid_value", "model_options.budget"),
                                 ({"other": 1}, "unknown_field", "model_options.other")):
        with pytest.raises(ChatError) as info:
            policy.options(options)
        error = Error.of(info.value)
        assert (error.status, error.code, error.param) == (400, code, param)
    with pytest.raises(ChatError):                          # a format that declares none takes none
        ChatPolicy(POLICY, choice="chatml").options({"effort": "high"})


@given(st.text(alphabet="ab\u00e9 \n", max_size=40), st.lists(st.text(alphabet="ab\u00e9 ", min_size=1, max_size=4),
                                                           min_size=1, max_size=4), st.data())
def test_stop_text_finds_the_first_stop_wherever_the_chunks_split(text, stops, data):
    from loom.chat import StopText
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    stopper = StopText(stops)
    out = "".join(stopper.push(c) for c in chunks) + stopper.flush()
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    assert out == (text[:min(found)] if found else text)
    assert stopper.hit == bool(found)
