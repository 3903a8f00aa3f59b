"""Fixtures of the server tests: apps serving the shared tiny random Llama, in-process or on
a loopback socket.

The model (``tests.conftest.save_tiny_llama``) is saved once per session and loaded once; each
app gets a fresh Engine (its own KV cache) over the loaded weights.
"""

from __future__ import annotations

import contextlib
import gc
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from hybridspec.config import EngineConfig, ModelConfig
from hybridspec.engine import Engine
from hybridspec.model.loader import LoadedModel, load_model
from hybridspec.server import ServerConfig, create_app
from tests.conftest import save_tiny_llama

TINY_MAX_SEQ_LEN = 256  # the shared tiny Llama's max_position_embeddings
TINY_MODEL_NAME = "tiny-llama"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("server-tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> LoadedModel:
    return load_model(ModelConfig(str(tiny_model_dir), dtype="float32"))


def tiny_engine_config(tiny_model_dir: Path, **overrides: object) -> EngineConfig:
    target = ModelConfig(str(tiny_model_dir), dtype="float32", max_num_seqs=4)
    # drafts that never depend on timing (measured costs: tests/engine/test_proposer_costs.py)
    options: dict[str, object] = {
        "target": target,
        "default_num_speculative_tokens": 4,
        "measure_proposer_costs": False,
    }
    options.update(overrides)
    return EngineConfig(**options)  # type: ignore[arg-type]


AppFactory = Callable[..., FastAPI]


@pytest.fixture
def make_app(tiny_model: LoadedModel, tiny_model_dir: Path) -> AppFactory:
    """``make_app(server_options=None, **engine_overrides)``: an app serving a fresh engine on
    the tiny model; ``server_options`` are ServerConfig fields (``api_key``...)."""

    def make(server_options: dict[str, Any] | None = None, **overrides: object) -> FastAPI:
        config = ServerConfig(
            engine=tiny_engine_config(tiny_model_dir, **overrides),
            served_model_name=TINY_MODEL_NAME,
            **(server_options or {}),
        )
        return create_app(config, engine_factory=lambda cfg: Engine(cfg, target=tiny_model))

    return make


@pytest.fixture
def client(make_app: AppFactory) -> Iterator[TestClient]:
    with TestClient(make_app()) as test_client:
        yield test_client


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """For tests that time a stream's gaps: the suite's heap is not the server's, and a full
    collection of every earlier test's objects can pause this process (server and client
    alike) for most of a second. Frozen, those objects are left out of collections."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port in this process; yield its base URL."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    with run_in_thread(config, timeout_s):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def run_in_thread(config: uvicorn.Config, timeout_s: float = 30.0) -> Iterator[None]:
    """Run a uvicorn server of ``config`` in a thread of this process until the block ends."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout_s)
