// Turnout dashboard: plain JavaScript, no build step. It asks the JSON API with the token kept in this tab's
// sessionStorage (sent as an Authorization header, never in a URL), and polls every two seconds; a task page
// streams the task's events with fetch(), which, unlike EventSource, can send that header.
"use strict";
(() => {
  const TOKEN_KEY = "turnout.token";
  const POLL_MS = 2000;
  const page = document.body.dataset.page;
  const $ = (sel) => document.querySelector(sel);
  const TENANT_COLOURS = ["#0b57d0", "#b3261e", "#146c2e", "#8e24aa", "#a15c00", "#00796b", "#c2185b", "#5d4037"];
  const OTHER_COLOUR = "#6e7781";

  class AuthNeeded extends Error {}

  // ---- the token and the API -------------------------------------------------------------------------

  const token = () => sessionStorage.getItem(TOKEN_KEY) || "";

  function headers(extra) {
    const out = Object.assign({ Accept: "application/json" }, extra || {});
    if (token()) out.Authorization = "Bearer " + token();
    return out;
  }

  async function errorText(resp) {
    try {
      const body = await resp.json();
      return (body.error && body.error.message) || resp.statusText;
    } catch (_) {
      return resp.statusText || "HTTP " + resp.status;
    }
  }

  async function checkAuth(resp) {
    if (resp.status === 401) {
      const why = await errorText(resp);
      askForToken(token() ? "That token was not accepted (" + why + "). Paste a valid one." : "");
      throw new AuthNeeded(why);
    }
    if (resp.status === 403) {
      const why = await errorText(resp);
      askForToken("This token cannot read here (" + why + "). Use a read, submit or admin token.");
      throw new AuthNeeded(why);
    }
  }

  async function api(path) {
    const resp = await fetch(path, { headers: headers(), cache: "no-store" });
    await checkAuth(resp);
    if (!resp.ok) throw new Error(await errorText(resp));
    return resp.json();
  }

  function askForToken(message) {
    $("#login").hidden = false;
    $("#content").hidden = true;
    $("#login-error").textContent = message || "";
    setConn("sign-in needed");
    $("#token-input").focus();
  }

  function setConn(text) {
    $("#conn").textContent = text;
  }

  $("#token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const value = $("#token-input").value.trim();
    if (!value) return;
    sessionStorage.setItem(TOKEN_KEY, value);
    $("#token-input").value = "";
    $("#login").hidden = true;
    $("#content").hidden = false;
    start();
  });

  $("#forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    $("#viewer").textContent = "";
    $("#forget").hidden = true;
    askForToken("Token forgotten.");
  });

  // ---- formatting ---------------------------------------------------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "style") Object.assign(node.style, value); // CSSOM: allowed where inline style attributes are not (CSP)
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    let v = Number(n);
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return (Number.isInteger(v) ? v : v.toFixed(1)) + " " + units[i];
  }

  const secs = (s) => (s === null || s === undefined ? "–" : Number(s).toFixed(3));
  const usd = (c) => (c === null || c === undefined ? "–" : c === 0 ? "$0" : "$" + Number(c).toFixed(c >= 1 ? 2 : 6));
  const clock = (iso) => (iso ? new Date(iso).toLocaleTimeString() : "–");
  const shortId = (id) => (id && id.length > 16 ? id.slice(0, 8) + "…" + id.slice(-6) : id || "");

  function colour(tenant) {
    if (tenant === "other tenants") return OTHER_COLOUR;
    let h = 0;
    for (const ch of tenant) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
    return TENANT_COLOURS[h % TENANT_COLOURS.length];
  }

  const badge = (state) => el("span", { class: "state " + state }, state);

  function routingText(r) {
    if (!r) return "–";
    return (r.requested || "?") + " → " + (r.device || "?") + ": " + (r.reason || "");
  }

  // Replace a table body only when its rows changed, so focus and selection survive a quiet refresh.
  const lastRows = new Map();
  function fillTable(id, rows, emptyText, columns) {
    const key = JSON.stringify(rows.map((r) => r.key));
    const tbody = document.querySelector("#" + id + " tbody");
    if (lastRows.get(id) === key && tbody.dataset.filled === "1") return;
    const previous = new Set(tbody.dataset.keys ? JSON.parse(tbody.dataset.keys) : []);
    tbody.replaceChildren(
      ...(rows.length
        ? rows.map((r) => {
            const tr = r.node;
            if (tbody.dataset.filled === "1" && r.id && !previous.has(r.id)) tr.classList.add("fresh");
            return tr;
          })
        : [el("tr", { class: "empty" }, el("td", { colspan: columns }, emptyText))])
    );
    tbody.dataset.keys = JSON.stringify(rows.map((r) => r.id).filter(Boolean));
    tbody.dataset.filled = "1";
    lastRows.set(id, key);
  }

  // ---- the overview -------------------------------------------------------------------------------------

  function renderTotals(t) {
    for (const name of ["queued", "running", "succeeded", "failed"]) {
      document.querySelector('[data-total="' + name + '"]').textContent = String(t[name] || 0);
    }
    document.querySelector('[data-total="cost_usd"]').textContent = usd(t.cost_usd);
  }

  function renderWorkers(workers) {
    const rows = workers.map((w) => ({
      id: w.id,
      key: [w.id, w.state, w.health, w.active_tasks, Math.round(w.heartbeat_age_s), w.capabilities.join(",")],
      node: el("tr", { "data-worker-id": w.id, "data-worker-name": w.name },
        el("td", {}, w.name),
        el("td", { "data-field": "state" }, badge(w.state)),
        el("td", { "data-field": "health" }, w.health),
        el("td", {}, w.host),
        el("td", { class: "num" }, String(w.cpu)),
        el("td", { class: "num", "data-field": "gpus" }, String(w.gpus.length)),
        el("td", { class: "num", "data-field": "active_tasks" }, String(w.active_tasks)),
        el("td", {}, Math.round(w.heartbeat_age_s) + " s ago"),
        el("td", {}, w.capabilities.join(", "))),
    }));
    fillTable("workers", rows, "No workers.", 9);
  }

  function bar(unit, allocations) {
    const total = unit.memory_total_bytes || 1;
    const segs = allocations.map((a) =>
      el("span", {
        class: "seg",
        style: { width: Math.min(100, (100 * a.memory_bytes) / total).toFixed(2) + "%", background: colour(a.tenant) },
        title: (a.task_id ? a.task_id + " · " : "") + a.tenant + " · " + bytes(a.memory_bytes),
      })
    );
    const allocated = allocations.reduce((s, a) => s + a.memory_bytes, 0);
    let label = bytes(allocated) + " allocated of " + bytes(unit.memory_total_bytes);
    const node = el("div", { class: "bar", role: "img" }, segs);
    if (unit.memory_used_bytes !== null && unit.memory_used_bytes !== undefined) {
      label += ", " + bytes(unit.memory_used_bytes) + " measured in use";
      const at = Math.min(100, (100 * unit.memory_used_bytes) / total).toFixed(2);
      node.append(el("span", { class: "used", style: { left: "calc(" + at + "% - 1px)" } }));
    }
    node.setAttribute("aria-label", label);
    return [node, el("p", { class: "meta", "data-field": "memory" }, label)];
  }

  function legend(allocations) {
    if (!allocations.length) return el("p", { class: "hint" }, "No tasks on it.");
    return el("ul", { class: "legend" }, allocations.map((a) =>
      el("li", { "data-task-id": a.task_id || "" },
        el("span", { class: "swatch", style: { background: colour(a.tenant) }, "aria-hidden": "true" }),
        a.task_id ? el("a", { href: "/tasks/" + encodeURIComponent(a.task_id) }, shortId(a.task_id)) : "a task",
        " " + (a.capability || "") + " · tenant " + a.tenant + " · " + bytes(a.memory_bytes) + (a.exclusive ? " (whole GPU)" : ""))));
  }

  function gpuCard(worker, g, isMig) {
    const readings = [];
    if (g.utilization_pct !== null && g.utilization_pct !== undefined) readings.push(el("span", { "data-field": "utilization" }, "utilization " + Math.round(g.utilization_pct) + "%"));
    if (g.temperature_c !== null && g.temperature_c !== undefined) readings.push(el("span", { "data-field": "temperature" }, Math.round(g.temperature_c) + " °C"));
    if (g.power_w !== null && g.power_w !== undefined) readings.push(el("span", {}, Math.round(g.power_w) + " W"));
    if (!isMig) readings.push(el("span", {}, "health " + g.health));
    const allocations = isMig ? g.allocations : g.allocations.concat(...g.mig_devices.map((m) => m.allocations));
    const title = isMig ? "MIG " + (g.mig_profile || "") : "GPU " + g.index + " · " + g.name + " · " + worker.name;
    return el("article", { class: "gpu" + (g.quarantined ? " quarantined" : ""), "data-gpu-uuid": g.uuid, "aria-label": title },
      el(isMig ? "h4" : "h3", {}, title),
      el("div", { class: "meta" }, readings, el("span", {}, g.uuid)),
      g.quarantined ? el("p", { class: "reason", "data-field": "quarantined" }, "Quarantined: " + g.quarantined) : null,
      bar(g, allocations),
      legend(isMig ? allocations : g.allocations),
      isMig || !g.mig_devices.length ? null : el("div", { class: "mig" }, g.mig_devices.map((m) => gpuCard(worker, m, true))));
  }

  let lastGpus = "";
  function renderGpus(workers) {
    const key = JSON.stringify(workers.map((w) => [w.name, w.gpus]));
    if (key === lastGpus) return;
    lastGpus = key;
    const cards = workers.flatMap((w) => w.gpus.map((g) => gpuCard(w, g, false)));
    $("#gpus").replaceChildren(...(cards.length ? cards : [el("p", { class: "empty" }, "No GPUs.")]));
  }

  function renderQueues(queues) {
    const rows = queues.map((q) => ({
      id: q.capability + "/" + q.device_class,
      key: [q.capability, q.device_class, q.queued, q.running],
      node: el("tr", { "data-capability": q.capability, "data-device-class": q.device_class },
        el("td", {}, q.capability), el("td", {}, q.device_class),
        el("td", { class: "num", "data-field": "queued" }, String(q.queued)),
        el("td", { class: "num", "data-field": "running" }, String(q.running))),
    }));
    fillTable("queues", rows, "Nothing queued or running.", 4);
  }

  function renderTasks(tasks, workers) {
    const names = new Map(workers.map((w) => [w.id, w.name]));
    const rows = tasks.map((t) => ({
      id: t.id,
      key: [t.id, t.state, t.device, t.worker, t.run_s, t.cost_usd],
      node: el("tr", { "data-task-id": t.id, "data-state": t.state },
        el("td", {}, el("a", { href: "/tasks/" + encodeURIComponent(t.id) }, shortId(t.id))),
        el("td", {}, t.capability),
        el("td", { "data-field": "state" }, badge(t.state)),
        el("td", { "data-field": "device" }, (t.device || "–") + (t.gpu_model ? " (" + t.gpu_model + ")" : "")),
        el("td", { "data-field": "worker" }, t.worker ? names.get(t.worker) || shortId(t.worker) : "–"),
        el("td", { "data-field": "routing" }, routingText(t.routing)),
        el("td", { class: "num", "data-field": "run_s" }, secs(t.run_s)),
        el("td", { class: "num", "data-field": "cost_usd" }, usd(t.cost_usd)),
        el("td", {}, clock(t.created_at))),
    }));
    fillTable("tasks", rows, "No tasks yet.", 9);
  }

  let pipelinesApi = true;
  async function renderPipelines() {
    if (!pipelinesApi) return;
    const resp = await fetch("/v1/pipeline-runs?limit=10", { headers: headers(), cache: "no-store" });
    if (resp.status === 404 || resp.status === 405) {
      pipelinesApi = false; // this controller has no pipelines yet: the panel keeps saying so
      return;
    }
    if (!resp.ok) return;
    const runs = (await resp.json()).pipeline_runs || [];
    $("#pipeline-runs").replaceChildren(runs.length
      ? el("div", { class: "scroll" }, el("table", {},
          el("thead", {}, el("tr", {}, ["Run", "Pipeline", "State", "Cost", "GPU-only cost", "Saving"].map((h) => el("th", { scope: "col" }, h)))),
          el("tbody", {}, runs.map((r) => el("tr", { "data-run-id": r.id },
            el("td", {}, shortId(r.id)), el("td", {}, r.pipeline || ""), el("td", {}, badge(r.state || "")),
            el("td", { class: "num" }, usd(r.cost_usd)), el("td", { class: "num" }, usd(r.gpu_only_cost_usd)),
            el("td", { class: "num" }, r.cost_usd !== null && r.gpu_only_cost_usd ? Math.round(100 * (1 - r.cost_usd / r.gpu_only_cost_usd)) + "%" : "–"))))))
      : el("p", { class: "empty" }, "No pipeline runs."));
  }

  async function refreshOverview() {
    const snap = await api("/v1/dashboard");
    renderTotals(snap.totals);
    renderGpus(snap.workers);
    renderWorkers(snap.workers);
    renderQueues(snap.queues);
    renderTasks(snap.tasks, snap.workers);
    await renderPipelines();
    setConn("live · updated " + clock(snap.time));
  }

  // ---- the task page ------------------------------------------------------------------------------------

  let taskDone = false;

  function showJson(id, value) {
    $(id).textContent = value === null || value === undefined ? "–" : JSON.stringify(value, null, 2);
  }

  const workerNames = new Map();
  async function refreshTask() {
    const id = document.body.dataset.taskId;
    const t = await api("/v1/tasks/" + encodeURIComponent(id));
    if (t.worker && !workerNames.has(t.worker)) {
      for (const w of (await api("/v1/workers")).workers) workerNames.set(w.id, w.name);
    }
    const fields = {
      state: badge(t.state), capability: t.capability,
      device: (t.device || "–") + (t.gpu_model ? " (" + t.gpu_model + ")" : ""),
      routing: routingText(t.routing), worker: t.worker ? (workerNames.get(t.worker) || "") + " (" + t.worker + ")" : "–", gpus: (t.gpus || []).join(", ") || "–",
      attempts: String(t.attempts), queue_s: secs(t.queue_s), run_s: secs(t.run_s), cost_usd: usd(t.cost_usd),
      created_at: t.created_at || "–", finished_at: t.finished_at || "–",
    };
    for (const [name, value] of Object.entries(fields)) {
      document.querySelector('#task-fields [data-field="' + name + '"]').replaceChildren(value);
    }
    document.body.dataset.state = t.state;
    showJson("#task-input", t.input);
    showJson("#task-output", t.output);
    showJson("#task-error", t.error);
    setConn("live · updated " + new Date().toLocaleTimeString());
    return t;
  }

  function eventDetails(e) {
    switch (e.event) {
      case "progress": return (e.done ?? "?") + " / " + (e.total ?? "?");
      case "text_delta": return e.delta ?? "";
      case "text": return e.content ?? "";
      case "log": return "[" + (e.stream || "log") + "] " + (e.line ?? "");
      case "worker": return (e.status || "") + (e.message ? ": " + e.message : "");
      case "result": return JSON.stringify(e.data ?? null);
      case "finish": return (e.status || "") + (e.error ? ": " + (e.error.type || "") + " " + (e.error.message || "") : "");
      default: {
        const rest = Object.assign({}, e);
        for (const k of ["event", "seq", "ts"]) delete rest[k];
        return JSON.stringify(rest);
      }
    }
  }

  function addEvent(e) {
    const tbody = $("#events tbody");
    tbody.append(el("tr", { "data-seq": e.seq, "data-event": e.event },
      el("td", { class: "num" }, String(e.seq)), el("td", {}, clock(e.ts)),
      el("td", {}, e.event), el("td", {}, eventDetails(e))));
  }

  async function streamEvents() {
    const id = document.body.dataset.taskId;
    let after = 0;
    $("#events tbody").replaceChildren();
    for (;;) {
      const extra = after ? { "Last-Event-ID": String(after) } : {};
      extra.Accept = "text/event-stream";
      const resp = await fetch("/v1/tasks/" + encodeURIComponent(id) + "/events", { headers: headers(extra), cache: "no-store" });
      await checkAuth(resp);
      if (!resp.ok) {
        $("#events-status").textContent = "Events unavailable: " + (await errorText(resp));
        return;
      }
      $("#events-status").textContent = "Streaming events…";
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer = (buffer + decoder.decode(value, { stream: true })).replace(/\r\n/g, "\n");
        const frames = buffer.split("\n\n");
        buffer = frames.pop();
        for (const frame of frames) {
          const data = frame.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
          if (!data) continue;
          const event = JSON.parse(data);
          after = event.seq || after;
          addEvent(event);
          if (event.event === "finish") {
            $("#events-status").textContent = "The task finished; all its events are above.";
            taskDone = true;
            await refreshTask();
            return;
          }
        }
      }
      await new Promise((r) => setTimeout(r, 1000)); // the connection dropped: resume after the last seen
    }
  }

  // ---- start --------------------------------------------------------------------------------------------

  let running = false;
  async function loop(step) {
    for (;;) {
      try {
        await step();
      } catch (e) {
        if (e instanceof AuthNeeded) { running = false; return; }
        setConn("cannot reach the controller (" + e.message + "); retrying");
      }
      if (taskDone) return;
      await new Promise((r) => setTimeout(r, POLL_MS));
    }
  }

  async function start() {
    if (running) return;
    running = true;
    try {
      const me = await api("/v1/whoami");
      $("#viewer").textContent = me.auth ? me.role + " token · tenant " + me.tenant : "auth off";
      $("#forget").hidden = !me.auth;
    } catch (e) {
      if (e instanceof AuthNeeded) { running = false; return; }
    }
    if (page === "overview") {
      loop(refreshOverview);
    } else if (page === "task") {
      loop(refreshTask); // until the event stream has seen `finish` (taskDone)
      streamEvents().catch((e) => {
        if (!(e instanceof AuthNeeded)) $("#events-status").textContent = "Event stream failed: " + e.message;
      });
    }
  }

  start();
})();
