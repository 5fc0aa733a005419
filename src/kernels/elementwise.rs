//! ReLU (forward with a gate, masked backward) and the residual add. See shaders/elementwise.wgsl.

use super::{expect_len, launch, Result};
use crate::gpu::{grid_1d, Gpu, Shader, Slice};

const SHADER: Shader = Shader { name: "elementwise", source: include_str!("../../shaders/elementwise.wgsl") };
const WG: u32 = 256;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    len: u32,
}

fn binary(
    gpu: &Gpu,
    enc: &mut wgpu::CommandEncoder,
    op: &'static str,
    names: [&'static str; 3],
    inputs: [Slice; 2],
    out: Slice,
) -> Result<()> {
    let len = out.len;
    expect_len(op, names[0], &inputs[0], len, "same length as the output")?;
    expect_len(op, names[1], &inputs[1], len, "same length as the output")?;
    let params = Params { len: len as u32 };
    let bindings = [(names[0], inputs[0]), (names[1], inputs[1]), (names[2], out)];
    launch(gpu, enc, op, &SHADER, op, &params, &bindings, grid_1d(len, WG))
}

/// `y = gate > 0 ? x : 0`. Pass `x` as `gate` for a plain ReLU.
pub fn relu_forward(gpu: &Gpu, enc: &mut wgpu::CommandEncoder, x: Slice, gate: Slice, y: Slice) -> Result<()> {
    binary(gpu, enc, "relu_forward", ["x", "gate", "y"], [x, gate], y)
}

/// `dx = gate > 0 ? dy : 0`, with the gate the forward used (its input or output).
pub fn relu_backward(gpu: &Gpu, enc: &mut wgpu::CommandEncoder, dy: Slice, gate: Slice, dx: Slice) -> Result<()> {
    binary(gpu, enc, "relu_backward", ["dy", "gate", "dx"], [dy, gate], dx)
}

/// `out = a + b`.
pub fn add(gpu: &Gpu, enc: &mut wgpu::CommandEncoder, a: Slice, b: Slice, out: Slice) -> Result<()> {
    binary(gpu, enc, "add", ["a", "b", "out"], [a, b], out)
}
