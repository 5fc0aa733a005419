//! Conv2d without bias: forward, input-VJP (a gather) and weight gradient, NCHW activations and
//! OIHW weights. The shaders are shaders/conv2d/, whose files say what is subtle.
//!
//! Each op has a plain kernel ([`Conv2dAlgo::Direct`], one output element per invocation) and a
//! register-blocked one ([`Conv2dAlgo::Blocked`], a register tile per invocation). All three also
//! run as an explicit GEMM over im2col rows ([`Conv2dAlgo::Gemm`]: register tiles, no workgroup
//! memory, for CPU drivers, where barriers are slow; the weight gradient's GEMM reads the
//! forward's im2col rows against dy in place), and as the implicit-GEMM family
//! ([`Conv2dAlgo::Implicit`]: tiles staged in workgroup memory, operands gathered in place, for
//! GPUs). Every variant sums each output in the same order, so they agree bit for bit and the
//! choice never changes a result.
//!
//! The plain launchers (`conv2d_forward`, …) run only the taps that read the input where
//! some read nothing but padding ([`Conv2dShape::crop`]), and pick the variant with
//! [`conv2d_algo`] (tune/) by the device's [`KernelPolicy`]: a forced variant
//! (`SYNCSTEP_CONV_ALGO`), else the GPU plan on GPUs, else the fastest candidate timed on the
//! adapter at that shape on first use (natively; in a browser there is no clock, so a guess by
//! device type). The `_with` launchers take the variant and
//! the whole kernel.
//!
//! Files: `shape` (shapes, limits, the uniform), `crop`, one per direction (`forward`,
//! `backward_data`, `backward_weight`), `gemm` (im2col and the GEMM launch), `tiles` (the
//! register tiles' WGSL, written per tile shape), `implicit` (the GPU family), `tune` (choosing
//! a variant).

use std::fmt;

use serde::{Deserialize, Serialize};

use super::{shader_source, KernelError, Result};
use syncstep_gpu::{Encoder, Shader, Slice};

mod backward_data;
mod backward_weight;
mod crop;
mod forward;
mod gemm;
pub mod implicit;
mod laid;
mod scratch;
mod shape;
mod tiles;
mod tune;
mod winograd;
mod winograd_weight;

pub use backward_data::conv2d_backward_input_with;
pub use backward_weight::conv2d_backward_weight_with;
pub use crop::{conv2d_launch_cropped, conv2d_launch_kept, crop_weights, Crop};
pub use forward::conv2d_forward_with;
pub use laid::WeightRows;
pub use shape::Conv2dShape;
#[cfg(not(target_arch = "wasm32"))]
pub use tune::autotune_cache_path;
pub use tune::{
    autotuned_algo, candidates, conv2d_algo, implicit_plan, parse_forced, runs_gpu_kernels, Device,
    DeviceConfig, Forced, KernelPlan, KernelPolicy,
};
use winograd::winograd_gemm_algo;
pub use winograd::{conv2d_winograd_with, winograd_chunk_images, WinogradTile};
use winograd_weight::winograd_weight_gemm_algo;

pub(crate) use implicit::FRAME as IMPLICIT;
use shape::{checked, tile_count, Params};
pub(crate) use tiles::TILES;
pub(crate) use winograd::{WINOGRAD_F2, WINOGRAD_F4};
pub use winograd_weight::conv2d_winograd_weight_with;

/// The base module: every kernel but the register-tiled GEMMs (`tiles` makes those).
pub(crate) const SHADER: Shader = Shader::file(
    "conv2d",
    shader_source!(
        "conv2d/common.wgsl",
        "conv2d/forward.wgsl",
        "conv2d/backward_data.wgsl",
        "conv2d/backward_weight.wgsl",
        "conv2d/im2col.wgsl",
        "conv2d/gemm.wgsl",
        "conv2d/crop.wgsl",
    ),
);
pub(super) const WG: u32 = 64;
/// The blocked kernels' tile edge: 4 channels × 4 pixels per invocation; the weight gradient's
/// tile is 4·TILE output × TILE input channels (WB_CO in the shader).
pub(super) const TILE: u64 = 4;
/// vec4s one im2col or weight-rows invocation writes (`ROW_RUN` in the shader).
pub(super) const ROW_RUN: u64 = 48;
/// conv2d_gemm_lanes' workgroup size.
pub(super) const GEMM_WG: u32 = 64;
/// The im2col scratch buffer holds at most this many bytes (and no more than a storage binding
/// may): larger problems run in chunks of pixels.
pub(super) const SCRATCH_BYTES: u64 = 64 << 20;

/// Which kernels a launch records. Stored by its name (`Display`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Conv2dAlgo {
    /// One output element per invocation: the plain, obviously correct version.
    Direct,
    /// A register tile per invocation (4 channels × 4 pixels; for the weight gradient 16 output
    /// × 4 input channels, tap by tap), no workgroup memory, no scratch.
    Blocked,
    /// im2col into a scratch buffer, then a GEMM with a register tile per invocation and no
    /// workgroup memory (CPU drivers).
    Gemm(GemmTile),
    /// The implicit-GEMM family (implicit/): register-blocked tiles of up to 8×8 outputs per
    /// invocation on operands staged in workgroup memory, gathered straight from NCHW (GPUs).
    Implicit,
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
/// `channels` or `gather`). Several sizes, because the best one depends on how many accumulators
/// a compiler keeps in registers before it spills (32 or so on some), and lanes of both kinds,
/// because pixel lanes fill a workgroup on large maps and channel lanes on the 2×2 and 1×1 maps
/// of the late stages. The weight gradient uses the same tiles with k (the weights' (ci, ky,
/// kx), in vec4s of 4) in place of pixels, so a tile holds as many outputs, each with a row and
/// an example sum. docs/performance-log.md says which the autotune picked where.
pub const GEMM_TILES: [GemmTile; 13] = [
    GemmTile { lanes: GemmLanes::Pixels, per_invocation: 4, per_workgroup: 8 },
    GemmTile { lanes: GemmLanes::Pixels, per_invocation: 8, per_workgroup: 4 },
    GemmTile { lanes: GemmLanes::Pixels, per_invocation: 8, per_workgroup: 8 },
    GemmTile { lanes: GemmLanes::Channels, per_invocation: 4, per_workgroup: 8 },
    GemmTile { lanes: GemmLanes::Channels, per_invocation: 8, per_workgroup: 4 },
    GemmTile { lanes: GemmLanes::Channels, per_invocation: 8, per_workgroup: 8 },
    GemmTile { lanes: GemmLanes::Channels, per_invocation: 8, per_workgroup: 12 },
    GemmTile { lanes: GemmLanes::ChannelsGather, per_invocation: 4, per_workgroup: 8 },
    GemmTile { lanes: GemmLanes::ChannelsGather, per_invocation: 8, per_workgroup: 8 },
    // 16 rows shared by the workgroup: two loads and sixteen broadcasts where the device
    // broadcasts (Gpu::broadcasts).
    GemmTile { lanes: GemmLanes::Pixels, per_invocation: 4, per_workgroup: 16 },
    GemmTile { lanes: GemmLanes::Channels, per_invocation: 4, per_workgroup: 16 },
    GemmTile { lanes: GemmLanes::ChannelsGather, per_invocation: 4, per_workgroup: 16 },
    // 32 output channels shared: the weight gradient's widest tile, four loads and thirty-two
    // broadcasts of dy per vec4 of k.
    GemmTile { lanes: GemmLanes::Pixels, per_invocation: 4, per_workgroup: 32 },
];

impl Conv2dAlgo {
    /// Every variant: what `SYNCSTEP_CONV_ALGO` accepts and what the tests run.
    pub fn all() -> Vec<Conv2dAlgo> {
        let mut all = vec![Conv2dAlgo::Direct, Conv2dAlgo::Blocked];
        all.extend(GEMM_TILES.iter().map(|&t| Conv2dAlgo::Gemm(t)));
        all.push(Conv2dAlgo::Implicit);
        all
    }

    /// Parses the names `Display` writes: `direct`, `blocked`, `gemm-pixels-8x8`, `implicit-gemm`.
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

/// A name that is no [`Conv2dAlgo`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no convolution variant is named `{name}`")]
pub struct UnknownAlgo {
    pub name: String,
}

impl TryFrom<String> for Conv2dAlgo {
    type Error = UnknownAlgo;
    fn try_from(name: String) -> std::result::Result<Self, UnknownAlgo> {
        Conv2dAlgo::parse(&name).ok_or(UnknownAlgo { name })
    }
}

impl From<Conv2dAlgo> for String {
    fn from(algo: Conv2dAlgo) -> String {
        algo.to_string()
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
            Conv2dAlgo::Implicit => write!(f, "implicit-gemm"),
        }
    }
}

/// The three launches of a convolution, for [`conv2d_algo`]. Stored by the launcher's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Conv2dOp {
    #[serde(rename = "conv2d_forward")]
    Forward,
    #[serde(rename = "conv2d_backward_input")]
    BackwardInput,
    #[serde(rename = "conv2d_backward_weight")]
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

/// `y = conv(x, w)`: `x` \[n,c_in,h,w\], `w` \[c_out,c_in,kh,kw\], `y` \[n,c_out,out_h,out_w\]
/// (overwritten). The variant is [`conv2d_algo`]'s choice.
pub fn conv2d_forward(
    gpu: &Device,
    enc: &mut Encoder,
    shape: &Conv2dShape,
    x: Slice,
    w: Slice,
    y: Slice,
) -> Result<()> {
    conv2d_launch(gpu, enc, Conv2dOp::Forward, shape, x, w, y)
}

/// The input-VJP `dx = convᵀ(dy, w)`, a gather over output positions: `dy`
/// \[n,c_out,out_h,out_w\], `w` \[c_out,c_in,kh,kw\], `dx` \[n,c_in,h,w\] (overwritten). The
/// variant is [`conv2d_algo`]'s choice.
pub fn conv2d_backward_input(
    gpu: &Device,
    enc: &mut Encoder,
    shape: &Conv2dShape,
    dy: Slice,
    w: Slice,
    dx: Slice,
) -> Result<()> {
    conv2d_launch(gpu, enc, Conv2dOp::BackwardInput, shape, dy, w, dx)
}

/// The weight gradient `dw = Σ_{n,oy,ox} dy ⊗ x-window`, summed in a fixed order: `dy`
/// \[n,c_out,out_h,out_w\], `x` \[n,c_in,h,w\], `dw` \[c_out,c_in,kh,kw\] (overwritten, not
/// accumulated). The variant is [`conv2d_algo`]'s choice.
pub fn conv2d_backward_weight(
    gpu: &Device,
    enc: &mut Encoder,
    shape: &Conv2dShape,
    dy: Slice,
    x: Slice,
    dw: Slice,
) -> Result<()> {
    conv2d_launch(gpu, enc, Conv2dOp::BackwardWeight, shape, dy, x, dw)
}

/// Records `op` with `algo`: forward (x, w → y), input-VJP (dy, w → dx) or weight gradient
/// (dy, x → dw), for callers that take the op as a value (the autotune, `syncstep bench`).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_launch_with(
    gpu: &Device,
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

/// `op` by the implicit-GEMM family, on the plan `gpu`'s policy keeps for `shape`
/// ([`implicit_plan`]); the operands as [`conv2d_launch_with`] takes them.
fn implicit_launch(
    gpu: &Device,
    enc: &mut Encoder,
    op: Conv2dOp,
    shape: &Conv2dShape,
    operands: (Slice, Slice, Slice),
) -> Result<()> {
    match implicit_plan(gpu, op, shape)? {
        implicit::Plan::Gather(plan) => implicit::gather_gemm(gpu, enc, op, shape, plan, operands),
        implicit::Plan::Weight(plan) => {
            implicit::weight_gradient_with(gpu, enc, shape, plan, operands)
        }
    }
}

/// `op` as the plain launchers run it: on the cropped kernel where [`Conv2dShape::crop`] finds
/// one, with [`conv2d_algo`]'s variant for the shape it runs (see [`conv2d_choice`]).
pub fn conv2d_launch(
    gpu: &Device,
    enc: &mut Encoder,
    op: Conv2dOp,
    shape: &Conv2dShape,
    a: Slice,
    b: Slice,
    out: Slice,
) -> Result<()> {
    checked(gpu, op, shape, [a, b, out])?;
    if runs_winograd(gpu, op, shape)?.is_some() {
        let gemm_algo = winograd_algo(gpu, op, shape)?;
        if op == Conv2dOp::BackwardWeight {
            return conv2d_winograd_weight_with(gpu, enc, gemm_algo, shape, a, b, out);
        }
        return conv2d_winograd_with(gpu, enc, op, gemm_algo, shape, a, b, out);
    }
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

/// The Winograd tile [`conv2d_launch`] runs `op` at `shape` in on `gpu`, if it runs Winograd.
fn runs_winograd(gpu: &Device, op: Conv2dOp, shape: &Conv2dShape) -> Result<Option<WinogradTile>> {
    let on = gpu.policy().winograd_on(gpu);
    Ok(shape.winograd(op).filter(|_| on))
}

/// The variant of the GEMMs of `op`'s Winograd at `shape`.
fn winograd_algo(gpu: &Device, op: Conv2dOp, shape: &Conv2dShape) -> Result<Conv2dAlgo> {
    match op {
        Conv2dOp::BackwardWeight => winograd_weight_gemm_algo(gpu, shape),
        _ => winograd_gemm_algo(gpu, op, shape),
    }
}

/// How [`conv2d_launch`] runs `op` at `shape`, as `syncstep bench` names it: the variant, or
/// its Winograd tile (`winograd-2x2`, `winograd-4x4`) and its GEMMs' variant.
pub fn conv2d_kernel_name(gpu: &Device, op: Conv2dOp, shape: &Conv2dShape) -> Result<String> {
    if let Some(tile) = runs_winograd(gpu, op, shape)? {
        return Ok(format!("{tile} {}", winograd_algo(gpu, op, shape)?));
    }
    Ok(conv2d_choice(gpu, op, shape)?.0.to_string())
}

/// What [`conv2d_launch`] runs for `op` at `shape`: the variant, and the crop it runs it on
/// (None: the whole kernel). The implicit-GEMM family leaves out the taps that read only
/// padding itself, so it runs the whole kernel. A weight gradient into a buffer without
/// COPY_DST is not cropped.
pub fn conv2d_choice(
    gpu: &Device,
    op: Conv2dOp,
    shape: &Conv2dShape,
) -> Result<(Conv2dAlgo, Option<Crop>)> {
    shape.validate(op.name())?;
    let crop = shape.crop();
    let algo = conv2d_algo(gpu, op, crop.as_ref().map_or(shape, |c| &c.shape))?;
    Ok((algo, crop.filter(|_| algo != Conv2dAlgo::Implicit)))
}

pub(super) fn no_kernel(op: &'static str, algo: Conv2dAlgo) -> KernelError {
    KernelError::Arg { op, arg: "algo", problem: format!("is {algo}, which has no {op} kernel") }
}

#[cfg(test)]
mod tests {
    use super::*;

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
