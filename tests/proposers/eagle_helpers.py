"""Random draft heads over tiny targets, and engines that draft with them (tests only)."""

from __future__ import annotations

import torch

from hybridspec import Engine
from hybridspec.distill.train import head_config, init_head
from hybridspec.model.loader import LoadedModel
from hybridspec.proposers.eagle import EagleHead, EagleProposer, target_parts


def random_head(target: LoadedModel, draft_vocab_size: int, seed: int = 0) -> EagleHead:
    """An untrained head over ``target`` drafting from its first ``draft_vocab_size`` ids."""
    torch.manual_seed(seed)
    config = head_config(target, draft_vocab_size)
    parts = target_parts(target)
    head = init_head(config, parts, torch.arange(draft_vocab_size))
    return head.to(dtype=parts.embed.dtype, device=parts.embed.device).eval()


def use_head(engine: Engine, head: EagleHead) -> EagleProposer:
    """Make ``engine``'s ``eagle`` proposer draft with ``head``, and so its ``hybrid`` (which
    composes the engine's ``eagle``, rebuilt with it); returns that proposer."""
    engine.register_proposer("eagle", lambda context: EagleProposer(context, head), replace=True)
    proposer = engine.resolve_proposer("eagle")
    assert isinstance(proposer, EagleProposer)
    return proposer
