"""The eagle head's configuration (``config.json``), what it borrows from the target, how a
target is recognised (``target_fingerprint``), and ``DraftHead``: what the proposer drafts with,
whichever head it is (``head.EagleHead``, ``published.Eagle3Head``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from hybridspec.errors import check

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "head.safetensors"
FORMAT = "hybridspec-eagle-1"


@dataclass(frozen=True, slots=True)
class HeadConfig:
    """The shape of a head and which target it was trained for (``config.json``)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    target: str = ""  # the target it was trained on (its source), for messages
    # ``target_fingerprint`` of the target it was trained on: how a shipped head is found
    target_fingerprint: str = ""
    format: str = FORMAT
    # Variants for heads trained elsewhere (``published``: EAGLE's own checkpoints):
    input_norm: bool = True  # False: the layer reads the fused input as it is (no RMSNorm)
    fc_bias: bool = False  # the fusion layer has a bias
    # True: the head reads the target's features after its final norm and its outputs go to
    # the LM head as they are; False: before the norm, which the head applies to its outputs
    normed_features: bool = False
    # The target's layers whose outputs the head reads (``ForwardBatch.hidden_layers``): one,
    # read as it is; several (EAGLE-3's low, middle and high features), fused by ``feature_fc``
    feature_layers: tuple[int, ...] = (-1,)

    def __post_init__(self) -> None:
        layers = self.feature_layers
        check(
            isinstance(layers, (list, tuple))
            and len(layers) >= 1
            and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
            and len(set(layers)) == len(layers),
            "feature_layers",
            f"expected distinct layer indices, got {layers!r}",
        )
        object.__setattr__(self, "feature_layers", tuple(layers))  # a list, from JSON
        for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, name, f"expected >= 1, got {value!r}")
        check(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            f"expected a divisor of num_heads={self.num_heads}, got {self.num_kv_heads}",
        )
        check(
            1 <= self.draft_vocab_size <= self.vocab_size,
            "draft_vocab_size",
            f"expected an integer in [1, vocab_size={self.vocab_size}], "
            f"got {self.draft_vocab_size!r}",
        )
        check(self.format == FORMAT, "format", f"expected {FORMAT!r}, got {self.format!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> HeadConfig:
        data = json.loads(text)
        check(isinstance(data, dict), "config", "expected a JSON object")
        fields = set(HeadConfig.__dataclass_fields__)
        unknown = sorted(set(data) - fields)
        check(not unknown, "config", f"unknown fields {unknown}")
        return HeadConfig(**data)


@dataclass(frozen=True, slots=True)
class TargetParts:
    """What the head borrows from the target, frozen: all of the head's dtype and device."""

    embed: torch.Tensor  # [V, D]
    norm: torch.Tensor  # [D], the target's final norm
    lm_head: torch.Tensor  # [V, D]
    # the target's logits are ``c * tanh(logits / c)`` (Gemma 2's final_logit_softcapping);
    # 0: none. The head's logits are capped alike, so that its draft distribution is shaped
    # as the target's is
    final_softcap: float = 0.0


def target_fingerprint(embed: torch.Tensor) -> str:
    """A short hash of a target's first embedding rows, rounded to bfloat16 (so that a target
    loaded in float32 or bfloat16, from any path, has the same one)."""
    rows = embed[:64].detach().to(torch.bfloat16).float().cpu().contiguous()
    return hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16]


class DraftHead(Protocol):
    """What the ``eagle`` proposer drafts with: ``EagleHead``, or a published EAGLE-3 head
    (``published.Eagle3Head``). One drafting step is ``x = fuse(features, next_ids)``,
    ``q, k, v = qkv(x, positions)``, attention over the head's cache, ``finish(x, attended)``
    (predicted features, fed back as the next step's ``features``), ``logits`` of those over
    ``draft_vocab``. ``target_features`` turns the target's hidden states of
    ``feature_layers`` (``[rows, len(feature_layers), D_target]``) into ``features [rows, D]``."""

    config: HeadConfig
    parts: TargetParts
    draft_vocab: torch.Tensor
    feature_layers: tuple[int, ...]

    def fuse(self, features: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor: ...

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor: ...

    def logits(self, features: torch.Tensor) -> torch.Tensor: ...

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor: ...
