// Shared by the browser tests: the static server on a free 127.0.0.1 port, Debian's Chromium
// driven by playwright-core, headless, with WebGPU on SwiftShader (the flags docs/web.md lists)
// or without it, and the native binary that writes the PORTABLE golden file. Never a browser
// download of Playwright's own.

import { execFile } from "node:child_process";
import { existsSync, mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { chromium } from "playwright-core";
import { startServer } from "../serve.mjs";

export const REPO = fileURLToPath(new URL("../../", import.meta.url));
export const OUTPUT = join(REPO, "test-output");

export const CHROMIUM = process.env.SYNCSTEP_CHROMIUM || "/usr/bin/chromium";

/** The native release binary (cargo test --release builds it; scripts/test.sh runs that first). */
export const NATIVE = join(process.env.CARGO_TARGET_DIR || join(REPO, "target"), "release", "syncstep");

/**
 * Runs the native `syncstep check` at these settings (no DRIFT: the golden needs only the first
 * step) and writes its PORTABLE golden to web/golden.json, where the page looks for it.
 * Resolves to { path, ms, table }.
 */
export async function writeGolden({ arch, replicas, batch, size, seed }) {
  if (!existsSync(NATIVE)) throw new Error(`no native binary at ${NATIVE}: run cargo build --release`);
  const path = join(REPO, "web", "golden.json");
  const args = ["check", "--arch", arch, "--replicas", replicas, "--batch", replicas * batch, "--image-size", size, "--seed", seed, "--steps", 0, "--golden", path];
  const t0 = Date.now();
  // The suite's environment, as tests/common gives the Rust tests: kernels chosen without timing,
  // the autotune's choices in the build folder.
  const target = process.env.CARGO_TARGET_DIR || join(REPO, "target");
  const env = {
    ...process.env,
    SYNCSTEP_CONV_ALGO: process.env.SYNCSTEP_CONV_ALGO || "guess",
    SYNCSTEP_AUTOTUNE_CACHE: process.env.SYNCSTEP_AUTOTUNE_CACHE || join(target, "tmp", "autotune-test.json"),
  };
  const { stdout } = await promisify(execFile)(NATIVE, args.map(String), { maxBuffer: 1 << 20, env });
  return { path, ms: Date.now() - t0, table: stdout };
}

const BASE_ARGS = [
  "--headless=new",
  "--no-sandbox",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
];

/** Serves web/ and opens a fresh Chromium profile; `webgpu` adds --enable-unsafe-webgpu. */
export async function openBrowser({ webgpu }) {
  if (!existsSync(CHROMIUM)) {
    throw new Error(`no Chromium at ${CHROMIUM}: run scripts/setup-web.sh --test (Debian's chromium) or set SYNCSTEP_CHROMIUM`);
  }
  if (!existsSync(join(REPO, "web/pkg/syncstep_bg.wasm"))) {
    throw new Error("web/pkg is not built: run scripts/web-build.sh");
  }
  const { server, url } = await startServer();
  const profile = mkdtempSync(join(tmpdir(), "syncstep-chromium-"));
  let context;
  try {
    // Playwright takes the profile folder here rather than as --user-data-dir.
    context = await chromium.launchPersistentContext(profile, {
      executablePath: CHROMIUM,
      headless: true,
      args: [...BASE_ARGS, ...(webgpu ? ["--enable-unsafe-webgpu"] : [])],
      viewport: { width: 1100, height: 900 },
    });
  } catch (e) {
    server.close();
    rmSync(profile, { recursive: true, force: true });
    throw e;
  }
  const close = async () => {
    await context.close().catch(() => {});
    server.close();
    rmSync(profile, { recursive: true, force: true });
  };
  return { context, url, close };
}

/**
 * Opens `url` in a new page, recording console errors, uncaught exceptions and failed
 * requests, and waits until window.syncstepResult settles (done, error or no-webgpu).
 */
export async function loadAndSettle(context, url, { timeout = 240_000 } = {}) {
  const page = await context.newPage();
  const problems = [];
  page.on("console", (m) => {
    if (m.type() === "error") problems.push(`console.error: ${m.text()}`);
  });
  page.on("pageerror", (e) => problems.push(`uncaught: ${e.message}`));
  page.on("requestfailed", (r) => problems.push(`request failed: ${r.url()} ${r.failure()?.errorText ?? ""}`));
  page.on("response", (r) => {
    if (r.status() >= 400) problems.push(`HTTP ${r.status()}: ${r.url()}`);
  });
  const t0 = Date.now();
  await page.goto(url);
  await page.waitForFunction(
    () => ["done", "error", "no-webgpu"].includes(window.syncstepResult?.status),
    null,
    { timeout, polling: 100 },
  );
  const elapsedMs = Date.now() - t0;
  const result = await page.evaluate(() => window.syncstepResult);
  return { page, result, problems, elapsedMs };
}

export async function screenshot(page, name) {
  mkdirSync(OUTPUT, { recursive: true });
  const path = join(OUTPUT, name);
  await page.screenshot({ path, fullPage: true });
  return path;
}
