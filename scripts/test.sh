#!/usr/bin/env bash
# The whole test suite, what CI runs (.ci/run calls exactly this). It installs what is missing,
# then:
#   1. lint: rustfmt, clippy and rustdoc (warnings are errors) over the workspace's crates, and
#      `cargo check` of the libraries and the binary for Windows (DX12) and macOS (Metal), which
#      proves those paths compile;
#   2. every test of every crate in release mode (debug wgpu and the f64 references are too
#      slow), built with the `mpi` feature (scripts/setup-mpi.sh installs Open MPI and
#      iproute2). The integration tests are two binaries (Cargo.toml, tests/suite/main.rs):
#      `suite`, and `mpi`, whose tests run ranks under mpirun (tests/mpi/mpi.rs) and on test
#      hosts over shaped links (tests/mpi/hosts.rs, scripts/hosts.sh: needs root). The ONNX
#      exports run in onnxruntime, which scripts/setup-onnx.sh installs in target/. GPU tests
#      run on the first adapter (lavapipe on a CPU machine). A test that cannot run here (no
#      adapter, no root) is reported as "ignored (skipped: …)", and with CI set it fails;
#   3. the browser face: the wasm build, and the demo page in headless Chromium (WebGPU on
#      SwiftShader) under `node --test`; its PORTABLE test runs the native release binary to
#      write web/golden.json first.
# Arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup-rust.sh
source scripts/setup.sh
bash scripts/setup-mpi.sh
bash scripts/setup-onnx.sh
# Open MPI refuses to start ranks as root unless told; CI runs as root.
if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

# Lint.
cross_targets=(x86_64-pc-windows-gnu aarch64-apple-darwin)
installed=$(rustup component list --installed 2>/dev/null || true)
for component in rustfmt clippy; do
    grep -q "^$component" <<<"$installed" || rustup component add "$component"
done
targets=$(rustup target list --installed 2>/dev/null || true)
for target in "${cross_targets[@]}"; do
    grep -qx "$target" <<<"$targets" || rustup target add "$target"
done
cargo fmt --all --check
cargo clippy --workspace --release --all-targets --features mpi --quiet -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --release --no-deps --features mpi --quiet
for target in "${cross_targets[@]}"; do
    cargo check --workspace --release --target "$target" --lib --bins --quiet
done

# The suite's environment (kernels chosen without timing, the autotune's choices in the build
# folder) is the tests' own (tests/suite/common: `test_var`), so a plain `cargo test` runs the
# same.
cargo test --workspace --release --all-targets --features mpi --no-fail-fast "$@"

# The page tests run these (`cargo test` builds examples as test harnesses, not as programs).
cargo build --release --features mpi --bin syncstep --example make_image_folder --example recipe_weights --quiet
bash scripts/setup-web.sh --test
# The browser face's crate compiles only for wasm32: its lint runs here, once that target is in.
cargo clippy --release --target wasm32-unknown-unknown -p syncstep-web --quiet -- -D warnings
bash scripts/web-build.sh
(cd web && node --test --test-reporter=spec test/*.test.mjs)
