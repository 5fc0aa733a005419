// ---------------------------------------------------------------------------------------------
// Weight gradient: dw[co,ci,ky,kx] = Σ_n Σ_oy (Σ_ox dy[n,co,oy,ox] · x[n,ci,oy·s−p+ky,ox·s−p+kx])
//
// - backward_weight sums over n, oy, ox. Each output row is summed on its own and then folded
//   into its example's total, which keeps f32 rounding low at large spatial sizes. Examples'
//   totals are summed pairwise (common/pairwise.wgsl).

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
    let examples = pairwise_count(p.n, nwg);
    for (var n = 0u; n < examples; n++) {
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
    wd_dw[i] = pairwise_total(&blocks, examples);
}

// Tile: output channels co0..co0+15 × input channels ci0..ci0+3, one tap (ky, kx) after the
// other, each in the direct kernel's summation order (four x loads serve 64 products). Rows and
// columns of output pixels whose window puts the tap on padding only add +0 (see common.wgsl), so
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
    let examples = pairwise_count(p.n, nwg);
    for (var tap = 0u; tap < khw; tap++) {
        let ky = tap / p.kw;
        let kx = tap % p.kw;
        let rows = outputs_inside(ky, p.h, p.out_h);
        let cols = outputs_inside(kx, p.w, p.out_w);
        var blocks_a: array<mat4x4<f32>, PAIRWISE_LEVELS>;
        var blocks_b: array<mat4x4<f32>, PAIRWISE_LEVELS>;
        var blocks_c: array<mat4x4<f32>, PAIRWISE_LEVELS>;
        var blocks_d: array<mat4x4<f32>, PAIRWISE_LEVELS>;
        for (var n = 0u; n < examples; n++) {
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
            wb_push(&blocks_a, n, examples, ea);
            wb_push(&blocks_b, n, examples, eb);
            wb_push(&blocks_c, n, examples, ec);
            wb_push(&blocks_d, n, examples, ed);
        }
        if (live) {
            // dw[co, ci, ky, kx]: whole groups of 4 output channels as 16 plain stores each (on
            // Mesa 22 a loop over a matrix indexed by variables is slower), ragged ones element
            // by element.
            let at = ((co0 * p.c_in + ci0) * p.dw_kh + p.crop_y + ky) * p.dw_kw + p.crop_x + kx;
            let co_step = p.c_in * p.dw_kh * p.dw_kw;
            wb_store(at, co_step, co0, ci0, wb_total(&blocks_a, examples));
            wb_store(at + 4u * co_step, co_step, co0 + 4u, ci0, wb_total(&blocks_b, examples));
            wb_store(at + 8u * co_step, co_step, co0 + 8u, ci0, wb_total(&blocks_c, examples));
            wb_store(at + 12u * co_step, co_step, co0 + 12u, ci0, wb_total(&blocks_d, examples));
        }
    }
}

// Whether the examples' pairwise sums close at the last (pairwise_push_or_close4): set by the
// launcher where that saves a level of the stack.
const WB_CLOSE: bool = false;

fn wb_push(blocks: ptr<function, array<mat4x4<f32>, PAIRWISE_LEVELS>>, n: u32, count: u32, e: mat4x4<f32>) {
    if (WB_CLOSE) { pairwise_push_or_close4(blocks, n, count, e); } else { pairwise_push4(blocks, n, e); }
}

fn wb_total(blocks: ptr<function, array<mat4x4<f32>, PAIRWISE_LEVELS>>, count: u32) -> mat4x4<f32> {
    if (WB_CLOSE) { return (*blocks)[0]; }
    return pairwise_total4(blocks, count);
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
