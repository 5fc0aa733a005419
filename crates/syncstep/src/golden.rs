//! The PORTABLE gate's golden summary: what one build's single-device step at the global batch
//! computed (the loss, each gradient tensor's L2 norm and a fixed sample of its elements) and
//! the activation pattern it ran on, so that another build (the wasm module in a browser) can
//! run the same step on the same pattern and be held to it. `syncstep check --golden PATH`
//! writes it; the page reads `golden.json` and hands the text to `check::run_check_on`.
//!
//! The pattern travels with the figures because ReLU inputs within f32 rounding of 0 fall on
//! different sides on different implementations (lavapipe, SwiftShader, a real GPU), and one
//! flip moves gradients far past any bound (docs/design.md, "Same activation pattern"). The run
//! being checked imposes the golden's ReLU masks and pool argmaxes, and reports separately how
//! many units its own free pattern would have flipped.
//!
//! Format (JSON): the settings it was made at (`replicas`, `batch_per_replica`,
//! `image_size`, `classes`, `seed`), `adapter`, `loss`, `samples_per_tensor`, `tensors`:
//! `[{name, len, norm, sample}]` with `sample` the elements at [`sample_indices`], and
//! `pattern`: `{relu: [{units, bits}], pool_argmax: {units, u32le}}`, where `bits` is one ReLU
//! site's mask packed 8 units a byte, least significant bit first, and `u32le` the argmaxes as
//! little-endian u32s, both base64 (RFC 4648, padded).

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use serde::{Deserialize, Serialize};

use crate::compare::{l2, sample_indices, summary_error};
use crate::model::{ActivationPattern, Arch, ResNet};

pub use crate::compare::SAMPLES_PER_TENSOR;
/// The format's version, written as `format`; a reader refuses others.
const FORMAT: u64 = 2;

#[derive(Debug, thiserror::Error)]
pub enum GoldenError {
    #[error("golden file: {0}")]
    Json(#[from] serde_json::Error),
    #[error("golden file: {0}")]
    Format(String),
    #[error("the golden file was made for {golden}, this run is {run}: write one for these settings (syncstep check --golden PATH)")]
    Settings { golden: String, run: String },
}

pub type Result<T, E = GoldenError> = std::result::Result<T, E>;

/// One gradient tensor's summary.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GoldenTensor {
    pub name: String,
    pub len: usize,
    /// ‖g‖₂ of the whole tensor, in f64.
    pub norm: f64,
    /// g at [`sample_indices`]`(len)`.
    pub sample: Vec<f32>,
}

/// The settings of a check a golden is made at, and a run must match to be held to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GoldenSettings {
    /// Absent from files written before there was a choice: those are ResNet-34's.
    #[serde(default)]
    pub arch: Arch,
    pub replicas: usize,
    pub batch_per_replica: usize,
    pub global_batch: usize,
    pub image_size: u32,
    pub classes: u32,
    pub seed: u64,
}

impl std::fmt::Display for GoldenSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let GoldenSettings {
            arch, replicas, global_batch, image_size: size, classes, seed, ..
        } = self;
        write!(
            f,
            "{arch}, {replicas} replicas, {global_batch} images, {size}×{size}, {classes} classes, seed {seed}"
        )
    }
}

/// A single-device step at the global batch of a check configuration, summarised.
#[derive(Clone, Debug, PartialEq)]
pub struct Golden {
    pub settings: GoldenSettings,
    /// Where it was computed: "llvmpipe (LLVM 15.0.6, 256 bits), Vulkan".
    pub adapter: String,
    pub loss: f32,
    pub tensors: Vec<GoldenTensor>,
    pub pattern: ActivationPattern,
}

impl Golden {
    /// The summary of a step of `model` at the global batch of a check at `settings`: its
    /// loss, its flat gradient and the pattern it ran on.
    pub fn of_step(
        settings: GoldenSettings,
        model: &ResNet,
        adapter: &str,
        loss: f32,
        grads: &[f32],
        pattern: &ActivationPattern,
    ) -> Golden {
        let tensors = model
            .params
            .iter()
            .map(|spec| {
                let g = &grads[spec.range()];
                GoldenTensor {
                    name: spec.name.clone(),
                    len: spec.len(),
                    norm: l2(g),
                    sample: sample_indices(g.len()).map(|i| g[i]).collect(),
                }
            })
            .collect();
        Golden { settings, adapter: adapter.to_string(), loss, tensors, pattern: pattern.clone() }
    }

    /// An error unless this golden was made at the `run`'s settings for `model`'s tensors.
    pub fn check_fits(&self, run: &GoldenSettings, model: &ResNet) -> Result<()> {
        if self.settings != *run {
            let (golden, run) = (self.settings.to_string(), run.to_string());
            return Err(GoldenError::Settings { golden, run });
        }
        let names = |t: &GoldenTensor| (t.name.clone(), t.len);
        if !self
            .tensors
            .iter()
            .map(names)
            .eq(model.params.iter().map(|p| (p.name.clone(), p.len())))
        {
            return Err(GoldenError::Format(
                "its tensors are not this model's (names or sizes differ)".into(),
            ));
        }
        Ok(())
    }

    /// Per parameter tensor (model order), how far `grads` (flat, model layout) is from this:
    /// the larger of the sample's norm-rel error and the relative error of the tensor's norm.
    /// Call [`Golden::check_fits`] first.
    pub fn tensor_errors(&self, model: &ResNet, grads: &[f32]) -> Vec<f64> {
        model
            .params
            .iter()
            .zip(&self.tensors)
            .map(|(spec, want)| summary_error(&grads[spec.range()], want.norm, &want.sample))
            .collect()
    }

    pub fn to_json(&self) -> String {
        let relu = self
            .pattern
            .relu
            .iter()
            .map(|mask| PackedMask { units: mask.len(), bits: BASE64.encode(pack_bits(mask)) });
        let argmax: Vec<u8> =
            self.pattern.pool_argmax.iter().flat_map(|a| a.to_le_bytes()).collect();
        let file = GoldenFile {
            golden: "syncstep single-device step at the global batch".into(),
            format: FORMAT,
            settings: self.settings,
            adapter: self.adapter.clone(),
            loss: self.loss,
            samples_per_tensor: SAMPLES_PER_TENSOR,
            tensors: self.tensors.clone(),
            pattern: PatternFile {
                relu: relu.collect(),
                pool_argmax: PackedArgmax {
                    units: self.pattern.pool_argmax.len(),
                    u32le: BASE64.encode(argmax),
                },
            },
        };
        serde_json::to_string(&file).expect("a golden file serialises")
    }

    pub fn from_json(text: &str) -> Result<Golden> {
        let doc: serde_json::Value = serde_json::from_str(text)?;
        let format = doc.get("format").and_then(serde_json::Value::as_u64);
        if format != Some(FORMAT) {
            let found = format.map_or("no format".to_string(), |f| format!("format {f}"));
            return Err(GoldenError::Format(format!("{found}, this build reads format {FORMAT}")));
        }
        let file: GoldenFile = serde_json::from_value(doc)?;
        for t in &file.tensors {
            if t.sample.len() != t.len.min(SAMPLES_PER_TENSOR) {
                let why = format!("{} values for a tensor of {}", t.sample.len(), t.len);
                return Err(bad(&format!("{}.sample", t.name), &why));
            }
        }
        let relu = file
            .pattern
            .relu
            .iter()
            .enumerate()
            .map(|(site, m)| {
                let what = format!("pattern.relu[{site}]");
                let bytes = BASE64.decode(&m.bits).map_err(|e| bad(&what, &e.to_string()))?;
                if bytes.len() != m.units.div_ceil(8) {
                    return Err(bad(
                        &what,
                        &format!("{} bytes for {} units", bytes.len(), m.units),
                    ));
                }
                Ok((0..m.units).map(|i| (bytes[i / 8] >> (i % 8)) & 1).collect())
            })
            .collect::<Result<_>>()?;
        let pool = &file.pattern.pool_argmax;
        let bytes =
            BASE64.decode(&pool.u32le).map_err(|e| bad("pattern.pool_argmax", &e.to_string()))?;
        if bytes.len() != 4 * pool.units {
            let why = format!("{} bytes for {} u32s", bytes.len(), pool.units);
            return Err(bad("pattern.pool_argmax", &why));
        }
        let pool_argmax =
            bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        Ok(Golden {
            settings: file.settings,
            adapter: file.adapter,
            loss: file.loss,
            tensors: file.tensors,
            pattern: ActivationPattern { relu, pool_argmax },
        })
    }
}

/// The file as stored: a [`Golden`] with its pattern packed (see the module comment).
#[derive(Serialize, Deserialize)]
struct GoldenFile {
    golden: String,
    format: u64,
    #[serde(flatten)]
    settings: GoldenSettings,
    adapter: String,
    loss: f32,
    samples_per_tensor: usize,
    tensors: Vec<GoldenTensor>,
    pattern: PatternFile,
}

#[derive(Serialize, Deserialize)]
struct PatternFile {
    relu: Vec<PackedMask>,
    pool_argmax: PackedArgmax,
}

/// One ReLU site's mask, 8 units a byte, base64.
#[derive(Serialize, Deserialize)]
struct PackedMask {
    units: usize,
    bits: String,
}

/// The pool's argmaxes as little-endian u32s, base64.
#[derive(Serialize, Deserialize)]
struct PackedArgmax {
    units: usize,
    u32le: String,
}

fn bad(what: &str, why: &str) -> GoldenError {
    GoldenError::Format(format!("`{what}`: {why}"))
}

/// A 0/1 mask, 8 units a byte, least significant bit first.
fn pack_bits(mask: &[u8]) -> Vec<u8> {
    mask.chunks(8)
        .map(|c| c.iter().enumerate().fold(0u8, |byte, (i, &m)| byte | ((m != 0) as u8) << i))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_pack_eight_units_a_byte_least_significant_first() {
        assert_eq!(pack_bits(&[1, 0, 0, 1, 1, 1, 0, 1, 1]), [0b1011_1001, 0b1]);
        assert_eq!(pack_bits(&[]), Vec::<u8>::new());
    }

    fn settings(batch_per_replica: usize) -> GoldenSettings {
        let global_batch = 2 * batch_per_replica;
        GoldenSettings {
            arch: Arch::ResNet34,
            replicas: 2,
            batch_per_replica,
            global_batch,
            image_size: 32,
            classes: 10,
            seed: 0,
        }
    }

    fn golden() -> (ResNet, Vec<f32>, Golden) {
        let model = ResNet::new(Arch::ResNet34, 10).unwrap();
        let grads: Vec<f32> =
            (0..model.param_len).map(|i| ((i % 97) as f32 - 48.0) * 1e-3).collect();
        let pattern = ActivationPattern {
            relu: vec![vec![1, 0, 0, 1, 1, 1, 0, 1, 1], vec![0; 3]],
            pool_argmax: vec![7, 0, u32::MAX],
        };
        let g = Golden::of_step(settings(4), &model, "an \"adapter\"", 2.4901247, &grads, &pattern);
        (model, grads, g)
    }

    #[test]
    fn a_golden_reads_back_exactly_and_holds_its_own_step_to_zero() {
        let (model, grads, g) = golden();
        let back = Golden::from_json(&g.to_json()).unwrap();
        assert_eq!(back, g);
        back.check_fits(&settings(4), &model).unwrap();
        assert!(back.tensor_errors(&model, &grads).iter().all(|&e| e == 0.0));
        let mut off = grads.clone();
        off[model.param("layer2.1.conv1.weight").unwrap().offset] *= 2.0;
        let errors = back.tensor_errors(&model, &off);
        let worst = errors.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap();
        assert_eq!(model.params[worst.0].name, "layer2.1.conv1.weight");
        assert!(*worst.1 > 0.0 && errors.iter().filter(|&&e| e > 0.0).count() == 1);
    }

    #[test]
    fn a_golden_for_other_settings_or_a_broken_file_is_refused_with_the_reason() {
        let (model, _, g) = golden();
        let e = g.check_fits(&settings(8), &model).unwrap_err().to_string();
        assert!(e.contains("2 replicas, 8 images") && e.contains("2 replicas, 16 images"), "{e}");
        let other = GoldenSettings { arch: Arch::ResNet18, ..settings(4) };
        let e = g.check_fits(&other, &model).unwrap_err().to_string();
        assert!(e.contains("made for resnet34,") && e.contains("this run is resnet18,"), "{e}");
        let text = g.to_json();
        // A file from before there was a choice of network is ResNet-34's.
        let old = Golden::from_json(&text.replace("\"arch\":\"resnet34\",", "")).unwrap();
        assert!(!old.to_json().is_empty() && old.settings.arch == Arch::ResNet34);
        assert_ne!(old.to_json(), text.replace("\"arch\":\"resnet34\",", ""));
        let e = Golden::from_json(&text.replace("\"format\":2", "\"format\":3"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("format 3"), "{e}");
        let e = Golden::from_json(&text.replace("\"units\":9", "\"units\":17"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("pattern.relu[0]") && e.contains("2 bytes for 17 units"), "{e}");
        let e = Golden::from_json(&text[..text.len() / 2]).unwrap_err().to_string();
        assert!(e.starts_with("golden file: ") && e.contains("column"), "{e}");
    }
}
