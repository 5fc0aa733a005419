//! `syncstep train`: ResNet-34 on the embedded synthetic dataset or on images (`--data`), with
//! checkpoints that keep a run: written every `--checkpoint-every` steps and on SIGINT, SIGTERM
//! or SIGHUP (after the step in flight), never with a non-finite value, and a resume that
//! changes a setting says so. A closed standard output ends the printing, not the run.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use syncstep::checkpoint::{self, Checkpoint};
use syncstep::collective::Peers;
use syncstep::data::loader::{Loader, Plan};
use syncstep::data::schedule::{Epochs, LrSchedule};
use syncstep::data::source::{DataSpec, Dataset, Splits};
use syncstep::data::transform::Augment;
use syncstep::data::Batch;
use syncstep::files::{self, Claim};
use syncstep::gpu::describe;
use syncstep::kernels::Device;
use syncstep::metrics::{MetricsLog, Record};
use syncstep::model::{Arch, ResNet};
use syncstep::parallel::adapter_label;
use syncstep::scores::Scores;
use syncstep::train::{
    loss_course, smoothed_loss, Diverged, Keep, LossCourse, RunEnd, RunError, RunHooks, RunPlan,
    StepDone, TrainConfig, Trainer, TrainingRun, CHECKPOINT_EVERY, HELD_OUT_EXAMPLES, LOSS_WINDOW,
};

use super::Exit;

mod evaluation;
mod settings;
mod signals;

use evaluation::{eval_subset, evaluate, report_scores, score_images, scores_record};
use signals::StopSignals;

/// SGD steps a run takes unless told.
const STEPS: u64 = 60;

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
    /// The network: torchvision's resnet18, resnet34, resnet50 or resnet101 [default: resnet34,
    /// or the checkpoint's with --resume].
    #[arg(long)]
    arch: Option<Arch>,
    /// What to train on: `synthetic` (the embedded dataset), a folder of class folders
    /// (`DIR/<class>/*.png|jpg|jpeg|bmp|webp`, with DIR/train and DIR/val when both exist),
    /// `cifar10:DIR` or `cifar100:DIR` (the binary files) [default: synthetic].
    #[arg(long)]
    data: Option<DataSpec>,
    /// SGD steps to run (on top of the checkpoint's, with --resume).
    #[arg(long, default_value_t = STEPS, conflicts_with = "epochs", allow_negative_numbers = true, value_parser = crate::cli::positive::<u64>)]
    steps: u64,
    /// Train until this many epochs of the training split are done (images only; the last
    /// partial batch of each epoch is dropped).
    #[arg(long, allow_negative_numbers = true, value_parser = crate::cli::positive::<u64>)]
    epochs: Option<u64>,
    /// Fraction of each class held out for validation when the folder has no train/ and val/
    /// [default: 0.1].
    #[arg(long, allow_hyphen_values = true)]
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
    #[arg(long, allow_negative_numbers = true, value_parser = crate::cli::workers)]
    workers: Option<usize>,
    /// Images per step, the global batch over all replicas [default: 16].
    #[arg(long, allow_negative_numbers = true, value_parser = crate::cli::whole::<usize>)]
    batch: Option<usize>,
    /// Side of the square input images, at least 32 [default: 32].
    #[arg(long, allow_negative_numbers = true, value_parser = crate::cli::whole::<u32>)]
    image_size: Option<u32>,
    /// Number of classes of the synthetic dataset and the classifier [default: 10; with
    /// --data, the dataset's].
    #[arg(long, allow_negative_numbers = true, value_parser = crate::cli::classes)]
    classes: Option<u32>,
    /// Seed of the initialisation, the dataset's split, shuffles and augmentation [default: 0].
    #[arg(long, allow_negative_numbers = true, value_parser = crate::cli::whole::<u64>)]
    seed: Option<u64>,
    /// Learning rate (the schedule's base rate) [default: 0.01].
    #[arg(long, allow_hyphen_values = true)]
    lr: Option<f32>,
    /// Learning-rate schedule after the warm-up: cosine (half a cosine, down to 0 at the end),
    /// constant, or step (a tenth from half the run, a hundredth from three quarters) [default:
    /// cosine].
    #[arg(long)]
    lr_schedule: Option<LrSchedule>,
    /// Steps of linear warm-up to the base rate [default: 10].
    #[arg(long, allow_negative_numbers = true, value_parser = crate::cli::whole::<u64>)]
    warmup_steps: Option<u64>,
    /// SGD momentum [default: 0.9].
    #[arg(long, allow_hyphen_values = true)]
    momentum: Option<f32>,
    /// Weight decay [default: 0.0005].
    #[arg(long, allow_hyphen_values = true)]
    weight_decay: Option<f32>,
    /// Label smoothing ε in [0, 1) [default: 0.1].
    #[arg(long, allow_hyphen_values = true)]
    label_smoothing: Option<f32>,
    /// Held-out images to measure accuracy on (0: none; at most 100000). Synthetic data:
    /// before and after training [default: 64]; images: after every epoch and at the end,
    /// spread over the validation split [default: all of it].
    #[arg(long, allow_negative_numbers = true, value_parser = crate::cli::whole::<usize>)]
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
    #[arg(long, conflicts_with = "adapters", allow_hyphen_values = true, value_parser = crate::cli::adapter)]
    adapter: Option<String>,
    /// Data-parallel over this many devices (any R up to the batch), each taking a contiguous
    /// shard of every step's batch (the first batch mod R one image more), with synchronised
    /// BatchNorm: the same training as on one device, bit for bit.
    #[arg(long, default_value_t = 1, conflicts_with = "mpi", allow_negative_numbers = true, value_parser = crate::cli::at_most::<1024>)]
    replicas: usize,
    /// Adapters for the replicas, comma-separated (`0,1`, `vulkan,gl`): replica r on the
    /// (r mod count)-th. Default: --adapter's (or the default) for all.
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true, value_parser = crate::cli::adapter)]
    adapters: Vec<String>,
    /// Keep the run in this checkpoint: written every --checkpoint-every steps, on SIGINT,
    /// SIGTERM or SIGHUP (after the step in flight) and at the end, atomically, and never with
    /// a non-finite value (the last good one stays). Checked for writability before training,
    /// and locked for the run: a second run on it is refused.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Steps between checkpoints (0: only at the end and on a signal) [default: 10].
    #[arg(long, allow_negative_numbers = true, value_parser = crate::cli::whole::<u64>)]
    checkpoint_every: Option<u64>,
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
    overwrite: super::Overwrite,
    #[command(flatten)]
    buckets: super::ranks::BucketArgs,
    #[command(flatten)]
    tune: super::ranks::TuneArgs,
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
    // First of all: a signal at any point (setting up and evaluating included) ends the run
    // saying what is kept; a second one ends it at once.
    let stop = StopSignals::register(args.ranks.mpi)?;
    let eval_limit = match args.eval_examples {
        Some(n) => super::eval_count("--eval-examples", n)?,
        None => usize::MAX,
    };
    if args.checkpoint.is_none() && args.checkpoint_every.is_some() {
        return Err("--checkpoint-every has no effect without --checkpoint: add --checkpoint PATH, or drop --checkpoint-every".into());
    }
    let peers = super::ranks::peers(&args.ranks)?;
    // Under MPI every rank trains; rank 0 alone prints, logs, evaluates and writes checkpoints.
    let lead = peers.rank() == 0;
    let settings::Run { cfg, splits, epochs, start, last, mut notes } = settings::resolve(&args)?;
    if args.ranks.mpi && args.checkpoint.is_some() {
        notes.extend(super::ranks::mpirun_grace_note());
    }
    halt(&stop, &args, "before training", None)?;
    let model = ResNet::new(cfg.arch, cfg.classes)?;
    check_host_memory(&model, &cfg, args.resume.as_deref())?;
    let checkpoint = args.checkpoint.as_ref().filter(|_| lead);
    let (_claim, mut log) = if lead { outputs(&args, &cfg, start.as_ref())? } else { (None, None) };
    let local = if args.ranks.mpi { args.ranks.local_replicas as usize } else { args.replicas };
    let bucket_bytes = args.buckets.bytes(local * peers.ranks())?;
    agree_with_ranks(&peers, &args, &cfg, local, start.as_ref())?;
    let gpus =
        super::ranks::devices(&peers, args.adapter.as_deref(), &args.adapters, local, &args.tune)?;
    let replicas = gpus.len() * peers.ranks();
    let devices = devices_text(&gpus, cfg.batch, peers.ranks(), local)?;
    let mut trainer =
        Trainer::data_parallel(gpus, cfg, start)?.with_peers(peers).with_bucket_bytes(bucket_bytes);
    if lead {
        announce(&trainer, splits.as_ref(), epochs, last, &devices, &notes);
    }
    let workers =
        args.workers.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
    let val = splits.as_ref().map(|s| Arc::new(eval_subset(&s.val, eval_limit)));
    let batches = batches(&trainer, splits.map(|s| s.train), epochs, workers)?;
    let synthetic_eval =
        if val.is_some() || !lead { 0 } else { args.eval_examples.unwrap_or(HELD_OUT_EXAMPLES) };
    let before = evaluate(&mut trainer, synthetic_eval, "before", &stop)?;
    halt(&stop, &args, "before training", None)?;
    if let (Some(scores), Some(log)) = (&before, log.as_mut()) {
        let lost = |e| format!("{e}: stopped before training; {}", kept(&args, None));
        log.write(&scores_record(scores, 0, trainer.step)).map_err(lost)?;
    }
    let (size, batch) = (trainer.cfg.image_size, trainer.cfg.batch);
    let flops = syncstep::bench::STEP_FLOPS_PER_FORWARD
        * trainer.model().forward_flops(size, size)
        * batch as f64;
    let every = args.checkpoint_every.unwrap_or(CHECKPOINT_EVERY);
    let plan = RunPlan { last, checkpoint_every: every, epochs };
    let mut console = Console {
        bar: steps_bar(lead, last - trainer.step),
        args: &args,
        batches,
        replicas,
        flops,
        lead,
        checkpoint,
        log,
        val,
        workers,
        stop: &stop,
        started: Instant::now(),
        wait: Duration::ZERO,
        waited: Duration::ZERO,
        busy: Duration::ZERO,
        last_scores: None,
        saved: None,
        log_failed: None,
        losses: Vec::new(),
    };
    let mut run = TrainingRun::new(trainer, plan);
    let end = pollster::block_on(run.run(&mut console));
    console.bar.finish_and_clear();
    // The loader's threads end here: the final evaluation has the cores.
    console.batches = Batches::Synthetic;
    if let RunEnd::Stopped { code, step } = end.map_err(|e| run_failed(&args, e))? {
        if let Some(lost) = console.log_failed.take() {
            return Err(
                format!("{lost}: stopped after step {step}; {}", kept(&args, Some(step))).into()
            );
        }
        return Err(stopped(code as usize, &args, &format!("after step {step}"), Some(step)));
    }
    console.finish(&run)?;
    if !lead {
        return Ok(());
    }
    console.report_accuracy(&mut run, before, synthetic_eval)?;
    match console.log_failed.take() {
        // The final evaluation's record, which comes after the final checkpoint.
        Some(lost) => {
            let kept = kept(&args, Some(run.trainer.step));
            Err(format!("{lost}: the final evaluation is not in it; {kept}").into())
        }
        None => Ok(()),
    }
}

/// Rank 0's outputs, checked before any work: the checkpoint, claimed for the run, and the
/// metrics log. No output may be an input of the run (its data, `--init`, the other output;
/// the log not `--resume` either, which the checkpoint may be: a run continued in place).
fn outputs(
    args: &TrainArgs,
    cfg: &TrainConfig,
    start: Option<&checkpoint::Checkpoint>,
) -> Result<(Option<Claim>, Option<MetricsLog>), Box<dyn std::error::Error>> {
    let any = args.checkpoint.is_some() || args.log.is_some();
    let overwrite = args.overwrite.check(any, "--checkpoint, --log")?;
    let data = cfg.images.as_ref().and_then(|i| i.data.path());
    let inputs: Vec<&Path> = [data, args.init.as_deref()].into_iter().flatten().collect();
    let claim = match &args.checkpoint {
        Some(path) => {
            let log = args.log.as_deref();
            let inputs: Vec<&Path> = inputs.iter().copied().chain(log).collect();
            let claim =
                files::check_output("--checkpoint", path, &inputs, checkpoint::KIND, overwrite)?;
            // Another run's checkpoint, as a fresh run's --log would be another run's log.
            let replaces = path.exists() && !files::writes_in_place(path);
            if args.resume.is_none() && replaces && !overwrite {
                return Err(format!(
                    "--checkpoint {}: exists, the checkpoint of another run; a fresh run does not replace it: continue that run with --resume {}, choose another --checkpoint, or add --overwrite to replace it",
                    path.display(),
                    path.display()
                )
                .into());
            }
            Some(claim)
        }
        None => None,
    };
    let from = start.filter(|ck| ck.step > 0).map_or(0, |ck| ck.step);
    let log = match &args.log {
        Some(path) => {
            let others = [args.resume.as_deref(), args.checkpoint.as_deref()];
            let inputs: Vec<&Path> =
                inputs.iter().copied().chain(others.into_iter().flatten()).collect();
            let resumed = args.resume.as_ref().map(|_| from);
            Some(MetricsLog::open(path, resumed, &inputs, overwrite)?)
        }
        None => None,
    };
    Ok((claim, log))
}

/// Checks that every rank runs the same training: the data by what it is (not by the path each
/// rank reaches it by), every other setting, the outputs rank 0 writes (a rank given others
/// would expect its own), and the state it starts from.
fn agree_with_ranks(
    peers: &Peers,
    args: &TrainArgs,
    cfg: &TrainConfig,
    local: usize,
    start: Option<&checkpoint::Checkpoint>,
) -> Result<(), Box<dyn std::error::Error>> {
    use super::ranks::agree;
    let data = cfg.images.as_ref().and_then(|i| i.fingerprint.as_ref()).map(|f| f.to_string());
    agree(peers, "the data (its files, sizes and labels)", &serde_json::to_vec(&data)?)?;
    let mut settings = cfg.metadata();
    // The data by what it is, not where each rank finds it, nor when its copy was written.
    settings.remove("data");
    settings.remove("data_times_sha256");
    agree(peers, "the settings", &serde_json::to_vec(&(settings, local))?)?;
    let outputs = serde_json::to_vec(&(&args.checkpoint, &args.log))?;
    agree(peers, "--checkpoint and --log (rank 0 writes them)", &outputs)?;
    if let Some(ck) = start {
        agree(peers, "the checkpoint", bytemuck::cast_slice(&ck.params))?;
    }
    Ok(())
}

/// Ends the run, saying so, when a signal came: `when` it stopped, and the step the checkpoint
/// holds (None: nothing of this run was saved).
fn halt(
    stop: &StopSignals,
    args: &TrainArgs,
    when: &str,
    saved: Option<u64>,
) -> Result<(), Box<dyn std::error::Error>> {
    match stop.received() {
        0 => Ok(()),
        signal => Err(stopped(signal, args, when, saved)),
    }
}

/// The devices a run trains on, for its first line: one adapter, or the replicas, their shard
/// sizes and adapters.
fn devices_text(
    gpus: &[Device],
    batch: usize,
    ranks: usize,
    local: usize,
) -> Result<String, Box<dyn std::error::Error>> {
    let r = gpus.len() * ranks;
    if r == 1 {
        return Ok(describe(&gpus[0].info));
    }
    let ranks = match ranks {
        1 => String::new(),
        p => format!(" (rank 0 of {p}, {local} per rank)"),
    };
    let mut sizes: Vec<String> =
        syncstep::data::shard_ranges(batch, r)?.iter().map(|s| s.len().to_string()).collect();
    sizes.dedup();
    Ok(format!(
        "{r} replicas of {} images{ranks}: {}",
        sizes.join(" or "),
        gpus.iter().map(|g| adapter_label(&g.info)).collect::<Vec<_>>().join("; ")
    ))
}

/// Prints what the run trains on, for how long, on what, and the notes of its settings.
fn announce(
    trainer: &Trainer,
    splits: Option<&Splits>,
    epochs: Option<Epochs>,
    last: u64,
    devices: &str,
    notes: &[String],
) {
    let cfg = &trainer.cfg;
    let what = match (&cfg.images, splits) {
        (Some(images), Some(s)) => format!(
            "{} ({} training and {} validation images)",
            images.data,
            s.train.len(),
            s.val.len()
        ),
        _ => "synthetic images".into(),
    };
    say!(
        "syncstep train: {} ({} classes), batch {} of {}×{} {what}, steps {} to {last}, on {devices}",
        cfg.arch.title(),
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
}

/// Where the batches come from: the loader's threads for images (the `train` split), else the
/// synthetic dataset.
fn batches(
    trainer: &Trainer,
    train: Option<Dataset>,
    epochs: Option<Epochs>,
    workers: usize,
) -> Result<Batches, Box<dyn std::error::Error>> {
    let cfg = &trainer.cfg;
    let (Some(images), Some(train), Some(epochs)) = (&cfg.images, train, epochs) else {
        return Ok(Batches::Synthetic);
    };
    // Only this process's replicas' examples of each batch are read (under MPI, its ranks'
    // shards).
    let part = trainer.part()?;
    let plan = Plan::Train { epochs, augment: images.augment, part: (part.start, part.end) };
    let loader =
        Loader::start(Arc::new(train), plan, cfg.image_size, images.norm, trainer.step, workers)?;
    Ok(Batches::Images(loader))
}

/// The bar of the run's steps; hidden on ranks other than 0.
fn steps_bar(lead: bool, steps: u64) -> ProgressBar {
    let bar = if lead { ProgressBar::new(steps) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// What this process shows and keeps of a run, the face the library's [`TrainingRun`] drives:
/// its batches, the step bar and log, validation at epochs' ends, the checkpoint file and the
/// signals that stop it.
struct Console<'a> {
    args: &'a TrainArgs,
    batches: Batches,
    /// Replicas over all ranks.
    replicas: usize,
    /// FLOPs of one step.
    flops: f64,
    /// Rank 0: the one that prints, logs, evaluates and writes checkpoints.
    lead: bool,
    checkpoint: Option<&'a PathBuf>,
    log: Option<MetricsLog>,
    /// The validation images; None for the synthetic dataset.
    val: Option<Arc<Dataset>>,
    workers: usize,
    stop: &'a StopSignals,
    bar: ProgressBar,
    /// When the step in flight began, and how long it waited for its batch.
    started: Instant,
    wait: Duration,
    /// Time waiting for batches, and whole steps' time, over the run.
    waited: Duration,
    busy: Duration,
    /// The validation scores after the last epoch that ended.
    last_scores: Option<Scores>,
    /// The final checkpoint's line, said once the run is known not to be stopped.
    saved: Option<String>,
    /// Why the log could not take a record (a full disk): the run stops after the step in flight
    /// and keeps its checkpoint, rather than lose it too.
    log_failed: Option<String>,
    /// The losses of this run's steps so far, whose median each step's line shows.
    losses: Vec<f32>,
}

impl RunHooks for Console<'_> {
    type Error = Box<dyn std::error::Error>;

    fn batch(&mut self, trainer: &Trainer) -> Result<Batch, Self::Error> {
        self.started = Instant::now();
        let (batch, wait) = self.batches.next(trainer)?;
        self.wait = wait;
        Ok(batch)
    }

    fn stepped(&mut self, trainer: &Trainer, done: &StepDone) -> Result<(), Self::Error> {
        let elapsed = self.started.elapsed();
        (self.waited, self.busy) = (self.waited + self.wait, self.busy + elapsed);
        self.report_step(trainer.cfg.batch, done, elapsed)
    }

    /// Rank 0 scores the validation split after each epoch.
    fn epoch_ended(&mut self, trainer: &mut Trainer, epoch: u64) -> Result<(), Self::Error> {
        if let Some(val) = self.val.clone().filter(|v| self.lead && !v.is_empty()) {
            self.last_scores = self.score(trainer, &val, epoch)?;
        }
        Ok(())
    }

    fn keeps_checkpoints(&self) -> bool {
        self.checkpoint.is_some()
    }

    fn keep(&mut self, trainer: &Trainer, ck: &Checkpoint, why: Keep) -> Result<(), Self::Error> {
        let Some(path) = self.checkpoint else { return Ok(()) };
        checkpoint::save(path, trainer.model(), ck)?;
        let line = format!("checkpoint: {} (step {})", path.display(), ck.step);
        match why {
            Keep::Final => self.saved = Some(line),
            Keep::Due | Keep::Stopped if self.bar.is_hidden() => self.say(&line),
            Keep::Due | Keep::Stopped => {}
        }
        Ok(())
    }

    fn stop_code(&mut self) -> u64 {
        // A lost log stops the run as a signal would, its checkpoint written.
        match self.log_failed {
            Some(_) => LOG_LOST,
            None => self.stop.received() as u64,
        }
    }
}

impl Console<'_> {
    fn say(&self, line: &str) {
        if self.lead {
            say!("{line}");
        }
    }

    /// The step's line on the bar (or printed, without a terminal) and in the log.
    fn report_step(
        &mut self,
        batch: usize,
        done: &StepDone,
        elapsed: Duration,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let StepDone { step, epoch, lr, loss } = *done;
        let secs = elapsed.as_secs_f64();
        let wait_share = self.wait.as_secs_f64() / secs;
        let throughput = throughput(batch, self.replicas, secs);
        self.losses.push(loss);
        let smoothed = smoothed_loss(&self.losses, LOSS_WINDOW).unwrap_or(loss);
        let line = format!(
            "step {step} epoch {epoch} lr {lr:.3e} loss {loss:.4} (median of {LOSS_WINDOW} steps {smoothed:.4}) {throughput} data wait {:.0}%",
            100.0 * wait_share
        );
        self.bar.set_message(format!("{line} {:.2} GFLOP/s", self.flops / secs / 1e9));
        self.bar.inc(1);
        if self.bar.is_hidden() {
            // Not a terminal (CI, a pipe): one line per step instead of a redrawn bar.
            self.say(&line);
        }
        self.record(&Record {
            step,
            epoch,
            loss: Some(loss),
            lr: Some(lr),
            images_per_s: Some(batch as f64 / secs),
            data_wait: Some(wait_share),
            ..Record::default()
        });
        Ok(())
    }

    /// Writes `record` to the log. A log that cannot take it (a full disk) is kept no more,
    /// and the run stops after the step in flight, keeping its checkpoint, rather than lose
    /// that too.
    fn record(&mut self, record: &Record) {
        if let Some(Err(e)) = self.log.as_mut().map(|log| log.write(record)) {
            self.log_failed = Some(e.to_string());
            self.log = None;
        }
    }

    /// The scores on `val` after `epoch`, printed and logged; None when a signal cut the
    /// evaluation short (the part scored is no measure of anything).
    fn score(
        &mut self,
        trainer: &mut Trainer,
        val: &Arc<Dataset>,
        epoch: u64,
    ) -> Result<Option<Scores>, Box<dyn std::error::Error>> {
        let scores = score_images(trainer, val, self.workers, &self.bar, self.stop)?;
        if self.stop.received() != 0 {
            return Ok(None);
        }
        let record = report_scores(&self.bar, &scores, epoch, trainer.step);
        self.record(&record);
        Ok(Some(scores))
    }

    /// After the last step: a signal's stop, the checkpoint written, and the loss's course.
    fn finish(&mut self, run: &TrainingRun) -> Result<(), Box<dyn std::error::Error>> {
        let total = self.busy.as_secs_f64();
        // A signal before here stops the run after its last step; once the checkpoint line is
        // out, one stops the final evaluation (a log reader can tell which from that line).
        let step = run.trainer.step;
        halt(self.stop, self.args, &format!("after step {step}"), Some(step))?;
        if let Some(saved) = self.saved.take() {
            self.say(&saved);
        }
        let losses = run.losses();
        // One step's loss is one batch's: the medians of the first and last steps show the
        // course, a hard batch's spike or two passed over.
        if let Some(LossCourse { window, start, end }) = loss_course(losses) {
            let change = match end / start {
                r if r <= 1.0 => format!("down {:.0}%", 100.0 * (1.0 - r)),
                r => format!("up {:.0}%", 100.0 * (r - 1.0)),
            };
            self.say(&format!(
                "loss, the median of {window} steps: {start:.4} at the start → {end:.4} at the end, {change} ({} steps in {total:.1} s, {:.1} img/s, {:.1}% of it waiting for data)",
                losses.len(),
                (losses.len() as f64 * run.trainer.cfg.batch as f64) / total,
                100.0 * self.waited.as_secs_f64() / total.max(f64::MIN_POSITIVE)
            ));
        }
        Ok(())
    }

    /// Rank 0's last lines: what it received from the other ranks, and the accuracy on the
    /// validation split or on the synthetic held-out images (before and after).
    fn report_accuracy(
        &mut self,
        run: &mut TrainingRun,
        before: Option<Scores>,
        synthetic_eval: usize,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let peers = run.trainer.replicas.peers();
        if peers.ranks() > 1 && !run.losses().is_empty() {
            say!(
                "MPI: {} ranks; rank 0 received {} a step from the others",
                peers.ranks(),
                syncstep::host::format_bytes(
                    peers.received_bytes() / run.losses().len() as u64,
                    syncstep::host::ByteScale::MiB,
                )
            );
        }
        let (classes, step) = (run.trainer.cfg.classes, run.trainer.step);
        let when = format!("during the final evaluation, after step {step}");
        if let Some(val) = self.val.clone().filter(|v| !v.is_empty()) {
            let scores = match self.last_scores.take().filter(|_| run.at_epoch_end()) {
                Some(scores) => Some(scores),
                None => {
                    let epoch = run.epoch();
                    self.score(&mut run.trainer, &val, epoch)?
                }
            };
            halt(self.stop, self.args, &when, Some(step))?;
            let scores = scores.ok_or("the final evaluation was cut short")?;
            say!(
                "validation ({} images, {classes} classes; chance {:.1}%): top-1 {:.1}%, top-5 {:.1}%",
                scores.examples,
                100.0 / classes as f64,
                100.0 * scores.top1(),
                100.0 * scores.top5()
            );
            return Ok(());
        }
        if self.val.is_some() {
            say!("validation: not measured (no validation images)");
            return Ok(());
        }
        let after = evaluate(&mut run.trainer, synthetic_eval, "after", self.stop)?;
        halt(self.stop, self.args, &when, Some(step))?;
        if let Some(scores) = &after {
            self.record(&scores_record(scores, 0, step));
        }
        match (before, after) {
            (Some(before), Some(after)) => say!(
                "held-out accuracy ({synthetic_eval} images, {classes} classes; chance {:.0}%): {:.1}% before → {:.1}% after",
                100.0 / classes as f64,
                100.0 * before.top1(),
                100.0 * after.top1()
            ),
            _ => say!("held-out accuracy: not measured (--eval-examples 0)"),
        }
        Ok(())
    }
}

/// The error of a run that ended early, said in the command line's terms.
fn run_failed(
    args: &TrainArgs,
    e: RunError<Box<dyn std::error::Error>>,
) -> Box<dyn std::error::Error> {
    match e {
        RunError::Diverged(d) => diverged(args, &d),
        RunError::Parallel(e) => e.into(),
        RunError::Face(e) => e,
    }
}

/// The stop code of a run whose log could not be written (no signal's number).
const LOG_LOST: u64 = 255;

/// The exit of a run that `signal` stopped `when`: 130, 143 or 129, and what is kept (`saved`: the
/// step the checkpoint holds; None when nothing of this run was written).
fn stopped(
    signal: usize,
    args: &TrainArgs,
    when: &str,
    saved: Option<u64>,
) -> Box<dyn std::error::Error> {
    let kept = kept(args, saved);
    let (name, code) = match signal as u64 {
        // Another rank's view of rank 0's lost log, which rank 0 names: an end every rank
        // agreed on, as a signal's (no rank ends the job while rank 0 writes).
        LOG_LOST => ("rank 0 could not write the --log", 1),
        _ => (StopSignals::name(signal), StopSignals::exit_code(signal)),
    };
    let message = format!("{name}: stopped {when}; {kept}");
    Box::new(Exit { code, message, job_ending: StopSignals::job_ending(signal) })
}

/// What a stopped run kept: the step its checkpoint holds (`saved`; None when nothing of this
/// run was written), and how to continue it.
fn kept(args: &TrainArgs, saved: Option<u64>) -> String {
    match (&args.checkpoint, saved) {
        // Only rank 0 knows whether it wrote the checkpoint (mpirun may have ended it first).
        (Some(_), _) if !super::ranks::writes_outputs() => {
            "rank 0 writes the checkpoint and says which step it holds".into()
        }
        (Some(path), Some(step)) => format!(
            "the checkpoint {} holds step {step}: continue with --resume {}",
            path.display(),
            path.display()
        ),
        (Some(_), None) => "no step was trained, so no checkpoint was written".into(),
        (None, _) => "no --checkpoint was given, so nothing was saved".into(),
    }
}

/// The error of a run that diverged: says why, what to change, and which checkpoint is kept.
fn diverged(args: &TrainArgs, d: &Diverged) -> Box<dyn std::error::Error> {
    let kept = match &args.checkpoint {
        Some(path) if path.exists() => {
            format!("the last good checkpoint {} is kept", path.display())
        }
        _ => "no checkpoint was written".into(),
    };
    format!("{d}; lower --lr (or --weight-decay); {kept}").into()
}

/// Refuses a run (resumed from `resume`, whose settings it keeps) whose images and activations
/// would not fit this host's available memory.
fn check_host_memory(
    model: &ResNet,
    cfg: &TrainConfig,
    resume: Option<&Path>,
) -> Result<(), Box<dyn std::error::Error>> {
    let Some(available) = super::available_memory() else { return Ok(()) };
    let (b, s) = (cfg.batch as u64, cfg.image_size);
    // The batch's images, and host copies of the largest activation (readback, staging).
    let images = b.checked_mul(3 * s as u64 * s as u64).and_then(|v| v.checked_mul(4));
    let largest = model.largest_activation(b, s, s).and_then(|v| v.checked_mul(8));
    let need = images.zip(largest).and_then(|(a, b)| a.checked_add(b)).unwrap_or(u64::MAX);
    if need > available {
        return Err(format!(
            "a batch of {b} images of {s}×{s} needs about {} of host memory, and {} is available: {}",
            syncstep::host::format_bytes(need, syncstep::host::ByteScale::Fit),
            syncstep::host::format_bytes(available, syncstep::host::ByteScale::Fit),
            settings::smaller("--batch or --image-size", resume)
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

#[cfg(test)]
mod tests {
    use clap::Args;
    use syncstep::train::{TrainConfig, CHECKPOINT_EVERY, HELD_OUT_EXAMPLES, VAL_SPLIT};

    use super::{TrainArgs, STEPS};

    /// The value `[default: …]` states in `flag`'s paragraph of `help` (up to a comma or
    /// semicolon, which start its conditions).
    fn stated_default(help: &str, flag: &str) -> String {
        let start = help.find(&format!("{flag} <")).unwrap_or_else(|| panic!("no {flag} in help"));
        let paragraph = &help[start..help[start..].find("\n\n").map_or(help.len(), |e| start + e)];
        let from = paragraph.find("[default: ").unwrap_or_else(|| panic!("{flag}: no default"))
            + "[default: ".len();
        let value = &paragraph[from..];
        value[..value.find([']', ',', ';']).unwrap_or(value.len())].trim().to_string()
    }

    /// The defaults the help and the README state by hand are the library's.
    #[test]
    fn the_help_and_readme_state_the_librarys_defaults() {
        let help = TrainArgs::augment_args(clap::Command::new("train")).render_long_help();
        let help = help.to_string();
        let cfg = TrainConfig::default();
        let (step, schedule) = (cfg.step, cfg.schedule);
        let expected = [
            ("--arch", cfg.arch.name().to_string()),
            ("--data", syncstep::data::source::DataSpec::Synthetic.to_string()),
            ("--val-split", VAL_SPLIT.to_string()),
            ("--batch", cfg.batch.to_string()),
            ("--image-size", cfg.image_size.to_string()),
            ("--classes", cfg.classes.to_string()),
            ("--seed", cfg.seed.to_string()),
            ("--lr", step.lr.to_string()),
            ("--lr-schedule", schedule.kind.to_string()),
            ("--warmup-steps", schedule.warmup_steps.to_string()),
            ("--momentum", step.momentum.to_string()),
            ("--weight-decay", step.weight_decay.to_string()),
            ("--label-smoothing", step.label_smoothing.to_string()),
            ("--eval-examples", HELD_OUT_EXAMPLES.to_string()),
            ("--checkpoint-every", CHECKPOINT_EVERY.to_string()),
            ("--steps", STEPS.to_string()),
        ];
        for (flag, value) in expected {
            assert_eq!(stated_default(&help, flag), value, "{flag}'s stated default");
        }
        let readme = include_str!("../../../README.md");
        let (b, s) = (cfg.batch, cfg.image_size);
        let main_job = format!("({STEPS} steps, batch {b}, {s}×{s};");
        assert!(readme.contains(&main_job), "the README's main job is not {main_job}");
    }
}
