"""Row invariance on CPU: a token's logits are bit-identical however it is batched.

Greedy speculative decoding gives plain decoding's text only if verifying a token among drafts
computes it exactly as decoding it alone. These tests check the pieces that make it so in
bfloat16 (``attention_kernels.attend``, ``attention.KernelAttention``, ``linear.PackedLinear``'s
one-row padding) and the result through the engine.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hybridspec import Engine, EngineConfig, GenerationParams, ModelConfig
from hybridspec.model.attention_kernels import attend
from hybridspec.model.kv_cache import numpy_view
from hybridspec.model.linear import ONE_ROW_MAX_IN_FEATURES, PackedLinear
from hybridspec.model.llama import LlamaRuntime
from hybridspec.model.llama_weights import LlamaWeights
from hybridspec.model.loader import LoadedModel
from hybridspec.model.runtime import ForwardBatch, ModelRuntime

VOCAB = 64


def reference_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: int
) -> torch.Tensor:
    """float64 softmax attention of ``q [H, hd]`` over positions ``0 .. position``."""
    rep = q.shape[0] // keys.shape[0]
    k = keys[:, : position + 1].double().repeat_interleave(rep, 0)  # [H, L, hd]
    v = values[:, : position + 1].double().repeat_interleave(rep, 0)
    scores = torch.einsum("hd,hld->hl", q.double(), k) / q.shape[-1] ** 0.5
    return torch.einsum("hl,hld->hd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_softmax_attention_and_ignores_memory_past_each_row(
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(0)
    slots, kv, rep, hd, max_len = 2, 2, 3, 16, 40
    keys = torch.randn(slots, kv, max_len, hd, generator=gen).to(dtype)
    values = torch.randn(slots, kv, max_len, hd, generator=gen).to(dtype)
    keys[1, :, 20:] = float("nan")  # stale or never-written memory past the rows' positions
    values[1, :, 20:] = float("nan")
    keys_t = keys.transpose(-1, -2).contiguous()
    # slot 0: tokens at positions 30..34 (one item of 5); slot 1: positions 17..19 (2 items)
    spans = [(0, 30, 5), (1, 17, 2), (1, 19, 1)]
    items = []
    token = 0
    for slot, position, count in spans:
        items += [(slot, head, token, position, count) for head in range(kv)]
        token += count
    q = torch.randn(token, kv * rep, hd, generator=gen)
    out = np.full((token, kv * rep, hd), np.nan, dtype=np.float32)
    scale = np.float32(hd**-0.5)
    attend(
        q.numpy(),
        numpy_view(keys_t),
        numpy_view(values),
        np.array(items, np.int32),
        scale,
        np.float32(0),
        0,
        out,
    )
    token = 0
    for slot, position, count in spans:
        for i in range(count):
            want = reference_attention(q[token], keys[slot], values[slot], position + i)
            torch.testing.assert_close(
                torch.from_numpy(out[token]).double(), want, atol=2e-6, rtol=2e-6
            )
            token += 1


@pytest.mark.parametrize("hd", [20, 64])  # 20: dims left over after the groups of 8
def test_kernel_computes_a_row_alike_alone_and_in_any_item(hd: int) -> None:
    gen = torch.Generator().manual_seed(4)
    kv, rep, max_len, tokens = 2, 3, 64, 12
    kernel_keys = numpy_view(torch.randn(1, kv, hd, max_len, generator=gen).to(torch.bfloat16))
    kernel_values = numpy_view(torch.randn(1, kv, max_len, hd, generator=gen).to(torch.bfloat16))
    q = torch.randn(tokens, kv * rep, hd, generator=gen).numpy()
    scale = np.float32(hd**-0.5)

    def run(queries: np.ndarray, first_position: int, counts: list[int]) -> np.ndarray:
        """Attention of ``queries`` at positions first_position.., in items of ``counts``."""
        items, token = [], 0
        for count in counts:
            items += [(0, h, token, first_position + token, count) for h in range(kv)]
            token += count
        out = np.full(queries.shape, np.nan, dtype=np.float32)
        attend(
            queries,
            kernel_keys,
            kernel_values,
            np.array(items, np.int32),
            scale,
            np.float32(0),
            0,
            out,
        )
        return out

    # first positions and lengths cross the groups of 8 positions and the 16 sum lanes
    for first in (0, 5, 7, 15, 16, 30, 45):
        alone = np.concatenate([run(q[t : t + 1], first + t, [1]) for t in range(tokens)])
        assert not np.isnan(alone).any()
        for counts in ([tokens], [4, 4, 4], [5, 7], [1, 11], [3, 2, 6, 1]):
            together = run(q, first, counts)
            assert together.tobytes() == alone.tobytes(), (first, counts)


@pytest.mark.parametrize("in_features", [576, ONE_ROW_MAX_IN_FEATURES + 512])
def test_packed_linear_computes_a_row_alike_alone_and_among_others(in_features: int) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(576, in_features, generator=gen).to(torch.bfloat16)
    assert_rows_alike(PackedLinear(weight, prepack=True), in_features, gen)


@pytest.mark.parametrize(
    ("in_features", "out_features", "row_counts"),
    [
        # SmolLM2-135M's down projection: oneDNN splits its sums at these counts on one thread
        (1536, 576, (130, 160, 200, 256, 520)),
        # a 1B model's down projection: from 25 rows
        (8192, 256, (25, 30, 104, 168)),
        # 1024 features or fewer: oneDNN never splits, and no call is split here (max_rows)
        (1024, 576, (193, 256, 520, 700)),
    ],
)
def test_packed_linear_computes_a_row_alike_in_calls_of_many_rows(
    in_features: int, out_features: int, row_counts: tuple[int, ...]
) -> None:
    """A prompt chunk's hundreds of rows come out as each row alone: a prompt's tokens, and a
    decode token beside them, do not depend on the split of the prompt into chunks."""
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    linear = PackedLinear(weight, prepack=True)
    x = torch.randn(max(row_counts), in_features, generator=gen).to(torch.bfloat16)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(len(x))])
    for rows in row_counts:
        assert torch.equal(linear(x[:rows]), alone[:rows]), rows


def assert_rows_alike(
    linear: Callable[[torch.Tensor], torch.Tensor], in_features: int, gen: torch.Generator
) -> None:
    """Each of 40 random bfloat16 rows comes out of ``linear`` alike alone and among others."""
    x = torch.randn(40, in_features, generator=gen).to(torch.bfloat16)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(len(x))])
    for rows in (2, 3, 9, 17, 40):
        assert torch.equal(linear(x[:rows]), alone[:rows]), rows


def tiny_bf16_config() -> LlamaConfig:
    # intermediate_size > ONE_ROW_MAX_IN_FEATURES: the down projection takes the padded path.
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=ONE_ROW_MAX_IN_FEATURES + 256,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def bf16_runtime(max_num_seqs: int = 4) -> LlamaRuntime:
    torch.manual_seed(2)
    config = tiny_bf16_config()
    model = LlamaForCausalLM(config).eval()
    weights = LlamaWeights.from_hf_state_dict(model.state_dict(), config, dtype=torch.bfloat16)
    return LlamaRuntime(weights, max_num_seqs, 256)


def assert_logits_alike_decoded_verified_and_batched(
    runtime: ModelRuntime, ids: list[int]
) -> torch.Tensor:
    """Positions 39..48 of ``ids`` decoded one at a time, verified as 9 drafts, and verified
    beside another sequence's span give the same logits; returns those logits."""
    slot, other = runtime.allocate(), runtime.allocate()
    runtime.forward(ForwardBatch.from_lists([other], [ids[5:50]], logits_indices=[]))
    # plain decoding: the prompt (logits for its last row), then one token per forward
    decoded = [
        runtime.forward(ForwardBatch.from_lists([slot], [ids[:40]], logits_indices=[39])).logits
    ]
    for i in range(40, 49):
        decoded.append(runtime.forward(ForwardBatch.from_lists([slot], [[ids[i]]])).logits)
    plain = torch.cat(decoded)  # logits of positions 39..48
    runtime.truncate(slot, 40)
    verified = runtime.forward(ForwardBatch.from_lists([slot], [ids[40:49]])).logits
    assert torch.equal(verified, plain[1:])
    runtime.truncate(slot, 40)
    # the same 9 tokens beside a 3-token span of another sequence, in one forward
    batch = ForwardBatch.from_lists([other, slot], [ids[50:53], ids[40:49]])
    assert torch.equal(runtime.forward(batch).logits[3:], plain[1:])
    return plain


def test_bfloat16_logits_do_not_depend_on_drafts_or_batch() -> None:
    runtime = bf16_runtime()
    assert runtime.invariant_attention
    ids = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = assert_logits_alike_decoded_verified_and_batched(runtime, ids)
    # a prompt fed with 9 drafts, as the engine's first round does
    fresh = bf16_runtime()
    fresh_slot = fresh.allocate()
    logits = fresh.forward(
        ForwardBatch.from_lists([fresh_slot], [ids[:49]], logits_indices=list(range(39, 49)))
    ).logits
    assert torch.equal(logits, plain)
    # the prompt split into chunks (as a prefill budget splits it), the last chunk batched
    # beside another sequence's prompt
    fresh.truncate(fresh_slot, 0)
    fresh.forward(ForwardBatch.from_lists([fresh_slot], [ids[:17]], logits_indices=[]))
    fresh.forward(ForwardBatch.from_lists([fresh_slot], [ids[17:30]], logits_indices=[]))
    neighbour = fresh.allocate()
    chunked = fresh.forward(
        ForwardBatch.from_lists(
            [neighbour, fresh_slot], [ids[3:40], ids[30:40]], logits_indices=[36, 46]
        )
    ).logits
    assert torch.equal(chunked[1:], plain[:1])


def wide_bf16_config() -> LlamaConfig:
    """SmolLM2-135M's widths, whose down projection oneDNN sums in chunks in a call of 130 or
    more rows; weights large enough that an MLP output's last bits show beside the residual."""
    config = tiny_bf16_config()
    config.hidden_size, config.intermediate_size = 576, 1536
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 9, 3, 64
    config.initializer_range = 0.2
    return config


def wide_bf16_weights() -> LlamaWeights:
    torch.manual_seed(7)
    config = wide_bf16_config()
    model = LlamaForCausalLM(config).eval()
    return LlamaWeights.from_hf_state_dict(model.state_dict(), config, dtype=torch.bfloat16)


def test_bfloat16_states_do_not_depend_on_the_split_of_a_long_prompt() -> None:
    """A 250-token prompt fed whole, in chunks, or with its last chunk beside another sequence's
    long chunk gives the same hidden states at every position and the same next-token logits:
    no matmul call sums a row differently for the number of rows it takes
    (``PackedLinear.max_rows``)."""
    runtime = LlamaRuntime(wide_bf16_weights(), 2, 256)
    ids = torch.randint(0, VOCAB, (250,), generator=torch.Generator().manual_seed(6)).tolist()

    def run(chunks: list[list[int]], neighbour: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's hidden states after layer 0 ``[250, D]`` and its last row's logits,
        the last chunk fed beside ``neighbour``'s tokens in another slot (none: alone)."""
        slot, other = runtime.allocate(), runtime.allocate()
        states = []
        for i, chunk in enumerate(chunks):
            slots, tokens = ([slot], [chunk])
            if i == len(chunks) - 1 and neighbour:
                slots, tokens = [other, slot], [neighbour, chunk]
            rows = sum(map(len, tokens))
            batch = ForwardBatch.from_lists(slots, tokens, [rows - 1], hidden_layers=(0,))
            output = runtime.forward(batch)
            assert output.hidden_states is not None
            states.append(output.hidden_states[rows - len(chunk) :, 0])
        runtime.free(slot)
        runtime.free(other)
        return torch.cat(states), output.logits

    whole = run([ids], [])
    splits = ([ids[:64], ids[64:128], ids[128:192], ids[192:]], [ids[:249], ids[249:]])
    for chunks in splits:
        for neighbour in ([], ids[:240]):  # a decode token beside a 240-token chunk
            states, logits = run(chunks, neighbour)
            assert torch.equal(states, whole[0]), ([len(c) for c in chunks], len(neighbour))
            assert torch.equal(logits, whole[1])


def test_greedy_text_and_logprobs_do_not_depend_on_the_prefill_chunk_size() -> None:
    """The engine's greedy tokens and their log-probabilities for a 200-token prompt are the
    same bits whether the prompt is prefilled whole or in chunks of 64 or 16 tokens."""
    weights = wide_bf16_weights()
    target = LoadedModel(weights, None, wide_bf16_config(), torch.bfloat16, (), "wide")  # type: ignore[arg-type]
    prompt = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(8)).tolist()
    params = GenerationParams.create(max_new_tokens=24, temperature=0.0, logprobs=1)
    results = []
    for chunk in (512, 64, 16):
        config = EngineConfig(
            target=ModelConfig(dtype="bfloat16", max_seq_len=256, max_num_seqs=1),
            prefill_chunk_size=chunk,
            prefill_step_ratio=None,  # chunks of prefill_chunk_size, not timed
            measure_proposer_costs=False,
        )
        results.append(
            Engine(config, target=target).generate(prompt_token_ids=prompt, params=params)
        )
    whole = results[0]
    assert whole.logprobs is not None
    for result in results[1:]:
        assert list(result.token_ids) == list(whole.token_ids)
        assert result.logprobs is not None
        assert torch.equal(result.logprobs.logprobs, whole.logprobs.logprobs)


def test_greedy_ngram_text_and_logprobs_equal_plain_decoding_in_bfloat16() -> None:
    """With batch-invariant logits, ngram's greedy text is plain decoding's, and each token's
    log-probabilities (generated and prompt, with alternatives) are the same bits whether it was
    verified as a draft or decoded alone (float32 runs differ in the last bits instead)."""
    runtime = bf16_runtime(max_num_seqs=2)
    target = LoadedModel(runtime.weights, None, tiny_bf16_config(), torch.bfloat16, (), "tiny")  # type: ignore[arg-type]
    engine = Engine(
        EngineConfig(
            target=ModelConfig(dtype="bfloat16", max_seq_len=256, max_num_seqs=2),
            measure_proposer_costs=False,  # drafts that never depend on timing
        ),
        target=target,
    )
    # a repetitive prompt, so that the n-gram proposer finds drafts and some are accepted
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(4)).tolist() * 4
    results = {}
    for proposer, k in (("none", None), ("ngram", 3), ("ngram", 8)):
        params = GenerationParams.create(
            max_new_tokens=80,
            temperature=0.0,
            proposer=proposer,
            num_speculative_tokens=k,
            logprobs=5,
            prompt_logprobs=2,
        )
        results[(proposer, k)] = engine.generate(prompt_token_ids=prompt, params=params)
    plain = results[("none", None)]
    assert plain.logprobs is not None and plain.prompt_logprobs is not None
    for key in (("ngram", 3), ("ngram", 8)):
        result = results[key]
        assert result.stats.draft_tokens_accepted > 0
        assert list(result.token_ids) == list(plain.token_ids)
        assert result.logprobs is not None and result.prompt_logprobs is not None
        for field in ("token_ids", "logprobs", "top_token_ids", "top_logprobs"):
            assert torch.equal(getattr(result.logprobs, field), getattr(plain.logprobs, field))
            assert torch.equal(
                getattr(result.prompt_logprobs, field), getattr(plain.prompt_logprobs, field)
            )
