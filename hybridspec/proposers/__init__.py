"""Proposers: cheap guessers of the next K tokens, chosen per request by name."""

from hybridspec.proposers.base import (
    DraftModel,
    NoProposer,
    Proposer,
    ProposerContext,
    ProposerFactory,
)
from hybridspec.proposers.registry import ProposerRegistry, default_registry, register_proposer

__all__ = [
    "DraftModel",
    "NoProposer",
    "Proposer",
    "ProposerContext",
    "ProposerFactory",
    "ProposerRegistry",
    "default_registry",
    "register_proposer",
]
