"""What a GGUF file's metadata builds through transformers, without transformers' slow parts.

A load of a GGUF file on the native forward needs transformers for two things: the
architecture's config (``LlamaConfig``, ``Qwen3Config``...) and the tokenizer. Importing a config
class costs about a second and a half of CPU and 60-80 MB (its module pulls in
``torch.distributed`` and ``sympy``); ``AutoTokenizer`` with ``gguf_file`` reads the whole file's
metadata a second time with ``gguf.GGUFReader`` only to learn the model type (seconds for a
128k vocabulary).

- ``config_for``: the config is built once per set of metadata fields (and transformers version)
  and its ``to_dict()`` saved in ``<cache>/configs`` (a few KB); later loads get a
  ``StoredConfig``, the same attributes without the import, and build the real config only when
  something asks for it (``StoredConfig.build``). A ``llama`` config's ``to_dict()`` is its
  class's defaults (``LLAMA_DEFAULTS``) overridden by the fields, so a first load builds that
  one without transformers too (a test checks it against transformers' own).
- ``tokenizer_class``: the class ``AutoTokenizer`` picks for a GGUF file whose folder holds no
  ``tokenizer_config.json`` (``TOKENIZER_MAPPING`` by model type, else ``TokenizersBackend``),
  chosen from the architecture read by ``gguf_file.GGUFFile``; None where that choice depends
  on more (a tokenizer config beside the file, a Mistral file written as ``llama``), and then
  the caller keeps ``AutoTokenizer``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# the model types whose tokenizer class is AutoTokenizer's by type alone (module docstring)
_PLAIN_TOKENIZER_TYPES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")

# ``LlamaConfig().to_dict()`` less its version (``transformers_version``, filled in from the
# installed package's metadata): what ``config_for`` overrides with a file's fields
LLAMA_DEFAULTS: dict[str, Any] = {
    "architectures": None,
    "output_hidden_states": False,
    "return_dict": True,
    "dtype": None,
    "chunk_size_feed_forward": 0,
    "is_encoder_decoder": False,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
    "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    "problem_type": None,
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "use_cache": True,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "head_dim": 128,
    "_name_or_path": "",
    "model_type": "llama",
    "output_attentions": False,
}


class StoredConfig(SimpleNamespace):
    """A transformers config's attributes as its ``to_dict()`` saved them: what the native
    forward reads (``getattr``), without importing the config's class."""

    def get_text_config(self, *args: Any, **kwargs: Any) -> StoredConfig:
        return self

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def build(self) -> PretrainedConfig:
        """The real config, from the same fields (as the weight cache rebuilds one)."""
        from transformers import CONFIG_MAPPING

        config: PretrainedConfig = CONFIG_MAPPING[self.model_type].from_dict(self.to_dict())
        return config


def config_for(
    model_type: str, fields: dict[str, Any], cache_dir: Path
) -> PretrainedConfig | StoredConfig:
    """``AutoConfig.for_model(model_type, **fields)``, or its saved attributes (``StoredConfig``)
    where an earlier load saved them under ``cache_dir / "configs"``."""
    version = importlib.metadata.version("transformers")
    key = json.dumps([model_type, fields, version], sort_keys=True, default=repr)
    entry = (
        cache_dir / "configs" / f"{model_type}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    )
    try:
        saved = json.loads(entry.read_text())
        if isinstance(saved, dict) and saved.get("model_type"):
            return StoredConfig(**saved)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("ignoring unreadable config cache %s: %s", entry, exc)
    if model_type == "llama":
        try:
            text = json.dumps(
                {"transformers_version": version, **LLAMA_DEFAULTS, **fields}, sort_keys=True
            )
        except (TypeError, ValueError):  # a field JSON cannot hold: transformers' config below
            pass
        else:
            _write_atomically(entry, text)
            return StoredConfig(**json.loads(text))
    from transformers import AutoConfig

    config: PretrainedConfig = AutoConfig.for_model(model_type, **fields)
    try:
        _write_atomically(entry, json.dumps(config.to_dict(), sort_keys=True))
    except (TypeError, ValueError) as exc:  # a field JSON cannot hold: built again next time
        logger.warning("cannot cache the config of %s: %s", model_type, exc)
    return config


def _write_atomically(entry: Path, text: str) -> None:
    """Write a fresh sibling file, then rename it into place (a reader never sees half of it);
    a cache that cannot be written is only logged."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(dir=entry.parent, prefix=f".{entry.name}-")
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(staging, entry)
    except OSError as exc:
        logger.warning("cannot cache the config in %s: %s", entry, exc)


def tokenizer_class(
    path: Path, architecture: str | None, name: str | None
) -> type[PreTrainedTokenizerBase] | None:
    """The class ``AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)`` builds, or
    None where only AutoTokenizer knows (module docstring)."""
    if (
        architecture not in _PLAIN_TOKENIZER_TYPES
        or (path.parent / "tokenizer_config.json").exists()
    ):
        return None
    if architecture == "llama" and "mistral" in str(name or "").lower():
        return None  # transformers reads it as a Mistral model
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    class_name = TOKENIZER_MAPPING_NAMES.get(architecture)
    chosen = tokenizer_class_from_name(class_name) if class_name else None
    return chosen if chosen is not None else TokenizersBackend


def saved_tokenizer_class(entry: Path) -> type[PreTrainedTokenizerBase]:
    """The class a saved tokenizer's ``tokenizer_config.json`` names where transformers exports
    it (``AutoTokenizer`` reads the same name; importing it costs a third of a second more), else
    ``AutoTokenizer``."""
    import transformers

    try:
        name = json.loads((entry / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    chosen = getattr(transformers, name, None) if isinstance(name, str) else None
    if isinstance(chosen, type) and issubclass(chosen, transformers.PreTrainedTokenizerBase):
        return chosen
    return cast("type[PreTrainedTokenizerBase]", transformers.AutoTokenizer)
