//! `syncstep export`: a checkpoint's model for PyTorch (torchvision's `state_dict` as
//! safetensors) or for ONNX runtimes (the inference graph). A file conversion: no device.

use std::error::Error;
use std::path::{Path, PathBuf};

use clap::Args;
use syncstep::checkpoint::{self, Checkpoint};
use syncstep::export::{self, onnx, Format};
use syncstep::model::ResNet;
use syncstep::tensorfile::TensorFile;

#[derive(Args)]
pub struct ExportArgs {
    /// The checkpoint of a run (`train --checkpoint`).
    checkpoint: PathBuf,
    /// The file to write; its extension chooses the format: .safetensors (torchvision's
    /// `state_dict`, which `load_state_dict(strict=True)` takes) or .onnx (the inference graph:
    /// input [batch, 3, size, size] float32, output the logits [batch, classes]).
    #[arg(short = 'o', long = "out")]
    out: PathBuf,
    #[command(flatten)]
    overwrite: super::Overwrite,
}

pub fn run(args: ExportArgs) -> Result<(), Box<dyn Error>> {
    let format = Format::of(&args.out).ok_or_else(|| {
        format!(
            "-o {}: the format is taken from the extension: .safetensors (torchvision's state_dict, for PyTorch) or .onnx (the inference graph)",
            args.out.display()
        )
    })?;
    let overwrite = args.overwrite.overwrite;
    let _claim = syncstep::files::check_output(
        "-o",
        &args.out,
        &[&args.checkpoint],
        export::KIND,
        overwrite,
    )?;
    let (model, ck) = read(&args.checkpoint)?;
    export::write(&args.out, format, &model, &ck)?;
    let (arch, classes, out) = (model.arch, model.classes, args.out.display());
    match format {
        Format::Safetensors => say!(
            "{out}: torchvision's {arch} state_dict ({classes} classes, step {}); in PyTorch: torchvision.models.{arch}(num_classes={classes}).load_state_dict(safetensors.torch.load_file(\"{out}\"))",
            ck.step
        ),
        Format::Onnx => {
            let size = ck.settings.image_size;
            let input = match &ck.settings.images {
                Some(images) => format!(
                    "images normalised with mean {:?} and std {:?}",
                    images.norm.mean, images.norm.std
                ),
                None => "the synthetic dataset's images".into(),
            };
            say!(
                "{out}: {arch}'s inference graph (ONNX, opset {}): input `{}` float32 [batch, 3, {size}, {size}] ({input}), output `{}` [batch, {classes}]",
                onnx::OPSET,
                onnx::INPUT,
                onnx::OUTPUT
            );
        }
    }
    Ok(())
}

/// The checkpoint at `path` and its model, read and checked.
fn read(path: &Path) -> Result<(ResNet, Checkpoint), Box<dyn Error>> {
    let file = TensorFile::read(path)?;
    if !file.metadata.contains_key("format") {
        return Err(format!(
            "{}: not a syncstep checkpoint (its header has no `format`; a `train --checkpoint` file has one): export takes a run's checkpoint, and torchvision weights are a state_dict already",
            path.display()
        )
        .into());
    }
    let cfg = checkpoint::check_checkpoint(&file)?;
    let model = ResNet::new(cfg.arch, cfg.classes)?;
    let ck = checkpoint::from_file(&file, &model)?;
    Ok((model, ck))
}
