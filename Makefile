# The two commands of README.md: `make serve` (serve the default model over HTTP) and `make test`
# (the test suite). `make demo` generates text without a server.
# Each creates .venv and installs what it needs on a fresh clone; later runs reuse it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= The list type
# Every install takes the versions of constraints.txt (build dependencies too): a fresh machine
# gets what CI passed with.
PIP := $(BIN)/python -m pip install -q -c constraints.txt --build-constraint constraints.txt

.PHONY: test serve demo bench bench-quick bench-real clean lock

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt pip

# torch first, by exact version: pip takes the CPU wheel this machine kind keeps on disk (a
# plain `torch` would pull a CUDA build of several GB).
$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) torch==2.13.0
	$(PIP) -e '.[cpu,test]'
	touch $@

# The demo needs only the engine and onnxruntime: the default model ships in the repository.
$(VENV)/.installed-cpu: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[cpu]'
	touch $@

# Serving: the engine, onnxruntime and Ray Serve.
$(VENV)/.installed-serve: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[cpu,serve]'
	touch $@

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q --durations=25

PORT ?= 8000
serve: $(VENV)/.installed-serve
	$(BIN)/raymuter serve --port $(PORT)

demo: $(VENV)/.installed-cpu
	$(BIN)/raymuter generate --max-new-tokens 80 "$(PROMPT)"

bench: $(VENV)/.installed
	$(BIN)/python bench/decode.py

bench-quick: $(VENV)/.installed
	$(BIN)/python bench/decode.py --quick

# The real model's table (bench/real.py): SmolLM2-135M from the registry's GGUF wheel, built once.
# llama.cpp's rows need llama-cpp-python too, built from source (~12 min; see bench/real.py for the flags).
$(VENV)/.installed-bench: pyproject.toml constraints.txt $(VENV)/.installed
	$(PIP) -e '.[cpu,test,bench]'
	touch $@

bench-real: $(VENV)/.installed-bench
	PYTHONPATH=. $(BIN)/python bench/real.py

# constraints.txt anew from the test venv (after a green `make test` with a moved pin or range);
# the pins of pip and setuptools (not in the venv's freeze) stay as they are
lock: $(VENV)/.installed
	{ grep -E '^(# |pip==|setuptools==)' constraints.txt; \
	  $(BIN)/python -m pip freeze --exclude-editable | sed 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV)
