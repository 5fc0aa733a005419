//! Writes an ImageFolder of PNG files (`DIR/<class>/<n>.png`) drawn from the synthetic dataset,
//! to try `syncstep train --data DIR`, `eval` and `predict` without a dataset at hand:
//!
//!     cargo run --release --example make_image_folder -- /tmp/shapes 1000 [size] [classes]

use std::path::PathBuf;

use syncstep::data::synthetic::{class_name, synthetic_image};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: make_image_folder DIR IMAGES [SIZE=48] [CLASSES=10]";
    let dir = PathBuf::from(args.first().ok_or(usage)?);
    let count: u64 = args.get(1).ok_or(usage)?.parse()?;
    let size: u32 = args.get(2).map_or(Ok(48), |s| s.parse())?;
    let classes: u32 = args.get(3).map_or(Ok(10), |s| s.parse())?;
    if dir.exists() {
        return Err(format!("{} exists: choose a new folder", dir.display()).into());
    }
    for index in 0..count {
        let (pixels, label) = synthetic_image(7, index, size, size, classes);
        let plane = (size * size) as usize;
        // The synthetic images are roughly N(0, 1): map ±2.5 σ onto 0..255.
        let byte = |v: f32| ((v / 5.0 + 0.5) * 255.0).clamp(0.0, 255.0) as u8;
        let rgb: Vec<u8> =
            (0..plane).flat_map(|p| [0, 1, 2].map(|c| byte(pixels[c * plane + p]))).collect();
        let folder = dir.join(class_name(label).replace(' ', "_"));
        std::fs::create_dir_all(&folder)?;
        image::RgbImage::from_raw(size, size, rgb)
            .ok_or("image buffer of the wrong size")?
            .save(folder.join(format!("{index:06}.png")))?;
    }
    println!("{count} images of {size}×{size} in {classes} classes under {}", dir.display());
    Ok(())
}
