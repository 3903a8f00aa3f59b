"""An embedding table left in the mapped GGUF file, its rows decoded as a forward looks them up.

A forward reads the embedding one row per token, so an untied embedding (Llama-3.1-8B's:
128,256 rows, 295 MB in Q4_K) need not be packed and held like the matrices it multiplies:
``MappedRows`` keeps the file's blocks where they are (a view of the read-only mapping) and
csrc/pack.c's ``hs_gguf_rows`` decodes the rows asked for into bfloat16, the values
``Kernel.dequantize_rows`` gives from the same matrix packed (a zero's sign aside, which no
forward can tell: the first layer squares the row and adds to it). The file's pages of the rows
read are the only memory it costs (page cache, shared, given back under memory pressure). A
tied embedding is the LM head, which a forward reads whole: it stays packed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from gguf import GGMLQuantizationType

from hybridspec.model.gguf_blocks import GGUF_TYPES, GGUFMatrix, GGUFPart

if TYPE_CHECKING:
    from hybridspec.model.qgemm import Kernel

_DEQUANTIZE_ROWS = 4096  # rows decoded per call by ``dequantize``: a bounded bfloat16 buffer


@dataclass(frozen=True, slots=True, eq=False)
class MappedRows:
    """One GGUF tensor ``[N, K]`` still in the mapped file, read a row at a time."""

    part: GGUFPart
    kernel: Kernel

    @staticmethod
    def of(matrix: GGUFMatrix, kernel: Kernel) -> MappedRows | None:
        """``matrix`` held in the file where the kernel decodes its type and it is one tensor
        in file order; None otherwise (the caller packs it)."""
        if len(matrix.parts) != 1 or matrix.parts[0].order is not None:
            return None
        part = matrix.parts[0]
        if not kernel.lib.hs_pack_type_known(GGMLQuantizationType[part.type_name].value):
            return None
        return MappedRows(part, kernel)

    @property
    def shape(self) -> tuple[int, int]:
        return self.part.shape

    @property
    def nbytes(self) -> int:
        """The file's bytes of the table (not resident: read a row at a time)."""
        return int(self.part.blocks.nbytes)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` in bfloat16, ``[len(index), K]`` (an embedding lookup); raises
        IndexError for an index outside the table."""
        count, cols = self.shape
        index = index.to(torch.int64).contiguous()
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= count):
            raise IndexError(f"index out of range for {count} rows")
        out = torch.empty((index.numel(), cols), dtype=torch.bfloat16)
        if index.numel() == 0:
            return out
        lib = self.kernel.lib
        group = GGUF_TYPES[self.part.type_name][3]
        scratch = torch.empty(int(lib.hs_pack_scratch(cols, group)), dtype=torch.uint8)
        kind = GGMLQuantizationType[self.part.type_name].value
        lib.hs_gguf_rows(
            self.part.blocks.ctypes.data,
            kind,
            cols,
            index.data_ptr(),
            index.numel(),
            out.data_ptr(),
            scratch.data_ptr(),
        )
        return out

    def dequantize_rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``rows(index)`` in ``dtype`` (``QuantizedWeight.dequantize_rows``'s form)."""
        return self.rows(index).to(dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole table dense in ``dtype`` (a transformers state dict wants it so)."""
        count = self.shape[0]
        return torch.cat(
            [
                self.dequantize_rows(torch.arange(lo, min(lo + _DEQUANTIZE_ROWS, count)), dtype)
                for lo in range(0, count, _DEQUANTIZE_ROWS)
            ]
        )
