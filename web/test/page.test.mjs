// The demo page in headless Chromium: with WebGPU (SwiftShader) the kernel self-check runs on
// load and every kernel matches the f64 reference; a folder of images picked in the page trains
// and predicts; without WebGPU the page explains what to do instead of going blank; bad
// settings are readable errors. (The equivalence gates are
// gates.test.mjs.) Screenshots go to test-output/.

import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { loadAndSettle, NATIVE, openBrowser, screenshot } from "./browser.mjs";

const TIMEOUT = 300_000;

test("kernel self-check passes in headless Chromium (WebGPU on SwiftShader)", { timeout: TIMEOUT }, async (t) => {
  const browser = await openBrowser({ webgpu: true });
  try {
    const { page, result, problems, elapsedMs } = await loadAndSettle(browser.context, `${browser.url}?selfcheck=1&seed=1`);
    const shot = await screenshot(page, "web-selfcheck.png");
    t.diagnostic(`page load to result: ${elapsedMs} ms (in page: ${Math.round(result.timings?.pageToResultMs)} ms, ` +
      `self-check ${Math.round(result.timings?.selfcheckMs)} ms); adapter ${result.adapter?.vendor}/${result.adapter?.architecture}; ${shot}`);
    assert.equal(result.status, "done", `page ended in "${result.status}": ${result.error ?? result.message ?? ""}`);
    assert.equal(result.adapter.backend, "BrowserWebGpu");
    const bytes = Object.values(result.adapter.parameterBytes);
    assert.equal(bytes.length, 4);
    assert.ok(bytes.every((b) => result.adapter.limits.maxBufferSize >= b), "SwiftShader should hold every network's parameters");
    const { kernels, pass } = result.selfcheck;
    assert.ok(kernels.length >= 7, `only ${kernels.length} kernels checked`);
    for (const k of kernels) {
      t.diagnostic(`${k.kernel} ${k.shape}: error ${k.error} (tolerance ${k.tolerance})`);
      assert.equal(typeof k.error, "number", `${k.kernel} ${k.shape}: non-finite output`);
      assert.ok(k.pass && k.error <= k.tolerance, `${k.kernel} ${k.shape}: error ${k.error} > ${k.tolerance}`);
    }
    assert.equal(pass, true);
    for (const kernel of ["conv2d_forward", "conv2d_backward_input", "conv2d_backward_weight", "relu_forward", "relu_backward", "add"]) {
      assert.ok(kernels.some((k) => k.kernel === kernel), `${kernel} was not checked`);
    }
    assert.match(await page.textContent("#selfcheck-summary"), /^PASS: all \d+ kernels match/);
    assert.equal(await page.locator("#selfcheck tbody tr").count(), kernels.length);
    assert.deepEqual(problems, [], "the page logged errors");
  } finally {
    await browser.close();
  }
});

test("without WebGPU the page says so and what to do", { timeout: TIMEOUT }, async (t) => {
  const browser = await openBrowser({ webgpu: false });
  try {
    const { page, result, problems } = await loadAndSettle(browser.context, `${browser.url}?run=1`);
    t.diagnostic(`reason: ${result.reason}; ${await screenshot(page, "web-no-webgpu.png")}`);
    assert.equal(result.status, "no-webgpu", `page ended in "${result.status}": ${result.error ?? ""}`);
    assert.ok(["missing", "no-adapter", "insecure-context"].includes(result.reason), result.reason);
    const notice = page.locator("#notice");
    assert.ok(await notice.isVisible(), "the no-WebGPU notice is not shown");
    const text = await notice.textContent();
    assert.match(text, /No WebGPU in this browser/);
    assert.match(text, /--enable-unsafe-webgpu/);
    assert.match(text, /Chrome|Edge/);
    for (const section of ["#settings-section", "#gates-section", "#train-section", "#selfcheck-section"]) {
      assert.ok(!(await page.locator(section).isVisible()), `${section} is offered without WebGPU`);
    }
    assert.deepEqual(problems, [], "the page logged errors");
  } finally {
    await browser.close();
  }
});

test("a bad setting in the address is reported, not a blank page", { timeout: TIMEOUT }, async () => {
  const browser = await openBrowser({ webgpu: true });
  try {
    const { page, result } = await loadAndSettle(browser.context, `${browser.url}?run=1&batch=zero`);
    assert.equal(result.status, "error");
    assert.match(result.error, /\?batch=zero: expected a whole number/);
    assert.match(await page.textContent("#notice"), /\?batch=zero/);
    const arch = await loadAndSettle(browser.context, `${browser.url}?arch=resnet9`);
    assert.equal(arch.result.status, "error");
    assert.match(arch.result.error, /\?arch=resnet9: expected one of resnet34, resnet18, resnet50, resnet101/);
    // Errors thrown by the wasm module arrive as readable messages.
    const bad = await loadAndSettle(browser.context, `${browser.url}?log=loud`);
    assert.equal(bad.result.status, "error");
    assert.match(bad.result.error, /unknown log level `loud`/);
    const one = await loadAndSettle(browser.context, `${browser.url}?replicas=1&run=1`);
    assert.equal(one.result.status, "error");
    assert.match(one.result.error, /R ≥ 2 replicas/);
    assert.match(await one.page.textContent("#settings-note"), /needs R ≥ 2/);
  } finally {
    await browser.close();
  }
});

test("a training that diverges stops with an error naming its step", { timeout: TIMEOUT }, async (t) => {
  const browser = await openBrowser({ webgpu: true });
  try {
    // The library's divergence guard, the command line's: at this rate the loss of step 2 is
    // millions of times the first step's.
    const query = "?arch=resnet18&replicas=2&batch=2&size=32&train_steps=6&lr=1000&train=1";
    const { page, result, problems } = await loadAndSettle(browser.context, `${browser.url}${query}`);
    t.diagnostic(`${result.error}; ${await screenshot(page, "web-diverged.png")}`);
    assert.equal(result.status, "error", `page ended in "${result.status}"`);
    assert.match(result.error, /the run diverged at step \d: its loss (rose to \S+, over 100 times the first step's|became NaN|became inf)/);
    assert.match(result.error, /lower the learning rate/);
    assert.equal(result.train, null, "a diverged run reported a result");
    assert.match(await page.textContent("#notice"), /diverged at step/);
    assert.deepEqual(problems.filter((p) => !/diverged/.test(p)), [], "the page logged other errors");
  } finally {
    await browser.close();
  }
});

test("a folder of the visitor's images trains data-parallel and its held-out images are predicted", { timeout: TIMEOUT }, async (t) => {
  // PNGs of the synthetic dataset's patterns, written by the native example.
  const maker = join(dirname(NATIVE), "examples", "make_image_folder");
  if (!existsSync(maker)) throw new Error(`no ${maker}: run cargo build --release --example make_image_folder`);
  const dir = mkdtempSync(join(tmpdir(), "syncstep-page-"));
  const folder = join(dir, "shapes");
  execFileSync(maker, [folder, "30", "32", "3"]);
  const browser = await openBrowser({ webgpu: true });
  try {
    const page = await browser.context.newPage();
    const problems = [];
    page.on("pageerror", (e) => problems.push(`uncaught: ${e.message}`));
    await page.goto(`${browser.url}?replicas=2&batch=2&size=32&train_steps=2&seed=3`);
    await page.waitForFunction(() => window.syncstepResult?.status === "ready", null, { timeout: TIMEOUT });
    await page.setInputFiles("#images-input", folder);
    await page.click("#images-button");
    await page.waitForFunction(() => ["done", "error"].includes(window.syncstepResult?.status), null, { timeout: TIMEOUT, polling: 200 });
    const result = await page.evaluate(() => window.syncstepResult);
    t.diagnostic(`${await screenshot(page, "web-images.png")}`);
    assert.equal(result.status, "done", `page ended in "${result.status}": ${result.error ?? ""}`);
    const report = result.images;
    assert.deepEqual(report.classes, ["disc", "horizontal_stripes", "square"]);
    assert.equal(report.train_images + report.val_images, 30);
    assert.equal(report.losses.length, 2);
    assert.ok(report.losses.every((l) => Number.isFinite(l) && l > 0), `losses ${report.losses}`);
    assert.ok(report.predictions.length >= 3, `${report.predictions.length} predictions`);
    for (const p of report.predictions) {
      assert.ok(report.classes.includes(p.label), p.label);
      const total = p.top.reduce((a, g) => a + g.probability, 0);
      assert.ok(p.top.length === 3 && total > 0 && total <= 1 + 1e-9, JSON.stringify(p));
    }
    assert.equal(await page.locator("#predictions img").count(), report.predictions.length);
    await page.waitForFunction(() => [...document.querySelectorAll("#predictions img")].every((i) => i.complete && i.naturalWidth > 0));
    assert.deepEqual(problems, [], "the page logged errors");
  } finally {
    await browser.close();
    rmSync(dir, { recursive: true, force: true });
  }
});
