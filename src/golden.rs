//! The PORTABLE gate's golden summary: what one build's single-device step at the global batch
//! computed (the loss, each gradient tensor's L2 norm and a fixed sample of its elements) and
//! the activation pattern it ran on, so that another build (the wasm module in a browser) can
//! run the same step on the same pattern and be held to it. `syncstep check --golden PATH`
//! writes it; the page reads `golden.json` and hands the text to `check::run_check_on`.
//!
//! The pattern travels with the figures because ReLU inputs within f32 rounding of 0 fall on
//! different sides on different implementations (lavapipe, SwiftShader, a real GPU), and one
//! flip moves gradients far past any bound (DESIGN.md, "same activation pattern"). The run
//! being checked imposes the golden's ReLU masks and pool argmaxes, and reports separately how
//! many units its own free pattern would have flipped.
//!
//! Format (JSON, `crate::json`): the settings it was made at (`replicas`, `batch_per_replica`,
//! `image_size`, `classes`, `seed`), `adapter`, `loss`, `samples_per_tensor`, `tensors`:
//! `[{name, len, norm, sample}]` with `sample` the elements at [`sample_indices`], and
//! `pattern`: `{relu: [{units, bits}], pool_argmax: {units, u32le}}`, where `bits` is one ReLU
//! site's mask packed 8 units a byte, least significant bit first, and `u32le` the argmaxes as
//! little-endian u32s, both base64 (RFC 4648, padded).

use crate::check::{norm_rel, CheckConfig};
use crate::json::{self, Value};
use crate::model::{ActivationPattern, ResNet34};

/// Elements sampled per gradient tensor (all of them in smaller tensors).
pub const SAMPLES_PER_TENSOR: usize = 64;
/// The format's version, written as `format`; a reader refuses others.
const FORMAT: u64 = 1;

#[derive(Debug, thiserror::Error)]
pub enum GoldenError {
    #[error("golden file: {0}")]
    Json(#[from] json::ParseError),
    #[error("golden file: {0}")]
    Format(String),
    #[error("the golden file was made for {golden}, this run is {run}: write one for these settings (syncstep check --golden PATH)")]
    Settings { golden: String, run: String },
}

pub type Result<T, E = GoldenError> = std::result::Result<T, E>;

/// One gradient tensor's summary.
#[derive(Clone, Debug, PartialEq)]
pub struct GoldenTensor {
    pub name: String,
    pub len: usize,
    /// ‖g‖₂ of the whole tensor, in f64.
    pub norm: f64,
    /// g at [`sample_indices`]`(len)`.
    pub sample: Vec<f32>,
}

/// A single-device step at the global batch of a check configuration, summarised.
#[derive(Clone, Debug, PartialEq)]
pub struct Golden {
    pub replicas: usize,
    pub batch: usize,
    pub image_size: u32,
    pub classes: u32,
    pub seed: u64,
    /// Where it was computed: "llvmpipe (LLVM 15.0.6, 256 bits), Vulkan".
    pub adapter: String,
    pub loss: f32,
    pub tensors: Vec<GoldenTensor>,
    pub pattern: ActivationPattern,
}

/// `min(len, SAMPLES_PER_TENSOR)` evenly spaced indices of a tensor of `len` elements: ⌊i·len/n⌋.
pub fn sample_indices(len: usize) -> impl Iterator<Item = usize> {
    let n = len.min(SAMPLES_PER_TENSOR);
    (0..n).map(move |i| i * len / n)
}

fn settings_text(replicas: usize, batch: usize, size: u32, classes: u32, seed: u64) -> String {
    format!("{replicas} replicas × {batch} images, {size}×{size}, {classes} classes, seed {seed}")
}

impl Golden {
    /// The summary of a step of `model` at `cfg`'s global batch: its loss, its flat gradient
    /// and the pattern it ran on.
    pub fn of_step(
        cfg: &CheckConfig,
        model: &ResNet34,
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
        Golden {
            replicas: cfg.replicas,
            batch: cfg.batch,
            image_size: cfg.image_size,
            classes: cfg.classes,
            seed: cfg.seed,
            adapter: adapter.to_string(),
            loss,
            tensors,
            pattern: pattern.clone(),
        }
    }

    /// An error unless this golden was made at `cfg`'s settings for `model`'s tensors.
    pub fn check_fits(&self, cfg: &CheckConfig, model: &ResNet34) -> Result<()> {
        let golden =
            settings_text(self.replicas, self.batch, self.image_size, self.classes, self.seed);
        let run = settings_text(cfg.replicas, cfg.batch, cfg.image_size, cfg.classes, cfg.seed);
        if golden != run {
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
    pub fn tensor_errors(&self, model: &ResNet34, grads: &[f32]) -> Vec<f64> {
        model
            .params
            .iter()
            .zip(&self.tensors)
            .map(|(spec, want)| {
                let g = &grads[spec.range()];
                let sample: Vec<f32> = sample_indices(g.len()).map(|i| g[i]).collect();
                let norm = l2(g);
                let norm_err =
                    if want.norm == 0.0 { norm } else { (norm - want.norm).abs() / want.norm };
                norm_rel(&sample, &want.sample).max(if norm_err.is_nan() {
                    f64::INFINITY
                } else {
                    norm_err
                })
            })
            .collect()
    }

    pub fn to_json(&self) -> String {
        let tensors = self.tensors.iter().map(|t| {
            json::Object::new()
                .str("name", &t.name)
                .int("len", t.len as u64)
                .num("norm", t.norm)
                .raw("sample", &json::array(t.sample.iter().map(|&v| json::number(v as f64))))
                .finish()
        });
        let relu = self.pattern.relu.iter().map(|mask| {
            json::Object::new()
                .int("units", mask.len() as u64)
                .str("bits", &base64_encode(&pack_bits(mask)))
                .finish()
        });
        let argmax: Vec<u8> =
            self.pattern.pool_argmax.iter().flat_map(|a| a.to_le_bytes()).collect();
        let pool = json::Object::new()
            .int("units", self.pattern.pool_argmax.len() as u64)
            .str("u32le", &base64_encode(&argmax))
            .finish();
        json::Object::new()
            .str("golden", "syncstep single-device step at the global batch")
            .int("format", FORMAT)
            .int("replicas", self.replicas as u64)
            .int("batch_per_replica", self.batch as u64)
            .int("image_size", self.image_size.into())
            .int("classes", self.classes.into())
            .int("seed", self.seed)
            .str("adapter", &self.adapter)
            .num("loss", self.loss as f64)
            .int("samples_per_tensor", SAMPLES_PER_TENSOR as u64)
            .raw("tensors", &json::array(tensors))
            .raw(
                "pattern",
                &json::Object::new()
                    .raw("relu", &json::array(relu))
                    .raw("pool_argmax", &pool)
                    .finish(),
            )
            .finish()
    }

    pub fn from_json(text: &str) -> Result<Golden> {
        let doc = json::parse(text)?;
        let format = uint(&doc, "format")?;
        if format != FORMAT {
            return Err(GoldenError::Format(format!(
                "format {format}, this build reads format {FORMAT}"
            )));
        }
        let small = |key: &str| -> Result<u32> {
            u32::try_from(uint(&doc, key)?).map_err(|_| bad(key, "too large"))
        };
        let tensors = field(&doc, "tensors")?
            .as_array()
            .ok_or_else(|| bad("tensors", "not an array"))?
            .iter()
            .map(|t| {
                let name = string(t, "name")?.to_string();
                let len = uint(t, "len")? as usize;
                let sample =
                    numbers(field(t, "sample")?).map_err(|e| bad(&format!("{name}.sample"), &e))?;
                if sample.len() != len.min(SAMPLES_PER_TENSOR) {
                    return Err(bad(
                        &format!("{name}.sample"),
                        &format!("{} values for a tensor of {len}", sample.len()),
                    ));
                }
                Ok(GoldenTensor {
                    norm: float(t, "norm")?,
                    sample: sample.iter().map(|&v| v as f32).collect(),
                    name,
                    len,
                })
            })
            .collect::<Result<_>>()?;
        let pattern = field(&doc, "pattern")?;
        let relu = field(pattern, "relu")?
            .as_array()
            .ok_or_else(|| bad("pattern.relu", "not an array"))?
            .iter()
            .enumerate()
            .map(|(site, m)| {
                let units = uint(m, "units")? as usize;
                let bytes = base64_decode(string(m, "bits")?)
                    .map_err(|e| bad(&format!("pattern.relu[{site}]"), &e))?;
                if bytes.len() != units.div_ceil(8) {
                    return Err(bad(
                        &format!("pattern.relu[{site}]"),
                        &format!("{} bytes for {units} units", bytes.len()),
                    ));
                }
                Ok((0..units).map(|i| (bytes[i / 8] >> (i % 8)) & 1).collect())
            })
            .collect::<Result<_>>()?;
        let pool = field(pattern, "pool_argmax")?;
        let units = uint(pool, "units")? as usize;
        let bytes =
            base64_decode(string(pool, "u32le")?).map_err(|e| bad("pattern.pool_argmax", &e))?;
        if bytes.len() != 4 * units {
            return Err(bad(
                "pattern.pool_argmax",
                &format!("{} bytes for {units} u32s", bytes.len()),
            ));
        }
        let pool_argmax =
            bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        Ok(Golden {
            replicas: uint(&doc, "replicas")? as usize,
            batch: uint(&doc, "batch_per_replica")? as usize,
            image_size: small("image_size")?,
            classes: small("classes")?,
            seed: uint(&doc, "seed")?,
            adapter: string(&doc, "adapter")?.to_string(),
            loss: float(&doc, "loss")? as f32,
            tensors,
            pattern: ActivationPattern { relu, pool_argmax },
        })
    }
}

fn l2(v: &[f32]) -> f64 {
    v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt()
}

fn bad(what: &str, why: &str) -> GoldenError {
    GoldenError::Format(format!("`{what}`: {why}"))
}

fn field<'v>(v: &'v Value, key: &str) -> Result<&'v Value> {
    v.get(key).ok_or_else(|| bad(key, "missing"))
}

fn string<'v>(v: &'v Value, key: &str) -> Result<&'v str> {
    field(v, key)?.as_str().ok_or_else(|| bad(key, "not a string"))
}

fn float(v: &Value, key: &str) -> Result<f64> {
    field(v, key)?.as_f64().ok_or_else(|| bad(key, "not a number"))
}

fn uint(v: &Value, key: &str) -> Result<u64> {
    let x = float(v, key)?;
    // Integers up to 2^53 are exact in f64, and nothing here comes near.
    if x >= 0.0 && x.fract() == 0.0 && x < 2f64.powi(53) {
        Ok(x as u64)
    } else {
        Err(bad(key, "not a whole number ≥ 0"))
    }
}

fn numbers(v: &Value) -> std::result::Result<Vec<f64>, String> {
    let items = v.as_array().ok_or("not an array")?;
    items.iter().map(|x| x.as_f64().ok_or_else(|| "holds a non-number".to_string())).collect()
}

/// A 0/1 mask, 8 units a byte, least significant bit first.
fn pack_bits(mask: &[u8]) -> Vec<u8> {
    mask.chunks(8)
        .map(|c| c.iter().enumerate().fold(0u8, |byte, (i, &m)| byte | ((m != 0) as u8) << i))
        .collect()
}

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for k in 0..4 {
            out.push(if k <= chunk.len() {
                BASE64[(n >> (18 - 6 * k) & 63) as usize] as char
            } else {
                '='
            });
        }
    }
    out
}

fn base64_decode(text: &str) -> std::result::Result<Vec<u8>, String> {
    let text = text.as_bytes();
    if !text.len().is_multiple_of(4) {
        return Err("base64 length is not a multiple of 4".into());
    }
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    for (q, quad) in text.chunks(4).enumerate() {
        let last = q + 1 == text.len() / 4;
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            return Err("misplaced base64 padding".into());
        }
        let mut n = 0u32;
        for &c in &quad[..4 - pad] {
            let v = BASE64
                .iter()
                .position(|&a| a == c)
                .ok_or_else(|| format!("`{}` is not base64", c as char))?;
            n = n << 6 | v as u32;
        }
        n <<= 6 * pad as u32;
        out.extend_from_slice(&[(n >> 16) as u8, (n >> 8) as u8, n as u8][..3 - pad]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_and_matches_rfc_4648() {
        for (plain, coded) in
            [("", ""), ("f", "Zg=="), ("fo", "Zm8="), ("foo", "Zm9v"), ("foobar", "Zm9vYmFy")]
        {
            assert_eq!(base64_encode(plain.as_bytes()), coded);
            assert_eq!(base64_decode(coded).unwrap(), plain.as_bytes());
        }
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(base64_decode(&base64_encode(&all)).unwrap(), all);
        assert!(
            base64_decode("Zg=").is_err()
                && base64_decode("Z===").is_err()
                && base64_decode("Zg==Zm8=").is_err()
                && base64_decode("Zm*v").is_err()
        );
    }

    #[test]
    fn samples_are_evenly_spaced_and_cover_small_tensors() {
        assert_eq!(sample_indices(10).collect::<Vec<_>>(), (0..10).collect::<Vec<_>>());
        let big: Vec<usize> = sample_indices(640).collect();
        assert_eq!((big.len(), big[1], big[63]), (64, 10, 630));
    }

    fn golden() -> (ResNet34, Vec<f32>, Golden) {
        let model = ResNet34::new(10).unwrap();
        let grads: Vec<f32> =
            (0..model.param_len).map(|i| ((i % 97) as f32 - 48.0) * 1e-3).collect();
        let pattern = ActivationPattern {
            relu: vec![vec![1, 0, 0, 1, 1, 1, 0, 1, 1], vec![0; 3]],
            pool_argmax: vec![7, 0, u32::MAX],
        };
        let cfg = CheckConfig { replicas: 2, batch: 4, ..Default::default() };
        let g = Golden::of_step(&cfg, &model, "an \"adapter\"", 2.4901247, &grads, &pattern);
        (model, grads, g)
    }

    #[test]
    fn a_golden_reads_back_exactly_and_holds_its_own_step_to_zero() {
        let (model, grads, g) = golden();
        let back = Golden::from_json(&g.to_json()).unwrap();
        assert_eq!(back, g);
        let cfg = CheckConfig { replicas: 2, batch: 4, ..Default::default() };
        back.check_fits(&cfg, &model).unwrap();
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
        let e = g
            .check_fits(&CheckConfig { replicas: 2, batch: 8, ..Default::default() }, &model)
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 replicas × 4 images") && e.contains("2 replicas × 8 images"), "{e}");
        let text = g.to_json();
        let e = Golden::from_json(&text.replace("\"format\":1", "\"format\":2"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("format 2"), "{e}");
        let e = Golden::from_json(&text.replace("\"units\":9", "\"units\":17"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("pattern.relu[0]") && e.contains("2 bytes for 17 units"), "{e}");
        assert!(Golden::from_json(&text[..text.len() / 2])
            .unwrap_err()
            .to_string()
            .starts_with("golden file: JSON at byte"));
    }
}
