//! The implicit-GEMM family ([`Conv2dAlgo::Implicit`](super::Conv2dAlgo::Implicit)): every
//! convolution GEMM as register-blocked outer products on tiles staged in workgroup memory, for
//! GPUs. The forward and the input-VJP gather their first operand straight from NCHW through a
//! [`Table`] of where each k reads (no im2col in memory; the input-VJP's stride phases along z
//! of one dispatch) against the weights laid out once per launch as [k][column]; the weight
//! gradient walks the canonical tree's nodes of examples (weight.rs). Every configuration sums
//! each output in every other variant's order, so the choice among them ([`plan`]) changes speed
//! only. The WGSL is written per configuration (wgsl.rs) on the frame
//! shaders/conv2d/implicit.wgsl.

mod table;
mod weight;
mod wgsl;

use super::{Conv2dOp, Conv2dShape};
use crate::gpu::{grid_1d, Encoder, Gpu, Slice};
use crate::kernels::{launch, KernelError, Result};
pub use table::{Phase, Table};
pub use weight::{
    most_levels, runs as weight_runs, weight_gradient, weight_gradient_with, weight_plan,
    WeightPlan,
};
pub use wgsl::Lanes;
use wgsl::{gemm_shader, FRAME};

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
    /// Bytes of workgroup memory: two slices of both operands.
    pub const fn shared_bytes(&self) -> u64 {
        2 * self.bk as u64 * (self.bm() + self.bn()) as u64 * 4
    }
    pub fn lanes(&self) -> Lanes {
        Lanes { threads_n: self.threads_n }
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

/// The family, largest tile first; each also runs in slices of 8 k where 16 do not fit the
/// device's workgroup memory ([`fitting`]). Every workgroup has at least as many invocations as
/// its tile has pixels, so each stages one pixel of the first operand.
pub const FAMILY: [TileConfig; 7] = [
    config(16, 16, 8, 8),
    config(16, 8, 8, 8),
    config(8, 16, 8, 8),
    config(8, 8, 8, 8),
    config(8, 8, 4, 8),
    config(8, 8, 8, 4),
    config(8, 8, 4, 4),
];

/// `config` with the largest slice (16 or 8 k) whose workgroup memory fits `gpu`, if any.
pub fn fitting(gpu: &Gpu, config: TileConfig) -> Option<TileConfig> {
    let limit = gpu.limits.max_compute_workgroup_storage_size as u64;
    [16, 8].into_iter().map(|bk| config.with_bk(bk)).find(|c| c.shared_bytes() <= limit)
}

/// How a gather GEMM sums its segments (see shaders/conv2d/common.wgsl).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sum {
    /// One segment per workgroup: all of k where the shape has one segment, else one segment
    /// into a slab (the segments split along z), which a pass adds in order.
    Whole,
    /// All of k in the workgroup, its segments' sums added in order to a total.
    Segments,
}

impl Sum {
    fn name(self) -> &'static str {
        match self {
            Sum::Whole => "whole",
            Sum::Segments => "segments",
        }
    }
}

/// How a gather GEMM runs: its tile, and whether its segments go along z (into slabs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatherPlan {
    pub config: TileConfig,
    pub split: bool,
}

/// Workgroups that keep a large GPU busy: two per compute unit of one with 132.
pub const FILL: u64 = 264;

/// The plan for `table`'s GEMM over `images` on `gpu`: the largest tile of the family whose
/// dispatch has [`FILL`] workgroups (thicken first); where none has, the segments along z if
/// the shape has several (fill at the order's fixed points), else the tile giving the most.
pub fn plan(gpu: &Gpu, table: &Table, images: u32) -> GatherPlan {
    let configs: Vec<TileConfig> = FAMILY.iter().filter_map(|&c| fitting(gpu, c)).collect();
    let groups = |c: &TileConfig, split: bool| {
        let z = table.phases.len() as u64 * if split { table.segments as u64 } else { 1 };
        table.most_pixels(images).div_ceil(c.bm() as u64)
            * (table.cols as u64).div_ceil(c.bn() as u64)
            * z
    };
    let splits: &[bool] = if table.segments > 1 { &[false, true] } else { &[false] };
    for &split in splits {
        if let Some(&config) = configs.iter().find(|c| groups(c, split) >= FILL) {
            return GatherPlan { config, split };
        }
    }
    let split = table.segments > 1;
    let config = *configs
        .iter()
        .max_by_key(|c| groups(c, split))
        .expect("64-invocation tiles fit every device");
    GatherPlan { config, split }
}

/// The uniform of the family's kernels, mirrored by `struct Implicit` in the frame.
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

/// The forward (`a` = x, `out` = y) or the input-VJP (`a` = dy, `out` = dx) at `s` as a gather
/// GEMM against `w`, as [`plan`] runs it.
pub fn gather_gemm(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: Conv2dOp,
    s: &Conv2dShape,
    (a, w, out): (Slice, Slice, Slice),
) -> Result<()> {
    let table = Table::of(op, s);
    let plan = plan(gpu, &table, s.n);
    gather_gemm_with(gpu, enc, op, s, &table, plan, (a, w, out))
}

/// [`gather_gemm`] with `table` (`Table::of(op, s)`) and the plan given.
pub fn gather_gemm_with(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: Conv2dOp,
    s: &Conv2dShape,
    table: &Table,
    plan: GatherPlan,
    (a, w, out): (Slice, Slice, Slice),
) -> Result<()> {
    let name = op.name();
    let gpu_err = |source| KernelError::Gpu { op: name, source };
    let (src, dst) = match op {
        Conv2dOp::Forward => ((s.c_in, s.h, s.w), (s.c_out, s.out_h(), s.out_w())),
        _ => ((s.c_out, s.out_h(), s.out_w()), (s.c_in, s.h, s.w)),
    };
    let cols4 = table.cols.div_ceil(4);
    let segments = if plan.split { table.segments } else { 1 };
    let config = plan.config;
    let m_tiles = table.most_pixels(s.n).div_ceil(config.bm() as u64);
    let params = Params {
        cols: table.cols,
        cols4,
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
        segments,
        m_tiles: m_tiles as u32,
        out_len: out.len as u32,
        k_rows: table.k_rows() as u32,
        w_col_stride: table.w_col_stride,
    };
    let key = table_key(op, s);
    let words = gpu
        .constants(bytemuck::bytes_of(&key), || bytemuck::cast_slice(&table.words()).to_vec())
        .map_err(gpu_err)?;
    let words = Slice::whole(&words);
    // The weights as [k][column], every phase's rows one after another.
    let rows_len = (table.k_rows() * cols4 as u64 * 4).max(4);
    let rows = gpu.scratch("conv2d implicit weight rows", rows_len).map_err(gpu_err)?;
    let rows = Slice::new(&rows, 0, rows_len);
    launch(
        gpu,
        enc,
        name,
        &FRAME,
        "conv2d_implicit_weights",
        &params,
        &[("w", w), ("table", words), ("weight rows", rows)],
        grid_1d(table.k_rows() * cols4 as u64, 64),
    )?;
    let n_tiles = (table.cols as u64).div_ceil(config.bn() as u64);
    let [x, y, _] = grid_1d(m_tiles * n_tiles, 1);
    let z = params.phases * segments;
    let sum = if table.segments > 1 && !plan.split { Sum::Segments } else { Sum::Whole };
    let shader = gemm_shader(config, sum);
    gpu.charge_flops(s.flops() as f64);
    if !plan.split || table.segments == 1 {
        let bindings = [("source", a), ("weight rows", rows), ("table", words), ("out", out)];
        return launch(
            gpu,
            enc,
            name,
            &shader,
            "conv2d_implicit_gemm",
            &params,
            &bindings,
            [x, y, z],
        );
    }
    let slabs_len = segments as u64 * out.len;
    let slabs = gpu.scratch("conv2d implicit segment sums", slabs_len).map_err(gpu_err)?;
    let slabs = Slice::new(&slabs, 0, slabs_len);
    let bindings =
        [("source", a), ("weight rows", rows), ("table", words), ("segment sums", slabs)];
    launch(gpu, enc, name, &shader, "conv2d_implicit_gemm", &params, &bindings, [x, y, z])?;
    let bindings = [("segment sums", slabs), ("out", out)];
    let grid = grid_1d(out.len, 64);
    launch(gpu, enc, name, &FRAME, "conv2d_implicit_segments", &params, &bindings, grid)
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
