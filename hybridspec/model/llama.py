"""A lean native forward for Llama's layer and its families over a slot-indexed KV cache
(gpt-fast style).

``LlamaRuntime`` runs the weights of ``llama_weights`` (the configurations it covers are listed
there); what a family adds to the layer (``families.Family``: q/k/v biases, q/k norms) is read
from the weights' tensors, all of it row by row. Other models load through the generic
transformers runtime (``hf_runtime``).

Dimensions: ``T`` new tokens in the batch (flat), ``B`` sequences, ``H`` query heads, ``KV``
key/value heads, ``rep = H // KV`` query heads per key/value head, ``hd`` head_dim, ``D``
hidden_size, ``I`` intermediate_size, ``V`` vocab_size, ``S`` max_seq_len, ``L`` keys attended.

Speed choices: q/k/v and gate/up are each one fused matmul; rope cos/sin are precomputed tables;
q and k are rotated in one op (they sit side by side in the fused projection); grouped-query
attention folds the ``rep`` query heads of a key/value head into extra query rows, so keys and
values are never repeated; a single sequence attends to slice views of its cache (no gathers);
the LM head runs only at ``logits_indices``. Quantized matrices (``model.quant``) run through
the block kernel (``model.qgemm``), which also takes each RMSNorm, the MLP's
``silu(gate) * up``, the residual adds, rope and the KV-cache writes into its calls (four calls
and the attention per layer), or, where that kernel cannot be built, torch's CPU int4 kernel
(``model.quant_linear``); the embedding looks up and dequantizes only the rows of the batch's
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridspec.model.attention import (
    Attention,
    KernelAttention,
    OneSequenceAttention,
    RaggedAttention,
)
from hybridspec.model.kv_cache import KVCache
from hybridspec.model.linear import PackedLinear
from hybridspec.model.llama_weights import LlamaLayerWeights, LlamaWeights, Matrix
from hybridspec.model.qgemm import BlockLinear, kernel
from hybridspec.model.quant import GROUP_SIZE, PackedWeight, QuantizedWeight
from hybridspec.model.quant_linear import Int4Linear, Int8Linear, quantized_linear
from hybridspec.model.rope import apply_rope, rope_tables
from hybridspec.model.runtime import (
    ForwardBatch,
    ForwardObserver,
    ForwardObservers,
    ForwardOutput,
    HostBatch,
    ObserverHandle,
    read_batch,
)

Linear = PackedLinear | BlockLinear | Int4Linear | Int8Linear


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


@dataclass(frozen=True, slots=True)
class _RuntimeLayer:
    """One decoder layer's weights as the runtime uses them (matmul weights maybe prepacked)."""

    attn_norm: torch.Tensor  # [D]
    wqkv: Linear  # D -> (H + 2 KV) hd
    wo: Linear  # H hd -> D
    mlp_norm: torch.Tensor  # [D]
    w_gate_up: Linear  # D -> 2 I
    w_down: Linear  # I -> D
    qkv_bias: torch.Tensor | None  # [(H + 2 KV) hd] (the family's, ``LlamaLayerWeights``)
    q_norm: torch.Tensor | None  # [hd]
    k_norm: torch.Tensor | None  # [hd]

    @staticmethod
    def of(layer: LlamaLayerWeights, prepack: bool) -> _RuntimeLayer:
        return _RuntimeLayer(
            attn_norm=layer.attn_norm,
            wqkv=build_linear(layer.wqkv, prepack),
            wo=build_linear(layer.wo, prepack),
            mlp_norm=layer.mlp_norm,
            w_gate_up=build_linear(layer.w_gate_up, prepack),
            w_down=build_linear(layer.w_down, prepack),
            qkv_bias=layer.qkv_bias,
            q_norm=layer.q_norm,
            k_norm=layer.k_norm,
        )


class LlamaRuntime:
    """The native Llama forward behind the ``ModelRuntime`` protocol.

    ``prepack`` (default: on CPU) keeps the matmul weights in oneDNN's layout (``PackedLinear``);
    this runtime then holds its own packed copy beside the plain ``weights``.
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
        dims = weights.dims
        self.weights = weights
        on_cpu = weights.device.type == "cpu"
        prepack = on_cpu if prepack is None else prepack
        kernel_dtypes = (torch.bfloat16, torch.float32)
        if invariant_attention is None:
            invariant_attention = on_cpu and weights.dtype in kernel_dtypes
        if invariant_attention and not (on_cpu and weights.dtype in kernel_dtypes):
            raise ValueError(
                "invariant_attention: the row-invariant kernel runs on CPU in bfloat16 or "
                f"float32, not on {weights.device.type} in {weights.dtype}"
            )
        self.invariant_attention = invariant_attention
        if weights.is_quantized and not (on_cpu and weights.dtype == torch.bfloat16):
            raise ValueError(
                "weights: quantized matrices run on CPU in bfloat16, not on "
                f"{weights.device.type} in {weights.dtype}"
            )
        self._layers = tuple(_RuntimeLayer.of(layer, prepack) for layer in weights.layers)
        self._lm_head = build_linear(weights.lm_head, prepack)
        self._cache = KVCache(
            num_layers=dims.num_layers,
            max_num_seqs=max_num_seqs,
            num_kv_heads=dims.num_kv_heads,
            max_seq_len=max_seq_len,
            head_dim=dims.head_dim,
            dtype=weights.dtype,
            device=weights.device,
            transposed_keys=invariant_attention,
        )
        self._slots = self._cache.slots
        self._observers = ForwardObservers(weights.device)
        self._rope = rope_tables(weights.inv_freq, max_seq_len, weights.dtype)  # [2, S, 1, hd]
        # The block kernel rotates q and k and stores k and v itself where attention runs
        # through the row-invariant kernel: it takes cos and sin in float32, [S, hd / 2, 2].
        self._block = None
        wqkv = self._layers[0].wqkv if self._layers else None
        if isinstance(wqkv, BlockLinear) and invariant_attention:
            self._block = wqkv.kernel
            half = rope_tables(weights.inv_freq, max_seq_len, torch.float32)[:, :, 0]
            half = half[..., : dims.head_dim // 2]  # [2, S, hd / 2]: cos, sin
            self._rope_pairs = half.permute(1, 2, 0).contiguous()
            self._cache_layouts = [
                self._block.cache_layout(keys, values)
                for keys, values in zip(
                    self._cache.layer_keys, self._cache.layer_values, strict=True
                )
            ]
        self._rep = dims.num_heads // dims.num_kv_heads
        self._qk_width = (dims.num_heads + dims.num_kv_heads) * dims.head_dim
        self._v_width = dims.num_kv_heads * dims.head_dim
        self._norm_shape = (dims.hidden_size,)

    @property
    def vocab_size(self) -> int:
        return self.weights.dims.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self._slots.max_seq_len

    @property
    def max_num_seqs(self) -> int:
        return self._slots.max_num_seqs

    @property
    def device(self) -> torch.device:
        return self.weights.device

    def allocate(self) -> int:
        return self._slots.allocate()

    def free(self, slot: int) -> None:
        self._slots.free(slot)

    def num_free_slots(self) -> int:
        return self._slots.num_free_slots()

    def seq_len(self, slot: int) -> int:
        return self._slots.seq_len(slot)

    def truncate(self, slot: int, length: int) -> None:
        self._slots.truncate(slot, length)

    def copy_prefix(self, source: int, dest: int, length: int) -> None:
        self._cache.copy_prefix(source, dest, length)

    def resident_bytes(self, slot: int) -> int:
        """Bytes of memory pages ``slot``'s keys and values hold (``KVCache.resident_bytes``)."""
        return self._cache.resident_bytes(slot)

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
        slots, num_new = host.slots, host.num_new_tokens
        attention: Attention
        if self.invariant_attention:
            attention = KernelAttention(self._cache, slots, starts, num_new, self._rep)
        elif len(slots) == 1:
            attention = OneSequenceAttention(
                self._cache, slots[0], starts[0], num_new[0], self._rep
            )
        else:
            attention = RaggedAttention(self._cache, slots, starts, num_new, self._rep)
        if len(slots) == 1:
            cos, sin = self._rope[:, starts[0] : starts[0] + num_new[0]]  # [T, 1, hd] views
        else:
            assert not isinstance(attention, OneSequenceAttention)
            cos, sin = self._rope[:, attention.positions]
        x = self._embed(host.token_ids.to(device, non_blocking=True))  # [T, D]
        kept: dict[int, torch.Tensor] = {}  # layer -> its output; each layer makes a new x
        for i, layer in enumerate(self._layers):
            x = self._decoder_layer(x, i, layer, cos, sin, attention)
            if i in host.hidden_layers:
                kept[i] = x
        hidden_states = None
        if host.hidden_layers:
            hidden_states = torch.stack([kept[i] for i in host.hidden_layers], dim=1)
        if host.logits_indices is not None:
            x = x[host.logits_indices.to(device, non_blocking=True)]
        eps = self.weights.dims.rms_norm_eps
        if isinstance(self._lm_head, BlockLinear):
            logits = self._lm_head.after_norm(x, self.weights.norm, eps)
        else:
            logits = self._lm_head(F.rms_norm(x, self._norm_shape, self.weights.norm, eps))
        return ForwardOutput(logits.float(), hidden_states)  # [num_logits, V]

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings ``[T, D]`` of ``token_ids [T]`` (quantized: those rows dequantized)."""
        embed = self.weights.embed
        if embed is self.weights.lm_head and isinstance(self._lm_head, BlockLinear):
            return self._lm_head.rows(token_ids)  # the same values, from the packed copy
        if isinstance(embed, PackedWeight):
            block = kernel()
            if block is None:
                return embed.unpack().dequantize_rows(token_ids, self.weights.dtype)
            return block.dequantize_rows(embed, token_ids)
        if isinstance(embed, QuantizedWeight):
            return embed.dequantize_rows(token_ids, self.weights.dtype)
        return F.embedding(token_ids, embed)

    def _decoder_layer(
        self,
        x: torch.Tensor,  # [T, D]
        i: int,
        layer: _RuntimeLayer,
        cos: torch.Tensor,  # [T, 1, hd]
        sin: torch.Tensor,
        attention: Attention,
    ) -> torch.Tensor:
        dims, eps = self.weights.dims, self.weights.dims.rms_norm_eps
        wqkv = layer.wqkv
        if isinstance(wqkv, BlockLinear):
            qkv = wqkv.after_norm(x, layer.attn_norm, eps)  # [T, (H + 2 KV) hd]
        else:
            qkv = wqkv(F.rms_norm(x, self._norm_shape, layer.attn_norm, eps))
        qkv = self._family_qkv(qkv, layer)
        if self._block is not None and isinstance(attention, KernelAttention):
            q = self._block.rope_store_unchecked(  # rope, k and v into the cache: one call
                qkv,
                dims.num_heads,
                dims.num_kv_heads,
                dims.head_dim,
                self._rope_pairs,
                attention.token_slots,
                attention.positions,
                self._cache_layouts[i],
            )
            attn = attention.attend_stored(i, q)  # [T, H hd] float32, into wo as it is
        else:
            qk = qkv[:, : self._qk_width].view(
                -1, dims.num_heads + dims.num_kv_heads, dims.head_dim
            )
            qk = apply_rope(qk, cos, sin)  # [T, H + KV, hd]
            v = qkv[:, self._qk_width :].view(-1, dims.num_kv_heads, dims.head_dim)
            attn = attention(i, qk[:, : dims.num_heads], qk[:, dims.num_heads :], v)
        # Each block-kernel matrix takes its residual add, norm or silu * up inside its call;
        # a dense one (a file may keep some matrices as F16) computes them in torch.
        if isinstance(layer.wo, BlockLinear):
            x = layer.wo(attn, residual=x)
        else:
            x = x + layer.wo(attn.to(x.dtype))
        if isinstance(layer.w_gate_up, BlockLinear):
            h = layer.w_gate_up.after_norm(x, layer.mlp_norm, eps)  # [T, 2 I]
        else:
            h = layer.w_gate_up(F.rms_norm(x, self._norm_shape, layer.mlp_norm, eps))
        if isinstance(layer.w_down, BlockLinear):
            return layer.w_down.after_silu_mul(h, residual=x)
        gate, up = h.chunk(2, dim=-1)  # [T, I] each
        return x + layer.w_down(F.silu(gate) * up)

    def _family_qkv(self, qkv: torch.Tensor, layer: _RuntimeLayer) -> torch.Tensor:
        """``qkv [T, (H + 2 KV) hd]`` with what the family adds before rope (``families``):
        the q/k/v biases, then an RMSNorm over each head of q and of k. Row by row, so a
        row's result does not depend on its batch; a new contiguous tensor where it changes."""
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        if layer.q_norm is None or layer.k_norm is None:
            return qkv
        dims = self.weights.dims
        hd, eps = dims.head_dim, dims.rms_norm_eps
        q, k, v = qkv.split([dims.num_heads * hd, dims.num_kv_heads * hd, self._v_width], 1)
        q = F.rms_norm(q.unflatten(1, (dims.num_heads, hd)), (hd,), layer.q_norm, eps)
        k = F.rms_norm(k.unflatten(1, (dims.num_kv_heads, hd)), (hd,), layer.k_norm, eps)
        return torch.cat((q.flatten(1), k.flatten(1), v), dim=1)
