"""A command worker that behaves like a model server: it loads a model (slowly), streams tokens, unloads.

It speaks Turnout's command-worker protocol and needs nothing but the Python standard library, so it runs
as a plain command or in its Docker image alike:

- each task's input is one JSON line on stdin: {"prompt": "...", "tokens": 20, "delay_s": 0.01};
- events go to stdout as JSON lines, flushed: `worker` (status), `progress`, `text_delta`, `text`,
  `result`, and `finish` last; anything on stderr becomes a `log` event;
- env: MODEL_NAME, MODEL_PATH, GPU_DEVICE, CUDA_VISIBLE_DEVICES, TURNOUT_TASK_ID (one-off mode), and
  LOAD_S (how long the simulated load takes, default 1.0) from the preset's env_vars.

In session mode the model is loaded once and serves every line until stdin closes; in one-off mode stdin
closes after the one task, and the worker unloads and exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

LOAD_STEPS = 5


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def load_model(name: str, path: str, load_s: float) -> dict[str, Any]:
    emit("worker", status="initializing", message=f"pid {os.getpid()}, GPUs {os.environ.get('CUDA_VISIBLE_DEVICES') or 'none'}")
    emit("worker", status="loading", message=f"loading {name} from {path}")
    for step in range(1, LOAD_STEPS + 1):
        time.sleep(load_s / LOAD_STEPS)
        emit("progress", done=step, total=LOAD_STEPS)
    print(f"{name} loaded in {load_s:.2f} s", file=sys.stderr, flush=True)
    return {"name": name, "loaded_at": time.time()}


def generate(model: dict[str, Any], task: Any, served: int) -> None:
    if not isinstance(task, dict):
        emit("finish", status="failed", error={"type": "invalid_input", "message": "input must be a JSON object"})
        return
    prompt = str(task.get("prompt", "hello"))
    tokens, delay_s = int(task.get("tokens", 20)), float(task.get("delay_s", 0.01))
    emit("worker", status="working", message=f"generating {tokens} tokens")
    words = prompt.split() or ["hello"]
    pieces = []
    for i in range(tokens):
        piece = f"{words[i % len(words)]} "
        pieces.append(piece)
        emit("text_delta", delta=piece)
        if delay_s:
            time.sleep(delay_s)
    text = "".join(pieces)
    emit("text", content=text)
    emit("result", data={"text": text, "model": model["name"], "pid": os.getpid(), "tasks_served": served,
                         "task_id": os.environ.get("TURNOUT_TASK_ID")})  # fmt: skip
    emit("finish", status="completed")


def main() -> int:
    name = os.environ.get("MODEL_NAME", "loading-worker")
    model = load_model(name, os.environ.get("MODEL_PATH", ""), float(os.environ.get("LOAD_S", "1.0")))
    served = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        served += 1
        try:
            task = json.loads(line)
        except ValueError as exc:
            emit("finish", status="failed", error={"type": "invalid_input", "message": f"not JSON: {exc}"})
            continue
        generate(model, task, served)
    emit("worker", status="cleaning_up", message=f"unloading {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
