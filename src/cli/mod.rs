//! Native command-line face: parses arguments and calls into the library. Nothing here
//! computes; every subcommand is a thin wrapper that prints what the library returns.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod check;
mod grad;
mod info;
mod train;

#[derive(Parser)]
#[command(
    name = "syncstep",
    version,
    about = "Train ResNet-34 with WGSL compute shaders on one or R WebGPU devices, and check that data-parallel equals single-device"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the adapters wgpu sees: backend, type, driver, and the limits and features that matter.
    Info,
    /// Train ResNet-34 on the embedded synthetic dataset (runs in minutes on a CPU's lavapipe).
    Train(train::TrainArgs),
    /// One step's loss, logits, gradients and BN statistics for given weights and batch.
    Grad(grad::GradArgs),
    /// Run the equivalence gates: R replicas with synchronised BatchNorm against one device at the global batch.
    Check(check::CheckArgs),
    /// Benchmark the training step on this adapter: images/s, GFLOP/s, memory, a roofline probe and (--profile) a per-layer breakdown.
    Bench(bench::BenchArgs),
}

pub fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info::run(),
        Command::Train(a) => train::run(a),
        Command::Grad(a) => grad::run(a),
        Command::Check(a) => check::run(a),
        Command::Bench(a) => bench::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
