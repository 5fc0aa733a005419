// BatchNorm, training mode, over x as [n, c, hw] (NCHW). Per channel the positions are
// s = b·hw + j, b < n, j < hw; `count` is how many positions the statistics describe (n·hw on
// one device, the global count after stats were merged across replicas), so the apply and
// backward kernels take it from Params rather than from the local shape.
//
// What is subtle:
// - Reductions (bn_forward_stats, bn_backward_sums) run one workgroup per channel. Each
//   invocation sums a strided subset in blocks of BLOCK terms, the block sums go into its total,
//   and the WG totals meet in a fixed tree: the order never depends on scheduling (bitwise
//   deterministic), and no serial sum is longer than max(BLOCK, count / (WG·BLOCK)).
// - stats hold (mean, M2 = Σ(x−mean)²), never E[x²]−μ², so replicas can merge them by Chan's
//   formula without cancellation. The mean pass sums x − x₀ (x₀ the channel's first element),
//   which keeps a large common offset out of the f32 sum; the M2 pass then sums (x − mean)².
// - Outputs are overwritten, never accumulated into; the all-reduce of sums is the caller's.

struct Params {
    n: u32,
    c: u32,
    hw: u32,
    count: u32,
    eps: f32,
}

// bn_update_running's own uniform, at the same binding 0.
struct RunningParams {
    c: u32,
    count: u32,
    momentum: f32,
}

const WG: u32 = 256u;
const BLOCK: u32 = 32u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(0) var<uniform> rp: RunningParams;

var<workgroup> partial: array<vec2<f32>, WG>;

// Index of position s of channel ch in x.
fn position(ch: u32, s: u32) -> u32 {
    return ((s / p.hw) * p.c + ch) * p.hw + s % p.hw;
}

// 1/√(M2/count + eps) of a channel.
fn inv_std(m2: f32) -> f32 {
    return 1.0 / sqrt(m2 / f32(p.count) + p.eps);
}

// The sum over the workgroup of every invocation's `v`, in a fixed tree order; every
// invocation gets the result. Call from uniform control flow.
fn tree_sum(tid: u32, v: vec2<f32>) -> vec2<f32> {
    partial[tid] = v;
    workgroupBarrier();
    for (var half = WG / 2u; half > 0u; half = half / 2u) {
        if (tid < half) {
            partial[tid] = partial[tid] + partial[tid + half];
        }
        workgroupBarrier();
    }
    let total = partial[0];
    // partial is reused by the next call.
    workgroupBarrier();
    return total;
}

fn channel_of(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}

// bn_forward_stats: stats = [mean per channel | M2 per channel] over the local n·hw positions.
@group(0) @binding(1) var<storage, read> stats_x: array<f32>;
@group(0) @binding(2) var<storage, read_write> stats_out: array<f32>;

// This invocation's share of Σ_s (x_s − shift) (or of its square), summed in blocks.
fn stats_partial(ch: u32, tid: u32, shift: f32, square: bool) -> f32 {
    let positions = p.n * p.hw;
    var total = 0.0;
    for (var start = tid; start < positions; start = start + WG * BLOCK) {
        let end = min(start + WG * BLOCK, positions);
        var block = 0.0;
        for (var s = start; s < end; s = s + WG) {
            let d = stats_x[position(ch, s)] - shift;
            block = block + select(d, d * d, square);
        }
        total = total + block;
    }
    return total;
}

@compute @workgroup_size(WG)
fn bn_forward_stats(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let ch = channel_of(wid, nwg);
    if (ch >= p.c) { return; }
    let positions = f32(p.n * p.hw);
    let x0 = stats_x[position(ch, 0u)];
    let mean = x0 + tree_sum(tid, vec2<f32>(stats_partial(ch, tid, x0, false), 0.0)).x / positions;
    let m2 = tree_sum(tid, vec2<f32>(stats_partial(ch, tid, mean, true), 0.0)).x;
    if (tid == 0u) {
        stats_out[ch] = mean;
        stats_out[p.c + ch] = m2;
    }
}

// bn_forward_apply: y = γ (x − μ)/√(M2/count + eps) + β, one invocation per element.
@group(0) @binding(1) var<storage, read> apply_x: array<f32>;
@group(0) @binding(2) var<storage, read> apply_stats: array<f32>;
@group(0) @binding(3) var<storage, read> apply_gamma: array<f32>;
@group(0) @binding(4) var<storage, read> apply_beta: array<f32>;
@group(0) @binding(5) var<storage, read_write> apply_y: array<f32>;

@compute @workgroup_size(WG)
fn bn_forward_apply(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i >= p.n * p.c * p.hw) { return; }
    let ch = (i / p.hw) % p.c;
    let xhat = (apply_x[i] - apply_stats[ch]) * inv_std(apply_stats[p.c + ch]);
    apply_y[i] = apply_gamma[ch] * xhat + apply_beta[ch];
}

// bn_backward_sums: sums = [Σdy per channel | Σdy·x̂ per channel] over the local positions, x̂
// from the given (possibly global) stats. Σdy·x̂ is summed as Σdy·(x − μ), scaled once at the end.
@group(0) @binding(1) var<storage, read> sums_dy: array<f32>;
@group(0) @binding(2) var<storage, read> sums_x: array<f32>;
@group(0) @binding(3) var<storage, read> sums_stats: array<f32>;
@group(0) @binding(4) var<storage, read_write> sums_out: array<f32>;

@compute @workgroup_size(WG)
fn bn_backward_sums(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let ch = channel_of(wid, nwg);
    if (ch >= p.c) { return; }
    let positions = p.n * p.hw;
    let mean = sums_stats[ch];
    var total = vec2<f32>(0.0);
    for (var start = tid; start < positions; start = start + WG * BLOCK) {
        let end = min(start + WG * BLOCK, positions);
        var block = vec2<f32>(0.0);
        for (var s = start; s < end; s = s + WG) {
            let i = position(ch, s);
            block = block + sums_dy[i] * vec2<f32>(1.0, sums_x[i] - mean);
        }
        total = total + block;
    }
    let sums = tree_sum(tid, total);
    if (tid == 0u) {
        sums_out[ch] = sums.x;
        sums_out[p.c + ch] = sums.y * inv_std(sums_stats[p.c + ch]);
    }
}

// bn_backward_input: dx = γ/√(σ²+eps) · (dy − Σdy/count − x̂·Σdy·x̂/count), with sums over all
// `count` positions (summed across replicas by the caller).
@group(0) @binding(1) var<storage, read> input_dy: array<f32>;
@group(0) @binding(2) var<storage, read> input_x: array<f32>;
@group(0) @binding(3) var<storage, read> input_stats: array<f32>;
@group(0) @binding(4) var<storage, read> input_gamma: array<f32>;
@group(0) @binding(5) var<storage, read> input_sums: array<f32>;
@group(0) @binding(6) var<storage, read_write> input_dx: array<f32>;

@compute @workgroup_size(WG)
fn bn_backward_input(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i >= p.n * p.c * p.hw) { return; }
    let ch = (i / p.hw) % p.c;
    let r = inv_std(input_stats[p.c + ch]);
    let xhat = (input_x[i] - input_stats[ch]) * r;
    let count = f32(p.count);
    input_dx[i] = input_gamma[ch] * r * (input_dy[i] - input_sums[ch] / count - xhat * input_sums[p.c + ch] / count);
}

// bn_update_running, in place: mean ← (1−m)·mean + m·μ; var ← (1−m)·var + m·M2/(count−1).
@group(0) @binding(1) var<storage, read> running_stats: array<f32>;
@group(0) @binding(2) var<storage, read_write> running_mean: array<f32>;
@group(0) @binding(3) var<storage, read_write> running_var: array<f32>;

@compute @workgroup_size(WG)
fn bn_update_running(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let ch = gid.x + gid.y * nwg.x * WG;
    if (ch >= rp.c) { return; }
    let m = rp.momentum;
    running_mean[ch] = (1.0 - m) * running_mean[ch] + m * running_stats[ch];
    running_var[ch] = (1.0 - m) * running_var[ch] + m * running_stats[rp.c + ch] / f32(rp.count - 1u);
}
