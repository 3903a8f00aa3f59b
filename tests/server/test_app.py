"""Start-up of the app (``server.app``): the engine is warm before the app serves, warmed
without a trace (free slots, no request in the metrics), and the start logs one ``ready:``
line."""

from __future__ import annotations

import gc
import json
import logging
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from hybridspec.engine import Engine
from hybridspec.model import LoadedModel
from hybridspec.server import ServerConfig, create_app
from tests.server.conftest import TINY_MODEL_NAME, AppFactory, tiny_engine_config
from tests.server.helpers import metric, parse_metrics

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter, so that numba has compiled (or loaded) nothing before the app
# starts: prints how many signatures every kernel of the runtime and of ngram has after the
# app started, then after requests of every kind.
NO_COMPILE_AFTER_START = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from fastapi.testclient import TestClient

from hybridspec.engine import Engine
from hybridspec.model import LoadedModel
from hybridspec.server import ServerConfig, create_app
from numba.core.registry import CPUDispatcher

from hybridspec.config import EngineConfig, ModelConfig
from hybridspec.model import attention_kernels, qgemm
from hybridspec.proposers import ngram_kernels
from hybridspec.server import ServerConfig, create_app
from tests.conftest import save_tiny_llama


def signatures():
    modules = (attention_kernels, ngram_kernels)
    return {
        f"{module.__name__}.{name}": len(value.signatures)
        for module in modules
        for name, value in vars(module).items()
        if isinstance(value, CPUDispatcher)
    }


model_dir = save_tiny_llama(Path(sys.argv[1]))
target = ModelConfig(str(model_dir), dtype=sys.argv[2], max_num_seqs=4)
config = EngineConfig(target=target, default_num_speculative_tokens=4)
chat = [{"role": "user", "content": "abc abc abc abc"}]
bodies = [
    {"messages": chat, "max_tokens": 8, "temperature": 0, "proposer": "ngram"},
    {"messages": chat, "max_tokens": 8, "temperature": 0.8, "seed": 1, "proposer": "none"},
    {"messages": chat, "max_tokens": 8, "temperature": 0.8, "seed": 2, "proposer": "ngram"},
    {"messages": chat, "max_tokens": 8, "temperature": 0, "stream": True},
]
with TestClient(create_app(ServerConfig(engine=config))) as client:
    started = signatures()
    for body in bodies:
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    with ThreadPoolExecutor(len(bodies)) as pool:
        codes = pool.map(lambda b: client.post("/v1/chat/completions", json=b).status_code, bodies)
        assert set(codes) == {200}
    kernel = qgemm.kernel()  # where it has a vector path, the attention runs in C, not numba
    print(json.dumps([started, signatures(), bool(kernel and kernel.attention_vectorized)]))
"""


DTYPES = ("float32", "bfloat16")
Runs = tuple[Path, dict[str, subprocess.Popen[bytes]]]


@pytest.fixture(scope="module")
def no_compile_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """``NO_COMPILE_AFTER_START`` in a fresh interpreter per dtype, all started at once: each
    is mostly a cold start on one thread (imports, numba's cache, the warm-up), so side by side
    they take about the time of one. Each writes to files, which no unread pipe can block."""
    directory = tmp_path_factory.mktemp("no-compile")
    runs = {}
    for dtype in DTYPES:
        with (
            (directory / f"{dtype}.out").open("wb") as out,
            (directory / f"{dtype}.err").open("wb") as err,
        ):
            command = [sys.executable, "-c", NO_COMPILE_AFTER_START, str(directory / dtype), dtype]
            runs[dtype] = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=err)
    try:
        yield directory, runs
    finally:
        for process in runs.values():
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.mark.serial  # two cold starts side by side: one core each
@pytest.mark.parametrize("dtype", DTYPES)
def test_requests_after_start_compile_nothing(no_compile_runs: Runs, dtype: str) -> None:
    directory, runs = no_compile_runs
    returncode = runs[dtype].wait(timeout=600)
    assert returncode == 0, (directory / f"{dtype}.err").read_text(errors="replace")[-3000:]
    output = (directory / f"{dtype}.out").read_text().splitlines()[-1]
    started, after_requests, c_attention = json.loads(output)
    assert c_attention or started["hybridspec.model.attention_kernels.attend"] >= 1
    assert started["hybridspec.proposers.ngram_kernels.propose_batch"] >= 1
    assert after_requests == started


def test_startup_leaves_free_slots_and_empty_metrics(make_app: AppFactory) -> None:
    with TestClient(make_app()) as client:
        engine = client.app.state.server.loop.engine  # type: ignore[attr-defined]
        assert engine.runtime.num_free_slots() == engine.runtime.max_num_seqs
        assert not engine.has_unfinished()
        samples = parse_metrics(client.get("/metrics").text)
        for name in (
            "hybridspec_requests_finished_total",
            "hybridspec_prompt_tokens_total",
            "hybridspec_generated_tokens_total",
            "hybridspec_target_forwards_total",
            "hybridspec_request_latency_seconds_count",
            "hybridspec_time_to_first_token_seconds_count",
        ):
            assert metric(samples, name) == 0, name


def test_startup_logs_one_ready_line(
    make_app: AppFactory, caplog: pytest.LogCaptureFixture, torch_threads: int
) -> None:
    with (
        caplog.at_level(logging.INFO, logger="hybridspec.server"),
        TestClient(make_app(num_threads=2)),
    ):
        pass
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready:")]
    assert len(ready) == 1, caplog.text
    pattern = (
        r"ready: tiny-llama \(transformers \S+ -> float32\), 2 threads, "
        r"proposers grammar,ngram,none,suffix,grammar\+ngram,grammar\+none,grammar\+suffix; "
        r"load \d+\.\d s, warm-up \d+\.\d s"
    )
    assert re.fullmatch(pattern, ready[0]), ready[0]


def test_a_frozen_heap_leaves_the_startup_objects_out_of_collections(
    make_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """``freeze_heap``: once warm, the model's and libraries' objects are frozen (no later
    collection visits them) and the ready line says what it took; off, nothing is frozen."""
    assert gc.get_freeze_count() == 0
    with TestClient(make_app()):
        assert gc.get_freeze_count() == 0
    try:
        with (
            caplog.at_level(logging.INFO, logger="hybridspec.server"),
            TestClient(make_app({"freeze_heap": True})) as client,
        ):
            assert gc.get_freeze_count() > 10_000
            assert client.get("/health").status_code == 200
    finally:
        gc.unfreeze()
    assert re.search(r"ready: .*, gc \d+\.\d s$", caplog.text, re.MULTILINE), caplog.text
    with pytest.raises(ValueError, match="freeze_heap"):
        ServerConfig(freeze_heap=1)  # type: ignore[arg-type]


class _ThreadRecordingEngine(Engine):
    """Records the thread that builds it, resets it (the end of the warm-up) and steps it."""

    threads: set[str]

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.threads = {threading.current_thread().name}
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def reset(self) -> None:
        self.threads.add(threading.current_thread().name)
        super().reset()

    def step(self) -> list:  # type: ignore[type-arg]
        self.threads.add(threading.current_thread().name)
        return super().step()


@pytest.fixture
def torch_threads() -> Iterator[int]:
    """This process's torch threads, restored afterwards (a test may set them)."""
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


def test_engine_built_warmed_and_stepped_on_the_engine_thread(
    tiny_model: LoadedModel, tiny_model_dir: Path, torch_threads: int
) -> None:
    """One thread runs every forward, so that the kernels keep one team of OpenMP workers;
    ``num_threads`` is set there and reported in the ready line and ``/v1/models``."""
    engines: list[_ThreadRecordingEngine] = []

    def factory(config: object) -> Engine:
        engines.append(_ThreadRecordingEngine(config, target=tiny_model))
        return engines[-1]

    config = ServerConfig(
        engine=tiny_engine_config(tiny_model_dir, num_threads=1), served_model_name=TINY_MODEL_NAME
    )
    with TestClient(create_app(config, engine_factory=factory)) as client:
        body = {"prompt": "hello", "max_tokens": 4}
        assert client.post("/v1/completions", json=body).status_code == 200
        card = client.get("/v1/models").json()["data"][0]
    assert engines[0].threads == {"hybridspec-engine"}
    assert card["hybridspec"]["num_threads"] == 1


def test_head_answers_as_get_without_a_body(make_app: AppFactory) -> None:
    with TestClient(make_app({"api_key": "k"})) as client:
        for path in ("/health", "/", "/playground"):  # open without the key, as GET is
            get, head = client.get(path), client.head(path)
            assert (get.status_code, head.status_code) == (200, 200), path
            assert head.content == b"" and get.content, path
            assert head.headers["content-type"] == get.headers["content-type"], path
            assert head.headers["content-length"] == str(len(get.content)), path
        assert client.head("/v1/models").status_code == 401  # the key, as for GET
        keyed = {"authorization": "Bearer k"}
        for path in ("/v1/models", "/metrics", "/openapi.json"):
            head = client.head(path, headers=keyed)
            assert head.status_code == 200 and head.content == b"", path
        head = client.head("/v1/chat/completions", headers=keyed)  # POST only: as GET, 405
        assert head.status_code == 405 and head.content == b""
