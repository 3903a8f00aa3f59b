"""The model runtime interface: a causal LM with a slot-indexed KV cache.

Both the target and a draft model run behind this interface. A runtime owns a KV cache with
``max_num_seqs`` slots; each live sequence holds one slot and a cached length. One ``forward``
appends a ragged batch of new tokens to several slots at once and returns their logits; a
sequence's cache is rolled back by ``truncate``.

Dimensions: ``num_seqs`` sequences in a batch, ``num_tokens`` new tokens over all of them
(flat, ragged), ``num_logits`` positions whose logits are wanted.

Worked example: slots [3, 0] with cached lengths [10, 4] and new tokens [a b c | d]
(``cu_num_tokens = [0, 3, 4]``) writes a, b, c at positions 10, 11, 12 of slot 3 and d at
position 4 of slot 0; afterwards the lengths are [13, 5]. ``logits_indices = [2, 3]`` returns
the logits after c and after d, shape [2, vocab_size].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """New tokens for several sequences, flat and ragged."""

    slots: torch.Tensor  # [num_seqs] int64, distinct cache slots
    token_ids: torch.Tensor  # [num_tokens] int64
    cu_num_tokens: torch.Tensor  # [num_seqs + 1] int64, cumulative, cu[0] = 0
    logits_indices: torch.Tensor | None = None  # [num_logits] int64 into token_ids; None = all

    @staticmethod
    def from_lists(
        slots: list[int], token_ids: list[list[int]], logits_indices: list[int] | None = None
    ) -> ForwardBatch:
        """Build a batch from per-sequence token lists (tests and simple callers)."""
        cu = [0]
        for ids in token_ids:
            cu.append(cu[-1] + len(ids))
        flat = [t for ids in token_ids for t in ids]
        return ForwardBatch(
            slots=torch.tensor(slots, dtype=torch.long),
            token_ids=torch.tensor(flat, dtype=torch.long),
            cu_num_tokens=torch.tensor(cu, dtype=torch.long),
            logits_indices=None
            if logits_indices is None
            else torch.tensor(logits_indices, dtype=torch.long),
        )


class ModelRuntime(Protocol):
    """A causal LM with a slot-indexed, truncatable KV cache."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_seq_len(self) -> int:
        """Most tokens one slot can hold (the context length)."""
        ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def allocate(self) -> int:
        """Reserve a free slot with cached length 0; raises CapacityError when none is free."""
        ...

    def free(self, slot: int) -> None:
        """Release a slot; its contents are discarded."""
        ...

    def num_free_slots(self) -> int: ...

    def seq_len(self, slot: int) -> int:
        """Number of tokens cached in ``slot``."""
        ...

    def truncate(self, slot: int, length: int) -> None:
        """Roll ``slot`` back to its first ``length`` tokens (``0 <= length <= seq_len``)."""
        ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Append the batch's tokens to their slots and return float32 logits.

        Returns ``[num_logits, vocab_size]`` (``[num_tokens, vocab_size]`` when
        ``logits_indices`` is None). Raises CapacityError when a slot would overflow.
        """
        ...
