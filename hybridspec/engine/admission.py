"""How requests enter the engine: checked and resolved where they enter (``add_request``,
``add_choices``: the proposer and K through ``ProposerCatalog``, the prompt, ``logit_bias`` and
stop ids against the model), then seated in KV-cache slots with the prefix cache's help
(``seat``, for the requests ``Scheduler.schedule`` admits), each one's proposer started.
``Engine`` owns one ``Admission``.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hybridspec.config import EngineConfig
from hybridspec.engine.choices import check_choices, choice_seed, fork_ready, group_choices
from hybridspec.engine.detokenizer import IncrementalDetokenizer
from hybridspec.engine.finish import Finisher
from hybridspec.engine.prefix_cache import PrefixCache
from hybridspec.engine.prompts import check_prompt
from hybridspec.engine.proposer_pool import ProposerPool
from hybridspec.engine.request import (
    FinishReason,
    GenerationParams,
    Request,
    RequestOutput,
    new_generator,
)
from hybridspec.engine.scheduler import Scheduler
from hybridspec.errors import check
from hybridspec.model import ModelRuntime
from hybridspec.types import Session
from hybridspec.verifier import check_logit_bias
from hybridspec.verifier.grammar import Grammars
from hybridspec.verifier.uniforms import key_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class Admission:
    """Requests' entry and admission (module docstring); its collaborators are passed in."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: PreTrainedTokenizerBase,
        runtime: ModelRuntime,
        eos_token_ids: frozenset[int],
        scheduler: Scheduler,
        prefix_cache: PrefixCache,
        proposers: ProposerPool,
        finisher: Finisher,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.runtime = runtime
        self.vocab_size, self.max_seq_len = runtime.vocab_size, runtime.max_seq_len
        self.max_num_seqs = config.target.max_num_seqs
        self.eos_token_ids = eos_token_ids
        self.scheduler = scheduler
        self.prefix_cache = prefix_cache
        self.proposers = proposers
        self.finisher = finisher
        self.seq_ids = itertools.count()  # each request's ``seq_id``
        self._grammars: Grammars | None = None

    def num_free_slots(self) -> int:
        """Slots free for running requests (the prefix cache gives up its entries for them)."""
        return self.max_num_seqs - len(self.scheduler.running)

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
        checked: bool = False,
    ) -> list[list[str]]:
        """Queue ``n`` choices of each prompt (``params``: one for all, or one per prompt),
        all or none; each prompt is prefilled once for its choices, and choice ``i`` samples
        with seed ``seed + i`` (``engine.choices``). Returns the ids, ``[prompt][choice]``.
        ``checked``: the caller ran ``check_choices`` with this engine's bounds where the
        request entered (the server, before tokenizing), so it is not run twice."""
        if not checked:
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
        check_prompt(prompt, self.max_seq_len, self.vocab_size)
        check_logit_bias(params.sampling, self.vocab_size)
        check(
            all(t < self.vocab_size for t in params.stop_token_ids),
            "stop_token_ids",
            f"expected token ids below the vocabulary size {self.vocab_size}",
        )
        resolved = params.resolved or self.proposers.catalog.resolve(
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
            seq_id=next(self.seq_ids),
            prompt_token_ids=prompt,
            params=params,
            resolved=resolved,
            generator=new_generator(seed),
            uniform_key=key_of(seed),
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt, params.stop),
            constraint=None if params.grammar is None else self.grammars().state(params.grammar),
        )

    def seat(self, admitted: list[Request]) -> tuple[list[RequestOutput], list[int]]:
        """Give each of ``admitted`` (just moved into the running batch by ``Scheduler.admit``)
        its slot, with the prefix cache's help, and start its proposer; then fork the choices
        whose source has prefilled their prompt (``choices.fork_ready``). Returns the outputs
        of those whose proposer failed to start (they end with an error), and each running
        request's cached length (``Scheduler.schedule`` plans by them)."""
        outputs: list[RequestOutput] = []
        for request in admitted:
            layers = request.proposer.feature_layers
            allocation = self.prefix_cache.allocate(
                self._cache_lookup(request), layers, request.params.cache_scope
            )
            request.slot, request.stats.cached_tokens = allocation.slot, allocation.num_cached
            if allocation.features is not None:  # the cached positions' rows, as if prefilled
                request.features.pending.append(allocation.features)
            elif layers and allocation.num_cached > 0:  # an entry that kept none: rows from
                request.features.skip(allocation.num_cached)  # the first uncached position
            elif layers and request.params.cache_prompt and self.prefix_cache.num_slots:
                request.features.kept = []
            request.start_time = time.perf_counter()
            try:
                params = request.params  # the proposer learns whose text it is (``Session``)
                session = Session(params.session, params.cache_prompt, params.cache_scope)
                request.proposer.start(request.seq_id, request.prompt_token_ids, session)
            except Exception as exc:  # a proposer's failure harms its own request only
                logger.exception("proposer %r failed to start", request.proposer_name)
                outputs.append(
                    self.finisher.finish(request, FinishReason.ERROR, f"proposer: {exc}")
                )
        running = self.scheduler.running
        fork_ready(running, self.runtime)  # choices share their prompt's prefill
        return outputs, [self.runtime.seq_len(r.slot) for r in running]  # type: ignore[arg-type]

    def _cache_lookup(self, request: Request) -> list[int] | None:
        """The prompt to look up in the prefix cache, or None where the request must prefill
        it all: it asked not to, it scores its prompt (the skipped rows would be missing), or
        it is a choice waiting for its group's source's prefill. (A proposer reading the
        target's features gets the cached positions' rows with the match where the entry kept
        them, ``prefix_cache``.)"""
        grouped = request.group is not None and request.group.source is not request
        if not request.params.cache_prompt or request.params.prompt_logprobs is not None or grouped:
            return None
        return request.prompt_token_ids
