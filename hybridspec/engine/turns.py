"""Fair turns: which waiting request the scheduler admits next when several tenants wait.

A request's tenant is ``GenerationParams.tenant`` (the server's API key's; requests without one
are one tenant, ``None``). First come, first served lets one tenant's burst decide everyone's
latency: 32 requests queued ahead of another tenant's one hold it for every slot they take
before it. Here each admission goes to the tenant that waited longest since its last turn
(``Turns.pick``): a tenant that was idle (nothing running or waiting) since its last turn
comes first, then the others from the least recently admitted, each to its oldest waiting
request.
So a burst costs another tenant at most the wait for one slot, and ``TenantConfig``'s
``reserved_slots`` remove even that: the last free slots go only to a tenant with nothing
running, which the burst's tenant never is.

Within a tenant, requests keep their order: a prompt whose choices need more slots than are
free holds back its tenant's later requests, and, when it is that tenant's turn, everyone's
(else a large group would starve behind single requests). A tenant at its ``max_running`` is
passed over until one of its requests ends.

Worked example, 9 slots, ``reserved_slots = 1``: tenant A sends 32 requests, 8 run (the ninth
slot is kept: A has requests running). Tenant B sends one: it has nothing running, so it takes
the ninth slot at the next step. When one of A's requests ends, the freed slot goes to A's next
(B waits for no slot of A's unless B sent more than one at once).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from hybridspec.config import TenantConfig
from hybridspec.engine.request import Request
from hybridspec.errors import TenantLimitError


def entry_size(head: Request) -> int:
    """Slots a queue entry needs: its prompt's choices, all admitted together."""
    return 1 if head.group is None else len(head.group.requests)


def is_entry(request: Request) -> bool:
    """Whether ``request`` heads a queue entry (a single request, or a group's source)."""
    return request.group is None or request.group.source is request


class Turns:
    """Tenants' turns in admission and their per-tenant bounds (module docstring)."""

    def __init__(self, config: TenantConfig | None = None) -> None:
        self.config = config if config is not None else TenantConfig()
        self._last_turn: dict[str | None, int] = {}  # tenant -> the admission that served it
        self._clock = 0

    def check_queue(self, waiting: Iterable[Request], new: list[list[Request]]) -> None:
        """TenantLimitError when queueing the entries ``new`` would leave a tenant more
        waiting entries than ``max_queued``."""
        most = self.config.max_queued
        if most is None:
            return
        counts = Counter(r.params.tenant for r in waiting if is_entry(r))
        for choices in new:
            tenant = choices[0].params.tenant
            counts[tenant] += 1
            if counts[tenant] > most:
                who = "the anonymous tenant" if tenant is None else f"tenant {tenant!r}"
                raise TenantLimitError(
                    f"{who} already has {most} requests waiting for a batch slot "
                    "(the per-tenant limit); retry later"
                )

    def pick(
        self, waiting: Iterable[Request], running: Iterable[Request], num_free_slots: int
    ) -> Request | None:
        """The queue entry to admit next into ``num_free_slots`` free slots, or None."""
        heads: dict[str | None, Request] = {}
        for request in waiting:  # each tenant's oldest entry, tenants in queue order
            if is_entry(request):
                heads.setdefault(request.params.tenant, request)
        if not heads:
            return None
        num_running = Counter(r.params.tenant for r in running)
        for idle in [t for t in self._last_turn if t not in heads and t not in num_running]:
            del self._last_turn[idle]  # it comes first when it sends again: it waited for none
        most = self.config.max_running
        for tenant in sorted(heads, key=lambda t: self._last_turn.get(t, -1)):
            head, held = heads[tenant], num_running[tenant]
            size = entry_size(head)
            if most is not None and held > 0 and held + size > most:
                continue  # at its bound: its turn passes
            if size > num_free_slots:
                return None  # its turn, and not enough slots: it holds the rest back
            if held > 0 and num_free_slots - size < self.config.reserved_slots:
                continue  # the reserved slots are for a tenant with nothing running
            return head
        return None

    def admitted(self, tenant: str | None) -> None:
        """Record ``tenant``'s turn: it goes behind every tenant waiting."""
        self._clock += 1
        self._last_turn[tenant] = self._clock
