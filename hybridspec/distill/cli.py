"""``hybridspec distill``: train an EAGLE-style draft head for a target, bounded in time.

Phases, each with its own budget, all resumable from ``--work-dir``: the target answers chat
prompts (``--answers-minutes``; on its quantized blocks where that is the faster default, with
features from its dense weights), reads local text teacher-forced (``--reading-minutes``), then
the head trains on the cached features (``--train-minutes``).
The head goes to ``--out`` (``config.json``, ``head.safetensors``) with ``training.json``:
the options, the time each phase took and the held-out acceptance estimate.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hybridspec.distill.options import DEFAULTS


def add_distill_command(commands: Any) -> None:
    """Register ``distill`` on the ``hybridspec`` subcommand parsers."""
    p = commands.add_parser(
        "distill",
        help="train a draft head (eagle proposer) for a target on this machine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default=None, help="as for serve (default: the embedded model)")
    p.add_argument("--dtype", default="auto", help="the target's dtype while making data")
    p.add_argument("--device", default="cpu", help="cpu or cuda: target and training")
    p.add_argument("--out", type=Path, required=True, help="directory of the trained head")
    p.add_argument("--work-dir", type=Path, required=True, help="cached data and checkpoints")
    p.add_argument("--answers-minutes", type=float, default=20.0)
    p.add_argument("--reading-minutes", type=float, default=2.0)
    p.add_argument("--train-minutes", type=float, default=30.0)
    p.add_argument("--max-new-tokens", type=int, default=256, help="per answer")
    p.add_argument("--max-num-seqs", type=int, default=16, help="answers written at once")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size")
    p.add_argument(
        "--feature-layers",
        type=_layers,
        default=(-1,),
        metavar="I,J,...",
        help="the target's layers the head reads, e.g. 2,15,-1 (EAGLE-3's low, middle and "
        "last); -1, the last, must be among them (default: -1)",
    )
    p.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size)
    p.add_argument("--window", type=int, default=DEFAULTS.window)
    p.add_argument("--lr", type=float, default=DEFAULTS.lr)
    p.add_argument("--steps", type=int, default=None, help="fixed optimiser steps (tests)")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed)
    p.set_defaults(run=run_distill)


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer indices, got {text!r}"
        ) from None


def run_distill(args: argparse.Namespace) -> int:
    from hybridspec.distill.run import distill

    return distill(args)
