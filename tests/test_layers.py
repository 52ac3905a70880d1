"""The layering DESIGN.md asks for, read from the source: imports no module may make."""

import ast
import os

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "loom")
OPENCL_OWNERS = {"device.py", "compiler.py"}   # the whole OpenCL backend lives behind these two


def imports(path):
    """Every module name an import statement in `path` names (at any depth)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_only_device_and_compiler_import_pyopencl():
    offenders = {name: sorted(m for m in imports(os.path.join(PACKAGE, name)) if m.split(".")[0] == "pyopencl")
                 for name in sorted(os.listdir(PACKAGE)) if name.endswith(".py") and name not in OPENCL_OWNERS}
    assert {name: found for name, found in offenders.items() if found} == {}
    assert any(m == "pyopencl" for m in imports(os.path.join(PACKAGE, "device.py")))   # the check can see one


def string_constants(path):
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_the_generic_floors_never_name_a_kind():
    """registry.py, admin.py, routes.py and server.py learn everything about a kind from its
    Kind object (kinds.py): not one kind name appears in them."""
    from loom import language
    for name in ("registry.py", "admin.py", "routes.py", "server.py", "kinds.py"):
        named = string_constants(os.path.join(PACKAGE, name)) & set(language.KINDS)
        assert named == set(), f"{name} names kinds {sorted(named)}"
    assert "queued" in string_constants(os.path.join(PACKAGE, "kinds.py"))   # the check can see a literal
