//! What a hostile-but-honest user does to the command line, class by class: no panic, no hang,
//! no exit 0 on a wrong result, no file of the user's lost or overwritten, no misleading
//! message. Each test tries a list of cases and says how many; docs/reliability.md keeps the
//! tally. Add a case here for every bug found.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use syncstep::checkpoint::{self, Checkpoint};
use syncstep::model::{Arch, ResNet};
use syncstep::tensorfile::{write_f32, TensorFile};

/// A fresh folder of this test's own, removed when dropped, however the test ends.
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("syncstep-reliability-{name}-")).tempdir().unwrap()
}

/// A fresh folder for a test whose binary needs an adapter, removed when dropped however the
/// test ends (see [`needs_adapter`]).
pub(crate) fn gpu_test_dir() -> tempfile::TempDir {
    needs_adapter();
    tempfile::tempdir().unwrap()
}

/// The binary with `args`, `set` variables set and `unset` ones removed.
pub(crate) fn run(args: &[&str], set: &[(&str, &str)], unset: &[&str]) -> Output {
    let mut c = crate::common::command();
    c.args(args).stdin(Stdio::null());
    set.iter().for_each(|(k, v)| {
        c.env(k, v);
    });
    unset.iter().for_each(|k| {
        c.env_remove(k);
    });
    c.output().unwrap()
}

pub(crate) fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A refusal: a non-zero exit, an `error:` line, no panic, and `says` in the message.
#[track_caller]
pub(crate) fn refused(o: &Output, says: &str) {
    let t = text(o);
    assert!(!o.status.success(), "exited 0:\n{t}");
    assert!(!t.contains("panicked") && !t.contains("RUST_BACKTRACE"), "panicked:\n{t}");
    assert!(t.contains("error:") || t.contains("error: "), "no error line:\n{t}");
    assert!(t.contains(says), "expected {says:?} in:\n{t}");
}

/// A checkpoint of one step at batch 2 (a real run: every later case starts from it).
pub(crate) fn one_step_checkpoint(dir: &Path) -> PathBuf {
    let path = dir.join("good.safetensors");
    let p = path.to_str().unwrap();
    let (ok, log) = syncstep(&[
        "train",
        "--steps",
        "1",
        "--batch",
        "2",
        "--eval-examples",
        "0",
        "--checkpoint",
        p,
    ]);
    assert!(ok, "{log}");
    path
}

/// Sizes past what a device or the host holds, in flags and in a checkpoint: errors naming
/// them, before any work, and never a panic (32-bit overflow, capacity overflow).
fn sizes_past_every_limit_are_errors_not_panics() {
    needs_adapter();
    let tmp = temp_dir("sizes");
    let dir = tmp.path();
    let cases: [(&[&str], &str); 9] = [
        (&["train", "--image-size", "65536", "--steps", "1"], "65536×65536"),
        (&["train", "--image-size", "4294967295", "--steps", "1"], "4294967295"),
        (&["train", "--batch", "18446744073709551615", "--steps", "1"], "host memory"),
        (
            &["train", "--image-size", "2048", "--steps", "1", "--eval-examples", "0"],
            "storage binding",
        ),
        (&["bench", "--roofline-size", "4000000000", "--steps", "1"], "--roofline-size"),
        (&["bench", "--image-size", "4096", "--steps", "1"], "--batch"),
        (&["check", "--global-batch", "0"], "cannot give each of 2 replicas"),
        (&["check", "--replicas", "0"], "replica count must be at least 1"),
        (
            &["grad", "--weights", "/nonexistent", "--batch", "/nonexistent", "--out", "/tmp/x"],
            "/nonexistent",
        ),
    ];
    for (args, says) in cases {
        refused(&run(args, &[], &[]), says);
    }
    // The same sizes through a checkpoint's metadata.
    let good = one_step_checkpoint(dir);
    let model = ResNet::new(Arch::ResNet34, 10).unwrap();
    let mut ck = checkpoint::load(&good, &model).unwrap();
    ck.settings.image_size = 65536;
    let big = dir.join("big.safetensors");
    checkpoint::save(&big, &model, &ck).unwrap();
    refused(&run(&["train", "--resume", big.to_str().unwrap(), "--steps", "1"], &[], &[]), "65536");
    eprintln!("{} cases", cases.len() + 1);
}

/// Outputs that would destroy an input, a device node or a folder; a failed PORTABLE's golden;
/// an autotune cache that is someone else's file: refused or left alone, byte for byte.
fn no_file_of_the_users_is_ever_overwritten() {
    needs_adapter();
    let tmp = temp_dir("files");
    let dir = tmp.path();
    let good = one_step_checkpoint(dir);
    let g = good.to_str().unwrap();
    let before = std::fs::read(&good).unwrap();
    let link = dir.join("link.safetensors");
    std::os::unix::fs::symlink(&good, &link).unwrap();
    let l = link.to_str().unwrap();
    let d = dir.to_str().unwrap();
    let cases: [(&[&str], &str); 5] = [
        (&["grad", "--weights", g, "--batch", g, "--out", g], "same file as the input"),
        (&["grad", "--weights", g, "--batch", g, "--out", l], "same file as the input"),
        (&["grad", "--weights", g, "--batch", g, "--out", d], "is a folder, not a regular file"),
        (&["check", "--against", g, "--golden", g], "same file as the input"),
        (
            &["train", "--steps", "1", "--checkpoint", "/nonexistent/dir/ck.safetensors"],
            "does not exist",
        ),
    ];
    for (args, says) in cases {
        refused(&run(args, &[], &[]), says);
        assert_eq!(std::fs::read(&good).unwrap(), before, "{args:?} changed the input");
    }
    // An autotune cache variable naming a user's file: used for nothing, left as it was.
    let notes = dir.join("notes.txt");
    std::fs::write(&notes, b"my notes\n").unwrap();
    let tune = [("SYNCSTEP_AUTOTUNE_CACHE", notes.to_str().unwrap())];
    // The autotune must run to read the file (scripts/test.sh forces the clockless choice).
    let o = run(&["bench", "--steps", "1", "--no-roofline"], &tune, &["SYNCSTEP_CONV_ALGO"]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(std::fs::read(&notes).unwrap(), b"my notes\n");
    assert!(text(&o).contains("is not a syncstep autotune cache"), "{}", text(&o));
    // Temporary files a killed writer left are cleared by the next write there.
    let stale = dir.join(".good.safetensors.tmp-4294967295-a1B2c3");
    std::fs::write(&stale, vec![0u8; 1000]).unwrap();
    let (ok, log) = syncstep(&[
        "train",
        "--steps",
        "1",
        "--batch",
        "2",
        "--eval-examples",
        "0",
        "--checkpoint",
        g,
        "--overwrite",
    ]);
    assert!(ok && !stale.exists(), "{log}");
    eprintln!("{} cases", cases.len() + 2);
}

/// Checkpoints that are corrupt, incomplete or ask for another run: refused, never resumed
/// with defaults filled in; a changed hyper-parameter needs --override and is said.
fn a_bad_checkpoint_or_a_changed_setting_is_never_resumed_silently() {
    needs_adapter();
    let tmp = temp_dir("checkpoints");
    let dir = tmp.path();
    let good = one_step_checkpoint(dir);
    let model = ResNet::new(Arch::ResNet34, 10).unwrap();
    let ck = checkpoint::load(&good, &model).unwrap();
    let resume = |path: &Path, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--resume",
            path.to_str().unwrap(),
            "--steps",
            "1",
            "--eval-examples",
            "0",
        ];
        args.extend_from_slice(extra);
        run(&args, &[], &[])
    };
    // One flipped bit in the data.
    let mut bytes = std::fs::read(&good).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x04;
    let flipped = dir.join("flipped.safetensors");
    std::fs::write(&flipped, &bytes).unwrap();
    refused(&resume(&flipped, &[]), "does not match the SHA-256");
    // Missing running statistics, a missing setting, an unparsable step.
    let file = TensorFile::read(&good).unwrap();
    let strip = |drop: &dyn Fn(&str) -> bool,
                 meta: &dyn Fn(&mut std::collections::BTreeMap<String, String>),
                 name: &str| {
        let values: Vec<(String, Vec<usize>, Vec<f32>)> = file
            .tensors
            .iter()
            .filter(|(n, _)| !drop(n))
            .map(|(n, t)| {
                (n.clone(), t.shape.clone(), t.values.iter().map(|&v| v as f32).collect())
            })
            .collect();
        let entries: Vec<(String, Vec<usize>, &[f32])> =
            values.iter().map(|(n, s, v)| (n.clone(), s.clone(), v.as_slice())).collect();
        let mut m = file.metadata.clone();
        m.remove("sha256");
        meta(&mut m);
        let path = dir.join(name);
        write_f32(&path, &entries, &m).unwrap();
        path
    };
    let no_running = strip(&|n| n.ends_with("running_var"), &|_| {}, "no-running.safetensors");
    refused(&resume(&no_running, &[]), "running_var");
    let no_seed = strip(&|_| false, &|m| drop(m.remove("seed")), "no-seed.safetensors");
    refused(&resume(&no_seed, &[]), "metadata `seed` is missing");
    let bad_step =
        strip(&|_| false, &|m| drop(m.insert("step".into(), "-3".into())), "bad-step.safetensors");
    refused(&resume(&bad_step, &[]), "metadata `step`");
    let huge = Checkpoint { step: (1 << 53) - 1, ..ck.clone() };
    let wrapping = dir.join("wrapping.safetensors");
    checkpoint::save(&wrapping, &model, &huge).unwrap();
    refused(&resume(&wrapping, &[]), "passes the largest step count");
    // A hyper-parameter the checkpoint was trained with: changed only with --override, said so.
    refused(&resume(&good, &["--lr", "0.5"]), "add --override");
    let o = resume(&good, &["--lr", "0.5", "--override"]);
    assert!(
        o.status.success() && text(&o).contains("--lr 0.5 overrides the checkpoint's 0.01"),
        "{}",
        text(&o)
    );
    refused(&resume(&good, &["--batch", "4", "--override"]), "--batch 2");
    eprintln!("8 cases");
}

/// A run that diverges stops with an error naming the step and keeps its last good checkpoint
/// (resumable); `grad` with weights that overflow exits non-zero.
fn a_diverging_run_fails_and_keeps_the_last_good_checkpoint() {
    needs_adapter();
    let tmp = temp_dir("diverge");
    let dir = tmp.path();
    let good = one_step_checkpoint(dir);
    let g = good.to_str().unwrap();
    let before = std::fs::read(&good).unwrap();
    let o = run(
        &[
            "train",
            "--resume",
            g,
            "--checkpoint",
            g,
            "--lr",
            "1e12",
            "--override",
            "--steps",
            "6",
            "--eval-examples",
            "0",
            "--checkpoint-every",
            "1",
        ],
        &[],
        &[],
    );
    refused(&o, "the run diverged at step");
    assert!(text(&o).contains("last good checkpoint"), "{}", text(&o));
    let model = ResNet::new(Arch::ResNet34, 10).unwrap();
    let kept = checkpoint::load(&good, &model).expect("the kept checkpoint loads");
    assert!(kept.params.iter().all(|v| v.is_finite()));
    if std::fs::read(&good).unwrap() != before {
        assert!(kept.step > 1, "a later good step may have been saved");
    }
    // grad: every parameter at 1e18 (each one below the bound a load holds weights to)
    // overflows the activations to infinity; the output is written, the exit is not 0.
    let mut ck = checkpoint::load(&good, &model).unwrap();
    ck.params.fill(1e18);
    let weights = dir.join("huge.safetensors");
    let entries: Vec<(String, Vec<usize>, &[f32])> = model
        .params
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone(), &ck.params[p.range()]))
        .collect();
    write_f32(&weights, &entries, &Default::default()).unwrap();
    let batch = syncstep::data::synthetic_batch(1, 0, 2, 32, 32, 10).unwrap();
    let b = dir.join("batch.safetensors");
    let state = (&ck.params[..], &ck.running[..]);
    checkpoint::write_step_inputs(&b, &model, state, &batch.images, 32, &int64(&batch.labels))
        .unwrap();
    let out = dir.join("g.safetensors");
    let o = run(
        &[
            "grad",
            "--weights",
            weights.to_str().unwrap(),
            "--batch",
            b.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
        &[],
    );
    refused(&o, "hold NaN or infinity");
    assert!(out.exists(), "the output is still written, to look at");
    eprintln!("2 cases");
}

/// SIGINT and SIGTERM: the step in flight finishes, the checkpoint is written, the exit status
/// is 130 or 143 and says where; the run resumes from there.
fn a_signal_saves_the_run_and_exits_with_its_status() {
    needs_adapter();
    let tmp = temp_dir("signals");
    let dir = tmp.path();
    for (signal, code) in [("INT", 130), ("TERM", 143)] {
        let ck = dir.join(format!("{signal}.safetensors"));
        let c = ck.to_str().unwrap();
        let args = ["train", "--steps", "1000", "--batch", "2", "--eval-examples", "0"];
        // Once the first step is done (its line is printed), ask it to stop.
        let (child, lines) = started_at(&[&args[..], &["--checkpoint", c]].concat(), "step 1 ");
        let (status, err) = stop(child, lines, signal);
        assert_eq!(status, Some(code), "SIG{signal}: {err}");
        assert!(
            err.contains(&format!("SIG{signal}: stopped after step")) && err.contains("--resume"),
            "{err}"
        );
        let model = ResNet::new(Arch::ResNet34, 10).unwrap();
        let saved = checkpoint::load(&ck, &model).unwrap();
        assert!(saved.step >= 1 && saved.step < 1000, "step {}", saved.step);
    }
    eprintln!("2 cases");
}

/// Messages that must say what is wrong in the user's words, and what to do.
fn messages_name_what_to_change() {
    needs_adapter();
    refused(
        &run(&["train", "--label-smoothing", "-0.1", "--steps", "1"], &[], &[]),
        "label smoothing must be in [0, 1)",
    );
    refused(&run(&["train", "--lr", "-1", "--steps", "1"], &[], &[]), "learning rate");
    for command in ["train", "check", "bench", "grad"] {
        let o = run(&[command, "--bucket-mb", "-1"], &[], &[]);
        refused(&o, "invalid value '-1' for '--bucket-mb <BUCKET_MB>': give MiB from 0 to 1048576");
    }
    refused(
        &run(&["train", "--batch", "1", "--steps", "1"], &[], &[]),
        "Expected more than 1 value per channel when training",
    );
    let metal = run(&["info"], &[("WGPU_BACKEND", "metal")], &[]);
    refused(&metal, "WGPU_BACKEND=metal");
    assert!(text(&metal).contains("This machine's adapters"), "{}", text(&metal));
    refused(&run(&["info"], &[("SYNCSTEP_ADAPTER", "foo")], &[]), "SYNCSTEP_ADAPTER=\"foo\"");
    refused(
        &run(&["train", "--steps", "1"], &[("SYNCSTEP_ADAPTER", "7")], &[]),
        "there is no adapter 7",
    );
    // No driver noise before anything of ours when XDG_RUNTIME_DIR is unset.
    let o = run(&["info"], &[], &["XDG_RUNTIME_DIR"]);
    assert!(o.status.success() && !text(&o).contains("XDG_RUNTIME_DIR"), "{}", text(&o));
    // No held-out images asked for: said so, not "0.0%".
    let o = run(&["train", "--steps", "1", "--batch", "2", "--eval-examples", "0"], &[], &[]);
    assert!(o.status.success() && text(&o).contains("not measured"), "{}", text(&o));
    eprintln!("13 cases");
}

/// What could run for weeks is capped or refused up front: nothing hangs.
fn nothing_runs_unbounded() {
    needs_adapter();
    let o = run(&["train", "--eval-examples", "100000000"], &[], &[]);
    refused(&o, "at most 100000");
    assert!(!text(&o).contains("syncstep train:"), "refused only after setting up: {}", text(&o));
    eprintln!("1 case");
}

/// Every regular file under `paths` (recursively) and its bytes: what a case must leave as it
/// was. A pipe is not read (that would block), nor is a link followed.
pub(crate) fn snapshot(paths: &[&Path]) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files = Vec::new();
    let mut todo: Vec<PathBuf> = paths.iter().map(|p| p.to_path_buf()).collect();
    while let Some(path) = todo.pop() {
        let kind = std::fs::symlink_metadata(&path).unwrap().file_type();
        if kind.is_dir() {
            todo.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
        } else if kind.is_file() {
            files.push((path.clone(), std::fs::read(&path).unwrap()));
        }
    }
    files.sort();
    files
}

/// An ImageFolder of two classes of `per_class` 32×32 PNGs each, under `dir`.
pub(crate) fn image_folder(dir: &Path, per_class: u8) -> PathBuf {
    let root = dir.join("images");
    for (c, class) in ["ant", "bee"].iter().enumerate() {
        std::fs::create_dir_all(root.join(class)).unwrap();
        for i in 0..per_class {
            let img = image::RgbImage::from_fn(32, 32, |x, y| {
                image::Rgb([(x * 8) as u8 ^ i, (y * 8) as u8, 200 * c as u8])
            });
            img.save(root.join(class).join(format!("{i}.png"))).unwrap();
        }
    }
    root
}

/// CIFAR-10's six binary files under `dir`, of two records each.
fn cifar10(dir: &Path) -> PathBuf {
    let root = dir.join("cifar");
    std::fs::create_dir_all(&root).unwrap();
    let record = |label: u8| std::iter::once(label).chain((0..3072).map(|i| i as u8));
    let files = ["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5"];
    for name in files.iter().chain(&["test_batch"]) {
        let bytes: Vec<u8> = record(1).chain(record(7)).collect();
        std::fs::write(root.join(format!("{name}.bin")), bytes).unwrap();
    }
    root
}

/// A checkpoint of one step on `images`.
pub(crate) fn images_checkpoint(dir: &Path, images: &Path) -> PathBuf {
    let path = dir.join("on-images.safetensors");
    let (i, p) = (images.to_str().unwrap(), path.to_str().unwrap());
    let args = ["--normalize", "imagenet", "--val-split", "0.5", "--checkpoint", p];
    let train = ["train", "--data", i, "--steps", "1", "--batch", "2"];
    let o = run(&[&train[..], &args[..]].concat(), &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    path
}

/// Outputs onto or inside any input of the same command — a dataset's files, `--init`, the
/// log, a scored image — are refused with every input unchanged; a checkpoint that is a link
/// is written through to its target, the link kept.
fn no_output_lands_on_or_inside_an_input() {
    needs_adapter();
    let tmp = temp_dir("inputs");
    let dir = tmp.path();
    let good = one_step_checkpoint(dir);
    let (images, cifar) = (image_folder(dir, 4), cifar10(dir));
    let log = dir.join("run.jsonl");
    std::fs::write(&log, b"{\"step\":1,\"epoch\":0,\"loss\":2.0}\n").unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (g, i, c, l) = (s(&good), s(&images), s(&cifar), s(&log));
    let (test_batch, png) = (s(&cifar.join("test_batch.bin")), s(&images.join("ant/0.png")));
    let cifar_data = format!("cifar10:{c}");
    let fresh = s(&dir.join("fresh.jsonl"));
    let train = ["train", "--steps", "1", "--batch", "2", "--eval-examples", "0"];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--data", &cifar_data, "--checkpoint", &test_batch], "lies inside the input folder"),
        (vec!["--data", &i, "--normalize", "imagenet", "--checkpoint", &png], "lies inside"),
        (vec!["--init", &g, "--checkpoint", &g], "same file as the input"),
        (vec!["--checkpoint", &l, "--log", &l, "--resume", &g], "same file as the input"),
        (vec!["--checkpoint", &fresh, "--log", &fresh], "same file as the input"),
        (vec!["--resume", &g, "--log", &g], "same file as the input"),
    ];
    let inputs = [dir];
    let before = snapshot(&inputs);
    for (extra, says) in &cases {
        let args: Vec<&str> = train.iter().copied().chain(extra.iter().copied()).collect();
        refused(&run(&args, &[], &[]), says);
        assert_eq!(snapshot(&inputs), before, "{args:?} changed an input");
    }
    let eval = run(&["eval", "--checkpoint", &g, "--data", &i, "--json", &png], &[], &[]);
    refused(&eval, "lies inside the input folder");
    assert_eq!(snapshot(&inputs), before, "eval --json changed an input");
    // A checkpoint that is a link: its target is written, the link stays one.
    let target = dir.join("runs/ck.safetensors");
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    let link = dir.join("ck-link.safetensors");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let link_text = s(&link);
    let args: Vec<&str> = train.iter().copied().chain(["--checkpoint", &link_text]).collect();
    let o = run(&args, &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    let model = ResNet::new(Arch::ResNet34, 10).unwrap();
    assert_eq!(checkpoint::load(&target, &model).unwrap().step, 1);
    eprintln!("{} cases", cases.len() + 2);
}

/// Flags given without effect, counts of zero that would do nothing, negative values: each an
/// error naming the flag (or, for a warm-up longer than the run, a note), nothing changed.
fn flags_without_effect_and_counts_that_do_nothing_are_named() {
    needs_adapter();
    let tmp = temp_dir("flags");
    let dir = tmp.path();
    let good = one_step_checkpoint(dir);
    let images = image_folder(dir, 4);
    let (g, i) = (good.to_str().unwrap(), images.to_str().unwrap());
    let on_images = images_checkpoint(dir, &images);
    let m = on_images.to_str().unwrap();
    let before = snapshot(&[dir]);
    let cases: [(&[&str], &str); 17] = [
        (&["train", "--steps", "1", "--checkpoint-every", "5"], "--checkpoint-every has no effect"),
        (&["bench", "--shapes-only", "--steps", "3"], "'--shapes-only' cannot be used with '--steps"),
        (&["train", "--steps", "1", "--bucket-mb", "8"], "--bucket-mb sizes the gradient buckets"),
        (&["eval", "--checkpoint", g, "--workers", "2"], "--workers applies to a dataset of images"),
        (&["eval", "--checkpoint", g, "--split", "train"], "--split applies to a dataset of images"),
        (&["train", "--steps", "1", "--augment", "none"], "--augment applies to images"),
        (&["train", "--data", i, "--val-split", "-1"], "validation split -1 is not in [0, 1)"),
        (
            &["train", "--data", i, "--epochs", "0"],
            "'0' for '--epochs <EPOCHS>': 0 would do nothing",
        ),
        (&["train", "--batch", "-2"], "'-2' for '--batch <BATCH>': cannot be negative"),
        (&["train", "--steps", "0"], "'0' for '--steps <STEPS>': 0 would do nothing"),
        (&["train", "--data", i, "--workers", "0"], "'0' for '--workers <WORKERS>'"),
        (&["eval", "--checkpoint", g, "--examples", "0"], "0 would do nothing"),
        (&["eval", "--checkpoint", m, "--examples", "5"], "drop --examples"),
        (&["predict", "--checkpoint", g, "--top", "0", i], "'0' for '--top <TOP>'"),
        (&["train", "--resume", g, "--batch", "4", "--override"], "which a resume keeps"),
        (
            &["train", "--resume", g, "--arch", "resnet18", "--override"],
            "--arch resnet18: the checkpoint was trained with --arch resnet34",
        ),
        (
            &["eval", "--checkpoint", g, "--arch", "resnet50"],
            "the checkpoint is a resnet34, not a resnet50 (--arch): drop --arch or pass --arch resnet34",
        ),
    ];
    for (args, says) in cases {
        let o = run(args, &[], &[]);
        refused(&o, says);
        assert!(!text(&o).contains("add --override"), "{}", text(&o));
        assert_eq!(snapshot(&[dir]), before, "{args:?} changed a file");
    }
    let o = run(
        &["train", "--steps", "1", "--batch", "2", "--eval-examples", "0", "--warmup-steps", "5"],
        &[],
        &[],
    );
    assert!(o.status.success() && text(&o).contains("never reaches --lr"), "{}", text(&o));
    eprintln!("{} cases", cases.len() + 1);
}

/// `syncstep ARGS…` started with its output piped, once a line of its standard output starts
/// with `at` (the handshake: it has got that far): the child, and its lines still to read. The
/// product offers no other (no ready file), and needs none: `train` handles the signals from
/// its first instruction, before it prints anything, so a line read means a signal sent now is
/// handled, and says where the run was.
fn started_at(args: &[&str], at: &str) -> (std::process::Child, impl Iterator<Item = String>) {
    let mut child = crate::common::command()
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout)).map_while(Result::ok);
    assert!(lines.by_ref().any(|line| line.starts_with(at)), "{args:?} never printed {at:?}");
    (child, lines)
}

/// Sends SIG`signal` to `child` and waits for it, reading the rest of its output (a closed pipe
/// would fail its next line): its exit status and standard error.
fn stop(
    child: std::process::Child,
    lines: impl Iterator<Item = String>,
    signal: &str,
) -> (Option<i32>, String) {
    let pid = child.id().to_string();
    assert!(Command::new("kill").args([&format!("-{signal}"), &pid]).status().unwrap().success());
    lines.for_each(drop);
    let out = child.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Runs `args` and sends SIG`signal` once a line of its output starts with `at`: its exit
/// status and standard error.
fn signalled(args: &[&str], at: &str, signal: &str) -> (Option<i32>, String) {
    let (child, lines) = started_at(args, at);
    stop(child, lines, signal)
}

/// A signal during an evaluation — the one before training, the final one — is honoured: the
/// run exits 143 saying what the checkpoint holds.
fn a_signal_during_an_evaluation_is_honoured() {
    needs_adapter();
    let tmp = temp_dir("signal-eval");
    let dir = tmp.path();
    let ck = dir.join("ck.safetensors");
    let c = ck.to_str().unwrap();
    // Before training: the held-out evaluation of 100000 images, stopped at its start.
    let args =
        ["train", "--steps", "2", "--batch", "2", "--eval-examples", "100000", "--checkpoint", c];
    let (code, err) = signalled(&args, "syncstep train:", "TERM");
    assert_eq!(code, Some(143), "{err}");
    assert!(err.contains("SIGTERM: stopped before training; no step was trained"), "{err}");
    assert!(!ck.exists());
    // The final evaluation, over 400 validation images, once the checkpoint is written.
    let images = image_folder(dir, 250);
    let i = images.to_str().unwrap();
    let args = [
        "train",
        "--data",
        i,
        "--val-split",
        "0.8",
        "--normalize",
        "imagenet",
        "--steps",
        "1",
        "--batch",
        "2",
        "--checkpoint",
        c,
    ];
    let (code, err) = signalled(&args, "checkpoint: ", "TERM");
    assert_eq!(code, Some(143), "{err}");
    assert!(err.contains("SIGTERM: stopped during the final evaluation, after step 1"), "{err}");
    assert!(err.contains(&format!("--resume {c}")), "{err}");
    let model = ResNet::new(Arch::ResNet34, 2).unwrap();
    assert_eq!(checkpoint::load(&ck, &model).unwrap().step, 1);
    eprintln!("2 cases");
}

/// What would run unbounded, or block on a pipe, is refused before it starts.
fn nothing_waits_forever() {
    needs_adapter();
    let tmp = temp_dir("unbounded");
    let dir = tmp.path();
    let good = one_step_checkpoint(dir);
    let g = good.to_str().unwrap();
    let on_images = images_checkpoint(dir, &image_folder(dir, 4));
    let fifo = dir.join("pipe.safetensors");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let f = fifo.to_str().unwrap();
    let svg = dir.join("c.svg");
    let cases: [(&[&str], &str); 5] = [
        (&["eval", "--checkpoint", g, "--examples", "100000000"], "at most 100000"),
        (&["train", "--resume", f, "--steps", "1"], "not a regular file"),
        (&["eval", "--checkpoint", f], "not a regular file"),
        (&["predict", "--checkpoint", on_images.to_str().unwrap(), f], "not a regular file"),
        (&["plot", f, "-o", svg.to_str().unwrap()], "not a regular file"),
    ];
    let before = snapshot(&[dir]);
    for (args, says) in cases {
        refused(&run_within(args, Duration::from_secs(120)), says);
        assert_eq!(snapshot(&[dir]), before, "{args:?} changed a file");
    }
    eprintln!("{} cases", cases.len());
}

/// The binary with `args`, killed (and the test failed) if it runs past `limit`: a case that
/// would hang fails instead of hanging the suite.
fn run_within(args: &[&str], limit: Duration) -> Output {
    let mut child = crate::common::command()
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            child.kill().unwrap();
            panic!("{args:?} still ran after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// Threads, address space and GPU memory that run out: errors naming the resource.
fn exhausted_resources_are_named() {
    needs_adapter();
    let tmp = temp_dir("resources");
    let dir = tmp.path();
    let images = image_folder(dir, 4);
    let i = images.to_str().unwrap();
    refused(&run(&["train", "--data", i, "--workers", "10000"], &[], &[]), "loader threads");
    let limited = |limit_kib: u64, args: &str| {
        let bin = env!("CARGO_BIN_EXE_syncstep");
        let script = format!("ulimit -v {limit_kib} && exec {bin} {args}");
        let mut sh = Command::new("sh");
        sh.envs(suite_env()).args(["-c", &script]).stdin(Stdio::null()).output().unwrap()
    };
    let train = "train --steps 1 --batch 2 --eval-examples 0";
    refused(&limited(600_000, train), "address-space limit (ulimit -v)");
    // Threads past the address space: 1000 loader threads' stacks do not fit in 3 GB.
    let o = limited(3_000_000, &format!("{train} --data {i} --workers 1000 --normalize imagenet"));
    refused(&o, "use a smaller --workers");
    eprintln!("3 cases");
}

/// A tensor's shape in a weights file, or None to leave it out.
type Reshaped = Option<Vec<usize>>;

/// ResNet-34 weights of 10 classes at `path`, each tensor in the shape `shape_of` gives it
/// (its values repeated to fill it).
fn reshaped_weights(path: &Path, shape_of: &dyn Fn(&str, Vec<usize>) -> Reshaped) {
    let model = ResNet::new(Arch::ResNet34, 10).unwrap();
    let (params, running) = (model.init_params(3), model.init_buffers());
    let tensors = model.params.iter().map(|t| (t, &params));
    let mut values = Vec::new();
    for (t, data) in tensors.chain(model.buffers.iter().map(|t| (t, &running))) {
        if let Some(shape) = shape_of(&t.name, t.shape.clone()) {
            let n = shape.iter().product::<usize>();
            let v: Vec<f32> = data[t.range()].iter().copied().cycle().take(n).collect();
            values.push((t.name.clone(), shape, v));
        }
    }
    let entries: Vec<(String, Vec<usize>, &[f32])> =
        values.iter().map(|(n, s, v)| (n.clone(), s.clone(), v.as_slice())).collect();
    write_f32(path, &entries, &Default::default()).unwrap();
}

/// `--init` weights: a malformed classifier and missing running statistics are errors naming
/// the tensor; a classifier of another class count is initialised afresh, said so.
fn init_weights_are_taken_whole_or_refused() {
    needs_adapter();
    let tmp = temp_dir("init");
    let dir = tmp.path();
    let images = image_folder(dir, 4);
    let i = images.to_str().unwrap();
    let weights = |name: &str, shape_of: &dyn Fn(&str, Vec<usize>) -> Reshaped| {
        let path = dir.join(name);
        reshaped_weights(&path, shape_of);
        path
    };
    let narrow = weights("narrow.safetensors", &|n, s| {
        Some(if n == "fc.weight" { vec![10, 256] } else { s })
    });
    let bias = weights("bias.safetensors", &|n, s| Some(if n == "fc.bias" { vec![7] } else { s }));
    let no_stats = weights("stats.safetensors", &|n, s| (!n.contains("running")).then_some(s));
    let whole = weights("whole.safetensors", &|_, s| Some(s));
    let cases = [
        (&narrow, "`fc.weight` has shape [10, 256]"),
        (&bias, "`fc.bias` has shape [7], but `fc.weight` has 10 rows"),
        (&no_stats, "missing tensor `bn1.running_mean`"),
    ];
    let before = snapshot(&[dir]);
    let train = |w: &Path| {
        let args = [
            "train",
            "--data",
            i,
            "--batch",
            "2",
            "--steps",
            "1",
            "--normalize",
            "imagenet",
            "--init",
            w.to_str().unwrap(),
        ];
        run(&args, &[], &[])
    };
    for (w, says) in cases {
        refused(&train(w), says);
        assert_eq!(snapshot(&[dir]), before);
    }
    let o = train(&whole);
    let t = text(&o);
    assert!(
        o.status.success() && t.contains("its classifier is for 10 classes and this run's for 2"),
        "{t}"
    );
    eprintln!("{} cases", cases.len() + 1);
}

/// `check --tie` at a global batch whose last BatchNorm sites see a few values per channel:
/// said to be ill-conditioned, and then not applied (2 values) or held to its stated looser
/// bound (4 values).
fn tie_at_an_ill_conditioned_shape_says_so() {
    needs_adapter();
    for (batch, says) in
        [("2", "n/a: ill-conditioned: BatchNorm over 2 values"), ("4", "bound ×100")]
    {
        let o = run(&["check", "--tie", "--global-batch", batch, "--steps", "0"], &[], &[]);
        let t = text(&o);
        assert!(o.status.success() && t.contains(says), "{t}");
    }
    eprintln!("2 cases");
}

/// A file of the user's at an output path — text, a photo, other weights, another command's
/// output, a write-protected file, one reached through a link, another user's — is refused
/// unless it is syncstep's own of that kind (or `--overwrite` says so), and never when its mode
/// protects it; a second run on a checkpoint in use is refused; a run that fails early leaves
/// no log; an output to the command's own standard output goes after what it printed.
fn an_output_replaces_only_syncsteps_own_file_of_its_kind() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = gpu_test_dir();
    let dir = tmp.path();
    let good = one_step_checkpoint(dir);
    let file = |name: &str, bytes: &[u8]| {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path.to_str().unwrap().to_string()
    };
    let (notes, photo) =
        (file("notes.txt", b"my notes\n"), file("photo.png", b"\x89PNG not really"));
    let log = file("run.jsonl", b"{\"step\":1,\"epoch\":0,\"loss\":2.0}\n");
    let (notes, photo, log) = (notes.as_str(), photo.as_str(), log.as_str());
    let weights = dir.join("other.safetensors");
    write_f32(&weights, &[("w".into(), vec![2], &[1.0, 2.0])], &Default::default()).unwrap();
    let protected = file("protected.safetensors", &std::fs::read(&good).unwrap());
    std::fs::set_permissions(&protected, std::fs::Permissions::from_mode(0o444)).unwrap();
    let protected = protected.as_str();
    let link = dir.join("link.safetensors");
    std::os::unix::fs::symlink(notes, &link).unwrap();
    let (g, w, l) = (good.to_str().unwrap(), weights.to_str().unwrap(), link.to_str().unwrap());
    let train = ["train", "--steps", "1", "--batch", "2", "--eval-examples", "0"];
    let mut cases: Vec<(Vec<&str>, &str)> = vec![
        (
            [&train[..], &["--checkpoint", notes]].concat(),
            "exists and is not a syncstep checkpoint",
        ),
        ([&train[..], &["--checkpoint", l]].concat(), "exists and is not a syncstep checkpoint"),
        ([&train[..], &["--checkpoint", w]].concat(), "add --overwrite to replace it"),
        ([&train[..], &["--log", notes]].concat(), "is not a syncstep metrics log"),
        ([&train[..], &["--checkpoint", protected, "--overwrite"]].concat(), "mode 0444"),
        (
            vec!["grad", "--weights", g, "--batch", g, "--out", photo],
            "is not syncstep grad's output",
        ),
        (vec!["eval", "--checkpoint", g, "--json", w], "is not syncstep eval's scores"),
        (vec!["predict", "--checkpoint", g, "--json", notes, photo], "is not syncstep predict's"),
        (vec!["check", "--json", notes], "is not syncstep check's figures"),
        (vec!["check", "--golden", g], "is not a syncstep golden file"),
        (vec!["bench", "--json", notes], "is not syncstep bench's figures"),
        (vec!["plot", log, "-o", photo], "is not a picture syncstep plot drew"),
        (
            vec!["eval", "--checkpoint", g, "--overwrite"],
            "--overwrite has no effect without an output",
        ),
    ];
    // Another user's file, in a folder anyone may write in: its mode is for others.
    let theirs = file("theirs.safetensors", &std::fs::read(&good).unwrap());
    if std::os::unix::fs::chown(&theirs, Some(4242), Some(4242)).is_ok() {
        cases.push(([&train[..], &["--checkpoint", theirs.as_str()]].concat(), "owner uid 4242"));
    }
    let before = snapshot(&[dir]);
    for (args, says) in &cases {
        refused(&run(args, &[], &[]), says);
        assert_eq!(snapshot(&[dir]), before, "{args:?} changed a file");
    }
    // A second run on a checkpoint in use is refused while the first holds it.
    let busy = dir.join("busy.safetensors");
    let b = busy.to_str().unwrap();
    let first = ["train", "--steps", "1000", "--batch", "2", "--eval-examples", "0"];
    let (child, lines) = started_at(&[&first[..], &["--checkpoint", b]].concat(), "step 1 ");
    let second = run(&[&train[..], &["--checkpoint", b]].concat(), &[], &[]);
    refused(&second, &format!("is being written by another syncstep run (process {})", child.id()));
    assert_eq!(stop(child, lines, "TERM").0, Some(143));
    // A run that fails after its outputs were checked leaves no log, and the next one runs.
    let fresh = dir.join("fresh.jsonl");
    let f = fresh.to_str().unwrap();
    refused(
        &run(&[&train[..], &["--log", f, "--adapter", "7"]].concat(), &[], &[]),
        "no adapter 7",
    );
    assert!(!fresh.exists(), "a failed run left its log");
    let o = run(&[&train[..], &["--log", f]].concat(), &[], &[]);
    assert!(o.status.success() && fresh.exists(), "{}", text(&o));
    // A checkpoint of the user's mode keeps it; --overwrite replaces a file of another kind.
    std::fs::set_permissions(&good, std::fs::Permissions::from_mode(0o600)).unwrap();
    let o = run(
        &["train", "--resume", g, "--checkpoint", g, "--steps", "1", "--eval-examples", "0"],
        &[],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(std::fs::metadata(&good).unwrap().permissions().mode() & 0o777, 0o600);
    let o = run(&[&train[..], &["--checkpoint", w, "--overwrite"]].concat(), &[], &[]);
    assert!(o.status.success() && checkpoint::is_checkpoint(&weights), "{}", text(&o));
    // The command's own standard output: the JSON goes after what was printed there.
    let printed = std::fs::File::create(dir.join("printed.txt")).unwrap();
    let o = crate::common::command()
        .args(["eval", "--checkpoint", g, "--examples", "2", "--json", "/dev/stdout"])
        .stdout(printed)
        .output()
        .unwrap();
    let printed = std::fs::read_to_string(dir.join("printed.txt")).unwrap();
    assert!(o.status.success() && printed.starts_with(&format!("{g} on synthetic")), "{printed}");
    assert!(printed.contains("\"top1\""), "{printed}");
    // A log to the run's own standard output: its records among the lines printed.
    let o = run(&[&train[..], &["--log", "/dev/stdout"]].concat(), &[], &[]);
    assert!(
        o.status.success() && text(&o).contains("{\"step\":1,\"epoch\":0,\"loss\":"),
        "{}",
        text(&o)
    );
    eprintln!("{} cases", cases.len() + 7);
}

/// An output replaces the file its own command wrote there before: a golden file, and the
/// figures beside it, written twice to the same paths.
fn an_output_replaces_the_file_its_own_command_wrote() {
    let tmp = gpu_test_dir();
    let (golden, figures) = (tmp.path().join("golden.json"), tmp.path().join("check.json"));
    let (g, f) = (golden.to_str().unwrap(), figures.to_str().unwrap());
    let check = ["check", "--replicas", "1", "--batch", "2", "--steps", "0", "--golden", g];
    for round in 0..2 {
        let o = run(&[&check[..], &["--json", f]].concat(), &[], &[]);
        assert!(o.status.success(), "round {round}: {}", text(&o));
    }
    assert!(golden.exists() && figures.exists());
}

/// A closed standard output (`train | head -n 1`) ends the printing, not the run: it trains to
/// its end and writes its checkpoint. SIGHUP (a closed terminal, a dropped ssh) is SIGTERM's
/// twin: the step in flight finishes, the checkpoint is written, the exit is 129.
fn a_closed_pipe_or_a_hangup_never_loses_a_run() {
    use std::io::BufRead;
    let tmp = gpu_test_dir();
    let model = ResNet::new(Arch::ResNet34, 10).unwrap();
    let (piped, hung) = (tmp.path().join("piped.safetensors"), tmp.path().join("hung.safetensors"));
    let train = ["train", "--batch", "2", "--eval-examples", "0", "--checkpoint"];
    let mut child = crate::common::command()
        .args([&train[..], &[piped.to_str().unwrap(), "--steps", "2"]].concat())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    assert!(first.starts_with("syncstep train:"), "{first}");
    // The reader is gone: every later line meets a closed pipe.
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && !err.contains("panicked"), "{err}");
    assert_eq!(checkpoint::load(&piped, &model).unwrap().step, 2);
    let args = [&train[..], &[hung.to_str().unwrap(), "--steps", "1000"]].concat();
    let (child, lines) = started_at(&args, "step 1 ");
    let (code, err) = stop(child, lines, "HUP");
    assert_eq!(code, Some(129), "{err}");
    let step = checkpoint::load(&hung, &model).unwrap().step;
    let said = format!(
        "SIGHUP: stopped after step {step}; the checkpoint {} holds step {step}",
        hung.display()
    );
    assert!(err.contains(&said), "{err}");
    eprintln!("2 cases");
}

/// `path`'s bytes with the first `from` replaced by `to` (of the same length), written to
/// `dir/name`: an edit no checksum was recomputed for.
fn edited(path: &Path, from: &[u8], to: &[u8], dir: &Path, name: &str) -> PathBuf {
    let mut bytes = std::fs::read(path).unwrap();
    let at = bytes.windows(from.len()).position(|w| w == from).expect("the text to edit");
    bytes[at..at + to.len()].copy_from_slice(to);
    let out = dir.join(name);
    std::fs::write(&out, bytes).unwrap();
    out
}

/// The checkpoint at `path` (of `model`) saved again to `dir/name` after `change`: with a
/// checksum that holds, so that only the checks of what it says can refuse it.
pub(crate) fn resaved(
    path: &Path,
    model: &ResNet,
    dir: &Path,
    name: &str,
    change: impl FnOnce(&mut Checkpoint),
) -> String {
    let mut ck = checkpoint::load(path, model).unwrap();
    change(&mut ck);
    let out = dir.join(name);
    checkpoint::save(&out, model, &ck).unwrap();
    out.to_str().unwrap().to_string()
}

/// Every byte of a checkpoint that a load reads is covered by its hash, and everything it says
/// is checked: an edited setting, a standard deviation of 0, a NaN mean, class names that are
/// not the class count, a negative running variance, integer weights; a checkpoint given as
/// --weights or weights as --checkpoint is pointed to its flag; --class-names with a
/// checkpoint is refused. Each refused by resume, eval or predict (the edited setting by all
/// three), naming the file and the setting, with every file unchanged.
fn every_setting_and_value_a_checkpoint_holds_is_checked() {
    let tmp = gpu_test_dir();
    let dir = tmp.path();
    let images = image_folder(dir, 4);
    let on_images = images_checkpoint(dir, &images);
    let png = images.join("ant/0.png");
    let (m, png) = (on_images.to_str().unwrap(), png.to_str().unwrap());
    let model = ResNet::new(Arch::ResNet34, 2).unwrap();
    let setting = |name: &str, edit: &dyn Fn(&mut syncstep::train::ImageSettings)| {
        resaved(&on_images, &model, dir, name, |ck| edit(ck.settings.images.as_mut().unwrap()))
    };
    let lr = edited(&on_images, b"\"lr\":\"0.01\"", b"\"lr\":\"0.02\"", dir, "lr.safetensors");
    let checked: Vec<(String, String)> = vec![
        (lr.to_str().unwrap().into(), "header or tensor data does not match the SHA-256".into()),
        (
            setting("std.safetensors", &|i| i.norm.std = [0.0, 0.2, 0.2]),
            "setting `std` is [0.0, 0.2, 0.2]".into(),
        ),
        (
            setting("mean.safetensors", &|i| i.norm.mean = [f32::NAN, 0.4, 0.4]),
            "setting `mean` is [NaN".into(),
        ),
        (
            setting("names.safetensors", &|i| i.class_names.push("cat".into())),
            "setting `class_names` lists 3 names, and `classes` is 2".into(),
        ),
        (
            resaved(&on_images, &model, dir, "var.safetensors", |ck| {
                ck.running
                    [model.buffers.iter().find(|t| t.name == "bn1.running_var").unwrap().range()]
                    [3] = -1.0
            }),
            "`bn1.running_var` element 3 is -1e0: a negative running variance".into(),
        ),
    ];
    let before = snapshot(&[dir]);
    // The three loads share one check: the edited file goes to each, the others in turn.
    let mut cases = 0;
    for (i, (path, says)) in checked.iter().enumerate() {
        let loads = [
            vec!["train", "--resume", path, "--steps", "1"],
            vec!["eval", "--checkpoint", path],
            vec!["predict", "--checkpoint", path, png],
        ];
        let taken = if i == 0 { 3 } else { 1 };
        for args in loads.iter().cycle().skip(i).take(taken) {
            let o = run(args, &[], &[]);
            refused(&o, says);
            assert!(text(&o).contains(path.as_str()), "the file is named: {}", text(&o));
            assert_eq!(snapshot(&[dir]), before, "{args:?} changed a file");
            cases += 1;
        }
    }
    // Integer weights, and files given to the other flag.
    let ints = dir.join("ints.safetensors");
    let resnet = ResNet::new(Arch::ResNet34, 10).unwrap();
    let params = resnet.init_params(1);
    let mut floats: Vec<(String, Vec<usize>, &[f32])> = resnet
        .params
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone(), &params[t.range()]))
        .collect();
    let conv1 = floats.remove(0);
    let labels = vec![1i64; conv1.2.len()];
    let int = [(conv1.0.clone(), conv1.1.clone(), &labels[..])];
    syncstep::tensorfile::write_f32_i64(&ints, &floats, &int, &Default::default()).unwrap();
    let weights = dir.join("weights.safetensors");
    reshaped_weights(&weights, &|_, s| Some(s));
    let (i, w) = (ints.to_str().unwrap(), weights.to_str().unwrap());
    let names = dir.join("names.txt");
    std::fs::write(&names, "ant\nbee\n").unwrap();
    let n = names.to_str().unwrap();
    let before = snapshot(&[dir]);
    let flags: [(&[&str], &str); 4] = [
        (&["predict", "--weights", i, png], "tensor `conv1.weight` holds integers"),
        (&["predict", "--weights", m, png], "this is a syncstep checkpoint (a `train --checkpoint` file), not torchvision weights: give it as --checkpoint"),
        (&["eval", "--checkpoint", w], "this is not a syncstep checkpoint (a `train --checkpoint` file); torchvision weights go to --weights"),
        (&["predict", "--checkpoint", m, "--class-names", n, png], "drop --class-names"),
    ];
    for (args, says) in flags {
        refused(&run(args, &[], &[]), says);
        assert_eq!(snapshot(&[dir]), before, "{args:?} changed a file");
    }
    eprintln!("{} cases", cases + flags.len());
}

/// A learning rate or weight decay that blows the parameters up in one step is a divergence:
/// exit non-zero, the last good checkpoint kept; weights that overflow give no NaN
/// probability, an error instead; counts past their bound are refused before any work.
fn runaway_numbers_are_refused_and_no_nan_is_printed() {
    let tmp = gpu_test_dir();
    let dir = tmp.path();
    let good = one_step_checkpoint(dir);
    let images = image_folder(dir, 4);
    let on_images = images_checkpoint(dir, &images);
    // Every parameter at 1e18: healthy alone, the activations overflow.
    let model = ResNet::new(Arch::ResNet34, 2).unwrap();
    let huge = resaved(&on_images, &model, dir, "huge.safetensors", |ck| ck.params.fill(1e18));
    let (g, png) = (good.to_str().unwrap(), images.join("ant/0.png"));
    let png = png.to_str().unwrap();
    let before = snapshot(&[dir]);
    let resume = ["train", "--resume", g, "--checkpoint", g, "--override", "--steps", "1"];
    let cases: [(&[&str], &str); 8] = [
        (
            &[&resume[..], &["--lr", "1e30"]].concat(),
            "the run diverged at step 2: `conv1.weight` element",
        ),
        (
            &[
                "train",
                "--steps",
                "1",
                "--batch",
                "2",
                "--eval-examples",
                "0",
                "--weight-decay",
                "1e30",
            ],
            "the run diverged at step 1",
        ),
        (&["predict", "--checkpoint", &huge, png], "ant/0.png: the model's outputs are not finite"),
        (
            &["eval", "--checkpoint", &huge],
            "the model's outputs for image 1 of the evaluation are not finite",
        ),
        (
            &["train", "--classes", "100000000", "--steps", "1"],
            "'100000000' for '--classes <CLASSES>': a classifier has 2 to 100000 classes",
        ),
        (
            &["check", "--steps", "18446744073709551615"],
            "'18446744073709551615' for '--steps <STEPS>': at most 1000",
        ),
        (&["bench", "--steps", "1000000"], "'1000000' for '--steps <STEPS>': at most 10000"),
        (
            &["train", "--replicas", "18446744073709551615"],
            "'18446744073709551615' for '--replicas <REPLICAS>': at most 1024",
        ),
    ];
    for (args, says) in cases {
        let o = run(args, &[], &[]);
        refused(&o, says);
        assert!(!text(&o).contains("NaN%"), "{}", text(&o));
        assert_eq!(snapshot(&[dir]), before, "{args:?} changed a file");
    }
    eprintln!("{} cases", cases.len());
}

/// The data is recorded by what it is: its absolute path and a fingerprint of its files. A
/// relative --data is recorded absolute, so `eval` from another folder scores the same images;
/// `DIR/../DIR/` and a copy elsewhere are the same data; an image rewritten at the same size in
/// its folder (its time) and a file added to it make it other data, refused by a resume and by
/// `eval` (its `--data` naming that folder too, in any spelling), with every file unchanged; a
/// checkpoint of an earlier build, without the times, is resumed with a note.
fn the_data_is_an_identity_not_a_path() {
    let tmp = gpu_test_dir();
    let dir = tmp.path().canonicalize().unwrap();
    let images = image_folder(&dir, 4);
    let ck = dir.join("ck.safetensors");
    let c = ck.to_str().unwrap();
    let in_dir = |cwd: &Path, args: &[&str]| {
        let mut cmd = crate::common::command();
        cmd.args(args).current_dir(cwd).stdin(Stdio::null()).output().unwrap()
    };
    let train = ["train", "--steps", "1", "--batch", "2", "--normalize", "imagenet"];
    let o = in_dir(&dir, &[&train[..], &["--data", "images", "--checkpoint", c]].concat());
    assert!(o.status.success(), "{}", text(&o));
    let recorded = TensorFile::read(&ck).unwrap().metadata["data"].clone();
    assert_eq!(recorded, images.to_str().unwrap(), "recorded absolute");
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let o = in_dir(&elsewhere, &["eval", "--checkpoint", c]);
    assert!(
        o.status.success() && text(&o).contains(&format!("on {recorded} (val split")),
        "{}",
        text(&o)
    );
    let resume = ["train", "--resume", c, "--steps", "1", "--eval-examples", "0"];
    let respelt = format!("{}/../images/", images.display());
    let o = run(&[&resume[..], &["--data", &respelt]].concat(), &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let copy = dir.join("copy");
    assert!(Command::new("cp").arg("-r").arg(&images).arg(&copy).status().unwrap().success());
    let o = run(&[&resume[..], &["--data", copy.to_str().unwrap()]].concat(), &[], &[]);
    let says =
        format!("{} holds the files the checkpoint was trained on at {recorded}", copy.display());
    assert!(o.status.success() && text(&o).contains(&says), "{}", text(&o));
    // An image rewritten at the same size in the checkpoint's own folder: its time tells.
    let rewritten = images.join("bee/1.png");
    let mut bytes = std::fs::read(&rewritten).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&rewritten, &bytes).unwrap();
    let since = "holds the checkpoint's files (names, sizes, labels), but some were modified since the checkpoint was written (their modification times differ)";
    refused(&run(&resume, &[], &[]), since);
    let o = run(&["eval", "--checkpoint", c], &[], &[]);
    refused(&o, &format!("holds the files {c} was trained on, but some were modified since"));
    // A checkpoint of an earlier build records no times: resumed, saying what goes unnoticed.
    let model = ResNet::new(Arch::ResNet34, 2).unwrap();
    let older = resaved(&ck, &model, &dir, "older.safetensors", |ck| {
        ck.settings.images.as_mut().unwrap().file_times = None
    });
    let o = run(&["train", "--resume", &older, "--steps", "1", "--eval-examples", "0"], &[], &[]);
    let note = "the checkpoint records no times of its files (an earlier build's, or the page's)";
    assert!(o.status.success() && text(&o).contains(note), "{}", text(&o));
    std::fs::copy(images.join("ant/0.png"), images.join("ant/extra.png")).unwrap();
    let before = snapshot(&[&dir]);
    let other = "is not the data the checkpoint was trained on: 9 images, SHA-256";
    refused(&run(&resume, &[], &[]), other);
    let o = run(&["eval", "--checkpoint", c], &[], &[]);
    refused(&o, "is not the data");
    assert!(
        text(&o).contains("8 images, SHA-256") && text(&o).contains("give --data"),
        "{}",
        text(&o)
    );
    // The same folder named by --data, in any spelling, is the checkpoint's own data still.
    for data in [images.to_str().unwrap(), &respelt] {
        let o = run(&["eval", "--checkpoint", c, "--data", data], &[], &[]);
        refused(&o, "is not the data");
        assert!(text(&o).contains("score a copy of it at another path"), "{}", text(&o));
    }
    assert_eq!(snapshot(&[&dir]), before, "a refusal changed a file");
    eprintln!("11 cases");
}

/// Decoding is as strict as PIL's: a JPEG cut short is an error naming it (the image crate's
/// decoder would decode it without a word), in training and in `predict`; an image of more
/// pixels than PIL takes is refused before it is decoded; one whose pixels do not fit the
/// memory left is an error naming it.
fn a_truncated_or_enormous_image_is_an_error_naming_it() {
    let tmp = gpu_test_dir();
    let dir = tmp.path();
    let images = image_folder(dir, 2);
    let on_images = images_checkpoint(dir, &images);
    let mut jpeg = std::io::Cursor::new(Vec::new());
    let photo = image::RgbImage::from_fn(40, 40, |x, y| image::Rgb([x as u8 * 6, y as u8 * 6, 7]));
    photo.write_to(&mut jpeg, image::ImageFormat::Jpeg).unwrap();
    let jpeg = jpeg.into_inner();
    let cut = images.join("ant/cut.jpg");
    std::fs::write(&cut, &jpeg[..jpeg.len() - 2]).unwrap();
    // A BMP whose header says 20000×20000.
    let mut bomb = std::io::Cursor::new(Vec::new());
    photo.write_to(&mut bomb, image::ImageFormat::Bmp).unwrap();
    let mut bomb = bomb.into_inner();
    bomb[18..22].copy_from_slice(&20000i32.to_le_bytes());
    bomb[22..26].copy_from_slice(&20000i32.to_le_bytes());
    let big = dir.join("big.bmp");
    std::fs::write(&big, bomb).unwrap();
    let (m, i) = (on_images.to_str().unwrap(), images.to_str().unwrap());
    let ck = dir.join("never.safetensors");
    let before = snapshot(&[dir]);
    let cut_short = format!("{}: not a decodable image (the file is cut short", cut.display());
    let train = ["train", "--data", i, "--val-split", "0", "--batch", "5", "--steps", "1"];
    let cases: [(&[&str], &str); 3] = [
        (
            &[&train[..], &["--normalize", "imagenet", "--checkpoint", ck.to_str().unwrap()]]
                .concat(),
            &cut_short,
        ),
        (&["predict", "--checkpoint", m, cut.to_str().unwrap()], &cut_short),
        (
            &["predict", "--checkpoint", m, big.to_str().unwrap()],
            "20000×20000 is 400000000 pixels, past the 178956970 PIL takes",
        ),
    ];
    for (args, says) in cases {
        refused(&run(args, &[], &[]), says);
        assert_eq!(snapshot(&[dir]), before, "{args:?} changed a file");
    }
    // A JPEG whose frame header says 13000×13000 (1 GB to decode and convert), under an
    // address-space limit that leaves less: an error naming it, not an abort.
    let at = jpeg.windows(2).position(|w| w == [0xFF, 0xC0]).expect("a baseline frame");
    let mut large = jpeg.clone();
    large[at + 5..at + 9].copy_from_slice(&[0x32, 0xC8, 0x32, 0xC8]);
    let large_path = dir.join("large.jpg");
    std::fs::write(&large_path, large).unwrap();
    let bin = env!("CARGO_BIN_EXE_syncstep");
    let script = format!(
        "ulimit -v 2100000 && exec {bin} predict --checkpoint {m} {}",
        large_path.display()
    );
    let mut sh = Command::new("sh");
    let o = sh.envs(suite_env()).args(["-c", &script]).stdin(Stdio::null()).output().unwrap();
    refused(&o, "large.jpg: its 13000×13000 pixels need 1014000000 bytes of host memory, which could not be allocated");
    eprintln!("{} cases", cases.len() + 1);
}

/// A command, the variables it runs with, and what its refusal says.
type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);

/// Messages name the cause in the user's words: `predict` and `eval` at an input size where
/// the run's batch does not fit take fewer images at a time (and one image that does not fit
/// names --image-size, not a --batch they do not have); a flag with no effect, a variable's
/// value with none, a flag checked before any device is made: each named.
fn messages_name_the_flag_and_a_large_input_takes_smaller_batches() {
    let tmp = gpu_test_dir();
    let dir = tmp.path();
    let images = image_folder(dir, 9);
    let ck = dir.join("b16.safetensors");
    let sixteen = ck.to_str().unwrap();
    let (i, png) = (images.to_str().unwrap(), images.join("ant/0.png"));
    let png = png.to_str().unwrap();
    let train = ["train", "--data", i, "--val-split", "0.1", "--normalize", "imagenet"];
    let o = run(
        &[&train[..], &["--batch", "16", "--steps", "1", "--checkpoint", sixteen]].concat(),
        &[],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    // A batch of 16 at 512² or 400² is past lavapipe's 128 MiB storage binding.
    let o = run(&["predict", "--checkpoint", sixteen, "--image-size", "512", png], &[], &[]);
    assert!(o.status.success() && text(&o).contains(&format!("{png}: ")), "{}", text(&o));
    let o = run(&["eval", "--checkpoint", sixteen, "--image-size", "400"], &[], &[]);
    assert!(o.status.success() && text(&o).contains("(val split, 2 images)"), "{}", text(&o));
    let before = snapshot(&[dir]);
    let cases: [Case; 7] = [
        (
            &["predict", "--checkpoint", sixteen, "--image-size", "100000", png],
            &[],
            "--image-size 100000: one image does not fit",
        ),
        (
            &["bench", "--profile-rows", "5"],
            &[],
            "--profile-rows sets the rows of --profile's table",
        ),
        (&["bench", "--roofline-size", "64", "--no-roofline"], &[], "cannot be used with"),
        (&["check", "--image-size", "16"], &[], "--image-size 16: image size 16×16 is too small"),
        (
            &["info"],
            &[("SYNCSTEP_SUBGROUPS", "garbage")],
            "SYNCSTEP_SUBGROUPS=\"garbage\": give on or off",
        ),
        (&["info"], &[("SYNCSTEP_MPI_SILENCE", "soon")], "SYNCSTEP_MPI_SILENCE=\"soon\""),
        (
            &[
                "grad",
                "--weights",
                sixteen,
                "--batch",
                sixteen,
                "--out",
                "g.safetensors",
                "--label-smoothing",
                "2",
            ],
            &[],
            "--label-smoothing 2: label smoothing must be in [0, 1)",
        ),
    ];
    for (args, set, says) in cases {
        let o = run(args, set, &[]);
        refused(&o, says);
        assert!(
            !text(&o).contains("--batch or") && !text(&o).contains("replica 0"),
            "{}",
            text(&o)
        );
        assert_eq!(snapshot(&[dir]), before, "{args:?} changed a file");
    }
    eprintln!("{} cases", cases.len() + 2);
}

tests![
    sizes_past_every_limit_are_errors_not_panics,
    no_file_of_the_users_is_ever_overwritten,
    a_bad_checkpoint_or_a_changed_setting_is_never_resumed_silently,
    a_diverging_run_fails_and_keeps_the_last_good_checkpoint,
    a_signal_saves_the_run_and_exits_with_its_status,
    messages_name_what_to_change,
    nothing_runs_unbounded,
    no_output_lands_on_or_inside_an_input,
    flags_without_effect_and_counts_that_do_nothing_are_named,
    a_signal_during_an_evaluation_is_honoured,
    nothing_waits_forever,
    exhausted_resources_are_named,
    init_weights_are_taken_whole_or_refused,
    tie_at_an_ill_conditioned_shape_says_so,
    an_output_replaces_only_syncsteps_own_file_of_its_kind,
    an_output_replaces_the_file_its_own_command_wrote,
    a_closed_pipe_or_a_hangup_never_loses_a_run,
    every_setting_and_value_a_checkpoint_holds_is_checked,
    runaway_numbers_are_refused_and_no_nan_is_printed,
    the_data_is_an_identity_not_a_path,
    a_truncated_or_enormous_image_is_an_error_naming_it,
    messages_name_the_flag_and_a_large_input_takes_smaller_batches,
];
