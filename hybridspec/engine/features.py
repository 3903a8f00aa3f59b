"""Target features for proposers: the target's hidden states at committed positions, handed to
the proposers that ask for them (``Proposer.feature_layers``) at no extra forward.

A forward names the union of the layers that its sequences' proposers ask for
(``ForwardBatch.hidden_layers``, from ``batch.forward_layers``) and returns their outputs for
every fed token. The rows of a sequence's committed tokens are kept by the round's commit
(``RoundRunner.commit``), in position order, until its next ``commit``, which hands them over
in ``CommitInfo.hidden_states`` (columns: the proposer's own layers, in its order) with
``CommitInfo.hidden_position``, the position of the first row. A row of a rejected draft
is never kept. Over a sequence's life the commits cover positions ``s, s + 1, ...`` without gap
or overlap, up to the last committed token but one (the last is fed by the next forward): ``s``
is 0 but for a request served from a prefix-cache entry that kept no features, whose rows
start at its first uncached position (``FeatureRows.skip``).

Worked example, one layer asked: a 10-token prompt fed as a prefill chunk of 6, then a decode
forward of ``[p6 .. p9, d1, d2, d3]`` whose verification accepts ``d1, d2`` and corrects the
third. The chunk's rows 0-5 wait; the decode forward keeps rows for positions 6-11 (``p6 ..
p9, d1, d2``) and drops ``d3``'s; the commit of ``[d1, d2, c]`` hands over positions 0-11
(12 rows, ``hidden_position = 0``). The next forward feeds ``c`` (position 12) with new drafts,
and the next commit starts at ``hidden_position = 12``.

A request served from the prefix cache starts with the cached positions' rows pending, as if
its prefill had computed them, where the entry kept them (else its rows start after the cached
positions); a request whose entry the cache may keep keeps the rows it hands
(``FeatureRows.kept``) for the entry (``FeatureRows.all_rows``).

Proposers that ask for no layer cost nothing: a forward none of whose sequences' proposers ask
computes no hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class FeatureRows:
    """One request's target features (module docstring): the rows at committed positions not
    yet handed to its proposer, how many positions were handed, and, where the prefix cache may
    keep its entry, the rows handed so far (else None)."""

    pending: list[torch.Tensor] = field(default_factory=list)
    num_handed: int = 0
    kept: list[torch.Tensor] | None = None

    def skip(self, num_positions: int) -> None:
        """Start the rows at position ``num_positions``: the positions before were served from a
        prefix-cache entry that kept no features, so none are pending, and none are kept for
        the request's own entry (it would lack them)."""
        self.num_handed, self.kept = num_positions, None

    def take(self) -> tuple[torch.Tensor | None, int]:
        """The rows kept since the last commit and the position of the first; forgets them.
        (None, position) when none were kept."""
        position = self.num_handed
        if not self.pending:
            return None, position
        rows = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending)
        self.pending.clear()
        self.num_handed += rows.shape[0]
        if self.kept is not None:
            self.kept.append(rows)
        return rows, position

    def all_rows(self) -> torch.Tensor | None:
        """The rows of every position computed (handed or still pending), for the prefix
        cache to keep with the request's entry (``CachedFeatures``); None where they were not
        kept."""
        rows = (self.kept + self.pending) if self.kept is not None else []
        return torch.cat(rows) if rows else None
