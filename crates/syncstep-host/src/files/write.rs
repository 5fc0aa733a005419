//! Writes: a regular file replaced whole and atomically (a temporary file beside it, synced,
//! renamed over it, keeping its mode and owner), anything else written in place; the temporary
//! files killed runs left are cleared on the next write.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use super::error::{FileError, Refusal, Result};
use super::place::{folder_of, place_of, Place};

/// Writes `bytes` to `path`: a regular file atomically (a temporary file beside it, synced,
/// then renamed over it, keeping the old file's mode; beside and over a symbolic link's target:
/// the link stays), anything else in place. First removes temporary files of earlier runs that
/// were killed mid-write.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |file| file.write_all(bytes))
}

/// [`write_atomic`] with what goes into the file written by `write`: an error there (or
/// anywhere before the rename) removes the temporary file and leaves `path` as it was.
pub(super) fn write_atomic_with(
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
pub(super) fn replace(
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
pub(super) fn keep_owner_and_mode(file: &File, old: &std::fs::Metadata) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mine = file.metadata()?;
    if (mine.uid(), mine.gid()) != (old.uid(), old.gid()) {
        // Only root may give a file away; anyone else's replacement is theirs.
        let _ = std::os::unix::fs::fchown(file, Some(old.uid()), Some(old.gid()));
    }
    file.set_permissions(std::fs::Permissions::from_mode(old.mode() & 0o7777))
}

#[cfg(not(unix))]
pub(super) fn keep_owner_and_mode(file: &File, old: &std::fs::Metadata) -> std::io::Result<()> {
    file.set_permissions(old.permissions())
}

/// Writes to `target` where it is, after what is there (what this process printed comes
/// first): a pipe, a terminal, a device, or this process's own output.
pub(super) fn write_in_place(
    target: &Path,
    write: impl FnOnce(&mut File) -> std::io::Result<()>,
) -> std::io::Result<()> {
    // Printing is line by line; a closed stdout is no reason to lose the output.
    let _ = std::io::stdout().flush();
    let mut file = open_in_place(target)?;
    write(&mut file)?;
    file.flush()
}

/// Opens `target` to append to it: this process's own standard output or error is written
/// through that stream's descriptor (so what it prints next comes after). A pipe no process
/// reads is an error, not a wait for one.
#[cfg(unix)]
pub fn open_in_place(target: &Path) -> std::io::Result<File> {
    use rustix::fs::OFlags;
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(stream) =
        std::fs::metadata(target).ok().and_then(|m| super::place::standard_stream(&m))
    {
        return Ok(stream);
    }
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

/// The start of the temporary files' names for `name`: hidden, then the writer's process id
/// (`.{name}.tmp-{pid}-{random}`), so that a later run can tell whether its writer is gone.
pub(super) fn temp_prefix(name: &std::ffi::OsStr) -> String {
    super::place::side_name(name, ".tmp-")
}

/// A new temporary file for `name` in `dir`, removed when dropped unless renamed. Created with
/// the permissions `File::create` gives (0666 less the umask), not `tempfile`'s owner-only
/// default: it becomes the user's output file.
pub(super) fn temp_file(
    dir: &Path,
    name: &std::ffi::OsStr,
) -> std::io::Result<tempfile::NamedTempFile> {
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
pub(super) fn remove_stale_temps(dir: &Path, name: &std::ffi::OsStr) {
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
pub(super) fn abandoned(pid: u32, entry: &std::fs::DirEntry) -> bool {
    let proc = Path::new("/proc");
    if proc.is_dir() {
        return !proc.join(pid.to_string()).exists();
    }
    let age = entry.metadata().and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
    age.is_some_and(|age| age > std::time::Duration::from_secs(3600))
}

/// Why this user may not replace the file `meta` describes, if its mode bits say so: the
/// owner's bits for its owner, the group's for its group, the others' for everyone else, root
/// included (root could, but a file that says it is not to be written is not replaced).
#[cfg(unix)]
pub(super) fn write_denied(meta: &std::fs::Metadata) -> Option<Refusal> {
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
pub(super) fn write_denied(meta: &std::fs::Metadata) -> Option<Refusal> {
    meta.permissions().readonly().then_some(Refusal::ReadOnly)
}
