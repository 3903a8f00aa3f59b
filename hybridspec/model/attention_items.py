"""The row-invariant attention's work items (``attention_kernels``), apart from its numba
kernel: the block kernel's C attention (csrc/attention.c) reads the same items, so a runtime
that has it builds them without importing numba (``attention.numba_attend``).
"""

from __future__ import annotations

# Columns of the int32 ``items`` array: cache slot, key/value head, index of the item's first
# query token in ``q``, position of that token in its sequence, number of consecutive tokens.
ITEM_COLUMNS = 5
ITEM_SLOT, ITEM_HEAD, ITEM_TOKEN, ITEM_POSITION, ITEM_NUM_TOKENS = range(ITEM_COLUMNS)
