"""Proposer names: the process-wide registry new engines start from, and per-registry copies."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from hybridspec import Proposal, Proposer, ProposeRequest, register_proposer
from hybridspec.errors import InvalidRequestError
from hybridspec.proposers import default_registry
from hybridspec.proposers import registry as registry_module


class Silent(Proposer):
    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        return [Proposal(()) for _ in requests]


@pytest.fixture
def plugin_name() -> Iterator[str]:
    yield "test-plugin"
    registry_module._process_registry().unregister("test-plugin")


def test_builtin_proposers_are_registered() -> None:
    assert {"none", "ngram", "draft"} <= set(default_registry().names())


def test_register_proposer_reaches_registries_made_later(plugin_name: str) -> None:
    before = default_registry()
    register_proposer(plugin_name, Silent)
    assert plugin_name in default_registry()
    assert plugin_name not in before  # a registry is a copy: engines already built keep theirs


def test_a_taken_or_malformed_name_is_refused(plugin_name: str) -> None:
    register_proposer(plugin_name, Silent)
    with pytest.raises(InvalidRequestError, match="already registered"):
        register_proposer(plugin_name, Silent)
    register_proposer(plugin_name, Silent, replace=True)
    with pytest.raises(InvalidRequestError, match="non-empty name"):
        register_proposer("no spaces", Silent)
