"""The quantized runtime: int4-kernel matmuls against the dequantized float32 reference, row
invariance, GGUF blocks kept through loading and the weight cache, and greedy parity of every
proposer alone and in mixed batches with a quantized target."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType

from hybridspec import DraftConfig, Engine, EngineConfig, GenerationParams, ModelConfig
from hybridspec.errors import ModelLoadError
from hybridspec.model import LlamaWeights, load_model, qgemm
from hybridspec.model import loader as loader_module
from hybridspec.model.gguf_rows import MappedRows
from hybridspec.model.llama import LlamaRuntime
from hybridspec.model.loader import resolve_quantize
from hybridspec.model.quant import PackedWeight, QuantizedWeight, quantize
from hybridspec.model.quant_linear import Int4Linear, Int8Linear, quantized_linear
from hybridspec.model.runtime import ForwardBatch
from tests.conftest import tiny_llama
from tests.engine.tiny import PROMPTS, VOCAB, tiny_loaded
from tests.model.test_invariance import (
    assert_logits_alike_decoded_verified_and_batched,
    assert_rows_alike,
)
from tests.model.test_loader import write_tiny_gguf


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HYBRIDSPEC_CACHE_DIR", str(tmp_path / "cache"))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize(("bits", "rows"), [(4, 96), (4, 40), (8, 96), (8, 40)])  # 40: padded
def test_quantized_matmul_matches_the_dequantized_float32_reference(bits: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = quantize(torch.randn(rows, 128, generator=gen) * 0.05, bits)
    linear = quantized_linear(weight)
    assert isinstance(linear, Int4Linear if bits == 4 else Int8Linear)
    x = torch.randn(7, 128, generator=gen).to(torch.bfloat16)
    want = x.float() @ weight.dequantize().T
    got = linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (7, rows)
    # bfloat16 inputs, scales and output: a few bfloat16 steps of the largest output
    assert relative_error(got, want) < 2e-2


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_matmul_computes_a_row_alike_alone_and_among_others(bits: int) -> None:
    gen = torch.Generator().manual_seed(1)
    linear = quantized_linear(quantize(torch.randn(576, 1536, generator=gen), bits))
    assert_rows_alike(linear, 1536, gen)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_logits_do_not_depend_on_drafts_or_batch(bits: int) -> None:
    runtime = tiny_loaded(0, quantize_bits=bits).create_runtime(4, 256)
    ids = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    assert_logits_alike_decoded_verified_and_batched(runtime, ids)


@pytest.fixture(scope="module")
def quantized_engine() -> Engine:
    target = tiny_loaded(0, quantize_bits=4)
    draft = tiny_loaded(0, noise_from=target, quantize_bits=4)
    config = EngineConfig(
        target=ModelConfig(dtype="bfloat16", max_seq_len=256, max_num_seqs=8),
        draft=DraftConfig(cost_per_token=0.0),  # priced as free, so that it drafts at all
        measure_proposer_costs=False,  # drafts that never depend on timing
    )
    return Engine(config, target=target, draft=draft)


SETUPS = [("none", None), ("ngram", 4), ("ngram", 8), ("draft", 3), ("draft", 6)]


def test_greedy_text_of_every_proposer_equals_plain_decoding_alone_and_batched(
    quantized_engine: Engine,
) -> None:
    engine = quantized_engine
    expected = [
        engine.generate(prompt_token_ids=p, proposer="none", max_new_tokens=30).token_ids
        for p in PROMPTS
    ]
    accepted = 0
    for name, k in SETUPS[1:]:
        for prompt, want in zip(PROMPTS, expected, strict=True):
            result = engine.generate(
                prompt_token_ids=prompt, proposer=name, num_speculative_tokens=k, max_new_tokens=30
            )
            assert result.token_ids == want, (name, k, prompt)
            accepted += result.stats.draft_tokens_accepted
    assert accepted > 0
    # all prompts at once, each with another proposer, in mixed batches
    ids: dict[str, int] = {}
    results: dict[int, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        name, k = SETUPS[(i + 1) % len(SETUPS)]
        params = GenerationParams(max_new_tokens=30, proposer=name, num_speculative_tokens=k)
        ids[engine.add_request(prompt, params)] = i
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                assert output.result is not None
                results[ids[output.request_id]] = output.result.token_ids
    assert [results[i] for i in range(len(PROMPTS))] == expected


def unpacked(matrix: object) -> QuantizedWeight:
    if isinstance(matrix, PackedWeight):
        return matrix.unpack()
    assert isinstance(matrix, QuantizedWeight)
    return matrix


@pytest.mark.parametrize(
    "qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]
)
def test_a_gguf_file_keeps_its_blocks_through_loading_and_the_cache(
    qtype: GGMLQuantizationType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(seed=1), qtype=qtype)
    config = ModelConfig(str(path), quantize="gguf")
    loaded = load_model(config)
    weights = loaded.weights
    # held in the block kernel's tiles where it builds, else as decoded blocks
    held = PackedWeight if qgemm.kernel() is not None else QuantizedWeight
    assert isinstance(weights, LlamaWeights) and isinstance(weights.layers[0].w_down, held)
    dense = load_model(ModelConfig(str(path), dtype="float32")).weights
    assert isinstance(dense, LlamaWeights)
    # the quantized matrices dequantize to what the dense load computed from the same blocks
    for got, want in (
        (weights.layers[1].wqkv, dense.layers[1].wqkv),
        (weights.lm_head, dense.lm_head),
    ):
        assert isinstance(got, held)
        assert torch.equal(unpacked(got).dequantize(), want)

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached weights should have been used")

    if held is QuantizedWeight:  # decoded in numpy: a restart reads the weight cache
        monkeypatch.setattr("hybridspec.model.gguf_load.read_gguf", fail)
    cached = load_model(config).weights  # else packed in place again, the same bytes
    assert isinstance(cached, LlamaWeights)
    matrices = [(cached.layers[0].wo, weights.layers[0].wo)]
    if isinstance(weights.embed, MappedRows):  # untied, of a type pack.c decodes: in the file
        assert isinstance(cached.embed, MappedRows) and held is PackedWeight
        every = torch.arange(weights.dims.vocab_size)
        assert torch.equal(cached.embed.rows(every), weights.embed.rows(every))
    else:
        matrices.append((cached.embed, weights.embed))
    for got, want in matrices:
        assert isinstance(got, held) and isinstance(want, held)
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
    ids = [[3, 1, 4, 1, 5, 9, 2, 6]]
    runtime, fresh = loaded.create_runtime(1, 64), load_model(config).create_runtime(1, 64)
    for rt in (runtime, fresh):
        rt.allocate()
    logits = runtime.forward(ForwardBatch.from_lists([0], ids)).logits
    assert torch.equal(logits, fresh.forward(ForwardBatch.from_lists([0], ids)).logits)
    reference = load_model(ModelConfig(str(path), dtype="float32")).create_runtime(1, 64)
    reference.allocate()
    want = reference.forward(ForwardBatch.from_lists([0], ids)).logits
    assert relative_error(logits, want) < 5e-2


@pytest.mark.parametrize(
    ("native_bf16", "isa", "want"),
    [
        (True, "avx512vnni", "gguf"),
        (False, "avx2", "gguf"),  # the vector dots run without native bfloat16 (an AVX2 CPU)
        (True, "portable", "gguf"),
        (False, "portable", "none"),  # neither: dequantized, as torch runs it
        (False, None, "none"),  # no kernel
    ],
)
def test_auto_keeps_blocks_where_the_kernel_has_vector_dots_or_bf16_is_native(
    monkeypatch: pytest.MonkeyPatch, native_bf16: bool, isa: str | None, want: str
) -> None:
    fake = SimpleNamespace(isa=isa)  # what ``resolve_quantize`` reads of a kernel
    monkeypatch.setattr(loader_module, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(qgemm, "kernel", lambda: None if isa is None else fake)
    cpu = torch.device("cpu")
    assert resolve_quantize("auto", "auto", cpu, True) == want
    assert resolve_quantize("auto", "bfloat16", cpu, True) == want
    assert resolve_quantize("auto", "auto", cpu, False) == "none"  # not a GGUF file
    assert resolve_quantize("auto", "auto", torch.device("cuda"), True) == "none"


def test_quantize_resolution_and_refusals() -> None:
    cpu = torch.device("cpu")
    assert resolve_quantize("none", "float32", cpu, True) == "none"
    assert resolve_quantize("auto", "float32", cpu, True) == "none"  # the kernel is bf16 only
    assert resolve_quantize("auto", "bfloat16", cpu, False) == "none"  # nothing to keep
    assert resolve_quantize("int4", "auto", cpu, False) == "int4"
    with pytest.raises(ModelLoadError, match="bfloat16"):
        resolve_quantize("int8", "float32", cpu, True)
    with pytest.raises(ModelLoadError, match="GGUF"):
        resolve_quantize("gguf", "bfloat16", cpu, False)
    with pytest.raises(ValueError, match="quantize"):
        ModelConfig(quantize="int3")
    weights = tiny_loaded(0, quantize_bits=4).weights
    assert isinstance(weights, LlamaWeights)
    float_weights = LlamaWeights(
        weights.dims,
        weights.embed,
        weights.layers,
        weights.norm.float(),
        weights.lm_head,
        weights.inv_freq,
    )
    with pytest.raises(ValueError, match="bfloat16"):
        LlamaRuntime(float_weights, 1, 16)
