"""The feature-level draft head of the ``eagle`` proposer (EAGLE, Li et al. 2024; EAGLE-3's
training-time test), its configuration and its files.

The head reads the target's own hidden state ``f_t`` (the last decoder layer's output, before
the final norm: ``ForwardBatch.hidden_layers = (-1,)``; or, as EAGLE-3 does, several layers'
outputs at ``t``, low, middle and last, side by side through a linear map ``feature_fc`` to the
target's width) and the embedding of the token that followed, ``x_{t+1}``; one
fully-connected layer fuses them, one Llama decoder layer at the
target's width (its own small KV cache) turns the sequence of fused inputs into predicted
features ``h_t`` of position ``t + 1``, and the target's final norm and LM head, restricted to a
frequency-ranked draft vocabulary (FR-Spec), turn ``h_t`` into logits of ``x_{t+2}``. The
target's embedding, final norm and LM head rows are borrowed, frozen, never stored in the head's
file; the file holds the fusion, the decoder layer and the draft vocabulary.

Drafting ``k`` tokens after a committed context ``x_0 .. x_{L-1}`` whose features
``f_0 .. f_{L-2}`` are known: the pairs ``(f_j, x_{j+1})`` for ``j < L - 1`` are real (the
target's features) and stay in the head's cache; the last one's output gives ``d_1``; then
``(h, d_1)``, ``(h', d_2)``, ... are fed with the head's own predicted features, and those
entries are dropped again at the next commit (``HeadCache.truncate``).

Dimensions: ``N`` rows (flat, ragged over sequences), ``D`` hidden size, ``H`` query heads,
``KV`` key/value heads, ``hd`` head_dim, ``I`` intermediate size, ``S`` draft vocabulary size,
``V`` the target's vocabulary size, ``B`` training windows of ``T`` positions.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hybridspec.errors import check
from hybridspec.model import BlockLinear, Kernel, quantize

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
    # Variants for heads trained elsewhere (``eagle_import``: EAGLE's own checkpoints):
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


def target_fingerprint(embed: torch.Tensor) -> str:
    """A short hash of a target's first embedding rows, rounded to bfloat16 (so that a target
    loaded in float32 or bfloat16, from any path, has the same one)."""
    rows = embed[:64].detach().to(torch.bfloat16).float().cpu().contiguous()
    return hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16]


class DraftHead(Protocol):
    """What the ``eagle`` proposer drafts with: ``EagleHead``, or a published EAGLE-3 head
    (``eagle_import.Eagle3Head``). One drafting step is ``x = fuse(features, next_ids)``,
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


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[..., 1, hd]`` at integer ``positions [...]`` for ``inv_freq [hd // 2]``."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope, rotate-half convention: ``x [..., heads, hd]``, ``cos, sin [..., 1, hd]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DecoderLayerHead(nn.Module):
    """What EAGLE-style heads share: a Llama decoder layer's q/k/v projection with rope, and
    its rest after attention (``wo``, the residual add, the MLP and its add). The subclass
    builds the modules named below; ``inv_freq`` is its rope's."""

    config: HeadConfig
    inv_freq: torch.Tensor
    wqkv: nn.Module
    wo: nn.Module
    mlp_norm: nn.Parameter
    w_gate_up: nn.Module
    w_down: nn.Module

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin ``[..., 1, hd]`` at integer ``positions [...]``."""
        return rope_cos_sin(self.inv_freq, positions, dtype)

    def project(
        self, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's input ``h`` -> q ``[..., H, hd]``, k, v ``[..., KV, hd]`` (rotated)."""
        c = self.config
        qkv = self.wqkv(h)
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        cos, sin = self.rope(positions, h.dtype)
        q = rotate(q.unflatten(-1, (c.num_heads, c.head_dim)), cos, sin)
        k = rotate(k.unflatten(-1, (c.num_kv_heads, c.head_dim)), cos, sin)
        return q, k, v.unflatten(-1, (c.num_kv_heads, c.head_dim))

    def layer_rest(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """``residual + wo(attended)``, then the MLP and its add: the layer's output."""
        c = self.config
        x = residual + self.wo(attended.flatten(-2))
        h = F.rms_norm(x, (c.hidden_size,), self.mlp_norm, c.rms_norm_eps)
        gate, up = self.w_gate_up(h).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


class EagleHead(DecoderLayerHead):
    """Fusion FC, one decoder layer, and logits over the draft vocabulary (module docstring)."""

    draft_vocab: torch.Tensor  # [S] int64: the target's ids of the draft vocabulary, sorted
    feature_layers: tuple[int, ...]  # ``HeadConfig.feature_layers``

    def __init__(self, config: HeadConfig, parts: TargetParts, draft_vocab: torch.Tensor) -> None:
        super().__init__()
        c = config
        check(
            tuple(parts.embed.shape) == (c.vocab_size, c.hidden_size),
            "target",
            f"a head for hidden size {c.hidden_size} and vocabulary {c.vocab_size} cannot run "
            f"on a target whose embedding is {tuple(parts.embed.shape)}",
        )
        check(
            tuple(draft_vocab.shape) == (c.draft_vocab_size,),
            "draft_vocab",
            f"expected {c.draft_vocab_size} token ids, got shape {tuple(draft_vocab.shape)}",
        )
        self.config = c
        d, q_width, kv_width = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.feature_layers = c.feature_layers
        # several layers' outputs side by side -> f_t [D]; None: the one layer's output is f_t
        self.feature_fc = (
            nn.Linear(len(c.feature_layers) * d, d, bias=False)
            if len(c.feature_layers) > 1
            else None
        )
        self.fc = nn.Linear(2 * d, d, bias=c.fc_bias)  # cat(embed(x_{t+1}), f_t) -> D
        self.input_norm = nn.Parameter(torch.ones(d)) if c.input_norm else None
        self.wqkv = nn.Linear(d, q_width + 2 * kv_width, bias=False)
        self.wo = nn.Linear(q_width, d, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.w_gate_up = nn.Linear(d, 2 * c.intermediate_size, bias=False)
        self.w_down = nn.Linear(c.intermediate_size, d, bias=False)
        self.register_buffer("draft_vocab", draft_vocab.long(), persistent=True)
        self.parts = parts
        self.draft_lm_head = parts.lm_head[draft_vocab.to(parts.lm_head.device)]  # [S, D]
        self.draft_lm: Int8DraftLinear | None = None  # its 8-bit form (``quantize_matmuls``)
        half = torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim
        self.inv_freq = 1.0 / (c.rope_theta**half)  # [hd // 2]

    # ------------------------------------------------------------------ pieces

    def fuse(self, features: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` features and the ids of the tokens after them -> fused inputs [..., D]."""
        embedded = F.embedding(next_token_ids, self.parts.embed)
        return self.fc(torch.cat((embedded, features.to(embedded.dtype)), dim=-1))

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused inputs ``[..., D]`` -> q ``[..., H, hd]``, k, v ``[..., KV, hd]`` (rotated)."""
        c = self.config
        h = x
        if self.input_norm is not None:
            h = F.rms_norm(x, (c.hidden_size,), self.input_norm, c.rms_norm_eps)
        return self.project(h, positions)

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's rest: ``x + wo(attended)``, then the MLP; predicted features [..., D]."""
        return self.layer_rest(x, attended)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary ``[..., S]`` of features ``[..., D]`` (the target's
        final norm, unless the features are normed already, and its LM head rows; for the
        target's own features, its logits there)."""
        h = features.to(self.draft_lm_head.dtype)
        if not self.config.normed_features:
            h = self.target_norm(h)
        if self.draft_lm is not None:
            return self.draft_lm(h)
        return F.linear(h, self.draft_lm_head)

    def target_norm(self, features: torch.Tensor) -> torch.Tensor:
        """The target's final RMSNorm of ``features [..., D]``."""
        c = self.config
        return F.rms_norm(features, (c.hidden_size,), self.parts.norm, c.rms_norm_eps)

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's inputs ``[..., D]`` from the target's outputs of ``feature_layers``
        ``[..., len(feature_layers), D]`` (before its final norm, as the runtime hands them):
        one layer's as they are (normed where the head reads normed features), several fused
        by ``feature_fc``."""
        if self.feature_fc is not None:
            return self.feature_fc(hidden.flatten(-2).to(self.draft_lm_head.dtype))
        one = hidden[..., 0, :]
        return self.target_norm(one) if self.config.normed_features else one

    # ---------------------------------------------------------------- training

    def unrolled(
        self, features: torch.Tensor, next_token_ids: torch.Tensor, num_steps: int
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
        c = self.config
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
            x = self.fuse(inputs, next_token_ids)  # [B, T, D]
            q, k, v = self.qkv(x, positions)
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
            outs.append(self.finish(x, attended.transpose(1, 2)))  # [B, T, D]
        return outs


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """``x [B, H, T, hd]`` moved ``by`` positions later along T (zeros first): row j = x[j-by]."""
    if by == 0:
        return x
    return torch.cat((torch.zeros_like(x[:, :, :by]), x[:, :, :-by]), dim=2)


# ------------------------------------------------------------------- drafting


class HeadCache:
    """The head's keys and values, one growing buffer per slot (a sequence being drafted for).

    ``truncate`` rolls a slot back; the entries kept are exactly those a fresh prefill of the
    same inputs would write (each row's keys and values depend on its own input alone).
    """

    def __init__(self, config: HeadConfig, dtype: torch.dtype, device: torch.device) -> None:
        self._shape = (config.num_kv_heads, config.head_dim)
        self._dtype, self._device = dtype, device
        self._keys: dict[int, torch.Tensor] = {}  # slot -> [capacity, KV, hd]
        self._values: dict[int, torch.Tensor] = {}
        self._lengths: dict[int, int] = {}
        self._next_slot = 0

    def allocate(self) -> int:
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        self._keys[slot] = torch.empty(64, *self._shape, dtype=self._dtype, device=self._device)
        self._values[slot] = torch.empty_like(self._keys[slot])
        self._lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self._keys.pop(slot, None)
        self._values.pop(slot, None)
        self._lengths.pop(slot, None)

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        assert 0 <= length <= self._lengths[slot], (length, self._lengths[slot])
        self._lengths[slot] = length

    def entries(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's keys and values ``[length, KV, hd]`` (views)."""
        n = self._lengths[slot]
        return self._keys[slot][:n], self._values[slot][:n]

    def append(
        self, slot: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[n, KV, hd]`` rows; the slot's whole keys and values after them."""
        start, n = self._lengths[slot], keys.shape[0]
        if start + n > self._keys[slot].shape[0]:
            capacity = max(2 * self._keys[slot].shape[0], start + n)
            for table in (self._keys, self._values):
                grown = torch.empty(capacity, *self._shape, dtype=self._dtype, device=self._device)
                grown[:start] = table[slot][:start]
                table[slot] = grown
        self._keys[slot][start : start + n] = keys
        self._values[slot][start : start + n] = values
        self._lengths[slot] = start + n
        return self.entries(slot)


def forward_cached(
    head: DraftHead,
    cache: HeadCache,
    slots: list[int],
    features: torch.Tensor,
    next_token_ids: torch.Tensor,
    num_rows: list[int],
) -> torch.Tensor:
    """Feed ``num_rows[i]`` pairs (feature, next token) to slot ``slots[i]``; predicted features.

    ``features [N, D]``, ``next_token_ids [N]``, flat in the order of ``slots``; returns
    ``[N, D]``. Each slot's new rows sit at positions ``cache.length(slot)`` onwards and attend
    to the slot's cached entries and, causally, to each other.
    """
    c = head.config
    rep = c.num_heads // c.num_kv_heads
    starts = [cache.length(slot) for slot in slots]
    positions = torch.cat(
        [torch.arange(s, s + n) for s, n in zip(starts, num_rows, strict=True)]
    ).to(features.device)
    x = head.fuse(features, next_token_ids)  # [N, D]
    q, k, v = head.qkv(x, positions)  # [N, H, hd], [N, KV, hd] x 2
    attended = torch.empty_like(q)
    row = 0
    for slot, start, n in zip(slots, starts, num_rows, strict=True):
        keys, values = cache.append(slot, k[row : row + n], v[row : row + n])
        mask = None
        if n > 1:  # row r sees entries <= start + r
            cols = torch.arange(start + n, device=x.device)
            mask = cols[None, :] <= (start + torch.arange(n, device=x.device))[:, None]
        attended[row : row + n] = F.scaled_dot_product_attention(
            q[row : row + n].transpose(0, 1),  # [H, n, hd]
            keys.transpose(0, 1).repeat_interleave(rep, dim=0),  # [H, L, hd]
            values.transpose(0, 1).repeat_interleave(rep, dim=0),
            attn_mask=mask,
        ).transpose(0, 1)
        row += n
    return head.finish(x, attended)


# --------------------------------------------------------------------- files


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
