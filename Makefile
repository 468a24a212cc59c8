# The two commands of README.md: `make serve` (serve the default model over HTTP) and `make test`
# (the test suite). `make demo` generates text without a server.
# Each creates .venv and installs what it needs on a fresh clone; later runs reuse it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= The list type

.PHONY: test serve demo bench bench-quick clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, by exact version: pip takes the CPU wheel this machine kind keeps on disk (a
# plain `torch` would pull a CUDA build of several GB).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[cpu,test]'
	touch $@

# The demo needs only the engine and onnxruntime: the default model ships in the repository.
$(VENV)/.installed-cpu: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[cpu]'
	touch $@

# Serving: the engine, onnxruntime and Ray Serve.
$(VENV)/.installed-serve: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[cpu,serve]'
	touch $@

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

PORT ?= 8000
serve: $(VENV)/.installed-serve
	$(BIN)/raymuter serve --port $(PORT)

demo: $(VENV)/.installed-cpu
	$(BIN)/raymuter generate --max-new-tokens 80 "$(PROMPT)"

bench: $(VENV)/.installed
	$(BIN)/python bench/decode.py

bench-quick: $(VENV)/.installed
	$(BIN)/python bench/decode.py --quick

clean:
	rm -rf $(VENV)
