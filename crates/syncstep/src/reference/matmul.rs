//! The matrix product in f64, row-major: the roofline probe's reference.

/// `c [m, n] = a [m, k] · b [k, n]`.
pub fn matmul(m: usize, k: usize, n: usize, a: &[f64], b: &[f64]) -> Vec<f64> {
    assert_eq!((a.len(), b.len()), (m * k, k * n), "a [m, k], b [k, n]");
    let mut c = vec![0.0; m * n];
    for (c_row, a_row) in c.chunks_mut(n).zip(a.chunks(k)) {
        for (&a_ik, b_row) in a_row.iter().zip(b.chunks(n)) {
            c_row.iter_mut().zip(b_row).for_each(|(c, &b)| *c += a_ik * b);
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_matches_hand_computed_values() {
        // [1 2 3; 4 5 6] · [7 8; 9 10; 11 12] = [58 64; 139 154]
        let c =
            matmul(2, 3, 2, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[7.0, 8.0, 9.0, 10.0, 11.0, 12.0]);
        assert_eq!(c, [58.0, 64.0, 139.0, 154.0]);
    }
}
