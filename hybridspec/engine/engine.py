"""The engine: continuous batching of requests, each with its own proposer and K.

One step, each stage one call into one module (docs/round.md follows its data in full):

1. schedule (``scheduler``): admit waiting requests into free KV-cache slots, seated by
   ``admission`` (the prefix cache, the proposers' start, choices' shared prefill), then plan:
   each running request either decodes or feeds a prefill chunk;
2. propose: every proposer drafts for all its decoding requests at once (``proposer_pool``,
   each request's draft count from ``drafts``);
3. build the round's one batch (``batch.build_round``) and run one target forward over it:
   ``[uncached committed tokens, d_1 .. d_k]`` per decoding request, plus the prefill chunks;
4. verify all decoding requests together (greedy or rejection sampling; ``batch.verify_round``);
5. commit each request's accepted tokens and bonus or recovered token, check stop conditions on
   them, roll the target cache back to the committed length and tell the proposer (``round``);
6. adaptive speculation learns the round's yield (``speculation``), and the requests that
   ended give back their slot, proposer state and place (``finish``).

A failure stays with the request it comes from (``step``): when the shared forward or
verification raises, the round runs again one sequence at a time.

``Engine`` is the one class callers use. It owns its parts, each its own object with its
collaborators passed in: ``admission`` (requests' entry), the ``scheduler``, the proposer pool
(``proposers``), ``draft_counts``, the round runner (``rounds``: commit), the ``prefix_cache``
and the ``finisher`` (how a request ends). What stays here is the construction, the step (with
its fault containment) and the one-request API (``stream``, ``generate``, ``generate_choices``,
``abort``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from hybridspec.config import EngineConfig
from hybridspec.engine import setup
from hybridspec.engine.admission import Admission
from hybridspec.engine.batch import build_round, run_round
from hybridspec.engine.choices import run_to_results
from hybridspec.engine.drafts import DraftCounts
from hybridspec.engine.finish import Ending, Finisher
from hybridspec.engine.prefix_cache import PrefixCache, kv_bytes_per_token
from hybridspec.engine.prompts import Messages, check_prompt, encode, prompt_and_params
from hybridspec.engine.proposer_pool import ProposerPool
from hybridspec.engine.request import (
    FinishReason,
    GenerationParams,
    GenerationResult,
    RequestOutput,
)
from hybridspec.engine.resolution import ProposerCatalog
from hybridspec.engine.round import ROUND_FAILED as ROUND_FAILED  # its public path
from hybridspec.engine.round import RoundRunner
from hybridspec.engine.row_costs import TimedForwardCost
from hybridspec.engine.scheduler import Scheduler
from hybridspec.engine.speculation import SpeculationPolicy
from hybridspec.engine.turns import Turns
from hybridspec.errors import HybridSpecError, check
from hybridspec.model import LoadedModel, load_model, thread_controller
from hybridspec.proposers import (
    Proposer,
    ProposerFactory,
    ProposerRegistry,
    default_registry,
)
from hybridspec.verifier.grammar import Grammars

logger = logging.getLogger(__name__)


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
        self.config = config = config if config is not None else EngineConfig()
        # before loading: the load runs forwards
        self.thread_policy = thread_controller(config.num_threads)
        self.target = target if target is not None else load_model(config.target)
        self.tokenizer = self.target.tokenizer
        self.eos_token_ids = frozenset(self.target.eos_token_ids)
        self.max_num_seqs = config.target.max_num_seqs
        budget_mb = setup.prefix_cache_mb(config, self.target)
        cache_slots = setup.prefix_cache_slots(config, self.target, budget_mb)
        self.runtime = self.target.create_runtime(
            self.max_num_seqs + cache_slots, config.target.max_seq_len
        )
        self.prefix_cache = PrefixCache(
            self.runtime, cache_slots, budget_mb * 2**20, kv_bytes_per_token(self.target)
        )
        self.max_seq_len = self.runtime.max_seq_len
        self.vocab_size = self.runtime.vocab_size
        self.forward_cost = TimedForwardCost()  # the machine's, kept across ``reset``
        self.scheduler = Scheduler(
            config.max_queue_size,
            config.prefill_chunk_size,
            setup.step_budget(config, self.forward_cost),
            turns=Turns(config.tenants),
        )
        self.proposers = ProposerPool(
            registry if registry is not None else default_registry(),
            config,
            self.target,
            self.runtime,
            draft,
        )
        self.proposers.catalog.find(config.default_proposer)
        self.finisher = Finisher(self.scheduler, self.prefix_cache)
        self.admission = Admission(
            config,
            self.tokenizer,
            self.runtime,
            self.eos_token_ids,
            self.scheduler,
            self.prefix_cache,
            self.proposers,
            self.finisher,
        )
        # Requests enter through admission: its methods, with their docstrings, are the engine's.
        self.add_request = self.admission.add_request
        self.add_choices = self.admission.add_choices
        self.draft_counts = DraftCounts(
            setup.speculation_policy(config, self.runtime),
            self.forward_cost,
            self.proposers,
            self.max_seq_len,
            config.measure_proposer_costs,
        )
        self.rounds = RoundRunner(self.runtime, self.forward_cost, self.eos_token_ids)

    @property
    def speculation(self) -> SpeculationPolicy | None:
        """Adaptive speculation's policy (None: off), which ``draft_counts`` keeps."""
        return self.draft_counts.speculation

    @speculation.setter
    def speculation(self, policy: SpeculationPolicy | None) -> None:
        self.draft_counts.speculation = policy

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

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        check_prompt(prompt_token_ids, self.max_seq_len, self.vocab_size)

    def num_free_slots(self) -> int:
        """Slots free for running requests (``Admission.num_free_slots``)."""
        return self.admission.num_free_slots()

    @property
    def catalog(self) -> ProposerCatalog:
        """What requests' proposers and K resolve against (``engine.resolution``)."""
        return self.proposers.catalog

    def grammars(self) -> Grammars:
        """The compiler of structured-output grammars (``Admission.grammars``)."""
        return self.admission.grammars()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request, releasing everything it holds; None if it is not known."""
        request = self.scheduler.find(request_id)
        if request is None:
            return None
        return self.finisher.finish(request, FinishReason.ABORT)

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

        The round reads: schedule (admit, seat, plan), propose, build, forward, verify,
        commit, finish; each stage is one call into one module. A failure is
        contained to its request: a proposer's (``ProposerPool.propose``), a commit's
        (``RoundRunner.commit``), and one in the shared forward or verification, after which
        every sequence of the round runs again alone (``RoundRunner.isolate``) and only those
        that fail alone fail.
        """
        plan, outputs = self.scheduler.schedule(self.max_num_seqs, self.admission)
        if not self.scheduler.running:
            return outputs
        if self.thread_policy is not None:
            self.thread_policy.for_step(prefill=plan.feeds_prompt)
        started = time.perf_counter()
        counts = self.draft_counts
        proposed = self.proposers.propose(plan.decode, counts.num_drafts, counts.shadow)
        ended = [Ending(r, FinishReason.ERROR, error) for r, error in proposed.failed]
        drafts, prefill = proposed.drafts, plan.prefill
        if not drafts and not prefill:
            return outputs + self.finisher.finish_round(ended)
        cached = {r.seq_id: self.runtime.seq_len(r.slot) for r, _ in (*drafts, *prefill)}  # type: ignore[arg-type]
        try:
            batch = build_round(drafts, prefill, cached, self.runtime.device)
            output, verified = run_round(self.runtime, batch, self.forward_cost, self.eos_token_ids)
        except Exception:
            logger.exception("a round of %d sequences failed; running each alone", len(cached))
            self.rounds.roll_back([r for r, _ in (*drafts, *prefill)], cached)
            committed = self.rounds.isolate(drafts, prefill, cached)
        else:
            seconds = time.perf_counter() - started
            committed = self.rounds.commit(batch, output, verified)
            policy = self.thread_policy
            if policy is not None and plan.feeds_prompt:  # prompt steps compare per token
                policy.observe_prompt(seconds, len(batch.forward.token_ids))
            elif policy is not None:  # decode rounds compare over the round's size
                relative = self.rounds.relative_time(batch, seconds)
                if relative is not None:
                    policy.observe(relative)
        if self.speculation is not None:  # adaptive speculation learns the round's yield
            self.speculation.record_step(committed.num_tokens, committed.num_rows)
        return outputs + self.finisher.finish_round([*ended, *committed.items])

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
        prompt_token_ids, params = prompt_and_params(
            self.encode, prompt, messages, prompt_token_ids, params, kwargs
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

    def generate(self, prompt: str | None = None, **kwargs: Any) -> GenerationResult:
        """Run one request to completion and return its result; the keyword arguments are
        ``stream``'s (``messages``, ``prompt_token_ids``, ``params``, or
        ``GenerationParams.create``'s)."""
        for output in self.stream(prompt, **kwargs):
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
        ids, params = prompt_and_params(
            self.encode, prompt, messages, prompt_token_ids, params, kwargs
        )
        return run_to_results(self.step, self.abort, self.add_choices([ids], params, n)[0])

    def abort_all(self) -> list[RequestOutput]:
        """Cancel every running and waiting request (at shutdown)."""
        requests = [*self.scheduler.running, *self.scheduler.waiting]
        return [self.finisher.finish(request, FinishReason.ABORT) for request in requests]

    def fail_running(self, message: str) -> list[RequestOutput]:
        """Fail every running request with ``message`` (after an unrecoverable step error)."""
        return [
            self.finisher.finish(request, FinishReason.ERROR, message)
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
        self.admission.seq_ids = itertools.count()
        if self.speculation is not None:
            self.speculation = SpeculationPolicy(self.speculation.verify_token_cost)
        if self.thread_policy is not None:
            self.thread_policy = thread_controller(self.config.num_threads)
        self.proposers.costs.clear()  # the warm-up's calls price no request's rounds

    def close(self) -> None:
        self.proposers.close()
