/* gpupool status page: a small SVG line plot (time on x, one line per series), no dependencies.
 *
 *   GpupoolPlot.draw(element, {series: [{name, points: [[t_s, value|null], ...]}],
 *                              yFormat: v => "…", yMin: 0, yMax: null, yTopAtLeast: 0})
 *
 * Gaps (null values) break a line. The y range starts at yMin (default 0) and ends at yMax or
 * the largest value or yTopAtLeast (rounded up to a "nice" number). Written for this page instead of vendoring
 * a plotting library: six line charts of at most 720 points each need about 150 lines.
 */
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777",
    "#4b5563"];
  const W = 460, H = 190, PAD_L = 52, PAD_R = 10, PAD_T = 10, PAD_B = 24;

  function el(name, attrs, parent) {
    const node = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (parent) parent.appendChild(node);
    return node;
  }

  function niceCeil(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 4, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  function clock(t_s, seconds) {
    const d = new Date(t_s * 1000);
    const two = n => String(n).padStart(2, "0");
    return two(d.getHours()) + ":" + two(d.getMinutes()) + (seconds ? ":" + two(d.getSeconds()) : "");
  }

  function draw(container, opts) {
    const series = opts.series || [];
    const fmt = opts.yFormat || (v => String(v));
    let tMin = Infinity, tMax = -Infinity, vMax = -Infinity;
    for (const s of series) {
      for (const [t, v] of s.points) {
        tMin = Math.min(tMin, t);
        tMax = Math.max(tMax, t);
        if (v !== null && v !== undefined && Number.isFinite(v)) vMax = Math.max(vMax, v);
      }
    }
    container.replaceChildren();
    const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", class: "plot"}, container);
    if (!Number.isFinite(tMin) || !Number.isFinite(vMax)) {
      el("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"}, svg)
        .textContent = "no data yet";
      return;
    }
    if (tMax - tMin < 120) tMin = tMax - 120;  // at least two minutes wide
    const yMin = opts.yMin ?? 0;
    const yMax = opts.yMax ?? niceCeil(Math.max(vMax, opts.yTopAtLeast ?? 0, yMin + 1e-9));
    const x = t => PAD_L + (t - tMin) / (tMax - tMin) * (W - PAD_L - PAD_R);
    const y = v => H - PAD_B - (v - yMin) / (yMax - yMin) * (H - PAD_T - PAD_B);
    for (let i = 0; i <= 4; i++) {
      const v = yMin + (yMax - yMin) * i / 4;
      el("line", {x1: PAD_L, x2: W - PAD_R, y1: y(v), y2: y(v), class: "grid"}, svg);
      el("text", {x: PAD_L - 4, y: y(v) + 4, "text-anchor": "end", class: "tick"}, svg)
        .textContent = fmt(v);
    }
    for (let i = 0; i <= 4; i++) {
      const t = tMin + (tMax - tMin) * i / 4;
      const anchor = i === 0 ? "start" : i === 4 ? "end" : "middle";
      el("text", {x: x(t), y: H - 6, "text-anchor": anchor, class: "tick"}, svg)
        .textContent = clock(t, tMax - tMin < 900);
    }
    series.forEach((s, i) => {
      const color = COLORS[i % COLORS.length];
      let d = "", pen = "M";
      for (const [t, v] of s.points) {
        if (v === null || v === undefined || !Number.isFinite(v)) { pen = "M"; continue; }
        d += `${pen}${x(t).toFixed(1)},${y(Math.min(v, yMax)).toFixed(1)} `;
        pen = "L";
      }
      if (d) el("path", {d, stroke: color, class: "line", "data-series": s.name}, svg);
      const shown = s.points.filter(([, v]) => v !== null && v !== undefined && Number.isFinite(v));
      if (shown.length <= 40) {  // few points: mark each, so a lone one is seen too
        for (const [t, v] of shown) {
          el("circle", {cx: x(t), cy: y(Math.min(v, yMax)), r: 2, fill: color}, svg);
        }
      }
    });
    const legend = document.createElement("div");
    legend.className = "legend";
    series.forEach((s, i) => {
      const item = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = COLORS[i % COLORS.length];
      item.append(swatch, document.createTextNode(s.name));
      legend.appendChild(item);
    });
    container.appendChild(legend);
  }

  window.GpupoolPlot = {draw};
})();
