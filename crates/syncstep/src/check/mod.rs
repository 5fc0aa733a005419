//! The equivalence gates of docs/design.md as one async library function, [`run_check`] (or
//! [`run_check_on`] given the devices, as the browser face does), whose [`CheckReport`] the
//! CLI prints and the browser page shows. Nothing here is native-only, so it compiles for
//! wasm32.
//!
//! Every gate compares two programs on the SAME activation pattern: the single-device run is
//! given the data-parallel run's ReLU masks and pool argmaxes (the replicas' captured patterns
//! concatenated), so ReLU sign flips cannot enter; how many units a free single-device run
//! would have flipped is reported beside. Shard r's images are shifted by +0.5·r so that
//! per-replica BatchNorm statistics differ visibly from the global ones (CONTROL needs that);
//! the single device gets the same shifted global batch.
//!
//! PORTABLE (given a [`Golden`] made by another build) runs the single-device step once more
//! on the golden's pattern and holds loss and gradients to the golden's figures.

mod report;

use report::row;
pub use report::{Bound, CheckReport, Gate, GateRow, TensorErrors};

use crate::collective::Peers;
use crate::compare::{norm_rel, tensor_errors, worst_of, worst_tensor};
use crate::data::{synthetic_batch, Batch};
use crate::golden::{Golden, GoldenSettings};
use crate::gpu::{AdapterChoice, Gpu};
use crate::kernels::{Device, DeviceConfig};
use crate::model::{ActivationPattern, Arch, ModelError, ResNet};
use crate::parallel::{
    self, adapter_label, BnMode, DataParallel, ParallelError, ParallelOptions, Sabotage,
};
use crate::reference::step as reference;
use crate::step::{
    OneDevice, Replica, Shard, StepConfig, StepError, StepOptions, StepOutput, BN_EPS,
};

/// TEST's bound on every gradient tensor (norm-rel): bitwise, for any R and shard sizes.
pub const TEST_GRAD_BOUND: f64 = 0.0;
/// TEST's bound on the loss and the logits (relative): bitwise.
pub const TEST_OUTPUT_BOUND: f64 = 0.0;
/// CONTROL must be at least this many times TEST's error.
pub const CONTROL_FACTOR: f64 = 100.0;
/// Stands in for TEST's error when TEST is bitwise 0, so CONTROL must still be clearly nonzero.
pub const CONTROL_FLOOR: f64 = 1e-12;
/// DRIFT's bound on the parameters after K SGD steps (norm-rel): bitwise.
pub const DRIFT_BOUND: f64 = 0.0;
pub const TIE_LOSS_BOUND: f64 = 1e-5;
pub const TIE_GRAD_BOUND: f64 = 1e-4;
/// At or below this many values per channel at some BatchNorm site, TIE is ill-conditioned:
/// the normalisation divides by a standard deviation over so few values that f32's rounding of
/// them moves the output far more than at larger batches (f32 and f64 legitimately part: on
/// lavapipe, up to 2.7e-4 at 4 values and 9.8e-5 at 5, against 5.5e-5 at 6).
pub const TIE_ILL_CONDITIONED_VALUES: u64 = 5;
/// TIE's bounds are this many times looser at an ill-conditioned shape.
pub const TIE_ILL_CONDITIONED_FACTOR: f64 = 100.0;
/// TIE's gradient bound is this many times looser for ResNet-101: f32's own rounding through its
/// 100 convolutions parts from f64 by more than [`TIE_GRAD_BOUND`] (PyTorch's own f32 step, on
/// the same activation pattern, by 3.0e-4 at batch 16 and 3.9e-4 at 8, 32×32).
pub const TIE_DEEP_FACTOR: f64 = 5.0;
/// At or below this many values per channel, TIE measures nothing: two values normalise to ±1
/// whatever they are, so the gradient through them is rounding alone (f32 and f64 part by up
/// to 100 %; 0.1 at 3 values).
pub const TIE_NO_MEASURE_VALUES: u64 = 3;
/// PORTABLE's bound on every gradient tensor (norm-rel of the sample, and of the norm).
pub const PORTABLE_GRAD_BOUND: f64 = 1e-4;
/// PORTABLE's bound on the loss (relative).
pub const PORTABLE_LOSS_BOUND: f64 = 1e-5;
/// Shard r's images are raised by this times r.
pub const SHARD_SHIFT: f32 = 0.5;

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(transparent)]
    Parallel(#[from] ParallelError),
    #[error("single-device run ({adapter}): {source}")]
    Single {
        adapter: String,
        #[source]
        source: StepError,
    },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Golden(#[from] crate::golden::GoldenError),
    #[error("{0}")]
    Config(String),
}

pub type Result<T, E = CheckError> = std::result::Result<T, E>;

/// What to check: R replicas × N images (or a global batch of B that R need not divide)
/// against one device at the global batch. What every MPI rank of a check must agree on is
/// its serialised form (each rank's own adapters left out).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct CheckConfig {
    pub arch: Arch,
    pub replicas: usize,
    /// Images per replica, N: the global batch is R·N unless `global_batch` says otherwise.
    pub batch: usize,
    /// The global batch B, when it is not R·N: the first B mod R replicas take one more.
    pub global_batch: Option<usize>,
    pub image_size: u32,
    pub classes: u32,
    /// SGD steps of the DRIFT gate; 0 leaves DRIFT out.
    pub steps: usize,
    pub seed: u64,
    /// Replica r runs on `adapters[r % len]`, the single device on the first; empty: default.
    #[serde(skip)]
    pub adapters: Vec<AdapterChoice>,
    /// Also hold the single device against the f64 reference (TIE; slow on big batches).
    pub tie: bool,
    /// Break the equivalence on purpose (tests only), to see TEST fail.
    pub sabotage: Option<Sabotage>,
    /// The least a gradient bucket of the data-parallel step holds (`--bucket-mb`).
    pub bucket_bytes: u64,
}

impl Default for CheckConfig {
    fn default() -> Self {
        CheckConfig {
            arch: Arch::default(),
            replicas: 2,
            batch: 8,
            global_batch: None,
            image_size: 32,
            classes: 10,
            steps: 5,
            seed: 0,
            adapters: Vec::new(),
            tie: false,
            sabotage: None,
            bucket_bytes: parallel::DEFAULT_BUCKET_BYTES,
        }
    }
}

impl CheckConfig {
    /// The global batch B.
    pub fn global(&self) -> usize {
        self.global_batch.unwrap_or(self.replicas * self.batch)
    }

    /// "3 replicas × 4" or "3 replicas, 10 examples (4, 3, 3)".
    pub fn shards_text(&self) -> String {
        let (r, b) = (self.replicas, self.global());
        let sizes: Vec<String> = crate::data::shard_ranges(b, r)
            .map(|ranges| ranges.iter().map(|s| s.len().to_string()).collect())
            .unwrap_or_default();
        if b.is_multiple_of(r) {
            format!("{r} replica(s) × {}", b / r)
        } else {
            format!("{r} replicas, {b} examples ({})", sizes.join(", "))
        }
    }

    /// The smallest shard's examples.
    pub fn smallest_shard(&self) -> usize {
        self.global() / self.replicas.max(1)
    }

    /// What a PORTABLE golden made by this check is made at.
    pub fn golden_settings(&self) -> GoldenSettings {
        GoldenSettings {
            arch: self.arch,
            replicas: self.replicas,
            batch_per_replica: self.batch,
            global_batch: self.global(),
            image_size: self.image_size,
            classes: self.classes,
            seed: self.seed,
        }
    }

    /// The model this configuration checks, or why it cannot be checked.
    pub fn model(&self) -> Result<ResNet> {
        if self.global_batch.is_none() && self.batch == 0 {
            return Err(CheckError::Config("batch per replica must be at least 1".into()));
        }
        crate::data::shard_ranges(self.global(), self.replicas).map_err(ParallelError::from)?;
        ResNet::check_image_size(self.image_size, self.image_size)?;
        let model = ResNet::new(self.arch, self.classes)?;
        model.check_training_batch(self.global() as u64, self.image_size, self.image_size)?;
        Ok(model)
    }

    /// Why CONTROL does not apply here, if it does not: with one replica per-replica
    /// statistics are the global ones, and a replica of too few examples leaves its own
    /// BatchNorm one value per channel (no variance to differ in).
    pub fn control_not_applicable(&self, model: &ResNet) -> Option<String> {
        if self.replicas == 1 {
            return Some("n/a: one replica's own statistics are the global ones".into());
        }
        let (n, size) = (self.smallest_shard() as u64, self.image_size);
        model.check_training_batch(n, size, size).err().map(|_| {
            format!("n/a: a replica of {n} example(s) leaves its own BatchNorm 1 value per channel at {size}×{size}")
        })
    }
}

/// The devices a check runs on: one per replica, and one for the single-device side.
pub struct CheckDevices {
    /// This process's replicas' devices.
    pub replicas: Vec<Device>,
    pub single: Device,
    /// Where the other replicas are: in this process unless the check runs over MPI ranks,
    /// where every rank runs every gate (the single device too) and rank 0 reports.
    pub peers: Peers,
}

impl CheckDevices {
    /// Replica r on `cfg.adapters[r % len]`, the single device on the first, all made with
    /// `config` (see [`parallel::devices`]).
    pub async fn open(cfg: &CheckConfig, config: &DeviceConfig) -> Result<CheckDevices> {
        let replicas = parallel::devices(cfg.replicas, &cfg.adapters, config).await?;
        let choice = cfg.adapters.first().cloned().unwrap_or_default();
        let single = Gpu::new(&choice).await.map_err(ParallelError::from)?;
        let single = Device::new(single, config);
        Ok(CheckDevices { replicas, single, peers: Peers::InProcess })
    }
}

/// Where a running check is: phase `index` of `total` starts (`index == total`: done), and
/// the gates decided so far.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckProgress<'a> {
    pub index: usize,
    pub total: usize,
    pub phase: String,
    pub gates: &'a [GateRow],
}

/// Counts a check's phases off to a progress callback.
struct Phases<'p> {
    index: usize,
    total: usize,
    report: &'p mut dyn FnMut(&CheckProgress),
}

impl Phases<'_> {
    fn start(&mut self, phase: String, gates: &[GateRow]) {
        log::info!("{phase}");
        (self.report)(&CheckProgress { index: self.index, total: self.total, phase, gates });
        self.index += 1;
    }
}

/// The global batch of step `step`: R·N synthetic images from example step·R·N on, shard r's
/// images shifted by +0.5·r.
pub fn gate_batch(cfg: &CheckConfig, step: usize) -> Result<Batch> {
    let m = cfg.global();
    let size = cfg.image_size;
    let plain = synthetic_batch(cfg.seed, (step * m) as u64, m, size, size, cfg.classes)
        .map_err(ParallelError::from)?;
    let shards = plain.shards(cfg.replicas).map_err(ParallelError::from)?;
    let shifted: Vec<Batch> =
        shards.iter().enumerate().map(|(r, s)| s.shifted(SHARD_SHIFT * r as f32)).collect();
    Ok(Batch::concat(&shifted))
}

/// The single-device side of every gate: one replica at the global batch R·N.
struct Single {
    replica: Replica,
    adapter: String,
}

impl Single {
    async fn step(
        &mut self,
        batch: &Batch,
        cfg: &StepConfig,
        opts: StepOptions<'_>,
    ) -> Result<StepOutput> {
        self.replica
            .forward_backward(batch, cfg, Shard::whole(batch.len()), &OneDevice, opts)
            .await
            .map_err(|e| self.named(e))
    }
    fn named(&self, source: StepError) -> CheckError {
        CheckError::Single { adapter: self.adapter.clone(), source }
    }
    async fn read_grads(&self) -> Result<Vec<f32>> {
        self.replica.read_grads().await.map_err(|e| self.named(e))
    }
}

/// Runs TEST, CONTROL, REPEAT, DRIFT (unless `steps` is 0) and TIE (if asked) on the devices
/// `cfg.adapters` names, made with `config`, and returns their figures. Errors only when
/// something could not run; failed gates are rows with `pass: false`.
pub async fn run_check(cfg: &CheckConfig, config: &DeviceConfig) -> Result<CheckReport> {
    cfg.model()?;
    run_check_on(cfg, CheckDevices::open(cfg, config).await?, None, &mut |_| {}).await
}

/// [`run_check`] on the given devices (`cfg.adapters` is not read), with PORTABLE against
/// `golden` if one is given, calling `progress` as each phase starts and once when done.
pub async fn run_check_on(
    cfg: &CheckConfig,
    devices: CheckDevices,
    golden: Option<&Golden>,
    progress: &mut dyn FnMut(&CheckProgress),
) -> Result<CheckReport> {
    let model = cfg.model()?;
    let ranks = devices.peers.ranks();
    if devices.replicas.len() * ranks != cfg.replicas {
        return Err(CheckError::Config(format!(
            "{} replicas need {} devices, {} given in each of {ranks} process(es)",
            cfg.replicas,
            cfg.replicas,
            devices.replicas.len()
        )));
    }
    if let Some(g) = golden {
        g.check_fits(&cfg.golden_settings(), &model)?;
    }
    let phases = Phases {
        index: 0,
        total: 5 + golden.is_some() as usize + cfg.tie as usize + cfg.steps,
        report: progress,
    };
    let mut params = model.init_params(cfg.seed);
    model.randomize_batchnorm(&mut params, cfg.seed + 1);
    let running = model.init_buffers();
    let dp = DataParallel::from_gpus(devices.replicas, &model, &params, &running)?
        .with_peers(devices.peers)
        .with_bucket_bytes(cfg.bucket_bytes);
    let adapter = adapter_label(&devices.single.info);
    let replica = Replica::new(devices.single, model.clone(), &params, &running)
        .map_err(|source| CheckError::Single { adapter: adapter.clone(), source })?;
    let mut gates = Gates {
        cfg,
        model,
        dp,
        single: Single { replica, adapter },
        step_cfg: StepConfig::default(),
        sync: ParallelOptions {
            bn: BnMode::Sync,
            capture_pattern: true,
            sabotage: cfg.sabotage,
            clock: None,
        },
        batch: gate_batch(cfg, 0)?,
        phases,
        rows: Vec::new(),
    };
    let mut test = gates.test(golden).await?;
    if cfg.tie {
        gates.phase(format!("TIE: the f64 reference step at {}", cfg.global()));
        let rows = tie(&gates.model, &params, &running, &gates.batch, &test);
        gates.rows.extend(rows);
    }
    let portable_errors = test.portable.take().map(|(portable_rows, errors)| {
        gates.rows.extend(portable_rows);
        errors
    });
    let control_errors = gates.control(&test).await?;
    gates.repeat(&test).await?;
    if cfg.steps > 0 {
        let row = gates.drift().await?;
        gates.rows.push(row);
    }
    gates.report(test, control_errors, portable_errors, golden)
}

/// A check under way: both sides' devices, the first step's batch, and the gates decided so
/// far.
struct Gates<'c, 'p> {
    cfg: &'c CheckConfig,
    model: ResNet,
    dp: DataParallel,
    single: Single,
    step_cfg: StepConfig,
    /// The data-parallel step with synchronised BatchNorm, capturing its pattern.
    sync: ParallelOptions,
    /// Step 0's global batch, which TEST, CONTROL, REPEAT and PORTABLE run on.
    batch: Batch,
    phases: Phases<'p>,
    rows: Vec<GateRow>,
}

/// What TEST computed, that the gates after it compare with.
struct TestRun {
    dp_out: Vec<StepOutput>,
    dp_grads: Vec<f32>,
    /// The data-parallel step's activation pattern, imposed on the single device.
    pattern: ActivationPattern,
    single_out: StepOutput,
    single_grads: Vec<f32>,
    /// Each tensor's error, and the worst.
    errors: Vec<f64>,
    error: f64,
    /// PORTABLE's rows and each tensor's error, when a golden was given.
    portable: Option<(Vec<GateRow>, Vec<f64>)>,
}

impl Gates<'_, '_> {
    fn phase(&mut self, phase: String) {
        self.phases.start(phase, &self.rows);
    }

    /// TEST: the data-parallel step against the single device on the DP run's pattern (and
    /// PORTABLE, when given a golden, between the single device's free step and that one).
    async fn test(&mut self, golden: Option<&Golden>) -> Result<TestRun> {
        let (m, shards) = (self.cfg.global(), self.cfg.shards_text());
        self.phase(format!("TEST: data-parallel step, {shards}"));
        let dp_out = self.dp.forward_backward(&self.batch, &self.step_cfg, self.sync).await?;
        let dp_grads = self.dp.read_grads().await?.swap_remove(0);
        let pattern = self.dp.pattern(&dp_out)?;
        self.phase(format!("TEST: single-device step at {m}, deciding its own activation pattern"));
        let free = StepOptions { impose: None, capture_pattern: true };
        let free = self.single.step(&self.batch, &self.step_cfg, free).await?;
        let free_pattern = free.pattern.unwrap_or_default();
        // Before TEST's own single step: DRIFT starts from the gradients that one leaves.
        let portable = match golden {
            Some(g) => {
                self.phase(format!(
                    "PORTABLE: single-device step at {m} on the golden's activation pattern"
                ));
                Some(self.portable(g, &free_pattern).await?)
            }
            None => None,
        };
        self.phase(format!("TEST: single-device step at {m} on the data-parallel pattern"));
        let imposed = StepOptions { impose: Some(&pattern), ..Default::default() };
        let single_out = self.single.step(&self.batch, &self.step_cfg, imposed).await?;
        let single_grads = self.single.read_grads().await?;
        let flips = Some(free_pattern.flips(&pattern));
        let errors = tensor_errors(&self.model, &dp_grads, &single_grads);
        let (error, worst) = worst_of(&self.model, &errors);
        let bitwise = |e: f64| if e == 0.0 { "bitwise 0".to_string() } else { String::new() };
        let bound = Bound::AtMost(TEST_GRAD_BOUND);
        self.rows.push(row(Gate::Test, error, bound, worst, flips, bitwise(error)));
        // Every replica holds the global loss.
        let dp_loss = dp_out[0].loss as f64;
        let loss_err = (dp_loss - single_out.loss as f64).abs() / (single_out.loss as f64).abs();
        let bound = Bound::AtMost(TEST_OUTPUT_BOUND);
        let note = format!("{dp_loss:.7} vs {:.7}", single_out.loss);
        self.rows.push(row(Gate::TestLoss, loss_err, bound, None, None, note));
        let logits_err = norm_rel(&self.dp.logits(&dp_out)?, &single_out.logits);
        self.rows.push(row(Gate::TestLogits, logits_err, bound, None, None, bitwise(logits_err)));
        Ok(TestRun { dp_out, dp_grads, pattern, single_out, single_grads, errors, error, portable })
    }

    /// CONTROL: per-replica statistics must be visibly wrong, or TEST could not fail. Returns
    /// each tensor's error (NaN where CONTROL does not apply).
    async fn control(&mut self, test: &TestRun) -> Result<Vec<f64>> {
        self.phase("CONTROL: data-parallel step with per-replica BatchNorm statistics".into());
        if let Some(why) = self.cfg.control_not_applicable(&self.model) {
            self.rows.push(row(Gate::Control, f64::NAN, Bound::NotApplicable, None, None, why));
            return Ok(vec![f64::NAN; self.model.params.len()]);
        }
        let local = ParallelOptions { bn: BnMode::Local, ..self.sync };
        let local_out = self.dp.forward_backward(&self.batch, &self.step_cfg, local).await?;
        let local_grads = self.dp.read_grads().await?.swap_remove(0);
        let errors = tensor_errors(&self.model, &local_grads, &test.single_grads);
        let (control, worst) = worst_of(&self.model, &errors);
        let local_pattern = self.dp.pattern(&local_out)?;
        let floor = test.error.max(CONTROL_FLOOR);
        let flips = Some(local_pattern.flips(&test.pattern));
        let bound = Bound::AtLeast(CONTROL_FACTOR * floor);
        self.rows.push(row(Gate::Control, control, bound, worst, flips, String::new()));
        Ok(errors)
    }

    /// REPEAT: the same DP step again. Only the running statistics moved since, and training
    /// mode does not read them. It leaves step 0's gradients in place for DRIFT.
    async fn repeat(&mut self, test: &TestRun) -> Result<()> {
        self.phase("REPEAT: the data-parallel step again".into());
        let options = ParallelOptions { capture_pattern: false, ..self.sync };
        let again = self.dp.forward_backward(&self.batch, &self.step_cfg, options).await?;
        let again_grads = self.dp.read_grads().await?.swap_remove(0);
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits();
        let differing = again_grads.iter().zip(&test.dp_grads).filter(|(a, b)| !same(**a, **b));
        let losses = again.iter().zip(&test.dp_out).filter(|(a, b)| !same(a.loss, b.loss));
        let differing = differing.count() + losses.count();
        self.rows.push(row(
            Gate::Repeat,
            differing as f64,
            Bound::AtMost(0.0),
            None,
            None,
            "measured = gradient and loss values that differ bitwise between two runs".into(),
        ));
        Ok(())
    }

    /// PORTABLE: the single-device step on `golden`'s activation pattern, held to its loss
    /// and gradients; flips are those of this build's own `free` pattern. Returns the rows and
    /// each tensor's error.
    async fn portable(
        &mut self,
        golden: &Golden,
        free: &ActivationPattern,
    ) -> Result<(Vec<GateRow>, Vec<f64>)> {
        let imposed = StepOptions { impose: Some(&golden.pattern), ..Default::default() };
        let out = self.single.step(&self.batch, &self.step_cfg, imposed).await?;
        let errors = golden.tensor_errors(&self.model, &self.single.read_grads().await?);
        let (grad_err, worst) = worst_of(&self.model, &errors);
        let loss_err = (out.loss as f64 - golden.loss as f64).abs() / (golden.loss as f64).abs();
        let flips = Some(free.flips(&golden.pattern));
        let against = format!("against {}", golden.adapter);
        let rows = vec![
            row(
                Gate::Portable,
                grad_err,
                Bound::AtMost(PORTABLE_GRAD_BOUND),
                worst,
                flips,
                against,
            ),
            row(
                Gate::PortableLoss,
                loss_err,
                Bound::AtMost(PORTABLE_LOSS_BOUND),
                None,
                None,
                format!("{:.7} vs {:.7}", out.loss, golden.loss),
            ),
        ];
        Ok((rows, errors))
    }

    /// DRIFT: K SGD steps data-parallel beside K single-device steps (each given that step's
    /// DP pattern), from the same state; then parameters against each other, and replicas
    /// among themselves (bitwise). Step 0's gradients are already in place: the replicas' from
    /// REPEAT, the single device's from TEST (parameters untouched since).
    async fn drift(&mut self) -> Result<GateRow> {
        let (steps, step_cfg) = (self.cfg.steps, self.step_cfg);
        for step in 0..steps {
            self.phase(format!(
                "DRIFT: SGD step {} of {steps}, data-parallel and single-device",
                step + 1
            ));
            if step > 0 {
                let batch = gate_batch(self.cfg, step)?;
                let out = self.dp.forward_backward(&batch, &step_cfg, self.sync).await?;
                let pattern = self.dp.pattern(&out)?;
                let imposed = StepOptions { impose: Some(&pattern), ..Default::default() };
                self.single.step(&batch, &step_cfg, imposed).await?;
            }
            self.dp.sgd_update(&step_cfg).await?;
            let single = &mut self.single;
            single.replica.sgd_update(&step_cfg).await.map_err(|e| single.named(e))?;
        }
        let dp_params = self.dp.read_params().await?.swap_remove(0);
        let single = &self.single;
        let single_params = single.replica.read_params().await.map_err(|e| single.named(e))?;
        let (drift, worst) = worst_tensor(&self.model, &dp_params, &single_params);
        let differing: Vec<String> = self
            .dp
            .replicas_that_differ(|r| &r.params)
            .await?
            .iter()
            .map(|r| format!("replica {r} differs from replica 0 in its parameters"))
            .collect();
        let note = if differing.is_empty() {
            "replicas bitwise equal".to_string()
        } else {
            differing.join("; ")
        };
        let note = if drift == 0.0 { format!("bitwise 0; {note}") } else { note };
        let mut r = row(Gate::Drift, drift, Bound::AtMost(DRIFT_BOUND), worst, None, note);
        r.pass &= differing.is_empty();
        Ok(r)
    }

    /// The last phase ("done"), and the report: every gate, each tensor's errors, and the
    /// golden of TEST's single-device step.
    fn report(
        mut self,
        test: TestRun,
        control_errors: Vec<f64>,
        portable_errors: Option<Vec<f64>>,
        golden: Option<&Golden>,
    ) -> Result<CheckReport> {
        let verdict = match self.rows.iter().all(|r| r.pass) {
            true => "all gates pass",
            false => "some gates FAIL",
        };
        self.phase(format!("done: {verdict}"));
        let tensors = self
            .model
            .params
            .iter()
            .enumerate()
            .map(|(i, spec)| TensorErrors {
                name: spec.name.clone(),
                test: test.errors[i],
                control: control_errors[i],
                portable: portable_errors.as_ref().map(|e| e[i]),
            })
            .collect();
        let cfg = self.cfg;
        Ok(CheckReport {
            config: cfg.clone(),
            replica_adapters: self.dp.adapters()?,
            golden: Golden::of_step(
                cfg.golden_settings(),
                &self.model,
                &self.single.adapter,
                test.single_out.loss,
                &test.single_grads,
                &test.pattern,
            ),
            single_adapter: self.single.adapter,
            portable_against: golden.map(|g| g.adapter.clone()),
            rows: self.rows,
            tensors,
        })
    }
}

/// TIE: TEST's single-device step at R·N (on the DP run's pattern) against the f64 reference
/// from the same `params` and `running` statistics on the same pattern; flips are those of a
/// free f64 run.
fn tie(
    model: &ResNet,
    params: &[f32],
    running: &[f32],
    batch: &Batch,
    test: &TestRun,
) -> Vec<GateRow> {
    let (out, grads, pattern) = (&test.single_out, &test.single_grads, &test.pattern);
    let p64: Vec<f64> = params.iter().map(|&v| v as f64).collect();
    let r64: Vec<f64> = running.iter().map(|&v| v as f64).collect();
    let cfg = StepConfig::default();
    let ref_cfg = reference::StepConfig {
        label_smoothing: cfg.label_smoothing as f64,
        divisor: batch.len() as f64,
        bn_momentum: cfg.bn_momentum as f64,
        bn_eps: BN_EPS as f64,
    };
    let want = reference::training_step(model, &p64, &r64, batch, &ref_cfg, Some(pattern));
    let free = reference::training_step(model, &p64, &r64, batch, &ref_cfg, None);
    let flips = pattern.flips(&free.pattern);
    let loss_err = (out.loss as f64 - want.loss).abs() / want.loss.abs();
    let want_grads: Vec<f32> = want.grads.iter().map(|&g| g as f32).collect();
    let (grad_err, worst) = worst_tensor(model, grads, &want_grads);
    let (values, map) = model.fewest_batchnorm_values(batch.len() as u64, batch.h, batch.w);
    let ([loss_bound, grad_bound], note) = tie_bounds(model.arch, values, map);
    vec![
        row(Gate::TieLoss, loss_err, loss_bound, None, Some(flips), note.clone()),
        row(Gate::Tie, grad_err, grad_bound, worst, Some(flips), note),
    ]
}

/// TIE's bounds on the loss and the gradients for `arch`, and what to note, at a shape whose
/// BatchNorm sites see `values` values per channel at the fewest (at `map`×`map` maps).
fn tie_bounds(arch: Arch, values: u64, map: u32) -> ([Bound; 2], String) {
    let shape = format!("BatchNorm over {values} values per channel at {map}×{map}");
    let next = TIE_NO_MEASURE_VALUES + 1;
    if values <= TIE_NO_MEASURE_VALUES {
        let note = format!("n/a: ill-conditioned: {shape}, where f32 and f64 part by rounding alone; a global batch of {next} or more is measured");
        return ([Bound::NotApplicable, Bound::NotApplicable], note);
    }
    let mut notes = Vec::new();
    let mut factor = 1.0;
    if values <= TIE_ILL_CONDITIONED_VALUES {
        factor = TIE_ILL_CONDITIONED_FACTOR;
        notes.push(format!("ill-conditioned: {shape}; bound ×{TIE_ILL_CONDITIONED_FACTOR}"));
    }
    let mut grad_bound = TIE_GRAD_BOUND * factor;
    if arch == Arch::ResNet101 {
        grad_bound *= TIE_DEEP_FACTOR;
        let title = arch.title();
        notes.push(format!(
            "{title}: gradient bound ×{TIE_DEEP_FACTOR}, f32's rounding at its depth"
        ));
    }
    ([Bound::AtMost(TIE_LOSS_BOUND * factor), Bound::AtMost(grad_bound)], notes.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tie_bounds_loosen_at_ill_conditioned_shapes_and_for_resnet101_alone() {
        let grad = |arch, values| tie_bounds(arch, values, 1).0[1];
        for arch in [Arch::ResNet18, Arch::ResNet34, Arch::ResNet50] {
            assert_eq!(
                tie_bounds(arch, 8, 1),
                ([Bound::AtMost(1e-5), Bound::AtMost(1e-4)], "".into())
            );
            assert_eq!(grad(arch, 5), Bound::AtMost(1e-4 * TIE_ILL_CONDITIONED_FACTOR));
        }
        let (bounds, note) = tie_bounds(Arch::ResNet101, 16, 1);
        assert_eq!(bounds, [Bound::AtMost(1e-5), Bound::AtMost(1e-4 * TIE_DEEP_FACTOR)]);
        assert!(note.starts_with("ResNet-101: gradient bound ×5"), "{note}");
        let both = 1e-4 * TIE_ILL_CONDITIONED_FACTOR * TIE_DEEP_FACTOR;
        assert_eq!(grad(Arch::ResNet101, 4), Bound::AtMost(both));
        assert_eq!(grad(Arch::ResNet101, 3), Bound::NotApplicable);
    }

    #[test]
    fn shards_of_the_gate_batch_are_shifted_by_half_their_index() {
        let cfg = CheckConfig { replicas: 3, batch: 2, ..Default::default() };
        let b = gate_batch(&cfg, 1).unwrap();
        let plain = synthetic_batch(cfg.seed, 6, 6, 32, 32, 10).unwrap();
        let il = 3 * 32 * 32;
        assert_eq!(b.labels, plain.labels);
        assert_eq!(b.images[..2 * il], plain.images[..2 * il]);
        assert_eq!(b.images[4 * il + 7], plain.images[4 * il + 7] + 1.0);
    }

    #[test]
    fn the_report_renders_as_a_table_and_as_json() {
        let model = ResNet::new(Arch::ResNet34, 10).unwrap();
        let tensors = model
            .params
            .iter()
            .map(|p| TensorErrors {
                name: p.name.clone(),
                test: 0.0,
                control: 0.5,
                portable: Some(2e-7),
            })
            .collect();
        let zeros = vec![0.0; model.param_len];
        let report = CheckReport {
            config: CheckConfig::default(),
            replica_adapters: vec!["a \"quoted\" adapter".into(), "b".into()],
            single_adapter: "a".into(),
            portable_against: Some("lavapipe".into()),
            tensors,
            golden: Golden::of_step(
                CheckConfig::default().golden_settings(),
                &model,
                "a",
                2.5,
                &zeros,
                &ActivationPattern::default(),
            ),
            rows: vec![
                row(
                    Gate::Test,
                    0.0,
                    Bound::AtMost(1e-5),
                    Some("fc.bias".into()),
                    Some(0),
                    "bitwise 0".into(),
                ),
                row(Gate::Control, 1e-13, Bound::AtLeast(1e-10), None, None, String::new()),
                row(Gate::Drift, f64::INFINITY, Bound::AtMost(1e-5), None, None, String::new()),
            ],
        };
        assert!(!report.passed());
        let table = report.table();
        assert!(
            table.contains("TEST")
                && table.contains("PASS")
                && table.contains("FAIL")
                && table.contains("replica 1: b")
                && table.contains("made on: lavapipe"),
            "{table}"
        );
        let json = report.to_json();
        assert!(json.contains(r#""a \"quoted\" adapter""#), "{json}");
        let parsed: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(parsed["pass"], false);
        let gates = parsed["gates"].as_array().unwrap();
        assert_eq!(
            (gates[0]["measured"].as_f64(), gates[2]["measured"].is_null()),
            (Some(0.0), true)
        );
        assert_eq!(gates[0]["worst_tensor"], "fc.bias");
        let tensors = parsed["tensors"].as_array().unwrap();
        assert_eq!(tensors.len(), 110);
        assert_eq!(tensors[0]["name"], "conv1.weight");
        assert_eq!(tensors[109]["portable"].as_f64(), Some(2e-7));
    }
}
