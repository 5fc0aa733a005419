//! The `collective` layer: moving numbers between R replicas' devices, knowing nothing of what
//! they mean. wgpu devices share no memory, so everything goes through the host:
//!
//! - [`all_reduce`]: one buffer range per replica is copied to MAP_READ staging, all maps are
//!   joined, the host reduces in a fixed pairwise order over replicas (see [`reduce`]), and the
//!   SAME bytes are written back to every replica. Same bytes in, so replicas never drift.
//! - [`Rendezvous`]: R replica futures, running concurrently under one `join_all` on one thread
//!   (natively or in a browser), meet in numbered rounds. Each deposits its local value; the
//!   last to arrive merges all deposits (in replica order, with the merge the rendezvous was
//!   built with) and every replica receives the same merged value. Waiting is by wakers: no
//!   threads, no spinning, no atomics. A replica that fails calls [`Rendezvous::abort`], so
//!   the others return an error instead of waiting forever.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::task::{Poll, Waker};

use crate::gpu::{Gpu, GpuError, Slice};

#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("replica {replica}: {source}")]
    Gpu {
        replica: usize,
        #[source]
        source: GpuError,
    },
    #[error("a collective needs at least one replica")]
    NoReplicas,
    #[error("replica {replica} offers {got} elements to the all-reduce, replica 0 offers {expected}; every replica must offer the same range")]
    RangeMismatch { replica: usize, got: u64, expected: u64 },
    #[error("the all-reduce range of replica {replica} starts at byte {offset}: it must be a multiple of 4")]
    Unaligned { replica: usize, offset: u64 },
    #[error("replica {replica} is not one of the {replicas} replicas of this rendezvous")]
    UnknownReplica { replica: usize, replicas: usize },
    #[error("abandoned because replica {replica} failed: {message}")]
    Aborted { replica: usize, message: String },
}

pub type Result<T, E = CollectiveError> = std::result::Result<T, E>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Mean,
}

/// All-reduces one range across replicas: `parts[r]` is replica r's device and its range (the
/// same length everywhere). Afterwards every range holds the identical f32 bytes: the sum (or
/// mean) over replicas in the pairwise order of [`reduce`]. Pass one large
/// range (a whole flat gradient buffer), not one per tensor: every call costs a round trip.
pub async fn all_reduce(parts: &[(&Gpu, Slice<'_>)], op: ReduceOp) -> Result<()> {
    let (_, first) = parts.first().ok_or(CollectiveError::NoReplicas)?;
    for (replica, (_, s)) in parts.iter().enumerate() {
        if s.len != first.len {
            return Err(CollectiveError::RangeMismatch { replica, got: s.len, expected: first.len });
        }
        if s.offset % 4 != 0 {
            return Err(CollectiveError::Unaligned { replica, offset: s.offset });
        }
    }
    let reads = parts.iter().enumerate().map(|(replica, (gpu, s))| async move {
        gpu.read::<f32>(*s).await.map_err(|source| CollectiveError::Gpu { replica, source })
    });
    let local = futures::future::try_join_all(reads).await?;
    let reduced = reduce(local, op);
    for (replica, (gpu, s)) in parts.iter().enumerate() {
        gpu.scoped(|| gpu.queue.write_buffer(s.buffer, s.offset, bytemuck::cast_slice(&reduced)))
            .await
            .map_err(|source| CollectiveError::Gpu { replica, source })?;
    }
    Ok(())
}

/// Element-wise sum or mean of equally long vectors, in f32, summed pairwise in replica order
/// as a binary counter: part r closes the blocks of 2^l parts ending at r (l < the number of
/// trailing ones of r). That is the order in which the kernels sum a batch's examples, so when
/// each part is a shard's sum over 2^k examples (a subtree of the batch's sum) the result is,
/// bit for bit, the sum one device takes over the whole batch; a sum in f64 rounded once
/// would be closer to exact but not that. The mean divides the sum by R (exact for R a power of
/// two).
pub fn reduce(parts: Vec<Vec<f32>>, op: ReduceOp) -> Vec<f32> {
    let replicas = parts.len();
    // blocks[l]: the sum of the latest block of 2^l parts not yet paired with its left sibling.
    let mut blocks: Vec<Option<Vec<f32>>> = Vec::new();
    for (r, mut v) in parts.into_iter().enumerate() {
        let mut l = 0;
        while (r >> l) & 1 == 1 {
            let left = blocks[l].take().expect("a set bit of r has its block");
            // IEEE addition commutes exactly: only the tree's shape matters.
            v.iter_mut().zip(&left).for_each(|(v, left)| *v += left);
            l += 1;
        }
        if blocks.len() <= l {
            blocks.resize(l + 1, None);
        }
        blocks[l] = Some(v);
    }
    // The open blocks are the set bits of R, the earliest parts in the highest: add them up from
    // the smallest, each as the left operand.
    let mut sum: Option<Vec<f32>> = None;
    for block in blocks.into_iter().flatten() {
        sum = Some(match sum {
            None => block,
            Some(mut s) => {
                s.iter_mut().zip(&block).for_each(|(s, left)| *s += left);
                s
            }
        });
    }
    let mut sum = sum.unwrap_or_default();
    if op == ReduceOp::Mean {
        let r = replicas as f32;
        sum.iter_mut().for_each(|v| *v /= r);
    }
    sum
}

/// One round of a [`Rendezvous`]: what has been deposited, the merged value once everyone has
/// arrived, and who is waiting for it.
struct Round<T> {
    deposits: Vec<Option<T>>,
    merged: Option<Rc<T>>,
    waiting: Vec<Option<Waker>>,
    /// Replicas that have taken the merged value; the round is dropped when all have.
    taken: usize,
}

struct State<T> {
    /// The round each replica deposits into next. Replicas move through rounds in the same
    /// order; a fast one may be one round ahead of a slow one that has not yet woken.
    next_round: Vec<u64>,
    rounds: BTreeMap<u64, Round<T>>,
    aborted: Option<(usize, String)>,
}

/// R replicas meeting in numbered rounds to merge values (see the module comment).
/// Single-threaded by design (`Rc`, `RefCell`): the replicas are futures on one thread.
pub struct Rendezvous<T> {
    replicas: usize,
    merge: Box<dyn Fn(Vec<T>) -> T>,
    state: RefCell<State<T>>,
}

impl<T> Rendezvous<T> {
    /// A rendezvous of `replicas` participants; `merge` gets every round's deposits in
    /// replica order and returns what all of them receive.
    pub fn new(replicas: usize, merge: impl Fn(Vec<T>) -> T + 'static) -> Self {
        Rendezvous {
            replicas,
            merge: Box::new(merge),
            state: RefCell::new(State { next_round: vec![0; replicas], rounds: BTreeMap::new(), aborted: None }),
        }
    }

    /// Deposits `local` for `replica`'s next round and waits until every replica has
    /// deposited; returns the merged value (the same `Rc` for all), or an error once any
    /// replica has aborted.
    pub async fn exchange(&self, replica: usize, local: T) -> Result<Rc<T>> {
        let round = self.deposit(replica, local)?;
        futures::future::poll_fn(|cx| {
            let mut state = self.state.borrow_mut();
            if let Some((replica, message)) = &state.aborted {
                return Poll::Ready(Err(CollectiveError::Aborted { replica: *replica, message: message.clone() }));
            }
            let r = state.rounds.get_mut(&round).expect("a round stays until every replica has taken its value");
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
                return Err(CollectiveError::Aborted { replica: *replica, message: message.clone() });
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
                let parts = r.deposits.iter_mut().map(|d| d.take().expect("all deposited")).collect();
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
            state.rounds.values_mut().flat_map(|r| r.waiting.iter_mut().filter_map(Option::take)).collect()
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
            Err::<(), _>(CollectiveError::Gpu { replica: 2, source: GpuError::DeviceLost("test".into()) })
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
    fn reduce_adds_pairwise_so_shard_sums_rebuild_the_whole_sum() {
        let terms: Vec<f32> = (0..16).map(|i| 1.0 / (i as f32 + 0.37) - 0.5 * (i % 3) as f32).collect();
        let scalars = |t: &[f32]| t.iter().map(|&v| vec![v]).collect::<Vec<_>>();
        let whole = reduce(scalars(&terms), ReduceOp::Sum)[0];
        assert_eq!(whole, (((terms[0] + terms[1]) + (terms[2] + terms[3])) + ((terms[4] + terms[5]) + (terms[6] + terms[7])))
            + (((terms[8] + terms[9]) + (terms[10] + terms[11])) + ((terms[12] + terms[13]) + (terms[14] + terms[15]))));
        for shards in [2, 4, 8] {
            let sums: Vec<f32> = terms.chunks(16 / shards).map(|c| reduce(scalars(c), ReduceOp::Sum)[0]).collect();
            assert_eq!(reduce(scalars(&sums), ReduceOp::Sum)[0].to_bits(), whole.to_bits(), "{shards} shards");
        }
        // Three parts: (a + b) + c; the mean divides once.
        let three = [vec![1.0f32, 0.1], vec![f32::EPSILON / 2.0, 0.2], vec![f32::EPSILON / 2.0, 0.3]];
        assert_eq!(reduce(three.to_vec(), ReduceOp::Sum), vec![(1.0 + f32::EPSILON / 2.0) + f32::EPSILON / 2.0, (0.1f32 + 0.2) + 0.3]);
        assert_eq!(reduce(three.to_vec(), ReduceOp::Mean)[1], ((0.1f32 + 0.2) + 0.3) / 3.0);
        assert_eq!(reduce(vec![vec![7.25f32]], ReduceOp::Mean), vec![7.25]);
    }
}
