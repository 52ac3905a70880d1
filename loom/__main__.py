"""Command line: python -m loom [flags] -> Server."""

import argparse
import logging
import os
import sys

from .server import Config, Server, configure_logging


def _positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parser():
    d = Config()
    p = argparse.ArgumentParser(
        prog="python -m loom",
        description="Loom inference server: serves model deployments over HTTP on TCP and Unix sockets.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", metavar="FILE",
                   help="model catalog to register at start: a JSON list of model documents (or {\"models\": [...]}); "
                        "relative base_directory values resolve against the file's folder")
    p.add_argument("--device", metavar="SELECTOR",
                   help="OpenCL device: cpu, gpu, a flat index N, P:D (platform:device), a driver (intel, pocl) or part of its name "
                        "(see --list-devices). Default: the first usable GPU, else the best usable CPU driver. "
                        "A device that fails its probe is never chosen; naming one fails start (exit 2)")
    p.add_argument("--list-devices", action="store_true",
                   help="probe every OpenCL device, print the table (* marks the default choice) and exit: "
                        "0 when one is usable, else 2")
    p.add_argument("--memory_bytes", type=_positive_int,
                   help="bound on device memory for every buffer (weights, state, workspace). "
                        "Default: 80%% of the device's global memory")
    p.add_argument("--listen", action="append", metavar="ADDR",
                   help="listener, repeatable: tcp:HOST:PORT or unix:PATH (a stale socket file is replaced; "
                        "the file is removed on exit). Default: tcp:127.0.0.1:8080")
    p.add_argument("--request_body_bytes", type=_positive_int, default=d.request_body_bytes,
                   help="bound on a request's decoded body (Content-Length or chunked); larger bodies get 413")
    p.add_argument("--header_bytes", type=_positive_int, default=d.header_bytes,
                   help="bound on a request line plus headers; larger heads get 431")
    p.add_argument("--connections", type=_positive_int, default=d.connections,
                   help="open client connections; past it a new connection gets 503 and is closed")
    p.add_argument("--output_buffer_bytes", type=_positive_int, default=d.output_buffer_bytes,
                   help="per-connection output credit: a streaming producer pauses while this much is unsent")
    p.add_argument("--header_timeout", type=_positive_float, default=d.header_timeout,
                   help="seconds to receive a request head once it has started (slowloris bound); then 408")
    p.add_argument("--idle_timeout", type=_positive_float, default=d.idle_timeout,
                   help="seconds a keep-alive connection may sit idle, or a transfer make no progress")
    p.add_argument("--request_timeout", type=_positive_float, default=d.request_timeout,
                   help="seconds to receive a whole request, head and body; then 408")
    p.add_argument("--shutdown_timeout", type=_positive_float, default=d.shutdown_timeout,
                   help="on SIGINT/SIGTERM, seconds in-flight requests get to finish before they are cancelled")
    p.add_argument("--workers", type=_positive_int, default=d.workers,
                   help="threads of the shared CPU executor (tokenizing, decoding, rendering)")
    p.add_argument("--registrations", type=_positive_int, default=d.registrations,
                   help="models registered at once (catalog included); more registrations answer 429")
    p.add_argument("--package_bytes", type=_positive_int, default=d.package_bytes,
                   help="uploaded package bytes all registrations may retain; more answer 429")
    p.add_argument("--prepare_timeout", type=_positive_float, default=d.prepare_timeout,
                   help="seconds a model's preparation (reading, uploading, probing) may take; then it fails")
    p.add_argument("--trial_timeout", type=_positive_float, default=d.trial_timeout,
                   help="seconds a package's stages may take in their trial run before it is refused")
    p.add_argument("--log_capacity", type=_positive_int, default=d.log_capacity,
                   help="entries kept in the /logz ring")
    p.add_argument("--kernel_cache", metavar="DIR",
                   help="folder where built OpenCL kernels are kept, so the next start loads them instead of "
                        "compiling (keyed by source, defines, device, driver version and host CPU). "
                        "Default: $XDG_CACHE_HOME/loom/kernels or ~/.cache/loom/kernels; 'none' keeps nothing")
    p.add_argument("--model_root", action="append", metavar="DIR",
                   help="a folder whose files clients may name for a model: registration and staging refuse "
                        "(403) a server path that resolves, symlinks followed, outside every root, and no file "
                        "outside them is read. Repeatable. Default: Loom's cache folder. The start-up catalog's "
                        "own folders and Loom's shipped packages are always roots (docs/operations.md, "
                        "'Exposure and model roots')")
    p.add_argument("--log_level", default=d.log_level, choices=["debug", "info", "warning", "error"],
                   help="stderr log level")
    return p


def list_devices(selector):
    from .device import NoUsableDevice, format_devices, list_devices, select_device
    devices = list_devices()
    try:
        chosen = select_device(devices, selector)
    except NoUsableDevice as e:
        print(format_devices(devices))
        print(f"loom: {e}", file=sys.stderr)
        return 2
    print(format_devices(devices, chosen))
    return 0


def main(argv=None):
    args = parser().parse_args(argv)
    if args.list_devices:
        return list_devices(args.device)
    config = Config(listen=args.listen or ["tcp:127.0.0.1:8080"],
                    request_body_bytes=args.request_body_bytes, header_bytes=args.header_bytes,
                    connections=args.connections, output_buffer_bytes=args.output_buffer_bytes,
                    header_timeout=args.header_timeout, idle_timeout=args.idle_timeout,
                    request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout,
                    workers=args.workers, log_capacity=args.log_capacity, log_level=args.log_level,
                    models=args.models, device=args.device, memory_bytes=args.memory_bytes,
                    registrations=args.registrations, package_bytes=args.package_bytes,
                    prepare_timeout=args.prepare_timeout, trial_timeout=args.trial_timeout,
                    kernel_cache="" if args.kernel_cache == "none" else args.kernel_cache,
                    model_root=args.model_root)
    server = Server(config)
    configure_logging(args.log_level, server.logs)
    try:
        server.start()
    except (OSError, ValueError) as e:
        print(f"loom: cannot start: {e}", file=sys.stderr)
        return 2
    code = server.serve_forever()
    # Exit now: a worker still waiting on a wedged device step would keep the interpreter
    # (its executor threads are joined at exit) past --shutdown_timeout.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
