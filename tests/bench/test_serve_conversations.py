"""``bench serve``'s conversational workloads (multi-turn, repeat) against a live server on the
tiny model: what each request sends, what is timed, and the report's table and JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from hybridspec.bench.serve_conversations import (
    ConversationPlan,
    ConversationServing,
    run_conversational,
    stream_completion,
)
from hybridspec.bench.serving_report import ServingResults, conversational_table, format_results
from hybridspec.bench.workload import parse_workload
from hybridspec.config import EngineConfig, ModelConfig
from hybridspec.engine import Engine
from hybridspec.model.loader import load_model
from hybridspec.server import ServerConfig, create_app
from tests.conftest import save_tiny_llama, tiny_tokenizer
from tests.server.conftest import TINY_MODEL_NAME, serve_in_thread

EDIT = [{"role": "user", "content": "edit {source}"}]
WORKLOAD = parse_workload(
    {
        "categories": {"code": {"input_grounded": True}, "chat": {"input_grounded": False}},
        "prompts": [
            {"id": "c1", "category": "code", "source": "ab " * 34, "messages": EDIT},
            {"id": "o2", "category": "chat", "messages": [{"role": "user", "content": "yes"}]},
            {"id": "o1", "category": "chat", "messages": [{"role": "user", "content": "hi"}]},
        ],
    }
)


def recording_app(directory: Path, bodies: list[dict[str, Any]]) -> FastAPI:
    """The tiny model's app, with every completions body it receives appended to ``bodies``."""
    model = load_model(ModelConfig(str(directory), dtype="float32"))
    target = ModelConfig(str(directory), dtype="float32", max_num_seqs=2)
    config = ServerConfig(
        engine=EngineConfig(target=target, prefix_cache_mb=8),
        served_model_name=TINY_MODEL_NAME,
    )
    app = create_app(config, engine_factory=lambda cfg: Engine(cfg, target=model))

    @app.middleware("http")
    async def record(request: Any, call_next: Any) -> Any:
        if request.url.path.endswith("/completions"):
            bodies.append(json.loads(await request.body()))
        return await call_next(request)

    return app


def test_multi_turn_and_repeat_against_a_live_server(tmp_path: Path) -> None:
    bodies: list[dict[str, Any]] = []
    app = recording_app(save_tiny_llama(tmp_path / "tiny"), bodies)
    plan = ConversationPlan.from_workload(
        WORKLOAD, conversations=1, turns=3, prompts=1, output_tokens=4
    )
    assert [p.id for p in plan.conversations[0]] == ["c1", "o2", "o1"]
    assert [p.id for p in plan.repeat] == ["c1"] and [p.id for p in plan.first_time] == ["o2"]
    lines: list[str] = []
    with serve_in_thread(app) as url:
        ours = run_conversational(
            url, plan, tiny_tokenizer(), ["multi-turn", "repeat"], True, lines.append
        )
        peer = run_conversational(url, plan, tiny_tokenizer(), ["multi-turn"], False)
    # ours: each of 3 turns sent cold and cached (6), then the repeat's 2 askings and 1 first-time
    # prompt; as a peer: 3 turns, with the cache
    assert len(bodies) == 6 + 3 + 3
    assert [b["cache_prompt"] for b in bodies[:6]] == [False, True, True, False, False, True]
    assert all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 4 for b in bodies)
    turn3 = bodies[4]["prompt"]
    assert (
        turn3.count("edit ab") == 1
        and "yes" in turn3
        and turn3.endswith("user\nhi<|im_end|>\n<|im_start|>assistant\n")
    )
    assert bodies[6]["prompt"] == bodies[7]["prompt"]  # the repeat's second asking
    assert len(ours.ttft_cached) == len(ours.ttft_cold) == 2 and len(peer.ttft_cached) == 2
    assert peer.ttft_cold == [] and len(ours.repeat_tps) == 1 and len(ours.first_tps) == 1
    assert ours.prompt_tokens[0] < ours.prompt_tokens[1]  # the history grows
    assert all(t > 0 for t in ours.ttft_cached + ours.ttft_cold + ours.repeat_tps)
    assert lines[0].startswith("turn 1: TTFT") and lines[-1].startswith("repeat: ")


def test_a_stream_is_timed_from_its_request(tmp_path: Path) -> None:
    app = recording_app(save_tiny_llama(tmp_path / "tiny"), [])
    with serve_in_thread(app) as url:
        # greedy: a sampled answer may be five bytes of unfinished characters, which the text
        # leaves out (seed 60 does)
        streamed = stream_completion(
            url, "<user>hi<assistant>", {"max_tokens": 5, "temperature": 0}
        )
    assert 0 < streamed.ttft_s <= streamed.total_s and streamed.tokens == 5
    assert streamed.tokens_per_s == 5 / streamed.total_s and streamed.text


def test_table_and_json_round_trip() -> None:
    ours = ConversationServing([0.1, 0.3], [1.0, 2.0], [500, 900], [300.0], [90.0])
    peer = ConversationServing([0.4, 0.6], [], [500, 900], [100.0], [80.0])
    table = conversational_table(
        {"hybridspec-suffix": ours, "llama-server": peer}, ["llama-server"]
    )
    row = next(line for line in table.splitlines() if line.startswith("| hybridspec-suffix"))
    # TTFT p50 0.2 s cached, 1.5 s cold (0.13x), 0.4x llama-server's; repeat 3x its rate
    assert row.split(" | ")[1:] == [
        "900",
        "0.200 s",
        "1.500 s",
        "0.13x",
        "0.40x",
        "300.0",
        "90.0",
        "3.00x |",
    ]
    results = ServingResults(ours=["hybridspec-suffix"])
    results.conversations = {"hybridspec-suffix": ours, "llama-server": peer}
    assert ServingResults.from_json(json.loads(json.dumps(results.to_json()))) == results
    assert "### multi-turn and repeat" in format_results(results)
