"""Tiny random Llama models for the engine's tests (float32, CPU unless asked), and engines
over them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from hybridspec import DraftConfig, Engine, EngineConfig, ModelConfig
from hybridspec.model import LlamaWeights
from hybridspec.model.loader import LoadedModel

VOCAB = 64

EOS = VOCAB - 1

PROMPTS = [
    [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2],
    [7],
    [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
    [5, 9, 5, 9, 5, 9, 5, 9, 40, 41, 42, 5, 9],
    [33, 34, 33, 35, 33, 36, 8, 8, 8, 8, 8],
]


def tiny_loaded(
    seed: int,
    noise_from: LoadedModel | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    quantize_bits: int | None = None,
    device: str = "cpu",
) -> LoadedModel:
    """A tiny random Llama; with ``noise_from``, that model's weights plus small noise (a draft
    that mostly agrees with it); with ``quantize_bits``, quantized at load (bfloat16 compute).
    With a ``tokenizer`` (the suite's byte-level one, for grammars) its vocabulary is the
    tokenizer's and EOS its EOS; else ``VOCAB`` ids, no text. ``device`` holds the weights."""
    vocab = VOCAB if tokenizer is None else len(tokenizer)
    eos = EOS if tokenizer is None else tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=eos,
        bos_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    state = model.state_dict()
    if noise_from is not None:
        torch.manual_seed(seed)
        state = {
            k: v + 0.3 * v.std() * torch.randn_like(v) if v.dim() > 1 else v
            for k, v in state.items()
        }
    else:  # sharpen the output so greedy text has structure worth speculating on, and keep
        # EOS (logit 0, below the largest of 63 others) out of greedy output.
        state["lm_head.weight"] = state["lm_head.weight"] * 8
        state["lm_head.weight"][eos] = 0
    dtype = torch.float32 if quantize_bits is None else torch.bfloat16
    weights = LlamaWeights.from_hf_state_dict(
        state, config, dtype=dtype, device=device, quantize_bits=quantize_bits
    )
    return LoadedModel(weights, tokenizer, config, dtype, (eos,), f"tiny:{seed}")  # type: ignore[arg-type]


def make_engine(target: LoadedModel, draft: LoadedModel | None = None, **config: object) -> Engine:
    target_config = ModelConfig(
        dtype="float32",
        max_seq_len=config.pop("max_seq_len", 256),  # type: ignore[arg-type]
        max_num_seqs=config.pop("max_num_seqs", 8),
    )  # type: ignore[arg-type]
    # The tiny draft costs what the target does: priced as free, so that it drafts at all.
    draft_config = DraftConfig(cost_per_token=0.0)
    # Proposers priced by their fixed costs: the drafts asked for never depend on timing.
    config.setdefault("measure_proposer_costs", False)
    return Engine(
        EngineConfig(target=target_config, draft=draft_config, **config),  # type: ignore[arg-type]
        target=target,
        draft=draft,
    )


def plain(engine: Engine, prompt: Sequence[int], max_new_tokens: int = 40) -> list[int]:
    return engine.generate(
        prompt_token_ids=prompt, proposer="none", max_new_tokens=max_new_tokens
    ).token_ids


def run_joining(
    engine: Engine,
    setups: Sequence[tuple[str, int | None]],
    joins: dict[int, list[int]],
    max_new_tokens: int = 30,
) -> dict[int, list[int]]:
    """Run ``PROMPTS[i]`` with proposer and K ``setups[i]``, each joining before the step that
    ``joins`` names (step number -> prompt indices); every prompt's generated tokens."""
    from hybridspec import GenerationParams

    ids: dict[str, int] = {}
    results: dict[int, list[int]] = {}
    step = 0
    while step <= max(joins) or engine.has_unfinished():
        for i in joins.get(step, []):
            name, k = setups[i]
            params = GenerationParams(
                max_new_tokens=max_new_tokens, proposer=name, num_speculative_tokens=k
            )
            ids[engine.add_request(PROMPTS[i], params)] = i
        for output in engine.step():
            if output.finished:
                assert output.result is not None
                results[ids[output.request_id]] = output.result.token_ids
        step += 1
    return results
