//! Writes seeded ResNet weights (random BatchNorm γ, β) and a synthetic batch in one
//! safetensors file with torchvision's names: the inputs of `syncstep grad`, which PyTorch
//! loads as they are. scripts/pytorch_fixtures.py runs it to make the PyTorch fixtures that
//! tests/suite/pytorch.rs holds the step to.
//!
//!     cargo run --release --example step_inputs -- OUT.safetensors SEED IMAGES [SIZE=32] [CLASSES=10] [ARCH=resnet34]

use std::path::PathBuf;

use syncstep::checkpoint::write_seeded_inputs;
use syncstep::model::{Arch, ResNet};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage =
        "usage: step_inputs OUT.safetensors SEED IMAGES [SIZE=32] [CLASSES=10] [ARCH=resnet34]";
    let out = PathBuf::from(args.first().ok_or(usage)?);
    let seed: u64 = args.get(1).ok_or(usage)?.parse()?;
    let images: usize = args.get(2).ok_or(usage)?.parse()?;
    let size: u32 = args.get(3).map_or(Ok(32), |s| s.parse())?;
    let classes: u32 = args.get(4).map_or(Ok(10), |s| s.parse())?;
    let arch: Arch = args.get(5).map_or(Ok(Arch::default()), |s| s.parse())?;
    if out.exists() {
        return Err(format!("{} exists: choose a new file", out.display()).into());
    }
    write_seeded_inputs(&out, &ResNet::new(arch, classes)?, seed, images, size, &[])?;
    println!(
        "{}: {arch}, seed {seed}, {images} images of {size}×{size}, {classes} classes",
        out.display()
    );
    Ok(())
}
