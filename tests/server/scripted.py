"""A tiny model whose answers follow a script, for tests of an agent loop's shape.

``ScriptedModel`` is the suite's tiny byte-level Llama whose runtime pushes each logits row
towards the next byte of a scripted answer: while the conversation has no tool result, a call
of the first function the system message describes, ``[{"name": <it>, "arguments": {"city":
"Paris"}}]``; after a tool result, the text ``ANSWER``. The engine, the grammar and the
server run unchanged on those logits (the grammar of ``tool_choice: "auto"`` still decides
what may be written), so a framework's tool round trip is exercised end to end without
depending on what a random model happens to write.

Dimensions: ``num_tokens`` fed tokens of a ragged batch, ``num_logits`` rows of logits.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import torch

from hybridspec.model.loader import LoadedModel
from hybridspec.model.runtime import ForwardBatch, ForwardOutput, ModelRuntime
from tests.conftest import TINY_EOS

ANSWER = "Sunny in Paris."
ASSISTANT = "<|im_start|>assistant\n"
FIRST_FUNCTION = re.compile(r'You can call these functions: \[\{"name":"([^"]+)"')
PUSH = 50.0  # added to the scripted token's logit: far above a random model's spread


def scripted_answer(context: str) -> str:
    """The answer the script gives after ``context`` (the chat-templated conversation)."""
    head = context[: context.rfind(ASSISTANT)]
    if "<|im_start|>tool\n" in head:
        return ANSWER
    match = FIRST_FUNCTION.search(head)
    if match is None:
        return ANSWER
    return json.dumps([{"name": match.group(1), "arguments": {"city": "Paris"}}])


class ScriptedRuntime:
    """Wraps a runtime: each slot's fed tokens are kept (by position, so that truncation and
    copied prefixes stay right), and each row of logits is pushed towards the script."""

    def __init__(self, inner: ModelRuntime, tokenizer: Any) -> None:
        self._inner = inner
        self._tokenizer = tokenizer
        self._history: dict[int, list[int]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def copy_prefix(self, source: int, dest: int, length: int) -> None:
        self._history[dest] = list(self._history.get(source, [])[:length])
        self._inner.copy_prefix(source, dest, length)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        starts = [self._inner.seq_len(int(slot)) for slot in batch.slots]
        output = self._inner.forward(batch)
        output = dataclasses.replace(output, logits=output.logits.clone())  # an inference tensor
        tokens, cu = batch.token_ids.tolist(), batch.cu_num_tokens.tolist()
        rows = batch.logits_indices
        indices = list(range(len(tokens))) if rows is None else rows.tolist()
        for i, slot in enumerate(batch.slots.tolist()):
            self._history[slot] = (
                self._history.get(slot, [])[: starts[i]] + tokens[cu[i] : cu[i + 1]]
            )
        for row, t in enumerate(indices):
            i = next(i for i in range(len(cu) - 1) if cu[i] <= t < cu[i + 1])
            slot = int(batch.slots[i])
            context = self._history[slot][: starts[i] + t - cu[i] + 1]
            self._push(output.logits[row], context)
        return output

    def _push(self, logits: torch.Tensor, context: list[int]) -> None:
        text = self._tokenizer.decode(context)
        if ASSISTANT not in text:
            return
        cut = text.rfind(ASSISTANT) + len(ASSISTANT)
        answer, written = scripted_answer(text), text[cut:]
        if not answer.startswith(written):
            return  # off the script (another request's grammar): leave the model's logits
        rest = answer[len(written) :]
        target = self._tokenizer.encode(rest[0], add_special_tokens=False)[0] if rest else TINY_EOS
        logits[target] += PUSH


@dataclasses.dataclass(frozen=True)
class ScriptedModel(LoadedModel):
    """A loaded tiny model whose runtimes follow the script (module docstring)."""

    def create_runtime(self, max_num_seqs: int, max_seq_len: int | None = None) -> ModelRuntime:
        inner = LoadedModel.create_runtime(self, max_num_seqs, max_seq_len)
        return ScriptedRuntime(inner, self.tokenizer)  # type: ignore[return-value]


def scripted(model: LoadedModel) -> ScriptedModel:
    return ScriptedModel(
        **{f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.init}
    )
