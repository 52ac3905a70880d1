"""The control VM: binds a module to a checkpoint and runs command programs into launch plans.

Two steps, both pure Python and device-free:

1. `bind(module, metadata, tensors, options)` evaluates every `spec` in order
   (with `meta`, `option`, `shape`, `has`), then resolves each `param` to a
   checkpoint tensor (or an alias) and checks its shape, and sizes each
   `state`. The result, a Binding, is what weight preparation and planning use.

2. `Binding.plan(command, **args)` runs a command for one geometry (its scalar
   arguments) and returns a flat Plan: the scratch buffers it needs and the
   ordered kernel launches, each with its specialization defines, global and
   local sizes and arguments (scalars, or references to params, states,
   scratch and the command's buffer arguments). Loops and calls are unrolled,
   so replaying a plan is a short loop of enqueues; plans are cached per
   geometry by their owner.
"""

import math
from dataclasses import dataclass, field

from .language import ANY_DIM, LoomError, pattern_code

MAX_STEPS = 2_000_000     # instructions per plan: a runaway loop fails instead of hanging
MAX_DEPTH = 32            # nested command calls
MAX_LAUNCHES = 100_000


@dataclass(frozen=True)
class Ref:
    """A device buffer a launch refers to, resolved to a real buffer at execution."""
    kind: str            # "param" | "state" | "scratch" | "arg"
    name: str
    index: int | None = None


@dataclass
class Launch:
    kernel: str          # the kernel declaration's name
    defines: dict        # specialization: macro -> value (flags map to None)
    grid: tuple
    local: tuple | None
    args: list           # Ref | int | float, in the OpenCL kernel's argument order
    arg_types: list      # "buf" | "int" | "float"


@dataclass
class Plan:
    command: str
    geometry: dict
    scratch: dict = field(default_factory=dict)      # name -> (dtype, dims)
    launches: list = field(default_factory=list)

    def scratch_bytes(self):
        return sum(itemsize(dtype) * math.prod(dims) for dtype, dims in self.scratch.values())


def itemsize(dtype):
    """Bytes per element of a scratch or state dtype (f16 2, f32 and i32 4)."""
    return 2 if dtype == "f16" else 4


@dataclass
class Tensor:
    """What binding needs to know of a checkpoint tensor."""
    shape: tuple
    dtype: str           # F32 | F16 | BF16 | a block format (Q8_0 | Q4_0 | ... | Q6_K)


@dataclass
class BoundParam:
    name: str
    index: int | None    # layer index for params declared name[count]
    tensor: str | None   # checkpoint tensor name, or None for an alias
    alias: tuple | None  # (param, index) this one shares storage with
    shape: tuple
    dtype: str           # the declared dtype (f32 | f16 | i32 | weight)
    storage: str         # what the device holds: F32, F16, I32, or a block format (Q8_0 ... Q6_K)
    tiled: tuple | None = None   # (axis, width) of a param declared tiled(axis, width): runtime.tile


@dataclass
class BoundState:
    name: str
    dtype: str
    page: int | None
    dims: tuple


# -- expression evaluation ---------------------------------------------------------

def _num(value, where):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LoomError(f"{where}: expected a number, got {_show(value)}")
    return value


def _show(value):
    return repr(value) if not isinstance(value, Ref) else f"{value.kind} {value.name}"


def _binary(op, a, b, where):
    if op in ("eq", "ne"):
        result = a == b and type(a) is type(b) or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                                   and not isinstance(a, bool) and not isinstance(b, bool) and a == b)
        return result if op == "eq" else not result
    if op in ("and", "or"):
        return (_truth(a, where) and _truth(b, where)) if op == "and" else (_truth(a, where) or _truth(b, where))
    if op == "add" and isinstance(a, str) and isinstance(b, str):
        return a + b
    a, b = _num(a, where), _num(b, where)
    if op in ("lt", "le", "gt", "ge"):
        return {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}[op]
    both_int = isinstance(a, int) and isinstance(b, int)
    if op in ("div", "idiv", "mod") and b == 0:
        raise LoomError(f"{where}: division by zero")
    if op == "add":
        return a + b
    if op == "sub":
        return a - b
    if op == "mul":
        return a * b
    if op == "div":
        return a / b
    if op == "idiv":
        return a // b if both_int else float(math.floor(a / b))
    if op == "mod":
        return a % b
    if op == "pow":
        if both_int and b >= 0:
            if abs(a) > 1 and b > 256:
                raise LoomError(f"{where}: {a} ** {b} is too large")
            return a ** b
        return float(a) ** float(b)
    raise LoomError(f"{where}: unknown operator {op}")


def _truth(value, where):
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value != 0
    raise LoomError(f"{where}: expected a condition, got {_show(value)}")


class Scope:
    """Name resolution and builtins for one evaluation context."""

    def __init__(self, names, builtins, where):
        self.names = names
        self.builtins = builtins
        self.where = where

    def lookup(self, name):
        if name not in self.names:
            raise LoomError(f"{self.where}: {name!r} has no value here")
        return self.names[name]


def step(stack, ins, scope):
    """Apply one expression instruction to the stack."""
    op = ins[0]
    where = scope.where
    if op in ("int", "float", "str", "bool"):
        stack.append(ins[1])
    elif op == "name":
        stack.append(scope.lookup(ins[1]))
    elif op == "neg":
        stack.append(-_num(stack.pop(), where))
    elif op == "not":
        stack.append(not _truth(stack.pop(), where))
    elif op == "select":
        otherwise, then, cond = stack.pop(), stack.pop(), stack.pop()
        stack.append(then if _truth(cond, where) else otherwise)
    elif op == "index":
        i, base = stack.pop(), stack.pop()
        if not isinstance(base, Ref) or base.kind != "param" or base.index is not None:
            raise LoomError(f"{where}: only a layered param can be indexed, not {_show(base)}")
        if isinstance(i, bool) or not isinstance(i, int):
            raise LoomError(f"{where}: a layer index must be an integer")
        stack.append(Ref("param", base.name, i))
    elif op == "fn":
        args = stack[len(stack) - ins[2]:]
        del stack[len(stack) - ins[2]:]
        stack.append(call_builtin(ins[1], args, scope))
    else:
        stack.append(_binary(op, *_pop2(stack), where))


def _pop2(stack):
    b, a = stack.pop(), stack.pop()
    return a, b


def evaluate(code, scope):
    stack = []
    for ins in code:
        step(stack, ins, scope)
    return stack[0]


def call_builtin(name, args, scope):
    where = scope.where
    if name == "min":
        return min(_num(args[0], where), _num(args[1], where))
    if name == "max":
        return max(_num(args[0], where), _num(args[1], where))
    if name == "ceil":
        a, b = _num(args[0], where), _num(args[1], where)
        if not (isinstance(a, int) and isinstance(b, int)) or b <= 0:
            raise LoomError(f"{where}: ceil(a, b) needs integers and b > 0")
        return -(-a // b)
    if name == "int":
        value = _num(args[0], where)
        if isinstance(value, float) and not math.isfinite(value):
            raise LoomError(f"{where}: int() of a non-finite number")
        return int(value)
    if name == "float":
        return float(_num(args[0], where))
    if name == "sqrt":
        value = _num(args[0], where)
        if value < 0:
            raise LoomError(f"{where}: sqrt of a negative number")
        return math.sqrt(value)
    fn = scope.builtins.get(name)
    if fn is None:
        raise LoomError(f"{where}: {name}() is not available here")
    return fn(*args)


# -- binding -------------------------------------------------------------------------

class Binding:
    def __init__(self, module, specs, params, states, tensors, options, metadata=None, fmt=None, driver="",
                 vector_width=0, int8_dot=False):
        self.module = module
        self.metadata = metadata or {}
        self.format = fmt
        self.driver = driver
        self.vector_width = vector_width
        self.int8_dot = int8_dot
        self.specs = specs            # name -> value
        self.params = params          # (name, index) -> BoundParam
        self.states = states          # name -> BoundState
        self.tensors = tensors
        self.options = options
        self.layers = {p.name: None for p in module.params}
        for (name, index) in params:
            if index is not None:
                self.layers[name] = max(self.layers[name] or 0, index + 1)

    def contract(self):
        """What a native variant must preserve: specialization values, parameter
        placement, retained state and the command signatures."""
        return {
            "specs": dict(self.specs),
            "params": {k: (p.shape, p.storage, p.tensor, p.alias, p.tiled) for k, p in self.params.items()},
            "states": {k: (s.dtype, s.page, s.dims) for k, s in self.states.items()},
            "commands": {c.name: tuple(c.args) for c in self.module.commands},
        }

    def storage(self, ref):
        return self.params[(ref.name, ref.index)].storage

    def param_shape(self, ref):
        return self.params[(ref.name, ref.index)].shape

    # -- planning ---------------------------------------------------------------
    def plan(self, command, **geometry):
        cmd = self.module.find("commands", command)
        if cmd is None:
            raise LoomError(f"module {self.module.name} has no command {command!r}")
        plan = Plan(command, dict(geometry))
        env = {}
        for arg_name, arg_type in cmd.args:
            if arg_type == "buf":
                env[arg_name] = Ref("arg", arg_name)
            else:
                if arg_name not in geometry:
                    raise LoomError(f"command {command}: argument {arg_name!r} was not given")
                env[arg_name] = geometry[arg_name]
        extra = set(geometry) - {a for a, _ in cmd.args}
        if extra:
            raise LoomError(f"command {command}: unknown arguments {sorted(extra)}")
        self._run(cmd, env, plan, [0], 0)
        return plan

    def _globals(self):
        names = dict(self.specs)
        for p in self.module.params:
            names[p.name] = Ref("param", p.name)
        for s in self.module.states:
            names[s.name] = Ref("state", s.name)
        return names

    def _builtins(self, plan=None):
        def dtype(ref):
            if isinstance(ref, Ref) and ref.kind == "scratch" and plan is not None and ref.name in plan.scratch:
                return plan.scratch[ref.name][0].upper()     # a scratch buffer's own type ("F32", ...)
            if not isinstance(ref, Ref) or ref.kind != "param" or (ref.name, ref.index) not in self.params:
                raise LoomError(f"dtype() needs a param or a scratch buffer, got {_show(ref)}")
            return self.storage(ref)

        def pages(ref):
            if not isinstance(ref, Ref) or ref.kind != "state" or self.states[ref.name].page is None:
                raise LoomError(f"pages() needs a paged state, got {_show(ref)}")
            return self.options.get("pages", 0)

        def present(ref):
            if not isinstance(ref, Ref) or ref.kind != "param":
                raise LoomError(f"present() needs a param, got {_show(ref)}")
            return (ref.name, ref.index) in self.params

        def dim(ref, axis):
            if not isinstance(ref, Ref) or ref.kind != "param" or (ref.name, ref.index) not in self.params:
                raise LoomError(f"dim() needs a param that is present, got {_show(ref)}")
            shape = self.param_shape(ref)
            if isinstance(axis, bool) or not isinstance(axis, int) or not -len(shape) <= axis < len(shape):
                raise LoomError(f"dim(): {ref.name} has no axis {_show(axis)}")
            return shape[axis]

        def tiles(ref):
            if isinstance(ref, Ref) and ref.kind == "scratch" and plan is not None and ref.name in plan.scratch:
                return 0        # scratch buffers are laid out as declared, never in tiles
            if not isinstance(ref, Ref) or ref.kind != "param" or (ref.name, ref.index) not in self.params:
                raise LoomError(f"tiles() needs a param that is present, got {_show(ref)}")
            tiled = self.params[(ref.name, ref.index)].tiled
            return tiled[1] if tiled else 0

        return {"dtype": dtype, "tiles": tiles, "pages": pages, "present": present, "dim": dim,
                "option": lambda k, *d: _option(self.options, k, d)}

    def _run(self, cmd, args, plan, steps, depth):
        if depth > MAX_DEPTH:
            raise LoomError(f"command {cmd.name}: calls nest deeper than {MAX_DEPTH}")
        names = self._globals()
        names.update(args)
        scope = Scope(names, self._builtins(plan), f"command {cmd.name}")
        body = cmd.body
        matching = _match_blocks(body)
        stack, loops, pc = [], [], 0
        while pc < len(body):
            steps[0] += 1
            if steps[0] > MAX_STEPS:
                raise LoomError(f"command {cmd.name}: more than {MAX_STEPS} steps (a runaway loop?)")
            ins = body[pc]
            op = ins[0]
            if op == "let":
                names[ins[1]] = stack.pop()
            elif op == "scratch":
                dims = tuple(_dim(v, scope.where) for v in stack[len(stack) - ins[3]:])
                del stack[len(stack) - ins[3]:]
                # One buffer per name and shape: a loop's iterations (a layer's widened
                # matrices, one shape per matrix) take the same buffers again.
                key = next((k for k, v in plan.scratch.items() if k.split("#")[0] == ins[1] and v == (ins[2], dims)),
                           ins[1] if ins[1] not in plan.scratch else f"{ins[1]}#{len(plan.scratch)}")
                plan.scratch[key] = (ins[2], dims)
                names[ins[1]] = Ref("scratch", key)
            elif op == "for":
                end, start = stack.pop(), stack.pop()
                start, end = _int(start, scope.where), _int(end, scope.where)
                if start >= end:
                    pc = matching[pc]
                else:
                    names[ins[1]] = start
                    loops.append((pc, end))
            elif op == "end":
                opener = matching[pc]
                if body[opener][0] == "for":
                    head, end = loops[-1]
                    value = names[body[head][1]] + 1
                    if value < end:
                        names[body[head][1]] = value
                        pc = head
                    else:
                        loops.pop()
            elif op == "if":
                if not _truth(stack.pop(), scope.where):
                    pc = matching[pc]  # to its else (then past it) or its end
            elif op == "else":
                pc = matching[pc]      # the then-branch ran: skip to end
            elif op == "launch":
                values = stack[len(stack) - ins[2]:]
                del stack[len(stack) - ins[2]:]
                self._launch(ins[1], values, plan)
            elif op == "invoke":
                values = stack[len(stack) - ins[2]:]
                del stack[len(stack) - ins[2]:]
                callee = self.module.find("commands", ins[1])
                callee_args = {}
                for (arg_name, arg_type), value in zip(callee.args, values):
                    _check_arg(arg_type, value, f"command {callee.name} argument {arg_name}")
                    callee_args[arg_name] = value
                self._run(callee, callee_args, plan, steps, depth + 1)
            else:
                step(stack, ins, scope)
            pc += 1

    def _launch(self, name, values, plan):
        kernel = self.module.find("kernels", name)
        where = f"kernel {name}"
        if len(plan.launches) >= MAX_LAUNCHES:
            raise LoomError(f"{where}: more than {MAX_LAUNCHES} launches in one plan")
        names = dict(self.specs)
        for arg, value in zip(kernel.args, values):
            _check_arg("buf" if arg.type == "tensor" else arg.type, value, f"{where} argument {arg.name}")
            names[arg.name] = value
            if arg.type == "tensor":
                shape = self._shape_of(value, plan, where)
                if len(shape) != len(arg.binds):
                    raise LoomError(f"{where}: argument {arg.name} has {len(shape)} dimensions, "
                                    f"the kernel binds {len(arg.binds)}")
                names.update(zip(arg.binds, shape))
        for bound, code in kernel.lets:     # each sees the arguments and the lets before it
            names[bound] = evaluate(code, Scope(names, self._builtins(plan), f"{where} let {bound}"))
        scope = Scope(names, self._builtins(plan), where)
        defines = {}
        for define, code in kernel.defines:
            value = evaluate(code, scope)
            if define is None:
                if not isinstance(value, str) or not value.isidentifier():
                    raise LoomError(f"{where}: a flag must evaluate to a macro name, got {value!r}")
                defines[value] = None
            else:
                if isinstance(value, bool):
                    value = int(value)
                if isinstance(value, Ref) or (isinstance(value, str) and not value.isidentifier()):
                    raise LoomError(f"{where}: define {define} must be a number or a name, got {_show(value)}")
                defines[define] = value
        if kernel.call is None:
            args, types = list(values), ["buf" if a.type == "tensor" else a.type for a in kernel.args]
        else:
            args = [evaluate(c, scope) for c in kernel.call]
            types = []
            for n, value in enumerate(args):
                kind = "buf" if isinstance(value, Ref) else "float" if isinstance(value, float) else "int"
                _check_arg(kind, value, f"{where} OpenCL argument {n}")
                types.append(kind)
        grid = tuple(_dim(evaluate(c, scope), where) for c in kernel.grid)
        local = tuple(_dim(evaluate(c, scope), where) for c in kernel.local) if kernel.local else None
        if local is not None and any(g % l for g, l in zip(grid, local)):
            raise LoomError(f"{where}: global size {grid} is not a multiple of the local size {local}")
        plan.launches.append(Launch(name, defines, grid, local, args, types))

    def _shape_of(self, ref, plan, where):
        if ref.kind == "param":
            if (ref.name, ref.index) not in self.params:
                raise LoomError(f"{where}: param {ref.name}" + (f"[{ref.index}]" if ref.index is not None else "")
                                + " does not exist" + (" (it has layers: index it)" if self.layers[ref.name] else ""))
            return self.param_shape(ref)
        if ref.kind == "scratch":
            return plan.scratch[ref.name][1]
        raise LoomError(f"{where}: a tensor argument must be a param or scratch buffer, not {ref.kind} {ref.name}")


def _check_arg(arg_type, value, where):
    if arg_type == "buf":
        if not isinstance(value, Ref):
            raise LoomError(f"{where}: expected a buffer, got {_show(value)}")
    elif arg_type == "int":
        if isinstance(value, bool) or not isinstance(value, int) or not -2**31 <= value < 2**31:
            raise LoomError(f"{where}: expected an int32, got {_show(value)}")
    elif arg_type == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise LoomError(f"{where}: expected a number, got {_show(value)}")


def _int(value, where):
    if isinstance(value, bool) or not isinstance(value, int):
        raise LoomError(f"{where}: expected an integer, got {_show(value)}")
    return value


def _dim(value, where):
    value = _int(value, where)
    if value < 1 or value > 2**31 - 1:
        raise LoomError(f"{where}: a size must be from 1 to 2^31-1, got {value}")
    return value


def _option(options, key, default):
    if key in options:
        return options[key]
    if default:
        return default[0]
    raise LoomError(f"option {key!r} is required by the module and was not given")


def _match_blocks(body):
    """Jump targets: for/if -> its else or end; else -> end; end -> its for/if."""
    matching, open_blocks = {}, []
    for pc, ins in enumerate(body):
        if ins[0] in ("for", "if"):
            open_blocks.append([pc, None])
        elif ins[0] == "else":
            open_blocks[-1][1] = pc
            matching[open_blocks[-1][0]] = pc
        elif ins[0] == "end":
            opener, else_pc = open_blocks.pop()
            matching[opener if else_pc is None else else_pc] = pc
            matching[pc] = opener
    return matching


def bind(module, metadata, tensors, options=None, fmt=None, driver="", vector_width=0, int8_dot=False):
    """Evaluate specs, resolve params to tensors and size states.

    metadata: checkpoint key/values; tensors: name -> Tensor; options: the
    model document's options (plus deployment sizing such as "pages"); driver:
    the device's driver family ("pocl", "intel", ...) and vector_width its
    native float vector width (8 on AVX2 CPUs, 16 with AVX-512; 0 unknown), so
    a package can choose the kernel geometry that is fastest on it; int8_dot
    whether its kernels may take x86 int8 dot products (device.int8_dot: AVX512-VNNI or AVX2).
    """
    options = dict(options or {})
    specs = {}

    def meta(key, *default):
        if not isinstance(key, str):
            raise LoomError("meta() needs a string key")
        if key in metadata:
            value = metadata[key]
            if isinstance(value, (bool, int, float, str)):
                return value
            if isinstance(value, list):
                return len(value)  # arrays (vocabularies) bind as their length
            raise LoomError(f"metadata {key!r} has an unsupported type")
        if default:
            return default[0]
        raise LoomError(f"the checkpoint has no metadata {key!r}")

    def expand(pattern, names, depth=0):
        """A tensor name pattern with its {EXPR} placeholders evaluated over `names`. A value may
        hold placeholders itself (a spec naming a block's prefix), expanded in turn."""
        if not isinstance(pattern, str):
            raise LoomError(f"a tensor name must be a string, got {_show(pattern)}")
        if depth > MAX_EXPANSION:
            raise LoomError(f"tensor name {pattern!r}: placeholders nest deeper than {MAX_EXPANSION}")
        out = pattern
        for text, code in pattern_code(pattern):
            value = evaluate(code, Scope(names, builtins, f"tensor name {pattern!r}"))
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise LoomError(f"tensor name {pattern!r}: {text} is {_show(value)}, not an integer or a string")
            out = out.replace(text, expand(value, names, depth + 1) if isinstance(value, str) else str(value), 1)
        return out

    def shape(name, axis, names=None):
        name = expand(name, names if names is not None else specs)
        if name not in tensors:
            raise LoomError(f"the checkpoint has no tensor {name!r}")
        dims = tensors[name].shape
        if not isinstance(axis, int) or not -len(dims) <= axis < len(dims):
            raise LoomError(f"tensor {name!r} has no axis {axis}")
        return dims[axis]

    def count(pattern, names=None):
        """How many layers a checkpoint holds: i = 0, 1, ... while the pattern with i names a tensor."""
        if not isinstance(pattern, str) or not _uses_index([("str", pattern)], specs):
            raise LoomError("count() needs a tensor name pattern with {i}")
        n = 0
        while n <= 4096 and expand(pattern, dict(names if names is not None else specs, i=n)) in tensors:
            n += 1
        return n

    def scoped(names):
        """Builtins whose tensor names see `names` (the specs, and a layer's i)."""
        return dict(builtins, shape=lambda name, axis: shape(name, axis, names),
                    has=lambda name: expand(name, names) in tensors,
                    count=lambda pattern: count(pattern, names), present=present)

    def present(ref):
        if not isinstance(ref, Ref) or ref.kind != "param":
            raise LoomError(f"present() needs a param, got {_show(ref)}")
        return (ref.name, ref.index) in params

    builtins = {"meta": meta, "shape": shape, "has": lambda name: expand(name, specs) in tensors, "count": count,
                "option": lambda k, *d: _option(options, k, d)}
    for spec in module.specs:
        names = dict(specs, format=fmt or "", driver=driver, vector_width=vector_width, int8_dot=bool(int8_dot))
        specs[spec.name] = evaluate(spec.code, Scope(names, scoped(names), f"spec {spec.name}"))
    scope_names = dict(specs)
    params = {}
    for p in module.params:
        scope = Scope(scope_names, scoped(scope_names), f"param {p.name}")
        per_layer = p.when is not None and p.count is not None and _uses_index(p.when, specs)
        if p.when is not None and not per_layer and not _truth(evaluate(p.when, scope), scope.where):
            continue  # absent in this checkpoint's configuration; commands branch around it
        count_ = None if p.count is None else _int(evaluate(p.count, scope), scope.where)
        if count_ is not None and not 0 <= count_ <= 4096:
            raise LoomError(f"param {p.name}: layer count {count_} out of range")
        refs = {q.name: Ref("param", q.name) for q in module.params}      # for a when's present()
        for index in range(count_) if count_ is not None else [None]:
            names = dict(refs, **scope_names) if index is None else dict(refs, **scope_names, i=index)
            where = f"param {p.name}" + (f"[{index}]" if index is not None else "")
            layer = Scope(names, scoped(names), where)
            if per_layer and not _truth(evaluate(p.when, layer), where):
                continue  # this layer is absent (say, a block without attention): commands test present()
            dims = tuple(None if tuple(d) == ANY_DIM else _dim(evaluate(d, layer), where) for d in p.dims)
            sources = [src if src.startswith("=") else expand(src, names) for src in p.sources]
            bound = _resolve_param(p, index, dims, sources, tensors, params)
            if p.tiled is not None and bound.alias is None:
                tiling = Scope(dict(names, storage=bound.storage), scoped(names), where)
                axis, width = (_int(evaluate(code, tiling), where) for code in p.tiled)
                blocks = bound.storage not in ("F32", "F16", "I32")
                if not 0 <= axis < len(bound.shape) or not 0 <= width <= 64 or blocks and axis != 0:
                    raise LoomError(f"{where}: tiled({axis}, {width}) needs an axis of its {len(bound.shape)} "
                                    "dimensions (rows, axis 0, for quantized blocks) and a width of 0 to 64")
                bound.tiled = (axis, width) if width else None     # width 0: as the checkpoint lays it out
            params[(p.name, index)] = bound
    states = {}
    for s in module.states:
        scope = Scope(scope_names, builtins, f"state {s.name}")
        page = None if s.page is None else _dim(evaluate(s.page, scope), scope.where)
        states[s.name] = BoundState(s.name, s.dtype, page, tuple(_dim(evaluate(d, scope), scope.where) for d in s.dims))
    return Binding(module, specs, params, states, tensors, options, metadata, fmt, driver, vector_width, int8_dot)


# Block formats stay blocks on the device (the kernels dequantize them); BF16 becomes F32.
STORAGE = {"F32": "F32", "F16": "F16", "BF16": "F32",
           **{t: t for t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")}}


MAX_EXPANSION = 8


def _uses_index(code, specs, depth=0):
    """Whether code mentions the layer index i: itself, or in a tensor name's placeholders
    (following string specs, whose placeholders expand in turn)."""
    if depth > MAX_EXPANSION:
        return False
    for ins in code:
        if tuple(ins) == ("name", "i"):
            return True
        text = ins[1] if ins[0] == "str" else specs.get(ins[1]) if ins[0] == "name" else None
        if isinstance(text, str) and "{" in text:
            try:
                if any(_uses_index(inner, specs, depth + 1) for _, inner in pattern_code(text)):
                    return True
            except LoomError:
                continue    # not a pattern: any use of it as a tensor name reports the brace
    return False


def _resolve_param(p, index, dims, sources, tensors, params):
    """The first of `sources` (names with their placeholders filled in) that the checkpoint holds."""
    where = f"param {p.name}" + (f"[{index}]" if index is not None else "")
    tried = []

    def fits(shape):
        return len(shape) == len(dims) and all(d is None or d == n for d, n in zip(dims, shape))

    def wanted():
        return "(" + ", ".join("?" if d is None else str(d) for d in dims) + ")"

    for src in sources:
        if src.startswith("="):
            target = (src[1:], index if (src[1:], index) in params else None)
            if target in params:
                other = params[target]
                if not fits(other.shape):
                    raise LoomError(f"{where}: alias {src[1:]} has shape {other.shape}, expected {wanted()}")
                return BoundParam(p.name, index, None, target, other.shape, p.dtype, other.storage, other.tiled)
            tried.append(src[1:])
            continue
        name = src
        tried.append(name)
        tensor = tensors.get(name)
        if tensor is None:
            continue
        if not fits(tuple(tensor.shape)):
            raise LoomError(f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, the module expects "
                            f"{wanted()}")
        if tensor.dtype not in STORAGE:
            raise LoomError(f"{where}: tensor {name!r} has unsupported type {tensor.dtype}")
        storage = {"f32": "F32", "f16": "F16", "i32": "I32"}.get(p.dtype) or STORAGE[tensor.dtype]
        if p.dtype == "i32" and tensor.dtype not in ("F32",):
            raise LoomError(f"{where}: i32 params need integer-valued F32 tensors")
        return BoundParam(p.name, index, name, None, tuple(tensor.shape), p.dtype, storage)
    raise LoomError(f"{where}: none of {tried} is in the checkpoint")
