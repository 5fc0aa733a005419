// Conv2d without bias: NCHW activations, OIHW weights. Forward, input-VJP, weight gradient.
//
// What is subtle:
// - Every output element is written by exactly one invocation, which sums in a fixed order.
//   No atomics and no += across dispatches: the same launch is bitwise reproducible, and
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
//   tile per invocation (4 channels × 4 pixels, or 4 output channels × 4 weights), no
//   workgroup memory (barriers are slow on CPU drivers such as lavapipe). Tiles are flattened
//   over the batch too, so 2×2 and 1×1 feature maps fill them. At a ragged edge a tile's
//   indices are clamped for the loads and the extra lanes skipped at the write.
// - The launcher guarantees every element count, and the padded input plane, is below 2^31.

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
fn pairwise_push(blocks: ptr<function, array<f32, 32>>, n: u32, total: f32) {
    var v = total;
    var l = 0u;
    for (; ((n >> l) & 1u) == 1u; l++) {
        v = (*blocks)[l] + v;
    }
    (*blocks)[l] = v;
}

fn pairwise_total(blocks: ptr<function, array<f32, 32>>, n: u32) -> f32 {
    var sum = 0.0;
    var first = true;
    for (var l = 0u; l < 32u; l++) {
        if (((n >> l) & 1u) == 1u) {
            if (first) { sum = (*blocks)[l]; } else { sum = (*blocks)[l] + sum; }
            first = false;
        }
    }
    return sum;
}

// The same for a 4×4 tile of sums.
fn pairwise_push4(blocks: ptr<function, array<mat4x4<f32>, 32>>, n: u32, total: mat4x4<f32>) {
    var v = total;
    var l = 0u;
    for (; ((n >> l) & 1u) == 1u; l++) {
        v = (*blocks)[l] + v;
    }
    (*blocks)[l] = v;
}

fn pairwise_total4(blocks: ptr<function, array<mat4x4<f32>, 32>>, n: u32) -> mat4x4<f32> {
    var sum = mat4x4<f32>();
    var first = true;
    for (var l = 0u; l < 32u; l++) {
        if (((n >> l) & 1u) == 1u) {
            if (first) { sum = (*blocks)[l]; } else { sum = (*blocks)[l] + sum; }
            first = false;
        }
    }
    return sum;
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
    var blocks: array<f32, 32>;
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

// Tile: output channels co0..co0+3 × four consecutive weights r0..r0+3 of the flattened
// (ci, ky, kx) axis, in the same summation order as the direct kernel.
@group(0) @binding(1) var<storage, read> wb_dy: array<f32>;
@group(0) @binding(2) var<storage, read> wb_x: array<f32>;
@group(0) @binding(3) var<storage, read_write> wb_dw: array<f32>;

fn wb_load_x(idx: vec4<i32>, ok: vec4<bool>) -> vec4<f32> {
    let s = vec4<u32>(select(vec4<i32>(0), idx, ok));
    return select(vec4<f32>(0.0), vec4<f32>(wb_x[s.x], wb_x[s.y], wb_x[s.z], wb_x[s.w]), ok);
}

@compute @workgroup_size(WG)
fn conv2d_backward_weight_blocked(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = linear_index(gid, nwg);
    let khw = p.kh * p.kw;
    let k_len = p.c_in * khw;
    let k_tiles = (k_len + 3u) / 4u;
    if (t >= k_tiles * ((p.c_out + 3u) / 4u)) { return; }
    let co0 = (t / k_tiles) * 4u;
    let r0 = (t % k_tiles) * 4u;
    let r = min(vec4<u32>(r0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(k_len - 1u));
    let ky = vec4<i32>((r % khw) / p.kw) - i32(p.pad);
    let kx = vec4<i32>(r % p.kw) - i32(p.pad);
    let hw = i32(p.h * p.w);
    // Offset in x of each weight's tap for output (0, 0) of image 0 (may be negative).
    let tap = vec4<i32>(r / khw) * hw + ky * i32(p.w) + kx;
    let ohw = p.out_h * p.out_w;
    let dyrow = min(vec4<u32>(co0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(p.c_out - 1u)) * ohw;
    var blocks: array<mat4x4<f32>, 32>;
    for (var n = 0u; n < p.n; n++) {
        var acc0 = vec4<f32>(0.0);
        var acc1 = vec4<f32>(0.0);
        var acc2 = vec4<f32>(0.0);
        var acc3 = vec4<f32>(0.0);
        let dy_n = n * p.c_out * ohw;
        let x_n = i32(n * p.c_in) * hw;
        for (var oy = 0u; oy < p.out_h; oy++) {
            let iy = ky + i32(oy * p.stride);
            let row_ok = inside4(iy, p.h);
            var row0 = vec4<f32>(0.0);
            var row1 = vec4<f32>(0.0);
            var row2 = vec4<f32>(0.0);
            var row3 = vec4<f32>(0.0);
            for (var ox = 0u; ox < p.out_w; ox++) {
                let ix = kx + i32(ox * p.stride);
                let idx = tap + (x_n + i32(oy * p.stride * p.w + ox * p.stride));
                let xv = wb_load_x(idx, row_ok & inside4(ix, p.w));
                let o = dy_n + oy * p.out_w + ox;
                row0 += wb_dy[dyrow.x + o] * xv;
                row1 += wb_dy[dyrow.y + o] * xv;
                row2 += wb_dy[dyrow.z + o] * xv;
                row3 += wb_dy[dyrow.w + o] * xv;
            }
            acc0 += row0;
            acc1 += row1;
            acc2 += row2;
            acc3 += row3;
        }
        pairwise_push4(&blocks, n, mat4x4<f32>(acc0, acc1, acc2, acc3));
    }
    let acc = pairwise_total4(&blocks, p.n);
    for (var i = 0u; i < 4u && co0 + i < p.c_out; i++) {
        for (var j = 0u; j < 4u && r0 + j < k_len; j++) {
            wb_dw[(co0 + i) * k_len + r0 + j] = acc[i][j];
        }
    }
}
