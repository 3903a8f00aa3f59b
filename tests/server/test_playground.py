"""The playground page in headless Chromium (Playwright driving the system's ``chromium``; no
browser is downloaded), served on a loopback socket: a message's tokens are colored by origin,
a greedy race of ``ngram`` and ``none`` shows identical texts and both timings, and no request
leaves the machine. The server holds the shared tiny random Llama (seconds on any machine);
with ``HYBRIDSPEC_PLAYGROUND_EMBEDDED=1`` the embedded model (docs/playground.png is made so,
with ``HYBRIDSPEC_PLAYGROUND_SCREENSHOT=docs/playground.png``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from hybridspec.config import EngineConfig, ModelConfig
from hybridspec.engine import Engine
from hybridspec.model.loader import LoadedModel
from hybridspec.server import ServerConfig, create_app
from tests.server.conftest import AppFactory, serve_in_thread

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT_ENV = "HYBRIDSPEC_PLAYGROUND_SCREENSHOT"  # also write the screenshot there
EMBEDDED_ENV = "HYBRIDSPEC_PLAYGROUND_EMBEDDED"  # serve the embedded model
PROMPT = (
    "Repeat this sentence five times, one per line: the quick brown fox jumps over the lazy dog."
)
TIMEOUT_MS = 120_000


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found is not None:
            return found
    pytest.skip("no chromium on PATH (apt-get install chromium); the browser test needs one")


@pytest.fixture
def browser_page() -> Iterator[Any]:
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
    )
    executable = chromium_path()
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        try:
            yield browser.new_page(viewport={"width": 1200, "height": 820})
        finally:
            browser.close()


def test_page_is_served_without_a_key(make_app: AppFactory) -> None:
    with TestClient(make_app({"api_key": "k"})) as client:
        for path in ("/", "/playground"):
            response = client.get(path)
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/html")
            assert "include_drafts" in response.text
            assert "http://" not in response.text and "https://" not in response.text
        assert client.get("/v1/models").status_code == 401


@pytest.fixture
def served_app(make_app: AppFactory, request: pytest.FixtureRequest) -> FastAPI:
    if not os.environ.get(EMBEDDED_ENV):
        return make_app({"api_key": "sk-page"})
    embedded: LoadedModel = request.getfixturevalue("embedded_float32")
    engine = EngineConfig(target=ModelConfig(dtype="float32", max_seq_len=512, max_num_seqs=4))
    config = ServerConfig(engine=engine, api_key="sk-page")
    return create_app(config, engine_factory=lambda cfg: Engine(cfg, target=embedded))


def console_of(page: Any) -> list[str]:
    """What the page logs to the console, page errors and failed loads included (a 404 or 401
    of any resource is logged as an error)."""
    messages: list[str] = []
    page.on("console", lambda message: messages.append(f"{message.type}: {message.text}"))
    page.on("pageerror", lambda error: messages.append(f"pageerror: {error}"))
    return messages


@pytest.mark.parametrize("key", [None, "sk-page"])
def test_the_page_opens_with_no_console_message(
    make_app: AppFactory, browser_page: Any, key: str | None
) -> None:
    """Opened, then given its key, the page logs nothing: its icon is served, and it asks a
    server wanting a key for nothing before it has one."""
    page = browser_page
    messages = console_of(page)
    with serve_in_thread(make_app({"api_key": key}), timeout_s=120) as url:
        page.goto(url + "/")
        page.wait_for_load_state("networkidle")
        if key is not None:
            page.fill("#key", key)
            page.dispatch_event("#key", "change")
        page.wait_for_selector("#proposer option[value=ngram]", state="attached")
        icon = page.evaluate("fetch('/favicon.ico').then((r) => r.status)")
    assert messages == []
    assert icon == 200


def test_the_icon_is_served_without_a_key(make_app: AppFactory) -> None:
    with TestClient(make_app({"api_key": "k"})) as client:
        for path in ("/favicon.ico", "/favicon.svg"):
            for response in (client.get(path), client.head(path)):
                assert response.status_code == 200
                assert response.headers["content-type"] == "image/svg+xml"
        assert client.get("/favicon.svg").content.startswith(b"<svg")
        assert b"data-key-required" in client.get("/").content


def test_race_in_chromium(served_app: FastAPI, browser_page: Any, tmp_path: Path) -> None:
    page, app = browser_page, served_app
    messages = console_of(page)
    with serve_in_thread(app, timeout_s=120) as url:
        local = urlsplit(url).netloc
        elsewhere: list[str] = []

        def route(request_route: Any) -> None:
            request = request_route.request
            if urlsplit(request.url).netloc == local:
                request_route.continue_()
            else:
                elsewhere.append(request.url)
                request_route.abort()

        page.route("**/*", route)
        page.goto(url + "/")
        page.fill("#key", "sk-page")
        page.dispatch_event("#key", "change")
        page.wait_for_selector("#proposer option[value=ngram]", state="attached")
        page.select_option("#proposer", "ngram")
        page.check("#race")
        page.select_option("#proposer2", "none")
        page.fill("#max_tokens", "48")
        page.fill("#prompt", PROMPT)
        page.click("#send")
        verdict = page.wait_for_selector(".verdict", timeout=TIMEOUT_MS)
        text = verdict.inner_text()
        boxes = page.query_selector_all(".answer")
        texts = [box.query_selector(".text").inner_text() for box in boxes]
        drafted = page.query_selector_all(".answer[data-proposer=ngram] .tok.draft")
        plain = page.query_selector_all(".answer[data-proposer=none] .tok.draft")
        page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
        if os.environ.get(SCREENSHOT_ENV):
            page.set_viewport_size({"width": 1200, "height": 560})
            page.screenshot(path=os.environ[SCREENSHOT_ENV])
    assert text.startswith("identical texts"), text
    assert "ngram" in text and "none" in text and text.count(" s") >= 2, text
    assert len(texts) == 2 and texts[0] == texts[1] and texts[0].strip()
    assert drafted, "no token of the ngram answer is marked as drafted"
    assert all(span.get_attribute("data-p") == "ngram" for span in drafted)
    assert not plain, "plain decoding has no drafts"
    assert elsewhere == [], elsewhere
    assert messages == [], messages
    assert (tmp_path / "playground.png").stat().st_size > 0
