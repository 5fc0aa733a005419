// The page's two charts, drawn as inline SVG (no chart library): each parameter tensor's
// gradient error on a log scale (TEST, CONTROL and, when it ran, PORTABLE), and a live loss
// curve. Colours come from style.css (classes series-*), so both themes work.

const NS = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs = {}, ...children) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  e.append(...children);
  return e;
}

function titled(node, text) {
  node.append(svgEl("title", {}, text));
  return node;
}

/** "10⁻⁷" as an SVG text with a raised exponent. */
function powerOfTen(exp, attrs) {
  const sign = exp < 0 ? "−" : "";
  return svgEl("text", attrs, "10", svgEl("tspan", { "baseline-shift": "super", "font-size": "75%" }, `${sign}${Math.abs(exp)}`));
}

/** An error figure: "0", "3.99", "2.76e-6"; null (non-finite in JSON) is "NaN/∞". */
export function formatError(e) {
  if (e === null || e === undefined) return "NaN/∞";
  if (e === 0) return "0";
  if (Number.isInteger(e) && e < 1e6) return String(e);
  return Math.abs(e) >= 0.01 && Math.abs(e) < 1000 ? String(+e.toPrecision(3)) : e.toExponential(2);
}

function fmt(e) {
  return e === 0 ? "0 (bitwise equal)" : formatError(e);
}

/** Which stage of ResNet-34 a parameter belongs to: stem, layer1…layer4, fc. */
function stageOf(name) {
  const m = /^(layer\d|fc)/.exec(name);
  return m ? m[1] : "stem";
}

function median(values) {
  const v = [...values].sort((a, b) => a - b);
  return v.length ? v[Math.floor(v.length / 2)] : NaN;
}

const SERIES = [
  { key: "control", label: "CONTROL: per-replica BatchNorm vs one device (what unsynchronised data parallel gets)", mark: "circle" },
  { key: "test", label: "TEST: synchronised replicas vs one device", mark: "circle" },
  { key: "portable", label: "PORTABLE: this browser vs the native golden", mark: "diamond" },
];

/**
 * Each tensor's errors on a log axis, model order (input → output). Exact zeros sit on a
 * labelled floor below the axis; non-finite errors on the top edge. Returns { svg, caption }.
 */
export function tensorChart(tensors, { testBound }) {
  const series = SERIES.filter((s) => tensors.some((t) => t[s.key] !== null && t[s.key] !== undefined));
  const W = 960, H = 400;
  const m = { left: 64, right: 16, top: 24 + 18 * series.length, bottom: 70 };
  const floorBand = 30;
  const plotW = W - m.left - m.right;
  const plotH = H - m.top - m.bottom - floorBand;
  const values = series.flatMap((s) => tensors.map((t) => t[s.key]));
  const positive = values.filter((v) => typeof v === "number" && v > 0);
  // TEST is held to the bit (bound 0): its bound is then the exact-zero floor, not a line.
  const bounds = testBound > 0 ? [testBound] : [];
  let hi = Math.ceil(Math.log10(Math.max(...bounds.map((b) => b * 10), ...positive, 1e-12)));
  let lo = Math.floor(Math.log10(Math.min(...bounds, ...positive, 10 ** hi)));
  lo = Math.max(lo, hi - 14);
  if (hi - lo < 2) lo = hi - 2;
  const y = (v) => m.top + plotH * (hi - Math.log10(v)) / (hi - lo);
  const yZero = m.top + plotH + floorBand * 0.6;
  const yOf = (v) => (v === null || v === undefined ? m.top : v === 0 ? yZero : y(Math.max(v, 10 ** lo)));
  const step = plotW / tensors.length;
  const x = (i) => m.left + (i + 0.5) * step;

  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": "Per-tensor gradient errors, log scale" });

  // Stage bands, labelled under the axis.
  const stages = [];
  tensors.forEach((t, i) => {
    const s = stageOf(t.name);
    if (!stages.length || stages.at(-1).name !== s) stages.push({ name: s, from: i, to: i });
    stages.at(-1).to = i;
  });
  stages.forEach((s, k) => {
    const x0 = m.left + s.from * step, x1 = m.left + (s.to + 1) * step;
    if (k % 2 === 0) svg.append(svgEl("rect", { x: x0, y: m.top, width: x1 - x0, height: plotH + floorBand, class: "band" }));
    svg.append(svgEl("text", { x: (x0 + x1) / 2, y: H - m.bottom + 26, class: "axis-text", "text-anchor": "middle" }, s.name));
  });

  // Decades.
  for (let e = lo; e <= hi; e++) {
    svg.append(svgEl("line", { x1: m.left, x2: W - m.right, y1: y(10 ** e), y2: y(10 ** e), class: "grid" }));
    svg.append(powerOfTen(e, { x: m.left - 8, y: y(10 ** e) + 4, class: "axis-text", "text-anchor": "end" }));
  }
  // The exact-zero floor.
  const floorTop = m.top + plotH + floorBand * 0.2;
  svg.append(svgEl("line", { x1: m.left, x2: W - m.right, y1: floorTop, y2: floorTop, class: "floor-line" }));
  svg.append(svgEl("text", { x: m.left - 8, y: yZero + 4, class: "axis-text strong", "text-anchor": "end" }, "exact 0"));

  // Bounds.
  const bound = (v, label) => {
    svg.append(svgEl("line", { x1: m.left, x2: W - m.right, y1: y(v), y2: y(v), class: "bound" }));
    svg.append(svgEl("text", { x: W - m.right - 4, y: y(v) - 4, class: "axis-text bound-text", "text-anchor": "end" }, label));
  };
  if (testBound > 0) bound(testBound, `TEST's bound ${testBound.toExponential(0)}`);

  // Points: CONTROL first, so TEST and PORTABLE stay visible on top.
  for (const s of series) {
    const g = svgEl("g", { class: `points series-${s.key}` });
    tensors.forEach((t, i) => {
      const v = t[s.key];
      const cx = x(i), cy = yOf(v);
      const r = 3.2;
      const shape = s.mark === "diamond"
        ? svgEl("path", { d: `M${cx} ${cy - r - 1}L${cx + r + 1} ${cy}L${cx} ${cy + r + 1}L${cx - r - 1} ${cy}Z`, class: "mark hollow" })
        : svgEl("circle", { cx, cy, r, class: "mark" });
      g.append(titled(shape, `${t.name}\n${s.key.toUpperCase()}: ${fmt(v)}`));
    });
    svg.append(g);
  }

  // Axes and their labels.
  svg.append(svgEl("line", { x1: m.left, x2: m.left, y1: m.top, y2: m.top + plotH + floorBand, class: "axis" }));
  svg.append(svgEl("text", { x: 14, y: m.top + plotH / 2, class: "axis-label", "text-anchor": "middle", transform: `rotate(-90 14 ${m.top + plotH / 2})` },
    "gradient error ‖a − b‖ / ‖b‖ (log)"));
  svg.append(svgEl("text", { x: m.left + plotW / 2, y: H - 10, class: "axis-label", "text-anchor": "middle" },
    `ResNet-34's ${tensors.length} parameter tensors, input → output (hover a point for its name)`));

  // Legend.
  series.forEach((s, k) => {
    const ly = 14 + 18 * k;
    const g = svgEl("g", { class: `legend series-${s.key}` });
    g.append(s.mark === "diamond"
      ? svgEl("path", { d: `M${m.left + 6} ${ly - 5}L${m.left + 11} ${ly}L${m.left + 6} ${ly + 5}L${m.left + 1} ${ly}Z`, class: "mark hollow" })
      : svgEl("circle", { cx: m.left + 6, cy: ly, r: 4, class: "mark" }));
    g.append(svgEl("text", { x: m.left + 18, y: ly + 4, class: "legend-text" }, s.label));
    svg.append(g);
  });

  return { svg, caption: caption(tensors, series) };
}

function caption(tensors, series) {
  const n = tensors.length;
  const part = (key, name) => {
    const v = tensors.map((t) => t[key]);
    if (v.every((e) => e === null) && key === "control") return `${name}: not applicable at these settings`;
    if (v.some((e) => e === null)) return `${name}: ${v.filter((e) => e === null).length} tensors non-finite`;
    const zeros = v.filter((e) => e === 0).length;
    const max = Math.max(...v);
    const worst = tensors[v.indexOf(max)].name;
    if (zeros === n) return `${name}: all ${n} tensors bitwise equal`;
    return `${name}: median ${formatError(median(v))}, max ${formatError(max)} (${worst})` +
      (zeros ? `, ${zeros} of ${n} exactly 0` : "");
  };
  const parts = series.map((s) => part(s.key, s.key.toUpperCase()));
  const test = tensors.map((t) => t.test);
  const control = tensors.map((t) => t.control);
  let apart = "";
  if (!test.some((e) => e === null) && !control.some((e) => e === null)) {
    const maxTest = Math.max(...test);
    const minControl = Math.min(...control);
    if (maxTest === 0 && minControl > 0) apart = " Every tensor differs under CONTROL; none under TEST.";
    else if (maxTest > 0 && minControl > maxTest) {
      apart = ` CONTROL's smallest error is ${Math.floor(Math.log10(minControl / maxTest))} orders of magnitude above TEST's largest.`;
    }
  }
  return `${parts.join(". ")}.${apart}`;
}

/** Nice round ticks covering [lo, hi]. */
function ticks(lo, hi, count) {
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const unit = [1, 2, 5, 10].map((f) => f * mag).find((u) => u >= raw);
  const out = [];
  for (let v = Math.ceil(lo / unit) * unit; v <= hi + unit * 1e-9; v += unit) out.push(+v.toPrecision(12));
  return out;
}

/** The training loss per step so far, on an axis of `total` steps, with its running mean
 * over the last `window` steps (one batch's loss is noisy). */
export function lossChart(losses, total, window = 5) {
  const W = 960, H = 260;
  const m = { left: 64, right: 16, top: 16, bottom: 44 };
  const plotW = W - m.left - m.right, plotH = H - m.top - m.bottom;
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": "Training loss per step" });
  const lo0 = losses.length ? Math.min(...losses) : 0;
  const hi0 = losses.length ? Math.max(...losses) : 3;
  const pad = Math.max((hi0 - lo0) * 0.1, 0.05);
  const lo = Math.max(0, lo0 - pad), hi = hi0 + pad;
  const yTicks = ticks(lo, hi, 5);
  const x = (step) => m.left + (total > 1 ? (step - 1) / (total - 1) : 0.5) * plotW;
  const y = (v) => m.top + plotH * (hi - v) / (hi - lo || 1);
  for (const v of yTicks) {
    svg.append(svgEl("line", { x1: m.left, x2: W - m.right, y1: y(v), y2: y(v), class: "grid" }));
    svg.append(svgEl("text", { x: m.left - 8, y: y(v) + 4, class: "axis-text", "text-anchor": "end" }, String(v)));
  }
  const xTicks = ticks(0, total, Math.min(10, total)).filter((s) => Number.isInteger(s) && s > 1);
  for (const s of [1, ...xTicks]) {
    svg.append(svgEl("text", { x: x(s), y: H - m.bottom + 18, class: "axis-text", "text-anchor": "middle" }, String(s)));
  }
  svg.append(svgEl("line", { x1: m.left, x2: m.left, y1: m.top, y2: m.top + plotH, class: "axis" }));
  svg.append(svgEl("line", { x1: m.left, x2: W - m.right, y1: m.top + plotH, y2: m.top + plotH, class: "axis" }));
  svg.append(svgEl("text", { x: 14, y: m.top + plotH / 2, class: "axis-label", "text-anchor": "middle", transform: `rotate(-90 14 ${m.top + plotH / 2})` }, "loss"));
  svg.append(svgEl("text", { x: m.left + plotW / 2, y: H - 6, class: "axis-label", "text-anchor": "middle" },
    "SGD step (loss: label-smoothed cross-entropy of the global batch, the replicas' mean)"));
  if (!losses.length) {
    svg.append(svgEl("text", { x: m.left + plotW / 2, y: m.top + plotH / 2, class: "axis-text", "text-anchor": "middle" }, "waiting for the first step…"));
    return svg;
  }
  const g = svgEl("g", { class: "series-loss" });
  const mean = losses.map((_, i) => {
    const last = losses.slice(Math.max(0, i + 1 - window), i + 1);
    return last.reduce((a, b) => a + b, 0) / last.length;
  });
  g.append(svgEl("polyline", { points: losses.map((v, i) => `${x(i + 1)},${y(v)}`).join(" "), class: "line" }));
  g.append(svgEl("polyline", { points: mean.map((v, i) => `${x(i + 1)},${y(v)}`).join(" "), class: "mean" }));
  losses.forEach((v, i) => g.append(titled(svgEl("circle", { cx: x(i + 1), cy: y(v), r: 3, class: "mark" }), `step ${i + 1}: loss ${v.toFixed(4)}`)));
  svg.append(g);
  const legend = svgEl("g", { class: "series-loss" });
  const item = (x0, cls, text) => {
    legend.append(svgEl("line", { x1: x0, x2: x0 + 24, y1: m.top + 8, y2: m.top + 8, class: cls }));
    legend.append(svgEl("text", { x: x0 + 30, y: m.top + 12, class: "legend-text" }, text));
  };
  item(W - m.right - 360, "line", "loss of each step");
  item(W - m.right - 190, "mean", `running mean of ${window}`);
  svg.append(legend);
  return svg;
}
