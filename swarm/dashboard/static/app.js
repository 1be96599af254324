// The swarm dashboard's page: polls /api/state and draws tables and SVG charts. No libraries, works offline.
"use strict";

const POLL_MS = 1500;  // how often the page asks for /api/state
const SVG_NS = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

function fmt(value, digits) {
  if (value === null || value === undefined || !isFinite(value)) return "\u2013";
  return Number(value).toLocaleString("en-US", {minimumFractionDigits: digits, maximumFractionDigits: digits});
}

function shortId(id) { return id.length > 14 ? id.slice(0, 6) + "\u2026" + id.slice(-6) : id; }

function duration(seconds) {
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  const pad = (n) => String(n).padStart(2, "0");
  return h > 0 ? `${h}:${pad(m)}:${pad(r)}` : `${m}:${pad(r)}`;
}

function cell(row, text, className, title) {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
  if (title) td.title = title;
  return td;
}

function fillTable(id, items, render) {
  const body = $(id).tBodies[0];
  body.replaceChildren();
  for (const item of items) render(body.insertRow(), item);
  if (body.rows.length) {  // headers of numeric columns line up with their right-aligned numbers
    const headers = $(id).tHead.rows[0].cells;
    [...body.rows[0].cells].forEach((td, i) => headers[i] && headers[i].classList.toggle("num", td.classList.contains("num")));
  }
  if (items.length === 0) {
    const td = body.insertRow().insertCell();
    td.colSpan = $(id).tHead.rows[0].cells.length;
    td.textContent = "none yet";
    td.className = "note";
  }
}

function idList(ids) { return ids.map(shortId).join(", "); }

function el(parent, name, attrs, text) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  parent.appendChild(node);
  return node;
}

function niceRange(lo, hi) {
  if (lo === hi) { const pad = Math.abs(lo) * 0.05 || 1; return [lo - pad, hi + pad]; }
  const pad = (hi - lo) * 0.08;
  return [lo - pad, hi + pad];
}

// A line chart of ys over xs (seconds since the dashboard started); null ys break the line.
// `step` draws a staircase (values hold until the next point). Sets data-points and data-last for tests.
function drawChart(svg, xs, ys, options) {
  const width = Math.max(svg.clientWidth, 200), height = Math.max(svg.clientHeight, 120);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.replaceChildren();
  const points = xs.map((x, i) => [x, ys[i]]).filter(([, y]) => y !== null && isFinite(y));
  svg.dataset.points = String(points.length);
  svg.dataset.last = points.length ? String(points[points.length - 1][1]) : "";
  if (points.length === 0) {
    el(svg, "text", {x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty"}, "waiting for data");
    return;
  }
  const left = 48, right = 12, top = 10, bottom = 22;
  const [x0, x1] = xs.length > 1 ? [xs[0], xs[xs.length - 1]] : [xs[0] - 1, xs[0] + 1];
  let [y0, y1] = niceRange(Math.min(...points.map((p) => p[1])), Math.max(...points.map((p) => p[1])));
  if (options.floor !== undefined && y0 < options.floor) y0 = Math.min(options.floor, y1 - 1);  // rates are never negative
  const sx = (x) => left + (x - x0) / ((x1 - x0) || 1) * (width - left - right);
  const sy = (y) => top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom);
  let ticks = [0, 1, 2, 3, 4].map((i) => y0 + (y1 - y0) * i / 4);
  if (options.digits === 0)  // integer series (steps): one gridline per distinct whole value in range
    ticks = [...new Set(ticks.map(Math.round))].filter((y) => y >= y0 && y <= y1);
  for (const y of ticks) {
    el(svg, "line", {x1: left, x2: width - right, y1: sy(y), y2: sy(y), class: "grid"});
    el(svg, "text", {x: left - 4, y: sy(y) + 3, "text-anchor": "end"}, fmt(y, options.digits));
  }
  for (let i = 0; i <= 3; i++) {
    const x = x0 + (x1 - x0) * i / 3;
    el(svg, "text", {x: sx(x), y: height - 6, "text-anchor": i === 0 ? "start" : i === 3 ? "end" : "middle"}, duration(x));
  }
  let d = "", previous = null;
  xs.forEach((x, i) => {
    const y = ys[i];
    if (y === null || !isFinite(y)) { previous = null; return; }
    if (previous === null) d += `M${sx(x).toFixed(1)},${sy(y).toFixed(1)}`;
    else if (options.step) d += `H${sx(x).toFixed(1)}V${sy(y).toFixed(1)}`;
    else d += `L${sx(x).toFixed(1)},${sy(y).toFixed(1)}`;
    previous = y;
  });
  el(svg, "path", {d, class: "line", stroke: options.color});
  const [lx, ly] = points[points.length - 1];
  el(svg, "circle", {cx: sx(lx), cy: sy(ly), r: 3, fill: options.color});
  if (options.marks) {
    const every = Math.max(1, Math.ceil(options.marks.length / 12));
    options.marks.forEach((mark, i) => {
      if (mark.t < x0) return;
      el(svg, "circle", {cx: sx(mark.t), cy: sy(mark.step), r: 2.5, fill: options.color});
      if (i % every === 0 || i === options.marks.length - 1)
        el(svg, "text", {x: sx(mark.t) + (sx(mark.t) > width - 40 ? -4 : 3), y: sy(mark.step) - 4,
                         "text-anchor": sx(mark.t) > width - 40 ? "end" : "start"}, String(mark.step));
    });
  }
}

function renderHeader(state) {
  $("run-id").textContent = state.run_id;
  document.title = `swarm ${state.run_id}`;
  $("global-step").textContent = state.global_step === null ? "\u2013" : String(state.global_step);
  $("loss-value").textContent = fmt(state.swarm.loss, 4);
  $("samples-value").textContent = fmt(state.swarm.samples_per_s, 1);
  $("tokens-value").textContent = fmt(state.swarm.tokens_per_s, 0);
  $("peers-value").textContent = String(state.swarm.num_peers);
  $("trainers-value").textContent = String(state.swarm.num_trainers);
  const status = $("poll-status");
  status.className = "status " + (state.poll.ok ? "ok" : "error");
  status.textContent = state.poll.ok ? `live \u00b7 up ${duration(state.uptime_s)}` : `DHT: ${state.poll.error}`;
  $("updated").textContent = new Date(state.updated_at * 1000).toLocaleTimeString();
}

function renderTables(state) {
  fillTable("stages-table", state.stages, (row, s) => {
    cell(row, String(s.stage), "num");
    cell(row, String(s.replicas), "num");
    cell(row, String(s.joining), "num");
    cell(row, fmt(s.throughput, 1), "num");
    cell(row, String(s.queue), "num");
    cell(row, s.step === null ? "\u2013" : String(s.step), "num");
    cell(row, String(s.samples_pending), "num");
  });
  fillTable("peers-table", state.peers, (row, p) => {
    if (p.banned) row.className = "banned";
    const id = cell(row, shortId(p.peer_id), "id", p.peer_id);
    if (p.banned) { const tag = document.createElement("span"); tag.className = "tag"; tag.textContent = "banned"; id.prepend(tag); }
    cell(row, String(p.stage), "num");
    cell(row, p.state, "state-" + p.state);
    cell(row, String(p.step), "num");
    cell(row, fmt(p.throughput, 1), "num");
    cell(row, String(p.queue), "num");
    cell(row, String(p.samples_processed), "num");
    cell(row, idList(p.excluded), "id", p.excluded.join("\n"));
    cell(row, idList(p.excluded_by), "id", p.excluded_by.join("\n"));
    cell(row, idList(p.accused_by), "id", p.accused_by.join("\n"));
  });
  fillTable("trainers-table", state.trainers, (row, t) => {
    cell(row, shortId(t.trainer_id), "id", t.trainer_id);
    cell(row, fmt(t.samples_per_s, 1), "num");
    cell(row, fmt(t.tokens_per_s, 0), "num");
    cell(row, fmt(t.loss, 4), "num");
    cell(row, String(t.samples_sent), "num");
  });
  $("accusations-section").hidden = state.accusations.length === 0;
  fillTable("accusations-table", state.accusations, (row, a) => {
    for (const id of [a.trainer_id, a.accused, a.witness, a.referee]) cell(row, shortId(id), "id", id);
    cell(row, String(a.stage), "num");
    cell(row, a.method);
    cell(row, String(a.step), "num");
  });
}

function renderJoin(join) {
  $("join-peer").textContent = join.peer;
  $("join-trainer").textContent = join.trainer;
  $("join-note").textContent = join.via === "manifest"
    ? "The organiser's signed manifest gives every run setting; nothing else is needed."
    : join.complete
      ? "The run has no manifest: these are its settings as its peers serve them, and must all be given."
      : "Waiting for a peer to tell the run's model and optimizer settings; a joiner must give the same ones.";
}

// The latest text sampled from the run's model (hidden until there is one): the prompt in bold, then the
// continuation, then when and how fast it was sampled, or why sampling failed.
function renderSample(sample) {
  $("sample-section").hidden = !sample;
  if (!sample) return;
  $("sample-prompt").textContent = sample.prompt;
  $("sample-text").textContent = sample.text;
  const minutes = Math.max(0, Date.now() / 1000 - sample.sampled_at) / 60;
  const ago = minutes < 1 ? "less than a minute ago" : `${Math.floor(minutes)} min ago`;
  const step = sample.step === null ? "step \u2013" : `step ${sample.step}`;
  const meta = $("sample-meta");
  meta.className = sample.error ? "note error" : "note";
  meta.textContent = sample.error
    ? `sampling failed (${step}, ${ago}): ${sample.error}`
    : `${step}, ${fmt(sample.tokens_per_s, 1)} tokens/s, ${ago}`;
}

function render(state) {
  renderHeader(state);
  renderTables(state);
  const h = state.history;
  drawChart($("loss-chart"), h.t, h.loss, {color: "#2563eb", digits: 3});
  drawChart($("throughput-chart"), h.t, h.samples_per_s, {color: "#15803d", digits: 1, floor: 0});
  drawChart($("steps-chart"), h.t, h.global_step, {color: "#7c3aed", digits: 0, step: true, floor: 0, marks: state.steps});
  renderJoin(state.join);
  renderSample(state.sample);
}

async function poll() {
  try {
    const response = await fetch("/api/state", {cache: "no-store"});
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
  } catch (error) {
    const status = $("poll-status");
    status.className = "status error";
    status.textContent = `dashboard unreachable: ${error.message}`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

document.addEventListener("click", (event) => {
  const id = event.target.dataset && event.target.dataset.copy;
  if (!id) return;
  const text = $(id).textContent;
  const done = () => { event.target.textContent = "copied"; setTimeout(() => { event.target.textContent = "copy"; }, 1500); };
  if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(text).then(done, () => {});
  else { getSelection().selectAllChildren($(id)); document.execCommand("copy"); done(); }
});

poll();
