//! From a decoded image to the network's input: the augmentation of a training image, the
//! fixed preprocessing of an evaluation image, and the normalisation of both.
//!
//! Every random choice comes from a ChaCha8 stream keyed by (seed, epoch, example), and the
//! geometry uses f32 with libm, so an example's image is the same bits however the batch is
//! sharded, after a resume, and in the browser. Training and the `square` evaluation resample
//! with image's Triangle filter (bilinear, its support widened when shrinking, like
//! torchvision's antialiased resize, but not to PIL's rounding); the `torchvision` evaluation
//! resamples as PIL does (`resample`), because pretrained weights are held to PyTorch's pixels.

use std::fmt;
use std::str::FromStr;

use image::imageops::{self, FilterType};
use image::Rgb;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::source::{Dataset, DatasetError, RgbImage};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Augment {
    /// The evaluation preprocessing.
    None,
    /// The CIFAR recipe: pad by size/8 with black, random crop, random horizontal flip.
    CropFlip,
    /// The ImageNet recipe: torchvision's RandomResizedCrop with its defaults, random flip.
    ResizedCropFlip,
}

impl FromStr for Augment {
    type Err = DatasetError;
    fn from_str(s: &str) -> Result<Augment, DatasetError> {
        match s {
            "none" => Ok(Augment::None),
            "crop-flip" => Ok(Augment::CropFlip),
            "resized-crop-flip" => Ok(Augment::ResizedCropFlip),
            _ => Err(DatasetError::Augment { value: s.to_string() }),
        }
    }
}

impl fmt::Display for Augment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Augment::None => "none",
            Augment::CropFlip => "crop-flip",
            Augment::ResizedCropFlip => "resized-crop-flip",
        })
    }
}

/// How an evaluation image (validation, `eval`, `predict`) is brought to size×size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preprocess {
    /// torchvision's ImageNet evaluation recipe: the shorter side resized to ⌊size·256/224⌋
    /// by PIL's bilinear resize, then a center crop of size×size.
    Torchvision,
    /// The image's central square resized to size×size: what training evaluates with.
    Square,
}

impl Preprocess {
    /// `img` brought to size×size, 8-bit RGB (before normalisation).
    pub fn apply(self, img: &RgbImage, size: u32) -> RgbImage {
        match self {
            Preprocess::Torchvision => torchvision_crop(img, size),
            Preprocess::Square => center_square(img, size),
        }
    }
}

impl FromStr for Preprocess {
    type Err = DatasetError;
    fn from_str(s: &str) -> Result<Preprocess, DatasetError> {
        match s {
            "torchvision" => Ok(Preprocess::Torchvision),
            "square" => Ok(Preprocess::Square),
            _ => Err(DatasetError::Preprocess { value: s.to_string() }),
        }
    }
}

impl fmt::Display for Preprocess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Preprocess::Torchvision => "torchvision",
            Preprocess::Square => "square",
        })
    }
}

/// Per-channel mean and standard deviation of pixel values scaled to [0, 1].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Normalization {
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

impl Normalization {
    pub const IMAGENET: Normalization =
        Normalization { mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225] };
}

/// The RNG of one example's augmentation: a function of (seed, epoch, global example index)
/// only, so data-parallel training and a resumed run see exactly the same images.
pub fn example_rng(seed: u64, epoch: u64, index: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&epoch.to_le_bytes());
    key[16..24].copy_from_slice(&index.to_le_bytes());
    key[24..].copy_from_slice(b"augment\0");
    ChaCha8Rng::from_seed(key)
}

/// A training image: `augment` applied with `rng`, then normalised, as [3, size, size] f32
/// (CHW).
pub fn train_image(
    img: &RgbImage,
    size: u32,
    augment: Augment,
    rng: &mut ChaCha8Rng,
    norm: &Normalization,
) -> Vec<f32> {
    let pixels = match augment {
        Augment::None => center_square(img, size),
        Augment::CropFlip => {
            // Drawn in a fixed order: rows, columns, flip.
            let pad = size / 8;
            let dy = rng.random_range(0..=2 * pad);
            let dx = rng.random_range(0..=2 * pad);
            let flip = rng.random_bool(0.5);
            padded_crop(&center_square(img, size), pad, dx, dy, flip)
        }
        Augment::ResizedCropFlip => {
            let (x, y, w, h) = resized_crop_box(img.width(), img.height(), rng);
            let mut out = resize(&*imageops::crop_imm(img, x, y, w, h), size, size);
            if rng.random_bool(0.5) {
                imageops::flip_horizontal_in_place(&mut out);
            }
            out
        }
    };
    normalise(&pixels, norm)
}

/// An evaluation image: brought to size×size by `preprocess`, normalised.
pub fn eval_image(
    img: &RgbImage,
    size: u32,
    preprocess: Preprocess,
    norm: &Normalization,
) -> Vec<f32> {
    normalise(&preprocess.apply(img, size), norm)
}

/// Per-channel mean and std of a dataset's eval images at `size` (pixels in [0, 1]), over at
/// most `max_images` of them spread evenly over the set. A channel that does not vary gets std
/// 1/255 (one pixel level), so that normalising with the result stays finite.
pub fn channel_stats(
    ds: &Dataset,
    size: u32,
    max_images: usize,
) -> Result<Normalization, DatasetError> {
    let n = ds.len().min(max_images);
    if n == 0 || size == 0 {
        return Err(DatasetError::NoImages {
            what: format!(
                "a set of {} images measured over {max_images} at {size}×{size}",
                ds.len()
            ),
        });
    }
    let (mut sum, mut squares) = ([0f64; 3], [0f64; 3]);
    for k in 0..n {
        let i = (k as u128 * ds.len() as u128 / n as u128) as usize;
        for p in center_square(&ds.decode(i)?, size).pixels() {
            for c in 0..3 {
                let v = p[c] as f64 / 255.0;
                sum[c] += v;
                squares[c] += v * v;
            }
        }
    }
    let count = n as f64 * size as f64 * size as f64;
    let mean = sum.map(|s| s / count);
    let std = [0, 1, 2].map(|c| {
        let var = (squares[c] / count - mean[c] * mean[c]).max(0.0);
        (var.sqrt() as f32).max(1.0 / 255.0)
    });
    Ok(Normalization { mean: mean.map(|m| m as f32), std })
}

/// The image's central square (side: its shorter side) resized to size×size: torchvision's
/// Resize(size) then CenterCrop(size), with the crop taken first so that the pixels it would
/// drop are never resampled.
fn center_square(img: &RgbImage, size: u32) -> RgbImage {
    let (w, h) = img.dimensions();
    let side = w.min(h);
    resize(&*imageops::crop_imm(img, (w - side) / 2, (h - side) / 2, side, side), size, size)
}

/// torchvision's `Resize(⌊size·256/224⌋)` then `CenterCrop(size)` on a PIL image. The
/// longer side is truncated from f64 as torchvision's `int(short_size * long / short)`, and
/// the crop's offsets are rounded half to even, as Python's `round`. Only the crop is
/// resampled.
fn torchvision_crop(img: &RgbImage, size: u32) -> RgbImage {
    let (w, h) = img.dimensions();
    let short_size = (size as u64 * 256 / 224) as u32;
    let (short, long) = (w.min(h).max(1) as u64, w.max(h) as u64);
    let long_size = ((short_size as u64 * long) as f64 / short as f64) as u32;
    let (width, height) = if w <= h { (short_size, long_size) } else { (long_size, short_size) };
    let offset = |extent: u32| {
        let (half, odd) = ((extent - size) / 2, (extent - size) % 2 == 1);
        half + (odd && half % 2 == 1) as u32
    };
    let (left, top) = (offset(width), offset(height));
    super::resample::resize_window(img, width, height, left..left + size, top..top + size)
}

/// Bilinear resampling; an image of no pixels becomes black.
fn resize<I: image::GenericImageView<Pixel = Rgb<u8>>>(img: &I, w: u32, h: u32) -> RgbImage {
    imageops::resize(img, w, h, FilterType::Triangle)
}

/// The size×size window at (dx, dy) of `img` padded by `pad` black pixels on every side,
/// mirrored left-right when `flip`. Black pixels, as torchvision pads the PIL image before
/// ToTensor and Normalize: after normalisation the border is −mean/std, not 0.
fn padded_crop(img: &RgbImage, pad: u32, dx: u32, dy: u32, flip: bool) -> RgbImage {
    let (w, h) = img.dimensions();
    RgbImage::from_fn(w, h, |x, y| {
        let x = if flip { w - 1 - x } else { x };
        let (sx, sy) = ((x + dx).checked_sub(pad), (y + dy).checked_sub(pad));
        match (sx, sy) {
            (Some(sx), Some(sy)) if sx < w && sy < h => *img.get_pixel(sx, sy),
            _ => Rgb([0, 0, 0]),
        }
    })
}

/// torchvision's RandomResizedCrop box (x, y, w, h) with scale (0.08, 1) and ratio (3/4, 4/3):
/// ten tries at a random area and log-uniform aspect ratio, else the largest central box
/// within the ratio range.
fn resized_crop_box(width: u32, height: u32, rng: &mut ChaCha8Rng) -> (u32, u32, u32, u32) {
    let area = width as f32 * height as f32;
    let (min_ratio, max_ratio) = (3.0f32 / 4.0, 4.0f32 / 3.0);
    let (log_min, log_max) = (libm::logf(min_ratio), libm::logf(max_ratio));
    for _ in 0..10 {
        let target = area * rng.random_range(0.08f32..1.0);
        let ratio = libm::expf(rng.random_range(log_min..log_max));
        let w = libm::roundf(libm::sqrtf(target * ratio)) as u32;
        let h = libm::roundf(libm::sqrtf(target / ratio)) as u32;
        if 0 < w && w <= width && 0 < h && h <= height {
            let y = rng.random_range(0..=height - h);
            let x = rng.random_range(0..=width - w);
            return (x, y, w, h);
        }
    }
    let in_ratio = width as f32 / height as f32;
    let (w, h) = if in_ratio < min_ratio {
        (width, (libm::roundf(width as f32 / min_ratio) as u32).min(height))
    } else if in_ratio > max_ratio {
        ((libm::roundf(height as f32 * max_ratio) as u32).min(width), height)
    } else {
        (width, height)
    };
    ((width - w) / 2, (height - h) / 2, w, h)
}

/// CHW f32: (pixel/255 − mean)/std per channel.
fn normalise(img: &RgbImage, norm: &Normalization) -> Vec<f32> {
    let plane = img.width() as usize * img.height() as usize;
    let mut out = vec![0f32; 3 * plane];
    for (p, px) in img.pixels().enumerate() {
        for c in 0..3 {
            out[c * plane + p] = (px[c] as f32 / 255.0 - norm.mean[c]) / norm.std[c];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNIT: Normalization = Normalization { mean: [0.0; 3], std: [1.0; 3] };

    /// Pixel (x, y) = (10 + 3x, 20 + 3y, 200) (x, y < 64): every pixel distinct, none black.
    fn gradient(w: u32, h: u32) -> RgbImage {
        RgbImage::from_fn(w, h, |x, y| Rgb([(10 + 3 * x) as u8, (20 + 3 * y) as u8, 200]))
    }

    fn at(chw: &[f32], size: u32, c: usize, x: u32, y: u32) -> f32 {
        chw[c * (size * size) as usize + (y * size + x) as usize]
    }

    #[test]
    fn augment_names_round_trip() {
        for a in [Augment::None, Augment::CropFlip, Augment::ResizedCropFlip] {
            assert_eq!(a.to_string().parse::<Augment>().unwrap(), a);
        }
        let e = "flip".parse::<Augment>().unwrap_err().to_string();
        assert!(e.contains("\"flip\"") && e.contains("crop-flip"), "{e}");
    }

    #[test]
    fn preprocess_names_round_trip() {
        for p in [Preprocess::Torchvision, Preprocess::Square] {
            assert_eq!(p.to_string().parse::<Preprocess>().unwrap(), p);
        }
        let e = "center".parse::<Preprocess>().unwrap_err().to_string();
        assert!(e.contains("\"center\"") && e.contains("torchvision or square"), "{e}");
    }

    /// torchvision's sizes and offsets: the longer side truncated, the crop's offsets rounded
    /// half to even (Python's round) — 59.5 to 60, 58.5 to 58 — and a square image.
    #[test]
    fn the_torchvision_crop_is_at_torchvisions_offsets() {
        use super::super::resample::resize_window;
        let wide = gradient(201, 150);
        let want = resize_window(&wide, 343, 256, 60..284, 16..240);
        assert_eq!(Preprocess::Torchvision.apply(&wide, 224), want);
        let tall = gradient(150, 200);
        let want = resize_window(&tall, 256, 341, 16..240, 58..282);
        assert_eq!(Preprocess::Torchvision.apply(&tall, 224), want);
        // 32: shorter side to ⌊32·256/224⌋ = 36, the crop 2 in.
        let square = gradient(40, 40);
        assert_eq!(
            Preprocess::Torchvision.apply(&square, 32),
            resize_window(&square, 36, 36, 2..34, 2..34)
        );
    }

    #[test]
    fn normalisation_matches_a_hand_computation() {
        let img = RgbImage::from_pixel(1, 1, Rgb([255, 128, 0]));
        let v = eval_image(&img, 1, Preprocess::Square, &Normalization::IMAGENET);
        let expected = [(1.0 - 0.485) / 0.229, (128.0 / 255.0 - 0.456) / 0.224, -0.406 / 0.225];
        for (got, want) in v.iter().zip(expected) {
            assert!((got - want).abs() < 1e-5, "{v:?}");
        }
    }

    #[test]
    fn eval_takes_the_central_square_of_a_non_square_image() {
        // 64×32 at size 32: columns 16..48 unchanged. 128×64 at size 32: shrunk by two.
        let wide = gradient(64, 32);
        let v = eval_image(&wide, 32, Preprocess::Square, &UNIT);
        assert_eq!(v.len(), 3 * 32 * 32);
        assert_eq!(at(&v, 32, 0, 0, 0), (10.0 + 3.0 * 16.0) / 255.0);
        assert_eq!(at(&v, 32, 1, 3, 9), (20.0 + 3.0 * 9.0) / 255.0);
        let tall = RgbImage::from_fn(64, 128, |_, y| {
            if (32..96).contains(&y) {
                Rgb([0, 250, 0])
            } else {
                Rgb([250, 0, 0])
            }
        });
        let v = eval_image(&tall, 32, Preprocess::Square, &UNIT);
        assert!(v[..1024].iter().all(|&r| r == 0.0) && v[1024..2048].iter().all(|&g| g > 0.97));
    }

    #[test]
    fn the_same_key_gives_the_same_image_and_another_epoch_another() {
        let img = gradient(40, 30);
        for augment in [Augment::CropFlip, Augment::ResizedCropFlip] {
            let run = |epoch, index| {
                train_image(
                    &img,
                    32,
                    augment,
                    &mut example_rng(5, epoch, index),
                    &Normalization::IMAGENET,
                )
            };
            let a = run(0, 3);
            assert_eq!(a.len(), 3 * 32 * 32);
            assert!(a.iter().all(|v| v.is_finite()));
            assert_eq!(a, run(0, 3));
            assert_ne!(a, run(1, 3), "{augment}");
            assert_ne!(a, run(0, 4), "{augment}");
        }
        let none = train_image(&img, 32, Augment::None, &mut example_rng(5, 0, 0), &UNIT);
        assert_eq!(none, eval_image(&img, 32, Preprocess::Square, &UNIT));
    }

    #[test]
    fn crop_flip_pads_with_black_and_flips_left_right() {
        let img = gradient(8, 8);
        assert_eq!(padded_crop(&img, 1, 1, 1, false), img);
        let flipped = padded_crop(&img, 1, 1, 1, true);
        assert_eq!(flipped.get_pixel(0, 5), img.get_pixel(7, 5));
        assert_eq!(flipped.get_pixel(6, 2), img.get_pixel(1, 2));
        // Shifted right and down by one: the first column and row are the padding.
        let shifted = padded_crop(&img, 1, 0, 0, false);
        assert_eq!(shifted.get_pixel(0, 4).0, [0, 0, 0]);
        assert_eq!(shifted.get_pixel(4, 0).0, [0, 0, 0]);
        assert_eq!(shifted.get_pixel(1, 1), img.get_pixel(0, 0));
        // Through train_image at 32 (pad 4): black borders up to 4 wide, and some image has one.
        let square = gradient(32, 32);
        let black = -Normalization::IMAGENET.mean[0] / Normalization::IMAGENET.std[0];
        let mut bordered = 0;
        for index in 0..20 {
            let mut rng = example_rng(1, 0, index);
            let v = train_image(&square, 32, Augment::CropFlip, &mut rng, &Normalization::IMAGENET);
            let black_columns = (0..32).filter(|&x| at(&v, 32, 0, x, 16) == black).count();
            let black_rows = (0..32).filter(|&y| at(&v, 32, 0, 16, y) == black).count();
            assert!(black_columns <= 4 && black_rows <= 4, "{black_columns} {black_rows}");
            bordered += (black_columns + black_rows > 0) as usize;
        }
        assert!(bordered > 0);
    }

    #[test]
    fn a_resized_crop_of_a_small_image_is_upscaled() {
        let small = gradient(3, 2);
        let mut seen = std::collections::HashSet::new();
        for index in 0..10 {
            let mut rng = example_rng(0, 0, index);
            let v = train_image(&small, 24, Augment::ResizedCropFlip, &mut rng, &UNIT);
            assert_eq!(v.len(), 3 * 24 * 24);
            // Values within the image's range: red 10..=16, blue 200.
            assert!(v[..576].iter().all(|&r| (9.5 / 255.0..=16.5 / 255.0).contains(&r)));
            assert!(v[1152..].iter().all(|&b| (b - 200.0 / 255.0).abs() < 1e-6));
            seen.insert(v.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        }
        assert!(seen.len() > 1, "crops differ between examples");
        for (w, h) in [(100, 10), (10, 100), (1, 1)] {
            let (x, y, cw, ch) = resized_crop_box(w, h, &mut example_rng(0, 0, 0));
            assert!(cw >= 1 && ch >= 1 && x + cw <= w && y + ch <= h, "{w}×{h}: {cw}×{ch}");
        }
    }

    #[test]
    fn channel_stats_of_constant_images() {
        let ds = Dataset::from_images(
            vec!["a".into(), "b".into()],
            vec![
                (RgbImage::from_pixel(8, 6, Rgb([51, 102, 204])), 0),
                (RgbImage::from_pixel(5, 5, Rgb([255, 102, 0])), 1),
            ],
        );
        let both = channel_stats(&ds, 4, 10).unwrap();
        let want_mean = [153.0 / 255.0, 0.4, 102.0 / 255.0];
        let want_std = [102.0 / 255.0, 1.0 / 255.0, 102.0 / 255.0];
        for c in 0..3 {
            assert!((both.mean[c] - want_mean[c]).abs() < 1e-6, "{both:?}");
            assert!((both.std[c] - want_std[c]).abs() < 1e-6, "{both:?}");
        }
        let first = channel_stats(&ds, 4, 1).unwrap();
        assert!((first.mean[0] - 0.2).abs() < 1e-6, "{first:?}");
        assert!(channel_stats(&ds.subset(&[]), 4, 10).is_err());
    }
}
