"""Prepared deployments on the device: modules bound to checkpoints, weights
uploaded, launch plans compiled once per geometry and replayed.

    prepared = prepare("vectors", sources, checkpoint, options, device, compiler, progress)  # a worker thread
    prepared.plan_async("embed", {"T": 7, "S": 2}, done)     # loop thread; compiles what is new
    event = plan.run({"ids": ids_buf, "offsets": off_buf, "out": out_buf})

`prepare` is the only step that touches files (sources, checkpoint) and it
runs off the loop. Planning runs the control VM (vm.py) for one geometry,
compiles each distinct kernel specialization through the compiler's cache
(asynchronously), allocates the plan's scratch as workspace and creates one
kernel object per launch with its arguments already set; the command's own
buffer arguments are the only ones set per run. A run is then a short loop
of enqueues on the device's in-order queue.
"""

import collections
import hashlib
import itertools
import math
import os
import threading
import time

import numpy as np

from . import language, vm, weights
from . import open_regular
from .errors import Problem, withhold
from .language import LoomError

PLAN_CACHE = 32     # plans (geometries) kept per deployment


class PrepareError(Problem):
    """Preparation failed; `code` names the stage for /v1/status."""


# What a document's prepare and control modules own: nothing else may declare it.
ROLES = {"prepare": ("specs", "params", "states"), "control": ("policy",)}


def _declared(module):
    sections = {s for s in ("specs", "params", "states", "kernels", "commands") if getattr(module, s)}
    return sections | ({"policy"} if module.policy is not None else set())


def load_module(paths, loaded=None, preserved=(), uploaded=()):
    """One module from several source files (.loom or .loombc): their declarations
    merge. `loaded` supplies (name, bytes) pairs already in memory (uploads);
    `preserved` the document's (role, name, bytes) prepare and control modules,
    each declaring only what its role owns (ROLES), which the sources then may not;
    those named in `uploaded` came from a package, the others from server files, whose
    syntax errors do not quote them (language.parse)."""
    items = [(p, None) for p in paths] + list(loaded or [])
    parts = [language.load(path, checked=False) if data is None else language.load_bytes(data, path, checked=False)
             for path, data in items]
    names = [path for path, _ in items]
    sources = set().union(*(_declared(part) for part in parts))
    for role, path, data in preserved:
        part = language.load_bytes(data, path, checked=False, quote=path in uploaded)
        extra = sorted(_declared(part) - set(ROLES[role]))
        if extra:
            raise LoomError(f"{path}: a {role} module declares only {', '.join(ROLES[role])}, not {', '.join(extra)}",
                            quotes=False)
        owned = sorted(sources & set(ROLES[role]))
        if owned:
            raise LoomError(f"the sources declare {', '.join(owned)}, which the {role} module {path} owns",
                            quotes=False)
        parts.append(part)
        names.append(path)
    return language.merge(parts, names)


def read_preserved(modules):
    """The (role, name, bytes) of the prepare and control modules, reading server files:
    a registration keeps these bytes, so variants never reread them."""
    out = []
    for role, path, data in modules:
        if data is None:
            with open_regular(path) as f:
                data = f.read()
        out.append((role, path, data))
    return out


def tile(array, axis, width):
    """A param declared tiled(axis, width) as the device holds it: `axis` cut into tiles of
    `width` (the last one padded with zeros), each tile laid out with the other axes in
    reverse order and its `width` indices innermost. A conv weight [O, C, K] tiled(0, 16)
    becomes [O/16][K][C][16]: an outer-product kernel reads 16 outputs' weights for one
    tap and channel as one vector, in place, instead of gathering them at every launch."""
    a = np.moveaxis(array, axis, 0)
    pad = -a.shape[0] % width
    if pad:
        a = np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])
    a = a.reshape((a.shape[0] // width, width) + a.shape[1:])
    return np.ascontiguousarray(a.transpose((0,) + tuple(range(a.ndim - 1, 1, -1)) + (1,)))


# The bit of a tiled Q5_0 block's fifth-bit word that holds element e's fifth bit: element
# 4j + b (its nibble the low one of byte b of quant word j) at 8b + 4 + j, element 4j + b + 16
# (the high one) at 8b + j; matmul.cl's RT_WORD shifts h by j (or 4 - j) to bit 8b + 4.
_Q5_0_FIFTH_BITS = [8 * (e % 4) + 4 + e // 4 for e in range(16)] + [8 * (e % 4) + e // 4 for e in range(16)]


def tile_blocks(raw, rows, storage, width):
    """A block-format matrix of `rows` rows declared tiled(0, width) as the device holds
    it: rows in tiles of `width` (the last padded with zero rows), and per tile and
    block column, each 2-byte scale field of the tile's rows side by side, then the
    block's other bytes four at a time, word j (its bytes 4j .. 4j + 3) of the tile's
    rows side by side. Q4_0 tiled(0, 16) puts 16 rows' scales in one half16 and word j
    of their quant bytes in one uint16: a kernel takes the 16 rows as the lanes of a
    vector, with no horizontal sums and no widening (matmul.cl's ROW_TILE). Q5_0's fifth
    bits are reordered within their word (_Q5_0_FIFTH_BITS) so that the kernel joins
    each to its nibble with one shift and one bitselect a word."""
    size = weights.BLOCK_LAYOUT[storage][1]
    b = raw.reshape(rows, -1, size)
    if storage == "Q5_0":
        qh = b[..., 2:6].copy().view("<u4")[..., 0]
        moved = np.zeros_like(qh)
        for e, at in enumerate(_Q5_0_FIFTH_BITS):
            moved |= ((qh >> np.uint32(e)) & np.uint32(1)) << np.uint32(at)
        b = b.copy()
        b[..., 2:6] = moved[..., None].view(np.uint8)
    pad = -rows % width
    if pad:
        b = np.concatenate([b, np.zeros((pad,) + b.shape[1:], np.uint8)])
    b = b.reshape(-1, width, b.shape[1], size).transpose(0, 2, 1, 3)     # [tile][block][row][byte]
    fields = [at + i for at in weights.SCALE_FIELDS[storage] for i in (0, 1)]
    rest = [i for i in range(size) if i not in fields]                  # a multiple of 4 in every format
    scales = b[..., fields].reshape(b.shape[:3] + (-1, 2)).transpose(0, 1, 3, 2, 4)        # [field][row][2]
    words = b[..., rest].reshape(b.shape[:3] + (-1, 4)).transpose(0, 1, 3, 2, 4)           # [word][row][4]
    tiles = np.concatenate([scales.reshape(b.shape[:2] + (-1,)), words.reshape(b.shape[:2] + (-1,))], axis=2)
    return np.ascontiguousarray(tiles).reshape(-1)


def _device_array(checkpoint, tensor, storage, tiled=None):
    """The bytes a param holds on the device, from its checkpoint tensor."""
    if tiled is not None and storage in weights.SCALE_FIELDS:
        return tile_blocks(_device_array(checkpoint, tensor, storage), checkpoint.tensors[tensor].shape[0],
                           storage, tiled[1])
    if tiled is not None:
        return tile(_device_array(checkpoint, tensor, storage), *tiled)
    info = checkpoint.tensors[tensor]
    if storage in weights.SCALE_FIELDS:
        raw = np.frombuffer(checkpoint.raw(tensor), np.uint8)
        blocks = raw.reshape(-1, weights.BLOCK_LAYOUT[storage][1])
        scales = np.concatenate([blocks[:, at:at + 2] for at in weights.SCALE_FIELDS[storage]], axis=1)
        if not np.isfinite(scales.view(np.float16)).all():
            # The kernels decode blocks without checks: an inf/NaN scale would read back as garbage.
            raise PrepareError("a tensor of the checkpoint has non-finite block scales", "weights",
                               private=f"tensor {tensor!r} has non-finite block scales", quotes=False)
        return raw
    if storage == "F32":
        return checkpoint.array(tensor).astype(np.float32, copy=False) if info.dtype == "F32" \
            else checkpoint.dequantize(tensor)
    if storage == "F16":
        return checkpoint.array(tensor) if info.dtype == "F16" else checkpoint.dequantize(tensor).astype(np.float16)
    values = checkpoint.dequantize(tensor)
    if not np.array_equal(values, np.round(values)) or np.abs(values).max(initial=0) >= 2**31:
        raise PrepareError("a tensor the module declares i32 holds non-integer values", "weights",
                           private=f"tensor {tensor!r} is declared i32 but holds non-integer values", quotes=False)
    return values.astype(np.int32)


class Variant:
    """One native execution choice: the command programs and kernels a
    deployment runs. The first is prepared with the registration; staged ones
    replace commands and kernels only, under the same resource contract."""

    def __init__(self, vid, base, binding, sources):
        self.id = vid
        self.base = base              # the id it was staged against (None for the prepared one)
        self.binding = binding        # same specs, params and state as every other variant
        self.sources = sources        # kernel name -> OpenCL source text
        self.phase = "compiling"
        self.error = None             # {"code", "message"} when failed
        self.diagnostics = []         # build evidence per kernel specialization
        self.created = time.time()
        self.users = 0                # consumer references: the selection, and each step in flight on it
        self.executables = []         # its staged builds, pinned in the compiler cache until it goes

    def pin(self, compiler, results):
        for result in results:
            if result.ok:
                compiler.pin(result)
                self.executables.append(result)

    def unpin(self, compiler):
        for executable in self.executables:
            compiler.unpin(executable)
        self.executables = []

    def record(self, detail=False):
        out = {"object": "variant", "id": self.id, "base": self.base, "phase": self.phase, "users": self.users,
               "created": int(self.created)}
        if self.error is not None:
            out["error"] = dict(self.error)
        if detail:
            out["diagnostics"] = list(self.diagnostics)
            if self.binding is not None:
                out["commands"] = [c.name for c in self.binding.module.commands]
                out["kernels"] = [k.name for k in self.binding.module.kernels]
        return out


class Prepared:
    """A module bound to a checkpoint with its params resident on the device."""

    def __init__(self, name, module, binding, device, compiler, sources):
        self.name = name
        self.module = module
        self.binding = binding
        self.device = device
        self.compiler = compiler
        self.sources = sources        # kernel name -> OpenCL source text, read at preparation
        self.params = {}              # (name, index) -> DeviceBuffer; empty while evicted
        self.states = {}              # name -> DeviceBuffer
        self.plans = collections.OrderedDict()   # (variant, command, geometry) -> ExecPlan
        self.pending = {}             # plan key -> [done callbacks] while compiling
        self.variants = {}            # id -> Variant, in creation order
        self.selected = None          # the preferred variant's id
        self.selecting = None         # a selection waiting for the safe execution boundary
        self.tokenizer = None         # from the asset directory or the checkpoint, when either has one
        self.preserved = []           # (role, name, bytes) of the prepare and control modules variants keep
        self.components = {}          # name -> Prepared: a document's extra components (a text model's "image")
        # Whether its code and includes all came from an uploaded package: only then may a build log
        # or a plan's error, which quote the sources, reach a client (errors.withhold).
        self.quotable = False
        self.uploaded = set()         # the preserved modules that came from the package
        # What restore needs to upload exactly what preparation did: the kind's extension of the
        # checkpoint (LoRA packs: not in the checkpoint, so a restore must derive them again), the
        # digests of what it derived then, and the identity of the checkpoint files read.
        self.extend = None
        self.extended = {}            # derived tensor name -> digest of its float32 bytes
        self.files = {}               # checkpoint file -> (device, inode, size, mtime_ns)

    @property
    def policy(self):
        return self.module.policy or {}

    def spec(self, name, default=None):
        return self.binding.specs.get(name, default)

    def param_bytes(self):
        return sum(b.capacity for b in set(self.params.values()))

    # -- plans ---------------------------------------------------------------
    def plan_async(self, command, geometry, done):
        """done(plan, error) on the loop thread, once every kernel is built.
        Plans come from the selected variant at the time of the call."""
        variant = self.variants.get(self.selected)
        binding, sources = (variant.binding, variant.sources) if variant else (self.binding, self.sources)
        key = (self.selected, command, tuple(sorted(geometry.items())))
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
            done(plan, None)
            return
        if key in self.pending:
            self.pending[key].append(done)
            return
        try:
            layout = binding.plan(command, **geometry)
        except LoomError as e:
            done(None, self._diagnostic(e, f"{command} does not plan at this geometry", "plan"))
            return
        self.pending[key] = [done]
        self.compile_layout(layout, binding, sources, lambda built: self._plan_ready(key, layout, built, binding))

    def compile_layout(self, layout, binding, sources, done):
        """Build every distinct kernel specialization a layout launches; done(built)."""
        specializations = {}
        for launch in layout.launches:
            specializations.setdefault((launch.kernel, tuple(sorted(launch.defines.items()))), launch.defines)
        built, remaining = {}, [len(specializations)]
        if not specializations:
            done(built)
            return

        def one_built(spec_key, result):
            built[spec_key] = result
            remaining[0] -= 1
            if remaining[0] == 0:
                done(built)

        for spec_key, defines in specializations.items():
            kernel = spec_key[0]
            macros = {k: (1 if v is None else v) for k, v in defines.items()}
            self.compiler.compile_async(sources[kernel], macros, name=f"{self.name}/{kernel}",
                                        on_done=lambda result, k=spec_key: one_built(k, result))

    def _plan_ready(self, key, layout, built, binding):
        waiters = self.pending.pop(key)
        failed = next((r for r in built.values() if not r.ok), None)
        if failed is not None:
            error = self._diagnostic(PrepareError(f"{failed.name}: {failed.message}\n{failed.log}", "compile"),
                                     "a kernel does not build at this geometry", "compile")
            plan = None
        else:
            try:
                plan = ExecPlan(self, layout, built, binding)
                error = None
            except Problem as e:        # OutOfDeviceMemory keeps its code (503); the waiters still answer
                plan, error = None, e
            except Exception as e:      # whatever went wrong, every waiter gets its answer
                plan, error = None, self._diagnostic(PrepareError(f"{type(e).__name__}: {e}", "plan"),
                                                     "the launch plan could not be made", "plan")
            if plan is not None:
                self.plans[key] = plan
                while len(self.plans) > PLAN_CACHE:
                    self.plans.popitem(last=False)[1].release()
        for done in waiters:
            done(plan, error)

    def _diagnostic(self, error, public, code):
        """A build or plan failure as a client may see it: whole when the sources were uploaded,
        else `public` (the build log quotes the server's source files)."""
        if self.quotable:
            return PrepareError(getattr(error, "message", None) or str(error), code, quotes=False)
        return withhold(error, f"{self.name}: {public}", PrepareError, code)

    @property
    def resident(self):
        return bool(self.params) or not self.binding.params

    def release_plans_where(self, drop):
        """Drop the cached plans whose (command, geometry) `drop` picks (an image size that left
        the deployment's size cache), with their scratch."""
        for key in [k for k in self.plans if drop(k[1], dict(k[2]))]:
            self.plans.pop(key).release()

    def release_plans(self):
        """Drop every cached plan and its scratch (trim); plans are rebuilt on demand
        from the compiler's cache. Queued kernels keep their buffers in the driver."""
        for plan in self.plans.values():
            plan.release()
        self.plans.clear()

    def evict(self):
        """Drop the parameters (and the plans bound to them); state and binding stay.
        Returns the bytes freed. Kernels already queued keep their buffers alive in
        the driver until they retire, so this is safe with work in flight."""
        freed = self.param_bytes()
        self.release_plans()
        for buf in set(self.params.values()):
            buf.release()
        self.params.clear()
        return freed

    def restore(self, checkpoint_path, progress=None):
        """Stream the parameters back from the checkpoint (a worker thread), exactly as
        preparation uploaded them: the same files (else PrepareError: a checkpoint replaced
        on disk needs a new registration, never a silent change of results) and the same
        derived tensors, derived again by the kind's extension."""
        checkpoint = open_checkpoint(checkpoint_path)
        with checkpoint:
            now = _file_identities(checkpoint)
            if now != self.files:
                changed = sorted(set(now) ^ set(self.files)) or [f for f in now if now[f] != self.files[f]]
                # (the file is named privately: a shard's or a directory entry's name is read from the server)
                raise PrepareError(f"{checkpoint_path}: a file of the checkpoint changed on disk since the model "
                                   "was prepared; register it again to serve the new file", "checkpoint",
                                   private=f"{changed[0]} changed on disk since the model was prepared", quotes=False)
            if self.extend is not None:
                _extend(checkpoint, checkpoint_path, self.extend, self.extended)
            _upload_params(self, checkpoint, progress)     # all or nothing

    def release(self):
        """Free everything this deployment holds on the device (its components too), and its variants' pins."""
        for part in self.components.values():
            part.release()
        self.components.clear()
        for variant in self.variants.values():
            variant.unpin(self.compiler)
        self.evict()
        for buf in set(self.states.values()):
            buf.release()
        self.states.clear()
        self.device.pool.trim(0, owner=self.name)


MAX_WORK_ITEMS = 1 << 40   # one launch; past this a grid is a runaway, not a workload


def _check_limits(device, kernel, launch):
    """A launch the device cannot take fails its plan (code device_limit), never the driver."""
    limits = device.limits()
    items = math.prod(launch.grid) if launch.grid else 1
    group = math.prod(launch.local) if launch.local else 1
    local = device.local_memory_bytes(kernel)
    if items > MAX_WORK_ITEMS or group > limits["work_group_size"] or local > limits["local_memory_bytes"]:
        raise Problem(f"kernel {launch.kernel} at this geometry launches {items} work-items in groups of {group} "
                      f"with {local} bytes of local memory; the device takes at most {MAX_WORK_ITEMS}, "
                      f"{limits['work_group_size']} and {limits['local_memory_bytes']}", "device_limit")


class ExecPlan:
    """A launch plan bound to device buffers and kernel objects, ready to replay."""

    def __init__(self, prepared, layout, built, binding):
        self.prepared = prepared
        self.layout = layout
        pool = prepared.device.pool
        self.scratch = {}
        self.executables = []
        self.lock = threading.Lock()
        self.pending = 0            # runs handed to the submission thread, not enqueued yet
        self.release_wanted = False
        self.bound = {}             # (launch index, arg index) -> the buffer object the last run bound there
        self.rebinds = 0            # set_arg calls runs made (tests: a repeated step makes none)
        try:
            for name, (dtype, dims) in layout.scratch.items():
                nbytes = vm.itemsize(dtype) * math.prod(dims)
                self.scratch[name] = pool.alloc(nbytes, prepared.name, "workspace")
            # (kernel, global, local, ((arg index, command buffer arg name), ...)): a run binds
            # each kernel's buffer arguments just before its launch, so the device starts on
            # the first kernel while the host binds the rest.
            self.launches = []
            for launch in layout.launches:
                executable = built[(launch.kernel, tuple(sorted(launch.defines.items())))]
                if executable not in self.executables:
                    prepared.compiler.pin(executable)
                    self.executables.append(executable)
                entry = binding.module.find("kernels", launch.kernel).entry
                kernel = prepared.device.kernel(executable.program, entry)
                _check_limits(prepared.device, kernel, launch)
                slots = []
                for i, (value, kind) in enumerate(zip(launch.args, launch.arg_types)):
                    if kind == "int":
                        kernel.set_arg(i, np.int32(value))
                    elif kind == "float":
                        kernel.set_arg(i, np.float32(value))
                    elif value.kind == "arg":
                        slots.append((i, value.name))
                    else:
                        kernel.set_arg(i, self._buffer(value))
                self.launches.append((kernel, launch.grid, launch.local, tuple(slots)))
        except BaseException:
            self.release()
            raise

    def _buffer(self, ref):
        p = self.prepared
        if ref.kind == "param":
            return p.params[(ref.name, ref.index)].buffer
        if ref.kind == "state":
            return p.states[ref.name].buffer
        return self.scratch[ref.name].buffer

    def run(self, buffers):
        """Enqueue the whole plan; returns the last launch's event. A buffer argument
        already bound to the same buffer by the previous run is not bound again (the
        pool hands a step's inputs the buffers the last step freed: ~200 set_arg calls
        a decode step saved, under the GIL the loop needs). Runs of one plan are
        serialized on the submission thread, so the record is never raced."""
        device = self.prepared.device
        event = None
        bound = self.bound
        for j, (kernel, grid, local, slots) in enumerate(self.launches):
            for i, name in slots:
                buffer = buffers[name].buffer
                if bound.get((j, i)) is not buffer:
                    kernel.set_arg(i, buffer)
                    bound[(j, i)] = buffer
                    self.rebinds += 1
            event = device.launch(kernel, grid, local)
        device.flush()
        return event

    def enqueued(self):
        """A submitted run is on the device queue (the submission thread): a release asked
        for meanwhile happens now, once no submitted run still needs the buffers."""
        with self.lock:
            self.pending -= 1
            deferred = self.pending == 0 and self.release_wanted
        if deferred:
            self._release()

    def release(self):
        with self.lock:
            if self.pending:
                self.release_wanted = True      # a run still waits to be enqueued
                return
        self._release()

    def _release(self):
        for buf in self.scratch.values():
            buf.release()
        self.scratch = {}
        for executable in self.executables:
            self.prepared.compiler.unpin(executable)
        self.executables = []


# Runs of one step in flight at once: before enqueuing run r the submission thread
# waits for run r - RUNS_AHEAD (done by then on a driver whose enqueue keeps pace with
# the device) and hands its results to the loop, so a long chain of runs streams its
# tokens as they come and can end early (`more`) without the device ever idling.
RUNS_AHEAD = 2


def run_stage(prepared, loop, command, geometry, inputs, outputs, done, after=None, on_submit=None, keep=(),
              bound=None, runs=1, on_run=None, more=None):
    """Upload `inputs` (name -> array), run `command`'s plan for `geometry`, download
    `outputs` (name -> (dtype, count)); done(values, error) on the loop thread.
    The loop only allocates and plans: the device's submission thread enqueues the
    copies and launches (device.submit) and a worker waits for the results, so the
    loop never blocks on the device, not even in a driver's enqueue. With
    `after(buffers, run) -> (transfers, cleanup, feed)` more work is queued behind the
    plan on the submission thread (sampling), and its transfers are the step's results.
    With runs > 1 the plan runs up to that many times back to back, each run taking the
    previous run's `feed` = (arrays uploaded over those inputs, name -> DeviceBuffer
    bound in their place: the sampled ids as the next tokens), so the device goes on
    without waiting for the host; on_run(run, values) gets every run's results but
    the last's, on the loop, in order, as they complete (done gets the last's). Before
    each run after the first, more() (on the submission thread) may end the chain: the
    step then has the runs enqueued so far. (A worker waiting on every run from the
    first cost a small model ~8 % of its decode: Intel's runtime spins in a wait, on
    a core the kernels need. The submission thread's waits are for runs already done.)
    on_submit() runs on the loop once the step is handed over (its deadline starts).
    Outputs named in `keep` stay on the device: their values are the DeviceBuffers,
    complete when done runs, which the caller releases. `bound` (name -> DeviceBuffer)
    are inputs already on the device (a kept output of an earlier step), used as they are."""
    device = prepared.device
    buffers, host = {}, []
    bound = dict(bound or {})

    def finish(values, error):
        # last allocated, first released: the pool (last in, first out per size) then gives
        # the next step each input the buffer it had, so its plan binds nothing again
        for name, buf in reversed(buffers.items()):
            if error is not None or name not in keep:
                buf.release()
        host.clear()
        done(values, error)

    try:
        for name, array in inputs.items():
            buffers[name] = device.pool.alloc(array.nbytes, prepared.name, "workspace")
            host.append(array)  # alive until the copy has completed
        for name, (dtype, count) in outputs.items():
            buffers[name] = device.pool.alloc(np.dtype(dtype).itemsize * count, prepared.name, "workspace")
    except Exception as e:
        finish(None, e)
        return

    def enqueue(plan):
        """On the submission thread: nothing here waits for the device but for runs
        RUNS_AHEAD back. -> ([transfers of each run], [cleanups], runs handed to on_run)"""
        arrays, on_device, results, cleanups, delivered = inputs, bound, [], [], 0
        try:
            for run in range(runs):
                if run and more is not None and not more():
                    break
                if run >= RUNS_AHEAD:
                    values = {name: t.wait() for name, t in results[delivered].items()}
                    loop.call_soon_threadsafe(on_run, delivered, values)
                    delivered += 1
                for name, array in arrays.items():
                    device.upload_async(buffers[name], array)
                if arrays is not inputs:
                    host.extend(arrays.values())      # alive until finish, as the first run's
                event = plan.run(dict(buffers, **on_device))
                if after is None:
                    results.append({name: (_Kept(event, buffers[name]) if name in keep else
                                           device.download_async(buffers[name], dtype, count))
                                    for name, (dtype, count) in outputs.items()})
                    continue
                transfers, cleanup, feed = after(buffers, run)
                results.append(transfers)
                cleanups.append(cleanup)
                if run + 1 < runs:
                    arrays, fed = feed
                    on_device = dict(bound, **fed)
        except BaseException:
            for cleanup in cleanups:
                cleanup()
            raise
        return results, cleanups, delivered

    def enqueued(result, error):
        if error is not None:
            finish(None, error)
            return
        results, cleanups, delivered = result

        def wait_all():
            for run in range(delivered, len(results)):
                values = {name: t.wait() for name, t in results[run].items()}
                if run + 1 < len(results):
                    loop.call_soon_threadsafe(on_run, run, values)
            return values

        def waited(values, error):
            for cleanup in cleanups:
                if cleanup is not None:
                    cleanup()
            finish(values, error)

        loop.run_in_executor(wait_all, waited)

    def planned(plan, error):
        if error is not None:
            finish(None, error)
            return
        with plan.lock:
            plan.pending += 1
        device.submit(lambda: _run_plan(plan, enqueue),
                      lambda result, error: loop.call_soon_threadsafe(enqueued, result, error))
        if on_submit is not None:
            on_submit()     # handed to the device: the step's deadline runs from here, JIT excluded

    prepared.plan_async(command, geometry, planned)


class _Kept:
    """A kept output of run_stage: its buffer, complete once the plan's last launch is
    (the queue is in order)."""

    def __init__(self, event, buffer):
        self.event, self.buffer = event, buffer

    def wait(self):
        if self.event is not None:
            self.event.wait()
        return self.buffer


def _run_plan(plan, enqueue):
    try:
        return enqueue(plan)
    finally:
        plan.enqueued()


def prepare(name, source_paths, checkpoint_path, options, device, compiler, progress=None, loaded=None,
            preserved=(), assets=None, includes=None, extend=None, quotable=False, quotable_assets=False):
    """Everything that reads files or uploads weights; runs on a worker thread.
    `loaded` holds (name, bytes) sources from an uploaded package; `preserved` the
    document's (role, path, bytes|None) prepare and control modules; `assets` a
    read(name) -> bytes|None over the model's metadata directory (default: the
    checkpoint's folder on the server); `extend(checkpoint)` -> (arrays, metadata) the
    kind adds to the checkpoint before binding (the image kind's packed LoRA adapters).
    `quotable`: every source, prepare/control module and include is an uploaded member,
    so diagnostics may quote them (the client's own bytes); `quotable_assets` likewise
    for the asset directory. Otherwise a diagnostic that would quote a server file says
    only where and what was expected (errors.withhold); the checkpoint is always the
    server's."""
    uploaded = {path for path, _ in loaded or ()} | {path for _, path, data in preserved if data is not None}
    servers = list(source_paths) + [path for _, path, data in preserved if data is None]
    try:
        preserved = read_preserved(preserved)
        module = load_module(source_paths, loaded, preserved, uploaded)
    except (LoomError, OSError) as e:
        raise module_problem(e, quotable, uploaded, servers, "source") from None
    checkpoint = open_checkpoint(checkpoint_path)
    with checkpoint:
        files = _file_identities(checkpoint)
        extended = _extend(checkpoint, checkpoint_path, extend) if extend is not None else {}
        tensors = {n: vm.Tensor(t.shape, t.dtype) for n, t in checkpoint.tensors.items()}
        metadata = dict(checkpoint.metadata)
        metadata.update(_flatten(metadata.get("config", {}), "config."))
        try:
            binding = vm.bind(module, metadata, tensors, options, checkpoint.format, device.info.get("driver", ""),
                              device.info.get("vector_width", 0), device.info.get("int8_dot", False))
        except LoomError as e:
            # its names come from the sources and the checkpoint (always a server file)
            raise withhold(e, f"the module does not bind to the checkpoint {checkpoint_path}", PrepareError,
                           "bind") from None
        sources = kernel_sources(module, compiler, includes, quotable)
        prepared = Prepared(name, module, binding, device, compiler, sources)
        prepared.preserved, prepared.quotable, prepared.uploaded = preserved, quotable, uploaded
        prepared.extend, prepared.extended, prepared.files = extend, extended, files
        prepared.tokenizer = _tokenizer(checkpoint_path, checkpoint, assets, quotable_assets)
        try:
            _upload(prepared, checkpoint, progress)
        except BaseException:
            prepared.release()
            raise
    return prepared


def module_problem(error, quotable, uploaded, servers, code):
    """A PrepareError for modules that did not load: OSError names a path; a LoomError is
    told whole when it quotes only the client's bytes (an uploaded member's syntax, or code
    that is all uploaded), else withheld (errors.withhold) naming the server files."""
    if isinstance(error, OSError) or quotable or not getattr(error, "quotes", True) or (
            getattr(error, "line", None) is not None and error.source in uploaded):
        return PrepareError(str(error), code, quotes=False)
    source = getattr(error, "source", None)
    where = source if isinstance(source, str) and source not in uploaded else ", ".join(servers)
    return withhold(error, f"{where}: not a Loom module this server can load", PrepareError, code)


def open_checkpoint(path):
    """weights.open_checkpoint, its errors as PrepareError: a checkpoint is always a server file,
    so what its reader says about the bytes stays on the server's standard error."""
    try:
        return weights.open_checkpoint(path)
    except OSError as e:
        raise PrepareError(str(e), "checkpoint", quotes=False) from None
    except weights.WeightsError as e:
        raise withhold(e, f"{path}: not a checkpoint Loom reads (GGUF, safetensors, a diffusers folder, "
                          "CTranslate2 or ONNX)", PrepareError, "checkpoint") from None


def _extend(checkpoint, checkpoint_path, extend, expected=None):
    """Add the kind's derived tensors (extend(checkpoint) -> (arrays, metadata)) to an open
    checkpoint; -> their digests. With `expected` (a restore), tensors that differ from the
    ones preparation derived (an adapter file replaced since) raise PrepareError."""
    try:
        arrays, extra = extend(checkpoint)
    except Problem as e:        # the adapters are server files: what the reader says of them is withheld
        adapter = getattr(e, "adapter", None)
        raise withhold(e, f"adapter {adapter!r}: its file is not a LoRA adapter this package applies"
                       if adapter else "the model's LoRA adapters cannot be used", PrepareError, e.code) from None
    digests = {name: hashlib.blake2b(np.ascontiguousarray(a, "<f4").tobytes(), digest_size=16).digest()
               for name, a in arrays.items()}
    if expected is not None and digests != expected:
        raise PrepareError("the tensors derived from the model's files at preparation (its LoRA adapters) "
                           "changed on disk since; register it again to serve the new files", "checkpoint",
                           quotes=False)
    checkpoint.add_arrays(arrays, f"{checkpoint_path}#extended")
    checkpoint.metadata.update(extra)
    return digests


def _file_identities(checkpoint):
    """file -> (device, inode, size, mtime_ns) of every file a checkpoint's tensors come from."""
    out = {}
    for f in sorted({t.file for t in checkpoint.tensors.values()}):
        try:
            st = os.stat(f)
        except OSError:
            continue        # an in-memory store (ONNX's decoded initializers, derived tensors)
        out[f] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def _upload(prepared, checkpoint, progress):
    _upload_params(prepared, checkpoint, progress)
    for state in prepared.binding.states.values():
        buf = prepared.device.pool.alloc(state_bytes(prepared.binding, state), prepared.name, "state")
        prepared.states[state.name] = buf
        if not state.page:      # starts as zeros (a kernel's counters); rows write their pages before reading them
            prepared.device.zero(buf)


def state_bytes(binding, state):
    """A retained state's device bytes: its dims, times the pool's pages when paged."""
    pages = binding.options.get("pages", 0) if state.page else 1
    return vm.itemsize(state.dtype) * math.prod(state.dims) * (state.page * pages if state.page else 1)


def _upload_params(prepared, checkpoint, progress):
    """Upload every param, then publish them at once: a deployment is resident only with
    all its params (a request admitted during a restore must not find half of them)."""
    binding, pool = prepared.binding, prepared.device.pool
    own = [bp for bp in binding.params.values() if bp.alias is None]
    total = sum(storage_bytes(bp.shape, bp.storage, bp.tiled) for bp in own)
    done = 0
    params = {}
    try:
        for bp in own:
            info = checkpoint.tensors.get(bp.tensor)
            if info is None or tuple(info.shape) != bp.shape:
                raise PrepareError("a tensor the module binds changed since it was bound", "checkpoint",
                                   private=f"tensor {bp.tensor!r} changed since the module was bound", quotes=False)
            array = _device_array(checkpoint, bp.tensor, bp.storage, bp.tiled)
            params[(bp.name, bp.index)] = pool.alloc(array.nbytes, prepared.name, "params", host=array)
            done += array.nbytes
            if progress:
                progress(done, total)
    except BaseException:
        for buf in params.values():
            buf.release()
        raise
    for key, bp in binding.params.items():
        if bp.alias is not None:
            target = bp.alias
            while binding.params[target].alias is not None:
                target = binding.params[target].alias
            params[key] = params[target]
    prepared.params = params


def _tokenizer(checkpoint_path, checkpoint, assets, quotable=False):
    """The model's tokenizer: tokenizer metadata in its asset directory (tokenizer.json
    or vocab.txt), else the tokenizer.ggml.* metadata of a GGUF checkpoint; None if neither.
    `quotable`: the asset directory is an uploaded package's (its errors may quote it)."""
    from . import tokenizer
    if assets is None:
        assets = tokenizer.folder_reader(checkpoint_path if os.path.isdir(checkpoint_path)
                                         else os.path.dirname(checkpoint_path))
    try:
        found = tokenizer.from_folder(assets)
        gguf = checkpoint.format == "gguf"
        if found is None and gguf and "tokenizer.ggml.model" in checkpoint.metadata:
            found = tokenizer.from_gguf_metadata(checkpoint.metadata)
        elif found is not None and found.chat_template is None and gguf:
            template = checkpoint.metadata.get("tokenizer.chat_template")
            found.chat_template = template if isinstance(template, str) else None
        return found
    except OSError as e:
        raise PrepareError(str(e), "tokenizer", quotes=False) from None
    except (tokenizer.TokenizerError, ValueError) as e:
        if quotable:
            raise PrepareError(str(e), "tokenizer", quotes=False) from None
        raise withhold(e, "the model's tokenizer files (its asset directory, or the GGUF checkpoint's metadata) "
                          "are not a tokenizer Loom reads", PrepareError, "tokenizer") from None


def storage_bytes(shape, storage, tiled=None):
    """A param's device bytes in its storage (quantized blocks stay blocks; a tiled axis
    padded to whole tiles)."""
    if tiled is not None:
        axis, width = tiled
        shape = shape[:axis] + (-(-shape[axis] // width) * width,) + shape[axis + 1:]
    values, size = weights.BLOCK_LAYOUT.get(storage, (1, 4))   # I32 params: 4 bytes a value
    return math.prod(shape) // values * size


def _flatten(value, prefix):
    out = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif prefix:
        out[prefix[:-1]] = value
    return out


def resolve(base_directory, path):
    """A relative path under base_directory, or an absolute one as given."""
    return path if os.path.isabs(path) else os.path.join(base_directory, path)


# Variant ids are unique for the life of the process, across registrations.
_variant_ids = itertools.count(1)


def next_variant_id():
    return next(_variant_ids)


def stage_binding(prepared, source_paths, loaded=None, includes=None, quotable=False):
    """Bind staged sources against a prepared deployment's checkpoint and check
    the resource contract. Runs on a worker (it reads files). `loaded` is an
    optional list of (name, bytes) for sources uploaded in a package; includes(name)
    reads what their kernels #include (kernel_sources). `quotable`: every source and
    include is uploaded, so diagnostics may quote them (see prepare)."""
    uploaded = {path for path, _ in loaded or ()} | prepared.uploaded
    try:
        module = load_module(source_paths, loaded, prepared.preserved, prepared.uploaded)
    except (LoomError, OSError) as e:
        servers = list(source_paths) + [path for _, path, _ in prepared.preserved if path not in prepared.uploaded]
        # the preserved prepare/control modules are the registration's: quotable only when it was
        raise module_problem(e, quotable and prepared.quotable, uploaded, servers, "source") from None
    base = prepared.binding
    try:
        binding = vm.bind(module, base.metadata, base.tensors, base.options, base.format, base.driver,
                          base.vector_width, base.int8_dot)
    except LoomError as e:
        raise withhold(e, "the sources do not bind to this deployment's checkpoint", PrepareError,
                       "contract") from None
    old, new = base.contract(), binding.contract()
    for part in ("specs", "params", "states"):
        if old[part] != new[part]:
            changed = sorted(set(old[part]) ^ set(new[part])) or sorted(
                k for k in old[part] if old[part][k] != new[part].get(k))
            raise PrepareError(f"the sources change the {part} of the resource contract", "contract",
                               private=f"the sources change the {part} of the resource contract: "
                                       f"{', '.join(str(c) for c in changed[:8])}", quotes=False)
    for name, args in old["commands"].items():
        if new["commands"].get(name) != args:
            raise PrepareError("the sources change a command's signature; each must keep its own", "contract",
                               private=f"command {name} must keep its signature {list(args)}", quotes=False)
    if module.policy is not None and module.policy != (prepared.module.policy or None):
        raise PrepareError("the sources change the policy; that needs a new registration", "contract", quotes=False)
    module.policy = prepared.module.policy
    return binding, kernel_sources(module, prepared.compiler, includes, quotable)


def kernel_sources(module, compiler, includes=None, quotable=False):
    """kernel name -> OpenCL source: a library kernel's file, or the inline source with its
    #include "name" lines filled from includes(name) (the package's files: bytes or None),
    else from the kernel library; nothing else is read."""
    def read(name):
        data = includes(name) if includes is not None else None
        if data is None:
            return compiler.library_file(name)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise LoomError(f"{name} is not UTF-8 text") from None

    sources = {}
    for kernel in module.kernels:
        try:
            sources[kernel.name] = (compiler.library_source(kernel.library[:-3]) if kernel.library
                                    else language.include_files(kernel.name, kernel.source, read))
        except OSError as e:        # an include refused (outside the model roots) or unreadable
            if quotable:
                raise PrepareError(str(e), "source", quotes=False) from None
            raise withhold(e, "a kernel's #include cannot be read (outside the model roots, or unreadable)",
                           PrepareError, "source") from None
        except ValueError as e:     # LoomError too
            if quotable:
                raise PrepareError(f"kernel {kernel.name}: {e}", "source", quotes=False) from None
            raise withhold(PrepareError(f"kernel {kernel.name}: {e}"), "a kernel's #include is neither in the "
                           "package, nor the kernel library, nor a UTF-8 file", PrepareError, "source") from None
    return sources
