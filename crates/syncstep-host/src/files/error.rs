//! What goes wrong with the user's files: a path refused as an output, with what to do instead,
//! or a read or write that failed.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{what} {}: {problem}", .path.display())]
    Refused { what: String, path: PathBuf, problem: Refusal },
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
}

pub type Result<T, E = FileError> = std::result::Result<T, E>;

/// Why a path cannot take an output, each with what to do instead.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error(
        "is not a file path (it names a folder): give a file's path, without a slash at its end"
    )]
    NotAFilePath,
    #[error("{} is not a folder", .0.display())]
    ParentNotAFolder(PathBuf),
    #[error("its folder {} does not exist", .0.display())]
    NoFolder(PathBuf),
    #[error("is a folder, not a regular file: give a file path")]
    Folder,
    #[error("is a block device (a disk), not a regular file: syncstep writes files, pipes and terminals, never a disk")]
    BlockDevice,
    #[error("is a chain of more than 40 symbolic links")]
    LinkChain,
    /// What it is could not be read (a link or the file's metadata).
    #[error("{0}")]
    Unreadable(std::io::Error),
    #[error("{} {}: writing it would destroy that input; write it elsewhere", overlap(*.folder), .input.display())]
    WouldDestroyInput { input: PathBuf, folder: bool },
    #[error("its mode {mode:04o} (owner uid {owner}) does not let {whose} write it, and syncstep never replaces a file its mode protects, even as root: write elsewhere, or change its mode")]
    ModeProtects { mode: u32, owner: u32, whose: &'static str },
    #[error("is read-only, and syncstep never replaces a read-only file: write elsewhere, or make it writable")]
    ReadOnly,
    #[error("exists and is not {what}: syncstep replaces only its own files of that kind; write elsewhere, or add --overwrite to replace it")]
    NotOurs { what: &'static str },
    #[error("cannot write in {} ({source})", .dir.display())]
    NotWritable { dir: PathBuf, source: std::io::Error },
    #[error("cannot make its lock {}: {source}", .lock.display())]
    LockNotMade { lock: PathBuf, source: std::io::Error },
    #[error("{} {why}, so it is not a lock of syncstep's: it is left alone; move it, or write elsewhere", .lock.display())]
    NotALock { lock: PathBuf, why: &'static str },
    #[error("{} is a lock of process {pid}, which still runs: if that is not a syncstep run writing this output, remove {}", .lock.display(), .lock.display())]
    LockOfALiveProcess { lock: PathBuf, pid: u32 },
    #[error("is named for two outputs of this command: give each its own path")]
    NamedTwice,
    #[error("is being written by another syncstep run (process {0}): wait for it to end, or write elsewhere")]
    BeingWritten(u32),
}

pub(super) fn overlap(folder: bool) -> &'static str {
    match folder {
        true => "lies inside the input folder",
        false => "is the same file as the input",
    }
}
