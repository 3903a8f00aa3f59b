"""``hybridspec serve --replicas N``: its options, each replica's CPU share, bad counts."""

from __future__ import annotations

import pytest

from hybridspec.cli import build_parser, server_config
from hybridspec.errors import InvalidRequestError

local = pytest.importorskip("hybridspec.deploy.local", exc_type=ImportError)


def test_replicas_options() -> None:
    args = build_parser().parse_args(["serve", "--replicas", "3", "--ray-address", "auto"])
    assert (args.replicas, args.ray_address) == (3, "auto")
    plain = build_parser().parse_args(["serve"])
    assert (plain.replicas, plain.ray_address) == (None, "local")
    assert server_config(args) == server_config(plain)  # the replicas' server is the same


@pytest.mark.parametrize(
    ("replicas", "cpus", "share"), [(2, 2, 1), (2, 4, 2), (3, 8, 2), (1, 2, 2), (4, 2, 0.5)]
)
def test_each_replica_gets_an_equal_share_of_the_cpus(
    replicas: int, cpus: int, share: float
) -> None:
    assert local.replica_cpus(replicas, cpus) == share


@pytest.mark.parametrize("replicas", [0, -1])
def test_a_bad_replica_count_is_refused_before_ray_starts(replicas: int) -> None:
    with pytest.raises(InvalidRequestError, match="replicas"):
        local.serve_replicas(server_config(build_parser().parse_args(["serve"])), replicas)
