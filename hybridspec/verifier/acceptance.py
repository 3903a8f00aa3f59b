"""Acceptance rules of speculative decoding, as pure tensor functions (no model code).

Paper symbols, as in Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding") and Chen et al. 2023 ("Accelerating Large Language Model Decoding with Speculative
Sampling"): ``p`` is the target's distribution and ``q`` the draft's, both under the request's
sampling transforms (``sampling.py``). Draft token d_i was drawn from q_i, or chosen
deterministically, which is verified exactly as a one-hot q_i. For one sequence with k drafts,
one target forward gives p_1 .. p_{k+1}, p_i being the target's distribution after the committed
tokens and d_1 .. d_{i-1}.

- **accepted tokens**: d_1 .. d_n, each of which passed ``u_i < min(1, p_i(d_i) / q_i(d_i))``
  with ``u_i ~ U[0, 1)``, where d_{n+1} is the first draft that failed (or n = k).
- **recovered token**: when d_{n+1} is rejected, a sample of the residual distribution
  ``norm(max(0, p_{n+1} - q_{n+1}))``, committed in its place.
- **bonus token**: when all k drafts are accepted, a sample of p_{k+1}, which the same target
  forward computed for free.

So every round commits n + 1 tokens, and each is distributed exactly as the target's (Theorem 1
of Leviathan et al.): ``P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y q(y) min(1, p(y)/q(y)))
norm(max(0, p - q))(x) = p(x)``. Greedy decoding is the case of a one-hot p at the target's
argmax: drafts are accepted while they equal the argmax, the first mismatch is replaced by the
argmax (the recovered token), and the argmax after d_k is the bonus token.

Dimensions: ``num_seqs`` sequences, ``total_num_drafts`` drafts over all of them (flat,
ragged, as ``layout.DraftLayout`` places them), ``num_rows = total_num_drafts + num_seqs`` target
positions, ``vocab_size``.
"""

from __future__ import annotations

import torch

from hybridspec.verifier.layout import DraftLayout


def count_accepted(accepted: torch.Tensor, layout: DraftLayout) -> torch.Tensor:
    """Length of each sequence's leading run of accepted drafts.

    ``accepted`` [total_num_drafts] bool -> num_accepted [num_seqs] int64. A draft after a
    rejected one is discarded even if it would pass: [T, F, T | T, T] gives [1, 2].
    """
    if accepted.numel() == 0:
        return layout.num_drafts_t.clone()
    # A rejected draft at position j caps its sequence at j; an accepted one caps nothing.
    cap = torch.where(accepted, layout.num_drafts_t[layout.seq_ids], layout.positions)
    return layout.num_drafts_t.scatter_reduce(0, layout.seq_ids, cap, reduce="amin")


def greedy_accept(
    target_token_ids: torch.Tensor, draft_token_ids: torch.Tensor, layout: DraftLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept while the target's argmax equals the draft.

    ``target_token_ids`` [num_rows] int64 (argmax of each target row), ``draft_token_ids``
    [total_num_drafts] -> (num_accepted [num_seqs], final_token_ids [num_seqs]): the final
    token is the argmax at the first mismatch (recovered) or after the last draft (bonus).
    """
    accepted = target_token_ids[layout.draft_rows] == draft_token_ids
    num_accepted = count_accepted(accepted, layout)
    return num_accepted, target_token_ids[layout.first_rows + num_accepted]


def accept_probability(
    target_probs_at_draft: torch.Tensor, draft_probs_at_draft: torch.Tensor | None
) -> torch.Tensor:
    """``min(1, p(d) / q(d))`` for each draft d; [total_num_drafts] -> same.

    ``draft_probs_at_draft`` None means deterministic drafts (one-hot q, q(d) = 1): the
    probability is then p(d). Where q(d) = 0 (the draft could not have proposed d) it is 1,
    never NaN.
    """
    if draft_probs_at_draft is None:
        return target_probs_at_draft
    p, q = target_probs_at_draft, draft_probs_at_draft
    return torch.where(p >= q, torch.ones_like(p), p / q.clamp(min=torch.finfo(q.dtype).tiny))


def rejection_accept(
    target_probs_at_draft: torch.Tensor,
    draft_probs_at_draft: torch.Tensor | None,
    uniforms: torch.Tensor,
    layout: DraftLayout,
) -> torch.Tensor:
    """Accept each draft iff ``u < min(1, p(d) / q(d))``; return num_accepted [num_seqs].

    ``uniforms`` [total_num_drafts] float64 in [0, 1), one per draft, drawn whether or not
    an earlier draft of the sequence was rejected (so the draw count never depends on luck).
    """
    accepted = uniforms < accept_probability(target_probs_at_draft, draft_probs_at_draft)
    return count_accepted(accepted, layout)


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """The recovered token's distribution ``norm(max(0, p - q))``; [n, vocab_size] -> same.

    A row where ``max(0, p - q)`` is all zero (p == q, where rejection has probability 0, or
    float rounding near it) falls back to p rather than dividing by zero.
    """
    return _normalise_or(torch.clamp(target_probs - draft_probs, min=0.0), target_probs)


def one_hot_residual_probs(
    target_probs: torch.Tensor, draft_token_ids: torch.Tensor
) -> torch.Tensor:
    """``residual_probs`` for a deterministic draft d (q = one-hot(d)), without building q.

    ``max(0, p - one_hot(d))`` is p with p(d) zeroed; renormalised. A row with p(d) = 1 (never
    rejected) falls back to p. ``target_probs`` [n, vocab_size], ``draft_token_ids`` [n].
    """
    residual = target_probs.scatter(1, draft_token_ids.unsqueeze(1), 0.0)
    return _normalise_or(residual, target_probs)


def _normalise_or(residual: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = residual.sum(dim=-1, keepdim=True)
    normalised = residual / total.clamp(min=torch.finfo(residual.dtype).tiny)
    return torch.where(total > 0, normalised, fallback)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row from one uniform per row.

    ``probs`` [n, vocab_size] (rows need not be normalised), ``uniforms`` [n] float64 in
    [0, 1) -> [n] int64. Token x is returned exactly for u in ``[cdf(x-1), cdf(x)) / cdf(V-1)``,
    an interval of length p(x) / sum(p), so a token of probability 0 is never returned. One
    uniform instead of V exponentials (the Gumbel-max way) keeps this cheap on a CPU.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # [n, vocab_size]
    # u < 1 makes u * total < total in IEEE arithmetic, so some cdf entry exceeds it.
    targets = uniforms.unsqueeze(1) * cdf[:, -1:]  # [n, 1]
    token_ids = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return token_ids.clamp_(max=probs.shape[-1] - 1)


def draw_uniforms(n: int, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` float64 uniforms in [0, 1) from ``generator``, on the device it draws on.

    Requests' generators live on the CPU (``engine.request.new_generator``), so that a seed
    draws the same numbers on every device; callers move the draws to their logits' device.
    None is torch's global CPU generator.
    """
    device = torch.device("cpu") if generator is None else generator.device
    return torch.rand(n, generator=generator, dtype=torch.float64, device=device)


def draw_token(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` [vocab_size], by inverse CDF (``sample_from_probs``) of one
    uniform from ``generator`` (``draw_uniforms``), as the verifier samples: a cumulative sum,
    where ``torch.multinomial`` costs milliseconds over a large vocabulary on a CPU."""
    uniform = draw_uniforms(1, generator).to(probs.device)
    return int(sample_from_probs(probs.unsqueeze(0), uniform)[0])
