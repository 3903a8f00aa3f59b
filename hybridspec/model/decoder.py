"""A decoder layer as the native forward runs it, its path chosen once, when the runtime loads.

``torch_layer`` and ``kernel_layer`` read one layer's weights (their matmul kinds, the family's
additions) and build a ``DecoderLayer``: an attention input step (``x`` to the attention's
output) and an after-attention step (the output projection and the MLP, each with its residual
add). Each step is the one path that layer takes on every call, so the forward is a plain loop
over layers:

- attention input: the block kernel's fused ``attn_in`` (norm, q/k/v projection, rope and the
  cache stores in one call, where the family adds nothing between them: ``FusedAttentionIn``),
  its ``rope_store`` after a projection the family adds to (``StoredAttentionIn``), both then
  attending through ``KernelAttention.attend_stored``; or torch's rope and an ``Attention``
  (``TorchAttentionIn``);
- after attention: the kernel's fused ``mlp_block`` where all three matrices are the kernel's and
  the family adds nothing (``FusedMlpBlock``), else an output projection (``residual_out``) and
  an MLP (``mlp``), each step in the kernel where its matrix is the kernel's, in torch where the
  matrix is dense or the family adds a step (Gemma's post-norms, GeGLU).

A step's path is chosen by ``isinstance`` on the layer's matrices here, at load; nothing is
chosen per call. Where every layer is one ``FusedAttentionIn`` and one ``FusedMlpBlock`` and the
attention runs in C, ``KernelStack`` runs them all in one kernel call per forward: the same calls
in the same order, with no Python between layers (on a small model, the per-layer calls' own
cost is a fair part of a decode step). Dimensions as in ``model.llama``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.nn.functional as F

from hybridspec.model.attention import Attention, KernelAttention
from hybridspec.model.kernel_abi import CacheLayout, StackLayer, StackPass
from hybridspec.model.linear import PackedLinear
from hybridspec.model.llama_weights import LlamaDims, LlamaLayerWeights, Matrix
from hybridspec.model.qgemm import BlockLinear, Kernel, kernel
from hybridspec.model.quant import GROUP_SIZE, PackedWeight, QuantizedWeight
from hybridspec.model.quant_linear import Int4Linear, Int8Linear, quantized_linear
from hybridspec.model.rope import apply_rope

Linear = PackedLinear | BlockLinear | Int4Linear | Int8Linear
Step = Callable[[torch.Tensor], torch.Tensor]  # [T, in] -> [T, out]
# H, KV, hd, rope pairs, token slots [T], positions [T], the layer's cache
RopeArgs = tuple[
    int, int, int, torch.Tensor, torch.Tensor, torch.Tensor, "ctypes._Pointer[CacheLayout]"
]
P = TypeVar("P")  # what one forward hands every layer: ``TorchPass`` or ``KernelAttention``


def build_linear(weight: Matrix, prepack: bool) -> Linear:
    """The matmul for ``weight``: a quantized kernel (the block kernel where it builds, else
    torch's int4 one for the schemes it has: groups of 32, 4-bit or symmetric 8-bit codes), or
    a (maybe prepacked) dense one, also for a quantized scheme that no kernel here runs."""
    if isinstance(weight, (QuantizedWeight, PackedWeight)):
        block = kernel() if weight.device.type == "cpu" else None
        if block is not None:
            return BlockLinear(weight, block)
        if isinstance(weight, PackedWeight):  # packed by a kernel that no longer loads
            weight = weight.unpack()
        if weight.group == GROUP_SIZE and (weight.bits == 4 or weight.offsets is None):
            return quantized_linear(weight)
        weight = weight.dequantize(torch.bfloat16)
    return PackedLinear(weight, prepack=prepack)


def normed_linear(linear: Linear, norm: torch.Tensor, eps: float) -> Step:
    """``linear(rms_norm(x) * norm)``: the norm in the block kernel's prologue where ``linear``
    is the kernel's (computed in float32 inside the call), else in torch."""
    if isinstance(linear, BlockLinear):
        return functools.partial(linear.after_norm, norm=norm, eps=eps)
    shape = tuple(norm.shape)
    return lambda x: linear(F.rms_norm(x, shape, norm, eps))


@dataclass(frozen=True, slots=True)
class TorchPass:
    """What each layer of one forward reads on the torch path: the attention and, per rope
    table (``LlamaRuntime``: 0 the global one, 1 the sliding layers' own), its rows."""

    attention: Attention
    ropes: tuple[torch.Tensor, ...]  # each [2, T, 1, hd]: cos, sin


@dataclass(frozen=True, slots=True)
class FamilyQkv:
    """The q/k/v projection with what the family adds before rope (``families``): the q/k/v
    biases (Qwen2), then an RMSNorm over each head of q and of k (Qwen3). Row by row, so a
    row's result does not depend on its batch; a new contiguous tensor."""

    project: Step
    bias: torch.Tensor | None  # [(H + 2 KV) hd]
    q_norm: torch.Tensor | None  # [hd]
    k_norm: torch.Tensor | None  # [hd]
    dims: LlamaDims

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.project(x)  # [T, (H + 2 KV) hd]
        if self.bias is not None:
            qkv = qkv + self.bias
        if self.q_norm is None or self.k_norm is None:
            return qkv
        dims = self.dims
        hd, eps = dims.head_dim, dims.rms_norm_eps
        kv = dims.num_kv_heads * hd
        q, k, v = qkv.split([dims.num_heads * hd, kv, kv], 1)
        q = F.rms_norm(q.unflatten(1, (dims.num_heads, hd)), (hd,), self.q_norm, eps)
        k = F.rms_norm(k.unflatten(1, (dims.num_kv_heads, hd)), (hd,), self.k_norm, eps)
        return torch.cat((q.flatten(1), k.flatten(1), v), dim=1)


def qkv_projection(layer: LlamaLayerWeights, wqkv: Linear, dims: LlamaDims) -> Step:
    """The layer's normed q/k/v projection ``[T, (H + 2 KV) hd]`` with the family's additions."""
    project = normed_linear(wqkv, layer.attn_norm, dims.rms_norm_eps)
    if layer.qkv_bias is None and (layer.q_norm is None or layer.k_norm is None):
        return project
    return FamilyQkv(project, layer.qkv_bias, layer.q_norm, layer.k_norm, dims)


@dataclass(frozen=True, slots=True)
class TorchAttentionIn:
    """q/k/v projected, q and k rotated in torch (side by side in one op), then the pass's
    ``Attention`` (which stores k and v): ``[T, H hd]``."""

    index: int  # the layer's
    rope: int  # its rope table
    qkv: Step
    dims: LlamaDims

    def __call__(self, x: torch.Tensor, p: TorchPass) -> torch.Tensor:
        dims = self.dims
        heads, kv_heads, hd = dims.num_heads, dims.num_kv_heads, dims.head_dim
        qkv = self.qkv(x)
        qk = qkv[:, : (heads + kv_heads) * hd].view(-1, heads + kv_heads, hd)
        cos, sin = p.ropes[self.rope]
        qk = apply_rope(qk, cos, sin)  # [T, H + KV, hd]
        v = qkv[:, (heads + kv_heads) * hd :].view(-1, kv_heads, hd)
        return p.attention(self.index, qk[:, :heads], qk[:, heads:], v)


@dataclass(frozen=True, slots=True)
class KernelRope:
    """What the block kernel's rope and cache stores read for one layer, beside its q/k/v."""

    rope_pairs: torch.Tensor  # [S, hd / 2, 2] float32: cos, sin of the layer's rope table
    layout: ctypes._Pointer[CacheLayout]  # the layer's cache (``KVCache.kernel_layouts``)
    dims: LlamaDims

    def args(self, attention: KernelAttention) -> RopeArgs:
        """``Kernel.rope_store``'s arguments after ``qkv`` (``attn_in``'s after ``eps``)."""
        d = self.dims
        return (
            d.num_heads,
            d.num_kv_heads,
            d.head_dim,
            self.rope_pairs,
            attention.token_slots,
            attention.positions,
            self.layout,
        )


@dataclass(frozen=True, slots=True)
class StoredAttentionIn:
    """q/k/v projected (with the family's additions), then the block kernel's ``rope_store``
    (q and k rotated, k and v into the cache) and the row-invariant attention over what it
    stored: ``[T, H hd]`` float32, into ``wo`` as it is."""

    index: int
    qkv: Step
    kernel: Kernel
    rope: KernelRope

    def __call__(self, x: torch.Tensor, attention: KernelAttention) -> torch.Tensor:
        q = self.kernel.rope_store(self.qkv(x), *self.rope.args(attention))
        return attention.attend_stored(self.index, q)


@dataclass(frozen=True, slots=True)
class FusedAttentionIn:
    """The norm, the q/k/v projection, rope and the cache stores in one block-kernel call
    (``Kernel.attn_in``), then the row-invariant attention: ``[T, H hd]`` float32."""

    index: int
    wqkv: BlockLinear
    attn_norm: torch.Tensor  # [D] bfloat16
    eps: float
    rope: KernelRope

    def __call__(self, x: torch.Tensor, attention: KernelAttention) -> torch.Tensor:
        wqkv = self.wqkv
        q = wqkv.kernel.attn_in(
            wqkv, x.contiguous(), self.attn_norm, self.eps, *self.rope.args(attention)
        )
        return attention.attend_stored(self.index, q)


@dataclass(frozen=True, slots=True)
class FusedMlpBlock:
    """The output projection and the MLP, with both residual adds, in one block-kernel call
    (``Kernel.mlp_block``)."""

    wo: BlockLinear
    w_gate_up: BlockLinear
    w_down: BlockLinear
    mlp_norm: torch.Tensor  # [D] bfloat16
    eps: float

    def __call__(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        wo = self.wo
        return wo.kernel.mlp_block(
            wo, self.w_gate_up, self.w_down, attn, x, self.mlp_norm, self.eps
        )


@dataclass(frozen=True, slots=True)
class UnfusedMlpBlock:
    """The output projection, then the MLP, each adding its residual."""

    residual_out: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, attn) -> x
    mlp: Step  # x -> x

    def __call__(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.residual_out(x, attn))


def residual_out(
    wo: Linear, post_norm: torch.Tensor | None, dtype: torch.dtype, eps: float
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``x + wo(attn)`` (Gemma: ``x + rms_norm(wo(attn)) * post_norm``): the residual add in
    the block kernel's epilogue where it can be; a dense ``wo`` takes ``attn`` in ``dtype``."""
    cast = not isinstance(wo, BlockLinear)  # the kernel reads float32 attention as it is
    if post_norm is not None:
        norm, shape = post_norm, tuple(post_norm.shape)
        if cast:
            return lambda x, attn: x + F.rms_norm(wo(attn.to(dtype)), shape, norm, eps)
        return lambda x, attn: x + F.rms_norm(wo(attn), shape, norm, eps)
    if isinstance(wo, BlockLinear):
        return lambda x, attn: wo(attn, residual=x)
    return lambda x, attn: x + wo(attn.to(dtype))


def mlp(
    layer: LlamaLayerWeights,
    w_gate_up: Linear,
    w_down: Linear,
    activation: Callable[[torch.Tensor], torch.Tensor] | None,
    eps: float,
) -> Step:
    """``x + w_down(act(gate) * up)`` of the normed ``x`` (Gemma: the output normed before the
    add). ``activation`` None: silu, which the block kernel fuses into ``w_down``'s call."""
    gate_up = normed_linear(w_gate_up, layer.mlp_norm, eps)  # [T, 2 I]
    post = layer.post_mlp_norm
    if isinstance(w_down, BlockLinear) and post is None and activation is None:
        return lambda x: w_down.after_silu_mul(gate_up(x), residual=x)
    act = activation or F.silu

    def step(x: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up(x).chunk(2, dim=-1)  # [T, I] each
        out = w_down(act(gate) * up)
        if post is not None:
            out = F.rms_norm(out, tuple(post.shape), post, eps)
        return x + out

    return step


class DecoderLayer(Generic[P]):
    """One decoder layer: ``x [T, D]`` to the layer's output ``[T, D]`` (a new tensor)."""

    __slots__ = ("after_attention", "attention_in")

    def __init__(
        self,
        attention_in: Callable[[torch.Tensor, P], torch.Tensor],  # x -> [T, H hd]
        after_attention: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],  # (x, attn) -> x
    ) -> None:
        self.attention_in = attention_in
        self.after_attention = after_attention

    def __call__(self, x: torch.Tensor, p: P) -> torch.Tensor:
        return self.after_attention(x, self.attention_in(x, p))


@dataclass(frozen=True, slots=True)
class LayerMatrices:
    """One layer's weights with its matmuls built (``build_linear``)."""

    weights: LlamaLayerWeights
    wqkv: Linear
    wo: Linear
    w_gate_up: Linear
    w_down: Linear

    @staticmethod
    def of(layer: LlamaLayerWeights, prepack: bool) -> LayerMatrices:
        return LayerMatrices(
            layer,
            build_linear(layer.wqkv, prepack),
            build_linear(layer.wo, prepack),
            build_linear(layer.w_gate_up, prepack),
            build_linear(layer.w_down, prepack),
        )


def after_attention(
    m: LayerMatrices,
    activation: Callable[[torch.Tensor], torch.Tensor] | None,
    dtype: torch.dtype,
    eps: float,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The layer's steps after its attention: one fused call where every matrix is the block
    kernel's and the family adds nothing (``activation`` None: silu), else two steps."""
    layer = m.weights
    if (
        isinstance(m.wo, BlockLinear)
        and isinstance(m.w_gate_up, BlockLinear)
        and isinstance(m.w_down, BlockLinear)
        and layer.post_attn_norm is None
        and layer.post_mlp_norm is None
        and activation is None
    ):
        return FusedMlpBlock(m.wo, m.w_gate_up, m.w_down, layer.mlp_norm, eps)
    return UnfusedMlpBlock(
        residual_out(m.wo, layer.post_attn_norm, dtype, eps),
        mlp(layer, m.w_gate_up, m.w_down, activation, eps),
    )


def torch_layer(
    m: LayerMatrices,
    index: int,
    rope: int,
    dims: LlamaDims,
    activation: Callable[[torch.Tensor], torch.Tensor] | None,
) -> DecoderLayer[TorchPass]:
    """Layer ``index`` with rope and the cache stores in torch (any ``Attention``)."""
    qkv = qkv_projection(m.weights, m.wqkv, dims)
    return DecoderLayer(
        TorchAttentionIn(index, rope, qkv, dims),
        after_attention(m, activation, m.weights.attn_norm.dtype, dims.rms_norm_eps),
    )


def kernel_layer(
    m: LayerMatrices,
    index: int,
    dims: LlamaDims,
    activation: Callable[[torch.Tensor], torch.Tensor] | None,
    block: Kernel,
    rope_pairs: torch.Tensor,  # [S, hd / 2, 2] float32: the layer's rope table
    layout: ctypes._Pointer[CacheLayout],  # the layer's cache (``KVCache.kernel_layouts``)
) -> DecoderLayer[KernelAttention]:
    """Layer ``index`` with rope and the cache stores in the block kernel, attending through
    ``KernelAttention``: q/k/v in the same call where the family adds nothing before rope."""
    layer, dtype = m.weights, m.weights.attn_norm.dtype
    rope = KernelRope(rope_pairs, layout, dims)
    attention_in: FusedAttentionIn | StoredAttentionIn
    if (
        isinstance(m.wqkv, BlockLinear)
        and layer.qkv_bias is None
        and layer.q_norm is None
        and dtype is torch.bfloat16
    ):
        eps = dims.rms_norm_eps
        attention_in = FusedAttentionIn(index, m.wqkv, layer.attn_norm, eps, rope)
    else:
        attention_in = StoredAttentionIn(index, qkv_projection(layer, m.wqkv, dims), block, rope)
    return DecoderLayer(attention_in, after_attention(m, activation, dtype, dims.rms_norm_eps))


class KernelStack:
    """Every layer of a stack in one kernel call per forward (csrc/stack.c, ``hs_layers``):
    each layer's ``attn_in``, C attention (on the kernel's pool) and ``mlp_block``, as the
    layers one by one would call them, so the outputs, the hidden states and the cache are
    equal to the bit. Built only where every layer is one ``FusedAttentionIn`` and one
    ``FusedMlpBlock`` (``of``), and run only for a pass that attends in C on the pool
    (``runs``)."""

    __slots__ = ("_dims", "_held", "_kernel", "_table")

    def __init__(
        self,
        layers: Sequence[tuple[FusedAttentionIn, FusedMlpBlock]],
        windows: Sequence[int],  # each layer's attention window (0: every earlier key)
        dims: LlamaDims,
        kernel: Kernel,
    ) -> None:
        self._dims, self._kernel = dims, kernel
        self._held: list[object] = []  # what the table points into
        rows = []
        for (a, m), window in zip(layers, windows, strict=True):
            attn_norm, mlp_norm = a.attn_norm.contiguous(), m.mlp_norm.contiguous()
            rope = a.rope.rope_pairs.contiguous()
            self._held += [a.wqkv, m.wo, m.w_gate_up, m.w_down, attn_norm, mlp_norm, rope]
            self._held.append(a.rope.layout)
            rows.append(
                StackLayer(
                    a.wqkv.pointer,
                    m.wo.pointer,
                    m.w_gate_up.pointer,
                    m.w_down.pointer,
                    attn_norm.data_ptr(),
                    mlp_norm.data_ptr(),
                    rope.data_ptr(),
                    a.rope.layout,
                    a.eps,
                    window,
                )
            )
        self._table = (StackLayer * len(rows))(*rows)

    @staticmethod
    def of(
        layers: Sequence[DecoderLayer[KernelAttention]], windows: Sequence[int], dims: LlamaDims
    ) -> KernelStack | None:
        """The stack of ``layers`` where each is fused in and after its attention, else None."""
        fused = [
            (layer.attention_in, layer.after_attention)
            for layer in layers
            if isinstance(layer.attention_in, FusedAttentionIn)
            and isinstance(layer.after_attention, FusedMlpBlock)
        ]
        if not fused or len(fused) != len(layers):
            return None
        return KernelStack(fused, windows, dims, fused[0][0].wqkv.kernel)

    def runs(self, p: KernelAttention) -> bool:
        """Whether this forward's pass attends in C on the kernel's pool, as the stack does."""
        return p.kernel is not None and p.pooled

    def run(
        self, x: torch.Tensor, p: KernelAttention, hidden_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``LayerStack.run``: the last layer's output ``[T, D]`` and ``hidden_layers``'
        outputs ``[T, len(hidden_layers), D]`` (None where it names none)."""
        d, tokens = self._dims, x.shape[0]
        q = torch.empty((tokens, d.num_heads, d.head_dim), dtype=torch.float32)
        attn = torch.empty_like(q)
        stack_pass = StackPass(
            tokens,
            d.num_heads,
            d.num_kv_heads,
            d.head_dim,
            p.token_slots.data_ptr(),
            p.positions.data_ptr(),
            p.items.ctypes.data,
            p.items.shape[0],
            p.scale,
            p.softcap,
            p.cache.keys.dtype is torch.float32,
            q.data_ptr(),
            attn.data_ptr(),
        )
        # layer i reads buffers[i % 2] and writes the other; the caller's x stays as it was
        buffers = (
            x.clone(memory_format=torch.contiguous_format),
            torch.empty(x.shape, dtype=x.dtype),
        )
        kept: dict[int, torch.Tensor] = {}
        first, end = 0, len(self._table)
        for stop in sorted(set(hidden_layers)):  # run up to each kept layer, then copy it out
            self._kernel.layers(self._table, first, stop + 1, stack_pass, *buffers)
            kept[stop], first = buffers[(stop + 1) % 2].clone(), stop + 1
        self._kernel.layers(self._table, first, end, stack_pass, *buffers)
        out = buffers[end % 2]
        if not hidden_layers:
            return out, None
        return out, torch.stack([kept[i] for i in hidden_layers], dim=1)
