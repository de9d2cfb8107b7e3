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
      c.task ? `${c.task} ${c.phase || ""}${c.total ? ` ${c.done}/${c.total}` : ""}` : "idle"]) { const td = document.createElement("td"); td.textContent = v; tr.appendChild(td); }
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
    const live = t.live ? `${t.live.phase || "-"} ${t.live.done}/${t.live.total}` + (t.live.checkpoint_bytes === undefined ? "" : `, checkpoints ${formatValue("bytes", t.live.checkpoint_bytes)}`) : "";
    // cuts: the payload's own count once the result is down (every cut the task lived through),
    // before that the cuts this console saw while the task ran
    const cuts = t.result && typeof t.result.interruptions === "number" ? `${t.result.interruptions} survived` : `${t.cuts_seen ?? 0} seen`;
    for (const v of [t.task_id, t.state || "", live, cuts, t.prompt || "", String(t.priority ?? ""), (t.images || []).map((i) => i.name || i).join(", "), result]) {
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
// Every command any `ow ground` process of this station sent (the station's command log: the
// CLI's and this console's alike), with who sent it, its answer code and round trip.
function showCommand(c) {
  const tr = document.createElement("tr"); tr.className = c.ok || c.not_yet ? "" : "sev-WARNING_HI";
  const what = c.what && !c.what.startsWith(c.command) ? `${c.command} ${c.what}` : (c.what || c.command);
  const count = c.chunks !== undefined ? ` ×${c.chunks}` : (c.sends > 1 ? ` (sent ${c.sends}×)` : "");
  for (const v of [fmtTime(c.t), what + count, c.origin || "", c.code + (c.text ? ": " + c.text : ""), c.rtt_ms]) {
    const td = document.createElement("td"); td.textContent = v; tr.appendChild(td);
  }
  const body = $("#commands tbody"); body.insertBefore(tr, body.firstChild);
  while (body.childElementCount > MAX_ROWS) body.removeChild(body.lastChild);
}

// --- telemetry -----------------------------------------------------------------------------
const GROUPS = [["battery (state of charge), power (W), bus voltage (V)", ["battery_soc", "payload_power_w", "bus_voltage_v"]],
  ["temperature (°C)", ["payload_temp_c", "bus_temp_c"]],
  ["storage: checkpoint bytes held, disk free", ["storage_used_bytes", "disk_free_bytes"]],
  ["wear and memory: bytes written to storage over the boots seen, payload resident memory", ["storage_written_bytes", "payload_memory_bytes"]],
  ["queue and progress", ["queue_depth", "progress_done"]]];
// Axis labels in human units: bytes in B/KiB/MiB/GiB (one unit per axis, chosen by its largest
// label, as many decimals as its step needs), the battery in %, °C, W, V; counts in whole numbers.
const COLOURS = ["#c60", "#06c", "#393", "#939"];
const UNITS = { battery_soc: "fraction", payload_power_w: "W", bus_voltage_v: "V", payload_temp_c: "°C", bus_temp_c: "°C",
  storage_used_bytes: "bytes", disk_free_bytes: "bytes", storage_written_bytes: "bytes", payload_memory_bytes: "bytes",
  queue_depth: "count", progress_done: "count" };
const BYTE_UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];
// Ticks on round numbers of the unit the axis shows (0.1 GiB on a GiB axis, not 100 MiB), about
// one per 30 px; counts in whole steps.
function niceStep(raw) {
  const decade = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * decade).find((s) => s >= raw * (1 - 1e-9));
}
function roundTicks(unit) {
  return (u, axisIdx, min, max) => {
    if (!(max > min)) return [min];
    const size = unit === "bytes" ? 1024 ** byteUnit(Math.max(Math.abs(min), Math.abs(max))) : 1;
    const wanted = Math.max(2, Math.floor(u.bbox.height / uPlot.pxRatio / 30));
    let step = niceStep((max - min) / size / wanted);
    if (unit === "count" || (unit === "bytes" && size === 1)) step = Math.max(1, step);
    const ticks = [];
    for (let v = Math.ceil(min / size / step - 1e-9) * step; v <= max / size + step * 1e-9; v += step) ticks.push(+(v * size).toPrecision(12));
    return ticks;
  };
}
function byteUnit(v) { let k = 0; while (k < BYTE_UNITS.length - 1 && Math.abs(v) >= 1024 ** (k + 1)) k++; return k; }
function decimalsFor(step) { return step > 0 ? Math.min(4, Math.max(0, Math.ceil(-Math.log10(step) - 1e-6))) : 0; }
function formatTicks(unit, ticks, step) {
  if (unit === "bytes") {
    const k = byteUnit(Math.max(...ticks.map(Math.abs))), size = 1024 ** k, d = k ? decimalsFor(step / size) : 0;
    return ticks.map((v) => `${(v / size).toFixed(d)} ${BYTE_UNITS[k]}`);
  }
  if (unit === "fraction") return ticks.map((v) => `${(100 * v).toFixed(decimalsFor(100 * step))} %`);
  if (unit === "count") return ticks.map((v) => String(Math.round(v)));
  return ticks.map((v) => `${v.toFixed(decimalsFor(step))}${unit ? " " + unit : ""}`);
}
function formatValue(unit, v) {
  if (unit === "bytes") { const k = byteUnit(v); return k ? `${+(v / 1024 ** k).toPrecision(4)} ${BYTE_UNITS[k]}` : `${v} B`; }
  if (unit === "fraction") return `${+(100 * v).toPrecision(4)} %`;
  if (unit === "count") return String(v);
  return `${+v.toPrecision(4)} ${unit}`;
}
// bytes and counts start at zero when they are small (uPlot would otherwise centre one value in 0..100)
function countRange(u, min, max) {
  if (min === null || max === null) return [0, 1];
  const lo = min >= 0 && min <= (max - min) * 3 ? 0 : min, hi = max > lo ? max : lo + 1;
  return uPlot.rangeNum(lo, hi, 0.1, true);
}
const measurer = document.createElement("canvas").getContext("2d");
function axisSize(u, values, axisIdx) {
  if (!values) return 50;
  measurer.font = u.axes[axisIdx].font[0];  // the font uPlot draws the labels with
  return Math.max(50, Math.ceil(Math.max(...values.map((v) => measurer.measureText(v).width)) / uPlot.pxRatio) + 22);  // + ticks and gap; at least room for the time axis's first date
}
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
    const opts = { width: plotWidth(), height: empty ? 60 : 170, title: empty ? `${title}: no samples in this range (the trace does not carry them)` : title,
      series: [{}, ...names.map((n, i) => ({ label: n, stroke: COLOURS[i], spanGaps: true, scale: n,
        value: (u, v) => (v === null || v === undefined ? "--" : formatValue(UNITS[n] || "", v)) }))],
      // one axis per series, in its colour and its unit, each as wide as its longest label
      axes: [{}, ...names.map((n, i) => ({ scale: n, side: i % 2 ? 1 : 3, stroke: COLOURS[i], grid: { show: i === 0 },
        ...(UNITS[n] === "bytes" || UNITS[n] === "count" ? { splits: roundTicks(UNITS[n]) } : {}),
        values: (u, ticks, axis, space, step) => formatTicks(UNITS[n] || "", ticks, ticks.length > 1 ? ticks[1] - ticks[0] : step), size: axisSize }))],
      scales: { x: { time: true }, ...Object.fromEntries(names.map((n) => [n, UNITS[n] === "bytes" || UNITS[n] === "count" ? { range: countRange } : {}])) },
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
// The upload to the payload, as the station's client reports it (chunks acknowledged on board);
// a held chunk is not sent again, so an uplink sent again after a cut starts where it stopped.
state.uploads = {};
function showUpload(r) {
  state.uploads[r.image] = r;
  $("#payload-progress").value = (100 * r.done) / Math.max(1, r.size);
  $("#payload-progress-text").textContent = `${r.image}: ${r.done} of ${r.size} bytes on board`;
}
// The images go to the console in resumable chunks (docs/ground.md "Upload to the console"): an
// upload is named by the file's SHA-256, so after a dropped connection, a page reload or a console
// restart the same file finds the offset the console kept and goes on from there.
state.uploadChunkBytes = 256 * 1024;
class Refused extends Error {}
class Paused extends Refused {}  // no progress for a minute: the operator goes on later
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
async function sha256Hex(buffer) {
  if (!window.crypto || !crypto.subtle) throw new Refused("this page is not a secure context (https, or loopback): the browser offers no SHA-256 to name the upload");
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", buffer));
  return Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join("");
}
async function call(method, url, body, headers) {
  const r = await fetch(url, { method, body, headers: { "X-Console-Token": token(), ...headers } });  // a network failure throws
  const data = await r.json().catch(() => ({ ok: false, error: `HTTP ${r.status}` }));
  return { status: r.status, data };
}
function kib(n) { return n < 10240 ? `${n} B` : n < 10 * 1048576 ? `${(n / 1024).toFixed(1)} KiB` : `${(n / 1048576).toFixed(1)} MiB`; }
async function uploadToConsole(file, shown) {
  const sha = await sha256Hex(await file.arrayBuffer());
  let lastProgress = Date.now(), pause = 1000, failures = 0;
  for (;;) {
    try {
      let r = await call("POST", "/api/uploads", JSON.stringify({ name: file.name, size: file.size, sha256: sha }), { "Content-Type": "application/json" });
      if (r.status !== 200) throw new Refused(r.data.error || `HTTP ${r.status}`);
      let offset = r.data.offset;
      shown(offset);
      while (offset < file.size) {
        const chunk = await file.slice(offset, offset + state.uploadChunkBytes).arrayBuffer();
        r = await call("PUT", `/api/uploads/${sha}`, chunk, { "Upload-Offset": String(offset), "Chunk-SHA256": await sha256Hex(chunk), "Content-Type": "application/octet-stream" });
        if (r.status === 409 && typeof r.data.offset === "number") { offset = r.data.offset; shown(offset); continue; }  // the console's offset wins
        if (r.status === 400 || r.status === 422) {  // a chunk damaged on the way, a file dropped: ask again, a few times
          if (++failures > 3) throw new Refused(r.data.error);
          break;
        }
        if (r.status !== 200) throw new Refused(r.data.error || `HTTP ${r.status}`);
        offset = r.data.offset; shown(offset); lastProgress = Date.now(); pause = 1000;
      }
      if (offset >= file.size) return { upload: sha, name: file.name };
    } catch (e) {
      if (e instanceof Refused) throw e;
      state.uploadRetries = (state.uploadRetries || 0) + 1;
      if (Date.now() - lastProgress > 60000) throw new Paused(`upload of ${file.name} to the console paused: no progress for a minute (${e.message}); press uplink again to continue where it stopped`);
      $("#uplink-status").textContent = `connection to the console lost (${e.message}); trying ${file.name} again in ${pause / 1000} s from where the console stands`;
      await sleep(pause); pause = Math.min(2 * pause, 8000);
    }
  }
}
// An uplink under way is kept in the browser (IndexedDB, which holds the chosen files themselves)
// until the console has answered it: a page reloaded or closed midway finds it again, with its
// files, and "uplink" goes on from where the console stands.
function pendingStore(mode, work) {
  return new Promise((resolve, reject) => {
    const opened = indexedDB.open("ow-console", 1);
    opened.onupgradeneeded = () => opened.result.createObjectStore("uplink");
    opened.onerror = () => reject(opened.error);
    opened.onsuccess = () => {
      const tx = opened.result.transaction("uplink", mode), request = work(tx.objectStore("uplink"));
      tx.oncomplete = () => { opened.result.close(); resolve(request.result); };
      tx.onerror = () => reject(tx.error);
    };
  });
}
const pending = {
  save: (value) => pendingStore("readwrite", (s) => s.put(value, "pending")).catch(() => null),
  clear: () => pendingStore("readwrite", (s) => s.delete("pending")).catch(() => null),
  load: () => pendingStore("readonly", (s) => s.get("pending")).catch(() => null),
};
async function offerPending() {
  const p = await pending.load();
  if (!p || !p.files || !p.files.length) return;
  $("#prompt").value = p.prompt; $("#max-new-tokens").value = p.max_new_tokens; $("#priority").value = p.priority;
  chosen = p.files; showChosen();
  $("#uplink-status").className = "error";
  $("#uplink-status").textContent = `an uplink was cut short before the console answered it (${p.files.map((f) => f.name).join(", ")}): press uplink to go on from where the console stands`;
}
$("#uplink-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const status = $("#uplink-status"); status.className = ""; status.textContent = "sending to the ground station…";
  await pending.save({ prompt: $("#prompt").value, max_new_tokens: $("#max-new-tokens").value, priority: $("#priority").value, files: chosen.slice() });
  $("#upload-progress").value = 0; $("#payload-progress").value = 0; $("#payload-progress-text").textContent = "";
  const files = chosen.slice(), total = files.reduce((n, f) => n + f.size, 0), held = files.map(() => 0);
  const shown = (i) => (offset) => {
    held[i] = offset; const done = held.reduce((a, b) => a + b, 0);
    $("#upload-progress").value = total ? (100 * done) / total : 100;
    status.textContent = `sending to the ground station… ${kib(done)} of ${kib(total)} held by the console`;
  };
  let data, cutShort = false;
  const fields = { prompt: $("#prompt").value, max_new_tokens: $("#max-new-tokens").value, priority: $("#priority").value };
  try {
    // the prompt and the numbers first, as the CLI checks them before it reads a file
    const checked = (await call("POST", "/api/uplink", JSON.stringify({ ...fields, check_only: true }), { "Content-Type": "application/json" })).data;
    if (!checked.ok) throw new Refused(checked.error || "refused");
    const images = [];
    for (let i = 0; i < files.length; i++) images.push(await uploadToConsole(files[i], shown(i)));
    $("#upload-progress").value = 100;
    status.textContent = "uploading to the payload (resumable; chunks the payload already holds are not sent again)…";
    const body = { ...fields, images };
    data = (await call("POST", "/api/uplink", JSON.stringify(body), { "Content-Type": "application/json" })).data;
  } catch (err) {
    data = { ok: false, error: err instanceof Refused ? err.message : `the console did not answer (${err.message})` };
    cutShort = err instanceof Paused || !(err instanceof Refused);
  }
  if (!cutShort) pending.clear();  // the console answered it: nothing to go on with
  if (!data.ok) { status.className = "error"; status.textContent = data.error; return; }
  const r = data.result;
  const lines = r.images.map((i) => `image ${i.name}: ${i.chunks} chunk(s), ${i.held_before} already on board, ${i.chunks_sent} sent${i.resumes ? `, resumed ${i.resumes} time(s)` : ""}; verified on board`);
  lines.push(r.reused_task_id ? `task ${r.task_id} accepted again by the payload (the same task; nothing new queued)` : `task ${r.task_id} accepted by the payload (queued)`);
  status.className = "ok"; status.textContent = lines.join("\n"); status.dataset.task = r.task_id; loadTasks();
});

// --- the stream ----------------------------------------------------------------------------
function onRecord(r) {
  state.lastPush = r;
  if (r.sent_t) state.latencies.push(Date.now() / 1000 - r.sent_t);
  if (state.latencies.length > 10000) state.latencies.shift();
  if (r.type === "COMMAND") { showCommand(r); tasksSoon(); return; }
  if (r.type === "UPLOAD") { showUpload(r); return; }
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
  await Promise.all([loadTimeline(), loadTasks(), offerPending()]);
  state.loadMs = performance.now();  // since navigation start: what the operator waits
  document.body.dataset.loaded = "1";
}
start().catch((e) => { document.body.dataset.error = e.message; $("#link").textContent = "error: " + e.message; });
