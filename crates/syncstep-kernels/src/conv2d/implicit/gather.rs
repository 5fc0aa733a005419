//! The forward and the input-VJP as one gather GEMM: the first operand (x, or dy) gathered
//! straight from NCHW by the phase's tap grid ([`Table`]), against the weights laid out as
//! [k][column] by a dispatch before it, into the output (y, or dx) or, with the segments split
//! along z, into slabs that a pass adds in order. The phases of one tap grid run in one
//! dispatch (the forward has one phase; a strided input-VJP's phases differ in their taps).

use super::super::scratch;
use super::construction::{self, GatherWork};
use super::gather_wgsl::{gather_shader, GatherKernel};
use super::{gathers, plan_cost, table_key, Sum, Table, TileConfig, FAMILY, PLANNED_FOR};
use crate::conv2d::{Conv2dOp, Conv2dShape, SCRATCH_BYTES};
use crate::{launch, KernelError, Result};
use syncstep_gpu::{grid_1d, DispatchShape, Encoder, Gpu, Serial, Slice};

/// How a gather GEMM runs: its tile, the slice depth it aims at (`config.bk`: each dispatch
/// stages whole tap rows, [`rows_per_thread`]), and whether its segments go along z (into slabs).
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

/// A run of phases with one tap grid (a phase with no tap joins any run: it writes +0): one
/// dispatch, its phases along z.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Group {
    pub phase0: u32,
    pub phases: u32,
    pub rows: u32,
    pub cols: u32,
}

/// The groups of `table`'s phases, in order.
pub fn groups(table: &Table) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    for (i, p) in table.phases.iter().enumerate() {
        let grid = (p.taps.rows, p.taps.cols);
        match groups.last_mut() {
            Some(g) if p.taps.is_empty() || (g.rows, g.cols) == grid => g.phases += 1,
            Some(g) if g.rows == 0 => (g.rows, g.cols, g.phases) = (grid.0, grid.1, g.phases + 1),
            _ => groups.push(Group { phase0: i as u32, phases: 1, rows: grid.0, cols: grid.1 }),
        }
    }
    for g in &mut groups {
        // A group of empty phases only still runs one (empty) row a slice.
        (g.rows, g.cols) = (g.rows.max(1), g.cols.max(1));
    }
    groups
}

/// The most taps a kernel takes as literals: each keeps a flag and an offset in registers for
/// the kernel's life.
const LITERAL_TAPS: u32 = 16;

/// Workgroup memory a gather kernel may take on `gpu`: the device's, and no more than the GPU
/// the plans are made for has ([`PLANNED_FOR`]), so that a device with more plans as that one.
pub fn shared_limit(gpu: &Gpu) -> u64 {
    (gpu.limits.max_compute_workgroup_storage_size as u64).min(PLANNED_FOR.shared_per_workgroup)
}

/// Tap rows each invocation of `config` stages per slice, for phases of `group`'s grid, within
/// `limit` bytes of workgroup memory: whole channels where a slice of about `config.bk` k holds
/// one (every tap then a literal), as many as make about `config.bk`, a power of two; else
/// (large kernels: the 7×7 stem) fewer rows than a channel has. With several segments a slice
/// never straddles two (`segment_channels` summed channels each). None where nothing fits.
pub fn rows_per_thread(
    config: TileConfig,
    group: &Group,
    segment_channels: Option<u32>,
    limit: u64,
) -> Option<u32> {
    let per_pixel = config.threads() / config.bm();
    let kernel = |rows_per_thread| GatherKernel {
        config,
        sum: Sum::Whole,
        rows: group.rows,
        cols: group.cols,
        rows_per_thread,
    };
    let aligned = |k: &GatherKernel| {
        segment_channels.is_none_or(|ch| (ch * group.rows).is_multiple_of(k.slice_rows()))
    };
    let ok = |k: &GatherKernel| k.shared_bytes() <= limit && aligned(k);
    let target = config.bk as f64;
    let channel = (group.rows * group.cols * per_pixel) as f64;
    let most = (target / channel).log2().round().max(0.0) as u32;
    let literal = group.rows * group.cols <= LITERAL_TAPS;
    let whole = (0..=most).rev().map(|p| group.rows << p).map(kernel).filter(|_| literal).find(ok);
    let rows = (target / (group.cols * per_pixel) as f64).round() as u32;
    let part = (1..group.rows.min(rows.max(1) + 1)).rev().map(kernel).find(ok);
    whole.or(part).map(|k| k.rows_per_thread)
}

/// The kernels `plan` runs for `table` on a device of `limit` bytes of workgroup memory, a
/// group each; None where a group has no kernel that fits.
pub fn kernels(plan: GatherPlan, table: &Table, limit: u64) -> Option<Vec<(Group, GatherKernel)>> {
    let segments = (table.segments > 1).then(|| {
        let p = &table.phases[0];
        p.seg_len / p.taps.len().max(1)
    });
    groups(table)
        .into_iter()
        .map(|g| {
            let rows_per_thread = rows_per_thread(plan.config, &g, segments, limit)?;
            let sum = plan.sum(table);
            let (rows, cols) = (g.rows, g.cols);
            Some((g, GatherKernel { config: plan.config, sum, rows, cols, rows_per_thread }))
        })
        .collect()
}

/// The dispatches a plan records: the weights' layout, a GEMM per group, and (split) the pass
/// adding the segments' slabs.
pub(super) struct GatherDispatches {
    pub layout: DispatchShape,
    pub gemms: Vec<DispatchShape>,
    pub combine: Option<DispatchShape>,
}

impl GatherDispatches {
    pub fn all(&self) -> impl Iterator<Item = &DispatchShape> {
        std::iter::once(&self.layout).chain(&self.gemms).chain(&self.combine)
    }
}

/// The laid-out weights: every phase's k rows, then rows of +0 that the loads of the two slices
/// after the last may reach; vec4s of columns padded with +0 to whole tiles of `bn`.
fn layout(table: &Table, kernels: &[(Group, GatherKernel)]) -> (u64, u32) {
    let deepest = kernels.iter().map(|(_, k)| 2 * k.bk() + k.b_rows()).max().unwrap_or(0) as u64;
    let bn = kernels.first().map_or(4, |(_, k)| k.config.bn());
    (table.k_rows() + deepest, table.cols.div_ceil(bn) * bn / 4)
}

/// `table` with only `group`'s phases.
fn group_table(table: &Table, group: &Group) -> Table {
    let phases = &table.phases[group.phase0 as usize..(group.phase0 + group.phases) as usize];
    Table { phases: phases.to_vec(), ..table.clone() }
}

/// Workgroups along x·y per tile row of `group`'s dispatch: its largest phase's pixel tiles.
fn m_tiles(table: &Table, group: &Group, images: u32, config: TileConfig) -> u32 {
    group_table(table, group).most_pixels(images).div_ceil(config.bm() as u64) as u32
}

/// What the workgroups of `group`'s dispatch of `kernel` do over `images`: per phase, its
/// tiles' slices (per segment where the segments run along z) and the tiles past its pixels.
fn work(
    table: &Table,
    group: &Group,
    kernel: &GatherKernel,
    images: u32,
    split: bool,
) -> GatherWork {
    let c = kernel.config;
    let n_tiles = (table.cols as u64).div_ceil(c.bn() as u64);
    let m_tiles = m_tiles(table, group, images, c) as u64;
    let bk = kernel.bk() as u64;
    let mut work = GatherWork { busy: Vec::new(), idle: 0 };
    for p in &table.phases[group.phase0 as usize..(group.phase0 + group.phases) as usize] {
        let pixels = (p.grid_h * p.grid_w) as u64 * images as u64;
        let busy = pixels.div_ceil(c.bm() as u64);
        let (k, seg) = (p.entries.len() as u64, p.seg_len.max(1) as u64);
        let idle = if split { table.segments as u64 } else { 1 };
        work.idle += (m_tiles - busy) * n_tiles * idle;
        if split {
            for first in (0..table.segments as u64).map(|i| (i * seg).min(k)) {
                let slices = (k - first).min(seg).div_ceil(bk);
                work.busy.push((busy * n_tiles, slices, 0));
            }
        } else {
            let flushes = if kernel.sum == Sum::Segments { k.div_ceil(seg) } else { 0 };
            work.busy.push((busy * n_tiles, k.div_ceil(bk), flushes));
        }
    }
    work
}

/// The dispatches of `plan` for `op` at `s` (`table` its table; `kernels` as [`kernels`]).
pub(super) fn dispatches(
    op: Conv2dOp,
    s: &Conv2dShape,
    table: &Table,
    plan: GatherPlan,
    kernels: &[(Group, GatherKernel)],
) -> GatherDispatches {
    let out_len = table.out_len(s.n);
    let source_len = if op == Conv2dOp::Forward { s.x_len() } else { s.y_len() };
    let (rows, cols4) = layout(table, kernels);
    let (layout_len, words) = (rows * cols4 as u64 * 4, table.words_len());
    let slabs = if plan.split { table.segments as u64 * out_len } else { 0 };
    let z = if plan.split { table.segments as u64 } else { 1 };
    let layout = DispatchShape {
        workgroups: (layout_len / 4).div_ceil(64),
        invocations: 64,
        flops: 0.0,
        bytes: 4 * (s.w_len() + layout_len + 4 * words),
        construction: None,
        serial: None,
    };
    let gemms = kernels
        .iter()
        .map(|(g, k)| {
            let c = k.config;
            let tiles =
                m_tiles(table, g, s.n, c) as u64 * (table.cols as u64).div_ceil(c.bn() as u64);
            let written = if plan.split { slabs } else { out_len };
            let work = work(table, g, k, s.n, plan.split);
            DispatchShape {
                workgroups: tiles * z * g.phases as u64,
                invocations: c.threads(),
                flops: group_table(table, g).flops(s.n),
                bytes: 4 * (source_len + layout_len + 4 * words + written),
                construction: Some(construction::gemm(k, &work, 4 * slabs, 2 + plan.split as u32)),
                serial: None,
            }
        })
        .collect();
    let combine = plan.split.then(|| DispatchShape {
        workgroups: out_len.div_ceil(64),
        invocations: 64,
        flops: slabs as f64,
        bytes: 4 * (slabs + out_len),
        construction: None,
        serial: Some(Serial { loads: 1, barriers: 0, instructions: 4 + 3 * table.segments }),
    });
    GatherDispatches { layout, gemms, combine }
}

/// The plan for `op` at `s` on `gpu`: of every tile of the family whose kernels fit it, summing
/// whole or (where the shape has segments and their slabs fit a storage binding) by segments
/// along z, the one the GPU model gives the least time (`plan_cost`): thick tiles first, then
/// enough workgroups to fill the GPU, split only at the order's fixed points.
pub fn plan(gpu: &Gpu, op: Conv2dOp, s: &Conv2dShape, table: &Table) -> GatherPlan {
    let limit = shared_limit(gpu);
    let cap = SCRATCH_BYTES.min(gpu.limits.max_storage_buffer_binding_size);
    let splittable = table.segments > 1 && 4 * table.segments as u64 * table.out_len(s.n) <= cap;
    let cost = |p: &GatherPlan| {
        let kernels = kernels(*p, table, limit)?;
        Some(plan_cost(dispatches(op, s, table, *p, &kernels).all()))
    };
    FAMILY
        .iter()
        .filter(|&&c| gathers(c))
        .flat_map(|&config| [false, true].map(|split| GatherPlan { config, split }))
        .filter(|p| !p.split || splittable)
        .filter_map(|p| Some((p, cost(&p)?)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(p, _)| p)
        .expect("a tile staging one tap row a slice fits every device")
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
    phase0: u32,
    segments: u32,
    m_tiles: u32,
    out_len: u32,
}

fn params(op: Conv2dOp, s: &Conv2dShape, table: &Table, plan: GatherPlan, cols4: u32) -> Params {
    let (src, dst) = match op {
        Conv2dOp::Forward => ((s.c_in, s.h, s.w), (s.c_out, s.out_h(), s.out_w())),
        _ => ((s.c_out, s.out_h(), s.out_w()), (s.c_in, s.h, s.w)),
    };
    Params {
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
        phase0: 0,
        segments: if plan.split { table.segments } else { 1 },
        m_tiles: 0,
        out_len: table.out_len(s.n) as u32,
    }
}

/// The kernels a plan runs for a table (a group each, as [`kernels`]) and the weights' layout
/// they read.
pub struct GatherLayout {
    kernels: Vec<(Group, GatherKernel)>,
    rows: u64,
    cols4: u32,
}

impl GatherLayout {
    /// `plan`'s for `op`'s `table` on `gpu`; an error where a group has no kernel that fits.
    pub fn of(gpu: &Gpu, op: Conv2dOp, table: &Table, plan: GatherPlan) -> Result<GatherLayout> {
        let limit = shared_limit(gpu);
        let Some(kernels) = kernels(plan, table, limit) else {
            let problem = format!("has no slice of its taps that fits the device's workgroup memory ({limit} bytes) or its segments");
            return Err(KernelError::Arg { op: op.name(), arg: "plan", problem });
        };
        let (rows, cols4) = layout(table, &kernels);
        Ok(GatherLayout { kernels, rows, cols4 })
    }

    /// Floats of the laid-out weights.
    pub fn floats(&self) -> u64 {
        self.rows * self.cols4 as u64 * 4
    }

    /// Its two records in the layouts' dispatch (shaders/conv2d/implicit.wgsl): its rows from
    /// vec4 `rows_at`, its weights from float `w_at`, `table` (its op's) from vec4 `table_at`.
    pub fn record(&self, table: &Table, rows_at: u64, w_at: u64, table_at: u64) -> [u32; 8] {
        let entries = table_at + 3 * table.phases.len() as u64;
        let (cols, k_rows) = (table.cols, table.k_rows() as u32);
        [
            rows_at as u32,
            w_at as u32,
            entries as u32,
            0,
            cols,
            self.cols4,
            k_rows,
            table.w_col_stride,
        ]
    }
}

/// Vec4s of rows a workgroup of the layouts' dispatch writes: each layout starts at one's first.
pub const LAYOUT_WORKGROUP: u64 = 64;

/// The records of the layouts' dispatch (conv2d_implicit_weights): two per layout
/// ([`GatherLayout::record`]) and each workgroup's layout, the layouts' rows `vec4s` in all.
pub struct LayoutRecords<'a> {
    pub records: Slice<'a>,
    pub workgroups: Slice<'a>,
    pub vec4s: u64,
}

/// Records the dispatch laying out the layouts of `records` from weights `w` by the tables'
/// entries in `tables` into `rows`.
pub fn lay_out(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: &'static str,
    records: &LayoutRecords,
    (w, tables, rows): (Slice, Slice, Slice),
) -> Result<()> {
    // Each invocation reads its workgroup's layout, the layout's records, its k's entry, then
    // its weights.
    gpu.describe_serial_next(Serial { loads: 4, barriers: 0, instructions: 40 });
    let bindings = [
        ("w", w),
        ("table", tables),
        ("layouts", records.records),
        ("layouts of the workgroups", records.workgroups),
        ("weight rows", rows),
    ];
    let grid = grid_1d(records.vec4s.div_ceil(LAYOUT_WORKGROUP), 1);
    let params = [records.vec4s as u32];
    launch(gpu, enc, op, &super::FRAME, "conv2d_implicit_weights", &params, &bindings, grid)
}

/// The words of `op`'s `table` at `s` among `gpu`'s constants.
pub fn table_words(
    gpu: &Gpu,
    op: Conv2dOp,
    s: &Conv2dShape,
    table: &Table,
) -> Result<wgpu::Buffer> {
    let key = table_key(op, s);
    gpu.constants(bytemuck::bytes_of(&key), || bytemuck::cast_slice(&table.words()).to_vec())
        .map_err(|source| KernelError::Gpu { op: op.name(), source })
}

/// `op` at `s` (the forward: `a` = x, `out` = y; the input-VJP: `a` = dy, `out` = dx) against
/// `w` as `plan` runs it, `table` its table (`Table::of(op, s)`): its weights laid out by a
/// dispatch of their own, then [`gather_gemm_laid`].
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
    let layout = GatherLayout::of(gpu, op, table, plan)?;
    let words = table_words(gpu, op, s, table)?;
    let record = layout.record(table, 0, 0, 0);
    let key: Vec<u32> = [u32::MAX].into_iter().chain(record).collect();
    let records = gpu
        .constants(bytemuck::cast_slice(&key), || bytemuck::cast_slice(&record).to_vec())
        .map_err(gpu_err)?;
    let vec4s = layout.floats() / 4;
    let workgroups = vec4s.div_ceil(LAYOUT_WORKGROUP);
    // Every workgroup's layout is the first.
    let key = [u32::MAX - 1, workgroups as u32];
    let firsts = gpu
        .constants(bytemuck::cast_slice(&key), || vec![0; 4 * workgroups as usize])
        .map_err(gpu_err)?;
    let records =
        LayoutRecords { records: Slice::whole(&records), workgroups: Slice::whole(&firsts), vec4s };
    let rows = gpu.scratch(scratch::IMPLICIT_WEIGHT_ROWS, layout.floats()).map_err(gpu_err)?;
    let rows = Slice::new(&rows, 0, layout.floats());
    lay_out(gpu, enc, name, &records, (w, Slice::whole(&words), rows))?;
    gather_gemm_laid(gpu, enc, op, s, (table, plan, &layout), (a, rows, out))
}

/// `op` at `s` as `plan` runs it against weights laid out in `rows` as `layout` says (by
/// [`lay_out`], earlier in the encoder).
pub fn gather_gemm_laid(
    gpu: &Gpu,
    enc: &mut Encoder,
    op: Conv2dOp,
    s: &Conv2dShape,
    (table, plan, layout): (&Table, GatherPlan, &GatherLayout),
    (a, rows, out): (Slice, Slice, Slice),
) -> Result<()> {
    let name = op.name();
    let gpu_err = |source| KernelError::Gpu { op: name, source };
    if rows.len < layout.floats() {
        let problem =
            format!("holds {} floats where the layout takes {}", rows.len, layout.floats());
        return Err(KernelError::Arg { op: name, arg: "weight rows", problem });
    }
    let kernels = &layout.kernels;
    let params = params(op, s, table, plan, layout.cols4);
    let shapes = dispatches(op, s, table, plan, kernels);
    let words = table_words(gpu, op, s, table)?;
    let words = Slice::whole(&words);
    let slabs_len = params.segments as u64 * out.len;
    let target = match shapes.combine {
        Some(_) => {
            let slabs = gpu.scratch(scratch::IMPLICIT_SEGMENT_SUMS, slabs_len).map_err(gpu_err)?;
            Some(slabs)
        }
        None => None,
    };
    let written = target.as_ref().map_or(out, |slabs| Slice::new(slabs, 0, slabs_len));
    for ((group, kernel), gemm) in kernels.iter().zip(&shapes.gemms) {
        let z = group.phases * params.segments;
        let m_tiles = m_tiles(table, group, s.n, kernel.config);
        let group_params = Params { phase0: group.phase0, m_tiles, ..params };
        let [x, y, _] = grid_1d(gemm.workgroups / z as u64, 1);
        gpu.charge_flops(gemm.flops);
        gpu.describe_next(gemm.construction.expect("a GEMM's construction"));
        let bindings = [("source", a), ("weight rows", rows), ("table", words), ("out", written)];
        let shader = gather_shader(*kernel);
        launch(
            gpu,
            enc,
            name,
            &shader,
            "conv2d_implicit_gemm",
            &group_params,
            &bindings,
            [x, y, z],
        )?;
    }
    let Some(combine) = shapes.combine else { return Ok(()) };
    gpu.charge_flops(combine.flops);
    let bindings = [("segment sums", written), ("out", out)];
    let grid = grid_1d(out.len, 64);
    launch(gpu, enc, name, &super::FRAME, "conv2d_implicit_segments", &params, &bindings, grid)
}
