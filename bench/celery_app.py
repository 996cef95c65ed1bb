"""The Celery yardstick: a no-op task, Redis as broker and result backend (db 15 unless told otherwise).

Started by `bench_throughput` as `celery -A bench.celery_app worker ...`; the URL comes from
`BENCH_CELERY_REDIS` so the bench and its workers agree. Settings are Celery's defaults except where
a Celery user running a benchmark would change them, and each is noted.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from bench.common import log_run

REDIS_URL = os.environ.get("BENCH_CELERY_REDIS", "redis://127.0.0.1:6379/15")

app = Celery("turnout_bench", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    result_expires=600,  # keep db 15 small between runs
    worker_hijack_root_logger=False,
    # Defaults kept on purpose: prefetch multiplier 4, early ack, no result compression.
)


@app.task(name="bench.noop")
def noop(data: object = None) -> None:
    return None


@app.task(name="bench.sleep", bind=True)
def sleep_logged(self: object, data: dict) -> dict:
    """The fault bench's task: the same work and run log as `bench/fault_app.py`'s `sleep`."""
    task_id = self.request.id  # type: ignore[attr-defined]
    log_run(data["log"], "start", task_id)
    time.sleep(float(data["seconds"]))
    log_run(data["log"], "end", task_id)
    return {"n": data.get("n")}
