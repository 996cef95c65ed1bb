"""Turnout: send every ML and data task to the hardware that suits it.

The public names are `__all__` (guarded by tests/unit/test_public_names.py); everything else is internal.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["AsyncClient", "Client", "Context", "TaskHandle", "WorkerApplication", "__version__"]

_WORKER = ("WorkerApplication", "Context")
_CLIENT = ("Client", "AsyncClient", "TaskHandle")


def __getattr__(name: str) -> object:
    # lazy, so `import turnout` in a handler process does not pull in the HTTP client or FastAPI
    if name in _WORKER:
        from turnout.worker import app

        return getattr(app, name)
    if name in _CLIENT:
        from turnout import client

        return getattr(client, name)
    raise AttributeError(f"module 'turnout' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazy names too, for `dir()` and completion."""
    return sorted({*globals(), *__all__})
