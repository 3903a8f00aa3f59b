"""Tenants: who sends a request, known from its API key, and what that changes.

One server is often shared (a team's agents, a lab's notebooks, several apps with a key each).
An API key file (``--api-keys FILE``) names them: one ``TENANT KEY`` pair a line, ``#`` comments
and blank lines skipped; a tenant may have several keys (to rotate one), a key one tenant. The
tenant then

- takes turns with the others in admission (``engine.turns``): ``GenerationParams.tenant``;
- reads and leaves cached text in its own scope (``cache_scope``) under ``per-tenant``
  isolation: the prefix cache and the ``suffix`` pools never serve one tenant faster for
  another's text; a request's ``cache_salt`` (vLLM's field) scopes further, within its tenant;
- is a label of the metrics (bounded: the file's names) and named in the log, never its key.

``--api-key KEY`` stays one anonymous tenant (``None``), as requests without a key are when
the server asks for none.

Isolation (``ServerConfig.cache_isolation``): ``per-tenant`` (the default with a key file),
``shared`` (every tenant reads every cached text; a ``cache_salt`` still scopes), ``off`` (no
request reads or leaves cached text: the prefix cache and the pools stand unused).
"""

from __future__ import annotations

import dataclasses
import hmac
import re
from collections.abc import Iterable

from starlette.requests import Request

from hybridspec.engine.request import GenerationParams
from hybridspec.errors import InvalidRequestError

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")  # a bounded metrics label
TENANT_SCOPE_KEY = "hybridspec.tenant"  # the ASGI scope's key for the request's tenant


def _bad_key_file(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param="api_keys")


def read_key_file(path: str) -> tuple[tuple[str, str], ...]:
    """The ``(tenant, key)`` pairs of an API key file (module docstring), in file order.

    Raises InvalidRequestError (a ValueError) naming the file and the line: unreadable, a
    line that is not two fields, a tenant name that is not ``TENANT_NAME``, a key of
    unprintable characters, a key given twice. No message repeats a key.
    """
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise _bad_key_file(f"api key file {path!r}: cannot be read ({exc})") from None
    pairs: list[tuple[str, str]] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"api key file {path!r}, line {number}"
        if len(fields) != 2:
            raise _bad_key_file(f"{where}: expected 'TENANT KEY', got {len(fields)} fields")
        tenant, key = fields
        if TENANT_NAME.fullmatch(tenant) is None:
            raise _bad_key_file(
                f"{where}: the tenant name {tenant[:64]!r} is not 1-64 letters, digits, "
                "'_', '.', '@' or '-' (starting with a letter or digit)"
            )
        if not key.isprintable():
            raise _bad_key_file(f"{where}: the key has unprintable characters")
        if key in first_line:
            raise _bad_key_file(f"{where}: a duplicate key (first on line {first_line[key]})")
        first_line[key] = number
        pairs.append((tenant, key))
    if not pairs:
        raise _bad_key_file(f"api key file {path!r}: no 'TENANT KEY' line")
    return tuple(pairs)


class KeyRing:
    """Which tenant a bearer key belongs to: every known key is compared in constant time."""

    def __init__(self, keys: Iterable[tuple[str | None, str]]) -> None:
        self._keys = [(tenant, key.encode()) for tenant, key in keys]

    def tenant_of(self, token: bytes) -> tuple[bool, str | None]:
        """(known, tenant): whether ``token`` is a key, and whose (None: the anonymous one).
        Every key is compared, so the time taken tells nothing of which one matched."""
        found, tenant = False, None
        for owner, key in self._keys:
            if hmac.compare_digest(token, key):
                found, tenant = True, owner
        return found, tenant


def tenant_of(request: Request) -> str | None:
    """The tenant whose key ``request`` came with (None: anonymous, or no keys)."""
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    return tenant if isinstance(tenant, str) else None


def cache_scope(isolation: str, tenant: str | None, salt: str | None) -> str | None:
    """The cache scope of a request (``GenerationParams.cache_scope``): under ``per-tenant``
    its tenant's, then its salt's within it; under ``shared`` its salt's; None (the shared
    scope) for neither. A tenant name has no newline, so ``tenant + "\\n" + salt`` is never
    another pair's."""
    owner = tenant if isolation == "per-tenant" else None
    if owner is None and salt is None:
        return None
    return f"{owner or ''}\n{salt or ''}"


def scoped(
    params: GenerationParams, isolation: str, tenant: str | None, salt: str | None
) -> GenerationParams:
    """``params`` with the request's tenant and cache scope (``off``: no cached text read or
    left)."""
    if isolation == "off":
        return dataclasses.replace(params, tenant=tenant, cache_prompt=False, cache_scope=None)
    scope = cache_scope(isolation, tenant, salt)
    return dataclasses.replace(params, tenant=tenant, cache_scope=scope)
