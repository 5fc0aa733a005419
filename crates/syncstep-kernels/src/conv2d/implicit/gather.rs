//! The forward and the input-VJP as one gather GEMM: the first operand (x, or dy) gathered
//! through the shape's [`Table`], against the weights laid out as [k][column] by a dispatch
//! before it, into the output (y, or dx) or, with the segments split along z, into slabs that a
//! pass adds in order.

use super::super::scratch;
use super::wgsl::{gemm_shader, FRAME};
use super::{construction, fitting, gathers, plan_cost, table_key, Sum, Table, TileConfig, FAMILY};
use crate::conv2d::{Conv2dOp, Conv2dShape, SCRATCH_BYTES};
use crate::{launch, KernelError, Result};
use syncstep_gpu::{grid_1d, DispatchShape, Encoder, Gpu, Slice};

/// How a gather GEMM runs: its tile, and whether its segments go along z (into slabs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatherPlan {
    pub config: TileConfig,
    pub split: bool,
}

impl GatherPlan {
    /// How its workgroups sum: all of k (by segments where the shape has several), or one
    /// segment each.
    fn sum(&self, table: &Table) -> Sum {
        if table.segments > 1 && !self.split {
            Sum::Segments
        } else {
            Sum::Whole
        }
    }
}

/// The dispatches a plan records: the weights' layout, the GEMM, and (split) the pass adding the
/// segments' slabs.
pub(super) struct GatherDispatches {
    pub layout: DispatchShape,
    pub gemm: DispatchShape,
    pub combine: Option<DispatchShape>,
}

impl GatherDispatches {
    pub fn all(&self) -> impl Iterator<Item = &DispatchShape> {
        [&self.layout, &self.gemm].into_iter().chain(&self.combine)
    }
}

/// Elements of the laid-out weights: every phase's k rows of whole vec4s of columns.
fn rows_len(table: &Table) -> u64 {
    (table.k_rows() * table.cols.div_ceil(4) as u64 * 4).max(4)
}

/// The dispatches of `plan` for `op` at `s` (`table` its table).
pub(super) fn dispatches(
    op: Conv2dOp,
    s: &Conv2dShape,
    table: &Table,
    plan: GatherPlan,
) -> GatherDispatches {
    let c = plan.config;
    let out_len = table.out_len(s.n);
    let source_len = if op == Conv2dOp::Forward { s.x_len() } else { s.y_len() };
    let (rows, words) = (rows_len(table), table.words_len());
    let slabs = if plan.split { table.segments as u64 * out_len } else { 0 };
    let tiles = table.most_pixels(s.n).div_ceil(c.bm() as u64)
        * (table.cols as u64).div_ceil(c.bn() as u64);
    let z = table.phases.len() as u64 * if plan.split { table.segments as u64 } else { 1 };
    let layout = DispatchShape {
        workgroups: (rows / 4).div_ceil(64),
        invocations: 64,
        flops: 0.0,
        bytes: 4 * (s.w_len() + rows + 4 * words),
        construction: None,
    };
    let gemm = DispatchShape {
        workgroups: tiles * z,
        invocations: c.threads(),
        flops: table.flops(s.n),
        bytes: 4 * (source_len + rows + 4 * words + if plan.split { slabs } else { out_len }),
        construction: Some(construction::gemm(
            c,
            plan.sum(table),
            4 * slabs,
            2 + plan.split as u32,
        )),
    };
    let combine = plan.split.then(|| DispatchShape {
        workgroups: out_len.div_ceil(64),
        invocations: 64,
        flops: slabs as f64,
        bytes: 4 * (slabs + out_len),
        construction: None,
    });
    GatherDispatches { layout, gemm, combine }
}

/// The plan for `op` at `s` on `gpu`: of every tile of the family that fits it, summing whole
/// or (where the shape has segments and their slabs fit a storage binding) by segments along z,
/// the one the GPU model gives the least time (`plan_cost`): thick tiles first, then enough
/// workgroups to fill the GPU, split only at the order's fixed points.
pub fn plan(gpu: &Gpu, op: Conv2dOp, s: &Conv2dShape, table: &Table) -> GatherPlan {
    let cap = SCRATCH_BYTES.min(gpu.limits.max_storage_buffer_binding_size);
    let splittable = table.segments > 1 && 4 * table.segments as u64 * table.out_len(s.n) <= cap;
    let candidates = FAMILY
        .iter()
        .filter(|&&c| gathers(c))
        .filter_map(|&c| fitting(gpu, c))
        .flat_map(|config| [false, true].map(|split| GatherPlan { config, split }))
        .filter(|p| !p.split || splittable);
    let cost = |p: &GatherPlan| plan_cost(dispatches(op, s, table, *p).all());
    candidates
        .min_by(|a, b| cost(a).total_cmp(&cost(b)))
        .expect("64-invocation tiles fit every device")
}

/// The uniform of the gather GEMM and its passes, mirrored by `struct Implicit` in the frame.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    cols: u32,
    cols4: u32,
    images: u32,
    src_c: u32,
    src_h: u32,
    src_w: u32,
    out_c: u32,
    out_h: u32,
    out_w: u32,
    a_step: u32,
    o_step: u32,
    phases: u32,
    segments: u32,
    m_tiles: u32,
    out_len: u32,
    k_rows: u32,
    w_col_stride: u32,
}

fn params(op: Conv2dOp, s: &Conv2dShape, table: &Table, plan: GatherPlan) -> Params {
    let (src, dst) = match op {
        Conv2dOp::Forward => ((s.c_in, s.h, s.w), (s.c_out, s.out_h(), s.out_w())),
        _ => ((s.c_out, s.out_h(), s.out_w()), (s.c_in, s.h, s.w)),
    };
    Params {
        cols: table.cols,
        cols4: table.cols.div_ceil(4),
        images: s.n,
        src_c: src.0,
        src_h: src.1,
        src_w: src.2,
        out_c: dst.0,
        out_h: dst.1,
        out_w: dst.2,
        a_step: table.source_step,
        o_step: table.output_step,
        phases: table.phases.len() as u32,
        segments: if plan.split { table.segments } else { 1 },
        m_tiles: table.most_pixels(s.n).div_ceil(plan.config.bm() as u64) as u32,
        out_len: table.out_len(s.n) as u32,
        k_rows: table.k_rows() as u32,
        w_col_stride: table.w_col_stride,
    }
}

/// `op` at `s` (the forward: `a` = x, `out` = y; the input-VJP: `a` = dy, `out` = dx) against
/// `w` as `plan` runs it, `table` its table (`Table::of(op, s)`).
pub fn gather_gemm_with(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: Conv2dOp,
    s: &Conv2dShape,
    (table, plan): (&Table, GatherPlan),
    (a, w, out): (Slice, Slice, Slice),
) -> Result<()> {
    let name = op.name();
    let gpu_err = |source| KernelError::Gpu { op: name, source };
    let params = params(op, s, table, plan);
    let shapes = dispatches(op, s, table, plan);
    let key = table_key(op, s);
    let words = gpu
        .constants(bytemuck::bytes_of(&key), || bytemuck::cast_slice(&table.words()).to_vec())
        .map_err(gpu_err)?;
    let words = Slice::whole(&words);
    let rows_len = rows_len(table);
    let rows = gpu.scratch(scratch::IMPLICIT_WEIGHT_ROWS, rows_len).map_err(gpu_err)?;
    let rows = Slice::new(&rows, 0, rows_len);
    let bindings = [("w", w), ("table", words), ("weight rows", rows)];
    let grid = grid_1d(rows_len / 4, 64);
    launch(gpu, enc, name, &FRAME, "conv2d_implicit_weights", &params, &bindings, grid)?;
    let z = params.phases * params.segments;
    let [x, y, _] = grid_1d(shapes.gemm.workgroups / z as u64, 1);
    let shader = gemm_shader(plan.config, plan.sum(table));
    gpu.charge_flops(shapes.gemm.flops);
    gpu.describe_next(shapes.gemm.construction.expect("a GEMM's construction"));
    let entry = "conv2d_implicit_gemm";
    let Some(combine) = shapes.combine else {
        let bindings = [("source", a), ("weight rows", rows), ("table", words), ("out", out)];
        return launch(gpu, enc, name, &shader, entry, &params, &bindings, [x, y, z]);
    };
    let slabs_len = params.segments as u64 * out.len;
    let slabs = gpu.scratch(scratch::IMPLICIT_SEGMENT_SUMS, slabs_len).map_err(gpu_err)?;
    let slabs = Slice::new(&slabs, 0, slabs_len);
    let bindings =
        [("source", a), ("weight rows", rows), ("table", words), ("segment sums", slabs)];
    launch(gpu, enc, name, &shader, entry, &params, &bindings, [x, y, z])?;
    gpu.charge_flops(combine.flops);
    let bindings = [("segment sums", slabs), ("out", out)];
    let grid = grid_1d(out.len, 64);
    launch(gpu, enc, name, &FRAME, "conv2d_implicit_segments", &params, &bindings, grid)
}
