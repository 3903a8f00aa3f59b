"""Target features for proposers: the hidden states of exactly the committed positions reach
the proposers that ask for them, in order and without gap, never a rejected draft's row."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from hybridspec import CommitInfo, Engine, GenerationParams, Proposal, ProposeRequest
from hybridspec.model import ForwardBatch, LoadedModel
from hybridspec.proposers import ProposerContext
from hybridspec.proposers.ngram import NgramProposer
from tests.engine.tiny import PROMPTS, make_engine

LONG_PROMPT = (PROMPTS[0] + PROMPTS[2] + PROMPTS[3]) * 2  # 92 tokens: several prefill chunks


class Recording(NgramProposer):
    """The n-gram proposer, recording what each commit hands over."""

    commits: list[CommitInfo]
    num_drafts: int  # proposed over all rounds

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self.commits = []
        self.num_drafts = 0

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        proposals = super().propose(requests)
        self.num_drafts += sum(p.num_drafts for p in proposals)
        return proposals

    def commit(self, info: CommitInfo) -> None:
        self.commits.append(info)
        super().commit(info)


class LastLayer(Recording):
    feature_layers = (-1,)


class TwoLayers(Recording):
    feature_layers = (0, -1)


def plain_hidden_states(
    target: LoadedModel, token_ids: Sequence[int], layers: tuple[int, ...]
) -> torch.Tensor:
    """[len(token_ids), len(layers), hidden_size]: one forward of the tokens in a fresh cache."""
    runtime = target.create_runtime(1, 256)
    slot = runtime.allocate()
    output = runtime.forward(ForwardBatch.from_lists([slot], [list(token_ids)], [], layers))
    assert output.hidden_states is not None
    return output.hidden_states


def handed_rows(commits: list[CommitInfo], seq_id: int) -> torch.Tensor:
    """The rows handed to ``seq_id``, checked to start at position 0 and follow one another."""
    rows, position = [], 0
    for info in commits:
        if info.seq_id != seq_id:
            continue
        assert info.hidden_states is not None
        assert info.hidden_position == position
        rows.append(info.hidden_states)
        position += info.hidden_states.shape[0]
    return torch.cat(rows)


def run(engine: Engine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Greedy requests, one per proposer, all at once: each one's committed tokens."""
    ids = {
        engine.add_request(
            prompt,
            GenerationParams(max_new_tokens=40, proposer=name, num_speculative_tokens=4),
        ): name
        for name, prompt in prompts.items()
    }
    committed: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.result is not None:
                prompt = prompts[ids[output.request_id]]
                committed[ids[output.request_id]] = prompt + output.result.token_ids
    return committed


def test_committed_positions_reach_the_proposer_in_order_and_exactly(
    target: LoadedModel,
) -> None:
    engine = make_engine(
        target, prefill_chunk_size=16, prefill_step_ratio=None, adaptive_speculation=False
    )
    engine.register_proposer("last-layer", LastLayer)
    engine.register_proposer("two-layers", TwoLayers)
    committed = run(
        engine, {"last-layer": LONG_PROMPT, "two-layers": PROMPTS[3], "ngram": PROMPTS[0]}
    )
    for name, layers in (("last-layer", (-1,)), ("two-layers", (0, -1))):
        proposer = engine.resolve_proposer(name)
        assert isinstance(proposer, Recording)
        accepted = sum(c.num_accepted for c in proposer.commits)
        assert 0 < accepted < proposer.num_drafts  # drafts kept and rejected: rows of both kinds
        rows = handed_rows(proposer.commits, proposer.commits[0].seq_id)
        expected = plain_hidden_states(target, committed[name], layers)
        # Every handed row is the committed token's, at its position; the last committed
        # tokens (after the final commit) are not handed.
        assert rows.shape[1:] == expected.shape[1:]
        torch.testing.assert_close(rows, expected[: rows.shape[0]], atol=1e-5, rtol=1e-5)
        assert rows.shape[0] >= len(committed[name]) - 1 - 5  # at most one round's tokens left


def test_a_proposer_that_asks_for_no_layer_gets_none_and_costs_nothing(
    target: LoadedModel,
) -> None:
    engine = make_engine(target, adaptive_speculation=False)
    engine.register_proposer("plain-recording", Recording)
    layers_asked: list[tuple[int, ...]] = []
    handle = engine.runtime.add_forward_observer(
        lambda batch, seconds: layers_asked.append(batch.hidden_layers)
    )
    run(engine, {"plain-recording": PROMPTS[0], "none": PROMPTS[2]})
    handle.remove()
    proposer = engine.resolve_proposer("plain-recording")
    assert isinstance(proposer, Recording) and proposer.commits
    assert all(info.hidden_states is None for info in proposer.commits)
    assert layers_asked and set(layers_asked) == {()}


@pytest.mark.parametrize("layers", [(-1,), (0, 1)])
def test_hidden_layers_of_the_forward_are_the_union_asked(
    target: LoadedModel, layers: tuple[int, ...]
) -> None:
    class Asking(Recording):
        feature_layers = layers

    engine = make_engine(target, adaptive_speculation=False)
    engine.register_proposer("asking", Asking)
    engine.register_proposer("last-layer", LastLayer)
    layers_asked: list[tuple[int, ...]] = []
    engine.runtime.add_forward_observer(lambda batch, _: layers_asked.append(batch.hidden_layers))
    run(engine, {"asking": PROMPTS[0], "last-layer": PROMPTS[2]})
    union = tuple(dict.fromkeys((*layers, -1)))
    assert union in layers_asked or tuple(dict.fromkeys((-1, *layers))) in layers_asked
