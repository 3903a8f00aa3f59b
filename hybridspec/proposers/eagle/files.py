"""An eagle head's files: ``config.json`` and ``head.safetensors`` (the trained weights and the
draft vocabulary; the target's borrowed parts are never stored)."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridspec.errors import check
from hybridspec.proposers.eagle.config import (
    CONFIG_FILE,
    FORMAT,
    WEIGHTS_FILE,
    HeadConfig,
    TargetParts,
)
from hybridspec.proposers.eagle.head import EagleHead


def save_head(head: EagleHead, directory: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``config.json`` and ``head.safetensors`` (trained weights and the draft vocab)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).contiguous().cpu()
        for name, t in head.state_dict().items()
    }
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": FORMAT})
    (directory / CONFIG_FILE).write_text(head.config.to_json() + "\n")


def load_head(directory: Path, parts: TargetParts) -> EagleHead:
    """The head in ``directory`` over the target's ``parts``, in their dtype and device."""
    from safetensors.torch import load_file

    config_path = directory / CONFIG_FILE
    check(config_path.is_file(), "head", f"no {CONFIG_FILE} in {directory}")
    config = HeadConfig.from_json(config_path.read_text())
    tensors = load_file(str(directory / WEIGHTS_FILE))
    check("draft_vocab" in tensors, "head", f"{directory / WEIGHTS_FILE} has no draft_vocab")
    head = EagleHead(config, parts, tensors["draft_vocab"])
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    check(
        not missing and not unexpected,
        "head",
        f"{directory / WEIGHTS_FILE}: missing {missing}, unexpected {unexpected}",
    )
    return head.to(dtype=parts.embed.dtype, device=parts.embed.device).eval()
