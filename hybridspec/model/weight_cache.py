"""A disk cache of the fused native weights read from a GGUF file, so that a restart skips the
GGUF parse, the dequantisation and the fusing.

Reading a GGUF file is the slow part of loading: the reader parses the vocabulary in the
metadata, dequantises every tensor to float32 and ``LlamaWeights.from_hf_state_dict`` fuses
and converts them. Its result, saved once with ``torch.save``, loads memory-mapped; the tensors
are the very ones that were saved, so every output is bit-identical to a fresh conversion
(timings in benchmarks/RESULTS.md, "Start-up").

An entry is keyed by the GGUF file (name, size, modification time), the dtype, the
quantization (``quantize``), the torch version, ``FORMAT`` and the source of the modules that
do the conversion (``families.py``, ``gguf.py``, ``gguf_blocks.py``, ``llama_weights.py``,
``quant.py``): an edit
there is a new entry, never a stale one. Entries live in ``default_cache_dir()/weights``; older
entries of the same file, dtype and quantization beyond ``KEEP_ENTRIES`` are removed when one is
written. A cache that cannot be read or written is logged and skipped. Quantized matrices are
saved as their codes, scales, offsets, bits and group.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridspec.model import families, gguf, gguf_blocks, llama_weights, quant
from hybridspec.model.families import FAMILIES
from hybridspec.model.gguf import default_cache_dir
from hybridspec.model.gguf_rows import MappedRows
from hybridspec.model.llama_weights import LlamaDims, LlamaLayerWeights, LlamaWeights, Matrix
from hybridspec.model.quant import PackedWeight, QuantizedWeight

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

FORMAT = 5  # bump when the payload's layout changes
KEEP_ENTRIES = 2  # per GGUF file and dtype: the current one and, say, another checkout's
_LAYER_FIELDS = tuple(f.name for f in dataclasses.fields(LlamaLayerWeights))


@dataclass(frozen=True, slots=True)
class ConvertedGGUF:
    """What loading a GGUF file produces: what the cache holds."""

    weights: LlamaWeights
    config: PretrainedConfig | Callable[[], PretrainedConfig]  # from the cache: built on demand
    eos_token_ids: tuple[int, ...]


def load_or_convert(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    convert: Callable[[], ConvertedGGUF],
    cache_dir: Path | None = None,
    quantize: str = "none",
) -> ConvertedGGUF:
    """The cached conversion of the GGUF file ``path`` to ``dtype`` and ``quantize``, else
    ``convert()`` (then cached)."""
    entry = entry_path(path, dtype, cache_dir, quantize)
    cached = _load(entry, device)
    if cached is not None:
        return cached
    converted = convert()
    _save(entry, converted)
    _prune(entry.parent, _prefix(path, dtype, quantize), keep=entry)
    return converted


def entry_path(
    path: Path, dtype: torch.dtype, cache_dir: Path | None = None, quantize: str = "none"
) -> Path:
    """Where the converted weights of the GGUF file ``path`` in ``dtype`` are kept."""
    stat = path.stat()
    digest = hashlib.sha256()
    parts = (path.name, stat.st_size, stat.st_mtime_ns, dtype, quantize, torch.__version__, FORMAT)
    for part in parts:
        digest.update(f"{part}|".encode())
    for module in (families, gguf, gguf_blocks, llama_weights, quant):
        digest.update(Path(str(module.__file__)).read_bytes())
    name = f"{_prefix(path, dtype, quantize)}{digest.hexdigest()[:16]}.pt"
    return (cache_dir or default_cache_dir()) / "weights" / name


def _prefix(path: Path, dtype: torch.dtype, quantize: str) -> str:
    """What the names of every entry of one file, dtype and quantization start with."""
    suffix = "" if quantize == "none" else f"{quantize}-"
    return f"{path.stem}-{str(dtype).removeprefix('torch.')}-{suffix}"


def _load(entry: Path, device: torch.device) -> ConvertedGGUF | None:
    if not entry.is_file():
        return None
    try:
        payload = torch.load(entry, map_location=device, mmap=True, weights_only=True)
        return _from_payload(payload)
    except Exception as exc:  # a truncated or foreign file must not stop the load
        logger.warning("ignoring unreadable weight cache %s: %s", entry, exc)
        return None


def _save(entry: Path, converted: ConvertedGGUF) -> None:
    """Write to a temporary file, then rename it into place: readers never see half a file."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(dir=entry.parent, prefix=f".{entry.name}-")
        os.close(handle)
        try:
            torch.save(_to_payload(converted), staging)
            os.replace(staging, entry)
        finally:
            if os.path.exists(staging):
                os.unlink(staging)
    except OSError as exc:
        logger.warning("cannot cache the converted weights in %s: %s", entry, exc)


def _prune(folder: Path, prefix: str, keep: Path) -> None:
    """Remove the older entries named ``prefix*`` beyond ``KEEP_ENTRIES`` (``keep`` counted)."""
    try:
        older = [p for p in folder.glob(f"{prefix}*.pt") if p != keep]
        older.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in older[KEEP_ENTRIES - 1 :]:
            old.unlink()
    except OSError:  # another process pruned first
        pass


def _to_payload(converted: ConvertedGGUF) -> dict[str, Any]:
    weights, config = converted.weights, converted.config
    if isinstance(weights.embed, MappedRows):  # only a load in place leaves it in the file
        raise ValueError("weights: an embedding still in its GGUF file is not cached")
    return {
        "config": (config() if callable(config) else config).to_dict(),
        "eos_token_ids": list(converted.eos_token_ids),
        "dims": dataclasses.asdict(weights.dims),
        "embed": _matrix_payload(weights.embed),
        "norm": weights.norm,
        "lm_head": None if weights.lm_head is weights.embed else _matrix_payload(weights.lm_head),
        "inv_freq": weights.inv_freq,
        "local_inv_freq": weights.local_inv_freq,
        "family": weights.family.name,
        "layers": [
            {f: _matrix_payload(getattr(layer, f)) for f in _LAYER_FIELDS}
            for layer in weights.layers
        ],
    }


def _matrix_payload(matrix: Matrix | None) -> torch.Tensor | dict[str, Any] | None:
    """A tensor (or a family's absent tensor, None) as it is; a ``QuantizedWeight`` or
    ``PackedWeight`` as a dict of its fields (``weights_only`` loading takes plain containers of
    tensors, not dataclasses)."""
    if matrix is None or isinstance(matrix, torch.Tensor):
        return matrix
    return {f.name: getattr(matrix, f.name) for f in dataclasses.fields(matrix)}


def _matrix(payload: torch.Tensor | dict[str, Any] | None) -> Matrix | None:
    if payload is None or isinstance(payload, torch.Tensor):
        return payload
    return PackedWeight(**payload) if "scale_super" in payload else QuantizedWeight(**payload)


def _from_payload(payload: dict[str, Any]) -> ConvertedGGUF:
    embed, lm_head = _matrix(payload["embed"]), _matrix(payload["lm_head"])
    assert embed is not None  # only a family's optional layer tensors are ever None
    layers = [{f: _matrix(v) for f, v in layer.items()} for layer in payload["layers"]]
    weights = LlamaWeights(
        dims=LlamaDims(**payload["dims"]),
        embed=embed,
        layers=tuple(LlamaLayerWeights(**layer) for layer in layers),  # type: ignore[arg-type]
        norm=payload["norm"],
        lm_head=embed if lm_head is None else lm_head,  # tied
        inv_freq=payload["inv_freq"],
        family=FAMILIES[payload["family"]],
        local_inv_freq=payload.get("local_inv_freq"),
    )
    return ConvertedGGUF(
        weights,
        functools.partial(_llama_config, payload["config"]),
        tuple(payload["eos_token_ids"]),
    )


def _llama_config(fields: dict[str, Any]) -> PretrainedConfig:
    from transformers import CONFIG_MAPPING

    config: PretrainedConfig = CONFIG_MAPPING[fields["model_type"]].from_dict(fields)
    return config
