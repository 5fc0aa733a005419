//! `syncstep train`: ResNet-34 on the embedded synthetic dataset or on images (`--data`), with
//! checkpoints that keep a run: written every `--checkpoint-every` steps and on SIGINT/SIGTERM
//! (after the step in flight), never with a non-finite value, and a resume that changes a
//! setting says so.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use syncstep::checkpoint;
use syncstep::data::loader::{Loader, Plan};
use syncstep::data::schedule::LrSchedule;
use syncstep::data::source::DataSpec;
use syncstep::data::transform::Augment;
use syncstep::data::Batch;
use syncstep::gpu::{describe, AdapterChoice};
use syncstep::metrics::{MetricsLog, Record};
use syncstep::model::ResNet34;
use syncstep::parallel::{adapter_label, ParallelError};
use syncstep::scores::Scores;
use syncstep::step::StepError;
use syncstep::train::{TrainConfig, Trainer};

use super::Exit;

mod settings;
mod signals;

use signals::StopSignals;

/// Held-out images `--eval-examples` takes at most: each is a forward pass.
const MAX_EVAL_EXAMPLES: usize = 100_000;
/// A run diverges when its loss is not finite or passes this many times its first step's.
const DIVERGED: f32 = 100.0;

/// Where the normalisation's per-channel mean and std come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Normalize {
    /// The training split's own, measured once over up to 1000 images.
    Dataset,
    /// ImageNet's (mean 0.485, 0.456, 0.406; std 0.229, 0.224, 0.225), for --init weights.
    Imagenet,
}

#[derive(Args)]
pub struct TrainArgs {
    /// What to train on: `synthetic` (the embedded dataset), a folder of class folders
    /// (`DIR/<class>/*.png|jpg|jpeg|bmp|webp`, with DIR/train and DIR/val when both exist),
    /// `cifar10:DIR` or `cifar100:DIR` (the binary files) [default: synthetic].
    #[arg(long)]
    data: Option<DataSpec>,
    /// SGD steps to run (on top of the checkpoint's, with --resume).
    #[arg(long, default_value_t = 60, conflicts_with = "epochs")]
    steps: u64,
    /// Train until this many epochs of the training split are done (images only; the last
    /// partial batch of each epoch is dropped).
    #[arg(long)]
    epochs: Option<u64>,
    /// Fraction of each class held out for validation when the folder has no train/ and val/
    /// [default: 0.1].
    #[arg(long)]
    val_split: Option<f64>,
    /// Training augmentation: none, crop-flip (pad and crop, flip: the CIFAR recipe) or
    /// resized-crop-flip (the ImageNet recipe) [default: crop-flip for CIFAR, else
    /// resized-crop-flip]. Seeded by (seed, epoch, image): the same on any replica count.
    #[arg(long)]
    augment: Option<Augment>,
    /// Per-channel normalisation of images [default: dataset].
    #[arg(long, value_enum)]
    normalize: Option<Normalize>,
    /// Threads decoding and augmenting the next batches while the GPU trains [default: the
    /// CPU's cores].
    #[arg(long)]
    workers: Option<usize>,
    /// Images per step, the global batch over all replicas [default: 16].
    #[arg(long)]
    batch: Option<usize>,
    /// Side of the square input images, at least 32 [default: 32].
    #[arg(long)]
    image_size: Option<u32>,
    /// Number of classes of the synthetic dataset and the classifier [default: 10; with
    /// --data, the dataset's].
    #[arg(long)]
    classes: Option<u32>,
    /// Seed of the initialisation, the dataset's split, shuffles and augmentation [default: 0].
    #[arg(long)]
    seed: Option<u64>,
    /// Learning rate (the schedule's base rate) [default: 0.01].
    #[arg(long, allow_negative_numbers = true)]
    lr: Option<f32>,
    /// Learning-rate schedule: constant, step (a tenth from half the run, a hundredth from
    /// three quarters) or cosine (down to 0 at the end) [default: constant].
    #[arg(long)]
    lr_schedule: Option<LrSchedule>,
    /// Steps of linear warm-up to the base rate [default: 0].
    #[arg(long)]
    warmup_steps: Option<u64>,
    /// SGD momentum [default: 0.9].
    #[arg(long, allow_negative_numbers = true)]
    momentum: Option<f32>,
    /// Weight decay [default: 0.0005].
    #[arg(long, allow_negative_numbers = true)]
    weight_decay: Option<f32>,
    /// Label smoothing ε in [0, 1) [default: 0.1].
    #[arg(long, allow_negative_numbers = true)]
    label_smoothing: Option<f32>,
    /// Held-out images to measure accuracy on (0: none; at most 100000). Synthetic data:
    /// before and after training [default: 64]; images: after every epoch and at the end,
    /// spread over the validation split [default: all of it].
    #[arg(long)]
    eval_examples: Option<usize>,
    /// Start from these weights (torchvision names, safetensors, e.g. an export of
    /// torchvision.models.resnet34): fine-tuning. A classifier of another class count is
    /// initialised afresh.
    #[arg(long, conflicts_with = "resume")]
    init: Option<PathBuf>,
    /// Append every step's loss, learning rate, images/s and data wait, and every evaluation,
    /// to this JSON-lines file (`syncstep plot` draws it).
    #[arg(long)]
    log: Option<PathBuf>,
    /// Adapter: an index from `syncstep info`, a backend (vulkan, gl, …) or both (`vulkan:1`).
    /// Defaults to $SYNCSTEP_ADAPTER, else the first adapter.
    #[arg(long, conflicts_with = "adapters")]
    adapter: Option<String>,
    /// Data-parallel over this many devices (any R up to the batch), each taking a contiguous
    /// shard of every step's batch (the first batch mod R one image more), with synchronised
    /// BatchNorm: the same training as on one device, bit for bit.
    #[arg(long, default_value_t = 1, conflicts_with = "mpi")]
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
    /// Continue bit-exactly from this checkpoint (its data, position in the epoch and
    /// hyper-parameters; it may be the --checkpoint file itself).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// With --resume: let the flags given change the checkpoint's hyper-parameters (lr, its
    /// schedule, momentum, weight decay, label smoothing, augmentation), said so when the run
    /// starts. The data settings (data, batch, image size, classes, seed) never change.
    #[arg(long = "override", requires = "resume")]
    override_settings: bool,
    #[command(flatten)]
    ranks: super::ranks::MpiArgs,
}

/// Where a run's batches come from.
enum Batches {
    /// The synthetic dataset's batch of each step, made on this thread.
    Synthetic,
    /// Images from the loader's threads.
    Images(Loader),
}

impl Batches {
    /// The next step's batch and how long it took to have it.
    fn next(&mut self, trainer: &Trainer) -> Result<(Batch, Duration), Box<dyn std::error::Error>> {
        let start = Instant::now();
        match self {
            Batches::Synthetic => Ok((trainer.batch_of_step(trainer.step)?, start.elapsed())),
            Batches::Images(loader) => match loader.next_batch() {
                Some((batch, waited)) => Ok((batch?, waited)),
                None => Err("the loader ran out of batches".into()),
            },
        }
    }
}

pub fn run(args: TrainArgs) -> Result<(), Box<dyn std::error::Error>> {
    let eval_limit = args.eval_examples.unwrap_or(usize::MAX);
    if args.eval_examples.is_some_and(|e| e > MAX_EVAL_EXAMPLES) {
        return Err(format!(
            "--eval-examples is {eval_limit}; at most {MAX_EVAL_EXAMPLES} (each is a forward pass)"
        )
        .into());
    }
    let peers = super::ranks::peers(&args.ranks)?;
    // Under MPI every rank trains; rank 0 alone prints, logs, evaluates and writes checkpoints.
    let lead = peers.rank() == 0;
    macro_rules! say {
        ($($t:tt)*) => { if lead { println!($($t)*) } };
    }
    let settings::Run { cfg, splits, epochs, start, last, notes } = settings::resolve(&args)?;
    let model = ResNet34::new(cfg.classes)?;
    check_host_memory(&model, &cfg)?;
    let checkpoint = args.checkpoint.as_ref().filter(|_| lead);
    if let Some(path) = checkpoint {
        syncstep::files::check_output("--checkpoint", path, &[])?;
    }
    let from = start.as_ref().filter(|ck| ck.step > 0).map_or(0, |ck| ck.step);
    let mut log = match args.log.as_ref().filter(|_| lead) {
        Some(path) => Some(MetricsLog::open(path, args.resume.as_ref().map(|_| from))?),
        None => None,
    };
    let local = if args.ranks.mpi { args.ranks.local_replicas as usize } else { args.replicas };
    super::ranks::agree(&peers, "the settings", format!("{cfg:?} {local}").as_bytes())?;
    if let Some(ck) = &start {
        super::ranks::agree(&peers, "the checkpoint", bytemuck::cast_slice(&ck.params))?;
    }
    let gpus = super::ranks::devices(&peers, args.adapter.as_deref(), &args.adapters, local)?;
    let r = gpus.len() * peers.ranks();
    let ranks = match peers.ranks() {
        1 => String::new(),
        p => format!(" (rank 0 of {p}, {local} per rank)"),
    };
    let adapter = if r == 1 {
        describe(&gpus[0].info)
    } else {
        let mut sizes: Vec<String> = syncstep::data::shard_ranges(cfg.batch, r)?
            .iter()
            .map(|s| s.len().to_string())
            .collect();
        sizes.dedup();
        format!(
            "{r} replicas of {} images{ranks}: {}",
            sizes.join(" or "),
            gpus.iter().map(|g| adapter_label(&g.info)).collect::<Vec<_>>().join("; ")
        )
    };
    let mut trainer = Trainer::data_parallel(gpus, cfg.clone(), start)?.with_peers(peers);
    let flops = syncstep::bench::STEP_FLOPS_PER_FORWARD
        * trainer.model().forward_flops(cfg.image_size, cfg.image_size)
        * cfg.batch as f64;
    let what = match (&cfg.images, &splits) {
        (Some(images), Some(s)) => format!(
            "{} ({} training and {} validation images)",
            images.data,
            s.train.len(),
            s.val.len()
        ),
        _ => "synthetic images".into(),
    };
    say!(
        "syncstep train: ResNet-34 ({} classes), batch {} of {}×{} {what}, steps {} to {last}, on {adapter}",
        cfg.classes, cfg.batch, cfg.image_size, cfg.image_size, trainer.step + 1
    );
    if let Some(e) = epochs {
        let dropped = match e.dropped() {
            0 => String::new(),
            d => format!("; {d} images of each epoch's shuffle are left out (a partial batch)"),
        };
        say!("{} steps per epoch{dropped}", e.steps_per_epoch());
    }
    notes.iter().for_each(|n| say!("{n}"));
    let workers =
        args.workers.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
    let (mut batches, val) = match (&cfg.images, splits, epochs) {
        (Some(images), Some(splits), Some(epochs)) => {
            // Only this process's replicas' examples of each batch are read (under MPI, its
            // ranks' shards).
            let part = trainer.part()?;
            let plan =
                Plan::Train { epochs, augment: images.augment, part: (part.start, part.end) };
            let train = Arc::new(splits.train);
            let loader =
                Loader::start(train, plan, cfg.image_size, images.norm, trainer.step, workers);
            let val = eval_subset(&splits.val, eval_limit);
            (Batches::Images(loader), Some(Arc::new(val)))
        }
        _ => (Batches::Synthetic, None),
    };
    let synthetic_eval = if val.is_some() || !lead { 0 } else { args.eval_examples.unwrap_or(64) };
    let before = evaluate(&mut trainer, synthetic_eval, "before")?;
    let stop = StopSignals::register()?;

    let bar = if lead { ProgressBar::new(last - trainer.step) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut losses = Vec::new();
    let (mut waited, mut busy) = (Duration::ZERO, Duration::ZERO);
    let mut last_scores = None;
    while trainer.step < last {
        let t = Instant::now();
        let (batch, wait) = batches.next(&trainer)?;
        let lr = trainer.lr();
        let loss = match pollster::block_on(trainer.train_on(&batch)) {
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
        let elapsed = t.elapsed();
        let secs = elapsed.as_secs_f64();
        (waited, busy) = (waited + wait, busy + elapsed);
        if losses.first().is_some_and(|&first: &f32| loss > DIVERGED * first) {
            bar.finish_and_clear();
            let why = format!(
                "its loss rose to {loss:e}, over {DIVERGED} times the first step's ({:.4})",
                losses[0]
            );
            return Err(diverged(&args, trainer.step, &why));
        }
        losses.push(loss);
        let epoch = epochs.map_or(0, |e| e.epoch_of(trainer.step - 1));
        let wait_share = wait.as_secs_f64() / secs;
        let throughput = throughput(cfg.batch, r, secs);
        let line = format!(
            "step {} epoch {epoch} lr {lr:.3e} loss {loss:.4} {throughput} data wait {:.0}%",
            trainer.step,
            100.0 * wait_share
        );
        bar.set_message(format!("{line} {:.2} GFLOP/s", flops / secs / 1e9));
        bar.inc(1);
        if bar.is_hidden() {
            // Not a terminal (CI, a pipe): one line per step instead of a redrawn bar.
            say!("{line}");
        }
        if let Some(log) = &mut log {
            log.write(&Record {
                step: trainer.step,
                epoch,
                loss: Some(loss),
                lr: Some(lr),
                images_per_s: Some(cfg.batch as f64 / secs),
                data_wait: Some(wait_share),
                ..Record::default()
            })?;
        }
        let epoch_done = epochs.is_some_and(|e| trainer.step % e.steps_per_epoch() == 0);
        if let Some(val) = val.as_ref().filter(|v| lead && epoch_done && !v.is_empty()) {
            let scores = score_images(&mut trainer, val, &cfg, workers, &bar)?;
            report_scores(&bar, &scores, epoch, trainer.step, log.as_mut())?;
            last_scores = Some(scores);
        }
        // Under MPI every rank stops after the same step, if any rank was told to.
        let signal = trainer.replicas.peers().max(stop.received() as u64)? as usize;
        let periodic = args.checkpoint_every > 0 && trainer.step % args.checkpoint_every == 0;
        if signal != 0 || (periodic && trainer.step < last) {
            if let Some(path) = checkpoint {
                let ck = pollster::block_on(trainer.checkpoint())?;
                checkpoint::save(path, trainer.model(), &ck)?;
                if bar.is_hidden() {
                    say!("checkpoint: {} (step {})", path.display(), ck.step);
                }
            }
        }
        if signal != 0 {
            bar.finish_and_clear();
            return Err(stopped(signal, &args, trainer.step));
        }
    }
    bar.finish_and_clear();
    drop(batches);
    let total = busy.as_secs_f64();
    if let Some(path) = checkpoint {
        let ck = pollster::block_on(trainer.checkpoint())?;
        checkpoint::save(path, trainer.model(), &ck)?;
        say!("checkpoint: {} (step {})", path.display(), ck.step);
    }
    if stop.received() != 0 {
        return Err(stopped(stop.received(), &args, trainer.step));
    }
    drop(stop);
    if !losses.is_empty() {
        // Single steps are noisy: compare the means of the first and last few.
        let k = losses.len().div_ceil(5).min(5);
        let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
        say!(
            "loss (mean of {k} steps): {:.4} at the start → {:.4} at the end ({} steps in {total:.1} s, {:.1} img/s, {:.1}% of it waiting for data)",
            mean(&losses[..k]),
            mean(&losses[losses.len() - k..]),
            losses.len(),
            (losses.len() as f64 * cfg.batch as f64) / total,
            100.0 * waited.as_secs_f64() / total.max(f64::MIN_POSITIVE)
        );
    }
    if !lead {
        return Ok(());
    }
    let peers = trainer.replicas.peers();
    if peers.ranks() > 1 && !losses.is_empty() {
        println!(
            "MPI: {} ranks; rank 0 received {:.1} MB a step from the others",
            peers.ranks(),
            peers.received_bytes() as f64 / losses.len() as f64 / 1e6
        );
    }
    if let Some(val) = val.as_ref().filter(|v| !v.is_empty()) {
        let epoch_end = epochs.is_some_and(|e| trainer.step % e.steps_per_epoch() == 0);
        let scores = match last_scores.filter(|_| epoch_end) {
            Some(scores) => scores,
            None => {
                let scores = score_images(&mut trainer, val, &cfg, workers, &bar)?;
                let epoch = epochs.map_or(0, |e| e.epoch_of(trainer.step.saturating_sub(1)));
                report_scores(&bar, &scores, epoch, trainer.step, log.as_mut())?;
                scores
            }
        };
        println!(
            "validation ({} images, {} classes; chance {:.1}%): top-1 {:.1}%, top-5 {:.1}%",
            scores.examples,
            cfg.classes,
            100.0 / cfg.classes as f64,
            100.0 * scores.top1(),
            100.0 * scores.top5()
        );
        return Ok(());
    }
    if val.is_some() {
        println!("validation: not measured (no validation images)");
        return Ok(());
    }
    let after = evaluate(&mut trainer, synthetic_eval, "after")?;
    match (before, after) {
        (Some(before), Some(after)) => println!(
            "held-out accuracy ({synthetic_eval} images, {} classes; chance {:.0}%): {:.1}% before → {:.1}% after",
            cfg.classes,
            100.0 / cfg.classes as f64,
            100.0 * before.top1(),
            100.0 * after.top1()
        ),
        _ => println!("held-out accuracy: not measured (--eval-examples 0)"),
    }
    Ok(())
}

/// At most `limit` examples of `val`, spread evenly over it (its classes are in order).
fn eval_subset(
    val: &syncstep::data::source::Dataset,
    limit: usize,
) -> syncstep::data::source::Dataset {
    let n = val.len();
    if limit >= n {
        return val.subset(&(0..n).collect::<Vec<_>>());
    }
    let picked: Vec<usize> =
        (0..limit).map(|i| (i as u128 * n as u128 / limit as u128) as usize).collect();
    val.subset(&picked)
}

/// The validation split's scores, with progress on the bar's terminal.
fn score_images(
    trainer: &mut Trainer,
    val: &Arc<syncstep::data::source::Dataset>,
    cfg: &TrainConfig,
    workers: usize,
    bar: &ProgressBar,
) -> Result<Scores, Box<dyn std::error::Error>> {
    let norm = cfg.images.as_ref().map(|i| i.norm).ok_or("no images to score")?;
    bar.set_message(format!("validating on {} images", val.len()));
    super::eval::score(trainer, val.clone(), cfg.image_size, norm, workers, &mut |_| {})
}

/// Prints and logs an evaluation after `step`.
fn report_scores(
    bar: &ProgressBar,
    scores: &Scores,
    epoch: u64,
    step: u64,
    log: Option<&mut MetricsLog>,
) -> Result<(), Box<dyn std::error::Error>> {
    let line = format!(
        "epoch {epoch} (step {step}): validation top-1 {:.1}%, top-5 {:.1}% ({} images)",
        100.0 * scores.top1(),
        100.0 * scores.top5(),
        scores.examples
    );
    match bar.is_hidden() {
        true => println!("{line}"),
        false => bar.println(line),
    }
    if let Some(log) = log {
        log.write(&Record {
            step,
            epoch,
            val_top1: Some(scores.top1()),
            val_top5: Some(scores.top5()),
            ..Record::default()
        })?;
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
) -> Result<Option<Scores>, Box<dyn std::error::Error>> {
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
            indicatif::HumanBytes(need),
            indicatif::HumanBytes(available)
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

/// The adapters named by `--adapters` (replica r on the (r mod count)-th), else `--adapter`,
/// else $SYNCSTEP_ADAPTER or the first adapter (see `ranks::adapter_choices`, which places each
/// replica of each rank on one of them).
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
