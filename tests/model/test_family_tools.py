"""``tool_choice: "auto"`` on a Qwen-templated model: a tiny Qwen3 checkpoint whose chat
template shows the tools as Qwen's does (``<tools>`` in the system turn, calls as Hermes'
``<tool_call>`` blocks), pushed by a script to answer with such a block; the server returns it
as OpenAI ``tool_calls``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from fastapi.testclient import TestClient

from hybridspec.config import ModelConfig
from hybridspec.engine import Engine
from hybridspec.model.loader import LoadedModel, load_model
from hybridspec.model.runtime import ModelRuntime
from hybridspec.server import ServerConfig, create_app
from tests.conftest import TINY_EOS, tiny_tokenizer
from tests.model.tiny_families import tiny_family
from tests.server.conftest import TINY_MODEL_NAME, tiny_engine_config
from tests.server.scripted import ASSISTANT, PUSH, ScriptedModel, ScriptedRuntime

# Qwen2.5's template, cut to what shows tools and calls (the real one also renders tool
# results and earlier calls the same way).
QWEN_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n\nYou may call one or more functions.\n\n"
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


class HermesRuntime(ScriptedRuntime):
    """Pushes each row towards ``CALL`` where the system turn shows tools, else towards EOS."""

    def _push(self, logits: torch.Tensor, context: list[int]) -> None:
        text = self._tokenizer.decode(context)
        if ASSISTANT not in text:
            return
        written = text[text.rfind(ASSISTANT) + len(ASSISTANT) :]
        answer = CALL if "<tools>" in text else ""
        if not answer.startswith(written):
            return
        rest = answer[len(written) :]
        target = self._tokenizer.encode(rest[0], add_special_tokens=False)[0] if rest else TINY_EOS
        logits[target] += PUSH


class HermesModel(ScriptedModel):
    def create_runtime(self, max_num_seqs: int, max_seq_len: int | None = None) -> ModelRuntime:
        inner = LoadedModel.create_runtime(self, max_num_seqs, max_seq_len)
        return HermesRuntime(inner, self.tokenizer)  # type: ignore[return-value]


def test_auto_returns_the_hermes_call_as_tool_calls(tmp_path: Path) -> None:
    model = tiny_family("qwen3", seed=0, max_position_embeddings=1024)
    model.save_pretrained(tmp_path)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(ModelConfig(str(tmp_path), dtype="float32"))
    assert loaded.is_native
    fields = {f.name: getattr(loaded, f.name) for f in dataclasses.fields(loaded) if f.init}
    scripted = HermesModel(**fields)
    config = ServerConfig(engine=tiny_engine_config(tmp_path), served_model_name=TINY_MODEL_NAME)
    app = create_app(config, engine_factory=lambda cfg: Engine(cfg, target=scripted))
    body: dict[str, Any] = {
        "model": TINY_MODEL_NAME,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": "auto",
        "max_tokens": 120,
        "temperature": 0,
    }
    with TestClient(app) as client:
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        without_tools = client.post(
            "/v1/chat/completions",
            json={k: v for k, v in body.items() if k != "tools" and k != "tool_choice"},
        ).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert without_tools["message"]["tool_calls"] is None  # no tools shown: no call scripted
