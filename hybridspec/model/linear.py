"""``PackedLinear``: a matmul whose weight is prepacked for oneDNN on CPU, row-invariant."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# oneDNN sums a row over more than this many input features in another order when the row is
# alone than when it has company (PackedLinear docstring).
ONE_ROW_MAX_IN_FEATURES = 1024
# oneDNN splits the sum over more than ONE_ROW_MAX_IN_FEATURES input features into chunks, in
# another order, once a block of rows it takes at a time times the input features exceeds about
# 200,000 (130 rows of 1536 features, 25 of 8192, on one thread; its blocks hold at most about
# 192 rows, so never at 1024 features or fewer): a row's result would then depend on how many
# rows came with it. Calls of at most this many elements (rows times input features) never split.
MAX_CALL_ELEMENTS = 192 * 1024


class PackedLinear:
    """``y = x @ W.T``, with ``W [out, in]`` reordered once into oneDNN's blocked layout on CPU.

    A plain ``F.linear`` streams a row-major weight through a generic kernel; oneDNN's prepacked
    weight is what its own GEMM reads best, so the same product takes less time. Results are
    identical in bfloat16 and within 1e-6 relative in float32 (another summation order).
    Without oneDNN (CUDA, a float16 weight on a CPU without avx512_fp16, a torch without mkldnn)
    this is plain ``F.linear``, the reference it is tested against.

    Two rows go through as three (the first repeated, its result dropped): oneDNN's kernel for
    exactly two rows streams the weights slower than for one or three. Each row's result is
    unchanged (oneDNN's rows are independent), so outputs are identical.

    One row also goes through as three when the weight has more than
    ``ONE_ROW_MAX_IN_FEATURES`` input features: oneDNN then sums a lone row in another order
    than a row among 3 or more, so a token decoded alone would come out slightly different from
    the same token verified among drafts. With the padding every row is computed the same way
    in any call (``tests/model/test_invariance.py``), for little beside the matmul itself.

    Where the weight has more than ``ONE_ROW_MAX_IN_FEATURES`` input features, many rows go
    through in calls of at most ``max_rows`` (``MAX_CALL_ELEMENTS`` over the input features: 128
    rows of 1536 features, 24 of 8192): in a larger call oneDNN may sum a row's input features
    in chunks, in another order than for the same row in a small call, so a prompt's tokens,
    and a decode token batched beside them, would come out differently for each split of the
    prompt into chunks. Worked example, 1536 input features and 300 rows: calls of 128, 128 and
    44 rows.
    """

    __slots__ = ("max_rows", "packed", "pad_one_row", "weight")

    def __init__(self, weight: torch.Tensor, *, prepack: bool) -> None:
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        self.pad_one_row = weight.shape[1] > ONE_ROW_MAX_IN_FEATURES
        self.max_rows = max(1, MAX_CALL_ELEMENTS // weight.shape[1]) if self.pad_one_row else None
        if prepack and weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
            try:  # batch-size hint 1 (decode); it serves larger batches as well
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
                self.weight = None  # the runtime keeps only the packed copy
            except RuntimeError as exc:
                logger.debug(
                    "oneDNN cannot pack a %s weight, using F.linear: %s", weight.dtype, exc
                )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            rows = x.shape[0]
            step = self.max_rows
            if step is not None and rows > step:  # see the class docstring
                return torch.cat([self(x[i : i + step]) for i in range(0, rows, step)])
            if rows == 2 or (rows == 1 and self.pad_one_row):  # see the class docstring
                return self._packed(torch.cat((x, x[:1].expand(3 - rows, -1))))[:rows]
            return self._packed(x)
        assert self.weight is not None
        return F.linear(x, self.weight)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
