"""``TrainOptions``: the head's training options and their defaults, in one place that the
``distill`` command line reads without importing torch (``distill.cli``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TrainOptions:
    budget_s: float
    seed: int = 0
    batch_size: int = 8
    window: int = 128
    lr: float = 1e-3
    num_steps: int = 3  # drafting steps unrolled (training-time test)
    max_steps: int | None = None  # a fixed number of optimiser steps (tests); None: by budget
    device: str = "cpu"
    # bfloat16 matmuls (torch.autocast): on CUDA, and on a CPU whose target runs in bfloat16
    # (the loader picks it only where the CPU has bfloat16 instructions)
    bfloat16: bool = False


DEFAULTS = TrainOptions(budget_s=0.0)  # what the command line shows and falls back to
