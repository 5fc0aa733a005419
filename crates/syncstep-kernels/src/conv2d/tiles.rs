//! The register-tiled GEMMs' WGSL: shaders/conv2d/gemm_tiles.wgsl holds each kernel's frame,
//! with a `// TILE <entry>` line where its body goes; the body is written here for each tile
//! shape, unrolled with a variable per output (CPU drivers run a loop as a SIMD loop under a
//! lane mask, which keeps an array it indexes in memory), and loads of what a workgroup shares
//! become subgroup broadcasts where the device broadcasts. One module per tile and mode.

use super::GemmTile;
use crate::{replaced, shader_source, with_subgroup_index};
use syncstep_gpu::Shader;

/// The frame every tile's module is made from.
pub(crate) const TILES: Shader = Shader::file(
    "conv2d_tiles",
    shader_source!("conv2d/common.wgsl", "conv2d/gemm.wgsl", "conv2d/gemm_tiles.wgsl"),
);

/// The module of the register-tiled GEMMs for `tile`: every kernel's body written, the
/// forward's, input-VJP's and pixel-lane weight gradient's broadcasting their shared rows where
/// `broadcasts`, and its override constants set.
pub(super) fn gemm_lanes_shader(tile: GemmTile, broadcasts: bool) -> Shader {
    let (a, b) = (tile.per_invocation, tile.per_workgroup);
    let variant = format!("{a}x{b}{}", if broadcasts { "_broadcast" } else { "" });
    let written = TILES.variant(&variant, move |frame| {
        TileKernel::ALL.into_iter().fold(frame.to_string(), |source, kernel| {
            let broadcast = broadcasts && kernel.broadcasts();
            let line = format!("    // TILE {}\n", kernel.entry());
            let source = replaced(&source, &line, &gemm_tile(kernel, a, b, broadcast));
            if broadcast {
                with_subgroup_index(&source, kernel.entry())
            } else {
                source
            }
        })
    });
    let broadcast = if broadcasts { 1.0 } else { 0.0 };
    written.with_constants(vec![
        ("GEMM_A", a as f64),
        ("GEMM_B", b as f64),
        ("GEMM_BROADCAST", broadcast),
    ])
}

/// The kernels whose tile bodies are written out per tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TileKernel {
    Lanes,
    Gather,
    WeightPixels,
    WeightChannels,
}

impl TileKernel {
    const ALL: [TileKernel; 4] = [
        TileKernel::Lanes,
        TileKernel::Gather,
        TileKernel::WeightPixels,
        TileKernel::WeightChannels,
    ];

    /// Whether the tile's shared rows (b) can be broadcast (`Gpu::broadcasts`): the GEMMs of the
    /// forward and input-VJP, and the weight gradient's whose workgroup shares output channels
    /// (its dy values).
    fn broadcasts(self) -> bool {
        matches!(self, TileKernel::Lanes | TileKernel::Gather | TileKernel::WeightPixels)
    }

    fn entry(self) -> &'static str {
        match self {
            TileKernel::Lanes => "conv2d_gemm_lanes",
            TileKernel::Gather => "conv2d_gemm_gather",
            TileKernel::WeightPixels => "conv2d_gemm_weight_pixels",
            TileKernel::WeightChannels => "conv2d_gemm_weight_channels",
        }
    }
}

/// `kernel`'s body for an `a`×`b` tile, written out with a variable per output.
pub(super) fn gemm_tile(kernel: TileKernel, a: u32, b: u32, broadcast: bool) -> String {
    let mut lines = vec![format!("    // {}'s body for a {a} × {b} tile", kernel.entry())];
    match kernel {
        TileKernel::Lanes | TileKernel::Gather => {
            lines.extend(gemm_tile_body(kernel, a, b, broadcast))
        }
        TileKernel::WeightPixels => lines.extend(gemm_weight_tile_body(b, a / 4, broadcast)),
        TileKernel::WeightChannels => lines.extend(gemm_weight_tile_body(a, b / 4, false)),
    }
    lines.join("\n") + "\n"
}

/// One line per `i` of `rows`, each the statements `f(i, j)` for `j` of `cols`, at `indent`.
pub(super) fn unrolled(
    indent: &str,
    rows: u32,
    cols: u32,
    f: impl Fn(u32, u32) -> String,
) -> Vec<String> {
    (0..rows)
        .map(|i| format!("{indent}{}", (0..cols).map(|j| f(i, j)).collect::<Vec<_>>().join(" ")))
        .collect()
}

/// conv2d_gemm_lanes' and conv2d_gemm_gather's tile: outputs t{i}_{j}, a row i of a by a row j
/// of b, summed over k segment by segment (s{i}_{j} the segment's sum).
/// With `broadcast`, the workgroup's rows of b are not loaded by every invocation: row j by those
/// whose subgroup index is j mod 8 (one load each per 8 rows), then subgroupBroadcast to all.
pub(super) fn gemm_tile_body(kernel: TileKernel, a: u32, b: u32, broadcast: bool) -> Vec<String> {
    let mut lines = Vec::new();
    if broadcast {
        // Lanes past a's edge stay for their subgroup's broadcasts, but a subgroup wholly past it
        // has no work: at a batch of 8 half the invocations of layer2's workgroups are there.
        lines.push("    if (subgroupAll(i0 >= g.rows_a)) { return; }".into());
    }
    lines.extend(
        (0..a).map(|i| {
            format!("    let a{i} = min(i0 + {i}u, g.rows_a - 1u) * g.a_stride + batch.x;")
        }),
    );
    let loads = b.div_ceil(8);
    if broadcast {
        lines.extend((0..loads).map(|k| {
            format!(
                "    let bl{k} = min(j0 + {}u + sid % 8u, g.rows_b - 1u) * g.row4 + batch.y;",
                8 * k
            )
        }));
    } else {
        lines.extend(
            (0..b).map(|j| {
                format!("    let b{j} = min(j0 + {j}u, g.rows_b - 1u) * g.row4 + batch.y;")
            }),
        );
    }
    // The sums over k in segments (common.wgsl): t the total, s the segment's sum.
    lines.extend(unrolled("    ", a, b, |i, j| format!("var t{i}_{j} = 0.0;")));
    lines.push("    for (var v0 = 0u; v0 < g.row4; v0 += g.seg4) {".into());
    lines.extend(unrolled("    ", a, b, |i, j| format!("var s{i}_{j} = 0.0;")));
    lines.push("    for (var v = v0; v < min(v0 + g.seg4, g.row4); v++) {".into());
    if broadcast {
        lines.extend((0..loads).map(|k| format!("        let bm{k} = gl_b[bl{k} + v];")));
        lines.extend(
            (0..b).map(|j| {
                format!("        let bv{j} = subgroupBroadcast(bm{}, {}u);", j / 8, j % 8)
            }),
        );
    } else {
        lines.extend((0..b).map(|j| format!("        let bv{j} = gl_b[b{j} + v];")));
    }
    if kernel == TileKernel::Gather {
        lines.push("        let tap = gg_taps[v];".into());
        lines.push("        let live = tap != vec4<u32>(0xffffffffu);".into());
        lines.push("        let at = select(vec4<u32>(0u), tap, live);".into());
    }
    for i in 0..a {
        lines.push(match kernel {
            TileKernel::Gather => format!(
                "        let av{i} = select(vec4<f32>(0.0), vec4<f32>(gg_w[a{i} + at.x], gg_w[a{i} + at.y], gg_w[a{i} + at.z], gg_w[a{i} + at.w]), live);"
            ),
            _ => format!("        let av{i} = gl_a[a{i} + v];"),
        });
        lines.extend((0..b).map(|j| {
            let term = |c: char| format!("s{i}_{j} += av{i}.{c} * bv{j}.{c};");
            format!("        {} {} {} {}", term('x'), term('y'), term('z'), term('w'))
        }));
    }
    lines.push("    }".into());
    lines.extend(unrolled("    ", a, b, |i, j| format!("t{i}_{j} += s{i}_{j};")));
    lines.push("    }".into());
    // Output offsets: the first row's by division, each next one by a step from it.
    let rows = |name: char, first: &str, of_a: bool, count: u32| -> Vec<String> {
        (0..count)
            .map(|i| match i {
                0 => format!("    let o{name}0 = gemm_out_first({first}, {of_a});"),
                i => format!("    let o{name}{i} = gemm_out_next(o{name}{}, {of_a});", i - 1),
            })
            .collect()
    };
    lines.extend(rows('a', "i0", true, a));
    lines.extend(rows('b', "j0", false, b));
    lines.extend(unrolled("    ", a, b, |i, j| {
        format!("gemm_lanes_store(i0 + {i}u, j0 + {j}u, oa{i}.at + ob{j}.at + batch.z, t{i}_{j});")
    }));
    lines
}

/// conv2d_gemm_weight_*'s tile: `channels` output channels from co0 × `quads` vec4s of k from
/// kv0; per output (vec4) s{c}_{v}, the sum over the current output row, and e{c}_{v}, over the
/// current example.
/// With `broadcast` (the workgroup shares the channels), channel c's dy is loaded by the
/// invocations whose subgroup index is c mod 8 and broadcast, as in gemm_tile_body.
pub(super) fn gemm_weight_tile_body(channels: u32, quads: u32, broadcast: bool) -> Vec<String> {
    let mut lines: Vec<String> =
        (0..quads).map(|v| format!("    let k{v} = min(kv0 + {v}u, g.row4 - 1u);")).collect();
    let loads = channels.div_ceil(8);
    if broadcast {
        // As in gemm_tile_body: a subgroup wholly past the last k has no work.
        lines.push("    if (subgroupAll(kv0 >= g.row4)) { return; }".into());
        lines.extend((0..loads).map(|k| {
            format!(
                "    let dl{k} = min(co0 + {}u + sid % 8u, g.channels - 1u) * g.out_plane;",
                8 * k
            )
        }));
    } else {
        lines
            .extend((0..channels).map(|c| {
                format!("    let d{c} = min(co0 + {c}u, g.channels - 1u) * g.out_plane;")
            }));
    }
    lines.extend(unrolled("    ", channels, quads, |c, v| {
        format!("var e{c}_{v} = gemm_weight_start(co0 + {c}u, kv0 + {v}u);")
    }));
    // Running counters rather than a division per output row (slow on CPU drivers).
    lines.push("    var n = g.pixel_begin / g.out_plane;".into());
    lines.push("    var in_example = g.pixel_begin % g.out_plane;".into());
    lines.push("    var dy_row = gemm_weight_dy_row(g.pixel_begin);".into());
    lines.push("    for (var cols_row = 0u; cols_row < g.pixel_count * g.row4; cols_row += g.out_w * g.row4) {".into());
    lines.extend(unrolled("        ", channels, quads, |c, v| {
        format!("var s{c}_{v} = vec4<f32>(0.0);")
    }));
    lines.push("        for (var ox = 0u; ox < g.out_w; ox++) {".into());
    lines.extend(
        (0..quads)
            .map(|v| format!("            let cv{v} = wg_cols[cols_row + ox * g.row4 + k{v}];")),
    );
    if broadcast {
        lines.extend(
            (0..loads).map(|k| format!("            let dm{k} = wg_dy[dy_row + dl{k} + ox];")),
        );
    }
    for c in 0..channels {
        lines.push(if broadcast {
            format!("            let dv{c} = subgroupBroadcast(dm{}, {}u);", c / 8, c % 8)
        } else {
            format!("            let dv{c} = wg_dy[dy_row + d{c} + ox];")
        });
        lines.extend(unrolled("            ", 1, quads, |_, v| {
            format!("s{c}_{v} += dv{c} * cv{v};")
        }));
    }
    lines.push("        }".into());
    lines.extend(unrolled("        ", channels, quads, |c, v| format!("e{c}_{v} += s{c}_{v};")));
    lines.push("        in_example += g.out_w;".into());
    lines.push("        dy_row += g.out_w;".into());
    lines.push("        if (in_example == g.out_plane) {".into());
    lines.extend(unrolled("            ", channels, quads, |c, v| {
        format!("gemm_weight_push(n, co0 + {c}u, kv0 + {v}u, e{c}_{v}); e{c}_{v} = vec4<f32>(0.0);")
    }));
    lines.push("            n++;".into());
    lines.push("            in_example = 0u;".into());
    lines.push("            dy_row += (g.channels - 1u) * g.out_plane;".into());
    lines.push("        }".into());
    lines.push("    }".into());
    lines.extend(unrolled("    ", channels, quads, |c, v| {
        format!("gemm_weight_keep(co0 + {c}u, kv0 + {v}u, e{c}_{v});")
    }));
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assert_valid_wgsl;
    use crate::conv2d::GEMM_TILES;

    #[test]
    fn every_kernel_frame_has_one_body_line_and_every_module_fills_it() {
        for kernel in TileKernel::ALL {
            let line = format!("    // TILE {}\n", kernel.entry());
            assert_eq!(TILES.text().matches(&line).count(), 1, "{}", kernel.entry());
        }
        let shader = gemm_lanes_shader(GEMM_TILES[0], false);
        assert!(!shader.text().contains("// TILE "), "{}", shader.text());
    }

    #[test]
    fn every_tile_specialises_to_valid_wgsl() {
        for (tile, broadcasts) in GEMM_TILES.into_iter().flat_map(|t| [(t, false), (t, true)]) {
            let shader = gemm_lanes_shader(tile, broadcasts);
            let capabilities = if broadcasts {
                naga::valid::Capabilities::SUBGROUP
            } else {
                naga::valid::Capabilities::empty()
            };
            assert_valid_wgsl(&shader, capabilities);
            assert!(
                shader.text().contains(&format!(
                    "s{}_{} += ",
                    tile.per_invocation - 1,
                    tile.per_workgroup - 1
                )),
                "{}",
                shader.name
            );
        }
    }
}
