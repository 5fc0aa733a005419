#!/usr/bin/env bash
# The main job on its embedded defaults: installs what is missing, builds, runs `syncstep`.
# Extra arguments replace the default subcommand, e.g. `scripts/run.sh info`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup-rust.sh
source scripts/setup.sh
if [ $# -eq 0 ]; then set -- train; fi
exec cargo run --release --quiet -- "$@"
