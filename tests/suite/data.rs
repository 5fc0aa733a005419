//! Training on images, end to end on generated data (no download): an ImageFolder of PNG and
//! JPEG files and CIFAR-format files; data-parallel = one device with augmentation on; a
//! stopped run resumed mid-epoch bit for bit; `eval` and `predict` against the f64 reference
//! forward; bad data refused with a message naming the file.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::common::*;
use syncstep::checkpoint;
use syncstep::data::loader::{Loader, Plan};
use syncstep::data::schedule::Epochs;
use syncstep::data::source::{self, DataSpec, Dataset};
use syncstep::data::synthetic::{class_name, synthetic_image};
use syncstep::data::transform::{eval_image, Augment, Normalization, Preprocess};
use syncstep::model::{Arch, ResNet};
use syncstep::scores::{ranking, softmax};
use syncstep::tensorfile::TensorFile;
use syncstep::train::{TrainConfig, Trainer};

/// A fresh folder of this test's own, removed when dropped, however the test ends.
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("syncstep-data-{name}-")).tempdir().unwrap()
}

/// The synthetic image `index` as 8-bit RGB of `w`×`h`.
fn rgb(index: u64, w: u32, h: u32, classes: u32) -> (image::RgbImage, u32) {
    let (pixels, label) = synthetic_image(11, index, h, w, classes);
    let plane = (w * h) as usize;
    let byte = |v: f32| ((v / 5.0 + 0.5) * 255.0).clamp(0.0, 255.0) as u8;
    let bytes = (0..plane).flat_map(|p| [0, 1, 2].map(|c| byte(pixels[c * plane + p]))).collect();
    (image::RgbImage::from_raw(w, h, bytes).unwrap(), label)
}

/// An ImageFolder of `count` images of 3 classes under `dir`: PNG and JPEG, of several sizes
/// (some smaller than the crop, some not square).
fn image_folder(dir: &Path, count: u64) -> PathBuf {
    let root = dir.join("images");
    for i in 0..count {
        let (w, h) = [(40, 36), (32, 48), (24, 24)][i as usize % 3];
        let (img, label) = rgb(i, w, h, 3);
        let folder = root.join(class_name(label).replace(' ', "_"));
        std::fs::create_dir_all(&folder).unwrap();
        let ext = if i % 2 == 0 { "png" } else { "jpg" };
        img.save(folder.join(format!("{i:04}.{ext}"))).unwrap();
    }
    root
}

fn data_parallel_training_on_augmented_images_is_the_single_device_run() {
    let gpu = fresh_gpu();
    let tmp = temp_dir("parallel");
    let dir = tmp.path();
    let root = image_folder(dir, 30);
    let splits = source::open(&DataSpec::Folder(root), 0.2, 0).unwrap();
    let train = Arc::new(splits.train);
    let cfg = TrainConfig { batch: 6, classes: 3, ..TrainConfig::default() };
    let epochs = Epochs { examples: train.len(), batch: cfg.batch, seed: cfg.seed };
    let plan = Plan::Train { epochs, augment: Augment::ResizedCropFlip, part: (0, cfg.batch) };
    let norm = Normalization::IMAGENET;
    // Batches are a function of the step: any thread count, any starting step.
    let batches = |workers, first| {
        let mut loader = Loader::start(train.clone(), plan, 32, norm, first, workers).unwrap();
        (first..6).map(|_| loader.next_batch().unwrap().0.unwrap()).collect::<Vec<_>>()
    };
    let one_thread = batches(1, 0);
    assert_eq!(one_thread, batches(3, 0));
    assert_eq!(one_thread[4..], batches(2, 4)[..]);
    assert_ne!(one_thread[0].images, one_thread[epochs.steps_per_epoch() as usize].images);

    let run = |gpus| {
        let mut t = Trainer::data_parallel(gpus, cfg.clone(), None).unwrap();
        for batch in &one_thread {
            pollster::block_on(t.train_on(batch)).unwrap();
        }
        pollster::block_on(t.checkpoint()).unwrap()
    };
    let single = run(vec![gpu]);
    let parallel = run((0..3).map(|_| fresh_gpu()).collect());
    assert_eq!(bits(&single.params), bits(&parallel.params), "parameters differ");
    assert_eq!(bits(&single.running), bits(&parallel.running), "running statistics differ");
    assert_ne!(bits(&single.params), bits(&ResNet::new(Arch::ResNet34, 3).unwrap().init_params(0)));
}

/// Every tensor of two safetensors files, bit for bit.
fn same_tensors(a: &Path, b: &Path) {
    let (a, b) = (TensorFile::read(a).unwrap(), TensorFile::read(b).unwrap());
    assert_eq!(a.tensors.len(), b.tensors.len());
    for (name, t) in &a.tensors {
        let u = &b.tensors[name];
        let same = t.values.iter().zip(&u.values).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same && t.shape == u.shape, "{name} differs");
    }
}

fn a_stopped_run_resumes_mid_epoch_bit_for_bit_and_eval_and_predict_match_the_reference() {
    needs_adapter();
    let tmp = temp_dir("resume");
    let dir = tmp.path();
    let root = image_folder(dir, 30);
    let data = root.to_str().unwrap();
    let at = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let (straight, stopped, log) =
        (at("straight.safetensors"), at("stopped.safetensors"), at("m.jsonl"));
    // 27 training images, batch 4: 6 steps per epoch, 2 epochs; the killed run is killed
    // after its checkpoint at step 4, mid-epoch.
    let common = [
        "train",
        "--data",
        data,
        "--batch",
        "4",
        "--lr",
        "0.02",
        "--lr-schedule",
        "cosine",
        "--epochs",
        "2",
    ];
    let args = |extra: &[&'static str]| -> Vec<String> {
        common.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let mut straight_args = args(&["--checkpoint"]);
    straight_args.extend([straight.clone(), "--log".into(), log.clone()]);
    let (ok, out) = syncstep(&straight_args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{out}");
    assert!(out.contains("6 steps per epoch") && out.contains("epoch 1"), "{out}");
    assert!(out.contains("validation top-1"), "{out}");
    let lines = std::fs::read_to_string(&log).unwrap();
    assert_eq!(lines.lines().filter(|l| l.contains("\"loss\"")).count(), 12, "{lines}");
    assert!(lines.contains("\"val_top1\"") && lines.contains("\"lr\""), "{lines}");

    let mut killed_args = args(&["--checkpoint-every", "4", "--checkpoint"]);
    killed_args.push(stopped.clone());
    let mut child = crate::common::command()
        .args(&killed_args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let saved = format!("checkpoint: {stopped} (step 4)");
    let lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    assert!(lines.map_while(Result::ok).any(|l| l == saved), "no {saved:?}");
    child.kill().unwrap();
    assert!(!child.wait().unwrap().success());
    assert_eq!(
        checkpoint::load(Path::new(&stopped), &ResNet::new(Arch::ResNet34, 3).unwrap())
            .unwrap()
            .step,
        4
    );
    let out = syncstep(&["train", "--resume", &stopped, "--epochs", "2", "--checkpoint", &stopped]);
    assert!(out.0 && out.1.contains("steps 5 to 12"), "{}", out.1);
    same_tensors(Path::new(&straight), Path::new(&stopped));

    // eval: the confusion matrix the f64 reference forward gives, up to near-ties.
    let json = at("scores.json");
    let (ok, out) = syncstep(&["eval", "--checkpoint", &straight, "--json", &json]);
    assert!(ok && out.contains("top-1") && out.contains("confusion"), "{out}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let file = TensorFile::read(Path::new(&straight)).unwrap();
    let cfg = TrainConfig::from_metadata(&file.metadata).unwrap();
    let model = ResNet::new(Arch::ResNet34, 3).unwrap();
    let ck = checkpoint::load(Path::new(&straight), &model).unwrap();
    let norm = cfg.images.as_ref().unwrap().norm;
    let val: Dataset = source::open(&DataSpec::Folder(root.clone()), 0.1, 0).unwrap().val;
    let mut confusion = vec![0u64; 9];
    let mut near_ties = 0;
    let mut first_logits = Vec::new();
    for i in 0..val.len() {
        let pixels = eval_image(&val.decode(i).unwrap(), 32, Preprocess::Square, &norm);
        let batch = syncstep::data::Batch { images: pixels, labels: vec![0], h: 32, w: 32 };
        let logits = syncstep::reference::step::predict(
            &model,
            &to_f64(&ck.params),
            &to_f64(&ck.running),
            &batch,
        );
        let as_f32: Vec<f32> = logits.iter().map(|&v| v as f32).collect();
        let order = ranking(&as_f32);
        near_ties += ((logits[order[0]] - logits[order[1]]).abs() < 1e-3) as u64;
        confusion[val.label(i) as usize * 3 + order[0]] += 1;
        if i == 0 {
            first_logits = as_f32;
        }
    }
    let gpu_confusion: Vec<u64> = report["confusion"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| row.as_array().unwrap().iter().map(|v| v.as_u64().unwrap()))
        .collect();
    let differing: u64 = confusion.iter().zip(&gpu_confusion).map(|(a, b)| a.abs_diff(*b)).sum();
    assert!(differing <= 2 * near_ties, "{confusion:?} vs {gpu_confusion:?}");
    assert_eq!(report["examples"].as_u64().unwrap() as usize, val.len());

    // predict: the reference's top class and probability for the first validation image.
    let (ok, out) = syncstep(&["predict", "--checkpoint", &straight, &val.name(0)]);
    assert!(ok, "{out}");
    let p = softmax(&first_logits);
    let best = ranking(&first_logits)[0];
    let expected = format!("{} {:.1}%", cfg.class_names()[best], 100.0 * p[best]);
    assert!(out.contains(&expected), "expected {expected:?} in:\n{out}");
}

/// CIFAR-10's binary layout: label byte, then the R, G and B planes of 32×32.
fn cifar_file(path: &Path, first: u64, records: u64, classes: u32) {
    let mut bytes = Vec::new();
    for i in first..first + records {
        let (img, label) = rgb(i, 32, 32, classes);
        bytes.push(label as u8);
        for c in 0..3 {
            bytes.extend(img.pixels().map(|p| p.0[c]));
        }
    }
    std::fs::write(path, bytes).unwrap();
}

fn cifar_files_train_and_evaluate() {
    needs_adapter();
    let tmp = temp_dir("cifar");
    let dir = tmp.path();
    let cifar = dir.join("cifar");
    std::fs::create_dir_all(&cifar).unwrap();
    for b in 1..=5 {
        cifar_file(&cifar.join(format!("data_batch_{b}.bin")), b * 10, 6, 10);
    }
    cifar_file(&cifar.join("test_batch.bin"), 0, 8, 10);
    let spec = format!("cifar10:{}", cifar.display());
    let ck = dir.join("c.safetensors");
    let (ok, out) = syncstep(&[
        "train",
        "--data",
        &spec,
        "--batch",
        "8",
        "--epochs",
        "1",
        "--checkpoint",
        ck.to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("30 training and 8 validation images") && out.contains("3 steps per epoch"),
        "{out}"
    );
    assert!(out.contains("6 images of each epoch"), "{out}");
    let (ok, out) = syncstep(&["eval", "--checkpoint", ck.to_str().unwrap()]);
    assert!(ok && out.contains("8 images") && out.contains("airplane"), "{out}");
}

fn bad_data_is_an_error_naming_the_file() {
    needs_adapter();
    let tmp = temp_dir("bad");
    let dir = tmp.path();
    let root = image_folder(dir, 12);
    let data = root.to_str().unwrap().to_string();
    let ck = dir.join("kept.safetensors");
    let ck = ck.to_str().unwrap();
    let base = [
        "train",
        "--data",
        &data,
        "--batch",
        "2",
        "--val-split",
        "0.2",
        "--checkpoint-every",
        "0",
        "--checkpoint",
        ck,
    ];
    let (ok, out) = syncstep(&[&base[..], &["--steps", "1"]].concat());
    assert!(ok, "{out}");
    let kept = std::fs::read(ck).unwrap();
    let failing = |what: &str, says: &str| {
        // Asked to replace the first run's checkpoint: the failure must still leave it whole.
        let (ok, out) = syncstep(&[&base[..], &["--steps", "12", "--overwrite"]].concat());
        assert!(!ok && out.contains(says) && !out.contains("panicked"), "{what}: {out}");
        assert_eq!(std::fs::read(ck).unwrap(), kept, "{what}: the checkpoint changed");
    };
    // A truncated image is found when the loader reaches it, before any step trains on it.
    let victim = std::fs::read_dir(root.join("disc")).unwrap().next().unwrap().unwrap().path();
    let bytes = std::fs::read(&victim).unwrap();
    std::fs::write(&victim, &bytes[..bytes.len() / 3]).unwrap();
    std::fs::write(dir.join("dummy"), b"").unwrap();
    failing("truncated image", &victim.file_name().unwrap().to_string_lossy());
    std::fs::write(&victim, &bytes).unwrap();

    std::fs::create_dir(root.join("empty")).unwrap();
    let (ok, out) = syncstep(&[&base[..], &["--steps", "1"]].concat());
    assert!(!ok && out.contains("empty") && !out.contains("panicked"), "{out}");
    std::fs::remove_dir(root.join("empty")).unwrap();

    let (ok, out) = syncstep(&["predict", "--checkpoint", ck, dir.join("dummy").to_str().unwrap()]);
    assert!(!ok && out.contains("dummy") && !out.contains("panicked"), "{out}");
    let cifar = dir.join("cifar");
    std::fs::create_dir_all(&cifar).unwrap();
    for b in 1..=5 {
        std::fs::write(cifar.join(format!("data_batch_{b}.bin")), vec![1u8; 3073 * 2 + 5]).unwrap();
    }
    std::fs::write(cifar.join("test_batch.bin"), vec![1u8; 3073]).unwrap();
    let spec = format!("cifar10:{}", cifar.display());
    let (ok, out) = syncstep(&["train", "--data", &spec, "--steps", "1"]);
    assert!(!ok && out.contains("3073") && out.contains("data_batch_1.bin"), "{out}");
    assert_eq!(std::fs::read(ck).unwrap(), kept);
}

fn init_weights_fine_tune_with_a_fresh_classifier_of_another_class_count() {
    needs_adapter();
    let tmp = temp_dir("init");
    let dir = tmp.path();
    // ImageNet-like weights: a 10-class model's, saved with torchvision names.
    let ten = ResNet::new(Arch::ResNet34, 10).unwrap();
    let weights = dir.join("w.safetensors");
    let saved = checkpoint::Checkpoint {
        params: ten.init_params(5),
        running: ten.init_buffers().iter().map(|v| v + 0.25).collect(),
        velocity: vec![0.0; ten.param_len],
        step: 0,
        settings: TrainConfig::default(),
    };
    checkpoint::save(&weights, &ten, &saved).unwrap();
    let three = ResNet::new(Arch::ResNet34, 3).unwrap();
    let init = three.init_params(9);
    let file = TensorFile::read(&weights).unwrap();
    let checkpoint::FineTuning { params, running, other_classes } =
        checkpoint::load_for_fine_tuning(&file, &three, &init).unwrap();
    assert_eq!(other_classes, Some(10));
    for spec in &three.params {
        let expected = if spec.name.starts_with("fc.") {
            &init[spec.range()]
        } else {
            let t = ten.params.iter().find(|t| t.name == spec.name).unwrap();
            &saved.params[t.range()]
        };
        assert_eq!(bits(&params[spec.range()]), bits(expected), "{}", spec.name);
    }
    assert_eq!(bits(&running), bits(&saved.running));

    let root = image_folder(dir, 12);
    let (ok, out) = syncstep(&[
        "train",
        "--data",
        root.to_str().unwrap(),
        "--batch",
        "4",
        "--steps",
        "1",
        "--normalize",
        "imagenet",
        "--init",
        weights.to_str().unwrap(),
    ]);
    assert!(ok && out.contains("fc is initialised afresh"), "{out}");
}

tests![
    data_parallel_training_on_augmented_images_is_the_single_device_run,
    a_stopped_run_resumes_mid_epoch_bit_for_bit_and_eval_and_predict_match_the_reference,
    cifar_files_train_and_evaluate,
    bad_data_is_an_error_naming_the_file,
    init_weights_fine_tune_with_a_fresh_classifier_of_another_class_count,
];
