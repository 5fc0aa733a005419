//! Training runs, checkpoints and the `syncstep grad` file interface.

use std::path::Path;

use crate::common::*;
use syncstep::checkpoint::{self, write_step_inputs};
use syncstep::data::synthetic_batch;
use syncstep::model::{Arch, ResNet};
use syncstep::step::{OneDevice, Replica, Shard, StepConfig, StepOptions};
use syncstep::tensorfile::{write_f32, write_f32_i64, TensorFile};
use syncstep::train::{
    Diverged, Divergence, Keep, RunEnd, RunError, RunHooks, RunPlan, StepDone, TrainConfig,
    Trainer, TrainingRun,
};

/// A fresh folder of this test's own, removed when dropped, however the test ends.
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("syncstep-{name}-")).tempdir().unwrap()
}

fn small() -> TrainConfig {
    TrainConfig { batch: 4, ..TrainConfig::default() }
}

fn run_steps(t: &mut Trainer, n: usize) {
    for _ in 0..n {
        pollster::block_on(t.train_step()).unwrap();
    }
}

fn resume_from_a_checkpoint_is_bit_exact() {
    let gpu = fresh_gpu();
    let tmp = temp_dir("resume");
    let dir = tmp.path();
    let path = dir.join("ck.safetensors");
    let mut straight = Trainer::new(gpu, small(), None).unwrap();
    run_steps(&mut straight, 5);

    let mut first = Trainer::new(fresh_gpu(), small(), None).unwrap();
    run_steps(&mut first, 3);
    let ck = pollster::block_on(first.checkpoint()).unwrap();
    checkpoint::save(&path, first.model(), &ck).unwrap();
    let loaded = checkpoint::load(&path, &ResNet::new(Arch::ResNet34, 10).unwrap()).unwrap();
    assert_eq!(loaded, ck);
    let mut resumed = Trainer::new(fresh_gpu(), small(), Some(loaded)).unwrap();
    assert_eq!(resumed.step, 3);
    run_steps(&mut resumed, 2);

    let a = pollster::block_on(straight.checkpoint()).unwrap();
    let b = pollster::block_on(resumed.checkpoint()).unwrap();
    assert_eq!(a.step, b.step);
    let same = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
    assert!(same(&a.params, &b.params), "parameters differ after resume");
    assert!(same(&a.velocity, &b.velocity), "momentum differs after resume");
    assert!(same(&a.running, &b.running), "running statistics differ after resume");
    assert!(
        a.params != pollster::block_on(first.checkpoint()).unwrap().params,
        "training changed nothing"
    );
}

/// Set in a child of [`a_checkpoint_write_killed_midway_keeps_the_old_checkpoint`]: the
/// checkpoint it saves (and is killed saving).
const KILLED_SAVE: &str = "SYNCSTEP_TEST_KILLED_SAVE";

fn a_checkpoint(model: &ResNet, step: u64) -> checkpoint::Checkpoint {
    checkpoint::Checkpoint {
        params: model.init_params(1),
        running: model.init_buffers(),
        velocity: vec![0.0; model.param_len],
        step,
        settings: TrainConfig::default(),
    }
}

/// A save killed midway (here by the kernel, at a file size limit far below a checkpoint's,
/// as a kill or a full disk would stop it) leaves the old checkpoint whole, and the next save
/// there removes the temporary file the killed one left (a kill runs no clean-up).
fn a_checkpoint_write_killed_midway_keeps_the_old_checkpoint() {
    let model = ResNet::new(Arch::ResNet34, 10).unwrap();
    if let Some(path) = std::env::var_os(KILLED_SAVE) {
        // The child: this save passes the file size limit and is killed (SIGXFSZ).
        checkpoint::save(Path::new(&path), &model, &a_checkpoint(&model, 2)).unwrap();
        return;
    }
    let tmp = temp_dir("killed-save");
    let dir = tmp.path();
    let path = dir.join("ck.safetensors");
    let ck = a_checkpoint(&model, 1);
    checkpoint::save(&path, &model, &ck).unwrap();
    // This test alone in a child process under a 1 MB file size limit (`ulimit -f` counts
    // blocks of 512 or 1024 bytes); a checkpoint is some 170 MB.
    let child = std::process::Command::new("sh")
        .args(["-c", "ulimit -c 0 && ulimit -f 2000 && exec \"$@\"", "sh"])
        .arg(std::env::current_exe().unwrap())
        .args(["train::a_checkpoint_write_killed_midway_keeps_the_old_checkpoint", "--exact"])
        .args(["--nocapture", "--test-threads", "1"])
        .env(KILLED_SAVE, &path)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&child.stderr);
    use std::os::unix::process::ExitStatusExt;
    assert!(child.status.signal().is_some(), "the save was not killed ({}): {log}", child.status);
    assert_eq!(checkpoint::load(&path, &model).unwrap(), ck, "{log}");
    let names = || {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let left = names();
    assert!(
        left.len() == 2 && left[0].starts_with(".ck.safetensors.tmp-"),
        "the killed save's temporary file is beside the checkpoint: {left:?}"
    );
    let newer = checkpoint::Checkpoint { step: 3, ..ck.clone() };
    checkpoint::save(&path, &model, &newer).unwrap();
    assert_eq!(checkpoint::load(&path, &model).unwrap(), newer);
    assert_eq!(names(), ["ck.safetensors"], "the next save removed what the killed one left");
}

fn grad_command_matches_the_in_process_step_and_refuses_bad_files() {
    let gpu = fresh_gpu();
    let tmp = temp_dir("grad");
    let dir = tmp.path();
    let model = ResNet::new(Arch::ResNet34, 10).unwrap();
    let mut params = model.init_params(4);
    model.randomize_batchnorm(&mut params, 5);
    let running = model.init_buffers();
    let batch = synthetic_batch(6, 0, 4, 32, 32, 10).unwrap();
    let wb = dir.join("wb.safetensors");
    let weights = (&params[..], &running[..]);
    write_step_inputs(&wb, &model, weights, &batch.images, 32, &int64(&batch.labels)).unwrap();
    let out = dir.join("g.safetensors");
    let (ok, log) = syncstep(&[
        "grad",
        "--weights",
        wb.to_str().unwrap(),
        "--batch",
        wb.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{log}");

    let mut r = Replica::new(gpu, model.clone(), &params, &running).unwrap();
    let want = pollster::block_on(r.forward_backward(
        &batch,
        &StepConfig::default(),
        Shard::whole(4),
        &OneDevice,
        StepOptions::default(),
    ))
    .unwrap();
    let grads = pollster::block_on(r.read_grads()).unwrap();
    let after = pollster::block_on(r.read_running()).unwrap();
    let g = TensorFile::read(&out).unwrap();
    assert_eq!(g.require("loss", &[1]).unwrap().values[0], want.loss as f64);
    assert_eq!(g.require("logits", &[4, 10]).unwrap().values, to_f64(&want.logits));
    for p in &model.params {
        assert_eq!(
            g.require(&format!("grad/{}", p.name), &p.shape).unwrap().values,
            to_f64(&grads[p.range()]),
            "grad/{}",
            p.name
        );
    }
    let b = &model.buffers[5];
    assert_eq!(
        g.require(&format!("after/{}", b.name), &b.shape).unwrap().values,
        to_f64(&after[b.range()])
    );

    // Each bad file is a clear error naming the problem.
    let case = |name: &str, labels: &[i64], edit: &dyn Fn(&mut Vec<f32>)| -> String {
        let mut images = batch.images.clone();
        edit(&mut images);
        let g = dir.join(format!("{name}.safetensors"));
        write_step_inputs(&g, &model, weights, &images, 32, labels).unwrap();
        syncstep(&[
            "grad",
            "--weights",
            g.to_str().unwrap(),
            "--batch",
            g.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .1
    };
    assert!(case("big", &[0, 1, 10, 2], &|_| {}).contains("label 10 of example 2 is out of range"));
    assert!(case("neg", &[0, -1, 1, 2], &|_| {}).contains("label -1 of example 1 is out of range"));
    assert!(case("nan", &[0, 1, 2, 3], &|v| v[5000] = f32::NAN).contains("non-finite"));

    let mut entries: Vec<(String, Vec<usize>, &[f32])> = model
        .params
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone(), &params[p.range()]))
        .collect();
    entries[3].1 = vec![entries[3].2.len()];
    let bad_w = dir.join("badw.safetensors");
    write_f32(&bad_w, &entries, &Default::default()).unwrap();
    let (ok, log) = syncstep(&[
        "grad",
        "--weights",
        bad_w.to_str().unwrap(),
        "--batch",
        wb.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && log.contains(&format!("`{}` has shape", model.params[3].name)), "{log}");
    entries.remove(3);
    write_f32(&bad_w, &entries, &Default::default()).unwrap();
    let (ok, log) = syncstep(&[
        "grad",
        "--weights",
        bad_w.to_str().unwrap(),
        "--batch",
        wb.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && log.contains(&format!("missing tensor `{}`", model.params[3].name)), "{log}");

    let (small_raw, small) = (dir.join("small.raw"), dir.join("small.safetensors"));
    let tiny = synthetic_batch(1, 0, 2, 16, 16, 10).unwrap();
    write_f32(
        &small_raw,
        &[
            ("input".into(), vec![2, 3, 16, 16], &tiny.images),
            ("labels".into(), vec![2], &[0.0, 1.0]),
        ],
        &Default::default(),
    )
    .unwrap();
    let ints = [("labels".to_string(), vec![2], &[0i64, 1][..])];
    let input = [("input".to_string(), vec![2, 3, 16, 16], &tiny.images[..])];
    write_f32_i64(&small, &input, &ints, &Default::default()).unwrap();
    let (ok, log) = syncstep(&[
        "grad",
        "--weights",
        wb.to_str().unwrap(),
        "--batch",
        small.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && log.contains("16×16 is too small"), "{log}");
    let (ok, log) = syncstep(&[
        "grad",
        "--weights",
        wb.to_str().unwrap(),
        "--batch",
        small_raw.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && log.contains("`labels` must be an integer tensor"), "{log}");
    let gray = dir.join("gray.safetensors");
    write_f32(
        &gray,
        &[("input".into(), vec![4, 1, 32, 32], &batch.images[..4 * 1024])],
        &Default::default(),
    )
    .unwrap();
    let (ok, log) = syncstep(&[
        "grad",
        "--weights",
        wb.to_str().unwrap(),
        "--batch",
        gray.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && log.contains("1 channels"), "{log}");

    let bytes = std::fs::read(&wb).unwrap();
    let cut = dir.join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let (ok, log) = syncstep(&[
        "grad",
        "--weights",
        cut.to_str().unwrap(),
        "--batch",
        wb.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && log.contains("truncated or corrupt"), "{log}");
}

fn train_refuses_an_unwritable_checkpoint_before_training() {
    let tmp = temp_dir("unwritable");
    let dir = tmp.path();
    let file = dir.join("plain-file");
    std::fs::write(&file, b"x").unwrap();
    let (ok, log) = syncstep(&[
        "train",
        "--steps",
        "1",
        "--checkpoint",
        file.join("ck.safetensors").to_str().unwrap(),
    ]);
    assert!(!ok && log.contains("is not a folder"), "{log}");
}

/// Data-parallel training (BatchNorm synchronised, gradients mean-all-reduced) is the
/// single-device training: after a few steps, the same parameters, momentum and running
/// statistics bit for bit, without imposing anything.
fn data_parallel_training_is_single_device_training_bit_for_bit() {
    let gpu = fresh_gpu();
    let mut single = Trainer::new(gpu, small(), None).unwrap();
    run_steps(&mut single, 3);
    let mut dp = Trainer::data_parallel(vec![fresh_gpu(), fresh_gpu()], small(), None).unwrap();
    run_steps(&mut dp, 3);
    let (a, b) = (
        pollster::block_on(single.checkpoint()).unwrap(),
        pollster::block_on(dp.checkpoint()).unwrap(),
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a.params), bits(&b.params), "parameters");
    assert_eq!(bits(&a.velocity), bits(&b.velocity), "momentum");
    assert_eq!(bits(&a.running), bits(&b.running), "running statistics");
    // Three replicas of 2, 1 and 1 images: the same training too.
    let mut three =
        Trainer::data_parallel(vec![fresh_gpu(), fresh_gpu(), fresh_gpu()], small(), None).unwrap();
    run_steps(&mut three, 3);
    let c = pollster::block_on(three.checkpoint()).unwrap();
    assert_eq!(bits(&a.params), bits(&c.params), "parameters at 3 replicas");
    assert_eq!(bits(&a.running), bits(&c.running), "running statistics at 3 replicas");
    let five: Vec<_> = (0..5).map(|_| fresh_gpu()).collect();
    let e = Trainer::data_parallel(five, small(), None).err().unwrap().to_string();
    assert!(e.contains("a batch of 4 cannot give each of 5 replicas an example"), "{e}");
}

fn train_and_grad_take_replicas() {
    needs_adapter();
    let (ok, log) = syncstep(&[
        "train",
        "--replicas",
        "2",
        "--batch",
        "4",
        "--steps",
        "2",
        "--eval-examples",
        "4",
    ]);
    assert!(
        ok && log.contains("2 replicas of 2 images") && log.contains("img/s per replica × 2"),
        "{log}"
    );
    let (ok, log) = syncstep(&["train", "--replicas", "5", "--batch", "4", "--steps", "1"]);
    assert!(!ok && log.contains("a batch of 4 cannot give each of 5 replicas an example"), "{log}");
    let (ok, log) = syncstep(&["train", "--replicas", "2", "--adapters", "0,99", "--steps", "1"]);
    assert!(
        !ok && log.contains("there is no adapter 99") && log.contains("This machine's adapters"),
        "{log}"
    );

    // grad: the data-parallel gradients are the single device's, bit for bit, at any R.
    let tmp = temp_dir("grad-replicas");
    let dir = tmp.path();
    let model = ResNet::new(Arch::ResNet34, 10).unwrap();
    let mut params = model.init_params(8);
    model.randomize_batchnorm(&mut params, 9);
    let batch = synthetic_batch(10, 0, 4, 32, 32, 10).unwrap();
    let wb = dir.join("wb.safetensors");
    let weights = (&params[..], &model.init_buffers()[..]);
    write_step_inputs(&wb, &model, weights, &batch.images, 32, &int64(&batch.labels)).unwrap();
    let grad = |replicas: &str, out: &Path| {
        syncstep(&[
            "grad",
            "--weights",
            wb.to_str().unwrap(),
            "--batch",
            wb.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--replicas",
            replicas,
        ])
    };
    let (one, two) = (dir.join("one.safetensors"), dir.join("two.safetensors"));
    let (ok, log) = grad("1", &one);
    assert!(ok, "{log}");
    let (ok, log) = grad("3", &two); // shards of 2, 1 and 1
    assert!(ok, "{log}");
    let (a, b) = (TensorFile::read(&one).unwrap(), TensorFile::read(&two).unwrap());
    for p in &model.params {
        let name = format!("grad/{}", p.name);
        assert_eq!(
            a.require(&name, &p.shape).unwrap().values,
            b.require(&name, &p.shape).unwrap().values,
            "{name}"
        );
    }
    assert_eq!(
        a.require("logits", &[4, 10]).unwrap().values,
        b.require("logits", &[4, 10]).unwrap().values
    );
    let (la, lb) =
        (a.require("loss", &[1]).unwrap().values[0], b.require("loss", &[1]).unwrap().values[0]);
    // The loss is the global one on every replica: the single device's, to the bit.
    assert_eq!(la.to_bits(), lb.to_bits(), "loss {la} vs {lb}");
    let (ok, log) = grad("5", &two);
    assert!(!ok && log.contains("a batch of 4 cannot give each of 5 replicas an example"), "{log}");
}

/// A face that records what the run hands it, and asks for a stop after `stop_after` steps.
struct Recorder {
    kept: Vec<(u64, Keep)>,
    steps: Vec<u64>,
    stop_after: Option<u64>,
}

impl RunHooks for Recorder {
    type Error = String;

    fn batch(&mut self, trainer: &Trainer) -> Result<syncstep::data::Batch, String> {
        trainer.batch_of_step(trainer.step).map_err(|e| e.to_string())
    }

    fn stepped(&mut self, _trainer: &Trainer, done: &StepDone) -> Result<(), String> {
        self.steps.push(done.step);
        Ok(())
    }

    fn keeps_checkpoints(&self) -> bool {
        true
    }

    fn keep(&mut self, _: &Trainer, ck: &checkpoint::Checkpoint, why: Keep) -> Result<(), String> {
        self.kept.push((ck.step, why));
        Ok(())
    }

    fn stop_code(&mut self) -> u64 {
        match self.stop_after {
            Some(step) if self.steps.last() == Some(&step) => 7,
            _ => 0,
        }
    }
}

/// The run the command line and the page drive: checkpoints as they fall due and at the end, a
/// stop asked for between steps (its state kept), and a diverging loss ending it at its step.
fn a_training_run_keeps_stops_and_guards_divergence() {
    let gpu = fresh_gpu();
    let cfg = TrainConfig { arch: Arch::ResNet18, batch: 2, ..TrainConfig::default() };
    let plan = RunPlan { last: 5, checkpoint_every: 2, epochs: None };
    let start = |gpu, cfg| TrainingRun::new(Trainer::new(gpu, cfg, None).unwrap(), plan);
    let recorder = |stop_after| Recorder { kept: Vec::new(), steps: Vec::new(), stop_after };

    let mut run = start(gpu, cfg.clone());
    let mut face = recorder(None);
    assert_eq!(pollster::block_on(run.run(&mut face)).unwrap(), RunEnd::Finished);
    assert_eq!(face.steps, [1, 2, 3, 4, 5]);
    assert_eq!(face.kept, [(2, Keep::Due), (4, Keep::Due), (5, Keep::Final)]);
    assert_eq!(run.losses().len(), 5);

    let mut run = start(fresh_gpu(), cfg.clone());
    let mut face = recorder(Some(3));
    let end = pollster::block_on(run.run(&mut face)).unwrap();
    assert_eq!(end, RunEnd::Stopped { code: 7, step: 3 });
    assert_eq!(face.kept, [(2, Keep::Due), (3, Keep::Stopped)]);

    let lr = StepConfig { lr: 1000.0, ..cfg.step };
    let mut run = start(fresh_gpu(), TrainConfig { step: lr, ..cfg });
    let mut face = recorder(None);
    match pollster::block_on(run.run(&mut face)) {
        Err(RunError::Diverged(Diverged { step: 2, why: Divergence::LossRose { first, .. } })) => {
            assert_eq!(first, run.losses()[0])
        }
        other => panic!("expected divergence at step 2, got {other:?}"),
    }
    assert_eq!(face.steps, [1], "a diverged step is not shown");
    assert!(face.kept.is_empty(), "a diverged run kept {:?}", face.kept);
}

/// The number in `line` right before `marker` (`2.6191` in "… 2.6191 at the start …").
fn number_before(line: &str, marker: &str) -> f64 {
    let head = &line[..line.find(marker).unwrap_or_else(|| panic!("no {marker:?} in {line}"))];
    let word = head.rsplit(' ').next().unwrap().trim_end_matches('%');
    word.parse().unwrap_or_else(|_| panic!("{word:?} in {line} is not a number"))
}

/// The main job as scripts/run.sh runs it (`train` on its defaults with a checkpoint and a log,
/// then `plot` of the log): its closing lines say that the loss's median fell and the held-out
/// accuracy rose, and its plot draws both.
fn the_main_job_shows_its_loss_falling_and_its_accuracy_rising() {
    needs_adapter();
    let tmp = temp_dir("main-job");
    let dir = tmp.path();
    let at = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let (ck, log, svg) = (at("checkpoint.safetensors"), at("metrics.jsonl"), at("curves.svg"));
    let (ok, out) = syncstep(&["train", "--checkpoint", &ck, "--log", &log]);
    assert!(ok, "{out}");
    let closing = |start: &str| {
        out.lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no {start:?} line: {out}"))
    };
    let loss = closing("loss, the median of 10 steps: ");
    let (first, last) = (number_before(loss, " at the start"), number_before(loss, " at the end"));
    assert!(last < first, "the loss's median went from {first} to {last}: {loss}");
    let accuracy = closing("held-out accuracy (64 images, 10 classes; chance 10%): ");
    let (before, after) = (number_before(accuracy, " before"), number_before(accuracy, " after"));
    assert!(after > before, "{accuracy}");
    // The log holds both evaluations, which the plot draws beside the loss.
    let records = syncstep::metrics::read(Path::new(&log)).unwrap();
    let evaluated: Vec<u64> =
        records.iter().filter(|r| r.val_top1.is_some()).map(|r| r.step).collect();
    assert_eq!(evaluated, [0, 60]);
    let (ok, out) = syncstep(&["plot", &log, "-o", &svg]);
    assert!(ok && out.contains("accuracy at 2 evaluations"), "{out}");
    let drawn = std::fs::read_to_string(&svg).unwrap();
    assert!(drawn.contains("median of the last 10 steps") && drawn.contains("accuracy (%)"));
    eprintln!("the main job: {loss}; {accuracy}");
}

tests![
    resume_from_a_checkpoint_is_bit_exact,
    a_checkpoint_write_killed_midway_keeps_the_old_checkpoint,
    grad_command_matches_the_in_process_step_and_refuses_bad_files,
    train_refuses_an_unwritable_checkpoint_before_training,
    data_parallel_training_is_single_device_training_bit_for_bit,
    train_and_grad_take_replicas,
    a_training_run_keeps_stops_and_guards_divergence,
    the_main_job_shows_its_loss_falling_and_its_accuracy_rising,
];
