"""loom.template against jinja2 itself, configured as transformers' apply_chat_template
configures it (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loop controls,
tojson without ASCII escaping, raise_exception): the same text for the chat templates
checkpoints carry, for generated templates that stress whitespace control, and a clean
TemplateError for anything hostile."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from loom.template import MAX_OUTPUT, Template, TemplateError

jinja2 = pytest.importorskip("jinja2")
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402


def reference(source, **variables):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(**variables)


SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
           "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
           "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
           "{% endif %}")

# Qwen2.5's shape: tools in the system turn, tool calls as JSON, tool results grouped in one user turn.
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 3's shape: bos_token, a system turn split off the list, set/trim, an optional date.
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and tools %}
    {{- "You have access to the following functions.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Gemma's shape: roles must alternate (raise_exception), a system turn folded into the first user turn.
GEMMA = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + '

' %}{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = "" %}{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = "model" %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}{{ message['content'] | trim }}{{ '<end_of_turn>
' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model
'}}{% endif %}"""

# Qwen3's shape: a namespace updated while walking the messages backwards, string methods.
QWEN3 = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content is defined %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Plain block layout without explicit trims: trim_blocks and lstrip_blocks do all the work.
INDENTED = """{% for m in messages %}
    {% if m.role == 'system' %}
[SYS] {{ m.content }}
    {% elif m.role in ['user', 'tool'] %}
[{{ m.role | upper }}] {{ m.content }}   {# trailing spaces kept #}
    {% else %}
[BOT] {{ m.content|default('...') }}{% if not loop.last %} |{% endif %}

    {% endif %}
{% endfor %}
{% if add_generation_prompt %}[BOT]{% endif %}"""

TEMPLATES = {"smollm2": SMOLLM2, "qwen2.5": QWEN25, "llama3": LLAMA3, "gemma": GEMMA, "qwen3": QWEN3,
             "indented": INDENTED}

WEATHER = {"type": "function", "function": {"name": "weather", "description": "Météo à Paris — «now»",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}

CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "What is the capital of France?"}],
    "system and turns": [{"role": "system", "content": "  Be brief.\n"},
                         {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! "},
                         {"role": "user", "content": "名前は？ 🙂"}],
    "tool round trip": [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": "", "tool_calls": [CALL]},
                        {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "tool", "content": "sunny"},
                        {"role": "user", "content": "Thanks"}],
    "reasoning history": [{"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
                          {"role": "user", "content": "<tool_response>x</tool_response>"}],
    "two users in a row": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
}


def outcome(fn):
    """The rendered text, or "error" when rendering fails."""
    try:
        return fn()
    except (TemplateError, jinja2.exceptions.TemplateError, TypeError, ZeroDivisionError):
        return "error"


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation", [True, False])
@pytest.mark.parametrize("tools", [None, [WEATHER]])
def test_real_chat_templates_render_as_jinja2_does(template, conversation, generation, tools):
    source = TEMPLATES[template]
    variables = {"messages": CONVERSATIONS[conversation], "add_generation_prompt": generation,
                 "bos_token": "<s>", "eos_token": "</s>"}
    if tools is not None:
        variables["tools"] = tools
    want = outcome(lambda: reference(source, **variables))
    got = outcome(lambda: Template(source).render(**variables))
    assert got == want
    if template != "gemma" or conversation == "one user turn":
        assert want != "error"     # the cases exercise the templates, not only their failures


def test_the_smollm2_template_adds_its_default_system_message():
    text = Template(SMOLLM2).render(messages=CONVERSATIONS["one user turn"], add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_raise_exception_is_the_templates_own_message():
    with pytest.raises(TemplateError, match="roles must alternate"):
        Template(GEMMA).render(messages=CONVERSATIONS["two users in a row"], bos_token="")


# -- whitespace control and expressions, generated ----------------------------------------

_text = st.text(alphabet=" \t\nab{}%#-", max_size=6).filter(lambda s: "{" not in s and "#}" not in s)
_mod = st.sampled_from(["", "-", "+"])
_end = st.sampled_from(["", "-"])


@st.composite
def _piece(draw):
    kind = draw(st.sampled_from(["text", "var", "if", "for", "comment", "set"]))
    lm, rm = draw(_mod), draw(_end)
    if kind == "text":
        return draw(_text)
    if kind == "var":
        return "{{" + ("-" if lm == "-" else "") + " x " + rm + "}}"
    if kind == "comment":
        return "{#" + lm + " c " + rm + "#}"
    if kind == "set":
        return "{%" + lm + " set y = x ~ 'z' " + rm + "%}"
    body = draw(_text) + "{{ loop.index if loop is defined else y }}" + draw(_text)
    head = "if x" if kind == "if" else "for i in items"
    tail = "endif" if kind == "if" else "endfor"
    return ("{%" + lm + " " + head + " " + rm + "%}" + body + "{%" + draw(_mod) + " " + tail + " "
            + draw(_end) + "%}")


@settings(max_examples=300, deadline=None)
@given(st.lists(_piece(), max_size=8))
def test_whitespace_control_matches_jinja2(pieces):
    source = "".join(pieces)
    variables = {"x": "X", "items": ["a", "b"]}
    assert outcome(lambda: Template(source).render(**variables)) == outcome(lambda: reference(source, **variables))


EXPRESSIONS = [
    "1 + 2 * 3 - 4 // 3 % 2", "'a' ~ 1 ~ none", "[1, 2, 3][1:]", "[1, 2, 3][::-1]", "'abc'[-1]",
    "x is defined and x is string", "y is not defined", "not x == 'X'", "'X' in x", "2 not in [1, 3]",
    "{'a': 1, 'b': [1, 2]} | tojson", "items | join(', ')", "items | length", "items | first | upper",
    "'  pad ' | trim", "x if items else 'no'", "y | default('d')", "(1, 2)", "msgs | selectattr('role', 'equalto', "
    "'user') | list | length", "msgs | map(attribute='role') | join('/')", "'a,b'.split(',')", "x.lower()",
    "d.get('k', 'none')", "d.items() | list", "range(3) | list", "'%s'", "3 > 2 > 1", "-x", "1 / 0",
    "msgs[0].content.startswith('h')", "'x' * 3", "loop.index", "d.k.z", "items.0", "items[5] is defined",
    "namespace(a=1).a", "'tab\\there'", "1.5 * 2", "(items | reverse)[0]", "d | items | first", "none | string",
    "true ~ false", "[1, 'a'] | tojson(indent=2)",
]


@pytest.mark.parametrize("expr", EXPRESSIONS)
def test_expressions_match_jinja2(expr):
    source = "{{ " + expr + " }}"
    variables = {"x": "X", "items": ["a", "b"], "d": {"k": "v"},
                 "msgs": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    assert outcome(lambda: Template(source).render(**variables)) == outcome(lambda: reference(source, **variables))


# -- hostile templates ---------------------------------------------------------------------

@pytest.mark.parametrize("source", [
    "{% for i in range(10**9) %}x{% endfor %}",                       # a huge range
    "{{ 'x' * 1000000000 }}",                                          # a huge string
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",   # too many steps
    "{% set s = 'abcdefgh' %}{% for i in range(30) %}{% set s = s ~ s %}{% endfor %}{{ s }}",  # output doubling
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",              # unbounded recursion
    "{{ ''.__class__.__mro__ }}", "{{ messages.append(1) }}", "{{ x.__init__.__globals__ }}",
    "{% if %}", "{% for %}", "{{ }}", "{% endif %}", "{% if x %}", "{{ (((( }}", "{{ 1 +", "{# open",
    "{% raw %}x{% endraw %}", "{{ x | nosuchfilter }}", "{{ x is nosuchtest }}",
    "{{" + "(" * 500 + "1" + ")" * 500 + "}}", "{% if x %}" * 200 + "{% endif %}" * 200,
    "{% break %}",
])
def test_hostile_templates_fail_with_a_template_error(source):
    with pytest.raises(TemplateError):
        Template(source).render(x="X", messages=[])


def test_a_sandbox_escape_reads_nothing():
    # Attributes are mapping keys and a short list of read-only methods: dunders are undefined.
    assert Template("{{ x.__class__ }}|{{ messages.__len__ }}").render(x="X", messages=[]) == "|"


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="{}%#-+ ()[]'\"|.,:=~*abcinfore\n_0123456789", max_size=60))
def test_any_text_parses_or_fails_cleanly(source):
    try:
        out = Template(source).render(a="A", b=[1, 2], messages=[{"role": "user", "content": "c"}])
    except TemplateError:
        return
    assert isinstance(out, str) and len(out) <= MAX_OUTPUT
