"""A GGUF file's weights and tokenizer loaded for ``model.loader``.

``load_in_place``: the file checked (``checked_gguf``), its pages read ahead from disk in the
background (``gguf_pack.read_ahead``) and part of the packed codes' huge pages faulted in on a
spare core (``huge_arena``) while the tokenizer loads, then its quantized matrices
packed straight from the mapped file into the block kernel's tiles, one at a time
(``convert_in_place``, ``model.gguf_pack``). ``load_or_convert``: other settings (another
device, ``quantize`` "none"/"int4"/"int8", no kernel) dequantize and fuse the file in numpy and
keep the result in the weight cache (``model.weight_cache``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from hybridspec.errors import ModelLoadError
from hybridspec.model import huge_arena, qgemm, weight_cache
from hybridspec.model.gguf import GGUFModel, read_gguf
from hybridspec.model.gguf_blocks import GGUF_TYPES, GGUFMatrix
from hybridspec.model.gguf_file import check_memory
from hybridspec.model.gguf_meta import StoredConfig
from hybridspec.model.gguf_pack import c_decodes, pack_matrix, read_ahead, trim_heap
from hybridspec.model.gguf_rows import MappedRows
from hybridspec.model.gguf_tokenizer import load_gguf_tokenizer
from hybridspec.model.llama_weights import LlamaWeights
from hybridspec.model.weight_cache import ConvertedGGUF

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

QUANTIZE_BITS = {"gguf": None, "int4": 4, "int8": 8}  # ``quantize`` -> bits of dense matrices
_LOAD_OVERHEAD = 256 << 20  # bytes a load holds beyond the weights: scratch, one run of the file


def load_in_place(
    path: Path, dtype: torch.dtype, block: qgemm.Kernel
) -> tuple[ConvertedGGUF, PreTrainedTokenizerBase]:
    """The file's weights packed in place and its tokenizer.

    The tokenizer loads before the weights are packed, so that its first conversion's memory
    (transformers reading the vocabulary) is freed (``trim_heap``) before the weights are
    held; meanwhile the disk reads the file ahead of the packing (a first load waits on the
    disk, not the CPU), and another core faults in the huge pages of part of the codes
    (``huge_arena``: at most what the codes take, so the peak is the same)."""
    model = checked_gguf(path)
    read_ahead(path, block)
    with huge_arena.prefaulted(codes_lower_bound(model, block)) as arena:
        tokenizer = load_gguf_tokenizer(path)
        trim_heap()
        arena.stop_faulting()  # the packing runs on every core
        return convert_in_place(path, dtype, block, model), tokenizer


def codes_lower_bound(model: GGUFModel, block: qgemm.Kernel) -> int:
    """Bytes that the packed codes of the layers' matrices take at least: 4 bits a weight for
    a 4-bit type, 6 for the others (``gguf_pack`` holds 5- to 8-bit codes in 6 bits, and a
    fused matrix of mixed types in its widest part's), counting only the matrices that
    csrc/pack.c packs (``gguf_pack.c_decodes``). The embedding and LM head are left out:
    whether they are packed depends on the model."""
    total = 0
    for name, matrix in model.state_dict.items():
        if ".layers." not in name or not isinstance(matrix, GGUFMatrix):
            continue
        if not c_decodes(matrix, block):
            continue
        for part in matrix.parts:
            bits = 4 if GGUF_TYPES[part.type_name][2] == 4 else 6
            total += part.shape[0] * part.shape[1] * bits // 8
    return total


def checked_gguf(path: Path) -> GGUFModel:
    """The GGUF file read lazily (``read_gguf``: every tensor checked against the file), and
    its weights checked to fit in the memory available now (``gguf_file.check_memory``)."""
    model = read_gguf(path, keep_quantized=True, lazy=True, stored_config=True)
    # the packed weights hold about the file's bytes; fused q/k/v of mixed types a little more
    check_memory(path, model.tensor_bytes + model.tensor_bytes // 16 + _LOAD_OVERHEAD)
    return model


def convert_in_place(
    path: Path, dtype: torch.dtype, block: qgemm.Kernel, model: GGUFModel | None = None
) -> ConvertedGGUF:
    """A GGUF file's quantized matrices packed straight from the mapped file into the kernel's
    tiles, one at a time (``gguf_pack``): the process holds the packed weights and a bounded
    run of the file's pages; an untied embedding stays in the file (``gguf_rows``). ``model``:
    ``checked_gguf(path)``, read here when None."""
    if model is None:
        model = checked_gguf(path)
    config = model.config  # its saved attributes where an earlier load saved them: read alike
    try:
        weights = LlamaWeights.from_hf_state_dict(
            model.state_dict,
            cast("PretrainedConfig", config),
            dtype=dtype,
            pack=functools.partial(pack_matrix, kernel=block, mapped=True),
            rows=functools.partial(MappedRows.of, kernel=block),
        )
    except ValueError as exc:  # tensors that disagree with the metadata
        raise ModelLoadError(f"GGUF file {str(path)!r}: {exc}") from exc
    source = config.build if isinstance(config, StoredConfig) else config
    return ConvertedGGUF(pack_quantized(weights), source, model.eos_token_ids)


def load_or_convert(
    path: Path, dtype: torch.dtype, device: torch.device, quantize: str
) -> ConvertedGGUF:
    """The weight cache's entry for the file, else the file dequantized and fused in numpy."""

    def convert() -> ConvertedGGUF:
        model = read_gguf(path, keep_quantized=quantize != "none")
        config = cast("PretrainedConfig", model.config)  # the real one: no stored_config
        try:
            weights = LlamaWeights.from_hf_state_dict(
                model.state_dict,
                config,
                dtype=dtype,
                device=device,
                quantize_bits=QUANTIZE_BITS.get(quantize),
            )
        except ValueError as exc:  # tensors that disagree with the metadata
            raise ModelLoadError(f"GGUF file {str(path)!r}: {exc}") from exc
        return ConvertedGGUF(pack_quantized(weights), config, model.eos_token_ids)

    # the cache holds what the runtime multiplies: the kernel's tiles where it builds
    packed = quantize != "none" and device.type == "cpu" and qgemm.kernel() is not None
    variant = f"{quantize}-packed" if packed else quantize
    return weight_cache.load_or_convert(path, dtype, device, convert, quantize=variant)


def pack_quantized(weights: LlamaWeights) -> LlamaWeights:
    """``weights`` with every quantized matrix in the block kernel's tiles (``PackedWeight``)
    where the kernel builds, so that the runtime multiplies them as they are: each matrix is
    resident once, in the form it is read in, and no runtime packs a copy of its own."""
    block = qgemm.kernel()
    if block is None or weights.device.type != "cpu" or not weights.is_quantized:
        return weights
    return weights.map_quantized(block.pack)
