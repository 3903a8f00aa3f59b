"""The transformers baseline: the model family's own class (``LlamaForCausalLM``,
``Qwen3ForCausalLM``...) ``generate`` on the very weights we run.

``hf_model_from_weights`` un-fuses ``LlamaWeights`` (``wqkv`` -> q/k/v, ``w_gate_up`` ->
gate/up, in the family's layout) into that class built on the meta device, assigning the
tensors rather than copying them, so both sides share one copy of the weights, in one dtype,
with a tied ``lm_head`` where ours is tied. ``HFMethod`` times ``generate()``, plain or with
prompt lookup decoding (``prompt_lookup_num_tokens``, transformers' n-gram speculation).

Draft counting for prompt lookup, from the tokens fed to each forward: the first forward
feeds the prompt plus ``c_1`` candidates, each later one its ``c_i`` candidates plus the last
committed token; every forward commits its accepted candidates plus one token of the target,
so ``accepted = generated - forwards``. Example: prompt 50, forwards fed [53, 4, 1] and 7
tokens generated: drafted 3 + 3 + 0 = 6, accepted 7 - 3 = 4.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaForCausalLM

from hybridspec.bench.records import Measurement, Speculation, first_difference
from hybridspec.bench.timing import ModuleForwardTimer
from hybridspec.errors import InvalidRequestError
from hybridspec.model import LlamaWeights, LoadedModel
from hybridspec.types import SamplingParams

logger = logging.getLogger(__name__)


def hf_model_from_weights(loaded: LoadedModel) -> LlamaForCausalLM:
    """A transformers model of ``loaded``'s family (``LlamaForCausalLM`` for Llama) sharing its
    native weights (no copy)."""
    weights = loaded.weights
    if not isinstance(weights, LlamaWeights):
        raise InvalidRequestError(
            "methods: the transformers baselines need a natively loaded Llama target; "
            f"{loaded.source} runs on the generic runtime",
            "methods",
        )
    config = copy.deepcopy(loaded.hf_config)
    config.tie_word_embeddings = weights.lm_head is weights.embed
    config.dtype = weights.dtype
    with torch.device("meta"):  # the family's own class (``model.families``): Qwen3's, Phi-3's...
        model: LlamaForCausalLM = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(weights.hf_state_dict(), strict=False, assign=True)
    tied_head = ["lm_head.weight"] if config.tie_word_embeddings else []
    assert list(missing) == tied_head and not unexpected, (missing, unexpected)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Buffers are not in the state dict: rebuild the rotary table from the config, as
    # transformers does at construction, on the weights' device.
    model.model.rotary_emb = type(model.model.rotary_emb)(config).to(weights.device)
    embed = model.model.embed_tokens  # Gemma's scaled embedding keeps its scale in a buffer
    if isinstance(getattr(embed, "embed_scale", None), torch.Tensor):
        embed.embed_scale = torch.tensor(embed.scalar_embed_scale, device=weights.device)
    return model.eval()


class HFMethod:
    """``generate()`` of a transformers model: plain, or prompt lookup with ``K`` candidates."""

    def __init__(
        self,
        name: str,
        model: LlamaForCausalLM,
        eos_token_ids: Sequence[int],
        prompt_lookup_num_tokens: int | None,
    ) -> None:
        self.name = name
        self.model = model
        self._eos = list(eos_token_ids)
        self._lookup = prompt_lookup_num_tokens
        self._timer = ModuleForwardTimer(model)
        self._device = next(model.parameters()).device

    def generation_config(self, sampling: SamplingParams, max_new_tokens: int) -> GenerationConfig:
        """Our sampling parameters in transformers' terms (its default top_k=50 switched off)."""
        options: dict[str, object] = {"do_sample": False}
        if not sampling.is_greedy:
            options = {
                "do_sample": True,
                "temperature": sampling.temperature,
                "top_k": sampling.top_k or 0,
                "top_p": sampling.top_p,
            }
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            eos_token_id=self._eos,
            pad_token_id=self._eos[0],
            prompt_lookup_num_tokens=self._lookup,
            **options,
        )

    def run(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        max_new_tokens: int,
        session: str | None = None,  # kept no text from one request to the next: unused
    ) -> Measurement:
        input_ids = torch.tensor([list(prompt_token_ids)], dtype=torch.long, device=self._device)
        config = self.generation_config(sampling, max_new_tokens)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        self._timer.reset()
        self._timer.install()
        try:
            start = time.perf_counter()
            with torch.inference_mode():
                # Some transformers releases annotate generate's self as a mixin protocol that
                # LlamaForCausalLM satisfies at run time but not for mypy; others do not.
                output = self.model.generate(  # type: ignore[misc,unused-ignore]
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    generation_config=config,
                )
            elapsed = time.perf_counter() - start
        finally:
            self._timer.uninstall()
        generated = output[0, input_ids.shape[1] :].tolist()
        fed = self._timer.input_tokens
        num_drafted = (fed[0] - len(prompt_token_ids)) + sum(n - 1 for n in fed[1:]) if fed else 0
        speculation = Speculation(
            token_ids=tuple(_strip_eos(generated, self._eos)),
            num_generated=len(generated),
            target_forwards=len(fed),
            num_drafts=num_drafted,
            num_accepted_tokens=len(generated) - len(fed),
        )
        return Measurement((speculation,), elapsed, self._timer.seconds)


def _strip_eos(token_ids: list[int], eos_token_ids: Sequence[int]) -> list[int]:
    """The generated ids before the first EOS (which our engine does not return either)."""
    for i, token in enumerate(token_ids):
        if token in eos_token_ids:
            return token_ids[:i]
    return token_ids


@dataclass(frozen=True, slots=True)
class ParityResult:
    """Whether transformers' greedy output equals ours on the warm-up prompt.

    On a mismatch, ``logit_gap`` is transformers' logit of its own token minus its logit of
    ours at the first differing position, fed our output up to there: a gap near the dtype's
    rounding step (bfloat16 keeps 8 bits of mantissa) means a near-tie that rounding decided;
    a large one means the two models differ.
    """

    ours: str
    theirs: str
    num_compared: int
    first_mismatch: int | None = None
    our_token: int | None = None
    their_token: int | None = None
    logit_gap: float | None = None

    @property
    def identical(self) -> bool:
        return self.first_mismatch is None

    def message(self) -> str:
        if self.identical:
            return (
                f"parity: {self.theirs} and {self.ours} greedy outputs are identical "
                f"({self.num_compared} tokens)"
            )
        return (
            f"PARITY MISMATCH: {self.theirs} greedy output differs from {self.ours} at token "
            f"{self.first_mismatch} of {self.num_compared} (ours {self.our_token}, theirs "
            f"{self.their_token}; transformers' logit gap there {self.logit_gap:+.4f})"
        )


def check_parity(
    ours: tuple[str, Sequence[int]],
    theirs: tuple[str, Sequence[int]],
    model: LlamaForCausalLM,
    prompt_token_ids: Sequence[int],
) -> ParityResult:
    """Compare two greedy outputs ``(method name, generated ids)``; diagnose a mismatch."""
    a, b = list(ours[1]), list(theirs[1])
    n = max(len(a), len(b))
    i = first_difference(a, b)
    if i is None:
        return ParityResult(ours[0], theirs[0], n)
    if i == min(len(a), len(b)):  # one ended (EOS) where the other went on
        our_token = a[i] if i < len(a) else None
        their_token = b[i] if i < len(b) else None
        return ParityResult(ours[0], theirs[0], n, i, our_token, their_token)
    device = next(model.parameters()).device
    context = torch.tensor([[*prompt_token_ids, *a[:i]]], dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = model(input_ids=context).logits[0, -1].float()
    gap = float(logits[b[i]] - logits[a[i]])
    return ParityResult(ours[0], theirs[0], n, i, a[i], b[i], gap)
