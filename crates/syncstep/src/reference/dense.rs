//! The fully connected layer in f64: x `[m, k_in]`, w `[k_out, k_in]`, b `[k_out]`,
//! y `[m, k_out]`, row-major.

/// `y = x·wᵀ + b`.
pub fn dense_forward(
    m: usize,
    k_in: usize,
    k_out: usize,
    x: &[f64],
    w: &[f64],
    b: &[f64],
) -> Vec<f64> {
    assert_eq!(
        (x.len(), w.len(), b.len()),
        (m * k_in, k_out * k_in, k_out),
        "x [m, k_in], w [k_out, k_in], b [k_out]"
    );
    let mut y = Vec::with_capacity(m * k_out);
    for xi in x.chunks(k_in) {
        for (wj, bj) in w.chunks(k_in).zip(b) {
            y.push(bj + xi.iter().zip(wj).map(|(a, b)| a * b).sum::<f64>());
        }
    }
    y
}

/// `dx = dy·w`.
pub fn dense_backward_input(
    m: usize,
    k_in: usize,
    k_out: usize,
    dy: &[f64],
    w: &[f64],
) -> Vec<f64> {
    assert_eq!((dy.len(), w.len()), (m * k_out, k_out * k_in), "dy [m, k_out], w [k_out, k_in]");
    let mut dx = vec![0.0; m * k_in];
    for (dxi, dyi) in dx.chunks_mut(k_in).zip(dy.chunks(k_out)) {
        for (g, wj) in dyi.iter().zip(w.chunks(k_in)) {
            dxi.iter_mut().zip(wj).for_each(|(d, w)| *d += g * w);
        }
    }
    dx
}

/// `dw = dyᵀ·x`.
pub fn dense_backward_weight(
    m: usize,
    k_in: usize,
    k_out: usize,
    dy: &[f64],
    x: &[f64],
) -> Vec<f64> {
    assert_eq!((dy.len(), x.len()), (m * k_out, m * k_in), "dy [m, k_out], x [m, k_in]");
    let mut dw = vec![0.0; k_out * k_in];
    for (dyi, xi) in dy.chunks(k_out).zip(x.chunks(k_in)) {
        for (g, dwj) in dyi.iter().zip(dw.chunks_mut(k_in)) {
            dwj.iter_mut().zip(xi).for_each(|(d, x)| *d += g * x);
        }
    }
    dw
}

/// `db = Σ over the batch of dy`.
pub fn dense_backward_bias(m: usize, k_out: usize, dy: &[f64]) -> Vec<f64> {
    assert_eq!(dy.len(), m * k_out, "dy [m, k_out]");
    (0..k_out).map(|j| dy.iter().skip(j).step_by(k_out).sum()).collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Seeded values in [-1, 1).
    pub(crate) fn random(seed: u64, n: usize) -> Vec<f64> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    /// Checks `analytic` = ∇loss(x) against central differences (h = 1e-6) for every element of
    /// x. Shared by the reference modules' finite-difference tests.
    #[track_caller]
    pub(crate) fn assert_matches_central_differences(
        what: &str,
        loss: impl Fn(&[f64]) -> f64,
        x: &[f64],
        analytic: &[f64],
    ) {
        const H: f64 = 1e-6;
        assert_eq!(x.len(), analytic.len(), "{what}: gradient length");
        let scale = analytic.iter().fold(0.0f64, |a, g| a.max(g.abs()));
        assert!(scale > 0.0, "{what}: an all-zero gradient tests nothing");
        let mut xh = x.to_vec();
        for i in 0..x.len() {
            xh[i] = x[i] + H;
            let up = loss(&xh);
            xh[i] = x[i] - H;
            let down = loss(&xh);
            xh[i] = x[i];
            let fd = (up - down) / (2.0 * H);
            let err = (fd - analytic[i]).abs() / scale;
            assert!(
                err <= 1e-6,
                "{what}[{i}]: analytic {} vs central difference {fd} (rel. error {err:e})",
                analytic[i]
            );
        }
    }

    #[test]
    fn dense_backward_matches_finite_differences() {
        let (m, k_in, k_out) = (3, 5, 4);
        let (x, w, b, r) =
            (random(1, m * k_in), random(2, k_out * k_in), random(3, k_out), random(4, m * k_out));
        let project = |y: Vec<f64>| -> f64 { y.iter().zip(&r).map(|(y, r)| y * r).sum() };
        let loss_x = |x: &[f64]| project(dense_forward(m, k_in, k_out, x, &w, &b));
        let loss_w = |w: &[f64]| project(dense_forward(m, k_in, k_out, &x, w, &b));
        let loss_b = |b: &[f64]| project(dense_forward(m, k_in, k_out, &x, &w, b));
        assert_matches_central_differences(
            "dx",
            loss_x,
            &x,
            &dense_backward_input(m, k_in, k_out, &r, &w),
        );
        assert_matches_central_differences(
            "dw",
            loss_w,
            &w,
            &dense_backward_weight(m, k_in, k_out, &r, &x),
        );
        assert_matches_central_differences("db", loss_b, &b, &dense_backward_bias(m, k_out, &r));
    }

    #[test]
    fn dense_forward_matches_a_hand_computed_product() {
        // x = [[1, 2]], w = [[1, 0], [3, -1], [0.5, 0.5]], b = [0, 1, -1]
        let y = dense_forward(
            1,
            2,
            3,
            &[1.0, 2.0],
            &[1.0, 0.0, 3.0, -1.0, 0.5, 0.5],
            &[0.0, 1.0, -1.0],
        );
        assert_eq!(y, vec![1.0, 2.0, 0.5]);
    }
}
