"""Run every benchmark that exists, print a summary, write `bench/results/<name>.json`.

    python -m bench [--only NAME[,NAME]] [--quick] [--profile]

A module may accept `quick` (smaller counts) and `profile` keyword arguments and may expose
`summary(result) -> str`; modules without them are run with their defaults (a `seconds` parameter is
shortened under --quick) and summarised by their top-level figures.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import time
import traceback
from typing import Any

from bench.common import RESULTS, exit_on_sigterm

BENCHES = (
    "throughput",
    "gpu_sampling",
    "openb",
    "events",
    "faults",
    "tenants",
    "pipelines",
    "controller",
    "replicas",
    "files",
    "peers",
    "channel",
)
QUICK_SECONDS = 2.0


def _kwargs(run: Any, quick: bool, profile: bool) -> dict[str, Any]:
    params = inspect.signature(run).parameters
    kwargs: dict[str, Any] = {}
    if "quick" in params:
        kwargs["quick"] = quick
    elif quick and "seconds" in params:
        kwargs["seconds"] = QUICK_SECONDS
    if profile and "profile" in params:
        kwargs["profile"] = True
    return kwargs


def _generic_summary(result: dict[str, Any], prefix: str = "  ", depth: int = 0) -> str:
    lines = []
    for key, value in result.items():
        if isinstance(value, dict) and depth < 1:
            lines.append(f"{prefix}{key}:")
            lines.append(_generic_summary(value, prefix + "  ", depth + 1))
        elif isinstance(value, (int, float, str, bool)) or value is None:
            lines.append(f"{prefix}{key}: {value}")
    return "\n".join(line for line in lines if line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--only", help=f"comma-separated names among {', '.join(BENCHES)}")
    parser.add_argument("--quick", action="store_true", help="smaller counts, for a smoke run")
    parser.add_argument(
        "--profile", action="store_true", help="py-spy the processes under test, where supported"
    )
    args = parser.parse_args(argv)
    exit_on_sigterm()
    names = BENCHES
    if args.only:
        names = tuple(n.strip().removeprefix("bench_") for n in args.only.split(",") if n.strip())
        unknown = [n for n in names if n not in BENCHES]
        if unknown:
            parser.error(f"unknown bench {', '.join(unknown)}; choose from {', '.join(BENCHES)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    failed = False
    for name in names:
        try:
            module = importlib.import_module(f"bench.bench_{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"bench.bench_{name}":
                print(f"== {name}: skipped (bench/bench_{name}.py does not exist yet)")
                continue
            print(f"== {name}: skipped (cannot import: {exc})")
            failed = True
            continue
        print(f"== {name}: running ...", flush=True)
        started = time.perf_counter()
        try:
            result = module.run(**_kwargs(module.run, args.quick, args.profile))
        except Exception:
            print(f"== {name}: FAILED\n{traceback.format_exc()}")
            failed = True
            continue
        path = RESULTS / f"{name}.json"
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        text = module.summary(result) if hasattr(module, "summary") else _generic_summary(result)
        print(
            f"== {name} ({time.perf_counter() - started:.1f} s) -> {path.relative_to(RESULTS.parent.parent)}"
        )
        print(text, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
