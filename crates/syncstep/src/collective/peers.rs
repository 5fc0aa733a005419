//! Where the other replicas of a data-parallel step are: all in this process ([`Peers::InProcess`],
//! the default), or spread over MPI ranks, L replicas per rank ([`Peers::Mpi`], `--mpi`). The
//! step code does not know which: it hands this process's replicas' values to [`Peers::gather`]
//! and [`Peers::reduce`] and gets every replica's back. Both keep the canonical order, so the
//! bits do not depend on where the replicas run.

use super::{leaves, reduce_chunks, CollectiveError, Incoming, ReduceOp, Result};
use crate::canonical::Plan;

#[derive(Clone, Default)]
pub enum Peers {
    /// Every replica lives in this process.
    #[default]
    InProcess,
    /// This process is one rank of several, each holding the same number of replicas: rank q
    /// holds replicas q·L … q·L + L − 1.
    #[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
    Mpi(std::rc::Rc<super::mpi::Ranks>),
}

impl Peers {
    /// This process's rank, 0 in-process.
    pub fn rank(&self) -> usize {
        match self {
            Peers::InProcess => 0,
            #[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
            Peers::Mpi(ranks) => ranks.rank(),
        }
    }

    /// How many processes hold replicas, 1 in-process.
    pub fn ranks(&self) -> usize {
        match self {
            Peers::InProcess => 1,
            #[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
            Peers::Mpi(ranks) => ranks.size(),
        }
    }

    /// Bytes this process has received from other processes so far (0 in-process, where
    /// nothing crosses a process boundary).
    pub fn received_bytes(&self) -> u64 {
        match self {
            Peers::InProcess => 0,
            #[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
            Peers::Mpi(ranks) => ranks.received_bytes(),
        }
    }

    /// The global index of this process's first replica, when it holds `local` of them.
    pub fn first_replica(&self, local: usize) -> usize {
        self.rank() * local
    }

    /// Every replica's values in replica order, from this process's replicas' `local` (values
    /// of any length; every rank passes as many replicas).
    pub fn gather(&self, local: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        match self {
            Peers::InProcess => Ok(local),
            #[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
            Peers::Mpi(ranks) => ranks.gather(local),
        }
    }

    /// [`gather`](Self::gather) of bytes.
    pub fn gather_bytes(&self, local: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        match self {
            Peers::InProcess => Ok(local),
            #[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
            Peers::Mpi(ranks) => ranks.gather(local),
        }
    }

    /// The all-reduce of one range of `len` elements: `local[i]` holds this process's i-th
    /// replica's pieces of it, one after the other (as many as `plan` gives that replica).
    /// Hands the reduced values to `out` with the index of their first element, in order; every
    /// process gets the same bits, the plan's sum ([`reduce_chunks`]).
    pub fn reduce(
        &self,
        local: &[&[f32]],
        plan: &Plan,
        op: ReduceOp,
        len: usize,
        out: impl FnMut(usize, &[f32]),
    ) -> Result<()> {
        self.check_pieces(local, plan, len)?;
        match self {
            Peers::InProcess => {
                reduce_chunks(&leaves(plan, local, len), plan, op, out);
                Ok(())
            }
            #[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
            Peers::Mpi(ranks) => ranks.reduce(local, plan, op, len, out),
        }
    }

    /// [`reduce`](Self::reduce), beside this thread's work where the values cross processes:
    /// in-process the reduced values go to `out` before it returns ([`Incoming::Written`]);
    /// over MPI they come later, on the communication thread ([`Incoming::Coming`]), and `out`
    /// is not called.
    pub fn reduce_beside(
        &self,
        local: &[&[f32]],
        plan: &Plan,
        op: ReduceOp,
        len: usize,
        out: impl FnMut(usize, &[f32]),
    ) -> Result<Incoming> {
        match self {
            Peers::InProcess => self.reduce(local, plan, op, len, out).map(|()| Incoming::Written),
            #[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
            Peers::Mpi(ranks) => {
                self.check_pieces(local, plan, len)?;
                let owned = local.iter().map(|pieces| pieces.to_vec()).collect();
                Ok(ranks.reduce_beside(owned, plan.clone(), op, len))
            }
        }
    }

    /// Each of this process's replicas offers as many pieces of `len` elements as `plan` adds.
    fn check_pieces(&self, local: &[&[f32]], plan: &Plan, len: usize) -> Result<()> {
        let first = self.first_replica(local.len());
        for (i, pieces) in local.iter().enumerate() {
            let expected = (plan.pieces_of(first + i) * len) as u64;
            if pieces.len() as u64 != expected {
                let (replica, got) = (first + i, pieces.len() as u64);
                return Err(CollectiveError::RangeMismatch { replica, got, expected });
            }
        }
        Ok(())
    }

    /// The largest of every process's `value` (a flag that any one of them may raise).
    pub fn max(&self, value: u64) -> Result<u64> {
        let bytes = postcard::to_allocvec(&value).expect("a u64 serialises");
        let all = self.gather_bytes(vec![bytes])?;
        let value = |b: &Vec<u8>| postcard::from_bytes::<u64>(b).unwrap_or(0);
        Ok(all.iter().map(value).max().unwrap_or(0))
    }

    /// Waits, idle, until every process has come here (nothing to wait for in-process).
    pub fn idle_barrier(&self) {
        match self {
            Peers::InProcess => {}
            #[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
            Peers::Mpi(ranks) => ranks.idle_barrier(),
        }
    }

    /// Checks that every rank holds the same `value` of `what` (a hash of its settings, say):
    /// an error naming the ranks that differ from rank 0. In-process there is nothing to compare.
    pub fn agree(&self, what: &str, value: u64) -> Result<()> {
        match self {
            Peers::InProcess => {
                let _ = (what, value);
                Ok(())
            }
            #[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
            Peers::Mpi(ranks) => ranks.agree(what, value),
        }
    }
}
