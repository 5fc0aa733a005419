//! The environment variables syncstep's faces read, and what each means, in one place. The
//! library reads none: [`Environment::read`] takes a lookup (the command line's
//! `std::env::var_os`, the tests' own), and what it finds becomes configuration
//! ([`Environment::devices`]). A value without a meaning is refused the same way for every
//! variable, naming it and the values it takes.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::gpu::AdapterChoice;
#[cfg(not(target_arch = "wasm32"))]
use crate::kernels::conv2d::autotune_cache_path;
use crate::kernels::conv2d::{parse_forced, Conv2dAlgo, Forced, KernelPlan, KernelPolicy};
use crate::kernels::DeviceConfig;

/// A variable whose value has no meaning, with the values it takes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value:?}: give {takes}, or unset it")]
pub struct VariableError {
    pub name: &'static str,
    pub value: String,
    pub takes: String,
}

/// What the environment asks of this process.
#[derive(Debug)]
pub struct Environment {
    /// `SYNCSTEP_ADAPTER`: the adapter when no flag names one (`1`, `gl`, `vulkan:1`).
    pub adapter: Option<AdapterChoice>,
    /// `SYNCSTEP_SUBGROUPS`: `off` runs the kernels that load what subgroups would broadcast.
    pub subgroups: bool,
    /// `SYNCSTEP_DUMP_SHADERS`: a folder every shader module is written to as it compiles.
    pub shader_dump: Option<PathBuf>,
    /// `SYNCSTEP_CONV_ALGO`: a convolution variant forced everywhere, or `guess`.
    pub conv_algo: Option<Forced>,
    /// `SYNCSTEP_WINOGRAD`: `on` or `off` forces Winograd's convolutions either way.
    pub winograd: Option<bool>,
    /// `SYNCSTEP_AUTOTUNE_CACHE` (a path, or `off`), else the XDG cache folder's
    /// `syncstep/autotune.json`.
    pub autotune_cache: Option<PathBuf>,
    /// `SYNCSTEP_MPI_SILENCE`: how long an MPI rank may go unheard, at least 1 s (default 20).
    pub mpi_silence: Duration,
    /// `LP_NUM_THREADS`: lavapipe's threads, recorded in `bench` reports.
    pub lp_num_threads: Option<String>,
}

impl Default for Environment {
    fn default() -> Self {
        Environment {
            adapter: None,
            subgroups: true,
            shader_dump: None,
            conv_algo: None,
            winograd: None,
            autotune_cache: None,
            mpi_silence: Duration::from_secs(20),
            lp_num_threads: None,
        }
    }
}

/// The longest `SYNCSTEP_MPI_SILENCE`, a day: past it a lost rank is never noticed.
const MAX_MPI_SILENCE: f64 = 86400.0;

/// What the existing `path` is when it is not a regular file (following links): reading a pipe
/// or a device waits or never ends, and a folder holds no cache.
fn not_a_regular_file(path: &std::path::Path) -> Option<&'static str> {
    let meta = std::fs::metadata(path).ok()?;
    match () {
        _ if meta.is_file() => None,
        _ if meta.is_dir() => Some("a folder"),
        _ => Some("a pipe or a device"),
    }
}

/// Makes `dir` for the shader dump, or takes it as it is when it is an empty folder: the dump
/// writes a file per shader module there, over what has that name, so a folder holding
/// anything (the user's files, a dataset) or a link is refused.
fn dump_folder(dir: &std::path::Path) -> Result<(), String> {
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir(dir).map_err(|e| format!("cannot make it: {e}"))
        }
        Err(e) => Err(e.to_string()),
        Ok(meta) if meta.file_type().is_symlink() => Err("it is a symbolic link".into()),
        Ok(meta) if !meta.is_dir() => Err("it is not a folder".into()),
        Ok(_) => match std::fs::read_dir(dir).map(|mut entries| entries.next().is_none()) {
            Ok(true) => Ok(()),
            Ok(false) => Err("it is not empty".into()),
            Err(e) => Err(e.to_string()),
        },
    }
}

/// `takes` for `name`, which holds `value`.
fn refuse(name: &'static str, value: &str, takes: &str) -> VariableError {
    VariableError { name, value: value.into(), takes: takes.into() }
}

/// The variables `var` gives, each read and bounded as it is asked for.
struct Variables<F: Fn(&str) -> Option<OsString>> {
    var: F,
}

impl<F: Fn(&str) -> Option<OsString>> Variables<F> {
    /// The variable's text (an empty variable counts as unset).
    fn text(&self, name: &'static str) -> Result<Option<String>, VariableError> {
        match (self.var)(name).filter(|v| !v.is_empty()) {
            None => Ok(None),
            Some(v) => v
                .into_string()
                .map(Some)
                .map_err(|v| refuse(name, &v.to_string_lossy(), "valid UTF-8")),
        }
    }

    fn on_off(&self, name: &'static str, default: &str) -> Result<Option<bool>, VariableError> {
        match self.text(name)?.as_deref().map(str::trim) {
            None => Ok(None),
            Some("on") => Ok(Some(true)),
            Some("off") => Ok(Some(false)),
            Some(other) => Err(refuse(name, other, &format!("on or off ({default})"))),
        }
    }

    fn adapter(&self) -> Result<Option<AdapterChoice>, VariableError> {
        let Some(v) = self.text("SYNCSTEP_ADAPTER")? else { return Ok(None) };
        AdapterChoice::parse(&v).map(Some).map_err(|e| {
            refuse("SYNCSTEP_ADAPTER", &v, &format!("an adapter `syncstep info` lists ({e})"))
        })
    }

    fn conv_algo(&self) -> Result<Option<Forced>, VariableError> {
        let Some(v) = self.text("SYNCSTEP_CONV_ALGO")? else { return Ok(None) };
        parse_forced(&v).map_err(|_| {
            let known: Vec<String> = Conv2dAlgo::all().iter().map(|a| a.to_string()).collect();
            refuse("SYNCSTEP_CONV_ALGO", &v, &format!("one of {}, guess", known.join(", ")))
        })
    }

    /// The autotune cache's file, refused where the path is not a regular file. A browser has
    /// no files: no cache.
    fn autotune_cache(&self) -> Result<Option<PathBuf>, VariableError> {
        #[cfg(target_arch = "wasm32")]
        let cache: Option<PathBuf> = None;
        #[cfg(not(target_arch = "wasm32"))]
        let cache = autotune_cache_path(
            (self.var)("SYNCSTEP_AUTOTUNE_CACHE"),
            (self.var)("XDG_CACHE_HOME"),
            (self.var)("HOME"),
        );
        if let Some(what) = cache.as_deref().and_then(not_a_regular_file) {
            let takes = format!(
                "the path of a file (this is {what}), or off for no cache (it is read and written whole)"
            );
            let path = cache.as_deref().map(|c| c.to_string_lossy()).unwrap_or_default();
            return Err(refuse("SYNCSTEP_AUTOTUNE_CACHE", &path, &takes));
        }
        Ok(cache)
    }

    /// wgpu's own: it ignores a name it does not know with a warning, and then offers no
    /// backend at all.
    fn check_wgpu_backend(&self) -> Result<(), VariableError> {
        let Some(v) = self.text("WGPU_BACKEND")? else { return Ok(()) };
        let known =
            ["vulkan", "vk", "dx12", "d3d12", "metal", "mtl", "opengl", "gles", "gl", "webgpu"];
        if v.to_lowercase().split(',').all(|b| known.contains(&b.trim())) {
            return Ok(());
        }
        let takes = "backends wgpu knows, comma-separated: vulkan, metal, dx12, gl or webgpu";
        Err(refuse("WGPU_BACKEND", &v, takes))
    }

    fn mpi_silence(&self, default: Duration) -> Result<Duration, VariableError> {
        let Some(v) = self.text("SYNCSTEP_MPI_SILENCE")? else { return Ok(default) };
        match v.trim().parse::<f64>() {
            Ok(s) if (1.0..=MAX_MPI_SILENCE).contains(&s) => Ok(Duration::from_secs_f64(s)),
            _ => {
                let takes = "the seconds a rank may go unheard, 1 to 86400 (default 20)";
                Err(refuse("SYNCSTEP_MPI_SILENCE", &v, takes))
            }
        }
    }

    fn shader_dump(&self) -> Result<Option<PathBuf>, VariableError> {
        let Some(dir) = (self.var)("SYNCSTEP_DUMP_SHADERS").filter(|v| !v.is_empty()) else {
            return Ok(None);
        };
        let dir = PathBuf::from(dir);
        dump_folder(&dir).map_err(|why| {
            let takes = format!(
                "a folder to make, or an empty one, for the shaders ({why}): files there would be replaced"
            );
            refuse("SYNCSTEP_DUMP_SHADERS", &dir.to_string_lossy(), &takes)
        })?;
        Ok(Some(dir))
    }
}

impl Environment {
    /// The environment `var` gives (an empty variable counts as unset).
    pub fn read(var: impl Fn(&str) -> Option<OsString>) -> Result<Environment, VariableError> {
        let v = Variables { var };
        let defaults = Environment::default();
        // In this order: a variable's error is the first of them that is wrong.
        let adapter = v.adapter()?;
        let subgroups = v.on_off(
            "SYNCSTEP_SUBGROUPS",
            "off: kernels that load what subgroups would broadcast; on: the default",
        )?;
        let conv_algo = v.conv_algo()?;
        let winograd = v.on_off("SYNCSTEP_WINOGRAD", "unset: on for CPU adapters, off on GPUs")?;
        let autotune_cache = v.autotune_cache()?;
        v.check_wgpu_backend()?;
        let mpi_silence = v.mpi_silence(defaults.mpi_silence)?;
        let shader_dump = v.shader_dump()?;
        Ok(Environment {
            adapter,
            subgroups: subgroups.unwrap_or(defaults.subgroups),
            shader_dump,
            conv_algo,
            winograd,
            autotune_cache,
            mpi_silence,
            lp_num_threads: v.text("LP_NUM_THREADS")?,
        })
    }

    /// The adapter when no flag names one: `SYNCSTEP_ADAPTER`'s, else the first.
    pub fn adapter(&self) -> AdapterChoice {
        self.adapter.clone().unwrap_or_default()
    }

    /// What this process's devices are made with: `plan`, timing afresh with `retune`, and what
    /// the environment forces.
    pub fn devices(&self, plan: KernelPlan, retune: bool) -> DeviceConfig {
        let policy = KernelPolicy::new(plan, self.conv_algo, self.autotune_cache.clone())
            .with_winograd(self.winograd)
            .with_retune(retune);
        DeviceConfig {
            policy: Arc::new(policy),
            subgroups: self.subgroups,
            shader_dump: self.shader_dump.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(vars: &[(&str, &str)]) -> Result<Environment, VariableError> {
        let vars: Vec<(String, OsString)> =
            vars.iter().map(|(k, v)| (k.to_string(), OsString::from(v))).collect();
        Environment::read(|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    /// Every variable refuses a value without a meaning the same way, naming itself and what it
    /// takes; empty is unset.
    #[test]
    fn every_variable_refuses_a_bad_value_the_same_way() {
        for (name, bad) in [
            ("SYNCSTEP_ADAPTER", "quantum"),
            ("SYNCSTEP_SUBGROUPS", "garbage"),
            ("SYNCSTEP_CONV_ALGO", "fastest"),
            ("SYNCSTEP_WINOGRAD", "maybe"),
            ("SYNCSTEP_MPI_SILENCE", "0.5"),
            ("SYNCSTEP_MPI_SILENCE", "soon"),
            ("SYNCSTEP_MPI_SILENCE", "1e20"),
            ("SYNCSTEP_MPI_SILENCE", "1e300"),
            ("SYNCSTEP_MPI_SILENCE", "inf"),
            ("SYNCSTEP_AUTOTUNE_CACHE", "/"),
            ("SYNCSTEP_AUTOTUNE_CACHE", "/dev/null"),
            ("WGPU_BACKEND", "garbage"),
            ("WGPU_BACKEND", "vulkan,,gl"),
        ] {
            let e = read(&[(name, bad)]).unwrap_err().to_string();
            assert!(e.starts_with(name), "{e}");
            assert!(e.contains(bad), "{e}");
        }
        let e = read(&[("SYNCSTEP_WINOGRAD", "maybe")]).unwrap_err().to_string();
        assert!(e.contains("give on or off") && e.ends_with("or unset it"), "{e}");
        let empty = read(&[("SYNCSTEP_WINOGRAD", ""), ("SYNCSTEP_MPI_SILENCE", "")]).unwrap();
        assert_eq!((empty.winograd, empty.mpi_silence), (None, Duration::from_secs(20)));
    }

    /// The shader dump goes only into a folder it makes or an empty one: a folder of the
    /// user's, a file, a link (even to an empty folder) are refused and left as they were.
    #[test]
    fn shaders_are_dumped_only_into_a_new_or_empty_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let dump =
            |dir: &std::path::Path| read(&[("SYNCSTEP_DUMP_SHADERS", dir.to_str().unwrap())]);
        let made = d.join("made");
        assert_eq!(dump(&made).unwrap().shader_dump, Some(made.clone()));
        assert!(made.is_dir(), "made at start");
        assert!(dump(&made).is_ok(), "still empty: taken");
        std::fs::write(made.join("avgpool.wgsl"), "the user's").unwrap();
        let (empty, link, file) = (d.join("empty"), d.join("link"), d.join("file"));
        std::fs::create_dir(&empty).unwrap();
        std::os::unix::fs::symlink(&empty, &link).unwrap();
        std::fs::write(&file, "notes").unwrap();
        for (dir, says) in [
            (&made, "it is not empty"),
            (&link, "symbolic link"),
            (&file, "not a folder"),
            (&d.join("no/such"), "cannot make it"),
        ] {
            let e = dump(dir).unwrap_err().to_string();
            assert!(e.starts_with("SYNCSTEP_DUMP_SHADERS=") && e.contains(says), "{e}");
        }
        assert_eq!(std::fs::read_to_string(made.join("avgpool.wgsl")).unwrap(), "the user's");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "notes");
        assert!(!d.join("no").exists());
    }

    #[test]
    fn good_values_configure_the_devices() {
        let env = read(&[
            ("SYNCSTEP_ADAPTER", "gl:1"),
            ("SYNCSTEP_SUBGROUPS", "off"),
            ("SYNCSTEP_CONV_ALGO", "guess"),
            ("SYNCSTEP_WINOGRAD", "on"),
            ("SYNCSTEP_AUTOTUNE_CACHE", "/tmp/choices.json"),
            ("SYNCSTEP_MPI_SILENCE", "2.5"),
        ])
        .unwrap();
        assert_eq!(env.adapter(), AdapterChoice::parse("gl:1").unwrap());
        assert_eq!(env.mpi_silence, Duration::from_secs_f64(2.5));
        let config = env.devices(KernelPlan::Gpu, true);
        assert!(!config.subgroups);
        let policy = &config.policy;
        assert_eq!(
            (policy.plan, policy.forced, policy.winograd),
            (KernelPlan::Gpu, Some(Forced::Guess), Some(true))
        );
        assert_eq!(policy.cache_file, Some(PathBuf::from("/tmp/choices.json")));
        let nothing = read(&[]).unwrap();
        assert_eq!((nothing.adapter(), nothing.subgroups), (AdapterChoice::default(), true));
        assert_eq!(nothing.autotune_cache, None, "no HOME, no XDG_CACHE_HOME: no cache file");
    }
}
