"""A soak of the prefix cache and the ``suffix`` proposer: many requests, memory and errors.

On the embedded target (bfloat16 on CPU, the prefix cache's exact runtime) with a small
context, it runs ``--requests`` short requests, a few at a time, drawn from a handful of
conversations that grow turn by turn and restart, half of them with ``suffix`` and half with
``ngram``, and reports errors, the prefix cache's hits and evictions, its entries against its
slots, and the process's resident memory after the warm-up and at the end (``/proc``, Linux).

Memory is checked against the budgets after every finished request: what the prefix cache
charges (its entries' and the free slots' resident pages) stays within its budget; the keys and
values resident (``KVCache.resident_bytes`` summed over every slot, running, retained or free)
within the running requests' slots (``max_num_seqs`` whole slots) plus that budget; and the
rest of the process's growth (the suffix pools, Python's heap, the allocator) within
``--allowance-mb``.
Run from the repository root::

    python benchmarks/experiments/engine/conversation_soak.py --requests 1000
"""

from __future__ import annotations

import argparse
import random
import resource
import time

import torch

from hybridspec.config import EngineConfig, ModelConfig, SuffixConfig
from hybridspec.engine import Engine, FinishReason, GenerationParams, kv_bytes_per_token, warm_up


def resident_mb() -> float:
    """The process's resident memory now (Linux ``/proc/self/statm``), in MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--prefix-cache-mb", type=int, default=64)
    parser.add_argument("--suffix-cache-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--allowance-mb", type=float, default=32.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = ModelConfig(max_seq_len=args.max_seq_len, max_num_seqs=4)
    engine = Engine(
        EngineConfig(
            target=target,
            prefix_cache_mb=args.prefix_cache_mb,
            suffix=SuffixConfig(args.suffix_cache_tokens, "per-session"),
        )
    )
    warm_up(engine)
    rng = random.Random(0)
    vocab = [t for t in range(1000, 20000)]
    histories = [[] for _ in range(args.conversations)]  # type: list[list[int]]
    began, errors, done, peak = time.perf_counter(), 0, 0, 0.0
    base, kv_base = resident_mb(), kv_resident_mb(engine)
    kv_peak, charged_peak, rest_peak = kv_base, 0.0, 0.0
    pending: dict[str, int] = {}
    submitted = 0
    while done < args.requests:
        while submitted < args.requests and len(pending) < 6:
            which = rng.randrange(args.conversations)
            history = histories[which]
            if len(history) > args.max_seq_len - 200:
                history.clear()  # the conversation starts over
            history.extend(rng.choice(vocab) for _ in range(rng.randrange(8, 40)))
            params = GenerationParams(
                max_new_tokens=rng.randrange(4, 24),
                proposer="suffix" if submitted % 2 else "ngram",
                session=f"user{which % 3}",
                cache_prompt=rng.random() > 0.1,
            )
            pending[engine.add_request(list(history), params)] = which
            submitted += 1
        outputs = engine.step()
        peak = max(peak, resident_mb())
        for output in outputs:
            if output.finished:
                which = pending.pop(output.request_id)
                done += 1
                if output.finish_reason is FinishReason.ERROR:
                    errors += 1
                elif output.result is not None:
                    histories[which].extend(output.result.token_ids)
                rss, kv = resident_mb(), kv_resident_mb(engine)
                peak, kv_peak = max(peak, rss), max(kv_peak, kv)
                rest_peak = max(rest_peak, (rss - kv) - (base - kv_base))
                charged = engine.prefix_cache.stats().resident_bytes / 2**20
                charged_peak = max(charged_peak, charged)
                if done % 50 == 0:  # progress, for a run cut short
                    print(
                        f"{done} requests, {errors} errors, {time.perf_counter() - began:.0f} s: "
                        f"charged {charged_peak:.1f} MiB at most, keys and values "
                        f"{kv_peak:.1f} MiB at most, the rest {rest_peak:.1f} MiB at most",
                        flush=True,
                    )
    stats = engine.prefix_cache.stats()
    end, kv_end = resident_mb(), kv_resident_mb(engine)
    slot_mb = kv_bytes_per_token(engine.target) * engine.max_seq_len / 2**20
    budget_mb = stats.budget_bytes / 2**20
    kv_bound = engine.max_num_seqs * slot_mb + budget_mb
    within = charged_peak <= budget_mb and kv_peak <= kv_bound and rest_peak <= args.allowance_mb
    print(
        f"{done} requests in {time.perf_counter() - began:.0f} s, {errors} errors; prefix cache: "
        f"{stats.hits} hits, {stats.hit_tokens} tokens read, {stats.evicted_tokens} evicted, "
        f"{stats.num_entries} entries (at most {engine.prefix_cache.num_slots}) holding "
        f"{stats.num_cached_tokens} tokens; charged {charged_peak:.1f} MiB at most (budget "
        f"{budget_mb:.0f} MiB), {stats.resident_bytes / 2**20:.1f} MiB at the end; resident "
        f"{base:.0f} MiB after the warm-up, {peak:.0f} MiB at most, {end:.0f} MiB at the end; "
        f"keys and values {kv_base:.1f} MiB after the warm-up, {kv_peak:.1f} at most, "
        f"{kv_end:.1f} at the end (bound: {engine.max_num_seqs} running slots of "
        f"{slot_mb:.1f} MiB + the budget = {kv_bound:.1f} MiB); the rest grew "
        f"{rest_peak:.1f} MiB at most (allowance {args.allowance_mb:.0f} MiB); within the "
        f"budgets: {'yes' if within else 'NO'}"
    )


def kv_resident_mb(engine: Engine) -> float:
    """MiB of memory pages the target's keys and values hold, over every slot."""
    slots = range(engine.runtime.max_num_seqs)
    return sum(engine.runtime.resident_bytes(slot) for slot in slots) / 2**20  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
