// The demo page in headless Chromium: with WebGPU (SwiftShader) the kernel self-check runs on
// load and every kernel matches the f64 reference; without WebGPU the page explains what to
// do instead of going blank. Screenshots go to test-output/.

import assert from "node:assert/strict";
import { test } from "node:test";
import { loadAndSettle, openBrowser, screenshot } from "./browser.mjs";

const TIMEOUT = 300_000;

test("kernel self-check passes in headless Chromium (WebGPU on SwiftShader)", { timeout: TIMEOUT }, async (t) => {
  const browser = await openBrowser({ webgpu: true });
  try {
    const { page, result, problems, elapsedMs } = await loadAndSettle(browser.context, `${browser.url}?run=1&seed=1`);
    const shot = await screenshot(page, "web-selfcheck.png");
    t.diagnostic(`page load to result: ${elapsedMs} ms (in page: ${Math.round(result.timings?.pageToResultMs)} ms, ` +
      `self-check ${Math.round(result.timings?.selfcheckMs)} ms); adapter ${result.adapter?.vendor}/${result.adapter?.architecture}; ${shot}`);
    assert.equal(result.status, "done", `page ended in "${result.status}": ${result.error ?? result.message ?? ""}`);
    assert.equal(result.adapter.backend, "BrowserWebGpu");
    assert.ok(result.kernels.length >= 7, `only ${result.kernels.length} kernels checked`);
    for (const k of result.kernels) {
      t.diagnostic(`${k.kernel} ${k.shape}: error ${k.error} (tolerance ${k.tolerance})`);
      assert.equal(typeof k.error, "number", `${k.kernel} ${k.shape}: non-finite output`);
      assert.ok(k.pass && k.error <= k.tolerance, `${k.kernel} ${k.shape}: error ${k.error} > ${k.tolerance}`);
    }
    assert.equal(result.pass, true);
    for (const kernel of ["conv2d_forward", "conv2d_backward_input", "conv2d_backward_weight", "relu_forward", "relu_backward", "add"]) {
      assert.ok(result.kernels.some((k) => k.kernel === kernel), `${kernel} was not checked`);
    }
    assert.match(await page.textContent("#summary"), /^PASS: all \d+ kernels match/);
    assert.equal(await page.locator("#results tbody tr").count(), result.kernels.length);
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
    assert.ok(!(await page.locator("#selfcheck-section").isVisible()), "the self-check is offered without WebGPU");
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
    // An error thrown by the wasm module arrives as a readable message.
    const bad = await loadAndSettle(browser.context, `${browser.url}?log=loud`);
    assert.equal(bad.result.status, "error");
    assert.match(bad.result.error, /unknown log level `loud`/);
  } finally {
    await browser.close();
  }
});
