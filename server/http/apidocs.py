"""``/docs``: Swagger UI over ``/openapi.json``, from files this server serves itself.

Its JavaScript and CSS come from the ``swagger-ui-bundle-v2`` package (Swagger UI 5, the
first to render OpenAPI 3.1), never from a CDN: operators and volunteers are often offline.
The page has no inline script (the initializer is ``/docs/init.js``), so it is served with
the dashboard's strict Content-Security-Policy: our own scripts, styles and fetches only
(Swagger UI's icons are ``data:`` images, which it allows). ``validatorUrl: null`` keeps
Swagger UI from asking validator.swagger.io for a badge. ReDoc is off: FastAPI's loads it
from a CDN.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, HTMLResponse, Response
from swagger_ui_bundle import swagger_ui_path

from server.http.errors import NotFound
from server.web.router import CSP

STATIC = "/docs/static"
ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png")  # all the page needs
PAGE = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>DiLoCo Hub API</title>
<link rel="icon" type="image/png" href="{STATIC}/favicon-32x32.png">
<link rel="stylesheet" href="{STATIC}/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{STATIC}/swagger-ui-bundle.js"></script>
<script src="/docs/init.js"></script>
</body>
</html>
"""

INIT = """window.ui = SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  deepLinking: true,
  validatorUrl: null,
  presets: [SwaggerUIBundle.presets.apis],
  layout: "BaseLayout",
});
"""


def install(app: FastAPI) -> None:
    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return HTMLResponse(PAGE, headers={"Content-Security-Policy": CSP})

    @app.get("/docs/init.js", include_in_schema=False)
    async def init() -> Response:
        return Response(INIT, media_type="text/javascript")

    @app.get(STATIC + "/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise NotFound(f"no such file: {STATIC}/{name}")
        return FileResponse(Path(swagger_ui_path) / name)
