#!/usr/bin/env bash
# Sourced by scripts/test.sh and scripts/run.sh: makes sure cargo and a C compiler are there, for a
# fresh Debian or Ubuntu machine. Installs only what is missing: a C compiler (the cc, libffi
# and mpi crates build C) through apt-get, and Rust through rustup (stable, with clippy and
# rustfmt) into ~/.cargo, whose env file it then reads.

[ -f "$HOME/.cargo/env" ] && ! command -v cargo >/dev/null && . "$HOME/.cargo/env"
rust_missing=()
command -v cc >/dev/null || rust_missing+=(build-essential)
command -v cargo >/dev/null || command -v curl >/dev/null || rust_missing+=(curl ca-certificates)
if [ "${#rust_missing[@]}" -gt 0 ]; then
    if command -v apt-get >/dev/null; then
        echo "setup-rust: installing ${rust_missing[*]}"
        $([ "$(id -u)" -ne 0 ] && echo sudo) apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $([ "$(id -u)" -ne 0 ] && echo sudo) apt-get install -y -qq \
            --no-install-recommends "${rust_missing[@]}" >/dev/null
    else
        echo "setup-rust: install ${rust_missing[*]} with your package manager" >&2
    fi
fi
if ! command -v cargo >/dev/null; then
    echo "setup-rust: installing Rust (rustup, stable) into ~/.cargo"
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs |
        sh -s -- -y -q --profile minimal --component clippy,rustfmt
    . "$HOME/.cargo/env"
fi
unset rust_missing
