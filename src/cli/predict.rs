//! `syncstep predict`: the likeliest classes of each image by a checkpoint or torchvision
//! weights (eval-mode BatchNorm; each image preprocessed as `--preprocess` says).

use std::path::{Path, PathBuf};

use clap::Args;
use serde_json::{json, Value};
use syncstep::classify::{default_class_names, top_classes, ClassifyError};
use syncstep::data::source::decode_file;
use syncstep::files::Kind;

use super::weights::ModelArgs;

/// predict's classes (`--json`), told by their `image_size`, `preprocess` and `images`.
const PREDICTIONS: Kind = Kind {
    what: "syncstep predict's classes (a predict --json file)",
    ours: |path| super::report_with(path, &["/image_size", "/preprocess", "/images"]),
};

#[derive(Args)]
pub struct PredictArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Images (png, jpeg, bmp, webp; any size: resized and center-cropped).
    #[arg(required = true)]
    images: Vec<PathBuf>,
    /// Classes listed per image, likeliest first.
    #[arg(long, default_value_t = 5, allow_negative_numbers = true, value_parser = crate::cli::positive::<usize>)]
    top: usize,
    /// With --weights: the classes' names, one a line, as many as `fc` has outputs [default:
    /// ImageNet-1k's for 1000 outputs, else the class indices].
    #[arg(long, requires = "weights")]
    class_names: Option<PathBuf>,
    /// Also write each image's top classes (index, name, probability) here, as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    overwrite: super::Overwrite,
}

pub fn run(args: PredictArgs) -> Result<(), Box<dyn std::error::Error>> {
    let (file, torchvision) = args.model.file();
    if args.class_names.is_some() && !torchvision {
        return Err("--class-names names the classes of --weights; a checkpoint has its own (its run's data): drop --class-names".into());
    }
    let overwrite = args.overwrite.check(args.json.is_some(), "--json")?;
    let mut inputs: Vec<&Path> = args.images.iter().map(PathBuf::as_path).collect();
    inputs.extend([Some(file), args.class_names.as_deref()].into_iter().flatten());
    let _claim = args
        .json
        .as_ref()
        .map(|path| syncstep::files::check_output("--json", path, &inputs, PREDICTIONS, overwrite))
        .transpose()?;
    let (model, weights) = args.model.read()?;
    let k = model.cfg.classes as usize;
    let (names, norm) = match (model.class_names(), model.norm()) {
        (Some(_), Some(norm)) if model.torchvision => {
            (class_names(args.class_names.as_deref(), k)?, norm)
        }
        (Some(names), Some(norm)) => (names, norm),
        _ => {
            return Err(format!(
                "{} was trained on the synthetic dataset, not on images: predict needs a run with --data",
                file.display()
            )
            .into())
        }
    };
    // The trainer checks the image size against the device before any image is made at it.
    let mut trainer = model.trainer(weights)?;
    // Every image is decoded before any runs, so a bad one is reported before the work.
    let mut pixels = Vec::with_capacity(args.images.len());
    for path in &args.images {
        pixels.push(model.input(&decode_file(path)?, &norm));
    }
    let ranked =
        pollster::block_on(top_classes(&mut trainer, &pixels, args.top)).map_err(|e| match e {
            ClassifyError::NotFinite { image, .. } => {
                format!("{}: {e}", args.images[image].display())
            }
            e => e.to_string(),
        })?;
    let mut report = Vec::new();
    for (path, top) in args.images.iter().zip(ranked) {
        let shown: Vec<String> =
            top.iter().map(|&(c, p)| format!("{} {:.1}%", names[c], 100.0 * p)).collect();
        say!("{}: {}", path.display(), shown.join(", "));
        let top: Vec<Value> = top
            .iter()
            .map(|&(c, p)| json!({"index": c, "class": names[c], "probability": p}))
            .collect();
        report.push(json!({"image": path.display().to_string(), "top": top}));
    }
    if let Some(path) = &args.json {
        let report = json!({
            model.flag(): file.display().to_string(),
            "image_size": model.cfg.image_size,
            "preprocess": model.preprocess.to_string(),
            "images": report,
        });
        let text = super::sealed(&serde_json::to_string_pretty(&report)?);
        syncstep::files::write_atomic(path, text.as_bytes())?;
    }
    Ok(())
}

/// The names of torchvision weights' `k` classes: `file`'s lines, else ImageNet-1k's when
/// there are 1000, else the indices.
fn class_names(file: Option<&Path>, k: usize) -> Result<Vec<String>, String> {
    let Some(file) = file else { return Ok(default_class_names(k)) };
    let bytes = syncstep::files::read_input(file)
        .map_err(|e| format!("--class-names {}: {e}", file.display()))?;
    let text = String::from_utf8(bytes)
        .map_err(|_| format!("--class-names {}: not UTF-8 text", file.display()))?;
    let names: Vec<String> = text.lines().map(|l| l.trim_end_matches('\r').to_string()).collect();
    if let Some(problem) = syncstep::settings::class_names_problem(&names, "line") {
        return Err(format!("--class-names {} {problem}, one name a line", file.display()));
    }
    if names.len() != k {
        return Err(format!(
            "--class-names {} lists {} names, but the weights' classifier (fc) has {k} outputs: give one name a line, {k} lines",
            file.display(),
            names.len()
        ));
    }
    Ok(names)
}
