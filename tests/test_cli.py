"""The ``generate`` command's sampling options reach GenerationParams (no model loaded); its
start-up's garbage-collector policy; run as the program, it ends with its output flushed."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridspec.cli import _start_up, build_parser, generation_params
from hybridspec.errors import InvalidRequestError


def test_every_sampling_control_is_an_option() -> None:
    args = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--presence-penalty",
            "0.5",
            "--frequency-penalty",
            "0.3",
            "--repetition-penalty",
            "1.1",
            "--logit-bias",
            '{"13": -100, "7": 2.5}',
            "--min-p",
            "0.05",
            "--min-tokens",
            "8",
            "--stop-token-id",
            "3",
            "--stop-token-id",
            "4",
            "-n",
            "3",
        ]
    )
    params = generation_params(args)
    sampling = params.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, 0.3)
    assert sampling.repetition_penalty == 1.1 and sampling.min_p == 0.05
    assert sampling.min_tokens == 8 and dict(sampling.logit_bias) == {7: 2.5, 13: -100.0}
    assert params.stop_token_ids == (3, 4) and args.n == 3


def test_defaults_are_the_librarys() -> None:
    params = generation_params(build_parser().parse_args(["generate", "hi"]))
    assert params.sampling.repetition_penalty == 1.0 and not params.sampling.logit_bias
    assert params.stop_token_ids == ()


@pytest.mark.parametrize("bias", ["[1, 2]", "{", '{"x": 1}'])
def test_a_bad_logit_bias_is_a_usage_error(bias: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--logit-bias", bias])


def test_out_of_bounds_values_name_the_field() -> None:
    args = build_parser().parse_args(["generate", "hi", "--min-p", "2"])
    with pytest.raises(InvalidRequestError, match="min_p"):
        generation_params(args)


def test_start_up_collects_nothing_inside_then_freezes_what_survives() -> None:
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with _start_up():
            assert not gc.isenabled()
            kept = [[] for _ in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(kept)
    finally:
        gc.unfreeze()


def test_start_up_turns_the_collector_back_on_after_an_error() -> None:
    frozen = gc.get_freeze_count()
    with pytest.raises(RuntimeError), _start_up():
        raise RuntimeError("load failed")
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_generate_as_the_program_streams_its_text_and_stats_before_it_exits() -> None:
    # ``main()`` ends the process with os._exit: what was written must still arrive
    command = ["generate", "Hi", "--raw", "--max-new-tokens", "3", "--max-seq-len", "256"]
    out = subprocess.run(
        [sys.executable, "-m", "hybridspec.cli", *command],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.endswith("\n")
    assert out.stderr.strip().splitlines()[-1].startswith("[")
    assert "target forwards" in out.stderr


NUMBA_FREE_RUN = """
import sys
from pathlib import Path

from hybridspec import Engine, EngineConfig
from hybridspec.cli import main
from hybridspec.config import ModelConfig
from tests.conftest import save_tiny_llama

model = str(save_tiny_llama(Path(sys.argv[1])))
argv = ["generate", "abc abc", "--target", model, "--proposer", "none", "--max-new-tokens", "4"]
assert main([*argv, "--raw", "--threads", "2"]) == 0
after_cli = "numba" in sys.modules
engine = Engine(EngineConfig(target=ModelConfig(model), num_threads=2))
none = engine.generate(prompt_token_ids=[5, 9, 5, 9, 5, 9], proposer="none", max_new_tokens=12)
after_none = "numba" in sys.modules
ngram = engine.generate(prompt_token_ids=[5, 9, 5, 9, 5, 9], proposer="ngram", max_new_tokens=12)
print(after_cli, after_none, "numba" in sys.modules, ngram.token_ids == none.token_ids)
"""


def test_a_run_without_n_grams_imports_no_numba(tmp_path: Path) -> None:
    """``generate --proposer none`` imports no numba (its libraries: ~100 MB resident) nor warms
    an n-gram kernel; an ``ngram`` request in the same engine afterwards imports and runs them."""
    out = subprocess.run(
        [sys.executable, "-c", NUMBA_FREE_RUN, str(tmp_path / "tiny")],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.split() == ["False", "False", "True", "True"]


TRANSFORMERS_FREE_RUN = """
import sys

from hybridspec.cli import main
from hybridspec.model.loader import embedded_model_path

argv = ["generate", "Hello", "--target", str(embedded_model_path()), "--proposer", "none"]
argv += ["--max-new-tokens", "2", "--threads", "2"]
assert main([*argv, "--raw"]) == 0  # a first load: the cache folder is fresh
first = "transformers" in sys.modules
assert main(argv) == 0  # a later load, the prompt rendered by the chat template
print(first, "transformers" in sys.modules)
"""


def test_a_gguf_run_imports_no_transformers(tmp_path: Path) -> None:
    """``generate --proposer none`` on a GGUF file imports no transformers (about half a second
    and some 40 MB): its tokenizer, config and chat template are built without it, on a first
    load (nothing cached) and on a later one."""
    from hybridspec.model import qgemm
    from hybridspec.model.gguf_tokenizer import default_cache_dir

    qgemm.kernel()  # compiled once into the usual cache, shared with the fresh one below
    cache = tmp_path / "cache"
    cache.mkdir()
    kernels = default_cache_dir() / "kernels"
    if kernels.is_dir():
        (cache / "kernels").symlink_to(kernels)
    out = subprocess.run(
        [sys.executable, "-c", TRANSFORMERS_FREE_RUN],
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "HYBRIDSPEC_CACHE_DIR": str(cache)},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.split()[-2:] == ["False", "False"], out.stderr
    assert list((cache / "tokenizers").iterdir())  # the tokenizer was built, then read back
