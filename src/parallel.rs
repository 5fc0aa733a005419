//! Data parallelism, part of the `step` layer: R [`Replica`]s, each on its own `wgpu::Device`
//! with its own parameters, gradients, momentum and running statistics resident, run one
//! training step on R contiguous shards of a global batch so that the result IS the
//! single-device step at the global batch (docs/design.md, "Synchronised BatchNorm"):
//!
//! - every BN site goes through [`SyncBn`], in one trip with the sites whose rows are ready at
//!   the same time ([`BnSync`]): the replicas' per-example rows (forward [mean | M2], backward
//!   [Σdy | Σdy·x̂]) are gathered, in replica order, onto every replica,
//!   which then merges them on its device by Chan's formula (forward) or sums them (backward)
//!   exactly as one device holding the whole batch does. So the forward, and every cotangent,
//!   are bitwise those of the single device (for R a power of two, where the loss divisor's
//!   R cancels exactly), not merely close;
//! - dγ, dβ are sums over the replica's own rows; each replica divides its loss by its own
//!   N; the flat gradient buffer is mean-all-reduced, summed on the host in the kernels'
//!   pairwise batch order, so for power-of-two shards it rebuilds the single device's sums bit
//!   for bit; all replicas hold the identical gradient and apply the identical SGD update.
//! - the gradient all-reduce rides on the backward's BN round trips: the step tells each
//!   backward site which suffix of the gradient buffer is final (units go backward in reverse
//!   layout order), the site's submission also copies the newly final part into staging, and
//!   that bucket is reduced at the next site while the device computes on
//!   ([`collective::BucketAllReduce`]). After the backward only the stem's conv weight and the
//!   last bucket remain. Each part is reduced once, so the bytes are the whole-buffer all-reduce's.
//!
//! The R replica steps run concurrently as futures under one `join_all` on one thread; they
//! meet at each BN site, and for each gradient bucket, in a [`Rendezvous`]. How bytes move is
//! the `collective` layer's.

use crate::collective::{
    self, BucketAllReduce, BucketRounds, BucketStaging, CollectiveError, Filled, ReduceOp,
    Rendezvous,
};
use crate::data::{Batch, DataError};
use crate::gpu::{self, AdapterChoice, Encoder, Gpu, GpuError, Slice};
use crate::model::ResNet34;
use crate::step::{
    self, BnRows, BnSync, LocalBn, Replica, StepConfig, StepError, StepOptions, StepOutput,
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

/// Deliberate breakages of the equivalence, so tests (and `syncstep check --sabotage`) can see
/// the TEST gate fail. Nothing else may use them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sabotage {
    /// All-reduce gradients by sum instead of mean: every gradient R times too large.
    SumGradients,
    /// Never merge BN statistics: each replica takes its own rows R times in place of the
    /// others' (its own mean and variance), while the backward sums stay synchronised.
    UnmergedStats,
}

/// Options of one data-parallel forward/backward.
#[derive(Clone, Copy, Debug, Default)]
pub struct ParallelOptions {
    pub bn: BnMode,
    /// Read each replica's activation pattern back (see [`StepOptions::capture_pattern`]).
    pub capture_pattern: bool,
    pub sabotage: Option<Sabotage>,
}

/// The rendezvous of one data-parallel step's BN sites and gradient buckets. Every replica
/// passes the same sites in the same order (forward stats, then backward sums), and the same
/// buckets, so one sequence of rounds of each kind serves all.
pub struct BnExchange {
    rows: Rendezvous<Vec<f32>>,
    grads: BucketRounds,
    replicas: u32,
    unmerged_stats: bool,
}

impl BnExchange {
    /// The exchange of `replicas` replicas whose gradients are all-reduced by `op`.
    pub fn new(replicas: usize, op: ReduceOp) -> BnExchange {
        let rows = Rendezvous::new(replicas, |parts: Vec<Vec<f32>>| parts.concat());
        BnExchange {
            rows,
            grads: collective::bucket_rounds(replicas, op),
            replicas: replicas as u32,
            unmerged_stats: false,
        }
    }

    /// Replica `replica`'s BatchNorm hook, all-reducing its gradients through `staging`.
    pub fn hook<'a>(&'a self, replica: usize, staging: &'a BucketStaging) -> SyncBn<'a> {
        SyncBn {
            exchange: self,
            replica,
            grads: BucketAllReduce::new(replica, staging, &self.grads),
        }
    }

    /// Releases every replica waiting at a BN site or a gradient bucket: `replica` failed.
    pub fn abort(&self, replica: usize, message: impl Into<String>) {
        let message = message.into();
        self.rows.abort(replica, message.clone());
        self.grads.abort(replica, message);
    }
}

/// Synchronised BatchNorm for one replica: at each BN site it submits what was recorded so far,
/// reads its own rows back, meets the other replicas, and writes all replicas' rows (identical
/// bytes on every replica) into its row buffer.
///
/// It also all-reduces the gradients in buckets: at each backward site the part of the
/// gradient buffer that has become final since the last one is copied into staging in the same
/// submission, and reduced at the next site, while the device runs the next part of the backward
/// ([`BucketAllReduce`]); [`finish`](Self::finish) reduces the rest after the backward.
pub struct SyncBn<'a> {
    exchange: &'a BnExchange,
    replica: usize,
    grads: BucketAllReduce<'a>,
}

impl SyncBn<'_> {
    /// One trip for every site of `sites`: their own rows go out together, and every replica's
    /// come back into each site's `rows`.
    async fn gather(
        &self,
        gpu: &Gpu,
        enc: &mut Encoder,
        sites: &[BnRows<'_>],
        exchange: bool,
        done: Option<Slice<'_>>,
    ) -> step::Result<()> {
        if let Some(done) = done {
            self.grads.record(gpu, enc, done)?;
        }
        let replicas = self.exchange.replicas as usize;
        let own: Vec<Slice> = sites
            .iter()
            .map(|s| Slice::new(s.rows, 0, s.rows.size() / 4 / replicas as u64))
            .collect();
        let own_read = gpu.record_read(enc, &own);
        let recorded = std::mem::replace(enc, gpu.encoder());
        self.grads.submitted(gpu.submit(recorded).await?);
        // Natively a readback blocks until this device is done: let the other replicas queue
        // their work first, so the devices run side by side instead of in turn.
        collective::yield_now().await;
        // The device runs what was just submitted: meanwhile reduce what earlier ones filled.
        self.grads.reduce(gpu, Filled::AllButLatest).await?;
        let mine = own_read.read(gpu).await?;
        let all = if exchange {
            self.exchange.rows.exchange(self.replica, mine).await?.to_vec()
        } else {
            mine.repeat(replicas)
        };
        // `all` is each replica's own rows of every site, replica after replica.
        let per_replica: usize = own.iter().map(|s| s.len as usize).sum();
        if all.len() != per_replica * replicas {
            let (site, local) = (sites[0].site, sites[0].local);
            return Err(StepError::Invalid(format!(
                "replica {} has {local} examples at BN site {site}, but the replicas' rows add up to {} values, not {}: every replica must hold an equal shard",
                self.replica,
                all.len(),
                per_replica * replicas
            )));
        }
        let mut at = 0;
        for (site, own) in sites.iter().zip(&own) {
            let len = own.len as usize;
            let rows: Vec<f32> = all
                .chunks(per_replica)
                .flat_map(|replica| &replica[at..at + len])
                .copied()
                .collect();
            gpu.queue.write_buffer(site.rows, 0, bytemuck::cast_slice(&rows));
            at += len;
        }
        Ok(())
    }
}

impl BnSync for SyncBn<'_> {
    fn replicas(&self) -> u32 {
        self.exchange.replicas
    }

    async fn stats(&self, gpu: &Gpu, enc: &mut Encoder, sites: &[BnRows<'_>]) -> step::Result<()> {
        self.gather(gpu, enc, sites, !self.exchange.unmerged_stats, None).await
    }

    async fn sums(
        &self,
        gpu: &Gpu,
        enc: &mut Encoder,
        sites: &[BnRows<'_>],
        done: Slice<'_>,
    ) -> step::Result<()> {
        self.gather(gpu, enc, sites, true, Some(done)).await
    }
}

impl SyncBn<'_> {
    /// After the backward: all-reduces the rest of the gradient buffer `grads` and every bucket
    /// still pending, and submits the copies back.
    pub async fn finish(&self, gpu: &Gpu, grads: &wgpu::Buffer) -> step::Result<()> {
        Ok(self.grads.finish(gpu, Slice::whole(grads)).await?)
    }
}

/// `replicas` devices, replica r's on `adapters[r % adapters.len()]` (no adapters: the
/// default one). Each asks for its adapter anew, which in a browser (one device per adapter)
/// gives every replica an adapter of its own.
pub async fn devices(replicas: usize, adapters: &[AdapterChoice]) -> Result<Vec<Gpu>> {
    if replicas == 0 {
        return Err(DataError::NoReplicas.into());
    }
    let default = [AdapterChoice::default()];
    let adapters = if adapters.is_empty() { &default[..] } else { adapters };
    let instance = gpu::instance();
    let mut gpus = Vec::with_capacity(replicas);
    for r in 0..replicas {
        let adapter = gpu::select_adapter(&instance, &adapters[r % adapters.len()]).await?;
        let device = Gpu::from_adapter(&adapter).await;
        gpus.push(device.map_err(|e| ParallelError::Replica {
            replica: r,
            adapter: adapter_label(&adapter.get_info()),
            source: e.into(),
        })?);
    }
    Ok(gpus)
}

/// R replicas of one model, training as one (see the module comment).
pub struct DataParallel {
    replicas: Vec<Replica>,
    /// Each replica's staging for the gradient all-reduce, kept from step to step.
    staging: Vec<BucketStaging>,
}

/// How a replica's adapter is named in messages: "llvmpipe (LLVM 15.0.6, 256 bits), Gl".
pub fn adapter_label(info: &wgpu::AdapterInfo) -> String {
    format!("{}, {:?}", info.name, info.backend)
}

impl DataParallel {
    /// `replicas` replicas holding `params` and `running` (model layout), on [`devices`].
    pub async fn new(
        model: &ResNet34,
        params: &[f32],
        running: &[f32],
        replicas: usize,
        adapters: &[AdapterChoice],
    ) -> Result<DataParallel> {
        DataParallel::from_gpus(devices(replicas, adapters).await?, model, params, running)
    }

    /// Replicas on the given devices, replica r on `gpus[r]`.
    pub fn from_gpus(
        gpus: Vec<Gpu>,
        model: &ResNet34,
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
        Ok(DataParallel { replicas, staging })
    }

    pub fn replicas(&self) -> &[Replica] {
        &self.replicas
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

    /// Each replica's adapter, in replica order.
    pub fn adapters(&self) -> Vec<String> {
        self.replicas.iter().map(|r| adapter_label(&r.gpu.info)).collect()
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

    /// One data-parallel forward/backward of `global`: replica r takes the r-th of R contiguous
    /// shards (the batch must divide by R), divides its loss by its own shard size, and the
    /// gradients are mean-all-reduced (in buckets during the backward, the rest after it), so
    /// every replica holds the identical gradient of the global batch's loss. Returns each
    /// replica's loss, logits and (if asked) pattern.
    pub async fn forward_backward(
        &mut self,
        global: &Batch,
        cfg: &StepConfig,
        opts: ParallelOptions,
    ) -> Result<Vec<StepOutput>> {
        let shards = global.shards(self.replicas.len())?;
        let op = if opts.sabotage == Some(Sabotage::SumGradients) {
            ReduceOp::Sum
        } else {
            ReduceOp::Mean
        };
        let exchange = BnExchange {
            unmerged_stats: opts.sabotage == Some(Sabotage::UnmergedStats),
            ..BnExchange::new(self.replicas.len(), op)
        };
        let step_opts = StepOptions { impose: None, capture_pattern: opts.capture_pattern };
        // One replica has nobody to meet: its own statistics are the global ones, and its
        // gradient is the mean. The same bits without the round trips.
        let alone = self.replicas.len() == 1;
        let bn = if alone { BnMode::Local } else { opts.bn };
        let steps = self.replicas.iter_mut().zip(&shards).zip(&self.staging).enumerate().map(
            |(r, ((replica, shard), staging))| {
                let exchange = &exchange;
                async move {
                    let divisor = shard.len() as f32;
                    let out = match bn {
                        BnMode::Sync => {
                            let hook = exchange.hook(r, staging);
                            let out = replica
                                .forward_backward(shard, cfg, divisor, &hook, step_opts)
                                .await;
                            match out {
                                Ok(out) => {
                                    hook.finish(&replica.gpu, &replica.grads).await.map(|()| out)
                                }
                                Err(e) => Err(e),
                            }
                        }
                        BnMode::Local => {
                            replica.forward_backward(shard, cfg, divisor, &LocalBn, step_opts).await
                        }
                    };
                    if let Err(e) = &out {
                        exchange.abort(r, e.to_string());
                    }
                    out
                }
            },
        );
        let results = futures::future::join_all(steps).await;
        let outputs = self.first_cause(results)?;
        if bn == BnMode::Local && !alone {
            // Per-replica statistics exist for the CONTROL gate only: the plain whole-buffer
            // all-reduce, without staging kept for it.
            let parts: Vec<(&Gpu, Slice)> =
                self.replicas.iter().map(|r| (&r.gpu, Slice::whole(&r.grads))).collect();
            collective::all_reduce(&parts, op).await.map_err(|e| self.collective_error(e))?;
        }
        Ok(outputs)
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
