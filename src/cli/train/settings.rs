//! What a `train` run is: each setting from its flag, else from the checkpoint on a resume,
//! else its default; for images, the dataset's splits, classes and normalisation; and where the
//! run starts (fresh, resumed, or from `--init` weights) and ends.

use std::collections::BTreeMap;
use std::error::Error;

use syncstep::checkpoint::{self, Checkpoint};
use syncstep::data::schedule::{Epochs, LrSchedule, Schedule};
use syncstep::data::source::{self, DataSpec, Splits};
use syncstep::data::transform::{channel_stats, Augment, Normalization};
use syncstep::model::ResNet34;
use syncstep::step::StepConfig;
use syncstep::tensorfile::TensorFile;
use syncstep::train::{ImageSettings, TrainConfig};

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

/// `cli` from the command line, else `saved` from the checkpoint, else `default`. A command-line
/// value that contradicts the checkpoint is an error (the run would not be a continuation),
/// unless `may_override`: then it wins, and `notes` says so.
fn setting<T: std::str::FromStr + PartialEq + std::fmt::Display>(
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

pub fn resolve(args: &TrainArgs) -> Result<Run, Box<dyn Error>> {
    let defaults = TrainConfig::default();
    let peek: BTreeMap<String, String> = match &args.resume {
        Some(p) => TensorFile::read(p)?.metadata,
        None => Default::default(),
    };
    let (step_defaults, o) = (StepConfig::default(), args.override_settings);
    let mut notes = Vec::new();
    let n = &mut notes;
    let data = setting("data", args.data.clone(), peek.get("data"), DataSpec::Synthetic, false, n)?;
    let seed = setting("seed", args.seed, peek.get("seed"), defaults.seed, false, n)?;
    let batch = setting("batch", args.batch, peek.get("batch"), defaults.batch, false, n)?;
    let image_size = setting(
        "image_size",
        args.image_size,
        peek.get("image_size"),
        defaults.image_size,
        false,
        n,
    )?;
    ResNet34::check_image_size(image_size, image_size)?;
    let (splits, images) = match &data {
        DataSpec::Synthetic => {
            if args.epochs.is_some() {
                return Err("the synthetic dataset has no epochs: use --steps".into());
            }
            (None, None)
        }
        spec => {
            let val_split =
                setting("val_split", args.val_split, peek.get("val_split"), 0.1, false, n)?;
            let splits = source::open(spec, val_split, seed)?;
            let default_augment = match spec {
                DataSpec::Cifar10(_) | DataSpec::Cifar100(_) => Augment::CropFlip,
                _ => Augment::ResizedCropFlip,
            };
            let augment =
                setting("augment", args.augment, peek.get("augment"), default_augment, o, n)?;
            let norm = normalization(args, &peek, &splits, image_size, n)?;
            let class_names = splits.train.class_names.clone();
            if let Some(saved) = peek.get("class_names") {
                if serde_json::from_str::<Vec<String>>(saved).ok().as_ref() != Some(&class_names) {
                    return Err(format!(
                        "the dataset's classes are not the checkpoint's ({saved}): resume on the data it was trained on"
                    )
                    .into());
                }
            }
            n.extend(splits.notes.iter().cloned());
            let images =
                ImageSettings { data: spec.clone(), val_split, augment, norm, class_names };
            (Some(splits), Some(images))
        }
    };
    let dataset_classes = images.as_ref().map(|i| i.class_names.len() as u32);
    if let (Some(flag), Some(dataset)) = (args.classes, dataset_classes) {
        if flag != dataset {
            return Err(format!(
                "--classes {flag}, but the dataset has {dataset} classes: drop --classes"
            )
            .into());
        }
    }
    let classes = setting(
        "classes",
        args.classes.or(dataset_classes),
        peek.get("classes"),
        defaults.classes,
        false,
        n,
    )?;
    let step = StepConfig {
        label_smoothing: setting(
            "label_smoothing",
            args.label_smoothing,
            peek.get("label_smoothing"),
            step_defaults.label_smoothing,
            o,
            n,
        )?,
        lr: setting("lr", args.lr, peek.get("lr"), step_defaults.lr, o, n)?,
        momentum: setting(
            "momentum",
            args.momentum,
            peek.get("momentum"),
            step_defaults.momentum,
            o,
            n,
        )?,
        weight_decay: setting(
            "weight_decay",
            args.weight_decay,
            peek.get("weight_decay"),
            step_defaults.weight_decay,
            o,
            n,
        )?,
        bn_momentum: setting(
            "bn_momentum",
            None,
            peek.get("bn_momentum"),
            step_defaults.bn_momentum,
            false,
            n,
        )?,
    };
    step.validate()?;
    let kind = setting(
        "lr_schedule",
        args.lr_schedule,
        peek.get("lr_schedule"),
        LrSchedule::Constant,
        o,
        n,
    )?;
    let warmup_steps =
        setting("warmup_steps", args.warmup_steps, peek.get("warmup_steps"), 0, o, n)?;

    let model = ResNet34::new(classes)?;
    let mut start = match &args.resume {
        Some(p) => Some(checkpoint::load(p, &model)?),
        None => None,
    };
    let from = start.as_ref().map_or(0, |ck| ck.step);
    let epochs = splits
        .as_ref()
        .map(|s| Epochs { examples: s.train.len(), batch, seed })
        .map(|e| match e.steps_per_epoch() {
            0 => Err(format!(
                "the training split has {} images, fewer than one batch of {batch}: use a smaller --batch",
                e.examples
            )),
            _ => Ok(e),
        })
        .transpose()?;
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
    // The schedule is laid over the run as first planned; a resume keeps it.
    let planned = peek.get("schedule_steps").filter(|_| !o).and_then(|s| s.parse().ok());
    let schedule = Schedule { kind, warmup_steps, total_steps: planned.unwrap_or(last) };
    let cfg = TrainConfig { batch, image_size, classes, seed, step, schedule, images };

    if let Some(path) = &args.init {
        let file = TensorFile::read(path)?;
        let (params, running, head_kept) =
            checkpoint::load_for_fine_tuning(&file, &model, &model.init_params(seed))?;
        if head_kept {
            n.push(format!(
                "--init {}: its classifier has another class count than {classes}: fc is initialised afresh (seed {seed})",
                path.display()
            ));
        }
        let velocity = vec![0.0; model.param_len];
        start = Some(Checkpoint { params, running, velocity, step: 0, settings: cfg.settings() });
    }
    Ok(Run { cfg, splits, epochs, start, last, notes })
}

/// The checkpoint's normalisation on a resume; else ImageNet's or the training split's own.
fn normalization(
    args: &TrainArgs,
    peek: &BTreeMap<String, String>,
    splits: &Splits,
    image_size: u32,
    notes: &mut Vec<String>,
) -> Result<Normalization, Box<dyn Error>> {
    if !peek.is_empty() {
        if args.normalize.is_some() {
            return Err("the checkpoint fixes the normalisation: drop --normalize".into());
        }
        return Ok(TrainConfig::from_settings(peek)?
            .images
            .map(|i| i.norm)
            .ok_or("the checkpoint has no normalisation")?);
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
