"""The warm Python process: loads the app once, runs `setup`, then serves tasks one at a time.

It speaks the command-worker protocol (DESIGN.md, "Command workers"): one JSON task per line on stdin,
JSON events on its protocol stream, `finish` last. So the worker runs Python handlers and command
workers with the same process code. Anything the handler prints goes to stderr and becomes `log`
events; the protocol stream is a private duplicate of the original stdout.

The protocol stream is strict JSON: a result JSON cannot carry (NaN, Infinity, a lone surrogate, a set,
bytes, an object of some class) is never stringified or written as `NaN`; its task fails `invalid_output`
naming the path (`output.scores.2`), and the process serves the next task.

    python -m turnout.worker.runner MODULE:APP CAPABILITY DEVICE PARENT_PID LIFELINE_FD
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import resource
import sys
import threading
import time
import traceback
from typing import Any

from turnout.jsonsafe import problem
from turnout.worker import lifeline
from turnout.worker.reports import TASK_TAG, InvalidOutput, invalid_output, readable


def _error(exc: BaseException) -> dict[str, Any]:
    """The task's error for a handler's exception: text only, made printable, so it always reaches the user."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:  # an exception whose __str__ raises still fails its task, not the process
        text = f"{type(exc).__name__}: (its message could not be read)"
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]
    except Exception:
        tb = ""
    oom = "out of memory" in text.lower() and (
        "cuda" in text.lower() or type(exc).__name__ == "OutOfMemoryError"
    )
    return {
        "type": "gpu_oom" if oom else "handler_error",
        "message": readable(text, 100_000),
        "traceback": readable(tb, 8000),
    }


def encode(event: dict[str, Any]) -> str:
    """One strict JSON line; raises ValueError (NaN, a lone surrogate, a huge int) or TypeError (no JSON form)."""
    return json.dumps(event, allow_nan=False)


def result_lines(result: Any, run_s: float, facts: dict[str, Any] | None = None, *, tag: int | None = None,
                 items: int | None = None) -> list[str]:  # fmt: skip
    """The `result` and `finish` lines of a handler's return value, or a failed `finish` saying what JSON
    cannot carry and where. Checked before anything is written, so the stream never holds half a report.

    `tag`: the task's number, written first in each line. `items`: a batch's size; a list of that many
    outputs is checked item by item, and an item JSON cannot carry fails only its own task: its place in
    `data` is null and `item_errors` holds its error (the path is the task's own, `output.score`)."""
    head: dict[str, Any] = {TASK_TAG: tag} if tag is not None else {}
    finish = {**head, "event": "finish", "status": "completed", "run_s": run_s, **(facts or {})}
    try:
        if items is not None and isinstance(result, list) and len(result) == items:
            wheres = [problem(item, "output") for item in result]
            if any(wheres):
                errors = [invalid_output(*where) if where else None for where in wheres]
                data = [None if where else item for item, where in zip(result, wheres, strict=True)]
                return [
                    encode({**head, "event": "result", "data": data, "item_errors": errors}),
                    encode(finish),
                ]
        where = problem(result, "output")
        if where is not None:
            error = invalid_output(*where)
        else:
            return [encode({**head, "event": "result", "data": result}), encode(finish)]
    except (ValueError, TypeError, RecursionError) as exc:  # e.g. an int longer than Python will print
        error = invalid_output("output", f"cannot be written as JSON: {type(exc).__name__}: {exc}")
    return [
        encode(
            {**head, "event": "finish", "status": "failed", "error": error, "run_s": run_s, **(facts or {})}
        )
    ]


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


class _LimitOnTorchImport(importlib.abc.MetaPathFinder):
    """Applies the memory limit the moment torch finishes importing, wherever the handler imports it.

    A handler without `setup` that imports torch inside its first call would otherwise run that call, and
    every later one, with the whole GPU's memory: the share would hold only on paper.
    """

    def find_spec(
        self, name: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once, and out of the way of the finders that really find torch
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            _limit_torch_memory()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def limit_gpu_memory() -> None:
    """Limit torch now if it is loaded, else as soon as it is (no-op without a shared-GPU limit)."""
    if not os.environ.get("TURNOUT_GPU_MEMORY_FRACTION"):
        return
    if "torch" in sys.modules:
        _limit_torch_memory()
    elif not any(isinstance(f, _LimitOnTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _LimitOnTorchImport())


def _torch_cuda() -> Any:
    """torch.cuda where the handler imported torch and a GPU is visible; else None (nothing to measure)."""
    torch = sys.modules.get("torch")
    try:
        return torch.cuda if torch is not None and torch.cuda.is_available() else None
    except Exception:
        return None


def _reset_gpu_peak() -> None:
    cuda = _torch_cuda()
    if cuda is not None:
        try:
            cuda.reset_peak_memory_stats()
        except Exception as exc:
            print(f"turnout: could not reset torch's peak memory: {exc}", file=sys.stderr)


def _peaks() -> dict[str, int]:
    """This process's peak RAM so far, and torch's peak GPU allocation during the task: for profiles."""
    out = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    cuda = _torch_cuda()
    if cuda is not None:
        try:
            out["peak_gpu_memory_bytes"] = int(cuda.max_memory_allocated())
        except Exception as exc:
            print(f"turnout: could not read torch's peak memory: {exc}", file=sys.stderr)
    return out


def main(argv: list[str]) -> int:
    app_ref, capability, device, parent_pid, lifeline_fd = argv
    lifeline.arm(int(parent_pid))
    lifeline.watch_fd(int(lifeline_fd))
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # print() in handlers lands on stderr -> log events
    sys.stdout = sys.stderr
    lock = threading.Lock()

    def write(*lines: str) -> None:
        """Lines written together: a task's result and finish reach the worker in one write, one wake-up."""
        with lock:
            proto.write("".join(f"{line}\n" for line in lines))
            proto.flush()

    def send(obj: dict[str, Any], tag: int | None = 0) -> None:
        """One line of the task numbered `tag` (0: setup, before the first task)."""
        write(encode({TASK_TAG: tag, **obj} if tag is not None else obj))

    from turnout.worker.app import BatchContext, Context, load_app

    try:
        app = load_app(app_ref)
        hv = app.variants[f"{capability}:{device}"]
        torch_device = "cuda:0" if device == "gpu" and os.environ.get("CUDA_VISIBLE_DEVICES") else "cpu"
        limit_gpu_memory()  # before setup: a model loaded there counts against the task's share too
        if app.setup_fn is not None:
            send(
                {"event": "worker", "status": "loading", "message": f"setup of {app.name} on {torch_device}"}
            )
            app.setup_fn(torch_device)
        if hv.setup is not None:
            send(
                {
                    "event": "worker",
                    "status": "loading",
                    "message": f"setup of {capability} on {torch_device}",
                }
            )
            hv.setup(torch_device)
    except Exception as exc:
        send({"event": "finish", "status": "failed", "error": {**_error(exc), "type": "setup_failed"}})
        return 3
    ready_at: float | None = time.time()  # said once, with the first task's finish: the cold start ends here
    batched = hv.variant.max_batch_size > 1
    for line in sys.stdin:
        if not line.strip():
            continue
        task = json.loads(line)
        # the worker numbers its tasks; each line of this task says its number, so none is taken for another's
        tag = task.get(TASK_TAG)
        tag = tag if type(tag) is int else None
        items = task["batch"] if batched and isinstance(task.get("batch"), list) else [task]
        head = items[0]
        ctx: Context = (BatchContext if batched else Context)(
            task_id=head.get("task_id", ""), attempt=head.get("attempt", 1), device=torch_device,
            gpus=head.get("gpus", []), sink=proto, lock=lock, tag=tag,
            # a batch's handler reads every input's files; only a single task collects an output directory
            files={k: v for i in items for k, v in (i.get("files") or {}).items()},
            output_dir=None if batched else head.get("output_dir"),
        )  # fmt: skip
        if isinstance(ctx, BatchContext):
            ctx.task_ids = [str(i.get("task_id", "")) for i in items]
        facts: dict[str, Any] = {"ready_at": ready_at} if ready_at is not None else {}
        ready_at = None
        _reset_gpu_peak()
        started = time.time()
        try:
            data = [i.get("input") for i in items] if batched else head.get("input")
            result = hv.handler(ctx, data)
            ctx._end()  # what its threads emit from now on is dropped: it would be read as no task's
            facts.update(_peaks())
            write(*result_lines(result, time.time() - started, facts, tag=tag,
                                items=len(items) if batched else None))  # fmt: skip
        except (
            InvalidOutput
        ) as exc:  # an event JSON cannot carry: refused at ctx.emit, before any was written
            ctx._end()
            facts.update(_peaks())
            error = invalid_output(exc.path, exc.why)
            send(
                {
                    "event": "finish",
                    "status": "failed",
                    "error": error,
                    "run_s": time.time() - started,
                    **facts,
                },
                tag,
            )
        except BaseException as exc:  # a handler's failure is its task's failure, never the process's
            ctx._end()
            facts.update(_peaks())
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                send({"event": "finish", "status": "failed", "error": _error(exc), **facts}, tag)
                return 1
            send({"event": "finish", "status": "failed", "error": _error(exc), "run_s": time.time() - started,
                  **facts}, tag)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
