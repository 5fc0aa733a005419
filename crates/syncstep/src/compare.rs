//! Comparing two runs' numbers: the norm-relative error every gate and test uses, per
//! parameter tensor and over a model, and the fixed sample of a tensor the PORTABLE golden
//! keeps. One place, so that every gate measures alike.

use crate::model::ResNet;

/// Elements sampled per tensor by [`sample_indices`] (all of them in smaller tensors).
pub const SAMPLES_PER_TENSOR: usize = 64;

/// ‖a − b‖₂ / ‖b‖₂ in f64 (‖a − b‖₂ when b is 0), for `b` in f32 (another run) or f64 (the
/// reference); infinite if the lengths differ or a or b is not finite (an unwritten, poisoned
/// element).
pub fn norm_rel<B: Copy + Into<f64>>(a: &[f32], b: &[B]) -> f64 {
    if a.len() != b.len()
        || a.iter().any(|v| !v.is_finite())
        || b.iter().any(|&v| !v.into().is_finite())
    {
        return f64::INFINITY;
    }
    let num = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y.into()).powi(2)).sum::<f64>().sqrt();
    let den = b.iter().map(|&y| y.into().powi(2)).sum::<f64>().sqrt();
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

/// ‖v‖₂ in f64.
pub fn l2(v: &[f32]) -> f64 {
    v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt()
}

/// Each parameter tensor's norm-rel error between two flat buffers in the model's layout, in
/// model order. `b` is the one held as right.
pub fn tensor_errors(model: &ResNet, a: &[f32], b: &[f32]) -> Vec<f64> {
    model.params.iter().map(|spec| norm_rel(&a[spec.range()], &b[spec.range()])).collect()
}

/// The largest of per-tensor errors (model order) and the tensor it occurs in (none when
/// every error is 0).
pub fn worst_of(model: &ResNet, errors: &[f64]) -> (f64, Option<String>) {
    let mut worst = (0.0, None);
    for (spec, &e) in model.params.iter().zip(errors) {
        if e > worst.0 {
            worst = (e, Some(spec.name.clone()));
        }
    }
    worst
}

/// The largest per-tensor norm-rel error between two flat buffers and the tensor it occurs in.
pub fn worst_tensor(model: &ResNet, a: &[f32], b: &[f32]) -> (f64, Option<String>) {
    worst_of(model, &tensor_errors(model, a, b))
}

/// How far `values` is from a tensor known only by its L2 norm and its elements at
/// [`sample_indices`]: the larger of the sample's norm-rel error and the norm's relative error
/// (infinite where either is not a number).
pub fn summary_error(values: &[f32], norm: f64, sample: &[f32]) -> f64 {
    let got: Vec<f32> = sample_indices(values.len()).map(|i| values[i]).collect();
    let l2 = l2(values);
    let norm_err = if norm == 0.0 { l2 } else { (l2 - norm).abs() / norm };
    norm_rel(&got, sample).max(if norm_err.is_nan() { f64::INFINITY } else { norm_err })
}

/// `min(len, SAMPLES_PER_TENSOR)` evenly spaced indices of a tensor of `len` elements: ⌊i·len/n⌋.
pub fn sample_indices(len: usize) -> impl Iterator<Item = usize> {
    let n = len.min(SAMPLES_PER_TENSOR);
    (0..n).map(move |i| i * len / n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Arch;

    #[test]
    fn norm_rel_flags_nan_and_length_mismatch() {
        assert_eq!(norm_rel(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!(norm_rel(&[f32::NAN, 2.0], &[1.0, 2.0]).is_infinite());
        assert!(norm_rel(&[1.0], &[1.0, 2.0]).is_infinite());
        assert!((norm_rel(&[0.0, 1.0], &[0.0, 2.0]) - 0.5).abs() < 1e-15);
    }

    #[test]
    fn norm_rel_and_the_worst_tensor() {
        assert_eq!(norm_rel(&[3.0, 4.0], &[3.0, 4.0]), 0.0);
        assert!((norm_rel(&[3.0, 5.0], &[3.0, 4.0]) - 0.2).abs() < 1e-12);
        assert_eq!(norm_rel(&[f32::NAN], &[1.0]), f64::INFINITY);
        let model = ResNet::new(Arch::ResNet34, 10).unwrap();
        let a = vec![1.0f32; model.param_len];
        let mut b = a.clone();
        b[model.param("layer3.1.bn2.bias").unwrap().offset] = 2.0;
        assert_eq!(worst_tensor(&model, &a, &b).1.as_deref(), Some("layer3.1.bn2.bias"));
        assert_eq!(worst_tensor(&model, &a, &a), (0.0, None));
    }

    #[test]
    fn samples_are_evenly_spaced_and_cover_small_tensors() {
        assert_eq!(sample_indices(10).collect::<Vec<_>>(), (0..10).collect::<Vec<_>>());
        let big: Vec<usize> = sample_indices(640).collect();
        assert_eq!((big.len(), big[1], big[63]), (64, 10, 630));
    }
}
