"""Escalation with two controller replicas on one PostgreSQL database: one replica at a time follows the
endpoints' jobs. A replica that starts while another leads sends nothing again; when the leader dies, the
other takes its jobs over within `LEAD_S` (the reaper leaves tasks an endpoint holds to escalation, so a job
nobody follows would hold its task `running` for ever)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Cluster, Processes
from tests.integration.test_escalation_hostile import Hostile, Reply, hostile_endpoint
from tests.integration.test_pipelines import until
from turnout.escalation import LEAD_S

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def _replica(tmp: Path, processes: Processes, pg_url: str, config: Path) -> Cluster:
    tmp.mkdir(parents=True, exist_ok=True)
    return Cluster(tmp, processes, pg_url, extra_args=["--config", str(config)])


@pytest.mark.timeout(180)
def test_one_replica_follows_each_job_and_another_takes_them_over_when_it_dies(
    pg_url: str, tmp_path: Path, processes: Processes
) -> None:
    state = Hostile()
    answer_now = threading.Event()  # until set, the endpoint holds each call (a long inference)

    def answer(method: str, path: str, body: Any) -> Reply:
        answer_now.wait(timeout=60)
        return Reply(200, {"label": "positive", "seen": body["input"]})

    state.answer = answer
    with hostile_endpoint(state) as url:
        config = tmp_path / "turnout.yaml"
        config.write_text(
            "escalation:\n  after_s: 0\n  endpoints:\n"
            f"    - {{capability: split, kind: http, url: '{url}/plain', poll_s: 0.1, timeout_s: 120}}\n"
        )
        # Given replica A leading escalation, its endpoint holding a task's call
        a = _replica(tmp_path / "a", processes, pg_url, config)
        a.start_controller()
        task_id = a.submit("split", {"n": 1}, gpu="require", placement_timeout_s=120)["id"]
        until(lambda: state.paths("POST"), timeout_s=30, what="the call to reach the endpoint")
        # When replica B starts on the same database
        (tmp_path / "b" / "home").mkdir(parents=True)
        shutil.copy(tmp_path / "a" / "home" / "admin.token", tmp_path / "b" / "home" / "admin.token")
        b = _replica(tmp_path / "b", processes, pg_url, config)
        b.start_controller()
        time.sleep(3 * 1.0)  # three of B's looks at the lead (LEAD_RENEW_S)
        # Then B sent nothing: the call A made is the only one
        assert state.paths("POST") == ["/plain"]
        # When A dies with the call in flight
        a.kill_controller()
        answer_now.set()
        # Then B takes the job over within LEAD_S and the task ends with the endpoint's answer
        started = time.monotonic()
        done = until(lambda: (t := b.api("GET", f"/v1/tasks/{task_id}").json())["state"] == "succeeded" and t,
                     timeout_s=LEAD_S + 30, what="B to take the job over")  # fmt: skip
        assert time.monotonic() - started < LEAD_S + 30
        assert done["output"] == {"label": "positive", "seen": {"n": 1}}
        assert done["device"] == "cloud:http-split"
        assert len(state.paths("POST")) == 2  # A's, cut by its death, and B's: an http call is sent again
