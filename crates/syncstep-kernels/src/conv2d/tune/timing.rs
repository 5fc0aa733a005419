//! The autotune's clock: timing candidates on the device (natively only: a browser has no
//! clock).
//!
//! wgpu has no clock inside shaders, so each run is one submission measured to completion with
//! the host's clock, holding enough launches of a short kernel that the submit and wait round
//! trip is small beside them. Other work on the machine only ever adds time, and comes and goes:
//! the candidates are timed in interleaved rounds, each keeps its fastest run, and a choice whose
//! fastest runs were not reproduced is provisional, timed again by the next process ([`tune`]).

use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::conv2d::{conv2d_launch_with, Conv2dAlgo, Conv2dOp, Conv2dShape, Device};
use crate::{KernelError, Result};
use syncstep_gpu::{launches_to_fill, Encoder, GpuError, Slice};

/// A choice, and the timings it was made from (so that a reader of the cache sees why).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct Tuned {
    pub(super) algo: Conv2dAlgo,
    /// Whether the timings were quiet enough to keep the choice for good. A provisional choice
    /// serves the process that made it; the next one times the candidates again.
    pub(super) settled: bool,
    /// Every candidate timed, fastest first.
    pub(super) timings: Vec<Timing>,
}

/// One candidate's timed runs, summed up.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct Timing {
    pub(super) algo: Conv2dAlgo,
    /// Its fastest run, in microseconds per launch.
    pub(super) best_us: f64,
    /// Its slowest run over its fastest: how much other work disturbed it.
    pub(super) spread: f64,
    /// How many runs were timed: fewer than the winner's when it was [`PRUNE`] times as slow,
    /// or no contender in the extra rounds.
    pub(super) runs: usize,
}

/// Rounds in which every candidate within [`PRUNE`] of the fastest is timed, in turns (A B C …
/// A B C …), so that a burst of other work slows a run of each rather than every run of one.
pub(super) const ROUNDS: usize = 3;
/// Rounds more, of the contenders only, while the timings cannot tell them apart.
pub(super) const EXTRA_ROUNDS: usize = 2;
/// The most a candidate's second fastest run may exceed its fastest for the fastest to count as
/// reproduced. Above it, other work was disturbing the runs; below it, a lead smaller than the
/// noise is a near tie, where either choice costs at most the noise.
pub(super) const QUIET: f64 = 1.25;
/// Candidates this many times slower than the fastest are timed no more: they cannot win, and
/// each of their runs costs as much as this many of the fastest's.
pub(super) const PRUNE: u32 = 10;
/// The least a timed submission runs: short kernels are launched several times in one
/// (as many for every candidate of a shape; see `launches_to_fill`).
pub(super) const MIN_SUBMIT: Duration = Duration::from_millis(2);

/// A timing source: `launches` launches of candidate `algo` in one submission, the time per
/// launch. On a device, its clock ([`fastest`]); in the tests, made-up figures.
pub(super) type Clock<'a> = dyn FnMut(Conv2dAlgo, u32) -> Result<Duration> + 'a;

/// The fastest of `candidates` for `op` at `s`, timed on `gpu` by [`tune`].
pub(super) fn fastest(
    gpu: &Device,
    op: Conv2dOp,
    s: &Conv2dShape,
    candidates: &[Conv2dAlgo],
) -> Result<Tuned> {
    // One tuning at a time per process: concurrent ones would time each other.
    static TUNING: Mutex<()> = Mutex::new(());
    let _one = TUNING.lock().unwrap_or_else(|p| p.into_inner());
    // The candidates' scratch (an im2col chunk the choice may never use) would otherwise stay
    // held for the device's life.
    gpu.scratch_as_before(|| {
        let gpu_err = |source| KernelError::Gpu { op: op.name(), source };
        let [input, second, output] = s.operand_lens(op);
        let input = gpu.buffer("autotune input", input).map_err(gpu_err)?;
        let second = gpu.buffer("autotune second input", second).map_err(gpu_err)?;
        let output = gpu.buffer("autotune output", output).map_err(gpu_err)?;
        let [input, second, output] = [&input, &second, &output].map(Slice::whole);
        let mut clock = |algo: Conv2dAlgo, launches: u32| -> Result<Duration> {
            let launch = |enc: &mut Encoder| {
                conv2d_launch_with(gpu, enc, op, algo, s, input, second, output)
            };
            gpu.time_recorded(launches, launch, gpu_err)
        };
        gpu.wait().map_err(gpu_err)?; // the caller's work in flight is not ours to time
        let tuned = tune(candidates, &mut clock)?;
        log::debug!("autotune {} {s:?}: {tuned:?}", op.name());
        Ok(tuned)
    })
}

/// The fastest of `candidates` by `clock`: [`ROUNDS`] interleaved rounds, each candidate's
/// figure its fastest run (other work only ever adds time); then, while [`Verdict::undecided`],
/// up to [`EXTRA_ROUNDS`] of the contenders. The choice is settled if [`Verdict::settled`].
/// Blocked, settled, when every candidate is refused.
pub(super) fn tune(candidates: &[Conv2dAlgo], clock: &mut Clock<'_>) -> Result<Tuned> {
    let (mut timed, launches) = first_round(candidates, clock)?;
    for _ in 1..ROUNDS {
        let contenders = within(&timed, PRUNE as f64);
        round(&mut timed, contenders, launches, clock)?;
    }
    let mut verdict = judge(&timed);
    for _ in 0..EXTRA_ROUNDS {
        if !verdict.undecided() {
            break;
        }
        let contenders = within(&timed, verdict.noise).max(2);
        round(&mut timed, contenders, launches, clock)?;
        verdict = judge(&timed);
    }
    Ok(Tuned {
        algo: timed.first().map_or(Conv2dAlgo::Blocked, |r| r.algo),
        settled: verdict.settled(),
        timings: timed.iter().map(Runs::timing).collect(),
    })
}

/// One candidate's timed runs, per launch.
#[derive(Debug)]
struct Runs {
    algo: Conv2dAlgo,
    runs: Vec<Duration>,
}

impl Runs {
    fn best(&self) -> Duration {
        self.runs.iter().copied().min().unwrap_or(Duration::MAX)
    }

    /// Its second fastest run over its fastest: whether the fastest was reproduced. 1 with one
    /// run (a candidate [`PRUNE`]d, which the noise of others' runs decides for).
    fn noise(&self) -> f64 {
        let mut sorted = self.runs.clone();
        sorted.sort();
        sorted.get(1).map_or(1.0, |&second| ratio(second, sorted[0]))
    }

    fn timing(&self) -> Timing {
        let slowest = self.runs.iter().copied().max().unwrap_or_default();
        Timing {
            algo: self.algo,
            // To the nanosecond: finer is noise.
            best_us: (self.best().as_secs_f64() * 1e9).round() / 1e3,
            spread: (ratio(slowest, self.best()) * 1e3).round() / 1e3,
            runs: self.runs.len(),
        }
    }
}

/// `a / b`, finite whatever the figures a clock gives.
fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64().max(1e-12)
}

/// Round one, candidate after candidate: an untimed run (whose JIT compile can take longer than
/// ten runs on lavapipe), then a timed one. The first candidate's second untimed run sets the
/// launches per submission, the same for all so that each times the same work; a candidate the
/// device refuses (a limit, a scratch buffer too large) is left out. Sorted fastest first.
fn first_round(candidates: &[Conv2dAlgo], clock: &mut Clock<'_>) -> Result<(Vec<Runs>, u32)> {
    let mut launches = 0;
    let mut timed = Vec::new();
    for &algo in candidates {
        match clock(algo, 1) {
            Ok(_) => {}
            // Any other refusal is a bug here, not the variant's.
            Err(KernelError::Arg { arg: "algo", .. })
            | Err(KernelError::Gpu { source: GpuError::Limit { .. }, .. }) => continue,
            Err(e) => return Err(e),
        };
        if launches == 0 {
            launches = launches_to_fill(MIN_SUBMIT, clock(algo, 1)?);
        }
        timed.push(Runs { algo, runs: vec![clock(algo, launches)?] });
    }
    timed.sort_by_key(Runs::best);
    Ok((timed, launches))
}

/// How many of `timed` (fastest first) are within `factor` of the fastest.
fn within(timed: &[Runs], factor: f64) -> usize {
    let limit = timed.first().map_or(Duration::ZERO, |r| r.best().mul_f64(factor));
    timed.iter().take_while(|r| r.best() <= limit).count()
}

/// Times the first `count` of `timed` (fastest first) once more each, in turns, and sorts them
/// again.
fn round(timed: &mut [Runs], count: usize, launches: u32, clock: &mut Clock<'_>) -> Result<()> {
    for r in timed.iter_mut().take(count) {
        r.runs.push(clock(r.algo, launches)?);
    }
    timed.sort_by_key(Runs::best);
    Ok(())
}

/// What the timings say about the fastest candidate against the runner-up.
#[derive(Debug, PartialEq)]
struct Verdict {
    /// The runner-up's figure over the winner's (infinite when nothing else was timed).
    lead: f64,
    /// The larger [`Runs::noise`] of the two.
    noise: f64,
}

impl Verdict {
    /// Another round could change or confirm the choice: the fastest runs were not reproduced,
    /// or the winner's lead is within the noise.
    fn undecided(&self) -> bool {
        self.noise > QUIET || self.lead < self.noise
    }

    /// The figures are to be trusted: both fastest runs reproduced within [`QUIET`]. A lead
    /// within that noise is a near tie and settles too: a candidate whose timings tie with the
    /// winner's would otherwise be timed again in every process.
    fn settled(&self) -> bool {
        self.noise <= QUIET
    }
}

/// The verdict on `timed`, fastest first.
fn judge(timed: &[Runs]) -> Verdict {
    match timed {
        [winner, runner_up, ..] => Verdict {
            lead: ratio(runner_up.best(), winner.best()),
            noise: winner.noise().max(runner_up.noise()),
        },
        // Nothing to tell apart.
        _ => Verdict { lead: f64::INFINITY, noise: 1.0 },
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::cell::Cell;
    use std::collections::HashMap;

    use super::*;
    use crate::conv2d::GEMM_TILES;

    /// Three candidates: Blocked and two register tiles.
    pub(in crate::conv2d) fn three() -> [Conv2dAlgo; 3] {
        [Conv2dAlgo::Blocked, Conv2dAlgo::Gemm(GEMM_TILES[0]), Conv2dAlgo::Gemm(GEMM_TILES[2])]
    }

    /// A clock of made-up figures, counting its runs in `runs`: each candidate takes its
    /// microseconds per launch in `speeds` (one missing is refused, as a device refuses a
    /// variant), times `load(algo, k)` on its k-th timed run; untimed runs (one launch, where
    /// the timed ones hold many at these speeds) take the plain figure.
    pub(in crate::conv2d) fn made_up<'a>(
        speeds: &'a [(Conv2dAlgo, f64)],
        load: &'a dyn Fn(Conv2dAlgo, usize) -> f64,
        runs: &'a Cell<usize>,
    ) -> impl FnMut(Conv2dAlgo, u32) -> Result<Duration> + 'a {
        let mut timed: HashMap<Conv2dAlgo, usize> = HashMap::new();
        move |algo, launches| {
            runs.set(runs.get() + 1);
            let Some(&(_, us)) = speeds.iter().find(|(a, _)| *a == algo) else {
                let problem = "refused".to_string();
                return Err(KernelError::Arg { op: "conv2d", arg: "algo", problem });
            };
            let load = match launches {
                1 => 1.0,
                _ => {
                    let k = timed.entry(algo).or_default();
                    *k += 1;
                    load(algo, *k - 1)
                }
            };
            Ok(Duration::from_secs_f64(us * load * 1e-6))
        }
    }

    /// Load on every run, no two runs of a candidate within [`QUIET`] of each other, over all
    /// the runs the tuner may take of it.
    pub(in crate::conv2d) fn noisy(_: Conv2dAlgo, k: usize) -> f64 {
        [1.7, 1.0, 2.9, 1.3, 2.2][k % 5]
    }

    pub(in crate::conv2d) fn quiet(_: Conv2dAlgo, _: usize) -> f64 {
        1.0
    }

    /// The truly fastest candidate, slowed 3× by other work while the first round timed it, is
    /// still chosen, and for good: its later runs reproduce its figure.
    #[test]
    fn a_candidate_slowed_in_one_round_still_wins() {
        let [next, fast, slow] = three();
        let speeds = [(next, 12.0), (fast, 10.0), (slow, 25.0)];
        let runs = Cell::new(0);
        let slowed_once = |a, k| if a == fast && k == 0 { 3.0 } else { 1.0 };
        let mut clock = made_up(&speeds, &slowed_once, &runs);
        let tuned = tune(&[next, fast, slow], &mut clock).unwrap();
        assert_eq!((tuned.algo, tuned.settled), (fast, true), "{tuned:?}");
        let shown = &tuned.timings[0];
        assert_eq!(
            (shown.algo, shown.best_us, shown.spread, shown.runs),
            (fast, 10.0, 3.0, ROUNDS)
        );
        let order: Vec<Conv2dAlgo> = tuned.timings.iter().map(|t| t.algo).collect();
        assert_eq!(order, [fast, next, slow], "fastest first");
    }

    /// Timings noisy throughout: the fastest figure is taken, but the choice is provisional,
    /// after a bounded number of extra rounds.
    #[test]
    fn noisy_timings_make_a_provisional_choice_in_bounded_time() {
        let [fast, next, slow] = three();
        let speeds = [(fast, 10.0), (next, 10.5), (slow, 30.0)];
        let runs = Cell::new(0);
        let tuned = tune(&[slow, next, fast], &mut made_up(&speeds, &noisy, &runs)).unwrap();
        assert_eq!((tuned.algo, tuned.settled), (fast, false), "{tuned:?}");
        assert_eq!(tuned.timings[0].runs, ROUNDS + EXTRA_ROUNDS, "{tuned:?}");
        let bound = 1 + speeds.len() * (1 + ROUNDS + EXTRA_ROUNDS);
        assert!(runs.get() <= bound, "{} runs", runs.get());
        // The same candidates quiet: settled, though the runner-up is within 5%.
        let quietly = tune(&[slow, next, fast], &mut made_up(&speeds, &quiet, &runs)).unwrap();
        assert_eq!((quietly.algo, quietly.settled), (fast, true), "{quietly:?}");
    }

    /// A candidate more than PRUNE times the fastest's time is timed once; one the device
    /// refuses is left out; nothing timed at all is Blocked.
    #[test]
    fn far_slower_candidates_are_timed_once_and_refused_ones_left_out() {
        let [fast, far, refused] = three();
        let speeds = [(fast, 10.0), (far, 150.0)];
        let runs = Cell::new(0);
        let tuned = tune(&[far, refused, fast], &mut made_up(&speeds, &quiet, &runs)).unwrap();
        let runs_of: Vec<(Conv2dAlgo, usize)> =
            tuned.timings.iter().map(|t| (t.algo, t.runs)).collect();
        assert_eq!(runs_of, [(fast, ROUNDS), (far, 1)]);
        assert!(tuned.settled);
        let none = tune(&[refused], &mut made_up(&speeds, &quiet, &runs)).unwrap();
        assert_eq!((none.algo, none.settled, none.timings.len()), (Conv2dAlgo::Blocked, true, 0));
    }

    /// Extra rounds while the order is within the noise, or the fastest runs not reproduced;
    /// settled once they are reproduced, a near tie included.
    #[test]
    fn the_verdict_weighs_the_lead_against_the_noise() {
        let verdict = |lead, noise| Verdict { lead, noise };
        let (undecided, settled) = (Verdict::undecided, Verdict::settled);
        assert!(!undecided(&verdict(1.5, 1.05)) && settled(&verdict(1.5, 1.05)));
        assert!(undecided(&verdict(1.02, 1.05)) && settled(&verdict(1.02, 1.05)));
        assert!(undecided(&verdict(3.0, 1.4)) && !settled(&verdict(3.0, 1.4)));
        let runs = |algo, us: &[u64]| Runs {
            algo,
            runs: us.iter().map(|&us| Duration::from_micros(us)).collect(),
        };
        let [a, b, _] = three();
        // The winner's slow first run does not count as noise; the runner-up's second does.
        let judged = judge(&[runs(a, &[30, 10, 11]), runs(b, &[12, 15])]);
        let close = |x: f64, y: f64| (x - y).abs() < 1e-9;
        assert!(close(judged.lead, 1.2) && close(judged.noise, 1.25), "{judged:?}");
        assert_eq!(judge(&[runs(a, &[10])]), verdict(f64::INFINITY, 1.0));
    }
}
