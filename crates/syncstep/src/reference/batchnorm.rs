//! BatchNorm in training mode, in f64 (docs/design.md, "BatchNorm, training mode"), with Chan's merge of per-replica
//! statistics for synchronised BatchNorm. x is NCHW seen as [n, c, hw]; per channel the set S
//! holds the n·hw positions.

use super::elementwise::{add, relu_forward};

/// The extent of x: [n, c, hw] with hw = H·W.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BnDims {
    pub n: usize,
    pub c: usize,
    pub hw: usize,
}

impl BnDims {
    fn index(&self, b: usize, ch: usize, j: usize) -> usize {
        (b * self.c + ch) * self.hw + j
    }

    /// The elements of channel `ch`, in batch-then-space order.
    fn channel(&self, ch: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.n).flat_map(move |b| (0..self.hw).map(move |j| self.index(b, ch, j)))
    }
}

/// Per-channel statistics of `count` positions: mean and M2 = Σ(x − mean)².
#[derive(Clone, Debug, PartialEq)]
pub struct BnStats {
    pub count: usize,
    pub mean: Vec<f64>,
    pub m2: Vec<f64>,
}

impl BnStats {
    /// 1/√(σ² + eps) per channel, σ² = M2/count (biased).
    fn inv_std(&self, eps: f64) -> Vec<f64> {
        self.m2.iter().map(|m2| 1.0 / (m2 / self.count as f64 + eps).sqrt()).collect()
    }
}

/// The backward's per-channel sums: Σdy (= dβ) and Σdy·x̂ (= dγ).
#[derive(Clone, Debug, PartialEq)]
pub struct BnSums {
    pub dy: Vec<f64>,
    pub dy_xhat: Vec<f64>,
}

/// Local (two-pass) mean and M2 of each channel over its n·hw positions.
pub fn bn_forward_stats(d: BnDims, x: &[f64]) -> BnStats {
    let count = d.n * d.hw;
    let mean: Vec<f64> =
        (0..d.c).map(|ch| d.channel(ch).map(|i| x[i]).sum::<f64>() / count as f64).collect();
    let m2 = (0..d.c).map(|ch| d.channel(ch).map(|i| (x[i] - mean[ch]).powi(2)).sum()).collect();
    BnStats { count, mean, m2 }
}

/// Chan's merge of per-replica statistics: μ = Σ n_r μ_r / n, M2 = Σ M2_r + Σ n_r (μ_r − μ)².
pub fn bn_merge_stats(parts: &[BnStats]) -> BnStats {
    let c = parts.first().map_or(0, |p| p.mean.len());
    let count: usize = parts.iter().map(|p| p.count).sum();
    let mean: Vec<f64> = (0..c)
        .map(|ch| parts.iter().map(|p| p.count as f64 * p.mean[ch]).sum::<f64>() / count as f64)
        .collect();
    let m2 = (0..c)
        .map(|ch| {
            parts.iter().map(|p| p.m2[ch] + p.count as f64 * (p.mean[ch] - mean[ch]).powi(2)).sum()
        })
        .collect();
    BnStats { count, mean, m2 }
}

/// y = γ (x − μ)/√(M2/count + eps) + β, with stats possibly merged across replicas.
pub fn bn_forward_apply(
    d: BnDims,
    x: &[f64],
    stats: &BnStats,
    eps: f64,
    gamma: &[f64],
    beta: &[f64],
) -> Vec<f64> {
    let inv_std = stats.inv_std(eps);
    let mut y = vec![0.0; x.len()];
    for ch in 0..d.c {
        for i in d.channel(ch) {
            y[i] = gamma[ch] * (x[i] - stats.mean[ch]) * inv_std[ch] + beta[ch];
        }
    }
    y
}

/// relu(y + shortcut) with y = `bn_forward_apply`, no shortcut when None; the ReLU passes where
/// its own input is positive, or where `gate` > 0 when a gate is given (an imposed pattern).
#[allow(clippy::too_many_arguments)]
pub fn bn_apply_relu(
    d: BnDims,
    x: &[f64],
    stats: &BnStats,
    eps: f64,
    gamma: &[f64],
    beta: &[f64],
    shortcut: Option<&[f64]>,
    gate: Option<&[f64]>,
) -> Vec<f64> {
    let y = bn_forward_apply(d, x, stats, eps, gamma, beta);
    let v = match shortcut {
        Some(s) => add(&y, s),
        None => y,
    };
    relu_forward(&v, gate.unwrap_or(&v))
}

/// Local Σdy and Σdy·x̂ per channel, x̂ from the given (possibly global) stats.
pub fn bn_backward_sums(d: BnDims, dy: &[f64], x: &[f64], stats: &BnStats, eps: f64) -> BnSums {
    let inv_std = stats.inv_std(eps);
    let sum_dy = (0..d.c).map(|ch| d.channel(ch).map(|i| dy[i]).sum()).collect();
    let sum_dy_xhat = (0..d.c)
        .map(|ch| d.channel(ch).map(|i| dy[i] * (x[i] - stats.mean[ch]) * inv_std[ch]).sum())
        .collect();
    BnSums { dy: sum_dy, dy_xhat: sum_dy_xhat }
}

/// dx = γ/√(σ²+eps) · (dy − Σ1/count − x̂·Σ2/count), with `sums` over all `stats.count` positions.
pub fn bn_backward_input(
    d: BnDims,
    dy: &[f64],
    x: &[f64],
    stats: &BnStats,
    eps: f64,
    gamma: &[f64],
    sums: &BnSums,
) -> Vec<f64> {
    let inv_std = stats.inv_std(eps);
    let count = stats.count as f64;
    let mut dx = vec![0.0; x.len()];
    for ch in 0..d.c {
        for i in d.channel(ch) {
            let xhat = (x[i] - stats.mean[ch]) * inv_std[ch];
            dx[i] = gamma[ch]
                * inv_std[ch]
                * (dy[i] - sums.dy[ch] / count - xhat * sums.dy_xhat[ch] / count);
        }
    }
    dx
}

/// In place: mean ← (1−m)·mean + m·μ; var ← (1−m)·var + m·M2/(count−1) (unbiased, as PyTorch).
/// `stats.count` must be at least 2.
pub fn bn_update_running(
    stats: &BnStats,
    momentum: f64,
    running_mean: &mut [f64],
    running_var: &mut [f64],
) {
    for ch in 0..stats.mean.len() {
        running_mean[ch] = (1.0 - momentum) * running_mean[ch] + momentum * stats.mean[ch];
        running_var[ch] = (1.0 - momentum) * running_var[ch]
            + momentum * stats.m2[ch] / (stats.count as f64 - 1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    const EPS: f64 = 1e-5;

    fn random(seed: u64, len: usize, lo: f64, hi: f64) -> Vec<f64> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..len).map(|_| rng.random_range(lo..hi)).collect()
    }

    fn max_rel(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(a, b)| (a - b).abs() / b.abs().max(1e-3)).fold(0.0, f64::max)
    }

    /// The batch split in two along n (first `n0` examples, then the rest).
    fn split(d: BnDims, x: &[f64], n0: usize) -> (BnDims, Vec<f64>, BnDims, Vec<f64>) {
        let at = n0 * d.c * d.hw;
        (BnDims { n: n0, ..d }, x[..at].to_vec(), BnDims { n: d.n - n0, ..d }, x[at..].to_vec())
    }

    #[test]
    fn merging_the_stats_of_two_halves_gives_the_stats_of_the_whole() {
        let d = BnDims { n: 5, c: 3, hw: 7 };
        let mut x = random(1, d.n * d.c * d.hw, -1.0, 1.0);
        // Shift the second part so its mean differs, as replicas' shards do.
        let at = 2 * d.c * d.hw;
        x[at..].iter_mut().for_each(|v| *v += 0.5);
        let (d0, x0, d1, x1) = split(d, &x, 2);
        let merged = bn_merge_stats(&[bn_forward_stats(d0, &x0), bn_forward_stats(d1, &x1)]);
        let whole = bn_forward_stats(d, &x);
        assert_eq!(merged.count, whole.count);
        assert!(
            max_rel(&merged.mean, &whole.mean) < 1e-13,
            "{:?} vs {:?}",
            merged.mean,
            whole.mean
        );
        assert!(max_rel(&merged.m2, &whole.m2) < 1e-13, "{:?} vs {:?}", merged.m2, whole.m2);
    }

    /// Sharded backward (global stats, summed sums) gives each shard its slice of the whole dx.
    #[test]
    fn sharded_backward_with_merged_stats_equals_the_whole_batch_backward() {
        let d = BnDims { n: 4, c: 2, hw: 5 };
        let len = d.n * d.c * d.hw;
        let (x, dy) = (random(2, len, 2.0, 4.0), random(3, len, -1.0, 1.0));
        let gamma = random(4, d.c, 0.5, 1.5);
        let whole = bn_forward_stats(d, &x);
        let dx = bn_backward_input(
            d,
            &dy,
            &x,
            &whole,
            EPS,
            &gamma,
            &bn_backward_sums(d, &dy, &x, &whole, EPS),
        );

        let (d0, x0, d1, x1) = split(d, &x, 3);
        let (_, dy0, _, dy1) = split(d, &dy, 3);
        let global = bn_merge_stats(&[bn_forward_stats(d0, &x0), bn_forward_stats(d1, &x1)]);
        let (s0, s1) = (
            bn_backward_sums(d0, &dy0, &x0, &global, EPS),
            bn_backward_sums(d1, &dy1, &x1, &global, EPS),
        );
        let add = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(a, b)| a + b).collect();
        let sums = BnSums { dy: add(&s0.dy, &s1.dy), dy_xhat: add(&s0.dy_xhat, &s1.dy_xhat) };
        let mut sharded = bn_backward_input(d0, &dy0, &x0, &global, EPS, &gamma, &sums);
        sharded.extend(bn_backward_input(d1, &dy1, &x1, &global, EPS, &gamma, &sums));
        assert!(max_rel(&sharded, &dx) < 1e-10, "{sharded:?} vs {dx:?}");
    }

    /// L = Σ r ⊙ y(x, γ, β) with y the training-mode BN (stats of x, then apply). The analytic
    /// gradient (through the batch statistics) against central differences, every element.
    #[test]
    fn training_mode_backward_matches_finite_differences() {
        let d = BnDims { n: 3, c: 2, hw: 4 };
        let len = d.n * d.c * d.hw;
        let x = random(5, len, 1.0, 5.0);
        let r = random(6, len, -1.0, 1.0);
        let gamma = random(7, d.c, 0.5, 1.5);
        let beta = random(8, d.c, -1.0, 1.0);
        let loss = |x: &[f64], gamma: &[f64], beta: &[f64]| -> f64 {
            let y = bn_forward_apply(d, x, &bn_forward_stats(d, x), EPS, gamma, beta);
            y.iter().zip(&r).map(|(y, r)| y * r).sum()
        };
        let stats = bn_forward_stats(d, &x);
        let sums = bn_backward_sums(d, &r, &x, &stats, EPS);
        let dx = bn_backward_input(d, &r, &x, &stats, EPS, &gamma, &sums);
        let h = 1e-6;
        let fd = |v: &[f64], i: usize, f: &dyn Fn(&[f64]) -> f64| {
            let (mut p, mut m) = (v.to_vec(), v.to_vec());
            p[i] += h;
            m[i] -= h;
            (f(&p) - f(&m)) / (2.0 * h)
        };
        let check = |what: &str, analytic: &[f64], numeric: Vec<f64>| {
            let scale = numeric.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for (i, (a, n)) in analytic.iter().zip(&numeric).enumerate() {
                assert!(
                    (a - n).abs() <= 1e-6 * scale,
                    "{what}[{i}]: analytic {a} vs finite difference {n}"
                );
            }
        };
        check("dx", &dx, (0..len).map(|i| fd(&x, i, &|x| loss(x, &gamma, &beta))).collect());
        check(
            "dgamma",
            &sums.dy_xhat,
            (0..d.c).map(|i| fd(&gamma, i, &|g| loss(&x, g, &beta))).collect(),
        );
        check(
            "dbeta",
            &sums.dy,
            (0..d.c).map(|i| fd(&beta, i, &|b| loss(&x, &gamma, b))).collect(),
        );
    }

    #[test]
    fn running_variance_is_unbiased() {
        // One channel over x = [1, 3]: μ = 2, M2 = 2, unbiased variance 2.
        let stats = bn_forward_stats(BnDims { n: 2, c: 1, hw: 1 }, &[1.0, 3.0]);
        let (mut mean, mut var) = ([0.0], [1.0]);
        bn_update_running(&stats, 0.1, &mut mean, &mut var);
        assert!(
            (mean[0] - 0.2).abs() < 1e-15 && (var[0] - (0.9 + 0.2)).abs() < 1e-15,
            "{mean:?} {var:?}"
        );
    }
}
