// Conv2d without bias: NCHW activations, OIHW weights. Forward, input-VJP, weight gradient.
//
// What is subtle:
// - Every output element is written by exactly one invocation, which sums in a fixed order.
//   One writer per element and no += across dispatches: the same launch is bitwise reproducible, and
//   outputs are overwritten.
// - backward_input is a GATHER (the transposed correlation): dx[n,ci,iy,ix] sums
//   dy[n,co,oy,ox]·w[co,ci,ky,kx] over the taps with oy·stride − pad + ky = iy. Only
//   ky ≡ iy + pad (mod stride) solve that, so the blocked kernel runs once per phase
//   (iy mod stride, ix mod stride): all pixels of one invocation then share the same taps.
//   A phase that no tap reaches (1×1 kernel, stride 2) gets zeros, still written.
// - backward_weight sums over n, oy, ox. Each output row is summed on its own and then folded
//   into its example's total, which keeps f32 rounding low at large spatial sizes. Examples'
//   totals are summed pairwise, as a binary counter (example n closes the blocks of 2^l
//   examples ending at n, l < the number of trailing ones of n): the sum over an aligned block
//   of 2^k examples, a data-parallel replica's shard, is then a subtree of the sum over the
//   batch, and the gradient all-reduce, adding shards' sums in the same pairwise order,
//   rebuilds the single device's result bit for bit.
// - Padding: coordinates are i32; a read that falls outside the input is replaced by 0 with
//   `select` and its index by 0, so nothing relies on robust-buffer-access clamping.
// - *_direct: one output element per invocation, the plain version. *_blocked: a 4×4 register
//   tile per invocation (4 channels × 4 pixels; for the weight gradient 16 output × 4 input
//   channels, tap by tap), no workgroup memory (barriers are slow on CPU drivers such as
//   lavapipe). Pixel tiles are flattened over the batch too, so 2×2 and 1×1 feature maps fill
//   them. At a ragged edge a tile's indices are clamped for the loads and the extra lanes
//   skipped at the write.
// - The launcher guarantees every element count, and the padded input plane, is below 2^31.
// - *_im2col + conv2d_gemm_*: the convolution as an explicit GEMM. An im2col pass copies each
//   pixel's window into one row of a scratch matrix (k = (ci, ky, kx) for the forward; for the
//   input-VJP k = (co, ty, tx) over one phase's taps), zero on padding and zero-padded to a
//   multiple of 4, so the GEMM reads both operands as vec4 along k. The other operand is the
//   weights in rows of the same k: OIHW rows as they are when c_in·kh·kw is a multiple of 4,
//   else a padded copy (*_weight_rows). Each output is summed over k in increasing order,
//   which is the direct kernels' order; the zeros im2col adds for padding and for taps that
//   miss the phase add +0 to a sum that starts at +0, so every variant gives the same bits.
//   (Only with non-finite weights would 0·w differ from a skipped tap.)
// - conv2d_gemm_weight_*: the weight gradient as a GEMM over the forward's im2col rows:
//   dw[co, k] = Σ_q dy[n, co, oy, ox]·cols[q, k] over pixels q = (n, oy, ox), dy read in place,
//   cols as vec4 along k (4 weights per load). Each invocation walks the pixels in order and
//   keeps, per output, the direct kernel's row sum (over ox) and example sum (over oy); an
//   example's total is pushed into the pairwise blocks, kept in a scratch buffer (one level per
//   bit of n, one writer per element), and conv2d_backward_weight_total adds the open blocks
//   as pairwise_total does. A chunk of pixels is whole output rows; when a chunk ends inside an
//   example, its running sum waits in the scratch's first level (the carry) for the next chunk,
//   so chunking does not change the order. Padding taps add dy·0 = ±0 to a row sum that starts
//   at +0 and never is −0, which leaves it unchanged: every variant gives the direct bits.

struct Params {
    n: u32,
    c_in: u32,
    h: u32,
    w: u32,
    c_out: u32,
    kh: u32,
    kw: u32,
    stride: u32,
    pad: u32,
    out_h: u32,
    out_w: u32,
    // backward_input_blocked only: the phase (iy mod stride, ix mod stride) and its grid size.
    phase_y: u32,
    phase_x: u32,
    phase_h: u32,
    phase_w: u32,
    // *_im2col and *_weight_rows only: the first pixel of this chunk, how many pixels, and the
    // row length in vec4s.
    row_begin: u32,
    row_count: u32,
    row4: u32,
    // conv2d_crop_weights and conv2d_uncrop_weight_gradient only: the kept taps' first row and
    // column in the whole kernel (kh × kw), and how many rows and columns they span.
    crop_y: u32,
    crop_x: u32,
    crop_h: u32,
    crop_w: u32,
    // conv2d_backward_weight_blocked only: dw's kernel size; tap (ky, kx) is its tap
    // (crop_y + ky, crop_x + kx). The whole kernel when the launcher runs a cropped one, else
    // kh × kw (and crop_y = crop_x = 0).
    dw_kh: u32,
    dw_kw: u32,
}

@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 64u;

fn linear_index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * WG;
}

fn x_index(n: u32, c: u32, iy: u32, ix: u32) -> u32 {
    return ((n * p.c_in + c) * p.h + iy) * p.w + ix;
}

fn w_index(co: u32, ci: u32, ky: u32, kx: u32) -> u32 {
    return ((co * p.c_in + ci) * p.kh + ky) * p.kw + kx;
}

fn y_index(n: u32, c: u32, oy: u32, ox: u32) -> u32 {
    return ((n * p.c_out + c) * p.out_h + oy) * p.out_w + ox;
}

// The input coordinate that tap k of output o reads (negative or ≥ size on padding).
fn input_at(o: u32, k: u32) -> i32 {
    return i32(o * p.stride + k) - i32(p.pad);
}

fn inside(i: i32, size: u32) -> bool {
    return i >= 0 && i < i32(size);
}

fn inside4(i: vec4<i32>, size: u32) -> vec4<bool> {
    return (i >= vec4<i32>(0)) & (i < vec4<i32>(i32(size)));
}

// Pairwise sums over examples (see the header). blocks[l] holds the sum of the latest block of
// 2^l examples not yet paired with its left sibling; push example n's total, then read the
// total over n examples: the open blocks are the set bits of n, the earliest examples in the
// highest, added from the smallest up, each as the left operand.
//
// The launcher sets PAIRWISE_LEVELS to the smallest of 4, 8, 16, 32 that holds the bits of the
// example count (pairwise_shader in src/kernels/mod.rs). Both functions loop over every level
// with that constant bound, which lets the driver unroll the loops and keep the blocks in
// registers; an array indexed by the variable level stays in memory on CPU drivers.
const PAIRWISE_LEVELS: u32 = 32u;

fn pairwise_push(blocks: ptr<function, array<f32, PAIRWISE_LEVELS>>, n: u32, total: f32) {
    // Example n closes the blocks below its lowest zero bit and becomes the block there.
    let closed = countTrailingZeros(~n);
    var v = total;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (l < closed) { v = (*blocks)[l] + v; } else if (l == closed) { (*blocks)[l] = v; }
    }
}

fn pairwise_total(blocks: ptr<function, array<f32, PAIRWISE_LEVELS>>, n: u32) -> f32 {
    var sum = 0.0;
    var first = true;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (((n >> l) & 1u) == 1u) {
            if (first) { sum = (*blocks)[l]; } else { sum = (*blocks)[l] + sum; }
            first = false;
        }
    }
    return sum;
}

// The same for a 4×4 tile of sums.
fn pairwise_push4(blocks: ptr<function, array<mat4x4<f32>, PAIRWISE_LEVELS>>, n: u32, total: mat4x4<f32>) {
    let closed = countTrailingZeros(~n);
    var v = total;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (l < closed) { v = (*blocks)[l] + v; } else if (l == closed) { (*blocks)[l] = v; }
    }
}

fn pairwise_total4(blocks: ptr<function, array<mat4x4<f32>, PAIRWISE_LEVELS>>, n: u32) -> mat4x4<f32> {
    var sum = mat4x4<f32>();
    var first = true;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (((n >> l) & 1u) == 1u) {
            if (first) { sum = (*blocks)[l]; } else { sum = (*blocks)[l] + sum; }
            first = false;
        }
    }
    return sum;
}

// pairwise_push4, except that the last of `count` terms closes the sum instead
// of being stored: it merges the blocks below its level as a push would, then the open blocks
// above, smallest first, as pairwise_total would, and leaves the total in blocks[0] (free by
// then). The stack needs one level per bit of count − 1, not of count: 4 for a batch of 16,
// where lavapipe (Mesa 22) ran the Blocked weight gradient 10× slower with 8. Its extra tests
// cost 10% on Mesa 25 where they save no level, so the launcher sets WB_CLOSE only where they
// do (see conv2d_backward_weight_blocked).
fn pairwise_push_or_close4(blocks: ptr<function, array<mat4x4<f32>, PAIRWISE_LEVELS>>, n: u32, count: u32, total: mat4x4<f32>) {
    let closed = countTrailingZeros(~n);
    let last = n + 1u == count;
    var v = total;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (l < closed || (last && l > closed && ((count >> l) & 1u) == 1u)) {
            v = (*blocks)[l] + v;
        } else if (l == closed && !last) {
            (*blocks)[l] = v;
        }
    }
    if (last) { (*blocks)[0] = v; }
}

// ---------------------------------------------------------------------------------------------
// Forward: y[n,co,oy,ox] = Σ_{ci,ky,kx} x[n,ci,oy·s−p+ky,ox·s−p+kx] · w[co,ci,ky,kx]

@group(0) @binding(1) var<storage, read> fd_x: array<f32>;
@group(0) @binding(2) var<storage, read> fd_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> fd_y: array<f32>;

@compute @workgroup_size(WG)
fn conv2d_forward_direct(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.n * p.c_out * p.out_h * p.out_w) { return; }
    let ox = i % p.out_w;
    let oy = (i / p.out_w) % p.out_h;
    let co = (i / (p.out_w * p.out_h)) % p.c_out;
    let n = i / (p.out_w * p.out_h * p.c_out);
    var acc = 0.0;
    for (var ci = 0u; ci < p.c_in; ci++) {
        for (var ky = 0u; ky < p.kh; ky++) {
            let iy = input_at(oy, ky);
            if (!inside(iy, p.h)) { continue; }
            for (var kx = 0u; kx < p.kw; kx++) {
                let ix = input_at(ox, kx);
                if (!inside(ix, p.w)) { continue; }
                acc += fd_x[x_index(n, ci, u32(iy), u32(ix))] * fd_w[w_index(co, ci, ky, kx)];
            }
        }
    }
    fd_y[i] = acc;
}

// Tile: output channels co0..co0+3 × flattened output positions q0..q0+3 of (n, oy, ox).
@group(0) @binding(1) var<storage, read> fb_x: array<f32>;
@group(0) @binding(2) var<storage, read> fb_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> fb_y: array<f32>;

fn fb_load_x(idx: vec4<i32>, ok: vec4<bool>) -> vec4<f32> {
    let s = vec4<u32>(select(vec4<i32>(0), idx, ok));
    return select(vec4<f32>(0.0), vec4<f32>(fb_x[s.x], fb_x[s.y], fb_x[s.z], fb_x[s.w]), ok);
}

@compute @workgroup_size(WG)
fn conv2d_forward_blocked(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = linear_index(gid, nwg);
    let ohw = p.out_h * p.out_w;
    let npix = p.n * ohw;
    let pix_tiles = (npix + 3u) / 4u;
    if (t >= pix_tiles * ((p.c_out + 3u) / 4u)) { return; }
    let co0 = (t / pix_tiles) * 4u;
    let q0 = (t % pix_tiles) * 4u;
    let q = min(vec4<u32>(q0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(npix - 1u));
    let nb = q / ohw;
    let oy = (q % ohw) / p.out_w;
    let ox = q % p.out_w;
    // Each pixel's window corner in the input (may lie in the padding) and its offset in x.
    let y0 = vec4<i32>(oy * p.stride) - i32(p.pad);
    let x0 = vec4<i32>(ox * p.stride) - i32(p.pad);
    let hw = i32(p.h * p.w);
    let base = vec4<i32>(nb * p.c_in) * hw + y0 * i32(p.w) + x0;
    let k_len = p.c_in * p.kh * p.kw;
    let wrow = min(vec4<u32>(co0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(p.c_out - 1u)) * k_len;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    var k = 0u;
    for (var ci = 0u; ci < p.c_in; ci++) {
        for (var ky = 0u; ky < p.kh; ky++) {
            let row_ok = inside4(y0 + i32(ky), p.h);
            let row = base + i32(ci) * hw + i32(ky * p.w);
            for (var kx = 0u; kx < p.kw; kx++) {
                let xv = fb_load_x(row + i32(kx), row_ok & inside4(x0 + i32(kx), p.w));
                acc0 += fb_w[wrow.x + k] * xv;
                acc1 += fb_w[wrow.y + k] * xv;
                acc2 += fb_w[wrow.z + k] * xv;
                acc3 += fb_w[wrow.w + k] * xv;
                k++;
            }
        }
    }
    let acc = array<vec4<f32>, 4>(acc0, acc1, acc2, acc3);
    for (var i = 0u; i < 4u && co0 + i < p.c_out; i++) {
        for (var j = 0u; j < 4u && q0 + j < npix; j++) {
            fb_y[(nb[j] * p.c_out + co0 + i) * ohw + oy[j] * p.out_w + ox[j]] = acc[i][j];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Input-VJP: dx[n,ci,iy,ix] = Σ dy[n,co,oy,ox] · w[co,ci,ky,kx] over oy·s − p + ky = iy,
// ox·s − p + kx = ix.

@group(0) @binding(1) var<storage, read> bd_dy: array<f32>;
@group(0) @binding(2) var<storage, read> bd_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> bd_dx: array<f32>;

// The output coordinate whose tap k reads input i, or -1 when there is none.
fn output_at(i: u32, k: u32, size: u32) -> i32 {
    let t = i32(i + p.pad) - i32(k);
    if (t < 0 || t % i32(p.stride) != 0 || t / i32(p.stride) >= i32(size)) { return -1; }
    return t / i32(p.stride);
}

@compute @workgroup_size(WG)
fn conv2d_backward_input_direct(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.n * p.c_in * p.h * p.w) { return; }
    let ix = i % p.w;
    let iy = (i / p.w) % p.h;
    let ci = (i / (p.w * p.h)) % p.c_in;
    let n = i / (p.w * p.h * p.c_in);
    var acc = 0.0;
    for (var co = 0u; co < p.c_out; co++) {
        for (var ky = 0u; ky < p.kh; ky++) {
            let oy = output_at(iy, ky, p.out_h);
            if (oy < 0) { continue; }
            for (var kx = 0u; kx < p.kw; kx++) {
                let ox = output_at(ix, kx, p.out_w);
                if (ox < 0) { continue; }
                acc += bd_dy[y_index(n, co, u32(oy), u32(ox))] * bd_w[w_index(co, ci, ky, kx)];
            }
        }
    }
    bd_dx[i] = acc;
}

// Tile: input channels ci0..ci0+3 × four pixels of one phase, flattened over (n, a, b) with
// iy = phase_y + s·a, ix = phase_x + s·b. The taps are ky = ky0 + s·t; tap t of pixel a reads
// output row oy = qy + a − t, where qy = (phase_y + pad − ky0) / s (exact).
@group(0) @binding(1) var<storage, read> bb_dy: array<f32>;
@group(0) @binding(2) var<storage, read> bb_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> bb_dx: array<f32>;

fn bb_load_dy(idx: vec4<i32>, ok: vec4<bool>) -> vec4<f32> {
    let s = vec4<u32>(select(vec4<i32>(0), idx, ok));
    return select(vec4<f32>(0.0), vec4<f32>(bb_dy[s.x], bb_dy[s.y], bb_dy[s.z], bb_dy[s.w]), ok);
}

@compute @workgroup_size(WG)
fn conv2d_backward_input_blocked(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = linear_index(gid, nwg);
    let phw = p.phase_h * p.phase_w;
    let npix = p.n * phw;
    let pix_tiles = (npix + 3u) / 4u;
    if (t >= pix_tiles * ((p.c_in + 3u) / 4u)) { return; }
    let ci0 = (t / pix_tiles) * 4u;
    let q0 = (t % pix_tiles) * 4u;
    let q = min(vec4<u32>(q0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(npix - 1u));
    let nb = q / phw;
    let iy = p.phase_y + p.stride * ((q % phw) / p.phase_w);
    let ix = p.phase_x + p.stride * (q % p.phase_w);
    let ky0 = (p.phase_y + p.pad) % p.stride;
    let kx0 = (p.phase_x + p.pad) % p.stride;
    // Output coordinates read by the first tap (t = 0); later taps step back by one.
    let oy0 = vec4<i32>((iy + p.pad - ky0) / p.stride);
    let ox0 = vec4<i32>((ix + p.pad - kx0) / p.stride);
    let ohw = i32(p.out_h * p.out_w);
    let base = vec4<i32>(nb * p.c_out) * ohw + oy0 * i32(p.out_w) + ox0;
    let khw = p.kh * p.kw;
    let ci = min(vec4<u32>(ci0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(p.c_in - 1u));
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var co = 0u; co < p.c_out; co++) {
        let wrow = (co * p.c_in + ci) * khw;
        var oy = oy0;
        var row = base + i32(co) * ohw;
        for (var ky = ky0; ky < p.kh; ky += p.stride) {
            let row_ok = inside4(oy, p.out_h);
            var ox = ox0;
            var idx = row;
            for (var kx = kx0; kx < p.kw; kx += p.stride) {
                let dyv = bb_load_dy(idx, row_ok & inside4(ox, p.out_w));
                let k = ky * p.kw + kx;
                acc0 += bb_w[wrow.x + k] * dyv;
                acc1 += bb_w[wrow.y + k] * dyv;
                acc2 += bb_w[wrow.z + k] * dyv;
                acc3 += bb_w[wrow.w + k] * dyv;
                ox -= vec4<i32>(1);
                idx -= vec4<i32>(1);
            }
            oy -= vec4<i32>(1);
            row -= vec4<i32>(i32(p.out_w));
        }
    }
    let acc = array<vec4<f32>, 4>(acc0, acc1, acc2, acc3);
    for (var i = 0u; i < 4u && ci0 + i < p.c_in; i++) {
        for (var j = 0u; j < 4u && q0 + j < npix; j++) {
            bb_dx[x_index(nb[j], ci0 + i, iy[j], ix[j])] = acc[i][j];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The convolution as an explicit GEMM (see the header): im2col, weight rows, then a GEMM whose
// every output is Σ_k a[row, k]·b[row', k] over rows of vec4s, written straight into NCHW.

// vec4s one im2col (or weight-rows) invocation writes at most: divisions to find its first tap,
// then running counters (integer division is slow on CPU drivers: a scalar loop per lane). 48
// rather than 16: at 224² the im2cols took 12–15% less time; the same at 32².
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

// conv2d_gemm_lanes, for CPU drivers: each invocation GEMM_A rows of a; the workgroup's
// invocations share GEMM_B rows of b. No workgroup memory, no barriers. The launcher compiles
// one module per tile shape, replacing these two constants and the bodies between BEGIN TILE
// and END TILE.
const GEMM_A: u32 = 4u;
const GEMM_B: u32 = 4u;
const GEMM_WG: u32 = 64u;

@group(0) @binding(1) var<storage, read> gl_a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> gl_b: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> gl_out: array<f32>;

// Whether conv2d_gemm_lanes, _gather and _weight_pixels broadcast their rows of b across a
// subgroup (see gemm_tile_body and gemm_weight_tile_body in src/kernels/conv2d.rs; the launcher
// sets it).
const GEMM_BROADCAST: bool = false;

// The first rows (i0, j0) of this invocation's tile, or none (u32 max) past the edge. With
// `whole_subgroups`, invocations past the last rows of a go on with clamped loads and no stores,
// so that all of a subgroup take part in its broadcasts (the tile body returns for a subgroup
// wholly past the edge).
fn gemm_lanes_origin(lid: u32, wid: vec3<u32>, nwg: vec3<u32>, whole_subgroups: bool) -> vec2<u32> {
    let a_groups = (g.rows_a + GEMM_WG * GEMM_A - 1u) / (GEMM_WG * GEMM_A);
    let f = wid.x + wid.y * nwg.x;
    let i0 = ((f % a_groups) * GEMM_WG + lid) * GEMM_A;
    let j0 = (f / a_groups) * GEMM_B;
    if ((i0 >= g.rows_a && !whole_subgroups) || j0 >= g.rows_b) { return vec2<u32>(0xffffffffu); }
    return vec2<u32>(i0, j0);
}

// Output (i, j) at `at` (the sum of i's and j's offsets: gemm_out_first, gemm_out_next).
fn gemm_lanes_store(i: u32, j: u32, at: u32, sum: f32) {
    if (i < g.rows_a && j < g.rows_b) { gl_out[at] = sum; }
}

@compute @workgroup_size(GEMM_WG)
fn conv2d_gemm_lanes(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let origin = gemm_lanes_origin(lid, wid, nwg, GEMM_BROADCAST);
    if (origin.x == 0xffffffffu) { return; }
    let i0 = origin.x;
    let j0 = origin.y;
    // BEGIN TILE conv2d_gemm_lanes: the body for GEMM_A × GEMM_B = 4 × 4, as gemm_tile in
    // src/kernels/conv2d.rs writes it for every tile: unrolled, with a variable per output.
    let a0 = min(i0 + 0u, g.rows_a - 1u) * g.a_stride;
    let a1 = min(i0 + 1u, g.rows_a - 1u) * g.a_stride;
    let a2 = min(i0 + 2u, g.rows_a - 1u) * g.a_stride;
    let a3 = min(i0 + 3u, g.rows_a - 1u) * g.a_stride;
    let b0 = min(j0 + 0u, g.rows_b - 1u) * g.row4;
    let b1 = min(j0 + 1u, g.rows_b - 1u) * g.row4;
    let b2 = min(j0 + 2u, g.rows_b - 1u) * g.row4;
    let b3 = min(j0 + 3u, g.rows_b - 1u) * g.row4;
    var s0_0 = 0.0; var s0_1 = 0.0; var s0_2 = 0.0; var s0_3 = 0.0;
    var s1_0 = 0.0; var s1_1 = 0.0; var s1_2 = 0.0; var s1_3 = 0.0;
    var s2_0 = 0.0; var s2_1 = 0.0; var s2_2 = 0.0; var s2_3 = 0.0;
    var s3_0 = 0.0; var s3_1 = 0.0; var s3_2 = 0.0; var s3_3 = 0.0;
    for (var v = 0u; v < g.row4; v++) {
        let bv0 = gl_b[b0 + v];
        let bv1 = gl_b[b1 + v];
        let bv2 = gl_b[b2 + v];
        let bv3 = gl_b[b3 + v];
        let av0 = gl_a[a0 + v];
        s0_0 += av0.x * bv0.x; s0_0 += av0.y * bv0.y; s0_0 += av0.z * bv0.z; s0_0 += av0.w * bv0.w;
        s0_1 += av0.x * bv1.x; s0_1 += av0.y * bv1.y; s0_1 += av0.z * bv1.z; s0_1 += av0.w * bv1.w;
        s0_2 += av0.x * bv2.x; s0_2 += av0.y * bv2.y; s0_2 += av0.z * bv2.z; s0_2 += av0.w * bv2.w;
        s0_3 += av0.x * bv3.x; s0_3 += av0.y * bv3.y; s0_3 += av0.z * bv3.z; s0_3 += av0.w * bv3.w;
        let av1 = gl_a[a1 + v];
        s1_0 += av1.x * bv0.x; s1_0 += av1.y * bv0.y; s1_0 += av1.z * bv0.z; s1_0 += av1.w * bv0.w;
        s1_1 += av1.x * bv1.x; s1_1 += av1.y * bv1.y; s1_1 += av1.z * bv1.z; s1_1 += av1.w * bv1.w;
        s1_2 += av1.x * bv2.x; s1_2 += av1.y * bv2.y; s1_2 += av1.z * bv2.z; s1_2 += av1.w * bv2.w;
        s1_3 += av1.x * bv3.x; s1_3 += av1.y * bv3.y; s1_3 += av1.z * bv3.z; s1_3 += av1.w * bv3.w;
        let av2 = gl_a[a2 + v];
        s2_0 += av2.x * bv0.x; s2_0 += av2.y * bv0.y; s2_0 += av2.z * bv0.z; s2_0 += av2.w * bv0.w;
        s2_1 += av2.x * bv1.x; s2_1 += av2.y * bv1.y; s2_1 += av2.z * bv1.z; s2_1 += av2.w * bv1.w;
        s2_2 += av2.x * bv2.x; s2_2 += av2.y * bv2.y; s2_2 += av2.z * bv2.z; s2_2 += av2.w * bv2.w;
        s2_3 += av2.x * bv3.x; s2_3 += av2.y * bv3.y; s2_3 += av2.z * bv3.z; s2_3 += av2.w * bv3.w;
        let av3 = gl_a[a3 + v];
        s3_0 += av3.x * bv0.x; s3_0 += av3.y * bv0.y; s3_0 += av3.z * bv0.z; s3_0 += av3.w * bv0.w;
        s3_1 += av3.x * bv1.x; s3_1 += av3.y * bv1.y; s3_1 += av3.z * bv1.z; s3_1 += av3.w * bv1.w;
        s3_2 += av3.x * bv2.x; s3_2 += av3.y * bv2.y; s3_2 += av3.z * bv2.z; s3_2 += av3.w * bv2.w;
        s3_3 += av3.x * bv3.x; s3_3 += av3.y * bv3.y; s3_3 += av3.z * bv3.z; s3_3 += av3.w * bv3.w;
    }
    let oa0 = gemm_out_first(i0, true);
    let oa1 = gemm_out_next(oa0, true);
    let oa2 = gemm_out_next(oa1, true);
    let oa3 = gemm_out_next(oa2, true);
    let ob0 = gemm_out_first(j0, false);
    let ob1 = gemm_out_next(ob0, false);
    let ob2 = gemm_out_next(ob1, false);
    let ob3 = gemm_out_next(ob2, false);
    gemm_lanes_store(i0 + 0u, j0 + 0u, oa0.at + ob0.at, s0_0); gemm_lanes_store(i0 + 0u, j0 + 1u, oa0.at + ob1.at, s0_1); gemm_lanes_store(i0 + 0u, j0 + 2u, oa0.at + ob2.at, s0_2); gemm_lanes_store(i0 + 0u, j0 + 3u, oa0.at + ob3.at, s0_3);
    gemm_lanes_store(i0 + 1u, j0 + 0u, oa1.at + ob0.at, s1_0); gemm_lanes_store(i0 + 1u, j0 + 1u, oa1.at + ob1.at, s1_1); gemm_lanes_store(i0 + 1u, j0 + 2u, oa1.at + ob2.at, s1_2); gemm_lanes_store(i0 + 1u, j0 + 3u, oa1.at + ob3.at, s1_3);
    gemm_lanes_store(i0 + 2u, j0 + 0u, oa2.at + ob0.at, s2_0); gemm_lanes_store(i0 + 2u, j0 + 1u, oa2.at + ob1.at, s2_1); gemm_lanes_store(i0 + 2u, j0 + 2u, oa2.at + ob2.at, s2_2); gemm_lanes_store(i0 + 2u, j0 + 3u, oa2.at + ob3.at, s2_3);
    gemm_lanes_store(i0 + 3u, j0 + 0u, oa3.at + ob0.at, s3_0); gemm_lanes_store(i0 + 3u, j0 + 1u, oa3.at + ob1.at, s3_1); gemm_lanes_store(i0 + 3u, j0 + 2u, oa3.at + ob2.at, s3_2); gemm_lanes_store(i0 + 3u, j0 + 3u, oa3.at + ob3.at, s3_3);
    // END TILE conv2d_gemm_lanes
}

// conv2d_gemm_gather: conv2d_gemm_lanes for the input-VJP with channel lanes, reading a (the
// weights, row ci) from w in place instead of from weight rows copied beforehand: for small
// batches of small maps that copy costs as much as the GEMM. gg_taps[v] holds the w offsets,
// relative to (0, ci, 0, 0), of the four taps of vec4 v of a row (co, ty, tx), u32 max past
// the last.
@group(0) @binding(1) var<storage, read> gg_w: array<f32>;
@group(0) @binding(4) var<storage, read> gg_taps: array<vec4<u32>>;

@compute @workgroup_size(GEMM_WG)
fn conv2d_gemm_gather(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let origin = gemm_lanes_origin(lid, wid, nwg, GEMM_BROADCAST);
    if (origin.x == 0xffffffffu) { return; }
    let i0 = origin.x;
    let j0 = origin.y;
    // BEGIN TILE conv2d_gemm_gather: the body for GEMM_A × GEMM_B = 4 × 4, as gemm_tile in
    // src/kernels/conv2d.rs writes it for every tile: unrolled, with a variable per output.
    let a0 = min(i0 + 0u, g.rows_a - 1u) * g.a_stride;
    let a1 = min(i0 + 1u, g.rows_a - 1u) * g.a_stride;
    let a2 = min(i0 + 2u, g.rows_a - 1u) * g.a_stride;
    let a3 = min(i0 + 3u, g.rows_a - 1u) * g.a_stride;
    let b0 = min(j0 + 0u, g.rows_b - 1u) * g.row4;
    let b1 = min(j0 + 1u, g.rows_b - 1u) * g.row4;
    let b2 = min(j0 + 2u, g.rows_b - 1u) * g.row4;
    let b3 = min(j0 + 3u, g.rows_b - 1u) * g.row4;
    var s0_0 = 0.0; var s0_1 = 0.0; var s0_2 = 0.0; var s0_3 = 0.0;
    var s1_0 = 0.0; var s1_1 = 0.0; var s1_2 = 0.0; var s1_3 = 0.0;
    var s2_0 = 0.0; var s2_1 = 0.0; var s2_2 = 0.0; var s2_3 = 0.0;
    var s3_0 = 0.0; var s3_1 = 0.0; var s3_2 = 0.0; var s3_3 = 0.0;
    for (var v = 0u; v < g.row4; v++) {
        let bv0 = gl_b[b0 + v];
        let bv1 = gl_b[b1 + v];
        let bv2 = gl_b[b2 + v];
        let bv3 = gl_b[b3 + v];
        let tap = gg_taps[v];
        let live = tap != vec4<u32>(0xffffffffu);
        let at = select(vec4<u32>(0u), tap, live);
        let av0 = select(vec4<f32>(0.0), vec4<f32>(gg_w[a0 + at.x], gg_w[a0 + at.y], gg_w[a0 + at.z], gg_w[a0 + at.w]), live);
        s0_0 += av0.x * bv0.x; s0_0 += av0.y * bv0.y; s0_0 += av0.z * bv0.z; s0_0 += av0.w * bv0.w;
        s0_1 += av0.x * bv1.x; s0_1 += av0.y * bv1.y; s0_1 += av0.z * bv1.z; s0_1 += av0.w * bv1.w;
        s0_2 += av0.x * bv2.x; s0_2 += av0.y * bv2.y; s0_2 += av0.z * bv2.z; s0_2 += av0.w * bv2.w;
        s0_3 += av0.x * bv3.x; s0_3 += av0.y * bv3.y; s0_3 += av0.z * bv3.z; s0_3 += av0.w * bv3.w;
        let av1 = select(vec4<f32>(0.0), vec4<f32>(gg_w[a1 + at.x], gg_w[a1 + at.y], gg_w[a1 + at.z], gg_w[a1 + at.w]), live);
        s1_0 += av1.x * bv0.x; s1_0 += av1.y * bv0.y; s1_0 += av1.z * bv0.z; s1_0 += av1.w * bv0.w;
        s1_1 += av1.x * bv1.x; s1_1 += av1.y * bv1.y; s1_1 += av1.z * bv1.z; s1_1 += av1.w * bv1.w;
        s1_2 += av1.x * bv2.x; s1_2 += av1.y * bv2.y; s1_2 += av1.z * bv2.z; s1_2 += av1.w * bv2.w;
        s1_3 += av1.x * bv3.x; s1_3 += av1.y * bv3.y; s1_3 += av1.z * bv3.z; s1_3 += av1.w * bv3.w;
        let av2 = select(vec4<f32>(0.0), vec4<f32>(gg_w[a2 + at.x], gg_w[a2 + at.y], gg_w[a2 + at.z], gg_w[a2 + at.w]), live);
        s2_0 += av2.x * bv0.x; s2_0 += av2.y * bv0.y; s2_0 += av2.z * bv0.z; s2_0 += av2.w * bv0.w;
        s2_1 += av2.x * bv1.x; s2_1 += av2.y * bv1.y; s2_1 += av2.z * bv1.z; s2_1 += av2.w * bv1.w;
        s2_2 += av2.x * bv2.x; s2_2 += av2.y * bv2.y; s2_2 += av2.z * bv2.z; s2_2 += av2.w * bv2.w;
        s2_3 += av2.x * bv3.x; s2_3 += av2.y * bv3.y; s2_3 += av2.z * bv3.z; s2_3 += av2.w * bv3.w;
        let av3 = select(vec4<f32>(0.0), vec4<f32>(gg_w[a3 + at.x], gg_w[a3 + at.y], gg_w[a3 + at.z], gg_w[a3 + at.w]), live);
        s3_0 += av3.x * bv0.x; s3_0 += av3.y * bv0.y; s3_0 += av3.z * bv0.z; s3_0 += av3.w * bv0.w;
        s3_1 += av3.x * bv1.x; s3_1 += av3.y * bv1.y; s3_1 += av3.z * bv1.z; s3_1 += av3.w * bv1.w;
        s3_2 += av3.x * bv2.x; s3_2 += av3.y * bv2.y; s3_2 += av3.z * bv2.z; s3_2 += av3.w * bv2.w;
        s3_3 += av3.x * bv3.x; s3_3 += av3.y * bv3.y; s3_3 += av3.z * bv3.z; s3_3 += av3.w * bv3.w;
    }
    let oa0 = gemm_out_first(i0, true);
    let oa1 = gemm_out_next(oa0, true);
    let oa2 = gemm_out_next(oa1, true);
    let oa3 = gemm_out_next(oa2, true);
    let ob0 = gemm_out_first(j0, false);
    let ob1 = gemm_out_next(ob0, false);
    let ob2 = gemm_out_next(ob1, false);
    let ob3 = gemm_out_next(ob2, false);
    gemm_lanes_store(i0 + 0u, j0 + 0u, oa0.at + ob0.at, s0_0); gemm_lanes_store(i0 + 0u, j0 + 1u, oa0.at + ob1.at, s0_1); gemm_lanes_store(i0 + 0u, j0 + 2u, oa0.at + ob2.at, s0_2); gemm_lanes_store(i0 + 0u, j0 + 3u, oa0.at + ob3.at, s0_3);
    gemm_lanes_store(i0 + 1u, j0 + 0u, oa1.at + ob0.at, s1_0); gemm_lanes_store(i0 + 1u, j0 + 1u, oa1.at + ob1.at, s1_1); gemm_lanes_store(i0 + 1u, j0 + 2u, oa1.at + ob2.at, s1_2); gemm_lanes_store(i0 + 1u, j0 + 3u, oa1.at + ob3.at, s1_3);
    gemm_lanes_store(i0 + 2u, j0 + 0u, oa2.at + ob0.at, s2_0); gemm_lanes_store(i0 + 2u, j0 + 1u, oa2.at + ob1.at, s2_1); gemm_lanes_store(i0 + 2u, j0 + 2u, oa2.at + ob2.at, s2_2); gemm_lanes_store(i0 + 2u, j0 + 3u, oa2.at + ob3.at, s2_3);
    gemm_lanes_store(i0 + 3u, j0 + 0u, oa3.at + ob0.at, s3_0); gemm_lanes_store(i0 + 3u, j0 + 1u, oa3.at + ob1.at, s3_1); gemm_lanes_store(i0 + 3u, j0 + 2u, oa3.at + ob2.at, s3_2); gemm_lanes_store(i0 + 3u, j0 + 3u, oa3.at + ob3.at, s3_3);
    // END TILE conv2d_gemm_gather
}

// conv2d_gemm_shared, for GPUs: a 64×64 output tile per workgroup of 256 invocations, 4×4 each;
// 16 k at a time staged in workgroup memory (8 KiB) between barriers.
const SHARED_EDGE: u32 = 64u;
var<workgroup> gs_tile_a: array<vec4<f32>, 256>;   // 64 rows × 4 vec4
var<workgroup> gs_tile_b: array<vec4<f32>, 256>;

@group(0) @binding(1) var<storage, read> gs_a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> gs_b: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> gs_out: array<f32>;

@compute @workgroup_size(256)
fn conv2d_gemm_shared(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let a_tiles = (g.rows_a + SHARED_EDGE - 1u) / SHARED_EDGE;
    let f = wid.x + wid.y * nwg.x;
    let a_base = (f % a_tiles) * SHARED_EDGE;
    let b_base = (f / a_tiles) * SHARED_EDGE;
    if (b_base >= g.rows_b) { return; }   // whole workgroups only: the barriers stay uniform
    // Staging: invocation lid copies vec4 (lid mod 4) of tile row lid / 4, for a and for b.
    let a_src = min(a_base + lid / 4u, g.rows_a - 1u) * g.row4;
    let b_src = min(b_base + lid / 4u, g.rows_b - 1u) * g.row4;
    let ti = (lid % 16u) * 4u;
    let tj = (lid / 16u) * 4u;
    var acc: array<vec4<f32>, 4>;   // acc[i][j]: a row ti + i, b row tj + j
    for (var v0 = 0u; v0 < g.row4; v0 += 4u) {
        let v = min(v0 + lid % 4u, g.row4 - 1u);
        gs_tile_a[lid] = gs_a[a_src + v];
        gs_tile_b[lid] = gs_b[b_src + v];
        workgroupBarrier();
        for (var s = 0u; s < min(4u, g.row4 - v0); s++) {
            var bv: array<vec4<f32>, 4>;
            for (var j = 0u; j < 4u; j++) { bv[j] = gs_tile_b[(tj + j) * 4u + s]; }
            for (var i = 0u; i < 4u; i++) {
                let av = gs_tile_a[(ti + i) * 4u + s];
                for (var j = 0u; j < 4u; j++) {
                    acc[i][j] += av.x * bv[j].x;
                    acc[i][j] += av.y * bv[j].y;
                    acc[i][j] += av.z * bv[j].z;
                    acc[i][j] += av.w * bv[j].w;
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u && a_base + ti + i < g.rows_a; i++) {
        for (var j = 0u; j < 4u && b_base + tj + j < g.rows_b; j++) {
            gs_out[gemm_out_index(a_base + ti + i, b_base + tj + j)] = acc[i][j];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Weight gradient: dw[co,ci,ky,kx] = Σ_n Σ_oy (Σ_ox dy[n,co,oy,ox] · x[n,ci,oy·s−p+ky,ox·s−p+kx])

@group(0) @binding(1) var<storage, read> wd_dy: array<f32>;
@group(0) @binding(2) var<storage, read> wd_x: array<f32>;
@group(0) @binding(3) var<storage, read_write> wd_dw: array<f32>;

@compute @workgroup_size(WG)
fn conv2d_backward_weight_direct(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.c_out * p.c_in * p.kh * p.kw) { return; }
    let kx = i % p.kw;
    let ky = (i / p.kw) % p.kh;
    let ci = (i / (p.kw * p.kh)) % p.c_in;
    let co = i / (p.kw * p.kh * p.c_in);
    var blocks: array<f32, PAIRWISE_LEVELS>;
    for (var n = 0u; n < p.n; n++) {
        var example = 0.0;
        for (var oy = 0u; oy < p.out_h; oy++) {
            let iy = input_at(oy, ky);
            if (!inside(iy, p.h)) { continue; }
            var row = 0.0;
            for (var ox = 0u; ox < p.out_w; ox++) {
                let ix = input_at(ox, kx);
                if (!inside(ix, p.w)) { continue; }
                row += wd_dy[y_index(n, co, oy, ox)] * wd_x[x_index(n, ci, u32(iy), u32(ix))];
            }
            example += row;
        }
        pairwise_push(&blocks, n, example);
    }
    wd_dw[i] = pairwise_total(&blocks, p.n);
}

// Tile: output channels co0..co0+15 × input channels ci0..ci0+3, one tap (ky, kx) after the
// other, each in the direct kernel's summation order (four x loads serve 64 products). Rows and
// columns of output pixels whose window puts the tap on padding only add +0 (see the header), so
// the loops skip them: on ResNet-34's 2×2 maps a 3×3 kernel's taps read the input at 16 of 36
// (pixel, tap) pairs. Every invocation is at the same tap at the same time, so those loop bounds
// are the same across invocations; and an invocation writes whole kernels (kh·kw consecutive
// weights), not one weight per cache line. The sums of 4 output channels are the columns of one
// matrix: a, b, c, d hold channels co0..co0+3, +4..+7, +8..+11, +12..+15.
@group(0) @binding(1) var<storage, read> wb_dy: array<f32>;
@group(0) @binding(2) var<storage, read> wb_x: array<f32>;
@group(0) @binding(3) var<storage, read_write> wb_dw: array<f32>;

// The outputs o < out whose tap k reads inside an input axis of `size`: o·stride − pad + k in
// [0, size), as the range [x, y).
fn outputs_inside(k: u32, size: u32, out: u32) -> vec2<u32> {
    let s = i32(p.stride);
    let lo = i32(p.pad) - i32(k); // o·stride ≥ lo
    let hi = i32(size) + lo; // o·stride < hi
    let first = u32(max(0, (lo + s - 1) / s));
    let end = select(0u, min(out, u32((hi - 1) / s + 1)), hi > 0);
    return vec2<u32>(first, max(first, end));
}

// A workgroup holds one tile of output channels, its invocations consecutive tiles of input
// channels: every invocation of a workgroup reads the same dy. Where the device has subgroups
// of 8 or more, the launcher compiles the dy reads between BEGIN DY and END DY as two loads per
// invocation, each of a different output channel, and subgroupBroadcast to the others (on
// lavapipe a storage load is a loop over the SIMD lanes, a broadcast one instruction).
const WB_LANES: u32 = 16u;
const WB_CO: u32 = 16u;

@compute @workgroup_size(WB_LANES)
fn conv2d_backward_weight_blocked(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let ci_tiles = (p.c_in + 3u) / 4u;
    let ci_blocks = (ci_tiles + WB_LANES - 1u) / WB_LANES;
    let f = wid.x + wid.y * nwg.x;
    let co0 = (f / ci_blocks) * WB_CO;
    if (co0 >= p.c_out) { return; }
    // Invocations past the last input-channel tile repeat it and skip the write: all of a
    // subgroup stay active for its broadcasts. Channels past a ragged edge are clamped for the
    // loads and skipped at the write.
    let ci_tile = (f % ci_blocks) * WB_LANES + lid;
    let live = ci_tile < ci_tiles;
    let ci0 = min(ci_tile, ci_tiles - 1u) * 4u;
    let lanes = vec4<u32>(0u, 1u, 2u, 3u);
    let ci = min(vec4<u32>(ci0) + lanes, vec4<u32>(p.c_in - 1u));
    let last = vec4<u32>(p.c_out - 1u);
    let co_a = min(vec4<u32>(co0) + lanes, last);
    let co_b = min(vec4<u32>(co0 + 4u) + lanes, last);
    let co_c = min(vec4<u32>(co0 + 8u) + lanes, last);
    let co_d = min(vec4<u32>(co0 + 12u) + lanes, last);
    let hw = p.h * p.w;
    let ohw = p.out_h * p.out_w;
    let khw = p.kh * p.kw;
    for (var tap = 0u; tap < khw; tap++) {
        let ky = tap / p.kw;
        let kx = tap % p.kw;
        let rows = outputs_inside(ky, p.h, p.out_h);
        let cols = outputs_inside(kx, p.w, p.out_w);
        var blocks_a: array<mat4x4<f32>, PAIRWISE_LEVELS>;
        var blocks_b: array<mat4x4<f32>, PAIRWISE_LEVELS>;
        var blocks_c: array<mat4x4<f32>, PAIRWISE_LEVELS>;
        var blocks_d: array<mat4x4<f32>, PAIRWISE_LEVELS>;
        for (var n = 0u; n < p.n; n++) {
            var ea = mat4x4<f32>();
            var eb = mat4x4<f32>();
            var ec = mat4x4<f32>();
            var ed = mat4x4<f32>();
            let x_n = (vec4<u32>(n * p.c_in) + ci) * hw;
            let dy_n = n * p.c_out * ohw;
            for (var oy = rows.x; oy < rows.y; oy++) {
                let iy = oy * p.stride + ky - p.pad;
                var ra = mat4x4<f32>();
                var rb = mat4x4<f32>();
                var rc = mat4x4<f32>();
                var rd = mat4x4<f32>();
                for (var ox = cols.x; ox < cols.y; ox++) {
                    let xi = x_n + vec4<u32>(iy * p.w + ox * p.stride + kx - p.pad);
                    let xv = vec4<f32>(wb_x[xi.x], wb_x[xi.y], wb_x[xi.z], wb_x[xi.w]);
                    let pix = dy_n + oy * p.out_w + ox;
                    // BEGIN DY conv2d_backward_weight_blocked
                    let da = wb_dy4(co_a * ohw + vec4<u32>(pix));
                    let db = wb_dy4(co_b * ohw + vec4<u32>(pix));
                    let dc = wb_dy4(co_c * ohw + vec4<u32>(pix));
                    let dd = wb_dy4(co_d * ohw + vec4<u32>(pix));
                    // END DY conv2d_backward_weight_blocked
                    ra[0] += da.x * xv; ra[1] += da.y * xv; ra[2] += da.z * xv; ra[3] += da.w * xv;
                    rb[0] += db.x * xv; rb[1] += db.y * xv; rb[2] += db.z * xv; rb[3] += db.w * xv;
                    rc[0] += dc.x * xv; rc[1] += dc.y * xv; rc[2] += dc.z * xv; rc[3] += dc.w * xv;
                    rd[0] += dd.x * xv; rd[1] += dd.y * xv; rd[2] += dd.z * xv; rd[3] += dd.w * xv;
                }
                ea += ra;
                eb += rb;
                ec += rc;
                ed += rd;
            }
            wb_push(&blocks_a, n, ea);
            wb_push(&blocks_b, n, eb);
            wb_push(&blocks_c, n, ec);
            wb_push(&blocks_d, n, ed);
        }
        if (live) {
            // dw[co, ci, ky, kx]: whole groups of 4 output channels as 16 plain stores each (on
            // Mesa 22 a loop over a matrix indexed by variables is slower), ragged ones element
            // by element.
            let at = ((co0 * p.c_in + ci0) * p.dw_kh + p.crop_y + ky) * p.dw_kw + p.crop_x + kx;
            let co_step = p.c_in * p.dw_kh * p.dw_kw;
            wb_store(at, co_step, co0, ci0, wb_total(&blocks_a));
            wb_store(at + 4u * co_step, co_step, co0 + 4u, ci0, wb_total(&blocks_b));
            wb_store(at + 8u * co_step, co_step, co0 + 8u, ci0, wb_total(&blocks_c));
            wb_store(at + 12u * co_step, co_step, co0 + 12u, ci0, wb_total(&blocks_d));
        }
    }
}

// Whether the examples' pairwise sums close at the last (pairwise_push_or_close4): set by the
// launcher where that saves a level of the stack.
const WB_CLOSE: bool = false;

fn wb_push(blocks: ptr<function, array<mat4x4<f32>, PAIRWISE_LEVELS>>, n: u32, e: mat4x4<f32>) {
    if (WB_CLOSE) { pairwise_push_or_close4(blocks, n, p.n, e); } else { pairwise_push4(blocks, n, e); }
}

fn wb_total(blocks: ptr<function, array<mat4x4<f32>, PAIRWISE_LEVELS>>) -> mat4x4<f32> {
    if (WB_CLOSE) { return (*blocks)[0]; }
    return pairwise_total4(blocks, p.n);
}

// dy at four indices.
fn wb_dy4(at: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(wb_dy[at.x], wb_dy[at.y], wb_dy[at.z], wb_dy[at.w]);
}

// Output channels co..co+3 (the columns of t) × input channels ci0..ci0+3 at one tap, from
// dw index `at` (co_step apart per output channel, a kernel apart per input channel).
fn wb_store(at: u32, co_step: u32, co: u32, ci0: u32, t: mat4x4<f32>) {
    let khw = p.dw_kh * p.dw_kw;
    if (co + 3u < p.c_out && ci0 + 3u < p.c_in) {
        wb_store_row(at, t[0]);
        wb_store_row(at + co_step, t[1]);
        wb_store_row(at + 2u * co_step, t[2]);
        wb_store_row(at + 3u * co_step, t[3]);
        return;
    }
    for (var i = 0u; i < 4u && co + i < p.c_out; i++) {
        for (var j = 0u; j < 4u && ci0 + j < p.c_in; j++) {
            wb_dw[at + i * co_step + j * khw] = t[i][j];
        }
    }
}

// One output channel's four input channels at one tap, a kernel apart in dw.
fn wb_store_row(at: u32, v: vec4<f32>) {
    let khw = p.dw_kh * p.dw_kw;
    wb_dw[at] = v.x;
    wb_dw[at + khw] = v.y;
    wb_dw[at + 2u * khw] = v.z;
    wb_dw[at + 3u * khw] = v.w;
}

// The weight gradient as a GEMM (see the header): the forward's im2col rows of one chunk
// against dy in place, into the pairwise blocks of example sums; then the total into dw.
@group(0) @binding(1) var<storage, read> wg_cols: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> wg_dy: array<f32>;
// [level][co][row4] vec4s: level 0 the carry, level 1 + l the pairwise block of 2^l examples.
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
// conv2d_backward_weight's chunks in src/kernels/conv2d.rs for why that matters here).
fn gemm_weight_push(n: u32, co: u32, kv: u32, total: vec4<f32>) {
    let at = gemm_weight_at(co, kv);
    if (at == 0xffffffffu) { return; }
    let level = g.channels * g.row4;
    let closed = countTrailingZeros(~n);
    var v = total;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (l < closed) { v = wg_sums[(l + 1u) * level + at] + v; } else if (l == closed) { wg_sums[(l + 1u) * level + at] = v; }
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

// conv2d_gemm_weight_pixels, for CPU drivers: each invocation GEMM_A / 4 vec4s of k (a rows are
// the k of im2col), the workgroup's invocations share GEMM_B output channels (b rows); no
// workgroup memory. conv2d_gemm_weight_channels: each invocation GEMM_A output channels, the
// workgroup shares GEMM_B / 4 vec4s of k. Tile bodies as conv2d_gemm_lanes'.
@compute @workgroup_size(GEMM_WG)
fn conv2d_gemm_weight_pixels(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let origin = gemm_lanes_origin(lid, wid, nwg, GEMM_BROADCAST);
    if (origin.x == 0xffffffffu) { return; }
    let kv0 = origin.x / 4u;
    let co0 = origin.y;
    // BEGIN TILE conv2d_gemm_weight_pixels: the body for GEMM_A × GEMM_B = 4 × 4, as gemm_tile in
    // src/kernels/conv2d.rs writes it for every tile: unrolled, with a variable per output.
    let k0 = min(kv0 + 0u, g.row4 - 1u);
    let d0 = min(co0 + 0u, g.channels - 1u) * g.out_plane;
    let d1 = min(co0 + 1u, g.channels - 1u) * g.out_plane;
    let d2 = min(co0 + 2u, g.channels - 1u) * g.out_plane;
    let d3 = min(co0 + 3u, g.channels - 1u) * g.out_plane;
    var e0_0 = gemm_weight_start(co0 + 0u, kv0 + 0u);
    var e1_0 = gemm_weight_start(co0 + 1u, kv0 + 0u);
    var e2_0 = gemm_weight_start(co0 + 2u, kv0 + 0u);
    var e3_0 = gemm_weight_start(co0 + 3u, kv0 + 0u);
    var n = g.pixel_begin / g.out_plane;
    var in_example = g.pixel_begin % g.out_plane;
    var dy_row = gemm_weight_dy_row(g.pixel_begin);
    for (var cols_row = 0u; cols_row < g.pixel_count * g.row4; cols_row += g.out_w * g.row4) {
        var s0_0 = vec4<f32>(0.0);
        var s1_0 = vec4<f32>(0.0);
        var s2_0 = vec4<f32>(0.0);
        var s3_0 = vec4<f32>(0.0);
        for (var ox = 0u; ox < g.out_w; ox++) {
            let cv0 = wg_cols[cols_row + ox * g.row4 + k0];
            let dv0 = wg_dy[dy_row + d0 + ox];
            s0_0 += dv0 * cv0;
            let dv1 = wg_dy[dy_row + d1 + ox];
            s1_0 += dv1 * cv0;
            let dv2 = wg_dy[dy_row + d2 + ox];
            s2_0 += dv2 * cv0;
            let dv3 = wg_dy[dy_row + d3 + ox];
            s3_0 += dv3 * cv0;
        }
        e0_0 += s0_0;
        e1_0 += s1_0;
        e2_0 += s2_0;
        e3_0 += s3_0;
        in_example += g.out_w;
        dy_row += g.out_w;
        if (in_example == g.out_plane) {
            gemm_weight_push(n, co0 + 0u, kv0 + 0u, e0_0); e0_0 = vec4<f32>(0.0);
            gemm_weight_push(n, co0 + 1u, kv0 + 0u, e1_0); e1_0 = vec4<f32>(0.0);
            gemm_weight_push(n, co0 + 2u, kv0 + 0u, e2_0); e2_0 = vec4<f32>(0.0);
            gemm_weight_push(n, co0 + 3u, kv0 + 0u, e3_0); e3_0 = vec4<f32>(0.0);
            n++;
            in_example = 0u;
            dy_row += (g.channels - 1u) * g.out_plane;
        }
    }
    gemm_weight_keep(co0 + 0u, kv0 + 0u, e0_0);
    gemm_weight_keep(co0 + 1u, kv0 + 0u, e1_0);
    gemm_weight_keep(co0 + 2u, kv0 + 0u, e2_0);
    gemm_weight_keep(co0 + 3u, kv0 + 0u, e3_0);
    // END TILE conv2d_gemm_weight_pixels
}

@compute @workgroup_size(GEMM_WG)
fn conv2d_gemm_weight_channels(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let origin = gemm_lanes_origin(lid, wid, nwg, false);
    if (origin.x == 0xffffffffu) { return; }
    let co0 = origin.x;
    let kv0 = origin.y / 4u;
    // BEGIN TILE conv2d_gemm_weight_channels: the body for GEMM_A × GEMM_B = 4 × 4, as gemm_tile in
    // src/kernels/conv2d.rs writes it for every tile: unrolled, with a variable per output.
    let k0 = min(kv0 + 0u, g.row4 - 1u);
    let d0 = min(co0 + 0u, g.channels - 1u) * g.out_plane;
    let d1 = min(co0 + 1u, g.channels - 1u) * g.out_plane;
    let d2 = min(co0 + 2u, g.channels - 1u) * g.out_plane;
    let d3 = min(co0 + 3u, g.channels - 1u) * g.out_plane;
    var e0_0 = gemm_weight_start(co0 + 0u, kv0 + 0u);
    var e1_0 = gemm_weight_start(co0 + 1u, kv0 + 0u);
    var e2_0 = gemm_weight_start(co0 + 2u, kv0 + 0u);
    var e3_0 = gemm_weight_start(co0 + 3u, kv0 + 0u);
    var n = g.pixel_begin / g.out_plane;
    var in_example = g.pixel_begin % g.out_plane;
    var dy_row = gemm_weight_dy_row(g.pixel_begin);
    for (var cols_row = 0u; cols_row < g.pixel_count * g.row4; cols_row += g.out_w * g.row4) {
        var s0_0 = vec4<f32>(0.0);
        var s1_0 = vec4<f32>(0.0);
        var s2_0 = vec4<f32>(0.0);
        var s3_0 = vec4<f32>(0.0);
        for (var ox = 0u; ox < g.out_w; ox++) {
            let cv0 = wg_cols[cols_row + ox * g.row4 + k0];
            let dv0 = wg_dy[dy_row + d0 + ox];
            s0_0 += dv0 * cv0;
            let dv1 = wg_dy[dy_row + d1 + ox];
            s1_0 += dv1 * cv0;
            let dv2 = wg_dy[dy_row + d2 + ox];
            s2_0 += dv2 * cv0;
            let dv3 = wg_dy[dy_row + d3 + ox];
            s3_0 += dv3 * cv0;
        }
        e0_0 += s0_0;
        e1_0 += s1_0;
        e2_0 += s2_0;
        e3_0 += s3_0;
        in_example += g.out_w;
        dy_row += g.out_w;
        if (in_example == g.out_plane) {
            gemm_weight_push(n, co0 + 0u, kv0 + 0u, e0_0); e0_0 = vec4<f32>(0.0);
            gemm_weight_push(n, co0 + 1u, kv0 + 0u, e1_0); e1_0 = vec4<f32>(0.0);
            gemm_weight_push(n, co0 + 2u, kv0 + 0u, e2_0); e2_0 = vec4<f32>(0.0);
            gemm_weight_push(n, co0 + 3u, kv0 + 0u, e3_0); e3_0 = vec4<f32>(0.0);
            n++;
            in_example = 0u;
            dy_row += (g.channels - 1u) * g.out_plane;
        }
    }
    gemm_weight_keep(co0 + 0u, kv0 + 0u, e0_0);
    gemm_weight_keep(co0 + 1u, kv0 + 0u, e1_0);
    gemm_weight_keep(co0 + 2u, kv0 + 0u, e2_0);
    gemm_weight_keep(co0 + 3u, kv0 + 0u, e3_0);
    // END TILE conv2d_gemm_weight_channels
}

// conv2d_gemm_weight_shared, for GPUs: 64 output channels × 16 vec4s of k per workgroup of 256
// invocations, 4 channels × 1 vec4 each; an output row's pixels staged 16 at a time in
// workgroup memory (8 KiB) between barriers.
var<workgroup> ws_cols: array<vec4<f32>, 256>;   // 16 pixels × 16 vec4s of k
var<workgroup> ws_dy: array<vec4<f32>, 256>;     // 16 pixels × 16 quads of channels

@compute @workgroup_size(256)
fn conv2d_gemm_weight_shared(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let kv_tiles = (g.row4 + 15u) / 16u;
    let f = wid.x + wid.y * nwg.x;
    let kv_base = (f % kv_tiles) * 16u;
    let co_base = (f / kv_tiles) * SHARED_EDGE;
    if (co_base >= g.channels) { return; }   // whole workgroups only: the barriers stay uniform
    // Summing: vec4 lid / 16 of k, channel quad lid mod 16. Staging: pixel lid / 16 of the 16,
    // vec4 (and channel quad) lid mod 16.
    let kv = kv_base + lid / 16u;
    let co = co_base + (lid % 16u) * 4u;
    let stage_kv = min(kv_base + lid % 16u, g.row4 - 1u);
    let stage_co = min(vec4<u32>(co) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(g.channels - 1u)) * g.out_plane;
    var e = array<vec4<f32>, 4>(gemm_weight_start(co, kv), gemm_weight_start(co + 1u, kv), gemm_weight_start(co + 2u, kv), gemm_weight_start(co + 3u, kv));
    for (var q = g.pixel_begin; q < g.pixel_begin + g.pixel_count; q += g.out_w) {
        let dy_row = gemm_weight_dy_row(q);
        let cols_row = (q - g.pixel_begin) * g.row4;
        var s: array<vec4<f32>, 4>;
        for (var x0 = 0u; x0 < g.out_w; x0 += 16u) {
            let ox = min(x0 + lid / 16u, g.out_w - 1u);
            ws_cols[lid] = wg_cols[cols_row + ox * g.row4 + stage_kv];
            let d = dy_row + ox + stage_co;
            ws_dy[lid] = vec4<f32>(wg_dy[d.x], wg_dy[d.y], wg_dy[d.z], wg_dy[d.w]);
            workgroupBarrier();
            for (var t = 0u; t < min(16u, g.out_w - x0); t++) {
                let c = ws_cols[t * 16u + lid / 16u];
                let dv = ws_dy[t * 16u + lid % 16u];
                s[0] += dv.x * c;
                s[1] += dv.y * c;
                s[2] += dv.z * c;
                s[3] += dv.w * c;
            }
            workgroupBarrier();
        }
        for (var i = 0u; i < 4u; i++) { e[i] += s[i]; }
        if ((q + g.out_w) % g.out_plane == 0u) {
            for (var i = 0u; i < 4u; i++) {
                gemm_weight_push(q / g.out_plane, co + i, kv, e[i]);
                e[i] = vec4<f32>(0.0);
            }
        }
    }
    for (var i = 0u; i < 4u; i++) { gemm_weight_keep(co + i, kv, e[i]); }
}

// The GEMM variants' last step: dw[co, k] = pairwise_total of the blocks wg_sums holds for
// (co, k) (read as floats: level 1 + l at (1 + l)·c_out·row4·4, then co·row4·4 + k).
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
        if (((p.n >> l) & 1u) == 1u) { blocks[l] = wt_sums[(l + 1u) * level + at]; }
    }
    wt_dw[i] = pairwise_total(&blocks, p.n);
}

// ---------------------------------------------------------------------------------------------
// Cropped kernels (Conv2dShape::crop in src/kernels/conv2d.rs): where some taps read padding for
// every output, the plain launchers run the convolution of the other taps. These copy the kept
// taps' weights out of the whole kernel, and write the kept taps' gradient back into the whole
// dw with +0 at the dropped taps (the sum every variant gives there).

@group(0) @binding(1) var<storage, read> crop_in: array<f32>;
@group(0) @binding(2) var<storage, read_write> crop_out: array<f32>;

// Tap (ty, tx) of the crop for the (co, ci) pair oc = co·c_in + ci: its index among the kept
// taps (x) and in the whole kernel (y).
fn crop_indices(oc: u32, ty: u32, tx: u32) -> vec2<u32> {
    return vec2<u32>((oc * p.crop_h + ty) * p.crop_w + tx, (oc * p.kh + p.crop_y + ty) * p.kw + p.crop_x + tx);
}

// An invocation copies the kept taps of CROP_RUN (co, ci) pairs WG apart: CPU drivers pay per
// workgroup, and a pair is a few loads (one per kept tap; layer4's 512×512 kernels are 262144
// pairs).
const CROP_RUN: u32 = 16u;

// The (co, ci) pair of run k of this invocation, or none (u32 max) past the last.
fn crop_pair(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, k: u32) -> u32 {
    let oc = (wid.x + wid.y * nwg.x) * WG * CROP_RUN + k * WG + lid;
    return select(0xffffffffu, oc, oc < p.c_out * p.c_in);
}

// The kept taps of this invocation's pairs, copied to the kept layout (crop) or back into the
// whole kernel (uncrop).
fn crop_walk(lid: u32, wid: vec3<u32>, nwg: vec3<u32>, uncrop: bool) {
    for (var k = 0u; k < CROP_RUN; k++) {
        let oc = crop_pair(wid, nwg, lid, k);
        if (oc == 0xffffffffu) { return; }
        for (var ty = 0u; ty < p.crop_h; ty++) {
            for (var tx = 0u; tx < p.crop_w; tx++) {
                let kept_whole = crop_indices(oc, ty, tx);
                let to_from = select(kept_whole, kept_whole.yx, uncrop);
                crop_out[to_from.x] = crop_in[to_from.y];
            }
        }
    }
}

@compute @workgroup_size(WG)
fn conv2d_crop_weights(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    crop_walk(lid, wid, nwg, false);
}

// The same walk the other way, into a dw the launcher cleared.
@compute @workgroup_size(WG)
fn conv2d_uncrop_weight_gradient(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    crop_walk(lid, wid, nwg, true);
}
