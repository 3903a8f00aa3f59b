"""Which replica a session sticks to: rendezvous (highest-random-weight) hashing.

Every replica gets a weight from the session key and its own id; the session goes to the
heaviest. Every router computes the same order from the same replicas (a cluster runs one
proxy, so one router, per node), and when a replica dies only the sessions it held move: the
others keep their heaviest replica. Kept apart from ``routing`` so that it needs no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


def rendezvous_order(session: str, replica_ids: Sequence[str]) -> list[str]:
    """``replica_ids`` from the session's preferred replica to its least preferred."""
    return sorted(replica_ids, key=lambda rid: (-_weight(session, rid), rid))


def _weight(session: str, replica_id: str) -> int:
    return xxhash.xxh64_intdigest(f"{len(session)}:{session}|{replica_id}".encode())
