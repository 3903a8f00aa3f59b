"""The proposer protocol: the public extension point of hybridspec.

A proposer guesses up to K next tokens for each sequence of a batch; the target verifies them
all in one forward. Its lifecycle per sequence:

1. ``start(seq_id, prompt_token_ids, session)`` when the sequence is admitted, with whose text
   it is (``types.Session``);
2. each round, ``propose(requests)`` for every sequence of the batch that uses this proposer,
   returning one ``Proposal`` of at most ``request.max_num_drafts`` drafts per request, in
   order (a round in which none of them asks for a draft skips the call: a round without
   drafts costs what plain decoding does);
3. after verification, ``commit(info)`` with a ``CommitInfo``: exactly the tokens that were
   appended to the sequence (accepted drafts then the bonus or recovered token) and how many
   drafts were accepted, so that the proposer can roll its own state back past what was
   rejected;
4. ``finish(seq_id)`` when the sequence ends, for whatever reason.

A proposer that declares ``shadow_checked`` may also be asked, for a request that adaptive
speculation paused, for one draft that is never verified: the round decodes plainly, and the
commit's ``num_accepted`` says whether the target's token was that draft (1, with no bonus token
after it) or not (0), as verification would have (``engine.speculation``, "Shadow probes").

Only ``propose`` is required: the other three default to doing nothing, which suits a proposer
that reads the whole committed context from ``ProposeRequest.token_ids`` each round.

A deterministic proposer returns ``Proposal(token_ids)``; one that samples its drafts declares
``samples_drafts = True`` and returns ``Proposal(token_ids, probs)`` with the distribution each
draft was drawn from, under the request's sampling controls and transforms
(``verifier.apply_controls`` with ``ProposeRequest.history()`` and its earlier drafts, then
``verifier.logits_to_probs``), as the verifier puts the target's. Either keeps verification
exactly lossless. A proposer with a distribution of its own may also stay deterministic by
drawing each draft at the request's position-keyed uniform (``ProposeRequest.uniform_key``), as
``eagle`` does: its sampled requests' text then does not depend on the drafts, and they are
priced by measured costs as greedy ones are (``engine.speculation``). The engine validates every
proposal once, where it enters (``verifier.check_proposal``).

A proposer is built from a ``ProposerContext``: what it may use from the engine (the target's
vocabulary, EOS ids and tokenizer, its own section of the configuration, the draft model the
engine loaded, the engine's other proposers to compose) and nothing else; it never calls back
into the engine.

A proposer that reads the target's features (a feature-level draft head, as EAGLE does) names
the target's layers in ``feature_layers``; each ``commit`` then brings the layers' outputs at
every committed position fed since the last one (``CommitInfo.hidden_states``, from
``CommitInfo.hidden_position`` on), taken from the verifying forward itself. Example: a 10-token
prompt, then a round that feeds ``[p9, d1, d2, d3]`` and keeps ``d1, d2``: the commit of
``[d1, d2, c]`` brings positions 0-11 (the prompt and the accepted drafts, not ``d3``); the
next one starts at position 12, ``c``. (After a prefix-cache hit on an entry that kept no
features, the first commit starts at the first uncached position.) ``engine.features`` has the
details.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from hybridspec.config import (
    DEFAULT_VERIFY_TOKEN_COST,
    DraftConfig,
    EagleConfig,
    ModelConfig,
    NgramConfig,
    SuffixConfig,
)
from hybridspec.model import LoadedModel, ModelRuntime
from hybridspec.types import NO_SESSION, CommitInfo, Proposal, ProposeRequest, Session

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class DraftModel:
    """The draft model the engine loaded once (``DraftConfig.model``) and one runtime over it.

    Every proposer that drafts with it shares both: each allocates the runtime's slots for its
    own sequences (one per sequence, and the engine runs at most ``max_num_seqs`` at once).
    """

    model: LoadedModel
    runtime: ModelRuntime


@dataclass(frozen=True, slots=True)
class ProposerContext:
    """What a proposer may use from the engine; read-only. Each built-in proposer reads its own
    section of the configuration (named as in ``EngineConfig``), never the engine's whole one."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tokenizer: PreTrainedTokenizerBase | None = None  # the target's, when one is loaded
    # The most sequences started at once (``ModelConfig.max_num_seqs``), for preallocation.
    max_num_seqs: int = ModelConfig().max_num_seqs
    ngram: NgramConfig = field(default_factory=NgramConfig)  # ``ngram``'s; ``suffix``'s orders
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    eagle: EagleConfig = field(default_factory=EagleConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    # Verifying one more token, relative to a forward's fixed cost (``EngineConfig``'s, its
    # default where the engine measures it): what ``hybrid`` charges each draft.
    verify_token_cost: float = DEFAULT_VERIFY_TOKEN_COST
    draft_model: DraftModel | None = None  # None: no draft model is configured
    # The target itself, read-only: a feature-level head borrows its embedding, final norm
    # and LM head (``eagle``). None where a proposer is built without one (unit tests).
    target: LoadedModel | None = None
    # Why ``draft_model`` is None although one was configured (its loading failed), for errors.
    draft_error: str | None = None
    # Seconds of a one-token forward of the target (timed once, on the first call, by the
    # engine's proposer pool), so that a proposer can price its own drafts relative to it
    # (``Proposer.cost_per_token``).
    target_forward_s: Callable[[], float] | None = None
    # The engine's proposers built before this one, by registered name, for a proposer that
    # composes them (``hybrid``: ``ngram`` and ``eagle`` or ``draft``); it holds what it reads
    # here and never closes it. Replacing one (``Engine.register_proposer``) rebuilds those that
    # read its name. ``unavailable``: the registered ones that could not be built, with why.
    proposers: Mapping[str, Proposer] = field(default_factory=lambda: MappingProxyType({}))
    unavailable: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


class Proposer(ABC):
    """Base class of every proposer. Subclasses implement ``propose``."""

    # The time of proposing one draft token, relative to the fixed cost of one target forward;
    # adaptive speculation (engine.speculation) asks for fewer drafts from costlier proposers.
    # 0 for proposers whose cost is negligible next to a forward (none, ngram); a model-based
    # proposer measures it when it is built.
    cost_per_token: float = 0.0
    # True for a proposer that may sample its drafts and return their distributions
    # (``Proposal.probs``); one that declares False must return deterministic proposals. Such
    # a request's sampled text depends on how many drafts it asks for, so adaptive speculation
    # decides them from its own rounds alone, keeping a seeded output independent of its batch
    # neighbours. A deterministic proposer's sampled text does not depend on its drafts
    # (``verifier.uniforms``).
    samples_drafts: bool = False
    # The target's decoder layers whose outputs this proposer reads (``ForwardBatch``'s
    # convention: ``(-1,)`` is the last layer's output before the final norm). The engine then
    # hands it their rows at its sequences' committed positions in ``CommitInfo.hidden_states``
    # (``engine.features``); () asks for none and costs nothing.
    feature_layers: tuple[int, ...] = ()
    # True for a proposer that drafts after ``ProposeRequest.draft_prefix`` (drafts chosen
    # before it was asked: a grammar's forced tokens); one that declares False is asked for no
    # drafts in a round that has a prefix, as its drafts would follow the committed context.
    continues_prefix: bool = False
    # True for a proposer whose drafts cost next to nothing to make and whose ``propose``
    # changes no state that its ``commit`` does not settle: a paused request then checks one of
    # its drafts each round against the target's own token, without a verify row (module
    # docstring). Its drafts must be deterministic (``samples_drafts`` False).
    shadow_checked: bool = False
    # True for a proposer that never drafts (``none``): the engine then neither prices its
    # requests' drafts nor calls it, so that plain decoding pays for no speculation. A subclass
    # that defines ``propose`` drafts unless it declares this itself (``__init_subclass__``).
    never_drafts: bool = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        """Refuse the attribute's old name, which the engine no longer reads: a proposer
        naming ``hidden_layers`` would silently get no features. A subclass that defines
        ``propose`` drafts unless it declares ``never_drafts`` itself: one built on
        ``NoProposer`` would otherwise never be called."""
        super().__init_subclass__(**kwargs)
        if "hidden_layers" in vars(cls):
            raise TypeError(f"{cls.__name__}: hidden_layers is now named feature_layers")
        if "propose" in vars(cls) and "never_drafts" not in vars(cls):
            cls.never_drafts = False

    def __init__(self, context: ProposerContext) -> None:
        self.context = context

    def compose(self, inner: Proposer) -> Proposer | None:
        """A proposer that drafts with this one and then lets ``inner`` continue in the same
        round (what a request names ``"this+inner"``, e.g. ``grammar+ngram``), or None when
        this proposer does not compose (the default)."""
        return None

    def start(  # noqa: B027
        self, seq_id: int, prompt_token_ids: Sequence[int], session: Session = NO_SESSION
    ) -> None:
        """Begin tracking a sequence whose context starts with ``prompt_token_ids``; ``session``
        says whose text it is (the engine passes the request's)."""

    @abstractmethod
    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        """Return one proposal of at most ``request.max_num_drafts`` drafts per request."""

    def commit(self, info: CommitInfo) -> None:  # noqa: B027
        """Learn what one round appended to the sequence ``info.seq_id`` (see ``CommitInfo``)."""

    def finish(self, seq_id: int) -> None:  # noqa: B027
        """Forget a sequence: it finished, failed or was cancelled."""

    def close(self) -> None:  # noqa: B027
        """Release resources held by the proposer itself (models, caches)."""


class NoProposer(Proposer):
    """Proposes nothing: every round is one plain decoding step of the target."""

    continues_prefix = True  # nothing, after any prefix
    never_drafts = True

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        return [Proposal(token_ids=()) for _ in requests]


ProposerFactory = Callable[[ProposerContext], Proposer]
