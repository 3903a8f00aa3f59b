"""The proposer protocol: the public extension point of hybridspec.

A proposer guesses up to K next tokens for each sequence of a batch; the target verifies them
all in one forward. Its lifecycle per sequence:

1. ``start(seq_id, prompt_token_ids)`` when the sequence is admitted;
2. each round, ``propose(requests)`` for every sequence of the batch that uses this proposer,
   returning one ``Proposal`` per request, in order;
3. after verification, ``commit(seq_id, token_ids, num_accepted)`` with exactly the tokens that
   were appended to the sequence (accepted drafts then the bonus or correction token), so that
   the proposer can roll its own state back past what was rejected;
4. ``finish(seq_id)`` when the sequence ends, for whatever reason.

Only ``propose`` is required: the other three default to doing nothing, which suits a proposer
that reads the whole committed context from ``ProposeRequest.token_ids`` each round.

A deterministic proposer returns ``Proposal(token_ids)``; one that samples its guesses returns
``Proposal(token_ids, probs)`` with the distribution each token was drawn from. Either keeps
verification exactly lossless.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridspec.errors import InvalidRequestError
from hybridspec.types import Proposal, ProposeRequest


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer is built with: facts about the target and its own options."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tokenizer: Any = None  # the target's transformers tokenizer, when one is loaded
    options: dict[str, Any] = field(default_factory=dict)  # this proposer's own configuration


class Proposer(ABC):
    """Base class of every proposer. Subclasses implement ``propose``."""

    # The time of proposing one draft token, relative to the fixed cost of one target forward;
    # adaptive speculation (engine.speculation) asks for fewer drafts from costlier proposers.
    # 0 for proposers whose cost is negligible next to a forward (none, ngram).
    cost_per_token: float = 0.0
    # True for a proposer that samples its drafts and returns their distributions
    # (``Proposal.probs``). Such a request's sampled text depends on how many drafts it asks
    # for, so adaptive speculation decides them from its own rounds alone, keeping a seeded
    # output independent of its batch neighbours. A deterministic proposer's sampled text does
    # not depend on its drafts (``verifier.uniforms``).
    samples_drafts: bool = False

    def __init__(self, context: ProposerContext) -> None:
        self.context = context

    def start(self, seq_id: int, prompt_token_ids: Sequence[int]) -> None:  # noqa: B027
        """Begin tracking a sequence whose context starts with ``prompt_token_ids``."""

    @abstractmethod
    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        """Return one proposal of at most ``request.num_tokens`` tokens per request, in order."""

    def commit(self, seq_id: int, token_ids: Sequence[int], num_accepted: int) -> None:  # noqa: B027
        """Learn that ``token_ids`` were appended to the sequence after verification.

        The first ``num_accepted`` of them are this proposer's accepted drafts; the last one is
        the target's bonus or correction token (unless a stop condition cut the round short).
        """

    def finish(self, seq_id: int) -> None:  # noqa: B027
        """Forget a sequence: it finished, failed or was cancelled."""

    def close(self) -> None:  # noqa: B027
        """Release resources held by the proposer itself (models, caches)."""


class NoProposer(Proposer):
    """Proposes nothing: every round is one plain decoding step of the target."""

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        return [Proposal(token_ids=()) for _ in requests]


ProposerFactory = Callable[[ProposerContext], Proposer]


class ProposerRegistry:
    """Maps a proposer name to the factory that builds it. The only place names are compared."""

    def __init__(self) -> None:
        self._factories: dict[str, ProposerFactory] = {}

    def register(self, name: str, factory: ProposerFactory, *, replace: bool = False) -> None:
        if (
            not isinstance(name, str)
            or not name
            or not name.replace("-", "").replace("_", "").isalnum()
        ):
            raise InvalidRequestError(
                f"proposer: expected a non-empty name of letters, digits, '-' or '_', got {name!r}",
                param="proposer",
            )
        if not callable(factory):
            raise InvalidRequestError(
                f"proposer: factory for {name!r} must be callable, got {factory!r}",
                param="proposer",
            )
        if name in self._factories and not replace:
            raise InvalidRequestError(
                f"proposer: {name!r} is already registered (pass replace=True to override)",
                param="proposer",
            )
        self._factories[name] = factory

    def unregister(self, name: str) -> None:
        self._factories.pop(name, None)

    def factory(self, name: str) -> ProposerFactory:
        try:
            return self._factories[name]
        except KeyError:
            known = ", ".join(sorted(self._factories))
            raise InvalidRequestError(
                f"proposer: unknown proposer {name!r}; registered: {known}", param="proposer"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def copy(self) -> ProposerRegistry:
        other = ProposerRegistry()
        other._factories = dict(self._factories)
        return other
