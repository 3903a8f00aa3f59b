"""The block-quantized matmul kernel: against the dequantized float32 reference, identical on
every instruction-set path and thread count, row-invariant, its fused prologues and epilogue,
the embedding lookup from the packed copy, refusals, and the fallback where it cannot build."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybridspec.model import kernel_build, qgemm
from hybridspec.model.decoder import build_linear
from hybridspec.model.kernel_abi import PROLOGUE_RMSNORM, cache_layout
from hybridspec.model.linear import PackedLinear
from hybridspec.model.qgemm import BlockLinear, Kernel
from hybridspec.model.quant import QuantizedWeight, factor_steps, quantize, widen
from hybridspec.model.quant_linear import Int4Linear
from hybridspec.model.runtime import ForwardBatch
from tests.engine.tiny import VOCAB, tiny_loaded
from tests.model.test_invariance import (
    assert_logits_alike_decoded_verified_and_batched,
    assert_rows_alike,
)

pytestmark = pytest.mark.skipif(qgemm.kernel() is None, reason="no C compiler")


@pytest.fixture(scope="module")
def variants(kernel_variants: dict[str, Kernel]) -> list[Kernel]:
    """The kernel built for each of its matmul's instruction-set paths (VNNI, AVX-512 without
    it, portable C), the runtime's build first."""
    return [kernel_variants[name] for name in ("native", "no-vnni", "portable")]


# scheme -> (bits, group, offsets): Q4_1 / Q4_K; Q8_0 / Q5_0; Q5_1 / Q5_K; Q2_K / Q3_K; Q6_K;
# and a fused q/k/v of mixed types widened to the widest scheme (6/16K+m: Q4_K's with Q6_K's).
# "K": a K-quant's scales and offsets, d * sc per 256 columns (d float16, sc 6 bits), held
# factored by the kernel. 6: 8-bit codes within -32..31 (Q6_K, Q5_K, Q5_0, Q5_1), held in 6 bits.
SCHEMES = {
    "4": (4, 32, True),
    "8": (8, 32, False),
    "8+m": (8, 32, True),
    "4/16": (4, 16, True),
    "8/16": (8, 16, False),
    "8/16+m": (8, 16, True),
    "4K": (4, 32, True),
    "8/16K": (8, 16, False),
    "8K+m": (8, 32, True),
    "6/16K": (6, 16, False),
    "6/16K+m": (6, 16, True),
    "6+m": (6, 32, True),
}


def weight(bits: int | str, rows: int, cols: int, seed: int) -> QuantizedWeight:
    """A random matrix in a scheme (``SCHEMES``), each sub-group with a scale of its own."""
    scheme = SCHEMES[str(bits)]
    gen = torch.Generator().manual_seed(seed)
    bits_held = 8 if scheme[0] == 6 else scheme[0]
    w = quantize(torch.randn(rows, cols, generator=gen) * 0.05, bits_held)
    w = widen(w, bits_held, *scheme[1:])
    if scheme[0] == 6:
        w = QuantizedWeight(w.codes // 4, w.scales, w.offsets, 8, w.group)
    if str(bits).endswith("K") or str(bits).endswith("K+m"):
        return QuantizedWeight(
            w.codes,
            k_factors(w.scales.shape, 256 // w.group, -63, gen),
            None if w.offsets is None else k_factors(w.scales.shape, 256 // w.group, 0, gen),
            w.bits,
            w.group,
        )
    if w.group == 16:  # sub-groups of one group no longer share a scale
        factors = 0.5 + torch.rand(w.scales.shape, generator=gen)
        w = QuantizedWeight(w.codes, w.scales * factors, w.offsets, w.bits, w.group)
    return w


def k_factors(shape: torch.Size, per: int, low: int, gen: torch.Generator) -> torch.Tensor:
    """``d * sc``: d float16 per row and ``per`` groups (256 columns), sc in ``low..63``."""
    rows, width = shape
    sc = torch.randint(low, 64, (rows, width), generator=gen).float()
    d = (torch.rand(rows, -(-width // per), generator=gen) * 1e-3 - 5e-4).half().float()
    return d.repeat_interleave(per, dim=1)[:, :width] * sc


def activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).bfloat16()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.mark.parametrize("rows", [96, 43])  # 43: padded
@pytest.mark.parametrize("bits", list(SCHEMES))
def test_matches_the_dequantized_float32_reference(kernel: Kernel, bits: str, rows: int) -> None:
    w = weight(bits, rows, 128, 0)
    x = activations(11, 128, 1)
    got = BlockLinear(w, kernel)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (11, rows)
    # 8-bit activations (a relative 2**-8 per group) and a bfloat16 output
    assert relative_error(got, x.float() @ w.dequantize().T) < 1e-2


@pytest.mark.parametrize("bits", list(SCHEMES))
def test_every_instruction_set_path_and_thread_count_computes_the_same(
    variants: list[Kernel], bits: str
) -> None:
    w, x = weight(bits, 61, 256, 2), activations(13, 256, 3)
    residual = activations(13, 61, 4)
    outs = [BlockLinear(k.pack(w), k)(x, residual=residual) for k in variants]
    assert all(torch.equal(outs[0], out) for out in outs[1:]), [k.isa for k in variants]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert variants[0].max_threads() == 1  # torch's OpenMP runtime, shared
        assert torch.equal(BlockLinear(w, variants[0])(x, residual=residual), outs[0])
        torch.set_num_threads(2)  # tiles in chunks that either thread claims (pool.c)
        for k in variants:
            for passive in (1, 0):
                k.lib.hs_set_passive(passive)
                assert torch.equal(BlockLinear(k.pack(w), k)(x, residual=residual), outs[0])
    finally:
        torch.set_num_threads(threads)


def test_every_instruction_set_path_computes_the_prologues_alike(variants: list[Kernel]) -> None:
    """The RMSNorm and silu(gate) * up prologues (vector loops on the AVX2 paths, the exp past
    its clamps at +-100) and the quantization of their rows, bit for bit on every path."""
    w = weight(4, 40, 96, 40)
    x, norm = activations(5, 96, 41) * 8, activations(1, 96, 42)[0]
    gate_up = activations(5, 192, 43) * 8
    gate_up[:, :3] = torch.tensor([100.0, -100.0, 0.0]).bfloat16()
    outs = []
    for k in variants:
        linear = BlockLinear(k.pack(w), k)
        outs.append(
            torch.cat((linear.after_norm(x, norm, 1e-5), linear.after_silu_mul(gate_up, None)))
        )
    assert all(torch.equal(outs[0], out) for out in outs[1:]), [k.isa for k in variants]


@pytest.mark.parametrize(("bits", "code"), [(4, 15), (6, 31), (6, -32), (8, -128), (8, 127)])
def test_the_largest_codes_against_the_largest_activations_sum_exactly(
    variants: list[Kernel], bits: int, code: int
) -> None:
    """Every code at its largest magnitude and every activation at its group's largest (codes
    q = 127 or -127): the AVX2 path's int16 partial sums (``RUN_OF`` in matmul_tiles.h) reach
    their bound, and every path still computes the same integers."""
    rows, cols = 16, 256
    if bits == 4:
        codes = torch.full((rows, cols // 2), code * 17, dtype=torch.uint8)  # both nibbles
    else:  # 8-bit codes; for 6 bits within -32..31, which the packer holds in 6
        codes = torch.full((rows, cols), code, dtype=torch.int8)
    w = QuantizedWeight(
        codes, torch.full((rows, cols // 32), 2.0**-10), None, 4 if bits == 4 else 8
    )
    x = torch.ones(3, cols, dtype=torch.bfloat16)
    x[1] = -1
    x[2, ::2] = -1
    outs = [BlockLinear(k.pack(w), k)(x) for k in variants]
    assert all(torch.equal(outs[0], out) for out in outs[1:]), [k.isa for k in variants]
    torch.testing.assert_close(outs[0].float(), x.float() @ w.dequantize().T, rtol=1e-2, atol=0)


@pytest.mark.parametrize("bits", ["4", "8", "8/16+m", "6+m"])
def test_a_row_comes_out_alike_alone_and_among_others(kernel: Kernel, bits: str) -> None:
    linear = BlockLinear(weight(bits, 200, 1536, 5), kernel)
    assert_rows_alike(linear, 1536, torch.Generator().manual_seed(6))


def test_fused_prologues_and_the_residual_epilogue(kernel: Kernel) -> None:
    w = weight(4, 72, 96, 7)
    linear, reference = BlockLinear(w, kernel), w.dequantize()
    x, norm = activations(9, 96, 8), activations(1, 96, 9)[0]
    normed = F.rms_norm(x.float(), (96,), norm.float(), 1e-5)
    assert relative_error(linear.after_norm(x, norm, 1e-5), normed @ reference.T) < 1e-2
    gate_up = activations(9, 192, 10)
    act = F.silu(gate_up[:, :96].float()) * gate_up[:, 96:].float()
    residual = activations(9, 72, 11)
    fused = linear.after_silu_mul(gate_up, residual)
    assert relative_error(fused, act @ reference.T + residual.float()) < 1e-2
    # the residual is added to the bfloat16 product, as a bfloat16 add would
    assert torch.equal(linear(x, residual), (linear(x).float() + residual.float()).bfloat16())


@pytest.mark.parametrize("attn_dtype", [torch.bfloat16, torch.float32])
def test_the_mlp_block_equals_its_three_calls_to_the_bit(
    kernel: Kernel, attn_dtype: torch.dtype
) -> None:
    wo = BlockLinear(weight(4, 64, 96, 20), kernel)  # attention width 96 -> model width 64
    gate_up = BlockLinear(weight("6+m", 2 * 96, 64, 21), kernel)  # 2 x 96 intermediate
    down = BlockLinear(weight(8, 64, 96, 22), kernel)
    attn, x = activations(7, 96, 23).to(attn_dtype), activations(7, 64, 24)
    norm = activations(1, 64, 25)[0]
    h = wo(attn, residual=x)
    want = down.after_silu_mul(gate_up.after_norm(h, norm, 1e-5), residual=h)
    assert torch.equal(kernel.mlp_block(wo, gate_up, down, attn, x, norm, 1e-5), want)
    for rows in (1, 3):  # a row alone comes out as among others
        got = kernel.mlp_block(wo, gate_up, down, attn[:rows], x[:rows], norm, 1e-5)
        assert torch.equal(got, want[:rows])
    assert kernel.mlp_block(wo, gate_up, down, attn[:0], x[:0], norm, 1e-5).shape == (0, 64)
    with pytest.raises(ValueError, match="mlp_block"):
        kernel.mlp_block(wo, down, gate_up, attn, x, norm, 1e-5)  # matrices in the wrong order


def test_float32_activations_are_read_as_they_are(kernel: Kernel) -> None:
    linear = BlockLinear(weight(4, 40, 64, 15), kernel)
    x = activations(5, 64, 16)
    assert torch.equal(linear(x.float()), linear(x))  # the same values, widened exactly


def test_rope_store_rotates_q_and_k_and_stores_k_and_v_at_each_tokens_slot(kernel: Kernel) -> None:
    heads, kv_heads, hd, seq, tokens = 4, 2, 16, 32, 5
    gen = torch.Generator().manual_seed(17)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * hd, generator=gen).bfloat16()
    angles = torch.rand(seq, hd // 2, generator=gen) * 6
    pairs = torch.stack((angles.cos(), angles.sin()), dim=-1)  # [S, hd / 2, 2]
    slots, positions = torch.tensor([1, 1, 0, 2, 1]), torch.tensor([3, 4, 0, 31, 5])
    keys = torch.zeros(3, kv_heads, hd, seq, dtype=torch.bfloat16)
    values = torch.zeros(3, kv_heads, seq, hd, dtype=torch.bfloat16)
    layout = cache_layout(keys, values)
    q = kernel.rope_store(qkv, heads, kv_heads, hd, pairs, slots, positions, layout)
    # the reference: rotate-half rope in float32 on the bfloat16 projections
    cos = torch.cat((pairs[..., 0], pairs[..., 0]), -1)[positions][:, None]  # [T, 1, hd]
    sin = torch.cat((pairs[..., 1], pairs[..., 1]), -1)[positions][:, None]
    x = qkv.float().view(tokens, heads + 2 * kv_heads, hd)[:, : heads + kv_heads]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = x * cos + torch.cat((-x2, x1), -1) * sin
    torch.testing.assert_close(q, rotated[:, :heads], rtol=1e-6, atol=1e-6)
    v = qkv.view(tokens, heads + 2 * kv_heads, hd)[:, heads + kv_heads :]
    for t, (slot, pos) in enumerate(zip(slots.tolist(), positions.tolist(), strict=True)):
        torch.testing.assert_close(
            keys[slot, :, :, pos].float(), rotated[t, heads:].bfloat16().float(), rtol=0, atol=0
        )
        assert torch.equal(values[slot, :, pos], v[t])
    written = torch.zeros(3, seq, dtype=torch.bool)
    written[slots, positions] = True
    assert (
        not keys.permute(0, 3, 1, 2)[~written].any() and not values.transpose(1, 2)[~written].any()
    )


def test_attn_in_equals_the_projection_then_rope_store_to_the_bit(kernel: Kernel) -> None:
    heads, kv_heads, hd, seq, tokens = 4, 2, 32, 16, 3
    wqkv = BlockLinear(weight(4, (heads + 2 * kv_heads) * hd, 64, 30), kernel)
    x, norm = activations(tokens, 64, 31), activations(1, 64, 32)[0]
    angles = torch.rand(seq, hd // 2, generator=torch.Generator().manual_seed(33)) * 6
    pairs = torch.stack((angles.cos(), angles.sin()), dim=-1).contiguous()
    slots, positions = torch.tensor([0, 1, 1]), torch.tensor([2, 0, 1])
    caches = [
        (
            torch.zeros(2, kv_heads, hd, seq, dtype=torch.bfloat16),
            torch.zeros(2, kv_heads, seq, hd, dtype=torch.bfloat16),
        )
        for _ in range(2)
    ]
    qkv = wqkv.after_norm(x, norm, 1e-5)
    layout = cache_layout(*caches[0])
    want = kernel.rope_store(qkv, heads, kv_heads, hd, pairs, slots, positions, layout)
    got = kernel.attn_in(
        wqkv, x, norm, 1e-5, heads, kv_heads, hd, pairs, slots, positions,
        cache_layout(*caches[1]),
    )  # fmt: skip
    assert torch.equal(got, want)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_the_fused_runtime_agrees_with_the_unfused_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block kernel's forward (norms, rope, cache writes fused) against the same weights
    through torch's int4 kernel and torch ops: the same model, up to 8-bit activations."""
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(18)).tolist()
    loaded = tiny_loaded(0, quantize_bits=4)
    fused = loaded.create_runtime(1, 64)
    monkeypatch.setattr("hybridspec.model.llama.kernel", lambda: None)
    unfused = loaded.create_runtime(1, 64)
    logits = []
    for runtime in (fused, unfused):
        runtime.allocate()
        batch = ForwardBatch.from_lists([0], [ids[:30]])
        runtime.forward(batch)
        logits.append(runtime.forward(ForwardBatch.from_lists([0], [ids[30:]])).logits)
    assert relative_error(logits[0], logits[1].float()) < 5e-2
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize(
    ("bits", "bpw"),
    [("4K", 4.75), ("8/16K", 8.625), ("8K+m", 8.75), ("6/16K", 6.625), ("4", 5.0), ("8", 8.5)],
)
def test_scales_are_held_in_the_bytes_of_the_files_blocks(
    variants: list[Kernel], bits: str, bpw: float
) -> None:
    """K-quants: int8 steps of a float32 factor per 256 columns; Q4_1, Q8_0: float16."""
    w, x = weight(bits, 48, 768, 21), activations(9, 768, 22)
    packed = variants[0].pack(w)
    kquant = "K" in bits
    assert (packed.scale_super is not None) == kquant
    assert packed.scales.dtype == (torch.int8 if kquant else torch.float16)
    assert packed.nbytes * 8 == bpw * 48 * 768  # a float32 scale per group would add 1-2 bits
    plain = variants[0].pack(w, narrow=False)  # float32 factors, 8-bit codes: same results
    assert plain.scale_super is None and plain.bits == w.bits
    want = BlockLinear(plain, variants[0])(x)
    assert all(torch.equal(BlockLinear(k.pack(w), k)(x), want) for k in variants)
    assert torch.equal(packed.unpack().dequantize(), w.dequantize())


def test_factor_steps_finds_the_exact_int8_form_or_none() -> None:
    steps = factor_steps(torch.tensor([[0.75, 1.25, 0.0, -0.5]]), 4)
    assert steps is not None
    assert steps[0].tolist() == [[3, 5, 0, -2]] and steps[1].tolist() == [[0.25]]
    assert factor_steps(torch.tensor([[1.0, 1.0 + 2**-20]]), 2) is None  # steps past int8
    assert factor_steps(torch.tensor([[float("nan"), 1.0]]), 2) is None


@pytest.mark.parametrize("bits", list(SCHEMES))
def test_a_packed_weight_unpacks_to_the_codes_scales_and_offsets_it_came_from(
    kernel: Kernel, bits: str
) -> None:
    w = weight(bits, 37, 96, 17)  # 37 rows: a padded last tile
    back = kernel.pack(w).unpack()
    assert torch.equal(back.codes, w.codes) and torch.equal(back.scales, w.scales)
    assert (back.bits, back.group) == (w.bits, w.group)
    assert (back.offsets is None) == (w.offsets is None)
    assert back.offsets is None or torch.equal(back.offsets, w.offsets)


@pytest.mark.parametrize("bits", list(SCHEMES))
def test_rows_of_the_packed_copy_are_the_weights_rows(kernel: Kernel, bits: str) -> None:
    w = weight(bits, 37, 64, 12)
    index = torch.tensor([36, 0, 9, 9, 17])
    got = BlockLinear(w, kernel).rows(index)
    assert torch.equal(got, w.dequantize_rows(index, torch.bfloat16))
    with pytest.raises(IndexError):
        kernel.dequantize_rows(kernel.pack(w), torch.tensor([37]))


def test_bad_input_is_refused_before_the_kernel_runs(kernel: Kernel) -> None:
    linear = BlockLinear(kernel.pack(weight(4, 16, 64, 13)), kernel)
    bf16 = torch.bfloat16
    with pytest.raises(ValueError, match=r"x: expected bfloat16 \[T, 64\]"):
        linear(torch.zeros(2, 32, dtype=bf16))
    with pytest.raises(ValueError, match="x: expected bfloat16"):
        linear(torch.zeros(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="x: expected bfloat16"):  # silu * up reads bfloat16
        linear.after_silu_mul(torch.zeros(2, 128), None)
    with pytest.raises(ValueError, match=r"x: expected bfloat16 \[T, 128\]"):
        linear.after_silu_mul(torch.zeros(2, 64, dtype=bf16), None)
    with pytest.raises(ValueError, match="norm"):
        linear.apply(torch.zeros(2, 64, dtype=bf16), PROLOGUE_RMSNORM, None, 0.0, None)
    with pytest.raises(ValueError, match="residual"):
        linear(torch.zeros(2, 64, dtype=bf16), residual=torch.zeros(2, 16))
    assert linear(torch.zeros(0, 64, dtype=bf16)).shape == (0, 16)


def test_each_thread_grows_its_scratch_when_a_call_needs_more_then_reuses_it() -> None:
    kernel = qgemm.load()  # a kernel of its own: its scratch starts empty
    linear = BlockLinear(weight(4, 48, 256, 40), kernel)
    x = activations(9, 256, 41)
    want = linear(x)  # grown: the first call found no room, did nothing, and ran again
    buffer = kernel._scratch.buffer
    assert buffer is not None and kernel._scratch.struct.bytes >= kernel._scratch.struct.need > 0
    assert torch.equal(linear(x[:3]), want[:3]) and kernel._scratch.buffer is buffer  # reused
    assert torch.equal(linear(x), want) and kernel._scratch.buffer is buffer
    results: list[torch.Tensor] = []
    other = threading.Thread(target=lambda: results.append(linear(x)))
    other.start()
    other.join()
    assert torch.equal(results[0], want) and kernel._scratch.buffer is buffer  # its own scratch


@pytest.fixture
def no_kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HYBRIDSPEC_QGEMM", "0")
    qgemm.kernel.cache_clear()
    yield
    qgemm.kernel.cache_clear()


def test_without_the_kernel_quantized_weights_run_through_torchs(no_kernel: None) -> None:
    assert qgemm.kernel() is None
    assert isinstance(build_linear(weight(4, 32, 64, 14), prepack=True), Int4Linear)
    k_quant = weight("8/16", 32, 64, 14)  # a scheme torch's kernel lacks: held dense
    linear = build_linear(k_quant, prepack=True)
    assert isinstance(linear, PackedLinear)
    x = activations(3, 64, 1)
    assert torch.equal(linear(x), PackedLinear(k_quant.dequantize(torch.bfloat16), prepack=True)(x))
    runtime = tiny_loaded(0, quantize_bits=4).create_runtime(4, 256)
    ids = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    assert_logits_alike_decoded_verified_and_batched(runtime, ids)


def test_a_compiler_that_fails_is_reported_and_falls_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(kernel_build, "compiler", lambda: "false")  # exits 1
    with pytest.raises(RuntimeError, match="failed to build"):
        kernel_build.build(cache_dir=tmp_path)
    monkeypatch.setenv("HYBRIDSPEC_CACHE_DIR", str(tmp_path))
    qgemm.kernel.cache_clear()
    try:
        assert qgemm.kernel() is None
    finally:
        qgemm.kernel.cache_clear()
    assert not list((tmp_path / "kernels").glob("*.so"))  # no half-written library left
