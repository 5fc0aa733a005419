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

// Tile: output channels co0..co0+WB_CO−1 × input channels ci0..ci0+3, one tap (ky, kx) after
// the other, each in the direct kernel's summation order (four x loads serve 4·WB_CO products).
// Rows and columns of output pixels whose window puts the tap on padding only add +0 (see
// common.wgsl), so the loops skip them: on ResNet-34's 2×2 maps a 3×3 kernel's taps read the
// input at 16 of 36 (pixel, tap) pairs. Every invocation is at the same tap at the same time, so
// those loop bounds are the same across invocations; and an invocation writes whole kernels
// (kh·kw consecutive weights), not one weight per cache line. The sums of 4 output channels are
// the columns of one matrix, a group: a holds channels co0..co0+3, b +4..+7, and so on. The
// launcher writes each `// EACH` line out once per group (blocked_weight_shader), @ the group's
// letter and # its first channel's offset, and sets WB_CO, 4 per group.
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
// of 8 or more, the launcher compiles the dy reads between BEGIN DY and END DY as one load per
// invocation for every 8 output channels, each of a different channel, and subgroupBroadcast to
// the others (on lavapipe a storage load is a loop over the SIMD lanes, a broadcast one
// instruction).
const WB_LANES: u32 = 16u;
override WB_CO: u32 = 16u;

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
    // EACH let co_@ = min(vec4<u32>(co0 + #u) + lanes, last);
    let hw = p.h * p.w;
    let ohw = p.out_h * p.out_w;
    let khw = p.kh * p.kw;
    let examples = pairwise_count(p.n, nwg);
    for (var tap = 0u; tap < khw; tap++) {
        let ky = tap / p.kw;
        let kx = tap % p.kw;
        let rows = outputs_inside(ky, p.h, p.out_h);
        let cols = outputs_inside(kx, p.w, p.out_w);
        // EACH var blocks_@: array<mat4x4<f32>, PAIRWISE_LEVELS>;
        for (var n = 0u; n < examples; n++) {
            // EACH var e@ = mat4x4<f32>();
            let x_n = (vec4<u32>(n * p.c_in) + ci) * hw;
            let dy_n = n * p.c_out * ohw;
            for (var oy = rows.x; oy < rows.y; oy++) {
                let iy = oy * p.stride + ky - p.pad;
                // EACH var r@ = mat4x4<f32>();
                for (var ox = cols.x; ox < cols.y; ox++) {
                    let xi = x_n + vec4<u32>(iy * p.w + ox * p.stride + kx - p.pad);
                    let xv = vec4<f32>(wb_x[xi.x], wb_x[xi.y], wb_x[xi.z], wb_x[xi.w]);
                    let pix = dy_n + oy * p.out_w + ox;
                    // BEGIN DY conv2d_backward_weight_blocked
                    // EACH let d@ = wb_dy4(co_@ * ohw + vec4<u32>(pix));
                    // END DY conv2d_backward_weight_blocked
                    // EACH r@[0] += d@.x * xv; r@[1] += d@.y * xv; r@[2] += d@.z * xv; r@[3] += d@.w * xv;
                }
                // EACH e@ += r@;
            }
            // EACH wb_push(&blocks_@, n, examples, e@);
        }
        if (live) {
            // dw[co, ci, ky, kx]: whole groups of 4 output channels as 16 plain stores each (on
            // Mesa 22 a loop over a matrix indexed by variables is slower), ragged ones element
            // by element.
            let at = ((co0 * p.c_in + ci0) * p.dw_kh + p.crop_y + ky) * p.dw_kw + p.crop_x + kx;
            let co_step = p.c_in * p.dw_kh * p.dw_kw;
            // EACH wb_store(at + #u * co_step, co_step, co0 + #u, ci0, wb_total(&blocks_@, examples));
        }
    }
}

// Whether the examples' pairwise sums close at the last (pairwise_push_or_close4): set by the
// launcher where that saves a level of the stack.
override WB_CLOSE: bool = false;

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
