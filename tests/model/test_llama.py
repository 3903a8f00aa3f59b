"""The native Llama runtime against transformers, on tiny random models and the embedded model.

Tolerances: float32 logits agree with transformers to ~1e-5 here; 1e-4 leaves room for
different but equally valid summation orders (fused matmuls, chunked prefill).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hybridspec.errors import CapacityError
from hybridspec.model.gguf import read_gguf
from hybridspec.model.llama import LlamaRuntime
from hybridspec.model.llama_weights import LlamaWeights, native_support_problem
from hybridspec.model.loader import LoadedModel, embedded_model_path
from hybridspec.model.rope import rope_inv_freq
from hybridspec.model.runtime import ForwardBatch, ModelRuntime
from tests.conftest import LLAMA3_ROPE, TINY_VOCAB_SIZE, tiny_llama, tiny_llama_config

ATOL = 1e-4
VARIANTS: dict[str, dict[str, Any]] = {
    "gqa": {},
    "mha": {"num_key_value_heads": 4},
    "mqa-tied": {"num_key_value_heads": 1, "tie_word_embeddings": True},
    "llama3-rope": {"rope_parameters": LLAMA3_ROPE},
    "linear-rope-head-dim-32": {
        "head_dim": 32,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
    },
}


def native(
    model: LlamaForCausalLM,
    max_num_seqs: int = 4,
    max_seq_len: int = 128,
    prepack: bool = True,
    invariant_attention: bool | None = None,
) -> LlamaRuntime:
    weights = LlamaWeights.from_hf_state_dict(model.state_dict(), model.config, dtype=torch.float32)
    return LlamaRuntime(
        weights, max_num_seqs, max_seq_len, prepack=prepack, invariant_attention=invariant_attention
    )


def reference_logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


def prompt(length: int, seed: int = 1) -> list[int]:
    return torch.randint(
        0, TINY_VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def run_chunks(runtime: ModelRuntime, slot: int, chunks: list[list[int]]) -> torch.Tensor:
    return torch.cat([runtime.forward(ForwardBatch.from_lists([slot], [c])).logits for c in chunks])


@pytest.mark.parametrize("rope", ["default", "linear", "llama3"])
def test_rope_inv_freq_matches_transformers(rope: str) -> None:
    params = {
        "default": {"rope_type": "default", "rope_theta": 500.0},
        "linear": {"rope_type": "linear", "rope_theta": 500.0, "factor": 3.0},
        "llama3": LLAMA3_ROPE,
    }[rope]
    config = tiny_llama_config(rope_parameters=params)
    expected, scaling = (
        ROPE_INIT_FUNCTIONS[rope](config)
        if rope != "default"
        else (
            LlamaForCausalLM(config).model.rotary_emb.inv_freq,
            1.0,
        )
    )
    assert scaling == 1.0
    torch.testing.assert_close(rope_inv_freq(config), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("length", [1, 6, 45])
@pytest.mark.parametrize("prepack", [True, False], ids=["prepacked", "plain"])
def test_prefill_logits_match_transformers(variant: str, length: int, prepack: bool) -> None:
    model = tiny_llama(seed=3, **VARIANTS[variant])
    ids = prompt(length)
    runtime = native(model, prepack=prepack)
    logits = runtime.forward(ForwardBatch.from_lists([runtime.allocate()], [ids])).logits
    assert logits.dtype == torch.float32 and logits.shape == (length, TINY_VOCAB_SIZE)
    torch.testing.assert_close(logits, reference_logits(model, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["gqa", "llama3-rope", "mqa-tied"])
def test_chunked_prefill_then_decode_match_transformers(variant: str) -> None:
    model = tiny_llama(seed=4, **VARIANTS[variant])
    ids = prompt(60, seed=2)
    runtime = native(model)
    chunks = [ids[:17], ids[17:18], ids[18:27], *[[t] for t in ids[27:40]], ids[40:]]
    logits = run_chunks(runtime, runtime.allocate(), chunks)
    torch.testing.assert_close(logits, reference_logits(model, ids), atol=ATOL, rtol=0)


def test_logits_indices_select_rows() -> None:
    model = tiny_llama(seed=5)
    ids = prompt(12)
    runtime = native(model)
    batch = ForwardBatch.from_lists([runtime.allocate()], [ids], logits_indices=[11, 3, 3])
    logits = runtime.forward(batch).logits
    torch.testing.assert_close(logits, reference_logits(model, ids)[[11, 3, 3]], atol=ATOL, rtol=0)


@pytest.mark.parametrize("slot_ids", [(0, 1, 2), (1, 2, 4), (0, 1, 7)])
@pytest.mark.parametrize("new", [(5, 9, 1), (1, 3, 1), (5, 40, 1), (40, 35, 1)])
@pytest.mark.parametrize("invariant", [True, False], ids=["kernel", "sdpa"])
def test_a_batch_equals_each_sequence_alone(
    slot_ids: tuple[int, int, int], new: tuple[int, int, int], invariant: bool
) -> None:
    """Both attention paths: the row-invariant kernel and the SDPA reference."""
    model = tiny_llama(seed=6)
    seqs = [prompt(70, seed=s) for s in (7, 8, 9)]
    cached = [11, 0, 24]  # slot lengths before the batch; it adds ``new`` tokens to each
    alone = []
    for seq, c, n in zip(seqs, cached, new, strict=True):
        runtime = native(model, invariant_attention=invariant)
        slot = runtime.allocate()
        chunks = [seq[:c], seq[c : c + n]] if c else [seq[:n]]
        alone.append(run_chunks(runtime, slot, chunks)[-n:])
    runtime = native(model, max_num_seqs=8, invariant_attention=invariant)
    # Garbage (NaN) in never-written cache memory must not leak into any sequence's reads.
    runtime._cache.keys.fill_(float("nan"))
    runtime._cache.values.fill_(float("nan"))
    taken = [runtime.allocate() for _ in range(max(slot_ids) + 1)]
    for slot in taken:
        if slot not in slot_ids:
            runtime.free(slot)
    slots = list(slot_ids)
    for slot, seq, c in zip(slots, seqs, cached, strict=True):
        if c:
            runtime.forward(ForwardBatch.from_lists([slot], [seq[:c]]))
    order = [2, 0, 1]  # slots in the batch need not be sorted
    batch = ForwardBatch.from_lists(
        [slots[i] for i in order], [seqs[i][cached[i] : cached[i] + new[i]] for i in order]
    )
    logits = runtime.forward(batch).logits
    torch.testing.assert_close(logits, torch.cat([alone[i] for i in order]), atol=ATOL, rtol=0)
    assert [runtime.seq_len(s) for s in slots] == [c + n for c, n in zip(cached, new, strict=True)]


def test_rollback_matches_fresh_prefill_and_continues_identically() -> None:
    model = tiny_llama(seed=10, rope_parameters=LLAMA3_ROPE)
    ids = prompt(40, seed=11)
    runtime = native(model)
    slot, other = runtime.allocate(), runtime.allocate()
    runtime.forward(ForwardBatch.from_lists([slot], [ids[:20]]))
    runtime.forward(ForwardBatch.from_lists([slot, other], [[1, 2, 3, 4, 5, 6, 7, 8, 9], ids[:3]]))
    runtime.truncate(slot, 20)  # all 9 drafts rejected
    runtime.forward(ForwardBatch.from_lists([slot], [ids[20:26]]))
    runtime.truncate(slot, 23)  # 3 of 6 accepted
    assert runtime.seq_len(slot) == 23 and runtime.seq_len(other) == 3

    fresh = native(model)
    fresh_slot = fresh.allocate()
    fresh.forward(ForwardBatch.from_lists([fresh_slot], [ids[:23]]))
    got, want = runtime._cache, fresh._cache
    for layer in range(got.keys.shape[0]):
        torch.testing.assert_close(
            got.key_view(layer, slot, 23), want.key_view(layer, fresh_slot, 23), atol=1e-5, rtol=0
        )
    torch.testing.assert_close(
        got.values[:, slot, :, :23], want.values[:, fresh_slot, :, :23], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        run_chunks(runtime, slot, [ids[23:30], ids[30:31]]),
        run_chunks(fresh, fresh_slot, [ids[23:30], ids[30:31]]),
        atol=1e-5,
        rtol=0,
    )


def test_truncate_to_zero_and_free_reuse_slot_cleanly() -> None:
    model = tiny_llama(seed=12)
    ids = prompt(10, seed=13)
    runtime = native(model, max_num_seqs=1)
    slot = runtime.allocate()
    runtime.forward(ForwardBatch.from_lists([slot], [prompt(25, seed=14)]))
    runtime.truncate(slot, 0)
    torch.testing.assert_close(
        run_chunks(runtime, slot, [ids]), reference_logits(model, ids), atol=ATOL, rtol=0
    )
    runtime.free(slot)
    assert runtime.num_free_slots() == 1
    slot = runtime.allocate()
    assert runtime.seq_len(slot) == 0
    torch.testing.assert_close(
        run_chunks(runtime, slot, [ids]), reference_logits(model, ids), atol=ATOL, rtol=0
    )


def test_capacity_errors() -> None:
    runtime = native(tiny_llama(seed=0), max_num_seqs=2, max_seq_len=16)
    first, second = runtime.allocate(), runtime.allocate()
    assert runtime.num_free_slots() == 0
    with pytest.raises(CapacityError):
        runtime.allocate()
    runtime.forward(ForwardBatch.from_lists([first], [list(range(10))]))
    with pytest.raises(CapacityError, match="max_seq_len"):
        runtime.forward(ForwardBatch.from_lists([second, first], [[1], list(range(7))]))
    assert (runtime.seq_len(first), runtime.seq_len(second)) == (10, 0)  # nothing was written
    runtime.forward(ForwardBatch.from_lists([first], [list(range(6))]))  # exactly full is fine
    assert runtime.seq_len(first) == 16


@pytest.mark.parametrize(
    "make_batch",
    [
        pytest.param(lambda s: ForwardBatch.from_lists([s + 1], [[1]]), id="unallocated-slot"),
        pytest.param(lambda s: ForwardBatch.from_lists([s, s], [[1], [2]]), id="repeated-slot"),
        pytest.param(
            lambda s: ForwardBatch.from_lists([s], [[TINY_VOCAB_SIZE]]), id="token-id-too-big"
        ),
        pytest.param(lambda s: ForwardBatch.from_lists([s], [[-1]]), id="negative-token-id"),
        pytest.param(lambda s: ForwardBatch.from_lists([s], [[]]), id="no-new-tokens"),
        pytest.param(
            lambda s: ForwardBatch.from_lists([s], [[1, 2]], [2]), id="logits-index-out-of-range"
        ),
        pytest.param(lambda s: ForwardBatch.from_lists([], []), id="empty-batch"),
        pytest.param(
            lambda s: ForwardBatch(torch.tensor([s]), torch.tensor([1.0]), torch.tensor([0, 1])),
            id="float-token-ids",
        ),
        pytest.param(
            lambda s: ForwardBatch(torch.tensor([s]), torch.tensor([1, 2]), torch.tensor([0, 1])),
            id="cu-num-tokens-disagrees",
        ),
        pytest.param(
            lambda s: ForwardBatch(torch.tensor([s]), torch.tensor([1]), torch.tensor([1, 1])),
            id="cu-num-tokens-not-from-zero",
        ),
    ],
)
def test_bad_batch_raises_value_error(make_batch: Callable[[int], ForwardBatch]) -> None:
    runtime = native(tiny_llama(seed=0), max_num_seqs=3, max_seq_len=16)
    slot = runtime.allocate()
    with pytest.raises(ValueError):
        runtime.forward(make_batch(slot))
    assert runtime.seq_len(slot) == 0


def test_bad_slot_arguments_raise_value_error() -> None:
    runtime = native(tiny_llama(seed=0), max_num_seqs=2, max_seq_len=16)
    slot = runtime.allocate()
    runtime.forward(ForwardBatch.from_lists([slot], [[1, 2, 3]]))
    for bad_length in (4, -1, 1.5, True):
        with pytest.raises(ValueError, match="length"):
            runtime.truncate(slot, bad_length)  # type: ignore[arg-type]
    for bad_slot in (slot + 1, -1, 2, "0"):
        with pytest.raises(ValueError, match="slot"):
            runtime.seq_len(bad_slot)  # type: ignore[arg-type]
    runtime.free(slot)
    with pytest.raises(ValueError, match="slot"):
        runtime.free(slot)
    with pytest.raises(ValueError, match="max_num_seqs"):
        native(tiny_llama(seed=0), max_num_seqs=0)


def test_native_support_problem_names_the_reason() -> None:
    assert native_support_problem(tiny_llama_config()) is None
    assert "attention_bias" in (
        native_support_problem(tiny_llama_config(attention_bias=True)) or ""
    )
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 2.0,
        "original_max_position_embeddings": 64,
    }
    assert "yarn" in (native_support_problem(tiny_llama_config(rope_parameters=yarn)) or "")


def test_bfloat16_runtime_returns_float32_close_to_float32() -> None:
    model = tiny_llama(seed=15)
    ids = prompt(20, seed=16)
    weights = LlamaWeights.from_hf_state_dict(
        model.state_dict(), model.config, dtype=torch.bfloat16
    )
    runtime = LlamaRuntime(weights, 1, 64)
    logits = run_chunks(runtime, runtime.allocate(), [ids[:12], ids[12:]])
    assert logits.dtype == torch.float32
    reference = reference_logits(model, ids)
    assert (logits - reference).abs().max() < 0.1 * reference.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_runtime_matches_cpu() -> None:
    model = tiny_llama(seed=17)
    ids = prompt(20, seed=18)
    weights = LlamaWeights.from_hf_state_dict(
        model.state_dict(), model.config, dtype=torch.float32, device="cuda"
    )
    runtime = LlamaRuntime(weights, 2, 64)
    slots = [runtime.allocate(), runtime.allocate()]
    runtime.forward(ForwardBatch.from_lists(slots[:1], [ids[:10]]))
    logits = runtime.forward(ForwardBatch.from_lists(slots, [ids[10:], ids[:4]])).logits
    assert logits.device.type == "cuda"
    expected = reference_logits(model, ids)
    torch.testing.assert_close(
        logits.cpu(), torch.cat([expected[10:], expected[:4]]), atol=1e-3, rtol=0
    )


@pytest.mark.slow
def test_embedded_model_logits_match_transformers(embedded_float32: LoadedModel) -> None:
    gguf = read_gguf(embedded_model_path())
    reference = LlamaForCausalLM(gguf.config).eval()
    reference.load_state_dict(gguf.state_dict, strict=False)  # lm_head is tied to the embedding
    tokenizer = embedded_float32.tokenizer
    assert tokenizer is not None
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    runtime = embedded_float32.create_runtime(1, 128)
    slot = runtime.allocate()
    logits = run_chunks(runtime, slot, [ids[:-3], ids[-3:]])
    expected = reference_logits(reference, ids)
    torch.testing.assert_close(logits, expected, atol=5e-4, rtol=1e-4)  # logits reach ~40
    assert int(logits[-1].argmax()) == int(expected[-1].argmax())
