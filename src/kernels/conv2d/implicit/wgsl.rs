//! The WGSL of the implicit-GEMM family, written per configuration: the frame
//! (shaders/conv2d/implicit.wgsl) and the configuration's entry point, its accumulators, loads
//! and stores written out with a variable each (CPU drivers keep an array that a loop indexes in
//! memory; GPUs keep either in registers). The lane expressions are [`Lanes`]' own, so that what
//! `bench` reports of the shared-memory reads is computed from the code that makes them.

use super::{Sum, TileConfig};
use crate::gpu::Shader;
use crate::kernels::{shader_source, specialise};

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
