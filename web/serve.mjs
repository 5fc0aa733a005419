// A tiny static server for the demo page: serves web/ (this folder) on 127.0.0.1 with the
// content types a module page needs (.wasm as application/wasm, .js/.mjs as text/javascript)
// and no caching, so a rebuilt wasm is picked up on reload.
//
//   node web/serve.mjs [--port N]      (or PORT=N; 0 picks a free port; default 8000)
//
// The tests import startServer() to run it on a free port of their own.

import { createServer } from "node:http";
import { existsSync } from "node:fs";
import { readFile, stat } from "node:fs/promises";
import { extname, join, normalize, resolve, sep } from "node:path";
import { fileURLToPath } from "node:url";

const HERE = fileURLToPath(new URL(".", import.meta.url));

const TYPES = {
  ".html": "text/html; charset=utf-8",
  ".js": "text/javascript; charset=utf-8",
  ".mjs": "text/javascript; charset=utf-8",
  ".css": "text/css; charset=utf-8",
  ".json": "application/json",
  ".wasm": "application/wasm",
  ".png": "image/png",
  ".svg": "image/svg+xml",
  ".ts": "text/plain; charset=utf-8",
  ".txt": "text/plain; charset=utf-8",
};

// Tooling that sits in web/ but is not part of the site.
const HIDDEN = new Set(["node_modules", "test", "serve.mjs", "package.json", "package-lock.json"]);

/** Serves `root` on host:port; resolves to { server, url } once listening. */
export function startServer({ root = HERE, host = "127.0.0.1", port = 0, log = false } = {}) {
  const base = resolve(root);
  const server = createServer(async (req, res) => {
    const send = (code, body, type = "text/plain; charset=utf-8") => {
      res.writeHead(code, { "Content-Type": type, "Cache-Control": "no-store" });
      res.end(body);
    };
    try {
      if (req.method !== "GET" && req.method !== "HEAD") return send(405, "method not allowed\n");
      let path = decodeURIComponent(new URL(req.url, "http://x").pathname);
      if (path.endsWith("/")) path += "index.html";
      const rel = normalize(path).replace(/^([/\\])+/, "");
      const top = rel.split(/[/\\]/)[0];
      const file = join(base, rel);
      if (!(file === base || file.startsWith(base + sep)) || HIDDEN.has(top) || top.startsWith(".")) {
        return send(404, "not found\n");
      }
      const info = await stat(file).catch(() => null);
      if (!info || !info.isFile()) {
        const hint = rel.startsWith("pkg/") ? " (build the wasm first: scripts/web-build.sh)" : "";
        return send(404, `not found: /${rel}${hint}\n`);
      }
      const body = await readFile(file);
      res.writeHead(200, {
        "Content-Type": TYPES[extname(file).toLowerCase()] ?? "application/octet-stream",
        "Content-Length": body.length,
        "Cache-Control": "no-store",
      });
      res.end(req.method === "HEAD" ? undefined : body);
      if (log) console.log(`${req.method} /${rel} 200`);
    } catch (e) {
      send(400, `bad request: ${e.message}\n`);
    }
  });
  return new Promise((ok, fail) => {
    server.once("error", fail);
    server.listen(port, host, () => {
      const { port: bound } = server.address();
      ok({ server, url: `http://${host}:${bound}/` });
    });
  });
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  const i = process.argv.indexOf("--port");
  const port = Number(i > 0 ? process.argv[i + 1] : process.env.PORT ?? 8000);
  if (!Number.isInteger(port) || port < 0 || port > 65535) {
    console.error(`serve: bad port ${i > 0 ? process.argv[i + 1] : process.env.PORT}`);
    process.exit(2);
  }
  startServer({ port, log: !!process.env.VERBOSE })
    .then(({ url }) => {
      console.log(`syncstep demo: ${url}`);
      console.log(`  the equivalence check on load: ${url}?replicas=2&batch=4&size=32&seed=0&run=1`);
      console.log(`  data-parallel training on load: ${url}?replicas=2&batch=4&train=1`);
      console.log(existsSync(join(HERE, "golden.json"))
        ? "  web/golden.json is there: the check includes PORTABLE (at the settings it was made for)"
        : "  no web/golden.json: PORTABLE is left out (scripts/web.sh --golden writes one)");
      console.log("  (Ctrl-C stops the server)");
    })
    .catch((e) => {
      console.error(`serve: ${e.code === "EADDRINUSE" ? `port ${port} is in use; pass --port N or PORT=N (0 picks a free one)` : e.message}`);
      process.exit(1);
    });
}
