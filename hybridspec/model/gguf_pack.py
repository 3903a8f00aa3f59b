"""A GGUF file's matrices packed straight from the mapped file into the block kernel's tiles.

``pack_matrix`` turns a ``GGUFMatrix`` (one tensor, or q/k/v stacked) into the very
``PackedWeight`` that ``Kernel.pack(matrix.decode())`` builds, byte for byte, without the
intermediate ``QuantizedWeight``: csrc/pack.c decodes each row's blocks, widens them to the
matrix's scheme, factors the scales and packs the codes, tile by tile on the kernel's threads,
with a scratch of one row per thread. Where it cannot (a type pack.c does not decode: Q8_0,
IQ4_NL, IQ4_XS), the numpy reference does it, one matrix at a time.

Memory: the file's pages that a conversion touches count in the process's resident size
(``VmHWM``) as long as they stay mapped in, so after each run of rows (``CHUNK_BYTES`` of the
file) they are given back with ``madvise(MADV_DONTNEED)`` (they stay in the page cache). The
peak is then what the packed weights hold plus one chunk. ``drop``: where the packed weights
are kept in a file of their own (``packed_file``), the chunk's pages also leave the page cache
(``MADV_PAGEOUT``): later loads map that file and never read these pages again, and the memory
they free is reused at once for the next chunk's pages and the packed file's own. Fresh memory
is what a first load pays for (on a virtual machine whose host takes free memory back, touching
a page the guest has not used lately costs a fault on the host too); reusing the file's pages
about halves what it touches.

``read_ahead``: the whole file asked into the page cache on a thread of its own, so that on a
first load the disk reads while the process works (the tokenizer, the packing of what was read
before) rather than one run at a time as the packing reaches it. Not with ``drop`` (the whole
file would then be fresh memory again): the packing asks for the next ``DROP_AHEAD`` runs
of rows as it goes.

Huge pages: the packed codes and factors are held in anonymous memory advised
``MADV_HUGEPAGE`` (``held``). A decode streams every matrix once a token; over gigabytes of
4 KB pages (an 8B model) each page costs an address translation, which 2 MB pages take away.
Where the system gives no huge pages, the memory is the same in 4 KB pages.

Dimensions: ``N`` rows, ``K`` columns, ``G = K / 32`` groups, ``X = K / group`` sub-groups per
row, tiles of ``ROWS`` = 16 rows.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import mmap
import os
import threading

import numpy as np
import torch
from gguf import GGMLQuantizationType

from hybridspec.model import huge_arena
from hybridspec.model.gguf_blocks import GGUF_TYPES, GGUFMatrix, GGUFPart
from hybridspec.model.qgemm import Kernel
from hybridspec.model.quant import GROUP_SIZE, ROWS, SUPER, PackedWeight

CHUNK_BYTES = 32 << 20  # of the file per call: the most of it resident at once
DROP_AHEAD = 4  # runs of rows asked for ahead of the packing where the file is read as it goes
READ_AHEAD_STEP = 128 << 10  # bytes per read-ahead request: the least device read-ahead size
_MADV_WILLNEED, _MADV_DONTNEED, _MADV_HUGEPAGE, _MADV_PAGEOUT = 3, 4, 14, 21
_HUGE = 2 << 20  # bytes of one huge page: below it a buffer is not worth the advice
# the modes of csrc/pack.c, in Kernel.pack's order of preference: int8 steps times a factor,
# float16, float32
_MODES = ((0, torch.int8), (1, torch.float16), (2, torch.float32))
_SYMMETRIC = ("Q5_0", "Q6_K")  # of the types pack.c decodes, those without offsets


class _Part(ctypes.Structure):
    """csrc/pack.c's ``pack_part_t``."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("type", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("rows", ctypes.c_int64),
        ("order", ctypes.c_void_p),
    ]


class _Out(ctypes.Structure):
    """csrc/pack.c's ``pack_out_t``."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("codes", "scales", "offsets", "ssup", "osup")]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def release(view: np.ndarray, advice: int = _MADV_DONTNEED, drop: bool = False) -> None:
    """Give back the pages of the mapped file under ``view`` (a slice of a read-only file
    mapping, nothing else): they leave the process's resident size and stay in the page cache,
    or with ``drop`` leave it too (``MADV_PAGEOUT`` first: clean pages no other process maps
    are freed). ``advice`` ``_MADV_WILLNEED`` instead starts reading them into the page cache
    (not into the process). A no-op on failure."""
    if view.size == 0:
        return
    start = view.ctypes.data
    first = start - start % mmap.PAGESIZE
    end = start + view.nbytes
    for each in (_MADV_PAGEOUT, advice) if drop else (advice,):
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), each)


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``): what a step
    of the load freed (the tokenizer's parse: about 35 MB for a 128k vocabulary) would
    otherwise stay resident under the weights. A no-op where the C library has no such call."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(ctypes.c_size_t(0))


def read_ahead(path: str | os.PathLike[str], kernel: Kernel) -> threading.Thread:
    """Have the disk read the whole file into the page cache on a thread of its own (started,
    and returned): csrc/pack.c's ``hs_read_ahead``, in C so that the thread holds the GIL
    once, not once per request. The pages go to the page cache, not into the process (its
    resident size does not grow); a file already cached costs a look-up per page. Where the
    file cannot be opened, nothing is read ahead (the packing reads it as it goes)."""

    def run() -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            size = ctypes.c_int64(os.fstat(fd).st_size)
            kernel.lib.hs_read_ahead(fd, size, ctypes.c_int64(READ_AHEAD_STEP))
        finally:
            os.close(fd)

    thread = threading.Thread(target=run, name="hs-gguf-read-ahead", daemon=True)
    thread.start()
    return thread


def held(shape: tuple[int, ...], dtype: torch.dtype, *, arena: bool = False) -> torch.Tensor:
    """An uninitialized tensor of ``shape`` in private anonymous memory advised
    ``MADV_HUGEPAGE`` before any page of it is touched (module docstring), or ``torch.empty``
    for a small one. The mapping lives as long as the tensor does. ``arena``: from the load's
    ``huge_arena`` while it has room (codes only: they are never thrown away)."""
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < _HUGE:
        return torch.empty(shape, dtype=dtype)
    taken = huge_arena.take(shape, dtype) if arena else None
    if taken is not None:
        return taken
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(region, "madvise"):  # a kernel without transparent huge pages: 4 KB pages
        with contextlib.suppress(OSError):
            region.madvise(_MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=dtype, count=count).view(shape)


def c_decodes(matrix: GGUFMatrix, kernel: Kernel) -> bool:
    """Whether csrc/pack.c decodes every part of ``matrix`` (else ``pack_matrix`` runs the
    numpy reference)."""
    return matrix.shape[0] > 0 and all(
        kernel.lib.hs_pack_type_known(GGMLQuantizationType[p.type_name].value) for p in matrix.parts
    )


def pack_matrix(
    matrix: GGUFMatrix, kernel: Kernel, *, mapped: bool = False, drop: bool = False
) -> PackedWeight:
    """``kernel.pack(matrix.decode())``, equal to the byte, in C where it decodes the types.

    ``mapped``: the parts' blocks are views of a file mapped read-only, whose pages are given
    back as they are converted (never for other memory: ``MADV_DONTNEED`` zeroes anonymous
    pages); ``drop`` (with ``mapped``): and dropped from the page cache (module docstring)."""
    if not c_decodes(matrix, kernel):
        packed = kernel.pack(matrix.decode())
        if mapped:
            for part in matrix.parts:
                release(part.blocks, drop=drop)
        return packed
    rows, cols = matrix.shape
    kinds = [p.type_name for p in matrix.parts]
    bits = 4 if all(GGUF_TYPES[k][2] == 4 for k in kinds) else 6  # 8-bit codes within 6 bits
    group = min(GGUF_TYPES[k][3] for k in kinds)
    asymmetric = any(k not in _SYMMETRIC for k in kinds)
    tiles, groups, subs = -(-rows // ROWS), cols // GROUP_SIZE, GROUP_SIZE // group
    codes = held((tiles, groups, ROWS * GROUP_SIZE * bits // 8), torch.uint8, arena=True)
    parts = (_Part * len(matrix.parts))(*(_part(p) for p in matrix.parts))
    threads = max(1, kernel.max_threads())
    scratch = torch.empty(threads * int(kernel.lib.hs_pack_scratch(cols, group)), dtype=torch.uint8)
    for mode, dtype in _MODES:
        scales = held((tiles, groups, subs * ROWS), dtype)  # pack.c fills them
        offsets = held(tuple(scales.shape), dtype) if asymmetric else None
        supers = [torch.empty((tiles, -(-groups // SUPER), ROWS)) for _ in range(2)]
        out = _Out(
            codes.data_ptr(),
            scales.data_ptr(),
            None if offsets is None else offsets.data_ptr(),
            supers[0].data_ptr(),
            supers[1].data_ptr(),
        )
        if _run(kernel, matrix, parts, (bits, group, mode), out, scratch, (mapped, drop)):
            factored = mode == 0
            return PackedWeight(
                codes,
                scales,
                offsets,
                supers[0] if factored else None,
                supers[1] if factored and offsets is not None else None,
                bits,
                group,
                rows,
                cols,
            )
    raise AssertionError("pack.c's float32 mode holds every value")


def _part(part: GGUFPart) -> _Part:
    order = None if part.order is None else part.order.ctypes.data
    kind = GGMLQuantizationType[part.type_name].value
    return _Part(part.blocks.ctypes.data, kind, 0, part.shape[0], order)


def _run(
    kernel: Kernel,
    matrix: GGUFMatrix,
    parts: ctypes.Array[_Part],
    scheme: tuple[int, int, int],  # bits, group, mode
    out: _Out,
    scratch: torch.Tensor,
    file: tuple[bool, bool],  # mapped, drop (``pack_matrix``)
) -> bool:
    """Every tile of ``matrix`` through csrc/pack.c in chunks of about ``CHUNK_BYTES`` of the
    file, each chunk's pages given back after it (the first one and the next one asked for
    before it, or ``DROP_AHEAD`` with ``drop``); False where the mode does not hold."""
    mapped, drop = file
    rows, cols = matrix.shape
    tiles = -(-rows // ROWS)
    row_bytes = max(p.blocks.nbytes // max(p.shape[0], 1) for p in matrix.parts)
    step = max(1, CHUNK_BYTES // (row_bytes * ROWS))
    bits, group, mode = scheme
    for first in range(0, tiles, step):
        last = min(tiles, first + step)
        if mapped:  # the next runs read ahead from disk while this one packs
            ahead = first if first == 0 else last
            window = (last + step * (DROP_AHEAD if drop else 1)) * ROWS
            _advise_rows(matrix, ahead * ROWS, window, _MADV_WILLNEED)
        failed = kernel.lib.hs_pack_gguf(
            ctypes.addressof(parts),
            len(parts),
            rows,
            cols,
            bits,
            group,
            mode,
            first,
            last,
            ctypes.addressof(out),
            scratch.data_ptr(),
        )
        if mapped:
            _advise_rows(matrix, first * ROWS, last * ROWS, _MADV_DONTNEED, drop)
        if failed:
            return False
    for part in matrix.parts if mapped else ():  # the permuted ones, read in their own order
        release(part.blocks, drop=drop)
    return True


def _advise_rows(matrix: GGUFMatrix, begin: int, end: int, advice: int, drop: bool = False) -> None:
    """``release`` the file pages of the matrix's rows ``[begin, end)`` (parts in file order)
    with ``advice`` (and ``drop``)."""
    for part in matrix.parts:
        count = part.shape[0]
        lo, hi = max(begin, 0), min(end, count)
        if part.order is None and lo < hi:
            per_row = part.blocks.nbytes // count
            release(part.blocks.reshape(-1)[lo * per_row : hi * per_row], advice, drop)
        begin, end = begin - count, end - count
