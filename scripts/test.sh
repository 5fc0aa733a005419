#!/usr/bin/env bash
# The whole test suite: installs what is missing, then every test in release mode (debug wgpu
# and f64 references are too slow). GPU tests run on the first adapter (lavapipe on a CPU
# machine); with CI set, a test that finds no adapter fails instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cargo test --release --all-targets "$@"
