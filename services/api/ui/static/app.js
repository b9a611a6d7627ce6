// kvgate operator page: polls the admin API once a second and draws what it gets.
// Plain DOM and hand-written SVG; data only ever reaches the page through textContent.
"use strict";

const API = "/api/v1";
const SVGNS = "http://www.w3.org/2000/svg";
const POLL_MS = 1000;
const KEEP_DECISIONS = 300;
const RATE_WINDOW_S = 10; // the header's req/s is over this many seconds of the API's clock
const HISTORY = 10; // resolved alerts shown under the open ones

const state = { token: "", lastSeq: 0, decisions: [], polling: false, now: null };

// ------------------------------------------------------------------ small helpers
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

function pct(x) { return x == null ? "–" : `${(100 * x).toFixed(1)}%`; }
function pct0(x) { return `${Number((100 * x).toPrecision(6))}%`; }
function ms(x) { return x == null ? "–" : (1000 * x).toFixed(0); }
function ago(iso) {
  if (!iso) return "–";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  return s < 90 ? `${s.toFixed(0)} s ago` : s < 5400 ? `${(s / 60).toFixed(0)} min ago` : `${(s / 3600).toFixed(1)} h ago`;
}

// a horizontal bar (0..1) as SVG, with its value written next to it
function ratioBar(x, width = 90) {
  const box = svg("svg", { width: width + 48, height: 14, class: "bar", role: "img" });
  box.append(svg("rect", { x: 0, y: 2, width, height: 10, fill: "#e5e7eb" }));
  if (x != null) {
    const v = Math.max(0, Math.min(1, x));
    const color = v > 0.9 ? "#b91c1c" : v > 0.75 ? "#d97706" : "#0ea5e9";
    box.append(svg("rect", { x: 0, y: 2, width: v * width, height: 10, fill: color }));
  }
  const t = svg("text", { x: width + 4, y: 12, "font-size": 11 });
  t.textContent = pct(x);
  box.append(t);
  return box;
}

// tick values at a 1-2-5 step from at or below lo to at or above hi (about n steps): round
// numbers, not 0/19/37
function niceTicks(lo, hi, n = 4) {
  const raw = (hi - lo) / Math.max(1, n);
  const mag = 10 ** Math.floor(Math.log10(raw || 1));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || 10 * mag;
  const out = [];
  const first = Math.floor(lo / step + 1e-9), last = Math.ceil(hi / step - 1e-9);
  for (let i = first; i <= last; i++) out.push(Number((i * step).toPrecision(12)));
  return { ticks: out, step };
}

// seconds as a short axis label: 45 s, 2.5 min, 1.5 h
function dur(s) {
  if (s < 120) return `${s.toFixed(0)} s`;
  if (s < 7200) return `${(s / 60).toFixed(s % 60 ? 1 : 0)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

// a line chart of several series [{name, color, points: [[x, y], ...]}]; the y axis ends on a
// round tick, the x axis has labelled ticks (xfmt) and a title (xLabel), the legend sits above
function lineChart(title, series, { width = 360, height = 170, fmt = (v) => v.toFixed(2), yMin = 0, minSpan = 1,
  xfmt = (v) => String(v), xLabel = "", xMin = null, minXSpan = 1 } = {}) {
  const pad = { l: 48, r: 12, t: 22, b: 36 };
  const all = series.flatMap((s) => s.points);
  const box = svg("svg", { width, height, role: "img", "aria-label": title });
  const head = svg("text", { x: pad.l, y: 13, "font-size": 12, "font-weight": 600 });
  head.textContent = title;
  box.append(head);
  // legend: right-aligned on the title line, never over the data
  let lx = width - pad.r;
  for (const s of [...series].reverse()) {
    const t = svg("text", { x: lx, y: 13, "font-size": 11, fill: s.color, "text-anchor": "end", class: "legend" });
    t.textContent = s.name;
    box.append(t);
    lx -= 8 + 6.5 * s.name.length;
  }
  if (all.length === 0) {
    const t = svg("text", { x: pad.l, y: height / 2, "font-size": 11, fill: "#6b7280" });
    t.textContent = "no samples yet";
    box.append(t);
    return box;
  }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const x0 = Math.min(...xs, xMin ?? Infinity), x1 = Math.max(...xs, x0 + minXSpan);
  const yLo = Math.min(yMin, ...ys);
  const yt = niceTicks(yLo, Math.max(Math.max(...ys), yLo + minSpan), 3);
  const y0 = yt.ticks[0], y1 = Math.max(yt.ticks.at(-1), y0 + yt.step);
  const sx = (x) => pad.l + ((x - x0) / (x1 - x0)) * (width - pad.l - pad.r);
  const sy = (y) => height - pad.b - ((y - y0) / (y1 - y0)) * (height - pad.t - pad.b);
  for (const v of yt.ticks) {
    box.append(svg("line", { x1: pad.l, x2: width - pad.r, y1: sy(v), y2: sy(v), stroke: "#e5e7eb" }));
    const t = svg("text", { x: pad.l - 4, y: sy(v) + 4, "font-size": 10, "text-anchor": "end", fill: "#6b7280", class: "ytick" });
    t.textContent = fmt(v);
    box.append(t);
  }
  const base = height - pad.b;
  box.append(svg("line", { x1: pad.l, x2: width - pad.r, y1: base, y2: base, stroke: "#9ca3af" }));
  for (const v of niceTicks(x0, x1, 4).ticks) {
    if (v < x0 || v > x1) continue;
    box.append(svg("line", { x1: sx(v), x2: sx(v), y1: base, y2: base + 4, stroke: "#9ca3af" }));
    const t = svg("text", { x: sx(v), y: base + 14, "font-size": 10, "text-anchor": "middle", fill: "#6b7280", class: "xtick" });
    t.textContent = xfmt(v);
    box.append(t);
  }
  if (xLabel) {
    const t = svg("text", { x: pad.l + (width - pad.l - pad.r) / 2, y: height - 3, "font-size": 10, "text-anchor": "middle", fill: "#6b7280", class: "xlabel" });
    t.textContent = xLabel;
    box.append(t);
  }
  for (const s of series) {
    if (s.points.length === 0) continue;
    const d = s.points.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    box.append(svg("path", { d, fill: "none", stroke: s.color, "stroke-width": 2 }));
    for (const p of s.points) box.append(svg("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: s.color }));
  }
  return box;
}

// ------------------------------------------------------------------ API
async function api(path, opts = {}) {
  const headers = { Authorization: `Bearer ${state.token}` };
  if (opts.body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(API + path, {
    method: opts.method || "GET",
    headers,
    body: opts.body === undefined ? undefined : JSON.stringify(opts.body),
  });
  let data = null;
  try { data = await resp.json(); } catch (_) { data = null; }
  if (resp.status === 401) { showLogin("token refused: " + (data?.error?.message || "401")); throw new Error("401"); }
  if (!resp.ok) throw new Error(data?.error?.message || `HTTP ${resp.status}`);
  return data;
}

// ------------------------------------------------------------------ sections
function renderWorkers(workers) {
  const body = document.querySelector("#workers tbody");
  const routed = {};
  for (const d of state.decisions) {
    if (d.worker_id) routed[d.worker_id] = (routed[d.worker_id] || 0) + 1;
    if (d.prefill_worker) routed[d.prefill_worker] = (routed[d.prefill_worker] || 0) + 1;
  }
  body.replaceChildren(...workers.map((w) => {
    const load = w.load || {};
    const health = el("td", { class: w.health === "healthy" ? "ok" : "bad" }, w.health);
    const circuit = el("td", { class: w.breaker === "open" ? "bad" : "" }, w.breaker);
    const rw = load.running == null ? "–" : `${load.running} / ${load.waiting ?? 0}` + (load.max_batch ? ` of ${load.max_batch}` : "");
    return el("tr", { "data-worker": w.worker_id },
      el("td", {}, w.role && w.role !== "both" ? `${w.worker_id} (${w.role})` : w.worker_id),
      health, el("td", {}, w.admin_state), circuit,
      el("td", {}, rw), el("td", {}, ratioBar(w.kv?.usage)),
      el("td", {}, ratioBar(load.cache_hit_rate)), el("td", {}, ratioBar(load.gpu_sm_util, 60)),
      el("td", { class: "routed" }, String(routed[w.worker_id] || 0)));
  }));
  document.getElementById("workers-count").textContent = `(${workers.length})`;
}

// the worker that answered; a disaggregated request shows its pair: prefill → decode, and the
// prefill time and the handoff (prefill answer to the decoder's first token) on hover
function workerCell(d) {
  if (!d.prefill_worker) return el("td", {}, d.worker_id || "–");
  const title = `prefill ${ms(d.prefill_s)} ms, handoff (KV transfer + first step) ${ms(d.handoff_s)} ms`;
  return el("td", { class: "pd-pair", title }, `${d.prefill_worker} → ${d.worker_id || "–"}`);
}

function renderDecisions() {
  const recent = state.decisions.slice(-15).reverse();
  const body = document.querySelector("#decisions tbody");
  body.replaceChildren(...recent.map((d) => el("tr", { "data-seq": d.seq },
    el("td", {}, new Date(d.ts * 1000).toLocaleTimeString()),
    el("td", { class: "rid", title: d.request_id }, shortId(d.request_id)),
    el("td", {}, d.policy_version ? `${d.policy} v${d.policy_version}` : `${d.policy} (default)`),
    el("td", {}, d.arm),
    workerCell(d),
    el("td", { class: d.status === "ok" ? "ok" : "bad" }, d.status),
    reuseCell(d),
    ttftCell(d),
    el("td", {}, ms(d.e2e_s)))));
  // requests per worker among the kept decisions, as bars
  const counts = {};
  for (const d of state.decisions) counts[d.worker_id || "none"] = (counts[d.worker_id || "none"] || 0) + 1;
  const names = Object.keys(counts).sort();
  const chart = document.getElementById("decisions-chart");
  const width = 520, row = 16, height = Math.max(1, names.length) * row + 22;
  const box = svg("svg", { width, height, role: "img", "aria-label": "requests per worker" });
  const head = svg("text", { x: 0, y: 12, "font-size": 12, "font-weight": 600 });
  head.textContent = `last ${state.decisions.length} requests per worker`;
  box.append(head);
  const max = Math.max(1, ...Object.values(counts));
  names.forEach((n, i) => {
    const y = 20 + i * row;
    const label = svg("text", { x: 0, y: y + 11, "font-size": 11 });
    label.textContent = n;
    box.append(label);
    box.append(svg("rect", { x: 110, y: y + 2, height: row - 5, width: (counts[n] / max) * (width - 170), fill: "#0ea5e9" }));
    const v = svg("text", { x: 114 + (counts[n] / max) * (width - 170), y: y + 11, "font-size": 11 });
    v.textContent = String(counts[n]);
    box.append(v);
  });
  chart.replaceChildren(box);
  document.getElementById("decisions-rate").textContent = rateText();
  document.getElementById("reuse").textContent = reuseText(state.decisions);
}

// one decision's reuse attribution: available / captured / delivered / prompt (+ why lost)
function reuseCell(d) {
  const avail = d.available_cached_tokens ?? d.predicted_cached_tokens;
  const text = `${avail} / ${d.predicted_cached_tokens} / ${d.cached_tokens ?? "–"} / ${d.prompt_tokens}`;
  return el("td", { class: "reuse" }, d.lost_reason ? `${text} (${d.lost_reason})` : text);
}

// "60% available, 45% captured, 40% delivered; lost: 15% load" over the answered requests kept
function reuseText(decisions) {
  let prompt = 0, avail = 0, capt = 0, deliv = 0;
  const lost = {};
  const add = (why, n) => { if (n > 0) lost[why] = (lost[why] || 0) + n; };
  for (const d of decisions) {
    if (d.status !== "ok" || d.cached_tokens == null) continue;
    const a = Math.max(d.available_cached_tokens ?? 0, d.predicted_cached_tokens);
    prompt += d.prompt_tokens; avail += a; capt += d.predicted_cached_tokens; deliv += d.cached_tokens;
    add(d.lost_reason || "filtered", a - d.predicted_cached_tokens);
    add("engine", d.predicted_cached_tokens - d.cached_tokens);
  }
  if (!prompt) return "";
  const p = (n) => `${(100 * n / prompt).toFixed(0)}%`;
  const why = Object.entries(lost).sort((x, y) => y[1] - x[1]).map(([k, n]) => `${p(n)} ${k}`);
  return `prompt tokens cached: ${p(avail)} available, ${p(capt)} captured, ${p(deliv)} delivered` +
    (why.length ? `; lost: ${why.join(", ")}` : "");
}

// a router's id is <16 hex: its random prefix><16 hex: a counter>: the counter is what differs
// between rows, the prefix's start what differs between routers; keep both, drop the padding.
// Other ids (a client's x-request-id): the tail, where counters usually are.
function shortId(id) {
  const m = /^(.*?)([0-9a-f]{16})([0-9a-f]{16})$/.exec(id);
  if (m) return `${m[1]}${m[2].slice(0, 6)}…${m[3].replace(/^0+(?=.)/, "")}`;
  return id.length > 16 ? `…${id.slice(-14)}` : id;
}

// a non-streamed answer's first token arrives with the whole answer: its TTFT is its total
function ttftCell(d) {
  if (d.ttft_s != null || d.e2e_s == null) return el("td", {}, ms(d.ttft_s));
  return el("td", { class: "whole", title: "not streamed: the first token came with the whole answer" }, `${ms(d.e2e_s)}*`);
}

// requests per second over the last RATE_WINDOW_S seconds of the API's clock: falls to 0 when
// the load stops (a rate over the kept decisions would stay at the last value)
function rateText() {
  if (state.now == null) return "";
  const recent = state.decisions.filter((d) => d.ts > state.now - RATE_WINDOW_S).length;
  const last = state.decisions.at(-1);
  const idle = recent === 0 && last ? `; last ${ago(new Date(1000 * last.ts).toISOString())}` : "";
  return `(${(recent / RATE_WINDOW_S).toFixed(1)} req/s over the last ${RATE_WINDOW_S} s${idle})`;
}

function canaryCurves(c) {
  // x: seconds since the canary started (each evaluation at its own time, the open window now)
  const t0 = Date.parse(c.created_at || "") || null;
  const at = (iso, i) => (t0 && iso ? Math.max(0, (Date.parse(iso) - t0) / 1000) : i);
  const points = (c.decisions || []).filter((d) => d.numbers && d.numbers.control);
  const steps = points.map((d, i) => ({ x: at(d.ts, i), n: d.numbers }));
  if (c.current) steps.push({ x: t0 ? Math.max(0, (1000 * (state.now ?? Date.now() / 1000) - t0) / 1000) : steps.length, n: c.current });
  const axis = t0
    ? { xfmt: dur, xLabel: "time since the canary started", xMin: 0, minXSpan: 60 }
    : { xLabel: "evaluation", xMin: 0, minXSpan: 4 };
  const series = (key, scale) => [
    { name: "control", color: "#2563eb", points: steps.filter((s) => s.n.control?.[key] != null).map((s) => [s.x, scale * s.n.control[key]]) },
    { name: "candidate", color: "#d62728", points: steps.filter((s) => s.n.candidate?.[key] != null).map((s) => [s.x, scale * s.n.candidate[key]]) },
  ];
  return el("div", { class: "charts" },
    lineChart("TTFT p95 (ms)", series("ttft_p95_s", 1000), { fmt: (v) => String(Number(v.toPrecision(6))), ...axis }),
    lineChart("cache hit rate", series("cache_hit_rate", 1), { fmt: (v) => pct0(v), minSpan: 0.1, ...axis }),
    lineChart("error rate", series("error_rate", 1), { fmt: (v) => pct0(v), minSpan: 0.05, ...axis }));
}

async function renderCanaries() {
  const list = (await api("/canaries?limit=3")).canaries;
  const box = document.getElementById("canaries");
  if (list.length === 0) { box.replaceChildren(el("p", { class: "muted" }, "none")); return; }
  const parts = [];
  for (const c of list) {
    const full = await api(`/canaries/${c.id}`);
    const reasons = (full.decisions || []).filter((d) => d.action !== "hold");
    parts.push(el("div", { class: "canary", "data-canary": c.id },
      el("div", {},
        el("strong", {}, `${c.control.name}@${c.control.version}`), " (control) vs ",
        el("strong", {}, `${c.candidate.name}@${c.candidate.version}`), " (candidate) — ",
        el("span", { class: c.state === "rolled_back" || c.state === "aborted" ? "bad" : "ok" }, c.state),
        ` at ${(100 * c.fraction).toFixed(0)}% `, el("span", { class: "muted" }, c.reason || "")),
      canaryCurves(full),
      reasons.length
        ? el("ul", { class: "reasons" }, ...reasons.map((d) => el("li", {}, `${d.action}: ${d.reason}`)))
        : el("p", { class: "muted" }, "no promote / rollback decision yet")));
  }
  box.replaceChildren(...parts);
}

async function renderAlerts() {
  const [firing, acked] = await Promise.all([
    api("/alerts?state=firing&limit=100"), api("/alerts?state=acknowledged&limit=100")]);
  const alerts = [...firing.alerts, ...acked.alerts];
  const body = document.querySelector("#alerts tbody");
  const act = (a, what) => async () => {
    try {
      await api(`/alerts/${a.id}/${what}`, { method: "POST", body: what === "silence" ? { duration_s: 3600 } : {} });
      setStatus(`${what} ${a.kind} done`);
      await refresh();
    } catch (e) { setStatus(`${what} failed: ${e.message}`, true); }
  };
  body.replaceChildren(...alerts.map((a) => el("tr", { "data-alert": a.id },
    el("td", { class: a.severity }, a.severity), el("td", {}, a.kind), el("td", {}, a.worker_id || "–"),
    el("td", {}, ago(a.first_seen)), el("td", {}, a.state), el("td", { class: "summary" }, a.summary),
    el("td", {},
      a.state === "firing" ? el("button", { onclick: act(a, "ack") }, "ack") : "",
      el("button", { onclick: act(a, "silence") }, "silence 1 h")))));
  document.getElementById("alerts-none").hidden = alerts.length > 0;
  // recent history: the last resolved alerts, newest first (an alert that fired and resolved
  // between two looks at the page is still seen)
  const resolved = (await api(`/alerts?state=resolved&limit=${HISTORY}`)).alerts;
  document.querySelector("#alerts-history tbody").replaceChildren(...resolved.map((a) => el("tr", { "data-alert": a.id },
    el("td", { class: a.severity }, a.severity), el("td", {}, a.kind), el("td", {}, a.worker_id || "–"),
    el("td", {}, ago(a.first_seen)), el("td", {}, ago(a.resolved_at || a.last_seen)),
    el("td", {}, a.resolved_by || "–"), el("td", { class: "summary" }, a.summary))));
  document.getElementById("alerts-history-none").hidden = resolved.length > 0;
}

const MAX_TENANTS = 20; // usage is asked per tenant: the page shows the first ones

async function renderTenants() {
  const tenants = (await api("/tenants")).tenants.slice(0, MAX_TENANTS);
  const since = Math.floor(Date.now() / 1000) - 3600;
  const usage = await Promise.all(tenants.map((t) => api(`/tenants/${encodeURIComponent(t.tenant_id)}/usage?since=${since}`)));
  document.querySelector("#tenants tbody").replaceChildren(...tenants.map((t, i) => {
    const u = usage[i];
    return el("tr", { "data-tenant": t.tenant_id },
      el("td", {}, t.tenant_id), el("td", {}, t.spec.weight), el("td", {}, t.spec.default_priority),
      el("td", {}, t.keys), el("td", {}, u.requests), el("td", {}, u.errors),
      el("td", {}, pct(u.cache_hit_ratio)), el("td", {}, u.prompt_tokens), el("td", {}, u.completion_tokens));
  }));
  document.getElementById("tenants-none").hidden = tenants.length > 0;
}

async function renderPolicy() {
  const p = await api("/active-policy");
  const text = p.name ? `policy ${p.name}@${p.version}` : "no managed policy (router default)";
  const canary = p.canary ? `, canary ${p.canary.candidate}@${p.canary.candidate_version} at ${(100 * p.canary.fraction).toFixed(0)}%` : "";
  document.getElementById("policy").textContent = text + canary;
}

// ------------------------------------------------------------------ loop
function setStatus(text, bad = false) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = bad ? "bad" : "muted";
}

async function refresh() {
  const got = await api(`/decisions?after=${state.lastSeq}&limit=500`);
  if (got.last < state.lastSeq) state.decisions = []; // the API restarted: start over
  state.decisions.push(...got.decisions);
  state.decisions = state.decisions.slice(-KEEP_DECISIONS);
  state.lastSeq = got.last;
  state.now = got.now ?? Date.now() / 1000;
  const workers = (await api("/workers")).workers;
  renderWorkers(workers);
  renderDecisions();
  await Promise.all([renderAlerts(), renderCanaries(), renderPolicy(), renderTenants()]);
  setStatus(`updated ${new Date().toLocaleTimeString()}`);
  document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
}

async function loop() {
  if (state.polling) return;
  state.polling = true;
  while (state.token) {
    try { await refresh(); } catch (e) { if (e.message !== "401") setStatus(`API error: ${e.message}`, true); }
    await new Promise((r) => setTimeout(r, POLL_MS));
  }
  state.polling = false;
}

function showLogin(message) {
  state.token = "";
  sessionStorage.removeItem("kvgate-token");
  document.getElementById("main").hidden = true;
  document.getElementById("login").hidden = false;
  setStatus(message || "a token is needed", Boolean(message));
}

function start(token) {
  state.token = token;
  sessionStorage.setItem("kvgate-token", token);
  document.getElementById("login").hidden = true;
  document.getElementById("main").hidden = false;
  loop();
}

document.addEventListener("DOMContentLoaded", () => {
  // #token=... : taken from the fragment (never sent to a server), then removed from the URL
  const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  if (m) history.replaceState(null, "", location.pathname + location.search);
  const token = m ? decodeURIComponent(m[1]) : sessionStorage.getItem("kvgate-token");
  document.getElementById("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const t = document.getElementById("token").value.trim();
    if (t) start(t);
  });
  if (token) start(token); else showLogin();
});
