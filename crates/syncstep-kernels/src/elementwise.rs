//! ReLU (forward with a gate, masked backward), the residual add, and the residual block's
//! backward join (add with a ReLU-masked operand). See shaders/elementwise.wgsl.

use super::{expect_len, launch, Result};
use syncstep_gpu::{grid_1d, Encoder, Gpu, Shader, Slice};

pub(crate) const SHADER: Shader =
    Shader::file("elementwise", include_str!("../shaders/elementwise.wgsl"));
const WG: u32 = 256;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    len: u32,
}

/// One invocation per element of `out`; every input has its length.
fn elementwise(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: &'static str,
    inputs: &[(&'static str, Slice)],
    out: (&'static str, Slice),
) -> Result<()> {
    let len = out.1.len;
    for (name, input) in inputs {
        expect_len(op, name, input, len, "same length as the output")?;
    }
    let params = Params { len: len as u32 };
    let bindings: Vec<(&'static str, Slice)> = inputs.iter().copied().chain([out]).collect();
    launch(gpu, enc, op, &SHADER, op, &params, &bindings, grid_1d(len, WG))
}

/// `y = gate > 0 ? x : 0`. Pass `x` as `gate` for a plain ReLU.
pub fn relu_forward(gpu: &Gpu, enc: &mut Encoder, x: Slice, gate: Slice, y: Slice) -> Result<()> {
    elementwise(gpu, enc, "relu_forward", &[("x", x), ("gate", gate)], ("y", y))
}

/// `dx = gate > 0 ? dy : 0`, with the gate the forward used (its input or output).
pub fn relu_backward(
    gpu: &Gpu,
    enc: &mut Encoder,
    dy: Slice,
    gate: Slice,
    dx: Slice,
) -> Result<()> {
    elementwise(gpu, enc, "relu_backward", &[("dy", dy), ("gate", gate)], ("dx", dx))
}

/// `out = a + b`.
pub fn add(gpu: &Gpu, enc: &mut Encoder, a: Slice, b: Slice, out: Slice) -> Result<()> {
    elementwise(gpu, enc, "add", &[("a", a), ("b", b)], ("out", out))
}

/// `out = a + (gate > 0 ? dy : 0)`: bitwise `add(a, relu_backward(dy, gate))` in one pass.
pub fn add_relu_backward(
    gpu: &Gpu,
    enc: &mut Encoder,
    a: Slice,
    dy: Slice,
    gate: Slice,
    out: Slice,
) -> Result<()> {
    elementwise(
        gpu,
        enc,
        "add_relu_backward",
        &[("a", a), ("dy", dy), ("gate", gate)],
        ("out", out),
    )
}
