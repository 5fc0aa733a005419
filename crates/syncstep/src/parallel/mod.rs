//! Data parallelism, part of the `step` layer: R [`Replica`]s, each on its own `wgpu::Device`
//! with its own parameters, gradients, momentum and running statistics resident, run one
//! training step on R contiguous shards of a global batch of B (any R ≤ B: the first B mod R
//! replicas take one example more) so that the result IS the single-device step at the global
//! batch, bit for bit (docs/design.md, "Data parallel"). Each replica's step talks to the others
//! through its [`ReplicaLink`], the data-parallel [`Communicator`]:
//!
//! - BatchNorm rows: every BN site's trip, shared with the sites whose rows are ready at the
//!   same time, gathers the replicas' per-example rows (forward [mean | M2], backward
//!   [Σdy | Σdy·x̂]), in the global batch's order, onto every replica (before its next
//!   submission: the step records on meanwhile), which then merges them on
//!   its device by Chan's formula (forward) or sums them (backward) exactly as one device holding
//!   the whole batch does. So the forward, and every cotangent, are bitwise those of the single
//!   device, not merely close;
//! - the loss: every replica divides by the global B, never by its own shard; every sum over
//!   examples (weight and bias gradients, dγ, dβ) is taken per canonical piece of the replica's
//!   examples (`canonical::pieces`: one for an aligned power-of-two shard) into a gradient slab
//!   each. The reported loss is the per-example losses of all replicas summed in the canonical
//!   order, divided by B;
//! - gradient buckets: the all-reduce adds all replicas' pieces along the canonical tree
//!   (`canonical::Plan`): the single device's sums, bit for bit, for any R and shard sizes; all
//!   replicas hold the identical gradient and apply the identical SGD update. The step tells the
//!   link which suffix of the gradient buffer is final after each unit (units go backward in
//!   reverse layout order); once a bucket's worth more is final ([`DataParallel::bucket_bytes`],
//!   whatever BatchNorm does) it is copied into staging in the submission that finishes it and
//!   reduced after the next submission while the device computes on
//!   ([`collective::BucketAllReduce`]).
//!   After the backward the last bucket remains. Each part is reduced once, so the bytes are
//!   the whole-buffer all-reduce's, whatever the bucket size.
//!
//! The R replica steps run concurrently as futures under one `join_all` on one thread; they
//! meet at each BN site, and for each gradient bucket, in a [`Rendezvous`]. How bytes move is
//! the `collective` layer's. [`Sabotaged`] breaks a link on purpose, for the gates that must
//! fail.

mod sabotage;

pub use sabotage::{Sabotage, Sabotaged};

use std::cell::RefCell;
use std::time::{Duration, Instant};

use crate::canonical::{self, Plan};
use crate::collective::{
    self, BucketAllReduce, BucketRounds, BucketStaging, CollectiveError, Filled, Peers, Pieces,
    ReduceOp, Rendezvous,
};
use crate::data::{Batch, DataError};
use crate::gpu::{self, AdapterChoice, Encoder, Gpu, GpuError, Readback, Slice};
use crate::kernels::{Device, DeviceConfig};
use crate::model::{ActivationPattern, ResNet};
use crate::step::{
    self, BnRows, Communicator, OneDevice, Replica, Shard, StepConfig, StepError, StepOptions,
    StepOutput,
};

#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    #[error("replica {replica} ({adapter}): {source}")]
    Replica {
        replica: usize,
        adapter: String,
        #[source]
        source: StepError,
    },
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// A step error that is no one replica's (a bad configuration).
    #[error(transparent)]
    Step(StepError),
}

pub type Result<T, E = ParallelError> = std::result::Result<T, E>;

/// How BatchNorm statistics are taken across replicas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BnMode {
    /// Synchronised: statistics over the global batch. What data-parallel training uses.
    #[default]
    Sync,
    /// Each replica's own statistics over its shard. Exists only for the CONTROL gate, which
    /// shows that the TEST gate can tell the difference.
    Local,
}

/// Options of one data-parallel forward/backward.
#[derive(Clone, Copy, Debug, Default)]
pub struct ParallelOptions {
    pub bn: BnMode,
    /// Read each replica's activation pattern back (see [`StepOptions::capture_pattern`]).
    pub capture_pattern: bool,
    pub sabotage: Option<Sabotage>,
    /// Read around each replica's gradient exchange after its backward, for
    /// [`DataParallel::exchange_wait`] (`bench`); None reads no clock, as a browser has none
    /// (`Instant::now` panics on wasm32). Reading it changes no bit.
    pub clock: Option<fn() -> Instant>,
}

/// The rendezvous of one data-parallel step's BN sites and gradient buckets. Every replica
/// passes the same sites in the same order (forward stats, then backward sums), and the same
/// buckets, so one sequence of rounds of each kind serves all.
pub struct StepExchange {
    rows: Rendezvous<Vec<f32>, collective::Result<Vec<Vec<f32>>>>,
    grads: BucketRounds,
    /// Each replica's examples, in replica order.
    counts: Vec<u32>,
    /// The least a gradient bucket holds (the last one excepted).
    bucket_bytes: u64,
}

impl StepExchange {
    /// The exchange of replicas holding `counts[r]` examples each, whose gradients' pieces are
    /// summed along `plan` in buckets of at least `bucket_bytes`; this process holds `local` of
    /// them, its `peers` the others.
    pub fn new(
        counts: Vec<u32>,
        plan: Plan,
        bucket_bytes: u64,
        local: usize,
        peers: &Peers,
    ) -> Self {
        let gather = peers.clone();
        let rows = Rendezvous::new(local, move |parts: Vec<Vec<f32>>| gather.gather(parts));
        let grads = collective::bucket_rounds(plan, ReduceOp::Sum, local, peers.clone());
        StepExchange { rows, grads, counts, bucket_bytes }
    }

    /// Replica `replica`'s link to the others, all-reducing the gradients of its `pieces`
    /// through `staging`.
    pub fn link<'a>(
        &'a self,
        replica: usize,
        pieces: Pieces,
        staging: &'a BucketStaging,
    ) -> ReplicaLink<'a> {
        let grads = BucketAllReduce::new(replica, pieces, staging, &self.grads, self.bucket_bytes);
        ReplicaLink { exchange: self, replica, grads, pending: RefCell::default() }
    }

    /// Each replica's examples, in replica order.
    pub fn counts(&self) -> &[u32] {
        &self.counts
    }

    /// Releases every replica waiting at a BN site or a gradient bucket: `replica` failed.
    pub fn abort(&self, replica: usize, message: impl Into<String>) {
        let message = message.into();
        self.rows.abort(replica, message.clone());
        self.grads.abort(replica, message);
    }
}

/// One replica's [`Communicator`] in a data-parallel step. At each BN site it submits what was
/// recorded so far with a readback of its own rows, and returns: the step records on while the
/// device runs. Before the next submission it reads those rows, meets the other replicas, and
/// writes all replicas' rows (identical bytes on every replica) into the sites' row buffers,
/// where the work recorded after the site reads them. The device sees the same writes in the
/// same place between the same submissions as if the link had waited at the site; only the
/// host's recording moves into the time the device computes.
///
/// It all-reduces the gradients in buckets of at least the exchange's bucket size: once that
/// much more of the gradient buffer is final, the part is copied into staging in the submission
/// that finishes it and reduced after the next submission, while the device runs the next part
/// of the backward ([`BucketAllReduce`]);
/// [`finish_gradients`](Communicator::finish_gradients) reduces the rest after the backward.
pub struct ReplicaLink<'a> {
    exchange: &'a StepExchange,
    replica: usize,
    grads: BucketAllReduce<'a>,
    /// The last trip's own rows, submitted and not yet exchanged.
    pending: RefCell<Option<PendingRows>>,
}

/// A trip on its way: this replica's own rows, copied back by the submission that computed
/// them, and the sites every replica's rows go to.
struct PendingRows {
    own: Readback,
    sites: Vec<SiteRows>,
}

/// A [`BnRows`] that owns its buffer handle, kept until the trip lands.
struct SiteRows {
    site: usize,
    buffer: wgpu::Buffer,
    offset: u64,
    len: u64,
    local: u32,
}

impl SiteRows {
    fn new(s: &BnRows<'_>) -> Self {
        let (buffer, offset, len) = (s.rows.buffer.clone(), s.rows.offset, s.rows.len);
        SiteRows { site: s.site, buffer, offset, len, local: s.local }
    }

    fn rows(&self) -> BnRows<'_> {
        let rows = Slice::new(&self.buffer, self.offset, self.len);
        BnRows { site: self.site, rows, local: self.local }
    }
}

impl ReplicaLink<'_> {
    /// Each replica's examples, in replica order.
    pub fn counts(&self) -> &[u32] {
        self.exchange.counts()
    }

    /// This replica's own rows of every site of `sites`, read back after submitting `enc`
    /// (the part of the step recorded so far).
    pub async fn own_rows(
        &self,
        gpu: &Gpu,
        enc: &mut Encoder,
        sites: &[BnRows<'_>],
    ) -> step::Result<Vec<f32>> {
        let own = self.record_own(gpu, enc, sites);
        self.submit(gpu, enc).await?;
        Ok(own.read(gpu).await?)
    }

    fn record_own(&self, gpu: &Gpu, enc: &mut Encoder, sites: &[BnRows<'_>]) -> Readback {
        let global = self.exchange.counts.iter().sum::<u32>() as u64;
        let own_len = |s: &BnRows| (s.width(global) * s.local as usize) as u64;
        let own: Vec<Slice> =
            sites.iter().map(|s| Slice::new(s.rows.buffer, s.rows.offset, own_len(s))).collect();
        gpu.record_read(enc, &own)
    }

    /// Lands the last trip, then submits `enc`; gradient buckets filled by earlier submissions
    /// are reduced while the device runs it.
    async fn submit(&self, gpu: &Gpu, enc: &mut Encoder) -> step::Result<()> {
        self.land(gpu).await?;
        let recorded = std::mem::replace(enc, gpu.encoder());
        self.grads.submitted(gpu.submit(recorded).await?);
        // Natively a readback blocks until this device is done: let the other replicas queue
        // their work first, so the devices run side by side instead of in turn.
        collective::yield_now().await;
        self.grads.reduce(gpu, Filled::AllButLatest).await?;
        Ok(())
    }

    /// The last trip's rows of every replica, written into its sites: before anything recorded
    /// after that trip is submitted.
    async fn land(&self, gpu: &Gpu) -> step::Result<()> {
        let Some(PendingRows { own, sites }) = self.pending.take() else { return Ok(()) };
        let mine = own.read(gpu).await?;
        let all = self.exchange.rows.exchange(self.replica, mine).await?.as_ref().clone()?;
        let sites: Vec<BnRows> = sites.iter().map(SiteRows::rows).collect();
        write_rows(gpu, &sites, self.exchange.counts(), &all)
    }

    /// One trip for every site of `sites`: their own rows go out together, and every replica's
    /// come back into each site's `rows` before the next submission.
    async fn gather(&self, gpu: &Gpu, enc: &mut Encoder, sites: &[BnRows<'_>]) -> step::Result<()> {
        let own = self.record_own(gpu, enc, sites);
        self.submit(gpu, enc).await?;
        let sites = sites.iter().map(SiteRows::new).collect();
        *self.pending.borrow_mut() = Some(PendingRows { own, sites });
        Ok(())
    }
}

/// Writes `all`, each replica's rows of every site of `sites` in replica order (site after site
/// within a replica), into each site's `rows` in the global batch's order.
pub fn write_rows(
    gpu: &Gpu,
    sites: &[BnRows<'_>],
    counts: &[u32],
    all: &[Vec<f32>],
) -> step::Result<()> {
    // A site's row is as wide on every replica.
    let global = counts.iter().sum::<u32>() as u64;
    let widths: Vec<usize> = sites.iter().map(|s| s.width(global)).collect();
    for (replica, rows) in all.iter().enumerate() {
        let expected: usize = widths.iter().map(|w| w * counts[replica] as usize).sum();
        if rows.len() != expected {
            return Err(StepError::BatchNormRows {
                replica,
                values: rows.len(),
                examples: counts[replica],
                site: sites[0].site,
                expected,
            });
        }
    }
    let mut at: Vec<usize> = vec![0; all.len()];
    for (site, width) in sites.iter().zip(&widths) {
        let rows: Vec<f32> = all
            .iter()
            .zip(counts)
            .zip(at.iter_mut())
            .flat_map(|((replica, &count), at)| {
                let part = &replica[*at..*at + width * count as usize];
                *at += part.len();
                part.iter().copied()
            })
            .collect();
        gpu.queue.write_buffer(site.rows.buffer, site.rows.offset, bytemuck::cast_slice(&rows));
    }
    Ok(())
}

impl Communicator for ReplicaLink<'_> {
    fn examples(&self, _local: u32) -> u32 {
        self.exchange.counts.iter().sum()
    }

    async fn bn_stats(
        &self,
        gpu: &Gpu,
        enc: &mut Encoder,
        sites: &[BnRows<'_>],
    ) -> step::Result<()> {
        self.gather(gpu, enc, sites).await
    }

    async fn bn_sums(
        &self,
        gpu: &Gpu,
        enc: &mut Encoder,
        sites: &[BnRows<'_>],
    ) -> step::Result<()> {
        self.gather(gpu, enc, sites).await
    }

    fn gradients_final(&self, gpu: &Gpu, enc: &mut Encoder, done: Slice<'_>) -> step::Result<()> {
        Ok(self.grads.record(gpu, enc, done)?)
    }

    async fn land_rows(&self, gpu: &Gpu) -> step::Result<()> {
        self.land(gpu).await
    }

    /// All-reduces the rest of the gradient buffer (its first piece `gradient`, and the others)
    /// and every bucket still pending, and submits the copies back.
    async fn finish_gradients(&self, gpu: &Gpu, gradient: Slice<'_>) -> step::Result<()> {
        self.land(gpu).await?;
        Ok(self.grads.finish(gpu, gradient).await?)
    }
}

/// `replicas` devices, replica r's on `adapters[r % adapters.len()]` (no adapters: the
/// default one), made with `config`: sharing its kernel policy, their choices made once for the
/// run. Each asks for its adapter anew, which in a browser (one device per adapter) gives every
/// replica an adapter of its own.
pub async fn devices(
    replicas: usize,
    adapters: &[AdapterChoice],
    config: &DeviceConfig,
) -> Result<Vec<Device>> {
    if replicas == 0 {
        return Err(DataError::NoReplicas.into());
    }
    let default = [AdapterChoice::default()];
    let adapters = if adapters.is_empty() { &default[..] } else { adapters };
    let instance = gpu::instance();
    let mut gpus = Vec::with_capacity(replicas);
    for r in 0..replicas {
        let adapter = gpu::select_adapter(&instance, &adapters[r % adapters.len()]).await?;
        let device = Gpu::from_adapter(&adapter).await.map_err(|e| ParallelError::Replica {
            replica: r,
            adapter: adapter_label(&adapter.get_info()),
            source: e.into(),
        })?;
        gpus.push(Device::new(device, config));
    }
    Ok(gpus)
}

/// R replicas of one model, training as one (see the module comment).
pub struct DataParallel {
    /// This process's replicas (all of them, unless `peers` holds others).
    replicas: Vec<Replica>,
    peers: Peers,
    /// Each replica's staging for the gradient all-reduce, kept from step to step.
    staging: Vec<BucketStaging>,
    /// The least a gradient bucket holds: [`DEFAULT_BUCKET_BYTES`] unless set.
    bucket_bytes: u64,
    /// The last step's [`exchange_wait`](Self::exchange_wait).
    exchange_wait: Option<Duration>,
}

/// The default gradient bucket, 4 MiB: about 15 buckets of ResNet-34's 81 MiB gradient, so all
/// but the last are reduced while the backward runs, in fewer exchanges than one per layer
/// (docs/performance-log.md, 2026-12-03, "Bucket size").
pub const DEFAULT_BUCKET_BYTES: u64 = 4 << 20;

/// How a replica's adapter is named in messages: "llvmpipe (LLVM 15.0.6, 256 bits), Gl".
pub fn adapter_label(info: &wgpu::AdapterInfo) -> String {
    format!("{}, {:?}", info.name, info.backend)
}

impl DataParallel {
    /// `replicas` replicas holding `params` and `running` (model layout), on [`devices`] made
    /// with `config`.
    pub async fn new(
        model: &ResNet,
        params: &[f32],
        running: &[f32],
        replicas: usize,
        adapters: &[AdapterChoice],
        config: &DeviceConfig,
    ) -> Result<DataParallel> {
        let gpus = devices(replicas, adapters, config).await?;
        DataParallel::from_gpus(gpus, model, params, running)
    }

    /// Replicas on the given devices, replica r on `gpus[r]`.
    pub fn from_gpus(
        gpus: Vec<Device>,
        model: &ResNet,
        params: &[f32],
        running: &[f32],
    ) -> Result<DataParallel> {
        if gpus.is_empty() {
            return Err(DataError::NoReplicas.into());
        }
        let replicas = gpus
            .into_iter()
            .enumerate()
            .map(|(r, gpu)| {
                let adapter = adapter_label(&gpu.info);
                Replica::new(gpu, model.clone(), params, running)
                    .map_err(|source| ParallelError::Replica { replica: r, adapter, source })
            })
            .collect::<Result<Vec<_>>>()?;
        let staging = replicas.iter().map(|_| BucketStaging::default()).collect();
        let bucket_bytes = DEFAULT_BUCKET_BYTES;
        let peers = Peers::InProcess;
        Ok(DataParallel { replicas, staging, peers, bucket_bytes, exchange_wait: None })
    }

    /// The same replicas as this process's part of a data-parallel step whose other replicas
    /// its `peers` hold (every rank the same number).
    pub fn with_peers(self, peers: Peers) -> DataParallel {
        DataParallel { peers, ..self }
    }

    /// The same replicas all-reducing their gradients in buckets of at least `bytes` during the
    /// backward (the last one excepted). Any size gives the same bits.
    pub fn with_bucket_bytes(self, bytes: u64) -> DataParallel {
        DataParallel { bucket_bytes: bytes, ..self }
    }

    /// The least a gradient bucket holds.
    pub fn bucket_bytes(&self) -> u64 {
        self.bucket_bytes
    }

    /// How long the last step waited, after the backward was done on this process's devices,
    /// for the last all-reduced gradient bucket its update needs: what the exchange beside the
    /// backward did not hide. Only for a step whose options carried a clock and that exchanged
    /// gradients (several replicas, synchronised BatchNorm).
    pub fn exchange_wait(&self) -> Option<Duration> {
        self.exchange_wait
    }

    /// This process's replicas.
    pub fn replicas(&self) -> &[Replica] {
        &self.replicas
    }

    /// How many replicas take part in a step, this process's and its peers'.
    pub fn global_replicas(&self) -> usize {
        self.replicas.len() * self.peers.ranks()
    }

    pub fn peers(&self) -> &Peers {
        &self.peers
    }

    /// The activation pattern of the global batch, from every replica's `outputs` (this
    /// process's, taken with `capture_pattern`).
    pub fn pattern(&self, outputs: &[StepOutput]) -> Result<ActivationPattern> {
        let local: Vec<ActivationPattern> =
            outputs.iter().map(|o| o.pattern.clone().unwrap_or_default()).collect();
        if self.peers.ranks() == 1 {
            return Ok(ActivationPattern::concat(&local));
        }
        let bytes = local.iter().map(ActivationPattern::to_bytes).collect();
        let all = self.peers.gather_bytes(bytes).map_err(|e| self.collective_error(e))?;
        let all = all
            .iter()
            .map(|b| ActivationPattern::from_bytes(b))
            .collect::<Option<Vec<_>>>()
            .ok_or(ParallelError::Step(StepError::PatternFromRank))?;
        Ok(ActivationPattern::concat(&all))
    }

    /// The replicas, this process's and its peers', whose `buffer` holds other bytes than
    /// replica 0's (across processes, compared by a SHA-256 of each).
    pub async fn replicas_that_differ(
        &self,
        buffer: fn(&Replica) -> &wgpu::Buffer,
    ) -> Result<Vec<usize>> {
        use sha2::{Digest, Sha256};
        let values = self.read_each(buffer).await?;
        fn bytes(v: &[f32]) -> &[u8] {
            bytemuck::cast_slice(v)
        }
        if self.peers.ranks() == 1 {
            let differs = |r: usize| bytes(&values[r]) != bytes(&values[0]);
            return Ok((1..values.len()).filter(|&r| differs(r)).collect());
        }
        let digests = values.iter().map(|v| Sha256::digest(bytes(v)).to_vec()).collect();
        let all = self.peers.gather_bytes(digests).map_err(|e| self.collective_error(e))?;
        Ok((1..all.len()).filter(|&r| all[r] != all[0]).collect())
    }

    /// Every replica's logits of `outputs` (this process's), in the global batch's order.
    pub fn logits(&self, outputs: &[StepOutput]) -> Result<Vec<f32>> {
        let local = outputs.iter().map(|o| o.logits.clone()).collect();
        let all = self.peers.gather(local).map_err(|e| self.collective_error(e))?;
        Ok(all.concat())
    }

    /// Inference (eval-mode BatchNorm) on replica 0: every replica holds the same parameters
    /// and, synchronised, the same running statistics.
    pub async fn predict(&mut self, batch: &Batch) -> Result<Vec<f32>> {
        let out = self.replicas[0].predict(batch).await;
        out.map_err(|e| self.named(0, e))
    }

    /// Replaces every replica's momentum (resuming from a checkpoint).
    pub fn write_velocity(&self, v: &[f32]) -> Result<()> {
        self.replicas
            .iter()
            .enumerate()
            .try_for_each(|(r, replica)| replica.write_velocity(v).map_err(|e| self.named(r, e)))
    }

    /// Each replica's adapter, in replica order: this process's and its peers'.
    pub fn adapters(&self) -> Result<Vec<String>> {
        let local: Vec<Vec<u8>> =
            self.replicas.iter().map(|r| adapter_label(&r.gpu.info).into_bytes()).collect();
        let all = self.peers.gather_bytes(local).map_err(|e| self.collective_error(e))?;
        Ok(all.into_iter().map(|b| String::from_utf8_lossy(&b).into_owned()).collect())
    }

    fn named(&self, replica: usize, source: StepError) -> ParallelError {
        ParallelError::Replica {
            replica,
            adapter: adapter_label(&self.replicas[replica].gpu.info),
            source,
        }
    }

    fn collective_error(&self, e: CollectiveError) -> ParallelError {
        match e {
            CollectiveError::Gpu { replica, source } => self.named(replica, source.into()),
            other => self.named(0, other.into()),
        }
    }

    /// One data-parallel forward/backward of `global`: replica r takes the r-th contiguous
    /// shard (the first B mod R one example longer), every replica divides its loss by B, and
    /// the gradients' canonical pieces are all-reduced (in buckets during the backward, the rest
    /// after it), so that every replica holds the single device's gradient of the global batch,
    /// bit for bit. Returns each replica's logits and (if asked) pattern, with the global loss.
    pub async fn forward_backward(
        &mut self,
        global: &Batch,
        cfg: &StepConfig,
        opts: ParallelOptions,
    ) -> Result<Vec<StepOutput>> {
        let mine = self.part(global.len())?;
        let at = Shard { start: mine.start as u64, global: global.len() as u64 };
        if mine.len() == global.len() {
            return self.forward_backward_part(global, at, cfg, opts).await;
        }
        self.forward_backward_part(&global.slice(mine), at, cfg, opts).await
    }

    /// The examples of a global batch of `global` that this process's replicas take: all of
    /// them in-process; under MPI the contiguous shards of its replicas.
    pub fn part(&self, global: usize) -> Result<std::ops::Range<usize>> {
        let ranges = crate::data::shard_ranges(global, self.global_replicas())?;
        let first = self.peers.first_replica(self.replicas.len());
        Ok(ranges[first].start..ranges[first + self.replicas.len() - 1].end)
    }

    /// [`forward_backward`](Self::forward_backward) given only this process's [`part`](Self::part)
    /// of the global batch: `part` holds examples `at.start …` of a batch of `at.global`.
    pub async fn forward_backward_part(
        &mut self,
        part: &Batch,
        at: Shard,
        cfg: &StepConfig,
        opts: ParallelOptions,
    ) -> Result<Vec<StepOutput>> {
        let ranges = self.shard_ranges(part, at)?;
        let plan = Plan::new(&ranges, at.global);
        let counts = ranges.iter().map(|r| (r.end - r.start) as u32).collect();
        let local = self.replicas.len();
        let first = self.peers.first_replica(local);
        let exchange =
            StepExchange::new(counts, plan.clone(), self.bucket_bytes, local, &self.peers);
        // One replica has nobody to meet: its own statistics are the global ones, and its only
        // piece is the whole batch. The same bits without the round trips.
        let alone = self.global_replicas() == 1;
        let bn = if alone { BnMode::Local } else { opts.bn };
        let replicas = self.replicas.iter_mut().zip(&ranges[first..]).zip(&self.staging);
        let steps = replicas.enumerate().map(|(r, ((replica, range), staging))| {
            let from = (range.start - at.start) as usize..(range.end - at.start) as usize;
            let shard = part.slice(from);
            let link = || {
                let pieces = replica.grad_pieces(plan.pieces_of(first + r));
                exchange.link(r, pieces, staging)
            };
            let link = (bn == BnMode::Sync).then(link);
            let at = Shard { start: range.start, global: at.global };
            let exchange = &exchange;
            async move {
                let out = replica_step(replica, &shard, at, cfg, link, opts).await;
                if let Err(e) = &out {
                    exchange.abort(r, e.to_string());
                }
                out
            }
        });
        let results = futures::future::join_all(steps).await;
        let (mut outputs, spans): (Vec<_>, Vec<_>) = self.first_cause(results)?.into_iter().unzip();
        self.exchange_wait = exchange_wait(&spans);
        if bn == BnMode::Local && !alone {
            self.all_reduce_gradients(&plan, first).await?;
        }
        // The global loss: every replica's per-example losses, in the canonical order over the
        // global batch, divided by it.
        let local_losses = outputs.iter().map(|o| o.losses.clone()).collect();
        let losses = self.peers.gather(local_losses).map_err(|e| self.collective_error(e))?;
        let loss = canonical::sum(&losses.concat()) / at.global as f32;
        outputs.iter_mut().for_each(|o| o.loss = loss);
        Ok(outputs)
    }

    /// Every replica's examples of a global batch of `at.global` as ranges of it, once `part`
    /// is checked to be this process's part of it, starting at `at.start`.
    fn shard_ranges(&self, part: &Batch, at: Shard) -> Result<Vec<std::ops::Range<u64>>> {
        let mine = self.part(at.global as usize)?;
        if (at.start as usize, part.len()) != (mine.start, mine.len()) {
            return Err(ParallelError::Step(StepError::NotThisProcessPart {
                start: mine.start,
                end: mine.end,
                global: at.global,
                given_start: at.start,
                given_end: at.start as usize + part.len(),
            }));
        }
        let ranges = crate::data::shard_ranges(at.global as usize, self.global_replicas())?;
        Ok(ranges.into_iter().map(|r| r.start as u64..r.end as u64).collect())
    }

    /// The plain all-reduce of every replica's gradient pieces along `plan`, after steps that
    /// exchanged nothing: per-replica statistics exist for the CONTROL gate only, without
    /// staging kept for it. `first` is this process's first replica.
    async fn all_reduce_gradients(&self, plan: &Plan, first: usize) -> Result<()> {
        let parts: Vec<(&Gpu, Vec<Slice>)> = self
            .replicas
            .iter()
            .enumerate()
            .map(|(r, replica)| {
                let (stride, len) = (replica.slab_stride(), replica.model.param_len as u64);
                let pieces = (0..plan.pieces_of(first + r) as u64)
                    .map(|p| Slice::new(&replica.grads, p * stride, len));
                (&*replica.gpu, pieces.collect())
            })
            .collect();
        collective::all_reduce(&parts, plan, ReduceOp::Sum, &self.peers)
            .await
            .map_err(|e| self.collective_error(e))
    }

    /// The outputs if every replica succeeded; otherwise the error of the replica that failed
    /// first in replica order, preferring a cause over the "abandoned" errors it set off.
    fn first_cause<T>(&self, results: Vec<step::Result<T>>) -> Result<Vec<T>> {
        let mut outputs = Vec::with_capacity(results.len());
        let (mut cause, mut consequence) = (None, None);
        for (r, result) in results.into_iter().enumerate() {
            match result {
                Ok(out) => outputs.push(out),
                Err(e) => {
                    let slot =
                        if matches!(e, StepError::Collective(CollectiveError::Aborted { .. })) {
                            &mut consequence
                        } else {
                            &mut cause
                        };
                    slot.get_or_insert_with(|| self.named(r, e));
                }
            }
        }
        match cause.or(consequence) {
            Some(e) => Err(e),
            None => Ok(outputs),
        }
    }

    /// The same SGD update on every replica (identical gradients in, identical parameters out).
    pub async fn sgd_update(&self, cfg: &StepConfig) -> Result<()> {
        let results =
            futures::future::join_all(self.replicas.iter().map(|r| r.sgd_update(cfg))).await;
        self.first_cause(results).map(drop)
    }

    async fn read_each(&self, buffer: fn(&Replica) -> &wgpu::Buffer) -> Result<Vec<Vec<f32>>> {
        let reads = self.replicas.iter().map(|r| async move {
            r.gpu.read_f32(Slice::whole(buffer(r))).await.map_err(StepError::from)
        });
        let results = futures::future::join_all(reads).await;
        self.first_cause(results)
    }

    /// Every replica's flat parameters, in replica order.
    pub async fn read_params(&self) -> Result<Vec<Vec<f32>>> {
        self.read_each(|r| &r.params).await
    }
    pub async fn read_grads(&self) -> Result<Vec<Vec<f32>>> {
        self.read_each(|r| &r.grads).await
    }
    pub async fn read_velocity(&self) -> Result<Vec<Vec<f32>>> {
        self.read_each(|r| &r.velocity).await
    }
    pub async fn read_running(&self) -> Result<Vec<Vec<f32>>> {
        self.read_each(|r| &r.running).await
    }
}

/// When a replica's backward was done on its device, and when its gradient exchange was
/// (every bucket reduced and its copy back submitted, ahead of the update).
type ExchangeSpan = (Instant, Instant);

/// From the last replica's backward done to the last replica's exchange done, of the `spans`
/// taken: this process's update waits for every replica's gradient.
fn exchange_wait(spans: &[Option<ExchangeSpan>]) -> Option<Duration> {
    let done = spans.iter().flatten().map(|s| s.0).max()?;
    let exchanged = spans.iter().flatten().map(|s| s.1).max()?;
    Some(exchanged.saturating_duration_since(done))
}

/// One replica's forward/backward of `shard`, examples `at` of the global batch: exchanging
/// through `link` (and broken as `opts` asks, for the gates that must fail), or through
/// nothing, with its own BatchNorm statistics and a gradient of its own. With `opts.clock`,
/// the span of its exchange after the backward.
async fn replica_step(
    replica: &mut Replica,
    shard: &Batch,
    at: Shard,
    cfg: &StepConfig,
    link: Option<ReplicaLink<'_>>,
    opts: ParallelOptions,
) -> step::Result<(StepOutput, Option<ExchangeSpan>)> {
    let step_opts = StepOptions { impose: None, capture_pattern: opts.capture_pattern };
    let clock = opts.clock;
    match (link, opts.sabotage) {
        (None, _) => {
            let out = replica.forward_backward(shard, cfg, at, &OneDevice, step_opts).await?;
            Ok((out, None))
        }
        (Some(link), None) => step_through(replica, shard, at, cfg, &link, step_opts, clock).await,
        (Some(link), Some(sabotage)) => {
            let broken = Sabotaged { link, sabotage };
            step_through(replica, shard, at, cfg, &broken, step_opts, clock).await
        }
    }
}

/// A replica's forward/backward with `comm`, its gradient exchange completed, and with a
/// `clock` the span of the exchange's part after the backward.
async fn step_through(
    replica: &mut Replica,
    shard: &Batch,
    at: Shard,
    cfg: &StepConfig,
    comm: &impl Communicator,
    opts: StepOptions<'_>,
    clock: Option<fn() -> Instant>,
) -> step::Result<(StepOutput, Option<ExchangeSpan>)> {
    let out = replica.forward_backward(shard, cfg, at, comm, opts).await?;
    // The step has read its losses back, after the whole backward: the device is done with it.
    let done = clock.map(|now| now());
    comm.finish_gradients(&replica.gpu, replica.gradient()).await?;
    Ok((out, done.zip(clock.map(|now| now()))))
}
