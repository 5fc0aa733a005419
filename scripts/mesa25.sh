#!/usr/bin/env bash
# Mesa 25 lavapipe (bookworm-backports) beside the system's Mesa, for benchmark figures: 2–4×
# faster on compute than bookworm's Mesa 22.3. Nothing of the system changes: apt runs on a
# private sources list and state under the cache folder, `apt-get download` fetches the
# backports mesa-vulkan-drivers .deb and `dpkg -x` unpacks it there. The script prints one
# line to evaluate, which selects it for that shell only:
#
#     eval "$(bash scripts/mesa25.sh)"      # export VK_ICD_FILENAMES=…/lvp_icd.x86_64.json
#     syncstep info                          # … llvmpipe Mesa 25.0.7 …
#
# The backports build links the LLVM 15 and libdrm that bookworm already has, so no
# LD_LIBRARY_PATH is needed (checked below: the driver's symbols all resolve). Idempotent:
# a second run only prints the line. SYNCSTEP_MESA25_DIR overrides the folder.
set -euo pipefail

DIR="${SYNCSTEP_MESA25_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/syncstep/mesa25}"
ICD="$DIR/lvp_icd.x86_64.json"
LIB="$DIR/root/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so"

say() { echo "mesa25: $*" >&2; }

if [ ! -f "$ICD" ] || [ ! -f "$LIB" ]; then
    command -v apt-get >/dev/null || { say "needs apt-get (Debian 12 bookworm)"; exit 1; }
    codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
    [ "$codename" = bookworm ] || say "warning: this is '$codename', not bookworm; backports' build may not load"
    [ "$(dpkg --print-architecture)" = amd64 ] || { say "only amd64 is handled"; exit 1; }
    mkdir -p "$DIR/deb"
    say "fetching bookworm-backports' package list into $DIR/apt"
    # shellcheck source=scripts/private-apt.sh
    source "$(dirname "${BASH_SOURCE[0]}")/private-apt.sh"
    private_apt "$DIR/apt" "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm-backports main"
    version="$(apt-cache "${apt_opts[@]}" madison mesa-vulkan-drivers | awk '/bookworm-backports/ { print $3; exit }')"
    [ -n "$version" ] || { say "bookworm-backports lists no mesa-vulkan-drivers"; exit 1; }
    say "downloading mesa-vulkan-drivers $version"
    rm -f "$DIR"/deb/*.deb
    (cd "$DIR/deb" && apt-get "${apt_opts[@]}" download "mesa-vulkan-drivers=$version" >&2)
    rm -rf "$DIR/root"
    dpkg -x "$DIR"/deb/mesa-vulkan-drivers_*.deb "$DIR/root"
    [ -f "$LIB" ] || { say "the package has no $LIB"; exit 1; }
    if ldd -r "$LIB" 2>&1 | grep -E "not found|undefined symbol" >&2; then
        say "the driver needs libraries this system lacks (above)"
        exit 1
    fi
    # The packaged ICD names the library without a folder (the loader would find the system's
    # Mesa 22 one); point it at the extracted file instead.
    sed "s#\"library_path\": *\"[^\"]*\"#\"library_path\": \"$LIB\"#" \
        "$DIR/root/usr/share/vulkan/icd.d/lvp_icd.json" >"$ICD"
    grep -q "\"$LIB\"" "$ICD" || { say "could not rewrite library_path in $ICD"; exit 1; }
    say "installed $version in $DIR"
fi

echo "export VK_ICD_FILENAMES=$ICD"
