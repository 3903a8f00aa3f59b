"""``DraftLayout``: where each sequence's drafts and target rows sit in a round's flat ragged
batch, built once per round (vLLM's ``SpecDecodeMetadata``) and read by verification, the
controls, acceptance and the engine's commit.

Sequence i with k_i drafts owns drafts ``cu[i] .. cu[i + 1] - 1`` of the flat draft list and the
k_i + 1 target rows ``cu[i] + i .. cu[i + 1] + i``; row j of them holds the target's logits after
the committed tokens and d_1 .. d_j, so draft t is checked by row ``t + seq_ids[t]``.

Worked example: num_drafts [2, 0, 3], so cu = [0, 2, 2, 5] and 8 target rows: seq 0 owns rows
0..2, seq 1 row 3, seq 2 rows 4..7. Then row_offsets = [0, 3, 4, 8], seq_ids = [0, 0, 2, 2, 2],
positions = [0, 1, 0, 1, 2], draft_rows = [0, 1, 4, 5, 6], first_rows = [0, 3, 4] and
bonus_rows = first_rows + num_drafts = [2, 3, 7].
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridspec.errors import check


@dataclass(frozen=True, slots=True)
class DraftLayout:
    """A batch's ragged layout, as Python offsets (for slicing lists and rows on the host) and as
    int64 tensors on the logits' device (for gathering); build it with ``from_counts``."""

    num_drafts: tuple[int, ...]  # [num_seqs] k_i
    offsets: tuple[int, ...]  # [num_seqs + 1] cu: sequence i's drafts are offsets[i] .. [i + 1]
    row_offsets: tuple[int, ...]  # [num_seqs + 1]: sequence i's target rows, offsets[i] + i ..
    num_drafts_t: torch.Tensor  # [num_seqs] int64, k_i
    seq_ids: torch.Tensor  # [total_num_drafts] int64, the sequence of each draft
    positions: torch.Tensor  # [total_num_drafts] int64, each draft's index in its sequence
    draft_rows: torch.Tensor  # [total_num_drafts] int64, the target row that checks each draft
    first_rows: torch.Tensor  # [num_seqs] int64, each sequence's first target row

    @staticmethod
    def from_counts(num_drafts: Sequence[int], device: torch.device | str = "cpu") -> DraftLayout:
        """The layout of sequences with ``num_drafts`` drafts each (non-negative ints)."""
        counts = tuple(int(k) for k in num_drafts)
        offsets = tuple(itertools.accumulate(counts, initial=0))
        num_seqs, total = len(counts), offsets[-1]
        counts_t = torch.tensor(counts, dtype=torch.long, device=device)
        seq_index = torch.arange(num_seqs, device=device)
        seq_ids = torch.repeat_interleave(seq_index, counts_t, output_size=total)
        first_drafts = torch.tensor(offsets[:-1], dtype=torch.long, device=device)
        draft_index = torch.arange(total, device=device)
        return DraftLayout(
            num_drafts=counts,
            offsets=offsets,
            row_offsets=tuple(o + i for i, o in enumerate(offsets)),
            num_drafts_t=counts_t,
            seq_ids=seq_ids,
            positions=draft_index - first_drafts[seq_ids],
            draft_rows=draft_index + seq_ids,
            first_rows=first_drafts + seq_index,
        )

    @staticmethod
    def from_cu_num_drafts(
        cu_num_drafts: torch.Tensor, device: torch.device | str = "cpu"
    ) -> DraftLayout:
        """The layout of cumulative offsets ``[num_seqs + 1]`` int64 from 0, checked
        (InvalidRequestError naming ``cu_num_drafts``)."""
        cu = cu_num_drafts
        check(
            cu.dim() == 1 and cu.numel() >= 2 and cu.dtype == torch.long,
            "cu_num_drafts",
            f"expected int64 [num_seqs + 1] with num_seqs >= 1, got {cu.dtype} {tuple(cu.shape)}",
        )
        offsets = cu.tolist()
        counts = [b - a for a, b in itertools.pairwise(offsets)]
        check(
            offsets[0] == 0 and min(counts) >= 0,
            "cu_num_drafts",
            f"expected non-decreasing offsets starting at 0, got {offsets}",
        )
        return DraftLayout.from_counts(counts, device)

    @property
    def num_seqs(self) -> int:
        return len(self.num_drafts)

    @property
    def total_num_drafts(self) -> int:
        return self.offsets[-1]

    @property
    def num_rows(self) -> int:
        return self.row_offsets[-1]

    @property
    def device(self) -> torch.device:
        return self.num_drafts_t.device

    @property
    def cu_num_drafts(self) -> torch.Tensor:
        """[num_seqs + 1] int64 on the CPU: the cumulative draft counts, from 0."""
        return torch.tensor(self.offsets, dtype=torch.long)

    @property
    def bonus_rows(self) -> torch.Tensor:
        """[num_seqs] int64: each sequence's last target row, after all its drafts."""
        return self.first_rows + self.num_drafts_t

    def split(self, flat: Sequence[int]) -> list[list[int]]:
        """Per sequence, its slice of ``flat`` (one entry per draft, e.g. the draft token ids)."""
        return [list(flat[a:b]) for a, b in itertools.pairwise(self.offsets)]

    def select(self, members: Sequence[int]) -> tuple[DraftLayout, list[int], list[int]]:
        """The layout of the sequences ``members`` alone, with the indices of their drafts and
        of their target rows in this batch."""
        offsets, rows = self.offsets, self.row_offsets
        draft_index = [t for i in members for t in range(offsets[i], offsets[i + 1])]
        row_index = [r for i in members for r in range(rows[i], rows[i + 1])]
        sub = DraftLayout.from_counts([self.num_drafts[i] for i in members], self.device)
        return sub, draft_index, row_index
