"""``GrammarPool``: grammars compile off the event loop with a deadline and a bounded number in
flight; ``Grammars``' cache stays within its bytes."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

from hybridspec.errors import CapacityError, GrammarError, InvalidRequestError
from hybridspec.model.loader import LoadedModel
from hybridspec.server.grammars import GrammarPool
from hybridspec.types import GrammarSpec
from hybridspec.verifier.grammar import Grammars


class SlowGrammars:
    """Compiles in ``seconds`` (until ``release`` is set), as a huge schema would."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.release = threading.Event()
        self.calls = 0

    def compile(self, spec: GrammarSpec, param: str) -> Any:
        self.calls += 1
        self.release.wait(self.seconds)
        return f"compiled {spec.source}"


def test_a_compile_past_its_deadline_is_a_400_naming_the_field() -> None:
    slow = SlowGrammars(30)
    pool = GrammarPool(lambda: slow, timeout_s=0.2)  # type: ignore[arg-type,return-value]

    async def run() -> None:
        start = time.monotonic()
        with pytest.raises(GrammarError) as caught:
            await pool.compile(GrammarSpec("regex", "a+"), "guided_regex")
        assert caught.value.param == "guided_regex" and time.monotonic() - start < 5
        assert pool._in_flight == 1  # the stray still counts
        slow.release.set()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if pool._in_flight == 0:
                break
        assert pool._in_flight == 0

    asyncio.run(run())
    pool.close()


def test_strays_cannot_pile_up() -> None:
    slow = SlowGrammars(30)
    pool = GrammarPool(lambda: slow, timeout_s=0.1, max_in_flight=2)  # type: ignore[arg-type,return-value]

    async def run() -> None:
        for source in ("a", "b"):
            with pytest.raises(GrammarError):
                await pool.compile(GrammarSpec("regex", source), "guided_regex")
        with pytest.raises(CapacityError):  # a 503 at once, no third compile
            await pool.compile(GrammarSpec("regex", "c"), "guided_regex")
        assert slow.calls == 2
        slow.release.set()

    asyncio.run(run())
    pool.close()


def test_a_compiled_spec_carries_its_grammar_and_keeps_its_identity() -> None:
    slow = SlowGrammars(0)
    pool = GrammarPool(lambda: slow)  # type: ignore[arg-type,return-value]
    spec = GrammarSpec("regex", "a+")
    compiled = asyncio.run(pool.compile(spec, "guided_regex"))
    assert compiled == spec and compiled is not None and compiled.compiled == "compiled a+"
    assert asyncio.run(pool.compile(None, "response_format")) is None
    pool.close()


def test_warm_builds_the_compiler_and_compiles_once_off_the_event_loop() -> None:
    """The lifespan's warm-up: one json_object compile on a worker thread; a model without a
    tokenizer (the engine's ``grammars`` refuses) is left unwarmed, not an error."""
    slow = SlowGrammars(0)
    threads: list[str] = []

    def build() -> SlowGrammars:
        threads.append(threading.current_thread().name)
        return slow

    pool = GrammarPool(build)  # type: ignore[arg-type,return-value]
    assert asyncio.run(pool.warm()) is True
    assert slow.calls == 1 and threads[0].startswith("grammar")
    pool.close()

    def no_tokenizer() -> SlowGrammars:
        raise InvalidRequestError("structured output needs the model's tokenizer", "grammar")

    unwarmed = GrammarPool(no_tokenizer)  # type: ignore[arg-type,return-value]
    assert asyncio.run(unwarmed.warm()) is False
    unwarmed.close()


def test_the_cache_stays_within_its_bytes(tiny_model: LoadedModel) -> None:
    vocab = tiny_model.weights.dims.vocab_size
    grammars = Grammars(tiny_model.tokenizer, vocab, [vocab - 1], cache_bytes=256 * 1024)
    sizes = []
    for i in range(40):
        names = {f"k{i}_{j}": {"type": "string"} for j in range(30)}
        schema = json.dumps({"type": "object", "properties": names})
        compiled = grammars.compile(GrammarSpec("json_schema", schema), "response_format")
        sizes.append(compiled.memory_size_bytes)
    assert 256 * 1024 - max(sizes) < grammars.cache_bytes <= 256 * 1024 < sum(sizes)
    first = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"x": {}}}))
    assert grammars.compile(first) is grammars.compile(first)  # a hit: the same grammar
