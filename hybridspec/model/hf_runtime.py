"""The generic runtime: any transformers causal LM behind the ``ModelRuntime`` protocol.

Used for models the native Llama forward does not cover. Correctness over speed: each slot keeps
its own transformers ``DynamicCache`` and the sequences of a batch run one after another.
``truncate`` crops the cache; where a cache cannot be cropped (a sliding-window layer past its
window, say), the slot is re-run from its kept tokens on the next forward. Hidden states come
from transformers' ``output_hidden_states``, asked only for batches that name layers.

Dimensions: ``n`` new tokens of one sequence, ``V`` vocab_size, ``D`` hidden_size, ``h`` layers
asked (``len(batch.hidden_layers)``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from hybridspec.model.kv_cache import SlotTable
from hybridspec.model.runtime import (
    ForwardBatch,
    ForwardObserver,
    ForwardObservers,
    ForwardOutput,
    ObserverHandle,
    SlotRuntime,
    read_batch,
)


@dataclass(slots=True)
class _SlotState:
    token_ids: list[int] = field(default_factory=list)  # every token the slot holds
    cache: DynamicCache | None = None
    cached: int = 0  # leading tokens of token_ids whose keys and values are in ``cache``


class HFRuntime(SlotRuntime):
    """A ``ModelRuntime`` over a transformers ``PreTrainedModel`` with a per-slot cache."""

    def __init__(self, model: PreTrainedModel, max_num_seqs: int, max_seq_len: int) -> None:
        self.model = model.eval()
        self._slots = SlotTable(max_num_seqs, max_seq_len)
        self._states = [_SlotState() for _ in range(max_num_seqs)]
        self._observers = ForwardObservers(model.device)
        head = model.get_output_embeddings()
        vocab = (
            head.weight.shape[0] if head is not None else model.config.get_text_config().vocab_size
        )
        self._vocab_size = int(vocab)
        text_config = model.config.get_text_config()
        self._num_layers = int(text_config.num_hidden_layers)
        # transformers gives the final norm's output as the last of ``hidden_states`` unless
        # the config says otherwise; ``ForwardBatch.hidden_layers`` names outputs before it.
        text_config.tie_last_hidden_states = False

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def device(self) -> torch.device:
        return self.model.device

    def allocate(self) -> int:
        slot = super().allocate()
        self._states[slot] = _SlotState()
        return slot

    def free(self, slot: int) -> None:
        super().free(slot)
        self._states[slot] = _SlotState()

    def truncate(self, slot: int, length: int) -> None:
        super().truncate(slot, length)
        state = self._states[slot]
        del state.token_ids[length:]
        if state.cache is None or state.cached <= length:
            return
        try:
            state.cache.crop(length - state.cached)  # a negative count removes that many
            state.cached = length
        except (RuntimeError, ValueError):
            state.cache, state.cached = None, 0  # rebuilt from token_ids by the next forward

    def copy_prefix(self, source: int, dest: int, length: int) -> None:
        """A copy of ``source``'s cache cropped to ``length`` (or, where it cannot be cropped,
        none: the next forward rebuilds it from the kept tokens)."""
        self._slots.copy_length(source, dest, length)
        state = self._states[source]
        copied = _SlotState(token_ids=state.token_ids[:length])
        if state.cache is not None and state.cached > 0:
            try:
                cache = copy.deepcopy(state.cache)
                if state.cached > length:
                    cache.crop(length - state.cached)
                copied.cache, copied.cached = cache, min(length, state.cached)
            except (RuntimeError, ValueError):
                copied.cache, copied.cached = None, 0
        self._states[dest] = copied

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Append the batch's tokens to their slots; float32 logits ``[num_logits, V]`` and the
        outputs of ``batch.hidden_layers``, ``[num_tokens, h, D]`` (``ForwardOutput``)."""
        return self._observers.call(self._run, batch)

    def add_forward_observer(self, observer: ForwardObserver) -> ObserverHandle:
        """Call ``observer(batch, seconds)`` after every forward until the handle is removed."""
        return self._observers.add(observer)

    def _run(self, batch: ForwardBatch) -> ForwardOutput:
        host = read_batch(batch, self.vocab_size, self._num_layers)
        starts = self._slots.reserve(host.slots, host.num_new_tokens)
        new_ids = host.token_ids.tolist()
        outputs, offset = [], 0
        with torch.inference_mode():
            for slot, num in zip(host.slots, host.num_new_tokens, strict=True):
                state, ids = self._states[slot], new_ids[offset : offset + num]
                outputs.append(self._extend(state, ids, host.hidden_layers))
                offset += num
        logits = torch.cat([logits for logits, _ in outputs])  # [num_tokens, V]
        ends = [s + n for s, n in zip(starts, host.num_new_tokens, strict=True)]
        self._slots.commit(host.slots, ends)
        if host.logits_indices is not None:
            logits = logits[host.logits_indices.to(logits.device)]
        hidden = [hidden for _, hidden in outputs if hidden is not None]
        return ForwardOutput(logits, torch.cat(hidden) if host.hidden_layers else None)

    def _extend(
        self, state: _SlotState, new_ids: list[int], hidden_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one slot's new tokens (after any tokens its cache lost): their logits ``[n, V]``
        float32 and the outputs of ``hidden_layers``, ``[n, h, D]`` (None when none asked)."""
        if state.cache is None:
            state.cache = DynamicCache(config=self.model.config)
        state.token_ids.extend(new_ids)
        pending = state.token_ids[state.cached :]
        input_ids = torch.tensor([pending], device=self.device)
        out = self.model(
            input_ids=input_ids,
            past_key_values=state.cache,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
        )
        state.cache, state.cached = out.past_key_values, len(state.token_ids)
        n = len(new_ids)
        if not hidden_layers:
            return out.logits[0, -n:].float(), None
        layers = [out.hidden_states[i + 1][0, -n:] for i in hidden_layers]  # entry 0: embeddings
        return out.logits[0, -n:].float(), torch.stack(layers, dim=1)
