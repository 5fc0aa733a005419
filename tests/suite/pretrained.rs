//! torchvision weights straight into `predict` and `eval` (`--weights`), held to PyTorch by the
//! fixtures `scripts/torchvision_fixtures.py` wrote (tests/fixtures/torchvision: two photo
//! crops, torchvision's preprocessing of them, and resnet18's, resnet34's and resnet50's top-5
//! on them for seeded weights that both sides make from one recipe); and the flags' errors, each
//! naming the fix.

use std::path::{Path, PathBuf};

use crate::common::*;
use base64::Engine;
use serde_json::Value;
use sha2::{Digest, Sha256};
use syncstep::data::source::decode_file;
use syncstep::data::transform::Preprocess;
use syncstep::model::Arch;
use syncstep::tensorfile::write_f32;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/torchvision");

/// PyTorch's probabilities, and syncstep's, may differ by this much.
const PROBABILITY_TOLERANCE: f64 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    Path::new(FIXTURES).join(name)
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A fresh folder of this test's own, removed when dropped, however the test ends.
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("syncstep-pretrained-{name}-")).tempdir().unwrap()
}

/// Writes the recipe's weights of `arch` for `classes` classes to `path`; their SHA-256 as the
/// script takes it (every tensor's f32 bytes, in name order).
fn write_seeded_weights(path: &Path, arch: Arch, classes: u32) -> String {
    let weights = recipe::weights(arch, classes);
    let entries: Vec<_> =
        weights.iter().map(|(n, (shape, v))| (n.clone(), shape.clone(), &v[..])).collect();
    write_f32(path, &entries, &Default::default()).unwrap();
    recipe::sha256(weights.values().map(|(_, v)| &v[..]))
}

fn torchvision_preprocessing_gives_pils_pixels() {
    let fixture_file = json(&fixture("preprocess.json"));
    let cases = fixture_file["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 8);
    let (mut worst, mut exact) = (0i32, 0);
    for case in cases {
        let (photo, size) = (case["photo"].as_str().unwrap(), case["size"].as_u64().unwrap());
        let what = format!("{photo} at {size}");
        let img = decode_file(&fixture(photo)).unwrap();
        let px = Preprocess::Torchvision.apply(&img, size as u32);
        assert_eq!(px.dimensions(), (size as u32, size as u32), "{what}");
        // Every pixel within one unit: the sums, and each subsampled pixel.
        let pixels = (size * size) as i64;
        for c in 0..3 {
            let sum: i64 = px.pixels().map(|p| p[c] as i64).sum();
            let want = case["channel_sums"][c].as_i64().unwrap();
            assert!(
                (sum - want).abs() <= pixels,
                "{what}: channel {c} sums to {sum}, PIL's {want}"
            );
        }
        let stride = case["stride"].as_u64().unwrap() as usize;
        let b64 = case["subsample"].as_str().unwrap();
        let want = base64::engine::general_purpose::STANDARD.decode(b64).unwrap();
        let got: Vec<u8> = px
            .rows()
            .step_by(stride)
            .flat_map(|row| row.step_by(stride).flat_map(|p| p.0).collect::<Vec<_>>())
            .collect();
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            let d = g as i32 - w as i32;
            assert!(d.abs() <= 1, "{what}: subsampled value {i} is {g}, PIL's {w}");
            worst = worst.max(d.abs());
        }
        let hash: String = Sha256::digest(px.as_raw()).iter().map(|b| format!("{b:02x}")).collect();
        exact += (hash == case["sha256"].as_str().unwrap()) as usize;
    }
    eprintln!(
        "torchvision preprocessing vs PIL: {exact} of {} crops identical to the bit (SHA-256); largest subsampled difference {worst}",
        cases.len()
    );
}

fn predict_with_torchvision_weights_gives_pytorchs_probabilities() {
    needs_adapter();
    let tmp = temp_dir("predict");
    let dir = tmp.path();
    let fixture_file = json(&fixture("predict.json"));
    for want in fixture_file["networks"].as_array().unwrap() {
        let arch: Arch = want["arch"].as_str().unwrap().parse().unwrap();
        let worst = predict_gives_pytorchs_top5(dir, arch, want);
        eprintln!("predict --weights vs PyTorch, {arch}: largest top-5 probability difference {worst:.2e}");
    }
}

/// `predict --weights` with the recipe's weights of `arch` on the photos of `want` (one
/// network's entry of predict.json) against its top-5; the largest probability difference.
fn predict_gives_pytorchs_top5(dir: &Path, arch: Arch, want: &Value) -> f64 {
    let weights = dir.join(format!("{arch}.safetensors"));
    let hash = write_seeded_weights(&weights, arch, 1000);
    assert_eq!(
        hash,
        want["weights_sha256"].as_str().unwrap(),
        "{arch}: the recipe's weights differ"
    );
    let out = dir.join(format!("{arch}-top.json"));
    let photos: Vec<PathBuf> = want["predictions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| fixture(p["photo"].as_str().unwrap()))
        .collect();
    let mut args =
        vec!["predict", "--weights", weights.to_str().unwrap(), "--json", out.to_str().unwrap()];
    args.extend(photos.iter().map(|p| p.to_str().unwrap()));
    let (ok, text) = syncstep(&args);
    assert!(ok, "{text}");
    let got = json(&out);
    assert_eq!(got["preprocess"], "torchvision");
    let mut worst = 0f64;
    for (g, w) in
        got["images"].as_array().unwrap().iter().zip(want["predictions"].as_array().unwrap())
    {
        let photo = w["photo"].as_str().unwrap();
        for (rank, (g, w)) in
            g["top"].as_array().unwrap().iter().zip(w["top"].as_array().unwrap()).enumerate()
        {
            assert_eq!(g["index"], w["index"], "{arch}, {photo}: class ranked {rank}");
            // ImageNet's names: the 1000-output classifier's default.
            assert_eq!(g["class"], w["class"], "{arch}, {photo}");
            let (p, q) = (g["probability"].as_f64().unwrap(), w["probability"].as_f64().unwrap());
            assert!(
                (p - q).abs() <= PROBABILITY_TOLERANCE,
                "{arch}, {photo}: class {} at {p}, PyTorch's {q}",
                w["index"]
            );
            worst = worst.max((p - q).abs());
        }
        let line =
            format!("{}: {} ", fixture(photo).display(), w["top"][0]["class"].as_str().unwrap());
        assert!(text.contains(&line), "{text}");
    }
    worst
}

/// An image folder of 3 classes, 2 photos-like images each (gradients of several sizes).
fn three_classes(dir: &Path) -> (PathBuf, Vec<(PathBuf, u64)>) {
    let root = dir.join("images");
    let mut images = Vec::new();
    for (label, class) in ["a", "b", "c"].iter().enumerate() {
        std::fs::create_dir_all(root.join(class)).unwrap();
        for i in 0..2u32 {
            let (w, h) = (40 + 13 * i + 5 * label as u32, 36 + 7 * label as u32);
            let img = image::RgbImage::from_fn(w, h, |x, y| {
                image::Rgb([(x * 6 + 40 * label as u32) as u8, (y * 5 + 30 * i) as u8, 90])
            });
            let path = root.join(class).join(format!("{i}.png"));
            img.save(&path).unwrap();
            images.push((path, label as u64));
        }
    }
    (root, images)
}

fn eval_with_torchvision_weights_scores_every_image_as_predict_ranks_them() {
    needs_adapter();
    let tmp = temp_dir("eval");
    let dir = tmp.path();
    let weights = dir.join("three.safetensors");
    write_seeded_weights(&weights, Arch::ResNet34, 3);
    let (root, images) = three_classes(dir);
    let (w, data) = (weights.to_str().unwrap(), root.to_str().unwrap());
    let scores = dir.join("scores.json");
    let (ok, out) = syncstep(&[
        "eval",
        "--weights",
        w,
        "--data",
        data,
        "--image-size",
        "32",
        "--json",
        scores.to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("(all split, 6 images)"), "{out}");
    let scores = json(&scores);
    assert_eq!(
        (scores["split"].as_str(), scores["preprocess"].as_str()),
        (Some("all"), Some("torchvision"))
    );
    assert_eq!(scores["weights"].as_str(), Some(w));
    // predict ranks the same images alike (class indices as names: 3 outputs, no names given).
    let top = dir.join("top.json");
    let mut args = vec![
        "predict",
        "--weights",
        w,
        "--image-size",
        "32",
        "--top",
        "1",
        "--json",
        top.to_str().unwrap(),
    ];
    args.extend(images.iter().map(|(p, _)| p.to_str().unwrap()));
    let (ok, out) = syncstep(&args);
    assert!(ok, "{out}");
    let top = json(&top);
    let predicted = top["images"].as_array().unwrap().iter().map(|i| &i["top"][0]);
    let right = predicted
        .zip(&images)
        .filter(|(p, (_, label))| p["index"].as_u64() == Some(*label))
        .count();
    assert!(top["images"][0]["top"][0]["class"].as_str().unwrap().parse::<u64>().is_ok(), "{top}");
    assert!(
        (scores["top1"].as_f64().unwrap() - right as f64 / 6.0).abs() < 1e-9,
        "{scores} vs {top}"
    );
    // An input size past the device is refused before any image is made at it.
    let img = images[0].0.to_str().unwrap();
    let (ok, out) = syncstep(&["predict", "--weights", w, "--image-size", "100000", img]);
    assert!(
        !ok && out.contains("one image does not fit") && out.contains("use a smaller --image-size"),
        "{out}"
    );
    assert!(!out.contains("panicked"), "{out}");
}

/// Wrong flags and wrong files are refused before any device is made, each naming the fix.
fn wrong_weights_and_flags_are_refused_saying_what_to_do() {
    let tmp = temp_dir("refused");
    let dir = tmp.path();
    let photo = fixture("chelsea.png");
    let img = photo.to_str().unwrap();
    let file = |name: &str, entries: &[(&str, Vec<usize>)]| {
        let zeros: Vec<Vec<f32>> =
            entries.iter().map(|(_, s)| vec![0.0; s.iter().product()]).collect();
        let entries: Vec<_> = entries
            .iter()
            .zip(&zeros)
            .map(|((n, s), z)| (n.to_string(), s.clone(), &z[..]))
            .collect();
        let path = dir.join(name);
        write_f32(&path, &entries, &Default::default()).unwrap();
        path.to_str().unwrap().to_string()
    };
    let wide =
        file("resnet50.safetensors", &[("fc.weight", vec![10, 2048]), ("fc.bias", vec![10])]);
    let headless =
        file("fc-only.safetensors", &[("fc.weight", vec![10, 512]), ("fc.bias", vec![10])]);
    // Tensors naming the blocks of `counts` per stage (BasicBlocks, or Bottlenecks with a conv3),
    // and a classifier [10, 2048].
    let blocks = |name: &str, counts: [usize; 4], bottleneck: bool| {
        let mut names = vec!["fc.weight".to_string()];
        for (stage, count) in counts.iter().enumerate() {
            for i in 0..*count {
                names.push(format!("layer{}.{i}.conv1.weight", stage + 1));
                names.extend(bottleneck.then(|| format!("layer{}.{i}.conv3.weight", stage + 1)));
            }
        }
        let entries: Vec<(&str, Vec<usize>)> = names
            .iter()
            .map(|n| (n.as_str(), if n == "fc.weight" { vec![10, 2048] } else { vec![1] }))
            .collect();
        file(name, &entries)
    };
    let resnet18 = blocks("resnet18.safetensors", [2, 2, 2, 2], false);
    let odd = blocks("odd.safetensors", [2, 2, 2, 2], true);
    let cases: [(&[&str], &[&str]); 10] = [
        (&["predict", img], &["required arguments were not provided", "--checkpoint", "--weights"]),
        (&["predict", "--checkpoint", &wide, "--weights", &wide, img], &["cannot be used with"]),
        (&["predict", "--checkpoint", &wide, "--class-names", &wide, img], &["--weights"]),
        (&["eval", "--weights", &wide], &["--weights needs --data"]),
        (
            &["predict", "--weights", &wide, img],
            &[&wide, "[10, 2048], expected [K, 512]", "torchvision ResNet's"],
        ),
        (
            &["predict", "--weights", &headless, img],
            &[&headless, "missing tensor `conv1.weight`", "torchvision ResNet's"],
        ),
        // The arch is the one the tensor names are, and --arch must agree.
        (&["predict", "--weights", &resnet18, img], &["expected [K, 512] (resnet18)"]),
        (
            &["predict", "--weights", &resnet18, "--arch", "resnet34", img],
            &["resnet18 weights (BasicBlocks [2, 2, 2, 2] per stage), but --arch is resnet34: drop --arch or pass --arch resnet18"],
        ),
        (&["predict", "--weights", &odd, img], &["Bottlenecks [2, 2, 2, 2] per stage are none of torchvision's ResNets"]),
        (&["eval", "--checkpoint", &headless], &[&headless, "torchvision weights go to --weights"]),
    ];
    for (args, says) in cases {
        let (ok, out) = syncstep(args);
        assert!(!ok, "{args:?} succeeded: {out}");
        for s in says {
            assert!(out.contains(s), "{args:?}: no {s:?} in {out}");
        }
        assert!(!out.contains("panicked"), "{out}");
    }
}

/// Errors found once the weights are read: class names that do not fit, data of other classes.
fn class_names_and_data_must_fit_the_classifier() {
    let tmp = temp_dir("classes");
    let dir = tmp.path();
    let weights = dir.join("three.safetensors");
    write_seeded_weights(&weights, Arch::ResNet34, 3);
    let w = weights.to_str().unwrap();
    let (root, _) = three_classes(dir);
    let two = dir.join("two.txt");
    std::fs::write(&two, "cat\ndog\n").unwrap();
    let gap = dir.join("gap.txt");
    std::fs::write(&gap, "cat\n\ndog\n").unwrap();
    std::fs::remove_dir_all(root.join("c")).unwrap();
    let img = fixture("coffee.png");
    // A name of spaces, a blank line after the names, a name twice: said as such, not as a
    // count.
    let predict = |names: &str| {
        let file = dir.join("names.txt");
        std::fs::write(&file, names).unwrap();
        let (f, i) = (file.to_str().unwrap(), img.to_str().unwrap());
        syncstep(&["predict", "--weights", w, "--class-names", f, i])
    };
    for (names, says) in [
        ("cat\n  \ndog\n", "holds a blank name (line 2)"),
        ("cat\ndog\nfox\n\n", "holds a blank name (line 4)"),
        ("cat\ndog\ncat\n", "holds \"cat\" twice (lines 1 and 3)"),
    ] {
        let (ok, out) = predict(names);
        assert!(!ok && out.contains(says) && !out.contains("panicked"), "{names:?}: {out}");
    }
    let cases: [(&[&str], &str); 3] = [
        (
            &[
                "predict",
                "--weights",
                w,
                "--class-names",
                two.to_str().unwrap(),
                img.to_str().unwrap(),
            ],
            "lists 2 names, but the weights' classifier (fc) has 3 outputs",
        ),
        (
            &[
                "predict",
                "--weights",
                w,
                "--class-names",
                gap.to_str().unwrap(),
                img.to_str().unwrap(),
            ],
            "holds a blank name (line 2)",
        ),
        (&["eval", "--weights", w, "--data", root.to_str().unwrap()], "has 2 classes, but"),
    ];
    for (args, says) in cases {
        let (ok, out) = syncstep(args);
        assert!(!ok && out.contains(says), "{args:?}: {out}");
    }
}

tests![
    torchvision_preprocessing_gives_pils_pixels,
    predict_with_torchvision_weights_gives_pytorchs_probabilities,
    eval_with_torchvision_weights_scores_every_image_as_predict_ranks_them,
    wrong_weights_and_flags_are_refused_saying_what_to_do,
    class_names_and_data_must_fit_the_classifier,
];
