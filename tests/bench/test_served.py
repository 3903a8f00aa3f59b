"""``hybridspec bench --served``: the bench's trials through a ``hybridspec serve`` it starts.

A served bench on a tiny random Llama (its records, the ``--vs-none`` ratios, the server
stopped after), the served requests against the library's on the same prompts (the same
tokens and counts), the client threads' closed loop, the server's command line and the
combinations refused before any server starts. Nothing here measures speed.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import pytest

from hybridspec.bench.harness import BenchConfig, sampling_for
from hybridspec.bench.served import (
    ServedMethod,
    client_closed_loop,
    engine_step_seconds,
    served_methods,
)
from hybridspec.bench.session import ModelOptions, bench_server, open_session
from hybridspec.bench.workload import parse_workload
from hybridspec.cli import main
from hybridspec.engine import GenerationParams
from hybridspec.errors import InvalidRequestError
from hybridspec.types import SamplingParams
from tests.bench.test_bench import tiny_workload
from tests.conftest import TinyLlamaFactory

K, MAX_NEW = 4, 8


def test_served_bench_records_every_trial_and_the_ratios_to_none(
    make_tiny_llama_dir: TinyLlamaFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = make_tiny_llama_dir(max_position_embeddings=1024)
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps(tiny_workload()))
    out = tmp_path / "out"
    argv = ["bench", "--served", "--target", str(model_dir), "--workload", str(workload)]
    argv += ["--dtype", "float32", "--max-new-tokens", str(MAX_NEW), "-k", str(K)]
    argv += ["--methods", "none", "ngram", "--concurrency", "2", "--vs-none"]
    argv += ["--threads", "1", "--output-dir", str(out)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "served: every engine method through hybridspec serve at http://127.0.0.1:" in stdout
    assert "== vs none" in stdout

    report = json.loads((out / "bench.json").read_text())
    assert report["meta"]["served"].endswith(
        "(2 slots, 1 threads, prefix cache off, a twin engine for none)"
    )
    assert report["meta"]["methods"] == ["none", "ngram"]
    # Pairs (``harness``): ngram beside the server's twin none, 2 prompts x 2 temperatures one
    # at a time, then at once per group (open-ended and input-grounded apart, as --vs-none runs
    # them) at each temperature; two records a pair.
    records = report["records"]
    assert len(records) == 2 * (4 + 4)
    for mine, theirs in zip(records[::2], records[1::2], strict=True):
        assert (mine["method"], mine["beside"]) == ("ngram", "none")
        assert (theirs["method"], theirs["beside"]) == ("none", "ngram")
        for key in ("prompt_ids", "temperature", "repeat", "concurrency"):
            assert mine[key] == theirs[key]
    concurrent = [r for r in records if r["category"] is None]
    assert {tuple(r["prompt_ids"]) for r in concurrent} == {("copy-1", "copy-1"), ("story-1",) * 2}
    for r in records:
        assert r["measurement"]["forward_s"] is None  # not observed through a server
        assert r["measurement"]["first_token_s"] is None  # a paired request's is not timed
        assert r["measurement"]["elapsed_s"] > 0  # its engine's seconds of steps
        for request in r["measurement"]["requests"]:
            assert 1 <= request["num_generated"] <= MAX_NEW
            assert request["target_forwards"] >= 1
            assert request["num_accepted_tokens"] <= request["num_drafts"]
    none_requests = [
        q for r in records if r["method"] == "none" for q in r["measurement"]["requests"]
    ]
    assert all(q["num_drafts"] == 0 for q in none_requests)
    agreement = report["greedy_agreement"]
    assert agreement["reference"] == "none"
    assert agreement["methods"]["ngram"] == {"identical": 2, "compared": 2, "first_divergence": []}
    cells = {(c["method"], c["temperature"], c["group"]): c for c in report["cells"]}
    assert cells[("none", 0.0, "all")]["outside_forward_share"] is None
    assert cells[("ngram", 0.8, "concurrent x2")]["speedup_vs_none"] > 0
    rows = [line.split() for line in stdout.splitlines() if line.startswith("ngram ")]
    # ngram over none: 2 groups x 2 temperatures, alone and 2 at once, every one measured
    assert len(rows) == 8 and all(row[4] != "-" for row in rows)
    assert {row[3] for row in rows} == {"x1", "x2"}
    log = (out / "serve.log").read_text()
    assert "Traceback" not in log
    assert "held the steps" not in log  # each pair's hold ended when both loops' requests were in
    url = report["meta"]["served"].split()[3]
    with pytest.raises(OSError):  # stopped when the bench ended
        urllib.request.urlopen(url + "/v1/models", timeout=2)


def test_served_requests_generate_what_the_library_does(
    make_tiny_llama_dir: TinyLlamaFactory, tmp_path: Path
) -> None:
    """The same prompt, sampling and proposer give the same text, its tokens counted the same
    way (the EOS token that ends a request included), served or in the library."""
    model_dir = make_tiny_llama_dir(max_position_embeddings=1024)
    workload = parse_workload(tiny_workload())
    options = ModelOptions(str(model_dir), dtype="float32", threads=1)
    config = BenchConfig(max_new_tokens=24)
    cases = [(m, t, i) for m in ("none", "ngram") for t in (0.0, 0.8) for i in range(2)]
    library = open_session(workload, options, ["none"], K, config)
    try:
        assert library.engine is not None
        expected = [
            library.engine.generate(
                prompt_token_ids=library.prompts[i].token_ids,
                params=GenerationParams(
                    max_new_tokens=config.max_new_tokens,
                    sampling=sampling_for(t, 0, 0, i),
                    proposer=m,
                    num_speculative_tokens=K,
                ),
            )
            for m, t, i in cases
        ]
    finally:
        library.close()
    served = open_session(workload, options, ["none", "ngram"], K, config, tmp_path / "s.log")
    try:
        methods = {m.name: m for m in served.methods if isinstance(m, ServedMethod)}
        assert list(methods) == ["none", "ngram"]
        got = [
            methods[m].send(
                methods[m].body(
                    served.prompts[i].token_ids, sampling_for(t, 0, 0, i), config.max_new_tokens
                )
            )
            for m, t, i in cases
        ]
        record = methods["none"].run(served.prompts[0].token_ids, SamplingParams(), 24)
        url = methods["none"].url
        with pytest.raises(InvalidRequestError, match=r"runs no \['eagle-9'\]"):
            served_methods(url, ["none", "eagle-9"], K, list)
        # one request at a time: no pairs, so the server runs no twin to pair with
        assert served.twin is None and set(engine_step_seconds(url)) == {"main"}
        pair = ([served.prompts[0].token_ids], [SamplingParams()], 4, 1)
        with pytest.raises(InvalidRequestError, match="runs no twin"):
            methods["ngram"].run_beside(methods["none"], *pair)
        with pytest.raises(InvalidRequestError, match="a served pair is a method and 'none'"):
            methods["none"].run_beside(methods["ngram"], *pair)
    finally:
        served.close()
    for (method, t, _), a, b in zip(cases, got, expected, strict=True):
        if t == 0 or method == "none":  # speculation's sampled tokens depend on its drafts
            assert a.text == b.text, (method, t)
            assert a.num_generated == b.stats.generated_tokens, (method, t)
        if method == "none":  # one forward per token, nothing drafted
            assert a.target_forwards == b.stats.target_forwards == a.num_generated
            assert a.num_drafts == 0
    assert any(a.num_generated == len(b.token_ids) + 1 for a, b in zip(got, expected, strict=True))
    tokenizer = served.target.tokenizer
    assert record.requests[0].token_ids == tuple(
        tokenizer.encode(got[0].text, add_special_tokens=False)
    )
    assert record.forward_s is None and record.first_token_s is not None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--methods", "none", "hf-plain"], r"\['hf-plain'\] run only in the library bench"),
        (["--methods", "llamacpp-plain"], r"\['llamacpp-plain'\] run only in the library"),
        (["--methods", "none", "--threads", "0"], "not 0"),
    ],
)
def test_served_refuses_what_only_the_library_runs(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--served", "--target", str(tmp_path / "missing"), *extra]
    assert main([*argv, "--output-dir", str(tmp_path)]) == 2  # before loading anything
    assert message.replace("\\", "") in capsys.readouterr().err.replace("\\", "")
    assert not (tmp_path / "serve.log").exists()


def test_the_bench_server_runs_the_bench_engine_options() -> None:
    options = ModelOptions(None, "draft-dir", "float32", "cpu", "none", threads=2)
    spec = bench_server(options, num_speculative_tokens=5, max_seq_len=300, max_num_seqs=8)
    argv = spec.argv(4321)
    flags = dict(zip(argv[4::2], argv[5::2], strict=True))
    assert argv[3] == "serve" and (flags["--host"], flags["--port"]) == ("127.0.0.1", "4321")
    assert "--target" not in argv  # the embedded model, as the bench's default
    assert flags["--draft"] == "draft-dir" and flags["--dtype"] == "float32"
    assert flags["--prefix-cache-mb"] == "0"  # every trial prefills its prompt
    assert flags["--suffix-isolation"] == "per-session"  # a suffix pool per pass
    assert (flags["--max-seq-len"], flags["--max-num-seqs"], flags["-k"]) == ("300", "8", "5")
    assert flags["--threads"] == "2" and spec.env == {"NUMBA_NUM_THREADS": "2"}
    auto = bench_server(ModelOptions(threads="auto"), 4, 300, 1)
    assert "auto" in auto.argv(1) and auto.env == {}


def test_a_request_names_its_pass_as_its_user() -> None:
    method = ServedMethod("http://127.0.0.1:1", "suffix", 4, list)
    body = method.body([1, 2], SamplingParams(temperature=0.8, seed=3), 8, "bench-r1-t0.8-x1")
    assert body["user"] == "bench-r1-t0.8-x1" and body["seed"] == 3
    assert "user" not in method.body([1, 2], SamplingParams(), 8)  # the warm-up: no pool


def test_client_closed_loop_keeps_n_requests_in_flight_in_order() -> None:
    concurrency, lock = 3, threading.Lock()
    started = threading.Barrier(concurrency, timeout=30)  # the first N are in flight together
    in_flight, most = [0], [0]

    def send(request: int) -> int:
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        if request < concurrency:
            started.wait()
        with lock:
            in_flight[0] -= 1
        return 10 * request

    results, elapsed = client_closed_loop(send, list(range(7)), concurrency)
    assert results == [10 * i for i in range(7)] and elapsed >= 0
    assert most[0] == concurrency
