"""A tiny SentencePiece vocabulary trained in a test (byte fallback), written into a checkpoint
folder as the families that ship SentencePiece vocabularies ship theirs (``tokenizer.model``,
``tokenizer_config.json``), so that llama.cpp's converter carries it into the GGUF file as
tokenizer model "llama" (tests only; needs ``sentencepiece``)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a king who had three daughters.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10",
    "def main():\n    print('hello world')\n    return 0",
]
SPM_PIECES = 400  # the trained model's size; added tokens come after it


@dataclass(frozen=True, slots=True)
class SpmVocabulary:
    """What sets one family's SentencePiece vocabulary apart: its special ids, the symbols
    trained in as pieces, the tokens added after the pieces (``added_tokens_decoder``, ids
    from ``SPM_PIECES``) and the rest of ``tokenizer_config.json``."""

    special_ids: dict[str, int]  # sentencepiece's pad_id, eos_id, bos_id, unk_id (-1: none)
    user_symbols: tuple[str, ...] = ()
    added_tokens: tuple[str, ...] = ()
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return SPM_PIECES + len(self.added_tokens)


def write_spm_tokenizer(folder: Path, vocabulary: SpmVocabulary) -> int:
    """Train the vocabulary and write it into ``folder``; returns its size (the model's
    ``vocab_size``)."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_TEXT * 20),
        model_writer=model,
        vocab_size=SPM_PIECES,
        model_type="bpe",
        byte_fallback=True,
        user_defined_symbols=list(vocabulary.user_symbols),
        character_coverage=1.0,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        minloglevel=2,
        **vocabulary.special_ids,
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    added = {
        str(SPM_PIECES + i): {"content": token, "special": True, "normalized": False}
        for i, token in enumerate(vocabulary.added_tokens)
    }
    config = vocabulary.config | ({"added_tokens_decoder": added} if added else {})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return vocabulary.size
