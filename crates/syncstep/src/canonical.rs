//! The canonical order of every sum over a batch's examples (docs/design.md, "Determinism"):
//! one addition tree over the examples [0, B) that depends on the global batch size B alone.
//!
//! The tree is the kernels' binary counter (syncstep-kernels' shaders/common/pairwise.wgsl)
//! read as ranges: a node [s, e) whose length is a power of two splits into its halves; any
//! other node, [s, B) after the larger blocks, splits into the largest power-of-two block at its
//! start and the rest. So the root [0, B) is T₁ + (T₂ + (… + Tₖ)) over the blocks of B's set
//! bits, largest first, each a balanced tree: what a kernel summing examples 0..B computes. A kernel launched on the
//! examples of any node computes that node's subtree, bit for bit.
//!
//! A replica holding examples [a, b) sums each of its [`pieces`] (the largest nodes inside its
//! range: one for an aligned power-of-two shard, O(log N) otherwise) with one launch, and a
//! [`Plan`] adds every replica's pieces up along the same tree. The result is the single
//! device's sum for any R, any shard sizes: a single device's only piece is the root.

use std::ops::Range;

/// The children of node `node` of the tree over `[0, batch)`, or none for a single example.
fn children(node: &Range<u64>) -> Option<(Range<u64>, Range<u64>)> {
    let len = node.end - node.start;
    if len <= 1 {
        return None;
    }
    let split =
        if len.is_power_of_two() { len / 2 } else { 1 << (u64::BITS - 1 - len.leading_zeros()) };
    Some((node.start..node.start + split, node.start + split..node.end))
}

/// The largest nodes of the tree over `[0, batch)` that lie inside `range`, in order: the sums a
/// holder of `range` contributes. `range` must lie inside `[0, batch)`.
pub fn pieces(range: Range<u64>, batch: u64) -> Vec<Range<u64>> {
    fn walk(node: Range<u64>, range: &Range<u64>, out: &mut Vec<Range<u64>>) {
        if node.end <= range.start || range.end <= node.start {
            return;
        }
        if range.start <= node.start && node.end <= range.end {
            out.push(node);
        } else if let Some((left, right)) = children(&node) {
            walk(left, range, out);
            walk(right, range, out);
        }
    }
    assert!(range.start < range.end && range.end <= batch, "{range:?} inside [0, {batch})");
    let mut out = Vec::new();
    walk(0..batch, &range, &mut out);
    out
}

/// The contiguous shards of a batch of `batch` examples over `replicas` replicas: the first
/// `batch mod replicas` take one example more than the others. `batch ≥ replicas ≥ 1`.
pub fn shards(batch: u64, replicas: u64) -> Vec<Range<u64>> {
    assert!(replicas >= 1 && batch >= replicas, "{batch} examples over {replicas} replicas");
    let (base, extra) = (batch / replicas, batch % replicas);
    let mut start = 0;
    (0..replicas)
        .map(|r| {
            let len = base + (r < extra) as u64;
            start += len;
            start - len..start
        })
        .collect()
}

/// One step of a [`Plan`]: put a leaf on the stack, or replace the top two values by their sum
/// (the lower one, the earlier examples, as the left operand).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Leaf(usize),
    Add,
}

/// How to add up the pieces of several holders into the sum over the whole batch, as a program
/// over a stack: `leaves[i]` is (holder, its piece number) of leaf i, and `steps` add them along
/// the canonical tree. The collective runs it element by element; it knows nothing of examples.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub leaves: Vec<(usize, usize)>,
    pub steps: Vec<Step>,
}

impl Plan {
    /// The plan that adds the [`pieces`] of each of `ranges` (holder r holds `ranges[r]`; they
    /// tile `[0, batch)` in order) into the sum over `[0, batch)`.
    pub fn new(ranges: &[Range<u64>], batch: u64) -> Plan {
        let mut leaves = Vec::new();
        let mut starts = Vec::new();
        for (holder, range) in ranges.iter().enumerate() {
            for (piece, node) in pieces(range.clone(), batch).into_iter().enumerate() {
                leaves.push((holder, piece));
                starts.push(node);
            }
        }
        fn walk(node: Range<u64>, leaves: &[Range<u64>], steps: &mut Vec<Step>) {
            if let Some(i) = leaves.iter().position(|l| *l == node) {
                steps.push(Step::Leaf(i));
            } else {
                let (left, right) = children(&node).expect("the pieces tile the batch");
                walk(left, leaves, steps);
                walk(right, leaves, steps);
                steps.push(Step::Add);
            }
        }
        let mut steps = Vec::new();
        walk(0..batch, &starts, &mut steps);
        Plan { leaves, steps }
    }

    /// The plan of `holders` holders with one piece each: the canonical tree over them as
    /// leaves (what equal aligned power-of-two shards give).
    pub fn one_piece_each(holders: usize) -> Plan {
        Plan::new(&shards(holders as u64, holders as u64), holders as u64)
    }

    /// The plan of one holder with one piece: its value as it is.
    pub fn single() -> Plan {
        Plan { leaves: vec![(0, 0)], steps: vec![Step::Leaf(0)] }
    }

    /// How many pieces holder `holder` brings.
    pub fn pieces_of(&self, holder: usize) -> usize {
        self.leaves.iter().filter(|(h, _)| *h == holder).count()
    }

    /// Runs the plan over `leaf(i)`, the value of leaf i, with `add(left, right)`.
    pub fn run<T>(&self, mut leaf: impl FnMut(usize) -> T, mut add: impl FnMut(T, T) -> T) -> T {
        let mut stack: Vec<T> = Vec::with_capacity(64);
        for step in &self.steps {
            match *step {
                Step::Leaf(i) => stack.push(leaf(i)),
                Step::Add => {
                    let right = stack.pop().expect("a plan adds two values");
                    let left = stack.pop().expect("a plan adds two values");
                    stack.push(add(left, right));
                }
            }
        }
        stack.pop().expect("a plan leaves its sum")
    }
}

/// `values` summed in the canonical order (the single device's, whatever the count).
pub fn sum(values: &[f32]) -> f32 {
    fn node(values: &[f32], range: Range<u64>) -> f32 {
        match children(&range) {
            None => values[range.start as usize],
            Some((left, right)) => node(values, left) + node(values, right),
        }
    }
    if values.is_empty() {
        return 0.0;
    }
    node(values, 0..values.len() as u64)
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // a list of one range is what `pieces` returns here
mod tests {
    use super::*;

    /// The binary counter of syncstep-kernels' shaders/common/pairwise.wgsl, written out on the
    /// host.
    #[allow(clippy::assign_op_pattern)] // the earlier block is the left operand, as there
    fn binary_counter(values: &[f32]) -> f32 {
        let mut blocks = [0.0f32; 64];
        for (t, &v) in values.iter().enumerate() {
            let mut v = v;
            let mut l = 0;
            while (t >> l) & 1 == 1 {
                v = blocks[l] + v;
                l += 1;
            }
            blocks[l] = v;
        }
        let mut total: Option<f32> = None;
        for (l, block) in blocks.iter().enumerate() {
            if (values.len() >> l) & 1 == 1 {
                total = Some(total.map_or(*block, |t| block + t));
            }
        }
        total.unwrap_or(0.0)
    }

    /// Values whose sums round differently in every other order.
    fn awkward(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (1.0 + i as f32 * 0.37).powi(7) * if i % 3 == 0 { -1.0 } else { 1.0 })
            .collect()
    }

    #[test]
    fn the_tree_is_the_kernels_binary_counter() {
        for n in 1..200 {
            let v = awkward(n);
            assert_eq!(sum(&v).to_bits(), binary_counter(&v).to_bits(), "{n} values");
        }
    }

    #[test]
    fn any_shards_rebuild_the_single_sum_bit_for_bit() {
        for batch in 1..70u64 {
            let v = awkward(batch as usize);
            let whole = sum(&v);
            for replicas in 1..=batch.min(9) {
                let ranges = shards(batch, replicas);
                let plan = Plan::new(&ranges, batch);
                // Each holder sums each of its pieces as a kernel would: from 0, alone.
                let piece_sums: Vec<Vec<f32>> = ranges
                    .iter()
                    .map(|r| {
                        pieces(r.clone(), batch)
                            .into_iter()
                            .map(|p| binary_counter(&v[p.start as usize..p.end as usize]))
                            .collect()
                    })
                    .collect();
                let got =
                    plan.run(|i| piece_sums[plan.leaves[i].0][plan.leaves[i].1], |a, b| a + b);
                assert_eq!(got.to_bits(), whole.to_bits(), "batch {batch}, {replicas} replicas");
            }
        }
    }

    #[test]
    fn an_aligned_power_of_two_shard_is_one_piece_and_the_whole_batch_the_root() {
        assert_eq!(pieces(8..16, 24), [8..16]);
        assert_eq!(pieces(0..24, 24), [0..24]);
        assert_eq!(pieces(16..24, 24), [16..24]);
        assert_eq!(pieces(3..6, 9), [3..4, 4..6]);
        assert_eq!(pieces(0..3, 9), [0..2, 2..3]);
        assert!((1..=64).all(|n| pieces(5..5 + n, 5 + n + 7).len() <= 2 * 7));
        assert_eq!(Plan::new(&shards(16, 2), 16).leaves, [(0, 0), (1, 0)]);
        assert_eq!(Plan::new(&[0..5], 5), Plan::single());
    }

    #[test]
    fn shards_give_the_first_replicas_one_more() {
        assert_eq!(shards(10, 3), [0..4, 4..7, 7..10]);
        assert_eq!(shards(8, 4), [0..2, 2..4, 4..6, 6..8]);
        assert_eq!(shards(3, 3), [0..1, 1..2, 2..3]);
    }
}
