//! `--mpi` under `mpirun` (a build with the `mpi` feature): replicas as ranks give the single
//! device's bits; ranks that disagree are refused at start; a rank that dies ends every rank.
//! Over TCP (`--mca btl tcp,self`), the transport that crosses machines.

use std::path::Path;
use std::process::{Command, Output};

use crate::common::*;
use crate::{inputs, same_bits};
use syncstep::checkpoint;
use syncstep::model::{Arch, ResNet};

const BIN: &str = env!("CARGO_BIN_EXE_syncstep");

/// A fresh folder of this test's own, removed when dropped, however the test ends. The ranks of
/// a job on this machine share it: each is passed its paths, and the job ends before it goes.
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("syncstep-mpi-{name}-")).tempdir().unwrap()
}

/// `mpirun` over TCP with `programs`: one `(ranks, argv)` per MPMD part. One job at a time:
/// the ranks of two jobs on a CI machine's two cores would take turns with each other's waits,
/// and MPI's waits yield the core rather than spin on it.
fn mpirun(programs: &[(usize, Vec<String>)]) -> Output {
    mpirun_with(programs, &[])
}

/// [`mpirun`] with environment variables for every rank.
fn mpirun_with(programs: &[(usize, Vec<String>)], env: &[(&str, &str)]) -> Output {
    let _turn = crate::one_job();
    let o = mpirun_command(programs, env, &[])
        .output()
        .expect("mpirun (Open MPI) must be installed: scripts/setup.sh");
    assert_ne!(o.status.code(), Some(124), "hung: ended after {HANG_LIMIT_S} s: {}", text(&o));
    o
}

/// How long a job may run before `timeout` ends it, as hung: far more than any job here takes
/// (a few minutes at most on a CI machine's two cores), so that it only keeps a hang from
/// stalling the suite. No test holds a job to a time: a time says how loaded the machine was.
const HANG_LIMIT_S: &str = "600";

/// The `mpirun` command over TCP with `programs`, `env` for every rank and `options` for
/// mpirun itself.
fn mpirun_command(
    programs: &[(usize, Vec<String>)],
    env: &[(&str, &str)],
    options: &[&str],
) -> Command {
    // `--foreground`: a signal to `timeout` goes to mpirun alone, which passes it on to the
    // ranks as it would from a batch system (the job's process group is not signalled).
    let mut cmd = Command::new("timeout");
    cmd.args(["--foreground", "-k", "10", HANG_LIMIT_S, "mpirun"]);
    cmd.envs(suite_env()).envs(env.iter().copied());
    cmd.args(["--oversubscribe", "--mca", "btl", "tcp,self", "--mca", "mpi_yield_when_idle", "1"])
        .args(options)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    for (i, (ranks, argv)) in programs.iter().enumerate() {
        if i > 0 {
            cmd.arg(":");
        }
        cmd.args(["-np", &ranks.to_string()]).args(argv);
    }
    cmd
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// `syncstep grad` of the batch in `batch` at the weights in `weights`, written to `out`.
fn grad_args(weights: &Path, batch: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let [w, b, o] = [weights, batch, out].map(|p| p.to_str().unwrap());
    [BIN, "grad", "--weights", w, "--batch", b, "--out", o]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
}

/// Three ranks over a batch of 7 (shards of 3, 2 and 2): the gradients, loss, logits and BN
/// statistics of one step are the single device's, bit for bit. (The training test below runs
/// P = 2 × 2.)
fn ranks_give_the_single_devices_gradients_bit_for_bit() {
    needs_adapter();
    let tmp = temp_dir("grad");
    let dir = tmp.path();
    let inputs = inputs(dir, 7);
    let single = dir.join("single.safetensors");
    let (ok, log) = syncstep(
        &grad_args(&inputs, &inputs, &single, &[])
            .iter()
            .skip(1)
            .map(|s| s.as_str())
            .collect::<Vec<_>>(),
    );
    assert!(ok, "{log}");
    let out = dir.join("ranks.safetensors");
    let o = mpirun(&[(3, grad_args(&inputs, &inputs, &out, &["--mpi"]))]);
    assert!(o.status.success(), "{}", text(&o));
    same_bits(&single, &out).unwrap_or_else(|e| panic!("3 ranks: {e}"));
}

/// Three SGD steps at a global batch of 6 over P = 2 ranks with 2 devices each (R = 4, uneven
/// shards of 2, 2, 1, 1) end with the single device's parameters, momentum and BN statistics,
/// bit for bit; rank 0 alone writes the checkpoint and prints. Two ranks of one device each
/// resume from it: one step more is the single device's fourth.
fn ranks_train_as_the_single_device_does_bit_for_bit() {
    needs_adapter();
    let tmp = temp_dir("train");
    let dir = tmp.path();
    let train = |ck: &Path, extra: &[&str]| -> Vec<String> {
        let base = [BIN, "train", "--steps", "3", "--batch", "6", "--eval-examples", "0"];
        let ck = ["--checkpoint", ck.to_str().unwrap()];
        base.iter().chain(&ck).chain(extra).map(|s| s.to_string()).collect()
    };
    let single = dir.join("single.safetensors");
    let args = train(&single, &[]);
    let (ok, log) = syncstep(&args[1..].iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert!(ok, "{log}");
    let model = ResNet::new(Arch::ResNet34, 10).unwrap();
    let want = checkpoint::load(&single, &model).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let ck = dir.join("ranks.safetensors");
    let per_rank = ["--mpi", "--local-replicas", "2"];
    let o = mpirun(&[(2, train(&ck, &per_rank))]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(out.matches("syncstep train:").count(), 1, "rank 0 alone prints: {out}");
    let note = "2 s to finish the step in flight and write the checkpoint";
    assert_eq!(out.matches(note).count(), 1, "rank 0 notes mpirun's default grace: {out}");
    let got = checkpoint::load(&ck, &model).unwrap();
    assert_eq!(got.step, 3);
    assert!(bits(&got.params) == bits(&want.params), "parameters differ");
    assert!(bits(&got.velocity) == bits(&want.velocity), "momentum differs");
    assert!(bits(&got.running) == bits(&want.running), "BN statistics differ");
    let resume = |ck: &Path, mpi: &[&str]| -> Vec<String> {
        let ck = ck.to_str().unwrap();
        let base = [BIN, "train", "--steps", "1", "--eval-examples", "0", "--resume", ck];
        base.iter().chain(&["--checkpoint", ck]).chain(mpi).map(|s| s.to_string()).collect()
    };
    let (ok, log) =
        syncstep(&resume(&single, &[])[1..].iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert!(ok, "{log}");
    // The checkpoint holds no replica layout: resumed on 2 ranks of one device each.
    let o = mpirun(&[(2, resume(&ck, &["--mpi"]))]);
    assert!(o.status.success(), "resumed: {}", text(&o));
    let (got, want) =
        (checkpoint::load(&ck, &model).unwrap(), checkpoint::load(&single, &model).unwrap());
    assert_eq!((got.step, want.step), (4, 4));
    assert!(bits(&got.params) == bits(&want.params), "resumed over ranks: parameters differ");
}

/// `check --mpi` over two ranks and a batch of 5 (shards of 3 and 2): every gate passes, TEST
/// and DRIFT to the bit, and rank 0 alone prints the table and writes the JSON.
fn check_over_ranks_passes_every_gate() {
    needs_adapter();
    let tmp = temp_dir("check");
    let dir = tmp.path();
    let json = dir.join("check.json");
    let args = [BIN, "check", "--mpi", "--batch", "5", "--steps", "1", "--json"];
    let args: Vec<String> =
        args.iter().map(|s| s.to_string()).chain([json.display().to_string()]).collect();
    let o = mpirun(&[(2, args)]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(out.matches("gate            measured").count(), 1, "{out}");
    assert!(out.contains("2 replicas, 5 examples (3, 2)"), "{out}");
    assert!(out.contains("  replica 1: "), "every rank's adapter is listed: {out}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    for gate in report["gates"].as_array().expect("gates") {
        assert_eq!(gate["pass"], true, "{gate}");
        if gate["gate"] == "TEST" || gate["gate"] == "DRIFT" {
            assert_eq!(gate["measured"], 0.0, "{gate}");
        }
    }
}

/// `bench --mpi` at P = 2: rank 0 alone reports, with the single device beside the ranks, the
/// bytes it received a step (half the gradient in the reduce-scatter, half in the all-gather,
/// plus the BatchNorm rows, losses and logits) and each rank's wait for the exchange.
fn bench_over_ranks_reports_the_bytes_received_and_each_ranks_wait() {
    needs_adapter();
    let tmp = temp_dir("bench");
    let dir = tmp.path();
    let json = dir.join("bench.json");
    let args = [BIN, "bench", "--mpi", "--batch", "4", "--steps", "1", "--no-roofline", "--json"];
    let args: Vec<String> =
        args.iter().map(|s| s.to_string()).chain([json.display().to_string()]).collect();
    let o = mpirun(&[(2, args)]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(out.matches("syncstep bench:").count(), 1);
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["step"]["replicas"], 2, "{report}");
    assert_eq!(report["single"]["global_batch"], 4, "{report}");
    let gradient = report["allreduce"]["gradient_bytes"].as_u64().unwrap();
    let received = report["rank_received_bytes_per_step"].as_u64().unwrap();
    assert!(
        received >= gradient && received < gradient + gradient / 50,
        "received {received} a step, the gradient is {gradient} bytes"
    );
    check_exchange_wait(&out, &report, 2, 1);
}

/// A rank with other settings (here its label smoothing, its own --checkpoint, or other data)
/// is refused before any step, naming them.
fn ranks_that_disagree_are_refused_at_start() {
    needs_adapter();
    let tmp = temp_dir("disagree");
    let dir = tmp.path();
    let inputs = inputs(dir, 2);
    let out = dir.join("g.safetensors");
    let o = mpirun(&[
        (1, grad_args(&inputs, &inputs, &out, &["--mpi"])),
        (1, grad_args(&inputs, &inputs, &out, &["--mpi", "--label-smoothing", "0.2"])),
    ]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("rank(s) [1] differ from rank 0 in the settings"), "{}", text(&o));
    assert!(!out.exists(), "nothing is written");
    // A rank's own --checkpoint, which rank 0 alone would write.
    let train = |ck: &str| -> Vec<String> {
        let args = [BIN, "train", "--mpi", "--batch", "2", "--steps", "1", "--checkpoint", ck];
        args.iter().map(|s| s.to_string()).collect()
    };
    let (a, b) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    let o = mpirun(&[(1, train(a.to_str().unwrap())), (1, train(b.to_str().unwrap()))]);
    let says = "rank(s) [1] differ from rank 0 in --checkpoint and --log (rank 0 writes them)";
    assert!(!o.status.success() && text(&o).contains(says), "{}", text(&o));
    assert!(!a.exists() && !b.exists(), "nothing is written");
    // A rank whose --data holds other images (here one more of each class) than rank 0's.
    let folder = |name: &str, per_class: u32| {
        for class in ["ant", "bee"] {
            std::fs::create_dir_all(dir.join(name).join(class)).unwrap();
            for i in 0..per_class {
                let img = image::RgbImage::from_pixel(32, 32, image::Rgb([i as u8 * 40, 9, 9]));
                img.save(dir.join(name).join(class).join(format!("{i}.png"))).unwrap();
            }
        }
        let args = [BIN, "train", "--mpi", "--batch", "2", "--steps", "1", "--val-split", "0"];
        let root = dir.join(name);
        let data = ["--normalize", "imagenet", "--data", root.to_str().unwrap()];
        args.iter().chain(&data).map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let o = mpirun(&[(1, folder("a", 2)), (1, folder("b", 3))]);
    let says = "rank(s) [1] differ from rank 0 in the data (its files, sizes and labels)";
    assert!(!o.status.success() && text(&o).contains(says), "{}", text(&o));
}

/// A rank killed while the others wait for it: every rank ends (mpirun returns), non-zero,
/// mpirun names the rank killed, and nothing is written. Rank 1 is stopped as it starts, however fast the adapter, and killed 2 s
/// later with the shell that started it (so that mpirun sees a rank end by signal 9), while
/// rank 0 waits for it to join the job.
fn a_rank_that_dies_ends_every_rank() {
    needs_adapter();
    let tmp = temp_dir("dies");
    let dir = tmp.path();
    let inputs = inputs(dir, 4);
    let out = dir.join("g.safetensors");
    let grad = grad_args(&inputs, &inputs, &out, &["--mpi"]);
    let killed = format!("{} & kill -STOP $!; sleep 2; kill -KILL $! $$", grad.join(" "));
    let o = mpirun(&[(1, grad), (1, vec!["sh".into(), "-c".into(), killed])]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    let named = t.contains("process rank 1 ") && t.contains("signal 9");
    assert!(named, "rank 1 was killed (not refused), and mpirun says so: {t}");
    assert!(!out.exists(), "nothing is written");
}

/// A rank that falls silent (stopped, as a host whose link is cut would look to the others)
/// while the job trains: rank 0 names it once the silence allowed (here 5 s) is over, where
/// MPI's TCP alone would wait for minutes, and every rank ends (mpirun returns), non-zero; the
/// checkpoint written before is intact.
fn a_rank_that_falls_silent_is_named_and_ends_the_job() {
    needs_adapter();
    let tmp = temp_dir("silent");
    let dir = tmp.path();
    let ck = dir.join("run.safetensors");
    let train =
        [BIN, "train", "--mpi", "--batch", "4", "--steps", "100000", "--eval-examples", "0"];
    let train: Vec<String> = train
        .iter()
        .map(|s| s.to_string())
        .chain(["--checkpoint-every", "1", "--checkpoint", ck.to_str().unwrap()].map(String::from))
        .collect();
    // Rank 1 is stopped once the first checkpoint is written (rank 0 writes it whole or not at
    // all), and killed with its process group at the end.
    let ck_path = ck.to_str().unwrap();
    let stopped = format!(
        "{} & until [ -e {ck_path} ]; do sleep 1; done; kill -STOP $!; wait",
        train.join(" ")
    );
    let o = mpirun_with(
        &[(1, train.clone()), (1, vec!["sh".into(), "-c".into(), stopped])],
        &[("SYNCSTEP_MPI_SILENCE", "5")],
    );
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("rank 0: error: no word from rank(s) [1] for 5 s"), "{}", text(&o));
    let model = ResNet::new(Arch::ResNet34, 10).unwrap();
    checkpoint::load(&ck, &model).unwrap_or_else(|e| panic!("{e}: {}", text(&o)));
}

/// A suspend, then SIGTERM to mpirun (a batch system's end, a `kill`; a Ctrl-C is the same to
/// it). Open MPI's first word to the ranks is a SIGCONT, then SIGTERM and SIGKILL
/// `odls_base_sigkill_timeout` seconds apart (here 10, README's recipe): the ranks stop on the
/// SIGCONT, after the step in flight; rank 0 writes the checkpoint of that step, the last its
/// log records, and every rank says so, all before the SIGTERM (which would name itself). The
/// suspend before (SIGTSTP to mpirun, passed on as SIGSTOP, then SIGCONT) only pauses the run.
/// Every handshake is a file a rank writes (its pid, the log, its output), never a line through
/// mpirun, which drops what the ranks print as it ends the job.
fn a_signal_to_mpirun_leaves_the_checkpoint_of_the_last_step() {
    needs_adapter();
    let tmp = temp_dir("signal");
    let dir = tmp.path();
    let (ck, log) = (dir.join("run.safetensors"), dir.join("run.jsonl"));
    let [c, l] = [&ck, &log].map(|p| p.to_str().unwrap());
    let rank = format!(
        r#"echo $$ > {d}/$OMPI_COMM_WORLD_RANK.pid; exec "$0" "$@" > {d}/$OMPI_COMM_WORLD_RANK.out 2>&1"#,
        d = dir.display()
    );
    let train = ["sh", "-c", &rank, BIN, "train", "--mpi", "--batch", "4", "--steps", "100000"];
    let outputs = ["--checkpoint-every", "0", "--checkpoint", c, "--log", l];
    let train: Vec<String> = train
        .iter()
        .chain(&["--eval-examples", "0"])
        .chain(&outputs)
        .map(|s| s.to_string())
        .collect();
    let _turn = crate::one_job();
    let mut job = mpirun_command(&[(2, train)], &[], &["--mca", "odls_base_sigkill_timeout", "10"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("mpirun (Open MPI) must be installed: scripts/setup.sh");
    let last_step = || {
        let records = syncstep::metrics::read(&log).unwrap_or_default();
        records.iter().rev().find(|r| r.is_training()).map_or(0, |r| r.step)
    };
    until(&mut job, "the first step", || last_step() >= 1);
    let pids = ["0", "1"].map(|r| std::fs::read_to_string(dir.join(format!("{r}.pid"))).unwrap());
    let pids = pids.map(|p| p.trim().to_string());
    // The ranks' parent is mpirun (`timeout`, the job's pid, passes on no SIGTSTP or SIGCONT).
    let mpirun = proc_stat(&pids[0]).1;
    let signal = |signal: &str, pid: &str| {
        assert!(Command::new("kill").args([signal, pid]).status().unwrap().success());
    };
    signal("-TSTP", &mpirun);
    until(&mut job, "both ranks stopped", || pids.iter().all(|p| proc_stat(p).0 == "T"));
    let suspended = last_step();
    // Longer than a rank takes a pause of its threads for a stop (a second).
    std::thread::sleep(std::time::Duration::from_secs(2));
    signal("-CONT", &mpirun);
    until(&mut job, "two steps after the resume", || last_step() >= suspended + 2);
    signal("-TERM", &job.id().to_string());
    let o = job.wait_with_output().unwrap();
    let said = ["0", "1"].map(|r| std::fs::read_to_string(dir.join(format!("{r}.out"))).unwrap());
    let all = format!("{}\n{}\n{}", text(&o), said[0], said[1]);
    assert!(!o.status.success(), "{all}");
    let model = ResNet::new(Arch::ResNet34, 10).unwrap();
    let step = checkpoint::load(&ck, &model).unwrap_or_else(|e| panic!("{e}: {all}")).step;
    assert!(step >= suspended + 2, "the run went on after the resume: {all}");
    assert_eq!(step, last_step(), "the checkpoint holds the last step the log records: {all}");
    let stopped = format!("mpirun is ending the job (its SIGCONT): stopped after step {step}; ");
    let lines = [
        format!("rank 0: {stopped}the checkpoint {c} holds step {step}"),
        format!("rank 1: {stopped}rank 0 writes the checkpoint and says which step it holds"),
    ];
    for (said, line) in said.iter().zip(lines) {
        assert!(said.contains(&line), "{line}: {all}");
    }
}

/// Waits until `done`, failing if `job` ends first.
fn until(job: &mut std::process::Child, what: &str, done: impl Fn() -> bool) {
    while !done() {
        if let Some(status) = job.try_wait().unwrap() {
            panic!("the job ended ({status}) before {what}");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// The state (`R`, `S`, `T`, …) and parent pid of process `pid`, from /proc.
fn proc_stat(pid: &str) -> (String, String) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The name in parentheses may hold spaces: the fields after it are the state and the parent.
    let after = &stat[stat.rfind(')').unwrap() + 1..];
    let mut fields = after.split_whitespace().map(String::from);
    (fields.next().unwrap(), fields.next().unwrap())
}

tests![
    ranks_give_the_single_devices_gradients_bit_for_bit,
    ranks_train_as_the_single_device_does_bit_for_bit,
    check_over_ranks_passes_every_gate,
    bench_over_ranks_reports_the_bytes_received_and_each_ranks_wait,
    ranks_that_disagree_are_refused_at_start,
    a_rank_that_dies_ends_every_rank,
    a_rank_that_falls_silent_is_named_and_ends_the_job,
    a_signal_to_mpirun_leaves_the_checkpoint_of_the_last_step,
];
