//! Conv2d without bias: forward, input-VJP (a gather) and weight gradient, NCHW activations and
//! OIHW weights. See shaders/conv2d.wgsl for what is subtle.
//!
//! Each op has a plain kernel ([`Conv2dAlgo::Direct`], one output element per invocation) and a
//! register-blocked one ([`Conv2dAlgo::Blocked`], a register tile per invocation). All three also
//! run as an explicit GEMM over im2col rows: [`Conv2dAlgo::Gemm`] (register tiles, no workgroup
//! memory: for CPU drivers, where barriers are slow) and [`Conv2dAlgo::GemmShared`]
//! (workgroup-shared tiles: for GPUs); the weight gradient's GEMM reads the forward's im2col
//! rows against dy in place. Every variant sums each output in the same order, so they agree
//! bit for bit and the choice never changes a result.
//!
//! The plain launchers (`conv2d_forward`, …) run only the taps that read the input where
//! some read nothing but padding ([`Conv2dShape::crop`]), and pick the variant with
//! [`conv2d_algo`]: the `SYNCSTEP_CONV_ALGO` environment variable if set, else the fastest
//! candidate timed on the adapter at that shape on first use (natively; in a browser there is
//! no clock, so a guess by device type), remembered for the process and, natively, in a file
//! (see [`conv2d_algo`]). The `_with` launchers take the variant and the whole kernel.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, OnceLock};

use super::{
    expect_len, expect_positive, expect_within_llvmpipe_loops, launch, pairwise_levels,
    pairwise_shader, with_subgroup_index, KernelError, Result,
};
use crate::gpu::{grid_1d, Encoder, Gpu, Shader, Slice};

const SOURCE: &str = include_str!("../../shaders/conv2d.wgsl");
const SHADER: Shader = Shader { name: "conv2d", source: SOURCE };
const WG: u32 = 64;
/// The blocked kernels' tile edge: 4 channels × 4 pixels per invocation; the weight gradient's
/// tile is 4·TILE output × TILE input channels (WB_CO in the shader).
const TILE: u64 = 4;
/// vec4s one im2col or weight-rows invocation writes (`ROW_RUN` in the shader).
const ROW_RUN: u64 = 48;
/// conv2d_gemm_lanes' workgroup size and conv2d_gemm_shared's (with its tile edge).
const GEMM_WG: u32 = 64;
const SHARED_WG: u32 = 256;
const SHARED_EDGE: u64 = 64;
/// The im2col scratch buffer holds at most this many bytes (and no more than a storage binding
/// may): larger problems run in chunks of pixels.
const SCRATCH_BYTES: u64 = 64 << 20;
/// Pixels per chunk of the weight gradient's GEMM at most. Each invocation loops over a chunk's
/// pixels, and lavapipe (Mesa 22) silently ends an invocation's loops after 65535 iterations of
/// all of them together (LP_MAX_TGSI_LOOP_ITERATIONS): a chunk's pixels and output rows stay
/// below that, with the pairwise pushes' loops unrolled (a constant bound).
const WEIGHT_CHUNK_PIXELS: u64 = 16384;

/// One convolution: input `[n, c_in, h, w]`, weights `[c_out, c_in, kh, kw]`, output
/// `[n, c_out, out_h, out_w]`, zero padding `pad` on every side, no bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Conv2dAlgo {
    /// One output element per invocation: the plain, obviously correct version.
    Direct,
    /// A register tile per invocation (4 channels × 4 pixels; for the weight gradient 16 output
    /// × 4 input channels, tap by tap), no workgroup memory, no scratch.
    Blocked,
    /// im2col into a scratch buffer, then a GEMM with a register tile per invocation and no
    /// workgroup memory (CPU drivers).
    Gemm(GemmTile),
    /// im2col, then a GEMM with 64×64 tiles staged in workgroup memory between barriers
    /// (GPUs).
    GemmShared,
}

/// The register tile of [`Conv2dAlgo::Gemm`]: each invocation holds `per_invocation` rows of
/// one operand (pixels or channels, as `lanes` says), and the invocations of a workgroup share
/// `per_workgroup` rows of the other, so one invocation sums per_invocation × per_workgroup
/// outputs. Pixel lanes suit large feature maps; channel lanes suit the 1×1 and 2×2 maps of
/// the late stages, where a batch has few pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmTile {
    pub lanes: GemmLanes,
    pub per_invocation: u32,
    pub per_workgroup: u32,
}

/// What [`GemmTile`] spreads over invocations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmLanes {
    Pixels,
    Channels,
    /// Channels, with the weights read from w in place rather than from weight rows copied
    /// beforehand: the input-VJP only, where that copy (a transpose) costs as much as the GEMM
    /// when a batch has few pixels.
    ChannelsGather,
}

/// The tiles [`Conv2dAlgo::Gemm`] is compiled for; `SYNCSTEP_CONV_ALGO` names one as
/// `gemm-pixels-8x8` (`gemm-<lanes>-<per_invocation>x<per_workgroup>`, lanes `pixels`,
/// `channels` or `gather`). Measured on lavapipe at ResNet-34's shapes: Mesa 22 runs the large
/// tiles fastest, Mesa 25 the 4×8 and 8×4 ones (it spills past ~32 accumulators); channel lanes
/// win from 2×2 maps down, and the gathering input-VJP at 1×1 maps. The weight gradient uses
/// the same tiles with k (the weights' (ci, ky, kx), in vec4s of 4) in place of pixels, so a tile
/// holds as many outputs, each with a row and an example sum: on Mesa 22 (shared cores) the
/// autotune picked 8×8 and 12×8 tiles at 8² maps and up, 4×8 channel lanes below, and kept
/// Blocked for the stem, the 1×1 projections and some 1×1 maps.
pub const GEMM_TILES: [GemmTile; 13] = [
    GemmTile { lanes: GemmLanes::Pixels, per_invocation: 4, per_workgroup: 8 },
    GemmTile { lanes: GemmLanes::Pixels, per_invocation: 8, per_workgroup: 4 },
    GemmTile { lanes: GemmLanes::Pixels, per_invocation: 8, per_workgroup: 8 },
    GemmTile { lanes: GemmLanes::Pixels, per_invocation: 12, per_workgroup: 8 },
    GemmTile { lanes: GemmLanes::Channels, per_invocation: 4, per_workgroup: 8 },
    GemmTile { lanes: GemmLanes::Channels, per_invocation: 8, per_workgroup: 4 },
    GemmTile { lanes: GemmLanes::Channels, per_invocation: 8, per_workgroup: 8 },
    GemmTile { lanes: GemmLanes::Channels, per_invocation: 8, per_workgroup: 12 },
    GemmTile { lanes: GemmLanes::ChannelsGather, per_invocation: 4, per_workgroup: 8 },
    GemmTile { lanes: GemmLanes::ChannelsGather, per_invocation: 8, per_workgroup: 8 },
    // 16 rows shared by the workgroup: two loads and sixteen broadcasts where the device
    // broadcasts (Gpu::broadcasts); the autotune took them at layer1–3 on Mesa 25.
    GemmTile { lanes: GemmLanes::Pixels, per_invocation: 4, per_workgroup: 16 },
    GemmTile { lanes: GemmLanes::Channels, per_invocation: 4, per_workgroup: 16 },
    GemmTile { lanes: GemmLanes::ChannelsGather, per_invocation: 4, per_workgroup: 16 },
];

impl Conv2dAlgo {
    /// Every variant: what `SYNCSTEP_CONV_ALGO` accepts and what the tests run.
    pub fn all() -> Vec<Conv2dAlgo> {
        let mut all = vec![Conv2dAlgo::Direct, Conv2dAlgo::Blocked];
        all.extend(GEMM_TILES.iter().map(|&t| Conv2dAlgo::Gemm(t)));
        all.push(Conv2dAlgo::GemmShared);
        all
    }

    /// Parses the names `Display` writes: `direct`, `blocked`, `gemm-pixels-8x8`, `gemm-shared`.
    pub fn parse(name: &str) -> Option<Conv2dAlgo> {
        Conv2dAlgo::all().into_iter().find(|a| a.to_string() == name.trim().to_ascii_lowercase())
    }

    /// Whether `op` has a kernel of this variant: all do, but the gathering GEMM is the
    /// input-VJP's only.
    pub fn has(&self, op: Conv2dOp) -> bool {
        match self {
            Conv2dAlgo::Gemm(GemmTile { lanes: GemmLanes::ChannelsGather, .. }) => {
                op == Conv2dOp::BackwardInput
            }
            _ => true,
        }
    }
}

impl fmt::Display for Conv2dAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Conv2dAlgo::Direct => write!(f, "direct"),
            Conv2dAlgo::Blocked => write!(f, "blocked"),
            Conv2dAlgo::Gemm(t) => {
                let lanes = match t.lanes {
                    GemmLanes::Pixels => "pixels",
                    GemmLanes::Channels => "channels",
                    GemmLanes::ChannelsGather => "gather",
                };
                write!(f, "gemm-{lanes}-{}x{}", t.per_invocation, t.per_workgroup)
            }
            Conv2dAlgo::GemmShared => write!(f, "gemm-shared"),
        }
    }
}

/// The three launches of a convolution, for [`conv2d_algo`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Conv2dOp {
    Forward,
    BackwardInput,
    BackwardWeight,
}

impl Conv2dOp {
    /// The launcher's name, as errors and profiles give it.
    pub fn name(self) -> &'static str {
        match self {
            Conv2dOp::Forward => "conv2d_forward",
            Conv2dOp::BackwardInput => "conv2d_backward_input",
            Conv2dOp::BackwardWeight => "conv2d_backward_weight",
        }
    }

    /// The launcher's two inputs and its output, in its order: name and length formula.
    fn operands(self) -> [(&'static str, &'static str); 3] {
        const X: &str = "n·c_in·h·w";
        const W: &str = "c_out·c_in·kh·kw";
        const Y: &str = "n·c_out·out_h·out_w";
        match self {
            Conv2dOp::Forward => [("x", X), ("w", W), ("y", Y)],
            Conv2dOp::BackwardInput => [("dy", Y), ("w", W), ("dx", X)],
            Conv2dOp::BackwardWeight => [("dy", Y), ("x", X), ("dw", W)],
        }
    }
}

/// The taps of a kernel that read inside the input for some output, where that is not all of
/// them: `shape` is the convolution of those taps alone, whose first row and column are
/// (`ky`, `kx`) of the whole kernel. See [`Conv2dShape::crop`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Crop {
    pub ky: u32,
    pub kx: u32,
    pub shape: Conv2dShape,
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
    /// Elements of `op`'s two inputs and its output, in [`conv2d_launch_with`]'s order.
    pub fn operand_lens(&self, op: Conv2dOp) -> [u64; 3] {
        match op {
            Conv2dOp::Forward => [self.x_len(), self.w_len(), self.y_len()],
            Conv2dOp::BackwardInput => [self.y_len(), self.w_len(), self.x_len()],
            Conv2dOp::BackwardWeight => [self.y_len(), self.x_len(), self.w_len()],
        }
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

    /// On maps smaller than the kernel's reach some taps read padding for every output:
    /// ResNet-34's 3×3 convolutions on the 1×1 maps of layer4 at a 32² input read only their
    /// centre tap. The convolution of the other taps (a smaller kernel with less padding and the
    /// same output size) has the same nonzero terms in the same order, and the dropped taps'
    /// weight gradient is +0, which is what every variant sums there. So the plain launchers
    /// run that one, and skip 8/9 of layer4's arithmetic. None where every tap reads the input
    /// somewhere, or where the kept taps would need a padding one `pad` cannot express (rows
    /// and columns cropped differently). Meaningful for a shape `validate` accepts.
    pub fn crop(&self) -> Option<Crop> {
        // Tap t of an axis reads input o·stride − pad + t for outputs o < out. Kept: from the
        // first tap that reads inside for some o to the last (with stride > 1 a tap between
        // may read only padding, and is kept).
        let axis = |size: u32, k: u32, out: u32| {
            let reads = |&t: &u32| {
                (0..out as i64).any(|o| {
                    (0..size as i64)
                        .contains(&(o * self.stride as i64 - self.pad as i64 + t as i64))
                })
            };
            let first = (0..k).find(reads)?;
            let last = (0..k).rev().find(reads)?;
            Some((first, last + 1 - first))
        };
        let (ky, kh) = axis(self.h, self.kh, self.out_h())?;
        let (kx, kw) = axis(self.w, self.kw, self.out_w())?;
        let shape = Conv2dShape { kh, kw, pad: self.pad - ky, ..*self };
        let expressible =
            ky == kx && shape.out_h() == self.out_h() && shape.out_w() == self.out_w();
        ((kh, kw) != (self.kh, self.kw) && expressible).then_some(Crop { ky, kx, shape })
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
                let problem =
                    format!("is {k}, larger than the padded input {axis} + 2·pad = {padded}");
                return Err(KernelError::Arg { op, arg, problem });
            }
        }
        let limit = i32::MAX as u64;
        let sizes = [
            ("x", self.x_len(), "n·c_in·h·w"),
            ("w", self.w_len(), "c_out·c_in·kh·kw"),
            ("y", self.y_len(), "n·c_out·out_h·out_w"),
            (
                "pad",
                (self.h as u64 + 2 * self.pad as u64) * (self.w as u64 + 2 * self.pad as u64),
                "(h + 2·pad)·(w + 2·pad)",
            ),
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
            row_begin: 0,
            row_count: 0,
            row4: 0,
            crop_y: 0,
            crop_x: 0,
            crop_h: 0,
            crop_w: 0,
            dw_kh: self.kh,
            dw_kw: self.kw,
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
    row_begin: u32,
    row_count: u32,
    row4: u32,
    crop_y: u32,
    crop_x: u32,
    crop_h: u32,
    crop_w: u32,
    dw_kh: u32,
    dw_kw: u32,
}

/// Validates `shape` and each binding's length (inputs first, output last), before anything
/// is recorded; returns the bindings named as the shader orders them.
fn checked<'a>(
    op: Conv2dOp,
    shape: &Conv2dShape,
    slices: [Slice<'a>; 3],
) -> Result<[(&'static str, Slice<'a>); 3]> {
    shape.validate(op.name())?;
    let (names, lens) = (op.operands(), shape.operand_lens(op));
    for i in 0..3 {
        expect_len(op.name(), names[i].0, &slices[i], lens[i], names[i].1)?;
    }
    Ok([0, 1, 2].map(|i| (names[i].0, slices[i])))
}

fn tiles(len: u64) -> u64 {
    len.div_ceil(TILE)
}

/// `y = conv(x, w)`: `x` [n,c_in,h,w], `w` [c_out,c_in,kh,kw], `y` [n,c_out,out_h,out_w]
/// (overwritten). The variant is [`conv2d_algo`]'s choice.
pub fn conv2d_forward(
    gpu: &Gpu,
    enc: &mut Encoder,
    shape: &Conv2dShape,
    x: Slice,
    w: Slice,
    y: Slice,
) -> Result<()> {
    conv2d_launch(gpu, enc, Conv2dOp::Forward, shape, x, w, y)
}

/// [`conv2d_forward`] with the kernel chosen by `algo`.
pub fn conv2d_forward_with(
    gpu: &Gpu,
    enc: &mut Encoder,
    algo: Conv2dAlgo,
    shape: &Conv2dShape,
    x: Slice,
    w: Slice,
    y: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_forward";
    let s = shape;
    let bindings = checked(Conv2dOp::Forward, s, [x, w, y])?;
    let (entry, threads) = match algo {
        Conv2dAlgo::Direct => ("conv2d_forward_direct", s.y_len()),
        Conv2dAlgo::Blocked => (
            "conv2d_forward_blocked",
            tiles(s.c_out as u64) * tiles(s.n as u64 * s.out_h() as u64 * s.out_w() as u64),
        ),
        Conv2dAlgo::Gemm(_) | Conv2dAlgo::GemmShared if algo.has(Conv2dOp::Forward) => {
            return forward_gemm(gpu, enc, algo, s, x, w, y)
        }
        Conv2dAlgo::Gemm(_) | Conv2dAlgo::GemmShared => return Err(no_kernel(OP, algo)),
    };
    launch(gpu, enc, OP, &SHADER, entry, &s.params(), &bindings, grid_1d(threads, WG))
}

/// The input-VJP `dx = convᵀ(dy, w)`, a gather over output positions: `dy`
/// [n,c_out,out_h,out_w], `w` [c_out,c_in,kh,kw], `dx` [n,c_in,h,w] (overwritten). The
/// variant is [`conv2d_algo`]'s choice.
pub fn conv2d_backward_input(
    gpu: &Gpu,
    enc: &mut Encoder,
    shape: &Conv2dShape,
    dy: Slice,
    w: Slice,
    dx: Slice,
) -> Result<()> {
    conv2d_launch(gpu, enc, Conv2dOp::BackwardInput, shape, dy, w, dx)
}

/// [`conv2d_backward_input`] with the kernel chosen by `algo`. All but Direct run once per
/// phase (iy mod stride, ix mod stride).
pub fn conv2d_backward_input_with(
    gpu: &Gpu,
    enc: &mut Encoder,
    algo: Conv2dAlgo,
    shape: &Conv2dShape,
    dy: Slice,
    w: Slice,
    dx: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_backward_input";
    let s = shape;
    let bindings = checked(Conv2dOp::BackwardInput, s, [dy, w, dx])?;
    if algo == Conv2dAlgo::Direct {
        return launch(
            gpu,
            enc,
            OP,
            &SHADER,
            "conv2d_backward_input_direct",
            &s.params(),
            &bindings,
            grid_1d(s.x_len(), WG),
        );
    }
    // Phase (py, px) holds the pixels iy = py + stride·a < h, ix = px + stride·b < w.
    let phases =
        (0..s.stride.min(s.h)).flat_map(|py| (0..s.stride.min(s.w)).map(move |px| (py, px)));
    let tapless = |(py, px): (u32, u32)| phase_taps(py, s.kh, s) * phase_taps(px, s.kw, s) == 0;
    // The GEMMs zero the phases no tap reaches (1×1 kernels at stride 2) with one clear of dx
    // rather than a GEMM each, where dx's buffer allows it (clears need COPY_DST).
    let cleared = algo != Conv2dAlgo::Blocked
        && phases.clone().any(tapless)
        && dx.buffer.usage().contains(wgpu::BufferUsages::COPY_DST);
    if cleared {
        enc.clear_buffer(dx.buffer, dx.offset, Some(dx.bytes()));
    }
    for (phase_y, phase_x) in phases {
        let phase_h = (s.h - phase_y).div_ceil(s.stride);
        let phase_w = (s.w - phase_x).div_ceil(s.stride);
        let params = Params { phase_y, phase_x, phase_h, phase_w, ..s.params() };
        if algo == Conv2dAlgo::Blocked {
            let threads =
                tiles(s.c_in as u64) * tiles(s.n as u64 * phase_h as u64 * phase_w as u64);
            launch(
                gpu,
                enc,
                OP,
                &SHADER,
                "conv2d_backward_input_blocked",
                &params,
                &bindings,
                grid_1d(threads, WG),
            )?;
        } else if !(cleared && tapless((phase_y, phase_x))) {
            backward_input_gemm_phase(gpu, enc, algo, s, params, dy, w, dx)?;
        }
    }
    Ok(())
}

/// The weight gradient `dw = Σ_{n,oy,ox} dy ⊗ x-window`, summed in a fixed order: `dy`
/// [n,c_out,out_h,out_w], `x` [n,c_in,h,w], `dw` [c_out,c_in,kh,kw] (overwritten, not
/// accumulated). The variant is [`conv2d_algo`]'s choice.
pub fn conv2d_backward_weight(
    gpu: &Gpu,
    enc: &mut Encoder,
    shape: &Conv2dShape,
    dy: Slice,
    x: Slice,
    dw: Slice,
) -> Result<()> {
    conv2d_launch(gpu, enc, Conv2dOp::BackwardWeight, shape, dy, x, dw)
}

/// [`conv2d_backward_weight`] with the kernel chosen by `algo`.
pub fn conv2d_backward_weight_with(
    gpu: &Gpu,
    enc: &mut Encoder,
    algo: Conv2dAlgo,
    shape: &Conv2dShape,
    dy: Slice,
    x: Slice,
    dw: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_backward_weight";
    let s = shape;
    let bindings = checked(Conv2dOp::BackwardWeight, s, [dy, x, dw])?;
    if matches!(algo, Conv2dAlgo::Direct | Conv2dAlgo::Blocked) {
        expect_within_loop_limit(&gpu.info.name, OP, algo, s)?;
    }
    let (entry, threads) = match algo {
        Conv2dAlgo::Direct => ("conv2d_backward_weight_direct", s.w_len()),
        Conv2dAlgo::Blocked => return backward_weight_blocked(gpu, enc, s, dy, x, dw, None),
        Conv2dAlgo::Gemm(_) | Conv2dAlgo::GemmShared if algo.has(Conv2dOp::BackwardWeight) => {
            return backward_weight_gemm(gpu, enc, algo, s, dy, x, dw)
        }
        Conv2dAlgo::Gemm(_) | Conv2dAlgo::GemmShared => return Err(no_kernel(OP, algo)),
    };
    launch(
        gpu,
        enc,
        OP,
        &pairwise_shader(&SHADER, s.n),
        entry,
        &s.params(),
        &bindings,
        grid_1d(threads, WG),
    )
}

/// The Blocked weight gradient of `s` into `dw` [c_out, c_in, kh, kw]; or, with `into` = (the
/// whole shape, its crop) and `s` the cropped shape, straight into the kept taps of the whole
/// kernel's `dw`, leaving the other taps as they are.
fn backward_weight_blocked(
    gpu: &Gpu,
    enc: &mut Encoder,
    s: &Conv2dShape,
    dy: Slice,
    x: Slice,
    dw: Slice,
    into: Option<(&Conv2dShape, &Crop)>,
) -> Result<()> {
    const OP: &str = "conv2d_backward_weight";
    let bindings =
        checked(Conv2dOp::BackwardWeight, into.map_or(s, |(whole, _)| whole), [dy, x, dw])?;
    expect_within_loop_limit(&gpu.info.name, OP, Conv2dAlgo::Blocked, s)?;
    let params = match into {
        Some((whole, crop)) => Params {
            crop_y: crop.ky,
            crop_x: crop.kx,
            dw_kh: whole.kh,
            dw_kw: whole.kw,
            ..s.params()
        },
        None => s.params(),
    };
    // Workgroups of WB_LANES input-channel tiles, one tile of WB_CO output channels each.
    const WB_LANES: u64 = 16;
    const WB_CO: u64 = 4 * TILE;
    let workgroups = (s.c_out as u64).div_ceil(WB_CO) * tiles(s.c_in as u64).div_ceil(WB_LANES);
    // Closing the examples' sum at the last saves a level of the pairwise stack where count − 1
    // needs fewer than count (see pairwise_push_or_close4).
    let close = pairwise_levels(s.n - 1) < pairwise_levels(s.n);
    let shader = blocked_weight_shader(gpu.broadcasts, close);
    launch(
        gpu,
        enc,
        OP,
        &pairwise_shader(&shader, if close { s.n - 1 } else { s.n }),
        "conv2d_backward_weight_blocked",
        &params,
        &bindings,
        grid_1d(workgroups, 1),
    )
}

/// conv2d.wgsl as the Blocked weight gradient runs it: broadcasting dy or not, closing the
/// examples' pairwise sum at the last (WB_CLOSE) or not.
fn blocked_weight_shader(broadcasts: bool, close: bool) -> Shader {
    static SHADERS: OnceLock<Mutex<HashMap<(bool, bool), Shader>>> = OnceLock::new();
    let mut shaders =
        SHADERS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    *shaders.entry((broadcasts, close)).or_insert_with(|| {
        let base = if broadcasts { broadcast_shader() } else { SHADER };
        if !close {
            return base;
        }
        let source =
            base.source.replace("const WB_CLOSE: bool = false;", "const WB_CLOSE: bool = true;");
        let name = format!("{}_close", base.name);
        Shader {
            name: Box::leak(name.into_boxed_str()),
            source: Box::leak(source.into_boxed_str()),
        }
    })
}

/// conv2d.wgsl for devices that broadcast (`Gpu::broadcasts`): the Blocked weight gradient's dy
/// reads (BEGIN DY … END DY) as two loads per subgroup invocation, of output channels
/// co0 + its index mod 8 and 8 more, and a subgroupBroadcast of each of the 16 to all. The same
/// values: the same bits.
fn broadcast_shader() -> Shader {
    static SHADER_BROADCAST: OnceLock<Shader> = OnceLock::new();
    *SHADER_BROADCAST.get_or_init(|| {
        let (begin, end) = ("                    // BEGIN DY conv2d_backward_weight_blocked\n", "                    // END DY conv2d_backward_weight_blocked\n");
        let at = |marker: &str| SOURCE.find(marker).unwrap_or_else(|| panic!("conv2d.wgsl has `{}`", marker.trim()));
        let (b, e) = (at(begin), at(end) + end.len());
        let mut lines = vec![begin.trim_end().to_string()];
        for (m, first) in [(0, ""), (1, " + 8u")] {
            lines.push(format!("                    let m{m} = wb_dy[pix + min(co0{first} + sid % 8u, p.c_out - 1u) * ohw];"));
        }
        for (g, name) in ["da", "db", "dc", "dd"].iter().enumerate() {
            let lanes: Vec<String> = (0..4).map(|i| format!("subgroupBroadcast(m{}, {}u)", g / 2, 4 * (g % 2) + i)).collect();
            lines.push(format!("                    let {name} = vec4<f32>({});", lanes.join(", ")));
        }
        lines.push(end.trim_end().to_string());
        let source = format!("{}{}\n{}", &SOURCE[..b], lines.join("\n"), &SOURCE[e..]);
        Shader { name: "conv2d_broadcast", source: Box::leak(with_subgroup_index(&source, "conv2d_backward_weight_blocked").into_boxed_str()) }
    })
}

/// Direct and Blocked weight gradients loop over every output pixel of every example in one
/// invocation, Blocked once per tap: refuse them where llvmpipe would cut those loops short (the
/// stem at 224², N=8; Blocked at maps of ~90² and up) rather than return a wrong gradient. The
/// autotune then takes a GEMM, whose chunks stay short.
fn expect_within_loop_limit(
    adapter: &str,
    op: &'static str,
    algo: Conv2dAlgo,
    s: &Conv2dShape,
) -> Result<()> {
    // Row loop, pixel loop and the pairwise stack's levels, per example (at most: Blocked
    // skips the rows and columns a tap reads only padding for).
    let per_tap = s.n as u64 * (s.out_h() as u64 * (s.out_w() as u64 + 1) + 1 + 32);
    let iterations = if algo == Conv2dAlgo::Blocked {
        s.kh as u64 * s.kw as u64 * (per_tap + 1)
    } else {
        per_tap
    };
    expect_within_llvmpipe_loops(
        adapter,
        op,
        "algo",
        iterations,
        || format!("is {algo}"),
        ": use a gemm variant",
    )
}

/// Records `op` with `algo`: forward (x, w → y), input-VJP (dy, w → dx) or weight gradient
/// (dy, x → dw), for callers that take the op as a value (the autotune, `syncstep bench`).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_launch_with(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: Conv2dOp,
    algo: Conv2dAlgo,
    shape: &Conv2dShape,
    a: Slice,
    b: Slice,
    out: Slice,
) -> Result<()> {
    match op {
        Conv2dOp::Forward => conv2d_forward_with(gpu, enc, algo, shape, a, b, out),
        Conv2dOp::BackwardInput => conv2d_backward_input_with(gpu, enc, algo, shape, a, b, out),
        Conv2dOp::BackwardWeight => conv2d_backward_weight_with(gpu, enc, algo, shape, a, b, out),
    }
}

/// `op` as the plain launchers run it: on the cropped kernel where [`Conv2dShape::crop`] finds
/// one, with [`conv2d_algo`]'s variant for the shape it runs (see [`conv2d_choice`]).
pub fn conv2d_launch(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: Conv2dOp,
    shape: &Conv2dShape,
    a: Slice,
    b: Slice,
    out: Slice,
) -> Result<()> {
    checked(op, shape, [a, b, out])?;
    // The weight gradient's dropped taps are zeroed by a clear, which needs COPY_DST.
    let clearable =
        op != Conv2dOp::BackwardWeight || out.buffer.usage().contains(wgpu::BufferUsages::COPY_DST);
    let (algo, crop) = if clearable {
        conv2d_choice(gpu, op, shape)?
    } else {
        (conv2d_algo(gpu, op, shape)?, None)
    };
    conv2d_launch_cropped(gpu, enc, op, algo, shape, crop.as_ref(), a, b, out)
}

/// `op` with `algo` run on `crop` (from `shape.crop()`; None: the whole kernel), as
/// [`conv2d_launch`] runs its choice. A cropped weight gradient needs `out` with COPY_DST.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_launch_cropped(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: Conv2dOp,
    algo: Conv2dAlgo,
    shape: &Conv2dShape,
    crop: Option<&Crop>,
    a: Slice,
    b: Slice,
    out: Slice,
) -> Result<()> {
    let [_, (_, w), _] = checked(op, shape, [a, b, out])?;
    let Some(crop) = crop else { return conv2d_launch_with(gpu, enc, op, algo, shape, a, b, out) };
    if op == Conv2dOp::BackwardWeight {
        // The dropped taps' gradient is +0: a clear, then the kept taps' kernel.
        if !out.buffer.usage().contains(wgpu::BufferUsages::COPY_DST) {
            return Err(KernelError::Arg {
                op: op.name(),
                arg: "dw",
                problem: "needs COPY_DST to run on a cropped kernel (its dropped taps are cleared)"
                    .to_string(),
            });
        }
        enc.clear_buffer(out.buffer, out.offset, Some(out.bytes()));
        if algo == Conv2dAlgo::Blocked {
            return backward_weight_blocked(gpu, enc, &crop.shape, a, b, out, Some((shape, crop)));
        }
    }
    let kept_len = crop.shape.w_len();
    let kept = gpu
        .scratch("conv2d kept taps", kept_len)
        .map_err(|source| KernelError::Gpu { op: op.name(), source })?;
    let kept = Slice::new(&kept, 0, kept_len);
    if op == Conv2dOp::BackwardWeight {
        conv2d_launch_with(gpu, enc, op, algo, &crop.shape, a, b, kept)?;
        launch(
            gpu,
            enc,
            op.name(),
            &SHADER,
            "conv2d_uncrop_weight_gradient",
            &crop_params(shape, crop),
            &[("kept taps' dw", kept), ("dw", out)],
            crop_grid(shape),
        )
    } else {
        crop_weights(gpu, enc, shape, crop, w, kept)?;
        conv2d_launch_with(gpu, enc, op, algo, &crop.shape, a, kept, out)
    }
}

/// Copies the kept taps of `crop` (`shape.crop()`) out of the whole kernel `w` into `kept`
/// (`crop.shape.w_len()` elements), for [`conv2d_launch_kept`]. The plain launchers copy on
/// every call; a step copies once for a convolution's forward and input-VJP.
pub fn crop_weights(
    gpu: &Gpu,
    enc: &mut Encoder,
    shape: &Conv2dShape,
    crop: &Crop,
    w: Slice,
    kept: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_crop_weights";
    shape.validate(OP)?;
    expect_len(OP, "w", &w, shape.w_len(), "c_out·c_in·kh·kw")?;
    expect_len(OP, "kept", &kept, crop.shape.w_len(), "c_out·c_in times the kept taps")?;
    launch(
        gpu,
        enc,
        OP,
        &SHADER,
        OP,
        &crop_params(shape, crop),
        &[("w", w), ("kept", kept)],
        crop_grid(shape),
    )
}

/// The forward or input-VJP as [`conv2d_launch`] runs it on a cropped kernel, from the kept
/// taps' weights [`crop_weights`] copied: `a` is x or dy, `out` y or dx of the whole shape.
pub fn conv2d_launch_kept(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: Conv2dOp,
    crop: &Crop,
    a: Slice,
    kept: Slice,
    out: Slice,
) -> Result<()> {
    if op == Conv2dOp::BackwardWeight {
        return Err(KernelError::Arg {
            op: op.name(),
            arg: "op",
            problem: "reads no weights: use conv2d_launch".to_string(),
        });
    }
    conv2d_launch_with(gpu, enc, op, conv2d_algo(gpu, op, &crop.shape)?, &crop.shape, a, kept, out)
}

/// The crop kernels' parameters: the whole kernel's shape, and where the kept taps sit in it.
fn crop_params(shape: &Conv2dShape, crop: &Crop) -> Params {
    Params {
        crop_y: crop.ky,
        crop_x: crop.kx,
        crop_h: crop.shape.kh,
        crop_w: crop.shape.kw,
        ..shape.params()
    }
}

/// One crop-kernel invocation per `CROP_RUN` (output channel, input channel) pairs.
fn crop_grid(shape: &Conv2dShape) -> [u32; 3] {
    const CROP_RUN: u64 = 16; // as in conv2d.wgsl
    grid_1d((shape.c_out as u64 * shape.c_in as u64).div_ceil(CROP_RUN), WG)
}

/// What [`conv2d_launch`] runs for `op` at `shape`: the variant, and the crop it runs it on
/// (None: the whole kernel). A weight gradient into a buffer without COPY_DST is not cropped.
pub fn conv2d_choice(
    gpu: &Gpu,
    op: Conv2dOp,
    shape: &Conv2dShape,
) -> Result<(Conv2dAlgo, Option<Crop>)> {
    shape.validate(op.name())?;
    let crop = shape.crop();
    Ok((conv2d_algo(gpu, op, crop.as_ref().map_or(shape, |c| &c.shape))?, crop))
}

fn no_kernel(op: &'static str, algo: Conv2dAlgo) -> KernelError {
    KernelError::Arg { op, arg: "algo", problem: format!("is {algo}, which has no {op} kernel") }
}

// ---------------------------------------------------------------------------------------------
// The GEMM variants.

/// The compiled-in variants of conv2d.wgsl: (tile rows per invocation, per workgroup, broadcast).
type TileShaders = Mutex<HashMap<(u32, u32, bool), Shader>>;

/// conv2d.wgsl for one tile of the conv2d_gemm_* kernels with register tiles: the tile constants
/// and the bodies between BEGIN TILE and END TILE replaced, the forward's and input-VJP's
/// broadcasting their shared rows where `broadcasts`. Compiled once per tile and mode (the
/// pipeline cache is keyed by the shader's name).
fn gemm_lanes_shader(tile: GemmTile, broadcasts: bool) -> Shader {
    static SHADERS: OnceLock<TileShaders> = OnceLock::new();
    let (a, b) = (tile.per_invocation, tile.per_workgroup);
    let mut shaders =
        SHADERS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    *shaders.entry((a, b, broadcasts)).or_insert_with(|| {
        let source = TileKernel::ALL.into_iter().fold(SOURCE.to_string(), |source, kernel| {
            let (begin, end) = tile_block(&source, kernel);
            let body = gemm_tile(kernel, a, b, broadcasts && kernel.broadcasts());
            let source = format!("{}{}{}", &source[..begin], body, &source[end..]);
            if broadcasts && kernel.broadcasts() {
                with_subgroup_index(&source, kernel.entry())
            } else {
                source
            }
        });
        let source = source
            .replace("const GEMM_A: u32 = 4u;", &format!("const GEMM_A: u32 = {a}u;"))
            .replace("const GEMM_B: u32 = 4u;", &format!("const GEMM_B: u32 = {b}u;"))
            .replace(
                "const GEMM_BROADCAST: bool = false;",
                &format!("const GEMM_BROADCAST: bool = {broadcasts};"),
            );
        let name = format!("conv2d_gemm_{a}x{b}{}", if broadcasts { "_broadcast" } else { "" });
        Shader {
            name: Box::leak(name.into_boxed_str()),
            source: Box::leak(source.into_boxed_str()),
        }
    })
}

/// The kernels whose tile bodies are written out per tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TileKernel {
    Lanes,
    Gather,
    WeightPixels,
    WeightChannels,
}

impl TileKernel {
    const ALL: [TileKernel; 4] = [
        TileKernel::Lanes,
        TileKernel::Gather,
        TileKernel::WeightPixels,
        TileKernel::WeightChannels,
    ];

    /// Whether the tile's shared rows (b) can be broadcast (`Gpu::broadcasts`): the GEMMs of the
    /// forward and input-VJP, and the weight gradient's whose workgroup shares output channels
    /// (its dy values).
    fn broadcasts(self) -> bool {
        matches!(self, TileKernel::Lanes | TileKernel::Gather | TileKernel::WeightPixels)
    }

    fn entry(self) -> &'static str {
        match self {
            TileKernel::Lanes => "conv2d_gemm_lanes",
            TileKernel::Gather => "conv2d_gemm_gather",
            TileKernel::WeightPixels => "conv2d_gemm_weight_pixels",
            TileKernel::WeightChannels => "conv2d_gemm_weight_channels",
        }
    }
}

/// Where `kernel`'s tile body starts and ends in `source` (the END TILE line included).
fn tile_block(source: &str, kernel: TileKernel) -> (usize, usize) {
    let (begin, end) = (
        format!("    // BEGIN TILE {}", kernel.entry()),
        format!("    // END TILE {}\n", kernel.entry()),
    );
    let begin = source
        .find(&begin)
        .unwrap_or_else(|| panic!("conv2d.wgsl marks {}'s tile body", kernel.entry()));
    (
        begin,
        source.find(&end).unwrap_or_else(|| {
            panic!("conv2d.wgsl marks the end of {}'s tile body", kernel.entry())
        }) + end.len(),
    )
}

/// `kernel`'s body for an `a`×`b` tile, written out with a variable per output: CPU drivers run
/// a loop as a SIMD loop under a lane mask, which keeps an array it indexes in memory.
fn gemm_tile(kernel: TileKernel, a: u32, b: u32, broadcast: bool) -> String {
    let mut lines = vec![
        format!("    // BEGIN TILE {}: the body for GEMM_A × GEMM_B = {a} × {b}, as gemm_tile in", kernel.entry()),
        "    // src/kernels/conv2d.rs writes it for every tile: unrolled, with a variable per output.".into(),
    ];
    match kernel {
        TileKernel::Lanes | TileKernel::Gather => {
            lines.extend(gemm_tile_body(kernel, a, b, broadcast))
        }
        TileKernel::WeightPixels => lines.extend(gemm_weight_tile_body(b, a / 4, broadcast)),
        TileKernel::WeightChannels => lines.extend(gemm_weight_tile_body(a, b / 4, false)),
    }
    lines.push(format!("    // END TILE {}", kernel.entry()));
    lines.join("\n") + "\n"
}

/// One line per `i` of `rows`, each the statements `f(i, j)` for `j` of `cols`, at `indent`.
fn unrolled(indent: &str, rows: u32, cols: u32, f: impl Fn(u32, u32) -> String) -> Vec<String> {
    (0..rows)
        .map(|i| format!("{indent}{}", (0..cols).map(|j| f(i, j)).collect::<Vec<_>>().join(" ")))
        .collect()
}

/// conv2d_gemm_lanes' and conv2d_gemm_gather's tile: outputs s{i}_{j}, a row i of a by a row j
/// of b, summed over k.
/// With `broadcast`, the workgroup's rows of b are not loaded by every invocation: row j by those
/// whose subgroup index is j mod 8 (one load each per 8 rows), then subgroupBroadcast to all.
fn gemm_tile_body(kernel: TileKernel, a: u32, b: u32, broadcast: bool) -> Vec<String> {
    let mut lines = Vec::new();
    if broadcast {
        // Lanes past a's edge stay for their subgroup's broadcasts, but a subgroup wholly past it
        // has no work: at a batch of 8 half the invocations of layer2's workgroups are there.
        lines.push("    if (subgroupAll(i0 >= g.rows_a)) { return; }".into());
    }
    lines.extend(
        (0..a).map(|i| format!("    let a{i} = min(i0 + {i}u, g.rows_a - 1u) * g.a_stride;")),
    );
    let loads = b.div_ceil(8);
    if broadcast {
        lines.extend((0..loads).map(|k| {
            format!("    let bl{k} = min(j0 + {}u + sid % 8u, g.rows_b - 1u) * g.row4;", 8 * k)
        }));
    } else {
        lines.extend(
            (0..b).map(|j| format!("    let b{j} = min(j0 + {j}u, g.rows_b - 1u) * g.row4;")),
        );
    }
    lines.extend(unrolled("    ", a, b, |i, j| format!("var s{i}_{j} = 0.0;")));
    lines.push("    for (var v = 0u; v < g.row4; v++) {".into());
    if broadcast {
        lines.extend((0..loads).map(|k| format!("        let bm{k} = gl_b[bl{k} + v];")));
        lines.extend(
            (0..b).map(|j| {
                format!("        let bv{j} = subgroupBroadcast(bm{}, {}u);", j / 8, j % 8)
            }),
        );
    } else {
        lines.extend((0..b).map(|j| format!("        let bv{j} = gl_b[b{j} + v];")));
    }
    if kernel == TileKernel::Gather {
        lines.push("        let tap = gg_taps[v];".into());
        lines.push("        let live = tap != vec4<u32>(0xffffffffu);".into());
        lines.push("        let at = select(vec4<u32>(0u), tap, live);".into());
    }
    for i in 0..a {
        lines.push(match kernel {
            TileKernel::Gather => format!(
                "        let av{i} = select(vec4<f32>(0.0), vec4<f32>(gg_w[a{i} + at.x], gg_w[a{i} + at.y], gg_w[a{i} + at.z], gg_w[a{i} + at.w]), live);"
            ),
            _ => format!("        let av{i} = gl_a[a{i} + v];"),
        });
        lines.extend((0..b).map(|j| {
            let term = |c: char| format!("s{i}_{j} += av{i}.{c} * bv{j}.{c};");
            format!("        {} {} {} {}", term('x'), term('y'), term('z'), term('w'))
        }));
    }
    lines.push("    }".into());
    // Output offsets: the first row's by division, each next one by a step from it.
    let rows = |name: char, first: &str, of_a: bool, count: u32| -> Vec<String> {
        (0..count)
            .map(|i| match i {
                0 => format!("    let o{name}0 = gemm_out_first({first}, {of_a});"),
                i => format!("    let o{name}{i} = gemm_out_next(o{name}{}, {of_a});", i - 1),
            })
            .collect()
    };
    lines.extend(rows('a', "i0", true, a));
    lines.extend(rows('b', "j0", false, b));
    lines.extend(unrolled("    ", a, b, |i, j| {
        format!("gemm_lanes_store(i0 + {i}u, j0 + {j}u, oa{i}.at + ob{j}.at, s{i}_{j});")
    }));
    lines
}

/// conv2d_gemm_weight_*'s tile: `channels` output channels from co0 × `quads` vec4s of k from
/// kv0; per output (vec4) s{c}_{v}, the sum over the current output row, and e{c}_{v}, over the
/// current example.
/// With `broadcast` (the workgroup shares the channels), channel c's dy is loaded by the
/// invocations whose subgroup index is c mod 8 and broadcast, as in gemm_tile_body.
fn gemm_weight_tile_body(channels: u32, quads: u32, broadcast: bool) -> Vec<String> {
    let mut lines: Vec<String> =
        (0..quads).map(|v| format!("    let k{v} = min(kv0 + {v}u, g.row4 - 1u);")).collect();
    let loads = channels.div_ceil(8);
    if broadcast {
        // As in gemm_tile_body: a subgroup wholly past the last k has no work.
        lines.push("    if (subgroupAll(kv0 >= g.row4)) { return; }".into());
        lines.extend((0..loads).map(|k| {
            format!(
                "    let dl{k} = min(co0 + {}u + sid % 8u, g.channels - 1u) * g.out_plane;",
                8 * k
            )
        }));
    } else {
        lines
            .extend((0..channels).map(|c| {
                format!("    let d{c} = min(co0 + {c}u, g.channels - 1u) * g.out_plane;")
            }));
    }
    lines.extend(unrolled("    ", channels, quads, |c, v| {
        format!("var e{c}_{v} = gemm_weight_start(co0 + {c}u, kv0 + {v}u);")
    }));
    // Running counters rather than a division per output row (slow on CPU drivers).
    lines.push("    var n = g.pixel_begin / g.out_plane;".into());
    lines.push("    var in_example = g.pixel_begin % g.out_plane;".into());
    lines.push("    var dy_row = gemm_weight_dy_row(g.pixel_begin);".into());
    lines.push("    for (var cols_row = 0u; cols_row < g.pixel_count * g.row4; cols_row += g.out_w * g.row4) {".into());
    lines.extend(unrolled("        ", channels, quads, |c, v| {
        format!("var s{c}_{v} = vec4<f32>(0.0);")
    }));
    lines.push("        for (var ox = 0u; ox < g.out_w; ox++) {".into());
    lines.extend(
        (0..quads)
            .map(|v| format!("            let cv{v} = wg_cols[cols_row + ox * g.row4 + k{v}];")),
    );
    if broadcast {
        lines.extend(
            (0..loads).map(|k| format!("            let dm{k} = wg_dy[dy_row + dl{k} + ox];")),
        );
    }
    for c in 0..channels {
        lines.push(if broadcast {
            format!("            let dv{c} = subgroupBroadcast(dm{}, {}u);", c / 8, c % 8)
        } else {
            format!("            let dv{c} = wg_dy[dy_row + d{c} + ox];")
        });
        lines.extend(unrolled("            ", 1, quads, |_, v| {
            format!("s{c}_{v} += dv{c} * cv{v};")
        }));
    }
    lines.push("        }".into());
    lines.extend(unrolled("        ", channels, quads, |c, v| format!("e{c}_{v} += s{c}_{v};")));
    lines.push("        in_example += g.out_w;".into());
    lines.push("        dy_row += g.out_w;".into());
    lines.push("        if (in_example == g.out_plane) {".into());
    lines.extend(unrolled("            ", channels, quads, |c, v| {
        format!("gemm_weight_push(n, co0 + {c}u, kv0 + {v}u, e{c}_{v}); e{c}_{v} = vec4<f32>(0.0);")
    }));
    lines.push("            n++;".into());
    lines.push("            in_example = 0u;".into());
    lines.push("            dy_row += (g.channels - 1u) * g.out_plane;".into());
    lines.push("        }".into());
    lines.push("    }".into());
    lines.extend(unrolled("    ", channels, quads, |c, v| {
        format!("gemm_weight_keep(co0 + {c}u, kv0 + {v}u, e{c}_{v});")
    }));
    lines
}

/// conv2d_gemm_*'s uniform, mirrored by `struct Gemm` in conv2d.wgsl.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Gemm {
    rows_a: u32,
    rows_b: u32,
    row4: u32,
    a_stride: u32,
    a_is_pixels: u32,
    pixel_begin: u32,
    pixel_count: u32,
    channels: u32,
    grid_w: u32,
    grid_h: u32,
    grid_plane: u32,
    out_w: u32,
    out_plane: u32,
    step: u32,
    origin_y: u32,
    origin_x: u32,
}

/// Where a GEMM's pixels land: the grid (n, a, b) of `grid_h`×`grid_w` pixels per image goes
/// to (origin_y + step·a, origin_x + step·b) of an `out_h`×`out_w` plane with `channels` planes
/// per image.
struct PixelGrid {
    images: u32,
    grid_h: u32,
    grid_w: u32,
    channels: u32,
    out_h: u32,
    out_w: u32,
    step: u32,
    origin_y: u32,
    origin_x: u32,
}

impl PixelGrid {
    fn pixels(&self) -> u64 {
        self.images as u64 * self.grid_h as u64 * self.grid_w as u64
    }
}

/// The GEMM's weight operand: rows of `row4` vec4s over the same k as the im2col rows, or (the
/// gathering input-VJP) w itself with the w offset of each k, relative to (0, ci, 0, 0).
#[derive(Clone, Copy)]
enum Weights<'a> {
    Rows(Slice<'a>),
    Gather { w: Slice<'a>, taps: Slice<'a>, khw: u32 },
}

/// The GEMM of one pixel chunk: `rows` (im2col, `count` pixels from `begin`, `row4` vec4s each)
/// against `weights` (`grid.channels` rows), into `out`.
#[allow(clippy::too_many_arguments)]
fn gemm(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: &'static str,
    algo: Conv2dAlgo,
    grid: &PixelGrid,
    (begin, count): (u64, u64),
    row4: u64,
    rows: Slice,
    weights: Weights,
    out: Slice,
) -> Result<()> {
    let channels = grid.channels as u64;
    let (pixels_are_a, rows_a, rows_b, a_stride, bindings) = match (algo, weights) {
        (
            Conv2dAlgo::Gemm(GemmTile { lanes: GemmLanes::ChannelsGather, .. }),
            Weights::Gather { w, taps, khw },
        ) => (
            false,
            channels,
            count,
            khw as u64,
            vec![("w", w), ("im2col", rows), ("out", out), ("taps", taps)],
        ),
        (Conv2dAlgo::Gemm(GemmTile { lanes: GemmLanes::Channels, .. }), Weights::Rows(weights)) => {
            (
                false,
                channels,
                count,
                row4,
                vec![("weight rows", weights), ("im2col", rows), ("out", out)],
            )
        }
        (
            Conv2dAlgo::Gemm(GemmTile { lanes: GemmLanes::Pixels, .. }) | Conv2dAlgo::GemmShared,
            Weights::Rows(weights),
        ) => (
            true,
            count,
            channels,
            row4,
            vec![("im2col", rows), ("weight rows", weights), ("out", out)],
        ),
        _ => unreachable!("{algo} with the other kind of weight operand"),
    };
    let params = Gemm {
        rows_a: rows_a as u32,
        rows_b: rows_b as u32,
        row4: row4 as u32,
        a_stride: a_stride as u32,
        a_is_pixels: pixels_are_a as u32,
        pixel_begin: begin as u32,
        pixel_count: count as u32,
        channels: grid.channels,
        grid_w: grid.grid_w,
        grid_h: grid.grid_h,
        grid_plane: grid.grid_h * grid.grid_w,
        out_w: grid.out_w,
        out_plane: grid.out_h * grid.out_w,
        step: grid.step,
        origin_y: grid.origin_y,
        origin_x: grid.origin_x,
    };
    match algo {
        Conv2dAlgo::Gemm(tile) => {
            let entry = if tile.lanes == GemmLanes::ChannelsGather {
                "conv2d_gemm_gather"
            } else {
                "conv2d_gemm_lanes"
            };
            let groups = rows_a.div_ceil(GEMM_WG as u64 * tile.per_invocation as u64)
                * rows_b.div_ceil(tile.per_workgroup as u64);
            launch(
                gpu,
                enc,
                op,
                &gemm_lanes_shader(tile, gpu.broadcasts),
                entry,
                &params,
                &bindings,
                grid_1d(groups * GEMM_WG as u64, GEMM_WG),
            )
        }
        _ => {
            let groups = rows_a.div_ceil(SHARED_EDGE) * rows_b.div_ceil(SHARED_EDGE);
            launch(
                gpu,
                enc,
                op,
                &SHADER,
                "conv2d_gemm_shared",
                &params,
                &bindings,
                grid_1d(groups * SHARED_WG as u64, SHARED_WG),
            )
        }
    }
}

/// Pixels per im2col chunk: a multiple of `unit` pixels, as many rows of `row4` vec4s as the
/// scratch cap and the device's storage-binding limit allow, and no more than `most` pixels
/// unless one unit is more.
fn chunk_pixels(
    gpu: &Gpu,
    op: &'static str,
    row4: u64,
    (pixels, unit, most): (u64, u64, u64),
) -> Result<u64> {
    let unit_bytes = row4.max(1) * 16 * unit;
    let cap = SCRATCH_BYTES.min(gpu.limits.max_storage_buffer_binding_size);
    if unit_bytes > cap {
        let problem = format!("needs im2col chunks of at least {unit_bytes} bytes, more than a storage binding here ({cap}); use Direct or Blocked");
        return Err(KernelError::Arg { op, arg: "algo", problem });
    }
    let units = (cap / unit_bytes).min((most / unit).max(1));
    Ok((units * unit).min(pixels))
}

/// im2col, chunk by chunk (a multiple of `unit` pixels each, at most `most` pixels where a
/// row of `unit` allows), each followed by
/// `gemm(encoder, first pixel, pixels, im2col rows)`.
#[allow(clippy::too_many_arguments)]
fn im2col_chunks(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: &'static str,
    (im2col, params): (&'static str, Params),
    pixels: (u64, u64, u64),
    source: Slice,
    mut gemm: impl FnMut(&mut Encoder, u64, u64, Slice) -> Result<()>,
) -> Result<()> {
    let row4 = params.row4 as u64;
    let chunk = chunk_pixels(gpu, op, row4, pixels)?;
    let pixels = pixels.0;
    let scratch = gpu
        .scratch("conv2d im2col", (chunk * row4 * 4).max(4))
        .map_err(|source| KernelError::Gpu { op, source })?;
    for begin in (0..pixels).step_by(chunk as usize) {
        let count = chunk.min(pixels - begin);
        let rows = Slice::new(&scratch, 0, (count * row4 * 4).max(4));
        if row4 > 0 {
            let params = Params { row_begin: begin as u32, row_count: count as u32, ..params };
            let threads = count * row4.div_ceil(ROW_RUN);
            launch(
                gpu,
                enc,
                op,
                &SHADER,
                im2col,
                &params,
                &[("source", source), ("im2col", rows)],
                grid_1d(threads, WG),
            )?;
        }
        gemm(enc, begin, count, rows)?;
    }
    Ok(())
}

/// im2col, chunk by chunk, each followed by the GEMM against `weights` into `out`.
#[allow(clippy::too_many_arguments)]
fn im2col_gemm(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: &'static str,
    algo: Conv2dAlgo,
    im2col: (&'static str, Params),
    grid: &PixelGrid,
    source: Slice,
    weights: Weights,
    out: Slice,
) -> Result<()> {
    let row4 = im2col.1.row4 as u64;
    im2col_chunks(
        gpu,
        enc,
        op,
        im2col,
        (grid.pixels(), 1, u64::MAX),
        source,
        |enc, begin, count, rows| {
            gemm(gpu, enc, op, algo, grid, (begin, count), row4, rows, weights, out)
        },
    )
}

fn forward_gemm(
    gpu: &Gpu,
    enc: &mut Encoder,
    algo: Conv2dAlgo,
    s: &Conv2dShape,
    x: Slice,
    w: Slice,
    y: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_forward";
    let k_len = s.c_in as u64 * s.kh as u64 * s.kw as u64;
    let row4 = k_len.div_ceil(4);
    let params = Params { row4: row4 as u32, ..s.params() };
    // OIHW rows are the GEMM's weight rows as they are when they are whole vec4s.
    let padded;
    let weights = if k_len.is_multiple_of(4) {
        w
    } else {
        let len = s.c_out as u64 * row4 * 4;
        padded = gpu
            .scratch("conv2d weight rows", len)
            .map_err(|source| KernelError::Gpu { op: OP, source })?;
        let rows = Slice::new(&padded, 0, len);
        let threads = s.c_out as u64 * row4;
        launch(
            gpu,
            enc,
            OP,
            &SHADER,
            "conv2d_forward_weight_rows",
            &params,
            &[("w", w), ("weight rows", rows)],
            grid_1d(threads, WG),
        )?;
        rows
    };
    let grid = PixelGrid {
        images: s.n,
        grid_h: s.out_h(),
        grid_w: s.out_w(),
        channels: s.c_out,
        out_h: s.out_h(),
        out_w: s.out_w(),
        step: 1,
        origin_y: 0,
        origin_x: 0,
    };
    im2col_gemm(
        gpu,
        enc,
        OP,
        algo,
        ("conv2d_forward_im2col", params),
        &grid,
        x,
        Weights::Rows(weights),
        y,
    )
}

/// The weight gradient as a GEMM: the forward's im2col rows (whole output rows per chunk)
/// against dy, into pairwise blocks of example sums (a scratch of 1 + bit length of n levels,
/// the first the carry between chunks), then their total into dw.
fn backward_weight_gemm(
    gpu: &Gpu,
    enc: &mut Encoder,
    algo: Conv2dAlgo,
    s: &Conv2dShape,
    dy: Slice,
    x: Slice,
    dw: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_backward_weight";
    if gpu.info.backend == wgpu::Backend::Gl {
        // Open issue: on wgpu's GL backend (llvmpipe GL, Mesa 22) these kernels give wrong sums
        // (zeros at n = 1), on Vulkan the direct kernel's bits. Refused until that is understood.
        let problem = format!("is {algo}, whose weight-gradient kernels give wrong results on the GL backend; use Blocked");
        return Err(KernelError::Arg { op: OP, arg: "algo", problem });
    }
    let row4 = (s.c_in as u64 * s.kh as u64 * s.kw as u64).div_ceil(4);
    let params = Params { row4: row4 as u32, ..s.params() };
    let levels = 1 + (u32::BITS - s.n.leading_zeros()) as u64;
    let level = s.c_out as u64 * row4 * 4;
    let sums_len = levels * level;
    let sums = gpu
        .scratch("conv2d weight sums", sums_len)
        .map_err(|source| KernelError::Gpu { op: OP, source })?;
    let sums = Slice::new(&sums, 0, sums_len);
    let (out_w, out_plane) = (s.out_w(), s.out_h() * s.out_w());
    let pixels = s.n as u64 * out_plane as u64;
    im2col_chunks(
        gpu,
        enc,
        OP,
        ("conv2d_forward_im2col", params),
        (pixels, out_w as u64, WEIGHT_CHUNK_PIXELS),
        x,
        |enc, begin, count, rows| {
            let (rows_a, rows_b) = match algo {
                Conv2dAlgo::Gemm(GemmTile { lanes: GemmLanes::Channels, .. }) => {
                    (s.c_out as u64, row4 * 4)
                }
                _ => (row4 * 4, s.c_out as u64),
            };
            let gemm = Gemm {
                rows_a: rows_a as u32,
                rows_b: rows_b as u32,
                row4: row4 as u32,
                pixel_begin: begin as u32,
                pixel_count: count as u32,
                channels: s.c_out,
                out_w,
                out_plane,
                ..bytemuck::Zeroable::zeroed()
            };
            let bindings = [("im2col", rows), ("dy", dy), ("weight sums", sums)];
            match algo {
                Conv2dAlgo::Gemm(tile) => {
                    let entry = if tile.lanes == GemmLanes::Channels {
                        "conv2d_gemm_weight_channels"
                    } else {
                        "conv2d_gemm_weight_pixels"
                    };
                    let groups = rows_a.div_ceil(GEMM_WG as u64 * tile.per_invocation as u64)
                        * rows_b.div_ceil(tile.per_workgroup as u64);
                    let shader = pairwise_shader(
                        &gemm_lanes_shader(tile, gpu.broadcasts && tile.lanes == GemmLanes::Pixels),
                        s.n,
                    );
                    launch(
                        gpu,
                        enc,
                        OP,
                        &shader,
                        entry,
                        &gemm,
                        &bindings,
                        grid_1d(groups * GEMM_WG as u64, GEMM_WG),
                    )
                }
                _ => {
                    let groups =
                        row4.div_ceil(SHARED_EDGE / 4) * (s.c_out as u64).div_ceil(SHARED_EDGE);
                    launch(
                        gpu,
                        enc,
                        OP,
                        &pairwise_shader(&SHADER, s.n),
                        "conv2d_gemm_weight_shared",
                        &gemm,
                        &bindings,
                        grid_1d(groups * SHARED_WG as u64, SHARED_WG),
                    )
                }
            }
        },
    )?;
    launch(
        gpu,
        enc,
        OP,
        &pairwise_shader(&SHADER, s.n),
        "conv2d_backward_weight_total",
        &params,
        &[("weight sums", sums), ("dw", dw)],
        grid_1d(s.w_len(), WG),
    )
}

/// Taps of a kernel of size `k` that the phase starting at `phase` reaches (`phase_taps` in
/// the shader).
fn phase_taps(phase: u32, k: u32, s: &Conv2dShape) -> u32 {
    let k0 = (phase + s.pad) % s.stride;
    if k0 >= k {
        0
    } else {
        (k - k0).div_ceil(s.stride)
    }
}

/// One phase of the input-VJP as a GEMM: weight rows over the phase's taps, then im2col of dy.
#[allow(clippy::too_many_arguments)]
fn backward_input_gemm_phase(
    gpu: &Gpu,
    enc: &mut Encoder,
    algo: Conv2dAlgo,
    s: &Conv2dShape,
    params: Params,
    dy: Slice,
    w: Slice,
    dx: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_backward_input";
    let k_len = s.c_out as u64
        * phase_taps(params.phase_y, s.kh, s) as u64
        * phase_taps(params.phase_x, s.kw, s) as u64;
    let row4 = k_len.div_ceil(4);
    let params = Params { row4: row4 as u32, ..params };
    let gpu_err = |source| KernelError::Gpu { op: OP, source };
    let (weight_rows, taps);
    let weights =
        if matches!(algo, Conv2dAlgo::Gemm(GemmTile { lanes: GemmLanes::ChannelsGather, .. })) {
            taps = gpu.upload("conv2d taps", &gather_taps(s, &params)).map_err(gpu_err)?;
            Weights::Gather { w, taps: Slice::whole(&taps), khw: s.kh * s.kw }
        } else {
            let len = (s.c_in as u64 * row4 * 4).max(4);
            weight_rows = gpu.scratch("conv2d weight rows", len).map_err(gpu_err)?;
            let rows = Slice::new(&weight_rows, 0, len);
            if row4 > 0 {
                let threads = s.c_in as u64 * row4.div_ceil(ROW_RUN);
                launch(
                    gpu,
                    enc,
                    OP,
                    &SHADER,
                    "conv2d_backward_input_weight_rows",
                    &params,
                    &[("w", w), ("weight rows", rows)],
                    grid_1d(threads, WG),
                )?;
            }
            Weights::Rows(rows)
        };
    let grid = PixelGrid {
        images: s.n,
        grid_h: params.phase_h,
        grid_w: params.phase_w,
        channels: s.c_in,
        out_h: s.h,
        out_w: s.w,
        step: s.stride,
        origin_y: params.phase_y,
        origin_x: params.phase_x,
    };
    im2col_gemm(
        gpu,
        enc,
        OP,
        algo,
        ("conv2d_backward_input_im2col", params),
        &grid,
        dy,
        weights,
        dx,
    )
}

/// conv2d_gemm_gather's table for one phase: for each k = (co, ty, tx) of an im2col row, the
/// offset in w of (co, ci, ky0 + stride·ty, kx0 + stride·tx) less that of (0, ci, 0, 0); u32
/// max pads the last vec4 (and stands alone when the phase has no taps).
fn gather_taps(s: &Conv2dShape, params: &Params) -> Vec<u32> {
    let (taps_y, taps_x) =
        (phase_taps(params.phase_y, s.kh, s), phase_taps(params.phase_x, s.kw, s));
    let (ky0, kx0) = ((params.phase_y + s.pad) % s.stride, (params.phase_x + s.pad) % s.stride);
    let co_stride = s.c_in * s.kh * s.kw;
    let mut taps: Vec<u32> = (0..s.c_out)
        .flat_map(|co| (0..taps_y).flat_map(move |ty| (0..taps_x).map(move |tx| (co, ty, tx))))
        .map(|(co, ty, tx)| co * co_stride + (ky0 + s.stride * ty) * s.kw + kx0 + s.stride * tx)
        .collect();
    taps.resize((params.row4 as usize * 4).max(4), u32::MAX);
    taps
}

// ---------------------------------------------------------------------------------------------
// Choosing a variant.

/// The variant the plain launchers use for `op` at `shape` on `gpu`:
/// 1. `SYNCSTEP_CONV_ALGO` (`direct`, `blocked`, `gemm-shared`, `gemm-pixels-8x8`, …; see
///    [`Conv2dAlgo::all`]), where `op` has that kernel (else Blocked: the gathering GEMM is
///    the input-VJP's only); or `guess`, the browser's choice;
/// 2. natively, the fastest of [`candidates`] timed on this adapter at this shape, on first use;
///    in a browser, where there is no clock, [`guess`] by device type.
///
/// Choices are remembered per (adapter, op, shape) for the life of the process and, natively,
/// in a file (see [`autotune::cache_path`]) that a later process reads instead of timing again.
/// Every variant gives the same bits, so this changes speed only.
pub fn conv2d_algo(gpu: &Gpu, op: Conv2dOp, shape: &Conv2dShape) -> Result<Conv2dAlgo> {
    match forced_algo(op)? {
        Some(Forced::Algo(forced)) => {
            return Ok(if forced.has(op) { forced } else { Conv2dAlgo::Blocked })
        }
        Some(Forced::Guess) => return Ok(guess(&gpu.info, op, shape)),
        None => {}
    }
    let candidates = candidates(gpu, op);
    if candidates.len() == 1 {
        return Ok(candidates[0]);
    }
    static CHOSEN: OnceLock<Mutex<Choices>> = OnceLock::new();
    let chosen = CHOSEN.get_or_init(Default::default);
    // Kernels that broadcast time differently from those that load: separate choices.
    let key = (adapter_key(&gpu.info) + if gpu.broadcasts { "|broadcast" } else { "" }, op, *shape);
    if let Some(&algo) = chosen.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(algo);
    }
    shape.validate(op.name())?;
    #[cfg(not(target_arch = "wasm32"))]
    let algo = {
        let file = autotune::cache_path();
        let remembered = file
            .as_deref()
            .and_then(|f| autotune::remembered(f, &key))
            .filter(|a| candidates.contains(a));
        match remembered {
            Some(algo) => algo,
            None => {
                let algo = autotune::fastest(gpu, op, shape, &candidates)?;
                if let Some(f) = &file {
                    autotune::remember(f, &key, algo);
                }
                algo
            }
        }
    };
    #[cfg(target_arch = "wasm32")]
    let algo = guess(&gpu.info, op, shape);
    log::debug!("{} {shape:?} on {}: {algo}", op.name(), gpu.info.name);
    chosen.lock().unwrap_or_else(|p| p.into_inner()).insert(key, algo);
    Ok(algo)
}

/// What `SYNCSTEP_CONV_ALGO` asks for: one variant, or `guess`, the browser's choice without a
/// clock (to run natively what a browser runs).
#[derive(Debug, PartialEq)]
enum Forced {
    Algo(Conv2dAlgo),
    Guess,
}

/// `SYNCSTEP_CONV_ALGO`, parsed; an unknown name is an error that lists the known ones.
fn forced_algo(op: Conv2dOp) -> Result<Option<Forced>> {
    std::env::var("SYNCSTEP_CONV_ALGO").map_or(Ok(None), |name| parse_forced(op, &name))
}

fn parse_forced(op: Conv2dOp, name: &str) -> Result<Option<Forced>> {
    match name.trim() {
        "" => Ok(None),
        "guess" => Ok(Some(Forced::Guess)),
        name => Conv2dAlgo::parse(name).map(|a| Some(Forced::Algo(a))).ok_or_else(|| {
            let known: Vec<String> = Conv2dAlgo::all().iter().map(|a| a.to_string()).collect();
            KernelError::Arg {
                op: op.name(),
                arg: "SYNCSTEP_CONV_ALGO",
                problem: format!("is `{name}`; known: {}, guess", known.join(", ")),
            }
        }),
    }
}

/// (adapter, op, shape) → the variant chosen there.
type Choices = HashMap<(String, Conv2dOp, Conv2dShape), Conv2dAlgo>;

/// An adapter as the choice cache knows it: the same hardware and driver choose alike. One line
/// without tabs, as the cache file stores it.
fn adapter_key(info: &wgpu::AdapterInfo) -> String {
    let key = format!("{:?}|{}|{}|{}", info.backend, info.name, info.driver, info.driver_info);
    key.replace(|c: char| c.is_control(), " ")
}

fn is_cpu(info: &wgpu::AdapterInfo) -> bool {
    info.device_type == wgpu::DeviceType::Cpu
}

/// What the autotune times for `op` on `gpu`'s kind of adapter. CPU drivers (lavapipe,
/// SwiftShader) run workgroups as loops over SIMD lanes, where a barrier is a coroutine switch:
/// register tiles without workgroup memory. GPUs: workgroup-shared tiles, and the register
/// tiles for the small GEMMs of the late stages. Direct is never a candidate.
pub fn candidates(gpu: &Gpu, op: Conv2dOp) -> Vec<Conv2dAlgo> {
    candidates_for(&gpu.info.name, gpu.info.backend, is_cpu(&gpu.info), op)
}

fn candidates_for(
    adapter: &str,
    backend: wgpu::Backend,
    cpu: bool,
    op: Conv2dOp,
) -> Vec<Conv2dAlgo> {
    let mut all = vec![Conv2dAlgo::Blocked];
    if op == Conv2dOp::BackwardWeight && backend == wgpu::Backend::Gl {
        return all; // the GEMMs are refused there (see backward_weight_gemm)
    }
    // SwiftShader's compiler takes over 8 GB and minutes for the weight-gradient GEMMs with
    // 64 outputs or more per invocation (measured natively, 8×8): those it is not given.
    let compiles = |t: &GemmTile| {
        !(op == Conv2dOp::BackwardWeight
            && adapter.contains("SwiftShader")
            && t.per_invocation * t.per_workgroup > 32)
    };
    all.extend(
        GEMM_TILES
            .iter()
            .filter(|t| compiles(t))
            .map(|&t| Conv2dAlgo::Gemm(t))
            .filter(|a| a.has(op)),
    );
    if !cpu {
        all.push(Conv2dAlgo::GemmShared);
    }
    all
}

/// Without a clock (wasm32): shared tiles on GPUs. On CPU adapters the weight gradient's
/// Blocked kernel (2–2.5× the GEMMs' speed at layer1–3 on SwiftShader, as on lavapipe) where
/// the adapter runs it, else register tiles with lanes over whichever of pixels and channels
/// is larger.
fn guess(info: &wgpu::AdapterInfo, op: Conv2dOp, s: &Conv2dShape) -> Conv2dAlgo {
    guess_for(is_cpu(info), &info.name, op, s)
}

fn guess_for(cpu: bool, adapter: &str, op: Conv2dOp, s: &Conv2dShape) -> Conv2dAlgo {
    if !cpu {
        return Conv2dAlgo::GemmShared;
    }
    if op == Conv2dOp::BackwardWeight
        && expect_within_loop_limit(adapter, op.name(), Conv2dAlgo::Blocked, s).is_ok()
    {
        return Conv2dAlgo::Blocked;
    }
    let pixels = s.n as u64 * s.out_h() as u64 * s.out_w() as u64;
    let lanes = if pixels >= s.c_out as u64 { GemmLanes::Pixels } else { GemmLanes::Channels };
    Conv2dAlgo::Gemm(GemmTile { lanes, per_invocation: 4, per_workgroup: 8 })
}

#[cfg(not(target_arch = "wasm32"))]
mod autotune {
    //! Times candidates on the device: wgpu has no clock inside shaders, so each run is one
    //! submission measured to completion with the host's clock, holding enough launches of a
    //! short kernel that the round trip (~0.1 ms on lavapipe) is small beside them. Remembers
    //! the choices in a text file: a header line naming the crate version and the kernels'
    //! source hash (another build's file is not read), then one line per choice: op, shape,
    //! variant and adapter, separated by tabs.

    use std::ffi::OsString;
    use std::path::{Path, PathBuf};
    use std::time::Duration;

    use super::*;
    use crate::gpu::launches_to_fill;

    /// The first line of a choices file this build reads: the crate version and a hash of the
    /// kernels' source as compiled (conv2d.wgsl, every tile's module with and without broadcasts,
    /// the broadcasting module), since a change to a kernel or to the tiles on offer (within a
    /// version too) changes which is fastest.
    pub(super) fn header() -> &'static str {
        static HEADER: OnceLock<String> = OnceLock::new();
        HEADER.get_or_init(|| {
            let tiles = GEMM_TILES
                .iter()
                .flat_map(|&t| [false, true].map(|b| gemm_lanes_shader(t, b).source));
            let sources = [SOURCE, broadcast_shader().source].into_iter().chain(tiles);
            // FNV-1a, 64 bits: stable across builds and platforms, unlike std's hasher.
            let hash = sources.flat_map(str::bytes).fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
            });
            format!("syncstep-autotune {} {hash:016x}", env!("CARGO_PKG_VERSION"))
        })
    }

    /// The choices file: `SYNCSTEP_AUTOTUNE_CACHE` (a path, or `off` for none), else
    /// `$XDG_CACHE_HOME/syncstep/autotune.txt`, else `~/.cache/syncstep/autotune.txt`.
    pub(super) fn cache_path() -> Option<PathBuf> {
        let var = std::env::var_os;
        cache_path_from(var("SYNCSTEP_AUTOTUNE_CACHE"), var("XDG_CACHE_HOME"), var("HOME"))
    }

    pub(super) fn cache_path_from(
        chosen: Option<OsString>,
        xdg_cache: Option<OsString>,
        home: Option<OsString>,
    ) -> Option<PathBuf> {
        let set = |v: Option<OsString>| v.filter(|v| !v.is_empty());
        if let Some(chosen) = set(chosen) {
            return (chosen != "off").then(|| PathBuf::from(chosen));
        }
        // XDG: a relative XDG_CACHE_HOME is invalid and ignored.
        let cache = set(xdg_cache)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
            .or_else(|| set(home).map(|h| PathBuf::from(h).join(".cache")))?;
        Some(cache.join("syncstep").join("autotune.txt"))
    }

    /// The choices in `file`: none when it is missing or another version wrote it, none with a
    /// warning when it cannot be read or is corrupt. Never an error: the cache only saves time.
    pub(super) fn load(file: &Path) -> Choices {
        let text = match std::fs::read_to_string(file) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Choices::new(),
            Err(e) => {
                log::warn!(
                    "autotune cache {}: cannot read it ({e}); timing afresh",
                    file.display()
                );
                return Choices::new();
            }
        };
        let mut lines = text.lines();
        let choices = match lines.next() {
            Some(first) if first == header() => {
                lines.map(parse_choice).collect::<Option<Choices>>()
            }
            Some(other) if other.starts_with("syncstep-autotune ") => {
                log::debug!(
                    "autotune cache {}: written by {other}, not {}; timing afresh",
                    file.display(),
                    header()
                );
                return Choices::new();
            }
            _ => None,
        };
        choices.unwrap_or_else(|| {
            log::warn!(
                "autotune cache {}: corrupt, ignored (it is rewritten with the next choice)",
                file.display()
            );
            Choices::new()
        })
    }

    /// The choice for `key` in `file` as this process first read it: the file is read once, not
    /// for each of a step's ~40 (op, shape) pairs. Choices this process makes stay in memory.
    pub(super) fn remembered(
        file: &Path,
        key: &(String, Conv2dOp, Conv2dShape),
    ) -> Option<Conv2dAlgo> {
        static READ: OnceLock<Mutex<HashMap<PathBuf, Choices>>> = OnceLock::new();
        let mut read = READ.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        read.entry(file.to_path_buf()).or_insert_with(|| load(file)).get(key).copied()
    }

    fn parse_choice(line: &str) -> Option<((String, Conv2dOp, Conv2dShape), Conv2dAlgo)> {
        let [op, dims, algo, adapter] = line.split('\t').collect::<Vec<_>>().try_into().ok()?;
        let op = [Conv2dOp::Forward, Conv2dOp::BackwardInput, Conv2dOp::BackwardWeight]
            .into_iter()
            .find(|o| o.name() == op)?;
        let dims: Vec<u32> = dims.split(' ').map(|d| d.parse().ok()).collect::<Option<_>>()?;
        let [n, c_in, h, w, c_out, kh, kw, stride, pad] = dims.try_into().ok()?;
        let shape = Conv2dShape { n, c_in, h, w, c_out, kh, kw, stride, pad };
        Some(((adapter.to_string(), op, shape), Conv2dAlgo::parse(algo)?))
    }

    /// Adds `key → algo` to the choices in `file`, read again so that other processes' choices
    /// stay, and writes them back through a temporary file renamed over it. A failure is a
    /// warning.
    pub(super) fn remember(file: &Path, key: &(String, Conv2dOp, Conv2dShape), algo: Conv2dAlgo) {
        // One writer at a time in this process (the temporary file's name is per process).
        static WRITING: Mutex<()> = Mutex::new(());
        let _one = WRITING.lock().unwrap_or_else(|p| p.into_inner());
        let mut choices = load(file);
        choices.insert(key.clone(), algo);
        let mut lines: Vec<String> = choices
            .iter()
            .map(|((adapter, op, s), algo)| {
                let dims = [s.n, s.c_in, s.h, s.w, s.c_out, s.kh, s.kw, s.stride, s.pad]
                    .map(|d| d.to_string())
                    .join(" ");
                format!("{}\t{dims}\t{algo}\t{adapter}", op.name())
            })
            .collect();
        lines.sort();
        lines.insert(0, header().to_string());
        let temporary = file.with_extension(format!("tmp{}", std::process::id()));
        let written = file
            .parent()
            .filter(|dir| !dir.as_os_str().is_empty())
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&temporary, lines.join("\n") + "\n"))
            .and_then(|()| std::fs::rename(&temporary, file));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&temporary);
            log::warn!(
                "autotune cache {}: cannot write it ({e}); choices are kept for this process only",
                file.display()
            );
        }
    }

    /// Timed runs per candidate after one untimed run (which compiles its pipelines on first
    /// use); the fastest run counts, the least disturbed by other work on the machine.
    const RUNS: usize = 2;
    /// Candidates timed again in turns at the end: at least this many of the fastest, and every
    /// one within FINALIST_SPREAD of the fastest. Other work on the machine during a candidate's
    /// first runs can make it look 50% slower: a choice 1.5× slower than the best was kept so
    /// (layer2's forward at 32² on Mesa 25, 1.41 against 0.92 ms when timed again).
    const FINALISTS: usize = 3;
    const FINALIST_SPREAD: f64 = 1.6;
    /// The least a timed submission runs: short kernels are launched several times in one
    /// (as many for every candidate of a shape; see `launches_to_fill`).
    const MIN_SUBMIT: Duration = Duration::from_millis(2);

    pub(super) fn fastest(
        gpu: &Gpu,
        op: Conv2dOp,
        s: &Conv2dShape,
        candidates: &[Conv2dAlgo],
    ) -> Result<Conv2dAlgo> {
        // The candidates' scratch (an im2col chunk the choice may never use) would otherwise stay
        // held for the device's life: a process that tuned held 13–61 MiB more than one that
        // read its choices from the file.
        gpu.scratch_as_before(|| time_candidates(gpu, op, s, candidates))
    }

    fn time_candidates(
        gpu: &Gpu,
        op: Conv2dOp,
        s: &Conv2dShape,
        candidates: &[Conv2dAlgo],
    ) -> Result<Conv2dAlgo> {
        // One tuning at a time per process: concurrent ones would time each other.
        static TUNING: Mutex<()> = Mutex::new(());
        let _one = TUNING.lock().unwrap_or_else(|p| p.into_inner());
        let gpu_err = |source| KernelError::Gpu { op: op.name(), source };
        let [input, second, output] = s.operand_lens(op);
        let input = gpu.buffer("autotune input", input).map_err(gpu_err)?;
        let second = gpu.buffer("autotune second input", second).map_err(gpu_err)?;
        let output = gpu.buffer("autotune output", output).map_err(gpu_err)?;
        let run = |algo: Conv2dAlgo, launches: u32| -> Result<Duration> {
            let launch = |enc: &mut Encoder| {
                conv2d_launch_with(
                    gpu,
                    enc,
                    op,
                    algo,
                    s,
                    Slice::whole(&input),
                    Slice::whole(&second),
                    Slice::whole(&output),
                )
            };
            gpu.time_recorded(launches, launch, gpu_err)
        };
        gpu.wait().map_err(gpu_err)?; // the caller's work in flight is not ours to time
        let mut launches = 0;
        let mut timed: Vec<(Duration, Conv2dAlgo)> = Vec::new();
        for &algo in candidates {
            match run(algo, 1) {
                Ok(_) => {}
                // A variant this device refuses (a limit, a scratch buffer too large) is skipped;
                // any other refusal is a bug here, not the variant's.
                Err(KernelError::Arg { arg: "algo", .. })
                | Err(KernelError::Gpu { source: crate::gpu::GpuError::Limit { .. }, .. }) => {
                    continue
                }
                Err(e) => return Err(e),
            };
            // The untimed run included the JIT compile (which on lavapipe can take longer than
            // ten runs): the first timed run decides whether the candidate is worth more.
            if launches == 0 {
                launches = launches_to_fill(MIN_SUBMIT, run(algo, 1)?);
            }
            let mut fastest = run(algo, launches)?;
            if timed.iter().any(|&(t, _)| fastest > 10 * t) {
                continue;
            }
            for _ in 1..RUNS {
                fastest = fastest.min(run(algo, launches)?);
            }
            log::debug!(
                "autotune {} {s:?}: {algo} {:.3} ms",
                op.name(),
                fastest.as_secs_f64() * 1e3
            );
            timed.push((fastest, algo));
        }
        // Other work on the machine during one candidate's runs makes it look slow, and the
        // choice is kept for good: the finalists (see FINALISTS) run again, taking turns, and
        // each keeps its best time.
        timed.sort_by_key(|&(t, _)| t);
        let close = timed.first().map_or(Duration::ZERO, |&(t, _)| t.mul_f64(FINALIST_SPREAD));
        timed.truncate(timed.iter().filter(|&&(t, _)| t <= close).count().max(FINALISTS));
        for _ in 0..RUNS {
            for (t, algo) in timed.iter_mut() {
                *t = (*t).min(run(*algo, launches)?);
            }
        }
        Ok(timed.into_iter().min_by_key(|&(t, _)| t).map_or(Conv2dAlgo::Blocked, |(_, algo)| algo))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The broadcasting module is conv2d.wgsl with the dy reads swapped: it must stay valid WGSL
    /// (with subgroups), broadcast all 16 channels, and load dy twice.
    #[test]
    fn broadcast_shader_is_valid_and_loads_dy_once() {
        let shader = broadcast_shader();
        let module = naga::front::wgsl::parse_str(shader.source)
            .unwrap_or_else(|e| panic!("{}", e.emit_to_string(shader.source)));
        let mut validator = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::SUBGROUP,
        );
        validator
            .validate(&module)
            .unwrap_or_else(|e| panic!("{}", e.emit_to_string(shader.source)));
        let kernel =
            &shader.source[shader.source.find("fn conv2d_backward_weight_blocked(").unwrap()..];
        let kernel = &kernel[..kernel.find("\n}\n").unwrap()];
        assert!(kernel.starts_with(
            "fn conv2d_backward_weight_blocked(@builtin(subgroup_invocation_id) sid: u32, "
        ));
        assert_eq!(kernel.matches("wb_dy[").count(), 2, "{kernel}");
        assert!(!kernel.contains("wb_dy4("), "{kernel}");
        assert!((0..2).all(|m| (0..8).all(|j| kernel.contains(&format!("subgroupBroadcast(m{m}, {j}u)")))), "{kernel}");
    }

    /// SwiftShader is not given the weight-gradient GEMMs whose compile takes it over 8 GB;
    /// lavapipe and its other ops keep every tile; GPUs add the shared tiles.
    #[test]
    fn candidates_per_adapter() {
        let big = |all: &[Conv2dAlgo]| {
            all.iter().any(
                |a| matches!(a, Conv2dAlgo::Gemm(t) if t.per_invocation * t.per_workgroup > 32),
            )
        };
        let vulkan = wgpu::Backend::Vulkan;
        let swiftshader =
            candidates_for("SwiftShader Device (Subzero)", vulkan, true, Conv2dOp::BackwardWeight);
        assert!(!big(&swiftshader) && swiftshader.len() > 2, "{swiftshader:?}");
        assert!(big(&candidates_for(
            "SwiftShader Device (Subzero)",
            vulkan,
            true,
            Conv2dOp::Forward
        )));
        assert!(big(&candidates_for(
            "llvmpipe (LLVM 15.0.6, 256 bits)",
            vulkan,
            true,
            Conv2dOp::BackwardWeight
        )));
        assert_eq!(
            candidates_for("llvmpipe", wgpu::Backend::Gl, true, Conv2dOp::BackwardWeight),
            [Conv2dAlgo::Blocked]
        );
        assert!(candidates_for("NVIDIA H200", vulkan, false, Conv2dOp::Forward)
            .contains(&Conv2dAlgo::GemmShared));
    }

    #[test]
    fn syncstep_conv_algo_names_a_variant_or_guess() {
        let parse = |name| parse_forced(Conv2dOp::Forward, name);
        assert_eq!(parse(" ").unwrap(), None);
        assert_eq!(parse("guess").unwrap(), Some(Forced::Guess));
        assert_eq!(
            parse("gemm-pixels-8x8").unwrap(),
            Some(Forced::Algo(Conv2dAlgo::Gemm(GEMM_TILES[2])))
        );
        let err = parse("fastest").unwrap_err().to_string();
        assert!(
            err.contains("SYNCSTEP_CONV_ALGO")
                && err.contains("`fastest`")
                && err.contains("blocked")
                && err.contains("guess"),
            "{err}"
        );
    }

    /// The browser's choice without a clock: GPUs the shared tiles; CPU adapters Blocked for
    /// the weight gradient unless llvmpipe's loop limit refuses it there, register tiles else.
    #[test]
    fn the_browsers_guess_by_device_type() {
        let small = Conv2dShape {
            n: 8,
            c_in: 256,
            h: 2,
            w: 2,
            c_out: 256,
            kh: 3,
            kw: 3,
            stride: 1,
            pad: 1,
        };
        let stem_224 = Conv2dShape {
            n: 8,
            c_in: 3,
            h: 224,
            w: 224,
            c_out: 64,
            kh: 7,
            kw: 7,
            stride: 2,
            pad: 3,
        };
        let (swiftshader, llvmpipe) =
            ("SwiftShader Device (Subzero)", "llvmpipe (LLVM 15.0.6, 256 bits)");
        assert_eq!(
            guess_for(false, "NVIDIA H200", Conv2dOp::BackwardWeight, &small),
            Conv2dAlgo::GemmShared
        );
        assert_eq!(
            guess_for(true, swiftshader, Conv2dOp::BackwardWeight, &small),
            Conv2dAlgo::Blocked
        );
        assert_eq!(
            guess_for(true, swiftshader, Conv2dOp::BackwardWeight, &stem_224),
            Conv2dAlgo::Blocked
        );
        assert_eq!(
            guess_for(true, llvmpipe, Conv2dOp::BackwardWeight, &small),
            Conv2dAlgo::Blocked
        );
        assert!(matches!(
            guess_for(true, llvmpipe, Conv2dOp::BackwardWeight, &stem_224),
            Conv2dAlgo::Gemm(_)
        ));
        assert!(matches!(
            guess_for(true, swiftshader, Conv2dOp::Forward, &small),
            Conv2dAlgo::Gemm(GemmTile { lanes: GemmLanes::Channels, .. })
        ));
    }

    /// Brute force over small geometries: a crop keeps the rows and columns from the first to
    /// the last tap some output reads inside the input, with the same output size. No crop means
    /// those are all of them, or no tap reads, or the kept taps start at different rows and
    /// columns, or their convolution would have another output size.
    #[test]
    fn crop_keeps_exactly_the_taps_that_read_the_input() {
        let mut cropped = 0;
        for (h, w, kh, kw, stride, pad) in small_geometries() {
            let s = Conv2dShape { n: 1, c_in: 1, h, w, c_out: 1, kh, kw, stride, pad };
            if s.validate("test").is_err() {
                continue;
            }
            let reads = |k: u32, size: u32, out: u32| {
                (0..out).any(|o| {
                    (0..size as i64).contains(&((o * stride) as i64 - pad as i64 + k as i64))
                })
            };
            // The first to the last tap that reads (with stride > 1 some between may not).
            let hull = |k: u32, size: u32, out: u32| {
                let reading: Vec<u32> = (0..k).filter(|&t| reads(t, size, out)).collect();
                reading.first().map(|&first| (first, reading.last().unwrap() + 1 - first))
            };
            let (rows, cols) = (hull(kh, h, s.out_h()), hull(kw, w, s.out_w()));
            match (s.crop(), rows, cols) {
                (Some(c), _, _) => {
                    cropped += 1;
                    assert_eq!(
                        (rows, cols),
                        (Some((c.ky, c.shape.kh)), Some((c.kx, c.shape.kw))),
                        "{s:?}"
                    );
                    assert_eq!((c.shape.out_h(), c.shape.out_w()), (s.out_h(), s.out_w()), "{s:?}");
                    assert_eq!(c.shape.pad + c.ky, pad, "{s:?}");
                    c.shape.validate("test").unwrap();
                }
                (None, Some((ky, kh_kept)), Some((kx, kw_kept)))
                    if (kh_kept, kw_kept) != (kh, kw) =>
                {
                    let kept = Conv2dShape { kh: kh_kept, kw: kw_kept, pad: pad - ky, ..s };
                    let same_size = (kept.out_h(), kept.out_w()) == (s.out_h(), s.out_w());
                    assert!(
                        ky != kx || !same_size,
                        "{s:?}: taps {rows:?} × {cols:?} could be cropped"
                    );
                }
                (None, _, _) => {} // every tap kept, or none reads the input
            }
        }
        assert!(cropped > 50, "only {cropped} geometries crop: the test checks little");
        // ResNet-34 at 32²: layer4's 3×3 convolutions on 1×1 maps keep their centre tap, its
        // strided one (2×2 → 1×1) a 2×2 corner; layer3's 2×2 maps keep every tap.
        let resnet = |h, stride| {
            Conv2dShape { n: 8, c_in: 512, h, w: h, c_out: 512, kh: 3, kw: 3, stride, pad: 1 }
                .crop()
                .map(|c| (c.ky, c.shape.kh, c.shape.pad))
        };
        assert_eq!(resnet(1, 1), Some((1, 1, 0)));
        assert_eq!(resnet(2, 2), Some((1, 2, 0)));
        assert_eq!(resnet(2, 1), None);
    }

    /// (h, w, kh, kw, stride, pad) over small values.
    fn small_geometries() -> impl Iterator<Item = (u32, u32, u32, u32, u32, u32)> {
        let small = |n: u32| 1..=n;
        small(4).flat_map(move |h| {
            small(4).flat_map(move |w| {
                small(5).flat_map(move |kh| {
                    small(5).flat_map(move |kw| {
                        small(3).flat_map(move |stride| {
                            (0..=3).map(move |pad| (h, w, kh, kw, stride, pad))
                        })
                    })
                })
            })
        })
    }

    #[test]
    fn the_shader_file_holds_the_generated_4x4_tiles() {
        for kernel in TileKernel::ALL {
            let (begin, end) = tile_block(SOURCE, kernel);
            assert_eq!(
                &SOURCE[begin..end],
                gemm_tile(kernel, 4, 4, false),
                "regenerate conv2d.wgsl's tile body with gemm_tile({kernel:?}, 4, 4, false)"
            );
        }
    }

    #[test]
    fn every_tile_specialises_to_valid_wgsl() {
        for (tile, broadcasts) in GEMM_TILES.into_iter().flat_map(|t| [(t, false), (t, true)]) {
            let shader = gemm_lanes_shader(tile, broadcasts);
            let module = naga::front::wgsl::parse_str(shader.source)
                .unwrap_or_else(|e| panic!("{}: {}", shader.name, e.emit_to_string(shader.source)));
            let capabilities = if broadcasts {
                naga::valid::Capabilities::SUBGROUP
            } else {
                naga::valid::Capabilities::empty()
            };
            let mut validator =
                naga::valid::Validator::new(naga::valid::ValidationFlags::all(), capabilities);
            validator
                .validate(&module)
                .unwrap_or_else(|e| panic!("{}: {}", shader.name, e.emit_to_string(shader.source)));
            assert!(
                shader.source.contains(&format!(
                    "s{}_{} += ",
                    tile.per_invocation - 1,
                    tile.per_workgroup - 1
                )),
                "{}",
                shader.name
            );
        }
    }

    /// A fresh directory for one test's cache file (removed by the test).
    #[cfg(not(target_arch = "wasm32"))]
    fn cache_dir(test: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("syncstep-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn key(adapter: &str, op: Conv2dOp, n: u32) -> (String, Conv2dOp, Conv2dShape) {
        (
            adapter.into(),
            op,
            Conv2dShape { n, c_in: 64, h: 8, w: 8, c_out: 64, kh: 3, kw: 3, stride: 1, pad: 1 },
        )
    }

    #[test]
    #[cfg(not(target_arch = "wasm32"))]
    fn autotune_choices_are_read_back_from_the_cache_file() {
        let dir = cache_dir("cache-round-trip");
        let file = dir.join("sub").join("autotune.txt");
        assert!(autotune::load(&file).is_empty(), "a missing file holds no choices");
        let pixels = Conv2dAlgo::Gemm(GEMM_TILES[2]);
        autotune::remember(&file, &key("Vulkan|llvmpipe|a b", Conv2dOp::BackwardWeight, 8), pixels);
        autotune::remember(
            &file,
            &key("Vulkan|llvmpipe|a b", Conv2dOp::Forward, 8),
            Conv2dAlgo::Blocked,
        );
        autotune::remember(
            &file,
            &key("Gl|llvmpipe|c", Conv2dOp::BackwardWeight, 8),
            Conv2dAlgo::GemmShared,
        );
        autotune::remember(
            &file,
            &key("Vulkan|llvmpipe|a b", Conv2dOp::Forward, 8),
            Conv2dAlgo::Direct,
        ); // replaces Blocked
        let choices = autotune::load(&file);
        assert_eq!(choices.len(), 3, "{choices:?}");
        assert_eq!(
            choices.get(&key("Vulkan|llvmpipe|a b", Conv2dOp::BackwardWeight, 8)),
            Some(&pixels)
        );
        assert_eq!(
            choices.get(&key("Vulkan|llvmpipe|a b", Conv2dOp::Forward, 8)),
            Some(&Conv2dAlgo::Direct)
        );
        assert_eq!(
            choices.get(&key("Gl|llvmpipe|c", Conv2dOp::BackwardWeight, 8)),
            Some(&Conv2dAlgo::GemmShared)
        );
        assert_eq!(choices.get(&key("Vulkan|llvmpipe|a b", Conv2dOp::BackwardWeight, 4)), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    #[cfg(not(target_arch = "wasm32"))]
    fn a_corrupt_unreadable_or_other_version_cache_file_is_ignored() {
        let dir = cache_dir("cache-corrupt");
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("autotune.txt");
        let good_line = "conv2d_forward\t8 64 8 8 64 3 3 1 1\tblocked\tVulkan|x";
        let header = autotune::header();
        let other_kernels =
            format!("syncstep-autotune {} 0123456789abcdef", env!("CARGO_PKG_VERSION"));
        for corrupt in [
            b"\xff\xfe not text".to_vec(),
            format!("{good_line}\n").into_bytes(), // no header
            format!("{header}\n{good_line}\nconv2d_forward\t8 64 8\tblocked\tVulkan|x\n").into_bytes(), // a short shape
            format!("{header}\n{good_line}\nconv2d_forward\t8 64 8 8 64 3 3 1 1\tgemm-pixels-3x3\tVulkan|x\n").into_bytes(),
            format!("syncstep-autotune 0.0.0-other\n{good_line}\n").into_bytes(),
            format!("{other_kernels}\n{good_line}\n").into_bytes(),
        ] {
            std::fs::write(&file, &corrupt).unwrap();
            assert!(autotune::load(&file).is_empty(), "{}", String::from_utf8_lossy(&corrupt));
        }
        std::fs::write(&file, format!("{header}\n{good_line}\n")).unwrap();
        assert_eq!(autotune::load(&file).len(), 1, "the same lines with nothing wrong are read");
        // A directory where the file should be: unreadable and unwritable, still no error.
        let blocked = dir.join("a directory");
        std::fs::create_dir_all(&blocked).unwrap();
        autotune::remember(&blocked, &key("Vulkan|x", Conv2dOp::Forward, 1), Conv2dAlgo::Blocked);
        assert!(autotune::load(&blocked).is_empty());
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2, "no temporary file is left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    #[cfg(not(target_arch = "wasm32"))]
    fn the_cache_file_follows_the_environment() {
        use std::path::PathBuf;
        let os = |s: &str| Some(std::ffi::OsString::from(s));
        let path = autotune::cache_path_from;
        assert_eq!(
            path(os("/t/choices.txt"), os("/x"), os("/h")),
            Some(PathBuf::from("/t/choices.txt"))
        );
        assert_eq!(path(os("off"), os("/x"), os("/h")), None);
        assert_eq!(path(None, os("/x"), os("/h")), Some(PathBuf::from("/x/syncstep/autotune.txt")));
        assert_eq!(
            path(os(""), os("relative"), os("/h")),
            Some(PathBuf::from("/h/.cache/syncstep/autotune.txt"))
        );
        assert_eq!(path(None, None, None), None);
    }

    #[test]
    fn algo_names_round_trip() {
        for algo in Conv2dAlgo::all() {
            assert_eq!(Conv2dAlgo::parse(&algo.to_string()), Some(algo));
        }
        assert_eq!(
            Conv2dAlgo::parse("GEMM-Pixels-8x8"),
            Some(Conv2dAlgo::Gemm(GemmTile {
                lanes: GemmLanes::Pixels,
                per_invocation: 8,
                per_workgroup: 8
            }))
        );
        assert_eq!(Conv2dAlgo::parse("gemm-pixels-3x3"), None);
    }
}
