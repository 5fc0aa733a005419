// Winograd F(m×m, 3×3) for the 3×3 convolutions of stride 1 and padding 1: the forward, and the
// input-VJP, which is the same convolution of dy with the weights rotated 180° and transposed.
// Each m×m output tile (m = TILE_OUT) is Aᵀ [Σ_c (G g_c Gᵀ) ⊙ (Bᵀ d_c B)] A over the
// (m + 2)×(m + 2) input patches d_c around it (TILE_IN a side, PATCH positions): PATCH products
// per tile and channel where the plain sum takes 9·m². winograd_f2.wgsl and winograd_f4.wgsl,
// one of which comes first in the module, hold the matrices. The sum over channels is one GEMM
// per position ξ of the patch (the launcher runs conv2d's GEMMs on these rows), summed over c in
// increasing order; the three kernels here are the transforms around it.
//
// Every tile belongs to one example, so an example's outputs do not depend on the batch or on
// how the launcher splits it into chunks of images. The transforms' additions are written out
// in a fixed order. The result differs from the plain sum by rounding only (tests bound it).
//
// Layouts, each position ξ = TILE_IN·i + j a slab of its own, `slab_*` elements after the previous:
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
    // The weight gradient's GEMMs' K: an image's tiles, padded to a multiple of 4.
    tiles_k: u32,
}

@group(0) @binding(0) var<uniform> q: Winograd;

const WINOGRAD_WG: u32 = 64u;

fn winograd_index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * WINOGRAD_WG;
}

// The input of the chunk's images (x forward and for the weight gradient, dy for the input-VJP),
// [n][c_gemm][h][w]; the weight gradient's dy, [n][r_out][h][w].
@group(0) @binding(1) var<storage, read> map_in: array<f32>;
@group(0) @binding(2) var<storage, read_write> v: array<vec4<f32>>;

// Bᵀ d B of channels 4·c4 … 4·c4 + 3 of image n's patch around tile (ty, tx), its columns first.
fn input_patch(n: u32, ty: u32, tx: u32, c4: u32) -> array<vec4<f32>, PATCH> {
    let hw = q.h * q.w;
    var t: array<vec4<f32>, PATCH>;
    for (var b = 0u; b < TILE_IN; b++) {
        let x = i32(TILE_OUT * tx + b) - 1;
        var column: array<vec4<f32>, TILE_IN>;
        for (var a = 0u; a < TILE_IN; a++) {
            let y = i32(TILE_OUT * ty + a) - 1;
            let ok = y >= 0 && y < i32(q.h) && x >= 0 && x < i32(q.w);
            let base = (n * q.c_gemm + 4u * c4) * hw + select(0u, u32(y) * q.w + u32(x), ok);
            let e = vec4<f32>(map_in[base], map_in[base + hw], map_in[base + 2u * hw], map_in[base + 3u * hw]);
            column[a] = select(vec4<f32>(0.0), e, ok);
        }
        let bt = input_1d(column);
        for (var a = 0u; a < TILE_IN; a++) {
            t[TILE_IN * a + b] = bt[a];
        }
    }
    var transformed: array<vec4<f32>, PATCH>;
    for (var a = 0u; a < TILE_IN; a++) {
        var along: array<vec4<f32>, TILE_IN>;
        for (var b = 0u; b < TILE_IN; b++) {
            along[b] = t[TILE_IN * a + b];
        }
        let out = input_1d(along);
        for (var b = 0u; b < TILE_IN; b++) {
            transformed[TILE_IN * a + b] = out[b];
        }
    }
    return transformed;
}

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
    let transformed = input_patch(n, ty, tx, c4);
    let row = tile * c4s + c4;
    for (var xi = 0u; xi < PATCH; xi++) {
        v[xi * (q.slab_v / 4u) + row] = transformed[xi];
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

// One invocation per (r, 4 channels c): G g Gᵀ of the four kernels, its columns first.
@compute @workgroup_size(WINOGRAD_WG)
fn winograd_weights(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let c4s = q.c_gemm / 4u;
    let i = winograd_index(gid, nwg);
    if (i >= q.r_out * c4s) { return; }
    let c = 4u * (i % c4s);
    let r = i / c4s;
    var t: array<vec4<f32>, 3u * TILE_IN>;
    for (var b = 0u; b < 3u; b++) {
        var column: array<vec4<f32>, 3>;
        for (var a = 0u; a < 3u; a++) {
            column[a] = vec4<f32>(tap(r, c, a, b), tap(r, c + 1u, a, b), tap(r, c + 2u, a, b), tap(r, c + 3u, a, b));
        }
        let g = weights_1d(column);
        for (var a = 0u; a < TILE_IN; a++) {
            t[3u * a + b] = g[a];
        }
    }
    for (var a = 0u; a < TILE_IN; a++) {
        let out = weights_1d(array<vec4<f32>, 3>(t[3u * a], t[3u * a + 1u], t[3u * a + 2u]));
        for (var b = 0u; b < TILE_IN; b++) {
            u[(TILE_IN * a + b) * (q.slab_u / 4u) + i] = out[b];
        }
    }
}

@group(0) @binding(1) var<storage, read> m: array<f32>;
// The output of the chunk's images (y forward, dx for the input-VJP), [n][r_out][h][w].
@group(0) @binding(2) var<storage, read_write> map_out: array<f32>;

// One invocation per (image, channel r, tile): Aᵀ m A, its columns first, the outputs inside the
// map.
@compute @workgroup_size(WINOGRAD_WG)
fn winograd_output(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let plane = q.tiles_h * q.tiles_w;
    let i = winograd_index(gid, nwg);
    if (i >= q.images * q.r_out * plane) { return; }
    var t: array<f32, TILE_OUT * TILE_IN>;
    for (var b = 0u; b < TILE_IN; b++) {
        var column: array<f32, TILE_IN>;
        for (var a = 0u; a < TILE_IN; a++) {
            column[a] = m[(TILE_IN * a + b) * q.slab_m + i];
        }
        let at = output_1d(column);
        for (var a = 0u; a < TILE_OUT; a++) {
            t[TILE_IN * a + b] = at[a];
        }
    }
    let tx = i % q.tiles_w;
    let ty = (i / q.tiles_w) % q.tiles_h;
    let nr = i / plane; // n_local · r_out + r
    let base = (q.first_image * q.r_out + nr) * q.h * q.w;
    for (var a = 0u; a < TILE_OUT; a++) {
        var along: array<f32, TILE_IN>;
        for (var b = 0u; b < TILE_IN; b++) {
            along[b] = t[TILE_IN * a + b];
        }
        let out = output_1d(along);
        let y = TILE_OUT * ty + a;
        for (var b = 0u; b < TILE_OUT; b++) {
            let x = TILE_OUT * tx + b;
            if (y < q.h && x < q.w) {
                map_out[base + y * q.w + x] = out[b];
            }
        }
    }
}

// The weight gradient, per example: dg = Gᵀ [Σ_tiles (A dy A^T) ⊙ (Bᵀ d B)] G, the forward's
// transforms differentiated. The sum over an example's tiles is one GEMM per position, its K the
// example's tiles padded with zeros to tiles_k (a multiple of 4), so these layouts put the tiles
// contiguous:
//   vt[ξ][n][c][t]  the transformed input (winograd_input's, transposed), c over c_gemm = c_in;
//   dt[ξ][n][r][t]  the transformed dy, r over r_out = c_out;
//   m[ξ][n][r][c]   the GEMMs' output; each example's gradient then goes to
//   units[n][r][9·c + 3·a + b], in dw's layout, for conv2d_backward_weight_units to sum pairwise.
@group(0) @binding(2) var<storage, read_write> tiles_out: array<f32>;

// Where position ξ, channel `ch` of `channels`, tile t of image n (in the chunk) goes in vt or dt.
fn tiles_at(xi: u32, n: u32, ch: u32, channels: u32, t: u32) -> u32 {
    return ((xi * q.images + n) * channels + ch) * q.tiles_k + t;
}

// One invocation per (image, tile t < tiles_k, 4 channels): vt, zeros past the image's tiles.
@compute @workgroup_size(WINOGRAD_WG)
fn winograd_input_tiles(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let c4s = q.c_gemm / 4u;
    let i = winograd_index(gid, nwg);
    if (i >= q.images * q.tiles_k * c4s) { return; }
    let c4 = i % c4s;
    let t = (i / c4s) % q.tiles_k;
    let n = i / (c4s * q.tiles_k);
    var transformed: array<vec4<f32>, PATCH>;
    if (t < q.tiles_h * q.tiles_w) {
        transformed = input_patch(q.first_image + n, t / q.tiles_w, t % q.tiles_w, c4);
    }
    for (var xi = 0u; xi < PATCH; xi++) {
        for (var k = 0u; k < 4u; k++) {
            tiles_out[tiles_at(xi, n, 4u * c4 + k, q.c_gemm, t)] = transformed[xi][k];
        }
    }
}

// One invocation per (image, tile t < tiles_k, 4 channels r): dt = A dy Aᵀ of the tile, its
// columns first, zeros outside the map and past the image's tiles.
@compute @workgroup_size(WINOGRAD_WG)
fn winograd_dy_tiles(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let r4s = q.r_out / 4u;
    let i = winograd_index(gid, nwg);
    if (i >= q.images * q.tiles_k * r4s) { return; }
    let r4 = i % r4s;
    let t = (i / r4s) % q.tiles_k;
    let n = i / (r4s * q.tiles_k);
    let ty = t / q.tiles_w;
    let tx = t % q.tiles_w;
    let inside = t < q.tiles_h * q.tiles_w;
    let hw = q.h * q.w;
    var z: array<vec4<f32>, TILE_IN * TILE_OUT>;
    for (var b = 0u; b < TILE_OUT; b++) {
        let x = TILE_OUT * tx + b;
        var column: array<vec4<f32>, TILE_OUT>;
        for (var a = 0u; a < TILE_OUT; a++) {
            let y = TILE_OUT * ty + a;
            let ok = inside && y < q.h && x < q.w;
            let base = ((q.first_image + n) * q.r_out + 4u * r4) * hw + select(0u, y * q.w + x, ok);
            let e = vec4<f32>(map_in[base], map_in[base + hw], map_in[base + 2u * hw], map_in[base + 3u * hw]);
            column[a] = select(vec4<f32>(0.0), e, ok);
        }
        let at = grad_output_1d(column);
        for (var a = 0u; a < TILE_IN; a++) {
            z[TILE_OUT * a + b] = at[a];
        }
    }
    for (var a = 0u; a < TILE_IN; a++) {
        var along: array<vec4<f32>, TILE_OUT>;
        for (var b = 0u; b < TILE_OUT; b++) {
            along[b] = z[TILE_OUT * a + b];
        }
        let out = grad_output_1d(along);
        for (var b = 0u; b < TILE_IN; b++) {
            for (var k = 0u; k < 4u; k++) {
                tiles_out[tiles_at(TILE_IN * a + b, n, 4u * r4 + k, q.r_out, t)] = out[b][k];
            }
        }
    }
}

@group(0) @binding(2) var<storage, read_write> units: array<f32>;

// One invocation per (image, r, c): Gᵀ m G of the example's products, its columns first, into its
// unit.
@compute @workgroup_size(WINOGRAD_WG)
fn winograd_weight_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = winograd_index(gid, nwg);
    let per_image = q.r_out * q.c_gemm;
    if (i >= q.images * per_image) { return; }
    var t: array<f32, 3u * TILE_IN>;
    for (var b = 0u; b < TILE_IN; b++) {
        var column: array<f32, TILE_IN>;
        for (var a = 0u; a < TILE_IN; a++) {
            column[a] = m[(TILE_IN * a + b) * q.slab_m + i];
        }
        let g = grad_weights_1d(column);
        for (var a = 0u; a < 3u; a++) {
            t[TILE_IN * a + b] = g[a];
        }
    }
    // i = (n·r_out + r)·c_gemm + c: its 9 taps are 9·i on.
    for (var a = 0u; a < 3u; a++) {
        var along: array<f32, TILE_IN>;
        for (var b = 0u; b < TILE_IN; b++) {
            along[b] = t[TILE_IN * a + b];
        }
        let out = grad_weights_1d(along);
        for (var b = 0u; b < 3u; b++) {
            units[9u * i + 3u * a + b] = out[b];
        }
    }
}
