"""The ``eagle`` proposer and its feature-level draft heads, one module per concern:

- ``proposer``: ``EagleProposer`` (drafting for a batch from the target's hidden states) and
  finding the shipped head of a target (``find_head``, ``SHIPPED_HEADS``);
- ``config``: ``HeadConfig`` (``config.json``), ``TargetParts`` (what a head borrows from the
  target), ``target_fingerprint``, and ``DraftHead``, what the proposer drafts with;
- ``head``: ``EagleHead`` (fusion, one decoder layer, draft-vocabulary logits) and the
  ``DecoderLayerHead`` it shares with published heads;
- ``training``: the training-time unroll that ``hybridspec distill`` trains through;
- ``cache``: drafting's per-sequence keys and values (``HeadCache``, ``forward_cached``);
- ``int8``: ``Int8DraftLinear``, the head's matmuls in 8 bits on CPU (``quantize_matmuls``);
- ``files``: ``save_head``, ``load_head``;
- ``published``: EAGLE and EAGLE-3 heads published elsewhere, as ``DraftHead``s.
"""

from hybridspec.proposers.eagle.cache import HeadCache, forward_cached
from hybridspec.proposers.eagle.config import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    DraftHead,
    HeadConfig,
    TargetParts,
    target_fingerprint,
)
from hybridspec.proposers.eagle.files import load_head, save_head
from hybridspec.proposers.eagle.head import DecoderLayerHead, EagleHead
from hybridspec.proposers.eagle.int8 import Int8DraftLinear, quantize_matmuls
from hybridspec.proposers.eagle.proposer import (
    SHIPPED_HEADS,
    EagleProposer,
    find_head,
    target_parts,
)
from hybridspec.proposers.eagle.published import (
    Eagle3Head,
    is_eagle_checkpoint,
    load_eagle_checkpoint,
)

__all__ = [
    "CONFIG_FILE",
    "SHIPPED_HEADS",
    "WEIGHTS_FILE",
    "DecoderLayerHead",
    "DraftHead",
    "Eagle3Head",
    "EagleHead",
    "EagleProposer",
    "HeadCache",
    "HeadConfig",
    "Int8DraftLinear",
    "TargetParts",
    "find_head",
    "forward_cached",
    "is_eagle_checkpoint",
    "load_eagle_checkpoint",
    "load_head",
    "quantize_matmuls",
    "save_head",
    "target_fingerprint",
    "target_parts",
]
