//! Writes the seeded torchvision ResNet weights that the PyTorch fixtures and the suite both make
//! from one recipe (tests/suite/common/recipe.rs; scripts/torchvision_fixtures.py says it whole)
//! as a `state_dict` in safetensors: what `syncstep predict --weights` and the page open, where
//! torchvision's pretrained weights cannot be downloaded. Prints the SHA-256 the fixtures
//! record for them (tests/fixtures/torchvision/predict.json).
//!
//!     cargo run --release --example recipe_weights -- OUT.safetensors [ARCH=resnet18] [CLASSES=1000]

use std::path::PathBuf;

use syncstep::model::Arch;
use syncstep::tensorfile::write_f32;

#[path = "../tests/suite/common/recipe.rs"]
mod recipe;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: recipe_weights OUT.safetensors [ARCH=resnet18] [CLASSES=1000]";
    let out = PathBuf::from(args.first().ok_or(usage)?);
    let arch: Arch = args.get(1).map_or(Ok(Arch::ResNet18), |s| s.parse())?;
    let classes: u32 = args.get(2).map_or(Ok(1000), |s| s.parse())?;
    if out.exists() {
        return Err(format!("{} exists: choose a new file", out.display()).into());
    }
    let weights = recipe::weights(arch, classes);
    let entries: Vec<_> =
        weights.iter().map(|(n, (shape, v))| (n.clone(), shape.clone(), &v[..])).collect();
    write_f32(&out, &entries, &Default::default())?;
    let sha256 = recipe::sha256(weights.values().map(|(_, v)| &v[..]));
    println!("{}: {arch} recipe weights, {classes} classes, SHA-256 {sha256}", out.display());
    Ok(())
}
