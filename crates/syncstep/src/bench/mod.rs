//! `syncstep bench`: how fast a training step runs on the user's own adapter.
//!
//! - **Step.** After `warmup` untimed steps (which JIT-compile every pipeline and let the
//!   convolutions autotune), `steps` timed steps of forward_backward + sgd_update, each timed on
//!   the host from the first record to the last device's idle; the median counts. GFLOP/s counts
//!   a training step as 2.97 × the forward FLOPs. With R > 1 the single-device step at batch R·N
//!   runs in the same process on replica 0's adapter, its steps interleaved with the
//!   data-parallel ones (so both see the same machine load), and the ratio DP / single is
//!   reported; so is the single device at batch N, one replica's shard, which says what the
//!   replicas' own steps take without the exchange: N's step once where the replicas run at
//!   once, R times where they take turns (CPU adapters, sharing the machine's cores; see
//!   `Gpu::blocking_maps`).
//! - **Memory** per replica: the buffers the replica holds after a step (parameters, gradients,
//!   momentum, running statistics, saved activations; [`crate::step::Replica::device_bytes`]), plus the
//!   largest transient set: everything created through the replica's `Gpu` between two
//!   submissions of a timed step (im2col scratch, weight rows, dispatch uniforms, readback
//!   staging; see [`crate::gpu::MemoryStats`]), which wgpu keeps until that submission completes. wgpu's own
//!   staging behind `queue.write_buffer` (the input batch, the BN rows and the all-reduced
//!   gradient) is not counted.
//! - **Roofline probe.** A GEMM at size³ on the same adapter (4096³ on a GPU, 512³ on a CPU
//!   adapter unless `--roofline-size` says): the implicit-GEMM family's, as a 1×1 convolution,
//!   with its figures by construction, and the matmul's register tiles; then every distinct
//!   convolution of the step (forward, input-VJP, weight gradient through the plain launchers,
//!   i.e. with the chosen kernel) timed the same way: best of 3 after one warm-up run, each a
//!   submit measured to the device's idle. A convolution's GFLOP/s reads as a fraction of the
//!   best GEMM's.
//! - **Profile** of one extra step on replica 0: every dispatch bracketed by timestamp queries
//!   ([`Gpu::start_profile`]), grouped by layer and launcher, by launcher, and by entry point.
//!   A layer's scope runs from its conv to the next layer's: the forward scope holds the conv,
//!   its BatchNorm and what follows up to the next conv (ReLU, residual add); the backward scope
//!   the BatchNorm backward, the weight gradient and the input-VJP.
//!
//! Native only: it needs a clock.

use std::sync::Arc;
use std::time::Instant;

use crate::collective::{CollectiveError, Peers};
use crate::data::synthetic_batch;
use crate::gpu::{
    describe, launches_to_fill, AdapterChoice, Encoder, Gpu, GpuError, KernelTime, Slice,
};
use crate::kernels::conv2d::{self, Conv2dAlgo, Conv2dOp, Conv2dShape};
use crate::kernels::matmul::{self, MatmulAlgo, MatmulShape, MATMUL_TILES};
use crate::kernels::KernelError;
use crate::kernels::{Device, DeviceConfig};
use crate::model::{Arch, ModelError, ResNet};
use crate::parallel::{self, DataParallel, ParallelError, ParallelOptions};
use crate::step::{conv2d_shape, StepConfig};
pub use crate::train::median;

mod predicted;
mod report;

pub use predicted::{
    pytorch_cuda, DispatchFigures, Estimate, GpuModel, Predicted, Total, CONV_OPS, H100, H200,
    PYTORCH_CUDA,
};
pub use report::{
    AllReduceBytes, BenchReport, ExchangeWait, ImplicitProbe, ProbeTime, Profile, ProfileRow,
    ReplicaMemory, Roofline, StepBench,
};

/// A training step's FLOPs as a multiple of the forward's (docs/performance.md says why 2.97).
pub const STEP_FLOPS_PER_FORWARD: f64 = 2.97;
/// The layer of profile rows that sum over every layer.
pub const ALL_LAYERS: &str = "all layers";
/// Timed runs per probe kernel, after one untimed run; the fastest counts.
const PROBE_RUNS: usize = 3;
/// The least one timed submission of a probe kernel runs.
const PROBE_SUBMIT: std::time::Duration = std::time::Duration::from_millis(5);

/// Why a report has no profile.
#[derive(Clone, Debug, thiserror::Error)]
pub enum NoProfile {
    #[error("not asked for (--profile)")]
    NotAsked,
    #[error("unavailable: the adapter lacks {0}")]
    Unavailable(&'static str),
    /// The profiled step failed (the timed steps before it did not).
    #[error("{0}")]
    Failed(Arc<BenchError>),
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("--{flag} {problem}")]
    Setting { flag: &'static str, problem: String },
    #[error(transparent)]
    Parallel(#[from] ParallelError),
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
}

pub type Result<T, E = BenchError> = std::result::Result<T, E>;

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub arch: Arch,
    pub replicas: usize,
    /// Images per replica N; the global batch is R·N unless `global_batch` says otherwise.
    pub batch: usize,
    /// The global batch B, when it is not R·N: the first B mod R replicas take one more.
    pub global_batch: Option<usize>,
    pub image_size: u32,
    pub classes: u32,
    pub steps: usize,
    pub warmup: usize,
    /// Replica r runs on `adapters[r % len]`; empty: the default adapter.
    pub adapters: Vec<AdapterChoice>,
    pub profile: bool,
    /// The roofline probe's size; None skips the probe.
    pub roofline: Option<ProbeSize>,
    /// What the devices are made with: the kernel policy they share (its plan, `--plan-for`;
    /// whether it times the convolutions afresh, `--retune`) and how their kernels compile.
    pub device: DeviceConfig,
    /// `LP_NUM_THREADS` (lavapipe's threads) where the caller has one, for the report.
    pub lp_num_threads: Option<String>,
    /// The least a gradient bucket of the data-parallel step holds (`--bucket-mb`).
    pub bucket_bytes: u64,
    pub seed: u64,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            arch: Arch::default(),
            replicas: 1,
            batch: 8,
            global_batch: None,
            image_size: 32,
            classes: 10,
            steps: 5,
            warmup: 1,
            adapters: Vec::new(),
            profile: false,
            roofline: Some(ProbeSize::ForAdapter),
            device: DeviceConfig::default(),
            lp_num_threads: None,
            bucket_bytes: parallel::DEFAULT_BUCKET_BYTES,
            seed: 0,
        }
    }
}

impl BenchConfig {
    /// The global batch B.
    pub fn global(&self) -> usize {
        self.global_batch.unwrap_or(self.replicas * self.batch)
    }

    /// Refuses settings that cannot be measured, naming the command-line flag.
    pub fn validate(&self) -> Result<()> {
        let setting =
            |flag, problem: &str| Err(BenchError::Setting { flag, problem: problem.to_string() });
        if self.replicas == 0 {
            return setting("replicas", "is 0: at least 1 device is needed");
        }
        if self.batch == 0 && self.global_batch.is_none() {
            return setting("batch", "is 0: each replica needs at least 1 image");
        }
        if self.global() < self.replicas {
            let problem = format!(
                "is {}: each of {} replicas needs at least 1 image",
                self.global(),
                self.replicas
            );
            return setting("batch", &problem);
        }
        if self.steps == 0 {
            return setting("steps", "is 0: time at least 1 step");
        }
        if self.warmup == 0 {
            return setting("warmup", "is 0: at least 1 untimed step compiles the pipelines and autotunes the convolutions");
        }
        if let Err(e) = ResNet::check_image_size(self.image_size, self.image_size) {
            return setting("image-size", &format!("{}: {e}", self.image_size));
        }
        if let Err(e) = ResNet::new(self.arch, self.classes) {
            return setting("classes", &format!("is {}: {e}", self.classes));
        }
        if let Some(ProbeSize::Cube(size)) = self.roofline {
            if size == 0 || size % 4 != 0 {
                return setting(
                    "roofline-size",
                    &format!("is {size}: the tiled matmul needs a positive multiple of 4"),
                );
            }
        }
        Ok(())
    }
}

/// The roofline probe's GEMM size, m = k = n.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeSize {
    /// [`GPU_PROBE`] on a GPU adapter (a grid that fills a large GPU), [`CPU_PROBE`] on a CPU
    /// adapter (where 4096³ would take a minute).
    ForAdapter,
    Cube(u32),
}

pub const GPU_PROBE: u32 = 4096;
pub const CPU_PROBE: u32 = 512;

impl ProbeSize {
    /// The size on `gpu`'s adapter.
    pub fn on(self, gpu: &Gpu) -> u32 {
        match self {
            ProbeSize::Cube(size) => size,
            ProbeSize::ForAdapter if gpu.info.device_type == wgpu::DeviceType::Cpu => CPU_PROBE,
            ProbeSize::ForAdapter => GPU_PROBE,
        }
    }
}

/// The least of `v`; infinity when empty.
fn least(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

/// The most of `v`; 0 when empty.
fn most(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

/// One training step (forward_backward + sgd_update) of `batch` over every replica, timed on
/// the host until every replica's device is idle: its seconds, and those its update waited for
/// the gradient exchange after the backward ([`DataParallel::exchange_wait`]) if it exchanged.
fn timed_step(
    dp: &mut DataParallel,
    batch: &crate::data::Batch,
    cfg: &StepConfig,
) -> Result<(f64, Option<f64>)> {
    let start = Instant::now();
    let opts = ParallelOptions { clock: Some(Instant::now), ..ParallelOptions::default() };
    pollster::block_on(async {
        dp.forward_backward(batch, cfg, opts).await?;
        dp.sgd_update(cfg).await
    })?;
    for r in dp.replicas() {
        r.gpu.wait()?;
    }
    let wait = dp.exchange_wait().map(|w| w.as_secs_f64());
    Ok((start.elapsed().as_secs_f64(), wait))
}

/// Runs the benchmark; `progress` hears what starts (warm-up steps compile for minutes on a
/// CPU driver).
pub fn run(cfg: &BenchConfig, progress: &mut dyn FnMut(&str)) -> Result<BenchReport> {
    run_with_peers(cfg, &Peers::InProcess, progress)
}

/// [`run`] as one rank of several: `cfg.replicas` are this process's replicas (on
/// `cfg.adapters`), its `peers` hold as many each, and `cfg.global_batch` is the whole step's.
/// Every rank runs the same data-parallel steps; rank 0 alone also runs the single device and
/// the roofline probe, and its report is the one to print.
pub fn run_with_peers(
    cfg: &BenchConfig,
    peers: &Peers,
    progress: &mut dyn FnMut(&str),
) -> Result<BenchReport> {
    cfg.validate()?;
    let lead = peers.rank() == 0;
    let model = model_of(cfg)?;
    let params = model.init_params(cfg.seed);
    let running = model.init_buffers();
    let step_cfg = StepConfig::default();
    let (r, b, size) = (cfg.replicas * peers.ranks(), cfg.global(), cfg.image_size);
    if b < r {
        let problem = format!("is {b}: each of {r} replicas needs at least 1 image");
        return Err(BenchError::Setting { flag: "batch", problem });
    }
    let batch =
        synthetic_batch(cfg.seed, 0, b, size, size, cfg.classes).map_err(ParallelError::from)?;
    let step_flops = STEP_FLOPS_PER_FORWARD * model.forward_flops(size, size) * b as f64;
    check_training_batch(&model, b, size)?;

    progress(&format!("opening {} device(s)", cfg.replicas));
    let devices = (&model, &params[..], &running[..], &cfg.device);
    let mut dp = open_devices(devices, cfg.replicas, &cfg.adapters)?
        .with_peers(peers.clone())
        .with_bucket_bytes(cfg.bucket_bytes);
    let replicas_take_turns = dp.replicas().iter().any(|replica| replica.gpu.blocking_maps);
    // Everything this run will allocate on the devices, checked before any work: the single
    // device's whole batch (each replica's shard is smaller), the roofline's matrices.
    let limits = &dp.replicas()[0].gpu.limits;
    check_batch_fits(&model, b, size, limits)?;
    if let Some(probe) = cfg.roofline {
        check_roofline_fits(probe.on(&dp.replicas()[0].gpu), limits)?;
    }
    // With R > 1, one device on replica 0's adapter at B and at replica 0's shard (a longest).
    let shard = batch.shards(r).map_err(ParallelError::from)?.swap_remove(0);
    let n = shard.len();
    let mut singles = match r > 1 && lead {
        true => single_devices(cfg, devices, n)?,
        false => Vec::new(),
    };
    let mut runs: Vec<(&mut DataParallel, &crate::data::Batch)> =
        std::iter::once(&mut dp).chain(&mut singles).zip([&batch, &batch, &shard]).collect();
    let timed = time_steps(cfg, peers, &mut runs, &step_cfg, progress)?;
    let mut benches = runs.iter().zip(timed.seconds).map(|((run, batch), seconds)| StepBench {
        replicas: run.global_replicas(),
        global_batch: batch.len(),
        seconds,
        flops: step_flops * batch.len() as f64 / b as f64,
        memory: run.replicas().iter().map(ReplicaMemory::of).collect(),
    });
    let (step, single_bench, shard_bench) =
        (benches.next().expect("the configuration asked for"), benches.next(), benches.next());

    let profile = profile(cfg, &model, &mut dp, &batch, n, progress);
    let roofline = match cfg.roofline.filter(|_| lead) {
        Some(probe) => {
            let (gpu, size) = (&dp.replicas()[0].gpu, probe.on(&dp.replicas()[0].gpu));
            progress(&format!("roofline probe: GEMMs {size}³ and the step's convolutions"));
            Some(roofline(gpu, &model, n as u32, cfg.image_size, size)?)
        }
        None => None,
    };
    Ok(BenchReport {
        allreduce: AllReduceBytes::of(&dp, b),
        config: cfg.clone(),
        adapters: dp.replicas().iter().map(|r| describe(&r.gpu.info)).collect(),
        lp_num_threads: cfg.lp_num_threads.clone(),
        step,
        single: single_bench,
        shard: shard_bench,
        replicas_take_turns,
        ranks: peers.ranks(),
        rank_received_bytes: (peers.ranks() > 1).then(|| timed.received / cfg.steps as u64),
        exchange_wait: timed.exchange_wait,
        roofline,
        profile,
    })
}

/// Single devices on replica 0's adapter, for the step at the global batch and at one
/// replica's shard of `shard` images, unless BatchNorm cannot train on that alone (one image
/// at 32²): then there is no shard step to time.
fn single_devices(cfg: &BenchConfig, devices: Devices, shard: usize) -> Result<Vec<DataParallel>> {
    let first = &cfg.adapters[..cfg.adapters.len().min(1)];
    let shard_alone = check_training_batch(devices.0, shard, cfg.image_size).is_ok();
    (0..1 + shard_alone as usize).map(|_| open_devices(devices, 1, first)).collect()
}

/// What devices of a benchmark are opened with: the model, its parameters and running
/// statistics, and the configuration they are made with (one kernel policy, shared).
type Devices<'a> = (&'a ResNet, &'a [f32], &'a [f32], &'a DeviceConfig);

/// `replicas` replicas of `devices`' model on [`parallel::devices`] its configuration.
fn open_devices(
    (model, params, running, config): Devices,
    replicas: usize,
    adapters: &[AdapterChoice],
) -> Result<DataParallel> {
    let gpus = pollster::block_on(parallel::devices(replicas, adapters, config))?;
    Ok(DataParallel::from_gpus(gpus, model, params, running)?)
}

/// With `--profile`, one more step of `batch` with replica 0's dispatches timed (replica 0
/// runs a shard of `shard` images); else, or when it cannot be had, why there is none.
fn profile(
    cfg: &BenchConfig,
    model: &ResNet,
    dp: &mut DataParallel,
    batch: &crate::data::Batch,
    shard: usize,
    progress: &mut dyn FnMut(&str),
) -> std::result::Result<Profile, NoProfile> {
    if !cfg.profile {
        return Err(NoProfile::NotAsked);
    }
    progress("profiled step");
    let (secs, kernels) = profile_step(dp, batch, &StepConfig::default())?;
    Ok(Profile::new(model, shard as u32, cfg.image_size, secs, kernels))
}

/// The model `cfg` asks for.
fn model_of(cfg: &BenchConfig) -> Result<ResNet> {
    ResNet::new(cfg.arch, cfg.classes)
        .map_err(|e: ModelError| BenchError::Setting { flag: "classes", problem: e.to_string() })
}

/// Refuses a training batch of `batch` images of `size`² that leaves a BatchNorm no variance.
fn check_training_batch(model: &ResNet, batch: usize, size: u32) -> Result<()> {
    model
        .check_training_batch(batch as u64, size, size)
        .map_err(|e| BenchError::Setting { flag: "batch", problem: format!("{batch}: {e}") })
}

/// Refuses a step of `batch` images of `size`² whose buffers a device of these `limits` cannot
/// bind.
fn check_batch_fits(model: &ResNet, batch: usize, size: u32, limits: &wgpu::Limits) -> Result<()> {
    crate::step::check_batch_fits(model, batch as u64, size, size, limits)
        .map_err(|e| BenchError::Setting { flag: "batch", problem: format!("{batch}: {e}") })
}

/// Refuses a roofline probe whose `m`×`m` matrices a device of these `limits` cannot bind.
fn check_roofline_fits(m: u32, limits: &wgpu::Limits) -> Result<()> {
    let bytes = (m as u64).saturating_mul(m as u64).saturating_mul(4);
    let binding = limits.max_storage_buffer_binding_size.min(limits.max_buffer_size);
    if bytes <= binding {
        return Ok(());
    }
    Err(BenchError::Setting {
        flag: "roofline-size",
        problem: format!(
            "is {m}: its {m}×{m} matrices need {} each, more than one storage binding on this device allows ({})",
            crate::host::format_bytes(bytes, crate::host::ByteScale::Fit),
            crate::host::format_bytes(binding, crate::host::ByteScale::Fit)
        ),
    })
}

/// What [`time_steps`] measured.
struct Timed {
    /// Each run's step times.
    seconds: Vec<Vec<f64>>,
    /// Every rank's exchange waits in the data-parallel run; none if it is one replica.
    exchange_wait: Option<ExchangeWait>,
    /// Bytes this rank received during the timed steps.
    received: u64,
}

/// The warm-up steps, then the timed steps of every run in turn. Memory statistics count from
/// the first timed step.
fn time_steps(
    cfg: &BenchConfig,
    peers: &Peers,
    runs: &mut [(&mut DataParallel, &crate::data::Batch)],
    step_cfg: &StepConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<Timed> {
    for w in 0..cfg.warmup {
        progress(&format!(
            "warm-up step {}/{} (compiles pipelines, autotunes convolutions)",
            w + 1,
            cfg.warmup
        ));
        for (run, batch) in runs.iter_mut() {
            timed_step(run, batch, step_cfg)?;
        }
        peers.idle_barrier();
    }
    runs.iter()
        .flat_map(|(run, _)| run.replicas())
        .for_each(|replica| replica.gpu.reset_memory_stats());
    let mut seconds = vec![Vec::new(); runs.len()];
    let mut waits = Vec::new();
    let received = peers.received_bytes();
    for s in 0..cfg.steps {
        progress(&format!("timed step {}/{}", s + 1, cfg.steps));
        for ((run, batch), times) in runs.iter_mut().zip(&mut seconds) {
            let (step, wait) = timed_step(run, batch, step_cfg)?;
            times.push(step);
            // Only the first run, the data-parallel one, exchanges: the others are one device.
            waits.extend(wait);
        }
        // The other ranks wait idle while rank 0 times the single device.
        peers.idle_barrier();
    }
    let received = peers.received_bytes() - received;
    // Every rank's steps exchanged, or none did (one replica in all): all gather, or none.
    let exchange_wait = match waits.is_empty() {
        true => None,
        false => Some(ExchangeWait::gather(peers, &waits)?),
    };
    Ok(Timed { seconds, exchange_wait, received })
}

/// The dispatches of one step at `cfg`'s shape on one device, recorded but not run
/// ([`Gpu::set_record_only`]): each one's workgroups, invocations, FLOPs and bytes, and the
/// step's figures on a large GPU, for shapes a CPU adapter would take hours to run. Its times are 0.
pub fn dispatch_shapes(cfg: &BenchConfig, progress: &mut dyn FnMut(&str)) -> Result<Profile> {
    cfg.validate()?;
    let model = model_of(cfg)?;
    let (b, size) = (cfg.global(), cfg.image_size);
    check_training_batch(&model, b, size)?;
    let batch =
        synthetic_batch(cfg.seed, 0, b, size, size, cfg.classes).map_err(ParallelError::from)?;
    progress("opening the device");
    let (params, running) = (model.init_params(cfg.seed), model.init_buffers());
    let adapters = &cfg.adapters[..cfg.adapters.len().min(1)];
    let mut dp = open_devices((&model, &params, &running, &cfg.device), 1, adapters)?;
    check_batch_fits(&model, b, size, &dp.replicas()[0].gpu.limits)?;
    dp.replicas()[0].gpu.set_record_only(true);
    progress("recording one step");
    let (secs, kernels) = profile_step(&mut dp, &batch, &StepConfig::default())
        .map_err(|e| BenchError::Setting { flag: "shapes-only", problem: e.to_string() })?;
    Ok(Profile::new(&model, b as u32, size, secs, kernels))
}

/// One more step with replica 0's dispatches timed; Err says why there is no profile.
fn profile_step(
    dp: &mut DataParallel,
    batch: &crate::data::Batch,
    cfg: &StepConfig,
) -> std::result::Result<(f64, Vec<KernelTime>), NoProfile> {
    let failed = |e: BenchError| NoProfile::Failed(Arc::new(e));
    let gpu = &dp.replicas()[0].gpu;
    match gpu.start_profile() {
        Ok(()) => {}
        Err(GpuError::MissingFeature(what)) => return Err(NoProfile::Unavailable(what)),
        Err(e) => return Err(failed(e.into())),
    }
    let start = Instant::now();
    let outcome = pollster::block_on(async {
        dp.forward_backward(batch, cfg, ParallelOptions::default()).await?;
        // The SGD update is no layer's: its scope says so.
        dp.replicas()[0].gpu.profile_scope("sgd update");
        dp.sgd_update(cfg).await
    })
    .map_err(BenchError::from)
    .and_then(|()| dp.replicas().iter().try_for_each(|r| r.gpu.wait()).map_err(BenchError::from));
    let secs = start.elapsed().as_secs_f64();
    // Stop profiling even when the step failed.
    let kernels = pollster::block_on(dp.replicas()[0].gpu.finish_profile());
    outcome.map_err(failed)?;
    Ok((secs, kernels.map_err(|e| failed(e.into()))?))
}

/// Seconds of one run of what `record` records: the best of [`PROBE_RUNS`] submissions, each of
/// enough runs back to back to fill [`PROBE_SUBMIT`], after one untimed run.
fn best_time(
    gpu: &Gpu,
    record: impl Fn(&mut Encoder) -> crate::kernels::Result<()>,
) -> Result<f64> {
    let time = |launches| {
        gpu.time_recorded(launches, |enc| record(enc).map_err(BenchError::from), BenchError::from)
    };
    let launches = launches_to_fill(PROBE_SUBMIT, time(1)?);
    let mut best = f64::INFINITY;
    for _ in 0..PROBE_RUNS {
        best = best.min(time(launches)?.as_secs_f64());
    }
    Ok(best)
}

/// The implicit-GEMM family and the matmul tiles at `size`³, then every distinct convolution of
/// the step at `batch` images per device, through the plain (chosen) launchers.
fn roofline(
    gpu: &Device,
    model: &ResNet,
    batch: u32,
    image_size: u32,
    size: u32,
) -> Result<Roofline> {
    let implicit = implicit_probe(gpu, size)?;
    let tiles = matmul_probes(gpu, size)?;
    let mut convs = Vec::new();
    for (s, names, input_vjp) in conv_shapes(model, batch, image_size) {
        let ops = [Conv2dOp::Forward, Conv2dOp::BackwardInput, Conv2dOp::BackwardWeight];
        for op in ops.into_iter().filter(|&op| op != Conv2dOp::BackwardInput || input_vjp) {
            convs.push(conv_probe(gpu, op, &s, &names)?);
        }
    }
    Ok(Roofline { size, implicit, tiles, convs })
}

/// The implicit-GEMM family's GEMM at `size`³: the forward of a 1×1 convolution of `size`
/// channels to `size` on one image of 1 × `size` pixels, as the family's plan runs it, with
/// the dispatch's figures by construction.
fn implicit_probe(gpu: &Device, size: u32) -> Result<ImplicitProbe> {
    let s = Conv2dShape {
        n: 1,
        c_in: size,
        h: 1,
        w: size,
        c_out: size,
        kh: 1,
        kw: 1,
        stride: 1,
        pad: 0,
    };
    let op = Conv2dOp::Forward;
    let Ok(conv2d::implicit::Plan::Gather(plan)) = conv2d::implicit_plan(gpu, op, &s) else {
        unreachable!("a forward's plan is a gather GEMM")
    };
    let dispatch =
        conv2d::implicit::planned_gemm(gpu, op, &s, conv2d::implicit::Plan::Gather(plan));
    let len = size as u64 * size as u64;
    let (x, w, y) =
        (filled(gpu, "probe a", len)?, filled(gpu, "probe b", len)?, gpu.buffer("probe c", len)?);
    let seconds = best_time(gpu, |enc| {
        let operands = (Slice::whole(&x), Slice::whole(&w), Slice::whole(&y));
        conv2d::implicit::gather_gemm(gpu, enc, op, &s, plan, operands)
    })?;
    let probe = ProbeTime {
        name: format!("implicit GEMM {size}³"),
        op: "conv2d_forward",
        algo: format!("{} {}", Conv2dAlgo::Implicit, plan.config.name()),
        kept_taps: None,
        shape: format!("{size}x{size}x{size}"),
        flops: 2.0 * (len * size as u64) as f64,
        seconds,
    };
    Ok(ImplicitProbe { probe, dispatch })
}

/// Each matmul tile's best time at `size`³.
fn matmul_probes(gpu: &Gpu, size: u32) -> Result<Vec<ProbeTime>> {
    let shape = MatmulShape { m: size, k: size, n: size };
    let len = size as u64 * size as u64;
    let (a, b, c) =
        (filled(gpu, "probe a", len)?, filled(gpu, "probe b", len)?, gpu.buffer("probe c", len)?);
    let mut tiles = Vec::new();
    for algo in MATMUL_TILES {
        let MatmulAlgo::Tiled { rows, cols } = algo else { continue };
        let seconds = best_time(gpu, |enc| {
            matmul::matmul(
                gpu,
                enc,
                algo,
                &shape,
                Slice::whole(&a),
                Slice::whole(&b),
                Slice::whole(&c),
            )
        })?;
        tiles.push(ProbeTime {
            name: format!("matmul {size}³"),
            op: "matmul",
            algo: format!("tiled {rows}x{cols}"),
            kept_taps: None,
            shape: format!("{size}x{size}x{size}"),
            flops: shape.flops() as f64,
            seconds,
        });
    }
    Ok(tiles)
}

/// The step's distinct convolution shapes at `batch` images, in forward order, each with the
/// layers that share it and whether the step takes its input-VJP.
fn conv_shapes(model: &ResNet, batch: u32, image_size: u32) -> Vec<(Conv2dShape, Vec<&str>, bool)> {
    let mut shapes: Vec<(Conv2dShape, Vec<&str>, bool)> = Vec::new();
    for input in model.conv_inputs(image_size, image_size) {
        let s = conv2d_shape(&input.conv, batch, input.h, input.w);
        // The stem's input is the image: the step takes no input-VJP of it.
        let input_vjp = input.conv != model.stem_conv;
        match shapes.iter_mut().find(|(t, _, _)| *t == s) {
            Some((_, names, vjp)) => {
                names.push(model.conv_name(&input.conv));
                *vjp |= input_vjp;
            }
            None => shapes.push((s, vec![model.conv_name(&input.conv)], input_vjp)),
        }
    }
    shapes
}

/// The best time of convolution `op` at shape `s`, which the layers `names` share.
fn conv_probe(gpu: &Device, op: Conv2dOp, s: &Conv2dShape, names: &[&str]) -> Result<ProbeTime> {
    let kernel = conv2d::conv2d_kernel_name(gpu, op, s)?;
    let [a, b, out] = s.operand_lens(op);
    let (a, b, out) = (
        filled(gpu, "probe input", a)?,
        filled(gpu, "probe second input", b)?,
        filled(gpu, "probe output", out)?,
    );
    let seconds = best_time(gpu, |enc| {
        conv2d::conv2d_launch(
            gpu,
            enc,
            op,
            s,
            Slice::whole(&a),
            Slice::whole(&b),
            Slice::whole(&out),
        )
    })?;
    let name = if names.len() > 2 {
        format!("{} (+{} more)", names[..2].join(", "), names.len() - 2)
    } else {
        names.join(", ")
    };
    Ok(ProbeTime {
        name,
        op: op.name(),
        algo: kernel,
        kept_taps: s.crop().map(|c| (c.shape.kh, c.shape.kw)),
        shape: format!("{}x{}x{}x{} k{} s{} → {}", s.n, s.c_in, s.h, s.w, s.kh, s.stride, s.c_out),
        flops: s.flops() as f64,
        seconds,
    })
}

/// A probe buffer of `len` values of 0.5.
fn filled(gpu: &Gpu, label: &str, len: u64) -> Result<wgpu::Buffer> {
    Ok(gpu.upload(label, &vec![0.5f32; len as usize])?)
}
