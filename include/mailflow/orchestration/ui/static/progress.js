// mailflow campaign progress page: renders the JSON of the plugin's API and keeps it live while
// sends are active: server-sent events first, polling as the fallback, nothing once done.
// Every value is written with textContent (never as HTML).
(function () {
  "use strict";
  const body = document.body;
  const root = body.dataset.root || "";
  const campaign = body.dataset.campaign || "";
  const refreshMs = Number(body.dataset.refreshMs) || 2000;
  const params = new URLSearchParams(window.location.search);
  const forcePoll = params.get("live") === "poll";
  const api = campaign ? `${root}/api/campaigns/${encodeURIComponent(campaign)}` : `${root}/api/campaigns`;
  const streamUrl = `${api.replace(/\/api\/campaigns$/, "/api")}/stream`;
  const live = document.getElementById("live");
  const updated = document.getElementById("updated");
  let source = null;
  let pollTimer = null;

  const COUNTS = [
    ["total", "Total"], ["pending", "Pending"], ["sending", "Sending"], ["sent", "Sent"], ["failed", "Failed"],
    ["cancelled", "Cancelled"], ["duplicate", "Duplicate"], ["skipped", "Skipped"], ["holdout", "Holdout"],
    ["invalid", "of failed: invalid"],
    ["rolled_back", "Rolled back"], ["dead_lettered", "Dead letters"],
    ["percent_done", "Done %"], ["send_rate_per_min", "Rate /min"], ["eta", "ETA"], ["next_due_at", "Next due"],
    ["last_sent_at", "Last sent"],
  ];
  // the columns every summary shows (mailflow.model.tally): the states add up to total
  const LIST = ["total", "pending", "sending", "sent", "failed", "cancelled", "duplicate", "skipped", "holdout",
    "rolled_back", "dead_lettered"];
  const RATES = [["delivered_rate", "Delivered"], ["hard_bounce_rate", "Hard bounces"], ["complaint_rate", "Complaints"]];

  function setLive(state, text) {
    live.dataset.state = state;
    live.textContent = text;
  }

  function when(iso) {
    if (!iso) return "";
    const d = new Date(iso);
    return isNaN(d) ? String(iso) : d.toLocaleString();
  }

  function cell(tr, text, cls, field) {
    const td = document.createElement("td");
    td.textContent = text === null || text === undefined ? "" : String(text);
    if (cls) td.className = cls;
    if (field) td.dataset.field = field;
    tr.appendChild(td);
    return td;
  }

  function fill(tbody, rows, build) {
    const frag = document.createDocumentFragment();
    rows.forEach((r) => { const tr = document.createElement("tr"); build(tr, r); frag.appendChild(tr); });
    tbody.replaceChildren(frag);
  }

  function pct(td, value) {
    const bar = document.createElement("span");
    bar.className = "pct";
    const fillEl = document.createElement("i");
    fillEl.style.width = `${Math.max(0, Math.min(100, Number(value) || 0))}%`;
    bar.appendChild(fillEl);
    td.textContent = "";
    td.appendChild(bar);
    td.appendChild(document.createTextNode(`${Number(value).toFixed(1)}%`));
  }

  function rate(v) {
    return v === null || v === undefined ? "-" : `${(Number(v) * 100).toFixed(Number(v) < 0.01 ? 2 : 1)}%`;
  }

  // The guard: "ok", or "tripped" with the reason (the campaign's own, else a provider account's).
  function guard(p) {
    if (p.guard_state === "tripped") return ["tripped", p.guard_reason || ""];
    if (p.account_guard_state === "tripped") return ["tripped", `account: ${p.account_guard_reason || ""}`];
    return ["ok", ""];
  }

  // Why a scheduled campaign does not send as planned (mailflow.sources.scheduled.holds).
  const HOLDS = { paused: "paused", guard_account: "account tripped", guard_campaign: "guard tripped",
                  guard_waiting: "waiting for outcomes",
                  canary: "canary waiting" };

  function holdNote(p) {
    const div = document.createElement("div");
    div.className = "hold";
    div.dataset.field = "hold";
    div.dataset.testid = "hold";
    div.hidden = !p.hold;
    if (p.hold) {
      const b = document.createElement("strong");
      b.textContent = `Held: ${HOLDS[p.hold.kind] || p.hold.kind}. `;
      div.append(b, document.createTextNode(p.hold.reason));
    }
    return div;
  }

  function guardCell(tr, p) {
    const [state, reason] = guard(p);
    const td = cell(tr, state, `guard-${state}`, "guard_state");
    if (reason) td.title = reason;
    return td;
  }

  function shortWhen(iso) {
    if (!iso) return "";
    const d = new Date(iso);
    return isNaN(d) ? String(iso) : d.toLocaleString(undefined, { month: "short", day: "numeric", hour: "2-digit",
                                                                    minute: "2-digit" });
  }

  function renderList(data) {
    const rows = data.campaigns || [];
    document.getElementById("empty").hidden = rows.length > 0;
    fill(document.querySelector("#campaigns tbody"), rows, (tr, c) => {
      tr.dataset.campaign = c.campaign;
      tr.dataset.active = String(c.active);
      if (c.active) tr.className = "active";
      const td = document.createElement("td");
      const a = document.createElement("a");
      a.href = `${root}/campaigns/${encodeURIComponent(c.campaign)}`;
      a.textContent = c.campaign;
      td.appendChild(a);
      tr.appendChild(td);
      const kind = cell(tr, `${c.kind}: ${c.campaign_status || (c.kind === "lifecycle" ? "hourly" : "")}`
        + (c.hold ? `, held (${HOLDS[c.hold.kind] || c.hold.kind})` : ""), c.hold ? "kind held" : "kind", "kind");
      if (c.hold) kind.title = c.hold.reason;
      LIST.forEach((k) => cell(tr, c[k], "n", k));
      pct(cell(tr, "", "", "percent_done"), c.percent_done);
      cell(tr, c.send_rate_per_min, "n", "send_rate_per_min");
      RATES.forEach(([k]) => cell(tr, rate(c[k]), "n", k));
      guardCell(tr, c);
      const eta = cell(tr, c.eta ? shortWhen(c.eta) : (c.active ? "unknown" : ""), "", "eta");
      if (c.eta) eta.title = when(c.eta);
    });
  }

  function renderCampaign(data) {
    const p = data.progress;
    document.getElementById("title-campaign").textContent = p.campaign;
    const dl = document.getElementById("progress");
    dl.dataset.active = String(p.active);
    dl.replaceChildren(...COUNTS.map(([k, label]) => {
      const div = document.createElement("div");
      const dt = document.createElement("dt");
      dt.textContent = label;
      const dd = document.createElement("dd");
      dd.dataset.field = k;
      const v = p[k];
      dd.textContent = v === null || v === undefined ? "-"
        : (/_at$|^eta$/.test(k) ? when(v) : (k === "percent_done" ? Number(v).toFixed(1) : String(v)));
      div.append(dt, dd);
      return div;
    }));
    document.getElementById("bar-fill").style.width = `${Number(p.percent_done) || 0}%`;
    document.getElementById("hold").replaceWith(Object.assign(holdNote(p), { id: "hold" }));
    const [gstate, greason] = guard(p);
    const outcomes = document.getElementById("outcomes");
    outcomes.replaceChildren(...RATES.map(([k, label]) => {
      const div = document.createElement("div");
      const dt = document.createElement("dt");
      dt.textContent = `${label} (of sent)`;
      const dd = document.createElement("dd");
      dd.dataset.field = k;
      dd.textContent = rate(p[k]);
      div.append(dt, dd);
      return div;
    }), (() => {
      const div = document.createElement("div");
      div.className = `guard guard-${gstate}`;
      const dt = document.createElement("dt");
      dt.textContent = "Reputation guard";
      const dd = document.createElement("dd");
      dd.dataset.field = "guard_state";
      dd.textContent = gstate;
      const why = document.createElement("p");
      why.dataset.field = "guard_reason";
      why.textContent = greason;
      div.append(dt, dd, why);
      return div;
    })());
    if (data.days) {
      fill(document.querySelector("#days tbody"), data.days, (tr, d) => {
        cell(tr, d.day);
        ["minted", "sent", "failed", "rolled_back", "cancelled", "duplicate", "skipped", "holdout", "dead_lettered",
          "unique_users"]
          .forEach((k) => cell(tr, d[k], "n", k));
      });
    }
    fill(document.querySelector("#recent tbody"), data.recent || [], (tr, r) => {
      tr.dataset.row = r.send_log_id;
      cell(tr, r.send_log_id);
      cell(tr, when(r.sent_at || r.claimed_at || r.minted_at));
      cell(tr, r.user_id);
      cell(tr, r.email, "", "email");
      cell(tr, r.rolled_back ? "failed (rolled back)" : r.status, `status-${r.status}`, "status");
      cell(tr, r.attempts, "n");
      cell(tr, r.error, "err", "error");
    });
    fill(document.querySelector("#errors tbody"), data.errors || [], (tr, e) => {
      cell(tr, e.error, "err", "error");
      cell(tr, e.dead_lettered ? "dead letter" : (e.rolled_back ? "rolled back" : "rejected"));
      cell(tr, e.emails, "n", "emails");
      cell(tr, when(e.last_at));
    });
  }

  // -- charts (uPlot, vendored: static/uPlot.iife.min.js) ---------------------------------------
  const seriesUrl = campaign ? `${api}/series` : `${root}/api/series`;
  const COLORS = ["#017cee", "#e8590c", "#2f9e44", "#ae3ec9", "#f59f00", "#1098ad", "#c2255c", "#5c7cfa"];
  const charts = {};
  let seriesAt = 0;
  let seriesBusy = false;

  function chartWidth(el) {
    return Math.max(320, Math.floor(el.getBoundingClientRect().width || el.parentElement.clientWidth || 600) - 4);
  }

  function draw(key, el, opts, data, meta) {
    if (charts[key]) { charts[key].destroy(); delete charts[key]; }
    el.replaceChildren();
    Object.assign(el.dataset, meta);
    if (typeof uPlot === "undefined") { el.textContent = "chart library missing"; return; }
    // the x range the chart really drew (epoch seconds), for tests and for reading the page
    const shown = (u, scale) => {
      if (scale !== "x") return;
      el.dataset.scaleMin = String(u.scales.x.min);
      el.dataset.scaleMax = String(u.scales.x.max);
    };
    charts[key] = new uPlot({ width: chartWidth(el), height: 240, ...opts, hooks: { setScale: [shown] } }, data, el);
  }

  function drawSends(s) {
    const el = document.getElementById("chart-sends");
    const names = Object.keys(s.series);
    const unit = s.unit;
    document.getElementById("sends-title").textContent =
      unit === "minute" ? "Sends per minute (live, last 2 hours)" : "Sends per day";
    const total = names.reduce((acc, n) => acc + s.series[n].reduce((a, b) => a + b, 0), 0);
    const bars = uPlot.paths && uPlot.paths.bars ? uPlot.paths.bars({ size: [0.8, 40] }) : undefined;
    const step = unit === "minute" ? 60 : 86400;
    const [x0, x1] = fitted(s.t, step);
    draw("sends", el, {
      // the data's own first and last step, half a step of room on each side: a single day or
      // minute is a bar, not a whole axis (see fitted)
      scales: { x: { time: true, range: () => [x0, x1] },
                y: { range: (u, min, max) => [0, Math.max(1, max)] } },
      axes: [{}, { label: unit === "minute" ? "emails / min" : "emails / day" }],
      series: [{ label: unit === "minute" ? "minute" : "day",
                 value: (u, v) => v == null ? "-" : (unit === "day" ? new Date(v * 1000).toISOString().slice(0, 10)
                                                     : new Date(v * 1000).toLocaleTimeString()) },
        ...names.map((n, i) => ({ label: n, stroke: COLORS[i % COLORS.length], fill: names.length === 1 ? COLORS[0] + "55" : undefined,
                                  width: 2, paths: names.length === 1 ? bars : undefined, points: { show: false } }))],
    }, [s.t, ...names.map((n) => s.series[n])],
    { unit, points: String(s.t.length), campaigns: names.join(","), total: String(total), xMin: String(x0),
      xMax: String(x1) });
  }

  // The x range of a chart: from the first to the last time of the data, with half a step of room
  // on each side. Taken from the data, not from the min and max uPlot passes to a range function:
  // for a time scale with a single point uPlot widens the max to min + 86400 / ms (its time unit
  // in ms: 1e-3 for seconds), i.e. 1,000 days, and one day of sends spanned almost three years.
  function fitted(t, step) {
    if (!t.length) { const now = Date.now() / 1000; return [now - step / 2, now + step / 2]; }
    return [t[0] - step / 2, t[t.length - 1] + step / 2];
  }

  function drawPlan(plan) {
    const box = document.getElementById("plan-box");
    box.hidden = !plan;
    if (!plan) return;
    const last = (a) => (a.length ? a[a.length - 1] : 0);
    const [x0, x1] = fitted(plan.t, plan.unit === "hour" ? 3600 : 86400);
    draw("plan", document.getElementById("chart-plan"), {
      scales: { x: { time: true, range: () => [x0, x1] }, y: { range: (u, min, max) => [0, Math.max(1, max)] } },
      axes: [{}, { label: "emails (cumulative)" }],
      series: [{ label: plan.unit },
        { label: "planned", stroke: "#868e96", width: 2, dash: [6, 4], points: { show: false } },
        { label: "sent", stroke: "#017cee", width: 2, fill: "#017cee22", points: { show: false } }],
    }, [plan.t, plan.planned, plan.sent],
    { unit: plan.unit, points: String(plan.t.length), planned: String(last(plan.planned)), sent: String(last(plan.sent)),
      xMin: String(x0), xMax: String(x1) });
  }

  async function refreshCharts(force) {
    if (seriesBusy || (!force && Date.now() - seriesAt < Math.max(5000, refreshMs))) return;
    seriesBusy = true;
    try {
      const resp = await fetch(seriesUrl, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      const s = await resp.json();
      // the plan box first: whether it shows decides the layout, hence the width of both charts
      document.getElementById("plan-box").hidden = !s.plan;
      drawSends(s.sends);
      drawPlan(s.plan);
      document.getElementById("charts").dataset.ready = "true";
      seriesAt = Date.now();
    } catch (err) {
      document.getElementById("sends-title").textContent = `Sends (chart unavailable: ${err.message})`;
    } finally {
      seriesBusy = false;
    }
  }

  function render(data) {
    if (campaign) renderCampaign(data); else renderList(data);
    refreshCharts(!data.active);
    updated.textContent = `updated ${new Date().toLocaleTimeString()}`;
    updated.dataset.generatedAt = data.generated_at || "";
  }

  function stop() {
    if (source) { source.close(); source = null; }
    if (pollTimer) { clearTimeout(pollTimer); pollTimer = null; }
  }

  function done() {
    stop();
    setLive("done", "done: nothing active, refresh stopped");
  }

  async function load() {
    const resp = await fetch(api, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    return resp.json();
  }

  function poll() {
    stop();
    setLive("polling", "live (polling)");
    const tick = async () => {
      try {
        const data = await load();
        render(data);
        if (!data.active) { done(); return; }
        setLive("polling", "live (polling)");
      } catch (err) {
        setLive("error", `refresh failed (${err.message}), retrying`);
      }
      pollTimer = setTimeout(tick, refreshMs);
    };
    pollTimer = setTimeout(tick, refreshMs);
  }

  function stream() {
    if (forcePoll || !("EventSource" in window)) { poll(); return; }
    stop();
    let received = false;
    source = new EventSource(streamUrl, { withCredentials: true });
    source.addEventListener("progress", (ev) => {
      received = true;
      setLive("streaming", "live");
      render(JSON.parse(ev.data));
    });
    source.addEventListener("done", done);
    source.addEventListener("failure", (ev) => {
      setLive("error", `send log: ${JSON.parse(ev.data).detail}`);
    });
    source.onerror = () => {
      // A stream that ends after its lifetime reconnects by itself; one that never delivered
      // (a proxy that buffers, 401/403, no SSE support) or was closed for good falls back to polling.
      if (!received || (source && source.readyState === EventSource.CLOSED)) poll();
    };
  }

  async function start() {
    document.getElementById(campaign ? "campaign-view" : "list-view").hidden = false;
    try {
      const data = await load();
      render(data);
      if (data.active) stream(); else done();
    } catch (err) {
      setLive("error", `could not load (${err.message}), retrying`);
      poll();
    }
  }

  document.getElementById("refresh").addEventListener("click", () => { stop(); start(); });
  start();
})();
