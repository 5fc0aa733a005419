// Pairwise sums over examples: the one order in which every sum over a batch is taken
// (docs/design.md, "Determinism"). Terms are added as a binary counter: term t closes the
// blocks of 2^l terms ending at t (l below the number of trailing ones of t) and becomes the
// block of the level above them; blocks[l] holds the sum of the latest block of 2^l terms not
// yet paired with its left sibling, always added as the left operand. After `count` terms the
// open blocks are the set bits of count, the earliest terms in the highest; the total adds
// them from the smallest up, each as the left operand. So a launch over the terms of any node
// of the batch's tree (an aligned block of 2^k terms, or a tail [s, count) after the larger
// blocks) computes that node's subtree of the batch's sum. A data-parallel replica sums each
// canonical piece of its shard (src/canonical.rs: the largest nodes inside it, one for an
// aligned power-of-two shard) with one launch, and an all-reduce that adds every replica's
// pieces along the same tree (`canonical::Plan`) rebuilds the batch's sum bit for bit.
//
// WGSL has no generics: the functions come in the element types the shaders sum (f32; vec2
// for BatchNorm's pairs; mat4x4 for the weight gradient's register tiles), each the same tree.
//
// PAIRWISE_LEVELS sizes the stack: the launcher sets it to the smallest of 4, 8, 16, 32 that
// holds the bits of the count (kernels::pairwise_shader). The f32 and mat4x4 pushes loop over
// every level with that constant bound, so that a driver can unroll them and keep the blocks
// in registers (an array indexed by a variable level stays in memory on CPU drivers, which
// the weight gradient's 4×4 tiles cannot afford). The vec2 push, one pair per invocation,
// loops only over the levels a term closes: there the compares of every level cost more.
const PAIRWISE_LEVELS: u32 = 32u;

// `count`, the number of terms a kernel's pairwise loop runs over, in a form no driver can make
// a compile-time constant (`nwg.x`, the dispatch's workgroups, is never 0). Lavapipe (Mesa 22)
// compiles a pipeline again with its uniform-only loop bounds as constants whenever that halves
// the shader, as a sum over one term does, and then does so at every dispatch: a shard or a
// canonical piece of one example cost a compile per launch.
fn pairwise_count(count: u32, nwg: vec3<u32>) -> u32 {
    return select(count, 0u, nwg.x == 0u);
}

// Where a buffer that keeps only the open blocks of `count` terms, largest first, one level
// each, keeps the block of 2^l terms: after the larger ones. The weight gradient's GEMMs keep
// their blocks so, in as many levels as their counts have open blocks at once (the set bits of
// a count), rather than one per bit of the batch.
// (Two shifts, each under 32 bits.)
fn pairwise_slot(l: u32, count: u32) -> u32 {
    return countOneBits((count >> 1u) >> l);
}

fn pairwise_push(blocks: ptr<function, array<f32, PAIRWISE_LEVELS>>, t: u32, term: f32) {
    let closed = countTrailingZeros(~t);
    var v = term;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (l < closed) { v = (*blocks)[l] + v; } else if (l == closed) { (*blocks)[l] = v; }
    }
}

fn pairwise_total(blocks: ptr<function, array<f32, PAIRWISE_LEVELS>>, count: u32) -> f32 {
    var sum = 0.0;
    var first = true;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (((count >> l) & 1u) == 1u) {
            if (first) { sum = (*blocks)[l]; } else { sum = (*blocks)[l] + sum; }
            first = false;
        }
    }
    return sum;
}

fn pairwise_push2(blocks: ptr<function, array<vec2<f32>, PAIRWISE_LEVELS>>, t: u32, term: vec2<f32>) {
    var v = term;
    var l = 0u;
    for (; ((t >> l) & 1u) == 1u; l++) {
        v = (*blocks)[l] + v;
    }
    (*blocks)[l] = v;
}

fn pairwise_total2(blocks: ptr<function, array<vec2<f32>, PAIRWISE_LEVELS>>, count: u32) -> vec2<f32> {
    var sum = vec2<f32>(0.0);
    var first = true;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (((count >> l) & 1u) == 1u) {
            if (first) { sum = (*blocks)[l]; } else { sum = (*blocks)[l] + sum; }
            first = false;
        }
    }
    return sum;
}

fn pairwise_push4(blocks: ptr<function, array<mat4x4<f32>, PAIRWISE_LEVELS>>, t: u32, term: mat4x4<f32>) {
    let closed = countTrailingZeros(~t);
    var v = term;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (l < closed) { v = (*blocks)[l] + v; } else if (l == closed) { (*blocks)[l] = v; }
    }
}

fn pairwise_total4(blocks: ptr<function, array<mat4x4<f32>, PAIRWISE_LEVELS>>, count: u32) -> mat4x4<f32> {
    var sum = mat4x4<f32>();
    var first = true;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (((count >> l) & 1u) == 1u) {
            if (first) { sum = (*blocks)[l]; } else { sum = (*blocks)[l] + sum; }
            first = false;
        }
    }
    return sum;
}

// pairwise_push4, except that the last of `count` terms closes the sum instead of being
// stored: it merges the blocks below its level as a push would, then the open blocks above,
// smallest first, as pairwise_total4 would, and leaves the total in blocks[0] (free by then).
// The same additions in the same order, with a stack one level per bit of count − 1 rather
// than of count: the launcher uses it where that saves a level (16 terms fit 4 levels).
fn pairwise_push_or_close4(blocks: ptr<function, array<mat4x4<f32>, PAIRWISE_LEVELS>>, t: u32, count: u32, term: mat4x4<f32>) {
    let closed = countTrailingZeros(~t);
    let last = t + 1u == count;
    var v = term;
    for (var l = 0u; l < PAIRWISE_LEVELS; l++) {
        if (l < closed || (last && l > closed && ((count >> l) & 1u) == 1u)) {
            v = (*blocks)[l] + v;
        } else if (l == closed && !last) {
            (*blocks)[l] = v;
        }
    }
    if (last) { (*blocks)[0] = v; }
}
