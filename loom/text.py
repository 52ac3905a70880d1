"""Text and sequence endpoints: tokenizer utilities, chat completions, named
checkpoints and known-token sequences.

- POST /tokenize, /detokenize and /v1/chat/completions/input_tokens run on the
  shared CPU executor: they never activate weights, occupy an execution row or
  wait for an inference step, but they obey the model's admission gate.
- POST /v1/chat/completions (JSON or SSE) renders the conversation with the
  package's chat policy and runs it on the deployment's TextEngine
  (scheduler.py); X-Loom-Session names a retained history, X-Loom-Checkpoint
  starts exactly from a pinned endpoint.
- POST/DELETE /v1/checkpoints/NAME and .../suspend pin, release and park
  endpoints (PROFILES.md "Named checkpoints").
- POST /v1/sequences streams known token ids through a sequence deployment
  (PROFILES.md "Known-token sequences"); GET /v1/sessions inspects it all.

A streamed response starts (status 200 and the first event) only once the
request has an execution row, so every refusal before that is a real HTTP
status.
"""

import base64
import collections
import logging
import re
import secrets
import time

import numpy as np

from . import kinds, registry, vision
from .chat import ChatPolicy, StopText, ToolCallError
from .errors import Error, Problem
from .http import Response, Stream, page, sse_event
from .jsonin import Arr, Bool, Enum, Int, Num, Obj, OneOf, Str, Tagged
from .logs import PRIVATE
from .scheduler import Refused, Sequence, TextEngine, trial_pages

log = logging.getLogger("loom.text")

MAX_TOKENS = 262144
MAX_TEXT_BYTES = 1 << 20

TOKENIZE = Obj({"model": Str(min_len=1), "content": Str(), "add_special": Bool(optional=True),
                "parse_special": Bool(optional=True), "with_pieces": Bool(optional=True)})
DETOKENIZE = Obj({"model": Str(min_len=1), "tokens": Arr(Int(lo=0, hi=2**31 - 1))})   # length: 413 below


def _tokenizer(server, name):
    reg = server.registry.registrations.get(name)
    if reg is None or reg.removing:
        raise Error(404, f"model {name!r} does not exist", "model_not_found", "model")
    tokenizer = reg.prepared.tokenizer if reg.prepared is not None else None
    if tokenizer is None:
        raise Error(404, f"model {name!r} has no loaded tokenizer", "tokenizer_not_found", "model")
    return reg, tokenizer


class TokenizerJob(kinds.Job):
    """/tokenize or /detokenize: CPU work behind the model's admission gate (a drained
    model queues it, bounded by pending_capacity). It counts among the registration's
    jobs until the work is done: the tokenizer borrow outlasts an unregister."""

    what = "tokenizer"
    resident = False

    def __init__(self, server, reg, request, work, respond):
        super().__init__(server, reg, request)
        self.work, self.respond = work, respond

    def run(self):
        self.server.loop.run_in_executor(self.work, self.done)

    def done(self, result, error):
        if error is not None and not isinstance(error, Error):
            error = Error(500, f"tokenizer failed: {error}", "tokenizer_failed")
        self.finish(None if error is not None else self.respond(result), error)


def _run(server, reg, request, work, respond):
    request.model = reg.name
    job = TokenizerJob(server, reg, request, work, respond)
    server.registry.enter(reg, job)
    return job.deferred


def tokenize(server, request):
    body = request.json(TOKENIZE)
    if body.get("with_pieces"):
        raise Error(400, "with_pieces:true is not supported: the decoder contract exposes no token bytes",
                        "unsupported_value", "with_pieces")
    if len(body["content"].encode("utf-8", "surrogatepass")) > MAX_TEXT_BYTES:
        raise Error(413, f"content is over {MAX_TEXT_BYTES} bytes", "content_too_large", "content")
    reg, tok = _tokenizer(server, body["model"])

    def work():
        ids = tok.encode(body["content"], add_special=body.get("add_special", False),
                         parse_special=body.get("parse_special", True))
        if len(ids) > MAX_TOKENS:
            raise Error(413, f"content is over {MAX_TOKENS} tokens", "content_too_large", "content")
        return ids

    return _run(server, reg, request, work, lambda ids: Response.json({"tokens": ids}))


def detokenize(server, request):
    body = request.json(DETOKENIZE)
    if len(body["tokens"]) > MAX_TOKENS:
        raise Error(413, f"more than {MAX_TOKENS} tokens", "content_too_large", "tokens")
    reg, tok = _tokenizer(server, body["model"])
    bad = next((t for t in body["tokens"] if t >= tok.vocab_size), None)
    if bad is not None:
        raise Error(400, f"token id {bad} is outside the vocabulary (size {tok.vocab_size})", "invalid_value",
                        "tokens")

    def work():
        text = tok.decode(body["tokens"])
        if len(text.encode("utf-8", "surrogatepass")) > MAX_TEXT_BYTES:
            raise Error(413, f"decoded text is over {MAX_TEXT_BYTES} bytes", "content_too_large", "tokens")
        return text

    return _run(server, reg, request, work, lambda text: Response.json({"content": text}))


# -- POST /v1/chat/completions -------------------------------------------------------


PART = Tagged("type", {"text": Obj({"text": Str()}),
                      "image_url": Obj({"image_url": Obj({"url": Str(), "detail": Enum(list(vision.DETAILS),
                                                                                       optional=True)})})})
CONTENT = OneOf(Str(), Arr(PART, min_len=1))
TOOL_CALL = Obj({"id": Str(), "type": Enum(["function"]),
                 "function": Obj({"name": Str(min_len=1), "arguments": Str()})})
MESSAGE = Obj({"role": Enum(["system", "user", "assistant", "tool"]), "content": OneOf(CONTENT, optional=True,
                                                                                       nullable=True),
               "name": Str(optional=True), "tool_calls": Arr(TOOL_CALL, optional=True, nullable=True),
               "tool_call_id": Str(optional=True),
               # What an assistant message that came back from here carries, sent back as history
               # (a client appends the message it got): accepted; past reasoning is not re-rendered.
               "reasoning_content": Str(optional=True, nullable=True), "refusal": Str(optional=True, nullable=True),
               "annotations": Arr(Obj(None), optional=True, nullable=True),
               "audio": Obj(None, optional=True, nullable=True), "function_call": Obj(None, optional=True, nullable=True)})
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
    "stop": OneOf(Str(min_len=1, max_len=1024), Arr(Str(min_len=1, max_len=1024), min_len=1, max_len=4),
                  optional=True, nullable=True),
})


def _policy(reg):
    """The deployment's chat policy (built when its engine started), or 501."""
    policy = reg.engine.chat
    if isinstance(policy, ValueError):
        raise Error(501, f"model {reg.name!r} has no chat framing: {policy}", "not_implemented", "model")
    return policy


def _sampling(policy, body):
    """Validated sampling parameters: the package's defaults and accepted ranges."""
    values = []
    for name, fallback in (("temperature", 0.0), ("top_p", 1.0), ("top_k", 0)):
        rule = policy.sampling.get(name, {})
        value = body.get(name)
        if value is None:
            value = rule.get("default", fallback)
        elif not rule.get("min", value) <= value <= rule.get("max", value):
            raise Error(400, f"{name} must be from {rule['min']} to {rule['max']} for this model",
                            "out_of_range", name)
        values.append(value)
    return values


def _text_chars(content):
    if isinstance(content, str):
        return len(content)
    return sum(len(part.get("text") or "") for part in content or ())


def _validated(server, request):
    """The shared front half of /v1/chat/completions and its input_tokens count:
    every field checked, the policy's framing applied. -> (body, reg, policy, prompt text)."""
    body = request.json(CHAT)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise Error(400, "supply max_tokens or max_completion_tokens, not both", "invalid_value",
                        "max_completion_tokens")
    stream = bool(body.get("stream"))
    if body.get("stream_options") and not stream:
        raise Error(400, "stream_options requires stream: true", "invalid_value", "stream_options")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise Error(400, "only tool_choice auto and none are supported", "unsupported_value", "tool_choice")
    if body.get("store"):
        raise Error(400, "store is not supported", "unsupported_value", "store")
    for i, m in enumerate(body["messages"]):
        if m["role"] != "assistant" and m.get("content") is None:
            raise Error(400, f"messages[{i}] needs content", "missing_field", f"messages[{i}].content")
        for field in ("audio", "function_call"):
            if m.get(field) is not None:
                raise Error(400, f"messages[{i}].{field} is not supported (null is accepted)", "unsupported_value",
                            f"messages[{i}].{field}")
        if m.get("tool_calls") and m["role"] != "assistant":
            raise Error(400, "only assistant messages carry tool_calls", "invalid_value",
                            f"messages[{i}].tool_calls")
    reg = server.registry.admit(body["model"], TEXT)
    request.model = reg.name
    policy = _policy(reg)
    _sampling(policy, body)
    options = policy.options(body.get("model_options"))     # 400 before admission; rendered below
    messages, tools, thinking = body["messages"], body.get("tools"), body.get("enable_thinking")
    tok = reg.prepared.tokenizer
    context = reg.doc["context_length"]
    bound = tok.text_bound(context)
    chars = sum(_text_chars(m.get("content")) for m in messages)
    if bound is not None and chars > bound:
        # Surely over the context: refused here, before a worker spends seconds tokenizing it.
        raise Error(400, f"the messages hold {chars} characters, more than a context of {context} tokens can "
                         "take", "context_length_exceeded", "messages")

    parts = [(f"messages[{i}].content[{j}]", part) for i, m in enumerate(messages)
             if isinstance(m.get("content"), list) for j, part in enumerate(m["content"])
             if part["type"] == "image_url"]
    component = reg.prepared.components.get("image")
    if parts and component is None:
        raise Error(400, f"model {reg.name!r} does not take image input (its input modalities: text)",
                    "unsupported_value", parts[0][0])

    def prompt():
        """On the CPU executor, as the model's one policy borrower: framing, then tokens
        (stopping once past the context: the caller refuses those), each image's positions
        among them -> (ids, vision.Media or None)."""
        if not parts:
            return tok.encode(policy.render(messages, tools, thinking, model_options=options), add_special=False,
                              limit=context), None
        shown, marks = vision.with_marks(messages)
        return vision.tokens(tok, policy.render(shown, tools, thinking, model_options=options), marks, parts,
                             component, context)

    return body, reg, policy, prompt, bool(parts)


SESSION_NAME = registry.NAME   # sessions and checkpoints are named like deployments


def _name_header(request, header):
    value = request.header(header.lower())
    if value is not None and not SESSION_NAME.fullmatch(value):
        raise Error(400, f"{header} names are {registry.NAME_RULE}", "invalid_header", header)
    return value


def chat_completions(server, request):
    session = _name_header(request, "X-Loom-Session")
    checkpoint = _name_header(request, "X-Loom-Checkpoint")
    body, reg, policy, prompt, images = _validated(server, request)
    stream = bool(body.get("stream"))
    choice = body.get("tool_choice", "auto")
    temperature, top_p, top_k = _sampling(policy, body)
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    limit = body.get(field) or reg.doc["max_output_tokens"]
    if limit > reg.doc["max_output_tokens"]:
        raise Error(400, f"{field} {limit} is over this deployment's limit of {reg.doc['max_output_tokens']} "
                         "(limits.max_output_tokens in /v1/models)", "out_of_range", field)
    cp = reg.engine.borrow(checkpoint) if checkpoint is not None else None   # an unknown name is 404 at once
    job = ChatJob(server, reg, request, policy, prompt, limit, (temperature, top_p, top_k, body.get("seed") or 0),
                  stream, bool((body.get("stream_options") or {}).get("include_usage")),
                  body.get("enable_thinking"), choice != "none", session, cp, stop=body.get("stop"))
    if images:
        job.components = ("image",)     # its images are projected by the image component's weights
    return _enter(server, reg, job)


def _enter(server, reg, job):
    try:
        server.registry.enter(reg, job)
    except Error:
        job.release()
        raise
    return job.deferred


def input_tokens(server, request):
    """The exact prompt length a generation would start from, counted on a CPU worker:
    no row, no KV pages, no weights; the same validation and framing."""
    for header in ("x-loom-session", "x-loom-checkpoint"):
        if request.header(header) is not None:
            raise Error(400, f"{header} selects retained state; counting is stateless", "unsupported_header",
                            header)
    body, reg, policy, prompt, _images = _validated(server, request)
    if reg.engine.counting >= reg.doc["pending_capacity"]:
        raise Error(503, f"model {reg.name!r} has a full counting queue", "queue_full", "model")
    reg.engine.counting += 1
    job = CountJob(server, reg, request, prompt)
    try:
        server.registry.enter(reg, job)     # the drain policy applies: a drained model queues the count
    except Error:
        reg.engine.counting -= 1
        raise
    return job.deferred


class CountJob(kinds.Job):
    """An input_tokens count: the policy's tokenizer on a CPU worker, no weights or rows."""

    what = "input token count"
    resident = False

    def __init__(self, server, reg, request, prompt):
        super().__init__(server, reg, request)
        self.prompt = prompt        # -> token ids, run as the model's policy borrower

    def run(self):
        self.engine.borrow_policy(self.prompt, self.counted)

    def counted(self, result, error):
        context = self.reg.doc["context_length"]
        ids = result[0] if error is None else None
        if error is not None:     # a framing refusal (ChatError) keeps its status; else the tokenizer broke
            self.finish(error=error if isinstance(error, Problem) else
                        Error(500, f"tokenizer failed: {error}", "tokenizer_failed"))
        elif len(ids) > context:    # the count stopped there: the input is longer still
            self.finish(error=Error(400, f"the input is over the context length of {context} tokens",
                                        "context_length_exceeded", "messages"))
        else:
            self.finish(Response.json({"input_tokens": len(ids)}))

    def cancelled(self):
        waiting = self in self.reg.waiting
        super().cancelled()
        if waiting:
            self.finish()        # withdrawn before it ran: its place in the counting queue frees

    def finish(self, response=None, error=None):
        if not self.finished:
            self.engine.counting -= 1
        super().finish(response, error)


class StreamingJob(kinds.Job):
    """A request on a TextEngine whose answer may be an SSE stream. The stream is handed
    to the client once the request has a row (open_stream); before that every error is
    an HTTP status. What was reserved for a request that never reached the engine (a
    borrowed checkpoint, a claimed handle) goes back through release()."""

    error_event = None    # the SSE event name of an error (None: a bare data line, as OpenAI streams)

    def __init__(self, server, reg, request):
        super().__init__(server, reg, request)
        self.seq = None
        self.stream = None

    def release(self):
        pass

    def open_stream(self):
        self.stream = Stream()
        self.stream.on_close = lambda reason: self.cancelled()
        self.stream.on_ready = lambda: self.engine.wake()
        self.deferred.resolve(self.stream)

    def stop(self):
        """The step in flight retires before the row is let go."""
        if self.seq is not None:
            self.engine.cancel(self.seq)
        else:
            self.release()

    def cancelled(self):
        super().cancelled()
        self.stop()

    def fail(self, error):
        """Withdrawn by unregister: the client gets the error (an SSE error event when
        streaming)."""
        if self.gone:
            return
        self.stop()
        if self.stream is None:
            super().fail(error)
            return
        self.gone = True
        self.send_error(error, "gone_error")

    def finish(self, response=None, error=None):
        self.release()
        if self.stream is not None and error is not None and not self.gone:
            self.send_error(error if isinstance(error, Error) else Error(500, str(error), "execution_failed"),
                            "server_error")
            error = None
        super().finish(response, error)

    def send_error(self, error, kind):
        self.stream.send(sse_event({"error": {"message": error.message, "type": kind, "param": error.param,
                                              "code": error.code}}, event=self.error_event))
        self.stream.finish()


class ChatJob(StreamingJob):
    what = "chat completion"

    def __init__(self, server, reg, request, policy, prompt, limit, sampling, stream, include_usage, thinking,
                 tools_allowed, session=None, checkpoint=None, stop=None):
        super().__init__(server, reg, request)
        # `stop` applies to the generated text before it is parsed, so it ends reasoning,
        # content and tool-call text alike; the stop text is never published.
        self.stopper = StopText([stop] if isinstance(stop, str) else stop) if stop else None
        self.session = session
        self.checkpoint = checkpoint      # borrowed: released when the engine takes it, or on failure
        self.policy, self.prompt, self.limit, self.sampling = policy, prompt, limit, sampling
        self.include_usage = include_usage
        self.parser = policy.parser(thinking, tools_allowed)
        self.id = f"chatcmpl-{request.id}"
        self.created = int(time.time())
        self.content, self.reasoning = [], []
        self.streaming = stream

    def release(self):
        if self.checkpoint is not None:
            self.engine.unborrow(self.checkpoint)
            self.checkpoint = None

    def run(self):
        self.engine.borrow_policy(self.prompt, self.tokenized)

    def tokenized(self, result, error):
        if error is not None or self.gone:
            self.finish(error=error)
            return
        ids, media = result
        context = self.reg.doc["context_length"]
        if len(ids) + self.limit > context:
            size = f"{len(ids)} tokens" if len(ids) <= context else f"over {context} tokens"
            self.finish(error=Error(400, f"the prompt ({size}) plus max_tokens ({self.limit}) "
                                             f"exceeds the context length {context}", "context_length_exceeded",
                                        "messages"))
            return
        cp = self.checkpoint
        if cp is not None and ids[:len(cp.tokens)] != cp.tokens:
            self.finish(error=Error(400, f"the conversation does not extend checkpoint {cp.name!r}: its "
                                             f"{len(cp.tokens)} consumed tokens differ from the rendered history",
                                        "history_mismatch", "messages"))
            return
        if media is not None and media.positions and \
                self.engine.reusable(ids, self.session, cp) <= media.positions[-1]:
            # Some image positions will be computed: decode now, so that a broken image is
            # a 4xx before the response begins (a retained prefix covering them skips this).
            self.server.loop.run_in_executor(media.decode, lambda _r, e: self._decoded(ids, media, e))
            return
        self._submit(ids, media)

    def _decoded(self, ids, media, error):
        if error is not None or self.gone:
            self.finish(error=error)
            return
        self._submit(ids, media)

    def _submit(self, ids, media):
        cp = self.checkpoint
        tok = self.reg.prepared.tokenizer
        stop_ids = {tok.special[s] for s in self.policy.stop if s in tok.special}
        if tok.eos_id is not None:
            stop_ids.add(tok.eos_id)
        self.prompt_tokens = len(ids)
        self.detok = tok.stream()
        self.stop_ids = stop_ids
        temperature, top_p, top_k, seed = self.sampling
        self.seq = Sequence(ids, self.limit, temperature, top_p, top_k, seed, stop_ids, self.on_token, self.on_done,
                            ready=lambda: self.stream is None or self.stream.ready, session=self.session,
                            checkpoint=cp, on_start=self.on_start, media=media)
        self.checkpoint = None            # the engine owns the borrow now
        self.engine.submit(self.seq)

    def on_start(self):
        """The request has a row: a streamed response begins."""
        if self.streaming and self.stream is None and not self.gone:
            self.open_stream()
            self.send({"role": "assistant", "content": ""})

    def send(self, delta, finish_reason=None):
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.reg.name,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
        self.stream.send(sse_event(chunk))

    def on_token(self, token):
        if token in self.stop_ids:
            return   # the terminal token counts in usage but is not text
        text = self.detok.push(token)
        if self.stopper is not None:
            text = self.stopper.push(text)
        try:
            deltas = self.parser.feed(text)
        except ToolCallError as e:
            self.fail_generation(e)
            return
        self.publish(deltas)
        if self.stopper is not None and self.stopper.hit:
            self.engine.stop(self.seq)      # ends at this step's boundary, as a stop token would

    def publish(self, deltas):
        for kind, text in deltas:
            (self.reasoning if kind == "reasoning" else self.content).append(text)
            if self.stream:
                self.send({"reasoning_content" if kind == "reasoning" else "content": text})

    def fail_generation(self, error):
        self.engine.cancel(self.seq)
        self.finish(error=Error(500, f"the model generated an invalid tool call: {error}", "invalid_tool_call"))

    def on_done(self, reason):
        if self.gone:
            self.finish()
            return
        if reason == "error":
            self.finish(error=_step_error(self.seq.error, "generation"))
            return
        if reason == "refused":
            self.finish(error=Error(503, "the KV pool cannot hold the checkpoint's pages right now",
                                        "checkpoint_restore_refused", "X-Loom-Checkpoint"))
            return
        tail = self.detok.flush()
        if self.stopper is not None:
            tail = self.stopper.push(tail) + self.stopper.flush()
            if self.stopper.hit:
                reason = "stop"
        try:
            self.publish(self.parser.feed(tail) + self.parser.close())
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
            self.send({"reasoning_content": None} if self.parser.reasoning_markers and not self.reasoning else {},
                      finish)
            if self.include_usage:
                self.stream.send(sse_event({"id": self.id, "object": "chat.completion.chunk",
                                            "created": self.created, "model": self.reg.name, "choices": [],
                                            "usage": usage}))
            self.stream.send(b"data: [DONE]\n\n")
            self.stream.finish()
            self.finish()
            return
        message = {"role": "assistant", "content": "".join(self.content)}
        if self.parser.reasoning_markers:   # reasoning-aware with thinking on: the key is always there
            message["reasoning_content"] = "".join(self.reasoning) or None
        if calls:
            message["tool_calls"] = calls
        self.finish(Response.json({"id": self.id, "object": "chat.completion", "created": self.created,
                                   "model": self.reg.name, "choices": [{"index": 0, "message": message,
                                                                        "finish_reason": finish}],
                                   "usage": usage}))


def sessions(server, request):
    """GET /v1/sessions: named histories, sequence handles and checkpoints held by text and
    sequence deployments, a bounded page at a time."""
    request.require_empty_body()
    params = request.params({"offset", "limit"})
    offset = request.int_param(params, "offset", 0, 0, 2**63 - 1)
    limit = request.int_param(params, "limit", 50, 1, 100)
    retaining = [reg for reg in server.registry.registrations.values()
                 if reg.kind in (TEXT, SEQUENCE) and not reg.removing]
    if not retaining:
        raise Error(501, "no text or sequence deployment retains sessions here", "not_implemented")
    rows = []
    for reg in retaining:
        eng = reg.engine
        if eng is None:
            continue
        kind = "sequence" if reg.kind is SEQUENCE else "session"
        for name, saved in eng.sessions.items():
            rows.append({"model": reg.name, "type": kind, "session": name, "position": len(saved.tokens),
                         "pages": len(saved.pages), "state": "idle"})
        for seq in eng.rows:
            if seq is not None and seq.session is not None:
                rows.append({"model": reg.name, "type": kind, "session": seq.session,
                             "position": eng.tables[seq.row].length, "pages": len(eng.tables[seq.row].pages),
                             "state": "active"})
        for cp in eng.checkpoints.values():
            rows.append({"model": reg.name, "type": "checkpoint", "checkpoint": cp.name, "position": len(cp.tokens),
                         "pages": len(cp.pages or ()), "host_snapshot_bytes": cp.host_bytes,
                         "state": "suspended" if cp.host is not None else "pinned"})
    data, next_offset = page(rows, offset, limit)
    return Response.json({"object": "list", "data": data, "offset": offset, "total": len(rows),
                          "next_offset": next_offset})


# -- named checkpoints: POST/DELETE /v1/checkpoints/NAME, POST .../suspend ------------------


def _retaining(server, request, name):
    """The deployment a checkpoint control selects (X-Loom-Model; optional with exactly
    one deployment), which must be prepared and have checkpoint capacity."""
    request.require_empty_body()
    if not SESSION_NAME.fullmatch(name):
        raise Error(400, f"checkpoint names are {registry.NAME_RULE}", "invalid_value", "name")
    model = request.header("x-loom-model")
    live = [r for r in server.registry.registrations.values() if not r.removing]
    if model is None:
        if len(live) != 1:
            raise Error(400, "X-Loom-Model selects the deployment (it may be omitted only when exactly one "
                                 "is registered)", "missing_header", "X-Loom-Model")
        reg = live[0]
    else:
        reg = server.registry.registrations.get(model)
        if reg is None or reg.removing:
            raise Error(404, f"model {model!r} does not exist", "model_not_found", "X-Loom-Model")
    if reg.kind not in (TEXT, SEQUENCE) or not reg.doc["checkpoint_capacity"]:
        raise Error(501, f"model {reg.name!r} has no checkpoint capacity", "checkpoints_disabled", "X-Loom-Model")
    if reg.phase != "ready" or reg.prepared is None:
        raise Error(404, f"model {reg.name!r} is not prepared", "model_not_prepared", "X-Loom-Model")
    request.model = reg.name
    return reg


def _checkpoint_view(reg, cp, **extra):
    return dict({"object": "checkpoint", "model": reg.name, "checkpoint": cp.name, "position": len(cp.tokens),
                 "pending_token": cp.pending, "suspended": cp.host is not None,
                 "host_snapshot_bytes": cp.host_bytes}, **extra)


class ControlJob(kinds.Job):
    """Pin, suspend or delete, through the deployment's one control slot. Pin and suspend
    wait for admission to reopen (delete does not: releasing a pin never waits for
    inference); once accepted, a control completes even if the client leaves."""

    what = "checkpoint control"
    resident = False

    def __init__(self, server, reg, request, work):
        super().__init__(server, reg, request)
        self.work = work
        self.release = None

    def start(self, error):
        if error is not None:
            self.finish(error=error)
            return
        try:
            self.engine.take_control(self.controlled)
        except Refused as e:
            self.finish(error=e)

    def controlled(self, release):
        self.release = release
        self.request.state = "running"
        try:
            self.work(self)      # even if the client has gone: accepted work still happens
        except Refused as e:
            self.finish(error=e)

    def finish(self, response=None, error=None):
        if self.release is not None:
            self.release()
        super().finish(response, error)

    def cancelled(self):
        self.gone = True         # not withdrawn from the admission queue


def pin_checkpoint(server, request, name):
    reg = _retaining(server, request, name)
    session = _name_header(request, "X-Loom-Session")
    if session is None:
        raise Error(400, "X-Loom-Session names the completed session to pin", "missing_header", "X-Loom-Session")

    def pin(job):
        cp = reg.engine.pin(name, session)
        job.finish(Response.json(_checkpoint_view(reg, cp, session=session), status=201))

    return _control(server, reg, request, pin)


def suspend_checkpoint(server, request, name):
    reg = _retaining(server, request, name)
    if reg.doc["checkpoint_backing"] != "elastic":
        raise Error(400, f"model {reg.name!r} has fixed checkpoint backing; suspension needs elastic backing",
                        "fixed_backing", "X-Loom-Model")

    def suspend(job):
        def done(cp, error):
            if error is not None:
                job.finish(error=error)
            else:
                job.finish(Response.json(_checkpoint_view(reg, cp)))
        reg.engine.suspend(name, done)

    return _control(server, reg, request, suspend)


def _control(server, reg, request, work):
    job = ControlJob(server, reg, request, work)
    server.registry.enter(reg, job)
    return job.deferred


def delete_checkpoint(server, request, name):
    """Through the control slot, but not the admission gate: allowed while drained."""
    reg = _retaining(server, request, name)

    def delete(job):
        reg.engine.delete(name)
        job.finish(Response.json({"object": "checkpoint", "model": reg.name, "checkpoint": name, "deleted": True}))

    job = ControlJob(server, reg, request, delete)
    server.registry.enter_ungated(reg, job)
    return job.deferred


# -- POST /v1/sequences ----------------------------------------------------------------


HANDLE = re.compile(r"[0-9a-f]{32}")
SEQUENCE_BODY = Obj({"model": Str(min_len=1), "session": Str(optional=True), "position": Int(lo=0, hi=2**31 - 1),
                "token_ids": Arr(Int(lo=0, hi=2**31 - 1), min_len=1, max_len=MAX_TOKENS),
                "options": Obj(None, optional=True)})


def sequences(server, request):
    """Known token ids through a sequence deployment: SSE attached, chunk per execution
    cohort, done. A handle continues at its exact completed position."""
    if request.header("x-loom-session") is not None:
        raise Error(400, "X-Loom-Session is not accepted here: the session body field is the handle",
                        "unsupported_header", "X-Loom-Session")
    checkpoint = _name_header(request, "X-Loom-Checkpoint")
    body = request.json(SEQUENCE_BODY)
    reg = server.registry.admit(body["model"], SEQUENCE)
    request.model = reg.name
    declared = ((reg.prepared.policy or {}).get("sequence") or {}).get("options", [])
    unknown = sorted(set(body.get("options") or {}) - set(declared))
    if unknown:
        raise Error(400, f"options {', '.join(unknown)} are not declared by this model's source",
                        "unknown_field", f"options.{unknown[0]}")
    ids, position, handle = body["token_ids"], body["position"], body.get("session")
    vocab = reg.prepared.spec("V")      # a package's vocabulary size bounds the ids it can embed
    bad = next((i for i, t in enumerate(ids) if t >= vocab), None) if vocab is not None else None
    if bad is not None:
        raise Error(400, f"token id {ids[bad]} is outside the vocabulary (size {vocab})", "invalid_value",
                        f"token_ids[{bad}]")
    if handle is not None and not HANDLE.fullmatch(handle):
        raise Error(400, "session is a 32-hex handle issued by this endpoint", "invalid_value", "session")
    if handle is not None and checkpoint is not None:
        raise Error(400, "a fork from X-Loom-Checkpoint omits session: it receives a new handle",
                        "invalid_value", "session")
    context = reg.doc["context_length"]
    if position + len(ids) > context:
        raise Error(400, f"position {position} plus {len(ids)} ids exceeds the context length {context}",
                        "context_length_exceeded", "token_ids")
    eng = reg.engine
    if eng.pool.pages_for(position + len(ids)) > eng.pool.pages:
        raise Error(503, f"{position + len(ids)} positions exceed the KV pool", "kv_pool_exhausted", "token_ids")
    resume = cp = None
    if handle is not None:
        resume = eng.claim(handle, position)
        base = resume.tokens
    elif checkpoint is not None:
        cp = eng.borrow(checkpoint)
        base = cp.tokens
        if position != len(base):
            eng.unborrow(cp)
            raise Error(409, f"position {position} is not checkpoint {checkpoint!r}'s consumed position "
                             f"{len(base)}", "stale_position", "position")
    else:
        base = []
        if position != 0:
            raise Error(409, f"position {position} is stale: a new sequence starts at 0", "stale_position",
                        "position")
    return _enter(server, reg, SequenceJob(server, reg, request, handle or secrets.token_hex(16), base, ids, resume, cp))


def _step_error(error, what):
    """A failed step's answer: a Problem keeps its code (step_timeout: 503), anything else is a 500."""
    if isinstance(error, Problem):
        return Error.of(error)
    return Error(500, f"{what} failed: {error}", "execution_failed")


class SequenceJob(StreamingJob):
    what = "sequence"
    error_event = "error"

    def __init__(self, server, reg, request, handle, base, ids, resume, checkpoint):
        super().__init__(server, reg, request)
        self.handle, self.base, self.ids = handle, list(base), ids
        self.resume, self.checkpoint = resume, checkpoint

    def release(self):
        """Never submitted: the claimed handle returns unchanged, the checkpoint unborrowed."""
        eng = self.engine
        if self.resume is not None:
            eng.unclaim(self.handle, self.resume)
            self.resume = None
        if self.checkpoint is not None:
            eng.unborrow(self.checkpoint)
            self.checkpoint = None

    def run(self):
        self.seq = Sequence(self.base + self.ids, session=self.handle, resume=self.resume,
                            checkpoint=self.checkpoint, on_chunk=self.on_chunk, on_done=self.on_done,
                            on_start=self.on_start, ready=lambda: self.stream is None or self.stream.ready,
                            first_output=len(self.base))
        self.resume = self.checkpoint = None     # the engine owns them now
        self.engine.submit(self.seq)

    def on_start(self):
        if self.gone:
            return
        self.open_stream()
        self.stream.send(sse_event({"session": self.handle, "position": len(self.base)}, event="attached"))

    def on_chunk(self, position, ids, data):
        self.stream.send(sse_event({"session": self.handle, "position": position,
                                    "next_position": position + len(ids), "token_ids": list(ids),
                                    "encoding": "base64", "data": base64.b64encode(data).decode()}, event="chunk"))

    def on_done(self, reason):
        if reason == "refused":
            self.finish(error=Error(503, "the KV pool cannot hold the checkpoint's pages right now",
                                        "checkpoint_restore_refused", "X-Loom-Checkpoint"))
        elif reason == "stop" and not self.gone:
            self.stream.send(sse_event({"session": self.handle, "position": len(self.seq.prompt)}, event="done"))
            self.stream.finish()
            self.finish()
        elif reason == "error" and not self.gone:
            self.finish(error=_step_error(self.seq.error, "sequence step"))
        else:
            self.finish()


# -- the kinds ------------------------------------------------------------------------


class ChatEngine(TextEngine):
    """A text deployment's engine, with what its endpoints keep beside the rows: the
    chat policy (or why there is none) and the input_tokens counts queued or running."""

    def __init__(self, reg, loop, **geometry):
        super().__init__(reg.prepared, loop, **geometry)
        prepared = reg.prepared
        tok = prepared.tokenizer
        template = tok.chat_template if tok is not None else None
        special = ("", "") if tok is None else \
            tuple("" if i is None else tok.id_to_token(i) for i in (tok.bos_id, tok.eos_id))
        try:
            self.chat = ChatPolicy(prepared.policy, template, (reg.doc.get("options") or {}).get("chat"), special)
        except ValueError as e:
            self.chat = e       # a deployment without chat framing still tokenizes and pins
        if getattr(self.chat, "template_problem", None):
            # (why quotes the checkpoint's template, a server file: the operator's stderr alone has it)
            log.warning("%s: the checkpoint's chat template cannot be used; the package's %s roles frame "
                        "its chats", reg.name, self.chat.name,
                        extra={"event": "chat_template_unusable", "model": reg.name,
                               PRIVATE: self.chat.template_problem})
        self.counting = 0
        self.policy_waiting = collections.deque()
        self.policy_busy = False
        image = prepared.components.get("image")
        if image is not None:       # the image component's projection cohorts
            self.projection = vision.ProjectionEngine(image, loop)
            self.projection.step_timeout = reg.doc["step_timeout"]

    def stats(self):
        out = super().stats()
        if self.projection is not None:
            out["images"] = dict(self.projection.stats(), images_decoded=self.projection.prepared.images_decoded)
        return out

    def backlog(self):
        return super().backlog() + len(self.policy_waiting)

    def borrow_policy(self, fn, done):
        """fn() on the CPU executor as the model's one source-policy borrower (template
        rendering and tokenizing, for generation and input_tokens alike): it waits for
        the borrower before it to retire. done(result, error) on the loop."""
        self.policy_waiting.append((fn, done))
        self._next_borrower()

    def _next_borrower(self):
        if self.policy_busy or not self.policy_waiting:
            return
        fn, done = self.policy_waiting.popleft()
        self.policy_busy = True

        def retired(result, error):
            self.policy_busy = False
            try:
                done(result, error)
            finally:
                self._next_borrower()

        self.loop.run_in_executor(fn, retired)


class Text(kinds.Kind):
    name = "text"
    endpoint = "/v1/chat/completions"
    routes = [
        ("POST", "/v1/chat/completions", chat_completions),
        ("POST", "/v1/chat/completions/input_tokens", input_tokens),
        ("GET", "/v1/sessions", sessions),
        ("POST", "/v1/checkpoints/{name}", pin_checkpoint),
        ("DELETE", "/v1/checkpoints/{name}", delete_checkpoint),
        ("POST", "/v1/checkpoints/{name}/suspend", suspend_checkpoint),
        ("POST", "/tokenize", tokenize),
        ("POST", "/detokenize", detokenize),
    ]
    inputs, outputs = ["text"], ["text"]
    probes = [("advance", {"T": 1, "R": 1})]
    contracts = {"image": vision.IMAGE}

    def trial(self, binding, command, geometry):
        inputs = trial_pages(binding, geometry["T"], geometry["R"])
        return inputs, {"logits": (np.float32, geometry["R"] * binding.specs["V"])}
    stage = "advance"

    def options(self, doc, options):
        # The KV pool: every row can hold a full context.
        options.setdefault("context_length", doc["context_length"])
        page = options.setdefault("page_size", 16)
        options.setdefault("pages", doc["rows"] * -(-options["context_length"] // page))
        return options

    def capability(self, reg):
        p = reg.prepared
        return {"context_length": reg.doc["context_length"],
                "limits": {"max_output_tokens": reg.doc["max_output_tokens"]},
                "retained": {k: reg.doc[k] for k in ("session_cache_capacity", "prefix_cache_capacity",
                                                     "checkpoint_capacity", "checkpoint_backing")},
                "input_tokens": bool(reg.doc["endpoint"] and p is not None and p.tokenizer is not None
                                     and p.policy.get("chats"))}

    def geometry(self, reg):
        options, doc = reg.prepared.binding.options, reg.doc
        return dict(rows=doc["rows"], pages=options["pages"], page_size=options["page_size"],
                    session_capacity=doc["session_cache_capacity"], prefix_capacity=doc["prefix_cache_capacity"],
                    checkpoint_capacity=doc["checkpoint_capacity"], elastic=doc["checkpoint_backing"] == "elastic",
                    stage=self.stage)

    def start(self, reg, loop):
        return ChatEngine(reg, loop, **self.geometry(reg))


class KnownTokens(Text):
    name = "sequence"
    endpoint = "/v1/sequences"
    routes = [("POST", "/v1/sequences", sequences)]
    inputs, outputs = ["tokens"], ["tensor"]
    probes = [("encode", {"T": 1})]
    stage = "encode"
    contracts = {}

    def trial(self, binding, command, geometry):
        inputs = trial_pages(binding, geometry["T"], 1)
        del inputs["last"]
        return inputs, {"out": (np.uint8, geometry["T"] * binding.specs["SEQUENCE_BYTES"])}

    def capability(self, reg):
        loom = super().capability(reg)
        del loom["input_tokens"]
        if reg.prepared is not None:
            loom["sequence_bytes_per_token"] = reg.prepared.spec("SEQUENCE_BYTES")
        return loom

    def start(self, reg, loop):
        return TextEngine(reg.prepared, loop, **self.geometry(reg))


TEXT = Text()
SEQUENCE = KnownTokens()
