// Winograd F(2×2, 3×3) for the 3×3 convolutions of stride 1 and padding 1: the forward, and the
// input-VJP, which is the same convolution of dy with the weights rotated 180° and transposed.
// Each 2×2 output tile is Aᵀ [Σ_c (G g_c Gᵀ) ⊙ (Bᵀ d_c B)] A over the 4×4 input patches d_c
// around it: 16 products per tile and channel where the plain sum takes 36. The sum over
// channels is one GEMM per position ξ of the 4×4 (the launcher runs conv2d's GEMMs on these
// rows), summed over c in increasing order; the three kernels here are the transforms around it.
//
// Every tile belongs to one example, so an example's outputs do not depend on the batch or on
// how the launcher splits it into chunks of images. The transforms' additions are written out
// in a fixed order. The result differs from the plain sum by rounding only (tests bound it).
//
// Layouts, each position ξ = 4·i + j a slab of its own, `slab_*` elements after the previous:
//   v[ξ][tile][c]  the transformed input, c contiguous: the GEMM's im2col rows (c_gemm/4 vec4s);
//   u[ξ][r][c]     the transformed weights, c contiguous: the GEMM's weight rows;
//   m[ξ][n][r][tile] the GEMM's output as it writes it (NCHW over the grid of tiles).
// tile = (n·tiles_h + ty)·tiles_w + tx over the chunk's images; c runs over the GEMM's K (the
// input's channels), r over the output's channels.

struct Winograd {
    // The chunk's images, and the first one's index in the whole batch.
    images: u32,
    first_image: u32,
    // K: channels of the map transformed (c_in forward, c_out for the input-VJP), a multiple of 4.
    c_gemm: u32,
    // Channels of the result (c_out forward, c_in for the input-VJP).
    r_out: u32,
    // The map's size, the same in and out (stride 1, padding 1).
    h: u32,
    w: u32,
    tiles_h: u32,
    tiles_w: u32,
    // Elements between consecutive positions' slabs of v, u and m.
    slab_v: u32,
    slab_u: u32,
    slab_m: u32,
    // 0: the forward's weights, g = w[r][c]; 1: the input-VJP's, g = w[c][r] rotated 180°.
    rotate: u32,
}

@group(0) @binding(0) var<uniform> q: Winograd;

const WINOGRAD_WG: u32 = 64u;

fn winograd_index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * WINOGRAD_WG;
}

// Bᵀ d B of four channels at once: d[4·i + j] is row i, column j of the patch.
fn input_transform(d: array<vec4<f32>, 16>) -> array<vec4<f32>, 16> {
    var t: array<vec4<f32>, 16>;
    for (var j = 0u; j < 4u; j++) {
        t[j] = d[j] - d[8u + j];
        t[4u + j] = d[4u + j] + d[8u + j];
        t[8u + j] = d[8u + j] - d[4u + j];
        t[12u + j] = d[4u + j] - d[12u + j];
    }
    var v: array<vec4<f32>, 16>;
    for (var i = 0u; i < 16u; i += 4u) {
        v[i] = t[i] - t[i + 2u];
        v[i + 1u] = t[i + 1u] + t[i + 2u];
        v[i + 2u] = t[i + 2u] - t[i + 1u];
        v[i + 3u] = t[i + 1u] - t[i + 3u];
    }
    return v;
}

// The input of the chunk's images (x forward, dy for the input-VJP), [n][c_gemm][h][w].
@group(0) @binding(1) var<storage, read> map_in: array<f32>;
@group(0) @binding(2) var<storage, read_write> v: array<vec4<f32>>;

// One invocation per (tile, 4 channels).
@compute @workgroup_size(WINOGRAD_WG)
fn winograd_input(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let c4s = q.c_gemm / 4u;
    let tiles = q.images * q.tiles_h * q.tiles_w;
    let i = winograd_index(gid, nwg);
    if (i >= tiles * c4s) { return; }
    let c4 = i % c4s;
    let tile = i / c4s;
    let tx = tile % q.tiles_w;
    let ty = (tile / q.tiles_w) % q.tiles_h;
    let n = q.first_image + tile / (q.tiles_w * q.tiles_h);
    var d: array<vec4<f32>, 16>;
    for (var a = 0u; a < 4u; a++) {
        let y = i32(2u * ty + a) - 1;
        for (var b = 0u; b < 4u; b++) {
            let x = i32(2u * tx + b) - 1;
            let ok = y >= 0 && y < i32(q.h) && x >= 0 && x < i32(q.w);
            let plane = select(0u, u32(y) * q.w + u32(x), ok);
            let base = (n * q.c_gemm + 4u * c4) * q.h * q.w + plane;
            let hw = q.h * q.w;
            let e = vec4<f32>(map_in[base], map_in[base + hw], map_in[base + 2u * hw], map_in[base + 3u * hw]);
            d[4u * a + b] = select(vec4<f32>(0.0), e, ok);
        }
    }
    let t = input_transform(d);
    let row = tile * c4s + c4;
    for (var xi = 0u; xi < 16u; xi++) {
        v[xi * (q.slab_v / 4u) + row] = t[xi];
    }
}

@group(0) @binding(1) var<storage, read> weights: array<f32>;
@group(0) @binding(2) var<storage, read_write> u: array<vec4<f32>>;

// g[3·a + b] of the weight that links output channel r to input channel c of the GEMM.
fn tap(r: u32, c: u32, a: u32, b: u32) -> f32 {
    if (q.rotate == 0u) {
        return weights[((r * q.c_gemm + c) * 3u + a) * 3u + b];
    }
    return weights[((c * q.r_out + r) * 3u + 2u - a) * 3u + 2u - b];
}

// One invocation per (r, 4 channels c): G g Gᵀ of the four kernels.
@compute @workgroup_size(WINOGRAD_WG)
fn winograd_weights(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let c4s = q.c_gemm / 4u;
    let i = winograd_index(gid, nwg);
    if (i >= q.r_out * c4s) { return; }
    let c = 4u * (i % c4s);
    let r = i / c4s;
    var g: array<vec4<f32>, 9>;
    for (var k = 0u; k < 9u; k++) {
        let a = k / 3u;
        let b = k % 3u;
        g[k] = vec4<f32>(tap(r, c, a, b), tap(r, c + 1u, a, b), tap(r, c + 2u, a, b), tap(r, c + 3u, a, b));
    }
    // G g: rows g0, (g0 + g1 + g2)/2, (g0 − g1 + g2)/2, g2.
    var t: array<vec4<f32>, 12>;
    for (var b = 0u; b < 3u; b++) {
        t[b] = g[b];
        t[3u + b] = 0.5 * (g[b] + g[3u + b] + g[6u + b]);
        t[6u + b] = 0.5 * (g[b] - g[3u + b] + g[6u + b]);
        t[9u + b] = g[6u + b];
    }
    // (G g) Gᵀ, the same on the columns.
    for (var a = 0u; a < 4u; a++) {
        let s = 3u * a;
        let row = (4u * a) * (q.slab_u / 4u) + i;
        u[row] = t[s];
        u[row + q.slab_u / 4u] = 0.5 * (t[s] + t[s + 1u] + t[s + 2u]);
        u[row + 2u * (q.slab_u / 4u)] = 0.5 * (t[s] - t[s + 1u] + t[s + 2u]);
        u[row + 3u * (q.slab_u / 4u)] = t[s + 2u];
    }
}

@group(0) @binding(1) var<storage, read> m: array<f32>;
// The output of the chunk's images (y forward, dx for the input-VJP), [n][r_out][h][w].
@group(0) @binding(2) var<storage, read_write> map_out: array<f32>;

// One invocation per (image, channel r, tile): Aᵀ m A, the 2×2 outputs inside the map.
@compute @workgroup_size(WINOGRAD_WG)
fn winograd_output(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let plane = q.tiles_h * q.tiles_w;
    let i = winograd_index(gid, nwg);
    if (i >= q.images * q.r_out * plane) { return; }
    var e: array<f32, 16>;
    for (var xi = 0u; xi < 16u; xi++) {
        e[xi] = m[xi * q.slab_m + i];
    }
    // Aᵀ e: rows e0 + e1 + e2 and e1 − e2 − e3 (of 4-element rows), then the same on columns.
    var t: array<f32, 8>;
    for (var j = 0u; j < 4u; j++) {
        t[j] = e[j] + e[4u + j] + e[8u + j];
        t[4u + j] = e[4u + j] - e[8u + j] - e[12u + j];
    }
    let tx = i % q.tiles_w;
    let ty = (i / q.tiles_w) % q.tiles_h;
    let nr = i / plane; // n_local · r_out + r
    let base = (q.first_image * q.r_out + nr) * q.h * q.w;
    for (var a = 0u; a < 2u; a++) {
        let y = 2u * ty + a;
        let s = 4u * a;
        let out = array<f32, 2>(t[s] + t[s + 1u] + t[s + 2u], t[s + 1u] - t[s + 2u] - t[s + 3u]);
        for (var b = 0u; b < 2u; b++) {
            let x = 2u * tx + b;
            if (y < q.h && x < q.w) {
                map_out[base + y * q.w + x] = out[b];
            }
        }
    }
}
