//! The data-parallel step on R devices against one device at the global batch: the gates of
//! docs/design.md through `check::run_check` (TEST, CONTROL, REPEAT, DRIFT, TIE, PORTABLE against
//! a golden file) at power-of-two shards, odd ones and uneven ones, the equivalence broken on
//! purpose, replicas on two different adapters, and the errors a user can cause (a batch
//! smaller than the replicas, a missing adapter, a device lost mid-run).
//!
//! `cargo test --release --test parallel -- --nocapture` prints every gate table.

use crate::common::*;
use syncstep::check::{
    run_check, run_check_on, Bound, CheckConfig, CheckDevices, CheckReport, Gate, CONTROL_FACTOR,
    CONTROL_FLOOR, TIE_DEEP_FACTOR, TIE_GRAD_BOUND,
};
use syncstep::data::synthetic_batch;
use syncstep::golden::Golden;
use syncstep::gpu::AdapterChoice;
use syncstep::model::{Arch, ResNet};
use syncstep::parallel::{DataParallel, ParallelOptions, Sabotage};
use syncstep::step::{OneDevice, Replica, Shard, StepConfig, StepOptions};

fn adapters() -> Vec<AdapterChoice> {
    vec![crate::common::environment().adapter()]
}

fn check(cfg: CheckConfig) -> CheckReport {
    needs_adapter();
    let report = pollster::block_on(run_check(&cfg, &device_config())).unwrap();
    eprintln!("{}", report.table());
    report
}

fn measured(report: &CheckReport, gate: Gate) -> f64 {
    report.row(gate).unwrap_or_else(|| panic!("no {gate} row")).measured
}

/// Every gate passes, each held to its bound here too (not only through `pass`): TEST and
/// DRIFT bitwise 0, CONTROL clearly off (or not applicable, saying why).
fn assert_gates(cfg: CheckConfig) -> CheckReport {
    let report = check(cfg);
    for gate in [Gate::Test, Gate::TestLoss, Gate::TestLogits, Gate::Repeat] {
        assert_eq!(measured(&report, gate), 0.0, "{gate}:\n{}", report.table());
    }
    let control = report.row(Gate::Control).unwrap();
    assert!(
        control.measured >= CONTROL_FACTOR * CONTROL_FLOOR || control.note.starts_with("n/a"),
        "CONTROL cannot tell synchronised from local BN:\n{}",
        report.table()
    );
    let drift = report.row(Gate::Drift).unwrap();
    assert!(
        drift.measured == 0.0 && drift.note.contains("replicas bitwise equal"),
        "DRIFT {:e}: {}",
        drift.measured,
        drift.note
    );
    assert!(report.passed(), "{}", report.table());
    report
}

fn gates_pass_at_2_replicas_of_4_and_the_single_device_ties_to_the_reference() {
    let cfg = CheckConfig {
        replicas: 2,
        batch: 4,
        adapters: adapters(),
        tie: true,
        seed: 3,
        ..Default::default()
    };
    assert_gates(cfg);
}

fn gates_pass_at_4_replicas_of_2() {
    assert_gates(CheckConfig {
        replicas: 4,
        batch: 2,
        adapters: adapters(),
        seed: 1,
        ..Default::default()
    });
}

/// Odd global batches split unevenly, with shard edges inside the canonical tree's pairs: 7 as
/// 3, 2, 2 (edges at 3 and 5), and 5 as 2, 1, 1, 1 (an edge at 3; replicas of one example,
/// whose own BatchNorm has no variance, so CONTROL does not apply there). TEST and DRIFT over
/// 2 SGD steps bitwise 0.
fn gates_pass_bitwise_at_odd_and_uneven_shards() {
    for (replicas, global_batch) in [(3, 7), (4, 5)] {
        let cfg = CheckConfig {
            replicas,
            global_batch: Some(global_batch),
            steps: 2,
            adapters: adapters(),
            ..Default::default()
        };
        assert_gates(cfg);
    }
}

/// The other ResNets hold every gate at uneven shards: ResNet-18's BasicBlocks [2, 2, 2, 2] at
/// 8 images as 3, 3, 2; ResNet-50's Bottlenecks (1×1 convolutions, the stride on the 3×3) at 16
/// as 6, 5, 5, where its smallest maps (1×1) give BatchNorm 16 values per channel: at 8, f32's
/// own rounding parts from f64 by more than TIE's bound (PyTorch's f32 step too, by 2.5e-4).
fn resnet18_and_resnet50_pass_the_gates_at_uneven_shards() {
    for (arch, global_batch) in [(Arch::ResNet18, 8), (Arch::ResNet50, 16)] {
        assert_gates(gates_at_uneven_shards(arch, global_batch));
    }
}

/// ResNet-101 likewise at 16 as 6, 5, 5, with TIE's gradient bound for its depth: its f32 step,
/// like PyTorch's, parts from f64 by a few 1e-4 through rounding alone.
fn resnet101_passes_the_gates_at_uneven_shards() {
    let report = assert_gates(gates_at_uneven_shards(Arch::ResNet101, 16));
    let tie = report.row(Gate::Tie).unwrap();
    assert_eq!(tie.bound, Bound::AtMost(TIE_GRAD_BOUND * TIE_DEEP_FACTOR));
}

fn gates_at_uneven_shards(arch: Arch, global_batch: usize) -> CheckConfig {
    CheckConfig {
        arch,
        replicas: 3,
        global_batch: Some(global_batch),
        steps: 1,
        tie: true,
        adapters: adapters(),
        ..Default::default()
    }
}

/// The equivalence done the way it usually is, with each replica dividing its loss by its own
/// shard and the all-reduce taking the mean: in f32 that is not the single device's step at 3
/// replicas of 4, and TEST, held to the bit, must say so; unsynchronised statistics likewise.
fn a_broken_equivalence_fails_test() {
    for (sabotage, replicas, batch) in
        [(Sabotage::LocalDivisor, 3, 4), (Sabotage::UnmergedStats, 2, 2)]
    {
        let cfg = CheckConfig {
            replicas,
            batch,
            steps: 0,
            adapters: adapters(),
            sabotage: Some(sabotage),
            ..Default::default()
        };
        let report = check(cfg);
        let test = report.row(Gate::Test).unwrap();
        assert!(
            !test.pass && test.measured > 0.0,
            "{sabotage:?} went unnoticed: TEST {:e}",
            test.measured
        );
        assert!(!report.passed());
    }
}

fn replicas_on_a_vulkan_and_a_gl_adapter_pass_test() {
    needs_adapter();
    let mixed = vec![AdapterChoice::parse("vulkan").unwrap(), AdapterChoice::parse("gl").unwrap()];
    let instance = syncstep::gpu::instance();
    for choice in &mixed {
        if let Err(e) = pollster::block_on(syncstep::gpu::select_adapter(&instance, choice)) {
            unavailable(&format!("no {choice:?} adapter for the mixed test ({e})"));
        }
    }
    // Uneven shards (3, 2) on Vulkan and GL.
    let report = check(CheckConfig {
        replicas: 2,
        global_batch: Some(5),
        steps: 1,
        adapters: mixed,
        ..Default::default()
    });
    assert!(
        report.replica_adapters[0].ends_with("Vulkan")
            && report.replica_adapters[1].ends_with("Gl"),
        "{:?}",
        report.replica_adapters
    );
    for gate in [Gate::Test, Gate::TestLoss, Gate::TestLogits, Gate::Drift] {
        let row = report.row(gate).unwrap();
        assert!(row.pass && row.measured == 0.0, "{gate} on Vulkan + GL:\n{}", report.table());
    }
}

/// The golden file of one run, read back, holds the next run to it: PORTABLE exactly 0 on the
/// same adapter, and the phases are reported in order up to "done".
fn a_golden_file_from_one_run_holds_the_next_to_it() {
    let cfg =
        CheckConfig { replicas: 2, batch: 2, steps: 0, adapters: adapters(), ..Default::default() };
    let first = check(cfg.clone());
    let golden = Golden::from_json(&first.golden.to_json()).unwrap();
    assert_eq!(golden, first.golden);
    let mut phases = Vec::new();
    let report = pollster::block_on(async {
        run_check_on(
            &cfg,
            CheckDevices::open(&cfg, &device_config()).await?,
            Some(&golden),
            &mut |p| phases.push((p.index, p.total, p.phase.clone(), p.gates.len())),
        )
        .await
    })
    .unwrap();
    eprintln!("{}", report.table());
    let portable = report.row(Gate::Portable).unwrap();
    assert_eq!((portable.measured, portable.flips), (0.0, Some(0)), "{}", report.table());
    assert_eq!(measured(&report, Gate::PortableLoss), 0.0);
    assert!(
        report.passed()
            && report
                .tensors
                .iter()
                .all(|t| t.portable == Some(0.0) && t.test == 0.0 && t.control > 0.0)
    );
    assert_eq!(report.portable_against.as_deref(), Some(first.single_adapter.as_str()));
    let total = phases[0].1;
    assert!(
        phases.iter().enumerate().all(|(i, p)| p.0 == i && p.1 == total)
            && phases.len() == total + 1,
        "{phases:?}"
    );
    assert!(
        phases.iter().any(|p| p.2.starts_with("PORTABLE"))
            && phases[total].2 == "done: all gates pass",
        "{phases:?}"
    );
    // The table fills as the check goes: nothing decided at first, every gate at the end.
    assert_eq!((phases[0].3, phases[total].3), (0, report.rows.len()));

    let other = CheckConfig { seed: 1, ..cfg };
    let e = pollster::block_on(async {
        run_check_on(
            &other,
            CheckDevices::open(&other, &device_config()).await?,
            Some(&golden),
            &mut |_| {},
        )
        .await
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(
            "golden file was made for resnet34, 2 replicas, 4 images, 32×32, 10 classes, seed 0"
        ),
        "{e}"
    );
}

fn model_and_state(seed: u64) -> (ResNet, Vec<f32>, Vec<f32>) {
    let model = ResNet::new(Arch::ResNet34, 10).unwrap();
    let mut params = model.init_params(seed);
    model.randomize_batchnorm(&mut params, seed + 1);
    let running = model.init_buffers();
    (model, params, running)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn one_replica_is_the_plain_single_device_step_bitwise() {
    let (model, params, running) = model_and_state(5);
    let device = fresh_gpu();
    let mut single = Replica::new(device, model.clone(), &params, &running).unwrap();
    let mut dp = pollster::block_on(DataParallel::new(
        &model,
        &params,
        &running,
        1,
        &adapters(),
        &device_config(),
    ))
    .unwrap();
    let batch = synthetic_batch(2, 0, 4, 32, 32, 10).unwrap();
    let cfg = StepConfig::default();
    let whole = Shard::whole(batch.len());
    let want = pollster::block_on(single.forward_backward(
        &batch,
        &cfg,
        whole,
        &OneDevice,
        StepOptions::default(),
    ))
    .unwrap();
    let got =
        pollster::block_on(dp.forward_backward(&batch, &cfg, ParallelOptions::default())).unwrap();
    assert_eq!(got[0].loss.to_bits(), want.loss.to_bits());
    assert_eq!(bits(&got[0].logits), bits(&want.logits));
    let dp_grads = pollster::block_on(dp.read_grads()).unwrap();
    assert_eq!(bits(&dp_grads[0]), bits(&pollster::block_on(single.read_grads()).unwrap()));
    assert_eq!(
        bits(&pollster::block_on(dp.read_running()).unwrap()[0]),
        bits(&pollster::block_on(single.read_running()).unwrap())
    );
}

fn synchronised_replicas_hold_identical_gradients_and_running_statistics() {
    let (model, params, running) = model_and_state(6);
    needs_adapter();
    let mut dp = pollster::block_on(DataParallel::new(
        &model,
        &params,
        &running,
        2,
        &adapters(),
        &device_config(),
    ))
    .unwrap();
    // Shards that differ visibly, so per-replica statistics would differ too.
    let shards = synthetic_batch(3, 0, 4, 32, 32, 10).unwrap().shards(2).unwrap();
    let batch = syncstep::data::Batch::concat(&[shards[0].clone(), shards[1].shifted(1.0)]);
    pollster::block_on(dp.forward_backward(
        &batch,
        &StepConfig::default(),
        ParallelOptions::default(),
    ))
    .unwrap();
    let run = pollster::block_on(dp.read_running()).unwrap();
    assert_eq!(bits(&run[0]), bits(&run[1]), "running statistics differ between replicas");
    assert_ne!(run[0], running, "running statistics were not updated");
    let grads = pollster::block_on(dp.read_grads()).unwrap();
    assert_eq!(
        bits(&grads[0]),
        bits(&grads[1]),
        "gradients differ between replicas after the all-reduce"
    );
}

/// Replicas whose maps wait on helper threads (GPUs: the devices run at once) take the same
/// step, to the bit, as replicas whose maps block the one thread they share (CPU adapters: the
/// devices take turns); both finish, with no replica waiting on another forever.
fn replicas_that_run_at_once_or_take_turns_give_the_same_bits() {
    let (model, params, running) = model_and_state(7);
    needs_adapter();
    let batch = synthetic_batch(5, 0, 8, 32, 32, 10).unwrap();
    let step = |blocking: bool| {
        let mut gpus =
            pollster::block_on(syncstep::parallel::devices(2, &adapters(), &device_config()))
                .unwrap();
        gpus.iter_mut().for_each(|g| g.blocking_maps = blocking);
        let mut dp = DataParallel::from_gpus(gpus, &model, &params, &running).unwrap();
        pollster::block_on(dp.forward_backward(
            &batch,
            &StepConfig::default(),
            ParallelOptions::default(),
        ))
        .unwrap();
        (
            pollster::block_on(dp.read_grads()).unwrap(),
            pollster::block_on(dp.read_running()).unwrap(),
        )
    };
    let (turns, at_once) = (step(true), step(false));
    for r in 0..2 {
        assert_eq!(bits(&turns.0[r]), bits(&at_once.0[r]), "replica {r}'s gradients");
        assert_eq!(bits(&turns.1[r]), bits(&at_once.1[r]), "replica {r}'s running statistics");
    }
}

/// Every gradient is all-reduced exactly once, in a bucket during the backward or after it, and
/// every replica's pieces are added along the canonical tree: the replicas hold the single
/// device's gradient bit for bit, with one piece per replica (2 × 2) and with two (3 × 3: [0, 2)
/// [2, 3) | [3, 4) [4, 6) | [6, 8) [8, 9)), in buckets of 25 MiB and of one layer's gradients
/// each (0; the default size elsewhere). Reduced twice, or a piece missed or added out of order, it would differ.
fn every_gradient_is_reduced_exactly_once_along_the_canonical_tree() {
    let (model, params, running) = model_and_state(9);
    let device = fresh_gpu();
    let mut single = Replica::new(device, model.clone(), &params, &running).unwrap();
    let cfg = StepConfig::default();
    for (replicas, batch, bucket_mib) in [(2, 4, 25), (3, 9, 0)] {
        let batch = synthetic_batch(5, 0, batch, 32, 32, 10).unwrap();
        let whole = Shard::whole(batch.len());
        let opts = StepOptions::default();
        pollster::block_on(single.forward_backward(&batch, &cfg, whole, &OneDevice, opts)).unwrap();
        let want = pollster::block_on(single.read_grads()).unwrap();
        let mut dp = pollster::block_on(DataParallel::new(
            &model,
            &params,
            &running,
            replicas,
            &adapters(),
            &device_config(),
        ))
        .unwrap()
        .with_bucket_bytes(bucket_mib << 20);
        pollster::block_on(dp.forward_backward(&batch, &cfg, ParallelOptions::default())).unwrap();
        for (r, got) in pollster::block_on(dp.read_grads()).unwrap().iter().enumerate() {
            for spec in &model.params {
                let (g, w) = (&got[spec.range()], &want[spec.range()]);
                assert!(w.iter().any(|&v| v != 0.0), "{} is all zero", spec.name);
                assert_eq!(bits(g), bits(w), "{} of replica {r} of {replicas}", spec.name);
            }
        }
    }
}

fn bad_inputs_are_clear_errors() {
    let (model, params, running) = model_and_state(7);
    needs_adapter();
    let new = |replicas, adapters: &[AdapterChoice]| {
        pollster::block_on(DataParallel::new(
            &model,
            &params,
            &running,
            replicas,
            adapters,
            &device_config(),
        ))
    };
    let e = new(0, &adapters()).err().unwrap().to_string();
    assert!(e.contains("replica count must be at least 1"), "{e}");
    let e = new(2, &[AdapterChoice { backend: None, index: 99 }]).err().unwrap().to_string();
    assert!(e.contains("there is no adapter 99") && e.contains("syncstep info"), "{e}");

    let mut dp = new(2, &adapters()).unwrap();
    let one = synthetic_batch(1, 0, 1, 32, 32, 10).unwrap();
    let e = pollster::block_on(dp.forward_backward(
        &one,
        &StepConfig::default(),
        ParallelOptions::default(),
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("a batch of 1 cannot give each of 2 replicas an example"), "{e}");
    let mut bad = synthetic_batch(1, 0, 4, 32, 32, 10).unwrap();
    bad.labels[3] = 10;
    let e = pollster::block_on(dp.forward_backward(
        &bad,
        &StepConfig::default(),
        ParallelOptions::default(),
    ))
    .unwrap_err()
    .to_string();
    assert!(e.starts_with("replica 1 (") && e.contains("label 10 of example 1"), "{e}");

    let e = pollster::block_on(run_check(
        &CheckConfig { replicas: 0, ..Default::default() },
        &device_config(),
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("replica count must be at least 1"), "{e}");
}

/// A device lost between steps: the next step stops with an error naming that replica (the
/// other replicas, waiting for it at a BatchNorm site, are released), and does not hang.
fn a_lost_device_stops_the_step_and_names_the_replica() {
    let (model, params, running) = model_and_state(8);
    needs_adapter();
    let batch = synthetic_batch(4, 0, 4, 32, 32, 10).unwrap();
    let cfg = StepConfig::default();
    for lost in [1, 0] {
        let mut dp = pollster::block_on(DataParallel::new(
            &model,
            &params,
            &running,
            2,
            &adapters(),
            &device_config(),
        ))
        .unwrap();
        pollster::block_on(dp.forward_backward(&batch, &cfg, ParallelOptions::default())).unwrap();
        dp.replicas()[lost].gpu.device.destroy();
        let e = pollster::block_on(dp.forward_backward(&batch, &cfg, ParallelOptions::default()))
            .unwrap_err()
            .to_string();
        eprintln!("{e}");
        assert!(
            e.starts_with(&format!("replica {lost} (")) && e.contains("GPU device lost"),
            "{e}"
        );
        let e = pollster::block_on(dp.sgd_update(&cfg)).unwrap_err().to_string();
        assert!(e.starts_with(&format!("replica {lost} (")), "{e}");
    }
}

tests![
    gates_pass_at_2_replicas_of_4_and_the_single_device_ties_to_the_reference,
    gates_pass_at_4_replicas_of_2,
    gates_pass_bitwise_at_odd_and_uneven_shards,
    resnet18_and_resnet50_pass_the_gates_at_uneven_shards,
    resnet101_passes_the_gates_at_uneven_shards,
    a_broken_equivalence_fails_test,
    replicas_on_a_vulkan_and_a_gl_adapter_pass_test,
    a_golden_file_from_one_run_holds_the_next_to_it,
    one_replica_is_the_plain_single_device_step_bitwise,
    synchronised_replicas_hold_identical_gradients_and_running_statistics,
    replicas_that_run_at_once_or_take_turns_give_the_same_bits,
    every_gradient_is_reduced_exactly_once_along_the_canonical_tree,
    bad_inputs_are_clear_errors,
    a_lost_device_stops_the_step_and_names_the_replica,
];
