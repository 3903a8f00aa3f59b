"""The request router of the deployment: least-loaded, sticky for a session.

Ray Serve's proxy routes each HTTP request to a replica through a ``RequestRouter``
(``ray.serve.request_router``). ``choose_replicas`` returns ranks of candidates; for each rank,
Ray reads from its cache (or probes) the replicas' queue lengths, the requests each holds, and
sends the request to the least loaded one that has room under ``max_ongoing_requests``, trying
the next rank when none has. Ray's default router draws two replicas at random, and reads a
cached length before probing an unknown one, so a burst can pile onto one replica. So:

- a request without a session hint gets the replicas from the least loaded, as the router
  last saw them (Ray counts up each request it sends, and probes a replica it has not seen
  lately before sending to it): the least-loaded replica with room;
- a request with a hint, the ``X-Session-Id`` header (Ray's session header, renamed by the
  environment variable ``RAY_SERVE_SESSION_ID_HEADER_KEY``), gets one rank per replica in its
  rendezvous order (``affinity``): its own replica while that replica is up and its engine has
  room (fewer than ``capacity`` requests, as last seen), so that a conversation's turns find
  the proposers' warm state (n-gram tables, draft caches); the next replica in its order only
  when that one is dead or full. When every replica is full the request goes to its own, whose
  engine answers 503 with Retry-After.

``max_ongoing_requests`` is set above the engine's capacity (``deploy.app``), so that the
engine's own queue, not the proxy, refuses work: the 503 is the server's OpenAI error.

Ray's proxy reads headers, not bodies; ``deploy.proxy`` turns a request's OpenAI ``user``
field into the session header before routing.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from hybridspec.deploy.affinity import rendezvous_order


class SessionAffinityRouter(RequestRouter):
    """Least-loaded routing; a request with a session hint goes to its session's replica."""

    def initialize_state(self, **kwargs: Any) -> None:
        """``capacity``: the requests a replica's engine holds (running and waiting)."""
        capacity = kwargs.get("capacity")
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity: expected None or an integer >= 1, got {capacity!r}")
        self._capacity: int | None = capacity

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Back off between rounds when no rank had room, rather than probing again at once.
            pending_request.routing_context.should_backoff = True
        session = pending_request.metadata.session_id if pending_request is not None else ""
        if session:
            by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
            order = [by_id[rid] for rid in rendezvous_order(session, list(by_id))]
            with_room = [replica for replica in order if not self._full(replica)]
            return [[replica] for replica in with_room or order]
        # Fewest requests held first, as this router last saw them (Ray counts each request it
        # sends); a replica not seen lately comes first, so Ray probes it. Ties in random order.
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))
        return [[replica] for replica in sorted(shuffled, key=self._load)]

    def _load(self, replica: RunningReplica) -> int:
        held = self.replica_queue_len_cache.get(replica.replica_id)
        return -1 if held is None else held

    def _full(self, replica: RunningReplica) -> bool:
        capacity = getattr(self, "_capacity", None)
        return capacity is not None and self._load(replica) >= capacity
