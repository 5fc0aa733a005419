//! Round five of the hostile user's cases: what syncstep writes beside an output (its lock, a
//! shader dump, a report's closing line, a log's next line) never touches a file of the
//! user's, and an environment value without a bound is refused before it is used. Each case
//! holds every file under its folder byte for byte.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::common::*;
use crate::reliability::{gpu_test_dir, one_step_checkpoint, refused, run, snapshot, text};

/// The JSON report in `printed` (from a line's leading `{` to the last `}`) parses: nothing printed
/// after it landed over its start.
#[track_caller]
fn holds_whole_json(printed: &str) {
    let start = match printed.starts_with('{') {
        true => 0,
        false => printed.find("\n{").unwrap_or_else(|| panic!("no report in:\n{printed}")) + 1,
    };
    let end = printed.rfind('}').unwrap_or_else(|| panic!("no end:\n{printed}")) + 1;
    let report = &printed[start..end];
    serde_json::from_str::<serde_json::Value>(report)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{printed}"));
}

/// `syncstep args` with its standard output (`stderr`: its error) in the file at `path`,
/// opened as a shell's `>` does (`append`: as `>>` does).
fn redirected(args: &[&str], path: &Path, append: bool, stderr: bool) -> (bool, String) {
    let mut options = std::fs::OpenOptions::new();
    match append {
        true => options.append(true).create(true),
        false => options.write(true).create(true).truncate(true),
    };
    let file = options.open(path).unwrap();
    let mut c = command();
    c.args(args).stdin(Stdio::null());
    let o = match stderr {
        true => c.stderr(file).output().unwrap(),
        false => c.stdout(file).output().unwrap(),
    };
    (o.status.success(), format!("{}{}", text(&o), std::fs::read_to_string(path).unwrap()))
}

/// `eval`, `check` and `bench --json /dev/stdout > f` (and `>>`) leave the report whole in f;
/// `--log /dev/stdout > f` and `--log /dev/stderr 2> f` take the records there.
fn a_report_or_a_log_to_a_redirected_stream_stays_whole() {
    let tmp = gpu_test_dir();
    let dir = tmp.path();
    let good = one_step_checkpoint(dir);
    let g = good.to_str().unwrap();
    let out = dir.join("out.txt");
    let json = ["--json", "/dev/stdout"];
    let reports: [&[&str]; 3] = [
        &["eval", "--checkpoint", g, "--examples", "2"],
        &["check", "--replicas", "1", "--batch", "2", "--steps", "0"],
        &["bench", "--batch", "2", "--steps", "1", "--warmup", "1", "--no-roofline"],
    ];
    for (i, args) in reports.iter().enumerate() {
        let append = i == 0;
        if append {
            std::fs::write(&out, "before\n").unwrap();
        }
        let (ok, printed) = redirected(&[args, &json[..]].concat(), &out, append, false);
        assert!(ok, "{args:?}: {printed}");
        holds_whole_json(&std::fs::read_to_string(&out).unwrap());
        assert!(!append || printed.contains("before\n"), "{printed}");
    }
    let train = ["train", "--steps", "2", "--batch", "2", "--eval-examples", "0"];
    for (log, stderr) in [("/dev/stdout", false), ("/dev/stderr", true)] {
        let (ok, _) = redirected(&[&train[..], &["--log", log]].concat(), &out, false, stderr);
        let printed = std::fs::read_to_string(&out).unwrap();
        assert!(ok && printed.contains("{\"step\":2,\"epoch\":0,\"loss\":"), "{log}: {printed}");
        assert!(printed.lines().filter(|l| l.starts_with("{\"step\":")).count() == 2, "{printed}");
    }
    eprintln!("5 cases");
}

/// A command's arguments, the variables it runs with, and what its refusal says.
type Case<'a> = (&'a [&'a str], Vec<(&'a str, &'a str)>, &'a str);

/// A lock's name taken by a link or a file of the user's, a shader dump into a folder of the
/// user's or the data, a resume onto a log whose last line is the user's, environment values
/// past every bound: refused, every file as it was.
fn nothing_of_the_users_is_touched_by_a_side_file() {
    let tmp = gpu_test_dir();
    let dir = tmp.path();
    let good = one_step_checkpoint(dir);
    let g = good.to_str().unwrap();
    let user = dir.join("user_numbers.txt");
    std::fs::write(&user, "12345").unwrap();
    let ck = dir.join("sym.safetensors");
    let lock = dir.join(".sym.safetensors.lock");
    let c = ck.to_str().unwrap();
    let train = ["train", "--steps", "1", "--batch", "2", "--eval-examples", "0"];
    let with_ck = [&train[..], &["--checkpoint", c]].concat();
    let data = dir.join("data");
    std::fs::create_dir_all(data.join("cat")).unwrap();
    std::fs::write(data.join("cat/avgpool.wgsl"), "a user's file").unwrap();
    let log = dir.join("run.jsonl");
    let l = log.to_str().unwrap();
    let o = run(
        &["train", "--resume", g, "--steps", "2", "--eval-examples", "0", "--log", l],
        &[],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    let mut log_text = std::fs::read_to_string(&log).unwrap();
    log_text.push_str("my note, no newline");
    std::fs::write(&log, &log_text).unwrap();
    let fifo = dir.join("fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let (cat, f) = (data.join("cat"), fifo.to_str().unwrap());
    let resume_log = ["train", "--resume", g, "--steps", "3", "--eval-examples", "0", "--log", l];
    let cases: Vec<Case> = vec![
        (&with_ck, vec![], "is a symbolic link, so it is not a lock of syncstep's"),
        (&train, vec![("SYNCSTEP_DUMP_SHADERS", cat.to_str().unwrap())], "it is not empty"),
        (&train, vec![("SYNCSTEP_DUMP_SHADERS", dir.to_str().unwrap())], "it is not empty"),
        (&resume_log, vec![], "is not a whole record"),
        (&["info"], vec![("SYNCSTEP_MPI_SILENCE", "1e300")], "1 to 86400"),
        (&train, vec![("SYNCSTEP_MPI_SILENCE", "1e20")], "1 to 86400"),
        (&train, vec![("SYNCSTEP_AUTOTUNE_CACHE", f)], "a pipe or a device"),
        (&train, vec![("SYNCSTEP_AUTOTUNE_CACHE", "/dev/stdout")], "SYNCSTEP_AUTOTUNE_CACHE"),
    ];
    std::os::unix::fs::symlink(&user, &lock).unwrap();
    let before = snapshot(&[dir]);
    for (args, env, says) in &cases {
        let mut c = command();
        c.args(*args).envs(env.iter().copied()).stdin(Stdio::null()).stdout(Stdio::piped());
        refused(&c.output().unwrap(), says);
        assert_eq!(snapshot(&[dir]), before, "{args:?} {env:?} changed a file");
    }
    // A user's file by the lock's name, holding a number: left alone, named.
    std::fs::remove_file(&lock).unwrap();
    std::fs::write(&lock, "42").unwrap();
    refused(&run(&with_ck, &[], &[]), "does not hold a syncstep lock");
    assert_eq!(std::fs::read(&lock).unwrap(), b"42");
    assert!(!ck.exists());
    eprintln!("{} cases", cases.len() + 1);
}

/// A log whose disk is full (`/dev/full`) stops the run after that step with its checkpoint
/// written, and says what was and was not saved.
fn a_full_disk_under_the_log_keeps_the_checkpoint() {
    let tmp = gpu_test_dir();
    let ck = tmp.path().join("ck.safetensors");
    let c = ck.to_str().unwrap();
    let train =
        ["train", "--steps", "3", "--batch", "2", "--eval-examples", "0", "--log", "/dev/full"];
    let o = run(&[&train[..], &["--checkpoint", c, "--checkpoint-every", "0"]].concat(), &[], &[]);
    refused(&o, "No space left on device");
    let says = format!(
        "stopped after step 1; the checkpoint {c} holds step 1: continue with --resume {c}"
    );
    assert!(text(&o).contains(&says), "{}", text(&o));
    let model = syncstep::model::ResNet::new(syncstep::model::Arch::ResNet34, 10).unwrap();
    assert_eq!(syncstep::checkpoint::load(&ck, &model).unwrap().step, 1);
    eprintln!("1 case");
}

/// A log that cannot take an evaluation's record stops the run as for a step's: after the
/// evaluation at an epoch's end, the checkpoint of that step is written and the error says what
/// the log lacks and what the checkpoint holds; after the final evaluation (the checkpoint
/// written before it), the error says the same. The log is a pipe whose reader goes after the
/// first step's record, as a disk that fills refuses what comes next.
fn a_log_lost_at_an_evaluation_keeps_the_checkpoint() {
    let tmp = gpu_test_dir();
    let dir = tmp.path();
    let data = crate::reliability::image_folder(dir, 10);
    let d = data.to_str().unwrap();
    // 2 training images (one step an epoch) and 18 to validate on; then 10 and 10.
    let cases = [
        ("0.9", "--epochs", "2", "stopped after step 1; "),
        ("0.5", "--steps", "1", "the final evaluation is not in it; "),
    ];
    for (i, (split, flag, value, says)) in cases.into_iter().enumerate() {
        let ck = dir.join(format!("ck{i}.safetensors"));
        let (c, log) = (ck.to_str().unwrap(), dir.join(format!("log{i}.jsonl")));
        assert!(Command::new("mkfifo").arg(&log).status().unwrap().success());
        let taken = dir.join(format!("taken{i}"));
        let mut reader = Command::new("head")
            .args(["-n", "1"])
            .arg(&log)
            .stdout(std::fs::File::create(&taken).unwrap())
            .spawn()
            .unwrap();
        let train = ["train", "--data", d, "--val-split", split, "--batch", "2", flag, value];
        let outputs = ["--checkpoint", c, "--log", log.to_str().unwrap()];
        let o = run(&[&train[..], &outputs, &["--normalize", "imagenet"]].concat(), &[], &[]);
        // Gone already, unless the run never opened the log.
        let _ = reader.kill();
        reader.wait().unwrap();
        refused(&o, "Broken pipe");
        let holds = format!("the checkpoint {c} holds step 1: continue with --resume {c}");
        assert!(text(&o).contains(&format!("{says}{holds}")), "{}", text(&o));
        let first = std::fs::read_to_string(&taken).unwrap();
        assert!(first.starts_with(r#"{"step":1,"#), "the log took step 1: {first}");
        let model = syncstep::model::ResNet::new(syncstep::model::Arch::ResNet34, 2).unwrap();
        assert_eq!(syncstep::checkpoint::load(&ck, &model).unwrap().step, 1);
    }
    eprintln!("{} cases", cases.len());
}

tests![
    a_report_or_a_log_to_a_redirected_stream_stays_whole,
    nothing_of_the_users_is_touched_by_a_side_file,
    a_full_disk_under_the_log_keeps_the_checkpoint,
    a_log_lost_at_an_evaluation_keeps_the_checkpoint,
];
