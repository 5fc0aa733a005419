//! The autotune's cache file (natively only: a browser has no files): the choices, with the
//! timings they were made from, kept across processes. It is JSON: the crate version, a hash of
//! the kernels' source as compiled and the format (another build's choices are not read), then
//! the choices. A file there that is not a cache of ours is never overwritten.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use serde::{Deserialize, Serialize};

use super::key::{ChoiceKey, Choices};
use super::timing::Tuned;
use crate::conv2d::backward_weight::blocked_weight_shader;
use crate::conv2d::tiles::gemm_lanes_shader;
use crate::conv2d::{Conv2dOp, Conv2dShape, GEMM_TILES, SHADER};

/// The cache file's layout: a file of another layout is timed afresh, as another build's.
const FORMAT: u64 = 2;

/// The cache file as stored.
#[derive(Serialize, Deserialize)]
pub(super) struct CacheFile {
    /// The crate version that wrote it.
    syncstep_autotune: String,
    /// [`kernels_hash`] of the build that wrote it.
    kernels: String,
    /// [`FORMAT`].
    format: u64,
    choices: Vec<Choice>,
}

#[derive(Serialize, Deserialize)]
pub(super) struct Choice {
    adapter: String,
    op: Conv2dOp,
    shape: Conv2dShape,
    #[serde(flatten)]
    tuned: Tuned,
}

/// A hash of the kernels' source as compiled (the base module, the Blocked weight gradient's
/// broadcasting ones, every tile's with and without broadcasts): a change to a kernel or to the
/// tiles on offer, within a version too, changes which is fastest.
pub(super) fn kernels_hash() -> &'static str {
    static HASH: OnceLock<String> = OnceLock::new();
    HASH.get_or_init(|| {
        let tiles = GEMM_TILES.iter().flat_map(|&t| [false, true].map(|b| gemm_lanes_shader(t, b)));
        let blocked = [4, 8].map(|groups| blocked_weight_shader(groups, true, false));
        let shaders = std::iter::once(SHADER).chain(blocked).chain(tiles);
        // SHA-256 (stable across builds and platforms, unlike std's hasher), its first 8 bytes
        // in hex: the cache only tells builds apart.
        use sha2::Digest;
        let digest = shaders.fold(sha2::Sha256::new(), |hash, shader| {
            hash.chain_update(shader.text().as_bytes())
                .chain_update(format!("{:?}", shader.constants))
        });
        digest.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect()
    })
}

/// The cache file, from the values of `SYNCSTEP_AUTOTUNE_CACHE` (`chosen`: a path, or `off` for
/// none), `XDG_CACHE_HOME` and `HOME`: `chosen`, else `$XDG_CACHE_HOME/syncstep/autotune.json`,
/// else `~/.cache/syncstep/autotune.json`. The caller reads the variables.
pub fn cache_path(
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
    /// Every choice in it, settled or provisional.
    pub(super) choices: HashMap<ChoiceKey, Tuned>,
    /// The file exists and is not a cache of ours (nor of an earlier format): it is left alone.
    pub(super) foreign: bool,
}

impl Loaded {
    /// The choices to take without timing: the settled ones.
    pub(super) fn settled(self) -> Choices {
        self.choices.into_iter().filter(|(_, t)| t.settled).map(|(key, t)| (key, t.algo)).collect()
    }
}

/// The choices in `file`: none when it is missing, another build (or an earlier layout) wrote
/// it, or it cannot be read or is corrupt (with a warning). Never an error: the cache only saves
/// time.
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
            return Loaded { choices: HashMap::new(), foreign: true };
        }
    };
    let file_text = |key: &str| doc.get(key).and_then(serde_json::Value::as_str);
    if file_text("syncstep_autotune") != Some(env!("CARGO_PKG_VERSION"))
        || file_text("kernels") != Some(kernels_hash())
        || doc.get("format").and_then(serde_json::Value::as_u64) != Some(FORMAT)
    {
        log::debug!(
            "autotune cache {}: written by another build or in another layout; timing afresh",
            file.display()
        );
        return Loaded::default();
    }
    match serde_json::from_value::<CacheFile>(doc) {
        Ok(cache) => Loaded {
            choices: cache
                .choices
                .into_iter()
                .map(|c| ((c.adapter, c.op, c.shape), c.tuned))
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

/// Puts `key → tuned` in `file` in place of what it held for `key`, the file read again so that
/// other processes' choices stay, and writes it back atomically
/// ([`syncstep_host::files::write_atomic`]: a temporary file renamed over it). A failure, or a
/// file that is not ours, is a warning.
pub(super) fn remember(file: &Path, key: &ChoiceKey, tuned: &Tuned) {
    // One writer at a time in this process: a read, an insert and a write, whole.
    static WRITING: Mutex<()> = Mutex::new(());
    let _one = WRITING.lock().unwrap_or_else(|p| p.into_inner());
    let Loaded { mut choices, foreign } = load(file);
    if foreign {
        return;
    }
    choices.insert(key.clone(), tuned.clone());
    let mut choices: Vec<Choice> = choices
        .into_iter()
        .map(|((adapter, op, shape), tuned)| Choice { adapter, op, shape, tuned })
        .collect();
    choices.sort_by_key(|c| (c.adapter.clone(), c.op.name(), format!("{:?}", c.shape)));
    let cache = CacheFile {
        syncstep_autotune: env!("CARGO_PKG_VERSION").to_string(),
        kernels: kernels_hash().to_string(),
        format: FORMAT,
        choices,
    };
    let text = serde_json::to_string_pretty(&cache).expect("the cache serialises");
    let written = file
        .parent()
        .filter(|dir| !dir.as_os_str().is_empty())
        .map_or(Ok(()), std::fs::create_dir_all)
        .map_err(|e| e.to_string())
        .and_then(|()| {
            syncstep_host::files::write_atomic(file, (text + "\n").as_bytes()).map_err(
                |e| match e {
                    syncstep_host::files::FileError::Io { message, .. } => message,
                    other => other.to_string(),
                },
            )
        });
    if let Err(e) = written {
        log::warn!(
            "autotune cache {}: cannot write it ({e}); choices are kept for this process only",
            file.display()
        );
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::conv2d::tune::timing::Timing;
    use crate::conv2d::Conv2dAlgo;

    /// A fresh directory for one test's cache file, removed when dropped, however the test
    /// ends.
    pub(in crate::conv2d) fn cache_dir(test: &str) -> tempfile::TempDir {
        tempfile::Builder::new().prefix(&format!("syncstep-{test}-")).tempdir().unwrap()
    }

    pub(in crate::conv2d) fn key(adapter: &str, op: Conv2dOp, n: u32) -> ChoiceKey {
        let shape =
            Conv2dShape { n, c_in: 64, h: 8, w: 8, c_out: 64, kh: 3, kw: 3, stride: 1, pad: 1 };
        (adapter.into(), op, shape)
    }

    #[test]
    fn choices_are_read_back_from_the_cache_file() {
        let tmp = cache_dir("cache-round-trip");
        let dir = tmp.path();
        let file = dir.join("sub").join("autotune.json");
        assert!(load(&file).choices.is_empty(), "a missing file holds no choices");
        let pixels = Conv2dAlgo::Gemm(GEMM_TILES[2]);
        let (vulkan, gl) = ("Vulkan|llvmpipe|a b", "Gl|llvmpipe|c");
        let timings = vec![Timing { algo: pixels, best_us: 12.5, spread: 1.1, runs: 3 }];
        let settled = |algo| Tuned { algo, settled: true, timings: timings.clone() };
        let provisional = Tuned { settled: false, ..settled(Conv2dAlgo::Blocked) };
        remember(&file, &key(vulkan, Conv2dOp::BackwardWeight, 8), &settled(pixels));
        remember(&file, &key(vulkan, Conv2dOp::Forward, 8), &settled(Conv2dAlgo::Blocked));
        remember(&file, &key(gl, Conv2dOp::BackwardWeight, 8), &provisional);
        remember(&file, &key(vulkan, Conv2dOp::Forward, 8), &settled(Conv2dAlgo::Direct)); // replaces
        let loaded = load(&file);
        assert_eq!(loaded.choices.len(), 3, "{loaded:?}");
        assert_eq!(loaded.choices.get(&key(gl, Conv2dOp::BackwardWeight, 8)), Some(&provisional));
        let choices = loaded.settled();
        assert_eq!(choices.len(), 2, "{choices:?}: the provisional choice is not taken");
        assert_eq!(choices.get(&key(vulkan, Conv2dOp::BackwardWeight, 8)), Some(&pixels));
        assert_eq!(choices.get(&key(vulkan, Conv2dOp::Forward, 8)), Some(&Conv2dAlgo::Direct));
        assert_eq!(choices.get(&key(vulkan, Conv2dOp::BackwardWeight, 4)), None);
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.contains(r#""best_us": 12.5"#) && text.contains(r#""settled": false"#));
    }

    #[test]
    fn a_corrupt_unreadable_or_other_build_cache_file_is_ignored_and_a_foreign_one_kept() {
        let tmp = cache_dir("cache-corrupt");
        let dir = tmp.path();
        let file = dir.join("autotune.json");
        let version = env!("CARGO_PKG_VERSION");
        let choice = r#"{"adapter":"Vulkan|x","op":"conv2d_forward","shape":{"n":8,"c_in":64,"h":8,"w":8,"c_out":64,"kh":3,"kw":3,"stride":1,"pad":1},"algo":"blocked","settled":true,"timings":[]}"#;
        let cache = |version: &str, kernels: &str, format: &str, choice: &str| {
            format!(
                r#"{{"syncstep_autotune":"{version}","kernels":"{kernels}",{format}"choices":[{choice}]}}"#
            )
        };
        let format = &format!(r#""format":{FORMAT},"#);
        let hash = kernels_hash();
        // The layout before the timings were kept: no format, a bare algo per choice.
        let earlier = choice.replace(r#","settled":true,"timings":[]"#, "");
        let ours = [
            cache(version, hash, format, &choice.replace("blocked", "gemm-pixels-3x3")),
            cache(version, hash, format, &choice.replace(r#""n":8,"#, "")),
            cache(version, hash, format, &choice.replace(r#""settled":true,"#, "")),
            cache(version, hash, "", &earlier),
            cache(version, hash, r#""format":1,"#, choice),
            cache("0.0.0-other", hash, format, choice),
            cache(version, "0123456789abcdef", format, choice),
            "syncstep-autotune 0.1.0 0123456789abcdef\nconv2d_forward\t8 64 8 8 64 3 3 1 1\tblocked\tx\n".into(),
        ];
        let tuned = Tuned { algo: Conv2dAlgo::Blocked, settled: true, timings: Vec::new() };
        for text in &ours {
            std::fs::write(&file, text).unwrap();
            let loaded = load(&file);
            assert!(loaded.choices.is_empty() && !loaded.foreign, "{text}");
            // Ours, so replaced by the next choice.
            remember(&file, &key("Vulkan|y", Conv2dOp::Forward, 1), &tuned);
            assert_eq!(load(&file).choices.len(), 1, "{text}");
        }
        std::fs::write(&file, cache(version, hash, format, choice)).unwrap();
        assert_eq!(load(&file).settled().len(), 1, "the same file with nothing wrong is read");
        // Not a cache of ours: read as none, and never overwritten.
        for foreign in [b"\xff\xfe not text".to_vec(), b"{\"a\": 1}".to_vec(), b"notes\n".to_vec()]
        {
            std::fs::write(&file, &foreign).unwrap();
            assert!(load(&file).foreign, "{}", String::from_utf8_lossy(&foreign));
            remember(&file, &key("Vulkan|x", Conv2dOp::Forward, 1), &tuned);
            assert_eq!(std::fs::read(&file).unwrap(), foreign, "a foreign file is left as it was");
        }
        // A directory where the file should be: unreadable and unwritable, still no error.
        let blocked = dir.join("a directory");
        std::fs::create_dir_all(&blocked).unwrap();
        remember(&blocked, &key("Vulkan|x", Conv2dOp::Forward, 1), &tuned);
        assert!(load(&blocked).choices.is_empty());
        assert_eq!(std::fs::read_dir(dir).unwrap().count(), 2, "no temporary file is left behind");
    }

    #[test]
    fn the_cache_file_follows_the_environment() {
        let os = |s: &str| Some(OsString::from(s));
        let path = cache_path;
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
