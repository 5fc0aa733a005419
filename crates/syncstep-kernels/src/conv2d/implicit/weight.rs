//! The weight gradient of the implicit-GEMM family: dw [c_out, (ci, ky, kx)] as a GEMM over the
//! batch's pixels, each workgroup one tile of outputs and one node of the canonical tree over
//! the examples, whose pairwise blocks it keeps in registers; the nodes' sums are then added as
//! the tree above them (shaders/conv2d/implicit.wgsl).

use super::super::scratch;
use super::weight_wgsl::{weight_shader, WeightKernel};
use super::{construction, plan_cost, shared_limit, table_key, Phase, Table, TileConfig, FAMILY};
use crate::conv2d::{Conv2dAlgo, Conv2dOp, Conv2dShape, SCRATCH_BYTES};
use crate::{expect_within_llvmpipe_loops, launch, pairwise_levels, KernelError, Result};
use syncstep_gpu::{grid_1d, DispatchShape, Encoder, Gpu, Serial, Slice};

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

/// Registers a weight-gradient pipeline may take: within 200 a compiler keeps every one's sums,
/// operands and staging without spilling, and an SM still holds two workgroups of 128.
const MOST_REGISTERS: u32 = 200;

/// The deepest node `config` holds in registers, at most one of the whole batch of `images`.
pub fn most_levels(config: TileConfig, images: u32) -> u32 {
    let by_batch = u32::BITS - (images.max(1) - 1).leading_zeros();
    let sums = |levels: u32| config.outputs() * (2 + levels) + config.tm + config.tn;
    let by_registers = (0..=by_batch).rev().find(|&l| sums(l) + 40 <= MOST_REGISTERS);
    by_registers.unwrap_or(0)
}

/// Whether `config` runs the weight gradient: each invocation stages one column (an output
/// channel, a k) of each operand.
pub fn runs(config: TileConfig) -> bool {
    config.threads() >= config.bm() && config.threads() >= config.bn()
}

/// The kernel of `plan` at `s` on a device of `limit` bytes of workgroup memory: slices of
/// about `plan.config.bk` pixels that follow the output map (whole rows of one example or whole
/// examples where rows are short, a part of a row where they are long); None where no slice of
/// the map fits.
pub fn kernel(plan: WeightPlan, s: &Conv2dShape, limit: u64) -> Option<WeightKernel> {
    let (oh, ow, target) = (s.out_h(), s.out_w(), plan.config.bk);
    let kernel = |rows, parts| WeightKernel {
        config: plan.config,
        out_h: oh,
        out_w: ow,
        rows,
        parts,
        levels: plan.levels,
    };
    let fits =
        |k: &WeightKernel| k.shared_bytes() <= limit && weight_registers(k) <= MOST_REGISTERS;
    let candidates: Vec<WeightKernel> = if ow >= target {
        // Parts of a row: the fewest of about `target` pixels, a divisor of the row where one is
        // near, then more (smaller) parts.
        let least = ow.div_ceil(target);
        let even = (least..=2 * least).find(|p| ow.is_multiple_of(*p)).unwrap_or(least);
        (even..=ow).map(|parts| kernel(1, parts)).collect()
    } else {
        // Whole rows: as many as make about `target` pixels, a divisor of the map's rows (one
        // example a slice) or a multiple of them (whole examples).
        let most = (target / ow).max(1);
        (1..=most)
            .rev()
            .filter(|r| oh.is_multiple_of(*r) || r.is_multiple_of(oh))
            .map(|rows| kernel(rows, 1))
            .collect()
    };
    candidates.into_iter().find(fits)
}

/// Registers an invocation of `kernel` holds, as a compiler allocates them: its row, example
/// and node sums, a pixel's operands, and per staged element of the next slice about five (its
/// value, its address and its pixel's row and column in the slice, its flag), seven where a
/// slice is part of a row (its column's tests move with the slice). Held to RADV/ACO's demand
/// (docs/performance.md).
pub fn weight_registers(kernel: &WeightKernel) -> u32 {
    let c = kernel.config;
    let staged = kernel.loads(c.bm()) + kernel.loads(c.bn());
    let per_staged = if kernel.parts > 1 { 7 } else { 5 };
    c.outputs() * (2 + kernel.levels) + c.tm + c.tn + per_staged * staged
}

/// The dispatches of `kernel` at `s` (`phase` the forward's table's): the GEMM, and (several
/// nodes, or taps left out) the pass adding the nodes into dw.
pub(super) fn dispatches(
    s: &Conv2dShape,
    phase: &Phase,
    kernel: &WeightKernel,
) -> (DispatchShape, Option<DispatchShape>) {
    let c = kernel.config;
    let plan = WeightPlan { config: c, levels: kernel.levels };
    let cols = phase.entries.len() as u64;
    let nodes = plan.nodes(s.n) as u64;
    let direct = nodes == 1 && cols == s.w_len() / s.c_out as u64;
    let sums = if direct { 0 } else { nodes * s.c_out as u64 * cols };
    let words = 3 + cols + 1 + (s.kh * s.kw) as u64;
    let tiles = (s.c_out as u64).div_ceil(c.bm() as u64) * cols.div_ceil(c.bn() as u64);
    let passes = 1 + !direct as u32;
    let examples =
        (0..nodes).map(|z| (s.n as u64 - z * plan.node() as u64).min(plan.node() as u64));
    let gemm = DispatchShape {
        workgroups: tiles * nodes,
        invocations: c.threads(),
        flops: 2.0
            * (s.n as u64 * s.out_h() as u64 * s.out_w() as u64 * s.c_out as u64 * cols) as f64,
        bytes: 4 * (s.y_len() + s.x_len() + 4 * words + if direct { s.w_len() } else { sums }),
        construction: Some(construction::weight(kernel, tiles, examples, 4 * sums, passes)),
        serial: None,
    };
    let combine = (!direct).then(|| DispatchShape {
        workgroups: s.w_len().div_ceil(64),
        invocations: 64,
        flops: (nodes * s.w_len()) as f64,
        bytes: 4 * (sums + 4 * words + s.w_len()),
        construction: None,
        // Each node's sum is pushed into the pairwise blocks before the next one is read.
        serial: Some(Serial {
            loads: nodes as u32 + 1,
            barriers: 0,
            instructions: 12 * nodes as u32,
        }),
    });
    (gemm, combine)
}

/// The plan for `s` (`table` the forward's): of every tile and node depth whose kernel fits
/// `gpu` (`fits`), the one the GPU model gives the least time (`plan_cost`).
pub fn weight_plan(gpu: &Gpu, s: &Conv2dShape, table: &Table) -> Result<WeightPlan> {
    let phase = &table.phases[0];
    let limit = shared_limit(gpu);
    let plans: Vec<WeightPlan> = FAMILY
        .iter()
        .flat_map(|&c| [c, TileConfig { bk: 8, ..c }])
        .filter(|&c| runs(c))
        .flat_map(|config| {
            (0..=most_levels(config, s.n)).map(move |levels| WeightPlan { config, levels })
        })
        .collect();
    let cost = |k: &WeightKernel| {
        let (gemm, combine) = dispatches(s, phase, k);
        plan_cost([&gemm].into_iter().chain(&combine))
    };
    let fitting = plans
        .iter()
        .filter_map(|&p| Some((p, kernel(p, s, limit)?)))
        .filter(|(_, k)| fits(gpu, s, phase, k).is_ok());
    match fitting.min_by(|a, b| cost(&a.1).total_cmp(&cost(&b.1))) {
        Some((plan, _)) => Ok(plan),
        // The shallowest nodes of the smallest tile fit least: say why that does not.
        None => {
            let last = WeightPlan { levels: 0, ..*plans.last().expect("the family has tiles") };
            let kernel = kernel(last, s, limit).ok_or_else(|| no_slice(s, limit))?;
            Err(fits(gpu, s, phase, &kernel).expect_err("no plan fits"))
        }
    }
}

/// The error of a shape whose output map no slice of the family cuts within `limit` bytes.
fn no_slice(s: &Conv2dShape, limit: u64) -> KernelError {
    let problem = format!(
        "has output rows of {} pixels, which no slice of the implicit-GEMM weight gradient cuts within the device's {limit} bytes of workgroup memory; use another variant",
        s.out_w()
    );
    KernelError::Arg { op: "conv2d_backward_weight", arg: "shape", problem }
}

/// Whether plan `p` of `s` fits `gpu`: its nodes' sums within a storage binding and the scratch
/// cap, and on llvmpipe its loops within the loop limiter's count (a node's pixels in one
/// invocation, and the nodes in the combine's).
fn fits(gpu: &Gpu, s: &Conv2dShape, phase: &Phase, k: &WeightKernel) -> Result<()> {
    const OP: &str = "conv2d_backward_weight";
    let p = WeightPlan { config: k.config, levels: k.levels };
    let nodes = p.nodes(s.n) as u64;
    let sums = nodes * s.c_out as u64 * phase.entries.len() as u64 * 4;
    let cap = SCRATCH_BYTES.min(gpu.limits.max_storage_buffer_binding_size);
    if nodes > 1 && sums > cap {
        let problem = format!("needs {sums} bytes of node sums, more than a storage binding here ({cap}); use a smaller batch");
        return Err(KernelError::Arg { op: OP, arg: "dy", problem });
    }
    let rows = p.node() as u64 * s.out_h() as u64;
    let node_loops = (rows * k.parts as u64).div_ceil(k.rows as u64) + 1;
    let combine_loops = nodes * (1 + pairwise_levels(nodes as u32) as u64);
    let advice = ": use a smaller image or batch, or another variant";
    let subject = || format!("is {}", Conv2dAlgo::Implicit);
    let adapter = &gpu.info.name;
    expect_within_llvmpipe_loops(adapter, OP, "algo", node_loops, subject, advice)?;
    expect_within_llvmpipe_loops(adapter, OP, "algo", combine_loops, subject, advice)
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
    zero: f32,
}

/// `dw` (overwritten) from `dy` and `x` at `s`, as `plan` runs it.
pub fn weight_gradient_with(
    gpu: &Gpu,
    enc: &mut Encoder,
    s: &Conv2dShape,
    plan: WeightPlan,
    (dy, x, dw): (Slice, Slice, Slice),
) -> Result<()> {
    const OP: &str = "conv2d_backward_weight";
    let gpu_err = |source| KernelError::Gpu { op: OP, source };
    let limit = shared_limit(gpu);
    let kernel = kernel(plan, s, limit).ok_or_else(|| no_slice(s, limit))?;
    let table = Table::of(Conv2dOp::Forward, s);
    let phase = &table.phases[0];
    let cols = phase.entries.len() as u32;
    let taps = s.kh * s.kw;
    let config = plan.config;
    let nodes = plan.nodes(s.n);
    let (gemm, combine) = dispatches(s, phase, &kernel);
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
        direct: combine.is_none() as u32,
        taps,
        kept: cols / s.c_in,
        zero: 0.0,
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
    let shader = weight_shader(kernel, nodes);
    let [gx, gy, _] = grid_1d(gemm.workgroups / nodes as u64, 1);
    gpu.charge_flops(gemm.flops);
    gpu.describe_next(gemm.construction.expect("a GEMM's construction"));
    let entry = "conv2d_implicit_weight";
    let Some(combine) = combine else {
        let bindings = [("dy", dy), ("x", x), ("table", words), ("dw", dw)];
        return launch(gpu, enc, OP, &shader, entry, &params, &bindings, [gx, gy, nodes]);
    };
    let sums_len = nodes as u64 * s.c_out as u64 * cols as u64;
    let sums = gpu.scratch(scratch::IMPLICIT_NODE_SUMS, sums_len).map_err(gpu_err)?;
    let sums = Slice::new(&sums, 0, sums_len);
    let bindings = [("dy", dy), ("x", x), ("table", words), ("node sums", sums)];
    launch(gpu, enc, OP, &shader, entry, &params, &bindings, [gx, gy, nodes])?;
    gpu.charge_flops(combine.flops);
    gpu.describe_serial_next(combine.serial.expect("the combine's chain"));
    let bindings = [("node sums", sums), ("table", words), ("dw", dw)];
    let grid = grid_1d(s.w_len(), 64);
    launch(gpu, enc, OP, &shader, "conv2d_implicit_weight_nodes", &params, &bindings, grid)
}

/// Per tap of the whole kernel (ky, kx), its rank among the kept taps of `phase` (the forward's
/// one), −1 where it was dropped: how the nodes' combine finds dw's columns.
fn tap_ranks(s: &Conv2dShape, phase: &Phase) -> Vec<[i32; 4]> {
    let kept: Vec<(i32, i32)> = phase.entries.iter().map(|e| (e[1], e[2])).collect();
    let kept = &kept[..kept.len() / s.c_in as usize];
    (0..s.kh as i32)
        .flat_map(|ky| (0..s.kw as i32).map(move |kx| (ky, kx)))
        .map(|tap| [kept.iter().position(|&k| k == tap).map_or(-1, |r| r as i32), 0, 0, 0])
        .collect()
}
