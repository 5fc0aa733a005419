//! The tests that run ranks under `mpirun` (the `mpi` feature), in a binary of their own: cargo
//! runs test binaries one after another, so their ranks never share this machine's cores with
//! the suite's tests (beside other work on two cores, a three-rank `check` took minutes rather
//! than seconds: docs/performance-log.md). The harness and helpers are the suite's.

// The suite's helpers, of which these tests use some: the suite's binary holds the rest to the
// dead-code lint.
#[macro_use]
#[allow(dead_code)]
#[path = "../suite/common/mod.rs"]
mod common;

mod hosts;
mod mpi;

/// One `mpirun` job at a time, held while one runs, across both modules: the ranks of two jobs
/// on a CI machine's two cores would take turns with each other's waits.
fn one_job() -> std::sync::MutexGuard<'static, ()> {
    static ONE_JOB: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE_JOB.lock().unwrap_or_else(|p| p.into_inner())
}

/// Weights with randomised BatchNorm and a batch of `m` synthetic 32×32 images, for `grad`: the
/// inputs of the multi-process tests.
pub fn inputs(dir: &std::path::Path, m: usize) -> std::path::PathBuf {
    let model = syncstep::model::ResNet::new(syncstep::model::Arch::ResNet34, 10).unwrap();
    let path = dir.join("inputs.safetensors");
    syncstep::checkpoint::write_seeded_inputs(&path, &model, 4, m, 32, &[]).unwrap();
    path
}

/// Every tensor of `a` and `b` bitwise equal, with the same names and shapes, and every
/// metadata entry the same (compared as maps: the header's key order is the safetensors crate's
/// hash order, which differs from file to file): the name of the first that is not.
pub fn same_bits(a: &std::path::Path, b: &std::path::Path) -> Result<(), String> {
    let (a, b) = (
        syncstep::tensorfile::TensorFile::read(a).unwrap(),
        syncstep::tensorfile::TensorFile::read(b).unwrap(),
    );
    assert!(a.tensors.len() > 100, "a gradient file or checkpoint holds every parameter");
    if let Some(name) = b.tensors.keys().find(|name| !a.tensors.contains_key(*name)) {
        return Err(format!("{name} is only in the second file"));
    }
    for (name, t) in &a.tensors {
        let u = b.get(name).ok_or(format!("{name} missing"))?;
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        if t.shape != u.shape || t.integer != u.integer || bits(&t.values) != bits(&u.values) {
            return Err(format!("{name} differs"));
        }
    }
    let keys = a.metadata.keys().chain(b.metadata.keys());
    match keys.into_iter().find(|k| a.metadata.get(*k) != b.metadata.get(*k)) {
        Some(key) => Err(format!(
            "metadata `{key}` differs: {:?} against {:?}",
            a.metadata.get(key),
            b.metadata.get(key)
        )),
        None => Ok(()),
    }
}

fn main() -> std::process::ExitCode {
    common::harness::main(&[mpi::TESTS, hosts::TESTS])
}
