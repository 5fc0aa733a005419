//! What data parallelism costs: the data-parallel step at R = 2 replicas × 8 images against the
//! single-device step at 16 (same adapter, same run), printed as a ratio (goal ≤ 1.10); and the
//! gradient all-reduce over the flat gradient buffer in GB/s, the plain one (fresh staging each
//! call) and the one the step uses (kept staging, reduced in place), against a plain host
//! memcpy of the same size.
//!
//! `cargo bench --bench parallel`; `SYNCSTEP_ADAPTER` picks the adapter (see `syncstep info`).

use std::cell::RefCell;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use syncstep::canonical::Plan;
use syncstep::collective::{
    all_reduce, bucket_rounds, BucketAllReduce, BucketStaging, Peers, Pieces, ReduceOp,
};
use syncstep::data::synthetic_batch;
use syncstep::environment::Environment;
use syncstep::gpu::{Gpu, Slice};
use syncstep::kernels::conv2d::KernelPlan;
use syncstep::kernels::Device;
use syncstep::model::{Arch, ResNet};
use syncstep::parallel::{DataParallel, ParallelOptions};
use syncstep::step::{OneDevice, Replica, Shard, StepConfig, StepOptions};

const REPLICAS: usize = 2;
const PER_REPLICA: usize = 8;

fn median(times: &RefCell<Vec<Duration>>) -> f64 {
    syncstep::bench::median(&times.borrow().iter().map(Duration::as_secs_f64).collect::<Vec<_>>())
}

/// Runs `step` once per iteration, timing each, so the medians can be compared afterwards.
fn timed<'a>(
    times: &'a RefCell<Vec<Duration>>,
    mut step: impl FnMut() + 'a,
) -> impl FnMut(u64) -> Duration + 'a {
    move |iters| {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            let start = Instant::now();
            step();
            let t = start.elapsed();
            times.borrow_mut().push(t);
            total += t;
        }
        total
    }
}

fn parallel(c: &mut Criterion) {
    let env = match Environment::read(|name| std::env::var_os(name)) {
        Ok(env) => env,
        Err(e) => return eprintln!("parallel benchmarks skipped: {e}"),
    };
    let (choice, config) = (env.adapter(), env.devices(KernelPlan::Auto, false));
    let model = ResNet::new(Arch::ResNet34, 10).expect("model");
    let params = model.init_params(0);
    let running = model.init_buffers();
    let (mut single, mut dp) = match pollster::block_on(async {
        let device = Device::new(Gpu::new(&choice).await?, &config);
        let single =
            Replica::new(device, model.clone(), &params, &running).map_err(|e| e.to_string())?;
        let dp = DataParallel::new(
            &model,
            &params,
            &running,
            REPLICAS,
            std::slice::from_ref(&choice),
            &config,
        )
        .await
        .map_err(|e| e.to_string())?;
        Ok::<_, Box<dyn std::error::Error>>((single, dp))
    }) {
        Ok(pair) => pair,
        Err(e) => return eprintln!("parallel benchmarks skipped: {e}"),
    };
    println!("adapter: {}", syncstep::gpu::describe(&single.gpu.info));
    let batch = synthetic_batch(0, 0, REPLICAS * PER_REPLICA, 32, 32, 10).unwrap();
    let cfg = StepConfig::default();
    let mut single_step = || {
        pollster::block_on(single.forward_backward(
            &batch,
            &cfg,
            Shard::whole(batch.len()),
            &OneDevice,
            StepOptions::default(),
        ))
        .expect("single step");
    };
    let mut dp_step = || {
        pollster::block_on(dp.forward_backward(&batch, &cfg, ParallelOptions::default()))
            .expect("data-parallel step");
    };

    let mut group = c.benchmark_group("step_32px");
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(20));
    let (single_times, dp_times) = (RefCell::new(Vec::new()), RefCell::new(Vec::new()));
    group.bench_function(format!("single_device_batch_{}", REPLICAS * PER_REPLICA), |b| {
        b.iter_custom(timed(&single_times, &mut single_step))
    });
    group.bench_function(format!("data_parallel_{REPLICAS}x{PER_REPLICA}"), |b| {
        b.iter_custom(timed(&dp_times, &mut dp_step))
    });
    group.finish();
    let (ts, td) = (median(&single_times), median(&dp_times));
    println!("\nstep medians: single device {ts:.3} s, data-parallel {td:.3} s: ratio {:.3} (goal ≤ 1.10)\n", td / ts);

    let bytes = model.param_len as u64 * 4;
    let mut group = c.benchmark_group("gradient_all_reduce");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(5))
        .throughput(Throughput::Bytes(bytes));
    let (reduce_times, staged_times, copy_times) =
        (RefCell::new(Vec::new()), RefCell::new(Vec::new()), RefCell::new(Vec::new()));
    let parts: Vec<(&Gpu, Slice)> = dp.replicas().iter().map(|r| (&*r.gpu, r.gradient())).collect();
    let plan = Plan::one_piece_each(REPLICAS);
    group.bench_function(format!("all_reduce_{REPLICAS}_replicas"), |b| {
        b.iter_custom(timed(&reduce_times, || {
            let pieces: Vec<(&Gpu, Vec<Slice>)> =
                parts.iter().map(|&(g, s)| (g, vec![s])).collect();
            pollster::block_on(all_reduce(&pieces, &plan, ReduceOp::Sum, &Peers::InProcess))
                .expect("all-reduce");
            // The writes land at the next submission: wait for them, as a step would.
            parts.iter().for_each(|(gpu, _)| gpu.wait().expect("wait"));
        }))
    });
    let staging: Vec<BucketStaging> = parts.iter().map(|_| BucketStaging::default()).collect();
    group.bench_function(format!("staged_all_reduce_{REPLICAS}_replicas"), |b| {
        b.iter_custom(timed(&staged_times, || {
            // The whole buffer as one bucket: what a step's buckets add up to.
            let rounds = bucket_rounds(plan.clone(), ReduceOp::Sum, REPLICAS, Peers::InProcess);
            let sides = parts.iter().zip(&staging).enumerate().map(|(r, ((gpu, s), staging))| {
                let rounds = &rounds;
                async move {
                    BucketAllReduce::new(r, Pieces::ONE, staging, rounds, 0).finish(gpu, *s).await
                }
            });
            pollster::block_on(futures::future::try_join_all(sides)).expect("staged all-reduce");
            parts.iter().for_each(|(gpu, _)| gpu.wait().expect("wait"));
        }))
    });
    let src = vec![1.0f32; model.param_len];
    let mut dst = vec![0.0f32; model.param_len];
    group.bench_function("host_memcpy", |b| {
        b.iter_custom(timed(&copy_times, || dst.copy_from_slice(std::hint::black_box(&src))))
    });
    group.finish();
    let gbs = |t: f64| bytes as f64 / t / 1e9;
    let (tr, ts, tc) = (median(&reduce_times), median(&staged_times), median(&copy_times));
    println!(
        "\ngradient buffer {:.1} MB over {REPLICAS} replicas: all-reduce {:.2} GB/s, with kept staging {:.2} GB/s, host memcpy {:.2} GB/s\n",
        bytes as f64 / 1e6,
        gbs(tr),
        gbs(ts),
        gbs(tc)
    );
}

criterion_group!(benches, parallel);
criterion_main!(benches);
