"""The benchmark harness: pure pieces on hand-built records, the transformers baseline against
the native forward, and a smoke run of ``hybridspec bench`` on a tiny random Llama.

Nothing here measures speed: the smoke run only checks that the table, JSON and PNG come out
and that the figures are consistent (counts, ranges, parity), never how fast anything is.
"""

from __future__ import annotations

import gc
import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridspec.bench import session as session_module
from hybridspec.bench.harness import BenchConfig, mixed_prompts, sequential_schedule
from hybridspec.bench.hf_baseline import check_parity, hf_model_from_weights
from hybridspec.bench.records import Measurement, Record, Speculation
from hybridspec.bench.session import ModelOptions, open_session
from hybridspec.bench.summary import (
    ALL,
    GROUNDED,
    Agreement,
    Summary,
    acceptance_per_position,
    greedy_agreement,
)
from hybridspec.bench.targets import CONCURRENCY_TARGETS, SPEED_TARGETS, evaluate_targets
from hybridspec.bench.workload import DEFAULT_WORKLOAD, Category, load_workload, parse_workload
from hybridspec.cli import build_parser, main
from hybridspec.config import ModelConfig
from hybridspec.errors import InvalidRequestError
from hybridspec.model.loader import load_model
from hybridspec.model.runtime import ForwardBatch
from hybridspec.types import SamplingParams
from tests.conftest import TinyLlamaFactory

SOURCE = "The quick brown fox jumps over the lazy dog near the river bank. " * 3


def tiny_workload() -> dict[str, Any]:
    return {
        "name": "tiny",
        "temperatures": [0.0, 0.8],
        "categories": {
            "copy": {"input_grounded": True},
            "story": {"input_grounded": False},
        },
        "prompts": [
            {
                "id": "copy-1",
                "category": "copy",
                "source": SOURCE,
                "messages": [{"role": "user", "content": "Repeat: {source}"}],
            },
            {
                "id": "story-1",
                "category": "story",
                "messages": [{"role": "user", "content": "Tell a story about a fox."}],
            },
        ],
    }


# --------------------------------------------------------------------------- workload


def test_shipped_workload_has_seven_categories_of_four_prompts() -> None:
    workload = load_workload(DEFAULT_WORKLOAD)
    assert len(workload.categories) == 7
    assert {c.input_grounded for c in workload.categories.values()} == {True, False}
    assert set(workload.temperatures) == {0.0, 0.8}
    for name in workload.categories:
        assert sum(p.category == name for p in workload.prompts) >= 4, name
    raw = json.loads(DEFAULT_WORKLOAD.read_text())
    for prompt, parsed in zip(raw["prompts"], workload.prompts, strict=True):
        if "source" in prompt:  # substituted into the last message, verbatim
            assert prompt["source"] in parsed.messages[-1]["content"]


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda p: p[0].pop("source"), "prompts[0].source"),
        (lambda p: p[0]["messages"][0].update(content="no placeholder"), "prompts[0].messages"),
        (lambda p: p[1].update(source=SOURCE), "prompts[1].source"),
        (lambda p: p[1].update(category="poetry"), "prompts[1].category"),
        (lambda p: p[1].update(id="copy-1"), "prompts"),
    ],
)
def test_invalid_workload_names_the_field(edit: Any, field: str) -> None:
    data = tiny_workload()
    edit(data["prompts"])
    with pytest.raises(InvalidRequestError) as info:
        parse_workload(data)
    assert info.value.param == field


def test_select_keeps_category_order_and_count() -> None:
    workload = load_workload(DEFAULT_WORKLOAD).select(["math_reasoning", "code_editing"], 2)
    assert [p.category for p in workload.prompts] == ["math_reasoning"] * 2 + ["code_editing"] * 2
    with pytest.raises(InvalidRequestError, match="unknown"):
        workload.select(["poetry"])


# --------------------------------------------------------------------------- schedule


def test_schedule_rotates_which_method_runs_first() -> None:
    trials = sequential_schedule(num_prompts=6, num_methods=3, temperatures=[0.0], repeats=1)
    assert len(trials) == 18
    firsts = [trials[3 * p].method for p in range(6)]
    assert sorted(firsts) == [0, 0, 1, 1, 2, 2]
    for p in range(6):  # every method once per prompt
        assert sorted(t.method for t in trials[3 * p : 3 * p + 3]) == [0, 1, 2]


def test_mixed_prompts_takes_categories_in_turn() -> None:
    assert mixed_prompts(["x", "x", "y", "z"], 5) == (0, 2, 3, 1, 0)


# --------------------------------------------------------------------------- summary


def record(
    method: str,
    repeat: int,
    category: str,
    tokens: int,
    seconds: float,
    forward_s: float,
    drafts: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    forwards: int | None = None,
) -> Record:
    accepted, proposed = drafts if drafts is not None else ((), ())
    speculation = Speculation(
        token_ids=tuple(range(tokens)),
        num_generated=tokens,
        target_forwards=forwards if forwards is not None else tokens,
        num_drafts=sum(proposed),
        num_accepted_tokens=sum(accepted),
        accepted_per_position=accepted,
        proposed_per_position=proposed,
    )
    return Record(
        method,
        0.0,
        repeat,
        (f"{category}-1",),
        category,
        Measurement((speculation,), seconds, forward_s),
        load_average=0.0,
    )


CATEGORIES = {"code": Category("code", True), "chat": Category("chat", False)}


def test_speedup_is_the_median_of_per_repeat_ratios() -> None:
    records = [
        record("none", 0, "code", 100, 10.0, 9.0),  # 10 tokens/s
        record("none", 1, "code", 100, 5.0, 4.5),  # 20 tokens/s
        record("ngram", 0, "code", 100, 100 / 30, 3.0, ((30, 20), (40, 30)), 50),  # 30/s
        record("ngram", 1, "code", 100, 100 / 40, 2.0, ((10, 5), (10, 10)), 25),  # 40/s
    ]
    summary = Summary(records, CATEGORIES)
    assert summary.speedup("ngram", "none", "code", 0.0) == pytest.approx((3.0 + 2.0) / 2)
    cell = summary.cell("ngram", 0.0, GROUNDED)
    assert cell is not None
    assert cell.tokens_per_s == pytest.approx(35.0)
    assert cell.speedup_vs_none == pytest.approx(2.5)
    assert cell.speedup_vs_hf_plain is None  # not run
    assert cell.acceptance_rate == pytest.approx(65 / 90)
    assert cell.mean_accepted_length == pytest.approx(200 / 75)
    assert cell.acceptance_per_position == pytest.approx((40 / 50, 25 / 40))
    assert cell.outside_forward_share == pytest.approx(
        ((1 - 3.0 / (100 / 30)) + (1 - 2.0 / (100 / 40))) / 2
    )
    none = summary.cell("none", 0.0, "code")
    assert none is not None and none.acceptance_rate is None
    assert none.mean_accepted_length == 1.0
    assert summary.cell("ngram", 0.0, "chat") is None  # nothing measured there


def test_decode_rate_and_time_to_first_token_leave_the_prefill_apart() -> None:
    def timed(method: str, repeat: int, tokens: int, seconds: float, first: float | None) -> Record:
        speculation = Speculation(tuple(range(tokens)), tokens, tokens, 0, 0)
        measurement = Measurement((speculation,), seconds, seconds, first)
        return Record(method, 0.0, repeat, ("code-1",), "code", measurement, 0.0)

    records = [
        timed("none", 0, 64, 4.0, 0.85),  # 63 / 3.15 = 20 tokens/s after the first
        timed("none", 1, 64, 3.5, 0.35),  # 63 / 3.15 again
        timed("llamacpp-plain", 0, 64, 5.05, 0.55),  # 63 / 4.5 = 14 tokens/s
        timed("llamacpp-plain", 1, 64, 4.75, 0.25),  # 14 again
        timed("hf-plain", 0, 64, 4.0, None),  # not observed
    ]
    summary = Summary(records, CATEGORIES)
    none = summary.cell("none", 0.0, "code")
    assert none is not None and none.decode_tokens_per_s == pytest.approx(20.0)
    assert none.first_token_ms == pytest.approx((850 + 350) / 2)
    assert none.tokens_per_s == pytest.approx((16.0 + 64 / 3.5) / 2)  # prefill included
    assert none.decode_vs_llamacpp_plain == pytest.approx(20 / 14)
    hf = summary.cell("hf-plain", 0.0, "code")
    assert hf is not None and hf.decode_tokens_per_s is None and hf.first_token_ms is None


def test_greedy_agreement_finds_where_outputs_diverge() -> None:
    def run(method: str, prompt: str, tokens: tuple[int, ...]) -> Record:
        speculation = Speculation(tokens, len(tokens), len(tokens), 0, 0)
        measurement = Measurement((speculation,), 1.0, 1.0)
        return Record(method, 0.0, 0, (prompt,), "code", measurement, 0.0)

    records = [
        run("none", "a", (1, 2, 3)),
        run("none", "b", (1, 2, 3)),
        run("ngram", "a", (1, 2, 3)),
        run("ngram", "b", (1, 5, 3)),
        run("hf-plain", "a", (1, 2)),
    ]
    agreement = greedy_agreement(records, "none")
    assert agreement["ngram"] == Agreement(identical=1, compared=2, first_divergence=(1,))
    assert agreement["hf-plain"] == Agreement(identical=0, compared=1, first_divergence=(2,))
    assert set(agreement) == {"ngram", "hf-plain"}


def test_greedy_agreement_compares_each_request_of_a_concurrent_trial() -> None:
    def run(method: str, prompts: tuple[str, ...], *outputs: tuple[int, ...]) -> Record:
        requests = tuple(Speculation(t, len(t), len(t), 0, 0) for t in outputs)
        category = "code" if len(prompts) == 1 else None
        return Record(
            method, 0.0, 0, prompts, category, Measurement(requests, 1.0, None), 0.0, len(prompts)
        )

    records = [
        run("none", ("a",), (1, 2, 3)),
        run("none", ("b",), (4, 5, 6)),
        run("none", ("a", "b", "a"), (1, 2, 3), (4, 5, 7), (1, 2, 3)),  # b's last token differs
        run("ngram", ("b", "a", "b"), (4, 5, 6), (1, 2, 3), (4, 5, 6)),
    ]
    agreement = greedy_agreement(records, "none")
    assert agreement["none x3"] == Agreement(identical=2, compared=3, first_divergence=(2,))
    assert agreement["ngram x3"] == Agreement(identical=3, compared=3, first_divergence=())
    assert set(agreement) == {"none x3", "ngram x3"}


def test_acceptance_per_position_pools_requests() -> None:
    a = Speculation((), 0, 0, 6, 4, (3, 1), (4, 2))
    b = Speculation((), 0, 0, 2, 1, (1,), (2,))
    assert acceptance_per_position([a, b]) == pytest.approx((4 / 6, 1 / 2))
    assert acceptance_per_position([a, Speculation((), 0, 0, 0, 0)]) is None


def test_targets_pass_fail_and_not_measured() -> None:
    records = [
        record("none", 0, "code", 100, 10.0, 9.95),  # 10/s, 0.5% outside
        record("ngram", 0, "code", 100, 2.0, 1.0),  # 50/s: 5x none, 50% outside
        record("none", 0, "chat", 100, 10.0, 9.95),
        record("ngram", 0, "chat", 100, 20.0, 19.0),  # 0.5x none
        record("hf-plain", 0, "code", 100, 10.0, 9.0),
        record("hf-plain", 0, "chat", 100, 10.0, 9.0),
        record("llamacpp-plain", 0, "code", 100, 10.0, 9.0),  # 10/s: ngram 5x on code
        record("llamacpp-plain", 0, "chat", 100, 10.0, 9.0),
    ]
    results = {r.description: r for r in evaluate_targets(Summary(records, CATEGORIES))}
    by_target = [results[t.description] for t in SPEED_TARGETS]
    statuses = ["fail", "not measured", "pass", "fail", "not measured"]
    statuses += ["pass", "pass", "not measured"]  # llama.cpp: plain run, prompt lookup not
    assert [r.status for r in by_target] == statuses
    assert by_target[0].value == pytest.approx(10 / 10)
    assert by_target[6].value == pytest.approx(5.0)
    overhead = {d.split(":")[0]: r for d, r in results.items() if "outside" in d}
    assert overhead["none"].status == "pass"
    assert overhead["ngram"].status == "fail" and overhead["ngram"].value == pytest.approx(0.5)


# ------------------------------------------------------------------ transformers baseline


@pytest.mark.parametrize("tied", [False, True])
def test_hf_model_shares_and_matches_the_native_weights(
    make_tiny_llama_dir: TinyLlamaFactory, tied: bool
) -> None:
    loaded = load_model(
        ModelConfig(str(make_tiny_llama_dir(tie_word_embeddings=tied)), dtype="float32")
    )
    model = hf_model_from_weights(loaded)
    assert model.model.layers[0].self_attn.q_proj.weight.untyped_storage().data_ptr() == (
        loaded.weights.layers[0].wqkv.untyped_storage().data_ptr()  # type: ignore[union-attr]
    )
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    token_ids = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
    runtime = loaded.create_runtime(1, 64)
    ours = runtime.forward(ForwardBatch.from_lists([runtime.allocate()], [token_ids])).logits
    with torch.inference_mode():
        theirs = model(input_ids=torch.tensor([token_ids])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_parity_check_reports_a_mismatch(make_tiny_llama_dir: TinyLlamaFactory) -> None:
    loaded = load_model(ModelConfig(str(make_tiny_llama_dir()), dtype="float32"))
    model = hf_model_from_weights(loaded)
    prompt = [256, 72, 105]
    same = check_parity(("none", [5, 6, 7]), ("hf-plain", [5, 6, 7]), model, prompt)
    assert same.identical and "identical" in same.message()
    differ = check_parity(("none", [5, 6, 7]), ("hf-plain", [5, 9, 7]), model, prompt)
    assert differ.first_mismatch == 1 and (differ.our_token, differ.their_token) == (6, 9)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[*prompt, 5]])).logits[0, -1]
    assert differ.logit_gap == pytest.approx(float(logits[9] - logits[6]), abs=1e-5)
    assert differ.message().startswith("PARITY MISMATCH")
    shorter = check_parity(("none", [5, 6]), ("hf-plain", [5, 6, 7]), model, prompt)
    assert shorter.first_mismatch == 2 and shorter.our_token is None


# ------------------------------------------------------------------------ smoke run


def test_cli_registers_bench() -> None:
    args = build_parser().parse_args(["bench", "--methods", "none", "hf-plain"])
    assert args.methods == ["none", "hf-plain"] and args.max_new_tokens == 128


def test_bench_smoke_on_tiny_llama(
    make_tiny_llama_dir: TinyLlamaFactory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_dir = make_tiny_llama_dir(max_position_embeddings=1024)
    draft_dir = make_tiny_llama_dir(seed=1, max_position_embeddings=1024)
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps(tiny_workload()))
    out = tmp_path / "out"
    k, max_new = 4, 8
    methods = ["none", "ngram", "draft", "hf-plain", "hf-prompt-lookup"]
    argv = ["bench", "--target", str(model_dir), "--draft", str(draft_dir)]
    argv += ["--workload", str(workload), "--dtype"]
    argv += ["float32", "--max-new-tokens", str(max_new), "-k", str(k), "--methods", *methods]
    argv += ["--concurrency", "2", "--output-dir", str(out), "--threads", "0"]
    threads = torch.get_num_threads()
    frozen: list[int] = []  # the trials run on a frozen heap, unfrozen after them
    trials = session_module.run_benchmark
    monkeypatch.setattr(
        session_module,
        "run_benchmark",
        lambda *a, **k: (frozen.append(gc.get_freeze_count()), trials(*a, **k))[1],
    )
    gc.unfreeze()
    assert main(argv) == 0
    assert torch.get_num_threads() == threads
    assert frozen[0] > 1_000 and gc.get_freeze_count() == 0
    captured = capsys.readouterr()
    stdout = captured.out
    records = 2 * 2 * (2 * 2 + 2) + 2 * 4  # see below
    assert f"{records}/{records}" in captured.err  # the progress bar counts every record
    for text in ("parity: hf-plain and none", "== greedy ==", "== sampled", "== targets =="):
        assert text in stdout
    assert "copy [G]" in stdout and "story [O]" in stdout and "concurrent x2" in stdout

    report = json.loads((out / "bench.json").read_text())
    assert report["parity"]["identical"] is True  # float32: the same weights, the same tokens
    agreement = report["greedy_agreement"]["methods"]
    for method in ("ngram", "draft"):  # lossless speculation
        assert agreement[method] == {"identical": 2, "compared": 2, "first_divergence": []}
    # none's runs beside ngram's and draft's, each prompt's compared with its first
    assert agreement["none"] == {"identical": 4, "compared": 4, "first_divergence": []}
    # 2 prompts x 2 temperatures: the 2 other engine methods, each beside the twin's none
    # (ngram|none draft|none, harness "Pairs"), and the 2 transformers ones; then at once at
    # each temperature the 2 engine methods' pairs again
    assert len(report["records"]) == records
    alone = [r for r in report["records"] if r["category"] is not None]
    paired = [r for r in alone if r["beside"] is not None]
    assert [r["method"] for r in alone if r["beside"] is None] == [
        "hf-plain",
        "hf-prompt-lookup",
    ] * 4
    for a, b in zip(paired[::2], paired[1::2], strict=True):
        assert (a["method"], a["beside"], b["method"], b["beside"]) in (
            ("ngram", "none", "none", "ngram"),
            ("draft", "none", "none", "draft"),
        )
        assert a["prompt_ids"] == b["prompt_ids"] and a["temperature"] == b["temperature"]
        for r in (a, b):
            measurement = r["measurement"]
            assert 0 < measurement["first_token_s"] <= measurement["elapsed_s"]
    concurrent = [r for r in report["records"] if r["category"] is None]
    pairs = [(a["method"], a["beside"], b["method"], b["beside"]) for a, b in pairwise(concurrent)]
    assert (
        pairs[::2] == [("ngram", "none", "none", "ngram"), ("draft", "none", "none", "draft")] * 2
    )
    for r in concurrent:  # every prompt, categories alternating, 2 at a time
        assert r["prompt_ids"] == ["copy-1", "story-1"] and r["concurrency"] == 2
        assert len(r["measurement"]["requests"]) == 2
    for r in report["records"]:
        for request in r["measurement"]["requests"]:
            assert request["num_accepted_tokens"] <= request["num_drafts"]
            assert request["num_generated"] <= (
                request["target_forwards"] + request["num_accepted_tokens"]
            )
    cells = {(c["method"], c["temperature"], c["group"]): c for c in report["cells"]}
    for cell in report["cells"]:
        assert cell["tokens_per_s"] > 0 and 1 <= cell["mean_generated"] <= max_new
        assert 0 <= cell["outside_forward_share"] < 1
        assert cell["mean_accepted_length"] is not None
        assert 1 <= cell["mean_accepted_length"] <= k + 1
        assert cell["acceptance_rate"] is None or 0 <= cell["acceptance_rate"] <= 1
        assert all(0 <= a <= 1 for a in cell["acceptance_per_position"] or [])
    for method in ("none", "hf-plain"):  # one token per forward, nothing proposed
        cell = cells[(method, 0.0, ALL)]
        assert cell["mean_accepted_length"] == 1.0 and cell["acceptance_rate"] is None
    assert cells[("none", 0.0, ALL)]["speedup_vs_none"] == 1.0
    assert cells[("none", 0.0, ALL)]["decode_tokens_per_s"] > 0  # after the first token
    assert cells[("none", 0.0, ALL)]["first_token_ms"] > 0
    assert cells[("hf-plain", 0.0, ALL)]["decode_tokens_per_s"] is None  # not observed
    bound = report["meta"]["memory_bound"]  # none's bytes x decode rate over a 1 GiB read
    assert bound["bytes_per_token"] > 0 and bound["share"] > 0
    assert "memory bound (none, greedy, all prompts)" in stdout
    for method in ("none", "ngram", "draft"):  # over one none request at a time
        assert cells[(method, 0.0, "concurrent x2")]["speedup_vs_none"] > 0
    assert cells[("hf-plain", 0.8, ALL)]["speedup_vs_hf_plain"] == 1.0
    for method in ("ngram", "draft"):
        assert cells[(method, 0.0, "copy")]["acceptance_per_position"] is not None
    assert cells[("hf-prompt-lookup", 0.0, "copy")]["acceptance_per_position"] is None
    statuses = {t["status"] for t in report["targets"]}
    assert statuses <= {"pass", "fail", "not measured"}
    assert len(report["targets"]) == len(SPEED_TARGETS) + len(CONCURRENCY_TARGETS) + 2 * 2
    measured = [t for t in report["targets"] if t["description"].startswith("2 concurrent")]
    assert len(measured) == len(CONCURRENCY_TARGETS)
    assert all(t["status"] != "not measured" for t in measured)
    png = (out / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_every_trial_prefills_its_whole_prompt(
    make_tiny_llama_dir: TinyLlamaFactory,
) -> None:
    """The bench's engine keeps no prefix cache: a method that runs a prompt after another did
    prefills it as the first did (and as the llama.cpp baselines do), not from a cached entry."""
    model_dir = make_tiny_llama_dir(max_position_embeddings=1024)
    workload = parse_workload(tiny_workload())
    options = ModelOptions(str(model_dir), threads=None)
    session = open_session(workload, options, ["none", "ngram"], 4, BenchConfig(max_new_tokens=4))
    try:
        prompt = session.prompts[0].token_ids
        for method in session.methods:
            method.run(prompt, SamplingParams(), 4)
        assert session.engine.prefix_cache.num_slots == 0
        assert session.engine.prefix_cache.stats().hits == 0
        # suffix's text pools per session: one per pass of the schedule (harness, "Passes")
        assert session.engine.config.suffix.isolation == "per-session"
    finally:
        session.close()
