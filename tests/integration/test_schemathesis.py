"""Schemathesis over the whole OpenAPI document of a real controller: whatever a client sends, no 5xx.

Every operation gets a small, derandomized batch of generated requests, valid and invalid, sent with the
admin token to a controller subprocess on a real SQLite file, beside a real worker. A 5xx is a bug: the
request was bad (a 4xx naming the field) or the server must cope.

(Driven through `operation.as_strategy()` rather than the pytest plugin's lazy fixture, which does not run
under pytest 9.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.conftest import Cluster

APP = "tests.apps.testapp:app"
EXAMPLES_PER_OPERATION = 50  # about 30 operations: the whole run stays well under a minute
BOUNDED = settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,  # the same requests every run: a bounded, repeatable check
    database=None,
    phases=[Phase.explicit, Phase.generate],  # a failure shows the request as found; shrinking costs minutes
    suppress_health_check=list(HealthCheck),
)


@dataclass(frozen=True)
class Targets:
    """Real ids the fuzzer uses half the time, so requests reach past the 404 of an unknown id."""

    cluster: Cluster
    worker_id: str  # registered over HTTP only: leasing, reporting or draining it disturbs no real worker
    worker_secret: str  # what its registration answered: worker routes for it get past the 403
    task_id: str  # cancelled, so its event stream ends at once


@pytest.fixture(scope="module")
def targets(shared_cluster: Cluster) -> Targets:
    shared_cluster.start_worker(APP, name="fuzz-worker")
    body = {"name": "fuzz-target", "host": "nowhere", "cpu": 1, "memory": 2**30,
            "variants": [{"capability": "count", "device": "cpu", "resources": {"cpu": 1}}]}  # fmt: skip
    registered = shared_cluster.api("POST", "/v1/workers/register", json=body).json()
    task_id = shared_cluster.submit("count", {"n": 1}, placement_timeout_s=600, priority=-1000)["id"]
    shared_cluster.api("POST", f"/v1/tasks/{task_id}/cancel")
    return Targets(shared_cluster, registered["id"], registered["secret"], task_id)


def _steer(case: Any, targets: Targets, real: bool) -> None:
    """Long polls answer at once (the run is about answers, not waiting up to an hour for one); when `real`,
    ids and capabilities are ones the controller knows."""
    if isinstance(case.query, dict) and "wait" in case.query:
        case.query["wait"] = 0
    if isinstance(case.body, dict) and case.path.endswith("/lease"):
        case.body["wait_s"] = 0  # its default is a 20 s long poll
    if not real or case.path.endswith("/lifeline"):  # a live worker's lifeline is an answer that never ends
        return
    path = case.path_parameters or {}
    if "worker_id" in path:
        path["worker_id"] = targets.worker_id
        kept = {k: v for k, v in (case.headers or {}).items() if k.lower() != "x-worker-secret"}
        case.headers = {**kept, "X-Worker-Secret": targets.worker_secret}
    if "task_id" in path:
        path["task_id"] = targets.task_id
    if isinstance(case.body, dict):
        tasks = case.body.get("tasks") if isinstance(case.body.get("tasks"), list) else [case.body]
        for task in tasks:
            if isinstance(task, dict) and isinstance(task.get("capability"), str):
                task["capability"] = "count"


@pytest.mark.slow
def test_no_request_makes_the_controller_answer_5xx(targets: Targets) -> None:
    api = targets.cluster
    headers = {"Authorization": f"Bearer {api.token}"}
    schema = schemathesis.openapi.from_url(
        f"{api.url}/openapi.json", headers=headers
    )  # the docs need a token
    failures: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1
        cases = st.one_of(
            operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)
        )

        @BOUNDED
        @given(case=cases, real=st.booleans())
        def fuzz(case: Any, real: bool) -> None:
            _steer(case, targets, real)
            try:
                response = case.call(base_url=api.url, headers=headers, timeout=30)
                case.validate_response(response, checks=[not_a_server_error])
            except Exception as exc:  # kept as found: Hypothesis may report only that it was flaky
                failures.append(f"{case.operation.label}: {exc!r}\n{case.as_curl_command(headers=headers)}")
                raise

        try:
            fuzz()
        except Exception:  # one operation's 5xx must not hide another's: report them all
            if not failures or not failures[-1].startswith(operation.label):
                failures.append(f"{operation.label}: failed (see above)")
    assert operations >= 20, "the OpenAPI document lost its operations"
    assert not failures, "\n\n".join(failures)
