//! The convolution as an explicit GEMM for CPU drivers: im2col into scratch, chunk by chunk,
//! each chunk followed by the register-tiled GEMM against the weight rows, whose outputs land
//! straight in NCHW.

use super::scratch;
use super::tiles::gemm_lanes_shader;
use super::{
    no_kernel, Conv2dAlgo, GemmLanes, GemmTile, Params, GEMM_WG, ROW_RUN, SCRATCH_BYTES, SHADER, WG,
};
use crate::{launch, KernelError, Result};
use syncstep_gpu::{grid_1d, Encoder, Gpu, Slice};

/// conv2d_gemm_*'s uniform, mirrored by `struct Gemm` in shaders/conv2d/gemm.wgsl.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct Gemm {
    pub(super) rows_a: u32,
    pub(super) rows_b: u32,
    pub(super) row4: u32,
    pub(super) a_stride: u32,
    pub(super) a_is_pixels: u32,
    pub(super) pixel_begin: u32,
    pub(super) pixel_count: u32,
    pub(super) channels: u32,
    pub(super) grid_w: u32,
    pub(super) grid_h: u32,
    pub(super) grid_plane: u32,
    pub(super) out_w: u32,
    pub(super) out_plane: u32,
    pub(super) step: u32,
    pub(super) origin_y: u32,
    pub(super) origin_x: u32,
    pub(super) unit_pixels: u32,
    pub(super) batch_a: u32,
    pub(super) batch_b: u32,
    pub(super) batch_out: u32,
    pub(super) seg4: u32,
}

/// GEMMs of one size side by side in one dispatch (conv2d_gemm_lanes): `count` of
/// them, each one's a rows `a` vec4s, b rows `b` vec4s and outputs `out` elements after the
/// previous one's.
#[derive(Clone, Copy)]
pub(super) struct GemmBatch {
    pub(super) count: u32,
    pub(super) a: u64,
    pub(super) b: u64,
    pub(super) out: u64,
}

impl GemmBatch {
    pub(super) const ONE: GemmBatch = GemmBatch { count: 1, a: 0, b: 0, out: 0 };
}

/// Where a GEMM's pixels land: the grid (n, a, b) of `grid_h`×`grid_w` pixels per image goes
/// to (origin_y + step·a, origin_x + step·b) of an `out_h`×`out_w` plane with `channels` planes
/// per image.
pub(super) struct PixelGrid {
    pub(super) images: u32,
    pub(super) grid_h: u32,
    pub(super) grid_w: u32,
    pub(super) channels: u32,
    pub(super) out_h: u32,
    pub(super) out_w: u32,
    pub(super) step: u32,
    pub(super) origin_y: u32,
    pub(super) origin_x: u32,
}

impl PixelGrid {
    fn pixels(&self) -> u64 {
        self.images as u64 * self.grid_h as u64 * self.grid_w as u64
    }
}

/// The GEMM's weight operand: rows of `row4` vec4s over the same k as the im2col rows, or (the
/// gathering input-VJP) w itself with the w offset of each k, relative to (0, ci, 0, 0).
#[derive(Clone, Copy)]
pub(super) enum Weights<'a> {
    Rows(Slice<'a>),
    Gather { w: Slice<'a>, taps: Slice<'a>, khw: u32 },
}

/// The GEMM of one pixel chunk: `rows` (im2col, `count` pixels from `begin`, `row4` vec4s each,
/// summed in segments of `seg4`) against `weights` (`grid.channels` rows), into `out`;
/// `batch.count` such GEMMs at once.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: &'static str,
    algo: Conv2dAlgo,
    grid: &PixelGrid,
    (begin, count): (u64, u64),
    (row4, seg4): (u64, u64),
    (rows, weights, out): (Slice, Weights, Slice),
    batch: GemmBatch,
) -> Result<()> {
    let o = operands(algo, grid.channels as u64, count, row4, rows, weights, out);
    let params = Gemm {
        rows_a: o.rows_a as u32,
        rows_b: o.rows_b as u32,
        row4: row4 as u32,
        a_stride: o.a_stride as u32,
        a_is_pixels: o.pixels_are_a as u32,
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
        unit_pixels: 0,
        batch_a: if o.pixels_are_a { batch.a } else { batch.b } as u32,
        batch_b: if o.pixels_are_a { batch.b } else { batch.a } as u32,
        batch_out: batch.out as u32,
        seg4: seg4 as u32,
    };
    // K as the rows hold it, zero-padded to whole vec4s.
    gpu.charge_flops(2.0 * (batch.count as u64 * o.rows_a * o.rows_b * row4 * 4) as f64);
    let Conv2dAlgo::Gemm(tile) = algo else { return Err(no_kernel(op, algo)) };
    let entry = if tile.lanes == GemmLanes::ChannelsGather {
        "conv2d_gemm_gather"
    } else {
        "conv2d_gemm_lanes"
    };
    let groups = o.rows_a.div_ceil(GEMM_WG as u64 * tile.per_invocation as u64)
        * o.rows_b.div_ceil(tile.per_workgroup as u64);
    let shader = gemm_lanes_shader(tile, gpu.broadcasts);
    let [x, y, _] = grid_1d(groups * GEMM_WG as u64, GEMM_WG);
    launch(gpu, enc, op, &shader, entry, &params, &o.bindings, [x, y, batch.count])
}

/// How a GEMM variant takes its operands: a, whose rows its lanes run over, is the pixels or the
/// channels; a's rows, b's, the stride of a's rows in vec4s, and the kernel's bindings.
struct Operands<'a> {
    pixels_are_a: bool,
    rows_a: u64,
    rows_b: u64,
    a_stride: u64,
    bindings: Vec<(&'static str, Slice<'a>)>,
}

/// [`Operands`] of `algo` for `count` pixels' `rows` (`row4` vec4s each) against `channels`
/// rows of `weights`, into `out`.
fn operands<'a>(
    algo: Conv2dAlgo,
    channels: u64,
    count: u64,
    row4: u64,
    rows: Slice<'a>,
    weights: Weights<'a>,
    out: Slice<'a>,
) -> Operands<'a> {
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
        (Conv2dAlgo::Gemm(GemmTile { lanes: GemmLanes::Pixels, .. }), Weights::Rows(weights)) => (
            true,
            count,
            channels,
            row4,
            vec![("im2col", rows), ("weight rows", weights), ("out", out)],
        ),
        _ => unreachable!("{algo} with the other kind of weight operand"),
    };
    Operands { pixels_are_a, rows_a, rows_b, a_stride, bindings }
}

/// Pixels per im2col chunk: a multiple of `unit` pixels, as many rows of `row4` vec4s as the
/// scratch cap and the device's storage-binding limit allow, and no more than `most` pixels
/// unless one unit is more.
pub(super) fn chunk_pixels(
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
pub(super) fn im2col_chunks(
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
        .scratch(scratch::IM2COL, (chunk * row4 * 4).max(4))
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

/// The im2col chunks hold at most this many bytes (within [`SCRATCH_BYTES`]): a chunk of
/// thousands of pixels fills the register tiles' GEMMs as the whole would.
const GEMM_CHUNK_BYTES: u64 = 16 << 20;

/// Pixels of an im2col chunk within [`GEMM_CHUNK_BYTES`], at rows of `row4` vec4s.
pub(super) fn gemm_chunk_pixels(row4: u64) -> u64 {
    (GEMM_CHUNK_BYTES / (row4.max(1) * 16)).max(1)
}

/// im2col, chunk by chunk, each followed by the GEMM against `weights` into `out`.
#[allow(clippy::too_many_arguments)]
pub(super) fn im2col_gemm(
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
    let (row4, seg4) = (im2col.1.row4 as u64, im2col.1.seg4 as u64);
    im2col_chunks(
        gpu,
        enc,
        op,
        im2col,
        (grid.pixels(), 1, gemm_chunk_pixels(row4)),
        source,
        |enc, begin, count, rows| {
            let operands = (rows, weights, out);
            let k = (row4, seg4);
            gemm(gpu, enc, op, algo, grid, (begin, count), k, operands, GemmBatch::ONE)
        },
    )
}
