//! Round five's misleading messages, each now saying what the user gave and what to change:
//! adapters spelt wrong, a negative infinity as a rate, an unknown `WGPU_BACKEND`, a picture or
//! a PyTorch file as weights, DataParallel's `module.` names, a plot of a folder or onto one, a
//! log line that is an array, a batch of one named as `--batch 1`, a checkpoint path ending in
//! a slash, ResNet-18 weights to `--init` without `--arch`, an output name that nearly fills
//! the 255 bytes a name may have. Every file under the test's folder is held byte for byte.

use std::process::Stdio;

use crate::common::*;
use crate::reliability::{refused, run, snapshot, text};
use syncstep::model::Arch;
use syncstep::tensorfile::write_f32;

/// A command's arguments, the variables it runs with, and what its refusal says.
type Case<'a> = (Vec<&'a str>, &'a [(&'a str, &'a str)], &'a str);

fn said_what_to_change() {
    needs_adapter();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let at = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let png = at("photo.png");
    std::fs::write(&png, b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR").unwrap();
    let pth = at("r18.pth");
    std::fs::write(&pth, b"PK\x03\x04\x14\0\0\0archive/data.pkl").unwrap();
    let r18 = at("r18.safetensors");
    let weights = recipe::weights(Arch::ResNet18, 3);
    let entries: Vec<_> =
        weights.iter().map(|(n, (s, v))| (n.clone(), s.clone(), &v[..])).collect();
    write_f32(std::path::Path::new(&r18), &entries, &Default::default()).unwrap();
    let module = at("module.safetensors");
    let prefixed: Vec<_> =
        entries.iter().map(|(n, s, v)| (format!("module.{n}"), s.clone(), *v)).collect();
    write_f32(std::path::Path::new(&module), &prefixed, &Default::default()).unwrap();
    let array = at("array.jsonl");
    std::fs::write(&array, "[1,2,3]\n").unwrap();
    let folder = at("logs");
    std::fs::create_dir(&folder).unwrap();
    fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let train = ["train", "--batch", "2", "--steps", "1", "--eval-examples", "0"];
        [&train[..], extra].concat()
    }
    let slash = format!("{}/", at("new.safetensors"));
    let (a_svg, in_folder) = (at("a.svg"), at("logs/a.svg"));
    let cases: Vec<Case> = vec![
        (with(&["--replicas", "2", "--adapters", "0,,1"]), &[], "is empty (two commas"),
        (with(&["--adapter", "-1"]), &[], "is negative: adapters count from 0"),
        (with(&["--adapter", "1:vulkan"]), &[], "the backend comes first (vulkan:1)"),
        (with(&["--adapter", "vulkan:x"]), &[], "has no number after the colon"),
        (with(&["--lr", "-inf"]), &[], "learning rate must be finite"),
        (vec!["info"], &[("WGPU_BACKEND", "garbage")], "WGPU_BACKEND=\"garbage\": give backends"),
        (vec!["predict", "--weights", &png, &png], &[], "a PNG image, not a safetensors file"),
        (vec!["predict", "--weights", &pth, &png], &[], "a PyTorch file (torch.save)"),
        (vec!["predict", "--weights", &module, &png], &[], "starts with `module.`"),
        (with(&["--arch", "resnet18", "--init", &module]), &[], "starts with `module.`"),
        (
            with(&["--init", &r18]),
            &[],
            "without --arch the run is a resnet34: pass --arch resnet18",
        ),
        (
            vec!["plot", &array, "-o", &a_svg],
            &[],
            "line 1: not a metrics record (not a JSON object)",
        ),
        (vec!["plot", &folder, "-o", &in_folder], &[], "is a folder: give the metrics log"),
        (vec!["plot", &array, "-o", &folder], &[], "is a folder, not a regular file"),
        (vec!["bench", "--batch", "1", "--no-roofline"], &[], "--batch 1: a training batch of 1"),
        (with(&["--checkpoint", &slash]), &[], "is not a file path (it names a folder)"),
    ];
    let before = snapshot(&[dir]);
    for (args, env, says) in &cases {
        let mut c = command();
        c.args(args).envs(env.iter().copied()).stdin(Stdio::null());
        refused(&c.output().unwrap(), says);
        assert_eq!(snapshot(&[dir]), before, "{args:?} changed a file");
    }
    // A legal name of 255 bytes: its lock and temporary file fit beside it.
    let log = at("run.jsonl");
    std::fs::write(&log, "{\"step\":1,\"epoch\":0,\"loss\":2.0}\n").unwrap();
    let long = at(&format!("{}.svg", "x".repeat(251)));
    let o = run(&["plot", &log, "-o", &long], &[], &[]);
    assert!(o.status.success() && std::path::Path::new(&long).exists(), "{}", text(&o));
    eprintln!("{} cases", cases.len() + 1);
}

tests![said_what_to_change];
