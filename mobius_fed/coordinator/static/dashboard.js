// mobius-fed dashboard: polls /v1/status and /v1/history and draws them as SVG.
// No dependencies. Every figure shown is also in a data-* attribute, for tests and scripts.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const POLL_MS = 2000;
const ENDED_POLL_MS = 5000;
const PALETTE = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#db2777", "#0891b2",
  "#65a30d"];

window.addEventListener("error", () => {
  document.body.dataset.errors = String(Number(document.body.dataset.errors || 0) + 1);
});

function el(tag, attrs, parent, text) {
  const isSvg = ["svg", "g", "path", "line", "circle", "text", "rect", "title"].includes(tag);
  const node = isSvg ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== undefined && v !== null) node.setAttribute(k, String(v));
  }
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

function fmt(v, digits = 4) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  return Number.isInteger(v) ? String(v) : v.toFixed(digits);
}

function fmtBytes(v) {
  if (v === null || v === undefined) return "–";
  const units = ["B", "KB", "MB", "GB"];
  let i = 0;
  while (v >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
  return `${v.toFixed(v < 10 ? 1 : 0)} ${units[i]}`;
}

// A line chart: series = [{name, points: [[x, y]], color, origin}]
function chart(container, series, opts) {
  const W = 720, H = 240, L = 52, R = 110, T = 10, B = 28;
  container.textContent = "";
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": opts.title },
    container);
  const all = series.flatMap((s) => s.points);
  if (!all.length) {
    el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "tick" }, svg,
      opts.empty || "no data yet");
  }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let x0 = Math.min(...xs, 0), x1 = Math.max(...xs, 1);
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (!isFinite(y0)) { y0 = 0; y1 = 1; }
  if (y1 - y0 < 1e-9) { y0 -= 0.5; y1 += 0.5; }
  const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
  if (x1 === x0) x1 = x0 + 1;
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  for (let k = 0; k <= 4; k++) {
    const y = y0 + ((y1 - y0) * k) / 4;
    el("line", { x1: L, x2: W - R, y1: sy(y), y2: sy(y), class: "grid" }, svg);
    el("text", { x: L - 4, y: sy(y) + 3, "text-anchor": "end", class: "tick" }, svg,
      y.toFixed(Math.abs(y1 - y0) < 1 ? 3 : 2));
  }
  const stepX = Math.max(1, Math.ceil((x1 - x0) / 6));
  for (let x = Math.ceil(x0); x <= x1; x += stepX) {
    el("text", { x: sx(x), y: H - B + 14, "text-anchor": "middle", class: "tick" }, svg,
      String(x));
  }
  el("line", { x1: L, x2: L, y1: T, y2: H - B, class: "axis" }, svg);
  el("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }, svg);
  el("text", { x: (L + W - R) / 2, y: H - 2, "text-anchor": "middle", class: "tick" }, svg,
    opts.xlabel || "step");
  series.forEach((s, i) => {
    const d = s.points.map((p, k) => `${k ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`)
      .join("");
    const last = s.points.length ? s.points[s.points.length - 1][1] : null;
    el("path", {
      d: d || "M0,0", class: `curve${s.origin ? " origin" : ""}`, stroke: s.color,
      "data-series": s.name, "data-points": s.points.length,
      "data-last": last === null ? "" : String(last),
    }, svg);
    el("text", { x: W - R + 8, y: T + 12 + i * 13, class: "legend", fill: s.color }, svg,
      `${s.label || s.name}${last === null ? "" : " " + fmt(last)}`);
  });
}

// R rings of P workers (docs/rings.md): ring r is workers r·P .. r·P+P-1, drawn as its own
// circle; edge g runs from worker g to its successor within its ring.
function drawRing(container, status) {
  const W = 420, H = 360;
  container.textContent = "";
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "ring" },
    container);
  const N = status.workers.length, R = Math.max(1, status.rings || 1), P = Math.max(1, N / R);
  const cols = Math.ceil(Math.sqrt(R)), rows = Math.ceil(R / cols);
  const cw = W / cols, ch = H / rows;
  const r = R === 1 ? 120 : Math.max(30, Math.min(cw, ch) / 2 - 44);
  const nr = R === 1 ? 26 : Math.max(12, Math.min(22, r / 3));
  const health = status.ring_health || [];
  const centre = (k) => [cw * ((k % cols) + 0.5), ch * (Math.floor(k / cols) + 0.5) - 6];
  const pos = (g) => {
    const [cx, cy] = centre(Math.floor(g / P));
    const a = -Math.PI / 2 + (2 * Math.PI * (g % P)) / P;
    return [cx + r * Math.cos(a), cy + r * Math.sin(a)];
  };
  for (let k = 0; k < R && R > 1; k++) {
    const h = health[k] || {};
    const [cx, cy] = centre(k);
    const g = el("g", { class: "ring-label", "data-ring": k, "data-state": h.state ?? "" }, svg);
    el("text", { x: cx, y: cy, class: "node-label" }, g, `ring ${k}`);
    el("text", { x: cx, y: cy + 13, class: `edge-label state-${h.state}` }, g, h.state ?? "");
  }
  (status.ring || []).forEach((e, i) => {
    const ring = Math.floor(i / P), cx = centre(ring)[0], cy = centre(ring)[1];
    const j = ring * P + ((i % P) + 1) % P;
    const [xa, ya] = pos(i), [xb, yb] = pos(j);
    const g = el("g", {
      class: "edge", "data-edge": e.edge, "data-state": e.state, "data-ring": ring,
      "data-bytes-per-s": e.bytes_per_s ?? "", "data-wait-share": e.wait_share ?? "",
      "data-path": e.path ?? "",
    }, svg);
    const mx = (xa + xb) / 2, my = (ya + yb) / 2;
    const bend = P === 2 ? ((i % P) ? 1 : -1) * r / 3 : 0;  // two workers: two arcs, not one line
    const qx = mx + ((mx - cx) * 0.25) + bend, qy = my + ((my - cy) * 0.25);
    el("path", { d: `M${xa},${ya} Q${qx},${qy} ${xb},${yb}`, class: `edge-line state-${e.state}` },
      g);
    const lx = mx + (mx - cx) * 0.45 + bend * 1.4, ly = my + (my - cy) * 0.45;
    const share = e.wait_share === null || e.wait_share === undefined ? "–"
      : `${Math.round(e.wait_share * 100)}% wait`;
    if (R === 1) {  // with several rings the edges table carries the figures
      el("text", { x: lx, y: ly, class: "edge-label" }, g, `${fmtBytes(e.bytes_per_s)}/s`);
      el("text", { x: lx, y: ly + 12, class: "edge-label" }, g, share);
      if (e.path && e.path !== "direct") {
        el("text", { x: lx, y: ly + 24, class: "edge-label edge-path" }, g, e.path);
      }
    }
    el("title", {}, g, `${e.edge} (${e.path || "direct"}): ${e.state}, ${e.reconnects} reconnects`);
  });
  status.workers.forEach((w, i) => {
    const [x, y] = pos(i), cy = centre(Math.floor(i / P))[1];
    const g = el("g", {
      class: "worker", "data-rank": w.rank, "data-ring": w.ring ?? 0, "data-state": w.state,
      "data-step": w.step, "data-last-loss": w.last_loss ?? "",
    }, svg);
    el("circle", { cx: x, cy: y, r: nr, class: `state-${w.state}` }, g);
    el("text", { x, y: y + 4, class: "node-label" }, g, `w${w.rank}`);
    const below = y > cy ? nr + 14 : -nr - 6;
    el("text", { x, y: y + below, class: "edge-label" }, g,
      R === 1 ? `${w.state} · step ${w.step}` : w.state);
    el("title", {}, g, `worker-${w.rank} ${w.address || ""}: ${w.state}`);
  });
}

function table(tbl, header, rows) {
  tbl.textContent = "";
  const tr = el("tr", {}, tbl);
  header.forEach((h) => el("th", {}, tr, h));
  rows.forEach((row) => {
    const r = el("tr", row.attrs || {}, tbl);
    row.cells.forEach((c) => {
      const boxed = c !== null && typeof c === "object";
      el("td", boxed && c.cls ? { class: c.cls } : {}, r, fmt(boxed ? c.v : c));
    });
  });
}

function flatten(obj, prefix, out) {
  for (const [k, v] of Object.entries(obj || {})) {
    const key = prefix ? `${prefix}.${k}` : k;
    if (v && typeof v === "object" && !Array.isArray(v)) flatten(v, key, out);
    else out.push([key, Array.isArray(v) ? JSON.stringify(v) : v]);
  }
  return out;
}

// The mean loss and one series per origin of rows [{loss, origin_losses}], at x(row).
function lossSeries(rows, x, P, name, label, prefix) {
  const series = [{ name, label, color: "#111827",
    points: rows.filter((r) => r.loss !== null).map((r) => [x(r), r.loss]) }];
  for (let s = 0; s < P; s++) {
    series.push({ name: `${prefix}-origin-${s}`, label: `origin ${s}`, origin: true,
      color: PALETTE[s % PALETTE.length],
      points: rows.filter((r) => r.origin_losses[s] !== null)
        .map((r) => [x(r), r.origin_losses[s]]) });
  }
  return series;
}

function render(status, history) {
  const body = document.body;
  body.dataset.phase = status.phase;
  body.dataset.step = status.step;
  body.dataset.round = status.round;
  body.dataset.runId = status.run_id;
  body.dataset.workers = status.workers.length;
  document.getElementById("run-id").textContent = status.run_id;
  const summary = document.getElementById("summary");
  summary.textContent = "";
  const items = [
    ["phase", status.phase, `phase-${status.phase}`],
    ["step", `${status.step}/${status.steps}`],
    ["round", `${status.round}/${status.num_rounds}`],
    ["strategy", status.strategy],
    ["train_loss", status.train_loss],
    ["eval_loss", status.eval_loss],
  ];
  const raw = { step: status.step, round: status.round };
  for (const [name, value, cls] of items) {
    const span = el("span", { "data-field": name,
      "data-value": raw[name] ?? (value === null || value === undefined ? "" : String(value)) },
      summary);
    span.appendChild(document.createTextNode(`${name.replace("_", " ")} `));
    el("b", cls ? { class: cls } : {}, span, fmt(value));
  }
  if (status.error) el("span", { class: "state-failed" }, summary, `error: ${status.error}`);

  const P = status.workers.length;
  chart(document.getElementById("chart-eval"),
    lossSeries(history.evals, (e) => e.step, P, "eval", "Eq. 8", "val"),
    { title: "validation loss", empty: "no evaluation yet" });
  chart(document.getElementById("chart-train"),
    lossSeries(history.steps, (r) => r.step + 1, P, "train", "mean", "train"),
    { title: "training loss" });

  const rounds = history.rounds.filter((r) => r.steps > 0);
  chart(document.getElementById("chart-step"), [
    { name: "step-time", label: "s/step", color: "#2563eb",
      points: rounds.map((r) => [r.round, r.train_s / r.steps]) },
    { name: "overhead", label: "barrier s", color: "#d97706", origin: true,
      points: rounds.map((r) => [r.round, r.overhead_s]) },
  ], { title: "step time", xlabel: "round" });

  drawRing(document.getElementById("ring"), status);
  const rings = status.rings || 1;  // each ring's health (one row per ring)
  table(document.getElementById("rings"),
    ["ring", "workers", "state", "step", "edges up", "why"],
    (status.ring_health || []).map((h) => ({ attrs: { class: "ring-row", "data-ring": h.ring,
      "data-state": h.state, "data-step": h.step, "data-healthy": h.healthy ? "1" : "0" },
      cells: [h.ring, h.workers.length ? `${h.workers[0]}–${h.workers[h.workers.length - 1]}`
        : "", { v: h.state, cls: `state-${h.state}` }, h.step, `${h.edges_up}/${h.edges}`,
        h.reason] })));
  document.getElementById("rings").hidden = rings === 1;
  table(document.getElementById("edges"),
    ["edge", "path", "state", "bytes/s", "tunnel bytes/s", "reconnects"],
    (status.ring || []).map((e) => ({ attrs: { class: "edge-row", "data-edge": e.edge,
      "data-path": e.path ?? "" },
      cells: [e.edge, e.path || "direct", { v: e.state, cls: `state-${e.state}` },
        e.bytes_per_s, e.tunnel_bytes_per_s, e.reconnects] })));
  const ringCol = rings > 1;  // a ring column with R rings only
  table(document.getElementById("workers"),
    ["rank", ...(ringCol ? ["ring"] : []), "state", "step", "loss", "tokens/s", "train s",
      "wait share", "blocks", "ms/block"],
    status.workers.map((w) => ({ attrs: { class: "worker-row", "data-rank": w.rank,
      "data-ring": w.ring ?? 0 },
      cells: [w.rank, ...(ringCol ? [w.ring ?? 0] : []), { v: w.state, cls: `state-${w.state}` },
        w.step, w.last_loss, w.tokens_per_s, w.train_s, w.wait_share === null ? null
          : `${Math.round(w.wait_share * 100)}%`, w.layers,
        w.block_s === null || w.block_s === undefined ? null : w.block_s * 1000] })));
  const pace = document.getElementById("pace");  // the slowest site and what it costs
  pace.textContent = status.pace ? `pace: ${status.pace.summary}` : "pace: not measured yet";
  pace.dataset.slowest = status.pace ? status.pace.slowest : "";
  table(document.getElementById("incidents"),
    ["#", "state", "what", "detected (s)", "recovered (s)", "rollback", "redone"],
    status.incidents.map((i) => ({ attrs: { class: "incident", "data-id": i.id,
      "data-state": i.state },
      cells: [i.id, { v: i.state, cls: `state-${i.state}` }, i.what, i.detection_s,
        i.recovery_s, i.rollback_round, i.steps_redone] })));
  renderSites(status);
  const cfg = flatten(status.config || {}, "", []);
  table(document.getElementById("config"), ["key", "value"],
    cfg.map(([k, v]) => ({ attrs: { "data-key": k }, cells: [k, v] })));
  const priv = document.getElementById("privacy");
  priv.textContent = status.privacy ? JSON.stringify(status.privacy, null, 2) : "none reported";
  priv.dataset.present = status.privacy ? "1" : "0";
  const inp = status.privacy && status.privacy.input;  // ε of the clipped input noise (per site)
  document.getElementById("privacy-epsilon").textContent = inp
    ? `input ε per site: ${inp.epsilon_position ?? "∞"} per position, ${inp.epsilon_sequence ?? "∞"} per sequence (whole run: ${inp.epsilon_sequence_whole_run ?? "∞"}); covers ${inp.covers}; not: ${inp.not_covered}`
    : "";
}

// mobius://worker/2 → worker-2, mobius://standby/0 → standby-0
function siteName(identity) {
  const m = /^mobius:\/\/([a-z]+)\/(\d+)$/.exec(identity || "");
  return m ? `${m[1]}-${m[2]}` : identity;
}

// Each site's clips and refused frames (the rank holders, and any site a handover
// replaced), the suspects, and the handovers so far.
function renderSites(status) {
  const b = status.bounds || {};
  const clipped = b.er_clipped || {}, refused = b.frames_refused || {}, last = b.last || {};
  const suspects = new Set(b.suspects || []);
  const rankOf = {};
  status.workers.forEach((w) => { rankOf[siteName(w.identity)] = w.rank; });
  const sites = [...new Set([...Object.keys(rankOf), ...Object.keys(clipped),
    ...Object.keys(refused)])];
  table(document.getElementById("sites"),
    ["site", "rank", "E/R clipped", "frames refused", "suspect", "last"],
    sites.map((s) => ({ attrs: { class: "site-row", "data-site": s,
      "data-clipped": clipped[s] || 0, "data-refused": refused[s] || 0,
      "data-suspect": suspects.has(s) ? "1" : "0" },
      cells: [s, s in rankOf ? rankOf[s] : "replaced", clipped[s] || 0, refused[s] || 0,
        suspects.has(s) ? { v: "suspect", cls: "state-failed" } : "no", last[s] || ""] })));
  const handovers = status.handovers || [];
  table(document.getElementById("handovers"),
    ["rank", "replaced", "standby", "why", "from round"],
    handovers.map((h) => ({ attrs: { class: "handover", "data-rank": h.rank,
      "data-standby": siteName(h.standby), "data-replaced": siteName(h.replaced) },
      cells: [h.rank, siteName(h.replaced), siteName(h.standby), h.why, h.round] })));
  document.getElementById("handovers").hidden = handovers.length === 0;
}

async function getJSON(path) {
  const r = await fetch(path, { cache: "no-store", headers: { accept: "application/json" } });
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

async function poll() {
  let wait = POLL_MS;
  const banner = document.getElementById("error");
  try {
    const [status, history] = await Promise.all([getJSON("/v1/status"),
      getJSON("/v1/history")]);
    render(status, history);
    banner.hidden = true;
    document.getElementById("updated").textContent =
      `updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.ready = "1";
    if (["done", "failed", "stopped"].includes(status.phase)) wait = ENDED_POLL_MS;
  } catch (err) {
    document.body.dataset.failures = String(Number(document.body.dataset.failures || 0) + 1);
    console.warn(`dashboard: ${err.message}`);
    banner.hidden = false;
    banner.textContent = `cannot read the coordinator's status: ${err.message} (retrying)`;
  }
  setTimeout(poll, wait);
}

poll();
