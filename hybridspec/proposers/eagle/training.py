"""The eagle head's training-time unroll (EAGLE-3's training-time test): every drafting step
computed for every position of a window at once, each step attending as drafting does, so that
the loss (``distill.train``) sees the inputs drafting will feed.

Dimensions: ``B`` windows of ``T`` positions, ``D`` hidden size, ``H`` query heads, ``KV``
key/value heads, ``hd`` head_dim.
"""

from __future__ import annotations

import math

import torch

from hybridspec.proposers.eagle.config import DraftHead


def unrolled(
    head: DraftHead, features: torch.Tensor, next_token_ids: torch.Tensor, num_steps: int
) -> list[torch.Tensor]:
    """Predicted features of each drafting step, as drafting meets them (training-time test).

    ``features [B, T, D]`` are the target's ``f_0 .. f_{T-1}``, ``next_token_ids [B, T]``
    the tokens ``x_1 .. x_T``. Step 1 at position ``j`` reads ``(f_j, x_{j+1})`` and attends
    to step-1 entries ``<= j``: it predicts ``f_{j+1}`` (``out[0][:, j]``). Step ``s`` at
    ``j`` reads ``(out[s-2][:, j-1], x_{j+1})``, the feature the previous step predicted,
    and attends as drafting does: to step-1 entries ``<= j - s + 1``, the entry of step
    ``m`` at ``j - s + m`` for ``1 < m < s``, and itself; it predicts ``f_{j+1}`` too
    (positions ``j < s - 1`` have no such history and are masked by the caller).
    """
    c = head.config
    length = features.shape[1]
    positions = torch.arange(length, device=features.device)
    rep, scale = c.num_heads // c.num_kv_heads, 1.0 / math.sqrt(c.head_dim)
    outs: list[torch.Tensor] = []
    keys: list[torch.Tensor] = []  # per step: [B, KV, T, hd]
    values: list[torch.Tensor] = []
    inputs = features
    for step in range(num_steps):
        if step > 0:  # feed back the previous step's prediction, one position later
            inputs = torch.cat((torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]), dim=1)
        x = head.fuse(inputs, next_token_ids)  # [B, T, D]
        q, k, v = head.qkv(x, positions)
        q = q.transpose(1, 2)  # [B, H, T, hd]
        keys.append(k.transpose(1, 2).repeat_interleave(rep, dim=1))  # [B, H, T, hd]
        values.append(v.transpose(1, 2).repeat_interleave(rep, dim=1))
        scores = [
            (q @ keys[0].transpose(-1, -2)).masked_fill(
                torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1 - step),
                float("-inf"),
            )
        ]  # step-1 entries <= j - step
        for m in range(1, step + 1):  # the entry of step m at j - step + m
            shifted_k = _shift(keys[m], step - m)
            scores.append((q * shifted_k).sum(-1, keepdim=True))  # [B, H, T, 1]
        weights = torch.softmax(torch.cat(scores, dim=-1) * scale, dim=-1)
        attended = weights[..., :length] @ values[0]
        for m in range(1, step + 1):
            attended = attended + weights[..., length + m - 1 :][..., :1] * _shift(
                values[m], step - m
            )
        outs.append(head.finish(x, attended.transpose(1, 2)))  # [B, T, D]
    return outs


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """``x [B, H, T, hd]`` moved ``by`` positions later along T (zeros first): row j = x[j-by]."""
    if by == 0:
        return x
    return torch.cat((torch.zeros_like(x[:, :, :by]), x[:, :, :-by]), dim=2)
