//! The user's files: what a command will write is checked before any work, and every write
//! either replaces a regular file whole or goes in place to a pipe, a terminal or the command's
//! own standard output.
//!
//! An existing file at an output path is replaced only when it is of the output's kind, told by
//! its content ([`Kind`]: a checkpoint replaces a checkpoint, never a photo), or with
//! `--overwrite`; never when it is one of the command's own inputs, and never when its mode bits
//! do not let this user write it (honoured as root too). A replacement keeps the old file's
//! mode and, where the system lets it, its owner. While a command runs it holds an advisory
//! lock on each output, so that a second run writing the same file is refused.
//!
//! A replacement is atomic: a temporary file beside the output (the `tempfile` crate's: created
//! afresh, removed on every error path) is written, synced and renamed over it, so a failed or
//! interrupted write leaves the old file whole. Its name holds the writer's process id, so that
//! one a killed run left behind (a kill runs no clean-up) is removed by the next write to the
//! same place. A pipe, a terminal, a character device, or the file the command's standard output
//! or error goes to (`/dev/stdout`, a shell's `>`) is written in place, after what is there:
//! a rename would put a new file where the shell's was, and lose what the command printed.
//! Native only: a browser has no file system.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

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
    #[error("is not a file path")]
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
    #[error("{} is there and is not a syncstep lock (a process id): it is left alone; move it, or write elsewhere", .0.display())]
    NotALock(PathBuf),
    #[error("is named for two outputs of this command: give each its own path")]
    NamedTwice,
    #[error("is being written by another syncstep run{}: wait for it to end, or write elsewhere", holder(*.0))]
    BeingWritten(Option<u32>),
}

fn overlap(folder: bool) -> &'static str {
    match folder {
        true => "lies inside the input folder",
        false => "is the same file as the input",
    }
}

fn holder(pid: Option<u32>) -> String {
    pid.map(|pid| format!(" (process {pid})")).unwrap_or_default()
}

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
    _lock: Option<lock::Lock>,
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
    path.file_name().ok_or_else(|| refused(Refusal::NotAFilePath))?;
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
        Ok(Claim { _lock: Some(lock::Lock::acquire(target)?) })
    }

    #[cfg(not(unix))]
    fn lock(_target: &Path) -> Result<Claim, Refusal> {
        Ok(Claim::none())
    }
}

/// Whether the existing regular file `target` may be replaced by an output of `kind`: its mode
/// must let this user write it, and it must be of that kind unless `overwrite`.
fn check_replaceable(
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

/// Why this user may not replace the file `meta` describes, if its mode bits say so: the
/// owner's bits for its owner, the group's for its group, the others' for everyone else, root
/// included (root could, but a file that says it is not to be written is not replaced).
#[cfg(unix)]
fn write_denied(meta: &std::fs::Metadata) -> Option<Refusal> {
    use std::os::unix::fs::MetadataExt;
    let (uid, gid) = (rustix::process::geteuid().as_raw(), rustix::process::getegid().as_raw());
    let in_group = meta.gid() == gid
        || rustix::process::getgroups()
            .is_ok_and(|groups| groups.iter().any(|g| g.as_raw() == meta.gid()));
    let (bit, whose) = match () {
        _ if meta.uid() == uid => (0o200, "its owner (you)"),
        _ if in_group => (0o020, "its group (yours)"),
        _ => (0o002, "others (you are not its owner)"),
    };
    let mode = meta.mode() & 0o7777;
    (mode & bit == 0).then(|| Refusal::ModeProtects { mode, owner: meta.uid(), whose })
}

#[cfg(not(unix))]
fn write_denied(meta: &std::fs::Metadata) -> Option<Refusal> {
    meta.permissions().readonly().then_some(Refusal::ReadOnly)
}

/// Where an output goes.
enum Place {
    /// A regular file, new or replaced whole (a temporary file beside it, renamed over it).
    Replace(PathBuf),
    /// Written where it is, after what is there: a pipe, a terminal, a character device, or
    /// this process's own standard output or error.
    InPlace(PathBuf),
}

/// Where a write to `path` goes: the file a symbolic link there points to (the link stays a
/// link; the target may be yet to be made), or in place. A folder or a block device is an
/// error.
fn place_of(path: &Path) -> Result<Place, Refusal> {
    let target = link_target(path)?;
    if is_descriptor(&target) {
        return Ok(Place::InPlace(target));
    }
    let meta = match std::fs::metadata(&target) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Place::Replace(target)),
        meta => meta.map_err(Refusal::Unreadable)?,
    };
    if meta.is_dir() {
        return Err(Refusal::Folder);
    }
    if meta.is_file() && !is_standard_stream(&meta) {
        return Ok(Place::Replace(target));
    }
    #[cfg(unix)]
    if std::os::unix::fs::FileTypeExt::is_block_device(&meta.file_type()) {
        return Err(Refusal::BlockDevice);
    }
    Ok(Place::InPlace(target))
}

/// The file a write to `path` changes: `path` itself, or the file a symbolic link there points
/// to (written through, so that the link stays a link; the target may be yet to be made). A
/// link to an open descriptor (`/dev/stdout`, `/proc/self/fd/1`) is where the chain stops: it
/// is written in place, as a pipe is.
fn link_target(path: &Path) -> Result<PathBuf, Refusal> {
    let mut path = path.to_path_buf();
    // Linux's own limit on the links one path may pass through.
    for _ in 0..40 {
        let link = std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink());
        if !link || is_descriptor(&path) {
            return Ok(path);
        }
        // Relative to the link's folder; an absolute target replaces it.
        path = folder_of(&path).join(std::fs::read_link(&path).map_err(Refusal::Unreadable)?);
    }
    Err(Refusal::LinkChain)
}

/// Whether `path` names an open descriptor of a process (Linux's `/proc/PID/fd/N`, which
/// `/dev/fd/N` and `/dev/stdout` lead to).
fn is_descriptor(path: &Path) -> bool {
    std::fs::canonicalize(folder_of(path))
        .is_ok_and(|dir| dir.starts_with("/proc") && dir.ends_with("fd"))
}

/// Whether the file `meta` describes is where this process's standard output or error goes.
#[cfg(unix)]
fn is_standard_stream(meta: &std::fs::Metadata) -> bool {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;
    let same = |fd: std::os::fd::BorrowedFd| {
        let stream = fd.try_clone_to_owned().map(File::from).and_then(|f| f.metadata());
        stream.is_ok_and(|s| s.dev() == meta.dev() && s.ino() == meta.ino())
    };
    same(std::io::stdout().as_fd()) || same(std::io::stderr().as_fd())
}

#[cfg(not(unix))]
fn is_standard_stream(_meta: &std::fs::Metadata) -> bool {
    false
}

/// Whether writing `output` would change `input`: the same file (by device and inode, so a
/// hard link or another spelling is caught; by its resolved path when it is yet to be made), or
/// a file inside the folder `input`.
fn overlaps(output: &Path, input: &Path) -> bool {
    if same_file(output, input) {
        return true;
    }
    match (resolved(output), resolved(input)) {
        (Some(output), Some(input)) => {
            output == input || (input.is_dir() && output.starts_with(&input))
        }
        _ => false,
    }
}

/// `path` with every link and `..` resolved: its own, or (not made yet) its folder's and its name.
pub fn resolved(path: &Path) -> Option<PathBuf> {
    std::fs::canonicalize(path)
        .ok()
        .or_else(|| Some(std::fs::canonicalize(folder_of(path)).ok()?.join(path.file_name()?)))
}

/// Opens `path` for reading, after refusing what is not a regular file: opening a pipe blocks
/// until something writes to it, and a device may never end.
pub fn open_input(path: &Path) -> std::io::Result<File> {
    if !std::fs::metadata(path)?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a folder, a pipe or a device): give a file",
        ));
    }
    File::open(path)
}

/// The bytes of the file at `path`, read as [`open_input`] opens it.
pub fn read_input(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    open_input(path)?.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Writes `bytes` to `path`: a regular file atomically (a temporary file beside it, synced,
/// then renamed over it, keeping the old file's mode; beside and over a symbolic link's target:
/// the link stays), anything else in place. First removes temporary files of earlier runs that
/// were killed mid-write.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |file| file.write_all(bytes))
}

/// [`write_atomic`] with what goes into the file written by `write`: an error there (or
/// anywhere before the rename) removes the temporary file and leaves `path` as it was.
fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut File) -> std::io::Result<()>,
) -> Result<()> {
    let io = |e: std::io::Error| FileError::Io { path: path.to_path_buf(), message: e.to_string() };
    let place = place_of(path)
        .map_err(|r| FileError::Io { path: path.to_path_buf(), message: r.to_string() })?;
    match place {
        Place::InPlace(target) => write_in_place(&target, write).map_err(io),
        Place::Replace(target) => replace(&target, write).map_err(io),
    }
}

/// Replaces (or makes) the regular file `path` with what `write` writes, atomically.
fn replace(
    path: &Path,
    write: impl FnOnce(&mut File) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let name = path.file_name().ok_or_else(|| std::io::Error::other("not a file path"))?;
    let old = std::fs::metadata(path).ok();
    if let Some(why) = old.as_ref().and_then(write_denied) {
        return Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, why.to_string()));
    }
    let dir = folder_of(path);
    remove_stale_temps(&dir, name);
    let mut tmp = temp_file(&dir, name)?;
    if let Some(old) = &old {
        keep_owner_and_mode(tmp.as_file(), old)?;
    }
    write(tmp.as_file_mut())?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// Gives the new file the mode of the `old` one it replaces and, where the system lets this
/// user (root), its owner.
#[cfg(unix)]
fn keep_owner_and_mode(file: &File, old: &std::fs::Metadata) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mine = file.metadata()?;
    if (mine.uid(), mine.gid()) != (old.uid(), old.gid()) {
        // Only root may give a file away; anyone else's replacement is theirs.
        let _ = std::os::unix::fs::fchown(file, Some(old.uid()), Some(old.gid()));
    }
    file.set_permissions(std::fs::Permissions::from_mode(old.mode() & 0o7777))
}

#[cfg(not(unix))]
fn keep_owner_and_mode(file: &File, old: &std::fs::Metadata) -> std::io::Result<()> {
    file.set_permissions(old.permissions())
}

/// Writes to `target` where it is, after what is there (what this process printed comes
/// first): a pipe, a terminal, a device, or this process's own output.
fn write_in_place(
    target: &Path,
    write: impl FnOnce(&mut File) -> std::io::Result<()>,
) -> std::io::Result<()> {
    // Printing is line by line; a closed stdout is no reason to lose the output.
    let _ = std::io::stdout().flush();
    let mut file = open_in_place(target)?;
    write(&mut file)?;
    file.flush()
}

/// Opens `target` to append to it. A pipe no process reads is an error, not a wait for one.
#[cfg(unix)]
pub fn open_in_place(target: &Path) -> std::io::Result<File> {
    use rustix::fs::OFlags;
    use std::os::unix::fs::OpenOptionsExt;
    let file = OpenOptions::new()
        .append(true)
        .custom_flags(OFlags::NONBLOCK.bits() as i32)
        .open(target)
        .map_err(|e| match e.raw_os_error() {
            Some(code) if code == rustix::io::Errno::NXIO.raw_os_error() => {
                std::io::Error::other("is a pipe that no process reads: start its reader first")
            }
            _ => e,
        })?;
    // Writes then wait for a slow reader rather than fail.
    let flags = rustix::fs::fcntl_getfl(&file)?;
    rustix::fs::fcntl_setfl(&file, flags - OFlags::NONBLOCK)?;
    Ok(file)
}

/// Opens `target` to append to it.
#[cfg(not(unix))]
pub fn open_in_place(target: &Path) -> std::io::Result<File> {
    OpenOptions::new().append(true).open(target)
}

/// The folder a file path is in ("." for a bare name).
fn folder_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// The start of the temporary files' names for `name`: hidden, then the writer's process id
/// (`.{name}.tmp-{pid}-{random}`), so that a later run can tell whether its writer is gone.
fn temp_prefix(name: &std::ffi::OsStr) -> String {
    format!(".{}.tmp-", name.to_string_lossy())
}

/// A new temporary file for `name` in `dir`, removed when dropped unless renamed. Created with
/// the permissions `File::create` gives (0666 less the umask), not `tempfile`'s owner-only
/// default: it becomes the user's output file.
fn temp_file(dir: &Path, name: &std::ffi::OsStr) -> std::io::Result<tempfile::NamedTempFile> {
    let prefix = format!("{}{}-", temp_prefix(name), std::process::id());
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    builder.tempfile_in(dir)
}

/// Removes `dir`'s temporary files for `name` whose process no longer runs (earlier builds
/// named them `.{name}.tmp-{pid}`, without the random part: those too).
fn remove_stale_temps(dir: &Path, name: &std::ffi::OsStr) {
    let prefix = temp_prefix(name);
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = file_name.strip_prefix(&prefix) else { continue };
        let Ok(pid) = rest.split_once('-').map_or(rest, |(pid, _)| pid).parse::<u32>() else {
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

#[cfg(unix)]
mod lock {
    //! An output's advisory lock (flock), held on a hidden file beside it, `.NAME.lock`, that
    //! holds the holder's process id: the output itself is a new file after every atomic write,
    //! which a lock on it would not follow. The kernel releases the lock when its holder ends,
    //! however it ends; the file is removed when the lock is released.

    use super::Refusal;
    use std::fs::{File, OpenOptions};
    use std::io::{Read, Write};
    use std::path::{Path, PathBuf};

    pub struct Lock {
        path: PathBuf,
        _file: File,
    }

    impl Lock {
        /// The lock of `target`; an error naming the process that holds it.
        pub fn acquire(target: &Path) -> Result<Lock, Refusal> {
            let name = target.file_name().unwrap_or_default().to_string_lossy();
            let path = super::folder_of(target).join(format!(".{name}.lock"));
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
                if !super::same_file_as_open(&path, &file) {
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
}

/// Whether the open `file` is the one at `path` now.
#[cfg(unix)]
fn same_file_as_open(path: &Path, file: &File) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(path), file.metadata()) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An output kind every file is, and one no file is.
    const ANY: Kind = Kind { what: "a test output", ours: |_| true };
    const NONE: Kind = Kind { what: "a test output", ours: |_| false };

    /// The names in `dir`, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn an_output_is_refused_where_it_would_destroy_something() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let input = d.join("weights.safetensors");
        std::fs::write(&input, b"precious").unwrap();
        let link = d.join("link.safetensors");
        std::os::unix::fs::symlink(&input, &link).unwrap();
        let hard = d.join("hard.safetensors");
        std::fs::hard_link(&input, &hard).unwrap();
        for same in [&input, &link, &hard] {
            let e = check_output("--out", same, &[&input], ANY, true).err().unwrap().to_string();
            assert!(e.contains("same file as the input"), "{e}");
        }
        let e = check_output("--out", d, &[], ANY, true).err().unwrap().to_string();
        assert!(e.contains("is a folder, not a regular file"), "{e}");
        let missing = d.join("no/such/dir/x");
        let e = check_output("--out", &missing, &[], ANY, true).err().unwrap().to_string();
        assert!(e.contains("does not exist"), "{e}");
        drop(check_output("--out", &d.join("new.safetensors"), &[&input], NONE, false).unwrap());
        assert_eq!(std::fs::read(&input).unwrap(), b"precious");
        assert_eq!(std::fs::read_dir(d).unwrap().count(), 3, "the probe and the lock are removed");
    }

    #[test]
    fn a_write_replaces_whole_and_clears_what_killed_runs_left() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let path = d.join("out.json");
        // Writers that are gone (no such pid; this build's names and earlier builds'), and one
        // that runs (this process's parent).
        let gone = [d.join(".out.json.tmp-4294967295-a1B2c3"), d.join(".out.json.tmp-4294967295")];
        for gone in &gone {
            std::fs::write(gone, b"half").unwrap();
        }
        let parent = std::os::unix::process::parent_id();
        let running = d.join(format!(".out.json.tmp-{parent}-x9Y8z7"));
        std::fs::write(&running, b"in progress").unwrap();
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert!(gone.iter().all(|gone| !gone.exists()) && running.exists());
        assert_eq!(names(d), [running.file_name().unwrap().to_str().unwrap(), "out.json"]);
    }

    #[test]
    fn a_write_that_fails_midway_keeps_the_old_file_and_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let path = d.join("ck.safetensors");
        write_atomic(&path, b"the old checkpoint").unwrap();
        let e = write_atomic_with(&path, |file| {
            file.write_all(b"the new che")?;
            Err(std::io::Error::other("disk full"))
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("disk full") && e.contains("ck.safetensors"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"the old checkpoint");
        assert_eq!(names(d), ["ck.safetensors"], "the temporary file is removed");
        // A rename that fails (a folder where the file goes): an error, nothing left either.
        let folder = d.join("a folder");
        std::fs::create_dir(&folder).unwrap();
        assert!(write_atomic(&folder, b"x").is_err());
        assert_eq!(names(d), ["a folder", "ck.safetensors"]);
    }

    #[test]
    fn a_written_file_has_the_usual_permissions_and_a_link_is_written_through() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        // What `File::create` gives here: 0666 less the umask.
        let plain = d.join("plain");
        std::fs::File::create(&plain).unwrap();
        let path = d.join("out.json");
        write_atomic(&path, b"{}").unwrap();
        assert_eq!(mode(&path), mode(&plain));
        std::fs::create_dir(d.join("runs")).unwrap();
        let target = d.join("runs/target.json");
        std::fs::write(&target, b"old").unwrap();
        let link = d.join("link.json");
        std::os::unix::fs::symlink("runs/target.json", &link).unwrap();
        drop(check_output("--json", &link, &[], ANY, false).unwrap());
        write_atomic(&link, b"new").unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert_eq!(names(&d.join("runs")), ["target.json"]);
        // A link to a file yet to be made makes it; one into a missing folder is refused.
        let ahead = d.join("ahead.json");
        std::os::unix::fs::symlink("runs/new.json", &ahead).unwrap();
        drop(check_output("--json", &ahead, &[], NONE, false).unwrap());
        write_atomic(&ahead, b"made").unwrap();
        assert_eq!(std::fs::read(d.join("runs/new.json")).unwrap(), b"made");
        let dangling = d.join("dangling.json");
        std::os::unix::fs::symlink("runs/none/x.json", &dangling).unwrap();
        let e = check_output("--json", &dangling, &[], ANY, false).err().unwrap().to_string();
        assert!(e.contains("cannot write in") && e.contains("runs/none"), "{e}");
        assert!(write_atomic(&dangling, b"x").is_err());
        assert!(std::fs::symlink_metadata(&dangling).unwrap().file_type().is_symlink());
    }

    #[test]
    fn an_output_inside_an_input_folder_or_onto_one_through_a_link_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let data = d.join("data");
        std::fs::create_dir_all(data.join("cat")).unwrap();
        std::fs::write(data.join("cat/1.png"), b"pixels").unwrap();
        let link = d.join("out.png");
        std::os::unix::fs::symlink(data.join("cat/1.png"), &link).unwrap();
        for (output, says) in [
            (data.join("cat/1.png"), "lies inside the input folder"),
            (data.join("cat/new.json"), "lies inside the input folder"),
            (d.join("data/../data/ck.safetensors"), "lies inside the input folder"),
            (link, "lies inside the input folder"),
        ] {
            let e = check_output("--json", &output, &[&data], ANY, true).err().unwrap().to_string();
            assert!(e.contains(says), "{e}");
        }
        drop(check_output("--json", &d.join("beside.json"), &[&data], ANY, false).unwrap());
        assert_eq!(std::fs::read(data.join("cat/1.png")).unwrap(), b"pixels");
    }

    #[test]
    fn an_input_that_is_not_a_regular_file_is_refused_before_it_is_opened() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            let e = read_input(&fifo).unwrap_err().to_string();
            assert!(e.contains("not a regular file"), "{e}");
        }
        let e = read_input(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    #[test]
    fn a_file_of_another_kind_is_replaced_only_when_asked_and_a_protected_one_never() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let photo = d.join("photo.jpg");
        std::fs::write(&photo, b"pixels").unwrap();
        let e = check_output("-o", &photo, &[], NONE, false).err().unwrap().to_string();
        assert!(e.contains("is not a test output") && e.contains("--overwrite"), "{e}");
        drop(check_output("-o", &photo, &[], NONE, true).unwrap());
        drop(check_output("-o", &photo, &[], ANY, false).unwrap());
        // A replacement keeps the mode of what it replaces.
        std::fs::set_permissions(&photo, std::fs::Permissions::from_mode(0o600)).unwrap();
        write_atomic(&photo, b"ours").unwrap();
        let mode = std::fs::metadata(&photo).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // A write-protected file is never replaced, --overwrite or not, root or not.
        std::fs::set_permissions(&photo, std::fs::Permissions::from_mode(0o444)).unwrap();
        let e = check_output("-o", &photo, &[], ANY, true).err().unwrap().to_string();
        assert!(e.contains("mode 0444") && e.contains("never replaces"), "{e}");
        assert!(write_atomic(&photo, b"x").is_err());
        assert_eq!(std::fs::read(&photo).unwrap(), b"ours");
        assert_eq!(names(d), ["photo.jpg"]);
    }

    #[test]
    fn an_output_is_claimed_once_and_its_lock_is_removed_with_the_claim() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("ck.safetensors");
        let claim = check_output("--checkpoint", &out, &[], ANY, false).unwrap();
        assert_eq!(names(tmp.path()), [".ck.safetensors.lock"]);
        let e = check_output("--log", &out, &[], ANY, false).err().unwrap().to_string();
        assert!(e.contains("two outputs of this command"), "{e}");
        drop(claim);
        assert!(names(tmp.path()).is_empty());
        drop(check_output("--log", &out, &[], ANY, false).unwrap());
        // A file of the user's by the lock's name is neither taken nor removed.
        let theirs = tmp.path().join(".ck.safetensors.lock");
        std::fs::write(&theirs, b"my notes").unwrap();
        let e = check_output("--log", &out, &[], ANY, false).err().unwrap().to_string();
        assert!(e.contains("is not a syncstep lock"), "{e}");
        assert_eq!(std::fs::read(&theirs).unwrap(), b"my notes");
    }

    #[test]
    fn a_pipe_or_a_device_is_written_in_place() {
        let tmp = tempfile::tempdir().unwrap();
        drop(check_output("--json", Path::new("/dev/null"), &[], NONE, false).unwrap());
        write_atomic(Path::new("/dev/null"), b"gone").unwrap();
        let fifo = tmp.path().join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let e = write_atomic(&fifo, b"lost").unwrap_err().to_string();
        assert!(e.contains("no process reads"), "{e}");
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read(fifo).unwrap())
        };
        // The reader may not have opened it yet: the write is tried until it has.
        while write_atomic(&fifo, b"read").is_err() {
            std::thread::yield_now();
        }
        assert_eq!(reader.join().unwrap(), b"read");
        let kind = std::fs::symlink_metadata(&fifo).unwrap().file_type();
        assert!(std::os::unix::fs::FileTypeExt::is_fifo(&kind));
    }
}
