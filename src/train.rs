//! Training on the embedded synthetic dataset: the step's data schedule (step s trains on
//! examples s·B … s·B + B − 1 of the seeded dataset, so a resumed run sees exactly what an
//! uninterrupted one would), evaluation on held-out examples, and checkpoints. On one device
//! or data-parallel on R (each taking a shard of every batch, BatchNorm synchronised): the same
//! schedule, and the same parameters step for step, bit for bit.

use std::collections::BTreeMap;

use crate::checkpoint::Checkpoint;
use crate::data::{synthetic_batch, Batch, DataError};
use crate::gpu::Gpu;
use crate::model::ResNet34;
use crate::parallel::{DataParallel, ParallelError, ParallelOptions, Result};
use crate::step::{StepConfig, StepError};

/// The held-out examples come from another seed stream than the training examples.
const HELD_OUT_SEED: u64 = 0x00e7_a1d0_0075_eed5;

/// What a run is: the data it sees and the step's hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainConfig {
    pub batch: usize,
    pub image_size: u32,
    pub classes: u32,
    pub seed: u64,
    pub step: StepConfig,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig { batch: 16, image_size: 32, classes: 10, seed: 0, step: StepConfig::default() }
    }
}

impl TrainConfig {
    /// The settings a checkpoint records (`checkpoint::REQUIRED_SETTINGS`), so that a resume
    /// can insist on the same run: the data, and the step's hyper-parameters (f32s written so
    /// that they read back exactly).
    pub fn settings(&self) -> BTreeMap<String, String> {
        let s = &self.step;
        BTreeMap::from([
            ("batch".into(), self.batch.to_string()),
            ("image_size".into(), self.image_size.to_string()),
            ("classes".into(), self.classes.to_string()),
            ("seed".into(), self.seed.to_string()),
            ("lr".into(), s.lr.to_string()),
            ("momentum".into(), s.momentum.to_string()),
            ("weight_decay".into(), s.weight_decay.to_string()),
            ("label_smoothing".into(), s.label_smoothing.to_string()),
            ("bn_momentum".into(), s.bn_momentum.to_string()),
        ])
    }
}

/// How many held-out examples the model classified correctly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    pub examples: usize,
    pub correct: usize,
}

impl Evaluation {
    pub fn accuracy(&self) -> f64 {
        self.correct as f64 / self.examples.max(1) as f64
    }
}

/// A training run on one device or data-parallel on several.
pub struct Trainer {
    pub replicas: DataParallel,
    pub cfg: TrainConfig,
    /// Steps taken so far (also the position in the data schedule).
    pub step: u64,
}

/// A configuration error: no replica's.
fn invalid(e: impl Into<StepError>) -> ParallelError {
    ParallelError::Step(e.into())
}

impl Trainer {
    /// A fresh run (seeded initialisation) or one continuing `resume`, on one device.
    pub fn new(gpu: Gpu, cfg: TrainConfig, resume: Option<Checkpoint>) -> Result<Trainer> {
        Trainer::data_parallel(vec![gpu], cfg, resume)
    }

    /// The same, data-parallel: replica r on `gpus[r]`, each taking a contiguous shard of every
    /// step's batch (the first batch mod R one image more): the same training, bit for bit.
    pub fn data_parallel(
        gpus: Vec<Gpu>,
        cfg: TrainConfig,
        resume: Option<Checkpoint>,
    ) -> Result<Trainer> {
        cfg.step.validate().map_err(invalid)?;
        if cfg.batch == 0 {
            return Err(invalid(StepError::Invalid("batch must be at least 1".into())));
        }
        if gpus.is_empty() {
            return Err(DataError::NoReplicas.into());
        }
        if cfg.batch < gpus.len() {
            return Err(DataError::TooFewExamples { batch: cfg.batch, replicas: gpus.len() }.into());
        }
        ResNet34::check_image_size(cfg.image_size, cfg.image_size).map_err(invalid)?;
        let model = ResNet34::new(cfg.classes).map_err(invalid)?;
        model
            .check_training_batch(cfg.batch as u64, cfg.image_size, cfg.image_size)
            .map_err(invalid)?;
        // The largest shard on each replica's device; evaluation runs batches of the same size.
        let shard = cfg.batch.div_ceil(gpus.len()) as u64;
        for gpu in &gpus {
            crate::step::check_batch_fits(
                &model,
                shard.max(1),
                cfg.image_size,
                cfg.image_size,
                &gpu.limits,
            )
            .map_err(invalid)?;
        }
        let (replicas, step) = match resume {
            Some(ck) => {
                let dp = DataParallel::from_gpus(gpus, &model, &ck.params, &ck.running)?;
                dp.write_velocity(&ck.velocity)?;
                (dp, ck.step)
            }
            None => (
                DataParallel::from_gpus(
                    gpus,
                    &model,
                    &model.init_params(cfg.seed),
                    &model.init_buffers(),
                )?,
                0,
            ),
        };
        Ok(Trainer { replicas, cfg, step })
    }

    pub fn model(&self) -> &ResNet34 {
        &self.replicas.replicas()[0].model
    }

    /// The training batch of step `s`.
    pub fn batch_of_step(&self, s: u64) -> Result<Batch, DataError> {
        let c = &self.cfg;
        synthetic_batch(c.seed, s * c.batch as u64, c.batch, c.image_size, c.image_size, c.classes)
    }

    /// One SGD step on the next batch; returns its loss (the global batch's, on every replica).
    pub async fn train_step(&mut self) -> Result<f32> {
        let batch = self.batch_of_step(self.step)?;
        let cfg = self.cfg.step;
        let out = self.replicas.forward_backward(&batch, &cfg, ParallelOptions::default()).await?;
        let loss = out[0].loss;
        if !loss.is_finite() {
            return Err(invalid(StepError::NonFiniteLoss { step: self.step, loss }));
        }
        self.replicas.sgd_update(&cfg).await?;
        self.step += 1;
        Ok(loss)
    }

    /// Accuracy on `examples` held-out images (eval-mode BatchNorm, on replica 0), in batches of
    /// one replica's shard (eval-mode logits do not depend on the batching); `progress` is told
    /// how many are done after each batch.
    pub async fn evaluate(
        &mut self,
        examples: usize,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Evaluation> {
        let c = self.cfg;
        let chunk = c.batch.div_ceil(self.replicas.replicas().len()).max(1);
        let mut correct = 0;
        let mut done = 0;
        while done < examples {
            let m = chunk.min(examples - done);
            let batch = synthetic_batch(
                c.seed ^ HELD_OUT_SEED,
                done as u64,
                m,
                c.image_size,
                c.image_size,
                c.classes,
            )?;
            let logits = self.replicas.predict(&batch).await?;
            let k = c.classes as usize;
            correct += batch
                .labels
                .iter()
                .enumerate()
                .filter(|&(i, &y)| argmax(&logits[i * k..(i + 1) * k]) == y as usize)
                .count();
            done += m;
            progress(done);
        }
        Ok(Evaluation { examples, correct })
    }

    /// Everything a bit-exact resume needs. Data-parallel, every replica's state is read and
    /// must agree bit for bit, so a checkpoint never holds one replica's diverged copy.
    pub async fn checkpoint(&self) -> Result<Checkpoint> {
        let one = |all: Vec<Vec<f32>>, what: &str| -> Result<Vec<f32>> {
            match all
                .iter()
                .position(|v| v.iter().zip(&all[0]).any(|(a, b)| a.to_bits() != b.to_bits()))
            {
                Some(r) => Err(invalid(StepError::Invalid(format!(
                    "replica {r}'s {what} differ from replica 0's: not writing a checkpoint"
                )))),
                None => Ok(all.into_iter().next().unwrap_or_default()),
            }
        };
        Ok(Checkpoint {
            params: one(self.replicas.read_params().await?, "parameters")?,
            running: one(self.replicas.read_running().await?, "running statistics")?,
            velocity: one(self.replicas.read_velocity().await?, "momentum")?,
            step: self.step,
            settings: self.cfg.settings(),
        })
    }
}

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().fold(0, |best, (i, &x)| if x > v[best] { i } else { best })
}
