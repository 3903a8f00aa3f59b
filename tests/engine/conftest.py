"""Fixtures of the engine tests: the tiny target of ``test_engine`` and a draft close to it."""

from __future__ import annotations

import pytest

from hybridspec.model import LoadedModel
from tests.engine.test_engine import tiny_loaded


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_loaded(0)


@pytest.fixture(scope="module")
def draft(target: LoadedModel) -> LoadedModel:
    return tiny_loaded(1, noise_from=target)
