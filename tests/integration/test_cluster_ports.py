"""The test clusters' controller start, against a port another process took between `free_port` and the bind.

Given a port that another server holds (and that answers `/healthz` with 200), when a cluster's first start
picks it, then the controller moves to a fresh port and the cluster talks to its own controller, never the
other server; a restart, whose workers know the port, does not move.
"""

from __future__ import annotations

import http.server
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.common import Processes
from tests.conftest import Cluster, http_stand_in


class Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def squatter() -> Iterator[int]:
    """A port held by a server that answers every GET with 200."""
    with http_stand_in(Healthy) as url:
        yield int(url.rsplit(":", 1)[1])


def test_a_first_start_on_a_taken_port_moves_to_a_fresh_one(
    tmp_path: Path, processes: Processes, squatter: int
) -> None:
    cluster = Cluster(tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}", port=squatter)
    cluster.start_controller()
    assert cluster.port != squatter
    assert cluster.api("GET", "/v1/workers").status_code == 200  # its own controller: the token is its own


def test_a_restart_on_a_taken_port_fails_rather_than_move(
    tmp_path: Path, processes: Processes, squatter: int
) -> None:
    cluster = Cluster(tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}")
    cluster.start_controller()
    cluster.kill_controller()
    cluster.port = squatter  # as if another process took its port while it was down
    with pytest.raises(RuntimeError, match="is taken"):
        cluster.start_controller()
