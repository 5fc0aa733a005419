// Global average pool over the spatial positions of each (n, c) plane, NCHW.
//
// Forward: one invocation per plane sums its hw values in ascending order, then divides by hw
// (a division, not a multiply by 1/hw: one rounding fewer). Backward overwrites dx with dy/hw
// broadcast over the plane; nothing accumulates. Both index linearly, spilling into y.

struct Params {
    planes: u32, // n * c
    hw: u32,
}

const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: Params;

fn linear_index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * WG;
}

// global_avgpool_forward: y[plane] = (sum over s of x[plane * hw + s]) / hw
@group(0) @binding(1) var<storage, read> fwd_x: array<f32>;
@group(0) @binding(2) var<storage, read_write> fwd_y: array<f32>;

@compute @workgroup_size(WG)
fn global_avgpool_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let plane = linear_index(gid, nwg);
    if (plane >= p.planes) { return; }
    let base = plane * p.hw;
    var sum = 0.0;
    for (var s = 0u; s < p.hw; s++) {
        sum += fwd_x[base + s];
    }
    fwd_y[plane] = sum / f32(p.hw);
}

// global_avgpool_backward: dx[plane * hw + s] = dy[plane] / hw
@group(0) @binding(1) var<storage, read> bwd_dy: array<f32>;
@group(0) @binding(2) var<storage, read_write> bwd_dx: array<f32>;

@compute @workgroup_size(WG)
fn global_avgpool_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.planes * p.hw) { return; }
    bwd_dx[i] = bwd_dy[i / p.hw] / f32(p.hw);
}
