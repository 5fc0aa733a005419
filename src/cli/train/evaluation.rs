//! Evaluations during a run: the held-out subset, its scores with progress, and their report.
//! A signal cuts an evaluation short between two batches; the caller then stops the run.

use std::sync::Arc;

use indicatif::{ProgressBar, ProgressStyle};
use syncstep::data::source::Dataset;
use syncstep::data::transform::Preprocess;
use syncstep::metrics::Record;
use syncstep::scores::Scores;
use syncstep::train::Trainer;

use super::signals::StopSignals;

/// At most `limit` examples of `val`, spread evenly over it (its classes are in order).
pub(super) fn eval_subset(val: &Dataset, limit: usize) -> Dataset {
    let n = val.len();
    if limit >= n {
        return val.subset(&(0..n).collect::<Vec<_>>());
    }
    let picked: Vec<usize> =
        (0..limit).map(|i| (i as u128 * n as u128 / limit as u128) as usize).collect();
    val.subset(&picked)
}

/// The validation split's scores, with progress on the bar's terminal.
pub(super) fn score_images(
    trainer: &mut Trainer,
    val: &Arc<Dataset>,
    workers: usize,
    bar: &ProgressBar,
    stop: &StopSignals,
) -> Result<Scores, Box<dyn std::error::Error>> {
    let cfg = &trainer.cfg;
    let (size, norm) = (cfg.image_size, cfg.images.as_ref().map(|i| i.norm));
    let norm = norm.ok_or("no images to score")?;
    bar.set_message(format!("validating on {} images", val.len()));
    // Validation makes its images as the run's `eval` and `predict` do by default.
    let recipe = (size, Preprocess::Square);
    crate::cli::eval::score(trainer, val.clone(), recipe, norm, workers, &mut |_| {
        stop.received() == 0
    })
}

/// Prints an evaluation after `step`; returns its record for the log, which `syncstep plot`
/// draws beside the loss.
pub(super) fn report_scores(bar: &ProgressBar, scores: &Scores, epoch: u64, step: u64) -> Record {
    let line = format!(
        "epoch {epoch} (step {step}): validation top-1 {:.1}%, top-5 {:.1}% ({} images)",
        100.0 * scores.top1(),
        100.0 * scores.top5(),
        scores.examples
    );
    match bar.is_hidden() {
        true => say!("{line}"),
        false => bar.println(line),
    }
    scores_record(scores, epoch, step)
}

/// The log's record of an evaluation after `step`.
pub(super) fn scores_record(scores: &Scores, epoch: u64, step: u64) -> Record {
    let (val_top1, val_top5) = (Some(scores.top1()), Some(scores.top5()));
    Record { step, epoch, val_top1, val_top5, ..Record::default() }
}

/// Held-out accuracy on `examples` images of the synthetic dataset, with progress on a
/// terminal; None for 0, or when a signal cut it short (a part scored is no measure of
/// anything; the caller then stops the run).
pub(super) fn evaluate(
    trainer: &mut Trainer,
    examples: usize,
    when: &str,
    stop: &StopSignals,
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
    let result = pollster::block_on(trainer.evaluate(examples, &mut |done| {
        bar.set_position(done as u64);
        stop.received() == 0
    }));
    bar.finish_and_clear();
    let scores = result?;
    Ok(Some(scores).filter(|_| stop.received() == 0))
}
