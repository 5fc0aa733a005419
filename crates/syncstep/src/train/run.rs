//! A training run from its first step to its last: the loop, when checkpoints are kept and
//! epochs scored, the divergence guard, and a stop asked for between steps. The faces (the
//! command line, the page) drive it through [`RunHooks`]: they supply the batches and decide
//! what to show, where to write and when to stop, and every face gets the same guard.

use super::trainer::Trainer;
use crate::checkpoint::{self, Checkpoint};
use crate::data::schedule::Epochs;
use crate::data::Batch;
use crate::parallel::ParallelError;
use crate::step::StepError;

/// Steps between checkpoints unless a face says otherwise.
pub const CHECKPOINT_EVERY: u64 = 10;
/// A run diverges when its loss passes this many times its first step's.
pub const DIVERGED: f32 = 100.0;

/// How long a run lasts and how often it keeps and scores.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RunPlan {
    /// The step the run ends after (counted from the start of training, a resumed run's
    /// earlier steps included).
    pub last: u64,
    /// Steps between checkpoints; 0 keeps one only at the end and when stopped.
    pub checkpoint_every: u64,
    /// The epochs over the training split, whose ends are scored; None for the synthetic
    /// dataset, which has none.
    pub epochs: Option<Epochs>,
}

/// Why a run is taken to have diverged.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Divergence {
    #[error("its loss became {loss}")]
    NonFiniteLoss { loss: f32 },
    #[error("its loss rose to {loss:e}, over {DIVERGED} times the first step's ({first:.4})")]
    LossRose { loss: f32, first: f32 },
    /// A tensor holds what a healthy run never does ([`checkpoint::unhealthy`]): a step's loss
    /// shows the update before it, this the last one.
    #[error("`{tensor}` element {index} became {value:e}, not finite or past ±{:e} (where its square overflows f32)", f32::MAX.sqrt())]
    Unhealthy { tensor: String, index: usize, value: f32 },
}

/// A run that diverged at `step`; the last checkpoint kept before it is good.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("the run diverged at step {step}: {why}")]
pub struct Diverged {
    pub step: u64,
    pub why: Divergence,
}

/// What ends a run early: the run's own failure, or its face's (`E`, the hooks' error).
#[derive(Debug)]
pub enum RunError<E> {
    Diverged(Diverged),
    Parallel(ParallelError),
    Face(E),
}

impl<E: std::fmt::Display> std::fmt::Display for RunError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::Diverged(d) => d.fmt(f),
            RunError::Parallel(e) => e.fmt(f),
            RunError::Face(e) => e.fmt(f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for RunError<E> {}

impl<E> From<ParallelError> for RunError<E> {
    fn from(e: ParallelError) -> Self {
        RunError::Parallel(e)
    }
}

/// Why a checkpoint is handed to [`RunHooks::keep`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    /// The plan's cadence.
    Due,
    /// A stop was asked for after this step.
    Stopped,
    /// The run's last step is done.
    Final,
}

/// A step done, for the face to show.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepDone {
    /// Steps taken so far, this one included.
    pub step: u64,
    /// The epoch this step belongs to (0 for the synthetic dataset).
    pub epoch: u64,
    pub lr: f32,
    pub loss: f32,
}

/// How a run ended without an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunEnd {
    /// Its last step is done and its state kept.
    Finished,
    /// A face asked it to stop with `code` ([`RunHooks::stop_code`]); `step` is the last done.
    Stopped { code: u64, step: u64 },
}

/// What a face supplies to a run and does at each of its points. Every method but
/// [`batch`](Self::batch) has a default that does nothing.
pub trait RunHooks {
    type Error;

    /// This process's part ([`Trainer::part`]) of the batch of step `trainer.step`.
    fn batch(&mut self, trainer: &Trainer) -> Result<Batch, Self::Error>;

    /// After every step.
    fn stepped(&mut self, _trainer: &Trainer, _done: &StepDone) -> Result<(), Self::Error> {
        Ok(())
    }

    /// After a step that ended epoch `epoch`: where a face scores its validation split.
    fn epoch_ended(&mut self, _trainer: &mut Trainer, _epoch: u64) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Whether this face keeps checkpoints as they fall due; the run's final state is read
    /// and checked either way.
    fn keeps_checkpoints(&self) -> bool {
        false
    }

    /// A checkpoint to keep, healthy; the run's step is `ck.step`.
    fn keep(
        &mut self,
        _trainer: &Trainer,
        _ck: &Checkpoint,
        _why: Keep,
    ) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Nonzero asks the run to stop after the step just done (a signal, a button). Under MPI
    /// every rank stops when any one asks, with the largest code.
    fn stop_code(&mut self) -> u64 {
        0
    }
}

/// A run under way: its trainer, its plan, and the losses of the steps it took.
pub struct TrainingRun {
    pub trainer: Trainer,
    pub plan: RunPlan,
    losses: Vec<f32>,
}

impl TrainingRun {
    pub fn new(mut trainer: Trainer, plan: RunPlan) -> TrainingRun {
        // A schedule laid over no run yet (the default's) is laid over this one.
        let schedule = &mut trainer.cfg.schedule;
        if schedule.total_steps == 0 {
            schedule.total_steps = plan.last;
        }
        TrainingRun { trainer, plan, losses: Vec::new() }
    }

    /// The losses of the steps this run took (not a resumed run's earlier ones).
    pub fn losses(&self) -> &[f32] {
        &self.losses
    }

    /// The epoch of the step just done.
    pub fn epoch(&self) -> u64 {
        self.plan.epochs.map_or(0, |e| e.epoch_of(self.trainer.step.saturating_sub(1)))
    }

    /// Whether the step just done ended an epoch.
    pub fn at_epoch_end(&self) -> bool {
        let ended = |e: Epochs| self.trainer.step.is_multiple_of(e.steps_per_epoch());
        self.trainer.step > 0 && self.plan.epochs.is_some_and(ended)
    }

    /// Steps until the plan's last, then its final state checked and kept; or the stop a
    /// face asked for, its state kept; or the error that ended it.
    pub async fn run<H: RunHooks>(&mut self, hooks: &mut H) -> Result<RunEnd, RunError<H::Error>> {
        while self.trainer.step < self.plan.last {
            let stop = self.step(hooks).await?;
            if stop != 0 {
                return Ok(RunEnd::Stopped { code: stop, step: self.trainer.step });
            }
        }
        let ck = self.healthy_checkpoint().await?;
        hooks.keep(&self.trainer, &ck, Keep::Final).map_err(RunError::Face)?;
        Ok(RunEnd::Finished)
    }

    /// One step: trained, guarded, shown, scored when it ends an epoch, and kept when a
    /// checkpoint is due or a stop was asked for (whose code it returns; 0 for none).
    async fn step<H: RunHooks>(&mut self, hooks: &mut H) -> Result<u64, RunError<H::Error>> {
        let batch = hooks.batch(&self.trainer).map_err(RunError::Face)?;
        let lr = self.trainer.lr();
        let loss = self.train_on(&batch).await?;
        let done = StepDone { step: self.trainer.step, epoch: self.epoch(), lr, loss };
        hooks.stepped(&self.trainer, &done).map_err(RunError::Face)?;
        if self.at_epoch_end() {
            hooks.epoch_ended(&mut self.trainer, done.epoch).map_err(RunError::Face)?;
        }
        let asked = hooks.stop_code();
        let peers = self.trainer.replicas.peers();
        let stop = peers.max(asked).map_err(|e| ParallelError::Step(StepError::Collective(e)))?;
        let every = self.plan.checkpoint_every;
        let due = every > 0 && done.step.is_multiple_of(every) && done.step < self.plan.last;
        if (stop != 0 || due) && hooks.keeps_checkpoints() {
            let ck = self.healthy_checkpoint().await?;
            let why = if stop != 0 { Keep::Stopped } else { Keep::Due };
            hooks.keep(&self.trainer, &ck, why).map_err(RunError::Face)?;
        }
        Ok(stop)
    }

    /// The loss of a step on `batch`; diverged when it is not finite or rose past
    /// [`DIVERGED`] times the first step's.
    async fn train_on<E>(&mut self, batch: &Batch) -> Result<f32, RunError<E>> {
        let loss = match self.trainer.train_on(batch).await {
            Ok(loss) => loss,
            Err(ParallelError::Step(StepError::NonFiniteLoss { loss, .. })) => {
                let why = Divergence::NonFiniteLoss { loss };
                return Err(RunError::Diverged(Diverged { step: self.trainer.step + 1, why }));
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(&first) = self.losses.first().filter(|&&first| loss > DIVERGED * first) {
            let why = Divergence::LossRose { loss, first };
            return Err(RunError::Diverged(Diverged { step: self.trainer.step, why }));
        }
        self.losses.push(loss);
        Ok(loss)
    }

    /// The run's state; diverged when a tensor holds what a healthy run never does.
    pub async fn healthy_checkpoint<E>(&self) -> Result<Checkpoint, RunError<E>> {
        let ck = self.trainer.checkpoint().await?;
        if let Some((tensor, index, value)) = checkpoint::unhealthy(self.trainer.model(), &ck) {
            let why = Divergence::Unhealthy { tensor, index, value };
            return Err(RunError::Diverged(Diverged { step: ck.step, why }));
        }
        Ok(ck)
    }
}
