"""What one benchmark trial measured, as plain frozen records (the harness's output).

``generated`` tokens count the EOS token when one ends a request (the engine's statistics and
``generate()`` both count it), so tokens/s compare like with like; ``token_ids`` leave it out,
for comparing outputs. Dimensions: ``K`` the largest number of drafts proposed in one round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Speculation:
    """What one request generated and how its rounds went."""

    token_ids: tuple[int, ...]  # generated ids, EOS excluded
    num_generated: int  # generated tokens, EOS included
    target_forwards: int  # target forwards that committed tokens (prefill-only chunks excluded)
    num_drafts: int  # proposed over all rounds
    num_accepted_tokens: int  # accepted drafts (bonus and recovered tokens excluded)
    accepted_per_position: tuple[int, ...] | None = None  # [K]; None: not observable
    proposed_per_position: tuple[int, ...] | None = None  # [K]


@dataclass(frozen=True, slots=True)
class Measurement:
    """One timed unit: a single request, or several run concurrently (in request order)."""

    requests: tuple[Speculation, ...]
    # Wall time, first request queued to last token finished, prefill included; of a loop run
    # in lockstep with another (``Record.beside``), the seconds of its own turns.
    elapsed_s: float
    forward_s: float | None  # of which inside the target model's forward; None: not observed
    # Of which until the first token (own turns too, as above); None: not observed.
    first_token_s: float | None = None

    @property
    def num_generated(self) -> int:
        return sum(r.num_generated for r in self.requests)


@dataclass(frozen=True, slots=True)
class Record:
    """One measurement, labelled with what was run."""

    method: str
    temperature: float
    repeat: int
    prompt_ids: tuple[str, ...]  # one prompt, or the M of a concurrent trial, in order
    category: str | None  # None: concurrent requests of mixed categories
    measurement: Measurement
    load_average: float  # the machine's 1-minute load average when the trial ended
    concurrency: int = 1  # most requests in the engine at once: 1, or the N of a concurrent trial
    # The method whose closed loop ran in lockstep with this one's, on another engine
    # (``harness``, "Pairs"); None: the loop ran alone.
    beside: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for request in data["measurement"]["requests"]:
            request.pop("token_ids")  # bulky; outputs are compared in the summary instead
        return data


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (or one ends); None if equal.

    Example: [1, 2, 3] and [1, 5, 3] differ at 1; [1, 2] and [1, 2, 3] at 2.
    """
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # unequal lengths are the point
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
