//! ReLU and the residual add in f64.

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
