//! Kernel throughput in FLOP/s: criterion's "elements/s" is FLOP/s here, since each benchmark's
//! throughput is its FLOP count (a multiply-add counting 2). Each iteration records one launch,
//! submits it and waits for the device to finish.
//!
//! `cargo bench --bench kernels`; `SYNCSTEP_ADAPTER` picks the adapter (see `syncstep info`).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use syncstep::gpu::{AdapterChoice, Gpu, Slice};
use syncstep::kernels::conv2d::{self as k, Conv2dAlgo, Conv2dShape};

/// ResNet-34 convolutions at batch 8 for a 32×32 network input.
fn resnet34_convs() -> [(&'static str, Conv2dShape); 4] {
    let conv = |c_in, hw, c_out, kernel, stride, pad| Conv2dShape {
        n: 8,
        c_in,
        h: hw,
        w: hw,
        c_out,
        kh: kernel,
        kw: kernel,
        stride,
        pad,
    };
    [
        ("stem_3to64_7x7s2_32px", conv(3, 32, 64, 7, 2, 3)),
        ("layer1_64to64_3x3s1_8px", conv(64, 8, 64, 3, 1, 1)),
        ("layer2_128to128_3x3s1_4px", conv(128, 4, 128, 3, 1, 1)),
        ("layer3_128to256_3x3s2_4px", conv(128, 4, 256, 3, 2, 1)),
    ]
}

type Launch = fn(&Gpu, &mut wgpu::CommandEncoder, Conv2dAlgo, &Conv2dShape, Slice, Slice, Slice) -> syncstep::kernels::Result<()>;

fn conv2d(c: &mut Criterion) {
    let gpu = match AdapterChoice::from_env().and_then(|choice| pollster::block_on(Gpu::new(&choice))) {
        Ok(gpu) => gpu,
        Err(e) => {
            eprintln!("conv2d benchmarks skipped: {e}");
            return;
        }
    };
    println!("adapter: {}", syncstep::gpu::describe(&gpu.info));
    let mut group = c.benchmark_group("conv2d_gflops");
    group.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
    for (layer, s) in resnet34_convs() {
        let buffer = |label, len: u64| gpu.upload(label, &vec![0.5f32; len as usize]).expect("buffer");
        let (x, dx) = (buffer("x", s.x_len()), buffer("dx", s.x_len()));
        let (w, dw) = (buffer("w", s.w_len()), buffer("dw", s.w_len()));
        let (y, dy) = (buffer("y", s.y_len()), buffer("dy", s.y_len()));
        let whole = Slice::whole;
        let ops: [(&str, Launch, [Slice; 3]); 3] = [
            ("forward", k::conv2d_forward_with, [whole(&x), whole(&w), whole(&y)]),
            ("backward_input", k::conv2d_backward_input_with, [whole(&dy), whole(&w), whole(&dx)]),
            ("backward_weight", k::conv2d_backward_weight_with, [whole(&dy), whole(&x), whole(&dw)]),
        ];
        group.throughput(Throughput::Elements(s.flops()));
        for (op, launch, [a, b, out]) in ops {
            for algo in [Conv2dAlgo::Blocked, Conv2dAlgo::Direct] {
                let id = BenchmarkId::new(format!("{op}/{algo:?}"), layer);
                group.bench_function(id, |bench| {
                    bench.iter(|| {
                        let mut enc = gpu.encoder();
                        launch(&gpu, &mut enc, algo, &s, a, b, out).expect("launch");
                        pollster::block_on(gpu.submit(enc)).expect("submit");
                        gpu.wait().expect("wait");
                    })
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, conv2d);
criterion_main!(benches);
