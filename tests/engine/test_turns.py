"""Fair turns across tenants in admission (``engine.turns``), on hand-built requests."""

from __future__ import annotations

import pytest

from hybridspec.config import TenantConfig
from hybridspec.engine.request import GenerationParams, Request
from hybridspec.engine.scheduler import Scheduler
from hybridspec.engine.turns import Turns
from hybridspec.errors import CapacityError, TenantLimitError
from tests.engine.test_scheduler import make_request


def scheduler(**tenants: int) -> Scheduler:
    return Scheduler(max_queue_size=64, prefill_chunk_size=16, turns=Turns(TenantConfig(**tenants)))


def add(scheduler: Scheduler, seq_id: int, tenant: str | None) -> None:
    scheduler.add(make_request(seq_id, 3, GenerationParams(tenant=tenant)), num_free_slots=0)


def tenants(requests: list[Request]) -> list[str | None]:
    return [r.params.tenant for r in requests]


def test_a_burst_does_not_hold_another_tenants_request_back() -> None:
    """A's 6 requests then B's 1: with 2 free slots, B takes the second, not the seventh."""
    s = scheduler()
    for i in range(6):
        add(s, i, "A")
    add(s, 6, "B")
    assert tenants(s.admit(2)) == ["A", "B"]
    assert tenants(s.admit(3)) == ["A", "A", "A"]


def test_tenants_alternate_from_the_least_recently_admitted() -> None:
    s = scheduler()
    for i in range(3):
        add(s, i, "A")
    for i in range(3, 6):
        add(s, i, "B")
    add(s, 6, None)  # requests without a tenant are one tenant
    assert tenants(s.admit(7)) == ["A", "B", None, "A", "B", "A", "B"]


def test_one_tenant_alone_is_first_come_first_served() -> None:
    s = scheduler()
    for i in range(4):
        add(s, i, "A")
    assert [r.seq_id for r in s.admit(4)] == [0, 1, 2, 3]


def test_the_reserved_slot_goes_to_a_tenant_with_nothing_running() -> None:
    """4 slots, 1 reserved: A's burst runs 3; the fourth waits for B, who takes it at once."""
    s = scheduler(reserved_slots=1)
    for i in range(8):
        add(s, i, "A")
    assert tenants(s.admit(4)) == ["A", "A", "A"]
    assert s.admit(1) == []  # A already runs: the last slot is not A's
    add(s, 8, "B")
    assert tenants(s.admit(1)) == ["B"]


def test_a_tenant_at_its_running_bound_is_passed_over() -> None:
    s = scheduler(max_running=2)
    for i in range(4):
        add(s, i, "A")
    add(s, 4, "B")
    assert tenants(s.admit(4)) == ["A", "B", "A"]
    assert s.admit(1) == []
    s.remove(s.running[0])  # one of A's ends
    assert tenants(s.admit(1)) == ["A"]


def test_a_tenant_beyond_its_queue_bound_is_refused_with_a_tenant_limit() -> None:
    s = scheduler(max_queued=2)
    add(s, 0, "A")
    add(s, 1, "A")
    with pytest.raises(TenantLimitError, match="requests waiting") as refused:
        add(s, 2, "A")
    assert isinstance(refused.value, CapacityError)  # a retry later may succeed
    add(s, 3, "B")  # another tenant's queue is its own
    assert len(s.waiting) == 3


def test_bounds_are_checked() -> None:
    for bad in ({"max_running": 0}, {"max_queued": -1}, {"reserved_slots": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TenantConfig(**bad)
