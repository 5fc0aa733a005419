// Softmax cross-entropy with label smoothing: logits z [m, k], labels y [m] (u32).
// q_j = ε/K + (1−ε)[j = y], ℓ = −Σ_j q_j log softmax(z)_j, dℓ/dz = softmax(z) − q;
// the step's loss is (Σ_i ℓ_i)/D (summed on the host, in the canonical order) and its gradient
// (softmax − q)/D.
//
// One workgroup per example. Row reductions are deterministic: each invocation accumulates a
// strided slice of the row in ascending j, then the workgroup combines those partials by a
// fixed tree, one writer per value. The row max is subtracted before exp; ℓ is formed as
// Σ_j q_j·(log Σ exp(z − max) − (z_j − max)), a sum of non-negative terms (Σ q = 1), so
// nothing cancels.
// A label ≥ K cannot be reported from a shader: that example's ℓ and its
// gradient row are written as NaN. WGSL has no NaN literal, so the launcher passes one in p.nan.
// The host validates labels before upload.

struct Params {
    m: u32,
    k: u32,
    smoothing: f32,
    divisor: f32,
    nan: f32,
}

const WG: u32 = 64u;
// The lowest finite f32, written exactly: Tint (Chrome) refuses a decimal literal that only
// rounds to it, such as -3.40282347e38.
const LOWEST: f32 = -0x1.fffffep+127f;

@group(0) @binding(0) var<uniform> p: Params;

var<workgroup> scratch: array<f32, WG>;

// One value per invocation in, the workgroup's max (or sum) out, combined by a fixed tree.
// Must be called in uniform control flow.
fn workgroup_reduce(lid: u32, v: f32, take_max: bool) -> f32 {
    scratch[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            let a = scratch[lid];
            let b = scratch[lid + s];
            scratch[lid] = select(a + b, max(a, b), take_max);
        }
        workgroupBarrier();
    }
    let r = scratch[0];
    workgroupBarrier(); // before the next call overwrites scratch
    return r;
}

// Shared by cross_entropy_forward and cross_entropy_backward.
@group(0) @binding(1) var<storage, read> ce_logits: array<f32>;
@group(0) @binding(2) var<storage, read> ce_labels: array<u32>;

struct RowStats {
    shift: f32, // max_j z_j
    sum: f32,   // Σ_j exp(z_j − shift), in [1, K]
}

fn row_stats(row: u32, lid: u32) -> RowStats {
    let base = row * p.k;
    var mx = LOWEST;
    for (var j = lid; j < p.k; j += WG) {
        mx = max(mx, ce_logits[base + j]);
    }
    mx = workgroup_reduce(lid, mx, true);
    var sum = 0.0;
    for (var j = lid; j < p.k; j += WG) {
        sum += exp(ce_logits[base + j] - mx);
    }
    return RowStats(mx, workgroup_reduce(lid, sum, false));
}

fn target_prob(j: u32, label: u32) -> f32 {
    return p.smoothing / f32(p.k) + select(0.0, 1.0 - p.smoothing, j == label);
}

// cross_entropy_forward: losses[i] = ℓ_i (no divisor)
@group(0) @binding(3) var<storage, read_write> fwd_losses: array<f32>;

@compute @workgroup_size(WG)
fn cross_entropy_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.x;
    let st = row_stats(row, lid);
    let log_sum = log(st.sum);
    let label = ce_labels[row];
    var acc = 0.0;
    for (var j = lid; j < p.k; j += WG) {
        acc += target_prob(j, label) * (log_sum - (ce_logits[row * p.k + j] - st.shift));
    }
    let loss = workgroup_reduce(lid, acc, false);
    if (lid == 0u) {
        fwd_losses[row] = select(loss, p.nan, label >= p.k);
    }
}

// cross_entropy_backward: dlogits[i, j] = (softmax(z_i)_j − q_j) / D, overwritten
@group(0) @binding(3) var<storage, read_write> bwd_dlogits: array<f32>;

@compute @workgroup_size(WG)
fn cross_entropy_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.x;
    let st = row_stats(row, lid);
    let label = ce_labels[row];
    for (var j = lid; j < p.k; j += WG) {
        let i = row * p.k + j;
        let softmax = exp(ce_logits[i] - st.shift) / st.sum;
        bwd_dlogits[i] = select((softmax - target_prob(j, label)) / p.divisor, p.nan, label >= p.k);
    }
}
