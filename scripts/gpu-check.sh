#!/usr/bin/env bash
# Everything the repository measures on a GPU, in one go, for a machine that has a GPU but no
# Rust: the adapter, the gates at 32² and 224² (the f64 reference at 32², and PORTABLE against
# golden files written on another adapter, where given), the step beside PyTorch CUDA (TF32 off
# and on) at small and large shapes, the data-parallel exchange of two devices on the one GPU,
# and a profile of the step. docs/performance.md ("On a machine with a GPU") says how to bring
# the binary and what to do without a Vulkan loader.
#
#   scripts/gpu-check.sh [OUT]       (default OUT: gpu-check; the log is OUT/gpu-check.log)
#
# SYNCSTEP names the binary (default target/release/syncstep); GOLDEN a folder holding
# golden-32.json and golden-224.json, written elsewhere by
#   syncstep check --replicas 2 --batch 8 --image-size 32 --steps 0 --golden golden-32.json
#   syncstep check --replicas 2 --batch 4 --image-size 224 --steps 0 --golden golden-224.json
# Each part has a time limit and the next one runs whatever it gave; the exit status is the
# number of parts that failed.
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
bin=${SYNCSTEP:-target/release/syncstep}
golden=${GOLDEN:-}
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1
failed=0

# part LIMIT_S NAME COMMAND…: runs COMMAND under a time limit, saying how long it took.
part() {
    local limit=$1 name=$2 start=$SECONDS
    shift 2
    echo "=== $name: $*"
    timeout --kill-after=5 "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    [ $rc -eq 0 ] || failed=$((failed + 1))
}

against() { # against SIZE: the PORTABLE gate's arguments where a golden file is given
    if [ -n "$golden" ] && [ -f "$golden/golden-$1.json" ]; then
        echo --against "$golden/golden-$1.json"
    fi
}

vs=(python3 scripts/vs_pytorch.py --syncstep "$(printf %q "$bin")") # a command line: quoted

command -v nvidia-smi >/dev/null && nvidia-smi -L
part 30 info "$bin" info
part 90 check-32 "$bin" check --replicas 2 --batch 8 --image-size 32 --steps 0 --tie \
    $(against 32) --json "$out/check-32.json"
part 90 check-32-drift "$bin" check --replicas 3 --batch 16 --image-size 32 --steps 5
part 120 vs-32-8 "${vs[@]}" --image-size 32 --batch 8 --rounds 2 --steps 10
part 150 vs-224-8 "${vs[@]}" --image-size 224 --batch 8 --rounds 2 --steps 5
# At 224² the f64 reference takes minutes of one CPU core: PORTABLE ties the step to another
# adapter's instead, which that adapter's own check --tie held to the reference.
part 150 check-224 "$bin" check --replicas 2 --batch 4 --image-size 224 --steps 0 \
    $(against 224) --json "$out/check-224.json"
part 120 check-224-drift "$bin" check --replicas 3 --batch 8 --image-size 224 --steps 2
part 90 exchange-224 "$bin" bench --replicas 2 --batch 16 --image-size 224 --steps 5 \
    --no-roofline --json "$out/exchange-224.json"
part 90 profile-224 "$bin" bench --batch 8 --image-size 224 --steps 3 --profile \
    --json "$out/profile-224.json"
part 120 vs-224-32 "${vs[@]}" --image-size 224 --batch 32 --rounds 1 --steps 5
part 120 vs-32-256 "${vs[@]}" --image-size 32 --batch 256 --rounds 1 --steps 5
part 90 timed-224 "$bin" bench --batch 8 --image-size 224 --steps 5 --plan-for timed \
    --no-roofline
echo "=== $failed part(s) failed"
exit $failed
