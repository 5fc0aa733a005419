//! The `reference` layer: plain-Rust f64 forward and backward of every op, with the same op
//! names as the GPU kernels. Tests hold the GPU path to it; it shares no code with that path.

pub mod avgpool;
pub mod batchnorm;
pub mod conv2d;
pub mod cross_entropy;
pub mod dense;
pub mod elementwise;
pub mod matmul;
pub mod maxpool;
pub mod sgd;
pub mod step;
