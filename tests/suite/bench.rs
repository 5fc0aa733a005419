//! `syncstep bench`: the report's figures hang together, the profile covers the step, the JSON
//! has every key, bad settings name their flag; and the gpu layer's profiler and memory counter
//! underneath. Speed itself is never asserted.

use std::collections::HashSet;

use crate::common::*;
use serde_json::Value;
use syncstep::bench::{
    self, BenchConfig, BenchReport, ProbeSize, ALL_LAYERS, STEP_FLOPS_PER_FORWARD,
};
use syncstep::gpu::{Encoder, ScratchSlot, Slice};
use syncstep::kernels::conv2d::Conv2dAlgo;
use syncstep::kernels::elementwise;
use syncstep::model::{Arch, ResNet};
use syncstep::step::conv2d_shape;

fn small(replicas: usize) -> BenchConfig {
    BenchConfig {
        replicas,
        batch: 2,
        steps: 1,
        profile: true,
        adapters: vec![crate::common::environment().adapter()],
        device: device_config(),
        ..BenchConfig::default()
    }
}

fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

/// What every report must satisfy, whatever R.
fn check_report(report: &BenchReport, cfg: &BenchConfig) {
    let model = ResNet::new(Arch::ResNet34, cfg.classes).unwrap();
    let s = &report.step;
    assert_eq!(
        (s.replicas, s.global_batch, s.seconds.len()),
        (cfg.replicas, cfg.global(), cfg.steps)
    );
    assert!(s.seconds.iter().all(|&t| positive(t)), "{:?}", s.seconds);
    assert!(s.min() <= s.median() && s.median() <= s.max());
    let flops = STEP_FLOPS_PER_FORWARD
        * model.forward_flops(cfg.image_size, cfg.image_size)
        * cfg.global() as f64;
    assert_eq!(s.flops, flops);
    assert!((s.gflops() - flops / s.median() / 1e9).abs() <= 1e-9 * s.gflops());
    assert!(
        (s.images_per_second() - cfg.global() as f64 / s.median()).abs()
            <= 1e-9 * s.images_per_second()
    );
    // Every replica holds at least parameters, gradients and momentum.
    assert_eq!(s.memory.len(), cfg.replicas);
    for m in &s.memory {
        assert!(m.held_bytes >= 3 * model.param_len as u64 * 4, "{m:?}");
        assert!(
            m.transient_bytes > 0 && m.largest_transient_buffer_bytes <= m.transient_bytes,
            "{m:?}"
        );
    }
    assert_eq!(report.adapters.len(), cfg.replicas);

    // The profile: every conv layer's forward and weight gradient (and input-VJP but the stem's)
    // is there with its FLOPs, and the kernels' time fits inside the step's wall time.
    let p = report.profile.as_ref().expect("lavapipe has timestamp queries");
    assert!(p.kernels.iter().all(|k| k.seconds.is_finite() && k.seconds >= 0.0));
    assert!(positive(p.kernel_seconds()));
    assert!(
        p.kernel_seconds() <= p.step_seconds,
        "kernels {} s in a step of {} s",
        p.kernel_seconds(),
        p.step_seconds
    );
    for conv in model.convs() {
        let name = model.conv_name(&conv);
        let mut ops = vec![("forward", "conv2d_forward"), ("backward", "conv2d_backward_weight")];
        if conv != model.stem_conv {
            ops.push(("backward", "conv2d_backward_input"));
        }
        for (direction, op) in ops {
            let layer = format!("{name} {direction}");
            let row = p
                .by_layer
                .iter()
                .find(|r| r.layer == layer && r.kernel == op)
                .unwrap_or_else(|| panic!("no profile row for {layer} {op}"));
            assert!(positive(row.seconds) && positive(row.flops.unwrap()), "{row:?}");
        }
    }
    assert!(p.by_layer.iter().any(|r| r.layer == "sgd update" && r.kernel == "sgd_update"));
    let total = |rows: &[bench::ProfileRow]| rows.iter().map(|r| r.seconds).sum::<f64>();
    for rows in [&p.by_layer, &p.by_op, &p.by_entry] {
        assert!((total(rows) - p.kernel_seconds()).abs() <= 1e-9 * p.kernel_seconds());
        assert!(rows.windows(2).all(|w| w[0].seconds >= w[1].seconds), "slowest first");
    }
    assert!(p.by_op.iter().chain(&p.by_entry).all(|r| r.layer == ALL_LAYERS));

    // The JSON carries every figure.
    let json = serde_json::from_str::<Value>(&report.to_json()).unwrap();
    let num = |v: &Value, path: &[&str]| {
        path.iter()
            .try_fold(v, |v, k| v.get(k))
            .and_then(Value::as_f64)
            .unwrap_or_else(|| panic!("no number at {path:?}"))
    };
    assert_eq!(num(&json, &["step", "median_s"]), s.median());
    assert_eq!(num(&json, &["step", "gflops"]), s.gflops());
    assert_eq!(num(&json, &["config", "replicas"]), cfg.replicas as f64);
    assert_eq!(num(&json, &["profile", "kernel_s"]), p.kernel_seconds());
    assert_eq!(
        json.get("step").unwrap().get("memory").unwrap().as_array().unwrap().len(),
        cfg.replicas
    );
    assert!(
        num(
            &json.get("step").unwrap().get("memory").unwrap().as_array().unwrap()[0],
            &["peak_bytes"]
        ) > 0.0
    );
    assert_eq!(
        json.get("profile").unwrap().get("by_layer").unwrap().as_array().unwrap().len(),
        p.by_layer.len()
    );
    let in_order = json.get("profile").unwrap().get("in_order").unwrap().as_array().unwrap();
    assert_eq!(in_order.len(), p.kernels.len());
    assert_eq!(in_order[0].get("entry").unwrap().as_str(), Some(p.kernels[0].entry));
    assert_eq!(json.get("adapters").unwrap().as_array().unwrap().len(), cfg.replicas);
    assert!(
        json.get("ratio").is_some()
            && json.get("single").is_some()
            && json.get("roofline").is_some()
    );
}

fn one_device_report_with_profile_and_roofline() {
    needs_adapter();
    let cfg = BenchConfig { roofline: Some(ProbeSize::Cube(64)), ..small(1) };
    let report = bench::run(&cfg, &mut |_| {}).unwrap();
    check_report(&report, &cfg);
    assert!(
        report.single.is_none()
            && report.shard.is_none()
            && report.ratio().is_none()
            && report.exchange_ratio().is_none()
            && report.exchange_wait.is_none()
    );
    let json = serde_json::from_str::<Value>(&report.to_json()).unwrap();
    let nothing_exchanged =
        ["ratio", "shard", "own_steps_s", "own_steps_ratio", "exchange_ratio", "exchange_wait"];
    for key in nothing_exchanged {
        assert_eq!(json.get(key), Some(&Value::Null), "{key}");
    }

    let roof = report.roofline.as_ref().unwrap();
    assert_eq!(roof.tiles.len(), 4);
    let gemms = || roof.tiles.iter().chain([&roof.implicit.probe]);
    assert!(gemms().all(|t| positive(t.gflops()) && t.flops == 2.0 * 64f64.powi(3)));
    assert_eq!(roof.gflops(), gemms().map(|t| t.gflops()).fold(0.0, f64::max));
    assert!(roof.implicit.probe.algo.starts_with("implicit-gemm "), "{:?}", roof.implicit);
    assert!(roof.implicit.dispatch.construction.is_some());
    // Every distinct convolution shape of the step (11 at 32×32) with its three launches, but
    // the stem's has no input-VJP.
    let model = ResNet::new(Arch::ResNet34, cfg.classes).unwrap();
    let shapes: HashSet<_> =
        model.conv_inputs(32, 32).iter().map(|i| conv2d_shape(&i.conv, 2, i.h, i.w)).collect();
    assert_eq!(shapes.len(), 11);
    assert_eq!(roof.convs.len(), 3 * shapes.len() - 1, "{:#?}", roof.convs);
    for c in &roof.convs {
        assert!(positive(c.gflops()), "{c:?}");
        let gemm = c.algo.strip_prefix("winograd-2x2 ").unwrap_or(&c.algo);
        assert!(Conv2dAlgo::parse(gemm).is_some(), "{}", c.algo);
    }
    // layer1's and layer2's 3×3 stride-1 convolutions (8×8 and 4×4 maps) run as Winograd
    // F(2×2, 3×3); F(4×4, 3×3) takes larger maps.
    let winograd = roof.convs.iter().filter(|c| c.algo.starts_with("winograd-2x2 ")).count();
    assert_eq!(winograd, 4, "{:#?}", roof.convs);
    // layer4's 3×3 convolutions on 1×1 maps run their centre tap alone.
    assert!(roof.convs.iter().any(|c| c.kept_taps == Some((1, 1))), "{:#?}", roof.convs);
    let text = report.text(15);
    for needle in [
        "images/s",
        "GFLOP/s",
        "roofline: GEMMs 64³",
        "warps an SM",
        "held",
        "layer · launcher",
        "conv2d_backward_weight",
    ] {
        assert!(text.contains(needle), "{needle} missing from\n{text}");
    }
}

/// A step recorded without running has the profiled step's dispatches, shape for shape, and no
/// times; every convolution launch and the classifier carry FLOPs, the step's in all; the JSON
/// lists every dispatch's shape and the step's figures by construction.
fn recorded_shapes_are_the_profiled_steps_with_their_flops() {
    needs_adapter();
    let cfg = BenchConfig { roofline: None, ..small(1) };
    let report = bench::run(&cfg, &mut |_| {}).unwrap();
    let profiled = report.profile.as_ref().unwrap();
    let recorded = bench::dispatch_shapes(&cfg, &mut |_| {}).unwrap();
    let shapes = |p: &bench::Profile| -> Vec<_> {
        p.kernels.iter().map(|k| (k.scope.clone(), k.entry, k.shape)).collect()
    };
    assert_eq!(shapes(&recorded), shapes(profiled));
    for k in &recorded.kernels {
        assert!(k.seconds == 0.0 && k.shape.workgroups > 0 && k.shape.invocations > 0, "{k:?}");
        assert!(k.shape.bytes > 0, "{k:?}");
    }
    for op in ["conv2d_forward", "conv2d_backward_weight", "dense_forward"] {
        let scopes: HashSet<&str> =
            recorded.kernels.iter().filter(|k| k.op == op).map(|k| k.scope.as_str()).collect();
        let charged: HashSet<&str> = recorded
            .kernels
            .iter()
            .filter(|k| k.op == op && k.shape.flops > 0.0)
            .map(|k| k.scope.as_str())
            .collect();
        assert!(!scopes.is_empty() && scopes == charged, "{op}: {scopes:?} vs {charged:?}");
    }
    // Cropped kernels (layer4's 3×3 on 1×1 maps) are charged the taps they run: less than the
    // nominal step, never more (GEMMs pad K to whole vec4s: the stem's 147 to 148).
    let flops: f64 = recorded.kernels.iter().map(|k| k.shape.flops).sum();
    let nominal = report.step.flops;
    assert!(flops > 0.5 * nominal && flops < 1.01 * nominal, "{flops} vs {nominal}");
    let json = serde_json::from_str::<Value>(&report.to_json()).unwrap();
    let first = &json["profile"]["in_order"][0];
    for key in ["workgroups", "invocations", "flops", "bytes"] {
        assert!(first.get(key).is_some(), "{key} missing from {first}");
    }
    let predicted = |p: &bench::Profile| p.on(&bench::H200).step_seconds();
    let in_json = json["profile"]["predicted"]["H200"]["step_predicted_s"].as_f64().unwrap();
    assert_eq!(in_json, predicted(profiled));
    assert!(predicted(&recorded) > 0.0);
}

fn data_parallel_report_has_the_ratio_to_one_device() {
    needs_adapter();
    // Uneven shards of 3 and 2: two canonical pieces each ([0, 2) [2, 3) | [3, 4) [4, 5)).
    let cfg = BenchConfig { roofline: None, global_batch: Some(5), ..small(2) };
    let report = bench::run(&cfg, &mut |_| {}).unwrap();
    check_report(&report, &cfg);
    let single = report.single.as_ref().expect("R = 2 measures the single device too");
    assert_eq!((single.replicas, single.global_batch, single.seconds.len()), (1, 5, 1));
    assert_eq!(single.flops, report.step.flops);
    assert!(positive(single.median()));
    let ratio = report.ratio().unwrap();
    assert_eq!(ratio, report.step.median() / single.median());
    let json = serde_json::from_str::<Value>(&report.to_json()).unwrap();
    assert_eq!(json.get("ratio").and_then(Value::as_f64), Some(ratio));
    assert_eq!(json.get("roofline"), Some(&Value::Null));
    assert!(report.text(5).contains("data-parallel / single device at batch 5"));
    let allreduce = json.get("allreduce").unwrap();
    let gradient = ResNet::new(Arch::ResNet34, cfg.classes).unwrap().param_len as u64 * 4;
    assert_eq!(allreduce["pieces_per_replica"], serde_json::json!([2, 2]));
    assert_eq!(allreduce["extra_bytes_per_replica"], serde_json::json!([gradient, gradient]));

    // One replica's shard alone: what the replicas' own steps take without the exchange.
    let shard = report.shard.as_ref().expect("R = 2 measures one replica's shard too");
    assert_eq!((shard.replicas, shard.global_batch, shard.seconds.len()), (1, 3, 1));
    assert!((shard.flops / report.step.flops - 3.0 / 5.0).abs() < 1e-12);
    let gpu = gpu();
    assert_eq!(
        report.replicas_take_turns, gpu.blocking_maps,
        "lavapipe's replicas take turns, a GPU's run at once"
    );
    let own = report.own_steps_seconds().unwrap();
    assert_eq!(own, if report.replicas_take_turns { 2.0 * shard.median() } else { shard.median() });
    assert_eq!(report.own_steps_ratio(), Some(own / single.median()));
    assert_eq!(report.exchange_ratio(), Some(report.step.median() / own));
    assert_eq!(json.get("own_steps_s").and_then(Value::as_f64), Some(own));
    assert_eq!(json.get("exchange_ratio").and_then(Value::as_f64), report.exchange_ratio());
    assert_eq!(json.get("replicas_take_turns"), Some(&Value::Bool(report.replicas_take_turns)));
    assert!(report.text(5).contains("data-parallel / the replicas' own steps"));
    // In-process, the replicas are one rank's.
    check_exchange_wait(&report.text(5), &json, 1, cfg.steps);
}

/// Replicas of one image each: the data-parallel step and the single device at the global batch
/// are timed, but one replica's shard alone is not (BatchNorm refuses a batch of one image at
/// 32²), and the report says so instead of failing.
fn shards_of_one_image_are_timed_together_but_not_alone() {
    needs_adapter();
    let cfg = BenchConfig { roofline: None, global_batch: Some(2), ..small(2) };
    let report = bench::run(&cfg, &mut |_| {}).unwrap();
    check_report(&report, &cfg);
    assert_eq!(report.single.as_ref().map(|s| s.global_batch), Some(2));
    assert!(report.shard.is_none() && report.exchange_ratio().is_none());
    let text = report.text(5);
    assert!(text.contains("the replicas' own steps: not timed"), "{text}");
    assert!(text.contains("data-parallel / single device at batch 2"), "{text}");
}

fn bad_settings_are_errors_naming_the_flag() {
    let cases = [
        (BenchConfig { steps: 0, ..BenchConfig::default() }, "--steps"),
        (BenchConfig { batch: 0, ..BenchConfig::default() }, "--batch"),
        (BenchConfig { replicas: 0, ..BenchConfig::default() }, "--replicas"),
        (BenchConfig { warmup: 0, ..BenchConfig::default() }, "--warmup"),
        (BenchConfig { image_size: 16, ..BenchConfig::default() }, "--image-size 16"),
        (
            BenchConfig { roofline: Some(ProbeSize::Cube(30)), ..BenchConfig::default() },
            "--roofline-size",
        ),
    ];
    for (cfg, flag) in cases {
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.starts_with(flag), "{e}");
        assert_eq!(bench::run(&cfg, &mut |_| {}).unwrap_err().to_string(), e);
    }
    assert!(BenchConfig::default().validate().is_ok());
}

fn the_command_line_prints_the_report_and_writes_json() {
    needs_adapter();
    let run = |args: &[&str]| {
        let out = crate::common::command().arg("bench").args(args).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (ok, _, err) = run(&["--steps", "0"]);
    assert!(!ok && err.contains("--steps is 0"), "{err}");
    let (ok, _, err) = run(&["--image-size", "16"]);
    assert!(!ok && err.contains("--image-size 16") && err.contains("too small"), "{err}");
    // --batch is the global batch, and --global-batch its synonym rather than a second setting.
    let (ok, _, err) = run(&["--replicas", "3", "--global-batch", "2"]);
    assert!(
        !ok && err.contains("--batch is 2: each of 3 replicas needs at least 1 image"),
        "{err}"
    );
    let (ok, _, err) = run(&["--batch", "4", "--global-batch", "4"]);
    assert!(!ok && err.contains("cannot be used multiple times"), "{err}");

    let dir = tempfile::Builder::new().prefix("syncstep-bench-").tempdir().unwrap();
    let path = dir.path().join("bench.json");
    let (ok, out, err) =
        run(&["--batch", "2", "--steps", "1", "--no-roofline", "--json", path.to_str().unwrap()]);
    assert!(ok, "{out}{err}");
    assert!(
        out.contains("single device, batch 2") && out.contains("profile: not asked for"),
        "{out}"
    );
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(json
        .get("step")
        .and_then(|s| s.get("median_s"))
        .and_then(Value::as_f64)
        .is_some_and(positive));
    assert_eq!(json.get("profile"), Some(&Value::Null));
}

/// The GPU plan's bars, by construction on an H200 (the program's own figures, recorded and not
/// run, with the plan free of the suite's forced clockless choice): the whole step's speed
/// beside PyTorch CUDA's, the convolutions' predicted share of the f32 peak and their
/// FLOP-weighted occupancy ceiling at 224², batch 32, 32², batch 256 and 224², batch 8; every
/// GEMM that carries more than 1% of the step's FLOPs reads workgroup memory without bank
/// conflicts, and the gather GEMMs among them sum at least 32 outputs an invocation; a 224²,
/// batch-32 step launches at most 440 dispatches, 240 of them convolutions'.
fn the_gpu_plan_by_construction() {
    needs_adapter();
    let dir = tempfile::Builder::new().prefix("syncstep-construction-").tempdir().unwrap();
    let path = dir.path().join("construction.json");
    // (image size, batch, the step's speed beside PyTorch CUDA's, the convolutions' share of
    // the peak and their occupancy ceiling): a little under today's figures
    // (docs/performance.md), so that a change that costs time shows here.
    let bars = [
        ("224", "32", 0.90, 0.48, 0.74),
        ("32", "256", 1.20, 0.31, 0.70),
        ("224", "8", 1.30, 0.37, 0.58),
    ];
    for (size, batch, speed, share, occupancy) in bars {
        let (ok, text) = outcome(
            crate::common::command()
                .env_remove("SYNCSTEP_CONV_ALGO")
                .args(["bench", "--shapes-only", "--plan-for", "gpu", "--image-size", size])
                .args(["--batch", batch, "--json", path.to_str().unwrap()]),
        );
        assert!(ok, "{text}");
        let json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let h200 = &json["profile"]["predicted"]["H200"];
        let conv = &h200["convolutions"];
        let at = format!("{size}², batch {batch}");
        let figure = |key: &str| conv[key].as_f64().unwrap();
        let step = h200["speed_vs_pytorch_cuda"].as_f64().unwrap();
        assert!(step >= speed, "{at}: the step at {step:.3}× PyTorch CUDA's speed\n{text}");
        assert!(figure("predicted_share") >= share, "{at}: {conv}\n{text}");
        assert!(figure("occupancy_ceiling") >= occupancy, "{at}: {conv}\n{text}");
        if (size, batch) == ("224", "32") {
            let all = h200["dispatches"].as_array().unwrap().len();
            assert!(all <= 400 && conv["dispatches"].as_u64().unwrap() <= 180, "{at}: {all}");
        }
        let dispatches = h200["dispatches"].as_array().unwrap();
        let flops: f64 = dispatches.iter().map(|d| d["flops"].as_f64().unwrap()).sum();
        let carrying = dispatches.iter().filter(|d| d["flops"].as_f64().unwrap() > 0.01 * flops);
        for d in carrying.filter(|d| d.get("outputs_per_invocation").is_some()) {
            assert_eq!(d["bank_conflict_degree"].as_f64(), Some(1.0), "{at}: {d}");
            if d["entry"] == "conv2d_implicit_gemm" {
                assert!(d["outputs_per_invocation"].as_u64().unwrap() >= 32, "{at}: {d}");
            }
        }
    }
}

fn the_profiler_times_every_dispatch_across_query_sets() {
    let gpu = fresh_gpu();
    let len = 256u64;
    let a = gpu.upload("a", &uniform(1, len as usize)).unwrap();
    let b = gpu.upload("b", &uniform(2, len as usize)).unwrap();
    let out = gpu.buffer("out", len).unwrap();
    let add = |enc: &mut Encoder| {
        elementwise::add(&gpu, enc, Slice::whole(&a), Slice::whole(&b), Slice::whole(&out)).unwrap()
    };
    // Not profiling: nothing recorded.
    let mut enc = gpu.encoder();
    add(&mut enc);
    pollster::block_on(gpu.submit(enc)).unwrap();
    gpu.start_profile().unwrap();
    // More dispatches than one query set holds (2 queries each, 4096 per set), over two
    // submissions and two scopes.
    let (first, second) = (1500, 1000);
    let start = std::time::Instant::now();
    for (scope, count) in [("first", first), ("second", second)] {
        gpu.profile_scope(scope);
        let mut enc = gpu.encoder();
        (0..count).for_each(|_| add(&mut enc));
        pollster::block_on(gpu.submit(enc)).unwrap();
    }
    gpu.wait().unwrap();
    let wall = start.elapsed().as_secs_f64();
    let times = pollster::block_on(gpu.finish_profile()).unwrap();
    assert_eq!(times.len(), first + second);
    assert!(
        times[..first].iter().all(|t| t.scope == "first")
            && times[first..].iter().all(|t| t.scope == "second")
    );
    assert!(times
        .iter()
        .all(|t| t.op == "add" && t.entry == "add" && t.seconds.is_finite() && t.seconds >= 0.0));
    let sum: f64 = times.iter().map(|t| t.seconds).sum();
    assert!(sum > 0.0 && sum <= wall, "{sum} s of kernels in {wall} s");
    // Finished: the next dispatches are not timed, and a second finish has nothing.
    let mut enc = gpu.encoder();
    add(&mut enc);
    pollster::block_on(gpu.submit(enc)).unwrap();
    assert!(pollster::block_on(gpu.finish_profile()).unwrap().is_empty());
}

fn memory_stats_count_each_submissions_buffers() {
    let gpu = fresh_gpu();
    gpu.reset_memory_stats();
    let big = gpu.buffer("big", 1000).unwrap();
    pollster::block_on(gpu.submit(gpu.encoder())).unwrap();
    let small = gpu.buffer("small", 100).unwrap();
    let small2 = gpu.upload("small2", &[1.0f32; 100]).unwrap();
    let m = gpu.memory_stats();
    assert_eq!(m.created_bytes, 4000 + 400 + 400);
    assert_eq!(m.largest_buffer_bytes, 4000);
    assert_eq!(m.largest_submission_bytes, 4000);
    drop((big, small, small2));
    gpu.reset_memory_stats();
    let _ = gpu.buffer("c", 10).unwrap();
    let _ = gpu.buffer("d", 10).unwrap();
    // Not yet submitted: the open set counts.
    assert_eq!(gpu.memory_stats().largest_submission_bytes, 80);
}

/// Gpu::scratch: one buffer per purpose, kept while it is large enough and replaced by a larger
/// one; so GEMM convolutions recorded into one submission share their im2col chunk rather than
/// each creating one (they were all resident until the submission completed).
fn kernel_scratch_is_one_buffer_per_purpose_reused_by_every_launch() {
    let gpu = fresh_gpu();
    let (slot_a, slot_b) = (ScratchSlot("test a"), ScratchSlot("test b"));
    let a = gpu.scratch(slot_a, 100).unwrap();
    assert_eq!(gpu.scratch(slot_a, 60).unwrap(), a, "a smaller request reuses the buffer");
    let b = gpu.scratch(slot_b, 100).unwrap();
    assert_ne!(a, b, "another purpose has a buffer of its own");
    let bigger = gpu.scratch(slot_a, 200).unwrap();
    assert!(bigger != a && bigger.size() >= 800, "a larger request replaces the buffer");
    assert_eq!(gpu.scratch_bytes(), bigger.size() + b.size());

    let s = syncstep::kernels::conv2d::Conv2dShape {
        n: 2,
        c_in: 16,
        h: 12,
        w: 12,
        c_out: 8,
        kh: 3,
        kw: 3,
        stride: 1,
        pad: 1,
    };
    let gemm = Conv2dAlgo::Gemm(syncstep::kernels::conv2d::GEMM_TILES[0]);
    let (x, w, y) = (
        gpu.upload("x", &uniform(1, s.x_len() as usize)).unwrap(),
        gpu.upload("w", &uniform(2, s.w_len() as usize)).unwrap(),
        gpu.buffer("y", s.y_len()).unwrap(),
    );
    let mut enc = gpu.encoder();
    let launch = |enc: &mut Encoder| {
        syncstep::kernels::conv2d::conv2d_launch_with(
            &gpu,
            enc,
            syncstep::kernels::conv2d::Conv2dOp::Forward,
            gemm,
            &s,
            Slice::whole(&x),
            Slice::whole(&w),
            Slice::whole(&y),
        )
        .unwrap();
        gpu.memory_stats().created_bytes
    };
    gpu.reset_memory_stats();
    let first = launch(&mut enc);
    let second = launch(&mut enc) - first;
    let im2col = s.n as u64
        * s.out_h() as u64
        * s.out_w() as u64
        * (s.c_in * s.kh * s.kw).div_ceil(4) as u64
        * 16;
    assert!(
        first >= im2col,
        "the first launch creates the im2col chunk ({first} bytes created, the chunk is {im2col})"
    );
    assert!(second < im2col, "the second launch creates {second} bytes: its own im2col chunk");
    pollster::block_on(gpu.submit(enc)).unwrap();

    // One-off launches (the autotune's) leave the pool as it was.
    let kept = gpu.scratch_bytes();
    gpu.scratch_as_before(|| {
        assert_ne!(gpu.scratch(slot_a, 10_000).unwrap(), bigger);
        gpu.scratch(ScratchSlot("test c"), 100).unwrap();
        assert!(gpu.scratch_bytes() > kept);
    });
    assert_eq!(gpu.scratch_bytes(), kept, "scratch_as_before kept what its closure created");
    assert_eq!(gpu.scratch(slot_a, 200).unwrap(), bigger, "the buffer from before is back");
}

tests![
    one_device_report_with_profile_and_roofline,
    recorded_shapes_are_the_profiled_steps_with_their_flops,
    data_parallel_report_has_the_ratio_to_one_device,
    shards_of_one_image_are_timed_together_but_not_alone,
    bad_settings_are_errors_naming_the_flag,
    the_command_line_prints_the_report_and_writes_json,
    the_gpu_plan_by_construction,
    the_profiler_times_every_dispatch_across_query_sets,
    memory_stats_count_each_submissions_buffers,
    kernel_scratch_is_one_buffer_per_purpose_reused_by_every_launch,
];
