"""A request's grammar compiled on worker threads, bounded in time, before it is queued.

The engine thread steps every running request, so it never compiles: ``GrammarPool.compile``
runs ``verifier.grammar.Grammars.compile`` (which first refuses a source beyond
``verifier.grammar_bounds``) on a small pool of worker threads and hands the compiled grammar
to the engine inside the ``GrammarSpec``; the engine thread then only builds a matcher. A
request whose grammar is compiling holds no slot and delays no other request's round.

``GrammarPool.warm`` builds the compiler and compiles one grammar at start-up (the lifespan
awaits it): importing xgrammar and reading the tokenizer's vocabulary hold the interpreter
lock for a fraction of a second, which would otherwise pause every stream when the first
structured request arrives.

A compile that passes ``timeout_s`` cannot be interrupted (xgrammar's C++ runs to its end): the
request gets a 400 ``invalid_grammar`` naming its field at the deadline, and the compile goes
on in the background. Compiles in flight, strays included, are at most ``max_in_flight``;
beyond that a request gets a 503 (``CapacityError``, with Retry-After) at once, so strays
cannot pile up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from hybridspec.errors import CapacityError, GrammarError, InvalidRequestError
from hybridspec.types import GrammarSpec
from hybridspec.verifier.grammar import Grammars

COMPILE_THREADS = 2
MAX_IN_FLIGHT = 4
DEFAULT_TIMEOUT_S = 5.0


class GrammarPool:
    """Compiles grammars off the engine thread; ``grammars`` builds the engine's compiler
    (``Engine.grammars``, on first use, on a worker thread)."""

    def __init__(
        self,
        grammars: Callable[[], Grammars],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self._grammars = grammars
        self._build_lock = threading.Lock()  # Engine.grammars builds the compiler once
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self._in_flight = 0  # changed on the event loop only
        self._executor = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    def _compile(self, spec: GrammarSpec, param: str) -> GrammarSpec:
        with self._build_lock:
            grammars = self._grammars()
        return dataclasses.replace(spec, compiled=grammars.compile(spec, param))

    async def warm(self) -> bool:
        """Build the compiler and compile ``json_object`` once, on a worker thread; False (and
        nothing built) where the model has no tokenizer, so no grammar can be served."""
        spec = GrammarSpec("json_object")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self._compile, spec, "response_format")
        except InvalidRequestError:
            return False
        return True

    async def compile(self, spec: GrammarSpec | None, param: str) -> GrammarSpec | None:
        """``spec`` with its compiled grammar (None stays None); GrammarError naming ``param``
        when it is beyond the bounds, invalid or not compiled within ``timeout_s``."""
        if spec is None:
            return None
        if self._in_flight >= self.max_in_flight:
            raise CapacityError(
                f"{self._in_flight} grammars are compiling, this server's limit; retry later"
            )
        self._in_flight += 1
        future = asyncio.get_running_loop().run_in_executor(
            self._executor, self._compile, spec, param
        )
        future.add_done_callback(self._done)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            raise GrammarError(
                f"{param}: the grammar did not compile within {self.timeout_s:g} s; "
                "make it smaller (fewer properties, alternatives or levels)",
                param,
            ) from None

    def _done(self, future: asyncio.Future[GrammarSpec]) -> None:
        self._in_flight -= 1
        if not future.cancelled():
            future.exception()  # a stray's error is retrieved, not logged as never retrieved

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
