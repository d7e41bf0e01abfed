"""The web chat page: `GET /` and its files under `/static/` (plain HTML, CSS and JS modules; the two libraries it
uses are vendored in static/vendor, so it needs no build step and no network)."""

from __future__ import annotations

from pathlib import Path

from sanic import Request, Sanic
from sanic.response import HTTPResponse, file

STATIC = Path(__file__).parent / "static"


def add_routes(app: Sanic) -> None:
    """Serves the page on `app`; it holds no secret, so a server with --api-key serves it too (the page asks for
    the key and sends it with its API calls)."""
    app.static("/static", STATIC, name="webui_static")

    @app.get("/")
    async def page(request: Request) -> HTTPResponse:
        # no-cache: a browser revalidates, so an upgraded server's page is the one shown
        return await file(STATIC / "index.html", mime_type="text/html; charset=utf-8",
                          headers={"Cache-Control": "no-cache"})
