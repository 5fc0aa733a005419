// ---------------------------------------------------------------------------------------------
// The GEMMs with register tiles (for CPU drivers, where barriers are slow): one module per
// tile shape. The launcher (src/kernels/conv2d/tiles.rs) sets GEMM_A, GEMM_B and
// GEMM_BROADCAST (override constants) and writes each kernel's body, unrolled with a variable
// per output, in place of its `// TILE` line.

// conv2d_gemm_lanes: each invocation GEMM_A rows of a; the workgroup's invocations share
// GEMM_B rows of b. No workgroup memory, no barriers.
override GEMM_A: u32 = 4u;
override GEMM_B: u32 = 4u;
const GEMM_WG: u32 = 64u;

@group(0) @binding(1) var<storage, read> gl_a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> gl_b: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> gl_out: array<f32>;

// Whether conv2d_gemm_lanes, _gather and _weight_pixels broadcast their rows of b across a
// subgroup (see gemm_tile_body and gemm_weight_tile_body in src/kernels/conv2d/tiles.rs; the
// launcher sets it).
override GEMM_BROADCAST: bool = false;

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
    let batch = gemm_batch(wid);
    // TILE conv2d_gemm_lanes
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
    let batch = vec3<u32>(0u);
    // TILE conv2d_gemm_gather
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
    // TILE conv2d_gemm_weight_pixels
}

@compute @workgroup_size(GEMM_WG)
fn conv2d_gemm_weight_channels(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let origin = gemm_lanes_origin(lid, wid, nwg, false);
    if (origin.x == 0xffffffffu) { return; }
    let co0 = origin.x;
    let kv0 = origin.y / 4u;
    // TILE conv2d_gemm_weight_channels
}
