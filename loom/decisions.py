"""POST /v1/systemone: finite decisions on a decision deployment.

The package's stage contract (kind decision): specs VOCAB and MAX_TOKENS, and

    command decide(ids: buf, pos: buf, offsets: buf, groups: buf, probs: buf, T: int, S: int, G: int)

Each of the G questions is a group of texts, its query first (the state and
the question's instructions) and then one text per option; `groups` (int32[G+1])
bounds the groups over the S texts, whose tokens are packed as for embeddings.
The package writes, for every option, its probability (float32[S - G], in
option order). The host checks those vectors (finite, non-negative, summing to
one) and rejects malformed output instead of normalizing it.
"""

import json

import numpy as np

from . import kinds
from .errors import Error
from .http import Response
from .jsonin import Any_, Arr, Enum, Map, Obj, OneOf, Str
from .scheduler import BatchEngine, pack, split_tokens

MAX_QUESTIONS = 1024
MAX_OPTIONS = 255
TYPED = OneOf(Str(), Obj(None), Arr(Any_(nullable=True)))   # instructions, criteria, state: text or structure

QUESTION = Obj({"type": Enum(["choice", "score", "noul"]), "instructions": TYPED,
                "criteria": Any_(optional=True)})
SPEC = Obj({"model": Str(min_len=1), "state": TYPED,
            "questions": Map(QUESTION, min_len=1, max_len=MAX_QUESTIONS)})
SUM_TOLERANCE = 1e-3


def _text(value):
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _images(value):
    """Whether a value carries image-input parts, which this profile does not accept."""
    if isinstance(value, dict):
        if "image_url" in value or value.get("type") in ("image_url", "input_image", "image"):
            return True
        return any(_images(v) for v in value.values())
    if isinstance(value, list):
        return any(_images(v) for v in value)
    return False


def _options(qid, question):
    """(option ids or None, option texts, legend) per the question type; 422 on a bad schema."""
    kind, criteria = question["type"], question.get("criteria")
    if kind == "noul":
        if criteria is not None:
            raise Error(422, f"question {qid!r}: noul questions take no criteria", "invalid_schema",
                            f"questions.{qid}.criteria")
        return None, ["Yes.", "No."], None
    if kind == "choice":
        if not isinstance(criteria, dict) or not 1 <= len(criteria) <= MAX_OPTIONS:
            raise Error(422, f"question {qid!r}: choice criteria must map 1 to {MAX_OPTIONS} option ids "
                                 "to descriptions", "invalid_schema", f"questions.{qid}.criteria")
        for option, description in criteria.items():
            if not option or description is None:
                raise Error(422, f"question {qid!r}: option ids must be nonempty with a description",
                                "invalid_schema", f"questions.{qid}.criteria")
        return list(criteria), [_text(v) for v in criteria.values()], None
    if not isinstance(criteria, list) or not 2 <= len(criteria) <= 10 or any(c is None for c in criteria):
        raise Error(422, f"question {qid!r}: score criteria must list 2 to 10 ordered levels", "invalid_schema",
                        f"questions.{qid}.criteria")
    return None, [_text(c) for c in criteria], criteria


def create(server, request):
    body = request.json(SPEC)
    reg = server.registry.admit(body["model"], KIND)
    request.model = reg.name
    if reg.prepared.tokenizer is None:
        raise Error(422, f"model {reg.name!r} has no tokenizer for decision texts", "no_tokenizer", "model")
    if _images(body["state"]) or any(_images(q["instructions"]) for q in body["questions"].values()):
        raise Error(400, "image inputs are not accepted by /v1/systemone", "unsupported_input", "state")
    state = _text(body["state"])
    plan = []   # (question id, type, option ids, legend, texts: query first)
    for qid, question in body["questions"].items():
        ids, texts, legend = _options(qid, question)
        plan.append((qid, question["type"], ids, legend, [f"{state}\n{_text(question['instructions'])}"] + texts))
    job = Job(server, reg, request, plan)
    server.registry.enter(reg, job)
    return job.deferred


def _tokenize(prepared, plan):
    """On a worker: every text of every question, framed as the encoder was trained."""
    tok, capacity = prepared.tokenizer, prepared.spec("MAX_TOKENS")
    sequences = []
    for qid, _, _, _, texts in plan:
        for text in texts:
            ids = tok.encode(text, add_special=prepared.policy.get("add_special", True))
            if len(ids) > capacity:
                raise Error(422, f"question {qid!r}: a text has {len(ids)} tokens, over the model's {capacity}",
                                "input_too_long", f"questions.{qid}")
            sequences.append(ids)
    return sequences


COHORT_TOKENS = 8192   # a cohort closes at this many tokens...
COHORT_INPUTS = 1024   # ...or texts; a larger request runs as a cohort of its own


class Job(kinds.Job):
    """One decision request: tokenizing, its share of a cohort, validation."""

    what = "decision"
    key = None          # any requests can share a cohort

    def __init__(self, server, reg, request, plan):
        super().__init__(server, reg, request)
        self.plan = plan
        self.sequences = None
        self.tokens = 0
        self.inputs = sum(len(texts) for *_, texts in plan)

    def run(self):
        self.server.loop.run_in_executor(_tokenize, self.tokenized, self.reg.prepared, self.plan)

    def tokenized(self, sequences, error):
        if error is not None or self.gone:
            self.finish(error=error)
            return
        self.sequences = sequences
        self.tokens = sum(len(s) for s in sequences)
        self.engine.submit(self)

    def decided(self, probs):
        at, answers = 0, {}
        for qid, kind, ids, legend, texts in self.plan:
            p = probs[at:at + len(texts) - 1]
            at += len(texts) - 1
            if not (np.isfinite(p).all() and (p >= 0).all() and abs(float(p.sum()) - 1) <= SUM_TOLERANCE):
                self.finish(error=Error(500, f"the model produced a malformed probability vector for "
                                             f"question {qid!r}", "malformed_output"))
                return
            values_ = [float(x) for x in p]
            if kind == "choice":
                answers[qid] = {"type": "choice", "choice": ids[int(np.argmax(p))],
                                "probabilities": dict(zip(ids, values_))}
            elif kind == "score":
                answers[qid] = {"type": "score", "score": float(np.dot(np.arange(len(p)), p)),
                                "probabilities": values_, "legend": legend}
            else:
                answers[qid] = {"type": "noul", "probability": values_[0]}
        self.finish(Response.json({"object": "systemone.decision", "model": self.reg.name, "answers": answers,
                                   "usage": {"prompt_tokens": self.tokens, "completion_tokens": 0,
                                             "total_tokens": self.tokens}}))


class Batch:
    """Several requests' questions in one `decide` step: their groups back to back,
    each request's option probabilities a contiguous slice of the output."""

    def stage(self, jobs):
        sequences = [s for job in jobs for s in job.sequences]
        ids, pos, offsets = pack(sequences)
        sizes = [len(texts) for job in jobs for *_, texts in job.plan]
        groups = np.zeros(len(sizes) + 1, np.int32)
        np.cumsum(sizes, out=groups[1:])
        options = len(sequences) - len(sizes)
        return ("decide", {"T": int(ids.size), "S": len(sequences), "G": len(sizes)},
                {"ids": ids, "pos": pos, "offsets": offsets, "groups": groups}, {"probs": (np.float32, options)})

    def deliver(self, jobs, values, error):
        at = 0
        for job in jobs:
            options = job.inputs - len(job.plan)
            mine = None if error is not None else values["probs"][at:at + options]
            at += options
            if error is not None:
                job.finish(error=error)
            elif job.gone:
                job.finish()
            else:
                job.decided(mine)


class Decision(kinds.Kind):
    name = "decision"
    endpoint = "/v1/systemone"
    routes = [("POST", "/v1/systemone", create)]
    inputs, outputs = ["text"], ["probabilities"]
    probes = [("decide", {"T": 2, "S": 2, "G": 1})]

    def trial(self, binding, command, geometry):
        S, G = geometry["S"], geometry["G"]
        ids, pos, offsets = pack(split_tokens(geometry["T"], S))
        groups = np.array([S * g // G for g in range(G + 1)], np.int32)
        return {"ids": ids, "pos": pos, "offsets": offsets, "groups": groups}, {"probs": (np.float32, S - G)}

    def start(self, reg, loop):
        return BatchEngine(reg.prepared, loop, Batch(), COHORT_TOKENS, COHORT_INPUTS)


KIND = Decision()
