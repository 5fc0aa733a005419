//! The matrix product `C = A·B`, row-major: the roofline probe. The benchmarks time it beside
//! the convolutions on the same adapter, so that a convolution's GFLOP/s reads as a fraction of
//! what that adapter does on a plain f32 GEMM. See shaders/matmul.wgsl for what is subtle.
//!
//! [`MatmulAlgo::Simple`] is one element per invocation, any sizes: the tiled kernel's test
//! neighbour. [`MatmulAlgo::Tiled`] holds a register tile per invocation and reads vec4s; which
//! tile is fastest depends on the driver, so the probe's figure is the best of [`MATMUL_TILES`].

use super::{expect_len, expect_positive, launch, with_subgroup_index, KernelError, Result};
use syncstep_gpu::{grid_1d, Encoder, Gpu, Shader, Slice};

const SOURCE: &str = include_str!("../shaders/matmul.wgsl");
pub(crate) const SHADER: Shader = Shader::file("matmul", SOURCE);
const WG: u32 = 64;

/// `C [m, n] = A [m, k] · B [k, n]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulShape {
    pub m: u32,
    pub k: u32,
    pub n: u32,
}

impl MatmulShape {
    /// Multiply-adds count 2.
    pub fn flops(&self) -> u64 {
        2 * self.m as u64 * self.k as u64 * self.n as u64
    }
}

/// Which kernel a launch records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulAlgo {
    /// One element per invocation, any sizes.
    Simple,
    /// `rows` × `cols` elements per invocation (`cols` a multiple of 4), vec4 loads; k and n
    /// must be multiples of 4.
    Tiled { rows: u32, cols: u32 },
}

/// The tiles [`MatmulAlgo::Tiled`] is compiled for: compilers differ in how many accumulators
/// they keep in registers before spilling, so the probe tries several and reports the best.
pub const MATMUL_TILES: [MatmulAlgo; 4] = [
    MatmulAlgo::Tiled { rows: 4, cols: 4 },
    MatmulAlgo::Tiled { rows: 4, cols: 8 },
    MatmulAlgo::Tiled { rows: 8, cols: 8 },
    MatmulAlgo::Tiled { rows: 12, cols: 8 },
];

/// `c = a·b`: `a` [m, k], `b` [k, n], `c` [m, n] (overwritten), with the kernel `algo`.
pub fn matmul(
    gpu: &Gpu,
    enc: &mut Encoder,
    algo: MatmulAlgo,
    shape: &MatmulShape,
    a: Slice,
    b: Slice,
    c: Slice,
) -> Result<()> {
    const OP: &str = "matmul";
    let s = shape;
    for (arg, v) in [("m", s.m), ("k", s.k), ("n", s.n)] {
        expect_positive(OP, arg, v)?;
    }
    let (m, k, n) = (s.m as u64, s.k as u64, s.n as u64);
    let sizes = [("a", a, m * k, "m·k"), ("b", b, k * n, "k·n"), ("c", c, m * n, "m·n")];
    for (arg, slice, len, formula) in &sizes {
        if *len > i32::MAX as u64 {
            let problem = format!(
                "needs {formula} = {len} elements, more than the shader's 32-bit indices allow"
            );
            return Err(KernelError::Arg { op: OP, arg, problem });
        }
        expect_len(OP, arg, slice, *len, formula)?;
    }
    let bindings = [("a", a), ("b", b), ("c", c)];
    let params = [s.m, s.k, s.n];
    match algo {
        MatmulAlgo::Simple => {
            launch(gpu, enc, OP, &SHADER, "matmul_simple", &params, &bindings, grid_1d(m * n, WG))
        }
        MatmulAlgo::Tiled { rows, cols } => {
            if !MATMUL_TILES.contains(&algo) {
                return Err(KernelError::Arg {
                    op: OP,
                    arg: "algo",
                    problem: format!("is a {rows}×{cols} tile; compiled tiles: {MATMUL_TILES:?}"),
                });
            }
            for (arg, v) in [("k", s.k), ("n", s.n)] {
                if v % 4 != 0 {
                    return Err(KernelError::Arg { op: OP, arg, problem: format!("is {v}; the tiled kernel reads vec4s and needs a multiple of 4 (use Simple)") });
                }
            }
            let col_groups = (n / 4).div_ceil(WG as u64 * (cols / 4) as u64);
            let groups = m.div_ceil(rows as u64) * col_groups;
            launch(
                gpu,
                enc,
                OP,
                &tiled_shader(rows, cols / 4, gpu.broadcasts),
                "matmul_tiled",
                &params,
                &bindings,
                grid_1d(groups * WG as u64, WG),
            )
        }
    }
}

/// matmul.wgsl for one tile: the body between BEGIN TILE and END TILE written for it, its
/// override constants set. With `broadcasts` (`Gpu::broadcasts`) the workgroup's rows of A are
/// loaded once per 8 invocations and subgroupBroadcast, as the convolutions' GEMMs do.
fn tiled_shader(rows: u32, cols4: u32, broadcasts: bool) -> Shader {
    let variant = format!("{rows}x{}{}", 4 * cols4, if broadcasts { "_broadcast" } else { "" });
    let written = SHADER.variant(&variant, move |source| {
        let (begin, end) = tile_block(source);
        let tile = matmul_tile(rows, cols4, broadcasts);
        let source = format!("{}{tile}{}", &source[..begin], &source[end..]);
        if broadcasts {
            with_subgroup_index(&source, "matmul_tiled")
        } else {
            source
        }
    });
    let broadcast = if broadcasts { 1.0 } else { 0.0 };
    written.with_constants(vec![
        ("TILE_M", rows as f64),
        ("TILE_N4", cols4 as f64),
        ("TILE_BROADCAST", broadcast),
    ])
}

/// Where matmul.wgsl's tile body starts and ends (the END TILE line included).
fn tile_block(source: &str) -> (usize, usize) {
    const END: &str = "    // END TILE\n";
    let begin =
        source.find("    // BEGIN TILE").expect("matmul.wgsl marks matmul_tiled's tile body");
    (begin, source.find(END).expect("matmul.wgsl marks the end of the tile body") + END.len())
}

/// matmul_tiled's body for `rows` × `cols4` vec4s, written out with a variable per vec4 of C:
/// CPU drivers run a loop as a SIMD loop under a lane mask, which keeps an array it indexes in
/// memory.
fn matmul_tile(rows: u32, cols4: u32, broadcast: bool) -> String {
    let mut lines = vec![format!("    // BEGIN TILE: {rows} rows × {cols4} vec4s, as matmul_tile in syncstep-kernels' matmul.rs writes it.")];
    let loads = rows.div_ceil(8);
    if broadcast {
        lines.extend(
            (0..loads).map(|k| {
                format!("    let al{k} = min(r0 + {}u + sid % 8u, p.m - 1u) * k4;", 8 * k)
            }),
        );
    } else {
        lines.extend((0..rows).map(|i| format!("    let a{i} = min(r0 + {i}u, p.m - 1u) * k4;")));
    }
    lines.extend((0..cols4).map(|j| format!("    let col{j} = min(c0 + {j}u, n4 - 1u);")));
    let row = |i: u32, f: &dyn Fn(u32, u32) -> String| {
        (0..cols4).map(|j| f(i, j)).collect::<Vec<_>>().join(" ")
    };
    lines.extend(
        (0..rows)
            .map(|i| format!("    {}", row(i, &|i, j| format!("var s{i}_{j} = vec4<f32>(0.0);")))),
    );
    lines.push("    for (var kk = 0u; kk < k4; kk++) {".into());
    lines.push("        let b_row = 4u * kk * n4;".into());
    for j in 0..cols4 {
        lines.push(format!("        let b{j} = array<vec4<f32>, 4>(mt_b[b_row + col{j}], mt_b[b_row + n4 + col{j}], mt_b[b_row + 2u * n4 + col{j}], mt_b[b_row + 3u * n4 + col{j}]);"));
    }
    if broadcast {
        lines.extend((0..loads).map(|k| format!("        let am{k} = mt_a[al{k} + kk];")));
    }
    for i in 0..rows {
        lines.push(if broadcast {
            format!("        let av{i} = subgroupBroadcast(am{}, {}u);", i / 8, i % 8)
        } else {
            format!("        let av{i} = mt_a[a{i} + kk];")
        });
        lines.extend((0..cols4).map(|j| {
            format!("        s{i}_{j} += av{i}.x * b{j}[0]; s{i}_{j} += av{i}.y * b{j}[1]; s{i}_{j} += av{i}.z * b{j}[2]; s{i}_{j} += av{i}.w * b{j}[3];")
        }));
    }
    lines.push("    }".into());
    lines.extend((0..rows).map(|i| {
        format!(
            "    {}",
            row(i, &|i, j| format!("matmul_tiled_store(r0 + {i}u, c0 + {j}u, s{i}_{j});"))
        )
    }));
    lines.push("    // END TILE".into());
    lines.join("\n") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shader_file_holds_the_generated_4x8_tile() {
        let (begin, end) = tile_block(SOURCE);
        assert_eq!(
            &SOURCE[begin..end],
            matmul_tile(4, 2, false),
            "regenerate matmul.wgsl's tile body with matmul_tile(4, 2, false)"
        );
    }

    #[test]
    fn every_tile_specialises_to_valid_wgsl() {
        for (algo, broadcasts) in MATMUL_TILES.into_iter().flat_map(|t| [(t, false), (t, true)]) {
            let MatmulAlgo::Tiled { rows, cols } = algo else { unreachable!() };
            let shader = tiled_shader(rows, cols / 4, broadcasts);
            let text = shader.text();
            let module = naga::front::wgsl::parse_str(&text)
                .unwrap_or_else(|e| panic!("{}: {}", shader.name, e.emit_to_string(&text)));
            let capabilities = if broadcasts {
                naga::valid::Capabilities::SUBGROUP
            } else {
                naga::valid::Capabilities::empty()
            };
            let mut validator =
                naga::valid::Validator::new(naga::valid::ValidationFlags::all(), capabilities);
            validator
                .validate(&module)
                .unwrap_or_else(|e| panic!("{}: {}", shader.name, e.emit_to_string(&text)));
        }
    }
}
