//! Where a path leads: the file a write changes (through links), whether it is written in place
//! (a pipe, a terminal, the command's own output) or replaced, and whether two paths are the
//! same file.

use std::path::{Path, PathBuf};

use super::error::Refusal;

/// Where an output goes.
pub(super) enum Place {
    /// A regular file, new or replaced whole (a temporary file beside it, renamed over it).
    Replace(PathBuf),
    /// Written where it is, after what is there: a pipe, a terminal, a character device, or
    /// this process's own standard output or error.
    InPlace(PathBuf),
}

/// Where a write to `path` goes: the file a symbolic link there points to (the link stays a
/// link; the target may be yet to be made), or in place. A folder or a block device is an
/// error.
pub(super) fn place_of(path: &Path) -> Result<Place, Refusal> {
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
pub(super) fn link_target(path: &Path) -> Result<PathBuf, Refusal> {
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
pub(super) fn is_descriptor(path: &Path) -> bool {
    std::fs::canonicalize(folder_of(path))
        .is_ok_and(|dir| dir.starts_with("/proc") && dir.ends_with("fd"))
}

/// Whether the file `meta` describes is where this process's standard output or error goes.
pub(super) fn is_standard_stream(meta: &std::fs::Metadata) -> bool {
    standard_stream(meta).is_some()
}

/// This process's standard output or error, as a descriptor of its own, when it goes to the
/// file `meta` describes. A write through it moves the stream's own offset: a file opened
/// afresh would write where the stream does not look, and the stream's next line would land
/// over it (`--json /dev/stdout > f`).
#[cfg(unix)]
pub(super) fn standard_stream(meta: &std::fs::Metadata) -> Option<std::fs::File> {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;
    let same = |fd: std::os::fd::BorrowedFd| {
        let stream = std::fs::File::from(fd.try_clone_to_owned().ok()?);
        let s = stream.metadata().ok()?;
        (s.dev() == meta.dev() && s.ino() == meta.ino()).then_some(stream)
    };
    same(std::io::stdout().as_fd()).or_else(|| same(std::io::stderr().as_fd()))
}

#[cfg(not(unix))]
pub(super) fn standard_stream(_meta: &std::fs::Metadata) -> Option<std::fs::File> {
    None
}

/// Whether a write to `path` goes in place (a pipe, a terminal, a character device, this
/// process's own output) rather than replacing a regular file.
pub fn writes_in_place(path: &Path) -> bool {
    matches!(place_of(path), Ok(Place::InPlace(_)))
}

/// Whether writing `output` would change `input`: the same file (by device and inode, so a
/// hard link or another spelling is caught; by its resolved path when it is yet to be made), or
/// a file inside the folder `input`.
pub(super) fn overlaps(output: &Path, input: &Path) -> bool {
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

/// The name of a hidden file beside the file `name` (its lock, its temporary files):
/// `.{name}{suffix}`, `name` cut to its first 200 bytes, so that the side file's name stays
/// within the 255 bytes a name may have where `name` itself nearly fills them.
pub(super) fn side_name(name: &std::ffi::OsStr, suffix: &str) -> String {
    let name = name.to_string_lossy();
    let mut end = name.len().min(200);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!(".{}{suffix}", &name[..end])
}

/// The folder a file path is in ("." for a bare name).
pub(super) fn folder_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Whether `a` and `b` name the same file (hard links and symbolic links included).
pub(super) fn same_file(a: &Path, b: &Path) -> bool {
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

/// Whether the open `file` is the one at `path` now.
#[cfg(unix)]
pub(super) fn same_file_as_open(path: &Path, file: &std::fs::File) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(path), file.metadata()) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// `path` with every link and `..` resolved: its own, or (not made yet) its folder's and its name.
pub fn resolved(path: &Path) -> Option<PathBuf> {
    std::fs::canonicalize(path)
        .ok()
        .or_else(|| Some(std::fs::canonicalize(folder_of(path)).ok()?.join(path.file_name()?)))
}
