//! `syncstep train`: ResNet-34 on the embedded synthetic dataset, with checkpoints.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use syncstep::checkpoint;
use syncstep::gpu::{describe, AdapterChoice, Gpu};
use syncstep::model::ResNet34;
use syncstep::parallel::adapter_label;
use syncstep::step::StepConfig;
use syncstep::train::{TrainConfig, Trainer};

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
    #[arg(long, default_value_t = StepConfig::default().lr)]
    lr: f32,
    #[arg(long, default_value_t = StepConfig::default().momentum)]
    momentum: f32,
    #[arg(long, default_value_t = StepConfig::default().weight_decay)]
    weight_decay: f32,
    #[arg(long, default_value_t = StepConfig::default().label_smoothing)]
    label_smoothing: f32,
    /// Held-out images to measure accuracy on, before and after training.
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
    /// Write a checkpoint here when done (atomically: a failed write keeps the old file).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Continue bit-exactly from this checkpoint (its batch, image size, classes and seed).
    #[arg(long)]
    resume: Option<PathBuf>,
}

/// `value` from the command line, else from the checkpoint, else the default; a command-line
/// value that contradicts the checkpoint is an error (the run would not be a continuation).
fn setting<T: std::str::FromStr + PartialEq + std::fmt::Display>(
    name: &str,
    cli: Option<T>,
    saved: Option<&String>,
    default: T,
) -> Result<T, String> {
    let saved = saved
        .map(|s| {
            s.parse::<T>().map_err(|_| format!("checkpoint setting `{name}` = {s:?} is not valid"))
        })
        .transpose()?;
    match (cli, saved) {
        (Some(c), Some(s)) if c != s => Err(format!(
            "the checkpoint was trained with --{} {s}; drop --{} or pass {s}",
            name.replace('_', "-"),
            name.replace('_', "-")
        )),
        (c, s) => Ok(c.or(s).unwrap_or(default)),
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
    let cfg = TrainConfig {
        batch: setting("batch", args.batch, peek.get("batch"), defaults.batch)?,
        image_size: setting(
            "image_size",
            args.image_size,
            peek.get("image_size"),
            defaults.image_size,
        )?,
        classes: setting("classes", args.classes, peek.get("classes"), defaults.classes)?,
        seed: setting("seed", args.seed, peek.get("seed"), defaults.seed)?,
        step: StepConfig {
            label_smoothing: args.label_smoothing,
            lr: args.lr,
            momentum: args.momentum,
            weight_decay: args.weight_decay,
            ..StepConfig::default()
        },
    };
    let resume = match &args.resume {
        Some(p) => Some(checkpoint::load(p, &ResNet34::new(cfg.classes)?)?),
        None => None,
    };
    if let Some(path) = &args.checkpoint {
        // Fail now rather than after the training: the checkpoint's folder must exist.
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(std::path::Path::new("."));
        if !dir.is_dir() {
            return Err(format!(
                "cannot write checkpoint {}: {} is not a folder",
                path.display(),
                dir.display()
            )
            .into());
        }
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
    let before = pollster::block_on(trainer.evaluate(args.eval_examples))?;

    let bar = ProgressBar::new(args.steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut losses = Vec::new();
    let start = Instant::now();
    for _ in 0..args.steps {
        let t = Instant::now();
        let loss = pollster::block_on(trainer.train_step())?;
        let secs = t.elapsed().as_secs_f64();
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
    }
    bar.finish_and_clear();
    let total = start.elapsed().as_secs_f64();
    let after = pollster::block_on(trainer.evaluate(args.eval_examples))?;
    if let Some(path) = &args.checkpoint {
        let ck = pollster::block_on(trainer.checkpoint())?;
        checkpoint::save(path, trainer.model(), &ck)?;
        println!("checkpoint: {} (step {})", path.display(), ck.step);
    }
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
    println!(
        "held-out accuracy ({} images, {} classes; chance {:.0}%): {:.1}% before → {:.1}% after",
        args.eval_examples,
        cfg.classes,
        100.0 / cfg.classes as f64,
        100.0 * before.accuracy(),
        100.0 * after.accuracy()
    );
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
