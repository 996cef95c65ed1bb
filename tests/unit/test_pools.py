"""`max_processes` is applied, not only validated: a pool never holds more live processes than its cap, however
many tasks want one at once, and the pools built for a Python app and for a session preset carry the cap
their declaration names. Processes here are counted stand-ins (no child is spawned), so the count is exact."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from turnout.worker.app import WorkerApplication
from turnout.worker.executors import python_runnables
from turnout.worker.pools import ProcessPool
from turnout.worker.presets import preset_runnables
from turnout.worker.processes import EventSink, Outcome, ProtocolProcess


class Tally:
    """How many counted processes are alive now, and at most so far."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.started = 0

    def up(self) -> None:
        self.live += 1
        self.started += 1
        self.peak = max(self.peak, self.live)

    def down(self) -> None:
        self.live -= 1


class Counted(ProtocolProcess):
    """A process that is alive from `start` until killed or closed, and answers each line after a yield."""

    def __init__(self, tally: Tally) -> None:
        super().__init__([], {})
        self.tally = tally
        self.up = False

    @property
    def alive(self) -> bool:
        return self.up

    async def start(self) -> None:
        await asyncio.sleep(0)  # a start takes a while: others may ask for a process meanwhile
        self.up = True
        self.tally.up()

    async def run(self, task_line: str, sink: EventSink, timeout_s: float | None) -> Outcome:
        await asyncio.sleep(0.001)
        return Outcome(True, output=json.loads(task_line))

    def kill(self) -> None:
        if self.up:
            self.up = False
            self.tally.down()

    async def close(self) -> None:
        self.kill()


async def serve_at_once(pool: ProcessPool, tasks: int, keys: int = 1) -> list[Any]:
    """`tasks` tasks that each take a process, run one line on it and give it back, all at once; GPU keys
    alternate among `keys` (a process started for other GPUs cannot serve them)."""

    async def one(i: int) -> Any:
        key = (str(i % keys),) if keys > 1 else ()
        proc = await pool.acquire(key, f"t{i}")
        try:
            outcome = await proc.run(json.dumps(i), lambda _event: None, None)
        finally:
            pool.release(proc, key, reusable=True)
        return outcome.output

    try:
        return await asyncio.gather(*(one(i) for i in range(tasks)))
    finally:
        await pool.close()


def test_a_pool_runs_no_more_processes_than_max_processes_while_six_tasks_want_one() -> None:
    tally = Tally()
    pool = ProcessPool(lambda key: Counted(tally), max_processes=2)
    outputs = asyncio.run(serve_at_once(pool, 6))
    assert outputs == list(range(6))  # every task ran, in its turn
    assert tally.peak == 2 and tally.live == 0


def test_without_a_cap_the_pool_grows_to_what_the_tasks_need() -> None:
    tally = Tally()
    asyncio.run(serve_at_once(ProcessPool(lambda key: Counted(tally)), 6))
    assert tally.peak == 6


@settings(max_examples=40, deadline=None)
@given(cap=st.integers(1, 4), tasks=st.integers(1, 12), keys=st.integers(1, 3))
def test_the_cap_holds_for_any_number_of_tasks_and_gpu_keys(cap: int, tasks: int, keys: int) -> None:
    tally = Tally()
    pool = ProcessPool(lambda key: Counted(tally), max_processes=cap)
    assert asyncio.run(serve_at_once(pool, tasks, keys)) == list(range(tasks))
    assert tally.peak <= cap and tally.live == 0


def test_a_python_apps_max_processes_caps_the_pool_its_variant_runs_in() -> None:
    app = WorkerApplication("capped")

    @app.capability("echo", cpu=0.1, max_processes=2)
    def echo(x: Any) -> Any:
        return x

    (runnable,) = python_runnables("tests.apps.none:app", app, {})
    tally = Tally()
    runnable.pool.factory = lambda key: Counted(tally)  # the pool as built, with counted processes
    asyncio.run(serve_at_once(runnable.pool, 5))
    assert tally.peak == 2


def test_a_session_presets_max_processes_caps_the_pool_its_model_runs_in(tmp_path: Path) -> None:
    doc = {"models": {"m": {"inference": {"command": ["x"], "mode": "session", "max_processes": 3}}}}
    path = tmp_path / "presets.yaml"
    path.write_text(json.dumps(doc))
    (runnable,) = preset_runnables(path, {}, models_dir=tmp_path, engine_answers=lambda: False)
    tally = Tally()
    runnable.pool.factory = lambda key: Counted(tally)
    asyncio.run(serve_at_once(runnable.pool, 8))
    assert tally.peak == 3
