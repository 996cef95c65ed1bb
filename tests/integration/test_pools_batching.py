"""Warm pools, batching, warm affinity and `gpu: auto`, end to end with real workers and handler processes."""

from __future__ import annotations

from pathlib import Path

import httpx
import psutil

from tests.conftest import Cluster
from tests.integration.test_pipelines import until
from turnout.client import Client

APP = "tests.apps.pool_app:app"


def handler_processes(worker_pid: int, capability: str) -> list[psutil.Process]:
    """The warm runner processes under a worker that serve one capability (not their lifeline sentinels,
    forked copies of each runner)."""
    found: dict[int, psutil.Process] = {}
    for child in psutil.Process(worker_pid).children(recursive=True):
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if "turnout.worker.runner" in argv and capability in argv and "python" in Path(argv[0]).name:
            found[child.pid] = child
    return [p for p in found.values() if p.ppid() not in found]


def pools(c: Cluster, name: str) -> dict:
    return next(w for w in c.api("GET", "/v1/workers").json()["workers"] if w["name"] == name)["pools"]


def beat(c: Cluster, name: str) -> str:
    return next(w for w in c.api("GET", "/v1/workers").json()["workers"] if w["name"] == name)[
        "last_heartbeat"
    ]


def test_pool_grows_to_max_processes_under_a_queue_then_idles_back_to_zero(cluster: Cluster) -> None:
    worker = cluster.start_worker(APP, name="w", extra=["--cpus", "2"])
    tasks = [cluster.submit("warmable", {"sleep": 2}) for _ in range(6)]
    seen: set[int] = set()

    def three_running() -> bool:
        procs = handler_processes(worker.pid, "warmable")
        seen.update(p.pid for p in procs)
        assert len(procs) <= 3, [p.cmdline() for p in procs]  # max_processes holds while six tasks wait
        return len(procs) == 3

    until(three_running, what="three warm processes")
    done = [cluster.result(t["id"], wait=60) for t in tasks]
    assert all(t["state"] == "succeeded" for t in done)
    assert len({t["output"]["pid"] for t in done}) == 3  # six tasks, three processes, each reused
    assert sum(1 for t in done if t["cold_start_s"] and t["cold_start_s"] >= 0.3) == 3  # one setup each
    until(lambda: not handler_processes(worker.pid, "warmable"), what="idle processes to exit")
    assert pools(cluster, "w")["warmable:cpu"]["started"] == 3
    # one task later: the pool grows by one process, not more
    one = cluster.result(cluster.submit("warmable", {})["id"])
    assert one["state"] == "succeeded" and one["cold_start_s"] >= 0.3
    until(lambda: pools(cluster, "w")["warmable:cpu"]["started"] == 4, what="the heartbeat's pool report")


def test_a_batch_of_n_calls_the_handler_once_and_each_task_keeps_its_own_result(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start_worker(APP, name="w")
    log = tmp_path / "calls.log"
    resp = cluster.api("POST", "/v1/tasks/batch",
                       json={"tasks": [{"capability": "batched", "input": {"i": i, "log": str(log)}} for i in range(8)]})  # fmt: skip
    assert resp.status_code == 201, resp.text
    ids = [t["id"] for t in resp.json()["tasks"]]
    done = [cluster.result(tid) for tid in ids]
    assert [t["state"] for t in done] == ["succeeded"] * 8
    assert log.read_text().split() == ["8"]  # one call of the handler for eight tasks
    assert [t["output"]["i"] for t in done] == list(range(8))  # each result went to its own task
    assert {t["batch_size"] for t in done} == {8}
    assert len({t["output"]["pid"] for t in done}) == 1
    assert len({round(t["run_s"], 6) for t in done}) == 1  # an equal share of the batch's seconds each
    with Client(cluster.url, cluster.token) as client:
        texts = [e["content"] for e in client.task(ids[5]).events() if e["event"] == "text"]
    assert texts == ["item 5"]  # its own events only


def test_a_batch_holds_one_tenants_tasks_only_on_a_shared_worker(cluster: Cluster, tmp_path: Path) -> None:
    """One handler call sees all its inputs: two tenants' tasks, queued together for one batched variant on
    one shared worker, are never handed to the same call."""
    cluster.start_worker(APP, name="w", extra=["--cpus", "2"])  # the operator's token: a shared pool
    log, who = tmp_path / "calls.log", tmp_path / "who.log"
    ids: list[tuple[str, str]] = []
    for tenant in ("acme", "globex"):
        token = cluster.api("POST", "/v1/tokens", json={"role": "submit", "tenant": tenant}).json()["token"]
        tasks = [{"capability": "batched", "input": {"i": i, "log": str(log), "who_log": str(who), "who": tenant}}
                 for i in range(4)]  # fmt: skip
        resp = httpx.post(f"{cluster.url}/v1/tasks/batch", json={"tasks": tasks}, timeout=30,
                          headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        assert resp.status_code == 201, resp.text
        ids += [(tenant, t["id"]) for t in resp.json()["tasks"]]
    done = [cluster.result(tid) for _, tid in ids]
    assert [t["state"] for t in done] == ["succeeded"] * 8
    calls = [line.split() for line in who.read_text().splitlines()]
    assert sorted(w for call in calls for w in call) == ["acme"] * 4 + ["globex"] * 4
    assert all(len(set(call)) == 1 for call in calls), calls  # each call one tenant's inputs
    assert all(t["tenant"] == tenant for (tenant, _), t in zip(ids, done, strict=True))


def test_a_part_full_batch_runs_once_its_wait_is_over(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_worker(APP, name="w")
    log = tmp_path / "calls.log"
    resp = cluster.api("POST", "/v1/tasks/batch",
                       json={"tasks": [{"capability": "batched", "input": {"i": i, "log": str(log)}} for i in range(3)]})  # fmt: skip
    done = [cluster.result(t["id"]) for t in resp.json()["tasks"]]
    assert [t["state"] for t in done] == ["succeeded"] * 3
    assert log.read_text().split() == ["3"]
    assert min(t["queue_s"] for t in done) >= 0.3  # it waited max_batch_wait_ms for more


def test_a_task_goes_to_the_worker_with_a_warm_process(cluster: Cluster) -> None:
    cluster.start_worker(APP, name="a", extra=["--cpus", "1"])
    first = cluster.result(cluster.submit("embed", {}, gpu="never")["id"])
    assert first["state"] == "succeeded" and first["cold_start_s"] > 0
    cluster.start_worker(APP, name="b", extra=["--cpus", "1"])
    until(lambda: pools(cluster, "a")["embed:cpu"]["loaded"] >= 1, what="a's warm process reported")
    until(lambda: "embed:cpu" in pools(cluster, "b"), what="b's pools reported")
    seen = beat(cluster, "a")
    until(lambda: beat(cluster, "a") != seen, what="one more heartbeat of a, so every view holds its report")
    workers = {w["name"]: w["id"] for w in cluster.api("GET", "/v1/workers").json()["workers"]}
    for _ in range(4):
        task = cluster.result(cluster.submit("embed", {}, gpu="never")["id"])
        assert task["worker"] == workers["a"] and task["cold_start_s"] == 0
    assert pools(cluster, "b")["embed:cpu"]["started"] == 0


def test_auto_takes_the_cpu_when_the_gpu_queue_is_long_and_the_gpu_when_it_is_not(cluster: Cluster) -> None:
    cluster.start_worker(APP, gpus="fake:1x24Gi", name="gpu", extra=["--cpus", "1"])
    cluster.start_worker(APP, name="cpu", extra=["--cpus", "1"])
    # no history yet: auto behaves like prefer
    fresh = cluster.result(cluster.submit("embed", {}, gpu="auto")["id"])
    assert fresh["routing"]["reason"] == "gpu available"
    for gpu in ("require", "never", "require", "never"):  # history on both device classes
        assert cluster.result(cluster.submit("embed", {}, gpu=gpu)["id"])["state"] == "succeeded"
    assert cluster.result(cluster.submit("hold", {"seconds": 1}, gpu="require")["id"])["state"] == "succeeded"
    caps = {c["name"]: c for c in cluster.api("GET", "/v1/capabilities").json()["capabilities"]}
    assert {p["device"] for p in caps["embed"]["profiles"]} == {"cpu", "gpu"}
    quick = cluster.result(cluster.submit("embed", {}, gpu="auto")["id"])
    assert quick["device"] == "gpu" and quick["routing"]["reason"].startswith("gpu run"), quick["routing"]
    holds = [cluster.submit("hold", {"seconds": 30}, gpu="require") for _ in range(6)]
    until(
        lambda: cluster.api("GET", f"/v1/tasks/{holds[0]['id']}").json()["state"] == "running", what="a hold"
    )
    busy = cluster.result(cluster.submit("embed", {}, gpu="auto")["id"])
    assert busy["device"] == "cpu", busy["routing"]
    assert busy["routing"]["reason"].startswith("gpu queue") and " > cpu run" in busy["routing"]["reason"]
    for h in holds:
        cluster.api("POST", f"/v1/tasks/{h['id']}/cancel")
    until(lambda: cluster.result(cluster.submit("embed", {}, gpu="auto")["id"])["device"] == "gpu",
          what="auto back on the gpu once its queue is gone")  # fmt: skip
