//! BatchNorm in training mode, synchronisable across replicas. See shaders/batchnorm.wgsl.
//!
//! x, y, dy, dx are NCHW seen as [n, c, hw]. Reductions over the batch go in two steps, per
//! example and then over examples, so that replicas holding shards of a batch can gather each
//! other's per-example rows and reduce them exactly as one device holding the whole batch:
//! - `rows` [n, 2C]: one row per example, [mean_b | M2_b] (`bn_example_stats`) or
//!   [Σdy | Σdy·x̂] (`bn_example_sums`), the unit a data-parallel step gathers;
//! - `stats` \[2C\] = \[mean | M2\] over all rows' positions, M2 = Σ(x − mean)²
//!   (`bn_stats`, Chan's merge over examples, never E\[x²\]−μ²), which in training updates
//!   the running statistics in the same launch;
//! - `sums` \[2C\] = \[Σdy | Σdy·x̂\] over all rows (`bn_sums`). Its halves are also the
//!   parameter gradients dβ and dγ: summed over one replica's own rows they are that
//!   replica's dβ, dγ; a caller copies them into its gradient buffer.
//!
//! `bn_stats` and `bn_sums` take rows gathered from every replica ([`Rows::Given`]), or take
//! them first from this device's batch ([`Rows::Take`]: one device, which gathers nothing, in
//! one launch where a channel's planes are few or small). On GPUs each runs a workgroup per
//! channel, its per-example and per-row sums side by side; elsewhere an invocation per
//! channel; the same additions in the same order.
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
use syncstep_gpu::{grid_1d, Encoder, Gpu, Serial, Shader, Slice};

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
    /// plane) where the device takes the GPU's kernels and a plane has more than one block,
    /// else `one` (an invocation per plane). Both give the same bits.
    fn per_example(
        &self,
        gpu: &Device,
        one: &'static str,
        by_plane: &'static str,
    ) -> (&'static str, [u32; 3]) {
        let planes = self.n as u64 * self.c as u64;
        if runs_gpu_kernels(gpu) && self.hw > BLOCK {
            (by_plane, grid_1d(planes, 1))
        } else {
            (one, grid_1d(planes, WG))
        }
    }

    /// The entry point and grid of a per-channel kernel: `by_channel` (a workgroup per channel)
    /// where the device takes the GPU's kernels, else `one` (an invocation per channel).
    fn per_channel(
        &self,
        gpu: &Device,
        one: &'static str,
        by_channel: &'static str,
    ) -> (&'static str, [u32; 3]) {
        if runs_gpu_kernels(gpu) {
            (by_channel, grid_1d(self.c as u64, 1))
        } else {
            (one, grid_1d(self.c as u64, WG))
        }
    }

    /// The rounds in which a workgroup per channel takes its rows: examples side by side, as
    /// many as its invocations hold planes of blocks, or one at a time where a plane has more
    /// blocks than it has invocations (shaders/batchnorm.wgsl, `take_stats_rows`).
    fn rounds_taking_rows(&self) -> u32 {
        let blocks = self.hw.div_ceil(BLOCK);
        match blocks > PLANE_WG {
            true => self.n,
            false => self.n.div_ceil(PLANE_WG / blocks),
        }
    }

    /// Whether a GPU's workgroup per channel takes its rows in the launch that merges them,
    /// rather than a launch of a workgroup per plane before it: while the rounds, each as long
    /// as a plane's serial chain, cost less than the gap between two launches.
    fn takes_rows_in_one_launch(&self) -> bool {
        self.rounds_taking_rows() <= MOST_ROUNDS_TAKEN
    }

    /// What one invocation of the kernel `entry` waits for in series (for `syncstep bench`'s
    /// model): a plane's two passes of blocks of BLOCK dependent adds (the loads of a block
    /// issued ahead), the blocks' sums added in order; for the per-channel kernels also the
    /// rows, taken (unless given) in rounds of planes, and merged in blocks of BLOCK, twice.
    fn serial(&self, entry: &str, rows_taken: bool) -> Serial {
        let blocks = self.hw.div_ceil(BLOCK);
        let by_workgroup = entry.ends_with("by_plane") || entry.ends_with("by_channel");
        let plane = match by_workgroup {
            true => {
                let rounds = blocks.div_ceil(PLANE_WG);
                Serial {
                    loads: 2 * rounds,
                    barriers: 4 * rounds,
                    instructions: 2 * (BLOCK.min(self.hw) * rounds + blocks),
                }
            }
            false => Serial { loads: 2 * blocks, barriers: 0, instructions: 2 * self.hw },
        };
        if entry.starts_with("bn_example") {
            return plane;
        }
        if !by_workgroup {
            // Given its rows (only a workgroup takes them): two passes, a load per row.
            return Serial { loads: 2 * self.n, barriers: 0, instructions: 4 * self.n };
        }
        // Two passes over the rows staged a round at a time: a load each, then a block of
        // BLOCK terms read from workgroup memory (about 30 clocks before each add) and the
        // round's block sums, with the barriers between.
        let rounds = self.n.div_ceil(PLANE_WG);
        let taken = if rows_taken { self.rounds_taking_rows() } else { 0 };
        Serial {
            loads: taken * plane.loads + 2 * rounds,
            barriers: taken * plane.barriers + 4 * rounds + 2,
            instructions: taken * plane.instructions
                + 2 * rounds * (BLOCK * STAGED_TERM + PLANE_WG / BLOCK),
        }
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
            rows_given: 0,
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
    rows_given: u32,
}

/// Positions a per-example kernel sums serially into one block (BLOCK in the shader), and the
/// invocations of a workgroup that sums a plane or a channel (PLANE_WG).
const BLOCK: u32 = 32;
const PLANE_WG: u32 = 256;
/// Dependent instructions' worth (about 4 clocks each) of a staged row's term: a
/// workgroup-memory load and an add.
const STAGED_TERM: u32 = 8;
/// A launch gap (about 10 µs on the modelled GPU) is about eight rounds of a 56² plane's chain.
const MOST_ROUNDS_TAKEN: u32 = 8;

/// The bindings of a per-channel kernel `entry`: all of them by the workgroup per channel,
/// which may take its rows, and from the rows on by the invocation per channel, which is given
/// them.
fn by_channel<'b, 'a>(
    bindings: &'b [(&'static str, Slice<'a>)],
    entry: &str,
) -> &'b [(&'static str, Slice<'a>)] {
    let rows = bindings.iter().position(|(name, _)| *name == "rows").expect("a rows binding");
    match entry.ends_with("by_channel") {
        true => bindings,
        false => &bindings[rows..],
    }
}

/// The per-example rows of `bn_stats` and `bn_sums`: to be taken from this device's batch into
/// the slice, or given (gathered from every replica, or a piece's own).
#[derive(Clone, Copy)]
pub enum Rows<'a> {
    Take(Slice<'a>),
    Given(Slice<'a>),
}

impl<'a> Rows<'a> {
    fn slice(&self) -> Slice<'a> {
        match *self {
            Rows::Take(s) | Rows::Given(s) => s,
        }
    }
    fn given(&self) -> u32 {
        matches!(self, Rows::Given(_)) as u32
    }
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
    let (entry, grid) = shape.per_example(gpu, OP, "bn_example_stats_by_plane");
    gpu.describe_serial_next(shape.serial(entry, false));
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

/// `stats` = [mean | M2] per channel over the n rows (n·hw positions), and, with `running`,
/// the running statistics updated in the same launch. The rows are `rows`' own (gathered), or
/// taken first from `x` (in the same launch on GPUs, by `bn_example_stats` before it
/// elsewhere); `x` is bound either way and read only then. Refuses a running update at
/// count < 2, where that variance is undefined (PyTorch raises too).
pub fn bn_stats(
    gpu: &Device,
    enc: &mut Encoder,
    shape: &BnShape,
    x: Slice,
    rows: Rows,
    stats: Slice,
    running: Option<Running>,
) -> Result<()> {
    const OP: &str = "bn_stats";
    shape.check(OP)?;
    if let Rows::Take(_) = rows {
        expect_len(OP, "x", &x, shape.tensor_len(), "n·c·hw")?;
    }
    expect_len(OP, "rows", &rows.slice(), shape.rows_len(), "n·2·c: [mean | M2] per example")?;
    expect_len(OP, "stats", &stats, shape.packed_len(), "2·c: [mean | M2]")?;
    // CPU drivers take the rows first (bn_stats takes none: see the shader), and so do GPUs
    // where a launch of a workgroup per plane is faster.
    let rows = match rows {
        Rows::Take(r) if !runs_gpu_kernels(gpu) || !shape.takes_rows_in_one_launch() => {
            bn_example_stats(gpu, enc, shape, x, r)?;
            Rows::Given(r)
        }
        rows => rows,
    };
    let taken = matches!(rows, Rows::Take(_));
    let params = Params { rows_given: rows.given(), ..shape.params(0, 0.0) };
    let Some(Running { momentum, mean, var }) = running else {
        let (entry, grid) = shape.per_channel(gpu, "bn_stats", "bn_stats_by_channel");
        gpu.describe_serial_next(shape.serial(entry, taken));
        let bindings = [("x", x), ("rows", rows.slice()), ("stats", stats)];
        return launch(gpu, enc, OP, &SHADER, entry, &params, by_channel(&bindings, entry), grid);
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
    let params = Params { momentum, count, ..params };
    let bindings = [
        ("x", x),
        ("rows", rows.slice()),
        ("stats", stats),
        ("running_mean", mean),
        ("running_var", var),
    ];
    let (entry, grid) = shape.per_channel(gpu, "bn_stats_running", "bn_stats_running_by_channel");
    gpu.describe_serial_next(shape.serial(entry, taken));
    launch(gpu, enc, OP, &SHADER, entry, &params, by_channel(&bindings, entry), grid)
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
    let (entry, grid) = shape.per_example(gpu, OP, "bn_example_sums_by_plane");
    gpu.describe_serial_next(shape.serial(entry, false));
    launch(gpu, enc, OP, &SHADER, entry, &params, &bindings, grid)
}

/// `sums` = [Σdy | Σdy·x̂] per channel over the n rows, summed pairwise so that a
/// power-of-two shard's sum is a subtree of the batch's. The rows are `rows`' own (gathered, or
/// a piece's), or taken first from `dy` (masked by `gate`), `x` and `stats` as
/// `bn_example_sums` takes them (in the same launch on GPUs, by it before elsewhere); those are
/// bound either way and read only then.
#[allow(clippy::too_many_arguments)]
pub fn bn_sums(
    gpu: &Device,
    enc: &mut Encoder,
    shape: &BnShape,
    count: u32,
    eps: f32,
    dy: Slice,
    gate: Option<Slice>,
    x: Slice,
    stats: Slice,
    rows: Rows,
    sums: Slice,
) -> Result<()> {
    const OP: &str = "bn_sums";
    shape.check(OP)?;
    let (gate, gated) = if let Rows::Take(_) = rows {
        shape.check_count(OP, count)?;
        expect_len(OP, "dy", &dy, shape.tensor_len(), "n·c·hw")?;
        expect_len(OP, "x", &x, shape.tensor_len(), "n·c·hw")?;
        optional(OP, "gate", shape, gate, dy)?
    } else {
        (gate.unwrap_or(dy), 0)
    };
    expect_len(OP, "stats", &stats, shape.packed_len(), "2·c: [mean | M2]")?;
    let per_example = "n·2·c: [Σdy | Σdy·x̂] per example";
    expect_len(OP, "rows", &rows.slice(), shape.rows_len(), per_example)?;
    expect_len(OP, "sums", &sums, shape.packed_len(), "2·c: [Σdy | Σdy·x̂]")?;
    let rows = match rows {
        Rows::Take(r) if !runs_gpu_kernels(gpu) || !shape.takes_rows_in_one_launch() => {
            let gate = (gated == 1).then_some(gate);
            bn_example_sums(gpu, enc, shape, count, eps, dy, gate, x, stats, r)?;
            Rows::Given(r)
        }
        rows => rows,
    };
    let taken = matches!(rows, Rows::Take(_));
    let params = Params { gated, rows_given: rows.given(), ..shape.params(count, eps) };
    let bindings = [
        ("dy", dy),
        ("gate", gate),
        ("x", x),
        ("stats", stats),
        ("rows", rows.slice()),
        ("sums", sums),
    ];
    let (entry, grid) = shape.per_channel(gpu, "bn_sums", "bn_sums_by_channel");
    gpu.describe_serial_next(shape.serial(entry, taken));
    launch(
        gpu,
        enc,
        OP,
        &pairwise_shader(&SHADER, shape.n),
        entry,
        &params,
        by_channel(&bindings, entry),
        grid,
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
