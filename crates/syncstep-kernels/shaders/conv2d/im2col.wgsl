// ---------------------------------------------------------------------------------------------
// The convolution as an explicit GEMM, part 1: im2col and weight rows.
//
// - *_im2col + conv2d_gemm_*: the convolution as an explicit GEMM. An im2col pass copies each
//   pixel's window into one row of a scratch matrix (k = (ci, ky, kx) for the forward; for the
//   input-VJP k = (co, ty, tx) over one phase's taps), zero on padding and zero-padded to a
//   multiple of 4, so the GEMM reads both operands as vec4 along k. The other operand is the
//   weights in rows of the same k: OIHW rows as they are when c_in·kh·kw is a multiple of 4,
//   else a padded copy (*_weight_rows). Each output is summed over k in increasing order,
//   which is the direct kernels' order; the zeros im2col adds for padding and for taps that
//   miss the phase add +0 to a sum that starts at +0, so every variant gives the same bits.
//   (Only with non-finite weights would 0·w differ from a skipped tap.)

// vec4s one im2col (or weight-rows) invocation writes at most: divisions to find its first tap,
// then running counters (integer division is slow on CPU drivers: a scalar loop per lane). Long
// runs divide less often; short ones spread a row over more invocations.
const ROW_RUN: u32 = 48u;

// The run of `rows` rows of p.row4 vec4s that invocation t writes, or none past the last row:
// (row, first vec4, end). A row's runs are as long as each other (37 vec4s go 13 + 13 + 11, not
// 16 + 16 + 5): a subgroup's lanes loop as long as its longest run.
fn row_run(t: u32, rows: u32) -> vec3<u32> {
    let runs = (p.row4 + ROW_RUN - 1u) / ROW_RUN;
    if (t >= rows * runs) { return vec3<u32>(0xffffffffu); }
    let len = (p.row4 + runs - 1u) / runs;
    let v0 = (t % runs) * len;
    return vec3<u32>(t / runs, v0, min(v0 + len, p.row4));
}

// Taps of a kernel of size k that the phase starting at input coordinate `phase` reaches:
// k0 = (phase + pad) mod stride, then every stride-th.
fn phase_first_tap(phase: u32) -> u32 {
    return (phase + p.pad) % p.stride;
}

fn phase_taps(phase: u32, k: u32) -> u32 {
    let k0 = phase_first_tap(phase);
    if (k0 >= k) { return 0u; }
    return (k - k0 + p.stride - 1u) / p.stride;
}

// Forward im2col: row r is pixel q = row_begin + r of (n, oy, ox); column k = (ci, ky, kx).
@group(0) @binding(1) var<storage, read> fi_x: array<f32>;
@group(0) @binding(2) var<storage, read_write> fi_cols: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn conv2d_forward_im2col(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let run = row_run(linear_index(gid, nwg), p.row_count);
    if (run.x == 0xffffffffu) { return; }
    let r = run.x;
    let v0 = run.y;
    let q = p.row_begin + r;
    let ohw = p.out_h * p.out_w;
    let y0 = i32(((q % ohw) / p.out_w) * p.stride) - i32(p.pad);
    let x0 = i32((q % p.out_w) * p.stride) - i32(p.pad);
    let plane = i32(p.h * p.w);
    let khw = p.kh * p.kw;
    let k_len = p.c_in * khw;
    var k = v0 * 4u;
    var at = i32((q / ohw) * p.c_in + k / khw) * plane;   // x offset of (n, ci)
    var ky = (k % khw) / p.kw;
    var kx = k % p.kw;
    for (var v = v0; v < run.z; v++) {
        var quad = vec4<f32>(0.0);
        for (var e = 0u; e < 4u; e++) {
            let iy = y0 + i32(ky);
            let ix = x0 + i32(kx);
            let ok = k < k_len && inside(iy, p.h) && inside(ix, p.w);
            quad[e] = select(0.0, fi_x[select(0, at + iy * i32(p.w) + ix, ok)], ok);
            k++;
            kx++;
            if (kx == p.kw) {
                kx = 0u;
                ky++;
                if (ky == p.kh) {
                    ky = 0u;
                    at += plane;
                }
            }
        }
        fi_cols[r * p.row4 + v] = quad;
    }
}

// Forward weight rows, only when c_in·kh·kw is not a multiple of 4: row co is w[co, ·] padded.
@group(0) @binding(1) var<storage, read> fr_w: array<f32>;
@group(0) @binding(2) var<storage, read_write> fr_rows: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn conv2d_forward_weight_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = linear_index(gid, nwg);
    if (t >= p.c_out * p.row4) { return; }
    let k_len = p.c_in * p.kh * p.kw;
    let k0 = (t % p.row4) * 4u;
    let at = (t / p.row4) * k_len + k0;
    var quad = vec4<f32>(0.0);
    for (var e = 0u; e < 4u; e++) {
        let ok = k0 + e < k_len;
        quad[e] = select(0.0, fr_w[select(0u, at + e, ok)], ok);
    }
    fr_rows[t] = quad;
}

// Input-VJP im2col for the phase (phase_y, phase_x): row r is pixel row_begin + r of (n, a, b)
// with iy = phase_y + stride·a, ix = phase_x + stride·b; column k = (co, ty, tx), the phase's
// taps ky = ky0 + stride·ty, kx = kx0 + stride·tx, which read dy at (oy0 − ty, ox0 − tx).
@group(0) @binding(1) var<storage, read> bi_dy: array<f32>;
@group(0) @binding(2) var<storage, read_write> bi_cols: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn conv2d_backward_input_im2col(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let run = row_run(linear_index(gid, nwg), p.row_count);
    if (run.x == 0xffffffffu) { return; }
    let r = run.x;
    let v0 = run.y;
    let pixel = p.row_begin + r;
    let phw = p.phase_h * p.phase_w;
    let iy = p.phase_y + p.stride * ((pixel % phw) / p.phase_w);
    let ix = p.phase_x + p.stride * (pixel % p.phase_w);
    let oy0 = i32((iy + p.pad - phase_first_tap(p.phase_y)) / p.stride);
    let ox0 = i32((ix + p.pad - phase_first_tap(p.phase_x)) / p.stride);
    let taps_x = phase_taps(p.phase_x, p.kw);
    let taps = phase_taps(p.phase_y, p.kh) * taps_x;
    let k_len = p.c_out * taps;
    let ohw = i32(p.out_h * p.out_w);
    var k = v0 * 4u;
    var at = i32((pixel / phw) * p.c_out + k / max(taps, 1u)) * ohw;   // dy offset of (n, co)
    var ty = (k % max(taps, 1u)) / max(taps_x, 1u);
    var tx = k % max(taps_x, 1u);
    for (var v = v0; v < run.z; v++) {
        var quad = vec4<f32>(0.0);
        for (var e = 0u; e < 4u; e++) {
            let oy = oy0 - i32(ty);
            let ox = ox0 - i32(tx);
            let ok = k < k_len && inside(oy, p.out_h) && inside(ox, p.out_w);
            quad[e] = select(0.0, bi_dy[select(0, at + oy * i32(p.out_w) + ox, ok)], ok);
            k++;
            tx++;
            if (tx == taps_x) {
                tx = 0u;
                ty++;
                if (ty * taps_x == taps) {
                    ty = 0u;
                    at += ohw;
                }
            }
        }
        bi_cols[r * p.row4 + v] = quad;
    }
}

// Input-VJP weight rows for the phase: row ci holds w[co, ci, ky0 + stride·ty, kx0 + stride·tx]
// over k = (co, ty, tx), padded.
@group(0) @binding(1) var<storage, read> br_w: array<f32>;
@group(0) @binding(2) var<storage, read_write> br_rows: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn conv2d_backward_input_weight_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let run = row_run(linear_index(gid, nwg), p.c_in);
    if (run.x == 0xffffffffu) { return; }
    let ci = run.x;
    let v0 = run.y;
    let ky0 = phase_first_tap(p.phase_y);
    let kx0 = phase_first_tap(p.phase_x);
    let taps_x = phase_taps(p.phase_x, p.kw);
    let taps = phase_taps(p.phase_y, p.kh) * taps_x;
    let k_len = p.c_out * taps;
    let khw = p.kh * p.kw;
    var k = v0 * 4u;
    var at = ((k / max(taps, 1u)) * p.c_in + ci) * khw + ky0 * p.kw + kx0;   // w offset of (co, ci, ky0, kx0)
    var ty = (k % max(taps, 1u)) / max(taps_x, 1u);
    var tx = k % max(taps_x, 1u);
    for (var v = v0; v < run.z; v++) {
        var quad = vec4<f32>(0.0);
        for (var e = 0u; e < 4u; e++) {
            let ok = k < k_len;
            quad[e] = select(0.0, br_w[select(0u, at + p.stride * (ty * p.kw + tx), ok)], ok);
            k++;
            tx++;
            if (tx == taps_x) {
                tx = 0u;
                ty++;
                if (ty * taps_x == taps) {
                    ty = 0u;
                    at += p.c_in * khw;
                }
            }
        }
        br_rows[ci * p.row4 + v] = quad;
    }
}
