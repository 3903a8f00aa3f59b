"""Where a forward's OpenMP threads wait: one engine, built and stepped on one thread or two.

Run from the repository root, one arrangement per process (an OpenMP team, once made, stays)::

    .venv/bin/python benchmarks/omp_teams.py split  # built and warmed on main, stepped on a thread
    .venv/bin/python benchmarks/omp_teams.py one    # built, warmed and stepped on one thread
    .venv/bin/python benchmarks/omp_teams.py main   # all on the main thread (the library)

``split`` is how ``hybridspec serve`` ran before the engine was built on its engine thread.
Prints tok/s of 128 greedy ``none`` tokens (``ignore_eos``) and the voluntary context switches
per token of the whole process (``/proc/self/task/*/status``): GNU OpenMP keeps one team of
workers per thread that starts parallel regions, and with more threads in teams than cores its
workers sleep between regions instead of spinning, which shows as hundreds of switches a token.
"""

from __future__ import annotations

import glob
import sys
import threading
import time

from hybridspec import Engine

PROMPT_IDS = list(range(1000, 1030))
TOKENS = 128


def voluntary_switches() -> int:
    total = 0
    for status in glob.glob("/proc/self/task/*/status"):
        try:
            with open(status) as lines:
                total += sum(int(x.split()[1]) for x in lines if x.startswith("voluntary_"))
        except OSError:
            pass
    return total


def generate(engine: Engine, out: list[tuple[float, float]]) -> None:
    engine.generate(prompt_token_ids=PROMPT_IDS, max_new_tokens=8, proposer="none")
    switches, start = voluntary_switches(), time.perf_counter()
    engine.generate(
        prompt_token_ids=PROMPT_IDS, max_new_tokens=TOKENS, ignore_eos=True, proposer="none"
    )
    seconds = time.perf_counter() - start
    out.append((TOKENS / seconds, (voluntary_switches() - switches) / TOKENS))


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "split"
    out: list[tuple[float, float]] = []
    if mode == "main":
        generate(Engine(), out)
    elif mode == "split":
        engine = Engine()
        engine.generate(prompt_token_ids=PROMPT_IDS, max_new_tokens=8)
        thread = threading.Thread(target=generate, args=(engine, out))
        thread.start()
        thread.join()
    elif mode == "one":
        thread = threading.Thread(target=lambda: generate(Engine(), out))
        thread.start()
        thread.join()
    else:
        raise SystemExit(f"mode: expected split, one or main, got {mode!r}")
    rate, switches = out[0]
    print(f"{mode}: {rate:.1f} tok/s, {switches:.1f} voluntary context switches per token")


if __name__ == "__main__":
    main()
