//! An output's advisory lock (flock), held on a hidden file beside it, `.NAME.lock`, that
//! holds the holder's process id: the output itself is a new file after every atomic write,
//! which a lock on it would not follow. The kernel releases the lock when its holder ends,
//! however it ends; the file is removed when the lock is released.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use super::error::Refusal;

pub struct Lock {
    path: PathBuf,
    _file: File,
}

impl Lock {
    /// The lock of `target`; an error naming the process that holds it.
    pub fn acquire(target: &Path) -> Result<Lock, Refusal> {
        let name = target.file_name().unwrap_or_default().to_string_lossy();
        let path = super::place::folder_of(target).join(format!(".{name}.lock"));
        let io = |source| Refusal::LockNotMade { lock: path.clone(), source };
        loop {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(io)?;
            let exclusive = rustix::fs::FlockOperation::NonBlockingLockExclusive;
            match rustix::fs::flock(&file, exclusive) {
                Err(rustix::io::Errno::WOULDBLOCK) => return Err(held(&mut file)),
                Err(e) => return Err(io(e.into())),
                Ok(()) => {}
            }
            // Its last holder may have removed the file between the open and the lock: then
            // this lock guards nothing, and the file there now is the one to take.
            if !super::place::same_file_as_open(&path, &file) {
                continue;
            }
            if holder(&mut file).is_err() {
                return Err(Refusal::NotALock(path));
            }
            file.set_len(0).map_err(io)?;
            write!(file, "{}", std::process::id()).map_err(io)?;
            return Ok(Lock { path, _file: file });
        }
    }
}

/// The process id a lock file holds: None for an empty one (made, not yet written), an
/// error for anything else (a file of the user's by that name).
fn holder(file: &mut File) -> Result<Option<u32>, ()> {
    let mut text = String::new();
    file.take(64).read_to_string(&mut text).map_err(drop)?;
    match text.trim() {
        "" => Ok(None),
        pid => pid.parse().map(Some).map_err(drop),
    }
}

/// Why a lock held by another is refused, naming its holder.
fn held(file: &mut File) -> Refusal {
    match holder(file) {
        Ok(Some(pid)) if pid == std::process::id() => Refusal::NamedTwice,
        Ok(pid) => Refusal::BeingWritten(pid),
        Err(()) => Refusal::BeingWritten(None),
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        // Removed while still held: a process that opened it meanwhile finds it gone once it
        // has the lock, and takes the next one.
        let _ = std::fs::remove_file(&self.path);
    }
}
