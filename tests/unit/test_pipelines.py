"""Pure pipeline, cost, batching and `auto` decisions, as tables and properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnout.batching import BatchBook
from turnout.config import Prices, controller_settings
from turnout.errors import InvalidInput
from turnout.escalation import eligible, parse_escalation
from turnout.gpu.allocation import GpuGrant
from turnout.models import Allocation, Device, GpuMode, Task, TaskSpec, TaskState, Variant
from turnout.pipelines import RunState, Stage, next_step, parse_pipelines, run_costs, stage_input
from turnout.profiles import Profile, Side, choose
from turnout.resources import parse_resources

GRANT = GpuGrant(("G",), (0,), 0, True, "Fake GPU", False)
STAGES = (Stage("a"), Stage("b"), Stage("c"))
keys = st.text("abcdef", min_size=1, max_size=3)
objects = st.dictionaries(keys, st.integers(), max_size=4)


def task(state: TaskState, *, device: Device | None = None, run_s: float | None = None, cost: float | None = None,
         model: str | None = None, error: dict | None = None, output: object = None, tid: str = "t") -> Task:  # fmt: skip
    return Task(tid, "default", TaskSpec("a", {}), state, 0.0, device=device, run_s=run_s, cost_usd=cost,
                gpu_model=model, error=error, output=output)  # fmt: skip


@given(objects, st.lists(objects, max_size=4))
def test_stage_input_is_the_run_input_updated_with_each_output_in_order(
    run_input: dict, outputs: list[dict]
) -> None:
    got = stage_input(run_input, [("cap", o) for o in outputs])
    expected = dict(run_input)
    for o in outputs:
        expected.update(o)
    assert got == expected
    assert run_input == dict(run_input)  # never changed in place


def test_a_stage_output_that_is_not_an_object_is_kept_under_its_capability() -> None:
    assert stage_input({"x": 1}, [("split", [1, 2]), ("count", None)]) == {"x": 1, "split": [1, 2]}


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([], (RunState.RUNNING, 0)),
        ([TaskState.RUNNING], (RunState.RUNNING, None)),
        ([TaskState.SUCCEEDED], (RunState.RUNNING, 1)),
        ([TaskState.SUCCEEDED, TaskState.FAILED], (RunState.FAILED, None)),
        ([TaskState.SUCCEEDED, TaskState.CANCELLED], (RunState.CANCELLED, None)),
        ([TaskState.SUCCEEDED] * 3, (RunState.SUCCEEDED, None)),
    ],
)
def test_next_step_after_each_combination_of_stage_states(states: list[TaskState], expected: tuple) -> None:
    step = next_step(STAGES, [task(s, error={"type": "boom", "message": "m"}) for s in states])
    assert (step.state, step.next_stage) == expected
    if step.state is RunState.FAILED:
        assert step.error is not None and step.error["stage"] == 1 and step.error["capability"] == "b"


def test_gpu_only_cost_prices_every_stage_as_the_gpu_that_ran_the_gpu_stage() -> None:
    prices = Prices(cpu=0.001, gpu=0.01, gpu_models={"A100": 0.02})
    tasks = [task(TaskState.SUCCEEDED, device=Device.CPU, run_s=2.0, cost=0.002),
             task(TaskState.SUCCEEDED, device=Device.GPU, run_s=1.0, cost=0.01, model="NVIDIA A100-SXM4-40GB"),
             task(TaskState.SUCCEEDED, device=Device.CPU, run_s=3.0, cost=0.003)]  # fmt: skip
    cost, gpu_only = run_costs(prices, tasks)
    assert cost == pytest.approx(0.015)
    assert gpu_only == pytest.approx(2.0 * 0.02 + 0.01 + 3.0 * 0.02)


def test_no_prices_means_no_cost_rather_than_zero() -> None:
    assert run_costs(Prices(), [task(TaskState.SUCCEEDED, device=Device.CPU, run_s=1.0)]) == (None, None)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"p": {"stages": []}}, "pipelines.p.stages"),
        ({"p": {"stages": [{"gpu": "never"}]}}, "pipelines.p.stages.0.capability"),
        ({"p": {"stages": [{"capability": "a", "timeout_s": -1}]}}, "pipelines.p.stages.0.timeout_s"),
        ({"p": {"stages": [{"capability": "a", "retries": 1.5}]}}, "pipelines.p.stages.0.retries"),
        ({"p": {"stages": [{"capability": "a", "colour": 1}]}}, "pipelines.p.stages.0.colour"),
        ({"P!": {"stages": [{"capability": "a"}]}}, "pipelines.P!"),
        ({"p": {"stages": [{"capability": "a", "gpu_wait_s": -1}]}}, "pipelines.p.stages.0.gpu_wait_s"),
        (
            {"p": {"stages": [{"capability": "a", "placement_timeout_s": 0}]}},
            "pipelines.p.stages.0.placement_timeout_s",
        ),
    ],
)
def test_bad_pipeline_config_names_the_key(raw: dict, field: str) -> None:
    with pytest.raises(InvalidInput) as info:
        parse_pipelines(raw)
    assert info.value.field == field


def test_a_stage_may_fall_back_at_once_as_a_task_may_and_waits_default_where_unsaid() -> None:
    """`gpu_wait_s: 0` (take the CPU at once when the GPUs are busy) is a task's to ask, and a stage's: it was
    refused, and a 0 would have become the default 10 s."""
    stages = parse_pipelines({"p": {"stages": [{"capability": "a", "gpu_wait_s": 0}, {"capability": "b"}]}})
    first, second = stages["p"].stages
    assert (first.gpu_wait_s, second.gpu_wait_s, second.placement_timeout_s) == (0.0, 10.0, 60.0)


def test_the_config_file_is_validated_as_one_naming_the_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = tmp_path / "turnout.yaml"
    cfg.write_text("prices: {cpu: 0.1}\nlimits: {'*': {max_gpus: 2}}\nescalation:\n  endpoints:\n"
                   "    - {capability: a, kind: runpod, url: 'https://x', api_key_env: NOPE}\n")  # fmt: skip
    with pytest.raises(InvalidInput) as info:
        controller_settings(cfg, environ={})
    assert str(cfg) in info.value.message and "escalation.endpoints.0.api_key_env" in info.value.message
    settings = controller_settings(cfg, environ={"NOPE": "k"})
    assert settings.escalation is not None and settings.escalation.endpoints[0].api_key == "k"


@given(st.sampled_from(list(GpuMode)), st.floats(0, 100))
def test_only_tasks_that_allow_a_gpu_and_waited_after_s_escalate(mode: GpuMode, waited: float) -> None:
    settings = parse_escalation(
        {"after_s": 30, "endpoints": [{"capability": "a", "kind": "http", "url": "http://x"}]}
    )
    got = eligible(mode, waited, settings, "a")
    assert (got is not None) == (mode is not GpuMode.NEVER and waited >= 30)
    assert eligible(mode, waited, settings, "b") is None


@pytest.mark.parametrize("poll_s", [0, 1e-9, 0.049, -1, "fast"])
def test_an_endpoint_is_never_polled_in_a_tight_loop(poll_s: object) -> None:
    endpoint = {"capability": "a", "kind": "runpod", "url": "http://x", "poll_s": poll_s}
    with pytest.raises(InvalidInput) as refused:
        parse_escalation({"endpoints": [endpoint]})
    assert refused.value.field == "escalation.endpoints.0.poll_s" and ">= 0.05" in refused.value.message


def profile(device: str, run_s: float, cold: float | None = None) -> Profile:
    return Profile("embed", device, None, 5, run_s, cold)


@given(st.floats(0.001, 10), st.floats(0.001, 10), st.floats(0, 1000), st.integers(1, 8))
def test_auto_picks_the_class_with_the_earlier_expected_finish(gpu_run: float, cpu_run: float, ahead: float,
                                                               slots: int) -> None:  # fmt: skip
    choice = choose(Side(profile("cpu", cpu_run)), Side(profile("gpu", gpu_run), ahead, slots))
    assert choice is not None
    gpu_finish = ahead / slots + gpu_run
    assert choice.device is (Device.GPU if gpu_finish <= cpu_run else Device.CPU)
    assert choice.reason.startswith("gpu ")


def test_auto_reason_carries_the_numbers() -> None:
    choice = choose(Side(profile("cpu", 2.0)), Side(profile("gpu", 0.2), 41.0, 1))
    assert choice is not None and choice.reason == "gpu queue 41 s + run 0.2 s > cpu run 2 s"
    cold = choose(Side(profile("cpu", 2.0)), Side(profile("gpu", 0.2, cold=5.0), 0.0, 1, warm=False))
    assert cold is not None and cold.device is Device.CPU and "cold start 5 s" in cold.reason


def test_without_history_for_both_classes_auto_defers_to_prefer() -> None:
    assert choose(Side(None), Side(profile("gpu", 0.1))) is None


def test_a_batch_takes_riders_up_to_its_size_and_waits_only_while_short() -> None:
    variant = Variant(
        "embed", Device.GPU, parse_resources({"gpu": 1}), max_batch_size=3, max_batch_wait_ms=100
    )
    book = BatchBook()
    lead = Task("t1", "default", TaskSpec("embed", {}), TaskState.QUEUED, 0.0, queued_at=10.0)
    batch = book.start(lead, Device.GPU, variant, GRANT, 1.0)
    assert batch is not None
    assert batch.wait_left_s(10.05) == pytest.approx(0.05) and book.waiting(10.05) == [batch]
    assert book.waiting(10.2) == []  # its wait is over: leased part full
    for i in (2, 3):
        rider = Task(f"t{i}", "default", TaskSpec("embed", {}), TaskState.QUEUED, 0.0)
        assert book.joinable(rider) is batch
        batch.members.append(rider.id)
    assert batch.full and book.waiting(10.0) == [] and not book.has_room()
    assert book.rider_alloc(batch) == Allocation(
        cpu=0.0, memory=0, gpu_share=1.0, batch="t1", batch_attempt=1
    )


@given(st.lists(st.sampled_from(["acme", "globex", "default"]), min_size=1, max_size=30))
def test_a_batch_never_holds_two_tenants_tasks(owners: list[str]) -> None:
    """One handler call sees every input of its batch: tasks of different tenants never share one."""
    variant = Variant("embed", Device.GPU, parse_resources({"gpu": 1}), max_batch_size=4)
    book = BatchBook()
    tenant_of: dict[str, str] = {}
    for i, owner in enumerate(owners):
        t = Task(f"t{i}", owner, TaskSpec("embed", {}), TaskState.QUEUED, 0.0)
        tenant_of[t.id] = owner
        batch = book.joinable(t)
        if batch is not None:
            batch.members.append(t.id)
        else:
            book.start(t, Device.GPU, variant, GRANT, 1.0)
    for batch in book.open.values():
        assert {tenant_of[m] for m in batch.members} == {batch.leader.tenant}
    # each tenant still batches its own: the first task of each opened a batch of its own
    assert {b.leader.tenant for b in book.open.values()} == set(owners)


def test_a_batchs_grant_is_held_once_and_by_a_rider_once_its_leader_is_gone() -> None:
    from turnout.placement import grant_holders

    def member(tid: str, batch: str | None) -> Task:
        alloc = Allocation(batch=batch) if batch else None
        return Task(tid, "acme", TaskSpec("embed", {}), TaskState.RUNNING, 0.0, gpus=GRANT, alloc=alloc)

    lead, r1, r2, solo = member("t1", "t1"), member("t2", "t1"), member("t3", "t1"), member("t9", None)
    assert [t.id for t in grant_holders([r1, lead, r2, solo])] == ["t1", "t9"]
    # the leader was cancelled or timed out: its riders' process still runs on the GPU, so the grant is held
    assert [t.id for t in grant_holders([r1, r2, solo])] == ["t2", "t9"]
    assert grant_holders([]) == []
