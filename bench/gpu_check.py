"""What only a real NVIDIA GPU can show, checked on one: run on a host with a GPU, never in the suite.

    python -m bench.gpu_check OUTDIR [--quick] [--no-model]

1. discovery: the NVML and nvidia-smi providers find the same GPUs (UUID, name, memory, compute capability,
   minor number), each takes a sample (timed: the worker takes one per heartbeat), and NVML says whether it took
   an Xid event set. The nvidia-smi outputs the provider parsed are saved to OUTDIR for the parser tests.
2. canary and scrub: the torch canary passes on a healthy device; the builtin scrub overwrites the free memory
   and gives it all back (memory used before and after, from NVML).
3. a cluster on the GPU (a controller on SQLite with the demo's turnout.yaml, one worker `--gpus auto
   --scrub-command builtin` serving the demo app, `bench.gpu_app` and sandboxed presets):
   - an exclusive task sees one device on cuda, its own; its worker scrubbed the GPU first (audited);
   - a shared task (`gpu_memory: 4Gi`) whose handler imports torch in its call allocates 2 GiB, and fails
     `gpu_oom` at 6 GiB instead of taking the GPU;
   - the demo's classify pipeline runs its middle stage on cuda;
   - a sandboxed command preset holding the GPU runs torch on cuda inside bubblewrap and sees only its nodes;
     a sandboxed CPU preset sees no /dev/nvidia* at all;
   - /metrics carries the GPU's allocated and used memory.
4. `bench_pipelines --gpu`: warm against cold, batched against unbatched, on cuda.

Every step records what it saw in OUTDIR/gpu_check.json, and a step that fails records why; the others go on.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench.common import Processes, TurnoutCluster, exit_on_sigterm

PROBE = textwrap.dedent("""
    import json, os, sys
    for line in sys.stdin:
        out = {"nvidia": sorted(n for n in os.listdir("/dev") if n.startswith("nvidia")),
               "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "pids": len([p for p in os.listdir("/proc") if p.isdigit()])}
        try:
            import torch
            out["cuda"] = torch.cuda.is_available()
            if out["cuda"]:
                x = torch.ones(1024, 1024, device="cuda")
                out["sum"] = float((x @ x).sum().item())
                out["name"] = torch.cuda.get_device_name(0)
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"[:500]
        print(json.dumps({"event": "result", "data": out}), flush=True)
        print(json.dumps({"event": "finish", "status": "completed"}), flush=True)
""")


def step(results: dict[str, Any], name: str, fn: Callable[[], Any], outdir: Path) -> None:
    """Run one check, keep what it saw or why it failed, and write everything so far (a killed run keeps it)."""
    started = time.monotonic()
    try:
        results[name] = fn()
    except Exception:
        results[name] = {"error": traceback.format_exc()[-3000:]}
    results[name + "_s"] = round(time.monotonic() - started, 2)
    (outdir / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    print(
        f"== {name} ({results[name + '_s']} s)\n{json.dumps(results[name], indent=1, default=str)[:4000]}",
        flush=True,
    )


def discovery(out: Path) -> dict[str, Any]:
    from turnout.gpu import smi
    from turnout.gpu.nvml import NvmlProvider

    nvml = NvmlProvider()
    nv_devices = nvml.devices()
    started = time.perf_counter()
    nv_sample = nvml.metrics()
    nvml_sample_ms = (time.perf_counter() - started) * 1000
    xid_events = nvml._events is not None

    seen: list[tuple[list[str], str]] = []

    def recording(argv: Any, timeout_s: float = 15.0) -> str:
        text = smi.run_command(argv, timeout_s)
        seen.append((list(argv), text))
        return text

    smi_provider = smi.SmiProvider(run=recording)
    smi_devices = smi_provider.devices()
    started = time.perf_counter()
    smi_sample = smi_provider.metrics()
    smi_sample_ms = (time.perf_counter() - started) * 1000
    for i, (argv, text) in enumerate(seen[:4]):
        (out / f"smi-{i}.txt").write_text(" ".join(argv) + "\n" + text)
    keys = ("uuid", "name", "memory_total_bytes", "compute_capability", "minor", "pci_bus_id", "driver_version",
            "mig_mode")  # fmt: skip
    pairs = [
        {k: (getattr(a, k), getattr(b, k)) for k in keys if getattr(a, k) != getattr(b, k)}
        for a, b in zip(nv_devices, smi_devices, strict=False)
    ]
    nvml.close()
    return {"nvml_devices": [asdict(d) for d in nv_devices], "smi_devices": [asdict(d) for d in smi_devices],
            "nvml_vs_smi_differences": pairs, "nvml_sample": [asdict(m) for m in nv_sample],
            "smi_sample": [asdict(m) for m in smi_sample], "nvml_sample_ms": round(nvml_sample_ms, 2),
            "smi_sample_ms": round(smi_sample_ms, 1), "xid_event_set": xid_events,
            "smi_commands": [" ".join(a) for a, _ in seen]}  # fmt: skip


def canary_and_scrub() -> dict[str, Any]:
    import asyncio

    from turnout.gpu.health import run_canary
    from turnout.gpu.nvml import NvmlProvider
    from turnout.worker.scrub import BUILTIN, run_scrub

    nvml = NvmlProvider()
    uuid = nvml.devices()[0].uuid

    def used() -> int | None:
        return next(m.memory_used_bytes for m in nvml.metrics() if m.uuid == uuid)

    started = time.monotonic()
    canary = run_canary(uuid)
    canary_s = time.monotonic() - started
    before = used()
    scrub = asyncio.run(run_scrub(BUILTIN, uuid))
    after = used()
    nvml.close()
    return {"canary_passed": canary, "canary_s": round(canary_s, 2), "scrub_ok": scrub.ok,
            "scrub_message": scrub.message, "scrub_s": round(scrub.seconds, 2), "used_before": before,
            "used_after": after}  # fmt: skip


def _task(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    task = http.post("/v1/tasks", json=body).json()
    if "id" not in task:
        return task
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        task = http.get(f"/v1/tasks/{task['id']}/result", params={"wait": 30}).json()
        if task["state"] in ("succeeded", "failed", "cancelled"):
            break
    return {k: task.get(k) for k in ("state", "device", "routing", "allocation", "output", "error", "attempt",
                                     "run_s", "cold_start_s", "worker_id")}  # fmt: skip


def cluster(tmp: Path) -> dict[str, Any]:
    procs = Processes()
    (tmp / "probe.py").write_text(PROBE)
    cmd = [sys.executable, str(tmp / "probe.py")]
    presets = {"models": {
        "sandbox-gpu": {"inference": {"command": cmd, "resources": {"gpu": 1}, "isolation": "sandbox"}},
        "sandbox-cpu": {"inference": {"command": cmd, "isolation": "sandbox"}},
    }}  # fmt: skip
    (tmp / "presets.yaml").write_text(json.dumps(presets))
    config = Path(__file__).parents[1] / "src" / "turnout" / "demo.yaml"
    c = TurnoutCluster(tmp, procs, heartbeat_s=1.0, controller_args=["--config", str(config)])
    out: dict[str, Any] = {}
    try:
        c.start_controller()
        c.start_worker("turnout.demo:app", "gpu-box", timeout_s=120,
                       extra=["bench.gpu_app:app", "--gpus", "auto", "--scrub-command", "builtin",
                              "--presets", str(tmp / "presets.yaml"), "-v"])  # fmt: skip
        http = httpx.Client(base_url=c.url, headers=c.headers, timeout=200)
        worker = http.get("/v1/workers").json()["workers"][0]
        out["worker_gpus"] = worker.get("gpus")
        out["exclusive"] = _task(http, {"capability": "cuda_probe", "input": {}, "gpu": "require"})
        out["scrub_audit"] = http.get("/v1/audit", params={"kind": "gpu_scrubbed"}).json()
        out["share_2gib"] = _task(http, {"capability": "cuda_share", "input": {"gib": 2}, "gpu": "require"})
        out["share_6gib"] = _task(http, {"capability": "cuda_share", "input": {"gib": 6}, "gpu": "require"})
        run = http.post("/v1/pipelines/classify/runs", params={"wait": 170},
                        json={"input": {"text": "The staff were friendly and the food was great."}}).json()  # fmt: skip
        out["pipeline"] = {"state": run.get("state"), "output": run.get("output"),
                           "stages": [{k: s.get(k) for k in ("capability", "device", "gpu_model", "run_s",
                                                              "cold_start_s", "cost_usd")} for s in run.get("stages", [])],
                           "cost_usd": run.get("cost_usd"), "gpu_only_cost_usd": run.get("gpu_only_cost_usd")}  # fmt: skip
        out["sandbox_gpu"] = _task(http, {"capability": "sandbox-gpu", "input": {}, "gpu": "require"})
        out["sandbox_cpu"] = _task(http, {"capability": "sandbox-cpu", "input": {}, "gpu": "never"})
        metrics = http.get("/metrics").text
        out["metrics_gpu_lines"] = [
            ln for ln in metrics.splitlines() if "gpu" in ln and not ln.startswith("#")
        ][:40]
        caps = http.get("/v1/capabilities").json()
        out["capabilities"] = [
            c for c in caps.get("capabilities", []) if c.get("name") in ("classify_text", "cuda_share")
        ]
        out["audit_kinds"] = sorted({r.get("kind") for r in http.get("/v1/audit").json().get("audit", [])})
    finally:
        out["worker_log_tail"] = c.log_tail("worker-gpu-box", 4000)
        procs.stop_all()
    return out


def main(argv: list[str]) -> int:
    paths = [a for a in argv if not a.startswith("--")]
    outdir = Path(paths[0] if paths else "gpu-check")
    outdir.mkdir(parents=True, exist_ok=True)
    exit_on_sigterm()
    results: dict[str, Any] = {}
    step(results, "discovery", lambda: discovery(outdir), outdir)
    step(results, "canary_and_scrub", canary_and_scrub, outdir)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        step(results, "cluster", lambda: cluster(Path(tmp)), outdir)
    from bench import bench_pipelines

    if "--no-model" in argv:  # the model bench is the longest part: leave it out of a quick re-check
        return 0
    step(results, "model_on_gpu", lambda: bench_pipelines.run(quick="--quick" in argv, gpu=True), outdir)
    with contextlib.suppress(Exception):
        results["model_summary"] = bench_pipelines.summary(results["model_on_gpu"])
    (outdir / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
