// SGD with momentum and weight decay as PyTorch (dampening 0, not Nesterov), in place over one
// flat parameter buffer: g' = g + wd·p; v ← μ·v + g'; p ← p − lr·v.
//
// Each element is read and written by one invocation only, so in-place is safe and the update
// does not depend on scheduling. The flat buffer's alignment padding holds zeros in p, g and v
// and stays zero. Elements go four at a time as vec4s (the launcher asks for a multiple of 4):
// CPU drivers then load and store them with half the instructions. An invocation updates RUN
// vec4s WG apart, so a workgroup covers WG·RUN consecutive ones: CPU drivers pay per workgroup,
// and tens of millions of elements in workgroups of WG would cost more in workgroup setup than
// in arithmetic.
// The workgroup index spills into y past 65535.

struct Params {
    len4: u32, // vec4s
    lr: f32,
    momentum: f32,
    weight_decay: f32,
}

const WG: u32 = 256u;
const RUN: u32 = 8u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> param: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> grad: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> velocity: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn sgd_update(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let first = (wid.x + wid.y * nwg.x) * WG * RUN + tid;
    for (var k = 0u; k < RUN; k++) {
        let i = first + k * WG;
        if (i >= p.len4) { return; }
        // One load of the parameter: after the velocity store a second would be loaded again
        // (the driver cannot tell that the bindings do not alias).
        let w = param[i];
        let g = grad[i] + p.weight_decay * w;
        let v = p.momentum * velocity[i] + g;
        velocity[i] = v;
        param[i] = w - p.lr * v;
    }
}
