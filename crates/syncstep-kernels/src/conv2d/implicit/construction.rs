//! What the family's dispatches do, by construction ([`Construction`]): read off each
//! configuration's code, the workgroup-memory addresses evaluated from the same `LaneIndex`es
//! that write its WGSL (wgsl.rs). `syncstep bench` turns them into a large GPU's figures.

use super::gather_wgsl::GatherKernel;
use super::weight::weight_registers;
use super::weight_wgsl::WeightKernel;
use super::wgsl::{gemm_a_read, gemm_b_read, LaneIndex};
use super::{Sum, TileConfig};
use syncstep_gpu::{Construction, Issued};

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

/// Instructions an invocation of a gather GEMM issues, as its generator (gather_wgsl.rs) writes
/// them and a GPU compiler keeps them (held to RADV/ACO's code: docs/performance.md):
/// - per k, unrolled: the tile's multiply-adds and its vec4 loads from workgroup memory (their
///   offsets literals, their bases computed once a slice);
/// - per staged element: its flag (a test of the channel and the tap, the tap's own flag
///   computed once), its address (the channel's offset plus the tap's), the address kept
///   inside the buffer, the load, and at the store the padding's select and the store;
/// - per staged channel: its offset and its test against the k range; per tap row staged where
///   the taps are not literals (the stem), its channel and row by a division, its test and
///   offset;
/// - per vec4 of weights: its address, the load and the store (the rows padded: no test);
/// - per slice: the loop, the buffers' bases, the next slice's tests and the barrier;
/// - per workgroup: the opening (the pixel's origin, the taps' flags and offsets) and the
///   closing (each output's pixel and its store).
pub const GATHER_ELEMENT: f64 = 7.0;
pub const GATHER_CHANNEL: f64 = 2.0;
pub const GATHER_ROW: f64 = 14.0;
pub const WEIGHT_VEC4: f64 = 3.0;
pub const SLICE: f64 = 32.0;
pub const GATHER_OPENING: f64 = 233.0;
/// Per kept tap at the opening: its flag and its offset.
pub const GATHER_TAP: f64 = 7.0;
/// Per pixel quad at the closing (four pixels' output offsets, each by divisions), per output
/// (its test, its branch and its store), and a workgroup past the last tile (it returns at once).
pub const CLOSING_QUAD: f64 = 196.0;
pub const CLOSING_OUTPUT: f64 = 6.0;
pub const IDLE_WORKGROUP: f64 = 15.0;

/// (multiply-adds, other instructions) one invocation of `kernel` issues for one slice.
pub fn gather_slice(kernel: &GatherKernel) -> (f64, f64) {
    let c = kernel.config;
    let (bk, outputs) = (kernel.bk() as f64, c.outputs() as f64);
    let per_k = ((c.tm + c.tn) / 4) as f64;
    let staging = if kernel.literal() {
        let channels = (kernel.rows_per_thread / kernel.rows) as f64;
        kernel.a_loads() as f64 * GATHER_ELEMENT + channels * GATHER_CHANNEL
    } else {
        kernel.a_loads() as f64 * GATHER_ELEMENT + kernel.rows_per_thread as f64 * GATHER_ROW
    };
    let weights = kernel.b_loads() as f64 * WEIGHT_VEC4;
    (bk * outputs, bk * per_k + staging + weights + SLICE)
}

/// (multiply-adds, other instructions) one invocation of `kernel` issues for `slices` slices,
/// closing `flushes` segments into its total on the way.
pub fn gather_invocation(kernel: &GatherKernel, slices: u64, flushes: u64) -> (f64, f64) {
    let c = kernel.config;
    let outputs = c.outputs() as f64;
    let (fmas, other) = gather_slice(kernel);
    let opening = GATHER_OPENING + kernel.taps() as f64 * GATHER_TAP;
    let closing = (c.tm / 4) as f64 * CLOSING_QUAD + outputs * CLOSING_OUTPUT;
    let segments = flushes as f64 * 2.0 * outputs;
    let slices = slices as f64;
    (slices * fmas, slices * other + opening + closing + segments)
}

/// Registers an invocation of `kernel` holds, as a compiler allocates them: its accumulators
/// (and the segments' totals), a k's operands, the next slice's elements and weights, and
/// the addresses and flags of its staging.
pub fn gather_registers(kernel: &GatherKernel) -> u32 {
    let c = kernel.config;
    let totals = if kernel.sum == Sum::Segments { c.outputs() } else { 0 };
    c.outputs() + totals + c.tm + c.tn + kernel.a_loads() + 4 * kernel.b_loads() + 24
}

/// The workgroups of a gather GEMM dispatch: those that sum (how many, their slices, the
/// segments each closes into its total) and those past their phase's last tile.
pub struct GatherWork {
    pub busy: Vec<(u64, u64, u64)>,
    pub idle: u64,
}

/// The gather GEMM of `kernel` doing `work`, writing `scratch_bytes` of segment sums (0: the
/// output itself), its op `passes` dispatches.
pub fn gemm(
    kernel: &GatherKernel,
    work: &GatherWork,
    scratch_bytes: u64,
    passes: u32,
) -> Construction {
    let c = kernel.config;
    let (mq, nq) = (c.tm / 4, c.tn / 4);
    let reads: Vec<LaneIndex> =
        (0..mq).map(|h| gemm_a_read(c, h)).chain((0..nq).map(|q| gemm_b_read(c, q))).collect();
    // A slice's stores, per k: the elements one float each, the weights a vec4 each.
    let a_stores: Vec<LaneIndex> = (0..kernel.a_loads()).map(|e| kernel.a_store(e)).collect();
    let b_stores: Vec<LaneIndex> = (0..kernel.b_loads()).map(|r| kernel.b_store(r)).collect();
    let stores = accesses(&a_stores, 4, 4).0 + accesses(&b_stores, 16, 16).0;
    let per_slice = accesses(&reads, 16, 16).0 * kernel.bk() as f64 + stores;
    let warps = c.threads() as f64 / 32.0;
    let mut issued =
        Issued { other: work.idle as f64 * IDLE_WORKGROUP * warps, ..Issued::default() };
    for &(workgroups, slices, flushes) in &work.busy {
        let (fmas, other) = gather_invocation(kernel, slices, flushes);
        let warps = workgroups as f64 * warps;
        issued.fmas += fmas * warps;
        issued.other += other * warps;
        issued.wavefronts += per_slice * slices as f64 * warps;
    }
    let (fmas, other) = gather_slice(kernel);
    Construction {
        shared_bytes: kernel.shared_bytes(),
        registers: gather_registers(kernel),
        scratch_bytes,
        passes,
        issued,
        slice: Issued { fmas, other, wavefronts: per_slice },
        ..tile(c, kernel.bk(), &reads, stores)
    }
}

/// Instructions an invocation of the weight gradient issues, as its generator (weight_wgsl.rs)
/// writes them: per pixel, unrolled, the tile's multiply-adds and its vec4 loads from
/// workgroup memory; per staged dy element its flag, address, load, select and store, per x
/// element the same and its row's and column's tests; per slice the slice's origin (its
/// example, row and column by divisions by literals), the loop and the barrier; per row its
/// sums into the example's and their reset; per example the pairwise push (an add or a copy a
/// level on average, the tests of the levels) and the example's reset; and the workgroup's
/// opening (each staged pixel's constant place, a k's table entry) and closing (its stores).
pub const WEIGHT_DY: f64 = 7.0;
pub const WEIGHT_X: f64 = 9.0;
pub const WEIGHT_SLICE: f64 = 70.0;
pub const WEIGHT_ROW: f64 = 4.0;
pub const WEIGHT_EXAMPLE: f64 = 6.0;
pub const WEIGHT_LEVEL: f64 = 5.0;
pub const WEIGHT_OPENING: f64 = 150.0;
pub const WEIGHT_STAGED: f64 = 8.0;

/// (multiply-adds, other instructions) one invocation of `kernel` issues for one slice.
pub fn weight_slice(kernel: &WeightKernel) -> (f64, f64) {
    let c = kernel.config;
    let (bk, outputs) = (kernel.bk() as f64, c.outputs() as f64);
    let per_pixel = ((c.tm + c.tn) / 4) as f64;
    let staging = kernel.loads(c.bm()) as f64 * WEIGHT_DY + kernel.loads(c.bn()) as f64 * WEIGHT_X;
    (bk * outputs, bk * per_pixel + staging + WEIGHT_SLICE)
}

/// (multiply-adds, other instructions) one invocation of `kernel` issues for a node of
/// `examples`.
pub fn weight_invocation(kernel: &WeightKernel, examples: u64) -> (f64, f64) {
    let c = kernel.config;
    let outputs = c.outputs() as f64;
    let rows = examples * kernel.out_h as u64;
    let slices = (rows * kernel.parts as u64).div_ceil(kernel.rows as u64) as f64;
    let (fmas, other) = weight_slice(kernel);
    let row = 2.0 * outputs + WEIGHT_ROW;
    let example = 2.0 * outputs + WEIGHT_EXAMPLE + kernel.levels as f64 * WEIGHT_LEVEL;
    let staged = (kernel.loads(c.bm()) + kernel.loads(c.bn())) as f64;
    let opening = WEIGHT_OPENING + staged * WEIGHT_STAGED;
    let closing = outputs * CLOSING_OUTPUT;
    let other = slices * other + rows as f64 * row + examples as f64 * example + opening + closing;
    (slices * fmas, other)
}

/// The weight gradient of `kernel`, `tiles` workgroups for each node of `examples`; its
/// dispatch writes `scratch_bytes` of node sums (0: dw itself), its op `passes` dispatches.
pub fn weight(
    kernel: &WeightKernel,
    tiles: u64,
    examples: impl Iterator<Item = u64>,
    scratch_bytes: u64,
    passes: u32,
) -> Construction {
    let c = kernel.config;
    let (mq, nq) = (c.tm / 4, c.tn / 4);
    let reads: Vec<LaneIndex> =
        (0..mq).map(|h| gemm_a_read(c, h)).chain((0..nq).map(|q| gemm_b_read(c, q))).collect();
    let stores = |cols: u32| -> Vec<LaneIndex> {
        (0..kernel.loads(cols)).map(|j| kernel.store(cols, j)).collect()
    };
    let stored = accesses(&stores(c.bm()), 4, 4).0 + accesses(&stores(c.bn()), 4, 4).0;
    let per_slice = accesses(&reads, 16, 16).0 * kernel.bk() as f64 + stored;
    let warps = tiles as f64 * c.threads() as f64 / 32.0;
    let mut issued = Issued::default();
    for examples in examples {
        let (fmas, other) = weight_invocation(kernel, examples);
        let rows = examples * kernel.out_h as u64;
        let slices = (rows * kernel.parts as u64).div_ceil(kernel.rows as u64) as f64;
        issued.fmas += fmas * warps;
        issued.other += other * warps;
        issued.wavefronts += per_slice * slices * warps;
    }
    let (fmas, other) = weight_slice(kernel);
    Construction {
        shared_bytes: kernel.shared_bytes(),
        registers: weight_registers(kernel),
        scratch_bytes,
        passes,
        issued,
        slice: Issued { fmas, other, wavefronts: per_slice },
        ..tile(c, kernel.bk(), &reads, stored)
    }
}

/// What both kernels' constructions share, from `c` in slices of `bk`, the lane indices of
/// its inner loop's reads (vec4s) and the wavefronts of a slice's stores.
fn tile(c: TileConfig, bk: u32, reads: &[LaneIndex], stores: f64) -> Construction {
    let (read, least) = accesses(reads, 16, 16);
    Construction {
        outputs_per_invocation: c.outputs(),
        fma_per_shared_float: c.outputs() as f64 / (c.tm + c.tn) as f64,
        read_wavefronts: read,
        least_read_wavefronts: least,
        store_wavefronts: stores / bk as f64,
        fma_between_barriers: c.outputs() as u64 * bk as u64,
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
    use crate::conv2d::implicit::gather_wgsl::tests::every_kernel;
    use crate::conv2d::implicit::weight_wgsl::tests::every_weight_kernel;

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
        let no_work = GatherWork { busy: Vec::new(), idle: 0 };
        for kernel in every_kernel() {
            let g = gemm(&kernel, &no_work, 0, 2);
            assert_eq!(g.read_wavefronts, g.least_read_wavefronts, "{}", kernel.name());
            let a_stores: Vec<LaneIndex> =
                (0..kernel.a_loads()).map(|e| kernel.a_store(e)).collect();
            let b_stores: Vec<LaneIndex> =
                (0..kernel.b_loads()).map(|r| kernel.b_store(r)).collect();
            for (taken, least) in [accesses(&a_stores, 4, 4), accesses(&b_stores, 16, 16)] {
                assert_eq!(taken, least, "{}: stores", kernel.name());
            }
            if kernel.config.outputs() == 64 {
                assert_eq!(g.fma_per_shared_float, 4.0);
            }
        }
        for kernel in every_weight_kernel() {
            let w = weight(&kernel, 1, [1].into_iter(), 0, 1);
            assert_eq!(w.read_wavefronts, w.least_read_wavefronts, "{}", kernel.name());
            let c = kernel.config;
            for cols in [c.bm(), c.bn()] {
                let stores: Vec<LaneIndex> =
                    (0..kernel.loads(cols)).map(|j| kernel.store(cols, j)).collect();
                let (taken, least) = accesses(&stores, 4, 4);
                assert_eq!(taken, least, "{}: stores", kernel.name());
            }
        }
    }
}
