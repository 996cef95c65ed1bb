"""Chained pipeline stages as pure decisions: which stages may follow on the same worker (`chain_route`), and
what the worker may send while a stage it started waits for the controller (`ChainBook`)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnout.models import Device, GpuMode
from turnout.pipelines import chain_route
from turnout.routing import ClusterView
from turnout.worker.chains import ChainBook, chained_lease, reorder

GPU_SOMEWHERE = ClusterView(gpu_possible=True, cpu_possible=True)
NO_GPU = ClusterView(gpu_possible=False, cpu_possible=True)


@pytest.mark.parametrize(
    "mode,gpu_wait_s,cluster,chained",
    [
        (GpuMode.NEVER, 10.0, GPU_SOMEWHERE, True),  # a CPU stage, whatever the fleet has
        (GpuMode.NEVER, 10.0, NO_GPU, True),
        (GpuMode.PREFER, 10.0, NO_GPU, True),  # falls back to the CPU anyway: no GPU worker could run it
        (GpuMode.PREFER, 10.0, GPU_SOMEWHERE, False),  # a GPU worker may take it: it is queued for one
        (GpuMode.PREFER, 0.0, GPU_SOMEWHERE, True),  # waits 0 s for a GPU: any CPU takes it at once
        (GpuMode.AUTO, 10.0, NO_GPU, True),
        (GpuMode.AUTO, 0.0, GPU_SOMEWHERE, False),  # `auto` weighs the queues, which the chain cannot see
        (GpuMode.REQUIRE, 10.0, GPU_SOMEWHERE, False),  # a GPU stage is never chained
        (GpuMode.REQUIRE, 10.0, NO_GPU, False),
    ],
)
def test_a_stage_is_chained_only_where_routing_would_send_it_to_a_cpu_whatever_is_queued(
    mode: GpuMode, gpu_wait_s: float, cluster: ClusterView, chained: bool
) -> None:
    decided = chain_route(mode, gpu_wait_s, True, cluster)
    assert (decided is not None) is chained
    if decided is not None:
        assert decided.device is Device.CPU and decided.reason


@pytest.mark.parametrize("mode", list(GpuMode))
def test_a_stage_the_worker_has_no_room_or_variant_for_is_never_chained(mode: GpuMode) -> None:
    assert chain_route(mode, 0.0, False, NO_GPU) is None


def lease(**fields: Any) -> dict[str, Any]:
    base = {"id": "t_parent", "capability": "clean", "input": {"text": "hi"}, "tenant": "acme",
            "chain": [{"stage": 1, "capability": "count", "timeout_s": 5.0, "labels": {"stage": "1"}},
                      {"stage": 2, "capability": "report", "timeout_s": None, "labels": {"stage": "2"}}]}  # fmt: skip
    return {**base, **fields}


def test_the_chained_stage_gets_the_input_the_controller_would_queue_for_it() -> None:
    child = chained_lease(lease(), {"words": ["hi"], "n": 1}, {"cpu": 0.5})
    assert child is not None
    assert child["input"] == {"text": "hi", "words": ["hi"], "n": 1}
    assert (child["capability"], child["device"], child["attempt"], child["tenant"]) == (
        "count",
        "cpu",
        1,
        "acme",
    )
    assert child["timeout_s"] == 5.0 and child["resources"] == {"cpu": 0.5} and child["gpus"] is None
    assert [s["stage"] for s in child["chain"]] == [2]  # the rest of the chain goes on with it
    assert child["id"].startswith("t_") and len(child["id"]) == 26


def test_a_chained_stage_sees_its_parents_output_as_json_carries_it() -> None:
    child = chained_lease(
        lease(), {"pair": (1, 2)}, {"cpu": 1}
    )  # a tuple arrives at the controller as a list
    assert child is not None and child["input"]["pair"] == [1, 2]
    not_an_object = chained_lease(lease(), [1, 2], {"cpu": 1})  # kept under the stage's capability name
    assert not_an_object is not None and not_an_object["input"]["clean"] == [1, 2]


def test_a_lease_without_a_chain_starts_nothing() -> None:
    assert chained_lease(lease(chain=[]), {}, {"cpu": 1}) is None
    assert chained_lease(lease(input=[1]), {}, {"cpu": 1}) is None


def test_an_answer_confirms_the_chain_it_names_and_refuses_the_others_with_what_they_chained() -> None:
    book = ChainBook()
    book.start("a", "b")
    book.start("b", "c")  # c followed b before b was confirmed
    book.start("x", "y")

    confirmed, refused = book.settle({"accepted": ["a", "x"], "refused": [], "chained": ["b"]})

    assert confirmed == ["b"] and refused == ["y"]
    assert not book.unconfirmed("b") and book.unconfirmed("c")  # c waits for b's own result to be answered
    confirmed, refused = book.settle({"accepted": [], "refused": ["b"]})  # b's result refused: so is c
    assert (confirmed, refused) == ([], ["c"]) and book.dropped == {"y", "c"}


def test_a_controller_that_knows_no_chains_refuses_them_all() -> None:
    book = ChainBook()
    book.start("a", "b")
    book.start("b", "c")
    assert book.settle({"accepted": ["a"], "refused": []}) == ([], ["b", "c"])


def completion(task_id: str) -> dict[str, Any]:
    return {"task_id": task_id, "attempt": 1, "status": "succeeded"}


def test_an_unconfirmed_stages_result_goes_right_behind_its_parents_and_only_without_events() -> None:
    book = ChainBook()
    book.start("a", "b")
    book.start("p", "q")
    results = [completion("a"), completion("b"), completion("q"), completion("z")]
    events = [
        {"task_id": "q", "attempt": 1, "event": {"event": "log"}},
        {"task_id": "z", "attempt": 1, "event": {}},
    ]

    going, sent_events = book.sendable(results, events)

    assert going == [0, 1, 3]  # q: its parent's result is not in this report, and it has an event waiting
    assert sent_events == [1]  # q's events wait until q exists there


ids = st.sampled_from(["a", "b", "c", "d", "e", "f"])


@given(pairs=st.lists(st.tuples(ids, ids), max_size=6), order=st.lists(ids, max_size=8, unique=True),
       with_events=st.sets(ids))  # fmt: skip
def test_nothing_unconfirmed_is_ever_sent_ahead_of_its_parent(
    pairs: list[tuple[str, str]], order: list[str], with_events: set[str]
) -> None:
    book = ChainBook()
    for parent, child in pairs:
        if parent != child and child not in book.parent_of and parent not in book.child_of:
            book.start(parent, child)
    results = [completion(t) for t in order]
    events = [{"task_id": t, "attempt": 1, "event": {}} for t in sorted(with_events)]

    going, sent_events = book.sendable(results, events)

    sent = [order[i] for i in going]
    assert going == sorted(going)  # order kept
    for i, task_id in enumerate(sent):
        parent = book.parent_of.get(task_id)
        if parent is not None:
            assert parent in sent[:i] and task_id not in with_events
    assert all(not book.unconfirmed(events[i]["task_id"]) for i in sent_events)
    assert all(book.unconfirmed(t) or t in sent for t in order)  # whatever is confirmed goes at once


@given(items=st.lists(ids, max_size=10), first=st.sets(st.integers(0, 9)), drop=st.sets(ids))
def test_reorder_puts_the_chosen_first_in_order_and_leaves_out_the_dropped(
    items: list[str], first: set[int], drop: set[str]
) -> None:
    listed = [{"task_id": t, "n": i} for i, t in enumerate(items)]
    chosen = sorted(i for i in first if i < len(items))
    count = reorder(listed, chosen, drop)
    kept = [i for i, t in enumerate(items) if t not in drop]
    assert [it["n"] for it in listed[:count]] == [i for i in chosen if i in kept]
    assert [it["n"] for it in listed[count:]] == [i for i in kept if i not in chosen]
