//! `syncstep eval`: the accuracy of a checkpoint or of torchvision weights on a dataset split
//! (eval-mode BatchNorm): top-1, top-5, per class, and the confusion matrix, printed and
//! (`--json`) written.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use syncstep::data::loader::{Loader, Plan};
use syncstep::data::source::{self, DataSpec, Dataset};
use syncstep::data::transform::{Normalization, Preprocess};
use syncstep::files::Kind;
use syncstep::scores::Scores;
use syncstep::settings::ImageSettings;
use syncstep::train::Trainer;

use super::weights::{Model, ModelArgs};

/// Classes up to which the confusion matrix is printed (the JSON always has it).
const PRINTED_CONFUSION: usize = 20;

/// eval's scores (`--json`), told by their `split`, `top1` and `confusion`.
const SCORES: Kind = Kind {
    what: "syncstep eval's scores (an eval --json file)",
    ours: |path| super::report_with(path, &["/split", "/top1", "/confusion"]),
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Split {
    Train,
    Val,
}

#[derive(Args)]
pub struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The data: as `train --data` [default: the checkpoint's; --weights needs it]. With a
    /// folder, a checkpoint's split is its run's (DIR/val, or the same seeded --val-split
    /// fraction); torchvision weights hold nothing out.
    #[arg(long)]
    data: Option<DataSpec>,
    /// Which split to score [default: val; with --weights, val where the data has one
    /// (DIR/val, CIFAR's test files), else every image, reported as the split `all`].
    #[arg(long, value_enum)]
    split: Option<Split>,
    /// Held-out images of the synthetic dataset to score, at most 100000 (with synthetic data
    /// only: a dataset's split is scored whole) [default: 1000].
    #[arg(long, allow_negative_numbers = true, value_parser = crate::cli::positive::<usize>)]
    examples: Option<usize>,
    /// Also write the scores, per-class accuracy and confusion matrix here, as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Threads decoding images [default: the CPU's cores].
    #[arg(long, allow_negative_numbers = true, value_parser = crate::cli::workers)]
    workers: Option<usize>,
    #[command(flatten)]
    overwrite: super::Overwrite,
}

/// Scores of `trainer` on every image of `data` (evaluation images: brought to `size` by
/// `preprocess`, normalised by `norm`), decoded by `workers` threads; `progress` is told how
/// many are done, and ends the scoring there by answering false.
pub fn score(
    trainer: &mut Trainer,
    data: Arc<Dataset>,
    (size, preprocess): (u32, Preprocess),
    norm: Normalization,
    workers: usize,
    progress: &mut dyn FnMut(usize) -> bool,
) -> Result<Scores, Box<dyn std::error::Error>> {
    let mut scores = Scores::new(trainer.cfg.classes);
    let batch = trainer.cfg.batch.div_ceil(trainer.replicas.replicas().len());
    let plan = Plan::Eval { batch, preprocess };
    let mut loader = Loader::start(data, plan, size, norm, 0, workers)?;
    while let Some((batch, _)) = loader.next_batch() {
        pollster::block_on(trainer.score(&batch?, &mut scores))?;
        if !progress(scores.examples) {
            break;
        }
    }
    Ok(scores)
}

pub fn run(args: EvalArgs) -> Result<(), Box<dyn std::error::Error>> {
    let (file, torchvision) = args.model.file();
    if torchvision && matches!(args.data, None | Some(DataSpec::Synthetic)) {
        return Err("--weights needs --data with images to score (DIR, cifar10:DIR or cifar100:DIR), of as many classes as the weights' classifier (fc) has outputs".into());
    }
    let (model, weights) = args.model.read()?;
    let cfg = &model.cfg;
    let spec = args
        .data
        .clone()
        .unwrap_or_else(|| cfg.images.as_ref().map_or(DataSpec::Synthetic, |i| i.data.clone()))
        .canonical()
        .map_err(|e| match args.data {
            Some(_) => format!("--data: {e}"),
            None => format!(
                "the checkpoint's data is not there ({e}): give --data with the place it is now"
            ),
        })?;
    let overwrite = args.overwrite.check(args.json.is_some(), "--json")?;
    let inputs: Vec<&Path> = [Some(file), spec.path()].into_iter().flatten().collect();
    let _claim = args
        .json
        .as_ref()
        .map(|path| syncstep::files::check_output("--json", path, &inputs, SCORES, overwrite))
        .transpose()?;
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} images")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let progress = &mut |done: usize| {
        bar.set_position(done as u64);
        true
    };
    let (scores, split, names, step) = match (&spec, model.norm()) {
        (DataSpec::Synthetic, Some(_)) => {
            return Err(format!(
                "{} was trained on images, and the synthetic dataset's patterns are other classes: give --data with images of its classes",
                file.display()
            )
            .into())
        }
        (DataSpec::Synthetic, None) => {
            let images_only = [
                ("--preprocess", args.model.preprocess.is_some()),
                ("--workers", args.workers.is_some()),
                ("--split", args.split.is_some()),
            ];
            if let Some((flag, _)) = images_only.iter().find(|(_, given)| *given) {
                return Err(format!("{flag} applies to a dataset of images; the synthetic dataset's held-out images are one set made in place: drop {flag}").into());
            }
            let examples = super::eval_count("--examples", args.examples.unwrap_or(1000))?;
            let mut trainer = model.trainer(weights)?;
            bar.set_length(examples as u64);
            let scores = pollster::block_on(trainer.evaluate(examples, progress))?;
            let split = "val";
            (scores, split, cfg.class_names(), trainer.step)
        }
        (_, None) => {
            return Err(format!(
                "{} was trained on the synthetic dataset: evaluate it with --data synthetic",
                file.display()
            )
            .into())
        }
        (spec, Some(norm)) => {
            let (split, data) = split_of(&args, &model, spec)?;
            let mut trainer = model.trainer(weights)?;
            bar.set_length(data.len() as u64);
            let workers = args
                .workers
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
            let names = data.class_names.clone();
            let recipe = (cfg.image_size, model.preprocess);
            let scores = score(&mut trainer, Arc::new(data), recipe, norm, workers, progress)?;
            (scores, split, names, trainer.step)
        }
    };
    bar.finish_and_clear();
    let report = Report { model: &model, spec: &spec, split, step, scores: &scores, names: &names };
    report.print();
    if let Some(path) = &args.json {
        report.write_json(path)?;
    }
    Ok(())
}

/// The split of `spec` that `args` asks to score, and its name ("all" where torchvision
/// weights score a dataset with no validation split of its own: nothing is held out). A
/// checkpoint's split is made as its run made it, and must have the classes it was trained
/// on; torchvision weights take a dataset of as many classes as their classifier has outputs.
fn split_of(
    args: &EvalArgs,
    model: &Model,
    spec: &DataSpec,
) -> Result<(&'static str, Dataset), Box<dyn std::error::Error>> {
    if args.examples.is_some() {
        return Err("--examples counts synthetic held-out images; a dataset's split is scored whole: drop --examples".into());
    }
    let cfg = &model.cfg;
    let run = cfg.images.as_ref().filter(|_| !model.torchvision);
    let splits = source::open(spec, run.map_or(0.0, |i| i.val_split), cfg.seed)?;
    // The checkpoint's own data, implied or named by --data in any spelling, must still be what
    // its run trained on (--data elsewhere names other data).
    let own = |i: &&ImageSettings| {
        let place = |spec: &DataSpec| spec.path().and_then(syncstep::files::resolved);
        args.data.is_none() || place(spec).is_some_and(|now| place(&i.data) == Some(now))
    };
    if let Some(images) = run.filter(own).filter(|i| i.fingerprint.is_some()) {
        let (now, times) = splits.identify(spec.path().unwrap_or(Path::new(".")))?;
        let other = match args.data {
            None => "give --data to score other data",
            Some(_) => "restore it, or score a copy of it at another path (other data)",
        };
        let ck = model.path.display();
        if let Some(then) = images.fingerprint.as_ref().filter(|&then| *then != now) {
            let changed = "files added, removed, renamed, resized or relabelled";
            return Err(format!(
                "{spec} is not the data {ck} was trained on: {now} now, {then} then ({changed}): {other}"
            )
            .into());
        }
        if images.file_times.as_ref().zip(times).is_some_and(|(then, now)| *then != now) {
            let since = super::modified_since(&ck.to_string());
            return Err(format!(
                "{spec} holds the files {ck} was trained on, but {since}: {other}"
            )
            .into());
        }
    }
    let whole = run.is_none() && splits.val.is_empty();
    let split = args.split.unwrap_or(if whole { Split::Train } else { Split::Val });
    let (data, name) = match split {
        Split::Train if whole => (splits.train, "all"),
        Split::Train => (splits.train, "train"),
        Split::Val => (splits.val, "val"),
    };
    match run {
        Some(images) if data.class_names != images.class_names => {
            return Err(format!(
                "{spec}'s classes are not the ones {} was trained on",
                model.path.display()
            )
            .into())
        }
        None if data.classes() != cfg.classes => {
            return Err(format!(
                "{spec} has {} classes, but {}'s classifier (fc) has {} outputs: give data with the classes the weights were trained on, in their order",
                data.classes(),
                model.path.display(),
                cfg.classes
            )
            .into())
        }
        _ => {}
    }
    if data.is_empty() {
        return Err(format!("{spec} has no {name} images").into());
    }
    Ok((name, data))
}

/// What an evaluation found, to print and to write.
struct Report<'a> {
    model: &'a Model,
    spec: &'a DataSpec,
    split: &'static str,
    /// The training step the weights are at (0 for torchvision's).
    step: u64,
    scores: &'a Scores,
    names: &'a [String],
}

impl Report<'_> {
    /// The scores, per-class accuracy and confusion matrix, as JSON.
    fn write_json(&self, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
        let scores = self.scores;
        let per_class: Vec<_> = scores
            .per_class()
            .iter()
            .zip(self.names)
            .map(|(&(examples, accuracy), name)| {
                json!({"name": name, "examples": examples, "accuracy": accuracy})
            })
            .collect();
        let confusion: Vec<&[u64]> = scores.confusion.chunks(scores.classes).collect();
        let report = json!({
            self.model.flag(): self.model.path.display().to_string(),
            "data": self.spec.to_string(),
            "split": self.split,
            "step": self.step,
            "image_size": self.model.cfg.image_size,
            "preprocess": self.model.preprocess.to_string(),
            "examples": scores.examples,
            "top1": scores.top1(),
            "top5": scores.top5(),
            "classes": per_class,
            "confusion": confusion,
        });
        let text = super::sealed(&serde_json::to_string_pretty(&report)?);
        syncstep::files::write_atomic(path, text.as_bytes())?;
        say!("scores: {}", path.display());
        Ok(())
    }

    fn print(&self) {
        let (scores, names) = (self.scores, self.names);
        say!(
            "{} on {} ({} split, {} images): top-1 {:.2}%, top-5 {:.2}%",
            self.model.path.display(),
            self.spec,
            self.split,
            scores.examples,
            100.0 * scores.top1(),
            100.0 * scores.top5()
        );
        let width = names.iter().map(|n| n.chars().count()).max().unwrap_or(5).clamp(5, 24);
        say!("{:<width$}  images  top-1", "class");
        for ((examples, accuracy), name) in scores.per_class().into_iter().zip(names) {
            let accuracy = accuracy.map_or("-".to_string(), |a| format!("{:.1}%", 100.0 * a));
            say!("{name:<width$}  {examples:>6}  {accuracy:>5}");
        }
        if scores.classes <= PRINTED_CONFUSION {
            say!("confusion (row: true class, column: predicted, in class order):");
            for row in scores.confusion.chunks(scores.classes) {
                let cells: Vec<String> = row.iter().map(|v| format!("{v:>5}")).collect();
                say!("{}", cells.join(""));
            }
        }
    }
}
