"""The engine's forward threads: ``num_threads="auto"`` builds the controller, which sees the
decode rounds' times over their sizes (not prompt chunks), and switching counts mid-request
keeps greedy texts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hybridspec.engine.engine as engine_module
from hybridspec.engine.row_costs import TimedForwardCost
from hybridspec.model import LoadedModel, set_num_threads
from hybridspec.model.thread_policy import ThreadController, available_cores
from tests.engine.tiny import make_engine

PROMPT = [5, 9, 2, 7, 11, 3]


class Alternating(ThreadController):
    """Switches between 1 and 2 threads at every observed step; counts what it saw."""

    def __init__(self) -> None:
        super().__init__(2, set_num_threads)
        self.observed: list[float] = []

    def observe(self, seconds: float) -> int:
        self.observed.append(seconds)
        self.threads = 1 if self.threads == 2 else 2
        set_num_threads(self.threads)
        return self.threads


def test_auto_threads_build_a_controller_over_the_usable_cores(target: LoadedModel) -> None:
    threads = torch.get_num_threads()
    try:
        engine = make_engine(target, num_threads="auto")
        assert engine.thread_policy is not None
        assert engine.thread_policy.max_threads == available_cores()
        assert make_engine(target, num_threads=1).thread_policy is None
        assert make_engine(target, num_threads=None).thread_policy is None
    finally:
        torch.set_num_threads(threads)


def test_reset_starts_the_controller_again_at_every_usable_core(target: LoadedModel) -> None:
    threads = torch.get_num_threads()
    try:
        engine = make_engine(target, num_threads="auto")
        assert engine.thread_policy is not None
        engine.thread_policy.threads = 1  # as if the warm-up's rounds had chosen one thread
        set_num_threads(1)
        engine.reset()
        assert engine.thread_policy.threads == available_cores()
        assert torch.get_num_threads() == available_cores()
    finally:
        torch.set_num_threads(threads)


class Recording(ThreadController):
    """Records what the engine tells it: the steps' kinds and the decode rounds' times."""

    def __init__(self) -> None:
        super().__init__(2, set_num_threads)
        self.steps: list[bool] = []
        self.observed: list[float] = []
        self.prompts: list[int] = []  # the tokens of each timed prompt step

    def for_step(self, prefill: bool) -> None:
        self.steps.append(prefill)
        super().for_step(prefill)

    def observe(self, seconds: float) -> int:
        self.observed.append(seconds)
        return self.threads

    def observe_prompt(self, seconds: float, tokens: int) -> None:
        self.prompts.append(tokens)
        super().observe_prompt(seconds, tokens)


def test_a_prompt_fed_in_one_step_is_not_timed_as_a_decode_round(target: LoadedModel) -> None:
    """A short prompt is fed in the step that also decodes its first token: that step (many
    times a decode round's time) is a prompt step, observed per token as one
    (``observe_prompt``), never as a decode round, so it cannot make a window of decode rounds
    look slow."""
    threads = torch.get_num_threads()
    try:
        engine = make_engine(target, num_threads=1)
        engine.generate(prompt_token_ids=PROMPT, proposer="none", max_new_tokens=12)  # priced
        engine.thread_policy = recording = Recording()
        out = engine.generate(prompt_token_ids=PROMPT, proposer="none", max_new_tokens=12)
        assert len(out.token_ids) == 12
        assert recording.steps == [True] + [False] * 11
        assert len(recording.observed) == 11  # every round after the prompt's
        assert recording.prompts == [len(PROMPT)]
    finally:
        torch.set_num_threads(threads)


class Clock:
    """``time`` for the engine module: each reading one second after the last."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_a_round_is_timed_over_its_size(target: LoadedModel, monkeypatch: Any) -> None:
    """The controller gets each decode round's time over the cost model's estimate of a round
    of its size (``relative_seconds``), so that rounds of few and of many rows (drafts, a batch
    filling or emptying) compare by what the thread count and the load make of them; a round
    the model cannot price is not observed."""
    threads = torch.get_num_threads()
    sizes: list[int] = []

    def relative(cost: TimedForwardCost, num_rows: int, num_scores: int) -> float | None:
        sizes.append(num_rows)
        return None if len(sizes) <= 2 else 0.25 * num_rows  # the first two: not priced yet

    try:
        engine = make_engine(target, num_threads=1)
        engine.thread_policy = recording = Recording()
        monkeypatch.setattr(TimedForwardCost, "relative_seconds", relative)
        monkeypatch.setattr(engine_module, "time", Clock())  # every round takes 1 s
        prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]  # repeats: ngram drafts, rounds of more rows
        out = engine.generate(prompt_token_ids=prompt, proposer="ngram", max_new_tokens=16)
        assert len(out.token_ids) == 16
        assert len(sizes) > 2
        assert recording.observed == pytest.approx([1.0 / (0.25 * rows) for rows in sizes[2:]])
    finally:
        torch.set_num_threads(threads)


def test_switching_threads_every_round_keeps_greedy_texts(
    target: LoadedModel, draft: LoadedModel
) -> None:
    threads = torch.get_num_threads()
    try:
        fixed = make_engine(target, draft, num_threads=1)
        expected = fixed.generate(prompt_token_ids=PROMPT, proposer="none", max_new_tokens=24)
        engine = make_engine(target, draft, num_threads=1)
        for proposer in ("none", "draft", "ngram"):
            engine.thread_policy = Alternating()
            out = engine.generate(prompt_token_ids=PROMPT, proposer=proposer, max_new_tokens=24)
            assert out.token_ids == expected.token_ids, proposer
            # one time per decode round (each commits a token at least); the prompt's step none
            assert 0 < len(engine.thread_policy.observed) <= len(out.token_ids) - 1
            assert all(seconds > 0 for seconds in engine.thread_policy.observed)
    finally:
        torch.set_num_threads(threads)
