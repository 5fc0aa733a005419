// ---------------------------------------------------------------------------------------------
// The convolution as an explicit GEMM, part 2: the GEMM uniform and where outputs land, and the
// weight gradient's pairwise blocks.
//
// - conv2d_gemm_weight_*: the weight gradient as a GEMM over the forward's im2col rows:
//   dw[co, k] = Σ_q dy[n, co, oy, ox]·cols[q, k] over pixels q = (n, oy, ox), dy read in place,
//   cols as vec4 along k (4 weights per load). Each invocation walks the pixels in order and
//   keeps, per output, the direct kernel's row sum (over ox) and example sum (over oy); an
//   example's total is pushed into the pairwise blocks, kept in a scratch buffer (the open
//   blocks one level each, largest first: pairwise_slot; one writer per element), and
//   conv2d_backward_weight_total adds the open blocks as pairwise_total does. A chunk of pixels
//   is whole output rows; when a chunk ends inside an example, its running sum waits in the
//   scratch's first level (the carry) for the next chunk, so chunking does not change the order. Padding taps add dy·0 = ±0 to a row sum that starts
//   at +0 and never is −0, which leaves it unchanged: every variant gives the direct bits.

// The GEMM: out = Σ_k a[i, k]·b[j, k] over rows of row4 vec4s. One of a, b is im2col rows
// (pixels), the other weight rows (channels); the result lands in NCHW at
// (n, channel, origin_y + step·py, origin_x + step·px) for pixel (n, py, px) of the grid.
struct Gemm {
    rows_a: u32,
    rows_b: u32,
    row4: u32,
    a_stride: u32,   // elements of gl_a (vec4s) or gg_w (floats) from one row of a to the next
    a_is_pixels: u32,
    pixel_begin: u32,
    pixel_count: u32,   // conv2d_gemm_weight_* only: the chunk's pixels
    channels: u32,
    grid_w: u32,
    grid_h: u32,
    grid_plane: u32,
    out_w: u32,
    out_plane: u32,
    step: u32,
    origin_y: u32,
    origin_x: u32,
    unit_pixels: u32,   // conv2d_backward_weight_units: pixels per unit
    // conv2d_gemm_lanes: GEMMs side by side, one per workgroup_id.z, the next one's a, b (in
    // vec4s) and outputs this far on (0 for one GEMM).
    batch_a: u32,
    batch_b: u32,
    batch_out: u32,
    // conv2d_gemm_lanes and _gather: vec4s of k per segment of the sums (see common.wgsl).
    seg4: u32,
}

// This workgroup's GEMM's offsets into a, b and the outputs (see batch_a).
fn gemm_batch(wid: vec3<u32>) -> vec3<u32> {
    return wid.z * vec3<u32>(g.batch_a, g.batch_b, g.batch_out);
}

@group(0) @binding(0) var<uniform> g: Gemm;

// A row's output offset `at` and, for a pixel, its column and row in the grid.
struct OutRow {
    at: u32,
    x: u32,
    y: u32,
}

// Where row `row` of a (`of_a`) or of b puts its outputs in NCHW, to be added to the other's: a
// pixel's (n, y, x) offset, or a channel's c · out_plane. A pixel's takes four integer divisions,
// slow on CPU drivers (a scalar loop per lane), so the register tiles work out their first row's
// here and step to the next with gemm_out_next, which only compares and adds.
fn gemm_out_first(row: u32, of_a: bool) -> OutRow {
    if ((g.a_is_pixels == 1u) != of_a) { return OutRow(row * g.out_plane, 0u, 0u); }
    let pixel = g.pixel_begin + row;
    let r = pixel % g.grid_plane;
    let gy = r / g.grid_w;
    let gx = r % g.grid_w;
    let at = (pixel / g.grid_plane) * g.channels * g.out_plane + (g.origin_y + g.step * gy) * g.out_w + g.origin_x + g.step * gx;
    return OutRow(at, gx, gy);
}

// The row after `r`: the next channel's plane, or the grid's next pixel (the next column, else
// the next grid row, else the next image's first pixel). u32 arithmetic wraps, so the steps back
// are additions.
fn gemm_out_next(r: OutRow, of_a: bool) -> OutRow {
    if ((g.a_is_pixels == 1u) != of_a) { return OutRow(r.at + g.out_plane, 0u, 0u); }
    let next_row = r.x + 1u == g.grid_w;
    let next_image = next_row && r.y + 1u == g.grid_h;
    var at = r.at + g.step;
    at += select(0u, g.step * (g.out_w - g.grid_w), next_row);
    at += select(0u, g.channels * g.out_plane - g.step * g.out_w * g.grid_h, next_image);
    return OutRow(at, select(r.x + 1u, 0u, next_row), select(select(r.y, r.y + 1u, next_row), 0u, next_image));
}

fn gemm_out_index(i: u32, j: u32) -> u32 {
    return gemm_out_first(i, true).at + gemm_out_first(j, false).at;
}

// The weight gradient as a GEMM (see the top of this file): the forward's im2col rows of one chunk
// against dy in place, into the pairwise blocks of example sums; then the total into dw.
@group(0) @binding(1) var<storage, read> wg_cols: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> wg_dy: array<f32>;
// [level][co][row4] vec4s: level 0 the carry, level 1 + pairwise_slot(l, count) the open block
// of 2^l examples after `count` examples.
@group(0) @binding(3) var<storage, read_write> wg_sums: array<vec4<f32>>;

// Where (co, kv) lives in a level of wg_sums, or u32 max for a clamped row past the edge.
fn gemm_weight_at(co: u32, kv: u32) -> u32 {
    if (co >= g.channels || kv >= g.row4) { return 0xffffffffu; }
    return co * g.row4 + kv;
}

// The running example sum a chunk starts from: the carry when it starts inside an example.
fn gemm_weight_start(co: u32, kv: u32) -> vec4<f32> {
    let at = gemm_weight_at(co, kv);
    if (at == 0xffffffffu || g.pixel_begin % g.out_plane == 0u) { return vec4<f32>(0.0); }
    return wg_sums[at];
}

// Example n's total into the pairwise blocks, as pairwise_push (a loop the driver unrolls: see
// WEIGHT_CHUNK_PIXELS in src/kernels/conv2d/backward_weight.rs for why that matters here).
fn gemm_weight_push(n: u32, co: u32, kv: u32, total: vec4<f32>) {
    let at = gemm_weight_at(co, kv);
    if (at == 0xffffffffu) { return; }
    let level = g.channels * g.row4;
    let closed = countTrailingZeros(~n);
    // pairwise_slot's levels, worked out once: the new block goes after the `top` larger ones,
    // where the largest of those it closes was; block l < closed is closed − 1 − l after it. The
    // index steps down by a level per l: in that form llvmpipe unrolls the loop at every stack
    // size (a loop it keeps counts toward its limit of 65535 iterations per invocation: the
    // 32-level test in tests/suite/conv2d.rs gets a wrong sum).
    let top = countOneBits((n >> 1u) >> closed);
    let smallest = (top + closed) * level + at;
    var v = total;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (l < closed) {
            v = wg_sums[smallest - l * level] + v;
        } else if (l == closed) {
            wg_sums[(1u + top) * level + at] = v;
        }
    }
}

// The running example sum at the end of a chunk, kept when the chunk ends inside an example.
fn gemm_weight_keep(co: u32, kv: u32, sum: vec4<f32>) {
    let at = gemm_weight_at(co, kv);
    if (at != 0xffffffffu && (g.pixel_begin + g.pixel_count) % g.out_plane != 0u) { wg_sums[at] = sum; }
}

// The dy row of pixel q (the first of an output row) for channel 0.
fn gemm_weight_dy_row(q: u32) -> u32 {
    return (q / g.out_plane) * g.channels * g.out_plane + q % g.out_plane;
}

// Winograd's weight gradient's second pass (winograd_weight.rs), one invocation per float of
// dw's rows: the chunk's units (an example's sums each there) added in order to the running example sum (the carry when the chunk starts inside an example), each
// example's total pushed into the pairwise blocks as pairwise_push does, read as floats from
// the levels of the blocks' scratch (level 0 the carry, then the open blocks: pairwise_slot).
@group(0) @binding(1) var<storage, read> wu_units: array<f32>;
@group(0) @binding(2) var<storage, read_write> wu_sums: array<f32>;

@compute @workgroup_size(WG)
fn conv2d_backward_weight_units(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    let level = g.channels * g.row4 * 4u;
    if (i >= level) { return; }
    let done = g.pixel_begin / g.out_plane;   // examples whole before the chunk
    var blocks: array<f32, PAIRWISE_LEVELS>;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (((done >> l) & 1u) == 1u) { blocks[l] = wu_sums[(1u + pairwise_slot(l, done)) * level + i]; }
    }
    var e = 0.0;
    if (g.pixel_begin % g.out_plane != 0u) { e = wu_sums[i]; }
    let units = g.pixel_count / g.unit_pixels;
    for (var u = 0u; u < units; u++) {
        e += wu_units[u * level + i];
        let end = g.pixel_begin + (u + 1u) * g.unit_pixels;
        if (end % g.out_plane == 0u) {
            pairwise_push(&blocks, end / g.out_plane - 1u, e);
            e = 0.0;
        }
    }
    let after = (g.pixel_begin + g.pixel_count) / g.out_plane;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (((after >> l) & 1u) == 1u) { wu_sums[(1u + pairwise_slot(l, after)) * level + i] = blocks[l]; }
    }
    if ((g.pixel_begin + g.pixel_count) % g.out_plane != 0u) { wu_sums[i] = e; }
}

// The GEMM variants' last step: dw[co, k] = pairwise_total of the blocks wg_sums holds for
// (co, k) (read as floats: the block of 2^l examples at (1 + pairwise_slot(l, n))·c_out·row4·4,
// then co·row4·4 + k).
@group(0) @binding(1) var<storage, read> wt_sums: array<f32>;
@group(0) @binding(2) var<storage, read_write> wt_dw: array<f32>;

@compute @workgroup_size(WG)
fn conv2d_backward_weight_total(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    let k_len = p.c_in * p.kh * p.kw;
    if (i >= p.c_out * k_len) { return; }
    let level = p.c_out * p.row4 * 4u;
    let at = (i / k_len) * p.row4 * 4u + i % k_len;
    var blocks: array<f32, PAIRWISE_LEVELS>;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (((p.n >> l) & 1u) == 1u) { blocks[l] = wt_sums[(1u + pairwise_slot(l, p.n)) * level + at]; }
    }
    wt_dw[i] = pairwise_total(&blocks, p.n);
}
