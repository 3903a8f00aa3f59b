"""A GGUF file's tokenizer, built once and cached on disk.

A byte-level BPE vocabulary (tokenizer model "gpt2": Llama 3, SmolLM2, Qwen) is built with the
``tokenizers`` library alone (``bpe_tokenizer.build_bpe``) and saved as ``tokenizer.json`` and
its special tokens; later loads read it back (``tokenizer.GGUFTokenizer.load``). Neither imports
transformers. Other kinds (SentencePiece "llama", ...) keep transformers' conversion:

``load_gguf_tokenizer``: the cache entry (``default_cache_dir()/tokenizers``) where one is
saved, read back through the class its config names (``gguf_meta.saved_tokenizer_class``);
else the file's vocabulary converted (``convert_gguf_tokenizer``, through the class
AutoTokenizer would pick: ``gguf_meta.tokenizer_class``) and saved atomically, its added tokens
recorded in its config so that a later load parses ``tokenizer.json`` once, in Rust.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, cast

from hybridspec.errors import ModelLoadError
from hybridspec.model.bpe_tokenizer import build_bpe, is_byte_level
from hybridspec.model.gguf_file import GGUFFile
from hybridspec.model.gguf_meta import saved_tokenizer_class, tokenizer_class
from hybridspec.model.tokenizer import GGUFTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_ENTRY_FORMAT = 2  # a cached tokenizer's layout: 2 records its added tokens in its config
_BPE_FORMAT = 1  # a cached ``GGUFTokenizer``'s layout (``GGUFTokenizer.save``)


def default_cache_dir() -> Path:
    """``$HYBRIDSPEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/hybridspec`` or ``~/.cache/hybridspec``."""
    explicit = os.environ.get("HYBRIDSPEC_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hybridspec"


def load_gguf_tokenizer(
    path: str | os.PathLike[str], cache_dir: Path | None = None
) -> PreTrainedTokenizerBase:
    """The file's tokenizer, built once and then loaded from ``cache_dir`` (module docstring).
    A ``GGUFTokenizer`` is typed as transformers' class: it has the methods callers use.

    The cache entry is keyed by the file's name, size and modification time and by the entry's
    format; a transformers conversion's also by the transformers version (its converter's
    output may change between versions).
    """
    path = Path(path).resolve()
    reader = GGUFFile(path)  # ModelLoadError for an unreadable file
    if is_byte_level(reader):
        entry = _entry(path, cache_dir, f"bpe{_BPE_FORMAT}")
        if entry.is_dir():
            try:
                return cast("PreTrainedTokenizerBase", GGUFTokenizer.load(entry))
            except (OSError, ValueError) as exc:
                logger.warning("ignoring unreadable tokenizer cache %s: %s", entry, exc)
        try:
            tokenizer = GGUFTokenizer(*build_bpe(reader))
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ModelLoadError(
                f"cannot build a tokenizer from GGUF file {str(path)!r}: {exc}"
            ) from exc
        _save_atomically(tokenizer, entry)
        return cast("PreTrainedTokenizerBase", tokenizer)
    import transformers

    entry = _entry(path, cache_dir, f"{transformers.__version__}|{_ENTRY_FORMAT}")
    if entry.is_dir():
        try:
            return saved_tokenizer_class(entry).from_pretrained(entry)
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable tokenizer cache %s: %s", entry, exc)
    converted = convert_gguf_tokenizer(path)
    _save_atomically(converted, entry)
    return converted


def _entry(path: Path, cache_dir: Path | None, kind: str) -> Path:
    """The cache folder of the file's tokenizer of this kind (and format)."""
    stat = path.stat()
    key = f"{path.name}|{stat.st_size}|{stat.st_mtime_ns}|{kind}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return (cache_dir or default_cache_dir()) / "tokenizers" / f"{path.stem}-{digest}"


def convert_gguf_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Convert the file's vocabulary with transformers (no cache): the class AutoTokenizer
    would pick, chosen from the file's architecture (``gguf_meta.tokenizer_class``)."""
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        reader = GGUFFile(path)
        arch, name = reader.get("general.architecture"), reader.get("general.name")
        chosen = tokenizer_class(path, arch, name)  # AutoTokenizer's, without its file read
        if chosen is not None:
            return chosen.from_pretrained(path.parent, gguf_file=path.name)
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(
            f"cannot build a tokenizer from GGUF file {str(path)!r}: {exc}"
        ) from exc


def _save_atomically(tokenizer: GGUFTokenizer | PreTrainedTokenizerBase, entry: Path) -> None:
    """Save into a fresh sibling folder, then rename it into place, so that a concurrent reader
    never sees a half-written entry. A cache that cannot be written is only logged."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}-"))
        if isinstance(tokenizer, GGUFTokenizer):
            tokenizer.save(staging)
        else:
            tokenizer.save_pretrained(staging)
            _record_added_tokens(staging)
        try:
            staging.rename(entry)
        except OSError:  # another process got there first; its entry is as good as ours
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        logger.warning("cannot cache the converted tokenizer in %s: %s", entry, exc)


def _record_added_tokens(folder: Path) -> None:
    """Copy a saved tokenizer's added tokens from its ``tokenizer.json`` into its
    ``tokenizer_config.json`` as ``added_tokens_decoder``, the form transformers reads there
    first: without it, every load from the cache parses the whole ``tokenizer.json`` in Python
    only to find them (about a third of a second for a 128k vocabulary), besides the Rust
    parse that builds the tokenizer. The same token fields either way, so the same tokenizer."""
    config_path, tokenizer_path = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not config_path.is_file() or not tokenizer_path.is_file():
        return
    config = json.loads(config_path.read_text(encoding="utf-8"))
    added = json.loads(tokenizer_path.read_text(encoding="utf-8")).get("added_tokens")
    if "added_tokens_decoder" in config or not isinstance(added, list):
        return
    config["added_tokens_decoder"] = {
        str(token["id"]): {k: v for k, v in token.items() if k != "id"} for token in added
    }
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")
