"""The servers that ``hybridspec bench serve`` measures, and the one ``hybridspec bench --served``
runs its trials through, each started and stopped as a process.

A ``ServerSpec`` is how to start one server on a port: ``hybridspec serve`` with a proposer,
llama-cpp-python's server (``python -m llama_cpp.server``), llama.cpp's own ``llama-server``.
``running`` starts it on a free loopback port, polls ``GET /v1/models`` until it answers 200
(every one of them serves it once its model is loaded), yields the base URL and stops the
process (SIGTERM, then SIGKILL) however the block ends. Its output goes to a log file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hybridspec.errors import HybridSpecError

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
READY_PATH = "/v1/models"
DEFAULT_READY_TIMEOUT_S = 600.0  # hybridspec loads and warms up in ~1 minute on 2 busy cores
STOP_TIMEOUT_S = 15.0
# Context of llama.cpp's servers: enough for the longest workload prompt plus its output, in
# each of llama-server's parallel slots (it splits --ctx-size among them).
LLAMA_CTX_PER_SLOT = 2048


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One server to measure: ``argv(port)`` is its command line on ``port``."""

    name: str  # its column in the tables: "hybridspec-ngram", "llama-server", ...
    argv: Callable[[int], list[str]]
    ours: bool  # hybridspec (a row of ratios) or a peer (a column of them)
    note: str = ""  # how it is driven, for the report
    env: dict[str, str] = field(default_factory=dict)  # over this process's environment


class ServerStartError(HybridSpecError, RuntimeError):
    """The server exited, or did not answer in time; the message ends with its log's tail (a
    command reports it as its other errors, without a traceback)."""


def free_port() -> int:
    """A TCP port that nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def hybridspec_spec(
    proposer: str, gguf: Path, threads: int, max_num_seqs: int, suffix: str = ""
) -> ServerSpec:
    """``hybridspec serve`` on ``gguf`` with ``proposer`` the default of every request, on
    ``serve --threads``; numba's pool is sized to match by the environment. ``suffix``: after
    its name (``-t2`` where several thread counts run)."""

    options = [
        *["--target", str(gguf), "--proposer", proposer],
        *["--max-num-seqs", str(max_num_seqs), "--threads", str(threads)],
    ]
    note = f"{max_num_seqs} slots, {threads} threads"
    return hybridspec_server(f"hybridspec-{proposer}{suffix}", options, threads, note)


def hybridspec_server(
    name: str, options: Sequence[str], threads: int | str, note: str = ""
) -> ServerSpec:
    """``hybridspec serve OPTIONS`` on the loopback, logging warnings only; a fixed number of
    ``threads`` also sizes numba's pool (by the environment), as ``serve --threads`` sizes
    torch's."""

    def argv(port: int) -> list[str]:
        return [
            *[sys.executable, "-m", "hybridspec.cli", "serve", "--host", LOOPBACK],
            *["--port", str(port), *options, "--log-level", "warning"],
        ]

    env = {} if threads == "auto" else {"NUMBA_NUM_THREADS": str(threads)}
    return ServerSpec(name, argv, ours=True, note=note, env=env)


def llama_cpp_python_spec(
    gguf: Path, threads: int, ctx: int = LLAMA_CTX_PER_SLOT
) -> ServerSpec | None:
    """llama-cpp-python's server with a context of ``ctx`` tokens, or None where ``llama_cpp``
    is not installed."""
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        return None

    def argv(port: int) -> list[str]:
        return [
            *[sys.executable, "-m", "llama_cpp.server", "--model", str(gguf)],
            *["--host", LOOPBACK, "--port", str(port), "--n_ctx", str(ctx)],
            *["--n_threads", str(threads), "--n_threads_batch", str(threads)],
            # By default a new request cuts the streaming one short (guidellm then counts an
            # empty response as an error); a serving benchmark wants every request served.
            *["--interrupt_requests", "false"],
        ]

    note = f"completions route, one request at a time (queued, not interrupted), {threads} threads"
    return ServerSpec("llama-cpp-python", argv, ours=False, note=note)


def llama_server_spec(
    binary: Path | None,
    gguf: Path,
    threads: int,
    parallel: int,
    ctx_per_slot: int = LLAMA_CTX_PER_SLOT,
) -> ServerSpec | None:
    """llama.cpp's ``llama-server`` with ``parallel`` slots of ``ctx_per_slot`` tokens each, or
    None where there is none."""
    found = binary or _which("llama-server")
    if found is None or not found.is_file():
        return None

    def argv(port: int) -> list[str]:
        return [
            *[str(found), "--model", str(gguf), "--host", LOOPBACK, "--port", str(port)],
            *["--parallel", str(parallel), "--ctx-size", str(ctx_per_slot * parallel)],
            *["--threads", str(threads), "--threads-batch", str(threads)],
        ]

    note = f"{parallel} parallel slots, {threads} threads"
    return ServerSpec("llama-server", argv, ours=False, note=note)


def _which(name: str) -> Path | None:
    """``name`` beside this interpreter (a virtual environment's bin/) or on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return beside
    found = shutil.which(name)
    return Path(found) if found else None


@contextlib.contextmanager
def running(
    spec: ServerSpec, log_path: Path, ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S
) -> Iterator[str]:
    """Start ``spec`` on a free port, wait until it is ready, yield its base URL, stop it."""
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            spec.argv(port),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **spec.env},
            start_new_session=True,  # its own process group: stopping it stops its children
        )
        try:
            url = f"http://{LOOPBACK}:{port}"
            wait_ready(url, process, ready_timeout_s, log_path)
            logger.info("%s ready at %s", spec.name, url)
            yield url
        finally:
            stop(process)


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    """Poll ``url`` + READY_PATH until it answers 200; raise if the process dies or time runs
    out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise ServerStartError(f"exited with {process.returncode}{_tail(log)}")
        if _answers(url + READY_PATH):
            return
        if time.monotonic() > deadline:
            raise ServerStartError(f"not ready after {timeout_s:.0f} s{_tail(log)}")
        time.sleep(0.5)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group, then SIGKILL it if it has not exited in STOP_TIMEOUT_S."""
    if process.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(STOP_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(log: Path, lines: int = 20) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "; its log ends:\n" + "\n".join(text) if text else ""


def specs_summary(specs: Sequence[ServerSpec]) -> str:
    return ", ".join(f"{s.name} ({s.note})" if s.note else s.name for s in specs)
