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

``Engine`` is the one class callers use; its parts live beside it: requests' entry and
admission (``admission.Admission``: ``add_request``, ``add_choices``), the round after drafting
(``round.RoundSteps``: forward, verify, commit, finish), proposers, prompts, scheduling,
features and choices in their own modules. What stays here is the construction, the step
(with its fault containment) and the one-request API (``stream``, ``generate``,
``generate_choices``, ``abort``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hybridspec.config import MAX_SPECULATIVE_TOKENS, EngineConfig
from hybridspec.engine.admission import Admission
from hybridspec.engine.choices import (
    fork_ready,
    run_to_results,
)
from hybridspec.engine.prefix_cache import (
    PrefixCache,
    default_prefix_cache_mb,
    kv_bytes_per_token,
    num_slots_for,
    physical_memory_bytes,
)
from hybridspec.engine.prompts import Messages, encode
from hybridspec.engine.proposer_pool import ProposerPool
from hybridspec.engine.request import (
    FinishReason,
    GenerationParams,
    GenerationResult,
    RequestOutput,
)
from hybridspec.engine.round import ROUND_FAILED as ROUND_FAILED  # its public path
from hybridspec.engine.scheduler import Scheduler
from hybridspec.engine.speculation import SpeculationPolicy, measure_verify_token_cost
from hybridspec.engine.step_budget import FittedForwardCost, StepBudget
from hybridspec.engine.turns import Turns
from hybridspec.errors import HybridSpecError, check
from hybridspec.model import (
    LoadedModel,
    load_model,
    thread_controller,
)
from hybridspec.proposers import (
    Proposer,
    ProposerFactory,
    ProposerRegistry,
    default_registry,
)
from hybridspec.verifier.grammar import Grammars

logger = logging.getLogger(__name__)


class Engine(Admission):
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
        # before loading: the load runs forwards
        self.thread_policy = thread_controller(self.config.num_threads)
        self.target = target if target is not None else load_model(self.config.target)
        self.tokenizer = self.target.tokenizer
        self.eos_token_ids = frozenset(self.target.eos_token_ids)
        self.max_num_seqs = self.config.target.max_num_seqs
        budget_mb = self._prefix_cache_mb()
        cache_slots = self._prefix_cache_slots(budget_mb)
        self.runtime = self.target.create_runtime(
            self.max_num_seqs + cache_slots, self.config.target.max_seq_len
        )
        self.prefix_cache = PrefixCache(
            self.runtime, cache_slots, budget_mb * 2**20, kv_bytes_per_token(self.target)
        )
        self.max_seq_len = self.runtime.max_seq_len
        self.vocab_size = self.runtime.vocab_size
        self.forward_cost = FittedForwardCost()  # the machine's, kept across ``reset``
        self.scheduler = Scheduler(
            self.config.max_queue_size,
            self.config.prefill_chunk_size,
            self._step_budget(),
            turns=Turns(self.config.tenants),
        )
        self.proposers = ProposerPool(
            registry if registry is not None else default_registry(),
            self.config,
            self.target,
            self.runtime,
            draft,
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

    def _step_budget(self) -> StepBudget | None:
        """The time bound of steps that prefill beside decoding requests (``step_budget``);
        None where the configuration turns it off."""
        ratio = self.config.prefill_step_ratio
        if ratio is None:
            return None
        config = self.config
        return StepBudget(
            self.forward_cost,
            ratio,
            config.prefill_step_min_s,
            max_seconds=config.prefill_step_max_s,
        )

    def _prefix_cache_mb(self) -> int:
        """The prefix cache's budget of resident memory (0: off). By default it is on where
        reuse is exact to the bit: the native runtime in bfloat16 on CPU, row-invariant (in
        float32 a token decoded alone gets keys 1e-7 off its prefilled ones)."""
        budget = self.config.prefix_cache_mb
        if budget is None:
            exact = self.target.is_native and self.target.dtype == torch.bfloat16
            on_cpu = torch.device(self.config.target.device).type == "cpu"
            budget = default_prefix_cache_mb() if exact and on_cpu else 0
        return budget

    def _prefix_cache_slots(self, budget_mb: int) -> int:
        """Virtual slots the prefix cache gets beyond the running requests' (``num_slots_for``)."""
        max_seq_len = self.config.target.max_seq_len
        max_seq_len = max_seq_len or self.target.max_seq_len or self.target.context_length
        per_token = kv_bytes_per_token(self.target)
        return num_slots_for(budget_mb, per_token, max_seq_len, physical_memory_bytes())

    # ----------------------------------------------------------------- proposers

    def target_forward_s(self) -> float:
        """Seconds of a one-token target forward, timed in place on first use (0: no slot);
        the fastest of several, as proposers time their own (``DraftModelProposer``)."""
        return self.proposers.target_forward_s()

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
        if self.thread_policy is not None:
            self.thread_policy.for_step(prefill=plan.feeds_prompt)
        started = time.perf_counter()
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
        if self.thread_policy is not None and not plan.feeds_prompt:  # decode rounds compare
            self.thread_policy.observe(time.perf_counter() - started)
        return outputs + self._commit_all(verified)

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
        """Forget what earlier requests taught the engine: adaptive speculation's last step and
        the proposers' measured costs, the request counter, the prefix cache and the thread
        count chosen (``--threads auto`` starts again at every usable core: the warm-up's
        rounds, each of another proposer and batch, are no measure of the requests' steps), so
        that it runs as if just built (after ``engine.warmup``). Only between requests: every
        slot must be free."""
        check(not self.has_unfinished(), "engine", "reset with requests still in the engine")
        self.prefix_cache.reset()
        assert self.runtime.num_free_slots() == self.runtime.max_num_seqs
        self._seq_ids = itertools.count()
        if self.speculation is not None:
            self.speculation = SpeculationPolicy(self.speculation.verify_token_cost)
        if self.thread_policy is not None:
            self.thread_policy = thread_controller(self.config.num_threads)
        self.proposers.costs.clear()  # the warm-up's calls price no request's rounds

    def close(self) -> None:
        self.proposers.close()
