"""Plain decoding's share of the memory bound: how near ``none`` decodes to the machine's rate
of reading memory.

share = bytes read per token x decode tokens/s / GB/s of a 1 GiB read, the read on the bench's
threads in its process: bytes per token are every matrix of the target as held (the packed
blocks, or dense bfloat16) read once per token, the embedding row aside; the decode rate is
``none``'s after its first token (``summary.decode_rates_by_repeat``), the read rate the best
of 5 sums over a 1 GiB float32 tensor. Example: 954 MB per token at 20 tokens/s is 19.1 GB/s;
over a 40 GB/s read, 48%.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hybridspec.model import LlamaWeights, LoadedModel, PackedWeight, QuantizedWeight, held_bytes

READ_BYTES = 2**30


@dataclass(frozen=True, slots=True)
class MemoryBound:
    bytes_per_token: int  # every matrix as held, read once
    decode_tokens_per_s: float  # none's, after the first token
    read_gb_per_s: float  # best of 5 sums over READ_BYTES
    threads: int  # torch's, for the read and the decoding

    @property
    def share(self) -> float:
        return self.bytes_per_token * self.decode_tokens_per_s / 1e9 / self.read_gb_per_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "share": self.share}

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> MemoryBound:
        return cls(*(fields[name] for name in cls.__slots__))

    def line(self) -> str:
        return (
            f"memory bound (none, greedy, all prompts): {self.bytes_per_token / 1e6:.0f} MB/token"
            f" x {self.decode_tokens_per_s:.1f} tok/s = "
            f"{self.bytes_per_token * self.decode_tokens_per_s / 1e9:.1f} GB/s of "
            f"{self.read_gb_per_s:.1f} GB/s read (1 GiB, {self.threads} threads): "
            f"{self.share:.0%}"
        )


def matrices(weights: LlamaWeights) -> list[torch.Tensor | QuantizedWeight | PackedWeight]:
    """Every matrix a token's forward multiplies: the layers' and the LM head."""
    found = [weights.lm_head]
    for layer in weights.layers:
        found += [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down]
    return found


def bytes_per_token(weights: LlamaWeights) -> int:
    """Bytes of every matrix a token's forward reads: the layers' and the LM head's."""
    return sum(held_bytes(m) for m in matrices(weights))


def read_rate(size: int = READ_BYTES, repeats: int = 5) -> float:
    """GB/s of summing ``size`` bytes of float32, best of ``repeats``."""
    data = torch.ones(size // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return size / best / 1e9


def measure(target: LoadedModel, decode_tokens_per_s: float | None) -> MemoryBound | None:
    """The share for ``target`` at ``none``'s decode rate; None without a rate or native
    weights (a transformers runtime's bytes are not counted here)."""
    if decode_tokens_per_s is None or not isinstance(target.weights, LlamaWeights):
        return None
    weights = bytes_per_token(target.weights)
    return MemoryBound(weights, decode_tokens_per_s, read_rate(), torch.get_num_threads())
