//! The `kernels` layer: one module per op family, each a few typed launch functions that
//! check shapes and device limits up front and record into the caller's `CommandEncoder`.
//! Nothing here submits; nothing here knows the model.

use crate::gpu::{Gpu, GpuError, Shader, Slice};

pub mod avgpool;
pub mod batchnorm;
pub mod conv2d;
pub mod cross_entropy;
pub mod dense;
pub mod elementwise;
pub mod matmul;
pub mod maxpool;
pub mod sgd;

/// A launch that was refused before anything was recorded, or that the device refused.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{op}: argument `{arg}` {problem}")]
    Arg { op: &'static str, arg: &'static str, problem: String },
    #[error("{op}: {source}")]
    Gpu {
        op: &'static str,
        #[source]
        source: GpuError,
    },
}

pub type Result<T, E = KernelError> = std::result::Result<T, E>;

/// Fails unless `s` holds exactly `expected` elements; `formula` says where that number comes from.
pub(crate) fn expect_len(op: &'static str, arg: &'static str, s: &Slice, expected: u64, formula: &str) -> Result<()> {
    if s.len != expected {
        return Err(KernelError::Arg { op, arg, problem: format!("has {} elements, expected {expected} ({formula})", s.len) });
    }
    Ok(())
}

/// Fails when a dimension is zero: an empty dispatch would silently leave outputs unwritten.
pub(crate) fn expect_positive(op: &'static str, arg: &'static str, v: u32) -> Result<()> {
    if v == 0 {
        return Err(KernelError::Arg { op, arg, problem: "is 0, expected at least 1".into() });
    }
    Ok(())
}

/// Checks every named binding against the device's limits, then records the dispatch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch<P: bytemuck::Pod>(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    op: &'static str,
    shader: &Shader,
    entry: &'static str,
    params: &P,
    bindings: &[(&'static str, Slice)],
    workgroups: [u32; 3],
) -> Result<()> {
    for (name, s) in bindings {
        gpu.check_binding(&format!("argument `{name}`"), s).map_err(|source| KernelError::Gpu { op, source })?;
    }
    let slices: Vec<Slice> = bindings.iter().map(|(_, s)| *s).collect();
    gpu.dispatch(encoder, op, shader, entry, params, &slices, workgroups).map_err(|source| KernelError::Gpu { op, source })
}
