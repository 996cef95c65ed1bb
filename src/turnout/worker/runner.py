"""The warm Python process: loads the app once, runs `setup`, then serves tasks one at a time.

It speaks the command-worker protocol (DESIGN.md, "Command workers"): one JSON task per line on stdin,
JSON events on its protocol stream, `finish` last. So the worker runs Python handlers and command
workers with the same process code. Anything the handler prints goes to stderr and becomes `log`
events; the protocol stream is a private duplicate of the original stdout.

    python -m turnout.worker.runner MODULE:APP CAPABILITY DEVICE PARENT_PID LIFELINE_FD
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import Any

from turnout.worker import lifeline


def _error(exc: BaseException) -> dict[str, Any]:
    text = f"{type(exc).__name__}: {exc}"
    oom = "out of memory" in text.lower() and (
        "cuda" in text.lower() or type(exc).__name__ == "OutOfMemoryError"
    )
    return {
        "type": "gpu_oom" if oom else "handler_error",
        "message": text,
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:],
    }


def _limit_torch_memory() -> None:
    """Hand a shared-GPU task's memory limit to torch, if the handler uses torch and a GPU is visible."""
    fraction = os.environ.get("TURNOUT_GPU_MEMORY_FRACTION")
    if not fraction or "torch" not in sys.modules:
        return
    torch = sys.modules["torch"]
    try:
        if torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(float(fraction), 0)
    except Exception as exc:  # a CPU build or no device: nothing to limit
        print(f"turnout: could not set torch memory fraction: {exc}", file=sys.stderr)


def main(argv: list[str]) -> int:
    app_ref, capability, device, parent_pid, lifeline_fd = argv
    lifeline.arm(int(parent_pid))
    lifeline.watch_fd(int(lifeline_fd))
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # print() in handlers lands on stderr -> log events
    sys.stdout = sys.stderr
    lock = threading.Lock()

    def send(obj: dict[str, Any]) -> None:
        line = json.dumps(obj, default=str)
        with lock:
            proto.write(line + "\n")
            proto.flush()

    from turnout.worker.app import Context, load_app

    try:
        app = load_app(app_ref)
        hv = app.variants[f"{capability}:{device}"]
        torch_device = "cuda:0" if device == "gpu" and os.environ.get("CUDA_VISIBLE_DEVICES") else "cpu"
        if app.setup_fn is not None:
            send(
                {"event": "worker", "status": "loading", "message": f"setup of {app.name} on {torch_device}"}
            )
            app.setup_fn(torch_device)
            _limit_torch_memory()
    except Exception as exc:
        send({"event": "finish", "status": "failed", "error": {**_error(exc), "type": "setup_failed"}})
        return 3
    for line in sys.stdin:
        if not line.strip():
            continue
        task = json.loads(line)
        ctx = Context(task_id=task.get("task_id", ""), attempt=task.get("attempt", 1), device=torch_device,
                      gpus=task.get("gpus", []), sink=proto, lock=lock)  # fmt: skip
        started = time.time()
        try:
            result = hv.handler(ctx, task.get("input"))
            send({"event": "result", "data": result})
            send({"event": "finish", "status": "completed", "run_s": time.time() - started})
        except BaseException as exc:  # a handler's failure is its task's failure, never the process's
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                send({"event": "finish", "status": "failed", "error": _error(exc)})
                return 1
            send(
                {"event": "finish", "status": "failed", "error": _error(exc), "run_s": time.time() - started}
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
