//! `syncstep check`: the equivalence gates (docs/design.md) as a table, optionally as JSON; the
//! PORTABLE gate's golden file out (`--golden`) or in (`--against`); the exit status is
//! non-zero when any gate fails.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use syncstep::check::{run_check_on, CheckConfig, CheckDevices, CheckProgress, CheckReport};
use syncstep::files::Kind;
use syncstep::golden::Golden;
use syncstep::gpu::{AdapterChoice, Gpu};
use syncstep::kernels::Device;
use syncstep::model::{Arch, ResNet};
use syncstep::parallel::ParallelError;
use syncstep::parallel::Sabotage;

/// check's figures (`--json`), told by their `check` and `global_batch`.
const FIGURES: Kind = Kind {
    what: "syncstep check's figures (a check --json file)",
    ours: |path| super::report_with(path, &["/check", "/global_batch"]),
};

/// A golden file (`--golden`), told by its `golden`, `format` and `tensors` (its settings are
/// top-level fields).
const GOLDEN: Kind = Kind {
    what: "a syncstep golden file (a check --golden file)",
    ours: |path| super::json_with(path, &["/golden", "/format", "/tensors"]),
};

#[derive(Args)]
pub struct CheckArgs {
    /// The network: torchvision's resnet18, resnet34, resnet50 or resnet101.
    #[arg(long, default_value_t = Arch::default())]
    arch: Arch,
    /// Number of replicas R (devices), each running a shard of the global batch: any R from 1.
    #[arg(long, default_value_t = 2, conflicts_with = "mpi", allow_negative_numbers = true, value_parser = crate::cli::at_most::<1024>)]
    replicas: usize,
    /// The global batch B, over all replicas; the single device runs all of it. The replicas'
    /// shards are derived: B/R images each, the first B mod R one image more. B ≥ R.
    #[arg(long, visible_alias = "global-batch", default_value_t = 16, allow_negative_numbers = true, value_parser = crate::cli::whole::<usize>)]
    batch: usize,
    /// Image side in pixels (at least 32).
    #[arg(long, default_value_t = 32, allow_negative_numbers = true, value_parser = crate::cli::whole::<u32>)]
    image_size: u32,
    /// Number of classes K.
    #[arg(long, default_value_t = 10, allow_negative_numbers = true, value_parser = crate::cli::classes)]
    classes: u32,
    /// SGD steps of the DRIFT gate (0 skips it; at most 1000).
    #[arg(long, default_value_t = 5, allow_negative_numbers = true, value_parser = crate::cli::at_most::<1000>)]
    steps: usize,
    /// Seed of the weights and the synthetic data.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = crate::cli::whole::<u64>)]
    seed: u64,
    /// Adapters for the replicas, comma-separated (`0,1`, `vulkan,gl`, `vulkan:0`): replica r
    /// runs on the (r mod count)-th; the single device on the first. Default: SYNCSTEP_ADAPTER
    /// or the first adapter `syncstep info` lists.
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true, value_parser = crate::cli::adapter)]
    adapters: Vec<String>,
    /// Also hold the single device against the f64 reference (TIE).
    #[arg(long)]
    tie: bool,
    /// Write the figures as JSON to this file (every gate, and each parameter tensor's errors).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the PORTABLE gate's golden file: the single-device step at the global batch (loss,
    /// per-tensor gradient norms and samples) and the activation pattern it ran on. The web
    /// page reads it as web/golden.json.
    #[arg(long)]
    golden: Option<PathBuf>,
    /// Run the PORTABLE gate against a golden file another build or adapter wrote with the same
    /// settings (--golden).
    #[arg(long)]
    against: Option<PathBuf>,
    /// Break the equivalence on purpose, to see the TEST gate fail.
    #[arg(long, value_enum, hide = true)]
    sabotage: Option<SabotageArg>,
    #[command(flatten)]
    overwrite: super::Overwrite,
    #[command(flatten)]
    buckets: super::ranks::BucketArgs,
    #[command(flatten)]
    tune: super::ranks::TuneArgs,
    #[command(flatten)]
    ranks: super::ranks::MpiArgs,
}

#[derive(Clone, Copy, ValueEnum)]
enum SabotageArg {
    LocalDivisor,
    UnmergedStats,
}

pub fn run(args: CheckArgs) -> Result<(), Box<dyn std::error::Error>> {
    let size = args.image_size;
    ResNet::check_image_size(size, size).map_err(|e| format!("--image-size {size}: {e}"))?;
    let outputs = args.json.is_some() || args.golden.is_some();
    let overwrite = args.overwrite.check(outputs, "--json, --golden")?;
    let peers = super::ranks::peers(&args.ranks)?;
    let lead = peers.rank() == 0;
    let local = if args.ranks.mpi { args.ranks.local_replicas as usize } else { args.replicas };
    // This process's replicas' adapters; the single device on the first.
    let adapters = super::ranks::adapter_choices(&peers, None, &args.adapters, local)?;
    let replicas = local * peers.ranks();
    let cfg = config(&args, replicas, adapters, args.buckets.bytes(replicas)?);
    super::ranks::agree(&peers, "the settings", &serde_json::to_vec(&cfg)?)?;
    // Outputs (rank 0's) are checked before any work; neither may be the golden read for
    // PORTABLE.
    let inputs: Vec<&std::path::Path> = args.against.iter().map(PathBuf::as_path).collect();
    let (json, golden_out) =
        (args.json.as_ref().filter(|_| lead), args.golden.as_ref().filter(|_| lead));
    let mut claims = Vec::new();
    for (flag, path, kind) in [("--json", json, FIGURES), ("--golden", golden_out, GOLDEN)] {
        if let Some(path) = path {
            claims.push(syncstep::files::check_output(flag, path, &inputs, kind, overwrite)?);
        }
    }
    let golden = args.against.as_deref().map(read_golden).transpose()?;
    cfg.model()?;
    // The single device shares the replicas' choices: timed once (and once with --retune).
    let config = args.tune.devices();
    let started = std::time::Instant::now();
    let report = pollster::block_on(async {
        let replicas = syncstep::parallel::devices(local, &cfg.adapters, &config).await?;
        let single = Gpu::new(&cfg.adapters[0]).await.map_err(ParallelError::from)?;
        let single = Device::new(single, &config);
        let devices = CheckDevices { replicas, single, peers };
        run_check_on(&cfg, devices, golden.as_ref(), &mut |p| {
            if lead {
                print_phase(started.elapsed().as_secs_f64(), p);
            }
        })
        .await
    })?;
    if !lead {
        return Ok(());
    }
    say_text!("{}", report.table());
    write_outputs(&report, json, golden_out)
}

/// The check the flags ask for, over `replicas` replicas in all, on `adapters`.
fn config(
    args: &CheckArgs,
    replicas: usize,
    adapters: Vec<AdapterChoice>,
    bucket_bytes: u64,
) -> CheckConfig {
    CheckConfig {
        arch: args.arch,
        replicas,
        // R = 0 is refused by `cfg.model()`.
        batch: args.batch / replicas.max(1),
        global_batch: Some(args.batch),
        image_size: args.image_size,
        classes: args.classes,
        steps: args.steps,
        seed: args.seed,
        adapters,
        tie: args.tie,
        sabotage: args.sabotage.map(|s| match s {
            SabotageArg::LocalDivisor => Sabotage::LocalDivisor,
            SabotageArg::UnmergedStats => Sabotage::UnmergedStats,
        }),
        bucket_bytes,
    }
}

/// The golden file at `path` (`--against`).
fn read_golden(path: &Path) -> Result<Golden, String> {
    let bytes = syncstep::files::read_input(path)
        .map_err(|e| format!("reading {}: {e}", path.display()))?;
    let text = String::from_utf8_lossy(&bytes);
    Golden::from_json(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// A phase that starts, `at` seconds into the check (or the end, with the verdict).
fn print_phase(at: f64, p: &CheckProgress) {
    if p.index < p.total {
        say_err!("[{}/{} at {at:.1} s] {}", p.index + 1, p.total, p.phase);
    } else {
        say_err!("[{at:.1} s] {}", p.phase);
    }
}

/// Writes the figures (`--json`) and, when every gate passed, the golden (`--golden`); an
/// error naming the gates that failed.
fn write_outputs(
    report: &CheckReport,
    json: Option<&PathBuf>,
    golden: Option<&PathBuf>,
) -> Result<(), Box<dyn std::error::Error>> {
    let write = |path: &PathBuf, text: String, what: &str| -> Result<(), String> {
        syncstep::files::write_atomic(path, text.as_bytes()).map_err(|e| e.to_string())?;
        say!("{what} written to {}", path.display());
        Ok(())
    };
    if let Some(path) = json {
        write(path, super::sealed(&report.to_json()), "figures")?;
    }
    let failed: Vec<&str> = report.rows.iter().filter(|r| !r.pass).map(|r| r.gate.name()).collect();
    // A golden is what another build is held to: only a passing run writes one.
    if let Some(path) = golden {
        if failed.is_empty() {
            write(path, report.golden.to_json(), "golden (PORTABLE)")?;
        } else {
            say!(
                "golden not written: this run failed gates, and {} is left as it was",
                path.display()
            );
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("{} gate(s) failed: {}", failed.len(), failed.join(", ")).into())
    }
}
