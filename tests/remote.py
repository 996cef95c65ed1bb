"""Remote workers for tests: a private CA and a TLS controller, and a network namespace with a veth pair.

`private_ca` makes a CA and a server certificate for the given IP addresses with `openssl`.
`veth_namespace` makes a network namespace joined to this one by a veth pair of its own, addressed from a
/30 that nothing on this host uses (10.200.X.Y): the controller listens on the host end, a worker runs in
the namespace, and the link can be cut (`cut()`) and restored (`restore()`). Traffic stays between the two
ends. Everything made is removed on exit, also when the test fails: processes left in the namespace are
killed, the veth pair and the namespace deleted. Where this host does not permit it (not root, no `ip`),
the test is skipped with the reason.

`TlsCluster` is `tests.conftest.Cluster` over https on a chosen address, trusting the private CA.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import Cluster
from turnout.tls import tls_verify


@dataclass(frozen=True)
class Tls:
    ca: Path
    cert: Path
    key: Path


def private_ca(tmp: Path, ips: list[str]) -> Tls:
    """A CA, and a certificate it signed for `ips` (subjectAltName), as PEM files under `tmp`."""
    run = lambda *argv: subprocess.run(argv, check=True, capture_output=True, cwd=tmp)  # noqa: E731
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(
        "openssl",
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=Turnout test CA",
    )
    run(
        "openssl",
        "req",
        *ec,
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=turnout-controller",
    )
    (tmp / "san.ext").write_text("subjectAltName=" + ",".join(f"IP:{ip}" for ip in ips) + "\n")
    run("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    return Tls(tmp / "ca.pem", tmp / "server.pem", tmp / "server.key")


@dataclass(frozen=True)
class Netns:
    name: str
    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        """Take the namespace's end of the link down: nothing passes either way, no connection is closed."""
        _ip("-n", self.name, "link", "set", self.ns_if, "down")

    def restore(self) -> None:
        _ip("-n", self.name, "link", "set", self.ns_if, "up")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _free_subnet() -> tuple[str, str]:
    """(host ip, namespace ip) of a /30 in 10.200.0.0/16 that no interface here uses."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=30).stdout
    for _ in range(100):
        third, base = random.randrange(256), 4 * random.randrange(64)
        if f"10.200.{third}." not in used:
            return f"10.200.{third}.{base + 1}", f"10.200.{third}.{base + 2}"
    raise RuntimeError("no free /30 in 10.200.0.0/16")


@contextlib.contextmanager
def veth_namespace() -> Iterator[Netns]:
    name = f"tnt{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except (OSError, subprocess.CalledProcessError) as exc:
        why = (
            exc.stderr.decode(errors="replace").strip()
            if isinstance(exc, subprocess.CalledProcessError)
            else exc
        )
        pytest.skip(f"network namespaces are not permitted here (`ip netns add` failed: {why})")
    host_ip, ns_ip = _free_subnet()
    netns = Netns(name, f"{name}h", f"{name}n", host_ip, ns_ip)
    try:
        _ip("link", "add", netns.host_if, "type", "veth", "peer", "name", netns.ns_if)
        _ip("link", "set", netns.ns_if, "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", netns.host_if)
        _ip("link", "set", netns.host_if, "up")
        _ip("-n", name, "addr", "add", f"{ns_ip}/30", "dev", netns.ns_if)
        _ip("-n", name, "link", "set", netns.ns_if, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield netns
    finally:
        pids = subprocess.run(
            ["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30
        ).stdout
        for pid in pids.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", netns.host_if)  # deletes its peer in the namespace too
        _ip("netns", "del", name)


@dataclass
class TlsCluster(Cluster):
    """A controller serving https on `host` with a certificate of the private CA in `tls`."""

    host: str = "127.0.0.1"
    tls: Tls | None = None

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        env = super().env
        assert self.tls is not None
        env["TURNOUT_CA_CERT"] = str(self.tls.ca)
        return env

    def controller_argv(self, port: int) -> list[str]:
        assert self.tls is not None
        return [*super().controller_argv(port), "--host", self.host,
                "--tls-cert", str(self.tls.cert), "--tls-key", str(self.tls.key)]  # fmt: skip

    def healthz_at(self) -> tuple[str, ssl.SSLContext | bool]:
        assert self.tls is not None
        return f"https://{self.host}", tls_verify(self.tls.ca)

    def api(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        assert self.tls is not None
        headers = {"Authorization": f"Bearer {self.token}", **dict(kwargs.pop("headers", None) or {})}  # type: ignore[call-overload]
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=60, verify=tls_verify(self.tls.ca),  # type: ignore[arg-type]
                             **kwargs)  # fmt: skip

    def start_remote_worker(self, netns: Netns | None, *apps: str, name: str, extra: list[str] | None = None,
                            wait: bool = True) -> subprocess.Popen[bytes]:  # fmt: skip
        """A worker (in `netns`, if given) reaching the controller over https with `--ca-cert`."""
        assert self.tls is not None
        argv = [*(netns.exec_prefix() if netns else []), sys.executable, "-m", "turnout.cli", "worker", *apps,
                "--controller", self.url, "--ca-cert", str(self.tls.ca), "--token", self.token, "--gpus", "none",
                "--name", name, "--heartbeat-s", str(self.heartbeat_s), *(extra or [])]  # fmt: skip
        env = {k: v for k, v in self.env.items() if k not in ("TURNOUT_CA_CERT", "TURNOUT_TOKEN")}
        proc = self.procs.start(argv, env, self.tmp / f"worker-{name}.log")
        if wait:
            self.wait_for_worker(name)
        return proc
