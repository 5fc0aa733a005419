//! Weights and checkpoints as safetensors with torchvision's `state_dict` names: parameters,
//! BN running statistics, and (checkpoints only) SGD momentum under `momentum/<name>`, plus
//! the run's position in the string metadata. Converts between files and the model's flat
//! layout; nothing here touches a GPU.

use std::collections::BTreeMap;
#[cfg(not(target_arch = "wasm32"))]
use std::path::Path;

use crate::model::ResNet34;
#[cfg(not(target_arch = "wasm32"))]
use crate::tensorfile::{write_f32, Entry};
use crate::tensorfile::{TensorFile, TensorFileError};

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    File(#[from] TensorFileError),
    #[error("{path}: tensor `{name}` holds a non-finite value at element {index}")]
    NonFinite { path: String, name: String, index: usize },
    #[error(
        "{path}: metadata `{key}` is missing or not a number; this is not a syncstep checkpoint"
    )]
    Metadata { path: String, key: String },
}

/// Flat parameters and running statistics from a file of torchvision names (f32 or f64).
/// Every parameter must be present with its exact shape; running statistics are optional and
/// default to mean 0, variance 1. Other keys are ignored.
pub fn load_weights(
    file: &TensorFile,
    model: &ResNet34,
) -> Result<(Vec<f32>, Vec<f32>), CheckpointError> {
    let mut params = vec![0.0f32; model.param_len];
    for spec in &model.params {
        let t = file.require(&spec.name, &spec.shape)?;
        copy_finite(file, &spec.name, &t.values, &mut params[spec.range()])?;
    }
    let mut running = model.init_buffers();
    for spec in &model.buffers {
        if let Some(t) = file.optional(&spec.name, &spec.shape)? {
            copy_finite(file, &spec.name, &t.values, &mut running[spec.range()])?;
        }
    }
    Ok((params, running))
}

fn copy_finite(
    file: &TensorFile,
    name: &str,
    src: &[f64],
    dst: &mut [f32],
) -> Result<(), CheckpointError> {
    for (i, (d, &s)) in dst.iter_mut().zip(src).enumerate() {
        if !s.is_finite() {
            return Err(CheckpointError::NonFinite {
                path: file.path.display().to_string(),
                name: name.into(),
                index: i,
            });
        }
        *d = s as f32;
    }
    Ok(())
}

/// Everything needed to continue a run bit-exactly.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    pub params: Vec<f32>,
    pub running: Vec<f32>,
    pub velocity: Vec<f32>,
    /// Steps taken so far.
    pub step: u64,
    /// Free-form settings of the run (seed, batch, image size, …), as strings.
    pub settings: BTreeMap<String, String>,
}

/// The named tensors of `flat` in the layout `specs` describes.
#[cfg(not(target_arch = "wasm32"))]
fn entries<'a>(
    prefix: &str,
    specs: &[crate::model::TensorSpec],
    flat: &'a [f32],
) -> Vec<Entry<'a>> {
    specs
        .iter()
        .map(|s| (format!("{prefix}{}", s.name), s.shape.clone(), &flat[s.range()]))
        .collect()
}

/// Writes a checkpoint atomically: an interrupted or failed save leaves the old file intact.
/// Native only (a browser has no file system).
#[cfg(not(target_arch = "wasm32"))]
pub fn save(path: &Path, model: &ResNet34, ck: &Checkpoint) -> Result<(), CheckpointError> {
    let mut all = entries("", &model.params, &ck.params);
    all.extend(entries("", &model.buffers, &ck.running));
    all.extend(entries("momentum/", &model.params, &ck.velocity));
    let mut meta = ck.settings.clone();
    meta.insert("step".into(), ck.step.to_string());
    meta.insert("format".into(), "syncstep-checkpoint-1".into());
    Ok(write_f32(path, &all, &meta)?)
}

/// Reads a checkpoint [`save`] wrote. Native only (a browser has no file system).
#[cfg(not(target_arch = "wasm32"))]
pub fn load(path: &Path, model: &ResNet34) -> Result<Checkpoint, CheckpointError> {
    let file = TensorFile::read(path)?;
    let (params, running) = load_weights(&file, model)?;
    let mut velocity = vec![0.0f32; model.param_len];
    for spec in &model.params {
        let name = format!("momentum/{}", spec.name);
        let t = file.require(&name, &spec.shape)?;
        copy_finite(&file, &name, &t.values, &mut velocity[spec.range()])?;
    }
    let step = file.metadata.get("step").and_then(|s| s.parse().ok()).ok_or_else(|| {
        CheckpointError::Metadata { path: path.display().to_string(), key: "step".into() }
    })?;
    let mut settings = file.metadata.clone();
    settings.remove("step");
    settings.remove("format");
    Ok(Checkpoint { params, running, velocity, step, settings })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_round_trips_exactly() {
        let model = ResNet34::new(10).unwrap();
        let params = model.init_params(5);
        let mut running = model.init_buffers();
        running[3] = 0.25;
        let velocity: Vec<f32> = params.iter().map(|p| p * 0.5).collect();
        let ck = Checkpoint {
            params,
            running,
            velocity,
            step: 42,
            settings: BTreeMap::from([("seed".into(), "7".into())]),
        };
        let dir = std::env::temp_dir().join(format!("syncstep-ck-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ck.safetensors");
        save(&path, &model, &ck).unwrap();
        assert_eq!(load(&path, &model).unwrap(), ck);
        // A file of another model (7 classes) is refused, naming the tensor.
        let e = load(&path, &ResNet34::new(7).unwrap()).unwrap_err().to_string();
        assert!(e.contains("fc.weight") && e.contains("[10, 512]"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
