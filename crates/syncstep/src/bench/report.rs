//! What `syncstep bench` measured, as a report: the steps' times, memory, the roofline probe and
//! the profile, printed as text or written as JSON.

use std::collections::HashMap;

use serde_json::{json, Value};

use super::predicted::{pytorch_cuda, Estimate, GpuModel, Predicted, H200};
use super::{
    least, median, most, BenchConfig, NoProfile, ALL_LAYERS, PROBE_RUNS, STEP_FLOPS_PER_FORWARD,
};
use crate::collective::{CollectiveError, Peers};
use crate::gpu::{DispatchShape, KernelTime, MemoryStats};
use crate::host::{format_bytes, ByteScale};
use crate::kernels::conv2d::KernelPlan;
use crate::model::ResNet;
use crate::step::Replica;

/// Step times of one configuration, with its memory per replica.
#[derive(Clone, Debug, PartialEq)]
pub struct StepBench {
    pub replicas: usize,
    /// Images over all replicas.
    pub global_batch: usize,
    /// Each timed step, in seconds.
    pub seconds: Vec<f64>,
    /// Training FLOPs of one step of the global batch.
    pub flops: f64,
    pub memory: Vec<ReplicaMemory>,
}

impl StepBench {
    pub fn median(&self) -> f64 {
        median(&self.seconds)
    }
    pub fn min(&self) -> f64 {
        least(&self.seconds)
    }
    pub fn max(&self) -> f64 {
        most(&self.seconds)
    }
    pub fn images_per_second(&self) -> f64 {
        self.global_batch as f64 / self.median()
    }
    pub fn gflops(&self) -> f64 {
        self.flops / self.median() / 1e9
    }
    fn label(&self) -> String {
        let (r, b) = (self.replicas, self.global_batch);
        if r == 1 {
            format!("single device, batch {b}")
        } else if b.is_multiple_of(r) {
            format!("data-parallel {r} × {}", b / r)
        } else {
            format!("data-parallel {r} replicas, {b} images")
        }
    }
    fn to_json(&self) -> Value {
        json!({
            "replicas": self.replicas,
            "global_batch": self.global_batch,
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

/// How long each rank's update waited for the gradient exchange after the backward was done on
/// its devices, a timed step each (`DataParallel::exchange_wait`): the part of the exchange
/// that running it beside the backward did not hide.
#[derive(Clone, Debug, PartialEq)]
pub struct ExchangeWait {
    /// Seconds, rank by rank (one rank in-process).
    pub per_rank: Vec<Vec<f64>>,
}

impl ExchangeWait {
    /// Every rank's `waits`, gathered from every rank (each calls it).
    pub(super) fn gather(peers: &Peers, waits: &[f64]) -> Result<ExchangeWait, CollectiveError> {
        let mine = waits.iter().flat_map(|w| w.to_le_bytes()).collect();
        let seconds = |bytes: &Vec<u8>| {
            let value = |b: &[u8]| b.try_into().map_or(f64::NAN, f64::from_le_bytes);
            bytes.chunks_exact(8).map(value).collect()
        };
        Ok(ExchangeWait { per_rank: peers.gather_bytes(vec![mine])?.iter().map(seconds).collect() })
    }

    /// A row per rank, its median also as a share of the data-parallel step's `step` seconds.
    fn text(&self, step: f64) -> Vec<String> {
        let mut lines = vec![
            "exchange wait, from the backward done on the device to the last gradient bucket reduced for the update (what the overlap did not hide):".to_string(),
            format!("{:<6} {:>9} {:>9} {:>9} {:>9}", "rank", "median s", "min s", "max s", "of step"),
        ];
        for (rank, w) in self.per_rank.iter().enumerate() {
            let (med, min, max) = (median(w), least(w), most(w));
            let share = 100.0 * med / step;
            lines.push(format!("{rank:<6} {med:>9.4} {min:>9.4} {max:>9.4} {share:>8.1}%"));
        }
        lines
    }

    fn to_json(&self) -> Value {
        let row = |(rank, w): (usize, &Vec<f64>)| {
            json!({"rank": rank, "median_s": median(w), "min_s": least(w), "max_s": most(w),
                   "steps_s": w})
        };
        Value::Array(self.per_rank.iter().enumerate().map(row).collect())
    }
}

/// What a data-parallel step's gradient all-reduce moves per replica: the gradient of each of
/// its canonical pieces (one for an aligned power-of-two shard, a few otherwise).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllReduceBytes {
    /// Bytes of one flat gradient.
    pub gradient_bytes: u64,
    /// Each replica's pieces, in replica order.
    pub pieces: Vec<usize>,
}

impl AllReduceBytes {
    pub(super) fn of(dp: &crate::parallel::DataParallel, batch: usize) -> AllReduceBytes {
        let replicas = dp.replicas();
        let gradient_bytes = replicas.first().map_or(0, |r| r.model.param_len as u64 * 4);
        AllReduceBytes::for_shards(batch, dp.global_replicas(), gradient_bytes)
    }

    /// The traffic of `replicas` replicas' shards of a batch of `batch`, for a gradient of
    /// `gradient_bytes`.
    pub fn for_shards(batch: usize, replicas: usize, gradient_bytes: u64) -> AllReduceBytes {
        let ranges = crate::data::shard_ranges(batch, replicas).unwrap_or_default();
        let pieces = ranges
            .iter()
            .map(|r| crate::canonical::pieces(r.start as u64..r.end as u64, batch as u64).len())
            .collect();
        AllReduceBytes { gradient_bytes, pieces }
    }

    /// Bytes each replica sends beyond one gradient (0 for power-of-two aligned shards).
    pub fn extra_bytes(&self) -> Vec<u64> {
        self.pieces.iter().map(|&p| (p as u64 - 1) * self.gradient_bytes).collect()
    }

    /// One line: the pieces each replica sends, and the bytes they add.
    fn text(&self) -> String {
        let extra: u64 = self.extra_bytes().iter().sum();
        format!(
            "gradient all-reduce: {} piece(s) per replica ({}), {} each; {} extra over all replicas{}",
            self.pieces.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", "),
            "one per canonical subtree of its shard",
            format_bytes(self.gradient_bytes, ByteScale::MiB),
            format_bytes(extra, ByteScale::MiB),
            if extra == 0 { " (aligned power-of-two shards)" } else { "" }
        )
    }

    fn to_json(&self) -> Value {
        let sent: Vec<u64> = self.pieces.iter().map(|&p| p as u64 * self.gradient_bytes).collect();
        json!({
            "gradient_bytes": self.gradient_bytes,
            "pieces_per_replica": self.pieces,
            "sent_bytes_per_replica": sent,
            "extra_bytes_per_replica": self.extra_bytes(),
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
    pub(super) fn of(replica: &Replica) -> ReplicaMemory {
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

/// The implicit-GEMM family's probe: its time, and its dispatch as the family's plan records
/// it (workgroups, invocations, and how it does its arithmetic).
#[derive(Clone, Debug, PartialEq)]
pub struct ImplicitProbe {
    pub probe: ProbeTime,
    pub dispatch: DispatchShape,
}

impl ImplicitProbe {
    /// Its figures by construction on `model`.
    fn estimate(&self, model: &GpuModel) -> Estimate {
        Estimate::of(model, &self.dispatch)
    }

    fn text(&self, adapter: &str) -> String {
        let c = self.dispatch.construction.unwrap_or_default();
        let e = self.estimate(&H200);
        let warps = e.warps_per_sm.unwrap_or(0.0);
        let occupancy = 100.0 * e.occupancy.unwrap_or(0.0);
        let mut line = format!(
            "  {}: {:.2} GFLOP/s; {} workgroups of {}, {} outputs an invocation, {} B of workgroup memory; on an H200 by construction {warps:.0} warps an SM, occupancy ceiling {occupancy:.0}%",
            self.probe.algo,
            self.probe.gflops(),
            self.dispatch.workgroups,
            self.dispatch.invocations,
            c.outputs_per_invocation,
            c.shared_bytes
        );
        if let Some(m) = GpuModel::ALL.iter().find(|m| adapter.contains(m.name)) {
            let share = 100.0 * self.probe.gflops() * 1e9 / m.peak();
            line.push_str(&format!("; {share:.0}% of this {}'s f32 peak", m.name));
        }
        line
    }

    fn to_json(&self, roof: f64) -> Value {
        let mut probe = self.probe.to_json(roof);
        let e = self.estimate(&H200);
        probe["workgroups"] = json!(self.dispatch.workgroups);
        probe["invocations"] = json!(self.dispatch.invocations);
        probe["h200_warps_per_sm"] = json!(e.warps_per_sm);
        probe["h200_occupancy_ceiling"] = json!(e.occupancy);
        probe
    }
}

/// The roofline probe's results.
#[derive(Clone, Debug, PartialEq)]
pub struct Roofline {
    pub size: u32,
    pub implicit: ImplicitProbe,
    pub tiles: Vec<ProbeTime>,
    pub convs: Vec<ProbeTime>,
}

impl Roofline {
    /// The best GEMM's GFLOP/s (the implicit family's or a matmul tile's): the roof.
    pub fn gflops(&self) -> f64 {
        let tiles = self.tiles.iter().map(ProbeTime::gflops).fold(0.0, f64::max);
        tiles.max(self.implicit.probe.gflops())
    }

    /// The GEMMs, then each convolution as a fraction of the best.
    fn text(&self, adapter: &str) -> Vec<String> {
        let best = self.gflops();
        let tiles: Vec<String> =
            self.tiles.iter().map(|t| format!("{} {:.2}", t.algo, t.gflops())).collect();
        let mut lines = vec![
            format!(
                "roofline: GEMMs {0}³, best of {PROBE_RUNS} runs each: {best:.2} GFLOP/s",
                self.size
            ),
            self.implicit.text(adapter),
            format!("  matmul register tiles: {}", tiles.join(", ")),
            format!(
                "{:<44} {:<24} {:<22} {:>9} {:>8} {:>6}",
                "convolution (layers)", "launcher", "kernel", "ms", "GFLOP/s", "roof"
            ),
        ];
        for p in &self.convs {
            let kernel =
                p.kept_taps.map_or(p.algo.clone(), |(h, w)| format!("{} {h}x{w} taps", p.algo));
            lines.push(format!(
                "{:<44} {:<24} {:<22} {:>9.3} {:>8.2} {:>5.0}%",
                clip(&p.name, 44),
                p.op,
                kernel,
                p.seconds * 1e3,
                p.gflops(),
                100.0 * p.gflops() / best
            ));
        }
        lines
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
    /// The step's figures by construction on each of [`GpuModel::ALL`].
    pub predicted: Vec<Predicted>,
}

impl Profile {
    /// Time the device spent in dispatches.
    pub fn kernel_seconds(&self) -> f64 {
        self.kernels.iter().map(|k| k.seconds).sum()
    }

    /// The step's kernel time and its figures on an H200, then its time by layer (the first `rows` rows), by
    /// launcher and by shader entry point.
    fn text(&self, rows: usize) -> Vec<String> {
        let mut lines = vec![format!(
            "profile of one step on replica 0 (timestamp queries): {} dispatches, {:.1} ms in kernels of a {:.1} ms step ({:.0}%)",
            self.kernels.len(),
            self.kernel_seconds() * 1e3,
            self.step_seconds * 1e3,
            100.0 * self.kernel_seconds() / self.step_seconds
        )];
        lines.extend(self.on(&super::H200).text());
        lines.extend(self.table("layer · launcher", &self.by_layer, rows));
        lines.push(String::new());
        lines.extend(self.table("launcher, all layers", &self.by_op, usize::MAX));
        lines.push(String::new());
        lines.extend(self.table("shader entry point, all layers", &self.by_entry, usize::MAX));
        lines
    }

    /// One of the profile's tables, its first `limit` rows. The per-layer table names layer and
    /// launcher; the others the kernel alone.
    fn table(&self, title: &str, rows: &[ProfileRow], limit: usize) -> Vec<String> {
        let all_layers = rows.first().is_some_and(|f| f.layer == ALL_LAYERS);
        let name = |r: &ProfileRow| match all_layers {
            true => r.kernel.clone(),
            false => format!("{} · {}", r.layer, r.kernel),
        };
        let mut lines = vec![format!(
            "{:<56} {:>6} {:>9} {:>6} {:>8}",
            title, "calls", "ms", "step", "GFLOP/s"
        )];
        for r in rows.iter().take(limit) {
            let gflops = r.flops.map_or(String::new(), |f| format!("{:.2}", f / r.seconds / 1e9));
            lines.push(format!(
                "{:<56} {:>6} {:>9.3} {:>5.1}% {:>8}",
                clip(&name(r), 56),
                r.dispatches,
                r.seconds * 1e3,
                100.0 * r.seconds / self.step_seconds,
                gflops
            ));
        }
        if rows.len() > limit {
            lines.push(format!("… {} more rows (all of them in --json)", rows.len() - limit));
        }
        lines
    }

    pub(super) fn new(
        model: &ResNet,
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
        let pytorch = pytorch_cuda(model.arch, image_size, batch, model.classes);
        let predicted =
            GpuModel::ALL.iter().map(|&m| Predicted::of(&kernels, m, pytorch)).collect();
        Profile { step_seconds, kernels, by_layer, by_op, by_entry, predicted }
    }

    /// Its figures on `model`, one of [`GpuModel::ALL`].
    pub fn on(&self, model: &GpuModel) -> &Predicted {
        self.predicted.iter().find(|p| p.model == *model).expect("every model is predicted")
    }

    pub fn to_json(&self) -> Value {
        let rows = |rows: &[ProfileRow]| {
            rows.iter().map(|r| r.to_json(self.step_seconds)).collect::<Vec<_>>()
        };
        let in_order: Vec<Value> = self
            .kernels
            .iter()
            .map(|k| {
                let s = &k.shape;
                json!({"layer": k.scope, "kernel": k.op, "entry": k.entry, "seconds": k.seconds,
                       "workgroups": s.workgroups, "invocations": s.invocations,
                       "flops": s.flops, "bytes": s.bytes})
            })
            .collect();
        json!({
            "step_s": self.step_seconds,
            "kernel_s": self.kernel_seconds(),
            "dispatches": self.kernels.len(),
            "by_layer": rows(&self.by_layer),
            "by_op": rows(&self.by_op),
            "by_entry": rows(&self.by_entry),
            "in_order": in_order,
            "predicted": self.predicted.iter().map(|p| (p.model.name.to_string(), p.to_json())).collect::<serde_json::Map<_, _>>(),
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
    /// The gradient all-reduce's traffic (R > 1).
    pub allreduce: AllReduceBytes,
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
    /// Processes the replicas run in (MPI ranks; 1 in-process).
    pub ranks: usize,
    /// Under MPI: bytes rank 0 received from the others a timed step.
    pub rank_received_bytes: Option<u64>,
    /// Data-parallel (R > 1): how long each rank's update waited for the exchange.
    pub exchange_wait: Option<ExchangeWait>,
    pub roofline: Option<Roofline>,
    /// The profile, or why there is none (`--profile` not given, or no timestamp queries).
    pub profile: std::result::Result<Profile, NoProfile>,
}

impl BenchReport {
    /// Data-parallel step time over the single device's at the same global batch (R > 1).
    pub fn ratio(&self) -> Option<f64> {
        self.single.as_ref().map(|s| self.step.median() / s.median())
    }

    /// What the replicas' own steps take, without the exchange (R > 1): the shard's step once
    /// for each replica of a process where they take turns, once where they run at once
    /// (ranks, each its own process, run at once).
    pub fn own_steps_seconds(&self) -> Option<f64> {
        let per_process = (self.step.replicas / self.ranks.max(1)) as f64;
        let turns = if self.replicas_take_turns { per_process } else { 1.0 };
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
        let mut lines = self.steps_text();
        lines.extend(self.exchange_text());
        lines.push(String::new());
        lines.extend(self.memory_text());
        if let Some(roof) = &self.roofline {
            lines.push(String::new());
            lines.extend(roof.text(self.adapters.first().map_or("", String::as_str)));
        }
        lines.push(String::new());
        match &self.profile {
            Err(why) => lines.push(format!("profile: {why}")),
            Ok(p) => lines.extend(p.text(rows)),
        }
        lines.iter().map(|l| format!("{l}\n")).collect()
    }

    /// What ran where and how it was timed, then each configuration's times.
    fn steps_text(&self) -> Vec<String> {
        let c = &self.config;
        let mut lines = vec![format!("syncstep bench: {2} training step (forward, backward, SGD), {0}×{0} images, {1} classes", c.image_size, c.classes, c.arch.title())];
        for (r, a) in self.adapters.iter().enumerate() {
            lines.push(format!("replica {r}: {a}"));
        }
        if let Some(t) = &self.lp_num_threads {
            lines.push(format!("LP_NUM_THREADS={t}"));
        }
        lines.push(format!("median of {} steps after {} warm-up; a step counts {STEP_FLOPS_PER_FORWARD} × forward FLOPs", c.steps, c.warmup));
        lines.push(format!("kernels: {}", plan_words(c.device.policy.plan)));
        lines.push(String::new());
        lines.push(format!(
            "{:<34} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "configuration", "median s", "min s", "max s", "images/s", "GFLOP/s"
        ));
        for s in self.benches() {
            lines.push(format!(
                "{:<34} {:>9.4} {:>9.4} {:>9.4} {:>9.1} {:>9.2}",
                s.label(),
                s.median(),
                s.min(),
                s.max(),
                s.images_per_second(),
                s.gflops()
            ));
        }
        lines
    }

    /// Data-parallel (R > 1): the ratios to the single device and to the replicas' own steps,
    /// how long each rank waited for the exchange, what the all-reduce moves, and under MPI
    /// what rank 0 received.
    fn exchange_text(&self) -> Vec<String> {
        let mut lines = Vec::new();
        if let Some(ratio) = self.ratio() {
            lines.push(format!(
                "data-parallel / single device at batch {}: {ratio:.3}",
                self.step.global_batch
            ));
        }
        if let (Some(own), Some(own_ratio), Some(exchange)) =
            (self.own_steps_seconds(), self.own_steps_ratio(), self.exchange_ratio())
        {
            let r = self.step.replicas / self.ranks.max(1);
            let n = self.shard.as_ref().map_or(0, |s| s.global_batch);
            let ranks = match self.ranks {
                1 => String::new(),
                p => format!(" in each of {p} ranks, which run at once"),
            };
            let how = if self.replicas_take_turns && r > 1 {
                format!("{r} × single device at batch {n} (the replicas take turns{ranks}: CPU adapters share the cores)")
            } else {
                format!("single device at batch {n} (the replicas run at once)")
            };
            lines.push(format!("the replicas' own steps, {how}: {own:.4} s, {own_ratio:.3} × single device at batch {}", self.step.global_batch));
            lines.push(format!("data-parallel / the replicas' own steps: {exchange:.3} (what the BatchNorm trips and the gradient all-reduce add)"));
        } else if self.single.is_some() {
            lines.push("the replicas' own steps: not timed, one replica's shard is too small a batch for BatchNorm on a device of its own".into());
        }
        if let Some(wait) = &self.exchange_wait {
            lines.extend(wait.text(self.step.median()));
        }
        if self.single.is_some() {
            lines.push(self.allreduce.text());
        }
        if let Some(bytes) = self.rank_received_bytes {
            lines.push(format!(
                "MPI: {} ranks × {} replicas; rank 0 received {} a step from the others",
                self.ranks,
                self.step.replicas / self.ranks.max(1),
                format_bytes(bytes, ByteScale::MiB)
            ));
        }
        lines
    }

    /// Each configuration's memory, replica by replica.
    fn memory_text(&self) -> Vec<String> {
        let mut lines = Vec::new();
        for s in self.benches() {
            for (r, m) in s.memory.iter().enumerate() {
                lines.push(format!(
                    "memory, {} replica {r}: held {}, + largest transient set {} (largest buffer {}) = peak {}",
                    s.label(),
                    format_bytes(m.held_bytes, ByteScale::MiB),
                    format_bytes(m.transient_bytes, ByteScale::MiB),
                    format_bytes(m.largest_transient_buffer_bytes, ByteScale::MiB),
                    format_bytes(m.peak_bytes(), ByteScale::MiB)
                ));
            }
        }
        lines
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
            json!({"size": r.size, "gflops": roof, "implicit": r.implicit.to_json(roof),
                   "tiles": probes(&r.tiles), "convs": probes(&r.convs)})
        });
        let mut report = json!({
            "config": {
                "replicas": c.replicas,
                "ranks": self.ranks,
                "batch_per_replica": c.batch,
                "global_batch": c.global(),
                "image_size": c.image_size,
                "classes": c.classes,
                "steps": c.steps,
                "warmup": c.warmup,
                "profile": c.profile,
                "plan_for": c.device.policy.plan.name(),
            },
            "adapters": self.adapters,
            "lp_num_threads": self.lp_num_threads,
            "step_flops_per_forward": STEP_FLOPS_PER_FORWARD,
            "step": self.step.to_json(),
            "allreduce": (self.step.replicas > 1).then(|| self.allreduce.to_json()),
            "single": self.single.as_ref().map(StepBench::to_json),
            "ratio": self.ratio(),
            "shard": self.shard.as_ref().map(StepBench::to_json),
            "replicas_take_turns": self.replicas_take_turns,
            "rank_received_bytes_per_step": self.rank_received_bytes,
            "own_steps_s": self.own_steps_seconds(),
            "own_steps_ratio": self.own_steps_ratio(),
            "exchange_ratio": self.exchange_ratio(),
            "exchange_wait": self.exchange_wait.as_ref().map(ExchangeWait::to_json),
            "roofline": roofline,
            "profile": self.profile.as_ref().ok().map(Profile::to_json),
        });
        if let Err(why) = &self.profile {
            report["profile_unavailable"] = json!(why.to_string());
        }
        report.to_string()
    }
}

fn plan_words(plan: KernelPlan) -> &'static str {
    match plan {
        KernelPlan::Auto => {
            "the GPU plan on GPU adapters, the timed choice on CPU adapters (--plan-for auto)"
        }
        KernelPlan::Gpu => "the GPU plan, chosen without a clock (--plan-for gpu)",
        KernelPlan::Timed => "the fastest of the candidates timed here (--plan-for timed)",
    }
}

fn clip(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(width - 1).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Aligned power-of-two shards send one gradient each, as before any shape was allowed;
    /// other shapes send a few, and the report says how many bytes more.
    #[test]
    fn the_all_reduce_sends_one_gradient_per_canonical_piece() {
        let of = |b, r| AllReduceBytes::for_shards(b, r, 100);
        for (b, r) in [(16, 2), (16, 4), (16, 8), (12, 3), (24, 3), (8, 1)] {
            assert!(of(b, r).extra_bytes().iter().all(|&e| e == 0), "{b} over {r}");
        }
        assert_eq!(of(9, 3).pieces, [2, 2, 2]);
        assert_eq!(of(9, 3).extra_bytes(), [100, 100, 100]);
        assert_eq!(of(10, 3).pieces, [1, 2, 2]); // [0, 4) | [4, 6) [6, 7) | [7, 8) [8, 10)
    }
}
