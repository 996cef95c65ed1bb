"""Tenants on shared GPUs end to end: one tenant at a time on a shared GPU, and a scrub between tenants.

Real controller and worker processes with fake GPUs; two tenants submit with their own tokens.
"""

from __future__ import annotations

import shlex
import sys
import time
from datetime import datetime
from typing import Any

import httpx
import pytest

from tests.conftest import Cluster, pid_alive

APP = "tests.apps.testapp:app"


class Tenant:
    """A tenant's submit token, used as a user of that tenant would."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        resp = cluster.api("POST", "/v1/tokens", json={"role": "submit", "tenant": name})
        assert resp.status_code == 201, resp.text
        self.cluster, self.headers = cluster, {"Authorization": f"Bearer {resp.json()['token']}"}

    def submit(self, capability: str, data: Any, **options: Any) -> str:
        resp = httpx.post(f"{self.cluster.url}/v1/tasks", headers=self.headers, timeout=30,
                          json={"capability": capability, "input": data, "gpu": "require", **options})  # fmt: skip
        assert resp.status_code == 201, resp.text
        return str(resp.json()["id"])

    def result(self, task_id: str, wait_s: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + wait_s
        while True:
            task = httpx.get(f"{self.cluster.url}/v1/tasks/{task_id}/result", params={"wait": 10},
                             headers=self.headers, timeout=30).json()  # fmt: skip
            if task["state"] in ("succeeded", "failed", "cancelled") or time.monotonic() > deadline:
                return task


def ts(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def audit(cluster: Cluster, kind: str) -> list[dict[str, Any]]:
    return [r for r in cluster.api("GET", "/v1/audit").json()["audit"] if r["kind"] == kind]


def test_a_shared_gpu_serves_one_tenant_at_a_time_and_is_scrubbed_between_tenants(cluster: Cluster) -> None:
    log = cluster.tmp / "scrubs.log"
    scrub = shlex.join([sys.executable, "-c",
                        f"import os; open({str(log)!r}, 'a').write(os.environ['CUDA_VISIBLE_DEVICES'] + '\\n')"])  # fmt: skip
    cluster.start_worker(APP, gpus="fake:1x24Gi", name="shared", extra=["--scrub-command", scrub])
    acme, globex = Tenant(cluster, "acme"), Tenant(cluster, "globex")
    first = acme.submit("share", {"sleep": 3})
    deadline = time.monotonic() + 30
    while (
        cluster.api("GET", f"/v1/tasks/{first}").json()["state"] == "queued" and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    other = globex.submit("share", {"sleep": 0})
    second = acme.submit("share", {"sleep": 0})
    done = {tid: t.result(tid) for t, tid in ((acme, first), (globex, other), (acme, second))}
    assert all(d["state"] == "succeeded" and d["gpus"] == ["GPU-fake-0"] for d in done.values()), done
    # acme's second share ran beside its first; globex's waited until acme had left the GPU
    assert ts(done[second]["started_at"]) < ts(done[first]["finished_at"])
    assert ts(done[other]["started_at"]) >= ts(done[first]["finished_at"])
    assert ts(done[other]["started_at"]) >= ts(done[second]["finished_at"])
    # scrubbed before acme's first task (history unknown to a new worker) and between acme and globex, no more
    scrubs = audit(cluster, "gpu_scrubbed")
    assert [(s["previous_tenant"], s["next_tenant"], s["ok"], s["gpu"]) for s in scrubs] == [
        (None, "acme", True, "GPU-fake-0"), ("acme", "globex", True, "GPU-fake-0")]  # fmt: skip
    assert scrubs[1]["task_id"] == other and ts(scrubs[1]["ts"]) <= ts(done[other]["started_at"])
    assert log.read_text().split() == ["GPU-fake-0", "GPU-fake-0"]


FAILING = shlex.join([sys.executable, "-c", "import sys; print('cannot clear memory'); sys.exit(3)"])


@pytest.mark.parametrize(("command", "reason"), [(FAILING, "cannot clear memory"), ("builtin", "torch")],
                         ids=["a failing scrub command", "the builtin step where torch cannot scrub"])  # fmt: skip
def test_a_gpu_whose_scrub_fails_is_quarantined_and_the_task_does_not_run_on_it(
    cluster: Cluster, command: str, reason: str
) -> None:
    cluster.start_worker(APP, gpus="fake:1x24Gi", name="scrubfail", extra=["--scrub-command", command])
    acme = Tenant(cluster, "acme")
    task = acme.result(acme.submit("gpuonly", {}, placement_timeout_s=2, max_retries=1), wait_s=60)
    assert (task["state"], task["error"]["type"]) == ("failed", "no_capacity"), task  # never ran
    assert task["routing"]["avoid_gpus"] == ["GPU-fake-0"]
    [record] = audit(cluster, "gpu_scrubbed")
    assert (record["ok"], record["gpu"], record["next_tenant"]) == (False, "GPU-fake-0", "acme")
    assert reason in record["message"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        worker = next(
            w for w in cluster.api("GET", "/v1/workers").json()["workers"] if w["name"] == "scrubfail"
        )
        if worker["gpus"][0]["quarantined"]:
            break
        time.sleep(0.1)
    quarantined = worker["gpus"][0]["quarantined"] or ""
    assert quarantined.startswith("GPU scrub failed") and reason in quarantined


def test_a_warm_process_serves_one_tenant_and_is_closed_when_its_gpu_changes_tenant(cluster: Cluster) -> None:
    cluster.start_worker(APP, gpus="fake:1x24Gi", name="plain")
    acme, globex = Tenant(cluster, "acme"), Tenant(cluster, "globex")
    pids = [(t, t.result(t.submit("gpuonly", {}))) for t in (acme, acme, globex)]
    assert all(done["state"] == "succeeded" for _, done in pids), pids
    first, again, other = (done["output"]["pid"] for _, done in pids)
    assert first == again  # warm: acme's process served acme's next task
    assert other != first  # never globex's
    deadline = time.monotonic() + 10
    while pid_alive(first) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(first)  # and it did not linger on the GPU globex now holds
    assert audit(cluster, "gpu_scrubbed") == []  # no scrub configured, none run
