"""Distillation on a tiny random target in seconds: the loss falls, training resumes exactly
where it stopped, the trained head drafts through the engine; and the data never contains a
bench prompt."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from hybridspec import Engine, GenerationParams
from hybridspec.bench.workload import DEFAULT_WORKLOAD, load_workload
from hybridspec.config import EagleConfig
from hybridspec.distill.data import (
    DataBudget,
    FeatureReader,
    Manifest,
    ShardWriter,
    answer_prompts,
    load_sequences,
    local_snippets,
    make_data,
)
from hybridspec.distill.options import TrainOptions
from hybridspec.distill.sources import chat_prompts
from hybridspec.distill.train import (
    acceptance,
    distill_parts,
    draft_vocabulary,
    head_config,
    init_head,
    label_column,
    resolve_layers,
    target_top,
    to_device,
    train,
    windows,
)
from hybridspec.model.loader import LoadedModel
from hybridspec.proposers.eagle import EagleHead, load_head, save_head
from tests.conftest import tiny_tokenizer
from tests.engine.tiny import EOS, PROMPTS, make_engine, plain, tiny_loaded
from tests.model.test_family_proposers import family_loaded
from tests.proposers.eagle_helpers import use_head


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_loaded(0)


@pytest.fixture(scope="module")
def sequences(target: LoadedModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return own_sequences(target)


def own_sequences(
    target: LoadedModel, layers: tuple[int, ...] = (-1,)
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The tiny target's own greedy continuations of random prompts, with the features of
    ``layers`` (on the CPU, as the data shards hold them)."""
    engine = make_engine(target, max_num_seqs=12)
    reader = FeatureReader(target, 256, layers)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, EOS) for _ in range(rng.randint(3, 12))] for _ in range(12)]
    answers = in_one_batch(engine, prompts, GenerationParams(max_new_tokens=40, proposer="none"))
    out = []
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = prompt + answer
        out.append((torch.tensor(ids, dtype=torch.int32), reader(ids).cpu().to(torch.bfloat16)))
    return out


def in_one_batch(
    engine: Engine, prompts: list[list[int]], params: GenerationParams
) -> list[list[int]]:
    """The tokens ``engine`` generates for ``prompts``, all running at once."""
    ids = {engine.add_request(prompt, params): i for i, prompt in enumerate(prompts)}
    results: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                assert output.result is not None
                results[ids[output.request_id]] = output.result.token_ids
    return [results[i] for i in range(len(prompts))]


def new_head(
    target: LoadedModel,
    sequences: list,  # type: ignore[type-arg]
    layers: tuple[int, ...] = (-1,),
) -> EagleHead:
    torch.manual_seed(0)
    vocab = draft_vocabulary(sequences, 48, (EOS,))
    config = head_config(target, 48, layers)
    return init_head(config, distill_parts(target, torch.float32), vocab)


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
    assert drafts_losslessly(target, head) > 0


def drafts_losslessly(target: LoadedModel, head: EagleHead, batched: bool = False) -> int:
    """Drafts kept when ``head`` drafts for ``PROMPTS`` through the engine, each text checked
    against plain decoding's; with ``batched``, all of them in one batch as well."""
    engine = make_engine(target, eagle=EagleConfig(cost_per_token=0.0))
    proposer = use_head(engine, head.eval())
    assert proposer.feature_layers == head.feature_layers
    drafted = 0
    expected = [plain(engine, prompt, 30) for prompt in PROMPTS]
    for prompt, tokens in zip(PROMPTS, expected, strict=True):
        result = engine.generate(prompt_token_ids=prompt, proposer="eagle", max_new_tokens=30)
        assert result.token_ids == tokens
        drafted += result.stats.draft_tokens_accepted
    if batched:
        params = GenerationParams(max_new_tokens=30, proposer="eagle")
        assert in_one_batch(engine, [list(p) for p in PROMPTS], params) == expected
    return drafted


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_a_head_for_another_family_trains_and_drafts_alone_and_batched(
    family: str, tmp_path: Path
) -> None:
    # Qwen3's q/k norms, Gemma 3's (1 + w) norms, post-norms and windows of 8 keys: the
    # features the head learns from are that family's, and its drafts leave the text as it is
    target = family_loaded(family)
    seqs = own_sequences(target)
    head = new_head(target, seqs)
    losses: list[float] = []
    train(head, seqs[4:], OPTIONS, tmp_path, lambda s: losses.append(s.last_loss))
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5])
    assert drafts_losslessly(target, head, batched=True) > 0


def test_a_head_of_several_layers_trains_from_the_last_layers_head_and_drafts(
    target: LoadedModel,
    tmp_path: Path,
) -> None:
    # EAGLE-3's fused features on the 2-layer target: layers 0 and 1 (the last, the label's)
    layers = resolve_layers((0, -1), 2)
    assert layers == (0, 1) and label_column(layers) == 1
    seqs = own_sequences(target, layers)
    assert seqs[0][1].shape[1:] == (2, 64)
    head = new_head(target, seqs, layers)
    assert head.feature_fc is not None and head.feature_layers == (0, 1)
    # it starts as the one-layer head does: the last layer's output through the fusion
    one_layer = new_head(target, [(ids, f[:, 1:]) for ids, f in seqs])
    held = windows(seqs[:4], 32, None, label_column(layers))
    held_one = windows([(ids, f[:, 1:]) for ids, f in seqs[:4]], 32, None)
    assert torch.equal(held.targets, held_one.targets)
    with torch.no_grad():
        assert torch.allclose(
            head.target_features(held.features), one_layer.target_features(held_one.features)
        )
    tops = target_top(distill_parts(target, torch.float32), held, head.config.rms_norm_eps)
    before = acceptance(head, held, tops, 1)
    losses: list[float] = []
    train(head, seqs[4:], OPTIONS, tmp_path / "work", lambda s: losses.append(s.last_loss))
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5])
    assert acceptance(head, held, tops, 1)[0] > before[0]
    assert float(head.feature_fc.weight[:, :64].detach().abs().sum()) > 0  # layer 0 is read
    save_head(head, tmp_path / "head")
    loaded = load_head(tmp_path / "head", distill_parts(target, torch.float32))
    assert loaded.config.feature_layers == (0, 1) and loaded.feature_layers == (0, 1)
    assert torch.equal(loaded.feature_fc.weight, head.feature_fc.weight.to(torch.bfloat16).float())
    assert drafts_losslessly(target, head) > 0


def test_feature_layers_resolve_and_must_hold_the_last_one() -> None:
    assert resolve_layers((-1,), 30) == (-1,)
    assert resolve_layers((2, 15, -1), 30) == (2, 15, 29)
    assert label_column((2, 15, 29)) == 2 and label_column((-1,)) == 0
    for bad in ((2, 15), (2, 30), (2, -31), (29, -1)):
        with pytest.raises(ValueError, match="feature layers"):
            resolve_layers(bad, 30)


def test_a_work_dir_of_other_layers_is_refused_and_one_layer_shards_read_as_one(
    target: LoadedModel, tmp_path: Path
) -> None:
    manifest = Manifest()
    writer = ShardWriter(tmp_path, manifest)
    writer._tokens.append(torch.arange(5, dtype=torch.int32))  # a shard as written before
    writer._features.append(torch.ones(5, 64, dtype=torch.bfloat16))  # layers: [n, D]
    writer.flush()
    ((ids, features),) = load_sequences(tmp_path, manifest.shards)
    assert ids.tolist() == [0, 1, 2, 3, 4] and features.shape == (5, 1, 64)
    engine = make_engine(target)
    budget = DataBudget(1.0, 1.0, 4)
    with pytest.raises(ValueError, match=r"layers \[-1\], not \[0, 1\]"):
        make_data(engine, tmp_path, budget, 0, lambda text: None, None, (0, 1))


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
    features = torch.arange(10, dtype=torch.float32)[:, None, None].repeat(1, 1, 2)  # [n, 1, D]
    short = (ids[:3], features[:3])  # 2 pairs: shorter than the window, padded
    held = windows([(ids, features), short], 4, None)
    assert held.next_token_ids.tolist() == [[6, 7, 8, 9], [1, 2, 0, 0]]
    assert held.features[0, :, 0, 0].tolist() == [5, 6, 7, 8]
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
