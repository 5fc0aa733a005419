//! Max pooling (ResNet's 3×3/s2/p1, any square window) with a saved argmax, the forward that
//! imposes a given argmax, and the gather backward. See shaders/maxpool.wgsl.
//!
//! x and dx are NCHW [n, c, h, w]; y and dy are [n, c, out_h, out_w]; `argmax` is a u32 buffer
//! [n, c, out_h, out_w] holding, per output, the index ih·w + iw within its input plane of the
//! first maximum in window scan order (kh outer, kw inner), padding never chosen, as PyTorch.
//! NaN inputs get no promise beyond an argmax inside the window (see the shader).

use super::{
    expect_len, expect_positive, expect_within_llvmpipe_loops, launch, KernelError, Result,
};
use syncstep_gpu::{grid_1d, Encoder, Gpu, Serial, Shader, Slice};

pub(crate) const SHADER: Shader = Shader::file("maxpool", include_str!("../shaders/maxpool.wgsl"));
const WG: u32 = 256;
/// Cells of a row the backward sums at once (`ROW_CHUNK` in the shader).
const ROW_CHUNK: u64 = 32;

/// Input [n, c, h, w] and a k×k window moved by `stride` over the input padded by `pad`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxPoolShape {
    pub n: u32,
    pub c: u32,
    pub h: u32,
    pub w: u32,
    pub k: u32,
    pub stride: u32,
    pub pad: u32,
}

impl MaxPoolShape {
    /// (h + 2·pad − k)/stride + 1 (meaningful for a shape the launchers accept).
    pub fn out_h(&self) -> u32 {
        out_len(self.h, self.k, self.stride, self.pad)
    }
    /// (w + 2·pad − k)/stride + 1 (meaningful for a shape the launchers accept).
    pub fn out_w(&self) -> u32 {
        out_len(self.w, self.k, self.stride, self.pad)
    }
    /// Elements of x and dx.
    pub fn input_len(&self) -> u64 {
        self.n as u64 * self.c as u64 * self.h as u64 * self.w as u64
    }
    /// Elements of y, dy and argmax.
    pub fn output_len(&self) -> u64 {
        self.n as u64 * self.c as u64 * self.out_h() as u64 * self.out_w() as u64
    }

    fn check(&self, op: &'static str) -> Result<Params> {
        for (arg, v) in [
            ("shape.n", self.n),
            ("shape.c", self.c),
            ("shape.h", self.h),
            ("shape.w", self.w),
            ("shape.k", self.k),
            ("shape.stride", self.stride),
        ] {
            expect_positive(op, arg, v)?;
        }
        if self.pad >= self.k {
            let problem = format!(
                "is {}, expected less than k = {}: a window must see a real input cell",
                self.pad, self.k
            );
            return Err(KernelError::Arg { op, arg: "shape.pad", problem });
        }
        let fits = |len: u32| self.k as u64 <= len as u64 + 2 * self.pad as u64;
        if !fits(self.h) || !fits(self.w) {
            let problem = format!(
                "is {}, expected at most min(h, w) + 2·pad = {} + 2·{}",
                self.k,
                self.h.min(self.w),
                self.pad
            );
            return Err(KernelError::Arg { op, arg: "shape.k", problem });
        }
        let (n, c, h, w, k, stride, pad) =
            (self.n, self.c, self.h, self.w, self.k, self.stride, self.pad);
        let (out_h, out_w) = (self.out_h(), self.out_w());
        Ok(Params { n, c, h, w, k, stride, pad, out_h, out_w, gated: 0 })
    }
}

fn out_len(len: u32, k: u32, stride: u32, pad: u32) -> u32 {
    ((len as u64 + 2 * pad as u64).saturating_sub(k as u64) / stride.max(1) as u64 + 1) as u32
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    c: u32,
    h: u32,
    w: u32,
    k: u32,
    stride: u32,
    pad: u32,
    out_h: u32,
    out_w: u32,
    /// maxpool_backward: 1 when a window's dy counts only where its `gate` is > 0.
    gated: u32,
}

/// y = the maximum of each window, and `argmax` (u32) the input cell it came from.
pub fn maxpool_forward(
    gpu: &Gpu,
    enc: &mut Encoder,
    shape: &MaxPoolShape,
    x: Slice,
    y: Slice,
    argmax: Slice,
) -> Result<()> {
    const OP: &str = "maxpool_forward";
    let params = shape.check(OP)?;
    expect_len(OP, "x", &x, shape.input_len(), "n·c·h·w")?;
    expect_len(OP, "y", &y, shape.output_len(), "n·c·out_h·out_w")?;
    expect_len(OP, "argmax", &argmax, shape.output_len(), "n·c·out_h·out_w")?;
    let iterations = shape.out_w() as u64 * (shape.k as u64 * shape.k as u64 + 1);
    expect_row_within_loop_limit(gpu, OP, shape.out_w(), iterations)?;
    // A window's cells: an address, a load and a compare each.
    gpu.describe_serial_next(Serial::loop_of(iterations, 5));
    let bindings = [("x", x), ("y", y), ("argmax", argmax)];
    // One invocation per output row (n, c, oy).
    launch(
        gpu,
        enc,
        OP,
        &SHADER,
        OP,
        &params,
        &bindings,
        grid_1d(shape.output_len() / shape.out_w() as u64, WG),
    )
}

/// y = x at the given `argmax` (e.g. saved by another run's `maxpool_forward`). Each argmax
/// value must be a cell of its window; out-of-plane values are not detected.
pub fn maxpool_forward_with_argmax(
    gpu: &Gpu,
    enc: &mut Encoder,
    shape: &MaxPoolShape,
    x: Slice,
    argmax: Slice,
    y: Slice,
) -> Result<()> {
    const OP: &str = "maxpool_forward_with_argmax";
    let params = shape.check(OP)?;
    expect_len(OP, "x", &x, shape.input_len(), "n·c·h·w")?;
    expect_len(OP, "argmax", &argmax, shape.output_len(), "n·c·out_h·out_w")?;
    expect_len(OP, "y", &y, shape.output_len(), "n·c·out_h·out_w")?;
    let bindings = [("x", x), ("argmax", argmax), ("y", y)];
    launch(gpu, enc, OP, &SHADER, OP, &params, &bindings, grid_1d(shape.output_len(), WG))
}

/// `dx[cell]` = Σ dy over the windows whose argmax names the cell (a gather; dx is overwritten).
pub fn maxpool_backward(
    gpu: &Gpu,
    enc: &mut Encoder,
    shape: &MaxPoolShape,
    dy: Slice,
    argmax: Slice,
    dx: Slice,
) -> Result<()> {
    backward(gpu, enc, "maxpool_backward", shape, dy, argmax, None, dx)
}

/// [`maxpool_backward`] of a pool whose input is a ReLU's output, with that ReLU's backward:
/// a window's dy counts only where its output `y` is > 0. A window's maximum is the ReLU's
/// output at the cell it chose, so this masks exactly the cells the ReLU zeroed: the bits of
/// `elementwise::relu_backward` after [`maxpool_backward`], without the ReLU's output.
pub fn maxpool_relu_backward(
    gpu: &Gpu,
    enc: &mut Encoder,
    shape: &MaxPoolShape,
    dy: Slice,
    argmax: Slice,
    y: Slice,
    dx: Slice,
) -> Result<()> {
    backward(gpu, enc, "maxpool_relu_backward", shape, dy, argmax, Some(y), dx)
}

#[allow(clippy::too_many_arguments)]
fn backward(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: &'static str,
    shape: &MaxPoolShape,
    dy: Slice,
    argmax: Slice,
    gate: Option<Slice>,
    dx: Slice,
) -> Result<()> {
    let params = shape.check(op)?;
    expect_len(op, "dy", &dy, shape.output_len(), "n·c·out_h·out_w")?;
    expect_len(op, "argmax", &argmax, shape.output_len(), "n·c·out_h·out_w")?;
    if let Some(y) = &gate {
        expect_len(op, "y", y, shape.output_len(), "n·c·out_h·out_w")?;
    }
    expect_len(op, "dx", &dx, shape.input_len(), "n·c·h·w")?;
    expect_row_within_loop_limit(gpu, op, shape.w, backward_iterations(shape))?;
    // A window's argmax, gate and dy, its cell's test and add.
    gpu.describe_serial_next(Serial::loop_of(backward_iterations(shape), 8));
    // Without a gate, dy stands in for it: a bind group fills every binding; the kernel ignores it.
    let params = Params { gated: gate.is_some() as u32, ..params };
    let bindings = [("dy", dy), ("argmax", argmax), ("dx", dx), ("gate", gate.unwrap_or(dy))];
    // One invocation per input row (n, c, iy).
    launch(
        gpu,
        enc,
        op,
        &SHADER,
        "maxpool_backward",
        &params,
        &bindings,
        grid_1d(shape.input_len() / shape.w as u64, WG),
    )
}

/// An invocation loops over a row of `cells`: refuse rows where llvmpipe would cut its
/// `iterations` short (at k = 3, forward rows of ~6500 cells and more) rather than return a
/// wrong result.
fn expect_row_within_loop_limit(
    gpu: &Gpu,
    op: &'static str,
    cells: u32,
    iterations: u64,
) -> Result<()> {
    expect_within_llvmpipe_loops(
        &gpu.info.name,
        op,
        "shape.w",
        iterations,
        || format!("has rows of {cells} cells"),
        "",
    )
}

/// At most how many times a backward invocation loops over its row: per chunk of
/// [`ROW_CHUNK`] cells, the windows covering it, then its cells.
fn backward_iterations(shape: &MaxPoolShape) -> u64 {
    let (k, stride) = (shape.k as u64, shape.stride as u64);
    let windows = k.div_ceil(stride) * ((ROW_CHUNK + k - 1).div_ceil(stride) + 1);
    (shape.w as u64).div_ceil(ROW_CHUNK) * (windows + ROW_CHUNK + 1)
}
