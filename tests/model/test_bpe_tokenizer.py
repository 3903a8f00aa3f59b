"""``model.bpe_tokenizer`` and ``model.tokenizer``: a byte-level BPE GGUF file's tokenizer built
without transformers gives what transformers' conversion gives: the same serialized backend,
ids, texts, special tokens and chat renders, on the embedded SmolLM2 file and on small files of
the Llama 3, Qwen2 and SmolLM2 kinds (``bpe_files``); cached and read back alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridspec.model.bpe_tokenizer import build_bpe
from hybridspec.model.gguf_file import GGUFFile
from hybridspec.model.gguf_tokenizer import convert_gguf_tokenizer, load_gguf_tokenizer
from hybridspec.model.loader import embedded_model_path
from hybridspec.model.tokenizer import GGUFTokenizer
from tests.model.bpe_files import KINDS, write_bpe_gguf

TEXTS = [
    "Hello",
    " Hello there, the tree is hell",
    "",
    "   ",
    "a\n\n\nb\t\t c  \r\n d",
    "Déjà vu: naïve façade, Straße, ΑΒΓ, Привет, 日本語のテキスト, 한국어",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷",
    "12345678901234567890 3.14159 1,000,000 -42",
    "def f(x):\n    return x == 123  # comment\n\tif (a) { b = c; }",
    "I'm sure it's what they've said, we'll see; I'D SAY IT'S",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nx<|eot_id|>",
    '<think>why</think> <tool_call>{"a": 1}</tool_call> <|endoftext|>',
    " hi hi  hi",
    "\u00a0nbsp\u2009thin\u3000ideographic",
    "\x00\x01 control \x7f bytes",
]


def _files(tmp_path: Path) -> list[Path]:
    return [embedded_model_path(), *(write_bpe_gguf(tmp_path / f"{k}.gguf", k) for k in KINDS)]


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HYBRIDSPEC_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[GGUFTokenizer, Any]]:
    """(ours, transformers' conversion) for each file."""
    folder = tmp_path_factory.mktemp("bpe")
    result = []
    for path in _files(folder):
        result.append((GGUFTokenizer(*build_bpe(GGUFFile(path))), convert_gguf_tokenizer(path)))
    return result


def test_the_backend_is_transformers_own(pairs: list[tuple[GGUFTokenizer, Any]]) -> None:
    for ours, reference in pairs:
        assert json.loads(ours.backend.to_str()) == json.loads(reference.backend_tokenizer.to_str())
        for name in ("bos", "eos", "unk", "pad"):
            assert getattr(ours, f"{name}_token") == getattr(reference, f"{name}_token"), name
            assert getattr(ours, f"{name}_token_id") == getattr(reference, f"{name}_token_id")
        assert ours.chat_template == reference.chat_template
        assert ours.all_special_tokens == reference.all_special_tokens
        assert ours.all_special_ids == reference.all_special_ids
        assert ours.get_vocab() == reference.get_vocab()
        assert len(ours) == len(reference) and ours.vocab_size == reference.vocab_size


def test_ids_and_texts_are_transformers_own(pairs: list[tuple[GGUFTokenizer, Any]]) -> None:
    for ours, reference in pairs:
        for text in TEXTS:
            for special in (True, False):
                ids = ours.encode(text, add_special_tokens=special)
                assert ids == reference.encode(text, add_special_tokens=special), (text, special)
                for skip in (True, False):
                    assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                        ids, skip_special_tokens=skip
                    )
            ids = ours.encode(text)
            assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
            singles = [[i] for i in ids]
            assert ours.batch_decode(singles) == reference.batch_decode(singles)
            for cut in range(len(ids) + 1):  # streaming decodes a growing prefix
                assert ours.decode(ids[:cut], skip_special_tokens=True) == reference.decode(
                    ids[:cut], skip_special_tokens=True
                )
        every = list(range(len(ours)))
        assert ours.batch_decode([[i] for i in every]) == reference.batch_decode(
            [[i] for i in every]
        )
        assert ours.decode(every[:300]) == reference.decode(every[:300])  # split UTF-8 bytes
        assert ours.convert_ids_to_tokens(every, skip_special_tokens=True) == (
            reference.convert_ids_to_tokens(every, skip_special_tokens=True)
        )


def test_ids_outside_and_a_text_not_a_str(pairs: list[tuple[GGUFTokenizer, Any]]) -> None:
    ours, reference = pairs[0]
    outside = [len(ours) + 5, 3]
    assert ours.convert_ids_to_tokens(outside) == reference.convert_ids_to_tokens(outside)
    assert ours.convert_ids_to_tokens(len(ours)) is None
    with pytest.raises(ValueError, match="must be a str"):
        ours.encode(b"bytes")  # type: ignore[arg-type]


def test_the_cache_reads_back_the_same_tokenizer(tmp_path: Path) -> None:
    for path in _files(tmp_path):
        built = load_gguf_tokenizer(path, cache_dir=tmp_path / "c")
        again = load_gguf_tokenizer(path, cache_dir=tmp_path / "c")
        assert isinstance(built, GGUFTokenizer) and isinstance(again, GGUFTokenizer)
        assert again.backend.to_str() == built.backend.to_str()
        assert again.special == built.special
        assert again.encode(TEXTS[6]) == built.encode(TEXTS[6])


def test_an_unreadable_cache_entry_is_built_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_bpe_gguf(tmp_path / "q.gguf", "qwen2")
    first = load_gguf_tokenizer(path, cache_dir=tmp_path / "c")
    (entry,) = (tmp_path / "c" / "tokenizers").iterdir()
    (entry / "special_tokens.json").write_text("[1, 2]")
    again = load_gguf_tokenizer(path, cache_dir=tmp_path / "c")
    assert "ignoring unreadable tokenizer cache" in caplog.text
    assert isinstance(again, GGUFTokenizer) and again.special == first.special


def test_a_sentencepiece_file_keeps_transformers_conversion(tmp_path: Path) -> None:
    from tests.model.tiny_families import GGUF_READY, tiny_family, write_family_gguf

    model = tiny_family("gemma2", seed=4, **GGUF_READY.get("gemma2", {}))
    path = write_family_gguf(tmp_path / "g.gguf", model, spm=True)
    loaded = load_gguf_tokenizer(path, cache_dir=tmp_path / "c")
    assert not isinstance(loaded, GGUFTokenizer)
    assert loaded.encode(" Hi there") == convert_gguf_tokenizer(path).encode(" Hi there")


def test_transformers_tokenizer_is_the_same_tokenizer(
    pairs: list[tuple[GGUFTokenizer, Any]],
) -> None:
    for ours, reference in pairs:
        theirs = ours.transformers_tokenizer()
        assert theirs.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
        assert theirs.special_tokens_map == reference.special_tokens_map
        assert theirs.encode(TEXTS[1]) == reference.encode(TEXTS[1])


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, «quoted» & <escaped>?",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi 🙂"}],
    [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "simple sum"},
        {"role": "user", "content": "And <|im_end|> 3+3?\n\n"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny, 21°C"},
    ],
]
EXTRA_TEMPLATES = [
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}{{ ns.n }}"
    "{{ dict(a=1) | tojson }}{{ strftime_now('%Y') }}{{ bos_token }}",
    "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% continue %}{% endif %}"
    "{{ m.thinking | default('-') }}{% endfor %}",
]


def _renders(ours: GGUFTokenizer, reference: Any, template: str | None) -> None:
    for messages in CONVERSATIONS:
        for tools in (None, [WEATHER]):
            for prompt in (True, False):
                for extra in ({}, {"tools_in_user_message": False, "date_string": "1 Jan 2025"}):
                    args = dict(tools=tools, add_generation_prompt=prompt, tokenize=False)
                    args |= dict(chat_template=template, **extra)
                    try:
                        expected = reference.apply_chat_template(messages, **args)
                    except Exception as exc:  # the template's own errors: raised alike
                        with pytest.raises(type(exc)):
                            ours.apply_chat_template(messages, **args)
                        continue
                    assert ours.apply_chat_template(messages, **args) == expected


def test_chat_renders_are_transformers_own(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tests.model.bpe_files import LLAMA3_TEMPLATE, QWEN_TEMPLATE

    for path in _files(tmp_path):
        ours = GGUFTokenizer(*build_bpe(GGUFFile(path)))
        reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        for template in (None, LLAMA3_TEMPLATE, QWEN_TEMPLATE, *EXTRA_TEMPLATES):
            if template is None and ours.chat_template is None:
                continue
            _renders(ours, reference, template)
        assert ours._transformers is None  # rendered by jinja2 alone


def test_chat_renders_that_only_transformers_makes(tmp_path: Path) -> None:
    path = write_bpe_gguf(tmp_path / "q.gguf", "qwen2")
    ours, reference = GGUFTokenizer(*build_bpe(GGUFFile(path))), convert_gguf_tokenizer(path)
    messages = CONVERSATIONS[1]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(messages)
    tagged = ours.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert tagged == reference.apply_chat_template(
        messages, tokenize=False, continue_final_message=True
    )
    batch = [messages, CONVERSATIONS[0]]
    assert ours.apply_chat_template(batch, tokenize=False) == reference.apply_chat_template(
        batch, tokenize=False
    )
    with pytest.raises(ValueError, match="empty conversation"):
        ours.apply_chat_template([], tokenize=False)
    bad = "{% set ns = namespace() %}{% set ns._x = 1 %}{{ messages[0].content }}"
    import jinja2

    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(messages, chat_template=bad, tokenize=False)


def test_a_file_without_its_vocabulary_is_a_load_error(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    from hybridspec.errors import ModelLoadError

    path = tmp_path / "empty.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"empty\.gguf.*tokenizer\.ggml\.tokens"):
        load_gguf_tokenizer(path, cache_dir=tmp_path / "c")
