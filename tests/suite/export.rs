//! `syncstep export` held to PyTorch and onnxruntime. The fixture scripts/export_fixtures.py
//! wrote (tests/fixtures/export/torchvision.json) holds, for each ResNet of the family with 10
//! classes, torchvision's `state_dict` entries (name, dtype, shape: what a strict load requires,
//! no more and no less) and PyTorch's eval-mode logits for the recipe's weights
//! (common/recipe.rs) on the recipe's input. The suite makes a checkpoint of those weights,
//! exports it, and holds the export to the fixture: its tensors to the state_dict exactly, and
//! syncstep's logits (from the export read back) and onnxruntime's (on the ONNX export) to
//! PyTorch's. Then the files export refuses, each with its reason, and nothing of the user's
//! replaced.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::common::*;
use safetensors::tensor::{Dtype, SafeTensors};
use serde_json::Value;
use syncstep::checkpoint::{self, Checkpoint};
use syncstep::data::Batch;
use syncstep::model::{Arch, ResNet};
use syncstep::tensorfile::TensorFile;
use syncstep::train::{TrainConfig, Trainer};

const FIXTURE: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/export/torchvision.json");

/// Runs an ONNX model in onnxruntime and prints what it gave, as JSON.
const ONNXRUNTIME: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/suite/onnxruntime_logits.py");

/// syncstep's logits may differ from PyTorch's by this much of the largest logit's magnitude (at
/// least 1): two f32 computations summing in different orders. (PyTorch's own f32 logits differ
/// from its f64 ones by 1.3e-6 of it, ResNet-101's.)
const SYNCSTEP_TOLERANCE: f64 = 1e-5;

/// onnxruntime's logits may differ from PyTorch's and syncstep's by this much, as above.
const ONNX_TOLERANCE: f64 = 1e-4;

/// The steps the test's checkpoints say they have trained: each BatchNorm's
/// `num_batches_tracked` in the export.
const STEP: u64 = 7;

fn fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(FIXTURE).unwrap()).unwrap()
}

/// A fresh folder of this test's own, removed when dropped, however the test ends.
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("syncstep-export-{name}-")).tempdir().unwrap()
}

/// The settings of a run of `arch` with `classes` classes on 32×32 images, batches of 2.
fn settings(arch: Arch, classes: u32) -> TrainConfig {
    TrainConfig { arch, classes, image_size: 32, batch: 2, ..TrainConfig::default() }
}

/// A checkpoint at step [`STEP`] holding the recipe's weights of `arch` with `classes` classes,
/// its momentum not zero (none of it may reach an export).
fn recipe_checkpoint(arch: Arch, classes: u32) -> (ResNet, Checkpoint) {
    let model = ResNet::new(arch, classes).unwrap();
    let weights = recipe::weights(arch, classes);
    let flat = |specs: &[syncstep::model::TensorSpec], len: usize| {
        let mut flat = vec![0.0f32; len];
        for spec in specs {
            flat[spec.range()].copy_from_slice(&weights[&spec.name].1);
        }
        flat
    };
    let (params, running) =
        (flat(&model.params, model.param_len), flat(&model.buffers, model.buffer_len));
    let velocity = params.iter().map(|p| 0.5 * p).collect();
    let settings = settings(arch, classes);
    (model, Checkpoint { params, running, velocity, step: STEP, settings })
}

/// Writes the recipe's checkpoint of `arch` (10 classes) in `dir`; its path.
fn write_checkpoint(dir: &Path, arch: Arch) -> (PathBuf, Checkpoint) {
    let path = dir.join(format!("{arch}.safetensors"));
    let (model, ck) = recipe_checkpoint(arch, 10);
    checkpoint::save(&path, &model, &ck).unwrap();
    (path, ck)
}

/// `syncstep export CHECKPOINT -o OUT`, which must succeed; what it printed.
fn export(checkpoint: &Path, out: &Path) -> String {
    let (ok, text) =
        syncstep(&["export", checkpoint.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(ok, "{text}");
    text
}

/// The fixture's entry for `arch`.
fn network(fixture: &Value, arch: Arch) -> &Value {
    let networks = fixture["networks"].as_array().unwrap();
    networks.iter().find(|n| n["arch"] == arch.name()).unwrap()
}

fn an_export_to_safetensors_is_torchvisions_state_dict() {
    let tmp = temp_dir("state-dict");
    let dir = tmp.path();
    let fixture = fixture();
    for arch in Arch::ALL {
        let (path, ck) = write_checkpoint(dir, arch);
        let out = dir.join(format!("{arch}-state-dict.safetensors"));
        let text = export(&path, &out);
        let hint = format!("torchvision.models.{arch}(num_classes=10).load_state_dict(");
        assert!(text.contains(&hint), "{text}");
        let bytes = std::fs::read(&out).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        // Name, dtype and shape of every tensor, and none else: what a strict load checks.
        let dtype = |d: Dtype| match d {
            Dtype::F32 => "float32",
            Dtype::I64 => "int64",
            other => panic!("{arch}: a tensor of {other:?}"),
        };
        let mut got: BTreeMap<String, Value> = BTreeMap::new();
        for (name, view) in file.tensors() {
            got.insert(name, serde_json::json!([dtype(view.dtype()), view.shape()]));
        }
        let want = network(&fixture, arch)["state_dict"].as_array().unwrap();
        let want: BTreeMap<String, Value> = want
            .iter()
            .map(|e| (e[0].as_str().unwrap().to_string(), serde_json::json!([e[1], e[2]])))
            .collect();
        assert_eq!(got, want, "{arch}: the export is not torchvision's state_dict");
        // The float tensors are the weights PyTorch's logits were computed with, to the bit.
        let floats: Vec<Vec<f32>> = want
            .keys()
            .filter_map(|name| {
                let view = file.tensor(name).unwrap();
                (view.dtype() == Dtype::F32).then(|| bytemuck::pod_collect_to_vec(view.data()))
            })
            .collect();
        let hash = recipe::sha256(floats.iter().map(Vec::as_slice));
        assert_eq!(hash, network(&fixture, arch)["weights_sha256"].as_str().unwrap(), "{arch}");
        let tracked = file.tensor("layer1.0.bn1.num_batches_tracked").unwrap();
        assert_eq!(tracked.data(), (ck.step as i64).to_le_bytes(), "{arch}");
        // syncstep reads its export back as torchvision weights.
        let read = TensorFile::read(&out).unwrap();
        assert_eq!(checkpoint::weights_arch(&read, None).unwrap(), arch);
        assert_eq!(read.metadata["producer"], "syncstep export");
    }
}

/// PyTorch's logits of `arch` from the fixture, and the recipe's input they were computed on.
fn pytorchs(fixture: &Value, arch: Arch) -> (Vec<f64>, Vec<f32>) {
    let (batch, size) =
        (fixture["batch"].as_u64().unwrap(), fixture["image_size"].as_u64().unwrap());
    let logits = network(fixture, arch)["logits"].as_array().unwrap();
    let logits =
        logits.iter().flat_map(|row| row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()));
    (logits.collect(), recipe::uniform("input", (batch * 3 * size * size) as usize))
}

/// The largest difference of `got` from `want`, over `want`'s largest magnitude (at least 1).
fn scaled_difference(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1f64, |m, v| m.max(v.abs()));
    got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0.0, f64::max) / scale
}

/// syncstep's eval-mode logits of the torchvision weights at `path` on `input` (32×32 images).
fn syncsteps_logits(path: &Path, input: &[f32]) -> Vec<f64> {
    let file = TensorFile::read(path).unwrap();
    let arch = checkpoint::weights_arch(&file, None).unwrap();
    let classes = checkpoint::classes(&file, arch).unwrap();
    let model = ResNet::new(arch, classes).unwrap();
    let (params, running) = checkpoint::load_weights(&file, &model, true).unwrap();
    let velocity = vec![0.0; model.param_len];
    let settings = settings(arch, classes);
    let ck = Checkpoint { params, running, velocity, step: 0, settings: settings.clone() };
    let mut trainer = Trainer::new(fresh_gpu(), settings, Some(ck)).unwrap();
    let images = input.len() / (3 * 32 * 32);
    let batch = Batch { images: input.to_vec(), labels: vec![0; images], h: 32, w: 32 };
    let logits = pollster::block_on(trainer.replicas.predict(&batch)).unwrap();
    to_f64(&logits)
}

/// The onnxruntime this machine has for the suite (scripts/setup-onnx.sh): its Python.
fn onnxruntime_python() -> PathBuf {
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).parent().unwrap();
    let python = target.join("onnxruntime/bin/python3");
    if !python.exists() {
        unavailable(&format!(
            "no onnxruntime at {} (scripts/setup-onnx.sh installs it)",
            python.display()
        ));
    }
    python
}

/// onnxruntime's report (see tests/suite/onnxruntime_logits.py) of the model at `path` on
/// `input`, `batch` images of 32×32.
fn onnxruntime(python: &Path, path: &Path, input: &[f32], batch: usize) -> Value {
    let data = path.with_extension("input.f32");
    std::fs::write(&data, bytemuck::cast_slice::<f32, u8>(input)).unwrap();
    let out = std::process::Command::new(python)
        .args([
            ONNXRUNTIME,
            path.to_str().unwrap(),
            data.to_str().unwrap(),
            &batch.to_string(),
            "32",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "onnxruntime: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn rows(value: &Value) -> Vec<f64> {
    let rows = value.as_array().unwrap().iter();
    rows.flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap())).collect()
}

fn exports_give_pytorchs_logits_in_syncstep_and_onnxruntime() {
    needs_adapter();
    let python = onnxruntime_python();
    let tmp = temp_dir("logits");
    let dir = tmp.path();
    let fixture = fixture();
    let batch = fixture["batch"].as_u64().unwrap() as usize;
    for arch in Arch::ALL {
        let (path, _) = write_checkpoint(dir, arch);
        let (pytorch, input) = pytorchs(&fixture, arch);
        let state_dict = dir.join(format!("{arch}-export.safetensors"));
        export(&path, &state_dict);
        let syncstep = syncsteps_logits(&state_dict, &input);
        let vs_pytorch = scaled_difference(&syncstep, &pytorch);
        assert!(
            vs_pytorch <= SYNCSTEP_TOLERANCE,
            "{arch}: syncstep's logits differ from PyTorch's by {vs_pytorch:e} of the largest"
        );

        let onnx = dir.join(format!("{arch}.onnx"));
        let text = export(&path, &onnx);
        assert!(
            text.contains("input `input` float32 [batch, 3, 32, 32]")
                && text.contains("output `logits` [batch, 10]"),
            "{text}"
        );
        let report = onnxruntime(&python, &onnx, &input, batch);
        assert_eq!(report["input"]["dims"], serde_json::json!(["batch", 3, 32, 32]), "{arch}");
        assert_eq!(report["output"], serde_json::json!({"name": "logits", "dims": ["batch", 10]}));
        assert_eq!(
            (report["producer"].as_str(), report["metadata"]["arch"].as_str()),
            (Some("syncstep"), Some(arch.name()))
        );
        let runtime = rows(&report["logits"]);
        let (ort_vs_pytorch, ort_vs_syncstep) =
            (scaled_difference(&runtime, &pytorch), scaled_difference(&runtime, &syncstep));
        assert!(
            ort_vs_pytorch.max(ort_vs_syncstep) <= ONNX_TOLERANCE,
            "{arch}: onnxruntime's logits differ from PyTorch's by {ort_vs_pytorch:e}, from syncstep's by {ort_vs_syncstep:e} of the largest"
        );
        // A batch of one: the batch is dynamic.
        let alone = scaled_difference(&rows(&report["first_alone"]), &pytorch[..10]);
        assert!(alone <= ONNX_TOLERANCE, "{arch}: the first image alone differs by {alone:e}");
        let largest = pytorch.iter().fold(0f64, |m, v| m.max(v.abs()));
        eprintln!(
            "{arch}: logits up to {largest:.2}; syncstep vs PyTorch {vs_pytorch:.1e}, onnxruntime vs PyTorch {ort_vs_pytorch:.1e}, vs syncstep {ort_vs_syncstep:.1e} of the largest"
        );
    }
}

/// Writes `ck`'s tensors (of `model`) under the header of a checkpoint of `settings`: a file
/// whose settings say another network than its tensors are.
fn write_mislabelled(path: &Path, model: &ResNet, ck: &Checkpoint, settings: &TrainConfig) {
    let mut meta = settings.metadata();
    meta.insert("step".into(), ck.step.to_string());
    meta.insert("format".into(), checkpoint::FORMAT.into());
    let named = |prefix: &str,
                 specs: &[syncstep::model::TensorSpec],
                 flat: &[f32]|
     -> Vec<(String, Vec<usize>, Vec<f32>)> {
        specs
            .iter()
            .map(|s| (format!("{prefix}{}", s.name), s.shape.clone(), flat[s.range()].to_vec()))
            .collect()
    };
    let mut all = named("", &model.params, &ck.params);
    all.extend(named("", &model.buffers, &ck.running));
    all.extend(named("momentum/", &model.params, &ck.velocity));
    let entries: Vec<_> = all.iter().map(|(n, s, v)| (n.clone(), s.clone(), &v[..])).collect();
    syncstep::tensorfile::write_f32(path, &entries, &meta).unwrap();
}

fn export_refuses_bad_files_and_replaces_nothing_of_the_users() {
    let tmp = temp_dir("bad");
    let dir = tmp.path();
    let (good, _) = write_checkpoint(dir, Arch::ResNet18);
    let bytes = std::fs::read(&good).unwrap();
    let truncated = dir.join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let photo =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torchvision/chelsea.png");
    let torchvision = dir.join("torchvision.safetensors");
    let (model, ck) = recipe_checkpoint(Arch::ResNet18, 10);
    let entries: Vec<_> = model
        .params
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone(), &ck.params[s.range()]))
        .collect();
    syncstep::tensorfile::write_f32(&torchvision, &entries, &Default::default()).unwrap();
    let other_arch = dir.join("other-arch.safetensors");
    write_mislabelled(&other_arch, &model, &ck, &settings(Arch::ResNet34, 10));
    let other_classes = dir.join("other-classes.safetensors");
    let (seven, ck7) = recipe_checkpoint(Arch::ResNet18, 7);
    write_mislabelled(&other_classes, &seven, &ck7, &settings(Arch::ResNet18, 10));
    let cases: [(&Path, &[&str]); 5] = [
        (&truncated, &["not a valid safetensors file", "truncated or corrupt"]),
        (&photo, &["a PNG image, not a safetensors file"]),
        (
            &torchvision,
            &["not a syncstep checkpoint", "torchvision weights are a state_dict already"],
        ),
        (&other_arch, &["its settings say resnet34, but its tensors are a resnet18's"]),
        (&other_classes, &["its settings say 10 classes, but its classifier (`fc.weight`) has 7"]),
    ];
    let users = dir.join("users.onnx");
    std::fs::write(&users, "the user's model").unwrap();
    let files = || std::fs::read_dir(dir).unwrap().count();
    let before = files();
    for (input, reasons) in cases {
        let input = input.to_str().unwrap();
        for out in ["new.onnx", "new.safetensors"] {
            let out = dir.join(out);
            let (ok, text) = syncstep(&["export", input, "-o", out.to_str().unwrap()]);
            assert!(!ok && reasons.iter().all(|r| text.contains(r)), "{input}: {text}");
            assert!(!out.exists(), "{input}: {} was made", out.display());
        }
        // Even with --overwrite, a failed export replaces nothing.
        let (ok, text) = syncstep(&["export", input, "-o", users.to_str().unwrap(), "--overwrite"]);
        assert!(!ok && text.contains(reasons[0]), "{input}: {text}");
        assert_eq!(std::fs::read(&users).unwrap(), b"the user's model");
        assert_eq!(files(), before, "{input}: a file was left behind");
    }
    let mislabelled = std::fs::read(&other_arch).unwrap();
    let good = good.to_str().unwrap();
    let refusals = [
        (users.clone(), "is not a model syncstep exported"),
        (PathBuf::from(good), "same file as the input"),
        (dir.join("other-arch.safetensors"), "is not a model syncstep exported"),
        (dir.join("model.pt"), "the format is taken from the extension: .safetensors"),
    ];
    for (out, reason) in refusals {
        let (ok, text) = syncstep(&["export", good, "-o", out.to_str().unwrap()]);
        assert!(!ok && text.contains(reason), "-o {}: {text}", out.display());
    }
    assert_eq!(std::fs::read(&users).unwrap(), b"the user's model");
    assert_eq!(std::fs::read(&other_arch).unwrap(), mislabelled);
    assert_eq!(std::fs::read(good).unwrap(), bytes);
    // An export replaces an export of its own without --overwrite.
    for out in ["again.onnx", "again.safetensors"] {
        let out = dir.join(out);
        export(Path::new(good), &out);
        export(Path::new(good), &out);
    }
}

tests![
    an_export_to_safetensors_is_torchvisions_state_dict,
    exports_give_pytorchs_logits_in_syncstep_and_onnxruntime,
    export_refuses_bad_files_and_replaces_nothing_of_the_users,
];
