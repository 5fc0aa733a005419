//! What each step trains on and at which learning rate, as functions of the step alone: epochs
//! of a seeded shuffle (the last partial batch dropped) and the learning-rate schedule. A
//! resumed run, and every replica of a data-parallel one, computes the same examples and the
//! same rate for a step as an uninterrupted single-device run.

use std::fmt;
use std::str::FromStr;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The shuffle of each epoch comes from another seed stream than the initialisation's.
const SHUFFLE_SEED: u64 = 0x5f1f_f1e5_0000_e90c;

/// Epochs over a training set of `examples` in batches of `batch`, each in the order of a
/// shuffle seeded by (seed, epoch).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Epochs {
    pub examples: usize,
    pub batch: usize,
    pub seed: u64,
}

impl Epochs {
    /// Full batches an epoch holds; the examples left over are not trained on in that epoch
    /// (another shuffle puts other ones last in the next).
    pub fn steps_per_epoch(&self) -> u64 {
        (self.examples / self.batch.max(1)) as u64
    }

    /// Examples of every epoch that no step trains on.
    pub fn dropped(&self) -> usize {
        self.examples % self.batch.max(1)
    }

    /// The epoch step `step` (0-based) belongs to.
    pub fn epoch_of(&self, step: u64) -> u64 {
        step / self.steps_per_epoch().max(1)
    }

    /// The order of the training set's examples in `epoch`.
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.examples).collect();
        let key = self.seed ^ SHUFFLE_SEED ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(key));
        order
    }

    /// The examples step `step` trains on, given its epoch's `order`.
    pub fn examples_of<'a>(&self, step: u64, order: &'a [usize]) -> &'a [usize] {
        let position = (step % self.steps_per_epoch().max(1)) as usize * self.batch;
        &order[position..position + self.batch]
    }
}

/// How the learning rate moves over a run (after the warm-up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LrSchedule {
    /// The base rate throughout.
    Constant,
    /// The base rate, a tenth of it from half the run, a hundredth from three quarters.
    Step,
    /// Half a cosine from the base rate down to 0 at the end of the run.
    Cosine,
}

/// A name that is no [`LrSchedule`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown learning-rate schedule {name:?}: constant, step or cosine")]
pub struct UnknownSchedule {
    pub name: String,
}

impl FromStr for LrSchedule {
    type Err = UnknownSchedule;
    fn from_str(s: &str) -> Result<Self, UnknownSchedule> {
        match s {
            "constant" => Ok(LrSchedule::Constant),
            "step" => Ok(LrSchedule::Step),
            "cosine" => Ok(LrSchedule::Cosine),
            _ => Err(UnknownSchedule { name: s.into() }),
        }
    }
}

impl fmt::Display for LrSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LrSchedule::Constant => "constant",
            LrSchedule::Step => "step",
            LrSchedule::Cosine => "cosine",
        })
    }
}

/// The learning rate of every step of a run of `total_steps`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Schedule {
    pub kind: LrSchedule,
    /// Steps over which the rate climbs linearly to the base rate (the first takes
    /// base/warmup_steps).
    pub warmup_steps: u64,
    /// The run's length the schedule is laid over; steps past it keep the last rate. 0: laid
    /// over no run yet (a `TrainingRun` lays it over its own), and until then the rate after
    /// the warm-up is the base rate.
    pub total_steps: u64,
}

/// The default: 10 steps of warm-up, then half a cosine. On the main job (60 steps of 16
/// synthetic images at 0.01) a constant rate's loss spikes to 3 times its running median and
/// its median ends near where it was at step 40; this one's stays within 1.6 times it and its
/// median ends at half the constant rate's, in the same steps.
impl Default for Schedule {
    fn default() -> Self {
        Schedule { kind: LrSchedule::Cosine, warmup_steps: 10, total_steps: 0 }
    }
}

impl Schedule {
    /// The rate of step `step` (0-based) for a base rate `base`. Computed in f64 with libm, so
    /// every platform gets the same f32.
    pub fn lr(&self, base: f32, step: u64) -> f32 {
        let base = base as f64;
        if step < self.warmup_steps {
            return (base * (step + 1) as f64 / self.warmup_steps as f64) as f32;
        }
        let rate = match self.kind {
            LrSchedule::Constant => base,
            _ if self.total_steps == 0 => base,
            LrSchedule::Step => {
                let total = self.total_steps;
                let passed = (step >= total / 2) as i32 + (step >= total * 3 / 4) as i32;
                base * 0.1f64.powi(passed)
            }
            LrSchedule::Cosine => {
                let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
                let t = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
                base * 0.5 * (1.0 + libm::cos(std::f64::consts::PI * t))
            }
        };
        rate as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_epoch_is_a_permutation_seeded_by_seed_and_epoch() {
        let e = Epochs { examples: 103, batch: 10, seed: 7 };
        assert_eq!((e.steps_per_epoch(), e.dropped()), (10, 3));
        let first = e.order(0);
        let mut sorted = first.clone();
        sorted.sort();
        assert_eq!(sorted, (0..103).collect::<Vec<_>>());
        assert_eq!(first, e.order(0));
        assert_ne!(first, e.order(1));
        assert_ne!(first, Epochs { seed: 8, ..e }.order(0));
        assert_eq!(e.epoch_of(9), 0);
        assert_eq!(e.epoch_of(10), 1);
        assert_eq!(e.examples_of(3, &first), &first[30..40]);
        assert_eq!(e.examples_of(13, &first), &first[30..40]);
    }

    #[test]
    fn warmup_climbs_then_each_schedule_follows_its_shape() {
        let s = Schedule { kind: LrSchedule::Constant, warmup_steps: 4, total_steps: 100 };
        let rates: Vec<f32> = (0..6).map(|i| s.lr(0.4, i)).collect();
        assert_eq!(rates, [0.1, 0.2, 0.3, 0.4, 0.4, 0.4]);
        let step = Schedule { kind: LrSchedule::Step, ..s };
        assert_eq!([step.lr(1.0, 49), step.lr(1.0, 50), step.lr(1.0, 75)], [1.0, 0.1, 0.01f32]);
        let cos = Schedule { kind: LrSchedule::Cosine, ..s };
        assert_eq!(cos.lr(1.0, 4), 1.0);
        assert!((cos.lr(1.0, 52) - 0.5).abs() < 1e-6);
        assert_eq!(cos.lr(1.0, 100), 0.0);
        assert_eq!(cos.lr(1.0, 500), 0.0);
        // Laid over no run yet: the base rate after the warm-up.
        let unlaid = Schedule { total_steps: 0, ..cos };
        assert_eq!([unlaid.lr(1.0, 0), unlaid.lr(1.0, 50)], [0.25, 1.0]);
        let names = ["constant", "step", "cosine"];
        assert!(names.iter().all(|n| n.parse::<LrSchedule>().unwrap().to_string() == *n));
        assert!("linear".parse::<LrSchedule>().is_err());
    }
}
