// asyncrl inspect: metric curves (runs overlaid, smoothing), live updates, clickable rows.
"use strict";

const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const charts = new Map(); // metric -> {canvas, data}
window.inspector = {charts}; // what a page shows, for a script (or a test) to read

function smooth(values, weight) {
  // TensorBoard's debiased exponential moving average; null values stay null
  let last = 0, count = 0;
  return values.map((v) => {
    if (v === null) return null;
    last = last * weight + (1 - weight) * v;
    count += 1;
    return last / (1 - Math.pow(weight, count));
  });
}

function chosenRuns() {
  const boxes = document.querySelectorAll("input.run");
  const host = document.getElementById("charts");
  if (host && host.dataset.runs) return host.dataset.runs;
  return Array.from(boxes).filter((b) => b.checked).map((b) => b.value).join(",");
}

async function loadChart(key) {
  const res = await fetch(`/api/series?key=${encodeURIComponent(key)}&runs=${chosenRuns()}`);
  const body = await res.json();
  if (!res.ok) throw new Error(body.error || res.statusText);
  const chart = charts.get(key);
  if (!chart) return;
  chart.data = body.runs.filter((run) => run.steps.length > 0);
  draw(key);
}

function addChart(key) {
  if (charts.has(key)) return;
  const host = document.getElementById("charts");
  const box = document.createElement("div");
  box.className = "chart";
  box.dataset.key = key;
  box.innerHTML = `<div class="chart-title"><span></span> <button title="remove">×</button></div>`
    + `<canvas width="520" height="240"></canvas><div class="readout"></div>`;
  box.querySelector("span").textContent = key;
  box.querySelector("button").onclick = () => { charts.delete(key); box.remove(); };
  host.appendChild(box);
  const canvas = box.querySelector("canvas");
  charts.set(key, {canvas, data: [], box});
  canvas.addEventListener("mousemove", (e) => readout(key, e));
  loadChart(key).catch((err) => { box.querySelector(".readout").textContent = String(err); });
}

function bounds(data, weight) {
  let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
  for (const run of data) {
    const ys = smooth(run.values, weight);
    run.smoothed = ys;
    run.steps.forEach((x, i) => {
      if (ys[i] === null) return;
      x0 = Math.min(x0, x); x1 = Math.max(x1, x);
      y0 = Math.min(y0, ys[i], run.values[i]); y1 = Math.max(y1, ys[i], run.values[i]);
    });
  }
  if (x0 === Infinity) return null;
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  return {x0, x1, y0, y1};
}

function draw(key) {
  const chart = charts.get(key);
  const weight = Number(document.getElementById("smoothing").value);
  const ctx = chart.canvas.getContext("2d");
  const W = chart.canvas.width, H = chart.canvas.height, L = 56, B = 22, T = 8, R = 10;
  ctx.clearRect(0, 0, W, H);
  const b = bounds(chart.data, weight);
  chart.bounds = b;
  if (!b) { ctx.fillText("no values logged yet", L, H / 2); return; }
  const px = (x) => L + (x - b.x0) / (b.x1 - b.x0) * (W - L - R);
  const py = (y) => T + (1 - (y - b.y0) / (b.y1 - b.y0)) * (H - T - B);
  chart.px = px; chart.py = py;
  ctx.strokeStyle = "#ccc"; ctx.fillStyle = "#444"; ctx.font = "11px sans-serif";
  for (let k = 0; k <= 4; k++) {
    const y = b.y0 + (b.y1 - b.y0) * k / 4, x = b.x0 + (b.x1 - b.x0) * k / 4;
    ctx.beginPath(); ctx.moveTo(L, py(y)); ctx.lineTo(W - R, py(y)); ctx.stroke();
    ctx.fillText(Number(y.toPrecision(3)).toString(), 2, py(y) + 4);
    ctx.fillText(Math.round(x).toString(), px(x) - 10, H - 6);
  }
  chart.data.forEach((run, n) => {
    const colour = COLOURS[run.run % COLOURS.length];
    for (const [ys, alpha, width] of [[run.values, 0.25, 1], [run.smoothed, 1, 1.6]]) {
      if (weight === 0 && alpha < 1) continue;
      ctx.globalAlpha = alpha; ctx.strokeStyle = colour; ctx.lineWidth = width; ctx.beginPath();
      let pen = false;
      run.steps.forEach((x, i) => {
        if (ys[i] === null) { pen = false; return; }
        if (pen) ctx.lineTo(px(x), py(ys[i])); else ctx.moveTo(px(x), py(ys[i]));
        pen = true;
      });
      ctx.stroke();
    }
    ctx.globalAlpha = 1; ctx.lineWidth = 1;
    ctx.fillStyle = colour; ctx.fillText(run.name, W - R - 120, T + 12 + 13 * n);
  });
}

function readout(key, e) {
  const chart = charts.get(key);
  if (!chart.bounds) return;
  const rect = chart.canvas.getBoundingClientRect();
  const x = chart.bounds.x0 + (e.clientX - rect.left - 56) / (rect.width - 66) * (chart.bounds.x1 - chart.bounds.x0);
  const parts = chart.data.map((run) => {
    let best = -1, gap = Infinity;
    run.steps.forEach((s, i) => { if (Math.abs(s - x) < gap) { gap = Math.abs(s - x); best = i; } });
    if (best < 0 || run.smoothed[best] === null) return "";
    return `${run.name}: step ${Math.round(run.steps[best])} = ${Number(run.values[best].toPrecision(4))}`
      + ` (smoothed ${Number(run.smoothed[best].toPrecision(4))})`;
  });
  chart.box.querySelector(".readout").textContent = parts.filter(Boolean).join(" · ");
}

function setupCharts() {
  const host = document.getElementById("charts");
  if (!host) return;
  JSON.parse(host.dataset.keys || "[]").forEach(addChart);
  const picker = document.getElementById("metric");
  if (picker) picker.addEventListener("change", () => { if (picker.value) addChart(picker.value); picker.value = ""; });
  const slider = document.getElementById("smoothing");
  slider.addEventListener("input", () => {
    document.getElementById("smoothing-value").textContent = slider.value;
    charts.forEach((_, key) => draw(key));
  });
  document.querySelectorAll("input.run").forEach((b) => b.addEventListener("change", () => {
    charts.forEach((_, key) => loadChart(key));
  }));
}

let lastSeen = null;
async function poll() {
  const live = document.body.dataset.live;
  try {
    const res = await fetch("/api/status");
    const body = await res.json();
    const now = JSON.stringify(body.runs.map((r) => [r.last_step, r.last_kept_step, r.evaluations]));
    const writing = body.runs.filter((r) => r.writing).map((r) => r.name);
    document.getElementById("live").textContent = writing.length ? `live: ${writing.join(", ")} writing` : "";
    if (lastSeen !== null && now !== lastSeen) {
      if (live === "curves") charts.forEach((_, key) => loadChart(key));
      if (live === "table") showNewer();
    }
    lastSeen = now;
  } catch (err) {
    document.getElementById("live").textContent = "the inspector does not answer";
  }
}

function showNewer() {
  if (document.getElementById("newer")) return;
  const note = document.createElement("p");
  note.id = "newer";
  note.innerHTML = 'newer steps were kept: <a href="">show them</a>';
  document.querySelector("main h1").after(note);
}

function setupRows() {
  document.querySelectorAll("tr.row").forEach((tr) => {
    tr.addEventListener("click", (e) => { if (e.target.tagName !== "A") window.location = tr.dataset.href; });
  });
}

setupCharts();
setupRows();
poll();
setInterval(poll, 3000);
