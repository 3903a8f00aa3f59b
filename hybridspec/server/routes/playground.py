"""Routes ``GET /`` and ``GET /playground``: the playground page, shipped as package data.

One self-contained HTML file (``server/static/playground.html``: its script and styles inline,
nothing fetched from elsewhere) that chats with this server through ``/v1/chat/completions``,
streaming with ``stream_options.include_drafts`` to show each token's origin. The page itself
needs no API key (a browser cannot send one when it opens a URL: ``middleware.OPEN_ROUTES``);
the page asks for the key and sends it with every API call, keeping it in memory only.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(include_in_schema=False)

PAGE = "playground.html"


@lru_cache(maxsize=1)
def page() -> str:
    """The page's HTML, read once from the package."""
    return resources.files("hybridspec.server").joinpath("static", PAGE).read_text("utf-8")


@router.get("/", response_class=HTMLResponse)
@router.get("/playground", response_class=HTMLResponse)
async def playground() -> HTMLResponse:
    return HTMLResponse(page(), headers={"Cache-Control": "no-cache"})
