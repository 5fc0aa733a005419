//! syncstep: a WebGPU compute runtime that trains ResNet-34 with WGSL compute shaders, on one
//! device or data-parallel over R devices with synchronised BatchNorm.
//!
//! This is the core crate. The layers below it are crates of their own, re-exported here under
//! their module names: `host` and `files` (syncstep-host), `gpu` (syncstep-gpu) and `kernels`
//! (syncstep-kernels). Above it are the command line (syncstep-cli) and the browser face
//! (syncstep-web). Within it: (`step`, `collective`) → `parallel` → `train`, `check`, `bench`.
//! `reference` is the f64 CPU world the GPU path is held to; it shares no code with it.

pub use syncstep_gpu as gpu;
pub use syncstep_host as host;
#[cfg(not(target_arch = "wasm32"))]
pub use syncstep_host::files;
pub use syncstep_kernels as kernels;

#[cfg(not(target_arch = "wasm32"))]
pub mod bench;
pub mod canonical;
pub mod check;
pub mod checkpoint;
pub mod classify;
pub mod collective;
pub mod compare;
pub mod data;
pub mod environment;
pub mod export;
pub mod golden;
#[cfg(not(target_arch = "wasm32"))]
pub mod metrics;
pub mod model;
pub mod parallel;
pub mod reference;
pub mod scores;
pub mod selfcheck;
pub mod settings;
pub mod step;
pub mod tensorfile;
pub mod train;
