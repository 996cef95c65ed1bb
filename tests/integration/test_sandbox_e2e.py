"""Sandboxed command workers end to end: a real worker runs real programs in bubblewrap, and they try to escape.

A probe program, told by its input what to try, reports what it could do. Each escape must fail: open a GPU
node it was not given, read another task's files, see the host's processes, reach the network; and each
baseline (its own GPU's node, a preset that allows the network) must work, so the tests can tell.
The GPU nodes are stand-ins this module makes with mknod (char 195:N, like the driver's) in a directory the
worker is pointed at with `--sandbox-dev-dir`.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Cluster
from turnout.client import Client
from turnout.worker.sandbox import find_bwrap

BWRAP = find_bwrap()
if isinstance(BWRAP, str):
    if os.environ.get("CI") == "true":
        raise RuntimeError(f"CI must run the sandbox tests, but {BWRAP}")
    pytest.skip(f"sandbox tests skipped: {BWRAP}", allow_module_level=True)

PROBE = textwrap.dedent("""
    import json, os, socket, sys, time

    def emit(**event):
        sys.stdout.write(json.dumps(event) + "\\n")
        sys.stdout.flush()

    def attempt(fn):
        try:
            got = fn()
        except Exception as exc:
            return type(exc).__name__
        return "ok:" + got if isinstance(got, str) else "ok"

    for line in sys.stdin:
        task = json.loads(line)
        do, out = task["do"], {}
        if do == "devices":
            out["nvidia"] = sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))
            out["open"] = {p: attempt(lambda p=p: os.close(os.open(p, os.O_RDONLY))) for p in task["paths"]}
            out["exists"] = {p: os.path.exists(p) for p in task["paths"]}
            out["gpu_device"] = os.environ.get("GPU_DEVICE")
        elif do == "hold":
            with open("secret.txt", "w") as f:
                f.write("tenant-a data")
            emit(event="worker", status="secret", message=os.path.abspath("secret.txt"))
            time.sleep(120)
        elif do == "read":
            out["read"] = {p: attempt(lambda p=p: open(p).read()) for p in task["paths"]}
            out["write"] = {p: attempt(lambda p=p: open(p, "w").write("x")) for p in task["writes"]}
            out["siblings"] = sorted(os.listdir(os.path.dirname(os.getcwd())))
            out["cwd"] = os.getcwd()
            out["home"] = os.environ.get("HOME")
            out["env"] = sorted(os.environ)
            out["own_write"] = attempt(lambda: open("mine.txt", "w").write("x"))
            out["tmp_write"] = attempt(lambda: open("/tmp/scratch", "w").write("x"))
        elif do == "procs":
            out["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
            out["signal_worker"] = attempt(lambda: os.kill(task["worker_pid"], 0))
        elif do == "net":
            out["connect"] = attempt(lambda: socket.create_connection(("127.0.0.1", task["port"]), timeout=3).close())
        elif do == "memory":
            def hog():
                buf = bytearray(task["bytes"])
                buf[:: 4096] = b"x" * len(buf[:: 4096])
            out["alloc"] = attempt(hog)
        emit(event="result", data=out)
        emit(event="finish", status="completed")
""")

NODES = {"nvidia0": 0, "nvidia1": 1, "nvidiactl": 255, "nvidia-uvm": 254, "nvidia-uvm-tools": 253}


def make_stand_in_nodes(root: Path) -> Path | None:
    """Character devices like the driver's (major 195); None where this user may not mknod."""
    dev = root / "dev"
    dev.mkdir()
    try:
        for name, minor in NODES.items():
            os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(195, minor))
    except PermissionError:
        return None
    return dev


@pytest.fixture(scope="module")
def sandbox(shared_cluster: Cluster) -> Iterator[tuple[Cluster, Any, Path | None]]:
    """One controller and one worker whose presets run sandboxed (the worker's default), with stand-in nodes."""
    tmp = shared_cluster.tmp
    (tmp / "app").mkdir()
    program = tmp / "app" / "probe.py"
    program.write_text(PROBE)
    cmd = [sys.executable, str(program)]
    doc = {"models": {
        "probe": {"inference": {"command": cmd}},
        "probe-gpu": {"inference": {"command": cmd, "resources": {"gpu": 1}}},
        "probe-net": {"inference": {"command": cmd, "isolation": "sandbox", "network": True}},
        "probe-small": {"inference": {"command": cmd, "resources": {"memory": "64Mi"}}},
        "probe-open": {"inference": {"command": cmd, "isolation": "none"}},
        "probe-session": {"inference": {"command": cmd, "mode": "session"}},
    }}  # fmt: skip
    presets = tmp / "presets.yaml"
    presets.write_text(json.dumps(doc))
    dev = make_stand_in_nodes(tmp)
    extra = [
        "--presets",
        str(presets),
        "--isolation",
        "sandbox",
        "--cpus",
        "8",
        "--models-dir",
        str(tmp / "models"),
    ]
    if dev is not None:
        extra += ["--sandbox-dev-dir", str(dev)]
    worker = shared_cluster.start_worker(gpus="fake:2x24Gi", name="sandboxed", extra=extra)
    yield shared_cluster, worker, dev


def run(cluster: Cluster, capability: str, data: dict[str, Any], **options: Any) -> dict[str, Any]:
    done = cluster.result(cluster.submit(capability, data, **options)["id"], wait=60)
    assert done["state"] == "succeeded", done
    return done


def test_a_sandboxed_program_cannot_open_a_gpu_node_it_was_not_given(
    sandbox: tuple[Cluster, Any, Path | None],
) -> None:
    cluster, _, dev = sandbox
    if dev is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the device test, but this user may not mknod stand-in device nodes")
        pytest.skip("stand-in device nodes need mknod (root)")
    paths = ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    done = run(cluster, "probe-gpu", {"do": "devices", "paths": paths}, gpu="require")
    out = done["output"]
    mine = int(out["gpu_device"])
    other = f"/dev/nvidia{1 - mine}"
    assert out["nvidia"] == sorted([f"nvidia{mine}", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"])
    assert (out["exists"][other], out["open"][other]) == (False, "FileNotFoundError")
    # its own node is there (a stand-in has no driver behind it, so opening it is ENXIO, not ENOENT)
    assert out["exists"][f"/dev/nvidia{mine}"] and out["open"][f"/dev/nvidia{mine}"] != "FileNotFoundError"
    assert (dev / os.path.basename(other)).exists()  # the host has it: the sandbox kept it out
    iso = done["isolation"]
    assert iso["mode"] == "sandbox" and iso["gpu_minors"] == [mine]
    assert iso["devices"] == [
        f"/dev/nvidia{mine}",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]


def test_a_cpu_task_in_a_sandbox_sees_no_gpu_node(sandbox: tuple[Cluster, Any, Path | None]) -> None:
    cluster, _, _ = sandbox
    done = run(cluster, "probe", {"do": "devices", "paths": ["/dev/nvidia0", "/dev/nvidiactl"]})
    assert done["output"]["nvidia"] == []
    assert done["isolation"]["devices"] == []


def test_a_sandboxed_program_cannot_read_another_tasks_files_or_write_outside_its_directory(
    sandbox: tuple[Cluster, Any, Path | None],
) -> None:
    cluster, _, _ = sandbox
    host_file = cluster.tmp / "host-secret.txt"
    host_file.write_text("host data")
    holder = cluster.submit("probe", {"do": "hold"})
    with Client(cluster.url, cluster.token) as client:
        secret = next(e["message"] for e in client.task(holder["id"]).events()
                      if e.get("event") == "worker" and e.get("status") == "secret")  # fmt: skip
    assert Path(secret).read_text() == "tenant-a data"  # it is really there, on the host
    try:
        writes = ["/usr/x", "/etc/x", str(cluster.tmp / "app" / "x"), str(Path(secret).parent / "x")]
        done = run(
            cluster,
            "probe",
            {"do": "read", "paths": [secret, str(host_file), "/etc/shadow"], "writes": writes},
        )
    finally:
        cluster.api("POST", f"/v1/tasks/{holder['id']}/cancel")
    out = done["output"]
    assert out["read"][secret] == "FileNotFoundError"
    assert out["read"][str(host_file)] == "FileNotFoundError"
    assert out["read"]["/etc/shadow"] in ("ok:", "PermissionError")  # masked by an empty node
    assert set(out["write"].values()) <= {"OSError", "FileNotFoundError", "PermissionError"}, out["write"]
    assert out["siblings"] == [os.path.basename(out["cwd"])]  # no other task's directory is there
    assert (out["own_write"], out["tmp_write"]) == ("ok", "ok")
    assert out["home"] == out["cwd"]
    # the worker's own environment stays outside (TURNOUT_URL, TURNOUT_HOME, ...); the contract's is there
    contract = {
        "TURNOUT_TASK_ID",
        "TURNOUT_INPUT_FILES",
        "TURNOUT_OUTPUT_DIR",
    }  # the task's own (files: issue 11)
    assert not any(k.startswith("TURNOUT_") and k not in contract for k in out["env"]), out["env"]
    assert {"MODEL_NAME", "MODEL_PATH", "CUDA_VISIBLE_DEVICES", "TURNOUT_TASK_ID", "PATH"} <= set(out["env"])
    assert done["isolation"]["writable"][0] == out["cwd"]


def test_a_one_off_tasks_working_directory_is_removed_after_it(
    sandbox: tuple[Cluster, Any, Path | None],
) -> None:
    cluster, _, _ = sandbox
    done = run(cluster, "probe", {"do": "read", "paths": [], "writes": []})
    cwd = Path(done["output"]["cwd"])
    deadline = time.monotonic() + 10
    while cwd.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not cwd.exists()


def test_a_sandboxed_session_keeps_one_working_directory_for_the_tasks_it_serves(
    sandbox: tuple[Cluster, Any, Path | None],
) -> None:
    cluster, _, _ = sandbox
    first, second = (
        run(cluster, "probe-session", {"do": "read", "paths": [], "writes": []}) for _ in range(2)
    )
    assert first["output"]["cwd"] == second["output"]["cwd"]
    assert first["isolation"]["mode"] == "sandbox"


def test_a_sandboxed_program_sees_no_host_process(sandbox: tuple[Cluster, Any, Path | None]) -> None:
    cluster, worker, _ = sandbox
    done = run(cluster, "probe", {"do": "procs", "worker_pid": worker.pid})
    out = done["output"]
    assert worker.pid not in out["pids"] and len(out["pids"]) <= 3, out  # bwrap's init and the program
    assert out["signal_worker"] == "ProcessLookupError"
    assert done["isolation"]["pid_namespace"] is True
    baseline = run(cluster, "probe-open", {"do": "procs", "worker_pid": worker.pid})
    assert worker.pid in baseline["output"]["pids"]  # without the sandbox it would
    assert baseline["isolation"]["mode"] == "none" and baseline["isolation"]["process_group"] is True


def test_a_sandboxed_program_cannot_reach_the_network_unless_its_preset_allows_it(
    sandbox: tuple[Cluster, Any, Path | None],
) -> None:
    cluster, _, _ = sandbox
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        cut = run(cluster, "probe", {"do": "net", "port": port})
        allowed = run(cluster, "probe-net", {"do": "net", "port": port})
    assert cut["output"]["connect"] in ("ConnectionRefusedError", "OSError", "TimeoutError"), cut["output"]
    assert cut["isolation"]["network"] is False
    assert allowed["output"]["connect"] == "ok"
    assert allowed["isolation"]["network"] is True


def test_a_sandboxed_program_cannot_use_more_memory_than_its_preset_and_the_task_says_how(
    sandbox: tuple[Cluster, Any, Path | None],
) -> None:
    cluster, _, _ = sandbox
    done = cluster.result(
        cluster.submit("probe-small", {"do": "memory", "bytes": 512 * 2**20})["id"], wait=60
    )
    limit = done["isolation"]["limits"]["memory"]
    assert limit["bytes"] == 64 * 2**20 and limit["via"] in ("cgroup", "rlimit")
    if limit["via"] == "rlimit":
        assert (done["state"], done["output"]) == ("succeeded", {"alloc": "MemoryError"}), done
    else:  # the kernel's OOM killer ends it
        assert done["state"] == "failed" and done["error"]["type"] == "process_exited", done
    fine = run(cluster, "probe-small", {"do": "memory", "bytes": 8 * 2**20})
    assert fine["output"] == {"alloc": "ok"}
