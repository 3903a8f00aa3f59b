"""``hybridspec bench --served``: the bench's trials through a ``hybridspec serve`` it starts.

One server process on a free loopback port (``servers.running``), on the bench's target and
options (dtype, device, quantize, threads, K, the draft), with the context that the library
bench's engine gets (the longest prompt plus the budget), one batch slot per concurrent request,
and its prefix cache off (``--prefix-cache-mb 0``): every trial prefills its whole prompt, as
the library bench's do. Each method is a proposer that every request of its trials names (the
request field ``proposer``); the methods that exist only in the library bench, the transformers
and llama.cpp baselines, are refused. The schedule, records, summary and ``--vs-none`` table
are the library bench's.

A request is the trial's prompt as token ids (the very tokens of the library bench's trial,
the chat template applied by the bench) through the completions route, streamed as a chat
client streams, with its usage (``stream_options.include_usage``). A trial is timed by the
client, from sending its first request to the end of its last stream, prefill included, as the
library's runs from the first request added to the last finished; a single request's first
token is when the first chunk with text arrives. Its tokens are the usage's completion tokens,
plus the EOS token where one ended it (finish reason ``stop``: no request names a stop
string), counted as the library counts them. Its text is compared with ``none``'s as the
library compares ids (``summary.greedy_agreement``): the records hold the ids of the text as
the target's tokenizer encodes it, once the trial's clock has stopped. Identical texts give
identical ids; where texts differ, the first differing id is where they part, give or take a
token. (The stream could carry each token's id, ``include_drafts``, but that costs the server a
worker thread's decode per chunk, and a chunk per round favours speculation, which makes
fewer.) Drafts proposed and accepted and target forwards come from the response's
``hybridspec`` statistics; the time inside the target's forward is not observed.

N at once: N client threads in a closed loop (``client_closed_loop``), like the library's N
requests in the engine at once.

Pairs (``harness``, "Pairs"): where the library bench would make a twin, the bench's server
runs one too (``serve --bench-twin``: a second engine over the same weights runs the requests
for ``none``, and the engine thread steps the two by turns, ``engine.loop``). A method's loop
and ``none``'s are then sent at once, each from client threads of its own
(``ServedMethod.run_beside``), and each is timed by its engine's seconds of steps over the pair,
read from the server's ``/metrics`` (``hybridspec_engine_step_seconds_total``) before and
after: the library's own turns, seen from outside. The clients' wall clocks would count the
other engine's turns. Those seconds leave out the server's work outside the engine thread
(HTTP, the streams), as the library's leave out its caller's; a paired request's first token
is not timed, for the same reason as the wall clock is not used. Before sending, the bench
holds the server's steps until both loops' first requests (N each, or every request where
there are fewer) are in (``/bench/hold``, ``engine.loop``), so that both engines start from a
full queue, as the library's pair starts.

Each request names its pass (``harness.pass_session``) as its ``user``, and the server keeps a
``suffix`` pool per user (``--suffix-isolation per-session``), as the library bench's engine
keeps one per session: ``suffix`` drafts from the pass's earlier prompts, never from an earlier
answer to the same prompt.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from hybridspec.bench.loadgen import COMPLETIONS_ROUTE
from hybridspec.bench.names import BASELINE, LIBRARY_ONLY
from hybridspec.bench.records import Measurement, Speculation
from hybridspec.bench.servers import READY_PATH
from hybridspec.bench.sse import ServedRequestError, stream_chunks
from hybridspec.errors import check
from hybridspec.types import SamplingParams

METRICS_PATH = "/metrics"
HOLD_PATH = "/bench/hold"  # serve --bench-twin only
STEP_SECONDS = "hybridspec_engine_step_seconds_total"  # by engine: main, twin
MAIN, TWIN = "main", "twin"
_Request = TypeVar("_Request")
_Result = TypeVar("_Result")


def check_served_methods(names: Sequence[str]) -> None:
    """Refuse the methods that only the library bench runs, naming them."""
    refused = [n for n in names if n in LIBRARY_ONLY]
    check(
        not refused,
        "methods",
        f"{refused} run only in the library bench, not through a server: drop them, or drop "
        "--served",
    )


def threads_option(threads: int | str | None) -> str:
    """The bench's engine threads as ``serve --threads`` takes them: 'auto' or N."""
    check(
        threads is not None,
        "threads",
        "served, the engine's threads are 'auto' or N (serve has no torch default): not 0",
    )
    return str(threads)


def served_proposers(url: str) -> list[str]:
    """The proposers the server at ``url`` runs (its model card's)."""
    with urllib.request.urlopen(url + READY_PATH, timeout=30) as response:
        (card,) = json.loads(response.read())["data"]
    return [p["name"] for p in card["hybridspec"]["proposers"]]


def served_methods(
    url: str, names: Sequence[str], k: int, encode: Callable[[str], Sequence[int]]
) -> list[ServedMethod]:
    """A ``ServedMethod`` per name; raises for a proposer the server does not run."""
    known = served_proposers(url)
    unknown = [n for n in names if n not in known]
    check(not unknown, "methods", f"the server runs no {unknown}; it runs {known}")
    return [ServedMethod(url, name, k, encode) for name in names]


def engine_step_seconds(url: str) -> dict[str, float]:
    """Each engine's seconds of steps so far (``main``, and ``twin`` where the server runs one),
    from the server's ``/metrics``."""
    with urllib.request.urlopen(url + METRICS_PATH, timeout=30) as response:
        text = response.read().decode()
    return {
        sample.labels["engine"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == STEP_SECONDS
    }


def hold_steps(url: str, num_requests: int) -> None:
    """Hold the twin-running server's steps until its engines hold ``num_requests`` requests
    (``/bench/hold``)."""
    body = json.dumps({"requests": num_requests}).encode()
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(url + HOLD_PATH, body, headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def client_closed_loop(
    send: Callable[[_Request], _Result], requests: Sequence[_Request], concurrency: int
) -> tuple[list[_Result], float]:
    """Send M requests from N = ``concurrency`` client threads, each sending the next request
    as soon as its last one is answered; the M results in request order and the wall seconds
    from the first sent to the last answered. Example, M = 3, N = 2: requests 0 and 1 go at
    once, 2 when the first of them is answered."""
    check(concurrency >= 1, "concurrency", f"expected >= 1, got {concurrency}")
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:  # takes requests in order
        results = list(pool.map(send, requests))
    return results, time.perf_counter() - start


@dataclass(frozen=True, slots=True)
class Served:
    """One streamed request: what it generated, its statistics and the client's times."""

    text: str
    num_generated: int  # the usage's completion tokens, and the EOS token that ended it
    target_forwards: int
    num_drafts: int
    num_accepted_tokens: int
    seconds: float  # request sent to the stream's end
    first_token_s: float | None  # request sent to the first chunk with text

    def speculation(self, encode: Callable[[str], Sequence[int]]) -> Speculation:
        """As the library's records hold a request, its ids those of its text (``encode``)."""
        return Speculation(
            token_ids=tuple(encode(self.text)),
            num_generated=self.num_generated,
            target_forwards=self.target_forwards,
            num_drafts=self.num_drafts,
            num_accepted_tokens=self.num_accepted_tokens,
        )


class ServedMethod:
    """A proposer of the bench's server: every request of its trials names it, with a fixed K.
    ``encode`` turns a text into the target tokenizer's ids, for the records."""

    def __init__(
        self, url: str, proposer: str, k: int, encode: Callable[[str], Sequence[int]]
    ) -> None:
        self.name = proposer
        self.url = url
        self._route = url + COMPLETIONS_ROUTE
        self._k = k
        self._encode = encode

    def body(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        max_new_tokens: int,
        session: str | None = None,
    ) -> dict[str, Any]:
        """The request of one prompt: the bench sets a temperature and, sampled, a seed;
        ``session`` is its ``user``."""
        plain = SamplingParams(temperature=sampling.temperature, seed=sampling.seed)
        assert sampling == plain, "the bench's requests set only a temperature and a seed"
        body: dict[str, Any] = {
            "prompt": list(prompt_token_ids),
            "max_tokens": max_new_tokens,
            "temperature": sampling.temperature,
            "proposer": self.name,
            "num_speculative_tokens": self._k,
            "stream_options": {"include_usage": True},
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if session is not None:
            body["user"] = session
        return body

    def send(self, body: dict[str, Any]) -> Served:
        """Stream one request and read its text, counts and times (module docstring)."""
        began = time.perf_counter()
        first: float | None = None
        parts: list[str] = []
        finish, usage, stats = None, None, None
        for chunk in stream_chunks(self._route, body):
            for choice in chunk["choices"]:
                text = choice.get("text") or ""
                if text and first is None:
                    first = time.perf_counter()
                parts.append(text)
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
            stats = chunk.get("hybridspec") or stats
        ended = time.perf_counter()
        if usage is None or stats is None or finish is None:
            raise ServedRequestError(f"{self._route}: the stream ended without its usage")
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        check(cached == 0, "cached_tokens", f"expected a cold prefill, {cached} tokens were cached")
        return Served(
            text="".join(parts),
            num_generated=int(usage["completion_tokens"]) + (finish == "stop"),
            target_forwards=int(stats["target_forwards"]),
            num_drafts=int(stats["draft_tokens_proposed"]),
            num_accepted_tokens=int(stats["draft_tokens_accepted"]),
            seconds=ended - began,
            first_token_s=None if first is None else first - began,
        )

    def run(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        max_new_tokens: int,
        session: str | None = None,
    ) -> Measurement:
        served = self.send(self.body(prompt_token_ids, sampling, max_new_tokens, session))
        requests = (served.speculation(self._encode),)
        return Measurement(requests, served.seconds, None, served.first_token_s)

    def run_concurrent(
        self,
        prompts: Sequence[Sequence[int]],
        samplings: Sequence[SamplingParams],
        max_new_tokens: int,
        concurrency: int,
        session: str | None = None,
    ) -> Measurement:
        """Every prompt from ``concurrency`` client threads (``client_closed_loop``); the texts
        are encoded once the last request is answered."""
        bodies = self._bodies(prompts, samplings, max_new_tokens, session)
        results, elapsed = client_closed_loop(self.send, bodies, concurrency)
        requests = self._requests(results)
        first = results[0].first_token_s if len(results) == 1 else None
        return Measurement(requests, elapsed, None, first)

    def run_beside(
        self,
        other: ServedMethod,
        prompts: Sequence[Sequence[int]],
        samplings: Sequence[SamplingParams],
        max_new_tokens: int,
        concurrency: int,
        session: str | None = None,
    ) -> tuple[Measurement, Measurement]:
        """This method's closed loop and ``other``'s (``none``, which the server's twin runs)
        over the same requests, sent at once; each timed by its engine's seconds of steps
        (module docstring)."""
        check(
            other.name == BASELINE != self.name and other.url == self.url,
            "methods",
            f"a served pair is a method and {BASELINE!r} on one server, not {self.name!r} and "
            f"{other.name!r}",
        )
        before = engine_step_seconds(self.url)
        check(TWIN in before, "methods", f"the server at {self.url} runs no twin (--bench-twin)")
        hold_steps(self.url, 2 * min(concurrency, len(prompts)))
        with ThreadPoolExecutor(max_workers=2) as pool:
            loops = [
                pool.submit(
                    client_closed_loop,
                    m.send,
                    m._bodies(prompts, samplings, max_new_tokens, session),
                    concurrency,
                )
                for m in (self, other)
            ]
            (mine, _), (theirs, _) = (loop.result() for loop in loops)
        after = engine_step_seconds(self.url)
        return (
            Measurement(self._requests(mine), after[MAIN] - before[MAIN], None, None),
            Measurement(other._requests(theirs), after[TWIN] - before[TWIN], None, None),
        )

    def _bodies(
        self,
        prompts: Sequence[Sequence[int]],
        samplings: Sequence[SamplingParams],
        max_new_tokens: int,
        session: str | None,
    ) -> list[dict[str, Any]]:
        return [
            self.body(p, s, max_new_tokens, session)
            for p, s in zip(prompts, samplings, strict=True)
        ]

    def _requests(self, results: Sequence[Served]) -> tuple[Speculation, ...]:
        return tuple(r.speculation(self._encode) for r in results)
