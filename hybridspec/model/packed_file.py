"""The packed weights of a GGUF file kept in a file of their own, mapped by later loads.

A load in place (``gguf_load``) turns every matrix into the kernel's tiles: seconds of CPU, and
gigabytes of fresh anonymous memory to fault in. The first load of a file packs its codes
straight into a shared mapping of a new file (``Writer``: pack.c writes the tiles there, so
there is no extra copy), appends the rest of the weights (scales, norms: what lives elsewhere)
and a header, and renames it into place. It never waits for the disk: the kernel writes the
pages back in the background. A later load maps that file read-only (``load``): no packing, and
the weights are the page cache's pages, shared with every process that maps them. On a
file system that keeps 2 MB folios in the page cache (ext4 on a recent kernel), the mapping is
in 2 MB pages like the anonymous huge pages it replaces; its start is 2 MB-aligned so that it
can be.

An entry is keyed by the GGUF file (its resolved path, size and modification time), ``FORMAT``,
the compiled kernel (its name carries its sources and flags; the ISA the tiles depend on) and
the source of the modules that decide the layout: an edit there is a new entry, never a stale
one. Entries live in ``default_cache_dir()/packed`` (``HYBRIDSPEC_CACHE_DIR``); entries of the
same file name beyond ``KEEP_ENTRIES`` are removed when one is written. An entry whose size,
header or index disagree (truncated, corrupt, of another format) is removed and rebuilt; a
cache that cannot be written (a full disk, a read-only folder) is logged and skipped.
``ModelConfig.packed_cache`` or ``HYBRIDSPEC_PACKED_CACHE=0`` turn it off.

An untied embedding is not in the file: it stays in the GGUF file's mapping (``gguf_rows``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from hybridspec.model.families import FAMILIES
from hybridspec.model.gguf import GGUFModel
from hybridspec.model.gguf_blocks import GGUFMatrix
from hybridspec.model.gguf_rows import MappedRows
from hybridspec.model.gguf_tokenizer import default_cache_dir
from hybridspec.model.llama_weights import LlamaDims, LlamaLayerWeights, LlamaWeights
from hybridspec.model.qgemm import Kernel
from hybridspec.model.quant import PackedWeight, QuantizedWeight

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when the file's layout changes
KEEP_ENTRIES = 2  # per GGUF file name: the current one and, say, another checkout's
ENV = "HYBRIDSPEC_PACKED_CACHE"  # "0", "false", "no" or "off": no packed-weight file
SUFFIX = ".packed"
DATA = 2 << 20  # file offset of the codes: offsets and addresses agree modulo a 2 MB page
_HEADER = struct.Struct("<8sIIQQQ16s")  # magic, format, 0, total size, index at, its length, key
_MAGIC = b"HSPACKED"
_STALE_S = 3600  # a staging file untouched this long was left by a process that died
_SOURCES = (  # the modules whose code decides the packed layout
    "packed_file.py",
    "gguf_load.py",
    "gguf_pack.py",
    "gguf_blocks.py",
    "gguf_rows.py",
    "quant.py",
    "llama_weights.py",
    "families.py",
    "csrc/pack.c",
)
_EMBED = "model.embed_tokens.weight"
_LAYER_FIELDS = tuple(f.name for f in dataclasses.fields(LlamaLayerWeights))
_PRIVATE_ANON = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_MAP_FIXED = 0x10  # Linux's and the BSDs' value; Python's mmap does not name it
_MADV_HUGEPAGE = 14


def enabled(setting: bool = True) -> bool:
    """Whether a load keeps and maps packed-weight files: ``setting`` and not turned off by
    ``HYBRIDSPEC_PACKED_CACHE``."""
    return setting and os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def entry_path(path: Path, kernel: Kernel, cache_dir: Path | None = None) -> Path:
    """Where the packed weights of the GGUF file ``path`` for ``kernel`` are kept."""
    stat = path.stat()
    digest = hashlib.sha256()
    parts = (path.resolve(), stat.st_size, stat.st_mtime_ns, FORMAT, kernel.path.name, kernel.isa)
    for part in parts:
        digest.update(f"{part}|".encode())
    here = Path(__file__).parent
    for source in _SOURCES:
        digest.update((here / source).read_bytes())
    return (
        (cache_dir or default_cache_dir())
        / "packed"
        / f"{path.stem}-{digest.hexdigest()[:32]}{SUFFIX}"
    )


def _key(entry: Path) -> bytes:
    return bytes.fromhex(entry.name.removesuffix(SUFFIX)[-32:])


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        *(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int),
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _map(fd: int, size: int, writable: bool) -> ctypes.Array[ctypes.c_char]:
    """The first ``size`` bytes of the file ``fd``, shared, at a 2 MB-aligned address (so that
    the page cache's 2 MB folios can be mapped whole), advised ``MADV_HUGEPAGE``; unmapped when
    the array and every tensor made from it are gone."""
    libc = _libc()
    reserved = libc.mmap(None, size + DATA, 0, _PRIVATE_ANON, -1, 0)  # PROT_NONE
    if reserved in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "cannot reserve address space for the packed weights")
    start = -(-reserved // DATA) * DATA
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    if libc.mmap(start, size, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0) != start:
        libc.munmap(reserved, size + DATA)
        raise OSError(ctypes.get_errno(), "cannot map the packed weights")
    if start > reserved:  # the reservation's parts outside the mapping
        libc.munmap(reserved, start - reserved)
    if reserved + DATA > start:
        libc.munmap(start + size, reserved + DATA - start)
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(size), _MADV_HUGEPAGE)
    array = (ctypes.c_char * size).from_address(start)
    weakref.finalize(array, libc.munmap, start, size)
    return array


def reserve(fd: int, size: int) -> None:
    """Have the file system set aside ``size`` bytes for the file ``fd`` (``fallocate``), so
    that a full disk is an ``OSError`` here, not a ``SIGBUS`` when the packing writes a page of
    the mapping. Where the file system cannot, the file stays sparse (blocks are taken as
    pages are written back)."""
    fallocate = getattr(ctypes.CDLL(None, use_errno=True), "fallocate", None)
    if fallocate is None:  # not Linux
        return
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fallocate(fd, 0, 0, size) != 0:
        error = ctypes.get_errno()
        if error not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise OSError(error, f"cannot set aside {size >> 20} MB: {os.strerror(error)}")


class Writer:
    """A packed-weight file being written: ``region`` (from ``DATA`` on) is where the codes go
    (``huge_arena.prefaulted(capacity, writer.region)``); ``finish`` appends what lies
    elsewhere and the index, and renames the file into place."""

    def __init__(self, entry: Path, capacity: int) -> None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        capacity = max(capacity, 4096)  # a region even where pack.c packs no matrix
        self.entry = entry
        fd, self.staging = tempfile.mkstemp(dir=entry.parent, prefix=f".{entry.name}-")
        self._fd = fd
        try:
            os.ftruncate(fd, DATA + capacity)
            reserve(fd, DATA + capacity)
            self._mapping = _map(fd, DATA + capacity, writable=True)
        except OSError:
            self.abandon()
            raise
        self.capacity = capacity
        self._tail = DATA
        self.region = (ctypes.c_char * capacity).from_buffer(self._mapping, DATA)

    @staticmethod
    def open(entry: Path, capacity: int) -> Writer | None:
        """A ``Writer`` for ``entry``, or None (logged) where the cache folder cannot take it."""
        try:
            return Writer(entry, capacity)
        except OSError as exc:
            logger.warning("cannot keep the packed weights in %s: %s", entry, exc)
            return None

    def finish(self, weights: LlamaWeights, used: int) -> None:
        """Append the tensors that are not in the region's first ``used`` bytes and the index,
        write the header, rename the file into place and prune older entries; a failure (a
        full disk) is logged and the file removed. The weights stay valid either way (the
        mapping lives on)."""
        self._tail = DATA + used
        try:
            index = json.dumps(_encode(weights, self._put)).encode()
            at = self._tail
            os.pwrite(self._fd, index, at)
            total = at + len(index)
            header = _HEADER.pack(_MAGIC, FORMAT, 0, total, at, len(index), _key(self.entry))
            os.pwrite(self._fd, header, 0)
            os.ftruncate(self._fd, total)  # the reserve never written: nothing on disk
            os.replace(self.staging, self.entry)
            prune(self.entry)
        except (OSError, ValueError) as exc:
            logger.warning("cannot keep the packed weights in %s: %s", self.entry, exc)
            self.abandon()
        finally:
            os.close(self._fd)

    def abandon(self) -> None:
        """Remove the staging file (its pages stay mapped while tensors use them)."""
        with contextlib.suppress(OSError):
            os.unlink(self.staging)

    def _put(self, tensor: torch.Tensor) -> list[Any]:
        """Where ``tensor`` is in the file: in the region already, else appended after it."""
        base = ctypes.addressof(self._mapping)
        address = tensor.data_ptr()
        if tensor.is_contiguous() and base + DATA <= address < base + DATA + self.capacity:
            offset = address - base
        else:
            offset = -(-self._tail // 64) * 64
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            written = os.pwrite(self._fd, data.data, offset) if data.size else 0
            if written != data.size:
                raise OSError("short write (the disk is full?)")
            self._tail = offset + data.size
        return [offset, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]


def _encode(weights: LlamaWeights, put: Any) -> dict[str, Any]:
    """The weights as JSON: tensors as ``put``'s [offset, dtype, shape]."""

    def matrix(value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            return {"tensor": put(value)}
        if isinstance(value, MappedRows):
            return {"mapped_rows": _EMBED}
        if isinstance(value, PackedWeight | QuantizedWeight):
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
            return {type(value).__name__: {k: matrix(v) for k, v in fields.items()}}
        if isinstance(value, int | float | str):
            return value
        raise ValueError(f"cannot keep a {type(value).__name__} in a packed-weight file")

    tied = weights.lm_head is weights.embed
    return {
        "dims": dataclasses.asdict(weights.dims),
        "family": weights.family.name,
        "embed": matrix(weights.embed),
        "lm_head": None if tied else matrix(weights.lm_head),
        "norm": matrix(weights.norm),
        "inv_freq": matrix(weights.inv_freq),
        "local_inv_freq": matrix(weights.local_inv_freq),
        "layers": [
            {f: matrix(getattr(layer, f)) for f in _LAYER_FIELDS} for layer in weights.layers
        ],
    }


def load(entry: Path, model: GGUFModel, kernel: Kernel) -> LlamaWeights | None:
    """The weights kept in ``entry``, mapped read-only; None where there is no entry, or (then
    removed, logged) one that is truncated, corrupt or of another format."""
    try:
        fd = os.open(entry, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _HEADER.size, 0)
        if len(head) != _HEADER.size:
            raise ValueError("shorter than its header")
        magic, version, _, total, at, length, key = _HEADER.unpack(head)
        if (magic, version, key) != (_MAGIC, FORMAT, _key(entry)) or total != size:
            raise ValueError("its header disagrees with its name or size")
        if not DATA <= at <= total - length:
            raise ValueError("its index lies outside it")
        index = json.loads(os.pread(fd, length, at))
        mapping = _map(fd, size, writable=False)
        return _decode(index, mapping, model, kernel, limit=at)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("rebuilding the unreadable packed weights %s: %s", entry, exc)
        with contextlib.suppress(OSError):
            entry.unlink()
        return None
    finally:
        os.close(fd)


def _decode(
    index: dict[str, Any],
    mapping: ctypes.Array[ctypes.c_char],
    model: GGUFModel,
    kernel: Kernel,
    limit: int,
) -> LlamaWeights:
    def tensor(where: list[Any]) -> torch.Tensor:
        offset, dtype, shape = where
        kind = getattr(torch, dtype)
        count = 1
        for n in shape:
            count *= int(n)
        if offset < DATA or offset + count * kind.itemsize > limit:
            raise ValueError(f"a tensor at {offset} runs past the data")
        if count == 0:
            return torch.empty(shape, dtype=kind)
        return torch.frombuffer(mapping, dtype=kind, count=count, offset=offset).view(shape)

    def matrix(value: Any) -> Any:
        if value is None or isinstance(value, int | float | str):
            return value
        if "tensor" in value:
            return tensor(value["tensor"])
        if "mapped_rows" in value:
            source = model.state_dict[value["mapped_rows"]]
            rows = MappedRows.of(source, kernel) if isinstance(source, GGUFMatrix) else None
            if rows is None:
                raise ValueError("its embedding is no longer one the GGUF file maps")
            return rows
        ((kind, fields),) = value.items()
        made = {k: matrix(v) for k, v in fields.items()}
        return PackedWeight(**made) if kind == "PackedWeight" else QuantizedWeight(**made)

    embed = matrix(index["embed"])
    dims: dict[str, Any] = {  # JSON made the dims' tuples lists
        k: tuple(v) if isinstance(v, list) else v for k, v in index["dims"].items()
    }
    lm_head = embed if index["lm_head"] is None else matrix(index["lm_head"])
    return LlamaWeights(
        dims=LlamaDims(**dims),
        embed=embed,
        layers=tuple(
            LlamaLayerWeights(**{k: matrix(v) for k, v in layer.items()})
            for layer in index["layers"]
        ),
        norm=matrix(index["norm"]),
        lm_head=lm_head,
        inv_freq=matrix(index["inv_freq"]),
        family=FAMILIES[index["family"]],
        local_inv_freq=matrix(index["local_inv_freq"]),
    )


def prune(entry: Path) -> None:
    """Remove the entries of ``entry``'s GGUF file name beyond ``KEEP_ENTRIES`` (oldest first,
    ``entry`` kept), and staging files of that name left by a process that died."""
    stem = entry.name[: -len(SUFFIX) - 33]
    try:
        older = [p for p in entry.parent.glob(f"{stem}-*{SUFFIX}") if p != entry]
        older.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in older[KEEP_ENTRIES - 1 :]:
            old.unlink()
        for staging in entry.parent.glob(f".{stem}-*{SUFFIX}-*"):
            if time.time() - staging.stat().st_mtime > _STALE_S:
                staging.unlink()
    except OSError:  # another process pruned first
        pass
