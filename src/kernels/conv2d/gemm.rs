//! The convolution as an explicit GEMM: im2col into scratch, chunk by chunk, each chunk
//! followed by the GEMM against the weight rows (register tiles, or workgroup-shared tiles on
//! GPUs), whose outputs land straight in NCHW.

use super::tiles::gemm_lanes_shader;
use super::{
    Conv2dAlgo, GemmLanes, GemmTile, Params, GEMM_WG, ROW_RUN, SCRATCH_BYTES, SHADER, SHARED_WG, WG,
};
use crate::gpu::{grid_1d, Encoder, Gpu, Shader, Slice};
use crate::kernels::{launch, replaced, specialise, KernelError, Result};

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
    pub(super) split: u32,
}

/// GEMMs of one size side by side in one dispatch (conv2d_gemm_lanes and _shared): `count` of
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
        split: 0,
    };
    // K as the rows hold it, zero-padded to whole vec4s.
    gpu.charge_flops(2.0 * (batch.count as u64 * o.rows_a * o.rows_b * row4 * 4) as f64);
    if algo == Conv2dAlgo::GemmShared && batch.count == 1 {
        if let Some(segments) = side_by_side(gpu, &o, row4, seg4) {
            return gemm_segments(gpu, enc, op, params, segments, o.bindings);
        }
    }
    let (shader, entry, groups, wg) = match algo {
        Conv2dAlgo::Gemm(tile) => {
            let entry = if tile.lanes == GemmLanes::ChannelsGather {
                "conv2d_gemm_gather"
            } else {
                "conv2d_gemm_lanes"
            };
            let groups = o.rows_a.div_ceil(GEMM_WG as u64 * tile.per_invocation as u64)
                * o.rows_b.div_ceil(tile.per_workgroup as u64);
            (gemm_lanes_shader(tile, gpu.broadcasts), entry, groups, GEMM_WG)
        }
        _ => {
            // The batch fills the dispatch too.
            let wide = gpu.wide_dispatch.div_ceil(batch.count as u64);
            let tile = shared_tile(o.rows_a, o.rows_b, wide);
            let groups = o.rows_a.div_ceil(tile.0) * o.rows_b.div_ceil(tile.1);
            (shared_tile_shader(tile), "conv2d_gemm_shared", groups, SHARED_WG)
        }
    };
    let [x, y, _] = grid_1d(groups * wg as u64, wg);
    launch(gpu, enc, op, &shader, entry, &params, &o.bindings, [x, y, batch.count])
}

/// The segments a shared-tile GEMM takes side by side, one a workgroup along z: all of them,
/// where its outputs alone leave the GPU narrow and the segments' sums of the chunk's outputs
/// fit the scratch (the GPU plan's chunks keep them within [`GPU_CHUNK_BYTES`]).
fn side_by_side(gpu: &Gpu, o: &Operands, row4: u64, seg4: u64) -> Option<u64> {
    let segments = row4.div_ceil(seg4.max(1));
    let tile = shared_tile(o.rows_a, o.rows_b, gpu.wide_dispatch);
    let groups = o.rows_a.div_ceil(tile.0) * o.rows_b.div_ceil(tile.1);
    let bytes = segments * o.rows_a * o.rows_b * 4;
    let fits = bytes <= SCRATCH_BYTES.min(gpu.limits.max_storage_buffer_binding_size);
    (segments > 1 && groups < gpu.wide_dispatch && fits).then_some(segments)
}

/// conv2d_gemm_shared with its `segments` side by side, each segment's sums into a slab the size
/// of the output in scratch, then conv2d_gemm_segments adding them in order into the output.
fn gemm_segments(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: &'static str,
    params: Gemm,
    segments: u64,
    bindings: Vec<(&'static str, Slice)>,
) -> Result<()> {
    let out = bindings[2].1;
    let (rows_a, rows_b) = (params.rows_a as u64, params.rows_b as u64);
    let slab = rows_a * rows_b;
    let slabs = gpu
        .scratch("conv2d weight sums", segments * slab)
        .map_err(|source| KernelError::Gpu { op, source })?;
    let slabs = Slice::new(&slabs, 0, segments * slab);
    let params = Gemm { batch_a: 0, batch_b: 0, batch_out: slab as u32, split: 1, ..params };
    let tile = shared_tile(rows_a, rows_b, gpu.wide_dispatch.div_ceil(segments));
    let groups = rows_a.div_ceil(tile.0) * rows_b.div_ceil(tile.1);
    let [x, y, _] = grid_1d(groups * SHARED_WG as u64, SHARED_WG);
    let split = [bindings[0], bindings[1], ("segment sums", slabs)];
    let shader = shared_tile_shader(tile);
    launch(gpu, enc, op, &shader, "conv2d_gemm_shared", &params, &split, [x, y, segments as u32])?;
    gpu.charge_flops((segments * rows_a * rows_b) as f64);
    let bindings = [("segment sums", slabs), ("out", out)];
    let grid = grid_1d(rows_a * rows_b, WG);
    launch(gpu, enc, op, &SHADER, "conv2d_gemm_segments", &params, &bindings, grid)
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
    Operands { pixels_are_a, rows_a, rows_b, a_stride, bindings }
}

/// The shared-tile GEMM's output tiles, largest first.
const SHARED_TILES: [(u64, u64); 7] =
    [(64, 64), (64, 32), (32, 64), (32, 32), (32, 16), (16, 32), (16, 16)];
/// The smallest of them: square.
const SMALLEST_SHARED_TILE: (u64, u64) = SHARED_TILES[SHARED_TILES.len() - 1];

/// The shared-tile GEMM's output tile (rows of a, rows of b) for `rows_a` × `rows_b` outputs:
/// the largest whose dispatch launches `wide` workgroups, else the smallest, which launches the
/// most that the GEMM has (where that is too few, [`side_by_side`] takes its sums' segments in
/// separate workgroups as well).
pub(super) fn shared_tile(rows_a: u64, rows_b: u64, wide: u64) -> (u64, u64) {
    let fills = |&(a, b): &(u64, u64)| rows_a.div_ceil(a) * rows_b.div_ceil(b) >= wide;
    SHARED_TILES.into_iter().find(fills).unwrap_or(SMALLEST_SHARED_TILE)
}

/// The base module with conv2d_gemm_shared's tile set to `(a, b)`, 16 or 32 or 64 each.
pub(super) fn shared_tile_shader((a, b): (u64, u64)) -> Shader {
    specialise(&SHADER, &format!("shared{a}x{b}"), |source| {
        let consts = [("SHARED_A", 64, a), ("SHARED_B", 64, b), ("SHARED_PA", 4, a / 16)];
        let consts =
            consts.into_iter().chain([("SHARED_PB", 4, b / 16), ("SHARED_ACC", 16, a * b / 256)]);
        consts.fold(source.to_string(), |s, (name, was, is)| {
            replaced(
                &s,
                &format!("const {name}: u32 = {was}u;"),
                &format!("const {name}: u32 = {is}u;"),
            )
        })
    })
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

/// The im2col chunks of the GEMMs that need no more hold at most this many bytes: the
/// forward's, the input-VJP's and the register tiles' weight gradient. A chunk of thousands of
/// pixels fills their GEMMs as the whole would; the GPU plan's weight gradient takes up to
/// [`SCRATCH_BYTES`], whose split needs its chunks wide.
const GEMM_CHUNK_BYTES: u64 = 16 << 20;

/// Pixels of an im2col chunk within [`GEMM_CHUNK_BYTES`], at rows of `row4` vec4s.
pub(super) fn gemm_chunk_pixels(row4: u64) -> u64 {
    (GEMM_CHUNK_BYTES / (row4.max(1) * 16)).max(1)
}

/// The GPU plan's im2col chunks, and the sums of the segments its GEMMs take side by side, hold
/// about this many bytes at most: a chunk of a few thousand pixels fills a GPU already.
pub(super) const GPU_CHUNK_BYTES: u64 = 8 << 20;

/// Pixels of a chunk of `gpu`'s `algo` GEMM with `channels` outputs a pixel, summed over `row4`
/// vec4s in segments of `seg4`: within [`GEMM_CHUNK_BYTES`] of im2col rows; for the GPU plan
/// within [`GPU_CHUNK_BYTES`] of im2col rows, unless the chunk's smallest tiles would then leave
/// the dispatch narrow, and of side-by-side segment sums (whose dispatch the segments widen).
fn im2col_gemm_pixels(gpu: &Gpu, algo: Conv2dAlgo, channels: u64, (row4, seg4): (u64, u64)) -> u64 {
    let im2col = gemm_chunk_pixels(row4);
    if algo != Conv2dAlgo::GemmShared {
        return im2col;
    }
    let segments = row4.div_ceil(seg4.max(1));
    let most = if segments > 1 {
        GPU_CHUNK_BYTES / (segments * channels.max(1) * 4)
    } else {
        let (edge, _) = SMALLEST_SHARED_TILE;
        let wide = edge * gpu.wide_dispatch.div_ceil(channels.div_ceil(edge).max(1));
        (GPU_CHUNK_BYTES / (row4.max(1) * 16)).max(wide)
    };
    most.min(im2col).max(1)
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
        (grid.pixels(), 1, im2col_gemm_pixels(gpu, algo, grid.channels as u64, (row4, seg4))),
        source,
        |enc, begin, count, rows| {
            let operands = (rows, weights, out);
            let k = (row4, seg4);
            gemm(gpu, enc, op, algo, grid, (begin, count), k, operands, GemmBatch::ONE)
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The largest tile whose dispatch is that wide, down to 16×16 when none is.
    #[test]
    fn shared_tiles_shrink_until_the_dispatch_is_wide() {
        let cases = [
            (1, (64, 64)),
            (8, (64, 64)),
            (9, (64, 32)),
            (16, (64, 32)),
            (17, (32, 32)),
            (32, (32, 32)),
            (33, (32, 16)),
            (64, (32, 16)),
            (65, (16, 16)),
            (10_000, (16, 16)),
        ];
        for (wide, tile) in cases {
            assert_eq!(shared_tile(256, 128, wide), tile, "wide {wide}");
        }
        assert_eq!(shared_tile(128, 65, 8), (32, 64), "where a's rows split better");
    }

    /// Every tile the GPU plan takes compiles: the specialised module stays valid WGSL.
    #[test]
    fn every_shared_tile_is_valid_wgsl() {
        for a in [16, 32, 64] {
            for b in [16, 32, 64] {
                let shader = shared_tile_shader((a, b));
                let acc = format!("const SHARED_ACC: u32 = {}u;", a * b / 256);
                assert!(shader.source.contains(&acc), "{a}x{b}");
                crate::kernels::assert_valid_wgsl(&shader, naga::valid::Capabilities::empty());
            }
        }
    }
}
