"""Each decoder layer's path, chosen once when the runtime is built: the block kernel's fused
calls where the family adds nothing between their parts, its unfused calls around what a family
adds, torch's rope and attention where q/k/v is dense or the attention is SDPA."""

from __future__ import annotations

import pytest
import torch

from hybridspec.model.decoder import (
    FusedAttentionIn,
    FusedMlpBlock,
    StoredAttentionIn,
    TorchAttentionIn,
    UnfusedMlpBlock,
)
from hybridspec.model.llama import LlamaRuntime
from hybridspec.model.llama_weights import LlamaWeights
from hybridspec.model.qgemm import kernel
from tests.conftest import tiny_llama
from tests.model.tiny_families import tiny_family


def paths(family: str, bits: int | None, invariant: bool = True) -> set[tuple[type, type]]:
    """The (attention input, after attention) step types of every layer of a tiny model."""
    model = tiny_llama(0) if family == "llama" else tiny_family(family, seed=0)
    weights = LlamaWeights.from_hf_state_dict(
        model.state_dict(), model.config, dtype=torch.bfloat16, quantize_bits=bits
    )
    runtime = LlamaRuntime(weights, 1, 32, invariant_attention=invariant)
    return {(type(x.attention_in), type(x.after_attention)) for x in runtime._stack.layers}


@pytest.mark.skipif(kernel() is None, reason="no C compiler")
@pytest.mark.parametrize(
    ("family", "want"),
    [
        ("llama", (FusedAttentionIn, FusedMlpBlock)),  # two calls and the attention a layer
        ("qwen2", (StoredAttentionIn, FusedMlpBlock)),  # q/k/v biases before rope
        ("qwen3", (StoredAttentionIn, FusedMlpBlock)),  # q and k normed before rope
        ("gemma2", (FusedAttentionIn, UnfusedMlpBlock)),  # post-norms and GeGLU
        ("gemma3", (StoredAttentionIn, UnfusedMlpBlock)),
    ],
)
def test_a_quantized_model_runs_each_layer_in_the_kernel_as_far_as_its_family_allows(
    family: str, want: tuple[type, type]
) -> None:
    assert paths(family, 8) == {want}


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_dense_weights_or_sdpa_attention_take_torchs_rope(family: str) -> None:
    assert paths(family, None) == {(TorchAttentionIn, UnfusedMlpBlock)}
    if kernel() is not None:  # quantized beside SDPA: the kernel's matmuls, torch's rope
        after = FusedMlpBlock if family == "llama" else UnfusedMlpBlock
        assert paths(family, 8, invariant=False) == {(TorchAttentionIn, after)}
