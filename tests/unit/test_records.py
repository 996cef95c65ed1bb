"""The typed records a task row decodes into (`Routing`, `Allocation`, `GpuGrant`): each is stored as the JSON
object it always was, and reads back as written."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from turnout.gpu.allocation import GpuGrant
from turnout.models import Allocation, Routing

names = st.text("abcdef-0123456789", min_size=1, max_size=12)
maybe_name = st.none() | names
error = st.none() | st.fixed_dictionaries({"type": names, "message": st.text(max_size=20)})
routings = st.builds(Routing, requested=maybe_name, device=maybe_name, reason=st.none() | st.text(max_size=40),
                     avoid_gpus=st.lists(names, max_size=3).map(tuple), last_error=error,
                     undelivered=st.integers(0, 10), cloud=maybe_name, cloud_job=maybe_name)  # fmt: skip
allocations = st.builds(Allocation, cpu=st.floats(0, 64, allow_nan=False), memory=st.integers(0, 2**40),
                        gpu_share=st.none() | st.floats(0.01, 1.0), batch=maybe_name,
                        batch_attempt=st.none() | st.integers(1, 9))  # fmt: skip
grants = st.builds(GpuGrant, uuids=st.lists(names, min_size=1, max_size=4).map(tuple),
                   indices=st.lists(st.integers(0, 7), min_size=1, max_size=4).map(tuple),
                   memory_bytes=st.integers(0, 2**40), exclusive=st.booleans(), model=names, mig=st.booleans(),
                   unit_memory_bytes=st.none() | st.integers(1, 2**40))  # fmt: skip


@given(routings)
def test_a_routing_reads_back_as_written_through_json(routing: Routing) -> None:
    assert Routing.from_dict(json.loads(json.dumps(routing.to_dict()))) == routing


@given(allocations)
def test_an_allocation_reads_back_as_written_through_json(alloc: Allocation) -> None:
    assert Allocation.from_dict(json.loads(json.dumps(alloc.to_dict()))) == alloc


@given(grants)
def test_a_grant_reads_back_as_written_through_json(grant: GpuGrant) -> None:
    assert GpuGrant.from_dict(json.loads(json.dumps(grant.to_dict()))) == grant


def test_rows_written_before_the_records_read_as_they_meant() -> None:
    # Given JSON objects as the controller stored them as dicts (a lease's routing, a requeue's, a rider's
    # allocation, a grant with its unit's memory)
    assert Routing.from_dict({"requested": "prefer", "device": "gpu", "reason": "gpu available"}) == Routing(
        requested="prefer", device="gpu", reason="gpu available"
    )
    requeued = {
        "avoid_gpus": ["GPU-1"],
        "last_error": {"type": "gpu_oom"},
        "undelivered": 1,
        "requested": "auto",
    }
    assert Routing.from_dict(requeued) == Routing(
        requested="auto", avoid_gpus=("GPU-1",), last_error={"type": "gpu_oom"}, undelivered=1
    )
    rider = {"cpu": 0.0, "memory": 0, "batch": "t_1", "batch_attempt": 2, "gpu_share": 0.5}
    assert Allocation.from_dict(rider) == Allocation(gpu_share=0.5, batch="t_1", batch_attempt=2)
    grant = {"uuids": ["G"], "indices": [0], "memory_bytes": 8, "exclusive": True, "model": "M", "mig": False,
             "unit_memory_bytes": None}  # fmt: skip
    assert GpuGrant.from_dict(grant) == GpuGrant(("G",), (0,), 8, True, "M", False)
    # And what they mean is stored as it was: only the keys that are set
    assert Routing(requested="prefer", device="cpu", reason="r").to_dict() == {
        "requested": "prefer", "device": "cpu", "reason": "r"
    }  # fmt: skip
    assert Routing.from_dict(None) is None and Allocation.from_dict(None) is None


def test_a_new_lease_carries_on_the_history_and_nothing_else() -> None:
    old = Routing(requested="auto", device="gpu", reason="r", avoid_gpus=("G",), last_error={"type": "gpu_oom"},
                  undelivered=1, cloud="rp", cloud_job="j")  # fmt: skip
    assert old.carried() == Routing(avoid_gpus=("G",), last_error={"type": "gpu_oom"}, undelivered=1)
