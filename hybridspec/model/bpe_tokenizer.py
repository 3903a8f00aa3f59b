"""A byte-level BPE GGUF tokenizer (``tokenizer.ggml.model`` "gpt2": Llama 3, SmolLM2, Qwen2/3)
built with the ``tokenizers`` library alone, from the fields ``gguf_file.GGUFFile`` reads.

``build_bpe`` builds the same ``tokenizers.Tokenizer`` that transformers' GGUF conversion
(``integrations.gguf.gguf_tokenizer_mapping``: ``byte_level_tokenizer``, then the special
tokens and the split regex, then ``TokenizersBackend``'s special tokens and post-processor)
leaves in its ``backend_tokenizer``: the same serialized JSON, so the same ids (tests compare
the two). It does not import transformers: that import and its converter's second read of the
vocabulary cost a first load about three seconds of CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridspec.model.gguf_file import GGUFFile

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_GPT2_DEFAULT = "<|endoftext|>"  # GPT2Tokenizer's default bos/eos/unk token, added if missing

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex transformers' converter sets (others: ByteLevel's own)
_SPLITS = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """The named special tokens of a GGUF tokenizer (token strings, None where the file names
    none), whether encoding adds BOS/EOS, and the chat template."""

    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def is_byte_level(reader: GGUFFile) -> bool:
    """True for the files ``build_bpe`` builds: tokenizer model "gpt2" (the vocabulary itself
    is not decoded here: a later load reads only the cached ``tokenizer.json``)."""
    return bool(reader.get("tokenizer.ggml.model") == "gpt2")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table: printable bytes stand for themselves, the others for
    characters from 256 on, so that every byte string is spelled in printable characters."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_bpe(reader: GGUFFile) -> tuple[Any, SpecialTokens]:
    """The file's ``tokenizers.Tokenizer`` and its special tokens (module docstring); raises
    ValueError for a file that is not of the byte-level kind."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    if not is_byte_level(reader):
        raise ValueError("not a byte-level BPE (tokenizer model 'gpt2') vocabulary")
    tokens: list[str] = list(reader.get("tokenizer.ggml.tokens") or ())
    if not tokens:
        raise ValueError("metadata 'tokenizer.ggml.tokens' is missing or empty")
    types: list[int] = list(reader.get("tokenizer.ggml.token_type") or ())
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in reader.get("tokenizer.ggml.merges") or ()]
    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    _add_file_tokens(tokenizer, tokens, types, alphabet)
    split = _SPLITS.get(str(reader.get("tokenizer.ggml.pre")))
    if split is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    special = _special_tokens(reader, tokens)
    named = [special.bos_token, special.eos_token, special.unk_token, special.pad_token]
    current = tokenizer.get_vocab(with_added_tokens=True)
    tokenizer.add_tokens(
        [AddedToken(t, special=True) for t in dict.fromkeys(named) if t and t not in current]
    )
    tokenizer.post_processor = _post_processor(tokenizer, special)
    return tokenizer, special


def _special_tokens(reader: GGUFFile, tokens: list[str]) -> SpecialTokens:
    def named(key: str) -> str | None:
        index = reader.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None else None

    template = reader.get("tokenizer.chat_template")
    return SpecialTokens(
        bos_token=named("bos_token_id"),
        eos_token=named("eos_token_id"),
        unk_token=named("unknown_token_id"),
        pad_token=named("padding_token_id"),
        add_bos_token=bool(reader.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(reader.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=str(template) if template is not None else None,
    )


def _add_file_tokens(
    tokenizer: Any, tokens: list[str], types: list[int], alphabet: set[str]
) -> None:
    """GPT2Tokenizer's default token where the vocabulary lacks it, then the file's control
    tokens as special (those spelled outside the byte alphabet are llama.cpp's mislabels:
    skipped) and its user-defined ones as plain added tokens, as transformers adds them."""
    from tokenizers import AddedToken

    if tokenizer.token_to_id(_GPT2_DEFAULT) is None:
        tokenizer.add_tokens([AddedToken(_GPT2_DEFAULT, special=True)])
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _CONTROL and set(t) <= alphabet
    ]
    tokenizer.add_special_tokens(control)
    current = tokenizer.get_vocab(with_added_tokens=True)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _USER_DEFINED and t in current
    ]
    tokenizer.add_tokens(user)


def _post_processor(tokenizer: Any, special: SpecialTokens) -> Any:
    """``TokenizersBackend.update_post_processor``'s template: BOS/EOS where the file adds them."""
    from tokenizers import processors

    bos = special.bos_token if special.add_bos_token else None
    eos = special.eos_token if special.add_eos_token else None
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    ids = [(t, tokenizer.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)
