//! The model the page holds: the last one trained here or opened from a file. It downloads as
//! the checkpoint `syncstep train --checkpoint` writes (the library's writer), opens again from
//! a checkpoint or torchvision's weights as `syncstep predict` reads them, continues training
//! under the library's resume rules, and classifies photos as `predict` does.
//!
//! One model at a time, on the host: a device is made for each use, as every page run does.
//! A file that is not a model leaves the one held as it was.

use std::cell::RefCell;
use std::path::Path;

use serde_json::{json, Value};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::JsFuture;

use syncstep::checkpoint::{self, Checkpoint};
use syncstep::classify::{fitting_batch, top_classes, Classifier, ClassifyError};
use syncstep::data::source::decode_bytes;
use syncstep::model::ResNet;
use syncstep::tensorfile::TensorFile;
use syncstep::train::{TrainConfig, Trainer};

use crate::{browser_devices, js_error, named_files, parse};

/// Bytes read from a file at a time: the page never holds a whole file outside this module's
/// one copy of it.
const CHUNK: usize = 16 << 20;

/// A model held: how it classifies, its weights, and what it came from.
struct Kept {
    classifier: Classifier,
    weights: Checkpoint,
    /// "trained in this page", or the file's name.
    source: String,
}

thread_local! {
    static KEPT: RefCell<Option<Kept>> = const { RefCell::new(None) };
}

/// Holds the final state of a run trained here (replacing any model held).
pub(crate) fn keep_trained(ck: Checkpoint) {
    let classifier = Classifier {
        cfg: ck.settings.clone(),
        torchvision: false,
        preprocess: syncstep::data::transform::Preprocess::Square,
    };
    let kept = Kept { classifier, weights: ck, source: "trained in this page".into() };
    KEPT.with(|k| *k.borrow_mut() = Some(kept));
}

/// The checkpoint held, to continue training: one of a run on images when `images`, else of
/// the synthetic dataset. Refused, saying what to do, for torchvision weights, for none, and
/// for a run on the other data.
pub(crate) fn to_resume(images: bool) -> Result<Checkpoint, JsError> {
    KEPT.with(|k| {
        let kept = k.borrow();
        let Some(kept) = kept.as_ref() else {
            return Err(JsError::new("no model to continue: train one, or open a checkpoint"));
        };
        if kept.classifier.torchvision {
            return Err(JsError::new(&format!(
                "{} holds torchvision weights, not a run to continue: open a checkpoint (Download model, or `syncstep train --checkpoint`)",
                kept.source
            )));
        }
        match &kept.weights.settings.images {
            Some(i) if !images => Err(JsError::new(&format!(
                "the model was trained on images ({}): continue it on the same folder, with \"Train on these images\"",
                i.class_names.join(", ")
            ))),
            None if images => Err(JsError::new(
                "the model was trained on the synthetic dataset: continue it with \"Train\"",
            )),
            _ => Ok(kept.weights.clone()),
        }
    })
}

/// What the page holds, or null: `{source, arch, classes, classNames (null for the synthetic
/// dataset), torchvision, step, imageSize, preprocess, images (trained on images),
/// downloadName (null for torchvision weights)}`.
#[wasm_bindgen]
pub fn model_info() -> Result<JsValue, JsError> {
    let info = KEPT.with(|k| k.borrow().as_ref().map(describe));
    parse(&info.unwrap_or(Value::Null).to_string())
}

fn describe(kept: &Kept) -> Value {
    let c = &kept.classifier;
    let cfg = &c.cfg;
    let download =
        (!c.torchvision).then(|| format!("{}-step{}.safetensors", cfg.arch, kept.weights.step));
    json!({
        "source": kept.source,
        "arch": cfg.arch.name(),
        "title": cfg.arch.title(),
        "classes": cfg.classes,
        "classNames": c.class_names(),
        "torchvision": c.torchvision,
        "step": kept.weights.step,
        "imageSize": cfg.image_size,
        "preprocess": c.preprocess.to_string(),
        "images": cfg.images.is_some(),
        "downloadName": download,
    })
}

/// The checkpoint file of the model held, as `syncstep train --checkpoint` writes it (one
/// writer: `checkpoint::to_bytes`): what `predict`, `eval` and `train --resume` read.
#[wasm_bindgen]
pub fn model_bytes() -> Result<Vec<u8>, JsError> {
    KEPT.with(|k| {
        let kept = k.borrow();
        let kept = kept.as_ref().ok_or_else(|| JsError::new("no model to download: train one first"))?;
        if kept.classifier.torchvision {
            return Err(JsError::new(
                "torchvision weights are downloaded as they were opened: the page saves checkpoints of runs",
            ));
        }
        let model = ResNet::new(kept.classifier.cfg.arch, kept.classifier.cfg.classes)
            .map_err(js_error)?;
        let name = format!("{}-step{}.safetensors", model.arch, kept.weights.step);
        checkpoint::to_bytes(Path::new(&name), &model, &kept.weights).map_err(js_error)
    })
}

/// Opens a model file (a `File` from a file input or a drop): a syncstep checkpoint, or a
/// torchvision ResNet's `state_dict` as safetensors, read and checked as `syncstep predict`
/// reads them (`--checkpoint`, `--weights`). Read in parts straight into this module's memory,
/// so that a large file is held once. On success it replaces the model held and resolves to
/// [`model_info`]'s object; a file that is not a model is an error saying why, and the model
/// held stays.
#[wasm_bindgen]
pub async fn open_model(file: web_sys::File) -> Result<JsValue, JsError> {
    let name = file.name();
    let bytes = read_file(&file).await?;
    let hint = |e: &dyn std::error::Error| {
        JsError::new(&format!(
            "{e}: the page opens a syncstep checkpoint (Download model, `syncstep train --checkpoint`) or a torchvision ResNet's `state_dict` (resnet18, resnet34, resnet50 or resnet101) saved as safetensors"
        ))
    };
    let file = TensorFile::from_bytes(Path::new(&name), &bytes).map_err(|e| hint(&e))?;
    drop(bytes);
    let opened = if checkpoint::checkpoint_format(&file.metadata) {
        Classifier::checkpoint(&file)
    } else {
        Classifier::torchvision(&file, None)
    };
    let (classifier, weights) = opened.map_err(|e| hint(&e))?;
    let kept = Kept { classifier, weights, source: name };
    let info = describe(&kept);
    KEPT.with(|k| *k.borrow_mut() = Some(kept));
    parse(&info.to_string())
}

/// The bytes of `file`, read a part at a time into one buffer reserved up front.
async fn read_file(file: &web_sys::File) -> Result<Vec<u8>, JsError> {
    let name = file.name();
    let size = file.size() as usize;
    let mut bytes = Vec::new();
    bytes.try_reserve_exact(size).map_err(|_| {
        JsError::new(&format!(
            "{name}: its {size} bytes do not fit in this page's memory (WebAssembly holds at most 4 GiB)"
        ))
    })?;
    let failed = |e: JsValue| {
        JsError::new(&format!("{name}: could not be read ({})", crate::describe_js(&e)))
    };
    while bytes.len() < size {
        let end = (bytes.len() + CHUNK).min(size);
        let part = file.slice_with_f64_and_f64(bytes.len() as f64, end as f64).map_err(failed)?;
        let buffer = JsFuture::from(part.array_buffer()).await.map_err(failed)?;
        let part = js_sys::Uint8Array::new(&buffer);
        if part.length() == 0 {
            return Err(JsError::new(&format!("{name}: the file ended before its {size} bytes")));
        }
        let at = bytes.len();
        bytes.resize(at + part.length() as usize, 0);
        part.copy_to(&mut bytes[at..]);
    }
    Ok(bytes)
}

/// The `top` likeliest classes of each of `files` (an array of `{path, bytes}`: photos in any
/// format `syncstep predict` decodes) by the model held, with the same preprocessing and
/// numbers: each photo decoded, brought to the input size and normalised, then run through
/// the network in eval mode. Resolves to predict's JSON: `{model, image_size, preprocess,
/// images: [{image, top: [{index, class, probability}]}]}`.
#[wasm_bindgen]
pub async fn classify(files: js_sys::Array, top: u32) -> Result<JsValue, JsError> {
    let (classifier, weights, source) = KEPT.with(|k| {
        let kept = k.borrow();
        let kept = kept.as_ref().ok_or_else(|| {
            JsError::new("no model to classify with: train one on images, or open a model file")
        })?;
        Ok::<_, JsError>((kept.classifier.clone(), kept.weights.clone(), kept.source.clone()))
    })?;
    let (Some(names), Some(norm)) = (classifier.class_names(), classifier.norm()) else {
        return Err(JsError::new(
            "this model was trained on the synthetic dataset, not on images: it names no classes of photos (train on a folder of images to classify photos)",
        ));
    };
    // Every photo is decoded before any runs, so a bad one is reported before the work.
    let photos = named_files(&files)?;
    let mut inputs = Vec::with_capacity(photos.len());
    for (path, bytes) in &photos {
        inputs.push(
            classifier.input(&decode_bytes(bytes, || path.clone()).map_err(js_error)?, &norm),
        );
    }
    let mut trainer = trainer(&classifier.cfg, weights).await?;
    let ranked = top_classes(&mut trainer, &inputs, top as usize).await.map_err(|e| match e {
        ClassifyError::NotFinite { image, .. } => js_error(format!("{}: {e}", photos[image].0)),
        e => js_error(e),
    })?;
    let images: Vec<Value> = photos
        .iter()
        .zip(ranked)
        .map(|((path, _), top)| {
            let top: Vec<Value> = top
                .iter()
                .map(|&(c, p)| json!({"index": c, "class": names[c], "probability": p}))
                .collect();
            json!({"image": path, "top": top})
        })
        .collect();
    let report = json!({
        "model": source,
        "image_size": classifier.cfg.image_size,
        "preprocess": classifier.preprocess.to_string(),
        "images": images,
    });
    parse(&report.to_string())
}

/// A one-device trainer holding `weights`, its batch the run's or as many images as the
/// device holds at the input size.
async fn trainer(cfg: &TrainConfig, weights: Checkpoint) -> Result<Trainer, JsError> {
    let model = ResNet::new(cfg.arch, cfg.classes).map_err(js_error)?;
    let gpu = browser_devices(1, Some(&model)).await?.swap_remove(0);
    let batch = fitting_batch(cfg, &gpu.limits).map_err(|e| {
        js_error(format!(
            "one {}×{} image does not fit this GPU: {e}",
            cfg.image_size, cfg.image_size
        ))
    })?;
    Trainer::new(gpu, TrainConfig { batch, ..cfg.clone() }, Some(weights)).map_err(js_error)
}
