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
//!   momentum, running statistics, saved activations; [`Replica::device_bytes`]), plus the
//!   largest transient set: everything created through the replica's `Gpu` between two
//!   submissions of a timed step (im2col scratch, weight rows, dispatch uniforms, readback
//!   staging; see [`MemoryStats`]), which wgpu keeps until that submission completes. wgpu's own
//!   staging behind `queue.write_buffer` (the input batch, the BN rows and the all-reduced
//!   gradient) is not counted.
//! - **Roofline probe.** The best of the matmul tiles at size³ on the same adapter, then every
//!   distinct convolution of the step (forward, input-VJP, weight gradient through the plain
//!   launchers, i.e. with the autotuned kernel) timed the same way: best of 3 after one warm-up
//!   run, each a submit measured to the device's idle. A convolution's GFLOP/s reads as a
//!   fraction of the matmul's.
//! - **Profile** of one extra step on replica 0: every dispatch bracketed by timestamp queries
//!   ([`Gpu::start_profile`]), grouped by layer and launcher, by launcher, and by entry point.
//!   A layer's scope runs from its conv to the next layer's: the forward scope holds the conv,
//!   its BatchNorm and what follows up to the next conv (ReLU, residual add); the backward scope
//!   the BatchNorm backward, the weight gradient and the input-VJP.
//!
//! Native only: it needs a clock.

use std::collections::HashMap;
use std::time::Instant;

use crate::data::synthetic_batch;
use crate::gpu::{
    describe, launches_to_fill, AdapterChoice, Encoder, Gpu, GpuError, KernelTime, MemoryStats,
    Slice,
};
use crate::kernels::conv2d::{self, Conv2dOp, Conv2dShape};
use crate::kernels::matmul::{self, MatmulAlgo, MatmulShape, MATMUL_TILES};
use crate::kernels::KernelError;
use crate::model::{ModelError, ResNet34};
use crate::parallel::{DataParallel, ParallelError, ParallelOptions};
use crate::step::{conv2d_shape, Replica, StepConfig};
use serde_json::{json, Value};

/// A training step's FLOPs as a multiple of the forward's (ENVIRONMENT.md).
pub const STEP_FLOPS_PER_FORWARD: f64 = 2.97;
/// The layer of profile rows that sum over every layer.
pub const ALL_LAYERS: &str = "all layers";
/// Timed runs per probe kernel, after one untimed run; the fastest counts.
const PROBE_RUNS: usize = 3;
/// The least one timed submission of a probe kernel runs.
const PROBE_SUBMIT: std::time::Duration = std::time::Duration::from_millis(5);

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
}

pub type Result<T, E = BenchError> = std::result::Result<T, E>;

/// What to measure.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchConfig {
    pub replicas: usize,
    /// Images per replica N; the global batch is R·N.
    pub batch: usize,
    pub image_size: u32,
    pub classes: u32,
    pub steps: usize,
    pub warmup: usize,
    /// Replica r runs on `adapters[r % len]`; empty: the default adapter.
    pub adapters: Vec<AdapterChoice>,
    pub profile: bool,
    /// The roofline matmul's size (m = k = n); None skips the probe.
    pub roofline: Option<u32>,
    pub seed: u64,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            replicas: 1,
            batch: 8,
            image_size: 32,
            classes: 10,
            steps: 5,
            warmup: 1,
            adapters: Vec::new(),
            profile: false,
            roofline: Some(512),
            seed: 0,
        }
    }
}

impl BenchConfig {
    /// Refuses settings that cannot be measured, naming the command-line flag.
    pub fn validate(&self) -> Result<()> {
        let setting =
            |flag, problem: &str| Err(BenchError::Setting { flag, problem: problem.to_string() });
        if self.replicas == 0 {
            return setting("replicas", "is 0: at least 1 device is needed");
        }
        if self.batch == 0 {
            return setting("batch", "is 0: each replica needs at least 1 image");
        }
        if self.steps == 0 {
            return setting("steps", "is 0: time at least 1 step");
        }
        if self.warmup == 0 {
            return setting("warmup", "is 0: at least 1 untimed step compiles the pipelines and autotunes the convolutions");
        }
        if let Err(e) = ResNet34::check_image_size(self.image_size, self.image_size) {
            return setting("image-size", &format!("{}: {e}", self.image_size));
        }
        if let Err(e) = ResNet34::new(self.classes) {
            return setting("classes", &format!("is {}: {e}", self.classes));
        }
        if let Some(size) = self.roofline {
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

/// Step times of one configuration, with its memory per replica.
#[derive(Clone, Debug, PartialEq)]
pub struct StepBench {
    pub replicas: usize,
    pub batch_per_replica: usize,
    /// Each timed step, in seconds.
    pub seconds: Vec<f64>,
    /// Training FLOPs of one step of the global batch.
    pub flops: f64,
    pub memory: Vec<ReplicaMemory>,
}

impl StepBench {
    pub fn global_batch(&self) -> usize {
        self.replicas * self.batch_per_replica
    }
    pub fn median(&self) -> f64 {
        median(&self.seconds)
    }
    pub fn min(&self) -> f64 {
        self.seconds.iter().copied().fold(f64::INFINITY, f64::min)
    }
    pub fn max(&self) -> f64 {
        self.seconds.iter().copied().fold(0.0, f64::max)
    }
    pub fn images_per_second(&self) -> f64 {
        self.global_batch() as f64 / self.median()
    }
    pub fn gflops(&self) -> f64 {
        self.flops / self.median() / 1e9
    }
    fn label(&self) -> String {
        if self.replicas == 1 {
            format!("single device, batch {}", self.batch_per_replica)
        } else {
            format!("data-parallel {} × {}", self.replicas, self.batch_per_replica)
        }
    }
    fn to_json(&self) -> Value {
        json!({
            "replicas": self.replicas,
            "batch_per_replica": self.batch_per_replica,
            "median_s": self.median(),
            "min_s": self.min(),
            "max_s": self.max(),
            "images_per_s": self.images_per_second(),
            "gflops": self.gflops(),
            "step_flops": self.flops,
            "steps_s": self.seconds,
            "memory": self.memory.iter().map(|m| m.to_json()).collect::<Vec<_>>(),
        })
    }
}

/// One replica's device memory (see the module comment for what is counted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaMemory {
    /// Buffers the replica holds between steps.
    pub held_bytes: u64,
    /// The most bytes created for one submission during the timed steps.
    pub transient_bytes: u64,
    pub largest_transient_buffer_bytes: u64,
}

impl ReplicaMemory {
    fn of(replica: &Replica) -> ReplicaMemory {
        let MemoryStats { largest_submission_bytes, largest_buffer_bytes, .. } =
            replica.gpu.memory_stats();
        ReplicaMemory {
            held_bytes: replica.device_bytes(),
            transient_bytes: largest_submission_bytes,
            largest_transient_buffer_bytes: largest_buffer_bytes,
        }
    }
    /// Held plus the largest transient set.
    pub fn peak_bytes(&self) -> u64 {
        self.held_bytes + self.transient_bytes
    }
    fn to_json(self) -> Value {
        json!({
            "held_bytes": self.held_bytes,
            "transient_bytes": self.transient_bytes,
            "largest_transient_buffer_bytes": self.largest_transient_buffer_bytes,
            "peak_bytes": self.peak_bytes(),
        })
    }
}

/// One kernel of the roofline probe: a matmul tile or a convolution of the step.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeTime {
    /// A matmul tile (`tiled 12x8`) or the layers sharing a convolution shape.
    pub name: String,
    /// `matmul`, or the convolution's launcher (`conv2d_forward`, …).
    pub op: &'static str,
    /// The kernel variant that ran (the autotune's choice for convolutions).
    pub algo: String,
    /// Where the launcher ran only the taps that read the input (`Conv2dShape::crop`): the
    /// rows × columns it kept. The FLOP count is still the whole kernel's.
    pub kept_taps: Option<(u32, u32)>,
    pub shape: String,
    pub flops: f64,
    pub seconds: f64,
}

impl ProbeTime {
    pub fn gflops(&self) -> f64 {
        self.flops / self.seconds / 1e9
    }
    fn to_json(&self, roof: f64) -> Value {
        json!({
            "name": self.name,
            "op": self.op,
            "algo": self.algo,
            "kept_taps": self.kept_taps.map(|(h, w)| format!("{h}x{w}")),
            "shape": self.shape,
            "flops": self.flops,
            "seconds": self.seconds,
            "gflops": self.gflops(),
            "fraction_of_roofline": self.gflops() / roof,
        })
    }
}

/// The roofline probe's results.
#[derive(Clone, Debug, PartialEq)]
pub struct Roofline {
    pub size: u32,
    pub tiles: Vec<ProbeTime>,
    pub convs: Vec<ProbeTime>,
}

impl Roofline {
    /// The best matmul tile's GFLOP/s: the roof.
    pub fn gflops(&self) -> f64 {
        self.tiles.iter().map(ProbeTime::gflops).fold(0.0, f64::max)
    }
}

/// One row of a profile table: the dispatches grouped under `layer` and `kernel`.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileRow {
    pub layer: String,
    pub kernel: String,
    pub dispatches: usize,
    pub seconds: f64,
    /// FLOPs where known (the convolutions).
    pub flops: Option<f64>,
}

impl ProfileRow {
    fn to_json(&self, step: f64) -> Value {
        let mut row = json!({
            "layer": self.layer,
            "kernel": self.kernel,
            "dispatches": self.dispatches,
            "seconds": self.seconds,
            "fraction_of_step": self.seconds / step,
            "gflops": self.flops.map(|f| f / self.seconds / 1e9),
        });
        if let Some(f) = self.flops {
            row["flops"] = json!(f);
        }
        row
    }
}

/// A profiled step on replica 0.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    /// The profiled step's wall time, host clock.
    pub step_seconds: f64,
    /// Every dispatch, in recording order.
    pub kernels: Vec<KernelTime>,
    /// By layer and launcher (`conv2d_forward`, `bn_forward_apply`, …), slowest first.
    pub by_layer: Vec<ProfileRow>,
    /// By launcher over all layers, slowest first.
    pub by_op: Vec<ProfileRow>,
    /// By shader entry point over all layers, slowest first.
    pub by_entry: Vec<ProfileRow>,
}

impl Profile {
    /// Time the device spent in dispatches.
    pub fn kernel_seconds(&self) -> f64 {
        self.kernels.iter().map(|k| k.seconds).sum()
    }

    fn new(
        model: &ResNet34,
        batch: u32,
        image_size: u32,
        step_seconds: f64,
        kernels: Vec<KernelTime>,
    ) -> Profile {
        // Convolution FLOPs per (scope, launcher): the step names a layer's scopes
        // "<conv> forward" and "<conv> backward".
        let mut conv_flops = HashMap::new();
        for input in model.conv_inputs(image_size, image_size) {
            let (name, flops) = (model.conv_name(&input.conv), batch as f64 * input.flops());
            conv_flops.insert((format!("{name} forward"), "conv2d_forward"), flops);
            conv_flops.insert((format!("{name} backward"), "conv2d_backward_input"), flops);
            conv_flops.insert((format!("{name} backward"), "conv2d_backward_weight"), flops);
        }
        let by_layer = group(
            &kernels,
            |k| (k.scope.clone(), k.op.to_string()),
            |layer, op| conv_flops.get(&(layer.to_string(), op)).copied(),
        );
        // Per launcher: FLOPs are known when every layer's row of it knows them.
        let mut by_op: Vec<ProfileRow> = Vec::new();
        for row in &by_layer {
            match by_op.iter_mut().find(|r| r.kernel == row.kernel) {
                Some(r) => {
                    r.dispatches += row.dispatches;
                    r.seconds += row.seconds;
                    r.flops = r.flops.zip(row.flops).map(|(a, b)| a + b);
                }
                None => by_op.push(ProfileRow { layer: ALL_LAYERS.into(), ..row.clone() }),
            }
        }
        sort_slowest_first(&mut by_op);
        let by_entry = group(&kernels, |k| (ALL_LAYERS.into(), k.entry.to_string()), |_, _| None);
        Profile { step_seconds, kernels, by_layer, by_op, by_entry }
    }

    fn to_json(&self) -> Value {
        let rows = |rows: &[ProfileRow]| {
            rows.iter().map(|r| r.to_json(self.step_seconds)).collect::<Vec<_>>()
        };
        let in_order: Vec<Value> = self
            .kernels
            .iter()
            .map(|k| json!({"layer": k.scope, "kernel": k.op, "entry": k.entry, "seconds": k.seconds}))
            .collect();
        json!({
            "step_s": self.step_seconds,
            "kernel_s": self.kernel_seconds(),
            "dispatches": self.kernels.len(),
            "by_layer": rows(&self.by_layer),
            "by_op": rows(&self.by_op),
            "by_entry": rows(&self.by_entry),
            "in_order": in_order,
        })
    }
}

/// Dispatches grouped by `key` (layer, kernel), with `flops` of each group where known.
fn group(
    kernels: &[KernelTime],
    key: impl Fn(&KernelTime) -> (String, String),
    flops: impl Fn(&str, &'static str) -> Option<f64>,
) -> Vec<ProfileRow> {
    let mut rows: Vec<ProfileRow> = Vec::new();
    let mut index: HashMap<(String, String), usize> = HashMap::new();
    for k in kernels {
        let (layer, kernel) = key(k);
        let i = *index.entry((layer.clone(), kernel.clone())).or_insert_with(|| {
            rows.push(ProfileRow {
                flops: flops(&layer, k.op),
                layer,
                kernel,
                dispatches: 0,
                seconds: 0.0,
            });
            rows.len() - 1
        });
        rows[i].dispatches += 1;
        rows[i].seconds += k.seconds;
    }
    sort_slowest_first(&mut rows);
    rows
}

fn sort_slowest_first(rows: &mut [ProfileRow]) {
    rows.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
}

/// Everything `syncstep bench` measured.
#[derive(Clone, Debug)]
pub struct BenchReport {
    pub config: BenchConfig,
    /// Each replica's adapter (`gpu::describe`).
    pub adapters: Vec<String>,
    pub lp_num_threads: Option<String>,
    /// The configuration asked for (R replicas × N; R = 1 is the plain single-device step).
    pub step: StepBench,
    /// With R > 1: one device at R·N on replica 0's adapter.
    pub single: Option<StepBench>,
    /// With R > 1: one device at N, one replica's shard, on replica 0's adapter.
    pub shard: Option<StepBench>,
    /// Whether the replicas take turns on the devices (a replica's maps wait in place,
    /// `Gpu::blocking_maps`) rather than run at once.
    pub replicas_take_turns: bool,
    pub roofline: Option<Roofline>,
    /// The profile, or why there is none (`--profile` not given, or no timestamp queries).
    pub profile: std::result::Result<Profile, String>,
}

impl BenchReport {
    /// Data-parallel step time over the single device's at the same global batch (R > 1).
    pub fn ratio(&self) -> Option<f64> {
        self.single.as_ref().map(|s| self.step.median() / s.median())
    }

    /// What the replicas' own steps take, without the exchange (R > 1): the shard's step R
    /// times where the replicas take turns, once where they run at once.
    pub fn own_steps_seconds(&self) -> Option<f64> {
        let turns = if self.replicas_take_turns { self.step.replicas as f64 } else { 1.0 };
        self.shard.as_ref().map(|s| turns * s.median())
    }

    /// The ratio to the single device that a free exchange would leave (R > 1): the replicas'
    /// own steps over the single device's at R·N.
    pub fn own_steps_ratio(&self) -> Option<f64> {
        Some(self.own_steps_seconds()? / self.single.as_ref()?.median())
    }

    /// The data-parallel step over the replicas' own steps (R > 1): what the BatchNorm trips and
    /// the gradient all-reduce add.
    pub fn exchange_ratio(&self) -> Option<f64> {
        Some(self.step.median() / self.own_steps_seconds()?)
    }

    /// The human-readable report; `rows` limits the layer table of the profile.
    pub fn text(&self, rows: usize) -> String {
        let c = &self.config;
        let mut out = String::new();
        let mut line = |s: String| {
            out.push_str(&s);
            out.push('\n');
        };
        line(format!("syncstep bench: ResNet-34 training step (forward, backward, SGD), {0}×{0} images, {1} classes", c.image_size, c.classes));
        for (r, a) in self.adapters.iter().enumerate() {
            line(format!("replica {r}: {a}"));
        }
        if let Some(t) = &self.lp_num_threads {
            line(format!("LP_NUM_THREADS={t}"));
        }
        line(format!("median of {} steps after {} warm-up; a step counts {STEP_FLOPS_PER_FORWARD} × forward FLOPs", c.steps, c.warmup));
        line(String::new());
        line(format!(
            "{:<34} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "configuration", "median s", "min s", "max s", "images/s", "GFLOP/s"
        ));
        for s in self.benches() {
            line(format!(
                "{:<34} {:>9.4} {:>9.4} {:>9.4} {:>9.1} {:>9.2}",
                s.label(),
                s.median(),
                s.min(),
                s.max(),
                s.images_per_second(),
                s.gflops()
            ));
        }
        if let Some(ratio) = self.ratio() {
            line(format!(
                "data-parallel / single device at batch {}: {ratio:.3}",
                self.step.global_batch()
            ));
        }
        if let (Some(own), Some(own_ratio), Some(exchange)) =
            (self.own_steps_seconds(), self.own_steps_ratio(), self.exchange_ratio())
        {
            let (r, n) = (self.step.replicas, self.step.batch_per_replica);
            let how = if self.replicas_take_turns {
                format!("{r} × single device at batch {n} (the replicas take turns: CPU adapters share the cores)")
            } else {
                format!("single device at batch {n} (the replicas run at once)")
            };
            line(format!("the replicas' own steps, {how}: {own:.4} s, {own_ratio:.3} × single device at batch {}", self.step.global_batch()));
            line(format!("data-parallel / the replicas' own steps: {exchange:.3} (what the BatchNorm trips and the gradient all-reduce add)"));
        }
        line(String::new());
        for s in self.benches() {
            for (r, m) in s.memory.iter().enumerate() {
                line(format!(
                    "memory, {} replica {r}: held {}, + largest transient set {} (largest buffer {}) = peak {}",
                    s.label(),
                    mib(m.held_bytes),
                    mib(m.transient_bytes),
                    mib(m.largest_transient_buffer_bytes),
                    mib(m.peak_bytes())
                ));
            }
        }
        if let Some(roof) = &self.roofline {
            line(String::new());
            let best = roof.gflops();
            let tiles: Vec<String> =
                roof.tiles.iter().map(|t| format!("{} {:.2}", t.algo, t.gflops())).collect();
            line(format!("roofline: matmul {0}³, best of {PROBE_RUNS} runs per tile: {best:.2} GFLOP/s ({1})", roof.size, tiles.join(", ")));
            line(format!(
                "{:<44} {:<24} {:<22} {:>9} {:>8} {:>6}",
                "convolution (layers)", "launcher", "kernel", "ms", "GFLOP/s", "roof"
            ));
            for p in &roof.convs {
                let kernel =
                    p.kept_taps.map_or(p.algo.clone(), |(h, w)| format!("{} {h}x{w} taps", p.algo));
                line(format!(
                    "{:<44} {:<24} {:<22} {:>9.3} {:>8.2} {:>5.0}%",
                    clip(&p.name, 44),
                    p.op,
                    kernel,
                    p.seconds * 1e3,
                    p.gflops(),
                    100.0 * p.gflops() / best
                ));
            }
        }
        line(String::new());
        match &self.profile {
            Err(why) => line(format!("profile: {why}")),
            Ok(p) => {
                line(format!(
                    "profile of one step on replica 0 (timestamp queries): {} dispatches, {:.1} ms in kernels of a {:.1} ms step ({:.0}%)",
                    p.kernels.len(),
                    p.kernel_seconds() * 1e3,
                    p.step_seconds * 1e3,
                    100.0 * p.kernel_seconds() / p.step_seconds
                ));
                // The per-layer table names layer and launcher; the others the kernel alone.
                let table = |line: &mut dyn FnMut(String),
                             title: &str,
                             rows: &[ProfileRow],
                             limit: usize| {
                    let name = |r: &ProfileRow| {
                        if rows.first().is_some_and(|f| f.layer == ALL_LAYERS) {
                            r.kernel.clone()
                        } else {
                            format!("{} · {}", r.layer, r.kernel)
                        }
                    };
                    line(format!(
                        "{:<56} {:>6} {:>9} {:>6} {:>8}",
                        title, "calls", "ms", "step", "GFLOP/s"
                    ));
                    for r in rows.iter().take(limit) {
                        let gflops = r
                            .flops
                            .map_or(String::new(), |f| format!("{:.2}", f / r.seconds / 1e9));
                        line(format!(
                            "{:<56} {:>6} {:>9.3} {:>5.1}% {:>8}",
                            clip(&name(r), 56),
                            r.dispatches,
                            r.seconds * 1e3,
                            100.0 * r.seconds / p.step_seconds,
                            gflops
                        ));
                    }
                    if rows.len() > limit {
                        line(format!("… {} more rows (all of them in --json)", rows.len() - limit));
                    }
                };
                table(&mut line, "layer · launcher", &p.by_layer, rows);
                line(String::new());
                table(&mut line, "launcher, all layers", &p.by_op, usize::MAX);
                line(String::new());
                table(&mut line, "shader entry point, all layers", &p.by_entry, usize::MAX);
            }
        }
        out
    }

    /// The configurations measured: the one asked for, then (R > 1) the single device at R·N
    /// and at N.
    fn benches(&self) -> impl Iterator<Item = &StepBench> {
        std::iter::once(&self.step).chain(&self.single).chain(&self.shard)
    }

    /// Every figure as one JSON object.
    pub fn to_json(&self) -> String {
        let c = &self.config;
        let roofline = self.roofline.as_ref().map(|r| {
            let roof = r.gflops();
            let probes = |v: &[ProbeTime]| v.iter().map(|p| p.to_json(roof)).collect::<Vec<_>>();
            json!({"size": r.size, "gflops": roof, "tiles": probes(&r.tiles), "convs": probes(&r.convs)})
        });
        let mut report = json!({
            "config": {
                "replicas": c.replicas,
                "batch_per_replica": c.batch,
                "image_size": c.image_size,
                "classes": c.classes,
                "steps": c.steps,
                "warmup": c.warmup,
                "profile": c.profile,
            },
            "adapters": self.adapters,
            "lp_num_threads": self.lp_num_threads,
            "step_flops_per_forward": STEP_FLOPS_PER_FORWARD,
            "step": self.step.to_json(),
            "single": self.single.as_ref().map(StepBench::to_json),
            "ratio": self.ratio(),
            "shard": self.shard.as_ref().map(StepBench::to_json),
            "replicas_take_turns": self.replicas_take_turns,
            "own_steps_s": self.own_steps_seconds(),
            "own_steps_ratio": self.own_steps_ratio(),
            "exchange_ratio": self.exchange_ratio(),
            "roofline": roofline,
            "profile": self.profile.as_ref().ok().map(Profile::to_json),
        });
        if let Err(why) = &self.profile {
            report["profile_unavailable"] = json!(why);
        }
        report.to_string()
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

fn clip(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(width - 1).collect::<String>())
    }
}

/// The median of `v` (the mean of the middle two for an even count); NaN when empty.
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One training step (forward_backward + sgd_update) of `batch` over every replica, timed on
/// the host until every replica's device is idle.
fn timed_step(dp: &mut DataParallel, batch: &crate::data::Batch, cfg: &StepConfig) -> Result<f64> {
    let start = Instant::now();
    pollster::block_on(async {
        dp.forward_backward(batch, cfg, ParallelOptions::default()).await?;
        dp.sgd_update(cfg).await
    })?;
    for r in dp.replicas() {
        r.gpu.wait()?;
    }
    Ok(start.elapsed().as_secs_f64())
}

/// Runs the benchmark; `progress` hears what starts (warm-up steps compile for minutes on a
/// CPU driver).
pub fn run(cfg: &BenchConfig, progress: &mut dyn FnMut(&str)) -> Result<BenchReport> {
    cfg.validate()?;
    let model = ResNet34::new(cfg.classes)
        .map_err(|e: ModelError| BenchError::Setting { flag: "classes", problem: e.to_string() })?;
    let params = model.init_params(cfg.seed);
    let running = model.init_buffers();
    let step_cfg = StepConfig::default();
    let (r, n, size) = (cfg.replicas, cfg.batch, cfg.image_size);
    let batch = synthetic_batch(cfg.seed, 0, r * n, size, size, cfg.classes);
    let step_flops = STEP_FLOPS_PER_FORWARD * model.forward_flops(size, size) * (r * n) as f64;

    progress(&format!("opening {r} device(s)"));
    let mut dp =
        pollster::block_on(DataParallel::new(&model, &params, &running, r, &cfg.adapters))?;
    let replicas_take_turns = dp.replicas().iter().any(|replica| replica.gpu.blocking_maps);
    // With R > 1, one device on replica 0's adapter at R·N and at N (replica 0's shard).
    let shard = batch.shards(r).map_err(ParallelError::from)?.swap_remove(0);
    let mut singles = Vec::new();
    if r > 1 {
        for _ in [r * n, n] {
            singles.push(pollster::block_on(DataParallel::new(
                &model,
                &params,
                &running,
                1,
                &cfg.adapters[..cfg.adapters.len().min(1)],
            ))?);
        }
    }
    let mut runs: Vec<(&mut DataParallel, &crate::data::Batch)> =
        std::iter::once(&mut dp).chain(&mut singles).zip([&batch, &batch, &shard]).collect();
    for w in 0..cfg.warmup {
        progress(&format!(
            "warm-up step {}/{} (compiles pipelines, autotunes convolutions)",
            w + 1,
            cfg.warmup
        ));
        for (run, batch) in runs.iter_mut() {
            timed_step(run, batch, &step_cfg)?;
        }
    }
    runs.iter()
        .flat_map(|(run, _)| run.replicas())
        .for_each(|replica| replica.gpu.reset_memory_stats());
    let mut seconds = vec![Vec::new(); runs.len()];
    for s in 0..cfg.steps {
        progress(&format!("timed step {}/{}", s + 1, cfg.steps));
        for ((run, batch), times) in runs.iter_mut().zip(&mut seconds) {
            times.push(timed_step(run, batch, &step_cfg)?);
        }
    }
    let mut benches = runs.iter().zip(seconds).map(|((run, batch), seconds)| StepBench {
        replicas: run.replicas().len(),
        batch_per_replica: batch.len() / run.replicas().len(),
        seconds,
        flops: step_flops * batch.len() as f64 / (r * n) as f64,
        memory: run.replicas().iter().map(ReplicaMemory::of).collect(),
    });
    let (step, single_bench, shard_bench) =
        (benches.next().expect("the configuration asked for"), benches.next(), benches.next());

    let profile = if cfg.profile {
        progress("profiled step");
        profile_step(&mut dp, &batch, &step_cfg)
            .map(|(secs, kernels)| Profile::new(&model, n as u32, size, secs, kernels))
    } else {
        Err("not asked for (--profile)".to_string())
    };
    let gpu = &dp.replicas()[0].gpu;
    let roofline = match cfg.roofline {
        Some(size) => {
            progress(&format!("roofline probe: matmul {size}³ and the step's convolutions"));
            Some(roofline(gpu, &model, n as u32, cfg.image_size, size)?)
        }
        None => None,
    };
    Ok(BenchReport {
        config: cfg.clone(),
        adapters: dp.replicas().iter().map(|r| describe(&r.gpu.info)).collect(),
        lp_num_threads: std::env::var("LP_NUM_THREADS").ok(),
        step,
        single: single_bench,
        shard: shard_bench,
        replicas_take_turns,
        roofline,
        profile,
    })
}

/// One more step with replica 0's dispatches timed; Err says why there is no profile.
fn profile_step(
    dp: &mut DataParallel,
    batch: &crate::data::Batch,
    cfg: &StepConfig,
) -> std::result::Result<(f64, Vec<KernelTime>), String> {
    let gpu = &dp.replicas()[0].gpu;
    match gpu.start_profile() {
        Ok(()) => {}
        Err(GpuError::MissingFeature(what)) => {
            return Err(format!("unavailable: the adapter lacks {what}"))
        }
        Err(e) => return Err(e.to_string()),
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
    outcome.map_err(|e| e.to_string())?;
    Ok((secs, kernels.map_err(|e| e.to_string())?))
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

/// The matmul tiles at `size`³, then every distinct convolution of the step at `batch` images
/// per device, through the plain (autotuned) launchers.
fn roofline(
    gpu: &Gpu,
    model: &ResNet34,
    batch: u32,
    image_size: u32,
    size: u32,
) -> Result<Roofline> {
    let filled = |label: &str, len: u64| gpu.upload(label, &vec![0.5f32; len as usize]);
    let shape = MatmulShape { m: size, k: size, n: size };
    let len = size as u64 * size as u64;
    let (a, b, c) = (filled("probe a", len)?, filled("probe b", len)?, gpu.buffer("probe c", len)?);
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
    drop((a, b, c));

    // Distinct shapes in forward order, with the layers that share each.
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
    let mut convs = Vec::new();
    for (s, names, input_vjp) in shapes {
        let ops = [Conv2dOp::Forward, Conv2dOp::BackwardInput, Conv2dOp::BackwardWeight];
        for op in ops.into_iter().filter(|&op| op != Conv2dOp::BackwardInput || input_vjp) {
            let (algo, crop) = conv2d::conv2d_choice(gpu, op, &s)?;
            let [a, b, out] = s.operand_lens(op);
            let (a, b, out) = (
                filled("probe input", a)?,
                filled("probe second input", b)?,
                filled("probe output", out)?,
            );
            let seconds = best_time(gpu, |enc| {
                conv2d::conv2d_launch(
                    gpu,
                    enc,
                    op,
                    &s,
                    Slice::whole(&a),
                    Slice::whole(&b),
                    Slice::whole(&out),
                )
            })?;
            let kept_taps = crop.map(|c| (c.shape.kh, c.shape.kw));
            let name = if names.len() > 2 {
                format!("{} (+{} more)", names[..2].join(", "), names.len() - 2)
            } else {
                names.join(", ")
            };
            let shape =
                format!("{}x{}x{}x{} k{} s{} → {}", s.n, s.c_in, s.h, s.w, s.kh, s.stride, s.c_out);
            convs.push(ProbeTime {
                name,
                op: op.name(),
                algo: algo.to_string(),
                kept_taps,
                shape,
                flops: s.flops() as f64,
                seconds,
            });
        }
    }
    Ok(Roofline { size, tiles, convs })
}
