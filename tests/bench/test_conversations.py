"""``bench conversations``: its summary's ratios and its command line."""

from __future__ import annotations

import argparse
import math

from hybridspec.bench.conversations import ConversationFigures, add_conversations_command


def test_the_summary_gives_same_run_median_ratios() -> None:
    figures = ConversationFigures(
        ttft_cached=[0.1, 0.3, 0.2],
        ttft_cold=[1.0, 2.0, 3.0],
        cached_tokens=[90, 180],
        prompt_tokens=[100, 200],
        repeat_tps={"none": [10.0, 12.0], "suffix": [40.0, 48.0]},
    )
    summary = figures.summary()
    assert math.isclose(summary["multi_turn_ttft_ratio"], 0.2 / 2.0)
    assert math.isclose(summary["multi_turn_cached_share"], 270 / 300)
    assert math.isclose(summary["repeat_suffix_over_none"], 44.0 / 11.0)
    assert math.isnan(summary["first_time_suffix_over_none"])  # not measured


def test_the_command_parses_its_options() -> None:
    parser = argparse.ArgumentParser()
    add_conversations_command(parser.add_subparsers())
    args = parser.parse_args(["conversations", "--turns", "7", "--prompts", "2"])
    assert (args.turns, args.prompts, args.threads) == (7, 2, 1)
