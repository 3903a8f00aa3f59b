"""The random-weight GGUF writer: llama.cpp's type for each tensor of a mix, blocks whose values
have the asked spread, and tiny files that our loader and (where installed) llama.cpp load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

from hybridspec.bench.random_blocks import BLOCKS, MIXES, random_blocks, use_more_bits
from hybridspec.bench.random_gguf import SHAPES, plan_tensors, write_random_gguf
from hybridspec.config import ModelConfig
from hybridspec.model import load_model


def test_use_more_bits_is_llama_cpps_layers() -> None:
    # i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(28) if use_more_bits(i, 28)] == [
        0,
        1,
        2,
        5,
        8,
        11,
        14,
        17,
        20,
        23,
        24,
        25,
        26,
        27,
    ]


def _types(shape: str, mix: str) -> dict[str, T]:
    return {t.name: t.qtype for t in plan_tensors(SHAPES[shape], "llama", mix)}


def test_q4_k_m_mix_of_the_1b_shape() -> None:
    types = _types("1b", "Q4_K_M")
    assert types["token_embd.weight"] == T.Q6_K  # tied: the output's type
    assert "output.weight" not in types
    assert types["blk.0.attn_v.weight"] == T.Q6_K
    assert types["blk.2.attn_v.weight"] == T.Q4_K
    assert types["blk.4.ffn_down.weight"] == T.Q6_K
    assert types["blk.5.ffn_down.weight"] == T.Q4_K
    assert types["blk.5.attn_q.weight"] == T.Q4_K
    assert types["blk.0.attn_norm.weight"] == T.F32


def test_untied_embedding_keeps_the_base_type() -> None:
    types = _types("8b", "Q4_K_M")
    assert types["token_embd.weight"] == T.Q4_K
    assert types["output.weight"] == T.Q6_K
    assert _types("8b", "Q8_0")["output.weight"] == T.Q8_0
    assert _types("8b", "Q4_0")["output.weight"] == T.Q6_K


def test_rows_of_576_fall_back_to_32_blocks() -> None:
    types = _types("135m", "Q4_K_M")  # hidden 576 is not a multiple of 256
    assert types["blk.3.attn_q.weight"] == T.Q5_0
    assert types["blk.0.attn_v.weight"] == T.Q8_0  # Q6_K's fallback
    assert types["token_embd.weight"] == T.Q8_0
    assert types["blk.3.ffn_down.weight"] == T.Q4_K  # 1536 columns: 6 blocks of 256


@pytest.mark.parametrize("qtype", [t for t in BLOCKS if t not in (T.F16, T.F32)])
def test_random_blocks_have_the_asked_spread(qtype: T) -> None:
    blocks = random_blocks(qtype, 64, 512, 0.02, np.random.default_rng(0))
    assert blocks.dtype == np.uint8 and blocks.shape == (
        64,
        512 // BLOCKS[qtype][0] * BLOCKS[qtype][1],
    )
    values = dequantize(blocks, qtype)
    assert values.shape == (64, 512)
    assert abs(float(values.std()) - 0.02) < 0.001
    assert abs(float(values.mean())) < 0.003


def test_unknown_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shape"):
        write_random_gguf(tmp_path / "x.gguf", "70b")
    with pytest.raises(ValueError, match="type"):
        write_random_gguf(tmp_path / "x.gguf", "tiny", "Q3_K_XL")
    with pytest.raises(ValueError, match="family"):
        write_random_gguf(tmp_path / "x.gguf", "tiny", family="gemma2")


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_gguf(tmp_path_factory.mktemp("gguf") / "tiny-Q4_K_M.gguf", "tiny")


def test_tiny_file_has_the_planned_tensors_and_vocabulary(tiny_q4_k_m: Path) -> None:
    reader = GGUFReader(tiny_q4_k_m)
    written = {t.name: T(t.tensor_type) for t in reader.tensors}
    assert written == _types("tiny", "Q4_K_M")
    assert written["blk.1.ffn_down.weight"] == T.Q6_K and written["blk.0.ffn_down.weight"] == T.Q4_K
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == SHAPES["tiny"].vocab_size
    assert int(reader.fields["general.file_type"].contents()) == MIXES["Q4_K_M"].file_type


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_our_loader_runs_a_written_file(family: str, tmp_path: Path) -> None:
    from tests.engine.tiny import make_engine

    path = write_random_gguf(tmp_path / f"{family}.gguf", "tiny", "Q8_0", family=family)
    loaded = load_model(ModelConfig(str(path)))
    assert loaded.is_native and loaded.hf_config.vocab_size == SHAPES["tiny"].vocab_size
    ids = loaded.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    result = make_engine(loaded).generate(prompt_token_ids=ids, proposer="none", max_new_tokens=4)
    assert len(result.token_ids) == 4


PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3, 4,", "def main():\n    "]


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q8_0"])
def test_llama_cpp_reads_what_we_read(mix: str, tmp_path: Path) -> None:
    """llama.cpp loads a written file and its logits at each prompt's end are finite and those
    of our loader's float32 reading (correlation > 0.999; both quantize activations differently,
    so not bit for bit), and our greedy first token is llama.cpp's for 3 of the 4 prompts (random
    weights leave near ties either side may break)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama_cpp is not installed")
    import torch

    from hybridspec.bench.hf_baseline import hf_model_from_weights
    from tests.engine.tiny import make_engine

    path = write_random_gguf(tmp_path / f"tiny-{mix}.gguf", "tiny", mix)
    theirs_model = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, verbose=False, logits_all=True)
    dense = hf_model_from_weights(load_model(ModelConfig(str(path), "float32", quantize="none")))
    loaded = load_model(ModelConfig(str(path)))
    engine = make_engine(loaded)
    agree = 0
    for text in PROMPTS:
        ids = loaded.tokenizer.encode(text, add_special_tokens=False)
        theirs_model.reset()
        theirs_model.eval(ids)
        theirs = np.array(theirs_model.scores[len(ids) - 1])
        with torch.no_grad():
            ours = dense(torch.tensor([ids])).logits[0, -1].numpy()
        assert np.isfinite(theirs).all()
        assert np.corrcoef(ours, theirs)[0, 1] > 0.999, text
        first = engine.generate(prompt_token_ids=ids, proposer="none", max_new_tokens=1)
        agree += first.token_ids[0] == int(theirs.argmax())
    theirs_model.close()
    assert agree >= 3, f"{agree} of {len(PROMPTS)} first tokens equal llama.cpp's"
