"""The two ways of attending over the KV cache, each writing the batch's new keys and values first.

``SdpaAttention``, the reference (and the path off CPU), runs torch's SDPA for each sequence
over slice views of its slot (``OneSequenceAttention``); ``KernelAttention``, the CPU default,
sends every row through the row-invariant kernel of ``attention_kernels``. ``LlamaRuntime``
builds one per forward and calls it once per decoder layer.

Dimensions: ``T`` new tokens, ``B`` sequences, ``H`` query heads, ``KV`` key/value heads,
``rep = H // KV``, ``hd`` head_dim, ``L`` keys attended.

Every way takes a ``Scoring``: the query scale, a soft cap of the scores and each layer's sliding
window (Gemma's local layers attend only the last ``window`` keys), all per layer, row by row.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hybridspec.model.attention_items import ITEM_COLUMNS
from hybridspec.model.kv_cache import KVCache, numpy_view
from hybridspec.model.qgemm import Kernel
from hybridspec.model.threads import num_threads, numba_follows


@dataclass(frozen=True, slots=True)
class Scoring:
    """How each layer scores its keys: ``scale`` multiplies the scores (None: ``hd ** -0.5``,
    Gemma's ``query_pre_attn_scalar ** -0.5``), ``softcap`` > 0 caps them at ``softcap *
    tanh(score / softcap)`` before the softmax (Gemma 2), and ``windows[layer]`` > 0 is the
    number of most recent keys, its own included, that a query of that layer attends (0 or no
    entry: every earlier key)."""

    scale: float | None = None
    softcap: float = 0.0
    windows: tuple[int, ...] = ()

    def window(self, layer: int) -> int:
        return self.windows[layer] if layer < len(self.windows) else 0

    def distinct_windows(self) -> set[int]:
        return {0, *self.windows}


PLAIN = Scoring()


@dataclass(frozen=True, slots=True)
class Spans:
    """A forward's sequences as attention sees them, over ``cache``: per sequence its slot,
    the position of its first new token and its number of new tokens (``[B]`` each); ``rep``
    query heads share each key/value head; ``scoring`` scores the keys."""

    cache: KVCache
    slots: list[int]
    starts: list[int]
    num_new: list[int]
    rep: int
    scoring: Scoring = PLAIN


def visible_keys(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Which keys each query sees, ``key_pos [L]`` against ``query_pos [..., 1]``: the earlier
    ones, and within a ``window`` > 0 only the last ``window`` of them."""
    visible = key_pos <= query_pos
    if window > 0:
        visible &= key_pos > query_pos - window
    return visible


def softmax_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scoring: Scoring,
) -> torch.Tensor:
    """SDPA of ``q`` over ``keys`` and ``values`` with ``scoring``'s scale and soft cap (a cap
    needs the scores themselves: then computed here, the softmax in float32)."""
    if scoring.softcap <= 0:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scoring.scale)
    scale = scoring.scale if scoring.scale is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / scoring.softcap) * scoring.softcap
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), values)


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive one SDPA applies: 0 where visible, -inf elsewhere.

    Built once per forward: SDPA converts a boolean mask on every call (every layer), so
    passing the additive form saves that work.
    """
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf")
    )


class OneSequenceAttention:
    """Attention for a batch of one sequence: writes and reads slice views of its cache slot.

    The ``rep`` query heads sharing a key/value head become ``rep`` extra query rows: ``q [n, H,
    hd]`` is laid out as ``[1, KV, n * rep, hd]``, where row ``i * rep + r`` is token ``i``'s
    head ``kv * rep + r`` (transformers' ``repeat_kv`` grouping), against keys ``[1, KV, L, hd]``.
    """

    def __init__(
        self,
        cache: KVCache,
        slot: int,
        start: int,
        num_new: int,
        rep: int,
        scoring: Scoring = PLAIN,
    ) -> None:
        self.cache, self.slot, self.start, self.end, self.rep = (
            cache,
            slot,
            start,
            start + num_new,
            rep,
        )
        self.scoring = scoring
        # window -> [n * rep, L] additive mask; None: all keys visible
        self.masks: dict[int, torch.Tensor | None] = {}
        device = cache.keys.device
        key_pos = torch.arange(self.end, device=device)
        query_pos = torch.arange(start, self.end, device=device)
        for window in scoring.distinct_windows():
            if num_new == 1 and (window == 0 or self.end <= window):
                self.masks[window] = None
                continue
            visible = visible_keys(key_pos[None, :], query_pos[:, None], window)
            self.masks[window] = additive_mask(
                visible.repeat_interleave(rep, dim=0), cache.keys.dtype
            )

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q [n, H, hd], k and v [n, KV, hd] -> [n, H hd]
        n, num_heads, hd = q.shape
        num_kv = k.shape[1]
        self.cache.write(layer, self.slot, self.start, k, v)
        keys = self.cache.key_view(layer, self.slot, self.end)  # [KV, L, hd]
        values = self.cache.layer_values[layer][self.slot][:, : self.end]
        q = q.view(n, num_kv, self.rep, hd).transpose(0, 1).reshape(1, num_kv, n * self.rep, hd)
        mask = self.masks[self.scoring.window(layer)]
        out = softmax_attention(
            q, keys[None], values[None], mask, self.scoring
        )  # [1, KV, n * rep, hd]
        return out.view(num_kv, n, self.rep, hd).transpose(0, 1).reshape(n, num_heads * hd)


class SdpaAttention:
    """Attention for any batch in torch's SDPA, the reference: each sequence attends alone
    over slice views of its own cache slot (``OneSequenceAttention``), so a row's result does
    not depend on the other sequences of its batch, and no row is padded.

    Worked example: spans of 1, 200 and 3 tokens (tokens 0, 1..200, 201..203) attend in three
    calls, over token slices 0:1, 1:201 and 201:204.
    """

    def __init__(self, spans: Spans) -> None:
        offsets = [0, *itertools.accumulate(spans.num_new)]
        self.parts = [
            (
                slice(offsets[i], offsets[i + 1]),
                OneSequenceAttention(spans.cache, *seq, spans.rep, spans.scoring),
            )
            for i, seq in enumerate(zip(spans.slots, spans.starts, spans.num_new, strict=True))
        ]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q [T, H, hd], k and v [T, KV, hd] -> [T, H hd]
        if len(self.parts) == 1:
            return self.parts[0][1](layer, q, k, v)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for tokens, attention in self.parts:
            out[tokens] = attention(layer, q[tokens], k[tokens], v[tokens])
        return out


class KernelAttention:
    """Attention for any batch on CPU, every row through the row-invariant kernel.

    Each query row attends through ``attention_kernels.attend``, or its C form (``kernel``'s
    ``attend_unchecked``, csrc/attention.c: the same bits, 2-3x faster) where the runtime passes
    the kernel library, so its output does not depend on the drafts, the batch, the split of a
    prompt into chunks, or the split of rows into items: a greedy request's text is the same
    with any proposer, K, batch or prefill budget. Requires ``cache.transposed_keys``.
    ``pooled``: the C form runs on the kernel library's own threads (csrc/pool.h), where the
    forward's matmuls are the library's too; else on torch's, where they are torch's.

    Rows are split into items of consecutive tokens of one sequence and one key/value head, as
    even as possible: at most ``SHORT_ITEM_TOKENS`` tokens for a span of up to
    ``LONG_SPAN_TOKENS`` (a decode or a verify span: 9 tokens give 9 items to share between
    threads), at most ``LONG_ITEM_TOKENS`` for a longer span (a prompt: fewer, larger items read
    each key once for more rows), in a number of items that the forward's threads share evenly
    where at most twice the blocks give one (``item_tokens``).

    Worked example: spans of 30 tokens (a prompt chunk) and 1 token (a plain decode), 3
    key/value heads: the first span gives 2 items of 15 tokens per head, the second 1 item
    per head: 9 items in one kernel call (on 2 threads; 3 threads take the 30 tokens in 2 items
    too, 4 threads in 4 items of 8).
    """

    SHORT_ITEM_TOKENS = 4
    LONG_ITEM_TOKENS = 16
    LONG_SPAN_TOKENS = 16

    def __init__(self, spans: Spans, kernel: Kernel | None = None, pooled: bool = False) -> None:
        cache, slots, starts, num_new = spans.cache, spans.slots, spans.starts, spans.num_new
        scoring = spans.scoring
        if not cache.transposed_keys:
            raise ValueError("cache: KernelAttention reads keys transposed (transposed_keys)")
        self.cache = cache
        self.kernel = kernel
        self.pooled = pooled
        items: list[tuple[int, int, int, int, int]] = []
        num_kv = cache.keys.shape[2]
        token = 0
        # the forward's threads matter only to a prompt's span (decode steps never ask)
        long_span = max(num_new) > self.LONG_SPAN_TOKENS
        threads = num_threads() if long_span else 1
        for slot, start, n in zip(slots, starts, num_new, strict=True):
            size = self.item_tokens(n, num_kv, threads)
            for b in range(0, n, size):
                count = min(size, n - b)
                for head in range(num_kv):
                    items.append((slot, head, token + b, start + b, count))
            token += n
        self.items = np.array(items, dtype=np.int32).reshape(-1, ITEM_COLUMNS)
        # One sequence writes its rows as a slice (cheaper than an index_put) and takes its rope
        # rows as a slice too; several scatter them by (slot, position).
        self.single: tuple[int, int] | None = None
        if len(slots) == 1:
            self.single = (slots[0], starts[0])
            self.positions = torch.arange(starts[0], starts[0] + num_new[0])  # [T]
            self.token_slots = torch.full((num_new[0],), slots[0], dtype=torch.int64)
        else:
            self.positions = torch.cat(
                [torch.arange(s, s + n) for s, n in zip(starts, num_new, strict=True)]
            )  # [T]
            self.token_slots = torch.repeat_interleave(torch.tensor(slots), torch.tensor(num_new))
        scale = scoring.scale
        self.scale = np.float32(1.0 / math.sqrt(cache.keys.shape[3]) if scale is None else scale)
        self.softcap = np.float32(scoring.softcap)
        self.scoring = scoring

    @classmethod
    def item_tokens(cls, n: int, num_kv: int, threads: int) -> int:
        """Tokens per item of a span of ``n`` new tokens: blocks of at most the span's limit,
        as even as possible. For a prompt's span, up to twice as many blocks where that makes
        its items a multiple of ``threads``, so that no thread waits while another runs a last
        item over the whole history (a 40-token chunk, 3 key/value heads, 2 threads: 4 blocks
        of 10, 12 items, not 3 blocks of 14)."""
        limit = cls.SHORT_ITEM_TOKENS if n <= cls.LONG_SPAN_TOKENS else cls.LONG_ITEM_TOKENS
        least = -(-n // limit)
        if n > cls.LONG_SPAN_TOKENS:
            for blocks in range(least, 2 * least + 1):
                size = -(-n // blocks)
                if -(-n // size) * num_kv % threads == 0:
                    return size
        return -(-n // least)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q [T, H, hd], k and v [T, KV, hd] -> [T, H hd]
        if self.single is not None:
            slot, start = self.single
            self.cache.write(layer, slot, start, k, v)
        else:
            self.cache.scatter(layer, self.token_slots, self.positions, k, v)
        return self.attend_stored(layer, q.float().contiguous()).to(q.dtype)

    def attend_stored(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of ``q [T, H, hd]`` float32 (contiguous) over keys and values the caller
        has already stored at this batch's ``token_slots`` and ``positions`` (the quantized
        runtime's ``hs_rope_store``); ``[T, H hd]`` float32."""
        num_tokens, num_heads, hd = q.shape
        window = self.scoring.window(layer)
        if self.kernel is not None:
            return self.kernel.attend_unchecked(
                q,
                self.cache.keys.shape[2],
                self.cache.kernel_layouts[layer],
                self.cache.keys.dtype is torch.float32,
                self.items,
                float(self.scale),
                float(self.softcap),
                window,
                self.pooled,
            ).view(num_tokens, num_heads * hd)
        out = np.empty((num_tokens, num_heads, hd), dtype=np.float32)
        numba_attend()(
            numpy_view(q),
            self.cache.kernel_keys[layer],
            self.cache.kernel_values[layer],
            self.items,
            self.scale,
            self.softcap,
            np.int64(window),
            out,
        )
        return torch.from_numpy(out).view(num_tokens, num_heads * hd)


def numba_attend() -> Callable[..., None]:
    """``attention_kernels.attend`` (imported, numba with it, on the first call: only where the
    runtime has no C attention), with numba's threads set to the calling thread's count."""
    from hybridspec.model.attention_kernels import attend

    numba_follows()
    return attend


Attention = SdpaAttention | KernelAttention
