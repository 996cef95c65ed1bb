"""Containers outlive a SIGKILLed worker: each is labelled with its worker, and a starting worker removes
those of this host's dead workers. No engine runs here, so a fake `docker` executable, first on PATH,
records every command line it is given and answers `ps` from a file."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from turnout.worker import containment, docker
from turnout.worker.presets import preset_runnables

FAKE_DOCKER = """#!{python}
import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "calls.jsonl"), "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1] == "ps":
    sys.stdout.write(open(os.path.join(here, "ps.txt")).read())
    sys.exit(int(open(os.path.join(here, "ps.rc")).read()))
"""


class FakeDocker:
    """A real `docker` executable in a directory of its own; `calls` are the argvs it was run with."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / "docker"
        self.path.write_text(FAKE_DOCKER.format(python=sys.executable))
        self.path.chmod(0o755)
        self.answer_ps("", rc=0)

    def answer_ps(self, text: str, rc: int = 0) -> None:
        (self.root / "ps.txt").write_text(text)
        (self.root / "ps.rc").write_text(str(rc))

    @property
    def calls(self) -> list[list[str]]:
        log = self.root / "calls.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def removed(self) -> list[str]:
        return [arg for call in self.calls if call[:2] == ["rm", "-f"] for arg in call[2:]]


@pytest.fixture
def fake_docker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeDocker:
    root = tmp_path / "bin"
    root.mkdir()
    monkeypatch.setenv("PATH", f"{root}:{Path(sys.executable).parent}:/usr/bin:/bin")
    return FakeDocker(root)


def dead_tag() -> str:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        return containment.worker_tag(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_a_container_is_labelled_with_its_worker_and_host() -> None:
    argv = docker.docker_argv("img", name="n", env_keys=[], gpu_uuids=[], models_dir=Path("/m"))
    labels = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--label"]
    assert sorted(labels) == sorted(
        [f"turnout.worker={containment.worker_tag()}", f"turnout.host={socket.gethostname()}"]
    )
    assert argv.index("--label") < argv.index("img")  # options, not the container's command


def test_a_starting_worker_removes_the_containers_of_dead_workers_of_this_host(
    fake_docker: FakeDocker,
) -> None:
    live = containment.worker_tag()
    gone = dead_tag()
    _boot, pid, ticks = live.split("-")
    fake_docker.answer_ps(f"aaa {live}\nbbb {gone}\nccc 00000000-{pid}-{ticks}\nddd \neee not-ours\n")

    removed = docker.remove_stale_containers()

    assert removed == ["bbb", "ccc"]
    listing, rm = fake_docker.calls
    assert listing[:2] == ["ps", "-a"] and f"label=turnout.host={socket.gethostname()}" in listing
    assert listing[listing.index("--format") + 1] == '{{.ID}} {{.Label "turnout.worker"}}'
    assert rm == ["rm", "-f", "bbb", "ccc"]  # the live worker's, unlabelled and foreign ones are left alone


def test_nothing_is_removed_when_every_worker_lives_or_the_engine_fails(fake_docker: FakeDocker) -> None:
    fake_docker.answer_ps(f"aaa {containment.worker_tag()}\n")
    assert docker.remove_stale_containers() == []
    fake_docker.answer_ps(f"bbb {dead_tag()}\n", rc=1)  # `docker ps` failed: its output is not trusted
    assert docker.remove_stale_containers() == []
    assert fake_docker.removed() == [] and len(fake_docker.calls) == 2


def test_an_absent_docker_costs_a_warning_not_the_worker(tmp_path: Path) -> None:
    assert docker.remove_stale_containers(docker=str(tmp_path / "no-docker")) == []


def test_presets_sweep_stale_containers_only_where_an_engine_answers(
    tmp_path: Path, fake_docker: FakeDocker
) -> None:
    presets = tmp_path / "presets.yaml"
    presets.write_text(json.dumps({"models": {"m": {"inference": {"docker_image": "img:1"}}}}))
    fake_docker.answer_ps(f"bbb {dead_tag()}\n")
    preset_runnables(presets, {}, engine_answers=lambda: False)
    assert fake_docker.calls == []
    preset_runnables(presets, {}, engine_answers=lambda: True)
    assert fake_docker.removed() == ["bbb"]
