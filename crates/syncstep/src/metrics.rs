//! A training run's metrics log: JSON Lines, one [`Record`] a line, each written whole and
//! flushed as it comes, so that a killed run keeps every line it wrote (the last one perhaps cut
//! short, which the reader skips).
//!
//! The file is made (or, resumed, opened) at the first record, so a run that fails before one
//! leaves no log behind, and an existing one as it was. A run resumed from a checkpoint appends
//! to the same log and drops nothing. The log may then
//! hold a step twice: once from the run that got further before it was stopped, once from the
//! run resumed from an earlier checkpoint. The reader keeps the later: a training record of step
//! s replaces everything read so far of step s or later. An evaluation record follows the
//! training record of its step, and is merged into it.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::files::{self, Claim, FileError, Kind};

/// One line of the log: a training step (`loss` set) or an evaluation after a step (`val_top1`
/// set, `loss` not), or both at once. Fields not measured are left out of the line.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Record {
    /// Steps done when recorded: 1 after the first step, 0 for an evaluation before training.
    pub step: u64,
    /// The epoch this step belongs to (0-based).
    pub epoch: u64,
    /// The step's training loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f32>,
    /// The learning rate the step used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f32>,
    /// Training images per second over the step's wall time, all replicas together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images_per_s: Option<f64>,
    /// Fraction (0..1) of the step's wall time spent waiting for data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_wait: Option<f64>,
    /// Top-1 accuracy (0..1) on the validation set, on a line written after an evaluation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_top1: Option<f64>,
    /// Top-5 accuracy (0..1) on the validation set, on a line written after an evaluation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_top5: Option<f64>,
}

impl Record {
    /// Whether this records a training step (rather than only an evaluation).
    pub fn is_training(&self) -> bool {
        self.loss.is_some()
    }

    /// Takes every field `later` sets, keeping this record's others.
    fn merge(&mut self, later: Record) {
        self.epoch = later.epoch;
        self.loss = later.loss.or(self.loss);
        self.lr = later.lr.or(self.lr);
        self.images_per_s = later.images_per_s.or(self.images_per_s);
        self.data_wait = later.data_wait.or(self.data_wait);
        self.val_top1 = later.val_top1.or(self.val_top1);
        self.val_top5 = later.val_top5.or(self.val_top5);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("--log {}: exists; choose another --log or remove it", path.display())]
    Exists { path: PathBuf },
    #[error(
        "{}, line {line}: not a metrics record ({message}); give the --log file of a training run, or remove that line",
        path.display()
    )]
    Malformed { path: PathBuf, line: usize, message: String },
    #[error(
        "--log {}: its last line ({line}) is not a whole record and has no newline; a resumed run appends only after whole lines and never cuts one: remove that line, or give another --log",
        path.display()
    )]
    LastLine { path: PathBuf, line: usize },
    #[error("metrics log {}: {message}", path.display())]
    Io { path: PathBuf, message: String },
    #[error(transparent)]
    File(#[from] FileError),
}

pub type Result<T, E = MetricsError> = std::result::Result<T, E>;

/// What a metrics log is to an output check: a file whose first line is a [`Record`] that
/// carries its own check (a hash of the rest of it), which a line another tool wrote does not,
/// however like a record it looks.
pub const KIND: Kind = Kind { what: "a syncstep metrics log (a train --log file)", ours: is_log };

fn is_log(path: &Path) -> bool {
    use std::io::{BufRead, Read};
    let Ok(file) = files::open_input(path) else { return false };
    // A line's worth is enough to tell; a large file of another kind is not read whole.
    let mut first = String::new();
    let read = std::io::BufReader::new(file.take(1 << 16)).read_line(&mut first);
    read.is_ok() && is_checked_line(&first)
}

/// The line `record` is written as: its JSON, with a last field `check` holding the first 8
/// bytes (in hex) of the SHA-256 of that JSON without it.
fn line_of(record: &Record) -> serde_json::Result<String> {
    let json = serde_json::to_string(record)?;
    let body = json.strip_suffix('}').unwrap_or(&json);
    Ok(format!("{body},\"check\":\"{}\"}}\n", check_of(&json)))
}

fn check_of(json: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(json.as_bytes())[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `line` is one [`line_of`] wrote, its check matching the rest.
fn is_checked_line(line: &str) -> bool {
    let line = line.strip_suffix('\n').unwrap_or(line);
    let Some((body, check)) = line.strip_suffix("\"}").and_then(|l| l.rsplit_once(",\"check\":\""))
    else {
        return false;
    };
    check == check_of(&format!("{body}}}"))
}

/// A metrics log for a run: its file is opened at the first record.
pub struct MetricsLog {
    path: PathBuf,
    file: Option<File>,
    start: Start,
    _claim: Claim,
}

/// How a log's file is opened at its first record.
enum Start {
    /// Made anew; `replace`: emptied, the file there being replaced (`--overwrite`).
    Fresh { replace: bool },
    /// A pipe, a terminal or the run's own output (`/dev/stdout`): written to where it is.
    InPlace,
    /// Appended to (made if there is none). A whole last line without its newline gets one
    /// (`newline`), so that the next line starts whole.
    Append { newline: bool },
}

impl MetricsLog {
    /// A log at `path` for a run. A fresh run (`resume_step` None) refuses a file that exists
    /// (another run's log) unless `overwrite`. A run resumed from the checkpoint of
    /// `resume_step` appends to it; its lines must be a metrics log. `inputs` are the run's
    /// other files (its data, weights, checkpoint), none of which the log may be. Nothing is
    /// written until the first record.
    pub fn open(
        path: &Path,
        resume_step: Option<u64>,
        inputs: &[&Path],
        overwrite: bool,
    ) -> Result<MetricsLog> {
        let claim = files::check_output("--log", path, inputs, KIND, overwrite)?;
        let exists = std::fs::metadata(path).is_ok();
        let start = match resume_step {
            _ if files::writes_in_place(path) => Start::InPlace,
            None if exists && !overwrite => {
                return Err(MetricsError::Exists { path: path.to_path_buf() })
            }
            None => Start::Fresh { replace: exists },
            // Another tool's file, which only --overwrite lets through: replaced, never added to.
            Some(_) if exists && !is_log(path) => Start::Fresh { replace: true },
            Some(step) => appending(path, step)?,
        };
        Ok(MetricsLog { path: path.to_path_buf(), file: None, start, _claim: claim })
    }

    /// Appends `record` as one line, in one write to the file (unbuffered: nothing waits in
    /// memory for a killed run to lose).
    pub fn write(&mut self, record: &Record) -> Result<()> {
        let line = line_of(record)
            .map_err(|e| MetricsError::Io { path: self.path.clone(), message: e.to_string() })?;
        let file = match self.file.take() {
            Some(file) => file,
            None => self.open_file()?,
        };
        let file = self.file.insert(file);
        // A line the disk had no room for is taken back whole: the log keeps whole records.
        let before = file.metadata().ok().filter(|m| m.is_file()).map(|m| m.len());
        file.write_all(line.as_bytes()).map_err(|e| {
            if let Some(len) = before {
                let _ = file.set_len(len);
            }
            io_error(&self.path, e)
        })
    }

    /// The log's file, opened as `start` says.
    fn open_file(&self) -> Result<File> {
        let io = |e: std::io::Error| io_error(&self.path, e);
        match self.start {
            Start::InPlace => files::open_in_place(&self.path).map_err(io),
            Start::Fresh { replace } => {
                let mut options = OpenOptions::new();
                match replace {
                    true => options.write(true).create(true).truncate(true),
                    false => options.write(true).create_new(true),
                };
                options.open(&self.path).map_err(|e| match e.kind() {
                    std::io::ErrorKind::AlreadyExists => {
                        MetricsError::Exists { path: self.path.clone() }
                    }
                    _ => io(e),
                })
            }
            Start::Append { newline } => {
                let file =
                    OpenOptions::new().append(true).create(true).open(&self.path).map_err(io)?;
                if newline {
                    (&file).write_all(b"\n").map_err(io)?;
                }
                Ok(file)
            }
        }
    }
}

/// How a run resumed from the checkpoint of `step` appends to the log at `path` (if any): its
/// lines must be a metrics log.
fn appending(path: &Path, step: u64) -> Result<Start> {
    let text = match read_text(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        read => read.map_err(|e| io_error(path, e))?,
    };
    if parse(path, &text)?.iter().any(|r| r.step > step) {
        log::info!(
            "{} holds records past step {step}: the resumed run's records of those steps replace them",
            path.display()
        );
    }
    let whole = text.rfind('\n').map_or(0, |i| i + 1);
    let tail = &text[whole..];
    match tail {
        "" => Ok(Start::Append { newline: false }),
        // The last line is whole but for its newline.
        _ if record_of(tail).is_ok() => Ok(Start::Append { newline: true }),
        // Not a record: perhaps a line a run cut short, perhaps the user's; never cut off.
        _ => Err(MetricsError::LastLine { path: path.to_path_buf(), line: text.lines().count() }),
    }
}

/// The log at `path` as text (refused, not opened, when it is not a regular file).
fn read_text(path: &Path) -> std::io::Result<String> {
    String::from_utf8(files::read_input(path)?)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Every record of the log at `path`, one per step, sorted by step. A malformed line is an
/// error naming its number, except a last line cut short (a killed run), which is skipped. A
/// step recorded more than once keeps its last training record and the evaluations after it;
/// records of later steps read before it were written by a run that was then resumed from an
/// earlier checkpoint, and are dropped.
pub fn read(path: &Path) -> Result<Vec<Record>> {
    let text = read_text(path).map_err(|e| io_error(path, e))?;
    let mut steps: BTreeMap<u64, Record> = BTreeMap::new();
    for record in parse(path, &text)? {
        if record.is_training() {
            steps.split_off(&record.step);
            steps.insert(record.step, record);
        } else if let Some(kept) = steps.get_mut(&record.step) {
            kept.merge(record);
        } else {
            steps.insert(record.step, record);
        }
    }
    Ok(steps.into_values().collect())
}

/// The records of `text` in the order written. Blank lines are skipped; so is a last line
/// without its newline that does not parse (a write a killed run cut short).
fn parse(path: &Path, text: &str) -> Result<Vec<Record>> {
    let mut records = Vec::new();
    let mut lines = text.split_inclusive('\n').enumerate().peekable();
    while let Some((index, line)) = lines.next() {
        if line.trim().is_empty() {
            continue;
        }
        match record_of(line) {
            Ok(record) => records.push(record),
            Err(_) if lines.peek().is_none() && !line.ends_with('\n') => {
                log::warn!(
                    "{}: skipping line {}, cut short (a run stopped while writing it)",
                    path.display(),
                    index + 1
                );
            }
            Err(e) => {
                return Err(MetricsError::Malformed {
                    path: path.to_path_buf(),
                    line: index + 1,
                    message: e,
                })
            }
        }
    }
    Ok(records)
}

/// The record a line holds: a JSON object of a record's fields (serde would also read a
/// record's fields from an array, `[1, 2, 3]`, which no log of ours holds).
fn record_of(line: &str) -> Result<Record, String> {
    if !line.trim_start().starts_with('{') {
        return Err("not a JSON object".into());
    }
    serde_json::from_str(line).map_err(|e| e.to_string())
}

fn io_error(path: &Path, e: std::io::Error) -> MetricsError {
    MetricsError::Io { path: path.to_path_buf(), message: e.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh folder of this test's own, removed when dropped, however the test ends.
    fn dir(test: &str) -> tempfile::TempDir {
        tempfile::Builder::new().prefix(&format!("syncstep-metrics-{test}-")).tempdir().unwrap()
    }

    fn training(step: u64, loss: f32) -> Record {
        Record {
            step,
            epoch: step / 10,
            loss: Some(loss),
            lr: Some(0.1),
            images_per_s: Some(250.5),
            data_wait: Some(0.125),
            ..Record::default()
        }
    }

    fn evaluation(step: u64, top1: f64) -> Record {
        Record { step, epoch: step / 10, val_top1: Some(top1), ..Record::default() }
    }

    #[test]
    fn records_read_back_as_written() {
        let tmp = dir("round-trip");
        let d = tmp.path();
        let path = d.join("metrics.jsonl");
        let mut log = MetricsLog::open(&path, None, &[], false).unwrap();
        let mut both = training(2, 1.5);
        both.val_top1 = Some(0.25);
        both.val_top5 = Some(0.75);
        let written = [evaluation(0, 0.1), training(1, 2.25), both];
        for r in &written {
            log.write(r).unwrap();
        }
        drop(log);
        assert_eq!(read(&path).unwrap(), written);
        let text = std::fs::read_to_string(&path).unwrap();
        let first = text.lines().next().unwrap();
        assert!(first.starts_with(r#"{"step":0,"epoch":0,"val_top1":0.1,"check":""#), "{first}");
        assert!(is_checked_line(first));
        // A changed value, or a line that only looks like a record: no check of ours.
        assert!(!is_checked_line(&first.replace("0.1", "0.2")));
        assert!(!is_checked_line(r#"{"step":0,"epoch":0,"val_top1":0.1}"#));
    }

    #[test]
    fn a_last_line_cut_short_is_skipped() {
        let tmp = dir("cut");
        let d = tmp.path();
        let path = d.join("metrics.jsonl");
        std::fs::write(&path, "{\"step\":1,\"epoch\":0,\"loss\":2.5}\n{\"step\":2,\"ep").unwrap();
        assert_eq!(
            read(&path).unwrap(),
            [Record { step: 1, loss: Some(2.5), ..Record::default() }]
        );
    }

    #[test]
    fn a_bad_middle_line_is_an_error_naming_it() {
        let tmp = dir("bad");
        let d = tmp.path();
        let path = d.join("metrics.jsonl");
        let text = "{\"step\":1,\"epoch\":0,\"loss\":2.5}\n\nnot json\n{\"step\":2,\"epoch\":0}\n";
        std::fs::write(&path, text).unwrap();
        let e = read(&path).unwrap_err().to_string();
        assert!(e.contains("metrics.jsonl, line 3:"), "{e}");
        // A whole last line (its newline written) that does not parse is no cut write either.
        std::fs::write(&path, "{\"step\":1,\"epoch\":0}\n{\"step\":\"two\"}\n").unwrap();
        let e = read(&path).unwrap_err().to_string();
        assert!(e.contains("line 2:"), "{e}");
        // An array of a record's values is no record.
        std::fs::write(&path, "[1,2,3]\n").unwrap();
        let e = read(&path).unwrap_err().to_string();
        assert!(e.contains("line 1: not a metrics record (not a JSON object)"), "{e}");
    }

    #[test]
    fn a_resumed_run_supersedes_the_steps_it_repeats_and_evaluations_merge() {
        let tmp = dir("resume");
        let d = tmp.path();
        let path = d.join("metrics.jsonl");
        let mut log = MetricsLog::open(&path, None, &[], false).unwrap();
        for step in 1..=4 {
            log.write(&training(step, 3.0)).unwrap();
        }
        log.write(&evaluation(2, 0.5)).unwrap();
        log.write(&evaluation(4, 0.9)).unwrap();
        drop(log);
        // Resumed from the checkpoint of step 2: steps 3 and 4 run again.
        let mut log = MetricsLog::open(&path, Some(2), &[], false).unwrap();
        log.write(&training(3, 1.0)).unwrap();
        log.write(&training(4, 0.5)).unwrap();
        log.write(&evaluation(4, 0.6)).unwrap();
        drop(log);
        let records = read(&path).unwrap();
        assert_eq!(records.iter().map(|r| r.step).collect::<Vec<_>>(), [1, 2, 3, 4]);
        let mut two = training(2, 3.0);
        two.val_top1 = Some(0.5);
        assert_eq!(records[1], two, "the evaluation is merged into its step");
        assert_eq!(records[2], training(3, 1.0), "the later run wins");
        let mut four = training(4, 0.5);
        four.val_top1 = Some(0.6);
        assert_eq!(records[3], four);
    }

    #[test]
    fn a_fresh_run_refuses_an_existing_log_and_makes_its_own_at_its_first_record() {
        let tmp = dir("exists");
        let d = tmp.path();
        let path = d.join("metrics.jsonl");
        MetricsLog::open(&path, None, &[], false).unwrap().write(&training(1, 2.5)).unwrap();
        let line = std::fs::read_to_string(&path).unwrap();
        let e = MetricsLog::open(&path, None, &[], false).err().unwrap().to_string();
        assert!(e.contains("exists; choose another --log or remove it"), "{e}");
        let notes = d.join("notes.txt");
        std::fs::write(&notes, "precious").unwrap();
        let e = MetricsLog::open(&notes, None, &[], false).err().unwrap().to_string();
        assert!(e.contains("is not a syncstep metrics log") && e.contains("--overwrite"), "{e}");
        assert_eq!(std::fs::read(&notes).unwrap(), b"precious");
        let e = MetricsLog::open(d, None, &[], false).err().unwrap().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        // Replaced, with --overwrite, only at the first record; made only then.
        drop(MetricsLog::open(&path, None, &[], true).unwrap());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), line);
        let mut log = MetricsLog::open(&path, None, &[], true).unwrap();
        log.write(&training(7, 1.0)).unwrap();
        assert_eq!(read(&path).unwrap(), [training(7, 1.0)]);
        let never = d.join("never.jsonl");
        drop(MetricsLog::open(&never, None, &[], false).unwrap());
        assert!(!never.exists());
    }

    #[test]
    fn a_resumed_run_appends_only_to_its_own_log_and_never_cuts_a_line() {
        let tmp = dir("append");
        let d = tmp.path();
        let path = d.join("metrics.jsonl");
        MetricsLog::open(&path, None, &[], false).unwrap().write(&training(1, 2.5)).unwrap();
        let ours = std::fs::read_to_string(&path).unwrap();
        // A last line that is not a whole record, a run's cut write or the user's note, is
        // neither cut off nor appended after.
        for tail in ["{\"step\":2,\"ep", "my note, no newline"] {
            std::fs::write(&path, format!("{ours}{tail}")).unwrap();
            let e = MetricsLog::open(&path, Some(1), &[], false).err().unwrap().to_string();
            assert!(e.contains("last line (2) is not a whole record"), "{e}");
            assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{ours}{tail}"));
        }
        // A whole last line without its newline is kept, and the next line starts after it.
        std::fs::write(&path, ours.trim_end()).unwrap();
        MetricsLog::open(&path, Some(1), &[], false).unwrap().write(&training(2, 2.0)).unwrap();
        assert_eq!(read(&path).unwrap(), [training(1, 2.5), training(2, 2.0)]);
        // A resumed run starts a log that is not there yet.
        let fresh = d.join("new.jsonl");
        MetricsLog::open(&fresh, Some(5), &[], false).unwrap().write(&training(6, 1.0)).unwrap();
        assert_eq!(read(&fresh).unwrap(), [training(6, 1.0)]);
        // Another tool's file is never appended to, however like a log it looks; --overwrite
        // replaces it.
        let other = d.join("other.jsonl");
        let theirs = "{\"step\":10,\"epoch\":0,\"loss\":1.0}\n";
        let notes = d.join("notes.txt");
        std::fs::write(&notes, "my notes\nmore").unwrap();
        for (file, content) in [(&other, theirs), (&notes, "my notes\nmore")] {
            std::fs::write(file, content).unwrap();
            let e = MetricsLog::open(file, Some(1), &[], false).err().unwrap().to_string();
            assert!(e.contains(": exists and is not a syncstep metrics log"), "{e}");
            assert_eq!(std::fs::read_to_string(file).unwrap(), content);
        }
        MetricsLog::open(&other, Some(1), &[], true).unwrap().write(&training(2, 2.0)).unwrap();
        assert_eq!(read(&other).unwrap(), [training(2, 2.0)]);
    }
}
