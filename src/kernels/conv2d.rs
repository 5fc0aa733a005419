//! Conv2d without bias: forward, input-VJP (a gather) and weight gradient, NCHW activations and
//! OIHW weights. See shaders/conv2d.wgsl for what is subtle.
//!
//! Each op has a plain kernel (`Conv2dAlgo::Direct`, one output element per invocation) and a
//! register-blocked one (`Conv2dAlgo::Blocked`, a 4×4 tile per invocation, the default). The
//! plain one stays as the fast one's test neighbour and as a fallback.

use super::{expect_len, expect_positive, launch, KernelError, Result};
use crate::gpu::{grid_1d, Gpu, Shader, Slice};

const SHADER: Shader = Shader { name: "conv2d", source: include_str!("../../shaders/conv2d.wgsl") };
const WG: u32 = 64;
/// The blocked kernels' tile edge: 4 channels × 4 pixels (or weights) per invocation.
const TILE: u64 = 4;

/// One convolution: input `[n, c_in, h, w]`, weights `[c_out, c_in, kh, kw]`, output
/// `[n, c_out, out_h, out_w]`, zero padding `pad` on every side, no bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dShape {
    pub n: u32,
    pub c_in: u32,
    pub h: u32,
    pub w: u32,
    pub c_out: u32,
    pub kh: u32,
    pub kw: u32,
    pub stride: u32,
    pub pad: u32,
}

/// Which kernels a launch records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Conv2dAlgo {
    /// One output element per invocation: the plain, obviously correct version.
    Direct,
    /// A 4×4 register tile per invocation, no workgroup memory: fast on CPU drivers and GPUs.
    #[default]
    Blocked,
}

fn out_size(size: u32, k: u32, stride: u32, pad: u32) -> u32 {
    ((size as u64 + 2 * pad as u64).saturating_sub(k as u64) / stride.max(1) as u64 + 1) as u32
}

impl Conv2dShape {
    /// `(h + 2·pad − kh) / stride + 1`; meaningful for a shape `validate` accepts.
    pub fn out_h(&self) -> u32 {
        out_size(self.h, self.kh, self.stride, self.pad)
    }
    /// `(w + 2·pad − kw) / stride + 1`; meaningful for a shape `validate` accepts.
    pub fn out_w(&self) -> u32 {
        out_size(self.w, self.kw, self.stride, self.pad)
    }
    /// Elements of the input (and of its gradient): n·c_in·h·w.
    pub fn x_len(&self) -> u64 {
        [self.n, self.c_in, self.h, self.w].iter().map(|&d| d as u64).product()
    }
    /// Elements of the weights (and of their gradient): c_out·c_in·kh·kw.
    pub fn w_len(&self) -> u64 {
        [self.c_out, self.c_in, self.kh, self.kw].iter().map(|&d| d as u64).product()
    }
    /// Elements of the output (and of its gradient): n·c_out·out_h·out_w.
    pub fn y_len(&self) -> u64 {
        [self.n, self.c_out, self.out_h(), self.out_w()].iter().map(|&d| d as u64).product()
    }
    /// Floating-point operations of the forward, a multiply-add counting 2; each backward
    /// (input or weight) does the same number.
    pub fn flops(&self) -> u64 {
        2 * self.y_len() * self.c_in as u64 * self.kh as u64 * self.kw as u64
    }

    /// Refuses a zero dimension, stride 0, a kernel larger than the padded input, and sizes the
    /// shaders' 32-bit signed index arithmetic cannot hold. `op` names the launch in the error.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        let dims = [
            ("n", self.n),
            ("c_in", self.c_in),
            ("h", self.h),
            ("w", self.w),
            ("c_out", self.c_out),
            ("kh", self.kh),
            ("kw", self.kw),
            ("stride", self.stride),
        ];
        for (arg, v) in dims {
            expect_positive(op, arg, v)?;
        }
        for (arg, k, size, axis) in [("kh", self.kh, self.h, "h"), ("kw", self.kw, self.w, "w")] {
            let padded = size as u64 + 2 * self.pad as u64;
            if k as u64 > padded {
                let problem = format!("is {k}, larger than the padded input {axis} + 2·pad = {padded}");
                return Err(KernelError::Arg { op, arg, problem });
            }
        }
        let limit = i32::MAX as u64;
        let sizes = [
            ("x", self.x_len(), "n·c_in·h·w"),
            ("w", self.w_len(), "c_out·c_in·kh·kw"),
            ("y", self.y_len(), "n·c_out·out_h·out_w"),
            ("pad", (self.h as u64 + 2 * self.pad as u64) * (self.w as u64 + 2 * self.pad as u64), "(h + 2·pad)·(w + 2·pad)"),
        ];
        for (arg, size, formula) in sizes {
            if size > limit {
                let problem = format!("gives {formula} = {size}, more than the shaders' 32-bit indices allow ({limit})");
                return Err(KernelError::Arg { op, arg, problem });
            }
        }
        Ok(())
    }

    fn params(&self) -> Params {
        Params {
            n: self.n,
            c_in: self.c_in,
            h: self.h,
            w: self.w,
            c_out: self.c_out,
            kh: self.kh,
            kw: self.kw,
            stride: self.stride,
            pad: self.pad,
            out_h: self.out_h(),
            out_w: self.out_w(),
            phase_y: 0,
            phase_x: 0,
            phase_h: 0,
            phase_w: 0,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    c_in: u32,
    h: u32,
    w: u32,
    c_out: u32,
    kh: u32,
    kw: u32,
    stride: u32,
    pad: u32,
    out_h: u32,
    out_w: u32,
    phase_y: u32,
    phase_x: u32,
    phase_h: u32,
    phase_w: u32,
}

/// Validates `shape` and each binding's length (inputs first, output last), before anything
/// is recorded; returns the bindings named as the shader orders them.
fn checked<'a>(
    op: &'static str,
    shape: &Conv2dShape,
    args: [(&'static str, Slice<'a>, u64, &str); 3],
) -> Result<[(&'static str, Slice<'a>); 3]> {
    shape.validate(op)?;
    for (name, s, len, formula) in &args {
        expect_len(op, name, s, *len, formula)?;
    }
    Ok(args.map(|(name, s, _, _)| (name, s)))
}

fn tiles(len: u64) -> u64 {
    len.div_ceil(TILE)
}

/// `y = conv(x, w)`: `x` [n,c_in,h,w], `w` [c_out,c_in,kh,kw], `y` [n,c_out,out_h,out_w]
/// (overwritten). Uses the blocked kernel.
pub fn conv2d_forward(gpu: &Gpu, enc: &mut wgpu::CommandEncoder, shape: &Conv2dShape, x: Slice, w: Slice, y: Slice) -> Result<()> {
    conv2d_forward_with(gpu, enc, Conv2dAlgo::Blocked, shape, x, w, y)
}

/// [`conv2d_forward`] with the kernel chosen by `algo`.
pub fn conv2d_forward_with(
    gpu: &Gpu,
    enc: &mut wgpu::CommandEncoder,
    algo: Conv2dAlgo,
    shape: &Conv2dShape,
    x: Slice,
    w: Slice,
    y: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_forward";
    let s = shape;
    let bindings = checked(
        OP,
        s,
        [("x", x, s.x_len(), "n·c_in·h·w"), ("w", w, s.w_len(), "c_out·c_in·kh·kw"), ("y", y, s.y_len(), "n·c_out·out_h·out_w")],
    )?;
    let (entry, threads) = match algo {
        Conv2dAlgo::Direct => ("conv2d_forward_direct", s.y_len()),
        Conv2dAlgo::Blocked => {
            ("conv2d_forward_blocked", tiles(s.c_out as u64) * tiles(s.n as u64 * s.out_h() as u64 * s.out_w() as u64))
        }
    };
    launch(gpu, enc, OP, &SHADER, entry, &s.params(), &bindings, grid_1d(threads, WG))
}

/// The input-VJP `dx = convᵀ(dy, w)`, a gather over output positions: `dy`
/// [n,c_out,out_h,out_w], `w` [c_out,c_in,kh,kw], `dx` [n,c_in,h,w] (overwritten). Uses the
/// blocked kernel, one dispatch per phase (iy mod stride, ix mod stride).
pub fn conv2d_backward_input(gpu: &Gpu, enc: &mut wgpu::CommandEncoder, shape: &Conv2dShape, dy: Slice, w: Slice, dx: Slice) -> Result<()> {
    conv2d_backward_input_with(gpu, enc, Conv2dAlgo::Blocked, shape, dy, w, dx)
}

/// [`conv2d_backward_input`] with the kernel chosen by `algo`.
pub fn conv2d_backward_input_with(
    gpu: &Gpu,
    enc: &mut wgpu::CommandEncoder,
    algo: Conv2dAlgo,
    shape: &Conv2dShape,
    dy: Slice,
    w: Slice,
    dx: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_backward_input";
    let s = shape;
    let bindings = checked(
        OP,
        s,
        [("dy", dy, s.y_len(), "n·c_out·out_h·out_w"), ("w", w, s.w_len(), "c_out·c_in·kh·kw"), ("dx", dx, s.x_len(), "n·c_in·h·w")],
    )?;
    if algo == Conv2dAlgo::Direct {
        return launch(gpu, enc, OP, &SHADER, "conv2d_backward_input_direct", &s.params(), &bindings, grid_1d(s.x_len(), WG));
    }
    // Phase (py, px) holds the pixels iy = py + stride·a < h, ix = px + stride·b < w.
    for phase_y in 0..s.stride.min(s.h) {
        for phase_x in 0..s.stride.min(s.w) {
            let phase_h = (s.h - phase_y).div_ceil(s.stride);
            let phase_w = (s.w - phase_x).div_ceil(s.stride);
            let params = Params { phase_y, phase_x, phase_h, phase_w, ..s.params() };
            let threads = tiles(s.c_in as u64) * tiles(s.n as u64 * phase_h as u64 * phase_w as u64);
            launch(gpu, enc, OP, &SHADER, "conv2d_backward_input_blocked", &params, &bindings, grid_1d(threads, WG))?;
        }
    }
    Ok(())
}

/// The weight gradient `dw = Σ_{n,oy,ox} dy ⊗ x-window`, summed in a fixed order: `dy`
/// [n,c_out,out_h,out_w], `x` [n,c_in,h,w], `dw` [c_out,c_in,kh,kw] (overwritten, not
/// accumulated). Uses the blocked kernel.
pub fn conv2d_backward_weight(gpu: &Gpu, enc: &mut wgpu::CommandEncoder, shape: &Conv2dShape, dy: Slice, x: Slice, dw: Slice) -> Result<()> {
    conv2d_backward_weight_with(gpu, enc, Conv2dAlgo::Blocked, shape, dy, x, dw)
}

/// [`conv2d_backward_weight`] with the kernel chosen by `algo`.
pub fn conv2d_backward_weight_with(
    gpu: &Gpu,
    enc: &mut wgpu::CommandEncoder,
    algo: Conv2dAlgo,
    shape: &Conv2dShape,
    dy: Slice,
    x: Slice,
    dw: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_backward_weight";
    let s = shape;
    let bindings = checked(
        OP,
        s,
        [("dy", dy, s.y_len(), "n·c_out·out_h·out_w"), ("x", x, s.x_len(), "n·c_in·h·w"), ("dw", dw, s.w_len(), "c_out·c_in·kh·kw")],
    )?;
    let (entry, threads) = match algo {
        Conv2dAlgo::Direct => ("conv2d_backward_weight_direct", s.w_len()),
        Conv2dAlgo::Blocked => {
            ("conv2d_backward_weight_blocked", tiles(s.c_out as u64) * tiles(s.c_in as u64 * s.kh as u64 * s.kw as u64))
        }
    };
    launch(gpu, enc, OP, &SHADER, entry, &s.params(), &bindings, grid_1d(threads, WG))
}
