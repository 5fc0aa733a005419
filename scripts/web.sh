#!/usr/bin/env bash
# Serves the demo page locally: builds the wasm if needed, then serves web/ on 127.0.0.1 and
# prints the URL. Open it in a browser with WebGPU (see README, "Web demo").
#   scripts/web.sh [--port N]     (default 8000; 0 picks a free port)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/web-build.sh
exec node web/serve.mjs "$@"
