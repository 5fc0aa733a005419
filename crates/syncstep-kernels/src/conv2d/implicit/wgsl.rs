//! The WGSL of the implicit-GEMM family, written per configuration: the frame
//! (shaders/conv2d/implicit.wgsl) and the configuration's entry point, its accumulators, loads
//! and stores written out with a variable each (CPU drivers keep an array that a loop indexes in
//! memory; GPUs keep either in registers).
//!
//! Where a lane reads and writes workgroup memory is a [`LaneIndex`]: the same value writes the
//! WGSL expression and evaluates it for lanes 0..32, so the bank conflicts `bench` reports are
//! those of the code the GPU runs (construction.rs).

use super::TileConfig;
use crate::shader_source;
use syncstep_gpu::Shader;

/// The frame every module of the family starts from.
pub(crate) const FRAME: Shader =
    Shader::file("conv2d_implicit", shader_source!("conv2d/implicit.wgsl"));

/// `((lid / div) % modulo) · mul`, no `% modulo` where it is None.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Term {
    div: u32,
    modulo: Option<u32>,
    mul: u32,
}

/// An index into workgroup memory as a function of the invocation's index `lid` in its
/// workgroup: a sum of [`Term`]s and a constant. What every lane adds alike (the buffer, the k
/// of the loop) stays out of it: it moves all lanes' addresses together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaneIndex {
    terms: Vec<Term>,
    constant: u32,
}

impl LaneIndex {
    pub(super) fn new() -> LaneIndex {
        LaneIndex { terms: Vec::new(), constant: 0 }
    }
    /// Plus `((lid / div) % modulo) · mul`.
    pub(super) fn term(mut self, div: u32, modulo: Option<u32>, mul: u32) -> LaneIndex {
        self.terms.push(Term { div, modulo, mul });
        self
    }
    pub(super) fn plus(mut self, constant: u32) -> LaneIndex {
        self.constant += constant;
        self
    }
    /// Its value for lane `lid`.
    pub fn at(&self, lid: u32) -> u32 {
        let term = |t: &Term| (lid / t.div) % t.modulo.unwrap_or(u32::MAX) * t.mul;
        self.terms.iter().map(term).sum::<u32>() + self.constant
    }
    /// As WGSL.
    pub(super) fn wgsl(&self) -> String {
        let term = |t: &Term| {
            let mut e = if t.div == 1 { "lid".to_string() } else { format!("lid / {}u", t.div) };
            if let Some(m) = t.modulo {
                e = format!("({e}) % {m}u");
            }
            if t.mul != 1 {
                e = format!("({e}) * {}u", t.mul);
            }
            e
        };
        let mut parts: Vec<String> = self.terms.iter().map(term).collect();
        parts.push(format!("{}u", self.constant));
        format!("({})", parts.join(" + "))
    }
}

/// The gather GEMM's reads of its tiles in the inner loop, in vec4s from the k row's start: the
/// pixel quads `m(lid) + h·BM/8` (h < tm/4) and column quads `n(lid) + q·BN/8` (q < tn/4). Lanes
/// next to each other take the next column quad, so a warp reads consecutive vec4s of b and one
/// or a few vec4s of a: conflict-free.
pub fn gemm_a_read(c: TileConfig, h: u32) -> LaneIndex {
    LaneIndex::new().term(c.threads_n, None, 1).plus(h * c.bm() / 8)
}
pub fn gemm_b_read(c: TileConfig, q: u32) -> LaneIndex {
    LaneIndex::new().term(1, Some(c.threads_n), 1).plus(q * c.bn() / 8)
}

/// Lines `f(i, q)` for i < `rows`, q < `quads`, one per i, at `indent`.
pub(super) fn each(
    indent: &str,
    rows: u32,
    quads: u32,
    f: impl Fn(u32, u32) -> String,
) -> Vec<String> {
    (0..rows)
        .map(|i| (0..quads).map(|q| f(i, q)).collect::<Vec<_>>().join(" "))
        .map(|l| format!("{indent}{l}"))
        .collect()
}

pub(super) const LANE: [char; 4] = ['x', 'y', 'z', 'w'];

/// Writes a staging step at an indent: loads of the slice from a first k (or pixel), or stores
/// into a buffer.
type Stage<'a> = &'a dyn Fn(&mut Vec<String>, &str, &str);

/// The loop over slices both kernels run, after their accumulators: the first slice (from
/// `first`) loaded and stored into buffer 0 and the second loaded into registers; then per
/// slice `body` sums the one in buffer `cur`, the next (in registers since the slice before)
/// is stored into the other buffer, and the one after it loaded into registers: one barrier a
/// slice, and a whole slice's sums between a load and its store. The loads run past the last
/// slice (each stays inside its buffer and is flagged off) and the stores too (inside their
/// arrays): a load used in the iteration that issues it, or under a branch, is moved by the
/// compiler next to its use, after the sums, where its latency is not hidden.
pub(super) fn slices(
    w: &mut Vec<String>,
    first: &str,
    bk: u32,
    (loads, stores): (Stage, Stage),
    body: &dyn Fn(&mut Vec<String>),
) {
    w.push("    {".into());
    loads(w, "        ", first);
    w.push("    }".into());
    stores(w, "    ", "0u");
    w.push("    {".into());
    loads(w, "        ", &format!("({first} + {bk}u)"));
    w.push("    }".into());
    w.push("    workgroupBarrier();".into());
    w.push("    for (var step = 0u; step < steps; step++) {".into());
    w.push("        let cur = step & 1u;".into());
    w.push(format!("        let next = {first} + (step + 1u) * {bk}u;"));
    w.push(format!("        let after = {first} + (step + 2u) * {bk}u;"));
    w.push("        let more = step + 1u < steps;".into());
    body(w);
    stores(w, "        ", "(1u - cur)");
    w.push("        {".into());
    loads(w, "            ", "after");
    w.push("        }".into());
    w.push("        workgroupBarrier();".into());
    w.push("    }".into());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lane index's WGSL and its value agree: the expression naga evaluates at lid is `at`.
    #[test]
    fn lane_indices_write_what_they_evaluate() {
        let index = LaneIndex::new().term(32, Some(2), 8).term(1, Some(8), 1).term(64, None, 4);
        assert_eq!(index.wgsl(), "(((lid / 32u) % 2u) * 8u + (lid) % 8u + (lid / 64u) * 4u + 0u)");
        assert_eq!((index.at(0), index.at(9), index.at(33), index.at(70)), (0, 1, 9, 10));
    }
}
