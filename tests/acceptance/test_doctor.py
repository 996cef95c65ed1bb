"""`turnout doctor` as a new worker host runs it: against a real controller, as a subprocess, by exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Cluster, free_port

MIG_GPUS = "fake:1xA100-40Gi-mig:3g.20gb,2g.10gb,1xL4-24Gi"


def doctor(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "turnout.cli", "doctor", *args], env=env, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip


def checks_of(out: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    body = json.loads(out.stdout)
    return {c["name"]: c for c in body["checks"]}


@pytest.fixture(scope="module")
def worker_token(shared_cluster: Cluster) -> str:
    resp = shared_cluster.api("POST", "/v1/tokens", json={"role": "worker"})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["token"])


def test_doctor_passes_a_fake_gpu_host_and_reports_provider_driver_cuda_and_mig(
    shared_cluster: Cluster, worker_token: str
) -> None:
    args = ("--controller", shared_cluster.url, "--token", worker_token, "--gpus", MIG_GPUS)
    out = doctor(*args, env=shared_cluster.env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "This host can serve" in out.stdout
    assert "Traceback" not in out.stderr
    found = checks_of(doctor(*args, "--json", env=shared_cluster.env))
    gpus = found["gpus"]["detail"]
    assert found["gpus"]["status"] == "ok"
    assert "2 GPUs from provider fake" in gpus and "driver 550.54.15" in gpus and "CUDA 12.4" in gpus
    assert "MIG on: 3g.20gb, 2g.10gb" in gpus and "1: NVIDIA L4 24 GiB, cc 8.9, MIG off" in gpus
    assert found["device nodes"]["status"] == "skip"
    assert found["controller"]["status"] == "ok"
    assert found["token"] == {
        "name": "token",
        "status": "ok",
        "detail": "a worker token: this worker will serve tenant default's tasks only",
        "fix": "",
    }
    assert found["clock"]["status"] == "ok"  # the same host's clock
    assert found["tls"]["status"] == "skip"  # plain HTTP, on loopback


@pytest.mark.skipif(
    Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/gpus").exists(),
    reason="this host has an NVIDIA driver: it is not a host with no GPU",
)
def test_doctor_passes_a_host_with_no_gpu_and_says_it_serves_cpu_variants_only(
    shared_cluster: Cluster, worker_token: str
) -> None:
    out = doctor(
        "--controller", shared_cluster.url, "--token", worker_token, "--json", env=shared_cluster.env
    )
    assert out.returncode == 0, out.stdout + out.stderr
    found = checks_of(out)
    assert found["gpus"]["status"] == "warn"
    assert "no NVIDIA GPU found" in found["gpus"]["detail"] and "CPU variants only" in found["gpus"]["detail"]
    assert "nvidia-smi" in found["gpus"]["fix"]
    assert found["device nodes"]["status"] == "skip"


def test_doctor_fails_a_wrong_token_and_says_how_to_get_a_worker_token(
    shared_cluster: Cluster, worker_token: str
) -> None:
    out = doctor(
        "--controller", shared_cluster.url, "--token", "tnt_wrong", "--gpus", "none", env=shared_cluster.env
    )
    assert out.returncode == 1
    assert "[FAIL] token" in out.stdout and "refused the token" in out.stdout
    assert "fix: on the controller host: turnout token create --role worker" in out.stdout
    assert "cannot serve yet: fix token" in out.stdout
    read = shared_cluster.api("POST", "/v1/tokens", json={"role": "read"}).json()["token"]
    found = checks_of(doctor("--controller", shared_cluster.url, "--token", read, "--gpus", "none", "--json",
                             env=shared_cluster.env))  # fmt: skip
    assert found["token"]["status"] == "fail"
    assert "needs the worker role" in found["token"]["detail"]
    found = checks_of(doctor("--controller", shared_cluster.url, "--token", worker_token + "\n", "--gpus", "none",
                             "--json", env=shared_cluster.env))  # fmt: skip
    assert found["token"]["status"] == "fail"
    assert (
        "no spaces or line breaks" in found["token"]["detail"]
        and worker_token not in found["token"]["detail"]
    )


def test_doctor_fails_an_unreachable_controller_and_says_how_to_reach_it(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "TURNOUT_HOME": str(tmp_path), "TURNOUT_URL": url}
    env.pop("TURNOUT_TOKEN", None)
    out = doctor("--gpus", "none", env=env)
    assert out.returncode == 1
    assert f"[FAIL] controller    cannot reach {url}" in out.stdout
    assert "fix: start it (turnout controller, or turnout up)" in out.stdout
    assert "Traceback" not in out.stderr


def test_doctor_against_a_web_page_says_it_is_not_a_controller(tmp_path: Path, web_page: str) -> None:
    env = {**os.environ, "TURNOUT_HOME": str(tmp_path), "TURNOUT_URL": web_page, "TURNOUT_TOKEN": "tnt_x"}
    out = doctor("--gpus", "none", env=env)
    assert out.returncode == 1
    assert (
        f"[FAIL] controller    {web_page}/healthz answered HTTP 200 text/html, not as a Turnout controller"
        in (out.stdout)
    )
    assert "pip install turnout==" not in out.stdout and "Traceback" not in out.stderr


def test_doctor_with_a_bad_gpu_spec_is_one_line_naming_the_option(tmp_path: Path) -> None:
    env = {**os.environ, "TURNOUT_HOME": str(tmp_path), "TURNOUT_URL": f"http://127.0.0.1:{free_port()}"}
    out = doctor("--gpus", "fake:lots", env=env)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: gpus:")
    assert "fix:" in out.stderr


def test_doctor_fails_an_untrusted_certificate_and_passes_once_the_ca_is_given(
    tmp_path: Path, processes: Any
) -> None:
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    port = free_port()
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TURNOUT_", "SSL_CERT"))}
    env.update(TURNOUT_HOME=str(home), PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    processes.start([sys.executable, "-m", "turnout.cli", "controller", "--port", str(port), "--home", str(home),
                     "--tls-cert", str(cert), "--tls-key", str(key)], env, tmp_path / "controller.log")  # fmt: skip
    url = f"https://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not (home / "admin.token").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    token = (home / "admin.token").read_text().strip()
    args = ("--controller", url, "--token", token, "--gpus", "none", "--json")
    found: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:  # until the controller listens
        found = checks_of(doctor(*args, env=env))
        if "cannot reach" not in found["controller"]["detail"]:
            break
        time.sleep(0.1)
    assert found["tls"]["status"] == "fail" and "not trusted" in found["tls"]["detail"]
    assert "SSL_CERT_FILE" in found["tls"]["fix"]
    trusted = doctor(*args, env={**env, "SSL_CERT_FILE": str(cert)})
    found = checks_of(trusted)
    assert found["tls"] == {
        "name": "tls",
        "status": "ok",
        "detail": f"{url}'s certificate is trusted",
        "fix": "",
    }
    assert found["token"]["status"] == "warn"  # an admin token works, but a worker token is advised
    assert trusted.returncode == 0


def test_clock_skew_warns_past_a_second_and_fails_past_ten() -> None:
    import httpx

    from turnout.api.schemas import iso
    from turnout.doctor import _clock_check

    now = time.time()
    resp = httpx.Response(200)
    assert _clock_check({"time": iso(now)}, resp, now, now).status == "ok"
    late = _clock_check({"time": iso(now - 3)}, resp, now, now)
    assert late.status == "warn" and "3.00 s ahead of the controller's" in late.detail and "NTP" in late.fix
    assert _clock_check({"time": iso(now + 30)}, resp, now, now).status == "fail"
