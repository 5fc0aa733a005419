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

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Poll, Waker};

use futures::future::{LocalBoxFuture, Shared};
use futures::FutureExt;

use crate::canonical::Plan;
use crate::gpu::{Encoder, Gpu, GpuError, Slice};

#[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
pub mod mpi;
mod peers;

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
    for start in (0..len).step_by(CHUNK) {
        let n = CHUNK.min(len - start);
        // IEEE addition commutes exactly: only the tree's shape matters, and it is the plan's.
        let mut sum = plan.run(
            |i| leaves[i][start..start + n].to_vec(),
            |mut left, right| {
                left.iter_mut().zip(&right).for_each(|(l, r)| *l += r);
                left
            },
        );
        if op == ReduceOp::Mean {
            let r = holders as f32;
            sum.iter_mut().for_each(|v| *v /= r);
        }
        out(start, &sum);
    }
}

/// One bucket of a replica's [`BucketStaging`]: host-visible copies of one byte range of the
/// reduced buffer. `read` (MAP_READ) receives the range of each of the replica's pieces, one
/// after the other, mapped for the reduce to read; `write` (MAP_WRITE) receives the reduced
/// values, then is copied back into the range of the first piece.
struct Bucket {
    read: wgpu::Buffer,
    write: wgpu::Buffer,
    /// Whether `write` is mapped (it is made mapped); if not, the submission that last used
    /// it (`None`: not known, the latest).
    write_mapped: bool,
    write_used: Option<wgpu::SubmissionIndex>,
}

/// One replica's staging for bucketed all-reduces of one buffer: a [`Bucket`] per byte range,
/// made on first use and kept, so that a step allocates nothing: fresh host memory (a staging
/// buffer, a `Vec`, a `write_buffer` copy) is zero-filled page by page by the kernel on first
/// touch, which costs more than reducing the same bytes in memory already touched. The buckets
/// of a training step are the same ranges every step, so they add up to the buffer once.
#[derive(Default)]
pub struct BucketStaging {
    buckets: RefCell<BTreeMap<(Range, u64), Bucket>>,
}

/// A byte range of the reduced buffer's first piece: (offset, bytes).
type Range = (u64, u64);

/// Where a replica's pieces lie in the buffer it all-reduces: `count` ranges of the same
/// length, piece j `j·stride` bytes after the first (the gradient of each canonical piece of
/// the replica's examples, in slabs of one buffer). One piece: the plain all-reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pieces {
    pub count: u64,
    pub stride: u64,
}

impl Pieces {
    pub const ONE: Pieces = Pieces { count: 1, stride: 0 };
}

impl BucketStaging {
    /// The buffers of bucket `range` of `pieces` pieces, made on first use.
    fn buffers(&self, gpu: &Gpu, range: Range, pieces: u64) -> (wgpu::Buffer, wgpu::Buffer) {
        let mut buckets = self.buckets.borrow_mut();
        let b = buckets.entry((range, pieces)).or_insert_with(|| {
            let staging = |label, size, usage, mapped_at_creation| {
                gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(label),
                    size,
                    usage,
                    mapped_at_creation,
                })
            };
            Bucket {
                read: staging(
                    "bucket.read",
                    pieces * range.1,
                    wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    false,
                ),
                write: staging(
                    "bucket.write",
                    range.1,
                    wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                    true,
                ),
                write_mapped: true,
                write_used: None,
            }
        });
        (b.read.clone(), b.write.clone())
    }

    fn with<T>(&self, range: Range, pieces: u64, f: impl FnOnce(&mut Bucket) -> T) -> T {
        let mut buckets = self.buckets.borrow_mut();
        f(buckets.get_mut(&(range, pieces)).expect("a bucket is made before it is used"))
    }
}

/// What a replica brings to a bucket's round: its staging for the bucket, both mapped.
pub struct MappedBucket {
    replica: usize,
    read: wgpu::Buffer,
    write: wgpu::Buffer,
}

/// The rounds in which R replicas reduce their buckets, one round per bucket, in the same order.
pub type BucketRounds = Rendezvous<MappedBucket, Result<Incoming>>;

/// The rounds of a bucketed all-reduce by `op` of the replicas' pieces along `plan`, among
/// `local` replicas of this process and those of its `peers`: the last local replica to bring
/// a bucket reduces every replica's read staging into every local replica's write staging (so
/// each gets the same bytes), with [`Peers::reduce_beside`]: in-process straight into the
/// mapped staging; over MPI the values come later, and each replica writes them itself.
pub fn bucket_rounds(plan: Plan, op: ReduceOp, local: usize, peers: Peers) -> BucketRounds {
    Rendezvous::new(local, move |parts: Vec<MappedBucket>| {
        let gpu_error = |replica: usize, e: wgpu::MapRangeError| CollectiveError::Gpu {
            replica,
            source: GpuError::Readback(e.to_string()),
        };
        let len = parts.first().map_or(0, |p| p.write.size() / 4);
        if let Some(p) = parts.iter().find(|p| p.write.size() / 4 != len) {
            let got = p.write.size() / 4;
            return Err(CollectiveError::RangeMismatch { replica: p.replica, got, expected: len });
        }
        let views = parts
            .iter()
            .map(|p| p.read.get_mapped_range(..).map_err(|e| gpu_error(p.replica, e)))
            .collect::<Result<Vec<_>>>()?;
        let mut outs = parts
            .iter()
            .map(|p| p.write.get_mapped_range_mut(..).map_err(|e| gpu_error(p.replica, e)))
            .collect::<Result<Vec<_>>>()?;
        let inputs: Vec<&[f32]> = views.iter().map(|v| bytemuck::cast_slice(v)).collect();
        peers.reduce_beside(&inputs, &plan, op, len as usize, |start, chunk| {
            let bytes: &[u8] = bytemuck::cast_slice(chunk);
            outs.iter_mut().for_each(|out| {
                out.slice(start * 4..start * 4 + bytes.len()).copy_from_slice(bytes)
            });
        })
    })
}

/// Which filled buckets [`BucketAllReduce::reduce`] takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filled {
    /// All but those of the latest submission, which the device may still be running: their
    /// turn comes at the next call, so their reduce overlaps the work submitted after them.
    AllButLatest,
    All,
}

/// One replica's side of a bucketed all-reduce of one buffer during one step, while the buffer
/// becomes final from its end downwards (a backward writes gradients in reverse layout order).
/// Each time more of it is final, [`record`](Self::record) copies the new part into staging in
/// the caller's encoder; after the caller submits, [`reduce`](Self::reduce) meets the other
/// replicas in [`BucketRounds`] for the parts filled by earlier submissions, and the next
/// `record` copies the reduced values back. [`finish`](Self::finish) does the rest. Every part
/// is reduced exactly once, by [`reduce_chunks`], so the result is bitwise [`all_reduce`]'s.
pub struct BucketAllReduce<'a> {
    replica: usize,
    pieces: Pieces,
    staging: &'a BucketStaging,
    rounds: &'a BucketRounds,
    /// The least a bucket holds, but the last of a step.
    bucket_bytes: u64,
    /// Where the part already handed to the all-reduce starts; `None` before the first.
    from: Cell<Option<u64>>,
    /// Buckets copied into staging, with the number of the submission that did it and, once
    /// submitted, its index.
    filled: RefCell<Vec<(Range, u64, Option<wgpu::SubmissionIndex>)>>,
    /// How many times the caller has submitted.
    submissions: Cell<u64>,
    /// Buckets reduced, whose write staging the next `record` copies back.
    reduced: RefCell<Vec<Range>>,
    /// Buckets whose copy back is recorded but not yet submitted.
    copying: RefCell<Vec<Range>>,
    /// Buckets whose values are on their way from other processes, oldest first; their write
    /// staging stays mapped until the values land.
    in_flight: RefCell<VecDeque<(Range, Coming)>>,
}

impl<'a> BucketAllReduce<'a> {
    /// Replica `replica`'s side, whose buffer holds its `pieces`, in buckets of at least
    /// `bucket_bytes` (every replica the same).
    pub fn new(
        replica: usize,
        pieces: Pieces,
        staging: &'a BucketStaging,
        rounds: &'a BucketRounds,
        bucket_bytes: u64,
    ) -> Self {
        BucketAllReduce {
            replica,
            pieces,
            staging,
            rounds,
            bucket_bytes,
            from: Cell::new(None),
            filled: RefCell::default(),
            submissions: Cell::new(0),
            reduced: RefCell::default(),
            copying: RefCell::default(),
            in_flight: RefCell::default(),
        }
    }

    /// Records into `enc` the copies back of the buckets reduced so far, and, once what `done`
    /// adds to the final part fills a bucket, its copy into staging. `done` is the final part of
    /// the first piece (the others lie `pieces.stride` apart): from some offset to the piece's
    /// end, never shrinking from one call to the next.
    pub fn record(&self, gpu: &Gpu, enc: &mut Encoder, done: Slice<'_>) -> Result<()> {
        self.record_bucket(gpu, enc, done, self.bucket_bytes)
    }

    /// [`record`](Self::record) with buckets of at least `least` bytes.
    fn record_bucket(
        &self,
        gpu: &Gpu,
        enc: &mut Encoder,
        done: Slice<'_>,
        least: u64,
    ) -> Result<()> {
        let Pieces { count, stride } = self.pieces;
        self.land_ready()?;
        for range in self.reduced.take() {
            let (_, write) = self.staging.buffers(gpu, range, count);
            enc.copy_buffer_to_buffer(&write, 0, done.buffer, range.0, range.1);
            self.copying.borrow_mut().push(range);
        }
        let end = self.from.get().unwrap_or(done.offset + done.bytes());
        if done.offset > end {
            return Err(CollectiveError::Shrunk {
                replica: self.replica,
                offset: done.offset,
                before: end,
            });
        }
        if !done.offset.is_multiple_of(4) {
            return Err(CollectiveError::Unaligned { replica: self.replica, offset: done.offset });
        }
        if done.offset + least.max(1) <= end {
            let range = (done.offset, end - done.offset);
            let (read, _) = self.staging.buffers(gpu, range, count);
            for piece in 0..count {
                let from = range.0 + piece * stride;
                enc.copy_buffer_to_buffer(done.buffer, from, &read, piece * range.1, range.1);
            }
            self.filled.borrow_mut().push((range, self.submissions.get(), None));
            self.from.set(Some(done.offset));
        } else if self.from.get().is_none() {
            self.from.set(Some(end));
        }
        Ok(())
    }

    /// The encoder `record` recorded into was submitted as `index`.
    pub fn submitted(&self, index: wgpu::SubmissionIndex) {
        for (_, _, at) in self.filled.borrow_mut().iter_mut().filter(|(_, _, at)| at.is_none()) {
            *at = Some(index.clone());
        }
        self.submissions.set(self.submissions.get() + 1);
        for range in self.copying.take() {
            self.staging.with(range, self.pieces.count, |b| b.write_used = Some(index.clone()));
        }
    }

    /// All-reduces the `which` filled buckets with the other replicas, oldest first.
    pub async fn reduce(&self, gpu: &Gpu, which: Filled) -> Result<()> {
        let submitted = self.submissions.get();
        let before = if which == Filled::All { submitted } else { submitted.saturating_sub(1) };
        let take =
            self.filled.borrow().iter().take_while(|(_, number, _)| *number < before).count();
        let ready: Vec<_> = self.filled.borrow_mut().drain(..take).collect();
        for (range, _, at) in ready {
            match self.reduce_bucket(gpu, range, at).await? {
                Incoming::Written => self.reduced.borrow_mut().push(range),
                Incoming::Coming(values) => self.in_flight.borrow_mut().push_back((range, values)),
            }
        }
        Ok(())
    }

    /// Lands the buckets whose values have come, oldest first, without waiting for the others.
    fn land_ready(&self) -> Result<()> {
        loop {
            let Some((range, values)) = self.in_flight.borrow().front().cloned() else {
                return Ok(());
            };
            let Some(values) = values.now_or_never() else { return Ok(()) };
            self.in_flight.borrow_mut().pop_front();
            self.land(range, values)?;
        }
    }

    /// Waits for every bucket still on its way and lands it.
    async fn land_all(&self) -> Result<()> {
        loop {
            let Some((range, values)) = self.in_flight.borrow_mut().pop_front() else {
                return Ok(());
            };
            self.land(range, values.await)?;
        }
    }

    /// Writes a bucket's reduced `values` into its mapped write staging, for the next `record`
    /// to copy back.
    fn land(&self, range: Range, values: Result<Arc<Vec<f32>>>) -> Result<()> {
        let write = self.staging.with(range, self.pieces.count, |b| {
            b.write_mapped = false;
            b.write.clone()
        });
        let written = values.and_then(|values| {
            let mut view = write.get_mapped_range_mut(..).map_err(|e| CollectiveError::Gpu {
                replica: self.replica,
                source: GpuError::Readback(e.to_string()),
            })?;
            view.copy_from_slice(bytemuck::cast_slice(&values));
            Ok(())
        });
        write.unmap();
        self.reduced.borrow_mut().push(range);
        written
    }

    async fn reduce_bucket(
        &self,
        gpu: &Gpu,
        range: Range,
        filled_at: Option<wgpu::SubmissionIndex>,
    ) -> Result<Incoming> {
        let gpu_error = |source| CollectiveError::Gpu { replica: self.replica, source };
        let count = self.pieces.count;
        let (read, write) = self.staging.buffers(gpu, range, count);
        gpu.map(&read, wgpu::MapMode::Read, filled_at).await.map_err(gpu_error)?;
        let written = self.staging.with(range, count, |b| (b.write_mapped, b.write_used.take()));
        if let (false, used) = written {
            let mapped = gpu.map(&write, wgpu::MapMode::Write, used).await;
            if mapped.is_err() {
                read.unmap();
            }
            mapped.map_err(gpu_error)?;
        }
        let merged = self
            .rounds
            .exchange(
                self.replica,
                MappedBucket { replica: self.replica, read: read.clone(), write: write.clone() },
            )
            .await;
        // Unmapped whatever happened, so that the next step can use the staging again; the
        // write staging of values still on their way when they land.
        read.unmap();
        let merged = merged.and_then(|m| (*m).clone());
        if !matches!(merged, Ok(Incoming::Coming(_))) {
            write.unmap();
            self.staging.with(range, count, |b| b.write_mapped = false);
        }
        merged
    }

    /// After the last `record` of a step: reduces the rest of the first piece, `whole` (and of
    /// the others), and every bucket still pending, and submits the copies back.
    pub async fn finish(&self, gpu: &Gpu, whole: Slice<'_>) -> Result<()> {
        self.submit_record(gpu, whole).await?;
        self.reduce(gpu, Filled::All).await?;
        self.land_all().await?;
        self.submit_record(gpu, whole).await
    }

    async fn submit_record(&self, gpu: &Gpu, whole: Slice<'_>) -> Result<()> {
        let mut enc = gpu.encoder();
        self.record_bucket(gpu, &mut enc, whole, 0)?;
        let index = gpu
            .submit(enc)
            .await
            .map_err(|source| CollectiveError::Gpu { replica: self.replica, source })?;
        self.submitted(index);
        Ok(())
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
