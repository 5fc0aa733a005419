//! What the family's dispatches do, by construction ([`Construction`]): read off each
//! configuration's code, the workgroup-memory addresses evaluated from the same `LaneIndex`es
//! that write its WGSL (wgsl.rs). `syncstep bench` turns them into a large GPU's figures.

use super::wgsl::{
    gemm_a_read, gemm_a_store, gemm_b_read, gemm_b_store, weight_a_read, weight_b_read,
    weight_shared_bytes, weight_store, LaneIndex,
};
use super::{Sum, TileConfig};
use syncstep_gpu::Construction;

/// Lanes of a warp, and banks of workgroup memory (4 bytes each), on the GPUs the figures are for.
const WARP: u32 = 32;
const BANKS: u64 = 32;

/// The wavefronts one warp-wide access takes, and the fewest its data could take: lane l reads
/// (or writes) `bytes` at byte address `at(l)`; an address that several lanes read is read once,
/// and each bank serves one 4-byte word a wavefront.
pub fn wavefronts(at: impl Fn(u32) -> u64, bytes: u64) -> (u64, u64) {
    let mut words: Vec<u64> = (0..WARP)
        .flat_map(|l| {
            let first = at(l) / 4;
            (0..bytes / 4).map(move |w| first + w)
        })
        .collect();
    words.sort_unstable();
    words.dedup();
    let mut per_bank = [0u64; BANKS as usize];
    for w in &words {
        per_bank[(w % BANKS) as usize] += 1;
    }
    let taken = per_bank.into_iter().max().unwrap_or(0);
    (taken, (words.len() as u64 * 4).div_ceil(4 * BANKS))
}

/// (wavefronts, fewest) of the accesses at `indices`, each `bytes` wide at `unit` bytes per step
/// of its index, summed.
fn accesses(indices: &[LaneIndex], unit: u64, bytes: u64) -> (f64, f64) {
    indices.iter().fold((0.0, 0.0), |(t, l), index| {
        let (taken, least) = wavefronts(|lid| index.at(lid) as u64 * unit, bytes);
        (t + taken as f64, l + least as f64)
    })
}

/// The gather GEMM of `c` summing as `sum` says; its dispatch writes `scratch_bytes` of
/// segment sums (0: the output itself) and its op runs `passes` dispatches.
pub fn gemm(c: TileConfig, sum: Sum, scratch_bytes: u64, passes: u32) -> Construction {
    let (mq, nq) = (c.tm / 4, c.tn / 4);
    let reads: Vec<LaneIndex> =
        (0..mq).map(|h| gemm_a_read(c, h)).chain((0..nq).map(|q| gemm_b_read(c, q))).collect();
    // A slice's stores, per k: a's one float each, b's a vec4 each.
    let a_stores: Vec<LaneIndex> = (0..c.a_loads()).map(|r| gemm_a_store(c, r)).collect();
    let b_stores: Vec<LaneIndex> = (0..c.b_loads()).map(|r| gemm_b_store(c, r)).collect();
    let stores = accesses(&a_stores, 4, 4).0 + accesses(&b_stores, 16, 16).0;
    let fma = c.outputs() as f64;
    // Per k: the tile's loads; per slice, shared by its k: each gathered float and each vec4 of
    // weights staged, and the loop's own work.
    let staging = (c.a_loads() * GATHERED + c.b_loads() * WEIGHT_VEC4 + SLICE) as f64;
    let issue = fma + (mq + nq) as f64 + staging / c.bk as f64;
    let totals = if sum == Sum::Segments { c.outputs() } else { 0 };
    Construction {
        shared_bytes: c.shared_bytes(),
        registers: c.outputs() + totals + c.tm + c.tn + c.a_loads() + 4 * c.b_loads() + 24,
        scratch_bytes,
        issue_per_fma: issue / fma,
        passes,
        ..tile(c, &reads, stores)
    }
}

/// Instructions a staged element costs, as the kernels write them: a gathered float its table
/// entry, the bounds of its row and column, the load, the select and the store; a vec4 of
/// weights its bounds, load and store; a dy float of the weight gradient its channel's bound,
/// address, load, select and store; an x float as a gathered one. A slice adds its loop, its
/// barrier and its indices; the weight gradient's its pixel's two divisions.
const GATHERED: u32 = 10;
const WEIGHT_VEC4: u32 = 4;
const DY: u32 = 6;
const SLICE: u32 = 8;
const PIXEL_SLICE: u32 = 24;

/// The weight gradient of `c` with nodes `levels` deep, at output rows of `out_w` pixels and
/// examples of `plane`; its dispatch writes `scratch_bytes` of node sums (0: dw itself).
pub fn weight(
    c: TileConfig,
    levels: u32,
    (out_w, plane): (u32, u32),
    scratch_bytes: u64,
    passes: u32,
) -> Construction {
    let (mq, nq) = (c.tm / 4, c.tn / 4);
    let reads: Vec<LaneIndex> =
        (0..mq).map(|h| weight_a_read(c, h)).chain((0..nq).map(|q| weight_b_read(c, q))).collect();
    let loads = |cols: u32| c.bk * cols / c.threads();
    let a_stores: Vec<LaneIndex> = (0..loads(c.bm())).map(|r| weight_store(c, c.bm(), r)).collect();
    let b_stores: Vec<LaneIndex> = (0..loads(c.bn())).map(|r| weight_store(c, c.bn(), r)).collect();
    let stores = accesses(&a_stores, 4, 4).0 + accesses(&b_stores, 4, 4).0;
    let fma = c.outputs() as f64;
    // Per pixel: the tile's loads, the row and example counters; per row the row sums' adds
    // into the example's and their reset; per example the pairwise adds (one a push on
    // average); per slice, shared by its pixels, each staged float and the slice's own work.
    let staging = (loads(c.bm()) * DY + loads(c.bn()) * GATHERED + PIXEL_SLICE) as f64;
    let per_row = 2.0 * fma / out_w.max(1) as f64;
    let per_example = fma / plane.max(1) as f64;
    let issue = fma + (mq + nq) as f64 + 3.0 + per_row + per_example + staging / c.bk as f64;
    Construction {
        shared_bytes: weight_shared_bytes(c),
        registers: c.outputs() * (2 + levels) + c.tm + c.tn + loads(c.bm()) + loads(c.bn()) + 28,
        scratch_bytes,
        issue_per_fma: issue / fma,
        passes,
        ..tile(c, &reads, stores)
    }
}

/// What both kernels' constructions share, from `c`, the lane indices of its inner loop's reads
/// (vec4s) and the wavefronts of a slice's stores.
fn tile(c: TileConfig, reads: &[LaneIndex], stores: f64) -> Construction {
    let (read, least) = accesses(reads, 16, 16);
    Construction {
        outputs_per_invocation: c.outputs(),
        fma_per_shared_float: c.outputs() as f64 / (c.tm + c.tn) as f64,
        read_wavefronts: read,
        least_read_wavefronts: least,
        store_wavefronts: stores / c.bk as f64,
        fma_between_barriers: c.outputs() as u64 * c.bk as u64,
        flop_per_staged_byte: flop_per_staged_byte(c),
        ..Construction::default()
    }
}

/// FLOPs per byte a workgroup stages: a slice of k (or pixels) is BK·(BM + BN) floats for
/// 2·BM·BN·BK FLOPs.
fn flop_per_staged_byte(c: TileConfig) -> f64 {
    let (bm, bn) = (c.bm() as f64, c.bn() as f64);
    2.0 * bm * bn / (4.0 * (bm + bn))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conv2d::implicit::FAMILY;

    /// Consecutive vec4s over a warp: 2 wavefronts, the fewest; one address for all: 1; the
    /// same 4 banks for 16 addresses: 16 where 2 would do.
    #[test]
    fn wavefronts_count_banks_and_broadcasts() {
        assert_eq!(wavefronts(|l| l as u64 % 16 * 16, 16), (2, 2));
        assert_eq!(wavefronts(|_| 64, 16), (1, 1));
        assert_eq!(wavefronts(|l| l as u64 % 16 * 256, 16), (16, 2));
        assert_eq!(wavefronts(|l| l as u64 * 4, 4), (1, 1));
    }

    /// Every configuration reads and stores workgroup memory without bank conflicts, and its
    /// 8×8 tiles do 4 multiply-adds per float they read.
    #[test]
    fn the_family_is_conflict_free() {
        for c in FAMILY.into_iter().flat_map(|c| [c, TileConfig { bk: 8, ..c }]) {
            let g = gemm(c, Sum::Whole, 0, 2);
            assert_eq!(g.read_wavefronts, g.least_read_wavefronts, "{}", c.name());
            let w = weight(c, 0, (7, 49), 0, 1);
            assert_eq!(w.read_wavefronts, w.least_read_wavefronts, "{}", c.name());
            let stores = [
                accesses(&(0..c.a_loads()).map(|r| gemm_a_store(c, r)).collect::<Vec<_>>(), 4, 4),
                accesses(&(0..c.b_loads()).map(|r| gemm_b_store(c, r)).collect::<Vec<_>>(), 16, 16),
            ];
            let per_slice = |cols: u32| c.bk * cols / c.threads();
            let weight_stores = [c.bm(), c.bn()].map(|cols| {
                accesses(
                    &(0..per_slice(cols)).map(|r| weight_store(c, cols, r)).collect::<Vec<_>>(),
                    4,
                    4,
                )
            });
            for (taken, least) in stores.into_iter().chain(weight_stores) {
                assert_eq!(taken, least, "{}: stores", c.name());
            }
            if c.outputs() == 64 {
                assert_eq!(g.fma_per_shared_float, 4.0);
            }
        }
    }
}
