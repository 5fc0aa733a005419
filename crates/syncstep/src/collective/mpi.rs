//! The MPI side of [`Peers`](super::Peers): this process is one rank of `mpirun -np P`, holding
//! L replicas. Nothing here sums in an order MPI chooses (no `MPI_Allreduce`): ranks only move
//! bytes, and every sum is the canonical plan's, taken on the host as in-process.
//!
//! - `Ranks::gather`: every rank's replicas' values to every rank (`MPI_Allgatherv`): the
//!   BatchNorm rows, the per-example losses, the logits.
//! - `Ranks::reduce`: a reduce-scatter then an all-gather. Rank q owns the q-th of P
//!   contiguous chunks of the range; every rank sends each rank the pieces of its chunk
//!   (`MPI_Alltoallv`), the owner adds all replicas' pieces along the plan, and the reduced
//!   chunks go to every rank (`MPI_Allgatherv`). Each element is summed in the plan's order by
//!   one rank, so the bits are in-process's; per rank, 2(P − 1)/P of the range moves each way
//!   (times the pieces per replica in the first half), the bandwidth-optimal all-reduce.
//! - `Ranks::reduce_beside`: the same reduce on a communication thread with a communicator of
//!   its own, as PyTorch's DDP runs its buckets on a communication stream: the gradient buckets
//!   cross the links while this thread records and submits the rest of the backward and the
//!   BatchNorm rows go their own way. Each communicator's collectives are issued in the same
//!   order on every rank (the bucket rounds', the step's), as MPI requires; MPI is started with
//!   `MPI_THREAD_MULTIPLE` so that the two threads may call it at once.
//! - A heartbeat thread, with a third communicator, tells every other rank once a second that
//!   this one lives. A rank that hears nothing from some rank for `silence` (a host down, its
//!   link cut, the process stopped) names it and ends the job, where MPI's own TCP would wait
//!   for minutes: every rank ends non-zero, the unreachable ones by their own heartbeat.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use futures::channel::oneshot;
use futures::FutureExt;
use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::request::{Request, StaticScope};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Count;

use super::{reduce_chunks, CollectiveError, Incoming, ReduceOp, Result};
use crate::canonical::Plan;

/// A job for the communication thread, run with its communicator.
type Job = Box<dyn FnOnce(&SimpleCommunicator) + Send>;

/// The MPI environment of this process (initialised once; finalised when dropped), its world
/// communicator, and the communication thread with its own.
pub struct Ranks {
    world: SimpleCommunicator,
    /// Bytes this rank has received from the others so far, on either thread: what its link
    /// carries inbound, whatever algorithm MPI runs underneath.
    received: Arc<AtomicU64>,
    /// The communication thread's queue (`None` once dropped, which ends the thread) and the
    /// thread, joined before MPI is finalised.
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Tells the heartbeat thread to say goodbye, and the thread.
    stop: Arc<AtomicBool>,
    heartbeat: Option<std::thread::JoinHandle<()>>,
    /// Finalises MPI when dropped, unless [`Ranks::leave_unfinalized`] was called.
    universe: Option<Universe>,
    finalize: std::cell::Cell<bool>,
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.jobs.take();
        self.stop.store(true, Ordering::Relaxed);
        for thread in [self.thread.take(), self.heartbeat.take()].into_iter().flatten() {
            let _ = thread.join();
        }
        if let Some(universe) = self.universe.take().filter(|_| !self.finalize.get()) {
            std::mem::forget(universe);
        }
    }
}

/// The heartbeat's message tag and its one byte.
const BEAT_TAG: i32 = 1;
static BEAT: u8 = 1;

/// The heartbeat thread's loop (see the module comment): beats out every second, beats in as
/// they come; a rank unheard for `silence` ends the job. On `stop`, it stops beating, waits in a
/// barrier until every rank has stopped, and takes in the beats still on their way, so that
/// none is left unreceived when MPI is finalised.
fn heartbeat(comm: SimpleCommunicator, stop: Arc<AtomicBool>, silence: Duration) {
    let (me, ranks) = (comm.rank() as usize, comm.size() as usize);
    let mut heard = vec![Instant::now(); ranks];
    let mut sends: Vec<Request<'static, u8>> = Vec::new();
    let mut next_beat = Instant::now();
    let mut phase = Phase::Beating;
    loop {
        while let Some((message, status)) =
            comm.any_process().immediate_matched_probe_with_tag(BEAT_TAG)
        {
            let _: (u8, _) = message.matched_receive();
            heard[status.source_rank() as usize] = Instant::now();
        }
        sends = sends.into_iter().filter_map(|send| send.test().err()).collect();
        let lost: Vec<usize> =
            (0..ranks).filter(|&q| q != me && heard[q].elapsed() > silence).collect();
        if !lost.is_empty() && !matches!(phase, Phase::Left(_)) {
            eprintln!(
                "rank {me}: error: no word from rank(s) {lost:?} for {} s: a host or its link is down, or the rank stopped; ending the job",
                silence.as_secs_f64()
            );
            end_job(70);
        }
        phase = match phase {
            Phase::Beating if stop.load(Ordering::Relaxed) => {
                Phase::Leaving(comm.immediate_barrier())
            }
            Phase::Beating if Instant::now() >= next_beat => {
                for q in (0..ranks).filter(|&q| q != me) {
                    let to = comm.process_at_rank(q as i32);
                    sends.push(to.immediate_send_with_tag(StaticScope, &BEAT, BEAT_TAG));
                }
                next_beat += Duration::from_secs(1);
                Phase::Beating
            }
            Phase::Leaving(barrier) => match barrier.test() {
                Ok(_) => Phase::Left(Instant::now()),
                Err(barrier) => Phase::Leaving(barrier),
            },
            // Every rank has stopped beating: what is still on its way arrives within moments;
            // a send some rank left untaken is let go rather than waited for.
            Phase::Left(at) if sends.is_empty() || at.elapsed() > Duration::from_millis(200) => {
                sends.into_iter().for_each(std::mem::forget);
                return;
            }
            phase => phase,
        };
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Where the heartbeat thread is: beating; waiting in the goodbye barrier; past it, since when.
enum Phase {
    Beating,
    Leaving(Request<'static, ()>),
    Left(Instant),
}

/// Ends the whole job with `code` from a rank that cannot go on, and this process even if MPI
/// cannot reach the others to say so (its link is cut).
fn end_job(code: i32) -> ! {
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(5));
        std::process::exit(code)
    });
    abort_job(code);
    std::process::exit(code)
}

impl Ranks {
    /// Initialises MPI and starts the communication thread. Fails when MPI was initialised
    /// already, or cannot let two threads call it at once.
    pub fn init(silence: Duration) -> Result<Ranks> {
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or_else(|| {
                CollectiveError::Mpi("MPI was initialised already in this process".into())
            })?;
        if threading != mpi::Threading::Multiple {
            return Err(CollectiveError::Mpi(format!(
                "this MPI offers threads at level {threading:?}; --mpi needs MPI_THREAD_MULTIPLE (Open MPI and MPICH offer it) to exchange gradients beside the backward"
            )));
        }
        let (jobs, queue) = mpsc::channel::<Job>();
        let thread = start("mpi-exchange", move |comm| queue.iter().for_each(|job| job(&comm)))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let heartbeat = start("mpi-heartbeat", move |comm| heartbeat(comm, stopping, silence))?;
        Ok(Ranks {
            world: universe.world(),
            received: Default::default(),
            jobs: Some(jobs),
            thread: Some(thread),
            stop,
            heartbeat: Some(heartbeat),
            universe: Some(universe),
            finalize: std::cell::Cell::new(true),
        })
    }

    /// Has this process, once its threads have said goodbye, leave MPI unfinalised when
    /// dropped: for a job `mpirun` is ending, which answers no rank's finalising until it has
    /// killed them all.
    pub fn leave_unfinalized(&self) {
        self.finalize.set(false);
    }

    pub fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    pub fn size(&self) -> usize {
        self.world.size() as usize
    }

    /// Bytes received from the other ranks so far.
    pub fn received_bytes(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    pub(super) fn gather<T: Equivalence + Copy + Default>(
        &self,
        local: Vec<Vec<T>>,
    ) -> Result<Vec<Vec<T>>> {
        let lens: Vec<u64> = local.iter().map(|v| v.len() as u64).collect();
        let mut all_lens = vec![0u64; lens.len() * self.size()];
        self.world.all_gather_into(&lens[..], &mut all_lens[..]);
        let per_rank: Vec<u64> =
            all_lens.chunks(lens.len().max(1)).map(|c| c.iter().sum()).collect();
        let (counts, displs) = partition(&per_rank)?;
        let mine: Vec<T> = local.concat();
        let mut all = vec![T::default(); per_rank.iter().sum::<u64>() as usize];
        self.world.all_gather_varcount_into(
            &mine[..],
            &mut PartitionMut::new(&mut all[..], counts, displs),
        );
        count::<T>(&self.received, all.len() - mine.len());
        let mut at = 0;
        Ok(all_lens
            .iter()
            .map(|&n| {
                let v = all[at..at + n as usize].to_vec();
                at += n as usize;
                v
            })
            .collect())
    }

    pub(super) fn reduce(
        &self,
        local: &[&[f32]],
        plan: &Plan,
        op: ReduceOp,
        len: usize,
        out: impl FnMut(usize, &[f32]),
    ) -> Result<()> {
        reduce(&self.world, &self.received, local, plan, op, len, out)
    }

    /// [`reduce`](Self::reduce) on the communication thread: returns at once, and the reduced
    /// range comes when every rank has sent its part.
    pub(super) fn reduce_beside(
        &self,
        local: Vec<Vec<f32>>,
        plan: Plan,
        op: ReduceOp,
        len: usize,
    ) -> Incoming {
        let (sent, coming) = oneshot::channel();
        let received = self.received.clone();
        let job: Job = Box::new(move |comm| {
            let local: Vec<&[f32]> = local.iter().map(Vec::as_slice).collect();
            let mut whole = vec![0f32; len];
            let reduced = reduce(comm, &received, &local, &plan, op, len, |start, chunk| {
                whole[start..start + chunk.len()].copy_from_slice(chunk)
            });
            let _ = sent.send(reduced.map(|()| Arc::new(whole)));
        });
        // A job not taken, or dropped untaken, ends in the receiver's `Canceled`.
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
        let stopped = || CollectiveError::Mpi("the exchange thread has stopped".into());
        Incoming::Coming(
            coming.map(move |r| r.unwrap_or_else(|_| Err(stopped()))).boxed_local().shared(),
        )
    }

    /// Waits until every rank has come here, sleeping rather than spinning as MPI's blocking
    /// calls do, so that a rank working meanwhile (rank 0 timing the single device) has the
    /// machine's cores to itself.
    pub(super) fn idle_barrier(&self) {
        let mut request = self.world.immediate_barrier();
        loop {
            match request.test() {
                Ok(_) => return,
                Err(pending) => request = pending,
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    pub(super) fn agree(&self, what: &str, value: u64) -> Result<()> {
        let mut all = vec![0u64; self.size()];
        self.world.all_gather_into(&value, &mut all[..]);
        let differ: Vec<usize> = (1..all.len()).filter(|&q| all[q] != all[0]).collect();
        if differ.is_empty() {
            Ok(())
        } else {
            Err(CollectiveError::Disagree { what: what.to_string(), ranks: differ })
        }
    }
}

/// A thread named `name` running `body` with a communicator of its own, made on it while this
/// thread waits: MPI_Comm_dup is a collective on the world, which nothing else may use meanwhile.
fn start(
    name: &str,
    body: impl FnOnce(SimpleCommunicator) + Send + 'static,
) -> Result<std::thread::JoinHandle<()>> {
    let (ready, started) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let comm = SimpleCommunicator::world().duplicate();
            let _ = ready.send(());
            body(comm)
        })
        .map_err(|e| CollectiveError::Mpi(format!("cannot start the thread {name}: {e}")))?;
    started
        .recv()
        .map_err(|_| CollectiveError::Mpi(format!("the thread {name} stopped as it started")))?;
    Ok(thread)
}

/// The all-reduce of [`Ranks::reduce`] over `comm`, counting what arrives in `received`.
fn reduce(
    comm: &SimpleCommunicator,
    received: &AtomicU64,
    local: &[&[f32]],
    plan: &Plan,
    op: ReduceOp,
    len: usize,
    mut out: impl FnMut(usize, &[f32]),
) -> Result<()> {
    let (ranks, me, l) = (comm.size() as usize, comm.rank() as usize, local.len());
    let chunk = |q: usize| q * len / ranks..(q + 1) * len / ranks;
    let pieces_of_rank = |q: usize| (q * l..(q + 1) * l).map(|h| plan.pieces_of(h)).sum::<usize>();
    // Reduce-scatter: rank q receives every replica's pieces of chunk q.
    let mut send = Vec::with_capacity(pieces_of_rank(me) * len);
    let mut send_lens = Vec::with_capacity(ranks);
    for q in 0..ranks {
        let c = chunk(q);
        for pieces in local {
            for piece in pieces.chunks(len.max(1)) {
                send.extend_from_slice(&piece[c.clone()]);
            }
        }
        send_lens.push((pieces_of_rank(me) * c.len()) as u64);
    }
    let mine = chunk(me);
    let recv_lens: Vec<u64> = (0..ranks).map(|q| (pieces_of_rank(q) * mine.len()) as u64).collect();
    let mut recv = vec![0f32; recv_lens.iter().sum::<u64>() as usize];
    let (send_counts, send_displs) = partition(&send_lens)?;
    let (recv_counts, recv_displs) = partition(&recv_lens)?;
    let parts = Partition::new(&send[..], send_counts, send_displs);
    let mut into = PartitionMut::new(&mut recv[..], recv_counts, &recv_displs[..]);
    mpi::request::scope(|scope| {
        wait_idle(comm.immediate_all_to_all_varcount_into(scope, &parts, &mut into));
    });
    drop(into);
    count::<f32>(received, recv.len() - recv_lens[me] as usize);
    // The plan's leaves of this chunk: replica h's piece j came from rank h / L, after the
    // pieces of that rank's replicas before h.
    let m = mine.len();
    let leaves: Vec<&[f32]> = plan
        .leaves
        .iter()
        .map(|&(h, j)| {
            let q = h / l;
            let before: usize = (q * l..h).map(|g| plan.pieces_of(g)).sum();
            let at = recv_displs[q] as usize + (before + j) * m;
            &recv[at..at + m]
        })
        .collect();
    let mut reduced = Vec::with_capacity(m);
    reduce_chunks(&leaves, plan, op, |_, c| reduced.extend_from_slice(c));
    // All-gather of the reduced chunks.
    let chunk_lens: Vec<u64> = (0..ranks).map(|q| chunk(q).len() as u64).collect();
    let (chunk_counts, chunk_displs) = partition(&chunk_lens)?;
    let mut whole = vec![0f32; len];
    let mut into = PartitionMut::new(&mut whole[..], chunk_counts, chunk_displs);
    mpi::request::scope(|scope| {
        wait_idle(comm.immediate_all_gather_varcount_into(scope, &reduced[..], &mut into));
    });
    drop(into);
    count::<f32>(received, len - m);
    out(0, &whole);
    Ok(())
}

/// Waits for `request`, asking MPI to progress it every 100 µs and sleeping in between: MPI's
/// own waits spin, which would take a core from the thread that records and submits the
/// backward meanwhile (and, on a CPU adapter, from the kernels).
fn wait_idle<'a, D: ?Sized, S: mpi::request::Scope<'a>>(mut request: Request<'a, D, S>) {
    loop {
        match request.test() {
            Ok(_) => return,
            Err(pending) => request = pending,
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Counts the receipt of `values` values of type `T` from the other ranks in `received`.
fn count<T>(received: &AtomicU64, values: usize) {
    received.fetch_add((values * std::mem::size_of::<T>()) as u64, Ordering::Relaxed);
}

/// The MPI counts and displacements (C ints) of parts of `lens` elements laid one after the
/// other: an error past MPI's limit of 2³¹ − 1 elements for any of them.
fn partition(lens: &[u64]) -> Result<(Vec<Count>, Vec<Count>)> {
    let total: u64 = lens.iter().sum();
    if total > Count::MAX as u64 {
        return Err(CollectiveError::Mpi(format!(
            "{total} values in one MPI exchange: past MPI's count limit of {}",
            Count::MAX
        )));
    }
    let counts: Vec<Count> = lens.iter().map(|&n| n as Count).collect();
    let displs = counts
        .iter()
        .scan(0, |at: &mut Count, &c| {
            let d = *at;
            *at += c;
            Some(d)
        })
        .collect();
    Ok((counts, displs))
}

/// This process's rank, when it is one rank of a running MPI job.
pub fn running_rank() -> Option<usize> {
    let running = mpi::environment::is_initialized() && !mpi::environment::is_finalized();
    running.then(|| SimpleCommunicator::world().rank() as usize)
}

/// Ends the whole MPI job with `code` when this process is one of its ranks and others wait on
/// it, so that none waits forever; returns when MPI is not running or this is the only rank.
pub fn abort_job(code: i32) {
    if running_rank().is_some() && SimpleCommunicator::world().size() > 1 {
        SimpleCommunicator::world().abort(code)
    }
}
