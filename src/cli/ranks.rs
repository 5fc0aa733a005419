//! `--mpi`: this process as one rank of `mpirun -np P syncstep …`, holding `--local-replicas L`
//! of the R = P·L replicas (a build with the `mpi` feature). Every rank runs the same command;
//! rank 0 prints and writes.

use std::error::Error;

use clap::Args;
use sha2::{Digest, Sha256};
use syncstep::collective::Peers;
use syncstep::gpu::AdapterChoice;
use syncstep::kernels::conv2d::KernelPlan;
use syncstep::kernels::{Device, DeviceConfig};

#[derive(Args, Clone, Debug)]
pub struct MpiArgs {
    /// Run as one rank of an MPI job (`mpirun -np P syncstep … --mpi`): the replicas are the
    /// ranks' devices, rank q holding replicas q·L … q·L + L − 1; the same bits as one process.
    /// Needs a build with `--features mpi`.
    #[arg(long)]
    pub mpi: bool,
    /// Replicas (devices) per rank under --mpi: R = P·L.
    #[arg(long, default_value_t = 1, requires = "mpi", value_parser = clap::value_parser!(u32).range(1..=64), allow_negative_numbers = true)]
    pub local_replicas: u32,
}

/// How data-parallel replicas all-reduce their gradients during the backward.
#[derive(Args, Clone, Debug)]
pub struct BucketArgs {
    /// Gradient buckets of at least this many MiB (the last one excepted), all-reduced while the
    /// backward computes on; 0: a bucket whenever a layer's gradients are final. Any size gives
    /// the same bits. Data-parallel runs only [default: 4, measured in docs/performance-log.md].
    #[arg(long, allow_negative_numbers = true, value_parser = bucket_mib)]
    pub bucket_mb: Option<f64>,
}

/// `--bucket-mb`'s value, or why it cannot be a bucket size.
fn bucket_mib(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(mib) if mib.is_finite() && (0.0..=1048576.0).contains(&mib) => Ok(mib),
        _ => Err("give MiB from 0 to 1048576".into()),
    }
}

impl BucketArgs {
    /// The bucket size in bytes for a run of `replicas` replicas in all; `--bucket-mb` is
    /// refused where one replica has no gradients to all-reduce.
    pub fn bytes(&self, replicas: usize) -> Result<u64, String> {
        match self.bucket_mb {
            Some(_) if replicas == 1 => Err("--bucket-mb sizes the gradient buckets data-parallel replicas all-reduce, and one replica has none: drop --bucket-mb, or give --replicas".into()),
            Some(mib) => Ok((mib * 1048576.0) as u64),
            None => Ok(syncstep::parallel::DEFAULT_BUCKET_BYTES),
        }
    }
}

/// How this process's devices choose their convolution kernels.
#[derive(Args, Clone, Debug, Default)]
pub struct TuneArgs {
    /// Time the convolution kernels afresh on this adapter instead of taking the autotune
    /// cache's choices, and replace those there: for a cache written while other work slowed
    /// the machine (docs/design.md, "The choice").
    #[arg(long)]
    pub retune: bool,
}

impl TuneArgs {
    /// What the devices are made with: the automatic plan, and what the environment asks.
    pub fn devices(&self) -> DeviceConfig {
        super::env::get().devices(KernelPlan::Auto, self.retune)
    }
}

#[cfg(feature = "mpi")]
thread_local! {
    /// The MPI job this process is a rank of, held until [`finish`] or [`abort_job`]: MPI is
    /// finalised only after a command succeeded, never on the way out of an error, where the
    /// other ranks may be waiting for this one.
    static JOB: std::cell::RefCell<Option<std::rc::Rc<syncstep::collective::mpi::Ranks>>> =
        const { std::cell::RefCell::new(None) };
}

/// The peers `args` asks for: in-process, or this process's MPI job.
pub fn peers(args: &MpiArgs) -> Result<Peers, Box<dyn Error>> {
    if !args.mpi {
        return Ok(Peers::InProcess);
    }
    #[cfg(feature = "mpi")]
    {
        let silence = super::env::get().mpi_silence;
        let ranks = std::rc::Rc::new(syncstep::collective::mpi::Ranks::init(silence)?);
        JOB.with(|job| *job.borrow_mut() = Some(ranks.clone()));
        Ok(Peers::Mpi(ranks))
    }
    #[cfg(not(feature = "mpi"))]
    Err("--mpi: this syncstep was built without MPI; build it with `cargo build --release --features mpi` (needs Open MPI or another MPI, and libclang)".into())
}

/// The adapters of this process's `local` replicas: global replica g on the (g mod count)-th
/// of `--adapters`, else on `--adapter` or $SYNCSTEP_ADAPTER, else (under MPI) on adapter
/// g mod the number of adapters of the first adapter's backend, so that ranks on one machine
/// spread over its devices (and not onto a second backend's view of the same one).
pub fn adapter_choices(
    peers: &Peers,
    adapter: Option<&str>,
    adapters: &[String],
    local: usize,
) -> Result<Vec<AdapterChoice>, Box<dyn Error>> {
    let first = peers.first_replica(local);
    let named = adapter.is_some() || !adapters.is_empty() || super::env::get().adapter.is_some();
    if named || peers.ranks() == 1 {
        let all = named_adapters(adapter, adapters)?;
        return Ok((first..first + local).map(|g| all[g % all.len()].clone()).collect());
    }
    let all = pollster::block_on(syncstep::gpu::adapters(&syncstep::gpu::instance()));
    let backend = all.first().map(|a| a.get_info().backend);
    let count = all.iter().filter(|a| Some(a.get_info().backend) == backend).count().max(1);
    Ok((first..first + local).map(|g| AdapterChoice { backend, index: g % count }).collect())
}

/// This process's devices for `local` replicas, on [`adapter_choices`], choosing kernels as
/// `tune` says.
pub fn devices(
    peers: &Peers,
    adapter: Option<&str>,
    adapters: &[String],
    local: usize,
    tune: &TuneArgs,
) -> Result<Vec<Device>, Box<dyn Error>> {
    let choices = adapter_choices(peers, adapter, adapters, local)?;
    Ok(pollster::block_on(syncstep::parallel::devices(local, &choices, &tune.devices()))?)
}

/// Checks that every rank has the same `what` (its bytes: settings, weights, data), naming the
/// ranks that differ.
pub fn agree(peers: &Peers, what: &str, bytes: &[u8]) -> Result<(), Box<dyn Error>> {
    let digest = Sha256::digest(bytes);
    let value = u64::from_le_bytes(digest[..8].try_into().expect("a SHA-256 has 8 bytes"));
    Ok(peers.agree(what, value)?)
}

/// "rank q: " under MPI, else nothing: for what every rank prints.
pub fn prefix() -> String {
    #[cfg(feature = "mpi")]
    if let Some(rank) = syncstep::collective::mpi::running_rank() {
        return format!("rank {rank}: ");
    }
    String::new()
}

/// Whether this process writes the run's outputs: rank 0 of an MPI job, or a process alone.
pub fn writes_outputs() -> bool {
    #[cfg(feature = "mpi")]
    if let Some(rank) = syncstep::collective::mpi::running_rank() {
        return rank == 0;
    }
    true
}

/// After an error: ends the MPI job (every rank exits non-zero) when this is one of its ranks.
pub fn abort_job() {
    #[cfg(feature = "mpi")]
    syncstep::collective::mpi::abort_job(1);
}

/// After success: finalises MPI when this process is a rank.
pub fn finish() {
    #[cfg(feature = "mpi")]
    JOB.with(|job| job.borrow_mut().take());
}

/// The `odls_base_sigkill_timeout` README's recipe gives Open MPI's `mpirun`, in seconds.
pub const RECIPE_SIGKILL_TIMEOUT: u32 = 10;

/// Under Open MPI's `mpirun` left at its default `odls_base_sigkill_timeout` (1 s): a note that
/// a run stopped by a Ctrl-C or SIGTERM to mpirun has 2 s to finish its step and write the
/// checkpoint before mpirun kills the ranks (docs/reliability.md), and what gives it more.
pub fn mpirun_grace_note() -> Option<String> {
    let open_mpi = std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some();
    let set = std::env::var_os("OMPI_MCA_odls_base_sigkill_timeout").is_some();
    (open_mpi && !set).then(|| format!(
        "note: a Ctrl-C or SIGTERM to mpirun leaves the ranks 2 s to finish the step in flight and write the checkpoint before Open MPI kills them (odls_base_sigkill_timeout, 1 s by default, twice), too short on a slow device, where the checkpoint then keeps what it held: give mpirun --mca odls_base_sigkill_timeout {RECIPE_SIGKILL_TIMEOUT}"
    ))
}

/// When `mpirun` is ending the job: ends this rank's part in it without finalising MPI, which
/// would wait for mpirun, busy killing the ranks, until it kills this one too.
pub fn leave() {
    #[cfg(feature = "mpi")]
    JOB.with(|job| {
        if let Some(ranks) = job.borrow_mut().take() {
            ranks.leave_unfinalized();
        }
    });
}

/// The adapters named by `--adapters` (replica r on the (r mod count)-th), else `--adapter`,
/// else $SYNCSTEP_ADAPTER or the first adapter ([`adapter_choices`] places each
/// replica of each rank on one of them).
fn named_adapters(
    adapter: Option<&str>,
    adapters: &[String],
) -> Result<Vec<AdapterChoice>, syncstep::gpu::GpuError> {
    match (adapter, adapters) {
        (_, [_, ..]) => adapters.iter().map(|a| AdapterChoice::parse(a)).collect(),
        (Some(a), []) => Ok(vec![AdapterChoice::parse(a)?]),
        (None, []) => Ok(vec![super::env::get().adapter()]),
    }
}

#[cfg(test)]
mod tests {
    /// README's `mpirun` recipe gives the time the note at a run's start names.
    #[test]
    fn the_readme_recipe_gives_the_noted_grace() {
        let readme = include_str!("../../README.md");
        let recipe = format!("--mca odls_base_sigkill_timeout {} ", super::RECIPE_SIGKILL_TIMEOUT);
        assert!(readme.contains(&recipe), "README's mpirun recipe lacks {recipe}");
    }
}
