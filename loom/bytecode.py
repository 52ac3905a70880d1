"""Module <-> .loombc, the binary form of a Loom module.

Layout (all integers little-endian):

    magic        8 bytes  b"\\x7fLOOMBC\\n"
    version      u16      FORMAT_VERSION
    sections     u16      number of section table entries
    table        sections x (u32 id, u32 offset, u32 length), offsets from file start
    payloads     the sections, in any order, non-overlapping, within the file

Sections: STRINGS (u32 count, then u32 length + UTF-8 each), CONSTS (u32
count, then u8 tag 0=int64 / 1=float64 + 8 bytes each), MODULE, SPECS,
PARAMS, STATES, KERNELS, COMMANDS, POLICY. Code is u32 instruction count then
per instruction a u8 opcode and its operands, which index the string and
constant tables.

`read` is the front door for untrusted bytes: every offset, length, count,
index and enum is checked against what is actually there before anything is
built (a count can never ask for more elements than the bytes remaining could
hold), and the resulting module then passes the same `language.check` as
parsed text. Every failure is a LoomError naming the section and offset.
"""

import json
import math
import struct

from .language import (ARG_TYPES, DTYPES, KINDS, Command, Kernel, KernelArg, LoomError, Module, Param, Spec,
                       State, check)

MAGIC = b"\x7fLOOMBC\n"
# 2: kernel records carry `let` bindings; 3: param records end with an optional tiled(axis, width).
# Older files (without them) still read.
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
NONE = 0xFFFFFFFF

STRINGS, CONSTS, MODULE, SPECS, PARAMS, STATES, KERNELS, COMMANDS, POLICY = range(1, 10)
SECTION_NAMES = {STRINGS: "strings", CONSTS: "consts", MODULE: "module", SPECS: "specs", PARAMS: "params",
                 STATES: "states", KERNELS: "kernels", COMMANDS: "commands", POLICY: "policy"}
KERNEL_ARG_TYPES = ARG_TYPES + ("tensor",)

# opcode -> (name, operand layout); layout letters: s=string index, c=const index, b=u8, h=u16
OPCODES = {
    1: ("int", "c"), 2: ("float", "c"), 3: ("str", "s"), 4: ("bool", "b"), 5: ("name", "s"),
    6: ("index", ""), 7: ("fn", "sb"), 8: ("select", ""), 9: ("neg", ""), 10: ("not", ""),
    11: ("add", ""), 12: ("sub", ""), 13: ("mul", ""), 14: ("div", ""), 15: ("idiv", ""), 16: ("mod", ""),
    17: ("pow", ""), 18: ("lt", ""), 19: ("le", ""), 20: ("gt", ""), 21: ("ge", ""), 22: ("eq", ""),
    23: ("ne", ""), 24: ("and", ""), 25: ("or", ""),
    32: ("let", "s"), 33: ("scratch", "sbb"), 34: ("for", "s"), 35: ("if", ""), 36: ("else", ""),
    37: ("end", ""), 38: ("launch", "sh"), 39: ("invoke", "sh"),
    40: ("call", "sh"),  # unresolved: a part of a multi-file module, resolved when the parts merge
}
OPNUMS = {name: (num, layout) for num, (name, layout) in OPCODES.items()}


# -- writing ---------------------------------------------------------------------

class _Writer:
    def __init__(self):
        self.strings, self.string_index = [], {}
        self.consts, self.const_index = [], {}

    def s(self, text):
        if text not in self.string_index:
            self.string_index[text] = len(self.strings)
            self.strings.append(text)
        return struct.pack("<I", self.string_index[text])

    def opt(self, text):
        return struct.pack("<I", NONE) if text is None else self.s(text)

    def c(self, value):
        key = (type(value), value)
        if key not in self.const_index:
            self.const_index[key] = len(self.consts)
            self.consts.append(value)
        return struct.pack("<I", self.const_index[key])

    def code(self, code):
        out = [struct.pack("<I", len(code))]
        for ins in code:
            op = ins[0]
            num, layout = OPNUMS[op]
            out.append(bytes([num]))
            for letter, operand in zip(layout, ins[1:]):
                if letter == "s":
                    out.append(self.s(operand))
                elif letter == "c":
                    out.append(self.c(operand))
                elif letter == "b":
                    out.append(bytes([DTYPES.index(operand) if op == "scratch" and isinstance(operand, str)
                                      else int(operand)]))
                elif letter == "h":
                    out.append(struct.pack("<H", operand))
        return b"".join(out)


def write(module):
    """Module -> .loombc bytes."""
    w = _Writer()
    u8 = lambda n: bytes([n])  # noqa: E731
    u32 = lambda n: struct.pack("<I", n)  # noqa: E731
    sections = {MODULE: w.s(module.name) + w.opt(module.kind)}
    sections[SPECS] = u32(len(module.specs)) + b"".join(w.s(s.name) + w.code(s.code) for s in module.specs)
    sections[PARAMS] = u32(len(module.params)) + b"".join(
        w.s(p.name) + (u8(1) + w.code(p.count) if p.count is not None else u8(0)) + u8(DTYPES.index(p.dtype))
        + u8(len(p.dims)) + b"".join(w.code(d) for d in p.dims)
        + u8(len(p.sources)) + b"".join(w.s(src) for src in p.sources)
        + (u8(1) + w.code(p.when) if p.when is not None else u8(0))
        + (u8(1) + w.code(p.tiled[0]) + w.code(p.tiled[1]) if p.tiled is not None else u8(0))
        for p in module.params)
    sections[STATES] = u32(len(module.states)) + b"".join(
        w.s(s.name) + u8(DTYPES.index(s.dtype)) + (u8(1) + w.code(s.page) if s.page is not None else u8(0))
        + u8(len(s.dims)) + b"".join(w.code(d) for d in s.dims)
        for s in module.states)
    sections[KERNELS] = u32(len(module.kernels)) + b"".join(_kernel(w, k) for k in module.kernels)
    sections[COMMANDS] = u32(len(module.commands)) + b"".join(
        w.s(c.name) + u8(len(c.args)) + b"".join(w.s(a) + u8(ARG_TYPES.index(t)) for a, t in c.args) + w.code(c.body)
        for c in module.commands)
    if module.policy is not None:
        sections[POLICY] = w.s(json.dumps(module.policy, ensure_ascii=False, sort_keys=False))
    # Tables last: every section above has interned its strings and constants by now.
    sections[STRINGS] = u32(len(w.strings)) + b"".join(
        u32(len(b)) + b for b in (s.encode("utf-8") for s in w.strings))
    sections[CONSTS] = u32(len(w.consts)) + b"".join(
        (b"\0" + struct.pack("<q", v)) if isinstance(v, int) else (b"\1" + struct.pack("<d", v)) for v in w.consts)
    order = sorted(sections)
    offset = len(MAGIC) + 4 + 12 * len(order)
    table, payload = [], []
    for sid in order:
        table.append(struct.pack("<III", sid, offset, len(sections[sid])))
        payload.append(sections[sid])
        offset += len(sections[sid])
    return MAGIC + struct.pack("<HH", FORMAT_VERSION, len(order)) + b"".join(table) + b"".join(payload)


def _kernel(w, k):
    u8 = lambda n: bytes([n])  # noqa: E731
    out = [w.s(k.name), u8(len(k.args))]
    for a in k.args:
        out += [w.s(a.name), u8(KERNEL_ARG_TYPES.index(a.type)), u8(len(a.binds))] + [w.s(b) for b in a.binds]
    out += [u8(1), w.s(k.library)] if k.library is not None else [u8(0), w.s(k.source)]
    out += [w.s(k.entry), u8(len(k.lets))]
    for name, code in k.lets:
        out += [w.s(name), w.code(code)]
    out += [struct.pack("<H", len(k.defines))]
    for name, code in k.defines:
        out += [w.opt(name), w.code(code)]
    out += [u8(len(k.grid))] + [w.code(g) for g in k.grid]
    out += [u8(1)] + [w.code(g) for g in k.local] if k.local is not None else [u8(0)]
    out += [u8(1), u8(len(k.call))] + [w.code(a) for a in k.call] if k.call is not None else [u8(0)]
    return b"".join(out)


# -- reading ---------------------------------------------------------------------

class _Cursor:
    def __init__(self, data, start, end, section, source):
        self.data, self.pos, self.end = data, start, end
        self.section, self.source = section, source
        self.strings, self.consts = [], []

    def fail(self, message):
        raise LoomError(f"{self.source or '.loombc'}: {SECTION_NAMES.get(self.section, 'header')} section, "
                        f"byte {self.pos}: {message}")

    def take(self, n):
        if n > self.end - self.pos:
            self.fail(f"needs {n} bytes but {self.end - self.pos} remain")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def u8(self):
        return self.take(1)[0]

    def u16(self):
        return struct.unpack("<H", self.take(2))[0]

    def u32(self):
        return struct.unpack("<I", self.take(4))[0]

    def count(self, min_bytes_each, what):
        n = self.u32()
        if n * min_bytes_each > self.end - self.pos:
            self.fail(f"{what} count {n} cannot fit in the {self.end - self.pos} bytes remaining")
        return n

    def s(self):
        i = self.u32()
        if i >= len(self.strings):
            self.fail(f"string index {i} out of range ({len(self.strings)} strings)")
        return self.strings[i]

    def opt(self):
        i = self.u32()
        if i == NONE:
            return None
        if i >= len(self.strings):
            self.fail(f"string index {i} out of range ({len(self.strings)} strings)")
        return self.strings[i]

    def enum(self, values, what):
        i = self.u8()
        if i >= len(values):
            self.fail(f"invalid {what} {i}")
        return values[i]

    def flag(self):
        v = self.u8()
        if v > 1:
            self.fail(f"invalid flag byte {v}")
        return v == 1

    def code(self):
        n = self.count(1, "instruction")
        code = []
        for _ in range(n):
            num = self.u8()
            if num not in OPCODES:
                self.fail(f"unknown opcode {num}")
            op, layout = OPCODES[num]
            ins = [op]
            for letter in layout:
                if letter == "s":
                    ins.append(self.s())
                elif letter == "c":
                    i = self.u32()
                    if i >= len(self.consts):
                        self.fail(f"constant index {i} out of range ({len(self.consts)} constants)")
                    value = self.consts[i]
                    if (op == "int") != isinstance(value, int):
                        self.fail(f"{op} refers to a constant of the wrong type")
                    ins.append(value)
                elif letter == "b":
                    v = self.u8()
                    if op == "bool" and v > 1:
                        self.fail("invalid boolean")
                    if op == "scratch" and len(ins) == 2:
                        if v >= len(DTYPES):
                            self.fail(f"invalid dtype {v}")
                        v = DTYPES[v]
                    ins.append(bool(v) if op == "bool" else v)
                else:
                    ins.append(self.u16())
            code.append(tuple(ins))
        return code

    def done(self):
        if self.pos != self.end:
            self.fail(f"{self.end - self.pos} unexpected trailing bytes")


def read(data, source=None, checked=True):
    """.loombc bytes -> a checked Module, or LoomError. checked=False returns a
    module part (see language.parse) whose references are checked once merged."""
    data = bytes(data)
    head = _Cursor(data, 0, len(data), None, source)
    if head.take(len(MAGIC)) != MAGIC:
        raise LoomError(f"{source or '.loombc'}: not a .loombc file (bad magic)")
    version = head.u16()
    if version not in READABLE_VERSIONS:
        head.fail(f"format version {version} is not supported (this reader knows "
                  f"{', '.join(map(str, READABLE_VERSIONS))})")
    n = head.u16()
    if n * 12 > len(data) - head.pos:
        head.fail(f"section table of {n} entries does not fit in the file")
    table, spans = {}, []
    for _ in range(n):
        sid, offset, length = struct.unpack("<III", head.take(12))
        if sid not in SECTION_NAMES:
            head.fail(f"unknown section id {sid}")
        if sid in table:
            head.fail(f"section {SECTION_NAMES[sid]} appears twice")
        if offset < head.pos or offset > len(data) or length > len(data) - offset:
            head.fail(f"section {SECTION_NAMES[sid]} spans bytes {offset}..{offset + length} outside the file")
        table[sid] = (offset, offset + length)
        spans.append((offset, offset + length, sid))
    table_end = len(MAGIC) + 4 + 12 * n
    spans.sort()
    for (a0, a1, sa), (b0, _, sb) in zip(spans, spans[1:]):
        if b0 < a1:
            head.fail(f"sections {SECTION_NAMES[sa]} and {SECTION_NAMES[sb]} overlap")
    if spans and spans[0][0] < table_end:
        head.fail("a section overlaps the section table")
    for required in (STRINGS, CONSTS, MODULE, SPECS, PARAMS, STATES, KERNELS, COMMANDS):
        if required not in table:
            head.fail(f"missing section {SECTION_NAMES[required]}")

    def cursor(sid):
        c = _Cursor(data, *table[sid], sid, source)
        c.strings, c.consts = strings, consts
        return c

    strings, consts = [], []
    c = cursor(STRINGS)
    for _ in range(c.count(4, "string")):
        raw = c.take(c.u32())
        try:
            strings.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            c.fail("string is not valid UTF-8")
    c.done()
    c = cursor(CONSTS)
    for _ in range(c.count(9, "constant")):
        tag = c.u8()
        raw = c.take(8)
        if tag == 0:
            consts.append(struct.unpack("<q", raw)[0])
        elif tag == 1:
            value = struct.unpack("<d", raw)[0]
            if not math.isfinite(value):
                c.fail("non-finite float constant")
            consts.append(value)
        else:
            c.fail(f"invalid constant tag {tag}")
    c.done()

    c = cursor(MODULE)
    module = Module(c.s(), c.opt())
    if module.kind is not None and module.kind not in KINDS:
        c.fail(f"unknown kind {module.kind!r}")
    c.done()
    c = cursor(SPECS)
    module.specs = [Spec(c.s(), c.code()) for _ in range(c.count(8, "spec"))]
    c.done()
    c = cursor(PARAMS)
    for _ in range(c.count(8, "param")):
        name = c.s()
        count = c.code() if c.flag() else None
        dtype = c.enum(DTYPES, "dtype")
        dims = [c.code() for _ in range(c.u8())]
        sources = [c.s() for _ in range(c.u8())]
        when = c.code() if c.flag() else None
        tiled = (c.code(), c.code()) if version >= 3 and c.flag() else None
        if not dims or not sources:
            c.fail(f"param {name!r} needs dimensions and a source")
        module.params.append(Param(name, count, dtype, dims, sources, when, tiled))
    c.done()
    c = cursor(STATES)
    for _ in range(c.count(8, "state")):
        name = c.s()
        dtype = c.enum(DTYPES, "dtype")
        page = c.code() if c.flag() else None
        dims = [c.code() for _ in range(c.u8())]
        if not dims:
            c.fail(f"state {name!r} needs dimensions")
        module.states.append(State(name, dtype, page, dims))
    c.done()
    c = cursor(KERNELS)
    for _ in range(c.count(8, "kernel")):
        name = c.s()
        args = []
        for _ in range(c.u8()):
            arg_name = c.s()
            arg_type = c.enum(KERNEL_ARG_TYPES, "argument type")
            binds = [c.s() for _ in range(c.u8())]
            if (arg_type == "tensor") != bool(binds):
                c.fail(f"kernel {name!r}: only tensor arguments bind dimensions, and they must bind some")
            args.append(KernelArg(arg_name, arg_type, binds))
        is_library = c.flag()
        text = c.s()
        entry = c.s()
        lets = [(c.s(), c.code()) for _ in range(c.u8())] if version >= 2 else []
        defines = [(c.opt(), c.code()) for _ in range(c.u16())]
        grid = [c.code() for _ in range(c.u8())]
        local = [c.code() for _ in range(len(grid))] if c.flag() else None
        call = [c.code() for _ in range(c.u8())] if c.flag() else None
        module.kernels.append(Kernel(name, args, text if is_library else None, None if is_library else text,
                                     entry, defines, grid, local, call, lets))
    c.done()
    c = cursor(COMMANDS)
    for _ in range(c.count(9, "command")):
        name = c.s()
        args = [(c.s(), c.enum(ARG_TYPES, "argument type")) for _ in range(c.u8())]
        module.commands.append(Command(name, args, c.code()))
    c.done()
    if POLICY in table:
        c = cursor(POLICY)
        text = c.s()
        c.done()
        from . import jsonin
        try:
            module.policy = jsonin.loads(text.encode())
        except jsonin.JSONInputError as e:
            c.fail(f"policy is not strict JSON: {e.message}")
    for kind, names in (("spec", module.specs), ("param", module.params), ("state", module.states),
                        ("kernel", module.kernels), ("command", module.commands)):
        seen = set()
        for decl in names:
            if decl.name in seen:
                raise LoomError(f"{source or '.loombc'}: {kind} {decl.name!r} is declared twice")
            seen.add(decl.name)
    return check(module, source) if checked else module


# -- disassembly -----------------------------------------------------------------

def disassemble(module):
    """A readable listing of every section, with code as instructions."""
    from .language import expr_text
    out = [f"module {module.name}" + (f" kind {module.kind}" if module.kind else "")]

    def listing(code, indent):
        depth = 0
        for n, ins in enumerate(code):
            if ins[0] in ("end", "else"):
                depth -= 1
            operands = " ".join(json.dumps(x) if isinstance(x, str) else str(x) for x in ins[1:])
            out.append(f"{'  ' * indent}{n:4}  {'  ' * depth}{ins[0]} {operands}".rstrip())
            if ins[0] in ("for", "if", "else"):
                depth += 1

    out.append(f"\nspecs ({len(module.specs)})")
    for s in module.specs:
        out.append(f"  {s.name} = {expr_text(s.code)}")
    out.append(f"\nparams ({len(module.params)})")
    for p in module.params:
        count = f"[{expr_text(p.count)}]" if p.count else ""
        dims = ", ".join(expr_text(d) for d in p.dims)
        when = f" when {expr_text(p.when)}" if p.when else ""
        tiled = f" tiled({expr_text(p.tiled[0])}, {expr_text(p.tiled[1])})" if p.tiled else ""
        out.append(f"  {p.name}{count} {p.dtype}[{dims}] <- {' | '.join(p.sources)}{tiled}{when}")
    out.append(f"\nstates ({len(module.states)})")
    for s in module.states:
        page = f" paged({expr_text(s.page)})" if s.page else ""
        out.append(f"  {s.name} {s.dtype}{page}[{', '.join(expr_text(d) for d in s.dims)}]")
    out.append(f"\nkernels ({len(module.kernels)})")
    for k in module.kernels:
        where = k.library if k.library is not None else f"inline, {len(k.source)} chars"
        out.append(f"  {k.name} -> {k.entry} ({where}); args "
                   + ", ".join(a.name + ":" + a.type + (f"[{','.join(a.binds)}]" if a.binds else "") for a in k.args))
        for name, code in k.lets:
            out.append(f"    let {name} = {expr_text(code)}")
        for name, code in k.defines:
            out.append(f"    -D {name or '<flag>'} = {expr_text(code)}")
        if k.call is not None:
            out.append(f"    args [{', '.join(expr_text(a) for a in k.call)}]")
        out.append(f"    grid [{', '.join(expr_text(g) for g in k.grid)}]"
                   + (f" local [{', '.join(expr_text(g) for g in k.local)}]" if k.local else ""))
    out.append(f"\ncommands ({len(module.commands)})")
    for c in module.commands:
        out.append(f"  {c.name}({', '.join(f'{a}: {t}' for a, t in c.args)}): {len(c.body)} instructions")
        listing(c.body, 1)
    if module.policy is not None:
        out.append(f"\npolicy: {len(json.dumps(module.policy))} bytes of JSON, keys {sorted(module.policy)}")
    return "\n".join(out) + "\n"
