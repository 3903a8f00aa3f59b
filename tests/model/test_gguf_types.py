"""A GGUF file mixing every supported block type, as K-quant "mix" files do: loaded with the
default settings onto its own blocks, close to its dense values, greedy text identical across
proposers alone and batched; an unsupported type refused by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from hybridspec import Engine, EngineConfig, GenerationParams, ModelConfig
from hybridspec.config import DraftConfig
from hybridspec.errors import ModelLoadError
from hybridspec.model import qgemm
from hybridspec.model.gguf_blocks import GGUF_TYPES
from hybridspec.model.loader import LoadedModel, load_model
from hybridspec.model.quant import PackedWeight
from hybridspec.model.runtime import ForwardBatch
from tests.conftest import tiny_llama
from tests.model.test_loader import write_tiny_gguf
from tests.model.test_quant import F16_FIELDS, random_raw

pytestmark = pytest.mark.skipif(qgemm.kernel() is None, reason="no C compiler")

# GGUF name -> type: layer 0 as a Q4_K_M file mixes K-quants (v and down as Q6_K), layer 1
# the 32-blocks, the IQ4 types and one F16 matrix among quantized ones; a tied Q6_K embedding
LAYOUT = {
    "token_embd.weight": "Q6_K",
    "blk.0.attn_q.weight": "Q4_K",
    "blk.0.attn_k.weight": "Q4_K",
    "blk.0.attn_v.weight": "Q6_K",
    "blk.0.attn_output.weight": "Q5_K",
    "blk.0.ffn_gate.weight": "Q2_K",
    "blk.0.ffn_up.weight": "Q3_K",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_q.weight": "Q4_0",
    "blk.1.attn_k.weight": "Q5_0",
    "blk.1.attn_v.weight": "Q8_0",
    "blk.1.attn_output.weight": "IQ4_NL",
    "blk.1.ffn_gate.weight": "Q5_1",
    "blk.1.ffn_up.weight": "IQ4_XS",
    "blk.1.ffn_down.weight": "F16",
}
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "tie_word_embeddings": True}
PROMPT = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100] * 3


def scaled_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks whose values have about the spread of a trained matrix (1 / sqrt(K)):
    every float16 factor of a block scaled alike."""
    raw = random_raw(kind, rows, cols, seed)
    spread = float(np.std(dequantize(raw, GGMLQuantizationType[kind])))
    blocks = raw.reshape(-1, GGUF_TYPES[kind][1])
    for at in F16_FIELDS[kind]:
        factor = blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)
        factor *= 1.0 / (cols**0.5 * spread)
        blocks[:, at : at + 2] = factor.astype(np.float16).view(np.uint8)
    return blocks.reshape(raw.shape)


def write_mixed_file(path: Path, layout: dict[str, str]) -> Path:
    model = tiny_llama(0, **SHAPE)
    blocks = {}
    for seed, (name, kind) in enumerate(layout.items()):
        if kind in ("F16", "F32"):
            continue
        rows, cols = _shape(model.config, name)
        raw = scaled_blocks(kind, rows, cols, seed) if kind in GGUF_TYPES else np.zeros(0)
        if kind not in GGUF_TYPES:  # a type this project does not hold: any bytes will do
            size = GGMLQuantizationType[kind]
            raw = np.random.default_rng(seed).integers(0, 256, (rows, _row_bytes(size, cols)))
            raw = raw.astype(np.uint8)
        blocks[name] = (raw, GGMLQuantizationType[kind])
    return write_tiny_gguf(path, model, qtype=GGMLQuantizationType.F16, blocks=blocks)


def _row_bytes(kind: GGMLQuantizationType, cols: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    per_block, block_bytes = GGML_QUANT_SIZES[kind]
    return cols // per_block * block_bytes


def _shape(config: object, name: str) -> tuple[int, int]:
    d, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    kv = 2 * d // 4  # 2 of 4 heads
    kind = name.split(".")[-2]
    return {
        "token_embd": (int(config.vocab_size), d),  # type: ignore[attr-defined]
        "attn_q": (d, d),
        "attn_k": (kv, d),
        "attn_v": (kv, d),
        "attn_output": (d, d),
        "ffn_gate": (inter, d),
        "ffn_up": (inter, d),
        "ffn_down": (d, inter),
    }[kind]


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One cache for the module: the file's tokenizer is converted once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYBRIDSPEC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mixed_file(tmp_path_factory.mktemp("gguf") / "mixed.gguf", LAYOUT)


def last_logits(model: LoadedModel) -> torch.Tensor:
    runtime = model.create_runtime(1, 128)
    return runtime.forward(ForwardBatch.from_lists([runtime.allocate()], [PROMPT])).logits[-1]


def test_every_type_loads_onto_its_blocks_with_the_default_settings(mixed_file: Path) -> None:
    model = load_model(ModelConfig(name_or_path=str(mixed_file)))
    weights = model.weights
    layer0, layer1 = weights.layers  # type: ignore[union-attr]
    assert weights.embed is weights.lm_head  # type: ignore[union-attr]
    held = [weights.embed, layer0.wqkv, layer0.wo, layer0.w_gate_up, layer0.w_down]  # type: ignore[union-attr]
    held += [layer1.wqkv, layer1.wo, layer1.w_gate_up]
    assert all(isinstance(m, PackedWeight) for m in held)  # in the kernel's tiles, once
    assert isinstance(layer1.w_down, torch.Tensor)  # F16 stays dense
    assert (layer0.wqkv.bits, layer0.wqkv.group) == (6, 16)  # Q4_K q, k beside a Q6_K v: 6 bits
    assert (layer0.w_gate_up.bits, layer0.w_gate_up.group) == (4, 16)  # Q2_K and Q3_K
    dense = load_model(ModelConfig(name_or_path=str(mixed_file), quantize="none", dtype="float32"))
    runtime = model.create_runtime(1, 128)
    assert runtime._lm_head.linear.weight is weights.embed  # type: ignore[union-attr]  # no copy
    want, got = last_logits(dense), last_logits(model)
    assert float((got - want).norm() / want.norm()) < 0.05  # 8-bit activations, bfloat16
    cached = load_model(ModelConfig(name_or_path=str(mixed_file)))  # from the weight cache
    assert torch.equal(last_logits(cached), got)


def test_greedy_text_is_identical_across_proposers_alone_and_batched(mixed_file: Path) -> None:
    source = ModelConfig(name_or_path=str(mixed_file), max_seq_len=96, max_num_seqs=3)
    engine = Engine(
        EngineConfig(target=source, draft=DraftConfig(model=source, cost_per_token=0.2))
    )
    texts = {}
    for proposer in ("none", "ngram", "draft"):
        params = GenerationParams.create(max_new_tokens=24, proposer=proposer)
        texts[proposer] = engine.generate(prompt_token_ids=PROMPT, params=params).token_ids
    assert texts["ngram"] == texts["none"] and texts["draft"] == texts["none"]
    other = [101, 32, 97] * 4
    ids = {
        engine.add_request(PROMPT, GenerationParams.create(max_new_tokens=24, proposer=p)): p
        for p in ("ngram", "draft")
    }
    ids[engine.add_request(other, GenerationParams.create(max_new_tokens=24))] = "other"
    batched = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.result is not None:
                batched[ids[output.request_id]] = output.result.token_ids
    assert batched["ngram"] == texts["none"] and batched["draft"] == texts["none"]


def test_an_unsupported_type_is_refused_naming_the_tensor_and_its_type(tmp_path: Path) -> None:
    path = write_mixed_file(tmp_path / "iq2.gguf", {"blk.0.attn_k.weight": "IQ2_XXS"})
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_k\.weight is of type IQ2_XXS"):
        load_model(ModelConfig(name_or_path=str(path)))
