"""The dashboard: `GET /` and `GET /tasks/{id}` (HTML), `GET /v1/dashboard` (its data), `GET /v1/whoami`.

The HTML pages carry no data and need no token: the browser's script asks the JSON API with the token the
user typed, kept in `sessionStorage` and sent as `Authorization: Bearer`, never in a URL. Where auth is on
and no token (or a bad one) is held, the API answers 401 and the page asks for one; a read token is enough.
"""

from __future__ import annotations

import time
from dataclasses import replace
from importlib.resources import files
from typing import Any

import jinja2
from fastapi import APIRouter
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from turnout import __version__
from turnout.access import Action, Principal
from turnout.api.guards import Guards
from turnout.api.schemas import iso, task_out
from turnout.api.service import Service
from turnout.dashboard.view import Totals, queue_views, totals, worker_views
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


def static_files() -> StaticFiles:
    """The page's script and style, mounted at /static."""
    return StaticFiles(directory=str(files("turnout.dashboard") / "static"))


def router(service: Service, guards: Guards) -> APIRouter:
    """The pages and their data; a tenant sees its own tasks and queues, and the workers that may serve it."""
    api = APIRouter()
    need = guards.need
    ctrl = service.controller
    totals_cache: dict[str | None, tuple[float, Totals]] = {}

    async def totals_of(tenant: str | None) -> Totals:
        hit = totals_cache.get(tenant)
        if hit is None or time.monotonic() - hit[0] > TOTALS_CACHE_S:
            hit = totals_cache[tenant] = (
                time.monotonic(),
                totals(await service.read(ctrl.task_stats, None, tenant=tenant)),
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
    async def snapshot(p: Principal = need(Action.READ)) -> dict[str, Any]:
        """Everything the overview shows, in one read: workers and GPUs, queues, recent tasks, totals.

        A tenant's view holds its own queues and tasks, and the workers that may serve it (its own and the
        shared pool's); other tenants' holds on those workers' GPUs show as `other tenants`, without ids."""
        tenant = p.scope
        workers = await guards.visible_workers(p)
        active = await service.read(ctrl.active_tasks)
        mine = await service.read(ctrl.task_stats, NON_TERMINAL, tenant=tenant)  # None: every tenant's
        recent = await service.read(ctrl.list_tasks, tenant, limit=RECENT_TASKS)
        sums = await totals_of(tenant)
        live = totals(mine)  # queued and running from this read, not from the cached scan
        sums = replace(sums, queued=live.queued, running=live.running)
        now = ctrl.clock()
        return {
            "time": iso(now),
            "viewer": {"role": p.role.value, "tenant": p.tenant, "all_tenants": tenant is None},
            "workers": [w.to_dict() for w in worker_views(workers, active, viewer_tenant=tenant, now=now)],
            "queues": [vars(q) for q in queue_views(mine)],
            "tasks": [task_out(t) for t in recent],
            "totals": vars(sums),
        }

    @api.get("/v1/whoami")
    async def whoami(p: Principal = need(Action.ANY)) -> dict[str, Any]:
        """The token's role and tenant (`"*"`: every tenant), and the controller's clock: what `turnout doctor`
        and the page check. Any valid token may ask, a worker's included."""
        return {"role": p.role.value, "tenant": p.tenant, "token_id": p.token_id if service.auth else None,
                "auth": service.auth, "time": iso(time.time())}  # fmt: skip

    return api
