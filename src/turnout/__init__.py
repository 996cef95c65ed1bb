"""Turnout: send every ML and data task to the hardware that suits it."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["AsyncClient", "Client", "Context", "TaskHandle", "WorkerApplication", "__version__"]


def __getattr__(name: str) -> object:
    # lazy, so `import turnout` in a handler process does not pull in the HTTP client or FastAPI
    if name in ("WorkerApplication", "Context"):
        from turnout.worker import app

        return getattr(app, name)
    if name in ("Client", "AsyncClient", "TaskHandle"):
        from turnout import client

        return getattr(client, name)
    raise AttributeError(name)
