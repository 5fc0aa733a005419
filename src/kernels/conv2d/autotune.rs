//! The autotune: timing candidates on the device, and remembering the choices in a cache file
//! (natively only: a browser has neither a clock nor files).
//!
//! wgpu has no clock inside shaders, so each run is one submission measured to completion with
//! the host's clock, holding enough launches of a short kernel that the submit and wait round
//! trip is small beside them. The cache is JSON: the crate version and a hash of the kernels'
//! source as compiled (another build's choices are not read), then the choices. A file there
//! that is not a cache of ours is never overwritten.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::backward_weight::broadcast_shader;
use super::tiles::gemm_lanes_shader;
use super::tune::{ChoiceKey, Choices};
use super::{conv2d_launch_with, Conv2dAlgo, Conv2dOp, Conv2dShape, GEMM_TILES, SHADER};
use crate::gpu::{launches_to_fill, Encoder, Gpu, Slice};
use crate::kernels::{KernelError, Result};

/// The cache file as stored.
#[derive(Serialize, Deserialize)]
pub(super) struct CacheFile {
    /// The crate version that wrote it.
    syncstep_autotune: String,
    /// [`kernels_hash`] of the build that wrote it.
    kernels: String,
    choices: Vec<Choice>,
}

#[derive(Serialize, Deserialize)]
pub(super) struct Choice {
    adapter: String,
    op: Conv2dOp,
    shape: Conv2dShape,
    algo: Conv2dAlgo,
}

/// A hash of the kernels' source as compiled (the base module, the broadcasting one, every
/// tile's with and without broadcasts): a change to a kernel or to the tiles on offer, within a
/// version too, changes which is fastest.
pub(super) fn kernels_hash() -> &'static str {
    static HASH: OnceLock<String> = OnceLock::new();
    HASH.get_or_init(|| {
        let tiles =
            GEMM_TILES.iter().flat_map(|&t| [false, true].map(|b| gemm_lanes_shader(t, b).source));
        let sources = [SHADER.source, broadcast_shader().source].into_iter().chain(tiles);
        // SHA-256 (stable across builds and platforms, unlike std's hasher), its first 8 bytes
        // in hex: the cache only tells builds apart.
        use sha2::Digest;
        let digest = sources.fold(sha2::Sha256::new(), |hash, source| hash.chain_update(source));
        digest.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect()
    })
}

/// The cache file: `SYNCSTEP_AUTOTUNE_CACHE` (a path, or `off` for none), else
/// `$XDG_CACHE_HOME/syncstep/autotune.json`, else `~/.cache/syncstep/autotune.json`.
pub(super) fn cache_path() -> Option<PathBuf> {
    let var = std::env::var_os;
    cache_path_from(var("SYNCSTEP_AUTOTUNE_CACHE"), var("XDG_CACHE_HOME"), var("HOME"))
}

pub(super) fn cache_path_from(
    chosen: Option<OsString>,
    xdg_cache: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    let set = |v: Option<OsString>| v.filter(|v| !v.is_empty());
    if let Some(chosen) = set(chosen) {
        return (chosen != "off").then(|| PathBuf::from(chosen));
    }
    // XDG: a relative XDG_CACHE_HOME is invalid and ignored.
    let cache = set(xdg_cache)
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| set(home).map(|h| PathBuf::from(h).join(".cache")))?;
    Some(cache.join("syncstep").join("autotune.json"))
}

/// What a cache file holds for this build.
#[derive(Debug, Default)]
pub(super) struct Loaded {
    pub(super) choices: Choices,
    /// The file exists and is not a cache of ours (nor of an earlier format): it is left alone.
    pub(super) foreign: bool,
}

/// The choices in `file`: none when it is missing, another build wrote it, or it cannot be read
/// or is corrupt (with a warning). Never an error: the cache only saves time.
pub(super) fn load(file: &Path) -> Loaded {
    let bytes = match std::fs::read(file) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Loaded::default(),
        Err(e) => {
            log::warn!("autotune cache {}: cannot read it ({e}); timing afresh", file.display());
            return Loaded::default();
        }
    };
    // The text format of earlier versions is ours too: replaced by the next choice.
    if bytes.starts_with(b"syncstep-autotune ") {
        return Loaded::default();
    }
    let doc: serde_json::Value = match serde_json::from_slice(&bytes) {
        Ok(doc @ serde_json::Value::Object(_)) if doc.get("syncstep_autotune").is_some() => doc,
        _ => {
            log::warn!(
                "{} is not a syncstep autotune cache: it is left alone, and choices are kept for \
                 this process only (set SYNCSTEP_AUTOTUNE_CACHE to another path)",
                file.display()
            );
            return Loaded { choices: Choices::new(), foreign: true };
        }
    };
    let file_text =
        |key: &str| doc.get(key).and_then(serde_json::Value::as_str).map(str::to_string);
    let (version, kernels) = (file_text("syncstep_autotune"), file_text("kernels"));
    if version.as_deref() != Some(env!("CARGO_PKG_VERSION"))
        || kernels.as_deref() != Some(kernels_hash())
    {
        log::debug!("autotune cache {}: written by another build; timing afresh", file.display());
        return Loaded::default();
    }
    match serde_json::from_value::<CacheFile>(doc) {
        Ok(cache) => Loaded {
            choices: cache
                .choices
                .into_iter()
                .map(|c| ((c.adapter, c.op, c.shape), c.algo))
                .collect(),
            foreign: false,
        },
        Err(e) => {
            log::warn!(
                "autotune cache {}: corrupt ({e}), ignored (it is rewritten with the next choice)",
                file.display()
            );
            Loaded::default()
        }
    }
}

/// Adds `key → algo` to the choices in `file`, read again so that other processes' choices
/// stay, and writes them back atomically ([`crate::files::write_atomic`]: a temporary file
/// renamed over it). A failure, or a file that is not ours, is a warning.
pub(super) fn remember(file: &Path, key: &ChoiceKey, algo: Conv2dAlgo) {
    // One writer at a time in this process: a read, an insert and a write, whole.
    static WRITING: Mutex<()> = Mutex::new(());
    let _one = WRITING.lock().unwrap_or_else(|p| p.into_inner());
    let Loaded { mut choices, foreign } = load(file);
    if foreign {
        return;
    }
    choices.insert(key.clone(), algo);
    let mut choices: Vec<Choice> = choices
        .into_iter()
        .map(|((adapter, op, shape), algo)| Choice { adapter, op, shape, algo })
        .collect();
    choices.sort_by_key(|c| (c.adapter.clone(), c.op.name(), format!("{:?}", c.shape)));
    let cache = CacheFile {
        syncstep_autotune: env!("CARGO_PKG_VERSION").to_string(),
        kernels: kernels_hash().to_string(),
        choices,
    };
    let text = serde_json::to_string_pretty(&cache).expect("the cache serialises");
    let written = file
        .parent()
        .filter(|dir| !dir.as_os_str().is_empty())
        .map_or(Ok(()), std::fs::create_dir_all)
        .map_err(|e| e.to_string())
        .and_then(|()| {
            crate::files::write_atomic(file, (text + "\n").as_bytes()).map_err(|e| match e {
                crate::files::FileError::Io { message, .. } => message,
                other => other.to_string(),
            })
        });
    if let Err(e) = written {
        log::warn!(
            "autotune cache {}: cannot write it ({e}); choices are kept for this process only",
            file.display()
        );
    }
}

/// Timed runs per candidate after one untimed run (which compiles its pipelines on first
/// use); the fastest run counts, the least disturbed by other work on the machine.
pub(super) const RUNS: usize = 2;
/// Candidates timed again in turns at the end: at least this many of the fastest, and every
/// one within FINALIST_SPREAD of the fastest. Other work on the machine during a candidate's
/// first runs can make it look half again as slow, and a choice is kept for good.
pub(super) const FINALISTS: usize = 3;
pub(super) const FINALIST_SPREAD: f64 = 1.6;
/// The least a timed submission runs: short kernels are launched several times in one
/// (as many for every candidate of a shape; see `launches_to_fill`).
pub(super) const MIN_SUBMIT: Duration = Duration::from_millis(2);

pub(super) fn fastest(
    gpu: &Gpu,
    op: Conv2dOp,
    s: &Conv2dShape,
    candidates: &[Conv2dAlgo],
) -> Result<Conv2dAlgo> {
    // The candidates' scratch (an im2col chunk the choice may never use) would otherwise stay
    // held for the device's life.
    gpu.scratch_as_before(|| time_candidates(gpu, op, s, candidates))
}

pub(super) fn time_candidates(
    gpu: &Gpu,
    op: Conv2dOp,
    s: &Conv2dShape,
    candidates: &[Conv2dAlgo],
) -> Result<Conv2dAlgo> {
    // One tuning at a time per process: concurrent ones would time each other.
    static TUNING: Mutex<()> = Mutex::new(());
    let _one = TUNING.lock().unwrap_or_else(|p| p.into_inner());
    let gpu_err = |source| KernelError::Gpu { op: op.name(), source };
    let [input, second, output] = s.operand_lens(op);
    let input = gpu.buffer("autotune input", input).map_err(gpu_err)?;
    let second = gpu.buffer("autotune second input", second).map_err(gpu_err)?;
    let output = gpu.buffer("autotune output", output).map_err(gpu_err)?;
    let run = |algo: Conv2dAlgo, launches: u32| -> Result<Duration> {
        let launch = |enc: &mut Encoder| {
            conv2d_launch_with(
                gpu,
                enc,
                op,
                algo,
                s,
                Slice::whole(&input),
                Slice::whole(&second),
                Slice::whole(&output),
            )
        };
        gpu.time_recorded(launches, launch, gpu_err)
    };
    gpu.wait().map_err(gpu_err)?; // the caller's work in flight is not ours to time
    let mut launches = 0;
    let mut timed: Vec<(Duration, Conv2dAlgo)> = Vec::new();
    for &algo in candidates {
        match run(algo, 1) {
            Ok(_) => {}
            // A variant this device refuses (a limit, a scratch buffer too large) is skipped;
            // any other refusal is a bug here, not the variant's.
            Err(KernelError::Arg { arg: "algo", .. })
            | Err(KernelError::Gpu { source: crate::gpu::GpuError::Limit { .. }, .. }) => continue,
            Err(e) => return Err(e),
        };
        // The untimed run included the JIT compile (which on lavapipe can take longer than
        // ten runs): the first timed run decides whether the candidate is worth more.
        if launches == 0 {
            launches = launches_to_fill(MIN_SUBMIT, run(algo, 1)?);
        }
        let mut fastest = run(algo, launches)?;
        if timed.iter().any(|&(t, _)| fastest > 10 * t) {
            continue;
        }
        for _ in 1..RUNS {
            fastest = fastest.min(run(algo, launches)?);
        }
        log::debug!("autotune {} {s:?}: {algo} {:.3} ms", op.name(), fastest.as_secs_f64() * 1e3);
        timed.push((fastest, algo));
    }
    // Other work on the machine during one candidate's runs makes it look slow, and the
    // choice is kept for good: the finalists (see FINALISTS) run again, taking turns, and
    // each keeps its best time.
    timed.sort_by_key(|&(t, _)| t);
    let close = timed.first().map_or(Duration::ZERO, |&(t, _)| t.mul_f64(FINALIST_SPREAD));
    timed.truncate(timed.iter().filter(|&&(t, _)| t <= close).count().max(FINALISTS));
    for _ in 0..RUNS {
        for (t, algo) in timed.iter_mut() {
            *t = (*t).min(run(*algo, launches)?);
        }
    }
    Ok(timed.into_iter().min_by_key(|&(t, _)| t).map_or(Conv2dAlgo::Blocked, |(_, algo)| algo))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory for one test's cache file (removed by the test).
    fn cache_dir(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("syncstep-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn key(adapter: &str, op: Conv2dOp, n: u32) -> ChoiceKey {
        let shape =
            Conv2dShape { n, c_in: 64, h: 8, w: 8, c_out: 64, kh: 3, kw: 3, stride: 1, pad: 1 };
        (adapter.into(), op, shape)
    }

    #[test]
    fn choices_are_read_back_from_the_cache_file() {
        let dir = cache_dir("cache-round-trip");
        let file = dir.join("sub").join("autotune.json");
        assert!(load(&file).choices.is_empty(), "a missing file holds no choices");
        let pixels = Conv2dAlgo::Gemm(GEMM_TILES[2]);
        let (vulkan, gl) = ("Vulkan|llvmpipe|a b", "Gl|llvmpipe|c");
        remember(&file, &key(vulkan, Conv2dOp::BackwardWeight, 8), pixels);
        remember(&file, &key(vulkan, Conv2dOp::Forward, 8), Conv2dAlgo::Blocked);
        remember(&file, &key(gl, Conv2dOp::BackwardWeight, 8), Conv2dAlgo::GemmShared);
        remember(&file, &key(vulkan, Conv2dOp::Forward, 8), Conv2dAlgo::Direct); // replaces
        let choices = load(&file).choices;
        assert_eq!(choices.len(), 3, "{choices:?}");
        assert_eq!(choices.get(&key(vulkan, Conv2dOp::BackwardWeight, 8)), Some(&pixels));
        assert_eq!(choices.get(&key(vulkan, Conv2dOp::Forward, 8)), Some(&Conv2dAlgo::Direct));
        assert_eq!(
            choices.get(&key(gl, Conv2dOp::BackwardWeight, 8)),
            Some(&Conv2dAlgo::GemmShared)
        );
        assert_eq!(choices.get(&key(vulkan, Conv2dOp::BackwardWeight, 4)), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_corrupt_unreadable_or_other_build_cache_file_is_ignored_and_a_foreign_one_kept() {
        let dir = cache_dir("cache-corrupt");
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("autotune.json");
        let version = env!("CARGO_PKG_VERSION");
        let choice = r#"{"adapter":"Vulkan|x","op":"conv2d_forward","shape":{"n":8,"c_in":64,"h":8,"w":8,"c_out":64,"kh":3,"kw":3,"stride":1,"pad":1},"algo":"blocked"}"#;
        let cache = |version: &str, kernels: &str, choice: &str| {
            format!(
                r#"{{"syncstep_autotune":"{version}","kernels":"{kernels}","choices":[{choice}]}}"#
            )
        };
        let ours = [
            cache(version, kernels_hash(), &choice.replace("blocked", "gemm-pixels-3x3")),
            cache(version, kernels_hash(), &choice.replace(r#""n":8,"#, "")),
            cache("0.0.0-other", kernels_hash(), choice),
            cache(version, "0123456789abcdef", choice),
            "syncstep-autotune 0.1.0 0123456789abcdef\nconv2d_forward\t8 64 8 8 64 3 3 1 1\tblocked\tx\n".into(),
        ];
        for text in &ours {
            std::fs::write(&file, text).unwrap();
            let loaded = load(&file);
            assert!(loaded.choices.is_empty() && !loaded.foreign, "{text}");
        }
        std::fs::write(&file, cache(version, kernels_hash(), choice)).unwrap();
        assert_eq!(load(&file).choices.len(), 1, "the same file with nothing wrong is read");
        // Not a cache of ours: read as none, and never overwritten.
        for foreign in [b"\xff\xfe not text".to_vec(), b"{\"a\": 1}".to_vec(), b"notes\n".to_vec()]
        {
            std::fs::write(&file, &foreign).unwrap();
            assert!(load(&file).foreign, "{}", String::from_utf8_lossy(&foreign));
            remember(&file, &key("Vulkan|x", Conv2dOp::Forward, 1), Conv2dAlgo::Blocked);
            assert_eq!(std::fs::read(&file).unwrap(), foreign, "a foreign file is left as it was");
        }
        // A directory where the file should be: unreadable and unwritable, still no error.
        let blocked = dir.join("a directory");
        std::fs::create_dir_all(&blocked).unwrap();
        remember(&blocked, &key("Vulkan|x", Conv2dOp::Forward, 1), Conv2dAlgo::Blocked);
        assert!(load(&blocked).choices.is_empty());
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2, "no temporary file is left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_cache_file_follows_the_environment() {
        let os = |s: &str| Some(OsString::from(s));
        let path = cache_path_from;
        assert_eq!(
            path(os("/t/choices.json"), os("/x"), os("/h")),
            Some(PathBuf::from("/t/choices.json"))
        );
        assert_eq!(path(os("off"), os("/x"), os("/h")), None);
        assert_eq!(
            path(None, os("/x"), os("/h")),
            Some(PathBuf::from("/x/syncstep/autotune.json"))
        );
        assert_eq!(
            path(os(""), os("relative"), os("/h")),
            Some(PathBuf::from("/h/.cache/syncstep/autotune.json"))
        );
        assert_eq!(path(None, None, None), None);
    }
}
