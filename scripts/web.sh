#!/usr/bin/env bash
# Serves the demo page locally: builds the wasm if needed, then serves web/ on 127.0.0.1 and
# prints the URL. Open it in a browser with WebGPU (see README, "Web demo").
#   scripts/web.sh [--golden] [--port N]     (default port 8000; 0 picks a free port)
# --golden first runs the native check at the page's default settings (R=2, N=4: a global batch
# of 8, 32×32, seed 0) and writes web/golden.json, so the page's check includes PORTABLE: this
# browser against this machine's native build.
set -euo pipefail
cd "$(dirname "$0")/.."
serve_args=()
for a in "$@"; do
    if [ "$a" = --golden ]; then
        source scripts/setup.sh
        cargo run --release --quiet -- check --replicas 2 --batch 8 --image-size 32 --seed 0 --steps 0 --golden web/golden.json
    else
        serve_args+=("$a")
    fi
done
bash scripts/web-build.sh
exec node web/serve.mjs "${serve_args[@]}"
