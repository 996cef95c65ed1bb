"""A hostile task author's program in the sandbox (`isolation: sandbox`), trying what the sandbox must stop.

The worker often runs as root on a GPU host (device permissions); its sandboxed program is then uid 0 without
capabilities, which still owns every root file: it must not change the host's kernel settings through
`/proc/sys`, nor read what only root may read under `/etc` or `/opt`. And a memory limit kept as an rlimit must
not be outgrown through a tmpfs (`/tmp`, `/dev/shm`, the sandbox's own `/`), whose pages no rlimit counts.

The probe runs the Python its task sends (`code`, filling `out`): each test says exactly what it tries.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Cluster
from tests.integration.test_sandbox_e2e import BWRAP  # noqa: F401  (its import skips here where no sandbox starts)

PROBE = textwrap.dedent("""
    import json, os, sys
    for line in sys.stdin:
        task, out = json.loads(line), {}
        exec(task["code"], {"out": out, "os": os})
        sys.stdout.write(json.dumps({"event": "result", "data": out}) + "\\n")
        sys.stdout.write(json.dumps({"event": "finish", "status": "completed"}) + "\\n")
        sys.stdout.flush()
""")

MEMORY = 64 * 2**20


@pytest.fixture(scope="module")
def private_tree() -> Iterator[Path | None]:
    """Under /opt (searched for private files as a worker starts): a file and a directory only root may read,
    and a file anyone may; None where this user cannot write /opt or is not root."""
    root = Path("/opt") / f"turnout-test-private-{os.getpid()}"
    if os.geteuid() != 0:
        yield None
        return
    try:
        (root / "vault").mkdir(parents=True)
    except OSError:
        yield None
        return
    try:
        (root / "host.key").write_text("host private key")
        (root / "host.key").chmod(0o600)
        (root / "vault" / "token").write_text("cluster admin token")
        (root / "vault").chmod(0o700)
        (root / "public.txt").write_text("public")
        root.chmod(0o755)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def sandbox(shared_cluster: Cluster, private_tree: Path | None) -> Iterator[Cluster]:
    tmp = shared_cluster.tmp
    (tmp / "app").mkdir()
    program = tmp / "app" / "probe.py"
    program.write_text(PROBE)
    cmd = [sys.executable, str(program)]
    doc = {"models": {
        "probe": {"inference": {"command": cmd, "isolation": "sandbox"}},
        "probe-small": {"inference": {"command": cmd, "isolation": "sandbox", "resources": {"memory": MEMORY}}},
    }}  # fmt: skip
    presets = tmp / "presets.yaml"
    presets.write_text(json.dumps(doc))
    shared_cluster.start_worker(name="hostile", extra=["--presets", str(presets), "--cpus", "4"])
    yield shared_cluster


def run(cluster: Cluster, capability: str, code: str) -> dict[str, Any]:
    done = cluster.result(cluster.submit(capability, {"code": textwrap.dedent(code)})["id"], wait=60)
    assert done["state"] == "succeeded", done
    assert done["isolation"]["mode"] == "sandbox", done["isolation"]
    out: dict[str, Any] = done["output"]
    return out


def test_a_sandboxed_root_cannot_change_the_hosts_kernel_settings(sandbox: Cluster) -> None:
    if os.geteuid() != 0:
        pytest.skip("only uid 0 may write /proc/sys without capabilities")
    # asked without writing: a write that got through would change the host's own kernel
    out = run(
        sandbox,
        "probe",
        """
        paths = ["/proc/sys/kernel/core_pattern", "/proc/sys/vm/drop_caches", "/proc/sysrq-trigger"]
        out["writable"] = {p: os.access(p, os.W_OK) for p in paths if os.path.exists(p)}
        out["read"] = open("/proc/sys/kernel/ostype").read().strip()
        out["own_proc"] = os.access("/proc/self/oom_score_adj", os.W_OK)
    """,
    )
    assert out["writable"] and not any(out["writable"].values()), out["writable"]
    assert out["read"] == "Linux"  # still readable: programs read their limits there
    assert out["own_proc"] is True  # its own processes' files are its own


def test_a_sandboxed_program_cannot_read_what_only_the_workers_user_may_read(
    sandbox: Cluster, private_tree: Path | None
) -> None:
    if private_tree is None:
        pytest.skip("needs root, to make root-only files under /opt")
    out = run(
        sandbox,
        "probe",
        f"""
        def attempt(fn):
            try:
                return "ok:" + fn()
            except Exception as exc:
                return type(exc).__name__
        root = {str(private_tree)!r}
        out["key"] = attempt(lambda: open(root + "/host.key").read())
        out["token"] = attempt(lambda: open(root + "/vault/token").read())
        out["vault"] = attempt(lambda: ",".join(os.listdir(root + "/vault")))
        out["public"] = attempt(lambda: open(root + "/public.txt").read())
    """,
    )
    assert out["public"] == "ok:public"  # the tree is there, as a user who is not root sees it
    assert not out["key"].startswith("ok:host"), out
    assert not out["token"].startswith("ok:cluster"), out
    assert out["vault"] in ("ok:", "FileNotFoundError", "PermissionError"), out


def test_a_sandboxed_programs_tmpfs_writes_stay_within_its_memory_limit(sandbox: Cluster) -> None:
    out = run(
        sandbox,
        "probe-small",
        f"""
        def fill(path, mib=3 * {MEMORY} // 2**20):
            written = 0
            try:
                with open(path, "wb") as f:
                    for _ in range(mib):
                        f.write(b"x" * 2**20)
                        f.flush()
                        written += 2**20
            except OSError as exc:
                return [written, exc.__class__.__name__]
            finally:
                if os.path.exists(path):
                    os.remove(path)
            return [written, "ok"]
        out["tmp"] = fill("/tmp/fill")
        out["shm"] = fill("/dev/shm/fill")
        out["root"] = fill("/fill")
        out["dev"] = fill("/dev/fill")
        out["small"] = [fill("/tmp/small", 1), fill("/dev/shm/small", 1)]
    """,
    )
    assert out["tmp"][0] <= MEMORY and out["tmp"][1] == "OSError", out  # ENOSPC at the limit
    assert out["shm"][0] <= MEMORY and out["shm"][1] == "OSError", out
    assert out["root"] == [0, "OSError"] and out["dev"] == [0, "OSError"], out  # read-only
    assert out["small"] == [[2**20, "ok"], [2**20, "ok"]]  # a program's scratch and shared memory still work
