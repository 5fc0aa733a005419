//! Native command-line face: parses arguments and calls into the library. Nothing here
//! computes; every subcommand is a thin wrapper that prints what the library returns.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod check;
mod info;

#[derive(Parser)]
#[command(name = "syncstep", version, about = "Train ResNet-34 with WGSL compute shaders on one or R WebGPU devices, and check that data-parallel equals single-device")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the adapters wgpu sees: backend, type, driver, and the limits and features that matter.
    Info,
    /// Run the equivalence gates: R replicas with synchronised BatchNorm against one device at the global batch.
    Check(check::CheckArgs),
}

pub fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info::run(),
        Command::Check(args) => check::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

