"""The worker's modules import downward only: agent, then presets and executors, then pools, then processes.

Read from the source (no import runs), so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import turnout.worker

WORKER = Path(turnout.worker.__file__).parent
# each module, and the worker modules it must never import (directly): those above it
ABOVE = {
    "processes": {"pools", "executors", "presets", "agent", "client", "handover"},
    "pools": {"executors", "presets", "agent", "client", "handover"},
    "handover": {"executors", "presets", "agent", "client"},
    "presets": {"executors", "agent", "client", "handover"},
    "executors": {"presets", "agent", "client"},
    "client": {"agent", "executors", "presets", "pools", "processes", "handover"},
}


def worker_imports(module: str) -> set[str]:
    tree = ast.parse((WORKER / f"{module}.py").read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "turnout.worker":
                out |= {alias.name for alias in node.names}
            elif node.module.startswith("turnout.worker."):
                out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[2] for a in node.names if a.name.startswith("turnout.worker.")}
    return out


@pytest.mark.parametrize("module", sorted(ABOVE))
def test_a_worker_module_never_imports_one_above_it(module: str) -> None:
    assert worker_imports(module) & ABOVE[module] == set()


def test_the_layers_are_what_the_modules_use() -> None:
    """Guards the guard: the parser sees the imports that are there."""
    assert {"pools", "processes"} <= worker_imports("presets")
    assert {"pools", "processes", "handover"} <= worker_imports("executors")
    assert {"client", "executors", "pools", "handover"} <= worker_imports("agent")


def test_a_worker_process_loads_none_of_the_api_nor_the_database() -> None:
    # What `turnout worker` imports (cli.worker): the runtime and the worker's parts, never FastAPI, the
    # controller or the store (SQLAlchemy); they cost every worker 0.7 s of its start
    import subprocess
    import sys

    code = ("import sys, turnout.cli, turnout.runtime, turnout.worker.agent, turnout.gpu.provider, "
            "turnout.worker.executors, turnout.worker.presets, turnout.worker.sandboxed; "
            "print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn', 'sqlalchemy', 'turnout.api', "
            "'turnout.controller', 'turnout.store') "
            "if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
