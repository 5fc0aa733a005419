//! An output's advisory lock (flock), held on a hidden file beside it, `.NAME.lock`: the output
//! itself is a new file after every atomic write, which a lock on it would not follow. The
//! kernel releases the lock when its holder ends, however it ends; the file is removed when the
//! lock is released.
//!
//! Whatever is at the lock's path may be the user's: the lock file is never opened through a
//! link, and is made only where nothing is. It appears whole and already locked (written and
//! locked under a temporary name, then hard-linked into place, which fails if anything is
//! there), so no other process ever reads half of one. One a killed run left behind is taken
//! over only when it is provably syncstep's: a regular file holding exactly [`content`], whose
//! process no longer runs and holds no lock on it. Anything else there is left alone and named.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::error::Refusal;

pub struct Lock {
    path: PathBuf,
    file: File,
}

/// What a lock file of process `pid` holds, byte for byte.
fn content(pid: u32) -> String {
    format!("syncstep lock: process {pid}\n")
}

/// The process id of a lock file's `text`, if it is exactly what [`content`] writes.
fn holder_of(text: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(text).ok()?;
    let pid: u32 =
        text.strip_prefix("syncstep lock: process ")?.strip_suffix('\n')?.parse().ok()?;
    (text == content(pid)).then_some(pid)
}

impl Lock {
    /// The lock of `target`; an error naming the process that holds it, or the file of the
    /// user's that is where the lock goes.
    pub fn acquire(target: &Path) -> Result<Lock, Refusal> {
        let name = super::place::side_name(target.file_name().unwrap_or_default(), ".lock");
        let path = super::place::folder_of(target).join(name);
        let io = |source| Refusal::LockNotMade { lock: path.clone(), source };
        // Each turn either makes the lock, refuses, or removes a stale one; a removal another
        // process makes meanwhile only sends this one round again.
        loop {
            match make(&path) {
                Ok(file) => return Ok(Lock { path, file }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io(e)),
            }
            let mut file = match open_existing(&path) {
                Ok(file) => file,
                // Gone between the two: its holder ended.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) if e.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) => {
                    return Err(Refusal::NotALock { lock: path, why: "is a symbolic link" })
                }
                Err(e) => return Err(io(e)),
            };
            if !file.metadata().map_err(io)?.is_file() {
                return Err(Refusal::NotALock { lock: path, why: "is not a regular file" });
            }
            let mut text = Vec::new();
            (&mut file).take(64).read_to_end(&mut text).map_err(io)?;
            let Some(pid) = holder_of(&text) else {
                return Err(Refusal::NotALock { lock: path, why: "does not hold a syncstep lock" });
            };
            let exclusive = rustix::fs::FlockOperation::NonBlockingLockExclusive;
            match rustix::fs::flock(&file, exclusive) {
                Err(rustix::io::Errno::WOULDBLOCK) if pid == std::process::id() => {
                    return Err(Refusal::NamedTwice)
                }
                Err(rustix::io::Errno::WOULDBLOCK) => return Err(Refusal::BeingWritten(pid)),
                Err(e) => return Err(io(e.into())),
                Ok(()) => {}
            }
            if runs(pid) {
                return Err(Refusal::LockOfALiveProcess { lock: path, pid });
            }
            // Removed only while it is still the file there and this process holds its lock:
            // another process taking it over waits for the lock, then finds it gone.
            if super::place::same_file_as_open(&path, &file) {
                log::info!(
                    "{}: taking over the lock of process {pid}, which ended",
                    path.display()
                );
                std::fs::remove_file(&path).map_err(io)?;
            }
        }
    }
}

/// Makes the lock file at `path`, locked and whole, where nothing is (an error of kind
/// `AlreadyExists` if anything is, a link included).
fn make(path: &Path) -> std::io::Result<File> {
    let dir = super::place::folder_of(path);
    let name = path.file_name().unwrap_or_default();
    super::write::remove_stale_temps(&dir, name);
    let tmp = super::write::temp_file(&dir, name)?;
    rustix::fs::flock(tmp.as_file(), rustix::fs::FlockOperation::NonBlockingLockExclusive)?;
    tmp.as_file().write_all(content(std::process::id()).as_bytes())?;
    match std::fs::hard_link(tmp.path(), path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Err(e),
        // A file system without hard links: made exclusively in place, then written; another
        // process that opens it before the write finds no lock in it and leaves it alone.
        Err(_) => return make_in_place(path),
    }
    // The temporary name goes (dropped); the lock stays on the file, now at `path`.
    let (file, _name) = tmp.into_parts();
    Ok(file)
}

/// [`make`] where hard links are not supported.
fn make_in_place(path: &Path) -> std::io::Result<File> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path)?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)?;
    file.write_all(content(std::process::id()).as_bytes())?;
    Ok(file)
}

/// Opens the file at `path` to read, never through a link (an error) and never waiting (a
/// pipe).
fn open_existing(path: &Path) -> std::io::Result<File> {
    use rustix::fs::OFlags;
    OpenOptions::new()
        .read(true)
        .custom_flags((OFlags::NOFOLLOW | OFlags::NONBLOCK).bits() as i32)
        .open(path)
}

/// Whether process `pid` runs (or may: where that cannot be told, it is taken to).
fn runs(pid: u32) -> bool {
    let Some(pid) = i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw) else {
        return false;
    };
    !matches!(rustix::process::test_kill_process(pid), Err(rustix::io::Errno::SRCH))
}

impl Drop for Lock {
    fn drop(&mut self) {
        // Removed while still held, and only while it is the file there: a process that opened
        // it meanwhile finds it gone once it has the lock, and takes the next one.
        if super::place::same_file_as_open(&self.path, &self.file) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
