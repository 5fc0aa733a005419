// Max pooling over NCHW planes: square window k, stride, padding that is never chosen.
//
// What is subtle:
// - argmax[o] is the index ih·W + iw within the input plane of the FIRST maximum in window scan
//   order (kh outer, kw inner): the running best starts at the window's first real cell and
//   only a strictly greater value replaces it, so ties keep the first, as PyTorch.
// - NaN: WGSL lets implementations assume there are none, so no NaN rule is promised. As
//   written, a NaN wins only as a window's first real cell (comparisons with NaN are false);
//   PyTorch would propagate it. argmax always names a real cell of the window either way.
// - The backward is a GATHER: each input cell gets the sum of the dy of the output windows whose
//   argmax names it, windows taken rows, then columns, ascending, onto +0. Fixed order, every dx
//   element written once, by the invocation of its row. Gated (the pool after a ReLU), a window
//   counts only where its output is > 0: its maximum is the ReLU's output at the cell it chose,
//   so that cell's gate, and the ReLU's output need not be kept.
// - maxpool_forward_with_argmax reads x at a given argmax, so a checking run can impose another
//   run's pooling choices (docs/design.md, "Same activation pattern").

struct Params {
    n: u32,
    c: u32,
    h: u32,
    w: u32,
    k: u32,
    stride: u32,
    pad: u32,
    out_h: u32,
    out_w: u32,
    // maxpool_backward: 1 when a window's dy counts only where its gate (the pool's output, the
    // ReLU before the pool having made it) is > 0.
    gated: u32,
}

const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: Params;

fn linear_index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * WG;
}

// maxpool_forward: y and argmax, one invocation per output row (see maxpool_backward for why).
@group(0) @binding(1) var<storage, read> fwd_x: array<f32>;
@group(0) @binding(2) var<storage, read_write> fwd_y: array<f32>;
@group(0) @binding(3) var<storage, read_write> fwd_argmax: array<u32>;

@compute @workgroup_size(WG)
fn maxpool_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = linear_index(gid, nwg);
    if (t >= p.n * p.c * p.out_h) { return; }
    let base = (t / p.out_h) * p.h * p.w;
    // The window's rows and columns in padded coordinates, clipped to the real input: i + pad.
    let r0 = (t % p.out_h) * p.stride;
    let r_lo = max(r0, p.pad);
    let r_hi = min(r0 + p.k, p.h + p.pad);
    for (var ox = 0u; ox < p.out_w; ox = ox + 1u) {
        let c0 = ox * p.stride;
        let c_lo = max(c0, p.pad);
        let c_hi = min(c0 + p.k, p.w + p.pad);
        var best_at = (r_lo - p.pad) * p.w + (c_lo - p.pad);
        var best = fwd_x[base + best_at];
        for (var r = r_lo; r < r_hi; r = r + 1u) {
            for (var c = c_lo; c < c_hi; c = c + 1u) {
                let at = (r - p.pad) * p.w + (c - p.pad);
                let v = fwd_x[base + at];
                if (v > best) {
                    best = v;
                    best_at = at;
                }
            }
        }
        fwd_y[t * p.out_w + ox] = best;
        fwd_argmax[t * p.out_w + ox] = best_at;
    }
}

// maxpool_forward_with_argmax: y = x at the given argmax.
@group(0) @binding(1) var<storage, read> with_x: array<f32>;
@group(0) @binding(2) var<storage, read> with_argmax: array<u32>;
@group(0) @binding(3) var<storage, read_write> with_y: array<f32>;

@compute @workgroup_size(WG)
fn maxpool_forward_with_argmax(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let o = linear_index(gid, nwg);
    let per_plane = p.out_h * p.out_w;
    if (o >= p.n * p.c * per_plane) { return; }
    with_y[o] = with_x[(o / per_plane) * p.h * p.w + with_argmax[o]];
}

// maxpool_backward: dx[cell] = Σ dy[o] over the windows o containing the cell with argmax[o] = cell.
@group(0) @binding(1) var<storage, read> bwd_dy: array<f32>;
@group(0) @binding(2) var<storage, read> bwd_argmax: array<u32>;
@group(0) @binding(3) var<storage, read_write> bwd_dx: array<f32>;
@group(0) @binding(4) var<storage, read> bwd_gate: array<f32>;

// The output rows (or columns) whose window covers input row i: o·stride ≤ i + pad < o·stride + k.
fn covering(i: u32, out_len: u32) -> vec2<u32> {
    let padded = i + p.pad;
    let lo = select(0u, (padded + 1u - p.k + p.stride - 1u) / p.stride, padded + 1u > p.k);
    let hi = min(padded / p.stride + 1u, out_len);
    return vec2<u32>(lo, hi);
}

// One invocation per input row, in chunks of ROW_CHUNK cells: it reads each window covering the
// chunk once (argmax, gate, dy) and adds its dy onto the cell it names, where that cell is in the
// chunk. Windows come rows, then columns, ascending, so each cell gets its sum in that order. On
// CPU drivers every storage load is a loop over the SIMD lanes: per window rather than per
// (cell, covering window) it makes a fraction of the loads. The chunk's sums are a private array
// of fixed size, whatever the row's width.
const ROW_CHUNK: u32 = 32u;

@compute @workgroup_size(WG)
fn maxpool_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = linear_index(gid, nwg);
    if (t >= p.n * p.c * p.h) { return; }
    let row = t % p.h;
    let out_base = (t / p.h) * p.out_h * p.out_w;
    let rows = covering(row, p.out_h);
    for (var c0 = 0u; c0 < p.w; c0 += ROW_CHUNK) {
        let cells = min(ROW_CHUNK, p.w - c0);
        let cols = vec2<u32>(covering(c0, p.out_w).x, covering(c0 + cells - 1u, p.out_w).y);
        // The argmax of the chunk's first cell: a window names cell j of the chunk by first + j
        // (u32 wraps, so a cell before the chunk names a j past it).
        let first = row * p.w + c0;
        var sums: array<f32, ROW_CHUNK>;
        for (var r = rows.x; r < rows.y; r++) {
            for (var c = cols.x; c < cols.y; c++) {
                let o = out_base + r * p.out_w + c;
                let j = bwd_argmax[o] - first;
                if (j < cells && (p.gated == 0u || bwd_gate[o] > 0.0)) {
                    sums[j] += bwd_dy[o];
                }
            }
        }
        for (var j = 0u; j < cells; j++) {
            bwd_dx[t * p.w + c0 + j] = sums[j];
        }
    }
}
