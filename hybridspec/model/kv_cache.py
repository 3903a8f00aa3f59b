"""A preallocated, slot-indexed KV cache with per-slot lengths.

Contents: ``SlotTable`` (which slots are taken, how full: host ints), ``KVCache`` (the tensors)
and ``numpy_view`` (a CPU tensor's memory as the kernels read it). The ways of attending over
the cache are in ``attention``.

Dimensions: ``num_layers`` decoder layers, ``max_num_seqs`` slots, ``num_kv_heads`` (``KV``)
key/value heads, ``max_seq_len`` (``S``) positions per slot, ``head_dim`` (``hd``) channels per
head; ``T`` new tokens, ``L`` keys attended.

Each slot is one live sequence. Its first ``seq_len(slot)`` positions hold valid keys and values;
positions past that hold stale values from before a rollback (or were never written), and every
reader masks them out, so ``truncate`` only moves the length back.

Worked example: a slot at length 12 that verified 4 draft tokens (length 16) and accepted 1 of
them plus a recovered token is truncated to 14; positions 14 and 15 keep the rejected keys until the
next forward overwrites them.
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np
import torch

from hybridspec.errors import CapacityError
from hybridspec.model.kernel_abi import cache_layout


class SlotTable:
    """Which cache slots are taken and how many positions each holds (host-side ints only).

    Plain Python ints, so that bookkeeping never syncs with the device.
    """

    def __init__(self, max_num_seqs: int, max_seq_len: int) -> None:
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected an integer >= 1, got {max_num_seqs!r}")
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len: expected an integer >= 1, got {max_seq_len!r}")
        self.max_num_seqs = max_num_seqs
        self.max_seq_len = max_seq_len
        self._lengths = [0] * max_num_seqs
        self._in_use = [False] * max_num_seqs
        self._free = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out the lowest slot

    def allocate(self) -> int:
        """Reserve a free slot with length 0; raises CapacityError when all are taken."""
        if not self._free:
            raise CapacityError(f"all {self.max_num_seqs} KV-cache slots are in use")
        slot = self._free.pop()
        self._in_use[slot] = True
        self._lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Release ``slot``; its contents are discarded."""
        self.check_slot(slot)
        self._in_use[slot] = False
        self._lengths[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)

    def num_free_slots(self) -> int:
        return len(self._free)

    def seq_len(self, slot: int) -> int:
        """Number of valid positions in ``slot``."""
        self.check_slot(slot)
        return self._lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        """Roll ``slot`` back to its first ``length`` positions."""
        current = self.seq_len(slot)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= current:
            raise ValueError(f"length: expected an integer in [0, {current}], got {length!r}")
        self._lengths[slot] = length

    def copy_length(self, source: int, dest: int, length: int) -> None:
        """Give ``dest`` the length ``length`` of a prefix copied from ``source`` (checked)."""
        self.check_slot(dest)
        current = self.seq_len(source)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= current:
            raise ValueError(f"length: expected an integer in [0, {current}], got {length!r}")
        if source == dest:
            raise ValueError(f"dest: expected a slot other than the source {source}, got {dest}")
        self._lengths[dest] = length

    def is_free(self, slot: int) -> bool:
        """Whether ``slot`` (an index in ``[0, max_num_seqs)``) is free."""
        return not self._in_use[slot]

    def check_slot(self, slot: int) -> None:
        """Raise ValueError unless ``slot`` is an allocated slot index."""
        if (
            isinstance(slot, bool)
            or not isinstance(slot, int)
            or not 0 <= slot < self.max_num_seqs
            or not self._in_use[slot]
        ):
            raise ValueError(
                f"slot: expected an allocated slot in [0, {self.max_num_seqs}), got {slot!r}"
            )

    def reserve(self, slots: list[int], num_new_tokens: list[int]) -> list[int]:
        """Check that each slot can take its new tokens; return the slots' current lengths.

        Raises ValueError for an unallocated or repeated slot and CapacityError when a slot would
        grow past ``max_seq_len``. Nothing changes until ``commit``.
        """
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots: expected distinct slots, got {slots}")
        starts = []
        for slot, num in zip(slots, num_new_tokens, strict=True):
            start = self.seq_len(slot)
            if start + num > self.max_seq_len:
                raise CapacityError(
                    f"slot {slot} holds {start} tokens and cannot take {num} more: "
                    f"max_seq_len is {self.max_seq_len}"
                )
            starts.append(start)
        return starts

    def commit(self, slots: list[int], new_lengths: list[int]) -> None:
        """Record the lengths after a forward has written its keys and values."""
        for slot, length in zip(slots, new_lengths, strict=True):
            self._lengths[slot] = length


class KVCache:
    """Key/value tensors for every layer and slot, with a ``SlotTable`` saying how full each is.

    On CPU (POSIX) the tensors lie in private anonymous mappings of their own (``_host_empty``):
    page aligned, and a page is backed by memory only once written, so a cache sized for the
    full context costs what the sequences touch (``resident_bytes``), and ``release_pages``
    gives a free slot's pages back to the system. Elsewhere they start uninitialised
    (``torch.empty``), and may hold NaN bit patterns: no reader looks past a slot's length.

    ``transposed_keys`` stores keys as ``[layers, slots, KV, hd, S]`` (values keep ``[..., S,
    hd]``), the layout the row-invariant kernel reads (``attention_kernels``); ``key_view``
    gives them in the usual ``[KV, L, hd]`` order either way.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        max_num_seqs: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        transposed_keys: bool = False,
    ) -> None:
        self.slots = SlotTable(max_num_seqs, max_seq_len)
        shape = (num_layers, max_num_seqs, num_kv_heads, max_seq_len, head_dim)
        self.transposed_keys = transposed_keys
        key_shape = (*shape[:3], head_dim, max_seq_len) if transposed_keys else shape
        on_cpu = torch.device(device).type == "cpu"
        self._mappings: tuple[mmap.mmap, ...] = ()
        if on_cpu and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MADV_DONTNEED"):
            self.keys, key_map = _host_empty(key_shape, dtype)
            self.values, value_map = _host_empty(shape, dtype)
            self._mappings = (key_map, value_map)
        else:
            self.keys = torch.empty(key_shape, dtype=dtype, device=device)
            self.values = torch.empty(shape, dtype=dtype, device=device)
        # Per-layer views, indexed once here rather than on every layer of every forward.
        self.layer_keys: tuple[torch.Tensor, ...] = tuple(self.keys.unbind(0))
        self.layer_values: tuple[torch.Tensor, ...] = tuple(self.values.unbind(0))
        # numpy views of the same memory for ``KernelAttention`` (CPU, transposed keys only).
        kernel_ready = transposed_keys and on_cpu
        self.kernel_keys = tuple(map(numpy_view, self.layer_keys)) if kernel_ready else ()
        self.kernel_values = tuple(map(numpy_view, self.layer_values)) if kernel_ready else ()
        # Per layer, pointers and strides as the C kernel's calls take them (csrc/cache_layout.h).
        layers = zip(self.layer_keys, self.layer_values, strict=True)
        self.kernel_layouts = tuple(cache_layout(*kv) for kv in layers) if kernel_ready else ()
        # Per slot: positions [0, n) may have been written since its pages were last released
        # (``resident_bytes`` counts their pages), and that count, kept for as long as n holds.
        self._touched_len = [0] * max_num_seqs
        self._resident: dict[int, tuple[int, int]] = {}

    def commit(self, slots: list[int], new_lengths: list[int]) -> None:
        """Record the lengths after a forward has written keys and values up to them."""
        self.slots.commit(slots, new_lengths)
        for slot, length in zip(slots, new_lengths, strict=True):
            self._touch(slot, length)

    def _touch(self, slot: int, end: int) -> None:
        self._touched_len[slot] = max(self._touched_len[slot], end)

    def copy_prefix(self, source: int, dest: int, length: int) -> None:
        """Copy the first ``length`` positions of ``source`` into ``dest`` (every layer), which
        then holds exactly them: the choices of one prompt share its prefill this way
        (``engine.choices``). Later writes to either slot never reach the other."""
        self.slots.copy_length(source, dest, length)
        if self.transposed_keys:
            self.keys[:, dest, ..., :length] = self.keys[:, source, ..., :length]
        else:
            self.keys[:, dest, :, :length] = self.keys[:, source, :, :length]
        self.values[:, dest, :, :length] = self.values[:, source, :, :length]
        self._touch(dest, length)

    def resident_bytes(self, slot: int) -> int:
        """Bytes of the memory pages that ``slot``'s positions written since its pages were last
        released occupy (CPU): what the slot adds to the process's resident memory, allocated or
        free. A page once written stays resident when the slot is freed or truncated, until
        ``release_pages``; this counts whole pages: with transposed keys each of the ``layers *
        KV * hd`` key rows of ``S`` positions is touched from its first position on, so one
        token costs a page per row (23 MB for SmolLM2-135M at 8,192 positions), where values
        cost ``hd`` per head. Computed from the layout (and kept while the slot's length holds).

        Worked example (bfloat16, 2 layers, 1 head, hd 4, S 4096: key rows of 8 KiB, a slot's
        values one 32 KiB run per layer): 10 positions written touch 1 page of each of the 8 key
        rows and 1 page of values per layer, 10 pages of 4 KiB in all.
        """
        length = self._touched_len[slot]
        known = self._resident.get(slot)
        if known is None or known[0] != length:
            known = (length, self._pages_of(slot, length))
            self._resident[slot] = known
        return known[1]

    def _pages_of(self, slot: int, length: int) -> int:
        """Bytes of the distinct pages that positions ``0 .. length - 1`` of ``slot`` occupy."""
        if length == 0:
            return 0
        itemsize = self.keys.element_size()
        num_slots, num_kv = self.keys.shape[1], self.keys.shape[2]
        max_seq_len = self.slots.max_seq_len
        head_dim = self.values.shape[-1]
        layers = np.arange(self.keys.shape[0])
        # One run of bytes per key row (transposed: [KV, hd] rows of S positions) or per head.
        rows_per_slot = num_kv * head_dim if self.transposed_keys else num_kv
        row_bytes = (
            max_seq_len * itemsize if self.transposed_keys else max_seq_len * head_dim * itemsize
        )
        key_span = length * itemsize if self.transposed_keys else length * head_dim * itemsize
        rows = (layers[:, None] * num_slots + slot) * rows_per_slot + np.arange(rows_per_slot)
        key_starts = self.keys.data_ptr() + rows.ravel() * row_bytes
        heads = (layers[:, None] * num_slots + slot) * num_kv + np.arange(num_kv)
        value_starts = self.values.data_ptr() + heads.ravel() * (max_seq_len * head_dim * itemsize)
        return _pages_bytes(key_starts, key_span) + _pages_bytes(
            value_starts, length * head_dim * itemsize
        )

    def release_pages(self, slot: int) -> None:
        """Give a free ``slot``'s memory pages back to the system (CPU; elsewhere nothing): its
        keys and values read as zeros after, and ``resident_bytes(slot)`` is 0. Only the pages
        wholly inside the slot's memory go: a page it shares with a neighbouring slot (where a
        layer's slot is not a whole number of pages) stays, and is that neighbour's to count."""
        if not self.slots.is_free(slot):
            raise ValueError(f"slot: expected a free slot, got {slot!r}, which is allocated")
        if not self._mappings or self._touched_len[slot] == 0:
            return
        page = mmap.PAGESIZE
        for tensor, mapping in zip((self.keys, self.values), self._mappings, strict=True):
            base = tensor.data_ptr()
            for layer in range(tensor.shape[0]):
                region = tensor[layer, slot]
                begin = region.data_ptr() - base
                end = begin + region.numel() * region.element_size()
                first, last = -(-begin // page) * page, end // page * page
                if last > first:
                    mapping.madvise(mmap.MADV_DONTNEED, first, last - first)
        self._touched_len[slot] = 0

    def key_view(self, layer: int, slot: int, end: int) -> torch.Tensor:
        """Keys of positions ``0 .. end - 1`` of ``slot`` at ``layer``, ``[KV, end, hd]``: a
        view, or a contiguous copy when keys are stored transposed.

        ``OneSequenceAttention`` handles both layouts, though the runtime pairs a transposed
        cache only with ``KernelAttention``; the tests read either layout through this."""
        keys = self.layer_keys[layer][slot]
        if self.transposed_keys:
            return keys[..., :end].transpose(-1, -2).contiguous()
        return keys[:, :end]

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [n, KV, hd]`` at positions ``start .. start + n - 1`` of ``slot``."""
        end = start + k.shape[0]
        keys = self.layer_keys[layer][slot]
        if self.transposed_keys:
            keys[..., start:end] = k.permute(1, 2, 0)
        else:
            keys[:, start:end] = k.transpose(0, 1)
        self.layer_values[layer][slot][:, start:end] = v.transpose(0, 1)

    def scatter(
        self,
        layer: int,
        token_slots: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store token ``t``'s ``k[t], v[t] [KV, hd]`` at ``positions[t]`` of ``token_slots[t]``."""
        keys = self.layer_keys[layer]
        if self.transposed_keys:
            keys[token_slots, :, :, positions] = k  # advanced dims first: [T, KV, hd]
        else:
            keys[token_slots, :, positions] = k
        self.layer_values[layer][token_slots, :, positions] = v


def _pages_bytes(starts: np.ndarray, span: int) -> int:
    """Bytes of the distinct memory pages that runs of ``span`` bytes from each of ``starts``
    (addresses) touch."""
    page = mmap.PAGESIZE
    first, last = starts // page, (starts + span - 1) // page
    widths = last - first + 1
    pages = np.repeat(first, widths) + (
        np.arange(widths.sum()) - np.repeat(np.cumsum(widths) - widths, widths)
    )
    return len(np.unique(pages)) * page


def _host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """A CPU tensor of ``shape`` over a private anonymous mapping of its own, and the mapping:
    page aligned, zero-filled, none of it resident until written.

    The mapping is advised ``MADV_NOHUGEPAGE``: a cache is written sparsely (with transposed
    keys, a token touches one page per key row), and where the system's transparent huge pages
    are ``always`` each such touch would make 2 MB resident, not 4 KB (448 MB, not 112 MB, for
    a 3B model's first token), and ``resident_bytes`` would count wrong."""
    count = int(np.prod(shape))
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; elsewhere no transparent huge pages
        with contextlib.suppress(OSError):  # a kernel built without them
            mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape), mapping


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array for the kernels: bfloat16 as its uint16 bits."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()
