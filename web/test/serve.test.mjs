// The static server: content types a module page needs, and nothing outside the site.

import assert from "node:assert/strict";
import { test } from "node:test";
import { startServer } from "../serve.mjs";

test("serves the page with the right content types and nothing outside web/", async () => {
  const { server, url } = await startServer();
  try {
    const get = (path) => fetch(new URL(path, url));
    const type = async (path) => {
      const r = await get(path);
      assert.equal(r.status, 200, `${path}: HTTP ${r.status}`);
      return r.headers.get("content-type");
    };
    assert.match(await type("/"), /^text\/html/);
    assert.match(await type("/main.js"), /^text\/javascript/);
    assert.match(await type("/style.css"), /^text\/css/);
    assert.match(await type("/pkg/syncstep.js"), /^text\/javascript/);
    assert.equal(await type("/pkg/syncstep_bg.wasm"), "application/wasm");
    for (const hidden of ["/../Cargo.toml", "/%2e%2e/Cargo.toml", "/node_modules/playwright-core/package.json", "/serve.mjs", "/test/page.test.mjs", "/nope.html"]) {
      assert.equal((await get(hidden)).status, 404, hidden);
    }
    assert.match(await (await get("/pkg/missing.wasm")).text(), /scripts\/web-build\.sh/);
  } finally {
    server.close();
  }
});
