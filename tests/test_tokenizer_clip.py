"""CLIP's tokenizer from its slow-tokenizer files (loom.tokenizer.from_clip_files).

The tokenizer folder is the one models/sd/generate.py writes for the tiny SD 1.5 model
(vocab.json, merges.txt learned from prompt words). Two oracles: the Hugging Face `tokenizers`
library built from the same synthesized tokenizer.json, and tests/sd_numpy.py's `tokenize`
(written from CLIP's own Python tokenizer), whose bos/eos and padding to 77 are stripped to
compare the raw ids. Where the two oracles part (html entities, decomposed accents, non-decimal
digits, special-token text), the tests say which one Loom follows and why.
"""
import html
import importlib.util
import json
import os
import shutil
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from loom import tokenizer as T
from loom.tokenizer import TokenizerError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd_numpy as sd  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("sd_generate", os.path.join(ROOT, "models", "sd", "generate.py"))
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("clip") / "tokenizer")
    gen.write_tokenizer(d)
    return d


def read(folder, name):
    with open(os.path.join(folder, name), "rb") as f:
        return f.read()


def config_of(folder):
    names = ("tokenizer_config.json", "special_tokens_map.json")
    return {k: v for name in names for k, v in json.loads(read(folder, name)).items()}


@pytest.fixture(scope="module")
def spec(folder):
    return T.clip_tokenizer_json(read(folder, "vocab.json"), read(folder, "merges.txt"), config_of(folder))


@pytest.fixture(scope="module")
def ours(folder):
    return T.from_clip_files(folder)


@pytest.fixture(scope="module")
def hf(spec):
    return HFTokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def ref(folder):
    return {"tokenizer": sd.read_tokenizer(folder)}


def hf_ids(hf, text, add_special=False, parse_special=True):
    hf.encode_special_tokens = not parse_special
    try:
        return hf.encode(text, add_special_tokens=add_special).ids
    finally:
        hf.encode_special_tokens = False


def sd_raw(ref, text):
    """sd_numpy's ids without bos, eos and padding. Every byte is at most one token, so
    max_length = bytes + 2 never truncates; the BPE there never makes the eos token (no merge
    builds "<|endoftext|>"), so the first eos after bos is the one it appended."""
    out = sd.tokenize(ref, text, max_length=len(text.encode("utf-8")) + 2)
    assert out[0] == ref["tokenizer"]["bos"]
    body = out[1:]
    return body[:body.index(ref["tokenizer"]["eos"])]


def sd_prompt(ours, text, length=77):
    """What SD feeds its text encoder: bos, ids truncated to fit, eos, then eos padding."""
    ids = ours.encode(text, add_special=True)
    ids = ids[:length - 1] + [ours.eos_id] if len(ids) > length else ids
    return ids + [ours.pad_id] * (length - len(ids))


# Text where CLIP's Python tokenizer and the tokenizer.json pipeline agree.
COMMON = [
    "", " ", "   \t\n ", "a red fox in the snow", "watercolor painting of an astronaut riding a horse on mars",
    "portrait photo, detailed, high quality", "A Red FOX In The SNOW", "DETAILED Illustration",
    "xyzzy quux blorptastic zqwv", "supercalifragilisticexpialidocious", "hello, world!!! (fox) -- ? ... ;:",
    "a_b __init__ snake_case", "$5 & 100% @home #tag ~tilde^ `tick`", "2024 3.14 1000000 007",
    "h2o r2d2 4k 1080p", "don't it's WE'LL they're I'M you've she'd", "'s 't 're 've 'm 'll 'd", "O'Brien's cat's",
    "a     red\t\tfox\n\n\nin   the  snow", "  leading and trailing  ", "\u3000ideographic\u00a0space\u2028line",
    "café naïve résumé façade Ünïcödé", "ÀÉÎÕÜ ÇÑ", "日本語のテキスト 東京タワー 中文", "한국어 안녕하세요", "Привет мир", "مرحبا",
    "😀 👍🏽 🇯🇵 🎨🖌️", "👩\u200d👩\u200d👧 family", "mixed 日本 text 123 with 😀 emoji", "Σ ς σ",
    "zero\u200bwidth\ufeffjoin", "<html> a </html>", "x" * 300, "ab" * 150 + " " + "fox " * 40,
]
# Text where they part, with the reason: Loom follows the tokenizer.json pipeline (HF's).
DIFFERENT = [
    "fox &amp; hound &lt;3 &quot;",     # CLIP's Python tokenizer unescapes html; the tokenizer.json does not
    "e\u0301 cafe\u0301",                   # NFC composes é; CLIP's Python tokenizer has no NFC (ftfy's aside)
    "x² ½ Ⅻ ①",                          # \p{N} isolates each; Python's re counts them as letters
    "a<|endoftext|>b <|startoftext|>",   # special tokens here; sd_numpy spells them out
    "ΟΔΟΣ",                              # Rust lowercases letter by letter; Python's lower() has a final sigma
]


def test_synthesized_json_is_clips_pipeline(spec, folder):
    vocab = json.loads(read(folder, "vocab.json"))
    assert spec["normalizer"] == {"type": "Sequence", "normalizers": [
        {"type": "NFC"}, {"type": "Replace", "pattern": {"Regex": r"\s+"}, "content": " "}, {"type": "Lowercase"}]}
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    assert split == {"type": "Split", "behavior": "Removed", "invert": True, "pattern": {"Regex": (
        r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+")}}
    assert byte_level == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    model = spec["model"]
    assert (model["type"], model["end_of_word_suffix"], model["unk_token"]) == ("BPE", "</w>", EOS)
    assert model["vocab"] == vocab and len(model["merges"]) == gen.N_MERGES
    assert model["merges"][0] == list(gen.learn_merges()[0])
    assert spec["post_processor"]["type"] == "RobertaProcessing"
    assert spec["post_processor"]["cls"] == [BOS, vocab[BOS]] and spec["post_processor"]["sep"] == [EOS, vocab[EOS]]
    assert spec["decoder"]["type"] == "ByteLevel"
    assert [(a["content"], a["id"], a["special"]) for a in spec["added_tokens"]] == [(BOS, vocab[BOS], True),
                                                                                     (EOS, vocab[EOS], True)]


def test_special_ids(ours, folder):
    vocab = json.loads(read(folder, "vocab.json"))
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.unk_id) == (vocab[BOS], vocab[EOS], vocab[EOS], vocab[EOS])
    assert ours.encode("", add_special=True) == [vocab[BOS], vocab[EOS]]
    assert ours.vocab_size == len(vocab)


@pytest.mark.parametrize("text", COMMON + DIFFERENT)
def test_corpus_equals_hf(ours, hf, text):
    for add_special in (False, True):
        for parse_special in (True, False):
            assert ours.encode(text, add_special=add_special, parse_special=parse_special) == \
                hf_ids(hf, text, add_special, parse_special)
    ids = ours.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("text", COMMON)
def test_corpus_equals_sd_numpy(ours, ref, text):
    assert ours.encode(text) == sd_raw(ref, text)
    assert sd_prompt(ours, text) == sd.tokenize(ref, text)      # bos, truncation to 75, eos, eos padding


def test_where_sd_numpy_differs(ours, ref):
    entities, decomposed, numbers, specials, sigma = DIFFERENT
    # html entities: unescaped (twice, as CLIP does) the text tokenizes as sd_numpy's
    assert ours.encode(entities) != sd_raw(ref, entities)
    assert ours.encode(html.unescape(html.unescape(entities))) == sd_raw(ref, entities)
    # decomposed accents: composed first, they tokenize as sd_numpy does the composed text
    assert ours.encode(decomposed) == sd_raw(ref, "é café")
    # superscripts, fractions, Roman numerals, circled digits: one \p{N} pre-token each
    assert ours.encode(numbers) == sum((ours.encode(c) for c in "x²½Ⅻ①"), [])
    assert ours.encode(numbers) != sd_raw(ref, numbers)
    # special-token text: the special ids, or with parse_special=False the text sd_numpy spells out
    assert ours.encode(specials) == ours.encode("a") + [ours.eos_id] + ours.encode("b") + [ours.bos_id]
    assert ours.encode(specials, parse_special=False) == sd_raw(ref, specials)
    # capital sigma: σ everywhere here, ς at a word's end in Python
    assert ours.encode(sigma) == ours.encode("οδοσ") != sd_raw(ref, sigma) == ours.encode("οδος")


def test_long_prompt_truncates_like_sd(ours, ref):
    text = " ".join(["watercolor painting of a red fox"] * 30)
    assert len(ours.encode(text)) > 75
    assert sd_prompt(ours, text) == sd.tokenize(ref, text)


def test_pure_python_merge_loop(folder, monkeypatch, hf):
    monkeypatch.setattr(T, "_native_bpe", None)
    tok = T.from_clip_files(folder)
    assert tok._model.table is None
    for text in COMMON + DIFFERENT:
        assert tok.encode(text, add_special=True) == hf_ids(hf, text, add_special=True)


def test_config_names_the_special_tokens(folder, tmp_path):
    # SD 2's tokenizer pads with "!": transformers makes it a special token, so "!" in a prompt
    # is its plain id (diffusers issue 4153), as HF's tokenizers does with the same JSON
    d = str(tmp_path / "tok")
    shutil.copytree(folder, d)
    with open(os.path.join(d, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "unk_token": EOS, "pad_token": "!"}, f)
    tok = T.from_clip_files(d)
    vocab = json.loads(read(d, "vocab.json"))
    assert tok.pad_id == vocab["!"] and tok.eos_id == vocab[EOS]
    spec = T.clip_tokenizer_json(read(d, "vocab.json"), read(d, "merges.txt"), config_of(d))
    hf = HFTokenizer.from_str(json.dumps(spec))
    for text in ("hello!", "! !! !!!", "a red fox!"):
        assert tok.encode(text, add_special=True) == hf_ids(hf, text, add_special=True)
    assert tok.encode("! !!") == [vocab["!"]] * 3
    # the files alone (no config): CLIP's names
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        os.remove(os.path.join(d, name))
    tok = T.from_clip_files(d)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (vocab[BOS], vocab[EOS], vocab[EOS])


def test_unicode_version_gaps_follow_hf(ours, hf):
    # Lowercasing (Rust: Unicode 17) and normalization (HF's crate: Unicode 9) differ from Python
    # 3.11's Unicode 14 at a few code points; each is checked here, not left to chance.
    from tokenizers import normalizers
    texts = [chr(c) for c in T._LOWER_NEWER] + ["\U00011935\U00011930", "\U00011938"]
    for lo, hi in T._parse_ranges(T._NORM_OLDER):
        for c in {lo, hi}:
            x = chr(c)
            texts += [x, "a\u0301" + x + "\u0316", "e" + x + "\u0301", x + "\u0301\u0316", "\u0316" + x + "a\u0301"]
    for text in texts:
        assert ours._normalize(text) == hf.normalizer.normalize_str(text), [hex(ord(c)) for c in text]
        for form in ("NFC", "NFD", "NFKC", "NFKD"):
            assert T._build_normalizer({"type": form})(text) == getattr(normalizers, form)().normalize_str(text)
        assert ours.encode(text) == hf_ids(hf, text)


# --- Properties ---------------------------------------------------------------------

_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40) | st.lists(st.sampled_from(
    list("aZ é日😀\u200d\u0301'sSlLdD\n\t1².&;_-")
    + [BOS, EOS, "<|ENDOFTEXT|>", "'LL", "  ", "\u3000", "fox", "red", "painting", "\u1df6\u05ae", "\u1c89"]),
    max_size=30).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_TEXT, parse_special=st.booleans())
def test_random_text_equals_hf(ours, hf, text, parse_special):
    ids = ours.encode(text, add_special=True, parse_special=parse_special)
    assert ids == hf_ids(hf, text, add_special=True, parse_special=parse_special)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False)


# --- Malformed files ----------------------------------------------------------------

def vocab_with(**changes):
    def make(vocab):
        return json.dumps({**vocab, **changes}).encode()
    return make


def vocab_without(token):
    def make(vocab):
        return json.dumps({k: v for k, v in vocab.items() if k != token}).encode()
    return make


BAD_VOCAB = {
    "not JSON": (lambda v: b'{"a": 1', "vocab.json is not valid JSON"),
    "not UTF-8": (lambda v: b'{"\xff": 1}', "vocab.json is not valid JSON"),
    "deeply nested": (lambda v: b"[" * 100000 + b"]" * 100000, "vocab.json is not valid JSON"),
    "a list": (lambda v: b'["a", "b"]', "vocab.json must be an object of token -> id, got list"),
    "string id": (vocab_with(a="1"), "token 'a' has id '1'"),
    "negative id": (vocab_with(a=-1), "token 'a' has id -1"),
    "bool id": (vocab_with(a=True), "token 'a' has id True"),
    "float id": (vocab_with(a=1.0), "token 'a' has id 1.0"),
    "huge id": (vocab_with(a=2**40), "ids are integers 0 .. 2\\*\\*32-1"),
    "null id": (vocab_with(a=None), "token 'a' has id None"),
    "no eos": (vocab_without(EOS), r"vocab.json lacks the eos token '<\|endoftext\|>'"),
    "no bos": (vocab_without(BOS), r"vocab.json lacks the bos token '<\|startoftext\|>'"),
    "merge part missing": (vocab_without("a"), "merge 'a' 'i' uses a token outside the vocabulary"),
    "merge result missing": (vocab_without("ai"), "merge 'a' 'i' uses a token outside the vocabulary"),
}
BAD_MERGES = {
    "not UTF-8": (b"#version: 0.2\na \xff\n", "merges.txt is not valid UTF-8"),
    "one token": (b"#version: 0.2\na i\nst\n", "merges.txt line 3: expected two tokens and one space, got 'st'"),
    "three tokens": (b"a i\ns t x\n", "merges.txt line 2: expected two tokens"),
    "two spaces": (b"a  i\n", "merges.txt line 1: expected two tokens"),
    "leading space": (b" a i\n", "merges.txt line 1"),
    "tab separated": (b"a\ti\n", "merges.txt line 1"),
    "unknown tokens": (b"#version: 0.2\nzz q\n", "merge 'zz' 'q' uses a token outside the vocabulary"),
}


def write_folder(base, folder, vocab=None, merges=None):
    d = os.path.join(base, "tok")
    shutil.copytree(folder, d)
    if vocab is not None:
        with open(os.path.join(d, "vocab.json"), "wb") as f:
            f.write(vocab)
    if merges is not None:
        with open(os.path.join(d, "merges.txt"), "wb") as f:
            f.write(merges)
    return d


@pytest.mark.parametrize("case", list(BAD_VOCAB))
def test_malformed_vocab_raises_tokenizer_error(folder, tmp_path, case):
    make, match = BAD_VOCAB[case]
    d = write_folder(str(tmp_path), folder, vocab=make(json.loads(read(folder, "vocab.json"))))
    with pytest.raises(TokenizerError, match=match) as info:
        T.from_clip_files(d)
    assert str(info.value).startswith(d + ": ")


@pytest.mark.parametrize("case", list(BAD_MERGES))
def test_malformed_merges_raise_tokenizer_error(folder, tmp_path, case):
    data, match = BAD_MERGES[case]
    d = write_folder(str(tmp_path), folder, merges=data)
    with pytest.raises(TokenizerError, match=match):
        T.from_clip_files(d)


def test_merges_header_and_blank_lines(folder, tmp_path, ours):
    # HF skips "#version" lines; blank lines (a trailing newline, CRLF ends) hold no merge
    lines = read(folder, "merges.txt").decode().split("\n")
    d = write_folder(str(tmp_path), folder, merges=("\r\n".join(lines[1:]) + "\r\n\r\n").encode())
    tok = T.from_clip_files(d)
    for text in COMMON:
        assert tok.encode(text) == ours.encode(text)


@pytest.mark.parametrize("name", ["vocab.json", "merges.txt"])
def test_missing_file(folder, tmp_path, name):
    d = write_folder(str(tmp_path), folder)
    os.remove(os.path.join(d, name))
    with pytest.raises(TokenizerError, match=f"{name}: no such file"):
        T.from_clip_files(d)


def test_bad_config_json(folder, tmp_path):
    d = write_folder(str(tmp_path), folder)
    with open(os.path.join(d, "special_tokens_map.json"), "wb") as f:
        f.write(b"{oops")
    with pytest.raises(TokenizerError, match="cannot read special_tokens_map.json"):
        T.from_clip_files(d)


@st.composite
def mutated(draw, original: bytes):
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(data) - 1))
        kind = draw(st.sampled_from(["byte", "insert", "delete"]))
        if kind == "byte":
            data[pos] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[pos:pos] = draw(st.sampled_from([b" ", b"\n", b'"', b",", b"{", b"]", b"-1", b"1e9", b"\\u0000"]))
        else:
            del data[pos:pos + draw(st.integers(1, 6))]
    return bytes(data)


@pytest.fixture(scope="module")
def fuzz_dir(folder, tmp_path_factory):
    return write_folder(str(tmp_path_factory.mktemp("fuzz")), folder)


def build_or_reject(d, name, data):
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)
    try:
        tok = T.from_clip_files(d)
    except TokenizerError:
        return
    tok.decode(tok.encode("a red fox, 2024! café 日本 😀", add_special=True))   # what builds must work


@pytest.fixture(scope="module")
def originals(folder):
    return {name: read(folder, name) for name in ("vocab.json", "merges.txt")}


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data(), name=st.sampled_from(["vocab.json", "merges.txt"]))
def test_fuzz_files_raise_only_tokenizer_error(fuzz_dir, originals, data, name):
    try:
        build_or_reject(fuzz_dir, name, data.draw(mutated(originals[name])))
    finally:
        with open(os.path.join(fuzz_dir, name), "wb") as f:
            f.write(originals[name])
