// Hand-written SVG charts: a line chart with points and a sparkline. No library.

import { s, si } from "./dom.js";

const W = 640;
const H = 260;
const PAD = { left: 52, right: 12, top: 12, bottom: 36 };

function extent(values) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) { if (v < lo) lo = v; if (v > hi) hi = v; }
  if (!Number.isFinite(lo)) return [0, 1];
  if (lo === hi) return [lo - 0.5, hi + 0.5];
  return [lo, hi];
}

/** About ``count`` round tick values between lo and hi. */
function ticks(lo, hi, count = 5) {
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((st) => (hi - lo) / st <= count);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(v);
  return out;
}

function label(v) {
  return Math.abs(v) >= 1000 ? si(v) : Number(v.toPrecision(4)).toString();
}

/**
 * series: [{name, key, points: [{x, y, round}]}] -> an <svg> with one <circle data-round>
 * per point (class "pt"), inside <g data-series=key>.
 */
export function lineChart({ series, xLabel, yLabel, title }) {
  const all = series.flatMap((se) => se.points);
  const [x0, x1] = extent(all.map((p) => p.x));
  const [y0, y1] = extent(all.map((p) => p.y));
  const px = (x) => PAD.left + ((x - x0) / (x1 - x0)) * (W - PAD.left - PAD.right);
  const py = (y) => H - PAD.bottom - ((y - y0) / (y1 - y0)) * (H - PAD.top - PAD.bottom);
  const svg = s("svg", {
    viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": title,
  });
  svg.append(s("title", { text: title }));
  const grid = s("g", { class: "grid" });
  for (const t of ticks(y0, y1)) {
    grid.append(
      s("line", { x1: PAD.left, x2: W - PAD.right, y1: py(t), y2: py(t) }),
      s("text", { x: PAD.left - 6, y: py(t) + 4, "text-anchor": "end", text: label(t) }),
    );
  }
  for (const t of ticks(x0, x1, 6)) {
    grid.append(s("text", { x: px(t), y: H - PAD.bottom + 16, "text-anchor": "middle", text: label(t) }));
  }
  grid.append(
    s("text", { x: (PAD.left + W - PAD.right) / 2, y: H - 4, "text-anchor": "middle", text: xLabel }),
    s("text", { x: 12, y: H / 2, transform: `rotate(-90 12 ${H / 2})`, "text-anchor": "middle", text: yLabel }),
  );
  svg.append(grid);
  if (all.length === 0) {
    svg.append(s("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty", text: "no closed rounds yet" }));
    return svg;
  }
  for (const se of series) {
    const g = s("g", { class: `series ${se.key}`, "data-series": se.key });
    const d = se.points.map((p, i) => `${i ? "L" : "M"}${px(p.x).toFixed(1)},${py(p.y).toFixed(1)}`).join("");
    if (d) g.append(s("path", { d, class: "line" }));
    for (const p of se.points) {
      g.append(
        s("circle", { cx: px(p.x).toFixed(1), cy: py(p.y).toFixed(1), r: 2.5, class: "pt", "data-round": p.round },
          s("title", { text: `round ${p.round}: ${se.name} ${p.y.toFixed(4)}` })),
      );
    }
    svg.append(g);
  }
  return svg;
}

/** A small trend line of ``values`` (no axes); empty when fewer than two. */
export function sparkline(values, label) {
  const w = 120;
  const h = 28;
  const svg = s("svg", { viewBox: `0 0 ${w} ${h}`, class: "spark", role: "img", "aria-label": label });
  if (values.length < 2) return svg;
  const [lo, hi] = extent(values);
  const d = values
    .map((v, i) => `${i ? "L" : "M"}${((i / (values.length - 1)) * (w - 2) + 1).toFixed(1)},${(h - 2 - ((v - lo) / (hi - lo)) * (h - 4)).toFixed(1)}`)
    .join("");
  svg.append(s("path", { d }));
  return svg;
}
