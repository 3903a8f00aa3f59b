"""The OpenAPI document is the API: schemathesis, with every check, finds no failure.

Schemathesis (its command line, as a user runs it) generates requests from ``/openapi.json``,
schema-valid and schema-invalid, for every operation and checks each answer: no 5xx, only
documented status codes and content types, bodies (and each server-sent event) matching their
schemas, valid data accepted, invalid data rejected, undeclared methods answered 405. A fixed
seed and a bounded number of examples keep the run reproducible and short. One check is
narrowed (``schemathesis_hooks.py``): a prompt longer than the context, which no schema can
state, may be refused (with code ``context_length_exceeded``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.server.conftest import AppFactory, serve_in_thread
from tests.server.helpers import parse_metrics

SEED = 20261125
MAX_EXAMPLES = 40
# With a key the run checks that every operation refuses requests without it or with a wrong
# one (schemathesis' ignored_auth probes an operation at its first 2xx). Its coverage phase is
# left out: those cases are the key-free run's, sent with the key, which the app checks before
# it reads the request; and fuzzed examples beyond a few test the key-free run's ground again.
MAX_EXAMPLES_WITH_KEY = 10
PHASES_WITH_KEY = "examples,fuzzing,stateful"


def schemathesis_command() -> str:
    found = shutil.which("st", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    return found


HOOKS = Path(__file__).with_name("schemathesis_hooks.py")
NARROWED = "positive_data_acceptance"  # replaced by the hook's positive_data_acceptance_but_context


def run_schemathesis(
    url: str, workdir: Path, max_examples: int, *options: str
) -> subprocess.CompletedProcess[str]:
    """All of schemathesis' checks, ``positive_data_acceptance`` narrowed (module docstring)."""
    return subprocess.run(
        [
            schemathesis_command(),
            "run",
            f"{url}/openapi.json",
            "--checks",
            "all",
            "--exclude-checks",
            NARROWED,
            "--seed",
            str(SEED),
            "--max-examples",
            str(max_examples),
            "--no-color",
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)},
        cwd=workdir,  # schemathesis keeps a crash cache in the working directory
    )


@pytest.mark.parametrize("api_key", [None, "sk-test-key"])
def test_schemathesis_finds_no_failure(
    make_app: AppFactory, api_key: str | None, tmp_path: Path
) -> None:
    """With a key, schemathesis sends it and also checks that requests without it (or with a
    wrong one) are refused on every operation that the document says needs it; the app's
    metrics show that it probed each so."""
    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    options = [] if api_key is None else ["--header", f"Authorization: Bearer {api_key}"]
    options += [] if api_key is None else ["--phases", PHASES_WITH_KEY]
    examples = MAX_EXAMPLES if api_key is None else MAX_EXAMPLES_WITH_KEY
    with serve_in_thread(make_app({"api_key": api_key})) as url:
        result = run_schemathesis(url, tmp_path, examples, *options)
        document = httpx.get(f"{url}/openapi.json", headers=headers).json()
        samples = parse_metrics(httpx.get(f"{url}/metrics", headers=headers).text)
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    assert "Selected: 9/9" in result.stdout, report  # every operation of the API was tested
    if api_key is not None:
        refused: dict[tuple[str, str], float] = {}
        for (name, pairs), value in samples.items():
            labels = dict(pairs)
            if name == "hybridspec_http_requests_total" and labels["status"] == "401":
                # a route template names its converters: /v1/models/{model:path}
                refused[labels["method"], re.sub(r":\w+}", "}", labels["path"])] = value
        keyed = [(m.upper(), p) for p, ops in document["paths"].items() for m in ops]
        keyed.remove(("GET", "/health"))
        assert len(keyed) == 8 and refused.keys() == set(keyed), refused
        assert min(refused.values()) >= 2, refused  # without the key, and with a wrong one


def test_with_a_key_every_operation_but_health_declares_it(make_app: AppFactory) -> None:
    with TestClient(make_app({"api_key": "k"})) as client:
        document = client.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, methods in document["paths"].items():
        for operation in methods.values():
            declared = operation.get("security") == [{"bearer": []}]
            assert declared == (path != "/health"), path
            assert ("401" in operation["responses"]) == (path != "/health"), path


def schema(client: TestClient) -> dict[str, Any]:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


def test_document_states_every_status_and_content_type(client: TestClient) -> None:
    document = schema(client)
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(chat) == {"200", "400", "404", "408", "413", "429", "500", "503"}  # never 422
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        answers = document["paths"][path]["post"]["responses"]
        for code in ("408", "429", "503"):  # read timeout; a tenant's bound; overload, shutdown
            assert answers[code]["content"]["application/json"]["schema"] == error, (path, code)
        assert "grammars are compiling" in answers["503"]["description"]
        assert "shutting down" in answers["503"]["description"]
    for path in ("/tokenize", "/detokenize"):
        assert {"408", "413"} <= set(document["paths"][path]["post"]["responses"])
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert set(metrics) == {"text/plain"}
    components = document["components"]["schemas"]
    assert "HTTPValidationError" not in components
    role = components["ChatMessage"]["properties"]["role"]
    assert set(role["enum"]) == {"system", "developer", "user", "assistant", "tool"}


def test_document_names_the_served_proposers_and_vocabulary(client: TestClient) -> None:
    components = schema(client)["components"]["schemas"]
    proposer = components["CompletionRequest"]["properties"]["proposer"]["anyOf"][0]
    models = client.get("/v1/models").json()["data"][0]["hybridspec"]["proposers"]
    assert proposer["enum"] == sorted(p["name"] for p in models)
    prompt = components["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert {"type": "integer", "minimum": 0, "maximum": 259} in [
        choice["items"] for choice in prompt if choice["type"] == "array"
    ]


def test_everything_the_document_advertises_is_accepted(client: TestClient) -> None:
    """Fields that the document lists with their bounds' edge values are served, not 400."""
    body = {
        "prompt": "hello",
        "max_tokens": 10_000,  # more than the context: a bound, not an error
        "temperature": 0,
        "top_p": 1,
        "top_k": 1,
        "stop": ["x"],
        "seed": 2**53 - 1,
        "n": 4,  # the test engine's slots
        "presence_penalty": -2,
        "frequency_penalty": 2,
        "logit_bias": {"0": -100, "259": 100},
        "repetition_penalty": 0.01,
        "min_p": 1,
        "min_tokens": 0,
        "user": "u",
        "best_of": 1,
        "ignore_eos": True,
        "stop_token_ids": [0, 259],
    }
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
    chat = {
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "response_format": {"type": "text"},
        "max_completion_tokens": 4,
    }
    response = client.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200, response.text


def test_generation_ends_when_the_context_is_full(client: TestClient) -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": 100_000, "ignore_eos": True, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["total_tokens"] == 256  # the tiny model's context
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_health_and_metrics_are_documented_as_served(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert httpx.Headers(client.get("/metrics").headers)["content-type"].startswith("text/plain")


def test_documented_fields_that_change_nothing_are_accepted(client: TestClient) -> None:
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "store": False,
        "metadata": {"team": "search"},
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "user": "someone",
    }
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    too_many = {**chat, "metadata": {str(i): "v" for i in range(17)}}
    response = client.post("/v1/chat/completions", json=too_many)
    assert response.status_code == 400 and response.json()["error"]["param"] == "metadata"
