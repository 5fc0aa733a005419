//! The weight gradient of the 3×3 stride-1 convolutions on large maps by Winograd, the forward's
//! tile differentiated: each example's gradient is Gᵀ [Σ_tiles (A dy Aᵀ) ⊙ (Bᵀ d B)] G. A chunk
//! of whole examples at a time: the input's and dy's transforms with each example's tiles
//! contiguous, one GEMM per (position, example) summing over that example's tiles in order, the
//! transform back into each example's gradient, and conv2d_backward_weight_units adding the
//! examples into the pairwise blocks; then their total, as every weight-gradient variant ends.
//! shaders/conv2d/winograd.wgsl says what each kernel computes.
//!
//! An example's gradient is computed on its own, whatever the batch and the chunks, and the
//! examples are summed in the canonical pairwise order, so the batch, the shards and the chunks
//! never change a bit. F(4×4, 3×3) multiplies 36 times per tile and weight where the plain sum
//! multiplies 144 times per 4×4 outputs and weight.

use super::backward_weight::{open_blocks, push_units, weight_total};
use super::gemm::{gemm, Gemm, GemmBatch, PixelGrid, Weights};
use super::scratch;
use super::winograd::{
    expect_gemm, gemm_algo_for, scratch_cap, Params, WinogradTile, PRODUCT_BYTES, WINOGRAD_WG,
};
use super::Device;
use super::{checked, Conv2dAlgo, Conv2dOp, Conv2dShape};
use crate::{launch, KernelError, Result};
use syncstep_gpu::{grid_1d, Encoder, Gpu, Slice};

const OP: &str = "conv2d_backward_weight";

/// A chunk of `images`' temporaries, lengths in elements: the transformed input and dy in the
/// im2col scratch (dy's from `dt_at`, a multiple of 64 elements: 256 bytes, where a storage
/// binding may start), and there too, once the GEMMs have read them, the examples' gradients
/// (`units`); the GEMMs' products in a scratch slot of their own (`scratch::WEIGHT_UNITS`).
struct Layout {
    tiles_k: u64,
    vt: u64,
    dt_at: u64,
    dt: u64,
    m: u64,
    units: u64,
}

impl Layout {
    fn new(s: &Conv2dShape, tile: WinogradTile, images: u64) -> Layout {
        let (tiles_h, tiles_w) = tile.tiles(s.h, s.w);
        let tiles_k = (tiles_h as u64 * tiles_w as u64).next_multiple_of(4);
        let slabs = tile.positions() * images;
        let vt = slabs * s.c_in as u64 * tiles_k;
        let dt = slabs * s.c_out as u64 * tiles_k;
        let m = slabs * s.c_out as u64 * s.c_in as u64;
        let units = images * s.w_len();
        Layout { tiles_k, vt, dt_at: vt.next_multiple_of(64), dt, m, units }
    }

    /// Elements of the im2col scratch it takes.
    fn im2col(&self) -> u64 {
        (self.dt_at + self.dt).max(self.units)
    }
}

/// Images per chunk: as many as keep the transforms and gradients within `cap_bytes` and the
/// products within [`PRODUCT_BYTES`], at least one.
fn chunk_images(s: &Conv2dShape, tile: WinogradTile, cap_bytes: u64) -> u32 {
    let fits = |images| {
        let l = Layout::new(s, tile, images);
        l.im2col() * 4 <= cap_bytes && l.m * 4 <= PRODUCT_BYTES.min(cap_bytes)
    };
    (1..=s.n as u64).rev().find(|&images| fits(images)).unwrap_or(1) as u32
}

/// The GEMM of one (position, example) as a 1×1 convolution: K the example's tiles, the input's
/// channels as pixels, the output's channels as rows; the variant the policy chooses for it.
pub(super) fn winograd_weight_gemm_algo(gpu: &Device, s: &Conv2dShape) -> Result<Conv2dAlgo> {
    let tile = WinogradTile::for_map(s.h, s.w);
    let images = chunk_images(s, tile, scratch_cap(gpu));
    let tiles_k = Layout::new(s, tile, 1).tiles_k as u32;
    let g = Conv2dShape { n: images, c_in: tiles_k, h: 1, w: s.c_in, kh: 1, kw: 1, pad: 0, ..*s };
    gemm_algo_for(gpu, &g)
}

/// The weight gradient dw of `s` (dy, x → dw) by Winograd, its GEMMs run by `gemm_algo` (a
/// register-tiled or shared-tile GEMM).
pub fn conv2d_winograd_weight_with(
    gpu: &Gpu,
    enc: &mut Encoder,
    gemm_algo: Conv2dAlgo,
    s: &Conv2dShape,
    dy: Slice,
    x: Slice,
    dw: Slice,
) -> Result<()> {
    checked(gpu, Conv2dOp::BackwardWeight, s, [dy, x, dw])?;
    let Some(tile) = s.winograd(Conv2dOp::BackwardWeight) else {
        let problem = format!("{s:?} is not a weight gradient Winograd takes");
        return Err(KernelError::Arg { op: OP, arg: "shape", problem });
    };
    expect_gemm(Conv2dOp::BackwardWeight, gemm_algo)?;
    let chunk = chunk_images(s, tile, scratch_cap(gpu));
    let layout = Layout::new(s, tile, chunk as u64);
    let gpu_err = |source| KernelError::Gpu { op: OP, source };
    let scratch = gpu.scratch(scratch::IM2COL, layout.im2col()).map_err(gpu_err)?;
    let products = gpu.scratch(scratch::WEIGHT_UNITS, layout.m).map_err(gpu_err)?;
    // The pairwise blocks: the carry's level (unused: chunks end on whole examples) and one per
    // block open at a chunk's end.
    let open = open_blocks(s.n as u64, chunk as u64, 1);
    let sums_len = (1 + open as u64) * s.w_len();
    let sums = gpu.scratch(scratch::WEIGHT_SUMS, sums_len).map_err(gpu_err)?;
    let sums = Slice::new(&sums, 0, sums_len);
    let (tiles_h, tiles_w) = tile.tiles(s.h, s.w);
    let base = Params {
        images: 0,
        first_image: 0,
        c_gemm: s.c_in,
        r_out: s.c_out,
        h: s.h,
        w: s.w,
        tiles_h,
        tiles_w,
        slab_v: 0,
        slab_u: 0,
        slab_m: 0,
        rotate: 0,
        tiles_k: layout.tiles_k as u32,
    };
    // dw's rows in vec4s, whole: c_in is a multiple of 4.
    let row4 = s.c_in * 9 / 4;
    for first in (0..s.n).step_by(chunk as usize) {
        let images = chunk.min(s.n - first);
        let part = Layout::new(s, tile, images as u64);
        let params =
            Params { images, first_image: first, slab_m: images * s.c_out * s.c_in, ..base };
        let vt = Slice::new(&scratch, 0, part.vt);
        let dt = Slice::new(&scratch, part.dt_at * 4, part.dt);
        let m = Slice::new(&products, 0, part.m);
        let units = Slice::new(&scratch, 0, part.units);
        let how = (s, tile, gemm_algo, row4);
        chunk_of_examples(gpu, enc, how, params, [dy, x, vt, dt, m, units, sums])?;
    }
    weight_total(gpu, enc, s, super::Params { row4, ..s.params() }, sums, dw)
}

/// One chunk of examples: the transforms of x into `vt` and of dy into `dt`, a GEMM per
/// (position, example) into `m`, the transform back into `units`, and their pairwise push.
fn chunk_of_examples(
    gpu: &Gpu,
    enc: &mut Encoder,
    (s, tile, gemm_algo, row4): (&Conv2dShape, WinogradTile, Conv2dAlgo, u32),
    params: Params,
    [dy, x, vt, dt, m, units, sums]: [Slice; 7],
) -> Result<()> {
    let (images, tiles_k) = (params.images as u64, params.tiles_k as u64);
    let (c_in, c_out) = (s.c_in as u64, s.c_out as u64);
    let shader = tile.shader();
    let grid = grid_1d(images * tiles_k * c_in / 4, WINOGRAD_WG);
    let bindings = [("x", x), ("winograd input tiles", vt)];
    launch(gpu, enc, OP, &shader, "winograd_input_tiles", &params, &bindings, grid)?;
    let grid = grid_1d(images * tiles_k * c_out / 4, WINOGRAD_WG);
    let bindings = [("dy", dy), ("winograd dy tiles", dt)];
    launch(gpu, enc, OP, &shader, "winograd_dy_tiles", &params, &bindings, grid)?;
    let pixels = PixelGrid {
        images: 1,
        grid_h: 1,
        grid_w: s.c_in,
        channels: s.c_out,
        out_h: 1,
        out_w: s.c_in,
        step: 1,
        origin_y: 0,
        origin_x: 0,
    };
    let batch = GemmBatch {
        count: (tile.positions() * images) as u32,
        a: c_in * tiles_k / 4,
        b: c_out * tiles_k / 4,
        out: c_out * c_in,
    };
    // An example's sum over its tiles is one segment, in order.
    let k = (tiles_k / 4, tiles_k / 4);
    gemm(gpu, enc, OP, gemm_algo, &pixels, (0, c_in), k, (vt, Weights::Rows(dt), m), batch)?;
    let grid = grid_1d(images * c_out * c_in, WINOGRAD_WG);
    let bindings = [("winograd products", m), ("weight units", units)];
    launch(gpu, enc, OP, &shader, "winograd_weight_grad", &params, &bindings, grid)?;
    let gemm = Gemm {
        row4,
        pixel_begin: params.first_image,
        pixel_count: params.images,
        channels: s.c_out,
        out_plane: 1,
        unit_pixels: 1,
        ..bytemuck::Zeroable::zeroed()
    };
    push_units(gpu, enc, s, &gemm, units, sums)
}
