#!/usr/bin/env bash
# `syncstep check` at every shape: R replicas in 1..8 times N images in 1..8 (R·N ≥ 2: one image
# at 32×32 leaves layer4's BatchNorm one value per channel, which is refused), and for R ≥ 2 an
# uneven global batch R·N + ⌊R/2⌋ too (the first B mod R replicas take one image more); 32×32,
# DRIFT over 2 SGD steps. One line per shape; exits non-zero if any gate fails anywhere.
#   scripts/every-shape.sh [--min-replicas 1] [--max-replicas 8] [--max-batch 8] [--steps 2]
# (--min-replicas continues a sweep that was stopped: the shapes of smaller R are skipped.)
# The kernels' choice never changes a bit, so the sweep takes the clockless one the browser
# takes (SYNCSTEP_CONV_ALGO=guess) rather than timing the kernels at every new shape.
set -euo pipefail
cd "$(dirname "$0")/.."
min_r=1 max_r=8 max_n=8 steps=2
while [ $# -gt 0 ]; do
    case "$1" in
        --min-replicas) min_r=$2; shift 2 ;;
        --max-replicas) max_r=$2; shift 2 ;;
        --max-batch) max_n=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        *) echo "every-shape: unknown argument $1 (see the top of $0)" >&2; exit 2 ;;
    esac
done
source scripts/setup.sh
cargo build --release --quiet --bin syncstep
export SYNCSTEP_CONV_ALGO="${SYNCSTEP_CONV_ALGO:-guess}"

failed=0
run() { # R, global batch
    local r=$1 b=$2 out status=0
    out=$(target/release/syncstep check --replicas "$r" --batch "$b" --steps "$steps" 2>&1) || status=$?
    local line
    line=$(awk -v r="$r" -v b="$b" '
        /^[0-9]+ replica/ { sub(/ \([0-9]+×.*/, ""); shape = $0 }
        $1 == "TEST" && $2 ~ /^[0-9]/ { test = $2 } $1 == "DRIFT" { drift = $2 }
        $1 == "CONTROL" { control = ($2 == "-" ? "n/a" : $2) }
        END { printf "R=%d B=%-3d %-40s TEST %-8s DRIFT %-8s CONTROL %s", r, b, shape, test, drift, control }
    ' <<<"$out")
    if [ "$status" -eq 0 ]; then
        echo "$line  PASS"
    else
        failed=1
        echo "$line  FAIL"
        grep -E "FAIL|error" <<<"$out" | sed 's/^/    /'
    fi
}
for r in $(seq "$min_r" "$max_r"); do
    for n in $(seq 1 "$max_n"); do
        [ $((r * n)) -ge 2 ] || continue
        run "$r" $((r * n))
        [ "$r" -ge 2 ] && run "$r" $((r * n + r / 2))
    done
done
exit "$failed"
