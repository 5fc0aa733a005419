// ---------------------------------------------------------------------------------------------
// Cropped kernels (Conv2dShape::crop in src/kernels/conv2d/crop.rs): where some taps read padding for
// every output, the plain launchers run the convolution of the other taps. These copy the kept
// taps' weights out of the whole kernel, and write the kept taps' gradient back into the whole
// dw with +0 at the dropped taps (the sum every variant gives there).

@group(0) @binding(1) var<storage, read> crop_in: array<f32>;
@group(0) @binding(2) var<storage, read_write> crop_out: array<f32>;

// Tap (ty, tx) of the crop for the (co, ci) pair oc = co·c_in + ci: its index among the kept
// taps (x) and in the whole kernel (y).
fn crop_indices(oc: u32, ty: u32, tx: u32) -> vec2<u32> {
    return vec2<u32>((oc * p.crop_h + ty) * p.crop_w + tx, (oc * p.kh + p.crop_y + ty) * p.kw + p.crop_x + tx);
}

// An invocation copies the kept taps of CROP_RUN (co, ci) pairs WG apart: CPU drivers pay per
// workgroup, and a pair is a few loads (one per kept tap; layer4's 512×512 kernels are 262144
// pairs).
const CROP_RUN: u32 = 16u;

// The (co, ci) pair of run k of this invocation, or none (u32 max) past the last.
fn crop_pair(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, k: u32) -> u32 {
    let oc = (wid.x + wid.y * nwg.x) * WG * CROP_RUN + k * WG + lid;
    return select(0xffffffffu, oc, oc < p.c_out * p.c_in);
}

// The kept taps of this invocation's pairs, copied to the kept layout (crop) or back into the
// whole kernel (uncrop).
fn crop_walk(lid: u32, wid: vec3<u32>, nwg: vec3<u32>, uncrop: bool) {
    for (var k = 0u; k < CROP_RUN; k++) {
        let oc = crop_pair(wid, nwg, lid, k);
        if (oc == 0xffffffffu) { return; }
        for (var ty = 0u; ty < p.crop_h; ty++) {
            for (var tx = 0u; tx < p.crop_w; tx++) {
                let kept_whole = crop_indices(oc, ty, tx);
                let to_from = select(kept_whole, kept_whole.yx, uncrop);
                crop_out[to_from.x] = crop_in[to_from.y];
            }
        }
    }
}

@compute @workgroup_size(WG)
fn conv2d_crop_weights(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    crop_walk(lid, wid, nwg, false);
}

// The same walk the other way, into a dw the launcher cleared.
@compute @workgroup_size(WG)
fn conv2d_uncrop_weight_gradient(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    crop_walk(lid, wid, nwg, true);
}
