"""Text utilities: POST /tokenize and POST /detokenize with a deployment's tokenizer.

These run on the shared CPU executor: they never activate weights, occupy an
execution row or wait for an inference step, but they do obey the model's
admission gate, and keep the prepared deployment (and so its tokenizer)
borrowed until the work has actually finished.
"""

import re

from .http import Deferred, HTTPError, Response
from .jsonin import Arr, Bool, Int, Obj, Str

MAX_TOKENS = 262144
MAX_TEXT_BYTES = 1 << 20

TOKENIZE = Obj({"model": Str(min_len=1), "content": Str(), "add_special": Bool(optional=True),
                "parse_special": Bool(optional=True), "with_pieces": Bool(optional=True)})
DETOKENIZE = Obj({"model": Str(min_len=1), "tokens": Arr(Int(lo=0, hi=2**31 - 1), max_len=MAX_TOKENS + 1)})


def _tokenizer(server, name):
    reg = server.registry.registrations.get(name)
    if reg is None or reg.removing:
        raise HTTPError(404, f"model {name!r} does not exist", "model_not_found", "model")
    tokenizer = reg.prepared.tokenizer if reg.prepared is not None else None
    if tokenizer is None:
        raise HTTPError(404, f"model {name!r} has no loaded tokenizer", "tokenizer_not_found", "model")
    if reg.admission != "open":
        raise HTTPError(503, f"model {name!r} is drained", "model_drained", "model")
    return reg, tokenizer


def _run(server, reg, request, fn, respond):
    """fn on a worker. It closes over the tokenizer, so the borrow lasts until the
    work is done even if the model is unregistered meanwhile."""
    deferred = Deferred()

    def done(result, error):
        if isinstance(error, HTTPError):
            deferred.resolve(error.response())
        elif error is not None:
            deferred.resolve(HTTPError(500, f"tokenizer failed: {error}", "tokenizer_failed").response())
        else:
            deferred.resolve(respond(result))

    request.model = reg.name
    server.loop.run_in_executor(fn, done)
    return deferred


def tokenize(server, request):
    body = request.json(TOKENIZE)
    if body.get("with_pieces"):
        raise HTTPError(400, "with_pieces:true is not supported: the decoder contract exposes no token bytes",
                        "unsupported_value", "with_pieces")
    if len(body["content"].encode("utf-8", "surrogatepass")) > MAX_TEXT_BYTES:
        raise HTTPError(413, f"content is over {MAX_TEXT_BYTES} bytes", "content_too_large", "content")
    reg, tok = _tokenizer(server, body["model"])

    def work():
        ids = tok.encode(body["content"], add_special=body.get("add_special", False),
                         parse_special=body.get("parse_special", True))
        if len(ids) > MAX_TOKENS:
            raise HTTPError(413, f"content is over {MAX_TOKENS} tokens", "content_too_large", "content")
        return ids

    return _run(server, reg, request, work, lambda ids: Response.json({"tokens": ids}))


def detokenize(server, request):
    body = request.json(DETOKENIZE)
    if len(body["tokens"]) > MAX_TOKENS:
        raise HTTPError(413, f"more than {MAX_TOKENS} tokens", "content_too_large", "tokens")
    reg, tok = _tokenizer(server, body["model"])
    bad = next((t for t in body["tokens"] if t >= tok.vocab_size), None)
    if bad is not None:
        raise HTTPError(400, f"token id {bad} is outside the vocabulary (size {tok.vocab_size})", "invalid_value",
                        "tokens")

    def work():
        text = tok.decode(body["tokens"])
        if len(text.encode("utf-8", "surrogatepass")) > MAX_TEXT_BYTES:
            raise HTTPError(413, f"decoded text is over {MAX_TEXT_BYTES} bytes", "content_too_large", "tokens")
        return text

    return _run(server, reg, request, work, lambda text: Response.json({"content": text}))


# -- POST /v1/chat/completions -------------------------------------------------------

import time  # noqa: E402


from . import registry  # noqa: E402
from .chat import ChatPolicy, ToolCallError  # noqa: E402
from .http import Stream, sse_event  # noqa: E402
from .jsonin import Enum, Num, OneOf  # noqa: E402
from .scheduler import Sequence, TextEngine  # noqa: E402

TEXT_PART = Obj({"type": Enum(["text"]), "text": Str()})
CONTENT = OneOf(Str(), Arr(TEXT_PART, min_len=1))
TOOL_CALL = Obj({"id": Str(), "type": Enum(["function"]),
                 "function": Obj({"name": Str(min_len=1), "arguments": Str()})})
MESSAGE = Obj({"role": Enum(["system", "user", "assistant", "tool"]), "content": OneOf(CONTENT, optional=True,
                                                                                       nullable=True),
               "name": Str(optional=True), "tool_calls": Arr(TOOL_CALL, optional=True),
               "tool_call_id": Str(optional=True)})
TOOL = Obj({"type": Enum(["function"]), "function": Obj({"name": Str(min_len=1, max_len=64),
                                                          "description": Str(optional=True),
                                                          "parameters": Obj(None, optional=True),
                                                          "strict": Bool(optional=True)})})
CHAT = Obj({
    "model": Str(min_len=1),
    "messages": Arr(MESSAGE, min_len=1),
    "stream": Bool(optional=True, nullable=True),
    "stream_options": Obj({"include_usage": Bool(optional=True)}, optional=True, nullable=True),
    "max_tokens": Int(lo=1, hi=16384, optional=True, nullable=True),
    "max_completion_tokens": Int(lo=1, hi=16384, optional=True, nullable=True),
    "temperature": Num(optional=True, nullable=True),
    "top_p": Num(optional=True, nullable=True),
    "top_k": Int(lo=0, hi=1 << 20, optional=True, nullable=True),
    "seed": Int(lo=0, hi=2**64 - 1, optional=True, nullable=True),
    "enable_thinking": Bool(optional=True, nullable=True),
    "model_options": Obj(None, optional=True),
    "tools": Arr(TOOL, max_len=4096, optional=True),
    "tool_choice": OneOf(Enum(["auto", "none", "required"]), Obj(None), optional=True),
    "store": Bool(optional=True),
})


def _policy(reg):
    """The deployment's chat policy, built once per prepared deployment."""
    prepared = reg.prepared
    if getattr(prepared, "chat", None) is None:
        template = prepared.binding.metadata.get("tokenizer.chat_template")
        try:
            prepared.chat = ChatPolicy(prepared.policy, template, (reg.doc.get("options") or {}).get("chat"))
        except ValueError as e:
            raise HTTPError(501, f"model {reg.name!r} has no chat framing: {e}", "not_implemented", "model") from None
    return prepared.chat


def _sampling(policy, body):
    """Validated sampling parameters: the package's defaults and accepted ranges."""
    values = []
    for name, fallback in (("temperature", 0.0), ("top_p", 1.0), ("top_k", 0)):
        rule = policy.sampling.get(name, {})
        value = body.get(name)
        if value is None:
            value = rule.get("default", fallback)
        elif not rule.get("min", value) <= value <= rule.get("max", value):
            raise HTTPError(400, f"{name} must be from {rule['min']} to {rule['max']} for this model",
                            "out_of_range", name)
        values.append(value)
    return values


def _validated(server, request):
    """The shared front half of /v1/chat/completions and its input_tokens count:
    every field checked, the policy's framing applied. -> (body, reg, policy, prompt text)."""
    body = request.json(CHAT)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise HTTPError(400, "supply max_tokens or max_completion_tokens, not both", "invalid_value",
                        "max_completion_tokens")
    stream = bool(body.get("stream"))
    if body.get("stream_options") and not stream:
        raise HTTPError(400, "stream_options requires stream: true", "invalid_value", "stream_options")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise HTTPError(400, "only tool_choice auto and none are supported", "unsupported_value", "tool_choice")
    if body.get("store"):
        raise HTTPError(400, "store is not supported", "unsupported_value", "store")
    for i, m in enumerate(body["messages"]):
        if m["role"] != "assistant" and m.get("content") is None:
            raise HTTPError(400, f"messages[{i}] needs content", "missing_field", f"messages[{i}].content")
        if m.get("tool_calls") and m["role"] != "assistant":
            raise HTTPError(400, "only assistant messages carry tool_calls", "invalid_value",
                            f"messages[{i}].tool_calls")
    reg = server.registry.admit(body["model"], "text")
    request.model = reg.name
    policy = _policy(reg)
    _sampling(policy, body)
    allowed = set(policy.format.get("model_options", []))
    unknown = sorted(set(body.get("model_options") or {}) - allowed)
    if unknown:
        raise HTTPError(400, f"model_options {', '.join(unknown)} not understood by this model's policy",
                        "unknown_field", f"model_options.{unknown[0]}")
    prompt = policy.render(body["messages"], body.get("tools"), body.get("enable_thinking"))
    return body, reg, policy, prompt


SESSION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def chat_completions(server, request):
    session = request.header("x-loom-session")
    if session is not None and not SESSION_NAME.fullmatch(session):
        raise HTTPError(400, "X-Loom-Session names are 1-64 ASCII letters, digits, '_', '.' or '-'",
                        "invalid_header", "X-Loom-Session")
    body, reg, policy, prompt = _validated(server, request)
    stream = bool(body.get("stream"))
    choice = body.get("tool_choice", "auto")
    temperature, top_p, top_k = _sampling(policy, body)
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or reg.doc["max_output_tokens"]
    job = ChatJob(server, reg, request, policy, prompt, limit, (temperature, top_p, top_k, body.get("seed") or 0),
                  stream, bool((body.get("stream_options") or {}).get("include_usage")),
                  body.get("enable_thinking"), choice != "none", session)
    server.registry.enter(reg, job)
    return job.stream if stream else job.deferred


def input_tokens(server, request):
    """The exact prompt length a generation would start from, counted on a CPU worker:
    no row, no KV pages, no weights; the same validation and framing."""
    for header in ("x-loom-session", "x-loom-checkpoint"):
        if request.header(header) is not None:
            raise HTTPError(400, f"{header} selects retained state; counting is stateless", "unsupported_header",
                            header)
    body, reg, policy, prompt = _validated(server, request)
    tok = reg.prepared.tokenizer
    counting = getattr(reg, "counting", 0)
    if counting >= reg.doc["pending_capacity"]:
        raise HTTPError(503, f"model {reg.name!r} has a full counting queue", "queue_full", "model")
    reg.counting = counting + 1
    deferred = Deferred()

    def counted(ids, error):
        reg.counting -= 1
        if error is not None:
            deferred.resolve(HTTPError(500, f"tokenizer failed: {error}", "tokenizer_failed").response())
        elif len(ids) > reg.doc["context_length"]:
            deferred.resolve(HTTPError(400, f"the input has {len(ids)} tokens, over the context length "
                                            f"{reg.doc['context_length']}", "context_length_exceeded",
                                       "messages").response())
        else:
            deferred.resolve(Response.json({"input_tokens": len(ids)}))

    server.loop.run_in_executor(lambda: tok.encode(prompt, add_special=False), counted)
    return deferred


def engine(server, reg):
    if getattr(reg, "engine", None) is None or reg.engine.prepared is not reg.prepared:
        options = reg.prepared.binding.options
        reg.engine = TextEngine(reg.prepared, server.loop, rows=reg.doc["rows"], pages=options["pages"],
                                page_size=options["page_size"], session_capacity=reg.doc["session_cache_capacity"],
                                prefix_capacity=reg.doc["prefix_cache_capacity"])
    return reg.engine


class ChatJob(registry.Job):
    what = "chat completion"

    def __init__(self, server, reg, request, policy, prompt, limit, sampling, stream, include_usage, thinking,
                 tools_allowed, session=None):
        super().__init__(server, reg, request)
        self.session = session
        self.policy, self.prompt_text, self.limit, self.sampling = policy, prompt, limit, sampling
        self.include_usage = include_usage
        self.parser = policy.parser(thinking, tools_allowed)
        self.id = f"chatcmpl-{request.id}"
        self.created = int(time.time())
        self.seq = None
        self.content, self.reasoning = [], []
        self.stream = None
        if stream:
            self.stream = Stream()
            self.stream.on_close = lambda reason: self.cancelled()
            self.stream.on_ready = lambda: engine(self.server, self.reg).wake()

    def run(self):
        tok = self.reg.prepared.tokenizer
        self.server.loop.run_in_executor(lambda: tok.encode(self.prompt_text, add_special=False), self.tokenized)

    def tokenized(self, ids, error):
        if error is not None or self.gone:
            self.finish(error=error)
            return
        context = self.reg.doc["context_length"]
        if len(ids) + self.limit > context:
            self.finish(error=HTTPError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({self.limit}) "
                                             f"exceeds the context length {context}", "context_length_exceeded",
                                        "messages"))
            return
        tok = self.reg.prepared.tokenizer
        stop_ids = {tok.special[s] for s in self.policy.stop if s in tok.special}
        if tok.eos_id is not None:
            stop_ids.add(tok.eos_id)
        self.prompt_tokens = len(ids)
        self.detok = tok.stream()
        self.stop_ids = stop_ids
        temperature, top_p, top_k, seed = self.sampling
        self.seq = Sequence(ids, self.limit, temperature, top_p, top_k, seed, stop_ids, self.on_token, self.on_done,
                            ready=(lambda: self.stream.ready) if self.stream else None, session=self.session)
        if self.stream:
            self.send({"role": "assistant", "content": ""})
        engine(self.server, self.reg).submit(self.seq)

    def send(self, delta, finish_reason=None):
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.reg.name,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
        self.stream.send(sse_event(chunk))

    def on_token(self, token):
        if token in self.stop_ids:
            return   # the terminal token counts in usage but is not text
        try:
            deltas = self.parser.feed(self.detok.push(token))
        except ToolCallError as e:
            self.fail_generation(e)
            return
        self.publish(deltas)

    def publish(self, deltas):
        for kind, text in deltas:
            (self.reasoning if kind == "reasoning" else self.content).append(text)
            if self.stream:
                self.send({"reasoning_content" if kind == "reasoning" else "content": text})

    def fail_generation(self, error):
        engine(self.server, self.reg).cancel(self.seq)
        self.finish(error=HTTPError(500, f"the model generated an invalid tool call: {error}", "invalid_tool_call"))

    def on_done(self, reason):
        if self.gone:
            self.finish()
            return
        if reason == "error":
            self.finish(error=HTTPError(500, f"generation failed: {self.seq.error}", "execution_failed"))
            return
        try:
            self.publish(self.parser.feed(self.detok.flush()) + self.parser.close())
        except ToolCallError as e:
            self.fail_generation(e)
            return
        calls = [{"id": f"call_{self.request.id}_{i}", "type": "function", "function": call}
                 for i, call in enumerate(self.parser.calls)]
        finish = "tool_calls" if calls else reason
        completion = len(self.seq.generated)
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                 "total_tokens": self.prompt_tokens + completion,
                 "prompt_tokens_details": {"cached_tokens": self.seq.cached}}
        if self.stream:
            if calls:
                self.send({"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]})
            self.send({}, finish)
            if self.include_usage:
                self.stream.send(sse_event({"id": self.id, "object": "chat.completion.chunk",
                                            "created": self.created, "model": self.reg.name, "choices": [],
                                            "usage": usage}))
            self.stream.send(b"data: [DONE]\n\n")
            self.stream.finish()
            self.finish()
            return
        message = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if calls:
            message["tool_calls"] = calls
        self.finish(Response.json({"id": self.id, "object": "chat.completion", "created": self.created,
                                   "model": self.reg.name, "choices": [{"index": 0, "message": message,
                                                                        "finish_reason": finish}],
                                   "usage": usage}))

    def cancelled(self):
        super().cancelled()
        if self.seq is not None:
            engine(self.server, self.reg).cancel(self.seq)

    def fail(self, error):
        """Withdrawn by unregister: the client gets the error (an SSE error event when
        streaming); the step in flight retires before the row is let go."""
        if self.gone:
            return
        if self.seq is not None:
            engine(self.server, self.reg).cancel(self.seq)
        if self.stream is None:
            super().fail(error)
            return
        self.gone = True
        self.stream.send(sse_event({"error": {"message": error.message, "type": "gone_error", "param": error.param,
                                              "code": error.code}}))
        self.stream.finish()

    def finish(self, response=None, error=None):
        if self.stream is not None and error is not None and not self.gone:
            err = error if isinstance(error, HTTPError) else HTTPError(500, str(error), "execution_failed")
            self.stream.send(sse_event({"error": {"message": err.message, "type": "server_error", "param": err.param,
                                                  "code": err.code}}))
            self.stream.finish()
            error = None
        super().finish(response, error)


def sessions(server, request):
    """GET /v1/sessions: named histories held by text deployments, a bounded page at a time."""
    request.require_empty_body()
    params = request.params({"offset", "limit"})
    offset = request.int_param(params, "offset", 0, 0, 2**63 - 1)
    limit = request.int_param(params, "limit", 50, 1, 100)
    texts = [reg for reg in server.registry.registrations.values() if reg.kind == "text" and not reg.removing]
    if not texts:
        raise HTTPError(501, "no text deployment retains sessions here", "not_implemented")
    rows = []
    for reg in texts:
        eng = getattr(reg, "engine", None)
        for name, (tokens, pages) in (eng.sessions.items() if eng is not None else ()):
            rows.append({"model": reg.name, "session": name, "tokens": len(tokens), "pages": len(pages),
                         "state": "idle"})
        for seq in (eng.rows if eng is not None else ()):
            if seq is not None and seq.session is not None:
                rows.append({"model": reg.name, "session": seq.session, "tokens": len(seq.prompt),
                             "pages": len(eng.tables[seq.row].pages), "state": "active"})
    page = rows[offset:offset + limit]
    return Response.json({"object": "list", "data": page, "offset": offset, "total": len(rows),
                          "next_offset": offset + len(page) if offset + len(page) < len(rows) else None})
