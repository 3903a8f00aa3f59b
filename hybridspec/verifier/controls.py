"""Sampling controls: the position-aware changes to the logits, applied alike to p and q.

The verifier applies them to each verified row of the target's logits, and a proposer that
returns q (``proposers.draft``) to each row of its own, both through ``apply_controls``; then the
sampling transforms (``sampling``: temperature, top-k, min-p, top-p) make the distribution, or
greedy decoding takes the argmax of the controlled logits. So p and q are under the same
transforms and verification stays exact, with every proposer.

The semantics are OpenAI's and vLLM's. For one row of logits ``z`` at a position with
``count[t]`` = how often token ``t`` occurs among the tokens *generated* before that position
(prompt excluded) and ``seen[t]`` = whether it occurs in the prompt or the generated tokens, in
this order (vLLM's):

1. **logit_bias**: ``z[t] += bias[t]``.
2. **repetition_penalty** ``rho`` (Hugging Face, vLLM): where ``seen[t]``, ``z[t] / rho`` if
   ``z[t] > 0`` else ``z[t] * rho``.
3. **frequency_penalty** ``f`` and **presence_penalty** ``r`` (OpenAI):
   ``z[t] -= f * count[t] + r * (count[t] > 0)``.
4. **grammar** (structured output, ``TokenHistory.constraint``): ``z[t] = -inf`` for every
   token the grammar forbids after the committed tokens and the drafted prefix
   (``verifier.grammar``).
5. **min_tokens**: while fewer than ``min_tokens`` tokens are generated, ``z[s] = -inf`` for
   every stop token ``s`` (the model's EOS ids, unless the request ignores EOS), except where
   the grammar allows nothing else (the output must end there to match it).

The -inf masks (4, 5) commute with 1-3, so this order is vLLM's (bias, min_tokens, penalties)
in effect.

Position-aware: at verify row j (after the committed tokens and drafts ``d_1 .. d_j``) the
drafts count as generated. Worked example: prompt ``[5, 6]``, generated ``[7, 7]``, drafts
``[8, 7, 9]``, ``f = 0.5``, ``r = 1``. Row 0 (no draft before it): ``count[7] = 2``, so
``z[7] -= 0.5 * 2 + 1 = 2``. Row 2 (after ``d_1 d_2 = 8 7``): ``count[7] = 3``, ``count[8] =
1``, so ``z[7] -= 2.5``, ``z[8] -= 1.5``; ``z[5]`` is untouched (prompt tokens are not counted;
with ``rho`` they are seen). With ``min_tokens = 4`` EOS is masked at rows 0 and 1 (2 and 3
generated) and allowed from row 2 on.

Requests without controls (``SamplingParams.has_controls``, and no grammar) cost nothing: their
rows are not touched, and a batch without any is returned as it came, without a copy. Counts
are built with one ``bincount`` per batch over the controlled sequences' generated tokens, then
each verify row adds its drafted prefix.

Dimensions: ``num_seqs`` sequences, ``num_rows`` rows of logits (each sequence's consecutive),
``vocab_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridspec.errors import check
from hybridspec.types import SamplingParams, TokenHistory
from hybridspec.verifier.layout import DraftLayout


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """Raise InvalidRequestError (param ``logit_bias``) for a token id outside the vocabulary."""
    outside = [t for t, _ in params.logit_bias if t >= vocab_size]
    check(
        not outside,
        "logit_bias",
        f"token ids must be below the vocabulary size {vocab_size}, got {outside[:5]}",
    )


@dataclass(frozen=True, slots=True)
class _Rows:
    """The controlled sequences' rows, flattened: what each row's controls read."""

    seq_of_row: torch.Tensor  # [num_rows] int64, index into the controlled sequences
    prefix_pairs: tuple[list[int], list[int]]  # (row, draft token) for each draft before a row
    num_generated: list[int]  # [num_rows]: generated tokens before the row, drafts included


def is_controlled(params: SamplingParams, history: TokenHistory | None) -> bool:
    """True when a sequence's logits change under its controls or its grammar."""
    return params.has_controls or (history is not None and history.constraint is not None)


def apply_controls(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
    drafts: Sequence[Sequence[int]],
    layout: DraftLayout | None = None,
) -> torch.Tensor:
    """The logits after each sequence's controls (module docstring), every row.

    ``logits`` [num_rows, vocab_size]; per sequence: its ``SamplingParams``, its history (may be
    None only when it has no controls) and its drafts. ``layout``: the verifier's rows, sequence
    i's ``k_i + 1`` from ``layout.row_offsets[i]``, row j after ``drafts[i][:j]``; None: one row
    per sequence, after all its drafts (a proposer's next position). Example: drafts
    ``[a, b, c]`` in a layout own 4 rows, after ``[], [a], [a, b], [a, b, c]``; without one, 1
    row, after ``[a, b, c]``.

    Returns ``logits`` itself when no sequence has controls; else a new float32 tensor (float64
    stays float64) in which only the controlled sequences' rows differ.
    """
    controlled = [
        i
        for i, p in enumerate(params)
        if is_controlled(p, histories[i] if i < len(histories) else None)
    ]
    if not controlled:
        return logits
    if layout is None:
        counts, starts = [1] * len(drafts), list(range(len(drafts) + 1))
    else:
        counts, starts = [k + 1 for k in layout.num_drafts], list(layout.row_offsets)
    check(
        len(params) == len(histories) == len(drafts) == len(counts)
        and starts[-1] == logits.shape[0]
        and (layout is None or list(layout.num_drafts) == [len(d) for d in drafts]),
        "layout",
        f"expected one entry per sequence and {logits.shape[0]} rows, got {counts} rows for "
        f"drafts of {[len(d) for d in drafts]}",
    )
    for i in controlled:
        check(histories[i] is not None, "histories", f"sequence {i} has controls but no history")
    float_input = logits.dtype in (torch.float32, torch.float64)
    out = logits.clone() if float_input else logits.float()  # never the caller's tensor
    rows = [r for i in controlled for r in range(starts[i], starts[i + 1])]
    whole = len(rows) == logits.shape[0]
    index = torch.tensor(rows, device=out.device)
    sub = out if whole else out[index]
    _apply_(
        sub,
        [params[i] for i in controlled],
        [histories[i] for i in controlled],  # type: ignore[misc]  # checked above
        [drafts[i] for i in controlled],
        [counts[i] for i in controlled],
    )
    if not whole:
        out[index] = sub
    return out


def _apply_(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[TokenHistory],
    drafts: list[Sequence[int]],
    num_rows: list[int],
) -> None:
    """``apply_controls`` in place on the rows of controlled sequences only."""
    layout = _layout(histories, drafts, num_rows, logits.device)
    seq_of_row = layout.seq_of_row.tolist()
    row_params = [params[s] for s in seq_of_row]
    bias = [(r, t, b) for r, p in enumerate(row_params) for t, b in p.logit_bias]
    if bias:
        r_index, t_index, values = zip(*bias, strict=True)
        logits.index_put_(
            (
                torch.tensor(r_index, device=logits.device),
                torch.tensor(t_index, device=logits.device),
            ),
            torch.tensor(values, dtype=logits.dtype, device=logits.device),
            accumulate=True,
        )
    penalised = [
        s
        for s, p in enumerate(params)
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
    ]
    if penalised:
        _penalise_(logits, params, histories, layout, penalised)
    row = 0
    for history, tokens, n in zip(histories, drafts, num_rows, strict=True):
        if history.constraint is not None:
            history.constraint.mask_(logits[row : row + n], tokens)
        row += n
    masked = [
        (r, t)
        for r, (s, n) in enumerate(zip(seq_of_row, layout.num_generated, strict=True))
        if n < params[s].min_tokens
        for t in histories[s].stop_token_ids
    ]
    if masked:
        _hold_back_stops_(logits, masked)


def _hold_back_stops_(logits: torch.Tensor, masked: list[tuple[int, int]]) -> None:
    """``min_tokens``: -inf at each (row, stop token) of ``masked``, except in a row where that
    would leave no token at all (a grammar that allows only EOS there: it wins)."""
    r_index = torch.tensor([r for r, _ in masked], device=logits.device)
    t_index = torch.tensor([t for _, t in masked], device=logits.device)
    saved = logits[r_index, t_index].clone()
    logits[r_index, t_index] = float("-inf")
    dead = ~torch.isfinite(logits).any(dim=1)  # [num_rows]
    keep = dead[r_index]
    if keep.any():
        logits[r_index[keep], t_index[keep]] = saved[keep]


def _layout(
    histories: list[TokenHistory],
    drafts: list[Sequence[int]],
    num_rows: list[int],
    device: torch.device,
) -> _Rows:
    """Which sequence each row belongs to, the drafts before each row, and its generated count."""
    seq_of_row, pair_rows, pair_tokens, num_generated = [], [], [], []
    row = 0
    for s, (history, tokens, n) in enumerate(zip(histories, drafts, num_rows, strict=True)):
        first_prefix = len(tokens) - n + 1
        for j in range(n):
            prefix = tokens[: first_prefix + j]
            seq_of_row.append(s)
            pair_rows += [row] * len(prefix)
            pair_tokens += list(prefix)
            num_generated.append(history.num_generated + len(prefix))
            row += 1
    return _Rows(torch.tensor(seq_of_row, device=device), (pair_rows, pair_tokens), num_generated)


def _penalise_(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[TokenHistory],
    layout: _Rows,
    penalised: list[int],
) -> None:
    """Repetition, frequency and presence penalties, in place, on the rows of ``penalised``."""
    num_seqs, vocab_size = len(params), logits.shape[1]
    device, dtype = logits.device, logits.dtype
    generated = [histories[s].token_ids[histories[s].num_prompt_tokens :] for s in penalised]
    base = _bincount([list(g) for g in generated], penalised, num_seqs, vocab_size, device)
    counts = base[layout.seq_of_row].to(dtype)  # [num_rows, vocab_size]
    pair_rows, pair_tokens = layout.prefix_pairs
    if pair_rows:
        counts.index_put_(
            (torch.tensor(pair_rows, device=device), torch.tensor(pair_tokens, device=device)),
            torch.ones(len(pair_rows), dtype=dtype, device=device),
            accumulate=True,
        )
    seq_of_row = layout.seq_of_row.tolist()
    rho_of_seq = [params[s].repetition_penalty for s in range(num_seqs)]
    if any(rho != 1.0 for rho in rho_of_seq):
        repeating = [s for s in penalised if rho_of_seq[s] != 1.0]
        prompts = [
            list(histories[s].token_ids[: histories[s].num_prompt_tokens]) for s in repeating
        ]
        in_prompt = _bincount(prompts, repeating, num_seqs, vocab_size, device) > 0
        seen = in_prompt[layout.seq_of_row] | (counts > 0)
        rho = torch.tensor([rho_of_seq[s] for s in seq_of_row], dtype=dtype, device=device)
        rho = rho.unsqueeze(1)
        penalised_logits = torch.where(logits > 0, logits / rho, logits * rho)
        logits.copy_(torch.where(seen, penalised_logits, logits))
    frequency = [params[s].frequency_penalty for s in seq_of_row]
    presence = [params[s].presence_penalty for s in seq_of_row]
    if any(frequency):
        f = torch.tensor(frequency, dtype=dtype, device=device).unsqueeze(1)
        logits.sub_(f * counts)
    if any(presence):
        r = torch.tensor(presence, dtype=dtype, device=device).unsqueeze(1)
        logits.sub_(r * (counts > 0).to(dtype))


def _bincount(
    token_lists: list[list[int]],
    seqs: list[int],
    num_seqs: int,
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:
    """[num_seqs, vocab_size] int64: how often each token occurs in ``token_lists[k]``, in row
    ``seqs[k]``; rows of the other sequences are 0."""
    flat = [t for tokens in token_lists for t in tokens]
    owner = [s for s, tokens in zip(seqs, token_lists, strict=True) for _ in tokens]
    index = torch.tensor(owner, dtype=torch.long, device=device) * vocab_size + torch.tensor(
        flat, dtype=torch.long, device=device
    )
    return torch.bincount(index, minlength=num_seqs * vocab_size).view(num_seqs, vocab_size)
