"""The distillation data: token sequences the target wrote or read, with its features, on disk.

Two phases, each bounded by its own time budget and resumable (``Manifest``):

1. *answers*: the target answers the chat prompts of ``sources`` (some with a follow-up turn),
   up to ``max_num_seqs`` at once through the engine (n-gram speculation: the same text,
   sooner). The engine may run the target's quantized blocks (``quantize="auto"``), which
   write about the same text faster;
2. *reading*: local text, tokenized raw, teacher-forced.

Every sequence (conversation, or a text chunk) then goes through one teacher-forced forward of
the dense target (``features_model``) that keeps the outputs of the head's ``feature_layers`` at
every position (what the head reads; the last decoder layer's, always among them, gives the
label through the target's LM head), stored in bfloat16 shards: ``tokens [N] int32``,
``features [N, L, D]``, ``offsets [num_seqs + 1]``. Dimensions: ``N`` tokens of a shard, ``L``
layers kept, ``D`` the target's width.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hybridspec.distill.sources import (
    Chat,
    Snippet,
    chat_prompts,
    share_snippets,
    stdlib_snippets,
)
from hybridspec.engine import Engine, GenerationParams
from hybridspec.errors import InvalidRequestError
from hybridspec.model import ForwardBatch, LoadedModel

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SHARD_TOKENS = 1 << 16
FEATURE_CHUNK = 512  # tokens per teacher-forced forward
SAMPLED_SHARE = 0.3  # answers sampled at temperature 0.8 (seeded), the rest greedy
SAMPLED_TEMPERATURE = 0.8
READ_CHUNK_TOKENS = 384
Progress = Callable[[str], None]


@dataclass(slots=True)
class Manifest:
    """What the data phases have done so far (``manifest.json`` in the work directory)."""

    shards: list[str] = field(default_factory=list)
    answers_s: float = 0.0
    answers_done: int = 0  # prompts answered
    answers_finished: bool = False
    reading_s: float = 0.0
    reading_done: int = 0  # snippets read
    reading_finished: bool = False
    num_tokens: int = 0
    feature_layers: list[int] = field(default_factory=lambda: [-1])  # the shards' layers

    @staticmethod
    def load(directory: Path) -> Manifest:
        path = directory / MANIFEST
        return Manifest(**json.loads(path.read_text())) if path.is_file() else Manifest()

    def save(self, directory: Path) -> None:
        tmp = directory / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(directory / MANIFEST)


class ShardWriter:
    """Buffers (tokens, features) sequences and writes a shard every ``SHARD_TOKENS`` tokens."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory, self.manifest = directory, manifest
        self._tokens: list[torch.Tensor] = []
        self._features: list[torch.Tensor] = []

    def add(self, tokens: list[int], features: torch.Tensor) -> None:
        self._tokens.append(torch.tensor(tokens, dtype=torch.int32))
        self._features.append(features.to(device="cpu", dtype=torch.bfloat16))
        if sum(t.numel() for t in self._tokens) >= SHARD_TOKENS:
            self.flush()

    def flush(self) -> None:
        """Write what is buffered as one shard and record it (and the phases' progress)."""
        from safetensors.torch import save_file

        if self._tokens:
            lengths = torch.tensor([0] + [t.numel() for t in self._tokens])
            name = f"shard-{len(self.manifest.shards):04d}.safetensors"
            save_file(
                {
                    "tokens": torch.cat(self._tokens),
                    "features": torch.cat(self._features).contiguous(),
                    "offsets": lengths.cumsum(0),
                },
                str(self.directory / name),
            )
            self.manifest.shards.append(name)
            self.manifest.num_tokens += int(lengths.sum())
            self._tokens, self._features = [], []
        self.manifest.save(self.directory)


class FeatureReader:
    """Teacher-forced features of many sequences with one runtime (its cache reused): the
    outputs of ``layers`` at every position, ``[n, len(layers), D]``."""

    def __init__(
        self, model: LoadedModel, max_seq_len: int, layers: tuple[int, ...] = (-1,)
    ) -> None:
        self.runtime = model.create_runtime(1, max_seq_len)
        self.max_seq_len = max_seq_len
        self.layers = layers

    def __call__(self, token_ids: list[int]) -> torch.Tensor:
        token_ids = token_ids[: self.max_seq_len]
        slot = self.runtime.allocate()
        rows = []
        try:
            for start in range(0, len(token_ids), FEATURE_CHUNK):
                chunk = token_ids[start : start + FEATURE_CHUNK]
                batch = ForwardBatch.from_lists([slot], [chunk], [len(chunk) - 1], self.layers)
                hidden = self.runtime.forward(batch).hidden_states
                assert hidden is not None
                rows.append(hidden)
        finally:
            self.runtime.free(slot)
        return torch.cat(rows)


@dataclass(slots=True)
class _Conversation:
    index: int  # the prompt's index
    turns: Chat  # the user's turns
    params: GenerationParams
    messages: list[dict[str, str]]  # what the target has been sent so far
    ids: list[int]  # the current turn's prompt, then its answer as it comes
    prompt_len: int = 0  # tokens of ``ids`` that are the current turn's prompt


def answer_prompts(
    engine: Engine,
    prompts: list[Chat],
    budget_s: float,
    max_new_tokens: int,
    seed: int,
) -> Iterator[tuple[int, list[int]]]:
    """Yield (prompt index, conversation tokens) as conversations finish, within ``budget_s``
    (those still running then are cut short and yielded as they are). A conversation with a
    follow-up sends it after the first answer, with that answer as the assistant's turn, and
    yields the whole exchange once."""
    deadline = time.monotonic() + budget_s
    rng = random.Random(seed)
    pending = iter(enumerate(prompts))
    running: dict[str, _Conversation] = {}
    capacity = engine.config.target.max_num_seqs
    exhausted = False

    def send(chat: _Conversation) -> None:
        chat.ids = list(engine.encode(messages=chat.messages))
        chat.prompt_len = len(chat.ids)
        running[engine.add_request(chat.ids, chat.params)] = chat

    while True:
        while not exhausted and len(running) < capacity and time.monotonic() < deadline:
            item = next(pending, None)
            if item is None:
                exhausted = True
                break
            index, turns = item
            sampled = rng.random() < SAMPLED_SHARE
            params = GenerationParams.create(
                max_new_tokens=max_new_tokens,
                temperature=SAMPLED_TEMPERATURE if sampled else 0.0,
                seed=(seed * 1_000_003 + index) % (1 << 53) if sampled else None,
                proposer="ngram",
            )
            send(_Conversation(index, turns, params, [{"role": "user", "content": turns[0]}], []))
        if not running:
            return
        if time.monotonic() >= deadline:
            for request_id, chat in running.items():
                engine.abort(request_id)
                yield chat.index, chat.ids
            return
        for output in engine.step():
            chat = running[output.request_id]
            chat.ids.extend(output.new_token_ids)
            if not output.finished:
                continue
            del running[output.request_id]
            answered = sum(m["role"] == "user" for m in chat.messages)
            if answered < len(chat.turns):
                answer = str(
                    engine.tokenizer.decode(chat.ids[chat.prompt_len :], skip_special_tokens=True)
                )
                chat.messages += [
                    {"role": "assistant", "content": answer.strip()},
                    {"role": "user", "content": chat.turns[answered]},
                ]
                send(chat)
            else:
                yield chat.index, chat.ids


def local_snippets(seed: int, limit: int = 6000) -> list[Snippet]:
    """Local text for prompts and reading, shuffled with ``seed``."""
    rng = random.Random(seed)
    snippets = stdlib_snippets(limit // 2, rng) + share_snippets(limit // 2, rng)
    rng.shuffle(snippets)
    return snippets


@dataclass(frozen=True, slots=True)
class DataBudget:
    answers_s: float
    reading_s: float
    max_new_tokens: int = 256
    num_prompts: int = 20000


def make_data(
    engine: Engine,
    directory: Path,
    budget: DataBudget,
    seed: int,
    progress: Progress,
    features_model: LoadedModel | None = None,
    feature_layers: tuple[int, ...] = (-1,),
) -> Manifest:
    """Run (or resume) both data phases into ``directory``; the manifest of what is there.
    Features are the outputs of ``feature_layers`` of ``features_model`` (default: the
    engine's target); a directory begun with other layers is refused."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.load(directory)
    if manifest.shards and tuple(manifest.feature_layers) != feature_layers:
        raise InvalidRequestError(
            f"work dir {directory} holds features of layers {manifest.feature_layers}, "
            f"not {list(feature_layers)}: use another work dir",
            "feature_layers",
        )
    manifest.feature_layers = list(feature_layers)
    snippets = local_snippets(seed)
    writer = ShardWriter(directory, manifest)
    reader = FeatureReader(features_model or engine.target, engine.max_seq_len, feature_layers)
    if not manifest.answers_finished:
        prompts = chat_prompts(snippets, budget.num_prompts, random.Random(seed))
        start, done = time.monotonic(), manifest.answers_done
        left = max(0.0, budget.answers_s - manifest.answers_s)
        for index, ids in answer_prompts(
            engine, prompts[done:], left, budget.max_new_tokens, seed + done
        ):
            writer.add(ids, reader(ids))
            manifest.answers_done = max(manifest.answers_done, done + index + 1)
            manifest.answers_s = budget.answers_s - left + time.monotonic() - start
            progress(f"answers: {manifest.answers_done} prompts, {_tokens(writer)} tokens")
        manifest.answers_finished = True
        writer.flush()
    if not manifest.reading_finished:
        tokenizer = engine.tokenizer
        start, left = time.monotonic(), max(0.0, budget.reading_s - manifest.reading_s)
        for i in range(manifest.reading_done, len(snippets)):
            if time.monotonic() - start >= left:
                break
            ids = list(tokenizer.encode(snippets[i].text))[:READ_CHUNK_TOKENS]
            if len(ids) >= 16:
                writer.add(ids, reader(ids))
            manifest.reading_done = i + 1
            manifest.reading_s = budget.reading_s - left + time.monotonic() - start
            progress(f"reading: {manifest.reading_done} texts, {_tokens(writer)} tokens")
        manifest.reading_finished = True
        writer.flush()
    return manifest


def _tokens(writer: ShardWriter) -> int:
    return writer.manifest.num_tokens + sum(t.numel() for t in writer._tokens)


def load_sequences(directory: Path, shards: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every sequence of ``shards``: (tokens ``[n]`` int32, features ``[n, L, D]`` bfloat16;
    shards of one layer written as ``[n, D]`` read as ``L = 1``)."""
    from safetensors.torch import load_file

    out = []
    for name in shards:
        shard = load_file(str(directory / name))
        offsets = shard["offsets"].tolist()
        features = shard["features"]
        if features.dim() == 2:
            features = features.unsqueeze(1)
        for start, end in itertools.pairwise(offsets):
            out.append((shard["tokens"][start:end], features[start:end]))
    return out
