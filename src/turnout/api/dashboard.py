"""The dashboard: `GET /` and `GET /tasks/{id}` (HTML), `GET /v1/dashboard` (its data), `GET /v1/whoami`.

The HTML pages carry no data and need no token: the browser's script asks the JSON API with the token the
user typed, kept in `sessionStorage` and sent as `Authorization: Bearer`, never in a URL. Where auth is on
and no token (or a bad one) is held, the API answers 401 and the page asks for one; a read token is enough.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from importlib.resources import files
from typing import Any

import jinja2
from fastapi import APIRouter, FastAPI, Header
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from turnout import __version__
from turnout.api.schemas import iso, task_out
from turnout.api.service import Service
from turnout.auth import Principal
from turnout.dashboard.view import Totals, queue_views, totals, worker_views
from turnout.errors import Forbidden
from turnout.models import ACTIVE_STATES, TaskState

RECENT_TASKS = 25
TOTALS_CACHE_S = 5.0  # totals scan the whole task table: once per few seconds, however many pages are open
NON_TERMINAL = (TaskState.QUEUED, *ACTIVE_STATES)
# no inline script or style, nothing from elsewhere: a task's input rendered on the page cannot run
HTML_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}

_templates = jinja2.Environment(
    loader=jinja2.PackageLoader("turnout.dashboard", "templates"),
    autoescape=jinja2.select_autoescape(["html"]),
    undefined=jinja2.StrictUndefined,
)


def install(
    app: FastAPI, service: Service, need: Callable[[str], Any], scope: Callable[[Principal], str | None]
) -> None:
    """Add the dashboard's pages, static files and data routes to `app`; `need` and `scope` are the app's auth."""
    app.include_router(router(service, need, scope))
    app.mount("/static", StaticFiles(directory=str(files("turnout.dashboard") / "static")), name="static")


def router(
    service: Service, need: Callable[[str], Any], scope: Callable[[Principal], str | None]
) -> APIRouter:
    api = APIRouter()
    ctrl = service.controller
    totals_cache: dict[str | None, tuple[float, Totals]] = {}

    async def totals_of(tenant: str | None) -> Totals:
        hit = totals_cache.get(tenant)
        if hit is None or time.monotonic() - hit[0] > TOTALS_CACHE_S:
            hit = totals_cache[tenant] = (
                time.monotonic(),
                totals(await service.read(ctrl.store.task_stats, None, tenant=tenant)),
            )
        return hit[1]

    def page(template: str, **context: Any) -> HTMLResponse:
        html = _templates.get_template(template).render(version=__version__, auth=service.auth, **context)
        return HTMLResponse(html, headers=HTML_HEADERS)

    @api.get("/", include_in_schema=False)
    async def overview() -> HTMLResponse:
        return page("overview.html")

    @api.get("/tasks/{task_id}", include_in_schema=False)
    async def task_page(task_id: str) -> HTMLResponse:
        return page("task.html", task_id=task_id)

    @api.get("/v1/dashboard")
    async def snapshot(p: Principal = need("read")) -> dict[str, Any]:
        """Everything the overview shows, in one read: workers and GPUs, queues, recent tasks, totals."""
        tenant = scope(p)
        workers = await service.read(ctrl.workers)
        active = await service.read(ctrl.store.active_tasks)
        queued = await service.read(ctrl.store.task_stats, NON_TERMINAL)
        recent = await service.read(ctrl.list_tasks, tenant, limit=RECENT_TASKS)
        sums = await totals_of(tenant)
        mine = (
            queued
            if tenant is None
            else await service.read(ctrl.store.task_stats, NON_TERMINAL, tenant=tenant)
        )
        live = totals(mine)  # queued and running from this read, not from the cached scan
        sums = replace(sums, queued=live.queued, running=live.running)
        now = ctrl.clock()
        return {
            "time": iso(now),
            "viewer": {"role": p.role.value, "tenant": p.tenant, "all_tenants": tenant is None},
            "workers": [w.to_dict() for w in worker_views(workers, active, viewer_tenant=tenant, now=now)],
            "queues": [vars(q) for q in queue_views(queued)],
            "tasks": [task_out(t) for t in recent],
            "totals": vars(sums),
        }

    @api.get("/v1/whoami")
    async def whoami(authorization: str | None = Header(None)) -> dict[str, Any]:
        """The token's role and tenant, and the controller's clock: what `turnout doctor` and the page check."""
        now = time.time()
        if not service.auth:
            return {"role": "admin", "tenant": "default", "token_id": None, "auth": False, "time": iso(now)}
        principal = None
        for kind in ("read", "worker"):  # every role may do one of these
            try:
                principal = await service.read(service.tokens.verify, authorization, kind)
                break
            except Forbidden:
                continue
        if principal is None:  # pragma: no cover - every role is allowed "read" or "worker"
            raise Forbidden("this token has no role")
        return {"role": principal.role.value, "tenant": principal.tenant, "token_id": principal.token_id,
                "auth": True, "time": iso(now)}  # fmt: skip

    return api
