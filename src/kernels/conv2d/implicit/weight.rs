//! The weight gradient of the implicit-GEMM family: dw [c_out, (ci, ky, kx)] as a GEMM over the
//! batch's pixels, each workgroup one tile of outputs and one node of the canonical tree over
//! the examples, whose pairwise blocks it keeps in registers; the nodes' sums are then added as
//! the tree above them (shaders/conv2d/implicit.wgsl).

use super::wgsl::{weight_shader, weight_shared_bytes};
use super::{table_key, Table, TileConfig, FAMILY, FILL};
use crate::gpu::{grid_1d, Encoder, Gpu, Slice};
use crate::kernels::conv2d::{Conv2dOp, Conv2dShape};
use crate::kernels::{launch, KernelError, Result};

/// How the weight gradient runs: its tile, and how deep a node's pairwise blocks go (a node is
/// 2^levels examples, the batch's last one its tail).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightPlan {
    pub config: TileConfig,
    pub levels: u32,
}

impl WeightPlan {
    /// Examples per node.
    pub fn node(&self) -> u32 {
        1 << self.levels
    }
    /// Nodes of a batch of `images`.
    pub fn nodes(&self, images: u32) -> u32 {
        images.div_ceil(self.node())
    }
}

/// Registers a weight-gradient invocation may give its sums: a row's, an example's and the
/// pairwise blocks', one each per output.
const SUM_REGISTERS: u32 = 192;

/// The deepest node `config` holds in registers, at most one of the whole batch of `images`.
pub fn most_levels(config: TileConfig, images: u32) -> u32 {
    let by_registers = (SUM_REGISTERS / config.outputs()).saturating_sub(2);
    let by_batch = u32::BITS - (images.max(1) - 1).leading_zeros();
    by_registers.min(by_batch)
}

/// Whether `config` runs the weight gradient on `gpu`: each invocation stages one pixel of a
/// slice (the slice's 8-pixel blocks fit across the warps), within the workgroup memory.
pub fn runs(gpu: &Gpu, config: TileConfig) -> bool {
    let warps = config.threads() / 32;
    let blocks = config.bk / 8;
    let limit = gpu.limits.max_compute_workgroup_storage_size as u64;
    config.bk.is_multiple_of(8)
        && warps.is_multiple_of(blocks)
        && weight_shared_bytes(config) <= limit
}

/// The plan for `s`: the largest tile whose dispatch has [`FILL`] workgroups with nodes as deep
/// as its registers hold (thicken first), else shallower nodes (more of them, fill at the
/// tree's fixed points), else the most workgroups.
pub fn weight_plan(gpu: &Gpu, s: &Conv2dShape, table: &Table) -> WeightPlan {
    let cols = table.phases[0].entries.len() as u64;
    let configs: Vec<TileConfig> = FAMILY
        .iter()
        .flat_map(|&c| [c, TileConfig { bk: 8, ..c }])
        .filter(|&c| runs(gpu, c))
        .collect();
    let groups = |p: &WeightPlan| {
        (s.c_out as u64).div_ceil(p.config.bm() as u64)
            * cols.div_ceil(p.config.bn() as u64)
            * p.nodes(s.n) as u64
    };
    for &config in &configs {
        for levels in (0..=most_levels(config, s.n)).rev() {
            let plan = WeightPlan { config, levels };
            if groups(&plan) >= FILL {
                return plan;
            }
        }
    }
    let fewest = |&config| WeightPlan { config, levels: 0 };
    configs.iter().map(fewest).max_by_key(groups).expect("64-invocation tiles fit every device")
}

/// The uniform of the weight-gradient kernels, mirrored by `struct ImplicitWeight`.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    c_out: u32,
    c_in: u32,
    h: u32,
    w: u32,
    out_h: u32,
    out_w: u32,
    stride: u32,
    pad: u32,
    images: u32,
    node: u32,
    nodes: u32,
    cols: u32,
    w_len: u32,
    m_tiles: u32,
    direct: u32,
    taps: u32,
    kept: u32,
}

/// `dw` (overwritten) from `dy` and `x` at `s`, as [`weight_plan`] runs it.
pub fn weight_gradient(
    gpu: &Gpu,
    enc: &mut Encoder,
    s: &Conv2dShape,
    (dy, x, dw): (Slice, Slice, Slice),
) -> Result<()> {
    let table = Table::of(Conv2dOp::Forward, s);
    let plan = weight_plan(gpu, s, &table);
    weight_gradient_with(gpu, enc, s, plan, (dy, x, dw))
}

/// [`weight_gradient`] with the plan given.
pub fn weight_gradient_with(
    gpu: &Gpu,
    enc: &mut Encoder,
    s: &Conv2dShape,
    plan: WeightPlan,
    (dy, x, dw): (Slice, Slice, Slice),
) -> Result<()> {
    const OP: &str = "conv2d_backward_weight";
    let gpu_err = |source| KernelError::Gpu { op: OP, source };
    let table = Table::of(Conv2dOp::Forward, s);
    let phase = &table.phases[0];
    let cols = phase.entries.len() as u32;
    let taps = s.kh * s.kw;
    let kept = cols / s.c_in;
    let config = plan.config;
    let nodes = plan.nodes(s.n);
    let direct = nodes == 1 && kept == taps;
    let m_tiles = (s.c_out as u64).div_ceil(config.bm() as u64);
    let params = Params {
        c_out: s.c_out,
        c_in: s.c_in,
        h: s.h,
        w: s.w,
        out_h: s.out_h(),
        out_w: s.out_w(),
        stride: s.stride,
        pad: s.pad,
        images: s.n,
        node: plan.node(),
        nodes,
        cols,
        w_len: s.c_in * taps,
        m_tiles: m_tiles as u32,
        direct: direct as u32,
        taps,
        kept,
    };
    let key = table_key(Conv2dOp::BackwardWeight, s);
    let words = gpu
        .constants(bytemuck::bytes_of(&key), || {
            let mut words = table.words();
            words.extend(tap_ranks(s, phase));
            bytemuck::cast_slice(&words).to_vec()
        })
        .map_err(gpu_err)?;
    let words = Slice::whole(&words);
    let shader = weight_shader(config, plan.levels, nodes);
    let n_tiles = (cols as u64).div_ceil(config.bn() as u64);
    let [gx, gy, _] = grid_1d(m_tiles * n_tiles, 1);
    gpu.charge_flops(s.flops() as f64);
    let entry = "conv2d_implicit_weight";
    if direct {
        let bindings = [("dy", dy), ("x", x), ("table", words), ("dw", dw)];
        return launch(gpu, enc, OP, &shader, entry, &params, &bindings, [gx, gy, nodes]);
    }
    let sums_len = nodes as u64 * s.c_out as u64 * cols as u64;
    let sums = gpu.scratch("conv2d implicit node sums", sums_len).map_err(gpu_err)?;
    let sums = Slice::new(&sums, 0, sums_len);
    let bindings = [("dy", dy), ("x", x), ("table", words), ("node sums", sums)];
    launch(gpu, enc, OP, &shader, entry, &params, &bindings, [gx, gy, nodes])?;
    gpu.charge_flops((nodes as u64 * s.w_len()) as f64);
    let bindings = [("node sums", sums), ("table", words), ("dw", dw)];
    let grid = grid_1d(s.w_len(), 64);
    launch(gpu, enc, OP, &shader, "conv2d_implicit_weight_nodes", &params, &bindings, grid)
}

/// Per tap of the whole kernel (ky, kx), its rank among the kept taps of `phase` (the forward's
/// one), −1 where it was dropped: how the nodes' combine finds dw's columns.
fn tap_ranks(s: &Conv2dShape, phase: &super::Phase) -> Vec<[i32; 4]> {
    let kept: Vec<(i32, i32)> = phase.entries.iter().map(|e| (e[1], e[2])).collect();
    let kept = &kept[..kept.len() / s.c_in as usize];
    (0..s.kh as i32)
        .flat_map(|ky| (0..s.kw as i32).map(move |kx| (ky, kx)))
        .map(|tap| [kept.iter().position(|&k| k == tap).map_or(-1, |r| r as i32), 0, 0, 0])
        .collect()
}
