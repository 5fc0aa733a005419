//! The optimizer: SGD with momentum and weight decay, as PyTorch's `torch.optim.SGD`
//! (dampening 0, not Nesterov). See shaders/sgd.wgsl.

use super::{expect_len, launch, KernelError, Result};
use syncstep_gpu::{grid_1d, Encoder, Gpu, Serial, Shader, Slice};

pub(crate) const SHADER: Shader = Shader::file("sgd", include_str!("../shaders/sgd.wgsl"));
const WG: u32 = 256;
/// vec4s per invocation (`RUN` in the shader).
const RUN: u64 = 8;

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
    len4: u32,
    lr: f32,
    momentum: f32,
    weight_decay: f32,
}

/// One step in place, elementwise over flat buffers of equal length:
/// `g' = grad + weight_decay·param; velocity ← momentum·velocity + g'; param ← param − lr·velocity`.
/// Start `velocity` at zero: PyTorch's first step sets it to g', which is then the same. The
/// length must be a multiple of 4 (the model's flat buffers, 256-byte aligned per tensor, are).
pub fn sgd_update(
    gpu: &Gpu,
    enc: &mut Encoder,
    h: &SgdParams,
    param: Slice,
    grad: Slice,
    velocity: Slice,
) -> Result<()> {
    const OP: &str = "sgd_update";
    for (arg, v) in [("lr", h.lr), ("momentum", h.momentum), ("weight_decay", h.weight_decay)] {
        if !v.is_finite() {
            return Err(KernelError::Arg {
                op: OP,
                arg,
                problem: format!("is {v}, expected a finite value"),
            });
        }
    }
    let len = param.len;
    if len == 0 || !len.is_multiple_of(4) || len > u32::MAX as u64 {
        let problem =
            format!("has {len} elements, expected a multiple of 4 from 4 to {}", u32::MAX - 3);
        return Err(KernelError::Arg { op: OP, arg: "param", problem });
    }
    expect_len(OP, "grad", &grad, len, "same length as param")?;
    expect_len(OP, "velocity", &velocity, len, "same length as param")?;
    let params = Params {
        len4: (len / 4) as u32,
        lr: h.lr,
        momentum: h.momentum,
        weight_decay: h.weight_decay,
    };
    let bindings = [("param", param), ("grad", grad), ("velocity", velocity)];
    // RUN vec4s an invocation, each three loads, the update's arithmetic and two stores.
    gpu.describe_serial_next(Serial::loop_of(RUN, 20));
    launch(gpu, enc, OP, &SHADER, OP, &params, &bindings, grid_1d((len / 4).div_ceil(RUN), WG))
}
