//! The bucketed all-reduce of a buffer that becomes final part by part (the gradients during a
//! backward): each replica's staging kept from step to step, the rounds in which the replicas
//! reduce their buckets, and one replica's side of it (see the module comment of `collective`).

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use futures::FutureExt;

use super::{CollectiveError, Coming, Incoming, Peers, ReduceOp, Rendezvous, Result};
use crate::canonical::Plan;
use crate::gpu::{Encoder, Gpu, GpuError, Slice};

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

/// One replica's staging for bucketed all-reduces of one buffer: a `Bucket` per byte range,
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
/// is reduced exactly once, by [`reduce_chunks`](super::reduce_chunks), so the result is bitwise
/// [`all_reduce`](super::all_reduce)'s.
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
