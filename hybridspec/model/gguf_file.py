"""A GGUF file checked before anything large is allocated: every tensor within the file and of
a known type (``GGUFFile``), and the memory a load will hold within what is free
(``check_memory``). Each failure is a ModelLoadError naming the file and, where there is one,
the tensor.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType

from hybridspec.errors import ModelLoadError

_MB = 1 << 20


# GGUF value types: struct format of the scalars (8: string, 9: array)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)
_ITEM_TYPES = {  # GGUF types whose tensors are read as arrays of numbers (the rest as bytes)
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of a GGUF file, as ``gguf.ReaderTensor`` has it: ``data`` a view of the
    mapped file (numbers for F32/F16/integer types, bytes ``[..., row bytes]`` otherwise)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # uint64, GGUF's order: the fastest dimension first
    n_bytes: int
    data: np.ndarray


class GGUFFile:
    """A GGUF file's metadata and tensors, read with the file mapped: each tensor checked
    against the file's size and its type before its view is made (ModelLoadError naming file
    and tensor). Arrays in the metadata (the vocabulary) are stepped over, not decoded, until
    asked for: ``get`` decodes one key's value.

    ``gguf.GGUFReader`` builds a numpy view per string of the vocabulary, seconds for 128k
    tokens; this reads the same fields and tensors in milliseconds."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            self.data = np.memmap(path, mode="r")
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {self.path!r}: {exc}") from exc
        self._raw = self.data.data  # a memoryview of the mapping
        self._fields: dict[str, tuple[int, int]] = {}  # key: (value type, offset of the value)
        try:
            self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, ValueError, OverflowError) as exc:
            raise ModelLoadError(
                f"cannot read GGUF file {self.path!r}: its header is truncated or corrupt ({exc})"
            ) from exc

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata ``key`` (a number, string, or list), else ``default``."""
        if key not in self._fields:
            return default
        kind, at = self._fields[key]
        return self._value(kind, at)[0]

    def _unpack(self, fmt: str, at: int) -> tuple[Any, int]:
        return struct.unpack_from("<" + fmt, self._raw, at)[0], at + struct.calcsize(fmt)

    def _string(self, at: int) -> tuple[str, int]:
        size, at = self._unpack("Q", at)
        if at + size > len(self._raw):
            raise ValueError(f"a string of {size} bytes past the end of the file")
        return bytes(self._raw[at : at + size]).decode("utf-8"), at + size

    def _value(self, kind: int, at: int) -> tuple[Any, int]:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind], at)
        if kind == _STRING:
            return self._string(at)
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, at = self._unpack("I", at)
        count, at = self._unpack("Q", at)
        if item in _SCALARS:
            fmt = "<" + _SCALARS[item]
            end = at + count * struct.calcsize(fmt)
            if end > len(self._raw):
                raise ValueError(f"an array of {count} items past the end of the file")
            return np.frombuffer(self._raw[at:end], dtype=fmt).tolist(), end
        values = []
        for _ in range(count):
            value, at = self._value(item, at)
            values.append(value)
        return values, at

    def _skip(self, kind: int, at: int) -> int:
        """The offset after a value, stepping over an array's strings without decoding them."""
        if kind != _ARRAY:
            return self._value(kind, at)[1]
        item, at = self._unpack("I", at)
        count, at = self._unpack("Q", at)
        if item in _SCALARS:
            return at + count * struct.calcsize(_SCALARS[item])
        if item != _STRING:
            for _ in range(count):
                at = self._skip(item, at)
            return at
        for _ in range(count):
            size, at = self._unpack("Q", at)
            at += size
        return at

    def _parse(self) -> list[GGUFTensor]:
        magic, at = self._unpack("I", 0)
        if magic != GGUF_MAGIC:
            raise ValueError("not a GGUF file (magic invalid)")
        version, at = self._unpack("I", at)
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (or big-endian)")
        tensor_count, at = self._unpack("Q", at)
        kv_count, at = self._unpack("Q", at)
        for _ in range(kv_count):
            key, at = self._string(at)
            kind, at = self._unpack("I", at)
            self._fields[key] = (kind, at)
            at = self._skip(kind, at)
        infos = []
        for _ in range(tensor_count):
            name, at = self._string(at)
            dims, at = self._unpack("I", at)
            shape = np.frombuffer(self._raw[at : at + 8 * dims], dtype="<u8").copy()
            at += 8 * dims
            kind, at = self._unpack("I", at)
            offset, at = self._unpack("Q", at)
            infos.append((name, shape, kind, offset))
        align = int(self.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align} is not a power of two")
        start = -(-at // align) * align
        return [self._tensor(start, *info) for info in infos]

    def _tensor(
        self, start: int, name: str, shape: np.ndarray, raw: int, offset: int
    ) -> GGUFTensor:
        where = f"GGUF file {self.path!r}: tensor {name!r}"
        try:
            kind = GGMLQuantizationType(raw)
        except ValueError:
            raise ModelLoadError(f"{where} has unknown type {raw}") from None
        per_block, block_bytes = GGML_QUANT_SIZES[kind]
        count = int(np.prod(shape, dtype=np.float64))
        if len(shape) == 0 or int(shape[0]) % per_block or count != int(np.prod(shape)):
            raise ModelLoadError(
                f"{where}: shape {shape.tolist()} is not a whole number of {kind.name} blocks "
                f"of {per_block}"
            )
        begin = start + offset
        end = begin + count // per_block * block_bytes
        if end > len(self._raw):
            raise ModelLoadError(
                f"{where} ends at byte {end} but the file has {len(self._raw)} bytes: the "
                "file is truncated or corrupt"
            )
        dims = tuple(int(d) for d in reversed(shape.tolist()))
        item = _ITEM_TYPES.get(kind)
        if item is None:
            data = self.data[begin:end].reshape(*dims[:-1], dims[-1] // per_block * block_bytes)
        else:
            data = self.data[begin:end].view(item).reshape(dims)
        return GGUFTensor(name, kind, shape, end - begin, data)


def available_memory() -> tuple[int, str]:
    """Bytes of memory a load can take now, and where that figure comes from: MemAvailable in
    /proc/meminfo, or the cgroup's limit less its usage where that is less."""
    available, source = -1, "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available, source = int(line.split()[1]) * 1024, "MemAvailable"
    except (OSError, ValueError, IndexError):
        pass
    cgroup = _cgroup_room()
    if cgroup is not None and (available < 0 or cgroup < available):
        available, source = cgroup, "the cgroup's memory.max less memory.current"
    return available, source


def _cgroup_room() -> int | None:
    """The cgroup v2 limit less the usage of this process's cgroup; None where unlimited."""
    try:
        relative = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        folder = Path("/sys/fs/cgroup") / relative.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((folder / "memory.current").read_text())
    except (OSError, ValueError, IndexError):
        return None


def check_memory(path: str | os.PathLike[str], needed: int) -> None:
    """Raise ModelLoadError where a load that holds ``needed`` bytes does not fit now."""
    available, source = available_memory()
    if 0 <= available < needed:
        raise ModelLoadError(
            f"GGUF file {os.fspath(path)!r}: loading it needs about {needed // _MB} MB of "
            f"memory, but {available // _MB} MB is available ({source})"
        )
