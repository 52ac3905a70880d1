"""The administration handlers over registry.py: /v1/models/* (register, drain,
undrain, unregister, activate, deactivate, pin, unpin), native executable
variants (/v1/models/variants...) and /v1/devices/trim (PROFILES.md).

They validate the request, find the registration and call the registry; the
lifecycle itself (phases, preparation, residency, admission) is registry.py's.
"""

import logging
import os
import re

from . import jsonin, packages, registry, runtime
from .errors import WITHHELD, Error, Problem, withhold
from .logs import PRIVATE
from .http import Deferred, Response, page
from .jsonin import Arr, Bool, Enum, Int, Obj, Str
from .registry import compile_probes

log = logging.getLogger("loom.admin")


MODEL = Obj({"model": Str(min_len=1)})
UNREGISTER = Obj({"model": Str(min_len=1), "mode": Enum(["drain", "abort"], optional=True)})
COMPONENT = Obj({"model": Str(min_len=1), "component": Str(optional=True)})
TRIM = Obj({"device": Int(lo=0, hi=2**31 - 1), "target_bytes": Int(lo=0, hi=2**62)})
COMPONENT_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def _registration(server, name):
    reg = server.registry.registrations.get(name)
    if reg is None or reg.removing:
        raise Error(404, f"model {name!r} does not exist", "model_not_found", "model")
    return reg


def _component(reg, body):
    """The residency selector: "primary" by default; undeclared 404, malformed 400."""
    component = body.get("component", "primary")
    if not COMPONENT_NAME.fullmatch(component):
        raise Error(400, f"invalid component selector {component!r}", "invalid_value", "component")
    if component not in reg.components():
        raise Error(404, f"model {reg.name!r} declares no {component!r} component", "component_not_found",
                        "component")
    return component


def _document(request):
    """The request JSON and, for multipart/form-data, the uploaded source package."""
    ctype = (request.header("content-type") or "").split(";")[0].strip().lower()
    if ctype != "multipart/form-data":
        return request.json(), None
    package, raw = packages.from_form(request.form())
    try:
        return jsonin.loads(raw), package
    except jsonin.JSONInputError as e:
        raise Error(400, f"request part: {e.message}", e.code, e.param) from None


def register_model(server, request):
    doc, package = _document(request)
    reg = server.registry.register(doc, None, package)
    return Response.json(dict(reg.status(), object="registration"), 202)


def drain_model(server, request):
    reg = _registration(server, request.json(MODEL)["model"])
    server.registry.drain(reg)
    return Response.json({"model": reg.name, "admission": reg.admission})


def undrain_model(server, request):
    reg = _registration(server, request.json(MODEL)["model"])
    server.registry.undrain(reg)
    return Response.json({"model": reg.name, "admission": reg.admission})


def unregister_model(server, request):
    body = request.json(UNREGISTER)
    reg = _registration(server, body["model"])
    mode = body.get("mode", "drain")
    server.registry.unregister(reg, mode)
    return Response.json({"model": reg.name, "mode": mode, "phase": reg.phase,
                          "in_flight": len(reg.jobs)}, 202)


def _residency_target(server, request):
    body = request.json(COMPONENT)
    reg = _registration(server, body["model"])
    component = _component(reg, body)
    if reg.phase != "ready" or reg.prepared is None:
        raise Error(409, f"model {reg.name!r} is {reg.phase}, not a healthy prepared registration",
                        "not_ready", "model")
    if reg.admission != "drained":
        raise Error(409, f"model {reg.name!r} must be drained first (POST /v1/models/drain)",
                        "not_drained", "model")
    return reg, component


def activate_model(server, request):
    reg, component = _residency_target(server, request)
    reg.deactivate_when_idle.discard(component)
    server.registry.activate(reg, name=component)
    return Response.json({"model": reg.name, "component": component, "operation": "activate"}, 202)


def deactivate_model(server, request):
    reg, component = _residency_target(server, request)
    server.registry.deactivate_when_unused(reg, component)
    return Response.json({"model": reg.name, "component": component, "operation": "deactivate"}, 202)


def _pinning(server, request, pinned):
    body = request.json(COMPONENT)
    reg = _registration(server, body["model"])
    component = _component(reg, body)
    if component == "primary":
        reg.pinned = pinned
    elif pinned:
        reg.pinned_components.add(component)
    else:
        reg.pinned_components.discard(component)
    return Response.json({"model": reg.name, "component": component, "pinned": pinned})


def pin_model(server, request):
    return _pinning(server, request, True)


def unpin_model(server, request):
    return _pinning(server, request, False)


def trim_device(server, request):
    body = request.json(TRIM)
    registry = server.registry
    if registry.device is None or body["device"] != 0:
        raise Error(404, f"no device {body['device']}", "device_not_found", "device")
    for reg in registry.registrations.values():
        if reg.engine is not None:
            reg.engine.release_idle()   # retained idle conversations are reclaimable caches too
        if reg.prepared is not None:
            for part in (reg.prepared, *reg.prepared.components.values()):
                part.release_plans()        # and so are cached plans' scratch, an extra component's too
    freed = registry.device.pool.trim(body["target_bytes"])
    return Response.json(dict(registry.resources(), device_index=0, freed_bytes=freed))


# -- native executable variants ------------------------------------------------------

PAGE = 64
MANAGEMENT_CREDIT = 8   # management observations open at once per registration; more answer 429
STAGE = Obj({"model": Str(min_len=1), "base": Int(lo=0, hi=2**62),
             "base_directory": Str(min_len=1, max_len=4096, optional=True),
             "sources": Arr(Str(min_len=1, max_len=4096), min_len=1, max_len=64), "wait": Bool(optional=True)})
SELECT = Obj({"model": Str(min_len=1), "variant": Int(lo=0, hi=2**62), "expected": Int(lo=0, hi=2**62)})
REMOVE = Obj({"model": Str(min_len=1), "variant": Int(lo=0, hi=2**62)})


def _variant_service(server, name):
    """A healthy prepared registration with native variants enabled."""
    reg = _registration(server, name)
    if reg.phase != "ready" or reg.prepared is None:
        raise Error(409, f"model {reg.name!r} is {reg.phase}, not a healthy prepared service", "not_ready", "model")
    if not reg.prepared.variants:
        raise Error(501, f"model {reg.name!r} does not support native variants (variant_capacity is 0)",
                        "variants_disabled", "model")
    return reg


def _variant(server, reg, vid, param="variant"):
    variant = reg.prepared.variants.get(vid)
    if variant is not None:
        return variant
    if any(r.prepared is not None and vid in r.prepared.variants for r in server.registry.registrations.values()):
        raise Error(409, f"variant {vid} belongs to another registration", "variant_conflict", param)
    raise Error(404, f"model {reg.name!r} has no variant {vid}", "variant_not_found", param)


def list_variants(server, request):
    request.require_empty_body()
    name = request.header("x-loom-model")
    if name is None:
        raise Error(400, "X-Loom-Model names the deployment whose variants to list", "missing_header",
                        "X-Loom-Model")
    reg = _variant_service(server, name)
    offset_text, variant_text = request.header("x-loom-offset"), request.header("x-loom-variant")
    if offset_text is not None and variant_text is not None:
        raise Error(400, "X-Loom-Offset and X-Loom-Variant are mutually exclusive", "conflicting_headers")
    prepared = reg.prepared
    if variant_text is not None:
        variant = _variant(server, reg, _header_int(variant_text, "X-Loom-Variant"))
        return _answer(Response.json(variant.record(detail=True)), _observe(reg))
    offset = _header_int(offset_text, "X-Loom-Offset") if offset_text is not None else 0
    variants = list(prepared.variants.values())
    data, next_offset = page(variants, offset, PAGE)
    return _answer(Response.json({"object": "list", "model": reg.name, "selected": prepared.selected,
                                  "count": len(variants), "offset": offset, "data": [v.record() for v in data],
                                  "next_offset": next_offset}), _observe(reg))


def _observe(reg):
    """One unit of reg's management-observation credit, or 429. An inventory, removal
    or selection answer holds it until its bytes have left for the client (or the
    client has gone: a slow reader cannot pile up answers); a staged compilation
    until it settles. Returns release(), which is idempotent."""
    if reg.observations >= MANAGEMENT_CREDIT:
        raise Error(429, f"model {reg.name!r} has {reg.observations} management observations open (its credit); "
                         "retry when one completes", "management_credit", "model")
    reg.observations += 1
    held = [True]

    def release():
        if held[0]:
            held[0] = False
            reg.observations -= 1
    return release


def _answer(response, release):
    response.on_sent = release
    return response


def _header_int(text, header):
    if not text.isdigit() or not text.isascii() or len(text) > 18:
        raise Error(400, f"{header} must be a nonnegative integer", "invalid_header", header)
    return int(text)


def stage_variant(server, request):
    doc, package = _document(request)
    try:
        body = STAGE.validate(doc)
    except jsonin.JSONInputError as e:
        raise Error(400, e.message, e.code, e.param) from None
    reg = _variant_service(server, body["model"])
    base = _variant(server, reg, body["base"], "base")
    if base.phase != "ready":
        raise Error(409, f"base variant {base.id} is {base.phase}, not ready", "variant_not_ready", "base")
    directory = body.get("base_directory")
    if directory is not None and not os.path.isabs(directory):
        raise Error(400, "base_directory must be absolute", "invalid_value", "base_directory")
    paths, loaded = [], []
    for i, source in enumerate(body["sources"]):
        if package is not None and not os.path.isabs(source):
            where, data = package.read(source, param=f"sources[{i}]")
            loaded.append((package.resolve(source)[1], data))
        elif not os.path.isabs(source) and directory is None:
            raise Error(400, f"relative source {source!r} needs an absolute base_directory", "invalid_value",
                            "sources")
        else:
            paths.append(runtime.resolve(directory, source) if directory else source)
    # Every server file it names, and the folder its #includes come from, inside the model roots.
    if directory is not None:
        server.registry.confined("base_directory", directory)
    for path in paths:
        server.registry.confined("sources", path)
    # Staging keeps the uploaded bytes only until its executables are built.
    includes = registry.Files.include_reader(directory, package)
    # Diagnostics may quote the sources only when they are all the client's (an uploaded package's).
    quotable = package is not None and not paths
    return _stage(server, reg, base, paths, loaded, includes, body.get("wait", True), quotable)


def _stage(server, reg, base, paths, loaded, includes, wait, quotable):
    prepared = reg.prepared
    if len(prepared.variants) >= reg.doc["variant_capacity"]:
        raise Error(429, f"model {reg.name!r} holds {len(prepared.variants)} variants, its variant_capacity",
                        "variant_capacity", "model")
    compiling = _observe(reg)
    variant = runtime.Variant(runtime.next_variant_id(), base.id, None, None)
    prepared.variants[variant.id] = variant
    deferred = Deferred() if wait else None

    def withdrawn(error):       # unregister answers a waiting client; the compilation goes on
        deferred.resolve(Response.error(error))

    if deferred is not None:
        reg.readers.add(withdrawn)
        deferred.on_cancel = lambda: reg.readers.discard(withdrawn)

    server.registry.staged(reg, +1)

    def settle(phase, error=None):
        variant.phase = phase
        variant.error = None if error is None else {"code": error["code"], "message": error["message"]}
        compiling()
        server.registry.staged(reg, -1)
        log.info("variant %d of %s: %s", variant.id, reg.name, phase,
                 extra={"event": "variant", "model": reg.name, "variant": variant.id, "phase": phase,
                        PRIVATE: (error or {}).get("private")})
        if withdrawn in reg.readers:
            reg.readers.discard(withdrawn)
            deferred.resolve(Response.json({"selected": prepared.selected, "variant": variant.record(detail=True)},
                                           200 if phase == "ready" else 422))

    def probed(failure, results):
        if failure is None and not reg.removing:
            variant.pin(prepared.compiler, results)   # until removal or the model's retirement
        for i, result in enumerate(results):
            # A build log quotes the sources it compiled (and a kernel's name is theirs): the client's
            # own only when all were uploaded; else the build is named by its place in the list.
            evidence = {"kernel": result.name, "log": result.log,
                        **({"message": result.message} if not result.ok else {})} if quotable \
                else {"kernel": f"#{i}", "log": f"({WITHHELD})" if result.log else ""}
            variant.diagnostics.append({"ok": result.ok, **evidence})
        if failure is not None:
            problem = registry.probe_problem(failure, quotable)
            settle("failed", {"code": problem.code, "message": problem.message, "private": problem.private})
        else:
            settle("ready")

    def bound(result, error):
        if error is not None:
            if not isinstance(error, Problem) or error.quotes:   # not a reader's: it may hold anything read
                error = withhold(error, "staging failed", code=getattr(error, "code", "internal"))
            settle("failed", {"code": error.code, "message": error.message, "private": error.private})
            return
        variant.binding, variant.sources = result
        compile_probes(reg, prepared, variant.binding, variant.sources, probed)

    server.loop.run_in_executor(runtime.stage_binding, bound, prepared, paths, loaded, includes, quotable)
    if deferred is not None:
        return deferred
    return Response.json({"selected": prepared.selected, "variant": variant.record()}, 202)


def select_variant(server, request):
    """Completes at the kind's safe execution boundary: once no cohort is in flight
    (text: between retired steps; embeddings and decisions: outside the active
    cohort). A client that leaves withdraws only its reader: the switch happens."""
    body = request.json(SELECT)
    reg = _variant_service(server, body["model"])
    prepared = reg.prepared
    variant = _variant(server, reg, body["variant"])
    if prepared.selecting is not None:
        raise Error(409, f"a selection of variant {prepared.selecting} is pending", "selection_pending", "variant")
    if body["expected"] != prepared.selected:
        raise Error(409, f"the selected variant is {prepared.selected}, not {body['expected']}",
                    "stale_expected", "expected")
    if variant.phase != "ready":
        raise Error(409, f"variant {variant.id} is {variant.phase}", "variant_not_ready", "variant")
    release = _observe(reg)
    prepared.selecting = variant.id
    deferred = Deferred()
    deferred.on_cancel = release     # the client left: the switch still happens at the boundary

    def switch():
        prepared.selecting = None
        if variant.id not in prepared.variants or reg.removing:
            deferred.resolve(_answer(Response.error(Error(
                410, f"model {reg.name!r} was unregistered before the selection took effect", "model_unregistered",
                "model")), release))
            return
        prepared.variants[prepared.selected].users -= 1
        variant.users += 1
        prepared.selected = variant.id
        log.info("selected variant %d of %s", variant.id, reg.name,
                 extra={"event": "variant_selected", "model": reg.name, "variant": variant.id})
        deferred.resolve(_answer(Response.json({"selected": variant.id}), release))

    reg.engine.at_boundary(switch)
    return deferred


def remove_variant(server, request):
    body = request.json(REMOVE)
    reg = _variant_service(server, body["model"])
    prepared = reg.prepared
    variant = _variant(server, reg, body["variant"])
    if variant.phase == "compiling":
        raise Error(409, f"variant {variant.id} is still compiling", "variant_busy", "variant")
    if variant.users or variant.id in (prepared.selected, prepared.selecting):
        raise Error(409, f"variant {variant.id} is in use ({variant.users} users)", "variant_busy", "variant")
    release = _observe(reg)
    del prepared.variants[variant.id]
    variant.unpin(prepared.compiler)
    for key in [k for k in prepared.plans if k[0] == variant.id]:
        prepared.plans.pop(key).release()
    return _answer(Response.json({"removed": variant.id}), release)


ROUTES = [
    ("GET", "/v1/models/variants", list_variants),
    ("POST", "/v1/models/variants", stage_variant),
    ("POST", "/v1/models/variants/select", select_variant),
    ("POST", "/v1/models/variants/remove", remove_variant),
    ("POST", "/v1/models/register", register_model),
    ("POST", "/v1/models/drain", drain_model),
    ("POST", "/v1/models/undrain", undrain_model),
    ("POST", "/v1/models/unregister", unregister_model),
    ("POST", "/v1/models/activate", activate_model),
    ("POST", "/v1/models/deactivate", deactivate_model),
    ("POST", "/v1/models/pin", pin_model),
    ("POST", "/v1/models/unpin", unpin_model),
    ("POST", "/v1/devices/trim", trim_device),
]
