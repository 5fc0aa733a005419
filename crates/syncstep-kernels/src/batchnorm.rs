//! BatchNorm in training mode, synchronisable across replicas. See shaders/batchnorm.wgsl.
//!
//! x, y, dy, dx are NCHW seen as [n, c, hw]. Reductions over the batch go in two steps, per
//! example and then over examples, so that replicas holding shards of a batch can gather each
//! other's per-example rows and reduce them exactly as one device holding the whole batch:
//! - `rows` [n, 2C]: one row per example, [mean_b | M2_b] (`bn_example_stats`) or
//!   [Σdy | Σdy·x̂] (`bn_example_sums`), the unit a data-parallel step gathers;
//! - `stats` \[2C\] = \[mean | M2\] over all rows' positions, M2 = Σ(x − mean)²
//!   (`bn_merge_examples`, Chan's merge over examples, never E\[x²\]−μ²), which in training
//!   updates the running statistics in the same launch;
//! - `sums` \[2C\] = \[Σdy | Σdy·x̂\] over all rows (`bn_sum_examples`). Its halves are also the
//!   parameter gradients dβ and dγ: summed over one replica's own rows they are that
//!   replica's dβ, dγ; a caller copies them into its gradient buffer.
//!
//! A `shape` with n rows describes the batch the rows come from (on a replica that gathered
//! them, the global batch). `count` is the number of positions the statistics describe: n·hw
//! on one device, the global count once rows were gathered; so it is a parameter, never the
//! local shape's.
//!
//! Fused with the ReLU after each BN site of the step: `bn_apply_relu` is `bn_forward_apply`,
//! an optional residual add and a ReLU in one pass, and the backward kernels take the ReLU's
//! gate and mask dy on the fly; each gives the unfused sequence's bits.

use super::conv2d::{runs_gpu_kernels, Device};
use super::{
    expect_len, expect_positive, launch, pairwise_shader, shader_source, KernelError, Result,
};
use syncstep_gpu::{grid_1d, Encoder, Gpu, Shader, Slice};

pub(crate) const SHADER: Shader = Shader::file("batchnorm", shader_source!("batchnorm.wgsl"));
const WG: u32 = 256;

/// x as [n, c, hw] with hw = H·W.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BnShape {
    pub n: u32,
    pub c: u32,
    pub hw: u32,
}

impl BnShape {
    /// Elements of x, y, dy and dx.
    pub fn tensor_len(&self) -> u64 {
        self.n as u64 * self.c as u64 * self.hw as u64
    }
    /// Positions per channel on this device, n·hw: the `count` of unmerged stats.
    pub fn positions(&self) -> u64 {
        self.n as u64 * self.hw as u64
    }
    /// Length of `stats` and `sums`: 2·c.
    pub fn packed_len(&self) -> u64 {
        2 * self.c as u64
    }
    /// Length of per-example `rows`: n·2c.
    pub fn rows_len(&self) -> u64 {
        self.n as u64 * self.packed_len()
    }

    fn check(&self, op: &'static str) -> Result<()> {
        expect_positive(op, "shape.n", self.n)?;
        expect_positive(op, "shape.c", self.c)?;
        expect_positive(op, "shape.hw", self.hw)
    }

    fn check_count(&self, op: &'static str, count: u32) -> Result<()> {
        if (count as u64) < self.positions() {
            return Err(KernelError::Arg {
                op,
                arg: "count",
                problem: format!(
                    "is {count}, expected at least n·hw = {} (more once stats are merged across replicas)",
                    self.positions()
                ),
            });
        }
        Ok(())
    }

    /// The entry point and grid of an elementwise kernel: `by_four` (four elements an
    /// invocation, vec4 loads and stores) where hw is a multiple of 4, else `one` (an element).
    fn elementwise(&self, one: &'static str, by_four: &'static str) -> (&'static str, [u32; 3]) {
        if self.hw.is_multiple_of(4) {
            (by_four, grid_1d(self.tensor_len() / 4, WG))
        } else {
            (one, grid_1d(self.tensor_len(), WG))
        }
    }

    /// The entry point and grid of a per-example kernel: `by_plane` (a workgroup per (b, ch)
    /// plane) where the device takes the GPU's kernels, else `one` (an invocation per plane).
    /// Both give the same bits.
    fn per_example(
        &self,
        gpu: &Device,
        one: &'static str,
        by_plane: &'static str,
    ) -> Result<(&'static str, [u32; 3])> {
        let planes = self.n as u64 * self.c as u64;
        Ok(if runs_gpu_kernels(gpu) {
            (by_plane, grid_1d(planes, 1))
        } else {
            (one, grid_1d(planes, WG))
        })
    }

    fn params(&self, count: u32, eps: f32) -> Params {
        Params {
            n: self.n,
            c: self.c,
            hw: self.hw,
            count,
            eps,
            residual: 0,
            gated: 0,
            momentum: 0.0,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    c: u32,
    hw: u32,
    count: u32,
    eps: f32,
    residual: u32,
    gated: u32,
    momentum: f32,
}

/// Per-example statistics: `rows[b]` = \[mean | M2\] over example b's hw positions.
pub fn bn_example_stats(
    gpu: &Device,
    enc: &mut Encoder,
    shape: &BnShape,
    x: Slice,
    rows: Slice,
) -> Result<()> {
    const OP: &str = "bn_example_stats";
    shape.check(OP)?;
    expect_len(OP, "x", &x, shape.tensor_len(), "n·c·hw")?;
    expect_len(OP, "rows", &rows, shape.rows_len(), "n·2·c: [mean | M2] per example")?;
    let (entry, grid) = shape.per_example(gpu, OP, "bn_example_stats_by_plane")?;
    launch(gpu, enc, OP, &SHADER, entry, &shape.params(0, 0.0), &[("x", x), ("rows", rows)], grid)
}

/// The running statistics a training-mode merge updates in place, from the merged values:
/// mean ← (1−m)·mean + m·μ; var ← (1−m)·var + m·M2/(count−1) (the unbiased variance, as
/// PyTorch's), with count = n·hw.
pub struct Running<'a> {
    pub momentum: f32,
    pub mean: Slice<'a>,
    pub var: Slice<'a>,
}

/// `stats` = [mean | M2] per channel over the n rows of `bn_example_stats` (n·hw positions),
/// and, with `running`, the running statistics updated in the same launch. Refuses a running
/// update at count < 2, where that variance is undefined (PyTorch raises too).
pub fn bn_merge_examples(
    gpu: &Gpu,
    enc: &mut Encoder,
    shape: &BnShape,
    rows: Slice,
    stats: Slice,
    running: Option<Running>,
) -> Result<()> {
    const OP: &str = "bn_merge_examples";
    shape.check(OP)?;
    expect_len(OP, "rows", &rows, shape.rows_len(), "n·2·c: [mean | M2] per example")?;
    expect_len(OP, "stats", &stats, shape.packed_len(), "2·c: [mean | M2]")?;
    let grid = grid_1d(shape.c as u64, WG);
    let Some(Running { momentum, mean, var }) = running else {
        let bindings = [("rows", rows), ("stats", stats)];
        return launch(gpu, enc, OP, &SHADER, OP, &shape.params(0, 0.0), &bindings, grid);
    };
    let Some(count) = u32::try_from(shape.positions()).ok().filter(|&count| count >= 2) else {
        return Err(KernelError::Arg {
            op: OP,
            arg: "shape",
            problem: format!("n·hw is {}, expected 2 to 2³²−1 to update the running statistics: their unbiased variance divides by n·hw − 1", shape.positions()),
        });
    };
    expect_len(OP, "running_mean", &mean, shape.c as u64, "c")?;
    expect_len(OP, "running_var", &var, shape.c as u64, "c")?;
    let params = Params { momentum, ..shape.params(count, 0.0) };
    let bindings = [("rows", rows), ("stats", stats), ("running_mean", mean), ("running_var", var)];
    launch(gpu, enc, OP, &SHADER, "bn_merge_examples_running", &params, &bindings, grid)
}

/// y = γ (x − μ)/√(M2/count + eps) + β, with `stats` local or merged over `count` positions.
#[allow(clippy::too_many_arguments)]
pub fn bn_forward_apply(
    gpu: &Gpu,
    enc: &mut Encoder,
    shape: &BnShape,
    count: u32,
    eps: f32,
    x: Slice,
    stats: Slice,
    gamma: Slice,
    beta: Slice,
    y: Slice,
) -> Result<()> {
    const OP: &str = "bn_forward_apply";
    shape.check(OP)?;
    shape.check_count(OP, count)?;
    expect_len(OP, "x", &x, shape.tensor_len(), "n·c·hw")?;
    expect_len(OP, "stats", &stats, shape.packed_len(), "2·c: [mean | M2]")?;
    expect_len(OP, "gamma", &gamma, shape.c as u64, "c")?;
    expect_len(OP, "beta", &beta, shape.c as u64, "c")?;
    expect_len(OP, "y", &y, shape.tensor_len(), "n·c·hw")?;
    let bindings = [("x", x), ("stats", stats), ("gamma", gamma), ("beta", beta), ("y", y)];
    launch(
        gpu,
        enc,
        OP,
        &SHADER,
        OP,
        &shape.params(count, eps),
        &bindings,
        grid_1d(shape.tensor_len(), WG),
    )
}

/// `out` = relu(y + shortcut) with y = γ (x − μ)/√(M2/count + eps) + β as `bn_forward_apply`
/// gives it, no shortcut added when `shortcut` is None. The ReLU passes where its own input is
/// positive, or where `gate` > 0 when a gate is given (an imposed activation pattern). Bitwise
/// the same as `bn_forward_apply`, `elementwise::add` (y first) and `elementwise::relu_forward`.
#[allow(clippy::too_many_arguments)]
pub fn bn_apply_relu(
    gpu: &Gpu,
    enc: &mut Encoder,
    shape: &BnShape,
    count: u32,
    eps: f32,
    x: Slice,
    stats: Slice,
    gamma: Slice,
    beta: Slice,
    shortcut: Option<Slice>,
    gate: Option<Slice>,
    out: Slice,
) -> Result<()> {
    const OP: &str = "bn_apply_relu";
    shape.check(OP)?;
    shape.check_count(OP, count)?;
    expect_len(OP, "x", &x, shape.tensor_len(), "n·c·hw")?;
    expect_len(OP, "stats", &stats, shape.packed_len(), "2·c: [mean | M2]")?;
    expect_len(OP, "gamma", &gamma, shape.c as u64, "c")?;
    expect_len(OP, "beta", &beta, shape.c as u64, "c")?;
    let (shortcut, residual) = optional(OP, "shortcut", shape, shortcut, x)?;
    let (gate, gated) = optional(OP, "gate", shape, gate, x)?;
    expect_len(OP, "out", &out, shape.tensor_len(), "n·c·hw")?;
    let params = Params { residual, gated, ..shape.params(count, eps) };
    let bindings = [
        ("x", x),
        ("stats", stats),
        ("gamma", gamma),
        ("beta", beta),
        ("shortcut", shortcut),
        ("gate", gate),
        ("out", out),
    ];
    let (entry, grid) = shape.elementwise(OP, "bn_apply_relu4");
    launch(gpu, enc, OP, &SHADER, entry, &params, &bindings, grid)
}

/// An optional n·c·hw input and its flag: the input (length checked) and 1 when given; else
/// `stand_in` to fill its binding, whose values the kernel ignores with the flag at 0.
fn optional<'a>(
    op: &'static str,
    arg: &'static str,
    shape: &BnShape,
    given: Option<Slice<'a>>,
    stand_in: Slice<'a>,
) -> Result<(Slice<'a>, u32)> {
    match given {
        Some(slice) => {
            expect_len(op, arg, &slice, shape.tensor_len(), "n·c·hw")?;
            Ok((slice, 1))
        }
        None => Ok((stand_in, 0)),
    }
}

/// Per-example backward sums: `rows[b]` = \[Σdy | Σdy·x̂\] over example b's positions, x̂ from
/// the given (global) stats over `count` positions. With a `gate`, dy is first masked by the
/// ReLU that followed BN (dy where gate > 0, else 0), bitwise as `elementwise::relu_backward`.
#[allow(clippy::too_many_arguments)]
pub fn bn_example_sums(
    gpu: &Device,
    enc: &mut Encoder,
    shape: &BnShape,
    count: u32,
    eps: f32,
    dy: Slice,
    gate: Option<Slice>,
    x: Slice,
    stats: Slice,
    rows: Slice,
) -> Result<()> {
    const OP: &str = "bn_example_sums";
    shape.check(OP)?;
    shape.check_count(OP, count)?;
    expect_len(OP, "dy", &dy, shape.tensor_len(), "n·c·hw")?;
    let (gate, gated) = optional(OP, "gate", shape, gate, dy)?;
    expect_len(OP, "x", &x, shape.tensor_len(), "n·c·hw")?;
    expect_len(OP, "stats", &stats, shape.packed_len(), "2·c: [mean | M2]")?;
    expect_len(OP, "rows", &rows, shape.rows_len(), "n·2·c: [Σdy | Σdy·x̂] per example")?;
    let params = Params { gated, ..shape.params(count, eps) };
    let bindings = [("dy", dy), ("gate", gate), ("x", x), ("stats", stats), ("rows", rows)];
    let (entry, grid) = shape.per_example(gpu, OP, "bn_example_sums_by_plane")?;
    launch(gpu, enc, OP, &SHADER, entry, &params, &bindings, grid)
}

/// `sums` = [Σdy | Σdy·x̂] per channel over the n rows of `bn_example_sums`, summed pairwise
/// so that a power-of-two shard's sum is a subtree of the batch's.
pub fn bn_sum_examples(
    gpu: &Gpu,
    enc: &mut Encoder,
    shape: &BnShape,
    rows: Slice,
    sums: Slice,
) -> Result<()> {
    const OP: &str = "bn_sum_examples";
    shape.check(OP)?;
    expect_len(OP, "rows", &rows, shape.rows_len(), "n·2·c: [Σdy | Σdy·x̂] per example")?;
    expect_len(OP, "sums", &sums, shape.packed_len(), "2·c: [Σdy | Σdy·x̂]")?;
    launch(
        gpu,
        enc,
        OP,
        &pairwise_shader(&SHADER, shape.n),
        OP,
        &shape.params(0, 0.0),
        &[("rows", rows), ("sums", sums)],
        grid_1d(shape.c as u64, WG),
    )
}

/// Where [`bn_backward_input`] writes dx.
#[derive(Clone, Copy)]
pub enum BnDx<'a> {
    Into(Slice<'a>),
    /// Over dy, where nothing later reads dy: the same bits, one buffer fewer (each invocation
    /// reads its elements of dy before it writes them).
    OverDy,
}

/// dx = γ/√(σ²+eps) · (dy − Σdy/count − x̂·Σdy·x̂/count), σ² = M2/count, with `sums` over all
/// `count` positions (every replica's rows). With a `gate`, dy is masked as in
/// `bn_example_sums`.
#[allow(clippy::too_many_arguments)]
pub fn bn_backward_input(
    gpu: &Gpu,
    enc: &mut Encoder,
    shape: &BnShape,
    count: u32,
    eps: f32,
    dy: Slice,
    gate: Option<Slice>,
    x: Slice,
    stats: Slice,
    gamma: Slice,
    sums: Slice,
    dx: BnDx,
) -> Result<()> {
    const OP: &str = "bn_backward_input";
    shape.check(OP)?;
    shape.check_count(OP, count)?;
    expect_len(OP, "dy", &dy, shape.tensor_len(), "n·c·hw")?;
    // A buffer written may not be bound twice: without a gate, x stands in for it.
    let (gate, gated) = optional(OP, "gate", shape, gate, x)?;
    expect_len(OP, "x", &x, shape.tensor_len(), "n·c·hw")?;
    expect_len(OP, "stats", &stats, shape.packed_len(), "2·c: [mean | M2]")?;
    expect_len(OP, "gamma", &gamma, shape.c as u64, "c")?;
    expect_len(OP, "sums", &sums, shape.packed_len(), "2·c: [Σdy | Σdy·x̂]")?;
    let params = Params { gated, ..shape.params(count, eps) };
    let mut bindings = vec![
        ("dy", dy),
        ("gate", gate),
        ("x", x),
        ("stats", stats),
        ("gamma", gamma),
        ("sums", sums),
    ];
    let (entry, grid) = match dx {
        BnDx::Into(dx) => {
            expect_len(OP, "dx", &dx, shape.tensor_len(), "n·c·hw")?;
            bindings.push(("dx", dx));
            shape.elementwise(OP, "bn_backward_input4")
        }
        BnDx::OverDy => {
            shape.elementwise("bn_backward_input_over_dy", "bn_backward_input4_over_dy")
        }
    };
    launch(gpu, enc, OP, &SHADER, entry, &params, &bindings, grid)
}
