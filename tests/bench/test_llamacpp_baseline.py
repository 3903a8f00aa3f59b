"""The llama.cpp baselines: skipped cleanly without ``llama_cpp``; counted and stopped like the
other methods (on a stand-in for ``Llama`` that replays fixed tokens); and, where llama-cpp-python
is installed, run for a few tokens on the embedded GGUF.
"""

from __future__ import annotations

import importlib.machinery
import json
import logging
import sys
import types
from collections.abc import Generator, Sequence
from pathlib import Path

import pytest

from hybridspec.bench.cli import default_methods
from hybridspec.bench.llamacpp_baseline import (
    LlamaCppMethod,
    LlamaCppOptions,
    llama_cpp_method,
    unavailable_reason,
)
from hybridspec.bench.names import DEFAULT_METHODS, LLAMACPP_METHODS
from hybridspec.cli import main
from hybridspec.errors import InvalidRequestError
from hybridspec.types import SamplingParams
from tests.bench.test_bench import tiny_workload
from tests.conftest import TinyLlamaFactory

EOS = 2


@pytest.fixture
def no_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import llama_cpp`` fails and ``find_spec`` finds nothing, as where it is not installed."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)


# ------------------------------------------------------------------ skipped without llama_cpp


def test_unavailable_reason_names_what_is_missing(no_llama_cpp: None) -> None:
    reason = unavailable_reason(Path("model.gguf"))
    assert reason is not None and "llama_cpp is not installed" in reason
    assert "make bench-peers" in reason


def test_default_methods_add_llama_cpp_only_where_importable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert default_methods(with_draft=False) == list(DEFAULT_METHODS)
    installed = types.ModuleType("llama_cpp")
    installed.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", installed)
    assert default_methods(with_draft=True) == [*DEFAULT_METHODS, *LLAMACPP_METHODS, "draft"]


def test_bench_skips_llama_cpp_methods_when_missing(
    no_llama_cpp: None,
    make_tiny_llama_dir: TinyLlamaFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps(tiny_workload()))
    out = tmp_path / "out"
    argv = ["bench", "--target", str(make_tiny_llama_dir()), "--workload", str(workload)]
    argv += ["--dtype", "float32", "--max-new-tokens", "4", "--temperature", "0"]
    argv += ["--methods", "none", *LLAMACPP_METHODS, "--output-dir", str(out)]
    with caplog.at_level(logging.WARNING, logger="hybridspec.bench"):
        assert main(argv) == 0
    assert "skipping llamacpp-plain, llamacpp-prompt-lookup: llama_cpp is not installed" in (
        caplog.text
    )
    report = json.loads((out / "bench.json").read_text())
    assert report["meta"]["methods"] == ["none"] and report["meta"]["llama_cpp"] is None
    assert {r["method"] for r in report["records"]} == {"none"}


def test_bench_with_only_llama_cpp_methods_and_none_installed_fails_cleanly(
    no_llama_cpp: None,
    make_tiny_llama_dir: TinyLlamaFactory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps(tiny_workload()))
    argv = ["bench", "--target", str(make_tiny_llama_dir()), "--workload", str(workload)]
    argv += ["--max-new-tokens", "4", "--methods", *LLAMACPP_METHODS]
    argv += ["--output-dir", str(tmp_path / "out")]
    assert main(argv) == 2
    assert "can run here" in capsys.readouterr().err


# ------------------------------------------------- counting and stopping, on a stand-in Llama


class ReplayLlama:
    """Stands in for ``llama_cpp.Llama``: ``generate`` evaluates the prompt, then one round per
    entry of ``rounds`` (the tokens fed: the last committed one plus drafts) and yields the
    tokens committed after each, as ``Llama.generate`` does with a draft model."""

    def __init__(self, committed: Sequence[Sequence[int]], fed: Sequence[int]) -> None:
        self.committed = committed  # tokens yielded after each eval: [1 + num_forwards - 1]
        self.fed = fed  # tokens fed to each eval after the prompt's
        self.seed: int | None = None
        self.options: dict[str, float | int] = {}
        self.resets = 0

    def eval(self, tokens: Sequence[int]) -> None:
        pass

    def reset(self) -> None:
        self.resets += 1

    def set_seed(self, seed: int) -> None:
        self.seed = seed

    def generate(
        self, tokens: Sequence[int], reset: bool, **options: float | int
    ) -> Generator[int, None, None]:
        assert not reset  # the method empties the cache itself
        self.options = options
        self.eval(tokens)
        for i, committed in enumerate(self.committed):
            yield from committed
            self.eval(list(range(self.fed[i])) if i < len(self.fed) else [0])


def test_prompt_lookup_counts_drafts_and_accepted_tokens() -> None:
    # prompt eval commits 7; a round fed 7 + 3 drafts accepts 2 and commits 8 9 10; a round fed
    # 1 + 0 commits 11, another EOS: 6 generated (EOS counted), 4 forwards, 3 drafted, 2 accepted
    llama = ReplayLlama([[7], [8, 9, 10], [11], [EOS]], fed=[4, 1, 1])
    method = LlamaCppMethod("llamacpp-prompt-lookup", llama, [EOS])
    measurement = method.run([5, 6], SamplingParams(), max_new_tokens=16)
    (request,) = measurement.requests
    assert request.token_ids == (7, 8, 9, 10, 11)
    assert request.num_generated == 6 and request.target_forwards == 4
    assert request.num_drafts == 3 and request.num_accepted_tokens == 2
    assert llama.resets == 1 and 0 <= measurement.forward_s <= measurement.elapsed_s
    assert llama.options == {
        "temp": 0.0,
        "top_k": 1,
        "top_p": 1.0,
        "min_p": 0.0,
        "repeat_penalty": 1.0,
    }


def test_plain_stops_at_the_token_budget() -> None:
    llama = ReplayLlama([[t] for t in range(10, 30)], fed=[1] * 20)
    method = LlamaCppMethod("llamacpp-plain", llama, [EOS])
    (request,) = method.run([5], SamplingParams(), max_new_tokens=4).requests
    assert request.token_ids == (10, 11, 12, 13) and request.num_generated == 4
    assert request.target_forwards == 4 and request.num_drafts == 0
    assert request.num_accepted_tokens == 0


def test_sampled_request_passes_temperature_and_seed() -> None:
    llama = ReplayLlama([[10]], fed=[])
    method = LlamaCppMethod("llamacpp-plain", llama, [EOS])
    method.run([5], SamplingParams(temperature=0.8, top_p=0.9, seed=7), max_new_tokens=1)
    assert llama.seed == 7
    assert llama.options["temp"] == 0.8 and llama.options["top_k"] == 0
    assert llama.options["top_p"] == 0.9


def test_controls_llama_cpp_does_not_take_are_refused() -> None:
    method = LlamaCppMethod("llamacpp-plain", ReplayLlama([[10]], fed=[]), [EOS])
    with pytest.raises(InvalidRequestError, match="sampling"):
        method.run([5], SamplingParams(presence_penalty=0.5), max_new_tokens=1)


def test_options_name_the_bad_field() -> None:
    with pytest.raises(InvalidRequestError, match="threads"):
        LlamaCppOptions(Path("m.gguf"), 0, 64, (EOS,), 4)


# --------------------------------------------------------- the real thing, where installed


@pytest.mark.slow
def test_llama_cpp_methods_on_the_embedded_gguf() -> None:
    pytest.importorskip("llama_cpp")
    from hybridspec.model import embedded_model_path
    from hybridspec.model.gguf import load_gguf_tokenizer

    gguf = embedded_model_path()
    tokenizer = load_gguf_tokenizer(gguf)
    messages = [{"role": "user", "content": "Repeat exactly: the cat sat on the mat. " * 3}]
    text = str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    prompt = tokenizer.encode(text, add_special_tokens=False)
    eos = (int(tokenizer.eos_token_id),)
    options = LlamaCppOptions(gguf, 1, len(prompt) + 32, eos, 4)
    plain = llama_cpp_method("llamacpp-plain", options)
    # llama.cpp's own tokenizer gives the ids the bench feeds it: the comparison is like for like
    assert plain.llama.tokenize(text.encode(), add_bos=False, special=True) == prompt
    lookup = llama_cpp_method("llamacpp-prompt-lookup", options)
    outputs = []
    for method in (plain, lookup, plain):  # the second plain run reuses nothing of the first
        (request,) = method.run(prompt, SamplingParams(), max_new_tokens=16).requests
        assert 1 <= request.num_generated <= 16
        outputs.append(request)
    assert outputs[0] == outputs[2]
    assert outputs[0].num_drafts == 0 and outputs[0].target_forwards == outputs[0].num_generated
    assert outputs[1].num_drafts > 0 and outputs[1].target_forwards < outputs[1].num_generated
    assert outputs[1].token_ids[:8] == outputs[0].token_ids[:8]
