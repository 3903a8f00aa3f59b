"""Tenants (``server.tenants``): the API key file, each key's tenant on every route, cached text
scoped per tenant (counted: prefix-cache hits and drafts, never timings), 429s, the metrics."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from hybridspec.cli import main
from hybridspec.errors import InvalidRequestError, TenantLimitError
from hybridspec.server import ServerConfig
from hybridspec.server.errors import exception_response
from hybridspec.server.tenants import KeyRing, cache_scope, read_key_file
from tests.server.conftest import TINY_MODEL_NAME, AppFactory
from tests.server.helpers import metric, parse_metrics

KEYS = (("alice", "sk-alice-1"), ("bob", "sk-bob-1"), ("alice", "sk-alice-2"))
PROMPT = [5, 9, 14, 2, 27, 5, 11, 40, 8, 19, 33, 6, 21, 12, 30, 7]


def key_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    return str(path)


def test_a_key_file_gives_tenant_key_pairs(tmp_path: Path) -> None:
    text = "# team keys\nalice sk-alice-1\n\n  bob   sk-bob-1  \nalice sk-alice-2\n"
    assert read_key_file(key_file(tmp_path, text)) == KEYS


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("alice sk-1\nbob\n", "line 2: expected 'TENANT KEY', got 1 fields"),
        ("alice sk-1\nbob sk-2 extra\n", "line 2: expected 'TENANT KEY', got 3 fields"),
        ("alice sk-1\n# x\nbob sk-1\n", "line 3: a duplicate key (first on line 1)"),
        ("-alice sk-1\n", "line 1: the tenant name '-alice' is not"),
        ("# nobody\n", "no 'TENANT KEY' line"),
    ],
)
def test_a_bad_key_file_is_refused_naming_the_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as refused:
        read_key_file(key_file(tmp_path, text))
    assert "sk-1" not in str(refused.value)  # never the key


def test_an_unreadable_key_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="cannot be read"):
        read_key_file(str(tmp_path / "missing"))


def test_serve_with_a_bad_key_file_stops_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = key_file(tmp_path, "alice sk-1\nbob\n")
    assert main(["serve", "--api-keys", path]) == 2
    assert "line 2" in capsys.readouterr().err


def test_the_key_ring_names_each_keys_tenant() -> None:
    ring = KeyRing([*KEYS, (None, "sk-anon")])
    assert ring.tenant_of(b"sk-alice-2") == (True, "alice")
    assert ring.tenant_of(b"sk-anon") == (True, None)
    assert ring.tenant_of(b"sk-alice") == (False, None)


def test_scopes_keep_tenants_and_salts_apart() -> None:
    assert cache_scope("shared", "alice", None) is None
    assert cache_scope("shared", "alice", "s") == cache_scope("shared", "bob", "s")
    assert cache_scope("per-tenant", "alice", None) != cache_scope("per-tenant", "bob", None)
    assert cache_scope("per-tenant", "alice", "s") != cache_scope("per-tenant", "alice", None)


def test_a_tenant_limit_is_a_429_with_retry_after() -> None:
    response = exception_response(TenantLimitError("too many"), retry_after_s=3)
    assert response.status_code == 429 and response.headers["Retry-After"] == "3"
    assert b'"rate_limit_exceeded"' in response.body


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(client: TestClient, key: str, **options: Any) -> dict[str, Any]:
    body = {
        "model": TINY_MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "proposer": "suffix",
        **options,
    }
    response = client.post("/v1/completions", json=body, headers=auth(key))
    assert response.status_code == 200, response.text
    return response.json()


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def accepted(answer: dict[str, Any]) -> int:
    """Drafts accepted: a request drafting another's answer from a pool has most of its 24
    tokens drafted and kept (19 here); one drafting from its own text, as a cold request, few
    (2). How many it is *offered* varies with what the proposer learned of its sources'
    confidence from earlier requests, so it is not compared."""
    return int(answer["hybridspec"]["draft_tokens_accepted"])


def from_a_pool(answer: dict[str, Any]) -> bool:
    return accepted(answer) >= 3 * answer["usage"]["completion_tokens"] // 4


def tenants_app(make_app: AppFactory, **server: Any) -> Any:
    options = {"tenant_keys": KEYS, "api_key": "sk-anon", **server}
    return make_app(options, prefix_cache_mb=8)


def test_per_tenant_isolation_serves_no_tenant_from_anothers_text(make_app: AppFactory) -> None:
    """Bob repeating Alice's prompt gets no prefix-cache hit and drafts as a cold request does
    (Alice's first: nothing in her pool yet); Alice's own repeat hits; texts are the same."""
    with TestClient(tenants_app(make_app)) as client:
        first = complete(client, "sk-alice-1")
        assert not from_a_pool(first)
        bob = complete(client, "sk-bob-1")
        assert cached(bob) == 0 and accepted(bob) == accepted(first)
        salted = complete(client, "sk-alice-2", cache_salt="private")
        assert cached(salted) == 0 and accepted(salted) == accepted(first)
        again = complete(client, "sk-alice-2")  # her other key: the same tenant
        assert cached(again) == len(PROMPT) - 1 and from_a_pool(again)
        texts = {a["choices"][0]["text"] for a in (first, bob, salted, again)}
        assert len(texts) == 1


def test_shared_isolation_serves_every_tenant_from_all_text(make_app: AppFactory) -> None:
    with TestClient(tenants_app(make_app, cache_isolation="shared")) as client:
        first = complete(client, "sk-alice-1")
        bob = complete(client, "sk-bob-1")
        assert cached(bob) == len(PROMPT) - 1 and from_a_pool(bob)
        assert bob["choices"][0]["text"] == first["choices"][0]["text"]
        salted = complete(client, "sk-bob-1", cache_salt="mine")  # the salt scopes still
        assert cached(salted) == 0 and accepted(salted) == accepted(first)


def test_isolation_off_reads_and_leaves_nothing(make_app: AppFactory) -> None:
    with TestClient(tenants_app(make_app, cache_isolation="off")) as client:
        first = complete(client, "sk-alice-1")
        again = complete(client, "sk-alice-1")
        assert cached(again) == 0 and accepted(again) == accepted(first)


def test_unknown_keys_get_401_and_tenants_are_counted(make_app: AppFactory) -> None:
    with TestClient(tenants_app(make_app)) as client:
        body = {"model": TINY_MODEL_NAME, "prompt": "hi", "max_tokens": 2}
        wrong = client.post("/v1/completions", json=body, headers=auth("sk-carol"))
        assert wrong.status_code == 401
        assert wrong.json()["error"]["code"] == "invalid_api_key"
        assert client.post("/v1/completions", json=body).status_code == 401
        for key in ("sk-alice-1", "sk-alice-2", "sk-bob-1", "sk-anon"):
            assert client.post("/v1/completions", json=body, headers=auth(key)).status_code == 200
        assert client.get("/v1/models", headers=auth("sk-bob-1")).status_code == 200
        text = client.get("/metrics", headers=auth("sk-bob-1")).text
        samples = parse_metrics(text)
        requests = "hybridspec_tenant_http_requests_total"
        assert metric(samples, requests, tenant="alice", status="200") == 2
        assert metric(samples, requests, tenant="bob", status="200") == 2
        assert metric(samples, requests, tenant="", status="200") == 1
        assert "sk-" not in text  # never a key
        tokens = metric(samples, "hybridspec_tenant_generated_tokens_total", tenant="alice")
        assert 0 < tokens <= 4


def test_tenants_add_a_reserved_slot() -> None:
    """The engine gets one slot more than asked for (4 here), reserved for a tenant with
    nothing running."""
    config = ServerConfig(tenant_keys=KEYS)
    engine = config.engine_config()
    assert engine.target.max_num_seqs == config.engine.target.max_num_seqs + 1
    assert engine.tenants.reserved_slots == 1
    assert engine.suffix.isolation == "per-session"
    assert ServerConfig().engine_config() == ServerConfig().engine
    with pytest.raises(ValueError, match="tenant_keys"):
        ServerConfig(tenant_keys=(("a", "k"), ("b", "k")))
    with pytest.raises(ValueError, match="cache_isolation"):
        ServerConfig(cache_isolation="everyone")
