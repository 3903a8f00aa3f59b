"""The draft head alone: drafting with its cache reproduces the training-time unroll, its
files round-trip, its configuration is checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridspec.model import block_kernel
from hybridspec.proposers.eagle import (
    HeadCache,
    HeadConfig,
    Int8DraftLinear,
    forward_cached,
    load_head,
    quantize_matmuls,
    save_head,
    target_parts,
)
from tests.engine.test_eagle import bf16_target
from tests.engine.tiny import tiny_loaded
from tests.proposers.eagle_helpers import random_head


@pytest.fixture(scope="module")
def head():  # type: ignore[no-untyped-def]
    return random_head(tiny_loaded(0), 48)


@pytest.mark.parametrize("position", [3, 6, 9])
def test_drafting_with_the_cache_matches_the_unrolled_steps(head, position: int) -> None:  # type: ignore[no-untyped-def]
    """Step s of ``unrolled`` at position j is what drafting computes there: the real pairs
    before it cached, then the head's own predictions fed back one by one."""
    torch.manual_seed(1)
    features, tokens = torch.randn(1, 12, 64), torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        outs = head.unrolled(features, tokens, 3)
        cache = HeadCache(head.config, torch.float32, torch.device("cpu"))
        slot = cache.allocate()
        step1 = forward_cached(head, cache, [slot], features[0], tokens[0], [12])
        torch.testing.assert_close(step1, outs[0][0])
        cache.truncate(slot, position)  # the real pairs before ``position``
        fed = outs[0][0, position - 1 : position]
        for step in (1, 2):
            fed = forward_cached(
                head, cache, [slot], fed, tokens[0, position + step - 1 : position + step], [1]
            )
            torch.testing.assert_close(fed[0], outs[step][0, position + step - 1])


def test_a_batch_drafts_each_sequence_as_alone(head) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(2)
    features, tokens = torch.randn(7, 64), torch.randint(0, 64, (7,))
    with torch.no_grad():
        cache = HeadCache(head.config, torch.float32, torch.device("cpu"))
        a, b = cache.allocate(), cache.allocate()
        together = forward_cached(head, cache, [a, b], features, tokens, [4, 3])
        alone = HeadCache(head.config, torch.float32, torch.device("cpu"))
        c = alone.allocate()
        torch.testing.assert_close(
            together[4:], forward_cached(head, alone, [c], features[4:], tokens[4:], [3])
        )
        torch.testing.assert_close(cache.entries(b)[0], alone.entries(c)[0])


def test_the_cache_grows_past_its_first_capacity(head) -> None:  # type: ignore[no-untyped-def]
    cache = HeadCache(head.config, torch.float32, torch.device("cpu"))
    slot = cache.allocate()
    with torch.no_grad():
        for _ in range(3):
            forward_cached(
                head, cache, [slot], torch.randn(50, 64), torch.zeros(50, dtype=torch.long), [50]
            )
    assert cache.length(slot) == 150
    cache.truncate(slot, 20)
    assert cache.entries(slot)[0].shape[0] == 20


def test_files_round_trip(head, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    save_head(head, tmp_path, dtype=torch.float32)
    loaded = load_head(tmp_path, target_parts(tiny_loaded(0)))
    assert loaded.config == head.config
    assert torch.equal(loaded.draft_vocab, head.draft_vocab)
    theirs = loaded.state_dict()
    for name, mine in head.state_dict().items():
        assert torch.equal(mine, theirs[name]), name


def test_a_head_for_another_width_is_refused(head, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    save_head(head, tmp_path)
    other = tiny_loaded(0)
    parts = target_parts(other)
    narrow = type(parts)(parts.embed[:, :32], parts.norm[:32], parts.lm_head[:, :32])
    with pytest.raises(ValueError, match="target"):
        load_head(tmp_path, narrow)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_kv_heads", 3),
        ("draft_vocab_size", 0),
        ("hidden_size", 0),
        ("format", "x"),
        ("feature_layers", ()),
        ("feature_layers", (2, 2)),
        ("feature_layers", ("2",)),
    ],
)
def test_bad_configs_raise_value_error_naming_the_field(head, field: str, value: object) -> None:  # type: ignore[no-untyped-def]
    data = {name: getattr(head.config, name) for name in HeadConfig.__dataclass_fields__}
    data[field] = value
    with pytest.raises(ValueError, match=field):
        HeadConfig(**data)
    with pytest.raises(ValueError, match="unknown"):
        HeadConfig.from_json('{"colour": 1}')


@pytest.mark.skipif(block_kernel() is None, reason="no C compiler")
def test_quantized_matmuls_draft_nearly_alike_and_leave_the_state_dict() -> None:
    """Drafting through 8-bit matmuls (``quantize_matmuls``): predictions within the 8-bit
    weights' and activations' error of the bfloat16 head's, the saved state unchanged."""
    head = random_head(bf16_target(), 48)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    torch.manual_seed(2)
    features, tokens = torch.randn(9, 64).bfloat16(), torch.randint(0, 64, (9,))

    def draft() -> tuple[torch.Tensor, torch.Tensor]:
        cache = HeadCache(head.config, torch.bfloat16, torch.device("cpu"))
        with torch.no_grad():
            out = forward_cached(head, cache, [cache.allocate()], features, tokens, [9])
            return out.float(), head.logits(out).float()

    dense_out, dense_logits = draft()
    kernel = block_kernel()
    assert kernel is not None
    quantize_matmuls(head, kernel)
    quantize_matmuls(head, kernel)  # a second call keeps the first's
    assert isinstance(head.fc, Int8DraftLinear) and isinstance(head.draft_lm, Int8DraftLinear)
    out, logits = draft()
    assert float((out - dense_out).norm() / dense_out.norm()) < 3e-2
    assert float((logits - dense_logits).norm() / dense_logits.norm()) < 3e-2
    assert (logits.argmax(-1) == dense_logits.argmax(-1)).float().mean() >= 0.75
    after = head.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())
