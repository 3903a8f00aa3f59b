"""Target features for proposers: the target's hidden states at committed positions, handed to
the proposers that ask for them (``Proposer.feature_layers``) at no extra forward.

A forward names the union of the layers that its sequences' proposers ask for
(``ForwardBatch.hidden_layers``, from ``batch.forward_layers``) and returns their outputs for
every fed token. The rows of a sequence's committed tokens are kept, in position order, until
its next ``commit``, which hands them over in ``CommitInfo.hidden_states`` (columns: the
proposer's own layers, in its order) with ``CommitInfo.hidden_position``, the position of the
first row. A row of a rejected draft is never kept. Over a sequence's life the commits cover
positions ``0, 1, 2, ...`` without gap or overlap, up to the last committed token but one (the
last is fed by the next forward).

Worked example, one layer asked: a 10-token prompt fed as a prefill chunk of 6, then a decode
forward of ``[p6 .. p9, d1, d2, d3]`` whose verification accepts ``d1, d2`` and corrects the
third. The chunk's rows 0-5 wait; the decode forward keeps rows for positions 6-11 (``p6 ..
p9, d1, d2``) and drops ``d3``'s; the commit of ``[d1, d2, c]`` hands over positions 0-11
(12 rows, ``hidden_position = 0``). The next forward feeds ``c`` (position 12) with new drafts,
and the next commit starts at ``hidden_position = 12``.

A request served from the prefix cache starts with the cached positions' rows pending, as if
its prefill had computed them; a request whose entry the cache may keep keeps the rows it hands
(``Request.kept_hidden``) for the entry (``kept_features``).

Proposers that ask for no layer cost nothing: a forward none of whose sequences' proposers ask
computes no hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridspec.engine.batch import RoundBatch
from hybridspec.engine.prefix_cache import CachedFeatures
from hybridspec.engine.request import Request


def keep_committed_rows(
    batch: RoundBatch, hidden_states: torch.Tensor, rejected: Sequence[int]
) -> None:
    """Keep, until its next commit, each request's rows of ``batch`` that hold committed tokens:
    all it fed but its last ``rejected[i]`` (rejected drafts), in its proposer's columns.

    ``rejected``: per sequence of the batch, in its order. ``hidden_states``: [num_tokens,
    len(batch.forward.hidden_layers), hidden_size].
    """
    cu, layers = batch.cu, batch.forward.hidden_layers
    for i, request in enumerate(batch.requests):
        proposer = request.proposer
        end = cu[i + 1] - rejected[i]
        if not proposer.feature_layers or end <= cu[i]:
            continue
        rows = hidden_states[cu[i] : end]
        if proposer.feature_layers != layers:
            rows = rows[:, [layers.index(layer) for layer in proposer.feature_layers]]
        request.pending_hidden.append(rows)


def take_rows(request: Request) -> tuple[torch.Tensor | None, int]:
    """The rows kept since the request's last commit and the position of the first; forgets
    them. (None, position) when none were kept."""
    position = request.num_hidden_handed
    if not request.pending_hidden:
        return None, position
    rows = (
        request.pending_hidden[0]
        if len(request.pending_hidden) == 1
        else torch.cat(request.pending_hidden)
    )
    request.pending_hidden.clear()
    request.num_hidden_handed += rows.shape[0]
    if request.kept_hidden is not None:
        request.kept_hidden.append(rows)
    return rows, position


def kept_features(request: Request) -> CachedFeatures | None:
    """The rows of every position the request computed (handed or still pending), for the
    prefix cache to keep with its entry; None where it did not keep them."""
    if request.kept_hidden is None:
        return None
    rows = request.kept_hidden + request.pending_hidden
    if not rows:
        return None
    return CachedFeatures(request.proposer.feature_layers, torch.cat(rows))
