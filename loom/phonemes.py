"""Text to phoneme ids for Piper VITS voices, equal to Piper 1.8's own front end.

Piper 1.8 (piper-tts) phonemizes with a static espeak-ng (master 212928b3,
"1.52.0.1") through its `espeakbridge` extension. Loom runs the libespeak-ng 1.52.0
that the `espeakng-loader` wheel ships, through ctypes, and makes its output equal
to Piper's:

1. `PiperVoice.phonemize(text)`: the text is split on raw-phoneme blocks
   `[[ ... ]]` (their characters become phonemes as written); every other part
   goes to espeak. The text is not normalized.
2. espeak, clause by clause (`espeak_TextToPhonemesWithTerminator`, IPA,
   `espeakCHARS_AUTO`): each call reads one clause and returns its IPA and the
   clause terminator. The bridge names the terminator "." "?" "!" "," ":" ";" only
   when `terminator & 0xFFFFF` equals CLAUSE_PERIOD, _QUESTION, _EXCLAMATION,
   _COMMA, _COLON or _SEMICOLON exactly (anything else: ""), and ends a sentence
   when the CLAUSE_TYPE_SENTENCE bit is set.
3. Per clause: language-switch flags "(xx)" are removed, the terminator is
   appended (plus " " after "," ":" ";"), the string is NFD-decomposed and split
   into code points; sentences end where espeak said so; a trailing empty
   sentence is dropped; optional vowel clusters from the voice config are merged.
4. `phonemes_to_ids`: "^", "_", then each phoneme's ids followed by "_", then
   "$"; a phoneme missing from the map is skipped with a warning.

Two things 1.52.0 lacks, reproduced here:

- The terminator: 1.52.0 exports only espeak_TextToPhonemes, which advances the
  text pointer but does not return the clause type. `_Clauses` replays espeak's
  ReadClause (readclause.c, identical in 1.52.0 and 212928b3) over the same
  characters, with libc's wide-character classes under the C.UTF-8 locale espeak
  itself selects, and checks its clause ends against the positions espeak
  returned: a disagreement raises instead of guessing.
- The linking phoneme ";" after an i vowel (IfNextVowelAppend): 1.52.0 hides it
  in IPA (`IF prevPh(#i) THEN ipa NULL`); 212928b3's WritePhMnemonic evaluates
  prevPh with the list start at the phoneme itself (espeak-ng commit 8afe77ba,
  issue #2367), so Piper prints it as "ʲ" ("me at" -> mˌiːʲ æt). A second,
  ASCII-mnemonic pass with a phoneme separator finds those ";" and they are
  written as "ʲ".

libespeak-ng is GPL-3.0-or-later. It is loaded on first use only (importing this
module loads nothing), and only a speech deployment uses it. espeak keeps global
state and is not thread-safe: every call holds one process-wide lock. Its
initialization sets the process's LC_CTYPE locale to C.UTF-8 (as Piper's does).
"""

import ctypes
import ctypes.util
import logging
import os
import re
import threading
import unicodedata

from .errors import Problem

_LOGGER = logging.getLogger(__name__)

PAD, BOS, EOS = "_", "^", "$"

MAX_CHARS = 100_000          # a hard ceiling; callers pass their own lower limit

_RAW_BLOCK = re.compile(r"(\[\[.*?\]\])")
_LANG_FLAG = re.compile(r"\([^)]+\)")

# espeak API constants (speak_lib.h)
_AUDIO_OUTPUT_SYNCHRONOUS = 0x02
_CHARS_AUTO = 0
_PHONEMES_IPA = 0x02
_SEP = 0xE00F            # phoneme separator for the aligned passes (private use: never in output)
_SEP_CHAR = chr(_SEP)

# readclause.c clause types (translate.h)
_CLAUSE_NONE = 0x4000
_CLAUSE_EOF = 0x90028
_CLAUSE_PARAGRAPH = 0x80046
_CLAUSE_PERIOD = 0x80028
_CLAUSE_COMMA = 0x41014
_CLAUSE_QUESTION = 0x82028
_CLAUSE_EXCLAMATION = 0x8302D
_CLAUSE_COLON = 0x4001E
_CLAUSE_SEMICOLON = 0x4101E
_CLAUSE_TYPE_SENTENCE = 0x80000
_CLAUSE_OPTIONAL_SPACE_AFTER = 0x8000
_CLAUSE_PUNCTUATION_IN_WORD = 0x100000
_CLAUSE_DOT_AFTER_LAST_WORD = 0x400000
_CHAR_EMPHASIS = 0x0530
_N_TR_SOURCE = 800

_TERMINATORS = {_CLAUSE_PERIOD: ".", _CLAUSE_QUESTION: "?", _CLAUSE_EXCLAMATION: "!",
                _CLAUSE_COMMA: ",", _CLAUSE_COLON: ":", _CLAUSE_SEMICOLON: ";"}

# clause_type_from_codepoint() of libespeak-ng 1.52.0 for every code point whose
# type is not CLAUSE_NONE, read from the library itself (tests/test_phonemes.py
# checks it again where the library keeps its symbol table): (first, last, type).
_CLAUSE_TYPE_RANGES = (
    (0x21, 0x21, 0x8302D), (0x2C, 0x2C, 0x41014), (0x2E, 0x2E, 0x80028), (0x3A, 0x3A, 0x4001E),
    (0x3B, 0x3B, 0x4101E), (0x3F, 0x3F, 0x82028), (0xA1, 0xA1, 0x4901E), (0xBF, 0xBF, 0x4901E),
    (0x37E, 0x37E, 0x82028), (0x387, 0x387, 0x4101E), (0x55B, 0x55C, 0x18302D),
    (0x55D, 0x55D, 0x41014), (0x55E, 0x55E, 0x182028), (0x589, 0x589, 0x88028),
    (0x60C, 0x60C, 0x41014), (0x61B, 0x61B, 0x4101E), (0x61F, 0x61F, 0x82028),
    (0x6D4, 0x6D4, 0x80028), (0x700, 0x700, 0x80046), (0x701, 0x701, 0x80028),
    (0x702, 0x702, 0x41014), (0x703, 0x703, 0x8302D), (0x704, 0x704, 0x80028),
    (0x706, 0x707, 0x4001E), (0x708, 0x708, 0x4101E), (0x709, 0x709, 0x82028),
    (0x7F8, 0x7F8, 0x41014), (0x7F9, 0x7F9, 0x8302D), (0x964, 0x964, 0x88028),
    (0x965, 0x965, 0x80046), (0xDF4, 0xDF4, 0x88028), (0xEAF, 0xEAF, 0x24901E),
    (0xF0D, 0xF0D, 0x88028), (0xF0E, 0xF0E, 0x80046), (0xF14, 0xF14, 0x41014),
    (0x10FB, 0x10FB, 0x80046), (0x1362, 0x1362, 0x80028), (0x1363, 0x1363, 0x41014),
    (0x1364, 0x1364, 0x4101E), (0x1365, 0x1366, 0x4001E), (0x1367, 0x1367, 0x82028),
    (0x1368, 0x1368, 0x80046), (0x166E, 0x166E, 0x80028), (0x1801, 0x1801, 0x24901E),
    (0x1802, 0x1802, 0x41014), (0x1803, 0x1803, 0x80028), (0x1804, 0x1804, 0x4001E),
    (0x1808, 0x1808, 0x41014), (0x1809, 0x1809, 0x80028), (0x1944, 0x1944, 0x8302D),
    (0x1945, 0x1945, 0x82028), (0x2013, 0x2014, 0x4101E), (0x2026, 0x2026, 0x24901E),
    (0x2029, 0x2029, 0x80046), (0x203C, 0x203C, 0x8302D), (0x2047, 0x2047, 0x82028),
    (0x204F, 0x204F, 0x4101E), (0x22EE, 0x22F1, 0x24901E), (0x2488, 0x249B, 0x80028),
    (0x2753, 0x2754, 0x82028), (0x2755, 0x2755, 0x8302D), (0x2757, 0x2757, 0x8302D),
    (0x2762, 0x2763, 0x8302D), (0x2982, 0x2982, 0x4001E), (0x2CF9, 0x2CF9, 0x80028),
    (0x2CFA, 0x2CFB, 0x82028), (0x2CFE, 0x2CFE, 0x80028), (0x2E32, 0x2E32, 0x41014),
    (0x2E33, 0x2E33, 0x80028), (0x2E34, 0x2E34, 0x41014), (0x2E35, 0x2E35, 0x4101E),
    (0x2E3A, 0x2E3B, 0x4101E), (0x2E3C, 0x2E3C, 0x80028), (0x2E41, 0x2E41, 0x41014),
    (0x3001, 0x3001, 0x49014), (0x3002, 0x3002, 0x88028), (0xA4FE, 0xA4FE, 0x41014),
    (0xA4FF, 0xA4FF, 0x80028), (0xA60D, 0xA60D, 0x41014), (0xA60E, 0xA60E, 0x80028),
    (0xA60F, 0xA60F, 0x82028), (0xA6F3, 0xA6F3, 0x80028), (0xA6F4, 0xA6F4, 0x4001E),
    (0xA6F5, 0xA6F5, 0x41014), (0xA6F6, 0xA6F6, 0x4101E), (0xA6F7, 0xA6F7, 0x82028),
    (0xFE10, 0xFE11, 0x41014), (0xFE12, 0xFE12, 0x80028), (0xFE13, 0xFE13, 0x4001E),
    (0xFE14, 0xFE14, 0x4101E), (0xFE15, 0xFE15, 0x8302D), (0xFE16, 0xFE16, 0x82028),
    (0xFE19, 0xFE19, 0x24901E), (0xFE31, 0xFE32, 0x4101E), (0xFE50, 0xFE51, 0x41014),
    (0xFE52, 0xFE52, 0x80028), (0xFE54, 0xFE54, 0x4101E), (0xFE55, 0xFE55, 0x4001E),
    (0xFE56, 0xFE56, 0x82028), (0xFE57, 0xFE57, 0x8302D), (0xFF01, 0xFF01, 0x8B02D),
    (0xFF0C, 0xFF0C, 0x49014), (0xFF0E, 0xFF0E, 0x88028), (0xFF1A, 0xFF1A, 0x4801E),
    (0xFF1B, 0xFF1B, 0x4901E), (0xFF1F, 0xFF1F, 0x8A028), (0xFF61, 0xFF61, 0x80028),
    (0xFF64, 0xFF64, 0x41014), (0x11143, 0x11143, 0x82028), (0x1144D, 0x1144D, 0x41014),
    (0x12471, 0x12472, 0x4001E), (0x16AF5, 0x16AF5, 0x80028), (0x1BC9F, 0x1BC9F, 0x80028),
    (0x1DA87, 0x1DA87, 0x41014), (0x1DA88, 0x1DA88, 0x80028), (0x1DA89, 0x1DA89, 0x4101E),
    (0x1DA8A, 0x1DA8A, 0x4001E), (0x1E95E, 0x1E95E, 0x8302D), (0x1E95F, 0x1E95F, 0x82028),
    (0x1F100, 0x1F100, 0x80028), (0x1F101, 0x1F10A, 0x41014), (0xE0021, 0xE0021, 0x8302D),
    (0xE002C, 0xE002C, 0x41014), (0xE002E, 0xE002E, 0x80028), (0xE003A, 0xE003A, 0x4001E),
    (0xE003B, 0xE003B, 0x4101E), (0xE003F, 0xE003F, 0x82028),
)
_CLAUSE_TYPES = {c: t for first, last, t in _CLAUSE_TYPE_RANGES for c in range(first, last + 1)}

_BRACKETS = frozenset(map(ord, "()[]{}<>\"'`")) | {0xAB, 0xBB, 0x300A, 0x300B, 0xE000 + ord("<")}
_CHARS_IGNORE = frozenset((0xAD, 0x200C))     # chars_ignore_default: soft hyphen, ZWNJ


class PhonemizerError(Problem):
    """Text that cannot become phonemes, or a phonemizer that cannot run.

    Codes: phonemizer_unavailable (espeakng-loader / libespeak-ng / the voice cannot
    be loaded), invalid_input (text espeak cannot take: NUL, control code 0x01,
    lone surrogates), input_too_long (over the caller's limit), unsupported_voice
    (a voice config this front end does not implement)."""

    code = "invalid_input"

    def __init__(self, message, code=None, param="input"):
        super().__init__(message, code, param)


def _clause_type(c):
    return _CLAUSE_TYPES.get(c, _CLAUSE_NONE)


def _is_bracket(c):
    return 0x2014 <= c <= 0x201F or c in _BRACKETS


class _WCtype:
    """libc's wide-character classes, as espeak's iswalpha() etc. see them (the
    locale is espeak's C.UTF-8 once it is initialized); memoized per code point."""

    def __init__(self):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        self._fns = {}
        for name in ("iswspace", "iswalnum", "iswalpha", "iswdigit", "iswlower"):
            fn = getattr(libc, name)
            fn.argtypes, fn.restype = [ctypes.c_uint32], ctypes.c_int
            self._fns[name] = fn
        self._memo = {name: {} for name in self._fns}

    def __call__(self, name, c):
        memo = self._memo[name]
        v = memo.get(c)
        if v is None:
            v = memo[c] = self._fns[name](c) != 0
        return v

    def is_alpha(self, c):
        """espeak's IsAlpha (common.c): iswalpha plus some in-word marks."""
        if self("iswalpha", c):
            return True
        if c < 0x300:
            return False
        if 0x901 <= c <= 0xDF7:
            return (c & 0x7F) < 0x64 or c in (0xA70, 0xA71) or 0xD7A <= c <= 0xD7F
        return (0x5B0 <= c <= 0x5C2 or c == 0x605 or c == 0x670 or 0x64B <= c <= 0x65E
                or 0x300 <= c <= 0x36F or 0xF40 <= c <= 0xFBC or 0x1100 <= c <= 0x11FF
                or 0x2800 <= c <= 0x28FF or 0x3040 < c <= 0xA700)


class _Clauses:
    """A replay of readclause.c's ReadClause for espeak_TextToPhonemes' settings
    (no SSML, punctuation not spoken, no phoneme input, line length 0, English
    language options): per clause, the terminator ReadClause returned and where the
    text decoder stopped. The decoder reads the text's code points and then its
    terminating NUL (espeakCHARS_AUTO decodes strlen + 1 bytes)."""

    def __init__(self, codepoints, wc):
        self.cps = codepoints + [0]
        self.pos = 0
        self.ungot = 0
        self.wc = wc

    def eof(self):
        return self.ungot == 0 and self.pos == len(self.cps)

    def getc(self):
        c = self.ungot
        if c:
            self.ungot = 0
            return c
        c = self.cps[self.pos]
        self.pos += 1
        return c

    def peekc(self):
        return self.cps[self.pos] if self.pos < len(self.cps) else 0

    def read(self):
        """One clause: its terminator (ReadClause's return value)."""
        wc = self.wc
        c1 = cprev = ord(" ")
        c_next = 0
        ix = 0
        any_alnum = stressed_word = False
        c2 = 0 if self.eof() else self.getc()
        while not self.eof():
            cprev, c1 = c1, c2
            c2 = ord(" ") if self.eof() else self.getc()
            if c1 == 0x01:                         # CTRL_EMBEDDED: refused before espeak sees it
                raise PhonemizerError("text contains control character U+0001")
            if c1 in _CHARS_IGNORE:
                continue
            if wc("iswalnum", c1):
                any_alnum = True
            else:
                if stressed_word:
                    stressed_word = False
                    c1 = _CHAR_EMPHASIS
                    self.ungot = c2
                    c2 = ord(" ")
                if c1 == 0xF0B:
                    c1 = ord(" ")
                if c1 == 0xD4D and c2 == 0x200D:
                    c1 = 0xD4E
            if c1 == 0x0A:
                parag = 0
                while not self.eof() and wc("iswspace", c2):
                    if c2 == 0x0A:
                        parag += 1
                    c2 = self.getc()
                if parag > 0:
                    self.ungot = c2
                    return (_CLAUSE_PARAGRAPH - 30) + 30 * min(parag, 3)
            is_end_clause = False
            if c1 == 0x2E and c2 == 0x2E:
                while not self.eof():
                    c_next = self.getc()
                    if c_next != 0x2E:
                        break
                    c1, c2 = 0x2026, ord(" ")
                if c1 == 0x2026:
                    c2 = c_next
                else:
                    self.ungot = c_next
            punct_data = _clause_type(c1)
            if punct_data != _CLAUSE_NONE:
                if punct_data & (_CLAUSE_QUESTION | _CLAUSE_EXCLAMATION):
                    while not self.eof() and _clause_type(c2) & (_CLAUSE_QUESTION | _CLAUSE_EXCLAMATION):
                        c_next = self.getc()
                        c2 = c_next
                if punct_data & _CLAUSE_PUNCTUATION_IN_WORD:
                    stressed_word = True
                    continue
                if (wc("iswspace", c2) or punct_data & _CLAUSE_OPTIONAL_SPACE_AFTER or _is_bracket(c2)
                        or c2 == 0x3F or self.eof() or c2 == 0x01):
                    is_end_clause = True
            if is_end_clause:
                nl_count = 0
                c_next = c2
                if wc("iswspace", c_next):
                    while not self.eof() and wc("iswspace", c_next):
                        if c_next == 0x0A:
                            nl_count += 1
                        c_next = self.getc()
                if c1 == 0x2E and nl_count < 2:
                    punct_data |= _CLAUSE_DOT_AFTER_LAST_WORD
                if nl_count == 0:
                    if c1 == 0x2E and c_next == 0x27 and self.peekc() == 0x73:
                        is_end_clause = False            # u.s.a.'s
                    if c1 == 0x2E:
                        if wc("iswlower", c_next):
                            is_end_clause = False        # abbreviation: next word lower-case
                        if not any_alnum:
                            c1 = ord(" ")
                            is_end_clause = False
                    elif not any_alnum:
                        is_end_clause = False
                if is_end_clause:
                    self.ungot = c_next
                    if wc("iswdigit", cprev) and not wc.is_alpha(c_next):
                        punct_data &= ~_CLAUSE_DOT_AFTER_LAST_WORD
                    if nl_count > 1:
                        if punct_data in (_CLAUSE_QUESTION, _CLAUSE_EXCLAMATION):
                            return punct_data + 35
                        return _CLAUSE_PARAGRAPH
                    return punct_data
                elif not self.eof() and wc("iswspace", c2):
                    self.ungot = c_next
            ix += 1 if c1 < 0x80 else 2 if c1 < 0x800 else 3 if c1 < 0x10000 else 4
            if (ix > _N_TR_SOURCE - 75 and not wc.is_alpha(c1) and not wc("iswdigit", c1)) \
                    or ix >= _N_TR_SOURCE - 4:
                self.ungot = c2
                return _CLAUSE_NONE
        return _CLAUSE_EOF


class _Espeak:
    """libespeak-ng from espeakng-loader, loaded on first use; callers hold _LOCK."""

    def __init__(self):
        try:
            import espeakng_loader
            path, data = espeakng_loader.get_library_path(), espeakng_loader.get_data_path()
            lib = ctypes.CDLL(path)
        except Exception as e:   # ImportError, OSError, RuntimeError (no data)
            raise PhonemizerError(f"espeak-ng is unavailable (espeakng-loader): {e}",
                                  "phonemizer_unavailable", None) from e
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
        lib.espeak_TextToPhonemes.restype = ctypes.c_void_p
        lib.espeak_Info.argtypes = [ctypes.POINTER(ctypes.c_char_p)]
        lib.espeak_Info.restype = ctypes.c_char_p
        if lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, os.fsencode(data), 0) < 0:
            raise PhonemizerError(f"espeak-ng could not initialize with data at {data}",
                                  "phonemizer_unavailable", None)
        self.lib, self.path, self.data = lib, path, data
        self.version = lib.espeak_Info(None).decode()
        self.wc = _WCtype()
        self.ungot = 0          # ReadClause's ungot_char: espeak keeps it between texts

    def set_voice(self, voice):
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise PhonemizerError(f"espeak-ng has no voice {voice!r}", "phonemizer_unavailable", None)

    def _pass(self, encoded, mode, limit):
        """Every clause's phoneme string and where espeak's pointer went (byte offset or None)."""
        buf = ctypes.create_string_buffer(encoded)
        base = ctypes.addressof(buf)
        ptr = ctypes.c_void_p(base)
        out = []
        while ptr.value is not None:
            if len(out) > limit:
                raise PhonemizerError("espeak-ng did not finish the text", "internal", None)
            r = self.lib.espeak_TextToPhonemes(ctypes.byref(ptr), _CHARS_AUTO, mode)
            out.append((ctypes.string_at(r).decode("utf-8", "replace") if r else "",
                        None if ptr.value is None else ptr.value - base))
        return out

    def _flush(self):
        """Let espeak read away a character it kept back (ReadClause's ungot_char)."""
        for _ in range(4):
            if not self.ungot:
                return
            sim = _Clauses([], self.wc)
            sim.ungot = self.ungot
            for _ in self._pass(b"", _PHONEMES_IPA, 4):
                sim.read()
            self.ungot = sim.ungot
        raise PhonemizerError("espeak-ng keeps a character back", "internal", None)

    def clauses(self, text):
        """[(ipa, terminator, end_of_sentence)] as Piper's espeakbridge.get_phonemes."""
        encoded = text.encode("utf-8")
        cps = [0x1A if c == 0xFFFD else c for c in map(ord, text)]   # the decoder's "I umlaut a half" fix
        offsets, b = [], 0
        for ch in text:
            offsets.append(b)
            b += len(ch.encode("utf-8"))
        offsets.append(b)               # the NUL
        limit = len(cps) + 2
        leaked = self.ungot
        ipa = self._pass(encoded, _PHONEMES_IPA | (_SEP << 8), limit)
        # The ASCII pass only matters where an IPA phoneme printed nothing. It must start
        # from the state the IPA pass started from: a character espeak kept back from the
        # previous text (ungot_char) was consumed by the IPA pass, so it leads the text here.
        sim = _Clauses(cps, self.wc)
        sim.ungot = leaked
        ends = []
        for _ in ipa:
            terminator = sim.read()
            ends.append((terminator, None if sim.pos == len(sim.cps) else offsets[sim.pos]))
        final = sim.ungot
        ascii_ = None
        if any("" in _slots(s) for s, _ in ipa):
            # the IPA pass may itself have left a character behind: read it away first
            self.ungot = sim.ungot
            self._flush()
            again = (chr(leaked).encode("utf-8") if leaked else b"") + encoded
            ascii_ = self._pass(again, _SEP << 8, limit + 1)
            if len(ascii_) != len(ipa):
                ascii_ = None
        out = []
        for i, ((phonemes, where), (terminator, at)) in enumerate(zip(ipa, ends)):
            if at != where:
                raise PhonemizerError(
                    f"clause {i} ends at byte {where} in espeak-ng, {at} in the replay",
                    "internal", None)
            if ascii_ is not None:
                phonemes = _show_linking_j(phonemes, ascii_[i][0])
            terminator &= 0xFFFFF
            out.append((phonemes.replace(_SEP_CHAR, ""), _TERMINATORS.get(terminator, ""),
                        (terminator & _CLAUSE_TYPE_SENTENCE) == _CLAUSE_TYPE_SENTENCE))
        self.ungot = final
        return out


def _slots(clause):
    return [s for word in clause.split(" ") for s in word.split(_SEP_CHAR)]


def _show_linking_j(ipa, mnemonics):
    """The IPA clause with each hidden ';' phoneme written "ʲ", as espeak 212928b3 does."""
    ipa_words, mn_words = ipa.split(" "), mnemonics.split(" ")
    if len(ipa_words) != len(mn_words):
        return ipa
    words = []
    for iw, mw in zip(ipa_words, mn_words):
        islots, mslots = iw.split(_SEP_CHAR), mw.split(_SEP_CHAR)
        if ";" in mslots and len(islots) == len(mslots):
            islots = ["ʲ" if m == ";" and s == "" else s for s, m in zip(islots, mslots)]
        words.append(_SEP_CHAR.join(islots))
    return " ".join(words)


_LOCK = threading.Lock()
_ESPEAK = None


def _espeak():
    global _ESPEAK
    if _ESPEAK is None:
        _ESPEAK = _Espeak()
    return _ESPEAK


def loaded():
    """Whether libespeak-ng has been loaded in this process."""
    return _ESPEAK is not None


def _check_text(text, max_chars):
    if not isinstance(text, str):
        raise PhonemizerError("input must be a string", "invalid_type")
    if len(text) > min(max_chars, MAX_CHARS):
        raise PhonemizerError(f"input has {len(text)} characters, over the limit of "
                              f"{min(max_chars, MAX_CHARS)}", "input_too_long")
    if "\x00" in text:
        raise PhonemizerError("input contains a NUL character")
    if "\x01" in text:
        raise PhonemizerError("input contains control character U+0001")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PhonemizerError("input is not valid Unicode (lone surrogate)") from None


def _merge_vowel_clusters(phones, clusters):
    longest = max(len(k) for k in clusters)
    out, i = [], 0
    while i < len(phones):
        match = None
        for n in range(min(longest, len(phones) - i), 1, -1):
            if tuple(phones[i:i + n]) in clusters:
                match = phones[i:i + n]
                break
        if match:
            out.append("".join(match))
            i += len(match)
        else:
            out.append(phones[i])
            i += 1
    return out


def _espeak_part(voice, text, clusters):
    sentences, sentence = [], []
    for phonemes, terminator, end in _espeak().clauses(text):
        phonemes = _LANG_FLAG.sub("", phonemes) + terminator
        if terminator in (",", ":", ";"):
            phonemes += " "
        sentence.extend(unicodedata.normalize("NFD", phonemes))
        if end:
            sentences.append(_merge_vowel_clusters(sentence, clusters) if clusters else sentence)
            sentence = []
    if sentence:
        sentences.append(_merge_vowel_clusters(sentence, clusters) if clusters else sentence)
    return sentences


def phonemize(text, voice, *, vowel_clusters=None, max_chars=MAX_CHARS):
    """Sentences of phonemes for `text` with espeak voice `voice`, equal to Piper 1.8's
    PiperVoice.phonemize for an espeak voice (raw [[ phonemes ]] blocks included)."""
    _check_text(text, max_chars)
    if not isinstance(voice, str) or not voice or "\x00" in voice:
        raise PhonemizerError(f"espeak voice {voice!r} is not a name", "unsupported_voice", "voice")
    if voice == "ar":
        raise PhonemizerError("Arabic voices need Piper's diacritizer, which Loom lacks",
                              "unsupported_voice", "voice")
    clusters = {tuple(c) for c in vowel_clusters} if vowel_clusters else None
    parts = _RAW_BLOCK.split(text)
    with _LOCK:
        try:
            sentences = _phonemize_parts(parts, voice, clusters)
        finally:
            if _ESPEAK is not None:
                # espeak may keep a character of this text back (ReadClause's ungot_char)
                # and would read it before the next text: "Dr.." then "you" reads "dot you".
                # Piper lets it leak into its next call; Loom reads it away, so every
                # request is phonemized as a fresh Piper process would.
                _ESPEAK._flush()
    if sentences and not sentences[-1]:
        sentences.pop()
    return sentences


def _phonemize_parts(parts, voice, clusters):
    sentences = []
    prev_raw = False
    for i, part in enumerate(parts):
        if part.startswith("[["):
            prev_raw = True
            if not sentences:
                sentences.append([])
            if i > 0 and parts[i - 1].endswith(" "):
                sentences[-1].append(" ")
            sentences[-1].extend(part[2:-2].strip())
            if i < len(parts) - 1 and parts[i + 1].startswith(" "):
                sentences[-1].append(" ")
            continue
        _espeak().set_voice(voice)
        got = _espeak_part(voice, part, clusters)
        if prev_raw and got:
            sentences[-1].extend(got[0])
            got = got[1:]
        sentences.extend(got)
        prev_raw = False
    return sentences


def ids(phonemes, phoneme_id_map, missing=None):
    """Phoneme ids as Piper's phonemes_to_ids: "^" "_", each phoneme's ids and "_",
    then "$". A phoneme absent from the map is skipped (Piper logs a warning); it is
    appended to `missing` when a list is given."""
    if not phoneme_id_map or any(s not in phoneme_id_map for s in (PAD, BOS, EOS)):
        raise PhonemizerError("phoneme_id_map lacks the pad, BOS or EOS symbol",
                              "unsupported_voice", "phoneme_id_map")
    pad = list(phoneme_id_map[PAD])
    out = list(phoneme_id_map[BOS]) + pad
    for p in phonemes:
        got = phoneme_id_map.get(p)
        if got is None:
            _LOGGER.warning("Missing phoneme from id map: %s", p)
            if missing is not None:
                missing.append(p)
            continue
        out.extend(got)
        out.extend(pad)
    out.extend(phoneme_id_map[EOS])
    return out


def text_to_ids(text, config, *, max_chars=MAX_CHARS, missing=None):
    """Per-sentence phoneme id lists for a Piper voice config (the .onnx.json dict), as
    PiperVoice.synthesize feeds its model: empty sentences are skipped."""
    kind = config.get("phoneme_type", "espeak")
    id_map = config.get("phoneme_id_map")
    if kind == "text":
        _check_text(text, max_chars)
        sentences = [list(unicodedata.normalize("NFD", text))]
    elif kind == "espeak":
        voice = (config.get("espeak") or {}).get("voice")
        sentences = phonemize(text, voice, vowel_clusters=config.get("vowel_clusters"),
                              max_chars=max_chars)
    else:
        raise PhonemizerError(f"phoneme_type {kind!r} is not supported", "unsupported_voice",
                              "phoneme_type")
    return [ids(s, id_map, missing) for s in sentences if s]
