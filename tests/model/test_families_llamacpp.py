"""Qwen2, Qwen3 and Mistral through llama.cpp's own converter and against llama.cpp: a tiny random
checkpoint (SmolLM2's tokenizer, which the converter knows) converted to F32 and Q8_0 by
``convert_hf_to_gguf.py`` and quantized to Q4_K_M by ``llama_cpp.llama_model_quantize``; each
file loads with default settings, and on F32 our greedy tokens equal llama.cpp's
(``llama_cpp.Llama``) for 4 raw prompts x 16 tokens (at least 3 of 4 per family: random
weights leave near ties that summation order may break either way).

Needs the converter (``HYBRIDSPEC_CONVERTER``: a llama.cpp checkout's convert_hf_to_gguf.py,
run with its gguf-py beside it), ``llama_cpp`` and the embedded model's tokenizer; skipped
without them (CI has none). Gemma, whose converter wants a SentencePiece vocabulary, and
Phi-3, for which llama.cpp wants Phi-3's special tokens: ``test_gemma_llamacpp`` and
``test_phi3_llamacpp``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridspec.config import ModelConfig
from hybridspec.engine import Engine
from hybridspec.errors import ModelLoadError
from hybridspec.model.loader import (
    LoadedModel,
    embedded_model_path,
    load_gguf_tokenizer,
    load_model,
)
from tests.model.tiny_families import tiny_family

CONVERTER = Path(
    os.environ.get(
        "HYBRIDSPEC_CONVERTER",
        "/work/main/build/llama.cpp-0.3.36/llama_cpp_python-0.3.36/vendor/llama.cpp/"
        "convert_hf_to_gguf.py",
    )
)
PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3, 4,", "def main():\n    "]
NEW_TOKENS = 16

llama_cpp = pytest.importorskip("llama_cpp", reason="llama_cpp is not installed")
if not CONVERTER.is_file():
    pytest.skip(f"llama.cpp's converter is not at {CONVERTER}", allow_module_level=True)


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HYBRIDSPEC_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    try:
        return load_gguf_tokenizer(embedded_model_path())
    except ModelLoadError as exc:  # no embedded model: nothing to convert with
        pytest.skip(f"no tokenizer for the converter: {exc}")


# The converter names the tokenizer's pre-tokenizer by a hash of its output; SmolLM2's tokenizer
# as transformers rebuilds it from the GGUF hashes differently from the original, so it is named
# here ("smollm", what it is). Both sides are fed token ids: the name cannot change a result.
_RUN_CONVERTER = (
    "import sys; sys.argv = sys.argv[1:]; sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0]); "
    "from conversion.base import TextModel; "
    "TextModel.get_vocab_base_pre = lambda self, tokenizer: 'smollm'; "
    "import runpy; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def convert(folder: Path, outtype: str) -> Path:
    out = folder.with_name(f"{folder.name}-{outtype.upper()}.gguf")
    env = dict(os.environ, PYTHONPATH=str(CONVERTER.parent / "gguf-py"))
    args = [str(folder), "--outtype", outtype, "--outfile", str(out)]
    done = subprocess.run(
        [sys.executable, "-c", _RUN_CONVERTER, str(CONVERTER), *args],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"the converter failed on {folder.name}: {done.stderr[-2000:]}"
    return out


def quantize_q4_k_m(source: Path) -> Path:
    out = source.with_name(source.name.replace("-F32", "-Q4_K_M").replace("-F16", "-Q4_K_M"))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    assert status == 0, f"llama_model_quantize returned {status}"
    return out


def llama_cpp_greedy(path: Path, prompt_ids: list[int]) -> list[int]:
    model = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, verbose=False, seed=0)
    tokens = []
    for token in model.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
        tokens.append(int(token))
        if len(tokens) == NEW_TOKENS:
            break
    model.close()
    return tokens


def convert_and_load(folder: Path) -> tuple[Path, LoadedModel]:
    """The checkpoint in ``folder`` as F32, Q8_0 and Q4_K_M files, each loaded with default
    settings (quantize and dtype "auto") on the native runtime; returns the F32 file and that
    file loaded in float32, unquantized."""
    f32 = convert(folder, "f32")
    for path in (f32, convert(folder, "q8_0"), quantize_q4_k_m(f32)):
        assert load_model(ModelConfig(str(path))).is_native, path.name
    return f32, load_model(ModelConfig(str(f32), dtype="float32", quantize="none"))


def assert_greedy_matches_llama_cpp(name: str, f32: Path, loaded: LoadedModel) -> None:
    """Our greedy tokens on ``loaded`` equal llama.cpp's on the same F32 file for at least 3 of
    the 4 raw ``PROMPTS`` (random weights leave near ties either side may break)."""
    from tests.engine.tiny import make_engine

    engine: Engine = make_engine(loaded)
    agree = 0
    for text in PROMPTS:
        ids = loaded.tokenizer.encode(text, add_special_tokens=False)
        ours = engine.generate(
            prompt_token_ids=ids, proposer="none", max_new_tokens=NEW_TOKENS
        ).token_ids
        agree += ours == llama_cpp_greedy(f32, ids)
    print(f"{name}: {agree} of {len(PROMPTS)} prompts equal llama.cpp's greedy tokens")
    assert agree >= 3, f"{name}: {agree} of {len(PROMPTS)} prompts equal llama.cpp's"


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_converted_files_load_and_match_llama_cpp(family: str, tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    vocab = len(tokenizer)
    model = tiny_family(family, seed=0, vocab_size=vocab)
    with torch.no_grad():  # sharper logits: fewer near ties between the two implementations
        model.lm_head.weight.mul_(4)
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    folder = tmp_path / family
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    f32, loaded = convert_and_load(folder)
    assert_greedy_matches_llama_cpp(family, f32, loaded)
