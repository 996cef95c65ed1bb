"""The dashboard's data (`GET /v1/dashboard`) against a real controller and workers (`GET /v1/whoami` and
who may read the dashboard: tests/inprocess/test_dashboard_api.py)."""

from __future__ import annotations

import time

import httpx

from tests.conftest import Cluster

GIB = 1024**3


def get(cluster: Cluster, path: str, token: str) -> httpx.Response:
    return httpx.get(f"{cluster.url}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=30)


def token(cluster: Cluster, role: str, tenant: str = "default") -> str:
    resp = cluster.api("POST", "/v1/tokens", json={"role": role, "tenant": tenant})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["token"])


def test_a_tenant_sees_its_own_gpu_holds_and_other_tenants_only_as_other_tenants(cluster: Cluster) -> None:
    cluster.start_worker(
        "tests.apps.testapp:app", gpus="fake:1xA100-40Gi-mig:3g.20gb,2g.10gb", name="gpu-box"
    )
    acme_submit, acme_read = token(cluster, "submit", "acme"), token(cluster, "read", "acme")
    theirs = cluster.submit(
        "share", {"sleep": 30}, gpu="require"
    )  # the default tenant's task, on a MIG device
    mine = httpx.post(f"{cluster.url}/v1/tasks", headers={"Authorization": f"Bearer {acme_submit}"}, timeout=30,
                      json={"capability": "share", "input": {"sleep": 30}, "gpu": "require"}).json()  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = {cluster.api("GET", f"/v1/tasks/{t['id']}").json()["state"] for t in (theirs, mine)}
        if states == {"running"}:
            break
        time.sleep(0.1)
    try:
        snap = get(cluster, "/v1/dashboard", acme_read).json()
        assert snap["viewer"] == {"role": "read", "tenant": "acme", "all_tenants": False}
        (gpu,) = snap["workers"][0]["gpus"]
        assert gpu["allocations"] == []  # a GPU in MIG mode is never held whole: its MIG devices are
        holds = [a for m in gpu["mig_devices"] for a in m["allocations"]]
        assert sorted((a["tenant"], a["task_id"]) for a in holds) == sorted(
            [("acme", mine["id"]), ("other tenants", None)]
        )
        # a share on a GPU in MIG mode takes one MIG device whole: 20 GiB and 10 GiB here
        assert gpu["allocated_bytes"] == sum(a["memory_bytes"] for a in holds) == 30 * GIB
        assert [t["id"] for t in snap["tasks"]] == [mine["id"]]  # recent tasks: its own only
        admin = get(cluster, "/v1/dashboard", cluster.token).json()
        seen = {
            a["task_id"]
            for w in admin["workers"]
            for g in w["gpus"]
            for m in g["mig_devices"]
            for a in m["allocations"]
        }
        assert seen == {theirs["id"], mine["id"]}
        queues = {(q["capability"], q["device_class"]): q for q in admin["queues"]}
        assert queues[("share", "gpu")]["running"] == 2
    finally:
        for t in (theirs, mine):
            cluster.api("POST", f"/v1/tasks/{t['id']}/cancel")
