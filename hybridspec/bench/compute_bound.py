"""The machine's int8 compute bound beside a verified row's measured cost: whether one more row
of a verify forward could cost less on this hardware (``hybridspec bench oracle``).

``peak_rate`` measures int8 multiply-accumulates per second on torch's threads with the
kernel library's ``hs_int8_peak`` (``csrc/peak.c``): the matmul's own dot instruction
(AVX512-VNNI, AVX2 or portable C, as the library was compiled) on registers, many independent
sums per thread, no memory read: the most the matmul's arithmetic could run at. A verified row
multiplies every matrix of the target once: ``macs_per_row`` of them (the rows times the
columns of the matrices ``memory_bound.bytes_per_token`` counts). ``ComputeBound`` sets the
measured cost of one more row (seconds) against the time those multiplies take at the peak,
and gives the ideal speedup at each alpha if a row cost only that:
``t(n) = t(1) + (n - 1) * macs_per_row / peak``.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hybridspec.bench.memory_bound import matrices
from hybridspec.model import LlamaWeights, block_kernel

_CALIBRATE_STEPS = 10_000  # the first calls' size (doubled until one is long enough)
_TIMED_S = 0.2  # each timed call's rough length


def peak_rate(repeats: int = 3) -> float | None:
    """Int8 multiply-accumulates per second on torch's threads, the best of ``repeats`` timed
    calls of about 0.2 s each; None without the kernel library."""
    kernel = block_kernel()
    if kernel is None:
        return None
    if repeats < 1:
        raise ValueError(f"repeats: expected at least 1, got {repeats}")
    function = kernel.lib.hs_int8_peak
    function.argtypes = [ctypes.c_int64, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64)]
    function.restype = ctypes.c_int64
    checksum = ctypes.c_int64(0)

    def timed(steps: int) -> tuple[int, float]:
        start = time.perf_counter()
        macs = int(function(steps, 0x01010101, ctypes.byref(checksum)))
        return macs, time.perf_counter() - start

    steps, seconds = _CALIBRATE_STEPS, 0.0
    while seconds < _TIMED_S / 10:  # long enough that waking the threads is no part of it
        steps *= 2
        _, seconds = timed(steps)
    steps = int(steps * _TIMED_S / seconds)
    return max(macs / seconds for macs, seconds in (timed(steps) for _ in range(repeats)))


def macs_per_row(weights: LlamaWeights) -> int:
    """Multiply-accumulates of one row through every matrix of the target (rows x columns)."""
    return sum(rows * cols for rows, cols in (m.shape for m in matrices(weights)))


@dataclass(frozen=True, slots=True)
class ComputeBound:
    macs_per_row: int  # every matrix of the target, once
    decode_seconds: float  # a one-row forward's measured seconds, t(1)
    row_seconds: float  # one more verified row's measured seconds
    peak_macs_per_s: float  # measured, on ``threads``
    threads: int

    @property
    def row_rate(self) -> float:
        """The multiply-accumulates per second a row's measured cost implies."""
        return self.macs_per_row / self.row_seconds if self.row_seconds > 0 else float("inf")

    @property
    def peak_row_cost(self) -> float:
        """One more row's cost at the peak, in one-row forwards."""
        return self.macs_per_row / self.peak_macs_per_s / self.decode_seconds

    def verify_cost(self, rows: Iterable[int]) -> dict[int, float]:
        """``t(n) / t(1)`` for each of ``rows`` if a row cost only its multiplies at the peak."""
        return {n: 1.0 + (n - 1) * self.peak_row_cost for n in rows}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self, ideals: dict[float, tuple[int, float]]) -> str:
        """The bound, with ``ideals`` (alpha -> best K and speedup at ``verify_cost``)."""
        disturbed = " (a row timed no dearer than none: disturbed)" if self.row_seconds <= 0 else ""
        at_peak = ", ".join(f"alpha {a:.2f} {s:.2f}x (K={k})" for a, (k, s) in ideals.items())
        return (
            f"compute bound (measured): {self.macs_per_row / 1e9:.2f} GMAC per row; one more row "
            f"costs {self.row_seconds * 1e3:.1f} ms of a {self.decode_seconds * 1e3:.1f} ms "
            f"decode = {self.row_rate / 1e9:.0f} GMAC/s, of an int8 peak of "
            f"{self.peak_macs_per_s / 1e9:.0f} GMAC/s ({self.threads} threads): "
            f"{self.row_rate / self.peak_macs_per_s:.0%}{disturbed}; a row at the peak costs "
            f"{self.peak_row_cost:.3f} of a decode, and the ideal would be {at_peak}"
        )


def measure(weights: object, decode_seconds: float, row_seconds: float) -> ComputeBound | None:
    """The bound for a target's ``weights`` (native ones only) at the measured seconds of a
    one-row forward and of one more row; None without native weights or the kernel."""
    if not isinstance(weights, LlamaWeights):
        return None
    peak = peak_rate()
    if peak is None:
        return None
    return ComputeBound(
        macs_per_row(weights), decode_seconds, row_seconds, peak, torch.get_num_threads()
    )
