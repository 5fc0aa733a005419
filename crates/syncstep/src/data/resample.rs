//! Bilinear resizing as PIL's `Image.resize(size, BILINEAR)` does it, which is what
//! torchvision's `Resize` runs on a PIL image, so that syncstep's torchvision preprocessing
//! gives PyTorch's pixels (to the unit, not merely close).
//!
//! What has to match, beyond "a triangle filter": each output pixel's filter is centred on it
//! in source coordinates and widened by the downscale factor (shrinking averages every source
//! pixel under it: the antialiasing); its window's ends are rounded half up and clamped to the
//! image; its weights are normalised to sum 1 in f64 and then quantised to 22-bit fixed point;
//! rows are resampled first into 8-bit pixels, then columns, each pass adding half a unit and
//! shifting (rounding half up) and clamping to 0..=255. The f64 steps keep PIL's order of
//! operations, so the quantised weights are PIL's bit for bit.

use std::ops::Range;

use image::Rgb;

use super::source::RgbImage;

/// Fraction bits of the fixed-point weights: 32 bits less 8 for a pixel and 2 of headroom.
const FRACTION_BITS: u32 = 22;

/// The source pixels one output pixel reads, from `first` on, and their fixed-point weights.
struct Taps {
    first: usize,
    weights: Vec<i32>,
}

/// The taps of outputs `wanted` of a resize from `input` to `output` pixels along one axis.
fn taps(input: u32, output: u32, wanted: Range<u32>) -> Vec<Taps> {
    let scale = input as f64 / output as f64;
    // The triangle spans one source pixel each side when enlarging, `scale` when shrinking.
    let support = scale.max(1.0);
    let inverse = 1.0 / support;
    wanted
        .map(|o| {
            let center = (o as f64 + 0.5) * scale;
            // `as` truncates toward zero, as PIL's int cast: adding 0.5 first rounds half up.
            let first = ((center - support + 0.5) as i64).max(0);
            let end = ((center + support + 0.5) as i64).min(input as i64);
            let raw: Vec<f64> = (first..end)
                .map(|i| (1.0 - ((i as f64 - center + 0.5) * inverse).abs()).max(0.0))
                .collect();
            // Never 0: the pixel under the centre is in the window with a weight of ½ or more.
            let sum: f64 = raw.iter().sum();
            let unit = (1u32 << FRACTION_BITS) as f64;
            let weights = raw.iter().map(|&w| (0.5 + w / sum * unit) as i32).collect();
            Taps { first: first as usize, weights }
        })
        .collect()
}

/// One channel value from fixed-point weights and the values they weigh: rounded half up,
/// clamped to 8 bits.
fn weigh(taps: &Taps, value: impl Fn(usize) -> u8) -> u8 {
    let mut acc: i32 = 1 << (FRACTION_BITS - 1);
    for (k, &w) in taps.weights.iter().enumerate() {
        acc += value(taps.first + k) as i32 * w;
    }
    (acc >> FRACTION_BITS).clamp(0, 255) as u8
}

/// The window `columns` × `rows` of `img` resized to `width`×`height`, as PIL's bilinear
/// resize, then cropped, would give it: the pixels the crop drops are never computed.
pub fn resize_window(
    img: &RgbImage,
    width: u32,
    height: u32,
    columns: Range<u32>,
    rows: Range<u32>,
) -> RgbImage {
    let (w, h) = img.dimensions();
    let mut out = RgbImage::new(columns.len() as u32, rows.len() as u32);
    if w == 0 || h == 0 {
        return out;
    }
    let across = taps(w, width, columns);
    let down = taps(h, height, rows);
    // The horizontal pass covers only the source rows the vertical one reads.
    let top = down.iter().map(|t| t.first).min().unwrap_or(0);
    let bottom = down.iter().map(|t| t.first + t.weights.len()).max().unwrap_or(0);
    let wide = RgbImage::from_fn(across.len() as u32, (bottom - top) as u32, |x, y| {
        let t = &across[x as usize];
        let row = top as u32 + y;
        Rgb([0, 1, 2].map(|c| weigh(t, |i| img.get_pixel(i as u32, row)[c])))
    });
    for (y, t) in down.iter().enumerate() {
        for x in 0..wide.width() {
            let px = Rgb([0, 1, 2].map(|c| weigh(t, |i| wide.get_pixel(x, (i - top) as u32)[c])));
            out.put_pixel(x, y as u32, px);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_are_pils_on_a_hand_computed_case() {
        // 4 → 2: scale 2, support 2. Output 0 is centred at 1.0 and reads pixels 0..3 with
        // triangle weights 0.75, 0.75, 0.25 (sum 1.75).
        let t = taps(4, 2, 0..2);
        assert_eq!(t[0].first, 0);
        let unit = (1u32 << FRACTION_BITS) as f64;
        let want: Vec<i32> =
            [0.75, 0.75, 0.25].iter().map(|w| (0.5 + w / 1.75 * unit) as i32).collect();
        assert_eq!(t[0].weights, want);
        // Output 1, centred at 3.0: pixels 1..4 (the window clamped at the image's end).
        assert_eq!((t[1].first, t[1].weights.len()), (1, 3));
    }

    #[test]
    fn the_same_size_is_the_identity_and_a_flat_image_stays_flat() {
        let img = RgbImage::from_fn(7, 5, |x, y| Rgb([(x * 30) as u8, (y * 40) as u8, 9]));
        assert_eq!(resize_window(&img, 7, 5, 0..7, 0..5), img);
        let flat = RgbImage::from_pixel(9, 13, Rgb([200, 3, 77]));
        let small = resize_window(&flat, 4, 5, 0..4, 0..5);
        assert!(small.pixels().all(|p| p.0 == [200, 3, 77]));
        let big = resize_window(&flat, 20, 31, 2..12, 5..25);
        assert_eq!(big.dimensions(), (10, 20));
        assert!(big.pixels().all(|p| p.0 == [200, 3, 77]));
    }

    #[test]
    fn a_window_is_the_same_part_of_the_whole_resize() {
        let img = RgbImage::from_fn(23, 17, |x, y| Rgb([(x * 11) as u8, (y * 15) as u8, 128]));
        let whole = resize_window(&img, 9, 40, 0..9, 0..40);
        let part = resize_window(&img, 9, 40, 3..8, 10..31);
        for (x, y, px) in part.enumerate_pixels() {
            assert_eq!(px, whole.get_pixel(x + 3, y + 10));
        }
        assert_eq!(resize_window(&RgbImage::new(0, 4), 3, 3, 0..3, 0..3), RgbImage::new(3, 3));
    }
}
