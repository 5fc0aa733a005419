//! The WGSL of the implicit-GEMM family, written per configuration: the frame
//! (shaders/conv2d/implicit.wgsl) and the configuration's entry point, its accumulators, loads
//! and stores written out with a variable each (CPU drivers keep an array that a loop indexes in
//! memory; GPUs keep either in registers). The lane expressions are [`Lanes`]' own, so that what
//! `bench` reports of the shared-memory reads is computed from the code that makes them.

use super::{Sum, TileConfig};
use crate::gpu::Shader;
use crate::kernels::{pairwise_shader, shader_source, specialise};

/// The frame every module of the family starts from.
pub(crate) const FRAME: Shader =
    Shader { name: "conv2d_implicit", source: shader_source!("conv2d/implicit.wgsl") };

/// Where lane `lid` of a workgroup reads the tile in workgroup memory: its pixels (rows of the
/// first operand) are quads `m_quad(lid) + h·BM/8` for h < tm/4, its columns quads
/// `n_quad(lid) + j·BN/8` for j < tn/4. Lanes next to each other take the next column quad, so a
/// warp reads consecutive vec4s of a row of b and one or a few vec4s of a row of a: no two lanes
/// of a quarter-warp meet in a bank unless they read the same address.
pub struct Lanes {
    pub threads_n: u32,
}

impl Lanes {
    /// The first pixel quad of lane `lid`.
    pub fn m_quad(&self, lid: u32) -> u32 {
        lid / self.threads_n
    }
    /// The first column quad of lane `lid`.
    pub fn n_quad(&self, lid: u32) -> u32 {
        lid % self.threads_n
    }
    fn m_quad_wgsl(&self) -> String {
        format!("lid / {}u", self.threads_n)
    }
    fn n_quad_wgsl(&self) -> String {
        format!("lid % {}u", self.threads_n)
    }
}

/// The module of `config`'s gather GEMM (`conv2d_implicit_gemm`) summing as `sum` says.
pub(crate) fn gemm_shader(config: TileConfig, sum: Sum) -> Shader {
    let variant = format!("{}_{}", config.name(), sum.name());
    specialise(&FRAME, &variant, |frame| format!("{frame}\n{}", gemm_entry(config, sum)))
}

/// `conv2d_implicit_gemm` for `c`: one BM × BN output tile of one phase (and, split, one segment
/// of its sums) per workgroup.
fn gemm_entry(c: TileConfig, sum: Sum) -> String {
    let (bm, bn, bk, threads) = (c.bm(), c.bn(), c.bk, c.threads());
    let (mq, nq) = (c.tm / 4, c.tn / 4);
    let lanes = c.lanes();
    // The stager's rows: every `a_rows`-th k row for a (one pixel per invocation: threads ≥ BM),
    // every `b_rows`-th for b's vec4s.
    let (a_rows, b_rows) = (threads / bm, threads / (bn / 4));
    let (a_loads, b_loads) = (bk * bm / threads, bk * bn / 4 / threads);
    let mut w = Vec::new();
    w.push(format!("var<workgroup> ig_a: array<vec4<f32>, {}>;", 2 * bk * bm / 4));
    w.push(format!("var<workgroup> ig_b: array<vec4<f32>, {}>;", 2 * bk * bn / 4));
    w.push(String::new());
    w.push(format!("@compute @workgroup_size({threads})"));
    w.push("fn conv2d_implicit_gemm(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {".into());
    w.push("    let phase = wid.z / ig.segments;".into());
    w.push("    let r0 = ig_record(phase, 0u);".into());
    w.push("    let r1 = ig_record(phase, 1u);".into());
    w.push("    let seg_len = u32(ig_record(phase, 2u).x);".into());
    w.push("    let grid_h = u32(r0.x);".into());
    w.push("    let grid_w = u32(r0.y);".into());
    w.push("    let k_count = u32(r0.z);".into());
    w.push("    let first = u32(r0.w);".into());
    w.push("    let pixels = ig.images * grid_h * grid_w;".into());
    w.push("    let f = wid.x + wid.y * nwg.x;".into());
    w.push(format!("    let m0 = (f % ig.m_tiles) * {bm}u;"));
    w.push(format!("    let n0 = (f / ig.m_tiles) * {bn}u;"));
    w.push("    // Whole workgroups only: the barriers stay uniform.".into());
    w.push("    if (m0 >= pixels || n0 >= ig.cols) { return; }".into());
    w.push("    var k_begin = 0u;".into());
    w.push("    var k_end = k_count;".into());
    w.push("    if (ig.segments > 1u) {".into());
    w.push("        k_begin = min((wid.z % ig.segments) * seg_len, k_count);".into());
    w.push("        k_end = min(k_begin + seg_len, k_count);".into());
    w.push("    }".into());
    w.push(format!("    let steps = (k_end - k_begin + {}u) / {bk}u;", bk - 1));
    // The stager's pixel and columns.
    w.push(format!("    let sa = ig_pixel(m0 + lid % {bm}u, grid_h, grid_w, r1);"));
    w.push(format!("    let sa_k = lid / {bm}u;"));
    w.push(format!("    let sb_col4 = n0 / 4u + lid % {}u;", bn / 4));
    w.push(format!("    let sb_k = lid / {}u;", bn / 4));
    let stage_loads = |w: &mut Vec<String>, indent: &str, k0: &str| {
        for r in 0..a_loads {
            w.push(format!(
                "{indent}pa{r} = ig_gather(sa, first, {k0} + sa_k + {}u, k_end);",
                r * a_rows
            ));
        }
        for r in 0..b_loads {
            w.push(format!(
                "{indent}pb{r} = ig_weight(first, {k0} + sb_k + {}u, k_end, sb_col4);",
                r * b_rows
            ));
        }
    };
    let stage_stores = |w: &mut Vec<String>, indent: &str, buffer: &str| {
        for r in 0..a_loads {
            w.push(format!(
                "{indent}ig_a[{buffer} * {}u + (sa_k + {}u) * {}u + (lid % {bm}u) / 4u][lid % 4u] = pa{r};",
                bk * bm / 4,
                r * a_rows,
                bm / 4
            ));
        }
        for r in 0..b_loads {
            w.push(format!(
                "{indent}ig_b[{buffer} * {}u + (sb_k + {}u) * {}u + lid % {}u] = pb{r};",
                bk * bn / 4,
                r * b_rows,
                bn / 4,
                bn / 4
            ));
        }
    };
    for r in 0..a_loads {
        w.push(format!("    var pa{r} = 0.0;"));
    }
    for r in 0..b_loads {
        w.push(format!("    var pb{r} = vec4<f32>(0.0);"));
    }
    stage_loads(&mut w, "    ", "k_begin");
    stage_stores(&mut w, "    ", "0u");
    w.push("    workgroupBarrier();".into());
    // Accumulators: c{j}_{h}, column j, pixel quad h (and the segments' total t{j}_{h}).
    let each = |f: &dyn Fn(u32, u32) -> String| -> Vec<String> {
        (0..c.tn)
            .map(|j| (0..mq).map(|h| f(j, h)).collect::<Vec<_>>().join(" "))
            .map(|l| format!("    {l}"))
            .collect()
    };
    w.extend(each(&|j, h| format!("var c{j}_{h} = vec4<f32>(0.0);")));
    if sum == Sum::Segments {
        w.extend(each(&|j, h| format!("var t{j}_{h} = vec4<f32>(0.0);")));
    }
    w.push(format!("    let am = {};", lanes.m_quad_wgsl()));
    w.push(format!("    let an = {};", lanes.n_quad_wgsl()));
    w.push("    for (var step = 0u; step < steps; step++) {".into());
    w.push("        let cur = step & 1u;".into());
    w.push(format!("        let next = k_begin + (step + 1u) * {bk}u;"));
    w.push("        let more = step + 1u < steps;".into());
    w.push("        if (more) {".into());
    stage_loads(&mut w, "            ", "next");
    w.push("        }".into());
    w.push(format!("        let a_at = cur * {}u + am;", bk * bm / 4));
    w.push(format!("        let b_at = cur * {}u + an;", bk * bn / 4));
    w.push(format!("        for (var kk = 0u; kk < {bk}u; kk++) {{"));
    for h in 0..mq {
        w.push(format!("            let a{h} = ig_a[a_at + kk * {}u + {}u];", bm / 4, h * bm / 8));
    }
    for q in 0..nq {
        w.push(format!("            let b{q} = ig_b[b_at + kk * {}u + {}u];", bn / 4, q * bn / 8));
    }
    for j in 0..c.tn {
        let b = format!("b{}.{}", j / 4, ['x', 'y', 'z', 'w'][j as usize % 4]);
        let line: Vec<String> = (0..mq).map(|h| format!("c{j}_{h} += {b} * a{h};")).collect();
        w.push(format!("            {}", line.join(" ")));
    }
    w.push("        }".into());
    if sum == Sum::Segments {
        w.push("        if ((next - k_begin) % seg_len == 0u || !more) {".into());
        for line in each(&|j, h| format!("t{j}_{h} += c{j}_{h}; c{j}_{h} = vec4<f32>(0.0);")) {
            w.push(format!("        {line}"));
        }
        w.push("        }".into());
    }
    w.push("        if (more) {".into());
    stage_stores(&mut w, "            ", "(1u - cur)");
    w.push("        }".into());
    w.push("        workgroupBarrier();".into());
    w.push("    }".into());
    // The stores: pixel quads at m0 + h·BM/2 + 4·am + i, columns at n0 + (j/4)·BN/2 + 4·an + j%4.
    w.push(
        "    let slab = select(0u, (wid.z % ig.segments) * ig.out_len, ig.segments > 1u);".into(),
    );
    let acc = if sum == Sum::Segments { 't' } else { 'c' };
    for h in 0..mq {
        for i in 0..4 {
            w.push(format!(
                "    let o{h}_{i} = ig_pixel(m0 + {}u + 4u * am + {i}u, grid_h, grid_w, r1);",
                h * bm / 2
            ));
        }
    }
    for j in 0..c.tn {
        w.push(format!("    let col{j} = n0 + {}u + 4u * an + {}u;", (j / 4) * bn / 2, j % 4));
        w.push(format!("    if (col{j} < ig.cols) {{"));
        w.push(format!("        let at = slab + col{j} * ig.out_h * ig.out_w;"));
        for h in 0..mq {
            for i in 0..4 {
                let lane = ['x', 'y', 'z', 'w'][i as usize];
                w.push(format!(
                    "        if (o{h}_{i}.ok) {{ ig_out[at + o{h}_{i}.out] = {acc}{j}_{h}.{lane}; }}"
                ));
            }
        }
        w.push("    }".into());
    }
    w.push("}".into());
    w.join("\n") + "\n"
}

/// The module of `config`'s weight gradient (`conv2d_implicit_weight`), its nodes' pairwise
/// blocks `levels` deep, and the nodes' combine (`conv2d_implicit_weight_nodes`) with its stack
/// sized for `nodes`.
pub(crate) fn weight_shader(config: TileConfig, levels: u32, nodes: u32) -> Shader {
    let frame = pairwise_shader(&FRAME, nodes);
    let variant = format!("{}_l{levels}", config.name());
    specialise(&frame, &variant, |frame| format!("{frame}\n{}", weight_entry(config, levels)))
}

/// Bytes of workgroup memory the weight gradient of `config` uses: two slices of both
/// operands, pixel-major with rows padded by a vec4 (see [`weight_entry`]).
pub(crate) fn weight_shared_bytes(config: TileConfig) -> u64 {
    2 * config.bk as u64 * (config.bm() + 4 + config.bn() + 4) as u64 * 4
}

/// `conv2d_implicit_weight` for `c`: one BM (co) × BN (k) tile and one node of examples per
/// workgroup, over slices of `bk` pixels. The slices are stored pixel-major, each row padded by
/// a vec4: a warp stages 8 pixels × 4 columns, which then fall in 32 different banks.
fn weight_entry(c: TileConfig, levels: u32) -> String {
    let (bm, bn, bk, threads) = (c.bm(), c.bn(), c.bk, c.threads());
    let (mq, nq) = (c.tm / 4, c.tn / 4);
    let (row_a, row_b) = ((bm + 4) / 4, (bn + 4) / 4);
    let lanes = c.lanes();
    let (a_loads, b_loads) = (bk * bm / threads, bk * bn / threads);
    // The warps that stage one slice's pixel block side by side; each invocation stages one
    // pixel of a slice (see the launcher's check on threads and bk).
    let blocks = bk / 8;
    let mut w = Vec::new();
    w.push(format!("var<workgroup> iw_a: array<vec4<f32>, {}>;", 2 * bk * row_a));
    w.push(format!("var<workgroup> iw_b: array<vec4<f32>, {}>;", 2 * bk * row_b));
    w.push(String::new());
    w.push(format!("@compute @workgroup_size({threads})"));
    w.push("fn conv2d_implicit_weight(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {".into());
    w.push("    let f = wid.x + wid.y * nwg.x;".into());
    w.push(format!("    let m0 = (f % iw.m_tiles) * {bm}u;"));
    w.push(format!("    let n0 = (f / iw.m_tiles) * {bn}u;"));
    w.push("    // Whole workgroups only: the barriers stay uniform.".into());
    w.push("    if (n0 >= iw.cols) { return; }".into());
    w.push("    let plane = iw.out_h * iw.out_w;".into());
    w.push("    let count = min(iw.node, iw.images - wid.z * iw.node);".into());
    w.push("    let q_begin = wid.z * iw.node * plane;".into());
    w.push("    let q_end = q_begin + count * plane;".into());
    w.push(format!("    let steps = (count * plane + {}u) / {bk}u;", bk - 1));
    w.push(format!("    let sq = ((lid / 32u) % {blocks}u) * 8u + lid % 8u;"));
    w.push(format!("    let sc = ((lid / 32u) / {blocks}u) * 4u + (lid % 32u) / 8u;"));
    // Column sc + r·(stride) of the slice for load r.
    let col_step = threads / 32 / blocks * 4;
    let loads = |w: &mut Vec<String>, indent: &str, q0: &str| {
        w.push(format!("{indent}let sp = iw_pixel({q0} + sq, q_end);"));
        for r in 0..a_loads {
            w.push(format!("{indent}pa{r} = iw_dy_at(sp, m0 + sc + {}u);", r * col_step));
        }
        for r in 0..b_loads {
            w.push(format!("{indent}pb{r} = iw_x_at(sp, n0 + sc + {}u);", r * col_step));
        }
    };
    let stores = |w: &mut Vec<String>, indent: &str, buffer: &str| {
        for (name, loads, row) in [("a", a_loads, row_a), ("b", b_loads, row_b)] {
            for r in 0..loads {
                let col = format!("sc + {}u", r * col_step);
                w.push(format!(
                    "{indent}iw_{name}[{buffer} * {}u + sq * {row}u + ({col}) / 4u][({col}) % 4u] = p{name}{r};",
                    bk * row
                ));
            }
        }
    };
    for r in 0..a_loads {
        w.push(format!("    var pa{r} = 0.0;"));
    }
    for r in 0..b_loads {
        w.push(format!("    var pb{r} = 0.0;"));
    }
    w.push("    {".into());
    loads(&mut w, "        ", "q_begin");
    w.push("    }".into());
    stores(&mut w, "    ", "0u");
    w.push("    workgroupBarrier();".into());
    // s{i}_{q}: output co i (0..tm) × k quad q, the row's sum; e… the example's; b{l}… the open
    // pairwise blocks.
    let each = |f: &dyn Fn(u32, u32) -> String| -> String {
        (0..c.tm)
            .flat_map(|i| (0..nq).map(move |q| (i, q)))
            .map(|(i, q)| f(i, q))
            .collect::<Vec<_>>()
            .join(" ")
    };
    w.push(format!("    {}", each(&|i, q| format!("var s{i}_{q} = vec4<f32>(0.0);"))));
    w.push(format!("    {}", each(&|i, q| format!("var e{i}_{q} = vec4<f32>(0.0);"))));
    for l in 0..levels {
        w.push(format!("    {}", each(&|i, q| format!("var b{l}_{i}_{q} = vec4<f32>(0.0);"))));
    }
    w.push(format!("    let am = {};", lanes.m_quad_wgsl()));
    w.push(format!("    let an = {};", lanes.n_quad_wgsl()));
    w.push("    var col = 0u;".into());
    w.push("    var row = 0u;".into());
    w.push("    var ex = 0u;".into());
    w.push("    for (var step = 0u; step < steps; step++) {".into());
    w.push("        let cur = step & 1u;".into());
    w.push(format!("        let next = q_begin + (step + 1u) * {bk}u;"));
    w.push("        let more = step + 1u < steps;".into());
    w.push("        if (more) {".into());
    loads(&mut w, "            ", "next");
    w.push("        }".into());
    w.push(format!("        let a_at = cur * {}u + am;", bk * row_a));
    w.push(format!("        let b_at = cur * {}u + an;", bk * row_b));
    w.push(format!("        let live = min({bk}u, q_end - (next - {bk}u));"));
    w.push("        for (var t = 0u; t < live; t++) {".into());
    for h in 0..mq {
        w.push(format!("            let a{h} = iw_a[a_at + t * {row_a}u + {}u];", h * bm / 8));
    }
    for q in 0..nq {
        w.push(format!("            let b{q} = iw_b[b_at + t * {row_b}u + {}u];", q * bn / 8));
    }
    for i in 0..c.tm {
        let a = format!("a{}.{}", i / 4, ['x', 'y', 'z', 'w'][i as usize % 4]);
        let line: Vec<String> = (0..nq).map(|q| format!("s{i}_{q} += {a} * b{q};")).collect();
        w.push(format!("            {}", line.join(" ")));
    }
    w.push("            col++;".into());
    w.push("            if (col == iw.out_w) {".into());
    w.push("                col = 0u;".into());
    w.push("                row++;".into());
    w.push(format!(
        "                {}",
        each(&|i, q| format!("e{i}_{q} += s{i}_{q}; s{i}_{q} = vec4<f32>(0.0);"))
    ));
    w.push("                if (row == iw.out_h) {".into());
    w.push("                    row = 0u;".into());
    // The example's sum into the node's pairwise blocks, as pairwise_push_or_close4 pushes it:
    // the last example closes the node's sum, which stays in e.
    w.push("                    let closed = countTrailingZeros(~ex);".into());
    w.push("                    let last = ex + 1u == count;".into());
    for l in 0..levels {
        w.push(format!(
            "                    if ({l}u < closed || (last && {l}u > closed && ((count >> {l}u) & 1u) == 1u)) {{"
        ));
        w.push(format!(
            "                        {}",
            each(&|i, q| format!("e{i}_{q} = b{l}_{i}_{q} + e{i}_{q};"))
        ));
        w.push(format!("                    }} else if ({l}u == closed && !last) {{"));
        w.push(format!(
            "                        {}",
            each(&|i, q| format!("b{l}_{i}_{q} = e{i}_{q};"))
        ));
        w.push("                    }".into());
    }
    w.push("                    if (!last) {".into());
    w.push(format!(
        "                        {}",
        each(&|i, q| format!("e{i}_{q} = vec4<f32>(0.0);"))
    ));
    w.push("                    }".into());
    w.push("                    ex++;".into());
    w.push("                }".into());
    w.push("            }".into());
    w.push("        }".into());
    w.push("        if (more) {".into());
    stores(&mut w, "            ", "(1u - cur)");
    w.push("        }".into());
    w.push("        workgroupBarrier();".into());
    w.push("    }".into());
    // The node's sums: co m0 + (i/4)·BM/2 + 4·am + i%4, k n0 + q·BN/2 + 4·an + 0..3.
    for q in 0..nq {
        w.push(format!("    let k{q} = n0 + {}u + 4u * an;", q * bn / 2));
    }
    w.push("    let node_at = wid.z * iw.c_out * iw.cols;".into());
    for i in 0..c.tm {
        w.push(format!("    let co{i} = m0 + {}u + 4u * am + {}u;", (i / 4) * bm / 2, i % 4));
        w.push(format!("    if (co{i} < iw.c_out) {{"));
        for q in 0..nq {
            for j in 0..4 {
                let lane = ['x', 'y', 'z', 'w'][j as usize];
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
    w.push("}".into());
    w.join("\n") + "\n"
}
