"""``Int8DraftLinear``: the eagle head's matmuls drafting on CPU through the model's block kernel
with 8-bit weights (``quantize_matmuls``), half of what bfloat16 weights stream; the head's state
dict, and its training, are unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridspec.model import BlockLinear, Kernel, quantize
from hybridspec.proposers.eagle.head import EagleHead


class Int8DraftLinear(nn.Module):
    """A linear map that drafts on CPU through the model's block kernel: ``weight`` also kept
    in 8-bit groups of 32 (Q8_0's scheme), half of what a bfloat16 weight streams. It keeps
    ``weight`` and ``bias`` as they are (an ``nn.Linear``'s parameters stay its parameters, so
    the state dict is unchanged), and computes with them exactly where gradients are wanted."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Kernel) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.matmul = BlockLinear(quantize(weight.detach().float(), 8), kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = self.matmul(flat).view(*x.shape[:-1], self.weight.shape[0]).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)


QUANTIZED_MATMULS = ("fc", "wqkv", "wo", "w_gate_up", "w_down", "lm_head")


def quantize_matmuls(head: nn.Module, kernel: Kernel) -> None:
    """Replace ``head``'s matmuls (``QUANTIZED_MATMULS``, those it has, and an ``EagleHead``'s
    draft-vocabulary rows of the target's LM head) by ``Int8DraftLinear``s, in place; those
    already replaced are kept. The head's state dict is unchanged: each keeps its weight."""
    for name in QUANTIZED_MATMULS:
        module = getattr(head, name, None)
        if isinstance(module, nn.Linear):
            setattr(head, name, Int8DraftLinear(module.weight, module.bias, kernel))
    if isinstance(head, EagleHead) and head.draft_lm is None:
        # a plain tensor, not a parameter: the submodule adds nothing to the state dict
        head.draft_lm = Int8DraftLinear(head.draft_lm_head, None, kernel)
