"""The engine: continuous batching of requests, each with its own proposer and K.

One step (see ARCHITECTURE.md for the full data flow):

1. admit waiting requests into free KV-cache slots;
2. plan: each running request either decodes or feeds a prefill chunk;
3. propose: every proposer drafts for all its decoding requests at once;
4. one target forward over the ragged batch ``[uncached committed tokens, d_1 .. d_k]`` per
   decoding request, plus the prefill chunks;
5. verify all decoding requests together (greedy or rejection sampling);
6. commit each request's accepted tokens and bonus/correction token, check stop conditions on
   them, roll the target cache back to the committed length and tell the proposer.

Dimensions: ``num_seqs`` decoding requests in the step; ``k_i`` drafts of request i.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hybridspec.config import MAX_SPECULATIVE_TOKENS, EngineConfig
from hybridspec.engine.detokenizer import IncrementalDetokenizer
from hybridspec.engine.request import (
    FinishReason,
    GenerationParams,
    GenerationResult,
    Request,
    RequestOutput,
    new_generator,
)
from hybridspec.engine.scheduler import Scheduler
from hybridspec.engine.speculation import SpeculationPolicy, measure_verify_token_cost
from hybridspec.errors import HybridSpecError, InvalidRequestError, check
from hybridspec.model import ForwardBatch, LoadedModel, load_model
from hybridspec.proposers import Proposer, ProposerContext, ProposerRegistry, default_registry
from hybridspec.types import EMPTY_PROPOSAL, Proposal, ProposeRequest
from hybridspec.verifier import VerifyInput, verify
from hybridspec.verifier.uniforms import KeyedUniforms, key_of

logger = logging.getLogger(__name__)

Messages = Sequence[dict[str, str]]
CHAT_ROLES = ("system", "user", "assistant", "tool")


class Engine:
    """Generates with speculative decoding; every request picks its proposer and K.

    ``step()`` advances every running request by one verification round (the building block
    for servers); ``generate()`` and ``stream()`` run one request to completion.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        target: LoadedModel | None = None,
        registry: ProposerRegistry | None = None,
    ) -> None:
        self.config = config if config is not None else EngineConfig()
        self.target = target if target is not None else load_model(self.config.target)
        self.tokenizer = self.target.tokenizer
        self.eos_token_ids = frozenset(self.target.eos_token_ids)
        self.runtime = self.target.create_runtime(
            self.config.target.max_num_seqs, self.config.target.max_seq_len
        )
        self.max_seq_len = self.runtime.max_seq_len
        self.vocab_size = self.runtime.vocab_size
        self.scheduler = Scheduler(self.config.max_queue_size, self.config.prefill_chunk_size)
        self._registry = registry if registry is not None else default_registry()
        self._proposers: dict[str, Proposer] = {}
        self._unavailable: dict[str, str] = {}
        for name in self._registry.names():
            self._build_proposer(name)
        self.resolve_proposer(self.config.default_proposer)
        self._seq_ids = itertools.count()
        self.speculation: SpeculationPolicy | None = None
        if self.config.adaptive_speculation:
            cost = self.config.verify_token_cost
            if cost is None:
                cost = measure_verify_token_cost(self.runtime, MAX_SPECULATIVE_TOKENS)
                logger.info("verify cost per token: %.4f of a forward", cost)
            self.speculation = SpeculationPolicy(cost)

    # ----------------------------------------------------------------- proposers

    def _build_proposer(self, name: str) -> None:
        context = ProposerContext(
            vocab_size=self.vocab_size,
            eos_token_ids=tuple(sorted(self.eos_token_ids)),
            device=self.runtime.device,
            tokenizer=self.tokenizer,
            options=self.config.proposer_options().get(name, {}),
        )
        try:
            self._proposers[name] = self._registry.factory(name)(context)
            self._unavailable.pop(name, None)
        except HybridSpecError as exc:
            # A proposer that cannot be built (``draft`` with no draft model) stays listed:
            # requests naming it get this reason as their error.
            self._unavailable[name] = str(exc)
            logger.info("proposer %r unavailable: %s", name, exc)

    def register_proposer(self, name: str, factory: Any, *, replace: bool = False) -> None:
        """Register a custom proposer under ``name`` and build it; requests may then pick it."""
        self._registry.register(name, factory, replace=replace)
        old = self._proposers.pop(name, None)
        if old is not None:
            old.close()
        self._build_proposer(name)
        if name in self._unavailable:
            raise InvalidRequestError(
                f"proposer: {name!r} could not be built: {self._unavailable[name]}", "proposer"
            )

    def available_proposers(self) -> list[str]:
        return sorted(self._proposers)

    def unavailable_proposers(self) -> dict[str, str]:
        """Registered proposers that could not be built, with the reason."""
        return dict(self._unavailable)

    def resolve_proposer(self, name: str) -> Proposer:
        if name in self._unavailable:
            raise InvalidRequestError(
                f"proposer: {name!r} is not available: {self._unavailable[name]}", "proposer"
            )
        if name not in self._proposers:
            self._registry.factory(name)  # raises the error that lists the known names
        return self._proposers[name]

    # ------------------------------------------------------------------ requests

    def encode(self, prompt: str | None = None, messages: Messages | None = None) -> list[int]:
        """Token ids of a plain prompt, or of chat messages with the chat template applied."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise InvalidRequestError(
                "prompt: this model has no tokenizer; pass token ids", "prompt"
            )
        check(
            (prompt is None) != (messages is None),
            "prompt",
            "expected exactly one of a prompt or chat messages",
        )
        if prompt is not None:
            check(
                isinstance(prompt, str), "prompt", f"expected a string, got {type(prompt).__name__}"
            )
            return list(tokenizer.encode(prompt))
        check_messages(messages)
        try:
            text = tokenizer.apply_chat_template(
                list(messages or ()), tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # errors raised by the template itself, e.g. on roles
            raise InvalidRequestError(
                f"messages: the chat template rejected them: {exc}", "messages"
            ) from exc
        return list(tokenizer.encode(str(text), add_special_tokens=False))

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        n = len(prompt_token_ids)
        check(n >= 1, "prompt", "the prompt is empty")
        check(
            n < self.max_seq_len,
            "prompt",
            f"the prompt has {n} tokens; the context holds {self.max_seq_len}, "
            "so at most {} fit with room to generate".format(self.max_seq_len - 1),
        )
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        check(
            not bad,
            "prompt",
            f"token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}",
        )

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: GenerationParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; raises InvalidRequestError or CapacityError, else returns its id."""
        params = params if params is not None else GenerationParams()
        check(isinstance(params, GenerationParams), "params", "expected GenerationParams")
        prompt = list(prompt_token_ids)
        self.check_prompt(prompt)
        name = params.proposer or self.config.default_proposer
        self.resolve_proposer(name)
        check(
            not params.stop or self.tokenizer is not None,
            "stop",
            "stop strings need a tokenizer, and this model has none",
        )
        request = Request(
            request_id=request_id or uuid.uuid4().hex,
            seq_id=next(self._seq_ids),
            prompt_token_ids=prompt,
            params=params,
            proposer_name=name,
            num_speculative_tokens=params.num_speculative_tokens
            or self.config.default_num_speculative_tokens,
            generator=new_generator(params.sampling.seed),
            uniform_key=key_of(params.sampling.seed),
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt, params.stop),
        )
        self.scheduler.add(request)
        return request.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request, releasing everything it holds; None if it is not known."""
        request = self.scheduler.find(request_id)
        if request is None:
            return None
        return self._finish(request, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return len(self.scheduler) > 0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Advance every running request by one round; return what each one committed."""
        outputs: list[RequestOutput] = []
        self._admit(outputs)
        running = self.scheduler.running
        if not running:
            return outputs
        assert all(r.slot is not None for r in running)
        plan = self.scheduler.plan([self.runtime.seq_len(r.slot) for r in running])  # type: ignore[arg-type]
        drafts = self._propose(plan.decode, outputs)
        if not drafts and not plan.prefill:
            return outputs
        batch = self._build_batch(drafts, plan.prefill)
        logits = self.runtime.forward(batch)  # [sum(k_i + 1), vocab_size]
        if drafts:
            verified = verify(
                VerifyInput.from_proposals(
                    [p for _, p in drafts],
                    logits,
                    [r.params.sampling for r, _ in drafts],
                    [r.generator for r, _ in drafts],
                    [KeyedUniforms(r.uniform_key, len(r.token_ids)) for r, _ in drafts],
                )
            )
            committed = 0
            for (request, proposal), tokens, num_accepted in zip(
                drafts, verified.output_token_ids, verified.num_accepted.tolist(), strict=True
            ):
                committed += len(tokens)
                outputs.append(self._commit(request, tokens, num_accepted, proposal.num_tokens))
            if self.speculation is not None:
                verified_tokens = sum(p.num_tokens + 1 for _, p in drafts)
                self.speculation.record_step(committed, verified_tokens)
        return outputs

    def _admit(self, outputs: list[RequestOutput]) -> None:
        for request in self.scheduler.admit(self.runtime.num_free_slots()):
            request.slot = self.runtime.allocate()
            request.start_time = time.perf_counter()
            try:
                self._proposers[request.proposer_name].start(
                    request.seq_id, request.prompt_token_ids
                )
            except Exception as exc:  # a proposer's failure harms its own request only
                logger.exception("proposer %r failed to start", request.proposer_name)
                outputs.append(self._finish(request, FinishReason.ERROR, f"proposer: {exc}"))

    def _num_drafts(self, request: Request, proposer: Proposer) -> int:
        """Drafts to ask for this round: the request's K, shrunk so that committing k + 1 tokens
        fits the context and budget, then to what pays off (adaptive speculation)."""
        room = self.max_seq_len - len(request.token_ids) - 1
        budget = request.params.max_new_tokens - request.num_generated - 1
        k = max(0, min(request.num_speculative_tokens, room, budget))
        if self.speculation is None or k == 0:
            return k
        return self.speculation.num_drafts(
            request.speculation,
            k,
            by_step=request.params.sampling.is_greedy or not proposer.samples_drafts,
            proposer_cost_per_token=proposer.cost_per_token,
        )

    def _propose(
        self, decode: list[Request], outputs: list[RequestOutput]
    ) -> list[tuple[Request, Proposal]]:
        """Ask each proposer for its requests' drafts; a failing proposer fails its requests."""
        groups: dict[str, list[Request]] = {}
        for request in decode:
            groups.setdefault(request.proposer_name, []).append(request)
        proposals: dict[int, Proposal] = {}
        for name, requests in groups.items():
            proposer = self._proposers[name]
            asks = [
                ProposeRequest(
                    r.seq_id,
                    r.token_ids,
                    self._num_drafts(r, proposer),
                    r.params.sampling,
                    r.generator,
                )
                for r in requests
            ]
            try:
                got = proposer.propose(asks)
                check(
                    len(got) == len(asks),
                    "proposer",
                    f"{name!r} returned {len(got)} proposals for {len(asks)} requests",
                )
                for ask, proposal in zip(asks, got, strict=True):
                    self._check_proposal(proposal, ask.num_tokens)
                    proposals[ask.seq_id] = proposal
            except Exception as exc:
                logger.exception("proposer %r failed", name)
                for request in requests:
                    outputs.append(self._finish(request, FinishReason.ERROR, f"proposer: {exc}"))
        return [(r, proposals.get(r.seq_id, EMPTY_PROPOSAL)) for r in decode if not r.finished]

    def _check_proposal(self, proposal: Proposal, num_tokens: int) -> None:
        check(
            isinstance(proposal, Proposal),
            "proposer",
            f"expected a Proposal, got {type(proposal).__name__}",
        )
        check(
            proposal.num_tokens <= num_tokens,
            "proposer",
            f"proposed {proposal.num_tokens} tokens where at most {num_tokens} were asked",
        )
        check(
            all(isinstance(t, int) and 0 <= t < self.vocab_size for t in proposal.token_ids),
            "proposer",
            f"proposed token ids outside [0, {self.vocab_size})",
        )
        if proposal.probs is not None:
            check(
                proposal.probs.shape[-1] == self.vocab_size,
                "proposer",
                f"probs have {proposal.probs.shape[-1]} columns, the vocabulary {self.vocab_size}",
            )

    def _build_batch(
        self, drafts: list[tuple[Request, Proposal]], prefill: list[tuple[Request, int]]
    ) -> ForwardBatch:
        """Flatten decoding spans (with logits for their last k + 1 positions) and chunks."""
        slots: list[int] = []
        token_ids: list[int] = []
        cu = [0]
        logits_indices: list[int] = []
        for request, proposal in drafts:
            assert request.slot is not None
            cached = self.runtime.seq_len(request.slot)
            token_ids.extend(request.token_ids[cached:])
            token_ids.extend(proposal.token_ids)
            logits_indices.extend(range(len(token_ids) - proposal.num_tokens - 1, len(token_ids)))
            slots.append(request.slot)
            cu.append(len(token_ids))
        for request, num_tokens in prefill:
            assert request.slot is not None
            cached = self.runtime.seq_len(request.slot)
            token_ids.extend(request.token_ids[cached : cached + num_tokens])
            slots.append(request.slot)
            cu.append(len(token_ids))
        return ForwardBatch(
            slots=torch.tensor(slots, dtype=torch.long),
            token_ids=torch.tensor(token_ids, dtype=torch.long),
            cu_num_tokens=torch.tensor(cu, dtype=torch.long),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long),
        )

    def _commit(
        self, request: Request, tokens: list[int], num_accepted: int, num_proposed: int
    ) -> RequestOutput:
        """Append verified tokens, stopping at the first stop condition; roll caches back."""
        request.stats.record_round(num_proposed, num_accepted)
        request.speculation.update(num_proposed, num_accepted, len(tokens))
        detokenizer = request.detokenizer
        assert detokenizer is not None and request.slot is not None
        new_token_ids: list[int] = []
        reason: FinishReason | None = None
        for token in tokens:
            request.stats.generated_tokens += 1
            if token in self.eos_token_ids and not request.params.ignore_eos:
                reason = FinishReason.STOP
                break
            request.token_ids.append(token)
            new_token_ids.append(token)
            if detokenizer.append(token):
                reason = FinishReason.STOP
            elif (
                request.num_generated >= request.params.max_new_tokens
                or len(request.token_ids) >= self.max_seq_len
            ):
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        if request.stats.time_to_first_token_s is None:
            request.stats.time_to_first_token_s = time.perf_counter() - request.arrival_time
        if reason is not None:
            return self._finish(request, reason, new_token_ids=new_token_ids)
        self.runtime.truncate(request.slot, len(request.token_ids) - 1)
        try:
            self._proposers[request.proposer_name].commit(request.seq_id, tokens, num_accepted)
        except Exception as exc:
            logger.exception("proposer %r failed to commit", request.proposer_name)
            return self._finish(request, FinishReason.ERROR, f"proposer: {exc}", new_token_ids)
        return RequestOutput(request.request_id, new_token_ids, detokenizer.stream_text(), False)

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        error: str | None = None,
        new_token_ids: list[int] | None = None,
    ) -> RequestOutput:
        """End a request for ``reason`` and release its slot and its proposer's state."""
        request.finish_reason = reason
        request.error = error
        if request.slot is not None:
            self.runtime.free(request.slot)
            request.slot = None
            try:
                self._proposers[request.proposer_name].finish(request.seq_id)
            except Exception:
                logger.exception("proposer %r failed to finish", request.proposer_name)
        self.scheduler.remove(request)
        stats = request.stats
        if request.start_time is not None:
            stats.elapsed_s = time.perf_counter() - request.start_time
        detokenizer = request.detokenizer
        text = detokenizer.text if detokenizer is not None else ""
        result = GenerationResult(
            request_id=request.request_id,
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=reason,
            stats=stats,
            error=error,
        )
        return RequestOutput(
            request.request_id,
            new_token_ids or [],
            detokenizer.stream_text(final=True) if detokenizer is not None else "",
            True,
            reason,
            result,
        )

    # ------------------------------------------------------------- one request

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Messages | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        params: GenerationParams | None = None,
        **kwargs: Any,
    ) -> Iterator[RequestOutput]:
        """Run one request, yielding its outputs as tokens are committed.

        Keyword arguments not given through ``params`` go to ``GenerationParams.create``.
        Other requests already in the engine advance too, but only this one's outputs are
        yielded. Closing the iterator early aborts the request.
        """
        if params is None:
            params = GenerationParams.create(**kwargs)
        else:
            check(
                not kwargs, "params", f"give either params or keyword options, not {sorted(kwargs)}"
            )
        if prompt_token_ids is None:
            prompt_token_ids = self.encode(prompt, messages)
        else:
            check(
                prompt is None and messages is None,
                "prompt",
                "expected one of prompt, messages or prompt_token_ids",
            )
        request_id = self.add_request(prompt_token_ids, params)
        finished = False
        try:
            while not finished:
                for output in self.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                self.abort(request_id)

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Messages | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        params: GenerationParams | None = None,
        **kwargs: Any,
    ) -> GenerationResult:
        """Run one request to completion; see ``stream`` for the arguments."""
        for output in self.stream(
            prompt, messages=messages, prompt_token_ids=prompt_token_ids, params=params, **kwargs
        ):
            if output.result is not None:
                if output.finish_reason is FinishReason.ERROR:
                    raise HybridSpecError(output.result.error or "generation failed")
                return output.result
        raise AssertionError("stream ended without a final output")

    def abort_all(self) -> list[RequestOutput]:
        """Cancel every running and waiting request (at shutdown)."""
        requests = [*self.scheduler.running, *self.scheduler.waiting]
        return [self._finish(request, FinishReason.ABORT) for request in requests]

    def fail_running(self, message: str) -> list[RequestOutput]:
        """Fail every running request with ``message`` (after an unrecoverable step error)."""
        return [
            self._finish(request, FinishReason.ERROR, message)
            for request in list(self.scheduler.running)
        ]

    def reset(self) -> None:
        """Forget what earlier requests taught the engine: adaptive speculation's last step and
        the request counter, so that it runs as if just built (after ``engine.warmup``). Only
        between requests: every slot must be free."""
        check(not self.has_unfinished(), "engine", "reset with requests still in the engine")
        assert self.runtime.num_free_slots() == self.runtime.max_num_seqs
        self._seq_ids = itertools.count()
        if self.speculation is not None:
            self.speculation = SpeculationPolicy(self.speculation.verify_token_cost)

    def close(self) -> None:
        for proposer in self._proposers.values():
            proposer.close()
        self._proposers.clear()


def check_messages(messages: Messages | None) -> None:
    """Validate OpenAI-style chat messages: a non-empty list of {role, content} strings."""
    check(
        isinstance(messages, (list, tuple)) and len(messages) > 0,
        "messages",
        "expected a non-empty list of messages",
    )
    for i, message in enumerate(messages or ()):
        check(isinstance(message, dict), f"messages[{i}]", "expected an object")
        check(
            message.get("role") in CHAT_ROLES,
            f"messages[{i}].role",
            f"expected one of {CHAT_ROLES}, got {message.get('role')!r}",
        )
        check(
            isinstance(message.get("content"), str), f"messages[{i}].content", "expected a string"
        )
