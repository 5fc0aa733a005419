//! The user's files: what a command will write is checked before any work (a folder that
//! exists, a regular file or none, never one of the command's own inputs, writable), and every
//! write is atomic (a temporary file beside it, then a rename), so a failed or interrupted write
//! leaves the old file whole. Temporary files a killed run left behind are removed by the next
//! write to the same place. Native only: a browser has no file system.

use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{what} {path}: {problem}")]
    Refused { what: String, path: PathBuf, problem: String },
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
}

pub type Result<T, E = FileError> = std::result::Result<T, E>;

/// Checks, before any work, that `path` can take the output `what` names (`--out`, a flag or a
/// variable): its folder exists, it is a regular file or does not exist yet, it is none of
/// `inputs` (the command's own input files: writing there would destroy one), and a file can
/// be created beside it.
pub fn check_output(what: &str, path: &Path, inputs: &[&Path]) -> Result<()> {
    let refused = |problem: String| FileError::Refused {
        what: what.to_string(),
        path: path.to_path_buf(),
        problem,
    };
    let name = path.file_name().ok_or_else(|| refused("is not a file path".into()))?;
    let dir = folder_of(path);
    if dir.exists() && !dir.is_dir() {
        return Err(refused(format!("{} is not a folder", dir.display())));
    }
    if !dir.is_dir() {
        return Err(refused(format!("its folder {} does not exist", dir.display())));
    }
    match std::fs::metadata(path) {
        Ok(meta) if !meta.is_file() => {
            return Err(refused(
                "exists and is not a regular file (a folder, a device or a pipe): it is left alone"
                    .into(),
            ))
        }
        Ok(_) => {
            if let Some(input) = inputs.iter().find(|input| same_file(path, input)) {
                return Err(refused(format!(
                    "is the same file as the input {}: writing it would destroy that input",
                    input.display()
                )));
            }
        }
        Err(_) => {}
    }
    // Writable: the temporary file an atomic write would make.
    let probe = temp_path(&dir, name);
    std::fs::File::create(&probe)
        .map_err(|e| refused(format!("cannot write in {} ({e})", dir.display())))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Writes `bytes` to `path` atomically: a temporary file beside it, synced, then renamed over
/// it. First removes temporary files of earlier runs that were killed mid-write.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |e: std::io::Error| FileError::Io { path: path.to_path_buf(), message: e.to_string() };
    let name = path.file_name().ok_or_else(|| FileError::Io {
        path: path.to_path_buf(),
        message: "not a file path".into(),
    })?;
    let dir = folder_of(path);
    remove_stale_temps(&dir, name);
    let tmp = temp_path(&dir, name);
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write()
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
        .map_err(io)
}

/// The folder a file path is in ("." for a bare name).
fn folder_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// This process's temporary file for `name` in `dir`: hidden, and named after the process so
/// that a later run can tell whether its writer is gone.
fn temp_path(dir: &Path, name: &std::ffi::OsStr) -> PathBuf {
    dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()))
}

/// Removes `dir`'s temporary files for `name` whose process no longer runs.
fn remove_stale_temps(dir: &Path, name: &std::ffi::OsStr) {
    let prefix = format!(".{}.tmp-", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = file_name.strip_prefix(&prefix).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && abandoned(pid, &entry) {
            log::info!("removing {file_name}, left by an earlier run that was stopped");
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Whether the temporary file `entry` of process `pid` is abandoned: the process no longer runs
/// or, where that cannot be told (no /proc), the file is over an hour old.
fn abandoned(pid: u32, entry: &std::fs::DirEntry) -> bool {
    let proc = Path::new("/proc");
    if proc.is_dir() {
        return !proc.join(pid.to_string()).exists();
    }
    let age = entry.metadata().and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
    age.is_some_and(|age| age > std::time::Duration::from_secs(3600))
}

/// Whether `a` and `b` name the same file (hard links and symbolic links included).
fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(a), Ok(b)) = (std::fs::metadata(a), std::fs::metadata(b)) {
            return a.dev() == b.dev() && a.ino() == b.ino();
        }
    }
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(test: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("syncstep-files-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn an_output_is_refused_where_it_would_destroy_something() {
        let d = dir("refused");
        let input = d.join("weights.safetensors");
        std::fs::write(&input, b"precious").unwrap();
        let link = d.join("link.safetensors");
        std::os::unix::fs::symlink(&input, &link).unwrap();
        let hard = d.join("hard.safetensors");
        std::fs::hard_link(&input, &hard).unwrap();
        for same in [&input, &link, &hard] {
            let e = check_output("--out", same, &[&input]).unwrap_err().to_string();
            assert!(e.contains("same file as the input"), "{e}");
        }
        let e = check_output("--out", &d, &[]).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let e = check_output("--out", Path::new("/dev/null"), &[]).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let e = check_output("--out", &d.join("no/such/dir/x"), &[]).unwrap_err().to_string();
        assert!(e.contains("does not exist"), "{e}");
        check_output("--out", &d.join("new.safetensors"), &[&input]).unwrap();
        assert_eq!(std::fs::read(&input).unwrap(), b"precious");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 3, "the probe is removed");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_write_replaces_whole_and_clears_what_killed_runs_left() {
        let d = dir("atomic");
        let path = d.join("out.json");
        // A writer that is gone (no such pid) and one that runs (this process's parent).
        let gone = d.join(".out.json.tmp-4294967295");
        std::fs::write(&gone, b"half").unwrap();
        let running = d.join(format!(".out.json.tmp-{}", std::os::unix::process::parent_id()));
        std::fs::write(&running, b"in progress").unwrap();
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert!(!gone.exists() && running.exists());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
