"""`turnout token create|list|revoke` and `turnout audit` as an operator and a tenant's admin run them."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import Cluster


def cli_as(cluster: Cluster, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "turnout.cli", *args], env={**cluster.env, "TURNOUT_TOKEN": token},
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip


def test_the_operator_and_a_tenant_admin_manage_tokens_from_the_cli(cluster: Cluster) -> None:
    made = cluster.cli("token", "create", "--role", "admin", "--tenant", "acme")
    assert made.returncode == 0, made.stderr
    acme_admin = json.loads(made.stdout)
    assert (
        acme_admin["role"] == "admin"
        and acme_admin["tenant"] == "acme"
        and acme_admin["token"].startswith("tnt_")
    )

    # the tenant's admin: its own tenant by default, nothing wider
    sub = cli_as(cluster, acme_admin["token"], "token", "create", "--role", "submit")
    assert sub.returncode == 0 and json.loads(sub.stdout)["tenant"] == "acme"
    wider = cli_as(cluster, acme_admin["token"], "token", "create", "--role", "worker", "--tenant", "*")
    assert wider.returncode == 2 and "acme" in wider.stderr and "Traceback" not in wider.stderr
    listed = json.loads(cli_as(cluster, acme_admin["token"], "token", "list", "--json").stdout)["tokens"]
    assert {t["tenant"] for t in listed} == {"acme"} and len(listed) == 2
    assert all("token" not in t for t in listed)  # shown once, at creation, never again

    everyone = json.loads(cluster.cli("token", "list", "--json").stdout)["tokens"]
    assert {t["tenant"] for t in everyone} == {"*", "acme"}  # the operator's own token is "*"
    operator_id = next(t["id"] for t in everyone if t["tenant"] == "*")
    refused = cli_as(cluster, acme_admin["token"], "token", "revoke", operator_id)
    assert refused.returncode == 2 and "not found" in refused.stderr

    revoked = cli_as(cluster, acme_admin["token"], "token", "revoke", json.loads(sub.stdout)["id"])
    assert revoked.returncode == 0, revoked.stderr
    gone = cli_as(cluster, json.loads(sub.stdout)["token"], "tasks")
    assert gone.returncode == 2 and "revoked" in gone.stderr

    bad = cluster.cli("token", "create", "--role", "root")
    assert bad.returncode == 2 and "role" in bad.stderr and "Traceback" not in bad.stderr

    audit = cli_as(cluster, acme_admin["token"], "audit", "--jsonl")
    kinds = [json.loads(line)["kind"] for line in audit.stdout.splitlines()]
    assert kinds == ["token_created", "token_created", "token_revoked"]  # acme's own records only
    table = cluster.cli("audit", "--kind", "token_revoked")
    assert table.returncode == 0 and "token_revoked" in table.stdout
