"""``hybridspec bench serve`` without guidellm or llama.cpp: the report parsing, the scenario,
the workload file, the tables and the goals, the chart, and the server processes (a fake
server: Python's own http.server, serving a file at /v1/models)."""

from __future__ import annotations

import json
import socket
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridspec.bench.library_rate import grounded_prompts, library_rates
from hybridspec.bench.loadgen import (
    COMPLETIONS_ROUTE,
    LoadGeneratorError,
    ServingPoint,
    grounded_workload,
    parse_report,
    scenario,
    synthetic_workload,
)
from hybridspec.bench.serve_cli import _specs
from hybridspec.bench.servers import (
    ServerSpec,
    ServerStartError,
    free_port,
    hybridspec_spec,
    llama_server_spec,
    running,
)
from hybridspec.bench.serving_report import (
    ServingResults,
    format_results,
    plot_serving,
    ratios,
)
from hybridspec.bench.workload import parse_workload
from hybridspec.cli import build_parser
from hybridspec.errors import HybridSpecError
from tests.conftest import save_tiny_llama

DATA = Path(__file__).parent / "data"


def point(concurrency: int, tok_s: float, ttft_p95: float, errored: int = 0) -> ServingPoint:
    return ServingPoint(concurrency, tok_s, ttft_p95 / 2, ttft_p95, 20.0, 30.0, 16, errored, 0)


# ---------------------------------------------------------------------------- guidellm


def test_parse_report_reads_a_recorded_guidellm_report() -> None:
    # Trimmed from a real guidellm 0.8.1 run against hybridspec serve (2 requests at c=1, 2).
    report = json.loads((DATA / "guidellm_0.8.1_report.json").read_text())
    points = parse_report(report)
    assert [p.concurrency for p in points] == [1, 2]
    first = points[0]
    assert first.output_tokens_per_s == pytest.approx(9.1207, abs=1e-3)
    assert first.ttft_p50_ms == pytest.approx(148.22, abs=1e-2)
    assert first.ttft_p95_ms == pytest.approx(179.27, abs=1e-2)
    assert first.itl_p50_ms < first.itl_p95_ms
    assert (first.successful, first.errored, first.incomplete) == (2, 0, 0)
    assert ServingPoint.from_json(first.to_json()) == first


def test_parse_report_names_what_is_missing() -> None:
    with pytest.raises(LoadGeneratorError, match="metrics"):
        parse_report({"benchmarks": [{"config": {"strategy": {"streams": 1}}}]})


def test_scenario_streams_one_benchmark_at_one_concurrency(tmp_path: Path) -> None:
    workload = synthetic_workload(128, 64, [1, 8])
    data = scenario("http://x:1", COMPLETIONS_ROUTE, workload.data[8], tmp_path, 8, 16, seed=8)
    spec = data["spec"]
    assert spec["backend"]["request_format"] == "/v1/completions"
    assert spec["backend"]["api_routes"] == {"/health": "v1/models"}
    assert spec["backend"]["extras"] == {"body": {"temperature": 0.0}}  # greedy by default
    assert spec["profile"] == {"kind": "concurrent", "streams": 8}
    assert spec["data"] == [{"kind": "synthetic_text", "prompt_tokens": 128, "output_tokens": 64}]
    assert spec["constraints"] == [{"kind": "max_requests", "count": 16}]
    assert spec["tokenizer"]["model"] == str(tmp_path)
    assert spec["seed"] == {"kind": "static", "value": 8}


class TemplateTokenizer:
    """Just what ``grounded_workload`` uses of a tokenizer."""

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        assert kwargs == {"tokenize": False, "add_generation_prompt": True}
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_grounded_workload_writes_the_templated_grounded_prompts(tmp_path: Path) -> None:
    source = "x" * 120
    workload = parse_workload(
        {
            "categories": {
                "code": {"input_grounded": True},
                "chat": {"input_grounded": False},
            },
            "prompts": [
                {
                    "id": "c1",
                    "category": "code",
                    "source": source,
                    "messages": [{"role": "user", "content": "edit {source}"}],
                },
                {"id": "o1", "category": "chat", "messages": [{"role": "user", "content": "hi"}]},
            ],
        }
    )
    tokenizer = TemplateTokenizer()
    loaded = grounded_workload(workload, tokenizer, 64, [1, 2], tmp_path)  # type: ignore[arg-type]
    assert sorted(loaded.data) == [1, 2]
    for c in (1, 2):
        path = tmp_path / f"grounded-c{c}.jsonl"
        assert loaded.data[c] == {"kind": "json_file", "path": str(path)}
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        # only the grounded prompt, tagged so that no concurrency reuses another's prompts
        expected = f"<user>[{c}.0] edit {source}<assistant>"
        assert rows == [{"prompt": expected, "output_tokens_count": 64}]


# ---------------------------------------------------------------------------- report


def results_of(ours: list[ServingPoint], peer: list[ServingPoint]) -> ServingResults:
    results = ServingResults({"synthetic": "synthetic text"}, ours=["hybridspec-ngram"])
    results.add("synthetic", "hybridspec-ngram", ours)
    results.add("synthetic", "llama-server", peer)
    return results


def test_ratios_and_goals_per_concurrency() -> None:
    ours = [point(1, 30.0, 200.0), point(2, 80.0, 150.0), point(4, 90.0, 400.0)]
    peer = [point(1, 60.0, 100.0), point(2, 40.0, 300.0), point(8, 50.0, 100.0)]
    found = ratios(ours, peer)
    assert [r.concurrency for r in found] == [1, 2]  # only where both ran
    assert found[0].throughput == pytest.approx(0.5)
    assert found[0].ttft_p95 == pytest.approx(2.0)
    assert not found[0].met  # c=1 needs >= 1.0x and TTFT p95 no worse
    assert found[1].throughput == pytest.approx(2.0)
    assert found[1].met  # c=2: exactly 2.0x, TTFT p95 half the peer's


def test_a_peer_without_throughput_gives_no_ratio() -> None:
    (ratio,) = ratios([point(1, 30.0, 200.0)], [point(1, 0.0, 0.0, errored=16)])
    assert ratio.throughput is None and ratio.ttft_p95 is None and not ratio.met


def test_format_results_has_a_points_table_and_a_ratio_row() -> None:
    text = format_results(results_of([point(1, 30.0, 200.0)], [point(1, 60.0, 100.0, 1)]))
    assert "### synthetic: synthetic text" in text
    assert "| hybridspec-ngram | 1 | 30.0 | 100 | 200 | 20.0 | 30.0 | 0/16 |" in text
    assert "| llama-server | 1 | 60.0 | 50 | 100 | 20.0 | 30.0 | 1/17 |" in text
    assert "| hybridspec-ngram / llama-server | 0.50x, 2.00x | 0 of 1 |" in text


def test_format_results_puts_the_library_beside_the_server() -> None:
    results = results_of([point(1, 30.0, 200.0)], [point(1, 60.0, 100.0)])
    results.library["synthetic"] = {"hybridspec-ngram": 40.0}
    text = format_results(results)
    assert "| hybridspec-ngram | 40.0 | 30.0 | 0.75x |" in text


def test_library_rates_of_grounded_prompts(tmp_path: Path) -> None:
    tiny_model_dir = save_tiny_llama(tmp_path / "tiny")
    lines = [{"prompt": f"[1.{i}] hello", "output_tokens_count": 6} for i in range(3)]
    path = tmp_path / "grounded-c1.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    prompts, output_tokens = grounded_prompts(path, limit=2)
    assert (prompts, output_tokens) == (["[1.0] hello", "[1.1] hello"], 6)
    threads = torch.get_num_threads()
    try:
        rates = library_rates(tiny_model_dir, ["none", "ngram"], 1, prompts, 6, 0.0, 0)
    finally:
        torch.set_num_threads(threads)
    assert set(rates) == {"none", "ngram"} and min(rates.values()) > 0


def test_several_thread_counts_name_every_server() -> None:
    args = build_parser().parse_args(["bench", "serve", "--threads", "1", "2", "--peers"])
    specs = _specs(args, Path("m.gguf"))
    names = [s.name for s in specs]
    assert names == [f"hybridspec-{p}-t{t}" for t in (1, 2) for p in ("none", "ngram")]
    argv = specs[-1].argv(1234)
    assert argv[argv.index("--threads") + 1] == "2"


def test_results_round_trip_through_json_and_plot(tmp_path: Path) -> None:
    results = results_of([point(1, 30.0, 200.0), point(2, 50.0, 250.0)], [point(1, 60.0, 90.0)])
    results.library["synthetic"] = {"hybridspec-ngram": 40.0}
    assert ServingResults.from_json(json.loads(json.dumps(results.to_json()))) == results
    plot_serving(results, tmp_path / "serve.png")
    assert (tmp_path / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- servers


def fake_server(root: Path) -> ServerSpec:
    """Python's http.server over ``root``, which holds the file /v1/models."""
    (root / "v1").mkdir(parents=True, exist_ok=True)
    (root / "v1" / "models").write_text('{"data": []}')

    def argv(port: int) -> list[str]:
        return [
            *[sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
            *["--directory", str(root)],
        ]

    return ServerSpec("fake", argv, ours=False)


def test_running_waits_for_the_server_and_stops_it(tmp_path: Path) -> None:
    spec = fake_server(tmp_path / "root")
    with running(spec, tmp_path / "fake.log", ready_timeout_s=30) as url:
        response = urllib.request.urlopen(url + "/v1/models", timeout=5)
        assert json.loads(response.read()) == {"data": []}
        response.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/v1/models", timeout=2)


def test_a_server_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    def argv(port: int) -> list[str]:
        return [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]

    with (
        pytest.raises(ServerStartError, match=r"exited with 3(.|\n)*no model here") as raised,
        running(ServerSpec("broken", argv, ours=False), tmp_path / "broken.log"),
    ):
        pass
    assert isinstance(raised.value, HybridSpecError)  # a command reports it without a traceback


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_a_missing_llama_server_is_skipped(tmp_path: Path) -> None:
    assert llama_server_spec(tmp_path / "nowhere", tmp_path / "m.gguf", 2, 8) is None


def test_bench_serve_is_a_subcommand_of_bench() -> None:
    args = build_parser().parse_args(["bench", "serve", "--concurrency", "1", "2"])
    assert args.run.__name__ == "run_bench_serve"
    assert args.concurrency == [1, 2]
    assert build_parser().parse_args(["bench"]).run.__name__ == "run_bench"


def test_hybridspec_gets_its_threads_from_serve_threads(tmp_path: Path) -> None:
    spec = hybridspec_spec("ngram", tmp_path / "m.gguf", threads=1, max_num_seqs=8)
    assert spec.env == {"NUMBA_NUM_THREADS": "1"}
    argv = spec.argv(1234)
    assert argv[argv.index("--threads") + 1] == "1"
    assert argv[argv.index("--proposer") + 1] == "ngram"
    assert argv[argv.index("--port") + 1] == "1234"
    assert spec.name == "hybridspec-ngram" and spec.ours
