"""A controller serving https with a certificate from a private CA: workers, the CLI and the SDK trust it
with `--ca-cert` (or `ca_cert=`, `TURNOUT_CA_CERT`), and a client that does not trust it is refused with
one line that says why, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Processes, channel_requests
from tests.remote import TlsCluster, private_ca
from turnout.client import Client
from turnout.errors import InvalidInput

APP = "tests.apps.testapp:app"


@pytest.fixture
def tls_cluster(tmp_path: Path, processes: Processes) -> TlsCluster:
    c = TlsCluster(tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}",
                   tls=private_ca(tmp_path, ["127.0.0.1"]))  # fmt: skip
    c.start_controller()
    return c


def test_a_worker_the_cli_and_the_sdk_reach_a_tls_controller_trusting_a_private_ca(
    tls_cluster: TlsCluster,
) -> None:
    assert tls_cluster.tls is not None
    ca = str(tls_cluster.tls.ca)
    # Given a worker that trusts the CA with --ca-cert
    tls_cluster.start_remote_worker(None, APP, name="tls")
    env = {k: v for k, v in tls_cluster.env.items() if k != "TURNOUT_CA_CERT"}
    # When the CLI submits with --ca-cert, and the SDK with ca_cert=
    cli = subprocess.run([sys.executable, "-m", "turnout.cli", "--ca-cert", ca, "submit", "count", "--input",
                          '{"n": 7}', "--wait", "--json"], env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    with Client(tls_cluster.url, tls_cluster.token, ca_cert=ca) as client:
        task = client.submit("count", {"n": 8}).result(timeout=30)
    # Then both tasks ran on the worker, over https
    assert cli.returncode == 0, cli.stderr
    assert '"n": 7' in cli.stdout and task["state"] == "succeeded" and task["output"]["n"] == 8
    # the worker's results went over its channel: a WebSocket over TLS, trusting the same CA
    assert channel_requests(tls_cluster.api("GET", "/metrics").text, "complete") >= 2
    by_env = subprocess.run([sys.executable, "-m", "turnout.cli", "tasks", "--json"], env={**env, "TURNOUT_CA_CERT": ca},
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert by_env.returncode == 0 and task["id"] in by_env.stdout, by_env.stderr
    # and `turnout doctor` on a prospective worker host finds the certificate trusted through the same CA
    doctor = subprocess.run([sys.executable, "-m", "turnout.cli", "--ca-cert", ca, "doctor", "--controller",
                             tls_cluster.url, "--gpus", "none", "--json"], env=env, capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    checks = {c["name"]: c["status"] for c in json.loads(doctor.stdout)["checks"]}
    assert checks["tls"] == "ok", doctor.stdout


def test_files_move_over_https_with_the_private_ca(tls_cluster: TlsCluster, tmp_path: Path) -> None:
    assert tls_cluster.tls is not None
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(3 * 1024 * 1024))
    with Client(tls_cluster.url, tls_cluster.token, ca_cert=tls_cluster.tls.ca) as client:
        up = client.upload(src)
        down = client.download(up["id"], tmp_path / "out.bin")
    assert up["sha256"] == down["sha256"] and (tmp_path / "out.bin").read_bytes() == src.read_bytes()


def test_a_client_that_does_not_trust_the_ca_is_refused_with_one_line(
    tls_cluster: TlsCluster, tmp_path: Path
) -> None:
    env = {k: v for k, v in tls_cluster.env.items() if k != "TURNOUT_CA_CERT"}
    out = subprocess.run([sys.executable, "-m", "turnout.cli", "tasks"], env=env, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 2 and "CERTIFICATE_VERIFY_FAILED" in out.stderr and "Traceback" not in out.stderr
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("nonsense")
    with pytest.raises(InvalidInput) as caught:
        Client(tls_cluster.url, tls_cluster.token, ca_cert=not_pem)
    assert caught.value.field == "ca-cert"
