"""The n-gram and suffix kernels (numba), imported and warmed up on first use.

An engine builds every registered proposer, ``ngram`` and ``suffix`` among them, whether or not
a request will name them. Their tables take numpy only (``ngram_tables``); numba (about 100 MB
of resident libraries) and the kernels' warm-up (loading them from numba's disk cache, or
compiling them) come with the first sequence a proposer starts: a run that never drafts with
n-grams never imports numba, and the server's warm-up requests start both before its first
request does.
"""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def compiled_ngram() -> ModuleType:
    """``ngram_kernels``, imported (numba with it) and warmed up on the first call."""
    from hybridspec.proposers import ngram_kernels

    ngram_kernels.warmup()
    return ngram_kernels


@functools.cache
def compiled_suffix() -> ModuleType:
    """``suffix_kernels`` (which calls ``ngram_kernels``'s), imported and warmed up on the
    first call."""
    compiled_ngram()
    from hybridspec.proposers import suffix_kernels

    suffix_kernels.warmup()
    return suffix_kernels
