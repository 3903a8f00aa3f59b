"""``stream_options.include_drafts``: each streamed chunk's tokens and their origin."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from tests.server.helpers import chunk_text, sse_chunks

CHAT = {
    "messages": [{"role": "user", "content": "one two three one two three one two"}],
    "max_tokens": 40,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


def _stream(client: TestClient, **fields: Any) -> list[dict[str, Any]]:
    response = client.post("/v1/chat/completions", json={**CHAT, **fields})
    assert response.status_code == 200, response.text
    return sse_chunks(response.text)


def _tokens(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for c in chunks for choice in c["choices"] for t in choice.get("tokens", ())]


def test_drafts_absent_unless_asked(client: TestClient) -> None:
    chunks = _stream(client, proposer="ngram")
    assert not _tokens(chunks)
    assert all("tokens" not in choice for c in chunks for choice in c["choices"])


def test_tokens_carry_their_origin_and_the_text(client: TestClient) -> None:
    plain = _stream(client, proposer="none")
    chunks = _stream(client, proposer="ngram", stream_options={"include_drafts": True})
    tokens = _tokens(chunks)
    assert len(tokens) == 40
    assert chunk_text(chunks) == chunk_text(plain)  # greedy: the same text, drafts or not
    assert "".join(t["text"] for t in tokens) == chunk_text(chunks)
    drafted = [t for t in tokens if t["drafted_by"] is not None]
    assert {t["drafted_by"] for t in drafted} == {"ngram"}
    final = chunks[-1]["hybridspec"]
    assert len(drafted) == final["draft_tokens_accepted"] > 0


def test_plain_decoding_marks_every_token_the_targets(client: TestClient) -> None:
    chunks = _stream(client, proposer="none", stream_options={"include_drafts": True})
    tokens = _tokens(chunks)
    assert len(tokens) == 40 and all(t["drafted_by"] is None for t in tokens)


def test_completions_stream_drafts_too(client: TestClient) -> None:
    body = {
        "prompt": "a b c a b c a b",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "proposer": "ngram",
        "stream_options": {"include_drafts": True},
    }
    response = client.post("/v1/completions", json=body)
    chunks = sse_chunks(response.text)
    assert len(_tokens(chunks)) == 12


def test_openapi_documents_the_extension(client: TestClient) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert "include_drafts" in schemas["StreamOptions"]["properties"]
    assert "tokens" in schemas["ChatChunkChoice"]["properties"]
    assert "drafted_by" in schemas["DraftToken"]["properties"]
