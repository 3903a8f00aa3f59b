"""The llama.cpp baseline: llama-cpp-python decoding the target's own GGUF file.

``llamacpp-plain`` is ``Llama.generate`` one token per forward; ``llamacpp-prompt-lookup`` is the
same with ``llama_cpp.llama_speculative.LlamaPromptLookupDecoding`` as its ``draft_model``
(n-gram speculation from the context, which needs ``logits_all=True``: a verify forward scores
every drafted position). Both run the file our target was loaded from (the embedded Q4_1 GGUF by
default) with the bench's thread count, are fed the very token ids our engine gets (the chat
template rendered by the target's tokenizer, which is read from the same GGUF), and stop at the
same EOS ids and token budget. Each run starts from an empty KV cache, so prompt processing is
timed, as it is for the other methods.

``llama_cpp`` is optional (``make bench-peers`` compiles it): where it cannot be imported, or the
target is not a GGUF file, ``unavailable_reason`` says why and the bench skips these methods.

Forward counting, from the tokens fed to each ``Llama.eval`` (one target forward): the first
feeds the prompt, each later one the last committed token plus its drafts; each commits its
accepted drafts plus one token of the target, so ``accepted = generated - forwards``, as for
transformers' prompt lookup (``hf_baseline``). Example: prompt 50, evals fed [50, 4, 1] and 7
tokens generated: drafted 3 + 0 = 3, accepted 7 - 3 = 4.
"""

from __future__ import annotations

import importlib.util
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridspec.bench.names import LLAMACPP_METHODS, LLAMACPP_PROMPT_LOOKUP
from hybridspec.bench.records import Measurement, Speculation
from hybridspec.errors import check
from hybridspec.model import openmp_defaults
from hybridspec.types import SamplingParams

# llama-cpp-python's prompt lookup matches n-grams of up to 2 tokens: its default, and
# transformers' (``max_matching_ngram_size``) as well.
PROMPT_LOOKUP_MAX_NGRAM = 2
SEED_RANGE = 2**31  # llama.cpp's sampler seeds are 32-bit; 0xFFFFFFFF means "random"


def unavailable_reason(gguf: Path | None) -> str | None:
    """Why the llama.cpp methods cannot run, or None when they can."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama_cpp is not installed (make bench-peers installs llama-cpp-python)"
    if gguf is None:
        return "the target is not a GGUF file, which llama.cpp needs"
    return None


@dataclass(frozen=True, slots=True)
class LlamaCppOptions:
    """What both llama.cpp methods share with the run: file, threads, context, stopping."""

    gguf: Path
    threads: int  # for prompt processing and decoding alike
    context_length: int  # the longest prompt plus the token budget and one round of drafts
    eos_token_ids: tuple[int, ...]
    num_speculative_tokens: int  # prompt lookup's drafts per round, our K

    def __post_init__(self) -> None:
        check(self.threads >= 1, "threads", f"expected >= 1, got {self.threads}")
        check(
            self.context_length >= 1,
            "context_length",
            f"expected >= 1, got {self.context_length}",
        )
        check(bool(self.eos_token_ids), "eos_token_ids", "expected at least one EOS id")


def llama_cpp_method(name: str, options: LlamaCppOptions) -> LlamaCppMethod:
    """Load ``options.gguf`` into a ``Llama`` for ``name``, with prompt lookup where it asks."""
    check(name in LLAMACPP_METHODS, "methods", f"expected one of {LLAMACPP_METHODS}, got {name}")
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    lookup = name == LLAMACPP_PROMPT_LOOKUP
    draft = (
        LlamaPromptLookupDecoding(
            max_ngram_size=PROMPT_LOOKUP_MAX_NGRAM, num_pred_tokens=options.num_speculative_tokens
        )
        if lookup
        else None
    )
    llama = Llama(
        model_path=str(options.gguf),
        n_ctx=options.context_length,
        n_threads=options.threads,
        n_threads_batch=options.threads,
        logits_all=lookup,
        draft_model=draft,
        verbose=False,
    )
    return LlamaCppMethod(name, llama, options.eos_token_ids)


class _EvalTimer:
    """Times and sizes every ``Llama.eval`` (one forward) of one ``Llama`` while it lives.

    ``Llama.generate`` calls ``self.eval``, so an instance attribute wrapping the bound method
    sees every forward; llama-cpp-python offers no hook of its own.
    """

    def __init__(self, llama: Any) -> None:
        self.seconds = 0.0
        self.input_tokens: list[int] = []
        self._eval: Callable[[Sequence[int]], None] = llama.eval
        llama.eval = self._timed

    def reset(self) -> None:
        self.seconds = 0.0
        self.input_tokens = []

    def _timed(self, tokens: Sequence[int]) -> None:
        start = time.perf_counter()
        self._eval(tokens)
        self.seconds += time.perf_counter() - start
        self.input_tokens.append(len(tokens))


class LlamaCppMethod:
    """``Llama.generate`` on prompt token ids, timed like the other methods."""

    def __init__(self, name: str, llama: Any, eos_token_ids: Sequence[int]) -> None:
        self.name = name
        self.llama = llama
        self._eos = frozenset(eos_token_ids)
        self._timer = _EvalTimer(llama)

    def _sampler_options(self, sampling: SamplingParams) -> dict[str, float | int]:
        """Our sampling parameters in llama.cpp's terms: temp 0 is its greedy sampler; its
        default top-k 40, top-p 0.95, min-p 0.05 and repeat penalty are switched off."""
        check(
            sampling.presence_penalty == 0
            and sampling.frequency_penalty == 0
            and sampling.repetition_penalty == 1
            and not sampling.logit_bias
            and sampling.min_tokens == 0,
            "sampling",
            f"the llama.cpp baselines take temperature, top_k, top_p and min_p only, got "
            f"{sampling}",
        )
        if sampling.is_greedy:
            return {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
        return {
            "temp": sampling.temperature,
            "top_k": sampling.top_k or 0,  # llama.cpp: <= 0 keeps the whole vocabulary
            "top_p": sampling.top_p,
            "min_p": sampling.min_p,
            "repeat_penalty": 1.0,
        }

    def run(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        max_new_tokens: int,
        session: str | None = None,  # kept no text from one request to the next: unused
    ) -> Measurement:
        options = self._sampler_options(sampling)
        seed = sampling.seed if sampling.seed is not None else random.randrange(SEED_RANGE)
        self.llama.set_seed(seed % SEED_RANGE)
        self._timer.reset()
        start = time.perf_counter()
        # An empty KV cache: generate() would otherwise reuse the prefix it shares with the
        # previous request and skip that part of prompt processing.
        self.llama.reset()
        self._first_token_at: float | None = None
        # ggml's OpenMP threads are torch's: OpenMP's own waits, as in a process of its own,
        # not the passive ones this process's forward may hold (threads.kernel_forward)
        with openmp_defaults():
            generated, ended = self._generate(list(prompt_token_ids), options, max_new_tokens)
        elapsed = time.perf_counter() - start
        first = None if self._first_token_at is None else self._first_token_at - start
        fed = self._timer.input_tokens
        num_generated = len(generated) + ended
        speculation = Speculation(
            token_ids=tuple(generated),
            num_generated=num_generated,
            target_forwards=len(fed),
            num_drafts=sum(n - 1 for n in fed[1:]),
            num_accepted_tokens=max(0, num_generated - len(fed)),
        )
        return Measurement((speculation,), elapsed, self._timer.seconds, first)

    def _generate(
        self, prompt: list[int], options: dict[str, float | int], max_new_tokens: int
    ) -> tuple[list[int], bool]:
        """The generated ids (EOS excluded) and whether an EOS ended them."""
        generated: list[int] = []
        tokens = self.llama.generate(prompt, reset=False, **options)
        try:
            for token in tokens:
                if self._first_token_at is None:
                    self._first_token_at = time.perf_counter()
                if token in self._eos:
                    return generated, True
                generated.append(int(token))
                if len(generated) == max_new_tokens:
                    break
        finally:
            tokens.close()
        return generated, False
