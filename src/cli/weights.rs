//! What `eval` and `predict` run, on one device: a training checkpoint (`--checkpoint`: the
//! run's classes, normalisation, image size and the `square` preprocessing its validation
//! used) or torchvision's weights (`--weights`: a ResNet `state_dict` as safetensors, with
//! ImageNet's normalisation and torchvision's evaluation preprocessing, as PyTorch would run
//! them). The flags that change how images are made apply to both.

use std::error::Error;
use std::path::{Path, PathBuf};

use clap::Args;
use syncstep::checkpoint::{self, Checkpoint};
use syncstep::classify::{fitting_batch, Classifier};
use syncstep::data::transform::Preprocess;
use syncstep::model::{Arch, ResNet};
use syncstep::tensorfile::TensorFile;
use syncstep::train::{TrainConfig, Trainer};

/// Exactly one of the two.
#[derive(Args)]
#[group(required = true, multiple = false)]
pub struct Source {
    /// The checkpoint of a run (`train --checkpoint`).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// torchvision ResNet weights: its `state_dict` saved as safetensors (docs/data.md shows
    /// how). The arch is the one their tensors are; the classes are `fc.weight`'s rows.
    #[arg(long)]
    weights: Option<PathBuf>,
}

#[derive(Args)]
pub struct ModelArgs {
    #[command(flatten)]
    source: Source,
    /// The network, checked against the weights: resnet18, resnet34, resnet50 or resnet101
    /// [default: the checkpoint's, or the one torchvision's weights are].
    #[arg(long)]
    arch: Option<Arch>,
    /// How an image is brought to the input size: torchvision (shorter side resized to
    /// ⌊size·256/224⌋ as PIL's antialiased bilinear resize, then a center crop: torchvision's
    /// ImageNet evaluation) or square (the central square resized to size: what training
    /// validates with) [default: torchvision with --weights, square with --checkpoint].
    #[arg(long)]
    pub preprocess: Option<Preprocess>,
    /// Side of the square input, at least 32 [default: the checkpoint's; 224 with --weights].
    #[arg(long, allow_negative_numbers = true, value_parser = crate::cli::whole::<u32>)]
    image_size: Option<u32>,
    /// Adapter (see `syncstep info`); defaults to $SYNCSTEP_ADAPTER, else the first.
    #[arg(long)]
    adapter: Option<String>,
}

/// Weights read and checked, and how images are made for them (the library's [`Classifier`],
/// which this derefs to); [`Model::trainer`] puts them on the device, once everything else has
/// been checked.
pub struct Model {
    pub classifier: Classifier,
    /// The file given, for messages.
    pub path: PathBuf,
    adapter: Option<String>,
    /// Whether `--image-size` set the input size (else the checkpoint's, or torchvision's).
    size_given: bool,
}

impl std::ops::Deref for Model {
    type Target = Classifier;

    fn deref(&self) -> &Classifier {
        &self.classifier
    }
}

impl Model {
    /// The flag the weights came by, as JSON reports name it.
    pub fn flag(&self) -> &'static str {
        if self.torchvision {
            "weights"
        } else {
            "checkpoint"
        }
    }

    /// Why one image at the input size does not fit the device, in `eval`'s and `predict`'s
    /// words: naming `--image-size` where it set the size (torchvision weights' size is the
    /// flag's default), else the checkpoint's setting.
    fn does_not_fit(&self, e: impl std::fmt::Display) -> String {
        let size = self.cfg.image_size;
        if self.size_given || self.torchvision {
            let e = e.to_string().replace("--batch or --image-size", "--image-size");
            return format!("--image-size {size}: one image does not fit: {e}");
        }
        let change = "this checkpoint's images are too large for this device to score";
        let e = e.to_string().replace("use a smaller --batch or --image-size", change);
        let path = self.path.display();
        format!("{path}: its setting `image_size` {size}: one image does not fit: {e}")
    }

    /// A trainer holding `weights` (what [`ModelArgs::read`] returned) on the adapter asked for,
    /// its batch the run's, or as many images as fit the device at the input size asked for.
    pub fn trainer(&self, weights: Checkpoint) -> Result<Trainer, Box<dyn Error>> {
        let (peers, tune) = (Default::default(), Default::default());
        let devices = super::ranks::devices(&peers, self.adapter.as_deref(), &[], 1, &tune)?;
        let gpu = devices.into_iter().next().ok_or("no device")?;
        let batch = fitting_batch(&self.cfg, &gpu.limits).map_err(|e| self.does_not_fit(e))?;
        Ok(Trainer::new(gpu, TrainConfig { batch, ..self.cfg.clone() }, Some(weights))?)
    }
}

impl ModelArgs {
    /// The file given and whether it holds torchvision weights.
    pub fn file(&self) -> (&Path, bool) {
        match (&self.source.checkpoint, &self.source.weights) {
            (Some(path), _) => (path, false),
            (None, Some(path)) => (path, true),
            // Unreachable: clap's group requires one of the two.
            (None, None) => (Path::new(""), false),
        }
    }

    /// The weights, read and checked (no device yet).
    pub fn read(&self) -> Result<(Model, Checkpoint), Box<dyn Error>> {
        let (path, torchvision) = self.file();
        let (mut classifier, weights) = if torchvision {
            torchvision_weights(path, self.arch)?
        } else {
            let file = TensorFile::read(path)?;
            let cfg = checkpoint::check_checkpoint(&file)?;
            if let Some(arch) = self.arch.filter(|&a| a != cfg.arch) {
                return Err(format!("{}: the checkpoint is a {}, not a {arch} (--arch): drop --arch or pass --arch {}", path.display(), cfg.arch, cfg.arch).into());
            }
            Classifier::checkpoint(&file)?
        };
        let cfg = &mut classifier.cfg;
        cfg.image_size = self.image_size.unwrap_or(cfg.image_size);
        ResNet::check_image_size(cfg.image_size, cfg.image_size)?;
        classifier.preprocess = self.preprocess.unwrap_or(classifier.preprocess);
        let model = Model {
            classifier,
            path: path.to_path_buf(),
            adapter: self.adapter.clone(),
            size_given: self.image_size.is_some(),
        };
        Ok((model, weights))
    }
}

/// torchvision weights (`--weights`), read by the library; a syncstep checkpoint is refused,
/// naming the flag it goes to.
fn torchvision_weights(
    path: &Path,
    asked: Option<Arch>,
) -> Result<(Classifier, Checkpoint), String> {
    let hint = |e: &dyn Error| {
        format!("{e}: --weights takes a torchvision ResNet's `state_dict` (resnet18, resnet34, resnet50 or resnet101) saved as safetensors (docs/data.md)")
    };
    let file = TensorFile::read(path).map_err(|e| hint(&e))?;
    if checkpoint::checkpoint_format(&file.metadata) {
        return Err(format!(
            "{}: this is a syncstep checkpoint (a `train --checkpoint` file), not torchvision weights: give it as --checkpoint, which runs it with its run's classes, image size and normalisation",
            path.display()
        ));
    }
    Classifier::torchvision(&file, asked).map_err(|e| hint(&e))
}
