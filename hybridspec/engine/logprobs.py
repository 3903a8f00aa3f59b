"""Log-probabilities of the tokens a request returns and of its prompt, from the target alone.

A request that asks (``GenerationParams.logprobs``, ``prompt_logprobs``) gets, for each token,
its log-probability and the ``num_top`` most likely tokens with theirs, under the distribution
the request samples from at that position (``verifier.logits_to_logprobs``: the request's
temperature, top-k and top-p; for a greedy request the plain log-softmax). Speculation does
not change them: the logits row that produced a committed token is the target's row at that
position, whatever was drafted, and the verifier already computed it.

Each forward's rows are reduced at once to ``Logprobs`` (a few numbers per position), so a
long prompt never holds ``[prompt_len, vocab_size]``. Requests that ask for nothing cost
nothing: the forward computes no extra row for them and nothing here runs.

Dimensions: ``num_tokens`` positions scored, ``num_top`` alternatives per position.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from hybridspec.types import SamplingParams
from hybridspec.verifier import logits_to_logprobs


@dataclass(frozen=True, slots=True)
class Logprobs:
    """Scored tokens: each one's log-probability and the most likely tokens at its position.

    ``-inf`` marks a token that the request's top-k or top-p filter leaves out. Ties among the
    alternatives are in no particular order.
    """

    token_ids: torch.Tensor  # [num_tokens] int64, the tokens scored
    logprobs: torch.Tensor  # [num_tokens] float32, log p of each
    top_token_ids: torch.Tensor  # [num_tokens, num_top] int64, most likely first
    top_logprobs: torch.Tensor  # [num_tokens, num_top] float32

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_top(self) -> int:
        return int(self.top_token_ids.shape[1])

    def __getitem__(self, index: slice) -> Logprobs:
        """The positions ``index`` (a slice) of these."""
        return Logprobs(
            self.token_ids[index],
            self.logprobs[index],
            self.top_token_ids[index],
            self.top_logprobs[index],
        )

    def rows(self) -> Iterator[tuple[int, float, list[int], list[float]]]:
        """Per scored token, as Python values: its id, its log-probability, and the ids and
        log-probabilities of its alternatives."""
        yield from zip(
            self.token_ids.tolist(),
            self.logprobs.tolist(),
            self.top_token_ids.tolist(),
            self.top_logprobs.tolist(),
            strict=True,
        )

    def to_dict(self) -> dict[str, list[int] | list[float] | list[list[int]] | list[list[float]]]:
        """Plain lists, for JSON."""
        return {
            "token_ids": self.token_ids.tolist(),
            "logprobs": self.logprobs.tolist(),
            "top_token_ids": self.top_token_ids.tolist(),
            "top_logprobs": self.top_logprobs.tolist(),
        }

    @staticmethod
    def empty(num_top: int) -> Logprobs:
        return Logprobs(
            torch.empty(0, dtype=torch.long),
            torch.empty(0),
            torch.empty(0, num_top, dtype=torch.long),
            torch.empty(0, num_top),
        )

    @staticmethod
    def cat(parts: Sequence[Logprobs], num_top: int) -> Logprobs:
        """``parts`` one after another (``empty(num_top)`` when there are none)."""
        if not parts:
            return Logprobs.empty(num_top)
        if len(parts) == 1:
            return parts[0]
        return Logprobs(
            torch.cat([p.token_ids for p in parts]),
            torch.cat([p.logprobs for p in parts]),
            torch.cat([p.top_token_ids for p in parts]),
            torch.cat([p.top_logprobs for p in parts]),
        )


def score(
    logits: torch.Tensor, token_ids: Sequence[int], params: SamplingParams, num_top: int
) -> Logprobs:
    """Score ``token_ids[i]`` against row ``i`` of ``logits`` [num_tokens, vocab_size]: the row
    of the position before it, the one whose forward predicted it."""
    assert logits.shape[0] == len(token_ids), (logits.shape, len(token_ids))
    if not token_ids:
        return Logprobs.empty(num_top)
    ids = torch.tensor(token_ids, dtype=torch.long)
    logprobs = logits_to_logprobs(logits, params)
    chosen = logprobs.gather(1, ids.to(logprobs.device).unsqueeze(1)).squeeze(1)
    top = logprobs.topk(num_top, dim=-1)
    return Logprobs(ids, chosen.float().cpu(), top.indices.cpu(), top.values.float().cpu())


@dataclass(eq=False)
class LogprobParts:
    """What one request's ``logprobs`` and ``prompt_logprobs`` ask for, scored so far: the
    committed tokens' parts, the prompt's parts (in position order), and whether an output has
    carried the prompt's yet (once complete, they go out once)."""

    sampling: SamplingParams
    num_top: int | None  # ``GenerationParams.logprobs``: None asks for none
    num_prompt_top: int | None  # ``GenerationParams.prompt_logprobs``
    prompt_token_ids: Sequence[int]
    committed: list[Logprobs] = field(default_factory=list)
    prompt: list[Logprobs] = field(default_factory=list)
    prompt_sent: bool = False

    def score_prompt(self, logits: torch.Tensor, start: int) -> None:
        """Score the prompt tokens after positions ``start, start + 1, ...`` against
        ``logits`` [num_rows, vocab_size], the rows of the prompt tokens at those positions."""
        assert self.num_prompt_top is not None
        ids = self.prompt_token_ids[start + 1 : start + 1 + logits.shape[0]]
        self.prompt.append(score(logits, ids, self.sampling, self.num_prompt_top))

    def score_committed(self, logits: torch.Tensor, token_ids: Sequence[int]) -> Logprobs | None:
        """Score the tokens a commit consumed against ``logits`` [len(token_ids), vocab_size],
        the rows that produced them; None when the request asks for no logprobs."""
        if self.num_top is None:
            return None
        scored = score(logits, token_ids, self.sampling, self.num_top)
        self.committed.append(scored)
        return scored

    def committed_logprobs(self) -> Logprobs | None:
        """Every committed token's, joined; None when the request asks for none."""
        return None if self.num_top is None else Logprobs.cat(self.committed, self.num_top)

    def prompt_logprobs(self) -> Logprobs | None:
        """The prompt's log-probabilities once every token but the first is scored, else None."""
        num_top = self.num_prompt_top
        scored = sum(len(part) for part in self.prompt)
        if num_top is None or scored < len(self.prompt_token_ids) - 1:
            return None
        joined = Logprobs.cat(self.prompt, num_top)
        self.prompt[:] = [joined]
        return joined

    def take_prompt_logprobs(self) -> Logprobs | None:
        """``prompt_logprobs()`` the first time they are complete, then None: an output
        carries them once."""
        if self.prompt_sent:
            return None
        scored = self.prompt_logprobs()
        self.prompt_sent = scored is not None
        return scored
