//! `syncstep predict`: the likeliest classes of each image by a checkpoint (eval-mode
//! BatchNorm; the image resized and center-cropped as evaluation does).

use std::path::PathBuf;

use clap::Args;
use syncstep::data::source::decode_file;
use syncstep::data::transform::{eval_image, Preprocess};
use syncstep::data::Batch;
use syncstep::scores::{ranking, softmax};

#[derive(Args)]
pub struct PredictArgs {
    /// The checkpoint (`train --checkpoint`) of a run on images.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Images (png, jpeg, bmp, webp; any size: resized and center-cropped).
    #[arg(required = true)]
    images: Vec<PathBuf>,
    /// Classes listed per image, likeliest first.
    #[arg(long, default_value_t = 5, allow_negative_numbers = true, value_parser = crate::cli::positive::<usize>)]
    top: usize,
    /// Adapter (see `syncstep info`); defaults to $SYNCSTEP_ADAPTER, else the first.
    #[arg(long)]
    adapter: Option<String>,
}

pub fn run(args: PredictArgs) -> Result<(), Box<dyn std::error::Error>> {
    let mut trainer = super::eval::load_trained(&args.checkpoint, args.adapter.as_deref())?;
    let cfg = trainer.cfg.clone();
    let images = cfg.images.as_ref().ok_or_else(|| {
        format!(
            "{} was trained on the synthetic dataset, not on images: predict needs a run with --data",
            args.checkpoint.display()
        )
    })?;
    let size = cfg.image_size;
    // Every image is decoded before any runs, so a bad one is reported before the work.
    let mut pixels = Vec::with_capacity(args.images.len());
    for path in &args.images {
        pixels.push(eval_image(&decode_file(path)?, size, Preprocess::Square, &images.norm));
    }
    let k = cfg.classes as usize;
    let chunk = cfg.batch.max(1);
    for (paths, chunk) in args.images.chunks(chunk).zip(pixels.chunks(chunk)) {
        let batch =
            Batch { images: chunk.concat(), labels: vec![0; chunk.len()], h: size, w: size };
        let logits = pollster::block_on(trainer.replicas.predict(&batch))?;
        for (path, row) in paths.iter().zip(logits.chunks(k)) {
            let p = softmax(row);
            let top: Vec<String> = ranking(row)
                .into_iter()
                .take(args.top)
                .map(|c| format!("{} {:.1}%", images.class_names[c], 100.0 * p[c]))
                .collect();
            println!("{}: {}", path.display(), top.join(", "));
        }
    }
    Ok(())
}
