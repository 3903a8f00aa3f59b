"""``hybridspec serve --replicas 2`` on a tiny model, end to end, through the official client.

One Ray instance for the module (its start and the replicas' are most of the time): greedy
parity across replicas and proposers with 16 concurrent requests, both replicas serving,
sessions sticking to one replica, and a replica killed mid-request: its requests fail with
a 502 naming the cause (a stream, with that error as its last event), the other replica's
complete, new requests are served, and Ray starts
a replica in its place. ``make test`` installs the ray extra, so CI runs these.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import save_tiny_llama
from tests.server.conftest import free_port

replicas = pytest.importorskip("hybridspec.deploy.replicas", exc_type=ImportError)
openai = pytest.importorskip("openai")

# Ray and two replicas, each a process of its own: the second pass of make test, with every core.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

STARTUP_TIMEOUT_S = 300.0
RESTART_TIMEOUT_S = 180.0
CONTEXT = 2048  # room for requests long enough to be in flight when their replica dies
LONG_TOKENS = 1500
MESSAGES = [{"role": "user", "content": "Count the colors: red, green, red, blue, green."}]
PROPOSERS = ("none", "ngram", "draft")


@dataclass(frozen=True)
class Served:
    base: str
    process: subprocess.Popen[bytes]
    log: Path

    def client(self, **headers: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base}/v1",
            api_key="unused",
            max_retries=0,  # a failure must show, not be retried on the other replica
            timeout=120.0,
            default_headers=headers or None,
        )

    def replica_pids(self) -> list[int]:
        return [pid for pid in _descendants(self.process.pid) if _is_replica(pid)]


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _is_replica(pid: int) -> bool:
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes()  # Ray's process title
    except OSError:
        return False
    return title.startswith(b"ray::") and b"ServeReplica:" in title


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str, served: Served) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if served.process.poll() is not None or time.monotonic() > deadline:
            tail = served.log.read_text(errors="replace")[-4000:]
            pytest.fail(f"{what} within {timeout_s:.0f} s; the server's log ends:\n{tail}")
        time.sleep(0.5)


def _replicas_up(served: Served) -> int:
    try:
        response = httpx.get(f"{served.base}/health", timeout=10)
    except httpx.HTTPError:
        return 0
    return int(response.json().get("replicas") or 0) if response.status_code == 200 else 0


def finished_by_replica(served: Served) -> dict[str, float]:
    """Requests each replica finished, from the aggregated /metrics."""
    text = httpx.get(f"{served.base}/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "hybridspec_requests_finished":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    replica = sample.labels["replica"]
                    counts[replica] = counts.get(replica, 0.0) + sample.value
    return counts


def _settled_counts(served: Served, total: float = 0.0) -> dict[str, float]:
    """The per-replica counts once they count ``total`` requests at least and hold still for
    longer than a report period (each replica reports its own every second)."""
    counts: dict[str, float] = finished_by_replica(served)  # the first reading, compared next

    def settled() -> bool:
        previous = dict(counts)
        time.sleep(replicas.REPORT_PERIOD_S + 0.5)
        counts.clear()
        counts.update(finished_by_replica(served))
        return counts == previous and sum(counts.values()) >= total

    _wait_for(settled, 30.0, f"/metrics counting {total:.0f} requests, settled", served)
    return counts


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    directory = tmp_path_factory.mktemp("replicas")
    model = save_tiny_llama(directory / "tiny", max_position_embeddings=CONTEXT)
    port = free_port()
    command = [sys.executable, "-m", "hybridspec.cli", "serve", "--replicas", "2"]
    command += ["--port", str(port), "--target", str(model), "--draft", str(model)]
    command += ["--dtype", "float32", "--max-num-seqs", "8", "--draft-cost-per-token", "0.5"]
    log = directory / "serve.log"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with log.open("wb") as out:
        # A session of its own: stopping it stops Ray's processes too.
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    result = Served(f"http://127.0.0.1:{port}", process, log)
    try:
        # The command's ready line comes once Ray runs both (the proxy routes to them); the
        # replicas' own count once both serve their app.
        _wait_for(
            lambda: b"ready: 2 replicas" in log.read_bytes() and _replicas_up(result) == 2,
            STARTUP_TIMEOUT_S,
            "2 replicas up",
            result,
        )
        yield result
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def _chat(
    client: openai.OpenAI, proposer: str, k: int, max_tokens: int = 24, **extra: object
) -> str:
    reply = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"proposer": proposer, "num_speculative_tokens": k, **extra},
    )
    return reply.choices[0].message.content or ""


def test_greedy_parity_across_replicas_and_proposers(served: Served) -> None:
    client = served.client()
    reference = _chat(client, "none", 1)
    before = sum(_settled_counts(served).values())
    jobs = [(PROPOSERS[i % 3], (1, 4, 8)[i % 3 - 1]) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(lambda job: _chat(client, *job), jobs))
    assert texts == [reference] * 16
    counts = _settled_counts(served, before + 16)
    assert len(counts) == 2 and all(count > 0 for count in counts.values()), counts


@pytest.mark.parametrize("how", ["header", "user"])
def test_a_session_sticks_to_one_replica(served: Served, how: str) -> None:
    before = _settled_counts(served)
    for _ in range(6):
        if how == "header":
            _chat(served.client(**{"x-session-id": "conversation-7"}), "ngram", 4, 8)
        else:
            served.client().chat.completions.create(
                model="tiny",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=8,
                temperature=0,
                user="alice",
            )
    after = _settled_counts(served, sum(before.values()) + 6)
    grew = {replica: after[replica] - before.get(replica, 0.0) for replica in after}
    assert [count for count in grew.values() if count] == [6.0], grew  # one replica, all 6


def test_a_dead_replica_fails_its_requests_and_is_replaced(served: Served) -> None:
    client = served.client()
    reference = _chat(client, "none", 1, LONG_TOKENS, ignore_eos=True)
    original = set(finished_by_replica(served))
    victim = served.replica_pids()[0]

    def long_request(i: int) -> str | openai.APIError:
        """Half stream: a stream cut by the death ends with the error as its last event."""
        extra = {"proposer": PROPOSERS[i % 2], "num_speculative_tokens": 4, "ignore_eos": True}
        try:
            if i % 2 == 0:
                return _chat(client, PROPOSERS[i % 2], 4, LONG_TOKENS, ignore_eos=True)
            chunks = client.chat.completions.create(
                model="tiny",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=LONG_TOKENS,
                temperature=0,
                stream=True,
                extra_body=extra,
            )
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        except openai.APIError as exc:
            return exc

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(long_request, i) for i in range(8)]
        time.sleep(1.5)  # every request admitted and generating: far from its 1500th token
        ended = [future.result() for future in futures if future.done()]
        assert not ended, f"requests ended before the kill: {ended}"
        os.kill(victim, signal.SIGKILL)
        outcomes = [future.result() for future in futures]
    failed = [o for o in outcomes if isinstance(o, openai.APIError)]
    assert [o for o in outcomes if not isinstance(o, openai.APIError)] == [reference] * (
        8 - len(failed)
    )
    assert 0 < len(failed) < 8, outcomes
    for error in failed:  # a 502 before the response began, else the stream's last event
        assert not isinstance(error, openai.APIStatusError) or error.status_code == 502
        assert error.code == "replica_failed" and "stopped before it answered" in error.message
    # New requests go to the live replica at once; Ray starts another in the dead one's place.
    short = _chat(client, "none", 1)
    assert [_chat(client, "ngram", 4) for _ in range(4)] == [short] * 4

    def replaced() -> bool:
        pids = served.replica_pids()
        return len(pids) == 2 and victim not in pids and _replicas_up(served) == 2

    _wait_for(replaced, RESTART_TIMEOUT_S, "a replica started in the dead one's place", served)

    def new_replica_served() -> bool:  # once the proxy routes to it too (least loaded: soon)
        assert _chat(client, "none", 1) == short
        return bool(set(finished_by_replica(served)) - original)

    _wait_for(new_replica_served, 60.0, "the new replica serving a request", served)
