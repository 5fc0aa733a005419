//! Kernel throughput in FLOP/s: criterion's "elements/s" is FLOP/s here, since each benchmark's
//! throughput is its FLOP count (a multiply-add counting 2). Each iteration records one launch,
//! submits it and waits for the device to finish.
//!
//! `matmul_gflops` is the roofline probe: the plain f32 GEMM at 512³ and 1024³, each tile; the
//! best of them is what the adapter does on a GEMM, and each convolution's figure reads as a
//! fraction of it. `conv2d_gflops` times ResNet-34's convolutions with `blocked` (the register
//! tiles of the first version) and `auto` (what the plain launchers run on this adapter: the
//! autotune's pick, printed, or SYNCSTEP_CONV_ALGO, on the kept taps where some read only
//! padding). A variant the adapter refuses (llvmpipe's loop limit) is named and skipped.
//!
//! `cargo bench --bench kernels`; `SYNCSTEP_ADAPTER` picks the adapter (see `syncstep info`);
//! `eval "$(scripts/mesa25.sh)"` first for Mesa 25's lavapipe.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use syncstep::environment::Environment;
use syncstep::gpu::{Encoder, Gpu, Slice};
use syncstep::kernels::conv2d::KernelPlan;
use syncstep::kernels::conv2d::{self as k, Conv2dAlgo, Conv2dOp, Conv2dShape};
use syncstep::kernels::matmul::{self as mm, MatmulAlgo, MatmulShape, MATMUL_TILES};
use syncstep::kernels::Device;

fn device() -> Option<Device> {
    let env = match Environment::read(|name| std::env::var_os(name)) {
        Ok(env) => env,
        Err(e) => {
            eprintln!("kernel benchmarks skipped: {e}");
            return None;
        }
    };
    match pollster::block_on(Gpu::new(&env.adapter())) {
        Ok(gpu) => {
            println!("adapter: {}", syncstep::gpu::describe(&gpu.info));
            Some(Device::new(gpu, &env.devices(KernelPlan::Auto, false)))
        }
        Err(e) => {
            eprintln!("kernel benchmarks skipped: {e}");
            None
        }
    }
}

/// Records `launch`, submits it and waits.
fn time_launch(gpu: &Gpu, launch: impl Fn(&mut Encoder)) {
    let mut enc = gpu.encoder();
    launch(&mut enc);
    pollster::block_on(gpu.submit(enc)).expect("submit");
    gpu.wait().expect("wait");
}

fn matmul(c: &mut Criterion) {
    let Some(gpu) = device() else { return };
    let mut group = c.benchmark_group("matmul_gflops");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    for size in [512, 1024] {
        let s = MatmulShape { m: size, k: size, n: size };
        let buffer = |label, len: u32| {
            gpu.upload(label, &vec![0.5f32; len as usize * len as usize]).expect("buffer")
        };
        let (a, b, out) = (buffer("a", size), buffer("b", size), buffer("c", size));
        group.throughput(Throughput::Elements(s.flops()));
        // The simple kernel takes seconds at 1024³; 512³ shows what the tiles gain.
        let algos = MATMUL_TILES.into_iter().chain((size == 512).then_some(MatmulAlgo::Simple));
        for algo in algos {
            let name = match algo {
                MatmulAlgo::Simple => "simple".to_string(),
                MatmulAlgo::Tiled { rows, cols } => format!("tiled_{rows}x{cols}"),
            };
            group.bench_function(BenchmarkId::new(name, format!("{size}^3")), |bench| {
                bench.iter(|| {
                    time_launch(&gpu, |enc| {
                        mm::matmul(
                            &gpu,
                            enc,
                            algo,
                            &s,
                            Slice::whole(&a),
                            Slice::whole(&b),
                            Slice::whole(&out),
                        )
                        .expect("launch")
                    })
                })
            });
        }
    }
    group.finish();
}

/// ResNet-34 convolutions at batch 8 for a 32×32 network input.
fn resnet34_convs() -> [(&'static str, Conv2dShape); 7] {
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
        ("layer3_256to256_3x3s1_2px", conv(256, 2, 256, 3, 1, 1)),
        ("layer4_512to512_3x3s1_1px", conv(512, 1, 512, 3, 1, 1)),
        ("layer3_proj_128to256_1x1s2_4px", conv(128, 4, 256, 1, 2, 0)),
    ]
}

/// One recorded convolution launch.
type Launch<'a> = dyn Fn(&mut Encoder) -> syncstep::kernels::Result<()> + 'a;

fn conv2d(c: &mut Criterion) {
    let Some(gpu) = device() else { return };
    let mut group = c.benchmark_group("conv2d_gflops");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for (layer, s) in resnet34_convs() {
        let buffer =
            |label, len: u64| gpu.upload(label, &vec![0.5f32; len as usize]).expect("buffer");
        group.throughput(Throughput::Elements(s.flops()));
        for op in [Conv2dOp::Forward, Conv2dOp::BackwardInput, Conv2dOp::BackwardWeight] {
            let name = op.name().trim_start_matches("conv2d_");
            let [a, b, out] = s.operand_lens(op).map(|len| buffer(name, len));
            let (a, b, out) = (Slice::whole(&a), Slice::whole(&b), Slice::whole(&out));
            let (chosen, crop) = k::conv2d_choice(&gpu, op, &s).expect("choice");
            let kept = crop.map_or(String::new(), |c| {
                format!(" on the kept {}x{} taps", c.shape.kh, c.shape.kw)
            });
            println!("{name} {layer}: auto = {chosen}{kept}");
            // `blocked` on the whole kernel; `auto` as the step runs it (the plain launcher).
            let blocked = |enc: &mut Encoder| {
                k::conv2d_launch_with(&gpu, enc, op, Conv2dAlgo::Blocked, &s, a, b, out)
            };
            let auto = |enc: &mut Encoder| k::conv2d_launch(&gpu, enc, op, &s, a, b, out);
            let runs: [(&str, &Launch); 2] = [("blocked", &blocked), ("auto", &auto)];
            for (label, launch) in runs {
                if label == "auto" && chosen == Conv2dAlgo::Blocked && crop.is_none() {
                    continue; // the same as `blocked`
                }
                if let Err(e) = launch(&mut gpu.encoder()) {
                    println!("{name}/{label} {layer}: not run ({e})");
                    continue;
                }
                group.bench_function(BenchmarkId::new(format!("{name}/{label}"), layer), |bench| {
                    bench.iter(|| time_launch(&gpu, |enc| launch(enc).expect("launch")))
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, matmul, conv2d);
criterion_main!(benches);
