"""The engine: continuous batching of requests, each with its own proposer and K.

One step (see ARCHITECTURE.md for the full data flow):

1. admit waiting requests into free KV-cache slots;
2. plan: each running request either decodes or feeds a prefill chunk;
3. propose: every proposer drafts for all its decoding requests at once;
4. one target forward over the ragged batch ``[uncached committed tokens, d_1 .. d_k]`` per
   decoding request, plus the prefill chunks;
5. verify all decoding requests together (greedy or rejection sampling);
6. commit each request's accepted tokens and bonus or recovered token, check stop conditions on
   them, roll the target cache back to the committed length and tell the proposer.

A failure stays with the request it comes from (``step``): when the shared forward or
verification raises, the round runs again one sequence at a time.

Dimensions: ``num_seqs`` decoding requests in the step; ``k_i`` drafts of request i.

The module is near 600 lines because ``Engine`` is the one class callers use: proposers,
prompts, scheduling, features and choices live in their own modules, and what stays is the
step (with its fault containment) and the request API (``add_request``, ``add_choices``,
``abort``, ``stream``, ``generate``, ``generate_choices``) over them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridspec.config import MAX_SPECULATIVE_TOKENS, EngineConfig
from hybridspec.engine.choices import (
    check_choices,
    choice_seed,
    fork_ready,
    group_choices,
    leave,
    run_to_results,
)
from hybridspec.engine.detokenizer import IncrementalDetokenizer
from hybridspec.engine.features import forward_layers, keep_committed_rows, take_rows
from hybridspec.engine.logprobs import Logprobs
from hybridspec.engine.prefix_cache import (
    PrefixCache,
    default_prefix_cache_mb,
    kv_bytes_per_token,
    num_slots_for,
)
from hybridspec.engine.prompts import Messages, check_prompt, encode
from hybridspec.engine.proposer_pool import ProposerPool, proposer_context
from hybridspec.engine.request import (
    FinishReason,
    GenerationParams,
    GenerationResult,
    Request,
    RequestOutput,
    new_generator,
)
from hybridspec.engine.resolution import ProposerCatalog
from hybridspec.engine.scheduler import Scheduler, StepBatch, forward_batch
from hybridspec.engine.speculation import SpeculationPolicy, measure_verify_token_cost
from hybridspec.errors import HybridSpecError, check
from hybridspec.model import (
    LoadedModel,
    fastest_forward_seconds,
    load_model,
    set_num_threads,
)
from hybridspec.proposers import (
    Proposer,
    ProposerFactory,
    ProposerRegistry,
    default_registry,
)
from hybridspec.types import CommitInfo, Proposal
from hybridspec.verifier import VerifyInput, VerifyOutput, check_logit_bias, verify
from hybridspec.verifier.grammar import Grammars
from hybridspec.verifier.layout import DraftLayout
from hybridspec.verifier.uniforms import KeyedUniforms, key_of

logger = logging.getLogger(__name__)

# What a request that failed inside the engine is told; the detail goes to the log.
ROUND_FAILED = "engine: this request's round failed (details in the server log)"


@dataclass(frozen=True, slots=True)
class _Round:
    """One forward's sequences and results, between verification and commit."""

    drafts: list[tuple[Request, Proposal]]  # decoding requests, verified
    prefill: list[tuple[Request, int]]  # (request, prompt tokens fed)
    fed: list[Proposer]  # per sequence of the batch: drafts then prefill
    step: StepBatch
    logits: torch.Tensor  # [num_logits, vocab_size]: the verified rows, then prompt rows
    hidden_states: torch.Tensor | None  # [num_tokens, len(batch.hidden_layers), hidden_size]
    layout: DraftLayout | None  # the decoding requests' drafts and rows; None: none decodes
    verified: VerifyOutput | None  # None: no decoding request


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
        draft: LoadedModel | None = None,
        registry: ProposerRegistry | None = None,
    ) -> None:
        """Load the target (and the draft model, if configured) unless given, and build every
        registered proposer (``registry``; default: ``proposers.default_registry()``)."""
        self.config = config if config is not None else EngineConfig()
        if self.config.num_threads is not None:
            set_num_threads(self.config.num_threads)  # before loading: the load runs forwards
        self.target = target if target is not None else load_model(self.config.target)
        self.tokenizer = self.target.tokenizer
        self.eos_token_ids = frozenset(self.target.eos_token_ids)
        self.max_num_seqs = self.config.target.max_num_seqs
        cache_slots = self._prefix_cache_slots()
        self.runtime = self.target.create_runtime(
            self.max_num_seqs + cache_slots, self.config.target.max_seq_len
        )
        self.prefix_cache = PrefixCache(self.runtime, cache_slots)
        self.max_seq_len = self.runtime.max_seq_len
        self.vocab_size = self.runtime.vocab_size
        self.scheduler = Scheduler(self.config.max_queue_size, self.config.prefill_chunk_size)
        self._target_forward_s: float | None = None
        context = proposer_context(
            self.config, self.target, self.runtime, draft, self.target_forward_s, self._session_of
        )
        self.proposers = ProposerPool(
            registry if registry is not None else default_registry(), context
        )
        self.proposers.catalog.find(self.config.default_proposer)
        self._seq_ids = itertools.count()
        self._grammars: Grammars | None = None
        self.speculation: SpeculationPolicy | None = None
        if self.config.adaptive_speculation:
            cost = self.config.verify_token_cost
            if cost is None:
                cost = measure_verify_token_cost(self.runtime, MAX_SPECULATIVE_TOKENS)
                logger.info("verify cost per token: %.4f of a forward", cost)
            self.speculation = SpeculationPolicy(cost)

    def _prefix_cache_slots(self) -> int:
        """Slots the prefix cache's budget buys beyond the running requests' (0: off). By
        default it is on where reuse is exact to the bit: the native runtime in bfloat16 on CPU,
        row-invariant (in float32 a token decoded alone gets keys 1e-7 off its prefilled ones)."""
        budget = self.config.prefix_cache_mb
        if budget is None:
            exact = self.target.is_native and self.target.dtype == torch.bfloat16
            on_cpu = torch.device(self.config.target.device).type == "cpu"
            budget = default_prefix_cache_mb() if exact and on_cpu else 0
        if budget == 0:
            return 0
        max_seq_len = self.config.target.max_seq_len
        max_seq_len = max_seq_len or self.target.max_seq_len or self.target.context_length
        return num_slots_for(budget, kv_bytes_per_token(self.target), max_seq_len)

    def _session_of(self, seq_id: int) -> str | None:
        """The session of a running request (its proposer's ``start`` asks)."""
        for request in self.scheduler.running:
            if request.seq_id == seq_id:
                return request.params.session
        return None

    def num_free_slots(self) -> int:
        """Slots free for running requests (the prefix cache gives up its entries for them)."""
        return self.max_num_seqs - len(self.scheduler.running)

    # ----------------------------------------------------------------- proposers

    def target_forward_s(self) -> float:
        """Seconds of a one-token target forward, timed in place on first use (0: no slot);
        the fastest of several, as proposers time their own (``DraftModelProposer``)."""
        if self._target_forward_s is None:
            seconds = fastest_forward_seconds(self.runtime)
            self._target_forward_s = seconds if seconds is not None else 0.0
        return self._target_forward_s

    def register_proposer(
        self, name: str, factory: ProposerFactory, *, replace: bool = False
    ) -> None:
        """Register a custom proposer under ``name`` and build it; requests may then pick it."""
        self.proposers.register(name, factory, replace=replace)

    def available_proposers(self) -> list[str]:
        return self.proposers.available()

    def unavailable_proposers(self) -> dict[str, str]:
        """Registered proposers that could not be built, with the reason."""
        return self.proposers.unavailable()

    def resolve_proposer(self, name: str) -> Proposer:
        """The proposer ``name``; InvalidRequestError when it is unknown or unavailable."""
        return self.proposers.catalog.find(name)

    @property
    def catalog(self) -> ProposerCatalog:
        """What requests' proposers and K resolve against (``engine.resolution``)."""
        return self.proposers.catalog

    def grammars(self) -> Grammars:
        """The compiler of structured-output grammars for this model's tokenizer (built on
        first use: reading the vocabulary takes a fraction of a second)."""
        check(
            self.tokenizer is not None,
            "grammar",
            "structured output needs the model's tokenizer, and this model has none",
        )
        if self._grammars is None:
            eos = sorted(self.eos_token_ids)
            cache_bytes = self.config.grammar_cache_mb * 1024 * 1024
            self._grammars = Grammars(self.tokenizer, self.vocab_size, eos, cache_bytes)
        return self._grammars

    # ------------------------------------------------------------------ requests

    def encode(
        self,
        prompt: str | None = None,
        messages: Messages | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a plain prompt, or of chat messages with the chat template applied
        (and ``tools``, for a template that shows them)."""
        return encode(self.tokenizer, prompt, messages, tools)

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        check_prompt(prompt_token_ids, self.max_seq_len, self.vocab_size)

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: GenerationParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; raises InvalidRequestError or CapacityError, else returns its id."""
        request = self._new_request(prompt_token_ids, params, request_id)
        self.scheduler.add(request, self.num_free_slots())
        return request.request_id

    def add_choices(
        self,
        prompts: Sequence[Sequence[int]],
        params: GenerationParams | Sequence[GenerationParams] | None = None,
        n: int = 1,
    ) -> list[list[str]]:
        """Queue ``n`` choices of each prompt (``params``: one for all, or one per prompt),
        all or none; each prompt is prefilled once for its choices, and choice ``i`` samples
        with seed ``seed + i`` (``engine.choices``). Returns the ids, ``[prompt][choice]``."""
        check_choices(n, len(prompts), self.max_num_seqs, self.config.max_queue_size)
        if params is None or isinstance(params, GenerationParams):
            params = [params or GenerationParams()] * len(prompts)
        check(len(params) == len(prompts), "params", "expected one GenerationParams per prompt")
        groups = [
            [self._new_request(prompt, one, choice_index=i) for i in range(n)]
            for prompt, one in zip(prompts, params, strict=True)
        ]
        for group in groups:
            group_choices(group)
        self.scheduler.add_all(groups, self.num_free_slots())
        return [[r.request_id for r in group] for group in groups]

    def _new_request(
        self,
        prompt_token_ids: Sequence[int],
        params: GenerationParams | None,
        request_id: str | None = None,
        choice_index: int = 0,
    ) -> Request:
        """A checked request, not queued yet."""
        params = params if params is not None else GenerationParams()
        check(isinstance(params, GenerationParams), "params", "expected GenerationParams")
        prompt = list(prompt_token_ids)
        self.check_prompt(prompt)
        check_logit_bias(params.sampling, self.vocab_size)
        check(
            all(t < self.vocab_size for t in params.stop_token_ids),
            "stop_token_ids",
            f"expected token ids below the vocabulary size {self.vocab_size}",
        )
        resolved = params.resolved or self.catalog.resolve(
            params.proposer, params.num_speculative_tokens
        )
        check(
            not params.stop or self.tokenizer is not None,
            "stop",
            "stop strings need a tokenizer, and this model has none",
        )
        seed = choice_seed(params.sampling.seed, choice_index)
        return Request(
            request_id=request_id or uuid.uuid4().hex,
            seq_id=next(self._seq_ids),
            prompt_token_ids=prompt,
            params=params,
            resolved=resolved,
            generator=new_generator(seed),
            uniform_key=key_of(seed),
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt, params.stop),
            constraint=None if params.grammar is None else self.grammars().state(params.grammar),
        )

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
        """Advance every running request by one round; return what each one committed.

        A failure is contained to its request: a proposer's (``ProposerPool.propose``), a
        commit's (``_commit_all``), and one in the shared forward or verification, after which
        every sequence of the round runs again alone (``_isolate``) and only those that fail
        alone fail.
        """
        outputs: list[RequestOutput] = []
        self._admit(outputs)
        fork_ready(self.scheduler.running, self.runtime)  # choices share their prompt's prefill
        running = self.scheduler.running
        if not running:
            return outputs
        assert all(r.slot is not None for r in running)
        plan = self.scheduler.plan([self.runtime.seq_len(r.slot) for r in running])  # type: ignore[arg-type]
        proposed = self.proposers.propose(plan.decode, self._num_drafts)
        for request, error in proposed.failed:
            outputs.append(self._finish(request, FinishReason.ERROR, error))
        drafts = proposed.drafts
        if not drafts and not plan.prefill:
            return outputs
        cached = {r.seq_id: self.runtime.seq_len(r.slot) for r, _ in (*drafts, *plan.prefill)}  # type: ignore[arg-type]
        try:
            verified = self._forward_and_verify(drafts, plan.prefill)
        except Exception:
            logger.exception("a round of %d sequences failed; running each alone", len(cached))
            self._roll_back(cached)
            return outputs + self._isolate(drafts, plan.prefill, cached)
        return outputs + self._commit_all(verified)

    def _forward_and_verify(
        self, drafts: list[tuple[Request, Proposal]], prefill: list[tuple[Request, int]]
    ) -> _Round:
        """One target forward over the decoding spans and prefill chunks, and verification of
        the drafts. Changes nothing but the fed sequences' target caches."""
        fed = [r.proposer for r, _ in (*drafts, *prefill)]
        step = forward_batch(drafts, prefill, self.runtime.seq_len, forward_layers(fed))
        output = self.runtime.forward(step.batch)
        logits = output.logits[: step.num_verify_rows]  # the verified rows
        inp = self._verify_input(drafts, logits) if drafts else None
        verified = verify(inp) if inp is not None else None
        layout = inp.layout if inp is not None else None
        hidden = output.hidden_states
        return _Round(drafts, prefill, fed, step, output.logits, hidden, layout, verified)

    def _commit_all(self, round_: _Round) -> list[RequestOutput]:
        """Score prompts that asked, then commit each decoding request's verified tokens; a
        failure fails that request only."""
        drafts, verified, layout = round_.drafts, round_.verified, round_.layout
        logits = round_.step.score_prompts(round_.logits)  # the verified rows
        accepted = verified.num_accepted.tolist() if verified is not None else []
        num_drafts = layout.num_drafts if layout is not None else ()
        outputs: list[RequestOutput] = []
        if round_.hidden_states is not None:
            rejected = [k - n for k, n in zip(num_drafts, accepted, strict=True)]
            requests = [r for r, _ in (*drafts, *round_.prefill)]
            rejected += [0] * len(round_.prefill)
            keep_committed_rows(
                round_.step.batch, round_.hidden_states, requests, round_.fed, rejected
            )
        if verified is None or layout is None:
            return outputs
        if verified.controlled_logits is not None:  # what p was made from: logprobs read it too
            logits = verified.controlled_logits
        committed = 0
        for (request, proposal), k, row, tokens, num_accepted in zip(
            drafts,
            num_drafts,
            layout.row_offsets,
            verified.output_token_ids,
            accepted,
            strict=False,
        ):  # row_offsets has one entry more
            committed += len(tokens)
            rows = logits[row : row + len(tokens)]  # the rows that produced ``tokens``
            try:
                drafted_by = proposal.drafted_by or request.proposer_name
                outputs.append(self._commit(request, tokens, num_accepted, k, rows, drafted_by))
            except Exception:
                logger.exception("committing request %s failed", request.request_id)
                outputs.append(self._finish(request, FinishReason.ERROR, ROUND_FAILED))
        if self.speculation is not None:
            self.speculation.record_step(committed, layout.num_rows)
        return outputs

    def _roll_back(self, cached: dict[int, int]) -> None:
        """Return the target cache of every sequence in ``cached`` (seq_id -> length) to its
        length before a failed round."""
        for request in self.scheduler.running:
            length = cached.get(request.seq_id)
            slot = request.slot
            if length is not None and slot is not None and self.runtime.seq_len(slot) > length:
                self.runtime.truncate(slot, length)

    def _isolate(
        self,
        drafts: list[tuple[Request, Proposal]],
        prefill: list[tuple[Request, int]],
        cached: dict[int, int],
    ) -> list[RequestOutput]:
        """Run a failed round again one sequence at a time, with the same drafts: those that
        succeed commit as they would have; those that fail alone end with an error."""
        outputs: list[RequestOutput] = []
        alone: list[tuple[list[tuple[Request, Proposal]], list[tuple[Request, int]]]] = [
            *(([entry], []) for entry in drafts),
            *(([], [entry]) for entry in prefill),
        ]
        for one_draft, one_prefill in alone:
            request = (one_draft or one_prefill)[0][0]
            try:
                verified = self._forward_and_verify(one_draft, one_prefill)
            except Exception:
                logger.exception("request %s failed alone", request.request_id)
                self._roll_back({request.seq_id: cached[request.seq_id]})
                outputs.append(self._finish(request, FinishReason.ERROR, ROUND_FAILED))
                continue
            outputs += self._commit_all(verified)
        return outputs

    def _verify_input(
        self, drafts: list[tuple[Request, Proposal]], logits: torch.Tensor
    ) -> VerifyInput:
        """Every decoding request's drafts against ``logits`` [sum(k_i + 1), vocab_size], with
        the round's ``DraftLayout`` (built here, once; the commit reads it too)."""
        return VerifyInput.from_proposals(
            [p for _, p in drafts],
            logits,
            [r.params.sampling for r, _ in drafts],
            [r.generator for r, _ in drafts],
            [KeyedUniforms(r.uniform_key, len(r.token_ids)) for r, _ in drafts],
            checked=True,  # by the proposer pool, where they entered
            histories=[r.history(self.eos_token_ids) for r, _ in drafts],
        )

    def _admit(self, outputs: list[RequestOutput]) -> None:
        for request in self.scheduler.admit(self.num_free_slots()):
            request.slot, request.stats.cached_tokens = self.prefix_cache.allocate(
                self._cache_lookup(request)
            )
            request.start_time = time.perf_counter()
            try:
                request.proposer.start(request.seq_id, request.prompt_token_ids)
            except Exception as exc:  # a proposer's failure harms its own request only
                logger.exception("proposer %r failed to start", request.proposer_name)
                outputs.append(self._finish(request, FinishReason.ERROR, f"proposer: {exc}"))

    def _cache_lookup(self, request: Request) -> list[int] | None:
        """The prompt to look up in the prefix cache, or None where the request must prefill
        it all: it asked not to, it scores its prompt (the skipped rows would be missing), its
        proposer reads the target's features of every position, or it is a choice waiting for
        its group's source's prefill."""
        grouped = request.group is not None and request.group.source is not request
        if (
            not request.params.cache_prompt
            or request.params.prompt_logprobs is not None
            or request.proposer.feature_layers
            or grouped
        ):
            return None
        return request.prompt_token_ids

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

    def _commit(
        self,
        request: Request,
        tokens: list[int],
        num_accepted: int,
        num_drafts: int,
        logits: torch.Tensor,
        drafted_by: str,
    ) -> RequestOutput:
        """Append verified tokens, stopping at the first stop condition; roll caches back.
        ``logits`` [len(tokens), vocab_size]: the target's rows that produced ``tokens``;
        ``drafted_by``: the proposer whose drafts they are (``RequestOutput.drafted_by``)."""
        request.stats.record_round(num_drafts, num_accepted)
        request.speculation.update(num_drafts, num_accepted, len(tokens))
        assert request.detokenizer is not None and request.slot is not None
        new_token_ids, consumed, reason = request.append(
            tokens, self.eos_token_ids, self.max_seq_len
        )
        logprobs = request.score_committed(logits[:consumed], tokens[:consumed])
        # The accepted drafts lead the round's tokens: the first ``num_drafted`` appended.
        num_drafted = min(num_accepted, len(new_token_ids))
        if reason is not None:
            output = self._finish(request, reason, new_token_ids=new_token_ids, logprobs=logprobs)
            return dataclasses.replace(output, num_drafted=num_drafted, drafted_by=drafted_by)
        if request.constraint is not None:
            request.constraint.commit(new_token_ids)
        self.runtime.truncate(request.slot, len(request.token_ids) - 1)
        hidden_states, hidden_position = take_rows(request)
        try:
            request.proposer.commit(
                CommitInfo(request.seq_id, tokens, num_accepted, hidden_states, hidden_position)
            )
        except Exception as exc:
            logger.exception("proposer %r failed to commit", request.proposer_name)
            return self._finish(
                request, FinishReason.ERROR, f"proposer: {exc}", new_token_ids, logprobs
            )
        return RequestOutput(
            request.request_id,
            new_token_ids,
            request.detokenizer.stream_text(),
            False,
            logprobs=logprobs,
            prompt_logprobs=request.take_prompt_logprobs(),
            num_drafted=num_drafted,
            drafted_by=drafted_by,
        )

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        error: str | None = None,
        new_token_ids: list[int] | None = None,
        logprobs: Logprobs | None = None,
    ) -> RequestOutput:
        """End a request for ``reason`` and release its slot and its proposer's state."""
        request.finish_reason = reason
        request.error = error
        if request.slot is not None:
            retain = request.params.cache_prompt and reason is not FinishReason.ERROR
            self.prefix_cache.release(request.slot, request.token_ids, retain)
            request.slot = None
            try:
                request.proposer.finish(request.seq_id)
            except Exception:
                logger.exception("proposer %r failed to finish", request.proposer_name)
        leave(request)
        self.scheduler.remove(request)
        return request.final_output(new_token_ids or [], logprobs)

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
        prompt_token_ids, params = self._prompt_and_params(
            prompt, messages, prompt_token_ids, params, kwargs
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

    def generate_choices(
        self,
        prompt: str | None = None,
        *,
        n: int,
        messages: Messages | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        params: GenerationParams | None = None,
        **kwargs: Any,
    ) -> list[GenerationResult]:
        """Run ``n`` choices of one prompt to completion, its prefill shared, and return their
        results in choice order (``engine.choices``; arguments as for ``stream``)."""
        ids, params = self._prompt_and_params(prompt, messages, prompt_token_ids, params, kwargs)
        return run_to_results(self.step, self.abort, self.add_choices([ids], params, n)[0])

    def _prompt_and_params(
        self,
        prompt: str | None,
        messages: Messages | None,
        prompt_token_ids: Sequence[int] | None,
        params: GenerationParams | None,
        kwargs: dict[str, Any],
    ) -> tuple[Sequence[int], GenerationParams]:
        """The prompt's token ids and the parameters, from ``stream``'s arguments."""
        if params is None:
            params = GenerationParams.create(**kwargs)
        else:
            check(
                not kwargs, "params", f"give either params or keyword options, not {sorted(kwargs)}"
            )
        if prompt_token_ids is None:
            return self.encode(prompt, messages), params
        check(
            prompt is None and messages is None,
            "prompt",
            "expected one of prompt, messages or prompt_token_ids",
        )
        return prompt_token_ids, params

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
        """Forget what earlier requests taught the engine: adaptive speculation's last step, the
        request counter and the prefix cache, so that it runs as if just built (after
        ``engine.warmup``). Only between requests: every slot must be free."""
        check(not self.has_unfinished(), "engine", "reset with requests still in the engine")
        self.prefix_cache.clear()
        self.prefix_cache = PrefixCache(self.runtime, self.prefix_cache.num_slots)
        assert self.runtime.num_free_slots() == self.runtime.max_num_seqs
        self._seq_ids = itertools.count()
        if self.speculation is not None:
            self.speculation = SpeculationPolicy(self.speculation.verify_token_cost)

    def close(self) -> None:
        self.proposers.close()
