//! The `collective` layer: moving numbers between R replicas' devices, knowing nothing of what
//! they mean. wgpu devices share no memory, so everything goes through the host:
//!
//! - [`all_reduce`]: one buffer range per replica is copied to MAP_READ staging, all maps are
//!   joined, the host reduces in a fixed pairwise order over replicas (see [`reduce`]), and the
//!   SAME bytes are written back to every replica. Same bytes in, so replicas never drift. The
//!   plain version: fresh staging every call.
//! - [`BucketAllReduce`]: the same reduce of a buffer that becomes final part by part (the
//!   gradients during a backward): each part is copied into staging in the submission that
//!   finishes it and reduced while the device runs the next one, straight from the mapped
//!   read staging of every replica into the mapped write staging of every replica
//!   ([`reduce_chunks`]), which is then copied back. The staging ([`BucketStaging`]) is kept
//!   from step to step: fresh host memory costs more than the reduce (page faults).
//! - [`Rendezvous`]: R replica futures, running concurrently under one `join_all` on one thread
//!   (natively or in a browser), meet in numbered rounds. Each deposits its local value; the
//!   last to arrive merges all deposits (in replica order, with the merge the rendezvous was
//!   built with) and every replica receives the same merged value. Waiting is by wakers: no
//!   threads, no spinning, no atomics. A replica that fails calls [`Rendezvous::abort`], so
//!   the others return an error instead of waiting forever.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Poll, Waker};

use futures::future::{LocalBoxFuture, Shared};

use crate::canonical::Plan;
use crate::gpu::{Gpu, GpuError, Slice};

mod buckets;
#[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
pub mod mpi;
mod peers;

pub use buckets::{
    bucket_rounds, BucketAllReduce, BucketRounds, BucketStaging, Filled, MappedBucket, Pieces,
};
pub use peers::Peers;

/// `Clone`: one bucket's error reaches every replica of its round.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("replica {replica}: {source}")]
    Gpu {
        replica: usize,
        #[source]
        source: GpuError,
    },
    #[error("a collective needs at least one replica")]
    NoReplicas,
    #[error(
        "{got} replicas offer parts to an all-reduce whose plan adds {expected} replicas' pieces"
    )]
    ReplicaCount { got: usize, expected: usize },
    #[error("replica {replica} offers {got} pieces to the all-reduce; its plan adds {expected}")]
    PieceCount { replica: usize, got: usize, expected: usize },
    #[error("replica {replica} offers {got} elements to the all-reduce, replica 0 offers {expected}; every replica must offer the same range")]
    RangeMismatch { replica: usize, got: u64, expected: u64 },
    #[error("the all-reduce range of replica {replica} starts at byte {offset}: it must be a multiple of 4")]
    Unaligned { replica: usize, offset: u64 },
    #[error("replica {replica} says the final part of the buffer starts at byte {offset}, after {before} where it started before: a final part cannot shrink")]
    Shrunk { replica: usize, offset: u64, before: u64 },
    #[error("replica {replica} is not one of the {replicas} replicas of this rendezvous")]
    UnknownReplica { replica: usize, replicas: usize },
    #[error("abandoned because replica {replica} failed: {message}")]
    Aborted { replica: usize, message: String },
    #[error("MPI: {0}")]
    Mpi(String),
    #[error("rank(s) {ranks:?} differ from rank 0 in {what}: every rank must run the same settings and model")]
    Disagree { what: String, ranks: Vec<usize> },
}

pub type Result<T, E = CollectiveError> = std::result::Result<T, E>;

/// An all-reduced range as [`Peers::reduce_beside`] gives it: handed to its `out` already
/// (in-process), or on its way from the other processes.
#[derive(Clone)]
pub enum Incoming {
    Written,
    Coming(Coming),
}

/// Reduced values on their way: every local replica awaits (a clone of) the same future.
pub type Coming = Shared<LocalBoxFuture<'static, Result<Arc<Vec<f32>>>>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the number of replicas (exact only for powers of two).
    Mean,
}

/// All-reduces across replicas: `parts[r]` is replica r's device and its pieces (ranges of the
/// same length, `plan.pieces_of(r)` of them), which `plan` adds up. Afterwards every replica's
/// first piece holds the identical f32 bytes, the plan's sum (or mean); its other pieces are
/// left as they were. Pass large ranges (whole flat gradient buffers), not one per tensor: every
/// call costs a round trip. Allocates its staging each call; a training step uses
/// [`BucketAllReduce`] instead.
pub async fn all_reduce(
    parts: &[(&Gpu, Vec<Slice<'_>>)],
    plan: &Plan,
    op: ReduceOp,
    peers: &Peers,
) -> Result<()> {
    let len = parts.first().and_then(|(_, p)| p.first()).ok_or(CollectiveError::NoReplicas)?.len;
    let holders = plan.leaves.iter().map(|&(h, _)| h + 1).max().unwrap_or(0);
    if parts.len() * peers.ranks() != holders {
        let got = parts.len() * peers.ranks();
        return Err(CollectiveError::ReplicaCount { got, expected: holders });
    }
    let first = peers.first_replica(parts.len());
    for (i, (_, pieces)) in parts.iter().enumerate() {
        let replica = first + i;
        if pieces.len() != plan.pieces_of(replica) {
            let (got, expected) = (pieces.len(), plan.pieces_of(replica));
            return Err(CollectiveError::PieceCount { replica, got, expected });
        }
        for s in pieces {
            if s.len != len {
                return Err(CollectiveError::RangeMismatch { replica, got: s.len, expected: len });
            }
            if s.offset % 4 != 0 {
                return Err(CollectiveError::Unaligned { replica, offset: s.offset });
            }
        }
    }
    let reads = parts.iter().enumerate().map(|(i, (gpu, pieces))| async move {
        let mut encoder = gpu.encoder();
        let read = gpu.record_read(&mut encoder, pieces);
        let gpu_error = |source| CollectiveError::Gpu { replica: first + i, source };
        gpu.submit(encoder).await.map_err(gpu_error)?;
        read.read::<f32>(gpu).await.map_err(gpu_error)
    });
    let local = futures::future::try_join_all(reads).await?;
    let local: Vec<&[f32]> = local.iter().map(|v| &v[..]).collect();
    let mut reduced = Vec::with_capacity(len as usize);
    peers.reduce(&local, plan, op, len as usize, |_, chunk| reduced.extend_from_slice(chunk))?;
    for (i, (gpu, pieces)) in parts.iter().enumerate() {
        let s = pieces[0];
        gpu.scoped(|| gpu.queue.write_buffer(s.buffer, s.offset, bytemuck::cast_slice(&reduced)))
            .await
            .map_err(|source| CollectiveError::Gpu { replica: first + i, source })?;
    }
    Ok(())
}

/// The plan's leaves, in its order, out of each replica's pieces laid one after the other.
pub(crate) fn leaves<'a, T: AsRef<[f32]>>(
    plan: &Plan,
    replicas: &'a [T],
    len: usize,
) -> Vec<&'a [f32]> {
    plan.leaves
        .iter()
        .map(|&(r, piece)| &replicas[r].as_ref()[piece * len..(piece + 1) * len])
        .collect()
}

/// Element-wise sum (or mean) of equally long `leaves` in f32, added along `plan` (the
/// canonical tree, [`crate::canonical`]): when the leaves are the sums of the canonical pieces
/// of a batch's examples, the result is, bit for bit, the sum one device takes over the whole
/// batch. (A sum in f64 rounded once would be closer to exact, but not that.)
pub fn reduce(leaves: &[&[f32]], plan: &Plan, op: ReduceOp) -> Vec<f32> {
    let mut out = Vec::with_capacity(leaves.iter().map(|p| p.len()).min().unwrap_or(0));
    reduce_chunks(leaves, plan, op, |_, chunk| out.extend_from_slice(chunk));
    out
}

/// Elements [`reduce_chunks`] reduces at a time: its few chunk buffers stay in the L1 cache.
const CHUNK: usize = 4096;

/// [`reduce`] without allocating the result: hands the reduced values to `out` a chunk at a
/// time, with the index of the chunk's first element, so the caller can write them straight into
/// mapped staging. Every element is summed in the same order as by [`reduce`]: the same bits.
/// Leaves should be equally long; the shortest decides.
pub fn reduce_chunks(
    leaves: &[&[f32]],
    plan: &Plan,
    op: ReduceOp,
    mut out: impl FnMut(usize, &[f32]),
) {
    let len = leaves.iter().map(|p| p.len()).min().unwrap_or(0);
    let holders = plan.leaves.iter().map(|&(h, _)| h + 1).max().unwrap_or(1);
    // Chunk buffers, reused from chunk to chunk: a plan of R leaves holds at most R − 1 sums.
    let mut spare: Vec<Vec<f32>> = Vec::new();
    for start in (0..len).step_by(CHUNK) {
        let n = CHUNK.min(len - start);
        let sum = plan.run(
            |i| Part::Leaf(&leaves[i][start..start + n]),
            |left, right| left.add(right, &mut spare),
        );
        let mut sum = match (sum, op) {
            (Part::Leaf(values), ReduceOp::Sum) => {
                out(start, values);
                continue;
            }
            (sum, _) => sum.into_sum(&mut spare),
        };
        if op == ReduceOp::Mean {
            let r = holders as f32;
            sum.iter_mut().for_each(|v| *v /= r);
        }
        out(start, &sum);
        spare.push(sum);
    }
}

/// `values` in a chunk buffer from `spare`, or a new one where none is spare.
fn chunk_buffer(spare: &mut Vec<Vec<f32>>, values: impl Iterator<Item = f32>) -> Vec<f32> {
    let mut buffer = spare.pop().unwrap_or_default();
    buffer.clear();
    buffer.extend(values);
    buffer
}

/// A value on the plan's stack within one chunk of [`reduce_chunks`]: a leaf's values, read
/// where they lie (copying them first would take as long as the sum itself), or a sum in a chunk
/// buffer.
enum Part<'a> {
    Leaf(&'a [f32]),
    Sum(Vec<f32>),
}

impl Part<'_> {
    fn values(&self) -> &[f32] {
        match self {
            Part::Leaf(values) => values,
            Part::Sum(values) => values,
        }
    }

    /// `self + right`, element by element, into a chunk buffer: one of theirs where either is a
    /// sum (IEEE addition commutes exactly, so which one holds it does not change a bit), else
    /// one from `spare`; a buffer freed goes back there.
    fn add(self, right: Part<'_>, spare: &mut Vec<Vec<f32>>) -> Part<'static> {
        match (self, right) {
            (Part::Sum(mut sum), right) => {
                sum.iter_mut().zip(right.values()).for_each(|(l, r)| *l += r);
                if let Part::Sum(freed) = right {
                    spare.push(freed);
                }
                Part::Sum(sum)
            }
            (Part::Leaf(left), Part::Sum(mut sum)) => {
                sum.iter_mut().zip(left).for_each(|(r, l)| *r += l);
                Part::Sum(sum)
            }
            (Part::Leaf(left), Part::Leaf(right)) => {
                Part::Sum(chunk_buffer(spare, left.iter().zip(right).map(|(l, r)| l + r)))
            }
        }
    }

    /// The values in a chunk buffer of their own.
    fn into_sum(self, spare: &mut Vec<Vec<f32>>) -> Vec<f32> {
        match self {
            Part::Sum(sum) => sum,
            Part::Leaf(values) => chunk_buffer(spare, values.iter().copied()),
        }
    }
}

/// One round of a [`Rendezvous`]: what has been deposited, the merged value once everyone has
/// arrived, and who is waiting for it.
struct Round<T, M> {
    deposits: Vec<Option<T>>,
    merged: Option<Rc<M>>,
    waiting: Vec<Option<Waker>>,
    /// Replicas that have taken the merged value; the round is dropped when all have.
    taken: usize,
}

struct State<T, M> {
    /// The round each replica deposits into next. Replicas move through rounds in the same
    /// order; a fast one may be one round ahead of a slow one that has not yet woken.
    next_round: Vec<u64>,
    rounds: BTreeMap<u64, Round<T, M>>,
    aborted: Option<(usize, String)>,
}

/// R replicas meeting in numbered rounds to merge values of type `T` into one of type `M` (see
/// the module comment). Single-threaded by design (`Rc`, `RefCell`): the replicas are futures
/// on one thread.
pub struct Rendezvous<T, M = T> {
    replicas: usize,
    merge: Box<dyn Fn(Vec<T>) -> M>,
    state: RefCell<State<T, M>>,
}

impl<T, M> Rendezvous<T, M> {
    /// A rendezvous of `replicas` participants; `merge` gets every round's deposits in
    /// replica order and returns what all of them receive.
    pub fn new(replicas: usize, merge: impl Fn(Vec<T>) -> M + 'static) -> Self {
        Rendezvous {
            replicas,
            merge: Box::new(merge),
            state: RefCell::new(State {
                next_round: vec![0; replicas],
                rounds: BTreeMap::new(),
                aborted: None,
            }),
        }
    }

    /// Deposits `local` for `replica`'s next round and waits until every replica has
    /// deposited; returns the merged value (the same `Rc` for all), or an error once any
    /// replica has aborted.
    pub async fn exchange(&self, replica: usize, local: T) -> Result<Rc<M>> {
        let round = self.deposit(replica, local)?;
        futures::future::poll_fn(|cx| {
            let mut state = self.state.borrow_mut();
            if let Some((replica, message)) = &state.aborted {
                return Poll::Ready(Err(CollectiveError::Aborted {
                    replica: *replica,
                    message: message.clone(),
                }));
            }
            let r = state
                .rounds
                .get_mut(&round)
                .expect("a round stays until every replica has taken its value");
            match r.merged.clone() {
                Some(merged) => {
                    r.taken += 1;
                    if r.taken == self.replicas {
                        state.rounds.remove(&round);
                    }
                    Poll::Ready(Ok(merged))
                }
                None => {
                    r.waiting[replica] = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        })
        .await
    }

    /// Puts `local` into `replica`'s next round, merging (and waking the others) if it was the
    /// last deposit. Returns the round number.
    fn deposit(&self, replica: usize, local: T) -> Result<u64> {
        if replica >= self.replicas {
            return Err(CollectiveError::UnknownReplica { replica, replicas: self.replicas });
        }
        let (round, wake) = {
            let mut state = self.state.borrow_mut();
            if let Some((replica, message)) = &state.aborted {
                return Err(CollectiveError::Aborted {
                    replica: *replica,
                    message: message.clone(),
                });
            }
            let round = state.next_round[replica];
            state.next_round[replica] += 1;
            let n = self.replicas;
            let r = state.rounds.entry(round).or_insert_with(|| Round {
                deposits: (0..n).map(|_| None).collect(),
                merged: None,
                waiting: vec![None; n],
                taken: 0,
            });
            r.deposits[replica] = Some(local);
            if r.deposits.iter().all(Option::is_some) {
                let parts =
                    r.deposits.iter_mut().map(|d| d.take().expect("all deposited")).collect();
                r.merged = Some(Rc::new((self.merge)(parts)));
                (round, r.waiting.iter_mut().filter_map(Option::take).collect())
            } else {
                (round, Vec::new())
            }
        };
        wake.into_iter().for_each(Waker::wake);
        Ok(round)
    }

    /// Abandons the rendezvous because `replica` failed: every waiting replica, and every later
    /// exchange, returns [`CollectiveError::Aborted`] naming it. The first abort is kept.
    pub fn abort(&self, replica: usize, message: impl Into<String>) {
        let wake: Vec<Waker> = {
            let mut state = self.state.borrow_mut();
            if state.aborted.is_none() {
                state.aborted = Some((replica, message.into()));
            }
            state
                .rounds
                .values_mut()
                .flat_map(|r| r.waiting.iter_mut().filter_map(Option::take))
                .collect()
        };
        wake.into_iter().for_each(Waker::wake);
    }
}

/// Lets the other futures of the same `join_all` (the other replicas) run before this one
/// continues: returns Pending once, asking to be polled again.
pub async fn yield_now() {
    let mut yielded = false;
    futures::future::poll_fn(|cx| {
        if yielded {
            return Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::future::join_all;

    fn summing(replicas: usize) -> Rendezvous<Vec<u32>> {
        Rendezvous::new(replicas, |parts: Vec<Vec<u32>>| {
            // The order is part of the contract: record it, then sum.
            let mut out: Vec<u32> = parts.iter().map(|p| p[0]).collect();
            out.push(parts.iter().map(|p| p[0]).sum());
            out
        })
    }

    #[test]
    fn every_replica_gets_the_same_merge_in_replica_order_round_after_round() {
        let rv = summing(3);
        let replica = |r: usize| {
            let rv = &rv;
            async move {
                let mut seen = Vec::new();
                for round in 0..4u32 {
                    // Replicas arrive in a different order each round.
                    for _ in 0..(r as u32 + round) % 3 {
                        yield_now().await;
                    }
                    seen.push(rv.exchange(r, vec![10 * round + r as u32]).await.unwrap());
                }
                seen
            }
        };
        let results = pollster::block_on(join_all((0..3).map(replica)));
        for round in 0..4u32 {
            let want = vec![10 * round, 10 * round + 1, 10 * round + 2, 30 * round + 3];
            for seen in &results {
                assert_eq!(*seen[round as usize], want);
                assert!(Rc::ptr_eq(&seen[round as usize], &results[0][round as usize]));
            }
        }
        assert!(rv.state.borrow().rounds.is_empty(), "finished rounds are dropped");
    }

    #[test]
    fn a_failing_replica_releases_the_waiting_ones_with_its_name() {
        let rv = summing(3);
        let waiting = |r: usize| {
            let rv = &rv;
            async move { rv.exchange(r, vec![r as u32]).await.map(|_| ()) }
        };
        let failing = async {
            yield_now().await;
            rv.abort(2, "GPU device lost");
            Err::<(), _>(CollectiveError::Gpu {
                replica: 2,
                source: GpuError::DeviceLost("test".into()),
            })
        };
        let (a, b, c) = pollster::block_on(futures::future::join3(waiting(0), waiting(1), failing));
        for e in [a.unwrap_err(), b.unwrap_err()] {
            assert!(matches!(&e, CollectiveError::Aborted { replica: 2, .. }), "{e}");
            assert!(e.to_string().contains("replica 2 failed: GPU device lost"), "{e}");
        }
        assert!(c.is_err());
        let late = pollster::block_on(rv.exchange(0, vec![0]));
        assert!(matches!(late, Err(CollectiveError::Aborted { replica: 2, .. })));
    }

    #[test]
    fn reduce_adds_along_the_plan_and_the_mean_divides_once() {
        let three =
            [vec![1.0f32, 0.1], vec![f32::EPSILON / 2.0, 0.2], vec![f32::EPSILON / 2.0, 0.3]];
        let leaves: Vec<&[f32]> = three.iter().map(Vec::as_slice).collect();
        // Three parts: (a + b) + c.
        assert_eq!(
            reduce(&leaves, &Plan::one_piece_each(3), ReduceOp::Sum),
            vec![(1.0 + f32::EPSILON / 2.0) + f32::EPSILON / 2.0, (0.1f32 + 0.2) + 0.3]
        );
        assert_eq!(
            reduce(&leaves, &Plan::one_piece_each(3), ReduceOp::Mean)[1],
            ((0.1f32 + 0.2) + 0.3) / 3.0
        );
        assert_eq!(reduce(&[&[7.25f32]], &Plan::single(), ReduceOp::Mean), vec![7.25]);
        // Uneven shards of 5 examples over 2 replicas: [0, 3) in pieces [0, 2), [2, 3); [3, 5)
        // in [3, 4), [4, 5): ((e0 + e1) + (e2 + e3)) + e4, whoever holds what.
        let plan = Plan::new(&crate::canonical::shards(5, 2), 5);
        assert_eq!(plan.leaves, [(0, 0), (0, 1), (1, 0), (1, 1)]);
        let e = [1e8f32, 3.0, -1e8, 0.5, 0.25];
        let pieces: [&[f32]; 4] = [&[e[0] + e[1]], &[e[2]], &[e[3]], &[e[4]]];
        assert_eq!(
            reduce(&pieces, &plan, ReduceOp::Sum)[0],
            ((e[0] + e[1]) + (e[2] + e[3])) + e[4]
        );
    }

    /// Every element of `reduce_chunks` is the plan's sum of that element's leaves added as
    /// scalars, whichever of a leaf or a sum each addition takes on either side (the plans of
    /// uneven shards have all four), with one leaf alone, and divided for the mean.
    #[test]
    fn reduce_chunks_adds_each_element_as_the_plan_adds_scalars() {
        let len = CHUNK + 5;
        // Magnitudes 2^-10 … 2^9 and both signs: sums that round, so an order change shows.
        let value = |leaf: usize, i: usize| {
            let mantissa = 1.0 + ((i * 31 + leaf * 17) % 97) as f32 / 97.0;
            let sign = if (i + leaf).is_multiple_of(3) { -1.0 } else { 1.0 };
            sign * mantissa * 2f32.powi(((i + 3 * leaf) % 20) as i32 - 10)
        };
        let mut additions = std::collections::BTreeSet::new();
        for batch in 1..=13u64 {
            for replicas in 1..=batch.min(5) {
                let plan = Plan::new(&crate::canonical::shards(batch, replicas), batch);
                let parts: Vec<Vec<f32>> = (0..plan.leaves.len())
                    .map(|l| (0..len).map(|i| value(l, i)).collect())
                    .collect();
                let leaves: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
                // Which additions the plan makes: (left is a leaf, right is a leaf).
                plan.run(
                    |_| true,
                    |left, right| {
                        additions.insert((left, right));
                        false
                    },
                );
                for op in [ReduceOp::Sum, ReduceOp::Mean] {
                    let mut got = vec![f32::NAN; len];
                    reduce_chunks(&leaves, &plan, op, |start, chunk| {
                        got[start..start + chunk.len()].copy_from_slice(chunk)
                    });
                    for (i, got) in got.iter().enumerate() {
                        let sum = plan.run(|l| leaves[l][i], |a, b| a + b);
                        let want = match op {
                            ReduceOp::Sum => sum,
                            ReduceOp::Mean => sum / replicas as f32,
                        };
                        let at = format!("batch {batch}, {replicas} replicas, {op:?}, element {i}");
                        assert_eq!(got.to_bits(), want.to_bits(), "{at}");
                    }
                }
            }
        }
        let all = [(false, false), (false, true), (true, false), (true, true)];
        assert_eq!(additions.into_iter().collect::<Vec<_>>(), all);
    }

    #[test]
    fn reduce_chunks_sums_each_element_as_reduce_sums_it_alone() {
        // Longer than a few chunks, and R = 5 and 6 leave several blocks open at the end.
        let len = 2 * CHUNK + 7;
        for replicas in [5, 6] {
            let parts: Vec<Vec<f32>> = (0..replicas)
                .map(|r| {
                    (0..len)
                        .map(|i| ((i * 7 + r * 13) % 101) as f32 / (r as f32 + 0.3) - 40.0)
                        .collect()
                })
                .collect();
            let leaves: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
            let plan = Plan::one_piece_each(replicas);
            for op in [ReduceOp::Sum, ReduceOp::Mean] {
                let got = reduce(&leaves, &plan, op);
                assert_eq!(got.len(), len);
                for i in [0, 1, CHUNK - 1, CHUNK, 2 * CHUNK + 6] {
                    let one: Vec<[f32; 1]> = parts.iter().map(|p| [p[i]]).collect();
                    let one: Vec<&[f32]> = one.iter().map(|p| &p[..]).collect();
                    let alone = reduce(&one, &plan, op)[0];
                    assert_eq!(
                        got[i].to_bits(),
                        alone.to_bits(),
                        "{replicas} parts, {op:?}, element {i}"
                    );
                }
                let mut starts = Vec::new();
                reduce_chunks(&leaves, &plan, op, |start, chunk| {
                    assert_eq!(chunk, &got[start..start + chunk.len()]);
                    starts.push(start);
                });
                assert_eq!(starts, [0, CHUNK, 2 * CHUNK]);
            }
        }
    }
}
