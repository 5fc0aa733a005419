//! The gather GEMM's WGSL (`conv2d_implicit_gemm`), written per [`GatherKernel`]: a tile, the
//! tap grid of the phases it runs, and the tap rows each invocation stages per slice.
//!
//! A slice is whole tap rows: `slice_rows` rows of `cols` taps, so where a slice holds whole
//! channels (`rows_per_thread` a multiple of the grid's rows) every staged element's tap is a
//! literal of the code: its source offset is the channel's offset plus a per-tap constant, its
//! padding test a flag computed once per kernel. Elsewhere (the 7×7 stem) each staged row finds
//! its (channel, tap row) by a division per row and the column stays literal. The loaded value
//! and its flag are kept apart until the store into workgroup memory, so the next slice's loads
//! stay in flight while this one is summed; the weights are read from rows padded with zeros,
//! past the last k and the last column, so their loads need no test at all.

use super::wgsl::{each, gemm_a_read, gemm_b_read, slices, LaneIndex, LANE};
use super::{Sum, TileConfig, FRAME};
use syncstep_gpu::Shader;

/// One gather GEMM kernel: `config`'s tile (its `bk` unused: the slice is `bk()`), summing as
/// `sum` says, over phases whose kept taps are `rows` × `cols`, each invocation staging
/// `rows_per_thread` tap rows of one pixel per slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GatherKernel {
    pub config: TileConfig,
    pub sum: Sum,
    pub rows: u32,
    pub cols: u32,
    pub rows_per_thread: u32,
}

impl GatherKernel {
    /// Invocations that stage one pixel of a slice.
    pub const fn per_pixel(&self) -> u32 {
        self.config.threads() / self.config.bm()
    }
    /// Tap rows of a slice.
    pub const fn slice_rows(&self) -> u32 {
        self.rows_per_thread * self.per_pixel()
    }
    /// k of a slice.
    pub const fn bk(&self) -> u32 {
        self.slice_rows() * self.cols
    }
    /// Taps of a channel.
    pub const fn taps(&self) -> u32 {
        self.rows * self.cols
    }
    /// Whether each invocation stages whole channels, every element's tap a literal.
    pub const fn literal(&self) -> bool {
        self.rows_per_thread.is_multiple_of(self.rows)
    }
    /// Floats of the first operand an invocation stages per slice.
    pub const fn a_loads(&self) -> u32 {
        self.rows_per_thread * self.cols
    }
    /// vec4s of the weights a slice stages, and per invocation (the last of them by the first
    /// invocations only, where they do not divide evenly).
    pub const fn b_vec4s(&self) -> u32 {
        self.bk() * self.config.bn() / 4
    }
    pub const fn b_loads(&self) -> u32 {
        self.b_vec4s().div_ceil(self.config.threads())
    }
    /// vec4s of workgroup memory a slice of weights takes: room for every invocation's store,
    /// those past the slice's rows never read.
    pub const fn b_slice(&self) -> u32 {
        self.b_loads() * self.config.threads()
    }
    /// Weight rows the invocations' loads reach from a slice's first: past the slice's own
    /// where the last load is not every invocation's (all load, only those in the slice store).
    pub const fn b_rows(&self) -> u32 {
        self.b_loads() * self.config.threads() / (self.config.bn() / 4)
    }
    /// Bytes of workgroup memory: two slices of both operands.
    pub const fn shared_bytes(&self) -> u64 {
        2 * (self.bk() as u64 * self.config.bm() as u64 + 4 * self.b_slice() as u64) * 4
    }
    /// As shader names and reports give it: `256t-128x128-8x8-g3x3-r3_whole`.
    pub fn name(&self) -> String {
        let c = self.config;
        format!(
            "{}t-{}x{}-{}x{}-g{}x{}-r{}_{}",
            c.threads(),
            c.bm(),
            c.bn(),
            c.tm,
            c.tn,
            self.rows,
            self.cols,
            self.rows_per_thread,
            self.sum.name()
        )
    }
    /// Where the stager stores its e-th element, in floats from the slice's start: k row
    /// `sa·rows_per_thread·cols + e` (sa its part of the pixel's rows) of its pixel.
    pub fn a_store(&self, e: u32) -> LaneIndex {
        let (bm, elements) = (self.config.bm(), self.a_loads());
        LaneIndex::new().term(bm, None, elements * bm).term(1, Some(bm), 1).plus(e * bm)
    }
    /// Where the stager stores its r-th vec4 of the weights, in vec4s from the slice's start.
    pub fn b_store(&self, r: u32) -> LaneIndex {
        LaneIndex::new().term(1, None, 1).plus(r * self.config.threads())
    }
}

/// The module of `kernel`.
pub(crate) fn gather_shader(kernel: GatherKernel) -> Shader {
    FRAME.variant(&kernel.name(), move |frame| format!("{frame}\n{}", gemm_entry(kernel)))
}

/// `conv2d_implicit_gemm` for `kernel`: one BM × BN output tile of one phase (and, split, one
/// segment of its sums) per workgroup.
fn gemm_entry(kernel: GatherKernel) -> String {
    let c = kernel.config;
    let (bm, bk, threads) = (c.bm(), kernel.bk(), c.threads());
    let (a_slice, b_slice) = (bk * bm / 4, kernel.b_slice());
    let mut w = gemm_prologue(kernel);
    let loads = |w: &mut Vec<String>, indent: &str, k0: &str| gather_loads(kernel, w, indent, k0);
    let stores = |w: &mut Vec<String>, indent: &str, buffer: &str| {
        for e in 0..kernel.a_loads() {
            let at = e * bm / 4;
            w.push(format!(
                "{indent}ig_a[{buffer} * {a_slice}u + sa_at + {at}u][lid % 4u] = select(0.0, pa{e}, pf{e});"
            ));
        }
        for r in 0..kernel.b_loads() {
            w.push(format!(
                "{indent}ig_b[{buffer} * {b_slice}u + lid + {}u] = pb{r};",
                r * threads
            ));
        }
    };
    w.extend((0..kernel.a_loads()).map(|e| format!("    var pa{e} = 0.0;")));
    w.extend((0..kernel.a_loads()).map(|e| format!("    var pf{e} = false;")));
    w.extend((0..kernel.b_loads()).map(|r| format!("    var pb{r} = vec4<f32>(0.0);")));
    // Accumulators c{j}_{h}: column j, pixel quad h; the segments' total t{j}_{h}.
    let mq = c.tm / 4;
    w.extend(each("    ", c.tn, mq, |j, h| format!("var c{j}_{h} = vec4<f32>(0.0);")));
    if kernel.sum == Sum::Segments {
        w.extend(each("    ", c.tn, mq, |j, h| format!("var t{j}_{h} = vec4<f32>(0.0);")));
    }
    let body = |w: &mut Vec<String>| gemm_slice(kernel, w);
    slices(&mut w, "k_begin", bk, (&loads, &stores), &body);
    gemm_stores(c, kernel.sum, &mut w);
    w.push("}".into());
    w.join("\n") + "\n"
}

/// The gather GEMM's workgroup arrays and its opening: the phase's records, the tile, the
/// segment of k, the pixel each invocation stages and its taps' offsets and padding flags.
fn gemm_prologue(kernel: GatherKernel) -> Vec<String> {
    let c = kernel.config;
    let (bm, bn, bk, threads) = (c.bm(), c.bn(), kernel.bk(), c.threads());
    let (a_slice, b_slice) = (bk * bm / 4, kernel.b_slice());
    let mut w = vec![
        format!("var<workgroup> ig_a: array<vec4<f32>, {}>;", 2 * a_slice),
        format!("var<workgroup> ig_b: array<vec4<f32>, {}>;", 2 * b_slice),
        String::new(),
        format!("@compute @workgroup_size({threads})"),
        "fn conv2d_implicit_gemm(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {".into(),
        "    let phase = ig.phase0 + wid.z / ig.segments;".into(),
        "    let r0 = ig_record(phase, 0u);".into(),
        "    let r1 = ig_record(phase, 1u);".into(),
        "    let r2 = ig_record(phase, 2u);".into(),
        "    let seg_len = u32(r2.x);".into(),
        "    let grid_h = u32(r0.x);".into(),
        "    let grid_w = u32(r0.y);".into(),
        "    let k_count = u32(r0.z);".into(),
        "    let first = u32(r0.w);".into(),
        "    let pixels = ig.images * grid_h * grid_w;".into(),
        "    let f = wid.x + wid.y * nwg.x;".into(),
        format!("    let m0 = (f % ig.m_tiles) * {bm}u;"),
        format!("    let n0 = (f / ig.m_tiles) * {bn}u;"),
        "    // Whole workgroups only: the barriers stay uniform.".into(),
        "    if (m0 >= pixels || n0 >= ig.cols) { return; }".into(),
        "    var k_begin = 0u;".into(),
        "    var k_end = k_count;".into(),
        "    if (ig.segments > 1u) {".into(),
        "        k_begin = min((wid.z % ig.segments) * seg_len, k_count);".into(),
        "        k_end = min(k_begin + seg_len, k_count);".into(),
        "    }".into(),
        format!("    let steps = (k_end - k_begin + {}u) / {bk}u;", bk - 1),
        // The stager's pixel and its part of the slice's rows, where it stores them, and the
        // weights' vec4 it stages.
        format!("    let sp = ig_pixel(m0 + lid % {bm}u, grid_h, grid_w, r1);"),
        format!("    let sa = lid / {bm}u;"),
        format!("    let sa_at = {} / 4u;", kernel.a_store(0).wgsl()),
        format!("    let sb_col4 = n0 / 4u + lid % {}u;", bn / 4),
        format!("    let sb_row = lid / {}u;", bn / 4),
        "    let base = bitcast<u32>(sp.base);".into(),
        "    let plane = ig.src_h * ig.src_w;".into(),
        "    let ty = sp.y0 + r2.y;".into(),
        "    let tx = sp.x0 + r2.z;".into(),
    ];
    // Column cx of the taps is inside the source for this pixel, and its offset from the row.
    for cx in 0..kernel.cols {
        w.push(format!("    let co{cx} = bitcast<u32>(tx + {cx} * r2.w) < ig.src_w;"));
    }
    if kernel.literal() {
        // Per tap: inside, and its offset from the pixel's origin in its channel.
        for ry in 0..kernel.rows {
            w.push(format!("    let ro{ry} = sp.ok && bitcast<u32>(ty + {ry} * r2.w) < ig.src_h;"));
            for cx in 0..kernel.cols {
                let t = ry * kernel.cols + cx;
                w.push(format!("    let ok{t} = ro{ry} && co{cx};"));
                w.push(format!(
                    "    let tap{t} = bitcast<u32>((r2.y + {ry} * r2.w) * i32(ig.src_w) + r2.z + {cx} * r2.w);"
                ));
            }
        }
        w.push(format!("    let ch_end = k_end / {}u;", kernel.taps()));
    } else {
        // The tap rows inside the source for this pixel, as bits; the columns' offsets.
        w.push("    var rows_in = 0u;".into());
        w.push(format!("    for (var r = 0u; r < {}u; r++) {{", kernel.rows));
        w.push("        if (sp.ok && bitcast<u32>(ty + i32(r) * r2.w) < ig.src_h) { rows_in |= 1u << r; }".into());
        w.push("    }".into());
        for cx in 0..kernel.cols {
            w.push(format!("    let cof{cx} = bitcast<u32>(r2.z + {cx} * r2.w);"));
        }
        w.push(format!("    let q_end = k_end / {}u;", kernel.cols));
    }
    w
}

/// Loads of the slice from k `k0` into registers: each element raw, with its flag (inside the
/// source and the k range), and the weights' vec4s.
fn gather_loads(kernel: GatherKernel, w: &mut Vec<String>, indent: &str, k0: &str) {
    let (rows, cols, rpt) = (kernel.rows, kernel.cols, kernel.rows_per_thread);
    if kernel.literal() {
        let per_thread = rpt / rows;
        w.push(format!("{indent}let ch = {k0} / {}u + sa * {per_thread}u;", kernel.taps()));
        for j in 0..per_thread {
            w.push(format!("{indent}let live{j} = ch + {j}u < ch_end;"));
            w.push(format!("{indent}let at{j} = base + (ch + {j}u) * plane;"));
            for t in 0..kernel.taps() {
                let e = j * kernel.taps() + t;
                w.push(format!("{indent}pf{e} = live{j} && ok{t};"));
                w.push(format!("{indent}pa{e} = ig_src[select(0u, at{j} + tap{t}, pf{e})];"));
            }
        }
    } else {
        w.push(format!("{indent}let q = {k0} / {cols}u + sa * {rpt}u;"));
        for j in 0..rpt {
            w.push(format!("{indent}let ry{j} = (q + {j}u) % {rows}u;"));
            w.push(format!(
                "{indent}let live{j} = q + {j}u < q_end && ((rows_in >> ry{j}) & 1u) == 1u;"
            ));
            w.push(format!(
                "{indent}let at{j} = base + (q + {j}u) / {rows}u * plane + bitcast<u32>((r2.y + i32(ry{j}) * r2.w) * i32(ig.src_w));"
            ));
            for cx in 0..cols {
                let e = j * cols + cx;
                w.push(format!("{indent}pf{e} = live{j} && co{cx};"));
                w.push(format!("{indent}pa{e} = ig_src[select(0u, at{j} + cof{cx}, pf{e})];"));
            }
        }
    }
    let row_step = kernel.config.threads() / (kernel.config.bn() / 4);
    w.push(format!("{indent}let wb = (first + {k0} + sb_row) * ig.cols4 + sb_col4;"));
    for r in 0..kernel.b_loads() {
        w.push(format!("{indent}pb{r} = ig_w[wb + {}u * ig.cols4];", r * row_step));
    }
}

/// One staged slice of the gather GEMM, unrolled: its outer products into the accumulators
/// and, summing by segments, each finished segment into the total.
fn gemm_slice(kernel: GatherKernel, w: &mut Vec<String>) {
    let c = kernel.config;
    let (bm, bn, bk) = (c.bm(), c.bn(), kernel.bk());
    let (mq, nq) = (c.tm / 4, c.tn / 4);
    let (a_slice, b_slice) = (bk * bm / 4, kernel.b_slice());
    w.push(format!("        let am = cur * {a_slice}u + {};", gemm_a_read(c, 0).wgsl()));
    w.push(format!("        let bq = cur * {b_slice}u + {};", gemm_b_read(c, 0).wgsl()));
    for kk in 0..bk {
        w.push("        {".into());
        for h in 0..mq {
            let at = kk * bm / 4 + h * bm / 8;
            w.push(format!("            let a{h} = ig_a[am + {at}u];"));
        }
        for q in 0..nq {
            let at = kk * bn / 4 + q * bn / 8;
            w.push(format!("            let b{q} = ig_b[bq + {at}u];"));
        }
        for j in 0..c.tn {
            let b = format!("b{}.{}", j / 4, LANE[j as usize % 4]);
            let line: Vec<String> = (0..mq).map(|h| format!("c{j}_{h} += {b} * a{h};")).collect();
            w.push(format!("            {}", line.join(" ")));
        }
        w.push("        }".into());
    }
    if kernel.sum == Sum::Segments {
        w.push("        if ((next - k_begin) % seg_len == 0u || !more) {".into());
        w.extend(each("            ", c.tn, mq, |j, h| {
            format!("t{j}_{h} += c{j}_{h}; c{j}_{h} = vec4<f32>(0.0);")
        }));
        w.push("        }".into());
    }
}

/// The gather GEMM's outputs: pixel quad h's pixels and column j as the reads place them, into
/// the slab of the workgroup's segment where the sums are split.
fn gemm_stores(c: TileConfig, sum: Sum, w: &mut Vec<String>) {
    let mq = c.tm / 4;
    w.push(
        "    let slab = select(0u, (wid.z % ig.segments) * ig.out_len, ig.segments > 1u);".into(),
    );
    let acc = if sum == Sum::Segments { 't' } else { 'c' };
    for h in 0..mq {
        let quad = gemm_a_read(c, h).wgsl();
        for i in 0..4 {
            w.push(format!(
                "    let o{h}_{i} = ig_pixel(m0 + 4u * {quad} + {i}u, grid_h, grid_w, r1);"
            ));
        }
    }
    for j in 0..c.tn {
        let quad = gemm_b_read(c, j / 4).wgsl();
        w.push(format!("    let col{j} = n0 + 4u * {quad} + {}u;", j % 4));
        w.push(format!("    if (col{j} < ig.cols) {{"));
        w.push(format!("        let at = slab + col{j} * ig.out_h * ig.out_w;"));
        for h in 0..mq {
            for (i, lane) in LANE.iter().enumerate() {
                w.push(format!(
                    "        if (o{h}_{i}.ok) {{ ig_out[at + o{h}_{i}.out] = {acc}{j}_{h}.{lane}; }}"
                ));
            }
        }
        w.push("    }".into());
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::assert_valid_wgsl;
    use crate::conv2d::implicit::{gathers, rows_per_thread, Group, FAMILY};

    /// Every gather kernel the plans can make: each tile at both slice depths, on the tap grids
    /// of ResNet's convolutions (3×3, 1×1, the strided input-VJP's 1×2 and 2×2 phases, the 7×7
    /// stem) and one more, summing whole and by segments.
    pub fn every_kernel() -> Vec<GatherKernel> {
        let grids = [(3, 3), (1, 1), (1, 2), (2, 2), (7, 7), (2, 3)];
        let mut kernels = Vec::new();
        for config in FAMILY.into_iter().filter(|&c| gathers(c)) {
            for (bk, (rows, cols)) in [16, 8].into_iter().flat_map(|bk| grids.map(|g| (bk, g))) {
                let group = Group { phase0: 0, phases: 1, rows, cols };
                let config = TileConfig { bk, ..config };
                let Some(rows_per_thread) = rows_per_thread(config, &group, None, 48 << 10) else {
                    continue;
                };
                for sum in [Sum::Whole, Sum::Segments] {
                    kernels.push(GatherKernel { config, sum, rows, cols, rows_per_thread });
                }
            }
        }
        kernels
    }

    /// Every gather kernel is valid WGSL for a browser's core set.
    #[test]
    fn every_kernel_is_valid_wgsl() {
        for kernel in every_kernel() {
            assert_valid_wgsl(&gather_shader(kernel), naga::valid::Capabilities::empty());
        }
    }

    /// Every workgroup-memory index a gather kernel computes stays inside its array, at every
    /// lane and every place the loops put it (what the pipelines, compiled without bounds
    /// checks, rely on): the largest lane index plus the largest offset every lane adds alike.
    #[test]
    fn workgroup_memory_indices_stay_in_their_arrays() {
        let most = |index: LaneIndex, lanes: u32| (0..lanes).map(|l| index.at(l)).max().unwrap();
        for kernel in every_kernel() {
            let c = kernel.config;
            let (bm, bn, bk, t) = (c.bm(), c.bn(), kernel.bk(), c.threads());
            let (a_len, b_len) = (2 * bk * bm / 4, 2 * kernel.b_slice());
            // Reads: buffer 1, the last k row, in vec4s.
            let (a_last, b_last) =
                (bk * bm / 4 + (bk - 1) * bm / 4, kernel.b_slice() + (bk - 1) * bn / 4);
            for h in 0..c.tm / 4 {
                assert!(a_last + most(gemm_a_read(c, h), t) < a_len, "{} a read", kernel.name());
            }
            for q in 0..c.tn / 4 {
                assert!(b_last + most(gemm_b_read(c, q), t) < b_len, "{} b read", kernel.name());
            }
            // Stores: buffer 1, in floats (a) and vec4s (b).
            for e in 0..kernel.a_loads() {
                let at = bk * bm + most(kernel.a_store(e), t);
                assert!(at < 4 * a_len, "{} a store", kernel.name());
            }
            for r in 0..kernel.b_loads() {
                let at = kernel.b_slice() + most(kernel.b_store(r), t);
                assert!(at < b_len, "{} b store", kernel.name());
            }
        }
    }
}
