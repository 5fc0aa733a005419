//! The seeded weights that the PyTorch fixtures and the suite both make from one recipe
//! (scripts/torchvision_fixtures.py says it whole), so that no weights need be stored: for the
//! tensor `name` with n elements, n values u in [-1, 1) from its name, then scaled by kind.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};
use syncstep::model::{Arch, ResNet};

/// The recipe's u for the tensor `name`: n values in [-1, 1), exact in f32.
pub fn uniform(name: &str, n: usize) -> Vec<f32> {
    let fnv = name
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3));
    (0..n as u64)
        .map(|i| {
            let mut z = fnv.wrapping_add(i).wrapping_add(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            (z >> 40) as f32 * 2f32.powi(-23) - 1.0
        })
        .collect()
}

/// The recipe's tensors of `arch` with `classes` classes, by name: every parameter and running
/// statistic.
pub fn weights(arch: Arch, classes: u32) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let model = ResNet::new(arch, classes).unwrap();
    let mut out = BTreeMap::new();
    for spec in model.params.iter().chain(&model.buffers) {
        let (name, shape) = (spec.name.as_str(), &spec.shape);
        let u = uniform(name, shape.iter().product());
        let values: Vec<f32> = if let [_, c, kh, kw] = shape[..] {
            let scale = (6.0 / (c * kh * kw) as f64).sqrt() as f32;
            u.iter().map(|v| v * scale).collect()
        } else if name.ends_with("running_var") {
            u.iter().map(|v| 1.0 + 0.5 * v).collect()
        } else if name.ends_with("running_mean") || name.ends_with("bias") || name == "fc.weight" {
            u.iter().map(|v| 0.1 * v).collect()
        } else {
            u.iter().map(|v| 0.7 + 0.25 * v).collect()
        };
        out.insert(name.to_string(), (shape.clone(), values));
    }
    out
}

/// The SHA-256 of float tensors as the script takes it: each one's f32 bytes, in name order.
pub fn sha256<'a>(tensors: impl IntoIterator<Item = &'a [f32]>) -> String {
    let mut hash = Sha256::new();
    for values in tensors {
        hash.update(bytemuck::cast_slice::<f32, u8>(values));
    }
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}
