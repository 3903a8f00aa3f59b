"""The lossless verifier: sampling transforms, acceptance rules and the batched verify step.

``verify(VerifyInput) -> VerifyOutput`` is the entry point; ``logits_to_probs`` is what a sampling
proposer uses to put its draft distribution q under the same transforms as the target's p.
"""

from hybridspec.verifier.batch import VerifyInput, VerifyKind, VerifyOutput
from hybridspec.verifier.checks import check_proposal
from hybridspec.verifier.sampling import (
    greedy_token_ids,
    logits_to_logprobs,
    logits_to_probs,
    logits_to_probs_by_row,
)
from hybridspec.verifier.verify import verify

__all__ = [
    "VerifyInput",
    "VerifyKind",
    "VerifyOutput",
    "check_proposal",
    "greedy_token_ids",
    "logits_to_logprobs",
    "logits_to_probs",
    "logits_to_probs_by_row",
    "verify",
]
