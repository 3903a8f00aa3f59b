"""Random-weight GGUF files in a real model's shapes, for measuring (``hybridspec bench
make-gguf``).

A file is written a tensor at a time, each straight as its blocks (``random_blocks``): no dense
model is ever in memory, so an 8B-shaped Q4_K_M file (4.9 GB) is written with a few hundred MB
in about the time its bytes take. Matrices have values of std 0.02 and mean about 0, norms are
1, and the types are those llama.cpp's quantizer writes for the mix (``random_blocks.MIXES``).
The vocabulary is the embedded SmolLM2 tokenizer's, padded with unused tokens to the shape's
vocabulary size, so that every file of one vocabulary size shares one tokenizer and a random
target and a random draft can be paired.

Shapes (``SHAPES``): ``135m`` SmolLM2-135M, ``1b`` Llama-3.2-1B, ``3b`` Llama-3.2-3B (both tied
embeddings), ``8b`` Llama-3.1-8B (untied), and ``tiny`` for tests. Families: the dense GGUF
architectures of ``model.families`` whose tensors are Llama's plus a little (``FAMILY_EXTRAS``):
``llama`` (and ``mistral``, which llama.cpp writes as ``llama``), ``qwen2`` (q/k/v biases),
``qwen3`` (q/k head norms).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from hybridspec.bench.random_blocks import MIXES, random_blocks, tensor_nbytes, tensor_type
from hybridspec.model import GGUFFile, embedded_model_path

logger = logging.getLogger(__name__)

WEIGHT_STD = 0.02
UNUSED_TOKEN_TYPE = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED


@dataclass(frozen=True, slots=True)
class Shape:
    num_layers: int
    hidden: int
    ffn: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tied: bool
    rope_theta: float = 500000.0
    context_length: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


SHAPES = {
    "tiny": Shape(2, 256, 512, 4, 2, 49152, tied=False),
    "135m": Shape(30, 576, 1536, 9, 3, 49152, tied=True, rope_theta=100000.0),
    "1b": Shape(16, 2048, 8192, 32, 8, 128256, tied=True),
    "3b": Shape(28, 3072, 8192, 24, 8, 128256, tied=True),
    "8b": Shape(32, 4096, 14336, 32, 8, 128256, tied=False),
}
# family: (GGUF architecture, per-layer tensors besides Llama's: role -> "bias" or "head_norm")
FAMILY_EXTRAS: dict[str, tuple[str, dict[str, str]]] = {
    "llama": ("llama", {}),
    "mistral": ("llama", {}),
    "qwen2": ("qwen2", {"attn_q": "bias", "attn_k": "bias", "attn_v": "bias"}),
    "qwen3": ("qwen3", {"attn_q_norm": "head_norm", "attn_k_norm": "head_norm"}),
}


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor to write: GGUF name, numpy shape ``[rows, cols]`` (or ``[cols]``), type."""

    name: str
    shape: tuple[int, ...]
    qtype: T
    fill: str  # "random", "ones" or "bias" (random, small)
    std: float = WEIGHT_STD  # of a random matrix's values


def plan_tensors(
    shape: Shape, family: str, mix_name: str, output_std: float = WEIGHT_STD
) -> list[Tensor]:
    """Every tensor of a file, in llama.cpp's order, with the type the mix gives it;
    ``output_std`` is the LM head's (the tied embedding's) spread."""
    mix = MIXES[mix_name]
    extras = FAMILY_EXTRAS[family][1]
    d, kv = shape.hidden, shape.num_kv_heads * shape.head_dim
    n = shape.num_layers

    def matrix(name: str, role: str, layer: int, rows: int, cols: int) -> Tensor:
        return Tensor(name, (rows, cols), tensor_type(mix, role, layer, n, cols), "random")

    embed_role = "output" if shape.tied else "token_embd"
    embed = matrix("token_embd.weight", embed_role, 0, shape.vocab_size, d)
    tensors = [replace(embed, std=output_std) if shape.tied else embed]
    tensors.append(Tensor("output_norm.weight", (d,), T.F32, "ones"))
    if not shape.tied:
        output = matrix("output.weight", "output", 0, shape.vocab_size, d)
        tensors.append(replace(output, std=output_std))
    rows = {"attn_q": d, "attn_k": kv, "attn_v": kv}
    for i in range(n):
        p = f"blk.{i}."
        tensors.append(Tensor(p + "attn_norm.weight", (d,), T.F32, "ones"))
        for role in ("attn_q", "attn_k", "attn_v"):
            tensors.append(matrix(p + role + ".weight", role, i, rows[role], d))
            if extras.get(role) == "bias":
                tensors.append(Tensor(p + role + ".bias", (rows[role],), T.F32, "bias"))
        for role, kind in extras.items():
            if kind == "head_norm":
                tensors.append(Tensor(p + role + ".weight", (shape.head_dim,), T.F32, "ones"))
        tensors.append(matrix(p + "attn_output.weight", "attn_output", i, d, d))
        tensors.append(Tensor(p + "ffn_norm.weight", (d,), T.F32, "ones"))
        tensors.append(matrix(p + "ffn_gate.weight", "ffn_gate", i, shape.ffn, d))
        tensors.append(matrix(p + "ffn_up.weight", "ffn_up", i, shape.ffn, d))
        tensors.append(matrix(p + "ffn_down.weight", "ffn_down", i, d, shape.ffn))
    return tensors


def _values(tensor: Tensor, rng: np.random.Generator) -> np.ndarray:
    if tensor.fill == "ones":
        return np.ones(tensor.shape, np.float32)
    if tensor.fill == "bias":
        return rng.standard_normal(tensor.shape, dtype=np.float32) * WEIGHT_STD
    rows, cols = tensor.shape
    return random_blocks(tensor.qtype, rows, cols, tensor.std, rng)


def _byte_shape(tensor: Tensor) -> tuple[tuple[int, ...], np.dtype, T | None]:
    """What ``GGUFWriter.add_tensor_info`` takes: blocks as uint8 rows, dense as themselves."""
    if tensor.qtype == T.F32:
        return tensor.shape, np.dtype(np.float32), None
    if tensor.qtype == T.F16:
        return tensor.shape, np.dtype(np.float16), None
    rows, cols = tensor.shape
    return (rows, tensor_nbytes(tensor.qtype, 1, cols)), np.dtype(np.uint8), tensor.qtype


def _add_tokenizer(
    writer: GGUFWriter, vocab_size: int, tokens_override: Sequence[str] | None
) -> None:
    """The embedded SmolLM2 vocabulary, padded with unused tokens to ``vocab_size``."""
    embedded = GGUFFile(embedded_model_path())  # its metadata only: the arrays decoded here
    tokens = list(tokens_override or embedded.get("tokenizer.ggml.tokens"))
    types = list(embedded.get("tokenizer.ggml.token_type"))[: len(tokens)]
    types += [1] * (len(tokens) - len(types))
    if len(tokens) > vocab_size:
        raise ValueError(f"vocab_size: the tokenizer has {len(tokens)} tokens, got {vocab_size}")
    pad = vocab_size - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(str(embedded.get("tokenizer.ggml.pre")))
    writer.add_token_list(tokens + [f"<unused_{i}>" for i in range(pad)])
    writer.add_token_types(types + [UNUSED_TOKEN_TYPE] * pad)
    writer.add_token_merges(list(embedded.get("tokenizer.ggml.merges")))
    for key in ("bos", "eos", "padding"):
        token_id = embedded.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            writer.add_uint32(f"tokenizer.ggml.{key}_token_id", int(token_id))
    template = embedded.get("tokenizer.chat_template")
    if template is not None:
        writer.add_string("tokenizer.chat_template", str(template))


def _add_hparams(writer: GGUFWriter, shape: Shape, file_type: int) -> None:
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab_size)
    writer.add_file_type(file_type)
    writer.add_quantization_version(2)


def write_random_gguf(
    path: str | Path,
    shape: Shape | str,
    mix: str = "Q4_K_M",
    *,
    family: str = "llama",
    seed: int = 0,
    tokens: Sequence[str] | None = None,
    output_std: float = WEIGHT_STD,
) -> Path:
    """Write a random-weight GGUF file of ``shape`` (a ``SHAPES`` name or a ``Shape``) in
    llama.cpp's ``mix`` (``random_blocks.MIXES``) and return its path. ``tokens`` replaces the
    embedded vocabulary's token strings (tests of mismatched vocabularies); a larger
    ``output_std`` than the other matrices' 0.02 sharpens the logits (fewer near ties).
    Raises ValueError for an unknown shape, family or mix."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"shape: expected one of {', '.join(SHAPES)}, got {shape!r}")
        shape = SHAPES[shape]
    if family not in FAMILY_EXTRAS:
        raise ValueError(f"family: expected one of {', '.join(FAMILY_EXTRAS)}, got {family!r}")
    if mix not in MIXES:
        raise ValueError(f"type: expected one of {', '.join(MIXES)}, got {mix!r}")
    path = Path(path)
    started = time.perf_counter()
    tensors = plan_tensors(shape, family, mix, output_std)
    writer = GGUFWriter(path, FAMILY_EXTRAS[family][0])
    writer.add_name(f"random {family} {mix}")
    _add_hparams(writer, shape, MIXES[mix].file_type)
    _add_tokenizer(writer, shape.vocab_size, tokens)
    for tensor in tensors:
        byte_shape, dtype, raw = _byte_shape(tensor)
        nbytes = int(np.prod(byte_shape)) * dtype.itemsize
        writer.add_tensor_info(tensor.name, byte_shape, dtype, nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tensor in tensors:
        writer.write_tensor_data(_values(tensor, rng))
    writer.close()
    logger.info(
        "wrote %s (%.2f GB) in %.1f s",
        path,
        path.stat().st_size / 1e9,
        time.perf_counter() - started,
    )
    return path


def with_vocab(shape: Shape, vocab_size: int) -> Shape:
    """``shape`` with another vocabulary size (a draft padded differently from its target)."""
    return replace(shape, vocab_size=vocab_size)
