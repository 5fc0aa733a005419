#!/usr/bin/env bash
# Sourced by scripts/run.sh and scripts/test.sh: makes sure wgpu will find a GPU driver, and
# installs only what is missing (safe to run again: a machine that has a driver installs nothing).
#   - macOS (Metal) and Windows (DX12/Vulkan from the GPU driver): nothing to install.
#   - Linux with a Vulkan driver (any ICD file and the Vulkan loader): nothing to install.
#   - Linux without one: Mesa's lavapipe (software Vulkan on the CPU) through apt-get, once;
#     without apt-get, a warning saying what to install, and the run goes on (wgpu may still
#     find a GL driver, and says so clearly if it finds nothing).

need_sudo() { if [ "$(id -u)" -ne 0 ]; then echo sudo; fi; }

# Whether a Vulkan ICD (a driver's JSON manifest) and the loader are installed. Globs, not `ls`:
# a missing directory must not fail the test under `set -o pipefail`.
have_vulkan_driver() {
    local icd found=0 named="${VK_ICD_FILENAMES:-}:${VK_DRIVER_FILES:-}"
    for icd in /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json \
        /usr/local/share/vulkan/icd.d/*.json ${named//:/ }; do
        if [ -f "$icd" ]; then found=1; break; fi
    done
    [ "$found" = 1 ] || return 1
    { ldconfig -p 2>/dev/null || true; } | grep -q 'libvulkan\.so\.1'
}

case "$(uname -s)" in
    Darwin | MINGW* | MSYS* | CYGWIN*) ;; # Metal / DX12: the system has what wgpu needs
    *)
        if ! have_vulkan_driver; then
            if command -v apt-get >/dev/null; then
                echo "setup: no Vulkan driver found; installing Mesa's lavapipe (software Vulkan)"
                $(need_sudo) apt-get update -qq
                DEBIAN_FRONTEND=noninteractive $(need_sudo) apt-get install -y -qq \
                    --no-install-recommends mesa-vulkan-drivers libvulkan1 >/dev/null
            else
                echo "setup: no Vulkan driver found and no apt-get: install your GPU's Vulkan driver" \
                    "(or Mesa's lavapipe, e.g. mesa-vulkan-drivers / vulkan-swrast); going on" >&2
            fi
        fi
        # Mesa prints "XDG_RUNTIME_DIR is invalid" without one.
        if [ -z "${XDG_RUNTIME_DIR:-}" ] || [ ! -d "${XDG_RUNTIME_DIR}" ]; then
            export XDG_RUNTIME_DIR="${TMPDIR:-/tmp}/syncstep-xdg-$(id -u)"
            mkdir -p -m 700 "$XDG_RUNTIME_DIR"
        fi
        ;;
esac
