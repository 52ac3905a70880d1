"""Chat templates: the Jinja subset that checkpoints carry (GGUF
`tokenizer.chat_template`, `chat_template` in tokenizer_config.json), rendered
the way transformers' apply_chat_template renders them (trim_blocks,
lstrip_blocks, loop controls, `tojson` without ASCII escaping,
`raise_exception`), so that a prompt is byte for byte what the model was
trained on. No template engine is a dependency; tests/test_template.py checks
this against jinja2 itself.

A template is checkpoint data, so untrusted: parsing and rendering are bounded
(nesting depth, work steps, sequence and output sizes), values expose only
data and a short list of string and mapping methods, and every failure is one
TemplateError.

    Template(source).render(messages=[...], add_generation_prompt=True, ...)
"""

import datetime
import json
import math
import re

MAX_DEPTH = 32              # nested blocks, expressions and macro calls
MAX_STEPS = 2_000_000       # nodes evaluated in one render
MAX_OUTPUT = 32 << 20       # characters one render may write, and the longest string or list it may build


class TemplateError(ValueError):
    """A template that cannot be parsed, or a render that failed (including the
    template's own raise_exception)."""


# -- lexing ----------------------------------------------------------------------------
# Text and tags first; whitespace control (`-`, `+`, trim_blocks, lstrip_blocks) is applied
# to the text between tags; then each tag's inside becomes expression tokens.

_TAG_OPEN = re.compile(r"\{([{%#])([-+]?)")
_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<string>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")
  | (?P<float>\d+\.\d+(?:[eE][-+]?\d+)?)
  | (?P<int>\d+)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>//|\*\*|==|!=|<=|>=|[-+*/%~|.,:()\[\]{}<>=])
""", re.X | re.S)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "0": "\0", "b": "\b", "f": "\f"}


def _unquote(text):
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), "\\" + m.group(1)), text[1:-1], flags=re.S)


def _lex(source):
    """source -> [("text", str) | (kind, tokens, at)] with kind "{{" or "{%"; comments dropped."""
    if source.endswith("\n"):      # jinja2 drops one trailing newline (keep_trailing_newline off)
        source = source[:-2] if source.endswith("\r\n") else source[:-1]
    pieces, pos, trim_next = [], 0, None
    while True:
        m = _TAG_OPEN.search(source, pos)
        text = source[pos:m.start() if m else len(source)]
        # The end of the tag before: "-" strips all whitespace, else a block's first newline
        # goes (jinja2 then counts the text as starting a line, for lstrip_blocks).
        line_starting = pos == 0
        if trim_next == "-":
            stripped = text.lstrip()
            line_starting = stripped != text and text[:len(text) - len(stripped)].endswith("\n")
            text = stripped
        elif trim_next == "block" and text.startswith(("\n", "\r\n")):
            text = text[text.index("\n") + 1:]
            line_starting = True
        if m:
            kind, mod = m.group(1), m.group(2)
            if mod == "-":
                text = text.rstrip()
            elif kind != "{" and mod != "+":
                # lstrip_blocks: spaces and tabs from the line's start up to a block or comment.
                line = text.rfind("\n") + 1
                if (line > 0 or line_starting) and not text[line:].strip(" \t"):
                    text = text[:line]
        if text:
            pieces.append(("text", text))
        if not m:
            return pieces
        kind, at = m.group(1), m.start()
        if kind == "#":
            end = source.find("#}", m.end())
            if end < 0:
                raise TemplateError(f"a comment at offset {at} is never closed")
            trim_next = "-" if source[end - 1] == "-" and end - 1 >= m.end() else \
                (None if source[end - 1] == "+" else "block")
            pos = end + 2
            continue
        tokens, pos, trim = _lex_tag(source, m.end(), "}}" if kind == "{" else "%}", at)
        trim_next = trim if trim == "-" else (None if kind == "{" or trim == "+" else "block")
        pieces.append(("{" + kind, tokens, at))


def _lex_tag(source, pos, close, at):
    """The tokens of one tag up to its close (outside strings and braces) -> (tokens, end, modifier)."""
    tokens, depth = [], 0
    while True:
        if pos >= len(source):
            raise TemplateError(f"a tag at offset {at} is never closed")
        if depth == 0:
            for mod in ("-", "+", ""):
                if source.startswith(mod + close, pos):
                    return tokens, pos + len(mod) + 2, mod
        m = _TOKEN.match(source, pos)
        if m is None:
            raise TemplateError(f"unexpected {source[pos]!r} at offset {pos}")
        pos = m.end()
        kind = m.lastgroup
        if kind == "ws":
            continue
        value = m.group()
        if kind == "op" and value in "([{":
            depth += 1
        elif kind == "op" and value in ")]}":
            depth -= 1
        tokens.append((kind, _unquote(value) if kind == "string" else value))


# -- parsing ---------------------------------------------------------------------------
# Nodes are tuples: ("text", s), ("out", expr), ("if", [(cond, body)...], else_body),
# ("for", targets, iterable, condition, body, else_body), ("set", target, attr, expr),
# ("setblock", target, body), ("macro", name, params, body), ("break",), ("continue",).
# Expressions are tuples too, evaluated by _Render.eval.

_END = {"if": ("elif", "else", "endif"), "for": ("else", "endfor"), "set": ("endset",),
        "macro": ("endmacro",), "generation": ("endgeneration",), "filter": ("endfilter",)}


class _Parser:
    def __init__(self, pieces):
        self.pieces, self.i = pieces, 0

    def body(self, ends=(), depth=0):
        """Nodes up to one of `ends` (block keywords) -> (nodes, the keyword, its tokens)."""
        if depth > MAX_DEPTH:
            raise TemplateError("blocks are nested too deeply")
        nodes = []
        while self.i < len(self.pieces):
            piece = self.pieces[self.i]
            self.i += 1
            if piece[0] == "text":
                nodes.append(("text", piece[1]))
            elif piece[0] == "{{":
                nodes.append(("out", _Expr(piece[1], piece[2]).whole()))
            else:
                tokens, at = piece[1], piece[2]
                if not tokens or tokens[0][0] != "name":
                    raise TemplateError(f"a block at offset {at} has no statement")
                word = tokens[0][1]
                if word in ends:
                    return nodes, word, _Expr(tokens[1:], at)
                nodes.append(self.statement(word, _Expr(tokens[1:], at), depth))
        if ends:
            raise TemplateError(f"missing {{% {ends[-1]} %}}")
        return nodes, None, None

    def statement(self, word, e, depth):
        if word == "if":
            branches, cond = [], e.whole()
            while True:
                nodes, end, rest = self.body(_END["if"], depth + 1)
                branches.append((cond, nodes))
                if end == "elif":
                    cond = rest.whole()
                    continue
                if end == "else":
                    rest.done()
                    otherwise, _, last = self.body(("endif",), depth + 1)
                    last.done()
                    return ("if", branches, otherwise)
                rest.done()
                return ("if", branches, [])
        if word == "for":
            targets = [e.name()]
            while e.accept(","):
                targets.append(e.name())
            e.expect("in")
            iterable = e.test_expr(with_condition=False)
            condition = e.test_expr() if e.accept("if") else None
            e.done()
            nodes, end, rest = self.body(_END["for"], depth + 1)
            rest.done()
            otherwise = []
            if end == "else":
                otherwise, _, last = self.body(("endfor",), depth + 1)
                last.done()
            return ("for", targets, iterable, condition, nodes, otherwise)
        if word == "set":
            target = e.name()
            attr = e.name() if e.accept(".") else None
            if e.at_end():
                nodes, _, rest = self.body(_END["set"], depth + 1)
                rest.done()
                return ("setblock", target, nodes)
            e.expect("=")
            value = e.whole()
            return ("set", target, attr, value)
        if word == "macro":
            name = e.name()
            e.expect("(")
            params = e.separated(")", lambda: (e.name(), e.test_expr() if e.accept("=") else None))
            e.done()
            nodes, _, rest = self.body(_END["macro"], depth + 1)
            rest.done()
            return ("macro", name, params, nodes)
        if word in ("break", "continue"):
            e.done()
            return (word,)
        if word == "generation":   # transformers' assistant-mask marker: renders its body
            e.done()
            nodes, _, rest = self.body(_END["generation"], depth + 1)
            rest.done()
            return ("if", [(("const", True), nodes)], [])
        raise TemplateError(f"unsupported statement {word!r}")


class _Expr:
    """Recursive descent over one tag's tokens, with Jinja's precedence."""

    def __init__(self, tokens, at):
        self.tokens, self.i, self.at, self.depth = tokens, 0, at, 0

    def peek(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else (None, None)

    def accept(self, value):
        kind, v = self.peek()
        if v == value and kind in ("op", "name"):
            self.i += 1
            return True
        return False

    def expect(self, value):
        if not self.accept(value):
            raise self.error(f"expected {value!r}")

    def error(self, what):
        got = self.peek()[1]
        return TemplateError(f"{what} in the tag at offset {self.at}" + (f", got {got!r}" if got else ""))

    def at_end(self):
        return self.i >= len(self.tokens)

    def done(self):
        if not self.at_end():
            raise self.error("unexpected tokens")

    def name(self):
        kind, v = self.peek()
        if kind != "name":
            raise self.error("expected a name")
        self.i += 1
        return v

    def whole(self):
        expr = self.test_expr()
        if self.accept(","):   # a bare tuple: {% set a = 1, 2 %}
            items = [expr]
            while not self.at_end():
                items.append(self.test_expr())
                if not self.accept(","):
                    break
            expr = ("tuple", items)
        self.done()
        return expr

    def test_expr(self, with_condition=True):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.error("the expression is nested too deeply")
        expr = self.or_expr()
        if with_condition and self.accept("if"):
            cond = self.or_expr()
            otherwise = self.test_expr() if self.accept("else") else ("const", _UNDEFINED)
            expr = ("cond", cond, expr, otherwise)
        self.depth -= 1
        return expr

    def or_expr(self):
        left = self.and_expr()
        while self.accept("or"):
            left = ("or", left, self.and_expr())
        return left

    def and_expr(self):
        left = self.not_expr()
        while self.accept("and"):
            left = ("and", left, self.not_expr())
        return left

    def not_expr(self):
        if self.accept("not"):
            return ("not", self.not_expr())
        return self.compare()

    def compare(self):
        """a < b <= c compares pairwise, as in Python and jinja2 -> ("cmp", [ops], [operands])."""
        operands, ops = [self.math1()], []
        while True:
            kind, v = self.peek()
            if kind == "op" and v in ("==", "!=", "<", ">", "<=", ">="):
                self.i += 1
            elif self.accept("in"):
                v = "in"
            elif v == "not" and self.i + 1 < len(self.tokens) and self.tokens[self.i + 1][1] == "in":
                self.i += 2
                v = "not in"
            else:
                return operands[0] if not ops else ("cmp", ops, operands)
            ops.append(v)
            operands.append(self.math1())

    def _binary(self, ops, operand):
        left = operand()
        while True:
            kind, v = self.peek()
            if kind != "op" or v not in ops:
                return left
            self.i += 1
            left = ("bin", v, left, operand())

    def math1(self):
        return self._binary(("+", "-"), self.concat)

    def concat(self):
        return self._binary(("~",), self.math2)

    def math2(self):
        return self._binary(("*", "/", "//", "%"), self.power)

    def power(self):
        return self._binary(("**",), self.unary)

    def unary(self, with_filter=True):
        kind, v = self.peek()
        if kind == "op" and v in ("-", "+"):
            self.i += 1
            node = ("neg", self.unary(False)) if v == "-" else self.unary(False)
        else:
            node = self.postfix(self.primary())
        return self.filters(node) if with_filter else node

    def primary(self):
        kind, v = self.peek()
        self.i += 1
        if kind == "name":
            consts = {"true": True, "True": True, "false": False, "False": False, "none": None, "None": None}
            return ("const", consts[v]) if v in consts else ("var", v)
        if kind == "string":
            while self.peek()[0] == "string":   # adjacent literals concatenate
                v += self.peek()[1]
                self.i += 1
            return ("const", v)
        if kind == "int":
            return ("const", int(v))
        if kind == "float":
            return ("const", float(v))
        if v == "(":
            if self.accept(")"):
                return ("tuple", [])
            first = self.test_expr()
            if not self.accept(","):
                self.expect(")")
                return first
            return ("tuple", [first] + self.separated(")", self.test_expr))
        if v == "[":
            return ("list", self.separated("]", self.test_expr))
        if v == "{":
            return ("dict", self.separated("}", self.pair))
        self.i -= 1
        raise self.error("expected a value")

    def postfix(self, node):
        while True:
            if self.accept("."):
                kind, v = self.peek()
                if kind not in ("name", "int"):
                    raise self.error("expected an attribute name")
                self.i += 1
                node = ("attr", node, v)
            elif self.accept("["):
                node = ("item", node, self.subscript())
            elif self.accept("("):
                args, kwargs = self.arguments()
                node = ("call", node, args, kwargs)
            else:
                return node

    def subscript(self):
        parts, current = [], None
        while True:
            if self.accept("]"):
                parts.append(current)
                break
            if self.accept(":"):
                parts.append(current)
                current = None
                continue
            if current is not None:
                raise self.error("expected ':' or ']'")
            current = self.test_expr()
        if len(parts) == 1:
            if parts[0] is None:
                raise self.error("expected an index")
            return parts[0]
        if len(parts) > 3:
            raise self.error("a slice has at most three parts")
        return ("slice", parts + [None] * (3 - len(parts)))

    def separated(self, close, item):
        """item() repeated, comma-separated (a trailing comma allowed), through `close` -> [items]."""
        items = []
        while not self.accept(close):
            items.append(item())
            if not self.accept(","):
                self.expect(close)
                break
        return items

    def pair(self):
        key = self.test_expr()
        self.expect(":")
        return key, self.test_expr()

    def argument(self):
        """One call argument: (None, value) or (keyword, value)."""
        kind, v = self.peek()
        if kind == "name" and self.i + 1 < len(self.tokens) and self.tokens[self.i + 1][1] == "=":
            self.i += 2
            return v, self.test_expr()
        return None, self.test_expr()

    def arguments(self):
        given = self.separated(")", self.argument)
        return [v for k, v in given if k is None], [(k, v) for k, v in given if k is not None]

    def filters(self, node):
        while True:
            if self.accept("|"):
                name = self.name()
                args, kwargs = self.arguments() if self.accept("(") else ([], [])
                node = ("filter", name, node, args, kwargs)
            elif self.accept("is"):
                negate = self.accept("not")
                name = self.name()
                args = []
                if self.accept("("):
                    args, _ = self.arguments()
                elif self.peek()[0] in ("string", "int", "float") or self.peek()[1] in ("none", "true", "false"):
                    args = [self.primary()]
                node = ("test", name, node, args)
                if negate:
                    node = ("not", node)
            else:
                return node


# -- values ----------------------------------------------------------------------------

class _Undefined:
    """A missing name or key: empty when printed or iterated, false, and an error when
    used further (attributes, arithmetic), as jinja2's default Undefined."""
    __slots__ = ("name",)

    def __init__(self, name=None):
        self.name = name

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __str__(self):
        return ""

    def __repr__(self):
        return "Undefined"

    def __eq__(self, other):
        return isinstance(other, _Undefined)

    def __hash__(self):
        return 0

    def fail(self):
        raise TemplateError(f"{self.name or 'a value'} is undefined")


_UNDEFINED = _Undefined()


class _Namespace(dict):
    """namespace(...): the one mutable value a template may assign attributes of."""


class _Loop:
    def __init__(self, items, depth):
        self.items, self.index0, self.depth = items, 0, depth

    def field(self, name):
        n, i = len(self.items), self.index0
        values = {"index0": i, "index": i + 1, "first": i == 0, "last": i == n - 1, "length": n,
                  "revindex": n - i, "revindex0": n - i - 1, "depth": self.depth, "depth0": self.depth - 1,
                  "previtem": self.items[i - 1] if i > 0 else _Undefined("loop.previtem"),
                  "nextitem": self.items[i + 1] if i + 1 < n else _Undefined("loop.nextitem")}
        if name == "cycle":
            return lambda *args: args[i % len(args)] if args else _UNDEFINED
        return values.get(name, _Undefined(f"loop.{name}"))


class _Macro:
    def __init__(self, render, params, body):
        self.render, self.params, self.body = render, params, body

    def __call__(self, *args, **kwargs):
        scope = {}
        for i, (name, default) in enumerate(self.params):
            if i < len(args):
                scope[name] = args[i]
            elif name in kwargs:
                scope[name] = kwargs[name]
            else:
                scope[name] = self.render.eval(default) if default is not None else _Undefined(name)
        return self.render.call_macro(self.body, scope)


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    """transformers' tojson: json.dumps without ASCII escaping (HTML-unsafe characters kept)."""
    try:
        return json.dumps(_plain(value), ensure_ascii=ensure_ascii, indent=indent,
                          separators=tuple(separators) if separators else None, sort_keys=sort_keys)
    except (TypeError, ValueError) as e:
        raise TemplateError(f"tojson: {e}") from None


def _plain(value):
    if isinstance(value, _Undefined):
        value.fail()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _text(value):
    if value is None:
        return "None"
    if value is True or value is False:
        return str(value)
    return str(value)       # containers print as Python shows them, as in jinja2


def _sequence(value, what):
    if isinstance(value, _Undefined):
        return []
    if isinstance(value, dict):
        return list(value)
    if isinstance(value, (list, tuple, str, type(reversed([])))):
        return list(value)
    raise TemplateError(f"{what} needs a sequence, not {type(value).__name__}")


def _attribute_getter(name):
    parts = str(name).split(".")

    def get(item):
        for part in parts:
            item = _lookup(item, int(part) if part.isdigit() else part)
        return item
    return get


def _lookup(obj, key):
    """obj.key or obj[key], jinja2-style: the mapping's item, a sequence's index, or undefined."""
    if isinstance(obj, _Undefined):
        obj.fail()
    if isinstance(obj, _Loop):
        return obj.field(key)
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        return _method(obj, key) if key in _DICT_METHODS else _Undefined(repr(key))
    if isinstance(obj, (list, tuple, str)):
        if isinstance(key, int) and not isinstance(key, bool):
            return obj[key] if -len(obj) <= key < len(obj) else _Undefined(f"index {key}")
        if isinstance(obj, str) and key in _STR_METHODS:
            return _method(obj, key)
    return _Undefined(repr(key))


# The only methods a template can call: reading ones (the sandbox transformers renders in
# refuses mutating methods the same way).
_STR_METHODS = {"strip", "lstrip", "rstrip", "split", "rsplit", "startswith", "endswith", "replace", "upper",
                "lower", "title", "capitalize", "find", "rfind", "count", "splitlines", "join"}
_DICT_METHODS = {"items", "keys", "values", "get"}


def _method(obj, name):
    method = getattr(obj, name)

    def call(*args):
        result = method(*[_plain(a) for a in args])
        if isinstance(result, (type({}.items()), type({}.keys()), type({}.values()))):
            return list(result)
        return result
    return call


def _test(name, value, args):
    tests = {
        "defined": lambda: not isinstance(value, _Undefined),
        "undefined": lambda: isinstance(value, _Undefined),
        "none": lambda: value is None,
        "string": lambda: isinstance(value, str),
        "number": lambda: isinstance(value, (int, float)) and not isinstance(value, bool),
        "integer": lambda: isinstance(value, int) and not isinstance(value, bool),
        "float": lambda: isinstance(value, float),
        "boolean": lambda: isinstance(value, bool),
        "true": lambda: value is True,
        "false": lambda: value is False,
        "mapping": lambda: isinstance(value, dict),
        "sequence": lambda: isinstance(value, (list, tuple, str, dict)),
        "iterable": lambda: isinstance(value, (list, tuple, str, dict)),
        "callable": lambda: callable(value),
        "odd": lambda: value % 2 == 1,
        "even": lambda: value % 2 == 0,
        "divisibleby": lambda: value % args[0] == 0,
        "eq": lambda: value == args[0], "equalto": lambda: value == args[0], "==": lambda: value == args[0],
        "ne": lambda: value != args[0], "!=": lambda: value != args[0],
        "lt": lambda: value < args[0], "gt": lambda: value > args[0],
        "le": lambda: value <= args[0], "ge": lambda: value >= args[0],
        "in": lambda: value in args[0],
        "lower": lambda: isinstance(value, str) and value.islower(),
        "upper": lambda: isinstance(value, str) and value.isupper(),
        "sameas": lambda: value is args[0],
    }
    if name not in tests:
        raise TemplateError(f"unknown test {name!r}")
    try:
        return bool(tests[name]())
    except (TypeError, IndexError, ZeroDivisionError) as e:
        raise TemplateError(f"test {name!r}: {e}") from None


# -- rendering -------------------------------------------------------------------------

class _Render:
    def __init__(self, template, variables):
        self.scopes = [dict(_GLOBALS), dict(variables)]
        self.out, self.size, self.steps, self.loops = [], 0, 0, 0
        self.template = template

    def run(self, nodes):
        for node in nodes:
            self.node(node)

    def write(self, text):
        self.size += len(text)
        if self.size > MAX_OUTPUT:
            raise TemplateError("the template's output is too large")
        self.out.append(text)

    def tick(self):
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise TemplateError("the template takes too many steps")

    def lookup(self, name):
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return _Undefined(repr(name))

    def node(self, node):
        self.tick()
        kind = node[0]
        if kind == "text":
            self.write(node[1])
        elif kind == "out":
            self.write(_text(self.eval(node[1])))
        elif kind == "if":
            for cond, body in node[1]:
                if self.truth(self.eval(cond)):
                    self.run(body)
                    return
            self.run(node[2])
        elif kind == "for":
            self.for_loop(*node[1:])
        elif kind == "set":
            _, target, attr, expr = node
            value = self.eval(expr)
            if attr is None:
                self.scopes[-1][target] = value
            else:
                ns = self.lookup(target)
                if not isinstance(ns, _Namespace):
                    raise TemplateError(f"{target}.{attr} can be set only on a namespace()")
                ns[attr] = value
        elif kind == "setblock":
            self.scopes[-1][node[1]] = self.capture(node[2])
        elif kind == "macro":
            self.scopes[-1][node[1]] = _Macro(self, node[2], node[3])
        elif kind == "break":
            raise _Break()
        elif kind == "continue":
            raise _Continue()

    def capture(self, nodes, scope=None):
        saved, self.out = self.out, []
        if scope is not None:
            self.scopes.append(scope)
        try:
            self.run(nodes)
            return "".join(self.out)
        finally:
            self.out = saved
            if scope is not None:
                self.scopes.pop()

    def call_macro(self, body, scope):
        if len(self.scopes) > MAX_DEPTH:
            raise TemplateError("macros call each other too deeply")
        return self.capture(body, scope)

    def for_loop(self, targets, iterable, condition, body, otherwise):
        source = self.eval(iterable)
        items = list(source.items()) if isinstance(source, dict) and len(targets) > 1 \
            else _sequence(source, "for")
        scope = {}
        self.scopes.append(scope)
        try:
            if condition is not None:
                kept = []
                for item in items:
                    self.bind(scope, targets, item)
                    if self.truth(self.eval(condition)):
                        kept.append(item)
                items = kept
            outer = self.lookup("loop")
            loop = _Loop(items, (outer.depth + 1) if isinstance(outer, _Loop) else 1)
            scope["loop"] = loop
            for i, item in enumerate(items):
                self.tick()
                loop.index0 = i
                self.bind(scope, targets, item)
                try:
                    self.run(body)
                except _Continue:
                    continue
                except _Break:
                    break
            if not items:
                self.run(otherwise)
        finally:
            self.scopes.pop()
        # Jinja scoping: assignments inside a loop body do not leak out of it.

    def bind(self, scope, targets, item):
        if len(targets) == 1:
            scope[targets[0]] = item
            return
        values = _sequence(item, "unpacking")
        if len(values) != len(targets):
            raise TemplateError(f"cannot unpack {len(values)} values into {len(targets)} names")
        scope.update(zip(targets, values))

    def truth(self, value):
        return bool(value)

    def eval(self, e):
        self.tick()
        kind = e[0]
        if kind == "const":
            return e[1]
        if kind == "var":
            return self.lookup(e[1])
        if kind == "attr":
            base = self.eval(e[1])
            return _lookup(base, int(e[2]) if e[2].isdigit() else e[2])
        if kind == "item":
            base = self.eval(e[1])
            if e[2][0] == "slice":
                return self.slice(base, e[2][1])
            return _lookup(base, self.eval(e[2]))
        if kind == "call":
            fn = self.eval(e[1])
            if isinstance(fn, _Undefined) or not callable(fn):
                raise TemplateError(f"{getattr(fn, 'name', None) or 'the value'} is not callable")
            args = [self.eval(a) for a in e[2]]
            kwargs = {k: self.eval(v) for k, v in e[3]}
            try:
                result = fn(*args, **kwargs)
            except TemplateError:
                raise
            except (TypeError, ValueError, AttributeError, IndexError, KeyError) as err:
                raise TemplateError(f"a call failed: {err}") from None
            self.bounded(result)
            return result
        if kind == "filter":
            return self.filter(e[1], self.eval(e[2]), [self.eval(a) for a in e[3]],
                               {k: self.eval(v) for k, v in e[4]})
        if kind == "test":
            return _test(e[1], self.eval(e[2]), [self.eval(a) for a in e[3]])
        if kind == "not":
            return not self.truth(self.eval(e[1]))
        if kind == "and":
            left = self.eval(e[1])
            return self.eval(e[2]) if self.truth(left) else left
        if kind == "or":
            left = self.eval(e[1])
            return left if self.truth(left) else self.eval(e[2])
        if kind == "cond":
            return self.eval(e[2]) if self.truth(self.eval(e[1])) else self.eval(e[3])
        if kind == "cmp":
            left = self.eval(e[2][0])
            for op, operand in zip(e[1], e[2][1:]):
                right = self.eval(operand)
                if not self.compare(op, left, right):
                    return False
                left = right
            return True
        if kind == "bin":
            return self.binary(e[1], self.eval(e[2]), self.eval(e[3]))
        if kind == "neg":
            value = self.eval(e[1])
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TemplateError("only numbers can be negated")
            return -value
        if kind == "list":
            return [self.eval(x) for x in e[1]]
        if kind == "tuple":
            return tuple(self.eval(x) for x in e[1])
        if kind == "dict":
            out = {}
            for k, v in e[1]:
                key = self.eval(k)
                if not isinstance(key, (str, int, float, bool, type(None))):
                    raise TemplateError("dictionary keys must be plain values")
                out[key] = self.eval(v)
            return out
        raise TemplateError(f"cannot evaluate {kind}")

    def slice(self, base, parts):
        start, stop, step = (None if p is None else self.eval(p) for p in parts)
        if isinstance(base, _Undefined):
            base.fail()
        if not isinstance(base, (list, tuple, str)):
            raise TemplateError("only sequences can be sliced")
        for p in (start, stop, step):
            if p is not None and (not isinstance(p, int) or isinstance(p, bool)):
                raise TemplateError("slice bounds must be integers")
        if step == 0:
            raise TemplateError("a slice step cannot be zero")
        return base[start:stop:step]

    def compare(self, op, a, b):
        if op == "not in":
            return not self.compare("in", a, b)
        if op == "in":
            if isinstance(b, _Undefined):
                b.fail()
            if isinstance(b, str) and not isinstance(a, str):
                raise TemplateError("'in <string>' needs a string on the left")
            if not isinstance(b, (list, tuple, str, dict)):
                raise TemplateError("'in' needs a sequence or mapping on the right")
            return a in b
        if op == "==":
            return a == b
        if op == "!=":
            return a != b
        try:
            return a < b if op == "<" else a > b if op == ">" else a <= b if op == "<=" else a >= b
        except TypeError:
            raise TemplateError(f"cannot compare {type(a).__name__} {op} {type(b).__name__}") from None

    def binary(self, op, a, b):
        if op == "~":
            return self.bounded(_text(a) + _text(b))
        for v in (a, b):
            if isinstance(v, _Undefined):
                v.fail()
        try:
            if op == "+":
                result = a + b
            elif op == "-":
                result = a - b
            elif op == "*":
                if isinstance(a, (str, list, tuple)) or isinstance(b, (str, list, tuple)):
                    count, seq = (b, a) if isinstance(a, (str, list, tuple)) else (a, b)
                    if isinstance(count, int) and count * len(seq) > MAX_OUTPUT:
                        raise TemplateError("a repetition is too large")
                result = a * b
            elif op == "/":
                result = a / b
            elif op == "//":
                result = a // b
            elif op == "%":
                if isinstance(a, str):
                    raise TemplateError("string formatting with % is not supported")
                result = a % b
            else:
                if isinstance(b, (int, float)) and abs(b) > 1024:
                    raise TemplateError("an exponent is too large")
                result = a ** b
        except (TypeError, ZeroDivisionError, OverflowError) as err:
            raise TemplateError(f"{type(a).__name__} {op} {type(b).__name__}: {err}") from None
        return self.bounded(result)

    def bounded(self, value):
        if isinstance(value, (str, list, tuple)) and len(value) > MAX_OUTPUT:
            raise TemplateError("a value the template built is too large")
        return value

    def filter(self, name, value, args, kwargs):
        fn = _FILTERS.get(name)
        if fn is None:
            raise TemplateError(f"unknown filter {name!r}")
        try:
            return self.bounded(fn(self, value, *args, **kwargs))
        except TemplateError:
            raise
        except (TypeError, ValueError, AttributeError, IndexError, KeyError) as err:
            raise TemplateError(f"filter {name!r}: {err}") from None


def _raise_exception(message):
    raise TemplateError(str(message))


def _range(*args):
    r = range(*[int(a) for a in args])
    if len(r) > 100_000:
        raise TemplateError("range() is too long")
    return list(r)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(str(fmt))


_GLOBALS = {"raise_exception": _raise_exception, "range": _range, "strftime_now": _strftime_now,
            "namespace": lambda **kw: _Namespace(kw), "dict": lambda **kw: dict(kw)}


def _select(render, value, args, by_attribute, keep):
    items = _sequence(value, "select")
    if by_attribute:
        get, args = _attribute_getter(args[0]), args[1:]
    else:
        def get(x):
            return x
    if args:
        name, rest = args[0], list(args[1:])
        return [x for x in items if _test(name, get(x), rest) == keep]
    return [x for x in items if bool(get(x)) == keep]


def _map(render, value, *args, attribute=None, default=None):
    items = _sequence(value, "map")
    if attribute is not None:
        get = _attribute_getter(attribute)
        return [(default if isinstance(get(x), _Undefined) and default is not None else get(x)) for x in items]
    name, rest = args[0], args[1:]
    return [render.filter(name, x, list(rest), {}) for x in items]


def _indent(render, value, width=4, first=False, blank=False):
    pad = " " * width if isinstance(width, int) else str(width)
    lines = str(value).split("\n")
    out = [lines[0] if not first else pad + lines[0]]
    out += [pad + line if (line or blank) else line for line in lines[1:]]
    return "\n".join(out)


def _round(render, value, precision=0, method="common"):
    if method == "common":
        factor = 10 ** precision
        return math.floor(value * factor + 0.5) / factor if value >= 0 else -math.floor(-value * factor + 0.5) / factor
    return (math.ceil if method == "ceil" else math.floor)(value * 10 ** precision) / 10 ** precision


_FILTERS = {
    "tojson": lambda r, v, indent=None, separators=None, sort_keys=False, ensure_ascii=False:
        _tojson(v, indent, separators, sort_keys, ensure_ascii),
    "trim": lambda r, v, chars=None: _text(v).strip(chars),
    "string": lambda r, v: _text(v),
    "length": lambda r, v: len(v) if not isinstance(v, _Undefined) else 0,
    "count": lambda r, v: len(v) if not isinstance(v, _Undefined) else 0,
    "list": lambda r, v: _sequence(v, "list"),
    "first": lambda r, v: (_sequence(v, "first") or [_UNDEFINED])[0],
    "last": lambda r, v: (_sequence(v, "last") or [_UNDEFINED])[-1],
    "join": lambda r, v, sep="", attribute=None: str(sep).join(
        _text(_attribute_getter(attribute)(x) if attribute is not None else x) for x in _sequence(v, "join")),
    "default": lambda r, v, default="", boolean=False: default if isinstance(v, _Undefined) or (boolean and not v)
        else v,
    "upper": lambda r, v: _text(v).upper(),
    "lower": lambda r, v: _text(v).lower(),
    "capitalize": lambda r, v: _text(v).capitalize(),
    "title": lambda r, v: _text(v).title(),
    "replace": lambda r, v, old, new, count=None: _text(v).replace(old, new, -1 if count is None else count),
    "safe": lambda r, v: v,
    "int": lambda r, v, default=0: _to_number(int, v, default),
    "float": lambda r, v, default=0.0: _to_number(float, v, default),
    "abs": lambda r, v: abs(v),
    "round": _round,
    "items": lambda r, v: list(v.items()) if isinstance(v, dict) else [],
    "dictsort": lambda r, v, case_sensitive=False, by="key", reverse=False: sorted(
        v.items(), key=lambda kv: kv[0 if by == "key" else 1], reverse=reverse),
    "reverse": lambda r, v: v[::-1] if isinstance(v, str) else reversed(_sequence(v, "reverse")),   # an iterator, as in jinja2
    "sort": lambda r, v, reverse=False, case_sensitive=False, attribute=None: sorted(
        _sequence(v, "sort"), key=_attribute_getter(attribute) if attribute else None, reverse=reverse),
    "unique": lambda r, v: list(dict.fromkeys(_sequence(v, "unique"))),
    "sum": lambda r, v, attribute=None, start=0: sum(
        (_attribute_getter(attribute)(x) if attribute else x for x in _sequence(v, "sum")), start),
    "min": lambda r, v: min(_sequence(v, "min")),
    "max": lambda r, v: max(_sequence(v, "max")),
    "select": lambda r, v, *a: _select(r, v, a, False, True),
    "reject": lambda r, v, *a: _select(r, v, a, False, False),
    "selectattr": lambda r, v, *a: _select(r, v, a, True, True),
    "rejectattr": lambda r, v, *a: _select(r, v, a, True, False),
    "map": _map,
    "indent": _indent,
    "wordcount": lambda r, v: len(_text(v).split()),
    "center": lambda r, v, width=80: _text(v).center(width),
}


def _to_number(kind, value, default):
    try:
        return kind(value)
    except (TypeError, ValueError):
        return default


class Template:
    """A parsed chat template: render(**variables) -> text (TemplateError on failure)."""

    def __init__(self, source):
        if not isinstance(source, str):
            raise TemplateError("a chat template is text")
        if len(source) > 1 << 20:
            raise TemplateError("the chat template is over 1 MiB")
        self.source = source
        try:
            self.nodes, _, _ = _Parser(_lex(source)).body()
        except RecursionError:
            raise TemplateError("the template is nested too deeply") from None

    def render(self, **variables):
        r = _Render(self, variables)
        try:
            r.run(self.nodes)
        except (_Break, _Continue):
            raise TemplateError("break or continue outside a loop") from None
        except RecursionError:
            raise TemplateError("the template recurses too deeply") from None
        return "".join(r.out)
