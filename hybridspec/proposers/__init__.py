"""Proposers: cheap guessers of the next K tokens, chosen per request by name."""

from hybridspec.proposers.base import (
    NoProposer,
    Proposer,
    ProposerContext,
    ProposerFactory,
    ProposerRegistry,
)


def default_registry() -> ProposerRegistry:
    """A fresh registry holding the built-in proposers: none, ngram and draft."""
    from hybridspec.proposers.draft import DraftModelProposer
    from hybridspec.proposers.ngram import NgramProposer

    registry = ProposerRegistry()
    registry.register("none", NoProposer)
    registry.register("ngram", NgramProposer)
    registry.register("draft", DraftModelProposer)
    return registry


__all__ = [
    "NoProposer",
    "Proposer",
    "ProposerContext",
    "ProposerFactory",
    "ProposerRegistry",
    "default_registry",
]
