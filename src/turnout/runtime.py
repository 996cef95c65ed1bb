"""The one place that wires concrete parts: a store, a controller, the API app, a worker agent.

The CLI, the tests and the benchmarks all build Turnout through these functions, so there is one way to
start it. The controller's parts (the API app and FastAPI, the controller, the store) are imported by the
functions that build them: a worker process, which imports this module too, loads none of them (with
`blobs.py` apart from the store, the worker's imports take 0.2 s instead of 0.9 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import httpx

from turnout import logs
from turnout.errors import InvalidInput

if TYPE_CHECKING:
    from turnout.api.service import Service
    from turnout.auth import TokenBook

log = logging.getLogger("turnout")
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def default_home() -> Path:
    return Path(os.environ.get("TURNOUT_HOME") or "~/.turnout").expanduser()


def default_db(home: Path) -> str:
    return os.environ.get("TURNOUT_DB") or f"sqlite:///{home / 'turnout.db'}"


@dataclass
class ControllerParts:
    service: Service
    admin_token: str | None  # set when one was created or read from the home directory
    # where the admin.token that a new token replaced was kept (it may be another database's operator token)
    previous_admin_token: Path | None = None


def build_controller(
    *,
    db: str,
    home: Path,
    config: Path | None = None,
    auth: bool = True,
    host: str = "127.0.0.1",
    heartbeat_s: float = 5.0,
    fresh_admin_token: bool = False,
    limit_flags: Mapping[str, str] | None = None,
    storage: Path | None = None,
) -> ControllerParts:
    from turnout.api.service import Service
    from turnout.auth import TokenBook
    from turnout.config import controller_settings
    from turnout.controller import Controller
    from turnout.store import open_store
    from turnout.store.notify import ReplicaBus
    from turnout.store.replicas import clock_for

    if not auth and host not in LOOPBACK:
        raise InvalidInput(
            f"--no-auth is refused unless the controller listens on loopback only (not {host})",
            field="no-auth",
        )
    files_dir = Path(storage).expanduser() if storage else home / "files"  # task inputs and outputs
    # every path is checked before anything is made: a bad flag leaves no token, directory or database behind
    directory_flag(home, "--home")
    directory_flag(files_dir, "--storage" if storage else "--home")
    settings = controller_settings(
        config, heartbeat_s=heartbeat_s, limit_flags=limit_flags, environ=os.environ, storage_dir=files_dir
    )
    private_dir(home)
    store = open_store(db)
    tokens = TokenBook(store)
    token = previous = None
    if auth:
        token, previous = _admin_token(store, tokens, home, fresh_admin_token)
    # PostgreSQL may be shared by several replicas: they judge time by the database's clock, and wake each
    # other's long polls (store/replicas.py, store/notify.py)
    bus = ReplicaBus(store.url) if store.dialect == "postgresql" else None
    controller = Controller(store, settings, clock=clock_for(store))
    service = Service(controller, tokens, auth=auth, bus=bus, recheck_s=settings.recheck_s)
    return ControllerParts(service, token, previous)


def _admin_token(store: object, tokens: TokenBook, home: Path, fresh: bool) -> tuple[str | None, Path | None]:
    """The operator's token, and where the admin.token it replaced was kept (None: nothing was replaced).

    Reuse the one in $TURNOUT_HOME/admin.token when it is valid here; else make one (if asked, or none exist)
    and write it there. A file already there is never overwritten: its token may be the only copy of another
    database's operator token (only hashes are stored), so it is first kept as `admin.token.<UTC time>`.
    The operator is an admin of every tenant (`"*"`), apart from tenants' admins."""
    from turnout.access import ALL_TENANTS
    from turnout.auth import hash_token, write_admin_token
    from turnout.models import Role

    path = home / "admin.token"
    if path.exists():
        try:
            existing = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            existing = ""  # not a token of ours: kept aside below, never read as one
        row = tokens.store.find_token(hash_token(existing)) if existing else None
        if row and row["revoked_at"] is None and row["role"] == "admin" and row["tenant"] == ALL_TENANTS:
            return existing, None
    if fresh or tokens.store.count_tokens() == 0:
        previous = keep_aside(path) if path.exists() else None
        token_id, token = tokens.create(Role.ADMIN, ALL_TENANTS)
        tokens.store.append_audit([(time.time(), "token_created", None,
                                    {"token": token_id, "role": "admin", "token_tenant": ALL_TENANTS, "by": "turnout"})])  # fmt: skip
        write_admin_token(home, token)
        return token, previous
    return None, None


def keep_aside(path: Path) -> Path:
    """Rename `path` to `<name>.<UTC time>` (`.1`, `.2`, ... after it if taken) and return the new path."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    kept = path.with_name(f"{path.name}.{stamp}")
    n = 0
    while kept.exists():
        n += 1
        kept = path.with_name(f"{path.name}.{stamp}.{n}")
    os.rename(path, kept)  # same directory: the old token is never copied, never half there
    with contextlib.suppress(OSError):
        kept.chmod(0o600)  # a secret: as private as admin.token is
    return kept


def directory_flag(path: Path, flag: str) -> None:
    """`path` (given with `flag`) is a directory, or can be made one: not a regular file, nor under one."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        what = "is" if probe == Path(path) else f"is under {probe}, which is"
        raise InvalidInput(f"{flag}: {path} {what} not a directory", field=flag.lstrip("-"))


def check_tls_files(cert: Path | None, key: Path | None) -> None:
    """`--tls-cert` and `--tls-key`: both or neither, and a PEM certificate and its key that load together,
    checked before the controller makes or prints anything (uvicorn would find out only as it starts)."""
    import ssl

    from turnout.errors import read_user_file

    if cert is None and key is None:
        return
    if cert is None or key is None:
        raise InvalidInput("--tls-cert and --tls-key go together", field="tls-cert")
    read_user_file(cert, "--tls-cert")
    read_user_file(key, "--tls-key")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(cert), str(key))
    except (ssl.SSLError, OSError) as exc:
        raise InvalidInput(f"--tls-cert/--tls-key: {cert} and {key} are not a PEM certificate and its key "
                           f"({exc})", field="tls-cert") from None  # fmt: skip


def listen(host: str, port: int) -> socket.socket:
    """The controller's socket, bound before its database is opened or anything printed: a port another
    process holds is one line naming it, not a controller that says where it serves and then exits."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidInput(f"port: expected a port number 0-65535, got {port!r}", field="port")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a restart reuses its port
    try:
        sock.bind((host, port))
    except (OSError, OverflowError, UnicodeError) as exc:
        sock.close()
        # a name that does not resolve, or an address that is not this machine's, is the host's fault
        if (
            isinstance(exc, socket.gaierror | UnicodeError)
            or getattr(exc, "errno", None) == errno.EADDRNOTAVAIL
        ):
            reason = getattr(exc, "strerror", None) or str(exc)
            raise InvalidInput(f"host: cannot listen on {host}: {reason}", field="host") from None
        taken = getattr(exc, "errno", None) == errno.EADDRINUSE
        reason = "address already in use" if taken else (getattr(exc, "strerror", None) or str(exc))
        raise InvalidInput(f"port: cannot listen on {host}:{port}: {reason}", field="port") from None
    return sock


def serve(
    service: Service,
    sock: socket.socket,
    *,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Run the API on `sock` (`listen`) until SIGINT/SIGTERM, or until `stop` is set (from another thread)."""
    import uvicorn

    from turnout.api.app import create_app

    app = create_app(service)
    # log_config=None: uvicorn's own lines go through the root handler, in the format --log-format chose
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, log_config=None,
                            ssl_certfile=str(tls_cert) if tls_cert else None,
                            ssl_keyfile=str(tls_key) if tls_key else None, timeout_graceful_shutdown=3)  # fmt: skip

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # held connections (worker lifelines, lease long polls) end now instead of holding the graceful
            # shutdown open, and no worker is judged by a connection the controller itself is closing
            service.begin_shutdown()
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if stop is not None and stop.is_set():
                service.begin_shutdown()
                return True
            return await super().on_tick(counter)

    Server(config).run(sockets=[sock])


def private_dir(path: Path) -> None:
    """The state directory, readable by this user only (0700): it holds the database and the admin token.

    An existing directory is tightened only when it is ours and already a Turnout home (from a version that
    made it world-readable); any other is left alone: `--home` may name a directory the user shares.
    """
    directory_flag(path, "--home")
    if not path.exists():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return
    st = path.stat()
    turnout_home = any((path / name).exists() for name in ("turnout.db", "admin.token"))
    if st.st_uid == os.getuid() and st.st_mode & 0o077 and turnout_home:
        path.chmod(0o700)


def wait_healthy(url: str, timeout_s: float = 20.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=1.0, verify=False).status_code == 200:
                return True
        time.sleep(0.05)
    return False


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` on uvloop where it is installed (uvicorn's standard extras bring it, except on Windows), as
    the controller's server runs: a worker agent spends a tenth to a fifth less CPU per task on it than on
    asyncio's own loop (its pipes to the task processes, its connection to the controller)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - installed with uvicorn[standard] wherever it builds
        asyncio.run(main)
        return
    uvloop.run(main)


def run_agent_until_signalled(agent: object) -> None:
    """Run a worker agent until SIGINT/SIGTERM, then drain and leave; a second signal stops its running
    tasks at once instead of waiting out the drain (they go back to the queue as it leaves)."""
    from turnout.worker.agent import Agent

    assert isinstance(agent, Agent)
    logs.set_worker(lambda: agent.worker_id)  # every line this process logs is about this worker

    async def main() -> None:
        stop, stop_now = asyncio.Event(), asyncio.Event()

        def signalled() -> None:
            if stop.is_set():
                log.warning("a second signal: stopping the running tasks now; they go back to the queue")
                stop_now.set()
            elif agent.running:
                log.warning("draining: %d running tasks get %.0f s to finish (a second signal stops them now)",
                            len(agent.running), agent.settings.drain_grace_s)  # fmt: skip
            stop.set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, signalled)
        await agent.run(stop, stop_now)

    run_loop(main())
