//! Native command-line face: parses arguments and calls into the library. Nothing here
//! computes; every subcommand is a thin wrapper that prints what the library returns.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use syncstep::host::{format_bytes, ByteScale};

/// `print!` that never panics: a closed standard output (`| head`) or a terminal gone away
/// (SIGHUP) ends the printing, not the command, which goes on to keep its files.
macro_rules! say_text {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($arg)*);
    }};
}

/// `println!` that never panics, as `say_text!`.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `eprintln!` that never panics, as `say_text!`.
macro_rules! say_err {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod bench;
mod check;
mod env;
mod eval;
mod export;
mod grad;
mod info;
mod plot;
mod predict;
mod ranks;
mod train;
mod weights;

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
    Train(Box<train::TrainArgs>),
    /// One step's loss, logits, gradients and BN statistics for given weights and batch.
    Grad(grad::GradArgs),
    /// Run the equivalence gates: R replicas with synchronised BatchNorm against one device at the global batch.
    Check(check::CheckArgs),
    /// Benchmark the training step on this adapter: images/s, GFLOP/s, memory, a roofline probe and (--profile) a per-layer breakdown.
    Bench(bench::BenchArgs),
    /// Accuracy of a checkpoint or torchvision weights on a dataset: top-1, top-5, per class, and the confusion matrix.
    Eval(eval::EvalArgs),
    /// The five likeliest classes of each image, by a checkpoint or torchvision weights.
    Predict(predict::PredictArgs),
    /// Draw a training run's loss and accuracy curves from its --log file, as SVG or PNG.
    Plot(plot::PlotArgs),
    /// Write a checkpoint's model for PyTorch (torchvision's state_dict, .safetensors) or ONNX runtimes (.onnx).
    Export(export::ExportArgs),
}

pub fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    private_runtime_dir();
    let cli = Cli::parse();
    let result = run(cli.command);
    let Err(e) = result else {
        ranks::finish();
        return ExitCode::SUCCESS;
    };
    let prefix = ranks::prefix();
    match e.downcast_ref::<Exit>() {
        // A stop every rank agreed on: each ends on its own.
        Some(exit) => {
            say_err!("{prefix}{}", exit.message);
            match exit.job_ending {
                false => ranks::finish(),
                true => ranks::leave(),
            }
            ExitCode::from(exit.code)
        }
        None => {
            say_err!("{prefix}error: {e}");
            ranks::abort_job();
            ExitCode::FAILURE
        }
    }
}

/// Runs `command`; every one but `plot` and `export` makes a GPU device, so first the memory it
/// needs and the variables that choose how are checked.
fn run(command: Command) -> Result<(), Box<dyn std::error::Error>> {
    if !matches!(command, Command::Plot(_) | Command::Export(_)) {
        check_memory()?;
        env::init()?;
    }
    match command {
        Command::Info => info::run(),
        Command::Train(a) => train::run(*a),
        Command::Grad(a) => grad::run(a),
        Command::Check(a) => check::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Predict(a) => predict::run(a),
        Command::Plot(a) => plot::run(a),
        Command::Export(a) => export::run(a),
    }
}

/// The address space a process needs to create a device and train a small batch, at least:
/// lavapipe (Mesa 22.3) needs between 1.5 and 2 GB for a batch of 2 at 32×32, and under less
/// fails inside the driver (a crash without a word, an abort, or an error that never says
/// memory).
const MIN_ADDRESS_SPACE: u64 = 2 << 30;

/// The host memory a device and a small batch's step hold, at least: lavapipe's process peaks at
/// about 390 MB for a batch of 2 at 32×32.
const MIN_FREE_MEMORY: u64 = 512 << 20;

/// Refuses, before the driver is asked for anything, an address-space limit (`ulimit -v`)
/// under [`MIN_ADDRESS_SPACE`] or less available memory than [`MIN_FREE_MEMORY`].
fn check_memory() -> Result<(), String> {
    memory_shortfall(syncstep::host::address_space_limit(), available_memory()).map_or(Ok(()), Err)
}

/// What is short, given this process's address-space limit and the host's available memory
/// (None: no limit, or not known).
fn memory_shortfall(limit: Option<u64>, available: Option<u64>) -> Option<String> {
    let bytes = |b| format_bytes(b, ByteScale::Fit);
    match (limit, available) {
        (Some(limit), _) if limit < MIN_ADDRESS_SPACE => Some(format!(
            "the address-space limit (ulimit -v) is {}, and a GPU device with a training step needs at least {}: raise the limit (ulimit -v unlimited)",
            bytes(limit),
            bytes(MIN_ADDRESS_SPACE)
        )),
        (_, Some(free)) if free < MIN_FREE_MEMORY => Some(format!(
            "this host has {} of memory available, and a GPU device with a training step needs at least {}: free some memory",
            bytes(free),
            bytes(MIN_FREE_MEMORY)
        )),
        _ => None,
    }
}

/// Why data that holds a checkpoint's files (names, sizes, labels) is not its data when their
/// times are not those `what` (the checkpoint) recorded.
pub fn modified_since(what: &str) -> String {
    format!(
        "some were modified since {what} was written (their modification times differ), and an image rewritten at the same size would be other data than the run's"
    )
}

/// An ending with its own exit status (an interrupted run: 130 for SIGINT, 143 for SIGTERM)
/// and what to say.
#[derive(Debug)]
pub struct Exit {
    pub code: u8,
    pub message: String,
    /// `mpirun` is ending the job: MPI is left as it is, not finalised (mpirun answers no rank
    /// until it has killed them all).
    pub job_ending: bool,
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Exit {}

/// Mesa's drivers print "XDG_RUNTIME_DIR is invalid" (per device) when the variable is unset
/// or names no folder; a private one of ours keeps the user's terminal for what matters.
fn private_runtime_dir() {
    if std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|d| std::path::Path::new(&d).is_dir()) {
        return;
    }
    let user = std::env::var("USER").unwrap_or_else(|_| "user".into());
    let dir = std::env::temp_dir().join(format!("syncstep-runtime-{user}"));
    let mut builder = std::fs::DirBuilder::new();
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    if builder.recursive(true).create(&dir).is_ok() {
        // Still one thread: nothing reads the environment concurrently.
        std::env::set_var("XDG_RUNTIME_DIR", &dir);
    }
}

/// The host memory that can be had now (Linux's MemAvailable), if this system says.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// A count flag's value: a whole number of 0 or more. Flags taking it accept a leading `-`
/// (`allow_negative_numbers`), so that `--batch -1` is answered here rather than read as an
/// unknown flag.
pub fn whole<T: std::str::FromStr<Err = std::num::ParseIntError>>(
    value: &str,
) -> Result<T, String> {
    value.parse::<T>().map_err(|e| match e.kind() {
        std::num::IntErrorKind::PosOverflow => "too large a count".to_string(),
        _ if value.starts_with('-') => "cannot be negative: give 0 or more".to_string(),
        _ => "give a whole number (0 or more)".to_string(),
    })
}

/// A count flag's value where 0 would do nothing: a whole number of 1 or more.
pub fn positive<T>(value: &str) -> Result<T, String>
where
    T: std::str::FromStr<Err = std::num::ParseIntError> + Default + PartialEq,
{
    match whole::<T>(value)? {
        zero if zero == T::default() => Err("0 would do nothing: give 1 or more".into()),
        count => Ok(count),
    }
}

/// Held-out images an evaluation takes at most: each is a forward pass, and a count past this
/// would run for hours (or weeks) with nothing more to learn.
pub const MAX_EVAL_EXAMPLES: usize = 100_000;

/// `n`, the count `flag` asks an evaluation for, unless past [`MAX_EVAL_EXAMPLES`].
pub fn eval_count(flag: &str, n: usize) -> Result<usize, String> {
    if n > MAX_EVAL_EXAMPLES {
        return Err(format!("{flag} is {n}; at most {MAX_EVAL_EXAMPLES} (each is a forward pass)"));
    }
    Ok(n)
}

/// A count flag's value bounded by `MAX`: a whole number from 0 to `MAX`, checked before
/// anything is allocated or run for it.
pub fn at_most<const MAX: usize>(value: &str) -> Result<usize, String> {
    match whole::<usize>(value)? {
        n if n > MAX => Err(format!("at most {MAX}")),
        n => Ok(n),
    }
}

/// An adapter flag's value (`--adapter`, each of `--adapters`): an index from `syncstep info`,
/// a backend, or `backend:index`, each mistake said in those terms.
pub fn adapter(value: &str) -> Result<String, String> {
    let syntax = "give an index from `syncstep info` (0, 1, …), a backend (vulkan, gl, …) or both as backend:index (vulkan:1)";
    let index_ok = |i: &str| !i.is_empty() && i.chars().all(|c| c.is_ascii_digit());
    let problem = match value.trim().split_once(':') {
        _ if value.trim().is_empty() => "is empty (two commas, or one at an end, in --adapters)",
        _ if value.trim().starts_with('-') => "is negative: adapters count from 0",
        Some((b, _)) if index_ok(b) => "puts the index first: the backend comes first (vulkan:1)",
        Some((_, i)) if !index_ok(i) => "has no number after the colon",
        _ => {
            return syncstep::gpu::AdapterChoice::parse(value)
                .map(|_| value.to_string())
                .map_err(|e| e.to_string());
        }
    };
    Err(format!("{problem}: {syntax}"))
}

/// `--classes`'s value: 2 to [`syncstep::model::MAX_CLASSES`], checked before the classifier
/// is allocated.
pub fn classes(value: &str) -> Result<u32, String> {
    let most = syncstep::model::MAX_CLASSES;
    match whole::<u32>(value) {
        Ok(n) if (2..=most).contains(&n) => Ok(n),
        _ => Err(format!("a classifier has 2 to {most} classes")),
    }
}

/// `--overwrite`, on the commands that write files.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct Overwrite {
    /// Replace an existing output file that is not syncstep's own of that kind (an output
    /// replaces a file syncstep wrote as that output without this flag). A file whose mode does
    /// not let you write it, or one of the command's inputs, is never replaced.
    #[arg(long)]
    pub overwrite: bool,
}

impl Overwrite {
    /// Refuses `--overwrite` when the command was given none of its outputs (`flags`).
    pub fn check(&self, any_output: bool, flags: &str) -> Result<bool, String> {
        if self.overwrite && !any_output {
            return Err(format!(
                "--overwrite has no effect without an output ({flags}): drop --overwrite"
            ));
        }
        Ok(self.overwrite)
    }
}

/// Whether the file at `path` is a JSON document with a value at each of `pointers` (JSON
/// pointers, `/golden`): how a golden file is told from other files.
pub fn json_with(path: &std::path::Path, pointers: &[&str]) -> bool {
    json_text(path).is_some_and(|text| has_values(&text, pointers))
}

/// Whether the file at `path` is a JSON report syncstep wrote ([`sealed`]) with a value at each
/// of `pointers` (`/config/plan_for`): a file that only has a report's keys is not one.
pub fn report_with(path: &std::path::Path, pointers: &[&str]) -> bool {
    json_text(path).is_some_and(|text| is_sealed(&text) && has_values(&text, pointers))
}

/// The text of the file at `path`, unless it is too large to be a report of ours.
fn json_text(path: &std::path::Path) -> Option<String> {
    // Reports are small; a large file is not one, and is not read.
    if !std::fs::metadata(path).is_ok_and(|m| m.len() < 256 << 20) {
        return None;
    }
    String::from_utf8(syncstep::files::read_input(path).ok()?).ok()
}

fn has_values(text: &str, pointers: &[&str]) -> bool {
    serde_json::from_str::<serde_json::Value>(text)
        .is_ok_and(|doc| pointers.iter().all(|p| doc.pointer(p).is_some()))
}

/// The key of a report's hash of its own text ([`sealed`]).
const SEAL_KEY: &str = "syncstep_sha256";

/// A JSON object's text `json` (pretty or compact) with a first key, [`SEAL_KEY`], holding the
/// SHA-256 of `json` itself: what tells a report syncstep wrote from a file that copies its keys.
pub fn sealed(json: &str) -> String {
    let hash = sha256_hex(json);
    match json.strip_prefix("{\n") {
        Some(body) => format!("{{\n  \"{SEAL_KEY}\": \"{hash}\",\n{body}"),
        None => format!("{{\"{SEAL_KEY}\":\"{hash}\",{}", json.strip_prefix('{').unwrap_or(json)),
    }
}

/// Whether `text` is what [`sealed`] makes of a JSON text, its hash holding.
fn is_sealed(text: &str) -> bool {
    let pretty = (format!("{{\n  \"{SEAL_KEY}\": \""), "\",\n", "{\n");
    let compact = (format!("{{\"{SEAL_KEY}\":\""), "\",", "{");
    [pretty, compact].iter().any(|(start, end, open)| {
        let Some(rest) = text.strip_prefix(start.as_str()) else { return false };
        let body = rest.get(64..).and_then(|r| r.strip_prefix(end));
        body.is_some_and(|body| rest[..64] == sha256_hex(&format!("{open}{body}")))
    })
}

fn sha256_hex(text: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(text.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// Loader threads `--workers` starts at most: more only wait on one another for the device.
const MAX_WORKERS: usize = 1024;

/// `--workers`'s value: 1 to [`MAX_WORKERS`] threads.
pub fn workers(value: &str) -> Result<usize, String> {
    match positive::<usize>(value)? {
        n if n > MAX_WORKERS => Err(format!("at most {MAX_WORKERS} loader threads")),
        n => Ok(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_little_memory_is_named_before_a_device_is_made() {
        let gib = 1u64 << 30;
        let short = memory_shortfall(Some(600_000 * 1024), Some(64 * gib)).unwrap();
        assert!(short.contains("address-space limit (ulimit -v) is 585.94 MiB"), "{short}");
        let short = memory_shortfall(None, Some(100 << 20)).unwrap();
        assert!(short.contains("100.00 MiB of memory available"), "{short}");
        assert_eq!(memory_shortfall(Some(4 * gib), Some(gib)), None);
        assert_eq!(memory_shortfall(None, None), None);
    }
}
