"""Runs an Engine on its own thread for asyncio callers (the HTTP server).

The engine thread alone touches the engine, from its construction on when the loop is given a
function that builds it (``EngineLoop.start``). The forward's threads (torch's OpenMP threads
and the kernel library's own, csrc/pool.c) belong to the thread that makes the parallel calls:
each keeps one team of workers per such thread, and once more threads are in GNU OpenMP's teams
than there are cores (an engine loaded and warmed up on the main thread, then stepped on this
one: two teams on two cores) every OpenMP worker sleeps at once between regions instead of
spinning, so each region waits for a futex wake. Building, warming and stepping on one thread
keeps one team of each.

Callers talk to it through an inbox of commands (add, abort) drained between steps, and
receive each request's outputs on an asyncio queue of their own. Adding a request waits for the
engine thread to accept or refuse it, so validation and capacity errors reach the caller before
any output. A caller that wants only a request's end (a response that is not streamed) asks
for ``final_only``: it gets the first output (its time to first token) and the final one (the
whole result), not one per step, so that its event loop is not woken, and does not take the
GIL and a core from the forward, on every round.

A benchmark's pair (``serve --bench-twin``: a method's requests on the engine, ``none``'s on the
twin, sent at once) starts from a hold (``EngineLoop.hold``): no engine steps until the engines
hold every request of both loops. Without it the first request to arrive is stepped alone, its
prefill a turn of its own while the others arrive, and the engine whose requests came first
then prefills the rest a chunk at a time beside its decoding rows, while the other, whose
requests all arrived during that turn, takes them in one batch: the two engines would start
unlike, always the same one first, and the pair would compare their starts as well as their
methods.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from hybridspec.engine.engine import Engine
from hybridspec.engine.request import GenerationParams, RequestOutput
from hybridspec.errors import HybridSpecError

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
NO_DRAFTS = "none"  # the proposer whose requests a twin runs (module docstring)


@dataclass(frozen=True, slots=True)
class _Add:
    prompts: Sequence[Sequence[int]]
    params: Sequence[GenerationParams]  # one per prompt
    n: int  # choices per prompt (``Engine.add_choices``)
    checked: bool  # ``n`` and the prompts' count checked where they entered (``add_choices``)
    accepted: asyncio.Future[list[list[str]]]
    outputs: asyncio.Queue[RequestOutput]  # every choice's outputs
    loop: asyncio.AbstractEventLoop
    final_only: bool  # each choice's first and final outputs only (module docstring)


@dataclass(slots=True)
class _Route:
    """Where one request's outputs go, and whether the caller wants only its first and final."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput]
    final_only: bool
    engine: int  # which engine runs it: 0, or 1 for the twin (module docstring)
    delivered: bool = False  # an output was handed over


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Hold:
    num_requests: int
    timeout_s: float


@dataclass(frozen=True, slots=True)
class _Call:
    fn: Callable[[Engine], Any]
    done: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class EngineTurns:
    """Which of the loop's engines steps next: of those with work, the one with the fewest
    seconds of steps since every engine was last idle, the first on a tie (module docstring).
    Example, two engines whose steps take 10 and 20 ms, both busy: 0, 1, 0, 0, 1, 0, 0, 1, ...
    """

    def __init__(self, num_engines: int) -> None:
        self.seconds = [0.0] * num_engines  # since every engine was last idle

    def next(self, busy: Sequence[bool]) -> int | None:
        """The engine to step (None: none has work, and the count starts again)."""
        waiting = [i for i, b in enumerate(busy) if b]
        if not waiting:
            self.seconds = [0.0] * len(self.seconds)
            return None
        return min(waiting, key=lambda i: self.seconds[i])

    def ran(self, index: int, seconds: float) -> None:
        self.seconds[index] += seconds


class EngineLoop:
    """Owns an Engine, its twin if any, and the thread that steps them.

    ``engine``: the engine, or a function that builds it, which then runs on the engine thread
    (module doc); ``EngineLoop.start`` waits for it to return. ``twin``: a function that builds
    the twin from the engine (module doc), on the engine thread too.
    """

    def __init__(
        self,
        engine: Engine | Callable[[], Engine],
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        twin: Callable[[Engine], Engine] | None = None,
    ):
        self._built: Future[Engine] = Future()
        if isinstance(engine, Engine) and twin is None:
            self._built.set_result(engine)
            build = None
        else:
            build = engine
        self._twin: Engine | None = None
        self._on_step = on_step
        self._inbox: queue.Queue[_Add | _Abort | _Hold | _Call | None] = queue.Queue()
        self._routes: dict[str, _Route] = {}
        num_engines = 1 if twin is None else 2
        self._turns = EngineTurns(num_engines)
        self._hold: tuple[int, float] | None = None  # (requests, deadline): ``hold``
        # Each engine's seconds inside ``Engine.step`` since the loop began; read by other
        # threads (a float's read or write is atomic under the GIL).
        self.step_seconds = [0.0] * num_engines
        self._thread = threading.Thread(
            target=self._run, args=(build, twin), name="hybridspec-engine", daemon=True
        )
        self._stopped = False
        self._thread.start()

    @classmethod
    async def start(
        cls,
        build: Callable[[], Engine],
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        twin: Callable[[Engine], Engine] | None = None,
    ) -> EngineLoop:
        """A loop whose engine ``build()`` made on the engine thread, and its twin ``twin(engine)``
        where given; raises what they raised."""
        engine_loop = cls(build, on_step, twin)
        try:
            await asyncio.wrap_future(engine_loop._built)
        except BaseException:
            engine_loop.close()
            raise
        return engine_loop

    @property
    def engine(self) -> Engine:
        """The engine (built: ``start`` has returned)."""
        return self._built.result(timeout=0)

    @property
    def engines(self) -> tuple[Engine, ...]:
        """The engine, then its twin where there is one (built: ``start`` has returned)."""
        engine = self.engine
        return (engine,) if self._twin is None else (engine, self._twin)

    async def submit(
        self, prompt_token_ids: Sequence[int], params: GenerationParams
    ) -> tuple[str, asyncio.Queue[RequestOutput]]:
        """Queue a request; raises its validation or capacity error, else gives its outputs."""
        ids, outputs = await self.submit_choices([prompt_token_ids], [params], 1)
        return ids[0][0], outputs

    async def submit_choices(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[GenerationParams],
        n: int,
        checked: bool = False,
        final_only: bool = False,
    ) -> tuple[list[list[str]], asyncio.Queue[RequestOutput]]:
        """Queue ``n`` choices of each prompt, all or none (``Engine.add_choices``, which
        ``checked`` is passed to); raises the refusal, else gives their ids
        ``[prompt][choice]`` and one queue of all outputs (with ``final_only``, each choice's
        first and final ones only)."""
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[list[list[str]]] = loop.create_future()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._inbox.put(_Add(prompts, params, n, checked, accepted, outputs, loop, final_only))
        request_ids = await accepted
        return request_ids, outputs

    async def stream(
        self, prompt_token_ids: Sequence[int], params: GenerationParams
    ) -> AsyncIterator[RequestOutput]:
        """Submit then yield outputs; closing the iterator early aborts the request."""
        async for _, output in self.stream_choices([prompt_token_ids], [params], 1):
            yield output

    async def stream_choices(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[GenerationParams],
        n: int,
        **options: bool,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Submit ``n`` choices of each prompt, then yield ``(index, output)`` as they come,
        ``index = prompt * n + choice``, until every one has finished; closing the iterator
        early aborts those that have not. ``options``: ``submit_choices``'s ``checked`` and
        ``final_only``."""
        request_ids, outputs = await self.submit_choices(prompts, params, n, **options)
        index = {rid: i for i, rid in enumerate(rid for ids in request_ids for rid in ids)}
        running = set(index)
        try:
            while running:
                output = await outputs.get()
                if output.finished:
                    running.discard(output.request_id)
                yield index[output.request_id], output
        finally:
            for request_id in running:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def hold(self, num_requests: int, timeout_s: float) -> None:
        """Step no engine until the engines together hold ``num_requests`` requests, running or
        waiting, or until ``timeout_s`` has passed (module docstring). Commands are handled in
        order, so every request submitted after this call is added before a step."""
        self._inbox.put(_Hold(num_requests, timeout_s))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result (the
        first engine's; ``engines`` gives the twin too, to read there)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        self._inbox.put(_Call(fn, done, loop))
        return await done

    def close(self, timeout: float = 10.0) -> None:
        self._stopped = True
        self._inbox.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------ engine thread

    def _run(
        self, build: Engine | Callable[[], Engine] | None, twin: Callable[[Engine], Engine] | None
    ) -> None:
        if build is not None:
            try:
                engine = build if isinstance(build, Engine) else build()
                if twin is not None:
                    self._twin = twin(engine)
                self._built.set_result(engine)
            except BaseException as exc:
                self._built.set_exception(exc)
                return
        engines = self.engines
        while not self._stopped:
            idle = not any(e.has_unfinished() for e in engines)
            self._drain(block=idle or self._holding(engines))
            if self._holding(engines):
                continue
            index = self._turns.next([e.has_unfinished() for e in engines])
            if self._stopped or index is None:
                continue
            engine = engines[index]
            start = time.perf_counter()
            try:
                outputs = engine.step()
            except Exception:
                # Engine.step contains failures to their requests; this is the last resort.
                logger.exception("engine step failed; failing the running requests")
                outputs = engine.fail_running("engine: the step failed (see the log)")
            seconds = time.perf_counter() - start
            self._turns.ran(index, seconds)
            self.step_seconds[index] += seconds
            self._deliver(outputs)
            if self._on_step is not None:
                self._on_step(outputs)

    def _drain(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
            while True:
                self._handle(command)
                command = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _holding(self, engines: Sequence[Engine]) -> bool:
        """Whether a ``hold`` still stops the steps; it ends once its requests are in, or
        (with a warning) at its deadline."""
        if self._hold is None:
            return False
        num_requests, deadline = self._hold
        held = sum(e.num_running + e.num_waiting for e in engines)
        if held < num_requests and time.perf_counter() < deadline:
            return True
        if held < num_requests:
            logger.warning("held the steps for %d requests, %d came; stepping", num_requests, held)
        self._hold = None
        return False

    def _handle(self, command: _Add | _Abort | _Hold | _Call | None) -> None:
        if isinstance(command, _Add):
            index = self._engine_for(command.params)
            try:
                ids = self.engines[index].add_choices(
                    command.prompts, command.params, command.n, checked=command.checked
                )
            except Exception as exc:
                command.loop.call_soon_threadsafe(_set_exception, command.accepted, exc)
                return
            for request_id in (rid for choices in ids for rid in choices):
                route = _Route(command.loop, command.outputs, command.final_only, index)
                self._routes[request_id] = route
            command.loop.call_soon_threadsafe(self._accept, command.accepted, ids)
        elif isinstance(command, _Abort):
            found = self._routes.get(command.request_id)
            engine = self.engines[0 if found is None else found.engine]
            output = engine.abort(command.request_id)
            if output is not None:
                self._deliver([output])
        elif isinstance(command, _Hold):
            self._hold = (command.num_requests, time.perf_counter() + command.timeout_s)
        elif isinstance(command, _Call):
            try:
                result = command.fn(self.engine)
            except Exception as exc:
                command.loop.call_soon_threadsafe(_set_exception, command.done, exc)
            else:
                command.loop.call_soon_threadsafe(_set_result, command.done, result)

    def _engine_for(self, params: Sequence[GenerationParams]) -> int:
        """1 (the twin) for a request whose proposer is ``NO_DRAFTS``, where there is a twin;
        else 0."""
        if self._twin is None:
            return 0
        default = self.engine.catalog.default_proposer
        names = {p.proposer or default for p in params}
        return 1 if names == {NO_DRAFTS} else 0

    def _accept(self, accepted: asyncio.Future[list[list[str]]], ids: list[list[str]]) -> None:
        """On the caller's loop: hand over the ids, or abort if the caller stopped waiting."""
        if accepted.done():  # cancelled while the engine thread was adding the requests
            for request_id in (rid for choices in ids for rid in choices):
                self.abort(request_id)
        else:
            accepted.set_result(ids)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their callers: one wake-up of each caller's event loop per
        step (``call_soon_threadsafe`` writes to the loop's self-pipe), however many requests
        the step advanced; none for a step whose outputs a ``final_only`` caller skips."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Routed]] = {}
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue
            if output.finished:
                del self._routes[output.request_id]
            elif route.final_only and route.delivered:
                continue
            route.delivered = True
            by_loop.setdefault(route.loop, []).append((route.outputs, output))
        for loop, routed in by_loop.items():
            loop.call_soon_threadsafe(_put_all, routed)


_Routed = tuple[asyncio.Queue[RequestOutput], RequestOutput]


def _put_all(routed: list[_Routed]) -> None:
    for outputs_queue, output in routed:
        outputs_queue.put_nowait(output)


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc if isinstance(exc, HybridSpecError) else HybridSpecError(str(exc)))
