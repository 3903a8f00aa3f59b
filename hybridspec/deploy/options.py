"""A ``ServerConfig`` from the ``args`` of a Ray Serve config file or of ``serve run``.

The keys are the configuration's own field names, nested (YAML) or dotted (``serve run``'s
``key=value`` arguments), so an option means what it means in the library::

    args:                                   # serve run hybridspec.deploy:build_app \\
      engine:                               #     engine.target.name_or_path=/models/m \\
        target: {name_or_path: /models/m, max_num_seqs: 8}
        default_proposer: ngram             #     engine.default_proposer=ngram
      served_model_name: my-model

Text values (all of ``serve run``'s) are converted to the field's type: ``8`` to an int,
``true``/``false`` to a bool, ``none``/``null`` to None where the field allows it. An unknown
key or a value of the wrong type is an ``InvalidRequestError`` (a ValueError) naming the
dotted field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from hybridspec.errors import InvalidRequestError
from hybridspec.server.config import ServerConfig

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_NONE = frozenset({"none", "null", "~", ""})


def server_config_from_args(args: Mapping[str, Any] | None) -> ServerConfig:
    """The ServerConfig that ``args`` describes (fields not named keep their defaults)."""
    config = _build(ServerConfig, _nest(args or {}), "")
    assert isinstance(config, ServerConfig)
    return config


def _nest(args: Mapping[str, Any]) -> dict[str, Any]:
    """``{"engine.target.dtype": x}`` -> ``{"engine": {"target": {"dtype": x}}}``."""
    nested: dict[str, Any] = {}
    for key, value in args.items():
        if not isinstance(key, str) or not key:
            raise InvalidRequestError(f"args: expected option names, got {key!r}", "args")
        *parents, leaf = key.split(".")
        node = nested
        for i, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                name = ".".join(parents[: i + 1])
                raise InvalidRequestError(f"{name}: given both a value and sub-options", name)
            node = child
        if isinstance(value, Mapping):
            value = _nest(value)
            existing = node.get(leaf)
            if isinstance(existing, dict):
                value = {**existing, **value}
        node[leaf] = value
    return nested


def _build(cls: type, values: Mapping[str, Any], prefix: str) -> object:
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        name = prefix + key
        if key not in fields:
            expected = ", ".join(prefix + f for f in fields)
            raise InvalidRequestError(f"{name}: unknown option; expected one of {expected}", name)
        kwargs[key] = _convert(hints[key], value, name)
    return cls(**kwargs)


def _convert(hint: Any, value: Any, name: str) -> Any:
    """``value`` as the field's type ``hint`` wants it (see the module doc)."""
    options = (
        typing.get_args(hint)
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        else (hint,)
    )
    nullable = type(None) in options
    for option in options:
        if dataclasses.is_dataclass(option) and isinstance(value, Mapping):
            return _build(typing.cast(type, option), value, name + ".")
    if not isinstance(value, str) or str in options:
        return value  # the config's own checks say whether it fits
    text = value.strip().lower()
    if nullable and text in _NONE:
        return None
    for option in options:
        if option is bool and text in _TRUE | _FALSE:
            return text in _TRUE
        if option in (int, float):
            try:
                return option(value)
            except ValueError:
                continue
    wanted = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise InvalidRequestError(f"{name}: expected {wanted}, got {value!r}", name)
