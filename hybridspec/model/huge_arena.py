"""Memory for a load's packed codes, faulted in on a spare core before the packing needs it.

The packed weights live in transparent huge pages (``gguf_pack.held``). Faulting one in means
the kernel finds and zeroes 2 MB, and where that memory has not been touched lately (a
virtual machine whose host takes free memory back, so each fresh page also costs the host a
fault) it costs several times what 4 KB pages do: about a second of system time per GB. The
packing runs on every core, so each of those seconds is paid inside it. But the steps before
it (the tokenizer, the metadata) run on one thread: an ``Arena`` maps one region for the
codes, advised ``MADV_HUGEPAGE``, and while those steps run a thread of its own faults it in
(``MADV_POPULATE_WRITE``, a system call: the thread does not hold the interpreter lock); the
packing then takes its codes from it (``take``), already resident.

Sizing: the region is a lower bound of what the codes need (``gguf_load``), so it
never holds pages the load would not have held anyway (the peak is unchanged); the codes that
do not fit are allocated as before. ``finish`` gives back any part of it left unused.

The region may also be given: a shared mapping of the packed-weight file a first load writes
(``packed_file``), which the thread faults in alike (the page cache's pages, not anonymous ones).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import threading
from collections.abc import Iterator

import torch

_MADV_DONTNEED, _MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 4, 14, 23
_STEP = 8 << 20  # bytes faulted per call: how soon ``stop_faulting`` takes effect
_ALIGN = 4096  # each taken tensor starts on a page


class Arena:
    """One region of ``nbytes``, faulted in from its start on a thread of its own until
    ``stop_faulting``; ``take`` hands out tensors from its start onwards. ``region``: a
    writable mapping (a ctypes array) to use, else a private anonymous one is made; ``fault``:
    the most bytes the thread faults in (a region sized by an upper bound is faulted only as
    far as the codes surely reach, so that the peak holds no page they leave unused)."""

    def __init__(
        self,
        nbytes: int,
        region: ctypes.Array[ctypes.c_char] | None = None,
        fault: int | None = None,
    ) -> None:
        self.nbytes = nbytes - nbytes % _ALIGN
        self._fault = self.nbytes if fault is None else min(fault, self.nbytes)
        if region is None:
            anonymous = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            self._region: mmap.mmap | ctypes.Array[ctypes.c_char] = mmap.mmap(
                -1, max(self.nbytes, _ALIGN), anonymous
            )
        else:
            self._region = region
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._region))
        madvise = ctypes.CDLL(None, use_errno=True).madvise  # 4 KB pages where there are no others
        madvise(ctypes.c_void_p(self._address), ctypes.c_size_t(self.nbytes), _MADV_HUGEPAGE)
        self._used = 0
        self.faulted = 0  # bytes from the start faulted in so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fault_in, name="hs-arena", daemon=True)
        self._thread.start()

    def _fault_in(self) -> None:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        for offset in range(0, self._fault, _STEP):
            if self._stop.is_set():
                return
            size = min(_STEP, self._fault - offset)
            if madvise(
                ctypes.c_void_p(self._address + offset), ctypes.c_size_t(size), _MADV_POPULATE_WRITE
            ):
                return  # a kernel before 5.14: the packing faults the pages itself
            self.faulted = offset + size

    @property
    def used(self) -> int:
        """Bytes from the region's start handed out so far (each tensor page-aligned)."""
        return self._used

    def stop_faulting(self) -> None:
        """Stop faulting pages in (the packing, on every core, is about to start) and wait
        for the thread's last call."""
        self._stop.set()
        self._thread.join()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialized tensor of ``shape`` from the region's unused part, else None."""
        count = math.prod(shape)
        end = self._used + count * dtype.itemsize
        if count == 0 or end > self.nbytes:
            return None
        tensor = torch.frombuffer(self._region, dtype=dtype, count=count, offset=self._used)
        self._used = end + (-end) % _ALIGN
        return tensor.view(shape)

    def finish(self) -> None:
        """Stop faulting and give back the pages of the part no tensor was taken from."""
        self.stop_faulting()
        if self._used < self.nbytes:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
            start = ctypes.c_void_p(self._address + self._used)
            madvise(start, ctypes.c_size_t(self.nbytes - self._used), _MADV_DONTNEED)


_active: Arena | None = None


@contextlib.contextmanager
def prefaulted(
    nbytes: int, region: ctypes.Array[ctypes.c_char] | None = None, fault: int | None = None
) -> Iterator[Arena]:
    """An ``Arena`` of ``nbytes`` (in ``region``, faulted in up to ``fault`` bytes, where
    given) that ``take`` hands codes out of inside the block; finished (its unused part given
    back) when the block ends."""
    global _active
    arena = Arena(nbytes, region, fault)
    _active = arena
    try:
        yield arena
    finally:
        _active = None
        arena.finish()


def take(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A tensor from the load's arena (``prefaulted``), else None: there is none, or it is
    used up."""
    return None if _active is None else _active.take(shape, dtype)
