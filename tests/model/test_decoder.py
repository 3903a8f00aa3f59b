"""Each decoder layer's path, chosen once when the runtime is built: the block kernel's fused
calls where the family adds nothing between their parts, its unfused calls around what a family
adds, torch's rope and attention where q/k/v is dense or the attention is SDPA."""

from __future__ import annotations

import dataclasses
import threading

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
from hybridspec.model.runtime import ForwardBatch, ForwardOutput
from tests.conftest import TINY_VOCAB_SIZE, tiny_llama
from tests.model.tiny_families import tiny_family


def runtime_of(family: str, bits: int | None, invariant: bool = True) -> LlamaRuntime:
    model = tiny_llama(0) if family == "llama" else tiny_family(family, seed=0)
    weights = LlamaWeights.from_hf_state_dict(
        model.state_dict(), model.config, dtype=torch.bfloat16, quantize_bits=bits
    )
    return LlamaRuntime(weights, 1, 32, invariant_attention=invariant)


def paths(family: str, bits: int | None, invariant: bool = True) -> set[tuple[type, type]]:
    """The (attention input, after attention) step types of every layer of a tiny model."""
    runtime = runtime_of(family, bits, invariant)
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


@pytest.mark.skipif(kernel() is None, reason="no C compiler")
def test_only_a_stack_whose_every_layer_fuses_runs_in_one_kernel_call() -> None:
    assert runtime_of("llama", 8)._stack.fused is not None
    for family in ("qwen2", "gemma2"):  # a layer with a step of its family's between calls
        assert runtime_of(family, 8)._stack.fused is None
    assert runtime_of("llama", None)._stack.fused is None  # dense: torch's layers
    assert runtime_of("llama", 8, invariant=False)._stack.fused is None  # SDPA


def forwards(runtime: LlamaRuntime) -> list[ForwardOutput]:
    """Prompts, a batch of spans with hidden states asked out of order (one twice), decodes,
    through one runtime; the decodes on a thread of their own, whose kernel scratch starts
    empty: the first layer's window needs little, the second's whole history more."""
    gen = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(0, TINY_VOCAB_SIZE, (n,), generator=gen).tolist()

    a, b, c = (runtime.allocate() for _ in range(3))
    prompts = [
        ForwardBatch.from_lists([a], [ids(3)]),
        ForwardBatch.from_lists([b, c], [ids(40), ids(100)]),
        ForwardBatch.from_lists([a, b, c], [ids(5), ids(1), ids(9)], hidden_layers=(1, 0, 1)),
    ]
    decodes = [
        ForwardBatch.from_lists([c], [ids(1)], hidden_layers=(-1,)),
        ForwardBatch.from_lists([c, a], [ids(1), ids(1)], logits_indices=[1]),
    ]
    outputs = [runtime.forward(batch) for batch in prompts]
    thread = threading.Thread(target=lambda: outputs.extend(map(runtime.forward, decodes)))
    thread.start()
    thread.join()
    assert len(outputs) == len(prompts) + len(decodes)
    return outputs


@pytest.mark.skipif(kernel() is None, reason="no C compiler")
@pytest.mark.parametrize("windows", [(), (6, 0)])
def test_the_stack_in_one_kernel_call_equals_its_layers_called_one_by_one(
    windows: tuple[int, ...],
) -> None:
    """Logits, hidden states and every key and value stored, to the bit, with the scratch
    grown from nothing in the middle of a stack (a windowed first layer needs less of it)."""
    model = tiny_llama(0)
    weights = LlamaWeights.from_hf_state_dict(
        model.state_dict(), model.config, dtype=torch.bfloat16, quantize_bits=4
    )
    weights = dataclasses.replace(
        weights, dims=dataclasses.replace(weights.dims, layer_windows=windows)
    )
    fused, layers = LlamaRuntime(weights, 3, 128), LlamaRuntime(weights, 3, 128)
    assert fused._stack.fused is not None
    object.__setattr__(layers._stack, "fused", None)
    want, got = forwards(layers), forwards(fused)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w.logits, g.logits)
        assert (w.hidden_states is None) == (g.hidden_states is None)
        if w.hidden_states is not None:
            assert g.hidden_states is not None and torch.equal(w.hidden_states, g.hidden_states)
    assert torch.equal(fused._cache.keys, layers._cache.keys)
    assert torch.equal(fused._cache.values, layers._cache.values)
