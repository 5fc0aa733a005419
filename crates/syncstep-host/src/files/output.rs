//! An output checked and claimed before any work: its folder, what it would replace, the inputs
//! it must not destroy, and the lock that keeps a second run off it.

use std::path::Path;

use super::error::{FileError, Refusal, Result};
use super::place::{folder_of, overlaps, place_of, Place};
use super::write::{temp_file, write_denied};

/// What kind of file an output is, told by its content: an existing file at an output path is
/// replaced only when it is one (or with `--overwrite`).
#[derive(Clone, Copy)]
pub struct Kind {
    /// What it is, for messages: "a syncstep checkpoint".
    pub what: &'static str,
    /// Whether the file at a path is one (reading as little of it as tells).
    pub ours: fn(&Path) -> bool,
}

/// An output claimed for a command: its lock, held until the claim is dropped. A pipe, a
/// terminal or the command's own output has none.
#[must_use = "the claim holds the output's lock: keep it until the output is written"]
pub struct Claim {
    #[cfg(unix)]
    _lock: Option<super::lock::Lock>,
}

/// Checks, before any work, that `path` can take the output `flag` names (`--out`, a flag or a
/// variable), and claims it. An existing regular file there is replaced only if its mode lets
/// this user write it and it is of `kind` (or `overwrite`); it must not be any of `inputs` nor
/// lie inside one (every file and folder the same command reads: a dataset's folder, `--init`,
/// `--log`, …), its folder must exist and let a file be created, and no other syncstep run may
/// be writing it. A symbolic link is judged by its target, the
/// file it writes. A pipe, a terminal or a character device is written in place; a folder or a
/// block device is refused.
pub fn check_output(
    flag: &str,
    path: &Path,
    inputs: &[&Path],
    kind: Kind,
    overwrite: bool,
) -> Result<Claim> {
    let refused = |problem: Refusal| FileError::Refused {
        what: flag.to_string(),
        path: path.to_path_buf(),
        problem,
    };
    // `x.safetensors/` names a folder to be, whose file name Rust's path would give as `x…`.
    let folder_spelt = path.as_os_str().to_string_lossy().ends_with(std::path::is_separator);
    if folder_spelt || path.file_name().is_none() {
        return Err(refused(Refusal::NotAFilePath));
    }
    let dir = folder_of(path);
    if dir.exists() && !dir.is_dir() {
        return Err(refused(Refusal::ParentNotAFolder(dir)));
    }
    if !dir.is_dir() {
        return Err(refused(Refusal::NoFolder(dir)));
    }
    let target = match place_of(path).map_err(refused)? {
        Place::InPlace(_) => return Ok(Claim::none()),
        Place::Replace(target) => target,
    };
    if let Some(input) = inputs.iter().find(|input| overlaps(&target, input)) {
        let (input, folder) = (input.to_path_buf(), input.is_dir());
        return Err(refused(Refusal::WouldDestroyInput { input, folder }));
    }
    if let Ok(meta) = std::fs::metadata(&target) {
        check_replaceable(&target, &meta, kind, overwrite).map_err(refused)?;
    }
    // Writable: the temporary file an atomic write would make (removed when dropped).
    let (dir, name) = (folder_of(&target), target.file_name().unwrap_or(path.as_os_str()));
    temp_file(&dir, name).map_err(|source| refused(Refusal::NotWritable { dir, source }))?;
    Claim::lock(&target).map_err(refused)
}

impl Claim {
    fn none() -> Claim {
        Claim {
            #[cfg(unix)]
            _lock: None,
        }
    }

    #[cfg(unix)]
    fn lock(target: &Path) -> Result<Claim, Refusal> {
        Ok(Claim { _lock: Some(super::lock::Lock::acquire(target)?) })
    }

    #[cfg(not(unix))]
    fn lock(_target: &Path) -> Result<Claim, Refusal> {
        Ok(Claim::none())
    }
}

/// Whether the existing regular file `target` may be replaced by an output of `kind`: its mode
/// must let this user write it, and it must be of that kind unless `overwrite`.
pub(super) fn check_replaceable(
    target: &Path,
    meta: &std::fs::Metadata,
    kind: Kind,
    overwrite: bool,
) -> Result<(), Refusal> {
    if let Some(why) = write_denied(meta) {
        return Err(why);
    }
    if !overwrite && !(kind.ours)(target) {
        return Err(Refusal::NotOurs { what: kind.what });
    }
    Ok(())
}
