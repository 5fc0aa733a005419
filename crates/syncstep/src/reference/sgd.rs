//! SGD with momentum and weight decay in f64, as PyTorch (dampening 0, not Nesterov).

/// One step in place: `g' = g + wd·p; v ← μ·v + g'; p ← p − lr·v`.
pub fn sgd_update(
    param: &mut [f64],
    grad: &[f64],
    velocity: &mut [f64],
    lr: f64,
    momentum: f64,
    weight_decay: f64,
) {
    assert!(
        param.len() == grad.len() && param.len() == velocity.len(),
        "param, grad and velocity have one length"
    );
    for ((p, g), v) in param.iter_mut().zip(grad).zip(velocity.iter_mut()) {
        *v = momentum * *v + g + weight_decay * *p;
        *p -= lr * *v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sgd_update_matches_two_hand_computed_steps() {
        // p = 1, g = 0.5, wd = 0.1, μ = 0.9, lr = 0.1, v = 0.
        // Step 1: g' = 0.6, v = 0.6, p = 0.94. Step 2 (same g): g' = 0.594, v = 1.134, p = 0.8266.
        let (mut p, mut v) = (vec![1.0, 0.0], vec![0.0, 0.0]);
        let g = [0.5, 0.0];
        sgd_update(&mut p, &g, &mut v, 0.1, 0.9, 0.1);
        assert!((p[0] - 0.94).abs() < 1e-15 && (v[0] - 0.6).abs() < 1e-15, "{p:?} {v:?}");
        sgd_update(&mut p, &g, &mut v, 0.1, 0.9, 0.1);
        assert!((p[0] - 0.8266).abs() < 1e-15 && (v[0] - 1.134).abs() < 1e-15, "{p:?} {v:?}");
        // Padding (zeros everywhere) stays zero.
        assert_eq!((p[1], v[1]), (0.0, 0.0));
    }
}
