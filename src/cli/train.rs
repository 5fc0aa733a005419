//! `syncstep train`: ResNet-34 on the embedded synthetic dataset, with checkpoints that keep a
//! run: written every `--checkpoint-every` steps and on SIGINT/SIGTERM (after the step in
//! flight), never with a non-finite value, and a resume that changes a setting says so.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use syncstep::checkpoint;
use syncstep::gpu::{describe, AdapterChoice, Gpu};
use syncstep::model::ResNet34;
use syncstep::parallel::{adapter_label, ParallelError};
use syncstep::step::{human_bytes, StepConfig, StepError};
use syncstep::train::{TrainConfig, Trainer};

use super::Exit;

/// Held-out images `--eval-examples` takes at most: each is a forward pass.
const MAX_EVAL_EXAMPLES: usize = 100_000;
/// A run diverges when its loss is not finite or passes this many times its first step's.
const DIVERGED: f32 = 100.0;

#[derive(Args)]
pub struct TrainArgs {
    /// SGD steps to run (on top of the checkpoint's, with --resume).
    #[arg(long, default_value_t = 60)]
    steps: u64,
    /// Images per step, the global batch over all replicas [default: 16].
    #[arg(long)]
    batch: Option<usize>,
    /// Side of the square input images, at least 32 [default: 32].
    #[arg(long)]
    image_size: Option<u32>,
    /// Number of classes of the synthetic dataset and the classifier [default: 10].
    #[arg(long)]
    classes: Option<u32>,
    /// Seed of the initialisation and of the dataset [default: 0].
    #[arg(long)]
    seed: Option<u64>,
    /// Learning rate [default: 0.01].
    #[arg(long, allow_negative_numbers = true)]
    lr: Option<f32>,
    /// SGD momentum [default: 0.9].
    #[arg(long, allow_negative_numbers = true)]
    momentum: Option<f32>,
    /// Weight decay [default: 0.0005].
    #[arg(long, allow_negative_numbers = true)]
    weight_decay: Option<f32>,
    /// Label smoothing ε in [0, 1) [default: 0.1].
    #[arg(long, allow_negative_numbers = true)]
    label_smoothing: Option<f32>,
    /// Held-out images to measure accuracy on, before and after training (0: none; at most
    /// 100000).
    #[arg(long, default_value_t = 64)]
    eval_examples: usize,
    /// Adapter: an index from `syncstep info`, a backend (vulkan, gl, …) or both (`vulkan:1`).
    /// Defaults to $SYNCSTEP_ADAPTER, else the first adapter.
    #[arg(long, conflicts_with = "adapters")]
    adapter: Option<String>,
    /// Data-parallel over this many devices (any R up to the batch), each taking a contiguous
    /// shard of every step's batch (the first batch mod R one image more), with synchronised
    /// BatchNorm: the same training as on one device, bit for bit.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Adapters for the replicas, comma-separated (`0,1`, `vulkan,gl`): replica r on the
    /// (r mod count)-th. Default: --adapter's (or the default) for all.
    #[arg(long, value_delimiter = ',')]
    adapters: Vec<String>,
    /// Keep the run in this checkpoint: written every --checkpoint-every steps, on SIGINT or
    /// SIGTERM (after the step in flight) and at the end, atomically, and never with a
    /// non-finite value (the last good one stays). Checked for writability before training.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Steps between checkpoints (0: only at the end and on a signal).
    #[arg(long, default_value_t = 10)]
    checkpoint_every: u64,
    /// Continue bit-exactly from this checkpoint (its data and hyper-parameters; it may be the
    /// --checkpoint file itself).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// With --resume: let the flags given change the checkpoint's hyper-parameters (lr,
    /// momentum, weight decay, label smoothing), said so when the run starts. The data settings
    /// (batch, image size, classes, seed) never change on a resume.
    #[arg(long = "override", requires = "resume")]
    override_settings: bool,
}

/// `cli` from the command line, else `saved` from the checkpoint, else `default`. A command-line
/// value that contradicts the checkpoint is an error (the run would not be a continuation),
/// unless `may_override`: then it wins, and `notes` says so.
fn setting<T: std::str::FromStr + PartialEq + std::fmt::Display + Copy>(
    name: &str,
    cli: Option<T>,
    saved: Option<&String>,
    default: T,
    may_override: bool,
    notes: &mut Vec<String>,
) -> Result<T, String> {
    let flag = name.replace('_', "-");
    let saved = saved
        .map(|s| {
            s.parse::<T>().map_err(|_| format!("checkpoint setting `{name}` = {s:?} is not valid"))
        })
        .transpose()?;
    match (cli, saved) {
        (Some(c), Some(s)) if c != s && may_override => {
            notes.push(format!("--{flag} {c} overrides the checkpoint's {s}"));
            Ok(c)
        }
        (Some(c), Some(s)) if c != s => Err(format!(
            "the checkpoint was trained with --{flag} {s}; drop --{flag}, pass {s}, or add --override to change it"
        )),
        (c, s) => Ok(c.or(s).unwrap_or(default)),
    }
}

/// SIGINT and SIGTERM while training: the first asks the run to stop after the step in flight,
/// a second ends the process at once. Dropped, the default actions return (an evaluation or
/// a save in progress is simply killed: nothing is lost that was not saved).
struct StopSignals {
    /// Which signal asked the run to stop, or 0 while none has.
    stop: Arc<AtomicUsize>,
    handlers: Vec<signal_hook::SigId>,
}

impl StopSignals {
    fn register() -> Result<StopSignals, std::io::Error> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let stop = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(AtomicBool::new(false));
        let mut handlers = Vec::new();
        for signal in [SIGINT, SIGTERM] {
            // Handlers run in the order registered: a second signal, while the step in flight
            // finishes, finds `seen` set and ends the process at once.
            handlers.push(signal_hook::flag::register_conditional_shutdown(
                signal,
                128 + signal,
                seen.clone(),
            )?);
            handlers.push(signal_hook::flag::register(signal, seen.clone())?);
            handlers.push(signal_hook::flag::register_usize(
                signal,
                stop.clone(),
                signal as usize,
            )?);
        }
        Ok(StopSignals { stop, handlers })
    }

    fn received(&self) -> usize {
        self.stop.load(Ordering::Relaxed)
    }
}

impl Drop for StopSignals {
    fn drop(&mut self) {
        for id in self.handlers.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

pub fn run(args: TrainArgs) -> Result<(), Box<dyn std::error::Error>> {
    let defaults = TrainConfig::default();
    // The model's class count is needed to read the checkpoint; take it from the flag or the
    // file's own settings.
    let peek = match &args.resume {
        Some(p) => syncstep::tensorfile::TensorFile::read(p)?.metadata,
        None => Default::default(),
    };
    let (step_defaults, o) = (StepConfig::default(), args.override_settings);
    let mut notes = Vec::new();
    let cfg = TrainConfig {
        batch: setting("batch", args.batch, peek.get("batch"), defaults.batch, false, &mut notes)?,
        image_size: setting(
            "image_size",
            args.image_size,
            peek.get("image_size"),
            defaults.image_size,
            false,
            &mut notes,
        )?,
        classes: setting(
            "classes",
            args.classes,
            peek.get("classes"),
            defaults.classes,
            false,
            &mut notes,
        )?,
        seed: setting("seed", args.seed, peek.get("seed"), defaults.seed, false, &mut notes)?,
        step: StepConfig {
            label_smoothing: setting(
                "label_smoothing",
                args.label_smoothing,
                peek.get("label_smoothing"),
                step_defaults.label_smoothing,
                o,
                &mut notes,
            )?,
            lr: setting("lr", args.lr, peek.get("lr"), step_defaults.lr, o, &mut notes)?,
            momentum: setting(
                "momentum",
                args.momentum,
                peek.get("momentum"),
                step_defaults.momentum,
                o,
                &mut notes,
            )?,
            weight_decay: setting(
                "weight_decay",
                args.weight_decay,
                peek.get("weight_decay"),
                step_defaults.weight_decay,
                o,
                &mut notes,
            )?,
            bn_momentum: setting(
                "bn_momentum",
                None,
                peek.get("bn_momentum"),
                step_defaults.bn_momentum,
                false,
                &mut notes,
            )?,
        },
    };
    cfg.step.validate()?;
    if args.eval_examples > MAX_EVAL_EXAMPLES {
        return Err(format!(
            "--eval-examples is {}; at most {MAX_EVAL_EXAMPLES} (each is a forward pass)",
            args.eval_examples
        )
        .into());
    }
    let model = ResNet34::new(cfg.classes)?;
    ResNet34::check_image_size(cfg.image_size, cfg.image_size)?;
    check_host_memory(&model, &cfg)?;
    let resume = match &args.resume {
        Some(p) => Some(checkpoint::load(p, &model)?),
        None => None,
    };
    let from = resume.as_ref().map_or(0, |ck| ck.step);
    let last = from.checked_add(args.steps).filter(|&s| s < 1 << 53).ok_or_else(|| {
        format!(
            "--steps {} from step {from} passes the largest step count a checkpoint keeps",
            args.steps
        )
    })?;
    if let Some(path) = &args.checkpoint {
        syncstep::files::check_output("--checkpoint", path, &[])?;
    }
    let gpus = devices(args.adapter.as_deref(), &args.adapters, args.replicas)?;
    let r = gpus.len();
    let adapter = if r == 1 {
        describe(&gpus[0].info)
    } else {
        let mut sizes: Vec<String> = syncstep::data::shard_ranges(cfg.batch, r)?
            .iter()
            .map(|s| s.len().to_string())
            .collect();
        sizes.dedup();
        format!(
            "{r} replicas of {} images: {}",
            sizes.join(" or "),
            gpus.iter().map(|g| adapter_label(&g.info)).collect::<Vec<_>>().join("; ")
        )
    };
    let mut trainer = Trainer::data_parallel(gpus, cfg, resume)?;
    let flops = syncstep::bench::STEP_FLOPS_PER_FORWARD
        * trainer.model().forward_flops(cfg.image_size, cfg.image_size)
        * cfg.batch as f64;
    println!(
        "syncstep train: ResNet-34 ({} classes), batch {} of {}×{} synthetic images, {} steps from step {}, on {adapter}",
        cfg.classes, cfg.batch, cfg.image_size, cfg.image_size, args.steps, trainer.step
    );
    notes.iter().for_each(|n| println!("{n}"));
    let before = evaluate(&mut trainer, args.eval_examples, "before")?;
    let stop = StopSignals::register()?;

    let bar = ProgressBar::new(args.steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut losses = Vec::new();
    let start = Instant::now();
    while trainer.step < last {
        let t = Instant::now();
        let loss = match pollster::block_on(trainer.train_step()) {
            Ok(loss) => loss,
            Err(ParallelError::Step(StepError::NonFiniteLoss { loss, .. })) => {
                bar.finish_and_clear();
                let why = format!("its loss became {loss}");
                return Err(diverged(&args, trainer.step + 1, &why));
            }
            Err(e) => {
                bar.finish_and_clear();
                return Err(e.into());
            }
        };
        let secs = t.elapsed().as_secs_f64();
        if losses.first().is_some_and(|&first: &f32| loss > DIVERGED * first) {
            bar.finish_and_clear();
            let why = format!(
                "its loss rose to {loss:e}, over {DIVERGED} times the first step's ({:.4})",
                losses[0]
            );
            return Err(diverged(&args, trainer.step, &why));
        }
        losses.push(loss);
        let throughput = throughput(cfg.batch, r, secs);
        bar.set_message(format!(
            "step {} loss {loss:.4} {throughput} {:.2} GFLOP/s",
            trainer.step,
            flops / secs / 1e9
        ));
        bar.inc(1);
        if bar.is_hidden() {
            // Not a terminal (CI, a pipe): one line per step instead of a redrawn bar.
            println!("step {} loss {loss:.4} {throughput}", trainer.step);
        }
        let signal = stop.received();
        let periodic = args.checkpoint_every > 0 && trainer.step % args.checkpoint_every == 0;
        if signal != 0 || (periodic && trainer.step < last) {
            if let Some(path) = &args.checkpoint {
                let ck = pollster::block_on(trainer.checkpoint())?;
                checkpoint::save(path, trainer.model(), &ck)?;
                if bar.is_hidden() {
                    println!("checkpoint: {} (step {})", path.display(), ck.step);
                }
            }
        }
        if signal != 0 {
            bar.finish_and_clear();
            return Err(stopped(signal, &args, trainer.step));
        }
    }
    bar.finish_and_clear();
    let total = start.elapsed().as_secs_f64();
    if let Some(path) = &args.checkpoint {
        let ck = pollster::block_on(trainer.checkpoint())?;
        checkpoint::save(path, trainer.model(), &ck)?;
        println!("checkpoint: {} (step {})", path.display(), ck.step);
    }
    if stop.received() != 0 {
        return Err(stopped(stop.received(), &args, trainer.step));
    }
    drop(stop);
    let after = evaluate(&mut trainer, args.eval_examples, "after")?;
    if !losses.is_empty() {
        // Single steps are noisy (batch 16): compare the means of the first and last few.
        let k = losses.len().div_ceil(5).min(5);
        let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
        println!(
            "loss (mean of {k} steps): {:.4} at the start → {:.4} at the end ({} steps in {total:.1} s, {:.1} img/s)",
            mean(&losses[..k]),
            mean(&losses[losses.len() - k..]),
            args.steps,
            (args.steps as f64 * cfg.batch as f64) / total
        );
    }
    match (before, after) {
        (Some(before), Some(after)) => println!(
            "held-out accuracy ({} images, {} classes; chance {:.0}%): {:.1}% before → {:.1}% after",
            args.eval_examples,
            cfg.classes,
            100.0 / cfg.classes as f64,
            100.0 * before.accuracy(),
            100.0 * after.accuracy()
        ),
        _ => println!("held-out accuracy: not measured (--eval-examples 0)"),
    }
    Ok(())
}

/// The exit of a run that `signal` stopped after `step`: 130 or 143, and where the run is kept.
fn stopped(signal: usize, args: &TrainArgs, step: u64) -> Box<dyn std::error::Error> {
    let (name, code) = if signal == signal_hook::consts::SIGINT as usize {
        ("SIGINT", 130)
    } else {
        ("SIGTERM", 143)
    };
    let kept = match &args.checkpoint {
        Some(path) => format!(
            "the checkpoint {} holds step {step}: continue with --resume {}",
            path.display(),
            path.display()
        ),
        None => "no --checkpoint was given, so nothing was saved".into(),
    };
    Box::new(Exit { code, message: format!("{name}: stopped after step {step}; {kept}") })
}

/// The error of a run that diverged at `step`: says why and which checkpoint is kept.
fn diverged(args: &TrainArgs, step: u64, why: &str) -> Box<dyn std::error::Error> {
    let kept = match &args.checkpoint {
        Some(path) if path.exists() => {
            format!("the last good checkpoint {} is kept", path.display())
        }
        _ => "no checkpoint was written".into(),
    };
    format!("the run diverged at step {step}: {why}; lower --lr; {kept}").into()
}

/// Held-out accuracy on `examples` images, with progress on a terminal; None for 0.
fn evaluate(
    trainer: &mut Trainer,
    examples: usize,
    when: &str,
) -> Result<Option<syncstep::train::Evaluation>, Box<dyn std::error::Error>> {
    if examples == 0 {
        return Ok(None);
    }
    let bar = ProgressBar::new(examples as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} held-out images {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(when.to_string());
    let result =
        pollster::block_on(trainer.evaluate(examples, &mut |done| bar.set_position(done as u64)));
    bar.finish_and_clear();
    Ok(Some(result?))
}

/// Refuses a run whose images and activations would not fit this host's available memory.
fn check_host_memory(
    model: &ResNet34,
    cfg: &TrainConfig,
) -> Result<(), Box<dyn std::error::Error>> {
    let Some(available) = super::available_memory() else { return Ok(()) };
    let (b, s) = (cfg.batch as u64, cfg.image_size);
    // The batch's images, and host copies of the largest activation (readback, staging).
    let images = b.checked_mul(3 * s as u64 * s as u64).and_then(|v| v.checked_mul(4));
    let largest = model.largest_activation(b, s, s).and_then(|v| v.checked_mul(8));
    let need = images.zip(largest).and_then(|(a, b)| a.checked_add(b)).unwrap_or(u64::MAX);
    if need > available {
        return Err(format!(
            "a batch of {b} images of {s}×{s} needs about {} of host memory, and {} is available: use a smaller --batch or --image-size",
            human_bytes(need),
            human_bytes(available)
        )
        .into());
    }
    Ok(())
}

/// Images per second of a step of `batch` images over `replicas` devices: in total and, when
/// data-parallel, per replica.
fn throughput(batch: usize, replicas: usize, secs: f64) -> String {
    let total = batch as f64 / secs;
    if replicas == 1 {
        format!("{total:.1} img/s")
    } else {
        format!("{total:.1} img/s ({:.1} img/s per replica × {replicas})", total / replicas as f64)
    }
}

/// The devices of a run: `replicas` of them, replica r on `adapters[r % len]` (or all on
/// `adapter`, else $SYNCSTEP_ADAPTER or the first adapter). Shared by `train` and `grad`.
pub fn devices(
    adapter: Option<&str>,
    adapters: &[String],
    replicas: usize,
) -> Result<Vec<Gpu>, Box<dyn std::error::Error>> {
    Ok(pollster::block_on(syncstep::parallel::devices(
        replicas,
        &adapter_choices(adapter, adapters)?,
    ))?)
}

/// The adapters named by `--adapters` (replica r on the (r mod count)-th), else `--adapter`,
/// else $SYNCSTEP_ADAPTER or the first adapter. Shared by `train`, `grad` and `bench`.
pub fn adapter_choices(
    adapter: Option<&str>,
    adapters: &[String],
) -> Result<Vec<AdapterChoice>, syncstep::gpu::GpuError> {
    match (adapter, adapters) {
        (_, [_, ..]) => adapters.iter().map(|a| AdapterChoice::parse(a)).collect(),
        (Some(a), []) => Ok(vec![AdapterChoice::parse(a)?]),
        (None, []) => Ok(vec![AdapterChoice::from_env()?]),
    }
}
