//! Max pooling (NCHW, square window k, stride, zero-free padding) in f64. The argmax of each
//! output is the index ih·W + iw within its input plane of the FIRST maximum in window scan
//! order (kh outer, kw inner), padding never chosen, as PyTorch.

/// Input extent and window; out_h = (h + 2·pad − k)/stride + 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub k: usize,
    pub stride: usize,
    pub pad: usize,
}

impl Pool {
    pub fn out_h(&self) -> usize {
        (self.h + 2 * self.pad - self.k) / self.stride + 1
    }
    pub fn out_w(&self) -> usize {
        (self.w + 2 * self.pad - self.k) / self.stride + 1
    }
    fn planes(&self) -> usize {
        self.n * self.c
    }
}

/// y and the argmax of every output. Comparisons are strict `>`, so ties keep the first cell
/// and a NaN never replaces the running maximum (it is chosen only as a window's first cell).
pub fn maxpool_forward(x: &[f64], p: Pool) -> (Vec<f64>, Vec<u32>) {
    let (oh, ow) = (p.out_h(), p.out_w());
    let mut y = Vec::with_capacity(p.planes() * oh * ow);
    let mut argmax = Vec::with_capacity(y.capacity());
    for plane in x.chunks(p.h * p.w).take(p.planes()) {
        for o_r in 0..oh {
            for o_c in 0..ow {
                let mut best: Option<(f64, usize)> = None;
                for kh in 0..p.k {
                    for kw in 0..p.k {
                        let (ih, iw) = (
                            (o_r * p.stride + kh).wrapping_sub(p.pad),
                            (o_c * p.stride + kw).wrapping_sub(p.pad),
                        );
                        if ih >= p.h || iw >= p.w {
                            continue;
                        }
                        let v = plane[ih * p.w + iw];
                        if best.is_none_or(|(b, _)| v > b) {
                            best = Some((v, ih * p.w + iw));
                        }
                    }
                }
                let (v, i) = best.expect("every window sees at least one input cell");
                y.push(v);
                argmax.push(i as u32);
            }
        }
    }
    (y, argmax)
}

/// y = x at the given argmax (another run's pooling choices).
pub fn maxpool_forward_with_argmax(x: &[f64], p: Pool, argmax: &[u32]) -> Vec<f64> {
    let per_plane = p.out_h() * p.out_w();
    argmax.iter().enumerate().map(|(o, &a)| x[(o / per_plane) * p.h * p.w + a as usize]).collect()
}

/// dx: each dy goes to the input cell its argmax names (a scatter here; the GPU gathers).
pub fn maxpool_backward(dy: &[f64], p: Pool, argmax: &[u32]) -> Vec<f64> {
    let per_plane = p.out_h() * p.out_w();
    let mut dx = vec![0.0; p.planes() * p.h * p.w];
    for (o, (&g, &a)) in dy.iter().zip(argmax).enumerate() {
        dx[(o / per_plane) * p.h * p.w + a as usize] += g;
    }
    dx
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// L = Σ r ⊙ maxpool(x) on distinct inputs (spaced far more than h apart, so no argmax
    /// changes under the perturbation): the gather/scatter backward against central differences.
    #[test]
    fn backward_matches_finite_differences() {
        for p in [
            Pool { n: 2, c: 2, h: 5, w: 6, k: 3, stride: 2, pad: 1 },
            Pool { n: 1, c: 1, h: 5, w: 5, k: 3, stride: 1, pad: 1 },
            Pool { n: 1, c: 2, h: 7, w: 4, k: 2, stride: 2, pad: 0 },
        ] {
            let mut rng = ChaCha8Rng::seed_from_u64(1);
            let len = p.planes() * p.h * p.w;
            let mut x: Vec<f64> = (0..len).map(|i| i as f64 * 1e-2).collect();
            x.shuffle(&mut rng);
            let (y, argmax) = maxpool_forward(&x, p);
            let r: Vec<f64> = (0..y.len()).map(|_| rng.random_range(-1.0..1.0)).collect();
            let loss =
                |x: &[f64]| maxpool_forward(x, p).0.iter().zip(&r).map(|(y, r)| y * r).sum::<f64>();
            let dx = maxpool_backward(&r, p, &argmax);
            let h = 1e-6;
            for i in 0..len {
                let (mut xp, mut xm) = (x.clone(), x.clone());
                xp[i] += h;
                xm[i] -= h;
                let fd = (loss(&xp) - loss(&xm)) / (2.0 * h);
                assert!(
                    (fd - dx[i]).abs() <= 1e-6,
                    "{p:?} dx[{i}]: analytic {} vs finite difference {fd}",
                    dx[i]
                );
            }
        }
    }

    #[test]
    fn ties_keep_the_first_cell_in_scan_order_and_padding_is_never_chosen() {
        // All-negative input: a padded zero would win if padding were considered.
        let p = Pool { n: 1, c: 1, h: 2, w: 2, k: 3, stride: 2, pad: 1 };
        let (y, argmax) = maxpool_forward(&[-2.0, -1.0, -1.0, -3.0], p);
        assert_eq!((y, argmax), (vec![-1.0], vec![1]));
    }
}
