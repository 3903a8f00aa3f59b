"""``hybridspec bench conversations``: multi-turn and repeat workloads on one engine.

Three measurements, each interleaved request by request on one engine so that a shared
machine's load falls on both sides alike:

- **multi-turn**: conversations whose every turn resends the history (earlier messages and
  answers, through the chat template) with the workload's next prompt as the new message. Each
  turn runs twice, with the prefix cache (``cache_prompt`` on) and without (off: it neither
  reads nor leaves anything), and the time to first token of turns 2+ is compared; greedy texts
  and log-probabilities of the two runs must be equal (counted as mismatches otherwise).
- **repeat**: every prompt asked, then asked again; on the second asking ``suffix`` drafts from
  the first one's answer. Tokens per second of the second asking, ``suffix`` over ``none``.
- **first-time**: open-ended prompts that no earlier request wrote, ``suffix`` over ``none``:
  what the proposer costs when it has nothing to match.

Dimensions: ``C`` conversations of ``T`` turns; ``P`` prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridspec.bench.workload import DEFAULT_WORKLOAD, Workload, WorkloadPrompt, load_workload

if TYPE_CHECKING:
    from hybridspec.engine import Engine, GenerationResult


@dataclass(slots=True)
class ConversationFigures:
    """What ``run_conversations`` measured (times in seconds)."""

    ttft_cached: list[float] = field(default_factory=list)  # turns 2+, cache on
    ttft_cold: list[float] = field(default_factory=list)  # the same turns, cache off
    cached_tokens: list[int] = field(default_factory=list)  # turns 2+, cache on
    prompt_tokens: list[int] = field(default_factory=list)  # turns 2+
    mismatches: int = 0  # turns whose text or log-probabilities differ with the cache
    repeat_tps: dict[str, list[float]] = field(default_factory=dict)  # second asking
    first_tps: dict[str, list[float]] = field(default_factory=dict)  # first-time prompts

    def summary(self) -> dict[str, float]:
        def ratio(a: list[float], b: list[float]) -> float:
            return statistics.median(a) / statistics.median(b) if a and b else float("nan")

        return {
            "multi_turn_ttft_p50_cached_s": _median(self.ttft_cached),
            "multi_turn_ttft_p50_cold_s": _median(self.ttft_cold),
            "multi_turn_ttft_ratio": ratio(self.ttft_cached, self.ttft_cold),
            "multi_turn_max_prompt_tokens": float(max(self.prompt_tokens, default=0)),
            "multi_turn_cached_share": sum(self.cached_tokens) / max(1, sum(self.prompt_tokens)),
            "multi_turn_mismatches": float(self.mismatches),
            "repeat_suffix_over_none": ratio(
                self.repeat_tps.get("suffix", []), self.repeat_tps.get("none", [])
            ),
            "first_time_suffix_over_none": ratio(
                self.first_tps.get("suffix", []), self.first_tps.get("none", [])
            ),
        }


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def select_prompts(
    workload: Workload, conversations: int, turns: int, num_prompts: int
) -> tuple[list[list[WorkloadPrompt]], list[WorkloadPrompt], list[WorkloadPrompt]]:
    """The workloads' prompts: ``conversations`` of ``turns`` prompts each, over the
    input-grounded prompts and then the open-ended ones; the first ``num_prompts`` grounded
    prompts (the repeat workload) and open-ended ones (first-time)."""
    grounded = [p for p in workload.prompts if workload.categories[p.category].input_grounded]
    open_ended = [p for p in workload.prompts if p not in grounded]
    ordered = [*grounded, *open_ended]
    starts = range(0, min(len(ordered) - turns + 1, conversations * turns), turns)
    chats = [ordered[start : start + turns] for start in starts]
    return chats, grounded[:num_prompts], open_ended[:num_prompts]


def run_conversations(
    engine: Engine,
    workload: Workload,
    turns: int,
    max_new_tokens: int,
    conversations: int,
    num_prompts: int,
    log: Any = print,
) -> ConversationFigures:
    """Run the three measurements (module docstring) on ``engine``, greedy: ``conversations``
    of ``turns`` turns, then ``num_prompts`` prompts of each kind for the other two."""
    figures = ConversationFigures()
    chats, repeat, first_time = select_prompts(workload, conversations, turns, num_prompts)
    for prompts in chats:
        _conversation(engine, prompts, max_new_tokens, figures, log)
    for prompt in repeat:  # asked once by each method, then again: the second is timed
        ids = engine.encode(messages=list(prompt.messages))
        _generate(engine, ids, "suffix", max_new_tokens)
        for name in ("none", "suffix"):
            result = _generate(engine, ids, name, max_new_tokens)
            figures.repeat_tps.setdefault(name, []).append(result.stats.tokens_per_second)
    for prompt in first_time:
        ids = engine.encode(messages=list(prompt.messages))
        for name in ("none", "suffix"):
            result = _generate(engine, ids, name, max_new_tokens, cache_prompt=False)
            figures.first_tps.setdefault(name, []).append(result.stats.tokens_per_second)
    log(json.dumps(figures.summary(), indent=1))
    return figures


def _conversation(
    engine: Engine,
    prompts: list[WorkloadPrompt],
    max_new_tokens: int,
    figures: ConversationFigures,
    log: Any,
) -> None:
    history: list[dict[str, str]] = []
    for turn, prompt in enumerate(prompts):
        history.extend(prompt.messages[-1:] if history else prompt.messages)
        ids = engine.encode(messages=history)
        runs = {}
        for cache_prompt in (True, False) if turn % 2 else (False, True):  # alternate the order
            runs[cache_prompt] = _generate(
                engine, ids, "ngram", max_new_tokens, logprobs=0, cache_prompt=cache_prompt
            )
        warm, cold = runs[True], runs[False]
        assert warm.logprobs is not None and cold.logprobs is not None
        same = warm.token_ids == cold.token_ids and (
            warm.logprobs.logprobs.tolist() == cold.logprobs.logprobs.tolist()
        )
        figures.mismatches += 0 if same else 1
        warm_s, cold_s = warm.stats.time_to_first_token_s, cold.stats.time_to_first_token_s
        assert warm_s is not None and cold_s is not None
        if turn > 0:
            figures.ttft_cached.append(warm_s)
            figures.ttft_cold.append(cold_s)
            figures.cached_tokens.append(warm.stats.cached_tokens)
            figures.prompt_tokens.append(len(ids))
        log(
            f"turn {turn + 1}: {len(ids)} prompt tokens, {warm.stats.cached_tokens} cached; "
            f"TTFT {warm_s:.3f} s vs {cold_s:.3f} s cold{'' if same else '; MISMATCH'}"
        )
        history.append({"role": "assistant", "content": warm.text})


def _generate(
    engine: Engine, ids: list[int], proposer: str, max_new_tokens: int, **options: Any
) -> GenerationResult:
    return engine.generate(
        prompt_token_ids=ids, proposer=proposer, max_new_tokens=max_new_tokens, **options
    )


def add_conversations_command(subcommands: Any) -> None:
    """Register ``bench conversations``."""
    parser = subcommands.add_parser(
        "conversations",
        help="multi-turn (prefix cache) and repeat (suffix proposer) workloads on one engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--workload", type=Path, default=DEFAULT_WORKLOAD, help="workload JSON file")
    add("--turns", type=int, default=6, help="turns per conversation (default 6)")
    add("--conversations", type=int, default=2, help="conversations (default 2)")
    add("--prompts", type=int, default=6, help="prompts of the repeat and first-time runs")
    add("--max-new-tokens", type=int, default=96)
    add("--target", default=None, help="target model (default: the embedded one)")
    add("--max-seq-len", type=int, default=4096)
    add(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: two threads spin at barriers on a busy machine, "
        "as for hybridspec bench)",
    )
    add("--output", type=Path, default=Path("bench-results/conversations.json"))
    parser.set_defaults(run=run_conversations_command)


def run_conversations_command(args: argparse.Namespace) -> int:
    import torch

    from hybridspec.config import EngineConfig, ModelConfig
    from hybridspec.engine import Engine
    from hybridspec.engine.warmup import warm_up

    torch.set_num_threads(args.threads)
    target = ModelConfig(args.target, max_seq_len=args.max_seq_len)
    engine = Engine(EngineConfig(target=target))
    warm_up(engine)
    began = time.perf_counter()
    workload = load_workload(args.workload)
    figures = run_conversations(
        engine, workload, args.turns, args.max_new_tokens, args.conversations, args.prompts
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "summary": figures.summary(),
        "figures": asdict(figures),
        "elapsed_s": time.perf_counter() - began,
    }
    args.output.write_text(json.dumps(body, indent=1))
    print(f"wrote {args.output}")
    return 0
