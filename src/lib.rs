//! syncstep: a WebGPU compute runtime that trains ResNet-34 with WGSL compute shaders, on one
//! device or data-parallel over R devices with synchronised BatchNorm.
//!
//! Layers, bottom up (see docs/design.md): `gpu` → `kernels` → (`step`, `collective`) → faces.
//! `reference` is the f64 CPU world the GPU path is held to; it shares no code with it.

#[cfg(not(target_arch = "wasm32"))]
pub mod bench;
pub mod canonical;
pub mod check;
pub mod checkpoint;
pub mod collective;
pub mod compare;
pub mod data;
#[cfg(not(target_arch = "wasm32"))]
pub mod files;
pub mod golden;
pub mod gpu;
pub mod host;
pub mod kernels;
#[cfg(not(target_arch = "wasm32"))]
pub mod metrics;
pub mod model;
pub mod parallel;
pub mod reference;
pub mod scores;
pub mod selfcheck;
pub mod step;
pub mod tensorfile;
pub mod train;
#[cfg(target_arch = "wasm32")]
pub mod web;
