//! `syncstep eval`: a checkpoint's accuracy on a dataset split (eval-mode BatchNorm): top-1,
//! top-5, per class, and the confusion matrix, printed and (`--json`) written.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use syncstep::checkpoint;
use syncstep::data::loader::{Loader, Plan};
use syncstep::data::source::{self, DataSpec, Dataset};
use syncstep::data::transform::{Normalization, Preprocess};
use syncstep::model::ResNet34;
use syncstep::scores::Scores;
use syncstep::tensorfile::TensorFile;
use syncstep::train::{ImageSettings, TrainConfig, Trainer};

/// Classes up to which the confusion matrix is printed (the JSON always has it).
const PRINTED_CONFUSION: usize = 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Split {
    Train,
    Val,
}

#[derive(Args)]
pub struct EvalArgs {
    /// The checkpoint to evaluate (`train --checkpoint`).
    #[arg(long)]
    checkpoint: PathBuf,
    /// The data: as `train --data` [default: the checkpoint's]. With a folder, the split is the
    /// checkpoint's (DIR/val, or the same seeded --val-split fraction).
    #[arg(long)]
    data: Option<DataSpec>,
    /// Which split to score.
    #[arg(long, value_enum, default_value_t = Split::Val)]
    split: Split,
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
    /// Adapter (see `syncstep info`); defaults to $SYNCSTEP_ADAPTER, else the first.
    #[arg(long)]
    adapter: Option<String>,
}

/// A checkpoint's run configuration and a trainer holding its weights, on one device.
pub fn load_trained(
    path: &Path,
    adapter: Option<&str>,
) -> Result<Trainer, Box<dyn std::error::Error>> {
    let cfg = TrainConfig::from_settings(&TensorFile::read(path)?.metadata)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let ck = checkpoint::load(path, &ResNet34::new(cfg.classes)?)?;
    let gpu =
        super::ranks::devices(&Default::default(), adapter, &[], 1, &Default::default())?.remove(0);
    Ok(Trainer::new(gpu, cfg, Some(ck))?)
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
    let mut trainer = load_trained(&args.checkpoint, args.adapter.as_deref())?;
    let cfg = trainer.cfg.clone();
    let spec = args
        .data
        .clone()
        .unwrap_or_else(|| cfg.images.as_ref().map_or(DataSpec::Synthetic, |i| i.data.clone()));
    if let Some(path) = &args.json {
        let inputs: Vec<&Path> =
            [Some(args.checkpoint.as_path()), spec.path()].into_iter().flatten().collect();
        syncstep::files::check_output("--json", path, &inputs)?;
    }
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} images")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let progress = &mut |done: usize| {
        bar.set_position(done as u64);
        true
    };
    let scores = match (&spec, &cfg.images) {
        (DataSpec::Synthetic, _) => {
            let examples = super::eval_count("--examples", args.examples.unwrap_or(1000))?;
            bar.set_length(examples as u64);
            pollster::block_on(trainer.evaluate(examples, progress))?
        }
        (_, None) => {
            return Err(format!(
                "{} was trained on the synthetic dataset: evaluate it with --data synthetic",
                args.checkpoint.display()
            )
            .into())
        }
        (spec, Some(images)) => {
            let data = split_of(&args, spec, images, cfg.seed)?;
            bar.set_length(data.len() as u64);
            let workers = args
                .workers
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
            let recipe = (cfg.image_size, Preprocess::Square);
            score(&mut trainer, Arc::new(data), recipe, images.norm, workers, progress)?
        }
    };
    bar.finish_and_clear();
    let names = cfg.class_names();
    print_scores(&args, &spec, &scores, &names);
    if let Some(path) = &args.json {
        write_json(path, &args, &spec, trainer.step, &scores, &names)?;
    }
    Ok(())
}

/// The split of `spec` that `args` asks to score, with the classes `images` were trained on.
fn split_of(
    args: &EvalArgs,
    spec: &DataSpec,
    images: &ImageSettings,
    seed: u64,
) -> Result<Dataset, Box<dyn std::error::Error>> {
    if args.examples.is_some() {
        return Err("--examples counts synthetic held-out images; a dataset's split is scored whole: drop --examples".into());
    }
    let splits = source::open(spec, images.val_split, seed)?;
    let data = match args.split {
        Split::Train => splits.train,
        Split::Val => splits.val,
    };
    if data.class_names != images.class_names {
        return Err(format!(
            "{spec}'s classes are not the ones {} was trained on",
            args.checkpoint.display()
        )
        .into());
    }
    if data.is_empty() {
        return Err(format!("{spec} has no {} images", split_name(args.split)).into());
    }
    Ok(data)
}

/// The scores, per-class accuracy and confusion matrix of the checkpoint at `step`, as JSON.
fn write_json(
    path: &Path,
    args: &EvalArgs,
    spec: &DataSpec,
    step: u64,
    scores: &Scores,
    names: &[String],
) -> Result<(), Box<dyn std::error::Error>> {
    let per_class: Vec<_> = scores
        .per_class()
        .iter()
        .zip(names)
        .map(|(&(examples, accuracy), name)| {
            json!({"name": name, "examples": examples, "accuracy": accuracy})
        })
        .collect();
    let confusion: Vec<&[u64]> = scores.confusion.chunks(scores.classes).collect();
    let report = json!({
        "checkpoint": args.checkpoint.display().to_string(),
        "data": spec.to_string(),
        "split": split_name(args.split),
        "step": step,
        "examples": scores.examples,
        "top1": scores.top1(),
        "top5": scores.top5(),
        "classes": per_class,
        "confusion": confusion,
    });
    let text = serde_json::to_string_pretty(&report)?;
    syncstep::files::write_atomic(path, text.as_bytes())?;
    println!("scores: {}", path.display());
    Ok(())
}

fn split_name(split: Split) -> &'static str {
    match split {
        Split::Train => "train",
        Split::Val => "val",
    }
}

fn print_scores(args: &EvalArgs, spec: &DataSpec, scores: &Scores, names: &[String]) {
    println!(
        "{} on {spec} ({} split, {} images): top-1 {:.2}%, top-5 {:.2}%",
        args.checkpoint.display(),
        split_name(args.split),
        scores.examples,
        100.0 * scores.top1(),
        100.0 * scores.top5()
    );
    let width = names.iter().map(|n| n.chars().count()).max().unwrap_or(5).clamp(5, 24);
    println!("{:<width$}  images  top-1", "class");
    for ((examples, accuracy), name) in scores.per_class().into_iter().zip(names) {
        let accuracy = accuracy.map_or("-".to_string(), |a| format!("{:.1}%", 100.0 * a));
        println!("{name:<width$}  {examples:>6}  {accuracy:>5}");
    }
    if scores.classes <= PRINTED_CONFUSION {
        println!("confusion (row: true class, column: predicted, in class order):");
        for row in scores.confusion.chunks(scores.classes) {
            let cells: Vec<String> = row.iter().map(|v| format!("{v:>5}")).collect();
            println!("{}", cells.join(""));
        }
    }
}
