//! The weight gradient's WGSL (`conv2d_implicit_weight`), written per [`WeightKernel`]: a tile,
//! the output map's rows and columns, how the slices of pixels cut them, and the node's depth.
//!
//! Slices follow the map: a slice is whole output rows (`rows` of them, all of one example or
//! whole examples), or one part of a row (`parts` slices a row). So where each row ends is a
//! literal of the unrolled loop, and the loop over a slice's pixels tests nothing: at each row's
//! end the row's sums go into the example's, at an example's end (a test once a row, the same
//! for the whole workgroup) the example's into the node's pairwise blocks. Each invocation
//! stages one column (an output channel, or a k) of several pixels, so a k's table entry is read
//! once per kernel, and a pixel's place in the slice is a constant of the invocation: per slice
//! only the slice's origin moves.

use super::wgsl::{each, gemm_a_read, gemm_b_read, slices, LaneIndex, LANE};
use super::{TileConfig, FRAME};
use crate::pairwise_shader;
use syncstep_gpu::Shader;

/// One weight-gradient kernel: `config`'s tile (its `bk` unused) at output maps of `out_h` ×
/// `out_w`, in slices of `rows` whole rows (`parts` 1) or of one of `parts` parts of a row
/// (`rows` 1), its nodes `levels` deep.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WeightKernel {
    pub config: TileConfig,
    pub out_h: u32,
    pub out_w: u32,
    pub rows: u32,
    pub parts: u32,
    pub levels: u32,
}

impl WeightKernel {
    /// Pixels of a row in one slice.
    pub const fn row_pixels(&self) -> u32 {
        self.out_w.div_ceil(self.parts)
    }
    /// Pixels of a slice.
    pub const fn bk(&self) -> u32 {
        self.rows * self.row_pixels()
    }
    /// Whether a slice holds whole examples (else its rows lie in one example).
    pub const fn whole_examples(&self) -> bool {
        self.rows.is_multiple_of(self.out_h)
    }
    /// Floats of a staged pixel's row of `cols` columns: padded by a vec4, so that a warp's
    /// store of one pixel's columns and the next falls in different banks.
    pub const fn row(cols: u32) -> u32 {
        cols + 4
    }
    /// Staged elements of `cols` columns per invocation per slice.
    pub const fn loads(&self, cols: u32) -> u32 {
        self.bk().div_ceil(self.config.threads() / cols)
    }
    /// Pixel rows of workgroup memory a slice of `cols` columns takes: room for every
    /// invocation's store, those past the slice's pixels never read.
    pub const fn slice_pixels(&self, cols: u32) -> u32 {
        self.loads(cols) * (self.config.threads() / cols)
    }
    /// Floats of workgroup memory a slice of `cols` columns takes.
    pub const fn slice(&self, cols: u32) -> u32 {
        self.slice_pixels(cols) * Self::row(cols)
    }
    /// Bytes of workgroup memory: two slices of both operands, pixel-major.
    pub const fn shared_bytes(&self) -> u64 {
        let (bm, bn) = (self.config.bm(), self.config.bn());
        2 * (self.slice(bm) + self.slice(bn)) as u64 * 4
    }
    /// As shader names and reports give it: `256t-128x128-8x8-m7x7-r2-p1_l0`.
    pub fn name(&self) -> String {
        let c = self.config;
        format!(
            "{}t-{}x{}-{}x{}-m{}x{}-r{}-p{}_l{}",
            c.threads(),
            c.bm(),
            c.bn(),
            c.tm,
            c.tn,
            self.out_h,
            self.out_w,
            self.rows,
            self.parts,
            self.levels
        )
    }
    /// Where the stager of `cols` columns stores its j-th element, in floats from the slice's
    /// start: column `lid mod cols` of pixel `lid / cols + j·threads/cols`.
    pub fn store(&self, cols: u32, j: u32) -> LaneIndex {
        let row = Self::row(cols);
        let step = self.config.threads() / cols;
        LaneIndex::new().term(1, Some(cols), 1).term(cols, None, row).plus(j * step * row)
    }
}

/// The module of `kernel` (`conv2d_implicit_weight`), and the nodes' combine
/// (`conv2d_implicit_weight_nodes`) with its stack sized for `nodes`.
pub(crate) fn weight_shader(kernel: WeightKernel, nodes: u32) -> Shader {
    let frame = pairwise_shader(&FRAME, nodes);
    frame.variant(&kernel.name(), move |frame| format!("{frame}\n{}", weight_entry(kernel)))
}

/// `conv2d_implicit_weight` for `kernel`: one BM (co) × BN (k) tile and one node of examples
/// per workgroup.
fn weight_entry(kernel: WeightKernel) -> String {
    let c = kernel.config;
    let mut w = weight_prologue(kernel);
    let loads = |w: &mut Vec<String>, indent: &str, s: &str| weight_loads(kernel, w, indent, s);
    let stores = |w: &mut Vec<String>, indent: &str, buffer: &str| {
        for (name, cols) in [("a", c.bm()), ("b", c.bn())] {
            let slice = kernel.slice(cols) / 4;
            for j in 0..kernel.loads(cols) {
                let at = kernel.store(cols, j).wgsl();
                w.push(format!(
                    "{indent}iw_{name}[{buffer} * {slice}u + {at} / 4u][{at} % 4u] = select(0.0, p{name}{j}, f{name}{j});"
                ));
            }
        }
    };
    for (name, cols) in [("a", c.bm()), ("b", c.bn())] {
        w.extend((0..kernel.loads(cols)).map(|j| format!("    var p{name}{j} = 0.0;")));
        w.extend((0..kernel.loads(cols)).map(|j| format!("    var f{name}{j} = false;")));
    }
    // s{i}_{q}: output channel i (0..tm) × k quad q, the row's sum; e… the example's; b{l}… the
    // node's open pairwise blocks.
    w.push(each_output(c, "    ", &|i, q| format!("var s{i}_{q} = vec4<f32>(0.0);")));
    w.push(each_output(c, "    ", &|i, q| format!("var e{i}_{q} = vec4<f32>(0.0);")));
    for l in 0..kernel.levels {
        w.push(each_output(c, "    ", &|i, q| format!("var b{l}_{i}_{q} = vec4<f32>(0.0);")));
    }
    let body = |w: &mut Vec<String>| weight_slice(kernel, w);
    slices(&mut w, "0u", 1, (&loads, &stores), &body);
    weight_stores(c, &mut w);
    w.push("}".into());
    w.join("\n") + "\n"
}

/// The weight gradient's workgroup arrays and its opening: the tile, the node's examples, each
/// invocation's columns and its pixels' places in a slice (in examples, rows and columns of the
/// map), and its k's table entry.
fn weight_prologue(kernel: WeightKernel) -> Vec<String> {
    let c = kernel.config;
    let (bm, bn, threads) = (c.bm(), c.bn(), c.threads());
    let (oh, ow) = (kernel.out_h, kernel.out_w);
    let mut w = vec![
        format!("var<workgroup> iw_a: array<vec4<f32>, {}>;", 2 * kernel.slice(bm) / 4),
        format!("var<workgroup> iw_b: array<vec4<f32>, {}>;", 2 * kernel.slice(bn) / 4),
        String::new(),
        format!("@compute @workgroup_size({threads})"),
        "fn conv2d_implicit_weight(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {".into(),
        "    let f = wid.x + wid.y * nwg.x;".into(),
        format!("    let m0 = (f % iw.m_tiles) * {bm}u;"),
        format!("    let n0 = (f / iw.m_tiles) * {bn}u;"),
        "    // Whole workgroups only: the barriers stay uniform.".into(),
        "    if (n0 >= iw.cols) { return; }".into(),
        format!("    let plane = {}u;", oh * ow),
        "    let count = min(iw.node, iw.images - wid.z * iw.node);".into(),
        "    let node_rows = count * iw.out_h;".into(),
        format!(
            "    let steps = {};",
            if kernel.parts > 1 {
                format!("node_rows * {}u", kernel.parts)
            } else {
                format!("(node_rows + {}u) / {}u", kernel.rows - 1, kernel.rows)
            }
        ),
        "    let dy_node = wid.z * iw.node * iw.c_out * plane;".into(),
        "    let x_node = wid.z * iw.node * iw.c_in * iw.h * iw.w;".into(),
        // The stager's dy column and x column (k: its table entry).
        format!("    let co = m0 + lid % {bm}u;"),
        "    let co_in = co < iw.c_out;".into(),
        "    let dy_co = co * plane;".into(),
        format!("    let k = n0 + lid % {bn}u;"),
        "    let k_in = k < iw.cols;".into(),
        "    let tap = iw_table[3u + select(0u, k, k_in)];".into(),
    ];
    // Each staged pixel's place in the slice: its row r (of the slice's rows), column x, and,
    // in slices of whole examples, its example and row in it.
    for (name, cols) in [("a", bm), ("b", bn)] {
        for j in 0..kernel.loads(cols) {
            let p = format!("lid / {cols}u + {}u", j * (threads / cols));
            let rp = kernel.row_pixels();
            w.push(format!("    let {name}r{j} = ({p}) / {rp}u;"));
            w.push(format!("    let {name}x{j} = ({p}) % {rp}u;"));
            if kernel.whole_examples() {
                w.push(format!("    let {name}e{j} = {name}r{j} / {oh}u;"));
                w.push(format!("    let {name}y{j} = {name}r{j} % {oh}u;"));
            } else {
                w.push(format!("    let {name}e{j} = 0u;"));
                w.push(format!("    let {name}y{j} = {name}r{j};"));
            }
        }
    }
    for j in 0..kernel.loads(bm) {
        w.push(format!(
            "    let a_at{j} = dy_node + dy_co + ae{j} * iw.c_out * plane + ay{j} * {ow}u + ax{j};"
        ));
    }
    for j in 0..kernel.loads(bn) {
        w.push(format!(
            "    let b_at{j} = x_node + u32(tap.x) + be{j} * iw.c_in * iw.h * iw.w + by{j} * iw.stride * iw.w + bx{j} * iw.stride;"
        ));
    }
    w
}

/// Loads of slice `s` into registers: each element raw, with its flag (inside the node, the
/// tile, the map and the source), from the slice's origin in the node and each invocation's
/// constant place in it.
fn weight_loads(kernel: WeightKernel, w: &mut Vec<String>, indent: &str, s: &str) {
    let c = kernel.config;
    let (oh, ow) = (kernel.out_h, kernel.out_w);
    // The slice's first row in the node, its example and row in it, and its first column.
    if kernel.parts > 1 {
        w.push(format!("{indent}let q = {s} / {}u;", kernel.parts));
        w.push(format!("{indent}let x0 = ({s} % {}u) * {}u;", kernel.parts, kernel.row_pixels()));
    } else {
        w.push(format!("{indent}let q = {s} * {}u;", kernel.rows));
        w.push(format!("{indent}let x0 = 0u;"));
    }
    w.push(format!("{indent}let ex = q / {oh}u;"));
    w.push(format!("{indent}let oy = q % {oh}u;"));
    w.push(format!("{indent}let dy_at = ex * iw.c_out * plane + oy * {ow}u + x0;"));
    w.push(format!(
        "{indent}let x_at = ex * iw.c_in * iw.h * iw.w + oy * iw.stride * iw.w + x0 * iw.stride - iw.pad * (iw.w + 1u);"
    ));
    w.push(format!("{indent}let sy = i32(oy * iw.stride) - i32(iw.pad) + tap.y;"));
    w.push(format!("{indent}let sx = i32(x0 * iw.stride) - i32(iw.pad) + tap.z;"));
    for j in 0..kernel.loads(c.bm()) {
        w.push(format!("{indent}fa{j} = co_in && q + ar{j} < node_rows && x0 + ax{j} < {ow}u;"));
        w.push(format!("{indent}pa{j} = iw_dy[select(0u, dy_at + a_at{j}, fa{j})];"));
    }
    for j in 0..kernel.loads(c.bn()) {
        w.push(format!(
            "{indent}fb{j} = k_in && q + br{j} < node_rows && x0 + bx{j} < {ow}u && bitcast<u32>(sy + i32(by{j} * iw.stride)) < iw.h && bitcast<u32>(sx + i32(bx{j} * iw.stride)) < iw.w;"
        ));
        w.push(format!("{indent}pb{j} = iw_x[select(0u, x_at + b_at{j}, fb{j})];"));
    }
}

/// One staged slice of the weight gradient, unrolled: its outer products into the row's sums;
/// at each row's end the row's sums into the example's, and at an example's end the example's
/// into the node's blocks.
fn weight_slice(kernel: WeightKernel, w: &mut Vec<String>) {
    let c = kernel.config;
    let (bm, bn, bk) = (c.bm(), c.bn(), kernel.bk());
    let (mq, nq) = (c.tm / 4, c.tn / 4);
    let (row_a, row_b) = (WeightKernel::row(bm) / 4, WeightKernel::row(bn) / 4);
    let (slice_a, slice_b) = (kernel.slice(bm) / 4, kernel.slice(bn) / 4);
    w.push(format!("        let am = cur * {slice_a}u + {};", gemm_a_read(c, 0).wgsl()));
    w.push(format!("        let bq = cur * {slice_b}u + {};", gemm_b_read(c, 0).wgsl()));
    if kernel.parts > 1 {
        w.push(format!("        let row_end = step % {}u == {}u;", kernel.parts, kernel.parts - 1));
        w.push(format!("        let q_cur = step / {}u;", kernel.parts));
    } else {
        w.push(format!("        let q_cur = step * {}u;", kernel.rows));
    }
    for p in 0..bk {
        w.push("        {".into());
        for h in 0..mq {
            w.push(format!("            let a{h} = iw_a[am + {}u];", p * row_a + h * bm / 8));
        }
        for q in 0..nq {
            w.push(format!("            let b{q} = iw_b[bq + {}u];", p * row_b + q * bn / 8));
        }
        for i in 0..c.tm {
            let a = format!("a{}.{}", i / 4, LANE[i as usize % 4]);
            let line: Vec<String> = (0..nq).map(|q| format!("s{i}_{q} += {a} * b{q};")).collect();
            w.push(format!("            {}", line.join(" ")));
        }
        w.push("        }".into());
        if (p + 1) % kernel.row_pixels() == 0 {
            let row = format!("q_cur + {}u", p / kernel.row_pixels());
            let open = if kernel.parts > 1 { "if (row_end) {" } else { "{" };
            w.push(format!("        {open}"));
            // The next row's sums start from the uniform's +0, which no compiler can see: from a
            // literal 0 it could fold the next pixel's product and pair it with the one after.
            w.push(each_output(c, "            ", &|i, q| {
                format!("e{i}_{q} += s{i}_{q}; s{i}_{q} = vec4<f32>(iw.zero);")
            }));
            w.push(format!("            let row = {row};"));
            w.push(format!(
                "            if (row % {}u == {}u && row < node_rows) {{",
                kernel.out_h,
                kernel.out_h - 1
            ));
            w.push(format!("                let ex = row / {}u;", kernel.out_h));
            weight_push_example(c, kernel.levels, w);
            w.push("            }".into());
            w.push("        }".into());
        }
    }
}

/// `f` of every output of an invocation of `c`'s weight gradient, output channel i (0..tm) by
/// k quad q, on one line.
fn each_output(c: TileConfig, indent: &str, f: &dyn Fn(u32, u32) -> String) -> String {
    each(indent, c.tm, c.tn / 4, f).join(" ")
}

/// The example's sum into the node's pairwise blocks, as pairwise_push_or_close4 pushes it: the
/// last example closes the node's sum, which stays in e.
fn weight_push_example(c: TileConfig, levels: u32, w: &mut Vec<String>) {
    let indent = "                ";
    w.push(format!("{indent}let closed = countTrailingZeros(~ex);"));
    w.push(format!("{indent}let last = ex + 1u == count;"));
    for l in 0..levels {
        w.push(format!(
            "{indent}if ({l}u < closed || (last && {l}u > closed && ((count >> {l}u) & 1u) == 1u)) {{"
        ));
        w.push(each_output(c, &format!("{indent}    "), &|i, q| {
            format!("e{i}_{q} = b{l}_{i}_{q} + e{i}_{q};")
        }));
        w.push(format!("{indent}}} else if ({l}u == closed && !last) {{"));
        w.push(each_output(c, &format!("{indent}    "), &|i, q| {
            format!("b{l}_{i}_{q} = e{i}_{q};")
        }));
        w.push(format!("{indent}}}"));
    }
    w.push(format!("{indent}if (!last) {{"));
    w.push(each_output(c, &format!("{indent}    "), &|i, q| {
        format!("e{i}_{q} = vec4<f32>(iw.zero);")
    }));
    w.push(format!("{indent}}}"));
}

/// The node's sums, where the reads place them (channel quads and k quads), into its slab of
/// the nodes' sums, or straight into dw where the batch is one node.
fn weight_stores(c: TileConfig, w: &mut Vec<String>) {
    let nq = c.tn / 4;
    for q in 0..nq {
        w.push(format!("    let k{q} = n0 + 4u * {};", gemm_b_read(c, q).wgsl()));
    }
    w.push("    let node_at = wid.z * iw.c_out * iw.cols;".into());
    for i in 0..c.tm {
        let quad = gemm_a_read(c, i / 4).wgsl();
        w.push(format!("    let co{i} = m0 + 4u * {quad} + {}u;", i % 4));
        w.push(format!("    if (co{i} < iw.c_out) {{"));
        for q in 0..nq {
            for (j, lane) in LANE.iter().enumerate() {
                w.push(format!("        if (k{q} + {j}u < iw.cols) {{"));
                w.push(format!("            var at = node_at + co{i} * iw.cols + k{q} + {j}u;"));
                w.push(format!(
                    "            if (iw.direct == 1u) {{ at = co{i} * iw.w_len + u32(iw_table[3u + k{q} + {j}u].w); }}"
                ));
                w.push(format!("            iw_out[at] = e{i}_{q}.{lane};"));
                w.push("        }".into());
            }
        }
        w.push("    }".into());
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::assert_valid_wgsl;
    use crate::conv2d::implicit::{most_levels, weight_runs, WeightPlan, FAMILY};
    use crate::conv2d::Conv2dShape;

    /// Every weight-gradient kernel the plans can make at the maps of ResNet's layers (224², 32²)
    /// and of the tests (odd rows, rows longer than a slice that no part divides), each tile at
    /// both slice depths, its nodes as deep as its registers take and no deeper.
    pub fn every_weight_kernel() -> Vec<WeightKernel> {
        let maps = [
            (112, 112),
            (56, 56),
            (28, 28),
            (14, 14),
            (7, 7),
            (16, 16),
            (8, 8),
            (4, 4),
            (2, 2),
            (1, 1),
            (5, 7),
            (3, 37),
        ];
        let mut kernels = Vec::new();
        for config in FAMILY.into_iter().flat_map(|c| [c, TileConfig { bk: 8, ..c }]) {
            if !weight_runs(config) {
                continue;
            }
            for (oh, ow) in maps {
                let s = Conv2dShape {
                    n: 64,
                    c_in: 8,
                    h: oh,
                    w: ow,
                    c_out: 8,
                    kh: 1,
                    kw: 1,
                    stride: 1,
                    pad: 0,
                };
                for levels in [0, most_levels(config, s.n)] {
                    let plan = WeightPlan { config, levels };
                    kernels.extend(crate::conv2d::implicit::weight_kernel(plan, &s, 48 << 10));
                }
            }
        }
        kernels
    }

    /// Every weight-gradient kernel is valid WGSL for a browser's core set.
    #[test]
    fn every_kernel_is_valid_wgsl() {
        for kernel in every_weight_kernel() {
            assert_valid_wgsl(&weight_shader(kernel, 33), naga::valid::Capabilities::empty());
        }
    }

    /// Every workgroup-memory index a weight-gradient kernel computes stays inside its array, at
    /// every lane and every place the loops put it, and a store's column stays in the row's
    /// columns, not its padding.
    #[test]
    fn workgroup_memory_indices_stay_in_their_arrays() {
        let most = |index: LaneIndex, lanes: u32| (0..lanes).map(|l| index.at(l)).max().unwrap();
        for kernel in every_weight_kernel() {
            let c = kernel.config;
            let (bk, t) = (kernel.bk(), c.threads());
            for (cols, quads, read) in [
                (c.bm(), c.tm / 4, gemm_a_read as fn(TileConfig, u32) -> LaneIndex),
                (c.bn(), c.tn / 4, gemm_b_read),
            ] {
                let (row, slice) = (WeightKernel::row(cols), kernel.slice(cols));
                let len = 2 * slice;
                for q in 0..quads {
                    let last = 4 * (slice / 4 + (bk - 1) * row / 4) + 4 * most(read(c, q), t) + 3;
                    assert!(last < len, "{} read", kernel.name());
                }
                for j in 0..kernel.loads(cols) {
                    assert!(
                        slice + most(kernel.store(cols, j), t) < len,
                        "{} store",
                        kernel.name()
                    );
                    let column = LaneIndex::new().term(1, Some(cols), 1);
                    assert!(most(column, t) < cols, "{} column", kernel.name());
                }
            }
        }
    }
}
