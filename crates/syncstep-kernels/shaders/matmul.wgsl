// Matrix product C = A·B, row-major: A [m, k], B [k, n], C [m, n] (overwritten). The roofline
// probe: the fastest plain f32 GEMM the project has, timed beside the convolutions on the same
// adapter so that their speed reads as a fraction of what the adapter can do.
//
// What is subtle:
// - Each element of C is summed over k in increasing order by one invocation (a single writer), the
//   same bits every run.
// - matmul_simple: one element per invocation, any sizes. matmul_tiled: TILE_M rows × 4·TILE_N4
//   columns per invocation, in registers, no workgroup memory (barriers are slow on CPU drivers
//   such as lavapipe). A is read as vec4 along k and B as vec4 along n, so k and n must be
//   multiples of 4. A workgroup's invocations share their rows (taken from the workgroup id), so
//   they read the same A. A tile past the edge of C clamps its reads and skips its writes.
// - The launcher compiles one module per tile, setting TILE_M, TILE_N4 and TILE_BROADCAST
//   (override constants) and writing the body between BEGIN TILE and END TILE (see matmul_tile
//   in src/kernels/matmul.rs); the launcher also
//   guarantees that m·k, k·n and m·n are below 2^31.

struct Params {
    m: u32,
    k: u32,
    n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 64u;

@group(0) @binding(1) var<storage, read> ms_a: array<f32>;
@group(0) @binding(2) var<storage, read> ms_b: array<f32>;
@group(0) @binding(3) var<storage, read_write> ms_c: array<f32>;

@compute @workgroup_size(WG)
fn matmul_simple(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i >= p.m * p.n) { return; }
    let row = i / p.n;
    let col = i % p.n;
    var acc = 0.0;
    for (var k = 0u; k < p.k; k++) {
        acc += ms_a[row * p.k + k] * ms_b[k * p.n + col];
    }
    ms_c[i] = acc;
}

override TILE_M: u32 = 4u;
override TILE_N4: u32 = 2u;
// Whether the tile broadcasts A's rows across a subgroup (set by the launcher with the body).
override TILE_BROADCAST: bool = false;

@group(0) @binding(1) var<storage, read> mt_a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> mt_b: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> mt_c: array<vec4<f32>>;

fn matmul_tiled_store(row: u32, col4: u32, sum: vec4<f32>) {
    if (row < p.m && col4 < p.n / 4u) { mt_c[row * (p.n / 4u) + col4] = sum; }
}

@compute @workgroup_size(WG)
fn matmul_tiled(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let n4 = p.n / 4u;
    let k4 = p.k / 4u;
    let col_groups = (n4 + WG * TILE_N4 - 1u) / (WG * TILE_N4);
    let f = wid.x + wid.y * nwg.x;
    let r0 = (f / col_groups) * TILE_M;
    let c0 = ((f % col_groups) * WG + lid) * TILE_N4;
    // Past C's last columns an invocation clamps its reads and skips its writes, but stays when
    // the tile broadcasts, for every invocation of a subgroup to take part.
    if (r0 >= p.m || (c0 >= n4 && !TILE_BROADCAST)) { return; }
    // BEGIN TILE: 4 rows × 2 vec4s, as matmul_tile in syncstep-kernels' matmul.rs writes it.
    let a0 = min(r0 + 0u, p.m - 1u) * k4;
    let a1 = min(r0 + 1u, p.m - 1u) * k4;
    let a2 = min(r0 + 2u, p.m - 1u) * k4;
    let a3 = min(r0 + 3u, p.m - 1u) * k4;
    let col0 = min(c0 + 0u, n4 - 1u);
    let col1 = min(c0 + 1u, n4 - 1u);
    var s0_0 = vec4<f32>(0.0); var s0_1 = vec4<f32>(0.0);
    var s1_0 = vec4<f32>(0.0); var s1_1 = vec4<f32>(0.0);
    var s2_0 = vec4<f32>(0.0); var s2_1 = vec4<f32>(0.0);
    var s3_0 = vec4<f32>(0.0); var s3_1 = vec4<f32>(0.0);
    for (var kk = 0u; kk < k4; kk++) {
        let b_row = 4u * kk * n4;
        let b0 = array<vec4<f32>, 4>(mt_b[b_row + col0], mt_b[b_row + n4 + col0], mt_b[b_row + 2u * n4 + col0], mt_b[b_row + 3u * n4 + col0]);
        let b1 = array<vec4<f32>, 4>(mt_b[b_row + col1], mt_b[b_row + n4 + col1], mt_b[b_row + 2u * n4 + col1], mt_b[b_row + 3u * n4 + col1]);
        let av0 = mt_a[a0 + kk];
        s0_0 += av0.x * b0[0]; s0_0 += av0.y * b0[1]; s0_0 += av0.z * b0[2]; s0_0 += av0.w * b0[3];
        s0_1 += av0.x * b1[0]; s0_1 += av0.y * b1[1]; s0_1 += av0.z * b1[2]; s0_1 += av0.w * b1[3];
        let av1 = mt_a[a1 + kk];
        s1_0 += av1.x * b0[0]; s1_0 += av1.y * b0[1]; s1_0 += av1.z * b0[2]; s1_0 += av1.w * b0[3];
        s1_1 += av1.x * b1[0]; s1_1 += av1.y * b1[1]; s1_1 += av1.z * b1[2]; s1_1 += av1.w * b1[3];
        let av2 = mt_a[a2 + kk];
        s2_0 += av2.x * b0[0]; s2_0 += av2.y * b0[1]; s2_0 += av2.z * b0[2]; s2_0 += av2.w * b0[3];
        s2_1 += av2.x * b1[0]; s2_1 += av2.y * b1[1]; s2_1 += av2.z * b1[2]; s2_1 += av2.w * b1[3];
        let av3 = mt_a[a3 + kk];
        s3_0 += av3.x * b0[0]; s3_0 += av3.y * b0[1]; s3_0 += av3.z * b0[2]; s3_0 += av3.w * b0[3];
        s3_1 += av3.x * b1[0]; s3_1 += av3.y * b1[1]; s3_1 += av3.z * b1[2]; s3_1 += av3.w * b1[3];
    }
    matmul_tiled_store(r0 + 0u, c0 + 0u, s0_0); matmul_tiled_store(r0 + 0u, c0 + 1u, s0_1);
    matmul_tiled_store(r0 + 1u, c0 + 0u, s1_0); matmul_tiled_store(r0 + 1u, c0 + 1u, s1_1);
    matmul_tiled_store(r0 + 2u, c0 + 0u, s2_0); matmul_tiled_store(r0 + 2u, c0 + 1u, s2_1);
    matmul_tiled_store(r0 + 3u, c0 + 0u, s3_0); matmul_tiled_store(r0 + 3u, c0 + 1u, s3_1);
    // END TILE
}
