"""A GGUF file's weights and tokenizer loaded for ``model.loader``.

``load_in_place``: the file checked (``checked_gguf``), part of the packed codes' huge pages
faulted in on a spare core (``huge_arena``) while the tokenizer loads, then its quantized
matrices packed straight from the mapped file into the block kernel's tiles, one at a time
(``convert_in_place``, ``model.gguf_pack``) into the mapping of a packed-weight file that
later loads map instead of packing (``model.packed_file``); each run of the file read just
ahead of the packing and dropped from the page cache after it (the packed file stands in for
it). Without that file, the whole file is read ahead in the background
(``gguf_pack.read_ahead``) and stays in the page cache for the next load's packing.
``load_or_convert``: other settings (another device, ``quantize`` "none"/"int4"/"int8", no
kernel) dequantize and fuse the file in numpy and keep the result in the weight cache
(``model.weight_cache``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from hybridspec.errors import ModelLoadError
from hybridspec.model import huge_arena, packed_file, qgemm, weight_cache
from hybridspec.model.gguf import GGUFModel, read_gguf
from hybridspec.model.gguf_blocks import GGUF_TYPES, GGUFMatrix
from hybridspec.model.gguf_file import check_memory
from hybridspec.model.gguf_meta import StoredConfig
from hybridspec.model.gguf_pack import c_decodes, pack_matrix, read_ahead, trim_heap
from hybridspec.model.gguf_rows import MappedRows
from hybridspec.model.gguf_tokenizer import load_gguf_tokenizer
from hybridspec.model.llama_weights import LlamaWeights
from hybridspec.model.quant import ROWS
from hybridspec.model.weight_cache import ConvertedGGUF

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

QUANTIZE_BITS = {"gguf": None, "int4": 4, "int8": 8}  # ``quantize`` -> bits of dense matrices
_LOAD_OVERHEAD = 256 << 20  # bytes a load holds beyond the weights: scratch, one run of the file


def load_in_place(
    path: Path, dtype: torch.dtype, block: qgemm.Kernel, cache: bool = True
) -> tuple[ConvertedGGUF, PreTrainedTokenizerBase]:
    """The file's weights packed in place and its tokenizer.

    ``cache`` (and ``packed_file.enabled``): a later load maps the packed weights the first
    one kept (``packed_file``) and packs nothing; the first one packs its codes into that
    file's mapping. The tokenizer loads before the weights are packed, so that its first
    conversion's memory (transformers reading the vocabulary) is freed (``trim_heap``) before
    the weights are held; meanwhile (without a packed-weight file) the disk reads the file
    ahead of the packing, and another core faults in part of the codes' memory
    (``huge_arena``: at most what the codes take, so the peak is the same)."""
    model = checked_gguf(path)
    entry = packed_file.entry_path(path, block) if packed_file.enabled(cache) else None
    weights = None if entry is None else packed_file.load(entry, model, block)
    if weights is not None:
        tokenizer = load_gguf_tokenizer(path)
        return ConvertedGGUF(weights, _config_source(model), model.eos_token_ids), tokenizer
    writer = (
        None if entry is None else packed_file.Writer.open(entry, codes_upper_bound(model, block))
    )
    if writer is None:  # else each run of the file is read just before it is packed, then dropped
        read_ahead(path, block)
    bound = codes_lower_bound(model, block)  # the arena never faults in more
    size, region = (bound, None) if writer is None else (writer.capacity, writer.region)
    with huge_arena.prefaulted(size, region, bound) as arena:
        tokenizer = load_gguf_tokenizer(path)
        trim_heap()
        arena.stop_faulting()  # the packing runs on every core
        try:
            converted = convert_in_place(path, dtype, block, model, drop=writer is not None)
        except BaseException:
            if writer is not None:
                writer.abandon()
            raise
        used = arena.used
    if writer is not None:
        writer.finish(converted.weights, used)
    return converted, tokenizer


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


def codes_upper_bound(model: GGUFModel, block: qgemm.Kernel) -> int:
    """Bytes that the packed codes of every matrix csrc/pack.c packs take at most: 6 bits a
    weight, rows in whole tiles, each matrix page-aligned (``packed_file.Writer``'s region,
    a sparse file: what is never written takes no disk)."""
    total = 0
    for matrix in model.state_dict.values():
        if isinstance(matrix, GGUFMatrix) and c_decodes(matrix, block):
            for part in matrix.parts:
                rows = -(-part.shape[0] // ROWS) * ROWS
                total += -(-rows * part.shape[1] * 6 // 8 // 4096) * 4096
    return total


def _config_source(model: GGUFModel) -> PretrainedConfig | Callable[[], PretrainedConfig]:
    """The model's config, or what builds it where an earlier load saved its fields."""
    config = model.config
    return config.build if isinstance(config, StoredConfig) else config


def checked_gguf(path: Path) -> GGUFModel:
    """The GGUF file read lazily (``read_gguf``: every tensor checked against the file), and
    its weights checked to fit in the memory available now (``gguf_file.check_memory``)."""
    model = read_gguf(path, keep_quantized=True, lazy=True, stored_config=True)
    # the packed weights hold about the file's bytes; fused q/k/v of mixed types a little more
    check_memory(path, model.tensor_bytes + model.tensor_bytes // 16 + _LOAD_OVERHEAD)
    return model


def convert_in_place(
    path: Path,
    dtype: torch.dtype,
    block: qgemm.Kernel,
    model: GGUFModel | None = None,
    drop: bool = False,
) -> ConvertedGGUF:
    """A GGUF file's quantized matrices packed straight from the mapped file into the kernel's
    tiles, one at a time (``gguf_pack``): the process holds the packed weights and a bounded
    run of the file's pages; an untied embedding stays in the file (``gguf_rows``). ``model``:
    ``checked_gguf(path)``, read here when None. ``drop``: the packed matrices' pages of the
    file dropped from the page cache as they are packed (``gguf_pack``: where a packed-weight
    file will stand in for them)."""
    if model is None:
        model = checked_gguf(path)
    config = model.config  # its saved attributes where an earlier load saved them: read alike
    try:
        weights = LlamaWeights.from_hf_state_dict(
            model.state_dict,
            cast("PretrainedConfig", config),
            dtype=dtype,
            pack=functools.partial(pack_matrix, kernel=block, mapped=True, drop=drop),
            rows=functools.partial(MappedRows.of, kernel=block),
        )
    except ValueError as exc:  # tensors that disagree with the metadata
        raise ModelLoadError(f"GGUF file {str(path)!r}: {exc}") from exc
    return ConvertedGGUF(pack_quantized(weights), _config_source(model), model.eos_token_ids)


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
