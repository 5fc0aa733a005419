//! The trainer: steps on batches at the schedule's rate, scores, and checkpoints.

use crate::checkpoint::Checkpoint;
use crate::data::{synthetic_batch, Batch, DataError};
use crate::kernels::Device;
use crate::model::ResNet;
use crate::parallel::{DataParallel, ParallelError, ParallelOptions, Result};
use crate::scores::Scores;
use crate::settings::TrainConfig;
use crate::step::{Shard, StepConfig, StepError};

/// The held-out examples come from another seed stream than the training examples.
const HELD_OUT_SEED: u64 = 0x00e7_a1d0_0075_eed5;

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
    pub fn new(gpu: Device, cfg: TrainConfig, resume: Option<Checkpoint>) -> Result<Trainer> {
        Trainer::data_parallel(vec![gpu], cfg, resume)
    }

    /// The same, data-parallel: replica r on `gpus[r]`, each taking a contiguous shard of every
    /// step's batch (the first batch mod R one image more): the same training, bit for bit.
    pub fn data_parallel(
        gpus: Vec<Device>,
        cfg: TrainConfig,
        resume: Option<Checkpoint>,
    ) -> Result<Trainer> {
        cfg.step.validate().map_err(invalid)?;
        if cfg.batch == 0 {
            return Err(invalid(StepError::NoBatch));
        }
        if gpus.is_empty() {
            return Err(DataError::NoReplicas.into());
        }
        if cfg.batch < gpus.len() {
            return Err(DataError::TooFewExamples { batch: cfg.batch, replicas: gpus.len() }.into());
        }
        ResNet::check_image_size(cfg.image_size, cfg.image_size).map_err(invalid)?;
        let model = ResNet::new(cfg.arch, cfg.classes).map_err(invalid)?;
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

    /// The same trainer as this process's part of a run whose other replicas its `peers` hold.
    pub fn with_peers(self, peers: crate::collective::Peers) -> Trainer {
        Trainer { replicas: self.replicas.with_peers(peers), ..self }
    }

    /// The same trainer all-reducing gradients in buckets of at least `bytes` (any size gives
    /// the same bits).
    pub fn with_bucket_bytes(self, bytes: u64) -> Trainer {
        Trainer { replicas: self.replicas.with_bucket_bytes(bytes), ..self }
    }

    pub fn model(&self) -> &ResNet {
        &self.replicas.replicas()[0].model
    }

    /// The training batch of step `s`.
    pub fn batch_of_step(&self, s: u64) -> Result<Batch> {
        let c = &self.cfg;
        let part = self.part()?;
        let first = s * c.batch as u64 + part.start as u64;
        Ok(synthetic_batch(c.seed, first, part.len(), c.image_size, c.image_size, c.classes)?)
    }

    /// The examples of each step's batch that this process's replicas take (all of them
    /// unless it is one MPI rank of several): what [`train_on`](Self::train_on) is given.
    pub fn part(&self) -> Result<std::ops::Range<usize>> {
        self.replicas.part(self.cfg.batch)
    }

    /// The learning rate of the next step.
    pub fn lr(&self) -> f32 {
        self.cfg.schedule.lr(self.cfg.step.lr, self.step)
    }

    /// One SGD step on the synthetic dataset's next batch; returns its loss.
    pub async fn train_step(&mut self) -> Result<f32> {
        let batch = self.batch_of_step(self.step)?;
        self.train_on(&batch).await
    }

    /// One SGD step on `batch` (this process's [`part`](Self::part) of the step's global batch:
    /// each replica takes its shard) at the schedule's rate; returns its loss (the global
    /// batch's, on every replica).
    pub async fn train_on(&mut self, batch: &Batch) -> Result<f32> {
        let cfg = StepConfig { lr: self.lr(), ..self.cfg.step };
        let at = Shard { start: self.part()?.start as u64, global: self.cfg.batch as u64 };
        let options = ParallelOptions::default();
        let out = self.replicas.forward_backward_part(batch, at, &cfg, options).await?;
        let loss = out[0].loss;
        if !loss.is_finite() {
            return Err(invalid(StepError::NonFiniteLoss { step: self.step, loss }));
        }
        self.replicas.sgd_update(&cfg).await?;
        self.step += 1;
        Ok(loss)
    }

    /// Adds the eval-mode predictions of `batch` (on replica 0; eval-mode logits do not depend
    /// on the batching) to `scores`.
    pub async fn score(&mut self, batch: &Batch, scores: &mut Scores) -> Result<()> {
        let logits = self.replicas.predict(batch).await?;
        if let Some((row, value)) = crate::scores::non_finite_row(&logits, scores.classes) {
            let image = scores.examples + row + 1;
            return Err(invalid(StepError::NonFiniteOutput { image, value }));
        }
        scores.add(&logits, &batch.labels);
        Ok(())
    }

    /// Scores on `examples` held-out images of the synthetic dataset, in batches of one
    /// replica's shard; `progress` is told how many are done after each batch, and ends the
    /// evaluation there by answering false (the scores then hold the part done).
    pub async fn evaluate(
        &mut self,
        examples: usize,
        progress: &mut dyn FnMut(usize) -> bool,
    ) -> Result<Scores> {
        let c = self.cfg.clone();
        let chunk = c.batch.div_ceil(self.replicas.replicas().len()).max(1);
        let mut scores = Scores::new(c.classes);
        while scores.examples < examples {
            let m = chunk.min(examples - scores.examples);
            let batch = synthetic_batch(
                c.seed ^ HELD_OUT_SEED,
                scores.examples as u64,
                m,
                c.image_size,
                c.image_size,
                c.classes,
            )?;
            self.score(&batch, &mut scores).await?;
            if !progress(scores.examples) {
                break;
            }
        }
        Ok(scores)
    }

    /// Everything a bit-exact resume needs. Data-parallel, every replica's state is read and
    /// must agree bit for bit, so a checkpoint never holds one replica's diverged copy.
    pub async fn checkpoint(&self) -> Result<Checkpoint> {
        let one = |all: Vec<Vec<f32>>, what: &'static str| -> Result<Vec<f32>> {
            match all
                .iter()
                .position(|v| v.iter().zip(&all[0]).any(|(a, b)| a.to_bits() != b.to_bits()))
            {
                Some(replica) => Err(invalid(StepError::ReplicasDiffer { replica, what })),
                None => Ok(all.into_iter().next().unwrap_or_default()),
            }
        };
        Ok(Checkpoint {
            params: one(self.replicas.read_params().await?, "parameters")?,
            running: one(self.replicas.read_running().await?, "running statistics")?,
            velocity: one(self.replicas.read_velocity().await?, "momentum")?,
            step: self.step,
            settings: self.cfg.clone(),
        })
    }
}
