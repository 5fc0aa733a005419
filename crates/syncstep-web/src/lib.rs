//! The browser face (wasm32 only): what `web/main.js` calls through wasm-bindgen.
//!
//! Every export follows one shape: an `async fn` returning `Result<JsValue, JsError>`, whose
//! value is a plain JS object parsed from the same JSON text a native face would print, and
//! whose error is a rejected promise carrying a readable `Error` message.
//! Long runs take an optional JS callback for progress. Nothing here blocks: every GPU wait is
//! an awaited map, and nothing reads a clock (`std::time::Instant` panics on wasm32); the page
//! times what it wants with `performance.now()`.
//!
//! A browser gives each adapter one device, so R replicas (and the check's single device)
//! each request an adapter of their own (`browser_devices`).
//!
//! Panics would surface in JS as an opaque `RuntimeError: unreachable`; none is expected (no
//! `unwrap` on anything a caller controls), and the hook installed by `start` prints the
//! message to the console should one happen anyway. `log` records go to the console too.
#![cfg(target_arch = "wasm32")]

use js_sys::{Function, Object, Promise, Reflect};
use serde_json::{json, Value};
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;
use wasm_bindgen_futures::JsFuture;

mod model;

use syncstep::check::{run_check_on, CheckConfig, CheckDevices, CheckProgress, Gate};
use syncstep::checkpoint::Checkpoint;
use syncstep::data::Batch;
use syncstep::golden::Golden;
use syncstep::gpu::{self, Gpu};
use syncstep::kernels::{Device, DeviceConfig};
use syncstep::model::{Arch, ResNet};
use syncstep::selfcheck::{self, Progress};
use syncstep::step::StepConfig;
use syncstep::train::{
    Keep, RunError, RunHooks, RunPlan, StepDone, TrainConfig, Trainer, TrainingRun,
};

/// Runs once when the module is instantiated: console logging (warnings and errors) and a
/// panic hook that prints the panic message before the module traps.
#[wasm_bindgen(start)]
fn start() {
    std::panic::set_hook(Box::new(|info| {
        web_sys::console::error_1(&format!("syncstep panicked: {info}").into())
    }));
    if log::set_logger(&CONSOLE).is_ok() {
        log::set_max_level(log::LevelFilter::Warn);
    }
}

/// Sets how much the library logs to the console: `off`, `error`, `warn`, `info`, `debug`
/// (pipeline compiles, devices) or `trace`.
#[wasm_bindgen]
pub fn set_log_level(level: &str) -> Result<(), JsError> {
    let filter: log::LevelFilter = level.parse().map_err(|_| {
        JsError::new(&format!(
            "unknown log level `{level}`: use off, error, warn, info, debug or trace"
        ))
    })?;
    log::set_max_level(filter);
    Ok(())
}

/// The library's version, for the page's footer and for reports.
#[wasm_bindgen]
pub fn version() -> String {
    env!("CARGO_PKG_VERSION").to_string()
}

/// The gates, as the report names them, with what each compares: `{name: meaning}` in the
/// report's order (`check::Gate`, the one table the page, the native report and the tests
/// share).
#[wasm_bindgen]
pub fn gates() -> Result<JsValue, JsError> {
    let table: serde_json::Map<String, Value> =
        Gate::ALL.iter().map(|g| (g.name().to_string(), Value::from(g.meaning()))).collect();
    parse(&Value::Object(table).to_string())
}

/// Whether this browser exposes WebGPU at all (`navigator.gpu`). It may still offer no adapter;
/// [`adapter_info`] finds that out.
#[wasm_bindgen]
pub fn has_webgpu() -> bool {
    navigator_gpu().is_some()
}

/// The adapter the kernels will run on: `backend`, `name`, the browser's own adapter strings
/// (`vendor`, `architecture`, `device`, `description`, `isFallbackAdapter` where the browser
/// reports it), the limits that decide which shapes fit, the features of interest, and
/// `parameterBytes`: the size of ResNet-34's flat parameter buffer (10 classes), which one
/// storage binding must hold.
#[wasm_bindgen]
pub async fn adapter_info() -> Result<JsValue, JsError> {
    let gpu_js = navigator_gpu().ok_or_else(no_webgpu)?;
    let instance = gpu::instance();
    let adapter = gpu::adapters(&instance).await.into_iter().next().ok_or_else(no_adapter)?;
    let info = adapter.get_info();
    let l = adapter.limits();
    let f = adapter.features();
    let browser = browser_adapter_info(&gpu_js).await?;
    let named = [
        (wgpu::Features::TIMESTAMP_QUERY, "timestamp-query"),
        (wgpu::Features::SHADER_F16, "shader-f16"),
        (wgpu::Features::SUBGROUP, "subgroups"),
    ];
    let features: Vec<&str> =
        named.iter().filter(|(x, _)| f.contains(*x)).map(|&(_, n)| n).collect();
    let report = json!({
        "backend": format!("{:?}", info.backend),
        "name": info.name,
        "deviceType": format!("{:?}", info.device_type),
        "vendor": browser.vendor,
        "architecture": browser.architecture,
        "device": browser.device,
        "description": browser.description,
        "isFallbackAdapter": browser.is_fallback,
        "limits": {
            "maxStorageBufferBindingSize": l.max_storage_buffer_binding_size,
            "maxStorageBuffersPerShaderStage": l.max_storage_buffers_per_shader_stage,
            "maxComputeWorkgroupStorageSize": l.max_compute_workgroup_storage_size,
            "maxComputeInvocationsPerWorkgroup": l.max_compute_invocations_per_workgroup,
            "maxComputeWorkgroupsPerDimension": l.max_compute_workgroups_per_dimension,
            "maxBufferSize": l.max_buffer_size,
            "minStorageBufferOffsetAlignment": l.min_storage_buffer_offset_alignment,
        },
        "features": features,
        "parameterBytes": parameter_bytes()?,
    });
    parse(&report.to_string())
}

/// Each network's flat parameter buffer in bytes at 10 classes, by `--arch` name.
fn parameter_bytes() -> Result<serde_json::Map<String, Value>, JsError> {
    Arch::ALL
        .iter()
        .map(|&a| {
            let bytes = ResNet::new(a, 10).map_err(js_error)?.param_len as u64 * 4;
            Ok((a.name().to_string(), json!(bytes)))
        })
        .collect()
}

/// Runs the kernel self-check ([`syncstep::selfcheck`]) on this browser's GPU: a few real kernels
/// at small ResNet-34 shapes against the f64 reference computed in this same wasm. Resolves to
/// `{check, adapter, seed, pass, kernels: [{kernel, shape, elements, error, tolerance, pass}]}`
/// (`error` is null where the GPU produced NaN). `on_progress`, if given, is called with
/// `{phase: "started"|"finished", index, total, kernel, result?}` around each kernel.
#[wasm_bindgen]
pub async fn kernel_selfcheck(
    seed: u32,
    on_progress: Option<Function>,
) -> Result<JsValue, JsError> {
    let gpu = device().await?;
    let mut report_progress = |p: Progress| {
        let Some(callback) = &on_progress else { return };
        let event = match p {
            Progress::Started { index, total, kernel } => {
                json!({"phase": "started", "index": index, "total": total, "kernel": kernel})
            }
            Progress::Finished { index, total, check } => json!({
                "phase": "finished",
                "index": index,
                "total": total,
                "kernel": check.kernel,
                "result": check.to_json(),
            }),
        };
        call_progress(callback, &event);
    };
    let report = selfcheck::run(&gpu, seed.into(), &mut report_progress).await.map_err(js_error)?;
    parse(&report.to_json())
}

/// The equivalence gates TEST, CONTROL, REPEAT and DRIFT (`steps` SGD steps; 0 leaves it out),
/// as `syncstep check` runs them, on `replicas` + 1 browser devices: R replicas × `batch`
/// images at `size`×`size` against one device at R·batch, 10 classes. With `golden` (the text
/// of a golden file `syncstep check --golden` wrote at the same settings) also PORTABLE.
///
/// Resolves to the report of `CheckReport::to_json`: the settings, `replica_adapters`,
/// `single_adapter`, `portable_against`, `pass`, `gates: [{gate, measured, bound, bound_kind,
/// worst_tensor, flips, note, pass}]` and `tensors: [{name, test, control, portable}]` (each
/// parameter tensor's norm-rel gradient error, model order). `on_progress`, if given, is
/// called with `{phase, index, total, gates}` as each phase starts (`gates`: those decided so
/// far, as in the report), and `index == total` when done.
#[wasm_bindgen]
#[allow(clippy::too_many_arguments)]
pub async fn run_gates(
    arch: String,
    replicas: u32,
    batch: u32,
    size: u32,
    seed: u32,
    steps: u32,
    golden: Option<String>,
    on_progress: Option<Function>,
) -> Result<JsValue, JsError> {
    let cfg = CheckConfig {
        arch: parse_arch(&arch)?,
        replicas: replicas as usize,
        batch: batch as usize,
        image_size: size,
        steps: steps as usize,
        seed: seed.into(),
        ..Default::default()
    };
    let model = cfg.model().map_err(js_error)?;
    let golden = golden.map(|text| Golden::from_json(&text)).transpose().map_err(js_error)?;
    if let Some(g) = &golden {
        g.check_fits(&cfg.golden_settings(), &model).map_err(js_error)?;
    }
    let mut gpus = browser_devices(cfg.replicas + 1, Some(&model)).await?;
    let single = gpus.pop().ok_or_else(no_adapter)?;
    let devices = CheckDevices { replicas: gpus, single, peers: Default::default() };
    let mut report_progress = |p: &CheckProgress| {
        if let Some(callback) = &on_progress {
            let event =
                json!({"phase": p.phase, "index": p.index, "total": p.total, "gates": p.gates});
            call_progress(callback, &event);
        }
    };
    let report = run_check_on(&cfg, devices, golden.as_ref(), &mut report_progress)
        .await
        .map_err(js_error)?;
    parse(&report.to_json())
}

/// A short data-parallel training run on the embedded synthetic dataset: `replicas` browser
/// devices, each taking `batch` images of every step's global batch of R·batch (BatchNorm
/// synchronised), `steps` SGD steps at learning rate `lr` from a seeded initialisation, or,
/// with `resume`, `steps` more of the checkpoint the page holds, under its own settings (the
/// library's resume: every setting is the checkpoint's but the replicas). Stopped with an
/// error should it diverge. `on_step`, if given, is called after each step with `{step, steps,
/// loss, lr}`. Resolves to `{arch, replicas, batch_per_replica, image_size, seed, from,
/// adapters, losses}` (`from`: the step it started at); the page then holds its final state.
#[wasm_bindgen]
#[allow(clippy::too_many_arguments)]
pub async fn train_demo(
    arch: String,
    replicas: u32,
    batch: u32,
    size: u32,
    steps: u32,
    seed: u32,
    lr: f32,
    resume: bool,
    on_step: Option<Function>,
) -> Result<JsValue, JsError> {
    let start = resume.then(|| model::to_resume(false)).transpose()?;
    let cfg = match &start {
        Some(ck) => resumed_config(ck, replicas)?,
        None => train_config(&arch, replicas, batch, size, seed, lr, 10)?,
    };
    let mut run = training_run(cfg, replicas, steps, None, start).await?;
    let mut page = PageRun { batches: PageBatches::Synthetic, on_step, steps, kept: None };
    let from = run.trainer.step;
    run.run(&mut page).await.map_err(run_failed)?;
    let cfg = &run.trainer.cfg;
    let report = json!({
        "arch": cfg.arch.name(),
        "replicas": replicas,
        "batch_per_replica": cfg.batch.div_ceil(replicas as usize),
        "image_size": cfg.image_size,
        "seed": cfg.seed,
        "from": from,
        "adapters": run.trainer.replicas.adapters().map_err(js_error)?,
        "losses": run.losses(),
    });
    page.keep_final()?;
    parse(&report.to_string())
}

/// A short data-parallel training run on the visitor's own images, which never leave the
/// browser: `files` is an array of `{path, bytes}` (a folder picker's files, `root/<class>/
/// <image>`), decoded and split here by the same code as `syncstep train --data DIR` (a fifth
/// of each class held out), augmented (resized-crop-flip) and normalised by their own
/// statistics. `replicas` devices take `batch` images each of every step, at learning rate
/// `lr`, stopped with an error should the run diverge; with `resume`, `steps` more of the
/// checkpoint the page holds, under its own settings, split, normalisation and augmentation,
/// on a folder of the classes it was trained on. `on_step` is called after each step with
/// `{step, steps, loss, lr}`. Resolves to `{classes, train_images, val_images, from, losses,
/// notes, predictions: [{path, label, top: [{class, probability}]}]}` with the predictions for
/// up to `shown` held-out images; the page then holds the run's final state.
#[wasm_bindgen]
#[allow(clippy::too_many_arguments)]
pub async fn train_images(
    files: js_sys::Array,
    arch: String,
    replicas: u32,
    batch: u32,
    size: u32,
    steps: u32,
    seed: u32,
    lr: f32,
    resume: bool,
    shown: u32,
    on_step: Option<Function>,
) -> Result<JsValue, JsError> {
    use syncstep::data::loader::Plan;
    use syncstep::data::schedule::Epochs;
    use syncstep::data::source::{folder_in_memory, DataSpec};
    use syncstep::data::transform::{channel_stats, Augment};
    use syncstep::train::ImageSettings;
    let start = resume.then(|| model::to_resume(true)).transpose()?;
    let files = named_files(&files)?;
    // The folder picked, as its files' paths name it: what the fingerprint is taken below.
    let root = files.first().and_then(|(path, _)| path.split('/').next()).unwrap_or_default();
    let root = std::path::PathBuf::from(root);
    let (cfg, splits) = match &start {
        Some(ck) => {
            let cfg = resumed_config(ck, replicas)?;
            let images = image_settings(&cfg)?;
            let splits = folder_in_memory(files, images.val_split, cfg.seed).map_err(js_error)?;
            let now = splits.fingerprint(&root).map_err(js_error)?;
            let problem = if splits.train.class_names != images.class_names {
                Some(format!(
                    "the folder's classes ({}) are not the ones the model was trained on ({})",
                    splits.train.class_names.join(", "),
                    images.class_names.join(", ")
                ))
            } else {
                images.fingerprint.as_ref().filter(|&then| *then != now).map(|then| {
                    format!("the folder is not the data the model was trained on: {now} now, {then} then (files added, removed, renamed, resized or relabelled)")
                })
            };
            if let Some(problem) = problem {
                return Err(JsError::new(&format!(
                    "{problem}: continue it on the data it was trained on"
                )));
            }
            (cfg, splits)
        }
        None => {
            let splits = folder_in_memory(files, 0.2, seed.into()).map_err(js_error)?;
            let norm = channel_stats(&splits.train, size, 1000).map_err(js_error)?;
            let class_names = splits.train.class_names.clone();
            let classes = class_names.len() as u32;
            let mut cfg = train_config(&arch, replicas, batch, size, seed, lr, classes)?;
            // Recorded as `train --data` records a folder, so that the run continues natively
            // on the same files (`--resume CHECKPOINT --data DIR`).
            cfg.images = Some(ImageSettings {
                data: DataSpec::Folder(root.clone()),
                fingerprint: Some(splits.fingerprint(&root).map_err(js_error)?),
                // A page's files carry no times a native resume could read back.
                file_times: None,
                val_split: 0.2,
                augment: Augment::ResizedCropFlip,
                norm,
                class_names,
            });
            (cfg, splits)
        }
    };
    let images = image_settings(&cfg)?;
    let (train, val) = (splits.train, splits.val);
    let epochs = Epochs { examples: train.len(), batch: cfg.batch, seed: cfg.seed };
    if epochs.steps_per_epoch() == 0 {
        return Err(JsError::new(&format!(
            "{} training images are fewer than one batch of {}: pick more images or use a smaller batch",
            train.len(),
            cfg.batch
        )));
    }
    let plan = Plan::Train { epochs, augment: images.augment, part: (0, cfg.batch) };
    let mut run = training_run(cfg, replicas, steps, Some(epochs), start).await?;
    let from = run.trainer.step;
    let batches = PageBatches::Images { train: &train, plan, norm: images.norm };
    let mut page = PageRun { batches, on_step, steps, kept: None };
    run.run(&mut page).await.map_err(run_failed)?;
    let class_names = &images.class_names;
    let shown = shown as usize;
    let predictions = predictions(&mut run.trainer, &val, &images.norm, class_names, shown).await?;
    let cfg = &run.trainer.cfg;
    let report = json!({
        "arch": cfg.arch.name(),
        "classes": class_names,
        "train_images": train.len(),
        "val_images": val.len(),
        "replicas": replicas,
        "batch_per_replica": cfg.batch.div_ceil(replicas as usize),
        "image_size": cfg.image_size,
        "from": from,
        "adapters": run.trainer.replicas.adapters().map_err(js_error)?,
        "losses": run.losses(),
        "notes": splits.notes,
        "predictions": predictions,
    });
    page.keep_final()?;
    parse(&report.to_string())
}

/// The image settings of a run on images.
fn image_settings(cfg: &TrainConfig) -> Result<syncstep::train::ImageSettings, JsError> {
    cfg.images
        .clone()
        .ok_or_else(|| JsError::new("internal error: a run on images without its image settings"))
}

/// A resumed run's settings: the checkpoint's, every one (as `train --resume` keeps them),
/// shared by `replicas` devices.
fn resumed_config(ck: &Checkpoint, replicas: u32) -> Result<TrainConfig, JsError> {
    let cfg = ck.settings.clone();
    if replicas == 0 || cfg.batch < replicas as usize {
        return Err(JsError::new(&format!(
            "the model's run takes a global batch of {} images, which {replicas} replicas cannot share: choose at most {} replicas",
            cfg.batch, cfg.batch
        )));
    }
    Ok(cfg)
}

/// A page run's settings: `replicas` × `batch` images of `size`² a step, at base rate `lr`.
fn train_config(
    arch: &str,
    replicas: u32,
    batch: u32,
    size: u32,
    seed: u32,
    lr: f32,
    classes: u32,
) -> Result<TrainConfig, JsError> {
    if replicas == 0 || batch == 0 {
        return Err(JsError::new("training needs at least 1 replica and 1 image per replica"));
    }
    let defaults = TrainConfig::default();
    Ok(TrainConfig {
        arch: parse_arch(arch)?,
        batch: (replicas * batch) as usize,
        image_size: size,
        classes,
        seed: seed.into(),
        step: StepConfig { lr, ..defaults.step },
        ..defaults
    })
}

/// A run of `cfg` for `steps` steps on `replicas` browser devices: fresh, or from `start`.
async fn training_run(
    cfg: TrainConfig,
    replicas: u32,
    steps: u32,
    epochs: Option<syncstep::data::schedule::Epochs>,
    start: Option<Checkpoint>,
) -> Result<TrainingRun, JsError> {
    ResNet::check_image_size(cfg.image_size, cfg.image_size).map_err(js_error)?;
    let model = ResNet::new(cfg.arch, cfg.classes).map_err(js_error)?;
    let gpus = browser_devices(replicas as usize, Some(&model)).await?;
    let last = start.as_ref().map_or(0, |ck| ck.step) + u64::from(steps);
    let trainer = Trainer::data_parallel(gpus, cfg, start).map_err(js_error)?;
    // Checkpoints are not kept as the run goes: the page holds its final state.
    let plan = RunPlan { last, checkpoint_every: 0, epochs };
    Ok(TrainingRun::new(trainer, plan))
}

/// Where a page run's batches come from.
enum PageBatches<'a> {
    /// The synthetic dataset's own batch of each step.
    Synthetic,
    /// The visitor's images, made on this thread as the CLI's loader makes them.
    Images {
        train: &'a syncstep::data::source::Dataset,
        plan: syncstep::data::loader::Plan,
        norm: syncstep::data::transform::Normalization,
    },
}

/// The page's face of a training run: its batches, each step told to `on_step`, and its
/// final state.
struct PageRun<'a> {
    batches: PageBatches<'a>,
    on_step: Option<Function>,
    steps: u32,
    kept: Option<Checkpoint>,
}

impl PageRun<'_> {
    /// Hands the run's final state to the page's model.
    fn keep_final(&mut self) -> Result<(), JsError> {
        let ck = self
            .kept
            .take()
            .ok_or_else(|| JsError::new("internal error: the run ended without its final state"))?;
        model::keep_trained(ck);
        Ok(())
    }
}

impl RunHooks for PageRun<'_> {
    type Error = JsError;

    fn batch(&mut self, trainer: &Trainer) -> Result<Batch, JsError> {
        let step = trainer.step;
        match &self.batches {
            PageBatches::Synthetic => trainer.batch_of_step(step).map_err(js_error),
            PageBatches::Images { train, plan, norm } => {
                let size = trainer.cfg.image_size;
                syncstep::data::loader::batch(train, plan, size, norm, step).map_err(js_error)
            }
        }
    }

    fn keep(&mut self, _trainer: &Trainer, ck: &Checkpoint, why: Keep) -> Result<(), JsError> {
        if why == Keep::Final {
            self.kept = Some(ck.clone());
        }
        Ok(())
    }

    fn stepped(&mut self, _trainer: &Trainer, done: &StepDone) -> Result<(), JsError> {
        if let Some(callback) = &self.on_step {
            let (step, steps, loss, lr) = (done.step, self.steps, done.loss, done.lr);
            call_progress(callback, &json!({"step": step, "steps": steps, "loss": loss, "lr": lr}));
        }
        Ok(())
    }
}

/// A page run's early end, as the page says it.
fn run_failed(e: RunError<JsError>) -> JsError {
    match e {
        RunError::Diverged(d) => js_error(format!("{d}; lower the learning rate")),
        RunError::Parallel(e) => js_error(e),
        RunError::Face(e) => e,
    }
}

/// The `{path, bytes}` objects of `files`, as (path, bytes).
fn named_files(files: &js_sys::Array) -> Result<Vec<(String, Vec<u8>)>, JsError> {
    let mut named = Vec::with_capacity(files.length() as usize);
    for file in files.iter() {
        let field =
            |key: &str| Reflect::get(&file, &key.into()).map_err(|e| js_error(describe_js(&e)));
        let path =
            field("path")?.as_string().ok_or_else(|| JsError::new("a file without a path"))?;
        let bytes = js_sys::Uint8Array::new(&field("bytes")?).to_vec();
        named.push((path, bytes));
    }
    Ok(named)
}

/// The three likeliest of `class_names` for each of the first `shown` images of `val`
/// (normalised by `norm`), by `trainer` (eval-mode), each `{path, label, top: [{class,
/// probability}]}`.
async fn predictions(
    trainer: &mut Trainer,
    val: &syncstep::data::source::Dataset,
    norm: &syncstep::data::transform::Normalization,
    class_names: &[String],
    shown: usize,
) -> Result<Vec<Value>, JsError> {
    use syncstep::classify::{top_classes, Classifier};
    use syncstep::data::transform::Preprocess;

    let classifier =
        Classifier { cfg: trainer.cfg.clone(), torchvision: false, preprocess: Preprocess::Square };
    let shown = val.len().min(shown);
    let mut inputs = Vec::with_capacity(shown);
    for i in 0..shown {
        inputs.push(classifier.input(&val.decode(i).map_err(js_error)?, norm));
    }
    let ranked = top_classes(trainer, &inputs, 3).await.map_err(js_error)?;
    let predictions = ranked
        .into_iter()
        .enumerate()
        .map(|(i, top)| {
            let top: Vec<Value> = top
                .into_iter()
                .map(|(c, p)| json!({"class": class_names[c], "probability": p}))
                .collect();
            json!({"path": val.name(i), "label": class_names[val.label(i) as usize], "top": top})
        })
        .collect();
    Ok(predictions)
}

/// A device on the browser's (first) adapter with the adapter's own limits.
async fn device() -> Result<Device, JsError> {
    Ok(browser_devices(1, None).await?.swap_remove(0))
}

/// `count` devices, each on an adapter of its own (a browser gives an adapter one device),
/// with the adapter's own limits; refused up front, with the reason, when an adapter cannot
/// hold `model`'s flat parameter buffer in one storage binding. wgpu leaves a browser
/// adapter's name empty, so the devices are named by what the browser says of its adapter.
/// They share one default kernel policy: the guess without a clock on CPU adapters, the GPU
/// plan on GPUs.
async fn browser_devices(count: usize, model: Option<&ResNet>) -> Result<Vec<Device>, JsError> {
    let config = DeviceConfig::default();
    let gpu_js = navigator_gpu().ok_or_else(no_webgpu)?;
    let name = browser_adapter_info(&gpu_js).await?.name();
    let instance = gpu::instance();
    let mut devices = Vec::with_capacity(count);
    for r in 0..count {
        let Some(adapter) = gpu::adapters(&instance).await.into_iter().next() else {
            return Err(if r == 0 {
                no_adapter()
            } else {
                JsError::new(&format!(
                    "this run needs {count} GPU adapters (a browser gives each adapter one device: one per replica, plus one for \
                     the single-device side of the check), but the browser offered only {r}: choose fewer replicas"
                ))
            });
        };
        // The optimizer binds the flat parameter buffer in parts; the buffer itself must fit.
        let allowed = adapter.limits().max_buffer_size;
        if let Some(model) = model.filter(|m| allowed < m.param_len as u64 * 4) {
            use syncstep::host::{format_bytes, ByteScale};
            return Err(JsError::new(&format!(
                "this GPU adapter allows buffers of at most {} (maxBufferSize), but {}'s flat parameter buffer ({} \
                 classes) is {}: choose a smaller network, or try another browser or GPU",
                format_bytes(allowed, ByteScale::Fit),
                model.arch.title(),
                model.classes,
                format_bytes(model.param_len as u64 * 4, ByteScale::Fit)
            )));
        }
        let mut device = Gpu::from_adapter(&adapter).await.map_err(js_error)?;
        if device.info.name.is_empty() {
            device.info.name = name.clone();
        }
        devices.push(Device::new(device, &config));
    }
    Ok(devices)
}

/// `--arch`'s value from the page: `resnet18`, `resnet34`, `resnet50` or `resnet101`.
fn parse_arch(arch: &str) -> Result<Arch, JsError> {
    arch.parse().map_err(|e: syncstep::model::UnknownArch| JsError::new(&e.to_string()))
}

/// Calls the page's progress callback; a callback that throws is logged, not fatal.
fn call_progress(callback: &Function, event: &Value) {
    let result = js_sys::JSON::parse(&event.to_string())
        .and_then(|event| callback.call1(&JsValue::NULL, &event));
    if let Err(e) = result {
        log::warn!("progress callback failed: {}", describe_js(&e));
    }
}

fn js_error(e: impl std::fmt::Display) -> JsError {
    JsError::new(&e.to_string())
}

fn no_webgpu() -> JsError {
    JsError::new(
        "this browser has no WebGPU (navigator.gpu is missing): use a current Chrome, Edge or other Chromium browser, \
         Safari 26+, or Firefox 141+ on Windows; on Linux start Chromium with --enable-unsafe-webgpu",
    )
}

fn no_adapter() -> JsError {
    JsError::new(
        "this browser has WebGPU but offered no adapter: the GPU may be blocklisted or hardware acceleration off \
         (see chrome://gpu); on Linux start Chromium with --enable-unsafe-webgpu (and --enable-features=Vulkan)",
    )
}

/// Parses a report's JSON text into a JS object.
fn parse(json_text: &str) -> Result<JsValue, JsError> {
    js_sys::JSON::parse(json_text).map_err(|e| {
        JsError::new(&format!("internal error: report is not JSON ({})", describe_js(&e)))
    })
}

/// A thrown JS value as text: an Error's message, or its string form.
fn describe_js(v: &JsValue) -> String {
    if let Some(e) = v.dyn_ref::<js_sys::Error>() {
        return String::from(e.message());
    }
    v.as_string().unwrap_or_else(|| format!("{v:?}"))
}

/// `navigator.gpu` in a window or a worker, if defined.
fn navigator_gpu() -> Option<JsValue> {
    let navigator =
        Reflect::get(&js_sys::global(), &"navigator".into()).ok().filter(|v| v.is_object())?;
    Reflect::get(&navigator, &"gpu".into()).ok().filter(|v| v.is_object())
}

/// What the browser says about its adapter (`GPUAdapterInfo`), which wgpu does not pass on.
struct BrowserAdapterInfo {
    vendor: String,
    architecture: String,
    device: String,
    description: String,
    is_fallback: Option<bool>,
}

impl BrowserAdapterInfo {
    /// "google swiftshader": the description, else vendor, architecture and device.
    fn name(&self) -> String {
        if !self.description.is_empty() {
            return self.description.clone();
        }
        let parts: Vec<&str> = [&self.vendor, &self.architecture, &self.device]
            .into_iter()
            .map(String::as_str)
            .filter(|s| !s.is_empty())
            .collect();
        if parts.is_empty() {
            "WebGPU adapter".into()
        } else {
            parts.join(" ")
        }
    }
}

async fn browser_adapter_info(gpu_js: &JsValue) -> Result<BrowserAdapterInfo, JsError> {
    let js = |e: JsValue| {
        JsError::new(&format!("navigator.gpu.requestAdapter failed: {}", describe_js(&e)))
    };
    let request: Function = Reflect::get(gpu_js, &"requestAdapter".into())
        .map_err(js)?
        .dyn_into()
        .map_err(|_| JsError::new("navigator.gpu.requestAdapter is not a function"))?;
    let options = Object::new();
    Reflect::set(&options, &"powerPreference".into(), &"high-performance".into()).map_err(js)?;
    let promise: Promise = request.call1(gpu_js, &options).map_err(js)?.dyn_into().map_err(js)?;
    let adapter = JsFuture::from(promise).await.map_err(js)?;
    if !adapter.is_object() {
        return Err(no_adapter());
    }
    let info = Reflect::get(&adapter, &"info".into()).unwrap_or(JsValue::UNDEFINED);
    let text = |key: &str| {
        Reflect::get(&info, &key.into()).ok().and_then(|v| v.as_string()).unwrap_or_default()
    };
    let flag = |obj: &JsValue| {
        Reflect::get(obj, &"isFallbackAdapter".into()).ok().and_then(|v| v.as_bool())
    };
    Ok(BrowserAdapterInfo {
        vendor: text("vendor"),
        architecture: text("architecture"),
        device: text("device"),
        description: text("description"),
        is_fallback: flag(&info).or_else(|| flag(&adapter)),
    })
}

/// Sends `log` records to the browser console.
struct ConsoleLogger;

static CONSOLE: ConsoleLogger = ConsoleLogger;

impl log::Log for ConsoleLogger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let line: JsValue = format!("[syncstep {}] {}", record.target(), record.args()).into();
        match record.level() {
            log::Level::Error => web_sys::console::error_1(&line),
            log::Level::Warn => web_sys::console::warn_1(&line),
            log::Level::Info => web_sys::console::info_1(&line),
            log::Level::Debug | log::Level::Trace => web_sys::console::debug_1(&line),
        }
    }

    fn flush(&self) {}
}
