//! Training. The trainer (trainer.rs) steps on batches (the embedded synthetic dataset's own
//! schedule, step s on examples s·B … s·B + B − 1, or batches a `data::loader` makes from
//! images) at the rate of the learning-rate schedule, scores on held-out examples, and
//! checkpoints that record every setting a bit-exact resume needs; on one device or
//! data-parallel on R (each taking a shard of every batch, BatchNorm synchronised), the same
//! parameters step for step, bit for bit. The training run (run.rs) drives it from the first
//! step to the last for the command line and the page alike, and loss.rs says what a run's
//! loss is doing.

mod loss;
mod run;
mod trainer;

pub use crate::settings::{ImageSettings, TrainConfig, HELD_OUT_EXAMPLES, VAL_SPLIT};
pub use loss::{loss_course, median, smoothed_loss, smoothed_losses, LossCourse, LOSS_WINDOW};
pub use run::{
    Diverged, Divergence, Keep, RunEnd, RunError, RunHooks, RunPlan, StepDone, TrainingRun,
    CHECKPOINT_EVERY, DIVERGED,
};
pub use trainer::Trainer;
