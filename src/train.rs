//! Training on the embedded synthetic dataset: the step's data schedule (step s trains on
//! examples s·B … s·B + B − 1 of the seeded dataset, so a resumed run sees exactly what an
//! uninterrupted one would), evaluation on held-out examples, and checkpoints.

use std::collections::BTreeMap;

use crate::checkpoint::Checkpoint;
use crate::data::{synthetic_batch, Batch};
use crate::gpu::Gpu;
use crate::model::ResNet34;
use crate::step::{LocalBn, Replica, Result, StepConfig, StepError, StepOptions};

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
    /// The settings a checkpoint records, so a resume can insist on the same data.
    pub fn settings(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("batch".into(), self.batch.to_string()),
            ("image_size".into(), self.image_size.to_string()),
            ("classes".into(), self.classes.to_string()),
            ("seed".into(), self.seed.to_string()),
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

/// A single-device training run.
pub struct Trainer {
    pub replica: Replica,
    pub cfg: TrainConfig,
    /// Steps taken so far (also the position in the data schedule).
    pub step: u64,
}

impl Trainer {
    /// A fresh run (seeded initialisation) or one continuing `resume`.
    pub fn new(gpu: Gpu, cfg: TrainConfig, resume: Option<Checkpoint>) -> Result<Trainer> {
        cfg.step.validate()?;
        if cfg.batch == 0 {
            return Err(StepError::Invalid("batch must be at least 1".into()));
        }
        ResNet34::check_image_size(cfg.image_size, cfg.image_size)?;
        let model = ResNet34::new(cfg.classes)?;
        let (replica, step) = match resume {
            Some(ck) => {
                let r = Replica::new(gpu, model, &ck.params, &ck.running)?;
                r.write_velocity(&ck.velocity)?;
                (r, ck.step)
            }
            None => {
                let params = model.init_params(cfg.seed);
                let running = model.init_buffers();
                (Replica::new(gpu, model, &params, &running)?, 0)
            }
        };
        Ok(Trainer { replica, cfg, step })
    }

    /// The training batch of step `s`.
    pub fn batch_of_step(&self, s: u64) -> Batch {
        let c = &self.cfg;
        synthetic_batch(c.seed, s * c.batch as u64, c.batch, c.image_size, c.image_size, c.classes)
    }

    /// One SGD step on the next batch; returns its loss.
    pub async fn train_step(&mut self) -> Result<f32> {
        let batch = self.batch_of_step(self.step);
        let cfg = self.cfg.step;
        let out = self.replica.forward_backward(&batch, &cfg, batch.len() as f32, &LocalBn, StepOptions::default()).await?;
        if !out.loss.is_finite() {
            return Err(StepError::Invalid(format!("the loss became {} at step {}: lower the learning rate", out.loss, self.step)));
        }
        self.replica.sgd_update(&cfg).await?;
        self.step += 1;
        Ok(out.loss)
    }

    /// Accuracy on `examples` held-out images (eval-mode BatchNorm), in batches of the
    /// training batch size.
    pub async fn evaluate(&mut self, examples: usize) -> Result<Evaluation> {
        let c = self.cfg;
        let mut correct = 0;
        let mut done = 0;
        while done < examples {
            let m = c.batch.min(examples - done);
            let batch = synthetic_batch(c.seed ^ HELD_OUT_SEED, done as u64, m, c.image_size, c.image_size, c.classes);
            let logits = self.replica.predict(&batch).await?;
            let k = c.classes as usize;
            correct += batch.labels.iter().enumerate().filter(|&(i, &y)| argmax(&logits[i * k..(i + 1) * k]) == y as usize).count();
            done += m;
        }
        Ok(Evaluation { examples, correct })
    }

    /// Everything a bit-exact resume needs.
    pub async fn checkpoint(&self) -> Result<Checkpoint> {
        Ok(Checkpoint {
            params: self.replica.read_params().await?,
            running: self.replica.read_running().await?,
            velocity: self.replica.read_velocity().await?,
            step: self.step,
            settings: self.cfg.settings(),
        })
    }
}

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().fold(0, |best, (i, &x)| if x > v[best] { i } else { best })
}
