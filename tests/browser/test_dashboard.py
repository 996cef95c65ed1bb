"""The dashboard as a person sees it: a real controller, a CPU worker and a fake-GPU worker, in headless Chromium.

What the page shows is checked against the API it reads; screenshots land in test-artifacts/.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser.conftest import DESKTOP, PHONE
from tests.conftest import Cluster

pytestmark = pytest.mark.browser
FAKE_GPUS = "fake:1xA100-40Gi,1xA100-40Gi-mig:3g.20gb,2g.10gb"
WAIT_MS = 30_000

# WCAG relative-luminance contrast of an element's text against the first opaque background behind it
CONTRAST_JS = """(sel) => {
  const rgb = (c) => (c.match(/[\\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => { const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
                               return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b); };
  const out = [];
  for (const el of document.querySelectorAll(sel)) {
    if (!el.offsetParent || !el.textContent.trim()) continue;
    let bg = null;
    for (let n = el; n && !bg; n = n.parentElement) {
      const c = rgb(getComputedStyle(n).backgroundColor);
      if (c.length === 3 || (c.length === 4 && c[3] > 0.9)) bg = c.slice(0, 3);
    }
    bg = bg || [255, 255, 255];
    const [a, b] = [lum(rgb(getComputedStyle(el).color).slice(0, 3)), lum(bg)];
    out.push([el.textContent.trim().slice(0, 30), (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)]);
  }
  return out;
}"""


@pytest.fixture(scope="module")
def fleet(shared_cluster: Cluster) -> Cluster:
    """The shared controller with a CPU worker (the demo app) and a fake-GPU worker (the test app), one in MIG mode."""
    shared_cluster.start_worker("turnout.demo:app", name="cpu-box")
    shared_cluster.start_worker("tests.apps.testapp:app", gpus=FAKE_GPUS, name="gpu-box")
    return shared_cluster


@pytest.fixture(scope="module")
def read_token(fleet: Cluster) -> str:
    resp = fleet.api("POST", "/v1/tokens", json={"role": "read", "tenant": "default"})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["token"])


@pytest.fixture
def page(chromium: Any, fleet: Cluster, read_token: str) -> Iterator[Any]:
    """A fresh browser session on the dashboard, signed in with a read token through the page's own form."""
    context = chromium.new_context(viewport=DESKTOP)
    try:
        pg = context.new_page()
        pg.goto(fleet.url + "/")
        sign_in(pg, read_token)
        yield pg
    finally:
        context.close()


def sign_in(pg: Any, token: str) -> None:
    pg.wait_for_selector("#token-input", state="visible", timeout=WAIT_MS)
    pg.fill("#token-input", token)
    pg.click("#token-form button[type=submit]")
    pg.wait_for_selector("#content", state="visible", timeout=WAIT_MS)


def expect(locator: Any) -> Any:
    from playwright.sync_api import expect as pw_expect

    return pw_expect(locator)


def test_dashboard_asks_for_a_token_keeps_it_out_of_the_url_and_a_read_token_is_enough(
    chromium: Any, fleet: Cluster, read_token: str, artifacts: Path
) -> None:
    context = chromium.new_context(viewport=DESKTOP)
    try:
        pg = context.new_page()
        pg.goto(fleet.url + "/")
        expect(pg.locator("#login")).to_be_visible(timeout=WAIT_MS)
        expect(pg.locator("#content")).to_be_hidden()
        assert pg.evaluate("[...document.querySelectorAll('input')].every(i => i.labels.length > 0)")
        pg.screenshot(path=str(artifacts / "dashboard-token-prompt.png"))

        pg.fill("#token-input", "tnt_not-a-real-token")
        pg.click("#token-form button[type=submit]")
        expect(pg.locator("#login-error")).to_contain_text("not accepted", timeout=WAIT_MS)

        worker_token = fleet.api("POST", "/v1/tokens", json={"role": "worker"}).json()["token"]
        pg.fill("#token-input", worker_token)
        pg.click("#token-form button[type=submit]")
        expect(pg.locator("#login-error")).to_contain_text("cannot read", timeout=WAIT_MS)

        pg.fill("#token-input", read_token)
        pg.click("#token-form button[type=submit]")
        expect(pg.locator("#viewer")).to_have_text("read token · tenant default", timeout=WAIT_MS)
        expect(pg.locator("tr[data-worker-name='cpu-box']")).to_be_visible(timeout=WAIT_MS)
        assert read_token not in pg.url
        assert pg.evaluate("sessionStorage.getItem('turnout.token')") == read_token

        other = context.browser.new_context(viewport=DESKTOP)  # another browser session starts signed out
        try:
            pg2 = other.new_page()
            pg2.goto(fleet.url + "/")
            expect(pg2.locator("#login")).to_be_visible(timeout=WAIT_MS)
        finally:
            other.close()
    finally:
        context.close()


def test_dashboard_shows_the_workers_gpus_and_queues_the_api_reports(
    page: Any, fleet: Cluster, artifacts: Path
) -> None:
    ghosts = [fleet.submit("ghost", {"i": i}, gpu="never", placement_timeout_s=600)["id"] for i in range(3)]
    try:
        workers = fleet.api("GET", "/v1/workers").json()["workers"]
        live = [w for w in workers if w["state"] == "healthy"]
        assert {w["name"] for w in live} >= {"cpu-box", "gpu-box"}
        for w in live:
            row = page.locator(f"tr[data-worker-id='{w['id']}']")
            expect(row.locator("[data-field=state]")).to_have_text(w["state"], timeout=WAIT_MS)
            expect(row.locator("[data-field=gpus]")).to_have_text(str(len(w["gpus"])))
        gpu_box = next(w for w in live if w["name"] == "gpu-box")
        for g in gpu_box["gpus"]:
            card = page.locator(f"article[data-gpu-uuid='{g['uuid']}']")
            expect(card).to_be_visible()
            expect(card.locator("h3")).to_contain_text(f"GPU {g['index']}")
            expect(card.locator("h3")).to_contain_text(g["name"])
            assert g["metrics"]["memory_used_bytes"] == 0  # idle fake GPUs: nothing measured in use
            expect(card.locator("[data-field=memory]").first).to_contain_text(
                f"of {g['memory_total_bytes'] // 1024**3} GiB, 0 B measured in use"
            )
            for mig in g["mig_devices"]:  # MIG devices sit under their parent
                expect(card.locator(f"article[data-gpu-uuid='{mig['uuid']}']")).to_contain_text(
                    mig["profile"]
                )
        queued = fleet.api("GET", "/v1/tasks", params={"state": "queued", "capability": "ghost"}).json()[
            "tasks"
        ]
        row = page.locator("tr[data-capability='ghost'][data-device-class='cpu']")
        expect(row.locator("[data-field=queued]")).to_have_text(str(len(queued)), timeout=WAIT_MS)
        assert len(queued) == 3
        for state in ("queued", "succeeded", "failed"):
            n = len(fleet.api("GET", "/v1/tasks", params={"state": state, "limit": 1000}).json()["tasks"])
            expect(page.locator(f"[data-total={state}]")).to_have_text(str(n), timeout=WAIT_MS)
        expect(page.locator("#pipeline-runs")).to_have_text(
            "No pipeline runs."
        )  # none exist: nothing made up
        page.screenshot(path=str(artifacts / "dashboard-overview-1280.png"), full_page=True)
        assert page.evaluate("document.documentElement.scrollWidth") <= DESKTOP["width"]
        low = [(text, ratio) for text, ratio in page.evaluate(CONTRAST_JS, "td, th, h2, .hint, .state, .meta, a, .card .label")
               if ratio < 4.5]  # fmt: skip
        assert not low, f"text below 4.5:1 contrast: {low[:5]}"
    finally:
        for tid in ghosts:
            fleet.api("POST", f"/v1/tasks/{tid}/cancel")


def test_submitted_work_appears_runs_on_its_gpu_and_finishes_without_a_reload(
    page: Any, fleet: Cluster, artifacts: Path
) -> None:
    page.evaluate("window.__sameDocument = true")
    task = fleet.submit("work", {"sleep": 3}, gpu="require")
    row = page.locator(f"tr[data-task-id='{task['id']}']")
    expect(row).to_be_visible(timeout=WAIT_MS)
    holder = page.locator(f".legend li[data-task-id='{task['id']}']")  # on its GPU's memory bar while it runs
    expect(holder).to_contain_text("tenant default", timeout=WAIT_MS)
    page.screenshot(path=str(artifacts / "dashboard-gpu-task-running.png"), full_page=True)
    done = fleet.result(task["id"])
    assert done["state"] == "succeeded", done["error"]
    expect(row).to_have_attribute("data-state", "succeeded", timeout=WAIT_MS)
    expect(row.locator("[data-field=device]")).to_contain_text(done["device"])
    expect(row.locator("[data-field=routing]")).to_have_text(
        f"{done['routing']['requested']} → {done['routing']['device']}: {done['routing']['reason']}"
    )
    expect(row.locator("[data-field=run_s]")).to_have_text(f"{done['run_s']:.3f}")
    expect(row.locator("[data-field=worker]")).to_have_text("gpu-box")
    expect(row.locator("[data-field=cost_usd]")).to_have_text("\N{EN DASH}")  # no prices: no cost, not $0
    expect(holder).to_have_count(0, timeout=WAIT_MS)  # released from the bar once it finished
    assert page.evaluate("window.__sameDocument") is True


def test_task_page_streams_the_task_events_as_they_happen(page: Any, fleet: Cluster, artifacts: Path) -> None:
    task = fleet.submit("sleep", {"seconds": 2}, gpu="never")
    page.goto(f"{fleet.url}/tasks/{task['id']}")  # the token stays in this tab's session: no prompt
    expect(page.locator("#login")).to_be_hidden()
    expect(page.locator("#events tr[data-event='progress']").first).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#events tr[data-event='finish']")).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#task-fields [data-field=state]")).to_have_text("succeeded", timeout=WAIT_MS)
    page.screenshot(path=str(artifacts / "task-page-1280.png"), full_page=True)
    with httpx.stream("GET", f"{fleet.url}/v1/tasks/{task['id']}/events",
                      headers={"Authorization": f"Bearer {fleet.token}"}, timeout=30) as resp:  # fmt: skip
        events = [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data:")]
    shown = page.locator("#events tbody tr")
    expect(shown).to_have_count(len(events))
    assert [int(s) for s in shown.evaluate_all("rows => rows.map(r => r.dataset.seq)")] == [
        e["seq"] for e in events
    ]
    assert [e["event"] for e in events][-1] == "finish"
    routing = fleet.api("GET", f"/v1/tasks/{task['id']}").json()["routing"]
    expect(page.locator("#task-fields [data-field=routing]")).to_contain_text(routing["reason"])


def test_dashboard_fits_a_phone_screen(page: Any, fleet: Cluster, artifacts: Path) -> None:
    page.set_viewport_size(PHONE)
    expect(page.locator("tr[data-worker-name='gpu-box']")).to_be_visible(timeout=WAIT_MS)
    page.screenshot(path=str(artifacts / "dashboard-phone.png"), full_page=True)
    # wide tables scroll inside their own box; the page itself never scrolls sideways
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
