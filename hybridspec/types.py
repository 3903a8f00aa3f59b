"""Types shared by the proposers, the verifier and the engine: a request's sampling options and
grammar, and the hand-offs between the engine and its proposers (``ProposeRequest``,
``Proposal``, ``CommitInfo``). What only the engine and the layers above it use lives there
(a request's statistics: ``engine.stats``).

Glossary of dimensions used in tensor shape comments across the package (ARCHITECTURE.md has
the whole glossary):

- ``num_seqs``: sequences verified together in one target forward.
- ``num_drafts``: draft tokens of one sequence in one round (0..K, ``k_i`` in formulas).
- ``total_num_drafts``: sum of ``num_drafts`` over a batch (flat ragged layout).
- ``vocab_size``: size of the target's (and draft's) vocabulary.
- ``cu_*``: cumulative offsets, length ``num_seqs + 1``, starting at 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from hybridspec.errors import check

MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_SEED = 1 << 63  # torch generators take a signed 64-bit seed
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|, as in the OpenAI API
MAX_LOGIT_BIAS = 100.0  # |bias|, as in the OpenAI API
MAX_LOGIT_BIAS_ENTRIES = 300
# repetition_penalty bounds: z / rho and z * rho stay finite in float32 for any logit z a model
# produces (a rho of 1e-300 would turn a positive logit into inf, and softmax into NaN).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# GenerationParams' bounds (``engine.request``), which the server's schema states too
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20  # the most alternatives a request may ask for, as in the OpenAI chat API


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the target's next-token distribution is shaped before sampling.

    ``temperature == 0`` (or below 1e-5) means greedy decoding. ``top_k = None``, ``top_p =
    1.0`` and ``min_p = 0`` disable those filters. ``seed`` makes sampling reproducible per
    request; ``None`` draws fresh entropy.

    The controls (``verifier.controls`` has their exact semantics and order) change the logits
    before any of that, for greedy requests too: ``presence_penalty`` and ``frequency_penalty``
    (OpenAI's, in [-2, 2]; 0 = off), ``repetition_penalty`` (Hugging Face's and vLLM's, in
    [0.01, 100]; 1 = off), ``logit_bias`` (token id -> bias in [-100, 100], at most 300; a
    mapping given here is stored as sorted pairs) and ``min_tokens`` (EOS is masked until that
    many tokens are generated; 0 = off).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    min_p: float = 0.0
    min_tokens: int = 0

    def __post_init__(self) -> None:
        check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            f"expected a finite number >= 0, got {self.temperature!r}",
        )
        check(
            self.top_k is None
            or (
                isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 1
            ),
            "top_k",
            f"expected None or an integer >= 1, got {self.top_k!r}",
        )
        check(
            _is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            f"expected a number in (0, 1], got {self.top_p!r}",
        )
        check(
            self.seed is None
            or (
                isinstance(self.seed, int)
                and not isinstance(self.seed, bool)
                and 0 <= self.seed < MAX_SEED
            ),
            "seed",
            f"expected None or an integer in [0, 2**63), got {self.seed!r}",
        )
        self._check_controls()

    def _check_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(
                _is_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                name,
                f"expected a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}",
            )
        rho = self.repetition_penalty
        check(
            _is_number(rho) and MIN_REPETITION_PENALTY <= rho <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"expected a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], "
            f"got {rho!r}",
        )
        check(
            _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
            "min_p",
            f"expected a number in [0, 1], got {self.min_p!r}",
        )
        check(
            isinstance(self.min_tokens, int)
            and not isinstance(self.min_tokens, bool)
            and self.min_tokens >= 0,
            "min_tokens",
            f"expected an integer >= 0, got {self.min_tokens!r}",
        )
        bias = self.logit_bias
        pairs = tuple(bias.items()) if isinstance(bias, Mapping) else bias
        check(
            isinstance(pairs, tuple)
            and len(pairs) <= MAX_LOGIT_BIAS_ENTRIES
            and all(_is_bias_pair(pair) for pair in pairs)
            and len({pair[0] for pair in pairs}) == len(pairs),
            "logit_bias",
            f"expected at most {MAX_LOGIT_BIAS_ENTRIES} distinct token ids >= 0, each with a "
            f"bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}",
        )
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in pairs)))

    @property
    def has_controls(self) -> bool:
        """True when a penalty, a logit bias or ``min_tokens`` changes the logits (min_p is a
        filter of the sampled distribution, like top-p, and does not count)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def is_greedy(self) -> bool:
        """Temperatures below ``MIN_SAMPLING_TEMPERATURE`` decode greedily, as in vLLM:
        dividing logits by them would overflow float32."""
        return self.temperature < MIN_SAMPLING_TEMPERATURE


def _is_bias_pair(pair: object) -> bool:
    return (
        isinstance(pair, tuple)
        and len(pair) == 2
        and isinstance(pair[0], int)
        and not isinstance(pair[0], bool)
        and pair[0] >= 0
        and _is_number(pair[1])
        and abs(pair[1]) <= MAX_LOGIT_BIAS
    )


GrammarKind = Literal["json_object", "json_schema", "regex", "grammar"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_object", "json_schema", "regex", "grammar")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request's output must match (structured output): ``json_object`` (any JSON
    object; ``source`` empty), ``json_schema`` (``source`` = the schema as JSON text),
    ``regex`` (``source`` = the pattern) or ``grammar`` (``source`` = an EBNF grammar whose
    start rule is ``root``, as in xgrammar and llama.cpp's GBNF). ``verifier.grammar`` compiles
    it against the model's tokenizer."""

    kind: GrammarKind
    source: str = ""
    # The grammar compiled ahead (``verifier.grammar.Grammars.compile``, on a worker thread),
    # so that the engine thread only builds its matcher; not part of the spec's identity.
    compiled: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check(
            self.kind in GRAMMAR_KINDS,
            "grammar",
            f"expected a kind in {list(GRAMMAR_KINDS)}, got {self.kind!r}",
        )
        check(
            isinstance(self.source, str) and (bool(self.source) != (self.kind == "json_object")),
            "grammar",
            f"expected a non-empty source for {self.kind!r} (and none for json_object), "
            f"got {self.source!r:.80}",
        )


class TokenConstraint(Protocol):
    """The tokens a sequence may generate, at its committed position (a compiled grammar's
    matcher: ``verifier.grammar.GrammarState``). Drafts are never committed to it: each call
    looks ahead through them and comes back."""

    def mask_(self, logits: torch.Tensor, drafts: Sequence[int]) -> None:
        """Set to -inf, in place, what the constraint forbids in ``logits`` [num_rows,
        vocab_size]; row j follows ``drafts[: len(drafts) - num_rows + 1 + j]`` (the layout of
        ``verifier.apply_controls``). Rows after a forbidden draft are left as they are."""

    def num_allowed(self, drafts: Sequence[int]) -> int:
        """How many of ``drafts``, from the first, the constraint allows in a row."""

    def forced(self, drafts: Sequence[int], max_num_tokens: int) -> list[int]:
        """Tokens of the text the constraint forces after ``drafts`` (JSON punctuation, keys,
        the rest of an enum value), tokenized; at most ``max_num_tokens``."""


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """The tokens before a sequence's next position, as the sampling controls count them.

    ``token_ids`` is the committed context, prompt then generated tokens, shared without
    copying: read it, never modify it. ``stop_token_ids`` are the tokens ``min_tokens`` masks
    (the model's EOS ids; none for a request that ignores EOS). ``constraint``: the request's
    grammar at that position, whose mask the controls apply last; None for none.
    """

    token_ids: Sequence[int]  # [num_prompt_tokens + num_generated]
    num_prompt_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    constraint: TokenConstraint | None = None

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True, slots=True)
class Session:
    """Whose text a sequence is, handed to its proposer's ``start``, for a proposer that drafts
    from other requests' text (``suffix``): ``name`` the session (``GenerationParams.session``,
    the server's ``user``), ``shares`` whether its text may be shared with others
    (``GenerationParams.cache_prompt``), ``scope`` its cache scope
    (``GenerationParams.cache_scope``: a tenant or a ``cache_salt``; None, the shared one)."""

    name: str | None = None
    shares: bool = True
    scope: str | None = None


NO_SESSION = Session()  # no session named, text shared in the shared scope


@dataclass(frozen=True, slots=True)
class ProposeRequest:
    """One sequence's request to a proposer for one round.

    ``token_ids`` is the committed context (prompt then generated tokens), shared with the
    engine without copying: read it, never modify it. ``max_num_drafts`` is how many drafts the
    engine asks for this round (the request's K, shrunk near the context limit and by adaptive
    speculation); a proposer may return fewer. ``generator`` is the request's random generator,
    for proposers that sample their drafts. ``uniform_key`` is the key of the request's
    position-keyed uniforms (``verifier.uniforms``; None outside the engine): a proposer that
    picks its draft at position ``len(token_ids) + j`` by inverse CDF at that position's uniform
    returns a deterministic draft that the verifier keeps exactly when the target's own sample
    there is the same token (``eagle`` at temperature > 0). ``num_prompt_tokens`` and
    ``stop_token_ids`` are what a proposer that returns q needs to put it under the request's
    sampling controls (``history``, ``verifier.controls``). ``constraint`` is the request's
    grammar (structured output) at its committed position, None for none: the drafts it forbids
    are cut where the proposal enters the engine.

    ``draft_prefix``: drafts already chosen for this round before this proposer was asked (the
    grammar's forced tokens, ``proposers.grammar``), for a proposer that declares
    ``Proposer.continues_prefix``: it drafts what follows them, at most ``max_num_drafts`` of its
    own, and they count among ``CommitInfo.num_accepted`` like its own drafts, first.
    """

    seq_id: int
    token_ids: Sequence[int]
    max_num_drafts: int
    sampling: SamplingParams
    generator: torch.Generator | None = None
    num_prompt_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    constraint: TokenConstraint | None = None
    draft_prefix: tuple[int, ...] = ()
    uniform_key: int | None = None

    def history(self) -> TokenHistory:
        """The committed context as the sampling controls count it."""
        return TokenHistory(
            self.token_ids, self.num_prompt_tokens, self.stop_token_ids, self.constraint
        )


@dataclass(frozen=True, slots=True)
class Proposal:
    """What a proposer guesses for one sequence in one round: ``num_drafts`` draft tokens.

    ``probs`` is the proposer's distribution q at each draft position, after the request's
    sampling transforms, from which each draft was drawn; ``None`` marks deterministic drafts,
    verified as one-hot draft distributions. The engine validates a proposal once, where it
    enters (``verifier.check_proposal``).
    """

    token_ids: Sequence[int]  # [num_drafts]
    probs: torch.Tensor | None = None  # [num_drafts, vocab_size] float, rows sum to 1
    # The registered name of the proposer that drafted, where a proposer delegates a round to
    # another (``hybrid``); None: the request's proposer itself. Reported, never verified.
    drafted_by: str | None = None

    @property
    def num_drafts(self) -> int:
        return len(self.token_ids)

    @property
    def is_sampled(self) -> bool:
        """True when the drafts were sampled from ``probs`` (verified by rejection sampling)."""
        return self.probs is not None


EMPTY_PROPOSAL = Proposal(token_ids=())


@dataclass(frozen=True, slots=True)
class CommitInfo:
    """What one round committed to a sequence, handed to its proposer's ``commit``.

    ``token_ids`` are exactly the tokens appended after verification: the first
    ``num_accepted`` are accepted drafts, the last one the target's bonus or recovered token
    (unless a stop condition cut the round short, when there may be fewer). A proposer rolls its
    own state back past the rejected drafts from these two fields alone.
    ``hidden_states`` is for proposers that read the target's features
    (``Proposer.feature_layers``): the target's hidden states at the committed positions
    ``hidden_position, hidden_position + 1, ...`` that it fed since the last commit (see
    ``engine.features``: the prompt's chunks, the last committed token, accepted drafts; never a
    rejected draft). The first commit's rows start at 0, or after the prompt's positions served
    from a prefix-cache entry that kept no features. ``None`` for a proposer that asks for no
    layer.
    """

    seq_id: int
    token_ids: Sequence[int]  # [num_committed]
    num_accepted: int
    # [num_rows, len(Proposer.feature_layers), hidden_size] in the target's dtype, or None
    hidden_states: torch.Tensor | None = None
    hidden_position: int = 0  # the position of hidden_states' first row
