//! The single-device ResNet-34 step against the f64 reference (TIE), repeatability (REPEAT),
//! the gradients a backward BN hook is told are final, and the errors a user can cause.

use crate::common::*;
use syncstep::data::synthetic_batch;
use syncstep::gpu::{Encoder, Gpu, Slice};
use syncstep::model::{Arch, ResNet};
use syncstep::reference::step as reference;
use syncstep::step::{
    BnRows, Communicator, OneDevice, Replica, Shard, StepConfig, StepOptions, StepOutput,
};

const BATCH: usize = 8;

fn setup(classes: u32, seed: u64) -> (ResNet, Vec<f32>, Vec<f32>) {
    let model = ResNet::new(Arch::ResNet34, classes).unwrap();
    let mut params = model.init_params(seed);
    model.randomize_batchnorm(&mut params, seed + 1);
    let running = model.init_buffers();
    (model, params, running)
}

fn replica(model: &ResNet, params: &[f32], running: &[f32]) -> Replica {
    Replica::new(fresh_gpu(), model.clone(), params, running).unwrap()
}

fn step(r: &mut Replica, batch: &syncstep::data::Batch, opts: StepOptions) -> StepOutput {
    let cfg = StepConfig::default();
    let whole = Shard::whole(batch.len());
    pollster::block_on(r.forward_backward(batch, &cfg, whole, &OneDevice, opts)).unwrap()
}

fn tie_gpu_step_matches_the_f64_reference() {
    let (model, params, running) = setup(10, 11);
    let mut r = replica(&model, &params, &running);
    let batch = synthetic_batch(5, 0, BATCH, 32, 32, 10).unwrap();
    let out = step(&mut r, &batch, StepOptions { capture_pattern: true, ..Default::default() });
    let grads = pollster::block_on(r.read_grads()).unwrap();
    let gpu_running = pollster::block_on(r.read_running()).unwrap();

    let p64: Vec<f64> = params.iter().map(|&v| v as f64).collect();
    let run64: Vec<f64> = running.iter().map(|&v| v as f64).collect();
    let cfg = reference::StepConfig {
        label_smoothing: 0.1,
        divisor: BATCH as f64,
        bn_momentum: 0.1,
        bn_eps: 1e-5,
    };
    let pattern = out.pattern.as_ref().unwrap();
    let want = reference::training_step(&model, &p64, &run64, &batch, &cfg, Some(pattern));
    let free = reference::training_step(&model, &p64, &run64, &batch, &cfg, None);
    let flips = pattern.flips(&free.pattern);

    let loss_err = (out.loss as f64 - want.loss).abs() / want.loss.abs();
    eprintln!(
        "TIE: loss gpu {} ref {} rel {loss_err:e}; {flips} unit(s) flipped between f32 and f64",
        out.loss, want.loss
    );
    assert!(loss_err <= 1e-5, "loss rel error {loss_err:e}");
    assert_close("logits", &out.logits, &want.logits, 1e-4);
    let mut worst = (0.0, String::new());
    for spec in &model.params {
        let e = norm_rel(&grads[spec.range()], &want.grads[spec.range()]);
        if e > worst.0 {
            worst = (e, spec.name.clone());
        }
    }
    eprintln!("TIE: worst gradient {} at {:e}", worst.1, worst.0);
    assert!(worst.0 <= 1e-4, "gradient of {} off by {:e} norm-rel", worst.1, worst.0);
    for spec in &model.buffers {
        assert_close(&spec.name, &gpu_running[spec.range()], &want.running[spec.range()], 1e-5);
    }
}

/// The optimizer updates a flat parameter buffer past one storage binding (ResNet-101's is past
/// WebGPU's default 128 MiB) in parts: on a device that binds 16 MiB, ResNet-34's 87 MB
/// buffer, in six parts, gets the bits of a device that binds it whole, every tensor moved.
fn sgd_past_one_binding_updates_in_parts_to_the_same_bits() {
    let (model, params, running) = setup(10, 3);
    let mut whole = replica(&model, &params, &running);
    let small = gpu_with_binding_limit(16 << 20);
    let mut parts = Replica::new(small, model.clone(), &params, &running).unwrap();
    let batch = synthetic_batch(2, 0, 2, 32, 32, 10).unwrap();
    let mut after = Vec::new();
    for r in [&mut whole, &mut parts] {
        step(r, &batch, StepOptions::default());
        pollster::block_on(r.sgd_update(&StepConfig::default())).unwrap();
        after.push(pollster::block_on(r.read_params()).unwrap());
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(bits(&after[0]) == bits(&after[1]), "parts differ from the whole update");
    for spec in &model.params {
        assert_ne!(after[1][spec.range()], params[spec.range()], "{} not updated", spec.name);
    }
}

fn repeat_the_same_step_twice_is_bitwise_equal() {
    let (model, params, running) = setup(10, 3);
    let mut r = replica(&model, &params, &running);
    let batch = synthetic_batch(9, 0, 4, 32, 32, 10).unwrap();
    let a = step(&mut r, &batch, StepOptions::default());
    let ga = pollster::block_on(r.read_grads()).unwrap();
    let b = step(&mut r, &batch, StepOptions::default());
    let gb = pollster::block_on(r.read_grads()).unwrap();
    assert_eq!(a.loss.to_bits(), b.loss.to_bits());
    assert!(
        ga.iter().zip(&gb).all(|(x, y)| x.to_bits() == y.to_bits()),
        "gradients differ between two identical steps"
    );
    assert!(ga.iter().any(|&g| g != 0.0));
}

/// The GPU plan (the implicit-GEMM family for every convolution, its tiles, segments and nodes
/// as a GPU's model chooses them) gives the clockless CPU plan's bits for the whole step, loss,
/// logits, every gradient and running statistic, with Winograd off on both (its roundings are
/// its own).
fn the_gpu_plans_step_gives_the_cpu_plans_bits() {
    use syncstep::kernels::conv2d::{Forced, KernelPlan, KernelPolicy};
    let (model, params, running) = setup(10, 21);
    let batch = synthetic_batch(13, 0, 6, 32, 32, 10).unwrap();
    let policies = [
        KernelPolicy::new(KernelPlan::Gpu, None, None),
        KernelPolicy::new(KernelPlan::Timed, Some(Forced::Guess), None).with_winograd(Some(false)),
    ];
    let mut runs = Vec::new();
    for policy in policies {
        let gpu = device_with(policy);
        let mut r = Replica::new(gpu, model.clone(), &params, &running).unwrap();
        let out = step(&mut r, &batch, StepOptions::default());
        let grads = pollster::block_on(r.read_grads()).unwrap();
        let running = pollster::block_on(r.read_running()).unwrap();
        runs.push((out.loss, bits(&out.logits), bits(&grads), bits(&running)));
    }
    let (gpu_plan, cpu_plan) = (&runs[0], &runs[1]);
    assert_eq!(gpu_plan.0.to_bits(), cpu_plan.0.to_bits(), "loss");
    assert!(gpu_plan.1 == cpu_plan.1, "logits differ");
    for spec in &model.params {
        let r = spec.range();
        assert!(gpu_plan.2[r.clone()] == cpu_plan.2[r], "gradient of {} differs", spec.name);
    }
    assert!(gpu_plan.3 == cpu_plan.3, "running statistics differ");
}

fn bad_inputs_are_clear_errors() {
    let (model, params, running) = setup(10, 3);
    let mut r = replica(&model, &params, &running);
    let cfg = StepConfig::default();
    let run = |r: &mut Replica, b: &syncstep::data::Batch| {
        let whole = Shard::whole(b.len());
        pollster::block_on(r.forward_backward(b, &cfg, whole, &OneDevice, StepOptions::default()))
            .unwrap_err()
            .to_string()
    };
    let mut b = synthetic_batch(1, 0, 2, 32, 32, 10).unwrap();
    b.labels[1] = 10;
    assert!(run(&mut r, &b).contains("label 10 of example 1"));
    let mut b = synthetic_batch(1, 0, 2, 32, 32, 10).unwrap();
    b.images[7] = f32::INFINITY;
    assert!(run(&mut r, &b).contains("non-finite"));
    let b = synthetic_batch(1, 0, 2, 16, 16, 10).unwrap();
    assert!(run(&mut r, &b).contains("too small"));
    let bad = StepConfig { label_smoothing: 1.5, ..cfg };
    let b = synthetic_batch(1, 0, 2, 32, 32, 10).unwrap();
    let (whole, opts) = (Shard::whole(2), StepOptions::default());
    let e = pollster::block_on(r.forward_backward(&b, &bad, whole, &OneDevice, opts))
        .unwrap_err()
        .to_string();
    assert!(e.contains("label smoothing"), "{e}");
    // One image at 32×32: layer4's BatchNorm would see one value per channel.
    let one = synthetic_batch(1, 0, 1, 32, 32, 10).unwrap();
    let e = pollster::block_on(r.forward_backward(&one, &cfg, Shard::whole(1), &OneDevice, opts))
        .unwrap_err()
        .to_string();
    assert!(e.contains("Expected more than 1 value per channel when training"), "{e}");
    let e = pollster::block_on(r.forward_backward(
        &b,
        &cfg,
        Shard { start: 3, global: 4 },
        &OneDevice,
        opts,
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("cannot be examples 3.. of a global batch of 4"), "{e}");
}

fn predict_uses_running_statistics_and_changes_nothing() {
    let (model, params, mut running) = setup(10, 5);
    // Non-trivial running statistics, as after some training.
    for (i, v) in running.iter_mut().enumerate() {
        *v = if *v == 1.0 { 0.5 + (i % 7) as f32 * 0.2 } else { ((i % 5) as f32 - 2.0) * 0.1 };
    }
    let mut r = replica(&model, &params, &running);
    let batch = synthetic_batch(2, 100, 4, 32, 32, 10).unwrap();
    let logits = pollster::block_on(r.predict(&batch)).unwrap();
    let p64: Vec<f64> = params.iter().map(|&v| v as f64).collect();
    let r64: Vec<f64> = running.iter().map(|&v| v as f64).collect();
    assert_close("eval logits", &logits, &reference::predict(&model, &p64, &r64, &batch), 1e-4);
    assert_eq!(
        pollster::block_on(r.read_running()).unwrap(),
        running,
        "predict changed the running statistics"
    );
    assert_eq!(pollster::block_on(r.predict(&batch)).unwrap(), logits);
}

/// A communicator that notes the sites of every trip and, at each backward one, submits what
/// was recorded and reads back the gradients the step has just said are final.
#[derive(Default)]
struct FinalGradients {
    stats_trips: std::cell::RefCell<Vec<Vec<usize>>>,
    sums_trips: std::cell::RefCell<Vec<Vec<usize>>>,
    /// The final part the step named last: the buffer, its offset and length.
    done: std::cell::RefCell<Option<(wgpu::Buffer, u64, u64)>>,
    /// Each backward trip's final part: its first element, and every piece's values from it.
    seen: std::cell::RefCell<Vec<(u64, Vec<Vec<f32>>)>>,
    /// The replica's gradient pieces: how many, and the bytes from one to the next.
    pieces: (u64, u64),
}

impl Communicator for FinalGradients {
    fn examples(&self, local: u32) -> u32 {
        local
    }
    async fn bn_stats(
        &self,
        _: &Gpu,
        _: &mut Encoder,
        sites: &[BnRows<'_>],
    ) -> syncstep::step::Result<()> {
        self.stats_trips.borrow_mut().push(sites.iter().map(|s| s.site).collect());
        Ok(())
    }
    fn gradients_final(
        &self,
        _: &Gpu,
        _: &mut Encoder,
        done: Slice<'_>,
    ) -> syncstep::step::Result<()> {
        *self.done.borrow_mut() = Some((done.buffer.clone(), done.offset, done.len));
        Ok(())
    }
    async fn bn_sums(
        &self,
        gpu: &Gpu,
        enc: &mut Encoder,
        sites: &[BnRows<'_>],
    ) -> syncstep::step::Result<()> {
        self.sums_trips.borrow_mut().push(sites.iter().map(|s| s.site).collect());
        let recorded = std::mem::replace(enc, gpu.encoder());
        gpu.submit(recorded).await?;
        let (buffer, offset, len) = self.done.borrow().clone().expect("named before the trip");
        let (count, stride) = self.pieces;
        let mut values = Vec::new();
        for piece in 0..count.max(1) {
            values.push(gpu.read_f32(Slice::new(&buffer, offset + piece * stride, len)).await?);
        }
        self.seen.borrow_mut().push((offset / 4, values));
        Ok(())
    }
}

/// The fewest trips the dependencies allow: a block's downsample travels with its first conv in
/// the forward (both read the block's input) and with its last in the backward (both read the
/// block's output cotangent); every other BN site travels alone.
fn bn_sites_whose_rows_are_ready_together_make_one_trip() {
    let (model, params, running) = setup(10, 13);
    let mut r = replica(&model, &params, &running);
    let hook = FinalGradients::default();
    pollster::block_on(r.forward_backward(
        &synthetic_batch(6, 0, 2, 32, 32, 10).unwrap(),
        &StepConfig::default(),
        Shard::whole(2),
        &hook,
        StepOptions::default(),
    ))
    .unwrap();
    let site = |bn| model.batchnorms().iter().position(|b| *b == bn).unwrap();
    let (mut forward, mut backward) =
        (vec![vec![site(model.stem_bn)]], vec![vec![site(model.stem_bn)]]);
    for b in &model.blocks {
        let ds = b.downsample.map(|(_, bn)| site(bn));
        let last = b.units.len() - 1;
        for (j, &(_, bn)) in b.units.iter().enumerate() {
            let bn = site(bn);
            forward.push(match ds {
                Some(ds) if j == 0 => vec![bn, ds],
                _ => vec![bn],
            });
            backward.push(match ds {
                Some(ds) if j == last => vec![ds, bn],
                _ => vec![bn],
            });
        }
    }
    backward.reverse();
    assert_eq!(*hook.stats_trips.borrow(), forward);
    assert_eq!(*hook.sums_trips.borrow(), backward);
    assert_eq!((forward.len(), backward.len()), (33, 33), "ResNet-34: 36 sites, 3 downsamples");
}

/// What the data-parallel all-reduce relies on: the part of the gradient buffer a backward hook
/// is told is final holds, at that moment, the step's final gradients (the buffer was poisoned
/// first), in every piece's slab, reaches the end of the buffer, and grows from site to site
/// down to the stem's BN. One piece (a whole batch) and two (examples [1, 3) of 4: [1, 2) and
/// [2, 3)).
fn the_gradients_a_backward_hook_is_told_are_final_are() {
    let (model, params, running) = setup(10, 12);
    let mut r = replica(&model, &params, &running);
    let batch = synthetic_batch(6, 0, 2, 32, 32, 10).unwrap();
    let want = step(&mut r, &batch, StepOptions::default());
    let want_grads = pollster::block_on(r.read_grads()).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (shard, pieces) in [(Shard::whole(2), 1), (Shard { start: 1, global: 4 }, 2)] {
        r.gpu.poison(Slice::whole(&r.grads));
        let hook = FinalGradients { pieces: (pieces, r.slab_stride()), ..Default::default() };
        let got = pollster::block_on(r.forward_backward(
            &batch,
            &StepConfig::default(),
            shard,
            &hook,
            StepOptions::default(),
        ))
        .unwrap();
        assert_eq!(
            bits(&got.logits),
            bits(&want.logits),
            "the hook's submissions changed the step"
        );
        if pieces == 1 {
            assert_eq!(got.loss.to_bits(), want.loss.to_bits());
        }
        let all = pollster::block_on(r.gpu.read_f32(Slice::whole(&r.grads))).unwrap();
        let slab = |p: u64| &all[(p * r.slab_stride() / 4) as usize..][..model.param_len];
        let seen = hook.seen.into_inner();
        assert_eq!(seen.len(), hook.sums_trips.borrow().len(), "one read per backward trip");
        assert!(
            seen.windows(2).all(|w| w[1].0 < w[0].0),
            "the final part must grow at every site: {:?}",
            seen.iter().map(|s| s.0).collect::<Vec<_>>()
        );
        assert!(seen[0].0 <= model.param("fc.weight").unwrap().offset as u64);
        assert_eq!(seen.last().unwrap().0, model.param("bn1.weight").unwrap().offset as u64);
        for (from, values) in &seen {
            for (p, values) in values.iter().enumerate() {
                assert_eq!(values.len() as u64, model.param_len as u64 - from);
                assert_eq!(
                    bits(values),
                    bits(&slab(p as u64)[*from as usize..]),
                    "piece {p}'s gradients from element {from} were not final when the hook was told so"
                );
            }
        }
        if pieces == 1 {
            // Padding was never written: compare the tensors with the step without the poison.
            for spec in &model.params {
                let got = &slab(0)[spec.range()];
                assert_eq!(bits(got), bits(&want_grads[spec.range()]), "{}", spec.name);
            }
        }
    }
}

tests![
    tie_gpu_step_matches_the_f64_reference,
    sgd_past_one_binding_updates_in_parts_to_the_same_bits,
    repeat_the_same_step_twice_is_bitwise_equal,
    the_gpu_plans_step_gives_the_cpu_plans_bits,
    bad_inputs_are_clear_errors,
    predict_uses_running_statistics_and_changes_nothing,
    bn_sites_whose_rows_are_ready_together_make_one_trip,
    the_gradients_a_backward_hook_is_told_are_final_are,
];
