// Conv2d without bias: NCHW activations, OIHW weights. Forward, input-VJP, weight gradient,
// each a plain kernel (*_direct: one output element per invocation) and a register-tiled one
// (*_blocked), and all three as an explicit GEMM over im2col rows (im2col.wgsl, gemm.wgsl,
// gemm_tiles.wgsl). The launchers are in src/kernels/conv2d/; this file is every module's
// first part: the uniform, indexing, and what holds for every kernel:
//
// - Every output element is written by exactly one invocation, which sums in a fixed order.
//   One writer per element and no += across dispatches: the same launch is bitwise reproducible, and
//   outputs are overwritten.
// - Padding: coordinates are i32; a read that falls outside the input is replaced by 0 with
//   `select` and its index by 0, so nothing relies on robust-buffer-access clamping.
// - *_direct: one output element per invocation, the plain version. *_blocked: a 4×4 register
//   tile per invocation (4 channels × 4 pixels; for the weight gradient 16 output × 4 input
//   channels, tap by tap), no workgroup memory (barriers are slow on CPU drivers such as
//   lavapipe). Pixel tiles are flattened over the batch too, so 2×2 and 1×1 feature maps fill
//   them. At a ragged edge a tile's indices are clamped for the loads and the extra lanes
//   skipped at the write.
// - Segments: an output's sum over k = (summed channel, tap) runs in segments of seg_channels
//   channels (all of them, one segment, except on small maps: Conv2dShape::sum_segment). Each
//   segment is summed from +0 in k's order, and the segments' sums are added in order to a total
//   from +0, by every variant, so the GPU plan can take the segments in separate workgroups and
//   add them afterwards without changing a bit. With one segment, total = +0 + sum = sum.
// - The launcher guarantees every element count, and the padded input plane, is below 2^31.

struct Params {
    n: u32,
    c_in: u32,
    h: u32,
    w: u32,
    c_out: u32,
    kh: u32,
    kw: u32,
    stride: u32,
    pad: u32,
    out_h: u32,
    out_w: u32,
    // backward_input_blocked only: the phase (iy mod stride, ix mod stride) and its grid size.
    phase_y: u32,
    phase_x: u32,
    phase_h: u32,
    phase_w: u32,
    // *_im2col and *_weight_rows only: the first pixel of this chunk, how many pixels, and the
    // row length in vec4s.
    row_begin: u32,
    row_count: u32,
    row4: u32,
    // conv2d_crop_weights and conv2d_uncrop_weight_gradient only: the kept taps' first row and
    // column in the whole kernel (kh × kw), and how many rows and columns they span.
    crop_y: u32,
    crop_x: u32,
    crop_h: u32,
    crop_w: u32,
    // conv2d_backward_weight_blocked only: dw's kernel size; tap (ky, kx) is its tap
    // (crop_y + ky, crop_x + kx). The whole kernel when the launcher runs a cropped one, else
    // kh × kw (and crop_y = crop_x = 0).
    dw_kh: u32,
    dw_kw: u32,
    // Forward and input-VJP: summed channels per segment of an output's sum (see below); and
    // the same in vec4s of an im2col row, which the launcher hands on to the GEMM's uniform
    // (no kernel here reads it).
    seg_channels: u32,
    seg4: u32,
}

@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 64u;

fn linear_index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * WG;
}

fn x_index(n: u32, c: u32, iy: u32, ix: u32) -> u32 {
    return ((n * p.c_in + c) * p.h + iy) * p.w + ix;
}

fn w_index(co: u32, ci: u32, ky: u32, kx: u32) -> u32 {
    return ((co * p.c_in + ci) * p.kh + ky) * p.kw + kx;
}

fn y_index(n: u32, c: u32, oy: u32, ox: u32) -> u32 {
    return ((n * p.c_out + c) * p.out_h + oy) * p.out_w + ox;
}

// The input coordinate that tap k of output o reads (negative or ≥ size on padding).
fn input_at(o: u32, k: u32) -> i32 {
    return i32(o * p.stride + k) - i32(p.pad);
}

fn inside(i: i32, size: u32) -> bool {
    return i >= 0 && i < i32(size);
}

fn inside4(i: vec4<i32>, size: u32) -> vec4<bool> {
    return (i >= vec4<i32>(0)) & (i < vec4<i32>(i32(size)));
}
