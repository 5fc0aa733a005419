// The fully connected layer, torchvision layout: x [m, k_in], w [k_out, k_in], b [k_out],
// y [m, k_out] = x·wᵀ + b.
//
// Forward and both matrix gradients are one strided product, out[i, j] = Σ_t a(i, t)·b(t, j),
// with a(i, t) = a[i*a_row + t*a_inner] and b(t, j) = b[t*b_inner + j*b_col]; the launcher
// picks the strides that read w (or dy) transposed in place. Each output element is one
// invocation summing t in a fixed order, and every output is overwritten, never accumulated
// across dispatches. The bias is added after the sum, as a separate rounding.
//
// The two reductions over the batch (dense_backward_weight, dense_backward_bias) sum pairwise
// (common/pairwise.wgsl, which this file is compiled after).

struct Params {
    rows: u32,
    cols: u32,
    inner: u32,
    a_row: u32,
    a_inner: u32,
    b_inner: u32,
    b_col: u32,
}

const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: Params;

// Shared by dense_forward, dense_backward_input and dense_backward_weight.
@group(0) @binding(1) var<storage, read> mm_a: array<f32>;
@group(0) @binding(2) var<storage, read> mm_b: array<f32>;
@group(0) @binding(3) var<storage, read_write> mm_out: array<f32>;

fn linear_index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * WG;
}

// out[o] with o = i*cols + j, before any bias.
fn product(o: u32) -> f32 {
    let i = o / p.cols;
    let j = o % p.cols;
    var sum = 0.0;
    for (var t = 0u; t < p.inner; t++) {
        sum += mm_a[i * p.a_row + t * p.a_inner] * mm_b[t * p.b_inner + j * p.b_col];
    }
    return sum;
}

// dense_forward: y = x·wᵀ + b (a = x, b = w read transposed)
@group(0) @binding(4) var<storage, read> fwd_bias: array<f32>;

@compute @workgroup_size(WG)
fn dense_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let o = linear_index(gid, nwg);
    if (o >= p.rows * p.cols) { return; }
    mm_out[o] = product(o) + fwd_bias[o % p.cols];
}

// dense_backward_input: dx = dy·w (a = dy, b = w)
@compute @workgroup_size(WG)
fn dense_backward_input(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let o = linear_index(gid, nwg);
    if (o >= p.rows * p.cols) { return; }
    mm_out[o] = product(o);
}

// dense_backward_weight: dw = dyᵀ·x (a = dy read transposed, b = x); t runs over the batch,
// summed pairwise.
@compute @workgroup_size(WG)
fn dense_backward_weight(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let o = linear_index(gid, nwg);
    if (o >= p.rows * p.cols) { return; }
    let i = o / p.cols;
    let j = o % p.cols;
    var blocks: array<f32, PAIRWISE_LEVELS>;
    let examples = pairwise_count(p.inner, nwg);
    for (var t = 0u; t < examples; t++) {
        pairwise_push(&blocks, t, mm_a[i * p.a_row + t * p.a_inner] * mm_b[t * p.b_inner + j * p.b_col]);
    }
    mm_out[o] = pairwise_total(&blocks, examples);
}

// dense_backward_bias: db[j] = Σ_i dy[i, j], summed pairwise over the batch (rows = m,
// cols = k_out)
@group(0) @binding(1) var<storage, read> bias_dy: array<f32>;
@group(0) @binding(2) var<storage, read_write> bias_db: array<f32>;

@compute @workgroup_size(WG)
fn dense_backward_bias(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let j = linear_index(gid, nwg);
    if (j >= p.cols) { return; }
    var blocks: array<f32, PAIRWISE_LEVELS>;
    let rows = pairwise_count(p.rows, nwg);
    for (var i = 0u; i < rows; i++) {
        pairwise_push(&blocks, i, bias_dy[i * p.cols + j]);
    }
    bias_db[j] = pairwise_total(&blocks, rows);
}
