"""The replicas of one deployment, as each replica's server sees them (``server.cluster``).

Every replica reports its metrics exposition every ``REPORT_PERIOD_S`` to one small actor per
deployment, ``ReplicaBoard`` (no CPU reserved; named, detached, so that it outlives any one
replica and is shared by all). ``/metrics`` on any replica answers the board's recent reports
merged (``exposition``), its own fresh; ``/health`` counts the replicas that reported within
``STALE_AFTER_S``: a replica that died drops out of both within seconds, and the one Ray starts
in its place joins at its first report.

Glossary: replica id, Ray Serve's unique id of a replica (``ReplicaID.unique_id``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import ray

from hybridspec.deploy.exposition import merge_expositions
from hybridspec.server.cluster import MetricsSnapshot

logger = logging.getLogger(__name__)

REPORT_PERIOD_S = 1.0
STALE_AFTER_S = 3.5  # three reports missed
BOARD_NAMESPACE = "hybridspec"


class ReplicaBoard:
    """The latest exposition of each replica, with when it came (the board's own clock)."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, bytes]] = {}

    def report(self, replica_id: str, exposition: bytes) -> None:
        self._reports[replica_id] = (time.monotonic(), exposition)

    def withdraw(self, replica_id: str) -> None:
        self._reports.pop(replica_id, None)

    def recent(self) -> dict[str, bytes]:
        """The expositions reported within ``STALE_AFTER_S``; older ones are forgotten."""
        now = time.monotonic()
        self._reports = {
            rid: (at, text)
            for rid, (at, text) in self._reports.items()
            if now - at <= STALE_AFTER_S
        }
        return {rid: text for rid, (_, text) in self._reports.items()}


def board_name(app_name: str, deployment: str) -> str:
    return f"replicas:{app_name}:{deployment}"


class RayCluster:
    """``server.cluster.Cluster`` for a replica of a Ray Serve deployment."""

    def __init__(self, board_name: str, replica_id: str) -> None:
        self.replica_id = replica_id
        remote_board: Any = ray.remote(num_cpus=0)(ReplicaBoard)
        self._board = remote_board.options(
            name=board_name, namespace=BOARD_NAMESPACE, lifetime="detached", get_if_exists=True
        ).remote()
        self._task: asyncio.Task[None] | None = None

    async def start(self, snapshot: MetricsSnapshot) -> None:
        await self._board.report.remote(self.replica_id, await snapshot())
        self._task = asyncio.create_task(self._report_every_period(snapshot))

    async def _report_every_period(self, snapshot: MetricsSnapshot) -> None:
        while True:
            await asyncio.sleep(REPORT_PERIOD_S)
            try:
                await self._board.report.remote(self.replica_id, await snapshot())
            except Exception:  # the board restarts with the cluster; report again next period
                logger.warning("could not report this replica's metrics", exc_info=True)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self._board.withdraw.remote(self.replica_id)

    async def metrics(self, own: bytes) -> bytes:
        reports: dict[str, bytes] = await self._board.recent.remote()
        return merge_expositions({**reports, self.replica_id: own})

    async def replicas_up(self) -> int:
        reports: dict[str, bytes] = await self._board.recent.remote()
        return len({*reports, self.replica_id})
