"""``GGUFTokenizer``: the tokenizer methods the runtime, server, grammar and proposers call, over
a ``tokenizers.Tokenizer`` alone (``model.bpe_tokenizer`` builds it from a GGUF file), so that
loading and running a model does not import transformers (about half a second of CPU).

Its ids and texts are those of the ``TokenizersBackend`` that transformers builds from the same
file: ``encode`` and ``decode`` are the backend's own calls, as that class makes them (a BPE
model's decode skips the clean-up of spaces). What only transformers does (a
save in transformers' layout, xgrammar's tokenizer info, a chat template's rarer arguments)
goes through ``transformers_tokenizer()``, the equivalent transformers object, built on first
use; a chat template's plain text render is jinja2's (``model.chat_template``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridspec.model.bpe_tokenizer import SpecialTokens
from hybridspec.model.chat_template import Unsupported, render

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

TOKENIZER_FILE, SPECIAL_FILE = "tokenizer.json", "special_tokens.json"
# apply_chat_template's arguments that only transformers' own method takes
_TRANSFORMERS_ONLY = frozenset(
    (
        "documents",
        "continue_final_message",
        "return_assistant_tokens_mask",
        "sanitize_control_tokens",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    )
)


class GGUFTokenizer:
    """A byte-level BPE tokenizer with its special tokens and chat template (module docstring)."""

    def __init__(self, backend: Tokenizer, special: SpecialTokens) -> None:
        self.backend = backend
        self.special = special
        self.chat_template = special.chat_template
        self._transformers: PreTrainedTokenizerBase | None = None

    @classmethod
    def load(cls, folder: Path) -> GGUFTokenizer:
        """Read what ``save`` wrote (ValueError/OSError for a missing or unreadable folder)."""
        from tokenizers import Tokenizer

        fields = json.loads((folder / SPECIAL_FILE).read_text(encoding="utf-8"))
        if not isinstance(fields, dict):
            raise ValueError(f"{folder / SPECIAL_FILE}: not a JSON object")
        try:
            special = SpecialTokens(**fields)
        except TypeError as exc:
            raise ValueError(f"{folder / SPECIAL_FILE}: {exc}") from exc
        try:
            backend = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
        except Exception as exc:  # tokenizers raises a bare Exception for a bad file
            raise ValueError(f"{folder / TOKENIZER_FILE}: {exc}") from exc
        return cls(backend, special)

    def save(self, folder: Path) -> None:
        """``tokenizer.json`` (the backend) and ``special_tokens.json`` into ``folder``."""
        self.backend.save(str(folder / TOKENIZER_FILE))
        text = json.dumps(self.special.to_dict(), ensure_ascii=False, indent=1)
        (folder / SPECIAL_FILE).write_text(text + "\n", encoding="utf-8")

    # ids of the named special tokens (None where the file names none)
    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special.bos_token

    @property
    def eos_token(self) -> str | None:
        return self.special.eos_token

    @property
    def pad_token(self) -> str | None:
        return self.special.pad_token

    @property
    def unk_token(self) -> str | None:
        return self.special.unk_token

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.special.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.special.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.special.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.special.unk_token)

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens, once each (transformers' ``all_special_tokens``)."""
        return list(dict.fromkeys(self._special_tokens_map().values()))

    @property
    def all_special_ids(self) -> list[int]:
        """Their ids (``build_bpe`` adds each named token to the vocabulary: never None)."""
        ids = [self.backend.token_to_id(t) for t in self.all_special_tokens]
        return [i for i in ids if i is not None]

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size, without added tokens (transformers' ``vocab_size``)."""
        return int(self.backend.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a str, not {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def batch_decode(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        seqs = [list(ids) for ids in sequences]
        return list(self.backend.decode_batch(seqs, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(
        self, ids: int | Sequence[int], skip_special_tokens: bool = False
    ) -> str | list[str | None] | None:
        """Each id's token string (None for an id outside the vocabulary, as transformers);
        ``skip_special_tokens`` drops the named special tokens' ids (transformers'
        ``all_special_ids``)."""
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int | None] | None:
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    def apply_chat_template(
        self,
        conversation: Any,
        tools: Any = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> Any:
        """transformers' ``apply_chat_template`` (same arguments and result). A text render
        (``tokenize=False``) of one conversation of plain messages is jinja2's here
        (``chat_template.render``); anything else goes through ``transformers_tokenizer()``."""
        template = chat_template if chat_template is not None else self.chat_template
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        if template is not None and not tokenize and not kwargs.keys() & _TRANSFORMERS_ONLY:
            variables = {**self._special_tokens_map(), **kwargs}
            try:
                return render(template, conversation, tools, add_generation_prompt, variables)
            except Unsupported:
                pass
        return self.transformers_tokenizer().apply_chat_template(
            conversation,
            tools=tools,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            **kwargs,
        )

    def _special_tokens_map(self) -> dict[str, str]:
        """The named special tokens the file has (transformers' ``special_tokens_map``)."""
        named = ("bos_token", "eos_token", "unk_token", "pad_token")
        return {n: t for n in named if (t := getattr(self.special, n)) is not None}

    def save_pretrained(self, folder: str | Path, **kwargs: Any) -> Any:
        """transformers' ``save_pretrained``: a folder ``AutoTokenizer`` reads."""
        return self.transformers_tokenizer().save_pretrained(folder, **kwargs)

    def transformers_tokenizer(self) -> PreTrainedTokenizerBase:
        """The equivalent transformers ``TokenizersBackend`` (built once, on first use)."""
        if self._transformers is None:
            from transformers import TokenizersBackend

            special = self.special
            self._transformers = TokenizersBackend(
                tokenizer_object=self.backend,
                bos_token=special.bos_token,
                eos_token=special.eos_token,
                unk_token=special.unk_token,
                pad_token=special.pad_token,
                add_bos_token=special.add_bos_token,
                add_eos_token=special.add_eos_token,
                chat_template=special.chat_template,
            )
        return self._transformers


def as_transformers(tokenizer: Any) -> Any:
    """``tokenizer`` as a transformers tokenizer, for code that inspects its class (xgrammar):
    a ``GGUFTokenizer``'s ``transformers_tokenizer()``, anything else as it is."""
    if isinstance(tokenizer, GGUFTokenizer):
        return tokenizer.transformers_tokenizer()
    return tokenizer
