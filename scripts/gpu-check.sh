#!/usr/bin/env bash
# Everything the repository measures on a GPU, in one go, most needed first, within a deadline,
# for a machine that has a GPU but no Rust: the adapter, the gates at 32² and 224² (the f64
# reference at 32², and PORTABLE against golden files written on another adapter, where given),
# the convolutions' time per op beside what the GPU model predicted for them, the GEMM probe at
# 4096³, the step beside PyTorch CUDA (TF32 off and on) at the batches people train with and at
# small ones, Winograd on against off, the data-parallel exchange of two devices on the one GPU.
# docs/performance.md ("On a machine with a GPU, in one go") says how to bring the binary and
# what to do without a Vulkan loader.
#
#   scripts/gpu-check.sh [OUT]       (default OUT: gpu-check; the log is OUT/gpu-check.log)
#
# SYNCSTEP names the binary (default target/release/syncstep); GOLDEN a folder holding
# golden-32.json and golden-224.json, written elsewhere by
#   syncstep check --replicas 2 --batch 8 --image-size 32 --steps 0 --golden golden-32.json
#   syncstep check --replicas 2 --batch 4 --image-size 224 --steps 0 --golden golden-224.json
# DEADLINE (seconds, default 540) bounds the whole run: each part has a time limit, and gets no
# more than what is left; a part with less than 20 s left is skipped. The exit status is the
# number of parts that failed or were skipped.
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
bin=${SYNCSTEP:-target/release/syncstep}
golden=${GOLDEN:-}
deadline=${DEADLINE:-540}
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1
failed=0

# part LIMIT_S NAME COMMAND…: runs COMMAND under a time limit (at most what the deadline leaves),
# saying how long it took.
part() {
    local limit=$1 name=$2 start=$SECONDS
    shift 2
    local left=$((deadline - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "=== $name: skipped, $left s left of the deadline"
        failed=$((failed + 1))
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
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
# What the GPU model predicts (recorded, not run), then what the GPU takes, per op and layer.
for shape in "224 32" "32 256" "224 8"; do
    set -- $shape
    part 40 "shapes-$1-$2" "$bin" bench --shapes-only --plan-for gpu --image-size "$1" \
        --batch "$2" --json "$out/shapes-$1-$2.json"
done
part 90 profile-224-32 "$bin" bench --batch 32 --image-size 224 --steps 2 --profile \
    --json "$out/profile-224-32.json"
part 20 predicted-224-32 python3 scripts/predicted_vs_measured.py "$out/shapes-224-32.json" \
    "$out/profile-224-32.json"
part 60 profile-32-256 "$bin" bench --batch 256 --image-size 32 --steps 2 --profile \
    --no-roofline --json "$out/profile-32-256.json"
part 20 predicted-32-256 python3 scripts/predicted_vs_measured.py "$out/shapes-32-256.json" \
    "$out/profile-32-256.json"
part 100 vs-224-32 "${vs[@]}" --image-size 224 --batch 32 --rounds 1 --steps 5
part 100 vs-32-256 "${vs[@]}" --image-size 32 --batch 256 --rounds 1 --steps 5
part 100 vs-224-8 "${vs[@]}" --image-size 224 --batch 8 --rounds 2 --steps 5
# At 224² the f64 reference takes minutes of one CPU core: PORTABLE ties the step to another
# adapter's instead, which that adapter's own check --tie held to the reference.
part 120 check-224 "$bin" check --replicas 2 --batch 4 --image-size 224 --steps 0 \
    $(against 224) --json "$out/check-224.json"
part 90 check-32-drift "$bin" check --replicas 3 --batch 16 --image-size 32 --steps 5
part 60 winograd-off "$bin" bench --batch 8 --image-size 224 --steps 5 --no-roofline
part 60 winograd-on env SYNCSTEP_WINOGRAD=on "$bin" bench --batch 8 --image-size 224 --steps 5 \
    --no-roofline
part 90 vs-32-8 "${vs[@]}" --image-size 32 --batch 8 --rounds 2 --steps 10
part 90 exchange-224 "$bin" bench --replicas 2 --batch 16 --image-size 224 --steps 5 \
    --no-roofline --json "$out/exchange-224.json"
part 120 check-224-drift "$bin" check --replicas 3 --batch 8 --image-size 224 --steps 2
echo "=== $failed part(s) failed or skipped, $SECONDS s"
exit $failed
