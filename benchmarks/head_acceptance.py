"""How often draft heads agree with the target on the bench's own greedy answers.

The target (the embedded SmolLM2-135M-Instruct, bfloat16) answers every prompt of the bench
workload greedily (128 new tokens); one teacher-forced forward gives its features. Each head
then drafts from them as in training (``distill.train``: the training-time unroll over each
answer's last window): per category, the share of positions where its top draft is the
target's top token, by drafting step, and over the input-grounded and open-ended groups the
share where the target's top token is among the head's top 1, 2, 3 or 5 drafts (what a tree of
that width could keep at most). The bench never sees the heads' training data, so this is the
held-out estimate on the workload itself.

Run from the repository root, after ``make install`` (about 2 minutes)::

    python benchmarks/head_acceptance.py hybridspec/heads/smollm2-135m-instruct [HEAD_DIR ...]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch

from hybridspec.bench.workload import DEFAULT_WORKLOAD, load_workload
from hybridspec.config import EngineConfig, ModelConfig
from hybridspec.distill.data import FeatureReader
from hybridspec.distill.train import (
    acceptance,
    distill_parts,
    label_column,
    target_top,
    windows,
)
from hybridspec.engine import Engine
from hybridspec.proposers.eagle import load_head

GROUNDED = {"code_editing", "summarization", "retrieval_qa", "extraction"}
STEPS = 3
WIDTHS = (1, 2, 3, 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("heads", nargs="+", type=Path, help="head directories")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = ModelConfig(None, "auto", "cpu", max_seq_len=2048, max_num_seqs=1, quantize="none")
    engine = Engine(EngineConfig(target=target))
    parts = distill_parts(engine.target, torch.float32)
    heads = {directory: load_head(directory, parts).float().eval() for directory in args.heads}
    last = int(engine.target.hf_config.get_text_config().num_hidden_layers) - 1
    layers = sorted({last, *(i % (last + 1) for h in heads.values() for i in h.feature_layers)})
    reader = FeatureReader(engine.target, 2048, tuple(layers))
    answers = defaultdict(list)
    for prompt in load_workload(DEFAULT_WORKLOAD).prompts:
        ids = list(engine.encode(messages=list(prompt.messages)))
        ids += engine.generate(prompt_token_ids=ids, proposer="ngram", max_new_tokens=128).token_ids
        answers[prompt.category].append((torch.tensor(ids), reader(ids).to(torch.bfloat16)))
    for directory, head in heads.items():
        # the columns of the head's layers, in its order; the label's is the last layer's
        columns = [layers.index(i % (last + 1)) for i in head.feature_layers]
        label = label_column(head.feature_layers)
        print(f"{directory}: top draft = target's top token, by step")
        for category, everything in answers.items():
            items = [(ids, features[:, columns]) for ids, features in everything]
            batch = windows(items, 127, None, label)
            tops = target_top(parts, batch, head.config.rms_norm_eps)
            rates = acceptance(head, batch, tops, STEPS)
            print(f"  {category:18s} " + " ".join(f"{r:.3f}" for r in rates))
        print(f"  target's top token among the head's top {WIDTHS}, by step")
        for group in ("input-grounded", "open-ended"):
            items = [
                (ids, features[:, columns])
                for category, chosen in answers.items()
                if (category in GROUNDED) == (group == "input-grounded")
                for ids, features in chosen
            ]
            coverages = top_coverage(head, parts, items, label)
            for step, coverage in enumerate(coverages, start=1):
                print(f"  {group:15s} step {step} " + " ".join(f"{c:.3f}" for c in coverage))


@torch.no_grad()
def top_coverage(head, parts, items, label):  # type: ignore[no-untyped-def]
    """Per drafting step, the share of positions whose target top token is in the head's top
    ``w`` drafts, for each ``w`` of ``WIDTHS``."""
    batch = windows(items, 127, None, label)
    tops = target_top(parts, batch, head.config.rms_norm_eps)
    out = []
    features = head.target_features(batch.features)
    for step, predicted in enumerate(head.unrolled(features, batch.next_token_ids, 2)):
        ranked = head.draft_vocab[head.logits(predicted).topk(max(WIDTHS), -1).indices]
        hit = ranked == tops[..., None]  # [B, T, max(WIDTHS)]
        mask = batch.mask.clone()
        mask[:, :step] = False
        out.append([float((hit[..., :w].any(-1) & mask).sum() / mask.sum()) for w in WIDTHS])
    return out


if __name__ == "__main__":
    main()
