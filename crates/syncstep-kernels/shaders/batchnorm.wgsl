// BatchNorm, training mode, over x as [n, c, hw] (NCHW). Per channel the positions are
// s = b·hw + j, b < n, j < hw; `count` is how many positions the statistics describe (n·hw on
// one device, the global count once replicas' rows were gathered), so the apply and backward
// kernels take it from Params rather than from the local shape.
//
// What is subtle:
// - Every reduction over the batch goes in two steps: first per example ("rows": one row of
//   [C | C] floats per example, bn_example_stats and bn_example_sums, one invocation or, on
//   GPUs, one workgroup per (example, channel)), then over the rows of the batch
//   (bn_stats, bn_sums, per channel). A row depends only on its example, and the second step
//   only on the rows in order. So R replicas that gather each other's rows (in replica order)
//   and run the second step get BITWISE what one device holding the whole batch gets: this is
//   what makes the data-parallel step equal the single-device one exactly, not to f32 noise.
//   One device, which gathers nothing, takes both steps in one launch of the second.
// - bn_sums also runs over one replica's own rows, for its dβ, dγ, which the gradient
//   all-reduce then adds across replicas. It sums rows pairwise (common/pairwise.wgsl, which
//   this file is compiled after), as every reduction over the batch in the step's backward
//   does.
// - Fixed orders throughout: serial sums in blocks of BLOCK terms whose totals are summed
//   again. Nothing depends on scheduling.
// - Statistics are (mean, M2 = Σ(x−mean)²), never E[x²]−μ². Rows merge by Chan's formula for
//   equal counts: μ = Σ μ_b / m, M2 = Σ M2_b + hw·Σ(μ_b − μ)². Mean passes sum x − x₀ (x₀ the
//   first value) to keep a large common offset out of the f32 sum.
// - Outputs are overwritten, never accumulated into; gathering rows is the caller's.
// - Fused with the ReLU that follows every BN site of the step (after the residual add, at a
//   block's end): bn_apply_relu computes relu(y [+ shortcut]) with exactly the operations, in
//   the order, of bn_forward_apply, add and relu_forward, so it gives their bits without
//   storing y or the sum; the backward kernels read dy through the ReLU's mask on the fly
//   (relu_backward's select), so the masked cotangent is never stored either.
// - Optional inputs (the shortcut; the ReLU gate) are switched on by flags in Params. A bind
//   group must fill every binding an entry point declares, so the launcher binds a stand-in
//   (another input of the same length) where one is off; the kernel ignores its values.

struct Params {
    n: u32,
    c: u32,
    hw: u32,
    count: u32,
    eps: f32,
    // bn_apply_relu: 1 when a shortcut is added before the ReLU.
    residual: u32,
    // bn_apply_relu: 1 when the ReLU's gate is the bound `gate`, not its own input; the
    // backward kernels: 1 when dy is masked by the bound `gate` (dy·[gate > 0]).
    gated: u32,
    // bn_stats_running(_by_channel): the running statistics' momentum.
    momentum: f32,
    // bn_stats_by_channel, bn_sums_by_channel: 1 when the rows are given (gathered from every
    // replica), 0 when the kernel takes them itself from this device's batch.
    rows_given: u32,
}

const WG: u32 = 256u;
const BLOCK: u32 = 32u;

@group(0) @binding(0) var<uniform> p: Params;

// 1/√(M2/count + eps) of a channel.
fn inv_std(m2: f32) -> f32 {
    return 1.0 / sqrt(m2 / f32(p.count) + p.eps);
}

// relu_backward's mask applied to dy when p.gated is 1.
fn masked(dy: f32, gate: f32) -> f32 {
    if (p.gated == 1u) {
        return select(0.0, dy, gate > 0.0);
    }
    return dy;
}

// bn_example_stats: rows[b] = [mean_b per channel | M2_b per channel] over example b's hw
// positions. One invocation per (b, ch); bn_example_stats_by_plane below gives the same bits.
@group(0) @binding(1) var<storage, read> example_x: array<f32>;
@group(0) @binding(2) var<storage, read_write> example_rows: array<f32>;

// Σ_j (x_j − shift) (or its square) over the block of BLOCK values (fewer at the plane's end)
// starting at `start` in the plane at `base`.
fn block_sum(base: u32, start: u32, shift: f32, square: bool) -> f32 {
    let end = min(start + BLOCK, p.hw);
    var block = 0.0;
    for (var j = start; j < end; j = j + 1u) {
        let d = example_x[base + j] - shift;
        block = block + select(d, d * d, square);
    }
    return block;
}

// The blocks' sums over the hw values of one plane, added in order.
fn plane_sum(base: u32, shift: f32, square: bool) -> f32 {
    var total = 0.0;
    for (var start = 0u; start < p.hw; start = start + BLOCK) {
        total = total + block_sum(base, start, shift, square);
    }
    return total;
}

// Example b's row of channel ch, [mean | M2] over its plane, by one invocation.
fn example_row(b: u32, ch: u32) {
    let base = (b * p.c + ch) * p.hw;
    let x0 = example_x[base];
    let mean = x0 + plane_sum(base, x0, false) / f32(p.hw);
    example_rows[2u * p.c * b + ch] = mean;
    example_rows[2u * p.c * b + p.c + ch] = plane_sum(base, mean, true);
}

@compute @workgroup_size(WG)
fn bn_example_stats(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i >= p.n * p.c) { return; }
    example_row(i / p.c, i % p.c);
}

// The per-example kernels for GPUs, where one invocation per (b, ch) leaves most of the device
// idle: a workgroup per plane, whose invocations sum PLANE_WG blocks side by side and whose
// first adds the blocks' sums in order, as the loops above do. The same additions in the same
// order, so each variant gives the other's bits (the launcher picks one by the kernel policy).
const PLANE_WG: u32 = 256u;
var<workgroup> plane_blocks: array<vec2<f32>, PLANE_WG>;
var<workgroup> plane_shift: f32;

// `total` (invocation 0's) plus, in block order, the blocks' sums the invocations hold in
// `mine` for the round of PLANE_WG blocks starting at position `round` of `len`.
fn add_round(total: vec2<f32>, lane: u32, mine: vec2<f32>, round: u32, len: u32) -> vec2<f32> {
    plane_blocks[lane] = mine;
    workgroupBarrier();
    var sum = total;
    if (lane == 0u) {
        let blocks = min(PLANE_WG, (len - round + BLOCK - 1u) / BLOCK);
        for (var k = 0u; k < blocks; k++) {
            sum = sum + plane_blocks[k];
        }
    }
    workgroupBarrier();
    return sum;
}

// plane_sum by a workgroup: the total in invocation 0.
fn plane_sum_by_plane(base: u32, shift: f32, square: bool, lane: u32) -> f32 {
    var total = vec2<f32>(0.0);
    for (var round = 0u; round < p.hw; round = round + BLOCK * PLANE_WG) {
        let start = round + lane * BLOCK;
        var mine = vec2<f32>(0.0);
        if (start < p.hw) {
            mine.x = block_sum(base, start, shift, square);
        }
        total = add_round(total, lane, mine, round, p.hw);
    }
    return total.x;
}

// The index of the workgroup's plane, (b, ch), in a grid of one workgroup per plane.
fn plane_index(wg: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wg.x + wg.y * nwg.x;
}

// Where a workgroup takes a channel's rows itself, it takes several examples side by side: an
// example's blocks go to `blocks_per_plane()` neighbouring invocations and the first of them
// adds their sums in order, as plane_sum does. A plane of more blocks than the workgroup has
// invocations takes the whole workgroup, an example at a time, by the `_by_plane` functions.
var<workgroup> example_shift: array<f32, PLANE_WG>;

fn blocks_per_plane() -> u32 {
    return (p.hw + BLOCK - 1u) / BLOCK;
}

// Invocation `lane`'s part in the round of examples side by side from `round`: its example b
// (the round's e-th) and the block of b's plane at `start`, if it holds one (not past the
// round's examples or the batch's), and whether it is the first of its example's.
struct SideBySide {
    b: u32,
    e: u32,
    start: u32,
    base: u32,
    holds: bool,
    first: bool,
}

fn side_by_side(round: u32, lane: u32, blocks: u32, ch: u32) -> SideBySide {
    let e = lane / blocks;
    let b = round + e;
    let start = (lane % blocks) * BLOCK;
    let holds = e < PLANE_WG / blocks && b < p.n;
    return SideBySide(b, e, start, (b * p.c + ch) * p.hw, holds, holds && start == 0u);
}

// An example's blocks' sums, added in order by its first invocation (the others get zero).
fn example_total(lane: u32, blocks: u32, first: bool, mine: vec2<f32>) -> vec2<f32> {
    plane_blocks[lane] = mine;
    workgroupBarrier();
    var sum = vec2<f32>(0.0);
    if (first) {
        for (var k = 0u; k < blocks; k++) {
            sum = sum + plane_blocks[lane + k];
        }
    }
    workgroupBarrier();
    return sum;
}

// Example b's row of channel ch by the workgroup (every invocation calls it alike).
fn example_row_by_plane(b: u32, ch: u32, lane: u32) {
    let base = (b * p.c + ch) * p.hw;
    let x0 = example_x[base];
    let mean_sum = plane_sum_by_plane(base, x0, false, lane);
    if (lane == 0u) {
        plane_shift = x0 + mean_sum / f32(p.hw);
    }
    let mean = workgroupUniformLoad(&plane_shift);
    let m2 = plane_sum_by_plane(base, mean, true, lane);
    if (lane == 0u) {
        example_rows[2u * p.c * b + ch] = mean;
        example_rows[2u * p.c * b + p.c + ch] = m2;
    }
}

// Every example's row of channel ch, [mean | M2], by the workgroup.
fn take_stats_rows(ch: u32, lane: u32) {
    let blocks = blocks_per_plane();
    if (blocks > PLANE_WG) {
        for (var b = 0u; b < p.n; b++) {
            example_row_by_plane(b, ch, lane);
        }
        return;
    }
    for (var round = 0u; round < p.n; round = round + PLANE_WG / blocks) {
        let s = side_by_side(round, lane, blocks, ch);
        var mine = vec2<f32>(0.0);
        if (s.holds) {
            let x0 = example_x[s.base];
            mine.x = block_sum(s.base, s.start, x0, false);
            mine.y = x0;
        }
        let mean_sum = example_total(lane, blocks, s.first, vec2<f32>(mine.x, 0.0));
        if (s.first) {
            example_shift[s.e] = mine.y + mean_sum.x / f32(p.hw);
        }
        workgroupBarrier();
        var m2 = vec2<f32>(0.0);
        if (s.holds) {
            m2.x = block_sum(s.base, s.start, example_shift[s.e], true);
        }
        let m2_sum = example_total(lane, blocks, s.first, m2);
        if (s.first) {
            example_rows[2u * p.c * s.b + ch] = example_shift[s.e];
            example_rows[2u * p.c * s.b + p.c + ch] = m2_sum.x;
        }
    }
}

@compute @workgroup_size(PLANE_WG)
fn bn_example_stats_by_plane(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let i = plane_index(wg, nwg);
    if (i >= p.n * p.c) { return; }
    example_row_by_plane(i / p.c, i % p.c, lane);
}

// bn_stats: stats = [mean | M2] per channel over the n rows (n·hw positions), merged by
// Chan's formula. One invocation per channel, the rows in order: no workgroup barriers, which
// CPU drivers run as coroutine switches. bn_stats_by_channel, for GPUs, gives the same bits
// with a workgroup per channel, and takes the rows first from this device's batch unless they
// are given (gathered from every replica): its invocations take the examples' rows side by side
// (or each example's blocks, on large planes), by the same per-example sums as
// bn_example_stats, then the rows' blocks of BLOCK side by side, and its first adds the blocks
// in order. (On CPU drivers the launcher takes the rows with bn_example_stats first: a loop of
// one invocation over every example's plane would pass llvmpipe's loop limit.)
// The _running entries also update the running statistics in place from the same values, in
// the same launch: mean ← (1−m)·mean + m·μ; var ← (1−m)·var + m·M2/(count−1).
@group(0) @binding(3) var<storage, read_write> merge_stats: array<f32>;
@group(0) @binding(4) var<storage, read_write> merge_running_mean: array<f32>;
@group(0) @binding(5) var<storage, read_write> merge_running_var: array<f32>;

// Row b of channel ch: [μ_b | M2_b].
fn stats_row(b: u32, ch: u32) -> vec2<f32> {
    return vec2<f32>(example_rows[2u * p.c * b + ch], example_rows[2u * p.c * b + p.c + ch]);
}

// A row's term of the merge: μ_b − shift, or (second pass) M2_b + hw·(μ_b − shift)².
fn row_term(row: vec2<f32>, shift: f32, second: bool) -> f32 {
    let d = row.x - shift;
    return select(d, row.y + f32(p.hw) * d * d, second);
}

// Σ over the rows start.. of one block of BLOCK, in order, of their terms.
fn rows_block(ch: u32, start: u32, shift: f32, second: bool) -> f32 {
    let end = min(start + BLOCK, p.n);
    var block = 0.0;
    for (var b = start; b < end; b++) {
        block = block + row_term(stats_row(b, ch), shift, second);
    }
    return block;
}

// The blocks' sums over every row, added in order.
fn rows_sum(ch: u32, shift: f32, second: bool) -> f32 {
    var total = 0.0;
    for (var start = 0u; start < p.n; start = start + BLOCK) {
        total = total + rows_block(ch, start, shift, second);
    }
    return total;
}

// The per-channel merges by a workgroup stage the rows in workgroup memory a round of PLANE_WG
// at a time, every invocation loading one, so that the serial sums over them wait on workgroup
// memory rather than on a load from memory per row: the round's blocks of BLOCK rows are summed
// side by side and added in order by the first invocation.
const STAGED_BLOCKS: u32 = PLANE_WG / BLOCK;
var<workgroup> staged_rows: array<vec2<f32>, PLANE_WG>;
var<workgroup> staged_blocks: array<vec2<f32>, STAGED_BLOCKS>;

// rows_sum by a workgroup: the total in invocation 0.
fn rows_sum_by_channel(ch: u32, shift: f32, second: bool, lane: u32) -> f32 {
    var total = 0.0;
    for (var round = 0u; round < p.n; round = round + PLANE_WG) {
        if (round + lane < p.n) {
            staged_rows[lane] = stats_row(round + lane, ch);
        }
        workgroupBarrier();
        let start = lane * BLOCK;
        if (lane < STAGED_BLOCKS && round + start < p.n) {
            let end = min(start + BLOCK, p.n - round);
            var block = 0.0;
            for (var i = start; i < end; i++) {
                block = block + row_term(staged_rows[i], shift, second);
            }
            staged_blocks[lane].x = block;
        }
        workgroupBarrier();
        if (lane == 0u) {
            let blocks = min(STAGED_BLOCKS, (p.n - round + BLOCK - 1u) / BLOCK);
            for (var k = 0u; k < blocks; k++) {
                total = total + staged_blocks[k].x;
            }
        }
    }
    return total;
}

// The running statistics of channel ch, from its merged [mean, M2].
fn update_running(ch: u32, stats: vec2<f32>) {
    let m = p.momentum;
    merge_running_mean[ch] = (1.0 - m) * merge_running_mean[ch] + m * stats.x;
    merge_running_var[ch] = (1.0 - m) * merge_running_var[ch] + m * stats.y / f32(p.count - 1u);
}

// Channel ch's merged [mean, M2], written to stats and returned.
fn stats_channel(ch: u32) -> vec2<f32> {
    let m0 = example_rows[ch];
    let mean = m0 + rows_sum(ch, m0, false) / f32(p.n);
    let m2 = rows_sum(ch, mean, true);
    merge_stats[ch] = mean;
    merge_stats[p.c + ch] = m2;
    return vec2<f32>(mean, m2);
}

// stats_channel by the workgroup, the rows taken first unless given: the statistics in
// invocation 0.
fn stats_by_channel(ch: u32, lane: u32) -> vec2<f32> {
    if (p.rows_given == 0u) {
        take_stats_rows(ch, lane);
    }
    storageBarrier();
    let m0 = example_rows[ch];
    let mean_sum = rows_sum_by_channel(ch, m0, false, lane);
    if (lane == 0u) {
        plane_shift = m0 + mean_sum / f32(p.n);
    }
    let mean = workgroupUniformLoad(&plane_shift);
    let m2 = rows_sum_by_channel(ch, mean, true, lane);
    if (lane == 0u) {
        merge_stats[ch] = mean;
        merge_stats[p.c + ch] = m2;
    }
    return vec2<f32>(mean, m2);
}

@compute @workgroup_size(WG)
fn bn_stats(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let ch = gid.x + gid.y * nwg.x * WG;
    if (ch >= p.c) { return; }
    stats_channel(ch);
}

@compute @workgroup_size(WG)
fn bn_stats_running(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let ch = gid.x + gid.y * nwg.x * WG;
    if (ch >= p.c) { return; }
    update_running(ch, stats_channel(ch));
}

@compute @workgroup_size(PLANE_WG)
fn bn_stats_by_channel(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let ch = plane_index(wg, nwg);
    if (ch >= p.c) { return; }
    stats_by_channel(ch, lane);
}

@compute @workgroup_size(PLANE_WG)
fn bn_stats_running_by_channel(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let ch = plane_index(wg, nwg);
    if (ch >= p.c) { return; }
    let stats = stats_by_channel(ch, lane);
    if (lane == 0u) {
        update_running(ch, stats);
    }
}

// bn_forward_apply: y = γ (x − μ)/√(M2/count + eps) + β, one invocation per element.
@group(0) @binding(1) var<storage, read> apply_x: array<f32>;
@group(0) @binding(2) var<storage, read> apply_stats: array<f32>;
@group(0) @binding(3) var<storage, read> apply_gamma: array<f32>;
@group(0) @binding(4) var<storage, read> apply_beta: array<f32>;
@group(0) @binding(5) var<storage, read_write> apply_y: array<f32>;

// Channel ch's affine map as (μ, 1/σ, γ, β).
fn affine_of(ch: u32) -> vec4<f32> {
    return vec4<f32>(apply_stats[ch], inv_std(apply_stats[p.c + ch]), apply_gamma[ch], apply_beta[ch]);
}

// y of one element x under the affine map k: one expression for every entry point, so the same
// bits.
fn applied(x: f32, k: vec4<f32>) -> f32 {
    let xhat = (x - k.x) * k.y;
    return k.z * xhat + k.w;
}

// The channel of element i: (i / hw) mod c.
fn channel_of(i: u32) -> u32 {
    return (i / p.hw) % p.c;
}

@compute @workgroup_size(WG)
fn bn_forward_apply(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i >= p.n * p.c * p.hw) { return; }
    apply_y[i] = applied(apply_x[i], affine_of(channel_of(i)));
}

// bn_apply_relu: out = gate > 0 ? v : 0 with v = y (+ shortcut when p.residual is 1), y as
// bn_forward_apply's, and gate = v itself or (p.gated is 1) the bound `gate`: bn_forward_apply,
// add(y, shortcut) and relu_forward in one pass, the same operations in the same order.
@group(0) @binding(5) var<storage, read> fused_shortcut: array<f32>;
@group(0) @binding(6) var<storage, read> fused_gate: array<f32>;
@group(0) @binding(7) var<storage, read_write> fused_out: array<f32>;

@compute @workgroup_size(WG)
fn bn_apply_relu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i >= p.n * p.c * p.hw) { return; }
    var v = applied(apply_x[i], affine_of(channel_of(i)));
    if (p.residual == 1u) {
        v = v + fused_shortcut[i];
    }
    var gate = v;
    if (p.gated == 1u) {
        gate = fused_gate[i];
    }
    fused_out[i] = select(0.0, v, gate > 0.0);
}

// bn_apply_relu4 and bn_backward_input4: the same four elements at a time, where hw is a
// multiple of 4 so that the four share a channel: one channel lookup, and vec4 loads and stores
// (CPU drivers pay per invocation and per load; lavapipe runs them ~2× as fast). Each element
// goes through the same expressions as in the one-element kernels: the same bits.
@group(0) @binding(1) var<storage, read> apply4_x: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> fused4_shortcut: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> fused4_gate: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> fused4_out: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn bn_apply_relu4(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = gid.x + gid.y * nwg.x * WG;
    if (t >= p.n * p.c * p.hw / 4u) { return; }
    let k = affine_of(channel_of(4u * t));
    let x = apply4_x[t];
    var v = vec4<f32>(applied(x.x, k), applied(x.y, k), applied(x.z, k), applied(x.w, k));
    if (p.residual == 1u) {
        v = v + fused4_shortcut[t];
    }
    var gate = v;
    if (p.gated == 1u) {
        gate = fused4_gate[t];
    }
    fused4_out[t] = select(vec4<f32>(0.0), v, gate > vec4<f32>(0.0));
}

// bn_example_sums: rows[b] = [Σdy | Σdy·x̂] per channel over example b's positions, x̂ from the
// given (global) stats: Σdy·(x − μ) scaled once by 1/σ at the end. dy is masked by `gate`
// when p.gated is 1. One invocation per (b, ch); bn_example_sums_by_plane gives the same bits.
@group(0) @binding(1) var<storage, read> esums_dy: array<f32>;
@group(0) @binding(2) var<storage, read> esums_gate: array<f32>;
@group(0) @binding(3) var<storage, read> esums_x: array<f32>;
@group(0) @binding(4) var<storage, read> esums_stats: array<f32>;
@group(0) @binding(5) var<storage, read_write> esums_rows: array<f32>;

// [Σdy | Σdy·(x − mean)] over the block of BLOCK positions starting at `start`.
fn sums_block(base: u32, start: u32, mean: f32) -> vec2<f32> {
    let end = min(start + BLOCK, p.hw);
    var block = vec2<f32>(0.0);
    for (var j = start; j < end; j = j + 1u) {
        let dy = masked(esums_dy[base + j], esums_gate[base + j]);
        block = block + dy * vec2<f32>(1.0, esums_x[base + j] - mean);
    }
    return block;
}

fn write_sums(b: u32, ch: u32, total: vec2<f32>) {
    esums_rows[2u * p.c * b + ch] = total.x;
    esums_rows[2u * p.c * b + p.c + ch] = total.y * inv_std(esums_stats[p.c + ch]);
}

// Example b's row of channel ch, [Σdy | Σdy·x̂] over its plane, by one invocation.
fn example_sums_row(b: u32, ch: u32) {
    let base = (b * p.c + ch) * p.hw;
    var total = vec2<f32>(0.0);
    for (var start = 0u; start < p.hw; start = start + BLOCK) {
        total = total + sums_block(base, start, esums_stats[ch]);
    }
    write_sums(b, ch, total);
}

// Example b's row of channel ch by the workgroup (every invocation calls it alike).
fn example_sums_row_by_plane(b: u32, ch: u32, lane: u32) {
    let base = (b * p.c + ch) * p.hw;
    var total = vec2<f32>(0.0);
    for (var round = 0u; round < p.hw; round = round + BLOCK * PLANE_WG) {
        let start = round + lane * BLOCK;
        var mine = vec2<f32>(0.0);
        if (start < p.hw) {
            mine = sums_block(base, start, esums_stats[ch]);
        }
        total = add_round(total, lane, mine, round, p.hw);
    }
    if (lane == 0u) {
        write_sums(b, ch, total);
    }
}

// Every example's row of channel ch, [Σdy | Σdy·x̂], by the workgroup.
fn take_sums_rows(ch: u32, lane: u32) {
    let blocks = blocks_per_plane();
    if (blocks > PLANE_WG) {
        for (var b = 0u; b < p.n; b++) {
            example_sums_row_by_plane(b, ch, lane);
        }
        return;
    }
    for (var round = 0u; round < p.n; round = round + PLANE_WG / blocks) {
        let s = side_by_side(round, lane, blocks, ch);
        var mine = vec2<f32>(0.0);
        if (s.holds) {
            mine = sums_block(s.base, s.start, esums_stats[ch]);
        }
        let total = example_total(lane, blocks, s.first, mine);
        if (s.first) {
            write_sums(s.b, ch, total);
        }
    }
}

@compute @workgroup_size(WG)
fn bn_example_sums(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i >= p.n * p.c) { return; }
    example_sums_row(i / p.c, i % p.c);
}

@compute @workgroup_size(PLANE_WG)
fn bn_example_sums_by_plane(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let i = plane_index(wg, nwg);
    if (i >= p.n * p.c) { return; }
    example_sums_row_by_plane(i / p.c, i % p.c, lane);
}

// bn_sums: sums = [Σdy | Σdy·x̂] per channel over the n rows (gathered from every replica, or
// a piece's own), summed pairwise. One invocation per channel. bn_sums_by_channel, for GPUs,
// gives the same bits with a workgroup per channel, and takes the rows first from this
// device's batch unless they are given: its invocations take the examples' rows side by side
// (or each example's blocks, on large planes), by the same per-example sums as
// bn_example_sums; then, the rows staged as the merge of statistics stages them, the pairwise
// sums of aligned chunks of 32 rows side by side (nodes of the batch's tree, the last one its
// tail), which its first adds as the tree above them.
@group(0) @binding(6) var<storage, read_write> esums_out: array<f32>;

fn sums_row(b: u32, ch: u32) -> vec2<f32> {
    return vec2<f32>(esums_rows[2u * p.c * b + ch], esums_rows[2u * p.c * b + p.c + ch]);
}

// The pairwise sum of rows start.. of `len`, as pairwise_push2 and pairwise_total2 take it.
fn rows_pairwise(ch: u32, start: u32, len: u32) -> vec2<f32> {
    var blocks: array<vec2<f32>, PAIRWISE_LEVELS>;
    for (var i = 0u; i < len; i++) {
        pairwise_push2(&blocks, i, sums_row(start + i, ch));
    }
    return pairwise_total2(&blocks, len);
}

// rows_pairwise over staged rows start.. of `len`.
fn staged_pairwise(start: u32, len: u32) -> vec2<f32> {
    var blocks: array<vec2<f32>, PAIRWISE_LEVELS>;
    for (var i = 0u; i < len; i++) {
        pairwise_push2(&blocks, i, staged_rows[start + i]);
    }
    return pairwise_total2(&blocks, len);
}

fn write_channel_sums(ch: u32, sums: vec2<f32>) {
    esums_out[ch] = sums.x;
    esums_out[p.c + ch] = sums.y;
}

@compute @workgroup_size(WG)
fn bn_sums(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let ch = gid.x + gid.y * nwg.x * WG;
    if (ch >= p.c) { return; }
    write_channel_sums(ch, rows_pairwise(ch, 0u, pairwise_count(p.n, nwg)));
}

// Rows in a chunk: each chunk is a node of the canonical tree over the examples (a block of
// staged rows).
const CHUNK: u32 = BLOCK;

@compute @workgroup_size(PLANE_WG)
fn bn_sums_by_channel(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let ch = plane_index(wg, nwg);
    if (ch >= p.c) { return; }
    if (p.rows_given == 0u) {
        take_sums_rows(ch, lane);
    }
    storageBarrier();
    let n = pairwise_count(p.n, nwg);
    let whole = n / CHUNK;
    // Invocation 0's stack over the whole chunks, and the tail's sum.
    var blocks: array<vec2<f32>, PAIRWISE_LEVELS>;
    var tail = vec2<f32>(0.0);
    for (var round = 0u; round < n; round = round + PLANE_WG) {
        if (round + lane < n) {
            staged_rows[lane] = sums_row(round + lane, ch);
        }
        workgroupBarrier();
        let start = lane * CHUNK;
        if (lane < STAGED_BLOCKS && round + start < n) {
            staged_blocks[lane] = staged_pairwise(start, min(CHUNK, n - round - start));
        }
        workgroupBarrier();
        if (lane == 0u) {
            let chunks = min(STAGED_BLOCKS, (n - round + CHUNK - 1u) / CHUNK);
            for (var k = 0u; k < chunks; k++) {
                let t = round / CHUNK + k;
                if (t < whole) {
                    pairwise_push2(&blocks, t, staged_blocks[k]);
                } else {
                    tail = staged_blocks[k];
                }
            }
        }
    }
    if (lane == 0u) {
        // The open blocks from the smallest up: the tail's (its own tree's total), then the
        // whole chunks' set bits.
        var sum = tail;
        var first = n % CHUNK == 0u;
        for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
            if (((whole >> l) & 1u) == 1u) {
                if (first) { sum = blocks[l]; } else { sum = blocks[l] + sum; }
                first = false;
            }
        }
        write_channel_sums(ch, sum);
    }
}

// bn_backward_input: dx = γ/√(σ²+eps) · (dy − Σdy/count − x̂·Σdy·x̂/count), with sums over all
// `count` positions (over every replica's rows); dy masked by `gate` when p.gated is 1.
@group(0) @binding(1) var<storage, read> input_dy: array<f32>;
@group(0) @binding(2) var<storage, read> input_gate: array<f32>;
@group(0) @binding(3) var<storage, read> input_x: array<f32>;
@group(0) @binding(4) var<storage, read> input_stats: array<f32>;
@group(0) @binding(5) var<storage, read> input_gamma: array<f32>;
@group(0) @binding(6) var<storage, read> input_sums: array<f32>;
@group(0) @binding(7) var<storage, read_write> input_dx: array<f32>;

// Channel ch's factors of the input gradient: (μ, 1/σ, γ, Σdy/count) and Σdy·x̂.
struct InputFactors {
    k: vec4<f32>,
    sum_dy_xhat: f32,
}

fn input_factors(ch: u32) -> InputFactors {
    let k = vec4<f32>(input_stats[ch], inv_std(input_stats[p.c + ch]), input_gamma[ch], input_sums[ch] / f32(p.count));
    return InputFactors(k, input_sums[p.c + ch]);
}

// dx of one element: one expression for both entry points, so the same bits.
fn input_grad(dy: f32, gate: f32, x: f32, f: InputFactors) -> f32 {
    let xhat = (x - f.k.x) * f.k.y;
    return f.k.z * f.k.y * (masked(dy, gate) - f.k.w - xhat * f.sum_dy_xhat / f32(p.count));
}

// Element i's dx from its dy.
fn input_grad_at(i: u32, dy: f32) -> f32 {
    return input_grad(dy, input_gate[i], input_x[i], input_factors(channel_of(i)));
}

@compute @workgroup_size(WG)
fn bn_backward_input(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i >= p.n * p.c * p.hw) { return; }
    input_dx[i] = input_grad_at(i, input_dy[i]);
}

@group(0) @binding(1) var<storage, read> input4_dy: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> input4_gate: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> input4_x: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> input4_dx: array<vec4<f32>>;

// Elements 4t..4t+3's dx from their dy.
fn input4_grad_at(t: u32, dy: vec4<f32>) -> vec4<f32> {
    let f = input_factors(channel_of(4u * t));
    let gate = input4_gate[t];
    let x = input4_x[t];
    return vec4<f32>(input_grad(dy.x, gate.x, x.x, f), input_grad(dy.y, gate.y, x.y, f), input_grad(dy.z, gate.z, x.z, f), input_grad(dy.w, gate.w, x.w, f));
}

@compute @workgroup_size(WG)
fn bn_backward_input4(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = gid.x + gid.y * nwg.x * WG;
    if (t >= p.n * p.c * p.hw / 4u) { return; }
    input4_dx[t] = input4_grad_at(t, input4_dy[t]);
}

// bn_backward_input and bn_backward_input4 with dx written over dy, which each invocation reads
// before it writes the same elements.
@group(0) @binding(1) var<storage, read_write> over_dy: array<f32>;
@group(0) @binding(1) var<storage, read_write> over4_dy: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn bn_backward_input_over_dy(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i >= p.n * p.c * p.hw) { return; }
    over_dy[i] = input_grad_at(i, over_dy[i]);
}

@compute @workgroup_size(WG)
fn bn_backward_input4_over_dy(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = gid.x + gid.y * nwg.x * WG;
    if (t >= p.n * p.c * p.hw / 4u) { return; }
    over4_dy[t] = input4_grad_at(t, over4_dy[t]);
}
