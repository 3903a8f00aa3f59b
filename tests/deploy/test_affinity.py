"""Rendezvous hashing: a session's replica order, the same everywhere, stable under deaths."""

from __future__ import annotations

from collections import Counter

from hybridspec.deploy.affinity import rendezvous_order

REPLICAS = [f"replica-{i}" for i in range(4)]
SESSIONS = [f"session-{i}" for i in range(400)]


def test_the_order_is_a_permutation_that_ignores_the_input_order() -> None:
    for session in SESSIONS[:20]:
        order = rendezvous_order(session, REPLICAS)
        assert sorted(order) == REPLICAS
        assert rendezvous_order(session, list(reversed(REPLICAS))) == order


def test_sessions_spread_over_the_replicas() -> None:
    firsts = Counter(rendezvous_order(session, REPLICAS)[0] for session in SESSIONS)
    assert set(firsts) == set(REPLICAS)
    assert min(firsts.values()) > len(SESSIONS) / len(REPLICAS) / 2


def test_a_dead_replica_moves_only_its_own_sessions() -> None:
    survivors = REPLICAS[1:]
    for session in SESSIONS:
        before = rendezvous_order(session, REPLICAS)
        after = rendezvous_order(session, survivors)
        assert after == [replica for replica in before if replica != REPLICAS[0]]
