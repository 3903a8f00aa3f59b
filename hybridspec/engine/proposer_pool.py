"""The engine's proposers: one instance per registered name, built once and shared by every
request that names it and by every proposer that composes it (``hybrid``), the ``catalog`` a
request resolves against (``engine.resolution``), starting a request's proposer with its
session, and the round's proposing step for all of them.

A proposal enters the engine here, and is validated here once (``verifier.check_proposal``);
a proposer that fails (raises, or returns something invalid) fails its own requests only.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from hybridspec.config import DEFAULT_VERIFY_TOKEN_COST, EngineConfig
from hybridspec.engine.proposer_costs import ProposerCosts
from hybridspec.engine.request import Request
from hybridspec.engine.resolution import ProposerCatalog
from hybridspec.errors import HybridSpecError, InvalidRequestError, check
from hybridspec.model import LoadedModel, ModelRuntime, fastest_forward_seconds, load_model
from hybridspec.proposers import (
    DraftModel,
    Proposer,
    ProposerContext,
    ProposerFactory,
    ProposerRegistry,
)
from hybridspec.proposers.draft_vocab import gguf_vocabulary_problem
from hybridspec.types import EMPTY_PROPOSAL, Proposal, ProposeRequest, TokenConstraint
from hybridspec.verifier import check_proposal

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Proposed:
    """A round's proposals: one per request that still decodes, and those whose proposer failed."""

    drafts: list[tuple[Request, Proposal]]
    failed: list[tuple[Request, str]]  # (request, error message)


def proposer_context(
    config: EngineConfig,
    target: LoadedModel,
    runtime: ModelRuntime,
    draft: LoadedModel | None,
    target_forward_s: Callable[[], float],
) -> ProposerContext:
    """What the proposers may use: the target's facts, their sections of ``config``, the draft
    model.

    The draft model is ``draft`` or, when that is None, ``config.draft.model`` loaded here (a
    failure leaves ``draft`` None and says why in ``draft_error``); one runtime over it, sized
    like the target's cache, is shared by every proposer that drafts with it.
    """
    draft_error = None
    if draft is None and config.draft.model is not None:
        draft_error = gguf_vocabulary_problem(
            config.target.name_or_path, config.draft.model.name_or_path
        )
        if draft_error is not None:  # told before the draft's weights are read
            logger.warning("%s", draft_error)
    if draft is None and config.draft.model is not None and draft_error is None:
        try:
            draft = load_model(config.draft.model)
        except HybridSpecError as exc:
            draft_error = f"it failed to load: {exc}"
            logger.warning("draft model failed to load: %s", exc)
    sizes, shared = config.target, None
    if draft is not None:
        shared = DraftModel(draft, draft.create_runtime(sizes.max_num_seqs, sizes.max_seq_len))
    # None: measured at start-up for adaptive speculation only; ``hybrid`` takes the default
    verify_cost = config.verify_token_cost
    return ProposerContext(
        vocab_size=runtime.vocab_size,
        eos_token_ids=tuple(sorted(set(target.eos_token_ids))),
        device=runtime.device,
        tokenizer=target.tokenizer,
        max_num_seqs=sizes.max_num_seqs,
        ngram=config.ngram,
        suffix=config.suffix,
        eagle=config.eagle,
        draft=config.draft,
        verify_token_cost=DEFAULT_VERIFY_TOKEN_COST if verify_cost is None else verify_cost,
        draft_model=shared,
        target=target,
        draft_error=draft_error,
        target_forward_s=target_forward_s,
    )


class ForwardTimer:
    """Seconds of a one-token forward of ``runtime``: timed in place on the first call (the
    fastest of several, as proposers time their own, ``DraftModelProposer``), then kept; 0 where
    no slot is free."""

    def __init__(self, runtime: ModelRuntime) -> None:
        self._runtime = runtime
        self._seconds: float | None = None

    def __call__(self) -> float:
        if self._seconds is None:
            seconds = fastest_forward_seconds(self._runtime)
            self._seconds = seconds if seconds is not None else 0.0
        return self._seconds


class _Reads(Mapping[str, Proposer]):
    """The proposers built so far, as one factory sees them (``ProposerContext.proposers``),
    remembering the names it looked up: replacing one of them rebuilds that proposer."""

    def __init__(self, proposers: dict[str, Proposer]) -> None:
        self._proposers = proposers
        self.names: set[str] = set()

    def __getitem__(self, name: str) -> Proposer:
        self.names.add(name)  # a name not (yet) built counts too: building it later rebuilds
        return self._proposers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._proposers)

    def __len__(self) -> int:
        return len(self._proposers)


class ProposerPool:
    """Builds every registered proposer, in the order they were registered, and the
    ``catalog`` that requests resolve their proposer against (``config``'s defaults); starts a
    request's proposer with its session."""

    def __init__(
        self,
        registry: ProposerRegistry,
        config: EngineConfig,
        target: LoadedModel,
        runtime: ModelRuntime,
        draft: LoadedModel | None = None,
    ) -> None:
        self._registry = registry
        self.target_forward_s = ForwardTimer(runtime)
        self._context = proposer_context(config, target, runtime, draft, self.target_forward_s)
        self._defaults = (config.default_proposer, config.default_num_speculative_tokens)
        self._proposers: dict[str, Proposer] = {}
        self._unavailable: dict[str, str] = {}
        self._reads: dict[str, frozenset[str]] = {}  # name -> the names its factory looked up
        self.costs = ProposerCosts()  # each proposer's drafting time, timed in ``propose``
        for name in registry:
            self._build(name)
        self.catalog = self._catalog()

    def _build(self, name: str) -> None:
        reads = _Reads(dict(self._proposers))
        context = dataclasses.replace(
            self._context, proposers=reads, unavailable=MappingProxyType(dict(self._unavailable))
        )
        try:
            self._proposers[name] = self._registry.factory(name)(context)
            self._unavailable.pop(name, None)
        except HybridSpecError as exc:
            # A proposer that cannot be built (``draft`` with no draft model) stays listed:
            # requests naming it get this reason as their error.
            self._unavailable[name] = str(exc)
            logger.info("proposer %r unavailable: %s", name, exc)
        self._reads[name] = frozenset(reads.names)

    def register(self, name: str, factory: ProposerFactory, *, replace: bool = False) -> None:
        """Register ``factory`` under ``name`` and build it, and again each proposer that
        composes the one it replaces; raise if it cannot be built."""
        self._registry.register(name, factory, replace=replace)
        self._rebuild(name, set())
        self.catalog = self._catalog()  # compositions of the replaced instance are rebuilt
        if name in self._unavailable:
            raise InvalidRequestError(
                f"proposer: {name!r} could not be built: {self._unavailable[name]}", "proposer"
            )

    def _rebuild(self, name: str, done: set[str]) -> None:
        """Build ``name`` again (closing the instance it replaces), then each proposer whose
        factory looked ``name`` up (``hybrid`` when ``eagle`` is replaced)."""
        done.add(name)
        old = self._proposers.pop(name, None)
        if old is not None:
            old.close()
            self.costs.forget(old)
        self._build(name)
        for other in [n for n, read in self._reads.items() if name in read and n not in done]:
            self._rebuild(other, done)

    def available(self) -> list[str]:
        """The built proposers, and each composition ``a+b`` of one that composes with one
        that does not (``grammar+ngram``)."""
        return list(self.catalog.names())

    def unavailable(self) -> dict[str, str]:
        """Registered proposers that could not be built, with the reason."""
        return dict(self._unavailable)

    def _catalog(self) -> ProposerCatalog:
        """The built proposers and their compositions (``Proposer.compose``: ``a`` drafts, then
        ``b`` continues in the same round), built here once and shared by every request: any
        proposer that composes may come first, any that does not after it."""
        proposers = dict(sorted(self._proposers.items()))
        heads = [n for n, p in proposers.items() if type(p).compose is not Proposer.compose]
        bases = [n for n in proposers if n not in heads]  # by name, whatever the build order
        for head in heads:
            for name in bases:
                composed = proposers[head].compose(proposers[name])
                if composed is not None:
                    proposers[f"{head}+{name}"] = composed
        return ProposerCatalog(proposers, dict(self._unavailable), *self._defaults)

    def propose(
        self,
        decode: Sequence[Request],
        num_drafts: Callable[[Request, Proposer], int],
        shadow: Callable[[Request], bool],
    ) -> Proposed:
        """Ask each proposer, once, for the drafts of all its requests in ``decode``.

        ``num_drafts(request, proposer)`` is how many drafts the request asks for this round;
        a request that asks for none but ``shadow(request)`` asks for one that is not verified
        (``engine.speculation``, "Shadow probes"): its proposal decodes plainly, and the draft
        waits in ``request.speculation.shadow`` for the round's token. A proposer none of whose
        requests asks for a draft is not called (its requests decode plainly). Each call that
        asked for drafts is timed into ``costs``. A proposer that ``never_drafts`` is neither
        priced nor called.
        """
        groups: dict[int, list[Request]] = {}  # by the proposer's identity
        for request in decode:
            groups.setdefault(id(request.proposer), []).append(request)
            request.speculation.shadow = None
        proposals: dict[int, Proposal] = {}
        failed: list[tuple[Request, str]] = []
        eos = frozenset(self._context.eos_token_ids)
        for requests in groups.values():
            proposer, name = requests[0].proposer, requests[0].proposer_name
            if proposer.never_drafts:
                continue
            counts = [num_drafts(r, proposer) for r in requests]
            shadows = [k == 0 and shadow(r) for r, k in zip(requests, counts, strict=True)]
            asks = [
                ProposeRequest(
                    r.seq_id,
                    r.token_ids,
                    1 if shadowed else k,
                    r.params.sampling,
                    r.generator,
                    len(r.prompt_token_ids),
                    r.stop_ids(eos),
                    r.constraint,
                    uniform_key=r.uniform_key,
                )
                for r, k, shadowed in zip(requests, counts, shadows, strict=True)
            ]
            if not any(ask.max_num_drafts for ask in asks):  # (``Proposer``: the call skipped)
                continue
            try:
                start = time.perf_counter()
                got = proposer.propose(asks)
                seconds = time.perf_counter() - start
                check(
                    len(got) == len(asks),
                    "proposer",
                    f"{name!r} returned {len(got)} proposals for {len(asks)} requests",
                )
                for r, ask, proposal, shadowed in zip(requests, asks, got, shadows, strict=True):
                    self._check(proposer, proposal, ask.max_num_drafts)
                    proposal = _allowed(proposal, ask.constraint)
                    if shadowed:  # checked against the round's token, never verified
                        r.speculation.shadow = (
                            proposal.token_ids[0] if proposal.num_drafts else None
                        )
                    else:
                        proposals[ask.seq_id] = proposal
                self._time(proposer, requests, asks, got, seconds)
            except Exception as exc:
                logger.exception("proposer %r failed", name)
                failed += [(request, f"proposer: {exc}") for request in requests]
        failed_ids = {request.seq_id for request, _ in failed}
        drafts = [
            (r, proposals.get(r.seq_id, EMPTY_PROPOSAL))
            for r in decode
            if r.seq_id not in failed_ids
        ]
        return Proposed(drafts, failed)

    def _time(
        self,
        proposer: Proposer,
        requests: list[Request],
        asks: list[ProposeRequest],
        got: list[Proposal],
        seconds: float,
    ) -> None:
        """Time a call into ``costs``, unless a request in it asks for drafts in one of its first
        two rounds: the draft model and the eagle head then catch up on the whole prompt, a
        prefill once per request rather than a round's price."""
        asking = [r for r, ask in zip(requests, asks, strict=True) if ask.max_num_drafts > 0]
        if any(r.stats.target_forwards < 2 for r in asking):
            return
        drafted = sum(proposal.num_drafts for proposal in got)
        self.costs.observe(proposer, len(asking), drafted, seconds)

    def _check(self, proposer: Proposer, proposal: Proposal, max_num_drafts: int) -> None:
        check_proposal(proposal, max_num_drafts, self._context.vocab_size)
        check(
            proposer.samples_drafts or not proposal.is_sampled,
            "proposer",
            "returned sampled drafts (probs) but declares samples_drafts = False",
        )

    def close(self) -> None:
        for proposer in self._proposers.values():
            proposer.close()
        self._proposers.clear()


def _allowed(proposal: Proposal, constraint: TokenConstraint | None) -> Proposal:
    """``proposal`` cut before its first draft that the request's grammar forbids: the
    verifier's masks at later positions would follow text the grammar cannot produce."""
    if constraint is None or not proposal.num_drafts:
        return proposal
    n = constraint.num_allowed(proposal.token_ids)
    if n == proposal.num_drafts:
        return proposal
    probs = None if proposal.probs is None else proposal.probs[:n]
    return Proposal(proposal.token_ids[:n], probs if n else None, proposal.drafted_by)
