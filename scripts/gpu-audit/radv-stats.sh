#!/usr/bin/env bash
# radv-stats.sh BIN [FAMILY] [ENV=VALUE…]: per-pipeline AMD shader statistics of the GPU plan of a
# syncstep binary, compiled by a real GPU compiler without a GPU. Run it from the project root:
#
#   bash scripts/gpu-audit/radv-stats.sh target/release/syncstep                    # RDNA3, wave64
#   bash scripts/gpu-audit/radv-stats.sh target/release/syncstep navi21             # RDNA2
#   bash scripts/gpu-audit/radv-stats.sh target/release/syncstep navi31 RADV_PERFTEST=cswave32
#   SHAPES=224:32 bash scripts/gpu-audit/radv-stats.sh target/release/syncstep navi31 RADV_DEBUG=asm
#
# Mesa 25's RADV (bookworm-backports; ACO compiler) creates a device on its null winsys when
# RADV_FORCE_FAMILY names a chip (Mesa 25 spells RDNA3 `navi31`, RDNA2 `navi21`; it refuses
# `gfx1100`, which Debian 12's Mesa 22.3 wants instead). That device has no memory heaps, no
# command submission and only a dummy sync type, so wgpu cannot open it as is; the layer
# VK_LAYER_SYNCSTEP_null_submit (null-submit/null_submit_layer.c) answers memory, buffers,
# descriptor sets, sync, command buffers and submits itself and passes device creation, shader
# modules and pipelines to RADV. The binary then runs `bench --plan-for gpu` for one warm-up and
# one timed step (nothing executes; every pipeline of the step is created) and the layer prints
# each pipeline's VK_KHR_pipeline_executable_properties statistics, the SPIR-V it came from and
# each dispatch's pipeline. radv_table.py joins those with `bench --shapes-only` (run on the same
# device) and prints one row per implicit-GEMM pipeline.
#
# Environment: SHAPES (default "224:32 32:256 224:8", image size:batch); ALL=1 (every pipeline,
# not only the implicit-GEMM family); PIPELINE=SUBSTR (only the pipelines whose module::entry
# contains SUBSTR, of any family); MARKDOWN=1 (Markdown tables); GPU_AUDIT_DIR (the work dir,
# default target/gpu-audit under the current directory). ENV=VALUE pairs go to the binary's
# environment (RADV_DEBUG=… is added to the tool's own RADV_DEBUG).
#
# Nothing is written beside this script. The work dir gets the compiled layer and its manifest,
# the RADV ICD manifest, Mesa 25 (unpacked there by the project's scripts/mesa25.sh) and the
# runs: runs/<family>[-<env values>]-<size>-b<batch>/ with bench.log (statistics, pipeline and
# dispatch lines, RADV's own output), shapes.json, wgsl/, spv/ and, with RADV_DEBUG=asm, asm/.
set -euo pipefail
say() { echo "radv-stats: $*" >&2; }
usage="usage: radv-stats.sh BIN [FAMILY] [ENV=VALUE…]"
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ $# -ge 1 ] || { say "$usage"; exit 2; }
[ -x "$1" ] && [ -f "$1" ] || { say "$1: not an executable file; $usage"; exit 2; }
BIN=$(readlink -f "$1")
FAMILY=${2:-navi31}
shift $(($# >= 2 ? 2 : 1))
for kv in "$@"; do
    [[ $kv == [A-Za-z_]*=* ]] || { say "'$kv' is not ENV=VALUE; $usage"; exit 2; }
done
SHAPES=${SHAPES:-"224:32 32:256 224:8"}

# The work dir, relative to the current directory, made absolute once (run-one.sh reads it too).
mkdir -p "${GPU_AUDIT_DIR:-target/gpu-audit}"
WORK=$(cd "${GPU_AUDIT_DIR:-target/gpu-audit}" && pwd)
export GPU_AUDIT_DIR=$WORK

# Tools: gcc and the Vulkan headers for the layer, spirv-dis (workgroup sizes) and python3 for
# the tables. As root they are installed with apt-get; otherwise the command is printed.
need=()
command -v gcc >/dev/null || need+=(gcc)
[ -f /usr/include/vulkan/vk_layer.h ] || need+=(libvulkan-dev)
command -v spirv-dis >/dev/null || need+=(spirv-tools)
command -v python3 >/dev/null || need+=(python3)
if [ ${#need[@]} -gt 0 ]; then
    install=(apt-get install -y --no-install-recommends "${need[@]}")
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "running as root: installing ${need[*]} (${install[*]})"
        "${install[@]}" >&2 || { apt-get update >&2 && "${install[@]}" >&2; } ||
            { say "could not install ${need[*]}"; exit 1; }
    else
        say "needs ${need[*]}: sudo ${install[*]}"
        exit 1
    fi
fi

# Mesa 25's RADV, unpacked beside the system's Mesa by the project's scripts/mesa25.sh: the one
# under the current directory (the project root) first, else the one of BIN's checkout.
MESA=$WORK/mesa25
LIB=$MESA/root/usr/lib/x86_64-linux-gnu/libvulkan_radeon.so
if [ ! -f "$LIB" ]; then
    script=""
    for s in scripts/mesa25.sh "$(dirname "$BIN")/../../scripts/mesa25.sh"; do
        [ -f "$s" ] && { script=$(readlink -f "$s"); break; }
    done
    [ -n "$script" ] || { say "no scripts/mesa25.sh here or beside $BIN (run from the project root)"; exit 1; }
    say "installing Mesa 25 (bookworm-backports) into $MESA with $script"
    SYNCSTEP_MESA25_DIR=$MESA bash "$script" >/dev/null
    [ -f "$LIB" ] || { say "$MESA has no libvulkan_radeon.so"; exit 1; }
fi
if missing=$(ldd "$LIB" | grep "not found"); then
    say "libvulkan_radeon.so needs libraries this system lacks:"
    echo "$missing" >&2
    exit 1
fi
ICD=$WORK/radeon_icd.json
sed "s#\"library_path\": *\"[^\"]*\"#\"library_path\": \"$LIB\"#" \
    "$MESA/root/usr/share/vulkan/icd.d/radeon_icd.json" >"$ICD"
grep -q "\"$LIB\"" "$ICD" || { say "could not rewrite library_path in $ICD"; exit 1; }

# The layer, rebuilt when its source differs from the copy it was last built from.
LAYER=$WORK/null-submit
SO=$LAYER/libsyncstep_null_submit.so
mkdir -p "$LAYER"
if [ ! -f "$SO" ] || ! cmp -s "$SRC/null-submit/null_submit_layer.c" "$LAYER/null_submit_layer.c"; then
    rm -f "$LAYER/null_submit_layer.c"
    gcc -O2 -Wall -fPIC -shared -fvisibility=hidden -o "$SO" "$SRC/null-submit/null_submit_layer.c" -lpthread
    cat "$SRC/null-submit/null_submit_layer.c" >"$LAYER/null_submit_layer.c"
fi
sed "s#@LIBRARY_PATH@#$SO#" "$SRC/null-submit/VK_LAYER_SYNCSTEP_null_submit.json.in" \
    >"$LAYER/VK_LAYER_SYNCSTEP_null_submit.json"

tag=$FAMILY
for kv in "$@"; do tag="$tag-$(echo "${kv#*=}" | tr -c 'A-Za-z0-9\n' '_')"; done
args=(--family "$FAMILY")
[ "${ALL:-0}" = 1 ] && args+=(--all)
[ "${MARKDOWN:-0}" = 1 ] && args+=(--markdown)
[ -n "${PIPELINE:-}" ] && args+=(--pipeline "$PIPELINE")
for shape in $SHAPES; do
    size=${shape%%:*} batch=${shape##*:}
    out=$WORK/runs/$tag-$size-b$batch
    bash "$SRC/run-one.sh" "$BIN" "$FAMILY" "$size" "$batch" "$out" "$@" >&2
    python3 "$SRC/radv_table.py" "$out" "${args[@]}"
    echo
done
