"""``bench serve``'s conversational workloads, sent over HTTP by this process (not guidellm).

- **multi-turn**: ``C`` conversations of ``T`` turns. Each turn appends the workload's next
  prompt as a user message to the history (earlier messages and the server's own answers),
  renders it with the model's chat template and streams it through the completions route, as
  the other workloads are sent, so that every server sees the very same text. The time to first
  token of turns 2+ is what a conversation's user waits for. On hybridspec every turn is sent
  twice, alternately first: with ``cache_prompt: false`` (the request neither reads nor leaves
  the prefix cache, so it prefills its whole history) and with the cache (the server's
  default); a peer gets each turn once with ``cache_prompt: true`` (llama-server's own slot
  reuse, on by default).
- **repeat**: ``P`` input-grounded prompts, each asked once, then asked again; the second
  asking's output tokens per second (``suffix`` drafts it from the first asking's answer), and
  ``P`` open-ended prompts asked once (first-time: nothing to match).

Every request asks for exactly ``output_tokens`` tokens (``ignore_eos``), greedy unless
``temperature`` says otherwise. Dimensions: ``C`` conversations, ``T`` turns, ``P`` prompts.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from hybridspec.bench.conversations import select_prompts
from hybridspec.bench.loadgen import COMPLETIONS_ROUTE
from hybridspec.bench.sse import stream_chunks

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hybridspec.bench.workload import Workload, WorkloadPrompt

CONVERSATIONAL = ("multi-turn", "repeat")


@dataclass(frozen=True, slots=True)
class Streamed:
    """One streamed completion: its text and its client-side times in seconds."""

    text: str
    ttft_s: float  # request sent to the first chunk that carries text
    total_s: float  # request sent to the stream's end
    tokens: int  # tokens asked for, and given (``ignore_eos``)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s if self.total_s > 0 else float("nan")


@dataclass(slots=True)
class ConversationServing:
    """What one server measured on the conversational workloads (seconds, tokens/s)."""

    ttft_cached: list[float] = field(default_factory=list)  # turns 2+, with the cache
    ttft_cold: list[float] = field(default_factory=list)  # turns 2+, cache_prompt false (ours)
    prompt_tokens: list[int] = field(default_factory=list)  # turns 2+, the history's length
    repeat_tps: list[float] = field(default_factory=list)  # second asking
    first_tps: list[float] = field(default_factory=list)  # open-ended prompts asked once

    def summary(self) -> dict[str, float]:
        return {
            "ttft_p50_cached_s": _median(self.ttft_cached),
            "ttft_p50_cold_s": _median(self.ttft_cold),
            "max_prompt_tokens": float(max(self.prompt_tokens, default=0)),
            "repeat_tok_s": _median(self.repeat_tps),
            "first_time_tok_s": _median(self.first_tps),
        }

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ConversationServing:
        return cls(**{k: list(v) for k, v in data.items()})


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def stream_completion(url: str, prompt: str, body: dict[str, Any]) -> Streamed:
    """POST ``prompt`` to ``url``'s completions route, streamed, and time it."""
    payload = {"prompt": prompt, "ignore_eos": True, **body}
    began = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    for chunk in stream_chunks(url + COMPLETIONS_ROUTE, payload):
        text = "".join(c.get("text") or "" for c in chunk.get("choices", []))
        if text and first is None:
            first = time.perf_counter()
        parts.append(text)
    ended = time.perf_counter()
    ttft = (first if first is not None else ended) - began
    return Streamed("".join(parts), ttft, ended - began, int(body["max_tokens"]))


@dataclass(frozen=True, slots=True)
class ConversationPlan:
    """The conversational workloads' prompts and sizes, the same for every server."""

    conversations: list[list[WorkloadPrompt]]  # C lists of T prompts
    repeat: list[WorkloadPrompt]  # P input-grounded prompts
    first_time: list[WorkloadPrompt]  # P open-ended prompts
    output_tokens: int
    temperature: float
    seed: int

    @classmethod
    def from_workload(
        cls,
        workload: Workload,
        conversations: int,
        turns: int,
        prompts: int,
        output_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> ConversationPlan:
        """Conversations over the grounded prompts, then the open-ended ones, ``turns`` each;
        the first ``prompts`` of each kind for the repeat and first-time runs."""
        chats, repeat, first_time = select_prompts(workload, conversations, turns, prompts)
        return cls(chats, repeat, first_time, output_tokens, temperature, seed)


def run_conversational(
    url: str,
    plan: ConversationPlan,
    tokenizer: PreTrainedTokenizerBase,
    workloads: tuple[str, ...] | list[str],
    ours: bool,
    log: Any = print,
) -> ConversationServing:
    """The ``workloads`` (of ``CONVERSATIONAL``) against the server at ``url``."""
    figures = ConversationServing()
    body: dict[str, Any] = {
        "max_tokens": plan.output_tokens,
        "temperature": plan.temperature,
        "seed": plan.seed,
    }

    def render(messages: list[dict[str, str]]) -> str:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return str(text)

    if "multi-turn" in workloads:
        for prompts in plan.conversations:
            _conversation(url, prompts, render, tokenizer, body, ours, figures, log)
    if "repeat" in workloads:
        for prompt in plan.repeat:
            text = render(list(prompt.messages))
            stream_completion(url, text, body)  # the first asking leaves its answer behind
            again = stream_completion(url, text, body)
            figures.repeat_tps.append(again.tokens_per_s)
        for prompt in plan.first_time:
            once = stream_completion(url, render(list(prompt.messages)), body)
            figures.first_tps.append(once.tokens_per_s)
        log(
            f"repeat: second asking {_median(figures.repeat_tps):.1f} tok/s, "
            f"first-time {_median(figures.first_tps):.1f} tok/s"
        )
    return figures


def _conversation(
    url: str,
    prompts: list[WorkloadPrompt],
    render: Any,
    tokenizer: PreTrainedTokenizerBase,
    body: dict[str, Any],
    ours: bool,
    figures: ConversationServing,
    log: Any,
) -> None:
    history: list[dict[str, str]] = []
    for turn, prompt in enumerate(prompts):
        history.extend(prompt.messages[-1:] if history else prompt.messages)
        text = render(history)
        cold = None
        if ours:  # both orders in turn, so that neither always runs on a warmer machine
            order = (False, True) if turn % 2 == 0 else (True, False)
            runs = {c: stream_completion(url, text, {**body, "cache_prompt": c}) for c in order}
            warm, cold = runs[True], runs[False]
        else:
            warm = stream_completion(url, text, {**body, "cache_prompt": True})
        if turn > 0:
            figures.ttft_cached.append(warm.ttft_s)
            if cold is not None:
                figures.ttft_cold.append(cold.ttft_s)
            figures.prompt_tokens.append(len(tokenizer(text, add_special_tokens=False).input_ids))
        log(
            f"turn {turn + 1}: TTFT {warm.ttft_s:.3f} s"
            + (f" (cold {cold.ttft_s:.3f} s)" if cold is not None else "")
        )
        history.append({"role": "assistant", "content": warm.text})
