#!/usr/bin/env bash
# Installs what the browser face needs, only what is missing (idempotent); run or source it.
#   scripts/setup-web.sh          the wasm toolchain: rustup's wasm32 target and wasm-bindgen-cli
#                                 at exactly the wasm-bindgen version in Cargo.lock
#   scripts/setup-web.sh --test   also what the browser tests need: Debian's chromium (it ships
#                                 SwiftShader, WebGPU on the CPU) and web/'s npm packages (npm ci)
# Never downloads a browser of its own (no `npx playwright install`); never uses Debian's
# wasm-opt (binaryen 108 breaks the module).
set -euo pipefail

(
cd "$(dirname "${BASH_SOURCE[0]}")/.."
want_test=0
for a in "$@"; do [ "$a" = --test ] && want_test=1; done
sudo_() { if [ "$(id -u)" -ne 0 ]; then sudo "$@"; else "$@"; fi; }

if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown; then
    echo "setup-web: adding rustup target wasm32-unknown-unknown"
    rustup target add wasm32-unknown-unknown
fi

# wasm-bindgen-cli must match the wasm-bindgen crate exactly, or the generated JS refuses the module.
X=$(awk '$0 == "name = \"wasm-bindgen\"" { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock)
if [ -z "$X" ]; then
    echo "setup-web: no wasm-bindgen in Cargo.lock" >&2
    exit 1
fi
if [ "$(wasm-bindgen --version 2>/dev/null)" != "wasm-bindgen $X" ]; then
    echo "setup-web: installing wasm-bindgen-cli $X (about 5 minutes, once)"
    # Not --locked: with it, resolution fails for this version.
    cargo install wasm-bindgen-cli --version "$X" --quiet
fi

if [ "$want_test" = 1 ]; then
    if [ -z "${SYNCSTEP_CHROMIUM:-}" ] && [ ! -x /usr/bin/chromium ]; then
        if command -v apt-get >/dev/null; then
            echo "setup-web: installing Debian's chromium (headless WebGPU on SwiftShader)"
            sudo_ apt-get update -qq
            DEBIAN_FRONTEND=noninteractive sudo_ apt-get install -y -qq --no-install-recommends chromium >/dev/null
        else
            echo "setup-web: no /usr/bin/chromium and no apt-get; set SYNCSTEP_CHROMIUM to a Chromium binary" >&2
            exit 1
        fi
    fi
    node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
    if ! command -v npm >/dev/null || [ "$node_major" -lt 20 ]; then
        echo "setup-web: the browser tests need Node 20+ with npm (found: $(node --version 2>/dev/null || echo none))" >&2
        exit 1
    fi
    # npm ci wipes and reinstalls node_modules; skip it when the lock file is what was installed.
    if ! cmp -s web/package-lock.json web/node_modules/.syncstep-installed-lock 2>/dev/null; then
        echo "setup-web: npm ci in web/"
        (cd web && npm ci --no-audit --no-fund --loglevel=error)
        cp web/package-lock.json web/node_modules/.syncstep-installed-lock
    fi
fi
)
