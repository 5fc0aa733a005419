//! A checkpoint's model for other frameworks (`syncstep export`): torchvision's `state_dict` as
//! safetensors, which PyTorch loads with `load_state_dict(strict=True)` (every parameter, every
//! BatchNorm buffer with `num_batches_tracked`, nothing of the optimizer), or the inference
//! graph as ONNX ([`onnx`]). Both carry the run's arch, image size, step and, for a run on
//! images, its normalisation and class names as string metadata. Nothing here touches a GPU.

use std::collections::BTreeMap;

use crate::checkpoint::Checkpoint;
use crate::model::ResNet;
use crate::tensorfile::{Entry, IntEntry};

pub mod onnx;
pub mod proto;

/// The metadata key, and its value, that mark a file as an export of syncstep's.
pub const PRODUCER_KEY: &str = "producer";
pub const PRODUCER: &str = "syncstep export";

/// The formats a model is exported in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// torchvision's `state_dict`, as safetensors.
    Safetensors,
    /// The inference graph, as ONNX.
    Onnx,
}

impl Format {
    /// The format a file's extension names (.safetensors or .onnx, any case); None for another.
    pub fn of(path: &std::path::Path) -> Option<Format> {
        let extension = path.extension()?.to_str()?.to_ascii_lowercase();
        match extension.as_str() {
            "safetensors" => Some(Format::Safetensors),
            "onnx" => Some(Format::Onnx),
            _ => None,
        }
    }
}

/// torchvision's `state_dict` of `model` holding `ck`'s weights: every parameter and running
/// statistic as f32, and each BatchNorm's `num_batches_tracked` as an int64 scalar (shape [])
/// holding `steps` (one value: the steps trained, the training-mode forwards PyTorch counts).
pub fn state_dict<'a>(
    model: &ResNet,
    ck: &'a Checkpoint,
    steps: &'a [i64],
) -> (Vec<Entry<'a>>, Vec<IntEntry<'a>>) {
    let named = |specs: &[crate::model::TensorSpec], flat: &'a [f32]| -> Vec<Entry<'a>> {
        specs.iter().map(|s| (s.name.clone(), s.shape.clone(), &flat[s.range()])).collect()
    };
    let mut floats = named(&model.params, &ck.params);
    floats.extend(named(&model.buffers, &ck.running));
    let counts = model
        .batchnorms()
        .iter()
        .map(|bn| {
            let name = &model.params[bn.weight].name;
            let prefix = name.strip_suffix(".weight").unwrap_or(name);
            (format!("{prefix}.num_batches_tracked"), Vec::new(), steps)
        })
        .collect();
    (floats, counts)
}

/// What an export records of the run beside the weights: its producer, arch, input size and
/// step, and for a run on images its normalisation (`mean`, `std`: comma-separated, per
/// channel, of pixels in [0, 1]) and class names (a JSON list, in the classifier's order).
pub fn metadata(ck: &Checkpoint) -> BTreeMap<String, String> {
    let cfg = &ck.settings;
    let mut meta = BTreeMap::from([
        (PRODUCER_KEY.to_string(), PRODUCER.to_string()),
        ("arch".into(), cfg.arch.to_string()),
        ("image_size".into(), cfg.image_size.to_string()),
        ("step".into(), ck.step.to_string()),
    ]);
    if let Some(images) = &cfg.images {
        let channels = |v: &[f32; 3]| v.map(|c| c.to_string()).join(",");
        meta.insert("mean".into(), channels(&images.norm.mean));
        meta.insert("std".into(), channels(&images.norm.std));
        let names = serde_json::to_string(&images.class_names).unwrap_or_default();
        meta.insert("class_names".into(), names);
    }
    meta
}

/// Writes `ck`'s model in `format` to `path`, atomically (a failed write leaves what was
/// there). Native only.
#[cfg(not(target_arch = "wasm32"))]
pub fn write(
    path: &std::path::Path,
    format: Format,
    model: &ResNet,
    ck: &Checkpoint,
) -> Result<(), crate::tensorfile::TensorFileError> {
    let mut meta = metadata(ck);
    match format {
        Format::Safetensors => {
            let steps = [i64::try_from(ck.step).unwrap_or(i64::MAX)];
            let (floats, counts) = state_dict(model, ck, &steps);
            // What Hugging Face's loaders look for in a PyTorch state_dict's safetensors.
            meta.insert("format".into(), "pt".into());
            crate::tensorfile::write_f32_i64(path, &floats, &counts, &meta)
        }
        Format::Onnx => {
            let size = ck.settings.image_size;
            let bytes = onnx::model_bytes(model, (&ck.params, &ck.running), size, &meta);
            crate::files::write_atomic(path, &bytes).map_err(|e| {
                crate::tensorfile::TensorFileError::Io { path: path.into(), message: e.to_string() }
            })
        }
    }
}

/// An export as an output (`syncstep export -o`): what it may replace. Native only.
#[cfg(not(target_arch = "wasm32"))]
pub const KIND: crate::files::Kind =
    crate::files::Kind { what: "a model syncstep exported", ours: is_export };

/// Whether the file at `path` is an export of syncstep's: safetensors whose header names it
/// as the producer, or ONNX that begins as syncstep's models do. Reads the header alone.
#[cfg(not(target_arch = "wasm32"))]
pub fn is_export(path: &std::path::Path) -> bool {
    use std::io::Read;
    let header = crate::tensorfile::read_header(path);
    if header.is_ok_and(|h| h.metadata.get(PRODUCER_KEY).is_some_and(|p| p == PRODUCER)) {
        return true;
    }
    let signature = onnx::signature();
    let mut start = Vec::new();
    let read = crate::files::open_input(path)
        .and_then(|f| f.take(signature.len() as u64).read_to_end(&mut start));
    read.is_ok() && start == signature
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::source::DataSpec;
    use crate::data::transform::{Augment, Normalization};
    use crate::model::Arch;
    use crate::settings::ImageSettings;
    use crate::train::TrainConfig;

    /// A run on images records what a user of the export needs to feed it and read its output;
    /// a run on the synthetic dataset, which has neither, records neither.
    #[test]
    fn an_export_records_the_runs_normalisation_and_class_names() {
        let model = ResNet::new(Arch::ResNet18, 2).unwrap();
        let images = ImageSettings {
            data: DataSpec::Cifar10("/data/cifar".into()),
            fingerprint: None,
            file_times: None,
            val_split: 0.1,
            augment: Augment::CropFlip,
            norm: Normalization { mean: [0.5, 0.25, 0.125], std: [0.2, 0.3, 0.4] },
            class_names: vec!["a \"cat\"".into(), "dog, big".into()],
        };
        let settings = TrainConfig { arch: Arch::ResNet18, classes: 2, ..TrainConfig::default() };
        let params = model.init_params(0);
        let (running, velocity) = (model.init_buffers(), vec![0.0; model.param_len]);
        let mut ck = Checkpoint { params, running, velocity, step: 12, settings };
        let synthetic = metadata(&ck);
        assert_eq!(
            synthetic.keys().collect::<Vec<_>>(),
            ["arch", "image_size", "producer", "step"]
        );
        assert_eq!((synthetic["arch"].as_str(), synthetic["step"].as_str()), ("resnet18", "12"));
        ck.settings.images = Some(images);
        let meta = metadata(&ck);
        assert_eq!(
            (meta["mean"].as_str(), meta["std"].as_str()),
            ("0.5,0.25,0.125", "0.2,0.3,0.4")
        );
        let names: Vec<String> = serde_json::from_str(&meta["class_names"]).unwrap();
        assert_eq!(names, ["a \"cat\"", "dog, big"]);
        let (floats, counts) = state_dict(&model, &ck, &[12]);
        assert_eq!(floats.len(), model.params.len() + model.buffers.len());
        assert_eq!(counts.len(), model.batchnorms().len());
        assert_eq!(counts[0], ("bn1.num_batches_tracked".to_string(), vec![], &[12i64][..]));
        assert_eq!(Format::of(std::path::Path::new("m.ONNX")), Some(Format::Onnx));
        assert_eq!(Format::of(std::path::Path::new("m.pt")), None);
    }
}
