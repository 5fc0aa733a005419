// The demo page: loads the wasm build (web/pkg, made by scripts/web-build.sh), checks that the
// browser has WebGPU, shows the adapter, and runs the kernel self-check.
//
// Everything the page finds is also in window.syncstepResult, for tests and for anyone at the
// console: { status, ... } where status is "loading" | "ready" | "running" | "done" | "error" |
// "no-webgpu". "done" carries the figures (pass, kernels[], adapter, timings).

import init, * as syncstep from "./pkg/syncstep.js";

const $ = (id) => document.getElementById(id);

const result = { status: "loading", settings: null };
window.syncstepResult = result;

/** Settings from the address: ?run=1&seed=1&replicas=2&batch=8&size=32&log=warn. */
function parseSettings(search) {
  const q = new URLSearchParams(search);
  const int = (name, fallback, min, max) => {
    const raw = q.get(name);
    if (raw === null || raw.trim() === "") return fallback;
    const v = Number(raw);
    if (!Number.isInteger(v) || v < min || v > max) {
      throw new Error(`?${name}=${raw}: expected a whole number from ${min} to ${max}`);
    }
    return v;
  };
  const flag = (name) => {
    const raw = q.get(name);
    return raw !== null && !["0", "false", "no", "off"].includes(raw.trim().toLowerCase());
  };
  return {
    run: flag("run"),
    seed: int("seed", 1, 0, 2 ** 32 - 1),
    // For the equivalence gates: R replicas × batch N per replica at size×size.
    replicas: int("replicas", 2, 1, 16),
    batch: int("batch", 8, 1, 1024),
    size: int("size", 32, 16, 512),
    log: q.get("log") || "warn",
  };
}

function el(tag, props = {}, ...children) {
  const e = Object.assign(document.createElement(tag), props);
  e.append(...children);
  return e;
}

function fmtError(e) {
  if (e === null || e === undefined) return "NaN/∞";
  return e === 0 ? "0" : e.toExponential(2);
}

function fmtMs(ms) {
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${Math.round(ms)} ms`;
}

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
  $("run-status").textContent = "";
  $("progress").hidden = true;
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
  $("selfcheck-section").hidden = true;
  Object.assign(result, { reason: probe.reason, message: why, status: "no-webgpu" });
}

function showAdapter(info) {
  const mib = (b) => `${(b / 2 ** 20).toFixed(0)} MiB`;
  const l = info.limits;
  const named = [info.vendor, info.architecture, info.device].filter(Boolean).join(" ");
  const fallback = {
    true: "yes: a software implementation on the CPU (correct, but slow)",
    false: "no: a hardware GPU",
    null: "unknown (the browser does not say)",
  }[String(info.isFallbackAdapter)];
  const rows = [
    ["Adapter", info.description || info.name || named || "(the browser does not say)"],
    ["Vendor · architecture · device", [info.vendor, info.architecture, info.device].map((s) => s || "—").join(" · ")],
    ["Backend", info.backend === "BrowserWebGpu" ? "WebGPU (the browser's, through wgpu)" : info.backend],
    ["Software (fallback) adapter", fallback],
    ["Max storage binding", mib(l.maxStorageBufferBindingSize)],
    ["Max buffer", mib(l.maxBufferSize)],
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
}

async function runSelfCheck(settings) {
  const button = $("run-button");
  const progress = $("progress");
  const status = $("run-status");
  const tbody = $("results").tBodies[0];
  button.disabled = true;
  $("summary").hidden = true;
  tbody.replaceChildren();
  $("results").hidden = false;
  progress.hidden = false;
  progress.value = 0;
  Object.assign(result, { status: "running", error: undefined });

  const rows = [];
  const started = [];
  const times = [];
  const t0 = performance.now();
  try {
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
        cells[2].textContent = fmtError(r.error);
        cells[3].textContent = fmtError(r.tolerance);
        cells[4].textContent = fmtMs(times[ev.index]);
        cells[5].replaceChildren(badge(r.pass));
      }
    });
    const selfcheckMs = performance.now() - t0;
    const failed = report.kernels.filter((k) => !k.pass);
    const summary = $("summary");
    summary.className = `summary ${report.pass ? "pass" : "fail"}`;
    summary.textContent = report.pass
      ? `PASS: all ${report.kernels.length} kernels match the f64 reference (${fmtMs(selfcheckMs)}).`
      : `FAIL: ${failed.length} of ${report.kernels.length} kernels differ from the f64 reference: ${failed.map((k) => k.kernel).join(", ")}.`;
    summary.hidden = false;
    status.textContent = "";
    progress.hidden = true;
    Object.assign(result, {
      pass: report.pass,
      seed: report.seed,
      kernels: report.kernels.map((k, i) => ({ ...k, timeMs: times[i] })),
      timings: { ...result.timings, selfcheckMs, pageToResultMs: performance.now() },
      status: "done",
    });
  } catch (e) {
    fail(`The kernel self-check stopped: ${e?.message ?? e}`);
  } finally {
    button.disabled = false;
  }
}

async function main() {
  let settings;
  try {
    settings = parseSettings(location.search);
  } catch (e) {
    return fail(e.message);
  }
  result.settings = settings;
  $("settings").textContent =
    `seed ${settings.seed} · replicas ${settings.replicas} · batch ${settings.batch} per replica · ` +
    `size ${settings.size}×${settings.size}${settings.run ? " · runs on load" : ""}`;

  const t0 = performance.now();
  try {
    await init();
  } catch (e) {
    return fail(`Could not load the WebAssembly module (pkg/syncstep_bg.wasm): ${e?.message ?? e}. ` +
      "Build it with scripts/web-build.sh, or serve the page with scripts/web.sh.");
  }
  result.version = syncstep.version();
  result.timings = { wasmLoadMs: performance.now() - t0 };
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

  $("run-button").addEventListener("click", () => runSelfCheck(settings));
  $("run-button").disabled = false;
  result.status = "ready";
  if (settings.run) await runSelfCheck(settings);
  else $("run-status").textContent = "Press the button, or add ?run=1 to the address to run on load.";
}

window.addEventListener("unhandledrejection", (e) => fail(String(e.reason?.message ?? e.reason)));
main().catch((e) => fail(String(e?.message ?? e)));
