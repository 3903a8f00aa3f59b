"""The bench's method names, in a module of their own so that the command line can list them
without importing the methods (torch, transformers, llama_cpp)."""

from __future__ import annotations

BASELINE = "none"  # our plain decoding: every speedup "vs none" divides by it
HF_BASELINE = "hf-plain"  # transformers' plain greedy/sampled generate()
HF_PROMPT_LOOKUP = "hf-prompt-lookup"
HF_METHODS = (HF_BASELINE, HF_PROMPT_LOOKUP)
LLAMACPP_BASELINE = "llamacpp-plain"  # llama-cpp-python's plain decoding of the target's GGUF
LLAMACPP_PROMPT_LOOKUP = "llamacpp-prompt-lookup"
LLAMACPP_METHODS = (LLAMACPP_BASELINE, LLAMACPP_PROMPT_LOOKUP)
DEFAULT_METHODS = (BASELINE, "ngram", HF_BASELINE, HF_PROMPT_LOOKUP)
LIBRARY_ONLY = (*HF_METHODS, *LLAMACPP_METHODS)  # not proposers: ``bench --served`` refuses them
