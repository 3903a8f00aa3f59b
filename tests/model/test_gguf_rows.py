"""An untied embedding left in the mapped GGUF file (``gguf_rows.MappedRows``): its rows the
values the packed matrix gives, for every type pack.c decodes; a file loaded in place holds it
so, and its forward's logits are those of the embedding packed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from hybridspec.model import qgemm
from hybridspec.model.gguf_blocks import GGUF_TYPES, GGUFMatrix, GGUFPart
from hybridspec.model.gguf_load import convert_in_place
from hybridspec.model.gguf_pack import c_decodes, pack_matrix
from hybridspec.model.gguf_rows import MappedRows
from hybridspec.model.llama import LlamaRuntime
from hybridspec.model.llama_weights import dense
from hybridspec.model.quant import PackedWeight
from hybridspec.model.runtime import ForwardBatch
from tests.model.test_gguf_types import (
    PROMPT,
    _private_cache,  # noqa: F401  # a fixture: the cache dir
    scaled_blocks,
)
from tests.model.test_llama import tiny_llama
from tests.model.test_loader import write_tiny_gguf
from tests.model.test_quant import random_raw

pytestmark = pytest.mark.skipif(qgemm.kernel() is None, reason="no C compiler")
DECODED = ["Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"]


def kernel() -> qgemm.Kernel:
    block = qgemm.kernel()
    assert block is not None
    return block


def decoded_types() -> list[str]:
    """The types csrc/pack.c decodes (the others are packed from numpy, never mapped)."""
    lib = kernel().lib
    return [k for k in sorted(GGUF_TYPES) if lib.hs_pack_type_known(GGMLQuantizationType[k].value)]


@pytest.mark.parametrize("kind", DECODED)
def test_rows_are_the_values_the_packed_matrix_gives(kind: str) -> None:
    rows, cols = 40, 512
    part = GGUFPart("t", kind, random_raw(kind, rows, cols, 3), (rows, cols))
    matrix = GGUFMatrix((part,))
    assert c_decodes(matrix, kernel())
    mapped = MappedRows.of(matrix, kernel())
    assert mapped is not None and mapped.shape == (rows, cols)
    index = torch.tensor([0, 39, 7, 7, 16, 15])
    got = mapped.rows(index)
    want = kernel().dequantize_rows(pack_matrix(matrix, kernel()), index)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got.float(), want.float())  # a zero's sign aside, the same bits
    assert torch.equal(mapped.dequantize(torch.float32)[index], got.float())


def test_every_type_pack_c_decodes_is_covered() -> None:
    assert decoded_types() == DECODED


def test_rows_outside_the_table_are_refused() -> None:
    part = GGUFPart("t", "Q4_K", random_raw("Q4_K", 8, 256, 1), (8, 256))
    mapped = MappedRows.of(GGUFMatrix((part,)), kernel())
    assert mapped is not None
    with pytest.raises(IndexError, match="8 rows"):
        mapped.rows(torch.tensor([8]))
    with pytest.raises(IndexError):
        mapped.rows(torch.tensor([-1]))
    assert mapped.rows(torch.tensor([], dtype=torch.int64)).shape == (0, 256)


def test_what_pack_c_cannot_decode_or_is_stacked_is_not_mapped() -> None:
    q8 = GGUFPart("t", "Q8_0", random_raw("Q8_0", 8, 256, 1), (8, 256))
    q4 = GGUFPart("u", "Q4_K", random_raw("Q4_K", 8, 256, 2), (8, 256))
    assert MappedRows.of(GGUFMatrix((q8,)), kernel()) is None
    assert MappedRows.of(GGUFMatrix((q4, q4)), kernel()) is None
    permuted = dataclasses.replace(q4, order=np.arange(8)[::-1].copy())
    assert MappedRows.of(GGUFMatrix((permuted,)), kernel()) is None


def write_untied_file(path: Path) -> Path:
    """A Q4_K_M-like file whose embedding (Q4_K) and LM head (Q6_K) are two tensors, as
    Llama-3.1-8B's are."""
    model = tiny_llama(0, hidden_size=256, intermediate_size=512, tie_word_embeddings=False)
    vocab = int(model.config.vocab_size)
    blocks = {
        "token_embd.weight": (scaled_blocks("Q4_K", vocab, 256, 1), GGMLQuantizationType.Q4_K),
        "output.weight": (scaled_blocks("Q6_K", vocab, 256, 2), GGMLQuantizationType.Q6_K),
    }
    return write_tiny_gguf(path, model, qtype=GGMLQuantizationType.F16, blocks=blocks)


def test_an_untied_embedding_stays_in_the_file_and_the_logits_do_not_change(
    tmp_path: Path,
) -> None:
    path = write_untied_file(tmp_path / "untied.gguf")
    weights = convert_in_place(path, torch.bfloat16, kernel()).weights
    assert isinstance(weights.embed, MappedRows) and isinstance(weights.lm_head, PackedWeight)
    embed_matrix = GGUFMatrix((weights.embed.part,))
    packed = dataclasses.replace(weights, embed=pack_matrix(embed_matrix, kernel()))
    every = torch.arange(weights.dims.vocab_size)
    assert isinstance(packed.embed, PackedWeight)
    want = kernel().dequantize_rows(packed.embed, every)
    assert torch.equal(weights.embed.rows(every).float(), want.float())
    assert torch.equal(dense(weights.embed, torch.bfloat16), want)

    def logits(w: object) -> torch.Tensor:
        runtime = LlamaRuntime(w, 1, 128)  # type: ignore[arg-type]
        batch = ForwardBatch.from_lists([runtime.allocate()], [PROMPT])
        return runtime.forward(batch).logits

    assert torch.equal(logits(weights), logits(packed))
