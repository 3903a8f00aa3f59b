"""Fixtures of the engine's tests: a tiny target, a draft that mostly agrees with it, an engine."""

from __future__ import annotations

import pytest

from hybridspec import Engine
from hybridspec.model.loader import LoadedModel
from tests.engine.tiny import make_engine, tiny_loaded


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_loaded(0)


@pytest.fixture(scope="module")
def draft(target: LoadedModel) -> LoadedModel:
    return tiny_loaded(1, noise_from=target)


@pytest.fixture(scope="module")
def engine(target: LoadedModel, draft: LoadedModel) -> Engine:
    return make_engine(target, draft)
