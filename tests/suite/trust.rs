//! What syncstep takes as its own and what it trusts: a checkpoint is its own only when it
//! holds the hash of its own content and a run's settings (a file that copies its strings is
//! foreign), a fresh run never replaces another run's checkpoint, an earlier build's format
//! whose settings nothing checks is not run, and class names are distinct and not blank.
//! Every file under each case's folder is held byte for byte.

use std::collections::BTreeMap;

use crate::reliability::{
    gpu_test_dir, one_step_checkpoint, refused, resaved, run, snapshot, text,
};
use syncstep::model::{Arch, ResNet};
use syncstep::tensorfile::{write_f32, TensorFile};

/// The checkpoint at `path` written again to `out` with its metadata `format` set to `format`
/// (and a hash that holds, so that only the format can refuse it).
fn with_format(path: &std::path::Path, out: &std::path::Path, format: &str) {
    let file = TensorFile::read(path).unwrap();
    let values: Vec<(String, Vec<usize>, Vec<f32>)> = file
        .tensors
        .iter()
        .map(|(name, t)| {
            (name.clone(), t.shape.clone(), t.values.iter().map(|&v| v as f32).collect())
        })
        .collect();
    let tensors: Vec<(String, Vec<usize>, &[f32])> =
        values.iter().map(|(n, s, v)| (n.clone(), s.clone(), &v[..])).collect();
    let mut metadata = file.metadata.clone();
    metadata.insert("format".into(), format.into());
    write_f32(out, &tensors, &metadata).unwrap();
}

/// Weights whose metadata says they are a checkpoint, another run's checkpoint (and a link to
/// it) under a fresh run: refused without --overwrite; an earlier build's format refused by
/// resume, eval and predict, pointing to `train --init`, which takes it; class names twice or
/// blank in a checkpoint refused.
fn only_syncsteps_own_checkpoint_is_replaced_and_no_old_format_is_trusted() {
    let tmp = gpu_test_dir();
    let dir = tmp.path();
    let good = one_step_checkpoint(dir);
    let g = good.to_str().unwrap();
    let spoof = dir.join("spoof.safetensors");
    let meta = BTreeMap::from([("format".to_string(), "syncstep-checkpoint-3".to_string())]);
    write_f32(&spoof, &[("fc.weight".into(), vec![2], &[1.0, 2.0])], &meta).unwrap();
    let link = dir.join("link.safetensors");
    std::os::unix::fs::symlink(&good, &link).unwrap();
    let old = dir.join("old.safetensors");
    with_format(&good, &old, "syncstep-checkpoint-2");
    let model = ResNet::new(Arch::ResNet34, 10).unwrap();
    let twice = resaved(&good, &model, dir, "twice.safetensors", |ck| {
        ck.settings.seed = 3; // a run of its own, to hold as another run's
    });
    let (s, l, o) = (spoof.to_str().unwrap(), link.to_str().unwrap(), old.to_str().unwrap());
    let train = ["train", "--steps", "1", "--batch", "2", "--eval-examples", "0"];
    let another = "exists, the checkpoint of another run; a fresh run does not replace it";
    let earlier = "an earlier build's, whose checksum does not cover its settings";
    let cases: Vec<(Vec<&str>, &str)> = vec![
        ([&train[..], &["--checkpoint", s]].concat(), "exists and is not a syncstep checkpoint"),
        ([&train[..], &["--checkpoint", g]].concat(), another),
        ([&train[..], &["--checkpoint", l]].concat(), another),
        ([&train[..], &["--checkpoint", &twice, "--seed", "3"]].concat(), another),
        (vec!["train", "--resume", o, "--steps", "2", "--eval-examples", "0"], earlier),
        (vec!["eval", "--checkpoint", o, "--examples", "2"], earlier),
        (vec!["predict", "--checkpoint", o, "--top", "1", s], earlier),
    ];
    let before = snapshot(&[dir]);
    for (args, says) in &cases {
        let out = run(args, &[], &[]);
        refused(&out, says);
        assert_eq!(snapshot(&[dir]), before, "{args:?} changed a file");
    }
    let out = run(&cases[4].0, &[], &[]);
    assert!(text(&out).contains(&format!("train --init {o}")), "{}", text(&out));
    // The way over: its weights, checked, start a run of this build's format.
    let carried = dir.join("carried.safetensors");
    let c = carried.to_str().unwrap();
    let out = run(&[&train[..], &["--init", o, "--checkpoint", c]].concat(), &[], &[]);
    assert!(out.status.success() && carried.exists(), "{}", text(&out));
    // Asked for: replaced.
    let out = run(&[&train[..], &["--checkpoint", g, "--overwrite"]].concat(), &[], &[]);
    assert!(out.status.success(), "{}", text(&out));
    eprintln!("{} cases", cases.len() + 2);
}

/// Class names in a (re-hashed) checkpoint that are alike or blank are refused by predict and
/// eval, naming the setting.
fn a_checkpoints_class_names_are_distinct_and_not_blank() {
    let tmp = gpu_test_dir();
    let dir = tmp.path();
    let images = crate::reliability::image_folder(dir, 4);
    let ck = crate::reliability::images_checkpoint(dir, &images);
    let model = ResNet::new(Arch::ResNet34, 2).unwrap();
    let rename = |name: &str, names: [&str; 2]| {
        resaved(&ck, &model, dir, name, |ck| {
            let images = ck.settings.images.as_mut().unwrap();
            images.class_names = names.map(String::from).to_vec();
        })
    };
    let (dup, blank) =
        (rename("dup.safetensors", ["ant", "ant"]), rename("blank.safetensors", ["ant", "  "]));
    let img = images.join("ant/0.png");
    let i = img.to_str().unwrap();
    let cases: [(&[&str], &str); 3] = [
        (&["predict", "--checkpoint", &dup, i], "holds \"ant\" twice (numbers 1 and 2)"),
        (&["predict", "--checkpoint", &blank, i], "holds a blank name (number 2)"),
        (&["eval", "--checkpoint", &dup], "setting `class_names`"),
    ];
    let before = snapshot(&[dir]);
    for (args, says) in cases {
        refused(&run(args, &[], &[]), says);
        assert_eq!(snapshot(&[dir]), before, "{args:?} changed a file");
    }
    eprintln!("{} cases", cases.len());
}

/// Pictures and reports that only copy syncstep's marks (a PNG's `Software` chunk, an SVG's
/// first comment, eval's keys), and plot's own picture annotated by hand: refused without
/// --overwrite, left as they were; plot's and eval's own outputs are replaced by the next run.
fn a_picture_or_report_is_ours_only_by_the_hash_it_holds() {
    let tmp = gpu_test_dir();
    let dir = tmp.path();
    let good = one_step_checkpoint(dir);
    let g = good.to_str().unwrap();
    let at = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let log = at("run.jsonl");
    std::fs::write(
        &log,
        "{\"step\":1,\"epoch\":0,\"loss\":2.0}\n{\"step\":2,\"epoch\":0,\"loss\":1.5}\n",
    )
    .unwrap();
    let (own_svg, own_png, own_json) = (at("own.svg"), at("own.png"), at("own.json"));
    for round in 0..2 {
        for out in [&own_svg, &own_png] {
            let o = run(&["plot", &log, "-o", out], &[], &[]);
            assert!(o.status.success(), "round {round}, {out}: {}", text(&o));
        }
        let o = run(&["eval", "--checkpoint", g, "--examples", "2", "--json", &own_json], &[], &[]);
        assert!(o.status.success(), "round {round}: {}", text(&o));
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&own_json).unwrap()).unwrap();
    assert!(json.get("top1").is_some(), "{json}");
    let spoof = |name: &str, bytes: &[u8]| {
        std::fs::write(dir.join(name), bytes).unwrap();
        at(name)
    };
    let png = spoof("spoof.png", b"\x89PNG\r\n\x1a\n\0\0\0\x16tEXtSoftware\0syncstep plot\0\0\0\0");
    let svg = spoof("spoof.svg", b"<!-- syncstep plot -->\n<svg>my drawing</svg>\n");
    let mut annotated = std::fs::read(&own_svg).unwrap();
    annotated.extend_from_slice(b"<!-- my note -->\n");
    let annotated = spoof("annotated.svg", &annotated);
    let other = spoof("other.json", br#"{"split": "val", "top1": 0.5, "confusion": [[1]]}"#);
    let picture = "is not a picture syncstep plot drew";
    let cases: [(&[&str], &str); 4] = [
        (&["plot", &log, "-o", &png], picture),
        (&["plot", &log, "-o", &svg], picture),
        (&["plot", &log, "-o", &annotated], picture),
        (
            &["eval", "--checkpoint", g, "--examples", "2", "--json", &other],
            "is not syncstep eval's scores",
        ),
    ];
    let before = snapshot(&[dir]);
    for (args, says) in cases {
        refused(&run(args, &[], &[]), says);
        assert_eq!(snapshot(&[dir]), before, "{args:?} changed a file");
    }
    eprintln!("{} cases", cases.len() + 3);
}

/// A checkpoint's settings that cannot be run are named as its own, not as flags the user did
/// not give: a batch past its data and an image size past the device (resume and predict), a
/// standard deviation so small a pixel normalises to infinity; its images are not scored as the
/// synthetic dataset's patterns.
fn a_checkpoints_settings_are_named_as_its_own() {
    let tmp = gpu_test_dir();
    let dir = tmp.path();
    let images = crate::reliability::image_folder(dir, 4);
    let ck = crate::reliability::images_checkpoint(dir, &images);
    let c = ck.to_str().unwrap();
    let model = ResNet::new(Arch::ResNet34, 2).unwrap();
    let batch = resaved(&ck, &model, dir, "batch.safetensors", |ck| ck.settings.batch = 1000);
    let size = resaved(&ck, &model, dir, "size.safetensors", |ck| ck.settings.image_size = 100_000);
    let tiny = resaved(&ck, &model, dir, "tiny.safetensors", |ck| {
        ck.settings.images.as_mut().unwrap().norm.std = [1e-40, 0.5, 0.5];
    });
    let img = images.join("ant/0.png");
    let i = img.to_str().unwrap();
    fn resume(ck: &str) -> Vec<&str> {
        vec!["train", "--resume", ck, "--steps", "9", "--eval-examples", "0"]
    }
    let kept = "settings of the checkpoint";
    let cases: Vec<(Vec<&str>, String)> = vec![
        (resume(&batch), format!("fewer than one batch of 1000: these are the {kept} {batch}")),
        (
            vec!["predict", "--checkpoint", &size, i],
            format!("{size}: its setting `image_size` 100000"),
        ),
        (vec!["predict", "--checkpoint", &tiny, i], "a pixel would normalise past".into()),
        (vec!["eval", "--checkpoint", c, "--data", "synthetic"], "was trained on images".into()),
    ];
    let before = snapshot(&[dir]);
    for (args, says) in &cases {
        let o = run(args, &[], &[]);
        refused(&o, says);
        assert!(!text(&o).contains("use a smaller --batch"), "{}", text(&o));
        assert_eq!(snapshot(&[dir]), before, "{args:?} changed a file");
    }
    eprintln!("{} cases", cases.len());
}

tests![
    a_checkpoints_settings_are_named_as_its_own,
    only_syncsteps_own_checkpoint_is_replaced_and_no_old_format_is_trusted,
    a_checkpoints_class_names_are_distinct_and_not_blank,
    a_picture_or_report_is_ours_only_by_the_hash_it_holds,
];
