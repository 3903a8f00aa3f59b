"""A lean native forward for Llama's layer and its families over a slot-indexed KV cache
(gpt-fast style).

``LlamaRuntime`` runs the weights of ``llama_weights`` (the configurations it covers are listed
there); what a family adds to the layer (``families.Family``: q/k/v biases, q/k norms, Gemma's
post-norms, activation, embedding scale, attention scale, soft caps, sliding windows and local
rope) is read from the weights' tensors, dims and family, all of it row by row. Other models
load through the generic transformers runtime (``hf_runtime``).

Each layer's path (the block kernel's fused calls, its unfused ones, torch's matmuls) is chosen
once, when the runtime is built (``decoder``), as are the embedding lookup and the LM head, so
that a forward is: embed, ``for layer in layers: x = layer(x, pass)``, the LM head. Where every
layer is the block kernel's two fused calls and the attention runs in C, the loop is one kernel
call (``decoder.KernelStack``), which a small model's decode step would otherwise spend a good
part of in Python between calls.

Dimensions: ``T`` new tokens in the batch (flat), ``B`` sequences, ``H`` query heads, ``KV``
key/value heads, ``rep = H // KV`` query heads per key/value head, ``hd`` head_dim, ``D``
hidden_size, ``I`` intermediate_size, ``V`` vocab_size, ``S`` max_seq_len, ``L`` keys attended.

Speed choices: q/k/v and gate/up are each one fused matmul; rope cos/sin are precomputed tables;
q and k are rotated in one op (they sit side by side in the fused projection); grouped-query
attention folds the ``rep`` query heads of a key/value head into extra query rows, so keys and
values are never repeated; a single sequence attends to slice views of its cache (no gathers);
the LM head runs only at ``logits_indices``. Quantized matrices (``model.quant``) run through
the block kernel (``model.qgemm``), which also takes each RMSNorm, the MLP's
``silu(gate) * up``, the residual adds, rope and the KV-cache writes into its calls (two calls
and the attention per layer, ``attn_in`` and ``mlp_block``, where the family adds nothing
between them), or, where that kernel cannot be built, torch's CPU int4 kernel
(``model.quant_linear``); the embedding looks up and dequantizes only the rows of the batch's
tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic

import torch
import torch.nn.functional as F

from hybridspec.model.attention import (
    Attention,
    KernelAttention,
    Scoring,
    SdpaAttention,
    Spans,
)
from hybridspec.model.decoder import (
    DecoderLayer,
    KernelStack,
    LayerMatrices,
    Linear,
    P,
    Step,
    TorchPass,
    build_linear,
    kernel_layer,
    normed_linear,
    torch_layer,
)
from hybridspec.model.gguf_rows import MappedRows
from hybridspec.model.kv_cache import KVCache
from hybridspec.model.llama_weights import LlamaWeights
from hybridspec.model.qgemm import BlockLinear, Kernel, kernel
from hybridspec.model.quant import PackedWeight, QuantizedWeight
from hybridspec.model.rope import rope_tables
from hybridspec.model.runtime import (
    ForwardBatch,
    ForwardObserver,
    ForwardObservers,
    ForwardOutput,
    HostBatch,
    ObserverHandle,
    SlotRuntime,
    read_batch,
)
from hybridspec.model.threads import kernel_forward

_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True, slots=True)
class LayerStack(Generic[P]):
    """The decoder layers and what builds, once per forward, the pass every layer reads."""

    layers: tuple[DecoderLayer[P], ...]
    begin: Callable[[HostBatch, list[int]], P]  # (batch, each sequence's start) -> the pass
    fused: KernelStack | None = None  # the layers in one kernel call, where they all fuse

    def run(
        self, x: torch.Tensor, host: HostBatch, starts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers over ``x [T, D]``: the last one's output and ``host.hidden_layers``'
        outputs ``[T, len(hidden_layers), D]`` (None where it names none); in one kernel call
        where the stack has one (``fused``) and this pass attends in C on the kernel's pool."""
        p = self.begin(host, starts)
        fused = self.fused
        if fused is not None and x.shape[0] and isinstance(p, KernelAttention) and fused.runs(p):
            return fused.run(x, p, host.hidden_layers)
        kept: dict[int, torch.Tensor] = {}  # layer -> its output; each layer makes a new x
        for i, layer in enumerate(self.layers):
            x = layer(x, p)
            if i in host.hidden_layers:
                kept[i] = x
        if not host.hidden_layers:
            return x, None
        return x, torch.stack([kept[i] for i in host.hidden_layers], dim=1)


@dataclass(frozen=True, slots=True)
class LmHead:
    """The final norm and the LM head: logits ``[num_logits, V]`` float32, soft-capped at
    ``softcap`` > 0 (Gemma 2)."""

    linear: Linear  # [V, D]
    project: Step  # linear(rms_norm(x) * norm), the norm in the block kernel where it can be
    softcap: float

    @staticmethod
    def of(linear: Linear, weights: LlamaWeights) -> LmHead:
        dims = weights.dims
        project = normed_linear(linear, weights.norm, dims.rms_norm_eps)
        return LmHead(linear, project, dims.final_softcap)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.project(x).float()
        if self.softcap > 0:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class LlamaRuntime(SlotRuntime):
    """The native Llama forward behind the ``ModelRuntime`` protocol.

    ``prepack`` (default: on CPU) keeps the matmul weights in oneDNN's layout (``PackedLinear``);
    this runtime then holds its own packed copy beside the plain ``weights``.
    ``invariant_attention`` (default: on CPU in bfloat16 or float32) sends every row through the
    row-invariant attention kernel (``KernelAttention``), else torch's SDPA.
    """

    def __init__(
        self,
        weights: LlamaWeights,
        max_num_seqs: int,
        max_seq_len: int,
        *,
        prepack: bool | None = None,
        invariant_attention: bool | None = None,
    ) -> None:
        self.weights = weights
        self.invariant_attention = _check_options(weights, invariant_attention)
        dims = weights.dims
        prepack = weights.device.type == "cpu" if prepack is None else prepack
        self._scoring = Scoring(dims.attn_scale, dims.attn_softcap, dims.layer_windows)
        self._cache = KVCache(
            num_layers=dims.num_layers,
            max_num_seqs=max_num_seqs,
            num_kv_heads=dims.num_kv_heads,
            max_seq_len=max_seq_len,
            head_dim=dims.head_dim,
            dtype=weights.dtype,
            device=weights.device,
            transposed_keys=self.invariant_attention,
        )
        self._slots = self._cache.slots
        self._observers = ForwardObservers(weights.device)
        self._rep = dims.num_heads // dims.num_kv_heads
        # The row-invariant attention in C where the kernel library has its vector path (the
        # numba kernel computes the same bits, slower).
        c_attention = kernel() if self.invariant_attention else None
        self._attention_kernel = (
            c_attention if c_attention and c_attention.attention_vectorized else None
        )
        self._ropes = [  # each [2, S, 1, hd]
            rope_tables(inv_freq, max_seq_len, weights.dtype) for inv_freq in _inv_freqs(weights)
        ]
        matrices = tuple(LayerMatrices.of(layer, prepack) for layer in weights.layers)
        self._stack = self._layer_stack(matrices, max_seq_len)
        self._lm_head = LmHead.of(build_linear(weights.lm_head, prepack), weights)
        self._embed = _embedding(weights, self._lm_head.linear)

    def _layer_stack(
        self, matrices: tuple[LayerMatrices, ...], max_seq_len: int
    ) -> LayerStack[TorchPass] | LayerStack[KernelAttention]:
        """Every layer's path: rope and the cache stores in the block kernel where the first
        layer's q/k/v matrix is the kernel's and the attention is the row-invariant one, else
        in torch."""
        weights, dims = self.weights, self.weights.dims
        activation = _activation(weights)
        ropes = _rope_of_layers(weights)
        wqkv = matrices[0].wqkv if matrices else None
        if isinstance(wqkv, BlockLinear) and self.invariant_attention:
            pairs = [_rope_pairs(f, max_seq_len, dims.head_dim) for f in _inv_freqs(weights)]
            layouts = self._cache.kernel_layouts
            in_kernel = tuple(
                kernel_layer(m, i, dims, activation, wqkv.kernel, pairs[rope], layouts[i])
                for i, (m, rope) in enumerate(zip(matrices, ropes, strict=True))
            )
            kernel_forward()
            windows = [self._scoring.window(i) for i in range(len(in_kernel))]
            fused = KernelStack.of(in_kernel, windows, dims)
            return LayerStack(in_kernel, self._kernel_attention, fused)
        in_torch = tuple(
            torch_layer(m, i, rope, dims, activation)
            for i, (m, rope) in enumerate(zip(matrices, ropes, strict=True))
        )
        return LayerStack(in_torch, self._torch_pass)

    @property
    def vocab_size(self) -> int:
        return self.weights.dims.vocab_size

    @property
    def device(self) -> torch.device:
        return self.weights.device

    def copy_prefix(self, source: int, dest: int, length: int) -> None:
        self._cache.copy_prefix(source, dest, length)

    def resident_bytes(self, slot: int) -> int:
        """Bytes of memory pages ``slot``'s keys and values hold (``KVCache.resident_bytes``)."""
        return self._cache.resident_bytes(slot)

    def release_pages(self, slot: int) -> None:
        """Give a free ``slot``'s memory pages back to the system (``KVCache.release_pages``)."""
        self._cache.release_pages(slot)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Append the batch's tokens to their slots; logits ``[num_logits, V]`` float32 and the
        outputs of ``batch.hidden_layers``, ``[T, len(hidden_layers), D]`` (``ForwardOutput``)."""
        return self._observers.call(self._run, batch)

    def add_forward_observer(self, observer: ForwardObserver) -> ObserverHandle:
        """Call ``observer(batch, seconds)`` after every forward until the handle is removed."""
        return self._observers.add(observer)

    def _run(self, batch: ForwardBatch) -> ForwardOutput:
        host = read_batch(batch, self.vocab_size, self.weights.dims.num_layers)
        starts = self._slots.reserve(host.slots, host.num_new_tokens)
        with torch.inference_mode():
            output = self._forward(host, starts)
        self._cache.commit(
            host.slots, [s + n for s, n in zip(starts, host.num_new_tokens, strict=True)]
        )
        return output

    def _forward(self, host: HostBatch, starts: list[int]) -> ForwardOutput:
        device = self.device
        x = self._embed(host.token_ids.to(device, non_blocking=True))  # [T, D]
        x, hidden_states = self._stack.run(x, host, starts)
        if host.logits_indices is not None:
            x = x[host.logits_indices.to(device, non_blocking=True)]
        return ForwardOutput(self._lm_head(x), hidden_states)  # [num_logits, V]

    def _kernel_attention(
        self, host: HostBatch, starts: list[int], pooled: bool = True
    ) -> KernelAttention:
        """The row-invariant attention for this batch: all the block kernel's layers read (on
        the kernel's own threads, as their matmuls are; torch's layers pass ``pooled=False``)."""
        return KernelAttention(self._spans(host, starts), self._attention_kernel, pooled)

    def _spans(self, host: HostBatch, starts: list[int]) -> Spans:
        """This batch's sequences as attention sees them."""
        return Spans(self._cache, host.slots, starts, host.num_new_tokens, self._rep, self._scoring)

    def _torch_pass(self, host: HostBatch, starts: list[int]) -> TorchPass:
        """The attention for this batch and each rope table's rows of its positions."""
        slots, num_new = host.slots, host.num_new_tokens
        attention: Attention = (
            self._kernel_attention(host, starts, pooled=False)
            if self.invariant_attention
            else SdpaAttention(self._spans(host, starts))
        )
        if len(slots) == 1:  # [2, T, 1, hd] views
            ropes = tuple(rope[:, starts[0] : starts[0] + num_new[0]] for rope in self._ropes)
        else:
            positions = torch.cat(
                [torch.arange(s, s + n) for s, n in zip(starts, num_new, strict=True)]
            ).to(self.device)  # [T]
            ropes = tuple(rope[:, positions] for rope in self._ropes)
        return TorchPass(attention, ropes)


def _check_options(weights: LlamaWeights, invariant_attention: bool | None) -> bool:
    """``invariant_attention`` resolved (None: where the kernel runs); ValueError for a choice
    or weights this runtime cannot run."""
    on_cpu = weights.device.type == "cpu"
    kernel_ready = on_cpu and weights.dtype in _KERNEL_DTYPES
    if invariant_attention is None:
        invariant_attention = kernel_ready
    if invariant_attention and not kernel_ready:
        raise ValueError(
            "invariant_attention: the row-invariant kernel runs on CPU in bfloat16 or "
            f"float32, not on {weights.device.type} in {weights.dtype}"
        )
    if weights.is_quantized and not (on_cpu and weights.dtype == torch.bfloat16):
        raise ValueError(
            "weights: quantized matrices run on CPU in bfloat16, not on "
            f"{weights.device.type} in {weights.dtype}"
        )
    return invariant_attention


def _inv_freqs(weights: LlamaWeights) -> list[torch.Tensor]:
    """The rope tables' frequencies: 0 the global one, 1 the sliding layers' own (Gemma 3)."""
    if weights.local_inv_freq is None:
        return [weights.inv_freq]
    return [weights.inv_freq, weights.local_inv_freq]


def _rope_of_layers(weights: LlamaWeights) -> list[int]:
    """Each layer's rope table: Gemma 3's sliding layers rotate by their own (1), others by 0."""
    windows, local = weights.dims.layer_windows, weights.local_inv_freq is not None
    return [int(local and i < len(windows) and windows[i] > 0) for i in range(len(weights.layers))]


def _rope_pairs(inv_freq: torch.Tensor, max_seq_len: int, head_dim: int) -> torch.Tensor:
    """A rope table as the block kernel takes it: ``[S, hd / 2, 2]`` float32, cos and sin."""
    half = rope_tables(inv_freq, max_seq_len, torch.float32)[:, :, 0]
    half = half[..., : head_dim // 2]  # [2, S, hd / 2]: cos, sin
    return half.permute(1, 2, 0).contiguous()


def _activation(weights: LlamaWeights) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The MLP's activation: None for silu (which the block kernel fuses), else Gemma's GeGLU."""
    if weights.family.activation == "gelu_pytorch_tanh":
        return functools.partial(F.gelu, approximate="tanh")
    return None


def _embedding(weights: LlamaWeights, lm_head: Linear) -> Step:
    """The embedding lookup ``token_ids [T]`` -> ``[T, D]``: quantized rows dequantized alone
    (from the LM head's packed copy where they are tied), times Gemma's ``sqrt(D)``."""
    lookup = _lookup(weights, lm_head)
    if not weights.family.gemma_layer:
        return lookup
    # rounded to the model's dtype, as transformers does
    scale = torch.tensor(weights.dims.hidden_size**0.5, dtype=torch.float32)
    scale = scale.to(weights.dtype).to(weights.device)
    return lambda token_ids: lookup(token_ids) * scale


def _lookup(weights: LlamaWeights, lm_head: Linear) -> Step:
    embed, dtype = weights.embed, weights.dtype
    if embed is weights.lm_head and isinstance(lm_head, BlockLinear):
        return lm_head.rows  # the same values, from the packed copy
    if isinstance(embed, MappedRows):  # an untied table left in its GGUF file
        return embed.rows
    if isinstance(embed, PackedWeight):
        block: Kernel | None = kernel()
        if block is None:  # packed by a kernel that no longer loads: unpacked per call
            return lambda token_ids: embed.unpack().dequantize_rows(token_ids, dtype)
        return functools.partial(block.dequantize_rows, embed)
    if isinstance(embed, QuantizedWeight):
        return functools.partial(embed.dequantize_rows, dtype=dtype)
    return functools.partial(F.embedding, weight=embed)
