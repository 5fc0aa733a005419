//! Global average pool in f64: x `[n, c, hw]` → y `[n, c]`.

/// `y[n, c] = mean over hw of x[n, c, :]`.
pub fn global_avgpool_forward(n: usize, c: usize, hw: usize, x: &[f64]) -> Vec<f64> {
    assert_eq!(x.len(), n * c * hw, "x is [n, c, hw]");
    x.chunks(hw).map(|plane| plane.iter().sum::<f64>() / hw as f64).collect()
}

/// `dx[n, c, :] = dy[n, c] / hw`.
pub fn global_avgpool_backward(n: usize, c: usize, hw: usize, dy: &[f64]) -> Vec<f64> {
    assert_eq!(dy.len(), n * c, "dy is [n, c]");
    dy.iter().flat_map(|&g| std::iter::repeat_n(g / hw as f64, hw)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::dense::tests::{assert_matches_central_differences, random};

    #[test]
    fn global_avgpool_backward_matches_finite_differences() {
        let (n, c, hw) = (2, 3, 5);
        let x = random(1, n * c * hw);
        let r = random(2, n * c);
        let loss = |x: &[f64]| {
            global_avgpool_forward(n, c, hw, x).iter().zip(&r).map(|(y, r)| y * r).sum()
        };
        assert_matches_central_differences("dx", loss, &x, &global_avgpool_backward(n, c, hw, &r));
    }

    #[test]
    fn global_avgpool_forward_is_the_plane_mean() {
        let y = global_avgpool_forward(1, 2, 3, &[1.0, 2.0, 6.0, -3.0, 0.0, 0.0]);
        assert_eq!(y, vec![3.0, -1.0]);
    }
}
