"""Text utilities: POST /tokenize and POST /detokenize with a deployment's tokenizer.

These run on the shared CPU executor: they never activate weights, occupy an
execution row or wait for an inference step, but they do obey the model's
admission gate, and keep the prepared deployment (and so its tokenizer)
borrowed until the work has actually finished.
"""

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
