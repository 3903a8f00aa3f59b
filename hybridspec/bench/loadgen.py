"""guidellm, the load generator behind ``hybridspec bench serve``: its workloads, its scenario
file, its run and its JSON report.

One guidellm run measures one server on one workload at one concurrency: a scenario file
(guidellm's own format) with a ``concurrent`` profile of that many streams, ending after
``requests`` requests; the report is guidellm's JSON (``--output kind=json``). Streaming is
guidellm's default: TTFT and ITL are measured by it from the server-sent events.

Glossary: *TTFT*, time to first token (from sending the request to the first streamed token);
*ITL*, inter-token latency (mean gap between tokens after the first, per request); percentiles
are over requests; *output tok/s* is guidellm's output-token throughput over the benchmark.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridspec.bench.workload import Workload

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

COMPLETIONS_ROUTE = "/v1/completions"
CHAT_ROUTE = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class LoadWorkload:
    """A workload as guidellm reads it: an entry of its scenario's ``data`` list for each
    concurrency. Every concurrency gets prompts of its own (guidellm restarts its data at each
    benchmark): a server's prompt cache then helps only with the prefixes requests really
    share (the chat template's system prompt), not with the previous concurrency's prompts."""

    name: str  # "synthetic" or "grounded": a table each
    description: str
    data: dict[int, dict[str, Any]]  # concurrency -> guidellm data entry


@dataclass(frozen=True, slots=True)
class ServingPoint:
    """One server at one concurrency, from guidellm's report."""

    concurrency: int
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    itl_p50_ms: float
    itl_p95_ms: float
    successful: int
    errored: int
    incomplete: int

    def to_json(self) -> dict[str, float | int]:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServingPoint:
        return cls(**{name: data[name] for name in cls.__slots__})


class LoadGeneratorError(RuntimeError):
    """guidellm failed, or wrote a report this module cannot read."""


def synthetic_workload(
    prompt_tokens: int, output_tokens: int, concurrencies: Sequence[int]
) -> LoadWorkload:
    """guidellm's synthetic text: ``prompt_tokens`` random words in, ``output_tokens`` out (its
    prompts differ between concurrencies through the scenario's seed)."""
    data = {"kind": "synthetic_text", "prompt_tokens": prompt_tokens}
    data["output_tokens"] = output_tokens
    description = f"guidellm synthetic text, {prompt_tokens} tokens in, {output_tokens} out"
    return LoadWorkload("synthetic", description, {c: dict(data) for c in concurrencies})


def grounded_workload(
    workload: Workload,
    tokenizer: PreTrainedTokenizerBase,
    output_tokens: int,
    concurrencies: Sequence[int],
    directory: Path,
) -> LoadWorkload:
    """The bench workload's input-grounded prompts as guidellm JSON-lines files in
    ``directory``, one per concurrency, each prompt's user message tagged ``[c.i]`` in front.

    Each prompt is rendered with the model's chat template into text (what the chat route
    would make of its messages), so that every server, driven through its completions route,
    gets the same tokens; ``output_tokens_count`` makes guidellm ask for exactly that many
    (``max_tokens`` with ``ignore_eos``).
    """
    grounded = [name for name, c in workload.categories.items() if c.input_grounded]
    prompts = [p for p in workload.prompts if p.category in grounded]
    if not prompts:
        raise ValueError(f"workload {workload.name!r} has no input-grounded prompt")
    directory.mkdir(parents=True, exist_ok=True)
    data = {}
    for concurrency in concurrencies:
        rows = []
        for i, prompt in enumerate(prompts):
            *earlier, last = prompt.messages
            tagged = {**last, "content": f"[{concurrency}.{i}] {last['content']}"}
            text = tokenizer.apply_chat_template(
                [*earlier, tagged], tokenize=False, add_generation_prompt=True
            )
            rows.append({"prompt": str(text), "output_tokens_count": output_tokens})
        path = directory / f"grounded-c{concurrency}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        data[concurrency] = {"kind": "json_file", "path": str(path)}
    description = (
        f"{len(prompts)} input-grounded prompts of {workload.name} ({', '.join(grounded)}), "
        f"chat template applied, {output_tokens} tokens out"
    )
    return LoadWorkload("grounded", description, data)


def scenario(
    target: str,
    route: str,
    data: dict[str, Any],
    tokenizer_dir: Path,
    concurrency: int,
    requests: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> dict[str, Any]:
    """guidellm's scenario file: one ``concurrent`` benchmark of ``requests`` requests,
    streaming. ``temperature`` goes in every request body (guidellm sends none: each server's
    default would apply, 1.0 for an OpenAI-style server, 0.8 for llama.cpp's)."""
    return {
        "metadata": {"name": f"hybridspec-bench-serve-c{concurrency}"},
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": target,
                "request_format": route,
                # guidellm checks GET /health first; llama-cpp-python's server has no /health
                "api_routes": {"/health": "v1/models"},
                "extras": {"body": {"temperature": temperature}},
            },
            "profile": {"kind": "concurrent", "streams": concurrency},
            "data": [data],
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
            "constraints": [{"kind": "max_requests", "count": requests}],
            "seed": {"kind": "static", "value": seed},
        },
    }


def run_guidellm(scenario_data: dict[str, Any], workdir: Path, name: str) -> list[ServingPoint]:
    """Run guidellm on ``scenario_data``; its scenario, log and report go to ``workdir/name.*``."""
    workdir.mkdir(parents=True, exist_ok=True)
    scenario_path = workdir / f"{name}.scenario.json"
    report_path = workdir / f"{name}.guidellm.json"
    log_path = workdir / f"{name}.guidellm.log"
    scenario_path.write_text(json.dumps(scenario_data, indent=2), encoding="utf-8")
    argv = [
        *[sys.executable, "-m", "guidellm", "run", "--scenario", str(scenario_path)],
        *["--output", f"kind=json,path={report_path}", "--disable-progress"],
    ]
    logger.info("guidellm: %s", " ".join(argv))
    with log_path.open("wb") as log:
        completed = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False)
    if completed.returncode != 0 or not report_path.is_file():
        raise LoadGeneratorError(f"guidellm exited with {completed.returncode}; see {log_path}")
    return parse_report(json.loads(report_path.read_text(encoding="utf-8")))


def parse_report(report: dict[str, Any]) -> list[ServingPoint]:
    """guidellm's JSON report (0.8) -> one point per benchmark, in concurrency order."""
    try:
        points = [_point(benchmark) for benchmark in report["benchmarks"]]
    except (KeyError, TypeError) as exc:
        raise LoadGeneratorError(f"unexpected guidellm report: missing {exc}") from exc
    return sorted(points, key=lambda p: p.concurrency)


def _point(benchmark: dict[str, Any]) -> ServingPoint:
    metrics = benchmark["metrics"]
    ttft = metrics["time_to_first_token_ms"]["successful"]["percentiles"]
    itl = metrics["inter_token_latency_ms"]["successful"]["percentiles"]
    totals = metrics["request_totals"]
    return ServingPoint(
        concurrency=int(benchmark["config"]["strategy"]["streams"]),
        # "total", as guidellm's own HTML and plot outputs report it
        output_tokens_per_s=float(metrics["output_tokens_per_second"]["total"]["mean"]),
        ttft_p50_ms=float(ttft["p50"]),
        ttft_p95_ms=float(ttft["p95"]),
        itl_p50_ms=float(itl["p50"]),
        itl_p95_ms=float(itl["p95"]),
        successful=int(totals["successful"]),
        errored=int(totals["errored"]),
        incomplete=int(totals["incomplete"]),
    )
