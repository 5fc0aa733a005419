//! `syncstep bench`: the training step's speed on this adapter (see `syncstep::bench`).

use std::path::PathBuf;

use clap::Args;
use syncstep::bench::{self, BenchConfig};

#[derive(Args)]
pub struct BenchArgs {
    /// Data-parallel over this many devices (any R); with R > 1 the single device at the global
    /// batch and at one replica's shard (the replicas' own steps, without the exchange) are
    /// measured too, in the same run, and the ratios printed.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Images per replica N (here --batch is per replica): the global batch is R·N.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// The global batch B instead of R·N, for shards of different sizes: the first B mod R
    /// replicas take one image more. B ≥ R.
    #[arg(long, conflicts_with = "batch")]
    global_batch: Option<usize>,
    /// Side of the square input images, at least 32.
    #[arg(long, default_value_t = 32)]
    image_size: u32,
    /// Timed steps; the median counts.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed steps first (at least 1: the first compiles the pipelines and autotunes).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Adapter: an index from `syncstep info`, a backend (vulkan, gl, …) or both (`vulkan:1`).
    /// Defaults to $SYNCSTEP_ADAPTER, else the first adapter.
    #[arg(long, conflicts_with = "adapters")]
    adapter: Option<String>,
    /// Adapters for the replicas, comma-separated (`0,1`, `vulkan,gl`): replica r on the
    /// (r mod count)-th; the single device on the first.
    #[arg(long, value_delimiter = ',')]
    adapters: Vec<String>,
    /// Time every dispatch of one more step with timestamp queries: a per-layer breakdown.
    #[arg(long)]
    profile: bool,
    /// Rows of the profile's per-layer table to print (all of them go to --json).
    #[arg(long, default_value_t = 15)]
    profile_rows: usize,
    /// Skip the roofline probe (the best matmul, then each convolution of the step).
    #[arg(long)]
    no_roofline: bool,
    /// Size of the roofline probe's square matmul.
    #[arg(long, default_value_t = 512)]
    roofline_size: u32,
    /// Write every figure as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(args: BenchArgs) -> Result<(), Box<dyn std::error::Error>> {
    let cfg = BenchConfig {
        replicas: args.replicas,
        batch: args.batch,
        global_batch: args.global_batch,
        image_size: args.image_size,
        steps: args.steps,
        warmup: args.warmup,
        adapters: super::train::adapter_choices(args.adapter.as_deref(), &args.adapters)?,
        profile: args.profile,
        roofline: (!args.no_roofline).then_some(args.roofline_size),
        ..BenchConfig::default()
    };
    cfg.validate()?;
    if let Some(path) = &args.json {
        // Fail now rather than after minutes of measuring.
        syncstep::files::check_output("--json", path, &[])?;
    }
    let started = std::time::Instant::now();
    let report = bench::run(&cfg, &mut |phase| {
        eprintln!("[{:.1} s] {phase}", started.elapsed().as_secs_f64())
    })?;
    print!("{}", report.text(args.profile_rows));
    if let Some(path) = &args.json {
        syncstep::files::write_atomic(path, report.to_json().as_bytes())?;
        println!("figures written to {}", path.display());
    }
    Ok(())
}
