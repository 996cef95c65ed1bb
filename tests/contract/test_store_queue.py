"""The queue and sweep half of the store contract, on every backend: what leases, the reaper and the
placement-timeout clock read and write, and the counts metrics and the dashboard show."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from tests.contract.test_store import _task
from turnout.gpu.allocation import GpuGrant
from turnout.models import Allocation, Device, GpuMode, Routing, Task, TaskSpec, TaskState
from turnout.resources import parse_resources
from turnout.store import Store
from turnout.store.base import queue_pages

NO_CAPACITY = {"type": "no_capacity", "message": "nobody can"}


def _plain(i: int, capability: str = "cap", gpu: GpuMode = GpuMode.PREFER, timeout_s: float = 10.0) -> Task:
    """A task with no resource overrides and no retry history: one of a 'kind' the sweep judges in bulk."""
    spec = TaskSpec(capability=capability, input={"n": i}, gpu=gpu, placement_timeout_s=timeout_s)
    return Task(id=f"t_{i:06d}", tenant="default", spec=spec, state=TaskState.QUEUED, created_at=100.0 + i)


def _lease(task_id: str, worker: str = "w", attempts: int = 0, **values: object) -> tuple:
    return (task_id, (TaskState.QUEUED,), attempts, {"state": TaskState.LEASED, "attempts": attempts + 1,
                                                     "worker_id": worker, **values})  # fmt: skip


def test_a_change_in_a_batch_sees_the_changes_before_it(store: Store) -> None:
    store.insert_tasks([_task(1)])
    start = ("t_000001", (TaskState.LEASED,), 1, {"state": TaskState.RUNNING, "started_at": 5.0})
    assert store.update_tasks([_lease("t_000001"), start]) == ["t_000001", "t_000001"]
    task = store.get_task("t_000001")
    assert task is not None and (task.state, task.attempts, task.started_at) == (TaskState.RUNNING, 1, 5.0)


def test_a_change_to_a_missing_task_applies_to_nothing(store: Store) -> None:
    assert store.update_tasks([_lease("t_404")]) == []


def test_reading_on_widens_the_queue_window_up_to_widen_to(store: Store) -> None:
    store.insert_tasks([_task(i) for i in range(6)])
    assert len(list(store.queued_tasks(["cap"], limit=2))) == 2
    assert len(list(store.queued_tasks(["cap"], limit=2, widen_to=4))) == 4
    assert [t.id for t in store.queued_tasks(None, limit=2, widen_to=100)] == [f"t_{i:06d}" for i in range(6)]
    assert list(store.queued_tasks(["other"])) == []


def test_a_deep_queue_is_read_in_growing_pages_in_order_each_task_once(store: Store) -> None:
    # Given 60 queued tasks, a few ahead of the rest by priority
    tasks = [_plain(i) for i in range(60)]
    tasks[50] = replace(tasks[50], spec=replace(tasks[50].spec, priority=5))
    store.insert_tasks(tasks)
    expected = ["t_000050", *(f"t_{i:06d}" for i in range(60) if i != 50)]
    # When a caller reads from a first page of 2 up to 45 (pages of 2, 8, 32, 3)
    read = [t.id for t in store.queued_tasks(["cap"], limit=2, widen_to=45)]
    # Then it gets the first 45 in the queue's order, none twice, none skipped at a page's edge
    assert read == expected[:45]
    # and a caller that stops early got what it read in the same order
    first_three = list(itertools.islice(store.queued_tasks(["cap"], limit=2, widen_to=200), 3))
    assert [t.id for t in first_three] == expected[:3]


def test_get_tasks_answers_each_existing_task_once(store: Store) -> None:
    store.insert_tasks([_task(1), _task(2)])
    assert sorted(t.id for t in store.get_tasks(["t_000002", "t_000001", "t_000002", "t_404"])) == [
        "t_000001",
        "t_000002",
    ]
    assert store.get_tasks([]) == []


def test_a_bare_read_leaves_out_the_input_and_the_output_and_nothing_else(store: Store) -> None:
    """What a pipeline run's answer reads of its stages: each stage's input holds every output before it."""
    done = replace(_task(1), state=TaskState.SUCCEEDED, output={"big": "x" * 1000}, run_s=0.5, cost_usd=0.001)
    store.insert_tasks([done, _task(2)])
    full = {t.id: t for t in store.get_tasks(["t_000001", "t_000002"])}
    bare = {t.id: t for t in store.get_tasks(["t_000001", "t_000002"], bare=True)}
    assert full["t_000001"].output == {"big": "x" * 1000} and full["t_000001"].spec.input == {"n": 1}
    for task_id, task in full.items():
        assert bare[task_id] == replace(task, spec=replace(task.spec, input=None), output=None)


def test_listing_filters_by_tenant_state_and_capability(store: Store) -> None:
    other = replace(_task(2, tenant="acme"), spec=replace(_task(2).spec, capability="other"))
    store.insert_tasks([_task(1), other, _task(3)])
    store.update_tasks([_lease("t_000003")])
    assert [t.id for t in store.list_tasks(tenant=None)] == ["t_000003", "t_000002", "t_000001"]
    assert [t.id for t in store.list_tasks(tenant="default")] == ["t_000003", "t_000001"]
    assert [t.id for t in store.list_tasks(tenant=None, state="leased")] == ["t_000003"]
    assert [t.id for t in store.list_tasks(tenant=None, capability="other")] == ["t_000002"]


def test_active_tasks_are_the_leased_and_running_ones_of_the_workers_named(store: Store) -> None:
    store.insert_tasks([_task(i) for i in range(4)])
    store.update_tasks([_lease("t_000000", "a"), _lease("t_000001", "b"), _lease("t_000002", "a")])
    store.update_tasks([("t_000002", (TaskState.LEASED,), 1, {"state": TaskState.SUCCEEDED})])
    assert sorted(t.id for t in store.active_tasks()) == ["t_000000", "t_000001"]
    assert [t.id for t in store.active_tasks(["a"])] == ["t_000000"]
    assert store.active_tasks([]) == []
    assert store.active_by_tenant() == {"default": 2}


def test_queue_depths_count_unfinished_tasks_per_capability_and_state(store: Store) -> None:
    store.insert_tasks([_task(1), _task(2), _task(3, tenant="acme"), _task(4)])
    store.update_tasks([_lease("t_000002")])
    store.update_tasks([("t_000004", (TaskState.QUEUED,), None, {"state": TaskState.CANCELLED})])
    assert store.queue_depths() == {"cap": {"queued": 2, "leased": 1}}
    assert store.queue_depths("acme") == {"cap": {"queued": 1}}


def test_task_stats_group_counts_run_times_costs_and_buckets(store: Store) -> None:
    store.insert_tasks([_task(i) for i in range(4)])
    store.update_tasks([_lease(f"t_00000{i}", device=Device.CPU) for i in range(3)])
    done = {"state": TaskState.SUCCEEDED}
    store.update_tasks([
        ("t_000000", (TaskState.LEASED,), 1, {**done, "run_s": 0.5, "cost_usd": 0.25}),
        ("t_000001", (TaskState.LEASED,), 1, {**done, "run_s": 3.0, "cost_usd": 0.5}),
        ("t_000002", (TaskState.LEASED,), 1, {**done}),
    ])  # fmt: skip
    rows = {(r["state"], r["device"]): r for r in store.task_stats(run_s_buckets=(1.0, 10.0))}
    assert set(rows) == {("succeeded", "cpu"), ("queued", None)}
    ok = rows[("succeeded", "cpu")]
    assert (ok["capability"], ok["gpu_mode"], ok["count"], ok["run_s_count"]) == ("cap", "prefer", 3, 2)
    assert (ok["run_s_sum"], ok["cost_usd"], ok["run_s_buckets"]) == (3.5, 0.75, [1, 2])
    queued = rows[("queued", None)]
    assert (queued["count"], queued["run_s_count"], queued["run_s_sum"], queued["cost_usd"]) == (
        1,
        0,
        0.0,
        0.0,
    )
    assert [r["state"] for r in store.task_stats([TaskState.QUEUED])] == ["queued"]
    assert store.task_stats(tenant="nobody") == []


def _kinds(store: Store) -> list[tuple[str, str, object, str]]:
    """The kinds, comparable across stores: overrides as the JSON they hold (each store keeps its own text)."""
    kinds = [(k.capability, k.gpu_mode, k.resources and json.loads(k.resources), k.sample_id)
             for k in store.queued_kinds()]  # fmt: skip
    return sorted(kinds, key=lambda k: (k[0], k[1], k[3]))


def test_queued_tasks_never_retried_are_grouped_into_kinds_by_overrides_and_retries_judged_alone(
    store: Store,
) -> None:
    retried = replace(_plain(6), routing=Routing(avoid_gpus=("GPU-1",)))
    store.insert_tasks([_plain(1), _plain(2), _plain(3, gpu=GpuMode.NEVER), _task(4), _task(5), retried])
    assert _kinds(store) == [("cap", "never", None, "t_000003"), ("cap", "prefer", None, "t_000001"),
                             ("cap", "prefer", {"memory": 2**30}, "t_000004")]  # fmt: skip
    assert [t.id for t in store.queued_unusual()] == ["t_000006"]


def test_the_placement_clock_of_a_kind_with_overrides_moves_only_its_own_tasks(store: Store) -> None:
    store.insert_tasks([_plain(1), _task(4), _task(5)])
    (with_overrides,) = [k for k in store.queued_kinds() if k.resources is not None]
    assert store.mark_servable(with_overrides, False, 1000.0, NO_CAPACITY) == []
    since = {t.id: t.unservable_since for t in store.get_tasks(["t_000001", "t_000004", "t_000005"])}
    assert since == {"t_000001": None, "t_000004": 1000.0, "t_000005": 1000.0}
    later = 1000.0 + store.get_task("t_000004").spec.placement_timeout_s  # type: ignore[union-attr]
    assert sorted(store.mark_servable(with_overrides, False, later, NO_CAPACITY)) == ["t_000004", "t_000005"]
    assert store.get_task("t_000001").state is TaskState.QUEUED  # type: ignore[union-attr]


def test_the_placement_clock_starts_fails_the_kind_when_due_and_clears_when_servable(store: Store) -> None:
    store.insert_tasks([_plain(1), _plain(2, timeout_s=30.0), _plain(3, gpu=GpuMode.NEVER), _task(4)])
    # Given nobody can serve (cap, prefer): the clock starts for its plain tasks only
    prefer = next(k for k in store.queued_kinds() if k[1:4] == ("cap", "prefer", None))
    assert store.mark_servable(prefer, False, 1000.0, NO_CAPACITY) == []
    assert [t.unservable_since for t in store.get_tasks(["t_000001", "t_000002"])] == [1000.0, 1000.0]
    assert store.get_task("t_000003").unservable_since is None  # type: ignore[union-attr]
    # When time passes: the clock keeps its start, and a task fails once its own placement_timeout_s is over
    assert store.mark_servable(prefer, False, 1005.0, NO_CAPACITY) == []
    assert store.mark_servable(prefer, False, 1010.0, NO_CAPACITY) == ["t_000001"]
    failed = store.get_task("t_000001")
    assert failed is not None and (failed.state, failed.error, failed.finished_at) == (
        TaskState.FAILED,
        NO_CAPACITY,
        1010.0,
    )
    # When a worker can serve it again: the clock of what is still queued is cleared
    assert store.mark_servable(prefer, True, 1011.0, NO_CAPACITY) == []
    assert store.get_task("t_000002").unservable_since is None  # type: ignore[union-attr]
    assert store.get_task("t_000004").unservable_since is None  # type: ignore[union-attr]


def test_each_tenants_tasks_of_one_kind_keep_a_placement_clock_of_their_own(store: Store) -> None:
    # the workers that may serve a task depend on its tenant (private workers): one verdict per tenant
    store.insert_tasks([_plain(1), replace(_plain(2), tenant="acme")])
    kinds = {k.tenant: k for k in store.queued_kinds() if k[1:4] == ("cap", "prefer", None)}
    assert sorted(kinds) == ["acme", "default"] and (kinds["acme"].sample_id, kinds["default"].sample_id) == (
        "t_000002",
        "t_000001",
    )
    store.mark_servable(kinds["acme"], False, 1000.0, NO_CAPACITY)
    assert [t.unservable_since for t in store.get_tasks(["t_000001", "t_000002"])] == [None, 1000.0]
    assert store.mark_servable(kinds["acme"], False, 1010.0, NO_CAPACITY) == ["t_000002"]
    assert store.get_task("t_000001").state is TaskState.QUEUED  # type: ignore[union-attr]


def test_json_columns_keep_none_apart_from_empty_and_read_back_as_written(store: Store) -> None:
    task = replace(_task(1), spec=replace(_task(1).spec, input=None, labels={}), output=None)
    store.insert_tasks([task])
    routing = Routing(requested="auto", device="cpu", avoid_gpus=("GPU-1",), undelivered=2)
    isolation = {"n": 1.5, "deep": {"x": [1, None]}, "empty": {}}
    values = {"routing": routing, "gpus": None, "usage": {}, "isolation": isolation}
    store.update_tasks([("t_000001", (TaskState.QUEUED,), 0, values)])
    back = store.get_task("t_000001")
    assert back is not None
    assert (back.spec.input, back.spec.labels, back.routing, back.gpus, back.usage, back.isolation) == (
        None,
        {},
        routing,
        None,
        {},
        isolation,
    )
    assert store.queued_unusual()[0].id == "t_000001"  # routing set: judged alone


def test_typed_records_read_back_as_written(store: Store) -> None:
    grant = GpuGrant(("GPU-a", "GPU-b"), (0, 1), 4 * 2**30, False, "Fake GPU", False, 24 * 2**30)
    alloc = Allocation(cpu=1.5, memory=2**30, gpu_share=0.25, batch="t_000001")
    cloud = Routing(cloud="rp", cloud_job="j1")
    store.insert_tasks([replace(_task(1), gpus=grant, alloc=alloc, routing=cloud)])
    back = store.get_task("t_000001")
    assert back is not None and (back.gpus, back.alloc, back.routing) == (grant, alloc, cloud)
    values = {"gpus": None, "alloc": Allocation(), "routing": None}
    store.update_tasks([("t_000001", (TaskState.QUEUED,), 0, values)])
    again = store.get_task("t_000001")
    assert again is not None and (again.gpus, again.alloc, again.routing) == (None, Allocation(), None)


def test_a_record_read_is_a_copy_changing_it_changes_nothing_stored(store: Store) -> None:
    """Also where a read shares what it decoded with later reads of the same stored text (SQLite keeps decoded
    resources, allocations, grants and routings): the mutable part of a record (a routing's last error) is
    never shared, whether a task's own or another's with the very same routing."""
    failed = Routing(last_error={"type": "oom", "notes": ["a"]})
    store.insert_tasks([_task(1), replace(_task(2), routing=failed), replace(_task(3), routing=failed)])
    store.update_tasks([("t_000001", (TaskState.QUEUED,), 0, {"isolation": {"keys": ["a"]}})])
    first = store.get_task("t_000001")
    assert first is not None and first.isolation is not None
    first.isolation["keys"].append("b")
    first.spec.input["n"] = 99
    again = store.get_task("t_000001")
    assert again is not None and again.isolation == {"keys": ["a"]} and again.spec.input == {"n": 1}
    for _ in range(2):  # the second read is the one a decoded-record cache would answer
        two, three = store.get_tasks(["t_000002", "t_000003"])
        assert two.routing == three.routing == failed
        assert two.routing is not None and two.routing.last_error is not None
        two.routing.last_error["notes"].append("changed")
        two.routing.last_error["type"] = "changed"
        assert three.routing is not None and three.routing.last_error == {"type": "oom", "notes": ["a"]}


def test_every_read_of_a_task_gives_the_same_record(store: Store) -> None:
    """A task by id, by ids, among a worker's active tasks, and in a listing: one record, however each is read
    (on SQLite the first three run on the driver's cursor, the listing through SQLAlchemy)."""
    grant = GpuGrant(("GPU-a",), (0,), 2**30, True, "Fake GPU", False, 24 * 2**30)
    task = replace(
        _task(1), state=TaskState.LEASED, worker_id="w_1", device=Device.GPU, gpus=grant, gpu_model="Fake GPU",
        alloc=Allocation(cpu=0.5, memory=2**20, gpu_share=1.0), routing=Routing(requested="prefer", device="gpu"),
        output={"deep": [1, 2.5, None, {"x": "é"}]}, error=None, isolation={"mode": "sandbox"},
        usage={"peak_rss_bytes": 123}, leased_at=1001.25, attempts=1,
    )  # fmt: skip
    store.insert_tasks([task])
    by_id = store.get_task(task.id)
    assert by_id == task
    assert store.get_tasks([task.id, "t_missing"]) == [task]
    assert store.active_tasks(["w_1", "w_other"]) == [task] and store.active_tasks([]) == []
    # without their inputs (a lease's read of what its worker holds): the same record but for the input
    bare = replace(task, spec=replace(task.spec, input=None))
    assert store.active_tasks(["w_1"], inputs=False) == [bare] and store.active_tasks(inputs=False) == [bare]
    assert store.get_task(task.id) == task  # the input is only left unread
    assert store.list_tasks(tenant=None) == [task]
    # resources of no key given (stored as an empty object): none, on every path, and read twice
    plain = replace(_task(2), spec=replace(_task(2).spec, resources=None, resource_keys=frozenset()))
    store.insert_tasks([replace(plain, spec=replace(plain.spec, resources=parse_resources({})))])
    for _ in range(2):
        assert store.get_task(plain.id) == plain and store.get_tasks([plain.id]) == [plain]
        assert sorted(store.list_tasks(tenant=None), key=lambda t: t.id) == [task, plain]


@given(
    st.integers(min_value=0, max_value=500), st.one_of(st.none(), st.integers(min_value=0, max_value=5000))
)
def test_queue_pages_cover_the_window_once_from_the_first_page_each_four_times_the_last(
    limit: int, widen_to: int | None
) -> None:
    pages = list(queue_pages(limit, widen_to))
    total = max(limit, widen_to or 0)
    # contiguous from 0, nothing read twice, exactly the window in all
    assert [o for o, _ in pages] == [sum(n for _, n in pages[:i]) for i in range(len(pages))]
    assert sum(n for _, n in pages) == total and all(n > 0 for _, n in pages)
    if pages:  # the first page is what the caller asked for first; each later one up to four times the last
        assert pages[0][1] == min(max(1, limit), total)
        assert all(b <= 4 * a for (_, a), (_, b) in itertools.pairwise(pages))
    # a deep window takes a handful of reads, not one per row
    assert len(pages) <= 2 + total.bit_length() // 2
