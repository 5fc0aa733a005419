#!/usr/bin/env bash
# onnxruntime, which the suite runs `syncstep export`'s ONNX models in (tests/suite/export.rs):
# a Python virtual environment in target/onnxruntime holding it (and NumPy, its dependency),
# made once from PyPI. Safe to run again: one that imports onnxruntime is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${CARGO_TARGET_DIR:-target}/onnxruntime"
version=1.32.0
if "$venv/bin/python3" -c "import onnxruntime" 2>/dev/null; then
    exit 0
fi
need_sudo() { if [ "$(id -u)" -ne 0 ]; then echo sudo; fi; }
# Debian's python3 makes a virtual environment only with python3-venv (ensurepip).
if ! command -v python3 >/dev/null || ! python3 -c "import ensurepip, venv" 2>/dev/null; then
    echo "setup-onnx: installing python3 and python3-venv"
    $(need_sudo) apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $(need_sudo) apt-get install -y -qq --no-install-recommends \
        python3 python3-venv >/dev/null
fi
rm -rf "$venv"
python3 -m venv "$venv"
echo "setup-onnx: installing onnxruntime $version into $venv"
"$venv/bin/python3" -m pip install --quiet --disable-pip-version-check "onnxruntime==$version"
