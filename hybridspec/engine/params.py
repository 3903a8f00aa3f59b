"""``GenerationParams``: what a caller asks of one request (sampling, stops, budget, proposer
and K, logprobs, grammar, prompt cache, session), checked where it is made, with the bounds of
``types`` and ``config``. ``engine.request`` re-exports it, its public path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from hybridspec.config import check_num_speculative_tokens
from hybridspec.engine.resolution import ResolvedProposer
from hybridspec.errors import check
from hybridspec.types import (
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    GrammarSpec,
    SamplingParams,
)

DEFAULT_MAX_NEW_TOKENS = 256
_SAMPLING = SamplingParams()  # the sampling defaults, which ``GenerationParams.create`` shows
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))  # its flat arguments' part


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """Per-request generation options. ``None`` proposer / K take the engine's defaults.

    ``logprobs``: None for none, else each returned token's log-probability and that many most
    likely alternatives (0..20); ``prompt_logprobs`` the same for the prompt's tokens (the first
    has none). Both are under the request's sampling transforms (``engine.logprobs``).
    ``max_new_tokens`` may be 0 when ``prompt_logprobs`` is asked: the prompt is scored, and
    nothing generated. ``stop_token_ids`` end the request as EOS does (left out of the text,
    held back by ``min_tokens``), ``ignore_eos`` or not. ``grammar``: what the output must
    match (structured output, ``verifier.grammar``); None for free text. ``resolved``: the
    proposer and K already resolved against this engine's catalog where the request entered
    (the server does; ``engine.resolution``), which the engine then takes as they are; None:
    the engine resolves ``proposer`` and ``num_speculative_tokens`` when the request is added.
    ``cache_prompt`` False: the request neither reads the prefix cache nor leaves its tokens in
    it (``engine.prefix_cache``; llama.cpp's name). ``session``: whose request it is, for the
    ``suffix`` proposer's per-session isolation (the server passes the ``user`` field).
    ``tenant``: whose turn the request takes in admission (``engine.turns``; None: the
    requests without a tenant, as one). ``cache_scope``: which cached text the request may
    reuse: prefix-cache entries and ``suffix`` pools left by requests of the same scope only
    (None is the shared scope; the server derives it from the tenant and ``cache_salt``).
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    proposer: str | None = None
    num_speculative_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    grammar: GrammarSpec | None = None
    resolved: ResolvedProposer | None = None
    cache_prompt: bool = True
    session: str | None = None
    tenant: str | None = None
    cache_scope: str | None = None

    def __post_init__(self) -> None:
        for name in ("session", "tenant", "cache_scope"):
            value = getattr(self, name)
            check(
                value is None or isinstance(value, str),
                name,
                f"expected None or a string, got {value!r}",
            )
        check(
            isinstance(self.cache_prompt, bool),
            "cache_prompt",
            f"expected a bool, got {self.cache_prompt!r}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(
                value is None
                or (
                    isinstance(value, int)
                    and not isinstance(value, bool)
                    and 0 <= value <= MAX_LOGPROBS
                ),
                name,
                f"expected None or an integer in [0, {MAX_LOGPROBS}], got {value!r}",
            )
        least = 0 if self.prompt_logprobs is not None else 1
        check(
            isinstance(self.max_new_tokens, int)
            and not isinstance(self.max_new_tokens, bool)
            and self.max_new_tokens >= least,
            "max_new_tokens",
            f"expected an integer >= {least}, got {self.max_new_tokens!r}"
            + (" (0 needs prompt_logprobs: it only scores the prompt)" if least else ""),
        )
        check(
            isinstance(self.sampling, SamplingParams),
            "sampling",
            f"expected SamplingParams, got {type(self.sampling).__name__}",
        )
        check(
            self.proposer is None or (isinstance(self.proposer, str) and bool(self.proposer)),
            "proposer",
            f"expected a proposer name, got {self.proposer!r}",
        )
        if self.num_speculative_tokens is not None:
            check_num_speculative_tokens(self.num_speculative_tokens)
        check(
            isinstance(self.stop, tuple)
            and len(self.stop) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            f"expected a tuple of at most {MAX_STOP_STRINGS} non-empty strings, got {self.stop!r}",
        )
        check(
            isinstance(self.stop_token_ids, tuple)
            and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
            and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids
            ),
            "stop_token_ids",
            f"expected a tuple of at most {MAX_STOP_TOKEN_IDS} token ids, "
            f"got {self.stop_token_ids!r}",
        )
        check(
            self.grammar is None or isinstance(self.grammar, GrammarSpec),
            "grammar",
            f"expected None or a GrammarSpec, got {type(self.grammar).__name__}",
        )
        check(
            self.resolved is None or isinstance(self.resolved, ResolvedProposer),
            "resolved",
            f"expected None or a ResolvedProposer, got {type(self.resolved).__name__}",
        )

    @classmethod
    def create(
        cls,
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        temperature: float = _SAMPLING.temperature,
        top_k: int | None = _SAMPLING.top_k,
        top_p: float = _SAMPLING.top_p,
        seed: int | None = _SAMPLING.seed,
        presence_penalty: float = _SAMPLING.presence_penalty,
        frequency_penalty: float = _SAMPLING.frequency_penalty,
        repetition_penalty: float = _SAMPLING.repetition_penalty,
        logit_bias: Mapping[int, float] | None = None,
        min_p: float = _SAMPLING.min_p,
        min_tokens: int = _SAMPLING.min_tokens,
        proposer: str | None = None,
        num_speculative_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        stop_token_ids: Sequence[int] = (),
        grammar: GrammarSpec | None = None,
        cache_prompt: bool = True,
        session: str | None = None,
        tenant: str | None = None,
        cache_scope: str | None = None,
    ) -> GenerationParams:
        """Build parameters from flat keyword arguments; ``stop`` may be one string or several,
        ``logit_bias`` a mapping of token ids to biases (``SamplingParams`` has the bounds and
        the defaults, which these arguments show)."""
        given = {name: value for name, value in locals().items() if name != "cls"}
        sampling = {name: given.pop(name) for name in _SAMPLING_FIELDS}
        sampling["logit_bias"] = logit_bias or {}  # stored as sorted pairs
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        else:
            check(isinstance(stop, (list, tuple)), "stop", f"expected strings, got {stop!r}")
            stops = tuple(stop)
        given.update(stop=stops, stop_token_ids=tuple(stop_token_ids))
        return cls(sampling=SamplingParams(**sampling), **given)
