"""`turnout file put|get|delete` and `turnout submit --file NAME=PATH`: files for task inputs and outputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from turnout.client import Client
from turnout.errors import InvalidInput

file_app = typer.Typer(no_args_is_help=True, help="Files for task inputs and outputs.")
out = Console()
err = Console(stderr=True)


def file_flag(flag: str) -> tuple[str, Path]:
    """`--file NAME=PATH` -> (NAME, PATH), the file checked before anything is uploaded."""
    name, sep, path = flag.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise InvalidInput(f"--file: expected NAME=PATH, got {flag!r}", field="file")
    if not Path(path).expanduser().is_file():
        raise InvalidInput(f"--file: {path} is not a readable file", field="file")
    return name.strip(), Path(path).expanduser()


def with_file(data: Any, name: str, file_id: str) -> Any:
    from turnout.files import file_ref, set_field

    return set_field(data, name, file_ref(file_id))


@file_app.command("put")
def file_put(
    path: Path, name: str | None = typer.Option(None, help="Name to record (default: the file's).")
) -> None:
    """Upload a file (streamed); prints {id, size, sha256, ...}. Use {"$file": ID} in a task's input."""
    if not path.is_file():
        raise InvalidInput(f"file put: {path} is not a readable file", field="path")
    with Client() as client:
        body = client.upload(path, name)
    out.print_json(json.dumps(body))


@file_app.command("get")
def file_get(
    file_id: str,
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Where to write it (default: ./ID; - for stdout)."
    ),
) -> None:
    """Download a file (streamed, its sha256 checked)."""
    import tempfile

    with Client() as client:
        if str(output) == "-":
            with tempfile.TemporaryDirectory() as tmp:
                got = client.download(file_id, Path(tmp) / "file")
                with open(got["path"], "rb") as fh:
                    while chunk := fh.read(1024 * 1024):
                        sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()
            return
        got = client.download(file_id, output or Path(file_id))
    err.print(
        f"{got['path']}: {got['size']} bytes, sha256 {got['sha256']} (checked)", markup=False, highlight=False
    )


@file_app.command("delete")
def file_delete(file_id: str) -> None:
    """Delete a file now (files also expire after the controller's file_retention_s)."""
    with Client() as client:
        client.delete_file(file_id)
    out.print(f"{file_id}: deleted")
