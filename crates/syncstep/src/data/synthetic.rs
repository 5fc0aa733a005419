//! The embedded synthetic dataset: pure integer/float arithmetic with ChaCha8 and libm, so an
//! image is bit-identical on every platform, wasm included.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{Batch, DataError};

/// The embedded dataset's ten patterns; class k draws pattern k mod 10 (and for k ≥ 10 a
/// different colour family), so any number of classes works.
pub const PATTERNS: [&str; 10] = [
    "disc",
    "square",
    "horizontal stripes",
    "vertical stripes",
    "checkerboard",
    "ring",
    "cross",
    "diagonal stripes",
    "left-right gradient",
    "two dots",
];

/// The name of class `k`: its pattern, and for k ≥ 10 its colour family.
pub fn class_name(k: u32) -> String {
    match k / 10 {
        0 => PATTERNS[k as usize % 10].to_string(),
        family => format!("{} ({family})", PATTERNS[k as usize % 10]),
    }
}

/// `m` images of the synthetic dataset starting at example `start`. Example i depends only on
/// (seed, i), so batches, shards and resumed runs see the same images.
pub fn synthetic_batch(
    seed: u64,
    start: u64,
    m: usize,
    h: u32,
    w: u32,
    classes: u32,
) -> Result<Batch, DataError> {
    let values = (m as u128 * 3 * h as u128 * w as u128).try_into().unwrap_or(usize::MAX);
    let mut images = crate::host::vec_with_capacity(values, "the batch's images")?;
    let mut labels = crate::host::vec_with_capacity(m, "the batch's labels")?;
    for i in 0..m as u64 {
        let (img, label) = synthetic_image(seed, start + i, h, w, classes);
        images.extend(img);
        labels.push(label);
    }
    Ok(Batch { images, labels, h, w })
}

/// One image [3, h, w] and its label: a pattern (the class) in a random colour at a random
/// place and scale, on a random background, with noise; roughly zero mean, unit variance.
pub fn synthetic_image(seed: u64, index: u64, h: u32, w: u32, classes: u32) -> (Vec<f32>, u32) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let label = rng.random_range(0..classes);
    let pattern = label % 10;
    let family = (label / 10) as f32;
    let hue = |rng: &mut ChaCha8Rng| -> [f32; 3] {
        let base: [f32; 3] =
            [rng.random_range(0.2..1.0), rng.random_range(0.2..1.0), rng.random_range(0.2..1.0)];
        // Classes beyond ten differ by a colour family: channel weights rotate.
        let r = family as usize % 3;
        [base[r % 3], base[(r + 1) % 3], base[(r + 2) % 3]]
    };
    let fg = hue(&mut rng);
    let bg: [f32; 3] =
        [rng.random_range(-0.8..0.0), rng.random_range(-0.8..0.0), rng.random_range(-0.8..0.0)];
    let size = h.min(w) as f32;
    let radius = size * rng.random_range(0.22..0.38);
    let cy = h as f32 * rng.random_range(0.35..0.65);
    let cx = w as f32 * rng.random_range(0.35..0.65);
    let period = size * rng.random_range(0.12..0.22);
    let noise = 0.25;
    let mut img = vec![0.0f32; 3 * h as usize * w as usize];
    for y in 0..h {
        for x in 0..w {
            let (dy, dx) = (y as f32 + 0.5 - cy, x as f32 + 0.5 - cx);
            let d = libm::sqrtf(dy * dy + dx * dx);
            let stripe = |t: f32| (libm::floorf(t / period) as i64).rem_euclid(2) == 0;
            let inside = match pattern {
                0 => d < radius,
                1 => dy.abs() < radius * 0.8 && dx.abs() < radius * 0.8,
                2 => stripe(y as f32),
                3 => stripe(x as f32),
                4 => stripe(y as f32) ^ stripe(x as f32),
                5 => d < radius && d > radius * 0.6,
                6 => dy.abs() < radius * 0.25 || dx.abs() < radius * 0.25,
                7 => stripe((x + y) as f32 * std::f32::consts::FRAC_1_SQRT_2),
                8 => x as f32 / w as f32 > rng.random_range(0.0..1.0),
                _ => {
                    let (ey, ex) = (dy, dx.abs() - radius * 0.6);
                    libm::sqrtf(ey * ey + ex * ex) < radius * 0.35
                }
            };
            let px = (y * w + x) as usize;
            for c in 0..3 {
                let v = if inside { fg[c] } else { bg[c] };
                img[c * (h * w) as usize + px] = 2.0 * v + noise * rng.random_range(-1.0f32..1.0);
            }
        }
    }
    (img, label)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_seeded_and_independent_of_batching() {
        let a = synthetic_batch(3, 0, 6, 32, 32, 10).unwrap();
        assert_eq!(a, synthetic_batch(3, 0, 6, 32, 32, 10).unwrap());
        assert_ne!(a.images, synthetic_batch(4, 0, 6, 32, 32, 10).unwrap().images);
        let tail = synthetic_batch(3, 2, 4, 32, 32, 10).unwrap();
        assert_eq!(a.slice(2..6), tail);
        assert_eq!(&a.images[2 * 3 * 1024..], &tail.images[..]);
        assert!(a.labels.iter().all(|&l| l < 10));
        a.validate(10).unwrap();
    }

    #[test]
    fn all_classes_appear_and_pixels_are_normalised() {
        let b = synthetic_batch(0, 0, 200, 32, 32, 10).unwrap();
        for k in 0..10 {
            assert!(b.labels.contains(&k), "class {k} missing");
        }
        let mean = b.images.iter().map(|&v| v as f64).sum::<f64>() / b.images.len() as f64;
        let var = b.images.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>()
            / b.images.len() as f64;
        assert!(mean.abs() < 0.6 && (0.2..3.0).contains(&var), "mean {mean} var {var}");
    }
}
