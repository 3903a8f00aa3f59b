"""EngineLoop: a request's outputs reach its asyncio caller, every step's or (``final_only``)
only the first and the final one, with the same result."""

from __future__ import annotations

import asyncio

from hybridspec import Engine
from hybridspec.engine import EngineLoop, GenerationParams, RequestOutput

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
