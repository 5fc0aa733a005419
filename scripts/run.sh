#!/usr/bin/env bash
# The main job on its embedded defaults: installs what is missing, builds, runs `syncstep train`
# and keeps the run in a folder of its own, runs/DATE-TIME/: its checkpoint, its metrics log and
# their plot (curves.svg: the loss and its running median, the held-out accuracy before and
# after, the learning rate). Extra arguments replace the default subcommand, e.g.
# `scripts/run.sh info`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup-rust.sh
source scripts/setup.sh
if [ $# -gt 0 ]; then
    exec cargo run --release --quiet -- "$@"
fi
run="runs/$(date +%Y-%m-%d-%H%M%S)"
mkdir -p "$run"
cargo run --release --quiet -- train --checkpoint "$run/checkpoint.safetensors" --log "$run/metrics.jsonl"
cargo run --release --quiet -- plot "$run/metrics.jsonl" -o "$run/curves.svg"
echo "the run's curves: $run/curves.svg (beside its checkpoint and metrics log)"
