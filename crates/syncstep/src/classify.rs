//! Classifying images with a model file, as `syncstep predict` and the page do it: a training
//! checkpoint (the run's classes, normalisation, image size and the `square` preprocessing its
//! validation used) or torchvision's weights (a ResNet `state_dict` as safetensors, f16 and
//! bf16 widened, with ImageNet's classes and normalisation and torchvision's evaluation
//! preprocessing, as PyTorch runs them). Each image's likeliest classes come with their softmax
//! probabilities, in f64.
//!
//! Eval-mode logits do not depend on how images are batched, so a face batches as its device
//! allows ([`fitting_batch`]) and gets the same numbers.

use crate::checkpoint::{self, Checkpoint, CheckpointError};
use crate::data::source::RgbImage;
use crate::data::transform::{eval_image, Normalization, Preprocess};
use crate::data::Batch;
use crate::model::{Arch, ModelError, ResNet};
use crate::parallel::ParallelError;
use crate::scores::{non_finite_row, ranking, softmax};
use crate::settings::TrainConfig;
use crate::tensorfile::TensorFile;
use crate::train::Trainer;

/// Side of the input for torchvision weights unless a face says otherwise: their training's.
pub const TORCHVISION_SIZE: u32 = 224;

/// ImageNet-1k's class names in the order of torchvision's classifiers, one a line, written by
/// `scripts/imagenet_classes.py` from torchvision's own metadata.
const IMAGENET_CLASSES: &str = include_str!("imagenet_classes.txt");

#[derive(Debug, thiserror::Error)]
pub enum ClassifyError {
    #[error(transparent)]
    File(#[from] CheckpointError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Parallel(#[from] ParallelError),
    /// Image `image` (counted from 0) gave a logit that is not finite.
    #[error("the model's outputs are not finite ({value}), so it has no prediction for it: the forward pass overflowed (the weights of a run that diverged, or an input far from what they were trained on, do that)")]
    NotFinite { image: usize, value: f32 },
}

/// How a model file classifies: the run its weights are (or, for torchvision's, stand for:
/// classes, image size, batch), whether they are torchvision's, and how an image is brought to
/// the input size (a face may change `cfg.image_size` and `preprocess`).
#[derive(Clone, Debug, PartialEq)]
pub struct Classifier {
    pub cfg: TrainConfig,
    pub torchvision: bool,
    pub preprocess: Preprocess,
}

impl Classifier {
    /// A checkpoint's weights, read and checked whole (`checkpoint::from_file`).
    pub fn checkpoint(file: &TensorFile) -> Result<(Classifier, Checkpoint), ClassifyError> {
        let cfg = checkpoint::check_checkpoint(file)?;
        let weights = checkpoint::from_file(file, &ResNet::new(cfg.arch, cfg.classes)?)?;
        let classifier = Classifier { cfg, torchvision: false, preprocess: Preprocess::Square };
        Ok((classifier, weights))
    }

    /// torchvision weights as a run at step 0 on 224×224 images: the arch their tensors are
    /// (`asked` must agree), the classes `fc`'s rows, every parameter and running statistic
    /// required (read as `train --init` and `grad` read them).
    pub fn torchvision(
        file: &TensorFile,
        asked: Option<Arch>,
    ) -> Result<(Classifier, Checkpoint), ClassifyError> {
        let arch = checkpoint::weights_arch(file, asked)?;
        let classes = checkpoint::classes(file, arch)?;
        let model = ResNet::new(arch, classes)?;
        let (params, running) = checkpoint::load_weights(file, &model, true)?;
        let cfg =
            TrainConfig { arch, image_size: TORCHVISION_SIZE, classes, ..TrainConfig::default() };
        let velocity = vec![0.0; model.param_len];
        let weights = Checkpoint { params, running, velocity, step: 0, settings: cfg.clone() };
        Ok((Classifier { cfg, torchvision: true, preprocess: Preprocess::Torchvision }, weights))
    }

    /// The normalisation of images: ImageNet's for torchvision weights, else the run's; None
    /// for a checkpoint of a run on the synthetic dataset (it never saw an image).
    pub fn norm(&self) -> Option<Normalization> {
        match &self.cfg.images {
            _ if self.torchvision => Some(Normalization::IMAGENET),
            images => images.as_ref().map(|i| i.norm),
        }
    }

    /// The classes' names: a checkpoint's run's, or [`default_class_names`] for torchvision
    /// weights; None for a checkpoint of the synthetic dataset.
    pub fn class_names(&self) -> Option<Vec<String>> {
        match &self.cfg.images {
            _ if self.torchvision => Some(default_class_names(self.cfg.classes as usize)),
            images => images.as_ref().map(|i| i.class_names.clone()),
        }
    }

    /// `img` as the model's input: brought to the input size, normalised by `norm`.
    pub fn input(&self, img: &RgbImage, norm: &Normalization) -> Vec<f32> {
        eval_image(img, self.cfg.image_size, self.preprocess, norm)
    }
}

/// The names of torchvision weights' `k` classes: ImageNet-1k's when there are 1000, else the
/// indices.
pub fn default_class_names(k: usize) -> Vec<String> {
    match k {
        1000 => IMAGENET_CLASSES.lines().map(str::to_string).collect(),
        _ => (0..k).map(|c| c.to_string()).collect(),
    }
}

/// The largest batch, of the run's (halved until it fits), that a device with `limits` holds at
/// `cfg`'s input size; the error of one image where none fits.
pub fn fitting_batch(cfg: &TrainConfig, limits: &wgpu::Limits) -> Result<usize, ClassifyError> {
    let model = ResNet::new(cfg.arch, cfg.classes)?;
    let size = cfg.image_size;
    let mut batch = cfg.batch.max(1);
    loop {
        match crate::step::check_batch_fits(&model, batch as u64, size, size, limits) {
            Ok(()) => return Ok(batch),
            Err(_) if batch > 1 => batch /= 2,
            Err(e) => return Err(ParallelError::Step(e).into()),
        }
    }
}

/// The `top` likeliest classes of each of `inputs` ([`Classifier::input`]) by `trainer`
/// (eval-mode BatchNorm, on its first replica), in batches of one replica's shard: each (class
/// index, probability), likeliest first.
pub async fn top_classes(
    trainer: &mut Trainer,
    inputs: &[Vec<f32>],
    top: usize,
) -> Result<Vec<Vec<(usize, f64)>>, ClassifyError> {
    let (size, k) = (trainer.cfg.image_size, trainer.cfg.classes as usize);
    let shard = trainer.cfg.batch.div_ceil(trainer.replicas.replicas().len()).max(1);
    let mut ranked = Vec::with_capacity(inputs.len());
    for chunk in inputs.chunks(shard) {
        let batch =
            Batch { images: chunk.concat(), labels: vec![0; chunk.len()], h: size, w: size };
        let logits = trainer.replicas.predict(&batch).await?;
        if let Some((row, value)) = non_finite_row(&logits, k) {
            return Err(ClassifyError::NotFinite { image: ranked.len() + row, value });
        }
        for row in logits.chunks(k) {
            let p = softmax(row);
            ranked.push(ranking(row).into_iter().take(top).map(|c| (c, p[c])).collect());
        }
    }
    Ok(ranked)
}
