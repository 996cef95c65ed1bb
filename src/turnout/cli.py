"""`turnout`: the command line. Thin: parse flags, call runtime/client, render with rich."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.console import Console
from rich.table import Column, Table

from turnout.cli_files import file_app, file_flag, with_file
from turnout.config import DEFAULT_PORT, parse_limit_flags
from turnout.errors import InvalidInput, TurnoutError, read_user_file

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Send every ML and data task to the hardware that suits it.",
)
token_app = typer.Typer(no_args_is_help=True, help="Make, list and revoke API tokens (admin).")
app.add_typer(token_app, name="token")
app.add_typer(file_app, name="file")  # turnout file put|get|delete (cli_files.py)
out = Console()
err = Console(stderr=True)
ID_WIDTH = 26  # `t_` and 24 hex digits (`models.new_id`)


def main() -> None:
    """Run the CLI; any error is one line on stderr with its fix, and exit code 2, never a traceback."""
    from turnout.cli_output import error_line, fix_for

    try:
        app()
    except TurnoutError as exc:
        _die(error_line(exc.message, fix_for(exc)))
    except httpx.InvalidURL as exc:  # not an HTTPError: a URL httpx cannot parse
        _die(error_line(f"url: {exc}", fix_for(InvalidInput("", field="url"))))
    except httpx.HTTPError as exc:
        _die(error_line(f"the controller connection failed: {exc or type(exc).__name__}",
                        "check TURNOUT_URL, then `turnout doctor`"))  # fmt: skip
    except KeyboardInterrupt:
        sys.exit(130)
    except OSError as exc:
        _die(error_line(str(exc), "check the path and its permissions"))
    except Exception as exc:  # a bug of ours: still one line, with what to report
        _die(
            error_line(
                f"unexpected {type(exc).__name__}: {exc}", "please report this with the command you ran"
            )
        )


@app.callback()
def _options(
    ca_cert: Path | None = typer.Option(
        None,
        "--ca-cert",
        envvar="TURNOUT_CA_CERT",
        help="PEM of a private CA that signed the controller's certificate.",
    ),
) -> None:
    """Send every ML and data task to the hardware that suits it."""
    if ca_cert is not None:  # read by every client this process makes (turnout.client.default_ca_cert)
        os.environ["TURNOUT_CA_CERT"] = str(ca_cert)


def _die(line: str) -> None:
    err.print(line, markup=False, highlight=False, soft_wrap=True)
    sys.exit(2)


def _home(home: Path | None) -> Path:
    from turnout.runtime import default_home

    return Path(home).expanduser() if home else default_home()


def _logging(verbose: bool = False, log_format: str = "text") -> None:
    from turnout import logs

    logs.configure(log_format, verbose=verbose)


LOG_FORMAT_HELP = "Log lines as text or json; lines about a task or worker carry its id."
DB_HELP = (
    "sqlite:///PATH, postgresql://... or memory:// (tests and demos: nothing survives a restart); "
    "default $TURNOUT_DB or $TURNOUT_HOME/turnout.db."
)


# ---- servers ---------------------------------------------------------------------------------------


@app.command()
def up(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(DEFAULT_PORT, help="Port to listen on."),
    home: Path | None = typer.Option(None, help="State directory (default $TURNOUT_HOME or ~/.turnout)."),
    db: str | None = typer.Option(None, help=DB_HELP),
    gpus: str = typer.Option("auto", help="GPUs of the local worker: auto, none, 0,2 or fake:SPEC."),
    app_ref: list[str] = typer.Option(
        [], "--app", help="MODULE:APP served by the local worker (default: the demo app)."
    ),
    presets: Path | None = typer.Option(None, help="Model presets file served by the local worker."),
    config: Path | None = typer.Option(None, help="turnout.yaml: prices, pipelines, limits, escalation."),
    no_auth: bool = typer.Option(False, "--no-auth", help="No tokens (loopback only)."),
    storage: Path | None = typer.Option(
        None, "--storage", help="Directory for files (task inputs and outputs); default $TURNOUT_HOME/files."
    ),
    request_limit: list[str] = typer.Option(
        [], "--request-limit", help="NAME=VALUE, repeatable: a request size limit, e.g. max_body_bytes=16Mi."
    ),
    log_format: str = typer.Option("text", "--log-format", help=LOG_FORMAT_HELP),
    verbose: bool = typer.Option(False, "-v", "--verbose"),
) -> None:
    """Controller on embedded SQLite plus one local worker, at http://127.0.0.1:8750."""
    from turnout.runtime import build_controller, default_db, listen, serve, wait_healthy

    _logging(verbose, log_format)
    _check_local_worker(app_ref, gpus, presets)  # before anything listens, is made or printed
    sock = listen(host, port)
    state = _home(home)
    if config is None and not app_ref:  # the demo app's prices and classify pipeline (src/turnout/demo.yaml)
        from turnout.demo import CONFIG as config
    db = db or default_db(state)
    parts = build_controller(db=db, home=state, config=config, auth=not no_auth, host=host,
                             fresh_admin_token=True, limit_flags=parse_limit_flags(request_limit),
                             storage=storage)  # fmt: skip
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    where = "in memory: nothing survives a restart" if db.startswith("memory://") else f"in {state}"
    out.print(f"[bold]Turnout[/bold] controller at {url}  (state {where})", soft_wrap=True)
    if parts.admin_token:
        out.print(
            f"admin token: {parts.admin_token}\n  (saved to {state / 'admin.token'}; the CLI and SDK find it there)",
            soft_wrap=True,
        )
    _previous_token_line(parts.previous_admin_token)
    worker_cmd = [sys.executable, "-m", "turnout.cli", "worker", *(app_ref or ["turnout.demo:app"]), "--controller", url,
                  "--gpus", gpus, "--name", "local", "--log-format", log_format, *(["-v"] if verbose else [])]  # fmt: skip
    if presets:
        worker_cmd += ["--presets", str(presets)]
    env = {**os.environ, "TURNOUT_HOME": str(state)}
    if parts.admin_token:
        env["TURNOUT_TOKEN"] = parts.admin_token
    worker: dict[str, subprocess.Popen[bytes]] = {}
    failed: list[int] = []
    stop = threading.Event()

    def start_worker() -> None:
        if not wait_healthy(url):
            return
        before = _local_workers(url, parts.admin_token)
        proc = worker["p"] = subprocess.Popen(worker_cmd, env=env)
        if _registered(url, parts.admin_token, before, proc):
            out.print(f'local worker started (gpus={gpus}); try:  turnout submit shout --input \'{{"text": "hi"}}\' '
                      "--wait", soft_wrap=True)  # fmt: skip
        elif proc.returncode is not None:  # it died as it started: up stops too, rather than serve no worker
            failed.append(proc.returncode)
            err.print(f"error: the local worker exited with code {proc.returncode} as it started; its error is "
                      "above (fix: check --app, --gpus and --presets)", markup=False, highlight=False, soft_wrap=True)  # fmt: skip
            stop.set()  # the server shuts down as on Ctrl-C, and up exits 2 below

    threading.Thread(target=start_worker, daemon=True).start()
    try:
        serve(parts.service, sock, stop=stop)
    finally:
        if "p" in worker:
            worker["p"].send_signal(signal.SIGTERM)
            try:
                worker["p"].wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker["p"].kill()
    if failed:
        raise typer.Exit(2)


def _check_local_worker(app_refs: list[str], gpus: str, presets: Path | None) -> None:
    """What `up`'s local worker would refuse as it starts, refused by `up` itself: a `--gpus` spec that is not
    one, a `--presets` file that does not load, a `--app` module that cannot be found (not imported here)."""
    import importlib.util

    from turnout.gpu.provider import discover

    if gpus.strip().lower() != "auto" and not gpus.replace(",", "").strip().isdigit():
        discover(gpus)  # none and fake:SPEC are quick; anything else that is not a spec raises
    if presets is not None:
        from turnout.worker.presets import load_presets

        load_presets(presets)
    for ref in app_refs:
        module, sep, attr = ref.partition(":")
        if not sep or not module or not attr:
            raise InvalidInput(f"--app: expected MODULE:APP, got {ref!r}", field="app")
        sys.path.insert(0, os.getcwd())  # where the worker looks too
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        finally:
            sys.path.pop(0)
        if found is None:
            raise InvalidInput(f"--app: no module named {module!r} (from {ref!r}) on the Python path or in the "
                               "current directory", field="app")  # fmt: skip


def _local_workers(url: str, token: str | None) -> set[str] | None:
    """Ids of the workers named `local` now; None where the controller cannot be asked."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.get(f"{url}/v1/workers", headers=headers, timeout=5.0)
        return {w["id"] for w in resp.json()["workers"] if w.get("name") == "local"}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def _registered(url: str, token: str | None, before: set[str] | None, proc: subprocess.Popen[bytes]) -> bool:
    """Wait until `proc` registers as a new worker named `local` (True) or exits (False)."""
    import time

    while proc.poll() is None:
        now = _local_workers(url, token)
        if now is None or before is None or now - before:
            return proc.poll() is None
        time.sleep(0.1)
    return False


def _previous_token_line(kept: Path | None) -> None:
    if kept is not None:
        err.print(f"note: the admin.token that was there is not valid for this database; it was kept as {kept} "
                  "(it may be another database's operator token)", markup=False, highlight=False, soft_wrap=True)  # fmt: skip


@app.command()
def controller(
    db: str | None = typer.Option(None, help=DB_HELP),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(DEFAULT_PORT),
    home: Path | None = typer.Option(None),
    config: Path | None = typer.Option(None),
    no_auth: bool = typer.Option(False, "--no-auth"),
    tls_cert: Path | None = typer.Option(None, help="PEM certificate for HTTPS."),
    tls_key: Path | None = typer.Option(None, help="PEM key for HTTPS."),
    heartbeat_s: float = typer.Option(5.0, help="Default worker heartbeat period."),
    storage: Path | None = typer.Option(
        None,
        "--storage",
        help="Directory for files (task inputs and outputs); default $TURNOUT_HOME/files; replicas share one.",
    ),
    request_limit: list[str] = typer.Option(
        [], "--request-limit", help="NAME=VALUE, repeatable: a request size limit, e.g. max_body_bytes=16Mi."
    ),
    log_format: str = typer.Option("text", "--log-format", help=LOG_FORMAT_HELP),
    verbose: bool = typer.Option(False, "-v", "--verbose"),
) -> None:
    """The controller only (state in SQLite or PostgreSQL)."""
    from turnout.runtime import build_controller, check_tls_files, default_db, listen, serve

    _logging(verbose, log_format)
    check_tls_files(tls_cert, tls_key)  # before anything listens, is made or printed
    sock = listen(host, port)
    state = _home(home)
    parts = build_controller(db=db or default_db(state), home=state, config=config, auth=not no_auth, host=host,
                             heartbeat_s=heartbeat_s, limit_flags=parse_limit_flags(request_limit),
                             storage=storage)  # fmt: skip
    if parts.admin_token:
        out.print(f"admin token: {parts.admin_token}  (saved to {state / 'admin.token'})", soft_wrap=True)
    _previous_token_line(parts.previous_admin_token)
    scheme = "https" if tls_cert else "http"
    out.print(f"Turnout controller at {scheme}://{host}:{port}")
    serve(parts.service, sock, tls_cert=tls_cert, tls_key=tls_key)


@app.command()
def worker(
    apps: list[str] = typer.Argument(None, help="MODULE:APP, one or more."),
    controller_url: str | None = typer.Option(
        None, "--controller", help="Controller URL (default $TURNOUT_URL)."
    ),
    token: str | None = typer.Option(
        None, help="Worker or admin token (default $TURNOUT_TOKEN or admin.token)."
    ),
    presets: Path | None = typer.Option(
        None, help="Model presets file: each model is served as a capability."
    ),
    models_dir: Path | None = typer.Option(
        None, help="Where presets' models live (MODEL_PATH; default ~/.turnout/models)."
    ),
    gpus: str = typer.Option("auto", help="auto, none, 0,2 or fake:SPEC."),
    name: str | None = typer.Option(None, help="Worker name (default: host name)."),
    strategy: str = typer.Option("pack", help="GPU placement on this worker: pack or spread."),
    cpus: float | None = typer.Option(None, help="Cores to offer (default: all)."),
    prefetch: str = typer.Option(
        "auto",
        help="Tasks to hold waiting beyond what runs, so a slot that ends starts the next at once (a GPU task "
        "waits after a running one, on its share): auto (up to 64 tasks the controller has seen end quickly, "
        "0.1 s of their work per core at most), N (any N tasks), 0 (none).",
    ),
    heartbeat_s: float = typer.Option(5.0, help="Heartbeat period."),
    canary: str | None = typer.Option(
        None, help="Command that must exit 0 before a quarantined GPU is used again."
    ),
    canary_backoff_s: float = typer.Option(
        30.0, help="Wait before a quarantined GPU's first canary (doubles on failure)."
    ),
    containment: str = typer.Option(
        "auto",
        envvar="TURNOUT_CONTAINMENT",
        help="Kernel mechanisms that end task processes with the worker: auto, none, or a list of "
        "pdeathsig,cgroup,pid_namespace.",
    ),
    ca_cert: Path | None = typer.Option(
        None,
        "--ca-cert",
        envvar="TURNOUT_CA_CERT",
        help="PEM of a private CA that signed the controller's certificate.",
    ),
    storage: Path | None = typer.Option(
        None, "--storage", help="The controller's file storage, mounted here (NFS): files move without HTTP."
    ),
    log_format: str = typer.Option("text", "--log-format", help=LOG_FORMAT_HELP),
    isolation: str = typer.Option(
        "none", help="Isolation of presets that do not say: none or sandbox (bubblewrap)."
    ),
    scrub_command: str | None = typer.Option(
        None,
        help="Run on a GPU before another tenant's task gets it (exit 0 = scrubbed); 'builtin': torch zeroes free memory.",
    ),
    sandbox_dev_dir: Path = typer.Option(
        Path("/dev"), help="Where sandboxes find the GPUs' /dev/nvidia* nodes (tests use stand-in nodes)."
    ),
    channel: bool = typer.Option(
        True,
        "--channel/--no-channel",
        help="Leases and reports over the controller's WebSocket (else HTTP only).",
    ),
    verbose: bool = typer.Option(False, "-v", "--verbose"),
) -> None:
    """A worker: serves the given apps (and presets) with the GPUs it finds."""
    import socket

    from turnout.client import controller_url as checked_url
    from turnout.client import default_token, default_url
    from turnout.gpu.provider import discover
    from turnout.runtime import run_agent_until_signalled
    from turnout.worker.agent import Agent, AgentSettings, prefetch_of
    from turnout.worker.app import load_app
    from turnout.worker.executors import python_runnables
    from turnout.worker.sandbox import Isolation
    from turnout.worker.sandboxed import SandboxOptions

    _logging(verbose, log_format)
    if strategy not in ("pack", "spread"):
        raise InvalidInput(f"--strategy: {strategy!r} is not pack or spread", field="strategy")
    if not apps and not presets:
        raise InvalidInput("give at least one MODULE:APP or --presets FILE", field="apps")
    if isolation not in {i.value for i in Isolation}:
        raise InvalidInput(f"--isolation: {isolation!r} is not none or sandbox", field="isolation")
    ahead, ahead_s = prefetch_of(prefetch)
    # the settings check their own numbers: a bad --cpus is refused before any app is imported
    try:
        url = checked_url(controller_url or default_url())  # a malformed one would be retried for ever
    except InvalidInput as exc:
        raise InvalidInput(f"--controller: {exc.message}", field="controller") from None
    settings = AgentSettings(controller_url=url, token=token or default_token(),
                             name=name or socket.gethostname(), gpus=gpus, strategy=strategy, cpus=cpus,
                             heartbeat_s=heartbeat_s, canary_command=shlex.split(canary) if canary else None,
                             canary_backoff_s=canary_backoff_s, scrub_command=scrub_command, ca_cert=ca_cert,
                             storage=storage.expanduser() if storage else None, channel=channel,
                             prefetch=ahead, prefetch_s=ahead_s)  # fmt: skip
    discovery = discover(gpus)
    from turnout.worker import containment as kernel

    kernel.configure(containment)  # probes the host, removes what dead workers of this host left
    sys.path.insert(0, os.getcwd())
    base_env = {k: v for k, v in os.environ.items() if k not in ("TURNOUT_TOKEN",)}
    runnables = []
    for ref in apps or []:
        runnables += python_runnables(ref, load_app(ref), base_env)
    if presets:
        from turnout.worker.presets import preset_runnables

        minors = {d.index: d.minor for d in discovery.devices if d.minor is not None}
        sandbox = SandboxOptions(Isolation(isolation), sandbox_dev_dir, gpu_minors=minors)
        runnables += preset_runnables(presets, base_env, models_dir=models_dir, sandbox=sandbox)
    run_agent_until_signalled(Agent(settings, runnables, discovery))


# ---- client commands -------------------------------------------------------------------------------


def _client() -> Any:
    from turnout.client import Client

    return Client()


def _json_arg(text: str, name: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidInput(f"{name}: not valid JSON ({exc})", field=name) from None


@app.command()
def submit(
    capability: str,
    input: str | None = typer.Option(None, "--input", "-i", help="The task input as JSON (default null)."),
    inputs: Path | None = typer.Option(
        None,
        "--inputs",
        help="Submit many: a file with one JSON input per line ('-' for stdin), with progress.",
    ),
    gpu: str = typer.Option("auto", help="prefer, never, require or auto."),
    wait: bool = typer.Option(False, "--wait", help="Wait for the result and print it."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Stream events as they come."),
    timeout_s: float | None = typer.Option(None, help="Fail the task after this many seconds of running."),
    priority: int = typer.Option(0),
    file: list[str] = typer.Option(
        [], "--file", help='NAME=PATH, repeatable: upload PATH and put {"$file": ID} at input NAME.'
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the task (or tasks) as JSON."),
) -> None:
    """Submit a task; with --follow, stream its events; with --inputs, submit a batch with progress bars."""
    from turnout.cli_output import follow as show_events
    from turnout.cli_output import summary

    options: dict[str, Any] = {"priority": priority, "gpu": _gpu_flag(gpu)}
    if timeout_s is not None:
        options["timeout_s"] = timeout_s
    if inputs is not None:
        # each would apply to one task and be dropped for the rest: refused, never ignored
        for flag, given in (("--input", input is not None), ("--file", bool(file)), ("--follow", follow)):
            if given:
                hint = " (use --wait)" if flag == "--follow" else " (put it in each line of the file)"
                raise InvalidInput(f"{flag} cannot be combined with --inputs{hint}", field=flag.lstrip("-"))
        _submit_many(capability, inputs, options, wait, as_json)
        return
    data = _json_arg("null" if input is None else input, "--input")
    named = [file_flag(f) for f in file]
    for name, _ in named:  # an input that cannot hold them is refused before any file is uploaded
        with_file(data, name, "")
    with _client() as client:
        for name, path in named:
            data = with_file(data, name, client.upload(path)["id"])
        if wait and not follow:  # the submission's answer is the result: one request
            task = client.run(capability, data, **options)
        else:
            handle = client.submit(capability, data, **options)
            if not follow:
                out.print_json(
                    json.dumps(handle.task if as_json else {"id": handle.id, "state": handle.task["state"]})
                )
                return
            show_events(handle.events(), out, err)
            task = handle.result()
    if follow and not as_json:
        err.print(summary(task), markup=False, highlight=False, soft_wrap=True)
        if task["output"] is not None:
            out.print_json(json.dumps(task["output"]))
    else:
        _print_task(task)
    if task["state"] != "succeeded":
        raise typer.Exit(1)


def _gpu_flag(gpu: str) -> str | bool:
    """`--gpu true|false` as the booleans the API takes for them; any other word as it is."""
    return {"true": True, "false": False}.get(gpu.strip().lower(), gpu)


def _submit_many(capability: str, path: Path, options: dict[str, Any], wait: bool, as_json: bool) -> None:
    from turnout.cli_output import PartlySubmitted, counts_line, numbered_inputs, submit_many

    if str(path) == "-":
        lines = sys.stdin.read().splitlines()
    else:
        lines = read_user_file(path, "--inputs").splitlines()
    numbered = list(numbered_inputs(lines, str(path)))
    specs = [{"capability": capability, "input": data, **options} for _, data in numbered]
    if not specs:
        raise InvalidInput(f"--inputs: {path} holds no inputs (one JSON value per line)", field="inputs")
    with _client() as client:
        try:
            done = submit_many(
                client, specs, err, wait=wait, lines=[n for n, _ in numbered], source=str(path)
            )
        except PartlySubmitted as partly:  # what was accepted is queued: say so, by id, before the error
            if as_json:
                out.print_json(json.dumps({"tasks": partly.submitted}))
            else:
                for t in partly.submitted:
                    print(f"{t['id']}\t{t['state']}")
            raise partly.error from None
    if as_json:
        out.print_json(json.dumps({"tasks": done}))
    else:
        for t in done:
            print(f"{t['id']}\t{t['state']}")  # tab-separated for scripts: no rich layout
        err.print(counts_line(done), markup=False, highlight=False)
    if wait and any(t["state"] != "succeeded" for t in done):
        raise typer.Exit(1)


def _print_task(task: dict[str, Any]) -> None:
    out.print_json(json.dumps(task, default=str))


@app.command("run")
def run_pipeline(
    pipeline: str,
    input: str = typer.Option("{}", "--input", "-i", help="The run's input as a JSON object."),
    gpu: str | None = typer.Option(
        None, help="gpu for stages that set none: prefer, never, require or auto."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the finished run as JSON, no live display."),
) -> None:
    """Run a pipeline: a live display of each stage (state, device, seconds), then a cost table."""
    from turnout.cli_output import terminal_safe
    from turnout.cli_runs import cost_table, follow_run, saving_line

    options = {"gpu": _gpu_flag(gpu)} if gpu else {}
    with _client() as client:
        run = client.run_pipeline(pipeline, _json_arg(input, "--input"), **options)
        if as_json:
            run = client.pipeline_run(run["id"], wait=24 * 3600)
        else:
            run = follow_run(lambda wait: client.pipeline_run(run["id"], wait=wait), run, err)
    if as_json:
        out.print_json(json.dumps(run))
    else:
        out.print(cost_table(run))
        out.print(saving_line(run), markup=False, highlight=False)
        if run["error"]:
            err.print(f"error: {terminal_safe(run['error'].get('message'))}", markup=False, highlight=False,
                      soft_wrap=True)  # fmt: skip
        if run["output"] is not None:
            out.print_json(json.dumps(run["output"]))
    if run["state"] != "succeeded":
        raise typer.Exit(1)


@app.command()
def task(task_id: str, as_json: bool = typer.Option(False, "--json", help="The task as JSON.")) -> None:
    """Show one task: where it ran, why there, how long, what it cost."""
    from turnout.cli_output import task_table

    with _client() as client:
        body = client.get_task(task_id)
    if as_json:
        _print_task(body)
    else:
        out.print(task_table(body))


@app.command()
def cancel(task_id: str = typer.Argument(..., metavar="ID")) -> None:
    """Cancel a task (a running process is killed), or a pipeline run (`r_...`: its stage in flight is killed,
    and no later stage starts)."""
    with _client() as client:
        t = client.cancel_pipeline_run(task_id) if task_id.startswith("r_") else client.cancel(task_id)
        out.print(f"{t['id']}: {t['state']}")


@app.command()
def tasks(
    state: str | None = typer.Option(None),
    capability: str | None = typer.Option(None),
    limit: int = typer.Option(20),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """List tasks, newest first."""
    with _client() as client:
        body = client.tasks(state=state, capability=capability, limit=limit)
    if as_json:
        out.print_json(json.dumps(body))
        return
    # the task id whole, never cut (`turnout task ID` takes it): the other columns give way to it
    table = Table(_id_column("id"), "capability", "state", "device", "worker", "attempts", "run_s", "reason")
    for t in body["tasks"]:
        table.add_row(t["id"], t["capability"], t["state"], t["device"] or "", t["worker"] or "",
                      str(t["attempts"]), f"{t['run_s']:.3f}" if t["run_s"] is not None else "",
                      (t.get("routing") or {}).get("reason", ""))  # fmt: skip
    _print_table(table)


@app.command()
def status(as_json: bool = typer.Option(False, "--json")) -> None:
    """Workers, their GPUs, and the queues."""
    with _client() as client:
        workers, caps = client.workers(), client.capabilities()
    if as_json:
        out.print_json(json.dumps({"workers": workers, "capabilities": caps}))
        return
    wt = Table(
        _id_column("worker"), "name", "state", "cpu", "gpus", "running", "capabilities", title="Workers"
    )
    for w in workers:
        gpus = ", ".join(_gpu_line(g) for g in w["gpus"]) or "-"
        wt.add_row(w["id"], w["name"], w["state"], str(w["resources"]["cpu"]), gpus, str(w["active_tasks"]),
                   ", ".join(w["capabilities"]))  # fmt: skip
    _print_table(wt)
    ct = Table("capability", "variants", "queued", "running", title="Capabilities")
    for c in caps:
        variants = ", ".join(f"{v['device']} ({len(v['workers'])} workers)" for v in c["variants"])
        ct.add_row(c["name"], variants or "-", str(c["queue_depth"]), str(c["running"]))
    _print_table(ct)


def _print_table(table: Table) -> None:
    """A table on stdout: as wide as the terminal, and in a pipe (where rich would assume 80 columns) as wide as
    its rows need, so a script reading it gets every value whole."""
    if out.is_terminal:
        out.print(table)
        return
    wide = Console(file=out.file, width=max(out.width, 400), color_system=None, highlight=False)
    wide.print(table)


def _id_column(header: str) -> Column:
    """A column of ids: never wrapped or cut with an ellipsis, however narrow the terminal (or a pipe's 80)."""
    return Column(header, no_wrap=True, min_width=ID_WIDTH, overflow="fold")


def _gpu_line(g: dict[str, Any]) -> str:
    from turnout.resources import format_bytes

    m = g.get("metrics") or {}
    used = m.get("memory_used_bytes")
    mem = f"{format_bytes(used)}/" if used is not None else ""
    extra = f" {m.get('utilization_pct'):.0f}%" if m.get("utilization_pct") is not None else ""
    bad = f" QUARANTINED({g['quarantined']})" if g.get("quarantined") else ""
    return f"{g['index']}:{g['name']} {mem}{format_bytes(g['memory_total_bytes'])}{extra}{bad}"


@app.command()
def gpus(
    spec: str = typer.Option("auto", "--gpus", help="auto, none, 0,2 or fake:SPEC."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """What GPUs this host has, from discovery."""
    from dataclasses import asdict

    from turnout.gpu.provider import discover
    from turnout.resources import format_bytes

    found = discover(spec)
    metrics = {m.uuid: m for m in found.provider.metrics()} if found.devices else {}
    if as_json:
        out.print_json(json.dumps({"provider": found.provider.name, "tried": [list(t) for t in found.tried],
                                   "gpus": [{**d.to_dict(), "metrics": asdict(metrics[d.uuid]) if d.uuid in metrics else None}
                                            for d in found.devices]}))  # fmt: skip
        return
    if not found.devices:
        out.print(f"no GPUs found (provider {found.provider.name})")
        for name, why in found.tried:
            out.print(f"  {name}: {why}")
        return
    table = Table(
        "index",
        "name",
        "uuid",
        "memory",
        "cc",
        "driver",
        "cuda",
        "mig",
        "util",
        "temp",
        title=f"GPUs ({found.provider.name})",
    )
    for d in found.devices:
        m = metrics.get(d.uuid)
        mig = ", ".join(x.profile for x in d.mig_devices) if d.mig_mode else "off"
        table.add_row(str(d.index), d.name, d.uuid, format_bytes(d.memory_total_bytes), d.compute_capability or "",
                      d.driver_version or "", d.cuda_version or "", mig,
                      f"{m.utilization_pct:.0f}%" if m and m.utilization_pct is not None else "",
                      f"{m.temperature_c:.0f}C" if m and m.temperature_c is not None else "")  # fmt: skip
    out.print(table)


@app.command()
def demo() -> None:
    """Start a controller, a CPU worker and a fake-GPU worker in this process, run the classify pipeline on sample
    texts, and show where each stage ran and what it cost against running it all on a GPU."""
    from turnout.demo_run import run as run_demo

    raise typer.Exit(run_demo(out, err))


@app.command()
def simulate(
    nodes: Path = typer.Option(..., help="Nodes CSV (openb format)."),
    tasks_csv: Path = typer.Option(..., "--tasks", help="Tasks CSV (openb pod list format)."),
    policy: str = typer.Option("fgd", help="Placement policy: fgd (the controller's), bestfit or random."),
    seed: int = typer.Option(42),
    mix: str = typer.Option(
        "online",
        help="What fgd weighs fragmentation against: online (the controller's estimate from the GPU tasks "
        "running, the one being placed and one whole GPU) or trace (the whole trace's mix known in advance, "
        "as the FGD paper's simulator does).",
    ),
    as_json: bool = typer.Option(
        False, "--json", help='Print {"policy", "seed", "mix", "points": [{"arrived_pct", "allocated_pct"}]}.'
    ),
) -> None:
    """Replay a workload trace through the controller's own placement code, as the controller would place it."""
    from turnout.simulate import main as simulate_main

    raise typer.Exit(simulate_main(nodes, tasks_csv, policy, seed, as_json, mix))


@token_app.command("create")
def token_create(
    role: str = typer.Option(..., help="admin, submit, worker or read."),
    tenant: str | None = typer.Option(
        None, help='Tenant it belongs to (default: your own; "*" = every tenant, operator only).'
    ),
) -> None:
    """Make a token (shown once)."""
    with _client() as client:
        body = client.create_token(role, tenant)
    out.print_json(json.dumps(body))


@token_app.command("list")
def token_list(
    tenant: str | None = typer.Option(None, help="Only this tenant's tokens."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Tokens you may manage (never the tokens themselves)."""
    with _client() as client:
        tokens = client.list_tokens(tenant)
    if as_json:
        out.print_json(json.dumps({"tokens": tokens}))
        return
    table = Table("id", "role", "tenant", "created_at", "revoked_at")
    for t in tokens:
        table.add_row(t["id"], t["role"], t["tenant"], t["created_at"] or "", t["revoked_at"] or "")
    out.print(table)


@token_app.command("revoke")
def token_revoke(token_id: str) -> None:
    """Revoke a token: it stops working within seconds on every controller."""
    with _client() as client:
        client.revoke_token(token_id)
    out.print(f"{token_id}: revoked")


@app.command()
def audit(
    since: str | None = typer.Option(None, help="ISO 8601 time or epoch seconds."),
    tenant: str | None = typer.Option(None, help="Only this tenant's records."),
    kind: str | None = typer.Option(None, help="Only this kind, e.g. gpu_allocated."),
    jsonl: bool = typer.Option(False, "--jsonl", help="One JSON record per line (for export)."),
    as_json: bool = typer.Option(False, "--json", help='{"audit": [...]} as the API answers (every page).'),
) -> None:
    """The audit log (admin): GPU allocations and releases, tokens, cancellations, workers."""
    with _client() as client:
        records = client.audit(since=since, tenant=tenant, kind=kind)
    if as_json:
        out.print_json(json.dumps({"audit": records}))
        return
    for rec in records:
        if jsonl:
            print(json.dumps(rec))
        else:
            out.print(f"{rec['ts']}  {rec['kind']:<18} {rec.get('tenant') or '':<10} "
                      + json.dumps({k: v for k, v in rec.items() if k not in ('ts', 'kind', 'tenant', 'id')}),
                      markup=False, highlight=False)  # fmt: skip


@app.command()
def doctor(
    controller_url: str | None = typer.Option(
        None, "--controller", help="Controller URL (default $TURNOUT_URL)."
    ),
    token: str | None = typer.Option(None, help="The worker token (default $TURNOUT_TOKEN or admin.token)."),
    gpus: str = typer.Option("auto", help="GPUs as the worker would use them: auto, none, 0,2 or fake:SPEC."),
    as_json: bool = typer.Option(False, "--json", help='{"ok", "checks": [{name, status, detail, fix}]}'),
) -> None:
    """Check this host before it serves as a worker, and say how to fix each problem; exit 0 only when it can."""
    from turnout import doctor as checks
    from turnout.client import default_ca_cert, default_token, default_url

    settings = checks.DoctorSettings(controller_url=controller_url or default_url(),
                                     token=token or default_token(), gpus=gpus, ca_cert=default_ca_cert())  # fmt: skip
    found = checks.run(settings)
    ok = checks.can_serve(found)
    if as_json:
        out.print_json(json.dumps({"ok": ok, "controller": settings.controller_url,
                                   "checks": [c.to_dict() for c in found]}))  # fmt: skip
    else:
        checks.render(found, settings.controller_url,
                      lambda line: out.print(line, markup=False, highlight=False, soft_wrap=True))  # fmt: skip
    raise typer.Exit(0 if ok else 1)


if __name__ == "__main__":
    main()
