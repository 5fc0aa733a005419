// BatchNorm, training mode, over x as [n, c, hw] (NCHW). Per channel the positions are
// s = b·hw + j, b < n, j < hw; `count` is how many positions the statistics describe (n·hw on
// one device, the global count once replicas' rows were gathered), so the apply and backward
// kernels take it from Params rather than from the local shape.
//
// What is subtle:
// - Every reduction over the batch goes in two steps: first per example ("rows": one row of
//   [C | C] floats per example, bn_example_stats and bn_example_sums, one invocation or, on
//   GPUs, one workgroup per (example, channel)), then over the rows of the batch
//   (bn_merge_examples, bn_sum_examples, per channel). A row depends only on its example, and
//   the second step only on the rows in order. So R replicas that gather each other's rows (in
//   replica order) and run the second step get BITWISE what one device holding the whole batch
//   gets: this is what makes the data-parallel step equal the single-device one exactly, not
//   to f32 noise.
// - bn_sum_examples also runs over one replica's own rows, for its dβ, dγ, which the
//   gradient all-reduce then adds across replicas. It sums rows pairwise
//   (common/pairwise.wgsl, which this file is compiled after), as every reduction over the
//   batch in the step's backward does.
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
    // bn_merge_examples_running: the running statistics' momentum.
    momentum: f32,
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

@compute @workgroup_size(WG)
fn bn_example_stats(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i >= p.n * p.c) { return; }
    let b = i / p.c;
    let ch = i % p.c;
    let base = (b * p.c + ch) * p.hw;
    let x0 = example_x[base];
    let mean = x0 + plane_sum(base, x0, false) / f32(p.hw);
    example_rows[2u * p.c * b + ch] = mean;
    example_rows[2u * p.c * b + p.c + ch] = plane_sum(base, mean, true);
}

// The per-example kernels for GPUs, where one invocation per (b, ch) leaves most of the device
// idle: a workgroup per plane, whose invocations sum PLANE_WG blocks side by side and whose
// first adds the blocks' sums in order, as the loops above do. The same additions in the same
// order, so each variant gives the other's bits (the launcher picks one by the kernel policy).
const PLANE_WG: u32 = 64u;
var<workgroup> plane_blocks: array<vec2<f32>, PLANE_WG>;
var<workgroup> plane_shift: f32;

// `total` (invocation 0's) plus, in block order, the blocks' sums the invocations hold in
// `mine` for the round of PLANE_WG blocks starting at position `round`.
fn add_round(total: vec2<f32>, lane: u32, mine: vec2<f32>, round: u32) -> vec2<f32> {
    plane_blocks[lane] = mine;
    workgroupBarrier();
    var sum = total;
    if (lane == 0u) {
        let blocks = min(PLANE_WG, (p.hw - round + BLOCK - 1u) / BLOCK);
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
        total = add_round(total, lane, mine, round);
    }
    return total.x;
}

// The index of the workgroup's plane, (b, ch), in a grid of one workgroup per plane.
fn plane_index(wg: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wg.x + wg.y * nwg.x;
}

@compute @workgroup_size(PLANE_WG)
fn bn_example_stats_by_plane(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let i = plane_index(wg, nwg);
    if (i >= p.n * p.c) { return; }
    let b = i / p.c;
    let ch = i % p.c;
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

// bn_merge_examples: stats = [mean | M2] per channel over n rows of bn_example_stats (n·hw
// positions). One invocation per channel, the rows in order: no workgroup barriers, which CPU
// drivers run as coroutine switches (a tree over a workgroup cost more than the whole merge).
// bn_merge_examples_running also updates the running statistics in place from the same values,
// in the same launch: mean ← (1−m)·mean + m·μ; var ← (1−m)·var + m·M2/(count−1).
@group(0) @binding(1) var<storage, read> merge_rows: array<f32>;
@group(0) @binding(2) var<storage, read_write> merge_stats: array<f32>;
@group(0) @binding(3) var<storage, read_write> merge_running_mean: array<f32>;
@group(0) @binding(4) var<storage, read_write> merge_running_var: array<f32>;

// Σ_b over the rows, in blocks, of μ_b − shift, or (second pass) of M2_b + hw·(μ_b − shift)².
fn rows_sum(ch: u32, shift: f32, second: bool) -> f32 {
    var total = 0.0;
    for (var start = 0u; start < p.n; start = start + BLOCK) {
        let end = min(start + BLOCK, p.n);
        var block = 0.0;
        for (var b = start; b < end; b++) {
            let d = merge_rows[2u * p.c * b + ch] - shift;
            block = block + select(d, merge_rows[2u * p.c * b + p.c + ch] + f32(p.hw) * d * d, second);
        }
        total = total + block;
    }
    return total;
}

// Channel ch's merged [mean, M2], written to stats and returned.
fn merge_channel(ch: u32) -> vec2<f32> {
    let m0 = merge_rows[ch];
    let mean = m0 + rows_sum(ch, m0, false) / f32(p.n);
    let m2 = rows_sum(ch, mean, true);
    merge_stats[ch] = mean;
    merge_stats[p.c + ch] = m2;
    return vec2<f32>(mean, m2);
}

@compute @workgroup_size(WG)
fn bn_merge_examples(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let ch = gid.x + gid.y * nwg.x * WG;
    if (ch >= p.c) { return; }
    merge_channel(ch);
}

@compute @workgroup_size(WG)
fn bn_merge_examples_running(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let ch = gid.x + gid.y * nwg.x * WG;
    if (ch >= p.c) { return; }
    let stats = merge_channel(ch);
    let m = p.momentum;
    merge_running_mean[ch] = (1.0 - m) * merge_running_mean[ch] + m * stats.x;
    merge_running_var[ch] = (1.0 - m) * merge_running_var[ch] + m * stats.y / f32(p.count - 1u);
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

@compute @workgroup_size(WG)
fn bn_example_sums(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i >= p.n * p.c) { return; }
    let b = i / p.c;
    let ch = i % p.c;
    let base = (b * p.c + ch) * p.hw;
    var total = vec2<f32>(0.0);
    for (var start = 0u; start < p.hw; start = start + BLOCK) {
        total = total + sums_block(base, start, esums_stats[ch]);
    }
    write_sums(b, ch, total);
}

@compute @workgroup_size(PLANE_WG)
fn bn_example_sums_by_plane(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let i = plane_index(wg, nwg);
    if (i >= p.n * p.c) { return; }
    let b = i / p.c;
    let ch = i % p.c;
    let base = (b * p.c + ch) * p.hw;
    var total = vec2<f32>(0.0);
    for (var round = 0u; round < p.hw; round = round + BLOCK * PLANE_WG) {
        let start = round + lane * BLOCK;
        var mine = vec2<f32>(0.0);
        if (start < p.hw) {
            mine = sums_block(base, start, esums_stats[ch]);
        }
        total = add_round(total, lane, mine, round);
    }
    if (lane == 0u) {
        write_sums(b, ch, total);
    }
}

// bn_sum_examples: sums = [Σdy | Σdy·x̂] per channel over n rows of bn_example_sums, summed
// pairwise. One invocation per channel.
@group(0) @binding(1) var<storage, read> rsums_rows: array<f32>;
@group(0) @binding(2) var<storage, read_write> rsums_out: array<f32>;

@compute @workgroup_size(WG)
fn bn_sum_examples(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let ch = gid.x + gid.y * nwg.x * WG;
    if (ch >= p.c) { return; }
    var blocks: array<vec2<f32>, PAIRWISE_LEVELS>;
    let examples = pairwise_count(p.n, nwg);
    for (var b = 0u; b < examples; b++) {
        pairwise_push2(&blocks, b, vec2<f32>(rsums_rows[2u * p.c * b + ch], rsums_rows[2u * p.c * b + p.c + ch]));
    }
    let sums = pairwise_total2(&blocks, examples);
    rsums_out[ch] = sums.x;
    rsums_out[p.c + ch] = sums.y;
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
