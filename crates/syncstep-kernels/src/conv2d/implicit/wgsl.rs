//! The WGSL of the implicit-GEMM family, written per configuration: the frame
//! (shaders/conv2d/implicit.wgsl) and the configuration's entry point, its accumulators, loads
//! and stores written out with a variable each (CPU drivers keep an array that a loop indexes in
//! memory; GPUs keep either in registers).
//!
//! Where a lane reads and writes workgroup memory is a [`LaneIndex`]: the same value writes the
//! WGSL expression and evaluates it for lanes 0..32, so the bank conflicts `bench` reports are
//! those of the code the GPU runs (construction.rs).

use super::{Sum, TileConfig};
use crate::{pairwise_shader, shader_source};
use syncstep_gpu::Shader;

/// The frame every module of the family starts from.
pub(crate) const FRAME: Shader =
    Shader::file("conv2d_implicit", shader_source!("conv2d/implicit.wgsl"));

/// `((lid / div) % modulo) · mul`, no `% modulo` where it is None.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Term {
    div: u32,
    modulo: Option<u32>,
    mul: u32,
}

/// An index into workgroup memory as a function of the invocation's index `lid` in its
/// workgroup: a sum of [`Term`]s and a constant. What every lane adds alike (the buffer, the k
/// of the loop) stays out of it: it moves all lanes' addresses together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaneIndex {
    terms: Vec<Term>,
    constant: u32,
}

impl LaneIndex {
    fn new() -> LaneIndex {
        LaneIndex { terms: Vec::new(), constant: 0 }
    }
    /// Plus `((lid / div) % modulo) · mul`.
    fn term(mut self, div: u32, modulo: Option<u32>, mul: u32) -> LaneIndex {
        self.terms.push(Term { div, modulo, mul });
        self
    }
    fn plus(mut self, constant: u32) -> LaneIndex {
        self.constant += constant;
        self
    }
    /// Its value for lane `lid`.
    pub fn at(&self, lid: u32) -> u32 {
        let term = |t: &Term| (lid / t.div) % t.modulo.unwrap_or(u32::MAX) * t.mul;
        self.terms.iter().map(term).sum::<u32>() + self.constant
    }
    /// As WGSL.
    fn wgsl(&self) -> String {
        let term = |t: &Term| {
            let mut e = if t.div == 1 { "lid".to_string() } else { format!("lid / {}u", t.div) };
            if let Some(m) = t.modulo {
                e = format!("({e}) % {m}u");
            }
            if t.mul != 1 {
                e = format!("({e}) * {}u", t.mul);
            }
            e
        };
        let mut parts: Vec<String> = self.terms.iter().map(term).collect();
        parts.push(format!("{}u", self.constant));
        format!("({})", parts.join(" + "))
    }
}

/// The gather GEMM's reads of its tiles in the inner loop, in vec4s from the k row's start: the
/// pixel quads `m(lid) + h·BM/8` (h < tm/4) and column quads `n(lid) + q·BN/8` (q < tn/4). Lanes
/// next to each other take the next column quad, so a warp reads consecutive vec4s of b and one
/// or a few vec4s of a: conflict-free.
pub fn gemm_a_read(c: TileConfig, h: u32) -> LaneIndex {
    LaneIndex::new().term(c.threads_n, None, 1).plus(h * c.bm() / 8)
}
pub fn gemm_b_read(c: TileConfig, q: u32) -> LaneIndex {
    LaneIndex::new().term(1, Some(c.threads_n), 1).plus(q * c.bn() / 8)
}

/// Where the gather GEMM's stager stores its r-th load of a, in floats from the slice's start:
/// its pixel `lid mod BM` of k row `lid / BM + r·(threads / BM)` (consecutive lanes, consecutive
/// banks); of b, in vec4s: column quad `lid mod (BN/4)` of k row `lid / (BN/4) + r·…`.
pub fn gemm_a_store(c: TileConfig, r: u32) -> LaneIndex {
    let bm = c.bm();
    LaneIndex::new().term(bm, None, bm).term(1, Some(bm), 1).plus(r * c.threads())
}
pub fn gemm_b_store(c: TileConfig, r: u32) -> LaneIndex {
    let quads = c.bn() / 4;
    LaneIndex::new().term(quads, None, quads).term(1, Some(quads), 1).plus(r * c.threads())
}

/// The weight gradient's reads of a pixel's row of each slice, in vec4s: output-channel quads
/// `m(lid) + h·BM/8` and k quads `n(lid) + q·BN/8`, as the gather GEMM's.
pub fn weight_a_read(c: TileConfig, h: u32) -> LaneIndex {
    gemm_a_read(c, h)
}
pub fn weight_b_read(c: TileConfig, q: u32) -> LaneIndex {
    gemm_b_read(c, q)
}

/// Rows of a weight-gradient slice of `cols` columns, in floats: padded by a vec4, so that a
/// warp's 8 pixels × 4 columns of a store fall in 32 different banks.
pub fn weight_row(cols: u32) -> u32 {
    cols + 4
}

/// Bytes of workgroup memory the weight gradient of `c` uses: two slices of both operands,
/// pixel-major, their rows padded ([`weight_row`]).
pub fn weight_shared_bytes(c: TileConfig) -> u64 {
    2 * c.bk as u64 * (weight_row(c.bm()) + weight_row(c.bn())) as u64 * 4
}

/// The weight gradient's stager: the pixel of the slice it stages (`lid mod 8` within the
/// block of 8 its warp takes) and its columns (`(lid mod 32) / 8` within the warp's 4, the next
/// 4 for each next warp past the slice's blocks).
pub fn weight_pixel(c: TileConfig) -> LaneIndex {
    let blocks = c.bk / 8;
    LaneIndex::new().term(32, Some(blocks), 8).term(1, Some(8), 1)
}
pub fn weight_column(c: TileConfig, r: u32) -> LaneIndex {
    let blocks = c.bk / 8;
    let step = c.threads() / 32 / blocks * 4;
    LaneIndex::new().term(32 * blocks, None, 4).term(8, Some(4), 1).plus(r * step)
}

/// Where the weight gradient's stager stores its r-th load, in floats from the slice's start,
/// in a slice of `cols` columns.
pub fn weight_store(c: TileConfig, cols: u32, r: u32) -> LaneIndex {
    let row = weight_row(cols);
    let mut index = weight_column(c, r);
    index.terms.extend(weight_pixel(c).terms.iter().map(|t| Term { mul: t.mul * row, ..*t }));
    index
}

/// The module of `config`'s gather GEMM (`conv2d_implicit_gemm`) summing as `sum` says.
pub(crate) fn gemm_shader(config: TileConfig, sum: Sum) -> Shader {
    let variant = format!("{}_{}", config.name(), sum.name());
    FRAME.variant(&variant, move |frame| format!("{frame}\n{}", gemm_entry(config, sum)))
}

/// Lines `f(i, q)` for i < `rows`, q < `quads`, one per i, at `indent`.
fn each(indent: &str, rows: u32, quads: u32, f: impl Fn(u32, u32) -> String) -> Vec<String> {
    (0..rows)
        .map(|i| (0..quads).map(|q| f(i, q)).collect::<Vec<_>>().join(" "))
        .map(|l| format!("{indent}{l}"))
        .collect()
}

const LANE: [char; 4] = ['x', 'y', 'z', 'w'];

/// Writes a staging step at an indent: loads of the slice from a first k (or pixel), or stores
/// into a buffer.
type Stage<'a> = &'a dyn Fn(&mut Vec<String>, &str, &str);

/// The loop over slices both kernels run, after their accumulators: the first slice (from
/// `first`) loaded and stored into buffer 0, then per slice `body` sums the one in buffer
/// `cur` while the next (from `next`) is loaded into registers, then stored into the other
/// buffer: one barrier a slice.
fn slices(
    w: &mut Vec<String>,
    first: &str,
    bk: u32,
    (loads, stores): (Stage, Stage),
    body: &dyn Fn(&mut Vec<String>),
) {
    w.push("    {".into());
    loads(w, "        ", first);
    w.push("    }".into());
    stores(w, "    ", "0u");
    w.push("    workgroupBarrier();".into());
    w.push("    for (var step = 0u; step < steps; step++) {".into());
    w.push("        let cur = step & 1u;".into());
    w.push(format!("        let next = {first} + (step + 1u) * {bk}u;"));
    w.push("        let more = step + 1u < steps;".into());
    w.push("        if (more) {".into());
    loads(w, "            ", "next");
    w.push("        }".into());
    body(w);
    w.push("        if (more) {".into());
    stores(w, "            ", "(1u - cur)");
    w.push("        }".into());
    w.push("        workgroupBarrier();".into());
    w.push("    }".into());
}

/// `conv2d_implicit_gemm` for `c`: one BM × BN output tile of one phase (and, split, one segment
/// of its sums) per workgroup.
fn gemm_entry(c: TileConfig, sum: Sum) -> String {
    let (bm, bn, bk, threads) = (c.bm(), c.bn(), c.bk, c.threads());
    let mq = c.tm / 4;
    let (a_loads, b_loads) = (c.a_loads(), c.b_loads());
    let (a_slice, b_slice) = (bk * bm / 4, bk * bn / 4);
    let mut w = gemm_prologue(c);
    let loads = |w: &mut Vec<String>, indent: &str, k0: &str| {
        for r in 0..a_loads {
            let k = format!("{k0} + sa_k + {}u", r * threads / bm);
            w.push(format!("{indent}pa{r} = ig_gather(sa, first, {k}, k_end);"));
        }
        for r in 0..b_loads {
            let k = format!("{k0} + sb_k + {}u", r * threads / (bn / 4));
            w.push(format!("{indent}pb{r} = ig_weight(first, {k}, k_end, sb_col4);"));
        }
    };
    let stores = |w: &mut Vec<String>, indent: &str, buffer: &str| {
        for r in 0..a_loads {
            let at = gemm_a_store(c, r).wgsl();
            w.push(format!("{indent}ig_a[{buffer} * {a_slice}u + {at} / 4u][{at} % 4u] = pa{r};"));
        }
        for r in 0..b_loads {
            let at = gemm_b_store(c, r).wgsl();
            w.push(format!("{indent}ig_b[{buffer} * {b_slice}u + {at}] = pb{r};"));
        }
    };
    w.extend((0..a_loads).map(|r| format!("    var pa{r} = 0.0;")));
    w.extend((0..b_loads).map(|r| format!("    var pb{r} = vec4<f32>(0.0);")));
    // Accumulators c{j}_{h}: column j, pixel quad h; the segments' total t{j}_{h}.
    w.extend(each("    ", c.tn, mq, |j, h| format!("var c{j}_{h} = vec4<f32>(0.0);")));
    if sum == Sum::Segments {
        w.extend(each("    ", c.tn, mq, |j, h| format!("var t{j}_{h} = vec4<f32>(0.0);")));
    }
    let body = |w: &mut Vec<String>| gemm_slice(c, sum, w);
    slices(&mut w, "k_begin", bk, (&loads, &stores), &body);
    gemm_stores(c, sum, &mut w);
    w.push("}".into());
    w.join("\n") + "\n"
}

/// The gather GEMM's workgroup arrays and its opening: the phase's records, the tile, the
/// segment of k, and the pixel and column each invocation stages.
fn gemm_prologue(c: TileConfig) -> Vec<String> {
    let (bm, bn, bk, threads) = (c.bm(), c.bn(), c.bk, c.threads());
    let (a_slice, b_slice) = (bk * bm / 4, bk * bn / 4);
    vec![
        format!("var<workgroup> ig_a: array<vec4<f32>, {}>;", 2 * a_slice),
        format!("var<workgroup> ig_b: array<vec4<f32>, {}>;", 2 * b_slice),
        String::new(),
        format!("@compute @workgroup_size({threads})"),
        "fn conv2d_implicit_gemm(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {".into(),
        "    let phase = wid.z / ig.segments;".into(),
        "    let r0 = ig_record(phase, 0u);".into(),
        "    let r1 = ig_record(phase, 1u);".into(),
        "    let seg_len = u32(ig_record(phase, 2u).x);".into(),
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
        // The stager's pixel (threads ≥ BM: one each) and column quad.
        format!("    let sa = ig_pixel(m0 + lid % {bm}u, grid_h, grid_w, r1);"),
        format!("    let sa_k = lid / {bm}u;"),
        format!("    let sb_col4 = n0 / 4u + lid % {}u;", bn / 4),
        format!("    let sb_k = lid / {}u;", bn / 4),
    ]
}

/// One staged slice of the gather GEMM: its outer products into the accumulators and, summing
/// by segments, each finished segment into the total.
fn gemm_slice(c: TileConfig, sum: Sum, w: &mut Vec<String>) {
    let (bm, bn, bk) = (c.bm(), c.bn(), c.bk);
    let (mq, nq) = (c.tm / 4, c.tn / 4);
    let (a_slice, b_slice) = (bk * bm / 4, bk * bn / 4);
    w.push(format!("        for (var kk = 0u; kk < {bk}u; kk++) {{"));
    for h in 0..mq {
        let at = gemm_a_read(c, h).wgsl();
        w.push(format!("            let a{h} = ig_a[cur * {a_slice}u + kk * {}u + {at}];", bm / 4));
    }
    for q in 0..nq {
        let at = gemm_b_read(c, q).wgsl();
        w.push(format!("            let b{q} = ig_b[cur * {b_slice}u + kk * {}u + {at}];", bn / 4));
    }
    for j in 0..c.tn {
        let b = format!("b{}.{}", j / 4, LANE[j as usize % 4]);
        let line: Vec<String> = (0..mq).map(|h| format!("c{j}_{h} += {b} * a{h};")).collect();
        w.push(format!("            {}", line.join(" ")));
    }
    w.push("        }".into());
    if sum == Sum::Segments {
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

/// The module of `config`'s weight gradient (`conv2d_implicit_weight`), its nodes' pairwise
/// blocks `levels` deep, and the nodes' combine (`conv2d_implicit_weight_nodes`) with its stack
/// sized for `nodes`.
pub(crate) fn weight_shader(config: TileConfig, levels: u32, nodes: u32) -> Shader {
    let frame = pairwise_shader(&FRAME, nodes);
    let variant = format!("{}_l{levels}", config.name());
    frame.variant(&variant, move |frame| format!("{frame}\n{}", weight_entry(config, levels)))
}

/// `conv2d_implicit_weight` for `c`: one BM (co) × BN (k) tile and one node of examples per
/// workgroup, over slices of `bk` pixels stored pixel-major ([`weight_row`]).
fn weight_entry(c: TileConfig, levels: u32) -> String {
    let (bm, bn, bk, threads) = (c.bm(), c.bn(), c.bk, c.threads());
    let (a_loads, b_loads) = (bk * bm / threads, bk * bn / threads);
    let mut w = weight_prologue(c);
    let loads = |w: &mut Vec<String>, indent: &str, q0: &str| {
        w.push(format!("{indent}let sp = iw_pixel({q0} + sq, q_end);"));
        for r in 0..a_loads {
            let col = weight_column(c, r).wgsl();
            w.push(format!("{indent}pa{r} = iw_dy_at(sp, m0 + {col});"));
        }
        for r in 0..b_loads {
            let col = weight_column(c, r).wgsl();
            w.push(format!("{indent}pb{r} = iw_x_at(sp, n0 + {col});"));
        }
    };
    let stores = |w: &mut Vec<String>, indent: &str, buffer: &str| {
        for (name, loads, cols) in [("a", a_loads, bm), ("b", b_loads, bn)] {
            let slice = bk * weight_row(cols) / 4;
            for r in 0..loads {
                let at = weight_store(c, cols, r).wgsl();
                w.push(format!(
                    "{indent}iw_{name}[{buffer} * {slice}u + {at} / 4u][{at} % 4u] = p{name}{r};"
                ));
            }
        }
    };
    w.extend((0..a_loads).map(|r| format!("    var pa{r} = 0.0;")));
    w.extend((0..b_loads).map(|r| format!("    var pb{r} = 0.0;")));
    // s{i}_{q}: output channel i (0..tm) × k quad q, the row's sum; e… the example's; b{l}… the
    // node's open pairwise blocks.
    w.push(each_output(c, "    ", &|i, q| format!("var s{i}_{q} = vec4<f32>(0.0);")));
    w.push(each_output(c, "    ", &|i, q| format!("var e{i}_{q} = vec4<f32>(0.0);")));
    for l in 0..levels {
        w.push(each_output(c, "    ", &|i, q| format!("var b{l}_{i}_{q} = vec4<f32>(0.0);")));
    }
    w.push("    var col = 0u;".into());
    w.push("    var row = 0u;".into());
    w.push("    var ex = 0u;".into());
    let body = |w: &mut Vec<String>| weight_slice(c, levels, w);
    slices(&mut w, "q_begin", bk, (&loads, &stores), &body);
    weight_stores(c, &mut w);
    w.push("}".into());
    w.join("\n") + "\n"
}

/// `f` of every output of an invocation of `c`'s weight gradient, output channel i (0..tm) by
/// k quad q, on one line.
fn each_output(c: TileConfig, indent: &str, f: &dyn Fn(u32, u32) -> String) -> String {
    each(indent, c.tm, c.tn / 4, f).join(" ")
}

/// The weight gradient's workgroup arrays and its opening: the tile, the node's examples and
/// pixels, and the pixel each invocation stages.
fn weight_prologue(c: TileConfig) -> Vec<String> {
    let (bm, bn, bk, threads) = (c.bm(), c.bn(), c.bk, c.threads());
    let (row_a, row_b) = (weight_row(bm) / 4, weight_row(bn) / 4);
    vec![
        format!("var<workgroup> iw_a: array<vec4<f32>, {}>;", 2 * bk * row_a),
        format!("var<workgroup> iw_b: array<vec4<f32>, {}>;", 2 * bk * row_b),
        String::new(),
        format!("@compute @workgroup_size({threads})"),
        "fn conv2d_implicit_weight(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {".into(),
        "    let f = wid.x + wid.y * nwg.x;".into(),
        format!("    let m0 = (f % iw.m_tiles) * {bm}u;"),
        format!("    let n0 = (f / iw.m_tiles) * {bn}u;"),
        "    // Whole workgroups only: the barriers stay uniform.".into(),
        "    if (n0 >= iw.cols) { return; }".into(),
        "    let plane = iw.out_h * iw.out_w;".into(),
        "    let count = min(iw.node, iw.images - wid.z * iw.node);".into(),
        "    let q_begin = wid.z * iw.node * plane;".into(),
        "    let q_end = q_begin + count * plane;".into(),
        format!("    let steps = (count * plane + {}u) / {bk}u;", bk - 1),
        format!("    let sq = {};", weight_pixel(c).wgsl()),
    ]
}

/// One staged slice of the weight gradient: its outer products into the row's sums, a row's
/// sum into the example's at each row's end, and the example's into the node's blocks at each
/// example's end.
fn weight_slice(c: TileConfig, levels: u32, w: &mut Vec<String>) {
    let (bm, bn, bk) = (c.bm(), c.bn(), c.bk);
    let (mq, nq) = (c.tm / 4, c.tn / 4);
    let (row_a, row_b) = (weight_row(bm) / 4, weight_row(bn) / 4);
    w.push(format!("        let live = min({bk}u, q_end - (next - {bk}u));"));
    w.push("        for (var t = 0u; t < live; t++) {".into());
    for h in 0..mq {
        let at = weight_a_read(c, h).wgsl();
        w.push(format!(
            "            let a{h} = iw_a[cur * {}u + t * {row_a}u + {at}];",
            bk * row_a
        ));
    }
    for q in 0..nq {
        let at = weight_b_read(c, q).wgsl();
        w.push(format!(
            "            let b{q} = iw_b[cur * {}u + t * {row_b}u + {at}];",
            bk * row_b
        ));
    }
    for i in 0..c.tm {
        let a = format!("a{}.{}", i / 4, LANE[i as usize % 4]);
        let line: Vec<String> = (0..nq).map(|q| format!("s{i}_{q} += {a} * b{q};")).collect();
        w.push(format!("            {}", line.join(" ")));
    }
    w.push("            col++;".into());
    w.push("            if (col == iw.out_w) {".into());
    w.push("                col = 0u;".into());
    w.push("                row++;".into());
    w.push(each_output(c, "                ", &|i, q| {
        format!("e{i}_{q} += s{i}_{q}; s{i}_{q} = vec4<f32>(0.0);")
    }));
    w.push("                if (row == iw.out_h) {".into());
    w.push("                    row = 0u;".into());
    weight_push_example(c, levels, w);
    w.push("                    ex++;".into());
    w.push("                }".into());
    w.push("            }".into());
    w.push("        }".into());
}

/// The example's sum into the node's pairwise blocks, as pairwise_push_or_close4 pushes it: the
/// last example closes the node's sum, which stays in e.
fn weight_push_example(c: TileConfig, levels: u32, w: &mut Vec<String>) {
    w.push("                    let closed = countTrailingZeros(~ex);".into());
    w.push("                    let last = ex + 1u == count;".into());
    for l in 0..levels {
        w.push(format!(
            "                    if ({l}u < closed || (last && {l}u > closed && ((count >> {l}u) & 1u) == 1u)) {{"
        ));
        w.push(each_output(c, "                        ", &|i, q| {
            format!("e{i}_{q} = b{l}_{i}_{q} + e{i}_{q};")
        }));
        w.push(format!("                    }} else if ({l}u == closed && !last) {{"));
        w.push(each_output(c, "                        ", &|i, q| {
            format!("b{l}_{i}_{q} = e{i}_{q};")
        }));
        w.push("                    }".into());
    }
    w.push("                    if (!last) {".into());
    w.push(each_output(c, "                        ", &|i, q| {
        format!("e{i}_{q} = vec4<f32>(0.0);")
    }));
    w.push("                    }".into());
}

/// The node's sums, where the reads place them (channel quads and k quads), into its slab of
/// the nodes' sums, or straight into dw where the batch is one node.
fn weight_stores(c: TileConfig, w: &mut Vec<String>) {
    let nq = c.tn / 4;
    for q in 0..nq {
        w.push(format!("    let k{q} = n0 + 4u * {};", weight_b_read(c, q).wgsl()));
    }
    w.push("    let node_at = wid.z * iw.c_out * iw.cols;".into());
    for i in 0..c.tm {
        let quad = weight_a_read(c, i / 4).wgsl();
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
mod tests {
    use super::*;
    use crate::assert_valid_wgsl;
    use crate::conv2d::implicit::FAMILY;

    /// A lane index's WGSL and its value agree: the expression naga evaluates at lid is `at`.
    #[test]
    fn lane_indices_write_what_they_evaluate() {
        let index = LaneIndex::new().term(32, Some(2), 8).term(1, Some(8), 1).term(64, None, 4);
        assert_eq!(index.wgsl(), "(((lid / 32u) % 2u) * 8u + (lid) % 8u + (lid / 64u) * 4u + 0u)");
        assert_eq!((index.at(0), index.at(9), index.at(33), index.at(70)), (0, 1, 9, 10));
    }

    fn every_config() -> impl Iterator<Item = TileConfig> {
        FAMILY.into_iter().flat_map(|c| [c, TileConfig { bk: 8, ..c }])
    }

    /// Every module of the family is valid WGSL for a browser's core set: the gather GEMM
    /// summing whole and by segments, the weight gradient at every node depth its registers
    /// take.
    #[test]
    fn every_configuration_is_valid_wgsl() {
        for c in every_config() {
            if crate::conv2d::implicit::gathers(c) {
                for sum in [Sum::Whole, Sum::Segments] {
                    assert_valid_wgsl(&gemm_shader(c, sum), naga::valid::Capabilities::empty());
                }
            }
            if c.bk % 8 == 0 && (c.threads() / 32) % (c.bk / 8) == 0 {
                for levels in [0, 2] {
                    let shader = weight_shader(c, levels, 33);
                    assert_valid_wgsl(&shader, naga::valid::Capabilities::empty());
                }
            }
        }
    }

    /// Every workgroup-memory index the kernels compute stays inside its array, at every lane
    /// and every place the loops put it (what the pipelines, compiled without bounds checks,
    /// rely on): the largest lane index plus the largest offset every lane adds alike.
    #[test]
    fn workgroup_memory_indices_stay_in_their_arrays() {
        let most =
            |index: LaneIndex, threads: u32| (0..threads).map(|l| index.at(l)).max().unwrap();
        for c in every_config() {
            let (bm, bn, bk, t) = (c.bm(), c.bn(), c.bk, c.threads());
            if crate::conv2d::implicit::gathers(c) {
                let (a_len, b_len) = (2 * bk * bm / 4, 2 * bk * bn / 4);
                // Reads: buffer 1, the last k row.
                let (a_last, b_last) =
                    (bk * bm / 4 + (bk - 1) * bm / 4, bk * bn / 4 + (bk - 1) * bn / 4);
                for h in 0..c.tm / 4 {
                    assert!(a_last + most(gemm_a_read(c, h), t) < a_len, "{} a read", c.name());
                }
                for q in 0..c.tn / 4 {
                    assert!(b_last + most(gemm_b_read(c, q), t) < b_len, "{} b read", c.name());
                }
                for r in 0..c.a_loads() {
                    assert!(
                        bk * bm + most(gemm_a_store(c, r), t) < 4 * a_len,
                        "{} a store",
                        c.name()
                    );
                }
                for r in 0..c.b_loads() {
                    assert!(
                        bk * bn / 4 + most(gemm_b_store(c, r), t) < b_len,
                        "{} b store",
                        c.name()
                    );
                }
            }
            if c.bk % 8 != 0 || (t / 32) % (bk / 8) != 0 {
                continue;
            }
            for (cols, read) in
                [(bm, weight_a_read as fn(TileConfig, u32) -> LaneIndex), (bn, weight_b_read)]
            {
                let row = weight_row(cols);
                let len = 2 * bk * row;
                let quads = if cols == bm { c.tm / 4 } else { c.tn / 4 };
                for q in 0..quads {
                    let last =
                        4 * (bk * row / 4 + (bk - 1) * row / 4) + 4 * most(read(c, q), t) + 3;
                    assert!(last < len, "{} weight read", c.name());
                }
                for r in 0..bk * cols / t {
                    assert!(
                        bk * row + most(weight_store(c, cols, r), t) < len,
                        "{} weight store",
                        c.name()
                    );
                    // A store's column stays in the row's columns, not its padding.
                    assert!(most(weight_column(c, r), t) < cols, "{} weight column", c.name());
                }
            }
        }
    }
}
