"""Tokenizers: byte-level BPE (GPT-2, Llama-3, Qwen2, SmolLM; CLIP's with a "</w>" word-end
suffix), SentencePiece-style BPE with byte fallback (Llama-2, Mistral) and WordPiece (BERT).

Loaded from a Hugging Face ``tokenizer.json``, a folder with ``vocab.txt`` (WordPiece), CLIP's
``vocab.json`` + ``merges.txt`` (``from_clip_files``: the tokenizer.json HF writes for CLIP,
synthesized from them), or the ``tokenizer.ggml.*`` keys of GGUF metadata.  Encoding and
decoding follow the Hugging Face ``tokenizers`` library step for step (added tokens ->
normalizer -> pre-tokenizer -> model -> post-processor; decoder chain), so ids are equal.
Standard library + numpy only: the Unicode classes of HF's Oniguruma regexes and Rust tables
are rebuilt from ``unicodedata`` (plus small tables for where HF's Unicode versions differ from
Python's: categories, lowercasing, normalization), and Oniguruma patterns are translated to
``re``.  ``loom._native.bpe`` (Cython) runs the BPE merge loop when built; the
pure-Python loop here gives the same ids.

Bounded for untrusted text: BPE runs per pre-token with a heap (O(n log n), no length cap, so
ids never depend on one), results are cached per short pre-token in a bounded LRU, added-token
matching is linear, and decoding rejects ids outside the vocabulary.
"""
from __future__ import annotations

import codecs
import functools
import heapq
import json
import os
import re
import unicodedata

import numpy as np

from . import open_regular, outside_roots

try:  # the Cython merge loop; without it the pure-Python loop gives the same ids, slower
    from ._native import bpe as _native_bpe
except ImportError:  # pragma: no cover - depends on the build
    _native_bpe = None

__all__ = ["TokenizerError", "Tokenizer", "Detokenizer", "from_tokenizer_json",
           "from_gguf_metadata", "from_clip_files", "clip_tokenizer_json", "load"]


class TokenizerError(ValueError):
    """A tokenizer description we cannot honor, or input a tokenizer cannot take."""


# --------------------------------------------------------------------------- Unicode tables

_CATEGORIES = ("Cn Lu Ll Lt Lm Lo Mn Mc Me Nd Nl No Pc Pd Ps Pe Pi Pf Po Sm Sc Sk So "
               "Zs Zl Zp Cc Cf Cs Co").split()
_CAT_CODE = {c: i for i, c in enumerate(_CATEGORIES)}

# White_Space: what Oniguruma's \s and Rust's char::is_whitespace match.  Python's
# str.isspace()/re \s also accept U+001C..U+001F, which HF treats as ordinary characters.
_WS_RANGES = ((0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
              (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
              (0x3000, 0x3000))
_WS = "".join(chr(c) for lo, hi in _WS_RANGES for c in range(lo, hi + 1))

# Code points Python 3.11's Unicode 14 database leaves unassigned but Unicode 16 (the tables in
# HF's Oniguruma) assigns, with their category.  Applied only where unicodedata says "Cn", so a
# newer Python's own data wins.
_UNICODE16 = """
897:Mn cf3:Mc ece:Mn 1b4e-1b4f:Po 1b7f:Po 1c89:Lu 1c8a:Ll 2427-2429:So 2ffc-2fff:So
31e4-31e5:So 31ef:So a7cb-a7cc:Lu a7cd:Ll a7da:Lu a7db:Ll a7dc:Lu 105c0-105f3:Lo
10d40-10d49:Nd 10d4a-10d4d:Lo 10d4e:Lm 10d4f:Lo 10d50-10d65:Lu 10d69-10d6d:Mn 10d6e:Pd
10d6f:Lm 10d70-10d85:Ll 10d8e-10d8f:Sm 10ec2-10ec4:Lo 10efc-10eff:Mn 1123f-11240:Lo 11241:Mn
11380-11389:Lo 1138b:Lo 1138e:Lo 11390-113b5:Lo 113b7:Lo 113b8-113ba:Mc 113bb-113c0:Mn
113c2:Mc 113c5:Mc 113c7-113ca:Mc 113cc-113cd:Mc 113ce:Mn 113cf:Mc 113d0:Mn 113d1:Lo 113d2:Mn
113d3:Lo 113d4-113d5:Po 113d7-113d8:Po 113e1-113e2:Mn 116d0-116e3:Nd 11b00-11b09:Po
11bc0-11be0:Lo 11be1:Po 11bf0-11bf9:Nd 11f00-11f01:Mn 11f02:Lo 11f03:Mc 11f04-11f10:Lo
11f12-11f33:Lo 11f34-11f35:Mc 11f36-11f3a:Mn 11f3e-11f3f:Mc 11f40:Mn 11f41:Mc 11f42:Mn
11f43-11f4f:Po 11f50-11f59:Nd 11f5a:Mn 1342f:Lo 13439-1343f:Cf 13440:Mn 13441-13446:Lo
13447-13455:Mn 13460-143fa:Lo 16100-1611d:Lo 1611e-16129:Mn 1612a-1612c:Mc 1612d-1612f:Mn
16130-16139:Nd 16d40-16d42:Lm 16d43-16d6a:Lo 16d6b-16d6c:Lm 16d6d-16d6f:Po 16d70-16d79:Nd
18cff:Lo 1b132:Lo 1b155:Lo 1cc00-1ccef:So 1ccf0-1ccf9:Nd 1cd00-1ceb3:So 1d2c0-1d2d3:No
1df25-1df2a:Ll 1e030-1e06d:Lm 1e08f:Mn 1e4d0-1e4ea:Lo 1e4eb:Lm 1e4ec-1e4ef:Mn 1e4f0-1e4f9:Nd
1e5d0-1e5ed:Lo 1e5ee-1e5ef:Mn 1e5f0:Lo 1e5f1-1e5fa:Nd 1e5ff:Po 1f6dc:So 1f774-1f776:So
1f77b-1f77f:So 1f7d9:So 1f8b2-1f8bb:So 1f8c0-1f8c1:So 1fa75-1fa77:So 1fa87-1fa89:So 1fa8f:So
1faad-1faaf:So 1fabb-1fabf:So 1fac6:So 1face-1facf:So 1fada-1fadc:So 1fadf:So 1fae8-1fae9:So
1faf7-1faf8:So 1fbcb-1fbef:So 2b739:Lo 2ebf0-2ee5d:Lo 31350-323af:Lo
"""

# Code points Python 3.11's normalization data (Unicode 14) acts on but HF's (the
# unicode-normalization-alignments crate, Unicode 9) does not know, so HF leaves them as they
# are, as starters (combining class 0): the combining marks of Unicode 10 to 14, characters
# with decompositions from Unicode 12 to 14, and Dives Akuru's composition 11935 11930 -> 11938.
_NORM_OLDER = """
7fd 898-89f 8ca-8d3 9fe c3c d3b-d3c eba 1715 1abf-1ace 1df6-1dfa 32ff a7f2-a7f4 a82c ab69
10781-10785 10787-107b0 107b2-107ba 10d24-10d27 10eab-10eac 10f46-10f50 10f82-10f85 11070
1133b 1145e 11839-1183a 11930 11935 11938 1193d-1193e 11943 119e0 11a34 11a47 11a99 11d42
11d44-11d45 11d97 16ff0-16ff1 1e130-1e136 1e2ae 1e2ec-1e2ef 1f16c 1fbf0-1fbf9
"""

# HF's BERT normalizer/pre-tokenizer classify with the `unicode_categories` crate, whose tables
# predate Unicode 10.  Differences from Python 3.11's Unicode 14 tables:
_BERT_PUNCT_EXTRA = "166d 111c9"
_BERT_PUNCT_EXCLUDE = """61d 9fd a76 c77 c84 1b7d-1b7e 2e43-2e4f 2e52-2e5d 10ead 10f55-10f59
10f86-10f89 1144b-1144f 1145a-1145b 1145d 11660-1166c 116b9 1183b 11944-11946 119e2 11a3f-11a46
11a9a-11a9c 11a9e-11aa2 11c41-11c45 11c70-11c71 11ef7-11ef8 11fff 12ff1-12ff2 16e97-16e9a 16fe2
1e95e-1e95f"""
_BERT_MN_EXTRA = "1734"
_BERT_MN_EXCLUDE = """7fd 898-89f 8ca-8e1 9fe afa-aff b55 c04 c3c d00 d3b-d3c d81 eba 180f
1885-1886 1abf-1ace 1df6-1dfb a82c a8c5 a8ff a9bd 10d24-10d27 10eab-10eac 10f46-10f50
10f82-10f85 11070 11073-11074 110c2 111c9 111cf 1123e 1133b 11438-1143f 11442-11444 11446 1145e
1182f-11837 11839-1183a 1193b-1193c 1193e 11943 119d4-119d7 119da-119db 119e0 11a01-11a0a
11a33-11a38 11a3b-11a3e 11a47 11a51-11a56 11a59-11a5b 11a8a-11a96 11a98-11a99 11c30-11c36
11c38-11c3d 11c3f 11c92-11ca7 11caa-11cb0 11cb2-11cb3 11cb5-11cb6 11d31-11d36 11d3a 11d3c-11d3d
11d3f-11d45 11d47 11d90-11d91 11d95 11d97 11ef3-11ef4 16f4f 16fe4 1cf00-1cf2d 1cf30-1cf46
1e000-1e006 1e008-1e018 1e01b-1e021 1e023-1e024 1e026-1e02a 1e130-1e136 1e2ae 1e2ec-1e2ef
1e944-1e94a"""
_BERT_CTL_EXCLUDE = "890-891 8e2 110cd 13430-13438"
# BertNormalizer's "Chinese character" blocks, as HF spells them.
_CJK_RANGES = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x2A6DF),
               (0x2A700, 0x2B81F), (0x2B920, 0x2CEAF), (0x2F800, 0x2FA1F))


def _parse_ranges(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split():
        lo, _, hi = item.partition("-")
        out.append((int(lo, 16), int(hi or lo, 16)))
    return out


@functools.lru_cache(maxsize=2)
def _category_array(patched: bool) -> np.ndarray:
    """Category code per code point; built once (about 0.2 s)."""
    cats = map(unicodedata.category, map(chr, range(0x110000)))
    arr = np.frombuffer(bytes(map(_CAT_CODE.__getitem__, cats)), dtype=np.uint8).copy()
    if patched:
        for item in _UNICODE16.split():
            span, cat = item.split(":")
            lo, hi = _parse_ranges(span)[0]
            seg = arr[lo:hi + 1]
            seg[seg == 0] = _CAT_CODE[cat]
    return arr


def _mask_ranges(mask: np.ndarray) -> list[tuple[int, int]]:
    m = np.concatenate(([0], mask.astype(np.int8), [0]))
    d = np.diff(m)
    return list(zip(np.flatnonzero(d == 1).tolist(), (np.flatnonzero(d == -1) - 1).tolist()))


def _ranges_body(ranges) -> str:
    """Regex character-class body for inclusive code point ranges."""
    return "".join("\\U%08x" % lo if lo == hi else "\\U%08x-\\U%08x" % (lo, hi)
                   for lo, hi in ranges)


def _complement(ranges) -> list[tuple[int, int]]:
    out, nxt = [], 0
    for lo, hi in sorted(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = max(nxt, hi + 1)
    if nxt <= 0x10FFFF:
        out.append((nxt, 0x10FFFF))
    return out


@functools.lru_cache(maxsize=None)
def _category_ranges(cats: frozenset, patched: bool = True) -> tuple:
    arr = _category_array(patched)
    return tuple(_mask_ranges(np.isin(arr, [_CAT_CODE[c] for c in cats])))


_PROPERTY_ALIASES = {"letter": "L", "mark": "M", "number": "N", "punctuation": "P",
                     "symbol": "S", "separator": "Z", "other": "C"}


def _property(name: str) -> tuple:
    """Ranges of a \\p{...} general-category property, in Oniguruma's loose spelling."""
    key = re.sub(r"[\s_-]", "", name).lower()
    key = _PROPERTY_ALIASES.get(key, key)
    cats = [c for c in _CATEGORIES if c.lower() == key or c[0].lower() == key]
    if not cats or len(key) > 2:
        raise TokenizerError(f"unsupported regex property \\p{{{name}}}")
    return _category_ranges(frozenset(cats))


_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def _bmp(ranges) -> list:
    return [(lo, min(hi, 0xFFFF)) for lo, hi in ranges if lo <= 0xFFFF]


class _Rx:
    """A pattern compiled twice: with full Unicode classes, and with the classes cut to the BMP.

    Python's re checks a class's ranges above U+FFFF one by one, which makes \\p{L}-sized
    classes about 6x slower.  Text without astral characters matches the same either way, so
    it gets the fast copy.  When only spans are needed and the pattern tells characters apart
    by general category alone (`stand_ins`), astral text is searched as a "shadow" in which each
    astral character is replaced by a BMP character of the same category.  A one-class pattern
    given its `members` (a per-code-point mask) also takes the fast copy when none of the
    astral characters present belongs to the class."""

    __slots__ = ("full", "fast", "groups", "stand_ins", "members")

    def __init__(self, build, flags=0, stand_ins=None, members=None):  # build(bmp_only) -> source
        self.full = re.compile(build(False), flags)
        try:
            self.fast = re.compile(build(True), flags)
        except re.error:  # e.g. a class with only astral members: keep the full one
            self.fast = self.full
        self.groups = self.full.groups
        self.stand_ins = stand_ins if self.fast is not self.full else None
        self.members = members

    def pick(self, s: str) -> re.Pattern:
        if self.fast is self.full:
            return self.full
        if self.members is None:
            return self.full if _ASTRAL.search(s) else self.fast
        members = self.members
        if any(members[ord(c)] for c in set(_ASTRAL.findall(s))):
            return self.full
        return self.fast

    def view(self, s: str) -> tuple:
        """(pattern, text of the same length) whose match spans are the spans in s."""
        if self.stand_ins is None or not _ASTRAL.search(s):
            return self.pick(s), s
        cats, reps = _category_array(True), self.stand_ins
        return self.fast, _ASTRAL.sub(lambda m: reps[cats[ord(m.group())]], s)

    def findall(self, s):
        return self.pick(s).findall(s)

    def finditer(self, s):
        return self.pick(s).finditer(s)

    def sub(self, repl, s):
        return self.pick(s).sub(repl, s)

    def split(self, s):
        return self.pick(s).split(s)


@functools.lru_cache(maxsize=None)
def _bert_classes() -> dict:
    """Regexes for BERT's control, whitespace, punctuation and non-spacing-mark classes."""
    arr = _category_array(False)
    code = lambda names: [_CAT_CODE[n] for n in names]  # noqa: E731
    punct = np.isin(arr, code(["Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po"]))
    for c in '!"#$%&\'()*+,-./:;<=>?@[\\]^_`{|}~':
        punct[ord(c)] = True
    mn = arr == _CAT_CODE["Mn"]
    ctl = np.isin(arr, code(["Cc", "Cf", "Co"]))
    for mask, extra, exclude in ((punct, _BERT_PUNCT_EXTRA, _BERT_PUNCT_EXCLUDE),
                                 (mn, _BERT_MN_EXTRA, _BERT_MN_EXCLUDE),
                                 (ctl, "0 fffd", _BERT_CTL_EXCLUDE)):
        for lo, hi in _parse_ranges(extra):
            mask[lo:hi + 1] = True
        for lo, hi in _parse_ranges(exclude):
            mask[lo:hi + 1] = False
    for c in "\t\n\r":
        ctl[ord(c)] = False
    ws = _ranges_body(_WS_RANGES)
    cjk = np.zeros(0x110000, dtype=bool)
    for lo, hi in _CJK_RANGES:
        cjk[lo:hi + 1] = True

    def cls(fmt, mask, uses=1):
        ranges = _mask_ranges(mask)
        return _Rx(lambda bmp: fmt % ((_ranges_body(_bmp(ranges) if bmp else ranges),) * uses),
                   members=mask)
    return {
        "control": cls("[%s]+", ctl),
        "space": re.compile("[%s]" % ws.replace("\\U00000020", "")),  # ' ' is already ' '
        "mn": cls("[%s]+", mn),
        "cjk": cls("([%s])", cjk),
        "punct_char": cls("[%s]", punct),
        # BertPreTokenizer: drop whitespace, isolate each punctuation char, keep other runs
        # (an astral character outside the class is an "other" either way).
        "pretok": cls("[%s]|[^%s" + ws + "]+", punct, uses=2),
    }


# Lowercase mappings that Rust's char::to_lowercase (HF's Lowercase; Unicode 17 in tokenizers
# 0.23) has for letters Python 3.11's Unicode 14 leaves unassigned: Cyrillic TJE, Latin letters
# of Unicode 16/17, Garay and Beria Erfe capitals.  Kept only where unicodedata says "Cn", so a
# newer Python's own data wins.
_LOWER_NEWER = {c: t for c, t in {
    0x1C89: 0x1C8A, 0xA7CB: 0x0264, 0xA7CC: 0xA7CD, 0xA7CE: 0xA7CF, 0xA7D2: 0xA7D3, 0xA7D4: 0xA7D5,
    0xA7DA: 0xA7DB, 0xA7DC: 0x019B, **{c: c + 0x20 for c in range(0x10D50, 0x10D66)},
    **{c: c + 0x1B for c in range(0x16EA0, 0x16EB9)}}.items()
    if unicodedata.category(chr(c)) == "Cn"}
_LOWER_NEWER_RX = re.compile("[%s]" % "".join(map(chr, _LOWER_NEWER))) if _LOWER_NEWER else None


def _lower(s: str) -> str:
    # Rust lowercases char by char; Python applies the final-sigma rule, so pre-map capital sigma.
    s = s.replace("\u03a3", "\u03c3").lower()
    if _LOWER_NEWER_RX is not None and not s.isascii() and _LOWER_NEWER_RX.search(s):
        s = s.translate(_LOWER_NEWER)
    return s


# --------------------------------------------------------------------------- Oniguruma -> re

_ESCAPE_CLASSES = {"s": lambda: _WS_RANGES, "d": lambda: _category_ranges(frozenset(["Nd"])),
                   "w": lambda: _category_ranges(frozenset(
                       ["Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Pc"])),
                   "h": lambda: ((0x30, 0x39), (0x41, 0x46), (0x61, 0x66))}


@functools.lru_cache(maxsize=64)
def _compile_onig(pattern: str) -> _Rx:
    try:
        return _Rx(functools.partial(_translate_onig, pattern), re.MULTILINE,
                   _stand_ins(pattern))
    except re.error as exc:
        raise TokenizerError(f"unsupported regex {pattern!r}: {exc}") from None


_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "a": "\a",
                   "e": "\x1b"}


def _literals(pattern: str):
    """The literal characters of an Oniguruma pattern, or None if the pattern could tell an
    astral character from a BMP character of the same general category: hex or astral
    literals, anchors such as \\b, ranges inside a class, or a case-insensitive class."""
    lits, i, n, in_class, first = set(), 0, len(pattern), False, 0
    while i < n:
        c = pattern[i]
        if c == "\\":
            e = pattern[i + 1:i + 2]
            if e in ("p", "P"):
                j = pattern.find("}", i) if pattern.startswith("{", i + 2) else i + 2
                i = j + 1
                continue
            if e and e in "sSdDwWhH":
                pass
            elif e in _SIMPLE_ESCAPES:
                lits.add(_SIMPLE_ESCAPES[e])
            elif e and not e.isalnum() and ord(e) < 0x80:
                lits.add(e)
            else:
                return None
            i += 2
            continue
        if ord(c) > 0xFFFF:
            return None
        if in_class:
            if c == "]" and i > first:
                in_class = False
            elif c == "-" and i > first and pattern[i + 1:i + 2] != "]":
                return None
        elif c == "[":
            in_class, first = True, i + 1 + (pattern[i + 1:i + 2] == "^")
            i = first
            continue
        lits.add(c)
        i += 1
    for m in re.finditer(r"\(\?[a-z]*i[a-z-]*([:)])", pattern):
        scope = pattern[m.end():] if m.group(1) == ")" else pattern[m.end():_group_end(pattern,
                                                                                   m.end())]
        if re.search(r"\\[pPdDwW]|\[|\.", scope):
            return None
    return lits


def _group_end(pattern: str, i: int) -> int:
    depth = 1
    while i < len(pattern) and depth:
        depth += {"(": 1, ")": -1}.get(pattern[i], 0)
        i += 2 if pattern[i] == "\\" else 1
    return i


@functools.lru_cache(maxsize=64)
def _stand_ins(pattern: str):
    """A BMP stand-in per general category (indexed by category code) for searching astral
    text with `pattern`, or None when that could change its matches."""
    lits = _literals(pattern)
    if lits is None:
        return None
    taken = set()
    for ch in lits:  # no stand-in may equal a literal, even case-insensitively
        taken.update(ch + ch.lower() + ch.upper() + ch.casefold())
    cats = _category_array(True)
    reps = [None] * len(_CATEGORIES)
    for code in np.unique(cats[0x10000:]).tolist():
        for cp in (np.flatnonzero(cats[0xA0:0x10000] == code) + 0xA0).tolist()[:64]:
            ch = chr(cp)
            if not taken & set(ch + ch.lower() + ch.upper() + ch.casefold()):
                reps[code] = ch
                break
        else:
            return None
    return reps


def _translate_onig(pattern: str, bmp_only: bool) -> str:
    """An Oniguruma (Ruby syntax) pattern as Python re source.

    \\p{..} classes, \\s, \\d, \\w and \\h become explicit Unicode ranges (cut to the BMP when
    bmp_only); ^/$ stay line anchors (compiled with re.M) and Ruby's (?m) becomes (?s).
    Constructs without an exact re equivalent (nested classes, set intersection, properties
    other than general categories, such as scripts) raise TokenizerError.
    """
    out, i, n, in_class = [], 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            ranges, negate = None, False
            if e in "pP":
                if pattern.startswith("{", i + 2):
                    j = pattern.find("}", i + 3)
                    if j < 0:
                        raise TokenizerError(f"bad regex property in {pattern!r}")
                    name, i = pattern[i + 3:j], j + 1
                else:
                    name, i = pattern[i + 2:i + 3], i + 3
                negate = e == "P"
                if name.startswith("^"):
                    negate, name = not negate, name[1:]
                ranges = _property(name)
            elif e.lower() in _ESCAPE_CLASSES:
                ranges, negate, i = _ESCAPE_CLASSES[e.lower()](), e.isupper(), i + 2
            elif e == "x" and pattern.startswith("{", i + 2):
                j = pattern.find("}", i + 3)
                if j < 0 or not re.fullmatch(r"[0-9A-Fa-f]{1,6}", pattern[i + 3:j]):
                    raise TokenizerError(f"bad \\x{{..}} escape in {pattern!r}")
                out.append("\\U%08x" % int(pattern[i + 3:j], 16))
                i = j + 1
                continue
            elif e == "z" and not in_class:
                out.append("\\Z")
                i += 2
                continue
            elif e == "Z" and not in_class:
                out.append("(?=\\n?\\Z)")
                i += 2
                continue
            else:
                out.append(pattern[i:i + 2])
                i += 2
                continue
            if in_class:
                ranges = _complement(ranges) if negate else ranges
                out.append(_ranges_body(_bmp(ranges) if bmp_only else ranges))
            else:
                out.append(("[^%s]" if negate else "[%s]") % _ranges_body(
                    _bmp(ranges) if bmp_only else ranges))
            continue
        if in_class:
            if c == "[" or pattern.startswith("&&", i):
                raise TokenizerError(f"unsupported nested character class in {pattern!r}")
            if c == "]":
                in_class = False
        elif c == "[":
            in_class = True
            j = i + 1 + (pattern.startswith("^", i + 1))
            if pattern.startswith("]", j):  # a leading ']' is literal
                out.append(pattern[i:j] + "\\]")
                i = j + 1
                continue
        elif c == "(" and pattern.startswith("(?", i):
            m = re.match(r"\(\?([imx]*)(?:-([imx]*))?([:)])", pattern[i:])
            if m:  # Ruby's (?m) is Python's (?s)
                on, off = m.group(1).replace("m", "s"), (m.group(2) or "").replace("m", "s")
                out.append("(?" + on + ("-" + off if off else "") + m.group(3))
                i += m.end()
                continue
        out.append(c)
        i += 1
    return "".join(out)


# --------------------------------------------------------------------------- byte-level map

def _bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = [""] * 256
    for b, c in zip(bs, cs):
        table[b] = chr(c)
    return table


_BYTE_CHARS = _bytes_to_unicode()
_BYTE_ENCODE = {i: ch for i, ch in enumerate(_BYTE_CHARS)}  # latin-1 ordinal -> mapped char
_BYTE_DECODE = {ch: i for i, ch in enumerate(_BYTE_CHARS)}


def _byte_level(s: str) -> str:
    return s.encode("utf-8").decode("latin-1").translate(_BYTE_ENCODE)


def _byte_level_bytes(token: str) -> bytes:
    try:
        return bytes(map(_BYTE_DECODE.__getitem__, token))
    except KeyError:  # not byte-level text (e.g. an added token): its own UTF-8
        return token.encode("utf-8")


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>\Z")


# --------------------------------------------------------------------------- models

# Longest pre-token whose result is kept in the LRU (longer ones are rare and would pin memory).
_CACHE_WORD_CHARS = 48
_CACHE_SIZE = 1 << 15


class _BPE:
    """HF `models.BPE` without dropout: merges applied by (rank, position) with a heap."""

    def __init__(self, vocab: dict, merges: list, *, unk=None, prefix=None, suffix=None,
                 fuse_unk=False, byte_fallback=False, ignore_merges=False):
        self.vocab = vocab
        self.unk_id = None
        if unk is not None:
            if unk not in vocab:
                raise TokenizerError(f"unk_token {unk!r} is not in the vocabulary")
            self.unk_id = vocab[unk]
        self.prefix, self.suffix = prefix or None, suffix or None
        self.fuse_unk, self.byte_fallback, self.ignore_merges = fuse_unk, byte_fallback, ignore_merges
        self.width = max(vocab.values(), default=0) + 1
        plen = len(self.prefix or "")
        pairs = {}
        for rank, (a, b) in enumerate(merges):
            try:
                ia, ib, new = vocab[a], vocab[b], vocab[a + b[plen:]]
            except KeyError:
                raise TokenizerError(f"merge {a!r} {b!r} uses a token outside the vocabulary") \
                    from None
            pairs[ia * self.width + ib] = (rank, new)  # a repeated merge keeps its last rank, as HF
        self.pairs = pairs
        self.table = _native_bpe.MergeTable(pairs, self.width) if _native_bpe else None
        self.byte_ids = None
        if byte_fallback:
            self.byte_ids = [vocab.get("<0x%02X>" % b) for b in range(256)]

    def symbols(self, w: str) -> list:
        get = self.vocab.get
        if self.prefix is None and self.suffix is None:
            ids = list(map(get, w))
            if None not in ids:
                return ids
        ids, unk = [], None
        last = len(w) - 1
        for i, ch in enumerate(w):
            s = ch
            if i and self.prefix:
                s = self.prefix + s
            if i == last and self.suffix:
                s = s + self.suffix
            tid = get(s)
            if tid is not None:
                if unk is not None:
                    ids.append(unk)
                    unk = None
                ids.append(tid)
                continue
            if self.byte_ids is not None:
                bts = [self.byte_ids[b] for b in s.encode("utf-8")]
                if None not in bts:
                    ids.extend(bts)  # HF quirk: a pending unk is emitted after these
                    continue
            if self.unk_id is not None:
                if unk is not None and not self.fuse_unk:
                    ids.append(unk)
                unk = self.unk_id
        if unk is not None:
            ids.append(unk)
        return ids

    def word(self, w: str) -> tuple:
        if self.ignore_merges:
            tid = self.vocab.get(w)
            if tid is not None:
                return (tid,)
        return tuple(self.merge(self.symbols(w)))

    def merge(self, c: list) -> list:
        if self.table is not None:
            return self.table.merge(c)
        return self.merge_py(c)

    def merge_py(self, c: list) -> list:
        n = len(c)
        if n < 2:
            return c
        pairs, width = self.pairs, self.width
        get = pairs.get
        heap = []
        for i in range(n - 1):
            m = get(c[i] * width + c[i + 1])
            if m is not None:
                heap.append((m[0], i, m[1]))
        if not heap:
            return c
        if len(heap) == 1 and n == 2:
            return [heap[0][2]]
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        alive = [True] * n
        while heap:
            _, pos, new = pop(heap)
            if not alive[pos]:
                continue
            j = nxt[pos]
            if j < 0:
                continue
            m = get(c[pos] * width + c[j])
            if m is None or m[1] != new:  # stale entry: the pair at pos changed
                continue
            c[pos] = new
            alive[j] = False
            k = nxt[j]
            nxt[pos] = k
            if k >= 0:
                prv[k] = pos
                m = get(new * width + c[k])
                if m is not None:
                    push(heap, (m[0], pos, m[1]))
            p = prv[pos]
            if p >= 0:
                m = get(c[p] * width + new)
                if m is not None:
                    push(heap, (m[0], p, m[1]))
        return [x for x, a in zip(c, alive) if a]

    def mergeable_tokens(self):
        return self.vocab.keys()


class _SentencePieceBPE:
    """SentencePiece BPE from GGUF scores: repeatedly merge the adjacent pair whose merged piece
    scores highest (ties: leftmost); characters outside the vocabulary become <0xXX> bytes."""

    def __init__(self, vocab: dict, scores: dict, byte_ids: list, unk_id):
        self.vocab, self.scores, self.byte_ids, self.unk_id = vocab, scores, byte_ids, unk_id

    def word(self, w: str) -> tuple:
        sym = list(w)
        n = len(sym)
        if not n:
            return ()
        scores = self.scores
        heap = []
        if n > 1:
            for i in range(n - 1):
                sc = scores.get(sym[i] + sym[i + 1])
                if sc is not None:
                    heap.append((-sc, i, i + 1, len(sym[i]) + len(sym[i + 1])))
            heapq.heapify(heap)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        size = [len(s) for s in sym]
        while heap:
            _, left, right, total = heapq.heappop(heap)
            if not size[left] or not size[right] or size[left] + size[right] != total:
                continue  # one side already merged elsewhere
            sym[left] += sym[right]
            size[left] = total
            size[right] = 0
            k = nxt[right]
            nxt[left] = k
            if k >= 0:
                prv[k] = left
                sc = scores.get(sym[left] + sym[k])
                if sc is not None:
                    heapq.heappush(heap, (-sc, left, k, total + size[k]))
            p = prv[left]
            if p >= 0:
                sc = scores.get(sym[p] + sym[left])
                if sc is not None:
                    heapq.heappush(heap, (-sc, p, left, size[p] + total))
        out = []
        get = self.vocab.get
        for s, sz in zip(sym, size):
            if not sz:
                continue
            tid = get(s)
            if tid is not None:
                out.append(tid)
                continue
            for b in s.encode("utf-8"):
                bid = self.byte_ids[b]
                if bid is None:
                    bid = self.unk_id
                if bid is None:
                    raise TokenizerError("character outside the vocabulary and no byte tokens")
                out.append(bid)
        return tuple(out)

    def mergeable_tokens(self):
        return self.scores.keys()


class _WordPiece:
    """HF `models.WordPiece`: greedy longest-match-first with a continuation prefix."""

    def __init__(self, vocab: dict, unk: str, prefix: str = "##", max_chars: int = 100):
        if unk not in vocab:
            raise TokenizerError(f"unk_token {unk!r} is not in the vocabulary")
        self.vocab, self.unk_id, self.prefix, self.max_chars = vocab, vocab[unk], prefix, max_chars
        # No token is longer than this, so matching never needs to try longer substrings.
        self.longest = max((len(t) for t in vocab), default=1)

    def word(self, w: str) -> tuple:
        if len(w) > self.max_chars:
            return (self.unk_id,)
        vocab, prefix, out, start, n = self.vocab, self.prefix, [], 0, len(w)
        while start < n:
            end = min(n, start + self.longest)
            while end > start:
                sub = w[start:end] if not start else prefix + w[start:end]
                tid = vocab.get(sub)
                if tid is not None:
                    out.append(tid)
                    break
                end -= 1
            else:
                return (self.unk_id,)
            start = end
        return tuple(out)


# --------------------------------------------------------------------------- normalizers

def _pattern(spec):
    """A tokenizer.json {"String": ..} or {"Regex": ..} pattern (re.Pattern or _Rx)."""
    if not isinstance(spec, dict) or len(spec) != 1:
        raise TokenizerError(f"bad pattern {spec!r}")
    (kind, value), = spec.items()
    if kind == "String":
        return re.compile(re.escape(value))
    if kind == "Regex":
        return _compile_onig(value)
    raise TokenizerError(f"unsupported pattern kind {kind!r}")


def _build_normalizer(spec):
    """A str -> str function for a tokenizer.json normalizer (None for none)."""
    if spec is None:
        return None
    kind = spec.get("type")
    if kind == "Sequence":
        steps = [f for f in map(_build_normalizer, spec["normalizers"]) if f is not None]

        def seq(s):
            for f in steps:
                s = f(s)
            return s
        return seq
    if kind == "Prepend":
        pre = spec["prepend"]
        return lambda s: pre + s if s else s
    if kind == "Replace":
        rx, content = _pattern(spec["pattern"]), spec["content"]
        return lambda s: rx.sub(lambda m: content, s)
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return _unicode_normalizer(kind)
    if kind == "Lowercase":
        return _lower
    if kind == "Strip":
        left, right = spec.get("strip_left", True), spec.get("strip_right", True)

        def strip(s):
            s = s.lstrip(_WS) if left else s
            return s.rstrip(_WS) if right else s
        return strip
    if kind == "StripAccents":
        mn = _bert_classes()["mn"]
        return lambda s: mn.sub("", s)
    if kind == "ByteLevel":
        return _byte_level
    if kind == "BertNormalizer":
        return _bert_normalizer(spec.get("clean_text", True), spec.get("handle_chinese_chars", True),
                                spec.get("strip_accents"), spec.get("lowercase", True))
    raise TokenizerError(f"unsupported normalizer {kind!r}")


@functools.lru_cache(maxsize=1)
def _norm_older_rx() -> re.Pattern:
    return re.compile("([%s])" % _ranges_body(_parse_ranges(_NORM_OLDER)))


def _unicode_normalizer(form: str):
    """unicodedata.normalize(form) as HF applies it: the characters its older tables do not know
    pass through unchanged, and as starters they end the text around them for reordering and
    composition, so each stretch between them normalizes on its own."""
    rx = _norm_older_rx()

    def normalize(s):
        if s.isascii():  # ASCII is its own normal form in all four
            return s
        if not rx.search(s):
            return unicodedata.normalize(form, s)
        parts = rx.split(s)  # odd items: the characters HF's tables do not know
        return "".join(p if i % 2 else unicodedata.normalize(form, p) for i, p in enumerate(parts))
    return normalize


def _bert_normalizer(clean_text, handle_chinese, strip_accents, lowercase):
    t = _bert_classes()
    if strip_accents is None:  # HF: unset means "same as lowercase"
        strip_accents = lowercase

    def normalize(s):
        if clean_text:
            s = t["space"].sub(" ", t["control"].sub("", s))
        if handle_chinese:  # " ".join of the split puts a space on each side of each one
            s = " ".join(t["cjk"].split(s))
        if strip_accents and not s.isascii():  # ASCII has no marks and is its own NFD
            s = t["mn"].sub("", unicodedata.normalize("NFD", s))
        if lowercase:
            s = _lower(s)
        return s
    return normalize


# --------------------------------------------------------------------------- pre-tokenizers
# A pre-tokenizer step maps a list of (text, starts_at_offset_0) pieces to a new list.

_BEHAVIORS = {"removed", "isolated", "mergedwithprevious", "mergedwithnext", "contiguous"}


def _split_spans(s: str, rx, behavior: str, invert: bool) -> list:
    """HF NormalizedString::split: (start, end) spans kept, in order."""
    spans, prev = [], 0
    pattern, view = rx.view(s) if rx.__class__ is _Rx else (rx, s)
    for m in pattern.finditer(view):
        a, b = m.span()
        if a == b:
            continue
        if prev < a:
            spans.append((prev, a, invert))
        spans.append((a, b, not invert))
        prev = b
    if prev < len(s):
        spans.append((prev, len(s), invert))
    if behavior == "isolated":
        return [(a, b) for a, b, _ in spans]
    if behavior == "removed":
        return [(a, b) for a, b, is_match in spans if not is_match]
    out, previous = [], False
    if behavior == "mergedwithnext":
        for a, b, is_match in reversed(spans):
            if is_match and not previous and out:
                out[-1] = (a, out[-1][1])
            else:
                out.append((a, b))
            previous = is_match
        return out[::-1]
    for a, b, is_match in spans:
        if out and ((behavior == "contiguous" and is_match == previous) or
                    (behavior == "mergedwithprevious" and is_match and not previous)):
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
        previous = is_match
    return out


def _splitter(rx: re.Pattern, behavior: str, invert: bool = False):
    def step(pieces):
        out = []
        for s, at0 in pieces:
            for a, b in _split_spans(s, rx, behavior, invert):
                out.append((s[a:b], at0 and a == 0))
        return out
    return step


def _build_pretokenizer(spec) -> list:
    """Flattened list of steps; ("regex", rx) and ("bytelevel",) are recognized for fast paths."""
    if spec is None:
        return []
    kind = spec.get("type")
    if kind == "Sequence":
        return [st for sub in spec["pretokenizers"] for st in _build_pretokenizer(sub)]
    if kind == "ByteLevel":
        steps = []
        if spec.get("add_prefix_space", True):
            steps.append(("prefix_space",))
        if spec.get("use_regex", True):
            steps.append(("regex", _compile_onig(_GPT2_REGEX), "isolated", False))
        return steps + [("bytelevel",)]
    if kind == "Split":
        behavior = str(spec.get("behavior", "Isolated")).lower()
        if behavior not in _BEHAVIORS:
            raise TokenizerError(f"unsupported split behavior {spec.get('behavior')!r}")
        return [("regex", _pattern(spec["pattern"]), behavior, bool(spec.get("invert", False)))]
    if kind == "Metaspace":
        rep = spec.get("replacement", "\u2581")
        scheme = spec.get("prepend_scheme")
        if scheme is None:
            scheme = "always" if spec.get("add_prefix_space", True) else "never"
        if scheme not in ("always", "first", "never"):
            raise TokenizerError(f"unsupported prepend_scheme {scheme!r}")
        return [("metaspace", rep, scheme, spec.get("split", True))]
    if kind == "BertPreTokenizer":
        return [("bert",)]
    if kind == "WhitespaceSplit":
        return [("regex", re.compile("[%s]+" % _ranges_body(_WS_RANGES)), "removed", False)]
    if kind == "Whitespace":
        # HF: Split(r"\w+|[^\w\s]+", Removed, invert=True) in Rust's regex, whose \w is
        # UTS#18's word class (join controls and circled letters included), not Oniguruma's.
        return [("regex", _rust_words(), "removed", True)]
    if kind == "Punctuation":
        behavior = str(spec.get("behavior", "Isolated")).lower()
        return [("regex", _bert_classes()["punct_char"], behavior, False)]
    if kind == "Digits":
        if spec.get("individual_digits", False):
            return [("regex", _compile_onig(r"\p{N}"), "isolated", False)]
        return [("regex", _compile_onig(r"\p{N}+"), "isolated", False)]
    if kind == "CharDelimiterSplit":
        return [("regex", re.compile(re.escape(spec["delimiter"])), "removed", False)]
    raise TokenizerError(f"unsupported pre_tokenizer {kind!r}")


# Other_Alphabetic code points outside the marks: circled and squared Latin letters.
_OTHER_ALPHABETIC = ((0x24B6, 0x24E9), (0x1F130, 0x1F149), (0x1F150, 0x1F169), (0x1F170, 0x1F189))


@functools.lru_cache(maxsize=1)
def _rust_words():
    word = _ranges_body(list(_category_ranges(frozenset(
        ["Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "Pc"]))) + [(0x200C, 0x200D)]
        + list(_OTHER_ALPHABETIC))
    return re.compile(f"[{word}]+|[^{word}{_ranges_body(_WS_RANGES)}]+")


_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _compile_steps(steps) -> list:
    fns = []
    for st in steps:
        kind = st[0]
        if kind == "prefix_space":
            fns.append(lambda ps: [(s if s.startswith(" ") else " " + s, a) for s, a in ps])
        elif kind == "regex":
            fns.append(_splitter(st[1], st[2], st[3]))
        elif kind == "bytelevel":
            fns.append(lambda ps: [(_byte_level(s), a) for s, a in ps])
        elif kind == "metaspace":
            fns.append(_metaspace_step(*st[1:]))
        elif kind == "bert":
            rx = _bert_classes()["pretok"]
            fns.append(lambda ps, rx=rx: [(w, False) for s, _ in ps for w in rx.findall(s)])
    return fns


def _metaspace_step(rep, scheme, split):
    rx = re.compile(re.escape(rep))

    def step(pieces):
        out = []
        for s, at0 in pieces:
            s = s.replace(" ", rep)
            if (scheme == "always" or (scheme == "first" and at0)) and not s.startswith(rep):
                s = rep + s
            if split:
                out.extend((s[a:b], at0 and a == 0)
                           for a, b in _split_spans(s, rx, "mergedwithnext", False))
            else:
                out.append((s, at0))
        return out
    return step


# --------------------------------------------------------------------------- decoders

def _build_decoder(spec) -> list:
    """Flattened decoder steps: tuples consumed by _decode_chain and the streaming plan."""
    if spec is None:
        return []
    kind = spec.get("type")
    if kind == "Sequence":
        return [st for sub in spec["decoders"] for st in _build_decoder(sub)]
    if kind == "ByteLevel":
        return [("bytelevel",)]
    if kind == "ByteFallback":
        return [("bytefallback",)]
    if kind == "Fuse":
        return [("fuse",)]
    if kind == "Replace":
        return [("replace", _pattern(spec["pattern"]), spec["content"])]
    if kind == "Strip":
        return [("strip", spec["content"], int(spec.get("start", 0)), int(spec.get("stop", 0)))]
    if kind == "Metaspace":
        scheme = spec.get("prepend_scheme")
        if scheme is None:
            scheme = "always" if spec.get("add_prefix_space", True) else "never"
        return [("metaspace", spec.get("replacement", "\u2581"), scheme != "never")]
    if kind == "WordPiece":
        return [("wordpiece", spec.get("prefix", "##"), spec.get("cleanup", True))]
    if kind == "BPEDecoder":
        return [("bpe", spec.get("suffix", "</w>"))]
    raise TokenizerError(f"unsupported decoder {kind!r}")


_WORDPIECE_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                      (" n't", "n't"), (" 'm", "'m"), (" do not", " don't"), (" 's", "'s"),
                      (" 've", "'ve"), (" 're", "'re"))


def _wordpiece_piece(tok: str, first: bool, prefix: str, cleanup: bool) -> str:
    if not first:
        tok = tok.replace(prefix, "", 1) if tok.startswith(prefix) else " " + tok
    if cleanup:
        for a, b in _WORDPIECE_CLEANUP:
            tok = tok.replace(a, b)
    return tok


def _strip_chars(tok: str, content: str, start: int, stop: int) -> str:
    a, b = 0, len(tok)
    while a < start and a < b and tok[a] == content:
        a += 1
    k = 0
    while k < stop and b > a and tok[b - 1] == content:
        b -= 1
        k += 1
    return tok[a:b]


def _decode_chain(steps, tokens: list) -> str:
    """HF's decoder chain over token strings."""
    if not steps:
        return " ".join(tokens)
    for st in steps:
        kind = st[0]
        if kind == "bytelevel":
            tokens = [b"".join(map(_byte_level_bytes, tokens)).decode("utf-8", "replace")]
        elif kind == "bytefallback":
            out, run = [], bytearray()
            for t in tokens + [None]:
                m = _BYTE_TOKEN.match(t) if t is not None and len(t) == 6 else None
                if m:
                    run.append(int(m.group(1), 16))
                    continue
                if run:  # a run of byte tokens: its text if valid UTF-8, else one U+FFFD per byte
                    try:
                        out.append(run.decode("utf-8"))
                    except UnicodeDecodeError:
                        out.extend("\ufffd" * len(run))
                    run = bytearray()
                if t is not None:
                    out.append(t)
            tokens = out
        elif kind == "fuse":
            tokens = ["".join(tokens)]
        elif kind == "replace":
            rx, content = st[1], st[2]
            tokens = [rx.sub(lambda m: content, t) for t in tokens]
        elif kind == "strip":
            tokens = [_strip_chars(t, *st[1:]) for t in tokens]
        elif kind == "metaspace":
            rep, drop_first = st[1], st[2]
            tokens = [t.replace(rep, "" if (i == 0 and drop_first) else " ")
                      for i, t in enumerate(tokens)]
        elif kind == "wordpiece":
            tokens = [_wordpiece_piece(t, i == 0, st[1], st[2]) for i, t in enumerate(tokens)]
        elif kind == "bpe":
            last = len(tokens) - 1
            tokens = [t.replace(st[1], "" if i == last else " ") for i, t in enumerate(tokens)]
    return "".join(tokens)


# --------------------------------------------------------------------------- added tokens

class _Added:
    __slots__ = ("content", "id", "special", "normalized", "lstrip", "rstrip", "single_word")

    def __init__(self, content, id, special=False, normalized=None, lstrip=False, rstrip=False,
                 single_word=False):
        if not isinstance(content, str) or not content or not isinstance(id, int):
            raise TokenizerError(f"bad added token {content!r}")
        self.content, self.id, self.special = content, id, bool(special)
        self.normalized = (not special) if normalized is None else bool(normalized)
        self.lstrip, self.rstrip, self.single_word = bool(lstrip), bool(rstrip), bool(single_word)


def _trie_regex(words) -> str:
    """A regex matching any of `words`, longest first at each position, shaped as a trie so a
    position costs the length of the longest candidate rather than the number of words."""
    root: dict = {}
    for w in words:
        node = root
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = True

    def emit(node) -> str:
        alts = []
        for ch, child in node.items():
            if ch == "":
                continue
            run = re.escape(ch)
            while len(child) == 1 and "" not in child:  # an unbranched chain needs no group
                (ch, child), = child.items()
                run += re.escape(ch)
            alts.append(run + emit(child))
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        # a terminal node tries the longer continuations first, then stops here
        return "(?:" + body + ")?" if "" in node else body
    return emit(root)


class _AddedMatcher:
    """Leftmost-longest matching of added tokens, as HF's Aho-Corasick (LeftmostLongest)."""

    _WORD = re.compile(r"\w")

    def __init__(self, patterns: dict):  # pattern text -> _Added
        self.by_text = patterns
        self.any_plain = any(not a.special for a in patterns.values())
        self.rx = re.compile(_trie_regex(patterns)) if patterns else None

    def split(self, s: str, at0: bool, parse_special: bool, out: list) -> None:
        """Append (text, at_offset_0) pieces and token ids for s to out."""
        if self.rx is None or (not parse_special and not self.any_plain):
            out.append((s, at0))
            return
        start, n = 0, len(s)
        ws_from = ws_end = -1  # the last whitespace run an rstrip scanned (keeps this linear)
        for m in self.rx.finditer(s):
            a, b = m.span()
            if a < start:  # inside the whitespace an rstrip token already took
                continue
            tok = self.by_text[m.group()]
            if tok.special and not parse_special:
                continue
            if tok.single_word and ((a and self._WORD.match(s[a - 1])) or
                                    (b < n and self._WORD.match(s[b]))):
                continue
            if tok.lstrip:  # spaces before it, but not those a previous token took
                while a > start and s[a - 1] in _WS:
                    a -= 1
            if tok.rstrip:
                if not ws_from <= b <= ws_end:
                    ws_from = ws_end = b
                    while ws_end < n and s[ws_end] in _WS:
                        ws_end += 1
                b = ws_end
            if start < a:
                out.append((s[start:a], at0 and start == 0))
            out.append(tok.id)
            start = b
        if start < n:
            out.append((s[start:], at0 and start == 0))


# --------------------------------------------------------------------------- tokenizer

class Tokenizer:
    """Text <-> token ids for one model.  Thread-safe: encoding state is read-only apart from the
    (thread-safe) per-pre-token LRU."""

    def __init__(self, *, model, normalizer=None, pretokenizer=(), decoder=(), added=(),
                 post=((), ()), bos_id=None, eos_id=None, pad_id=None, unk_id=None):
        self._model = model
        self._normalize = normalizer
        added = list(added)
        self._id_to_token: dict = {i: t for t, i in model.vocab.items()}
        for a in added:  # HF names a normalized added token by its normalized text
            self._id_to_token[a.id] = normalizer(a.content) if a.normalized and normalizer \
                else a.content
        self.vocab_size = max(self._id_to_token, default=-1) + 1
        if min(self._id_to_token, default=0) < 0:
            raise TokenizerError("negative token id")
        self.special = {a.content: a.id for a in added}
        self._special_ids = frozenset(a.id for a in added if a.special)
        # HF matches non-normalized added tokens on the raw text, then normalized ones on the
        # normalized pieces (their own content normalized the same way).
        self._raw_added = _AddedMatcher({a.content: a for a in added if not a.normalized})
        norm_added = {}
        for a in added:
            if a.normalized:
                text = normalizer(a.content) if normalizer else a.content
                if text:
                    norm_added.setdefault(text, a)
        self._norm_added = _AddedMatcher(norm_added) if norm_added else None
        self._prefix_ids, self._suffix_ids = list(post[0]), list(post[1])
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = bos_id, eos_id, pad_id, unk_id
        self.chat_template = None   # the Jinja chat template that came with this vocabulary, if any
        self._setup_pretokenizer(list(pretokenizer))
        self._decoder = list(decoder)
        self._setup_stream()
        self._cached_word = functools.lru_cache(maxsize=_CACHE_SIZE)(self._word)

    # -- pre-tokenization plan
    def _setup_pretokenizer(self, steps):
        # The model sees byte-level text; when ByteLevel is the last step its mapping is applied
        # per word inside the cached path instead of to every piece.
        self._word_map = None
        if steps and steps[-1][0] == "bytelevel":
            self._word_map = _byte_level
            steps = steps[:-1]
        self._fast_rx = None
        if len(steps) == 1 and steps[0][0] == "regex" and steps[0][2] == "isolated" \
                and not steps[0][3] and not steps[0][1].groups:
            self._fast_rx, steps = steps[0][1], []
        elif not steps:
            self._fast_rx = self._safe_split_regex()
        self._steps = _compile_steps(steps)

    def _safe_split_regex(self):
        """With no pre-tokenizer (SentencePiece style) the whole text is one word.  If no token
        can contain a non-'▁' character followed by '▁', no merge crosses such a boundary, so
        splitting there is exact and lets the LRU work."""
        model = self._model
        if not isinstance(model, (_BPE, _SentencePieceBPE)) or "\u2581" not in model.vocab:
            return None
        if isinstance(model, _BPE) and (model.ignore_merges or model.prefix or model.suffix):
            return None
        cross = re.compile("[^\u2581]\u2581")
        if any(cross.search(t) for t in model.mergeable_tokens()):
            return None
        return re.compile("\u2581*[^\u2581]+|\u2581+")

    def _word(self, w: str) -> tuple:
        if self._word_map is not None:
            w = self._word_map(w)
        return self._model.word(w)

    def _words(self, s: str, at0: bool) -> list:
        rx = self._fast_rx
        if rx is not None:
            pattern, view = rx.view(s) if rx.__class__ is _Rx else (rx, s)
            words = pattern.findall(view)
            if sum(map(len, words)) == len(s):  # the usual case: matches tile the text
                if view is not s:  # matched on the astral shadow: take the same spans of s
                    pos, spans = 0, []
                    for w in words:
                        spans.append(s[pos:pos + len(w)])
                        pos += len(w)
                    words = spans
                return words
            return [s[a:b] for a, b in _split_spans(s, rx, "isolated", False)]
        pieces = [(s, at0)]
        for f in self._steps:
            pieces = f(pieces)
        return [p for p, _ in pieces if p]

    # -- public API
    @functools.cached_property
    def max_token_chars(self):
        """The most characters one token stands for, or None when a token can stand for
        any number (WordPiece's unknown word)."""
        if isinstance(self._model, _WordPiece):
            return None
        return max(map(len, self._id_to_token.values()), default=1)

    def text_bound(self, tokens: int):
        """A length in characters past which a text surely encodes to more than `tokens`
        tokens (normalization may shrink text, so with a 4x margin); None if unbounded.
        Lets a caller refuse a huge text without spending a worker (and the GIL) on it."""
        longest = self.max_token_chars
        return None if longest is None else 4 * longest * (tokens + 1) + 1024

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True, limit=None) -> list:
        """Token ids of `text`. With `limit`, encoding stops soon after the ids pass it
        (the result is then longer than limit, and incomplete)."""
        if not isinstance(text, str):
            raise TokenizerError("text must be a string")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise TokenizerError("text contains unpaired surrogates") from None
        ids: list = []
        pieces: list = []
        stop = limit
        if text:
            self._raw_added.split(text, True, parse_special, pieces)
        cached, word, limit = self._cached_word, self._word, _CACHE_WORD_CHARS
        for piece in pieces:
            if piece.__class__ is int:
                ids.append(piece)
                continue
            s, at0 = piece
            if self._normalize is not None:
                s = self._normalize(s)
                if not s:
                    continue
            if self._norm_added is not None:
                parts: list = []
                self._norm_added.split(s, at0, parse_special, parts)
            else:
                parts = [(s, at0)]
            for part in parts:
                if part.__class__ is int:
                    ids.append(part)
                    continue
                for w in self._words(*part):
                    ids.extend(cached(w) if len(w) <= limit else word(w))
                    if stop is not None and len(ids) > stop:
                        return ids
        if add_special:
            ids = self._prefix_ids + ids + self._suffix_ids
        return ids

    def _check_ids(self, ids) -> list:
        """ids as a list of ints, each naming a token (numpy integers accepted, bools not)."""
        ids = list(ids)
        table = self._id_to_token
        for k, i in enumerate(ids):
            if i.__class__ is not int:
                if isinstance(i, bool) or not hasattr(i, "__index__"):
                    raise TokenizerError(f"token id {i!r} is not an integer")
                ids[k] = i = i.__index__()
            if i not in table:
                raise TokenizerError(f"token id {i} is outside the vocabulary")
        return ids

    def decode(self, ids, skip_special: bool = False) -> str:
        ids = self._check_ids(ids)
        table = self._id_to_token
        if skip_special:
            ids = [i for i in ids if i not in self._special_ids]
        return _decode_chain(self._decoder, [table[i] for i in ids])

    def token_bytes(self, id: int) -> bytes:
        """The bytes one token contributes to decoded text when it is not the first token."""
        return self._piece(self._check_ids([id])[0], False)

    def stream(self) -> "Detokenizer":
        return Detokenizer(self)

    def id_to_token(self, id: int) -> str:
        return self._id_to_token[self._check_ids([id])[0]]

    def token_to_id(self, token: str):
        return self.special.get(token, self._model.vocab.get(token))

    # -- streaming plan: per-token text steps, a byte conversion, then whole-text steps
    def _setup_stream(self):
        before, after_bytes, whole, mode, fused = [], [], [], "utf8", False
        for st in self._decoder:
            kind = st[0]
            if kind == "bytelevel":  # maps bytes and joins everything into one string
                mode, fused = kind, True
            elif kind == "bytefallback":
                mode = kind
            elif kind == "fuse":
                fused = True
            elif fused:
                whole.append(st)
            elif mode == "bytefallback":
                after_bytes.append(st)
            else:
                before.append(st)
        self._stream_before, self._stream_after_bytes = before, after_bytes
        self._stream_mode, self._stream_whole = mode, whole
        self._piece_cache: dict = {}
        self._plain = not self._decoder  # no decoder: HF joins tokens with spaces

    def _piece(self, id: int, first: bool) -> bytes:
        key = (id, first)
        hit = self._piece_cache.get(key)
        if hit is not None:
            return hit
        tok = self._id_to_token[id]
        if self._plain:
            tok = tok if first else " " + tok
        tok = _token_steps(self._stream_before, tok, first)
        if self._stream_mode == "bytelevel":
            out = _byte_level_bytes(tok)
        elif self._stream_mode == "bytefallback" and len(tok) == 6 and _BYTE_TOKEN.match(tok):
            out = bytes([int(tok[3:5], 16)])
        else:
            out = _token_steps(self._stream_after_bytes, tok, first).encode("utf-8")
        if len(self._piece_cache) < 1 << 17:
            self._piece_cache[key] = out
        return out


def _token_steps(steps, tok: str, first: bool) -> str:
    """Per-token decoder steps applied to one token (first: it is the first token)."""
    for st in steps:
        kind = st[0]
        if kind == "replace":
            tok = st[1].sub(lambda m, c=st[2]: c, tok)
        elif kind == "strip":
            tok = _strip_chars(tok, *st[1:])
        elif kind == "metaspace":
            tok = tok.replace(st[1], "" if (first and st[2]) else " ")
        elif kind == "wordpiece":
            tok = _wordpiece_piece(tok, first, st[1], st[2])
        elif kind == "bpe":  # the suffix marks a word end; only the last token's is dropped
            tok = tok.replace(st[1], " ")
    return tok


class Detokenizer:
    """Incremental decoding: push(id) returns the text that is complete so far; bytes of a
    character split across tokens wait for the next token, flush() returns the rest (U+FFFD for
    bytes that never became a character).  Concatenated output equals Tokenizer.decode(ids) for
    valid UTF-8; for invalid byte runs the count of U+FFFD may differ from HF's ByteFallback."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self._first = True
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        # whole-text steps (after the tokens were joined); strip state is per stream
        self._whole = [list(st) for st in tok._stream_whole]
        self._held = ""

    def push(self, id: int) -> str:
        piece = self._tok._piece(self._tok._check_ids([id])[0], self._first)
        self._first = False
        return self._post(self._utf8.decode(piece), False)

    def flush(self) -> str:
        return self._post(self._utf8.decode(b"", final=True), True)

    def _post(self, text: str, final: bool) -> str:
        for st in self._whole:
            if st[0] != "strip":
                text = _token_steps([st], text, True)
                continue
            content = st[1]
            while st[2] > 0 and text:  # strip up to `start` leading content chars
                if text[0] != content:
                    st[2] = 0
                    break
                text = text[1:]
                st[2] -= 1
            if st[3]:  # hold back trailing content chars until we know they are not the end
                text = self._held + text
                keep = len(text.rstrip(content))
                text, self._held = text[:keep], text[keep:]
                if final:
                    text += self._held[:max(0, len(self._held) - st[3])]
                    self._held = ""
        return text


# --------------------------------------------------------------------------- tokenizer.json

def _post_processor(spec, token_ids: dict) -> tuple:
    """(prefix ids, suffix ids) a post-processor adds around a single sequence."""
    if spec is None:
        return [], []
    kind = spec.get("type")
    if kind == "Sequence":
        pre, suf = [], []
        for sub in spec["processors"]:
            p, s = _post_processor(sub, token_ids)
            pre, suf = p + pre, suf + s
        return pre, suf
    if kind == "ByteLevel":
        return [], []
    if kind in ("BertProcessing", "RobertaProcessing"):
        return [int(spec["cls"][1])], [int(spec["sep"][1])]
    if kind == "TemplateProcessing":
        specials = spec.get("special_tokens", {})
        pre, suf, seen = [], [], False
        for item in spec["single"]:
            if "Sequence" in item:
                if seen:
                    raise TokenizerError("template with two sequences")
                seen = True
            elif "SpecialToken" in item:
                name = item["SpecialToken"]["id"]
                if name not in specials:
                    raise TokenizerError(f"template token {name!r} is not defined")
                (suf if seen else pre).extend(int(x) for x in specials[name]["ids"])
            else:
                raise TokenizerError(f"bad template item {item!r}")
        return pre, suf
    raise TokenizerError(f"unsupported post_processor {kind!r}")


def _config_token(config: dict, key: str):
    v = config.get(key)
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def from_tokenizer_json(data, config: dict | None = None) -> Tokenizer:
    """Build from tokenizer.json (bytes, str or parsed dict).  `config` is an optional parsed
    tokenizer_config.json, used only for the bos/eos/pad token names."""
    try:
        spec = json.loads(data) if isinstance(data, (bytes, bytearray, str)) else data
        if not isinstance(spec, dict):
            raise TokenizerError("tokenizer.json must be an object")
        return _from_spec(spec, config or {})
    except TokenizerError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise TokenizerError(f"malformed tokenizer.json: {exc!r}") from None


def _from_spec(spec: dict, config: dict) -> Tokenizer:
    m = spec["model"]
    kind = m.get("type")
    vocab = m.get("vocab")
    if kind is None:  # very old files omit the type
        kind = "BPE" if "merges" in m else "WordPiece"
    if kind == "BPE":
        if m.get("dropout") not in (None, 0, 0.0):
            raise TokenizerError("BPE dropout is not supported")
        merges = [tuple(x.split(" ")) if isinstance(x, str) else tuple(x) for x in m["merges"]]
        if any(len(x) != 2 for x in merges):
            raise TokenizerError("a merge must name exactly two tokens")
        model = _BPE(dict(vocab), merges, unk=m.get("unk_token"),
                     prefix=m.get("continuing_subword_prefix"), suffix=m.get("end_of_word_suffix"),
                     fuse_unk=bool(m.get("fuse_unk")), byte_fallback=bool(m.get("byte_fallback")),
                     ignore_merges=bool(m.get("ignore_merges")))
        unk_name = m.get("unk_token")
    elif kind == "WordPiece":
        unk_name = m.get("unk_token", "[UNK]")
        model = _WordPiece(dict(vocab), unk_name, m.get("continuing_subword_prefix", "##"),
                           int(m.get("max_input_chars_per_word", 100)))
    else:
        raise TokenizerError(f"unsupported tokenizer model {kind!r}")
    added = [_Added(a["content"], int(a["id"]), a.get("special", False), a.get("normalized"),
                    a.get("lstrip", False), a.get("rstrip", False), a.get("single_word", False))
             for a in spec.get("added_tokens") or []]
    token_ids = dict(model.vocab)
    token_ids.update({a.content: a.id for a in added})
    post = _post_processor(spec.get("post_processor"), token_ids)
    # tokenizer.json does not name bos/eos: take them from tokenizer_config.json when given,
    # else from what the post-processor adds (Llama's <s>, BERT's [CLS] ... [SEP]).
    named = {k: token_ids.get(_config_token(config, k + "_token")) for k in ("bos", "eos", "pad")}
    bos = named["bos"] if named["bos"] is not None else (post[0][0] if post[0] else None)
    eos = named["eos"] if named["eos"] is not None else (post[1][-1] if post[1] else None)
    pad = named["pad"]
    if pad is None:
        pad = token_ids.get((spec.get("padding") or {}).get("pad_token"))
    unk = token_ids.get(unk_name) if unk_name is not None else None
    return Tokenizer(model=model, normalizer=_build_normalizer(spec.get("normalizer")),
                     pretokenizer=_build_pretokenizer(spec.get("pre_tokenizer")),
                     decoder=_build_decoder(spec.get("decoder")), added=added, post=post,
                     bos_id=bos, eos_id=eos, pad_id=pad, unk_id=unk)


# --------------------------------------------------------------------------- WordPiece vocab.txt

_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def _bert_tokenizer(tokens: list, lowercase=True, strip_accents=None, chinese=True,
                    names=None) -> Tokenizer:
    names = dict(zip(("pad", "unk", "cls", "sep", "mask"), _BERT_SPECIALS), **(names or {}))
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    for key in ("unk", "cls", "sep"):
        if names[key] not in vocab:
            raise TokenizerError(f"WordPiece vocabulary lacks {names[key]!r}")
    added = [_Added(names[k], vocab[names[k]], special=True, normalized=False)
             for k in ("pad", "unk", "cls", "sep", "mask") if names[k] in vocab]
    cls, sep = vocab[names["cls"]], vocab[names["sep"]]
    return Tokenizer(model=_WordPiece(vocab, names["unk"]),
                     normalizer=_bert_normalizer(True, chinese, strip_accents, lowercase),
                     pretokenizer=[("bert",)], decoder=[("wordpiece", "##", True)], added=added,
                     post=([cls], [sep]), bos_id=cls, eos_id=sep,
                     pad_id=vocab.get(names["pad"]), unk_id=vocab[names["unk"]])


def load(path) -> Tokenizer:
    """A tokenizer.json file, or a folder holding tokenizer.json (or vocab.txt for WordPiece)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        tok = from_folder(folder_reader(path))
        if tok is None:
            raise TokenizerError(f"{path} holds neither tokenizer.json nor vocab.txt")
        return tok
    folder, name = os.path.split(path)
    read = folder_reader(folder)
    data = read(name)
    if data is None:
        raise TokenizerError(f"cannot read {path}: no such file")
    return from_tokenizer_json(data, _config(read))


def folder_reader(folder):
    """read(name) -> bytes, or None when `folder` has no such file: the server-side
    form of the reader from_folder takes."""
    def read(name):
        path = os.path.join(folder, name)
        if not os.path.lexists(path):
            return None
        if outside_roots(path):     # (a symlink out of the model roots, say): refused, not read
            raise OSError(f"{path} resolves outside the model roots (--model_root)")
        if not os.path.isfile(path):
            return None
        try:
            with open_regular(path) as f:
                return f.read()
        except OSError as exc:
            raise TokenizerError(f"cannot read {path}: {exc}") from None
    return read


def _config(read, name: str = "tokenizer_config.json") -> dict:
    data = read(name)
    if data is None:
        return {}
    try:
        config = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise TokenizerError(f"cannot read {name}: {exc}") from None
    return config if isinstance(config, dict) else {}


def _chat_template(config: dict, read):
    """HF's chat template: chat_template.jinja beside the tokenizer, else tokenizer_config's
    chat_template (a string, or a list of named templates whose "default" is the one)."""
    data = read("chat_template.jinja")
    if data is not None:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TokenizerError(f"cannot read chat_template.jinja: {exc}") from None
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def from_folder(read) -> Tokenizer | None:
    """The tokenizer metadata of one folder, through read(name) -> bytes | None (a server
    directory or an uploaded package's): tokenizer.json with its tokenizer_config.json,
    else a WordPiece vocab.txt; None when the folder has neither."""
    config = _config(read)
    data = read("tokenizer.json")
    if data is not None:
        tok = from_tokenizer_json(data, config)
        tok.chat_template = _chat_template(config, read)
        return tok
    vocab = read("vocab.txt")
    if vocab is None:
        return None
    try:
        tokens = [line.rstrip("\r") for line in vocab.decode("utf-8").split("\n")]
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"cannot read vocab.txt: {exc}") from None
    while tokens and tokens[-1] == "":
        tokens.pop()
    names = {k: _config_token(config, k + "_token") for k in ("pad", "unk", "cls", "sep", "mask")}
    return _bert_tokenizer(tokens, lowercase=bool(config.get("do_lower_case", True)),
                           strip_accents=config.get("strip_accents"),
                           chinese=bool(config.get("tokenize_chinese_chars", True)),
                           names={k: v for k, v in names.items() if v})


# --------------------------------------------------------------------------- CLIP files
# diffusers folders ship CLIP's slow-tokenizer files (vocab.json, merges.txt), no tokenizer.json.
# The pipeline below is the tokenizer.json HF tokenizers holds for openai/clip-vit-large-patch14
# (what transformers' CLIPConverter writes), so ids equal CLIPTokenizerFast's.  Not reproduced
# from CLIP's own Python tokenizer: ftfy.fix_text and html.unescape (twice) before normalizing,
# so "&amp;" here is "&", "amp", ";".  Its strip() changes nothing: the split drops whitespace.

_CLIP_BOS, _CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
_CLIP_SPLIT = (r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|"
               r"[^\s\p{L}\p{N}]+")


def _clip_vocab(data: bytes) -> dict:
    try:
        vocab = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise TokenizerError(f"vocab.json is not valid JSON: {exc}") from None
    if not isinstance(vocab, dict):
        raise TokenizerError("vocab.json must be an object of token -> id, got "
                             + type(vocab).__name__)
    for token, tid in vocab.items():
        if tid.__class__ is not int or not 0 <= tid < 2**32:  # HF ids are u32; bools are not ids
            raise TokenizerError(f"vocab.json: token {token!r} has id {tid!r}; "
                                 f"ids are integers 0 .. 2**32-1")
    return vocab


def _clip_merges(data: bytes) -> list:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"merges.txt is not valid UTF-8: {exc}") from None
    merges = []
    for n, line in enumerate(text.split("\n"), 1):
        line = line[:-1] if line.endswith("\r") else line
        if not line or line.startswith("#version"):  # HF skips the header; blank: no merge
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise TokenizerError(f"merges.txt line {n}: expected two tokens and one space, "
                                 f"got {line!r}")
        merges.append(parts)
    return merges


def _clip_names(config: dict) -> dict:
    """bos/eos/unk/pad token names from the config, CLIPTokenizer's defaults where absent."""
    return {k: _config_token(config, k + "_token") or (_CLIP_BOS if k == "bos" else _CLIP_EOS)
            for k in ("bos", "eos", "unk", "pad")}


def clip_tokenizer_json(vocab: bytes, merges: bytes, config: dict | None = None) -> dict:
    """The tokenizer.json (as a dict) of a CLIP tokenizer from its vocab.json and merges.txt
    bytes.  `config`: tokenizer_config.json and special_tokens_map.json merged, for the
    bos/eos/unk/pad names (when absent CLIP's: bos <|startoftext|>, the others <|endoftext|>)."""
    config = config or {}
    vocab, merges = _clip_vocab(vocab), _clip_merges(merges)
    names = _clip_names(config)
    for key in ("bos", "eos", "unk"):
        if names[key] not in vocab:
            raise TokenizerError(f"vocab.json lacks the {key} token {names[key]!r}")
    # transformers registers every special token of the config as an added token (SD 2's pad
    # "!" too); tokenizer_config.json may say whether one is matched on normalized text.
    added = {}
    for key in ("bos", "eos", "unk", "pad"):
        name = names[key]
        if name not in vocab or name in added:
            continue
        entry = config.get(key + "_token")
        normalized = entry.get("normalized") if isinstance(entry, dict) else None
        added[name] = {"id": vocab[name], "content": name, "single_word": False, "lstrip": False,
                       "rstrip": False, "special": True,
                       "normalized": normalized if isinstance(normalized, bool) else True}
    bos, eos = names["bos"], names["eos"]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": list(added.values()),
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "NFC"}, {"type": "Replace", "pattern": {"Regex": r"\s+"}, "content": " "},
            {"type": "Lowercase"}]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _CLIP_SPLIT}, "behavior": "Removed",
             "invert": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]},
        "post_processor": {"type": "RobertaProcessing", "sep": [eos, vocab[eos]],
                           "cls": [bos, vocab[bos]], "trim_offsets": False,
                           "add_prefix_space": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": names["unk"],
                  "continuing_subword_prefix": "", "end_of_word_suffix": "</w>",
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def from_clip_files(folder) -> Tokenizer:
    """CLIP's tokenizer from a folder of its slow-tokenizer files: vocab.json and merges.txt
    (tokenizer_config.json and special_tokens_map.json optional), as a diffusers pipeline's
    tokenizer/ holds them.  encode(text, add_special=True) gives bos, the ids, eos, unpadded
    and untruncated (SD pads with its pad token, eos for SD 1.5, to 77).  decode keeps the
    "</w>" word ends, as HF's ByteLevel decoder does (CLIPTokenizerFast makes them spaces)."""
    folder = os.fspath(folder)
    read = folder_reader(folder)
    files = {}
    for name in ("vocab.json", "merges.txt"):
        files[name] = read(name)
        if files[name] is None:
            raise TokenizerError(f"{os.path.join(folder, name)}: no such file (a CLIP tokenizer "
                                 f"folder holds vocab.json and merges.txt)")
    # special_tokens_map.json overrides tokenizer_config.json, as in transformers; the names are
    # passed on filled in, so the Tokenizer's bos/eos/pad ids are set without either file.
    config = {**_config(read), **_config(read, "special_tokens_map.json")}
    config.update({k + "_token": v for k, v in _clip_names(config).items()})
    try:
        spec = clip_tokenizer_json(files["vocab.json"], files["merges.txt"], config)
        return from_tokenizer_json(spec, config)
    except TokenizerError as exc:
        raise TokenizerError(f"{folder}: {exc}") from None


# --------------------------------------------------------------------------- GGUF metadata

_GGUF_PRE = {
    "default": None, "gpt2": None,
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                 r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
             r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_GGUF_PRE["llama3"] = _GGUF_PRE["llama-bpe"]
_GGUF_PRE["smollm"] = None  # GPT-2's regex after isolating every digit (HF: Digits + ByteLevel)
# token_type values in GGUF
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def _text(v) -> str:
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode("utf-8")
    if isinstance(v, str):
        return v
    raise TokenizerError(f"expected a string, got {type(v).__name__}")


def from_gguf_metadata(metadata: dict) -> Tokenizer:
    """Build from the tokenizer.ggml.* keys of GGUF metadata."""
    try:
        tok = _from_gguf(metadata)
        template = metadata.get("tokenizer.chat_template")
        tok.chat_template = _text(template) if template is not None else None
        return tok
    except TokenizerError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"malformed GGUF tokenizer metadata: {exc!r}") from None


def _from_gguf(md: dict) -> Tokenizer:
    get = lambda key, default=None: md.get("tokenizer.ggml." + key, default)  # noqa: E731
    kind = _text(get("model"))
    tokens = [_text(t) for t in get("tokens")]
    n = len(tokens)
    types = [int(t) for t in get("token_type", [])] or [_NORMAL] * n
    if len(types) != n:
        raise TokenizerError("token_type and tokens differ in length")

    def token_id(key):
        v = get(key)
        if v is None:
            return None
        v = int(v)
        if not 0 <= v < n:
            raise TokenizerError(f"tokenizer.ggml.{key} {v} is outside the vocabulary")
        return v
    bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
    unk, pad = token_id("unknown_token_id"), token_id("padding_token_id")

    if kind == "bert":
        if any(t.startswith("\u2581") for t in tokens):  # llama.cpp's "phantom space" spelling
            tokens = [t if (t.startswith("[") and t.endswith("]")) else
                      t[1:] if t.startswith("\u2581") else "##" + t for t in tokens]
        cls, sep = token_id("cls_token_id"), token_id("seperator_token_id")
        names = {}
        for key, tid in (("unk", unk), ("pad", pad), ("cls", bos if cls is None else cls),
                         ("sep", eos if sep is None else sep), ("mask", token_id("mask_token_id"))):
            if tid is not None:
                names[key] = tokens[tid]
        return _bert_tokenizer(tokens, names=names)

    vocab = {}
    for i, t in enumerate(tokens):
        vocab[t] = i  # a repeated token maps to its last id, as llama.cpp
    added = [_Added(tokens[i], i, special=types[i] in (_CONTROL, _UNKNOWN), normalized=False)
             for i in range(n) if types[i] in (_CONTROL, _UNKNOWN, _USER_DEFINED)]
    if kind == "gpt2":
        pre = _text(get("pre", "default"))
        if pre not in _GGUF_PRE:
            raise TokenizerError(f"unsupported GGUF pre-tokenizer {pre!r}")
        merges = [tuple(_text(m).split(" ")) for m in get("merges", [])]
        if any(len(m) != 2 for m in merges):
            raise TokenizerError("a merge must name exactly two tokens")
        # Meta's Llama-3 tokenizer.json (and llama.cpp for "llama-bpe") ignore merges for
        # words that are whole tokens.
        model = _BPE(vocab, merges, ignore_merges=pre in ("llama-bpe", "llama3"))
        steps = [("regex", _compile_onig(_GGUF_PRE[pre] or _GPT2_REGEX), "isolated", False)]
        if pre == "smollm":
            steps.insert(0, ("regex", _compile_onig(r"\p{N}"), "isolated", False))
        normalizer = _build_normalizer({"type": "NFC"}) if pre == "qwen2" else None
        decoder = [("bytelevel",)]
        add_bos = bool(get("add_bos_token", False))
        pretok = steps + [("bytelevel",)]
    elif kind == "llama":
        scores_list = [float(s) for s in get("scores", [0.0] * n)]
        if len(scores_list) != n:
            raise TokenizerError("scores and tokens differ in length")
        # Only ordinary pieces are merge results; control, byte and unused tokens are not.
        scores = {}
        for i, t in enumerate(tokens):
            if types[i] in (0, _NORMAL, _USER_DEFINED):
                scores[t] = scores_list[i]
        byte_ids = [None] * 256
        for i, t in enumerate(tokens):
            m = _BYTE_TOKEN.match(t)
            if m and types[i] == _BYTE:
                byte_ids[int(m.group(1), 16)] = i
        model = _SentencePieceBPE(vocab, scores, byte_ids, unk)
        space = bool(get("add_space_prefix", True))
        normalizer = _build_normalizer({"type": "Sequence", "normalizers": (
            [{"type": "Prepend", "prepend": "\u2581"}] if space else []) + [
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]})
        decoder = [("replace", re.compile("\u2581"), " "), ("bytefallback",), ("fuse",)] + (
            [("strip", " ", 1, 0)] if space else [])
        add_bos = bool(get("add_bos_token", True))
        pretok = []
    else:
        raise TokenizerError(f"unsupported GGUF tokenizer model {kind!r}")
    prefix = [bos] if add_bos and bos is not None else []
    suffix = [eos] if get("add_eos_token", False) and eos is not None else []
    return Tokenizer(model=model, normalizer=normalizer, pretokenizer=pretok, decoder=decoder,
                     added=added, post=(prefix, suffix), bos_id=bos, eos_id=eos, pad_id=pad,
                     unk_id=unk)
