"""The public names of `turnout` (DESIGN.md, Python API): exactly these, each resolving to what it says, and
importing `turnout` alone stays light (a handler process imports it; it must not pay for the client or FastAPI).

A name added to or dropped from `__all__` fails here first: the public surface changes only on purpose."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import turnout

PUBLIC = ["AsyncClient", "Client", "Context", "TaskHandle", "WorkerApplication", "__version__"]


def test_all_is_exactly_the_public_names() -> None:
    assert turnout.__all__ == PUBLIC


@pytest.mark.parametrize("name", [n for n in PUBLIC if n != "__version__"])
def test_each_public_name_resolves_to_a_class_of_the_package(name: str) -> None:
    obj = getattr(turnout, name)
    assert inspect.isclass(obj)
    assert obj.__name__ == name
    assert obj.__module__.startswith("turnout.")


def test_the_version_is_a_release_string() -> None:
    major, minor, patch = turnout.__version__.split(".")
    assert all(part.isdigit() for part in (major, minor, patch))


def test_dir_lists_every_public_name_and_an_unknown_name_is_an_attribute_error() -> None:
    assert set(PUBLIC) <= set(dir(turnout))
    with pytest.raises(AttributeError, match="no attribute 'Clinet'"):
        turnout.Clinet  # noqa: B018


def test_importing_turnout_loads_neither_the_http_client_nor_fastapi() -> None:
    code = "import sys, turnout; print(sorted(m for m in ('httpx', 'fastapi', 'sqlalchemy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
