"""What a server needs to know about the replicas serving beside it, when it is one of many.

A server run alone has none (``ServerState.cluster`` is None). A replica of a deployment that
runs several behind one endpoint (``hybridspec.deploy``, on Ray Serve) gets a ``Cluster``: the
app's lifespan starts it with a way to snapshot this replica's metrics, ``/metrics`` answers
every live replica's series, each labelled with its replica, and ``/health`` counts the
replicas up. The server imports nothing of Ray: this protocol is the whole hand-off.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

MetricsSnapshot = Callable[[], Awaitable[bytes]]  # this replica's exposition, refreshed


class Cluster(Protocol):
    async def start(self, snapshot: MetricsSnapshot) -> None:
        """Begin sharing this replica's metrics (``snapshot``) with the others."""

    async def stop(self) -> None:
        """Stop sharing; called once at shutdown."""

    async def metrics(self, own: bytes) -> bytes:
        """The exposition of every live replica, this one's (``own``, fresh) included."""

    async def replicas_up(self) -> int:
        """How many replicas have reported recently, this one included."""
