//! Shared by the test binaries: the harness, one device per binary (pipelines compile once),
//! seeded random tensors, and the norm-relative error the gates use.

#[macro_use]
pub mod harness;
pub mod recipe;

use std::ffi::OsString;
use std::process::Command;
use std::sync::OnceLock;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
pub use syncstep::compare::norm_rel;
use syncstep::environment::Environment;
use syncstep::gpu::{Encoder, Gpu, Slice};
use syncstep::kernels::conv2d::KernelPlan;
use syncstep::kernels::{Device, DeviceConfig, KernelError};

/// The suite's environment variables, whoever runs it (`cargo test` or scripts/test.sh): those
/// set, and where one is not, the kernels chosen without timing (the browser's guess: every
/// variant gives the same bits, tests/suite/conv2d.rs holds each to them, and timing every
/// candidate at the suite's many shapes was a quarter of its time) and the autotune's choices in the
/// build folder, never the user's cache. The autotune's own tests set their policies.
pub fn test_var(name: &str) -> Option<OsString> {
    let set = std::env::var_os(name).filter(|v| !v.is_empty());
    set.or_else(|| match name {
        "SYNCSTEP_CONV_ALGO" => Some("guess".into()),
        "SYNCSTEP_AUTOTUNE_CACHE" => {
            Some(concat!(env!("CARGO_TARGET_TMPDIR"), "/autotune-test.json").into())
        }
        _ => None,
    })
}

/// What [`test_var`] gives, as the command line would read it.
pub fn environment() -> &'static Environment {
    static ENVIRONMENT: OnceLock<Environment> = OnceLock::new();
    ENVIRONMENT.get_or_init(|| Environment::read(test_var).expect("the suite's environment"))
}

/// What the suite's devices are made with (the automatic plan, [`environment`]'s choices).
pub fn device_config() -> DeviceConfig {
    environment().devices(KernelPlan::Auto, false)
}

/// The variables the suite gives every syncstep it runs (see [`test_var`]).
pub fn suite_env() -> [(&'static str, OsString); 2] {
    ["SYNCSTEP_CONV_ALGO", "SYNCSTEP_AUTOTUNE_CACHE"]
        .map(|name| (name, test_var(name).expect("the suite has a default")))
}

/// The binary under test as a command, in the suite's environment.
pub fn command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_syncstep"));
    command.envs(suite_env());
    command
}

/// The shared device, made once per process. Where there is none, the test ends skipped, or in
/// CI (`CI` set) failed: CI has lavapipe.
pub fn gpu() -> &'static Device {
    static GPU: OnceLock<Result<Device, String>> = OnceLock::new();
    let made = GPU.get_or_init(|| {
        let _ = env_logger::builder().is_test(true).try_init();
        let gpu = pollster::block_on(Gpu::new(&environment().adapter()));
        gpu.map(|g| Device::new(g, &device_config())).map_err(|e| e.to_string())
    });
    match made {
        Ok(device) => device,
        Err(e) => unavailable(&format!("no GPU adapter ({e})")),
    }
}

/// For a test whose GPU work is in the `syncstep` it runs, or in devices it makes itself: ends it
/// as [`gpu`] does where there is no adapter.
pub fn needs_adapter() {
    gpu();
}

/// Ends the test for want of `what` this machine lacks: skipped, or in CI (`CI` set) failed,
/// because CI's machine has everything the suite needs.
pub fn unavailable(what: &str) -> ! {
    if std::env::var_os("CI").is_some() {
        panic!("{what}, and CI must have it (CI is set)");
    }
    harness::skip(format!("skipped: {what}; with CI set this fails"))
}

/// A device of its own (for code that takes ownership of a device).
pub fn fresh_gpu() -> Device {
    device_made_with(&device_config())
}

/// A device of its own whose convolutions choose by `policy`.
pub fn device_with(policy: syncstep::kernels::conv2d::KernelPolicy) -> Device {
    device_made_with(&DeviceConfig { policy: std::sync::Arc::new(policy), ..device_config() })
}

/// A device of its own made with `config`.
fn device_made_with(config: &DeviceConfig) -> Device {
    needs_adapter();
    let gpu = pollster::block_on(Gpu::new(&environment().adapter())).unwrap();
    Device::new(gpu, config)
}

/// A separate device whose storage bindings are capped at `max_binding_bytes`, to check that
/// launches past a device limit are refused with a clear error.
pub fn gpu_with_binding_limit(max_binding_bytes: u64) -> Device {
    gpu_with_limits(|l| l.max_storage_buffer_binding_size = max_binding_bytes)
}

/// A separate device with the adapter's limits as `lower` changes them (lower only).
pub fn gpu_with_limits(lower: impl FnOnce(&mut wgpu::Limits)) -> Device {
    needs_adapter();
    pollster::block_on(async {
        let instance = syncstep::gpu::instance();
        let adapter =
            syncstep::gpu::select_adapter(&instance, &environment().adapter()).await.unwrap();
        let mut limits = adapter.limits();
        lower(&mut limits);
        let gpu = Gpu::from_adapter_with_limits(&adapter, limits).await.unwrap();
        Device::new(gpu, &device_config())
    })
}

/// A separate device whose kernels load what the others pass by subgroupBroadcast, as in a
/// browser and on devices without subgroups, so one run tests both kinds.
pub fn gpu_that_loads() -> Device {
    let mut gpu = gpu_with_limits(|_| {});
    gpu.broadcasts = false;
    gpu
}

/// Uniform values in [-1, 1), never all zero.
pub fn uniform(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Uniform values in [lo, hi).
pub fn uniform_in(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// Each value's bit pattern: what "bitwise" compares.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

pub fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

#[track_caller]
pub fn assert_close(what: &str, gpu: &[f32], reference: &[f64], tol: f64) {
    let e = norm_rel(gpu, reference);
    assert!(
        e <= tol,
        "{what}: norm-rel error {e:e} > {tol:e} (first elements gpu {:?} ref {:?})",
        &gpu[..gpu.len().min(4)],
        &reference[..reference.len().min(4)]
    );
}

/// A storage buffer filled with NaN, so any element a kernel fails to write shows up.
pub fn poisoned(gpu: &Gpu, label: &str, len: usize) -> wgpu::Buffer {
    let b = gpu.buffer(label, len as u64).unwrap();
    gpu.poison(Slice::whole(&b));
    b
}

pub fn read(gpu: &Gpu, b: &wgpu::Buffer) -> Vec<f32> {
    pollster::block_on(gpu.read_f32(Slice::whole(b))).unwrap()
}

pub fn submit(gpu: &Gpu, enc: Encoder) {
    pollster::block_on(gpu.submit(enc)).unwrap();
}

/// Each case `(op, arg, result, text)` is a launch that must have been refused as
/// `KernelError::Arg` naming `op` and `arg`, with `text` in its message.
#[track_caller]
pub fn assert_arg_errors<const N: usize>(
    cases: [(&str, &str, syncstep::kernels::Result<()>, &str); N],
) {
    for (op, arg, result, text) in cases {
        let err = result.unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, KernelError::Arg { op: o, arg: a, .. } if o == op && a == arg),
            "{op}/{arg}: {msg}"
        );
        assert!(msg.contains(text), "{msg}");
    }
}

/// Batch sizes whose pairwise sums over examples need each private stack size the kernels are
/// compiled for but the largest (4, 8 and 16 levels; see `syncstep::kernels::pairwise_levels`).
/// 32 levels need 65536 examples or more, which lavapipe (Mesa 22) cannot loop over in one
/// invocation: it ends every loop of an invocation after 65535 iterations of all its loops
/// together (LP_MAX_TGSI_LOOP_ITERATIONS), silently. [`PAIRWISE_LARGEST`] is for kernels that
/// split the batch over dispatches.
pub fn pairwise_counts() -> [u32; 3] {
    let counts = [1, 17, 300];
    let levels = counts.map(syncstep::kernels::pairwise_levels);
    assert_eq!(
        levels[..],
        syncstep::kernels::PAIRWISE_LEVELS[..3],
        "one batch size per stack size"
    );
    counts
}

/// A batch size that needs the largest pairwise stack, 32 levels.
pub const PAIRWISE_LARGEST: u32 = 65537;

/// A batch of `batch` examples over `replicas` replicas as data-parallel training sums it: each
/// replica's canonical pieces summed alone by `piece_sum` (a kernel run on those examples), then
/// added along the canonical plan. For any shards this must be the whole batch's sum, bitwise.
pub fn summed_in_pieces(
    batch: usize,
    replicas: usize,
    piece_sum: impl Fn(std::ops::Range<usize>) -> Vec<f32>,
) -> Vec<f32> {
    use syncstep::canonical::{pieces, shards, Plan};
    let ranges = shards(batch as u64, replicas as u64);
    let plan = Plan::new(&ranges, batch as u64);
    let sums: Vec<Vec<Vec<f32>>> = ranges
        .iter()
        .map(|r| {
            let p = pieces(r.clone(), batch as u64);
            p.into_iter().map(|p| piece_sum(p.start as usize..p.end as usize)).collect()
        })
        .collect();
    let leaves: Vec<&[f32]> = plan.leaves.iter().map(|&(r, p)| sums[r][p].as_slice()).collect();
    syncstep::collective::reduce(&leaves, &plan, syncstep::collective::ReduceOp::Sum)
}

/// `parts` summed element-wise in the kernels' pairwise order over examples, on the host: the
/// all-reduce's order over replicas, which is the same binary counter.
pub fn pairwise_sum(parts: Vec<Vec<f32>>) -> Vec<f32> {
    let leaves: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
    let plan = syncstep::canonical::Plan::one_piece_each(parts.len());
    syncstep::collective::reduce(&leaves, &plan, syncstep::collective::ReduceOp::Sum)
}

/// `syncstep ARGS…` (the binary under test): whether it succeeded, and stdout + stderr.
pub fn syncstep(args: &[&str]) -> (bool, String) {
    outcome(command().args(args))
}

/// Runs `cmd`: whether it succeeded, and stdout + stderr.
pub fn outcome(cmd: &mut std::process::Command) -> (bool, String) {
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
    )
}

/// A batch's labels as `grad` takes them (int64, as PyTorch keeps them).
pub fn int64(labels: &[u32]) -> Vec<i64> {
    labels.iter().map(|&l| l.into()).collect()
}

/// `bench`'s exchange wait in its printed report `text` and its `json`: a row per rank of
/// `ranks`, each of its `steps` waits finite and non-negative (a time is never bounded).
pub fn check_exchange_wait(text: &str, json: &serde_json::Value, ranks: usize, steps: usize) {
    let table = text.lines().skip_while(|l| !l.starts_with("exchange wait, from the backward"));
    let mut lines = table.skip(1);
    assert!(lines.next().is_some_and(|l| l.starts_with("rank ")), "a table of waits: {text}");
    let time = |x: f64| x.is_finite() && x >= 0.0;
    for rank in 0..ranks {
        let row: Vec<String> =
            lines.next().unwrap_or_default().split_whitespace().map(String::from).collect();
        let figures: Vec<f64> = row.iter().skip(1).take(3).filter_map(|f| f.parse().ok()).collect();
        let ok = row.first() == Some(&rank.to_string()) && figures.len() == 3;
        assert!(ok && figures.into_iter().all(time), "rank {rank}'s row: {text}");
    }
    let rows = json["exchange_wait"].as_array().expect("exchange_wait in the JSON");
    assert_eq!(rows.len(), ranks, "{rows:?}");
    for (rank, row) in rows.iter().enumerate() {
        assert_eq!(row["rank"], rank, "{row}");
        let steps_s = row["steps_s"].as_array().expect("steps_s");
        assert_eq!(steps_s.len(), steps, "{row}");
        let figures = ["median_s", "min_s", "max_s"].map(|k| &row[k]);
        for x in figures.into_iter().chain(steps_s) {
            assert!(x.as_f64().is_some_and(time), "rank {rank}: {row}");
        }
    }
}
