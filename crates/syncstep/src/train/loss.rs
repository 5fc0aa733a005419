//! The loss a reader should look at. One step's loss is one batch's: noisy, and a batch the
//! model gets badly wrong spikes it. The median of the last few steps' losses passes over a
//! spike or two and falls as the model learns, so the faces show it beside each step's own and
//! sum a run up with it.

/// Steps a smoothed loss is the median of.
pub const LOSS_WINDOW: usize = 10;

/// The median of the last `window` of `losses` (all of them when fewer); None when empty.
pub fn smoothed_loss(losses: &[f32], window: usize) -> Option<f32> {
    let last = &losses[losses.len().saturating_sub(window.max(1))..];
    let last: Vec<f64> = last.iter().map(|&l| l.into()).collect();
    (!last.is_empty()).then(|| median(&last) as f32)
}

/// Each step's smoothed loss: the median of the `window` steps up to and including it.
pub fn smoothed_losses(losses: &[f32], window: usize) -> Vec<f32> {
    (1..=losses.len()).filter_map(|end| smoothed_loss(&losses[..end], window)).collect()
}

/// How a run's loss went: the median of its first `window` steps' losses and of its last
/// `window`, the two windows apart (at most [`LOSS_WINDOW`] steps, at least 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossCourse {
    pub window: usize,
    pub start: f32,
    pub end: f32,
}

/// The course of `losses`, a run's steps' in order; None for a run of no steps.
pub fn loss_course(losses: &[f32]) -> Option<LossCourse> {
    let window = LOSS_WINDOW.min(losses.len() / 2).max(1);
    let start = smoothed_loss(&losses[..window.min(losses.len())], window)?;
    Some(LossCourse { window, start, end: smoothed_loss(losses, window)? })
}

/// The median of `v` (the mean of the middle two for an even count); NaN when empty.
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_smoothed_loss_passes_over_spikes() {
        // Falling by 0.1 a step, with two spikes in the last five.
        let mut losses: Vec<f32> = (0..20).map(|s| 3.0 - 0.1 * s as f32).collect();
        losses[16] = 5.0;
        losses[18] = 6.0;
        let mean = losses[15..].iter().sum::<f32>() / 5.0;
        assert!(mean > losses[0] - 0.2, "the mean of the last five, {mean}, hardly falls");
        assert_eq!(smoothed_loss(&losses, 5), Some(losses[15]));
        assert_eq!(
            smoothed_loss(&losses, 4),
            Some(((losses[17] as f64 + losses[16] as f64) / 2.0) as f32)
        );
        assert_eq!(
            smoothed_loss(&losses[..2], 10),
            Some(((losses[0] as f64 + losses[1] as f64) / 2.0) as f32)
        );
        assert_eq!(smoothed_loss(&[], 10), None);
        let smoothed = smoothed_losses(&losses, 5);
        assert_eq!(smoothed.len(), losses.len());
        assert_eq!((smoothed[0], smoothed[19]), (losses[0], losses[15]));
        assert!(smoothed.windows(2).all(|w| w[1] <= w[0]), "{smoothed:?}");
    }

    #[test]
    fn a_runs_course_compares_windows_that_do_not_overlap() {
        let losses: Vec<f32> = (0..60).map(|s| 60.0 - s as f32).collect();
        let course = loss_course(&losses).unwrap();
        assert_eq!(course, LossCourse { window: 10, start: 55.5, end: 5.5 });
        let course = loss_course(&losses[..7]).unwrap();
        assert_eq!(course, LossCourse { window: 3, start: 59.0, end: 55.0 });
        assert_eq!(loss_course(&[2.0]), Some(LossCourse { window: 1, start: 2.0, end: 2.0 }));
        assert_eq!(loss_course(&[]), None);
    }
}
