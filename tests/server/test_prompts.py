"""Prompts are tokenized off the engine thread, and one that cannot fit is refused at once."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from hybridspec.config import ModelConfig
from hybridspec.engine import Engine
from hybridspec.errors import InvalidRequestError
from hybridspec.model.loader import LoadedModel
from hybridspec.proposers import NoProposer
from hybridspec.server import ServerConfig, create_app
from hybridspec.server.prompts import Prompt, PromptEncoder, longest_token_chars
from hybridspec.types import Proposal, ProposeRequest
from tests.conftest import tiny_tokenizer
from tests.server.conftest import TINY_MODEL_NAME, serve_in_thread, tiny_engine_config

STREAM_ROUND_S = 0.02


def encoder(
    encode: Any = None, max_prompt_tokens: int = 10, chars: int | None = 3
) -> PromptEncoder:
    def refuse(text: str | None, messages: Any, tools: Any) -> list[int]:
        raise AssertionError("tokenized a prompt that its size alone rules out")

    return PromptEncoder(encode or refuse, lambda ids: None, max_prompt_tokens, chars)


def test_text_longer_than_the_tokens_can_hold_is_refused_untokenized() -> None:
    prompts = encoder()  # 10 tokens of at most 3 characters: 30 characters
    with pytest.raises(InvalidRequestError, match="31 characters") as raised:
        prompts.check_size(Prompt("x" * 31, None, None, 1))
    assert raised.value.param == "prompt"
    chat = [{"role": "user", "content": "x" * 20}, {"role": "user", "content": "y" * 11}]
    with pytest.raises(InvalidRequestError) as raised:
        prompts.check_size(Prompt(None, chat, None, 1))
    assert raised.value.param == "messages"
    prompts.check_size(Prompt("x" * 30, None, None, 1))  # may fit: left to the tokenizer
    prompts.close()


def test_too_many_token_ids_are_refused() -> None:
    prompts = encoder()
    with pytest.raises(InvalidRequestError, match="11 tokens") as raised:
        asyncio.run(prompts.encode(Prompt(None, None, list(range(11)), 1)))
    assert raised.value.param == "prompt"
    assert asyncio.run(prompts.encode(Prompt(None, None, list(range(10)), 1))) == list(range(10))
    prompts.close()


def test_tokenizing_runs_on_a_worker_thread_and_counts_tokens() -> None:
    threads: list[str] = []

    def encode(text: str | None, messages: Any, tools: Any) -> list[int]:
        threads.append(threading.current_thread().name)
        return [1] * len(text or "")

    prompts = encoder(encode, max_prompt_tokens=4, chars=None)
    assert asyncio.run(prompts.encode(Prompt("abcd", None, None, 1))) == [1] * 4
    with pytest.raises(InvalidRequestError, match="5 tokens; at most 4"):
        asyncio.run(prompts.encode(Prompt("abcde", None, None, 1)))
    assert threads and all(name.startswith("hybridspec-tokenize") for name in threads)
    prompts.close()


def test_longest_token_is_the_longest_special_token_of_a_byte_tokenizer() -> None:
    tokenizer = tiny_tokenizer()
    assert longest_token_chars(tokenizer, len(tokenizer)) == len("<|im_start|>")
    assert longest_token_chars(None, 10) is None


class SteadyProposer(NoProposer):
    """Proposes nothing; each round takes STREAM_ROUND_S, so streams last seconds."""

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        time.sleep(STREAM_ROUND_S)
        return super().propose(requests)


def stream_chunk_times(url: str, index: int, started: threading.Event) -> list[float]:
    body = {
        "model": TINY_MODEL_NAME,
        "prompt": f"stream {index}",
        "max_tokens": 200,
        "ignore_eos": True,
        "temperature": 0,
        "proposer": "steady",
        "stream": True,
    }
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
                started.set()
    return times


@pytest.mark.serial  # times a stream's gaps and a refusal (pyproject: markers)
@pytest.mark.usefixtures("frozen_heap")
def test_huge_prompts_are_refused_fast_while_streams_keep_flowing(
    tiny_model: LoadedModel, tiny_model_dir: Path
) -> None:
    """Two streams run; prompts far beyond the context (by characters, by tokens, as token
    ids) get a 400 in well under a second each, /health stays 200, and neither stream pauses
    for 1 s or more."""

    def factory(config: Any) -> Engine:
        engine = Engine(config, target=tiny_model)
        engine.register_proposer("steady", SteadyProposer)
        return engine

    target = ModelConfig(str(tiny_model_dir), dtype="float32", max_num_seqs=4)
    config = ServerConfig(
        engine=tiny_engine_config(tiny_model_dir, target=target), served_model_name=TINY_MODEL_NAME
    )
    huge = [
        {"prompt": "x" * 3_000_000},  # 3 MB: refused by its size
        {"prompt": "y" * 3_000},  # fits the size bound (255 * 12 characters); 3000 tokens
        {"prompt": [5] * 300_000},
        {"messages": [{"role": "user", "content": "z" * 3_000_000}]},
    ]
    with serve_in_thread(create_app(config, engine_factory=factory)) as url:
        started = [threading.Event(), threading.Event()]
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(stream_chunk_times, url, i, started[i]) for i in range(2)]
            assert all(event.wait(30) for event in started)
            for body in huge:
                route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                began = time.monotonic()
                response = httpx.post(
                    f"{url}{route}", json={"model": TINY_MODEL_NAME, **body}, timeout=30
                )
                took = time.monotonic() - began
                assert response.status_code == 400, response.text
                assert response.json()["error"]["param"] in ("prompt", "messages")
                assert took < 1.0, f"refused after {took:.2f} s"
                assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            times = [stream.result(timeout=60) for stream in streams]
    for chunks in times:
        assert len(chunks) > 100
        gaps = [b - a for a, b in itertools.pairwise(chunks)]
        assert max(gaps) < 1.0, f"a stream paused for {max(gaps):.2f} s"
