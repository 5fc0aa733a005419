//! The user's files: what a command will write is checked before any work (a folder that
//! exists, a regular file or none, never one of the command's own inputs, writable), and every
//! write is atomic (a temporary file beside it, then a rename), so a failed or interrupted write
//! leaves the old file whole. The temporary file is the `tempfile` crate's: created afresh
//! (never an existing file), removed on every error path, renamed over the output when it is
//! whole. Its name holds the writer's process id, so that one a killed run left behind (a kill
//! runs no clean-up) is removed by the next write to the same place. Native only: a browser
//! has no file system.

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
/// variable): its folder exists, it is a regular file or does not exist yet, and a file can be
/// created beside it. It must not be any of `inputs` nor lie inside one: `inputs` are every file
/// and folder the same command reads (a dataset's folder, `--init`, `--log`, …), and writing
/// there would destroy one. A symbolic link is judged by its target, the file it writes.
pub fn check_output(what: &str, path: &Path, inputs: &[&Path]) -> Result<()> {
    let refused = |problem: String| FileError::Refused {
        what: what.to_string(),
        path: path.to_path_buf(),
        problem,
    };
    path.file_name().ok_or_else(|| refused("is not a file path".into()))?;
    let dir = folder_of(path);
    if dir.exists() && !dir.is_dir() {
        return Err(refused(format!("{} is not a folder", dir.display())));
    }
    if !dir.is_dir() {
        return Err(refused(format!("its folder {} does not exist", dir.display())));
    }
    let target = link_target(path).map_err(|e| refused(e.to_string()))?;
    if std::fs::metadata(&target).is_ok_and(|meta| !meta.is_file()) {
        return Err(refused(
            "exists and is not a regular file (a folder, a device or a pipe): it is left alone"
                .into(),
        ));
    }
    if let Some(input) = inputs.iter().find(|input| overlaps(&target, input)) {
        let kind = if input.is_dir() {
            "lies inside the input folder"
        } else {
            "is the same file as the input"
        };
        return Err(refused(format!(
            "{kind} {}: writing it would destroy that input; write it elsewhere",
            input.display()
        )));
    }
    // Writable: the temporary file an atomic write would make (removed when dropped).
    let (dir, name) = (folder_of(&target), target.file_name().unwrap_or(path.as_os_str()));
    temp_file(&dir, name)
        .map_err(|e| refused(format!("cannot write in {} ({e})", dir.display())))?;
    Ok(())
}

/// The file a write to `path` changes: `path` itself, or the file a symbolic link there points
/// to (written through, so that the link stays a link; the target may be yet to be made).
fn link_target(path: &Path) -> std::io::Result<PathBuf> {
    let mut path = path.to_path_buf();
    // Linux's own limit on the links one path may pass through.
    for _ in 0..40 {
        if !std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
            return Ok(path);
        }
        // Relative to the link's folder; an absolute target replaces it.
        path = folder_of(&path).join(std::fs::read_link(&path)?);
    }
    Err(std::io::Error::other("is a chain of more than 40 symbolic links"))
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
fn resolved(path: &Path) -> Option<PathBuf> {
    std::fs::canonicalize(path)
        .ok()
        .or_else(|| Some(std::fs::canonicalize(folder_of(path)).ok()?.join(path.file_name()?)))
}

/// Opens `path` for reading, after refusing what is not a regular file: opening a pipe blocks
/// until something writes to it, and a device may never end.
pub fn open_input(path: &Path) -> std::io::Result<std::fs::File> {
    if !std::fs::metadata(path)?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a folder, a pipe or a device): give a file",
        ));
    }
    std::fs::File::open(path)
}

/// The bytes of the file at `path`, read as [`open_input`] opens it.
pub fn read_input(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    open_input(path)?.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Writes `bytes` to `path` atomically: a temporary file beside it, synced, then renamed over
/// it (beside and over a symbolic link's target: the link stays). First removes temporary files of earlier runs that were killed mid-write.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |file| file.write_all(bytes))
}

/// [`write_atomic`] with what goes into the temporary file written by `write`: an error there
/// (or anywhere before the rename) removes the temporary file and leaves `path` as it was.
fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<()> {
    let io = |e: std::io::Error| FileError::Io { path: path.to_path_buf(), message: e.to_string() };
    let target = link_target(path).map_err(io)?;
    let path = target.as_path();
    let name = path.file_name().ok_or_else(|| FileError::Io {
        path: path.to_path_buf(),
        message: "not a file path".into(),
    })?;
    let dir = folder_of(path);
    remove_stale_temps(&dir, name);
    let mut tmp = temp_file(&dir, name).map_err(io)?;
    write(tmp.as_file_mut()).and_then(|()| tmp.as_file().sync_all()).map_err(io)?;
    tmp.persist(path).map_err(|e| io(e.error))?;
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

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
            let e = check_output("--out", same, &[&input]).unwrap_err().to_string();
            assert!(e.contains("same file as the input"), "{e}");
        }
        let e = check_output("--out", d, &[]).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let e = check_output("--out", Path::new("/dev/null"), &[]).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let e = check_output("--out", &d.join("no/such/dir/x"), &[]).unwrap_err().to_string();
        assert!(e.contains("does not exist"), "{e}");
        check_output("--out", &d.join("new.safetensors"), &[&input]).unwrap();
        assert_eq!(std::fs::read(&input).unwrap(), b"precious");
        assert_eq!(std::fs::read_dir(d).unwrap().count(), 3, "the probe is removed");
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
        check_output("--json", &link, &[]).unwrap();
        write_atomic(&link, b"new").unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert_eq!(names(&d.join("runs")), ["target.json"]);
        // A link to a file yet to be made makes it; one into a missing folder is refused.
        let ahead = d.join("ahead.json");
        std::os::unix::fs::symlink("runs/new.json", &ahead).unwrap();
        check_output("--json", &ahead, &[]).unwrap();
        write_atomic(&ahead, b"made").unwrap();
        assert_eq!(std::fs::read(d.join("runs/new.json")).unwrap(), b"made");
        let dangling = d.join("dangling.json");
        std::os::unix::fs::symlink("runs/none/x.json", &dangling).unwrap();
        let e = check_output("--json", &dangling, &[]).unwrap_err().to_string();
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
            let e = check_output("--json", &output, &[&data]).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
        check_output("--json", &d.join("beside.json"), &[&data]).unwrap();
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
}
