// SGD with momentum and weight decay as PyTorch (dampening 0, not Nesterov), in place over one
// flat parameter buffer: g' = g + wd·p; v ← μ·v + g'; p ← p − lr·v.
//
// One invocation per element, reading and writing only its own element, so in-place is safe
// and the update does not depend on scheduling. The flat buffer's alignment padding holds
// zeros in p, g and v and stays zero. Buffers reach tens of millions of elements: the index
// spills into y.

struct Params {
    len: u32,
    lr: f32,
    momentum: f32,
    weight_decay: f32,
}

const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> param: array<f32>;
@group(0) @binding(2) var<storage, read> grad: array<f32>;
@group(0) @binding(3) var<storage, read_write> velocity: array<f32>;

fn linear_index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * WG;
}

@compute @workgroup_size(WG)
fn sgd_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.len) { return; }
    let g = grad[i] + p.weight_decay * param[i];
    let v = p.momentum * velocity[i] + g;
    velocity[i] = v;
    param[i] = param[i] - p.lr * v;
}
