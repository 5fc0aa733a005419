// ReLU and the residual add: elementwise, one invocation per element.
//
// ReLU takes its mask from a separate `gate` tensor rather than from x itself: normally the
// launcher binds x as the gate, but a gate run can impose another run's activation pattern
// (docs/design.md, "Same activation pattern"). The backward reads the same gate.
//
// add_relu_backward is add(a, relu_backward(dy, gate)) in one pass, with the same select and
// the same operand order, so the same bits: a residual block's input cotangent, the conv
// branch's plus the identity shortcut's (the block output's cotangent through its ReLU).

struct Params {
    len: u32,
}

const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: Params;

fn linear_index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * WG;
}

// relu_forward: y = gate > 0 ? x : 0
@group(0) @binding(1) var<storage, read> relu_x: array<f32>;
@group(0) @binding(2) var<storage, read> relu_gate: array<f32>;
@group(0) @binding(3) var<storage, read_write> relu_y: array<f32>;

@compute @workgroup_size(WG)
fn relu_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.len) { return; }
    relu_y[i] = select(0.0, relu_x[i], relu_gate[i] > 0.0);
}

// relu_backward: dx = gate > 0 ? dy : 0
@group(0) @binding(1) var<storage, read> relub_dy: array<f32>;
@group(0) @binding(2) var<storage, read> relub_gate: array<f32>;
@group(0) @binding(3) var<storage, read_write> relub_dx: array<f32>;

@compute @workgroup_size(WG)
fn relu_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.len) { return; }
    relub_dx[i] = select(0.0, relub_dy[i], relub_gate[i] > 0.0);
}

// add: out = a + b (the residual join; its backward is the identity on both branches)
@group(0) @binding(1) var<storage, read> add_a: array<f32>;
@group(0) @binding(2) var<storage, read> add_b: array<f32>;
@group(0) @binding(3) var<storage, read_write> add_out: array<f32>;

@compute @workgroup_size(WG)
fn add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.len) { return; }
    add_out[i] = add_a[i] + add_b[i];
}

// add_relu_backward: out = a + (gate > 0 ? dy : 0)
@group(0) @binding(1) var<storage, read> addrb_a: array<f32>;
@group(0) @binding(2) var<storage, read> addrb_dy: array<f32>;
@group(0) @binding(3) var<storage, read> addrb_gate: array<f32>;
@group(0) @binding(4) var<storage, read_write> addrb_out: array<f32>;

@compute @workgroup_size(WG)
fn add_relu_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.len) { return; }
    addrb_out[i] = addrb_a[i] + select(0.0, addrb_dy[i], addrb_gate[i] > 0.0);
}
