//! ReLU, the residual add and its backward join in f64.

/// `y = gate > 0 ? x : 0`.
pub fn relu_forward(x: &[f64], gate: &[f64]) -> Vec<f64> {
    x.iter().zip(gate).map(|(&x, &g)| if g > 0.0 { x } else { 0.0 }).collect()
}

/// `dx = gate > 0 ? dy : 0`.
pub fn relu_backward(dy: &[f64], gate: &[f64]) -> Vec<f64> {
    relu_forward(dy, gate)
}

pub fn add(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(a, b)| a + b).collect()
}

/// `a + (gate > 0 ? dy : 0)`.
pub fn add_relu_backward(a: &[f64], dy: &[f64], gate: &[f64]) -> Vec<f64> {
    add(a, &relu_backward(dy, gate))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f(x) = Σ a·x + Σ dy·relu(x + c): the gradient is add_relu_backward(a, dy, x + c), a block
    /// input's cotangent (a from the conv branch, the shortcut through the output ReLU).
    #[test]
    fn add_relu_backward_matches_finite_differences() {
        let a = [0.3, -1.2, 0.7, 2.0, -0.4];
        let dy = [1.5, 0.25, -0.8, -1.1, 0.6];
        let c = [0.5, -2.0, 1.0, -0.3, 0.1];
        let x = [0.2, 0.9, -0.6, 0.8, -0.7];
        let f = |x: &[f64]| -> f64 {
            let s: Vec<f64> = x.iter().zip(&c).map(|(x, c)| x + c).collect();
            a.iter().zip(x).map(|(a, x)| a * x).sum::<f64>()
                + dy.iter().zip(relu_forward(&s, &s)).map(|(d, r)| d * r).sum::<f64>()
        };
        let gate: Vec<f64> = x.iter().zip(&c).map(|(x, c)| x + c).collect();
        let grad = add_relu_backward(&a, &dy, &gate);
        let h = 1e-6;
        for i in 0..x.len() {
            let (mut p, mut m) = (x.to_vec(), x.to_vec());
            p[i] += h;
            m[i] -= h;
            let fd = (f(&p) - f(&m)) / (2.0 * h);
            assert!(
                (grad[i] - fd).abs() < 1e-8,
                "[{i}]: analytic {} vs finite difference {fd}",
                grad[i]
            );
        }
        // Both sides of the mask are exercised.
        assert!(gate.iter().any(|&g| g > 0.0) && gate.iter().any(|&g| g < 0.0));
    }
}
