"""The model runtime interface: a causal LM with a slot-indexed KV cache.

Both the target and a draft model run behind this interface. A runtime owns a KV cache with
``max_num_seqs`` slots; each live sequence holds one slot and a cached length. One ``forward``
appends a ragged batch of new tokens to several slots at once and returns a ``ForwardOutput``:
their logits and, where the batch asks, the outputs of chosen decoder layers (the features an
EAGLE-style proposer reads); a sequence's cache is rolled back by ``truncate``. Observers added
by ``add_forward_observer`` learn each forward's batch and wall time (benchmarks, tests).

Dimensions: ``num_seqs`` sequences in a batch, ``num_tokens`` new tokens over all of them
(flat, ragged), ``num_logits`` positions whose logits are wanted, ``num_layers`` decoder layers
of the model, ``hidden_size`` its width.

Worked example: slots [3, 0] with cached lengths [10, 4] and new tokens [a b c | d]
(``cu_num_tokens = [0, 3, 4]``) writes a, b, c at positions 10, 11, 12 of slot 3 and d at
position 4 of slot 0; afterwards the lengths are [13, 5]. ``logits_indices = [2, 3]`` returns
the logits after c and after d, shape [2, vocab_size]. ``hidden_layers = (-1,)`` adds the last
decoder layer's output for all four tokens, shape [4, 1, hidden_size]: row 2 is c's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from hybridspec.model.kv_cache import SlotTable


@dataclass(frozen=True, slots=True)
class BatchInts:
    """A ``ForwardBatch``'s bookkeeping as host ints, checked once where the batch was built
    (``ForwardBatch.build``), so that a runtime reads them instead of the tensors each forward."""

    slots: tuple[int, ...]  # [num_seqs], at least one
    num_new_tokens: tuple[int, ...]  # [num_seqs], each >= 1
    min_token_id: int  # the smallest and largest of token_ids, which a runtime bounds by its
    max_token_id: int  # vocabulary


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """New tokens for several sequences, flat and ragged. Build it with ``build`` (checked
    once, carrying its host ints) or ``from_lists``; one built field by field is checked by
    every forward instead."""

    slots: torch.Tensor  # [num_seqs] int64, distinct cache slots
    token_ids: torch.Tensor  # [num_tokens] int64
    cu_num_tokens: torch.Tensor  # [num_seqs + 1] int64, cumulative, cu[0] = 0
    logits_indices: torch.Tensor | None = None  # [num_logits] int64 into token_ids; None = all
    # Decoder layers whose outputs are wanted for every token (``ForwardOutput.hidden_states``).
    # Layer ``i`` (0-based; negative counts from the end) gives the residual stream after layer
    # ``i``, before the final norm: ``(-1,)`` is the last layer's output as EAGLE reads it,
    # ``(2, num_layers // 2, -3)`` a low, a middle and a high layer as EAGLE-3 fuses them. In
    # transformers' ``output_hidden_states`` (index 0: the embeddings) layer ``i`` is entry
    # ``i + 1``, except that transformers by default gives the last entry after the final norm.
    hidden_layers: tuple[int, ...] = ()
    host: BatchInts | None = field(default=None, compare=False, repr=False)  # set by ``build``

    @staticmethod
    def build(
        slots: Sequence[int],
        token_ids: Sequence[int],
        cu_num_tokens: Sequence[int],
        logits_indices: Sequence[int] | None = None,
        hidden_layers: tuple[int, ...] = (),
    ) -> ForwardBatch:
        """A batch from host ints, checked here (ValueError naming the field) so that a
        runtime trusts its ``host`` and checks only what depends on the model (the vocabulary,
        the layers)."""
        rows = None if logits_indices is None else list(logits_indices)
        ints = _checked_ints(list(slots), list(cu_num_tokens), list(token_ids), rows)
        return ForwardBatch(
            slots=torch.tensor(slots, dtype=torch.long),
            token_ids=torch.tensor(token_ids, dtype=torch.long),
            cu_num_tokens=torch.tensor(cu_num_tokens, dtype=torch.long),
            logits_indices=None if rows is None else torch.tensor(rows, dtype=torch.long),
            hidden_layers=hidden_layers,
            host=ints,
        )

    @staticmethod
    def from_lists(
        slots: list[int],
        token_ids: list[list[int]],
        logits_indices: list[int] | None = None,
        hidden_layers: tuple[int, ...] = (),
    ) -> ForwardBatch:
        """Build a batch from per-sequence token lists (tests and simple callers)."""
        cu = list(itertools.accumulate((len(ids) for ids in token_ids), initial=0))
        flat = [t for ids in token_ids for t in ids]
        return ForwardBatch.build(slots, flat, cu, logits_indices, hidden_layers)


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    """What one forward returns. ``hidden_states`` is None unless the batch named layers."""

    logits: torch.Tensor  # [num_logits, vocab_size] float32
    # [num_tokens, len(hidden_layers), hidden_size] in the model's dtype, row t for token_ids[t]
    # (every fed token, whatever logits_indices says); column j for batch.hidden_layers[j].
    hidden_states: torch.Tensor | None = None


# Called after each forward with its batch and its wall time in seconds.
ForwardObserver = Callable[[ForwardBatch, float], None]


class ObserverHandle:
    """Returned by ``add_forward_observer``; ``remove()`` stops the calls (again: no effect)."""

    __slots__ = ("_key", "_observers")

    def __init__(self, observers: dict[int, ForwardObserver], key: int) -> None:
        self._observers, self._key = observers, key

    def remove(self) -> None:
        self._observers.pop(self._key, None)


class ForwardObservers:
    """A runtime's forward observers, and the clock around its forwards while it has any.

    With none, ``call`` only calls the forward. With some, it synchronises a CUDA device before
    reading the clock on each side, so that the forward's kernels count in its time rather than
    in whatever runs next (a CPU forward is synchronous already).
    """

    __slots__ = ("_device", "_next_key", "_observers")

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._observers: dict[int, ForwardObserver] = {}  # in the order they were added
        self._next_key = 0

    def add(self, observer: ForwardObserver) -> ObserverHandle:
        key, self._next_key = self._next_key, self._next_key + 1
        self._observers[key] = observer
        return ObserverHandle(self._observers, key)

    def call(
        self, forward: Callable[[ForwardBatch], ForwardOutput], batch: ForwardBatch
    ) -> ForwardOutput:
        """``forward(batch)``, timed and reported to every observer when there are any."""
        if not self._observers:
            return forward(batch)
        synchronize(self._device)
        start = time.perf_counter()
        output = forward(batch)
        synchronize(self._device)
        seconds = time.perf_counter() - start
        for observer in tuple(self._observers.values()):  # one may remove itself
            observer(batch, seconds)
        return output


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so that a clock read next counts it: a CUDA device
    runs kernels asynchronously; a CPU is synchronous already."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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

    def copy_prefix(self, source: int, dest: int, length: int) -> None:
        """Make ``dest`` (allocated) hold a copy of the first ``length`` tokens cached in
        ``source`` (``0 <= length <= seq_len(source)``), so that both go on from the same
        prefix without one forward's writes or a truncation of one reaching the other."""
        ...

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Append the batch's tokens to their slots; their logits and any hidden states asked.

        ``logits`` is float32 ``[num_logits, vocab_size]`` (``[num_tokens, vocab_size]`` when
        ``logits_indices`` is None). Raises CapacityError when a slot would overflow.
        """
        ...

    def add_forward_observer(self, observer: ForwardObserver) -> ObserverHandle:
        """Call ``observer(batch, seconds)`` after every forward until the handle is removed."""
        ...


class SlotRuntime:
    """The slot bookkeeping of a ``ModelRuntime`` whose KV-cache slots a ``SlotTable`` holds
    (``_slots``, set by the runtime): its bounds, slots and cached lengths, one place for
    every runtime."""

    _slots: SlotTable

    @property
    def max_seq_len(self) -> int:
        return self._slots.max_seq_len

    @property
    def max_num_seqs(self) -> int:
        return self._slots.max_num_seqs

    def allocate(self) -> int:
        return self._slots.allocate()

    def free(self, slot: int) -> None:
        self._slots.free(slot)

    def num_free_slots(self) -> int:
        return self._slots.num_free_slots()

    def seq_len(self, slot: int) -> int:
        return self._slots.seq_len(slot)

    def truncate(self, slot: int, length: int) -> None:
        self._slots.truncate(slot, length)


@dataclass(frozen=True, slots=True)
class HostBatch:
    """A ``ForwardBatch`` after its checks, with its bookkeeping read to host ints."""

    slots: list[int]  # [num_seqs]
    num_new_tokens: list[int]  # [num_seqs], each >= 1
    token_ids: torch.Tensor  # [num_tokens] int64, each in [0, vocab_size)
    logits_indices: torch.Tensor | None  # [num_logits] int64 in [0, num_tokens); None = all
    hidden_layers: tuple[int, ...]  # each in [0, num_layers): negative indices resolved


def read_batch(batch: ForwardBatch, vocab_size: int, num_layers: int) -> HostBatch:
    """``batch`` read to host ints and checked against the model (ValueError naming the field):
    a built batch's ints as ``build`` checked them, another's read from its tensors and checked
    field by field."""
    ints = batch.host if batch.host is not None else _read_ints(batch)
    if ints.min_token_id < 0 or ints.max_token_id >= vocab_size:
        raise ValueError(
            f"token_ids: expected ids in [0, {vocab_size}), "
            f"got [{ints.min_token_id}, {ints.max_token_id}]"
        )
    layers = batch.hidden_layers
    if not isinstance(layers, tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) and -num_layers <= i < num_layers
        for i in layers
    ):
        raise ValueError(
            f"hidden_layers: expected a tuple of layer indices in [{-num_layers}, {num_layers}), "
            f"got {layers!r}"
        )
    return HostBatch(
        list(ints.slots),
        list(ints.num_new_tokens),
        batch.token_ids,
        batch.logits_indices,
        tuple(i % num_layers for i in layers),
    )


def _read_ints(batch: ForwardBatch) -> BatchInts:
    """The host ints of a batch built field by field, checked."""
    for name in ("slots", "token_ids", "cu_num_tokens"):
        _check_index_tensor(getattr(batch, name), name)
    if batch.logits_indices is not None:
        _check_index_tensor(batch.logits_indices, "logits_indices")
    rows = None if batch.logits_indices is None else batch.logits_indices.tolist()
    # host ints: cheaper than tensor reductions for a few tokens
    return _checked_ints(
        batch.slots.tolist(), batch.cu_num_tokens.tolist(), batch.token_ids.tolist(), rows
    )


def _checked_ints(
    slots: list[int], cu: list[int], ids: list[int], rows: list[int] | None
) -> BatchInts:
    """The batch's host ints after the checks that do not depend on the model."""
    if not slots:
        raise ValueError("slots: expected at least one sequence, got none")
    if len(cu) != len(slots) + 1 or cu[0] != 0:
        raise ValueError(
            f"cu_num_tokens: expected {len(slots) + 1} cumulative offsets starting at 0, got {cu}"
        )
    num_new_tokens = [b - a for a, b in itertools.pairwise(cu)]
    if min(num_new_tokens) < 1:
        raise ValueError(f"cu_num_tokens: expected each sequence to add >= 1 token, got {cu}")
    if len(ids) != cu[-1]:
        raise ValueError(f"token_ids: expected {cu[-1]} tokens (cu_num_tokens[-1]), got {len(ids)}")
    if rows and (min(rows) < 0 or max(rows) >= cu[-1]):
        raise ValueError(f"logits_indices: expected indices in [0, {cu[-1]}), got {rows}")
    return BatchInts(tuple(slots), tuple(num_new_tokens), min(ids), max(ids))


def _check_index_tensor(tensor: object, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a 1-D int64 tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1 or tensor.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{name}: expected a 1-D int64 tensor, got shape {tuple(tensor.shape)} {tensor.dtype}"
        )
