"""The worker's own count of its cores (worker/slots.py): jobs leased for the room first, jobs leased ahead
in the order they came, never more CPU held than the worker has (but for one job bigger than the worker,
alone), and a job stopped while it waits gives its turn to the next."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from turnout.worker.slots import Slots


async def _started(slots: Slots, cpu: float, ahead: bool, order: list[str], name: str) -> None:
    await slots.hold(cpu, ahead=ahead)
    order.append(name)


def test_room_goes_to_jobs_leased_for_it_first_then_to_jobs_leased_ahead_in_order() -> None:
    async def scenario() -> list[str]:
        slots, order = Slots(2.0), []
        await slots.hold(1.0, ahead=False)
        await slots.hold(1.0, ahead=False)  # full
        jobs = [asyncio.create_task(_started(slots, 1.0, True, order, name)) for name in ("a1", "a2")]
        await asyncio.sleep(0)
        jobs.append(asyncio.create_task(_started(slots, 1.0, False, order, "room")))  # came last, goes first
        await asyncio.sleep(0)
        assert order == [] and slots.waiting() == 3
        for _ in range(3):
            slots.release(1.0)
            await asyncio.sleep(0)
        await asyncio.gather(*jobs)
        return order

    assert asyncio.run(scenario()) == ["room", "a1", "a2"]


def test_a_job_stopped_while_it_waits_gives_its_turn_to_the_next() -> None:
    async def scenario() -> tuple[list[str], float]:
        slots, order = Slots(1.0), []
        await slots.hold(1.0, ahead=False)
        first = asyncio.create_task(_started(slots, 1.0, True, order, "first"))
        second = asyncio.create_task(_started(slots, 1.0, True, order, "second"))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0)
        slots.release(1.0)
        await second
        return order, slots.used

    assert asyncio.run(scenario()) == (["second"], 1.0)


def test_a_job_granted_then_stopped_before_it_ran_frees_its_room() -> None:
    async def scenario() -> tuple[float, int]:
        slots = Slots(1.0)
        await slots.hold(1.0, ahead=False)
        job = asyncio.create_task(slots.hold(1.0, ahead=True))
        await asyncio.sleep(0)
        slots.release(1.0)  # granted: its wake-up is scheduled, not run
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        return slots.used, slots.waiting()

    assert asyncio.run(scenario()) == (0.0, 0)


def test_a_follower_takes_its_leaders_room_when_it_ends_before_any_job_waiting_for_room() -> None:
    async def scenario() -> tuple[list[str], float]:
        slots, order = Slots(1.0), []
        await slots.hold(0.5, ahead=False)  # the leader
        await slots.hold(0.5, ahead=False)  # another: full
        waiting = asyncio.create_task(_started(slots, 0.5, False, order, "for room"))

        async def follower() -> None:
            await slots.follow("leader", 0.5)
            order.append("follower")

        job = asyncio.create_task(follower())
        await asyncio.sleep(0)
        assert slots.waiting() == 2
        slots.release(0.5, ["other-task"])  # the other job ended: the job waiting for room starts
        await waiting
        slots.release(0.5, ["leader"])  # the leader ended: its follower, and nobody else, takes its room
        await job
        return order, slots.used

    assert asyncio.run(scenario()) == (["for room", "follower"], 1.0)


def test_a_follower_whose_leader_never_hands_its_room_on_waits_for_room_and_one_stopped_frees_nothing() -> (
    None
):
    async def scenario() -> tuple[list[str], float, int]:
        slots, order = Slots(1.0), []
        await slots.hold(1.0, ahead=False)

        async def follower(leader: str, name: str) -> None:
            await slots.follow(leader, 1.0)
            order.append(name)

        kept = asyncio.create_task(follower("chained", "after a chained stage"))
        stopped = asyncio.create_task(follower("leader", "stopped"))
        await asyncio.sleep(0)
        slots.forsake(["chained"])  # its leader's room went to a chained stage: it waits for room instead
        stopped.cancel()
        await asyncio.gather(stopped, return_exceptions=True)
        slots.release(1.0, ["leader"])  # no follower left for it: the room goes to the one waiting
        await kept
        return order, slots.used, slots.waiting()

    assert asyncio.run(scenario()) == (["after a chained stage"], 1.0, 0)


def test_a_job_bigger_than_the_worker_runs_alone_and_a_stage_takes_over_its_parents_room() -> None:
    async def scenario() -> list[float]:
        slots = Slots(1.0)
        await slots.hold(4.0, ahead=False)  # nothing else runs: it may
        seen = [slots.used]
        slots.hand_over(4.0, 0.5)
        seen.append(slots.used)
        slots.release(0.5)
        seen.append(slots.used)
        return seen

    assert asyncio.run(scenario()) == [4.0, 0.5, 0.0]


JOB = st.tuples(st.sampled_from([0.1, 0.25, 0.5, 1.0, 1.5]), st.booleans(), st.integers(0, 3))


@settings(max_examples=60, deadline=None)
@given(capacity=st.sampled_from([0.5, 1.0, 2.0]), jobs=st.lists(JOB, min_size=1, max_size=12),
       cancels=st.sets(st.integers(0, 11)))  # fmt: skip
def test_held_cpu_never_passes_the_workers_but_for_one_job_alone_and_every_job_not_stopped_runs(
    capacity: float, jobs: list[tuple[float, bool, int]], cancels: set[int]
) -> None:
    async def scenario() -> None:
        slots = Slots(capacity)
        running: list[float] = []
        ran: list[int] = []

        async def job(i: int, cpu: float, ahead: bool, steps: int) -> None:
            await slots.hold(cpu, ahead=ahead)
            running.append(cpu)
            try:  # as the agent runs a job: what it holds is released however it ends
                assert sum(running) <= capacity + 1e-9 or len(running) == 1, (running, capacity)
                for _ in range(steps):
                    await asyncio.sleep(0)
                ran.append(i)
            finally:
                running.remove(cpu)
                slots.release(cpu)

        tasks = [asyncio.create_task(job(i, *spec)) for i, spec in enumerate(jobs)]
        await asyncio.sleep(0)
        for i in cancels:
            if i < len(tasks):
                tasks[i].cancel()
        # a job left waiting for ever (room that leaked) fails here, not at the suite's timeout
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=0.5)
        failures = [o for o in outcomes if isinstance(o, Exception)]
        assert not failures, failures
        stopped = {i for i, t in enumerate(tasks) if t.cancelled()}
        assert set(ran) | stopped == set(range(len(jobs)))
        assert slots.used < 1e-9 and slots.waiting() == 0  # every hold was released or given back

    asyncio.run(scenario())
