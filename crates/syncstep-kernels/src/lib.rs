//! The `kernels` layer: one module per op family, each a few typed launch functions that
//! check shapes and device limits up front and record into the caller's `CommandEncoder`.
//! Nothing here submits; nothing here knows the model.

use syncstep_gpu::{Encoder, Gpu, GpuError, Shader, Slice};

pub mod avgpool;
pub mod batchnorm;
pub mod conv2d;
pub use conv2d::{Device, DeviceConfig};
pub mod cross_entropy;
pub mod dense;
pub mod elementwise;
pub mod gpu_model;
pub mod matmul;
pub mod maxpool;
pub mod sgd;

/// Every shader as the launchers compile it (prelude and files joined), before any variant is
/// made from it: what the shader tests validate without a device.
pub fn base_shaders() -> [Shader; 13] {
    [
        avgpool::SHADER,
        batchnorm::SHADER,
        conv2d::SHADER,
        conv2d::IMPLICIT,
        conv2d::TILES,
        conv2d::WINOGRAD_F2,
        conv2d::WINOGRAD_F4,
        cross_entropy::SHADER,
        dense::SHADER,
        elementwise::SHADER,
        matmul::SHADER,
        maxpool::SHADER,
        sgd::SHADER,
    ]
}

/// A launch that was refused before anything was recorded, or that the device refused.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{op}: argument `{arg}` {problem}")]
    Arg { op: &'static str, arg: &'static str, problem: String },
    #[error("{op}: {source}")]
    Gpu {
        op: &'static str,
        #[source]
        source: GpuError,
    },
}

pub type Result<T, E = KernelError> = std::result::Result<T, E>;

/// llvmpipe (lavapipe, and Mesa's GL on the CPU) ends every loop of an invocation once its
/// loops together have run this many iterations, silently (gallivm's loop limiter).
const LLVMPIPE_LOOP_ITERATIONS: u64 = 65535;

/// Whether llvmpipe, if `adapter` is it, would cut short an invocation looping `iterations` times.
pub(crate) fn llvmpipe_cuts(adapter: &str, iterations: u64) -> bool {
    adapter.contains("llvmpipe") && iterations > LLVMPIPE_LOOP_ITERATIONS
}

/// Refuses, on llvmpipe, a launch whose invocations would loop `iterations` times, rather than
/// return what the loop limiter cut short: for launchers whose loops run over a size the caller
/// picks. The problem reads "`subject`, which would loop … after 65535`advice`".
pub(crate) fn expect_within_llvmpipe_loops(
    adapter: &str,
    op: &'static str,
    arg: &'static str,
    iterations: u64,
    subject: impl FnOnce() -> String,
    advice: &str,
) -> Result<()> {
    if llvmpipe_cuts(adapter, iterations) {
        let problem = format!("{}, which would loop ~{iterations} times in one invocation; llvmpipe stops loops after {LLVMPIPE_LOOP_ITERATIONS}{advice}", subject());
        return Err(KernelError::Arg { op, arg, problem });
    }
    Ok(())
}

/// Fails unless `s` holds exactly `expected` elements; `formula` says where that number comes from.
pub(crate) fn expect_len(
    op: &'static str,
    arg: &'static str,
    s: &Slice,
    expected: u64,
    formula: &str,
) -> Result<()> {
    if s.len != expected {
        return Err(KernelError::Arg {
            op,
            arg,
            problem: format!("has {} elements, expected {expected} ({formula})", s.len),
        });
    }
    Ok(())
}

/// Fails when a dimension is zero: an empty dispatch would silently leave outputs unwritten.
pub(crate) fn expect_positive(op: &'static str, arg: &'static str, v: u32) -> Result<()> {
    if v == 0 {
        return Err(KernelError::Arg { op, arg, problem: "is 0, expected at least 1".into() });
    }
    Ok(())
}

/// A shader's source: the pairwise-sum prelude (shaders/common/pairwise.wgsl), so that every
/// sum over examples takes one order, then the named files of shaders/, joined at build time.
macro_rules! shader_source {
    ($($file:literal),+ $(,)?) => {
        concat!(
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/shaders/common/pairwise.wgsl")),
            $(include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/shaders/", $file))),+
        )
    };
}
pub(crate) use shader_source;

/// The private stack sizes the pairwise sums over examples are compiled for (see
/// `pairwise_shader`): few, so that few pipelines compile.
pub const PAIRWISE_LEVELS: [u32; 4] = [4, 8, 16, 32];

/// The prelude's line that sizes the pairwise stack.
const PAIRWISE_LINE: &str = "const PAIRWISE_LEVELS: u32 = 32u;";

/// Levels a pairwise sum over `count` terms keeps: one per bit of `count`, rounded up to the
/// smallest of [`PAIRWISE_LEVELS`].
pub fn pairwise_levels(count: u32) -> u32 {
    let bits = u32::BITS - count.leading_zeros();
    PAIRWISE_LEVELS.into_iter().find(|&l| l >= bits).unwrap_or(32)
}

/// `shader` (which starts with the pairwise prelude) with its pairwise stack sized for sums over
/// `count` terms. The prelude's loops run over every level with that constant bound, so the
/// driver can unroll them and keep the blocks in registers. Only the size changes, not the
/// order of additions. (The size is an array's, which WGSL takes from a constant, not an
/// `override`: the variant writes its declaration.)
pub(crate) fn pairwise_shader(shader: &Shader, count: u32) -> Shader {
    let levels = pairwise_levels(count);
    shader.variant(&format!("pairwise{levels}"), move |source| {
        replaced(source, PAIRWISE_LINE, &format!("const PAIRWISE_LEVELS: u32 = {levels}u;"))
    })
}

/// `source` with `from`, which it must contain (the shaders are this crate's own), as `to`.
pub(crate) fn replaced(source: &str, from: &str, to: &str) -> String {
    assert!(source.contains(from), "the shader has `{from}`");
    source.replace(from, to)
}

/// `source` with entry point `entry` also taking its subgroup index, `sid`: for the modules that
/// broadcast (`Gpu::broadcasts`), compiled only where the device has subgroups.
pub(crate) fn with_subgroup_index(source: &str, entry: &str) -> String {
    let head = format!("fn {entry}(");
    replaced(source, &head, &format!("{head}@builtin(subgroup_invocation_id) sid: u32, "))
}

/// Checks every named binding against the device's limits, then records the dispatch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch<P: bytemuck::Pod>(
    gpu: &Gpu,
    encoder: &mut Encoder,
    op: &'static str,
    shader: &Shader,
    entry: &'static str,
    params: &P,
    bindings: &[(&'static str, Slice)],
    workgroups: [u32; 3],
) -> Result<()> {
    for (name, s) in bindings {
        gpu.check_binding(&format!("argument `{name}`"), s)
            .map_err(|source| KernelError::Gpu { op, source })?;
    }
    let slices: Vec<Slice> = bindings.iter().map(|(_, s)| *s).collect();
    gpu.dispatch(encoder, op, shader, entry, params, &slices, workgroups)
        .map_err(|source| KernelError::Gpu { op, source })
}

/// Fails the test unless `shader` parses and validates (naga, as wgpu does) with `capabilities`.
#[cfg(test)]
pub(crate) fn assert_valid_wgsl(shader: &Shader, capabilities: naga::valid::Capabilities) {
    let text = shader.text();
    let module = naga::front::wgsl::parse_str(&text)
        .unwrap_or_else(|e| panic!("{}: {}", shader.name, e.emit_to_string(&text)));
    naga::valid::Validator::new(naga::valid::ValidationFlags::all(), capabilities)
        .validate(&module)
        .unwrap_or_else(|e| panic!("{}: {}", shader.name, e.emit_to_string(&text)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairwise_levels_hold_the_bits_of_the_count() {
        let cases = [
            (1, 4),
            (15, 4),
            (16, 8),
            (17, 8),
            (255, 8),
            (256, 16),
            (65535, 16),
            (65536, 32),
            (u32::MAX, 32),
        ];
        for (count, levels) in cases {
            assert_eq!(pairwise_levels(count), levels, "count {count}");
        }
    }

    #[test]
    fn every_pairwise_stack_size_specialises_to_valid_wgsl() {
        let shaders = [conv2d::SHADER, dense::SHADER, batchnorm::SHADER];
        for shader in shaders {
            for levels in PAIRWISE_LEVELS {
                // The largest count that still fits `levels`.
                let specialised = pairwise_shader(&shader, ((1u64 << levels) - 1) as u32);
                assert_eq!(specialised.name, format!("{}_pairwise{levels}", shader.name));
                let declared = format!("const PAIRWISE_LEVELS: u32 = {levels}u;");
                assert!(
                    specialised.text().contains(&declared),
                    "{}: the stack size was not substituted",
                    specialised.name
                );
                assert_valid_wgsl(&specialised, naga::valid::Capabilities::empty());
            }
        }
    }
}
