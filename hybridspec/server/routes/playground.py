"""Routes ``GET /`` and ``GET /playground``: the playground page, shipped as package data; and
its icon, ``GET /favicon.svg`` (the page links it) and ``GET /favicon.ico`` (where a browser
looks by default: the same SVG, so that no page load logs a 404).

One self-contained HTML file (``server/static/playground.html``: its script and styles inline,
nothing fetched from elsewhere) that chats with this server through ``/v1/chat/completions``,
streaming with ``stream_options.include_drafts`` to show each token's origin. The page itself
needs no API key (a browser cannot send one when it opens a URL: ``middleware.OPEN_ROUTES``);
the page asks for the key and sends it with every API call, keeping it in memory only. Where
the server wants a key, the page's ``<body>`` says so (``data-key-required``), and the page
waits for the key before its first call, so that opening it logs nothing in the console.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from hybridspec.server.state import State

router = APIRouter(include_in_schema=False)

PAGE = "playground.html"
ICON = "favicon.svg"


@lru_cache(maxsize=1)
def page() -> str:
    """The page's HTML, read once from the package."""
    return resources.files("hybridspec.server").joinpath("static", PAGE).read_text("utf-8")


@lru_cache(maxsize=1)
def icon() -> bytes:
    """The icon's SVG, read once from the package."""
    return resources.files("hybridspec.server").joinpath("static", ICON).read_bytes()


@router.get("/", response_class=HTMLResponse)
@router.get("/playground", response_class=HTMLResponse)
async def playground(state: State) -> HTMLResponse:
    html = page()
    if state.config.api_key is not None or state.config.tenant_keys:
        html = html.replace("<body>", "<body data-key-required>", 1)
    return HTMLResponse(html, headers={"Cache-Control": "no-cache"})


@router.get("/favicon.svg")
@router.get("/favicon.ico")
async def favicon() -> Response:
    return Response(icon(), media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})
