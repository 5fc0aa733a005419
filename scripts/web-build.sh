#!/usr/bin/env bash
# Builds the browser face: the syncstep-web crate for wasm32 (release), then wasm-bindgen's JS
# glue into web/pkg (generated, git-ignored), named syncstep.js and syncstep_bg.wasm. Installs the toolchain first if it is missing.
# Incremental: seconds when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-web.sh
cargo build --release --target wasm32-unknown-unknown -p syncstep-web --lib --quiet
wasm-bindgen --target web --out-dir web/pkg --out-name syncstep \
    "${CARGO_TARGET_DIR:-target}/wasm32-unknown-unknown/release/syncstep_web.wasm"
raw=$(wc -c < web/pkg/syncstep_bg.wasm)
gz=$(gzip -9c web/pkg/syncstep_bg.wasm | wc -c)
echo "web-build: web/pkg/syncstep_bg.wasm $((raw / 1024)) KiB ($((gz / 1024)) KiB gzipped)"
