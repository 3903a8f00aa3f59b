"""A chat template rendered by jinja2 as transformers renders it, without importing transformers.

``render`` mirrors ``transformers.utils.chat_template_utils``: the same sandboxed environment
(``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the
``{% generation %}`` tag), the same globals (``raise_exception``, ``strftime_now``, ``dict``,
``namespace`` refusing underscore names) and ``tojson`` filter (no HTML escaping), and the same
treatment of the inputs: messages' ``None`` values dropped, reasoning copied under its aliases,
and every value rebuilt from plain JSON types. Tests compare its renders with transformers'.

Inputs it does not take (``Unsupported``: a message or tool that is not a plain dict, values of
other types) are left to transformers by the caller (``tokenizer.GGUFTokenizer``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Unsupported(Exception):
    """An input this renderer does not take: the caller renders it through transformers."""


def render(
    template: str,
    messages: Any,
    tools: Any = None,
    add_generation_prompt: bool = False,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """``template`` rendered for one conversation, as transformers' ``apply_chat_template``
    with ``tokenize=False`` renders it (``variables``: the special tokens and extra keywords)."""
    if not isinstance(messages, (list, tuple)):
        raise Unsupported("a conversation other than a list of messages")
    chat = []
    for message in messages:
        if not isinstance(message, dict):
            raise Unsupported("a message other than a dict")
        chat.append(_plain({k: v for k, v in message.items() if v is not None}))
    if tools is not None:
        if not all(isinstance(tool, dict) for tool in tools):
            raise Unsupported("a tool other than a JSON schema")
        tools = _plain(list(tools))
    return str(
        _compiled(template).render(
            messages=_alias_reasoning(chat),
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **_plain(dict(variables or {})),
        )
    )


def _plain(value: Any) -> Any:
    """``value`` rebuilt from exact JSON types (what the template sees); Unsupported otherwise."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    raise Unsupported(f"a value of type {type(value).__name__}")


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's reasoning under every name templates read it by (transformers does so)."""
    aliased = []
    for message in chat:
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    """The template compiled in transformers' environment (module docstring)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: the body, as it is (transformers tracks
        where it falls only for assistant masks, which are not rendered here)."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it so)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> Any:
            return caller()

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"but got {name!r}. Please rename the attribute."
                )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)
