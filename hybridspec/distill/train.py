"""Training a draft head on the cached features (``data``): the loss, the held-out acceptance
estimate, the time-bounded, resumable loop.

Loss (EAGLE-3): at every drafting step of the training-time unroll (``EagleHead.unrolled``),
the cross-entropy of the head's distribution over the draft vocabulary against the target's
own distribution there (its final norm and LM head applied to the cached feature of the next
position), later steps weighted less. The acceptance estimate is greedy: the share of
held-out positions where the head's top token at step ``s`` equals the target's top token
over its whole vocabulary, which is what greedy verification keeps.

The cached features are the outputs of the head's ``feature_layers`` (``data``); the label's
feature is the last decoder layer's output, which is always among them (``label_column``).

Dimensions: ``B`` windows of ``T`` positions, ``L`` layers cached, ``D`` hidden size, ``S``
draft vocabulary.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridspec.distill.options import TrainOptions
from hybridspec.errors import InvalidRequestError
from hybridspec.model import LoadedModel
from hybridspec.proposers.eagle import EagleHead, HeadConfig, TargetParts, target_fingerprint

CHECKPOINT = "checkpoint.pt"
STEP_DECAY = 0.8  # weight of drafting step s: STEP_DECAY ** (s - 1)
WARMUP_STEPS = 30
TIMING_STEPS = 10  # steps timed to fix the run's length from its budget
CHECKPOINT_EVERY_S = 60.0
Sequence_ = tuple[torch.Tensor, torch.Tensor]  # tokens [n] int, features [n, L, D] bfloat16


def head_config(
    model: LoadedModel, draft_vocab_size: int, feature_layers: tuple[int, ...] = (-1,)
) -> HeadConfig:
    """A head of the target's width, heads and MLP size, for ``model``, reading the outputs
    of ``feature_layers``."""
    text = model.hf_config.get_text_config()
    num_heads = text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    parts = distill_parts(model, torch.float32)
    return HeadConfig(
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_heads=num_heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // num_heads,
        rms_norm_eps=float(text.rms_norm_eps),
        rope_theta=float(theta or getattr(text, "rope_theta", None) or 10000.0),
        vocab_size=int(parts.embed.shape[0]),
        draft_vocab_size=min(draft_vocab_size, int(parts.embed.shape[0])),
        target=model.source,
        target_fingerprint=target_fingerprint(parts.embed),
        feature_layers=feature_layers,
    )


def resolve_layers(layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """``layers`` as indices in ``[0, num_layers)`` (negative ones count from the last), a
    single ``-1`` kept as it is (the shipped heads' form); the last layer must be among them,
    for the label."""
    if layers == (-1,):
        return layers
    resolved = tuple(i + num_layers if i < 0 else i for i in layers)
    if any(not 0 <= i < num_layers for i in resolved) or len(set(resolved)) != len(resolved):
        raise InvalidRequestError(
            f"feature layers: expected distinct indices in [{-num_layers}, {num_layers}), "
            f"got {list(layers)}",
            "feature_layers",
        )
    if num_layers - 1 not in resolved:
        raise InvalidRequestError(
            f"feature layers: the last layer (-1 or {num_layers - 1}) must be among them, as "
            f"the label's feature; got {list(layers)}",
            "feature_layers",
        )
    return resolved


def label_column(layers: tuple[int, ...]) -> int:
    """Which of the cached ``layers`` (resolved, ``resolve_layers``) is the last one's."""
    return layers.index(-1) if -1 in layers else layers.index(max(layers))


def distill_parts(model: LoadedModel, dtype: torch.dtype, device: str = "cpu") -> TargetParts:
    """The target's embedding, final norm and LM head, frozen, in ``dtype`` for training."""
    from hybridspec.proposers.eagle import target_parts

    parts = target_parts(model)
    embed = parts.embed.to(device=device, dtype=dtype)
    lm_head = embed if parts.lm_head is parts.embed else parts.lm_head.to(device, dtype)
    norm = parts.norm.to(device=device, dtype=dtype)
    return TargetParts(embed, norm, lm_head, parts.final_softcap)


def draft_vocabulary(sequences: list[Sequence_], size: int, eos: tuple[int, ...]) -> torch.Tensor:
    """The ``size`` most frequent tokens of ``sequences`` (EOS first), sorted by id (FR-Spec)."""
    vocab_size = int(max(int(t.max()) for t, _ in sequences)) + 1
    counts = torch.zeros(max(vocab_size, max(eos) + 1), dtype=torch.long)
    for tokens, _ in sequences:
        counts += torch.bincount(tokens.long(), minlength=counts.numel())
    counts[list(eos)] = counts.max() + 1
    ranked = torch.argsort(counts, descending=True, stable=True)[:size]
    return torch.sort(ranked).values


def init_head(config: HeadConfig, parts: TargetParts, vocab: torch.Tensor) -> EagleHead:
    """A new head whose fusion starts by passing the feature through (and a little of the
    embedding), so that the untrained head predicts about what the target's feature says."""
    head = EagleHead(config, parts, vocab)
    d = config.hidden_size
    with torch.no_grad():
        head.fc.weight.normal_(0.0, 0.02)
        head.fc.weight[:, d:] += torch.eye(d)
        if head.feature_fc is not None:  # starts as the last layer's output alone
            last = label_column(config.feature_layers)
            head.feature_fc.weight.zero_()
            head.feature_fc.weight[:, last * d : (last + 1) * d] = torch.eye(d)
    return head


@dataclass(frozen=True, slots=True)
class Batch:
    features: torch.Tensor  # [B, T, L, D]: the cached layers' outputs
    next_token_ids: torch.Tensor  # [B, T]
    targets: torch.Tensor  # [B, T, D]: the feature of the next position
    mask: torch.Tensor  # [B, T] bool: real positions


def sample_batch(
    sequences: list[Sequence_], options: TrainOptions, rng: random.Random, label: int = 0
) -> Batch:
    """``B`` windows from random sequences (chosen by length), padded to ``T``."""
    weights = [max(0, t.numel() - 1) for t, _ in sequences]
    chosen = rng.choices(range(len(sequences)), weights=weights, k=options.batch_size)
    return windows([sequences[i] for i in chosen], options.window, rng, label)


def windows(
    picked: list[Sequence_], window: int, rng: random.Random | None, label: int = 0
) -> Batch:
    """One window of ``window`` pairs per sequence, padded: at a random start with ``rng``,
    else each sequence's last (held-out evaluation): an answer's last window is the target's
    own text, where its first is mostly the chat template that every answer shares, which the
    head learns by heart and which would inflate the estimate. ``label``: the column of the
    cached layers that is the last layer's (``label_column``)."""
    layers, d = picked[0][1].shape[1:]
    b = len(picked)
    features = torch.zeros(b, window, layers, d)
    targets = torch.zeros(b, window, d)
    tokens = torch.zeros(b, window, dtype=torch.long)
    mask = torch.zeros(b, window, dtype=torch.bool)
    for row, (ids, feats) in enumerate(picked):
        pairs = ids.numel() - 1
        last = max(0, pairs - window)
        start = rng.randint(0, last) if rng is not None else last
        n = min(window, pairs - start)
        features[row, :n] = feats[start : start + n].float()
        targets[row, :n] = feats[start + 1 : start + n + 1, label].float()
        tokens[row, :n] = ids[start + 1 : start + n + 1].long()
        mask[row, :n] = True
    return Batch(features, tokens, targets, mask)


def step_losses(head: EagleHead, batch: Batch, num_steps: int) -> list[torch.Tensor]:
    """Each unrolled step's soft cross-entropy against the target, over its valid positions."""
    with torch.no_grad():
        target_probs = torch.softmax(head.logits(batch.targets).float(), dim=-1)  # [B, T, S]
    features = head.target_features(batch.features)  # [B, T, D]
    outs = head.unrolled(features, batch.next_token_ids, num_steps)
    losses = []
    for step, out in enumerate(outs):
        log_q = F.log_softmax(head.logits(out).float(), dim=-1)
        ce = -(target_probs * log_q).sum(-1)  # [B, T]
        mask = batch.mask.clone()
        mask[:, :step] = False  # no drafting history there (EagleHead.unrolled)
        losses.append((ce * mask).sum() / mask.sum().clamp(min=1))
    return losses


@torch.no_grad()
def acceptance(
    head: EagleHead, batch: Batch, target_top: torch.Tensor, num_steps: int
) -> list[float]:
    """Greedy acceptance estimate per drafting step: head top == target top (``[B, T]``)."""
    features = head.target_features(batch.features)
    outs = head.unrolled(features, batch.next_token_ids, num_steps)
    rates = []
    for step, out in enumerate(outs):
        top = head.draft_vocab[head.logits(out).argmax(-1)]
        mask = batch.mask.clone()
        mask[:, :step] = False
        rates.append(float(((top == target_top) & mask).sum()) / max(1, int(mask.sum())))
    return rates


def target_top(parts: TargetParts, batch: Batch, eps: float) -> torch.Tensor:
    """The target's top token over its whole vocabulary at each next position: ``[B, T]``."""
    h = F.rms_norm(batch.targets, (batch.targets.shape[-1],), parts.norm.float(), eps)
    tops = [F.linear(row, parts.lm_head).argmax(-1) for row in h.to(parts.lm_head.dtype)]
    return torch.stack(tops)


def mean_accepted_length(rates: list[float], k: int) -> float:
    """Committed tokens per round with ``k`` drafts if step ``s`` is kept with ``rates[s]``
    given the earlier ones (later steps as the last measured), bonus token included."""
    total, chain = 1.0, 1.0
    for s in range(k):
        chain *= rates[min(s, len(rates) - 1)]
        total += chain
    return total


@dataclass(slots=True)
class TrainState:
    step: int = 0
    total_steps: int | None = None
    elapsed_s: float = 0.0
    last_loss: float = math.nan


def save_checkpoint(
    path: Path,
    head: EagleHead,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    rng: random.Random,
) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "head": head.state_dict(),
            "optimizer": optimizer.state_dict(),
            "state": (state.step, state.total_steps, state.elapsed_s, state.last_loss),
            "rng": rng.getstate(),
            "torch_rng": torch.get_rng_state(),
        },
        tmp,
    )
    tmp.replace(path)


def load_checkpoint(
    path: Path, head: EagleHead, optimizer: torch.optim.Optimizer, rng: random.Random
) -> TrainState:
    saved = torch.load(path, weights_only=False)
    head.load_state_dict(saved["head"])
    optimizer.load_state_dict(saved["optimizer"])
    rng.setstate(saved["rng"])
    torch.set_rng_state(saved["torch_rng"])
    return TrainState(*saved["state"])


def learning_rate(options: TrainOptions, state: TrainState) -> float:
    """Linear warm-up, then cosine decay to a tenth over the run's steps."""
    if state.step < WARMUP_STEPS:
        return options.lr * (state.step + 1) / WARMUP_STEPS
    total = state.total_steps or (state.step + 1)
    progress = min(1.0, (state.step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS))
    return options.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    head: EagleHead,
    train_seqs: list[Sequence_],
    options: TrainOptions,
    work: Path,
    on_step: Callable[[TrainState], None],
) -> TrainState:
    """Train ``head`` until its budget (or ``max_steps``) is spent; resumes from ``work``."""
    rng = random.Random(options.seed)
    optimizer = torch.optim.AdamW(
        [p for p in head.parameters() if p.requires_grad], lr=options.lr, weight_decay=0.0
    )
    work.mkdir(parents=True, exist_ok=True)
    path = work / CHECKPOINT
    state = load_checkpoint(path, head, optimizer, rng) if path.is_file() else TrainState()
    if options.max_steps is not None:
        state.total_steps = options.max_steps
    device = torch.device(options.device)
    label = label_column(head.feature_layers)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=options.bfloat16)
    last_save = time.monotonic()
    while state.total_steps is None or state.step < state.total_steps:
        if options.max_steps is None and state.elapsed_s >= options.budget_s:
            break
        start = time.monotonic()
        batch = to_device(sample_batch(train_seqs, options, rng, label), device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(options, state)
        with autocast:
            losses = step_losses(head, batch, options.num_steps)
        loss = sum(STEP_DECAY**s * loss for s, loss in enumerate(losses))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        state.step += 1
        state.elapsed_s += time.monotonic() - start
        state.last_loss = float(losses[0].detach())
        if state.total_steps is None and state.step == WARMUP_STEPS + TIMING_STEPS:
            per_step = state.elapsed_s / state.step
            state.total_steps = max(state.step + 1, int(options.budget_s / per_step))
        on_step(state)
        if time.monotonic() - last_save >= CHECKPOINT_EVERY_S:
            save_checkpoint(path, head, optimizer, state, rng)
            last_save = time.monotonic()
    save_checkpoint(path, head, optimizer, state, rng)
    return state


def to_device(batch: Batch, device: torch.device | str) -> Batch:
    """``batch`` on ``device`` (itself on the CPU, where windows are cut)."""
    if torch.device(device).type == "cpu":
        return batch
    fields = (batch.features, batch.next_token_ids, batch.targets, batch.mask)
    return Batch(*(t.to(device) for t in fields))
