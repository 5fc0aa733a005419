#!/usr/bin/env bash
# Runs a program on Debian unstable's lavapipe (Mesa 26 when this was written) beside the
# system's Mesa, for benchmark figures. That build links unstable's glibc and LLVM, which
# bookworm lacks, so nothing of it can be loaded by the system's dynamic loader: the script
# downloads mesa-vulkan-drivers and every package it depends on (about 70 MB: glibc, LLVM, the
# Vulkan loader), unpacks them under the cache folder without installing anything, and runs the
# program under unstable's dynamic loader with those libraries only:
#
#     scripts/mesa-sid.sh target/release/syncstep info    # … llvmpipe Mesa 26.2.6-1 …
#     python3 scripts/vs_pytorch.py --syncstep "scripts/mesa-sid.sh target/release/syncstep"
#
# The program must be a native executable (the loader runs it; a script would not be). Children
# it starts run on the system's libraries again. The first run fetches; later runs only run.
# SYNCSTEP_MESA_SID_DIR overrides the folder.
set -euo pipefail

DIR="${SYNCSTEP_MESA_SID_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/syncstep/mesa-sid}"
LIBS="$DIR/root/usr/lib/x86_64-linux-gnu"
LOADER="$LIBS/ld-linux-x86-64.so.2"
ICD="$DIR/lvp_icd.x86_64.json"

say() { echo "mesa-sid: $*" >&2; }

[ $# -ge 1 ] || { echo "usage: scripts/mesa-sid.sh PROGRAM [ARGS…]" >&2; exit 2; }
program="$(command -v "$1" || true)"
[ -n "$program" ] || { say "no program '$1'"; exit 2; }

if [ ! -f "$ICD" ] || [ ! -x "$LOADER" ]; then
    command -v apt-get >/dev/null || { say "needs apt-get (Debian or Ubuntu)"; exit 1; }
    [ "$(dpkg --print-architecture)" = amd64 ] || { say "only amd64 is handled"; exit 1; }
    mkdir -p "$DIR/deb"
    say "fetching unstable's package list into $DIR/apt"
    # shellcheck source=scripts/private-apt.sh
    source "$(dirname "${BASH_SOURCE[0]}")/private-apt.sh"
    private_apt "$DIR/apt" "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main"
    # The driver, the Vulkan loader and everything they need, by name (virtual packages, shown
    # in angle brackets, are provided by real ones in the list).
    packages="$(apt-cache "${apt_opts[@]}" depends --recurse --no-recommends --no-suggests \
        --no-conflicts --no-breaks --no-replaces --no-enhances mesa-vulkan-drivers libvulkan1 |
        grep -v -e '^ ' -e '^<' | sort -u)"
    say "downloading $(echo "$packages" | wc -l) packages"
    rm -f "$DIR"/deb/*.deb
    # shellcheck disable=SC2086 # one package name per word
    (cd "$DIR/deb" && apt-get "${apt_opts[@]}" download $packages >&2)
    rm -rf "$DIR/root"
    for deb in "$DIR"/deb/*.deb; do dpkg -x "$deb" "$DIR/root"; done
    [ -x "$LOADER" ] || { say "the packages hold no $LOADER"; exit 1; }
    if "$LOADER" --library-path "$LIBS" --list "$LIBS/libvulkan_lvp.so" 2>&1 | grep "not found" >&2; then
        say "the driver needs libraries the packages lack (above)"
        exit 1
    fi
    # The packaged ICD names the library without a folder; point it at the unpacked file.
    sed "s#\"library_path\": *\"[^\"]*\"#\"library_path\": \"$LIBS/libvulkan_lvp.so\"#" \
        "$DIR/root/usr/share/vulkan/icd.d/lvp_icd.json" >"$ICD"
    grep -q "\"$LIBS/libvulkan_lvp.so\"" "$ICD" || { say "could not rewrite library_path in $ICD"; exit 1; }
    say "unpacked $(ls "$DIR"/deb/mesa-vulkan-drivers_*.deb | sed 's/.*_\(.*\)_amd64.deb/\1/') in $DIR"
fi

VK_ICD_FILENAMES="$ICD" exec "$LOADER" --library-path "$LIBS" "$program" "${@:2}"
