"""The exception hierarchy of hybridspec.

The server maps each class to an OpenAI-style error body (see ``hybridspec.server``):

- ``InvalidRequestError`` (a ``ValueError``): the caller's input is wrong, HTTP 400;
  ``ContextLengthError``, its prompt is too long; ``GrammarError``, its structured output
  cannot be compiled; ``IncompatibleFieldsError``, fields valid one by one that the request
  cannot combine.
- ``UnknownModelError``: a model name the engine does not serve, HTTP 404.
- ``CapacityError``: no room for the request right now (queue or KV cache full), HTTP 503;
  ``TenantLimitError``, its tenant holds all it may (``TenantConfig``), HTTP 429.
- ``ModelLoadError``: a model or tokenizer could not be loaded or does not fit the target.
"""

from __future__ import annotations


class HybridSpecError(Exception):
    """Base class of every error raised on purpose by hybridspec."""


class InvalidRequestError(HybridSpecError, ValueError):
    """A request or configuration argument is invalid.

    ``param`` names the offending field, so that servers can point at it.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """A prompt longer than the model's context (or the configured prompt limit) allows.

    Its own class because no request schema can state the limit (it depends on how the
    prompt tokenizes); servers answer it with OpenAI's ``context_length_exceeded`` code.
    """


class GrammarError(InvalidRequestError):
    """A request's structured output cannot be served: its grammar, regex or JSON schema (or
    its tools' parameters) does not compile, or it names tools in a way the model cannot be
    shown. Its own class because no request schema can state it; servers answer it with the
    code ``invalid_grammar``.
    """


class IncompatibleFieldsError(InvalidRequestError):
    """Fields each valid alone that one request cannot combine: a ``tool_choice`` without
    ``tools``, a named function that is not among them, two tools of one name, two fields that
    would each constrain the output. Its own class because no request schema can state it;
    servers answer it with the code ``incompatible_fields``.
    """


class UnknownModelError(InvalidRequestError):
    """A request names a model that this engine does not serve."""


class CapacityError(HybridSpecError):
    """The engine cannot take the request now; retrying later may succeed."""


class TenantLimitError(CapacityError):
    """The request's tenant already has as many requests waiting as it may
    (``TenantConfig.max_queued``); retrying once some of them have run may succeed."""


class ModelLoadError(HybridSpecError, ValueError):
    """A model, draft model or tokenizer cannot be loaded or is incompatible."""


def check(condition: bool, param: str, message: str) -> None:
    """Raise ``InvalidRequestError`` for ``param`` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise InvalidRequestError(f"{param}: {message}", param=param)
