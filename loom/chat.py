"""Chat policy runtime: render a conversation to the package's framing, parse what
the model generates back into content, reasoning and tool calls.

Everything model-specific is data in the package's `policy` (see
models/llama/llama.loom): role templates, the generation prompt, stop strings,
reasoning markers, the tool catalog's framing and the tool-call grammar, and
sampling defaults and ranges. A package may carry several chat formats under
`policy.chats`; the model document's `options.chat` picks one, and otherwise
the format whose `detect` marker appears in the checkpoint's own chat template
(GGUF `tokenizer.chat_template`) wins, then the first.

A format with `"template": "checkpoint"` renders the messages with the
checkpoint's own Jinja chat template when it has one (loom.template, exactly
as transformers would), keeping the package's reasoning and tool-call grammar:
a template that does not frame tools itself gets the package's tool preamble
in its system message, tool calls in the package's grammar and tool results
as `tools.response` says.

Rendering is canonical: the same messages always give the same text, which
is what retained-conversation reuse will key on.
"""

import json

from .errors import Problem
from .template import Template, TemplateError


class ChatError(Problem):
    """A conversation this chat policy cannot frame (errors.STATUS gives its status)."""


ROLES = ("system", "user", "assistant", "tool")


class ChatPolicy:
    def __init__(self, policy, chat_template=None, choice=None, special=("", "")):
        chats = policy.get("chats") or {}
        if not chats:
            raise ValueError("the package policy declares no chat formats (policy.chats)")
        if choice is None:
            choice = next((name for name, fmt in chats.items()
                           if chat_template and fmt.get("detect") and fmt["detect"] in chat_template), None)
        name = choice or next(iter(chats))
        if name not in chats:
            raise ValueError(f"unknown chat format {name!r}; the package has {', '.join(chats)}")
        self.name = name
        self.format = chats[name]
        self.sampling = policy.get("sampling", {})
        self.reasoning = self.format.get("reasoning")
        self.tools = self.format.get("tools")
        self.stop = list(self.format.get("stop", []))
        # The checkpoint's template, when the format defers to it; one that cannot be parsed
        # leaves the format's own roles in charge (template_problem says why).
        self.template, self.template_problem = None, None
        if self.format.get("template") == "checkpoint" and chat_template:
            try:
                self.template = Template(chat_template)
            except TemplateError as e:
                self.template_problem = str(e)
        self.bos_token, self.eos_token = special

    # -- input -------------------------------------------------------------------
    def options(self, values):
        """Validate model_options against the format's declarations -> {name: value}.
        A declaration is {"type": "boolean"|"string"|"integer"|"number", "enum": [...],
        "system": "... {value} ...", "generation": "... {value} ..."}: where its text goes."""
        declared = self.format.get("model_options") or {}
        for name, value in (values or {}).items():
            rule = declared.get(name) if isinstance(declared, dict) else None
            if rule is None:
                raise ChatError(f"model_options.{name} is not understood by this model's policy", "unknown_field",
                                f"model_options.{name}")
            kind = rule.get("type")
            ok = {"boolean": lambda v: isinstance(v, bool), "string": lambda v: isinstance(v, str),
                  "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
                  "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}.get(kind,
                                                                                                 lambda v: True)
            if not ok(value) or ("enum" in rule and value not in rule["enum"]):
                allowed = f"one of {rule['enum']}" if "enum" in rule else f"a {kind}"
                raise ChatError(f"model_options.{name} must be {allowed}", "invalid_value", f"model_options.{name}")
        return dict(values or {})

    def _option_text(self, values, where):
        declared = self.format.get("model_options") or {}
        return "".join(declared[name][where].replace("{value}", json.dumps(value) if not isinstance(value, str)
                                                     else value)
                       for name, value in values.items() if where in declared[name])

    def render(self, messages, tools=None, enable_thinking=None, generation=True, model_options=None):
        """Messages (validated) -> the prompt text, framing included; model_options
        (validated by options()) render where the format declares them."""
        fmt = self.format
        options = self.options(model_options)
        if self.template is not None:
            return self._render_template(messages, tools, enable_thinking, generation, options)
        parts = [fmt.get("bos", "")]
        system = [m for m in messages if m["role"] == "system"]
        rest = [m for m in messages if m["role"] != "system"]
        system_text = "\n\n".join(_text(m["content"]) for m in system) + self._option_text(options, "system")
        if tools:
            if not self.tools:
                raise ChatError("this model's chat format has no tool calling", "unsupported_value", "tools")
            catalog = "\n".join(json.dumps(t, ensure_ascii=False, separators=(", ", ": ")) for t in tools)
            preamble = self.tools["preamble"].replace("{tools}", catalog)
            system_text = f"{system_text}\n\n{preamble}" if system_text else preamble
        if system_text or fmt.get("default_system") is not None:
            parts.append(fmt["roles"]["system"].replace("{content}", system_text or fmt.get("default_system", "")))
        for m in rest:
            parts.append(fmt["roles"][m["role"]].replace("{content}", self._content(m)))
        if generation:
            parts.append(fmt["generation"] + self._option_text(options, "generation"))
            thinking = self._thinking(enable_thinking)
            if thinking is False and self.reasoning and self.reasoning.get("disabled"):
                parts.append(self.reasoning["disabled"])
        return "".join(parts)

    def _render_template(self, messages, tools, enable_thinking, generation, options):
        """The checkpoint's template over the messages, with what the package adds around it."""
        source = self.template.source
        native_tools = "tools" in source      # the template frames the catalog and calls itself
        response = (self.tools or {}).get("response")
        shown = []
        for m in messages:
            item = {"role": m["role"], "content": _text(m.get("content") or "")}
            if m["role"] == "assistant" and m.get("tool_calls"):
                if native_tools:
                    item["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                           "function": {"name": c["function"]["name"],
                                                        "arguments": _arguments(c["function"]["arguments"])}}
                                          for c in m["tool_calls"]]
                else:
                    item["content"] = self._content(m)
            elif m["role"] == "tool":
                if m.get("tool_call_id") is not None:
                    item["tool_call_id"] = m["tool_call_id"]
                if not native_tools and response:
                    item = {"role": response["role"], "content": response["content"].replace("{content}",
                                                                                              item["content"])}
            shown.append(item)
        variables = {"messages": shown, "add_generation_prompt": generation,
                     "bos_token": self.bos_token, "eos_token": self.eos_token}
        preamble = ""
        if tools:
            if native_tools:
                variables["tools"] = tools
            elif not self.tools:
                raise ChatError("this model's chat format has no tool calling", "unsupported_value", "tools")
            else:
                catalog = "\n".join(json.dumps(t, ensure_ascii=False, separators=(", ", ": ")) for t in tools)
                preamble = self.tools["preamble"].replace("{tools}", catalog)
        # What the package adds to the system turn, as the roles path adds it: option text, then the catalog.
        options_text = self._option_text(options, "system")
        if options_text or preamble:
            has_system = bool(shown) and shown[0]["role"] == "system"
            system = (shown[0]["content"] if has_system else "") + options_text
            system = f"{system}\n\n{preamble}" if system and preamble else system or preamble
            if has_system:
                shown[0] = {"role": "system", "content": system}
            else:
                shown.insert(0, {"role": "system", "content": system})
        thinking = self._thinking(enable_thinking)
        template_thinks = "enable_thinking" in source
        if template_thinks and thinking is not None:
            variables["enable_thinking"] = thinking
        for name, value in options.items():
            variables.setdefault(name, value)
        try:
            text = self.template.render(**variables)
        except TemplateError as e:
            raise ChatError(f"the model's chat template cannot frame these messages: {e}", "invalid_value",
                            "messages") from None
        if generation:
            text += self._option_text(options, "generation")
            if thinking is False and not template_thinks and self.reasoning and self.reasoning.get("disabled"):
                text += self.reasoning["disabled"]
        return text

    def _thinking(self, enable_thinking):
        if enable_thinking is None:
            return self.reasoning.get("default", True) if self.reasoning else None
        if not self.reasoning:
            if enable_thinking:
                raise ChatError("this model does not support reasoning", "unsupported_value", "enable_thinking")
            return None
        return enable_thinking

    def _content(self, message):
        if message["role"] == "assistant":
            text = _text(message.get("content") or "")
            for call in message.get("tool_calls") or []:
                fn = call["function"]
                body = json.dumps({"name": fn["name"], "arguments": _arguments(fn["arguments"])}, ensure_ascii=False)
                text += ("\n" if text else "") + self.tools["open"] + body + self.tools["close"] if self.tools \
                    else body
            return text
        return _text(message["content"])

    # -- output ------------------------------------------------------------------
    def parser(self, enable_thinking=None, tools_allowed=True):
        return OutputParser(self, self._thinking(enable_thinking), tools_allowed)


def _arguments(arguments):
    """A tool call's arguments as templates expect them: an object, not its JSON text."""
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        raise ChatError("tool call arguments must be a JSON object", "invalid_value",
                        "messages.tool_calls.function.arguments") from None


def _text(content):
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


class ToolCallError(Problem):
    """Generated text that opened a tool call but is not a valid one."""

    code = "invalid_tool_call"


class OutputParser:
    """Splits generated text into reasoning, answer content and tool calls.

    feed(text) returns the deltas that are safe to publish now: a marker that
    may still be forming (say "<too" of "<tool_call>") is held back until the
    next text decides. Tool calls are published only whole and valid."""

    def __init__(self, policy, thinking, tools_allowed):
        self.policy = policy
        self.reasoning_markers = policy.reasoning if thinking else None
        self.in_reasoning = bool(thinking and policy.reasoning and policy.reasoning.get("starts_open"))
        self.tools = policy.tools
        self.tools_allowed = tools_allowed
        self.pending = ""
        self.call = None          # text of a tool call being collected
        self.calls = []
        self.content = []
        self.reasoning = []

    def feed(self, text):
        """-> list of ("content" | "reasoning", text) deltas."""
        self.pending += text
        out = []
        while self.pending:
            if self.call is not None:
                end = self.pending.find(self.tools["close"])
                if end < 0:
                    keep = _partial(self.pending, self.tools["close"])  # the marker may be arriving
                    self.call += self.pending[:len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                self.call += self.pending[:end]
                self.pending = self.pending[end + len(self.tools["close"]):]
                self._finish_call()
                continue
            markers = []
            if self.reasoning_markers:
                markers.append(self.reasoning_markers["close" if self.in_reasoning else "open"])
            if self.tools and not self.in_reasoning:
                markers.append(self.tools["open"])
            hit = min(((self.pending.find(m), m) for m in markers if m in self.pending), default=None)
            if hit is None:
                keep = max((_partial(self.pending, m) for m in markers), default=0)
                if len(self.pending) > keep:
                    out.append(self._emit(self.pending[:len(self.pending) - keep]))
                    self.pending = self.pending[len(self.pending) - keep:]
                break
            at, marker = hit
            if at:
                out.append(self._emit(self.pending[:at]))
            self.pending = self.pending[at + len(marker):]
            if self.tools and marker == self.tools["open"] and not self.in_reasoning:
                self.call = ""
            else:
                self.in_reasoning = not self.in_reasoning
        return [d for d in out if d[1]]

    def _emit(self, text):
        kind = "reasoning" if self.in_reasoning else "content"
        (self.reasoning if self.in_reasoning else self.content).append(text)
        return kind, text

    def _finish_call(self):
        if not self.tools_allowed:
            raise ToolCallError("the model called a tool while tool_choice is none")
        try:
            call = json.loads(self.call)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"generated tool call is not valid JSON: {e.msg}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) \
                or not isinstance(call.get("arguments", {}), dict):
            raise ToolCallError("generated tool call needs a name and object arguments")
        self.calls.append({"name": call["name"], "arguments": json.dumps(call.get("arguments", {}),
                                                                         ensure_ascii=False)})
        self.call = None

    def close(self):
        """End of generation: flush held text; an unfinished tool call is an error."""
        if self.call is not None:
            raise ToolCallError("generation ended inside a tool call")
        out = [self._emit(self.pending)] if self.pending else []
        self.pending = ""
        return [d for d in out if d[1]]


def _partial(text, marker):
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class StopText:
    """OpenAI's `stop` strings on a stream of generated text: push() returns what is safe
    to publish now, holding back a tail that could still begin a stop string; once one
    completes, `hit` is set and the text before it is the last returned. The stop text
    itself is never returned, wherever the token and delta boundaries fall."""

    def __init__(self, stops):
        self.stops = list(stops)
        self.held = ""
        self.hit = False

    def push(self, text):
        if self.hit:
            return ""
        buf = self.held + text
        # The stop that completes first, as token-by-token generation would meet it (at one end,
        # the longer one): the same answer however the text is chunked.
        found = [(i + len(stop), i) for stop, i in ((stop, buf.find(stop)) for stop in self.stops) if i >= 0]
        if found:
            self.hit, self.held = True, ""
            return buf[:min(found)[1]]
        keep = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), keep, -1):
                if buf.endswith(stop[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self):
        """The held tail once generation has ended without completing a stop string."""
        out, self.held = ("" if self.hit else self.held), ""
        return out

