"""A worker app for the file tests: handlers that read input files by path and write output files."""

from __future__ import annotations

import hashlib
import shutil
from typing import Any

from turnout import Context, WorkerApplication

app = WorkerApplication("files")
CHUNK = 1024 * 1024


@app.capability("digest", cpu=0.1)
def digest(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """The sha256 and size of the input file `data["file"]`, read from its local path a megabyte at a time."""
    h = hashlib.sha256()
    size = 0
    with open(ctx.path(data["file"]), "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"sha256": h.hexdigest(), "size": size}


@app.capability("copy", cpu=0.1)
def copy(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """Copies the input file to `<output_dir>/<data["as"]>` and writes a small note beside it."""
    shutil.copyfile(ctx.path(data["file"]), ctx.output_dir / data.get("as", "copy.bin"))
    (ctx.output_dir / "notes").mkdir()
    (ctx.output_dir / "notes" / "done.txt").write_text(f"copied by {ctx.task_id}\n")
    return {"copied": True}


@app.capability("noop", cpu=0.01)
def noop(ctx: Context, data: Any) -> None:
    return None


@app.capability("where", cpu=0.1)
def where(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """Where the input file is read from, and where the output directory lives."""
    return {"path": str(ctx.path(data["file"])), "output_dir_in": str(ctx.output_dir.parent)}


@app.capability("outdir", cpu=0.1)
def outdir(ctx: Context, data: Any) -> dict[str, Any]:
    """Its output directory, whether it was empty, and (given `leave`) a file left in it."""
    empty = not any(ctx.output_dir.iterdir())
    if isinstance(data, dict) and data.get("leave"):
        (ctx.output_dir / "left.txt").write_text(ctx.task_id)
    return {"output_dir": str(ctx.output_dir), "was_empty": empty}
