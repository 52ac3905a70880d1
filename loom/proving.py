"""The proving ground: a package's stages trial-run in a child process before they serve.

A registration (and every staged native variant) is ready only once each of its
kind's probe stages has run, in a child process, on the same device, from the
same device binaries the server built, with zero-filled parameters and state and
the kind's own probe inputs (Kind.trial). Every buffer sits between guard bytes.
A kernel that loops forever, crashes the driver, writes out of bounds or asks
for more local memory than the device has then fails the registration with a
clear code and its evidence, and the server never runs it:

    trial_timeout   the child did not finish within --trial_timeout seconds
    trial_crash     the child died (a signal, a driver assertion, a segfault)
    out_of_bounds   a kernel wrote outside one of its buffers
    device_limit    a launch over the device's limits (work-group size, local memory)
    trial           anything else the child reported (its message says what)

    failure = prove(job, timeout)        # a worker thread: None, or (code, message)

The child is `python -m loom.proving`: it reads one pickled job on stdin and
writes one JSON line per kernel it is about to run, then a verdict. The parent
trusts only what it can check: its exit, its time, and its last words.
"""

import json
import os
import pickle
import signal
import subprocess
import sys

import numpy as np

MARK = "loom-proving:"
MAX_WORK_ITEMS = 1 << 32    # one launch at a probe geometry: more is a runaway grid
TAIL = 2000     # characters of the child's stderr kept as evidence


def job(device_info, binding, built, trials):
    """What the child needs, picklable: the bound module's inputs, the device
    binaries the server built (`built`: {(kernel, defines): Executable}) and the
    trials: [(command, geometry, inputs {name: array}, outputs {name: (dtype, count)})]."""
    return {"device": f"{device_info['platform']}:{device_info['device']}",
            "module": binding.module, "metadata": binding.metadata, "tensors": binding.tensors,
            "options": binding.options, "format": binding.format, "driver": binding.driver,
            "vector_width": binding.vector_width, "int8_dot": binding.int8_dot,
            "binaries": {key: executable.binary() for key, executable in built.items()}, "trials": trials}


def prove(job, timeout):
    """Run the trials in a child; None when every stage ran cleanly, else (code, message)."""
    data = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        done = subprocess.run([sys.executable, "-m", "loom.proving"], input=data, capture_output=True,
                              timeout=timeout, close_fds=True)
        out, err, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        running = _last(e.stdout)
        where = f" in {running}" if running else ""
        return "trial_timeout", f"a trial run did not finish within {timeout:g} s{where} (--trial_timeout)"
    lines = [json.loads(line[len(MARK):]) for line in out.decode("utf-8", "replace").splitlines()
             if line.startswith(MARK)]
    verdict = next((m for m in reversed(lines) if "ok" in m), None)
    if code == 0 and verdict is not None:
        return None if verdict["ok"] else (verdict["code"], verdict["message"])
    running = _last(out)
    where = f" while running {running}" if running else ""
    tail = err.decode("utf-8", "replace")[-TAIL:].strip()
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        reason = f"the trial run died with {name}{where}"
    else:
        reason = f"the trial run exited with status {code}{where}"
    return "trial_crash", reason + (f"; its last output: {tail}" if tail else "")


def _last(out):
    """The kernel the child said it was running last."""
    text = (out or b"").decode("utf-8", "replace")
    starts = [json.loads(line[len(MARK):]) for line in text.splitlines() if line.startswith(MARK)]
    starts = [m for m in starts if "kernel" in m]
    return f"kernel {starts[-1]['kernel']} of {starts[-1]['command']}" if starts else None


# -- the child ---------------------------------------------------------------------------

def _say(message):
    sys.stdout.write(MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


def _run(job):
    from . import device, vm
    from .compiler import Compiler, run_now
    from .runtime import state_bytes, storage_bytes
    device.assume_usable()
    dev = device.Device(job["device"])
    compiler = Compiler(dev, run_now)
    binding = vm.bind(job["module"], job["metadata"], job["tensors"], job["options"], job["format"], job["driver"],
                      job["vector_width"], job["int8_dot"])
    buffers = {}
    for key, bp in binding.params.items():
        if bp.alias is None:
            buffers[("param", key)] = dev.guarded(storage_bytes(bp.shape, bp.storage, bp.tiled))
    for key, bp in binding.params.items():
        target = bp.alias
        while target is not None and binding.params[target].alias is not None:
            target = binding.params[target].alias
        if target is not None:
            buffers[("param", key)] = buffers[("param", target)]
    for state in binding.states.values():
        buffers[("state", state.name)] = dev.guarded(state_bytes(binding, state))
    programs = {key: compiler.load_binary(binary, name=key[0]) for key, binary in job["binaries"].items()}
    limits = dev.limits()
    local_limit, group_limit = limits["local_memory_bytes"], limits["work_group_size"]
    for command, geometry, inputs, outputs in job["trials"]:
        layout = binding.plan(command, **geometry)
        args = {name: dev.guarded(array.nbytes, array) for name, array in inputs.items()}
        args.update({name: dev.guarded(np.dtype(dtype).itemsize * count) for name, (dtype, count) in outputs.items()})
        sizes = {name: vm.itemsize(dtype) * int(np.prod(dims, dtype=np.int64))
                 for name, (dtype, dims) in layout.scratch.items()}
        largest = dev.info["max_allocation_bytes"]
        for name, nbytes in sizes.items():
            if nbytes > largest:
                return {"ok": False, "code": "device_limit",
                        "message": f"scratch {name} of {command} needs {nbytes} bytes at the probe geometry "
                                   f"{geometry}; the device's largest allocation is {largest}"}
        scratch = {name: dev.guarded(nbytes) for name, nbytes in sizes.items()}
        for launch in layout.launches:
            executable = programs[(launch.kernel, tuple(sorted(launch.defines.items())))]
            kernel = dev.kernel(executable.program, binding.module.find("kernels", launch.kernel).entry)
            used = []
            for i, (value, kind) in enumerate(zip(launch.args, launch.arg_types)):
                if kind == "int":
                    kernel.set_arg(i, np.int32(value))
                elif kind == "float":
                    kernel.set_arg(i, np.float32(value))
                else:
                    where = {"arg": args, "scratch": scratch}.get(value.kind)
                    buf = where[value.name] if where is not None else \
                        buffers[("param", (value.name, value.index))] if value.kind == "param" else \
                        buffers[("state", value.name)]
                    kernel.set_arg(i, buf.buffer)
                    used.append((value.name, buf))
            items = int(np.prod(launch.grid, dtype=np.int64)) if launch.grid else 1
            group = int(np.prod(launch.local, dtype=np.int64)) if launch.local else 1
            if items > MAX_WORK_ITEMS or group > group_limit:
                return {"ok": False, "code": "device_limit",
                        "message": f"kernel {launch.kernel} of {command} launches {items} work-items in groups of "
                                   f"{group}; the bounds are {MAX_WORK_ITEMS} and {group_limit}"}
            local = dev.local_memory_bytes(kernel)
            if local > local_limit:
                return {"ok": False, "code": "device_limit",
                        "message": f"kernel {launch.kernel} of {command} needs {local} bytes of local memory; "
                                   f"the device has {local_limit}"}
            _say({"kernel": launch.kernel, "command": command})
            dev.launch(kernel, launch.grid, launch.local)
            dev.finish()
            broken = [name for name, buf in used if not buf.intact()]
            if broken:
                return {"ok": False, "code": "out_of_bounds",
                        "message": f"kernel {launch.kernel} of {command} wrote outside "
                                   f"{', '.join(sorted(set(broken)))} at the probe geometry {geometry}"}
    return {"ok": True}


def main():
    job = pickle.load(sys.stdin.buffer)     # from the server that started this process
    try:
        verdict = _run(job)
    except Exception as e:      # a failure the child can name: report it, not a traceback
        verdict = {"ok": False, "code": "trial", "message": f"{type(e).__name__}: {e}"}
    _say(verdict)
    sys.stdout.flush()
    os._exit(0)     # skip driver teardown: a wedged driver must not turn a verdict into a hang


if __name__ == "__main__":
    main()
