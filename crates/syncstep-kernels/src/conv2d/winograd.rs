//! Winograd F(m×m, 3×3) for the 3×3 convolutions of stride 1 and padding 1, forward and
//! input-VJP: the weights' transform, then, a chunk of images at a time, the input's transform,
//! one GEMM per position of the (m + 2)×(m + 2) transformed tiles (conv2d's GEMMs, register or
//! shared tiles, summing over channels in order; all of them in one dispatch) and the output's
//! transform. shaders/conv2d/winograd.wgsl says what each kernel computes.
//!
//! F(4×4, 3×3) multiplies 36 times per 4×4 outputs and channel, F(2×2, 3×3) 16 times per 2×2,
//! where the plain sum multiplies 144 and 36 times. Both round differently from it, F(4×4) more
//! (its transforms scale by up to 5 and 1/24), so it takes the large maps only
//! ([`WinogradTile::for_map`]). The plain launchers take Winograd where the device's kernel
//! policy says so ([`KernelPolicy::winograd`](super::KernelPolicy)) and the shape is one of
//! these ([`Conv2dShape::winograd`]), a rule that does not look at the batch, so every replica
//! and the single device make the same choice for every layer.

use super::gemm::{gemm, GemmBatch, PixelGrid, Weights};
use super::scratch;
use super::tune::guess_for;
use super::Device;
use super::{
    checked, conv2d_algo, shader_source, Conv2dAlgo, Conv2dOp, Conv2dShape, SCRATCH_BYTES,
};
use crate::{launch, KernelError, Result};
use syncstep_gpu::{grid_1d, Encoder, Gpu, Shader, Slice};

pub(crate) const WINOGRAD_F2: Shader = Shader::file(
    "conv2d winograd 2x2",
    shader_source!("conv2d/winograd_f2.wgsl", "conv2d/winograd.wgsl"),
);
pub(crate) const WINOGRAD_F4: Shader = Shader::file(
    "conv2d winograd 4x4",
    shader_source!("conv2d/winograd_f4.wgsl", "conv2d/winograd.wgsl"),
);
pub(super) const WINOGRAD_WG: u32 = 64;
/// The GEMMs' products take at most this many bytes: a chunk of images at a time.
pub(super) const PRODUCT_BYTES: u64 = 8 << 20;
/// The smallest map (each side) taken: on 2×2 maps a tile is the whole map, and the transforms
/// cost more than the multiplies they save.
const WINOGRAD_MIN_SIDE: u32 = 4;
/// The smallest map (each side) F(4×4, 3×3) takes. Below it, at small images, the BatchNorms
/// downstream normalise over few values and amplify its rounding: at 32×32 (layer1's 8×8 maps,
/// layer2's 4×4), batch 6, it put the step 1.8e-4 from the f64 reference, where F(2×2) puts it
/// 5.0e-5 and the TIE gate allows 1e-4.
const WINOGRAD_F4_MIN_SIDE: u32 = 14;
/// The smallest map (each side) whose weight gradient Winograd takes: each example's gradient is
/// written out in Winograd's domain (36 values per weight where the plain sum keeps 9), and on
/// smaller maps an example has too few tiles (16 at 14×14) to pay for that.
const WINOGRAD_WEIGHT_MIN_SIDE: u32 = 28;

/// Winograd's tile: F(2×2, 3×3) or F(4×4, 3×3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WinogradTile {
    F2,
    F4,
}

impl WinogradTile {
    /// The tile for maps of `h`×`w`.
    pub(super) fn for_map(h: u32, w: u32) -> WinogradTile {
        if h.min(w) >= WINOGRAD_F4_MIN_SIDE {
            WinogradTile::F4
        } else {
            WinogradTile::F2
        }
    }

    /// Outputs of a tile, each side.
    pub(super) fn out(self) -> u32 {
        match self {
            WinogradTile::F2 => 2,
            WinogradTile::F4 => 4,
        }
    }

    /// Positions of a transformed tile: one GEMM each.
    pub(super) fn positions(self) -> u64 {
        (self.out() as u64 + 2).pow(2)
    }

    pub(super) fn shader(self) -> Shader {
        match self {
            WinogradTile::F2 => WINOGRAD_F2,
            WinogradTile::F4 => WINOGRAD_F4,
        }
    }

    /// Tiles of a map of `h`×`w`, each side.
    pub(super) fn tiles(self, h: u32, w: u32) -> (u32, u32) {
        (h.div_ceil(self.out()), w.div_ceil(self.out()))
    }
}

impl std::fmt::Display for WinogradTile {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "winograd-{0}x{0}", self.out())
    }
}

/// `struct Winograd` of shaders/conv2d/winograd.wgsl.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct Params {
    pub(super) images: u32,
    pub(super) first_image: u32,
    pub(super) c_gemm: u32,
    pub(super) r_out: u32,
    pub(super) h: u32,
    pub(super) w: u32,
    pub(super) tiles_h: u32,
    pub(super) tiles_w: u32,
    pub(super) slab_v: u32,
    pub(super) slab_u: u32,
    pub(super) slab_m: u32,
    pub(super) rotate: u32,
    pub(super) tiles_k: u32,
}

impl Conv2dShape {
    /// Winograd's tile for `op` at this shape, if it computes it: a 3×3 kernel, stride 1,
    /// padding 1, on maps of at least `WINOGRAD_MIN_SIDE` a side, with channels in multiples of
    /// 4 (the GEMMs' rows are whole vec4s); F(4×4, 3×3) on maps of at least
    /// `WINOGRAD_F4_MIN_SIDE`; the weight gradient on maps of at least
    /// `WINOGRAD_WEIGHT_MIN_SIDE`. The batch plays no part.
    pub fn winograd(&self, op: Conv2dOp) -> Option<WinogradTile> {
        let side = self.h.min(self.w);
        let takes = (self.kh, self.kw, self.stride, self.pad) == (3, 3, 1, 1)
            && side >= WINOGRAD_MIN_SIDE
            && self.c_in.is_multiple_of(4)
            && self.c_out.is_multiple_of(4)
            && (op != Conv2dOp::BackwardWeight || side >= WINOGRAD_WEIGHT_MIN_SIDE);
        takes.then(|| WinogradTile::for_map(self.h, self.w))
    }
}

/// The GEMM of one position at a chunk of `images`: `tiles` rows of K = c_gemm against r_out
/// rows, as a 1×1 convolution of that size, whose variant the policy chooses for the Winograd
/// GEMMs ([`winograd_gemm_shape`]).
fn winograd_gemm_shape(s: &Conv2dShape, op: Conv2dOp, images: u32) -> Conv2dShape {
    let (c_gemm, r_out) = gemm_channels(s, op);
    let (tiles_h, tiles_w) = WinogradTile::for_map(s.h, s.w).tiles(s.h, s.w);
    Conv2dShape {
        n: images,
        c_in: c_gemm,
        h: tiles_h,
        w: tiles_w,
        c_out: r_out,
        kh: 1,
        kw: 1,
        stride: 1,
        pad: 0,
    }
}

/// (K, output channels) of `op`'s GEMMs: the forward sums over c_in into c_out, the input-VJP
/// over c_out into c_in.
fn gemm_channels(s: &Conv2dShape, op: Conv2dOp) -> (u32, u32) {
    match op {
        Conv2dOp::BackwardInput => (s.c_out, s.c_in),
        _ => (s.c_in, s.c_out),
    }
}

/// The variant of `op`'s Winograd GEMMs at `s`, by the device's policy: its choice for the 1×1
/// convolution of the GEMMs' size (timed, forced or planned like any other) where that is a
/// GEMM, else the clockless guess for that convolution, which is one.
pub(super) fn winograd_gemm_algo(
    gpu: &Device,
    op: Conv2dOp,
    s: &Conv2dShape,
) -> Result<Conv2dAlgo> {
    gemm_algo_for(gpu, &winograd_gemm_shape(s, op, winograd_chunk_images(s, op, scratch_cap(gpu))))
}

/// The policy's variant for a Winograd GEMM of the 1×1 convolution `g`'s size: its choice where
/// that is a GEMM, else the clockless guess, which is one.
pub(super) fn gemm_algo_for(gpu: &Device, g: &Conv2dShape) -> Result<Conv2dAlgo> {
    Ok(match conv2d_algo(gpu, Conv2dOp::Forward, g)? {
        algo @ Conv2dAlgo::Gemm(_) => algo,
        _ => guess_for(false, &gpu.info.name, Conv2dOp::Forward, g),
    })
}

/// Whether Winograd's GEMMs can run as `gemm_algo` for `op`: a register-tiled or shared-tile
/// GEMM that has the forward's kernel.
pub(super) fn expect_gemm(op: Conv2dOp, gemm_algo: Conv2dAlgo) -> Result<()> {
    if !matches!(gemm_algo, Conv2dAlgo::Gemm(_)) || !gemm_algo.has(Conv2dOp::Forward) {
        let problem = format!("is {gemm_algo}; Winograd's GEMMs take a GEMM tile");
        return Err(KernelError::Arg { op: op.name(), arg: "algo", problem });
    }
    Ok(())
}

/// Where a launch keeps its temporaries, in scratch buffers of other launches, none of which
/// runs while a Winograd launch does: the transformed weights and then, for a chunk of `images`,
/// the transformed input, one after the other in the im2col scratch (the second from `v_at`, a
/// multiple of 64 elements: 256 bytes, where a storage binding may start); the products in the
/// weight gradients' sums, a buffer of their own (the GEMM writes them while it reads the other
/// two, which one buffer cannot be bound for). Lengths in elements.
#[derive(Debug, PartialEq)]
struct Scratch {
    u: u64,
    v_at: u64,
    v: u64,
    m: u64,
}

impl Scratch {
    fn new(s: &Conv2dShape, op: Conv2dOp, images: u64) -> Scratch {
        let (c_gemm, r_out) = gemm_channels(s, op);
        let tile = WinogradTile::for_map(s.h, s.w);
        let (tiles_h, tiles_w) = tile.tiles(s.h, s.w);
        let tiles = images * tiles_h as u64 * tiles_w as u64;
        let positions = tile.positions();
        let u = positions * r_out as u64 * c_gemm as u64;
        let (v, m) = (positions * tiles * c_gemm as u64, positions * tiles * r_out as u64);
        Scratch { u, v_at: u.next_multiple_of(64), v, m }
    }

    /// Elements of the im2col scratch it takes.
    fn weights_and_input(&self) -> u64 {
        self.v_at + self.v
    }
}

/// Images per chunk: as many as keep the weights and input of `Scratch` within `cap_bytes`
/// and its products within `PRODUCT_BYTES`, at least one.
pub fn winograd_chunk_images(s: &Conv2dShape, op: Conv2dOp, cap_bytes: u64) -> u32 {
    let one = Scratch::new(s, op, 1);
    let inputs = (cap_bytes / 4).saturating_sub(one.v_at) / one.v.max(1);
    let products = PRODUCT_BYTES.min(cap_bytes) / 4 / one.m.max(1);
    inputs.min(products).clamp(1, s.n as u64) as u32
}

/// The most bytes a launch's scratch takes: the plain GEMMs' cap, within a storage binding.
pub(super) fn scratch_cap(gpu: &Gpu) -> u64 {
    SCRATCH_BYTES.min(gpu.limits.max_storage_buffer_binding_size)
}

/// `op` (forward: x, w → y; input-VJP: dy, w → dx) as Winograd, in the tile the shape takes, its
/// GEMMs run by `gemm_algo` (a register-tiled or shared-tile GEMM).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_winograd_with(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: Conv2dOp,
    gemm_algo: Conv2dAlgo,
    s: &Conv2dShape,
    input: Slice,
    w: Slice,
    out: Slice,
) -> Result<()> {
    let name = op.name();
    checked(gpu, op, s, [input, w, out])?;
    let Some(tile) = s.winograd(op).filter(|_| op != Conv2dOp::BackwardWeight) else {
        let problem = format!("{s:?} is not a 3×3, stride 1, padding 1 {name} Winograd takes");
        return Err(KernelError::Arg { op: name, arg: "shape", problem });
    };
    expect_gemm(op, gemm_algo)?;
    let chunk = winograd_chunk_images(s, op, scratch_cap(gpu));
    let layout = Scratch::new(s, op, chunk as u64);
    let gpu_err = |source| KernelError::Gpu { op: name, source };
    let scratch = gpu.scratch(scratch::IM2COL, layout.weights_and_input()).map_err(gpu_err)?;
    let products = gpu.scratch(scratch::WEIGHT_SUMS, layout.m).map_err(gpu_err)?;
    let u = Slice::new(&scratch, 0, layout.u);
    let (c_gemm, r_out) = gemm_channels(s, op);
    let (tiles_h, tiles_w) = tile.tiles(s.h, s.w);
    let base = Params {
        images: 0,
        first_image: 0,
        c_gemm,
        r_out,
        h: s.h,
        w: s.w,
        tiles_h,
        tiles_w,
        slab_v: 0,
        slab_u: r_out * c_gemm,
        slab_m: 0,
        rotate: (op == Conv2dOp::BackwardInput) as u32,
        tiles_k: 0,
    };
    let grid = grid_1d(r_out as u64 * c_gemm as u64 / 4, WINOGRAD_WG);
    let bindings = [("w", w), ("winograd weights", u)];
    launch(gpu, enc, name, &tile.shader(), "winograd_weights", &base, &bindings, grid)?;
    for first in (0..s.n).step_by(chunk as usize) {
        let images = chunk.min(s.n - first);
        let params = Params { images, first_image: first, ..base };
        let part = Scratch::new(s, op, images as u64);
        let v = Slice::new(&scratch, part.v_at * 4, part.v);
        let m = Slice::new(&products, 0, part.m);
        chunk_of_images(gpu, enc, (op, tile, gemm_algo), params, [input, u, v, m, out])?;
    }
    Ok(())
}

/// One chunk of images: the input's transform into `v`, a GEMM per position against `u` into
/// `m`, the output's transform.
fn chunk_of_images(
    gpu: &Gpu,
    enc: &mut Encoder,
    (op, tile, gemm_algo): (Conv2dOp, WinogradTile, Conv2dAlgo),
    params: Params,
    [input, u, v, m, out]: [Slice; 5],
) -> Result<()> {
    let name = op.name();
    let tiles = params.images as u64 * params.tiles_h as u64 * params.tiles_w as u64;
    let (c_gemm, r_out) = (params.c_gemm as u64, params.r_out as u64);
    let (slab_v, slab_m) = (tiles * c_gemm, tiles * r_out);
    let params = Params { slab_v: slab_v as u32, slab_m: slab_m as u32, ..params };
    let bindings = [("input", input), ("winograd input", v)];
    let grid = grid_1d(tiles * c_gemm / 4, WINOGRAD_WG);
    launch(gpu, enc, name, &tile.shader(), "winograd_input", &params, &bindings, grid)?;
    let pixels = PixelGrid {
        images: params.images,
        grid_h: params.tiles_h,
        grid_w: params.tiles_w,
        channels: params.r_out,
        out_h: params.tiles_h,
        out_w: params.tiles_w,
        step: 1,
        origin_y: 0,
        origin_x: 0,
    };
    let batch = GemmBatch {
        count: tile.positions() as u32,
        a: slab_v / 4,
        b: params.slab_u as u64 / 4,
        out: slab_m,
    };
    let operands = (v, Weights::Rows(u), m);
    // Winograd's sums over channels are one segment: its GEMMs fill a GPU side by side.
    let k = (c_gemm / 4, c_gemm / 4);
    gemm(gpu, enc, name, gemm_algo, &pixels, (0, tiles), k, operands, batch)?;
    let bindings = [("winograd products", m), ("output", out)];
    let grid = grid_1d(tiles * r_out, WINOGRAD_WG);
    launch(gpu, enc, name, &tile.shader(), "winograd_output", &params, &bindings, grid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_winograd_kernels_are_valid_wgsl() {
        for shader in [WINOGRAD_F2, WINOGRAD_F4] {
            crate::assert_valid_wgsl(&shader, naga::valid::Capabilities::empty());
        }
    }

    /// The rule looks at the kernel, stride, padding, map and channels, never at the batch.
    #[test]
    fn winograd_takes_3x3_stride_1_on_maps_of_4_or_more_at_any_batch() {
        let layer1 =
            Conv2dShape { n: 8, c_in: 64, h: 8, w: 8, c_out: 64, kh: 3, kw: 3, stride: 1, pad: 1 };
        for n in [1, 3, 8, 256] {
            for (side, tile) in
                [(4, WinogradTile::F2), (13, WinogradTile::F2), (14, WinogradTile::F4)]
            {
                let s = Conv2dShape { n, h: side, w: side + 3, ..layer1 };
                assert_eq!(s.winograd(Conv2dOp::Forward), Some(tile), "{s:?}");
                assert_eq!(s.winograd(Conv2dOp::BackwardInput), Some(tile), "{s:?}");
                assert_eq!(s.winograd(Conv2dOp::BackwardWeight), None);
            }
        }
        for other in [
            Conv2dShape { stride: 2, ..layer1 },
            Conv2dShape { h: 2, w: 2, ..layer1 },
            Conv2dShape { kh: 1, kw: 1, pad: 0, ..layer1 },
            Conv2dShape { c_in: 3, ..layer1 },
        ] {
            assert_eq!(other.winograd(Conv2dOp::Forward), None, "{other:?}");
        }
    }

    /// A chunk's scratch is within the cap and as many images as fit; at least one image.
    #[test]
    fn winograd_chunks_fit_their_scratch() {
        let s = Conv2dShape {
            n: 32,
            c_in: 64,
            h: 56,
            w: 56,
            c_out: 64,
            kh: 3,
            kw: 3,
            stride: 1,
            pad: 1,
        };
        let cap = 16 << 20;
        let images = winograd_chunk_images(&s, Conv2dOp::Forward, cap) as u64;
        assert!((1..32).contains(&images), "{images}");
        let fits = |images| {
            let layout = Scratch::new(&s, Conv2dOp::Forward, images);
            layout.weights_and_input() * 4 <= cap && layout.m * 4 <= PRODUCT_BYTES
        };
        assert!(fits(images) && !fits(images + 1), "as many as fit: {images}");
        let small = Conv2dShape { h: 8, w: 8, ..s };
        assert_eq!(winograd_chunk_images(&small, Conv2dOp::Forward, cap), 32, "at most the batch");
        let huge = Conv2dShape { h: 4096, w: 4096, n: 2, ..s };
        assert_eq!(winograd_chunk_images(&huge, Conv2dOp::Forward, cap), 1);
        let layout = Scratch::new(&s, Conv2dOp::BackwardInput, 3);
        assert!(layout.v_at >= layout.u && layout.v_at.is_multiple_of(64));
    }
}
