"""``PackedLinear``: a matmul whose weight is prepacked for oneDNN on CPU, row-invariant."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# oneDNN sums a row over more than this many input features in another order when the row is
# alone than when it has company (PackedLinear docstring).
ONE_ROW_MAX_IN_FEATURES = 1024


class PackedLinear:
    """``y = x @ W.T``, with ``W [out, in]`` reordered once into oneDNN's blocked layout on CPU.

    A plain ``F.linear`` streams a row-major weight through a generic kernel; oneDNN's prepacked
    weight is what its own GEMM reads best. Measured on the development CPU (one thread), the
    SmolLM2 LM head ``[49152, 576]`` for 1 and 9 rows: bfloat16 6.8 -> 4.2 ms and 8.8 -> 4.4 ms,
    float32 10.0 -> 7.9 ms and 20.6 -> 13.7 ms; the gate/up weight ``[3072, 576]``, 1 row:
    bfloat16 162 -> 73 us. Results are identical in bfloat16 and within 1e-6 relative in
    float32 (another summation order). Without oneDNN (CUDA, a float16 weight on a CPU without
    avx512_fp16, a torch without mkldnn) this is plain ``F.linear``, the reference it is tested
    against.

    Two rows go through as three (the first repeated, its result dropped): oneDNN's kernel for
    exactly two rows streams the weights slower than for one or three. Measured on the
    development CPU, a whole forward after a 300-token context, relative to one token: 2 tokens
    1.10 -> 1.03 (3 tokens: 1.01). Each row's result is unchanged (oneDNN's rows are
    independent), so outputs are identical.

    One row also goes through as three when the weight has more than
    ``ONE_ROW_MAX_IN_FEATURES`` input features: oneDNN then sums a lone row in another order
    than a row among 3 or more (measured: 6 to 49 of 128 rows differ in bfloat16 for 1088 to
    1536 features, none for 576 to 1024), so a token decoded alone would come out slightly
    different from the same token verified among drafts. With the padding every row is
    computed the same way in any call (``tests/engine/test_invariance.py``); it costs about
    8 us per call (SmolLM2's down projection, 1536 features).
    """

    __slots__ = ("packed", "pad_one_row", "weight")

    def __init__(self, weight: torch.Tensor, *, prepack: bool) -> None:
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        self.pad_one_row = weight.shape[1] > ONE_ROW_MAX_IN_FEATURES
        if prepack and weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
            try:  # batch-size hint 1: decode; measured as fast or faster for 9..256 rows too
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
                self.weight = None  # the runtime keeps only the packed copy
            except RuntimeError as exc:
                logger.debug(
                    "oneDNN cannot pack a %s weight, using F.linear: %s", weight.dtype, exc
                )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            rows = x.shape[0]
            if rows == 2 or (rows == 1 and self.pad_one_row):  # see the class docstring
                return self._packed(torch.cat((x, x[:1].expand(3 - rows, -1))))[:rows]
            return self._packed(x)
        assert self.weight is not None
        return F.linear(x, self.weight)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
