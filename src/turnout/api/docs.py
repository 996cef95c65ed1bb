"""The API's own description, behind a token (it lists every route, the worker protocol's included):
`GET /openapi.json` and `GET /docs` (Swagger UI with the document inlined, since the page's own fetch of
/openapi.json would carry no token). Neither is in the document itself."""

from __future__ import annotations

import json

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from turnout.access import Action, Principal
from turnout.api.guards import Guards
from turnout.api.strictjson import StrictJsonRoute

_SWAGGER_PAGE = """<!doctype html>
<html><head><title>Turnout API</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({spec: SPEC, dom_id: "#swagger-ui"});</script>
</body></html>
"""


def router(app: FastAPI, guards: Guards) -> APIRouter:
    """Routes that describe `app`, the application they are included in."""
    api = APIRouter(route_class=StrictJsonRoute)

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi_doc(p: Principal = guards.need(Action.ANY)) -> JSONResponse:
        return JSONResponse(app.openapi())

    @api.get("/docs", include_in_schema=False)
    async def docs(p: Principal = guards.need(Action.ANY)) -> HTMLResponse:
        spec = json.dumps(app.openapi()).replace("</", "<\\/")
        return HTMLResponse(_SWAGGER_PAGE.replace("SPEC", spec))

    return api
