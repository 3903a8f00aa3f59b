"""Where ``ngram``'s drafts miss on sampled text: the profile behind its T = 0.8 figure.

A deterministic draft ``d`` is kept with probability ``p(d)``, the target's probability of it
at that position (``verifier.uniforms``: the target's token is the inverse-CDF sample of ``p``
at a keyed uniform, and the draft is kept when it equals it). So no choice of a single draft
can be kept more often than the target's top token, ``max p``. This script measures how far
``ngram``'s first drafts are from that ceiling, and why, on the texts ``hybridspec bench``
generates for the input-grounded prompts:

1. Each prompt is generated with ``ngram`` at the bench's seeds (repeat ``r``, prompt ``i``:
   ``seed + r * SEED_STRIDE + i``, as ``hybridspec.bench.harness.sampling_for``), recording
   every round: its committed length and the drafts proposed. The text is the one ``none``
   writes for the same seed (sampled texts do not depend on the proposer).
2. One target forward over prompt + text gives ``p`` at every generated position. As a check,
   sampling each position again from this ``p`` with its keyed uniform must give the text
   (printed as ``resampled``); otherwise the figures below would be about other numbers.
3. Rounds are grouped by the longest context (up to the proposer's ``max_order``) whose last
   tokens occur earlier in the proposer's window: the match the first draft copies from.

Run from the repository root, after ``make install`` (about 8 minutes with the defaults)::

    python benchmarks/sampled_drafts.py                    # T = 0.8, 3 seeds
    python benchmarks/sampled_drafts.py --seeds 1 --prompts 4

It prints tokens per verifying forward per seed (how much the text itself moves the figure),
then the table of rounds. Numbers of a run are quoted in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridspec.bench.harness import sampling_for
from hybridspec.bench.timing import EngineForwardTimer
from hybridspec.bench.workload import DEFAULT_WORKLOAD, encode_prompt, load_workload
from hybridspec.config import EngineConfig, ModelConfig, NgramConfig
from hybridspec.engine import Engine, GenerationParams
from hybridspec.model.runtime import ForwardBatch
from hybridspec.types import Proposal, ProposeRequest
from hybridspec.verifier.acceptance import sample_from_probs
from hybridspec.verifier.sampling import logits_to_probs
from hybridspec.verifier.uniforms import key_of, position_uniform

GROUPS = ("no earlier occurrence", "1 token", "2 tokens", "3 or more tokens")


@dataclass(frozen=True, slots=True)
class Round:
    position: int  # committed tokens before the round (prompt included): the first draft's index
    drafts: tuple[int, ...]


@dataclass(slots=True)
class Group:
    rounds: int = 0
    drafted: int = 0
    kept: int = 0
    p_draft: float = 0.0
    p_top: float = 0.0
    p_top_drafted: float = 0.0
    draft_is_top: int = 0


@dataclass(slots=True)
class Totals:
    tokens: int = 0
    forwards: int = 0  # target forwards, prefill included (as the bench counts them)
    resampled: int = 0


def match_order(tokens: np.ndarray, length: int, config: NgramConfig) -> int:
    """The longest order ``n`` whose last ``n`` committed tokens occur earlier in the window
    followed by a committed token (0 when none does): what ``copy`` proposes from."""
    low = max(0, length - config.window)
    for n in range(config.max_order, config.min_order - 1, -1):
        if length - low < n + 1:
            continue
        earlier = np.lib.stride_tricks.sliding_window_view(tokens[low : length - 1], n)
        if np.all(earlier == tokens[length - n : length], axis=1).any():
            return n
    return 0


def record_rounds(engine: Engine) -> list[Round]:
    """Wrap ``engine``'s ngram proposer so that each ``propose`` call appends its rounds."""
    proposer = engine.resolve_proposer("ngram")
    original = proposer.propose
    rounds: list[Round] = []

    def propose(requests: Sequence[ProposeRequest]) -> list[Proposal]:
        proposals = original(requests)
        for request, proposal in zip(requests, proposals, strict=True):
            drafts = tuple(proposal.token_ids)
            rounds.append(Round(len(request.token_ids), drafts))
        return proposals

    proposer.propose = propose  # type: ignore[method-assign]
    return rounds


def target_probs(
    engine: Engine, sequence: list[int], prompt_len: int, temperature: float
) -> torch.Tensor:
    """p [len(sequence) - prompt_len + 1, V] at every position after the prompt, the one
    after ``sequence`` included, from one forward over ``sequence``."""
    runtime = engine.runtime
    slot = runtime.allocate()
    try:
        rows = list(range(prompt_len - 1, len(sequence)))
        logits = runtime.forward(
            ForwardBatch.from_lists([slot], [sequence], logits_indices=rows)
        ).logits
    finally:
        runtime.free(slot)
    return logits_to_probs(logits, GenerationParams.create(temperature=temperature).sampling)


def add_prompt(
    totals: Totals,
    groups: list[Group],
    engine: Engine,
    prompt: list[int],
    seed: int,
    args: argparse.Namespace,
    rounds: list[Round],
) -> None:
    rounds.clear()
    params = GenerationParams.create(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=seed,
        proposer="ngram",
    )
    timer = EngineForwardTimer(engine.runtime)
    timer.install()
    try:
        result = engine.generate(prompt_token_ids=prompt, params=params)
    finally:
        timer.uninstall()
    text = list(result.token_ids)
    probs = target_probs(engine, prompt + text, len(prompt), args.temperature)
    key = key_of(seed)
    uniforms = [position_uniform(key, len(prompt) + i) for i in range(len(text) + 1)]
    resampled = sample_from_probs(probs, torch.tensor(uniforms, dtype=torch.float64)).tolist()
    if result.stats.generated_tokens == len(text) + 1:  # it ended on an end-of-sequence token
        end = resampled[-1]
        text.append(end if end in engine.eos_token_ids else -1)  # -1 counts as a mismatch
    probs = probs[: len(text)]
    sequence = prompt + text
    totals.resampled += sum(a == b for a, b in zip(resampled, text, strict=False))
    totals.tokens += len(text)
    totals.forwards += timer.calls
    top_p, top_id = probs.max(dim=-1)
    tokens = np.array(sequence, np.int64)
    config = engine.resolve_proposer("ngram").config  # type: ignore[attr-defined]
    for r in rounds:
        i = r.position - len(prompt)  # index of the first draft's position in the text
        group = groups[min(match_order(tokens, r.position, config), len(GROUPS) - 1)]
        group.rounds += 1
        group.p_top += float(top_p[i])
        if r.drafts:
            d = r.drafts[0]
            group.drafted += 1
            group.kept += int(d == text[i])
            group.p_draft += float(probs[i, d])
            group.p_top_drafted += float(top_p[i])
            group.draft_is_top += int(d == int(top_id[i]))


def print_groups(groups: list[Group]) -> None:
    print(
        f"{'longest earlier match':24s} {'rounds':>7s} {'share':>6s} {'drafted':>8s} "
        f"{'p(draft)':>9s} {'p(top)':>7s} {'draft=top':>10s} {'kept':>6s}"
    )
    all_rounds = sum(g.rounds for g in groups)
    for name, g in zip(GROUPS, groups, strict=True):
        if g.rounds == 0:
            continue
        line = f"{name:24s} {g.rounds:7d} {g.rounds / all_rounds:6.0%} {g.drafted / g.rounds:8.0%} "
        if g.drafted:
            line += (
                f"{g.p_draft / g.drafted:9.2f} {g.p_top_drafted / g.drafted:7.2f} "
                f"{g.draft_is_top / g.drafted:10.0%} {g.kept / g.drafted:6.0%}"
            )
        else:
            line += f"{'-':>9s} {g.p_top / g.rounds:7.2f} {'-':>10s} {'-':>6s}"
        print(line)
    print(
        "p(draft): mean target probability of the first draft, the chance it is kept; p(top): "
        "mean probability of the target's top token at the same positions, the most any "
        "single draft could be kept; kept: first drafts kept, measured"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seeds", type=int, default=3, help="bench repeats 0..N-1")
    parser.add_argument("--seed", type=int, default=0, help="the bench's base seed")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=None, help="first N prompts only")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.temperature <= 0:
        parser.error("--temperature: expected > 0 (greedy drafts are kept when they are the top)")
    torch.set_num_threads(args.threads)

    workload = load_workload(DEFAULT_WORKLOAD)
    grounded = [n for n, c in workload.categories.items() if c.input_grounded]
    prompts = workload.select(grounded, 4).prompts[: args.prompts]
    target = ModelConfig(None, "bfloat16", "cpu", max_num_seqs=2, max_seq_len=1024)
    engine = Engine(EngineConfig(target=target))
    rounds = record_rounds(engine)
    token_ids = [list(encode_prompt(engine.tokenizer, p)) for p in prompts]

    groups = [Group() for _ in GROUPS]
    tokens = forwards = 0
    print(
        f"T = {args.temperature}, {len(prompts)} input-grounded prompts, "
        f"the bench's seeds of repeats 0..{args.seeds - 1}"
    )
    for repeat in range(args.seeds):
        totals = Totals()
        for i, prompt in enumerate(token_ids):
            seed = sampling_for(args.temperature, args.seed, repeat, i).seed
            assert seed is not None
            add_prompt(totals, groups, engine, prompt, seed, args, rounds)
        print(
            f"repeat {repeat}: {totals.tokens} tokens in {totals.forwards} target forwards, "
            f"{totals.tokens / totals.forwards:.2f} per forward; resampled from the "
            f"recomputed p: {totals.resampled} of {totals.tokens} tokens equal the text"
        )
        tokens += totals.tokens
        forwards += totals.forwards
    print(f"all repeats: {tokens / forwards:.2f} tokens per target forward\n")
    print_groups(groups)


if __name__ == "__main__":
    main()
