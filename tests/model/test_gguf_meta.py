"""``model.gguf_meta``: a GGUF file's tokenizer and config as transformers builds them, faster.

Each family's tiny file (``tiny_families``): the tokenizer ``convert_gguf_tokenizer`` builds is
AutoTokenizer's (class, serialization, special tokens, template); the config saved by a first
read gives a second read the same attributes, dimensions and support verdict, and builds the
same real config; a later in-place load imports no transformers config class.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from hybridspec.model.families import family_of, family_problem
from hybridspec.model.gguf import convert_gguf_tokenizer, load_gguf_tokenizer, read_gguf
from hybridspec.model.gguf_meta import StoredConfig
from hybridspec.model.llama_weights import LlamaDims, native_support_problem
from hybridspec.model.rope import local_rope_inv_freq, rope_inv_freq
from hybridspec.model.tokenizer import GGUFTokenizer
from tests.model.tiny_families import FAMILY_NAMES, GGUF_READY, tiny_family, write_family_gguf

# names the native forward reads with getattr (model.families, model.llama_weights)
READ_NAMES = (
    "model_type",
    "hidden_act",
    "hidden_activation",
    "attention_bias",
    "mlp_bias",
    "use_bidirectional_attention",
    "partial_rotary_factor",
    "use_sliding_window",
    "sliding_window",
    "layer_types",
    "query_pre_attn_scalar",
    "tie_word_embeddings",
    "rope_parameters",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "num_key_value_heads",
    "head_dim",
)


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HYBRIDSPEC_CACHE_DIR", str(tmp_path / "cache"))


def _family_file(family: str, folder: Path) -> Path:
    folder.mkdir()
    model = tiny_family(family, seed=4, **GGUF_READY.get(family, {}))
    return write_family_gguf(folder / f"{family}.gguf", model, spm=family.startswith("gemma"))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tokenizer_is_autotokenizers_own(family: str, tmp_path: Path) -> None:
    path = _family_file(family, tmp_path / "files")
    ours = convert_gguf_tokenizer(path)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert type(ours) is type(reference)
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert ours.special_tokens_map == reference.special_tokens_map
    assert ours.chat_template == reference.chat_template
    text = " Hi there, the tree"
    assert ours.encode(text) == reference.encode(text)
    cached = load_gguf_tokenizer(path)  # converted, saved, read back by its class
    if isinstance(cached, GGUFTokenizer):  # byte-level files: built without transformers
        again = load_gguf_tokenizer(path)  # read back from the cache
        assert isinstance(again, GGUFTokenizer)
        for tok in (cached, again):
            assert tok.backend.to_str() == reference.backend_tokenizer.to_str()
            assert tok.encode(text) == reference.encode(text)
            assert tok.chat_template == reference.chat_template
            assert tok.eos_token_id == reference.eos_token_id
        return
    assert type(cached) is type(reference) and cached.encode(text) == reference.encode(text)
    again = load_gguf_tokenizer(path)
    assert type(again) is type(reference) and again.encode(text) == reference.encode(text)
    states = [
        {i: t.__getstate__() for i, t in tok.added_tokens_decoder.items()}
        for tok in (reference, cached, again)
    ]
    assert states[0] == states[1] == states[2]
    assert again.special_tokens_map == reference.special_tokens_map


def test_a_cached_tokenizer_is_read_without_parsing_its_json_in_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _family_file("phi3", tmp_path / "files")  # byte-level: a GGUFTokenizer
    fresh = load_gguf_tokenizer(path, cache_dir=tmp_path)  # converted and saved
    parse = json.load

    def no_tokenizer_json(handle: Any, *args: Any, **kwargs: Any) -> Any:
        assert not str(getattr(handle, "name", "")).endswith("tokenizer.json")
        return parse(handle, *args, **kwargs)

    monkeypatch.setattr(json, "load", no_tokenizer_json)
    cached = load_gguf_tokenizer(path, cache_dir=tmp_path)
    assert cached.get_vocab() == fresh.get_vocab()
    assert cached.encode(" Hi there") == fresh.encode(" Hi there")


def _same(stored: Any, real: Any) -> None:
    for name in READ_NAMES:
        assert getattr(stored, name, "absent") == getattr(real, name, "absent"), name
    assert LlamaDims.from_hf_config(stored) == LlamaDims.from_hf_config(real)
    assert native_support_problem(stored) == native_support_problem(real)
    assert family_problem(stored) == family_problem(real)
    if family_problem(real) is None:
        assert family_of(stored) is family_of(real)
        assert rope_inv_freq(stored).equal(rope_inv_freq(real))
        local, reference = local_rope_inv_freq(stored), local_rope_inv_freq(real)
        assert (local is None) == (reference is None)
        assert local is None or reference is None or local.equal(reference)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_stored_config_reads_as_the_real_one(family: str, tmp_path: Path) -> None:
    path = _family_file(family, tmp_path / "files")
    real = read_gguf(path).config
    first = read_gguf(path, stored_config=True).config  # built, its fields saved
    assert isinstance(first, StoredConfig) == (real.model_type == "llama")  # no transformers
    if isinstance(first, StoredConfig):  # what transformers' config would have saved
        assert first.to_dict() == json.loads(json.dumps(real.to_dict()))
    stored = read_gguf(path, stored_config=True).config
    assert isinstance(stored, StoredConfig)
    _same(stored, real)
    built = stored.build()
    assert type(built) is type(real) and built.to_dict() == real.to_dict()


def test_a_later_load_imports_no_config_class(tmp_path: Path) -> None:
    path = _family_file("qwen3", tmp_path / "files")
    script = (
        "import sys\n"
        "from hybridspec.model.gguf import load_gguf_tokenizer, read_gguf\n"
        "read_gguf(sys.argv[1], keep_quantized=True, lazy=True, stored_config=True)\n"
        "load_gguf_tokenizer(sys.argv[1])\n"
        "print('transformers.configuration_utils' in sys.modules)\n"
    )
    run = [sys.executable, "-c", script, str(path)]
    root = Path(__file__).resolve().parents[2]  # this tree's hybridspec
    first = subprocess.run(run, capture_output=True, text=True, check=True, cwd=root)
    assert first.stdout.strip() == "True"  # the first read builds (and saves) the config
    later = subprocess.run(run, capture_output=True, text=True, check=True, cwd=root)
    assert later.stdout.strip() == "False", later.stderr


def test_an_unreadable_saved_config_is_built_again(tmp_path: Path) -> None:
    path = _family_file("qwen2", tmp_path / "files")
    read_gguf(path, stored_config=True)  # saves the fields
    (entry,) = (tmp_path / "cache" / "configs").iterdir()
    entry.write_text("{not json")
    rebuilt = read_gguf(path, stored_config=True).config
    assert not isinstance(rebuilt, StoredConfig)  # built, and saved again
    assert isinstance(read_gguf(path, stored_config=True).config, StoredConfig)
