//! What a `train` run is: each setting from its flag, else from the checkpoint on a resume,
//! else its default; for images, the dataset's splits, classes and normalisation; and where the
//! run starts (fresh, resumed, or from `--init` weights) and ends.

use std::error::Error;
use std::path::Path;

use syncstep::checkpoint::{self, Checkpoint};
use syncstep::data::schedule::{Epochs, LrSchedule, Schedule};
use syncstep::data::source::{self, DataSpec, Fingerprint, Splits};
use syncstep::data::transform::{channel_stats, Augment, Normalization};
use syncstep::model::{Arch, ResNet};
use syncstep::step::StepConfig;
use syncstep::tensorfile::TensorFile;
use syncstep::train::{ImageSettings, TrainConfig, VAL_SPLIT};

use super::{Normalize, TrainArgs};

/// Images the dataset's channel statistics are measured on, spread over the training set.
const STATS_IMAGES: usize = 1000;

/// A run, resolved.
pub struct Run {
    pub cfg: TrainConfig,
    /// The images' splits; None for the synthetic dataset.
    pub splits: Option<Splits>,
    /// The epochs over the training split; None for the synthetic dataset.
    pub epochs: Option<Epochs>,
    /// The state to start from: a checkpoint, or `--init` weights at step 0.
    pub start: Option<Checkpoint>,
    /// The step the run ends after.
    pub last: u64,
    /// What the user is told before training: overrides, skipped files, the normalisation.
    pub notes: Vec<String>,
}

/// The settings a resumed checkpoint was made with (none for a fresh run), and what the user
/// is told about the run's settings.
struct Saved {
    cfg: Option<TrainConfig>,
    notes: Vec<String>,
    /// `--override` was given.
    override_given: bool,
}

impl Saved {
    /// `cli` from the command line (`--flag`), else what the checkpoint `recorded`, else
    /// `default`. A command-line value that contradicts the checkpoint is an error (the run
    /// would not be a continuation), unless the setting is `overridable` and `--override` was
    /// given: then it wins, and the notes say so.
    fn setting<T: PartialEq + std::fmt::Display>(
        &mut self,
        flag: &str,
        cli: Option<T>,
        recorded: impl FnOnce(&TrainConfig) -> Option<T>,
        default: T,
        overridable: bool,
    ) -> Result<T, String> {
        match (cli, self.cfg.as_ref().and_then(recorded)) {
            (Some(c), Some(s)) if c != s && overridable && self.override_given => {
                self.notes.push(format!("--{flag} {c} overrides the checkpoint's {s}"));
                Ok(c)
            }
            (Some(c), Some(s)) if c != s && overridable => Err(format!(
                "the checkpoint was trained with --{flag} {s}; drop --{flag}, pass {s}, or add --override to change it"
            )),
            (Some(c), Some(s)) if c != s => Err(format!(
                "--{flag} {c}: the checkpoint was trained with --{flag} {s}, which a resume keeps (even with --override): drop --{flag} or pass {s}, or start a new run to change it"
            )),
            (c, s) => Ok(c.or(s).unwrap_or(default)),
        }
    }

    /// The checkpoint's image settings; None for a fresh run or the synthetic dataset.
    fn images(&self) -> Option<&ImageSettings> {
        self.cfg.as_ref().and_then(|c| c.images.as_ref())
    }
}

pub fn resolve(args: &TrainArgs) -> Result<Run, Box<dyn Error>> {
    let defaults = TrainConfig::default();
    // Read once, and checked whole before any of it is used.
    let resumed = args.resume.as_deref().map(TensorFile::read).transpose()?;
    let cfg = resumed.as_ref().map(checkpoint::check_checkpoint).transpose()?;
    let mut saved = Saved { cfg, notes: Vec::new(), override_given: args.override_settings };
    let arch = saved.setting("arch", args.arch, |c| Some(c.arch), defaults.arch, false)?;
    let data = run_data(args, &saved)?;
    let seed = saved.setting("seed", args.seed, |c| Some(c.seed), defaults.seed, false)?;
    let batch = saved.setting("batch", args.batch, |c| Some(c.batch), defaults.batch, false)?;
    let recorded_size = |c: &TrainConfig| Some(c.image_size);
    let image_size =
        saved.setting("image-size", args.image_size, recorded_size, defaults.image_size, false)?;
    ResNet::check_image_size(image_size, image_size)
        .map_err(|e| format!("--image-size {image_size}: {e}"))?;
    let (splits, images) = match image_settings(args, &mut saved, &data, seed, image_size)? {
        Some((splits, images)) => (Some(splits), Some(images)),
        None => (None, None),
    };
    let classes = class_count(args, &mut saved, images.as_ref(), defaults.classes)?;
    let step = step_config(args, &mut saved)?;
    let (kind, warmup_steps) = schedule_settings(args, &mut saved, defaults.schedule)?;

    let model = ResNet::new(arch, classes)?;
    let start = resumed.map(|file| checkpoint::from_file(&file, &model)).transpose()?;
    let from = start.as_ref().map_or(0, |ck| ck.step);
    let epochs = epochs_over(splits.as_ref(), batch, seed, args.resume.as_deref())?;
    let last = last_step(args, epochs, from)?;
    // The schedule is laid over the run as first planned; a resume keeps it.
    let planned = saved.cfg.as_ref().map(|c| c.schedule.total_steps);
    let total_steps = planned.filter(|_| !args.override_settings).unwrap_or(last);
    // The default warm-up is longer than a run of a few steps, which then only climbs: a note
    // only for one asked for.
    if warmup_steps > total_steps && args.warmup_steps.is_some() {
        saved.notes.push(format!(
            "note: the warm-up ({warmup_steps} steps) is longer than the run's {total_steps}: the rate never reaches --lr"
        ));
    }
    let schedule = Schedule { kind, warmup_steps, total_steps };
    let cfg = TrainConfig { arch, batch, image_size, classes, seed, step, schedule, images };
    let start = match &args.init {
        Some(path) => Some(init_weights(path, &model, args.arch, &cfg, &mut saved.notes)?),
        None => start,
    };
    Ok(Run { cfg, splits, epochs, start, last, notes: saved.notes })
}

/// For images (`--data`): the dataset's splits and the run's image settings; None for the
/// synthetic dataset.
fn image_settings(
    args: &TrainArgs,
    saved: &mut Saved,
    data: &DataSpec,
    seed: u64,
    image_size: u32,
) -> Result<Option<(Splits, ImageSettings)>, Box<dyn Error>> {
    if let DataSpec::Synthetic = data {
        if args.epochs.is_some() {
            return Err("the synthetic dataset has no epochs: use --steps".into());
        }
        let images_only = [
            ("--augment", args.augment.is_some()),
            ("--val-split", args.val_split.is_some()),
            ("--normalize", args.normalize.is_some()),
            ("--workers", args.workers.is_some()),
        ];
        if let Some((flag, _)) = images_only.iter().find(|(_, given)| *given) {
            return Err(format!(
                "{flag} applies to images (--data DIR, cifar10:DIR, …); the synthetic dataset has no use for it: drop {flag}"
            )
            .into());
        }
        return Ok(None);
    }
    let recorded_split = |c: &TrainConfig| c.images.as_ref().map(|i| i.val_split);
    let val_split = saved.setting("val-split", args.val_split, recorded_split, VAL_SPLIT, false)?;
    let splits = source::open(data, val_split, seed)?;
    let root = data.path().unwrap_or(Path::new("."));
    let (fingerprint, file_times) = splits.identify(root)?;
    same_data(saved, data, &fingerprint, file_times.as_deref())?;
    let default_augment = match data {
        DataSpec::Cifar10(_) | DataSpec::Cifar100(_) => Augment::CropFlip,
        _ => Augment::ResizedCropFlip,
    };
    let recorded_augment = |c: &TrainConfig| c.images.as_ref().map(|i| i.augment);
    let augment =
        saved.setting("augment", args.augment, recorded_augment, default_augment, true)?;
    let recorded_norm = saved.images().map(|i| i.norm);
    let norm = normalization(args, recorded_norm, &splits, image_size, &mut saved.notes)?;
    let class_names = splits.train.class_names.clone();
    if let Some(names) = saved.images().map(|i| &i.class_names).filter(|n| **n != class_names) {
        return Err(format!(
            "the dataset's classes are not the checkpoint's ({}): resume on the data it was trained on",
            names.join(", ")
        )
        .into());
    }
    saved.notes.extend(splits.notes.iter().cloned());
    let fingerprint = Some(fingerprint);
    let images = ImageSettings {
        data: data.clone(),
        fingerprint,
        file_times,
        val_split,
        augment,
        norm,
        class_names,
    };
    Ok(Some((splits, images)))
}

/// The run's data, its path made absolute: `--data`, else the checkpoint's. A resume may name
/// the checkpoint's data at another path (moved, or reached by a link): [`same_data`] then
/// holds it to the checkpoint's fingerprint.
fn run_data(args: &TrainArgs, saved: &Saved) -> Result<DataSpec, Box<dyn Error>> {
    let flag = args.data.as_ref().map(DataSpec::canonical).transpose()?;
    let Some(recorded) = saved.cfg.as_ref().map(TrainConfig::data) else {
        return Ok(flag.unwrap_or(DataSpec::Synthetic));
    };
    match flag {
        None => recorded.canonical().map_err(|e| {
            format!("the checkpoint's data {recorded} is not there ({e}): give --data with the place it is now").into()
        }),
        Some(flag) if std::mem::discriminant(&flag) != std::mem::discriminant(&recorded) => {
            Err(format!("--data {flag}: the checkpoint was trained on {recorded}, which a resume keeps (even with --override): drop --data, or start a new run").into())
        }
        Some(flag) => Ok(flag),
    }
}

/// On a resume, refuses data that is not the checkpoint's: another fingerprint (files added,
/// removed, renamed, resized or relabelled), or, for a checkpoint of an earlier build, which
/// has none, another folder. In the checkpoint's own folder, files written since (their times,
/// `times` now, are not those recorded: an image rewritten at the same size) are refused too.
/// The same files at another path, whose times are their copy's, are said so. Under MPI, rank 0
/// alone holds the times to the checkpoint's (the other ranks' copies of the data, on other
/// hosts, have times of their own, and are held to rank 0's data by its fingerprint).
fn same_data(
    saved: &mut Saved,
    data: &DataSpec,
    now: &Fingerprint,
    times: Option<&str>,
) -> Result<(), Box<dyn Error>> {
    let Some(recorded) = saved.cfg.as_ref().map(TrainConfig::data) else { return Ok(()) };
    let moved = recorded.canonical().ok().as_ref() != Some(data);
    let images = saved.images();
    let recorded_times = images.and_then(|i| i.file_times.clone());
    match images.and_then(|i| i.fingerprint.clone()) {
        Some(then) if then != *now => Err(format!(
            "{data} is not the data the checkpoint was trained on: {now} now, {then} then (files added, removed, renamed, resized or relabelled): resume on that data"
        )
        .into()),
        Some(_) if moved => {
            saved.notes.push(format!("{data} holds the files the checkpoint was trained on at {recorded}"));
            Ok(())
        }
        None if moved => Err(format!(
            "--data {data}: the checkpoint was trained with --data {recorded}, which a resume keeps (even with --override): drop --data or pass {recorded}"
        )
        .into()),
        None => Ok(()),
        Some(_) => match (recorded_times, times) {
            (Some(then), Some(now)) if then != now && crate::cli::ranks::writes_outputs() => {
                Err(format!(
                    "{data} holds the checkpoint's files (names, sizes, labels), but {}: resume on the files as they were, or start a new run from the checkpoint's weights with --init",
                    crate::cli::modified_since("the checkpoint")
                )
                .into())
            }
            (None, Some(_)) => {
                saved.notes.push(format!(
                    "the checkpoint records no times of its files (an earlier build's, or the page's): an image of {data} rewritten at the same size would go unnoticed"
                ));
                Ok(())
            }
            _ => Ok(()),
        },
    }
}

/// The class count: `--classes`, which must be the dataset's when there are images.
fn class_count(
    args: &TrainArgs,
    saved: &mut Saved,
    images: Option<&ImageSettings>,
    default: u32,
) -> Result<u32, Box<dyn Error>> {
    let dataset_classes = images.map(|i| i.class_names.len() as u32);
    if let (Some(flag), Some(dataset)) = (args.classes, dataset_classes) {
        if flag != dataset {
            return Err(format!(
                "--classes {flag}, but the dataset has {dataset} classes: drop --classes"
            )
            .into());
        }
    }
    let given = args.classes.or(dataset_classes);
    Ok(saved.setting("classes", given, |c| Some(c.classes), default, false)?)
}

/// The SGD step's hyper-parameters.
fn step_config(args: &TrainArgs, saved: &mut Saved) -> Result<StepConfig, Box<dyn Error>> {
    let d = StepConfig::default();
    let step = StepConfig {
        label_smoothing: saved.setting(
            "label-smoothing",
            args.label_smoothing,
            |c| Some(c.step.label_smoothing),
            d.label_smoothing,
            true,
        )?,
        lr: saved.setting("lr", args.lr, |c| Some(c.step.lr), d.lr, true)?,
        momentum: saved.setting(
            "momentum",
            args.momentum,
            |c| Some(c.step.momentum),
            d.momentum,
            true,
        )?,
        weight_decay: saved.setting(
            "weight-decay",
            args.weight_decay,
            |c| Some(c.step.weight_decay),
            d.weight_decay,
            true,
        )?,
        bn_momentum: saved.cfg.as_ref().map_or(d.bn_momentum, |c| c.step.bn_momentum),
    };
    step.validate()?;
    Ok(step)
}

/// The learning-rate schedule's kind and warm-up.
fn schedule_settings(
    args: &TrainArgs,
    saved: &mut Saved,
    defaults: Schedule,
) -> Result<(LrSchedule, u64), String> {
    let recorded_kind = |c: &TrainConfig| Some(c.schedule.kind);
    let kind =
        saved.setting("lr-schedule", args.lr_schedule, recorded_kind, defaults.kind, true)?;
    let recorded_warmup = |c: &TrainConfig| Some(c.schedule.warmup_steps);
    let warmup_steps = saved.setting(
        "warmup-steps",
        args.warmup_steps,
        recorded_warmup,
        defaults.warmup_steps,
        true,
    )?;
    Ok((kind, warmup_steps))
}

/// What to change when the run's batch or image size (`what`: the flags) does not fit: the
/// flags, or, for a run resumed from `resume` (whose settings a resume keeps), a new run.
pub fn smaller(what: &str, resume: Option<&Path>) -> String {
    match resume {
        None => format!("use a smaller {what}"),
        Some(ck) => format!(
            "these are the settings of the checkpoint {}, which a resume keeps: start a new run with a smaller {what} (--init {} takes its weights)",
            ck.display(),
            ck.display()
        ),
    }
}

/// The epochs over the training split; None for the synthetic dataset.
fn epochs_over(
    splits: Option<&Splits>,
    batch: usize,
    seed: u64,
    resume: Option<&Path>,
) -> Result<Option<Epochs>, String> {
    splits
        .map(|s| Epochs { examples: s.train.len(), batch, seed })
        .map(|e| match e.steps_per_epoch() {
            0 => Err(format!(
                "the training split has {} images, fewer than one batch of {batch}: {}",
                e.examples,
                smaller("--batch", resume)
            )),
            _ => Ok(e),
        })
        .transpose()
}

/// The step the run ends after: `--epochs` of the training split, else `--steps` more than
/// the checkpoint's `from`.
fn last_step(args: &TrainArgs, epochs: Option<Epochs>, from: u64) -> Result<u64, Box<dyn Error>> {
    let last = match (args.epochs, epochs) {
        (Some(count), Some(e)) => count.checked_mul(e.steps_per_epoch()),
        _ => from.checked_add(args.steps),
    }
    .filter(|&s| s < 1 << 53)
    .ok_or("--steps or --epochs passes the largest step count a checkpoint keeps")?;
    if last <= from && args.epochs.is_some() {
        return Err(format!(
            "the checkpoint is at step {from}, already past --epochs {}",
            args.epochs.unwrap_or(0)
        )
        .into());
    }
    Ok(last)
}

/// The state at step 0 from `--init` weights, for `model` (of `--arch`, `asked`, or the
/// default). `notes` says what was not taken: a classifier of another class count (initialised
/// afresh) and tensors the model has no place for (ignored).
fn init_weights(
    path: &Path,
    model: &ResNet,
    asked: Option<Arch>,
    cfg: &TrainConfig,
    notes: &mut Vec<String>,
) -> Result<Checkpoint, Box<dyn Error>> {
    let file = TensorFile::read(path)?;
    let found = checkpoint::weights_arch(&file, asked)?;
    if found != model.arch {
        return Err(format!(
            "--init {}: these are {found} weights, and without --arch the run is a {}: pass --arch {found}",
            path.display(),
            model.arch
        )
        .into());
    }
    let checkpoint::FineTuning { params, running, other_classes } =
        checkpoint::load_for_fine_tuning(&file, model, &model.init_params(cfg.seed))?;
    if let Some(k) = other_classes {
        notes.push(format!(
            "--init {}: its classifier is for {k} classes and this run's for {}: fc is initialised afresh (seed {}); every other tensor is taken",
            path.display(),
            cfg.classes,
            cfg.seed
        ));
    }
    let known = |name: &str| model.params.iter().chain(&model.buffers).any(|t| t.name == name);
    let ignored: Vec<&str> =
        file.tensors.keys().map(String::as_str).filter(|name| !known(name)).collect();
    if let Some(first) = ignored.first() {
        notes.push(format!(
            "--init {}: {} tensor(s) {} has no place for are ignored ({first}{})",
            path.display(),
            model.arch.title(),
            ignored.len(),
            if ignored.len() > 1 { ", …" } else { "" }
        ));
    }
    let velocity = vec![0.0; model.param_len];
    Ok(Checkpoint { params, running, velocity, step: 0, settings: cfg.clone() })
}

/// The checkpoint's normalisation on a resume; else ImageNet's or the training split's own.
fn normalization(
    args: &TrainArgs,
    recorded: Option<Normalization>,
    splits: &Splits,
    image_size: u32,
    notes: &mut Vec<String>,
) -> Result<Normalization, Box<dyn Error>> {
    if let Some(norm) = recorded {
        if args.normalize.is_some() {
            return Err("the checkpoint fixes the normalisation: drop --normalize".into());
        }
        return Ok(norm);
    }
    let norm = match args.normalize.unwrap_or(Normalize::Dataset) {
        Normalize::Imagenet => Normalization::IMAGENET,
        Normalize::Dataset => channel_stats(&splits.train, image_size, STATS_IMAGES)?,
    };
    notes.push(format!(
        "normalisation: mean {:.4?}, std {:.4?} ({})",
        norm.mean,
        norm.std,
        match args.normalize {
            Some(Normalize::Imagenet) => "ImageNet's".to_string(),
            _ => format!("the training split's, over up to {STATS_IMAGES} images"),
        }
    ));
    Ok(norm)
}
