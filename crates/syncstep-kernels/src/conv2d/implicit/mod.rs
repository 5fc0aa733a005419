//! The implicit-GEMM family ([`Conv2dAlgo::Implicit`](super::Conv2dAlgo::Implicit)): every
//! convolution GEMM as register-blocked outer products on tiles staged in workgroup memory, for
//! GPUs. The forward and the input-VJP gather their first operand straight from NCHW through a
//! [`Table`] of where each k reads (no im2col in memory; the input-VJP's stride phases along z
//! of one dispatch) against the weights laid out once per launch as [k][column]; the weight
//! gradient walks the canonical tree's nodes of examples (weight.rs). Every configuration sums
//! each output in every other variant's order, so the choice among them ([`make_plan`]) changes speed
//! only. The WGSL is written per configuration (wgsl.rs) on the frame
//! shaders/conv2d/implicit.wgsl.

pub mod construction;
mod gather;
mod gather_wgsl;
mod table;
mod weight;
mod weight_wgsl;
mod wgsl;

use super::{Conv2dOp, Conv2dShape};
use crate::gpu_model::{Estimate, GpuModel, H200};
use crate::Result;
pub use gather::{
    gather_gemm_laid, gather_gemm_with, groups, kernels, lay_out, rows_per_thread, shared_limit,
    GatherLayout, GatherPlan, Group, LayoutRecords, LAYOUT_WORKGROUP,
};
pub use gather_wgsl::GatherKernel;
use syncstep_gpu::{DispatchShape, Encoder, Gpu, Slice};
pub use table::{Phase, Table, TapGrid};
pub use weight::{
    kernel as weight_kernel, most_levels, runs as weight_runs, weight_gradient_with, weight_plan,
    WeightPlan,
};
pub use weight_wgsl::WeightKernel;
pub(crate) use wgsl::FRAME;

/// One configuration of the family: a workgroup of `threads_m × threads_n` invocations, each
/// summing `tm × tn` outputs (pixels × columns: 4 or 8 each) over slices of `bk` k staged in
/// workgroup memory, double-buffered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TileConfig {
    pub threads_m: u32,
    pub threads_n: u32,
    pub tm: u32,
    pub tn: u32,
    pub bk: u32,
}

impl TileConfig {
    pub const fn threads(&self) -> u32 {
        self.threads_m * self.threads_n
    }
    /// Pixels (the first operand's rows) of a workgroup's tile.
    pub const fn bm(&self) -> u32 {
        self.threads_m * self.tm
    }
    /// Columns (the weights' rows) of a workgroup's tile.
    pub const fn bn(&self) -> u32 {
        self.threads_n * self.tn
    }
    /// Outputs per invocation.
    pub const fn outputs(&self) -> u32 {
        self.tm * self.tn
    }
    /// Floats of the first operand an invocation stages per slice (one pixel, several k).
    pub const fn a_loads(&self) -> u32 {
        self.bk * self.bm() / self.threads()
    }
    /// vec4s of the weights an invocation stages per slice.
    pub const fn b_loads(&self) -> u32 {
        self.bk * self.bn() / 4 / self.threads()
    }
    /// Bytes of workgroup memory: two slices of both operands.
    pub const fn shared_bytes(&self) -> u64 {
        2 * self.bk as u64 * (self.bm() + self.bn()) as u64 * 4
    }
    /// As shader names and reports give it: `256t-128x128-8x8-k16`.
    pub fn name(&self) -> String {
        format!(
            "{}t-{}x{}-{}x{}-k{}",
            self.threads(),
            self.bm(),
            self.bn(),
            self.tm,
            self.tn,
            self.bk
        )
    }
    /// This configuration with slices of `bk`.
    const fn with_bk(self, bk: u32) -> TileConfig {
        TileConfig { bk, ..self }
    }
}

const fn config(threads_m: u32, threads_n: u32, tm: u32, tn: u32) -> TileConfig {
    TileConfig { threads_m, threads_n, tm, tn, bk: 16 }
}

/// The family, largest tile first: 8×8 outputs an invocation in workgroups of 256 down to 32
/// invocations, then 4×8 and 4×4 for the GEMMs too small to fill a GPU otherwise, then 4×8 and
/// 4×4 in workgroups of 256, whose invocations each stage fewer of a slice's elements (the
/// weight gradient's registers go to its sums instead). The gather
/// GEMM takes the ones that [`gathers`], the weight gradient those that run it
/// (`weight::runs`); each in slices of 16 k, or of 8 where 16 do not fit the device's
/// workgroup memory ([`fitting`]).
pub const FAMILY: [TileConfig; 12] = [
    config(16, 16, 8, 8),
    config(16, 8, 8, 8),
    config(8, 16, 8, 8),
    config(8, 8, 8, 8),
    config(4, 8, 8, 8),
    config(8, 4, 8, 8),
    config(8, 8, 4, 8),
    config(8, 8, 8, 4),
    config(8, 8, 4, 4),
    config(16, 16, 4, 8),
    config(16, 16, 8, 4),
    config(16, 16, 4, 4),
];

/// Whether the gather GEMM takes `config`: at least 32 outputs an invocation (a thinner tile
/// does more staging than arithmetic), and at least as many invocations as the tile has pixels,
/// so that each stages one pixel of the first operand.
pub const fn gathers(config: TileConfig) -> bool {
    config.outputs() >= 32 && config.threads() >= config.bm()
}

/// `config` with the largest slice (16 or 8 k) whose workgroup memory fits `gpu`, if any.
pub fn fitting(gpu: &Gpu, config: TileConfig) -> Option<TileConfig> {
    let limit = gpu.limits.max_compute_workgroup_storage_size as u64;
    [16, 8].into_iter().map(|bk| config.with_bk(bk)).find(|c| c.shared_bytes() <= limit)
}

/// How a gather GEMM sums its segments (see shaders/conv2d/common.wgsl).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Sum {
    /// One segment per workgroup: all of k where the shape has one segment, else one segment
    /// into a slab (the segments split along z), which a pass adds in order.
    Whole,
    /// All of k in the workgroup, its segments' sums added in order to a total.
    Segments,
}

impl Sum {
    pub(super) fn name(self) -> &'static str {
        match self {
            Sum::Whole => "whole",
            Sum::Segments => "segments",
        }
    }
}

/// What [`make_plan`] chose for a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    Gather(GatherPlan),
    Weight(WeightPlan),
}

/// The GPU the plans are made for: wgpu does not say how many compute units a device has, and
/// a browser has no clock, so the tiles are chosen for a large GPU by construction (what fills
/// it fills a smaller one too).
pub const PLANNED_FOR: GpuModel = H200;

/// The time `dispatches` would take on [`PLANNED_FOR`] by construction, launch gaps included.
fn plan_cost<'a>(dispatches: impl Iterator<Item = &'a DispatchShape>) -> f64 {
    let m = &PLANNED_FOR;
    dispatches.map(|d| Estimate::of(m, d).seconds + m.launch_gap_s).sum()
}

/// The plan for `op` at `s` on `gpu`, made afresh: the tuner keeps it for the device's life
/// (`conv2d::implicit_plan`), as a plan weighs dozens of configurations.
pub fn make_plan(gpu: &Gpu, op: Conv2dOp, s: &Conv2dShape) -> Result<Plan> {
    match op {
        Conv2dOp::BackwardWeight => {
            Ok(Plan::Weight(weight_plan(gpu, s, &Table::of(Conv2dOp::Forward, s))?))
        }
        _ => Ok(Plan::Gather(gather::plan(gpu, op, s, &Table::of(op, s)))),
    }
}

/// The GEMM dispatch `plan` records for `op` at `s` on `gpu` (the one with the most FLOPs,
/// where the phases run in several): its workgroups, invocations, FLOPs, bytes and
/// construction, for reports (`syncstep bench`'s probe).
pub fn planned_gemm(gpu: &Gpu, op: Conv2dOp, s: &Conv2dShape, plan: Plan) -> DispatchShape {
    match plan {
        Plan::Gather(p) => {
            let table = Table::of(op, s);
            let kernels = gather::kernels(p, &table, shared_limit(gpu)).unwrap_or_default();
            let gemms = gather::dispatches(op, s, &table, p, &kernels).gemms;
            gemms.into_iter().max_by(|a, b| a.flops.total_cmp(&b.flops)).unwrap_or_default()
        }
        Plan::Weight(p) => {
            let table = Table::of(Conv2dOp::Forward, s);
            weight::kernel(p, s, shared_limit(gpu))
                .map(|k| weight::dispatches(s, &table.phases[0], &k).0)
                .unwrap_or_default()
        }
    }
}

/// The forward (`a` = x, `out` = y) or the input-VJP (`a` = dy, `out` = dx) at `s` as a gather
/// GEMM against `w`, run as `plan` says.
pub fn gather_gemm(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: Conv2dOp,
    s: &Conv2dShape,
    plan: GatherPlan,
    slices: (Slice, Slice, Slice),
) -> Result<()> {
    gather_gemm_with(gpu, enc, op, s, (&Table::of(op, s), plan), slices)
}

/// What names a launch's table among a device's constants: the op and the shape.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct TableKey {
    kind: u32,
    shape: [u32; 9],
}

fn table_key(op: Conv2dOp, s: &Conv2dShape) -> TableKey {
    let kind = match op {
        Conv2dOp::Forward => 1,
        Conv2dOp::BackwardInput => 2,
        Conv2dOp::BackwardWeight => 3,
    };
    // The batch is not in it: a table lists k, which the images share.
    TableKey { kind, shape: [0, s.c_in, s.h, s.w, s.c_out, s.kh, s.kw, s.stride, s.pad] }
}
