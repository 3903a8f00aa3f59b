"""A lean native forward for Llama's layer and its families over a slot-indexed KV cache
(gpt-fast style).

``LlamaRuntime`` runs the weights of ``llama_weights`` (the configurations it covers are listed
there); what a family adds to the layer (``families.Family``: q/k/v biases, q/k norms, Gemma's
post-norms, activation, embedding scale, attention scale, soft caps, sliding windows and local
rope) is read from the weights' tensors, dims and family, all of it row by row. Other models
load through the generic transformers runtime (``hf_runtime``).

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

One module over 400 lines, on purpose: the one forward every family runs, whose layer steps
read the runtime's tables (rope, cache layouts, the kernel); apart, they would pass them all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridspec.model.attention import (
    Attention,
    KernelAttention,
    OneSequenceAttention,
    RaggedAttention,
    Scoring,
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
    post_attn_norm: torch.Tensor | None  # [D] Gemma's, before the residual adds
    post_mlp_norm: torch.Tensor | None  # [D]
    rope: int  # which rope table: 0 the global one, 1 the sliding layers' own

    @staticmethod
    def of(layer: LlamaLayerWeights, prepack: bool, rope: int) -> _RuntimeLayer:
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
            post_attn_norm=layer.post_attn_norm,
            post_mlp_norm=layer.post_mlp_norm,
            rope=rope,
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
        # Gemma 3's sliding layers rotate by their own rope (table 1); every other layer by 0.
        inv_freqs = [weights.inv_freq]
        if weights.local_inv_freq is not None:
            inv_freqs.append(weights.local_inv_freq)
        windows = dims.layer_windows
        self._layers = tuple(
            _RuntimeLayer.of(
                layer, prepack, int(len(inv_freqs) > 1 and i < len(windows) and windows[i] > 0)
            )
            for i, layer in enumerate(weights.layers)
        )
        self._scoring = Scoring(dims.attn_scale, dims.attn_softcap, windows)
        self._activation: Callable[[torch.Tensor], torch.Tensor] = F.silu
        if weights.family.activation == "gelu_pytorch_tanh":
            self._activation = functools.partial(F.gelu, approximate="tanh")
        self._embed_scale = None  # Gemma's sqrt(D), rounded to the model's dtype as transformers
        if weights.family.gemma_layer:
            scale = torch.tensor(dims.hidden_size**0.5, dtype=torch.float32)
            self._embed_scale = scale.to(weights.dtype).to(weights.device)
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
        self._ropes = [  # each [2, S, 1, hd]
            rope_tables(inv_freq, max_seq_len, weights.dtype) for inv_freq in inv_freqs
        ]
        # The block kernel rotates q and k and stores k and v itself where attention runs
        # through the row-invariant kernel: it takes cos and sin in float32, [S, hd / 2, 2].
        self._block = None
        # The row-invariant attention in C where the kernel library has its vector path (the
        # numba kernel computes the same bits, slower).
        c_attention = kernel() if invariant_attention else None
        self._attention_kernel = (
            c_attention if c_attention and c_attention.attention_vectorized else None
        )
        wqkv = self._layers[0].wqkv if self._layers else None
        if isinstance(wqkv, BlockLinear) and invariant_attention:
            self._block = wqkv.kernel
            self._rope_pairs = []
            for inv_freq in inv_freqs:
                half = rope_tables(inv_freq, max_seq_len, torch.float32)[:, :, 0]
                half = half[..., : dims.head_dim // 2]  # [2, S, hd / 2]: cos, sin
                self._rope_pairs.append(half.permute(1, 2, 0).contiguous())
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
        slots, num_new = host.slots, host.num_new_tokens
        attention: Attention
        args = (self._cache, slots, starts, num_new, self._rep, self._scoring)
        if self.invariant_attention:
            attention = KernelAttention(*args, kernel=self._attention_kernel)
        elif len(slots) == 1:
            attention = OneSequenceAttention(
                self._cache, slots[0], starts[0], num_new[0], self._rep, self._scoring
            )
        else:
            attention = RaggedAttention(*args)
        if len(slots) == 1:  # [T, 1, hd] views
            ropes = [rope[:, starts[0] : starts[0] + num_new[0]] for rope in self._ropes]
        else:
            assert not isinstance(attention, OneSequenceAttention)
            ropes = [rope[:, attention.positions] for rope in self._ropes]
        x = self._embed(host.token_ids.to(device, non_blocking=True))  # [T, D]
        if self._embed_scale is not None:
            x = x * self._embed_scale
        kept: dict[int, torch.Tensor] = {}  # layer -> its output; each layer makes a new x
        for i, layer in enumerate(self._layers):
            cos, sin = ropes[layer.rope]
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
        logits = logits.float()
        cap = self.weights.dims.final_softcap
        if cap > 0:  # Gemma 2's soft cap of the logits
            logits = torch.tanh(logits / cap) * cap
        return ForwardOutput(logits, hidden_states)  # [num_logits, V]

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
        if self._block is not None and isinstance(attention, KernelAttention):
            # rope, k and v into the cache in the kernel, after the projection in the same
            # call where the family adds nothing between them
            rope = (
                dims.num_heads,
                dims.num_kv_heads,
                dims.head_dim,
                self._rope_pairs[layer.rope],
                attention.token_slots,
                attention.positions,
                self._cache.kernel_layouts[i],
            )
            if (
                isinstance(wqkv, BlockLinear)
                and layer.qkv_bias is None
                and layer.q_norm is None
                and x.dtype is torch.bfloat16
                and layer.attn_norm.dtype is torch.bfloat16
            ):
                q = self._block.attn_in(wqkv, x.contiguous(), layer.attn_norm, eps, *rope)
            else:
                q = self._block.rope_store_unchecked(self._qkv(x, layer, eps), *rope)
            attn = attention.attend_stored(i, q)  # [T, H hd] float32, into wo as it is
            return self._after_attention(x, layer, attn, eps)
        qkv = self._qkv(x, layer, eps)
        qk = qkv[:, : self._qk_width].view(-1, dims.num_heads + dims.num_kv_heads, dims.head_dim)
        qk = apply_rope(qk, cos, sin)  # [T, H + KV, hd]
        v = qkv[:, self._qk_width :].view(-1, dims.num_kv_heads, dims.head_dim)
        attn = attention(i, qk[:, : dims.num_heads], qk[:, dims.num_heads :], v)
        return self._after_attention(x, layer, attn, eps)

    def _qkv(self, x: torch.Tensor, layer: _RuntimeLayer, eps: float) -> torch.Tensor:
        """The layer's normed q/k/v projection ``[T, (H + 2 KV) hd]``, with what the family
        adds before rope (``_family_qkv``)."""
        if isinstance(layer.wqkv, BlockLinear):
            qkv = layer.wqkv.after_norm(x, layer.attn_norm, eps)
        else:
            qkv = layer.wqkv(F.rms_norm(x, self._norm_shape, layer.attn_norm, eps))
        return self._family_qkv(qkv, layer)

    def _after_attention(
        self, x: torch.Tensor, layer: _RuntimeLayer, attn: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """The layer's output projection and MLP, each with its residual add."""
        # Each block-kernel matrix takes its residual add, norm or silu * up inside its call
        # (all three in one call where all three are the kernel's); a dense one (a file may
        # keep some matrices as F16) computes them in torch, as does Gemma's layer its
        # post-norms (between a matmul and its residual add) and GeGLU.
        if (
            isinstance(layer.wo, BlockLinear)
            and isinstance(layer.w_gate_up, BlockLinear)
            and isinstance(layer.w_down, BlockLinear)
            and layer.post_attn_norm is None
            and layer.post_mlp_norm is None
            and self._activation is F.silu
        ):
            return layer.wo.kernel.mlp_block(
                layer.wo, layer.w_gate_up, layer.w_down, attn, x, layer.mlp_norm, eps
            )
        if layer.post_attn_norm is not None:
            out = layer.wo(attn if isinstance(layer.wo, BlockLinear) else attn.to(x.dtype))
            x = x + F.rms_norm(out, self._norm_shape, layer.post_attn_norm, eps)
        elif isinstance(layer.wo, BlockLinear):
            x = layer.wo(attn, residual=x)
        else:
            x = x + layer.wo(attn.to(x.dtype))
        if isinstance(layer.w_gate_up, BlockLinear):
            h = layer.w_gate_up.after_norm(x, layer.mlp_norm, eps)  # [T, 2 I]
        else:
            h = layer.w_gate_up(F.rms_norm(x, self._norm_shape, layer.mlp_norm, eps))
        if (
            isinstance(layer.w_down, BlockLinear)
            and layer.post_mlp_norm is None
            and self._activation is F.silu
        ):
            return layer.w_down.after_silu_mul(h, residual=x)
        gate, up = h.chunk(2, dim=-1)  # [T, I] each
        out = layer.w_down(self._activation(gate) * up)
        if layer.post_mlp_norm is not None:
            out = F.rms_norm(out, self._norm_shape, layer.post_mlp_norm, eps)
        return x + out

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
