"""Schemathesis hooks for the OpenAPI test (loaded through ``SCHEMATHESIS_HOOKS``).

``positive_data_acceptance_but_context`` is schemathesis' own ``positive_data_acceptance`` with
two exemptions that no JSON Schema can state: a schema-valid prompt that tokenizes to more
tokens than the context holds (it depends on how the text tokenizes, and on all messages
together), answered with a 400 whose code, OpenAI's ``context_length_exceeded``, says so; and
a grammar, regex or JSON schema (``guided_*``, ``response_format``, tools' parameters) that
does not compile, answered with code ``invalid_grammar``; fields valid alone that a request
cannot combine (a tool_choice without tools, two output constraints), answered with code
``incompatible_fields``; and a ``tool`` message without ``tool_call_id`` (the schema has one message
type for every role), answered with a 400 naming ``messages[i].tool_call_id``. Every other
refusal of schema-valid data still fails.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance


@schemathesis.check
def positive_data_acceptance_but_context(ctx: Any, response: Any, case: Any) -> bool | None:
    if response.status_code == 400:
        try:
            code = response.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        if code in ("context_length_exceeded", "invalid_grammar", "incompatible_fields"):
            return None
        if str(response.json()["error"].get("param")).endswith(".tool_call_id"):
            return None
    result: bool | None = positive_data_acceptance(ctx, response, case)
    return result
