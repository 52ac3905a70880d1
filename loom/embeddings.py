"""POST /v1/embeddings on an embedding deployment.

The package's stage contract (kind embedding): specs VOCAB (token ids are
below it), DIM (the output width) and MAX_TOKENS (per input), and

    command embed(ids: buf, pos: buf, offsets: buf, out: buf, T: int, S: int)

and, for packages whose policy lists reduced "dimensions",

    command embed_narrow(ids: buf, pos: buf, offsets: buf, out: buf, T: int, S: int, W: int)

where ids holds the S inputs' tokens back to back (int32[T]), pos each
token's position within its input (int32[T]), offsets the inputs' boundaries
(int32[S + 1]) and out receives float32[S, DIM].

The request runs off the loop's critical path: its inputs are uploaded with
non-blocking copies, the plan for its geometry is compiled (once) and
replayed, the result comes back through an asynchronous download, and a
worker thread waits for the device so the loop never does.
"""

import base64

import numpy as np

from . import kinds
from .errors import Error
from .http import Response
from .jsonin import Arr, Enum, Int, Obj, OneOf, Str
from .scheduler import BatchEngine, pack, split_tokens

INPUT_ITEMS = 2048

SPEC = Obj({
    "model": Str(min_len=1),
    "input": OneOf(Str(), Arr(Str(), min_len=1, max_len=INPUT_ITEMS), Arr(Int(lo=0, hi=2**31 - 1), min_len=1),
                   Arr(Arr(Int(lo=0, hi=2**31 - 1), min_len=1), min_len=1, max_len=INPUT_ITEMS)),
    "encoding_format": Enum(["float", "base64"], optional=True),
    "dimensions": Int(lo=1, hi=1 << 20, optional=True),
    "user": Str(optional=True),
})


def _check(sequences, prepared):
    """Token id lists validated against the package's vocabulary and capacity."""
    vocab, capacity = prepared.spec("VOCAB"), prepared.spec("MAX_TOKENS")
    for i, ids in enumerate(sequences):
        if not ids:
            raise Error(400, f"input {i} is empty", "invalid_value", "input")
        if len(ids) > capacity:
            raise Error(400, f"input {i} has {len(ids)} tokens; this model takes at most {capacity}",
                            "context_length_exceeded", "input")
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise Error(400, f"input {i}: token id {bad} is outside the vocabulary (size {vocab})",
                            "invalid_value", "input")
    return sequences


def tokenize(prepared, texts):
    """On a worker thread: texts -> token ids, framed as the encoder was trained."""
    add_special = prepared.policy.get("add_special", True)
    return [prepared.tokenizer.encode(text, add_special=add_special) for text in texts]


def create(server, request):
    body = request.json(SPEC)
    reg = server.registry.admit(body["model"], KIND)
    prepared = reg.prepared
    request.model = reg.name
    width = body.get("dimensions", prepared.spec("DIM"))
    if width not in supported_widths(prepared):
        raise Error(400, f"dimensions {width} is not a width this model supports: "
                         f"{', '.join(map(str, supported_widths(prepared)))}", "unsupported_value", "dimensions")
    value = body["input"]
    texts = None
    if isinstance(value, str) or isinstance(value[0], str):
        if prepared.tokenizer is None:
            raise Error(400, "this deployment has no tokenizer: send token IDs", "no_tokenizer", "input")
        texts = [value] if isinstance(value, str) else value
        sequences = None
    else:
        sequences = _check([value] if isinstance(value[0], int) else value, prepared)
    job = Job(server, reg, request, sequences, body.get("encoding_format", "float"), texts, width)
    server.registry.enter(reg, job)  # may raise 503 on a full queue: nothing was allocated yet
    return job.deferred


COHORT_TOKENS = 8192   # a cohort closes at this many tokens...
COHORT_INPUTS = 256    # ...or inputs; a request larger than that runs as a cohort of its own


class Job(kinds.Job):
    """One request: its inputs, its share of a cohort, its response."""

    what = "embedding"

    def __init__(self, server, reg, request, sequences, encoding, texts=None, width=None):
        super().__init__(server, reg, request)
        self.key = self.width = width or reg.prepared.spec("DIM")   # one output width per cohort
        self.sequences = sequences
        self.texts = texts       # text inputs, tokenized on a worker once admitted
        self.tokens = sum(len(s) for s in sequences) if sequences else 0
        self.inputs = len(sequences or texts)
        self.encoding = encoding

    def run(self):
        if self.sequences is None:
            self.server.loop.run_in_executor(tokenize, self.tokenized, self.reg.prepared, self.texts)
        else:
            self.engine.submit(self)

    def tokenized(self, sequences, error):
        if error is None:
            try:
                self.sequences = _check(sequences, self.reg.prepared)
                self.tokens = sum(len(s) for s in sequences)
            except Error as e:
                error = e
        if error is not None or self.gone:
            self.finish(error=error)
        else:
            self.engine.submit(self)

    def deliver(self, rows):
        data = []
        for i, row in enumerate(rows):
            embedding = (base64.b64encode(row.astype("<f4").tobytes()).decode() if self.encoding == "base64"
                         else [float(x) for x in row])
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        self.finish(Response.json({"object": "list", "data": data, "model": self.reg.name,
                                   "usage": {"prompt_tokens": self.tokens, "total_tokens": self.tokens}}))


class Batch:
    """Several requests' inputs in one `embed` (or `embed_narrow`) step."""

    def __init__(self, prepared):
        self.prepared = prepared

    def stage(self, jobs):
        ids, pos, offsets = pack([s for job in jobs for s in job.sequences])
        count, width = len(offsets) - 1, jobs[0].width
        command, geometry = "embed", {"T": int(ids.size), "S": count}
        if width != self.prepared.spec("DIM"):
            command, geometry = "embed_narrow", dict(geometry, W=width)
        return command, geometry, {"ids": ids, "pos": pos, "offsets": offsets}, {"out": (np.float32, count * width)}

    def deliver(self, jobs, values, error):
        rows = None if error is not None else values["out"].reshape(sum(len(j.sequences) for j in jobs), -1)
        row = 0
        for job in jobs:
            mine = None if rows is None else rows[row:row + len(job.sequences)]
            row += len(job.sequences)
            if error is not None:
                job.finish(error=error)
            elif job.gone:
                job.finish()  # its rows are dropped; its peers are not disturbed
            else:
                job.deliver(mine)


def supported_widths(prepared):
    """The package's own output width, plus reduced widths it computes itself
    (its policy's "dimensions", served by an `embed_narrow` command)."""
    widths = {prepared.spec("DIM")}
    if prepared.binding.module.find("commands", "embed_narrow") is not None:
        widths.update(w for w in prepared.policy.get("dimensions", []) if isinstance(w, int) and w > 0)
    return sorted(widths)


class Embedding(kinds.Kind):
    name = "embedding"
    endpoint = "/v1/embeddings"
    routes = [("POST", "/v1/embeddings", create)]
    inputs, outputs = ["text", "tokens"], ["embedding"]
    probes = [("embed", {"T": 1, "S": 1})]

    def trial(self, binding, command, geometry):
        ids, pos, offsets = pack(split_tokens(geometry["T"], geometry["S"]))
        width = geometry.get("W", binding.specs["DIM"])
        return {"ids": ids, "pos": pos, "offsets": offsets}, {"out": (np.float32, geometry["S"] * width)}

    def capability(self, reg):
        p = reg.prepared
        if p is None:
            return {}
        return {"dimensions": p.spec("DIM"), "supported_dimensions": supported_widths(p),
                "max_input_tokens": p.spec("MAX_TOKENS")}

    def start(self, reg, loop):
        return BatchEngine(reg.prepared, loop, Batch(reg.prepared), COHORT_TOKENS, COHORT_INPUTS)


KIND = Embedding()
