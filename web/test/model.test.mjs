// The page keeps its model and classifies photos, in headless Chromium (WebGPU on SwiftShader),
// held to the native command on the same files: a ResNet-18 trained 20 steps on a folder of
// images is downloaded, the page reloaded and the file opened again, and two photos classified:
// the same top-5 and probabilities (within 1e-5) as `syncstep predict --checkpoint`; `eval` and
// `train --resume` take the file too, and the page continues from its step as the resume does. torchvision ResNet-18 weights (the seeded recipe's,
// tests/suite/common/recipe.rs, written by the native example recipe_weights: nothing is
// downloaded) classify the photos with the same top-5 as `syncstep predict --weights`, and as
// PyTorch's (tests/fixtures/torchvision/predict.json). A model of the synthetic dataset, which
// names no photos, downloads for `eval` and `train --resume` too. Files that are not a model, and a
// continuation on other classes, are errors on the page, and the model held stays.

import assert from "node:assert/strict";
import { execFile, execFileSync } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { promisify } from "node:util";
import { NATIVE, openBrowser, REPO, screenshot } from "./browser.mjs";

const TIMEOUT = 1_200_000;
const STEPS = 20;
const PHOTOS = ["chelsea.png", "coffee.png"].map((p) => join(REPO, "tests/fixtures/torchvision", p));
const PYTORCH = JSON.parse(readFileSync(join(REPO, "tests/fixtures/torchvision/predict.json"), "utf8"));

/** The native binary with `args`, in the suite's environment; its output. */
async function native(args) {
  const target = process.env.CARGO_TARGET_DIR || join(REPO, "target");
  const env = {
    ...process.env,
    SYNCSTEP_CONV_ALGO: process.env.SYNCSTEP_CONV_ALGO || "guess",
    SYNCSTEP_AUTOTUNE_CACHE: process.env.SYNCSTEP_AUTOTUNE_CACHE || join(target, "tmp", "autotune-test.json"),
  };
  const { stdout, stderr } = await promisify(execFile)(NATIVE, args, { env, maxBuffer: 1 << 20 });
  return stdout + stderr;
}

/** `syncstep predict` on `photos` with `flags`; its JSON report. */
async function nativePredict(dir, name, flags, photos) {
  const out = join(dir, `${name}.json`);
  await native(["predict", ...flags, "--json", out, ...photos]);
  return JSON.parse(readFileSync(out, "utf8"));
}

/** A safetensors file of `tensors` ({name: shape}, f32 zeros), as bytes. */
function safetensors(tensors) {
  const header = {};
  let at = 0;
  for (const [name, shape] of Object.entries(tensors)) {
    const bytes = 4 * shape.reduce((a, b) => a * b, 1);
    header[name] = { dtype: "F32", shape, data_offsets: [at, at + bytes] };
    at += bytes;
  }
  const text = Buffer.from(JSON.stringify(header));
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(text.length));
  return Buffer.concat([len, text, Buffer.alloc(at)]);
}

/** Waits until the page's run settles; its window.syncstepResult. */
async function settled(page) {
  await page.waitForFunction(() => ["done", "error"].includes(window.syncstepResult?.status), null, { timeout: TIMEOUT, polling: 200 });
  return page.evaluate(() => window.syncstepResult);
}

/** Opens `path` in the page's model input; the result once settled. */
async function openModel(page, path) {
  await page.setInputFiles("#model-input", path);
  return settled(page);
}

/** Classifies `photos` in the page; its report. */
async function classify(page, photos) {
  await page.setInputFiles("#photos-input", photos);
  const result = await settled(page);
  assert.equal(result.status, "done", `classifying: ${result.error}`);
  return result.classify;
}

/** The page's top-5 against the native command's: the same classes, probabilities within `tolerance`. */
function sameTop5(t, page, cli, tolerance) {
  assert.equal(page.images.length, cli.images.length);
  assert.equal(page.image_size, cli.image_size);
  assert.equal(page.preprocess, cli.preprocess);
  let worst = 0;
  page.images.forEach((image, i) => {
    const want = cli.images[i].top;
    assert.equal(image.top.length, 5);
    image.top.forEach((g, rank) => {
      assert.equal(g.index, want[rank].index, `${image.image}: class ranked ${rank}`);
      assert.equal(g.class, want[rank].class);
      worst = Math.max(worst, Math.abs(g.probability - want[rank].probability));
    });
    t.diagnostic(`${image.image}: ${image.top.map((g) => `${g.class} ${g.probability.toPrecision(6)}`).join(", ")}`);
  });
  t.diagnostic(`largest top-5 probability difference from the native command: ${worst.toExponential(2)}`);
  assert.ok(worst <= tolerance, `probabilities differ by ${worst}, past ${tolerance}`);
}

test("a model trained in the page downloads, opens again, classifies as syncstep predict does, and continues", { timeout: TIMEOUT }, async (t) => {
  const maker = join(dirname(NATIVE), "examples", "make_image_folder");
  if (!existsSync(maker)) throw new Error(`no ${maker}: run cargo build --release --example make_image_folder`);
  const dir = mkdtempSync(join(tmpdir(), "syncstep-model-"));
  // Six classes, so that a top-5 leaves one out; three for a continuation on other classes.
  const folder = join(dir, "shapes");
  execFileSync(maker, [folder, "60", "32", "6"]);
  // At lr 0.001 the 20 steps leave probabilities spread over the classes (at 0.01 one class
  // takes all of them), so that the page and the native command are compared on every one.
  const three = join(dir, "three");
  execFileSync(maker, [three, "12", "32", "3"]);
  const browser = await openBrowser({ webgpu: true });
  try {
    const page = await browser.context.newPage();
    const problems = [];
    page.on("pageerror", (e) => problems.push(`uncaught: ${e.message}`));
    await page.goto(`${browser.url}?arch=resnet18&replicas=1&batch=4&size=32&train_steps=${STEPS}&seed=3&lr=0.001`);
    await page.waitForFunction(() => window.syncstepResult?.status === "ready", null, { timeout: TIMEOUT });
    assert.ok(await page.locator("#download-button").isDisabled(), "a download is offered before there is a model");
    await page.setInputFiles("#images-input", folder);
    await page.click("#images-button");
    let result = await settled(page);
    assert.equal(result.status, "done", `training: ${result.error}`);
    assert.equal(result.images.losses.length, STEPS);
    assert.equal(result.model.step, STEPS);
    assert.equal(result.model.classes, 6);
    // Two held-out images of two classes: what the model has learnt something about.
    const held = result.images.predictions;
    const second = held.find((p) => p.label !== held[0].label);
    const photos = [held[0], second].map((p) => join(dir, p.path));

    const [download] = await Promise.all([page.waitForEvent("download"), page.click("#download-button")]);
    const checkpoint = join(dir, download.suggestedFilename());
    await download.saveAs(checkpoint);
    assert.equal(download.suggestedFilename(), `resnet18-step${STEPS}.safetensors`);
    // The command line takes it: eval on its folder, and a resume there (the folder's
    // fingerprint is the page's), one step on.
    t.diagnostic((await native(["eval", "--checkpoint", checkpoint, "--data", folder])).split("\n")[0]);
    const log = join(dir, "resumed.jsonl");
    const resumed = ["train", "--resume", checkpoint, "--data", folder, "--steps", "1", "--checkpoint", join(dir, "resumed.safetensors"), "--log", log];
    t.diagnostic((await native(resumed)).trim().split("\n").at(-1));
    const nativeStep = readFileSync(log, "utf8").trim().split("\n").map((l) => JSON.parse(l)).find((r) => r.loss !== undefined);

    // A fresh page holds nothing until the file is opened.
    await page.reload();
    await page.waitForFunction(() => window.syncstepResult?.status === "ready", null, { timeout: TIMEOUT });
    result = await openModel(page, checkpoint);
    assert.equal(result.status, "done", `opening: ${result.error}`);
    assert.deepEqual([result.model.source, result.model.step, result.model.torchvision], [download.suggestedFilename(), STEPS, false]);
    const trained = await classify(page, photos);
    const predicted = await nativePredict(dir, "checkpoint", ["--checkpoint", checkpoint], photos);
    sameTop5(t, trained, predicted, 1e-5);
    t.diagnostic(await screenshot(page, "web-model.png"));

    // Bad files: an error on the page, naming what is wrong, and the model held stays.
    const bytes = readFileSync(checkpoint);
    // A block of each stage tells ResNet-18 (BasicBlocks [2, 2, 2, 2]); its classifier's width is not one.
    const resnet18Blocks = Object.fromEntries([1, 2, 3, 4].map((s) => [`layer${s}.1.conv1.weight`, [1]]));
    const bad = {
      "truncated.safetensors": [bytes.subarray(0, bytes.length >> 1), /truncated\.safetensors: not a valid safetensors file .*truncated or corrupt/],
      "photo.safetensors": [readFileSync(PHOTOS[0]), /photo\.safetensors: a PNG image, not a safetensors file/],
      "other-arch.safetensors": [safetensors({ "layer1.0.conv1.weight": [1], "layer1.4.conv1.weight": [1] }), /BasicBlocks \[5, 0, 0, 0\] per stage are none of torchvision's ResNets/],
      "other-classifier.safetensors": [safetensors({ ...resnet18Blocks, "fc.weight": [10, 256] }), /`fc\.weight` has shape \[10, 256\], expected \[K, 512\] \(resnet18\)/],
    };
    for (const [name, [content, message]] of Object.entries(bad)) {
      const path = join(dir, name);
      writeFileSync(path, content);
      const r = await openModel(page, path);
      t.diagnostic(`${name}: ${r.error}`);
      assert.equal(r.status, "error", name);
      assert.match(r.error, message);
      assert.match(r.error, /the page opens a syncstep checkpoint/);
      assert.match(await page.textContent("#notice"), message);
      assert.match(await page.textContent("#model-status"), /The model held is still resnet18-step20\.safetensors/);
      assert.equal(r.model.source, download.suggestedFilename(), `${name} replaced the model held`);
    }

    // The model continues from its step on the data it was trained on, and only on that.
    await page.fill("input[name=trainSteps]", "1");
    await page.check("#resume-input");
    await page.setInputFiles("#images-input", three);
    await page.click("#images-button");
    result = await settled(page);
    assert.equal(result.status, "error");
    assert.match(result.error, /the folder's classes \(.*\) are not the ones the model was trained on/);
    await page.check("#resume-input");
    await page.setInputFiles("#images-input", folder);
    await page.click("#images-button");
    result = await settled(page);
    assert.equal(result.status, "done", `continuing: ${result.error}`);
    assert.equal(result.images.from, STEPS);
    assert.equal(result.model.step, STEPS + 1);
    // The same step as the command line's resume, on another GPU compiler.
    const [loss] = result.images.losses;
    t.diagnostic(`step ${STEPS + 1}: loss ${loss} in the page, ${nativeStep.loss} natively (step ${nativeStep.step})`);
    assert.ok(Math.abs(loss - nativeStep.loss) <= 1e-4 * Math.abs(nativeStep.loss), `loss ${loss} against ${nativeStep.loss}`);
    assert.deepEqual(problems, [], "the page threw");
  } finally {
    await browser.close();
    rmSync(dir, { recursive: true, force: true });
  }
});

test("a model trained on the synthetic dataset downloads, eval and train --resume take it, and the page continues it alike", { timeout: TIMEOUT }, async (t) => {
  const dir = mkdtempSync(join(tmpdir(), "syncstep-synthetic-"));
  const browser = await openBrowser({ webgpu: true });
  try {
    const page = await browser.context.newPage();
    await page.goto(`${browser.url}?arch=resnet18&replicas=2&batch=2&size=32&train_steps=2&seed=5`);
    await page.waitForFunction(() => window.syncstepResult?.status === "ready", null, { timeout: TIMEOUT });
    await page.click("#train-button");
    let result = await settled(page);
    assert.equal(result.status, "done", `training: ${result.error}`);
    assert.deepEqual([result.model.step, result.model.images, result.model.classNames], [2, false, null]);
    assert.ok(await page.locator("#photos-input").isDisabled(), "a model of the synthetic dataset is offered photos");
    const [download] = await Promise.all([page.waitForEvent("download"), page.click("#download-button")]);
    const checkpoint = join(dir, download.suggestedFilename());
    await download.saveAs(checkpoint);
    t.diagnostic((await native(["eval", "--checkpoint", checkpoint, "--examples", "8"])).trim().split("\n")[0]);
    const log = join(dir, "resumed.jsonl");
    await native(["train", "--resume", checkpoint, "--steps", "1", "--checkpoint", join(dir, "resumed.safetensors"), "--log", log]);
    const nativeStep = readFileSync(log, "utf8").trim().split("\n").map((l) => JSON.parse(l)).find((r) => r.loss !== undefined);
    // The page continues the model it holds, on one replica: the same step.
    await page.selectOption("select[name=replicas]", "1");
    await page.fill("input[name=trainSteps]", "1");
    await page.check("#resume-input");
    await page.click("#train-button");
    result = await settled(page);
    assert.equal(result.status, "done", `continuing: ${result.error}`);
    assert.deepEqual([result.train.from, result.model.step], [2, 3]);
    const [loss] = result.train.losses;
    t.diagnostic(`step 3: loss ${loss} in the page, ${nativeStep.loss} natively (step ${nativeStep.step})`);
    assert.ok(Math.abs(loss - nativeStep.loss) <= 1e-4 * Math.abs(nativeStep.loss), `loss ${loss} against ${nativeStep.loss}`);
  } finally {
    await browser.close();
    rmSync(dir, { recursive: true, force: true });
  }
});

test("torchvision ResNet-18 weights classify photos in the page as syncstep predict --weights and PyTorch do", { timeout: TIMEOUT }, async (t) => {
  const maker = join(dirname(NATIVE), "examples", "recipe_weights");
  if (!existsSync(maker)) throw new Error(`no ${maker}: run cargo build --release --example recipe_weights`);
  const dir = mkdtempSync(join(tmpdir(), "syncstep-weights-"));
  const weights = join(dir, "resnet18.safetensors");
  const made = execFileSync(maker, [weights, "resnet18", "1000"], { encoding: "utf8" });
  const pytorch = PYTORCH.networks.find((n) => n.arch === "resnet18");
  assert.match(made, new RegExp(`SHA-256 ${pytorch.weights_sha256}`), "the recipe's weights are not the fixtures'");
  const browser = await openBrowser({ webgpu: true });
  try {
    const page = await browser.context.newPage();
    await page.goto(browser.url);
    await page.waitForFunction(() => window.syncstepResult?.status === "ready", null, { timeout: TIMEOUT });
    const result = await openModel(page, weights);
    assert.equal(result.status, "done", `opening: ${result.error}`);
    assert.deepEqual([result.model.arch, result.model.classes, result.model.torchvision], ["resnet18", 1000, true]);
    assert.equal(result.model.classNames[0], "tench");
    assert.ok(await page.locator("#download-button").isDisabled(), "torchvision weights are offered as a checkpoint");
    const got = await classify(page, PHOTOS);
    const predicted = await nativePredict(dir, "weights", ["--weights", weights], PHOTOS);
    sameTop5(t, got, predicted, 1e-5);
    got.images.forEach((image, i) => {
      const want = pytorch.predictions[i];
      assert.deepEqual(image.top.map((g) => g.index), want.top.map((g) => g.index), `${want.photo}: PyTorch's top-5`);
      image.top.forEach((g, rank) => assert.ok(Math.abs(g.probability - want.top[rank].probability) <= 1e-4, `${want.photo}: ${g.class}`));
    });
    assert.equal(await page.locator("#classified figure").count(), 2);
    assert.match(await page.textContent("#classified"), new RegExp(got.images[0].top[0].class));
    t.diagnostic(await screenshot(page, "web-weights.png"));
  } finally {
    await browser.close();
    rmSync(dir, { recursive: true, force: true });
  }
});
