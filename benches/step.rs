//! The full ResNet-34 training step (forward, backward, SGD update) on one device:
//! images/s and GFLOP/s, counting a step as 2.97 × the forward FLOPs (docs/performance.md).

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use syncstep::bench::STEP_FLOPS_PER_FORWARD;
use syncstep::data::synthetic_batch;
use syncstep::environment::Environment;
use syncstep::gpu::{describe, Gpu};
use syncstep::kernels::conv2d::KernelPlan;
use syncstep::kernels::Device;
use syncstep::model::{Arch, ResNet};
use syncstep::step::{OneDevice, Replica, Shard, StepConfig, StepOptions};

fn step_bench(c: &mut Criterion) {
    let env = Environment::read(|name| std::env::var_os(name)).expect("the environment");
    let gpu = pollster::block_on(Gpu::new(&env.adapter())).expect("a GPU adapter");
    let gpu = Device::new(gpu, &env.devices(KernelPlan::Auto, false));
    eprintln!("adapter: {}", describe(&gpu.info));
    let model = ResNet::new(Arch::ResNet34, 10).unwrap();
    let params = model.init_params(0);
    let mut replica = Replica::new(gpu, model.clone(), &params, &model.init_buffers()).unwrap();
    let cfg = StepConfig::default();
    let mut group = c.benchmark_group("resnet34_step");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(20));
    for (n, size) in [(8usize, 32u32), (16, 64)] {
        let batch = synthetic_batch(0, 0, n, size, size, 10).unwrap();
        let flops = STEP_FLOPS_PER_FORWARD * model.forward_flops(size, size) * n as f64;
        let mut one_step = || {
            pollster::block_on(async {
                replica
                    .forward_backward(
                        &batch,
                        &cfg,
                        Shard::whole(n),
                        &OneDevice,
                        StepOptions::default(),
                    )
                    .await
                    .unwrap();
                replica.sgd_update(&cfg).await.unwrap();
            })
        };
        one_step(); // compile pipelines, allocate activations
        let t = Instant::now();
        one_step();
        let s = t.elapsed().as_secs_f64();
        eprintln!(
            "N={n} {size}x{size}: {:.3} s/step, {:.1} images/s, {:.2} GFLOP/s (single timed step)",
            s,
            n as f64 / s,
            flops / s / 1e9
        );
        group.throughput(Throughput::Elements(n as u64));
        group.bench_function(format!("images/N{n}_{size}px"), |b| b.iter(&mut one_step));
    }
    group.finish();
}

criterion_group!(benches, step_bench);
criterion_main!(benches);
