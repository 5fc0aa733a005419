//! One kernel on one screen: a device, two uploads, one launch of the residual add, a readback,
//! and the answer held to a plain CPU loop. Every kernel in `syncstep::kernels` is launched the
//! same way: check shapes, record into an `Encoder`, submit.
//!
//!     cargo run --release --example hello_kernel

use syncstep::environment::Environment;
use syncstep::gpu::{Gpu, Slice};
use syncstep::kernels::elementwise;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The adapter `SYNCSTEP_ADAPTER` names, else the best one (a real GPU before a CPU driver).
    let adapter = Environment::read(|name| std::env::var_os(name))?.adapter();
    let gpu = pollster::block_on(Gpu::new(&adapter))?;
    println!("adapter: {}", syncstep::gpu::describe(&gpu.info));

    let a: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    let b: Vec<f32> = (0..1000).map(|i| 1.0 / (i as f32 + 1.0)).collect();
    let a_buf = gpu.upload("a", &a)?;
    let b_buf = gpu.upload("b", &b)?;
    let out = gpu.buffer("out", a.len() as u64)?;

    // Record the launch (shapes are checked here, before anything runs), then submit.
    let mut encoder = gpu.encoder();
    let (a_in, b_in, out_slice) = (Slice::whole(&a_buf), Slice::whole(&b_buf), Slice::whole(&out));
    elementwise::add(&gpu, &mut encoder, a_in, b_in, out_slice)?;
    pollster::block_on(gpu.submit(encoder))?;

    // Read back (an async map: in a browser this is awaited, never blocked on).
    let sum = pollster::block_on(gpu.read_f32(Slice::whole(&out)))?;
    let wrong = sum.iter().zip(a.iter().zip(&b)).filter(|(s, (x, y))| **s != *x + *y).count();
    println!("out[0..4] = {:?}; {wrong} of {} elements differ from the CPU", &sum[..4], sum.len());
    if wrong > 0 {
        return Err("the kernel disagrees with the CPU".into());
    }
    Ok(())
}
