//! The weight gradient, `dw = Σ_{n,oy,ox} dy ⊗ x-window`, summed over the batch in the
//! pairwise order: Direct and Blocked kernels (Blocked broadcasting dy where the device
//! broadcasts), and the GEMM over the forward's im2col rows with the examples' pairwise blocks
//! kept in scratch between chunks.

use super::gemm::{gemm_chunk_pixels, im2col_chunks, Gemm};
use super::scratch;
use super::tiles::gemm_lanes_shader;
use super::Device;
use super::{
    checked, implicit_launch, no_kernel, tile_count, Conv2dAlgo, Conv2dOp, Conv2dShape, Crop,
    GemmLanes, Params, GEMM_WG, SHADER, TILE, WG,
};
use crate::{
    expect_within_llvmpipe_loops, launch, llvmpipe_cuts, pairwise_levels, pairwise_shader,
    with_subgroup_index, KernelError, Result,
};
use syncstep_gpu::{grid_1d, Encoder, Gpu, Shader, Slice};

/// Pixels per chunk of the weight gradient's GEMM at most. Each invocation loops over a chunk's
/// pixels, and lavapipe (Mesa 22) silently ends an invocation's loops after 65535 iterations of
/// all of them together (LP_MAX_TGSI_LOOP_ITERATIONS): a chunk's pixels and output rows stay
/// below that, with the pairwise pushes' loops unrolled (a constant bound).
pub(super) const WEIGHT_CHUNK_PIXELS: u64 = 16384;

/// [`conv2d_backward_weight`](super::conv2d_backward_weight) with the kernel chosen by `algo`.
pub fn conv2d_backward_weight_with(
    gpu: &Device,
    enc: &mut Encoder,
    algo: Conv2dAlgo,
    shape: &Conv2dShape,
    dy: Slice,
    x: Slice,
    dw: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_backward_weight";
    let s = shape;
    let bindings = checked(gpu, Conv2dOp::BackwardWeight, s, [dy, x, dw])?;
    if matches!(algo, Conv2dAlgo::Direct | Conv2dAlgo::Blocked) {
        expect_within_loop_limit(gpu, OP, algo, s)?;
    }
    let (entry, threads) = match algo {
        Conv2dAlgo::Direct => ("conv2d_backward_weight_direct", s.w_len()),
        Conv2dAlgo::Blocked => return backward_weight_blocked(gpu, enc, s, dy, x, dw, None),
        Conv2dAlgo::Gemm(_) if algo.has(Conv2dOp::BackwardWeight) => {
            return backward_weight_gemm(gpu, enc, algo, s, dy, x, dw)
        }
        Conv2dAlgo::Implicit => {
            return implicit_launch(gpu, enc, Conv2dOp::BackwardWeight, s, (dy, x, dw))
        }
        Conv2dAlgo::Gemm(_) => return Err(no_kernel(OP, algo)),
    };
    gpu.charge_flops(s.flops() as f64);
    launch(
        gpu,
        enc,
        OP,
        &pairwise_shader(&SHADER, s.n),
        entry,
        &s.params(),
        &bindings,
        grid_1d(threads, WG),
    )
}

/// The Blocked weight gradient of `s` into `dw` [c_out, c_in, kh, kw]; or, with `into` = (the
/// whole shape, its crop) and `s` the cropped shape, straight into the kept taps of the whole
/// kernel's `dw`, leaving the other taps as they are.
pub(super) fn backward_weight_blocked(
    gpu: &Gpu,
    enc: &mut Encoder,
    s: &Conv2dShape,
    dy: Slice,
    x: Slice,
    dw: Slice,
    into: Option<(&Conv2dShape, &Crop)>,
) -> Result<()> {
    const OP: &str = "conv2d_backward_weight";
    let bindings =
        checked(gpu, Conv2dOp::BackwardWeight, into.map_or(s, |(whole, _)| whole), [dy, x, dw])?;
    expect_within_loop_limit(gpu, OP, Conv2dAlgo::Blocked, s)?;
    let params = match into {
        Some((whole, crop)) => Params {
            crop_y: crop.ky,
            crop_x: crop.kx,
            dw_kh: whole.kh,
            dw_kw: whole.kw,
            ..s.params()
        },
        None => s.params(),
    };
    // Workgroups of WB_LANES input-channel tiles, one tile of WB_CO output channels each.
    const WB_LANES: u64 = 16;
    let groups = blocked_groups(s);
    let wb_co = TILE * groups as u64;
    let workgroups =
        (s.c_out as u64).div_ceil(wb_co) * tile_count(s.c_in as u64).div_ceil(WB_LANES);
    // Closing the examples' sum at the last saves a level of the pairwise stack where count − 1
    // needs fewer than count (see pairwise_push_or_close4).
    let close = pairwise_levels(s.n - 1) < pairwise_levels(s.n);
    let shader = blocked_weight_shader(groups, gpu.broadcasts, close);
    gpu.charge_flops(s.flops() as f64);
    launch(
        gpu,
        enc,
        OP,
        &pairwise_shader(&shader, if close { s.n - 1 } else { s.n }),
        "conv2d_backward_weight_blocked",
        &params,
        &bindings,
        grid_1d(workgroups, 1),
    )
}

/// Groups of 4 output channels a Blocked invocation sums (WB_CO / 4): 8 where an example's
/// output plane has 16 pixels or more, so that each load of x serves 128 products rather than
/// 64; 4 on smaller planes, where the padding taps leave a tap few pixels and the wider tile
/// ran slower (docs/performance-log.md, 2026-12-05). Any number gives the same bits.
pub(super) fn blocked_groups(s: &Conv2dShape) -> u32 {
    if s.c_out >= 32 && s.out_h() as u64 * s.out_w() as u64 >= 16 {
        8
    } else {
        4
    }
}

/// The module the Blocked weight gradient runs: `groups` groups of 4 output channels per
/// invocation (the kernel's `// EACH` lines written out for each), dy broadcast or not, the
/// examples' pairwise sum closed at the last (WB_CLOSE) or not.
pub(super) fn blocked_weight_shader(groups: u32, broadcasts: bool, close: bool) -> Shader {
    let variant = format!(
        "blocked{}{}{}",
        4 * groups,
        if broadcasts { "_broadcast" } else { "" },
        if close { "_close" } else { "" }
    );
    let written = SHADER.variant(&variant, move |source| {
        let source = if broadcasts { broadcast_dy(source, groups) } else { source.to_string() };
        each_group(&source, groups)
    });
    let close = if close { 1.0 } else { 0.0 };
    written.with_constants(vec![("WB_CO", (4 * groups) as f64), ("WB_CLOSE", close)])
}

/// `source` with each `// EACH <line>` written out as `groups` lines, the g-th with its `@` as
/// the g-th letter and its `#` as 4·g.
fn each_group(source: &str, groups: u32) -> String {
    let mut out = String::with_capacity(source.len() * 2);
    for line in source.lines() {
        match line.split_once("// EACH ") {
            Some((indent, each)) if indent.trim().is_empty() => {
                for (g, letter) in group_letters(groups) {
                    let written = each.replace('@', &letter.to_string());
                    out.push_str(&format!(
                        "{indent}{}\n",
                        written.replace('#', &(4 * g).to_string())
                    ));
                }
            }
            _ => out.push_str(&format!("{line}\n")),
        }
    }
    out
}

/// The Blocked kernel's groups of 4 output channels: each one's index and the letter its
/// variables carry (`ra`, `da`, `blocks_a`, …), the same in every line written for it.
fn group_letters(groups: u32) -> impl Iterator<Item = (usize, char)> {
    ('a'..='z').take(groups as usize).enumerate()
}

/// The Blocked weight gradient's dy reads (BEGIN DY … END DY) for devices that broadcast
/// (`Gpu::broadcasts`): one load per subgroup invocation for every 8 of the `groups`·4 output
/// channels, of channel co0 + 8·m + its index mod 8, and a subgroupBroadcast of each channel
/// to all. The same values: the same bits.
fn broadcast_dy(source: &str, groups: u32) -> String {
    let indent = " ".repeat(20);
    let begin = format!("{indent}// BEGIN DY conv2d_backward_weight_blocked\n");
    let end = format!("{indent}// END DY conv2d_backward_weight_blocked\n");
    let at =
        |marker: &str| source.find(marker).unwrap_or_else(|| panic!("the shader has `{marker}`"));
    let (b, e) = (at(&begin), at(&end) + end.len());
    let mut lines = vec![begin.trim_end().to_string()];
    for m in 0..groups.div_ceil(2) {
        lines.push(format!(
            "{indent}let m{m} = wb_dy[pix + min(co0 + {}u + sid % 8u, p.c_out - 1u) * ohw];",
            8 * m
        ));
    }
    for (g, letter) in group_letters(groups) {
        let lanes: Vec<String> = (0..4)
            .map(|i| format!("subgroupBroadcast(m{}, {}u)", g / 2, 4 * (g % 2) + i))
            .collect();
        lines.push(format!("{indent}let d{letter} = vec4<f32>({});", lanes.join(", ")));
    }
    lines.push(end.trim_end().to_string());
    let source = format!("{}{}\n{}", &source[..b], lines.join("\n"), &source[e..]);
    with_subgroup_index(&source, "conv2d_backward_weight_blocked")
}

/// Direct and Blocked weight gradients loop over every output pixel of every example in one
/// invocation, Blocked once per tap: refuse them where llvmpipe would cut those loops short (the
/// stem at 224², N=8; Blocked at maps of ~90² and up) rather than return a wrong gradient. The
/// autotune then takes a GEMM, whose chunks stay short; wgpu's GL backend has none (see
/// [`backward_weight_gemm`]), so there the refusal points to another adapter.
pub(super) fn expect_within_loop_limit(
    gpu: &Gpu,
    op: &'static str,
    algo: Conv2dAlgo,
    s: &Conv2dShape,
) -> Result<()> {
    let advice = if gpu.info.backend == wgpu::Backend::Gl {
        ": wgpu's GL backend has no other weight gradient; use a Vulkan adapter (on a CPU, Mesa's \
         lavapipe; `syncstep info` lists the adapters) or a smaller batch or image"
    } else {
        ": use a gemm variant"
    };
    let loops = weight_gradient_loops(algo, s);
    expect_within_llvmpipe_loops(&gpu.info.name, op, "algo", loops, || format!("is {algo}"), advice)
}

/// Whether `algo`'s weight gradient at `s` stays within llvmpipe's loop limit on `adapter`.
pub(super) fn fits_loop_limit(adapter: &str, algo: Conv2dAlgo, s: &Conv2dShape) -> bool {
    !llvmpipe_cuts(adapter, weight_gradient_loops(algo, s))
}

/// The iterations of an invocation of the Direct or Blocked weight gradient at `s`: the row
/// loop, the pixel loop and the pairwise stack's levels, per example (at most: Blocked skips the
/// rows and columns a tap reads only padding for), Blocked's once per tap.
fn weight_gradient_loops(algo: Conv2dAlgo, s: &Conv2dShape) -> u64 {
    let per_tap = s.n as u64 * (s.out_h() as u64 * (s.out_w() as u64 + 1) + 1 + 32);
    if algo == Conv2dAlgo::Blocked {
        s.kh as u64 * s.kw as u64 * (per_tap + 1)
    } else {
        per_tap
    }
}

/// The weight gradient as a GEMM: the forward's im2col rows (whole output rows per chunk)
/// against dy, into pairwise blocks of example sums (a scratch of a level for the carry between
/// chunks and one for each block open at once), then their total into dw.
pub(super) fn backward_weight_gemm(
    gpu: &Gpu,
    enc: &mut Encoder,
    algo: Conv2dAlgo,
    s: &Conv2dShape,
    dy: Slice,
    x: Slice,
    dw: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_backward_weight";
    if gpu.info.backend == wgpu::Backend::Gl {
        // Open issue: on wgpu's GL backend (llvmpipe GL, Mesa 22) these kernels give wrong sums
        // (zeros at n = 1), on Vulkan the direct kernel's bits. Refused until that is understood.
        let problem = format!("is {algo}, whose weight-gradient kernels give wrong results on the GL backend; use Blocked");
        return Err(KernelError::Arg { op: OP, arg: "algo", problem });
    }
    let row4 = (s.c_in as u64 * s.kh as u64 * s.kw as u64).div_ceil(4);
    let params = Params { row4: row4 as u32, ..s.params() };
    let level = s.c_out as u64 * row4 * 4;
    // The register tiles push every example's total (counts 1..=n).
    let levels = 1 + open_blocks(s.n as u64, 1, 1) as u64;
    let sums_len = levels * level;
    let sums = gpu
        .scratch(scratch::WEIGHT_SUMS, sums_len)
        .map_err(|source| KernelError::Gpu { op: OP, source })?;
    let sums = Slice::new(&sums, 0, sums_len);
    backward_weight_tiles(gpu, enc, algo, s, params, (dy, x), sums)?;
    weight_total(gpu, enc, s, params, sums, dw)
}

/// The most pairwise blocks open at once after any chunk of `chunk` of `total` pixels (or
/// examples), `per_example` to an example: the levels of weight sums a GEMM keeps besides the
/// carry. The blocks open after `e` whole examples are the set bits of `e`.
pub(super) fn open_blocks(total: u64, chunk: u64, per_example: u64) -> u32 {
    let ends = (chunk..total + chunk).step_by(chunk as usize);
    ends.map(|end| (end.min(total) / per_example).count_ones()).max().unwrap_or(0)
}

/// dw from the pairwise blocks of example sums in `sums` (`params.row4` vec4s a row), as
/// pairwise_total adds them.
pub(super) fn weight_total(
    gpu: &Gpu,
    enc: &mut Encoder,
    s: &Conv2dShape,
    params: Params,
    sums: Slice,
    dw: Slice,
) -> Result<()> {
    gpu.charge_flops((s.n as u64 * s.w_len()) as f64);
    launch(
        gpu,
        enc,
        "conv2d_backward_weight",
        &pairwise_shader(&SHADER, s.n),
        "conv2d_backward_weight_total",
        &params,
        &[("weight sums", sums), ("dw", dw)],
        grid_1d(s.w_len(), WG),
    )
}

/// A chunk's units (`gemm.pixel_count / gemm.unit_pixels` of them, each a level of `sums`) added
/// in order into its examples' running sums, each example's total pushed into the pairwise
/// blocks in `sums`.
pub(super) fn push_units(
    gpu: &Gpu,
    enc: &mut Encoder,
    s: &Conv2dShape,
    gemm: &Gemm,
    units: Slice,
    sums: Slice,
) -> Result<()> {
    let level = s.c_out as u64 * gemm.row4 as u64 * 4;
    gpu.charge_flops((gemm.pixel_count / gemm.unit_pixels) as f64 * level as f64);
    launch(
        gpu,
        enc,
        "conv2d_backward_weight",
        &pairwise_shader(&SHADER, s.n),
        "conv2d_backward_weight_units",
        gemm,
        &[("weight units", units), ("weight sums", sums)],
        grid_1d(level, WG),
    )
}

/// The register tiles' weight gradient: each invocation walks a chunk's pixels in order, pushing
/// every example's total into the pairwise blocks in `sums`.
fn backward_weight_tiles(
    gpu: &Gpu,
    enc: &mut Encoder,
    algo: Conv2dAlgo,
    s: &Conv2dShape,
    params: Params,
    (dy, x): (Slice, Slice),
    sums: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_backward_weight";
    let Conv2dAlgo::Gemm(tile) = algo else { return Err(no_kernel(OP, algo)) };
    let row4 = params.row4 as u64;
    let (out_w, out_plane) = (s.out_w(), s.out_h() * s.out_w());
    let pixels = s.n as u64 * out_plane as u64;
    im2col_chunks(
        gpu,
        enc,
        OP,
        ("conv2d_forward_im2col", params),
        (pixels, out_w as u64, WEIGHT_CHUNK_PIXELS.min(gemm_chunk_pixels(row4))),
        x,
        |enc, begin, count, rows| {
            let (rows_a, rows_b) = match tile.lanes {
                GemmLanes::Channels => (s.c_out as u64, row4 * 4),
                _ => (row4 * 4, s.c_out as u64),
            };
            let gemm = Gemm {
                rows_a: rows_a as u32,
                rows_b: rows_b as u32,
                row4: row4 as u32,
                pixel_begin: begin as u32,
                pixel_count: count as u32,
                channels: s.c_out,
                out_w,
                out_plane,
                ..bytemuck::Zeroable::zeroed()
            };
            let bindings = [("im2col", rows), ("dy", dy), ("weight sums", sums)];
            gpu.charge_flops(2.0 * (count * s.c_out as u64 * row4 * 4) as f64);
            let entry = if tile.lanes == GemmLanes::Channels {
                "conv2d_gemm_weight_channels"
            } else {
                "conv2d_gemm_weight_pixels"
            };
            let groups = rows_a.div_ceil(GEMM_WG as u64 * tile.per_invocation as u64)
                * rows_b.div_ceil(tile.per_workgroup as u64);
            let shader = pairwise_shader(
                &gemm_lanes_shader(tile, gpu.broadcasts && tile.lanes == GemmLanes::Pixels),
                s.n,
            );
            launch(
                gpu,
                enc,
                OP,
                &shader,
                entry,
                &gemm,
                &bindings,
                grid_1d(groups * GEMM_WG as u64, GEMM_WG),
            )
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assert_valid_wgsl;

    /// The Blocked modules are the base module with the `// EACH` lines written out per group and,
    /// broadcasting, the dy reads swapped: each must be valid WGSL (with subgroups) and,
    /// broadcasting, broadcast every channel and load dy once per 8 channels.
    #[test]
    fn blocked_shaders_are_valid_and_broadcast_every_channel() {
        for (groups, broadcasts) in [(4, false), (4, true), (8, false), (8, true)] {
            let shader = blocked_weight_shader(groups, broadcasts, false);
            assert_valid_wgsl(&shader, naga::valid::Capabilities::SUBGROUP);
            let text = shader.text();
            let kernel = &text[text.find("fn conv2d_backward_weight_blocked(").unwrap()..];
            let kernel = &kernel[..kernel.find("\n}\n").unwrap()];
            assert!(!kernel.contains("EACH"), "{kernel}");
            let last = (b'a' + groups as u8 - 1) as char;
            assert!(kernel.contains(&format!("wb_push(&blocks_{last}, n, examples, e{last});")));
            if !broadcasts {
                assert_eq!(kernel.matches("wb_dy4(").count(), groups as usize, "{kernel}");
                continue;
            }
            assert!(kernel.starts_with(
                "fn conv2d_backward_weight_blocked(@builtin(subgroup_invocation_id) sid: u32, "
            ));
            let loads = groups / 2;
            assert_eq!(kernel.matches("wb_dy[").count(), loads as usize, "{kernel}");
            assert!(!kernel.contains("wb_dy4("), "{kernel}");
            let broadcast = |m, j| kernel.contains(&format!("subgroupBroadcast(m{m}, {j}u)"));
            assert!((0..loads).all(|m| (0..8).all(|j| broadcast(m, j))), "{kernel}");
        }
    }
}
