"""`turnout demo`: a controller, a CPU worker and a fake-GPU worker in this process, the classify pipeline run on
sample texts, then where each stage ran and what it cost against running it all on a GPU. Exits 0 when every
run succeeded and every text got the sentiment it reads as.

Everything listens on loopback only (a free port, no tokens) and lives in a temporary directory that is removed
at the end. The handlers run in the workers' own warm processes, as under `turnout up`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from turnout.cli_runs import saving_line, usd

SAMPLES: tuple[tuple[str, str], ...] = (
    ("The food was amazing and the staff were friendly. I would gladly come back!", "positive"),
    ("Absolutely loved the film. The acting was superb and the ending made me smile.", "positive"),
    ("Great battery life, a bright screen, and it arrived a day early. Very happy.", "positive"),
    ("The hotel room was spotless and the view was breathtaking.", "positive"),
    ("Thank you for the quick help, the support team was wonderful.", "positive"),
    ("A delightful book, warm and funny from the first page to the last.", "positive"),
    ("The service was slow and the soup was cold. The waiter was rude to us.", "negative"),
    ("Worst purchase I have ever made. It broke after two days.", "negative"),
    ("The flight was delayed for hours and nobody told us anything. Awful.", "negative"),
    ("I am disappointed: the update deleted my files and support never answered.", "negative"),
    ("The movie was boring and far too long. I regret paying for it.", "negative"),
    ("Terrible noise all night, a dirty bathroom, and a rude manager.", "negative"),
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(out: Console, err: Console) -> int:
    """Start everything, run the pipeline on SAMPLES, print routing and cost; 0 when all went as it should."""
    import uvicorn

    from turnout.api.app import create_app
    from turnout.client import Client
    from turnout.demo import CONFIG
    from turnout.runtime import build_controller, wait_healthy
    from turnout.worker.agent import Agent, AgentSettings
    from turnout.worker.app import load_app
    from turnout.worker.executors import python_runnables

    logging.getLogger("turnout").setLevel(logging.ERROR)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="turnout-demo-") as tmp:
        home = Path(tmp)
        parts = build_controller(db=f"sqlite:///{home / 'turnout.db'}", home=home, config=CONFIG, auth=False,
                                 heartbeat_s=1.0)  # fmt: skip
        server = uvicorn.Server(uvicorn.Config(create_app(parts.service), host="127.0.0.1", port=port,
                                               log_level="error", access_log=False, log_config=None))  # fmt: skip
        api = threading.Thread(target=server.run, name="turnout-demo-api", daemon=True)
        api.start()
        stop: dict[str, Callable[[], None]] = {}
        workers = threading.Thread(target=_run_workers, args=(url, stop, Agent, AgentSettings, python_runnables, load_app),
                                   name="turnout-demo-workers", daemon=True)  # fmt: skip
        try:
            if not wait_healthy(url):
                err.print("the demo controller did not start")
                return 1
            workers.start()
            with Client(url, None) as client:
                return _demo(client, out, err)
        finally:
            if "stop" in stop:
                stop["stop"]()
            workers.join(timeout=40)
            server.should_exit = True
            api.join(timeout=10)


def _run_workers(url: str, stop: dict[str, Callable[[], None]], agent_cls: Any, settings_cls: Any,
                 runnables: Any, load_app: Any) -> None:  # fmt: skip
    """A CPU worker and a worker with one fake A100, as two agents on one event loop in this thread."""

    async def main() -> None:
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        stop["stop"] = lambda: (loop.call_soon_threadsafe(done.set), None)[1]
        app = load_app("turnout.demo:app")
        agents = [
            agent_cls(settings_cls(controller_url=url, token=None, name="cpu-worker", gpus="none", cpus=2,
                                   heartbeat_s=1.0, drain_grace_s=5), runnables("turnout.demo:app", app, {})),
            agent_cls(settings_cls(controller_url=url, token=None, name="gpu-worker", gpus="fake:1xA100-40Gi",
                                   cpus=2, heartbeat_s=1.0, drain_grace_s=5), runnables("turnout.demo:app", app, {})),
        ]  # fmt: skip
        await asyncio.gather(*(a.run(done) for a in agents))

    asyncio.run(main())


def _demo(client: Any, out: Console, err: Console) -> int:
    import time

    deadline = time.monotonic() + 60
    while len([w for w in client.workers() if w["state"] == "healthy"]) < 2:
        if time.monotonic() > deadline:
            err.print("the demo workers did not register")
            return 1
        time.sleep(0.1)
    out.print(
        "[bold]Turnout demo[/bold]: a controller, a CPU worker and a worker with one (fake) A100, in this process"
    )
    out.print(f"classify pipeline on {len(SAMPLES)} texts: preprocess_text (CPU) -> classify_text "
              "(all-MiniLM-L6-v2, GPU preferred, batched) -> postprocess_results (CPU)")  # fmt: skip
    runs = [client.run_pipeline("classify", {"text": text}) for text, _ in SAMPLES]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err) as bar:  # fmt: skip
        job = bar.add_task("runs finished", total=len(runs))
        finished: dict[str, dict[str, Any]] = {}
        while len(finished) < len(runs):
            for r in runs:
                if r["id"] not in finished:
                    got = client.pipeline_run(r["id"], wait=0.2)
                    if got["state"] != "running":
                        finished[r["id"]] = got
            bar.update(job, completed=len(finished))
    done = [finished[r["id"]] for r in runs]
    out.print(_results_table(done))
    out.print(_routing_table(done))
    out.print(_cost_table(done))
    total = {
        "cost_usd": sum(r["cost_usd"] or 0 for r in done),
        "gpu_only_cost_usd": sum(r["gpu_only_cost_usd"] or 0 for r in done),
    }
    out.print(saving_line(total), markup=False, highlight=False)
    right = sum(
        1
        for r, (_, want) in zip(done, SAMPLES, strict=True)
        if r["state"] == "succeeded" and r["output"]["label"] == want
    )
    out.print(f"{right} of {len(SAMPLES)} texts classified as they read")
    ok = all(r["state"] == "succeeded" for r in done) and right == len(SAMPLES)
    if not ok:
        for r in done:
            if r["state"] != "succeeded":
                err.print(f"run {r['id']} {r['state']}: {(r['error'] or {}).get('message')}", markup=False)
    return 0 if ok else 1


def _results_table(done: list[dict[str, Any]]) -> Table:
    table = Table(title="results", title_justify="left")
    for col in ("text", "expected", "summary"):
        table.add_column(col)
    for r, (text, want) in zip(done, SAMPLES, strict=True):
        summary = (r["output"] or {}).get("summary") or r["state"]
        table.add_row(text[:56] + ("..." if len(text) > 56 else ""), want, summary)
    return table


def _routing_table(done: list[dict[str, Any]]) -> Table:
    """Where each stage ran and why, over all runs."""
    table = Table(title="routing", title_justify="left")
    for col in ("stage", "device", "runs", "why", "batch sizes"):
        table.add_column(col)
    seen: dict[tuple[str, str, str], list[int]] = {}
    for r in done:
        for st in r["stages"]:
            key = (st["capability"], st["device"] or "-", (st["reason"] or "").split("; batched with")[0])
            seen.setdefault(key, []).append(st.get("batch_size") or 1)
    for (cap, device, why), sizes in seen.items():
        table.add_row(cap, device, str(len(sizes)), why, ", ".join(str(s) for s in sorted(set(sizes))))
    return table


def _cost_table(done: list[dict[str, Any]]) -> Table:
    """Per stage over all runs: seconds and cost, against the same seconds on the GPU."""
    table = Table(title="cost of all runs", title_justify="left")
    for col in ("stage", "device", "cold start s", "run s", "cost", "on the GPU"):
        table.add_column(col, justify="left" if col in ("stage", "device") else "right")
    rows: dict[str, dict[str, Any]] = {}
    for r in done:
        gpu_price = _gpu_price(r)
        for st in r["stages"]:
            row = rows.setdefault(
                st["capability"], {"device": set(), "cold": 0.0, "run": 0.0, "cost": 0.0, "gpu": 0.0}
            )
            row["device"].add(st["device"] or "-")
            row["cold"] += st["cold_start_s"] or 0.0
            row["run"] += st["run_s"] or 0.0
            row["cost"] += st["cost_usd"] or 0.0
            seconds = (st["cold_start_s"] or 0.0) + (st["run_s"] or 0.0)
            row["gpu"] += (st["cost_usd"] or 0.0) if st["device"] == "gpu" else seconds * gpu_price
    for cap, row in rows.items():
        table.add_row(cap, ", ".join(sorted(row["device"])), f"{row['cold']:.3f}", f"{row['run']:.3f}", usd(row["cost"]),
                      usd(row["gpu"]))  # fmt: skip
    table.add_row("total", "", "", "", usd(sum(r["cost_usd"] or 0 for r in done)),
                  usd(sum(r["gpu_only_cost_usd"] or 0 for r in done)), style="bold")  # fmt: skip
    return table


def _gpu_price(run: dict[str, Any]) -> float:
    """The per-second GPU price this run's gpu_only total used, recovered from its CPU stages."""
    cpu = [st for st in run["stages"] if st["device"] != "gpu" and st["run_s"] is not None]
    seconds = sum((st["cold_start_s"] or 0.0) + st["run_s"] for st in cpu)
    gpu_stage = sum(st["cost_usd"] or 0.0 for st in run["stages"] if st["device"] == "gpu")
    if not seconds or run["gpu_only_cost_usd"] is None:
        return 0.0
    return float((run["gpu_only_cost_usd"] - gpu_stage) / seconds)
