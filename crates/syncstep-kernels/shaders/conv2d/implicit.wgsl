// The implicit-GEMM family (src/kernels/conv2d/implicit/): the forward and the input-VJP as one
// register-blocked GEMM that gathers its first operand straight from NCHW (no im2col in memory),
// and the weight gradient as the same tile walking a node of examples. This file is the frame
// every module of the family shares; src/kernels/conv2d/implicit/ (gather_wgsl.rs, wgsl.rs)
// writes each configuration's entry point after it. What is subtle:
//
// - Each output's sum over k runs in increasing k from +0 in one accumulator, `c += a * b`, as
//   every other variant sums it, so the family gives their bits. A zero the gather selects for
//   padding, or past the last k of a tile, adds +0·w = ±0, which leaves a sum that starts at +0
//   as it was (it is never −0): the same bits as a skipped tap.
// - The table (ig_table) lists, per phase, where each k reads: the source offset and the rows and
//   columns it moves from the pixel's origin, in k's order, with the taps that read only padding
//   for every pixel left out (they would add +0). The kept taps of a phase are a grid of rows ×
//   columns, so the gather finds each k's tap from the grid (its record) rather than from an
//   entry; the entries lay out the weights and serve the weight gradient. The forward has one
//   phase; the input-VJP one per (iy mod stride, ix mod stride), the phases of one tap grid in one
//   dispatch along z.
// - Segments (common.wgsl): a workgroup sums all of its phase's k, adding the segments' sums in
//   order to a total from +0 (entry points with a `t…` register set), or one segment whose sum
//   goes to a slab, which conv2d_implicit_segments then adds in order.
// - Workgroup memory is written before it is read, one barrier per K step: slice s+1 is loaded
//   into registers while slice s is summed from one buffer, then stored into the other.

struct Implicit {
    // The GEMM's columns: c_out (forward) or c_in (input-VJP); vec4s of a laid-out weight row,
    // its columns padded with +0 to whole tiles.
    cols: u32,
    cols4: u32,
    images: u32,
    // What the gather reads (x, or dy) and where the outputs land (y, or dx), NCHW.
    src_c: u32,
    src_h: u32,
    src_w: u32,
    out_c: u32,
    out_h: u32,
    out_w: u32,
    // Source and output rows per grid row: (stride, 1) for the forward, (1, stride) for a phase.
    a_step: u32,
    o_step: u32,
    phases: u32,
    // The first phase of this dispatch (phases run along z from it).
    phase0: u32,
    // Segments along z per phase: 1 where a workgroup sums all of its phase's k.
    segments: u32,
    // Workgroups along x·y per tile row: the largest phase's pixel tiles.
    m_tiles: u32,
    // Elements of the output: the stride of the segment slabs.
    out_len: u32,
}

@group(0) @binding(0) var<uniform> ig: Implicit;

// Per phase three records, then the k entries of every phase, then one spare entry (where an
// empty phase's first entry points):
//   record 0: (grid_h, grid_w, k_count, first entry), record 1: (source row and column of grid
//   point (0, 0), output row and column of it), record 2: (k per segment, row and column of the
//   first kept tap from a pixel's origin, +1 or −1: the step from one kept tap to the next);
//   entry: (source offset, rows, columns, w offset).
fn ig_record(phase: u32, r: u32) -> vec4<i32> {
    return ig_table[3u * phase + r];
}

// Where a phase's pixel m reads its source from and writes its output to.
struct IgPixel {
    ok: bool,
    base: i32,
    y0: i32,
    x0: i32,
    out: u32,
}

fn ig_pixel(m: u32, grid_h: u32, grid_w: u32, r1: vec4<i32>) -> IgPixel {
    let plane = grid_h * grid_w;
    let pixels = ig.images * plane;
    let mc = min(m, pixels - 1u);
    let n = mc / plane;
    let gy = (mc % plane) / grid_w;
    let gx = mc % grid_w;
    let y0 = i32(gy * ig.a_step) + r1.x;
    let x0 = i32(gx * ig.a_step) + r1.y;
    let base = i32(n * ig.src_c * ig.src_h * ig.src_w) + y0 * i32(ig.src_w) + x0;
    let oy = gy * ig.o_step + u32(r1.z);
    let ox = gx * ig.o_step + u32(r1.w);
    let out = n * ig.out_c * ig.out_h * ig.out_w + oy * ig.out_w + ox;
    return IgPixel(m < pixels, base, y0, x0, out);
}

@group(0) @binding(1) var<storage, read> ig_src: array<f32>;
@group(0) @binding(2) var<storage, read> ig_w: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> ig_table: array<vec4<i32>>;
@group(0) @binding(4) var<storage, read_write> ig_out: array<f32>;

// The weights as the GEMM reads them: row k (every phase's, in the table's order) holds the
// column c's w at c·w_col_stride + the entry's w offset, +0 past the last column and in the rows
// after the last k, so that the GEMM's loads of a slice need no test. One dispatch lays out
// several convolutions' weights (a step's, once for the step), each a layout of two records:
// (its first vec4 in il_rows, its weights' first float in il_w, its first entry in il_table,
// 0), (cols, cols4, k_rows, w_col_stride). The layouts lie in order, each from a workgroup's
// first vec4, and il_workgroups names each workgroup's layout; the vec4s between two layouts
// are +0.
struct ImplicitLayouts {
    vec4s: u32,
}

@group(0) @binding(0) var<uniform> il: ImplicitLayouts;
@group(0) @binding(1) var<storage, read> il_w: array<f32>;
@group(0) @binding(2) var<storage, read> il_table: array<vec4<i32>>;
@group(0) @binding(3) var<storage, read> il_layouts: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> il_workgroups: array<u32>;
@group(0) @binding(5) var<storage, read_write> il_rows: array<vec4<f32>>;

@compute @workgroup_size(64)
fn conv2d_implicit_weights(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = gid.x + gid.y * nwg.x * 64u;
    if (t >= il.vec4s) { return; }
    let laid = il_workgroups[wid.x + wid.y * nwg.x];
    let at = il_layouts[2u * laid];
    let dims = il_layouts[2u * laid + 1u];
    let k = (t - at.x) / dims.y;
    let c0 = ((t - at.x) % dims.y) * 4u;
    let row = k < dims.z;
    let w0 = at.y + u32(il_table[at.z + select(0u, k, row)].w);
    var quad = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {
        let ok = row && c0 + i < dims.x;
        quad[i] = select(0.0, il_w[select(0u, w0 + (c0 + i) * dims.w, ok)], ok);
    }
    il_rows[t] = quad;
}

// The segments' sums taken side by side, added in order onto +0, as every variant adds them.
@group(0) @binding(1) var<storage, read> is_slabs: array<f32>;
@group(0) @binding(2) var<storage, read_write> is_out: array<f32>;

@compute @workgroup_size(64)
fn conv2d_implicit_segments(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i >= ig.out_len) { return; }
    var total = 0.0;
    for (var s = 0u; s < ig.segments; s++) {
        total += is_slabs[s * ig.out_len + i];
    }
    is_out[i] = total;
}

// The weight gradient (src/kernels/conv2d/implicit/weight.rs): dw[co, k] over the kept taps'
// k = (ci, ky, kx) of the forward's table, summed as every variant sums it: each output row's
// pixels in order from +0 (s), the rows of an example in order from +0 (e), the examples by the
// canonical pairwise tree. A workgroup walks one node of the tree (an aligned block of
// `node` examples, or the batch's tail) for one tile of (co, k), its pairwise blocks in
// registers; where the batch has more nodes, conv2d_implicit_weight_nodes adds the nodes'
// sums as a binary counter over them, which is the tree above the nodes.
struct ImplicitWeight {
    c_out: u32,
    c_in: u32,
    h: u32,
    w: u32,
    out_h: u32,
    out_w: u32,
    stride: u32,
    pad: u32,
    images: u32,
    // Examples per node (a power of two) and the nodes of the batch.
    node: u32,
    nodes: u32,
    // The kept taps' k (the GEMM's columns) and dw's row, c_in·kh·kw.
    cols: u32,
    w_len: u32,
    m_tiles: u32,
    // Whether the workgroups write dw itself (one node, every tap kept).
    direct: u32,
    // Taps of the whole kernel, and of them the kept ones.
    taps: u32,
    kept: u32,
    // +0, where a row's sums start again (weight_wgsl.rs).
    zero: f32,
}

@group(0) @binding(0) var<uniform> iw: ImplicitWeight;
@group(0) @binding(1) var<storage, read> iw_dy: array<f32>;
@group(0) @binding(2) var<storage, read> iw_x: array<f32>;
// The forward's table: one phase's three records, its k entries, a spare entry, then one entry
// per tap of the whole kernel whose x is its rank among the kept taps (−1: dropped).
@group(0) @binding(3) var<storage, read> iw_table: array<vec4<i32>>;
@group(0) @binding(4) var<storage, read_write> iw_out: array<f32>;

// Where pixel q of the batch reads dy (channel 0) and x (tap offset 0), and its origin.
struct IwPixel {
    ok: bool,
    dy: u32,
    x: i32,
    y0: i32,
    x0: i32,
}

fn iw_pixel(q: u32, end: u32) -> IwPixel {
    let plane = iw.out_h * iw.out_w;
    let qc = min(q, end - 1u);
    let n = qc / plane;
    let pix = qc % plane;
    let y0 = i32((pix / iw.out_w) * iw.stride) - i32(iw.pad);
    let x0 = i32((pix % iw.out_w) * iw.stride) - i32(iw.pad);
    let x = i32(n * iw.c_in * iw.h * iw.w) + y0 * i32(iw.w) + x0;
    return IwPixel(q < end, n * iw.c_out * plane + pix, x, y0, x0);
}

fn iw_dy_at(p: IwPixel, co: u32) -> f32 {
    let ok = p.ok && co < iw.c_out;
    return select(0.0, iw_dy[select(0u, p.dy + co * iw.out_h * iw.out_w, ok)], ok);
}

fn iw_x_at(p: IwPixel, k: u32) -> f32 {
    let e = iw_table[3u + select(0u, k, k < iw.cols)];
    let iy = p.y0 + e.y;
    let ix = p.x0 + e.z;
    let ok = p.ok && k < iw.cols && iy >= 0 && iy < i32(iw.h) && ix >= 0 && ix < i32(iw.w);
    return select(0.0, iw_x[select(0, p.x + e.x, ok)], ok);
}

// dw from the nodes' sums (node-major, then co, then the kept k): their pairwise total, and +0
// for the dropped taps.
@group(0) @binding(1) var<storage, read> in_nodes: array<f32>;
@group(0) @binding(2) var<storage, read> in_table: array<vec4<i32>>;
@group(0) @binding(3) var<storage, read_write> in_dw: array<f32>;

@compute @workgroup_size(64)
fn conv2d_implicit_weight_nodes(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i >= iw.c_out * iw.w_len) { return; }
    let co = i / iw.w_len;
    let ci = (i % iw.w_len) / iw.taps;
    let rank = in_table[3u + iw.cols + 1u + i % iw.taps].x;
    if (rank < 0) {
        in_dw[i] = 0.0;
        return;
    }
    let at = co * iw.cols + ci * iw.kept + u32(rank);
    var blocks: array<f32, PAIRWISE_LEVELS>;
    let count = pairwise_count(iw.nodes, nwg);
    for (var t = 0u; t < count; t++) {
        pairwise_push(&blocks, t, in_nodes[t * iw.c_out * iw.cols + at]);
    }
    in_dw[i] = pairwise_total(&blocks, count);
}
