#!/usr/bin/env bash
# Installs what syncstep needs on a Debian/Ubuntu machine, only what is missing (idempotent):
# a Vulkan loader and Mesa's software Vulkan driver (lavapipe) when no Vulkan driver exists.
set -euo pipefail

need_sudo() { if [ "$(id -u)" -ne 0 ]; then echo sudo; fi; }

have_vulkan_icd() {
    ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json 2>/dev/null | grep -q . &&
        ldconfig -p 2>/dev/null | grep -q libvulkan.so.1
}

if ! have_vulkan_icd; then
    if command -v apt-get >/dev/null; then
        echo "setup: no Vulkan driver found; installing Mesa's lavapipe (software Vulkan)"
        $(need_sudo) apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $(need_sudo) apt-get install -y -qq --no-install-recommends mesa-vulkan-drivers libvulkan1 >/dev/null
    else
        echo "setup: no Vulkan driver found and no apt-get; install your GPU's Vulkan driver (or Mesa lavapipe)" >&2
        exit 1
    fi
fi

# wgpu's loaders print a warning without it; harmless but noisy.
if [ -z "${XDG_RUNTIME_DIR:-}" ] || [ ! -d "${XDG_RUNTIME_DIR}" ]; then
    export XDG_RUNTIME_DIR="${TMPDIR:-/tmp}/syncstep-xdg-$(id -u)"
    mkdir -p -m 700 "$XDG_RUNTIME_DIR"
fi
