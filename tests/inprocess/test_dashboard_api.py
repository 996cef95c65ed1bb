"""`GET /v1/whoami` and who may read the dashboard, in-process (the dashboard's data with GPUs held by
running tasks is checked against real workers in tests/integration/test_dashboard_api.py)."""

from __future__ import annotations

from tests.inprocess.conftest import Served


def token(served: Served, role: str, tenant: str = "default") -> str:
    resp = served.call("POST", "/v1/tokens", json={"role": role, "tenant": tenant})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["token"])


def test_whoami_names_each_tokens_role_and_tenant_and_the_controller_clock(served: Served) -> None:
    for role in ("admin", "submit", "worker", "read"):
        body = served.call("GET", "/v1/whoami", token(served, role, "acme")).json()
        assert (body["role"], body["tenant"], body["auth"]) == (role, "acme", True)
        assert body["time"].endswith("Z")
    refused = served.call("GET", "/v1/whoami", "tnt_nope")
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "unauthorized"
    assert served.call("GET", "/v1/dashboard", "").status_code == 401  # data needs a token
    page = served.call("GET", "/", "")  # the page itself does not, and holds no data
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'self'" in page.headers["content-security-policy"]
