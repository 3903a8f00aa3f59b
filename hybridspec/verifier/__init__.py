"""The lossless verifier: sampling transforms, acceptance rules and the batched verify step.

``verify(VerifyInput) -> VerifyOutput`` is the entry point; ``apply_controls`` (logit bias,
min_tokens, penalties: position-aware, counting the drafted prefix) then ``logits_to_probs``
(temperature, top-k, min-p, top-p) are what a sampling proposer uses to put its draft
distribution q under the same transforms as the target's p, which ``verify`` makes from the
target's logits the same way.
"""

from hybridspec.verifier.batch import VerifyInput, VerifyKind, VerifyOutput
from hybridspec.verifier.checks import check_proposal
from hybridspec.verifier.controls import apply_controls, check_logit_bias
from hybridspec.verifier.grammar import GrammarState
from hybridspec.verifier.layout import DraftLayout
from hybridspec.verifier.sampling import (
    greedy_token_ids,
    logits_to_logprobs,
    logits_to_probs,
    logits_to_probs_by_row,
)
from hybridspec.verifier.verify import verify

__all__ = [
    "DraftLayout",
    "GrammarState",
    "VerifyInput",
    "VerifyKind",
    "VerifyOutput",
    "apply_controls",
    "check_logit_bias",
    "check_proposal",
    "greedy_token_ids",
    "logits_to_logprobs",
    "logits_to_probs",
    "logits_to_probs_by_row",
    "verify",
]
