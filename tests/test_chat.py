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


# A system turn, a question, the assistant's tool call and the tool's result.
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, clear"},
]


def test_chatml_framing_with_tools_and_a_tool_round_trip():
    policy = ChatPolicy(POLICY, choice="chatml")
    messages = ROUND_TRIP
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


LLAMA3_TEMPLATE = ("{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + "
                   "'<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
                   "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
                   "{%- endif %}")


def test_llama3_framing_and_detection():
    detected = ChatPolicy(POLICY, chat_template=LLAMA3_TEMPLATE, special=("<|begin_of_text|>", "<|eot_id|>"))
    assert detected.name == "llama3" and detected.template is not None
    want = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert detected.render([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]) == want
    # The package's own roles frame it identically when the checkpoint brings no template.
    assert ChatPolicy(POLICY, choice="llama3").render([{"role": "user", "content": "Hi"}]) == want
    with pytest.raises(ChatError) as info:
        detected.render([{"role": "user", "content": "x"}], tools=[WEATHER])
    assert Error.of(info.value).status == 400 and info.value.param == "tools"
    with pytest.raises(ChatError):
        detected.render([{"role": "user", "content": "x"}], enable_thinking=True)
    assert ChatPolicy(POLICY).name == "chatml"  # no template to detect from: the first format


# SmolLM2's own template (its GGUF's tokenizer.chat_template): ChatML with a default system message.
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
           "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
           "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
           "{% endif %}")
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def test_the_checkpoint_template_frames_the_chat_with_its_default_system_message():
    policy = ChatPolicy(POLICY, chat_template=SMOLLM2, choice="chatml")
    user = {"role": "user", "content": "What is the capital of France?"}
    assert policy.render([user], enable_thinking=True) == (
        DEFAULT_SYSTEM + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    system = {"role": "system", "content": "Be brief."}
    assert policy.render([system, user], enable_thinking=True, generation=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")
    # Thinking off: the package's disabled-reasoning suffix follows the template's generation prompt.
    assert policy.render([user], enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_template_without_tools_gets_the_packages_tool_grammar():
    policy = ChatPolicy(POLICY, chat_template=SMOLLM2, choice="chatml")
    roles = ChatPolicy(POLICY, choice="chatml")
    messages = ROUND_TRIP
    # Same text as the package's own ChatML roles: preamble in the system turn, the call in the
    # package's grammar, the result as a <tool_response> user turn.
    assert policy.render(messages, tools=[WEATHER], enable_thinking=False) == \
        roles.render(messages, tools=[WEATHER], enable_thinking=False)
    # No system message: the catalog becomes the system turn, replacing the template's default.
    text = policy.render(messages[1:2], tools=[WEATHER], enable_thinking=True)
    assert text.startswith("<|im_start|>system\n# Tools\n") and "SmolLM" not in text


def test_a_template_that_frames_tools_gets_them_natively():
    template = ("{%- if tools %}{{- '<|im_start|>system\nTOOLS:' }}{%- for t in tools %}{{- ' ' + t.function.name }}"
                "{%- endfor %}{{- '<|im_end|>\n' }}{%- endif %}{%- for m in messages %}"
                "{%- if m.tool_calls %}{{- '<|im_start|>assistant\nCALL ' + m.tool_calls[0].function.name + ' ' + "
                "m.tool_calls[0].function.arguments | tojson + '<|im_end|>\n' }}"
                "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
                "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
    policy = ChatPolicy(POLICY, chat_template=template, choice="chatml")
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c", "content": "cold"}]
    assert policy.render(messages, tools=[WEATHER], enable_thinking=True) == (
        "<|im_start|>system\nTOOLS: get_weather<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\nCALL get_weather {\"city\": \"Oslo\"}<|im_end|>\n<|im_start|>tool\ncold<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_a_template_that_fails_or_cannot_parse():
    raising = "{{ raise_exception('Only user turns, please') if messages[0].role != 'user' }}ok"
    policy = ChatPolicy(POLICY, chat_template=raising, choice="chatml")
    with pytest.raises(ChatError) as info:
        policy.render([{"role": "system", "content": "x"}])
    assert Error.of(info.value).status == 400 and info.value.param == "messages"
    assert "Only user turns, please" in str(info.value)
    broken = ChatPolicy(POLICY, chat_template="<|im_start|>{% for %}", choice="chatml")
    assert broken.template is None and "offset 12" in broken.template_problem
    assert broken.render([{"role": "user", "content": "Hi"}], enable_thinking=True) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"    # the package's roles


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
    # The stop that completes first in the text (the earliest end; at one end, the longest).
    found = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    assert out == (text[:min(found)[1]] if found else text)
    assert stopper.hit == bool(found)
