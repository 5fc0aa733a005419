//! Conv2d without bias in f64: NCHW activations, OIHW weights (torchvision's layout).
//!
//! Written as the definition reads, with no care for speed: the forward sums over the taps of
//! each output; the input-VJP gathers, for each input cell, the outputs whose window covers it
//! (solving `oy·stride − pad + ky = iy`); the weight gradient sums over batch and space.

/// Geometry of one convolution; `h`, `w` are the input's, the output's follow from them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvGeometry {
    pub n: usize,
    pub c_in: usize,
    pub h: usize,
    pub w: usize,
    pub c_out: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: usize,
    pub pad: usize,
}

impl ConvGeometry {
    pub fn out_h(&self) -> usize {
        (self.h + 2 * self.pad - self.kh) / self.stride + 1
    }
    pub fn out_w(&self) -> usize {
        (self.w + 2 * self.pad - self.kw) / self.stride + 1
    }
    fn x_index(&self, n: usize, c: usize, iy: usize, ix: usize) -> usize {
        ((n * self.c_in + c) * self.h + iy) * self.w + ix
    }
    fn w_index(&self, co: usize, ci: usize, ky: usize, kx: usize) -> usize {
        ((co * self.c_in + ci) * self.kh + ky) * self.kw + kx
    }
    fn y_index(&self, n: usize, c: usize, oy: usize, ox: usize) -> usize {
        ((n * self.c_out + c) * self.out_h() + oy) * self.out_w() + ox
    }
    /// The input coordinate tap `k` of output `o` reads, or None where it falls on padding.
    fn input_at(&self, o: usize, k: usize, size: usize) -> Option<usize> {
        (o * self.stride + k).checked_sub(self.pad).filter(|&i| i < size)
    }
    /// The output coordinate whose tap `k` reads input `i`, if any.
    fn output_at(&self, i: usize, k: usize, size: usize) -> Option<usize> {
        let t = (i + self.pad).checked_sub(k)?;
        (t % self.stride == 0 && t / self.stride < size).then_some(t / self.stride)
    }
}

/// `y[n,co,oy,ox] = Σ_{ci,ky,kx} x[n,ci,oy·s−p+ky,ox·s−p+kx] · w[co,ci,ky,kx]`, zero padding.
pub fn conv2d_forward(g: &ConvGeometry, x: &[f64], w: &[f64]) -> Vec<f64> {
    let (oh, ow) = (g.out_h(), g.out_w());
    let mut y = vec![0.0; g.n * g.c_out * oh * ow];
    for n in 0..g.n {
        for co in 0..g.c_out {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = 0.0;
                    for ci in 0..g.c_in {
                        for ky in 0..g.kh {
                            let Some(iy) = g.input_at(oy, ky, g.h) else { continue };
                            for kx in 0..g.kw {
                                let Some(ix) = g.input_at(ox, kx, g.w) else { continue };
                                acc += x[g.x_index(n, ci, iy, ix)] * w[g.w_index(co, ci, ky, kx)];
                            }
                        }
                    }
                    y[g.y_index(n, co, oy, ox)] = acc;
                }
            }
        }
    }
    y
}

/// The input-VJP: `dx[n,ci,iy,ix] = Σ dy[n,co,oy,ox] · w[co,ci,ky,kx]` over the `(co,ky,kx)` and
/// outputs `(oy,ox)` whose window puts tap `(ky,kx)` on `(iy,ix)`.
pub fn conv2d_backward_input(g: &ConvGeometry, dy: &[f64], w: &[f64]) -> Vec<f64> {
    let (oh, ow) = (g.out_h(), g.out_w());
    let mut dx = vec![0.0; g.n * g.c_in * g.h * g.w];
    for n in 0..g.n {
        for ci in 0..g.c_in {
            for iy in 0..g.h {
                for ix in 0..g.w {
                    let mut acc = 0.0;
                    for co in 0..g.c_out {
                        for ky in 0..g.kh {
                            let Some(oy) = g.output_at(iy, ky, oh) else { continue };
                            for kx in 0..g.kw {
                                let Some(ox) = g.output_at(ix, kx, ow) else { continue };
                                acc += dy[g.y_index(n, co, oy, ox)] * w[g.w_index(co, ci, ky, kx)];
                            }
                        }
                    }
                    dx[g.x_index(n, ci, iy, ix)] = acc;
                }
            }
        }
    }
    dx
}

/// The weight gradient: `dw[co,ci,ky,kx] = Σ_{n,oy,ox} dy[n,co,oy,ox] · x[n,ci,oy·s−p+ky,ox·s−p+kx]`.
pub fn conv2d_backward_weight(g: &ConvGeometry, dy: &[f64], x: &[f64]) -> Vec<f64> {
    let (oh, ow) = (g.out_h(), g.out_w());
    let mut dw = vec![0.0; g.c_out * g.c_in * g.kh * g.kw];
    for co in 0..g.c_out {
        for ci in 0..g.c_in {
            for ky in 0..g.kh {
                for kx in 0..g.kw {
                    let mut acc = 0.0;
                    for n in 0..g.n {
                        for oy in 0..oh {
                            let Some(iy) = g.input_at(oy, ky, g.h) else { continue };
                            for ox in 0..ow {
                                let Some(ix) = g.input_at(ox, kx, g.w) else { continue };
                                acc += dy[g.y_index(n, co, oy, ox)] * x[g.x_index(n, ci, iy, ix)];
                            }
                        }
                    }
                    dw[g.w_index(co, ci, ky, kx)] = acc;
                }
            }
        }
    }
    dw
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random(rng: &mut ChaCha8Rng, len: usize) -> Vec<f64> {
        (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    fn geometry(
        n: usize,
        c_in: usize,
        hw: (usize, usize),
        c_out: usize,
        k: (usize, usize),
        stride: usize,
        pad: usize,
    ) -> ConvGeometry {
        ConvGeometry { n, c_in, h: hw.0, w: hw.1, c_out, kh: k.0, kw: k.1, stride, pad }
    }

    /// Stride 2 with padding, the 7×7/s2/p3 stem (small), 1×1/s2, an odd one with kh ≠ kw,
    /// stride 3 and padding wider than the kernel's reach, and stride 1.
    fn geometries() -> Vec<ConvGeometry> {
        vec![
            geometry(2, 3, (5, 5), 2, (3, 3), 2, 1),
            geometry(1, 2, (9, 8), 3, (7, 7), 2, 3),
            geometry(2, 3, (5, 4), 2, (1, 1), 2, 0),
            geometry(1, 2, (5, 7), 3, (2, 3), 3, 2),
            geometry(2, 2, (4, 5), 3, (3, 3), 1, 1),
        ]
    }

    /// `L(v) = Σ r ⊙ f(v)`; checks `grad` (the analytic dL/dv) against central differences at
    /// every element of `v`.
    fn check_against_central_differences(
        what: &str,
        v: &[f64],
        r: &[f64],
        f: impl Fn(&[f64]) -> Vec<f64>,
        grad: &[f64],
    ) {
        let loss = |v: &[f64]| f(v).iter().zip(r).map(|(a, b)| a * b).sum::<f64>();
        let h = 1e-6;
        let mut worst = 0.0f64;
        for i in 0..v.len() {
            let (mut plus, mut minus) = (v.to_vec(), v.to_vec());
            plus[i] += h;
            minus[i] -= h;
            let fd = (loss(&plus) - loss(&minus)) / (2.0 * h);
            let err = (fd - grad[i]).abs() / grad[i].abs().max(1.0);
            worst = worst.max(err);
            assert!(
                err <= 1e-6,
                "{what}: element {i}: finite difference {fd} vs analytic {}",
                grad[i]
            );
        }
        // A gradient of zeros would pass trivially; the random cotangent makes it non-zero.
        assert!(grad.iter().any(|&d| d.abs() > 1e-3), "{what}: gradient is (nearly) all zero");
        eprintln!("{what}: worst relative error {worst:e}");
    }

    #[test]
    fn conv2d_backward_input_matches_central_differences() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for g in geometries() {
            let x = random(&mut rng, g.n * g.c_in * g.h * g.w);
            let w = random(&mut rng, g.c_out * g.c_in * g.kh * g.kw);
            let r = random(&mut rng, g.n * g.c_out * g.out_h() * g.out_w());
            let dx = conv2d_backward_input(&g, &r, &w);
            check_against_central_differences(
                &format!("dx {g:?}"),
                &x,
                &r,
                |x| conv2d_forward(&g, x, &w),
                &dx,
            );
        }
    }

    #[test]
    fn conv2d_backward_weight_matches_central_differences() {
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        for g in geometries() {
            let x = random(&mut rng, g.n * g.c_in * g.h * g.w);
            let w = random(&mut rng, g.c_out * g.c_in * g.kh * g.kw);
            let r = random(&mut rng, g.n * g.c_out * g.out_h() * g.out_w());
            let dw = conv2d_backward_weight(&g, &r, &x);
            check_against_central_differences(
                &format!("dw {g:?}"),
                &w,
                &r,
                |w| conv2d_forward(&g, &x, w),
                &dw,
            );
        }
    }

    /// Finite differences only tie the backward passes to the forward; this pins the forward,
    /// including padding and stride, to numbers worked out by hand.
    #[test]
    fn conv2d_forward_matches_hand_computed_values() {
        let x: Vec<f64> = (1..=9).map(f64::from).collect(); // 3×3: 1 2 3 / 4 5 6 / 7 8 9
        let ones = [1.0; 4];
        let valid = geometry(1, 1, (3, 3), 1, (2, 2), 1, 0);
        assert_eq!(conv2d_forward(&valid, &x, &ones), [12.0, 16.0, 24.0, 28.0]);
        // Windows start at -1 and 1: [x00, x01+x02, x10+x20, x11+x12+x21+x22].
        let padded = geometry(1, 1, (3, 3), 1, (2, 2), 2, 1);
        assert_eq!(conv2d_forward(&padded, &x, &ones), [1.0, 5.0, 11.0, 28.0]);
        // Two output channels with weights [1,0,0,0] and [0,0,0,2]: a shifted copy and twice another.
        let two = geometry(1, 1, (3, 3), 2, (2, 2), 1, 0);
        let w = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0];
        assert_eq!(conv2d_forward(&two, &x, &w), [1.0, 2.0, 4.0, 5.0, 10.0, 12.0, 16.0, 18.0]);
    }
}
