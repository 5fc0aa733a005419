//! Softmax cross-entropy with label smoothing in f64 (docs/design.md, "Loss"): logits `[m, k]`,
//! labels `[m]`, q_j = ε/K + (1−ε)[j = y], ℓ = −Σ_j q_j log softmax(z)_j, loss = Σ_i ℓ_i / D.
//! A label `>= k` gives a NaN ℓ (and loss) and a NaN gradient row, as on the GPU.

fn target_prob(k: usize, smoothing: f64, j: usize, label: u32) -> f64 {
    smoothing / k as f64 + if j as u32 == label { 1.0 - smoothing } else { 0.0 }
}

/// `log softmax` of one row, by subtracting the max before log-sum-exp.
fn log_softmax(z: &[f64]) -> Vec<f64> {
    let max = z.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
    let log_sum = z.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
    z.iter().map(|v| v - max - log_sum).collect()
}

/// The per-example losses ℓ_i and the step's loss (Σ_i ℓ_i) / divisor.
pub fn cross_entropy_forward(
    m: usize,
    k: usize,
    smoothing: f64,
    divisor: f64,
    logits: &[f64],
    labels: &[u32],
) -> (Vec<f64>, f64) {
    assert_eq!((logits.len(), labels.len()), (m * k, m), "logits [m, k], labels [m]");
    let losses: Vec<f64> = logits
        .chunks(k)
        .zip(labels)
        .map(|(z, &y)| {
            if y as usize >= k {
                return f64::NAN;
            }
            -log_softmax(z)
                .iter()
                .enumerate()
                .map(|(j, lp)| target_prob(k, smoothing, j, y) * lp)
                .sum::<f64>()
        })
        .collect();
    let loss = losses.iter().sum::<f64>() / divisor;
    (losses, loss)
}

/// d loss / d logits = (softmax − q) / divisor.
pub fn cross_entropy_backward(
    m: usize,
    k: usize,
    smoothing: f64,
    divisor: f64,
    logits: &[f64],
    labels: &[u32],
) -> Vec<f64> {
    assert_eq!((logits.len(), labels.len()), (m * k, m), "logits [m, k], labels [m]");
    logits
        .chunks(k)
        .zip(labels)
        .flat_map(|(z, &y)| {
            log_softmax(z).into_iter().enumerate().map(move |(j, lp)| {
                if y as usize >= k {
                    f64::NAN
                } else {
                    (lp.exp() - target_prob(k, smoothing, j, y)) / divisor
                }
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::dense::tests::{assert_matches_central_differences, random};

    #[test]
    fn cross_entropy_backward_matches_finite_differences() {
        let (m, k, divisor) = (3, 7, 2.5);
        let logits: Vec<f64> = random(1, m * k).iter().map(|v| 3.0 * v).collect();
        let labels = [4, 0, 6];
        for smoothing in [0.0, 0.1] {
            let loss = |z: &[f64]| cross_entropy_forward(m, k, smoothing, divisor, z, &labels).1;
            let grad = cross_entropy_backward(m, k, smoothing, divisor, &logits, &labels);
            assert_matches_central_differences("dlogits", loss, &logits, &grad);
        }
    }

    #[test]
    fn cross_entropy_forward_matches_hand_computed_values() {
        // Equal logits: softmax is uniform, so ℓ = log K whatever q is.
        let (losses, loss) = cross_entropy_forward(2, 4, 0.1, 4.0, &[0.5; 8], &[1, 3]);
        assert!(losses.iter().all(|l| (l - 4f64.ln()).abs() < 1e-15), "{losses:?}");
        assert!((loss - 2.0 * 4f64.ln() / 4.0).abs() < 1e-15);
        // z = (0, ln 3): softmax = (1/4, 3/4); ε = 0.2, y = 0: q = (0.9, 0.1).
        let (losses, _) = cross_entropy_forward(1, 2, 0.2, 1.0, &[0.0, 3f64.ln()], &[0]);
        let expected = -(0.9 * 0.25f64.ln() + 0.1 * 0.75f64.ln());
        assert!((losses[0] - expected).abs() < 1e-15, "{} vs {expected}", losses[0]);
        let grad = cross_entropy_backward(1, 2, 0.2, 1.0, &[0.0, 3f64.ln()], &[0]);
        assert!(
            (grad[0] - (0.25 - 0.9)).abs() < 1e-15 && (grad[1] - (0.75 - 0.1)).abs() < 1e-15,
            "{grad:?}"
        );
    }

    #[test]
    fn cross_entropy_marks_an_out_of_range_label_with_nan() {
        let (losses, loss) =
            cross_entropy_forward(2, 3, 0.1, 2.0, &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], &[0, 3]);
        assert!(losses[0].is_finite() && losses[1].is_nan() && loss.is_nan());
        let grad = cross_entropy_backward(2, 3, 0.1, 2.0, &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], &[0, 3]);
        assert!(grad[..3].iter().all(|g| g.is_finite()) && grad[3..].iter().all(|g| g.is_nan()));
    }
}
