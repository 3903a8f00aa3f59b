"""Distillation on a tiny random target in seconds: the loss falls, training resumes exactly
where it stopped, the trained head drafts through the engine; and the data never contains a
bench prompt."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from hybridspec.bench.workload import DEFAULT_WORKLOAD, load_workload
from hybridspec.config import EagleConfig
from hybridspec.distill.data import FeatureReader, answer_prompts, local_snippets
from hybridspec.distill.sources import chat_prompts
from hybridspec.distill.train import (
    TrainOptions,
    acceptance,
    distill_parts,
    draft_vocabulary,
    head_config,
    init_head,
    target_top,
    to_device,
    train,
    windows,
)
from hybridspec.model.loader import LoadedModel
from hybridspec.proposers.eagle_head import EagleHead
from tests.conftest import tiny_tokenizer
from tests.engine.tiny import EOS, PROMPTS, make_engine, plain, tiny_loaded
from tests.proposers.eagle_helpers import use_head


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_loaded(0)


@pytest.fixture(scope="module")
def sequences(target: LoadedModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return own_sequences(target)


def own_sequences(target: LoadedModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The tiny target's own greedy continuations of random prompts, with their features (on
    the CPU, as the data shards hold them)."""
    engine = make_engine(target)
    reader = FeatureReader(target, 256)
    rng = random.Random(0)
    out = []
    for _ in range(12):
        prompt = [rng.randrange(1, EOS) for _ in range(rng.randint(3, 12))]
        ids = prompt + plain(engine, prompt, 40)
        out.append((torch.tensor(ids, dtype=torch.int32), reader(ids).cpu().to(torch.bfloat16)))
    return out


def new_head(target: LoadedModel, sequences: list) -> EagleHead:  # type: ignore[type-arg]
    torch.manual_seed(0)
    vocab = draft_vocabulary(sequences, 48, (EOS,))
    return init_head(head_config(target, 48), distill_parts(target, torch.float32), vocab)


OPTIONS = TrainOptions(budget_s=60.0, batch_size=4, window=32, lr=3e-3, max_steps=30)


def test_training_lowers_the_loss_and_the_head_drafts(
    target: LoadedModel,
    sequences: list,
    tmp_path: Path,  # type: ignore[type-arg]
) -> None:
    head = new_head(target, sequences)
    held_out = windows(sequences[:4], 32, None)
    tops = target_top(distill_parts(target, torch.float32), held_out, head.config.rms_norm_eps)
    before = acceptance(head, held_out, tops, 2)
    losses: list[float] = []
    train(head, sequences[4:], OPTIONS, tmp_path, lambda s: losses.append(s.last_loss))
    assert len(losses) == OPTIONS.max_steps
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5])
    after = acceptance(head, held_out, tops, 2)
    assert after[0] > before[0]
    engine = make_engine(target, eagle=EagleConfig(cost_per_token=0.0))
    use_head(engine, head.eval())
    drafted = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt_token_ids=prompt, proposer="eagle", max_new_tokens=30)
        assert result.token_ids == plain(engine, prompt, 30)
        drafted += result.stats.draft_tokens_accepted
    assert drafted > 0


def test_training_resumes_exactly_from_its_checkpoint(
    target: LoadedModel,
    sequences: list,
    tmp_path: Path,  # type: ignore[type-arg]
) -> None:
    short = TrainOptions(budget_s=60.0, batch_size=2, window=16, max_steps=6)
    straight = new_head(target, sequences)
    train(straight, sequences, short, tmp_path / "straight", lambda s: None)
    resumed = new_head(target, sequences)
    half = TrainOptions(budget_s=60.0, batch_size=2, window=16, max_steps=3)
    train(resumed, sequences, half, tmp_path / "resumed", lambda s: None)
    again = new_head(target, sequences)  # a fresh process: everything from the checkpoint
    steps: list[int] = []
    train(again, sequences, short, tmp_path / "resumed", lambda s: steps.append(s.step))
    assert steps == [4, 5, 6]
    theirs = again.state_dict()
    for name, mine in straight.state_dict().items():
        assert torch.equal(mine, theirs[name]), name


def test_the_draft_vocabulary_is_the_most_frequent_tokens_and_eos() -> None:
    seqs = [(torch.tensor([5, 5, 5, 7, 7, 9], dtype=torch.int32), torch.zeros(6, 2))]
    assert draft_vocabulary(seqs, 3, (2,)).tolist() == [2, 5, 7]


def test_no_bench_prompt_is_in_the_distillation_data() -> None:
    workload = load_workload(DEFAULT_WORKLOAD)
    bench_texts = [m["content"] for p in workload.prompts for m in p.messages]
    snippets = local_snippets(seed=0, limit=400)
    chats = chat_prompts(snippets, 400, random.Random(0))
    assert any(len(turns) == 2 for turns in chats)  # follow-ups are part of what is checked
    data = [turn for turns in chats for turn in turns] + [s.text for s in snippets]
    for bench in bench_texts:
        # a long piece of every bench message, and the whole of it, appear nowhere in the data
        probe = bench[:120]
        assert not any(probe in text or text in bench for text in data), probe


def test_a_follow_up_goes_after_the_first_answer_and_the_exchange_is_yielded_once() -> None:
    tokenizer = tiny_tokenizer()
    engine = make_engine(tiny_loaded(0, tokenizer=tokenizer), max_seq_len=256)
    chats = [("Tell me about tea.", "Why is that?"), ("Say hello.",)]
    got = dict(answer_prompts(engine, chats, 120.0, 6, seed=0))
    assert sorted(got) == [0, 1]
    two = tokenizer.decode(got[0])
    first_answer = two.index("<|im_start|>assistant")
    assert "Tell me about tea." in two[:first_answer]
    assert "Why is that?" in two[first_answer:]
    assert two.count("<|im_start|>assistant") == 2  # the first answer sent back, then the second
    one = tokenizer.decode(got[1])
    assert one.count("<|im_start|>user") == 1 and "Say hello." in one
    prompt = engine.encode(messages=[{"role": "user", "content": "Say hello."}])
    assert got[1][: len(prompt)] == list(prompt) and len(got[1]) == len(prompt) + 6


def test_held_out_windows_are_each_sequences_last_and_training_ones_lie_inside() -> None:
    # Pairs of a 10-token sequence: features f_0..f_8 with next tokens x_1..x_9.
    ids = torch.arange(10, dtype=torch.int32)
    features = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 2)
    short = (ids[:3], features[:3])  # 2 pairs: shorter than the window, padded
    held = windows([(ids, features), short], 4, None)
    assert held.next_token_ids.tolist() == [[6, 7, 8, 9], [1, 2, 0, 0]]
    assert held.features[0, :, 0].tolist() == [5, 6, 7, 8]
    assert held.targets[0, :, 0].tolist() == [6, 7, 8, 9]
    assert held.mask.tolist() == [[True] * 4, [True, True, False, False]]
    rng = random.Random(0)
    for _ in range(20):
        batch = windows([(ids, features)], 4, rng)
        first = int(batch.next_token_ids[0, 0])
        assert 1 <= first <= 6
        assert batch.next_token_ids[0].tolist() == list(range(first, first + 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_on_the_device_lowers_the_loss_and_the_head_drafts_there(
    tmp_path: Path,
) -> None:
    target = tiny_loaded(0, device="cuda")
    engine = make_engine(target)
    seqs = own_sequences(target)
    torch.manual_seed(0)
    vocab = draft_vocabulary(seqs, 48, (EOS,))
    parts = distill_parts(target, torch.float32, "cuda")
    head = init_head(head_config(target, 48), parts, vocab).to("cuda")
    held_out = to_device(windows(seqs[:4], 32, None), "cuda")
    tops = target_top(parts, held_out, head.config.rms_norm_eps)
    losses: list[float] = []
    options = dataclasses.replace(OPTIONS, device="cuda", bfloat16=True)
    train(head, seqs[4:], options, tmp_path, lambda s: losses.append(s.last_loss))
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5])
    assert acceptance(head, held_out, tops, 2)[0] > 0
    eagle_engine = make_engine(target, eagle=EagleConfig(cost_per_token=0.0))
    use_head(eagle_engine, head.eval())
    for prompt in PROMPTS:
        result = eagle_engine.generate(prompt_token_ids=prompt, proposer="eagle", max_new_tokens=30)
        assert result.token_ids == plain(engine, prompt, 30)
