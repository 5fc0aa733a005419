//! The training step through the library: ResNet-34 on one device, then the same step
//! data-parallel on three devices with synchronised BatchNorm (shards of 3, 3 and 2 images), and
//! the program's headline checked here in a few lines: the replicas' gradient of the shards is,
//! bit for bit, the single device's gradient of the whole batch.
//!
//!     cargo run --release --example train_step

use syncstep::data::synthetic_batch;
use syncstep::environment::Environment;
use syncstep::gpu::Gpu;
use syncstep::kernels::conv2d::KernelPlan;
use syncstep::kernels::Device;
use syncstep::model::{Arch, ResNet};
use syncstep::parallel::{DataParallel, ParallelOptions};
use syncstep::step::{OneDevice, Replica, Shard, StepConfig, StepOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The adapter and kernel choices the environment names (`SYNCSTEP_ADAPTER`, …), as the
    // command line reads them.
    let env = Environment::read(|name| std::env::var_os(name))?;
    let (choice, config) = (env.adapter(), env.devices(KernelPlan::Auto, false));
    let model = ResNet::new(Arch::ResNet34, 10)?;
    let (params, running) = (model.init_params(0), model.init_buffers());
    let cfg = StepConfig::default();
    // 8 images of 32×32 from the embedded synthetic dataset (seed 0, from example 0).
    let batch = synthetic_batch(0, 0, 8, 32, 32, model.classes)?;

    // One device: forward, loss (divided by the batch size), backward, then SGD.
    let gpu = Device::new(pollster::block_on(Gpu::new(&choice))?, &config);
    let mut single = Replica::new(gpu, model.clone(), &params, &running)?;
    let whole = Shard::whole(batch.len());
    let opts = StepOptions::default();
    let out = pollster::block_on(single.forward_backward(&batch, &cfg, whole, &OneDevice, opts))?;
    let single_grads = pollster::block_on(single.read_grads())?;
    pollster::block_on(single.sgd_update(&cfg))?;
    println!("single device, batch {}: loss {:.6}", batch.len(), out.loss);

    // Three devices, each taking a contiguous shard of the same batch.
    let mut dp =
        pollster::block_on(DataParallel::new(&model, &params, &running, 3, &[choice], &config))?;
    let outs = pollster::block_on(dp.forward_backward(&batch, &cfg, ParallelOptions::default()))?;
    let grads = pollster::block_on(dp.read_grads())?;
    let differing = grads[0].iter().zip(&single_grads).filter(|(a, b)| a.to_bits() != b.to_bits());
    let differing = differing.count();
    println!(
        "data-parallel, 3 replicas: loss {:.6}; {differing} of {} gradient values differ from \
         the single device's",
        outs[0].loss,
        single_grads.len()
    );
    if differing > 0 || grads.iter().any(|g| *g != grads[0]) || outs[0].loss != out.loss {
        return Err("the data-parallel gradient is not the single device's".into());
    }
    Ok(())
}
