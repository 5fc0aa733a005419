//! The user's files: refusals, atomic writes, in-place writes, claims and locks.

use std::io::Write;
use std::path::Path;

use super::input::*;
use super::output::*;
use super::write::*;

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
    let slash = d.join("new.safetensors/");
    let e = check_output("--out", &slash, &[], ANY, true).err().unwrap().to_string();
    assert!(e.contains("is not a file path"), "{e}");
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

/// A name that nearly fills the 255 bytes a name may have: its lock and temporary file keep
/// the start of it.
#[test]
fn an_output_of_the_longest_name_is_claimed_and_written() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(format!("{}.svg", "x".repeat(251)));
    let claim = check_output("-o", &path, &[], NONE, false).unwrap();
    write_atomic(&path, b"drawn").unwrap();
    drop(claim);
    assert_eq!(std::fs::read(&path).unwrap(), b"drawn");
    assert_eq!(names(tmp.path()), [path.file_name().unwrap().to_str().unwrap()]);
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
    assert!(e.contains("not a lock of syncstep's"), "{e}");
    assert_eq!(std::fs::read(&theirs).unwrap(), b"my notes");
}

#[test]
fn a_lock_is_never_followed_nor_taken_from_the_user_and_a_stale_one_is_rewritten_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let out = d.join("ck.safetensors");
    let lock = d.join(".ck.safetensors.lock");
    let claim_refused = |says: &str| {
        let e = check_output("--checkpoint", &out, &[], ANY, false).err().unwrap().to_string();
        assert!(e.contains(says) && e.contains(".ck.safetensors.lock"), "{e}");
    };
    // A link to a user's file (a number in it, or nothing), and a dangling one: not followed.
    let theirs = d.join("numbers.txt");
    for content in [&b"12345"[..], b""] {
        std::fs::write(&theirs, content).unwrap();
        std::os::unix::fs::symlink(&theirs, &lock).unwrap();
        claim_refused("is a symbolic link");
        assert_eq!(std::fs::read(&theirs).unwrap(), content);
        std::fs::remove_file(&lock).unwrap();
    }
    std::os::unix::fs::symlink(d.join("made.txt"), &lock).unwrap();
    claim_refused("is a symbolic link");
    assert!(!d.join("made.txt").exists(), "nothing is made through a dangling link");
    std::fs::remove_file(&lock).unwrap();
    // A user's file holding a process id (of a process that is gone), or the lock's words with
    // more after them: theirs.
    for content in [&b"42"[..], b"4294967295\n", b"syncstep lock: process 2147483646\nmine\n"] {
        std::fs::write(&lock, content).unwrap();
        claim_refused("does not hold a syncstep lock");
        assert_eq!(std::fs::read(&lock).unwrap(), content);
    }
    // A pipe there is not read (that would wait).
    std::fs::remove_file(&lock).unwrap();
    assert!(std::process::Command::new("mkfifo").arg(&lock).status().unwrap().success());
    claim_refused("is not a regular file");
    std::fs::remove_file(&lock).unwrap();
    // A lock whose process runs (this one's parent) and holds no lock: not taken.
    let parent = format!("syncstep lock: process {}\n", std::os::unix::process::parent_id());
    std::fs::write(&lock, &parent).unwrap();
    claim_refused("which still runs");
    assert_eq!(std::fs::read(&lock).unwrap(), parent.as_bytes());
    // A lock whose process is gone is taken over, twice in a row, and holds this process's
    // lock whole each time (not the new id written after the old one's length).
    let mine = format!("syncstep lock: process {}\n", std::process::id());
    for gone in [2147483646, 2147483645] {
        std::fs::write(&lock, format!("syncstep lock: process {gone}\n")).unwrap();
        let claim = check_output("--checkpoint", &out, &[], ANY, false).unwrap();
        assert_eq!(std::fs::read_to_string(&lock).unwrap(), mine);
        drop(claim);
        assert!(!lock.exists());
    }
    assert_eq!(names(d), ["numbers.txt"]);
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
