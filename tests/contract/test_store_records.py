"""Runs, profiles, file records, workers and tokens, on every backend (the `store` fixture of test_store.py)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests.contract.test_store import _task
from turnout.models import Device, GpuMode, Task, TaskSpec, TaskState, Variant, Worker, WorkerState
from turnout.pipelines import PipelineRun, RunState, Stage
from turnout.profiles import Profile
from turnout.resources import parse_resources
from turnout.store import Store
from turnout.store.files import FileRecord

STAGES = (Stage("pre"), Stage("classify", timeout_s=30.0))


def _run(i: int, tenant: str = "default", pipeline: str = "p", task_ids: tuple[str, ...] = ()) -> PipelineRun:
    return PipelineRun(id=f"r_{i:06d}", tenant=tenant, pipeline=pipeline, state=RunState.RUNNING,
                       input={"text": "x"}, gpu=None, stages=STAGES, task_ids=task_ids, created_at=float(i))  # fmt: skip


def _worker(i: int, registered_at: float, state: WorkerState = WorkerState.HEALTHY) -> Worker:
    return Worker(id=f"w_{i}", name=f"n{i}", host="h", state=state,
                  variants=(Variant("cap", Device.CPU, parse_resources({"cpu": 1})),), cpu=2.0, memory_bytes=2**30,
                  gpus=(), strategy="pack", registered_at=registered_at, last_heartbeat=registered_at, heartbeat_s=5.0)  # fmt: skip


# ---- pipeline runs ---------------------------------------------------------------------------------


def test_runs_read_back_identically_and_list_newest_first(store: Store) -> None:
    runs = [_run(1), _run(2, tenant="acme"), _run(3, task_ids=("t_1",))]
    for run in runs:
        store.runs.insert_run(run)
    assert store.runs.get_run("r_000003") == runs[2]
    assert store.runs.get_run("r_404") is None
    assert sorted(r.id for r in store.runs.get_runs(["r_000001", "r_000003", "r_404"])) == [
        "r_000001",
        "r_000003",
    ]
    assert [r.id for r in store.runs.list_runs(tenant=None)] == ["r_000003", "r_000002", "r_000001"]
    assert [r.id for r in store.runs.list_runs(tenant="default", limit=1)] == ["r_000003"]
    assert [r.id for r in store.runs.list_runs(tenant=None, cursor="r_000003")] == ["r_000002", "r_000001"]


def test_a_run_moves_on_only_while_its_task_list_is_as_expected(store: Store) -> None:
    store.runs.insert_run(_run(1, task_ids=("t_1",)))
    # Given two callers who both read one task: the first to queue the next stage wins, the second changes nothing
    assert store.runs.update_run("r_000001", 1, {"task_ids": ("t_1", "t_2")})
    assert not store.runs.update_run("r_000001", 1, {"task_ids": ("t_1", "t_3")})
    assert store.runs.get_run("r_000001").task_ids == ("t_1", "t_2")  # type: ignore[union-attr]
    done = {"state": RunState.SUCCEEDED, "output": {"label": "ok"}, "finished_at": 9.0}
    assert store.runs.update_run("r_000001", 2, done)
    assert not store.runs.update_run("r_000001", 2, {"state": RunState.FAILED})  # ended: never changes again
    run = store.runs.get_run("r_000001")
    assert run is not None and (run.state, run.output, run.finished_at) == (
        RunState.SUCCEEDED,
        {"label": "ok"},
        9.0,
    )
    assert store.runs.runs_to_move_on() == []
    assert not store.runs.update_run("r_404", 0, {"state": RunState.FAILED})


def test_the_sweep_reads_only_running_runs_with_no_stage_queued_or_in_flight(store: Store) -> None:
    def stage(run: int, i: int, state: TaskState) -> Task:
        spec = TaskSpec(capability="cap", input={}, gpu=GpuMode.NEVER)
        return Task(id=f"t_{run}{i}", tenant="default", spec=spec, state=state, created_at=1.0,
                    pipeline_run_id=f"r_{run:06d}")  # fmt: skip

    tasks = [stage(1, 0, TaskState.QUEUED), stage(2, 0, TaskState.SUCCEEDED), stage(2, 1, TaskState.RUNNING),
             stage(3, 0, TaskState.SUCCEEDED), stage(4, 0, TaskState.CANCELLED), stage(5, 0, TaskState.LEASED)]  # fmt: skip
    store.insert_tasks(tasks)
    for n in range(1, 6):
        store.runs.insert_run(
            _run(n, task_ids=tuple(t.id for t in tasks if t.pipeline_run_id == f"r_{n:06d}"))
        )
    # Given runs 1, 2 and 5 have a stage waiting or under way, and runs 3 and 4 a stage that ended
    assert [r.id for r in store.runs.runs_to_move_on()] == ["r_000003", "r_000004"]
    # When a run ends, the sweep no longer reads it
    store.runs.update_run("r_000003", 1, {"state": RunState.SUCCEEDED, "finished_at": 2.0})
    assert [r.id for r in store.runs.runs_to_move_on(limit=5)] == ["r_000004"]


def test_run_counts_and_costs_are_grouped(store: Store) -> None:
    for run in (_run(1), _run(2), _run(3, pipeline="q")):
        store.runs.insert_run(run)
    store.runs.update_run("r_000002", 0, {"state": RunState.FAILED})
    assert sorted(store.runs.run_counts()) == [("p", "failed", 1), ("p", "running", 1), ("q", "running", 1)]
    store.insert_tasks([_task(1), _task(2), _task(3, tenant="acme")])
    store.update_tasks(
        [(f"t_00000{i}", (TaskState.QUEUED,), None, {"cost_usd": 0.25 * i}) for i in (1, 2, 3)]
    )
    assert sorted(store.runs.cost_by_tenant()) == [("cap", "acme", 0.75), ("cap", "default", 0.75)]


def test_profiles_fold_samples_into_moving_averages_and_keep_peaks(store: Store) -> None:
    store.runs.record_profile("cap", "gpu", "H100", run_s=1.0, cold_start_s=None, peak_gpu_memory_bytes=100,
                              peak_rss_bytes=None, now=1.0)  # fmt: skip
    store.runs.record_profile("cap", "gpu", "H100", run_s=2.0, cold_start_s=4.0, peak_gpu_memory_bytes=50,
                              peak_rss_bytes=7, now=2.0)  # fmt: skip
    store.runs.record_profile("cap", "cpu", None, run_s=3.0, cold_start_s=None, peak_gpu_memory_bytes=None,
                              peak_rss_bytes=None, now=3.0)  # fmt: skip
    by_device = {p.device: p for p in store.runs.profiles()}
    gpu = by_device["gpu"]
    assert (gpu.gpu_model, gpu.samples, gpu.cold_start_s, gpu.peak_gpu_memory_bytes, gpu.peak_rss_bytes) == (
        "H100",
        2,
        4.0,
        100,
        7,
    )
    assert gpu.run_s == pytest.approx(0.7 * 1.0 + 0.3 * 2.0)
    assert by_device["cpu"] == Profile("cap", "cpu", None, 1, 3.0)


# ---- file records ----------------------------------------------------------------------------------


def test_file_records_belong_to_their_tenant_and_expire(store: Store) -> None:
    files = [FileRecord("f_1", "acme", "a.txt", 3, "ab" * 32, 1.0, expires_at=10.0),
             FileRecord("f_2", "acme", None, 0, "cd" * 32, 2.0, task_id="t_1"),
             FileRecord("f_3", "globex", "c", 5, "ef" * 32, 3.0, expires_at=20.0)]  # fmt: skip
    for record in files:
        store.files.insert(record)
    assert store.files.get("f_2") == files[1]
    assert store.files.get("f_404") is None
    assert store.files.owned({"f_1", "f_2", "f_3", "f_404"}, "acme", 5.0) == {"f_1", "f_2"}
    assert store.files.owned(set(), "acme", 5.0) == set()
    # expired, its record not swept yet: not there any more (a task naming it would find nothing)
    assert store.files.owned({"f_1", "f_2"}, "acme", 10.0) == {"f_2"}
    assert store.files.expire(15.0) == ["f_1"]
    assert store.files.expire(15.0) == []
    assert store.files.delete("f_3") and not store.files.delete("f_3")
    assert store.files.owned({"f_1", "f_3"}, "globex", 15.0) == set()
    with pytest.raises(sa.exc.IntegrityError):
        store.files.insert(files[1])


# ---- workers and tokens ----------------------------------------------------------------------------


def test_workers_list_in_registration_order_and_gone_ones_only_when_asked(store: Store) -> None:
    store.upsert_worker(_worker(1, 20.0))
    store.upsert_worker(_worker(2, 10.0, WorkerState.GONE))
    store.upsert_worker(_worker(3, 30.0))
    assert [w.id for w in store.list_workers()] == ["w_1", "w_3"]
    assert [w.id for w in store.list_workers(include_gone=True)] == ["w_2", "w_1", "w_3"]
    # registering again under its id replaces what was known of it
    store.upsert_worker(_worker(2, 40.0))
    assert [w.id for w in store.list_workers()] == ["w_1", "w_3", "w_2"]


def test_a_worker_update_sets_its_columns_and_honours_the_state_guard(store: Store) -> None:
    store.upsert_worker(_worker(1, 1.0))
    metrics = {"gpus": [{"uuid": "GPU-0", "utilization": 0.5}]}
    assert store.update_worker("w_1", last_heartbeat=9.0, metrics=metrics, quarantined={"GPU-0": "ecc"})
    worker = store.get_worker("w_1")
    assert worker is not None and (worker.last_heartbeat, worker.metrics, worker.quarantined) == (
        9.0,
        metrics,
        {"GPU-0": "ecc"},
    )
    assert not store.update_worker("w_1", (WorkerState.DRAINING,), state=WorkerState.GONE.value)
    assert not store.update_worker("w_404", state=WorkerState.GONE.value)
    assert store.get_worker("w_404") is None


def test_tokens_are_found_by_hash_revoked_once_and_counted(store: Store) -> None:
    assert store.count_tokens() == 0
    store.insert_token("k_1", "h1", "admin", "*", 1.0)
    store.insert_token("k_2", "h2", "worker", "acme", 2.0)
    row = {
        "id": "k_2",
        "hash": "h2",
        "role": "worker",
        "tenant": "acme",
        "created_at": 2.0,
        "revoked_at": None,
    }
    assert store.find_token("h2") == row
    assert store.get_token("k_2") == row
    assert store.find_token("nope") is None and store.get_token("k_404") is None
    assert store.revoke_token("k_2", 5.0)
    assert not store.revoke_token("k_2", 6.0)  # the first revocation's time stands
    assert store.find_token("h2")["revoked_at"] == 5.0  # type: ignore[index]
    assert store.count_tokens() == 2
    with pytest.raises(sa.exc.IntegrityError):  # a hash names one token
        store.insert_token("k_3", "h1", "read", "acme", 3.0)
    assert store.count_tokens() == 2


# ---- JSON values ------------------------------------------------------------------------------------

# Every kind of JSON value a task's input or output, or a run's output, may be. A bare number is the one to
# watch: SQLite gives a JSON column NUMERIC affinity, and would store the text `12345678901234567890` as a REAL.
JSON_VALUES = [1.5, 7, -0.0, 1e5, 1e300, 12345678901234567890, -(2**70), 0, True, None, "12", "x", [1, 2.5],
               {"n": 12345678901234567890}]  # fmt: skip


@pytest.mark.parametrize("value", JSON_VALUES, ids=repr)
def test_any_json_value_reads_back_exactly_as_input_output_and_run_output(
    store: Store, value: object
) -> None:
    task = _task(1)
    task = Task(task.id, task.tenant, TaskSpec("cap", value), TaskState.QUEUED, task.created_at)
    store.insert_tasks([task])
    assert store.update_tasks([(task.id, (TaskState.QUEUED,), None, {"output": value})]) == [task.id]
    for read in (store.get_task(task.id), *store.get_tasks([task.id])):
        assert read is not None
        assert repr(read.spec.input) == repr(value) and repr(read.output) == repr(value)  # -0.0 and 1e5 too
    store.runs.insert_run(_run(1))
    assert store.runs.update_run("r_000001", 0, {"state": RunState.SUCCEEDED, "output": value})
    run = store.runs.get_run("r_000001")
    assert run is not None and repr(run.output) == repr(value)
    assert [repr(r.output) for r in store.runs.list_runs(tenant=None)] == [repr(value)]
