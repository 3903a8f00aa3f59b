"""EngineLoop: a request's outputs reach its asyncio caller, every step's or (``final_only``)
only the first and the final one, with the same result; a twin runs ``none``'s requests, the
two engines by turns (``EngineTurns``, on given seconds, not timed), and a hold keeps both from
stepping until its requests are in."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from hybridspec import Engine
from hybridspec.engine import EngineLoop, GenerationParams, RequestOutput
from hybridspec.engine.loop import EngineTurns
from hybridspec.model.loader import LoadedModel
from tests.engine.tiny import make_engine

PROMPT = [5, 9, 12, 7, 5, 9, 12, 7, 5, 9]


def collect(engine: Engine, n: int, final_only: bool) -> list[tuple[int, RequestOutput]]:
    """Every (choice index, output) the loop hands over for ``n`` greedy choices of PROMPT."""
    params = GenerationParams.create(max_new_tokens=12, ignore_eos=True, proposer="none")

    async def run() -> list[tuple[int, RequestOutput]]:
        loop = EngineLoop(engine)
        try:
            stream = loop.stream_choices([PROMPT], [params], n, final_only=final_only)
            return [item async for item in stream]
        finally:
            loop.close()

    return asyncio.run(run())


def test_final_only_hands_over_the_first_and_final_outputs_of_each_choice(engine: Engine) -> None:
    every = collect(engine, 2, final_only=False)
    ends = collect(engine, 2, final_only=True)
    for index in (0, 1):
        all_outputs = [o for i, o in every if i == index]
        two = [o for i, o in ends if i == index]
        assert len(all_outputs) > 2  # one per round: 12 tokens without drafts
        assert [o.finished for o in two] == [False, True]
        assert two[0].new_token_ids == all_outputs[0].new_token_ids
        final, expected = two[1].result, all_outputs[-1].result
        assert final is not None and expected is not None
        assert final.token_ids == expected.token_ids
        assert final.text == expected.text
        assert sum(len(o.new_token_ids) for o in all_outputs) == len(final.token_ids)


def test_turns_go_to_the_engine_with_the_fewest_seconds_since_all_were_idle() -> None:
    """The module docstring's example: steps of 10 and 20 ms, both engines busy."""
    turns = EngineTurns(2)
    order = []
    for _ in range(8):
        index = turns.next([True, True])
        assert index is not None
        order.append(index)
        turns.ran(index, (0.010, 0.020)[index])
    assert order == [0, 1, 0, 0, 1, 0, 0, 1]


def test_turns_skip_an_idle_engine_and_start_again_once_all_are_idle() -> None:
    turns = EngineTurns(2)
    turns.ran(0, 5.0)  # engine 0 ran alone while 1 had nothing
    assert turns.next([True, False]) == 0
    assert turns.next([True, True]) == 1  # 1 is owed the seconds 0 ran beside it
    assert turns.next([False, False]) is None
    assert turns.seconds == [0.0, 0.0]
    assert turns.next([True, True]) == 0  # a tie goes to the first


def test_a_twin_runs_the_requests_for_none_and_steps_by_turns(
    engine: Engine, target: LoadedModel
) -> None:
    """With a twin, ``none``'s request runs there and ``ngram``'s on the engine, at once: each
    engine's seconds of steps grow, each text is the one a loop without a twin gives, and
    a twin's request that is closed early is aborted there."""
    none = GenerationParams.create(max_new_tokens=12, ignore_eos=True, proposer="none")
    ngram = GenerationParams.create(max_new_tokens=12, ignore_eos=True, proposer="ngram")
    long_none = GenerationParams.create(max_new_tokens=200, ignore_eos=True, proposer="none")
    twins: list[Engine] = []

    def twin(first: Engine) -> Engine:
        twins.append(make_engine(first.target))
        return twins[-1]

    async def texts(loop: EngineLoop) -> list[tuple[int, ...]]:
        async def run(params: GenerationParams) -> tuple[int, ...]:
            outputs = [o async for o in loop.stream(PROMPT, params)]
            result = outputs[-1].result
            assert result is not None
            return tuple(result.token_ids)

        return list(await asyncio.gather(run(none), run(ngram)))

    async def run() -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], list[float]]:
        alone = EngineLoop(engine)
        try:
            expected = await texts(alone)
        finally:
            alone.close()
        paired = await EngineLoop.start(lambda: engine, twin=twin)
        try:
            assert paired.engines == (engine, twins[0])
            got = await texts(paired)
            seconds = list(paired.step_seconds)
            stream = paired.stream_choices([PROMPT], [long_none], 1)
            _, first = await anext(stream)
            assert first.new_token_ids
            await stream.aclose()  # type: ignore[attr-defined]
            unfinished = await paired.call(lambda _: twins[0].has_unfinished())
            assert not unfinished
        finally:
            paired.close()
        return expected, got, seconds

    expected, got, seconds = asyncio.run(run())
    assert got == expected
    assert all(s > 0 for s in seconds)


def first_steps_under_hold(
    engine: Engine, num_requests: int, timeout_s: float
) -> tuple[list[int], list[tuple[int, ...]]]:
    """A loop with a twin (of ``engine``'s weights), held for ``num_requests`` requests, then
    sent an ``ngram`` request and a ``none`` one in turn: the requests both engines held at
    each step's start, and the two texts."""
    held: list[int] = []

    def twin(first: Engine) -> Engine:
        return make_engine(first.target)

    async def run() -> list[tuple[int, ...]]:
        loop = await EngineLoop.start(lambda: engine, twin=twin)
        for e in loop.engines:
            step = e.step

            def counted(step: Callable[[], list[RequestOutput]] = step) -> list[RequestOutput]:
                held.append(sum(x.num_running + x.num_waiting for x in loop.engines))
                return step()

            e.step = counted  # type: ignore[method-assign]
        try:
            loop.hold(num_requests, timeout_s)
            streams = []
            for proposer in ("ngram", "none"):
                params = GenerationParams.create(
                    max_new_tokens=6, ignore_eos=True, proposer=proposer
                )
                _, outputs = await loop.submit(PROMPT, params)  # accepted: added to its engine
                streams.append(outputs)
                await asyncio.sleep(0.05)  # time for a loop that does not hold to step
            texts = []
            for outputs in streams:
                while not (output := await outputs.get()).finished:
                    pass
                assert output.result is not None
                texts.append(tuple(output.result.token_ids))
            return texts
        finally:
            loop.close()

    texts = asyncio.run(run())
    return held, texts


def test_a_hold_steps_no_engine_until_its_requests_are_in(engine: Engine) -> None:
    """The ``ngram`` request is added first, and no step runs until ``none``'s is in too: both
    engines start from a full queue (module docstring). The hold ends there: the steps that
    follow run as they would."""
    held, texts = first_steps_under_hold(engine, 2, timeout_s=60.0)
    assert held[0] == 2
    assert texts[0] == texts[1]  # greedy: the same text from each engine


def test_a_hold_ends_at_its_deadline_with_a_warning(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Held for 3 requests, 2 come: the steps start once the deadline passes, and say so."""
    with caplog.at_level(logging.WARNING, logger="hybridspec.engine.loop"):
        held, texts = first_steps_under_hold(engine, 3, timeout_s=0.3)
    assert held[0] == 2 and texts[0] == texts[1]
    assert "held the steps for 3 requests, 2 came" in caplog.text
