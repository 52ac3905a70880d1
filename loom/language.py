"""The Loom source language: `.loom` text <-> Module.

A module declares what a model needs and how to run it:

    spec    compile-time values bound from checkpoint metadata and options
    param   device parameters prepared from checkpoint tensors
    state   retained device state (e.g. paged KV)
    kernel  an OpenCL kernel: library or inline source, typed arguments,
            specialization defines and launch geometry
    command a program for the control VM: loops, scalar arithmetic,
            scratch buffers, kernel launches, calls
    policy  a JSON object for the serving policy (chat template, limits...)

Code (spec values, shapes, geometry, command bodies) is kept in one form:
a flat list of instructions for a stack machine with structured control flow
(`for`/`if`/`else`/`end` bracket their bodies, as in WebAssembly). That is
what .loombc stores and the VM runs, and because it is structured it prints
back to text exactly, so text -> module -> text is a fixed point and
text -> module -> binary -> module is lossless.

The grammar is in docs/language.md. Command line for authors:

    python -m loom.language check x.loom
    python -m loom.language compile x.loom -o x.loombc
    python -m loom.language disassemble x.loombc
"""

import json
import re
import sys
from dataclasses import dataclass, field

from . import open_regular

DTYPES = ("f32", "f16", "i32", "weight")
ARG_TYPES = ("buf", "int", "float")
KINDS = ("text", "sequence", "embedding", "decision", "image", "speech", "recognition")

BINARY = {  # operator -> (opcode, precedence); higher binds tighter
    "or": ("or", 1), "and": ("and", 2),
    "==": ("eq", 4), "!=": ("ne", 4), "<": ("lt", 4), "<=": ("le", 4), ">": ("gt", 4), ">=": ("ge", 4),
    "+": ("add", 5), "-": ("sub", 5),
    "*": ("mul", 6), "/": ("div", 6), "//": ("idiv", 6), "%": ("mod", 6),
    "**": ("pow", 8),
}
OPERATOR = {op: sym for sym, (op, _) in BINARY.items()}
PRECEDENCE = {op: prec for _, (op, prec) in BINARY.items()}
UNARY = {"neg": "-", "not": "not "}

# Functions callable in expressions, with their arity (None = 1 or 2).
BUILTINS = {
    "meta": None,     # meta("key") or meta("key", default): checkpoint metadata
    "option": None,   # option("name") or option("name", default): model document options
    "shape": 2,       # shape("tensor", axis): a checkpoint tensor's dimension (row-major axis)
    "has": 1,         # has("tensor"): whether the checkpoint holds it
    "count": 1,       # count("blk.{i}.x"): layers present, i = 0, 1, ... while the name exists
    "dtype": 1,       # dtype(x): a weight's storage type as a string ("F32", "Q8_0", ...)
    "tiles": 1,       # tiles(w): the tile width of a param declared tiled(axis, width), else 0
    "pages": 1,       # pages(state): pages in a paged state pool
    "present": 1,     # present(w[l]): whether a param (layer) exists in this checkpoint
    "dim": 2,         # dim(w[l], axis): a param's dimension (what a "?" in its shape bound)
    "min": 2, "max": 2, "ceil": 2,  # ceil(a, b) is integer ceiling division
    "int": 1, "float": 1, "sqrt": 1,
}

# Visible to specs: the checkpoint format ("gguf", "safetensors" or "ctranslate2"), the
# device's driver family ("pocl", "intel", "nvidia", ...: device.driver_family) and its native
# float vector width (8 on AVX2, 16 with AVX-512; 0 unknown).
SPEC_PREDEFINED = ("format", "driver", "vector_width", "int8_dot")

STATEMENT_OPS = ("let", "scratch", "for", "if", "else", "end", "launch", "invoke")

# A param dimension written "?": the checkpoint tensor's own size (a name no expression can spell).
ANY_DIM = (("name", "?"),)
# A placeholder in a tensor name pattern: "down_blocks.{i // LPB}.resnets.{i % LPB}.conv1.weight".
PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


def pattern_code(pattern):
    """The placeholders of a tensor name pattern as [(text, code)]; a stray brace rejects."""
    if PLACEHOLDER.sub("", pattern).count("{") or PLACEHOLDER.sub("", pattern).count("}"):
        raise LoomError(f"tensor name {pattern!r} has an unmatched brace")
    out = []
    for m in PLACEHOLDER.finditer(pattern):
        parser = Parser(m.group(1))
        if parser.peek().kind == "eof":
            raise LoomError(f"tensor name {pattern!r} has an empty placeholder")
        code = parser.expr()
        if parser.peek().kind != "eof":
            raise LoomError(f"tensor name {pattern!r}: placeholder {{{m.group(1)}}} is not one expression")
        out.append((m.group(0), code))
    return out


class LoomError(ValueError):
    """A source or module error, with a location when there is one. `quotes`: whether the
    message may hold text read from the source (a name, a token); a parse that must not
    quote its file (a server file, parse(quote=False)) says only where and what was expected."""

    def __init__(self, message, line=None, col=None, source=None, quotes=True):
        where = f"{source or '<source>'}:{line}:{col}: " if line is not None else ""
        super().__init__(where + message)
        self.message = message
        self.line = line
        self.col = col
        self.source = source
        self.quotes = quotes


# -- the module ------------------------------------------------------------------

@dataclass
class Spec:
    name: str
    code: list


@dataclass
class Param:
    name: str
    count: list | None          # code for the layer count when declared as name[count]
    dtype: str
    dims: list                  # code per dimension; ANY_DIM takes the tensor's own size
    sources: list               # tensor name patterns ({EXPR} placeholders) or, prefixed "=", another param
    when: list | None = None    # code for a condition: the param exists only where it holds
    tiled: tuple | None = None  # (axis code, width code): the device holds it in tiles along axis


@dataclass
class State:
    name: str
    dtype: str
    page: list | None           # code for the page size when paged
    dims: list


@dataclass
class KernelArg:
    name: str
    type: str                   # buf | int | float | tensor
    binds: list = field(default_factory=list)   # names bound to a tensor argument's dimensions


@dataclass
class Kernel:
    name: str
    args: list
    library: str | None         # file in opencl/, or None for inline source
    source: str | None          # inline OpenCL C
    entry: str
    defines: list               # (name, code) pairs; name None = a flag whose name is the code's string value
    grid: list
    local: list | None
    call: list | None = None    # code per OpenCL argument when they differ from the declared ones
    lets: list = field(default_factory=list)    # (name, code): local bindings, in order, before defines


@dataclass
class Command:
    name: str
    args: list                  # (name, type)
    body: list


@dataclass
class Module:
    name: str
    kind: str | None = None
    specs: list = field(default_factory=list)
    params: list = field(default_factory=list)
    states: list = field(default_factory=list)
    kernels: list = field(default_factory=list)
    commands: list = field(default_factory=list)
    policy: dict | None = None

    def find(self, section, name):
        return next((d for d in getattr(self, section) if d.name == name), None)


# -- lexer -----------------------------------------------------------------------

TOKEN = re.compile(r"""
    (?P<ws>[ \t\r\n]+|\#[^\n]*)
  | (?P<triple>\"\"\"[\s\S]*?\"\"\")
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<float>(?:\d+\.(?!\.)\d*|(?<!\.)\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)
  | (?P<int>\d+)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>\*\*|//|==|!=|<=|>=|\.\.|[-+*/%<>()\[\]{},:=|?;])
""", re.VERBOSE)

KEYWORDS = {"module", "kind", "spec", "param", "state", "kernel", "command", "policy", "let", "scratch",
            "for", "in", "if", "else", "and", "or", "not", "from", "source", "entry", "defines", "grid",
            "local", "paged", "flag", "true", "false", "args", "when", "tiled"}


@dataclass
class Tok:
    kind: str
    text: str
    line: int
    col: int


def tokenize(text, source=None, quote=True):
    tokens, pos, line, line_start = [], 0, 1, 0
    while pos < len(text):
        m = TOKEN.match(text, pos)
        if not m:
            raise LoomError(f"unexpected character {text[pos]!r}" if quote else
                            "expected a token of Loom source (a name, number, string, operator or comment)",
                            line, pos - line_start + 1, source, quotes=quote)
        kind, value = m.lastgroup, m.group()
        if kind != "ws":
            if kind == "name" and value in KEYWORDS:
                kind = "kw"
            tokens.append(Tok(kind, value, line, pos - line_start + 1))
        newlines = value.count("\n")
        if newlines:
            line += newlines
            line_start = pos + value.rindex("\n") + 1
        pos = m.end()
    # End of file is reported just after the last token, where the missing text belongs.
    last = tokens[-1] if tokens else None
    tokens.append(Tok("eof", "", last.line, last.col + len(last.text)) if last and "\n" not in last.text
                  else Tok("eof", "", line, pos - line_start + 1))
    return tokens


def _unquote(tok, source=None):
    if tok.kind == "triple":
        return tok.text[3:-3]  # raw: kernel source is written as is, backslashes included
    try:
        return json.loads(tok.text)
    except json.JSONDecodeError:
        raise LoomError("invalid escape in string", tok.line, tok.col, source, quotes=False) from None


# -- parser ----------------------------------------------------------------------

class Parser:
    def __init__(self, text, source=None, quote=True):
        self.text = text
        self.source = source
        self.quote = quote          # False: a server file, whose text no message repeats
        self.tokens = tokenize(text, source, quote)
        self.i = 0

    def error(self, message, tok=None, found=None, quoting=None):
        """A LoomError at `tok` (default: the next token): `message` says what was expected;
        when the parse may quote its text, `found` (the text met instead) is added, or
        `quoting` (a message naming what the source says) replaces it."""
        tok = tok or self.peek()
        if self.quote and quoting is not None:
            message = quoting
        elif self.quote and found is not None:
            message = f"{message}, found {found or 'end of file'!r}"
        return LoomError(message, tok.line, tok.col, self.source,
                         quotes=self.quote and (found is not None or quoting is not None))

    def peek(self, ahead=0):
        return self.tokens[min(self.i + ahead, len(self.tokens) - 1)]

    def next(self):
        tok = self.peek()
        self.i += 1
        return tok

    def at(self, text, kind=None):
        tok = self.peek()
        return tok.text == text and (kind is None or tok.kind == kind) and tok.kind not in ("string", "triple")

    def accept(self, text):
        if self.at(text):
            return self.next()
        return None

    def expect(self, text):
        if not self.at(text):
            raise self.error(f"expected {text!r}", found=self.peek().text)
        return self.next()

    def name(self, what="a name"):
        tok = self.peek()
        if tok.kind != "name":
            raise self.error(f"expected {what}", found=tok.text)
        return self.next().text

    def string(self, what="a string"):
        tok = self.peek()
        if tok.kind not in ("string", "triple"):
            raise self.error(f"expected {what}")
        return _unquote(self.next(), self.source)

    # module := 'module' NAME ('kind' NAME)? decl*
    def module(self, checked=True):
        self.expect("module")
        module = Module(self.name("the module name"))
        if self.accept("kind"):
            tok = self.peek()
            module.kind = self.name("a kind")
            if module.kind not in KINDS:
                raise self.error(f"expected a kind: one of {', '.join(KINDS)}", tok,
                                 quoting=f"unknown kind {module.kind!r}; one of {', '.join(KINDS)}")
        while self.peek().kind != "eof":
            tok = self.peek()
            keyword = tok.text if tok.kind == "kw" else None
            parse = {"spec": self.spec, "param": self.param, "state": self.state, "kernel": self.kernel,
                     "command": self.command, "policy": self.policy}.get(keyword)
            if parse is None:
                raise self.error("expected a declaration (spec, param, state, kernel, command, policy)",
                                 found=tok.text)
            self.next()
            parse(module, tok)
        return check(module, self.source) if checked else module

    def declare(self, module, section, decl, tok):
        if module.find(section, decl.name) is not None:
            raise self.error(f"expected a new {section[:-1]} name: this one is declared twice", tok,
                             quoting=f"{section[:-1]} {decl.name!r} is declared twice")
        getattr(module, section).append(decl)

    def spec(self, module, tok):
        name = self.name()
        self.expect("=")
        self.declare(module, "specs", Spec(name, self.expr()), tok)

    def param(self, module, tok):
        name = self.name()
        count = None
        if self.accept("["):
            count = self.expr()
            self.expect("]")
        self.expect(":")
        dtype = self.dtype()
        dims = self.shape(any_dim=True)
        self.expect("=")
        sources = [self.source_ref()]
        while self.accept("|"):
            sources.append(self.source_ref())
        tiled = None
        if self.accept("tiled"):
            self.expect("(")
            axis = self.expr()
            self.expect(",")
            tiled = (axis, self.expr())
            self.expect(")")
        when = self.expr() if self.accept("when") else None
        self.declare(module, "params", Param(name, count, dtype, dims, sources, when, tiled), tok)

    def source_ref(self):
        if self.peek().kind == "name":
            return "=" + self.next().text
        return self.string("a tensor name or a param")

    def dtype(self):
        tok = self.peek()
        if tok.text not in DTYPES or tok.kind != "name":
            raise self.error(f"expected a dtype ({', '.join(DTYPES)})")
        return self.next().text

    def shape(self, any_dim=False):
        self.expect("[")
        dims = [self.dim(any_dim)]
        while self.accept(","):
            dims.append(self.dim(any_dim))
        self.expect("]")
        return dims

    def dim(self, any_dim):
        if any_dim and self.at("?") and self.peek(1).text in (",", "]"):
            self.next()
            return list(ANY_DIM)
        return self.expr()

    def state(self, module, tok):
        name = self.name()
        self.expect(":")
        dtype = self.dtype()
        page = None
        if self.accept("paged"):
            self.expect("(")
            page = self.expr()
            self.expect(")")
        self.declare(module, "states", State(name, dtype, page, self.shape()), tok)

    def arguments(self, tensors):
        """'(' name ':' type, ... ')' -> [(name, type, bound dimension names)]."""
        self.expect("(")
        args = []
        while not self.at(")"):
            if args:
                self.expect(",")
            arg_name = self.name("an argument name")
            self.expect(":")
            type_tok = self.peek()
            arg_type = self.name("an argument type")
            binds = []
            if arg_type == "tensor" and tensors:
                self.expect("[")
                binds.append(self.name("a dimension name"))
                while self.accept(","):
                    binds.append(self.name("a dimension name"))
                self.expect("]")
            elif arg_type not in ARG_TYPES:
                kinds = "buf, int, float or tensor[...]" if tensors else "buf, int or float"
                raise self.error(f"expected an argument type: {kinds}", type_tok,
                                 quoting=f"argument type must be {kinds}, not {arg_type!r}")
            args.append((arg_name, arg_type, binds))
        self.expect(")")
        return args

    def kernel(self, module, tok):
        name = self.name()
        args = [KernelArg(n, t, b) for n, t, b in self.arguments(tensors=True)]
        library = source = None
        if self.accept("from"):
            library = self.string("a library file name")
        elif self.accept("source"):
            source = self.string("OpenCL C source")
        else:
            raise self.error("expected 'from \"file.cl\"' or 'source \"\"\"...\"\"\"'")
        entry = self.string("an entry point name") if self.accept("entry") else name
        lets = []
        while self.accept("let"):
            bound = self.name("a let name")
            self.expect("=")
            lets.append((bound, self.expr()))
        defines = []
        if self.accept("defines"):
            self.expect("{")
            while not self.at("}"):
                if defines:
                    self.expect(",")
                if self.accept("flag"):
                    defines.append((None, self.expr()))
                else:
                    define = self.name("a define name")
                    self.expect("=")
                    defines.append((define, self.expr()))
            self.expect("}")
        call = self.shape() if self.accept("args") else None
        self.expect("grid")
        grid = self.shape()
        local = self.shape() if self.accept("local") else None
        self.declare(module, "kernels", Kernel(name, args, library, source, entry, defines, grid, local, call, lets),
                     tok)

    def command(self, module, tok):
        name = self.name()
        args = [(n, t) for n, t, _ in self.arguments(tensors=False)]
        body = []
        self.block(body)
        self.declare(module, "commands", Command(name, args, body), tok)

    def block(self, code):
        self.expect("{")
        while not self.accept("}"):
            self.statement(code)

    def statement(self, code):
        tok = self.peek()
        if self.accept("let"):
            name = self.name()
            self.expect("=")
            code += self.expr()
            code.append(("let", name))
        elif self.accept("scratch"):
            name = self.name()
            self.expect(":")
            dtype = self.dtype()
            dims = self.shape()
            for dim in dims:
                code += dim
            code.append(("scratch", name, dtype, len(dims)))
        elif self.accept("for"):
            var = self.name("a loop variable")
            self.expect("in")
            code += self.expr()
            self.expect("..")
            code += self.expr()
            code.append(("for", var))
            self.block(code)
            code.append(("end",))
        elif self.accept("if"):
            code += self.expr()
            code.append(("if",))
            self.block(code)
            if self.accept("else"):
                code.append(("else",))
                if self.at("if"):
                    self.statement(code)  # else if: a nested if inside the else block
                else:
                    self.block(code)
            code.append(("end",))
        elif tok.kind == "name" and self.peek(1).text == "(":
            name = self.next().text
            args = self.call_args()
            for arg in args:
                code += arg
            code.append(("call", name, len(args)))  # resolved to launch/invoke by check()
        else:
            raise self.error("expected a statement (let, scratch, for, if, or a call)", found=tok.text)
        self.accept(";")

    def call_args(self):
        self.expect("(")
        args = []
        while not self.at(")"):
            if args:
                self.expect(",")
            args.append(self.expr())
        self.expect(")")
        return args

    def policy(self, module, tok):
        if module.policy is not None:
            raise self.error("policy is declared twice", tok)
        start = self.peek()
        if start.text != "{":
            raise self.error("expected a JSON object after policy")
        # The policy is a JSON object: find its extent by bracket depth over tokens.
        depth = 0
        while True:
            t = self.next()
            if t.kind == "eof":
                raise self.error("unterminated policy object", start)
            if t.text in "{[" and t.kind == "op":
                depth += 1
            elif t.text in "}]" and t.kind == "op":
                depth -= 1
                if depth == 0:
                    break
        end = self.tokens[self.i - 1]
        offset = _offset(self.text, start.line, start.col)
        stop = _offset(self.text, end.line, end.col) + 1
        from . import jsonin
        try:
            module.policy = jsonin.loads(self.text[offset:stop].encode())
        except jsonin.JSONInputError as e:
            raise self.error("expected a strict JSON object after policy", start,
                             quoting=f"policy is not strict JSON: {e.message}") from None

    # expressions: precedence climbing, emitting postfix code
    def expr(self, min_prec=0):
        code = self.unary()
        while True:
            tok = self.peek()
            if tok.kind in ("op", "kw") and tok.text in BINARY:
                op, prec = BINARY[tok.text]
                if prec < min_prec:
                    break
                self.next()
                # ** is right-associative; the rest associate left
                code += self.expr(prec if op == "pow" else prec + 1)
                code.append((op,))
            elif tok.text == "?" and min_prec <= 0:
                self.next()
                then = self.expr()
                self.expect(":")
                otherwise = self.expr()
                code += then + otherwise + [("select",)]
            else:
                break
        return code

    def unary(self):
        if self.accept("-"):
            code = self.expr(7)
            if len(code) == 1 and code[0][0] in ("int", "float"):
                return [(code[0][0], -code[0][1])]  # a negative literal, so it prints back the same
            return code + [("neg",)]
        if self.accept("not"):
            return self.expr(3) + [("not",)]
        return self.postfix()

    def postfix(self):
        code = self.atom()
        while self.at("["):
            self.next()
            code += self.expr()
            self.expect("]")
            code.append(("index",))
        return code

    def atom(self):
        tok = self.next()
        if tok.kind == "int":
            return [("int", int(tok.text))]
        if tok.kind == "float":
            return [("float", float(tok.text))]
        if tok.kind in ("string", "triple"):
            return [("str", _unquote(tok, self.source))]
        if tok.kind == "kw" and tok.text in ("true", "false"):
            return [("bool", tok.text == "true")]
        if tok.text == "(":
            code = self.expr()
            self.expect(")")
            return code
        if tok.kind == "name":
            if self.at("("):
                if tok.text not in BUILTINS:
                    raise self.error(f"expected a function: one of {', '.join(BUILTINS)}", tok,
                                     quoting=f"unknown function {tok.text!r}")
                args = self.call_args()
                arity = BUILTINS[tok.text]
                if (arity is None and len(args) not in (1, 2)) or (arity is not None and len(args) != arity):
                    raise self.error(f"expected {arity or '1 or 2'} arguments in this call, got {len(args)}", tok,
                                     quoting=f"{tok.text}() takes {arity or '1 or 2'} arguments, got {len(args)}")
                return [op for arg in args for op in arg] + [("fn", tok.text, len(args))]
            return [("name", tok.text)]
        raise self.error("expected an expression", tok, found=tok.text)


def _offset(text, line, col):
    lines = text.split("\n")
    return sum(len(l) + 1 for l in lines[:line - 1]) + col - 1


def parse(text, source=None, checked=True, quote=True):
    """Parse .loom text into a checked Module. With checked=False the result is a
    part of a multi-file module (say, config.loom beside advance.loombc): names it
    uses from the other parts are resolved when the parts are merged and checked.
    With quote=False a syntax error names the position and what was expected, never
    the text found there (the text of a server file is never repeated to a client)."""
    return Parser(text, source, quote).module(checked)


# -- checking ----------------------------------------------------------------------

# Preprocessor file access in any spelling: '#', the digraph '%:' or the trigraph '??=',
# then include/include_next/import/embed; and the __has_include family. Of these only
# INCLUDE's plain form passes: a quoted relative name that the server itself resolves
# inside the package or the kernel library (include_files), never on the filesystem.
_FILE_DIRECTIVE = re.compile(r"(?:#|%:|\?\?=)\s*(?:include|import|embed)|__has_(?:include|embed)")
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"((?:[A-Za-z0-9_-][A-Za-z0-9_.-]*/)*[A-Za-z0-9_-][A-Za-z0-9_.-]*)"'
                     r'[ \t]*(?://.*)?$', re.M)
MAX_INCLUDE_DEPTH = 8


def include_problem(text):
    """Why an OpenCL source's file directives are not all plain package includes, or None."""
    text = text.replace("\\\n", "")
    plain = {m.start() for m in INCLUDE.finditer(text)}
    for m in _FILE_DIRECTIVE.finditer(text):
        line = text.rfind("\n", 0, m.start()) + 1
        if line not in plain or any(part in ("", ".", "..") for part in
                                    INCLUDE.match(text, line).group(1).split("/")):
            shown = text[line:text.find("\n", m.start()) if "\n" in text[m.start():] else None].strip()
            return (f"{shown[:80]!r}: only #include \"relative/name\" is allowed, resolved inside the package "
                    "or the kernel library")
    return None


def include_files(kernel, text, read, depth=0):
    """`text` with each #include "name" replaced by read(name) (the package's file, else the
    kernel library's), recursively; LoomError for a name found in neither."""
    if depth > MAX_INCLUDE_DEPTH:
        raise LoomError(f"kernel {kernel}: includes nest deeper than {MAX_INCLUDE_DEPTH}")
    problem = include_problem(text)
    if problem:
        raise LoomError(f"kernel {kernel}: {problem}")

    def expand(m):
        name = m.group(1)
        body = read(name)
        if body is None:
            raise LoomError(f"kernel {kernel} includes {name!r}, which is neither in the package nor the "
                            "kernel library")
        line = text.count("\n", 0, m.start()) + 2
        return f'#line 1 "{name}"\n{include_files(kernel, body, read, depth + 1)}\n#line {line} "{kernel}"'

    return INCLUDE.sub(expand, text.replace("\\\n", ""))


def check(module, source=None):
    """Resolve names and validate a module's structure (used for text and binary alike)."""
    def fail(message):
        raise LoomError(message, source=source)

    kernels = {k.name: k for k in module.kernels}
    commands = {c.name: c for c in module.commands}
    globals_ = {s.name for s in module.specs} | {p.name for p in module.params} | {s.name for s in module.states}
    seen = set(SPEC_PREDEFINED)
    for spec in module.specs:
        _check_expr(spec.code, {s for s in seen}, f"spec {spec.name}", fail)
        seen.add(spec.name)
    specs = {s.name for s in module.specs}
    params = {p.name for p in module.params}
    declared = set()
    for p in module.params:
        layer = specs | ({"i"} if p.count is not None else set())     # a layered param's own index
        if p.count is not None:
            _check_expr(p.count, specs, f"param {p.name}", fail)
        for dim in p.dims:
            if tuple(dim) != ANY_DIM:
                _check_expr(dim, layer, f"param {p.name}", fail)
        if p.when is not None:      # may test present() of a param declared above
            _check_expr(p.when, layer | declared, f"param {p.name}", fail)
        if p.tiled is not None:
            if p.dtype not in ("f32", "f16", "weight"):
                fail(f"param {p.name}: tiled() needs dtype f32, f16 or weight, not {p.dtype}")
            for code in p.tiled:     # `storage`: the bound tensor's device type ("Q4_0", ...)
                _check_expr(code, layer | {"storage"}, f"param {p.name}", fail)
        declared.add(p.name)
        for src in p.sources:
            if src.startswith("=") and src[1:] not in params:
                fail(f"param {p.name}: source {src[1:]!r} is not a param")
            if not src.startswith("="):
                try:
                    placeholders = pattern_code(src)
                except LoomError as e:
                    fail(f"param {p.name}: {e.message}")
                for _, code in placeholders:
                    _check_expr(code, layer, f"param {p.name} source {src!r}", fail)
    for s in module.states:
        for code in ([s.page] if s.page else []) + s.dims:
            _check_expr(code, specs, f"state {s.name}", fail)
    for k in module.kernels:
        problem = include_problem(k.source) if k.source is not None else None
        if problem:
            fail(f"kernel {k.name}: an inline source reads no server file: {problem}")
        names = set(specs)
        for arg in k.args:
            if arg.name in names:
                fail(f"kernel {k.name}: argument {arg.name!r} repeats a name")
            names.add(arg.name)
            for bound in arg.binds:
                if bound in names:
                    fail(f"kernel {k.name}: dimension {bound!r} repeats a name")
                names.add(bound)
        for bound, code in k.lets:
            _check_expr(code, names, f"kernel {k.name} let {bound}", fail)
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", bound) or bound in names:
                fail(f"kernel {k.name}: let {bound!r} is not a new name")
            names.add(bound)
        for define, code in k.defines:
            if define is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", define):
                fail(f"kernel {k.name}: invalid define name {define!r}")
            _check_expr(code, names, f"kernel {k.name}", fail)
        if not 1 <= len(k.grid) <= 3 or (k.local is not None and len(k.local) != len(k.grid)):
            fail(f"kernel {k.name}: grid needs 1 to 3 dimensions and local the same count")
        for code in k.grid + (k.local or []) + (k.call or []):
            _check_expr(code, names, f"kernel {k.name}", fail)
        if k.call is not None and not k.call:
            fail(f"kernel {k.name}: args needs at least one argument")
        if (k.library is None) == (k.source is None):
            fail(f"kernel {k.name}: needs exactly one of a library file or inline source")
        if k.source is not None and ('"""' in k.source or k.source.endswith('"')):
            fail(f'kernel {k.name}: inline source may not contain \'"""\' or end with \'"\'')
        if k.library is not None and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.cl", k.library):
            fail(f"kernel {k.name}: library file must be a plain NAME.cl, not {k.library!r}")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k.entry):
            fail(f"kernel {k.name}: invalid entry point {k.entry!r}")
    for c in module.commands:
        scope = set(globals_) | {a for a, _ in c.args}
        if len({a for a, _ in c.args}) != len(c.args):
            fail(f"command {c.name}: repeated argument name")
        _check_body(c, scope, kernels, commands, fail)
    if module.policy is not None and not isinstance(module.policy, dict):
        fail("policy must be a JSON object")
    return module


EXPR_OPS = {"int", "float", "str", "bool", "name", "index", "fn", "select", "neg", "not"} | set(OPERATOR)


def _stack_effect(ins):
    op = ins[0]
    if op in ("int", "float", "str", "bool", "name"):
        return 0, 1
    if op in ("neg", "not"):
        return 1, 1
    if op in OPERATOR or op == "index":
        return 2, 1
    if op == "select":
        return 3, 1
    if op == "fn":
        return ins[2], 1
    raise KeyError(op)


def _check_expr(code, scope, where, fail):
    depth = 0
    for ins in code:
        if ins[0] not in EXPR_OPS:
            fail(f"{where}: {ins[0]!r} is not an expression instruction")
        if ins[0] == "name" and ins[1] not in scope:
            fail(f"{where}: unknown name {ins[1]!r}")
        if ins[0] == "fn" and (ins[1] not in BUILTINS or
                               (BUILTINS[ins[1]] or 0) not in (0, ins[2]) or not 1 <= ins[2] <= 2):
            fail(f"{where}: bad call of {ins[1]!r}")
        pops, pushes = _stack_effect(ins)
        if depth < pops:
            fail(f"{where}: malformed expression code")
        depth += pushes - pops
    if depth != 1:
        fail(f"{where}: malformed expression code")


def _check_body(command, scope, kernels, commands, fail):
    where = f"command {command.name}"
    depth, blocks, scope = 0, [], set(scope)
    for n, ins in enumerate(command.body):
        op = ins[0]
        if op in EXPR_OPS:
            if op == "name" and ins[1] not in scope:
                fail(f"{where}: unknown name {ins[1]!r}")
            if op == "fn" and ins[1] not in BUILTINS:
                fail(f"{where}: unknown function {ins[1]!r}")
            pops, pushes = _stack_effect(ins)
        elif op in ("let", "scratch", "for"):
            pops = {"let": 1, "scratch": ins[3] if op == "scratch" else 0, "for": 2}[op]
            pushes = 0
            if op == "scratch" and (ins[2] not in DTYPES or not 1 <= ins[3] <= 4):
                fail(f"{where}: bad scratch declaration")
            scope.add(ins[1])
            if op == "for":
                blocks.append("for")
        elif op == "if":
            pops, pushes = 1, 0
            blocks.append("if")
        elif op == "else":
            if not blocks or blocks[-1] != "if":
                fail(f"{where}: else without if")
            blocks[-1] = "else"
            pops = pushes = 0
        elif op == "end":
            if not blocks:
                fail(f"{where}: end without a block")
            blocks.pop()
            pops = pushes = 0
        elif op in ("call", "launch", "invoke"):
            name, nargs = ins[1], ins[2]
            if op != "invoke" and name in kernels:
                expected = len(kernels[name].args)
                command.body[n] = ("launch", name, nargs)
            elif op != "launch" and name in commands:
                expected = len(commands[name].args)
                command.body[n] = ("invoke", name, nargs)
            else:
                fail(f"{where}: {name!r} is neither a kernel nor a command")
            if nargs != expected:
                fail(f"{where}: {name} takes {expected} arguments, got {nargs}")
            pops, pushes = nargs, 0
        else:
            fail(f"{where}: unknown instruction {op!r}")
        if depth < pops:
            fail(f"{where}: malformed code")
        depth += pushes - pops
        if op in STATEMENT_OPS + ("call",) and depth != 0:
            fail(f"{where}: malformed code")
    if blocks or depth != 0:
        fail(f"{where}: unterminated block")


# -- printing ----------------------------------------------------------------------

def _tree(code):
    """Postfix expression code -> a nested tuple tree."""
    stack = []
    for ins in code:
        pops, _ = _stack_effect(ins)
        args = stack[len(stack) - pops:] if pops else []
        del stack[len(stack) - pops:]
        stack.append((ins, args))
    return stack


def expr_text(code):
    (root,) = _tree(code)
    return _node_text(root, 0)


def _literal(value):
    if isinstance(value, float):
        text = repr(value)
        return text if ("." in text or "e" in text or "inf" in text or "nan" in text) else text + ".0"
    return str(value)


def _node_text(node, parent_prec):
    ins, args = node
    op = ins[0]
    if op in ("int", "float"):
        text = _literal(ins[1])
        return f"({text})" if ins[1] < 0 or text.startswith("-") else text
    if op == "str":
        return json.dumps(ins[1], ensure_ascii=False)
    if op == "bool":
        return "true" if ins[1] else "false"
    if op == "name":
        return ins[1]
    if op == "index":
        return f"{_node_text(args[0], 10)}[{_node_text(args[1], 0)}]"
    if op == "fn":
        return f"{ins[1]}({', '.join(_node_text(a, 0) for a in args)})"
    if op == "select":
        text = f"{_node_text(args[0], 1)} ? {_node_text(args[1], 0)} : {_node_text(args[2], 0)}"
        return f"({text})" if parent_prec > 0 else text
    if op in UNARY:
        prec = 7 if op == "neg" else 3
        text = UNARY[op] + _node_text(args[0], prec)
        return f"({text})" if parent_prec > prec else text
    prec = PRECEDENCE[op]
    right_prec = prec if op == "pow" else prec + 1
    left_prec = prec + 1 if op == "pow" else prec
    text = f"{_node_text(args[0], left_prec)} {OPERATOR[op]} {_node_text(args[1], right_prec)}"
    return f"({text})" if parent_prec > prec else text


def _split_exprs(code, count):
    """Split concatenated expression code into `count` expressions (last ones)."""
    out, end = [], len(code)
    for _ in range(count):
        need, start = 1, end
        while need:
            start -= 1
            pops, pushes = _stack_effect(code[start])
            need += pops - pushes
        out.append(code[start:end])
        end = start
    return code[:end], out[::-1]


def format_module(module):
    """Module -> canonical .loom text (parse(format_module(m)) == m)."""
    out = [f"module {module.name}" + (f" kind {module.kind}" if module.kind else ""), ""]
    for s in module.specs:
        out.append(f"spec {s.name} = {expr_text(s.code)}")
    if module.specs:
        out.append("")
    for p in module.params:
        count = f"[{expr_text(p.count)}]" if p.count is not None else ""
        sources = " | ".join(src[1:] if src.startswith("=") else json.dumps(src, ensure_ascii=False)
                             for src in p.sources)
        when = f" when {expr_text(p.when)}" if p.when is not None else ""
        tiled = f" tiled({expr_text(p.tiled[0])}, {expr_text(p.tiled[1])})" if p.tiled is not None else ""
        out.append(f"param {p.name}{count} : {p.dtype} {_dims_text(p.dims)} = {sources}{tiled}{when}")
    if module.params:
        out.append("")
    for s in module.states:
        paged = f" paged({expr_text(s.page)})" if s.page is not None else ""
        out.append(f"state {s.name} : {s.dtype}{paged} {_dims_text(s.dims)}")
    if module.states:
        out.append("")
    for k in module.kernels:
        args = ", ".join(f"{a.name}: {a.type}" + (f"[{', '.join(a.binds)}]" if a.binds else "") for a in k.args)
        out.append(f"kernel {k.name}({args})")
        if k.library is not None:
            out.append(f"    from {json.dumps(k.library)}")
        else:
            out.append(f'    source """{k.source}"""')
        if k.entry != k.name:
            out.append(f"    entry {json.dumps(k.entry)}")
        for bound, code in k.lets:
            out.append(f"    let {bound} = {expr_text(code)}")
        if k.defines:
            defines = ", ".join(f"flag {expr_text(c)}" if d is None else f"{d} = {expr_text(c)}" for d, c in k.defines)
            out.append(f"    defines {{ {defines} }}")
        if k.call is not None:
            out.append(f"    args {_dims_text(k.call)}")
        out.append(f"    grid {_dims_text(k.grid)}" + (f" local {_dims_text(k.local)}" if k.local else ""))
        out.append("")
    for c in module.commands:
        args = ", ".join(f"{a}: {t}" for a, t in c.args)
        out.append(f"command {c.name}({args}) {{")
        _body_text(c.body, out)
        out.append("}")
        out.append("")
    if module.policy is not None:
        out.append("policy " + json.dumps(module.policy, indent=2, ensure_ascii=False))
    return "\n".join(out).rstrip("\n") + "\n"


def _dims_text(dims):
    return "[" + ", ".join(expr_text(d) for d in dims) + "]"


def _body_text(body, out):
    indent, pending = 1, []
    for ins in body:
        op = ins[0]
        if op in EXPR_OPS:
            pending.append(ins)
            continue
        pad = "    " * indent
        if op == "let":
            out.append(f"{pad}let {ins[1]} = {expr_text(pending)}")
        elif op == "scratch":
            _, dims = _split_exprs(pending, ins[3])
            out.append(f"{pad}scratch {ins[1]} : {ins[2]} {_dims_text(dims)}")
        elif op == "for":
            _, (start, end) = _split_exprs(pending, 2)
            out.append(f"{pad}for {ins[1]} in {expr_text(start)}..{expr_text(end)} {{")
            indent += 1
        elif op == "if":
            out.append(f"{pad}if {expr_text(pending)} {{")
            indent += 1
        elif op == "else":
            out.append(f"{'    ' * (indent - 1)}}} else {{")
        elif op == "end":
            indent -= 1
            out.append(f"{'    ' * indent}}}")
        elif op in ("launch", "invoke", "call"):
            _, args = _split_exprs(pending, ins[2])
            out.append(f"{pad}{ins[1]}({', '.join(expr_text(a) for a in args)})")
        pending = []


def merge(parts, names=None):
    """One checked module from module parts: declarations join, names stay unique."""
    merged = None
    for n, module in enumerate(parts):
        where = names[n] if names else f"part {n}"
        if merged is None:
            merged = module
            continue
        if module.kind is not None and module.kind != merged.kind:
            # A package may reuse another kind's part (a decision package built on the
            # bert encoder): the model document's kind decides which stage is served.
            merged.kind = None if merged.kind is not None else module.kind
        for section in ("specs", "params", "states", "kernels", "commands"):
            for decl in getattr(module, section):
                if merged.find(section, decl.name) is not None:
                    raise LoomError(f"{where}: {section[:-1]} {decl.name!r} is also declared by another part")
                getattr(merged, section).append(decl)
        if module.policy is not None:
            if merged.policy is not None:
                raise LoomError(f"{where}: policy is also declared by another part")
            merged.policy = module.policy
    if merged is None:
        raise LoomError("no sources")
    return check(merged)


# -- command line ------------------------------------------------------------------

def load(path, checked=True, quote=False):
    """A module from .loom text or .loombc binary, by content. A file is the server's
    own, so by default its syntax errors do not quote it (parse); the command line,
    run by the file's owner, quotes."""
    with open_regular(path) as f:
        data = f.read()
    return load_bytes(data, path, checked, quote)


def load_bytes(data, path, checked=True, quote=True):
    from . import bytecode
    if data.startswith(bytecode.MAGIC):
        return bytecode.read(data, source=path, checked=checked)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LoomError(f"not UTF-8 text at byte {e.start}", source=path, quotes=False) from None
    return parse(text, path, checked, quote)


def main(argv=None):
    import argparse
    from . import bytecode
    ap = argparse.ArgumentParser(prog="python -m loom.language", description="Loom module tools for authors.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="compile .loom text to .loombc")
    c.add_argument("source")
    c.add_argument("-o", "--output", required=True)
    c.add_argument("--partial", action="store_true",
                   help="a part of a multi-file module: names from the other parts are checked when they merge")
    k = sub.add_parser("check", help="parse and check .loom or .loombc files (several: as one merged module)")
    k.add_argument("source", nargs="+")
    sub.add_parser("format", help="print a module as canonical .loom text").add_argument("source")
    sub.add_parser("disassemble", help="print a module's sections and code").add_argument("source")
    p = sub.add_parser("split", help="split a module into the parts a model document names: the native "
                                     "providers (kernels, commands) and either one config part (specs, params, "
                                     "states, policy) or a prepare part (specs, params, states) and a control "
                                     "part (policy)")
    p.add_argument("source")
    p.add_argument("--program", required=True, help="the .loom file for kernels and commands")
    p.add_argument("--config", help="the .loom file for specs, params, states and policy")
    p.add_argument("--prepare", help="the .loom file for specs, params and states (a document's prepare module)")
    p.add_argument("--control", help="the .loom file for the policy (a document's control module)")
    args = ap.parse_args(argv)
    if args.cmd == "split" and (args.config is None) == (args.prepare is None or args.control is None):
        ap.error("split takes --config, or --prepare with --control")
    try:
        if args.cmd == "check":
            module = merge([load(path, checked=False, quote=True) for path in args.source], args.source)
            args.source = " + ".join(args.source)
        else:
            module = load(args.source, checked=not getattr(args, "partial", False), quote=True)
    except (LoomError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.cmd == "compile":
        with open(args.output, "wb") as f:
            f.write(bytecode.write(module))
    elif args.cmd == "split":
        program = Module(module.name, None, kernels=module.kernels, commands=module.commands)
        if args.config:
            parts = [(args.config, Module(module.name, module.kind, module.specs, module.params, module.states,
                                          policy=module.policy))]
        else:
            parts = [(args.prepare, Module(module.name, module.kind, module.specs, module.params, module.states)),
                     (args.control, Module(module.name, None, policy=module.policy))]
        for path, part in parts + [(args.program, program)]:
            with open(path, "w", encoding="utf-8") as f:
                f.write(format_module(part))
    elif args.cmd == "check":
        print(f"{args.source}: ok ({len(module.specs)} specs, {len(module.params)} params, "
              f"{len(module.states)} states, {len(module.kernels)} kernels, {len(module.commands)} commands)")
    elif args.cmd == "format":
        sys.stdout.write(format_module(module))
    else:
        sys.stdout.write(bytecode.disassemble(module))
    return 0


if __name__ == "__main__":
    sys.exit(main())
