//! Choosing a variant for each (adapter, op, shape), by the device's [`KernelPolicy`]: forced
//! (`SYNCSTEP_CONV_ALGO`), else the GPU plan, else timed on the device (natively) or guessed by
//! device type (in a browser, which has no clock), and remembered for the device's life and,
//! natively, in a cache file. Every variant gives the same bits, so the choice changes speed
//! only.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

#[cfg(not(target_arch = "wasm32"))]
mod cache;
#[cfg(not(target_arch = "wasm32"))]
pub use cache::cache_path as autotune_cache_path;
mod key;
#[cfg(not(target_arch = "wasm32"))]
mod timing;

use key::{adapter_key, is_cpu, ChoiceKey, Choices};

use super::backward_weight::fits_loop_limit;
use super::{implicit, Conv2dAlgo, Conv2dOp, Conv2dShape, GemmLanes, GemmTile, GEMM_TILES};
use crate::{KernelError, Result};
use syncstep_gpu::Gpu;

/// How the plain launchers choose kernels when nothing forces one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelPlan {
    /// GPU adapters (discrete, integrated, virtual) take the GPU plan; CPU adapters the timed
    /// choice natively, the clockless guess in a browser.
    #[default]
    Auto,
    /// The GPU plan on any adapter, without a clock: the implicit-GEMM family for every op, its
    /// tiles and splits chosen by shape (`implicit::plan`, `implicit::weight_plan`). What a GPU
    /// runs; on a CPU adapter it gives the same bits, slowly, and the shape of a GPU's work.
    Gpu,
    /// The fastest candidate timed on the adapter (natively), on any adapter.
    Timed,
}

impl KernelPlan {
    /// The name `--plan-for` takes and reports write.
    pub fn name(self) -> &'static str {
        match self {
            KernelPlan::Auto => "auto",
            KernelPlan::Gpu => "gpu",
            KernelPlan::Timed => "timed",
        }
    }
}

/// A variant forced on every convolution (the command line's `SYNCSTEP_CONV_ALGO`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forced {
    /// This variant where the op has it, else Blocked (the gathering GEMM is the input-VJP's
    /// only).
    Algo(Conv2dAlgo),
    /// The browser's choice without a clock, to run natively what a browser runs.
    Guess,
}

/// How one device's convolutions choose their variants: given to the device when it is made
/// ([`Device::new`]) by its caller (the command line builds it from flags and environment
/// variables; the library reads none).
#[derive(Debug)]
pub struct KernelPolicy {
    pub plan: KernelPlan,
    pub forced: Option<Forced>,
    /// Whether the forwards and input-VJPs of 3×3, stride-1 convolutions run as Winograd, in the
    /// tile [`Conv2dShape::winograd`] gives the shape (winograd.rs): fewer multiplies, other
    /// roundings than the plain sum. `Some` forces it (`SYNCSTEP_WINOGRAD`); by default it is
    /// on where the run's first device to convolve is a CPU adapter without the GPU plan, whose
    /// register tiles it outruns, and off under the GPU plan, whose direct GEMMs do more
    /// arithmetic per byte than Winograd's transforms move (docs/performance-log.md, 2026-12-06). Every device of
    /// a run takes the same answer, as the run's shared policy does.
    pub winograd: Option<bool>,
    /// The default's answer, once settled.
    winograd_settled: OnceLock<bool>,
    /// Where the autotune's choices persist between processes (natively; see cache.rs).
    /// None: they are this device's only.
    pub cache_file: Option<PathBuf>,
    /// The choices made on this device or read from `cache_file`.
    chosen: Mutex<Chosen>,
}

#[derive(Debug, Default)]
struct Chosen {
    choices: Choices,
    /// The implicit-GEMM family's plans ([`remembered_plan`]).
    plans: HashMap<ChoiceKey, implicit::Plan>,
    /// Whether `cache_file`'s settled choices have been taken: once, not for each of a step's
    /// ~40 (op, shape) pairs; never when retuning ([`KernelPolicy::with_retune`]).
    file_read: bool,
}

impl KernelPolicy {
    pub fn new(plan: KernelPlan, forced: Option<Forced>, cache_file: Option<PathBuf>) -> Self {
        KernelPolicy {
            plan,
            forced,
            cache_file,
            winograd: None,
            winograd_settled: OnceLock::new(),
            chosen: Mutex::default(),
        }
    }

    /// This policy with Winograd forced on or off, or (None) by default.
    pub fn with_winograd(self, winograd: Option<bool>) -> Self {
        KernelPolicy { winograd, ..self }
    }

    /// Whether `gpu`'s convolutions take Winograd where their shapes allow (see
    /// [`KernelPolicy::winograd`]).
    pub fn winograd_on(&self, gpu: &Gpu) -> bool {
        self.winograd.unwrap_or_else(|| {
            *self.winograd_settled.get_or_init(|| self.plan != KernelPlan::Gpu && is_cpu(&gpu.info))
        })
    }
}

impl Default for KernelPolicy {
    fn default() -> Self {
        KernelPolicy::new(KernelPlan::Auto, None, None)
    }
}

/// What a [`Device`] is made with: its kernel policy, and how its kernels compile. The devices
/// of one run share one policy, and so its choices.
#[derive(Clone, Debug)]
pub struct DeviceConfig {
    pub policy: Arc<KernelPolicy>,
    /// Kernels pass values by subgroupBroadcast where the device has subgroups of 8 or more;
    /// false runs the kernels that load instead, as devices without subgroups do.
    pub subgroups: bool,
    /// A folder every shader module is written to as it is compiled, for reading.
    pub shader_dump: Option<PathBuf>,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig::with_policy(Arc::default())
    }
}

impl DeviceConfig {
    /// `policy`, with subgroups where the device has them and no shader dump.
    pub fn with_policy(policy: Arc<KernelPolicy>) -> Self {
        DeviceConfig { policy, subgroups: true, shader_dump: None }
    }
}

/// A device as the kernels launch on it: the gpu layer's [`Gpu`] and the [`KernelPolicy`] that
/// chooses its convolutions' variants, given when the device is made. It dereferences to its
/// `Gpu`, so whatever takes a `&Gpu` takes a `&Device` too.
pub struct Device {
    gpu: Gpu,
    policy: Arc<KernelPolicy>,
}

impl Device {
    pub fn new(mut gpu: Gpu, config: &DeviceConfig) -> Device {
        gpu.broadcasts &= config.subgroups;
        gpu.shader_dump = config.shader_dump.clone();
        Device { gpu, policy: config.policy.clone() }
    }

    pub fn policy(&self) -> &Arc<KernelPolicy> {
        &self.policy
    }
}

impl std::ops::Deref for Device {
    type Target = Gpu;
    fn deref(&self) -> &Gpu {
        &self.gpu
    }
}

impl std::ops::DerefMut for Device {
    fn deref_mut(&mut self) -> &mut Gpu {
        &mut self.gpu
    }
}

/// The variant the plain launchers use for `op` at `shape` on `gpu`, by its [`KernelPolicy`]:
/// 1. a forced variant (`direct`, `blocked`, `implicit-gemm`, `gemm-pixels-8x8`, …; see
///    [`Conv2dAlgo::all`]) where `op` has that kernel (else Blocked), or the browser's guess;
/// 2. the GPU plan ([`KernelPlan::Gpu`]) where the policy asks for it or the adapter is a GPU
///    and it asks for nothing else;
/// 3. natively, the fastest of [`candidates`] timed on this adapter at this shape, on first use;
///    in a browser, where there is no clock, `guess` by device type.
///
/// Every variant gives the same bits, so this changes speed only.
pub fn conv2d_algo(gpu: &Device, op: Conv2dOp, shape: &Conv2dShape) -> Result<Conv2dAlgo> {
    let policy = gpu.policy();
    match policy.forced {
        Some(Forced::Algo(forced)) => {
            return Ok(if forced.has(op) { forced } else { Conv2dAlgo::Blocked })
        }
        Some(Forced::Guess) => return Ok(guess(&gpu.info, op, shape, false)),
        None => {}
    }
    match policy.plan {
        KernelPlan::Gpu => Ok(guess(&gpu.info, op, shape, true)),
        KernelPlan::Auto if !is_cpu(&gpu.info) => Ok(guess(&gpu.info, op, shape, false)),
        KernelPlan::Auto | KernelPlan::Timed => autotuned_algo(gpu, op, shape),
    }
}

/// The implicit-GEMM family's plan for `op` at `shape` on `gpu`: made on first use and kept
/// with the device's policy (a plan weighs dozens of configurations, a step launches each shape
/// every time).
pub fn implicit_plan(gpu: &Device, op: Conv2dOp, shape: &Conv2dShape) -> Result<implicit::Plan> {
    let policy = gpu.policy();
    let key = (adapter_key(&gpu.info), op, *shape);
    if let Some(&plan) = policy.chosen().plans.get(&key) {
        return Ok(plan);
    }
    let plan = implicit::make_plan(gpu, op, shape)?;
    policy.chosen().plans.insert(key, plan);
    Ok(plan)
}

/// Whether `gpu` takes the kernels shaped for GPUs where an op has variants but no timed choice
/// (BatchNorm's per-example sums): under the GPU plan, or on a GPU adapter.
pub fn runs_gpu_kernels(gpu: &Device) -> bool {
    gpu.policy().plan == KernelPlan::Gpu || !is_cpu(&gpu.info)
}

/// [`conv2d_algo`]'s choice when nothing forces one: the fastest candidate, timed on first use
/// (natively) or remembered (by the device, or in its policy's cache file), or the browser's
/// guess.
pub fn autotuned_algo(gpu: &Device, op: Conv2dOp, shape: &Conv2dShape) -> Result<Conv2dAlgo> {
    let candidates = candidates(gpu, op);
    if candidates.len() == 1 {
        return Ok(candidates[0]);
    }
    let policy = gpu.policy();
    // Kernels that broadcast time differently from those that load: separate choices.
    let key = (adapter_key(&gpu.info) + if gpu.broadcasts { "|broadcast" } else { "" }, op, *shape);
    if let Some(&algo) = policy.chosen().choices.get(&key) {
        return Ok(algo);
    }
    shape.validate(op.name())?;
    #[cfg(not(target_arch = "wasm32"))]
    let algo = policy
        .remembered_or_timed(&key, &candidates, || timing::fastest(gpu, op, shape, &candidates))?;
    #[cfg(target_arch = "wasm32")]
    let algo = guess(&gpu.info, op, shape, false);
    log::debug!("{} {shape:?} on {}: {algo}", op.name(), gpu.info.name);
    policy.chosen().choices.insert(key, algo);
    Ok(algo)
}

impl KernelPolicy {
    /// With `retune` (`--retune`), the cache file's choices are not taken: each is timed
    /// afresh, once per policy, and replaces its entry in the file.
    pub fn with_retune(mut self, retune: bool) -> Self {
        self.chosen.get_mut().unwrap_or_else(|p| p.into_inner()).file_read |= retune;
        self
    }

    fn chosen(&self) -> std::sync::MutexGuard<'_, Chosen> {
        self.chosen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The settled choice for `key` in the cache file as this policy first read it.
    #[cfg(not(target_arch = "wasm32"))]
    fn remembered(&self, key: &ChoiceKey) -> Option<Conv2dAlgo> {
        let file = self.cache_file.as_deref()?;
        let mut chosen = self.chosen();
        if !chosen.file_read {
            chosen.file_read = true;
            let read = cache::load(file).settled();
            chosen.choices.extend(read);
        }
        chosen.choices.get(key).copied()
    }

    /// The choice for `key`: the cache file's settled one where it is one of `candidates`, else
    /// the one `time` makes, written to the cache file (provisional where the timings were too
    /// noisy to keep it: the next process times it again).
    #[cfg(not(target_arch = "wasm32"))]
    fn remembered_or_timed(
        &self,
        key: &ChoiceKey,
        candidates: &[Conv2dAlgo],
        time: impl FnOnce() -> Result<timing::Tuned>,
    ) -> Result<Conv2dAlgo> {
        if let Some(algo) = self.remembered(key).filter(|a| candidates.contains(a)) {
            return Ok(algo);
        }
        let tuned = time()?;
        if !tuned.settled {
            log::info!(
                "{} {:?} on {}: the timings were too noisy (other work on the machine?): {} \
                 serves this process, and is timed again by the next",
                key.1.name(),
                key.2,
                key.0,
                tuned.algo
            );
        }
        if let Some(file) = &self.cache_file {
            cache::remember(file, key, &tuned);
        }
        Ok(tuned.algo)
    }
}

/// `SYNCSTEP_CONV_ALGO`'s value, parsed; an unknown name is an error that lists the known ones.
pub fn parse_forced(name: &str) -> Result<Option<Forced>> {
    match name.trim() {
        "" => Ok(None),
        "guess" => Ok(Some(Forced::Guess)),
        name => Conv2dAlgo::parse(name).map(|a| Some(Forced::Algo(a))).ok_or_else(|| {
            let known: Vec<String> = Conv2dAlgo::all().iter().map(|a| a.to_string()).collect();
            KernelError::Arg {
                op: "conv2d",
                arg: "SYNCSTEP_CONV_ALGO",
                problem: format!("is `{name}`; known: {}, guess", known.join(", ")),
            }
        }),
    }
}

/// What the autotune times for `op` on `gpu`'s kind of adapter: Blocked, the register tiles
/// (which CPU drivers such as lavapipe and SwiftShader favour: they run a workgroup as a loop
/// over SIMD lanes, where a barrier is a coroutine switch) and the implicit-GEMM family. Direct
/// is never a candidate.
pub fn candidates(gpu: &Gpu, op: Conv2dOp) -> Vec<Conv2dAlgo> {
    candidates_for(&gpu.info.name, gpu.info.backend, op)
}

pub(super) fn candidates_for(
    adapter: &str,
    backend: wgpu::Backend,
    op: Conv2dOp,
) -> Vec<Conv2dAlgo> {
    let mut all = vec![Conv2dAlgo::Blocked];
    if op == Conv2dOp::BackwardWeight && backend == wgpu::Backend::Gl {
        return all; // the GEMMs are refused there (see backward_weight_gemm)
    }
    // SwiftShader's compiler takes over 8 GB and minutes for the weight-gradient GEMMs with
    // 64 outputs or more per invocation (measured natively, 8×8): those it is not given.
    let compiles = |t: &GemmTile| {
        !(op == Conv2dOp::BackwardWeight
            && adapter.contains("SwiftShader")
            && t.per_invocation * t.per_workgroup > 32)
    };
    all.extend(
        GEMM_TILES
            .iter()
            .filter(|t| compiles(t))
            .map(|&t| Conv2dAlgo::Gemm(t))
            .filter(|a| a.has(op)),
    );
    all.push(Conv2dAlgo::Implicit);
    all
}

/// Without a clock (wasm32, and the GPU plan): the implicit-GEMM family on GPUs, and on any
/// adapter taken `as_gpu`. On CPU adapters the weight gradient's Blocked kernel (2–2.5× the GEMMs' speed at
/// layer1–3 on SwiftShader, as on lavapipe) where the adapter runs it, else register tiles with
/// lanes over whichever of pixels and channels is larger. On wgpu's GL backend the weight
/// gradient is Blocked, its only kernel there (see backward_weight_gemm).
pub(super) fn guess(
    info: &wgpu::AdapterInfo,
    op: Conv2dOp,
    s: &Conv2dShape,
    as_gpu: bool,
) -> Conv2dAlgo {
    if op == Conv2dOp::BackwardWeight && info.backend == wgpu::Backend::Gl {
        return Conv2dAlgo::Blocked;
    }
    guess_for(as_gpu || !is_cpu(info), &info.name, op, s)
}

/// [`guess`] for an adapter taken as a GPU (`gpu`) or as a CPU driver named `adapter`.
pub(super) fn guess_for(gpu: bool, adapter: &str, op: Conv2dOp, s: &Conv2dShape) -> Conv2dAlgo {
    if gpu {
        return Conv2dAlgo::Implicit;
    }
    if op == Conv2dOp::BackwardWeight && fits_loop_limit(adapter, Conv2dAlgo::Blocked, s) {
        return Conv2dAlgo::Blocked;
    }
    let pixels = s.n as u64 * s.out_h() as u64 * s.out_w() as u64;
    let lanes = if pixels >= s.c_out as u64 { GemmLanes::Pixels } else { GemmLanes::Channels };
    Conv2dAlgo::Gemm(GemmTile { lanes, per_invocation: 4, per_workgroup: 8 })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SwiftShader is not given the weight-gradient GEMMs whose compile takes it over 8 GB;
    /// lavapipe and its other ops keep every tile; every adapter has the implicit-GEMM family.
    #[test]
    fn candidates_per_adapter() {
        let big = |all: &[Conv2dAlgo]| {
            all.iter().any(
                |a| matches!(a, Conv2dAlgo::Gemm(t) if t.per_invocation * t.per_workgroup > 32),
            )
        };
        let vulkan = wgpu::Backend::Vulkan;
        let swiftshader =
            candidates_for("SwiftShader Device (Subzero)", vulkan, Conv2dOp::BackwardWeight);
        assert!(!big(&swiftshader) && swiftshader.len() > 2, "{swiftshader:?}");
        assert!(big(&candidates_for("SwiftShader Device (Subzero)", vulkan, Conv2dOp::Forward)));
        assert!(big(&candidates_for(
            "llvmpipe (LLVM 15.0.6, 256 bits)",
            vulkan,
            Conv2dOp::BackwardWeight
        )));
        assert_eq!(
            candidates_for("llvmpipe", wgpu::Backend::Gl, Conv2dOp::BackwardWeight),
            [Conv2dAlgo::Blocked]
        );
        assert!(candidates_for("NVIDIA H200", vulkan, Conv2dOp::Forward)
            .contains(&Conv2dAlgo::Implicit));
    }

    #[test]
    fn syncstep_conv_algo_names_a_variant_or_guess() {
        let parse = parse_forced;
        assert_eq!(parse(" ").unwrap(), None);
        assert_eq!(parse("guess").unwrap(), Some(Forced::Guess));
        assert_eq!(
            parse("gemm-pixels-8x8").unwrap(),
            Some(Forced::Algo(Conv2dAlgo::Gemm(GEMM_TILES[2])))
        );
        let err = parse("fastest").unwrap_err().to_string();
        assert!(
            err.contains("SYNCSTEP_CONV_ALGO")
                && err.contains("`fastest`")
                && err.contains("blocked")
                && err.contains("guess"),
            "{err}"
        );
    }

    /// The browser's choice without a clock: GPUs the implicit-GEMM family; CPU adapters Blocked for
    /// the weight gradient unless llvmpipe's loop limit refuses it there, register tiles else.
    #[test]
    fn the_browsers_guess_by_device_type() {
        let small = Conv2dShape {
            n: 8,
            c_in: 256,
            h: 2,
            w: 2,
            c_out: 256,
            kh: 3,
            kw: 3,
            stride: 1,
            pad: 1,
        };
        let stem_224 = Conv2dShape {
            n: 8,
            c_in: 3,
            h: 224,
            w: 224,
            c_out: 64,
            kh: 7,
            kw: 7,
            stride: 2,
            pad: 3,
        };
        let (swiftshader, llvmpipe) =
            ("SwiftShader Device (Subzero)", "llvmpipe (LLVM 15.0.6, 256 bits)");
        const GPU: bool = true;
        const CPU: bool = false;
        assert_eq!(
            guess_for(GPU, "NVIDIA H200", Conv2dOp::BackwardWeight, &small),
            Conv2dAlgo::Implicit
        );
        assert_eq!(
            guess_for(CPU, swiftshader, Conv2dOp::BackwardWeight, &small),
            Conv2dAlgo::Blocked
        );
        assert_eq!(
            guess_for(CPU, swiftshader, Conv2dOp::BackwardWeight, &stem_224),
            Conv2dAlgo::Blocked
        );
        assert_eq!(guess_for(CPU, llvmpipe, Conv2dOp::BackwardWeight, &small), Conv2dAlgo::Blocked);
        assert!(matches!(
            guess_for(CPU, llvmpipe, Conv2dOp::BackwardWeight, &stem_224),
            Conv2dAlgo::Gemm(_)
        ));
        assert!(matches!(
            guess_for(CPU, swiftshader, Conv2dOp::Forward, &small),
            Conv2dAlgo::Gemm(GemmTile { lanes: GemmLanes::Channels, .. })
        ));
    }

    /// A CPU adapter takes the register tiles and Blocked unless the GPU plan asks for the GPU's
    /// kernels; a GPU adapter takes the GPU's kernels either way.
    #[test]
    fn the_gpu_plan_and_only_it_gives_a_cpu_adapter_the_gpus_kernels() {
        let adapter = |name: &str, device_type| wgpu::AdapterInfo {
            name: name.into(),
            vendor: 0,
            device: 0,
            device_type,
            device_pci_bus_id: String::new(),
            driver: String::new(),
            driver_info: String::new(),
            backend: wgpu::Backend::Vulkan,
            subgroup_min_size: 4,
            subgroup_max_size: 64,
            transient_saves_memory: None,
            limit_bucket: None,
        };
        let lavapipe = adapter("llvmpipe (LLVM 15.0.6, 256 bits)", wgpu::DeviceType::Cpu);
        let gpu = adapter("NVIDIA H200", wgpu::DeviceType::DiscreteGpu);
        let layer1 =
            Conv2dShape { n: 8, c_in: 64, h: 8, w: 8, c_out: 64, kh: 3, kw: 3, stride: 1, pad: 1 };
        for op in [Conv2dOp::Forward, Conv2dOp::BackwardInput, Conv2dOp::BackwardWeight] {
            assert_ne!(guess(&lavapipe, op, &layer1, false), Conv2dAlgo::Implicit, "{op:?}");
            assert_eq!(guess(&lavapipe, op, &layer1, true), Conv2dAlgo::Implicit, "{op:?}");
            assert_eq!(guess(&gpu, op, &layer1, false), Conv2dAlgo::Implicit, "{op:?}");
        }
    }

    mod autotuned {
        use std::cell::Cell;
        use std::path::Path;

        use super::super::cache::tests::{cache_dir, key};
        use super::super::cache::{load, remember};
        use super::super::timing::tests::{made_up, noisy, quiet, three};
        use super::super::timing::{tune, Tuned};
        use super::*;

        /// A process's policy, with `file` for its cache.
        fn process(file: &Path) -> KernelPolicy {
            KernelPolicy::new(KernelPlan::Timed, None, Some(file.to_path_buf()))
        }

        /// `policy`'s choice for `key` among the candidates of `speeds` (see `made_up`), and
        /// how many runs its clock took.
        fn choose(
            policy: &KernelPolicy,
            key: &ChoiceKey,
            speeds: &[(Conv2dAlgo, f64)],
            load: &dyn Fn(Conv2dAlgo, usize) -> f64,
        ) -> (Conv2dAlgo, usize) {
            let runs = Cell::new(0);
            let mut clock = made_up(speeds, load, &runs);
            let candidates: Vec<Conv2dAlgo> = speeds.iter().map(|&(a, _)| a).collect();
            let algo = policy
                .remembered_or_timed(key, &candidates, || tune(&candidates, &mut clock))
                .unwrap();
            (algo, runs.get())
        }

        /// Timed while other work slows the fastest candidate most and every run is noisy, the
        /// choice is wrong but provisional; the next process times it again, quietly, and
        /// settles the right one; the one after takes it from the file without timing.
        #[test]
        fn a_choice_timed_under_load_is_timed_again_until_it_settles() {
            let tmp = cache_dir("tune-provisional");
            let dir = tmp.path();
            let file = dir.join("autotune.json");
            let [fast, next, slow] = three();
            let speeds = [(slow, 30.0), (next, 10.5), (fast, 10.0)];
            let key = key("Vulkan|llvmpipe", Conv2dOp::Forward, 8);
            let busy = |a, k| noisy(a, k) * if a == fast { 1.5 } else { 1.0 };
            assert_eq!(choose(&process(&file), &key, &speeds, &busy).0, next);
            let written = load(&file).choices.remove(&key).expect("written");
            assert_eq!((written.algo, written.settled), (next, false), "{written:?}");
            assert!(!load(&file).settled().contains_key(&key), "provisional: not taken");

            let (algo, runs) = choose(&process(&file), &key, &speeds, &quiet);
            assert_eq!(algo, fast);
            assert!(runs > 0, "a provisional choice is timed again");
            assert_eq!(load(&file).settled().get(&key), Some(&fast), "settled and written");

            let (algo, runs) = choose(&process(&file), &key, &speeds, &busy);
            assert_eq!((algo, runs), (fast, 0), "a settled choice is taken without timing");
        }

        /// `--retune`: a settled choice in the cache file (one made under load, say) is timed
        /// again, and its entry replaced.
        #[test]
        fn retuning_times_a_settled_choice_again_and_replaces_it() {
            let tmp = cache_dir("tune-retune");
            let dir = tmp.path();
            let file = dir.join("autotune.json");
            let [fast, next, slow] = three();
            let speeds = [(slow, 30.0), (next, 10.5), (fast, 10.0)];
            let key = key("Vulkan|llvmpipe", Conv2dOp::BackwardInput, 8);
            remember(&file, &key, &Tuned { algo: slow, settled: true, timings: Vec::new() });
            assert_eq!(choose(&process(&file), &key, &speeds, &quiet), (slow, 0));

            let (algo, runs) = choose(&process(&file).with_retune(true), &key, &speeds, &quiet);
            assert_eq!(algo, fast);
            assert!(runs > 0, "timed although the file holds a settled choice");
            let written = load(&file).choices.remove(&key).expect("written");
            assert_eq!((written.algo, written.settled), (fast, true), "{written:?}");
            assert_eq!(written.timings.len(), speeds.len(), "{written:?}");
        }
    }
}
