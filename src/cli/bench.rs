//! `syncstep bench`: the training step's speed on this adapter (see `syncstep::bench`).

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use syncstep::bench::{self, BenchConfig, ProbeSize};
use syncstep::files::Kind;
use syncstep::kernels::conv2d::KernelPlan;
use syncstep::model::Arch;

/// bench's figures (`--json`), told by their `config.plan_for`.
const FIGURES: Kind = Kind {
    what: "syncstep bench's figures (a bench --json file)",
    ours: |path| super::report_with(path, &["/config/plan_for"]),
};

/// Rows the profile's per-layer table prints unless `--profile-rows` says.
const PROFILE_ROWS: usize = 15;

#[derive(Clone, Copy, ValueEnum)]
enum PlanFor {
    Auto,
    Gpu,
    Timed,
}

#[derive(Args)]
pub struct BenchArgs {
    /// The network: torchvision's resnet18, resnet34, resnet50 or resnet101.
    #[arg(long, default_value_t = Arch::default())]
    arch: Arch,
    /// Data-parallel over this many devices (any R); with R > 1 the single device at the global
    /// batch and at one replica's shard (the replicas' own steps, without the exchange) are
    /// measured too, in the same run, and the ratios printed.
    #[arg(long, default_value_t = 1, conflicts_with = "mpi", allow_negative_numbers = true, value_parser = crate::cli::at_most::<1024>)]
    replicas: usize,
    /// The global batch B, over all replicas (with --mpi, all ranks' replicas). The replicas'
    /// shards are derived: B/R images each, the first B mod R one image more. B ≥ R.
    #[arg(long, visible_alias = "global-batch", default_value_t = 8, allow_negative_numbers = true, value_parser = crate::cli::whole::<usize>)]
    batch: usize,
    /// Side of the square input images, at least 32.
    #[arg(long, default_value_t = 32, allow_negative_numbers = true, value_parser = crate::cli::whole::<u32>)]
    image_size: u32,
    /// Timed steps (at most 10000); the median counts.
    #[arg(long, default_value_t = 5, allow_negative_numbers = true, value_parser = crate::cli::at_most::<10000>)]
    steps: usize,
    /// Untimed steps first (at least 1: the first compiles the pipelines and autotunes; at most
    /// 1000).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = crate::cli::at_most::<1000>)]
    warmup: usize,
    /// Adapter: an index from `syncstep info`, a backend (vulkan, gl, …) or both (`vulkan:1`).
    /// Defaults to $SYNCSTEP_ADAPTER, else the first adapter.
    #[arg(long, conflicts_with = "adapters", allow_hyphen_values = true, value_parser = crate::cli::adapter)]
    adapter: Option<String>,
    /// Adapters for the replicas, comma-separated (`0,1`, `vulkan,gl`): replica r on the
    /// (r mod count)-th; the single device on the first.
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true, value_parser = crate::cli::adapter)]
    adapters: Vec<String>,
    /// Time every dispatch of one more step with timestamp queries: a per-layer breakdown.
    #[arg(long)]
    profile: bool,
    /// Rows of the profile's per-layer table to print (all of them go to --json), with
    /// --profile [default: 15].
    #[arg(long, allow_negative_numbers = true, value_parser = crate::cli::whole::<usize>)]
    profile_rows: Option<usize>,
    /// Skip the roofline probe (the implicit-GEMM kernel and the matmul at size³, then each
    /// convolution of the step).
    #[arg(long)]
    no_roofline: bool,
    /// Size of the roofline probe's square GEMMs (m = k = n) [default: 4096 on a GPU adapter,
    /// 512 on a CPU adapter].
    #[arg(long, conflicts_with = "no_roofline", allow_negative_numbers = true, value_parser = crate::cli::whole::<u32>)]
    roofline_size: Option<u32>,
    /// Write every figure as JSON to this file (with --profile or --shapes-only: every
    /// dispatch's workgroups, invocations, FLOPs and bytes, and each convolution's construction
    /// and predicted time on an H100 and an H200).
    #[arg(long)]
    json: Option<PathBuf>,
    /// How convolution kernels are chosen. `gpu`: what a GPU runs, chosen without a clock from
    /// the shapes alone (the implicit-GEMM family's tile, split and node depth that an H200's
    /// model gives the least time, launch gaps included), so a CPU adapter shows a GPU's
    /// figures; `timed`: the
    /// fastest candidate timed on this adapter; `auto`: `gpu` on GPU adapters, `timed` on CPU
    /// adapters. Every choice gives the same bits.
    #[arg(long, value_enum, default_value_t = PlanFor::Auto)]
    plan_for: PlanFor,
    /// Record one step's dispatches without running them, and print how wide they are (their
    /// workgroups, invocations, FLOPs and bytes go to --json): the shape of a step too large to
    /// run on this adapter, e.g. `--plan-for gpu --image-size 224 --batch 32` on a CPU.
    #[arg(long, conflicts_with_all = ["mpi", "replicas", "profile", "steps", "warmup", "no_roofline", "roofline_size", "bucket_mb"])]
    shapes_only: bool,
    #[command(flatten)]
    overwrite: super::Overwrite,
    #[command(flatten)]
    buckets: super::ranks::BucketArgs,
    #[command(flatten)]
    tune: super::ranks::TuneArgs,
    #[command(flatten)]
    ranks: super::ranks::MpiArgs,
}

pub fn run(args: BenchArgs) -> Result<(), Box<dyn std::error::Error>> {
    if args.profile_rows.is_some() && !args.profile {
        return Err("--profile-rows sets the rows of --profile's table: add --profile, or drop --profile-rows".into());
    }
    let overwrite = args.overwrite.check(args.json.is_some(), "--json")?;
    let peers = super::ranks::peers(&args.ranks)?;
    let lead = peers.rank() == 0;
    let local = if args.ranks.mpi { args.ranks.local_replicas as usize } else { args.replicas };
    let global_replicas = local * peers.ranks();
    let cfg = BenchConfig {
        arch: args.arch,
        replicas: local,
        // R = 0 is refused by `cfg.validate()`.
        batch: args.batch / global_replicas.max(1),
        global_batch: Some(args.batch),
        image_size: args.image_size,
        steps: args.steps,
        warmup: args.warmup,
        adapters: super::ranks::adapter_choices(
            &peers,
            args.adapter.as_deref(),
            &args.adapters,
            local,
        )?,
        profile: args.profile,
        roofline: (!args.no_roofline)
            .then_some(args.roofline_size.map_or(ProbeSize::ForAdapter, ProbeSize::Cube)),
        device: super::env::get().devices(
            match args.plan_for {
                PlanFor::Auto => KernelPlan::Auto,
                PlanFor::Gpu => KernelPlan::Gpu,
                PlanFor::Timed => KernelPlan::Timed,
            },
            args.tune.retune,
        ),
        lp_num_threads: super::env::get().lp_num_threads.clone(),
        bucket_bytes: args.buckets.bytes(global_replicas)?,
        ..BenchConfig::default()
    };
    cfg.validate()?;
    if args.shapes_only {
        return shapes_only(&cfg, args.json.as_deref(), overwrite);
    }
    super::ranks::agree(&peers, "the settings", &shared_settings(&cfg, &args))?;
    let json = args.json.as_ref().filter(|_| lead);
    // Fail now rather than after minutes of measuring.
    let _claim = json
        .map(|path| syncstep::files::check_output("--json", path, &[], FIGURES, overwrite))
        .transpose()?;
    let started = std::time::Instant::now();
    let report = bench::run_with_peers(&cfg, &peers, &mut |phase| {
        if lead {
            say_err!("[{:.1} s] {phase}", started.elapsed().as_secs_f64())
        }
    })?;
    if !lead {
        return Ok(());
    }
    say_text!("{}", report.text(args.profile_rows.unwrap_or(PROFILE_ROWS)));
    if let Some(path) = json {
        syncstep::files::write_atomic(path, super::sealed(&report.to_json()).as_bytes())?;
        say!("figures written to {}", path.display());
    }
    Ok(())
}

/// `bench --shapes-only`: one step recorded, not run; its figures on an H200 printed and
/// (--json) every dispatch's on an H100 and an H200 written.
fn shapes_only(
    cfg: &BenchConfig,
    json: Option<&Path>,
    overwrite: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let _claim = json
        .map(|path| syncstep::files::check_output("--json", path, &[], FIGURES, overwrite))
        .transpose()?;
    let profile = bench::dispatch_shapes(cfg, &mut |phase| say_err!("{phase}"))?;
    say!(
        "syncstep bench --shapes-only: one {} training step at batch {}, {}×{} images, recorded and not run: {} dispatches",
        cfg.arch.title(),
        cfg.global(),
        cfg.image_size,
        cfg.image_size,
        profile.kernels.len()
    );
    profile.on(&bench::H200).text().iter().for_each(|l| say!("{l}"));
    if let Some(path) = json {
        let report = serde_json::json!({
            "config": {"arch": cfg.arch.name(), "batch": cfg.global(), "image_size": cfg.image_size, "classes": cfg.classes,
                       "plan_for": cfg.device.policy.plan.name()},
            "profile": profile.to_json(),
        });
        syncstep::files::write_atomic(path, super::sealed(&report.to_string()).as_bytes())?;
        say!("figures written to {}", path.display());
    }
    Ok(())
}

/// What every rank of `bench --mpi` must run alike, as bytes to agree on: the settings, not the
/// adapters, folders and threads each rank has of its own.
fn shared_settings(cfg: &BenchConfig, args: &BenchArgs) -> Vec<u8> {
    #[derive(serde::Serialize)]
    struct Shared<'a> {
        arch: &'a str,
        replicas: usize,
        batch: usize,
        global_batch: Option<usize>,
        image_size: u32,
        classes: u32,
        steps: usize,
        warmup: usize,
        profile: bool,
        roofline: Option<String>,
        plan_for: &'a str,
        retune: bool,
        forced: Option<String>,
        winograd: Option<bool>,
        bucket_bytes: u64,
        seed: u64,
    }
    let policy = &cfg.device.policy;
    let shared = Shared {
        arch: cfg.arch.name(),
        replicas: cfg.replicas,
        batch: cfg.batch,
        global_batch: cfg.global_batch,
        image_size: cfg.image_size,
        classes: cfg.classes,
        steps: cfg.steps,
        warmup: cfg.warmup,
        profile: cfg.profile,
        roofline: cfg.roofline.map(|r| format!("{r:?}")),
        plan_for: policy.plan.name(),
        retune: args.tune.retune,
        forced: policy.forced.map(|f| format!("{f:?}")),
        winograd: policy.winograd,
        bucket_bytes: cfg.bucket_bytes,
        seed: cfg.seed,
    };
    serde_json::to_vec(&shared).expect("the settings serialise")
}
