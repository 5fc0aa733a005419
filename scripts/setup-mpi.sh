#!/usr/bin/env bash
# Makes sure a build with `--features mpi` and the MPI tests can run: an MPI (mpicc, mpirun),
# libclang (the bindings' build runs bindgen) and iproute2 (`ip`, `tc`: tests/mpi/hosts.rs makes
# test hosts with scripts/hosts.sh). Installs only what is missing, with apt-get (Debian/Ubuntu: Open
# MPI); elsewhere says what to install and fails.
set -euo pipefail

need_sudo() { if [ "$(id -u)" -ne 0 ]; then echo sudo; fi; }
have_libclang() { { ldconfig -p 2>/dev/null || true; } | grep -q 'libclang[-.0-9]*\.so'; }

missing=()
command -v mpicc >/dev/null && command -v mpirun >/dev/null || missing+=(openmpi-bin libopenmpi-dev)
have_libclang || [ -n "${LIBCLANG_PATH:-}" ] || missing+=(libclang-dev)
command -v ip >/dev/null && command -v tc >/dev/null || missing+=(iproute2)
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null; then
    echo "setup-mpi: missing ${missing[*]}: install an MPI (Open MPI or MPICH, with mpicc and" \
        "mpirun), libclang and iproute2 with your package manager" >&2
    exit 1
fi
echo "setup-mpi: installing ${missing[*]}"
$(need_sudo) apt-get update -qq
DEBIAN_FRONTEND=noninteractive $(need_sudo) apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
