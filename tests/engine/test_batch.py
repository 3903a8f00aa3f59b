"""The round's one batch: the forward's layout, the verified rows and the prompt rows, built
once and checked once."""

from __future__ import annotations

import pytest
import torch

from hybridspec.engine.batch import build_round
from hybridspec.engine.request import GenerationParams, Request
from hybridspec.engine.resolution import ResolvedProposer
from hybridspec.model import ForwardBatch
from hybridspec.model.runtime import read_batch
from hybridspec.proposers import NoProposer, ProposerContext
from hybridspec.types import Proposal

NONE = ResolvedProposer("none", NoProposer(ProposerContext(vocab_size=8, eos_token_ids=())), 4)
CPU = torch.device("cpu")


def make_request(seq_id: int, prompt_len: int, params: GenerationParams | None = None) -> Request:
    request = Request(
        request_id=f"r{seq_id}",
        seq_id=seq_id,
        prompt_token_ids=[t % 8 for t in range(prompt_len)],
        params=params or GenerationParams(),
        resolved=NONE,
        generator=torch.Generator(),
    )
    request.slot = seq_id
    return request


def test_prompt_rows_are_computed_only_for_requests_that_ask() -> None:
    """A request asking for prompt logprobs adds the rows of the prompt tokens it feeds, but the
    prompt's last, after every verified row; one that does not ask adds none."""
    scoring = GenerationParams(max_new_tokens=0, prompt_logprobs=2)
    asks_chunk, plain_chunk = make_request(0, 40, scoring), make_request(1, 40)
    asks_decode, plain_decode = make_request(2, 10, scoring), make_request(3, 10)
    cached = {0: 16, 1: 16, 2: 6, 3: 6}
    drafts = [(asks_decode, Proposal([7, 6])), (plain_decode, Proposal([5]))]
    batch = build_round(drafts, [(asks_chunk, 5), (plain_chunk, 5)], cached, CPU)
    # Decoding spans: [p6 p7 p8 p9 d d] at 0..5 and [p6 p7 p8 p9 d] at 6..10; chunks at 11, 16.
    assert batch.cu == (0, 6, 11, 16, 21)
    assert batch.forward.cu_num_tokens.tolist() == list(batch.cu)
    assert batch.num_verify_rows == 3 + 2
    verified = [3, 4, 5, 9, 10]
    # asks_decode's p6 p7 p8 (p9 predicts the first new token: a verified row); the chunk's 5.
    indices = batch.forward.logits_indices
    assert indices is not None
    assert indices.tolist() == [*verified, 0, 1, 2, 11, 12, 13, 14, 15]
    assert [(r.request, r.start, r.num_rows) for r in batch.prompt_rows] == [
        (asks_decode, 6, 3),
        (asks_chunk, 16, 5),
    ]
    nothing_asked = build_round(drafts[1:], [(plain_chunk, 5)], cached, CPU)
    assert nothing_asked.forward.logits_indices is not None
    assert nothing_asked.forward.logits_indices.tolist() == [3, 4]
    assert nothing_asked.prompt_rows == ()


def test_the_verified_rows_are_the_forwards_first_logits_rows() -> None:
    """One layout for both: the forward returns each decoding request's k + 1 rows in order,
    which are the verifier's draft and bonus rows; the drafts sit on the device once."""
    first, second, chunk = make_request(0, 5), make_request(1, 7), make_request(2, 30)
    cached = {0: 4, 1: 6, 2: 10}
    drafts = [(first, Proposal([1, 2, 3])), (second, Proposal([]))]
    batch = build_round(drafts, [(chunk, 4)], cached, CPU)
    assert batch.layout is not None
    assert batch.layout.num_drafts == (3, 0)
    assert batch.layout.draft_rows.tolist() == [0, 1, 2]
    assert batch.layout.bonus_rows.tolist() == [3, 4]
    assert batch.draft_token_ids.tolist() == [1, 2, 3]
    assert batch.forward.token_ids.tolist() == [4, 1, 2, 3, 6, 2, 3, 4, 5]
    assert batch.starts == (4, 6, 10)
    assert [r.seq_id for r in batch.requests] == [0, 1, 2]
    prefill_only = build_round([], [(chunk, 4)], cached, CPU)
    assert prefill_only.layout is None and prefill_only.num_verify_rows == 0


def test_a_built_batch_carries_its_checked_host_ints() -> None:
    """The runtime reads a built batch's ints, not its tensors; it checks only the model's
    bounds (the vocabulary, the layers)."""
    batch = ForwardBatch.build([3, 0], [1, 2, 3, 4], [0, 3, 4], [2, 3], (-1,))
    assert batch.host is not None
    assert (batch.host.slots, batch.host.num_new_tokens) == ((3, 0), (3, 1))
    host = read_batch(batch, vocab_size=8, num_layers=2)
    assert (host.slots, host.num_new_tokens, host.hidden_layers) == ([3, 0], [3, 1], (1,))
    with pytest.raises(ValueError, match=r"token_ids: expected ids in \[0, 4\)"):
        read_batch(batch, vocab_size=4, num_layers=2)
    unchecked = ForwardBatch(batch.slots, batch.token_ids, batch.cu_num_tokens)
    assert read_batch(unchecked, 8, 2).num_new_tokens == [3, 1]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (([], [], [0]), "slots"),
        (([0], [1, 2], [1, 2]), "cu_num_tokens"),
        (([0, 1], [1, 2], [0, 2, 2]), "cu_num_tokens"),
        (([0], [1, 2, 3], [0, 2]), "token_ids"),
        (([0], [1, 2], [0, 2], [2]), "logits_indices"),
    ],
)
def test_building_a_batch_checks_it(args: tuple, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        ForwardBatch.build(*args)
