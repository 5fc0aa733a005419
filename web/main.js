// The demo page: loads the wasm build (web/pkg, made by scripts/web-build.sh), checks that the
// browser has WebGPU, and runs what the visitor asks for: the equivalence gates (with PORTABLE
// when a golden file is there), a short data-parallel training (on the synthetic dataset, or on
// a folder of the visitor's own images), the kernel self-check. The model trained last, or
// opened from a file, is held by the wasm module: it downloads as a checkpoint, continues
// training, and classifies photos as `syncstep predict` does.
//
// Everything the page finds is also in window.syncstepResult, for tests and for anyone at the
// console: { status, settings, adapter, gates, portable, train, images, selfcheck, model,
// classify, timings, error }
// where status is "loading" | "ready" | "running" | "done" | "error" | "no-webgpu"; "done"
// once every run the address asked for has finished.

import init, * as syncstep from "./pkg/syncstep.js";
import { formatError, lossChart, tensorChart } from "./charts.js";

const $ = (id) => document.getElementById(id);

const result = { status: "loading", settings: null, gates: null, portable: null, train: null, images: null, selfcheck: null, model: null, classify: null, timings: {} };
window.syncstepResult = result;

const FIELDS = {
  replicas: { min: 1, max: 4, fallback: 2 },
  batch: { min: 1, max: 256, fallback: 4 },
  size: { min: 32, max: 512, fallback: 32 },
  seed: { min: 0, max: 2 ** 32 - 1, fallback: 0 },
  steps: { min: 0, max: 20, fallback: 5 },
  trainSteps: { min: 1, max: 500, fallback: 20, param: "train_steps" },
  // The training's learning rate; the one field that need not be whole.
  lr: { min: 1e-6, max: 1e4, fallback: 0.01, real: true },
};

// The networks `syncstep --arch` builds, torchvision's names; the first is the default.
const ARCHS = ["resnet34", "resnet18", "resnet50", "resnet101"];

/** Settings from the address: ?arch=resnet34&replicas=2&batch=4&size=32&seed=0&steps=5&lr=0.01&run=1&train=1. */
function parseSettings(search) {
  const q = new URLSearchParams(search);
  const settings = {};
  for (const [name, f] of Object.entries(FIELDS)) {
    const key = f.param ?? name;
    const raw = q.get(key);
    if (raw === null || raw.trim() === "") {
      settings[name] = f.fallback;
      continue;
    }
    const v = Number(raw);
    if (!(f.real ? Number.isFinite(v) : Number.isInteger(v)) || v < f.min || v > f.max) {
      throw new Error(`?${key}=${raw}: expected a ${f.real ? "number" : "whole number"} from ${f.min} to ${f.max}`);
    }
    settings[name] = v;
  }
  const flag = (name) => {
    const raw = q.get(name);
    return raw !== null && !["0", "false", "no", "off"].includes(raw.trim().toLowerCase());
  };
  const arch = (q.get("arch") ?? "").trim() || ARCHS[0];
  if (!ARCHS.includes(arch)) throw new Error(`?arch=${arch}: expected one of ${ARCHS.join(", ")}`);
  return {
    ...settings,
    arch,
    run: flag("run"),
    train: flag("train"),
    selfcheck: flag("selfcheck"),
    golden: q.get("golden") || null,
    log: q.get("log") || "warn",
  };
}

/** The address that reproduces `s` (runs flags off: the link's reader adds run=1 or train=1). */
function settingsQuery(s, extra = {}) {
  const q = new URLSearchParams({ arch: s.arch });
  for (const [name, f] of Object.entries(FIELDS)) q.set(f.param ?? name, String(s[name]));
  if (s.golden) q.set("golden", s.golden);
  for (const [k, v] of Object.entries(extra)) q.set(k, v);
  return `?${q}`;
}

function el(tag, props = {}, ...children) {
  const e = Object.assign(document.createElement(tag), props);
  e.append(...children);
  return e;
}

/** A bound: "1e-5" where it is a power of ten's multiple, else as an error figure. */
function formatBound(b) {
  return b > 0 && Number(b.toExponential(0)) === b ? b.toExponential(0) : formatError(b);
}

function fmtMs(ms) {
  if (ms >= 60_000) return `${Math.floor(ms / 60_000)} min ${Math.round((ms % 60_000) / 1000)} s`;
  return ms >= 1000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms)} ms`;
}

const mib = (b) => `${(b / 2 ** 20).toFixed(0)} MiB`;

function badge(pass) {
  return el("span", { className: `badge ${pass ? "pass" : "fail"}`, textContent: pass ? "PASS" : "FAIL" });
}

function showNotice({ title, lines = [], items = [], error = false }) {
  const n = $("notice");
  n.className = error ? "notice error" : "notice";
  n.replaceChildren(el("h2", { textContent: title }), ...lines.map((t) => el("p", { textContent: t })));
  if (items.length) n.append(el("ul", {}, ...items.map((t) => el("li", { textContent: t }))));
  n.hidden = false;
}

function fail(message) {
  console.error(`syncstep: ${message}`);
  showNotice({ title: "Something went wrong", lines: [message], error: true });
  for (const part of ["gates", "train", "selfcheck"]) {
    $(`${part}-progress`).hidden = true;
    $(`${part}-status`).textContent = "";
  }
  Object.assign(result, { error: message, status: "error" });
}

/** Whether WebGPU is usable here, and if not, why. */
async function probeWebGPU() {
  if (!navigator.gpu) return { ok: false, reason: window.isSecureContext ? "missing" : "insecure-context" };
  try {
    const adapter = await navigator.gpu.requestAdapter({ powerPreference: "high-performance" });
    return adapter ? { ok: true } : { ok: false, reason: "no-adapter" };
  } catch (e) {
    return { ok: false, reason: "no-adapter", detail: String(e?.message ?? e) };
  }
}

function showNoWebGPU(probe) {
  const why = {
    "missing": "This browser does not expose WebGPU (navigator.gpu is missing), so the kernels have nowhere to run.",
    "insecure-context":
      "WebGPU is only available to secure pages: open this page over https, or from localhost / 127.0.0.1 (scripts/web.sh serves it there).",
    "no-adapter":
      "This browser has WebGPU but offered no GPU adapter: the GPU may be blocklisted, hardware acceleration turned off, or WebGPU disabled on this platform.",
  }[probe.reason];
  showNotice({
    title: "No WebGPU in this browser",
    lines: [why, ...(probe.detail ? [probe.detail] : []), "To run it:"],
    items: [
      "Chrome or Edge 113+ on Windows, macOS or ChromeOS (Android 121+): WebGPU is on by default.",
      "Chrome or Chromium on Linux: where WebGPU is not on for your GPU yet, start it with --enable-unsafe-webgpu (and --enable-features=Vulkan), or enable chrome://flags/#enable-unsafe-webgpu.",
      "Safari 26+ on macOS, iOS and iPadOS.",
      "Firefox 141+ on Windows (other platforms in later releases); elsewhere set dom.webgpu.enabled in about:config, or use Nightly.",
      "Still nothing? chrome://gpu says whether WebGPU is hardware accelerated, and why not.",
    ],
  });
  $("adapter-status").textContent = "No WebGPU adapter.";
  for (const id of ["settings-section", "gates-section", "train-section", "model-section", "selfcheck-section"]) $(id).hidden = true;
  Object.assign(result, { reason: probe.reason, message: why, status: "no-webgpu" });
}

function showAdapter(info) {
  const l = info.limits;
  const named = [info.vendor, info.architecture, info.device].filter(Boolean).join(" ");
  const fallback = {
    true: "yes: a software implementation on the CPU (correct, but slow)",
    false: "no: a hardware GPU",
    null: "unknown (the browser does not say)",
  }[String(info.isFallbackAdapter)];
  const fitting = ARCHS.filter((a) => l.maxBufferSize >= info.parameterBytes[a]);
  const sizes = ARCHS.map((a) => `${a} ${mib(info.parameterBytes[a])}`).join(", ");
  const rows = [
    ["Adapter", info.description || info.name || named || "(the browser does not say)"],
    ["Vendor · architecture · device", [info.vendor, info.architecture, info.device].map((s) => s || "—").join(" · ")],
    ["Backend", info.backend === "BrowserWebGpu" ? "WebGPU (the browser's, through wgpu)" : info.backend],
    ["Software (fallback) adapter", fallback],
    ["Max storage binding", mib(l.maxStorageBufferBindingSize)],
    ["Max buffer", `${mib(l.maxBufferSize)} (the networks' parameters: ${sizes}; ` +
      `${fitting.length === ARCHS.length ? "all fit" : `fit: ${fitting.join(", ") || "none"}`})`],
    ["Storage buffers per stage", String(l.maxStorageBuffersPerShaderStage)],
    ["Workgroup storage", `${l.maxComputeWorkgroupStorageSize / 1024} KiB`],
    ["Invocations per workgroup", String(l.maxComputeInvocationsPerWorkgroup)],
    ["Features", info.features.length ? info.features.join(", ") : "none of interest"],
  ];
  $("adapter-table").tBodies[0].replaceChildren(
    ...rows.map(([k, v]) => el("tr", {}, el("th", { scope: "row", textContent: k }), el("td", { textContent: v }))),
  );
  $("adapter-table").hidden = false;
  $("adapter-status").hidden = true;
  if (!fitting.includes(ARCHS[0])) {
    showNotice({
      title: "This GPU adapter cannot hold ResNet-34's parameters in one buffer",
      lines: [
        `Its largest buffer is ${mib(l.maxBufferSize)} (maxBufferSize), and the flat parameter buffer is ` +
          `${mib(info.parameterBytes[ARCHS[0]])}. WebGPU's default limit is 256 MiB, which is enough; this browser or GPU ` +
          `offers less. ${fitting.length ? `Choose ${fitting.join(" or ")}, or try` : "Try"} another browser or GPU; ` +
          "the kernel self-check below still runs.",
      ],
    });
  }
}

/** A running clock beside a status line: "label · 0:42". Returns a stop function. */
function ticking(statusEl, label) {
  const t0 = performance.now();
  let text = label;
  const show = () => {
    const s = Math.floor((performance.now() - t0) / 1000);
    statusEl.textContent = `${text} · ${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
  };
  show();
  const timer = setInterval(show, 1000);
  return {
    set(next) {
      text = next;
      show();
    },
    stop() {
      clearInterval(timer);
    },
  };
}

/** The PORTABLE golden: `?golden=URL`, or golden.json next to the page if it is there. */
async function loadGolden(settings) {
  const url = settings.golden ?? "golden.json";
  let response;
  try {
    response = await fetch(url, { cache: "no-store" });
  } catch (e) {
    return { status: "unreadable", url, message: `could not fetch ${url}: ${e?.message ?? e}` };
  }
  if (!response.ok) {
    return { status: response.status === 404 && !settings.golden ? "absent" : "unreadable", url, message: `${url}: HTTP ${response.status}` };
  }
  const text = await response.text();
  let g;
  try {
    g = JSON.parse(text);
  } catch (e) {
    return { status: "unreadable", url, message: `${url} is not JSON: ${e.message}` };
  }
  const made = { arch: g.arch ?? "resnet34", replicas: g.replicas, batch: g.batch_per_replica, size: g.image_size, seed: g.seed, classes: g.classes, adapter: g.adapter };
  const same = made.arch === settings.arch && made.replicas === settings.replicas && made.batch === settings.batch &&
    made.size === settings.size && made.seed === settings.seed && made.classes === 10;
  return { status: same ? "ready" : "other-settings", url, made, text };
}

function describeGolden(golden, settings) {
  const make = `syncstep check --arch ${settings.arch} --replicas ${settings.replicas} --batch ${settings.replicas * settings.batch} --image-size ${settings.size} ` +
    `--seed ${settings.seed} --golden web/golden.json`;
  switch (golden.status) {
    case "absent":
      return `PORTABLE not run: no golden.json next to this page. To compare this browser with a native run, write one with \`${make}\`.`;
    case "unreadable":
      return `PORTABLE not run: ${golden.message}.`;
    case "other-settings": {
      const m = golden.made;
      return `PORTABLE not run: ${golden.url} was made for ${m.arch}, R=${m.replicas}, N=${m.batch}, ${m.size}×${m.size}, seed ${m.seed}; ` +
        `these settings differ (open ${settingsQuery({ ...settings, arch: m.arch, replicas: m.replicas, batch: m.batch, size: m.size, seed: m.seed }, { run: "1" })}, ` +
        `or write a golden for these: \`${make}\`).`;
    }
    default:
      return `PORTABLE: this browser's single-device step, on the activation pattern of the golden made natively on ` +
        `${golden.made.adapter} (${golden.url}), held to its loss and to 64 sampled elements and the norm of every gradient tensor.`;
  }
}

/** What each gate compares, by the name the report gives it: the library's one table
 * (`check::Gate`), read once the module is loaded. */
let gateMeanings = {};

function gateRow(g) {
  const bound = g.bound_kind === "not_applicable" ? "n/a"
    : g.bound_kind === "at_most" && g.bound === 0 ? "bitwise"
    : `${g.bound_kind === "at_most" ? "≤" : "≥"} ${formatBound(g.bound)}`;
  const measured = g.bound_kind === "not_applicable" ? "–"
    : g.gate === "REPEAT" ? `${g.measured} differ` : formatError(g.measured);
  const row = el("tr", { className: g.pass ? "" : "failed" },
    el("td", { className: "gate", textContent: g.gate }),
    el("td", { className: "muted", textContent: gateMeanings[g.gate] ?? "" }),
    el("td", { className: "num", textContent: measured, title: g.note }),
    el("td", { className: "num", textContent: bound }),
    el("td", { className: "tensor", textContent: g.worst_tensor ?? "—" }),
    el("td", { className: "num", textContent: g.flips ?? "—" }),
    el("td", {}, badge(g.pass)));
  if (g.note) row.cells[2].append(el("div", { className: "note", textContent: g.note }));
  return row;
}

function showGates(gates) {
  $("gates").tBodies[0].replaceChildren(...gates.map(gateRow));
  $("gates").hidden = false;
}

/** The gates' figures as window.syncstepResult carries them. */
function gateFigures(gates) {
  return gates.map((g) => ({
    gate: g.gate, measured: g.measured, bound: g.bound, boundKind: g.bound_kind, worstTensor: g.worst_tensor,
    flips: g.flips, note: g.note, pass: g.pass,
  }));
}

async function runGates(settings) {
  // The library checks one replica too (its TEST is the plain single-device step), but on the
  // page that would be minutes of SwiftShader proving nothing about synchronisation.
  if (settings.replicas < 2) {
    throw new Error("The equivalence check needs R ≥ 2 replicas: with one there is nothing to synchronise (training runs on one device).");
  }
  const progress = $("gates-progress");
  const clock = ticking($("gates-status"), "Fetching the golden file…");
  Object.assign(result, { status: "running", error: undefined, gates: null, portable: null });
  $("gates-summary").hidden = true;
  $("chart-figure").hidden = true;
  $("gates").hidden = true;
  $("gates-adapters").hidden = true;
  progress.hidden = false;
  progress.value = 0;
  const t0 = performance.now();
  try {
    const golden = await loadGolden(settings);
    result.portable = { status: golden.status, url: golden.url, madeOn: golden.made?.adapter ?? null, message: describeGolden(golden, settings) };
    $("portable-note").textContent = result.portable.message;
    $("portable-note").hidden = false;
    clock.set(`Requesting ${settings.replicas + 1} GPU adapters (one per replica, one for the single device)…`);
    // When each phase started, in ms from the start of the check: step times on this GPU.
    const phases = [];
    const report = await syncstep.run_gates(settings.arch, settings.replicas, settings.batch, settings.size, settings.seed, settings.steps,
      golden.status === "ready" ? golden.text : undefined, (ev) => {
        phases.push({ phase: ev.phase, ms: performance.now() - t0 });
        progress.max = ev.total;
        progress.value = ev.index;
        if (ev.gates.length) {
          result.timings.firstGateMs ??= performance.now();
          showGates(ev.gates);
        }
        if (ev.index < ev.total) {
          const first = ev.index === 0 ? " (compiling shaders first)" : "";
          clock.set(`${ev.phase}${first}, phase ${ev.index + 1} of ${ev.total}`);
        }
      });
    const gatesMs = performance.now() - t0;
    clock.stop();
    progress.hidden = true;
    $("gates-status").textContent = `Done in ${fmtMs(gatesMs)}.`;
    showGates(report.gates);
    const failed = report.gates.filter((g) => !g.pass).map((g) => g.gate);
    const summary = $("gates-summary");
    summary.className = `summary ${report.pass ? "pass" : "fail"}`;
    const gate = (name) => report.gates.find((g) => g.gate === name);
    const [test, control, portable] = [gate("TEST"), gate("CONTROL"), gate("PORTABLE")];
    summary.textContent = report.pass
      ? `PASS: ${report.replicas} replicas × ${report.batch_per_replica} took the single-device step at ` +
        `${report.replicas * report.batch_per_replica}: TEST ${formatError(test.measured)}${test.measured === 0 ? " (bitwise equal)" : ""}, ` +
        (control.bound_kind === "not_applicable" ? `(CONTROL: ${control.note})`
          : `while per-replica BatchNorm (CONTROL) is off by up to ${formatError(control.measured)}`) +
        `${portable ? `; this browser matches the native golden to ${formatError(portable.measured)}` : ""}.`
      : `FAIL: ${failed.join(", ")}.`;
    summary.hidden = false;
    const devices = [...report.replica_adapters, report.single_adapter];
    $("gates-adapters").textContent = new Set(devices).size === 1
      ? `${devices.length} WebGPU devices, each on an adapter of its own: ${devices[0]}.`
      : `Replicas on ${report.replica_adapters.join("; ")}; the single device on ${report.single_adapter}.`;
    $("gates-adapters").hidden = false;
    drawTensorChart(report);
    if (portable) {
      const loss = gate("PORTABLE loss");
      Object.assign(result.portable, {
        status: "compared", pass: portable.pass && loss.pass, measured: portable.measured, bound: portable.bound,
        worstTensor: portable.worst_tensor, flips: portable.flips, lossError: loss.measured, loss: loss.note,
      });
    }
    result.gates = {
      pass: report.pass, arch: report.arch, replicas: report.replicas, batch: report.batch_per_replica, size: report.image_size,
      seed: report.seed, steps: report.steps, replicaAdapters: report.replica_adapters, singleAdapter: report.single_adapter,
      gates: gateFigures(report.gates), tensors: report.tensors, phases,
    };
    result.timings.gatesMs = gatesMs;
  } finally {
    clock.stop();
  }
}

function drawTensorChart(report) {
  const chart = tensorChart(report.tensors, { testBound: report.gates.find((g) => g.gate === "TEST").bound });
  $("chart").replaceChildren(chart.svg);
  $("chart-caption").textContent = chart.caption;
  $("chart-figure").hidden = false;
}

async function runTraining(settings) {
  const progress = $("train-progress");
  const clock = ticking($("train-status"), `Requesting ${settings.replicas} GPU adapter${settings.replicas > 1 ? "s" : ""}…`);
  Object.assign(result, { status: "running", error: undefined, train: null });
  progress.hidden = false;
  progress.max = settings.trainSteps;
  progress.value = 0;
  $("loss-figure").hidden = false;
  const losses = [];
  const stepMs = [];
  const draw = () => $("loss-chart").replaceChildren(lossChart(losses, settings.trainSteps));
  draw();
  const t0 = performance.now();
  let last = t0;
  try {
    const resume = $("resume-input").checked;
    const report = await syncstep.train_demo(settings.arch, settings.replicas, settings.batch, settings.size, settings.trainSteps, settings.seed, settings.lr, resume, (ev) => {
      const now = performance.now();
      stepMs.push(now - last);
      last = now;
      losses.push(ev.loss);
      progress.value = ev.step;
      clock.set(`Step ${ev.step} of ${ev.steps}: loss ${ev.loss.toFixed(4)}`);
      draw();
    });
    clock.stop();
    progress.hidden = true;
    // The first step also compiles every shader: leave it out of the step time.
    const steady = stepMs.length > 1 ? stepMs.slice(1) : stepMs;
    const meanStepMs = steady.reduce((a, b) => a + b, 0) / steady.length;
    const images = report.replicas * report.batch_per_replica;
    const from = report.from ? `from step ${report.from} of the model held, ` : "";
    $("train-status").textContent = `${report.losses.length} steps ${from}of ${report.replicas} × ${report.batch_per_replica} images: loss ` +
      `${losses[0].toFixed(4)} → ${losses.at(-1).toFixed(4)}; ${fmtMs(meanStepMs)} a step (${(images / (meanStepMs / 1000)).toFixed(1)} images/s` +
      `${stepMs.length > 1 ? ", the first step, which also compiles the shaders, left out" : ""}).`;
    result.train = { ...report, stepMs, meanStepMs };
    result.timings.trainMs = performance.now() - t0;
    showModel();
  } finally {
    clock.stop();
  }
}

const IMAGE_FILE = /\.(png|jpe?g|bmp|webp)$/i;

/** Trains on the images of the picked folder, then shows the held-out ones with their predictions. */
async function runImageTraining(settings) {
  const picked = [...$("images-input").files].filter((f) => IMAGE_FILE.test(f.name));
  if (!picked.length) throw new Error("Pick a folder of class folders of images first.");
  const status = $("images-status");
  const clock = ticking(status, `Reading ${picked.length} images…`);
  Object.assign(result, { status: "running", error: undefined, images: null });
  const files = await Promise.all(picked.map(async (f) => ({ path: f.webkitRelativePath || f.name, bytes: new Uint8Array(await f.arrayBuffer()) })));
  const byPath = new Map(picked.map((f) => [f.webkitRelativePath || f.name, f]));
  $("images-figure").hidden = false;
  const losses = [];
  const draw = () => $("images-chart").replaceChildren(lossChart(losses, settings.trainSteps));
  draw();
  try {
    clock.set(`Decoding ${files.length} images and requesting ${settings.replicas} GPU adapter${settings.replicas > 1 ? "s" : ""}…`);
    const resume = $("resume-input").checked;
    const report = await syncstep.train_images(files, settings.arch, settings.replicas, settings.batch, settings.size, settings.trainSteps, settings.seed, settings.lr, resume, 8, (ev) => {
      losses.push(ev.loss);
      clock.set(`Step ${ev.step} of ${ev.steps}: loss ${ev.loss.toFixed(4)}, learning rate ${ev.lr.toPrecision(3)}`);
      draw();
    });
    clock.stop();
    const from = report.from ? ` from step ${report.from} of the model held` : "";
    status.textContent = `${report.losses.length} steps${from} on ${report.train_images} images of ${report.classes.length} classes ` +
      `(${report.classes.join(", ")}): loss ${losses[0].toFixed(4)} → ${losses.at(-1).toFixed(4)}. ${report.notes.join(". ")}.`;
    const cards = report.predictions.map((p) => {
      const card = document.createElement("figure");
      const img = document.createElement("img");
      const file = byPath.get(p.path);
      if (file) img.src = URL.createObjectURL(file);
      img.alt = p.path;
      const caption = document.createElement("figcaption");
      const guesses = p.top.map((t) => `${t.class} ${(100 * t.probability).toFixed(1)}%`).join(", ");
      caption.textContent = `${p.label}: ${guesses}`;
      card.append(img, caption);
      return card;
    });
    $("predictions").replaceChildren(...cards);
    $("predictions").hidden = cards.length === 0;
    result.images = report;
    showModel();
  } finally {
    clock.stop();
  }
}

/** Shows the model the wasm module holds (or none) and what can be done with it. */
function showModel() {
  const info = syncstep.model_info();
  result.model = info;
  if (info) {
    const names = info.classNames
      ? `${info.classes} classes (${info.classNames.length > 8 ? `${info.classNames.slice(0, 8).join(", ")}, …` : info.classNames.join(", ")})`
      : `${info.classes} classes of the synthetic dataset (no photos to name)`;
    const kind = info.torchvision ? "torchvision weights" : `a checkpoint at step ${info.step}`;
    $("model-status").textContent = `${info.source}: ${info.title}, ${kind}, ${names}; input ${info.imageSize}×${info.imageSize} (${info.preprocess} preprocessing).`;
  }
  updateModelControls();
  return info;
}

/** The model's controls, enabled for what the model held (and a page not busy) allows. */
function updateModelControls() {
  const info = result.model;
  $("download-button").disabled = busy || !info?.downloadName;
  $("photos-input").disabled = busy || !info?.classNames;
  $("model-input").disabled = busy;
  const resume = $("resume-input");
  const resumable = !!info && !info.torchvision;
  resume.disabled = busy || !resumable;
  if (!resumable) resume.checked = false;
}

/** Saves the model held as a checkpoint file, the bytes the library's checkpoint writer makes. */
function downloadModel() {
  const info = result.model;
  const bytes = syncstep.model_bytes();
  const url = URL.createObjectURL(new Blob([bytes], { type: "application/octet-stream" }));
  const link = el("a", { href: url, download: info.downloadName, hidden: true });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
  $("model-status").textContent = `Saved ${info.downloadName} (${mib(bytes.length)}): syncstep predict --checkpoint ${info.downloadName} photo.jpg`;
}

/** Opens a model file: read in parts by the wasm module, checked as `syncstep predict` checks it. */
async function openModel(file) {
  Object.assign(result, { status: "running", error: undefined });
  $("model-status").textContent = `Reading ${file.name} (${mib(file.size)})…`;
  try {
    await syncstep.open_model(file);
  } catch (e) {
    const held = result.model ? ` The model held is still ${result.model.source}.` : "";
    $("model-status").textContent = `${e?.message ?? e}${held}`;
    throw e;
  }
  $("classified").replaceChildren();
  $("classified").hidden = true;
  showModel();
}

/** The top-5 classes of each photo by the model held, shown beside it. */
async function classifyPhotos(photos) {
  Object.assign(result, { status: "running", error: undefined, classify: null });
  const clock = ticking($("model-status"), `Classifying ${photos.length} photo${photos.length > 1 ? "s" : ""}…`);
  try {
    const files = await Promise.all(photos.map(async (f) => ({ path: f.name, bytes: new Uint8Array(await f.arrayBuffer()) })));
    const report = await syncstep.classify(files, 5);
    clock.stop();
    const cards = report.images.map((image, i) => {
      const img = el("img", { src: URL.createObjectURL(photos[i]), alt: image.image });
      const list = el("ol", {}, ...image.top.map((t) => el("li", { textContent: `${t.class} ${(100 * t.probability).toFixed(1)}%` })));
      return el("figure", {}, img, el("figcaption", { textContent: image.image }, list));
    });
    $("classified").replaceChildren(...cards);
    $("classified").hidden = false;
    $("model-status").textContent = `${report.images.length} photos classified by ${report.model} at ${report.image_size}×${report.image_size} (${report.preprocess} preprocessing).`;
    result.classify = report;
  } finally {
    clock.stop();
  }
}

/** Files dropped on the page: a model file is opened; photos are classified by the model held. */
async function dropped(files) {
  const models = files.filter((f) => /\.safetensors$/i.test(f.name));
  const photos = files.filter((f) => IMAGE_FILE.test(f.name));
  if (!models.length && !photos.length) throw new Error("Drop a model file (.safetensors) or photos (png, jpg, bmp, webp).");
  if (models.length > 1) throw new Error("Drop one model file at a time.");
  if (models.length) await openModel(models[0]);
  if (photos.length) await classifyPhotos(photos);
}

async function runSelfCheck(settings) {
  const progress = $("selfcheck-progress");
  const status = $("selfcheck-status");
  const tbody = $("selfcheck").tBodies[0];
  $("selfcheck-summary").hidden = true;
  tbody.replaceChildren();
  $("selfcheck").hidden = false;
  progress.hidden = false;
  progress.value = 0;
  Object.assign(result, { status: "running", error: undefined, selfcheck: null });

  const rows = [];
  const started = [];
  const times = [];
  const t0 = performance.now();
  const report = await syncstep.kernel_selfcheck(settings.seed, (ev) => {
    progress.max = ev.total;
    if (ev.phase === "started") {
      started[ev.index] = performance.now();
      const first = ev.index === 0 ? " (the first kernel also compiles shaders)" : "";
      status.textContent = `Running ${ev.kernel}, ${ev.index + 1} of ${ev.total}${first}…`;
      const row = el("tr", {},
        el("td", { textContent: ev.kernel }), el("td"), el("td", { className: "num" }),
        el("td", { className: "num" }), el("td", { className: "num" }),
        el("td", {}, el("span", { className: "badge running", textContent: "running" })));
      rows[ev.index] = row;
      tbody.append(row);
    } else {
      times[ev.index] = performance.now() - started[ev.index];
      progress.value = ev.index + 1;
      const r = ev.result;
      const cells = rows[ev.index].cells;
      cells[1].textContent = r.shape;
      cells[2].textContent = formatError(r.error);
      cells[3].textContent = formatError(r.tolerance);
      cells[4].textContent = fmtMs(times[ev.index]);
      cells[5].replaceChildren(badge(r.pass));
    }
  });
  const selfcheckMs = performance.now() - t0;
  const failed = report.kernels.filter((k) => !k.pass);
  const summary = $("selfcheck-summary");
  summary.className = `summary ${report.pass ? "pass" : "fail"}`;
  summary.textContent = report.pass
    ? `PASS: all ${report.kernels.length} kernels match the f64 reference (${fmtMs(selfcheckMs)}).`
    : `FAIL: ${failed.length} of ${report.kernels.length} kernels differ from the f64 reference: ${failed.map((k) => k.kernel).join(", ")}.`;
  summary.hidden = false;
  status.textContent = "";
  progress.hidden = true;
  result.selfcheck = { pass: report.pass, seed: report.seed, kernels: report.kernels.map((k, i) => ({ ...k, timeMs: times[i] })) };
  result.timings.selfcheckMs = selfcheckMs;
}

const BUTTONS = ["gates-button", "train-button", "images-button", "selfcheck-button"];
let busy = false;

/** Runs one job with the buttons disabled; a failure becomes the page's error notice. */
async function job(run, ...args) {
  busy = true;
  updateForm();
  updateModelControls();
  try {
    await run(...args);
    return true;
  } catch (e) {
    fail(`${e?.message ?? e}`);
    return false;
  } finally {
    busy = false;
    updateForm();
    updateModelControls();
  }
}

/** The settings in the form, checked as the address is. */
function formSettings(base) {
  const form = $("settings-form");
  const q = new URLSearchParams({ arch: form.elements.arch.value });
  for (const [name, f] of Object.entries(FIELDS)) q.set(f.param ?? name, form.elements[name].value);
  if (base.golden) q.set("golden", base.golden);
  return { ...parseSettings(`?${q}`), log: base.log };
}

let current;

function updateForm() {
  let s;
  try {
    s = formSettings(current);
  } catch (e) {
    $("settings-note").textContent = e.message.replace(/^\?/, "");
    for (const id of BUTTONS) $(id).disabled = true;
    return;
  }
  current = s;
  const one = s.replicas === 1;
  for (const id of BUTTONS) $(id).disabled = busy;
  $("gates-button").disabled = busy || one;
  $("settings-note").textContent = one
    ? "With R = 1 there is nothing to synchronise: the equivalence check needs R ≥ 2 (training runs on one device)."
    : `${s.arch}: ${s.replicas} replicas × ${s.batch} images of ${s.size}×${s.size} against one device at ${s.replicas * s.batch}; ` +
      `the check uses ${s.replicas + 1} GPU adapters, one per device.`;
  const link = settingsQuery(s, { run: "1" });
  $("permalink").href = link;
  $("permalink").textContent = link;
  history.replaceState(null, "", settingsQuery(s));
}

function fillForm(s) {
  const form = $("settings-form");
  for (const name of Object.keys(FIELDS)) form.elements[name].value = String(s[name]);
  form.elements.arch.value = s.arch;
}

async function main() {
  let settings;
  try {
    settings = parseSettings(location.search);
  } catch (e) {
    return fail(e.message);
  }
  result.settings = settings;
  current = settings;
  fillForm(settings);

  const t0 = performance.now();
  try {
    await init();
  } catch (e) {
    return fail(`Could not load the WebAssembly module (pkg/syncstep_bg.wasm): ${e?.message ?? e}. ` +
      "Build it with scripts/web-build.sh, or serve the page with scripts/web.sh.");
  }
  result.version = syncstep.version();
  gateMeanings = syncstep.gates();
  result.timings.wasmLoadMs = performance.now() - t0;
  $("version").textContent = `syncstep ${result.version}`;
  try {
    syncstep.set_log_level(settings.log);
  } catch (e) {
    return fail(e.message);
  }

  const probe = await probeWebGPU();
  if (!probe.ok) return showNoWebGPU(probe);

  try {
    result.adapter = await syncstep.adapter_info();
  } catch (e) {
    return fail(`Could not open the GPU adapter: ${e?.message ?? e}`);
  }
  showAdapter(result.adapter);

  $("settings-form").addEventListener("input", updateForm);
  $("gates-button").addEventListener("click", () => job(runGates, current).then(settle));
  $("train-button").addEventListener("click", () => job(runTraining, current).then(settle));
  $("images-button").addEventListener("click", () => job(runImageTraining, current).then(settle));
  $("selfcheck-button").addEventListener("click", () => job(runSelfCheck, current).then(settle));
  $("download-button").addEventListener("click", () => job(downloadModel).then(settle));
  const picked = (input, run) => input.addEventListener("change", () => {
    const files = [...input.files];
    input.value = "";
    if (files.length) job(run, files).then(settle);
  });
  picked($("model-input"), (files) => openModel(files[0]));
  picked($("photos-input"), classifyPhotos);
  const zone = $("drop-zone");
  for (const type of ["dragenter", "dragover"]) {
    zone.addEventListener(type, (e) => {
      e.preventDefault();
      zone.classList.add("over");
    });
  }
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("over");
    if (!busy) job(dropped, [...e.dataTransfer.files]).then(settle);
  });
  result.status = "ready";
  updateForm();
  updateModelControls();

  const queued = [[settings.run, runGates], [settings.train, runTraining], [settings.selfcheck, runSelfCheck]];
  const wanted = queued.filter(([on]) => on);
  if (!wanted.length) {
    $("gates-status").textContent = "Press the button, or add run=1 to the address to run on load.";
    return;
  }
  for (const [, run] of wanted) {
    if (!(await job(run, settings))) return;
  }
  settle(true);
}

/** After a run: "done", unless it failed. */
function settle(ok) {
  if (ok) {
    result.status = "done";
    result.timings.pageToResultMs = performance.now();
  }
}

window.addEventListener("unhandledrejection", (e) => fail(String(e.reason?.message ?? e.reason)));
main().catch((e) => fail(String(e?.message ?? e)));
