"""POST /v1/embeddings on an embedding deployment.

The package's stage contract (kind embedding): specs VOCAB (token ids are
below it), DIM (the output width) and MAX_TOKENS (per input), and

    command embed(ids: buf, pos: buf, offsets: buf, out: buf, T: int, S: int)

where ids holds the S inputs' tokens back to back (int32[T]), pos each
token's position within its input (int32[T]), offsets the inputs' boundaries
(int32[S + 1]) and out receives float32[S, DIM].

The request runs off the loop's critical path: its inputs are uploaded with
non-blocking copies, the plan for its geometry is compiled (once) and
replayed, the result comes back through an asynchronous download, and a
worker thread waits for the device so the loop never does.
"""

import base64
import time

import numpy as np
import pyopencl as cl

from .http import Deferred, HTTPError, Response
from .jsonin import Arr, Enum, Int, Obj, OneOf, Str

INPUT_ITEMS = 2048

SPEC = Obj({
    "model": Str(min_len=1),
    "input": OneOf(Str(), Arr(Str(), min_len=1, max_len=INPUT_ITEMS), Arr(Int(lo=0, hi=2**31 - 1), min_len=1),
                   Arr(Arr(Int(lo=0, hi=2**31 - 1), min_len=1), min_len=1, max_len=INPUT_ITEMS)),
    "encoding_format": Enum(["float", "base64"], optional=True),
    "dimensions": Int(lo=1, hi=1 << 20, optional=True),
    "user": Str(optional=True),
})


def _inputs(value, prepared):
    """The request's inputs as lists of token ids, validated against the package."""
    if isinstance(value, str) or (isinstance(value, list) and isinstance(value[0], str)):
        tokenizer = getattr(prepared, "tokenizer", None)
        if tokenizer is None:
            raise HTTPError(400, "this deployment has no tokenizer: send token IDs", "no_tokenizer", "input")
        value = [value] if isinstance(value, str) else value
        return [tokenizer.encode(text) for text in value]
    sequences = [value] if isinstance(value[0], int) else value
    vocab, capacity = prepared.spec("VOCAB"), prepared.spec("MAX_TOKENS")
    for i, ids in enumerate(sequences):
        if len(ids) > capacity:
            raise HTTPError(400, f"input {i} has {len(ids)} tokens; this model takes at most {capacity}",
                            "context_length_exceeded", "input")
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise HTTPError(400, f"input {i}: token id {bad} is outside the vocabulary (size {vocab})",
                            "invalid_value", "input")
    return sequences


def create(server, request):
    body = request.json(SPEC)
    reg = server.registry.admit(body["model"], "embedding")
    prepared = reg.prepared
    request.model = reg.name
    sequences = _inputs(body["input"], prepared)
    dim = prepared.spec("DIM")
    if "dimensions" in body and body["dimensions"] != dim:
        raise HTTPError(400, f"this model supports dimensions {dim} only", "unsupported_value", "dimensions")
    job = Job(server, reg, request, sequences, body.get("encoding_format", "float"))
    server.registry.enter(reg, job)  # may raise 503 on a full queue: nothing was allocated yet
    return job.deferred


class Job:
    """One request's trip through the device."""

    def __init__(self, server, reg, request, sequences, encoding):
        self.server, self.reg, self.request = server, reg, request
        self.prepared = reg.prepared
        self.sequences = sequences
        self.encoding = encoding
        self.deferred = Deferred()
        self.deferred.on_cancel = self.cancelled
        self.buffers = {}
        self.host = []           # host arrays kept alive until their copies complete
        self.gone = False        # the client left, or the response was already settled
        self.acquired = False
        request.state = "queued"

    def start(self, error):
        """The admission gate let us through and the parameters are resident."""
        self.acquired = error is None
        if error is not None:
            self.finish(error=error)
            return
        if self.gone:
            self.finish()
            return
        self.request.state = "running"
        sequences, reg = self.sequences, self.reg
        ids = np.fromiter((t for seq in sequences for t in seq), np.int32)
        offsets = np.zeros(len(sequences) + 1, np.int32)
        np.cumsum([len(s) for s in sequences], out=offsets[1:])
        pos = np.concatenate([np.arange(len(s), dtype=np.int32) for s in sequences])
        self.geometry = {"T": int(ids.size), "S": len(sequences)}
        try:
            pool, queue = self.prepared.device.pool, self.prepared.device.queue
            dim = self.prepared.spec("DIM")
            for name, array in (("ids", ids), ("pos", pos), ("offsets", offsets)):
                self.buffers[name] = pool.alloc(array.nbytes, reg.name, "workspace")
                cl.enqueue_copy(queue, self.buffers[name].buffer, array, is_blocking=False)
                self.host.append(array)
            self.buffers["out"] = pool.alloc(4 * len(sequences) * dim, reg.name, "workspace")
        except Exception as e:
            self.finish(error=e)
            return
        self.prepared.plan_async("embed", self.geometry, self.planned)

    def planned(self, plan, error):
        if error is not None:
            self.finish(error=error)
            return
        if self.gone:
            self.finish()
            return
        self.request.state = "running"
        plan.run(self.buffers)
        dim = self.prepared.spec("DIM")
        transfer = self.prepared.device.download_async(self.buffers["out"], np.float32,
                                                       self.geometry["S"] * dim)
        self.server.loop.run_in_executor(transfer.wait, self.downloaded)

    def downloaded(self, values, error):
        if error is not None:
            self.finish(error=error)
            return
        dim = self.prepared.spec("DIM")
        values = values.reshape(self.geometry["S"], dim)
        data = []
        for i, row in enumerate(values):
            embedding = (base64.b64encode(row.astype("<f4").tobytes()).decode() if self.encoding == "base64"
                         else [float(x) for x in row])
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        tokens = self.geometry["T"]
        self.finish(Response.json({"object": "list", "data": data, "model": self.reg.name,
                                   "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}))

    def cancelled(self):
        """The client disconnected: leave the queue, or let accepted work retire."""
        self.gone = True
        self.server.registry.withdraw(self.reg, self)

    def fail(self, error):
        """Withdrawn (unregister): answer now; accepted device work still retires."""
        if not self.gone:
            self.gone = True
            self.deferred.resolve(error.response())

    def finish(self, response=None, error=None):
        for buf in self.buffers.values():
            buf.release()
        self.buffers = {}
        self.host = []
        self.server.registry.leave(self.reg, self, self.acquired)
        self.acquired = False
        if error is not None:
            status = 503 if type(error).__name__ == "OutOfDeviceMemory" else 500
            response = HTTPError(status, f"embedding failed: {getattr(error, 'message', error)}",
                                 "device_memory" if status == 503 else "execution_failed").response()
        if not self.gone:
            self.deferred.resolve(response)
