"""What each thread team gets on a busy machine: decode tokens and prompt steps at fixed modes.

``--threads auto`` chooses among thread counts and wait modes from measured step times
(``hybridspec.model.thread_policy``); this times the modes it chooses among directly, each
fixed, in turns (so that the machine's drift falls on all of them alike), with ``--busy N``
busy-looping processes beside the run (``hybridspec.bench.busy``). A mode is a count and a
letter:

- ``s``: spinning waits (a fixed ``--threads N``);
- ``p``: passive waits, the team packed two threads a core (``hybridspec.model.wait_mode`` with
  the room of one core: what ``auto`` runs decode rounds at beside busy processes);
- ``w``: passive waits, spread over the cores (what ``auto`` runs prompt steps at).

``decode`` times a token of greedy decoding with ``none`` (a request of ``--tokens`` + 1 new
tokens less one of 1, the same prompt: its prompt step cancels); ``prompt`` times a one-token
request of a fresh prompt of ``--words`` random words (no prefix-cache hit), first token
included. Run from the repository root, after ``make install``::

    python benchmarks/experiments/busy/team_modes.py decode --target FILE.gguf --busy 2 \\
        --modes 1s 2p 2w 3w 4w
    python benchmarks/experiments/busy/team_modes.py prompt --target FILE.gguf --busy 1 \\
        --modes 1s 2w 3w 4w
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from hybridspec.bench import busy_processes
from hybridspec.config import EngineConfig, ModelConfig
from hybridspec.engine import Engine
from hybridspec.model import prompt_step, set_num_threads, wait_mode

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "music",
    "paper",
    "light",
    "window",
    "garden",
    "yellow",
    "quiet",
    "number",
    "engine",
    "silver",
    "forest",
]


def apply_mode(mode: str) -> None:
    """Set the calling thread's forward to ``mode`` (module docstring)."""
    count, kind = int(mode[:-1]), mode[-1]
    if count < 1 or kind not in "spw":
        raise ValueError(f"mode: expected a count and s, p or w, got {mode!r}")
    set_num_threads(count)
    wait_mode(kind != "s", 1.0 if kind == "p" else None)
    prompt_step(kind == "w")


def decode_ms(engine: Engine, tokens: int) -> float:
    """Milliseconds per decoded token of one greedy ``none`` request."""
    messages = [{"role": "user", "content": "Tell me a long story about a dragon."}]

    def run(new_tokens: int) -> float:
        start = time.perf_counter()
        engine.generate(messages=messages, proposer="none", max_new_tokens=new_tokens)
        return time.perf_counter() - start

    one = run(1)
    return 1000 * (run(tokens + 1) - one) / tokens


def prompt_ms(engine: Engine, words: int, rng: random.Random) -> float:
    """Milliseconds to the first token of a fresh prompt."""
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    start = time.perf_counter()
    engine.generate(messages=[{"role": "user", "content": text}], proposer="none", max_new_tokens=1)
    return 1000 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("decode", "prompt"))
    parser.add_argument("--target", help="a GGUF file (default: the embedded one)")
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside the run")
    parser.add_argument("--modes", nargs="+", default=["1s", "2p", "2w"])
    parser.add_argument("--rounds", type=int, default=4, help="turns through the modes")
    parser.add_argument("--tokens", type=int, default=48, help="decode: tokens timed a turn")
    parser.add_argument("--words", type=int, default=120, help="prompt: words of a prompt")
    args = parser.parse_args()
    engine = Engine(EngineConfig(num_threads=2, target=ModelConfig(args.target)))
    rng = random.Random(0)
    measure: Callable[[], float] = (
        (lambda: decode_ms(engine, args.tokens))
        if args.what == "decode"
        else (lambda: prompt_ms(engine, args.words, rng))
    )
    for mode in args.modes:  # each mode's first run (its workers, its scratch) untimed
        apply_mode(mode)
        measure()
    times: dict[str, list[float]] = {mode: [] for mode in args.modes}
    with busy_processes(args.busy):
        time.sleep(1.0)  # the busy processes started and placed
        for _ in range(args.rounds):
            for mode in args.modes:
                apply_mode(mode)
                times[mode].append(measure())
    unit = "ms/token" if args.what == "decode" else "ms to the first token"
    print(f"{args.what}, {args.busy} busy processes beside, {unit}:")
    for mode, values in times.items():
        listed = " ".join(f"{value:.1f}" for value in values)
        print(f"{mode:>4}: median {statistics.median(values):7.1f}   ({listed})")


if __name__ == "__main__":
    main()
