// OrbitWeaver ground console. Everything arrives pushed on /api/stream (server-sent events);
// views re-read the server (decimated) only when something they show has changed.
"use strict";
const $ = (s) => document.querySelector(s);
const state = { info: null, events: [], commands: [], kinds: new Set(), severities: new Set(),
  timeline: null, telemetry: null, range: null, plots: [], lastPush: null, latencies: [] };
window.consoleState = state;  // read by the browser tests and the benchmark

const token = () => $("#token").value;
function fmtTime(t) { return new Date(t * 1000).toISOString().replace("T", " ").slice(0, 23); }
async function getJSON(url) { const r = await fetch(url); if (!r.ok) throw new Error(await r.text()); return r.json(); }
async function post(url, body) {
  const r = await fetch(url, { method: "POST", body, headers: { "X-Console-Token": token() } });
  const data = await r.json().catch(() => ({ ok: false, error: `HTTP ${r.status}` }));
  if (!r.ok) throw new Error(data.error || `HTTP ${r.status}`);
  return data;
}
function later(fn, ms) { let pending = null; return () => { if (!pending) pending = setTimeout(() => { pending = null; fn(); }, ms); }; }

// --- views ---------------------------------------------------------------------------------
document.querySelectorAll("nav button").forEach((b) => b.addEventListener("click", () => {
  document.querySelectorAll("nav button").forEach((x) => x.classList.toggle("active", x === b));
  document.querySelectorAll(".view").forEach((v) => v.classList.toggle("active", v.id === "view-" + b.dataset.view));
  if (b.dataset.view === "telemetry") loadTelemetry(); else if (b.dataset.view === "timeline") loadTimeline();
}));

function plotWidth() { return Math.max(400, document.querySelector("main").clientWidth - 40); }

// --- pass timeline -------------------------------------------------------------------------
let timelinePlot = null, timelineZoom = null;
async function loadTimeline() {
  const q = timelineZoom ? `?t0=${timelineZoom[0]}&t1=${timelineZoom[1]}` : "";
  const tl = await getJSON("/api/timeline" + q);
  state.timeline = tl;
  const marks = [];
  for (const w of tl.windows) { marks.push([w[0], 1, "on"]); if (w[1] !== null) marks.push([w[1], 0, "off"]); }
  for (const c of tl.cuts) marks.push([c.t, 0, "cut"]);
  for (const b of tl.boots) marks.push([b, 1, "boot"]);
  marks.sort((a, b) => a[0] - b[0]);
  // Exactly [t0, t1] on the x axis (the range asked for, what panning moves): a window that
  // opened before t0 only sets the level the view starts at.
  const xs = [], on = [], cut = [], boot = [];
  const point = (t, level, c, b) => { xs.push(t); on.push(level); cut.push(c); boot.push(b); };
  let level = 0, started = false;
  for (const [t, v, what] of marks) {
    const power = what === "on" || what === "off";
    if (t < tl.t0) { if (power) level = v; continue; }
    if (t > tl.t1) break;
    if (!started && t > tl.t0) point(tl.t0, level, null, null);
    started = true;
    if (power) level = v;
    point(t, level, what === "cut" ? 0.5 : null, what === "boot" ? 1.05 : null);
  }
  if (!xs.length) point(tl.t0, level, null, null);
  if (tl.t1 > xs[xs.length - 1]) point(tl.t1, level, null, null);
  const data = [xs, on, cut, boot];
  const opts = { width: plotWidth(), height: 180, title: "payload power windows, cuts and boots",
    scales: { x: { time: true }, y: { range: [-0.1, 1.2] } },
    series: [{}, { label: "payload on", stroke: "#2a7d2a", fill: "rgba(42,125,42,.15)", paths: uPlot.paths.stepped({ align: 1 }) },
      { label: "cut", stroke: "#c00", points: { size: 9, fill: "#c00" }, paths: () => null },
      { label: "boot", stroke: "#06c", points: { size: 7, fill: "#06c" }, paths: () => null }],
    hooks: { setSelect: [(u) => { if (u.select.width > 2) {
      timelineZoom = [u.posToVal(u.select.left, "x"), u.posToVal(u.select.left + u.select.width, "x")]; loadTimeline(); } }] },
    cursor: { drag: { x: true, setScale: false } } };
  if (timelinePlot) timelinePlot.destroy();
  timelinePlot = new uPlot(opts, data, $("#timeline-plot"));
  timelinePlot.over.addEventListener("dblclick", () => { timelineZoom = null; loadTimeline(); });
  const doing = tl.doing && tl.doing.task ? `running ${tl.doing.task} (${tl.doing.phase || "-"})` : "idle";
  $("#now").textContent = `payload ${tl.payload_on ? "ON" : "OFF"}, ${doing}; ${tl.total_cuts} cut(s), ${tl.boots.length} boot(s) in view`;
  $("#cuts tbody").innerHTML = "";
  for (const c of tl.cuts.slice(-200).reverse()) {
    const tr = document.createElement("tr");
    tr.className = "cut";
    for (const v of [fmtTime(c.t), c.cause + (c.after_fault ? " (after fault)" : ""),
      c.warning_lead_s === null ? "no warning" : c.warning_lead_s.toFixed(1),
      c.task ? `${c.task} ${c.phase || ""}` : "idle"]) { const td = document.createElement("td"); td.textContent = v; tr.appendChild(td); }
    $("#cuts tbody").appendChild(tr);
  }
}
const timelineSoon = later(() => { if (!panning) loadTimeline(); }, 250);  // (mouseup reloads)

// Pan: the same width, earlier or later, kept inside the history. The buttons and arrow keys move
// half a view; shift+drag moves the drawn view with the mouse (no request while dragging: the
// plot only shifts its scale, so it stays smooth on a 72-hour history) and fetches the new range,
// thinned by the server, once, on release.
function panTo(t0, width) {
  const [s0, s1] = state.timeline.span;
  t0 = Math.min(Math.max(t0, s0), s1 - width);
  timelineZoom = [t0, t0 + width];
  return loadTimeline();
}
function panTimeline(fraction) {
  const tl = state.timeline;
  if (!tl) return Promise.resolve();
  const width = tl.t1 - tl.t0;
  if (!(width > 0) || width >= tl.span[1] - tl.span[0]) return Promise.resolve();  // all of it is shown
  return panTo(tl.t0 + fraction * width, width);
}
$("#pan-earlier").addEventListener("click", () => panTimeline(-0.5));
$("#pan-later").addEventListener("click", () => panTimeline(0.5));
document.addEventListener("keydown", (e) => {
  if (!$("#view-timeline").classList.contains("active") || e.target.matches("input, textarea, select")) return;
  if (e.key === "ArrowLeft") panTimeline(-0.5); else if (e.key === "ArrowRight") panTimeline(0.5);
});
let panning = null;
function panShift(e) { return ((e.clientX - panning.x) / timelinePlot.over.clientWidth) * (panning.max - panning.min); }
$("#timeline-plot").addEventListener("mousedown", (e) => {
  if (!e.shiftKey || !timelinePlot || !state.timeline) return;
  e.stopPropagation(); e.preventDefault();  // before uPlot sees it: a pan, not a zoom selection
  panning = { x: e.clientX, min: timelinePlot.scales.x.min, max: timelinePlot.scales.x.max };
}, true);
window.addEventListener("mousemove", (e) => {
  if (!panning) return;
  const dt = panShift(e);
  timelinePlot.setScale("x", { min: panning.min - dt, max: panning.max - dt });
});
window.addEventListener("mouseup", (e) => {
  if (!panning) return;
  const dt = panShift(e), width = panning.max - panning.min, from = panning.min;
  panning = null;
  if (dt !== 0 && width < state.timeline.span[1] - state.timeline.span[0]) panTo(from - dt, width); else loadTimeline();
});

// --- tasks ---------------------------------------------------------------------------------
// The completion forecast as `ow ground status` says it: per task the expected time, the 10-90 %
// band and the power-ups still to come, or why there is none (ground/forecast.py).
function forecastText(f) {
  if (f === null || f === undefined) return "no forecast (the console has no ground state)";
  if (f.error) return f.error;
  if (f.unavailable) return "no forecast: " + f.unavailable;
  const clock = (t) => new Date(t * 1000).toISOString().slice(11, 19) + "Z";
  const parts = Object.entries(f.tasks || {}).map(([id, x]) =>
    x.expected === undefined ? `${id}: ${x.reason || x.unavailable || "no forecast"}`
      : `${id}: done at ${clock(x.expected)} (10-90 % ${clock(x.p10)}..${clock(x.p90)}; ${x.windows} more window(s))`);
  return parts.length ? "completion forecast: " + parts.join("; ") : "completion forecast: no open task";
}
async function loadTasks() {
  const data = await getJSON("/api/tasks");
  const f = data.forecast;
  $("#forecast").textContent = forecastText(f);
  const body = $("#tasks tbody"); body.innerHTML = "";
  for (const t of data.tasks.slice().reverse()) {
    const tr = document.createElement("tr"); tr.dataset.task = t.task_id;
    const timings = t.result && t.result.timings ? Object.entries(t.result.timings).map(([k, v]) => `${k} ${(+v).toFixed(2)} s`).join(", ") : "";
    const result = t.result ? `${t.result.text} — logits SHA-256 ${String(t.result.logits_sha256).slice(0, 16)}… (${timings})` : "";
    const live = t.live ? `${t.live.phase || "-"} ${t.live.done}/${t.live.total}, checkpoints ${t.live.checkpoint_bytes} B` : "";
    for (const v of [t.task_id, t.state || "", live, String(t.cuts_seen ?? 0), t.prompt || "", String(t.priority ?? ""), (t.images || []).map((i) => i.name || i).join(", "), result]) {
      const td = document.createElement("td"); td.textContent = v; tr.appendChild(td);
    }
    const td = document.createElement("td");
    for (const [label, act] of [["cancel", "cancel"], ["priority", "priority"], ["resend", "resend"]]) {
      const b = document.createElement("button"); b.textContent = label; b.disabled = state.info.read_only;
      b.addEventListener("click", () => taskAction(t.task_id, act)); td.appendChild(b);
    }
    tr.appendChild(td); body.appendChild(tr);
  }
}
async function taskAction(task, act) {
  const body = new FormData();
  if (act === "priority") { const p = prompt(`new priority for ${task}`); if (p === null) return; body.append("priority", p); }
  try { await post(`/api/tasks/${encodeURIComponent(task)}/${act}`, body); } catch (e) { alert(`${act} ${task}: ${e.message}`); }
  loadTasks();
}
$("#release").addEventListener("click", async () => {
  const item = $("#release-item").value.trim(); if (!item) return;
  try { await post(`/api/quarantine/${encodeURIComponent(item)}/release`, new FormData()); alert(`${item}: released from quarantine`); }
  catch (e) { alert(`release ${item}: ${e.message}`); }
});
const tasksSoon = later(loadTasks, 300);

// --- events and commands -------------------------------------------------------------------
const MAX_ROWS = 2000;
function addOption(sel, set, v) { if (v && !set.has(v)) { set.add(v); const o = document.createElement("option"); o.textContent = v; $(sel).appendChild(o); } }
function eventRow(e) {
  const tr = document.createElement("tr"); tr.dataset.kind = e.type; tr.dataset.severity = e.severity || "";
  tr.dataset.routine = e.routine ? "1" : "";
  tr.className = "sev-" + (e.severity || "");
  for (const v of [e.n, fmtTime(e.t), e.type === "EVENT" ? e.body.event_id : e.type, e.severity || "", e.text || ""]) {
    const td = document.createElement("td"); td.textContent = v; tr.appendChild(td);
  }
  applyFilter(tr); return tr;
}
function applyFilter(tr) {
  const k = $("#kind-filter").value, s = $("#severity-filter").value;
  // routine housekeeping (FDIR nominal every second...) only when asked, as `ow ground events --all`
  const routine = tr.dataset.routine && !$("#show-routine").checked && k !== tr.dataset.kind;
  tr.hidden = routine || (k && tr.dataset.kind !== k) || (s && tr.dataset.severity !== s);
}
["#kind-filter", "#severity-filter", "#show-routine"].forEach((s) => $(s).addEventListener("change", () => document.querySelectorAll("#events tbody tr").forEach(applyFilter)));
function showEvent(e) {
  addOption("#kind-filter", state.kinds, e.type); addOption("#severity-filter", state.severities, e.severity);
  const body = $("#events tbody"); body.insertBefore(eventRow(e), body.firstChild);
  while (body.childElementCount > MAX_ROWS) body.removeChild(body.lastChild);
}
function showCommand(c) {
  const tr = document.createElement("tr"); tr.className = c.ok ? "" : "sev-WARNING_HI";
  for (const v of [fmtTime(c.t), c.command, c.code + (c.text ? ": " + c.text : ""), c.rtt_ms]) { const td = document.createElement("td"); td.textContent = v; tr.appendChild(td); }
  const body = $("#commands tbody"); body.insertBefore(tr, body.firstChild);
  while (body.childElementCount > MAX_ROWS) body.removeChild(body.lastChild);
}

// --- telemetry -----------------------------------------------------------------------------
const GROUPS = [["battery (state of charge), power (W), bus voltage (V)", ["battery_soc", "payload_power_w", "bus_voltage_v"]],
  ["temperature (°C)", ["payload_temp_c", "bus_temp_c"]],
  ["storage: checkpoint bytes held, disk free", ["storage_used_bytes", "disk_free_bytes"]],
  ["wear and memory: bytes written to storage over the boots seen, payload resident memory", ["storage_written_bytes", "payload_memory_bytes"]],
  ["queue and progress", ["queue_depth", "progress_done"]]];
let telemetryZoom = null;
async function loadTelemetry() {
  const q = telemetryZoom ? `t0=${telemetryZoom[0]}&t1=${telemetryZoom[1]}&` : "";
  const data = await getJSON(`/api/telemetry?${q}buckets=${Math.round(plotWidth())}`);
  state.telemetry = data;
  state.range = [data.t0, data.t1];
  $("#range").textContent = `${fmtTime(data.t0)} → ${fmtTime(data.t1)}`;
  $("#csv").href = `/api/telemetry.csv?t0=${data.t0}&t1=${data.t1}`;
  state.plots.forEach((p) => p.destroy()); state.plots = [];
  $("#plots").innerHTML = "";
  for (const [title, names] of GROUPS) {
    const times = [...new Set(names.flatMap((n) => (data.series[n] || []).map((p) => p[0])))].sort((a, b) => a - b);
    const cols = names.map((n) => { const m = new Map((data.series[n] || []).map((p) => [p[0], p[1]])); return times.map((t) => (m.has(t) ? m.get(t) : null)); });
    const empty = names.every((n) => !(data.series[n] || []).length);
    const human = (u, vals) => vals.map((v) => (Math.abs(v) >= 1e6 ? (v / 1048576).toFixed(1) + " MiB" : String(+v.toPrecision(4))));
    const opts = { width: plotWidth(), height: empty ? 60 : 170, title: empty ? `${title}: no samples in this range (the trace does not carry them)` : title,
      scales: { x: { time: true } },
      series: [{}, ...names.map((n, i) => ({ label: n, stroke: ["#c60", "#06c", "#393", "#939"][i], spanGaps: true, scale: i ? "y" + i : "y" }))],
      axes: [{}, ...names.map((n, i) => ({ scale: i ? "y" + i : "y", side: i % 2 ? 1 : 3, show: i < 2, values: human, size: 70 }))],
      cursor: { drag: { x: true, setScale: false } },
      hooks: { setSelect: [(u) => { if (u.select.width > 2) {
        telemetryZoom = [u.posToVal(u.select.left, "x"), u.posToVal(u.select.left + u.select.width, "x")]; loadTelemetry(); } }] } };
    const div = document.createElement("div"); $("#plots").appendChild(div);
    state.plots.push(new uPlot(opts, [times, ...cols], div));
  }
}
$("#range-all").addEventListener("click", () => { telemetryZoom = null; loadTelemetry(); });
const telemetrySoon = later(() => { if ($("#view-telemetry").classList.contains("active")) loadTelemetry(); }, 2000);

// --- uplink --------------------------------------------------------------------------------
let chosen = [];
function showChosen() { $("#chosen").innerHTML = ""; for (const f of chosen) { const li = document.createElement("li"); li.textContent = `${f.name} (${f.size} bytes)`; $("#chosen").appendChild(li); } }
$("#images").addEventListener("change", () => { chosen = [...$("#images").files]; showChosen(); });
const drop = $("#drop");
drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (e) => { e.preventDefault(); drop.classList.remove("over"); chosen = chosen.concat([...e.dataTransfer.files]); showChosen(); });
$("#uplink-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const form = new FormData();
  form.append("prompt", $("#prompt").value); form.append("max_new_tokens", $("#max-new-tokens").value); form.append("priority", $("#priority").value);
  for (const f of chosen) form.append("image", f, f.name);
  const status = $("#uplink-status"); status.className = ""; status.textContent = "sending to the ground station…";
  const xhr = new XMLHttpRequest();  // fetch() cannot report upload progress
  xhr.open("POST", "/api/uplink"); xhr.setRequestHeader("X-Console-Token", token());
  xhr.upload.onprogress = (ev) => { if (ev.lengthComputable) $("#upload-progress").value = (100 * ev.loaded) / ev.total; };
  xhr.upload.onload = () => { status.textContent = "uploading to the payload (resumable; chunks the payload already holds are not sent again)…"; };
  xhr.onload = () => {
    let data; try { data = JSON.parse(xhr.responseText); } catch { data = { ok: false, error: `HTTP ${xhr.status}` }; }
    if (!data.ok) { status.className = "error"; status.textContent = data.error; return; }
    const r = data.result;
    const lines = r.images.map((i) => `image ${i.name}: ${i.chunks} chunk(s), ${i.held_before} already on board, ${i.chunks_sent} sent${i.resumes ? `, resumed ${i.resumes} time(s)` : ""}; verified on board`);
    lines.push(r.reused_task_id ? `task ${r.task_id} accepted again by the payload (the same task; nothing new queued)` : `task ${r.task_id} accepted by the payload (queued)`);
    status.className = "ok"; status.textContent = lines.join("\n"); status.dataset.task = r.task_id; loadTasks();
  };
  xhr.onerror = () => { status.className = "error"; status.textContent = "the console did not answer"; };
  xhr.send(form);
});

// --- the stream ----------------------------------------------------------------------------
function onRecord(r) {
  state.lastPush = r;
  if (r.sent_t) state.latencies.push(Date.now() / 1000 - r.sent_t);
  if (state.latencies.length > 10000) state.latencies.shift();
  if (r.type === "COMMAND") { showCommand(r); tasksSoon(); return; }
  if (r.type === "POWER" || r.type === "THERMAL" || r.type === "HEARTBEAT") { telemetrySoon(); return; }
  if (r.n) showEvent(r);
  if (r.type === "POWER_STATE" || r.type === "SHUTDOWN_WARNING" || (r.type === "EVENT" && r.body && r.body.event_id === "BOOT")) timelineSoon();
  if (r.type === "EVENT" && r.body && String(r.body.event_id).startsWith("TASK_")) tasksSoon();
  if (r.type === "HOUSEKEEPING") telemetrySoon();
}
function connect() {
  const source = new EventSource("/api/stream");
  source.onopen = () => { $("#link").textContent = "live"; $("#link").className = "badge live"; };
  source.onmessage = (m) => onRecord(JSON.parse(m.data));
  source.onerror = () => { $("#link").textContent = "reconnecting"; $("#link").className = "badge down"; };
}

async function start() {
  const m = location.hash.match(/token=([^&]+)/); if (m) $("#token").value = decodeURIComponent(m[1]);
  state.info = await getJSON("/api/info");
  $("#station").textContent = state.info.station ? `station ${state.info.station}` : "";
  $("#mode").textContent = state.info.read_only ? "read-only" : "commanding"; $("#mode").className = "badge" + (state.info.read_only ? " ro" : "");
  $("#token-box").hidden = !state.info.token_required;
  if (state.info.read_only) { $("#send").disabled = true; $("#release").disabled = true; }
  connect();  // first: nothing that happens while the history loads is missed
  const page = await getJSON("/api/events?limit=2000");
  page.events.forEach(showEvent); page.commands.forEach(showCommand);
  await Promise.all([loadTimeline(), loadTasks()]);
  state.loadMs = performance.now();  // since navigation start: what the operator waits
  document.body.dataset.loaded = "1";
}
start().catch((e) => { document.body.dataset.error = e.message; $("#link").textContent = "error: " + e.message; });
