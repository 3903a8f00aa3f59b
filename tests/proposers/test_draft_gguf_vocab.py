"""A draft GGUF file whose vocabulary is not the target file's is refused from the files'
metadata (``draft_vocab.gguf_vocabulary_problem``), naming both files, before the draft's
weights are read; the same vocabulary, or one padded with unused tokens, passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridspec.bench.random_gguf import Shape, write_random_gguf
from hybridspec.config import DraftConfig, EngineConfig, ModelConfig
from hybridspec.engine import Engine
from hybridspec.errors import InvalidRequestError
from hybridspec.model import GGUFFile, embedded_model_path
from hybridspec.proposers.draft_vocab import gguf_vocabulary_problem

SMALL = Shape(1, 64, 128, 2, 1, 49152, tied=True)  # the embedded vocabulary, a small model


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("vocab")
    tokens = list(GGUFFile(embedded_model_path()).get("tokenizer.ggml.tokens"))
    tokens[300], tokens[301] = tokens[301], tokens[300]
    return {
        "target": write_random_gguf(folder / "target.gguf", SMALL, "Q8_0"),
        "same": write_random_gguf(folder / "same.gguf", SMALL, "Q8_0", seed=1),
        "padded": write_random_gguf(
            folder / "padded.gguf", Shape(1, 64, 128, 2, 1, 49152 + 64, tied=True), "Q8_0"
        ),
        "other": write_random_gguf(folder / "other.gguf", SMALL, "Q8_0", tokens=tokens),
    }


def test_same_or_padded_vocabulary_passes(files: dict[str, Path]) -> None:
    assert gguf_vocabulary_problem(str(files["target"]), str(files["same"])) is None
    assert gguf_vocabulary_problem(str(files["target"]), str(files["padded"])) is None
    assert gguf_vocabulary_problem(str(files["target"]), "HuggingFaceTB/SmolLM2-135M") is None


def test_other_vocabulary_names_both_files_and_the_token(files: dict[str, Path]) -> None:
    problem = gguf_vocabulary_problem(str(files["target"]), str(files["other"]))
    assert problem is not None
    assert str(files["target"]) in problem and str(files["other"]) in problem
    assert "token id 300" in problem


def test_engine_refuses_the_draft_before_loading_it(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import hybridspec.engine.proposer_pool as pool

    def no_load(config: ModelConfig) -> None:
        raise AssertionError(f"the draft {config.name_or_path} was loaded")

    monkeypatch.setattr(pool, "load_model", no_load)
    target = ModelConfig(str(files["target"]), max_seq_len=64, max_num_seqs=1)
    draft = ModelConfig(str(files["other"]), max_seq_len=64, max_num_seqs=1)
    engine = Engine(EngineConfig(target=target, draft=DraftConfig(draft)))
    try:
        with pytest.raises(InvalidRequestError) as error:
            engine.resolve_proposer("draft")
        assert str(files["target"]) in str(error.value) and str(files["other"]) in str(error.value)
    finally:
        engine.close()
