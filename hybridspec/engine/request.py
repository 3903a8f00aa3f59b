"""Requests: what a caller asks for, the state the engine keeps, and what it returns.

Glossary: ``committed`` tokens are prompt tokens plus generated tokens that passed verification;
``cached`` tokens are those whose keys and values sit in the target's KV cache. While a request
decodes, every committed token but the last is cached: the last one is fed to the next forward.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hybridspec.engine.detokenizer import IncrementalDetokenizer
from hybridspec.engine.features import FeatureRows
from hybridspec.engine.logprobs import LogprobParts, Logprobs
from hybridspec.engine.params import DEFAULT_MAX_NEW_TOKENS as DEFAULT_MAX_NEW_TOKENS
from hybridspec.engine.params import GenerationParams as GenerationParams  # its public path
from hybridspec.engine.resolution import ResolvedProposer
from hybridspec.engine.speculation import SpeculationState
from hybridspec.engine.stats import GenerationStats
from hybridspec.types import TokenHistory
from hybridspec.verifier.grammar import GrammarState
from hybridspec.verifier.uniforms import key_of

if TYPE_CHECKING:  # the command line reads GenerationParams' defaults without transformers
    from hybridspec.proposers import Proposer


class FinishReason(str, enum.Enum):
    """Why a request ended (values as in the OpenAI API where one exists)."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # failed; other requests are unaffected


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """The whole outcome of one request.

    ``logprobs`` (when asked) scores ``token_ids`` and then, when the request stopped at EOS,
    that EOS token, which ``token_ids`` leaves out; ``prompt_logprobs`` (when asked) scores
    the prompt's tokens from the second on.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: GenerationStats
    error: str | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason.value,
            "stats": self.stats.to_dict(),
        }
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value.to_dict()
        return out


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one engine step produced for one request: the newly committed tokens and text.

    ``logprobs`` scores ``new_token_ids`` (and the EOS that ended the request, if one did);
    ``prompt_logprobs`` comes once, on the first output after the prompt was scored.
    The first ``num_drafted`` of ``new_token_ids`` are drafts the target accepted, proposed by
    ``drafted_by`` (a registered proposer's name); the others are the target's own tokens.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None = None
    result: GenerationResult | None = None  # set on the final output
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    num_drafted: int = 0
    drafted_by: str | None = None


def new_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed`` or, when None, with fresh entropy."""
    generator = torch.Generator()
    generator.manual_seed(
        seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    )
    return generator


@dataclass(eq=False)
class ChoiceGroup:
    """The live choices of one prompt until its prefill is shared; ``requests[0]`` (the
    source) prefills. Each member's ``Request.group`` points here until the fork."""

    requests: list[Request]  # [n], in choice order; finished members leave

    @property
    def source(self) -> Request:
        return self.requests[0]


@dataclass(eq=False)
class Request:
    """The engine's mutable state of one request; owned by the engine thread alone."""

    request_id: str
    seq_id: int
    prompt_token_ids: list[int]
    params: GenerationParams
    resolved: ResolvedProposer  # its proposer object and K, resolved once when it was added
    generator: torch.Generator
    # position-keyed randomness of sampled verification (verifier.uniforms); fresh by default
    uniform_key: int = field(default_factory=lambda: key_of(None))
    token_ids: list[int] = field(default_factory=list)  # committed: prompt, then generated
    slot: int | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    arrival_time: float = field(default_factory=time.perf_counter)
    start_time: float | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    detokenizer: IncrementalDetokenizer | None = None
    speculation: SpeculationState = field(default_factory=SpeculationState)
    # Its parts: the target's features for its proposer (``engine.features``), and its
    # log-probabilities scored so far (``engine.logprobs``; made from ``params``).
    features: FeatureRows = field(default_factory=FeatureRows)
    scores: LogprobParts = field(init=False)
    # The choices of its prompt, until they share its prefill (``engine.choices``); else None.
    group: ChoiceGroup | None = None
    # The grammar's matcher at the committed position (``params.grammar``), None for none.
    constraint: GrammarState | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.stats.prompt_tokens = len(self.prompt_token_ids)
        params = self.params
        self.scores = LogprobParts(
            params.sampling, params.logprobs, params.prompt_logprobs, self.prompt_token_ids
        )

    @property
    def proposer(self) -> Proposer:
        return self.resolved.proposer

    @property
    def proposer_name(self) -> str:
        return self.resolved.name

    @property
    def num_speculative_tokens(self) -> int:
        return self.resolved.num_speculative_tokens

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def history(self, eos_token_ids: frozenset[int]) -> TokenHistory | None:
        """What the request's sampling controls count (``verifier.controls``): its committed
        tokens, the EOS ids that ``min_tokens`` masks unless it ignores EOS, and its grammar.
        None when it has neither controls nor a grammar."""
        if not self.params.sampling.has_controls and self.constraint is None:
            return None
        return TokenHistory(
            self.token_ids,
            len(self.prompt_token_ids),
            self.stop_ids(eos_token_ids),
            self.constraint,
        )

    def stop_ids(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """The tokens that end this request: EOS unless it ignores EOS, and its own."""
        eos = frozenset() if self.params.ignore_eos else eos_token_ids
        return eos | frozenset(self.params.stop_token_ids)

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(
        self, tokens: Sequence[int], eos_token_ids: Set[int], max_seq_len: int
    ) -> tuple[list[int], int, FinishReason | None]:
        """Commit verified ``tokens`` one by one, up to the first stop condition: EOS (not
        appended), a stop string, ``max_new_tokens`` or the context length. Returns the tokens
        appended, how many of ``tokens`` were consumed (those appended, and the EOS that
        stopped the request) and why the request finished, if it did."""
        assert self.detokenizer is not None
        new_token_ids: list[int] = []
        reason: FinishReason | None = None
        if self.params.max_new_tokens == 0:  # scores its prompt only
            return new_token_ids, 0, FinishReason.LENGTH
        consumed = 0
        for token in tokens:
            consumed += 1
            self.stats.generated_tokens += 1
            if (
                token in eos_token_ids and not self.params.ignore_eos
            ) or token in self.params.stop_token_ids:
                reason = FinishReason.STOP
                break
            self.token_ids.append(token)
            new_token_ids.append(token)
            if self.detokenizer.append(token):
                reason = FinishReason.STOP
            elif (
                self.num_generated >= self.params.max_new_tokens
                or len(self.token_ids) >= max_seq_len
            ):
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        if self.stats.time_to_first_token_s is None:
            self.stats.time_to_first_token_s = time.perf_counter() - self.arrival_time
        return new_token_ids, consumed, reason

    def final_output(
        self, new_token_ids: list[int], logprobs: Logprobs | None = None
    ) -> RequestOutput:
        """The last output of a finished request, with its whole result; ``logprobs`` scores
        ``new_token_ids`` (and the EOS that stopped it) when asked."""
        assert self.finish_reason is not None
        if self.start_time is not None:
            self.stats.elapsed_s = time.perf_counter() - self.start_time
        detokenizer = self.detokenizer
        result = GenerationResult(
            request_id=self.request_id,
            text=detokenizer.text if detokenizer is not None else "",
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            stats=self.stats,
            error=self.error,
            logprobs=self.scores.committed_logprobs(),
            prompt_logprobs=self.scores.prompt_logprobs(),
        )
        return RequestOutput(
            self.request_id,
            new_token_ids,
            detokenizer.stream_text(final=True) if detokenizer is not None else "",
            True,
            self.finish_reason,
            result,
            logprobs,
            self.scores.take_prompt_logprobs(),
        )
