//! The optimizer: SGD with momentum and weight decay, as PyTorch's `torch.optim.SGD`
//! (dampening 0, not Nesterov). See shaders/sgd.wgsl.

use super::{expect_len, launch, KernelError, Result};
use crate::gpu::{grid_1d, Gpu, Shader, Slice};

const SHADER: Shader = Shader { name: "sgd", source: include_str!("../../shaders/sgd.wgsl") };
const WG: u32 = 256;
/// Elements per invocation (`RUN` in the shader).
const RUN: u64 = 16;

/// Hyper-parameters of one step; all must be finite.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdParams {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    len: u32,
    lr: f32,
    momentum: f32,
    weight_decay: f32,
}

/// One step in place, elementwise over flat buffers of equal length:
/// `g' = grad + weight_decay·param; velocity ← momentum·velocity + g'; param ← param − lr·velocity`.
/// Start `velocity` at zero: PyTorch's first step sets it to g', which is then the same.
pub fn sgd_update(gpu: &Gpu, enc: &mut wgpu::CommandEncoder, h: &SgdParams, param: Slice, grad: Slice, velocity: Slice) -> Result<()> {
    const OP: &str = "sgd_update";
    for (arg, v) in [("lr", h.lr), ("momentum", h.momentum), ("weight_decay", h.weight_decay)] {
        if !v.is_finite() {
            return Err(KernelError::Arg { op: OP, arg, problem: format!("is {v}, expected a finite value") });
        }
    }
    let len = u32::try_from(param.len)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| KernelError::Arg { op: OP, arg: "param", problem: format!("has {} elements, expected 1 to {}", param.len, u32::MAX) })?;
    expect_len(OP, "grad", &grad, param.len, "same length as param")?;
    expect_len(OP, "velocity", &velocity, param.len, "same length as param")?;
    let params = Params { len, lr: h.lr, momentum: h.momentum, weight_decay: h.weight_decay };
    let bindings = [("param", param), ("grad", grad), ("velocity", velocity)];
    launch(gpu, enc, OP, &SHADER, OP, &params, &bindings, grid_1d(param.len.div_ceil(RUN), WG))
}
