#!/usr/bin/env bash
# The whole test suite: installs what is missing, then every test in release mode (debug wgpu
# and f64 references are too slow). GPU tests run on the first adapter (lavapipe on a CPU
# machine); with CI set, a test that finds no adapter fails instead of skipping.
# Then the browser face: the wasm build, and the demo page in headless Chromium (WebGPU on
# SwiftShader) under `node --test`; its PORTABLE test runs the native release binary to write
# web/golden.json first. Arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
# Autotune choices of the test binaries go to the build folder, never the user's cache; the
# binaries share them, so each shape is timed once per run.
export SYNCSTEP_AUTOTUNE_CACHE="${SYNCSTEP_AUTOTUNE_CACHE:-$PWD/target/autotune-test.json}"
cargo test --release --all-targets "$@"
# lavapipe has subgroups, so the run above tested the kernels that broadcast; the ones that
# load (browsers, devices without subgroups) once more here.
SYNCSTEP_SUBGROUPS=off cargo test --release --test conv2d --test matmul "$@"

cargo build --release --bin syncstep --quiet
bash scripts/setup-web.sh --test
bash scripts/web-build.sh
(cd web && node --test --test-reporter=spec test/*.test.mjs)
