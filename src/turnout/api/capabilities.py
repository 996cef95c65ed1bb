"""`GET /v1/capabilities`: each capability with its variants, the workers serving each, its queue, and what
`gpu: auto` has learned of it. A tenant sees its own queues and the workers that may serve it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter

from turnout.access import Action, Principal
from turnout.api.guards import Guards
from turnout.api.service import Service
from turnout.api.strictjson import StrictJsonRoute
from turnout.models import Worker
from turnout.profiles import Profile, learned_gpu_memory


def router(service: Service, guards: Guards) -> APIRouter:
    api = APIRouter(route_class=StrictJsonRoute)
    ctrl = service.controller

    @api.get("/v1/capabilities")
    async def capabilities(p: Principal = guards.need(Action.READ)) -> dict[str, Any]:
        workers = await guards.visible_workers(p)
        depths = await service.read(ctrl.queue_depths, p.scope)
        learned = await service.read(ctrl.learned_profiles)
        return {"capabilities": capabilities_out(workers, depths, learned)}

    return api


def capabilities_out(
    workers: Sequence[Worker], depths: dict[str, dict[str, int]], learned: Sequence[Profile]
) -> list[dict[str, Any]]:
    """Capabilities by name: those a worker offers and those only queued (no variant yet)."""
    caps: dict[str, dict[str, Any]] = {}
    for w in workers:
        for v in w.variants:
            entry = caps.setdefault(v.capability, {"name": v.capability, "variants": {}})
            var = entry["variants"].setdefault(
                v.device.value,
                {"device": v.device.value, "resources": v.resources.to_dict(), "workers": []},
            )
            var["workers"].append({"id": w.id, "name": w.name, "state": w.state.value})
    for name in depths:
        caps.setdefault(name, {"name": name, "variants": {}})
    out = []
    for name in sorted(caps):
        entry = caps[name]
        d = depths.get(name, {})
        out.append({"name": name, "variants": list(entry["variants"].values()),
                    "queue_depth": d.get("queued", 0), "running": d.get("leased", 0) + d.get("running", 0),
                    **profile_view(name, entry["variants"], learned)})  # fmt: skip
    return out


def profile_view(
    capability: str, variants: dict[str, dict[str, Any]], learned: Sequence[Profile]
) -> dict[str, Any]:
    """A capability's profiles (what `auto` routes on), and for a GPU variant that declares no gpu_memory, the
    one learned from its observed peak with headroom (`gpu_memory_learned`, bytes)."""
    mine = [p for p in learned if p.capability == capability]
    gpu = variants.get("gpu")
    if gpu is not None and not gpu["resources"].get("gpu_memory"):
        gpu["gpu_memory_learned"] = learned_gpu_memory(mine)
    return {"profiles": [p.to_dict() for p in mine]}
